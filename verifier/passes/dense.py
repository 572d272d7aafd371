"""The certified forward pass of dense weights, stage by stage on whole batches (BLAS).

The pass of :mod:`verifier.passes.forward` follows each query row through compiled kernels
that touch only the entries a row reaches: right for the construction's models, whose
matrices are sparse, and slow for trained ones, where every entry is reached and each
product is enclosed term by term. This pass encloses the same exact forward pass
(:mod:`layout`) for a whole batch at a time, each matrix product in midpoint-radius form
on BLAS (Lemma D of :mod:`verifier.arithmetic.dense`: two ordinary products per interval
product), with the same meaning of every number it returns (:class:`BatchResult`):

1. **Tables** (once): per token and per position, each head's query and key projections
   and its value rows W_O·W_V·E[x], W_O·W_V·P[j] (Lemma D on the exact E and P).
2. **Attention**: the scores and softmax enclosures of every head at the last position,
   from those tables (:func:`verifier.arithmetic.dense.attention`, compiled, row by row).
3. **Residual**: r = E[x_p] + P[p] + Σ_m Σ_j a_mj·(W_O W_V E[x_j] + W_O W_V P[j]), every
   row's terms gathered into a sparse matrix A of attention weights against one table of
   value rows, so that r is three sparse-by-dense products (:meth:`DensePass.residual`).
4. **Gate**: g = W_G·r + b_G (Lemma D); the winner (largest midpoint), the certified margin,
   the experts that may win (whose upper end reaches the winner's lower end) and, for the
   scaled gate, the enclosure of softmax(g)_e.
5. **Experts**: for each (row, expert that may win), z = W_1·r + b_1, ReLU, W_2·a (Lemma D
   on an interval input), y = r + c·W_2·a.
6. **Readout**: the logits U·y (Lemma D) and their error enclosure
   (:func:`verifier.arithmetic.dense.readout`); the reported enclosure is the worst over the
   experts that may win, as in the plain pass.
7. **Ablation**: the logits U·r of the rows asked for, their error, the L2 gap and the lower
   end of 1 − P(o) for the row's target o (:func:`verifier.arithmetic.dense.readout`).

A row with a non-finite enclosure anywhere decides nothing (error [0, 1], margin −∞). The
enclosures differ from the plain pass's in the last digits (the same exact values, other
rounding bounds); both contain the exact values (property tests against the 60-digit
oracle). Not computed here: the probability of a zero logit (ρ, NaN) and the exact count of
zero logits (−1), which only a certificate of a construction's model records, and the
neurons that may fire (none): query classes are recorded by the plain pass. Which weights
take this pass: :func:`is_dense`.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from layout import Weights
from verifier.arithmetic import dense as D
from verifier.arithmetic import interval as I
from verifier.passes.forward import BatchResult

#: Logit entries (rows × tokens) computed at a time: bounds the memory of the readout.
LOGITS_PER_RUN = 2_000_000
#: The share of a run's logits near their rows' tops above which the readout's radii are
#: computed by a second product rather than one by one (:meth:`DensePass.readout`).
LIVE = 0.125


def is_dense(weights: Weights) -> bool:
    """Whether ``weights`` take the dense pass: its unembedding and its experts store at least
    :data:`verifier.arithmetic.dense.DENSE` of their entries (a trained model; the
    construction's are far sparser), and a batch's residual rows (d wide) are small enough to
    hold densely (d at most 4096)."""
    if weights.d > 4096 or not weights.experts:
        return False
    blocks = [weights.U] + [m for e in weights.experts for m in (e.W_1, e.W_2)]
    stored = sum(m.nnz for m in blocks)
    size = sum(m.shape[0] * m.shape[1] for m in blocks)
    return size > 0 and stored >= D.DENSE * size


class DensePass:
    """The dense pass's tables for fixed weights (module docstring); ``run_batch`` is the
    pass protocol (:class:`verifier.running.runner.Pass`)."""

    def __init__(self, weights: Weights, vocab_size: int | None = None) -> None:
        I.check_platform()
        D.check_blas()
        weights.validate()
        w = weights
        self.weights = w
        self.vocab_size = max(len(w.vocab), vocab_size or 0)
        if self.vocab_size != len(w.vocab):
            raise ValueError("the dense pass runs over the weights' whole vocabulary (no compact cut)")
        H, d = len(w.heads), w.d
        self.n_heads = H
        E = D.Matrix.of(w.E).B
        P = D.Matrix.of(w.P).B
        E = E.toarray() if sp.issparse(E) else E
        P = P.toarray() if sp.issparse(P) else P
        V1, npos = E.shape[0], P.shape[0]
        self.npos = npos
        # 1. tables: queries and keys of every head side by side (head m owns starts[m] .. + widths[m])
        self.widths = np.array([h.W_Q.shape[0] for h in w.heads], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.widths)[:-1]]).astype(np.int64)
        if H:
            WQ = D.Matrix.of(sp.vstack([h.W_Q for h in w.heads]).T)
            WK = D.Matrix.of(sp.vstack([h.W_K for h in w.heads]).T)
            self.QE, self.QP = D.product(E, None, WQ), D.product(P, None, WQ)
            self.KE, self.KP = D.product(E, None, WK), D.product(P, None, WK)
        else:
            z = np.zeros((V1, 0)), np.zeros((npos, 0))
            self.QE = self.KE = (z[0], z[0])
            self.QP = self.KP = (z[1], z[1])
        # value rows W_O W_V E[x] and W_O W_V P[j] per head, then E and P themselves: one table
        mids, rads = [], []
        for X in (E, P):
            for h in w.heads:
                vm, vr = D.product(X, None, D.Matrix.of(h.W_V.T))
                om, orad = D.product(vm, vr, D.Matrix.of(h.W_O.T))
                mids.append(om)
                rads.append(orad)
        tab_m = np.concatenate(mids + [E, P]) if H else np.concatenate([E, P])
        tab_r = np.concatenate(rads + [np.zeros_like(E), np.zeros_like(P)]) if H else np.zeros_like(tab_m)
        #: the most terms of a residual entry: E[x_p], P[p] and two value rows per head and position
        self.terms = 2 * H * npos + 2
        g = I.gamma(self.terms + 1)
        with np.errstate(invalid="ignore", over="ignore"):
            self.tab_m = np.ascontiguousarray(tab_m)
            self.tab_w1 = D.up_nonneg(tab_r + D.up_nonneg(g * np.abs(tab_m)))     # vr + γ|vm|, rounded up
            self.tab_w2 = D.up_nonneg(np.abs(tab_m) + tab_r)                      # |vm| + vr, rounded up
        self.oe_off = np.arange(H, dtype=np.int64) * V1
        self.op_off = H * V1 + np.arange(H, dtype=np.int64) * npos
        self.e_off, self.p_off = H * (V1 + npos), H * (V1 + npos) + V1
        # 4.-7. the gate, the experts, the unembedding
        self.WG = D.Matrix.of(w.W_G.T)
        self.bG = np.asarray(w.b_G, np.float64)
        self.experts = [(D.Matrix.of(e.W_1.T), np.asarray(e.b_1, np.float64), D.Matrix.of(e.W_2.T)) for e in w.experts]
        self.UT = D.Matrix.of(w.U.T)
        #: |U| by token and each token's largest |U_tj| (the readout's radii, finished lazily)
        self.U_abs = np.ascontiguousarray(np.abs(w.U.toarray()))
        self.U_max = self.U_abs.max(axis=1, initial=0.0)
        self.scaled = w.gate_mode == "top1-scaled"
        self.bos = w.bos
        self._vstamp = np.zeros(max(len(w.vocab), 1), np.int64)
        self._blas = None                   # a threadpoolctl controller, made on the first batch
        self.weights = w.frame()

    # --- stages ---------------------------------------------------------------------------------

    def residual(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The residual enclosures (n × d) at the last position of the rows ``ids`` (BOS first).

        With a_k the attention enclosures and v_k the value rows' (k over heads and
        positions, and E[x_p], P[p] with weight exactly 1), r = Σ_k a_k·v_k, T terms. Its
        midpoint is the float sum fl(Σ am_k·vm_k) (a sparse product, any order: (A3)), and
        |r − fl(Σ am_k vm_k)| <= Σ_k |am_k|·(vr_k + γ_T|vm_k|) + ar_k·(|vm_k| + vr_k) + T·η
        (the products' radii and Lemma 2); each of the two sums of non-negative terms is a
        sparse product with tables rounded up (``tab_w1``, ``tab_w2``), bounded by Lemma 2
        as c_T·fl(·) + T·η."""
        n, p1 = ids.shape
        p = p1 - 1
        H = self.n_heads
        cols, vals_m, vals_r = [], [], []
        if H:
            a_m, a_r = D.attention(ids, *self.QE, *self.QP, *self.KE, *self.KP, self.starts, self.widths,
                                   D.EXP_LO, D.EXP_HI)                  # (n, H, p+1)
            for m in range(H):
                cols.append(self.oe_off[m] + ids)                       # W_O W_V E[x_j]
                cols.append(np.broadcast_to(self.op_off[m] + np.arange(p1), (n, p1)))   # W_O W_V P[j]
                vals_m += [a_m[:, m, :], a_m[:, m, :]]
                vals_r += [a_r[:, m, :], a_r[:, m, :]]
        cols += [self.e_off + ids[:, p:], np.full((n, 1), self.p_off + p, np.int64)]
        vals_m += [np.ones((n, 1)), np.ones((n, 1))]
        vals_r += [np.zeros((n, 1)), np.zeros((n, 1))]
        C = np.concatenate(cols, axis=1)
        width = C.shape[1]
        ptr = np.arange(0, n * width + 1, width, dtype=np.int64)
        shape = (n, self.tab_m.shape[0])
        Am = sp.csr_matrix((np.concatenate(vals_m, axis=1).ravel(), C.ravel(), ptr), shape=shape)
        Ar = sp.csr_matrix((np.concatenate(vals_r, axis=1).ravel(), C.ravel(), ptr), shape=shape)
        T = width
        c = I.sum_factor(T)
        with np.errstate(invalid="ignore", over="ignore"):
            mid = np.asarray(Am @ self.tab_m)
            r1 = np.asarray(abs(Am) @ self.tab_w1)
            r2 = np.asarray(Ar @ self.tab_w2)
            rad = D.up_nonneg(D.up_nonneg(D.up_nonneg(c * r1) + D.up_nonneg(c * r2)) + 3.0 * T * D.FLOOR)
        if T > self.terms:
            raise AssertionError("a residual entry has more terms than its tables' rounding allows")
        return mid, I.guard(mid, rad)

    def gate(self, rm: np.ndarray, rr: np.ndarray):
        """The gate scores' enclosures and decisions: (winner, margin, scores mid, scores rad,
        top three (ids, lo, hi), candidates CSR (ptr, experts))."""
        gm, gr = D.product(rm, rr, self.WG)
        return decide(*D.add_exact(gm, gr, self.bG))

    def scale(self, gm: np.ndarray, gr: np.ndarray, rows: np.ndarray, experts: np.ndarray):
        """The gate scale c = softmax(g)_e of each (row, expert) pair, enclosed (top1-scaled)."""
        with np.errstate(invalid="ignore", over="ignore"):
            p_lo, p_hi = I.softmax_bounds(I.lower(gm, gr), I.upper(gm, gr), gm)
        return I.from_bounds(p_lo[rows, experts], p_hi[rows, experts])

    def expert_output(self, k: int, rm: np.ndarray, rr: np.ndarray, cm: np.ndarray | None, cr: np.ndarray | None,
                      rows: np.ndarray):
        """y = r + c·W_2 ReLU(W_1 r + b_1) for expert k on rows (rm, rr); c = 1 when ``cm`` is None.
        Returns (ym, yr, the rows a runtime may find no finite value for (none here: the exact
        pass reads a non-finite enclosure as unbounded), what the readout of y needs besides)."""
        W1, b1, W2 = self.experts[k]
        zm, zr = D.add_exact(*D.product(rm, rr, W1), b1)
        am, ar = D.relu(np.ascontiguousarray(zm), np.ascontiguousarray(zr))
        om, orad = D.product(am, ar, W2)
        if cm is not None:
            with np.errstate(invalid="ignore", over="ignore"):
                orad = I.mul_rad(cm[:, None], cr[:, None], om, orad)
                om = cm[:, None] * om
        with np.errstate(invalid="ignore", over="ignore"):
            ym = rm + om
            yr = D.up_nonneg(D.up_nonneg(rr + orad) + D.up_nonneg(I.U * np.abs(ym)))
        return ym, I.guard(ym, yr), np.zeros(ym.shape[0], bool), None

    def readout(self, ym: np.ndarray, yr: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
                target: np.ndarray, extra=None) -> tuple[np.ndarray, ...]:
        """Logits U·y and their readout (:func:`verifier.arithmetic.dense.readout`), a run of
        rows at a time: (error lo, error hi, argmax token, L2 gap, lower end of 1 − P(o)).

        The logits' radii are finished by a second product when many tokens of the run lie
        near its rows' tops (more than :data:`LIVE` of them within :data:`~verifier.arithmetic.dense.SKIP`
        of the largest midpoint, plus one): then almost every radius is needed. Otherwise the
        readout finishes only the radii it needs (a trained model's logits with its expert's
        output: a few tokens near the top, the rest far below). Either way every radius used is
        Lemma D's; the choice only decides where it is computed."""
        n = ym.shape[0]
        V = self.UT.shape[1]
        step = max(1, LOGITS_PER_RUN // max(V, 1))
        out = [np.empty(n), np.empty(n), np.empty(n, np.int64), np.empty(n), np.empty(n)]
        none = np.zeros((0, 0))
        for a in range(0, n, step):
            b = min(a + step, n)
            vp, vv = _take_csr(valid_ptr, valid, a, b)
            Lm, S, c, f = D.product_parts(ym[a:b], yr[a:b], self.UT)
            Lm = np.ascontiguousarray(Lm)
            with np.errstate(invalid="ignore"):
                live = np.count_nonzero(Lm >= Lm.max(axis=1, initial=-np.inf, keepdims=True) + (D.SKIP - 1.0))
            if live > LIVE * Lm.size:
                Lr = D.finish(S, self.UT, c, f, Lm)
                args = (Lm, np.ascontiguousarray(Lr), none, none, np.zeros(0), 0.0, 0.0)
            else:
                args = (Lm, none, np.ascontiguousarray(S), self.U_abs, self.U_max, c, f)
            got = D.readout(*args, vp, vv, np.ascontiguousarray(target[a:b], np.int64), self._vstamp,
                            D.EXP_LO, D.EXP_HI)
            for o, g in zip(out, got):
                o[a:b] = g
        return tuple(out)

    # --- the pass ---------------------------------------------------------------------------------

    def run_batch(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
                  ablate: np.ndarray | None = None, scores: bool = True,
                  target: np.ndarray | None = None) -> BatchResult:
        """The certified pass over a batch (n × p token ids, the weights' ids; BOS is added):
        the pass protocol, with the meaning :func:`verifier.passes.forward.run_batch` gives it."""
        tokens = np.asarray(tokens, np.int64)
        if tokens.ndim == 1:
            tokens = tokens[None, :]
        n = tokens.shape[0]
        V = len(self.weights.vocab)
        vptr = np.asarray(valid_ptr, np.int64)
        vals = np.asarray(valid, np.int64)
        target = np.full(n, -1, np.int64) if target is None else np.ascontiguousarray(target, np.int64)
        if (tokens.size and (tokens.min() < 0 or tokens.max() > V)) or (vals.size and (vals.min() < 0 or vals.max() >= V)) \
                or (target.size and target.max() >= V) or target.size != n or tokens.shape[1] + 1 > self.npos \
                or vptr.size != n + 1 or (n and (vptr[0] != 0 or vptr[-1] != vals.size or (np.diff(vptr) < 0).any())):
            raise ValueError("tokens (BOS included), valid next tokens and targets must be token ids of the weights, "
                             "the valid ones in a CSR of one row per query, within the weights' positions")
        ids = np.ascontiguousarray(np.concatenate([np.full((n, 1), self.bos, np.int64), tokens], axis=1))
        if self._blas is None:
            from threadpoolctl import ThreadpoolController

            self._blas = ThreadpoolController()
        # one BLAS thread: a worker process is one job (--jobs), and a row's products are then
        # the same sums in the same order whatever else the machine runs
        with self._blas.limit(limits=1, user_api="blas"):
            return self._run(n, ids, vptr, vals, ablate, scores, target)

    def _run(self, n, ids, vptr, vals, ablate, scores, target) -> BatchResult:
        rm, rr = self.residual(ids)
        e, margin, gm, gr, top, (cand_ptr, cand) = self.gate(rm, rr)
        pair_rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(cand_ptr))
        cm = cr = None
        if self.scaled:
            cm, cr = self.scale(gm, gr, pair_rows, cand)
        err_lo, err_hi = np.full(n, np.inf), np.full(n, -np.inf)
        predicted = np.full(n, -1, np.int64)
        no_target = np.full(pair_rows.size, -1, np.int64)
        undecided = ~np.isfinite(margin)                # the gate decides nothing
        for k in np.unique(cand):
            sel = np.flatnonzero(cand == k)
            rows = pair_rows[sel]
            ym, yr, bad, extra = self.expert_output(int(k), rm[rows], rr[rows], None if cm is None else cm[sel],
                                                    None if cr is None else cr[sel], rows)
            vp, vv = _gather_csr(vptr, vals, rows)
            lo, hi, pred, _, _ = self.readout(ym, yr, vp, vv, no_target[:rows.size], extra)
            np.minimum.at(err_lo, rows, lo)
            np.maximum.at(err_hi, rows, hi)
            undecided[rows[bad]] = True
            routed = e[rows] == k
            predicted[rows[routed]] = pred[routed]
        # a row an expert that may win gives a value a runtime may not compute (the deployed
        # pass: overflow) decides nothing, its gate included (a dense runtime spreads 0·∞)
        margin = np.where(undecided & np.isfinite(margin) & ~np.isfinite(gr).all(axis=1), -np.inf, margin)
        if self.deployed:
            margin = np.where(undecided, -np.inf, margin)
        err_lo[undecided], err_hi[undecided] = 0.0, 1.0
        ab_lo, ab_hi = np.full(n, np.nan), np.full(n, np.nan)
        ab_gap, ab_obj = np.full(n, np.nan), np.full(n, np.nan)
        ablate = np.ones(n, bool) if ablate is None else np.asarray(ablate, bool)
        ab = np.flatnonzero(ablate)
        if ab.size:
            vp, vv = _gather_csr(vptr, vals, ab)
            lo, hi, _, gap, obj = self.readout(rm[ab], rr[ab], vp, vv, target[ab], self.ablation_extra(rm[ab], rr[ab]))
            ab_lo[ab], ab_hi[ab] = lo, hi
            has = target[ab] >= 0
            ab_gap[ab[has]], ab_obj[ab[has]] = gap[has], obj[has]
        if self.deployed:                               # (F5): a row whose gate decides nothing ablates nothing
            sel = undecided & ablate
            ab_lo[sel], ab_hi[sel] = 0.0, 1.0
            ab_gap[sel & (target >= 0)] = -np.inf
            ab_obj[sel & (target >= 0)] = 0.0
        nan = np.full(n, np.nan)
        grad = gr.max(axis=1, initial=0.0) if gr.size else np.zeros(n)
        return BatchResult(e, margin, ~(margin > 0), gm if scores else None, grad, err_lo, err_hi, ab_lo, ab_hi,
                           predicted, top, (cand_ptr, cand), nan, nan.copy(), nan.copy(), nan.copy(), None, ab_gap,
                           np.full(n, -1, np.int64), ab_obj)

    deployed = False

    def ablation_extra(self, rm: np.ndarray, rr: np.ndarray):
        """What the readout of the ablated logits U·r needs besides r (nothing here)."""
        return None


def decide(gm: np.ndarray, gr: np.ndarray):
    """The gate's decisions from its scores' enclosures [gm ± gr] (n × K): the winner (the
    largest midpoint, the first of equal ones), the certified margin (the winner's lower end
    minus the others' largest upper end, rounded down; +∞ with one expert, −∞ where a score is
    not finite), the scores, the top three experts with their ends, and as CSR the experts that
    may win (whose upper end reaches the winner's lower end; the winner alone where nothing is
    decided)."""
    n, K = gm.shape
    lo, hi = I.lower(gm, gr), I.upper(gm, gr)
    finite = np.isfinite(gm).all(axis=1) & np.isfinite(gr).all(axis=1)
    e = np.argmax(gm, axis=1) if K else np.zeros(n, np.int64)
    rows = np.arange(n)
    lo_e = lo[rows, e]
    others = hi.copy()
    others[rows, e] = -np.inf
    top_other = others.max(axis=1) if K > 1 else np.full(n, -np.inf)
    with np.errstate(invalid="ignore"):
        margin = np.where(top_other == -np.inf, np.inf, I.down(lo_e - top_other))
    margin = np.where(finite, margin, -np.inf)
    may = (hi >= lo_e[:, None]) & finite[:, None]
    may[rows, e] = True
    cand_ptr = np.concatenate([[0], np.cumsum(may.sum(axis=1))]).astype(np.int64)
    cand = np.nonzero(may)[1].astype(np.int64)
    order = np.argsort(-gm, axis=1, kind="stable")[:, :3]
    top = np.full((n, 3), -1, np.int64)
    top_lo = np.full((n, 3), -np.inf)
    top_hi = np.full((n, 3), np.inf)
    k3 = order.shape[1]
    top[:, :k3] = order
    top_lo[:, :k3] = np.take_along_axis(lo, order, axis=1)
    top_hi[:, :k3] = np.take_along_axis(hi, order, axis=1)
    return e.astype(np.int64), margin, gm, gr, (top, top_lo, top_hi), (cand_ptr, cand)


def _take_csr(ptr: np.ndarray, vals: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows a..b of a CSR, renumbered from 0."""
    return np.ascontiguousarray(ptr[a:b + 1] - ptr[a]), np.ascontiguousarray(vals[ptr[a]:ptr[b]])


def _gather_csr(ptr: np.ndarray, vals: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from verifier.passes.batches import take_csr

    p, v = take_csr(ptr, vals, np.asarray(rows, np.int64))
    return np.ascontiguousarray(p, np.int64), np.ascontiguousarray(v, np.int64)
