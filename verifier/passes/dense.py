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

    def __init__(self, weights: Weights, vocab_size: int | None = None, tables: bool = True) -> None:
        """``tables``: build the attention and residual tables (a deployed pass takes those
        stages from the plain pass instead: :class:`DeployedDensePass`)."""
        I.check_platform()
        D.check_blas()
        weights.validate()
        w = weights
        self.weights = w
        self.vocab_size = max(len(w.vocab), vocab_size or 0)
        if self.vocab_size != len(w.vocab):
            raise ValueError("the dense pass runs over the weights' whole vocabulary (no compact cut)")
        self.n_heads = len(w.heads)
        self.npos = w.P.shape[0]
        if tables:
            self._tables(w)
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

    def _tables(self, w: Weights) -> None:
        """1. The attention and residual tables (the module docstring)."""
        H = self.n_heads
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
            self.tab_w1 = D.up_nonneg_array(tab_r + D.up_nonneg_array(g * np.abs(tab_m)))     # vr + γ|vm|, rounded up
            self.tab_w2 = D.up_nonneg_array(np.abs(tab_m) + tab_r)                      # |vm| + vr, rounded up
        self.oe_off = np.arange(H, dtype=np.int64) * V1
        self.op_off = H * V1 + np.arange(H, dtype=np.int64) * npos
        self.e_off, self.p_off = H * (V1 + npos), H * (V1 + npos) + V1

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
            rad = D.up_nonneg_array(D.up_nonneg_array(D.up_nonneg_array(c * r1) + D.up_nonneg_array(c * r2))
                                    + 3.0 * T * D.FLOOR)
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
            yr = D.up_nonneg_array(D.up_nonneg_array(rr + orad) + D.up_nonneg_array(I.U * np.abs(ym)))
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
        return (*out, np.zeros(n, bool))   # the exact pass: a non-finite logit gives [0, 1] only

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
        if (tokens.size and (tokens.min() < 0 or tokens.max() > V)) \
                or (vals.size and (vals.min() < 0 or vals.max() >= V)) \
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
        undecided = ~(margin > -np.inf)                 # the gate decides nothing (+∞: one expert, decided)
        for k in np.unique(cand):
            sel = np.flatnonzero(cand == k)
            rows = pair_rows[sel]
            ym, yr, bad, extra = self.expert_output(int(k), rm[rows], rr[rows], None if cm is None else cm[sel],
                                                    None if cr is None else cr[sel], rows)
            vp, vv = _gather_csr(vptr, vals, rows)
            lo, hi, pred, _, _, unbounded = self.readout(ym, yr, vp, vv, no_target[:rows.size], extra)
            np.minimum.at(err_lo, rows, lo)
            np.maximum.at(err_hi, rows, hi)
            undecided[rows[bad | unbounded]] = True
            routed = e[rows] == k
            predicted[rows[routed]] = pred[routed]
        # a row an expert that may win gives a value a runtime may not compute (the deployed
        # pass: overflow) decides nothing, its gate included (a dense runtime spreads 0·∞)
        if self.deployed:
            margin = np.where(undecided, -np.inf, margin)
        err_lo[undecided], err_hi[undecided] = 0.0, 1.0
        ab_lo, ab_hi = np.full(n, np.nan), np.full(n, np.nan)
        ab_gap, ab_obj = np.full(n, np.nan), np.full(n, np.nan)
        ablate = np.ones(n, bool) if ablate is None else np.asarray(ablate, bool)
        ab = np.flatnonzero(ablate)
        if ab.size:
            vp, vv = _gather_csr(vptr, vals, ab)
            lo, hi, _, gap, obj, _ = self.readout(rm[ab], rr[ab], vp, vv, target[ab],
                                                  self.ablation_extra(rm[ab], rr[ab]))
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


class DeployedDensePass(DensePass):
    """The dense pass of every execution in a floating-point format (:mod:`verifier.passes.floating`).

    Attention and the residual are the plain deployed pass's (its tables and row kernels,
    :class:`verifier.passes.forward.Prepared` with the deployment: each query's residual is a
    sparse row of d entries, enclosing r̂ in every execution the execution model allows). From
    the residual on, every stage is a dense product (Lemma D) widened by the stage's rounding
    as :class:`verifier.passes.floating.Stages` gives it (the same terms the plain pass's kernels
    add, :mod:`verifier.arithmetic.kernels`), each magnitude Σ|w|·|x| being one more product of
    non-negative matrices, or folded into the radius's own (S = up(S_exact + up(ρ·(|xm| + xr))):
    one product then bounds both the exact pass's rounding and the stage's):

    * **gate**: ρ_g·Σ_j |W_G[k, j]|·|r̂_j| and ρ_g·|b_G[k]|, its floor and the inputs-read-as-zero
      allowance 2·e_min·(||r̂||_1 + Σ_j |W_G[k, j]|); a score or a partial sum that may reach the
      format's largest value makes the row undecided;
    * **experts**: z as the gate (ρ_z, f_z, 2·e_min·(||r̂||_1 + Σ|W_1 row|)); the output c·W_2·a
      with ρ_o and the gate scale's ρ_sc relative to Σ|W_2|·|c·a| <= |c|_max·Σ|W_2|·a_hi, its
      floors scaled by |c|, and W_2·a's own magnitude checked before the scale (top1-scaled);
    * **readout**: the logits of ŷ = fl(r̂ + ô) with the output sum's and the logits' rounding
      and allowances, and the output softmax by Lemma F2
      (:func:`verifier.arithmetic.dense.readout_deployed`); the ablated logits U·r̂ likewise without
      the output sum.

    A pair (row, expert that may win) with a value that may overflow makes its row undecided,
    margin and ablation included (F4, F5).
    """

    deployed = True

    def __init__(self, weights: Weights, vocab_size: int | None = None, deployment=None, stages=None) -> None:
        from layout.formats import round_weights
        from verifier.passes.floating import row_sums, softmax_constants
        from verifier.passes.forward import Prepared

        if deployment is None:
            raise ValueError("a deployed pass needs a deployment")
        self.dep = deployment
        self.plain = Prepared(weights, vocab_size=vocab_size, deployment=deployment, stages=stages)
        self.st = self.plain.deployed.stages
        w = round_weights(weights, deployment.fmt)
        super().__init__(w, vocab_size, tables=False)
        st = self.st
        self.sm = softmax_constants(self.vocab_size, deployment)
        self.rs_g = row_sums(w.W_G)
        self.rs_z = [row_sums(e.W_1) for e in w.experts]
        self.rs_2 = np.asarray(st.rs_2, np.float64)
        self.rs_l = np.ascontiguousarray(st.rs_l, np.float64)

    def residual(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The plain deployed pass's residual enclosures, as dense rows (an entry outside a
        row's pattern is exactly 0)."""
        from verifier.passes.forward import residual

        R = residual(self.plain, np.ascontiguousarray(ids[:, 1:]))
        rm, rr = R.dense()
        with np.errstate(invalid="ignore", over="ignore"):
            self._l1r = I.up(D.up_nonneg_array(np.abs(rm) + rr).sum(axis=1) * I.sum_factor(max(rm.shape[1], 1)))
        return rm, rr

    def _stage(self, Xm, Xr, B: D.Matrix, rho: float):
        """Lemma D's midpoint and radius of X·B with the stage's relative rounding folded in
        (module docstring), and an upper bound of the magnitudes Σ|B|·(|Xm| + Xr)."""
        k = B.terms
        g, c = I.gamma(k + 1), I.sum_factor(k)
        with np.errstate(invalid="ignore", over="ignore"):
            mid = D._times(Xm, B.B)
            ax = np.abs(Xm)
            S = D.up_nonneg_array(D.up_nonneg_array(I.up(1.0 + rho) * Xr) + D.up_nonneg_array(I.up(g + rho) * ax))
            rad = D.up_nonneg_array(D.up_nonneg_array(c * D._times(S, B.absB)) + 2.0 * (k + 1) * D.FLOOR)
            mag = D.up_nonneg_array(D.up_nonneg_array(c * D._times(D.up_nonneg_array(ax + Xr), B.absB))
                                    + 2.0 * (k + 1) * D.FLOOR)
        return mid, rad, mag

    def gate(self, rm: np.ndarray, rr: np.ndarray):
        st = self.st
        rho = st.rho_g
        mid, rad, mag = self._stage(rm, rr, self.WG, rho)
        with np.errstate(invalid="ignore", over="ignore"):
            gm = mid + self.bG
            b = np.abs(self.bG)
            gr = D.up_nonneg_array(rad + D.up_nonneg_array(I.U * np.abs(gm)))
            daz = D.up_nonneg_array(D.up_nonneg_array(2.0 * st.e_min)
                                    * D.up_nonneg_array(self._l1r[:, None] + self.rs_g[None, :]))
            gr = D.up_nonneg_array(gr + D.up_nonneg_array(D.up_nonneg_array(rho * b) + D.up_nonneg_array(st.f_g + daz)))
            rho1 = I.up(1.0 + rho)
            bad = ~(D.up_nonneg_array(rho1 * D.up_nonneg_array(np.abs(gm) + gr)) < st.largest)
            # every partial sum of the score
            bad |= ~(D.up_nonneg_array(rho1 * D.up_nonneg_array(mag + b)) < st.largest)
        gr = np.where(bad.any(axis=1)[:, None], np.inf, I.guard(gm, gr))
        return decide(gm, gr)

    def scale(self, gm: np.ndarray, gr: np.ndarray, rows: np.ndarray, experts: np.ndarray):
        from verifier.passes.floating import softmax as deployed_softmax

        with np.errstate(invalid="ignore", over="ignore"):
            p_lo, p_hi = deployed_softmax(I.lower(gm, gr), I.upper(gm, gr), gm, self.dep)
        return I.from_bounds(p_lo[rows, experts], p_hi[rows, experts])

    def expert_output(self, k: int, rm: np.ndarray, rr: np.ndarray, cm: np.ndarray | None, cr: np.ndarray | None,
                      rows: np.ndarray):
        st = self.st
        W1, b1, W2 = self.experts[k]
        l1r = self._l1r[rows]
        largest = st.largest
        with np.errstate(invalid="ignore", over="ignore"):
            # z = W_1 r̂ + b_1: the product's and the bias's rounding, floor, allowance
            mid, rad, mag = self._stage(rm, rr, W1, st.rho_z)
            zm = mid + b1
            b = np.abs(b1)
            zr = D.up_nonneg_array(rad + D.up_nonneg_array(I.U * np.abs(zm)))
            daz = D.up_nonneg_array(D.up_nonneg_array(2.0 * st.e_min)
                                    * D.up_nonneg_array(l1r[:, None] + self.rs_z[k][None, :]))
            zr = D.up_nonneg_array(zr + D.up_nonneg_array(D.up_nonneg_array(st.rho_z * b)
                                                          + D.up_nonneg_array(st.f_z + daz)))
            bad = ~(D.up_nonneg_array(I.up(1.0 + st.rho_z) * D.up_nonneg_array(mag + b)) < largest).any(axis=1)
            zr = I.guard(zm, zr)
            am, ar = D.relu(np.ascontiguousarray(zm), np.ascontiguousarray(zr))
            a_hi = D.up_nonneg_array(np.abs(am) + ar)
            l1a = I.up(a_hi.sum(axis=1) * I.sum_factor(max(a_hi.shape[1], 1)))
            # o = c·W_2·a: the exact enclosure, then the stages' rounding relative to |c|·Σ|W_2|·a_hi
            om, orad = D.product(am, ar, W2)
            k2 = W2.terms
            unscaled = D.up_nonneg_array(D.up_nonneg_array(I.sum_factor(k2) * D._times(a_hi, W2.absB))
                                         + 2.0 * (k2 + 1) * D.FLOOR)
            if cm is not None:
                orad = I.mul_rad(cm[:, None], cr[:, None], om, orad)
                om = cm[:, None] * om
                cmax = D.up_nonneg_array(np.abs(cm) + cr)[:, None]
                bad |= ~(D.up_nonneg_array(I.up(1.0 + st.rho_o) * unscaled) < largest).any(axis=1)   # W_2·a before c
            else:
                cmax = np.ones((om.shape[0], 1))
            rho_o = I.up(st.rho_o + I.up(st.rho_sc * I.up(1.0 + st.rho_o)))
            mag_o = D.up_nonneg_array(cmax * unscaled)
            daz_o = D.up_nonneg_array(D.up_nonneg_array(2.0 * st.e_min)
                                      * D.up_nonneg_array(l1a[:, None] + self.rs_2[None, :]))
            absolute = D.up_nonneg_array(D.up_nonneg_array(D.up_nonneg_array(cmax * D.up_nonneg_array(st.f_o + daz_o))
                                                           * I.up(1.0 + st.rho_sc))
                                         + st.f_sc)
            orad = D.up_nonneg_array(orad + D.up_nonneg_array(D.up_nonneg_array(rho_o * mag_o) + absolute))
            bad |= ~(D.up_nonneg_array(I.up(1.0 + rho_o) * mag_o) < largest).any(axis=1)
            orad = I.guard(om, orad)
            # ŷ = fl(r̂ + ô), and what its logits' rounding needs: per coordinate |r̂| + |ô|, ||ŷ||_1
            ym = rm + om
            yr = I.guard(ym, D.up_nonneg_array(D.up_nonneg_array(rr + orad) + D.up_nonneg_array(I.U * np.abs(ym))))
            Mv = D.up_nonneg_array(D.up_nonneg_array(np.abs(rm) + rr) + D.up_nonneg_array(np.abs(om) + orad))
            d = rm.shape[1]
            l1o = I.up(D.up_nonneg_array(np.abs(om) + orad).sum(axis=1) * I.sum_factor(max(d, 1)))
            l1y = D.up_nonneg_array(D.up_nonneg_array(I.up(1.0 + st.rho_y) * D.up_nonneg_array(l1r + l1o))
                                    + 2.0 * d * st.f_y)
        bad |= ~(np.isfinite(ym).all(axis=1) & np.isfinite(yr).all(axis=1))
        rho_L = I.up(st.rho_y + I.up(st.rho_l * I.up(1.0 + st.rho_y)))
        return ym, yr, bad, (Mv, l1y, rho_L, True)

    def ablation_extra(self, rm: np.ndarray, rr: np.ndarray):
        with np.errstate(invalid="ignore", over="ignore"):
            Mv = D.up_nonneg_array(np.abs(rm) + rr)
            l1 = I.up(Mv.sum(axis=1) * I.sum_factor(max(rm.shape[1], 1)))
        return (Mv, l1, self.st.rho_l, False)

    def readout(self, ym: np.ndarray, yr: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
                target: np.ndarray, extra=None) -> tuple[np.ndarray, ...]:
        """The deployed logits and their readout (:func:`verifier.arithmetic.dense.readout_deployed`):
        the radius product's inputs carry the stages' rounding, ρ·(|r̂| + |ô|) (``extra``)."""
        Mv, l1y, rho, with_sum = extra
        st, sm = self.st, self.sm
        cst = np.array([st.f_y, st.rho_l, st.f_l, st.e_min, 1.0 if with_sum else 0.0, st.largest, rho, *sm], np.float64)
        n = ym.shape[0]
        V = self.UT.shape[1]
        step = max(1, LOGITS_PER_RUN // max(V, 1))
        out = [np.empty(n), np.empty(n), np.empty(n, np.int64), np.empty(n), np.empty(n), np.empty(n, bool)]
        none = np.zeros((0, 0))
        for a in range(0, n, step):
            b = min(a + step, n)
            vp, vv = _take_csr(valid_ptr, valid, a, b)
            Lm, S, c, f = D.product_parts(ym[a:b], yr[a:b], self.UT)
            with np.errstate(invalid="ignore", over="ignore"):
                S = D.up_nonneg_array(S + D.up_nonneg_array(rho * Mv[a:b]))
            Lm = np.ascontiguousarray(Lm)
            with np.errstate(invalid="ignore"):
                live = np.count_nonzero(Lm >= Lm.max(axis=1, initial=-np.inf, keepdims=True) + (D.SKIP - 1.0))
            if live > LIVE * Lm.size:
                Lr = np.ascontiguousarray(D.finish(S, self.UT, c, f, Lm))
                args = (Lm, Lr, none, self.U_abs, self.U_max, c, f)
            else:
                args = (Lm, none, np.ascontiguousarray(S), self.U_abs, self.U_max, c, f)
            got = D.readout_deployed(*args, np.ascontiguousarray(Mv[a:b]), self.rs_l,
                                     np.ascontiguousarray(l1y[a:b], np.float64), cst, vp, vv,
                                     np.ascontiguousarray(target[a:b], np.int64), self._vstamp, D.EXP_LO, D.EXP_HI)
            for o, g in zip(out, got):
                o[a:b] = g
        return tuple(out)
