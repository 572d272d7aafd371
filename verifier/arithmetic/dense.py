"""Dense interval arithmetic at the speed of BLAS: matrix products in midpoint-radius form,
and the output softmax's error over rows of dense logits (compiled).

The kernels of :mod:`verifier.arithmetic.kernels` enclose a sparse model entry by entry:
each entry of each product is accumulated term by term with its own rounding bound. A
trained model is dense (every weight non-zero), and there the same enclosures can be had
from a handful of ordinary floating-point matrix products, each run by the platform's BLAS
(the midpoint-radius products of Rump, *Fast and parallel interval arithmetic*, BIT 39,
1999, here with an a-priori rounding term, so that no change of the rounding mode is
needed). The arithmetic model is that of :mod:`verifier.arithmetic.interval`, (A1) and
(A2), with one more assumption, the dense twin of (A3):

(A3') a BLAS product ``C = A @ B`` of float64 matrices computes each entry C_il as a sum of
      the k products A_ij·B_jl in *some* order and grouping (blocked, threaded, with or
      without fused multiply-add), each product and addition as in (A1). A product whose
      factor B_jl is 0 may be left out (reference BLAS skips it): for finite A_ij it is
      exactly 0 either way. :func:`check_blas` probes round-to-nearest and gradual
      underflow inside the BLAS threads before any product is trusted.

**Lemma D (products).** Let X = [Xm ± Xr] be an n×k interval matrix (Xr >= 0), B a k×m
matrix of floats (exact), and C = fl(Xm·B) computed under (A3'). Let t be the most
non-zero entries of a column of B (t <= k), γ = γ_{t+1}, c = c_t (Lemma 1), and
S = up(Xr + up(γ·|Xm|)) element-wise. Then for every x in X and every entry,

    |(x·B)_il − C_il| <= up(up(c·fl(S·|B|)_il) + 2t·η) =: R_il,

with fl(S·|B|) another BLAS product. *Proof.* (x − Xm)·B has entries bounded by
(Xr·|B|)_il. By Lemma 2 the float sum C_il errs from (Xm·B)_il by at most
γ_t·(|Xm|·|B|)_il + t·η (the products with B_jl = 0 are exactly 0 and add nothing). So
the error is at most ((Xr + γ|Xm|)·|B|)_il + t·η <= (S·|B|)_il + t·η, and since S and |B|
are non-negative, Lemma 2 bounds the exact (S·|B|)_il by (1 + 2γ_t)·fl(S·|B|)_il + t·η
<= c·fl(S·|B|)_il + t·η; each step of R rounds upward (A2). □ The code uses
:data:`~verifier.arithmetic.constants.FLOOR` >= η for η, as every radius of the verifier
does. A product costs two BLAS calls of the same shape instead of one; a midpoint or
radius that is not finite makes the entry unbounded (:func:`verifier.arithmetic.interval.guard`).

A block of the model whose matrix is sparse is multiplied by scipy's sparse product
instead (:class:`Matrix` decides by the share of stored entries): under (A3) it is the
same sum of the same products in another order, and Lemma D holds word for word.

Rounding steps on whole arrays. ``np.nextafter`` is a library call per element; for
non-negative arrays (every radius) :func:`up_nonneg_array` uses the two-flop step of
:func:`verifier.arithmetic.rounding.up_nonneg`, x·(1 + 2^-52) + 2^-1022 >= nextafter(x, +∞), and
for signed values the compiled kernels use :func:`verifier.arithmetic.rounding.up_finite` /
:func:`verifier.arithmetic.rounding.down_finite` (proofs there).

**The output softmax over dense logits** (:func:`readout`): per row, the error
1 − P(valid) of softmax(z) for z in the logits' enclosures, as
:func:`verifier.arithmetic.logits.error_enclosure` encloses it (every token of a dense row is
touched: no logit is a structural 0), with the exponential of each term enclosed by
:func:`exp_bounds` (a table of e^(j/64) and a degree-6 polynomial: a few flops instead of
the degree-14 evaluation, with the same enclosing property) and the terms too small to
matter bounded all at once (:data:`SKIP`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from verifier.arithmetic import interval as I
from verifier.arithmetic.accumulate import B1, F1, F2, F3, I1, I2
from verifier.arithmetic.constants import FLOOR, STEP, U
from verifier.arithmetic.exponential import exp_lower, exp_upper, horner
from verifier.arithmetic.kernel_forms import kernel
from verifier.arithmetic.rounding import (STEP_DOWN, down, down_finite, down_nonneg, gamma, sum_factor, up, up_finite,
                                          up_nonneg)

#: A block whose matrix stores at least this share of its entries is multiplied dense (BLAS).
DENSE = 0.25


# --- rounding steps on arrays -------------------------------------------------------------------


def up_nonneg_array(x: np.ndarray) -> np.ndarray:
    """An upper bound of each x >= 0 rounded up by one step: x·(1 + 2^-52) + 2^-1022
    (>= nextafter(x, +∞), as :func:`verifier.arithmetic.rounding.up_nonneg`; +∞ and NaN stay)."""
    out = np.multiply(x, STEP)
    out += FLOOR
    return out


def down_nonneg_array(x: np.ndarray) -> np.ndarray:
    """A lower bound of each x >= 0 one step down: max(x·(1 − 2^-52) − 2^-1022, 0).

    For a normal x in [2^e, 2^(e+1)), x·2^-52 >= ulp(x), so the exact product lies at least
    one unit below x and rounds (monotonically) to at most the float below x; subtracting
    the floor cannot raise it. A subnormal x or 0 goes to 0 or below, clamped to 0."""
    out = np.multiply(x, STEP_DOWN)
    out -= FLOOR
    return np.maximum(out, 0.0, out=out)


# --- the BLAS probe ---------------------------------------------------------------------------


def check_blas() -> None:
    """Refuse to run where the BLAS does not compute as (A3') assumes: round to nearest
    (ties to even), subnormals neither flushed on output nor read as zero on input, in the
    threads BLAS starts for a product large enough to be split among them."""
    n = 256
    A = np.full((n, n), 2.0 ** -537)
    got = A @ A                                       # each product 2^-1074 = η: FTZ gives 0
    ok = bool(np.all(got == n * 2.0 ** -1074))
    tiny = np.full((n, n), 2.0 ** -1074)              # DAZ would read η as 0
    ok = ok and bool(np.all(tiny @ np.eye(n) == 2.0 ** -1074))
    one = np.zeros((n, 2))
    one[:, 0] = 1.0
    one[:, 1] = 2.0 ** -53                            # 1 + 2^-53 is a tie: to even, 1
    ok = ok and bool(np.all(np.ones((n, n)) @ np.ones((n, 2)) == n))
    ok = ok and bool(np.all((one @ np.array([[1.0], [1.0]])) == 1.0))
    if not ok:
        raise RuntimeError("this process's BLAS does not compute in IEEE-754 binary64 round-to-nearest with "
                           "gradual underflow (flush-to-zero in its threads?); certified results would not be proofs")


# --- exact matrices and products ---------------------------------------------------------------


@dataclass(frozen=True)
class Matrix:
    """An exact k×m matrix B kept for :func:`product`: as a dense array (multiplied by BLAS)
    when it stores at least :data:`DENSE` of its entries, else as CSR (scipy); with |B| and
    the most non-zero entries of a column (Lemma D's t)."""

    B: np.ndarray | sp.csr_matrix
    absB: np.ndarray | sp.csr_matrix
    terms: int

    @staticmethod
    def of(M: sp.spmatrix | np.ndarray) -> "Matrix":
        """``M`` (canonical sparse or an array of floats) kept dense or sparse by its density."""
        if sp.issparse(M):
            M = I.as_csr(M)
            shape, nnz = M.shape, M.nnz
            cols = np.bincount(M.indices, minlength=shape[1])
        else:
            M = np.asarray(M, np.float64)
            shape, nnz = M.shape, int(np.count_nonzero(M))
            cols = np.count_nonzero(M, axis=0)
        terms = max(int(cols.max(initial=0)), 1)
        size = shape[0] * shape[1]
        if size and nnz >= DENSE * size:
            B = np.ascontiguousarray(M.toarray() if sp.issparse(M) else M, np.float64)
            return Matrix(B, np.abs(B), terms)
        B = I.as_csr(sp.csr_matrix(M)) if not sp.issparse(M) else M
        return Matrix(B, abs(B), terms)

    @property
    def shape(self) -> tuple[int, int]:
        return self.B.shape

    @property
    def dense(self) -> bool:
        return isinstance(self.B, np.ndarray)


def _times(X: np.ndarray, B) -> np.ndarray:
    """X @ B for a dense X and a dense or CSR B, as a dense C-contiguous array."""
    if isinstance(B, np.ndarray):
        return np.matmul(X, B)
    return np.ascontiguousarray((B.T @ X.T).T)          # scipy: a sum of the products per entry (A3)


def product_parts(Xm: np.ndarray, Xr: np.ndarray | None, B: Matrix):
    """Lemma D's midpoint C = fl(Xm·B) and the parts of its radius: (C, S, c, f) with
    S = up(Xr + up(γ|Xm|)), c = c_t and f = 2t·η, so that the radius is
    up(up(c·fl(S·|B|)) + f) (:func:`product` finishes it; the readout may finish it only
    where it is needed: :func:`readout`)."""
    k = B.terms
    g, c = I.gamma(k + 1), I.sum_factor(k)
    with np.errstate(invalid="ignore", over="ignore"):
        mid = _times(Xm, B.B)
        S = np.abs(Xm)
        S *= g
        S = up_nonneg_array(S)
        if Xr is not None:
            S += Xr
            S = up_nonneg_array(S)
    return mid, S, c, 2.0 * k * FLOOR


def product(Xm: np.ndarray, Xr: np.ndarray | None, B: Matrix) -> tuple[np.ndarray, np.ndarray]:
    """The enclosure (mid, rad) of X·B for X = [Xm ± Xr] (``Xr`` None: X exact), Lemma D."""
    mid, S, c, f = product_parts(Xm, Xr, B)
    return mid, finish(S, B, c, f, mid)


def finish(S: np.ndarray, B: Matrix, c: float, f: float, mid: np.ndarray) -> np.ndarray:
    """Lemma D's radius from :func:`product_parts`' parts: up(up(c·fl(S·|B|)) + f), infinite
    where the midpoint or the radius is not finite."""
    with np.errstate(invalid="ignore", over="ignore"):
        rad = _times(S, B.absB)
        rad *= c
        rad = up_nonneg_array(rad)
        rad += f
        rad = up_nonneg_array(rad)
    return I.guard(mid, rad)


def add_exact(mid: np.ndarray, rad: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[mid ± rad] + b for an exact float b (broadcast): fl(mid + b) errs by at most
    u·|fl(mid + b)| (A1: no underflow term for an addition)."""
    with np.errstate(invalid="ignore", over="ignore"):
        m = mid + b
        r = np.abs(m)
        r *= U
        r = up_nonneg_array(r)
        r += rad
        r = up_nonneg_array(r)
    return m, I.guard(m, r)


# --- the exponential by table -------------------------------------------------------------------

#: The table's step is 2^-SHIFT: e^x = e^(j/64)·e^r with j = floor(64x), r in [0, 1/64).
SHIFT = 6
#: The table covers j/64 for j in [J_LOW, J_HIGH]: e^x below J_LOW/64 is at most e^(J_LOW/64)
#: (about 2^-1075: the enclosure's upper end is the table's first, its lower end 0).
J_LOW = -745 * 64
J_HIGH = 64 * 64
#: Taylor coefficients of e^r to degree 6 (rounded to nearest; their rounding is in REL).
POLY = np.array([1.0 / math.factorial(i) for i in range(7)])
#: A relative bound of everything between the computed polynomial p̂(r̂) and e^(x − j/64):
#: Horner's rounding (positive coefficients and argument: at most γ_13), the coefficients'
#: rounding (u), the truncation r^7/7!·e^r <= 2^-42/5040·e^(1/64) < u/2, and r's own rounding
#: (|r̂ − r| <= 2^-59, a factor e^(2^-59) <= 1 + u/4): together below 15u < 2^-47.
REL = 2.0 ** -47
#: Terms whose exponent's upper end lies below SKIP are bounded together (:func:`readout`).
SKIP = -64.0


def _exp_table() -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi] enclosures of e^(j/64), j = J_LOW..J_HIGH, by the degree-14 enclosure of
    :func:`verifier.arithmetic.interval.exp_enclosure` (each j/64 is a float, exactly)."""
    x = np.arange(J_LOW, J_HIGH + 1, dtype=np.float64) / 64.0
    lo, hi = I.exp_enclosure(x, x)
    return np.ascontiguousarray(lo), np.ascontiguousarray(hi)


EXP_LO, EXP_HI = _exp_table()


@kernel()
def _poly(r):
    return horner(POLY, r)


@kernel()
def exp_below(x, lo_t):
    """A lower bound of e^x (x a float; NaN: 0), by the table ``lo_t`` (:data:`EXP_LO`).

    x = j/64 + r with j = floor(64x) (64x is exact), r = x − j/64 in [0, 1/64): e^x =
    e^(j/64)·e^r >= lo_t[j]·p(r), p the degree-6 Taylor polynomial (its terms are
    positive, so p(r) <= e^r), and p(r) >= p̂·(1 − REL) for the computed p̂ (:data:`REL`);
    each product is rounded down (:func:`down_nonneg_array`'s step). Outside the table the
    degree-14 enclosure :func:`verifier.arithmetic.exponential.exp_lower` is used."""
    if not (x >= J_LOW / 64.0):
        return 0.0
    if not (x < J_HIGH / 64.0):
        return exp_lower(x)
    j = math.floor(x * 64.0)
    r = x - j / 64.0
    if r < 0.0:
        r = 0.0
    p = _poly(r) * (1.0 - REL)
    p = p * STEP_DOWN - FLOOR
    v = lo_t[int(j) - J_LOW] * p
    v = v * STEP_DOWN - FLOOR
    return max(v, 0.0)


@kernel()
def exp_above(x, hi_t):
    """An upper bound of e^x (x a float; NaN: +∞), by the table ``hi_t`` (:data:`EXP_HI`):
    e^x = e^(j/64)·e^r <= hi_t[j]·p̂·(1 + REL) (:data:`REL` includes the truncation), each
    product rounded up; below the table hi_t[0] >= e^(J_LOW/64) >= e^x; above it, the
    degree-14 enclosure :func:`verifier.arithmetic.exponential.exp_upper`."""
    if not (x < J_HIGH / 64.0):
        return exp_upper(x)
    if x < J_LOW / 64.0:
        return hi_t[0]
    j = math.floor(x * 64.0)
    r = x - j / 64.0
    if r > 1.0 / 64.0:
        r = 1.0 / 64.0
    p = _poly(r) * (1.0 + REL)
    p = p * STEP + FLOOR
    v = hi_t[int(j) - J_LOW] * p
    return v * STEP + FLOOR


@kernel()
def exp_around(xc, delta, lo_t, hi_t):
    """(lo, hi) with lo <= e^x <= hi for every x in [xc − δ, xc + δ] (δ >= 0), from one
    evaluation at xc: the table's enclosure [E_lo, E_hi] of e^xc (as :func:`exp_below` and
    :func:`exp_above` compute it, sharing the polynomial), then e^(xc + t) for |t| <= δ <= 1 lies
    in [E_lo·(1 − δ), E_hi·(1 + δ + δ²)] (1 − δ <= e^-δ, and e^δ <= 1 + δ + δ² for δ <= 1:
    the tail Σ_{k>=2} δ^k/k! is at most (e − 2)·δ²). A wider δ, or an xc outside the table,
    takes the two evaluations."""
    if not (delta <= 1.0 and xc >= J_LOW / 64.0 + 1.0 and xc < J_HIGH / 64.0 - 1.0):
        return exp_below(xc - delta, lo_t), exp_above(xc + delta, hi_t)
    j = math.floor(xc * 64.0)
    r = xc - j / 64.0
    if r < 0.0:
        r = 0.0
    elif r > 1.0 / 64.0:
        r = 1.0 / 64.0
    p = _poly(r)
    k = int(j) - J_LOW
    lo = lo_t[k] * ((p * (1.0 - REL)) * STEP_DOWN - FLOOR)
    lo = (lo * STEP_DOWN - FLOOR) * (1.0 - delta)
    lo = max(lo * STEP_DOWN - FLOOR, 0.0)
    hi = hi_t[k] * ((p * (1.0 + REL)) * STEP + FLOOR)
    hi = (hi * STEP + FLOOR) * up_nonneg(1.0 + up_nonneg(delta + up_nonneg(delta * delta)))
    return lo, hi * STEP + FLOOR


# --- attention and ReLU, row by row -------------------------------------------------------------


@kernel()
def _from_bounds(lo, hi):
    """Midpoint-radius form of [lo, hi] (a point stays a point): mid = lo/2 + hi/2, and a
    radius reaching both ends, each difference rounded up."""
    if lo == hi:
        return lo, 0.0
    m = 0.5 * lo + 0.5 * hi
    return m, max(up_finite(hi - m), up_finite(m - lo))


@kernel(args=(F2, F2), returns=(F2, F2))
def relu(mid, rad):
    """ReLU of [mid ± rad] element-wise, in midpoint-radius form: the interval itself where
    its lower end is certainly >= 0, exactly 0 where its upper end is certainly <= 0, else
    [0, hi] (hi the upper end rounded up); a non-finite entry stays unbounded."""
    n, w = mid.shape
    om = np.empty((n, w))
    orad = np.empty((n, w))
    for i in range(n):
        for j in range(w):
            m = mid[i, j]
            r = rad[i, j]
            if not (np.isfinite(m) and np.isfinite(r)):
                om[i, j], orad[i, j] = m, np.inf
                continue
            lo = down_finite(m - r)
            hi = up_finite(m + r)
            if lo >= 0.0:
                om[i, j], orad[i, j] = m, r
            elif hi <= 0.0:
                om[i, j], orad[i, j] = 0.0, 0.0
            else:
                om[i, j], orad[i, j] = _from_bounds(0.0, hi)
    return om, orad


@kernel(args=(I2, F2, F2, F2, F2, F2, F2, F2, F2, I1, I1, F1, F1), returns=(F3, F3))
def attention(ids, QEm, QEr, QPm, QPr, KEm, KEr, KPm, KPr, starts, widths, lo_t, hi_t):
    """Every head's attention enclosures at the last position of each row of ``ids``
    (n × (p+1), BOS first): (mid, rad), each (n, heads, p+1).

    The query of head m is W_Q^m·h_p with h_p = E[x_p] + P[p], enclosed as QE[x_p] + QP[p]
    (the tables hold the enclosures of W_Q·E[x] and W_Q·P[j]; their sum's rounding is
    u·|fl(sum)|, (A1)); the keys likewise at every position. A score q·k_j (no scaling) is
    an interval dot product: midpoint fl(Σ qm·km), radius
    c_t·Σ(|qm|·kr + qr·|km| + qr·kr + γ_{t+1}|qm||km|) + (t + 1)·η over the head's t
    coordinates (:func:`verifier.arithmetic.interval.dot_rows`, each step rounded up).
    The softmax over positions is :func:`verifier.arithmetic.interval.softmax_bounds`'s
    enclosure (any shift M: the largest score midpoint), with the exponentials of
    :func:`exp_below` / :func:`exp_above`; a head with a non-finite score gets [0, 1]."""
    n, p1 = ids.shape
    H = starts.size
    am = np.zeros((n, H, p1))
    ar = np.zeros((n, H, p1))
    W = 0
    for m in range(H):
        W = max(W, widths[m])
    qm = np.empty(W)
    qr = np.empty(W)
    s_m = np.empty(p1)
    s_r = np.empty(p1)
    e_lo = np.empty(p1)
    e_hi = np.empty(p1)
    cp = sum_factor(p1)
    dp = down(1.0 - gamma(p1))
    p = p1 - 1
    for i in range(n):
        x = ids[i, p]
        for m in range(H):
            a0 = starts[m]
            t = widths[m]
            g = gamma(t + 1)
            ct = sum_factor(t)
            for u in range(t):
                v = QEm[x, a0 + u] + QPm[p, a0 + u]
                qm[u] = v
                qr[u] = up_nonneg(up_nonneg(QEr[x, a0 + u] + QPr[p, a0 + u]) + up_nonneg(U * abs(v)))
            bad = False
            for j in range(p1):
                y = ids[i, j]
                mid = 0.0
                acc = 0.0
                for u in range(t):
                    km = KEm[y, a0 + u] + KPm[j, a0 + u]
                    kr = up_nonneg(up_nonneg(KEr[y, a0 + u] + KPr[j, a0 + u]) + up_nonneg(U * abs(km)))
                    mid += qm[u] * km
                    aq = abs(qm[u])
                    ak = abs(km)
                    w = up_nonneg(up_nonneg(up_nonneg(aq * kr) + up_nonneg(qr[u] * ak)) + up_nonneg(qr[u] * kr))
                    acc = up_nonneg(acc + up_nonneg(w + up_nonneg(g * up_nonneg(aq * ak))))
                rad = up_nonneg(up_nonneg(ct * acc) + (t + 1) * FLOOR) if t > 0 else 0.0
                if not (np.isfinite(mid) and np.isfinite(rad)):
                    bad = True
                s_m[j] = mid
                s_r[j] = rad
            if bad:
                for j in range(p1):
                    am[i, m, j], ar[i, m, j] = 0.5, 0.5
                continue
            M = -np.inf
            for j in range(p1):
                M = max(M, s_m[j])
            tot_lo = 0.0
            tot_hi = 0.0
            for j in range(p1):
                e_lo[j] = exp_below(down_finite(down_finite(s_m[j] - s_r[j]) - M), lo_t)
                e_hi[j] = exp_above(up_finite(up_finite(s_m[j] + s_r[j]) - M), hi_t)
                tot_lo += e_lo[j]
                tot_hi += e_hi[j]
            tot_hi = up_nonneg(cp * tot_hi)
            tot_lo = max(down(dp * tot_lo), 0.0)
            for j in range(p1):
                others_hi = up(tot_hi - e_hi[j])
                others_lo = max(down(tot_lo - e_lo[j]), 0.0)
                lo = down(e_lo[j] / up(e_lo[j] + others_hi))
                hi = up(e_hi[j] / down(e_hi[j] + others_lo))
                if not (lo >= 0.0):
                    lo = 0.0
                if not (hi <= 1.0):
                    hi = 1.0
                am[i, m, j], ar[i, m, j] = _from_bounds(lo, hi)
    return am, ar


# --- the readout: error and localization numbers of dense logit rows -----------------------------


@kernel()
def _gap(best, hi_o):
    """The L2 gap's lower bound from max_{t != o} lo(z_t) (``best``) and hi(z_o): rounded down,
    and >= 0 where the floats compare best >= hi(z_o) (the exact difference is then >= 0; a tie
    counts: :func:`verifier.arithmetic.logits._top_gap`); −∞ when nothing bounds the maximum."""
    if not np.isfinite(best):
        return -np.inf
    if best >= hi_o:
        return max(down(best - hi_o), 0.0)
    return down(best - hi_o)


@kernel()
def _dot_radius(S, Uabs, i, t, c, f):
    """Lemma D's radius of logit t of row i from its parts: up(up(c·fl(Σ_j S_ij·|U_tj|)) + f)."""
    acc = 0.0
    for j in range(S.shape[1]):
        acc += S[i, j] * Uabs[t, j]
    return up_nonneg(up_nonneg(c * acc) + f)


@kernel()
def _masses(sums, grow, shrink, skip_hi):
    """The valid and invalid masses of :func:`_add_term`'s ``sums`` enclosed: each float sum's
    lower end times ``shrink``, its upper end times ``grow`` plus its skipped tokens' bound
    ``skip_hi`` each (the callers' proofs); the others' lower sum and the target's term as
    they are. Returns (valid lo, valid hi, invalid lo, invalid hi, others' lo, target's hi)."""
    v_lo, v_hi, i_lo, i_hi, o_lo, t_hi, v_skip, i_skip = sums
    return (down(shrink * v_lo), up(up(grow * v_hi) + up(v_skip * skip_hi)), down(shrink * i_lo),
            up(up(grow * i_hi) + up(i_skip * skip_hi)), o_lo, t_hi)


@kernel()
def _readout_arrays(n):
    """Per row: error lower and upper end, argmax token (−1: none yet), gap and lower bound
    of 1 − P(o) (NaN: no target)."""
    return np.empty(n), np.empty(n), np.full(n, -1, np.int64), np.full(n, np.nan), np.full(n, np.nan)


@kernel()
def _mark_valid(i, valid_ptr, valid, vstamp):
    """Row i's valid next tokens marked i in ``vstamp`` (a token t is valid for row i where
    vstamp[t] == i)."""
    for q in range(valid_ptr[i], valid_ptr[i + 1]):
        vstamp[valid[q]] = i


@kernel()
def _nothing_known(i, o, err_lo, err_hi, gap, obj_lo):
    """Row i where a value is not finite: its error in [0, 1] and, with a target ``o``, no
    gap (−∞) and no lower bound of the ablated error (0)."""
    err_lo[i], err_hi[i] = 0.0, 1.0
    if o >= 0:
        gap[i] = -np.inf
        obj_lo[i] = 0.0


@kernel()
def _add_term(sums, valid, target, skipped, e_lo, e_hi):
    """A token's term added to a row's sums ``sums`` = (valid lo, valid hi, invalid lo,
    invalid hi, the other tokens' lo, the target's hi, valid skipped, invalid skipped): its
    bounds [e_lo, e_hi] of e^(z − M) to the valid or the invalid mass and, unless it is the
    ``target``, to the others'; a ``skipped`` token (its upper bound below e^SKIP, never the
    target) only counted, to be bounded as a whole."""
    v_lo, v_hi, i_lo, i_hi, o_lo, t_hi, v_skip, i_skip = sums
    if skipped:
        if valid:
            return v_lo, v_hi, i_lo, i_hi, o_lo, t_hi, v_skip + 1, i_skip
        return v_lo, v_hi, i_lo, i_hi, o_lo, t_hi, v_skip, i_skip + 1
    if valid:
        v_lo += e_lo
        v_hi += e_hi
    else:
        i_lo += e_lo
        i_hi += e_hi
    if target:
        t_hi = e_hi
    else:
        o_lo += e_lo
    return v_lo, v_hi, i_lo, i_hi, o_lo, t_hi, v_skip, i_skip


@kernel(args=(F2, F2, F2, F2, F1, "f64", "f64", I1, I1, I1, I1, F1, F1), returns=(F1, F1, I1, F1, F1))
def readout(Lm, Lr, S, Uabs, ub, c, f, valid_ptr, valid, target, vstamp, lo_t, hi_t):
    """Per row i of dense logits z = U·y enclosed as [Lm ± rad] (a row with a non-finite
    entry decides nothing): the enclosure of the error 1 − P(valid), the argmax token of the
    midpoints (the first of equal ones), and where ``target[i] = o >= 0``, a lower bound of
    max_{t != o} z_t − z_o (the localization's L2) and a lower end of 1 − P(o), o alone (L1).

    **Radii.** Either given whole (``Lr``, when ``S`` has no columns), or finished here from
    Lemma D's parts: S = up(yr + up(γ|ym|)) per row (``S``), |U| by token (``Uabs``, V × d),
    ub_t = max_j |U_tj| (``ub``), c = c_d and f = 2d·η (``c``, ``f``); then
    rad_t = up(up(c·fl(Σ_j S_j|U_tj|)) + f) is Lemma D's radius (the sum in any order). A
    token is first given the cheaper radius up(up(up(c·fl(Σ_j S_j))·ub_t) + f), also an upper
    bound (Σ_j S_j|U_tj| <= (Σ_j S_j)·ub_t, and Lemma 1 for the float sum), and only a token
    that this does not already put below :data:`SKIP` gets its own sum: in a trained model's
    readout almost every token lies far below the top, so the radius product costs next to
    nothing.

    **The error** is :func:`verifier.arithmetic.logits.error_enclosure`'s enclosure with no
    untouched token: with M the largest midpoint, z_t − M lies within δ = up(r_t + up(u·|x_c|))
    of x_c = fl(m_t − M) ((A1): the subtraction errs by at most u·|x_c|), and e_t = e^(z_t − M)
    is enclosed by :func:`exp_around`; S_val and S_inv the sums over the valid tokens and the others (Lemma 1:
    the exact sum of n non-negative terms is at most c_n·fl(S) and at least (1 − γ_n)·fl(S));
    error = S_inv/(S_inv + S_val), increasing in S_inv and decreasing in S_val. A term whose
    exponent's upper end is below :data:`SKIP` is not evaluated: it lies in [0, e^SKIP], and
    the count of such terms times an upper bound of e^SKIP is added to its sum's upper end (a
    term of 0 to its lower end): the enclosure is at most a few e^-64 wider than term by term.

    **The gap**: z_o <= hi(z_o), and max_{t != o} z_t >= lo(z_t) for each t != o (with either
    radius), the difference rounded down; where the floats compare best >= hi(z_o) the exact
    difference is >= 0 (a tie counts: :func:`verifier.arithmetic.logits._top_gap`).
    1 − P(o) = S_others/(S_others + e_o), S_others over every t != o, enclosed as the error is.

    ``vstamp``: a work array of V int64 (overwritten)."""
    n, V = Lm.shape
    d = S.shape[1]
    lazy = d > 0
    err_lo, err_hi, pred, gap, obj_lo = _readout_arrays(n)
    cV = sum_factor(V + 1)
    dd = down(1.0 - gamma(V + 1))
    skip_hi = exp_above(SKIP, hi_t)
    vstamp[:V] = -1
    for i in range(n):
        _mark_valid(i, valid_ptr, valid, vstamp)
        o = target[i]
        M = -np.inf
        arg = -1
        bad = False
        s1 = 0.0
        if lazy:
            for j in range(d):
                s1 += S[i, j]
            s1 = up_nonneg(c * s1)
            if not np.isfinite(s1):
                bad = True
        for t in range(V):
            m = Lm[i, t]
            if not np.isfinite(m) or (not lazy and not np.isfinite(Lr[i, t])):
                bad = True
            if m > M:
                M = m
                arg = t
        pred[i] = arg
        if bad or not np.isfinite(M):
            _nothing_known(i, o, err_lo, err_hi, gap, obj_lo)
            continue
        sums, best, hi_o = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0), -np.inf, 0.0     # (_add_term's sums)
        for t in range(V):
            m = Lm[i, t]
            if lazy:
                r = up_nonneg(up_nonneg(s1 * ub[t]) + f)
                if t == o or up_finite(up_finite(m + r) - M) >= SKIP:
                    r = _dot_radius(S, Uabs, i, t, c, f)
            else:
                r = Lr[i, t]
            xc = m - M
            delta = up_nonneg(r + up_nonneg(U * abs(xc)))
            x_hi = up_finite(xc + delta)
            if t == o:
                hi_o = up_finite(m + r)
            elif o >= 0:
                low = down_finite(m - r)
                if low > best:
                    best = low
            skipped = x_hi < SKIP and t != o
            e_lo, e_hi = (0.0, 0.0) if skipped else exp_around(xc, delta, lo_t, hi_t)
            sums = _add_term(sums, vstamp[t] == i, t == o, skipped, e_lo, e_hi)
        val_lo, val_hi, inv_lo, inv_hi, oth_lo, eo_hi = _masses(sums, cV, dd, skip_hi)
        hi_ = up(inv_hi / down(inv_hi + val_lo))
        lo_ = down(inv_lo / up(inv_lo + val_hi))
        err_hi[i] = hi_ if hi_ <= 1.0 else 1.0
        err_lo[i] = lo_ if lo_ >= 0.0 else 0.0
        if o >= 0:
            gap[i] = _gap(best, hi_o)
            oth_lo = down(dd * oth_lo)
            lo1 = down(oth_lo / up(oth_lo + eo_hi))
            obj_lo[i] = lo1 if lo1 >= 0.0 else 0.0
    return err_lo, err_hi, pred, gap, obj_lo


# --- the readout of a deployed pass (a floating-point format) -------------------------------------

#: Positions in :func:`readout_deployed`'s constants (``cst``): the logits' rounding beyond the
#: exact pass's radius (the output sum's floor carried by U, the logits' floor, the smallest
#: normal number of the format, whether the output sum is there, the largest finite value), then
#: the output softmax's constants in the order of :func:`verifier.passes.floating.softmax_constants`.
(DC_F_Y, DC_RHO_L, DC_F_L, DC_EMIN, DC_WITH_SUM, DC_LARGEST, DC_RHO, DC_REL, DC_TINY, DC_LO, DC_HI, DC_F_LO,
 DC_F_HI, DC_TAU) = range(14)


@kernel()
def _absolute(rs, l1y, cst):
    """A deployed logit's absolute allowance for a token whose row of U sums to ``rs`` (in
    absolute values): the output sum's floor carried through U (with the logits' rounding),
    the logits' floor, and the inputs-read-as-zero allowance 2·e_min·(||ŷ||_1 + Σ|U_t|)
    (:func:`verifier.arithmetic.deployed.widen_logit`)."""
    sum_floor = (up_nonneg(up_nonneg(rs * cst[DC_F_Y]) * up_nonneg(1.0 + cst[DC_RHO_L])) if cst[DC_WITH_SUM] != 0.0
                 else 0.0)
    return up_nonneg(up_nonneg(sum_floor + cst[DC_F_L])
                     + up_nonneg(up_nonneg(2.0 * cst[DC_EMIN]) * up_nonneg(l1y + rs)))


@kernel(args=(F2, F2, F2, F2, F1, "f64", "f64", F2, F1, F1, F1, I1, I1, I1, I1, F1, F1),
        returns=(F1, F1, I1, F1, F1, B1))
def readout_deployed(Lm, Lr, S, Uabs, ub, c, f, Mv, rs_l, l1y, cst, valid_ptr, valid, target, vstamp, lo_t, hi_t):
    """:func:`readout` for every execution in a floating-point format (Lemma F2 of
    :mod:`verifier.passes.floating` for the output softmax, as
    :func:`verifier.arithmetic.logits.error_enclosure_deployed` encloses it, with no untouched token).

    A logit's radius is Lemma D's for the enclosure of U·ŷ with its inputs S = up(S_y +
    up(ρ·m)) (``S``, or whole in ``Lr``): S_y the exact pass's parts of ŷ, m = |r̂| + |ô| per
    coordinate (``Mv``: the magnitudes of the terms a runtime adds), ρ the output sum's and the
    logits' rounding, so that the radius covers ρ·Σ_j |U_tj|·m_j (the stages' rounding,
    :func:`verifier.arithmetic.deployed.widen_logit`) besides the exact pass's; plus the
    token's absolute allowance (:func:`_absolute`, ``l1y`` the row's ||ŷ||_1 bound, ``rs_l`` the
    rows of |U| summed). A token whose magnitude (1 + ρ)·Σ_j |U_tj|·m_j may reach the format's
    largest value makes the row undecided (its bound first from (Σ_j m_j)·max_j |U_tj|, then,
    where that does not settle it, from the token's own sum). The softmax: M_hi the largest
    upper end (any upper bound of it is sound: it only widens θ), c the largest midpoint, each
    exponent widened by θ = rel·(M_hi − lo) + tiny, the exps by the format's factors, the sums
    A (valid) and B (the rest) by Lemma 1, then the mass's factors and τ. Skipped terms, the L2
    gap and 1 − P(o) (the valid set {o}) as in :func:`readout`. The last result says which rows
    decide nothing (a value that may be non-finite or overflow): their error is [0, 1]."""
    n, V = Lm.shape
    d = S.shape[1]
    lazy = d > 0
    undecided = np.zeros(n, np.bool_)
    err_lo, err_hi, pred, gap, obj_lo = _readout_arrays(n)
    cf = sum_factor(V + 2)
    dd = down(1.0 - gamma(V + 2))
    rel, tiny, lo_f, hi_f = cst[DC_REL], cst[DC_TINY], cst[DC_LO], cst[DC_HI]
    f_lo, f_hi, tau = cst[DC_F_LO], cst[DC_F_HI], cst[DC_TAU]
    rho1 = up_nonneg(1.0 + cst[DC_RHO])
    largest = cst[DC_LARGEST]
    skip_hi = up_nonneg(exp_above(SKIP, hi_t) * hi_f)
    total_hi = up_nonneg(f_hi + tau)
    vstamp[:V] = -1
    for i in range(n):
        _mark_valid(i, valid_ptr, valid, vstamp)
        o = target[i]
        s1 = 0.0
        s1m = 0.0
        for j in range(Mv.shape[1]):
            s1m += Mv[i, j]
            if lazy:
                s1 += S[i, j]
        s1 = up_nonneg(c * s1)
        s1m = up_nonneg(c * s1m)
        bad = not (np.isfinite(s1) and np.isfinite(s1m) and np.isfinite(l1y[i]))
        Mhi = -np.inf
        cs = -np.inf
        arg = -1
        for t in range(V):
            m = Lm[i, t]
            r = up_nonneg(up_nonneg(s1 * ub[t]) + f) if lazy else Lr[i, t]
            r = up_nonneg(r + _absolute(rs_l[t], l1y[i], cst))
            if not (np.isfinite(m) and np.isfinite(r)):
                bad = True
            if not (up_nonneg(rho1 * up_nonneg(s1m * ub[t])) < largest):
                acc = 0.0
                for j in range(Mv.shape[1]):
                    acc += Mv[i, j] * Uabs[t, j]
                if not (up_nonneg(rho1 * up_nonneg(up_nonneg(c * acc) + f)) < largest):
                    bad = True
            Mhi = max(Mhi, up_finite(m + r))
            if m > cs:
                cs = m
                arg = t
        pred[i] = arg
        if bad or not (np.isfinite(Mhi) and np.isfinite(cs)):
            _nothing_known(i, o, err_lo, err_hi, gap, obj_lo)
            undecided[i] = True
            continue
        sums, best, hi_o = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0), -np.inf, 0.0     # (_add_term's sums)
        for t in range(V):
            m = Lm[i, t]
            absolute = _absolute(rs_l[t], l1y[i], cst)
            if lazy:
                r = up_nonneg(up_nonneg(up_nonneg(s1 * ub[t]) + f) + absolute)
                lo = down_finite(m - r)
                theta = up_nonneg(up_nonneg(rel * up_finite(Mhi - lo)) + tiny)
                if t == o or up_finite(up_finite(up_finite(m + r) + theta) - cs) >= SKIP:
                    r = up_nonneg(_dot_radius(S, Uabs, i, t, c, f) + absolute)
            else:
                r = up_nonneg(Lr[i, t] + absolute)
            lo = down_finite(m - r)
            hi = up_finite(m + r)
            theta = up_nonneg(up_nonneg(rel * up_finite(Mhi - lo)) + tiny)
            if t == o:
                hi_o = hi
            elif o >= 0 and lo > best:
                best = lo
            x_hi = up_finite(up_finite(hi + theta) - cs)
            skipped = x_hi < SKIP and t != o
            e_lo = e_hi = 0.0
            if not skipped:
                e_lo = max(down_nonneg(exp_below(down_finite(down_finite(lo - theta) - cs), lo_t) * lo_f), 0.0)
                e_hi = up_nonneg(exp_above(x_hi, hi_t) * hi_f)
            sums = _add_term(sums, vstamp[t] == i, t == o, skipped, e_lo, e_hi)
        A_lo, A_hi, B_lo, B_hi, oth_lo, eo_hi = _masses(sums, cf, dd, skip_hi)
        r_lo = down(A_lo / up(A_lo + B_hi))
        r_hi = up(A_hi / down(A_hi + B_lo))
        if not (r_lo >= 0.0):
            r_lo = 0.0
        if not (r_hi <= 1.0):
            r_hi = 1.0
        mass_lo = max(down(down(r_lo * f_lo) - tau), 0.0)
        mass_hi = min(up(up(r_hi * f_hi) + tau), total_hi)
        err_lo[i] = down(1.0 - mass_hi)
        err_hi[i] = min(up(1.0 - mass_lo), 1.0)
        if o >= 0:
            gap[i] = _gap(best, hi_o)
            oth_lo = down(dd * oth_lo)
            p_hi = up(eo_hi / down(eo_hi + oth_lo))
            if not (p_hi <= 1.0):
                p_hi = 1.0
            obj_lo[i] = down(1.0 - min(up(up(p_hi * f_hi) + tau), total_hi))
    return err_lo, err_hi, pred, gap, obj_lo, undecided
