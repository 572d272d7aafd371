"""The certified forward pass of a two-layer model (:class:`layout.layers.Stack`).

Layer 1's attention is the one-layer pass's (:func:`verifier.passes.forward.residual`: the
residual r at the last position, enclosed). Everything after it is computed here on
sparse interval matrices (:mod:`verifier.arithmetic.interval`: every product by Lemma 2,
every sum by Lemma 1, each step rounded outward; an entry outside a pattern is exactly 0):

1. **Gate 1**: W_G·r + b_G; the winner, its certified margin, and the experts that may win.
2. **Expert 1**, for each (row, expert k that may win): y = r + W_2 ReLU(W_1 r + b_1).
3. **Gate 2** on y, and **expert 2** for each expert that may win: y' = y + W'_2 ReLU(W'_1 y + b'_1).
4. **Readout**: the logits U·y' (sparse: a token no term reaches has logit exactly 0) and
   the error 1 − P(valid) enclosed (:func:`readout`); the reported enclosure is the worst
   over every pair of experts that may win.
5. **Ablations** of object queries: hop 1, the first layer's expert removed (y = r, then
   layer 2 as in 3); hop 2, the second layer's expert removed (the logits U·y). For each:
   the error, the lower end of 1 − P(o) for the object o alone (L1) and a lower bound of
   max_{t != o} z_t − z_o (L2), worst over the experts that may win.

ReLU of an interval [lo, hi]: itself when lo >= 0, exactly 0 when hi <= 0 (the entry is
dropped: outside the pattern it is 0), else [0, hi], stored as mid = hi/2 and a radius of
at least both mid and hi − mid (rounded up), so that it covers [0, hi]. Only the exact
pass ("top1" gates in both layers) is enclosed here; the deployed-precision pass has no
two-layer form yet (the command line refuses it in one line).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from layout.layers import Stack
from verifier.arithmetic import interval as I
from verifier.arithmetic.interval import SparseInterval
from verifier.passes.dense import decide
from verifier.passes.forward import Prepared, gate_decisions, residual


def relu_bounds(m: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ReLU of the intervals [m ± r] (element-wise, the module docstring): (mid, rad, not 0)."""
    lo, hi = I.lower(m, r), I.upper(m, r)
    on = lo >= 0
    with np.errstate(invalid="ignore", over="ignore"):
        mid = np.where(on, m, hi * 0.5)
        rad = np.where(on, r, np.maximum(mid, I.up(hi - mid)))
    return mid, I.guard(mid, rad), hi > 0


def hidden(X: SparseInterval, W1T, b1: np.ndarray) -> SparseInterval:
    """ReLU(W_1 X + b_1) for the rows of X (given W_1^T).

    z = W_1 x by Lemma 2 (:func:`verifier.arithmetic.interval.matmul`: a neuron no term
    reaches has z exactly 0 and is outside the pattern). The bias: a neuron with b > 0 is
    added to every row's pattern (:func:`verifier.arithmetic.interval.add`); on the pattern,
    fl(z + b) errs by at most u·|fl(z + b)| (one addition: no underflow term). Outside it a
    neuron with b <= 0 has pre-activation exactly b, so ReLU gives exactly 0 and it stays
    out. Then the ReLU of each stored interval; entries exactly 0 after it are dropped."""
    b1 = np.asarray(b1, np.float64)
    Z = I.matmul(X, W1T)
    pos = np.flatnonzero(b1 > 0)
    if pos.size:
        n = X.shape[0]
        rows = np.repeat(np.arange(n, dtype=np.int64), pos.size)
        Z = I.add(Z, I.from_coo(Z.shape, rows, np.tile(pos, n), np.tile(b1[pos], n), np.zeros(rows.size)))
    rest = np.where(b1 > 0, 0.0, b1)            # the bias not yet added
    with np.errstate(invalid="ignore", over="ignore"):
        m = Z.mid + rest[Z.indices]
        r = I.guard(m, I.add_rad(Z.rad, I.up(I.U * np.abs(m))))
    mid, rad, keep = relu_bounds(m, r)
    ptr = np.zeros(Z.shape[0] + 1, np.int64)
    np.cumsum(np.bincount(Z.row_ids()[keep], minlength=Z.shape[0]), out=ptr[1:])
    return SparseInterval(Z.shape, ptr, Z.indices[keep], mid[keep], rad[keep])


def expert_output(X: SparseInterval, W1T, b1: np.ndarray, W2T: sp.csr_matrix) -> SparseInterval:
    """X + W_2 ReLU(W_1 X + b_1) for the rows of X (given W_1^T, W_2^T)."""
    if W1T.shape[1] == 0:
        return X
    return I.add(X, I.matmul(hidden(X, W1T, np.asarray(b1, np.float64)), W2T))


def gate(X: SparseInterval, WGT, b: np.ndarray):
    """The gate's decisions on rows X (:func:`verifier.passes.dense.decide`), except that on
    a row whose scores are not all finite (an overflow: the exact scores are finite, any of
    them may be the largest) **every** expert may win, where ``decide`` names the winner
    alone: the ablation of hop 1 reads no margin, so its worst case must cover every routing."""
    S = I.matmul(X, WGT)
    m, r = S.dense()
    with np.errstate(invalid="ignore", over="ignore"):
        gm = m + b
        gr = I.guard(gm, I.add_rad(r, I.up(I.U * np.abs(gm))))
    e, margin, gm, gr, top, (ptr, cand) = decide(gm, gr)
    n, K = gm.shape
    undecided = ~(np.isfinite(gm).all(axis=1) & np.isfinite(gr).all(axis=1))
    if undecided.any():
        may = np.zeros((n, K), bool)
        may[np.repeat(np.arange(n), np.diff(ptr)), cand] = True
        may[undecided] = True
        ptr = np.concatenate([[0], np.cumsum(may.sum(axis=1))]).astype(np.int64)
        cand = np.nonzero(may)[1].astype(np.int64)
    return e, margin, gm, gr, top, (ptr, cand)


def readout(L: SparseInterval, vptr: np.ndarray, valid: np.ndarray, target: np.ndarray | None = None):
    """From logit enclosures L (n × V; a token outside the pattern has logit exactly 0):
    (error lo, error hi) of 1 − P(valid next tokens) and, where ``target`` names a token o,
    the lower end of 1 − P(o) and a lower bound of max_{t != o} z_t − z_o.

    Error = A/(A + B), A the invalid tokens' mass Σ e^{z_t − M}, B the valid ones', for any
    shift M; it increases in A and decreases in B, so the bounds take A's upper and B's
    lower ends and the reverse. Each e^x is enclosed (:func:`I.exp_enclosure`); the tokens
    of logit 0 enter as a count times e^{−M}; sums of non-negative terms are bounded by
    Lemma 1 above (c_T·fl) and below ((1 − γ_T)·fl), each step rounded outward."""
    n, V = L.shape
    rows = L.row_ids()
    lo, hi = I.lower(L.mid, L.rad), I.upper(L.mid, L.rad)
    bad = np.bincount(rows[~(np.isfinite(lo) & np.isfinite(hi))], minlength=n) > 0
    nt = np.diff(L.indptr)
    key = rows * V + L.indices
    vrows = np.repeat(np.arange(n, dtype=np.int64), np.diff(vptr))
    vkey = np.sort(vrows * V + np.asarray(valid, np.int64))
    is_valid = np.isin(key, vkey, assume_unique=False)
    n_valid = np.diff(vptr)
    zero_valid = n_valid - np.bincount(rows[is_valid], minlength=n)
    zero_invalid = (V - nt) - zero_valid
    err = _ratio(n, rows, lo, hi, L.mid, ~is_valid, zero_invalid, zero_valid, V - nt, nt)
    err_lo, err_hi = err
    err_lo[bad], err_hi[bad] = 0.0, 1.0
    if target is None:
        return err_lo, err_hi, None, None
    target = np.asarray(target, np.int64)
    has = target >= 0
    is_o = L.indices == target[rows]
    o_touched = np.bincount(rows[is_o], minlength=n) > 0
    zo = np.where(has & ~o_touched, 1, 0)
    obj_lo, _ = _ratio(n, rows, lo, hi, L.mid, ~is_o, (V - nt) - zo, zo, V - nt, nt)
    # L2: max over t != o of lo_t (0 for an untouched t != o), minus o's upper end (0 if untouched)
    best = np.full(n, -np.inf)
    np.maximum.at(best, rows[~is_o], lo[~is_o])
    untouched_other = (V - nt - zo) > 0
    best = np.where(untouched_other, np.maximum(best, 0.0), best)
    hi_o = np.zeros(n)
    hi_o[rows[is_o]] = hi[is_o]
    with np.errstate(invalid="ignore"):
        g = best - hi_o
        gap = np.where(g == 0, 0.0, I.down(g))     # a difference of floats that rounds to 0 is exactly 0
    obj_lo[bad | ~has], gap[bad] = 0.0, -np.inf
    obj_lo[~has], gap[~has] = np.nan, np.nan
    return err_lo, err_hi, np.maximum(obj_lo, 0.0), gap


def _ratio(n, rows, lo, hi, mid, bad_entry, zero_bad, zero_good, zeros, nt):
    """Enclosure of A/(A + B): A the mass of the entries ``bad_entry`` plus ``zero_bad``
    tokens of logit 0, B the others' (see :func:`readout`)."""
    M = np.full(n, -np.inf)
    np.maximum.at(M, rows, np.where(np.isfinite(mid), mid, -np.inf))
    M = np.where(zeros > 0, np.maximum(M, 0.0), M)
    M = np.where(np.isfinite(M), M, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        e_lo, e_hi = I.exp_enclosure(I.down(lo - M[rows]), I.up(hi - M[rows]))
        z_lo, z_hi = I.exp_enclosure(-M, -M)
    T = int(nt.max(initial=0)) + 1
    c, g = I.sum_factor(T), I.gamma(T)

    def mass(sel, count):
        s_hi = np.bincount(rows[sel], weights=e_hi[sel], minlength=n) + I.up(count * z_hi)
        s_lo = np.bincount(rows[sel], weights=e_lo[sel], minlength=n) + I.down(count * z_lo)
        return np.maximum(I.down(I.down(1.0 - g) * s_lo), 0.0), I.up(c * s_hi)

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        a_lo, a_hi = mass(bad_entry, zero_bad)
        b_lo, b_hi = mass(~bad_entry, zero_good)
        lo_r = I.down(a_lo / I.up(a_lo + b_hi))
        hi_r = I.up(a_hi / I.down(a_hi + b_lo))
    lo_r = np.where(np.isfinite(lo_r), np.maximum(lo_r, 0.0), 0.0)
    hi_r = np.where(np.isfinite(hi_r), np.minimum(hi_r, 1.0), 1.0)
    return lo_r, hi_r


@dataclass
class LayersResult:
    """Per row of a batch: both layers' routing and the errors (module docstring)."""

    expert1: np.ndarray         # (n,) layer 1's winner (largest midpoint)
    margin1: np.ndarray         # (n,) its certified margin (<= 0: not certified)
    expert2: np.ndarray         # (n,) layer 2's winner, after layer 1's winner
    margin2: np.ndarray         # (n,) the smallest certified margin of layer 2 over layer 1's possible winners
    err_lo: np.ndarray
    err_hi: np.ndarray
    #: per hop (1, 2): (error lo, error hi, lower end of 1 − P(o), L2 gap lower bound) with that
    #: layer's expert removed; NaN on rows not ablated
    ablated: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


class LayersPass:
    """The two-layer pass for fixed weights."""

    def __init__(self, stack: Stack) -> None:
        stack.validate()
        self.stack = stack
        self.prep = Prepared(stack.first)
        w, s = stack.first, stack.second
        # each transposed matrix kept by the residual directions it reads (interval.Thin): a
        # product then meets only those entries of a row (the same sums, bit for bit)
        thin = I.Thin.transpose_of
        self.E1 = [(thin(e.W_1), np.asarray(e.b_1, np.float64), I.as_csr(e.W_2).T.tocsr()) for e in w.experts]
        self.WG2 = thin(s.W_G)
        self.bG2 = np.asarray(s.b_G, np.float64)
        self.E2 = [(thin(e.W_1), np.asarray(e.b_1, np.float64), I.as_csr(e.W_2).T.tocsr()) for e in s.experts]
        self.UT = thin(w.U)

    def _layer2(self, Y: SparseInterval):
        """Layer 2 on rows Y: (winner, margin, for each candidate (rows, y') pairs)."""
        e, margin, _, _, _, (ptr, cand) = gate(Y, self.WG2, self.bG2)
        pair_rows = np.repeat(np.arange(Y.shape[0], dtype=np.int64), np.diff(ptr))
        outs = []
        for k in np.unique(cand):
            sel = pair_rows[cand == k]
            outs.append((sel, expert_output(Y.rows(sel), *self.E2[int(k)])))
        return e, margin, outs

    def _worst(self, n, outs, vptr, vals, target):
        """The worst readout over candidate outputs: (err lo, err hi, 1 − P(o) lo, gap)."""
        err_lo, err_hi = np.full(n, np.inf), np.full(n, -np.inf)
        obj, gap = np.full(n, np.inf), np.full(n, np.inf)
        for rows, Y in outs:
            vp, vv = _take(vptr, vals, rows)
            lo, hi, o, g = readout(I.matmul(Y, self.UT), vp, vv, None if target is None else target[rows])
            np.minimum.at(err_lo, rows, lo)
            np.maximum.at(err_hi, rows, hi)
            if target is not None:
                np.minimum.at(obj, rows, np.nan_to_num(o, nan=np.inf))
                np.minimum.at(gap, rows, np.nan_to_num(g, nan=np.inf))
        return err_lo, err_hi, obj, gap

    def run_batch(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray, target: np.ndarray,
                  ablate1: np.ndarray, ablate2: np.ndarray) -> LayersResult:
        """The pass over a batch (n × p weights' token ids, BOS added here): routing, the
        error, and the ablations of the rows ``ablate1`` (hop 1) and ``ablate2`` (hop 2)."""
        tokens = np.asarray(tokens, np.int64)
        n = tokens.shape[0]
        vptr, vals = np.asarray(valid_ptr, np.int64), np.asarray(valid, np.int64)
        target = np.asarray(target, np.int64)
        R = residual(self.prep, tokens)
        # layer 1's gate: the one-layer pass's (the same weights, the same enclosure and decisions)
        e1, margin1, _, _, _, _, ptr1, cand1, _ = gate_decisions(self.prep, R, False)
        pair_rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr1))
        e2 = np.full(n, -1, np.int64)
        margin2 = np.full(n, np.inf)
        finals, hop2 = [], []
        for k in np.unique(cand1):
            rows = pair_rows[cand1 == k]
            Y = expert_output(R.rows(rows), *self.E1[int(k)])
            w2, m2, outs = self._layer2(Y)
            np.minimum.at(margin2, rows, m2)
            routed = e1[rows] == k
            e2[rows[routed]] = w2[routed]
            finals += [(rows[sub], out) for sub, out in outs]
            hop2.append((rows, Y))
        err_lo, err_hi, _, _ = self._worst(n, finals, vptr, vals, None)
        nan = lambda: np.full(n, np.nan)  # noqa: E731
        ablated = {1: (nan(), nan(), nan(), nan()), 2: (nan(), nan(), nan(), nan())}
        a1 = np.flatnonzero(ablate1)
        if a1.size:
            _, m, outs = self._layer2(R.rows(a1))
            got = self._worst(a1.size, outs, *_take(vptr, vals, a1), target[a1])
            for arr, g in zip(ablated[1], got):
                arr[a1] = g
        a2 = np.asarray(ablate2, bool)
        if a2.any():
            outs = []
            for rows, Y in hop2:
                sel = np.flatnonzero(a2[rows])
                outs.append((rows[sel], Y.rows(sel)))
            got = self._worst(n, outs, vptr, vals, target)
            for arr, g in zip(ablated[2], got):
                arr[a2] = g[a2]
        return LayersResult(e1, margin1, e2, margin2, err_lo, err_hi, ablated)


def _take(ptr: np.ndarray, vals: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from verifier.passes.batches import take_csr

    return take_csr(ptr, vals, np.asarray(rows, np.int64))
