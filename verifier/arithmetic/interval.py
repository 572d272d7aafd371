"""Rigorous interval arithmetic in float64: dense arrays and sparse matrices.

An interval is a pair (mid, rad) meaning [mid − rad, mid + rad], rad >= 0. Weights are
floats, hence exact rationals, and enter with rad = 0. An enclosure with a non-finite
mid or rad decides nothing (callers treat it as (−∞, ∞)).

Arithmetic model (checked at start by :func:`check_platform`)
---------------------------------------------------------------
(A1) float64 ``+ − × ÷`` are IEEE-754 binary64, round to nearest, gradual underflow:
     fl(x∘y) = (x∘y)(1 + δ) + η',  |δ| <= u = 2^-53,  |η'| <= η/2,  δ·η' = 0,
     with η = 2^-1074 the smallest subnormal; η' = 0 for + and − (a sum that lands in
     the subnormal range is exact). Equivalently |fl(x) − x| <= u·|fl(x)| + η/2.
     Overflow gives ±inf (or NaN), never a wrong finite number. The lemmas below
     assume no overflow: a midpoint that overflowed is not within any radius of the
     truth (−M − M + M + M is exactly 0 but sums to −inf from the left). Hence the rule:
     **an interval whose mid or rad is not finite means (−∞, ∞)**. Every primitive
     gives such a result an infinite radius, and :func:`lower` / :func:`upper`, through
     which every decision reads an interval, return −∞ / +∞ for it.
(A2) ``np.nextafter`` is exact, so for a single operation ``up(fl(x∘y)) >= x∘y`` and
     ``down(fl(x∘y)) <= x∘y``: one operation rounded to nearest, then one step
     outward, is rounded in that direction. Every radius below is computed as a chain
     of such steps (``up`` after each operation), so it is an upper bound *whatever*
     underflows: a product that rounds to 0 becomes η after ``up``.
(A3) numpy and scipy reductions (``sum``, ``add.reduceat``, sparse products) compute
     each result as a sum of the given terms in *some* order (pairwise, blocked,
     sequential: any), each addition as in (A1); a scipy sparse product's entry (i, k)
     is such a sum of the (A1) products a_ij·b_jk over the stored entries with a
     common j, and scipy may omit the entry when the computed sum is exactly 0.

Two lemmas (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1 and §2.2;
the underflow terms follow from (A1) with η' per product and none per addition):

**Lemma 1** (non-negative sums). For floats t_1..t_n >= 0 summed in any order,
Σ t <= (1 + 2γ_n)·fl(Σ t), where γ_n = n·u/(1 − n·u) <= 1/2.

**Lemma 2** (dot products). For floats a_j, b_j (j = 1..n), summed in any order,
|fl(Σ a_j b_j) − Σ a_j b_j| <= γ_n·Σ |a_j b_j| + n·η; and if a_j, b_j >= 0,
Σ a_j b_j <= (1 + 2γ_n)·fl(Σ a_j b_j) + n·η.

Interval dot products follow: for x_j ∈ [xm_j ± xr_j] and exact b_j,
|Σ x_j b_j − fl(Σ xm_j b_j)| <= Σ (xr_j + γ_n|xm_j|)·|b_j| + n·η. The weights
s_j = up(xr_j + up(γ_n·|xm_j|)) >= xr_j + γ_n|xm_j| (A2), and by Lemma 2 the radius
up(up(c_n·fl(Σ s_j|b_j|)) + 2n·η), c_n = up(1 + 2γ_n), bounds the error. The floor
2n·η is what makes an *underflowed* entry safe: however small its computed terms,
a structurally present entry keeps a radius of at least η, which later layers amplify
honestly instead of treating as an exact zero. (The code uses the larger floor
:data:`FLOOR` = 2^-1022, the smallest normal number, in place of η: as sound, and
radii then never enter the slow subnormal range.)

Sparse intervals
----------------
:class:`SparseInterval` stores one CSR *pattern* with a mid and a rad array on it.
**Invariant: an entry outside the pattern is exactly 0.** Products compute their
pattern *structurally*: (i, k) is in the pattern of X·B iff some j has (i, j) stored
in X and (j, k) stored in B, whatever the values (a product of all-ones copies counts
the terms; counts are exact integers, never 0 where a term exists). An entry is
therefore absent only when no term contributes to it, and is then exactly 0; scipy's
habit of dropping computed zeros (an underflow, a cancellation) can no longer turn a
non-zero value into an "exact" zero. Entries stored with mid = rad = 0 are exactly 0
too (rad is a valid radius) and may be pruned.

Exponential
-----------
:func:`exp_enclosure` does not trust the platform's ``exp``: it reduces
x = k·ln2 + r with |r| <= 0.35 (ln2 enclosed by two floats), evaluates the degree-14
Taylor polynomial of e^r by Horner (error <= (γ_28 + u)·e^|r| plus the remainder
|r|^15/15!·e^0.35 < 2^-62, together below ``HORNER_ERR``), and scales by 2^k with
``ldexp`` (exact unless the result is subnormal; one outward step covers that). e^x is
increasing, so [e^lo, e^hi] encloses e^[lo, hi]. ``tests/verifier/arithmetic/test_interval.py`` checks
the constants and the enclosure against mpmath.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from verifier.arithmetic.constants import (  # noqa: F401
    ETA, EXP_MAX, EXP_MIN, FLOOR, HORNER_ERR, INV_LN2, LN2_HI, LN2_LO, TAYLOR, TINY, U)


# --- rounding steps -------------------------------------------------------------------------------


def down(x):
    return np.nextafter(x, -np.inf)


def up(x):
    return np.nextafter(x, np.inf)


def gamma(n: int) -> float:
    """An upper bound of γ_n = n·u / (1 − n·u)."""
    nu = n * U
    if nu >= 0.25:
        raise ValueError(f"too many terms for the rounding bound: {n}")
    return float(up(up(nu) / down(1.0 - nu)))


def gammas(n: np.ndarray) -> np.ndarray:
    """:func:`gamma` element-wise (the same operations, so the same floats)."""
    nu = np.asarray(n, np.float64) * U
    if nu.size and nu.max() >= 0.25:
        raise ValueError(f"too many terms for the rounding bound: {int(np.max(n))}")
    return up(up(nu) / down(1.0 - nu))


def sum_factor(n: int) -> float:
    """c_n = up(1 + 2γ_n): Σ t <= c_n·fl(Σ t) for n non-negative terms (Lemma 1)."""
    return float(up(1.0 + 2.0 * gamma(n)))


def check_platform() -> None:
    """Refuse to run where the arithmetic model (A1) does not hold.

    Checks, in numpy's vectorised loops and in a scipy sparse product, that rounding is
    to nearest (ties to even) and that subnormals are neither flushed to zero on output
    (FTZ) nor read as zero on input (DAZ); some libraries built with fast-math switch
    both on for the whole process, which would make underflowed terms silently vanish.
    """
    n = 64
    one = np.ones(n)
    tie = one + np.full(n, 2.0 ** -53)               # a tie: rounds to even, i.e. 1
    above = one + np.full(n, 3 * 2.0 ** -54)          # rounds up to 1 + 2^-52
    below = -one - np.full(n, 3 * 2.0 ** -54)         # rounds down to −(1 + 2^-52)
    tiny = np.full(n, ETA)
    sub = np.full(n, 2.0 ** -1060)
    ok = (np.all(tie == 1.0) and np.all(above == 1.0 + 2.0 ** -52) and np.all(below == -(1.0 + 2.0 ** -52))
          and np.all(tiny * 2.0 == 2 * ETA)            # DAZ would read η as 0
          and np.all(sub * 0.5 == 2.0 ** -1061)         # FTZ would flush a subnormal result
          and np.all(np.nextafter(np.zeros(n), 1.0) == ETA))
    if ok:
        B = sp.csr_matrix(np.full((2, 2), 2.0 ** -537))
        ok = bool(np.all((B @ B).toarray() == 2.0 ** -1073))  # two products of exactly η each: FTZ gives 0
    if not ok:
        raise RuntimeError("this process does not compute in IEEE-754 binary64 round-to-nearest with gradual underflow "
                           "(a library may have enabled flush-to-zero); certified results would not be proofs")


# --- the exponential ------------------------------------------------------------------------------


def _horner(r: np.ndarray) -> np.ndarray:
    acc = np.full_like(r, TAYLOR[-1])
    for c in reversed(TAYLOR[:-1]):
        acc = acc * r + c
    return acc


def _reduce(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = np.rint(x * INV_LN2)
    # r = x − k·ln2 with ln2 ∈ [LN2_LO, LN2_HI]; both products and the subtraction widened.
    kl = np.where(k >= 0, k * LN2_LO, k * LN2_HI)  # smallest k·ln2 candidate
    kh = np.where(k >= 0, k * LN2_HI, k * LN2_LO)
    r_lo = down(down(x - up(kh)))
    r_hi = up(up(x - down(kl)))
    return k, r_lo, r_hi


def _exp_lower(x: np.ndarray) -> np.ndarray:
    """A lower bound of e^x: e^x >= e^min(x, 709); 0 below −740 and for NaN; down(1) for
    |x| <= 2^-60 (e^x >= 1 − 2^-60 there; and no subnormal arithmetic in the polynomial)."""
    xn = np.nan_to_num(x, nan=-np.inf)
    tiny = np.abs(xn) <= TINY
    xs = np.where(tiny, 0.0, np.clip(xn, EXP_MIN, EXP_MAX))
    k, r_lo, _ = _reduce(xs)
    t = down(_horner(r_lo) - HORNER_ERR)
    with np.errstate(under="ignore"):
        v = down(np.ldexp(t, k.astype(np.int64)))
    return np.where(xn < EXP_MIN, 0.0, np.where(tiny, down(1.0), np.maximum(v, 0.0)))


def _exp_upper(x: np.ndarray) -> np.ndarray:
    """An upper bound of e^x: e^x <= e^max(x, −740); +inf above 709 and for NaN; up(1) for
    |x| <= 2^-60 (e^x < 1 + 2^-59 there)."""
    xn = np.nan_to_num(x, nan=np.inf)
    tiny = np.abs(xn) <= TINY
    xs = np.where(tiny, 0.0, np.clip(xn, EXP_MIN, EXP_MAX))
    k, _, r_hi = _reduce(xs)
    t = up(_horner(r_hi) + HORNER_ERR)
    with np.errstate(under="ignore"):
        v = up(np.ldexp(t, k.astype(np.int64)))
    return np.where(xn > EXP_MAX, np.inf, np.where(tiny, up(1.0), v))


def exp_enclosure(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Floats (a, b) with a <= e^x <= b for every x in [lo, hi] (element-wise; NaN: [0, ∞])."""
    return _exp_lower(np.asarray(lo, np.float64)), _exp_upper(np.asarray(hi, np.float64))


def exp_lo_unique(x: np.ndarray) -> np.ndarray:
    """Lower enclosure of exp at each x, evaluated once per distinct value."""
    u, inv = np.unique(x, return_inverse=True)
    return _exp_lower(u)[inv.reshape(-1)].reshape(x.shape)


def exp_hi_unique(x: np.ndarray) -> np.ndarray:
    u, inv = np.unique(x, return_inverse=True)
    return _exp_upper(u)[inv.reshape(-1)].reshape(x.shape)


# --- softmax ------------------------------------------------------------------------------------


def softmax_bounds(s_lo: np.ndarray, s_hi: np.ndarray, s_mid: np.ndarray):
    """Enclosure (lo, hi) of softmax over the last axis from score bounds.

    a_j = e_j / (e_j + Σ_{l≠j} e_l) increases in e_j and decreases in the others, so
    lo uses e_j's lower and the others' upper bounds, and hi the reverse. Any shift M
    leaves the ratios unchanged; sums of the non-negative e's are bounded by Lemma 1 of
    :mod:`verifier.arithmetic.interval`, every other step is one operation rounded outward.
    """
    M = s_mid.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        e_lo = exp_lo_unique(down(s_lo - M))
        e_hi = exp_hi_unique(up(s_hi - M))
    return ratio_bounds(e_lo, e_hi)


def ratio_bounds(e_lo: np.ndarray, e_hi: np.ndarray):
    """Enclosure (lo, hi) of e_j / Σ_l e_l over the last axis, for e_l ∈ [e_lo_l, e_hi_l], e_lo >= 0.

    The ratio increases in e_j and decreases in the others: lo takes e_j's lower and the
    others' upper bounds, hi the reverse. Sums of the non-negative bounds are enclosed by
    Lemma 1 of :mod:`verifier.arithmetic.interval`, every other step is one operation rounded outward.
    """
    J = e_lo.shape[-1]
    tot_hi = up(sum_factor(J) * e_hi.sum(axis=-1, keepdims=True))
    tot_lo = down(down(1.0 - gamma(J)) * e_lo.sum(axis=-1, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        others_hi = up(tot_hi - e_hi)
        others_lo = np.maximum(down(tot_lo - e_lo), 0.0)
        lo = down(e_lo / up(e_lo + others_hi))
        hi = up(e_hi / down(e_hi + others_lo))
    lo = np.nan_to_num(lo, nan=0.0)
    hi = np.minimum(np.nan_to_num(hi, nan=1.0), 1.0)
    return np.maximum(lo, 0.0), hi


# --- dense intervals ------------------------------------------------------------------------------


def guard(m, r):
    """The radius, infinite wherever the midpoint or the radius is not finite (overflow: unbounded)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(m) & np.isfinite(r), r, np.inf)


def lower(m, r):
    """A lower end of [m ± r]: −∞ unless both are finite."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(np.isfinite(m) & np.isfinite(r), down(m - r), -np.inf)


def upper(m, r):
    """An upper end of [m ± r]: +∞ unless both are finite."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(np.isfinite(m) & np.isfinite(r), up(m + r), np.inf)


def add_rad(*terms):
    """An upper bound of the sum of non-negative terms: up after every addition."""
    acc = terms[0]
    for t in terms[1:]:
        acc = up(acc + t)
    return acc


def mul_rad(am, ar, bm, br):
    """Radius of the product of [am ± ar]·[bm ± br] around fl(am·bm) (element-wise).

    |ab − fl(am·bm)| <= |am|·br + ar·|bm| + ar·br + u·|fl(am·bm)| + η/2 by (A1).
    """
    m = am * bm
    return guard(m, add_rad(up(np.abs(am) * br), up(ar * np.abs(bm)), up(ar * br), up(U * np.abs(m)), FLOOR))


def sum_rad(mids: np.ndarray, rads: np.ndarray, axis: int = -1):
    """Σ of n intervals along ``axis``: (fl(Σ mid), radius covering rads and the sum's rounding)."""
    n = mids.shape[axis]
    g = gamma(n + 1)
    m = np.sum(mids, axis=axis)
    w = add_rad(rads, up(g * np.abs(mids)))
    return m, guard(m, up(sum_factor(n) * np.sum(w, axis=axis)))


def dot_rows(am, ar, bm, br):
    """Row-wise dot products Σ_t a_t b_t of two interval matrices (n x t).

    Each term's product radius (|am|br + ar|bm| + ar·br, all rounded up) plus γ_t|am·bm|
    for the rounding of the midpoint sum, plus t·η for its underflows (Lemma 2).
    """
    t = am.shape[-1]
    g = gamma(t + 1)
    m = np.sum(am * bm, axis=-1)
    w = add_rad(up(np.abs(am) * br), up(ar * np.abs(bm)), up(ar * br), up(g * up(np.abs(am) * np.abs(bm))))
    return m, guard(m, add_rad(up(sum_factor(t) * np.sum(w, axis=-1)), (t + 1) * FLOOR))


def dot_segments(am, ar, bm, br, starts: np.ndarray, widths: np.ndarray):
    """Dot products over consecutive segments of the last axis (one per head of a stack).

    Segment s covers ``widths[s]`` entries from ``starts[s]``; the result has one entry
    per segment along the last axis, each enclosed as in :func:`dot_rows` (with γ for
    the widest segment); an empty segment is exactly 0.
    """
    t = int(widths.max(initial=0))
    g = gamma(t + 1)
    shape = np.broadcast_shapes(am.shape, bm.shape)[:-1] + (starts.size,)
    if am.shape[-1] == 0 or bm.shape[-1] == 0 or t == 0:
        return np.zeros(shape), np.zeros(shape)
    safe = np.minimum(starts, am.shape[-1] - 1)
    m = np.add.reduceat(am * bm, safe, axis=-1)
    w = add_rad(up(np.abs(am) * br), up(ar * np.abs(bm)), up(ar * br), up(g * up(np.abs(am) * np.abs(bm))))
    r = add_rad(up(sum_factor(t) * np.add.reduceat(w, safe, axis=-1)), (t + 1) * FLOOR)
    empty = widths == 0
    m = np.where(empty, 0.0, m)
    r = np.where(empty, 0.0, r)
    return m, guard(m, r)


def gather_add(A: tuple[np.ndarray, np.ndarray], B: tuple[np.ndarray, np.ndarray], rows_a, row_b):
    """A[rows_a] + B[row_b] for dense intervals; the addition's rounding is at most u·|fl| (A1)."""
    m = A[0][rows_a] + B[0][row_b]
    return m, guard(m, add_rad(A[1][rows_a], B[1][row_b], up(U * np.abs(m))))


def from_bounds(lo: np.ndarray, hi: np.ndarray):
    """Mid-radius form of [lo, hi]; a point interval stays a point (radius exactly 0)."""
    point = lo == hi
    with np.errstate(invalid="ignore", over="ignore"):
        mid = np.where(point, lo, 0.5 * lo + 0.5 * hi)
        rad = np.where(point, 0.0, np.maximum(up(hi - mid), up(mid - lo)))
    return mid, rad


# --- sparse intervals -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseInterval:
    """A sparse interval matrix: [mid ± rad] on a canonical CSR pattern, exactly 0 elsewhere."""

    shape: tuple[int, int]
    indptr: np.ndarray
    indices: np.ndarray
    mid: np.ndarray
    rad: np.ndarray

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    def row_ids(self) -> np.ndarray:
        """The row of each stored entry."""
        return np.repeat(np.arange(self.shape[0], dtype=np.int64), np.diff(self.indptr))

    def mid_csr(self) -> sp.csr_matrix:
        return sp.csr_matrix((self.mid, self.indices, self.indptr), shape=self.shape)

    def nonfinite_rows(self) -> np.ndarray:
        """Rows holding an entry whose enclosure is not finite (such a row decides nothing)."""
        bad = ~(np.isfinite(self.mid) & np.isfinite(self.rad))
        return np.bincount(self.row_ids()[bad], minlength=self.shape[0]) > 0

    def rows(self, idx: np.ndarray) -> "SparseInterval":
        """Rows ``idx`` (in that order)."""
        idx = np.asarray(idx, np.int64)
        counts = self.indptr[idx + 1] - self.indptr[idx]
        ptr = np.zeros(idx.size + 1, np.int64)
        np.cumsum(counts, out=ptr[1:])
        pos = np.repeat(self.indptr[idx] - ptr[:-1], counts) + np.arange(int(ptr[-1]))
        return SparseInterval((idx.size, self.shape[1]), ptr, self.indices[pos], self.mid[pos], self.rad[pos])

    def only(self, columns: np.ndarray) -> "SparseInterval":
        """The entries in the columns ``columns`` marks (bool per column), each row's in their
        order; the others dropped (for a reader of those columns alone, the same matrix)."""
        hit = np.asarray(columns, bool)[self.indices]
        if hit.all():
            return self
        ptr = np.zeros(self.shape[0] + 1, np.int64)
        np.cumsum(np.bincount(self.row_ids()[hit], minlength=self.shape[0]), out=ptr[1:])
        return SparseInterval(self.shape, ptr, self.indices[hit], self.mid[hit], self.rad[hit])

    def prune(self) -> "SparseInterval":
        """Without entries that are exactly 0 (mid = rad = 0)."""
        keep = (self.mid != 0) | (self.rad != 0)
        if keep.all():
            return self
        return from_coo(self.shape, self.row_ids()[keep], self.indices[keep], self.mid[keep], self.rad[keep])

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        m = np.zeros(self.shape)
        r = np.zeros(self.shape)
        rows = self.row_ids()
        m[rows, self.indices] = self.mid
        r[rows, self.indices] = self.rad
        return m, r


def as_csr(M: sp.spmatrix) -> sp.csr_matrix:
    """A canonical CSR or CSC matrix as canonical CSR, by moving entries (no arithmetic:
    each entry is stored once, so no two values are ever added)."""
    if M.format == "csr":
        return M
    out = sp.csr_matrix(M)
    out.sort_indices()
    if out.nnz != M.nnz:
        raise ValueError("converting to CSR changed the number of stored entries")
    return out


def exact(M: sp.spmatrix) -> SparseInterval:
    """An exact canonical CSR or CSC matrix as a CSR point interval (every stored entry
    kept, even a stored 0). A canonical CSC matrix holds each entry once, so converting it
    to CSR moves values without adding any: exact."""
    from layout import sparse_problem

    problem = sparse_problem(M)
    if problem:
        raise ValueError(f"not a canonical float64 CSR or CSC matrix: {problem}")
    M = as_csr(M)
    return SparseInterval(M.shape, M.indptr.astype(np.int64), M.indices.astype(np.int64),
                          M.data.astype(np.float64), np.zeros(M.nnz))


def from_coo(shape, rows, cols, mids, rads) -> SparseInterval:
    """Entries given once each (no repeated (row, col)), in any order."""
    rows = np.asarray(rows, np.int64)
    cols = np.asarray(cols, np.int64)
    order = np.lexsort((cols, rows))
    ptr = np.zeros(shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=shape[0]), out=ptr[1:])
    return SparseInterval(tuple(shape), ptr, cols[order], np.asarray(mids, np.float64)[order],
                          np.asarray(rads, np.float64)[order])


def sum_terms(shape, rows, cols, mids, rads, terms: int | None = None) -> SparseInterval:
    """Σ of interval terms with equal (row, col).

    The midpoint of an entry is the float sum of its terms' midpoints (additions only:
    error <= γ_T Σ|mid|, no underflow term by (A1)); its radius bounds the terms' radii
    plus that rounding, by Lemma 1. Every (row, col) that has a term is kept. T is the most
    terms any entry has, or ``terms`` when given (at least that many; γ_n and c_n grow with
    n): a fixed count makes an entry's enclosure depend on its own terms only.
    """
    rows = np.asarray(rows, np.int64)
    cols = np.asarray(cols, np.int64)
    n_rows, n_cols = shape
    if rows.size == 0:
        return SparseInterval(tuple(shape), np.zeros(n_rows + 1, np.int64), np.zeros(0, np.int64),
                              np.zeros(0), np.zeros(0))
    key = rows * n_cols + cols
    order = np.argsort(key, kind="stable")
    key = key[order]
    start = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    max_terms = int(np.diff(np.append(start, key.size)).max())
    if terms is not None:
        if max_terms > terms:
            raise ValueError(f"an entry has more than the {terms} terms its rounding bound allows")
        max_terms = terms
    g = gamma(max_terms + 1)
    mids = np.asarray(mids, np.float64)[order]
    w = add_rad(np.asarray(rads, np.float64)[order], up(g * np.abs(mids)))
    mid = np.add.reduceat(mids, start)
    rad = guard(mid, up(sum_factor(max_terms) * np.add.reduceat(w, start)))
    ukey = key[start]
    out_rows = ukey // n_cols
    ptr = np.zeros(n_rows + 1, np.int64)
    np.cumsum(np.bincount(out_rows, minlength=n_rows), out=ptr[1:])
    return SparseInterval(tuple(shape), ptr, ukey - out_rows * n_cols, mid, rad)


def vstack(parts: list[SparseInterval]) -> SparseInterval:
    """The rows of every part, one part after another (same number of columns)."""
    cols = parts[0].shape[1]
    ptrs, offset = [np.zeros(1, np.int64)], 0
    for x in parts:
        ptrs.append(x.indptr[1:] + offset)
        offset += x.nnz
    return SparseInterval((sum(x.shape[0] for x in parts), cols), np.concatenate(ptrs),
                          np.concatenate([x.indices for x in parts]), np.concatenate([x.mid for x in parts]),
                          np.concatenate([x.rad for x in parts]))


def add(A: SparseInterval, B: SparseInterval) -> SparseInterval:
    """A + B (same shape); the pattern is the union of both."""
    return sum_terms(A.shape, np.concatenate([A.row_ids(), B.row_ids()]), np.concatenate([A.indices, B.indices]),
                     np.concatenate([A.mid, B.mid]), np.concatenate([A.rad, B.rad]))


def _ones(indptr, indices, shape) -> sp.csr_matrix:
    return sp.csr_matrix((np.ones(indices.size), indices, indptr), shape=shape)


def _align(pattern: sp.csr_matrix, M: sp.csr_matrix) -> np.ndarray:
    """Values of ``M`` on ``pattern``'s entries (both sorted; M's entries ⊆ pattern's); 0 elsewhere."""
    out = np.zeros(pattern.nnz)
    if M.nnz == 0:
        return out
    w = pattern.shape[1]
    pkey = np.repeat(np.arange(pattern.shape[0], dtype=np.int64), np.diff(pattern.indptr)) * w + pattern.indices
    mkey = np.repeat(np.arange(M.shape[0], dtype=np.int64), np.diff(M.indptr)) * w + M.indices
    pos = np.searchsorted(pkey, mkey)
    if pos.size and (pos.max() >= pkey.size or not np.array_equal(pkey[pos], mkey)):
        raise AssertionError("a sparse product stored an entry outside its structural pattern")
    out[pos] = M.data
    return out


@dataclass(frozen=True)
class Thin:
    """An exact sparse matrix B kept by the rows that hold an entry: row ``rows[r]`` of B
    is row r of ``M``, every other row is empty. For a transposed weight matrix that reads
    few of the d residual directions (a head's W_Q^T: d rows, a handful of entries) it
    holds nothing of size d, where a CSR matrix holds a row pointer of d + 1 entries."""

    shape: tuple[int, int]
    rows: np.ndarray            # (u,) sorted row ids of B with an entry
    M: sp.csr_matrix            # (u, shape[1]) those rows, canonical
    absM: sp.csr_matrix         # |M|, on M's pattern

    @staticmethod
    def transpose_of(W: sp.spmatrix) -> "Thin":
        """B = W^T for a canonical CSR or CSC W (no arithmetic: entries are moved)."""
        Wc = sp.csc_matrix(W)                      # column j of W is row j of B
        Wc.sort_indices()
        counts = np.diff(Wc.indptr)
        rows = np.flatnonzero(counts).astype(np.int64)
        ptr = np.zeros(rows.size + 1, np.int64)
        np.cumsum(counts[rows], out=ptr[1:])
        M = sp.csr_matrix((Wc.data, Wc.indices, ptr), shape=(rows.size, W.shape[0]))
        if M.nnz != W.nnz:
            raise ValueError("transposing changed the number of stored entries")
        return Thin((W.shape[1], W.shape[0]), rows, M, abs(M))

    @property
    def nnz(self) -> int:
        return int(self.M.nnz)

    def abs(self) -> "Thin":
        """|B|."""
        return Thin(self.shape, self.rows, self.absM, self.absM)

    def restrict(self, X: SparseInterval) -> SparseInterval:
        """X with its columns renumbered to ``rows`` (column rows[r] becomes r) and its
        entries in other columns dropped, each row's entries in their order. Such an entry
        meets an empty row of B and forms no term of X @ B."""
        pos = np.searchsorted(self.rows, X.indices)
        hit = pos < self.rows.size
        hit[hit] = self.rows[pos[hit]] == X.indices[hit]
        ptr = np.zeros(X.shape[0] + 1, np.int64)
        np.cumsum(np.bincount(X.row_ids()[hit], minlength=X.shape[0]), out=ptr[1:])
        return SparseInterval((X.shape[0], self.rows.size), ptr, pos[hit], X.mid[hit], X.rad[hit])


def matmul(X: SparseInterval, B: "sp.csr_matrix | Thin", absB: sp.csr_matrix | None = None) -> SparseInterval:
    """X @ B for an exact sparse B: structural pattern, radius by Lemma 2 (module docstring).

    ``absB`` may pass |B| precomputed. The rounding bound of row i uses n_i, the most
    terms of an entry of that row (γ_{n_i + 1} and c_{n_i}): a row's radii depend on that
    row and B only, never on which other rows are multiplied with it (so a product of a
    subset of rows, or of B restricted to the columns the rows reach, gives the same
    radii: :mod:`verifier.running.shards` relies on it).

    B may be :class:`Thin`: X is then restricted to the rows B holds
    (:meth:`Thin.restrict`) and multiplied by them. The result is bit for bit the same:
    the dropped entries form no term, so the term counts, the pattern and every sum (each
    row's terms taken in the order of its entries, which is kept) are unchanged.
    """
    if isinstance(B, Thin):
        if X.shape[1] != B.shape[0]:
            raise ValueError("shapes do not match")
        out = matmul(B.restrict(X), B.M, B.absM)
        return SparseInterval((X.shape[0], B.shape[1]), out.indptr, out.indices, out.mid, out.rad)
    B = sp.csr_matrix(B)
    shape = (X.shape[0], B.shape[1])
    if X.nnz == 0 or B.nnz == 0:
        return SparseInterval(shape, np.zeros(shape[0] + 1, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    C = _ones(X.indptr, X.indices, X.shape) @ _ones(B.indptr, B.indices, B.shape)   # term counts, exact integers
    C = C.tocsr()
    C.sort_indices()
    if C.nnz == 0:
        return SparseInterval(shape, np.zeros(shape[0] + 1, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    counts = np.diff(C.indptr)
    n_row = np.zeros(C.shape[0])
    has = counts > 0
    n_row[has] = np.maximum.reduceat(C.data, C.indptr[:-1][has])      # most terms of an entry, per row
    g_row = gammas(n_row + 1)
    c_row = up(1.0 + 2.0 * gammas(n_row))                                # sum_factor per row
    Ym = (X.mid_csr() @ B).tocsr()
    Ym.sort_indices()
    S = sp.csr_matrix((add_rad(X.rad, up(g_row[X.row_ids()] * np.abs(X.mid))), X.indices, X.indptr), shape=X.shape)
    Rs = (S @ (abs(B) if absB is None else absB)).tocsr()
    Rs.sort_indices()
    mid = _align(C, Ym)
    c_entry = np.repeat(c_row, counts)
    rad = guard(mid, add_rad(up(c_entry * _align(C, Rs)), up(2.0 * FLOOR * C.data)))
    return SparseInterval(shape, C.indptr.astype(np.int64), C.indices.astype(np.int64), mid, rad)


def row_bound_matmul(X: SparseInterval, B: sp.csr_matrix, colmax: np.ndarray):
    """X @ B with one radius per row covering every column: (dense fl(Xm @ B), radius per row).

    With c_j = max_k |b_jk| (``colmax``, one value per row j of B; 0 where B reads nothing)
    and n the most entries stored in a column of B,
    |(X B)_ik − fl(Xm B)_ik| <= Σ_j (xr_ij + γ_n|xm_ij|)·|b_jk| + n·η
                             <= Σ_j s_ij·c_j + n·η,   s_ij = up(xr_ij + up(γ_n|xm_ij|)),
    where the last sum is of non-negative products rounded up one by one and bounded by
    Lemma 1. Directions B never reads cost nothing. Used for the gate, whose scores are
    dense and only compared.
    """
    B = sp.csr_matrix(B)
    max_terms = int(np.bincount(B.indices, minlength=1).max()) if B.nnz else 1
    g = gamma(max_terms + 1)
    Ym = np.asarray((X.mid_csr() @ B).toarray())
    c = colmax[X.indices]
    read = c > 0
    rows = X.row_ids()[read]
    t = up(add_rad(X.rad[read], up(g * np.abs(X.mid[read]))) * c[read])
    n_row = np.bincount(rows, minlength=X.shape[0])
    S = np.bincount(rows, weights=t, minlength=X.shape[0])
    S = up(sum_factor(int(n_row.max(initial=1))) * S)
    rad = add_rad(S, float(2 * (max_terms + 1)) * FLOOR)
    with np.errstate(invalid="ignore"):
        return Ym, np.where(np.isfinite(Ym).all(axis=1) & np.isfinite(rad), rad, np.inf)


def scale_rows(X: SparseInterval, am: np.ndarray, ar: np.ndarray) -> SparseInterval:
    """Row i of X times the interval [am_i ± ar_i] (element-wise on the stored entries)."""
    rows = X.row_ids()
    a_m, a_r = am[rows], ar[rows]
    return SparseInterval(X.shape, X.indptr, X.indices, a_m * X.mid, mul_rad(a_m, a_r, X.mid, X.rad))
