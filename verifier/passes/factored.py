"""The factored pass: the exact certified pass, with what query rows share enclosed once.

The queries of one template structure differ only in their entities: "the capital of
France is" and "the capital of Italy is" have the same words at the same positions, the
same attention pattern (every entity of an attention class looks alike to the heads'
queries and keys), and in most heads the same values (a structure head reads "an entity
is here", not which one). Only a few terms of such a row are its own: its last token's
embedding when that is an entity, and its entities' value rows in the heads where
entities differ (the subject head's "which entity"). So the residual is written

    r_i = s_c + o_i,

the *shared part* s_c of the row's **cohort** c and the row's **own part** o_i, where

* the **split** (:class:`Split`) says which terms are own: an entity token's E row (at
  the last position) and its value rows in the *diverse* heads, those in which two
  entities of the task set have different value rows (decided exactly on the
  embeddings: every entity's E row agrees on the coordinates W_V reads, or not);
* the **cohort key** of a row is its tokens with each entity replaced by its attention
  class (the class of bitwise-equal query/key projections, :class:`Prepared`): rows with
  one key have bitwise the same attention enclosures and the same shared terms, so s_c
  (every term of the row but its own, in the plain pass's order) is a function of the
  key alone, enclosed once per cohort.

The kernels (each stage's factored twin: :func:`verifier.arithmetic.residual.residual_part`,
:func:`verifier.arithmetic.gate.gate_parts`, :func:`verifier.arithmetic.experts.experts_parts`,
:func:`verifier.arithmetic.logits.ablated_parts`) carry the two parts through the gate,
the experts and the softmax, enclosing once per cohort (or per cohort and expert) what
the rows share and per row what its own part touches; their docstrings give the
arguments. A row's result depends on the row, the weights and the split only, never on
which other rows share its batch, so it is the same in every batch, on every shard cut
(a cut gets the full weights' split: :meth:`Split.cut`) and in a re-certification.

The enclosures are not bitwise those of the plain pass (:mod:`verifier.passes.forward`):
the same exact terms are summed along other trees, with the rounding bounds those
trees need. Both contain the exact values. The plain pass still runs the deployed pass
of a floating-point format, the scaled gate ("top1-scaled"), and :func:`verifier.checks.certify`.
The argmax token of a row is the largest logit midpoint, ties going to the smaller token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from layout import Weights
from verifier.arithmetic import interval as I
from verifier.arithmetic import experts as experts_k
from verifier.arithmetic import exponential, rounding
from verifier.arithmetic import gate as gate_k
from verifier.arithmetic import logits as logits_k
from verifier.arithmetic import residual as residual_k
from verifier.passes.batches import take_csr
from verifier.passes.forward import (ACTIVE_SLOTS, LOGITS_PER_RUN, BatchResult, Prepared, _row_runs, _unique_rows,
                                     attention)


@dataclass(frozen=True)
class Split:
    """Which terms of a query row are its own (the rest are its cohort's).

    ``entity``: per token of the weights (BOS included, last), whether it is an entity of
    the task set; ``diverse``: per head, whether two entities have different value rows
    there (then each entity's value row in that head is its row's own term)."""

    entity: np.ndarray
    diverse: tuple[bool, ...]

    @staticmethod
    def of(weights: Weights, entities: np.ndarray) -> "Split":
        """The split for the entity tokens ``entities`` (weights' token ids)."""
        V1 = weights.E.shape[0]
        mask = np.zeros(V1, bool)
        entities = np.unique(np.asarray(entities, np.int64))
        mask[entities] = True
        return Split(mask, diverse_heads(weights, entities))

    def cut(self, tokens: np.ndarray) -> "Split":
        """The split of a cut of the weights whose token i is the full weights' ``tokens[i]``
        (BOS the cut's last): the same tokens own the same terms (the heads are not renumbered)."""
        return Split(np.append(self.entity[np.asarray(tokens, np.int64)], False), self.diverse)


def diverse_heads(weights: Weights, entities: np.ndarray) -> tuple[bool, ...]:
    """Per head: do two of the ``entities`` have different value rows?

    *Exactly decided.* A token's value row in head m, W_O W_V E[x] as the pass encloses it
    (:class:`verifier.passes.forward.Prepared`: a sparse product row by row), depends on
    the entries of its E row in the coordinates W_V reads and on nothing else: the other
    entries meet empty rows of W_V^T and form no term. So entities whose E rows agree
    bitwise there have bitwise equal value rows, and a head where they all agree is not
    diverse. (Agreeing rows that come from different E rows are counted as different: a
    head is then called diverse without need, which costs speed, never soundness.)"""
    E = I.as_csr(weights.E)[np.asarray(entities, np.int64)]
    E.sort_indices()
    rows = np.repeat(np.arange(E.shape[0]), np.diff(E.indptr))
    out = []
    for h in weights.heads:
        if E.shape[0] < 2:
            out.append(False)
            continue
        reads = np.diff(sp.csc_matrix(h.W_V).indptr) > 0        # the coordinates W_V reads
        keep = reads[E.indices]
        counts = np.bincount(rows[keep], minlength=E.shape[0])
        if (counts != counts[0]).any():
            out.append(True)
            continue
        c0 = int(counts[0])
        if c0 == 0:                                            # no entity has a value here
            out.append(False)
            continue
        idx = E.indices[keep].reshape(-1, c0)
        val = np.ascontiguousarray(E.data[keep], np.float64).reshape(-1, c0)
        same = (idx == idx[:1]).all() and (val.view(np.int64) == val[:1].view(np.int64)).all()
        out.append(not bool(same))
    return tuple(out)


class FactoredPass:
    """The exact certified pass of some weights, factored over cohorts (the pass protocol of
    :class:`verifier.passes.protocol.Pass`): built on :class:`Prepared`'s tables, with
    ``split`` the full weights'. Weights in gate mode "top1-scaled" and the deployed pass
    run :class:`Prepared`'s plain pass."""

    def __init__(self, prep: Prepared, split: Split) -> None:
        if prep.deployed is not None:
            raise ValueError("the factored pass is the exact pass; a deployed format runs the plain one")
        V1 = prep.weights.E.shape[0]
        if split.entity.shape != (V1,) or len(split.diverse) != prep.n_heads:
            raise ValueError("the split does not fit these weights")
        self.prep = prep
        self.split = split
        self.weights = prep.weights
        self.entity = np.ascontiguousarray(split.entity, bool)
        self.factored = prep.weights.gate_mode == "top1"
        self._scratch = None

    @property
    def layer(self):
        """The gate and experts as the kernels read them (:class:`verifier.passes.tables.LayerTables`)."""
        return self.prep.layer

    @property
    def watch(self) -> np.ndarray:
        return self.prep.watch

    @watch.setter
    def watch(self, mask: np.ndarray) -> None:
        self.prep.watch = mask

    def run_batch(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
                  ablate: np.ndarray | None = None, scores: bool = True,
                  target: np.ndarray | None = None) -> BatchResult:
        """The certified pass over a batch (as :func:`verifier.passes.forward.run_batch`)."""
        if not self.factored:
            return self.prep.run_batch(tokens, valid_ptr, valid, ablate=ablate, scores=scores, target=target)
        return run_batch(self, tokens, valid_ptr, valid, ablate=ablate, scores=scores, target=target)

    def scratch(self) -> dict:
        """Work arrays of the factored kernels (allocated once per process, on first use)."""
        if self._scratch is None:
            rounding.check()
            w = self.prep.weights
            d, V, width = max(w.d, 1), max(len(w.vocab), self.prep.vocab_size, 1), max(self.prep.layer.max_width, 1)

            def spa(size):
                """A compact accumulator over ``size`` columns (accumulate.slot): (acc, touched, where).
                Only its first slots are written (np.zeros: untouched pages cost nothing) and
                ``where`` is 4 bytes per column. Stamp 0 is no row's (Prepared.stamps starts at 1)."""
                if size >= 2 ** 31:
                    raise ValueError(f"{size} columns: the accumulators' slot maps hold 32-bit slots")
                return np.zeros((size, 5)), np.zeros(size, np.int64), np.zeros(size, np.int32)

            # a cohort's logit table (verifier.arithmetic.logits.cohort_table): tokens, mid, rad,
            # exp bounds, by midpoint, by lower end, sorted tokens and their positions
            table = (np.zeros(V, np.int64), np.zeros(V), np.zeros(V), np.zeros(V), np.zeros(V),
                     np.zeros(V, np.int64), np.zeros(V, np.int64), np.zeros(V, np.int64), np.zeros(V, np.int64))
            K = len(w.experts)
            self._scratch = {"z": spa(width), "z_own": spa(width), "y": spa(d), "L": spa(V),
                             "g": (np.zeros(K), np.full(K, -1.0), np.zeros(K, np.int64)),
                             # per slot of "z": the shared z and activity
                             "shared_z": (np.zeros(width), np.zeros(width), np.zeros(width), np.zeros(width),
                                          np.zeros(width, bool)),
                             "v": np.zeros(V), "table": table,
                             # the watched shared neurons, their count last (experts._record)
                             "watched": np.zeros(width + 1, np.int64),
                             "memo": np.full((4, exponential.MEMO), np.nan),
                             "u": (np.zeros(d), np.zeros(d), np.zeros((d, 2)))}
        return self._scratch

    def trim_scratch(self) -> None:
        """Let the work arrays go when a batch used more than ``SPILL`` slots of an
        accumulator: only a cohort that reaches a whole task's subjects (the query before
        its subject, whose valid next tokens are all of them) does, and its slots, its
        logit table and their pages would otherwise stay resident in the worker for the
        rest of the pass. The next batch allocates them anew, as untouched zeros. Nothing
        kept there outlives a batch (stamps are never reused; the exp memo is a cache)."""
        sc = self._scratch
        if sc is None:
            return
        for key in ("y", "L", "z", "z_own"):
            acc = sc[key][0]
            if acc.shape[0] > SPILL and acc[SPILL, 0] != 0.0:
                self._scratch = None
                return


#: Slots of an accumulator beyond which a batch's work arrays are let go afterwards
#: (FactoredPass.trim_scratch): 1M slots, 40 MB of one accumulator.
SPILL = 1 << 20

def cohorts(entity: np.ndarray, ids: np.ndarray, qk_class: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first row of each cohort, cohort of each row) for rows ``ids`` (BOS included; ``entity``
    per token, the split's): the key is the row's tokens with each entity replaced by
    −1 − its attention class; the rows of one key, exactly (grouped by a hash first, then
    compared entry by entry: :func:`verifier.passes.forward._unique_rows`)."""
    return _unique_rows(np.where(entity[ids], -1 - qk_class[ids].astype(np.int64), ids))


def residual_parts(prep: Prepared, split: Split, ids: np.ndarray, scratch: tuple, entity: np.ndarray | None = None):
    """(S, O, cohort) of rows ``ids`` (BOS included): the shared parts s_c of their cohorts
    and each row's own part o_i (:func:`verifier.arithmetic.residual.residual_part`; the
    module docstring), r_i = s_{cohort[i]} + o_i term by term. ``scratch``: a compact
    accumulator over the residual directions; ``entity`` the split's, narrowed to these
    weights' tokens (default ``split.entity``)."""
    w = prep.weights
    entity = split.entity if entity is None else entity
    own = np.ascontiguousarray(entity[ids])
    first, cohort = cohorts(entity, ids, prep.qk_class)
    cohort = np.ascontiguousarray(cohort, np.int64)
    # a cohort's rows have one attention class per position, hence one attention row
    att_c, am, ar = attention(prep, np.ascontiguousarray(ids[first]))
    att = np.ascontiguousarray(att_c[cohort])
    heads = (prep.n_heads, prep.v_row, w.P.shape[0])
    E, P = prep.E_arrays, prep.P_arrays
    OE = (prep.OE.indptr, prep.OE.indices, prep.OE.mid, prep.OE.rad)
    OP = (prep.OP.indptr, prep.OP.indices, prep.OP.mid, prep.OP.rad)
    diverse = np.asarray(split.diverse, bool).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        S = residual_k.residual_part(np.ascontiguousarray(ids[first]), np.ascontiguousarray(own[first]), diverse, True,
                                     (np.ascontiguousarray(att_c), am, ar), E, P, OE, OP, heads, scratch,
                                     prep.stamps(first.size))
        O = residual_k.residual_part(ids, own, diverse, False, (att, am, ar), E, P, OE, OP, heads, scratch,
                                     prep.stamps(ids.shape[0]))
    return S, O, cohort


def _reduce_pairs(n: int, rows: np.ndarray, values: tuple, single: bool) -> tuple:
    """Per row, (min of lower ends, max of upper ends, fmin, fmax) over its pairs' values
    (err_lo, err_hi, rho_lo, rho_hi): one pair per row is assigned directly."""
    err_lo, err_hi = np.full(n, np.inf), np.full(n, -np.inf)
    rho_lo, rho_hi = np.full(n, np.inf), np.full(n, -np.inf)
    lo, hi, r_lo, r_hi = values
    bad_rho = ~(np.isfinite(r_lo) & np.isfinite(r_hi))
    if single:
        err_lo[rows], err_hi[rows] = lo, hi
        rho_lo[rows], rho_hi[rows] = np.where(bad_rho, np.nan, r_lo), r_hi
    else:
        np.minimum.at(err_lo, rows, lo)
        np.maximum.at(err_hi, rows, hi)
        np.fmin.at(rho_lo, rows, r_lo)
        np.fmax.at(rho_hi, rows, r_hi)
        rho_lo[rows[bad_rho]] = np.nan                      # any candidate without a ρ: none for the row
    return err_lo, err_hi, rho_lo, rho_hi


def run_batch(fp: FactoredPass, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
              ablate: np.ndarray | None = None, scores: bool = True, target: np.ndarray | None = None) -> BatchResult:
    """The factored certified pass of a batch (n x p token ids, weights' ids; BOS is added):
    the arguments and the result of :func:`verifier.passes.forward.run_batch`."""
    prep = fp.prep
    w = prep.weights
    tokens = np.asarray(tokens, np.int64)
    if tokens.ndim == 1:
        tokens = tokens[None, :]
    n = tokens.shape[0]
    V = prep.vocab_size
    vptr = np.asarray(valid_ptr, np.int64)
    vals = np.asarray(valid, np.int64)
    target = np.full(n, -1, np.int64) if target is None else np.ascontiguousarray(target, np.int64)
    # the kernels index per-token arrays by these ids, unchecked: each must be a token
    if (tokens.size and (tokens.min() < 0 or tokens.max() > V)) or (vals.size and (vals.min() < 0 or vals.max() >= V)) \
            or (target.size and target.max() >= V) or target.size != n \
            or vptr.size != n + 1 or (n and (vptr[0] != 0 or vptr[-1] != vals.size or (np.diff(vptr) < 0).any())):
        raise ValueError("tokens (BOS included), valid next tokens and targets must be token ids of the weights, "
                         "the valid ones in a CSR of one row per query")
    if tokens.size and tokens.max() >= w.E.shape[0]:
        raise ValueError("a query token has no row of E in these weights")
    ablate = np.ones(n, bool) if ablate is None else np.asarray(ablate, bool)
    ids = np.ascontiguousarray(np.concatenate([np.full((n, 1), w.bos, np.int64), tokens], axis=1))
    S, O, cohort = residual_parts(prep, fp.split, ids, fp.scratch()["y"], fp.entity)
    sc = fp.scratch()
    order = np.argsort(cohort, kind="stable")
    K = len(w.experts)
    G = np.empty((n, K)) if scores else np.empty((1, 1))
    gmid, gstamp, gtouched = sc["g"]
    with np.errstate(invalid="ignore", over="ignore"):
        e, margin, Grad, top, top_lo, top_hi, cand_row, cand = gate_k.gate_parts(
            S, O, cohort, order, prep.layer.WGT, prep.layer.wg_colmax, prep.layer.b_G, prep.layer.wg_max_terms,
            gmid, gstamp, gtouched, prep.stamps(n), G, scores)
    per_row = np.bincount(cand_row, minlength=n)
    single = n == 0 or per_row.max() == 1
    cand_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(per_row, out=cand_ptr[1:])
    by_row = np.argsort(cand_row, kind="stable")
    cands = (cand_ptr, cand[by_row])
    # the pairs (row, candidate expert), grouped by (cohort, expert)
    grp = np.lexsort((cand, cohort[cand_row]))
    p_rows, p_exp = np.ascontiguousarray(cand_row[grp]), np.ascontiguousarray(cand[grp], np.int64)

    predicted = np.full(n, -1, np.int64)
    ab_lo, ab_hi = np.full(n, np.nan), np.full(n, np.nan)
    ab_rho_lo, ab_rho_hi = np.full(n, np.nan), np.full(n, np.nan)
    ab_gap, ab_zeros = np.full(n, np.nan), np.full(n, -1, np.int64)
    ab_obj = np.full(n, np.nan)
    R_ACT = ACTIVE_SLOTS
    active = np.full((n, R_ACT + 1), -1, np.int64)
    active[:, R_ACT] = 0
    UT = prep.UT_arrays
    expert_args = (prep.layer.W1T, prep.layer.first, prep.layer.W2T, UT, V)
    scratch = (*sc["z"], *sc["shared_z"], *sc["z_own"], *sc["y"], *sc["L"], sc["v"], sc["table"], sc["watched"],
               sc["memo"])
    ab_sorted = order[ablate[order]]                        # ablated rows, grouped by cohort
    bound_o = logits_k.logits_bound(O[0], O[1], UT[0])
    bound_s = logits_k.logits_bound(S[0], S[1], UT[0])
    if int(bound_o.sum()) + int(bound_s.sum()) <= LOGITS_PER_RUN:
        runs = [(np.arange(n), 0, S[0].size - 1, p_rows, p_exp, ab_sorted)]
    else:
        # Rows in runs (in cohort order) whose logits stay within a bound, so that memory is
        # bounded for any unembedding; each run with the shared logits of its cohorts.
        runs = []
        for a, b in _row_runs(bound_o[order] + bound_s[cohort[order]], LOGITS_PER_RUN):
            rows = order[a:b]
            in_run = np.zeros(n, bool)
            in_run[rows] = True
            sel = in_run[p_rows]
            runs.append((rows, int(cohort[rows[0]]), int(cohort[rows[-1]]) + 1, p_rows[sel], p_exp[sel],
                         ab_sorted[in_run[ab_sorted]]))
    out_pairs = []
    for rows, c0, c1, q_rows, q_exp, ab_rows in runs:
        whole = rows.size == n
        # the run's rows renumbered from 0 (the whole batch: as they are)
        local = None if whole else np.full(n, -1, np.int64)
        if local is not None:
            local[rows] = np.arange(rows.size)
        Sr = S if whole else _rows(S, np.arange(c0, c1))
        Or = O if whole else _rows(O, rows)
        vp, vv = (vptr, vals) if whole else take_csr(vptr, vals, rows)
        coh = cohort if whole else np.ascontiguousarray(cohort[rows] - c0)
        tg = target if whole else np.ascontiguousarray(target[rows])
        lr = q_rows if whole else np.ascontiguousarray(local[q_rows])
        with np.errstate(invalid="ignore", over="ignore"):
            Ls = _logits(prep, sc, Sr, bound_s[c0:c1])
            Lo = _logits(prep, sc, Or, bound_o[rows] if not whole else bound_o)
            act = np.full((q_rows.size, R_ACT + 1), -1, np.int64)
            act[:, R_ACT] = 0
            lo, hi, pred, r_lo, r_hi = experts_k.experts_parts((lr, q_exp), coh, Sr, Or, Ls, Lo, *expert_args, (vp, vv),
                                                        scratch, prep.stamps(2 * q_rows.size), prep.watch, act)
            out_pairs.append((q_rows, q_exp, lo, hi, pred, r_lo, r_hi, act))
            if ab_rows.size:
                la = ab_rows if whole else np.ascontiguousarray(local[ab_rows])
                sc_L = sc["L"]
                res = logits_k.ablated_parts(la, coh, Ls, Lo, V, vp, vv, sc_L, sc["v"], sc["table"], sc["memo"],
                                       prep.stamps(3 * ab_rows.size), tg, Sr, Or, prep.U_arrays, sc["u"])
                (ab_lo[ab_rows], ab_hi[ab_rows], ab_rho_lo[ab_rows], ab_rho_hi[ab_rows], ab_gap[ab_rows],
                 ab_zeros[ab_rows], ab_obj[ab_rows]) = res
    q_rows, q_exp, lo, hi, pred, r_lo, r_hi, act = (np.concatenate(x) for x in zip(*out_pairs)) if len(out_pairs) > 1 \
        else out_pairs[0]
    err_lo, err_hi, rho_lo, rho_hi = _reduce_pairs(n, q_rows, (lo, hi, r_lo, r_hi), single)
    routed = q_exp == e[q_rows]
    predicted[q_rows[routed]] = pred[routed]
    active[q_rows[routed]] = act[routed]
    undecided = ~np.isfinite(Grad)                          # the gate cannot say which expert wins
    err_lo[undecided], err_hi[undecided] = 0.0, 1.0
    rho_lo[undecided | ~np.isfinite(rho_lo)] = np.nan
    rho_hi[np.isnan(rho_lo)] = np.nan
    Gm = G if scores else None
    fp.trim_scratch()
    return BatchResult(e, margin, ~(margin > 0), Gm, Grad, err_lo, err_hi, ab_lo, ab_hi, predicted,
                       (top, top_lo, top_hi), cands, rho_lo, rho_hi, ab_rho_lo, ab_rho_hi, active, ab_gap,
                       ab_zeros, ab_obj)


def _rows(X: tuple, idx: np.ndarray) -> tuple:
    """Rows ``idx`` of a CSR part (ptr, idx, mid, rad), in that order."""
    ptr, cols, mid, rad = X
    if idx.size == ptr.size - 1 and np.array_equal(idx, np.arange(idx.size)):
        return X
    counts = ptr[idx + 1] - ptr[idx]
    new = np.zeros(idx.size + 1, np.int64)
    np.cumsum(counts, out=new[1:])
    pos = np.repeat(ptr[idx] - new[:-1], counts) + np.arange(int(new[-1]))
    return new, np.ascontiguousarray(cols[pos]), np.ascontiguousarray(mid[pos]), np.ascontiguousarray(rad[pos])


def _logits(prep: Prepared, sc: dict, X: tuple, bound: np.ndarray) -> tuple:
    """U·X for the rows of a part (:func:`verifier.arithmetic.logits.logits`)."""
    UT = prep.UT_arrays
    return logits_k.logits(X[0], X[1], X[2], X[3], UT[0], UT[1], UT[2], *sc["L"], prep.stamps(X[0].size - 1),
                     max(int(bound.sum()), 1))
