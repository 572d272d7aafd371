"""The certified forward pass: every quantity enclosed, vectorised over a batch.

A batch is n prefixes of one length p (token ids, BOS prepended here). For each row
the pass returns enclosures of the gate scores, the routing decision with its
certified margin, and the error 1 − P(valid) of the next-token distribution, for the
model and for the model with the routed expert's output removed (ablation). The
equations are those of :mod:`layout`; the arithmetic is
:mod:`verifier.interval` (mid-radius, every radius rounded upward, enclosed exp).

Zeros. Sparse intermediate results are :class:`~verifier.interval.SparseInterval`
values whose pattern is *structural*: an entry is absent only when no term of the
forward pass contributes to it, and is then exactly 0. Two shortcuts rest on that and
nothing else: a logit absent from the product U·y is exactly 0 (counted, not
enumerated), and a neuron absent from W_1·r has pre-activation exactly b_1 (so its
activation is exactly max(b_1, 0)). A value that underflowed, or cancelled, stays
present with a radius of at least η and is amplified honestly by later layers.

Non-finite values. A row whose residual, expert output or logits hold a non-finite
enclosure (an overflow) is decided by nothing: its error is [0, 1], its margin −∞.

Speed without changing the computation:

* **Linearity.** W_K h_j = W_K E[x_j] + W_K P[j], and likewise for queries and for the
  value path W_O W_V h_j. The per-token and per-position projections are computed once
  per weights (:class:`Prepared`), as intervals, and gathered per row. In exact
  arithmetic this is the same forward pass; the enclosures cover both roundings.
* **Sharing.** Rows with identical score intervals have identical softmax enclosures;
  the softmax is evaluated once per distinct score row. Identical exp arguments are
  enclosed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from verifier import interval as I
from verifier.batches import take_csr
from verifier.interval import SparseInterval
from layout import Weights


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
        return I.lower(self.gate_mid, self.gate_rad[:, None])

    @property
    def gate_hi(self) -> np.ndarray:
        return I.upper(self.gate_mid, self.gate_rad[:, None])

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
    OE: SparseInterval                     # (V+1, d): W_O W_V E[x]
    OP: SparseInterval                     # (n_pos, d)


class Prepared:
    """Per-weights interval projections (computed once, reused by every batch)."""

    def __init__(self, weights: Weights) -> None:
        I.check_platform()
        weights.validate()
        self.weights = weights
        E, P = I.exact(weights.E), I.exact(weights.P)
        self.heads = []
        for h in weights.heads:
            WQ, WK = h.W_Q.T.tocsr(), h.W_K.T.tocsr()
            WV, WO = h.W_V.T.tocsr(), h.W_O.T.tocsr()
            self.heads.append(HeadProj(I.matmul(E, WQ).dense(), I.matmul(P, WQ).dense(),
                                       I.matmul(E, WK).dense(), I.matmul(P, WK).dense(),
                                       I.matmul(I.matmul(E, WV), WO), I.matmul(I.matmul(P, WV), WO)))
        # Tokens with identical projections give identical scores / values: class ids per head.
        self.qk_class = [_dense_row_classes(np.concatenate([h.QE[0], h.QE[1], h.KE[0], h.KE[1]], axis=1)) for h in self.heads]
        self.v_class = [_sparse_row_classes(h.OE) for h in self.heads]
        # Every head at once: query/key projections side by side (head m owns columns
        # starts[m] .. starts[m] + widths[m]), value paths stacked (head m's rows after
        # m·(V+1) and m·n_pos), one class per token over all heads' scores.
        hs = self.heads
        self.widths = np.array([h.QE[0].shape[1] for h in hs], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.widths)[:-1]]).astype(np.int64)
        stack = lambda pick: tuple(np.concatenate([pick(h)[i] for h in hs], axis=1) if hs else np.zeros((0, 0))  # noqa: E731
                                   for i in (0, 1))
        self.QE, self.QP, self.KE, self.KP = (stack(lambda h: h.QE), stack(lambda h: h.QP), stack(lambda h: h.KE),
                                              stack(lambda h: h.KP))
        self.qk_all = _dense_row_classes(np.stack(self.qk_class, axis=1)) if hs else np.zeros(E.shape[0], np.int64)
        self.v_all = np.stack(self.v_class) if hs else np.zeros((0, E.shape[0]), np.int64)
        self.OE = I.vstack([h.OE for h in hs]) if hs else None
        self.OP = I.vstack([h.OP for h in hs]) if hs else None
        self.E = E
        self.P = P
        self.UT = weights.U.T.tocsr()
        self.absUT = abs(self.UT)
        self.WGT = weights.W_G.T.tocsr()
        # the largest |W_G[k, j]| per residual direction j (0 where the gate reads nothing)
        self.wg_colmax = np.zeros(weights.d)
        np.maximum.at(self.wg_colmax, weights.W_G.indices, np.abs(weights.W_G.data))
        self.experts = [(e.W_1.T.tocsr(), e.b_1, e.W_2.T.tocsr(), np.flatnonzero(e.b_1 > 0)) for e in weights.experts]


def _dense_row_classes(X: np.ndarray) -> np.ndarray:
    """Class id per row: equal ids iff the rows are bitwise equal."""
    X = np.ascontiguousarray(X)
    if X.shape[1] == 0:
        return np.zeros(X.shape[0], np.int64)
    view = X.view(np.dtype((np.void, X.dtype.itemsize * X.shape[1]))).reshape(-1)
    return np.unique(view, return_inverse=True)[1].reshape(-1).astype(np.int64)


def _sparse_row_classes(M: SparseInterval, max_nnz: int = 8) -> np.ndarray:
    """Class id per row of a sparse interval matrix (bitwise equality); identity if rows are wide."""
    n = M.shape[0]
    counts = np.diff(M.indptr)
    width = int(counts.max(initial=0))
    if width > max_nnz:
        return np.arange(n, dtype=np.int64)
    table = np.full((n, 3 * max(width, 1)), -1.0)
    pos = np.arange(M.nnz) - np.repeat(M.indptr[:-1], counts)
    rows = M.row_ids()
    table[rows, pos] = M.indices
    table[rows, width + pos] = M.mid
    table[rows, 2 * width + pos] = M.rad
    return _dense_row_classes(table)


def softmax_bounds(s_lo: np.ndarray, s_hi: np.ndarray, s_mid: np.ndarray):
    """Enclosure (lo, hi) of softmax over the last axis from score bounds.

    a_j = e_j / (e_j + Σ_{l≠j} e_l) increases in e_j and decreases in the others, so
    lo uses e_j's lower and the others' upper bounds, and hi the reverse. Any shift M
    leaves the ratios unchanged; sums of the non-negative e's are bounded by Lemma 1 of
    :mod:`verifier.interval`, every other step is one operation rounded outward.
    """
    M = s_mid.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        e_lo = I.exp_lo_unique(I.down(s_lo - M))
        e_hi = I.exp_hi_unique(I.up(s_hi - M))
    J = s_mid.shape[-1]
    tot_hi = I.up(I.sum_factor(J) * e_hi.sum(axis=-1, keepdims=True))
    tot_lo = I.down(I.down(1.0 - I.gamma(J)) * e_lo.sum(axis=-1, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        others_hi = I.up(tot_hi - e_hi)
        others_lo = np.maximum(I.down(tot_lo - e_lo), 0.0)
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
    """COO triplets (row in batch, col, value) of M[rows] (plain float matrices; used by the baseline)."""
    counts = M.indptr[rows + 1] - M.indptr[rows]
    total = int(counts.sum())
    out_rows = np.repeat(np.arange(rows.size), counts)
    starts = np.repeat(M.indptr[rows] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    pos = starts + np.arange(total)
    return out_rows, M.indices[pos], M.data[pos]


# --- the pass ---------------------------------------------------------------------------------


class _Terms:
    """Interval terms (row, col, mid, rad) to be summed, each optionally scaled by an interval per row."""

    def __init__(self, n: int, d: int) -> None:
        self.shape = (n, d)
        self.rows, self.cols, self.mid, self.rad = [], [], [], []

    def rows_of(self, M: SparseInterval, src: np.ndarray | None, am=None, ar=None, target: np.ndarray | None = None) -> None:
        """Rows ``src`` of M (all rows if None), optionally each scaled by [am ± ar] (one interval per
        source row), added to the batch rows ``target`` (default: 0, 1, 2, ... in order)."""
        X = M if src is None else M.rows(src)
        r = X.row_ids()
        mid, rad = X.mid, X.rad
        if am is not None:
            a_m, a_r = am[r], ar[r]
            mid, rad = a_m * X.mid, I.mul_rad(a_m, a_r, X.mid, X.rad)
        if target is not None:
            r = target[r]
        self.rows.append(r); self.cols.append(X.indices); self.mid.append(mid); self.rad.append(rad)

    def total(self) -> SparseInterval:
        cat = lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt)  # noqa: E731
        return I.sum_terms(self.shape, cat(self.rows, np.int64), cat(self.cols, np.int64),
                           cat(self.mid, np.float64), cat(self.rad, np.float64))


def head_output(prep: Prepared, m: int, ids: np.ndarray) -> SparseInterval:
    """W_O Σ_j a_j W_V h_j at the last position, for rows of ``ids`` (n x (p+1), BOS first).

    Evaluated once per distinct (score classes, value classes) row, then gathered; every
    position j is handled in the same array operations (no loop over positions).
    """
    h = prep.heads[m]
    n, p1 = ids.shape
    p = p1 - 1
    qk = prep.qk_class[m][ids]
    first, inv = _unique_rows(qk)
    rep = ids[first]                                                      # (n', p+1)
    with np.errstate(invalid="ignore", over="ignore"):
        q_m, q_r = I.gather_add(h.QE, h.QP, rep[:, p], p)                # (n', d_h)
        k_m, k_r = I.gather_add(h.KE, h.KP, rep, np.arange(p1)[None, :])  # (n', p+1, d_h)
        s_mid, s_rad = I.dot_rows(q_m[:, None, :], q_r[:, None, :], k_m, k_r)
        a_lo, a_hi = softmax_bounds(I.lower(s_mid, s_rad), I.upper(s_mid, s_rad), s_mid)
    am, ar = I.from_bounds(a_lo, a_hi)
    combo = np.concatenate([inv[:, None], prep.v_class[m][ids]], axis=1)
    cfirst, cinv = _unique_rows(combo)
    crep = ids[cfirst]
    cam, car = am[inv[cfirst]].reshape(-1), ar[inv[cfirst]].reshape(-1)  # one interval per (row, position)
    nc = cfirst.size
    target = np.repeat(np.arange(nc, dtype=np.int64), p1)
    terms = _Terms(nc, prep.weights.d)
    with np.errstate(invalid="ignore", over="ignore"):
        terms.rows_of(h.OE, crep.reshape(-1), cam, car, target)
        terms.rows_of(h.OP, np.tile(np.arange(p1, dtype=np.int64), nc), cam, car, target)
        return terms.total().rows(cinv)


def heads_output(prep: Prepared, ids: np.ndarray, terms: "_Terms") -> None:
    """Add every head's W_O Σ_j a_j W_V h_j at the last position to ``terms`` (rows of ``ids``,
    n x (p+1), BOS first), all heads and positions in the same array operations.

    Scores are computed once per distinct row of token classes (over all heads), the
    softmax once per (row, head); value terms once per distinct (head, attention row,
    value classes of the row's tokens), then gathered back to every row.
    """
    H = len(prep.heads)
    if H == 0:
        return
    n, p1 = ids.shape
    p = p1 - 1
    V1, npos = prep.weights.E.shape[0], prep.weights.P.shape[0]
    first, inv = _unique_rows(prep.qk_all[ids])
    rep = ids[first]                                                        # (n', p+1)
    with np.errstate(invalid="ignore", over="ignore"):
        q_m, q_r = I.gather_add(prep.QE, prep.QP, rep[:, p], p)           # (n', Σd_h)
        k_m, k_r = I.gather_add(prep.KE, prep.KP, rep, np.arange(p1)[None, :])  # (n', p+1, Σd_h)
        s_mid, s_rad = I.dot_segments(q_m[:, None, :], q_r[:, None, :], k_m, k_r, prep.starts, prep.widths)
        s_mid, s_rad = s_mid.transpose(0, 2, 1), s_rad.transpose(0, 2, 1)  # (n', H, p+1)
        a_lo, a_hi = softmax_bounds(I.lower(s_mid, s_rad), I.upper(s_mid, s_rad), s_mid)
    am, ar = I.from_bounds(a_lo, a_hi)                                      # (n', H, p+1)
    # one key per (head, row): the head, its attention row's class, its tokens' value classes
    key = np.concatenate([np.broadcast_to(np.arange(H)[:, None, None], (H, n, 1)),
                          np.broadcast_to(inv[None, :, None], (H, n, 1)), prep.v_all[:, ids]], axis=2).reshape(H * n, p1 + 2)
    kfirst, kinv = _unique_rows(key)
    head, row = kfirst // n, kfirst % n
    nk = kfirst.size
    a_m = am[inv[row], head].reshape(-1)
    a_r = ar[inv[row], head].reshape(-1)
    target = np.repeat(np.arange(nk, dtype=np.int64), p1)
    reps = _Terms(nk, prep.weights.d)
    with np.errstate(invalid="ignore", over="ignore"):
        reps.rows_of(prep.OE, (head[:, None] * V1 + ids[row]).reshape(-1), a_m, a_r, target)
        reps.rows_of(prep.OP, (head[:, None] * npos + np.arange(p1)[None, :]).reshape(-1), a_m, a_r, target)
        out = reps.total()
    terms.rows_of(out, kinv, target=np.tile(np.arange(n, dtype=np.int64), H))


def residual(prep: Prepared, tokens: np.ndarray) -> SparseInterval:
    """r at the last position for rows of ``tokens`` (n x p, weights' ids), enclosed.

    r = E[x_p] + P[p] + Σ_m (head m's output), summed once with a rounding bound.
    """
    w = prep.weights
    n, p = tokens.shape
    ids = np.concatenate([np.full((n, 1), w.bos, np.int64), tokens], axis=1)  # (n, p+1)
    terms = _Terms(n, w.d)
    terms.rows_of(prep.E, ids[:, p])
    terms.rows_of(prep.P, np.full(n, p, np.int64))
    heads_output(prep, ids, terms)
    with np.errstate(invalid="ignore", over="ignore"):
        return terms.total()


def expert_output(prep: Prepared, k: int, R: SparseInterval) -> SparseInterval:
    """W_2 ReLU(W_1 r + b_1) for expert k on the interval rows R, enclosed.

    A neuron absent from the structural pattern of W_1·r has no term: its pre-activation
    is exactly b_1, so its activation is exactly max(b_1, 0) (added for b_1 > 0).
    """
    W1T, b1, W2T, positive = prep.experts[k]
    n = R.shape[0]
    width = W1T.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        Z = I.matmul(R, W1T)
        rows, cols = Z.row_ids(), Z.indices
        zm = Z.mid + b1[cols]
        zr = I.add_rad(Z.rad, I.up(I.U * np.abs(zm)))
        am, ar = I.from_bounds(np.maximum(I.lower(zm, zr), 0.0), np.maximum(I.upper(zm, zr), 0.0))
    if positive.size:
        key = rows * width + cols
        extra_r = np.repeat(np.arange(n, dtype=np.int64), positive.size)
        extra_c = np.tile(positive, n)
        missing = ~np.isin(extra_r * width + extra_c, key)
        rows = np.concatenate([rows, extra_r[missing]])
        cols = np.concatenate([cols, extra_c[missing]])
        am = np.concatenate([am, b1[extra_c[missing]]])
        ar = np.concatenate([ar, np.zeros(int(missing.sum()))])
    A = I.from_coo((n, width), rows, cols, am, ar).prune()
    with np.errstate(invalid="ignore", over="ignore"):
        return I.matmul(A, W2T)


def sparse_error(L: SparseInterval, V: int, valid_ptr: np.ndarray, valid: np.ndarray):
    """Enclosure of 1 − P(valid) from sparse logit intervals (absent logits are exactly 0).

    error = S_inv / (S_inv + S_val) with S the sums of e^(logit − M) over invalid and
    valid tokens; it increases in S_inv and decreases in S_val. Tokens absent from the
    pattern contribute e^(−M) each and are counted.
    """
    n = L.shape[0]
    rows = L.row_ids()
    cols = L.indices
    with np.errstate(invalid="ignore", over="ignore"):
        lo, hi = I.lower(L.mid, L.rad), I.upper(L.mid, L.rad)
    stored = np.diff(L.indptr)
    vrows = np.repeat(np.arange(n, dtype=np.int64), np.diff(valid_ptr))
    vkey = np.unique(vrows * V + np.asarray(valid, np.int64))      # a valid token counts once
    n_valid = np.bincount(vkey // V, minlength=n)
    key = rows * V + cols
    if vkey.size:
        pos = np.minimum(np.searchsorted(vkey, key), vkey.size - 1)
        is_valid = vkey[pos] == key
    else:
        is_valid = np.zeros(key.size, bool)
    stored_valid = np.bincount(rows, weights=is_valid, minlength=n).astype(np.int64)
    zero_valid = n_valid - stored_valid
    zero_invalid = V - stored - zero_valid
    has_zero = (V - stored) > 0
    M = np.full(n, -np.inf)
    np.maximum.at(M, rows, np.nan_to_num(L.mid, nan=0.0))
    M = np.where(has_zero, np.maximum(M, 0.0), M)
    M = np.where(np.isfinite(M), M, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        e_lo = I.exp_lo_unique(I.down(lo - M[rows]))
        e_hi = I.exp_hi_unique(I.up(hi - M[rows]))
        z_lo = I.exp_lo_unique(I.down(-M))
        z_hi = I.exp_hi_unique(I.up(-M))
        c = I.sum_factor(int(stored.max(initial=0)) + 1)
        d = I.down(1.0 - I.gamma(int(stored.max(initial=0)) + 1))
        inv = ~is_valid

        def hi_sum(mask, zeros, z):
            s = np.bincount(rows, weights=np.where(mask, e_hi, 0.0), minlength=n)
            return I.up(I.up(c * s) + I.up(zeros * z))

        def lo_sum(mask, zeros, z):
            s = np.bincount(rows, weights=np.where(mask, e_lo, 0.0), minlength=n)
            return I.down(I.down(d * s) + I.down(zeros * z))

        inv_hi, val_hi = hi_sum(inv, zero_invalid, z_hi), hi_sum(is_valid, zero_valid, z_hi)
        inv_lo, val_lo = lo_sum(inv, zero_invalid, z_lo), lo_sum(is_valid, zero_valid, z_lo)
    with np.errstate(invalid="ignore", divide="ignore"):
        err_hi = I.up(inv_hi / I.down(inv_hi + val_lo))
        err_lo = I.down(inv_lo / I.up(inv_lo + val_hi))
    bad = L.nonfinite_rows()
    err_hi = np.where(np.isfinite(err_hi) & ~bad, np.minimum(err_hi, 1.0), 1.0)
    err_lo = np.where(np.isfinite(err_lo) & ~bad, np.maximum(err_lo, 0.0), 0.0)
    predicted = np.full(n, -1, np.int64)
    if rows.size:
        order = np.lexsort((-np.nan_to_num(L.mid, nan=-np.inf), rows))
        first = np.ones(order.size, bool)
        first[1:] = rows[order][1:] != rows[order][:-1]
        best = np.full(n, -np.inf)
        predicted[rows[order][first]] = cols[order][first]
        best[rows[order][first]] = L.mid[order][first]
        predicted = np.where(has_zero & (best < 0), -1, predicted)
    return err_lo, err_hi, predicted


def gate_scores(prep: Prepared, R: SparseInterval) -> tuple[np.ndarray, np.ndarray]:
    """(n, K) midpoints of g = W_G r + b_G and one radius per row bounding every score's error.

    The product's row bound (:func:`verifier.interval.row_bound_matmul`), plus the
    rounding of adding b_G: at most u·|fl(·)| per score (A1), so u·max_k |G_ik| per row.
    """
    w = prep.weights
    with np.errstate(invalid="ignore", over="ignore"):
        Gm, rho = I.row_bound_matmul(R, prep.WGT, prep.wg_colmax)
        Gm = Gm + w.b_G[None, :]
        rad = I.add_rad(rho, I.up(I.U * np.abs(Gm).max(axis=1, initial=0.0)))
    bad = ~np.isfinite(Gm).all(axis=1) | ~np.isfinite(rad) | R.nonfinite_rows()
    return Gm, np.where(bad, np.inf, rad)


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
    R = residual(prep, tokens)
    Gm, Grad = gate_scores(prep, R)
    rows = np.arange(n)
    e = np.argmax(np.nan_to_num(Gm, nan=-np.inf), axis=1)
    ge = Gm[rows, e]
    with np.errstate(invalid="ignore", over="ignore"):
        if K > 1:
            second = Gm.copy()
            second[rows, e] = -np.inf
            second = second.max(axis=1)
            margin = I.down(I.down(ge - second) - I.up(2 * Grad))
        else:
            margin = np.full(n, np.inf)
        margin = np.where(np.isfinite(Grad), margin, -np.inf)
        margin = np.where(np.isnan(margin), -np.inf, margin)
        # An expert may win unless its upper end is certainly below the winner's lower end.
        cand = ~(I.up(Gm + Grad[:, None]) < I.down(ge - Grad)[:, None])
    cand[rows, e] = True
    if w.gate_mode == "top1-scaled":
        first, inv = _unique_rows(Gm, Grad[:, None])
        Gf, Rf = Gm[first], Grad[first][:, None]
        with np.errstate(invalid="ignore", over="ignore"):
            p_lo, p_hi = softmax_bounds(I.lower(Gf, Rf), I.upper(Gf, Rf), Gf)
        p_lo, p_hi = p_lo[inv], p_hi[inv]
    err_lo = np.full(n, np.inf)
    err_hi = np.full(n, -np.inf)
    predicted = np.full(n, -1, np.int64)
    for k in np.flatnonzero(cand.any(axis=0)):
        idx = np.flatnonzero(cand[:, k])
        Rk = R.rows(idx)
        out = expert_output(prep, int(k), Rk)
        if w.gate_mode == "top1-scaled":
            out = I.scale_rows(out, *I.from_bounds(p_lo[idx, k], p_hi[idx, k]))
        with np.errstate(invalid="ignore", over="ignore"):
            Y = I.add(Rk, out)
            L = I.matmul(Y, prep.UT, prep.absUT)
        vptr, vals = take_csr(valid_ptr, valid, idx)
        lo, hi, pred = sparse_error(L, V, vptr, vals)
        bad = Y.nonfinite_rows()
        lo, hi = np.where(bad, 0.0, lo), np.where(bad, 1.0, hi)
        err_lo[idx] = np.minimum(err_lo[idx], lo)
        err_hi[idx] = np.maximum(err_hi[idx], hi)
        routed = e[idx] == k
        predicted[idx[routed]] = pred[routed]
    ab_lo, ab_hi = np.full(n, np.nan), np.full(n, np.nan)
    rows_ab = np.arange(n) if ablate is None else np.flatnonzero(ablate)
    if rows_ab.size:
        Ra = R.rows(rows_ab)
        with np.errstate(invalid="ignore", over="ignore"):
            L = I.matmul(Ra, prep.UT, prep.absUT)
        vptr, vals = take_csr(valid_ptr, valid, rows_ab)
        lo, hi, _ = sparse_error(L, V, vptr, vals)
        bad = Ra.nonfinite_rows()
        ab_lo[rows_ab], ab_hi[rows_ab] = np.where(bad, 0.0, lo), np.where(bad, 1.0, hi)
    key = -np.nan_to_num(Gm, nan=np.inf)
    top = np.argpartition(key, min(2, K - 1), axis=1)[:, :3] if K > 3 else np.argsort(key, axis=1)
    top = np.take_along_axis(top, np.argsort(np.take_along_axis(key, top, 1), axis=1), 1)
    tm = np.take_along_axis(Gm, top, 1)
    top_gate = (top, I.lower(tm, Grad[:, None]), I.upper(tm, Grad[:, None]))
    return BatchResult(e, margin, ~(margin > 0), Gm, Grad, err_lo, err_hi, ab_lo, ab_hi, predicted, top_gate)

