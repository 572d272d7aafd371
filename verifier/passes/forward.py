"""The certified forward pass: every quantity enclosed, vectorised over a batch.

A batch is n prefixes of one length p (token ids, BOS prepended here). For each row
the pass returns enclosures of the gate scores, the routing decision with its
certified margin, and the error 1 − P(valid) of the next-token distribution, for the
model and for the model with the routed expert's output removed (ablation). The
equations are those of :mod:`layout`; the arithmetic is :mod:`verifier.arithmetic.interval`
(mid-radius, every radius rounded upward, enclosed exp), carried out per row by the
compiled kernels of :mod:`verifier.arithmetic`, one module per stage.

Stages of :func:`run_batch`:

1. **Attention** (numpy): per head, the score intervals and softmax enclosures, once per
   distinct row of token classes (rows whose tokens have identical projections share
   them); every head and position in the same array operations.
2. **Residual** (:func:`verifier.arithmetic.residual.residual`): E[x_p] + P[p] + each head's value
   rows scaled by its attention intervals, summed per entry.
3. **Gate** (:func:`verifier.arithmetic.gate.gate`): scores and one radius per row; the routed
   expert, the certified margin, and every expert that may still win.
4. **Experts and error** (:func:`verifier.arithmetic.experts.experts`): for each (row, expert that
   may win), W_1·r + b_1, ReLU, y = r + c·W_2·a, the logits U·y and the error enclosure;
   the reported enclosure is the worst over the experts that may win.
5. **Ablation** (:func:`verifier.arithmetic.logits.ablated`): the error of softmax(U·r), and
   for a row with a target token o (an object query's object) a lower bound of
   max_{t != o} z_t − z_o over z = U·r (the localization check's L2) and a lower end of
   1 − P(o) for o alone (its L1).

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

from layout import Weights
from verifier.arithmetic import interval as I
from verifier.arithmetic import experts as experts_k
from verifier.arithmetic import gate as gate_k
from verifier.arithmetic import logits as logits_k
from verifier.arithmetic import residual as residual_k
from verifier.arithmetic import rounding
from verifier.arithmetic.interval import SparseInterval, softmax_bounds
from verifier.passes.batches import take_csr
from verifier.passes.tables import LayerTables, csr_arrays
from verifier.arithmetic.deployed import KERNEL_CONSTANTS
from verifier.passes.floating import Deployment, softmax_constants
from verifier.passes.floating import softmax as deployed_softmax
from verifier.passes.floating import stages as stages_of


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
    #: (rho) and with it removed (ablated_rho); NaN where not computed (logits.error_enclosure)
    rho_lo: np.ndarray | None = None
    rho_hi: np.ndarray | None = None
    ablated_rho_lo: np.ndarray | None = None
    ablated_rho_hi: np.ndarray | None = None
    #: (n, R + 1): watched neurons of the routed expert that may be on (Prepared.watch), and
    #: in the last column how many there were (more than R: the list is incomplete)
    active: np.ndarray | None = None
    #: (n,) with the routed expert's output removed, a certified lower bound of
    #: max_{t != o} z_t − z_o for the row's target token o (>= 0: o is not the strict top
    #: token); NaN where no target was given, −∞ where nothing is decided
    ablated_gap: np.ndarray | None = None
    #: (n,) the number of tokens other than o whose ablated logit is exactly 0 (−1: no target);
    #: a saved certificate needs it when tokens are added or removed (incremental)
    ablated_zeros: np.ndarray | None = None
    #: (n,) with the routed expert's output removed, a lower end of 1 − P(o) for the row's
    #: target token o alone (L1 bounds P(o), which may be far below the valid set's mass);
    #: NaN where no target was given
    ablated_object_lo: np.ndarray | None = None

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
                           pick(self.active), pick(self.ablated_gap), pick(self.ablated_zeros),
                           pick(self.ablated_object_lo))

    def compact(self) -> "BatchResult":
        """Without the full (n, K) gate enclosures (kept: the top three per row)."""
        return BatchResult(self.expert, self.margin, self.ambiguous, None, None, self.err_lo, self.err_hi,
                           self.ablated_lo, self.ablated_hi, self.predicted, self.top_gate, None,
                           self.rho_lo, self.rho_hi, self.ablated_rho_lo, self.ablated_rho_hi, self.active,
                           self.ablated_gap, self.ablated_zeros, self.ablated_object_lo)


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


class Prepared:
    """Per-weights interval projections (computed once, reused by every batch).

    Attention tables are stored per token *class*: tokens whose query and key projections
    are bitwise equal (in every head) share one class and one table row, and so do
    tokens whose value rows W_O W_V E[x] are equal in a head. The projections are
    computed ``TOKEN_CHUNK`` tokens at a time, so neither the tables nor their
    computation hold a row per token beyond the class maps. Sharing a row between equal
    rows changes no value, so every enclosure is the one computed for each token.
    """

    def __init__(self, weights: Weights, gate_terms: int = 0, vocab_size: int | None = None,
                 deployment=None, stages=None) -> None:
        """``gate_terms``: a lower limit for the longest gate row used in the rounding bound
        (a shard of larger weights passes theirs, so that its enclosures are theirs bit for
        bit; a larger count only widens the bound). ``vocab_size``: the number of tokens the
        output softmax runs over, if more than the weights' rows (a compact shard,
        :class:`verifier.running.shards.Compact`: the missing tokens have logit exactly 0).
        ``deployment`` (:class:`verifier.passes.floating.Deployment`): enclose every execution in
        that floating-point format instead of the exact pass (the weights as deployed,
        rounded to the format; each stage's rounding added to its enclosure:
        :class:`Deployed`); ``stages``: its :class:`verifier.passes.floating.Stages` when they are a
        larger model's (a cut of the weights passes the full weights', mapped to its own
        numbering, so that its enclosures are theirs bit for bit), else computed here."""
        I.check_platform()
        weights.validate()
        self.dep = deployment
        if deployment is not None:
            from layout.formats import round_weights

            weights = round_weights(weights, deployment.fmt)
        self.weights = weights
        self.vocab_size = max(len(weights.vocab), vocab_size or 0)
        d, V1, H = weights.d, weights.E.shape[0], len(weights.heads)
        self.n_heads = H
        P = I.exact(weights.P)
        # W_Q^T, W_K^T, W_V^T (d rows) kept by the rows they read (interval.Thin): nothing of
        # size d per head; W_O^T has a row per value direction, few
        WQ = [I.Thin.transpose_of(h.W_Q) for h in weights.heads]
        WK = [I.Thin.transpose_of(h.W_K) for h in weights.heads]
        WV = [I.Thin.transpose_of(h.W_V) for h in weights.heads]
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

        deployed = deployment is not None
        # |W| for the deployed pass's magnitudes only
        absWQ, absWK = ([W.abs() for W in WQ], [W.abs() for W in WK]) if deployed else ([], [])
        absWV, absWO = ([W.abs() for W in WV], [abs(W) for W in WO]) if deployed else ([], [])

        def magnitudes(rows: sp.csr_matrix) -> tuple:
            """The deployed pass's class columns of E rows: |W_Q||E[x]|, |W_K||E[x]| (the heads
            side by side), ||E[x]||_1 and its entry count (:class:`Deployed`)."""
            absX = I.exact(abs(rows))
            cat = lambda Ws: (np.concatenate([I.upper(*I.matmul(absX, W).dense()) for W in Ws], axis=1)  # noqa: E731
                              if Ws else np.zeros((rows.shape[0], 0)))
            l1 = I.up(np.asarray(abs(rows).sum(axis=1)).reshape(-1, 1) * I.sum_factor(max(d, 1)))
            return cat(absWQ), cat(absWK), l1, np.diff(rows.indptr).astype(np.float64).reshape(-1, 1)

        qp = qk(P)
        self.QP, self.KP = qp[:2], qp[2:]                    # (positions, Σd_h) mid, rad
        self.OP = I.vstack([I.matmul(I.matmul(P, WV[m]), WO[m]) for m in range(H)]) if H else _empty(d)
        # Per token: its query/key class and, per head, its value row (for the deployed pass,
        # the magnitudes it adds are part of each class and each value row: tokens share one
        # only if those agree too, so a cut of the weights has the full weights' classes).
        qk_table, v_table, vm_table = _RowTable(), _RowTable(), _RowTable()
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
        # the residual directions the query and key maps read (a token's projections are a
        # function of its embedding there: computed once per distinct such part, _by_distinct)
        qk_read = np.unique(np.concatenate([W.rows for W in WQ + WK] + [np.zeros(0, np.int64)]))
        for a in range(0, n if H else 0, TOKEN_CHUNK):
            b = min(a + TOKEN_CHUNK, n)
            if deployed:                    # (the magnitudes read the whole row: ||E[x]||_1)
                table = np.concatenate(qk(I.exact(E_todo[a:b])) + magnitudes(E_todo[a:b]), axis=1)
            else:
                part, which = _by_distinct(E_todo[a:b], qk_read, lambda X: np.concatenate(qk(I.exact(X)), axis=1))
                table = part[which]
            table = np.ascontiguousarray(table)
            first, inv = _unique_rows(table)
            keys = [table[f].tobytes() for f in first]
            qk_class[todo[a:b]] = qk_table.add(keys, lambda new: table[first[new]])[inv]
        last = (None, None)                              # the last distinct rows found, and the columns they read
        for m in range(H):
            # Every token's value row W_O W_V E[x] in one product per head: scipy's sparse
            # product costs time in the number of output columns (d) per call, so a call
            # per chunk of tokens would cost d per chunk. Each output row depends on its
            # own input row only, so the rows are those a product per chunk gives.
            # (each value row is a function of the token's embedding where W_V reads it alone:
            # computed once per distinct such part, _by_distinct)
            # (heads whose W_V reads the same columns share the distinct rows: found once)
            O_all = M_all = O_classes = None
            if n:
                read = WV[m].rows
                if last[0] is None or not np.array_equal(last[0], read):
                    last = (read, _distinct_rows(E_todo, read))
                part, which = _by_distinct(E_todo, read,
                                           lambda X: I.matmul(I.matmul(I.exact(X), WV[m]), WO[m]), last[1])
                O_all = part.rows(which)
                O_classes = _repeated_row_classes(part, which)
            if n and deployed:              # the deployed pass's |W_O||W_V||E[x]| on the same (structural) pattern
                part, which = _by_distinct(E_todo, WV[m].rows,
                                           lambda X: I.matmul(I.matmul(I.exact(abs(X)), absWV[m]), absWO[m]), last[1])
                M_all = part.rows(which)
            for a in range(0, n, TOKEN_CHUNK):
                b = min(a + TOKEN_CHUNK, n)
                whole = (a, b) == (0, n)
                O = O_all.rows(np.arange(a, b)) if not whole else O_all
                M = (M_all.rows(np.arange(a, b)) if not whole else M_all) if deployed else None
                cls = O_classes if whole and O_classes is not None else _sparse_row_classes(O)
                if deployed:
                    cls = _unique_rows(cls[:, None], _sparse_row_classes(M)[:, None])[1]
                first, inv = np.unique(cls, return_index=True, return_inverse=True)[1:]
                if 2 * first.size > O.shape[0]:
                    ids = v_table.append(O, O.shape[0])
                    if deployed:
                        vm_table.append(M, M.shape[0])
                    v_row[m, todo[a:b]] = ids
                else:
                    rows = O.rows(first)
                    mrows = M.rows(first) if deployed else None
                    keys = [_sparse_row_bytes(rows, i) + (_sparse_row_bytes(mrows, i) if deployed else b"")
                            for i in range(first.size)]
                    v_row[m, todo[a:b]] = v_table.add(keys, rows.rows)[inv.reshape(-1)]
                    if deployed:
                        vm_table.add(keys, mrows.rows)
            del O_all, M_all
        del last
        if n < V1:
            stand_in = todo[np.flatnonzero(empty[todo])[0]]
            qk_class[empty] = qk_class[stand_in]
            v_row[:, empty] = v_row[:, [stand_in]]
        w_ = int(self.widths.sum())
        QK = np.concatenate(qk_table.parts) if qk_table.parts else np.zeros((0, (6 * w_ + 2) if deployed else 4 * w_))
        self.QE = (QK[:, :w_], QK[:, w_:2 * w_])            # (query/key classes, Σd_h) mid, rad
        self.KE = (QK[:, 2 * w_:3 * w_], QK[:, 3 * w_:4 * w_])
        #: the deployed pass's class columns: |W_Q||E[x]|, |W_K||E[x]|, ||E[x]||_1, its entry count
        self.QK_magnitudes = QK[:, 4 * w_:] if deployed else None
        self.qk_class = _narrow(qk_class)                    # (V+1,) class of each token
        self.OE = I.vstack(v_table.parts) if v_table.parts else _empty(d)   # distinct value rows
        #: the deployed pass's |W_O||W_V||E[x]| on each value row's pattern (aligned with OE)
        self.OE_magnitudes = (np.concatenate([I.upper(x.mid, x.rad) for x in vm_table.parts]) if vm_table.parts
                              else np.zeros(0)) if deployed else None
        self.v_row = _narrow(v_row)                          # (H, V+1): head m, token x -> row of OE
        self.E_arrays = csr_arrays(E)
        self.P_arrays = csr_arrays(I.as_csr(weights.P))
        # The unembedding as CSR arrays over the residual directions.
        self.UT_arrays = csr_arrays(weights.U.T.tocsr())
        #: U by token (the ablation's top-token gap compares two rows: logits._pair_gap)
        self.U_arrays = csr_arrays(weights.U) if deployment is None else csr_arrays(sp.csr_matrix((0, d)))
        #: the gate and the experts as the kernels read them
        self.layer = LayerTables.of(weights.W_G, weights.b_G, weights.experts, d, gate_terms)
        #: global neurons whose possible activity each row records (BatchResult.active); set
        #: by whoever saves a certificate (verifier.checks.classes), empty otherwise
        self.watch = np.zeros(0, bool)
        self._scratch = None
        # Stamps start at 1: a work array's 0 means "no row's", so the accumulators start as
        # np.zeros and need no initializing pass (the pages of columns no row reaches are
        # never touched: at 20M facts the residual accumulator alone is 0.7 GB per process).
        self._stamp = 1
        self.deployed = Deployed(self, weights, deployment, absWQ, absWK, absWV, absWO, stages) if deployed else None
        # From here on the pass reads its tables: it keeps the weights' frame (sizes, BOS,
        # b_G, the mode), not their matrices, so that at scale the weights' memory can go
        # once the caller lets them go (verifier.checks.verify)
        self.weights = weights.frame()

    def run_batch(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
                  ablate: np.ndarray | None = None, scores: bool = True,
                  target: np.ndarray | None = None) -> "BatchResult":
        """The certified pass over a batch (:func:`run_batch`): the pass protocol of
        :class:`verifier.passes.protocol.Pass`, which the deployed pass of a format shares."""
        return run_batch(self, tokens, valid_ptr, valid, ablate=ablate, scores=scores, target=target)

    def scratch(self):
        """Sparse-accumulator work arrays (allocated once per process, on first use)."""
        if self._scratch is None:
            rounding.check()
            d, V, w = self.weights.d, len(self.weights.vocab), max(self.layer.max_width, 1)

            def spa(size):
                """(accumulator rows: stamp, mid, A, B, count; the touched columns)."""
                return np.zeros((size, 5)), np.zeros(size, np.int64)      # stamp 0: no row's

            if V >= 2 ** 31:
                raise ValueError(f"{V} tokens: the logits' slot map holds 32-bit slots")
            K = len(self.weights.experts)
            # "y" has a sixth column: the deployed pass's unscaled magnitude of an expert output (experts.experts)
            self._scratch = {"z": spa(w), "y": (np.zeros((max(d, 1), 6)), np.zeros(max(d, 1), np.int64)),
                             "L": spa(max(V, 1)),
                             # the slot map of logits.logits, which keeps its sums compactly in "L"
                             # (accumulate.slot; stamps are never reused, so the two layouts share it safely)
                             "Lw": np.zeros(max(V, 1), np.int32),
                             "m": np.zeros((max(d, 1), 2)), "lm": np.zeros(max(self.vocab_size, V, 1)),
                             "g": gate_work(K),
                             "v": np.zeros(max(V, 1)),
                             "buf": (np.zeros(max(d, 1), np.int64), np.zeros(max(d, 1)), np.zeros(max(d, 1))),
                             "u": (np.zeros(max(d, 1)), np.zeros(max(d, 1)), np.zeros((max(d, 1), 2)))}
        return self._scratch

    def stamps(self, count: int) -> int:
        """The first of ``count`` fresh stamps (every row handled by a kernel gets its own)."""
        first = self._stamp
        self._stamp += count
        return first


class Deployed:
    """What the deployed pass of a floating-point format adds to the exact pass's tables.

    The exact pass encloses E[x] + P[j] and its projections per token class and per
    position (reassociated where exact arithmetic allows: W_O W_V h_j as one row). The
    deployed computation rounds every stage (verifier.passes.floating, Stages): its value differs
    from the exact one by at most ρ times the stage's sum of |terms| plus absolute floors.
    These tables bound those sums: per query/key class (the class columns of
    :class:`Prepared`) and per position the magnitudes |W_Q||E[x]|, |W_Q||P[j]| (and W_K's)
    and ||E[x]||_1; per value row the magnitudes |W_O||W_V||E[x]| (Prepared.OE_magnitudes)
    and |W_O||W_V||P[j]| on the value rows' own patterns; and per head and token the
    largest entry and the sum of |W_V||E[x]| (and per position of |W_V||P[j]|), for the
    values' overflow and the inputs-read-as-zero allowances.
    """

    def __init__(self, prep: "Prepared", weights: Weights, deployment, absWQ, absWK, absWV, absWO, stages=None) -> None:
        self.dep = deployment
        self.stages = st = stages if stages is not None else stages_of(weights, deployment)
        self.fp = st.kernel_constants()
        assert len(self.fp) == len(KERNEL_CONSTANTS)
        self.sm = softmax_constants(prep.vocab_size, deployment)
        H, d = prep.n_heads, weights.d
        w_ = int(prep.widths.sum())
        absE = abs(I.as_csr(weights.E))
        absP = abs(I.as_csr(weights.P))

        def mags(X: sp.csr_matrix, Ws) -> np.ndarray:
            if not Ws:
                return np.zeros((X.shape[0], 0))
            return np.concatenate([I.upper(*I.matmul(I.exact(X), W).dense()) for W in Ws], axis=1)

        self.QPm, self.KPm = mags(absP, absWQ), mags(absP, absWK)
        C = prep.QK_magnitudes
        self.QEm, self.KEm = C[:, :w_], C[:, w_:2 * w_]
        self.El1_cls = C[:, 2 * w_] if C.shape[0] else np.zeros(1)
        self.Enz_cls = C[:, 2 * w_ + 1] if C.shape[0] else np.zeros(1)
        self.OEm = prep.OE_magnitudes
        V1 = absE.shape[0]
        self.VEmax, self.VEl1 = np.zeros((H, V1)), np.zeros((H, V1))
        self.VPmax, self.VPl1 = np.zeros((H, absP.shape[0])), np.zeros((H, absP.shape[0]))
        OPm = []
        for m in range(H):
            V_E = I.matmul(I.exact(absE), absWV[m])
            ve = I.upper(V_E.mid, V_E.rad)
            np.maximum.at(self.VEmax[m], V_E.row_ids(), ve)
            np.add.at(self.VEl1[m], V_E.row_ids(), ve)
            V_P = I.matmul(I.exact(absP), absWV[m])
            vp = I.upper(V_P.mid, V_P.rad)
            np.maximum.at(self.VPmax[m], V_P.row_ids(), vp)
            np.add.at(self.VPl1[m], V_P.row_ids(), vp)
            MP = I.matmul(V_P, absWO[m])
            OPm.append(I.upper(MP.mid, MP.rad))
        self.VEl1 = I.up(self.VEl1 * I.sum_factor(max(d, 1)))
        self.VPl1 = I.up(self.VPl1 * I.sum_factor(max(d, 1)))
        self.OPm = np.concatenate(OPm) if OPm else np.zeros(0)
        if self.OPm.size != prep.OP.nnz or self.OEm.size != prep.OE.nnz:
            raise AssertionError("the value rows' magnitudes do not share their patterns")
        # ||E[x]||_1 and ||P[j]||_1 (with their entry counts) for the embedding sums' allowances
        self.El1 = I.up(np.asarray(absE.sum(axis=1)).ravel() * I.sum_factor(max(d, 1)))
        self.Pl1 = I.up(np.asarray(absP.sum(axis=1)).ravel() * I.sum_factor(max(d, 1)))
        self.Enz = np.diff(I.as_csr(weights.E).indptr).astype(np.float64)
        self.Pnz = np.diff(I.as_csr(weights.P).indptr).astype(np.float64)


def _empty(d: int) -> SparseInterval:
    return I.SparseInterval((0, d), np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))


def _narrow(a: np.ndarray) -> np.ndarray:
    """int32 when every value fits (class maps hold one entry per token: half the memory)."""
    return a.astype(np.int32) if a.size == 0 or a.max() < 2 ** 31 - 1 else a


def _sparse_row_bytes(M: SparseInterval, i: int) -> bytes:
    """Row i's stored (index, mid, rad) as bytes: equal bytes iff bitwise equal rows."""
    a, b = int(M.indptr[i]), int(M.indptr[i + 1])
    return M.indices[a:b].astype(np.int64).tobytes() + M.mid[a:b].tobytes() + M.rad[a:b].tobytes()


def _dense_row_classes(X: np.ndarray) -> np.ndarray:
    """Class id per row: equal ids iff the rows are bitwise equal."""
    X = np.ascontiguousarray(X)
    if X.shape[1] == 0:
        return np.zeros(X.shape[0], np.int64)
    return _unique_rows(X)[1].astype(np.int64)


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


def _repeated_row_classes(part: SparseInterval, which: np.ndarray, max_nnz: int = 8) -> np.ndarray | None:
    """``_sparse_row_classes(part.rows(which))`` from ``part``'s rows alone, where every row
    of ``part`` is some row ``which`` takes (as :func:`_by_distinct` gives them); None
    where the rows are wide (their classes are then the rows themselves).

    Why the same ids: the rows taken are copies of part's, so their widest row is part's
    and each row's table row (:func:`_sparse_row_classes`) and hash are those of the part
    row it copies; the set of distinct rows is part's, so the sorted distinct hashes, and
    whether two different rows share one, are too. A row's class, its hash's rank among
    them (or, after a shared hash, its bytes' rank), is then its part row's class."""
    if int(np.diff(part.indptr).max(initial=0)) > max_nnz:
        return None
    return _sparse_row_classes(part, max_nnz)[which]


def _by_distinct(X: sp.csr_matrix, read: np.ndarray, f, distinct: tuple[np.ndarray, np.ndarray] | None = None):
    """``f`` over the rows of X computed once per distinct row part: (f of the distinct
    rows, the distinct row of each row), so that f(X)'s row i is ``out[which[i]]``.

    ``f`` must be row-local and read only the columns ``read`` (sorted): each of its output
    rows a function of the same input row's entries in those columns, as a product by a
    matrix whose other rows are empty is (interval.matmul: a row's pattern, sums and radii
    depend on that row's terms alone, and an entry in a column the matrix does not read
    forms no term). Rows equal (bitwise) in those columns then have bitwise equal outputs,
    and a distinct row stands for all of them. Rows with many entries there are not
    compared (each stands for itself). ``distinct``: :func:`_distinct_rows` of (X, read),
    if already found (several maps reading the same columns of the same rows)."""
    X = I.as_csr(X)
    first, which = _distinct_rows(X, read) if distinct is None else distinct
    return f(X[first]), which


def _distinct_rows(X: sp.csr_matrix, read: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a row of each distinct part of X's rows in the columns ``read``, in order of first
    appearance; for each row, the index of its part among them): :func:`_by_distinct`."""
    X = I.as_csr(X)
    pos = np.searchsorted(read, X.indices)
    hit = pos < read.size
    hit[hit] = read[pos[hit]] == X.indices[hit]
    rows = np.repeat(np.arange(X.shape[0], dtype=np.int64), np.diff(X.indptr))[hit]
    ptr = np.zeros(X.shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=X.shape[0]), out=ptr[1:])
    part = SparseInterval((X.shape[0], read.size), ptr, pos[hit].astype(np.int64), X.data[hit].astype(np.float64),
                          np.zeros(int(hit.sum())))
    _, first, which = np.unique(_sparse_row_classes(part), return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")            # distinct rows in order of first appearance
    rank = np.empty(order.size, np.int64)
    rank[order] = np.arange(order.size)
    return first[order], rank[which.reshape(-1)]


#: Odd multipliers of the row hash of :func:`_unique_rows` (any fixed values: the hash only
#: groups rows first).
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                dtype=np.uint64).view(np.int64)


def _unique_rows(*arrays: np.ndarray):
    """Distinct rows (bitwise) of the column-stacked arrays: (first index of each, inverse).

    Rows of integers or of float64 (read as their bits) are grouped by a 64-bit hash first,
    then every row is compared with its group's first row entry by entry; should two
    different rows share a hash (never seen), they are grouped by their bytes instead
    (sorting them, as for any other type). So a group holds exactly the rows of one value.
    The distinct rows come in the order of their hashes."""
    stacked = np.ascontiguousarray(np.concatenate(arrays, axis=1))
    if stacked.dtype == np.float64 or np.issubdtype(stacked.dtype, np.integer):
        key = stacked.view(np.int64) if stacked.dtype == np.float64 else stacked.astype(np.int64)
        mix = np.resize(_MIX, key.shape[1]) * (np.arange(key.shape[1], dtype=np.int64) * 2 + 1)
        with np.errstate(over="ignore"):
            h = key @ mix                               # Σ_j key·mix mod 2^64 (wraps around): a hash, not a number
        _, first, inv = np.unique(h, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        if np.array_equal(key, key[first[inv]]):
            return first, inv
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
    D = prep.deployed
    with np.errstate(invalid="ignore", over="ignore"):
        q_m, q_r = I.gather_add(prep.QE, prep.QP, rep[:, p], p)           # (n', Σd_h)
        k_m, k_r = I.gather_add(prep.KE, prep.KP, rep, np.arange(p1)[None, :])  # (n', p+1, Σd_h)
        if D is not None:
            q_r = _deployed_projection(D, q_r, D.QEm[rep[:, p]], D.QPm[p], rep[:, p], p, D.stages.rho_q,
                                       D.stages.f_q, D.stages.rs_q)
            k_r = _deployed_projection(D, k_r, D.KEm[rep], D.KPm[:p1][None, :, :], rep, np.arange(p1)[None, :],
                                       D.stages.rho_k, D.stages.f_k, D.stages.rs_k)
        s_mid, s_rad = I.dot_segments(q_m[:, None, :], q_r[:, None, :], k_m, k_r, prep.starts, prep.widths)
        if D is not None:
            s_rad = _deployed_scores(D, prep, q_m, q_r, k_m, k_r, s_rad)
        s_mid, s_rad = s_mid.transpose(0, 2, 1), s_rad.transpose(0, 2, 1)  # (n', H, p+1)
        if D is None:
            a_lo, a_hi = softmax_bounds(I.lower(s_mid, s_rad), I.upper(s_mid, s_rad), s_mid)
        else:
            a_lo, a_hi = deployed_softmax(I.lower(s_mid, s_rad), I.upper(s_mid, s_rad), s_mid, D.dep)
            a_lo = np.where(np.isfinite(s_rad), a_lo, 0.0)
            a_hi = np.where(np.isfinite(s_rad), a_hi, np.inf)
    am, ar = I.from_bounds(a_lo, a_hi)
    return inv.astype(np.int64), np.ascontiguousarray(am), np.ascontiguousarray(ar)


def _deployed_projection(D: Deployed, rad, mag_e, mag_p, cls, pos, rho, floor, rs):
    """A query or key as deployed: W·ĥ with ĥ = fl(E[x] + P[j]), widened from the exact
    W·(E[x] + P[j]) by (ρ_h + ρ(1 + ρ_h))·(|W||E[x]| + |W||P[j]|) (ĥ's rounding carried
    through W, and the product's own), ĥ's floor through W ((1 + ρ)·f_h·Σ|W|), the product's
    floor and its inputs-read-as-zero allowance 2·e_min·(||ĥ||_1 + Σ|W|)."""
    st = D.stages
    rh, fh = st.rho_h, st.f_h
    k = float(I.up(rh + I.up(rho * I.up(1.0 + rh))))
    l1h = I.up(I.up(I.up(1.0 + rh) * I.up(D.El1_cls[cls] + D.Pl1[pos])) + I.up(I.up(D.Enz_cls[cls] + D.Pnz[pos]) * fh))
    const = I.up(I.up(I.up(1.0 + rho) * fh) * rs) + floor
    daz = I.up(I.up(2.0 * st.e_min) * I.up(l1h[..., None] + rs))
    mag = I.up(mag_e + mag_p)
    out = I.add_rad(rad, I.up(k * mag), const, daz)
    over = ~(I.up(I.up(np.abs(mag) * I.up(1.0 + k)) + out) < st.largest)
    return np.where(over, np.inf, out)


def _deployed_scores(D: Deployed, prep, q_m, q_r, k_m, k_r, s_rad):
    """The scores as deployed: the interval dot product of the deployed query and keys,
    widened by the dot product's rounding ρ_s·Σ|q̂||k̂|, its floor and its allowance
    2·e_min·(||q̂||_1 + ||k̂||_1) per head; ∞ where a score may overflow."""
    st = D.stages
    qa = I.up(np.abs(q_m) + q_r)
    ka = I.up(np.abs(k_m) + k_r)
    mag_m, mag_r = I.dot_segments(qa[:, None, :], np.zeros_like(qa)[:, None, :], ka, np.zeros_like(ka),
                                  prep.starts, prep.widths)
    mag = I.upper(mag_m, mag_r)
    safe = np.minimum(prep.starts, max(qa.shape[-1] - 1, 0))
    l1q = np.add.reduceat(qa, safe, axis=-1) if qa.shape[-1] else np.zeros(qa.shape[:-1] + (prep.starts.size,))
    l1k = np.add.reduceat(ka, safe, axis=-1) if ka.shape[-1] else np.zeros(ka.shape[:-1] + (prep.starts.size,))
    l1 = I.up(I.up(l1q[:, None, :] * I.sum_factor(max(qa.shape[-1], 1)))
              + I.up(l1k * I.sum_factor(max(ka.shape[-1], 1))))
    out = I.add_rad(s_rad, I.up(st.rho_s * mag), st.f_s, I.up(I.up(2.0 * st.e_min) * l1))
    over = ~(I.up(I.up(mag * I.up(1.0 + st.rho_s)) + out) < st.largest)
    return np.where(over, np.inf, out)


def residual(prep: Prepared, tokens: np.ndarray) -> SparseInterval:
    """r at the last position for rows of ``tokens`` (n x p, weights' ids), enclosed.

    r = E[x_p] + P[p] + Σ_m (head m's output), each entry a sum of terms with a rounding
    bound (:func:`verifier.arithmetic.residual.residual`).
    """
    w = prep.weights
    n, p = tokens.shape
    ids = np.ascontiguousarray(np.concatenate([np.full((n, 1), w.bos, np.int64), tokens], axis=1))  # (n, p+1)
    att, am, ar = attention(prep, ids)
    H = prep.n_heads
    OE, OP = prep.OE, prep.OP
    npos = w.P.shape[0]
    (Ep, Ei, Ev), (Pp, Pi, Pv) = prep.E_arrays, prep.P_arrays
    cap = residual_k.residual_bound(ids, Ep, Pp, OE.indptr, OP.indptr, H, prep.v_row, npos)
    yacc, ytouched = prep.scratch()["y"]
    stamp0 = prep.stamps(n)
    with np.errstate(invalid="ignore", over="ignore"):
        ptr, idx, mid, rad = residual_k.residual(ids, (att, am, ar), (Ep, Ei, Ev), (Pp, Pi, Pv),
                                        (OE.indptr, OE.indices, OE.mid, OE.rad),
                                        (OP.indptr, OP.indices, OP.mid, OP.rad),
                                        (H, prep.v_row, npos), (yacc, ytouched), stamp0, max(cap, 1),
                                        _residual_deployed(prep, ids, att, am, ar))
    return SparseInterval((n, w.d), ptr, idx, mid, rad)


def _residual_deployed(prep: Prepared, ids: np.ndarray, att, am, ar) -> tuple:
    """The residual kernel's ``deployed`` argument: off for the exact pass; for the deployed
    one its tables and, per row, the value path's absolute allowances. Per row, head m and
    position j, with â_hi the attention's upper end and ĥ_j's ||·||_1 bounded from the
    tables: the values' floor and allowance through the attention-weighted sum,
    ζ = Σ_m [(1 + ρ_mix)·Σ_j â_hi·((1 + ρ_v)·Σ|W_V|·f_h + f_v + 2·e_min·(||ĥ_j||_1 + Σ|W_V|))
    + f_mix + 2·e_min·(Σ_j â_hi + Σ_j max|v̂_j|)] (carried through W_O by its row sums in the
    kernel), and the W_O products' inputs-read-as-zero share 2·e_min·Σ_m ||ĉ_m||_1; a row
    whose values may overflow (a dense runtime computes every position's) is undecided."""
    D = prep.deployed
    if D is None:
        z = np.zeros(1)
        return (False, z, np.zeros((1, 2)), z, z, z, z, z, z, z)
    st = D.stages
    n, p1 = ids.shape
    H = prep.n_heads
    pos = np.arange(p1)
    a_hi = I.upper(am, ar)[att] if H else np.zeros((n, 0, p1))                    # (n, H, p+1)
    with np.errstate(invalid="ignore", over="ignore"):
        rh, rv, rmix = st.rho_h, st.rho_v, st.rho_mix
        l1h = I.up(I.up(I.up(1.0 + rh) * I.up(D.El1[ids] + D.Pl1[pos])) + I.up(I.up(D.Enz[ids] + D.Pnz[pos]) * st.f_h))
        daz_v = I.up(I.up(2.0 * st.e_min) * I.up(l1h + st.rs_v))                       # (n, p+1)
        per_v = I.up(I.up(I.up(I.up(1.0 + rv) * I.up(st.rs_v * st.f_h)) + st.f_v) + daz_v)
        zeta = np.zeros(n)
        l1c = np.zeros(n)
        bad = np.zeros(n, bool)
        for m in range(H):
            vmax = I.up(I.up(I.up(1.0 + rv) * I.up(I.up(1.0 + rh) * I.up(D.VEmax[m][ids] + D.VPmax[m][pos]))) + per_v)
            l1v = I.up(I.up(I.up(1.0 + rv) * I.up(I.up(1.0 + rh) * I.up(D.VEl1[m][ids] + D.VPl1[m][pos])))
                       + I.up(D.stages.dv * per_v))
            a = a_hi[:, m, :]
            a_sum = I.up(a.sum(axis=1) * I.sum_factor(p1))
            zeta = I.up(zeta + I.up(I.up(I.up(1.0 + rmix) * I.up(I.up(a * per_v).sum(axis=1) * I.sum_factor(p1)))
                                    + I.up(st.f_mix + I.up(I.up(2.0 * st.e_min)
                                                           * I.up(a_sum + I.up(vmax.sum(axis=1) * I.sum_factor(p1)))))))
            c_l1 = I.up(I.up(I.up(1.0 + rmix) * I.up(I.up(a * l1v).sum(axis=1) * I.sum_factor(p1)))
                        + I.up(D.stages.dv * st.f_mix))
            l1c = I.up(l1c + c_l1)
            bad |= ~(I.up(vmax * I.up(1.0 + rmix)).max(axis=1, initial=0.0) < st.largest)
            bad |= ~(c_l1 < st.largest)
        extra = np.where(bad | ~np.isfinite(zeta) | ~np.isfinite(l1c), np.inf, I.up(I.up(2.0 * st.e_min) * l1c))
    return (True, D.fp, prep.scratch()["m"], D.OEm, D.OPm, st.rho_or, st.f_or, zeta, st.rs_o, extra)


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


def gate_decisions(prep: Prepared, R: SparseInterval, scores: bool, layer: LayerTables | None = None,
                   work: tuple | None = None):
    """The gate's decisions (:func:`verifier.arithmetic.gate.gate`): winner, margin, radius per row,
    top three, the experts that may win (CSR), and the (n, K) midpoints if ``scores``.

    By default the gate of ``prep``'s layer; ``layer`` another layer's over the same residual
    directions (a stack's), with ``work`` its per-expert work arrays (gate_work); the exact
    pass only."""
    t = prep.layer if layer is None else layer
    n, K = R.shape[0], t.K
    G = np.empty((n, K)) if scores else np.empty((1, 1))
    gmid, gstamp, gtouched = prep.scratch()["g"] if layer is None else work
    with np.errstate(invalid="ignore", over="ignore"):
        D = prep.deployed if layer is None else None
        deployed = (True, D.fp, D.stages.rs_g) if D is not None else (False, np.zeros(1), 0.0)
        out = gate_k.gate(R.indptr, R.indices, R.mid, R.rad, *t.WGT, t.wg_colmax, t.wg_hot, t.b_G, t.wg_max_terms,
                          gmid, gstamp, gtouched, prep.stamps(n), G, scores, deployed)
    return (*out, G if scores else None)


def gate_work(K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gate kernel's per-expert work arrays for K experts (stamp −1: no row's)."""
    return np.zeros(K), np.full(K, -1.0), np.zeros(K, np.int64)


def _experts_deployed(prep: Prepared, R: SparseInterval, sc: dict) -> tuple:
    """The experts and ablation kernels' ``deployed`` argument (off for the exact pass):
    constants, the output softmax's, the row sums of W_1, W_2 and U, each row's ||r̂||_1 and
    a per-token scratch array."""
    D = prep.deployed
    if D is None:
        z = np.zeros(1)
        return (False, z, z, z, z, z, z, z)
    st = D.stages
    n = R.shape[0]
    l1r = np.zeros(n)
    if R.nnz:                      # Σ_j (|mid_j| + rad_j) per row, its float sum bounded by Lemma 1
        with np.errstate(invalid="ignore", over="ignore"):
            np.add.at(l1r, R.row_ids(), I.up(np.abs(R.mid) + R.rad))
            l1r = I.up(l1r * I.sum_factor(max(int(np.diff(R.indptr).max(initial=1)), 1)))
    return (True, D.fp, D.sm, st.rs_z, st.rs_2, st.rs_l, l1r, sc["lm"])


def run_batch(prep: Prepared | Weights, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
              ablate: np.ndarray | None = None, scores: bool = True, target: np.ndarray | None = None) -> BatchResult:
    """Certified forward pass of a batch (n x p token ids, weights' ids; BOS is added).

    ``ablate`` (bool per row, default all) selects the rows whose ablated error is
    enclosed; the others get NaN there (the entanglement check needs object queries only).
    ``target`` (token id per row, −1: none; default none): for an ablated row, the token o
    whose ablated logit gap max_{t != o} z_t − z_o is bounded below (``ablated_gap``).
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
            if prep.deployed is None:
                p_lo, p_hi = softmax_bounds(I.lower(Gf, Rf), I.upper(Gf, Rf), Gf)
            else:                          # the gate scale's softmax as deployed (Lemma F2)
                p_lo, p_hi = deployed_softmax(I.lower(Gf, Rf), I.upper(Gf, Rf), Gf, prep.deployed.dep)
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
    ab_gap, ab_zeros = np.full(n, np.nan), np.full(n, -1, np.int64)
    ab_obj = np.full(n, np.nan)
    target = np.full(n, -1, np.int64) if target is None else np.ascontiguousarray(target, np.int64)
    # the kernels index per-token arrays by these ids, unchecked: each must be a token
    if (tokens.size and (tokens.min() < 0 or tokens.max() > V)) or (vals.size and (vals.min() < 0 or vals.max() >= V)) \
            or (target.size and target.max() >= V) \
            or vptr.size != n + 1 or (n and (vptr[0] != 0 or vptr[-1] != vals.size or (np.diff(vptr) < 0).any())):
        raise ValueError("tokens (BOS included), valid next tokens and targets must be token ids of the weights, "
                         "the valid ones in a CSR of one row per query")
    R_ACT = ACTIVE_SLOTS
    active = np.full((n, R_ACT + 1), -1, np.int64)
    active[:, R_ACT] = 0
    ablate = np.ones(n, bool) if ablate is None else np.asarray(ablate, bool)
    undecided_rows = np.zeros(n, bool)
    UT_ptr, UT_idx, UT_val = prep.UT_arrays
    # U·r for a run of rows at a time, so that memory stays bounded for any unembedding
    bound = logits_k.logits_bound(R.indptr, R.indices, UT_ptr)
    for a, b in _row_runs(bound, LOGITS_PER_RUN):
        Rc = R if (a, b) == (0, n) else R.rows(np.arange(a, b))
        vp, vv = take_csr(vptr, vals, np.arange(a, b))
        with np.errstate(invalid="ignore", over="ignore"):
            L = logits_k.logits(Rc.indptr, Rc.indices, Rc.mid, Rc.rad, UT_ptr, UT_idx, UT_val, *sc["L"], sc["Lw"],
                          prep.stamps(b - a), max(int(bound[a:b].sum()), 1))
            deployed = _experts_deployed(prep, Rc, sc)
            sel = (pair_rows >= a) & (pair_rows < b)
            n_sel = int(sel.sum())
            act = np.full((n_sel, R_ACT + 1), -1, np.int64)
            act[:, R_ACT] = 0
            lo, hi, pred, r_lo, r_hi, pair_bad = experts_k.experts(
                ((pair_rows[sel] - a).astype(np.int64), pair_experts[sel].astype(np.int64)),
                (np.ascontiguousarray(cm[sel]), np.ascontiguousarray(cr[sel])),
                (Rc.indptr, Rc.indices, Rc.mid, Rc.rad), L, prep.layer.W1T, prep.layer.first,
                prep.layer.W2T, prep.UT_arrays, V, (vp, vv), (*sc["z"], *sc["y"], *sc["L"], sc["v"]),
                prep.stamps(n_sel), prep.watch, act, deployed)
            rows_sel = pair_rows[sel]
            if prep.deployed is not None:
                # a dense runtime multiplies every value, also by zero weights: a value of a
                # candidate expert that may be non-finite can spread (0·∞), so its row decides nothing
                undecided_rows[rows_sel[pair_bad]] = True
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
                (ab_lo[a + ab], ab_hi[a + ab], ab_rho_lo[a + ab], ab_rho_hi[a + ab], ab_gap[a + ab],
                 ab_zeros[a + ab], ab_obj[a + ab]) = logits_k.ablated(ab.astype(np.int64), L, V, vp,
                                                                      vv, *sc["L"], sc["v"],
                                                               prep.stamps(2 * ab.size), deployed, target[a:b],
                                                (Rc.indptr, Rc.indices, Rc.mid, Rc.rad), prep.U_arrays, sc["u"])
    undecided = ~np.isfinite(Grad) | undecided_rows     # the gate cannot say which expert wins
    err_lo[undecided], err_hi[undecided] = 0.0, 1.0
    if prep.deployed is not None:
        if undecided_rows.any():                         # (reported as a row the gate cannot decide)
            margin = np.where(undecided_rows, -np.inf, margin)
        # The ablation claims nothing either: a runtime that removes the routed expert by
        # multiplying its output by 0 (execution model, "ablation") gets NaN from an infinite
        # output, and where the gate decides nothing it may route to an expert whose output
        # was never checked (only the midpoints' winner is a candidate then).
        sel = undecided & ablate
        ab_lo[sel], ab_hi[sel] = 0.0, 1.0
        ab_gap[sel & (target >= 0)] = -np.inf
        ab_obj[sel & (target >= 0)] = 0.0
    rho_lo[undecided | ~np.isfinite(rho_lo)] = np.nan
    rho_hi[np.isnan(rho_lo)] = np.nan
    top_gate = (top, top_lo, top_hi)
    return BatchResult(e, margin, ~(margin > 0), Gm, Grad, err_lo, err_hi, ab_lo, ab_hi, predicted, top_gate,
                       (cand_ptr, cand), rho_lo, rho_hi, ab_rho_lo, ab_rho_hi, active, ab_gap, ab_zeros,
                       ab_obj)


def FloatPass(weights: Weights, dep: Deployment, source: str = "weights") -> Prepared:
    """The deployed forward pass of ``weights`` in ``dep.fmt``, enclosed for every execution:
    this module's compiled pass with the deployment's stages added (:mod:`verifier.passes.floating`)."""
    weights.validate(source)
    return Prepared(weights, deployment=dep)
