"""The public hypothesis strategies produce what they promise."""

from __future__ import annotations

from typing import Callable

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from budget import examples

from tasks import SUBJECT, StructureTrie, TaskSet, Template, object_query_collisions
from tasks.model import SLOT_SPELLINGS, check_name
from tasks.strategies import entity_names, ill_posed_task_sets, shared_template_task_sets, task_sets, templates, words
from tasks.structure import check_routable

FAST = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def sample(strategy: st.SearchStrategy, n: int = 200) -> list:
    """``n`` examples, reproducibly (derandomized), without shrinking."""
    out: list = []

    @settings(max_examples=n, phases=[Phase.generate], derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example) -> None:
        out.append(example)

    collect()
    return out


@pytest.fixture(scope="module")
def generated() -> list[TaskSet]:
    return sample(task_sets())


@FAST
@given(words())
def test_words_are_template_words(word: str) -> None:
    assert word and not any(c.isspace() for c in word) and word not in SLOT_SPELLINGS
    assert Template.parse(f"{word} ⋆1 ⋆2").parts[0] == word


@FAST
@given(entity_names())
def test_entity_names_pass_check_name_unchanged(name: str) -> None:
    assert check_name(name, "entity") == name
    assert "\t" not in name and "\n" not in name


def test_entity_names_may_have_spaces() -> None:
    assert any(" " in e for e in sample(entity_names(), 100))


@FAST
@given(templates(max_length=5))
def test_templates_are_valid(template: Template) -> None:
    assert 2 <= template.length <= 5
    assert template.subject_index < template.object_index
    assert Template.parse(template.text()) == template


@FAST
@given(task_sets(min_tasks=2, max_tasks=3, max_templates=2, max_facts=3, max_template_length=4))
def test_task_set_sizes(taskset: TaskSet) -> None:
    assert 2 <= len(taskset) <= 3
    assert all(1 <= t.n_templates <= 2 and 1 <= t.n_facts <= 3 for t in taskset)
    assert taskset.L <= 4


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        task_sets(max_template_length=2)
    with pytest.raises(ValueError):
        task_sets(min_tasks=3, max_tasks=2)


# --- each promised feature is produced ------------------------------------------------


def _shared_subject(ts: TaskSet) -> bool:
    subjects = [set(t.facts.subjects) for t in ts]
    return any(a & b for i, a in enumerate(subjects) for b in subjects[i + 1:])


def _object_is_subject_elsewhere(ts: TaskSet) -> bool:
    return any(set(a.facts.objects) & set(b.facts.subjects) for a in ts for b in ts if a is not b)


def _starts_with_subject(ts: TaskSet) -> bool:
    return any(t.parts[0] is SUBJECT for task in ts for t in task.templates)


def _starts_with_word(ts: TaskSet) -> bool:
    return any(t.parts[0] is not SUBJECT for task in ts for t in task.templates)


def _several_templates(ts: TaskSet) -> bool:
    return any(t.n_templates > 1 for t in ts)


def _shared_prefix_with_subject(ts: TaskSet) -> bool:
    return any(len(node.tasks) > 1 and node.has_subject for node in StructureTrie(ts))


def _shared_word_prefix(ts: TaskSet) -> bool:
    return any(len(node.tasks) > 1 and not node.has_subject for node in StructureTrie(ts))


def _entity_with_space(ts: TaskSet) -> bool:
    return any(" " in e for e in ts.vocabulary.entities)


@pytest.mark.parametrize(
    "feature, share",
    [(_shared_subject, 0.3), (_object_is_subject_elsewhere, 0.3), (_starts_with_subject, 0.3),
     (_starts_with_word, 0.3), (_several_templates, 0.3), (_shared_prefix_with_subject, 0.3),
     (_shared_word_prefix, 0.05), (_entity_with_space, 0.05)],
)
def test_task_sets_produce(generated: list[TaskSet], feature: Callable[[TaskSet], bool], share: float) -> None:
    """Each feature appears in a decent share of examples (measured: see the report)."""
    assert sum(map(feature, generated)) >= share * len(generated)


def test_structural_collisions_only_when_allowed(generated: list[TaskSet]) -> None:
    assert not any(object_query_collisions(StructureTrie(ts), structural=True) for ts in generated)
    allowed = sample(task_sets(allow_structural_collisions=True), 100)
    found = [c for ts in allowed for c in object_query_collisions(StructureTrie(ts), structural=True)]
    assert len(found) >= 10
    assert all(c.subject is None for c in found)


@FAST
@given(ill_posed_task_sets(max_tasks=2))
def test_ill_posed_sets_construct(tasks: tuple) -> None:
    taskset = TaskSet(tasks)
    assert object_query_collisions(StructureTrie(taskset))


def test_strategies_accept_a_user_word_pool() -> None:
    made = sample(templates(words=st.sampled_from(["the", "of"]), max_length=4), 50)
    assert all(set(t.words) <= {"the", "of"} for t in made)
    assert any(t.length == 4 for t in made)


# --- shared templates ------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared() -> list[TaskSet]:
    return sample(shared_template_task_sets(), 150)


def _sharing_counts(ts: TaskSet) -> list[int]:
    """For each template text used by several tasks, how many tasks use it."""
    users: dict = {}
    for task in ts:
        for t in task.templates:
            users.setdefault(t.parts, set()).add(task.name)
    return [len(u) for u in users.values() if len(u) > 1]


def test_shared_template_sets_are_well_posed_and_share(shared: list[TaskSet]) -> None:
    for ts in shared:
        check_routable(ts)                                   # no object query shared with a shared subject
        counts = _sharing_counts(ts)
        assert counts and all(2 <= c <= 10 for c in counts)   # two unmarked groups may draw the same text
        assert object_query_collisions(StructureTrie(ts), structural=True)
    assert {c for ts in shared for c in _sharing_counts(ts)} >= {2, 3, 4, 5}


def _sharers_chain(ts: TaskSet) -> bool:
    """An object of one task is a subject of another task with the same template text."""
    return any(set(a.facts.objects) & set(b.facts.subjects) for a in ts for b in ts
               if a is not b and set(a.templates) & set(b.templates))


def _word_after_object(ts: TaskSet) -> bool:
    return any(t.object_index < t.length - 1 for task in ts for t in task.templates)


def _non_ascii_entity(ts: TaskSet) -> bool:
    return any(not e.isascii() for e in ts.vocabulary.entities)


@pytest.mark.parametrize("feature, share", [(_sharers_chain, 0.5), (_word_after_object, 0.3),
                                            (_non_ascii_entity, 0.5), (_starts_with_word, 0.3),
                                            (_starts_with_subject, 0.3)])
def test_shared_template_sets_produce(shared: list[TaskSet], feature, share: float) -> None:
    assert sum(map(feature, shared)) >= share * len(shared)


def test_shared_template_bad_arguments() -> None:
    with pytest.raises(ValueError):
        shared_template_task_sets(min_sharing=1)
