"""The certified forward pass: every quantity enclosed, vectorised over a batch.

A batch is n prefixes of one length p (token ids, BOS prepended here). For each row
the pass returns enclosures of the gate scores, the routing decision with its
certified margin, and the error 1 − P(valid) of the next-token distribution, for the
model and for the model with the routed expert's output removed (ablation). The
equations are those of :mod:`layout`; the arithmetic is :mod:`verifier.interval`
(mid-radius, every radius rounded upward, enclosed exp), carried out per row by the
compiled kernels of :mod:`verifier.kernels`.

Stages of :func:`run_batch`:

1. **Attention** (numpy): per head, the score intervals and softmax enclosures, once per
   distinct row of token classes (rows whose tokens have identical projections share
   them); every head and position in the same array operations.
2. **Residual** (:func:`verifier.kernels.residual`): E[x_p] + P[p] + each head's value
   rows scaled by its attention intervals, summed per entry.
3. **Gate** (:func:`verifier.kernels.gate`): scores and one radius per row; the routed
   expert, the certified margin, and every expert that may still win.
4. **Experts and error** (:func:`verifier.kernels.experts`): for each (row, expert that
   may win), W_1·r + b_1, ReLU, y = r + c·W_2·a, the logits U·y and the error enclosure;
   the reported enclosure is the worst over the experts that may win.
5. **Ablation** (:func:`verifier.kernels.ablated`): the error of softmax(U·r).

Zeros are structural everywhere: an entry no term of the forward pass reaches is
exactly 0 (a logit of no touched direction is 0 and counted; a neuron the row does not
reach has pre-activation exactly b_1); an entry whose terms underflowed or cancelled
keeps a radius. A row with a non-finite enclosure anywhere decides nothing: error
[0, 1], margin −∞.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from verifier import interval as I
from verifier import kernels as K_
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
    candidates: tuple[np.ndarray, np.ndarray] | None = None  # CSR (ptr, experts): the experts that may win each row
    #: enclosure of the probability one token of logit exactly 0 has, with the routed expert
    #: (rho) and with it removed (ablated_rho); NaN where not computed (kernels._error)
    rho_lo: np.ndarray | None = None
    rho_hi: np.ndarray | None = None
    ablated_rho_lo: np.ndarray | None = None
    ablated_rho_hi: np.ndarray | None = None
    #: (n, R + 1): watched neurons of the routed expert that may be on (Prepared.watch), and
    #: in the last column how many there were (more than R: the list is incomplete)
    active: np.ndarray | None = None

    @property
    def gate_lo(self) -> np.ndarray:
        """(n, K) lower ends of the gate scores."""
        return I.lower(self.gate_mid, self.gate_rad[:, None])

    @property
    def gate_hi(self) -> np.ndarray:
        return I.upper(self.gate_mid, self.gate_rad[:, None])

    def take(self, idx: np.ndarray) -> "BatchResult":
        """Rows ``idx`` (without the full gate enclosures and the candidates)."""
        pick = lambda a: None if a is None else a[idx]  # noqa: E731
        top = tuple(a[idx] for a in self.top_gate) if self.top_gate is not None else None
        return BatchResult(self.expert[idx], self.margin[idx], self.ambiguous[idx], None, None, self.err_lo[idx],
                           self.err_hi[idx], self.ablated_lo[idx], self.ablated_hi[idx], self.predicted[idx], top, None,
                           pick(self.rho_lo), pick(self.rho_hi), pick(self.ablated_rho_lo), pick(self.ablated_rho_hi),
                           pick(self.active))

    def compact(self) -> "BatchResult":
        """Without the full (n, K) gate enclosures (kept: the top three per row)."""
        return BatchResult(self.expert, self.margin, self.ambiguous, None, None, self.err_lo, self.err_hi,
                           self.ablated_lo, self.ablated_hi, self.predicted, self.top_gate, None,
                           self.rho_lo, self.rho_hi, self.ablated_rho_lo, self.ablated_rho_hi, self.active)


class _RowTable:
    """Distinct rows, numbered in order of first appearance (bitwise equality of the bytes
    of each row). Rows come in chunks; only a chunk's distinct rows are looked up."""

    def __init__(self) -> None:
        self.ids: dict[bytes, int] = {}
        self.count = 0
        self.parts: list = []

    def add(self, keys: list[bytes], rows) -> np.ndarray:
        """Ids of rows with bytes ``keys``; ``rows(positions)`` gives the new ones' values."""
        out = np.empty(len(keys), np.int64)
        new = []
        for i, key in enumerate(keys):
            got = self.ids.get(key)
            if got is None:
                got = self.ids[key] = self.count + len(new)
                new.append(i)
            out[i] = got
        if new:
            self.parts.append(rows(np.asarray(new, np.int64)))
            self.count += len(new)
        return out

    def append(self, rows, n: int) -> np.ndarray:
        """``n`` rows kept as they are (not looked up: a chunk whose rows are mostly distinct)."""
        self.parts.append(rows)
        self.count += n
        return np.arange(self.count - n, self.count, dtype=np.int64)


#: Tokens per chunk when the per-token head projections are computed.
TOKEN_CHUNK = 1 << 16
#: A residual direction read by at least this many rows of W_G is "hot" (kernels.gate).
HOT_READERS = 16


class Prepared:
    """Per-weights interval projections (computed once, reused by every batch).

    Attention tables are stored per token *class*: tokens whose query and key projections
    are bitwise equal (in every head) share one class and one table row, and so do
    tokens whose value rows W_O W_V E[x] are equal in a head. The projections are
    computed ``TOKEN_CHUNK`` tokens at a time, so neither the tables nor their
    computation hold a row per token beyond the class maps. Sharing a row between equal
    rows changes no value, so every enclosure is the one computed for each token.
    """

    def __init__(self, weights: Weights, gate_terms: int = 0, vocab_size: int | None = None) -> None:
        """``gate_terms``: a lower limit for the longest gate row used in the rounding bound
        (a shard of larger weights passes theirs, so that its enclosures are theirs bit for
        bit; a larger count only widens the bound). ``vocab_size``: the number of tokens the
        output softmax runs over, if more than the weights' rows (a compact shard,
        :class:`verifier.shards.Compact`: the missing tokens have logit exactly 0)."""
        I.check_platform()
        weights.validate()
        self.weights = weights
        self.vocab_size = max(len(weights.vocab), vocab_size or 0)
        d, V1, H = weights.d, weights.E.shape[0], len(weights.heads)
        self.n_heads = H
        P = I.exact(weights.P)
        WQ = [h.W_Q.T.tocsr() for h in weights.heads]
        WK = [h.W_K.T.tocsr() for h in weights.heads]
        WV = [h.W_V.T.tocsr() for h in weights.heads]
        WO = [h.W_O.T.tocsr() for h in weights.heads]
        # Query and key projections of every head side by side: head m owns columns
        # starts[m] .. starts[m] + widths[m].
        self.widths = np.array([w.shape[1] for w in WQ], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.widths)[:-1]]).astype(np.int64)

        def qk(X: SparseInterval):
            """(query mid, query rad, key mid, key rad) of rows X, every head side by side."""
            if not H:
                return tuple(np.zeros((X.shape[0], 0)) for _ in range(4))
            q = [I.matmul(X, W).dense() for W in WQ]
            k = [I.matmul(X, W).dense() for W in WK]
            return tuple(np.concatenate([x[i] for x in pair], axis=1) for pair in (q, k) for i in (0, 1))

        qp = qk(P)
        self.QP, self.KP = qp[:2], qp[2:]                    # (positions, Σd_h) mid, rad
        self.OP = I.vstack([I.matmul(I.matmul(P, WV[m]), WO[m]) for m in range(H)]) if H else _empty(d)
        # Per token: its query/key class and, per head, its value row.
        qk_table, v_table = _RowTable(), _RowTable()
        qk_class = np.zeros(V1, np.int64)
        v_row = np.zeros((H, V1), np.int64)
        E = I.as_csr(weights.E)
        # Tokens whose E row is empty (a shard keeps only its queries' rows) all have the
        # same projections, those of an empty row: one of them is computed and stands for
        # the rest. (Each output row depends on its own input row only.)
        empty = np.diff(E.indptr) == 0
        if empty.sum() > 1:
            todo = np.concatenate([np.flatnonzero(~empty), np.flatnonzero(empty)[:1]])
            todo.sort()
            E_todo = E[todo]
        else:
            todo, E_todo = np.arange(V1), E
        n = todo.size
        for a in range(0, n if H else 0, TOKEN_CHUNK):
            b = min(a + TOKEN_CHUNK, n)
            X = I.exact(E_todo[a:b])
            table = np.ascontiguousarray(np.concatenate(qk(X), axis=1))
            first, inv = _unique_rows(table)
            keys = [table[f].tobytes() for f in first]
            qk_class[todo[a:b]] = qk_table.add(keys, lambda new: table[first[new]])[inv]
        for m in range(H):
            # Every token's value row W_O W_V E[x] in one product per head: scipy's sparse
            # product costs time in the number of output columns (d) per call, so a call
            # per chunk of tokens would cost d per chunk. Each output row depends on its
            # own input row only, so the rows are those a product per chunk gives.
            O_all = I.matmul(I.matmul(I.exact(E_todo), WV[m]), WO[m]) if n else None
            for a in range(0, n, TOKEN_CHUNK):
                b = min(a + TOKEN_CHUNK, n)
                O = O_all.rows(np.arange(a, b)) if (a, b) != (0, n) else O_all
                cls = _sparse_row_classes(O)
                first, inv = np.unique(cls, return_index=True, return_inverse=True)[1:]
                if 2 * first.size > O.shape[0]:
                    ids = v_table.append(O, O.shape[0])
                    v_row[m, todo[a:b]] = ids
                else:
                    rows = O.rows(first)
                    keys = [_sparse_row_bytes(rows, i) for i in range(first.size)]
                    v_row[m, todo[a:b]] = v_table.add(keys, rows.rows)[inv.reshape(-1)]
            del O_all
        if n < V1:
            stand_in = todo[np.flatnonzero(empty[todo])[0]]
            qk_class[empty] = qk_class[stand_in]
            v_row[:, empty] = v_row[:, [stand_in]]
        QK = np.concatenate(qk_table.parts) if qk_table.parts else np.zeros((0, 4 * int(self.widths.sum())))
        w_ = int(self.widths.sum())
        self.QE = (QK[:, :w_], QK[:, w_:2 * w_])            # (query/key classes, Σd_h) mid, rad
        self.KE = (QK[:, 2 * w_:3 * w_], QK[:, 3 * w_:])
        self.qk_class = _narrow(qk_class)                    # (V+1,) class of each token
        self.OE = I.vstack(v_table.parts) if v_table.parts else _empty(d)   # distinct value rows
        self.v_row = _narrow(v_row)                          # (H, V+1): head m, token x -> row of OE
        self.E_arrays = _csr_arrays(E)
        self.P_arrays = _csr_arrays(I.as_csr(weights.P))
        # The gate and the unembedding as CSR arrays over the residual directions.
        self.UT_arrays = _csr_arrays(weights.U.T.tocsr())
        self.WGT_arrays = _csr_arrays(weights.W_G.T.tocsr())
        WG = I.as_csr(weights.W_G)
        # the largest |W_G[k, j]| per residual direction j (0 where the gate reads nothing)
        self.wg_colmax = np.zeros(d)
        np.maximum.at(self.wg_colmax, WG.indices, np.abs(WG.data))
        self.wg_max_terms = max(int(np.diff(WG.indptr).max(initial=1)), int(gate_terms))
        # columns read by many experts: their part of the gate scores is shared by rows (kernels.gate)
        self.wg_hot = np.diff(self.WGT_arrays[0]) >= HOT_READERS
        # All experts side by side for the kernels: neuron g of expert k is global neuron
        # off[k] + g; W_1^T rows list (global neuron, weight) sorted by neuron.
        widths = np.array([e.width for e in weights.experts], np.int64)
        self.off = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        W1 = sp.vstack([e.W_1 for e in weights.experts]).tocsr() if widths.sum() else sp.csr_matrix((0, d))
        self.W1T = _csr_arrays(W1.T.tocsr())
        del W1
        self.W2T = _csr_arrays(sp.hstack([e.W_2 for e in weights.experts]).T.tocsr() if widths.sum()
                               else sp.csr_matrix((0, d)))
        self.b1 = np.concatenate([e.b_1 for e in weights.experts]) if widths.sum() else np.zeros(0)
        pos = [np.flatnonzero(e.b_1 > 0) + self.off[k] for k, e in enumerate(weights.experts)]
        self.pos_ptr = np.concatenate([[0], np.cumsum([x.size for x in pos])]).astype(np.int64)
        self.pos_idx = np.concatenate(pos).astype(np.int64) if pos else np.zeros(0, np.int64)
        self.max_width = int(widths.max(initial=1))
        #: global neurons whose possible activity each row records (BatchResult.active); set
        #: by whoever saves a certificate (verifier.classes), empty otherwise
        self.watch = np.zeros(0, bool)
        self._scratch = None
        self._stamp = 0

    def run_batch(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
                  ablate: np.ndarray | None = None, scores: bool = True) -> "BatchResult":
        """The certified pass over a batch (:func:`run_batch`): the pass protocol of
        :class:`verifier.runner.Pass`, which the deployed pass of a format shares."""
        return run_batch(self, tokens, valid_ptr, valid, ablate=ablate, scores=scores)

    def scratch(self):
        """Sparse-accumulator work arrays (allocated once per process, on first use)."""
        if self._scratch is None:
            K_.check()
            d, V, w = self.weights.d, len(self.weights.vocab), max(self.max_width, 1)

            def spa(size):
                """(accumulator rows: stamp, mid, A, B, count; the touched columns)."""
                acc = np.zeros((size, 5))
                acc[:, 0] = -1.0
                return acc, np.zeros(size, np.int64)

            K = len(self.weights.experts)
            self._scratch = {"z": spa(w), "y": spa(max(d, 1)), "L": spa(max(V, 1)),
                             "g": (np.zeros(K), np.full(K, -1.0), np.zeros(K, np.int64)),
                             "v": np.full(max(V, 1), -1.0),
                             "buf": (np.zeros(max(d, 1), np.int64), np.zeros(max(d, 1)), np.zeros(max(d, 1)))}
        return self._scratch

    def stamps(self, count: int) -> int:
        """The first of ``count`` fresh stamps (every row handled by a kernel gets its own)."""
        first = self._stamp
        self._stamp += count
        return first


def _empty(d: int) -> SparseInterval:
    return I.SparseInterval((0, d), np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))


def _narrow(a: np.ndarray) -> np.ndarray:
    """int32 when every value fits (class maps hold one entry per token: half the memory)."""
    return a.astype(np.int32) if a.size == 0 or a.max() < 2 ** 31 - 1 else a


def _sparse_row_bytes(M: SparseInterval, i: int) -> bytes:
    """Row i's stored (index, mid, rad) as bytes: equal bytes iff bitwise equal rows."""
    a, b = int(M.indptr[i]), int(M.indptr[i + 1])
    return M.indices[a:b].astype(np.int64).tobytes() + M.mid[a:b].tobytes() + M.rad[a:b].tobytes()


def _csr_arrays(M: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indptr, indices, data) of a canonical CSR matrix as int64/float64 arrays."""
    M = sp.csr_matrix(M)
    M.sort_indices()
    return (M.indptr.astype(np.int64), M.indices.astype(np.int64), M.data.astype(np.float64))


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
    return ratio_bounds(e_lo, e_hi)


def ratio_bounds(e_lo: np.ndarray, e_hi: np.ndarray):
    """Enclosure (lo, hi) of e_j / Σ_l e_l over the last axis, for e_l ∈ [e_lo_l, e_hi_l], e_lo >= 0.

    The ratio increases in e_j and decreases in the others: lo takes e_j's lower and the
    others' upper bounds, hi the reverse. Sums of the non-negative bounds are enclosed by
    Lemma 1 of :mod:`verifier.interval`, every other step is one operation rounded outward.
    """
    J = e_lo.shape[-1]
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


# --- the pass ---------------------------------------------------------------------------------


def attention(prep: Prepared, ids: np.ndarray):
    """Every head's attention enclosures at the last position of the rows of ``ids`` (n x (p+1)).

    Returns (row class of each row, mid and rad of the weights: (classes, heads, p+1)).
    Scores are computed once per distinct row of token classes (over all heads), as
    segmented dot products of the heads' stacked query and key projections.
    """
    n, p1 = ids.shape
    p = p1 - 1
    H = prep.n_heads
    cls = prep.qk_class[ids]
    first, inv = _unique_rows(cls)
    if H == 0:
        return inv, np.zeros((first.size, 0, p1)), np.zeros((first.size, 0, p1))
    rep = cls[first]                                                        # (n', p+1) classes
    with np.errstate(invalid="ignore", over="ignore"):
        q_m, q_r = I.gather_add(prep.QE, prep.QP, rep[:, p], p)           # (n', Σd_h)
        k_m, k_r = I.gather_add(prep.KE, prep.KP, rep, np.arange(p1)[None, :])  # (n', p+1, Σd_h)
        s_mid, s_rad = I.dot_segments(q_m[:, None, :], q_r[:, None, :], k_m, k_r, prep.starts, prep.widths)
        s_mid, s_rad = s_mid.transpose(0, 2, 1), s_rad.transpose(0, 2, 1)  # (n', H, p+1)
        a_lo, a_hi = softmax_bounds(I.lower(s_mid, s_rad), I.upper(s_mid, s_rad), s_mid)
    am, ar = I.from_bounds(a_lo, a_hi)
    return inv.astype(np.int64), np.ascontiguousarray(am), np.ascontiguousarray(ar)


def residual(prep: Prepared, tokens: np.ndarray) -> SparseInterval:
    """r at the last position for rows of ``tokens`` (n x p, weights' ids), enclosed.

    r = E[x_p] + P[p] + Σ_m (head m's output), each entry a sum of terms with a rounding
    bound (:func:`verifier.kernels.residual`).
    """
    w = prep.weights
    n, p = tokens.shape
    ids = np.ascontiguousarray(np.concatenate([np.full((n, 1), w.bos, np.int64), tokens], axis=1))  # (n, p+1)
    att, am, ar = attention(prep, ids)
    H = prep.n_heads
    OE, OP = prep.OE, prep.OP
    npos = w.P.shape[0]
    (Ep, Ei, Ev), (Pp, Pi, Pv) = prep.E_arrays, prep.P_arrays
    cap = K_.residual_bound(ids, Ep, Pp, OE.indptr, OP.indptr, H, prep.v_row, npos)
    yacc, ytouched = prep.scratch()["y"]
    stamp0 = prep.stamps(n)
    with np.errstate(invalid="ignore", over="ignore"):
        ptr, idx, mid, rad = K_.residual(ids, (att, am, ar), (Ep, Ei, Ev), (Pp, Pi, Pv),
                                        (OE.indptr, OE.indices, OE.mid, OE.rad), (OP.indptr, OP.indices, OP.mid, OP.rad),
                                        (H, prep.v_row, npos), (yacc, ytouched), stamp0, max(cap, 1))
    return SparseInterval((n, w.d), ptr, idx, mid, rad)


LOGITS_PER_RUN = 4_000_000
#: Watched neurons recorded per row (BatchResult.active); more are counted, not listed.
ACTIVE_SLOTS = 8


def _row_runs(bound: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Consecutive row ranges whose summed ``bound`` stays within ``limit`` (one row at least)."""
    if bound.size == 0 or int(bound.sum()) <= limit:
        return [(0, bound.size)]
    runs, a, total = [], 0, 0
    for i, c in enumerate(bound.tolist()):
        if total + c > limit and i > a:
            runs.append((a, i))
            a, total = i, 0
        total += c
    runs.append((a, bound.size))
    return runs


def gate_decisions(prep: Prepared, R: SparseInterval, scores: bool):
    """The gate's decisions (:func:`verifier.kernels.gate`): winner, margin, radius per row,
    top three, the experts that may win (CSR), and the (n, K) midpoints if ``scores``."""
    n, K = R.shape[0], len(prep.weights.experts)
    G = np.empty((n, K)) if scores else np.empty((1, 1))
    gmid, gstamp, gtouched = prep.scratch()["g"]
    with np.errstate(invalid="ignore", over="ignore"):
        out = K_.gate(R.indptr, R.indices, R.mid, R.rad, *prep.WGT_arrays, prep.wg_colmax, prep.wg_hot,
                      np.asarray(prep.weights.b_G, np.float64), prep.wg_max_terms,
                      gmid, gstamp, gtouched, prep.stamps(n), G, scores)
    return (*out, G if scores else None)


def run_batch(prep: Prepared | Weights, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
              ablate: np.ndarray | None = None, scores: bool = True) -> BatchResult:
    """Certified forward pass of a batch (n x p token ids, weights' ids; BOS is added).

    ``ablate`` (bool per row, default all) selects the rows whose ablated error is
    enclosed; the others get NaN there (the entanglement check needs object queries only).
    ``scores=False`` skips the full (n, K) gate midpoints (the result keeps the top three).
    """
    if isinstance(prep, Weights):
        prep = Prepared(prep)
    w = prep.weights
    tokens = np.asarray(tokens, np.int64)
    if tokens.ndim == 1:
        tokens = tokens[None, :]
    n = tokens.shape[0]
    V = prep.vocab_size
    R = residual(prep, tokens)
    scaled = w.gate_mode == "top1-scaled"
    want = scores or scaled
    e, margin, Grad, top, top_lo, top_hi, cand_ptr, cand, Gm = gate_decisions(prep, R, want)
    pair_rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(cand_ptr))
    pair_experts = cand
    if scaled:
        first, inv = _unique_rows(Gm, Grad[:, None])
        Gf, Rf = Gm[first], Grad[first][:, None]
        with np.errstate(invalid="ignore", over="ignore"):
            p_lo, p_hi = softmax_bounds(I.lower(Gf, Rf), I.upper(Gf, Rf), Gf)
        cm, cr = I.from_bounds(p_lo[inv][pair_rows, pair_experts], p_hi[inv][pair_rows, pair_experts])
    else:
        cm, cr = np.ones(pair_rows.size), np.zeros(pair_rows.size)
    sc = prep.scratch()
    vptr = np.asarray(valid_ptr, np.int64)
    vals = np.asarray(valid, np.int64)
    err_lo = np.full(n, np.inf)
    err_hi = np.full(n, -np.inf)
    rho_lo = np.full(n, np.inf)
    rho_hi = np.full(n, -np.inf)
    predicted = np.full(n, -1, np.int64)
    ab_lo, ab_hi = np.full(n, np.nan), np.full(n, np.nan)
    ab_rho_lo, ab_rho_hi = np.full(n, np.nan), np.full(n, np.nan)
    R_ACT = ACTIVE_SLOTS
    active = np.full((n, R_ACT + 1), -1, np.int64)
    active[:, R_ACT] = 0
    ablate = np.ones(n, bool) if ablate is None else np.asarray(ablate, bool)
    UT_ptr, UT_idx, UT_val = prep.UT_arrays
    # U·r for a run of rows at a time, so that memory stays bounded for any unembedding
    bound = K_.logits_bound(R.indptr, R.indices, UT_ptr)
    for a, b in _row_runs(bound, LOGITS_PER_RUN):
        Rc = R if (a, b) == (0, n) else R.rows(np.arange(a, b))
        vp, vv = take_csr(vptr, vals, np.arange(a, b))
        with np.errstate(invalid="ignore", over="ignore"):
            L = K_.logits(Rc.indptr, Rc.indices, Rc.mid, Rc.rad, UT_ptr, UT_idx, UT_val, *sc["L"],
                          prep.stamps(b - a), max(int(bound[a:b].sum()), 1))
            sel = (pair_rows >= a) & (pair_rows < b)
            n_sel = int(sel.sum())
            act = np.full((n_sel, R_ACT + 1), -1, np.int64)
            act[:, R_ACT] = 0
            lo, hi, pred, r_lo, r_hi = K_.experts(
                ((pair_rows[sel] - a).astype(np.int64), pair_experts[sel].astype(np.int64)),
                (np.ascontiguousarray(cm[sel]), np.ascontiguousarray(cr[sel])),
                (Rc.indptr, Rc.indices, Rc.mid, Rc.rad), L, prep.W1T, (prep.off, prep.b1, prep.pos_ptr, prep.pos_idx),
                prep.W2T, prep.UT_arrays, V, (vp, vv), (*sc["z"], *sc["y"], *sc["L"], sc["v"]),
                prep.stamps(n_sel), prep.watch, act)
            rows_sel = pair_rows[sel]
            np.minimum.at(err_lo, rows_sel, lo)
            np.maximum.at(err_hi, rows_sel, hi)
            np.fmin.at(rho_lo, rows_sel, r_lo)
            np.fmax.at(rho_hi, rows_sel, r_hi)
            bad_rho = ~(np.isfinite(r_lo) & np.isfinite(r_hi))
            rho_lo[rows_sel[bad_rho]] = np.nan                # any candidate without a ρ: none for the row
            routed = pair_experts[sel] == e[rows_sel]
            predicted[rows_sel[routed]] = pred[routed]
            active[rows_sel[routed]] = act[routed]
            ab = np.flatnonzero(ablate[a:b])
            if ab.size:
                ab_lo[a + ab], ab_hi[a + ab], ab_rho_lo[a + ab], ab_rho_hi[a + ab] = K_.ablated(
                    ab.astype(np.int64), *L, V, vp, vv, *sc["L"], sc["v"], prep.stamps(ab.size))
    undecided = ~np.isfinite(Grad)                     # the gate cannot say which expert wins
    err_lo[undecided], err_hi[undecided] = 0.0, 1.0
    rho_lo[undecided | ~np.isfinite(rho_lo)] = np.nan
    rho_hi[np.isnan(rho_lo)] = np.nan
    top_gate = (top, top_lo, top_hi)
    return BatchResult(e, margin, ~(margin > 0), Gm, Grad, err_lo, err_hi, ab_lo, ab_hi, predicted, top_gate,
                       (cand_ptr, cand), rho_lo, rho_hi, ab_rho_lo, ab_rho_hi, active)

