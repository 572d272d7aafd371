"""The dense pass (BLAS): its primitives against exact arithmetic, the whole pass against the
60-digit oracle, and beside the plain pass on trained models.

Every enclosure must contain the exact value: products against ``fractions.Fraction``
(Lemma D of :mod:`verifier.arithmetic.dense`, dense and sparse blocks, over the whole
exponent range), the tabled exponential and the readout against mpmath, and the whole
pass (attention, residual, gate, experts, logits, ablation) against the independent oracle
of :mod:`audit.oracle` on random dense models.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import scipy.sparse as sp
from budget import FULL, examples
from hypothesis import given, settings
from hypothesis import strategies as st

from verifier.arithmetic import dense as D
from verifier.arithmetic.rounding import down_finite, up_finite

SETTINGS = settings(max_examples=examples(120), deadline=None)


def floats(lo: int = -1074, hi: int = 1000):
    """±m·2^(e-b+1) with m of b <= 8 bits, so the leading bit sits at 2^e, e anywhere in [lo, hi]
    (weighted towards both ends), or 0. Below 2^-1074 + b the value rounds to a subnormal or 0."""
    exponent = st.one_of(st.integers(lo, hi), st.integers(lo, lo + 60), st.integers(hi - 60, hi), st.integers(-30, 30))
    return st.one_of(st.just(0.0),
                     st.builds(lambda m, e, s: s * math.ldexp(m, e - m.bit_length() + 1), st.integers(1, 255), exponent,
                               st.sampled_from([1.0, -1.0])))


def matrices(rows: int, cols: int, lo: int = -1074, hi: int = 1000, zeros: float = 0.0):
    return st.lists(floats(lo, hi), min_size=rows * cols, max_size=rows * cols).map(
        lambda v: np.array(v).reshape(rows, cols))


def _F(x) -> Fraction:
    return Fraction(float(x))


# --- Lemma D -----------------------------------------------------------------------------------


@SETTINGS
@given(matrices(3, 5), matrices(3, 5, -1074, -900), matrices(5, 4), st.booleans())
def test_products_enclose_every_point_of_the_interval(Xm, Xr, B, sparse_block):
    """|x·B − mid| <= rad for every x in [Xm ± Xr]: the worst point's distance is
    |Σ (xm − mid)| + Σ xr·|b| (exact rationals), for a block taken dense (BLAS) or sparse."""
    Xr = np.abs(Xr)
    if sparse_block:
        B = np.where(np.arange(B.size).reshape(B.shape) % 3 == 0, B, 0.0)     # two thirds zero: sparse
    block = D.Matrix.of(sp.csr_matrix(B) if sparse_block else B)
    assert block.dense == (np.count_nonzero(B) >= D.DENSE * B.size)
    with np.errstate(all="ignore"):
        mid, rad = D.product(Xm, Xr, block)
    for i in range(3):
        for k in range(4):
            if not (math.isfinite(mid[i, k]) and math.isfinite(rad[i, k])):
                continue
            centre = sum(_F(Xm[i, j]) * _F(B[j, k]) for j in range(5))
            spread = sum(_F(Xr[i, j]) * abs(_F(B[j, k])) for j in range(5))
            assert abs(centre - _F(mid[i, k])) + spread <= _F(rad[i, k]), (i, k)


def test_a_product_that_overflows_is_unbounded():
    X = np.array([[1e308, 1e308]])
    mid, rad = D.product(X, None, D.Matrix.of(np.array([[2.0], [2.0]])))
    assert rad[0, 0] == np.inf


def test_the_blas_probe_passes_here():
    D.check_blas()


@SETTINGS
@given(matrices(4, 3, -60, 60), matrices(4, 3, -80, -20))
def test_add_exact_and_relu_enclose(M, R):
    R = np.abs(R)
    b = np.array([0.75, -1.5, 3.0])
    m, r = D.add_exact(M, R, b)
    om, orad = D.relu(np.ascontiguousarray(m), np.ascontiguousarray(r))
    for i in range(4):
        for j in range(3):
            for corner in (-1, 1):
                x = _F(M[i, j]) + corner * _F(R[i, j]) + _F(b[j])
                assert abs(x - _F(m[i, j])) <= _F(r[i, j])
                assert abs(max(x, 0) - _F(om[i, j])) <= _F(orad[i, j])


# --- rounding steps and the exponential --------------------------------------------------------


@SETTINGS
@given(floats(-1074, 1022))
def test_signed_steps_are_at_least_one_unit(x):
    assert up_finite.jit(x) >= np.nextafter(x, np.inf)
    assert down_finite.jit(x) <= np.nextafter(x, -np.inf)
    if x >= 0:
        assert D.up_nonneg_array(np.array([x]))[0] >= np.nextafter(x, np.inf)
        assert D.down_nonneg_array(np.array([x]))[0] <= max(np.nextafter(x, -np.inf), 0.0)


EDGES = [0.0, -0.0, 1 / 64, -1 / 64, 2.0 ** -1074, -(2.0 ** -1074), -745.0, -744.99, -745.01, 63.99, 64.0, 700.0,
         709.5, -1e-300, D.SKIP, -40.0, -1000.0]


@settings(max_examples=examples(400), deadline=None)
@given(st.one_of(st.floats(-800, 720, allow_nan=False), st.sampled_from(EDGES)),
       st.one_of(st.just(0.0), st.floats(0, 2), st.sampled_from([2.0 ** -60, 1e-12, 1.0])))
def test_the_tabled_exponential_encloses(x, delta):
    mp = mpmath.mp.clone()
    mp.dps = 50
    lo, hi = D.exp_below.jit(x, D.EXP_LO), D.exp_above.jit(x, D.EXP_HI)
    e = mp.exp(mp.mpf(x))
    assert mp.mpf(lo) <= e <= mp.mpf(hi)
    a, b = D.exp_around.jit(x, delta, D.EXP_LO, D.EXP_HI)
    assert mp.mpf(a) <= mp.exp(mp.mpf(x) - mp.mpf(delta)) and mp.exp(mp.mpf(x) + mp.mpf(delta)) <= mp.mpf(b)


def test_the_tabled_exponential_is_as_tight_as_the_polynomial_one():
    """Within about 10^-12 relative over the range a softmax uses (the degree-14 one: 4e-13)."""
    xs = np.linspace(-600, 60, 2001)
    lo = np.array([D.exp_below.jit(float(x), D.EXP_LO) for x in xs])
    hi = np.array([D.exp_above.jit(float(x), D.EXP_HI) for x in xs])
    assert np.all((hi - lo) / hi < 1e-12)


# --- attention and the readout -----------------------------------------------------------------


def _softmax(mp, xs):
    top = max(xs)
    ex = [mp.exp(x - top) for x in xs]
    s = mp.fsum(ex)
    return [e / s for e in ex]


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 6), st.sampled_from([0.0, 1e-9, 1e-3]))
def test_attention_encloses_the_softmax_of_every_score(seed, p1, spread):
    rng = np.random.default_rng(seed)
    V, npos, widths = 5, 7, np.array([3, 2], np.int64)
    W = int(widths.sum())
    starts = np.array([0, 3], np.int64)
    tables = [rng.normal(0, 3, (V, W)), np.abs(rng.normal(0, spread, (V, W))), rng.normal(0, 3, (npos, W)),
              np.abs(rng.normal(0, spread, (npos, W)))]
    keys = [rng.normal(0, 3, (V, W)), np.abs(rng.normal(0, spread, (V, W))), rng.normal(0, 3, (npos, W)),
            np.abs(rng.normal(0, spread, (npos, W)))]
    ids = rng.integers(0, V, (4, p1)).astype(np.int64)
    am, ar = D.attention(ids, *tables, *keys, starts, widths, D.EXP_LO, D.EXP_HI)
    mp = mpmath.mp.clone()
    mp.dps = 40
    for trial in range(3):                       # the midpoints and two random points of the inputs' boxes
        pick = lambda m, r: m + (0 if trial == 0 else rng.uniform(-1, 1, m.shape) * r)  # noqa: E731
        Q = [pick(tables[0], tables[1]), pick(tables[2], tables[3])]
        K = [pick(keys[0], keys[1]), pick(keys[2], keys[3])]
        for i in range(ids.shape[0]):
            for h, (a0, t) in enumerate(zip(starts, widths)):
                q = [mp.mpf(float(Q[0][ids[i, -1], a0 + u])) + mp.mpf(float(Q[1][p1 - 1, a0 + u])) for u in range(t)]
                scores = []
                for j in range(p1):
                    k = [mp.mpf(float(K[0][ids[i, j], a0 + u])) + mp.mpf(float(K[1][j, a0 + u])) for u in range(t)]
                    scores.append(mp.fsum(a * b for a, b in zip(q, k)))
                for j, a in enumerate(_softmax(mp, scores)):
                    assert abs(a - mp.mpf(float(am[i, h, j]))) <= mp.mpf(float(ar[i, h, j])), (i, h, j)


@settings(max_examples=examples(80), deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([1e-15, 1e-6, 0.5]), st.sampled_from([1.0, 10.0, 60.0]),
       st.booleans())
def test_the_readout_encloses_error_gap_and_object(seed, rad, scale, lazy):
    """Every z in the box: its error, its gap max_{t != o} z_t − z_o and 1 − P(o) lie within
    what the readout certifies (given whole radii, or finished lazily from Lemma D's parts)."""
    rng = np.random.default_rng(seed)
    n, V, d = 5, 40, 4
    Y = rng.normal(0, 1, (n, d))
    U = rng.normal(0, scale, (V, d))
    Yr = np.abs(rng.normal(0, rad, (n, d)))
    block = D.Matrix.of(U.T)
    if lazy:
        Lm, S, c, f = D.product_parts(Y, Yr, block)
        Lr = np.zeros((0, 0))
        args = (Lm, Lr, S, np.ascontiguousarray(np.abs(U)), np.abs(U).max(axis=1), c, f)
        _, Lr_full = D.product(Y, Yr, block)
    else:
        Lm, Lr_full = D.product(Y, Yr, block)
        args = (Lm, Lr_full, np.zeros((0, 0)), np.zeros((0, 0)), np.zeros(0), 0.0, 0.0)
    ptr = np.array([0, 1, 3, 3, 4, 6], np.int64)
    valid = rng.integers(0, V, ptr[-1]).astype(np.int64)
    target = np.array([valid[0], valid[1], -1, rng.integers(0, V), valid[4]], np.int64)
    lo, hi, pred, gap, obj = D.readout(*args, ptr, valid, target, np.zeros(V, np.int64), D.EXP_LO, D.EXP_HI)
    mp = mpmath.mp.clone()
    mp.dps = 40
    for i in range(n):
        assert pred[i] == int(np.argmax(Lm[i]))
        for trial in range(3):
            z = Lm[i] + (0 if trial == 0 else rng.uniform(-1, 1, V) * Lr_full[i])
            p = _softmax(mp, [mp.mpf(float(v)) for v in z])
            good = set(valid[ptr[i]:ptr[i + 1]].tolist())
            err = mp.fsum(p[t] for t in range(V) if t not in good)          # 1 − P(valid), without cancelling
            slack = err * mp.mpf(10) ** -30                                   # mpmath's own rounding at 40 digits
            assert mp.mpf(float(lo[i])) - slack <= err <= mp.mpf(float(hi[i])) + slack, (i, trial)
            o = target[i]
            if o >= 0:
                true_gap = max(mp.mpf(float(z[t])) for t in range(V) if t != o) - mp.mpf(float(z[o]))
                assert mp.mpf(float(gap[i])) <= true_gap
                assert mp.mpf(float(obj[i])) <= mp.fsum(p[t] for t in range(V) if t != o)
            else:
                assert np.isnan(gap[i]) and np.isnan(obj[i])


def test_a_row_with_a_non_finite_logit_decides_nothing():
    Lm = np.array([[0.0, np.inf, 1.0]])
    lo, hi, _, gap, obj = D.readout(Lm, np.zeros((1, 3)), np.zeros((0, 0)), np.zeros((0, 0)), np.zeros(0), 0.0, 0.0,
                                    np.array([0, 1], np.int64), np.array([0], np.int64), np.array([0], np.int64),
                                    np.zeros(3, np.int64), D.EXP_LO, D.EXP_HI)
    assert (lo[0], hi[0], gap[0], obj[0]) == (0.0, 1.0, -np.inf, 0.0)


# --- the whole pass ----------------------------------------------------------------------------


def random_dense_model(taskset, seed: int, d: int = 8, heads: int = 2, width: int = 6, scaled: bool = False,
                       scale: float = 1.0):
    """Random dense weights in the layout for ``taskset`` (every entry non-zero)."""
    from layout import Expert, Head, Weights

    rng = np.random.default_rng(seed)
    vocab = taskset.vocabulary.tokens
    V, K = len(vocab), len(taskset.tasks)
    dense = lambda r, c, s=1.0: sp.csr_matrix(rng.normal(0, s * scale, (r, c)))  # noqa: E731
    hs = tuple(Head(dense(3, d), dense(3, d), dense(3, d), dense(d, 3)) for _ in range(heads))
    experts = tuple(Expert(dense(width, d), rng.normal(0, 1, width), dense(d, width)) for _ in range(K))
    return Weights(tuple(vocab), dense(V + 1, d), dense(taskset.L, d), hs, dense(K, d), rng.normal(0, 1, K), experts,
                   dense(V, d, 3.0), tuple(taskset.names), "top1-scaled" if scaled else "top1")


@pytest.mark.parametrize("seed,scaled", [(0, False), (1, True), (2, True)])
def test_the_dense_pass_encloses_the_oracle_on_every_query(capitals_set, seed, scaled):
    """Random dense models over capitals: each query's exact gate scores, routing, error,
    ablated error, P_ablated(o) and top-token gap (60 digits) lie within the dense pass's
    enclosures; where the margin is certified the oracle routes alike."""
    from audit.oracle import Oracle, _Fingerprints, enumerate_queries
    from verifier.passes.dense import DensePass, is_dense

    w = random_dense_model(capitals_set, seed, scaled=scaled)
    assert is_dense(w)
    index = {t: i for i, t in enumerate(w.vocab)}
    dp = DensePass(w)
    oracle = Oracle(dps=60)
    fp = _Fingerprints(w)
    mp = mpmath.mp.clone()
    mp.dps = 60
    certified = 0
    for q in enumerate_queries(capitals_set):
        ids = tuple(index[t] for t in q.prefix)
        valid = sorted(index[t] for t in q.valid)
        target = valid[0] if q.object_of and q.determined is not None and len(valid) == 1 else -1
        res = dp.run_batch(np.array([ids], np.int64), np.array([0, len(valid)], np.int64), np.array(valid, np.int64),
                           ablate=np.array([True]), target=np.array([target], np.int64))
        got = oracle.evaluate(w, fp, ids, frozenset(valid), True, 60, target if target >= 0 else None)
        if res.margin[0] > 0:
            certified += 1
            assert got["expert"] == res.expert[0], q.prefix
            assert got["margin"] >= mp.mpf(float(res.margin[0])), q.prefix
        if res.margin[0] > 0 or len(w.experts) == 1:
            assert mp.mpf(float(res.err_lo[0])) <= got["error"] <= mp.mpf(float(res.err_hi[0])), q.prefix
        assert mp.mpf(float(res.ablated_lo[0])) <= got["ablated"] <= mp.mpf(float(res.ablated_hi[0])), q.prefix
        if target >= 0:
            assert got["gap"] >= mp.mpf(float(res.ablated_gap[0])), q.prefix
            assert 1 - got["p_object"] >= mp.mpf(float(res.ablated_object_lo[0])), q.prefix
    assert certified > 0


def test_the_construction_takes_the_plain_pass_and_a_trained_model_the_dense_one(capitals_model):
    import layout
    from verifier.passes.dense import is_dense

    assert not is_dense(capitals_model.instantiate())
    assert is_dense(layout.load("docs/training/weights/K4-E4-localize-s0.npz"))


@pytest.mark.parametrize("name", ["K4-E4-localize-s0", "K8-E8-localize-s1"])
def test_dense_and_plain_passes_agree_on_trained_models(name):
    """The same verdict and the same counts per task, and numbers equal to about 10 digits."""
    import dataclasses

    import layout
    from tasks.io import load_tasks
    from verifier.checks.verify import verify
    from verifier.running import runner

    k = name.split("-")[0]
    ts = load_tasks(f"docs/training/tasks-{k}.yaml")
    w = layout.load(f"docs/training/weights/{name}.npz")
    dense = verify(ts, w, 0.01)
    original = runner.is_dense
    try:
        runner.is_dense = lambda weights: False
        plain = verify(ts, w, 0.01)
    finally:
        runner.is_dense = original
    assert dense.certified == plain.certified
    counts = ("queries", "object_queries", "misrouted", "over_epsilon", "ablation_broken", "l1_held", "l2_held",
              "localized")
    for a, b in zip(dense.tasks, plain.tasks):
        assert [getattr(a, c) for c in counts] == [getattr(b, c) for c in counts]
        for field in ("worst_error", "min_margin", "min_gap", "min_object_lower", "min_ablated_lower"):
            x, y = getattr(a, field), getattr(b, field)
            assert x == pytest.approx(y, rel=1e-9, abs=1e-12), (a.name, field)
    assert dataclasses.asdict(dense.tasks[0]).keys() == dataclasses.asdict(plain.tasks[0]).keys()


# --- the deployed dense pass -------------------------------------------------------------------


@pytest.mark.parametrize("fmt,acc,seed,scaled", [("float32", None, 0, False), ("float32", None, 1, True),
                                                 ("bfloat16", "float32", 2, True), ("bfloat16", None, 3, False)])
def test_the_deployed_dense_pass_contains_every_execution(capitals_set, fmt, acc, seed, scaled):
    """Random dense models: every query's execution in ``fmt`` (the emulator of audit.deployed,
    in each summation order) has its error within the certified enclosure, its routed expert the
    certified one where the margin is positive, and without its expert (each way of removing
    it) its error, 1 − P(o) and top-token gap within the ablation's enclosures."""
    from fractions import Fraction

    from audit.deployed import ABLATIONS, ORDERS, Deployed
    from layout.formats import FORMATS
    from verifier.checks.verify import token_map
    from verifier.passes.batches import batches
    from verifier.passes.dense import DeployedDensePass
    from verifier.passes.floating import Deployment

    w = random_dense_model(capitals_set, seed, d=8, scaled=scaled, scale=0.7)
    dep = Deployment.named(fmt, accumulate=acc)
    dp = DeployedDensePass(w, deployment=dep)
    tmap = token_map(capitals_set, w)
    decided = 0
    for b in batches(capitals_set):
        tokens, valid = tmap[b.tokens], tmap[b.valid]
        target = np.where(b.target >= 0, tmap[np.maximum(b.target, 0)], -1)
        res = dp.run_batch(tokens, b.valid_ptr, valid, target=target)
        for order in ORDERS[:3] if FULL else ORDERS[seed % 3: seed % 3 + 1]:     # all three in the full profile
            run = Deployed(w, FORMATS[fmt], order, seed, acc=dep.acc)
            for i in range(len(b)):
                good = valid[b.valid_ptr[i]:b.valid_ptr[i + 1]]
                with np.errstate(all="ignore"):
                    p, e, _ = run.forward(list(tokens[i]))
                err = 1 - sum(Fraction(float(x)) for x in p[good])
                if res.margin[i] > 0:
                    decided += 1
                    assert e == res.expert[i], (order, i)
                    assert Fraction(res.err_lo[i]) <= err <= Fraction(res.err_hi[i]), (order, i)
                if target[i] < 0:
                    continue
                for way in ABLATIONS:
                    with np.errstate(all="ignore"):
                        pa, _, z = run.forward(list(tokens[i]), ablate=way)
                    err_a = 1 - sum(Fraction(float(x)) for x in pa[good])
                    assert Fraction(res.ablated_lo[i]) <= err_a <= Fraction(res.ablated_hi[i]), (order, way, i)
                    assert Fraction(res.ablated_object_lo[i]) <= 1 - Fraction(float(pa[target[i]])), (order, way, i)
                    o = target[i]
                    gap = max(float(z[t]) for t in range(z.size) if t != o) - float(z[o])
                    assert res.ablated_gap[i] <= gap, (order, way, i)
    assert decided > 0 or (fmt == "bfloat16" and acc is None)     # all-bfloat16 certifies no routing here


@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_deployed_dense_and_plain_passes_agree_on_a_trained_model(fmt):
    """The same decisions (routing certified or not, error below ε or not, each localization
    part) as the plain deployed pass on a trained model; numbers within the plain pass's own
    slack (the dense enclosures are per entry, the plain gate's per row)."""
    import layout
    from tasks.io import load_tasks
    from verifier.checks.verify import verify
    from verifier.passes.floating import Deployment
    from verifier.running import runner

    ts = load_tasks("docs/training/tasks-K4.yaml")
    w = layout.load("docs/training/weights/K4-E4-localize-s0.npz")
    dep = Deployment.named(fmt)
    dense = verify(ts, w, 0.01, deployment=dep)
    original = runner.is_dense
    try:
        runner.is_dense = lambda weights: False
        plain = verify(ts, w, 0.01, deployment=dep)
    finally:
        runner.is_dense = original
    assert dense.certified == plain.certified
    for a, b in zip(dense.tasks, plain.tasks):
        for c in ("queries", "object_queries", "misrouted", "over_epsilon", "ablation_broken", "l1_held", "l2_held"):
            assert getattr(a, c) == getattr(b, c), (a.name, c)
        assert a.worst_error == pytest.approx(b.worst_error, rel=2e-2)


def test_a_single_expert_is_routed_and_decides(capitals_set):
    """With one expert the margin is +∞ (nothing to beat): the row is decided, as in the
    plain pass, not [0, 1] as a gate that decides nothing (a dense one-expert model could
    never certify). The enclosures agree with the plain pass's and contain the oracle's."""
    import dataclasses

    from audit.oracle import Oracle, _Fingerprints, enumerate_queries
    from verifier.passes.dense import DensePass
    from verifier.passes.forward import Prepared, run_batch

    w = random_dense_model(capitals_set, 4, scaled=False)
    U = w.U.copy()
    U.data *= 2.0 ** -6                      # logits of a few units: errors strictly inside (0, 1)
    w = dataclasses.replace(w, W_G=w.W_G[:1], b_G=np.asarray(w.b_G[:1]), experts=w.experts[:1],
                            expert_tasks=w.expert_tasks[:1], U=U)
    index = {t: i for i, t in enumerate(w.vocab)}
    dp, plain = DensePass(w), Prepared(w)
    oracle, fp = Oracle(dps=60), _Fingerprints(w)
    for q in enumerate_queries(capitals_set)[:12]:
        ids = np.array([[index[t] for t in q.prefix]], np.int64)
        valid = np.array(sorted(index[t] for t in q.valid), np.int64)
        ptr = np.array([0, valid.size], np.int64)
        a = dp.run_batch(ids, ptr, valid, ablate=np.array([False]))
        b = run_batch(plain, ids, ptr, valid, ablate=np.array([False]))
        assert a.margin[0] == np.inf and a.err_hi[0] < 1.0
        assert a.err_hi[0] == pytest.approx(b.err_hi[0], rel=1e-9)
        assert a.err_lo[0] == pytest.approx(b.err_lo[0], rel=1e-9)
        got = oracle.evaluate(w, fp, tuple(ids[0].tolist()), frozenset(valid.tolist()), True, 60, None)
        assert a.err_lo[0] <= got["error"] <= a.err_hi[0]
