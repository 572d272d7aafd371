"""The fixtures every test module may use, and the layout of tests/.

The tests mirror the rooms of the code: a test file about one room lives under that room's
path (tests/tasks/ for tasks/, tests/verifier/passes/ for verifier/passes/, tests/verifier/ for
the verifier as a whole), and a test that spans rooms (end to end, the documents, the
architecture, fuzzing, soundness, differential and mutation testing, the benchmarks' smoke
runs) stays at the top of tests/, named by its subject. The helpers the tests share (budget.py,
adversaries.py, documents.py, repository.py, data/) stay at the top too; setup.cfg puts tests/
on the import path, and test modules' names are unique (pytest imports them by name).
"""

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
