"""The discrete knowledge model: its rules, its sizes, and query enumeration.

Every rule of :mod:`tasks.model` is shown to fail when broken; query enumeration
(:mod:`tasks.queries`) and :func:`~tasks.structure.open_tasks` are checked against a
brute-force enumeration from the dataset sentences on generated task sets; and the
synthetic WikiData-shaped generator is checked for its promised shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

from tasks import (
    OBJECT,
    SUBJECT,
    Facts,
    StructureTrie,
    Task,
    TaskError,
    TaskSet,
    Template,
    check_routable,
    count_queries,
    iter_queries,
    object_query_collisions,
    open_tasks,
)
from tasks.strategies import ill_posed_task_sets, task_sets
from tasks.synthetic import default_n_tasks, wikidata_like, zipf_sizes

PROPERTY = settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def task(name: str, templates: list[str], facts: dict[str, str]) -> Task:
    return Task(name, tuple(templates), Facts(facts))


# --- rules: each one fails when broken ------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ("the capital of is *2", "has no subject slot"),
        ("the capital of ⋆1 is", "has no object slot"),
        ("⋆1 and ⋆1 are ⋆2", "has 2 subject slot"),
        ("⋆1 is ⋆2 or ⋆2", "has 2 object slot"),
        ("⋆2 is the capital of ⋆1", "⋆2 before ⋆1"),
        ("", "empty"),
        ("   ", "empty"),
    ],
)
def test_template_rules(text: str, message: str) -> None:
    with pytest.raises(TaskError, match=re.escape(message)):
        Template.parse(text)


@pytest.mark.parametrize(
    "parts",
    [
        ("two words", SUBJECT, OBJECT),
        ("", SUBJECT, OBJECT),
        ("tab\there", SUBJECT, OBJECT),
        (3, SUBJECT, OBJECT),
    ],
)
def test_template_bad_words(parts: tuple) -> None:
    with pytest.raises(TaskError, match="bad word"):
        Template(parts)


def test_template_empty_and_not_a_string() -> None:
    with pytest.raises(TaskError, match="empty"):
        Template(())
    with pytest.raises(TaskError, match="not a string"):
        Template.parse(12)


def test_template_parse_accepts_both_spellings() -> None:
    t = Template.parse("the capital of *1 is ⋆2")
    assert t.parts == ("the", "capital", "of", SUBJECT, "is", OBJECT)
    assert (t.length, t.subject_index, t.object_index) == (6, 3, 5)
    assert t.fill("France", "Paris") == ("the", "capital", "of", "France", "is", "Paris")
    assert Template.parse(t.text(ascii=True)) == t


def test_task_rules() -> None:
    with pytest.raises(TaskError, match="has no templates"):
        task("capital", [], {"France": "Paris"})
    with pytest.raises(TaskError, match="lists template '⋆1 is ⋆2' twice"):
        task("capital", ["⋆1 is ⋆2", "*1 is *2"], {"France": "Paris"})
    with pytest.raises(TaskError, match="empty dictionary"):
        task("capital", ["⋆1 is ⋆2"], {})
    with pytest.raises(TaskError, match="task name is empty"):
        task("  ", ["⋆1 is ⋆2"], {"France": "Paris"})


def test_subject_with_two_objects() -> None:
    with pytest.raises(TaskError, match="subject 'France' has two objects, 'Paris' and 'Lyon'"):
        Facts([("France", "Paris"), ("France", "Lyon")])
    with pytest.raises(TaskError, match="two objects"):
        Task("capital", ("⋆1 is ⋆2",), [("France", "Paris"), ("France", "Lyon")])
    # The same fact twice is harmless and kept once.
    assert len(Facts([("France", "Paris"), ("France", "Paris")])) == 1


@pytest.mark.parametrize(
    "name, message",
    [("", "is empty"), ("New\tYork", "tab or line break"), ("a\nb", "tab or line break"), ("*1", "slot marker"),
     ("⋆2", "slot marker"), (7, "not a string")],
)
def test_entity_name_rules(name: object, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        Facts([(name, "Paris")])
    with pytest.raises(TaskError, match=message):
        Facts([("France", name)])


def test_entity_names_are_stripped_and_may_have_spaces() -> None:
    facts = Facts([("  New York City ", "USA")])
    assert facts.subjects == ("New York City",)
    assert facts["New York City"] == "USA"


def test_task_set_rules() -> None:
    capital = task("capital", ["⋆1 is ⋆2"], {"France": "Paris"})
    with pytest.raises(TaskError, match="no tasks"):
        TaskSet(())
    with pytest.raises(TaskError, match="two tasks are named 'capital'"):
        TaskSet((capital, task("capital", ["⋆1 has ⋆2"], {"Spain": "Madrid"})))
    clash = task("word", ["⋆1 of is ⋆2"], {"of": "Paris"})
    with pytest.raises(TaskError, match="token 'of' is a word of template '⋆1 of is ⋆2'.*also the subject"):
        TaskSet((clash,))
    with pytest.raises(TaskError, match="token 'is' is a word .* task 'capital' and also the object"):
        TaskSet((capital, task("other", ["⋆1 has ⋆2"], {"Spain": "is"})))


@pytest.mark.parametrize("epsilon", [0, 1, -0.1, 1.5])
def test_epsilon_out_of_range(epsilon: float) -> None:
    with pytest.raises(TaskError, match="epsilon"):
        TaskSet((task("capital", ["⋆1 is ⋆2"], {"France": "Paris"}),), epsilon=epsilon)


def test_epsilon_in_range() -> None:
    assert TaskSet((task("capital", ["⋆1 is ⋆2"], {"France": "Paris"}),), epsilon=0.01).epsilon == 0.01


def test_error_is_one_line_with_file_and_line() -> None:
    err = TaskError("subject 'a'\nhas two objects", fix="keep one").located("tasks.yaml", 12)
    assert str(err) == "tasks.yaml:12: subject 'a' has two objects; keep one"


# --- routability ----------------------------------------------------------------------


def colliding_tasks(shared_subject: bool) -> TaskSet:
    capital = task("capital", ["the capital of ⋆1 is ⋆2"], {"France": "Paris", "Spain": "Madrid"})
    kind = task("kind", ["the capital of ⋆1 is a ⋆2"], {"France" if shared_subject else "Peru": "city"})
    return TaskSet((capital, kind))


def test_check_routable_names_both_templates_and_the_prefix() -> None:
    taskset = colliding_tasks(shared_subject=True)
    with pytest.raises(TaskError) as info:
        check_routable(taskset)
    message = str(info.value)
    assert "template 'the capital of ⋆1 is ⋆2' of task 'capital'" in message
    assert "template 'the capital of ⋆1 is a ⋆2' of task 'kind'" in message
    assert "share the object-query prefix 'the capital of France is'" in message
    assert "\n" not in message
    assert info.value.refs == [(0, 0), (1, 0)]


def test_structural_collision_without_shared_subject_is_routable() -> None:
    taskset = colliding_tasks(shared_subject=False)
    check_routable(taskset)
    trie = StructureTrie(taskset)
    assert object_query_collisions(trie) == []
    (collision,) = object_query_collisions(trie, structural=True)
    assert collision.subject is None and collision.n_shared_subjects == 0
    assert collision.structure == "the capital of ⋆1 is"


def test_two_object_queries_on_one_prefix_are_reported_once() -> None:
    a = task("a", ["⋆1 is ⋆2"], {"x": "y"})
    b = task("b", ["⋆1 is ⋆2"], {"x": "z"})
    collisions = object_query_collisions(StructureTrie(TaskSet((a, b))))
    assert len(collisions) == 1
    with pytest.raises(TaskError, match="share the object-query prefix 'x is'"):
        check_routable(TaskSet((a, b)))


# --- sizes: L, |T(k)|, N_k, c(k) ------------------------------------------------------


def test_sizes_and_complexity_by_hand() -> None:
    capital = task(
        "capital",
        ["the capital of ⋆1 is ⋆2", "⋆1 has capital ⋆2"],
        {"France": "Paris", "Spain": "Madrid", "Japan": "Tokyo"},
    )
    language = task("language", ["people in ⋆1 speak ⋆2"], {"France": "French", "Spain": "Spanish"})
    taskset = TaskSet((capital, language))
    assert taskset.L == 6
    assert [t.n_templates for t in taskset] == [2, 1]
    assert [t.n_facts for t in taskset] == [3, 2]
    assert taskset.n_facts == 5
    assert [taskset.complexity(k) for k in range(2)] == [6 * 2 + 3, 6 * 1 + 2]
    # Queries by hand: 5 subject-free prefixes ('the', 'the capital', 'the capital of',
    # 'people', 'people in'), 5 capital structures with ⋆1 ('the capital of ⋆1',
    # '... ⋆1 is', '⋆1', '⋆1 has', '⋆1 has capital') times 3 subjects, and 2 language
    # structures with ⋆1 times 2 subjects.
    assert count_queries(taskset) == 5 + 5 * 3 + 2 * 2
    assert taskset.without("capital").names == ("language",)


# --- vocabulary -----------------------------------------------------------------------


def reordered(taskset: TaskSet, data: st.DataObject) -> TaskSet:
    """The same task set with tasks, templates and facts in a drawn order."""
    tasks = []
    for t in data.draw(st.permutations(taskset.tasks)):
        facts = data.draw(st.permutations(list(t.facts.items())))
        tasks.append(Task(t.name, tuple(data.draw(st.permutations(t.templates))), Facts(facts)))
    return TaskSet(tuple(tasks))


@PROPERTY
@given(task_sets(), st.data())
def test_vocabulary_ids_do_not_depend_on_order(taskset: TaskSet, data: st.DataObject) -> None:
    other = reordered(taskset, data)
    assert other.vocabulary == taskset.vocabulary
    assert list(other.vocabulary.words) == sorted(other.vocabulary.words)
    assert list(other.vocabulary.entities) == sorted(other.vocabulary.entities)
    for k, t in enumerate(taskset.tasks):
        j = other.index(t.name)
        s1, o1 = taskset.fact_ids[k]
        s2, o2 = other.fact_ids[j]
        assert np.array_equal(s1, s2) and np.array_equal(o1, o2)


def test_vocabulary_layout() -> None:
    taskset = colliding_tasks(shared_subject=True)
    vocab = taskset.vocabulary
    assert vocab.words == ("a", "capital", "is", "of", "the")
    assert vocab.entities == ("France", "Madrid", "Paris", "Spain", "city")
    assert vocab.id("France") == 5 and vocab.is_entity(5) and not vocab.is_entity(4)
    with pytest.raises(TaskError, match="unknown token"):
        vocab.id("Berlin")


# --- query enumeration against brute force --------------------------------------------


@dataclass
class Expected:
    """What brute force says about one prefix."""

    valid: set[str] = field(default_factory=set)
    tasks: set[int] = field(default_factory=set)
    object_query: bool = False
    templates: set[tuple[int, str]] = field(default_factory=set)


def brute_force(taskset: TaskSet) -> dict[tuple[str, ...], Expected]:
    """Every proper prefix of every sentence, from the sentences alone."""
    out: dict[tuple[str, ...], Expected] = {}
    for sentence, k, template, _subject in taskset.sentences():
        for n in range(1, len(sentence)):
            e = out.setdefault(sentence[:n], Expected())
            e.valid.add(sentence[n])
            e.tasks.add(k)
            e.object_query |= template.parts[n] is OBJECT
            e.templates.add((k, str(template)))
    return out


def consistent_by_brute_force(taskset: TaskSet, prefix: tuple[str, ...]) -> tuple[str, ...]:
    """Names of the tasks with a sentence of which ``prefix`` is a proper prefix."""
    n = len(prefix)
    ks = {k for sentence, k, _, _ in taskset.sentences() if len(sentence) > n and sentence[:n] == prefix}
    return tuple(taskset.names[k] for k in sorted(ks))


@PROPERTY
@given(task_sets(allow_structural_collisions=True))
def test_iter_queries_matches_brute_force(taskset: TaskSet) -> None:
    check_queries_against_brute_force(taskset)


@PROPERTY
@given(ill_posed_task_sets())
def test_iter_queries_matches_brute_force_on_ill_posed_sets(tasks: tuple[Task, ...]) -> None:
    # Enumeration does not assume routability: here prefixes past ⋆2 are shared by tasks.
    check_queries_against_brute_force(TaskSet(tasks))


def check_queries_against_brute_force(taskset: TaskSet) -> None:
    expected = brute_force(taskset)
    queries = list(iter_queries(taskset))
    prefixes = [q.prefix for q in queries]
    assert len(prefixes) == len(set(prefixes)), "a prefix is enumerated twice"
    assert set(prefixes) == set(expected)
    names = taskset.names
    for q in queries:
        e = expected[q.prefix]
        assert q.valid == e.valid, q.prefix
        assert q.tasks == tuple(names[k] for k in sorted(e.tasks)), q.prefix
        assert q.determined == (names[next(iter(e.tasks))] if len(e.tasks) == 1 else None), q.prefix
        assert q.object_query == e.object_query, q.prefix
        assert (taskset.index(q.witness[0]), q.witness[1]) in e.templates, q.prefix
    assert count_queries(taskset) == len(expected)


@st.composite
def task_set_and_prefixes(draw: st.DrawFn) -> tuple[TaskSet, list[tuple[str, ...]]]:
    """A task set and prefixes: sentence prefixes, some with an entity swapped or a token added."""
    taskset = draw(task_sets(allow_structural_collisions=True))
    sentences = [s for s, _, _, _ in taskset.sentences()]
    tokens = taskset.vocabulary.tokens
    entities = taskset.vocabulary.entities
    prefixes = []
    for _ in range(draw(st.integers(1, 12))):
        sentence = draw(st.sampled_from(sentences))
        prefix = list(sentence[: draw(st.integers(1, len(sentence)))])
        change = draw(st.sampled_from(["none", "none", "entity", "append"]))
        if change == "entity":
            spots = [i for i, t in enumerate(prefix) if t in entities]
            if spots:
                prefix[draw(st.sampled_from(spots))] = draw(st.sampled_from(entities))
        elif change == "append":
            prefix.append(draw(st.sampled_from(tokens)))
        prefixes.append(tuple(prefix))
    return taskset, prefixes


@PROPERTY
@given(task_set_and_prefixes())
def test_open_tasks_matches_brute_force(case: tuple[TaskSet, list[tuple[str, ...]]]) -> None:
    taskset, prefixes = case
    trie = StructureTrie(taskset)
    for prefix in prefixes:
        assert open_tasks(taskset, prefix, trie) == consistent_by_brute_force(taskset, prefix), prefix


# --- well-posed and ill-posed generated sets -----------------------------------------


@PROPERTY
@given(task_sets())
def test_generated_sets_are_well_posed(taskset: TaskSet) -> None:
    check_routable(taskset)
    assert object_query_collisions(StructureTrie(taskset), structural=True) == []


@PROPERTY
@given(task_sets(allow_structural_collisions=True))
def test_generated_sets_with_structural_collisions_are_routable(taskset: TaskSet) -> None:
    check_routable(taskset)


@PROPERTY
@given(ill_posed_task_sets())
def test_ill_posed_sets_fail_check_routable(tasks: tuple[Task, ...]) -> None:
    taskset = TaskSet(tasks)  # the local rules hold
    with pytest.raises(TaskError, match="no model can route this task set") as info:
        check_routable(taskset)
    (k1, t1), (k2, t2) = info.value.refs
    assert k1 != k2
    message = str(info.value)
    assert f"template '{taskset.tasks[k1].templates[t1]}' of task '{taskset.tasks[k1].name}'" in message
    assert f"template '{taskset.tasks[k2].templates[t2]}' of task '{taskset.tasks[k2].name}'" in message


# --- synthetic WikiData-shaped sets ---------------------------------------------------


def fingerprint(taskset: TaskSet) -> tuple:
    return tuple((t.name, tuple(map(str, t.templates)), tuple(t.facts.items())) for t in taskset)


def test_default_task_count_anchors() -> None:
    assert default_n_tasks(1_000_000) == 100
    assert default_n_tasks(20_000_000) == 822
    assert default_n_tasks(1) == 1
    assert 1 <= default_n_tasks(100_000) < 100


def test_zipf_sizes() -> None:
    sizes = zipf_sizes(10_000, 50, 1.1)
    assert sizes.sum() == 10_000 and sizes.min() >= 1
    assert np.all(np.diff(sizes) <= 0)
    assert list(zipf_sizes(7, 7)) == [1] * 7
    with pytest.raises(ValueError):
        zipf_sizes(3, 4)


def test_synthetic_is_deterministic_per_seed() -> None:
    a = wikidata_like(3_000, n_tasks=15, seed=7)
    b = wikidata_like(3_000, n_tasks=15, seed=7)
    c = wikidata_like(3_000, n_tasks=15, seed=8)
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(c)


@pytest.fixture(scope="module")
def synthetic() -> TaskSet:
    return wikidata_like(20_000, n_tasks=40, seed=1)


def test_synthetic_sizes(synthetic: TaskSet) -> None:
    assert len(synthetic) == 40
    sizes = [t.n_facts for t in synthetic]
    assert sum(sizes) == 20_000 == synthetic.n_facts and min(sizes) >= 1
    assert max(sizes) > 10 * np.median(sizes)  # Zipf: a few large relations
    assert all(1 <= t.n_templates <= 5 for t in synthetic)
    assert all(re.fullmatch(r"P\d+", t.name) for t in synthetic)
    assert all(re.fullmatch(r"Q\d+", e) for e in synthetic.vocabulary.entities)


def test_synthetic_is_well_posed(synthetic: TaskSet) -> None:
    check_routable(synthetic)
    trie = StructureTrie(synthetic)
    assert object_query_collisions(trie, structural=True) == []
    # The shape the strategies promise too: shared prefixes, ⋆1 first, shared entities.
    assert any(len(node.tasks) > 1 for node in trie)
    assert any(t.parts[0] is SUBJECT for task in synthetic for t in task.templates)
    subjects = [set(t.facts.subjects) for t in synthetic]
    objects = set().union(*(t.facts.objects for t in synthetic))
    assert any(subjects[0] & s for s in subjects[1:])
    assert objects & set().union(*subjects)


def test_synthetic_options() -> None:
    taskset = wikidata_like(500, n_tasks=10, seed=2, templates_per_task=(2, 2), n_entities=400)
    assert all(t.n_templates == 2 for t in taskset)
    assert len(taskset.vocabulary.entities) <= 400
    with pytest.raises(ValueError, match="n_entities"):
        wikidata_like(500, n_tasks=1, n_entities=10)
    with pytest.raises(ValueError):
        wikidata_like(0)
    with pytest.raises(ValueError):
        wikidata_like(10, templates_per_task=(3, 2))


def test_synthetic_100k_facts() -> None:
    taskset = wikidata_like(100_000)
    assert taskset.n_facts == 100_000
    assert len(taskset) == default_n_tasks(100_000)
    check_routable(taskset)


@settings(max_examples=examples(80), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_task_alone_is_the_task_set_of_it_alone(data):
    """TaskSet.alone(k), computed from the set's arrays, is TaskSet((task,)): vocabulary, fact ids, L."""
    from tasks.strategies import task_sets

    ts = data.draw(task_sets(max_tasks=4, max_templates=3, max_facts=8))
    for k, task in enumerate(ts.tasks):
        got, want = ts.alone(k), TaskSet((task,))
        assert got.vocabulary == want.vocabulary and got.L == want.L and got.tasks == want.tasks
        for (a, b), (c, d) in zip(got.fact_ids, want.fact_ids):
            assert a.tolist() == c.tolist() and b.tolist() == d.tolist()
        assert got.vocabulary.entity_array.tolist() == list(want.vocabulary.entities)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_task_hash_from_the_fact_ids_is_the_hash_of_its_sorted_facts(data):
    from tasks.strategies import task_sets
    from verifier.certificates.certificate import task_hash

    ts = data.draw(task_sets(max_tasks=4, max_templates=2, max_facts=8))
    for task in ts.tasks:
        assert task_hash(task, ts) == task_hash(task)


@settings(max_examples=examples(20), deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_entity_ids_by_dict_and_by_binary_search_agree(monkeypatch, seed):
    """Many names are looked up in the entity dict up to ``DICT_ENTITIES`` entities, else by
    binary search in the sorted string array: both give the same ids (code point order,
    as ``sorted`` gives it, for names of any characters and lengths), and both refuse a
    name that is not an entity."""
    import random

    import tasks.model

    rnd = random.Random(seed)
    alphabet = "aAzZ09_-é\u00ffǅ\u0301\u4e2d\U0001f600\U0010fffd"
    names = {"".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 5))) for _ in range(1500)}
    entities = tuple(sorted(names))
    wanted = list(entities)
    rnd.shuffle(wanted)
    got = {}
    for limit in (10 ** 9, 0):
        monkeypatch.setattr(tasks.model, "DICT_ENTITIES", limit)
        vocab = tasks.model.Vocabulary(("a", "b"), entities)
        got[limit] = vocab.entity_ids(wanted).tolist()
        with pytest.raises(KeyError):
            vocab.entity_ids(wanted[:999] + ["\x00not an entity"])
    assert got[0] == got[10 ** 9] == [2 + entities.index(n) for n in wanted]
