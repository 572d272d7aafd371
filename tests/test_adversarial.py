"""No false certificate on adversarial weights, found by search rather than by imagination.

Hypothesis draws weights from the built models of small task sets and then applies up
to three adversarial edits: any mutation operator (encodings, underflow paths, huge
cancelling pairs, rescaled directions, ...) or a single entry set to ±m·2^e with e
anywhere in float64's exponent range. Two properties, against the independent oracle
(exact linear algebra, exp at 60 digits):

* **containment**: for every query, the exact gate scores, margin, error and ablated
  error lie inside the verifier's enclosures (the strong property: it fails on an
  unsound enclosure even when no verdict flips);
* **no false pass**: if :func:`verifier.checks.verify.verify` certifies, the oracle finds no
  violation.

The small sets' object queries have their object as only valid next token, where L1's lower
end of 1 − P_ablated(o) is the ablated error's; a set whose object queries also admit a
template word (``word-and-object``) reaches the enclosure of o's probability alone, checked
for containment and no false pass the same way.

A weights object the verifier refuses (bad input) satisfies both trivially.
"""

from __future__ import annotations

import math
from pathlib import Path

import mpmath
import numpy as np
import scipy.sparse as sp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from budget import examples

from tasks.errors import TaskError
from tasks.reading import load_tasks
from audit import mutants as M
from audit.oracle import Oracle, _Fingerprints, _layout_problem, enumerate_queries
from verifier.checks.certify import certify
from verifier.checks.verify import verify

SETS = M.small_sets()
#: Object queries "X lives in" with two valid next tokens, the object and the word "the":
#: L1 encloses P_ablated(o) alone there (:func:`verifier.arithmetic.kernels.ablated`).
WORD_AND_OBJECT = {"word-and-object": load_tasks(Path(__file__).parent / "data" / "word_and_object.yaml")}
OPERATORS = sorted(M.OPERATORS)
ORACLE = Oracle(dps=60)


def _value():
    exponent = st.one_of(st.integers(-1074, 1010), st.integers(-1074, -1000), st.integers(990, 1010), st.integers(-40, 40))
    return st.builds(lambda m, e, s: s * math.ldexp(m, e), st.integers(1, 255), exponent, st.sampled_from([1.0, -1.0]))


@st.composite
def adversarial(draw, sets: dict = SETS):
    name = draw(st.sampled_from(sorted(sets)))
    taskset, w, eps = M.built(name, sets[name])
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            op = draw(st.sampled_from(OPERATORS))
            try:
                made = M.mutate(M.OPERATORS[op], w, np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1))))
            except ValueError:   # an earlier step stored a matrix non-canonically: it cannot be edited further
                made = None
            if made is None:
                continue
            w, text = made
            steps.append(f"{op}: {text}")
        else:
            arrays = [(n, g, p) for n, g, p, _ in M._arrays_with_entries(w)]
            aname, get, put = arrays[draw(st.integers(0, len(arrays) - 1))]
            m = get()
            v = draw(_value())
            if sp.issparse(m):
                i, j = draw(st.integers(0, m.shape[0] - 1)), draw(st.integers(0, m.shape[1] - 1))
                try:
                    lil = sp.lil_matrix(m, copy=True)
                    lil[i, j] = v
                    w = put(M._csr(lil))
                except ValueError:
                    continue
                steps.append(f"{aname}[{i}, {j}] = {v!r}")
            else:
                i = draw(st.integers(0, m.size - 1))
                vec = np.array(m, np.float64, copy=True)
                vec[i] = v
                w = put(vec)
                steps.append(f"{aname}[{i}] = {v!r}")
    return name, taskset, w, eps, steps


def _enclosures(taskset, w, queries):
    """The verifier's enclosures for every query (the public per-query API; TaskError if refused)."""
    with np.errstate(all="ignore"):
        return certify(w, [q.prefix for q in queries], [q.valid for q in queries], ablate=True)


def _inside(lo, value, hi) -> bool:
    lo, hi = float(lo), float(hi)
    if math.isnan(lo) or math.isnan(hi):
        return True   # NaN bounds are read as (−∞, ∞) by every check
    return mpmath.mpf(lo) <= value <= mpmath.mpf(hi)


PROFILE_SMALL = settings(max_examples=examples(20), deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROFILE
@given(adversarial())
def test_enclosures_contain_the_exact_values(case):
    name, taskset, w, eps, steps = case
    queries = enumerate_queries(taskset)
    try:
        res = _enclosures(taskset, w, queries)
    except TaskError:
        event("refused as bad input")
        return   # nothing certified
    if _layout_problem(taskset, w):
        event("refused as bad input")
        return
    event("enclosures checked")
    index = {t: i for i, t in enumerate(w.vocab)}
    fp = _Fingerprints(w)
    for i, q in enumerate(queries):
        ex = ORACLE.evaluate(w, fp, tuple(index[t] for t in q.prefix), frozenset(index[t] for t in q.valid), True, 60)
        where = (name, steps, " ".join(q.prefix))
        assert _inside(res.err_lo[i], ex["error"], res.err_hi[i]), (where, res.err_lo[i], ex["error"], res.err_hi[i])
        assert _inside(res.ablated_lo[i], ex["ablated"], res.ablated_hi[i]), (where, "ablated")
        for k, g in enumerate(ex["gates"]):
            assert _inside(res.gate_lo[i, k], g, res.gate_hi[i, k]), (where, "gate", k)
        e = int(res.expert[i])
        others = [g for k, g in enumerate(ex["gates"]) if k != e]
        if others and math.isfinite(res.margin[i]):
            assert mpmath.mpf(float(res.margin[i])) <= ex["gates"][e] - max(others), (where, "margin")


@PROFILE
@given(adversarial())
def test_no_false_certificate(case):
    name, taskset, w, eps, steps = case
    try:
        with np.errstate(all="ignore"):
            report = verify(taskset, w, eps, source="adversarial")
    except TaskError:
        event("refused as bad input")
        return
    event("certified" if report.certified else "not certified")
    if report.certified:
        truth = ORACLE.judge(taskset, w, eps)
        assert not truth.violating, (name, steps, truth.summary(), [v.detail for v in truth.violations])


@PROFILE_SMALL
@given(adversarial(WORD_AND_OBJECT))
def test_the_objects_ablated_probability_is_enclosed(case):
    """L1's number, a lower end of 1 − P_ablated(o) for o alone (``ablated_object_lo``),
    contains the exact value at every object query, also where the valid set holds a word
    besides o; and a certified model has no violation the oracle finds (L1 on P(o) included)."""
    from verifier.checks.verify import token_map
    from verifier.passes.batches import batches
    from verifier.passes.forward import Prepared

    name, taskset, w, eps, steps = case
    try:
        with np.errstate(all="ignore"):
            prep = Prepared(w)
            report = verify(taskset, w, eps, source="adversarial")
    except TaskError:
        event("refused as bad input")
        return
    tmap, fp = token_map(taskset, w, "weights"), _Fingerprints(w)
    seen = 0
    for b in batches(taskset):
        tokens = tmap[b.tokens]
        with np.errstate(all="ignore"):
            res = prep.run_batch(tokens, b.valid_ptr, tmap[b.valid], target=np.where(b.target >= 0, tmap[b.target], -1))
        for i in np.flatnonzero(b.target >= 0):
            o = int(tmap[b.target[i]])
            ex = ORACLE.evaluate(w, fp, tuple(int(t) for t in tokens[i]), frozenset({o}), True, 60)
            lo = float(res.ablated_object_lo[i])
            assert math.isnan(lo) or mpmath.mpf(lo) <= ex["ablated"], (steps, i, lo, ex["ablated"])
            seen += b.valid_ptr[i + 1] - b.valid_ptr[i] > 1
    assert seen == 4                       # "X lives in": the object and the word "the"
    event("certified" if report.certified else "not certified")
    if report.certified:
        truth = ORACLE.judge(taskset, w, eps)
        assert not truth.violating, (name, steps, truth.summary(), [v.detail for v in truth.violations])
