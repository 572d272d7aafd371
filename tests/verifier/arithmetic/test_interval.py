"""The interval primitives against exact rationals, over the whole float64 exponent range.

Every enclosure must contain the exact value (computed with ``fractions.Fraction`` from
the same floats), whatever underflows, cancels or comes near overflow; an entry absent
from a sparse result must be exactly 0. Values are drawn as ±m·2^e with e anywhere from
−1074 to 1023, so products underflow below the smallest subnormal and sums absorb.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from budget import examples

from verifier.arithmetic import interval as I
from verifier.arithmetic.interval import softmax_bounds

SETTINGS = settings(max_examples=examples(150), deadline=None)


def floats(lo: int = -1074, hi: int = 1000):
    """±m·2^e, m of a few bits, e in [lo, hi] (weighted towards both ends), or 0."""
    exponent = st.one_of(st.integers(lo, hi), st.integers(lo, lo + 60), st.integers(hi - 60, hi), st.integers(-30, 30))
    return st.one_of(st.just(0.0), st.builds(lambda m, e, s: s * math.ldexp(m, e), st.integers(1, 255), exponent,
                                             st.sampled_from([1.0, -1.0])))


def sparse(rows: int, cols: int, lo: int = -1074, hi: int = 1000):
    @st.composite
    def make(draw):
        mask = draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
        vals = [draw(floats(lo, hi)) if m else 0.0 for m in mask]
        dense = np.array(vals).reshape(rows, cols)
        r, c = np.nonzero(np.array(mask).reshape(rows, cols))
        M = sp.csr_matrix((dense[r, c], (r, c)), shape=(rows, cols))   # explicit zeros kept where drawn
        M.sort_indices()
        return M
    return make()


def _F(x) -> Fraction:
    return Fraction(float(x))


def _contains(mid, rad, exact: Fraction) -> bool:
    if not (math.isfinite(mid) and math.isfinite(rad)):
        return True   # a non-finite enclosure decides nothing (callers treat it as unbounded)
    return abs(exact - _F(mid)) <= _F(rad)


def test_platform_is_ieee():
    I.check_platform()


def test_ln2_bracket():
    with mpmath.workdps(60):
        ln2 = mpmath.log(2)
        assert mpmath.mpf(I.LN2_LO) < ln2 < mpmath.mpf(I.LN2_HI)
    assert np.nextafter(I.LN2_LO, 1.0) == I.LN2_HI


def test_horner_error_constant_covers_the_proof():
    u = 2.0 ** -53
    g28 = 28 * u / (1 - 28 * u)
    e035 = math.exp(0.35)
    remainder = 0.35 ** 15 / math.factorial(15) * e035
    coefficients = 15 * u * e035        # each 1/k! rounded: at most u relative
    assert (g28 + u) * e035 + remainder + coefficients < I.HORNER_ERR
    with mpmath.workdps(40):
        for r in np.linspace(-0.35, 0.35, 2001):
            assert abs(mpmath.mpf(float(I._horner(np.array([r]))[0])) - mpmath.exp(mpmath.mpf(r))) < I.HORNER_ERR


@SETTINGS
@given(st.lists(st.one_of(st.floats(-800, 800), st.floats(-50, 50), st.floats(700, 712), st.floats(-750, -730)),
                min_size=1, max_size=20))
def test_exp_enclosure_contains_exp(xs):
    x = np.array(xs)
    lo, hi = I.exp_enclosure(x, x)
    with mpmath.workdps(50):
        for xi, a, b in zip(xs, lo, hi):
            e = mpmath.exp(mpmath.mpf(xi))
            assert mpmath.mpf(a) <= e <= mpmath.mpf(b)


def test_exp_enclosure_of_nan_is_everything():
    lo, hi = I.exp_enclosure(np.array([np.nan]), np.array([np.nan]))
    assert lo[0] == 0.0 and hi[0] == np.inf


def test_gamma_and_sum_factor_round_up():
    for n in (1, 2, 10, 10 ** 6, 10 ** 12):
        exact = Fraction(n, 2 ** 53) / (1 - Fraction(n, 2 ** 53))
        assert _F(I.gamma(n)) >= exact
        assert _F(I.sum_factor(n)) >= 1 + 2 * exact


@SETTINGS
@given(sparse(3, 4), sparse(4, 3), sparse(3, 4, -1074, -900), st.data())
def test_matmul_encloses_and_absent_is_exactly_zero(X, B, R, data):
    rad = np.abs(sp.csr_matrix(R).toarray())
    # rad lives on X's pattern (rad > 0 only where X stores an entry)
    Xd = X.toarray()
    stored = np.zeros(X.shape, bool)
    stored[np.repeat(np.arange(3), np.diff(X.indptr)), X.indices] = True
    rad = np.where(stored, rad, 0.0)
    Xi = I.SparseInterval(X.shape, X.indptr.astype(np.int64), X.indices.astype(np.int64), X.data.copy(),
                          rad[np.repeat(np.arange(3), np.diff(X.indptr)), X.indices])
    with np.errstate(all="ignore"):
        Y = I.matmul(Xi, B)
    Bd = B.toarray()
    Ym, Yr = Y.dense()
    present = np.zeros(Y.shape, bool)
    present[Y.row_ids(), Y.indices] = True
    for i in range(3):
        for k in range(3):
            # the exact product lies in Σ_j [x_ij ± r_ij]·b_jk; check both extreme corners' sum bound
            centre = sum(_F(Xd[i, j]) * _F(Bd[j, k]) for j in range(4))
            spread = sum(_F(rad[i, j]) * abs(_F(Bd[j, k])) for j in range(4))
            if not present[i, k]:
                assert centre == 0 and spread == 0
                continue
            m, r = Ym[i, k], Yr[i, k]
            if math.isfinite(m) and math.isfinite(r):
                assert abs(centre - _F(m)) + spread <= _F(r), (i, k)


def _same_interval(A: I.SparseInterval, B: I.SparseInterval) -> bool:
    """Bit for bit: the same shape, pattern, midpoints and radii."""
    return (A.shape == B.shape and np.array_equal(A.indptr, B.indptr) and np.array_equal(A.indices, B.indices)
            and np.array_equal(A.mid.view(np.int64), B.mid.view(np.int64))
            and np.array_equal(A.rad.view(np.int64), B.rad.view(np.int64)))


@SETTINGS
@given(sparse(4, 9), sparse(3, 9), sparse(4, 9, -1074, -900), st.sampled_from(["csr", "csc"]))
def test_a_thin_product_is_the_csr_product_bit_for_bit(X, W, R, fmt):
    """X @ W^T with W^T kept by the rows it holds (interval.Thin, nothing of size d) gives
    the product with W^T as CSR exactly: X's entries in columns W^T does not read are
    dropped, which forms no term; radii on X too (they enter the product's radius)."""
    W = W.asformat(fmt)
    rad = np.abs(R.toarray())[np.repeat(np.arange(4), np.diff(X.indptr)), X.indices]
    Xi = I.SparseInterval(X.shape, X.indptr.astype(np.int64), X.indices.astype(np.int64), X.data.copy(), rad)
    thin = I.Thin.transpose_of(W)
    assert thin.rows.size == np.count_nonzero(np.diff(sp.csc_matrix(W).indptr))
    with np.errstate(all="ignore"):
        assert _same_interval(I.matmul(Xi, thin), I.matmul(Xi, W.T.tocsr()))
        assert _same_interval(I.matmul(Xi, thin.abs()), I.matmul(Xi, abs(W.T.tocsr())))


@SETTINGS
@given(sparse(2, 5), sparse(5, 4))
def test_structural_pattern_keeps_underflowed_entries(X, B):
    Xi = I.exact(X)
    with np.errstate(all="ignore"):
        Y = I.matmul(Xi, B)
    # every (i, k) with a stored term pair is present (stored zeros count as terms too)
    Xs = sp.csr_matrix((np.ones(X.nnz), X.indices, X.indptr), shape=X.shape)
    Bs = sp.csr_matrix((np.ones(B.nnz), B.indices, B.indptr), shape=B.shape)
    want = (Xs @ Bs).toarray() > 0
    got = np.zeros(Y.shape, bool)
    got[Y.row_ids(), Y.indices] = True
    assert np.array_equal(want, got)
    assert np.all(Y.rad > 0)


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), floats(), floats(-1074, -1000)),
                min_size=1, max_size=25))
def test_sum_terms_encloses(terms):
    rows, cols, mids, rads = zip(*terms)
    rads = np.abs(rads)
    with np.errstate(all="ignore"):
        S = I.sum_terms((3, 3), rows, cols, mids, rads)
    m, r = S.dense()
    present = np.zeros((3, 3), bool)
    present[S.row_ids(), S.indices] = True
    for i in range(3):
        for j in range(3):
            mine = [(a, b) for (ri, ci, a, b) in zip(rows, cols, mids, rads) if (ri, ci) == (i, j)]
            if not mine:
                assert not present[i, j]
                continue
            centre = sum(_F(a) for a, _ in mine)
            spread = sum(_F(b) for _, b in mine)
            if math.isfinite(m[i, j]) and math.isfinite(r[i, j]):
                assert abs(centre - _F(m[i, j])) + spread <= _F(r[i, j])


@SETTINGS
@given(st.lists(st.tuples(floats(), floats(-1074, -900), floats(), floats(-1074, -900)), min_size=1, max_size=12))
def test_dot_rows_encloses(pairs):
    am, ar, bm, br = (np.array([p[i] for p in pairs])[None, :] for i in range(4))
    ar, br = np.abs(ar), np.abs(br)
    with np.errstate(all="ignore"):
        m, r = I.dot_rows(am, ar, bm, br)
    # the worst case over the box: |Σ (a+δa)(b+δb) − m| <= Σ |a|δb + δa|b| + δaδb + |Σab − m|
    centre = sum(_F(a) * _F(b) for a, b in zip(am[0], bm[0]))
    spread = sum(abs(_F(a)) * _F(y) + _F(x) * abs(_F(b)) + _F(x) * _F(y)
                 for a, x, b, y in zip(am[0], ar[0], bm[0], br[0]))
    if math.isfinite(m[0]) and math.isfinite(r[0]):
        assert abs(centre - _F(m[0])) + spread <= _F(r[0])


@SETTINGS
@given(sparse(3, 4), st.lists(floats(-60, 60), min_size=3, max_size=3),
       st.lists(floats(-1074, -1000), min_size=3, max_size=3))
def test_scale_rows_encloses(X, am, ar):
    am, ar = np.array(am), np.abs(np.array(ar))
    Xi = I.exact(X)
    with np.errstate(all="ignore"):
        Y = I.scale_rows(Xi, am, ar)
    rows = Xi.row_ids()
    for p in range(Xi.nnz):
        i = rows[p]
        centre = _F(am[i]) * _F(Xi.mid[p])
        spread = _F(ar[i]) * abs(_F(Xi.mid[p]))
        if math.isfinite(Y.mid[p]) and math.isfinite(Y.rad[p]):
            assert abs(centre - _F(Y.mid[p])) + spread <= _F(Y.rad[p])


@SETTINGS
@given(sparse(2, 5), sparse(5, 3))
def test_row_bound_matmul_encloses_every_column(X, B):
    Xi = I.exact(X)
    colmax = np.abs(B.toarray()).max(axis=1)
    with np.errstate(all="ignore"):
        Ym, rad = I.row_bound_matmul(Xi, B, colmax)
    Xd, Bd = X.toarray(), B.toarray()
    for i in range(2):
        for k in range(3):
            exact = sum(_F(Xd[i, j]) * _F(Bd[j, k]) for j in range(5))
            if math.isfinite(Ym[i, k]) and math.isfinite(rad[i]):
                assert abs(exact - _F(Ym[i, k])) <= _F(rad[i])


@SETTINGS
@given(st.lists(st.tuples(st.floats(-800, 800), st.floats(0, 1e3)), min_size=1, max_size=6))
def test_softmax_bounds_enclose(scores):
    mid = np.array([[s for s, _ in scores]])
    rad = np.array([[r for _, r in scores]])
    lo, hi = softmax_bounds(I.lower(mid, rad), I.upper(mid, rad), mid)
    with mpmath.workdps(50):
        # at the midpoint, and at the corner that favours entry 0 most
        for pick in (lambda s, r, j: s, lambda s, r, j: s + r if j == 0 else s - r):
            x = [mpmath.mpf(pick(float(s), float(r), j)) for j, (s, r) in enumerate(zip(mid[0], rad[0]))]
            top = max(x)
            e = [mpmath.exp(v - top) for v in x]
            z = mpmath.fsum(e)
            for j in range(len(x)):
                assert mpmath.mpf(lo[0, j]) <= e[j] / z <= mpmath.mpf(hi[0, j])


def test_absent_logits_are_exactly_zero_only_without_terms():
    """The shortcut 'absent = exactly 0' is applied to an output whose only term underflowed: it must stay."""
    X = sp.csr_matrix(np.array([[2.0 ** -600]]))
    B = sp.csr_matrix(np.array([[2.0 ** -500]]))
    Y = I.matmul(I.exact(X), B)
    assert Y.nnz == 1 and Y.mid[0] == 0.0 and Y.rad[0] >= 2 ** -1074
    Z = I.matmul(Y, sp.csr_matrix(np.array([[2.0 ** 1000]])))
    assert Z.nnz == 1 and Z.rad[0] >= 2.0 ** -1100 * 2.0 ** 1000


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_nonfinite_rows_are_flagged(bad):
    S = I.SparseInterval((2, 2), np.array([0, 1, 2]), np.array([0, 1]), np.array([1.0, bad]), np.array([0.0, 0.0]))
    assert S.nonfinite_rows().tolist() == [False, True]


# --- the compiled kernels' scalar arithmetic ---------------------------------------------------------


@SETTINGS
@given(st.one_of(st.floats(-800, 800), st.floats(-1e-15, 1e-15), st.floats(700, 712), st.floats(-750, -730),
                 st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 2.0 ** -60, -(2.0 ** -60), 2.0 ** -59])))
def test_kernel_exp_encloses_exp(x):
    from verifier.arithmetic import exponential as X

    lo, hi = X.exp_lower(x), X.exp_upper(x)
    with mpmath.workdps(50):
        e = mpmath.exp(mpmath.mpf(x))
        assert mpmath.mpf(lo) <= e <= mpmath.mpf(hi)


def test_remembered_exp_bounds_are_the_bounds():
    """The memo of exp bounds (the factored softmax's) returns the function's value for every
    argument, whichever arguments share its slots, and None remembers nothing."""
    from verifier.arithmetic import exponential as X

    rng = np.random.default_rng(7)
    xs = np.concatenate([rng.uniform(-50, 5, 3000), rng.choice(rng.uniform(-50, 5, 40), 3000),
                         [0.0, -0.0, 1e301, -1e301, np.inf, -np.inf, np.nan, 2.0 ** -61]])
    memo = np.full((4, X.MEMO), np.nan)
    for x in xs:
        lo, hi = X.exp_lower(x), X.exp_upper(x)
        for got, want in ((X.exp_memo(x, memo, -1.0), lo), (X.exp_memo(x, memo, 1.0), hi),
                          (X.exp_memo(x, None, -1.0), lo), (X.exp_memo(x, None, 1.0), hi)):
            assert got == want or (math.isnan(got) and math.isnan(want))


@SETTINGS
@given(floats(-1074, 1000))
def test_upward_step_is_at_least_nextafter(x):
    from verifier.arithmetic import rounding as R

    x = abs(x)
    assert R.up_nonneg(x) >= np.nextafter(x, np.inf)
    assert R.up_one_plus(x) >= np.nextafter(1.0 + x, np.inf) or 1.0 + x == np.inf


@SETTINGS
@given(st.one_of(floats(-1074, 1000), st.sampled_from([0.0, -0.0, 5e-324, -5e-324, np.inf, -np.inf, 2.0 ** -1022,
                                                       -(2.0 ** -1022), np.finfo(float).max, -np.finfo(float).max])))
def test_signed_steps_are_at_least_nextafter_for_either_sign(x):
    """The two-flop steps of the factored kernels, on values of either sign: up_signed(x) is at
    least the next float above x and down_signed(x) at most the one below; for x >= 0
    up_signed is up_nonneg to the bit."""
    from verifier.arithmetic import rounding as R

    for v in (x, -x):
        with np.errstate(over="ignore"):                         # the next float beyond the largest: ±inf
            above, below = np.nextafter(v, np.inf), np.nextafter(v, -np.inf)
        assert R.up_signed(v) >= above and R.down_signed(v) <= below
        if v >= 0:
            assert R.up_signed(v) == R.up_nonneg(v)


def test_kernel_tables_round_up_like_the_functions():
    from verifier.arithmetic import rounding as R

    for n in (0, 1, 2, 3, 17, 100, R.TABLE - 1):
        exact_g = Fraction(n + 1, 2 ** 53) / (1 - Fraction(n + 1, 2 ** 53))
        assert _F(R.GAMMA1[n]) >= exact_g and R.GAMMA1[n] == R.gamma(n + 1)
        assert R.FACTOR[n] == R.sum_factor(n) == R.factor(n)
        assert R.SHRINK[n] == R.down(1.0 - R.gamma(n + 1)) == R.shrink(n)
        assert _F(R.SHRINK[n]) <= 1 - exact_g
    for n in range(R.TABLE):                                  # every entry is the function's, to the bit
        assert R.factor(n) == R.sum_factor(n) and R.shrink(n) == R.down(1.0 - R.gamma(n + 1))
    for n in (R.TABLE, R.TABLE + 1, 10 ** 6):                    # beyond the tables: the functions
        assert R.factor(n) == R.sum_factor(n) and R.shrink(n) == R.down(1.0 - R.gamma(n + 1))


@SETTINGS
@given(st.one_of(floats(-1074, 1000), st.sampled_from([0.0, -0.0, np.inf, -np.inf, np.nan])))
def test_a_passes_steps_are_its_own(x):
    """step_up and step_down are nextafter for the plain pass (quick None) and the two-flop
    steps for the factored pass (QUICK), to the bit."""
    from verifier.arithmetic import rounding as R

    for v in (x, -x):
        for got, want in ((R.step_up(v, None), R.up(v)), (R.step_down(v, None), R.down(v)),
                          (R.step_up(v, R.QUICK), R.up_signed(v)), (R.step_down(v, R.QUICK), R.down_signed(v))):
            assert got == want or (math.isnan(got) and math.isnan(want))


def test_kernel_products_enclose():
    from verifier.arithmetic import accumulate as K

    rng = np.random.default_rng(0)
    for _ in range(2000):
        am, bm = (math.ldexp(float(rng.uniform(-1, 1)), int(rng.integers(-1074, 600))) for _ in range(2))
        ar, br = (abs(math.ldexp(float(rng.uniform(0, 1)), int(rng.integers(-1074, 600)))) for _ in range(2))
        m, r = K.mul_interval(am, ar, bm, br)
        if math.isfinite(r):
            worst = max(abs((_F(am) + sa * _F(ar)) * (_F(bm) + sb * _F(br)) - _F(m))
                        for sa in (-1, 1) for sb in (-1, 1))
            assert worst <= _F(r)


def test_kernel_platform_check():
    from verifier.arithmetic import rounding as R

    R.check()


def test_matmul_rows_do_not_depend_on_the_other_rows():
    """Row i of X·B is the same floats whether X has other rows or not, and whether B keeps
    columns no row of X reaches (verifier.running.shards relies on it: a shard multiplies fewer
    rows by a cut B)."""
    import scipy.sparse as sp

    from verifier.arithmetic import interval as I

    rng = np.random.default_rng(5)
    B = sp.random(40, 30, density=0.3, random_state=rng, format="csr")
    B.data = rng.normal(size=B.nnz)
    X = sp.random(12, 40, density=0.08, random_state=rng, format="csr")
    X.data = rng.normal(size=X.nnz)
    X = X.tolil()
    X[0, :] = rng.normal(size=40)                   # one dense row: many more terms than the others
    X = sp.csr_matrix(X)
    X.sort_indices()
    XI = I.SparseInterval(X.shape, X.indptr.astype(np.int64), X.indices.astype(np.int64), X.data.copy(),
                          np.abs(X.data) * 1e-9)
    full = I.matmul(XI, B)
    rows = np.arange(1, 12)
    part = I.matmul(XI.rows(rows), B)
    ref = full.rows(rows)
    assert np.array_equal(part.indptr, ref.indptr) and np.array_equal(part.indices, ref.indices)
    assert np.array_equal(part.mid, ref.mid) and np.array_equal(part.rad, ref.rad)


def test_the_numpy_and_compiled_arithmetic_enclose_alike():
    """verifier.arithmetic.interval (numpy) and the compiled kernels (numba) read their constants from one
    module (verifier.arithmetic.constants); on the same inputs their exp enclosures, rounding factors
    and upward steps agree bit for bit (so a bound proven for one is the other's)."""
    from verifier.arithmetic import accumulate as A
    from verifier.arithmetic import constants as C
    from verifier.arithmetic import exponential as X
    from verifier.arithmetic import rounding as R

    rng = np.random.default_rng(3)
    xs = np.concatenate([rng.uniform(-800, 800, 4000), rng.uniform(-1, 1, 2000) * 2.0 ** -55,
                         [0.0, -0.0, C.EXP_MIN, C.EXP_MAX, C.EXP_MIN - 1, C.EXP_MAX + 1, 2.0 ** -60, -2.0 ** -60,
                          np.inf, -np.inf, np.nan]])
    lo, hi = I.exp_enclosure(xs, xs)
    k_lo = np.array([X.exp_lower(x) for x in xs])
    k_hi = np.array([X.exp_upper(x) for x in xs])
    assert np.array_equal(lo, k_lo) and np.array_equal(hi, k_hi)
    for n in (1, 2, 17, 4095, 4096, 10 ** 6):
        assert I.gamma(n) == R.gamma(n) and I.sum_factor(n) == R.sum_factor(n)
    r = np.abs(rng.normal(size=1000)) * 10.0 ** rng.integers(-300, 300, 1000)
    assert np.all(np.array([R.up_nonneg(x) for x in r]) >= I.up(r))
    assert (A.U, A.FLOOR, X.LN2_LO, X.LN2_HI, X.HORNER_ERR) == (I.U, I.FLOOR, I.LN2_LO, I.LN2_HI, I.HORNER_ERR)
