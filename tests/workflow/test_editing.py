"""Editing with a proof of locality: ``check --since`` gives the verdict a full check gives.

The property (hypothesis, derandomized): for random task sets and random sequences of
edits (add a fact with new or existing tokens, change an object, remove a fact, remove a
whole task), the certificate re-certified after each edit (``workflow.since.check_since``)
has the verdict of a full verification of the same model (the same β and γ), the same
per-task counts (queries, object queries, each check's failures), the same routing
matrix, and enclosures of the worst errors that overlap the full check's (both contain
the exact value). 200 sequences run in CI.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

from workflow.certificates import check_and_save

from workflow.since import check_since
from construction.model import build
from tasks.errors import TaskError
from tasks.model import Facts, Task, TaskSet, Template
from tasks.strategies import shared_template_task_sets, task_sets
from tasks.structure import check_routable
from verifier.checks.verify import verify
from repository import DATA

KINDS = ("add new subject, new object", "add new subject, existing object", "add existing entity as subject",
         "change object to an existing entity", "change object to a new entity", "remove a fact", "remove a task")


def _with_task(ts: TaskSet, k: int, task: Task | None) -> TaskSet:
    tasks = list(ts.tasks)
    if task is None:
        del tasks[k]
    else:
        tasks[k] = task
    return TaskSet(tuple(tasks), ts.epsilon, ts.parameters)


@st.composite
def edit(draw, ts: TaskSet, fresh: list[int]):
    """One edit of ``ts`` (a new task set), or None when the drawn edit is not well-posed."""
    kind = draw(st.sampled_from(KINDS))
    k = draw(st.integers(0, len(ts.tasks) - 1))
    task = ts.tasks[k]
    facts = dict(task.facts.items())
    entities = list(ts.vocabulary.entities)

    def new_name() -> str:
        fresh[0] += 1
        return f"new entity #{fresh[0]}"

    if kind == "remove a task":
        if len(ts.tasks) < 2:
            return None
        return _with_task(ts, k, None)
    if kind == "remove a fact":
        if len(facts) < 2:
            return None
        del facts[draw(st.sampled_from(sorted(facts)))]
    elif kind.startswith("change object"):
        s = draw(st.sampled_from(sorted(facts)))
        facts[s] = draw(st.sampled_from(entities)) if "existing" in kind else new_name()
    else:
        if kind == "add existing entity as subject":
            candidates = sorted(set(entities) - set(facts))
            if not candidates:
                return None
            s = draw(st.sampled_from(candidates))
        else:
            s = new_name()
        facts[s] = new_name() if kind.endswith("new object") else draw(st.sampled_from(entities))
    try:
        out = _with_task(ts, k, Task(task.name, task.templates, Facts(facts.items())))
        check_routable(out)
    except TaskError:
        return None                                  # e.g. a subject now shared at a shared template
    return out


def _compare(inc, full, p_rel: float = 1e-6) -> None:
    """``inc`` (a re-certification) gives ``full``'s verdict, counts and figures; its worst
    P_ablated(o) within ``p_rel`` (a reused class updates one range of ρ for all its queries,
    so where they differ its bound is sound and looser)."""
    assert inc.certified == full.certified, (inc.counterexamples[:2], full.counterexamples[:2])
    assert inc.queries == full.queries and inc.complete
    assert np.array_equal(inc.routing_matrix, full.routing_matrix)
    assert inc.foreign == full.foreign
    for a, b in zip(inc.tasks, full.tasks):
        assert (a.name, a.queries, a.object_queries, a.misrouted, a.over_epsilon, a.ablation_broken) == \
               (b.name, b.queries, b.object_queries, b.misrouted, b.over_epsilon, b.ablation_broken)
        # the localization check: the same counts, |O_k| and the same smallest L2 gap (a reused
        # class keeps its gap only where its exact-zero logits cannot change its witness)
        assert (a.objects, a.l1_held, a.l2_held, a.localized, a.entanglement_ok) == \
               (b.objects, b.l1_held, b.l2_held, b.localized, b.entanglement_ok)
        assert a.min_gap == b.min_gap
        if b.object_queries:
            assert math.isclose(a.worst_p_ablated, b.worst_p_ablated, rel_tol=p_rel, abs_tol=1e-12)
        assert a.width == b.width and a.certified == b.certified
        if b.queries:
            # both enclose the exact worst error: the enclosures overlap
            assert a.worst_error_lower <= b.worst_error and b.worst_error_lower <= a.worst_error
            # a reused class's bound is its old enclosure, updated for the tokens added or removed:
            # sound, and close to the full check's
            assert math.isclose(a.worst_error, b.worst_error, rel_tol=1e-3, abs_tol=1e-12)
            assert math.isclose(a.min_margin, b.min_margin, rel_tol=1e-9, abs_tol=1e-12) or \
                (math.isinf(a.min_margin) and math.isinf(b.min_margin))


def run_sequence(ts: TaskSet, steps: list, tmp_path, cell_queries: int | None = None,
                 modes: Counter | None = None) -> None:
    """Certify ``ts``, then each edit with --since, each against a full verification of the same
    model; ``modes`` counts the re-certifications' modes (and those that reused classes in part)."""
    d = str(tmp_path / "cert")
    model = build(ts)
    check_and_save(ts, model, d, isolation=False, cell_queries=cell_queries)
    modes = Counter() if modes is None else modes
    for new in steps:
        inc, _ = check_since(new, d, isolation=False)
        full = verify(new, build(new, beta=float(model.beta), gamma=float(model.gamma)).instantiate(), model.epsilon)
        _compare(inc, full)
        modes[inc.incremental["mode"]] += 1
        if inc.incremental.get("classes_partly_reused"):
            modes["partly reused"] += 1


SMALL = dict(max_tasks=3, max_templates=2, max_facts=4, max_template_length=5)


def test_incremental_verdicts_equal_full_ones(tmp_path_factory):
    """Random edit sequences: every re-certification equals a full verification; the sequences
    exercise the incremental path (most of the time, often with classes that lost the queries
    of subjects run again) and the fallback to a full check."""
    modes: Counter = Counter()

    @settings(max_examples=examples(200), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(task_sets(**SMALL), shared_template_task_sets(max_sharing=3, max_groups=1, max_other_tasks=1,
                                                                    max_templates=2, max_facts=3,
                                                                    max_template_length=5)),
           st.data())
    def sequences(ts, data):
        fresh = [0]
        steps, current = [], ts
        for _ in range(data.draw(st.integers(1, 3))):
            new = data.draw(edit(current, fresh))
            if new is not None:
                steps.append(new)
                current = new
        # cells of one, two or three subjects put cell boundaries among the few facts drawn here
        # (at the default size every small set is one cell)
        cell = data.draw(st.sampled_from([1, 2, 3, None]))
        run_sequence(ts, steps, tmp_path_factory.mktemp("seq"), cell, modes)

    sequences()
    assert modes["incremental"] > examples(200) // 2 and modes["full"] > 0, modes
    assert modes["partly reused"] >= examples(4, floor=1), modes


# --- edits at cell boundaries ---------------------------------------------------------------------

BOUNDARY_KINDS = ("remove the boundary's subject", "remove the subject before a boundary",
                  "add a name just before a boundary", "add a name just after a boundary",
                  "change an object to a new name", "change an object to an existing entity")


@settings(max_examples=examples(60), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(6, 14), st.integers(2, 4), st.data())
def test_edits_at_cell_boundaries(tmp_path_factory, n_subjects, cell, data):
    """Two tasks over one pool of names, cells of ``cell`` subjects, so that removed and added
    subjects (and names leaving the vocabulary) sit at, just before and just after the cells'
    first names: the cells a re-certification reruns are decided by name ranges there."""
    from verifier.checks.classes import CellPlan
    from tasks.structure import StructureTrie

    pool = sorted(data.draw(st.sets(st.text("ab", min_size=1, max_size=5), min_size=n_subjects + 4,
                                    max_size=n_subjects + 4)))
    subjects = pool[:n_subjects]
    objects = pool[n_subjects:]
    first = {s: data.draw(st.sampled_from(objects), label="object") for s in subjects}
    second = {s: data.draw(st.sampled_from(objects), label="object") for s in subjects[::3]}
    ts = TaskSet((Task("first", (Template.parse("the first of ⋆1 is ⋆2"),), Facts(first.items())),
                  Task("second", (Template.parse("⋆1 has second ⋆2 here"),), Facts(second.items()))), 0.01, {})
    plan = CellPlan.of(ts, StructureTrie(ts), cell)
    bounds = sorted({b for v in plan.boundaries.values() for b in v})
    steps, current = [], ts
    for _ in range(data.draw(st.integers(1, 2))):
        k = data.draw(st.integers(0, 1))
        facts = dict(current.tasks[k].facts.items())
        kind = data.draw(st.sampled_from(BOUNDARY_KINDS))
        b = data.draw(st.sampled_from(bounds)) if bounds else min(facts)
        before = [s for s in sorted(facts) if s < b]
        if kind == "remove the boundary's subject" and b in facts and len(facts) > 1:
            del facts[b]
        elif kind == "remove the subject before a boundary" and before and len(facts) > 1:
            del facts[before[-1]]
        elif kind == "add a name just before a boundary" and b[:-1]:
            facts[b[:-1]] = data.draw(st.sampled_from(objects))      # a prefix sorts first
        elif kind == "add a name just after a boundary":
            facts[b + "a"] = data.draw(st.sampled_from(objects))
        elif kind == "change an object to a new name":
            facts[data.draw(st.sampled_from(sorted(facts)))] = b + "b"
        else:
            facts[data.draw(st.sampled_from(sorted(facts)))] = data.draw(
                st.sampled_from(list(current.vocabulary.entities)))
        try:
            new = _with_task(current, k, Task(current.tasks[k].name, current.tasks[k].templates, Facts(facts.items())))
            check_routable(new)
        except TaskError:
            continue
        steps.append(new)
        current = new
    run_sequence(ts, steps, tmp_path_factory.mktemp("cells"), cell)


# --- the locality analysis against weights the construction did not make ------------------------


class _BadInput:
    def __init__(self, exc: TaskError) -> None:
        self.message = str(exc)


def _outcome(fn):
    try:
        return fn()
    except TaskError as exc:
        return _BadInput(exc)


def test_reuse_is_sound_for_mutated_weights(tmp_path_factory):
    """Re-certify weights that are the construction's after an edit *and then mutated*
    (any operator of audit.mutants, anywhere): the verdict and counts equal a full
    verification of those mutated weights. The reuse rests on the diff of the two files,
    not on how the new one was made; the mutants exercise the incremental path."""
    from audit import mutants as M
    from construction.numbering import correspondence, numbering
    from verifier.certificates.certificate import load_certificate
    from verifier.certificates.incremental import recertify
    from verifier.certificates.locality import Correspondence

    modes: Counter = Counter()

    @settings(max_examples=examples(80), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(task_sets(**SMALL), st.sampled_from(sorted(M.OPERATORS)), st.integers(0, 2 ** 32 - 1), st.data())
    def mutated(ts, op_name, seed, data):
        d = str(tmp_path_factory.mktemp("cert") / "c")
        model = build(ts)
        check_and_save(ts, model, d, isolation=False)
        old = load_certificate(d)
        new = data.draw(edit(ts, [0])) if data.draw(st.booleans()) else ts
        new = new if new is not None else ts
        w = build(new, beta=float(model.beta), gamma=float(model.gamma)).instantiate()
        made = M.mutate(M.OPERATORS[op_name], w, np.random.default_rng(seed))
        if made is None:
            return
        mutant = made[0]
        cor = Correspondence(**correspondence(numbering(old.taskset), numbering(new)))
        full = _outcome(lambda: verify(new, mutant, model.epsilon))
        inc = _outcome(lambda: recertify(old, new, mutant, cor, model.epsilon))
        if isinstance(full, _BadInput) or isinstance(inc, _BadInput):
            assert isinstance(full, _BadInput) and isinstance(inc, _BadInput), (op_name, made[1], full, inc)
            return
        report, _, _, info = inc
        modes[info.mode] += 1
        if report is not None:
            _compare(report, full)

    mutated()
    assert modes["incremental"] >= examples(20, floor=3), modes

def test_reuse_keeps_l1_of_the_object_alone(tmp_path):
    """A model that, without its expert, predicts the template word "the" after "Ann lives in"
    (P(valid set) above 1/|O_k|, P(object) below it: L1 holds on the object's probability
    alone). Adding a fact with two new entities to the other task grows the vocabulary by 2:
    the reused classes' 1 − P(o) moves with the new zero-logit tokens, and the
    re-certification equals a full verification, reusing classes."""
    from construction.numbering import correspondence, numbering
    from tasks.reading import loads_tasks
    from tasks.structure import StructureTrie
    from verifier.certificates.certificate import Certificate, task_hash
    from verifier.certificates.incremental import recertify
    from verifier.certificates.locality import Correspondence, watched_neurons
    from verifier.checks.classes import CellPlan, ClassRecorder

    text = (DATA / "word_and_object.yaml").read_text(encoding="utf-8")
    ts = loads_tasks(text)
    new = loads_tasks(text.replace("Bob: cook}", "Bob: cook, Eve: smith}"))

    def knows_the_word(model):
        w = model.instantiate()
        U = w.U.tolil()
        U[w.vocab.index("the"), w.residual_labels.index("subj:Ann")] = 3.0
        return w.replace(U=U.tocsr())

    model = build(ts)
    w = knows_the_word(model)
    trie = StructureTrie(ts)
    plan, watched = CellPlan.of(ts, trie), watched_neurons(w)
    recorder = ClassRecorder.for_weights(ts, trie, plan, w, model.epsilon, watched)
    report = verify(ts, w, model.epsilon, classes=recorder)
    home = next(r for r in report.tasks if r.name == "home")
    assert home.l1_ok and home.min_ablated_lower < 1 - 1 / 3    # (the word costs the error check elsewhere)
    old = Certificate(model.epsilon, report.verdict, ts, w, recorder.table(), plan, watched, {},
                      {t.name: task_hash(t) for t in ts.tasks}, {})
    w2 = knows_the_word(build(new, beta=float(model.beta), gamma=float(model.gamma)))
    assert len(w2.vocab) == len(w.vocab) + 2
    cor = Correspondence(**correspondence(numbering(ts), numbering(new)))
    inc, _, _, info = recertify(old, new, w2, cor, model.epsilon)
    assert info.mode == "incremental" and info.classes_reused > 0 and info.vocabulary_delta == 2
    # the class of "Ann lives in" and "Bob lives in" mixes Ann's small ρ with Bob's larger one
    _compare(inc, verify(new, w2, model.epsilon), p_rel=0.1)
