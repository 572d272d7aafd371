"""Rigorous interval arithmetic in float64, vectorised, dense and sparse.

An interval is a pair (mid, rad) of float64 arrays meaning [mid − rad, mid + rad];
for sparse matrices, a pair of CSR matrices with the same shape (an entry missing from
both is exactly 0). Weights are floats, hence exact rationals, and enter with rad = 0.

Rounding. IEEE-754 +, −, ×, ÷ are correctly rounded: |fl(x ∘ y) − x ∘ y| <= u·|x ∘ y|
with u = 2^-53 (barring underflow, covered by an absolute term η = 2^-1074 per
operation). A sum of n products computed in any order satisfies
|fl(Σ a_i b_i) − Σ a_i b_i| <= γ_n Σ |a_i||b_i|, γ_n = n·u/(1 − n·u) (Higham, Accuracy
and Stability of Numerical Algorithms, §3.1). Every radius below adds that term and
is then inflated by (1 + 4γ_n) to cover the rounding of the radius computation itself
(it is a sum of non-negative terms).

Exponential. :func:`exp_enclosure` does not trust the platform's ``exp``: it reduces
x = k·ln2 + r with |r| <= 0.35 (ln2 enclosed by two floats), evaluates the degree-14
Taylor polynomial of e^r by Horner (error <= (γ_28 + u)·e^|r|, Higham Thm 5.3, plus
the remainder |r|^15/15!·e^0.35 < 2^-62), and scales by 2^k exactly with ``ldexp``;
every step is widened outward. e^x is increasing, so [e^lo, e^hi] encloses e^[lo, hi].
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp

U = 2.0 ** -53
ETA = 2.0 ** -1074
LN2_LO = 0.6931471805599452862  # float just below ln 2
LN2_HI = 0.6931471805599453972  # float just above ln 2
assert LN2_LO < math.log(2) < LN2_HI or math.isclose(LN2_LO, math.log(2))
_TAYLOR = [1.0 / math.factorial(i) for i in range(15)]
_HORNER_ERR = 1e-14  # >= (γ_28 + u)·e^0.35 + 0.35^15/15!·e^0.35


def gamma(n: int) -> float:
    """γ_n = n·u / (1 − n·u)."""
    nu = n * U
    if nu >= 0.5:
        raise ValueError(f"too many terms for the rounding bound: {n}")
    return nu / (1.0 - nu)


def down(x: np.ndarray) -> np.ndarray:
    return np.nextafter(x, -np.inf)


def up(x: np.ndarray) -> np.ndarray:
    return np.nextafter(x, np.inf)


def _horner(r: np.ndarray) -> np.ndarray:
    acc = np.full_like(r, _TAYLOR[-1])
    for c in reversed(_TAYLOR[:-1]):
        acc = acc * r + c
    return acc


def exp_enclosure(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Floats (a, b) with a <= e^x <= b for every x in [lo, hi] (element-wise)."""
    lo = np.asarray(lo, np.float64)
    hi = np.asarray(hi, np.float64)
    return _exp_lower(lo), _exp_upper(hi)


def _reduce(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = np.rint(x * (1.0 / 0.6931471805599453))
    # r = x − k·ln2 with ln2 ∈ [LN2_LO, LN2_HI]; both products and the subtraction widened.
    kl = np.where(k >= 0, k * LN2_LO, k * LN2_HI)  # smallest k·ln2 candidate
    kh = np.where(k >= 0, k * LN2_HI, k * LN2_LO)
    r_lo = down(down(x - up(kh)))
    r_hi = up(up(x - down(kl)))
    return k, r_lo, r_hi


def _exp_lower(x: np.ndarray) -> np.ndarray:
    """A lower bound of e^x. Uses e^x >= e^min(x, 709), and 0 below −740."""
    xs = np.clip(x, -740.0, 709.0)
    k, r_lo, _ = _reduce(xs)
    t = down(_horner(r_lo) - _HORNER_ERR)
    with np.errstate(under="ignore"):
        v = down(np.ldexp(t, k.astype(np.int64)))
    return np.where(x < -740.0, 0.0, np.maximum(v, 0.0))


def _exp_upper(x: np.ndarray) -> np.ndarray:
    """An upper bound of e^x. Uses e^x <= e^max(x, −740), and +inf above 709."""
    xs = np.clip(x, -740.0, 709.0)
    k, _, r_hi = _reduce(xs)
    t = up(_horner(r_hi) + _HORNER_ERR)
    with np.errstate(under="ignore"):
        v = up(np.ldexp(t, k.astype(np.int64)))
    return np.where(x > 709.0, np.inf, v)


# --- dense helpers ---------------------------------------------------------------------


def add(am, ar, bm, br):
    m = am + bm
    return m, up((ar + br) * (1 + 4 * U) + U * np.abs(m))


def mul(am, ar, bm, br):
    """Element-wise product of intervals."""
    m = am * bm
    r = np.abs(am) * br + ar * np.abs(bm) + ar * br
    return m, up(r * (1 + 8 * U) + U * np.abs(m) + ETA)


def dot_rows(am, ar, bm, br):
    """Row-wise dot products Σ_t a_t b_t of two interval matrices (n x t)."""
    n = am.shape[-1]
    g = gamma(n + 2)
    m = np.sum(am * bm, axis=-1)
    r = np.sum(np.abs(am) * br + ar * np.abs(bm) + ar * br, axis=-1)
    t = np.sum(np.abs(am * bm), axis=-1)
    return m, up((r + g * t) * (1 + 4 * g) + (n + 1) * ETA)


def lower(m, r):
    return down(m - r)


def upper(m, r):
    return up(m + r)


# --- sparse helpers --------------------------------------------------------------------


def _max_terms(B: sp.csr_matrix, axis: int) -> int:
    if B.nnz == 0:
        return 1
    return int(B.getnnz(axis=axis).max())


def same_pattern(A: sp.csr_matrix, B: sp.csr_matrix) -> bool:
    """True if two CSR matrices store exactly the same (row, col) entries in the same order."""
    return (A.shape == B.shape and A.nnz == B.nnz and np.array_equal(A.indptr, B.indptr)
            and np.array_equal(A.indices, B.indices))


def smatmul(Xm: sp.csr_matrix, Xr: sp.csr_matrix, B: sp.spmatrix) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Interval X (sparse) times an exact sparse matrix B: (X @ B)."""
    B = sp.csr_matrix(B)
    absB = abs(B)
    n = min(_max_terms(B.tocsc(), 0), max(Xm.shape[1], 1)) + 2
    g = gamma(n)
    Ym = (Xm @ B).tocsr()
    # Xr|B| + γ|Xm||B| = (Xr + γ|Xm|)|B|: one product. The computed sums of non-negative
    # terms are within a factor (1 ± γ_n) of the true ones; inflating by (1 + 4γ_n), itself
    # rounded (relative error <= u <= γ_n), still covers them.
    if same_pattern(Xm, Xr):
        S = sp.csr_matrix((Xr.data + g * np.abs(Xm.data), Xm.indices, Xm.indptr), shape=Xm.shape)
    else:
        S = Xr + g * abs(Xm)
    R = (S @ absB).tocsr()
    R.data = R.data * (1 + 4 * g) + n * ETA
    if not same_pattern(Ym, R):
        # A midpoint entry whose radius terms all underflowed to 0 still carries rounding
        # error (at most n·η): give every midpoint entry at least that radius.
        floor = Ym.copy()
        floor.data = np.full(floor.nnz, n * ETA)
        R = (R + floor).tocsr()
    return Ym, R


def smatmul_rowbound(Xm: sp.csr_matrix, Xr: sp.csr_matrix, B: sp.spmatrix, Bmax: float | None = None):
    """X @ B with a per-row radius: Ym exactly as in :func:`smatmul`, radius r_i for every entry of row i.

    |(X@B)_ik − fl(Xm@B)_ik| <= Σ_j (xr_ij + γ|xm_ij|)·|b_jk| <= (Σ_j xr_ij + γ|xm_ij|)·max|B|,
    computed in O(nnz(X)) instead of a second sparse product. Looser than smatmul's
    radius, still rigorous; used where the product is dense and only comparisons matter.
    """
    B = sp.csr_matrix(B)
    n = min(_max_terms(B.tocsc(), 0), max(Xm.shape[1], 1)) + 2
    g = gamma(n)
    Ym = (Xm @ B).tocsr()
    bmax = float(abs(B).max()) if Bmax is None else Bmax
    rows_m = np.repeat(np.arange(Xm.shape[0]), np.diff(Xm.indptr))
    rows_r = np.repeat(np.arange(Xr.shape[0]), np.diff(Xr.indptr))
    s = np.bincount(rows_m, weights=g * np.abs(Xm.data), minlength=Xm.shape[0])
    s += np.bincount(rows_r, weights=Xr.data, minlength=Xr.shape[0])
    return Ym, (s * bmax) * (1 + 8 * g) + n * ETA


def srow_scale(Xm: sp.csr_matrix, Xr: sp.csr_matrix, am: np.ndarray, ar: np.ndarray):
    """Rows of interval X scaled by intervals a (one per row)."""
    Dm = sp.diags(am)
    Ym = (Dm @ Xm).tocsr()
    R = (sp.diags(np.abs(am)) @ Xr + sp.diags(ar) @ (abs(Xm) + Xr) + sp.diags(np.full(am.shape, U)) @ abs(Ym)).tocsr()
    R.data = R.data * (1 + 16 * U) + ETA
    if not same_pattern(Ym, R):  # an underflowed product still rounds by at most η
        floor = Ym.copy()
        floor.data = np.full(floor.nnz, ETA)
        R = (R + floor).tocsr()
    return Ym, R


def sadd(Am, Ar, Bm, Br):
    Ym = (Am + Bm).tocsr()
    Rs = (Ar + Br).tocsr()
    if same_pattern(Ym, Rs):
        return Ym, sp.csr_matrix(((Rs.data + U * np.abs(Ym.data)) * (1 + 8 * U), Ym.indices, Ym.indptr), shape=Ym.shape)
    R = (Rs + U * abs(Ym)).tocsr()
    R.data = R.data * (1 + 8 * U)
    return Ym, R
