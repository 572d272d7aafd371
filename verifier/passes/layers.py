"""The certified forward pass of a two-layer model (:class:`layout.layers.Stack`).

A layer is a unit here: a gate and experts over the residual directions
(:class:`verifier.passes.tables.LayerTables`), applied to rows of intervals by the same two
compiled stages whatever the layer: the gate's decisions
(:func:`verifier.passes.forward.gate_decisions`: winner, certified margin, the experts that
may win) and the experts' outputs y = x + W_2 ReLU(W_1 x + b_1), one row per (row, expert
that may win) (:func:`verifier.arithmetic.experts.layer_rows`). Every value is enclosed as
in the one-layer pass (mid-radius, Lemmas 1 and 2, every radius rounded up; an entry no term
reaches is exactly 0).

1. **Residual** r at the last position: layer 1's attention, the one-layer pass's, row by
   row (:func:`verifier.passes.forward.residual`) or, given the task set's entities,
   factored: r_i = s_c + o_i, the shared part of the row's cohort enclosed once per cohort
   and the row's own part (:mod:`verifier.passes.factored`); r itself is then formed
   (:func:`verifier.arithmetic.residual.parts_sum`) only in the directions the hop-1 pass
   reads.
2. **Layer 1** on r: its gate, and y for each expert that may win. Factored, both read r's
   parts: the gate as the one-layer factored pass decides it
   (:func:`verifier.arithmetic.gate.gate_parts`), the experts enclosing once per (cohort,
   expert) what the rows share and per row what its own part changes
   (:func:`verifier.arithmetic.experts.layer_rows_parts`).
3. **Layer 2** on each y: its gate, and y' for each expert that may win.
4. **Readout** of each y': the logits U·y' (:func:`verifier.arithmetic.logits.logits`) and
   the error 1 − P(valid) enclosed (:func:`verifier.arithmetic.logits.ablated`, which reads
   the error of softmax(U·x) for any rows x); a query's enclosure is the worst over every
   pair of experts that may win.
5. **Ablations** of object queries: hop 1, the first layer's expert removed (y = r, then
   layer 2 as in 3); hop 2, the second layer's expert removed (y' = y). For each: the error,
   the lower end of 1 − P(o) for the object o alone (L1) and a lower bound of
   max_{t != o} z_t − z_o (L2), worst over the experts that may win.

*Read directions.* A stage's rows keep only the directions some later stage reads: the
residual those of either layer's gate and first expert matrices and of U, layer 1's outputs
those of layer 2 and U, layer 2's those of U. Every later value is a sum over the
directions its matrix reads, so it is the same sum, term for term, with the rest left out.

*Distinct items.* After layer 1 many rows are equal in the directions still read (every
person born in one country has the same y at the object query: the bridge entity and the
template), so layer 2 and the readout run once per distinct item, its result read by every
row of the item: the key is the row's entries bitwise (:func:`_keys`) with its valid next
tokens, its object (for an ablation) and whether it decides nothing. The enclosures of
an item bound the exact values of every input it stands for, since the inputs are the
same intervals: a row's values depend on its own inputs only.

*Rows that decide nothing.* A row where a value may be non-finite (an overflow: the exact
value is finite, but nothing bounds it), or a gate whose scores may be non-finite (any
expert may win, so every route would need checking), claims nothing: its error is [0, 1],
and an ablation there has error lower end 0, 1 − P(o) lower end 0 and gap −∞, so no check
passes on it. Only the exact pass ("top1" gates in both layers) is enclosed here; the
deployed-precision pass has no two-layer form yet (the command line refuses it in one line).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from layout.layers import Stack
from verifier.arithmetic import experts as experts_k
from verifier.arithmetic import gate as gate_k
from verifier.arithmetic import logits as logits_k
from verifier.arithmetic import residual as residual_k
from verifier.arithmetic.interval import SparseInterval
from verifier.passes.batches import take_csr
from verifier.passes.forward import (LOGITS_PER_RUN, Prepared, _experts_deployed, _row_runs, _unique_rows,
                                     gate_decisions, gate_work, residual)
from verifier.passes.factored import Split, residual_parts
from verifier.passes.tables import LayerTables


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


@dataclass
class _Routed:
    """A layer applied to rows X: one output row per (row, expert that may win)."""

    rows: np.ndarray            # (P,) the row of X of each pair
    expert: np.ndarray          # (P,) its expert
    Y: SparseInterval           # (P, d) the outputs
    bad: np.ndarray             # (P,) the pair decides nothing (module docstring)
    winner: np.ndarray          # (n,) per row of X: the gate's winner
    margin: np.ndarray          # (n,) its certified margin (−∞ where the row decides nothing)


class LayersPass:
    """The two-layer pass for fixed weights."""

    def __init__(self, stack: Stack, entities: np.ndarray | None = None) -> None:
        """``entities``: the task set's entity tokens (weights' ids); given, the residual is
        enclosed factored over cohorts (module docstring), else row by row."""
        stack.validate()
        self.stack = stack
        #: attention, the residual, layer 1's tables and the unembedding
        self.prep = Prepared(stack.first)
        self.split = None if entities is None else Split.of(stack.first, entities)
        self._acc = None
        s = stack.second
        self.layers = (self.prep.layer, LayerTables.of(s.W_G, s.b_G, s.experts, stack.first.d))
        self._work = (None, gate_work(self.layers[1].K))
        width = max(max(t.max_width for t in self.layers), 1)
        self._z = (np.zeros((width, 5)), np.zeros(width, np.int64))    # stamp 0: no row's
        # the residual directions each stage's rows are read in (module docstring, "Read
        # directions"): the readout reads U's; layer 2's output is read by the readout alone,
        # layer 1's by layer 2 and the readout, the residual by both layers and the readout
        d = stack.first.d
        U = _reads(d, self.prep.UT_arrays)
        l2 = U | _reads(d, self.layers[1].WGT) | _reads(d, self.layers[1].W1T)
        self._keep = (l2, U)                             # what layer 1's, layer 2's outputs keep
        self._read_r = l2 | _reads(d, self.layers[0].WGT) | _reads(d, self.layers[0].W1T)
        self._parts_scratch = None

    def _residual(self, tokens: np.ndarray) -> tuple[SparseInterval, tuple | None]:
        """(r at the last position of each row of ``tokens``, in the directions read after it;
        factored, its parts (S, O, cohort), in which layer 1's experts read it)."""
        prep = self.prep
        if self.split is None:
            return residual(prep, tokens).only(self._read_r), None
        n, d = tokens.shape[0], prep.weights.d
        ids = np.ascontiguousarray(np.concatenate([np.full((n, 1), prep.weights.bos, np.int64), tokens], axis=1))
        if self._acc is None:                            # a compact accumulator for the parts (stamp 0: no row's)
            self._acc = (np.zeros((max(d, 1), 5)), np.zeros(max(d, 1), np.int64), np.zeros(max(d, 1), np.int32))
        S, O, cohort = residual_parts(prep, self.split, ids, self._acc)
        yacc, ytouched = prep.scratch()["y"]
        with np.errstate(invalid="ignore", over="ignore"):
            # layer 1's gate and experts read the parts: r itself only where the hop-1 pass reads it
            ptr, idx, mid, rad = residual_k.parts_sum(S, O, cohort, self._keep[0], (yacc, ytouched), prep.stamps(n))
        return SparseInterval((n, d), ptr, idx, mid, rad), (S, O, cohort)

    def _layer(self, i: int, X: SparseInterval, bad_in: np.ndarray | None = None, parts: tuple | None = None
               ) -> _Routed:
        """Layer ``i`` (0 or 1) on rows X: its gate, then each expert that may win, on X or,
        given, on the rows' parts (S, O, cohort: :func:`verifier.arithmetic.gate.gate_parts`,
        :func:`verifier.arithmetic.experts.layer_rows_parts`)."""
        prep, t = self.prep, self.layers[i]
        n = X.shape[0]
        if parts is None:
            e, margin, grad, _, _, _, ptr, cand, _ = gate_decisions(prep, X, False, None if i == 0 else t,
                                                                    self._work[i])
            rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr))
        else:                                            # the factored gate (the one-layer factored pass's)
            S, O, cohort = parts
            gmid, gstamp, gtouched = prep.scratch()["g"] if i == 0 else self._work[i]
            with np.errstate(invalid="ignore", over="ignore"):
                e, margin, grad, _, _, _, rows, cand = gate_k.gate_parts(
                    S, O, cohort, np.argsort(cohort, kind="stable"), t.WGT, t.wg_colmax, t.b_G, t.wg_max_terms,
                    gmid, gstamp, gtouched, prep.stamps(n), np.empty((1, 1)), False)
            rows = np.asarray(rows, np.int64)
        undecided = ~np.isfinite(grad)
        if bad_in is not None:
            undecided |= bad_in
        margin = np.where(undecided, -np.inf, margin)
        experts = np.ascontiguousarray(cand, np.int64)
        yacc, ytouched = prep.scratch()["y"]
        with np.errstate(invalid="ignore", over="ignore"):
            if parts is None:
                ptr_y, idx, mid, rad, bad = experts_k.layer_rows(
                    (rows, experts), (X.indptr, X.indices, X.mid, X.rad), t.W1T, t.first, t.W2T, self._keep[i],
                    (*self._z, yacc, ytouched), prep.stamps(rows.size))
            else:
                S, O, cohort = parts
                order = np.lexsort((experts, cohort[rows]))   # the pairs of one (cohort, expert) together
                rows, experts = np.ascontiguousarray(rows[order]), np.ascontiguousarray(experts[order])
                ptr_y, idx, mid, rad, bad = experts_k.layer_rows_parts(
                    (rows, experts), S, O, cohort, t.W1T, t.first, t.W2T, self._keep[i],
                    self._parts_work(t, yacc, ytouched), prep.stamps(2 * rows.size))
        Y = SparseInterval((rows.size, X.shape[1]), ptr_y, idx, mid, rad)
        return _Routed(rows, experts, Y, bad | undecided[rows], e, margin)

    def _parts_work(self, t: LayerTables, yacc: np.ndarray, ytouched: np.ndarray) -> tuple:
        """The factored layer kernel's work arrays (stamp 0: no row's; made once): the shared z's
        compact accumulator, z^c and a^c per slot, the row's compact z accumulator, the y
        accumulator given, the shared output's mid and radius per column and its columns."""
        if self._parts_scratch is None:
            w, d = max(t.max_width, 1), max(self.prep.weights.d, 1)
            acc = lambda: (np.zeros((w, 5)), np.zeros(w, np.int64), np.zeros(w, np.int32))  # noqa: E731
            self._parts_scratch = ((*acc(), np.zeros(w), np.zeros(w), np.zeros(w), np.zeros(w), np.zeros(w, bool),
                                    *acc()), (np.zeros(d), np.zeros(d), np.zeros(d, np.int64)))
        z, shared_out = self._parts_scratch
        return (*z, yacc, ytouched, *shared_out)

    def _readout(self, Y: SparseInterval, vptr: np.ndarray, vals: np.ndarray, target: np.ndarray):
        """Per row of Y: (error lo, error hi, lower end of 1 − P(o), gap lower bound) of
        softmax(U·y) (NaN for the last two where ``target`` is −1)."""
        prep = self.prep
        sc = prep.scratch()
        n = Y.shape[0]
        out = tuple(np.full(n, np.nan) for _ in range(4))
        UT = prep.UT_arrays
        bound = logits_k.logits_bound(Y.indptr, Y.indices, UT[0])
        for a, b in _row_runs(bound, LOGITS_PER_RUN):
            Yc = Y if (a, b) == (0, n) else Y.rows(np.arange(a, b))
            vp, vv = take_csr(vptr, vals, np.arange(a, b))
            with np.errstate(invalid="ignore", over="ignore"):
                L = logits_k.logits(Yc.indptr, Yc.indices, Yc.mid, Yc.rad, *UT, *sc["L"], sc["Lw"],
                                    prep.stamps(b - a), max(int(bound[a:b].sum()), 1))
                lo, hi, _, _, gap, _, obj = logits_k.ablated(
                    np.arange(b - a, dtype=np.int64), L, prep.vocab_size, vp, vv, *sc["L"], sc["v"],
                    prep.stamps(2 * (b - a)), _experts_deployed(prep, Yc, sc), np.ascontiguousarray(target[a:b]),
                    (Yc.indptr, Yc.indices, Yc.mid, Yc.rad), prep.U_arrays, sc["u"])
            for arr, got in zip(out, (lo, hi, obj, gap)):
                arr[a:b] = got
        return out

    def _worst(self, n: int, owner: np.ndarray, routed: _Routed, vptr: np.ndarray, vals: np.ndarray,
               target: np.ndarray | None):
        """The worst readout of ``routed``'s outputs per row of the batch (``owner``: the
        batch row of each output row): (err lo, err hi, 1 − P(o) lo, gap)."""
        tgt = np.full(owner.size, -1, np.int64) if target is None else target[owner]
        lo, hi, obj, gap = self._readout(routed.Y, *take_csr(vptr, vals, owner), tgt)
        bad = routed.bad
        lo[bad], hi[bad], obj[bad], gap[bad] = 0.0, 1.0, 0.0, -np.inf
        worst = (np.full(n, np.inf), np.full(n, -np.inf), np.full(n, np.inf), np.full(n, np.inf))
        np.minimum.at(worst[0], owner, lo)
        np.maximum.at(worst[1], owner, hi)
        if target is not None:                           # NaN (no target) counts as +inf; −∞ stays −∞
            np.minimum.at(worst[2], owner, np.where(np.isnan(obj), np.inf, obj))
            np.minimum.at(worst[3], owner, np.where(np.isnan(gap), np.inf, gap))
        return worst

    def run_batch(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray, target: np.ndarray,
                  ablate1: np.ndarray, ablate2: np.ndarray) -> LayersResult:
        """The pass over a batch (n × p weights' token ids, BOS added here): routing, the
        error, and the ablations of the rows ``ablate1`` (hop 1) and ``ablate2`` (hop 2).

        After layer 1 the stages run once per distinct item (module docstring, "Distinct
        items"): layer 2 and the readout per distinct (y, valid set, y decides nothing), the
        hop-2 readout per distinct (y, valid set, object, decides nothing), the hop-1 pass per
        distinct (r in the directions layer 2 and U read, valid set, object)."""
        tokens = np.asarray(tokens, np.int64)
        n = tokens.shape[0]
        vptr, vals = np.asarray(valid_ptr, np.int64), np.asarray(valid, np.int64)
        target = np.asarray(target, np.int64)
        R, parts = self._residual(tokens)
        first = self._layer(0, R, parts=parts)
        Y = first.Y
        vkey = _unique_rows(_keys(vptr, (vals,)))[1]     # per batch row: its valid set's class
        u, inv = _distinct(Y, vkey[first.rows], first.bad)
        second = self._layer(1, Y.rows(u), first.bad[u])
        lo, hi, _, _ = self._worst(u.size, second.rows, second, *take_csr(vptr, vals, first.rows[u]), None)
        err_lo, err_hi, margin2 = np.full(n, np.inf), np.full(n, -np.inf), np.full(n, np.inf)
        np.minimum.at(err_lo, first.rows, lo[inv])
        np.maximum.at(err_hi, first.rows, hi[inv])
        np.minimum.at(margin2, first.rows, second.margin[inv])
        routed = first.expert == first.winner[first.rows]
        e2 = np.full(n, -1, np.int64)
        e2[first.rows[routed]] = second.winner[inv[routed]]
        nan = lambda: np.full(n, np.nan)  # noqa: E731
        ablated = {1: (nan(), nan(), nan(), nan()), 2: (nan(), nan(), nan(), nan())}
        a1 = np.flatnonzero(ablate1)
        if a1.size:                                      # hop 1: y = r, then layer 2
            X = R.only(self._keep[0]).rows(a1)           # (what layer 2 and the readout read of r)
            u1, inv1 = _distinct(X, vkey[a1], target[a1])
            alone = self._layer(1, X.rows(u1))
            got = self._worst(u1.size, alone.rows, alone, *take_csr(vptr, vals, a1[u1]), target[a1[u1]])
            for arr, g in zip(ablated[1], got):
                arr[a1] = g[inv1]
        a2 = np.asarray(ablate2, bool)
        if a2.any():                                     # hop 2: y' = y, for each layer-1 expert that may win
            sel = np.flatnonzero(a2[first.rows])
            Ys, rows = Y.rows(sel), first.rows[sel]
            u2, inv2 = _distinct(Ys, vkey[rows], target[rows], first.bad[sel])
            items = np.arange(u2.size, dtype=np.int64)
            hop2 = _Routed(items, first.expert[sel][u2], Ys.rows(u2), first.bad[sel][u2], first.winner, first.margin)
            got = self._worst(u2.size, items, hop2, *take_csr(vptr, vals, rows[u2]), target[rows[u2]])
            g_lo, g_hi, g_obj, g_gap = got
            worst = (np.full(n, np.inf), np.full(n, -np.inf), np.full(n, np.inf), np.full(n, np.inf))
            np.minimum.at(worst[0], rows, g_lo[inv2])
            np.maximum.at(worst[1], rows, g_hi[inv2])
            np.minimum.at(worst[2], rows, g_obj[inv2])
            np.minimum.at(worst[3], rows, g_gap[inv2])
            for arr, g in zip(ablated[2], worst):
                arr[a2] = g[a2]
        return LayersResult(first.winner, first.margin, e2, margin2, err_lo, err_hi, ablated)


#: The widest row (entries, or valid tokens) a key lists; a wider row is its own item.
KEY_WIDTH = 32


def _distinct(X: SparseInterval, *more: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the first row of each distinct item, each row's item) for rows X, the item of a row
    being its entries bitwise (:func:`_keys`) and its values in ``more`` (per row: a key
    table, or one number)."""
    cols = [m.astype(np.float64).reshape(m.shape[0], -1) for m in more]
    return _unique_rows(_keys(X.indptr, (X.indices, X.mid, X.rad)), *cols)


def _keys(ptr: np.ndarray, columns: tuple[np.ndarray, ...], width: int = KEY_WIDTH) -> np.ndarray:
    """Per CSR row (``ptr``; the entries' ``columns``, e.g. index, midpoint, radius), a float64
    key: two rows have bitwise equal keys only if they hold the same entries bitwise, in the
    same order. The key lists the entry count, then each column's entries (integers below
    2^53 are exact floats); a row wider than 99% of the rows, or than ``width``, is keyed by
    its own number (it is an item of its own)."""
    n = ptr.size - 1
    counts = np.diff(ptr)
    # as wide as 99% of the rows (at most ``width``): the few wider rows are items of their own
    w = int(min(np.sort(counts)[(99 * n) // 100] if n else 0, width))
    key = np.zeros((n, 2 + len(columns) * w))
    key[:, 0] = counts
    wide = counts > w
    key[:, 1] = np.where(wide, np.arange(n), -1)
    rows = np.repeat(np.arange(n, dtype=np.int64), counts)
    pos = np.arange(int(ptr[-1]) - int(ptr[0])) - np.repeat(ptr[:-1] - ptr[0], counts)
    keep = ~wide[rows]
    for c, col in enumerate(columns):
        key[rows[keep], 2 + c * w + pos[keep]] = np.asarray(col, np.float64)[keep]
    return key


def _reads(d: int, MT: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """The residual directions a matrix reads (bool per direction), given its transpose as
    CSR arrays with a row per direction: those whose row holds an entry."""
    out = np.zeros(d, bool)
    out[: MT[0].size - 1] = np.diff(MT[0]) > 0
    return out
