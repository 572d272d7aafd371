"""The factored pass (verifier.passes.factored): sound, a function of each row alone, and
deciding as the plain pass does.

* **containment** against the independent oracle (exact linear algebra, exp at 60 digits)
  on adversarial weights, and on built weights whose subjects' embeddings are changed
  where heads read them: gate scores, margin, error, ablated error, and at object queries
  the ablated P(o) and top-token gap, for every query, batched as ``verify`` batches them;
* a **wrong split** is caught by that comparison: the pass with a head wrongly called
  uniform (its entities' value rows differ) misses exact values, so the split matters and
  the test can fail;
* the **split** is decided exactly: an entity whose embedding differs in a coordinate a
  head's W_V reads makes that head diverse, one in a coordinate no W_V reads does not;
* a row's result is **the same in every batch** (bitwise, whichever rows share it), and
  on a compact shard (tests/verifier/running/test_shards.py runs its bitwise test for both passes);
* on built models the factored pass **decides as the plain pass**: the same winner,
  candidates, certified routing and error verdicts, enclosures equal to rounding;
* its **compact accumulators** (accumulate.slot) give each column of a row one slot, in the
  order first touched, and know exactly which columns the current row has, whatever
  earlier rows left in them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from budget import examples

from adversaries import ORACLE, WORD_AND_OBJECT, adversarial, entities_moved, inside
from audit.oracle import _Fingerprints, _layout_problem
from construction.model import build
from tasks.errors import TaskError
from tasks.io import load_tasks
from tasks.model import Facts, Task, TaskSet, Template
from tasks.strategies import task_sets
from tasks.synthetic import wikidata_like
from verifier.checks.verify import token_map
from verifier.passes.batches import batches
from verifier.passes.factored import FactoredPass, Split
from verifier.passes.forward import Prepared

PROFILE = settings(max_examples=examples(60), deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _split(taskset, w) -> Split:
    return Split.of(w, token_map(taskset, w)[taskset.vocabulary.n_words:])


def _rows(taskset, w, fp):
    """(prefix ids, valid ids, object or −1, result row) for every query, batched as verify batches."""
    tmap = token_map(taskset, w)
    for b in batches(taskset, chunk=64):
        tokens = tmap[b.tokens]
        target = np.where(b.target >= 0, tmap[np.maximum(b.target, 0)], -1)
        with np.errstate(all="ignore"):
            res = fp.run_batch(tokens, b.valid_ptr, tmap[b.valid], target=target)
        for i in range(len(b)):
            valid = tmap[b.valid[b.valid_ptr[i]:b.valid_ptr[i + 1]]]
            yield tuple(int(t) for t in tokens[i]), frozenset(int(t) for t in valid), int(target[i]), res, i


def _contained(taskset, w, fp, where) -> list[str]:
    """Every enclosure of the factored pass against the oracle; the misses, described."""
    fpr = _Fingerprints(w)
    misses = []
    for ids, valid, o, res, i in _rows(taskset, w, fp):
        ex = ORACLE.evaluate(w, fpr, ids, valid, True, 60, target=o if o >= 0 else None)
        checks = [("error", res.err_lo[i], ex["error"], res.err_hi[i]),
                  ("ablated", res.ablated_lo[i], ex["ablated"], res.ablated_hi[i])]
        for k, g in enumerate(ex["gates"]):
            checks.append((f"gate {k}", res.gate_lo[i, k], g, res.gate_hi[i, k]))
        e = int(res.expert[i])
        others = [g for k, g in enumerate(ex["gates"]) if k != e]
        if others and math.isfinite(res.margin[i]):
            checks.append(("margin", res.margin[i], ex["gates"][e] - max(others), math.inf))
        if o >= 0:
            checks.append(("1 - P_ablated(o)", res.ablated_object_lo[i], 1 - ex["p_object"], math.inf))
            checks.append(("L2 gap", res.ablated_gap[i], ex["gap"], math.inf))
        for what, lo, value, hi in checks:
            if not inside(lo, value, hi):
                misses.append(f"{where} {ids} {what}: {float(lo)!r} <= {value} <= {float(hi)!r}")
    return misses


@PROFILE
@given(adversarial())
def test_factored_enclosures_contain_the_exact_values(case):
    name, taskset, w, eps, steps = case
    try:
        with np.errstate(all="ignore"):
            fp = FactoredPass(Prepared(w), _split(taskset, w))
    except TaskError:
        event("refused as bad input")
        return
    if _layout_problem(taskset, w):
        event("refused as bad input")
        return
    event("diverse heads: %d of %d" % (sum(fp.split.diverse), len(fp.split.diverse)))
    misses = _contained(taskset, w, fp, (name, steps))
    assert not misses, misses[:5]


@PROFILE
@given(entities_moved())
def test_factored_enclosures_contain_the_exact_values_when_entities_differ(case):
    """Subjects whose embeddings differ from the others' where heads read them: the split
    and the cohort keys must follow (a value row that differs is the row's own term)."""
    name, taskset, w, eps, steps = case
    try:
        with np.errstate(all="ignore"):
            fp = FactoredPass(Prepared(w), _split(taskset, w))
    except TaskError:
        return
    if _layout_problem(taskset, w):
        return
    event("diverse heads: %d of %d" % (sum(fp.split.diverse), len(fp.split.diverse)))
    misses = _contained(taskset, w, fp, (name, steps))
    assert not misses, misses[:5]


@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial(WORD_AND_OBJECT))
def test_factored_object_probability_is_enclosed_beside_a_word(case):
    """Object queries whose valid set also holds a template word: P_ablated(o) alone."""
    name, taskset, w, eps, steps = case
    try:
        with np.errstate(all="ignore"):
            fp = FactoredPass(Prepared(w), _split(taskset, w))
    except TaskError:
        return
    if _layout_problem(taskset, w):
        return
    misses = _contained(taskset, w, fp, (name, steps))
    assert not misses, misses[:5]


def _entity_direction_changed(w, taskset, coordinate: str, value: float):
    """``w`` with one subject's E entry at residual coordinate ``coordinate`` (a label, or its
    block followed by ``*``: the block's first coordinate) set to ``value``."""
    labels = list(w.residual_labels)
    col = next(i for i, x in enumerate(labels) if x == coordinate or (coordinate.endswith("*")
                                                                       and x.startswith(coordinate[:-1])))
    entity = token_map(taskset, w)[taskset.fact_ids[0][0][0]]       # the first task's first subject
    E = sp.lil_matrix(w.E, copy=True)
    E[entity, col] = value
    return w.replace(E=sp.csr_matrix(E))


@pytest.fixture(scope="module")
def capitals():
    ts = load_tasks("examples/capitals.yaml")
    return ts, build(ts).instantiate()


def test_the_split_is_the_heads_whose_entities_differ(capitals):
    ts, w = capitals
    split = _split(ts, w)
    # the structure heads read "an entity" (the same for all), the subject head which one
    assert split.diverse == tuple([False] * (len(w.heads) - 1) + [True])
    assert split.entity[token_map(ts, w)[ts.vocabulary.n_words:]].all()
    assert not split.entity[token_map(ts, w)[:ts.vocabulary.n_words]].any() and not split.entity[w.bos]
    # one entity's "entity" coordinate (read by every structure head's W_V) changed: every head diverse
    assert all(_split(ts, _entity_direction_changed(w, ts, "entity", 1.5)).diverse)
    # one entity with a word's direction too (read by the structure heads' W_V, by no query or key)
    assert all(_split(ts, _entity_direction_changed(w, ts, "word:*", 1.0)).diverse)
    # a coordinate no head's W_V reads ("one") changed: the split is unchanged
    assert _split(ts, _entity_direction_changed(w, ts, "one", 2.0)).diverse == split.diverse


def test_a_wrong_split_misses_exact_values_and_the_right_one_does_not(capitals):
    """The factoring is sound because the split is right. One entity also carries a word's
    direction, which the structure heads' values read and no query or key does: its
    attention class is the other entities', its value rows are not. With those heads forced
    uniform, the shared part of its rows is another entity's, and the containment
    comparison finds exact values outside the enclosures; with the split computed, none."""
    ts, w = capitals
    moved = _entity_direction_changed(w, ts, "word:*", 1.0)
    right = _split(ts, moved)
    assert _contained(ts, moved, FactoredPass(Prepared(moved), right), "right split") == []
    wrong = Split(right.entity, tuple([False] * (len(moved.heads) - 1) + [True]))
    assert _contained(ts, moved, FactoredPass(Prepared(moved), wrong), "wrong split")


def test_heads_that_read_nothing_for_queries_and_keys_are_enclosed(capitals):
    """Every head's W_Q and W_K with no rows (attention uniform over the prefix): all tokens
    fall in one query/key class, and both passes still contain the exact values."""
    from layout.weights import Head

    ts, w = capitals
    blind = w.replace(heads=tuple(Head(sp.csr_matrix((0, w.d)), sp.csr_matrix((0, w.d)), h.W_V, h.W_O)
                                  for h in w.heads))
    with np.errstate(all="ignore"):
        plain, factored = Prepared(blind), FactoredPass(Prepared(blind), _split(ts, blind))
    assert len(np.unique(plain.qk_class)) == 1
    assert _contained(ts, blind, plain, "plain") == []
    assert _contained(ts, blind, factored, "factored") == []


FIELDS = ("expert", "margin", "ambiguous", "err_lo", "err_hi", "ablated_lo", "ablated_hi", "predicted", "rho_lo",
          "rho_hi", "ablated_rho_lo", "ablated_rho_hi", "active", "ablated_gap", "ablated_zeros", "ablated_object_lo",
          "gate_rad")


def _same(a, b) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


def _candidates(res, i):
    ptr, cand = res.candidates
    return sorted(cand[ptr[i]:ptr[i + 1]].tolist())


@pytest.mark.parametrize("name", ["capitals", "generated"])
def test_a_rows_result_does_not_depend_on_its_batch(name):
    """Rows of one prefix length shuffled and cut into other batches (so that their cohorts
    meet other rows, or none) give bitwise the same results, every field."""
    ts = load_tasks("examples/capitals.yaml") if name == "capitals" else wikidata_like(600, n_tasks=5, seed=3)
    w = build(ts).instantiate()
    tmap = token_map(ts, w)
    fp = FactoredPass(Prepared(w), _split(ts, w))
    rng = np.random.default_rng(0)
    for b in batches(ts, chunk=5000):
        tokens, valid = tmap[b.tokens], tmap[b.valid]
        target = np.where(b.target >= 0, tmap[np.maximum(b.target, 0)], -1)
        whole = fp.run_batch(tokens, b.valid_ptr, valid, target=target)
        perm = rng.permutation(len(b))
        for rows in np.array_split(perm, min(len(b), 3)):
            if not rows.size:
                continue
            sub = b.take(rows)
            part = fp.run_batch(tmap[sub.tokens], sub.valid_ptr, tmap[sub.valid], target=target[rows])
            for field in FIELDS:
                assert _same(getattr(part, field), getattr(whole, field)[rows]), (name, b.p, field)
            for t in range(3):
                assert _same(part.top_gate[t], whole.top_gate[t][rows])
            assert _same(part.gate_mid, whole.gate_mid[rows])
            assert all(_candidates(part, u) == _candidates(whole, r) for u, r in enumerate(rows))


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task_sets())
def test_the_factored_pass_decides_as_the_plain_pass(ts):
    """Built models: the same winner, candidates and decisions; enclosures equal to rounding."""
    w = build(ts).instantiate()
    tmap = token_map(ts, w)
    prep = Prepared(w)
    fp = FactoredPass(prep, _split(ts, w))
    eps = 0.01
    for b in batches(ts):
        args = (tmap[b.tokens], b.valid_ptr, tmap[b.valid])
        target = np.where(b.target >= 0, tmap[np.maximum(b.target, 0)], -1)
        a = prep.run_batch(*args, target=target)
        f = fp.run_batch(*args, target=target)
        assert _same(a.expert, f.expert) and _same(a.ambiguous, f.ambiguous)
        assert all(_candidates(a, i) == _candidates(f, i) for i in range(len(b)))
        assert _same(a.err_hi < eps, f.err_hi < eps) and _same(a.ablated_lo >= eps, f.ablated_lo >= eps)
        for field in ("err_lo", "err_hi", "ablated_lo", "ablated_hi", "ablated_object_lo", "margin"):
            x, y = getattr(a, field), getattr(f, field)
            assert np.allclose(x, y, rtol=1e-9, atol=1e-9, equal_nan=True), field
        assert _same(a.ablated_zeros, f.ablated_zeros)
        assert _same(a.ablated_gap >= 0, f.ablated_gap >= 0)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=14), st.lists(st.integers(0, 9), max_size=6)),
                min_size=1, max_size=12))
def test_compact_accumulator_slots_are_a_rows_columns_in_order(rows):
    """Rows of touches (each row a new stamp) and, after each row, lookups: every touch
    gets the column's slot among the row's columns in order of first touch, a lookup finds
    exactly the row's columns, and a column an earlier row left behind is never taken for
    the current row's (the stale slot maps of earlier rows are the case that matters)."""
    from verifier.arithmetic.accumulate import slot as _at
    from verifier.arithmetic.accumulate import slot_of as _slot_of

    n = 10
    acc, touched, where = np.zeros((n, 5)), np.zeros(n, np.int64), np.zeros(n, np.int32)
    for r, (cols, asks) in enumerate(rows):
        s = float(r + 1)                                   # stamps start at 1 and are never reused
        mine: dict[int, int] = {}
        nt = 0
        for col in cols:
            sl, nt = _at(col, acc, s, touched, nt, where)
            assert sl == mine.setdefault(col, len(mine)) and nt == len(mine)
            acc[sl, 1] += 1.0                              # the row's own sums stay in their slots
        for col in range(n):
            assert _slot_of(col, acc, s, touched, where) == mine.get(col, -1)
        for col in asks:
            assert _slot_of(col, acc, s, touched, where) == mine.get(col, -1)
        for col, sl in mine.items():
            assert touched[sl] == col and acc[sl, 1] == cols.count(col)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 9), st.floats(-1e6, 1e6), st.floats(0, 1e3)), max_size=20),
                min_size=1, max_size=6))
def test_dense_and_compact_accumulators_hold_the_same_sums(rows):
    """The plain pass keeps a row's sums at each column's own index (dense), the factored pass
    in slots (compact); the kernel functions both run take either (accumulate.place): the same
    columns in the same order with bitwise the same sums, row after row."""
    from verifier.arithmetic.accumulate import product_terms
    from verifier.arithmetic.logits import row_logits

    n = 10
    dense, d_touched = np.zeros((n, 5)), np.zeros(n, np.int64)
    compact, c_touched, where = np.zeros((n, 5)), np.zeros(n, np.int64), np.zeros(n, np.int32)
    for r, terms in enumerate(rows):
        s = float(r + 1)
        ptr = np.array([0, len(terms)], np.int64)
        idx = np.array([c for c, _, _ in terms], np.int64)
        mid = np.array([m for _, m, _ in terms])
        rad = np.array([x for _, _, x in terms])
        rows_ = (ptr, idx, mid, rad, rad)                 # logit rows: (ptr, idx, mid, rad, magnitude)
        no_y = (np.zeros((1, 5)), np.zeros(1, np.int64), None)
        UT = (np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0))
        nd = row_logits(rows_, 0, UT, no_y, 0, dense, s, d_touched, None, None, 1.0, 0.0)[0]
        nc = row_logits(rows_, 0, UT, no_y, 0, compact, s, c_touched, where, None, 1.0, 0.0)[0]
        nd = product_terms(ptr, idx, mid, 0, 1.5, 0.25, dense, s, d_touched, nd, None)
        nc = product_terms(ptr, idx, mid, 0, 1.5, 0.25, compact, s, c_touched, nc, where)
        assert nd == nc == len(set(idx.tolist()))
        assert np.array_equal(d_touched[:nd], c_touched[:nc])
        for u in range(nc):
            assert dense[d_touched[u]].tobytes() == compact[u].tobytes()


def test_work_arrays_let_go_after_a_batch_that_spills_change_no_result(monkeypatch):
    """A batch whose accumulators pass SPILL slots lets the work arrays go (they are made
    anew for the next batch), and every batch's results are bitwise those of a pass that
    keeps them."""
    import verifier.passes.factored as F

    ts = wikidata_like(600, n_tasks=5, seed=3)
    w = build(ts).instantiate()
    tmap = token_map(ts, w)
    keep, trim = FactoredPass(Prepared(w), _split(ts, w)), FactoredPass(Prepared(w), _split(ts, w))
    released = 0
    for b in batches(ts, chunk=5000):
        args = (tmap[b.tokens], b.valid_ptr, tmap[b.valid])
        target = np.where(b.target >= 0, tmap[np.maximum(b.target, 0)], -1)
        monkeypatch.setattr(F, "SPILL", 10 ** 9)
        want = keep.run_batch(*args, target=target)
        assert keep._scratch is not None
        monkeypatch.setattr(F, "SPILL", 3)
        got = trim.run_batch(*args, target=target)
        released += trim._scratch is None
        for field in FIELDS:
            assert _same(getattr(got, field), getattr(want, field)), (b.p, field)
    assert released > 0


# --- L1 through the large-table subtraction (verifier.arithmetic.logits.error_enclosure_parts) -------


def _large_table_case(dominant: float = 40.0):
    """A task of 80 subjects and 9 objects ("s of o"), its built weights with U reading the
    last position's coordinate ``pos:2`` for every token: 2^-4 for the subjects and the word,
    −1 for the objects but o0, ``dominant`` for o0. The ablated logits U·r of an object query
    ("s of") are then those numbers, all from the cohort's shared part (P at the last
    position), none from the row's own: a shared table of 89 tokens (more than
    ``factored.DIRECT``), holding every query's object, where o0 dominates (1 − P(o0) is
    3.8·10^-16 at 40, below the rounding of the table's sum; 0.37 at 5) and the other
    objects are improbable (L1 holds for them, |O_k| = 9)."""
    facts = {f"s{i:02d}": f"o{i % 9}" for i in range(80)}
    ts = TaskSet((Task("a", (Template.parse("⋆1 of ⋆2"),), Facts(facts)),), epsilon=0.01)
    w = build(ts).instantiate()
    col = w.residual_labels.index("pos:2")
    U = sp.lil_matrix(w.U, copy=True)
    objects = {f"o{j}" for j in range(9)}
    for t, name in enumerate(w.vocab):
        if name == "o0":
            U[t, col] = dominant
        elif name in objects:
            U[t, col] = -1.0
        elif name in ts.vocabulary.tokens:
            U[t, col] = 2.0 ** -4
    return ts, w.replace(U=sp.csr_matrix(U))


def _object_queries(ts, w):
    """(tokens, valid_ptr, valid, targets) of the object queries, weights' ids."""
    tmap = token_map(ts, w)
    for b in batches(ts):
        rows = np.flatnonzero(b.target >= 0)
        if rows.size:
            b = b.take(rows)
            yield tmap[b.tokens], b.valid_ptr, tmap[b.valid], tmap[b.target]


def _python_ablated_parts(monkeypatch, error_parts):
    """The factored pass's ablation run as Python (``ablated_parts.py_func``), calling
    ``error_parts`` for each error enclosure (the compiled helpers it calls stay compiled), so
    that a counter or a mutant of ``error_enclosure_parts`` can stand in (inside compiled code the
    compiled one would be called)."""
    from verifier.arithmetic import logits as F_

    monkeypatch.setattr(F_, "ablated_parts", F_.ablated_parts.py_func)
    monkeypatch.setattr(F_, "error_enclosure_parts", error_parts)


def _mutant(old: str, new: str):
    """``error_enclosure_parts`` and the subtraction it calls (``_table_rest``) as Python,
    with the source ``old`` replaced by ``new`` in the one of them that holds it."""
    import inspect
    import textwrap

    from verifier.arithmetic import logits as F_

    namespace = dict(vars(F_))
    found = 0
    for name in ("_table_rest", "error_enclosure_parts"):
        src = textwrap.dedent(inspect.getsource(getattr(F_, name).py_func))
        src = src[src.index("def "):]                   # without the @kernel() line
        found += src.count(old)
        exec(compile(src.replace(old, new), f"<mutant of {name}>", "exec"), namespace)
    assert found == 1, old
    return namespace["error_enclosure_parts"]


def _l1_numbers(ts, w, fp):
    """Per object query: (prefix, object, the pass's lower end of 1 − P_ablated(o), the exact
    1 − P_ablated(o) at 60 digits)."""
    fpr = _Fingerprints(w)
    out = []
    for tokens, vptr, valid, target in _object_queries(ts, w):
        res = fp.run_batch(tokens, vptr, valid, target=target)
        for i in range(tokens.shape[0]):
            ex = ORACLE.evaluate(w, fpr, tuple(int(t) for t in tokens[i]), frozenset([int(target[i])]), True, 60,
                                 target=int(target[i]))
            out.append((tuple(tokens[i]), int(target[i]), float(res.ablated_object_lo[i]), 1 - ex["p_object"]))
    return out


@pytest.mark.parametrize("dominant", [40.0, 5.0])
def test_l1_through_the_large_table_subtraction_encloses_the_exact_value(monkeypatch, dominant):
    """Directed: the factored pass's L1 number for object queries whose object sits in a
    shared table of more than ``DIRECT`` tokens and dominates it, computed as the table's sum
    minus the object's share (every call takes that branch: counted), encloses the exact
    1 − P_ablated(o) and decides L1 as the plain pass does; its numbers are the plain
    pass's to 10^-12 except where the exact value (3.8·10^-16) is below the rounding of the
    table's sum, where the difference is clamped to 0 (sound: a lower end)."""
    from verifier.arithmetic import logits as F_
    from verifier.checks.localization import l1_thresholds

    ts, w = _large_table_case(dominant)
    calls = []
    compiled = F_.error_enclosure_parts

    def counting(*args):
        cohort, vlo, vhi = args[6], args[8], args[9]
        calls.append((int(cohort[0]), int(vhi - vlo)))
        return compiled(*args)

    _python_ablated_parts(monkeypatch, counting)
    fp = FactoredPass(Prepared(w), _split(ts, w))
    numbers = _l1_numbers(ts, w, fp)
    assert len(numbers) == 80
    assert calls and all(nL > F_.DIRECT and 2 * nv < nL for nL, nv in calls)      # the subtraction, every time
    misses = [n for n in numbers if not inside(n[2], n[3], math.inf)]
    assert not misses, misses[:3]
    o0 = token_map(ts, w)[ts.vocabulary.id("o0")]
    assert {o for _, o, _, exact in numbers if exact < 0.5} == {o0}            # the dominant object
    # the plain pass decides L1 alike (threshold 1 − 1/9), on every query
    monkeypatch.undo()
    plain = {(p, o): lo for p, o, lo, _ in _l1_numbers(ts, w, Prepared(w))}
    thr = l1_thresholds(ts)[1][0]
    for p, o, lo, exact in numbers:
        assert (lo >= thr) == (plain[p, o] >= thr) == (o != o0), (p, o, lo, plain[p, o])
        assert math.isclose(lo, plain[p, o], rel_tol=1e-12) or (o == o0 and dominant > 30 and lo == 0.0)


@pytest.mark.parametrize("old, new", [
    # the object's share kept in
    ("                sub = _in_table(sub, w, elo, ehi)\n    # and Σ over", "\n    # and Σ over"),
    # not clamped
    ("    rest_lo = max(step_down(s_lo - q_hi, QUICK), 0.0)", "    rest_lo = abs(step_down(s_lo - q_hi, QUICK))"),
])
def test_a_broken_large_table_subtraction_is_caught(monkeypatch, old, new):
    """Mutants of the subtraction: the object's share not taken out of the table's sum; a
    negative difference (the table's rounded sum minus the object's, below the rounding of
    the larger) taken by its magnitude instead of clamped at 0. Each puts the lower end of
    1 − P_ablated(o0) above the exact value, which the oracle catches. (Subtracting the
    share's lower bound instead of its upper one, or the table's upper sum for its lower
    one, are not among them: the table's own rounding allowance, over more than 64 terms,
    covers those few ulps, so such a mutant stays sound here.) The harness itself (the same
    Python ablation with the real ``error_enclosure_parts``) gives the compiled pass's numbers bit
    for bit."""
    from verifier.arithmetic import logits as F_

    ts, w = _large_table_case()
    compiled = [n[2] for n in _l1_numbers(ts, w, FactoredPass(Prepared(w), _split(ts, w)))]
    unchanged, broken = _mutant("    direct = nL", "    direct = nL"), _mutant(old, new)
    _python_ablated_parts(monkeypatch, unchanged)
    same = _l1_numbers(ts, w, FactoredPass(Prepared(w), _split(ts, w)))
    assert [n[2] for n in same] == compiled
    monkeypatch.setattr(F_, "error_enclosure_parts", broken)
    numbers = _l1_numbers(ts, w, FactoredPass(Prepared(w), _split(ts, w)))
    misses = [n for n in numbers if not inside(n[2], n[3], math.inf)]
    assert misses
