"""The certified forward pass: every quantity enclosed, vectorised over a batch.

A batch is n prefixes of one length p (token ids, BOS prepended here). For each row
the pass returns enclosures of the gate scores, the routing decision with its
certified margin, and the error 1 − P(valid) of the next-token distribution, for the
model and for the model with the routed expert's output removed (ablation). The
equations are those of :mod:`verifier.layout`; the arithmetic is
:mod:`verifier.interval` (mid-radius, outward rounding, enclosed exp).

Speed without changing the computation:

* **Linearity.** W_K h_j = W_K E[x_j] + W_K P[j], and likewise for queries and for the
  value path W_O W_V h_j. The per-token and per-position projections are computed once
  per weights (:class:`Prepared`), as interval matrices, and gathered per row. In exact
  arithmetic this is the same forward pass; the enclosures cover both roundings.
* **Sharing.** Rows with identical score intervals have identical softmax enclosures;
  the softmax is evaluated once per distinct score row. Identical exp arguments are
  enclosed once.
* **Sparsity.** A token whose row of U meets no non-zero of y has logit exactly 0 and is
  never materialised; the softmax adds (count × e^0) for those, split into valid and
  invalid by counting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from verifier import interval as I
from verifier.batches import take_csr
from verifier.layout import Weights


@dataclass
class BatchResult:
    expert: np.ndarray        # (n,) argmax of the gate's midpoints
    margin: np.ndarray        # (n,) certified lower bound of g_e − max_{k != e} g_k (<= 0: not certified)
    ambiguous: np.ndarray     # (n,) bool: another expert may win (margin <= 0)
    gate_mid: np.ndarray | None  # (n, K) midpoints of the gate scores
    gate_rad: np.ndarray | None  # (n,) one radius per row, for every score of the row
    err_lo: np.ndarray        # (n,) enclosure of the error, worst over the experts that may win
    err_hi: np.ndarray
    ablated_lo: np.ndarray    # (n,) error with the routed expert's output removed
    ablated_hi: np.ndarray
    predicted: np.ndarray     # (n,) argmax token of the logit midpoints (routed expert), -1: a zero logit
    top_gate: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (n, 3) experts, lower, upper ends

    @property
    def gate_lo(self) -> np.ndarray:
        """(n, K) lower ends of the gate scores."""
        with np.errstate(invalid="ignore", over="ignore"):
            return I.down(self.gate_mid - self.gate_rad[:, None])

    @property
    def gate_hi(self) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            return I.up(self.gate_mid + self.gate_rad[:, None])

    def compact(self) -> "BatchResult":
        """Without the full (n, K) gate enclosures (kept: the top three per row)."""
        return BatchResult(self.expert, self.margin, self.ambiguous, None, None, self.err_lo, self.err_hi,
                           self.ablated_lo, self.ablated_hi, self.predicted, self.top_gate)


@dataclass
class HeadProj:
    QE: tuple[np.ndarray, np.ndarray]      # (V+1, d_h) mid, rad: W_Q E[x]
    QP: tuple[np.ndarray, np.ndarray]      # (n_pos, d_h)
    KE: tuple[np.ndarray, np.ndarray]
    KP: tuple[np.ndarray, np.ndarray]
    OE: tuple[sp.csr_matrix, sp.csr_matrix]  # (V+1, d): W_O W_V E[x]
    OP: tuple[sp.csr_matrix, sp.csr_matrix]  # (n_pos, d)


class Prepared:
    """Per-weights interval projections (computed once, reused by every batch)."""

    def __init__(self, weights: Weights) -> None:
        self.weights = weights
        E, P = weights.E.tocsr(), weights.P.tocsr()
        zE, zP = sp.csr_matrix(E.shape), sp.csr_matrix(P.shape)
        self.heads = []
        for h in weights.heads:
            def dense(X, Z, W):
                m, r = I.smatmul(X, Z, W.T)
                return np.asarray(m.toarray()), np.asarray(r.toarray())

            def ov(X, Z):
                vm, vr = I.smatmul(X, Z, h.W_V.T)
                return I.smatmul(vm, vr, h.W_O.T)

            self.heads.append(HeadProj(dense(E, zE, h.W_Q), dense(P, zP, h.W_Q), dense(E, zE, h.W_K), dense(P, zP, h.W_K),
                                       ov(E, zE), ov(P, zP)))
        # Tokens with identical projections give identical scores / values: class ids per head.
        self.qk_class = [_dense_row_classes(np.concatenate([h.QE[0], h.QE[1], h.KE[0], h.KE[1]], axis=1)) for h in self.heads]
        self.v_class = [_sparse_row_classes(h.OE[0], h.OE[1]) for h in self.heads]
        self.UT = weights.U.T.tocsr()
        self.WGT = weights.W_G.T.tocsr()
        self.wg_max = float(abs(weights.W_G).max()) if weights.W_G.nnz else 0.0
        self.experts = [(e.W_1.T.tocsr(), e.b_1, e.W_2.T.tocsr(), np.flatnonzero(e.b_1 > 0)) for e in weights.experts]


def _dense_row_classes(X: np.ndarray) -> np.ndarray:
    """Class id per row: equal ids iff the rows are exactly equal."""
    X = np.ascontiguousarray(X)
    if X.shape[1] == 0:
        return np.zeros(X.shape[0], np.int64)
    view = X.view(np.dtype((np.void, X.dtype.itemsize * X.shape[1]))).reshape(-1)
    return np.unique(view, return_inverse=True)[1].reshape(-1).astype(np.int64)


def _sparse_row_classes(Mm: sp.csr_matrix, Mr: sp.csr_matrix, max_nnz: int = 8) -> np.ndarray:
    """Class id per row of an interval CSR matrix (exact equality); identity if rows are wide."""
    n = Mm.shape[0]
    pattern, mid, rad = _union(Mm, Mr)
    counts = np.diff(pattern.indptr)
    width = int(counts.max(initial=0))
    if width > max_nnz:
        return np.arange(n, dtype=np.int64)
    table = np.full((n, 3 * max(width, 1)), -1.0)
    pos = np.arange(pattern.indices.size) - np.repeat(pattern.indptr[:-1], counts)
    rows = np.repeat(np.arange(n), counts)
    table[rows, pos] = pattern.indices
    table[rows, width + pos] = mid
    table[rows, 2 * width + pos] = rad
    return _dense_row_classes(table)


# --- small interval helpers ------------------------------------------------------------------


def _gather_add(A: tuple[np.ndarray, np.ndarray], B: tuple[np.ndarray, np.ndarray], rows_a, row_b):
    """A[rows_a] + B[row_b] (dense intervals), enclosed."""
    m = A[0][rows_a] + B[0][row_b]
    r = A[1][rows_a] + B[1][row_b]
    return m, I.up(r * (1 + 4 * I.U) + I.U * np.abs(m))


def _from_bounds(lo: np.ndarray, hi: np.ndarray):
    """Mid-radius form of [lo, hi]; a point interval stays a point (radius exactly 0)."""
    point = lo == hi
    mid = np.where(point, lo, 0.5 * lo + 0.5 * hi)
    rad = np.where(point, 0.0, np.maximum(I.up(hi - mid), I.up(mid - lo)))
    return mid, rad


def _exp_lo(x: np.ndarray) -> np.ndarray:
    """Lower enclosure of exp at each x, evaluated once per distinct value."""
    u, inv = np.unique(x, return_inverse=True)
    return I.exp_enclosure(u, u)[0][inv.reshape(-1)].reshape(x.shape)


def _exp_hi(x: np.ndarray) -> np.ndarray:
    u, inv = np.unique(x, return_inverse=True)
    return I.exp_enclosure(u, u)[1][inv.reshape(-1)].reshape(x.shape)


def softmax_bounds(s_lo: np.ndarray, s_hi: np.ndarray, s_mid: np.ndarray):
    """Enclosure (lo, hi) of softmax over the last axis from score bounds.

    a_j = e_j / (e_j + Σ_{l≠j} e_l) increases in e_j and decreases in the others, so
    lo uses e_j's lower and the others' upper bounds, and hi the reverse.
    """
    M = s_mid.max(axis=-1, keepdims=True)
    e_lo = _exp_lo(I.down(s_lo - M))
    e_hi = _exp_hi(I.up(s_hi - M))
    J = s_mid.shape[-1]
    g = I.gamma(J + 2)
    tot_hi = I.up(e_hi.sum(axis=-1, keepdims=True) * (1 + g))
    tot_lo = I.down(e_lo.sum(axis=-1, keepdims=True) * (1 - g))
    others_hi = I.up((tot_hi - e_hi) * (1 + 4 * I.U))
    others_lo = np.maximum(I.down((tot_lo - e_lo) * (1 - 4 * I.U)), 0.0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        lo = I.down(e_lo / I.up(e_lo + others_hi))
        hi = I.up(e_hi / I.down(e_hi + others_lo))
    lo = np.nan_to_num(lo, nan=0.0)
    hi = np.minimum(np.nan_to_num(hi, nan=1.0), 1.0)
    return np.maximum(lo, 0.0), hi


def _unique_rows(*arrays: np.ndarray):
    """Distinct rows of the column-stacked arrays: (first index of each, inverse)."""
    stacked = np.ascontiguousarray(np.concatenate(arrays, axis=1))
    view = stacked.view(np.dtype((np.void, stacked.dtype.itemsize * stacked.shape[1]))).reshape(-1)
    _, first, inv = np.unique(view, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)


def _csr_rows(M: sp.csr_matrix, rows: np.ndarray):
    """COO triplets (row in batch, col, value) of M[rows]."""
    counts = M.indptr[rows + 1] - M.indptr[rows]
    total = int(counts.sum())
    out_rows = np.repeat(np.arange(rows.size), counts)
    starts = np.repeat(M.indptr[rows] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    pos = starts + np.arange(total)
    return out_rows, M.indices[pos], M.data[pos]


def _aligned(pattern: sp.csr_matrix, m: sp.csr_matrix) -> np.ndarray:
    """Values of ``m`` on ``pattern``'s stored entries (pattern ⊇ m's pattern); 0 elsewhere."""
    w = pattern.shape[1]
    prow = np.repeat(np.arange(pattern.shape[0]), np.diff(pattern.indptr))
    mrow = np.repeat(np.arange(m.shape[0]), np.diff(m.indptr))
    pkey = prow.astype(np.int64) * w + pattern.indices
    mkey = mrow.astype(np.int64) * w + m.indices
    out = np.zeros(pkey.size)
    out[np.searchsorted(pkey, mkey)] = m.data
    return out


def _union(mid: sp.csr_matrix, rad: sp.csr_matrix) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    """Common pattern of an interval sparse matrix, with mid and rad values on it."""
    mid, rad = mid.tocsr(), rad.tocsr()
    mid.sum_duplicates()
    rad.sum_duplicates()
    if I.same_pattern(mid, rad):
        return mid, mid.data, rad.data
    pattern = (abs(mid) + abs(rad)).tocsr()
    pattern.sum_duplicates()
    pattern.sort_indices()
    mid.sort_indices()
    rad.sort_indices()
    return pattern, _aligned(pattern, mid), _aligned(pattern, rad)


# --- the pass ---------------------------------------------------------------------------------


def _sum_terms(shape, rows_l, cols_l, mid_l, rad_l, terms: int):
    """Σ of COO interval terms (equal (row, col) summed) with a rounding bound for the sums.

    Each entry's midpoint is a float sum of at most ``terms`` midpoints: within
    γ·Σ|mid| of the exact sum (any order). Radii add, inflated to cover their rounding.
    """
    rows = np.concatenate(rows_l)
    cols = np.concatenate(cols_l)
    mids = np.concatenate(mid_l)
    Mm = sp.csr_matrix((mids, (rows, cols)), shape=shape)
    Ma = sp.csr_matrix((np.abs(mids), (rows, cols)), shape=shape)
    Mr = sp.csr_matrix((np.concatenate(rad_l), (rows, cols)), shape=shape)
    for M in (Mm, Ma, Mr):
        M.sum_duplicates()  # sorts and sums; keeps explicit zeros, so the patterns agree
    g = I.gamma(terms + 2)
    if I.same_pattern(Mm, Mr) and I.same_pattern(Mm, Ma):
        rad = (Mr.data + g * Ma.data) * (1 + 4 * g) + terms * I.ETA
        return Mm, sp.csr_matrix((rad, Mm.indices.copy(), Mm.indptr.copy()), shape=shape)
    pattern, mm, mr = _union(Mm, Mr)  # not expected (scipy keeps explicit zeros), but safe
    ma = _aligned(pattern, Ma)
    rad = (mr + g * ma) * (1 + 4 * g) + terms * I.ETA
    return (sp.csr_matrix((mm, pattern.indices, pattern.indptr), shape=shape),
            sp.csr_matrix((rad, pattern.indices.copy(), pattern.indptr.copy()), shape=shape))


class _Terms:
    """COO accumulator of interval terms, each optionally scaled by an interval per row."""

    def __init__(self) -> None:
        self.rows, self.cols, self.mid, self.rad = [], [], [], []

    def rows_of(self, M: sp.csr_matrix, R: sp.csr_matrix, src: np.ndarray | None, am=None, ar=None) -> None:
        """Rows ``src`` (all rows if None) of the interval matrix (M, R), optionally scaled."""
        same = R.nnz and np.array_equal(M.indptr, R.indptr) and np.array_equal(M.indices, R.indices)
        if src is None:
            r, c, vm = np.repeat(np.arange(M.shape[0]), np.diff(M.indptr)), M.indices, M.data
            vr = R.data if same else None
        else:
            r, c, vm = _csr_rows(M, src)
            vr = _csr_rows(R, src)[2] if same else None
        self.add(r, c, vm, vr if same else np.zeros_like(vm), am, ar)
        if R.nnz and not same:
            r2, c2, vr2 = _csr_rows(R, src if src is not None else np.arange(R.shape[0]))
            self.add(r2, c2, np.zeros_like(vr2), vr2, am, ar)

    def add(self, r, c, vm, vr, am, ar) -> None:
        if am is None:
            mid, rad = vm, vr
        else:
            a_m, a_r = am[r], ar[r]
            mid = a_m * vm
            rad = (np.abs(a_m) * vr + a_r * np.abs(vm) + a_r * vr + I.U * np.abs(mid)) * (1 + 16 * I.U) + I.ETA
        self.rows.append(r); self.cols.append(c); self.mid.append(mid); self.rad.append(rad)

    def total(self, shape, terms: int):
        return _sum_terms(shape, self.rows, self.cols, self.mid, self.rad, terms)


def head_output(prep: Prepared, m: int, ids: np.ndarray):
    """W_O Σ_j a_j W_V h_j at the last position, for rows of ``ids`` (n x (p+1), BOS first).

    Evaluated once per distinct (score classes, value classes) row, then gathered.
    """
    h = prep.heads[m]
    n, p1 = ids.shape
    p = p1 - 1
    qk = prep.qk_class[m][ids]
    first, inv = _unique_rows(qk)
    rep = ids[first]
    q_m, q_r = _gather_add(h.QE, h.QP, rep[:, p], p)
    s_mid, s_rad = np.empty((rep.shape[0], p1)), np.empty((rep.shape[0], p1))
    for j in range(p1):
        k_m, k_r = _gather_add(h.KE, h.KP, rep[:, j], j)
        s_mid[:, j], s_rad[:, j] = I.dot_rows(q_m, q_r, k_m, k_r)
    a_lo, a_hi = softmax_bounds(I.lower(s_mid, s_rad), I.upper(s_mid, s_rad), s_mid)
    am, ar = _from_bounds(a_lo, a_hi)
    combo = np.concatenate([inv[:, None], prep.v_class[m][ids]], axis=1)
    cfirst, cinv = _unique_rows(combo)
    crep = ids[cfirst]
    cam, car = am[inv[cfirst]], ar[inv[cfirst]]
    terms = _Terms()
    nc = cfirst.size
    for j in range(p1):
        terms.rows_of(h.OE[0], h.OE[1], crep[:, j], cam[:, j], car[:, j])
        terms.rows_of(h.OP[0], h.OP[1], np.full(nc, j, np.int64), cam[:, j], car[:, j])
    Om, Or = terms.total((nc, prep.weights.d), 2 * p1)
    return Om[cinv], Or[cinv]


def residual(prep: Prepared, tokens: np.ndarray):
    """r at the last position for rows of ``tokens`` (n x p, weights' ids); interval CSR (n x d).

    r = E[x_p] + P[p] + Σ_m (head m's output), summed once with a rounding bound.
    """
    w = prep.weights
    n, p = tokens.shape
    ids = np.concatenate([np.full((n, 1), w.bos, np.int64), tokens], axis=1)  # (n, p+1)
    terms = _Terms()
    terms.rows_of(w.E.tocsr(), sp.csr_matrix(w.E.shape), ids[:, p])
    terms.rows_of(w.P.tocsr(), sp.csr_matrix(w.P.shape), np.full(n, p, np.int64))
    for m in range(len(prep.heads)):
        Om, Or = head_output(prep, m, ids)
        terms.rows_of(Om, Or, None)
    return terms.total((n, w.d), 2 + len(prep.heads))


def expert_output(prep: Prepared, k: int, Rm: sp.csr_matrix, Rr: sp.csr_matrix):
    """W_2 ReLU(W_1 r + b_1) for expert k on interval rows R; interval CSR (n x d)."""
    W1T, b1, W2T, positive = prep.experts[k]
    n = Rm.shape[0]
    Zm, Zr = I.smatmul(Rm, Rr, W1T)
    pattern, zm, zr = _union(Zm, Zr)
    cols = pattern.indices.astype(np.int64)
    rows = np.repeat(np.arange(n), np.diff(pattern.indptr))
    zm2 = zm + b1[cols]
    zr2 = I.up(zr + 2 * I.U * np.abs(zm2))
    a_lo = np.maximum(I.lower(zm2, zr2), 0.0)
    a_hi = np.maximum(I.upper(zm2, zr2), 0.0)
    am, ar = _from_bounds(a_lo, a_hi)
    if positive.size:
        # A positive-bias neuron fires even where nothing else reaches it: act = b exactly.
        width = W1T.shape[1]
        key = rows * width + cols
        extra_r = np.repeat(np.arange(n), positive.size)
        extra_c = np.tile(positive, n)
        extra_key = extra_r * width + extra_c
        missing = ~np.isin(extra_key, key)
        rows = np.concatenate([rows, extra_r[missing]]); cols = np.concatenate([cols, extra_c[missing]])
        am = np.concatenate([am, b1[extra_c[missing]]]); ar = np.concatenate([ar, np.zeros(int(missing.sum()))])
    keep = (am != 0) | (ar != 0)
    shape = (n, W1T.shape[1])
    Am = sp.csr_matrix((am[keep], (rows[keep], cols[keep])), shape=shape)
    Ar = sp.csr_matrix((ar[keep], (rows[keep], cols[keep])), shape=shape)
    return I.smatmul(Am, Ar, W2T)


def sparse_error(Lm: sp.csr_matrix, Lr: sp.csr_matrix, V: int, valid_ptr: np.ndarray, valid: np.ndarray):
    """Enclosure of 1 − P(valid) from sparse logit intervals (absent logits are exactly 0)."""
    n = Lm.shape[0]
    pattern, mid, rad = _union(Lm, Lr)
    rows = np.repeat(np.arange(n), np.diff(pattern.indptr))
    cols = pattern.indices.astype(np.int64)
    lo, hi = I.lower(mid, rad), I.upper(mid, rad)
    stored = np.diff(pattern.indptr)
    n_valid = np.diff(valid_ptr)
    vkey = np.sort(np.repeat(np.arange(n), n_valid).astype(np.int64) * V + valid)
    key = rows.astype(np.int64) * V + cols
    pos = np.searchsorted(vkey, key)
    is_valid = (pos < vkey.size) & (vkey[np.minimum(pos, max(vkey.size - 1, 0))] == key) if vkey.size else np.zeros(key.size, bool)
    stored_valid = np.bincount(rows, weights=is_valid, minlength=n).astype(np.int64)
    zero_valid = n_valid - stored_valid
    zero_invalid = V - stored - zero_valid
    has_zero = (V - stored) > 0
    M = np.full(n, -np.inf)
    np.maximum.at(M, rows, mid)
    M = np.where(has_zero, np.maximum(M, 0.0), M)
    M = np.where(np.isfinite(M), M, 0.0)
    e_lo = _exp_lo(I.down(lo - M[rows]))
    e_hi = _exp_hi(I.up(hi - M[rows]))
    z_lo = _exp_lo(I.down(-M))
    z_hi = _exp_hi(I.up(-M))
    g = I.gamma(int(stored.max(initial=0)) + 4)
    inv = ~is_valid
    with np.errstate(over="ignore"):
        inv_hi = I.up((np.bincount(rows, weights=np.where(inv, e_hi, 0.0), minlength=n) + I.up(zero_invalid * z_hi)) * (1 + g))
        inv_lo = I.down((np.bincount(rows, weights=np.where(inv, e_lo, 0.0), minlength=n) + I.down(zero_invalid * z_lo)) * (1 - g))
        val_hi = I.up((np.bincount(rows, weights=np.where(is_valid, e_hi, 0.0), minlength=n) + I.up(zero_valid * z_hi)) * (1 + g))
        val_lo = I.down((np.bincount(rows, weights=np.where(is_valid, e_lo, 0.0), minlength=n) + I.down(zero_valid * z_lo)) * (1 - g))
    with np.errstate(invalid="ignore", divide="ignore"):
        err_hi = I.up(inv_hi / I.down(inv_hi + val_lo))
        err_lo = I.down(inv_lo / I.up(inv_lo + val_hi))
    err_hi = np.where(np.isfinite(err_hi), np.minimum(err_hi, 1.0), 1.0)
    err_lo = np.where(np.isfinite(err_lo), np.maximum(err_lo, 0.0), 0.0)
    predicted = np.full(n, -1, np.int64)
    if rows.size:
        order = np.lexsort((-mid, rows))
        first = np.ones(order.size, bool)
        first[1:] = rows[order][1:] != rows[order][:-1]
        best = np.full(n, -np.inf)
        predicted[rows[order][first]] = cols[order][first]
        best[rows[order][first]] = mid[order][first]
        predicted = np.where(has_zero & (best < 0), -1, predicted)
    return err_lo, err_hi, predicted


def run_batch(prep: Prepared | Weights, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
              ablate: np.ndarray | None = None) -> BatchResult:
    """Certified forward pass of a batch (n x p token ids, weights' ids; BOS is added).

    ``ablate`` (bool per row, default all) selects the rows whose ablated error is
    enclosed; the others get NaN there (the entanglement check needs object queries only).
    """
    if isinstance(prep, Weights):
        prep = Prepared(prep)
    w = prep.weights
    tokens = np.asarray(tokens, np.int64)
    if tokens.ndim == 1:
        tokens = tokens[None, :]
    n = tokens.shape[0]
    V, K = len(w.vocab), len(w.experts)
    Rm, Rr = residual(prep, tokens)
    # The gate's product is dense (n x K) and only compared, so one radius per row bounds
    # every score of the row: R_i >= |g_ik − Gm_ik| for all k (product, plus the rounding
    # of adding b_G, at most u·max_k |Gm_ik|).
    Gm, rho = I.smatmul_rowbound(Rm, Rr, prep.WGT, prep.wg_max)
    Gm = np.asarray(Gm.toarray()) + w.b_G[None, :]
    with np.errstate(invalid="ignore", over="ignore"):
        R = I.up((rho + 2 * I.U * np.abs(Gm).max(axis=1, initial=0.0)) * (1 + 4 * I.U))
        finite = np.isfinite(Gm).all(axis=1) & np.isfinite(R)
        rows = np.arange(n)
        e = np.argmax(Gm, axis=1)
        ge = Gm[rows, e]
        if K > 1:
            second = Gm.copy()
            second[rows, e] = -np.inf
            second = second.max(axis=1)
            margin = I.down(I.down(ge - second) - I.up(2 * R))
        else:
            margin = np.full(n, np.inf)
        margin = np.where(finite, margin, -np.inf)
        # NaN-safe: a comparison that cannot be decided keeps the expert in.
        cand = ~(I.up(Gm + R[:, None]) < I.down(ge - R)[:, None])
    cand[rows, e] = True
    if w.gate_mode == "top1-scaled":
        first, inv = _unique_rows(Gm, R[:, None])
        Gf, Rf = Gm[first], R[first][:, None]
        p_lo, p_hi = softmax_bounds(I.down(Gf - Rf), I.up(Gf + Rf), Gf)
        p_lo, p_hi = p_lo[inv], p_hi[inv]
    err_lo = np.full(n, np.inf)
    err_hi = np.full(n, -np.inf)
    predicted = np.full(n, -1, np.int64)
    for k in np.flatnonzero(cand.any(axis=0)):
        idx = np.flatnonzero(cand[:, k])
        rm, rr = Rm[idx], Rr[idx]
        om, orad = expert_output(prep, int(k), rm, rr)
        if w.gate_mode == "top1-scaled":
            cm, cr = _from_bounds(p_lo[idx, k], p_hi[idx, k])
            om, orad = I.srow_scale(om, orad, cm, cr)
        ym, yr = I.sadd(rm, rr, om, orad)
        Lm, Lr = I.smatmul(ym, yr, prep.UT)
        vptr, vals = take_csr(valid_ptr, valid, idx)
        lo, hi, pred = sparse_error(Lm, Lr, V, vptr, vals)
        err_lo[idx] = np.minimum(err_lo[idx], lo)
        err_hi[idx] = np.maximum(err_hi[idx], hi)
        routed = e[idx] == k
        predicted[idx[routed]] = pred[routed]
    ab_lo, ab_hi = np.full(n, np.nan), np.full(n, np.nan)
    rows_ab = np.arange(n) if ablate is None else np.flatnonzero(ablate)
    if rows_ab.size:
        Lm, Lr = I.smatmul(Rm[rows_ab], Rr[rows_ab], prep.UT)
        vptr, vals = take_csr(valid_ptr, valid, rows_ab)
        ab_lo[rows_ab], ab_hi[rows_ab], _ = sparse_error(Lm, Lr, V, vptr, vals)
    key = -np.nan_to_num(Gm, nan=np.inf)
    top = np.argpartition(key, min(2, K - 1), axis=1)[:, :3] if K > 3 else np.argsort(key, axis=1)
    top = np.take_along_axis(top, np.argsort(np.take_along_axis(key, top, 1), axis=1), 1)
    tm = np.take_along_axis(Gm, top, 1)
    top_gate = (top, I.down(tm - R[:, None]), I.up(tm + R[:, None]))
    return BatchResult(e, margin, ~(margin > 0), Gm, R, err_lo, err_hi, ab_lo, ab_hi, predicted, top_gate)
