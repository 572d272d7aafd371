"""Fuzzing the construction and the verifier with the public strategies.

Properties (examples per property: the ``max_examples`` of each ``settings``):

* well-posed sets certify, those in which several tasks share template text included
  (``shared_template_task_sets``: no refusal allowed); elsewhere a construction
  RoutingError is a documented refusal, allowed and counted when it carries a proof
  ('no gate routes the determined prefixes ...') or says none was found; so is
  a one-token vocabulary (``⋆1 ⋆2`` with x -> x), where no model can pass the
  entanglement check (see :func:`degenerate`);
* ill-posed sets are rejected by ``tasks.structure.check_routable``, naming a genuine
  collision (two templates of two tasks, the object-query prefix, a shared subject);
* metamorphic: renaming tokens consistently, and reordering tasks, templates and facts,
  leave the verdict unchanged and permute the experts accordingly (per-task records
  compared by name: widths, queries, certified);
* adding a task leaves the other experts identical (``construction.experts.labelled_entries``);
* certified at ε => certified at every larger ε (same weights) below the smallest
  ablated error; above it the entanglement check fails by definition (ablation must
  raise every object query's error to ε), see ``test_larger_epsilon_beyond_ablation``.

Runs derandomized (reproducible in CI); the refusal counts are printed by the last test
(``-s`` or ``-rA`` shows them).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from budget import examples

import numpy as np

from construction.experts import labelled_entries
from construction.gate import RoutingError
from construction.model import build
from tasks.errors import TaskError
from tasks.model import Facts, Task, TaskSet, Template
from tasks.strategies import ill_posed_task_sets, shared_template_task_sets, task_sets
from tasks.structure import check_routable
from audit import mutants as M
from audit.oracle import Oracle
from workflow.check import check_built
from verifier.checks.verify import verify

STATS: Counter = Counter()
REFUSALS = ("no gate routes the determined prefixes", "cannot be told apart")


def fuzz(n: int):
    return settings(max_examples=examples(n), deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


SMALL = dict(max_tasks=3, max_templates=2, max_facts=4, max_template_length=5)


def outcome(ts: TaskSet, property_name: str):
    """(model, weights, report), or None for a documented refusal (counted)."""
    STATS[f"{property_name}: examples"] += 1
    try:
        model = build(ts)
    except RoutingError as exc:
        assert any(r in str(exc) for r in REFUSALS), str(exc)
        STATS[f"{property_name}: refused ({'proven' if REFUSALS[0] in str(exc) else 'no gate found, not proven'})"] += 1
        return None
    w = model.instantiate()
    return model, w, check_built(ts, model, weights=w)


def degenerate(ts: TaskSet, report) -> bool:
    """One token in the whole vocabulary (template ⋆1 ⋆2, facts x -> x): every model
    predicts it with certainty, so removing an expert cannot break an object query and
    the entanglement check (ablated error >= ε) cannot pass. Counted, not certified."""
    if ts.vocabulary.size != 1:
        return False
    assert not report.certified
    assert all(r.error_ok and r.routing_ok and r.size_ok and not r.entanglement_ok for r in report.tasks)
    STATS["one-token vocabulary (cannot certify entanglement)"] += 1
    return True


def records(report) -> dict:
    return {r.name: (r.width, r.bound, r.queries, r.object_queries, r.certified, r.misrouted, r.over_epsilon)
            for r in report.tasks}


# --- well-posed and ill-posed ---------------------------------------------------------------


def test_well_posed_sets_certify():
    """Every well-posed set the construction routes certifies; the routing refusals (documented,
    proven or not) stay a minority of the examples (counted within this test, whatever ran before)."""
    before = Counter(STATS)

    @fuzz(150)
    @given(task_sets(**SMALL))
    def well_posed(ts):
        got = outcome(ts, "well-posed")
        if got is not None and not degenerate(ts, got[2]):
            report = got[2]
            assert report.certified, report.counterexamples[:3]
            assert all(r.isolated for r in report.tasks)

    well_posed()
    ran = Counter(STATS)
    ran.subtract(before)
    print("\nfuzz counts:", {k: v for k, v in sorted(ran.items()) if v})
    assert ran["well-posed: examples"] > 2 * sum(v for k, v in ran.items() if k.startswith("well-posed: refused"))


@fuzz(100)
@given(task_sets(**SMALL, allow_structural_collisions=True))
def test_sets_with_structural_collisions_certify_or_are_refused(ts):
    got = outcome(ts, "structural collisions allowed")
    if got is not None and not degenerate(ts, got[2]):
        assert got[2].certified, got[2].counterexamples[:3]


SHARED = dict(max_sharing=4, max_groups=2, max_other_tasks=1, max_templates=2, max_facts=3, max_template_length=5)


@fuzz(100)
@given(shared_template_task_sets(**SHARED))
def test_sets_sharing_template_text_certify(ts):
    """Tasks phrased alike, told apart by their subjects (past ⋆2 too): every one certifies."""
    try:
        model = build(ts)
    except RoutingError as exc:
        raise AssertionError(f"a well-posed set of shared templates was refused: {exc}") from None
    report = check_built(ts, model, weights=model.instantiate())
    STATS["shared templates: examples"] += 1
    if not degenerate(ts, report):
        assert report.certified, report.counterexamples[:3]
        # the exact errors lie below the closed form (an enclosure's upper end may sit a
        # rounding radius above it where the bound is attained)
        assert max(r.worst_error_lower for r in report.tasks) <= report.closed_form_value
        assert all(r.isolated for r in report.tasks)


@fuzz(300)
@given(ill_posed_task_sets())
def test_ill_posed_sets_are_rejected_with_the_collision(tasks):
    ts = TaskSet(tasks)
    with pytest.raises(TaskError) as info:
        check_routable(ts)
    message = str(info.value)
    assert "no model can route this task set" in message and "share the object-query prefix" in message
    assert "\n" not in message
    (k1, t1), (k2, t2) = info.value.refs
    assert k1 != k2
    first, second = ts.tasks[k1].templates[t1], ts.tasks[k2].templates[t2]
    sigma = first.parts[: first.object_index]          # the object-query structure of the first template
    assert second.parts[: len(sigma)] == sigma          # ... which the second template passes through
    shared = set(ts.tasks[k1].facts) & set(ts.tasks[k2].facts)
    assert shared and any(f"'{str(first)}'" in message and s in message for s in shared)
    with pytest.raises(TaskError):
        build(ts)
    STATS["ill-posed: rejected"] += 1


# --- the verifier against the independent oracle, on generated sets -----------------------------


@fuzz(150)
@given(task_sets(max_tasks=4, max_templates=3, max_facts=5, max_template_length=6, allow_structural_collisions=True))
def test_query_enumeration_matches_an_independent_one(ts):
    """A query the verifier skipped would be a query it never checks."""
    from tasks.queries import count_queries, iter_queries
    from audit.oracle import enumerate_queries

    mine = {(q.prefix, q.valid, tuple(ts.names[k] for k in q.tasks),
             ts.names[q.determined] if q.determined is not None else None, bool(q.object_of))
            for q in enumerate_queries(ts)}
    theirs = {(q.prefix, q.valid, q.tasks, q.determined, q.object_query) for q in iter_queries(ts)}
    assert mine == theirs
    assert count_queries(ts) == len(mine)


ORACLE = Oracle()


@fuzz(400)
@given(task_sets(**SMALL), st.sampled_from(sorted(M.all_operator_names())), st.integers(0, 2 ** 32 - 1))
def test_mutants_of_generated_sets_are_never_certified_falsely(ts, name, seed):
    try:
        model = build(ts)
    except RoutingError:
        return
    w, eps = model.instantiate(), model.epsilon
    op = M.OPERATORS[name] if name in M.OPERATORS else M.boundary_operators(ts, eps, ORACLE)[name]
    made = M.mutate(op, w, np.random.default_rng(seed))
    if made is None:
        STATS["generated mutants: not applicable"] += 1
        return
    o = M.classify(ts, "generated", op, made[0], made[1], eps, ORACLE)
    STATS[f"generated mutants: {o.category}"] += 1
    assert o.verdict != "crashed", o.reason
    assert o.category != "FALSE PASS", (name, o.description, o.details)


@fuzz(150)
@given(shared_template_task_sets(**SHARED), st.sampled_from(sorted(M.all_operator_names())),
       st.integers(0, 2 ** 32 - 1))
def test_mutants_of_shared_template_sets_are_never_certified_falsely(ts, name, seed):
    """The first-entity subject head and a gate that leans on subject membership give the
    mutants new places to hide (past ⋆2, where subject and object both sit in the prefix)."""
    model = build(ts)
    w, eps = model.instantiate(), model.epsilon
    op = M.OPERATORS[name] if name in M.OPERATORS else M.boundary_operators(ts, eps, ORACLE)[name]
    made = M.mutate(op, w, np.random.default_rng(seed))
    if made is None:
        return
    o = M.classify(ts, "shared", op, made[0], made[1], eps, ORACLE)
    STATS[f"shared-template mutants: {o.category}"] += 1
    assert o.verdict != "crashed", o.reason
    assert o.category != "FALSE PASS", (name, o.description, o.details)


# --- metamorphic ----------------------------------------------------------------------------


def renamed(ts: TaskSet, words: dict[str, str], entities: dict[str, str]) -> TaskSet:
    tasks = []
    for task in ts.tasks:
        templates = tuple(Template(tuple(words[p] if isinstance(p, str) else p for p in t.parts))
                          for t in task.templates)
        tasks.append(Task(task.name, templates, Facts((entities[s], entities[o]) for s, o in task.facts.items())))
    return TaskSet(tuple(tasks), ts.epsilon, ts.parameters)


@fuzz(80)
@given(task_sets(**SMALL), st.data())
def test_renaming_tokens_keeps_the_verdict(ts, data):
    vocab = ts.vocabulary
    wperm = data.draw(st.permutations(range(len(vocab.words))))
    eperm = data.draw(st.permutations(range(len(vocab.entities))))
    words = {w: f"w{wperm[i]}" for i, w in enumerate(vocab.words)}
    entities = {e: f"entity {eperm[i]}" for i, e in enumerate(vocab.entities)}   # a space: never a word
    ts2 = renamed(ts, words, entities)
    a, b = outcome(ts, "rename"), outcome(ts2, "rename (renamed)")
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a[2].certified == b[2].certified
    assert records(a[2]) == records(b[2])
    assert a[1].expert_tasks == b[1].expert_tasks
    for ra, rb in zip(a[2].tasks, b[2].tasks):
        assert ra.worst_error == pytest.approx(rb.worst_error, rel=1e-9, abs=1e-300)


@fuzz(80)
@given(task_sets(**SMALL), st.data())
def test_reordering_tasks_templates_and_facts_keeps_the_verdict(ts, data):
    order = data.draw(st.permutations(range(len(ts.tasks))))
    tasks = []
    for k in order:
        task = ts.tasks[k]
        templates = data.draw(st.permutations(task.templates))
        facts = data.draw(st.permutations(list(task.facts.items())))
        tasks.append(Task(task.name, tuple(templates), Facts(facts)))
    ts2 = TaskSet(tuple(tasks), ts.epsilon, ts.parameters)
    a, b = outcome(ts, "reorder"), outcome(ts2, "reorder (reordered)")
    assert (a is None) == (b is None)
    if a is None:
        return
    (m1, _, r1), (m2, w2, r2) = a, b
    assert r1.certified == r2.certified
    assert records(r1) == records(r2)
    assert w2.expert_tasks == ts2.names                      # experts follow the new task order
    for name in ts.names:
        e1, e2 = m1.experts[ts.index(name)], m2.experts[ts2.index(name)]
        assert labelled_entries(e1) == labelled_entries(e2), name


@st.composite
def extra_task(draw, ts: TaskSet) -> Task:
    """A task with a fresh name and a fresh marker word right before ⋆2 (its own object
    queries are its alone; its prefixes may still pass through another task's)."""
    pool = list(ts.vocabulary.words)
    entities = list(ts.vocabulary.entities)
    marker = "⟨added⟩"
    n_templates = draw(st.integers(1, 2))
    templates = []
    for i in range(n_templates):
        before = draw(st.lists(st.sampled_from(pool), max_size=2)) if pool else []
        middle = draw(st.lists(st.sampled_from(pool), max_size=1)) if pool else []
        parts = (tuple(before) + ((f"{marker}{i}",) if draw(st.booleans()) else ()) + ("⋆1",) + tuple(middle)
                 + (f"{marker}{i}",) + ("⋆2",))
        templates.append(" ".join(parts))
    templates = list(dict.fromkeys(templates))
    subjects = draw(st.lists(st.sampled_from(entities + ["fresh subject"]), min_size=1, max_size=3, unique=True))
    objects = draw(st.lists(st.sampled_from(entities + ["fresh object"]), min_size=len(subjects),
                            max_size=len(subjects)))
    name = "added " + "+" * (1 + max(len(n) for n in ts.names))   # longer than every name: unique
    return Task(name, tuple(templates), Facts(zip(subjects, objects)))


@fuzz(80)
@given(task_sets(**SMALL), st.data())
def test_adding_a_task_leaves_the_other_experts_identical(ts, data):
    new = data.draw(extra_task(ts))
    ts2 = TaskSet(ts.tasks + (new,), ts.epsilon, ts.parameters)
    try:
        check_routable(ts2)      # the new template may pass through another task's object-query prefix
    except TaskError:
        STATS["add a task: drawn task not routable (skipped)"] += 1
        assume(False)
    STATS["add a task: examples"] += 1
    try:
        m1, m2 = build(ts), build(ts2)
    except RoutingError as exc:
        assert any(r in str(exc) for r in REFUSALS), str(exc)
        STATS["add a task: refused"] += 1
        return
    for k, task in enumerate(ts.tasks):
        assert labelled_entries(m1.experts[k]) == labelled_entries(m2.experts[k]), task.name


# --- larger epsilon -------------------------------------------------------------------------


@fuzz(80)
@given(task_sets(**SMALL), st.floats(0.0, 1.0))
def test_certified_stays_certified_at_larger_epsilon(ts, t):
    got = outcome(ts, "larger epsilon")
    if got is None:
        return
    model, w, report = got
    assert report.certified
    smallest_ablated = Oracle().judge(ts, w, model.epsilon).min_ablated
    # every larger epsilon up to (just below) the smallest exact ablated error
    larger = model.epsilon + t * (smallest_ablated - model.epsilon) * (1 - 1e-9)
    assert verify(ts, w, larger).certified, (larger, smallest_ablated)
    STATS["larger epsilon: checked"] += 1


def test_larger_epsilon_beyond_ablation(capitals_set, capitals_model):
    """Above the smallest ablated error (22/23 here: the ablated model is uniform over 23
    tokens) no expert's removal 'breaks' its object queries any more, so the
    entanglement check fails: monotonicity in ε holds up to there, by definition."""
    w = capitals_model.instantiate()
    assert verify(capitals_set, w, 0.95).certified
    report = verify(capitals_set, w, 0.96)
    assert not report.certified
    assert all(r.error_ok and r.routing_ok and r.size_ok and not r.entanglement_ok for r in report.tasks)


def test_one_token_vocabulary_cannot_certify_entanglement():
    """The degenerate well-posed set the fuzzer found: template ⋆1 ⋆2, fact x -> x."""
    ts = TaskSet((Task("t", ("⋆1 ⋆2",), {"x": "x"}),))
    model = build(ts)
    report = check_built(ts, model, weights=model.instantiate())
    assert degenerate(ts, report)
    assert report.tasks[0].worst_error < 1e-300 and report.tasks[0].ablation_broken == 0   # the error is exactly 0
