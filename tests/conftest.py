from __future__ import annotations

import pytest

from tasks.model import TaskSet


def capitals() -> TaskSet:
    """Three tasks, shared entities, shared prefixes ('the', '⋆1 ...'), an object that is a subject elsewhere.

    The same set as examples/capitals.yaml; defined once, in audit.mutants.small_sets.
    """
    from audit.mutants import small_sets

    return small_sets()["capitals"]


@pytest.fixture(scope="session")
def capitals_set() -> TaskSet:
    return capitals()


@pytest.fixture(scope="session")
def capitals_model(capitals_set):
    from construction.model import build

    return build(capitals_set)
