"""Reuse of part of a class: a subject's queries taken out of their classes and run again.

The pieces ``check --since`` rests on when it re-runs single subjects rather than whole
cells (``verifier.certificates.incremental._Selection``): a group built for some subjects is exactly
the full group's rows with those subjects; a row of such a batch names a part that holds
it; classes recorded in two runs and merged are the classes one run records. The end-to-end
property (verdicts, counts, margins equal a full check's) is ``tests/workflow/test_editing.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

from workflow.certificates import check_and_save

from workflow.since import check_since
from construction.model import build
from tasks.model import Facts, Task, TaskSet, Template
from tasks.queries import build_group
from tasks.strategies import shared_template_task_sets, task_sets
from tasks.structure import StructureTrie
from verifier.passes.batches import batches, batches_of_subjects
from verifier.checks.classes import CellPlan, ClassRecorder, merge_classes
from verifier.certificates.locality import watched_neurons
from verifier.running.runner import Shard, verify_batch
from verifier.checks.verify import token_map, verify

SETS = st.one_of(task_sets(max_tasks=3, max_templates=2, max_facts=6),
                 shared_template_task_sets(max_sharing=3, max_groups=1, max_other_tasks=1, max_facts=4))


def _rows(g) -> list[tuple]:
    return [(int(g.subjects[i]), int(g.objects[i]), tuple(g.allowed_of(i).tolist()), tuple(g.valid_of(i).tolist()),
             bool(g.object_query[i]), int(g.determined[i])) for i in range(len(g))]


@settings(max_examples=examples(60), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(SETS, st.data())
def test_a_group_of_some_subjects_is_the_full_groups_rows_with_them(ts, data):
    trie = StructureTrie(ts)
    entities = np.arange(ts.vocabulary.n_words, ts.vocabulary.size, dtype=np.int64)
    for node in trie:
        if not node.has_subject:
            continue
        chosen = np.array(sorted(data.draw(st.sets(st.sampled_from(entities.tolist()), max_size=4))), np.int64)
        full = [r for r in _rows(build_group(ts, trie, node)) if r[0] in set(chosen.tolist())]
        assert _rows(build_group(ts, trie, node, subjects=chosen)) == full


@settings(max_examples=examples(40), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(SETS)
def test_a_subject_batch_row_names_the_part_that_holds_it(ts):
    """Counterexamples are described by rebuilding the part a row names (verify._State.finish)."""
    trie = StructureTrie(ts)
    subjects = {node.id: np.unique(np.concatenate([ts.fact_ids[k][0] for k in node.tasks]))
                for node in trie if node.has_subject}
    seen = 0
    for b in batches_of_subjects(ts, trie, subjects, chunk=3):
        for i in range(len(b)):
            lo, hi = (int(x) for x in b.part[i])
            assert hi == lo + 1 == b.tokens[i, trie.nodes[int(b.node[i])].subject_position] + 1
            g = build_group(ts, trie, trie.nodes[int(b.node[i])], (lo, hi))
            assert tuple(b.tokens[i]) == tuple(int(x) for x in _tokens(g, int(b.index[i])))
            seen += 1
    assert seen == sum(len(build_group(ts, trie, trie.nodes[n])) for n in subjects)


def _tokens(g, i: int) -> list[int]:
    from verifier.passes.batches import group_tokens
    return group_tokens(g)[i].tolist()


def _recorder(ts, trie, weights, plan):
    return ClassRecorder.for_weights(ts, trie, plan, weights, 0.01, watched_neurons(weights))


@settings(max_examples=examples(40), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(SETS, st.integers(0, 2 ** 16))
def test_classes_recorded_in_two_runs_and_merged_are_one_runs(ts, seed):
    weights = build(ts).instantiate()
    trie = StructureTrie(ts)
    plan = CellPlan.of(ts, trie, 2)
    shard = Shard(weights, token_map(ts, weights))
    one, parts = _recorder(ts, trie, weights, plan), [_recorder(ts, trie, weights, plan) for _ in range(2)]
    rng = np.random.default_rng(seed)
    for b in batches(ts, trie):
        res = verify_batch(shard, b)
        one.record(b, res)
        side = rng.integers(0, 2, len(b)).astype(bool)
        for j, rows in enumerate((np.flatnonzero(side), np.flatnonzero(~side))):
            if rows.size:
                parts[j].record(b.take(rows), res.take(rows))
    a = one.table()
    from verifier.checks.classes import ClassTable
    both = ClassTable.concat([p.table() for p in parts])
    m = merge_classes(both, np.arange(len(both)))

    def rows(t):
        out = {}
        for i in range(len(t)):
            key = (t.nodes[int(t.node[i])], int(t.cell[i]), tuple(t.allowed_of(i).tolist()), int(t.expert[i]))
            assert key not in out
            floats = np.delete(t.floats[i], 1)                          # err_lo follows the witness chosen
            out[key] = (tuple(t.counts[i].tolist()), tuple(np.nan_to_num(floats, nan=7.0).tolist()),
                        tuple(t.active_of(i).tolist()), bool(t.overflow[i]))
        return out
    assert rows(m) == rows(a)
    for i in range(len(m)):                 # a class with a subject names its worst query
        if "⋆1" in m.nodes[int(m.node[i])]:
            assert (m.worst[i][0] != "") == bool(np.isfinite(m.floats[i, 0]))


def _task(name, facts):
    return Task(name, (Template.parse("⋆1 of ⋆2"), Template.parse("about ⋆1 : ⋆2 .")), Facts(facts))


def test_an_edit_of_one_subject_reruns_its_queries_not_its_cell(tmp_path):
    facts = {f"s{i:03d}": f"o{i % 7}" for i in range(200)}
    ts = TaskSet((_task("a", facts), _task("b", {f"t{i:03d}": f"o{i % 5}" for i in range(50)})))
    model = build(ts)
    check_and_save(ts, model, str(tmp_path / "cert"), isolation=False)
    new = TaskSet((_task("a", {**facts, "s100": "o3"}), ts.tasks[1]))
    inc, _ = check_since(new, str(tmp_path / "cert"), isolation=False)
    full = verify(new, build(new, beta=float(model.beta), gamma=float(model.gamma)).instantiate(), model.epsilon)
    i = inc.incremental
    assert i["mode"] == "incremental" and i["classes_partly_reused"] > 0
    # the subject's queries: at most one per prefix of the task's two templates
    assert 0 < i["queries_rerun"] <= 8, i
    assert inc.certified == full.certified and inc.queries == full.queries
    for a, b in zip(inc.tasks, full.tasks):
        assert (a.queries, a.object_queries, a.misrouted, a.over_epsilon, a.ablation_broken, a.min_margin) == \
               (b.queries, b.object_queries, b.misrouted, b.over_epsilon, b.ablation_broken, b.min_margin)
        assert (a.objects, a.l1_held, a.l2_held, a.localized, a.min_gap) == \
               (b.objects, b.l1_held, b.l2_held, b.localized, b.min_gap)


@settings(max_examples=examples(60), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(task_sets(max_tasks=3, max_templates=2, max_facts=6), st.data())
def test_changed_subjects_by_ids_are_the_subjects_whose_fact_differs_by_name(ts, data):
    """verifier.certificates.incremental.changed_subjects compares facts as integer pairs through the
    token map; by name, a subject is changed when its object differs or it is in one task set only."""
    from verifier.certificates.incremental import changed_subjects

    new_names = ["n0", "n1", "n2"]
    tasks = []
    for task in ts.tasks:
        facts = dict(task.facts.items())
        for s in data.draw(st.lists(st.sampled_from(sorted(facts) + new_names), max_size=3)):
            action = data.draw(st.sampled_from(["set", "remove"]))
            if action == "remove" and s in facts and len(facts) > 1:
                del facts[s]
            elif action == "set":
                facts[s] = data.draw(st.sampled_from(sorted(set(facts.values())) + new_names))
        tasks.append(Task(task.name, task.templates, Facts(facts)))
    new = TaskSet(tuple(tasks), ts.epsilon, ts.parameters)
    old_tokens, new_tokens = ts.vocabulary.tokens, new.vocabulary.tokens
    where = {t: i for i, t in enumerate(new_tokens)}
    to_new = np.array([where.get(t, -1) for t in old_tokens], np.int64)
    got, sets = changed_subjects(ts, new, to_new)
    for a, b, ch, changed_set in zip(ts.tasks, new.tasks, got, sets):
        fa, fb = dict(a.facts.items()), dict(b.facts.items())
        assert ch == {s for s in fa.keys() | fb.keys() if fa.get(s) != fb.get(s)}
        assert changed_set == (fa.keys() != fb.keys())


@settings(max_examples=examples(20), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(shared_template_task_sets(max_sharing=3, max_facts=4), st.data())
def test_records_pick_each_tasks_worst_class_as_argmax_does(ts, data):
    """A task's worst query is that of its first class (in table order) at the largest upper
    error, a NaN counting as the largest: ties, NaNs and infinities among the errors."""
    from workflow.certificates import check_and_record
    from verifier.checks.classes import FLOATS, query_text, records

    _, cert = check_and_record(ts, build(ts), isolation=False)
    t = cert.table
    F = t.floats.copy()
    F[:, FLOATS.index("err_hi")] = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, np.nan, np.inf, -np.inf]),
                                                      min_size=len(t), max_size=len(t)))
    t.floats = F
    got = records(t, ts, len(cert.weights.experts))
    owner = np.repeat(np.arange(len(t)), np.diff(t.allowed_ptr))
    hi = t.column("err_hi")
    for k in range(len(ts.tasks)):
        mine = owner[t.allowed == k]
        if mine.size:
            j = int(mine[np.argmax(hi[mine])])
            assert got.worst_query[k] == query_text(t.nodes[int(t.node[j])], *t.worst[j])
            assert got.worst[k] == hi[j] or np.isnan(got.worst[k]) and np.isnan(hi[j])


@pytest.mark.parametrize("unsorted", [False, True])
def test_merged_classes_unite_their_active_neurons_sorted(capitals_set, unsorted):
    """merge_classes gives each class the sorted union of its members' active neurons, whether
    or not the lists of the classes it leaves alone were sorted (then every list is sorted
    again, as before the shortcut)."""
    from workflow.certificates import check_and_record
    from verifier.checks.classes import ClassTable

    _, cert = check_and_record(capitals_set, build(capitals_set), isolation=False)
    t = cert.table.take(np.arange(len(cert.table)))
    t.active = t.active.copy()
    if unsorted:                                   # a class left alone (not a multiple of 3) listing 1, 0
        lists = [t.active_of(i).tolist() for i in range(len(t))]
        lists[1] = [1, 0]
        t.active_ptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)
        t.active = np.array([n for x in lists for n in x], np.int64)
    extra = t.take(np.arange(0, len(t), 3))
    extra.active = (extra.active + 1) % (int(t.active.max(initial=0)) + 1)   # other neurons, to unite
    merged = ClassTable.concat([t, extra])
    pair = merged.node.astype(np.int64) * (int(merged.cell.max(initial=0)) + 1) + merged.cell
    out = merge_classes(merged, np.flatnonzero(np.isin(pair, pair[len(t):])))
    assert len(out) == len(t)
    for i in range(len(out)):
        want = set(t.active_of(i).tolist()) | (set(extra.active_of(i // 3).tolist()) if i % 3 == 0 else set())
        assert out.active_of(i).tolist() == sorted(want)


def test_reused_active_lists_naming_absent_neurons_are_refused(capitals_set):
    """A certificate whose class lists a neuron its expert does not have is refused (one
    line, exit 2), not mapped through another expert's neurons."""
    from workflow.certificates import check_and_record
    from construction.numbering import correspondence, numbering
    from tasks.errors import TaskError
    from verifier.certificates.incremental import _map_active
    from verifier.certificates.locality import Correspondence

    _, cert = check_and_record(capitals_set, build(capitals_set), isolation=False)
    names = numbering(capitals_set)
    cor = Correspondence(**correspondence(names, names, set(capitals_set.names)))
    ok = _map_active(cert.table.take(np.arange(len(cert.table))), cor)
    assert ok.active.tolist() == cert.table.active.tolist()           # the identity keeps every list
    i = int(np.flatnonzero(np.diff(cert.table.active_ptr) > 0)[0])
    for wrong in (cert.weights.experts[int(cert.table.expert[i])].width, -1):
        t = cert.table.take(np.arange(len(cert.table)))
        t.active = t.active.copy()
        t.active[t.active_ptr[i]] = wrong
        with pytest.raises(TaskError, match="neurons its experts do not have"):
            _map_active(t, cor)


def test_removing_facts_drops_their_object_queries_from_the_localization_counts(tmp_path):
    """Directed: under ``check --since``, removing facts takes their subjects' queries out of
    their classes, which lose them (partly reused, never run again since the queries are
    gone). The localization counts (object queries, L1, L2, all three of the entanglement
    check) drop by exactly those object queries, as a full check of the edited set counts
    them, in the report and its JSON, and the saved certificate carries the lower counts into
    the next removal; the last removal also takes the task's only fact with its object away
    (|O_k| and L1's threshold change)."""
    from verifier.checks.report import task_json

    facts = {**{f"s{i:03d}": f"o{i % 7}" for i in range(200)}, "s200": "lonely"}
    other = _task("b", {f"t{i:03d}": f"o{i % 5}" for i in range(50)})
    ts = TaskSet((_task("a", facts), other))
    model = build(ts)
    first = check_and_save(ts, model, str(tmp_path / "cert"), isolation=False)
    a0 = first.tasks[0]
    assert a0.object_queries == 2 * 201 and a0.l1_held == a0.l2_held == a0.localized == a0.object_queries
    assert a0.objects == 8
    current, removed = dict(facts), 0
    for gone in (["s100"], ["s050", "s150", "s151"], ["s200"]):
        for s in gone:
            del current[s]
        removed += len(gone)
        new = TaskSet((_task("a", current), other))
        inc, _ = check_since(new, str(tmp_path / "cert"), isolation=False)
        full = verify(new, build(new, beta=float(model.beta), gamma=float(model.gamma)).instantiate(), model.epsilon)
        i = inc.incremental
        assert i["mode"] == "incremental" and i["classes_partly_reused"] > 0, i
        a = inc.tasks[0]
        # two object queries per subject ("s of", "about s :"), each certifying L1 and L2
        assert a.object_queries == a0.object_queries - 2 * removed
        assert (a.l1_held, a.l2_held, a.localized) == (a.object_queries,) * 3
        assert a.objects == (7 if "s200" in gone else 8)
        for x, y in zip(inc.tasks, full.tasks):
            assert (x.objects, x.object_queries, x.l1_held, x.l2_held, x.localized, x.ablation_broken, x.min_gap) == \
                   (y.objects, y.object_queries, y.l1_held, y.l2_held, y.localized, y.ablation_broken, y.min_gap)
            counts = ("l1_held", "l2_held", "localized", "l1", "l2", "ablation")
            jx, jy = task_json(x), task_json(y)
            assert [jx["localization"][k] for k in counts] == [jy["localization"][k] for k in counts]
            assert (jx["object_queries"], jx["graded"]["l1"], jx["graded"]["l2"]) == \
                   (jy["object_queries"], jy["graded"]["l1"], jy["graded"]["l2"])
        assert inc.certified and full.certified
