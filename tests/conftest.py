from __future__ import annotations

import pytest

from tasks.model import Task, TaskSet


def capitals() -> TaskSet:
    """Three tasks, shared entities, shared prefixes ('the', '⋆1 ...'), an object that is a subject elsewhere."""
    return TaskSet((
        Task("capital", ("the capital of ⋆1 is ⋆2", "⋆1 has capital ⋆2"),
             {"France": "Paris", "Germany": "Berlin", "Japan": "Tokyo", "Italy": "Rome"}),
        Task("continent", ("the continent of ⋆1 is ⋆2", "⋆1 lies in ⋆2"),
             {"France": "Europe", "Germany": "Europe", "Japan": "Asia", "Brazil": "South America"}),
        Task("located", ("⋆1 is a city in ⋆2",),
             {"Paris": "France", "Berlin": "Germany", "Tokyo": "Japan", "Rome": "Italy", "São Paulo": "Brazil"}),
    ), epsilon=0.01)


@pytest.fixture(scope="session")
def capitals_set() -> TaskSet:
    return capitals()


@pytest.fixture(scope="session")
def capitals_model(capitals_set):
    from construction.model import build

    return build(capitals_set)
