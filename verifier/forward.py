"""The certified forward pass: every quantity enclosed, vectorised over a batch.

A *batch* is n prefixes of the same length p that share their tokens except at some
positions (the entity slots): ``positions[j]`` is either an int (the token at j for
every row) or an int array (one token per row). The structure-trie groups of
:mod:`tasks.queries` are exactly such batches, so shared positions are embedded and
projected once per batch.

For each row the pass returns enclosures of the gate scores, the routing decision
with its certified margin, and the error 1 − P(valid) of the next-token distribution,
for the model and for the model with the routed expert ablated (its output removed).
The equations are those of :mod:`verifier.layout`; the arithmetic is
:mod:`verifier.interval` (mid-radius, outward rounding, enclosed exp).

Large vocabularies: logits are U·y with U sparse; a token whose row of U meets no
non-zero of y has logit exactly 0 and is never materialised. The softmax sums over
the stored logits and adds (count × e^0) for the others, split into valid and invalid
by counting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from verifier import interval as I
from verifier.layout import Weights


@dataclass
class BatchResult:
    expert: np.ndarray        # (n,) argmax of the gate's midpoints
    margin: np.ndarray        # (n,) certified lower bound of g_e − max_{k != e} g_k (<= 0: not certified)
    candidates: sp.csr_matrix  # (n, K) bool: experts that may win (g_hi >= g_e lo)
    gate_lo: np.ndarray       # (n, K)
    gate_hi: np.ndarray
    err_lo: np.ndarray        # (n,) enclosure of the error, worst over candidate experts
    err_hi: np.ndarray
    ablated_lo: np.ndarray    # (n,) error with the routed expert's output removed
    ablated_hi: np.ndarray
    predicted: np.ndarray     # (n,) argmax token of the logit midpoints (routed expert)


def _embed(weights: Weights, token, j: int, n: int):
    """h_j = E[x_j] + P[j] as an interval sparse (1 x d) or (n x d) matrix."""
    if isinstance(token, (int, np.integer)):
        e = weights.E[int(token)]
        p = weights.P[j]
        mid = (e + p).tocsr()
        overlap = e.multiply(p)
        rad = (2 * I.U * abs(mid.multiply(overlap != 0))).tocsr()
        return mid, rad, True
    ids = np.asarray(token, np.int64)
    e = weights.E[ids]
    p = sp.csr_matrix(np.ones((n, 1))) @ weights.P[j]
    mid = (e + p).tocsr()
    overlap = e.multiply(p)
    rad = (2 * I.U * abs(mid.multiply(overlap != 0))).tocsr()
    return mid, rad, False


def _dense(m: sp.spmatrix) -> np.ndarray:
    return np.asarray(m.toarray())


def _softmax_bounds(s_lo: np.ndarray, s_hi: np.ndarray, s_mid: np.ndarray):
    """Enclosure of softmax over the last axis from score bounds: (lo, hi)."""
    M = s_mid.max(axis=-1, keepdims=True)
    e_lo = I.exp_enclosure(I.down(s_lo - M), I.down(s_lo - M))[0]
    e_hi = I.exp_enclosure(I.up(s_hi - M), I.up(s_hi - M))[1]
    J = s_mid.shape[-1]
    g = I.gamma(J + 2)
    tot_hi = I.up(e_hi.sum(axis=-1, keepdims=True) * (1 + g))
    tot_lo = I.down(e_lo.sum(axis=-1, keepdims=True) * (1 - g))
    others_hi = I.up((tot_hi - e_hi) * (1 + 4 * I.U))  # Σ_{l != j} e_hi_l (rounded up)
    others_lo = np.maximum(I.down((tot_lo - e_lo) * (1 - 4 * I.U)), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        lo = I.down(e_lo / I.up(e_lo + others_hi))
        hi = I.up(e_hi / I.down(e_hi + others_lo))
    lo = np.nan_to_num(lo, nan=0.0)
    hi = np.minimum(np.nan_to_num(hi, nan=1.0), 1.0)
    return np.maximum(lo, 0.0), hi


def _from_bounds(lo: np.ndarray, hi: np.ndarray):
    """Mid-radius form of [lo, hi]; a point interval stays a point (radius exactly 0)."""
    point = lo == hi
    mid = np.where(point, lo, 0.5 * lo + 0.5 * hi)
    rad = np.where(point, 0.0, np.maximum(I.up(hi - mid), I.up(mid - lo)))
    return mid, rad


def _aligned(pattern: sp.csr_matrix, m: sp.csr_matrix) -> np.ndarray:
    """Values of ``m`` on ``pattern``'s stored entries (pattern ⊇ m's pattern); 0 elsewhere."""
    pattern = pattern.tocsr()
    pattern.sort_indices()
    m = m.tocsr()
    m.sort_indices()
    w = pattern.shape[1]
    prow = np.repeat(np.arange(pattern.shape[0]), np.diff(pattern.indptr))
    mrow = np.repeat(np.arange(m.shape[0]), np.diff(m.indptr))
    pkey = prow.astype(np.int64) * w + pattern.indices
    mkey = mrow.astype(np.int64) * w + m.indices
    out = np.zeros(pkey.size)
    pos = np.searchsorted(pkey, mkey)
    out[pos] = m.data
    return out


def _union(mid: sp.csr_matrix, rad: sp.csr_matrix) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    """Common pattern of an interval sparse matrix, with mid and rad values on it."""
    pattern = (abs(mid) + abs(rad)).tocsr()
    pattern.sort_indices()
    return pattern, _aligned(pattern, mid), _aligned(pattern, rad)


def attention(weights: Weights, positions: list, n: int):
    """Residual r at the last position, as an interval sparse (n x d)."""
    p = len(positions) - 1
    hs = [_embed(weights, tok, j, n) for j, tok in enumerate(positions)]
    ones = sp.csr_matrix(np.ones((n, 1)))

    def rows(mid, rad, shared):
        return ((ones @ mid).tocsr(), (ones @ rad).tocsr()) if shared else (mid, rad)

    Rm, Rr = rows(*hs[p])
    for head in weights.heads:
        dq = head.W_Q.shape[0]
        qm, qr = I.smatmul(hs[p][0], hs[p][1], head.W_Q.T)
        qm, qr = _dense(qm), _dense(qr)
        if hs[p][2]:
            qm, qr = np.broadcast_to(qm, (n, dq)), np.broadcast_to(qr, (n, dq))
        s_mid, s_rad = np.empty((n, p + 1)), np.empty((n, p + 1))
        values = []
        for j, (hm, hr, shared) in enumerate(hs):
            km, kr = I.smatmul(hm, hr, head.W_K.T)
            km, kr = _dense(km), _dense(kr)
            if shared:
                km, kr = np.broadcast_to(km, (n, dq)), np.broadcast_to(kr, (n, dq))
            s_mid[:, j], s_rad[:, j] = I.dot_rows(qm, qr, km, kr)
            values.append(I.smatmul(hm, hr, head.W_V.T) + (shared,))
        a_lo, a_hi = _softmax_bounds(I.lower(s_mid, s_rad), I.upper(s_mid, s_rad), s_mid)
        am, ar = _from_bounds(a_lo, a_hi)
        Om = Or = None
        for j, (vm, vr, shared) in enumerate(values):
            vm, vr = rows(vm, vr, shared)
            tm, tr = I.srow_scale(vm, vr, am[:, j], ar[:, j])
            Om, Or = (tm, tr) if Om is None else I.sadd(Om, Or, tm, tr)
        om, orad = I.smatmul(Om, Or, head.W_O.T)
        Rm, Rr = I.sadd(Rm, Rr, om, orad)
    return Rm, Rr


def _sparse_error(Lm: sp.csr_matrix, Lr: sp.csr_matrix, V: int, valid_ptr: np.ndarray, valid: np.ndarray):
    """Enclosure of 1 − P(valid) from sparse logit intervals (absent logits are exactly 0)."""
    n = Lm.shape[0]
    pattern, mid, rad = _union(Lm, Lr)
    rows = np.repeat(np.arange(n), np.diff(pattern.indptr))
    cols = pattern.indices
    lo, hi = I.lower(mid, rad), I.upper(mid, rad)
    stored = np.diff(pattern.indptr)
    n_valid = np.diff(valid_ptr)
    vrows = np.repeat(np.arange(n), n_valid)
    vkey = np.sort(vrows.astype(np.int64) * V + valid)
    key = rows.astype(np.int64) * V + cols
    pos = np.searchsorted(vkey, key)
    is_valid = (pos < vkey.size) & (vkey[np.minimum(pos, vkey.size - 1)] == key)
    stored_valid = np.bincount(rows, weights=is_valid, minlength=n).astype(np.int64)
    zero_valid = n_valid - stored_valid
    zero_invalid = V - stored - zero_valid
    has_zero = (V - stored) > 0
    M = np.full(n, -np.inf)
    np.maximum.at(M, rows, mid)
    M = np.where(has_zero, np.maximum(M, 0.0), M)
    M = np.where(np.isfinite(M), M, 0.0)
    e_lo = I.exp_enclosure(I.down(lo - M[rows]), I.down(lo - M[rows]))[0]
    e_hi = I.exp_enclosure(I.up(hi - M[rows]), I.up(hi - M[rows]))[1]
    z_lo = I.exp_enclosure(I.down(-M), I.down(-M))[0]
    z_hi = I.exp_enclosure(I.up(-M), I.up(-M))[1]
    g = I.gamma(int(stored.max(initial=0)) + 4)
    inv = ~is_valid
    inv_hi = I.up((np.bincount(rows, weights=np.where(inv, e_hi, 0.0), minlength=n) + I.up(zero_invalid * z_hi)) * (1 + g))
    inv_lo = I.down((np.bincount(rows, weights=np.where(inv, e_lo, 0.0), minlength=n) + I.down(zero_invalid * z_lo)) * (1 - g))
    val_hi = I.up((np.bincount(rows, weights=np.where(is_valid, e_hi, 0.0), minlength=n) + I.up(zero_valid * z_hi)) * (1 + g))
    val_lo = I.down((np.bincount(rows, weights=np.where(is_valid, e_lo, 0.0), minlength=n) + I.down(zero_valid * z_lo)) * (1 - g))
    with np.errstate(invalid="ignore", divide="ignore"):
        err_hi = I.up(inv_hi / I.down(inv_hi + val_lo))
        err_lo = I.down(inv_lo / I.up(inv_lo + val_hi))
    err_hi = np.where(np.isfinite(err_hi), np.minimum(err_hi, 1.0), 1.0)
    err_lo = np.where(np.isfinite(err_lo), np.maximum(err_lo, 0.0), 0.0)
    # Predicted token: the largest logit midpoint, a zero-logit token if none is positive.
    predicted = np.full(n, -1, np.int64)
    best = np.full(n, -np.inf)
    order = np.lexsort((-mid, rows))
    first = np.ones(order.size, bool)
    first[1:] = rows[order][1:] != rows[order][:-1]
    predicted[rows[order][first]] = cols[order][first]
    best[rows[order][first]] = mid[order][first]
    predicted = np.where(has_zero & (best < 0), -1, predicted)
    return err_lo, err_hi, predicted


def expert_output(weights: Weights, k: int, Rm: sp.csr_matrix, Rr: sp.csr_matrix):
    """W_2 ReLU(W_1 r + b_1) for expert k on interval rows R; interval sparse (n x d)."""
    ex = weights.experts[k]
    n = Rm.shape[0]
    Zm, Zr = I.smatmul(Rm, Rr, ex.W_1.T)
    pattern, zm, zr = _union(Zm, Zr)
    cols = pattern.indices
    zm2 = zm + ex.b_1[cols]
    zr2 = I.up(zr + I.U * np.abs(zm2) * 2)
    a_lo = np.maximum(I.lower(zm2, zr2), 0.0)
    a_hi = np.maximum(I.upper(zm2, zr2), 0.0)
    am, ar = _from_bounds(a_lo, a_hi)
    rows = np.repeat(np.arange(n), np.diff(pattern.indptr))
    # Neurons with a positive bias fire even where nothing else reaches them: act = b exactly.
    positive = np.flatnonzero(ex.b_1 > 0)
    if positive.size:
        touched = set(zip(rows.tolist(), cols.tolist()))
        extra = [(i, c) for i in range(n) for c in positive if (i, c) not in touched]
        if extra:
            er, ec = np.array(extra).T
            rows = np.concatenate([rows, er]); cols = np.concatenate([cols, ec])
            am = np.concatenate([am, ex.b_1[ec]]); ar = np.concatenate([ar, np.zeros(ec.size)])
    Am = sp.csr_matrix((am, (rows, cols)), shape=(n, ex.width))
    Ar = sp.csr_matrix((ar, (rows, cols)), shape=(n, ex.width))
    return I.smatmul(Am, Ar, ex.W_2.T)


def run_batch(weights: Weights, positions: list, n: int, valid_ptr: np.ndarray, valid: np.ndarray) -> BatchResult:
    """Certified forward pass of a batch; ``valid`` in the weights' token ids."""
    V, K = len(weights.vocab), len(weights.experts)
    Rm, Rr = attention(weights, positions, n)
    Gm, Gr = I.smatmul(Rm, Rr, weights.W_G.T)
    Gm, Gr = _dense(Gm) + weights.b_G[None, :], _dense(Gr)
    Gr = I.up(Gr + I.U * np.abs(Gm) * 2)
    g_lo, g_hi = I.lower(Gm, Gr), I.upper(Gm, Gr)
    e = np.argmax(Gm, axis=1)
    rows = np.arange(n)
    others = g_hi.copy()
    others[rows, e] = -np.inf
    margin = I.down(g_lo[rows, e] - others.max(axis=1)) if K > 1 else np.full(n, np.inf)
    cand = g_hi >= g_lo[rows, e][:, None]
    cand[rows, e] = True

    if weights.gate_mode == "top1-scaled":
        p_lo, p_hi = _softmax_bounds(g_lo, g_hi, Gm)
    err_lo = np.full(n, np.inf)
    err_hi = np.full(n, -np.inf)
    predicted = np.full(n, -1, np.int64)
    Um = weights.U.T
    for k in np.flatnonzero(cand.any(axis=0)):
        idx = np.flatnonzero(cand[:, k])
        rm, rr = Rm[idx], Rr[idx]
        om, orad = expert_output(weights, int(k), rm, rr)
        if weights.gate_mode == "top1-scaled":
            cm, cr = _from_bounds(p_lo[idx, k], p_hi[idx, k])
            om, orad = I.srow_scale(om, orad, cm, cr)
        ym, yr = I.sadd(rm, rr, om, orad)
        Lm, Lr = I.smatmul(ym, yr, Um)
        vptr, vals = _subset_csr(valid_ptr, valid, idx)
        lo, hi, pred = _sparse_error(Lm, Lr, V, vptr, vals)
        err_lo[idx] = np.minimum(err_lo[idx], lo)
        err_hi[idx] = np.maximum(err_hi[idx], hi)
        routed = e[idx] == k
        predicted[idx[routed]] = pred[routed]
    Lm, Lr = I.smatmul(Rm, Rr, Um)
    ab_lo, ab_hi, _ = _sparse_error(Lm, Lr, V, valid_ptr, valid)
    return BatchResult(e, margin, sp.csr_matrix(cand), g_lo, g_hi, err_lo, err_hi, ab_lo, ab_hi, predicted)


def _subset_csr(ptr: np.ndarray, vals: np.ndarray, idx: np.ndarray):
    counts = ptr[idx + 1] - ptr[idx]
    new_ptr = np.concatenate([[0], np.cumsum(counts)])
    if counts.sum() == 0:
        return new_ptr, np.zeros(0, np.int64)
    starts = np.repeat(ptr[idx], counts)
    offsets = np.arange(counts.sum()) - np.repeat(new_ptr[:-1], counts)
    return new_ptr, vals[starts + offsets]
