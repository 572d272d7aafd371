"""Re-certifying after an edit: reuse what did not change, run again what might have.

Given a saved certificate (:mod:`verifier.certificates.certificate`: the old weights W, the old task
set, its query classes) and new weights W' for an edited task set, :func:`recertify` gives
the report a full ``verify`` of W' would give, running only part of the queries:

1. **What changed in the weights.** :func:`verifier.certificates.locality.diff` compares W and W' entry
   by entry under a correspondence of their numberings (given by the caller; any
   injective one that pairs indices of the same name gives a sound answer, and
   :func:`naming_problem` checks the names: a full check reads token rows and experts by
   name, so rows renamed with no array changed are another model).
2. **Which queries it can reach.** A changed entry of ``E``, of a head's ``W_Q``, ``W_K``,
   ``W_V`` (column c) matters only to queries with a token whose embedding has c; of
   ``W_O`` (value v) only to queries with a token whose embedding feeds v; of ``W_G`` or of
   an expert's ``W_1`` (column c) only to queries with a token that *reaches* c
   (:func:`verifier.certificates.locality.reaching`); of ``U`` (row t, column c) only to the logit of t,
   where the residual or the routed expert writes c. A neuron of an expert whose second
   layer or bias changed matters where it may be on: for a neuron the certificate watched,
   in the classes that recorded it as possibly on; for any other, only at queries that
   reach its first-layer row (elsewhere its pre-activation is exactly its bias, at most 0).
   A position reaching any of it, a changed ``P`` or ``b_G`` (every query's gate), tasks
   added, removed, reordered or re-templated, or other heads or experts: a full check.
3. **Which queries have new meaning.** A query's consistent tasks and valid next tokens
   depend only on its structure, on its subject's facts in the tasks through that
   structure, and (for a structure without an entity, followed by ⋆1) on those tasks'
   subject sets (``tasks.queries``). So an edit of task k's facts changes the queries of
   its changed subjects, at k's structures, and k's plain structures followed by ⋆1.
4. What runs again is chosen per subject where it can be (:class:`_Selection`): every query
   of an affected subject at an affected node, on W'; the certificate's queries of that
   subject there are taken out of their classes. A class that loses queries keeps its
   summary, now over fewer queries: its largest upper end of the error and smallest margins
   are still bounds for the rest, and stay *exact* because a class loses queries only while
   its worst query and its query of the smallest margin stay in it (else its sub-cell, the
   queries of its cell with its consistent tasks, runs again whole, as does any sub-cell
   with two classes or a class that step 5 forces). A word (every query of a node holds
   it) brings back whole cells. Every other class is reused whole: its queries compute, in
   exact arithmetic, what they computed under W, except that the vocabulary has
   Δ = |V'| − |V| more tokens, each of logit
   exactly 0 there (a new token's logit is written only where its unembedding row's
   coordinates are reached, which step 2 excludes; a removed token had logit 0 there, and
   was not a valid next token, else step 3 would have found the query). With ρ =
   1/Σ_t e^(z_t) (the probability one token of logit 0 has when the query has one; above 1
   when every token has a negative logit, so no bound of ρ is capped at 1), the error e
   becomes 1 − (1 − e)/(1 + Δρ), and ρ becomes ρ/(1 + Δρ): :func:`_grown` encloses both,
   monotone in e and ρ, rounded outward.
   The ablated error changes the same way, and so does 1 − P_ablated(o) for the object o
   alone (the error of the valid set {o}: L1's number); margins do not change. The localization check's
   L2 gap of an object query, max_{t != o} z_t − z_o bounded below from the ablated logit
   enclosures (:func:`verifier.arithmetic.logits.ablated`), changes only through the
   tokens of logit exactly 0 other than o: the witness t may be one of them, and their
   count Z moves by Δ exactly (every token added or removed is one, and none is o: a
   query whose object came or went has a changed fact, step 3). While Z > 0 before and
   after (Z + Δ > 0), a 0 is among the candidates on both sides, so the gap is the same
   number; a class keeps the smallest Z of its object queries, and is run again when it
   is 0 or Z + Δ <= 0 (the witness may come or go). L1's threshold 1 − 1/|O_k| depends on
   the task's distinct objects, which an edit may change: every reused class is compared
   with the new task set's threshold.
5. A reused class that is not decided (a failure in it, no ρ, or an updated bound within a
   band of 1e-9 of ε or of L1's threshold when Δ != 0, or an L2 gap that may change, or a margin below the band when the
   gate's longest row changed, which changes the rounding bound of every gate score in a full check) is run
   again too, so every failure in the report, and every counterexample, comes from a query
   run on W'. Every reused class is compared with the ε asked for, from its stored
   enclosures (not from counts recorded at the certificate's ε). The band keeps the verdict
   the full check's: a full check encloses the same exact values, so it can only disagree
   where its own enclosure is wider than the band.

The classes of the new run and the reused ones (with their updated bounds) form the new
certificate's table, a class run again and a reused one of the same key made one
(:func:`verifier.checks.classes.merge_classes`), and the per-task records are computed from it
(:func:`verifier.checks.classes.records`): counts, worst errors and smallest margins as a full
check's, the reused parts' enclosures as stored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import scipy.sparse as sp

from layout import Weights
from tasks.structure import structure_of
from tasks.errors import TaskError
from tasks.model import TaskSet
from tasks.queries import build_group
from tasks.structure import StructureTrie, check_routable
from verifier.arithmetic import interval as I
from verifier.passes.batches import batches_of, batches_of_subjects
from verifier.certificates.certificate import Certificate
from verifier.checks import catalogue
from verifier.checks.classes import (FLOATS, ClassRecorder, ClassTable, count_columns, merge_classes, records,
                                      set_codes)
from verifier.checks.localization import l1_thresholds
from verifier.certificates.locality import Correspondence, Diff, diff, reaching
from verifier.running.parallel import Executor
from verifier.running.runner import PassSpec, Runner
from verifier.checks.verify import (Names, Report, Tally, assemble_report, close_report, record_totals, task_records,
                                   token_map)

#: Updated bounds closer than this to ε (when the vocabulary size changed) are run again.
BAND = 1e-9


@dataclass
class Incremental:
    """What ``check --since`` did, for the report."""

    mode: str                                  # "incremental", or "full" (with ``reason``)
    reason: str = ""
    changed_weights: dict[str, int] = field(default_factory=dict)   # array -> changed entries
    changed_rows: dict[str, list] = field(default_factory=dict)     # array -> a few changed rows (labels)
    vocabulary_delta: int = 0
    cells_total: int = 0
    cells_rerun: int = 0
    classes_reused: int = 0
    classes_partly_reused: int = 0             # of them, classes that some of their queries left (run again)
    queries_rerun: int = 0
    queries_reused: int = 0
    tasks_reused: list[str] = field(default_factory=list)
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)    # seconds per step
    diff: Diff | None = None                                  # the entries that changed (not in the report)

    def mark(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - since, 3)
        return now

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "diff"}


def _grown(e_lo, e_hi, r_lo, r_hi, d: int):
    """Enclosures of e' = 1 − (1 − e)/(1 + dρ) and ρ' = ρ/(1 + dρ) for e ∈ [e_lo, e_hi],
    ρ ∈ [r_lo, r_hi] and d more tokens of logit 0 (d < 0: fewer). e' increases in e, and
    in ρ when d > 0 (decreases when d < 0); ρ' increases in ρ. NaN where 1 + dρ may be <= 0.
    ρ and ρ' are not capped at 1: a row with no token of logit 0 left has ρ' = 1/Σ_t e^(z_t),
    above 1 when its logits are all negative (ρ' = 4 for ρ = 0.8, d = −1)."""
    e_lo, e_hi, r_lo, r_hi = (np.asarray(a, float) for a in (e_lo, e_hi, r_lo, r_hi))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        r_for_hi, r_for_lo = (r_hi, r_lo) if d > 0 else (r_lo, r_hi)
        den_hi = I.up(1.0 + I.up(d * r_for_hi))          # largest 1 + dρ for the upper end of e'
        den_lo = I.down(1.0 + I.down(d * r_for_lo))      # smallest, for the lower end
        hi = I.up(1.0 - I.down(I.down(1.0 - e_hi) / den_hi))
        lo = I.down(1.0 - I.up(I.up(1.0 - e_lo) / den_lo))
        rho_hi = I.up(r_hi / I.down(1.0 + I.down(d * r_hi)))
        rho_lo = I.down(r_lo / I.up(1.0 + I.up(d * r_lo)))
        bad = ~((den_lo > 0) & (I.down(1.0 + I.down(d * r_hi)) > 0)) | ~np.isfinite(r_lo) | ~np.isfinite(r_hi)
    for a in (hi, lo, rho_hi, rho_lo):
        a[bad] = np.nan
    return np.clip(lo, 0.0, 1.0), np.clip(hi, 0.0, 1.0), np.maximum(rho_lo, 0.0), rho_hi


def vocab_array(weights: Weights) -> np.ndarray:
    """``weights.vocab`` as a numpy string array, kept on the (immutable) weights: a watcher's
    next re-certification finds it on the certificate's weights."""
    kept = weights.__dict__.get("_vocab_array")
    if kept is not None and kept[0] is weights.vocab:
        return kept[1]
    got = np.asarray(weights.vocab, dtype=str) if weights.vocab else np.zeros(0, "U1")
    got.setflags(write=False)
    weights.__dict__["_vocab_array"] = (weights.vocab, got)     # for this very tuple only
    return got


def naming_problem(old: Certificate, weights: Weights, cor: Correspondence) -> str:
    """Why the correspondence does not pair rows of the same meaning ("" if it does).

    The diff compares rows index by index under ``cor``; a full check reads rows by name
    (a token's row is the one its name labels, a task's expert the one ``expert_tasks``
    names). So every pair must carry one name: two names swapped in ``vocab`` with no array
    changed is another model (each token now reads the other's row), which a diff of the
    arrays alone would call unchanged."""
    ov, nv = vocab_array(old.weights), vocab_array(weights)
    named = cor.tokens[:ov.size]                       # then BOS's row, which has no name in vocab
    m = np.flatnonzero(named >= 0)
    same = nv is ov and m.size == ov.size and np.array_equal(named, np.arange(ov.size))   # each row its own name
    if cor.tokens.size != ov.size + 1 or cor.tokens[-1] != nv.size or \
            (m.size and not same and (named[m].max() >= nv.size or (ov[m] != nv[named[m]]).any())):
        return "the weights' vocabulary does not name its rows as the task set numbers them"
    ot, nt = list(old.weights.expert_tasks), list(weights.expert_tasks)
    if cor.experts.size != len(ot) or any(j >= len(nt) or (j >= 0 and nt[j] != ot[i])
                                          for i, j in enumerate(cor.experts.tolist())):
        return "the weights' experts are not named as the task set numbers them"
    return ""


def full_reason(old: Certificate, taskset: TaskSet, weights: Weights, epsilon: float, d: Diff) -> str:
    """Why the edit cannot be re-certified part by part ("" if it can)."""
    alone = [c.name for c in catalogue.counted() if not c.reused]
    if alone:
        return f"the check '{alone[0]}' is decided afresh for every query (its classes are not reused)"
    ots = old.taskset
    if epsilon != old.epsilon:
        return f"epsilon changed ({old.epsilon:g} -> {epsilon:g})"
    if ots.names != taskset.names:
        return "tasks were added, removed or reordered (the gate's tie-break biases of other tasks change)"
    for a, b in zip(ots.tasks, taskset.tasks):
        if a.templates != b.templates:
            return f"the templates of task '{a.name}' changed"
    if tuple(old.weights.expert_tasks) != tuple(weights.expert_tasks):
        return "the experts serve other tasks"
    if d.shape_change:
        return d.shape_change
    if d.matrices["P"].count:
        return "the position embeddings changed"
    if d.vectors["b_G"].size:
        return "the gate's biases changed (every query's gate scores)"
    if d.new_experts.size or d.gone_experts.size:
        return "experts were added or removed"
    return ""


class _Touch:
    """Tokens (new numbering) at which a changed entry may change something, experts whose
    every query may change, and old classes (by index) that may change."""

    def __init__(self, old: Certificate, new: Weights, cor: Correspondence) -> None:
        self.old, self.new, self.cor = old, new, cor
        self.tokens = np.zeros(new.E.shape[0], bool)
        #: per old expert: tokens at which something changes only for queries routed to it
        self.by_expert: dict[int, np.ndarray] = {}
        self.position = False
        self.experts: set[int] = set()          # old expert indices
        self.classes = np.zeros(len(old.table), bool)
        self._E_old = sp.csr_matrix(old.weights.E)
        self._E_new = sp.csr_matrix(new.E)
        self._first_rows: dict[int, tuple[list, list]] = {}   # per old expert: W_1 rows (new, old) to reach
        self._csr: dict = {}

    def _target(self, expert: int | None) -> np.ndarray:
        if expert is None:
            return self.tokens
        return self.by_expert.setdefault(expert, np.zeros(self.tokens.size, bool))

    def _old_tokens(self, mask_old: np.ndarray, expert: int | None = None) -> None:
        ids = self.cor.tokens[np.flatnonzero(mask_old)]
        self._target(expert)[ids[ids >= 0]] = True

    def direct(self, coords_new: np.ndarray, coords_old: np.ndarray) -> None:
        """Queries whose embeddings have one of these coordinates (read directly by W_Q, W_K, W_V)."""
        for E, P, coords, old in ((self._E_new, self.new.P, coords_new, False),
                                  (self._E_old, self.old.weights.P, coords_old, True)):
            if coords.size == 0:
                continue
            mask = np.zeros(E.shape[1], bool)
            mask[coords] = True
            rows = np.repeat(np.arange(E.shape[0]), np.diff(E.indptr))
            hit = np.zeros(E.shape[0], bool)
            hit[rows[mask[E.indices]]] = True
            if old:
                self._old_tokens(hit)
            else:
                self.tokens |= hit
            Pc = sp.csr_matrix(P)
            if Pc.nnz and mask[Pc.indices].any():
                self.position = True

    def reach(self, coords_new: np.ndarray, coords_old: np.ndarray, expert: int | None = None) -> None:
        """Queries whose residual may have one of these coordinates (with ``expert``: only those
        of them routed to that old expert)."""
        for w, coords, old in ((self.new, coords_new, False), (self.old.weights, coords_old, True)):
            if coords.size == 0:
                continue
            mask = np.zeros(w.d, bool)
            mask[coords] = True
            toks, pos = reaching(w, mask)
            self.position |= pos
            if old:
                self._old_tokens(toks, expert)
            else:
                self._target(expert)[:] |= toks

    def neuron(self, k_old: int, n_new: int | None, n_old: int | None, first_layer: bool) -> None:
        """Neuron of old expert ``k_old`` whose output may change: ``first_layer`` when its row of
        W_1 or its bias changed (or it is new or gone), else only its row of W_2."""
        k_new = int(self.cor.experts[k_old])
        e_new, e_old = self.new.experts[k_new], self.old.weights.experts[k_old]
        b_new = float(e_new.b_1[n_new]) if n_new is not None else -1.0
        b_old = float(e_old.b_1[n_old]) if n_old is not None else -1.0
        if b_new > 0 or b_old > 0:
            self.experts.add(k_old)                                  # may be on wherever routed
            return
        watched = n_old is not None and bool(self.old.watched[k_old][n_old])
        if watched and first_layer:
            self.experts.add(k_old)                                  # may turn on wherever its row is reached
            return
        if watched:
            t = self.old.table
            sel = np.flatnonzero(t.expert == k_old)
            for i in sel.tolist():
                if t.overflow[i] or n_old in t.active_of(i):
                    self.classes[i] = True
            return
        # its row of W_1 is reached where the neuron may change; collected per expert and reached
        # at once in :meth:`flush` (reaching a union of coordinates is the union of reaching each)
        rows = self._first_rows.setdefault(k_old, ([], []))
        if n_new is not None:
            rows[0].append(self._W1(e_new.W_1, (k_new, False))[n_new].indices)
        if n_old is not None:
            rows[1].append(self._W1(e_old.W_1, (k_old, True))[n_old].indices)

    def _W1(self, W_1, key) -> sp.csr_matrix:
        m = self._csr.get(key)
        if m is None:
            m = self._csr[key] = sp.csr_matrix(W_1)
        return m

    def flush(self) -> None:
        """Reach the first-layer rows collected by :meth:`neuron`, one pass per expert."""
        for k_old, (new_rows, old_rows) in sorted(self._first_rows.items()):
            union = lambda parts: np.unique(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, np.int64)  # noqa: E731
            self.reach(union(new_rows), union(old_rows), expert=k_old)
        self._first_rows.clear()

    def writers(self, coords_new: np.ndarray, coords_old: np.ndarray) -> None:
        """Neurons whose second layer writes these coordinates (a logit that changed)."""
        for k_old, k_new in enumerate(self.cor.experts.tolist()):
            if k_new < 0:
                continue
            inv = np.full(self.new.experts[k_new].width, -1, np.int64)
            nm = self.cor.neurons[k_old]
            inv[nm[nm >= 0]] = np.flatnonzero(nm >= 0)
            for W2, coords, old in ((self.new.experts[k_new].W_2, coords_new, False),
                                    (self.old.weights.experts[k_old].W_2, coords_old, True)):
                if coords.size == 0:
                    continue
                W2 = sp.csc_matrix(W2)
                mask = np.zeros(W2.shape[0], bool)
                mask[coords] = True
                cols = np.repeat(np.arange(W2.shape[1]), np.diff(W2.indptr))
                for n in np.unique(cols[mask[W2.indices]]).tolist():
                    if old:
                        self.neuron(k_old, int(nm[n]) if nm[n] >= 0 else None, n, False)
                    else:
                        self.neuron(k_old, n, int(inv[n]) if inv[n] >= 0 else None, False)


def touched(old: Certificate, new: Weights, cor: Correspondence, d: Diff) -> _Touch:
    """Step 2 of the module docstring: what each changed entry can reach."""
    T = _Touch(old, new, cor)
    M = d.matrices
    e = M["E"]
    T.tokens[e.rows] = True
    gone = np.zeros(old.weights.E.shape[0], bool)
    gone[e.gone_rows] = True
    T._old_tokens(gone)
    for m in range(len(new.heads)):
        for name in ("W_Q", "W_K", "W_V"):
            c = M[f"heads.{m}.{name}"]
            T.direct(np.unique(c.cols), np.unique(c.gone_cols))
        o = M[f"heads.{m}.W_O"]
        # a changed entry of W_O at value v: queries whose embeddings feed v through W_V
        for W_V, values, old_side in ((new.heads[m].W_V, np.unique(o.cols), False),
                                      (old.weights.heads[m].W_V, np.unique(o.gone_cols), True)):
            if values.size:
                feed = np.unique(sp.csr_matrix(W_V)[values].indices)
                T.direct(*((np.zeros(0, np.int64), feed) if old_side else (feed, np.zeros(0, np.int64))))
    g = M["W_G"]
    T.reach(np.unique(g.cols), np.unique(g.gone_cols))
    u = M["U"]
    if u.count:
        T.reach(np.unique(u.cols), np.unique(u.gone_cols))
        T.writers(np.unique(u.cols), np.unique(u.gone_cols))
    for k_old, k_new in enumerate(cor.experts.tolist()):
        if k_new < 0:
            continue
        nm = cor.neurons[k_old]
        inv = np.full(new.experts[k_new].width, -1, np.int64)
        inv[nm[nm >= 0]] = np.flatnonzero(nm >= 0)
        w1, w2 = M[f"experts.{k_new}.W_1"], M[f"experts.{k_new}.W_2"]
        # a changed entry of W_1 at (n, c): z_n changes where c is reached (in queries routed here)
        T.reach(np.unique(w1.cols), np.unique(w1.gone_cols), expert=k_old)
        first = set(d.vectors[f"experts.{k_new}.b_1"].tolist()) | set(d.vectors[f"experts.{k_new}.new"].tolist())
        for n in sorted(first):
            T.neuron(k_old, n, int(inv[n]) if inv[n] >= 0 else None, True)
        for n_old in d.vectors[f"experts.{k_new}.gone"].tolist():
            T.neuron(k_old, None, n_old, True)
        for n in np.unique(w2.cols).tolist():
            if n not in first:
                T.neuron(k_old, n, int(inv[n]) if inv[n] >= 0 else None, False)
        for n_old in np.unique(w2.gone_cols).tolist():
            n = int(nm[n_old])
            T.neuron(k_old, n if n >= 0 else None, n_old, n < 0)
    T.flush()
    return T


def changed_subjects(old: TaskSet, new: TaskSet, to_new: np.ndarray,
                     edited: set[str] | None = None) -> tuple[list[set[str]], list[bool]]:
    """Per task (same order in both): the subjects whose fact was added, removed or changed,
    and whether its set of subjects changed (step 3 of the module docstring). Tasks not in
    ``edited`` (when given: their facts are known to be equal) are not compared.

    ``to_new``: the new task set's id of each old token id (-1: gone). A token keeps its name
    exactly when it keeps its id through ``to_new``, so facts are compared as integer pairs:
    an old fact (s, o) is unchanged when the new task has subject ``to_new[s]`` with object
    ``to_new[o]`` (the fact ids are sorted by subject, so one binary search finds it)."""
    out, sets = [], []
    for k, (a, b) in enumerate(zip(old.tasks, new.tasks)):
        if edited is not None and a.name not in edited:
            out.append(set())
            sets.append(False)
            continue
        sa, oa = old.fact_ids[k]
        sb, ob = new.fact_ids[k]
        sa_new, oa_new = to_new[sa], to_new[oa]
        at = np.minimum(np.searchsorted(sb, sa_new), max(sb.size - 1, 0))
        kept = (sa_new >= 0) & (sb[at] == sa_new) if sb.size else np.zeros(sa.size, bool)
        same = kept & (ob[at] == oa_new)
        added = np.ones(sb.size, bool)
        added[at[kept]] = False
        out.append({old.vocabulary.token(i) for i in sa[~same].tolist()}
                   | {new.vocabulary.token(i) for i in sb[added].tolist()})
        sets.append(bool((~kept).any() or added.any()))
    return out, sets


def recertify(old: Certificate, taskset: TaskSet, weights: Weights, cor: Correspondence, epsilon: float, *,
              executor: Executor | None = None, jobs: int = 1, source: str = "weights",
              progress: Callable[[int, int], None] | None = None, edited: set[str] | None = None):
    """(report, class table, watched neurons per expert, :class:`Incremental`): the report a
    full check of ``weights`` would give. When the edit needs a full check, the first three
    are None and ``Incremental.reason`` says why."""
    start = t = time.perf_counter()
    info = Incremental("incremental")
    weights.validate(source)
    t = info.mark("validate", t)
    reason = naming_problem(old, weights, cor)
    if reason:
        info.mode, info.reason = "full", reason
        return None, None, None, info
    d = diff(old.weights, weights, cor)
    info.changed_weights, info.diff = d.changed, d
    t = info.mark("diff", t)
    reason = full_reason(old, taskset, weights, epsilon, d)
    if reason:
        info.mode, info.reason = "full", reason
        return None, None, None, info
    T = touched(old, weights, cor, d)
    t = info.mark("reach", t)
    if T.position or T.tokens[weights.bos]:
        info.mode, info.reason = "full", "a changed weight is reached by a position embedding or by BOS (every query)"
        return None, None, None, info
    trie = structure_of(taskset)
    check_routable(taskset, trie)
    tmap = token_map(taskset, weights, source)
    back = np.full(weights.E.shape[0], -1, np.int64)
    back[tmap] = np.arange(tmap.size)             # weights' token id -> task set's id
    table = old.table
    Δ = len(weights.vocab) - len(old.weights.vocab)
    info.vocabulary_delta = Δ
    old_rows = token_map(old.taskset, old.weights, "the certificate's weights")
    new_rows = cor.tokens[old_rows]
    old_to_new = np.where(new_rows >= 0, back[np.maximum(new_rows, 0)], -1)   # task sets' ids, by name
    ch_subj, ch_set = changed_subjects(old.taskset, taskset, old_to_new, edited)
    keys = [_key(trie, n) for n in trie]
    node_of_key = {k: i for i, k in enumerate(keys)}
    key_node = np.array([node_of_key.get(k, -1) for k in table.nodes], np.int64)
    cls_node = key_node[table.node] if len(table) else np.zeros(0, np.int64)
    if (cls_node < 0).any():
        info.mode, info.reason = "full", "the certificate's structures do not match the task set's"
        return None, None, None, info
    sel = _Selection(old, taskset, trie, keys, new_rows, back, cls_node)
    touched_ids = back[np.flatnonzero(T.tokens)]
    sel.tokens(touched_ids[touched_ids >= 0])
    for k, ch in enumerate(ch_subj):
        sel.changed(k, ch)
    for node in trie:
        if not node.has_subject and any(ch_set[k] for k in node.tasks):
            sel.whole.add((node.id, 0, None))
    # tokens at which something changed only for queries routed to one expert: their queries
    # where a class of the old table was routed to that expert
    for k_old, mask in sorted(T.by_expert.items()):
        ids = back[np.flatnonzero(mask)]
        sel.tokens(ids[ids >= 0], routed=k_old)
    counts = table.counts
    F = table.floats
    col = {name: i for i, name in enumerate(FLOATS)}
    # a class failing a check anywhere runs again (every failure reported comes from W')
    failing = table.column("foreign") > 0
    for c in catalogue.counted():
        n = table.column(c.column)
        failing |= (n > 0) if c.failures else (n < table.column("object_queries" if c.objects else "queries"))
    forced = T.classes | failing | np.isin(table.expert, list(T.experts))
    # L1's threshold of each class's task, in the new task set (|O_k| may have changed);
    # object queries are determined, so a class holding any has one consistent task
    single = np.diff(table.allowed_ptr) == 1
    cls_task = np.where(single, table.allowed[np.minimum(table.allowed_ptr[:-1], max(table.allowed.size - 1, 0))]
                        if table.allowed.size else 0, -1)
    l1_thr = l1_thresholds(taskset)[1]
    thr = np.where(cls_task >= 0, l1_thr[np.maximum(cls_task, 0)] if l1_thr.size else 0.0, 0.0)
    gap, zmin = F[:, col["ab_gap"]], F[:, col["ab_zeros"]]
    no_rho = ~(np.isfinite(F[:, col["rho_lo"]]) & np.isfinite(F[:, col["rho_hi"]]))
    no_ab_rho = (counts[:, 1] > 0) & ~(np.isfinite(F[:, col["ab_rho_lo"]]) & np.isfinite(F[:, col["ab_rho_hi"]]))
    new_floats = F.copy()
    if Δ != 0:
        forced |= no_rho | no_ab_rho
        lo, hi, rlo, rhi = _grown(F[:, col["err_lo"]], F[:, col["err_hi"]], F[:, col["rho_lo"]], F[:, col["rho_hi"]], Δ)
        alo, _, arlo, arhi = _grown(F[:, col["ab_lo"]], F[:, col["ab_lo"]], F[:, col["ab_rho_lo"]],
                                    F[:, col["ab_rho_hi"]], Δ)
        olo = _grown(F[:, col["ab_obj_lo"]], F[:, col["ab_obj_lo"]], F[:, col["ab_rho_lo"]],
                     F[:, col["ab_rho_hi"]], Δ)[0]
        has_oq = counts[:, 1] > 0
        new_floats[:, col["err_lo"]], new_floats[:, col["err_hi"]] = lo, hi
        new_floats[:, col["rho_lo"]], new_floats[:, col["rho_hi"]] = rlo, rhi
        new_floats[has_oq, col["ab_lo"]] = alo[has_oq]
        new_floats[has_oq, col["ab_obj_lo"]] = olo[has_oq]
        new_floats[has_oq, col["ab_rho_lo"]], new_floats[has_oq, col["ab_rho_hi"]] = arlo[has_oq], arhi[has_oq]
        undecided = ~(hi < epsilon - BAND) | (has_oq & ~(alo >= epsilon + BAND))
        undecided |= has_oq & (thr > 0) & ~(olo >= thr + BAND)          # L1, beside its threshold
        undecided |= has_oq & ~((zmin > 0) & (zmin + Δ > 0))            # L2: the witness may change
        forced |= undecided
        new_floats[has_oq, col["ab_zeros"]] = zmin[has_oq] + Δ
    else:
        # the stored enclosures hold as they are; compared with ε again here rather than trusting
        # the counts recorded at the certificate's ε (they agree unless the certificate was edited)
        has_oq = counts[:, 1] > 0
        forced |= ~(F[:, col["err_hi"]] < epsilon) | (has_oq & ~(F[:, col["ab_lo"]] >= epsilon))
    # L1 (at the new task set's threshold) and L2 from the stored (or updated) enclosures
    forced |= has_oq & ~(new_floats[:, col["ab_obj_lo"]] >= thr)
    forced |= has_oq & ~(gap >= 0.0)
    gate_terms = lambda w: int(np.diff(sp.csr_matrix(w.W_G).indptr).max(initial=1))  # noqa: E731
    if gate_terms(weights) != gate_terms(old.weights):
        # the gate's rounding bound counts its longest row: a full check's margins differ in the
        # last bits, so a margin within the band is decided by running it again
        forced |= ~(F[:, col["margin_all"]] > BAND)
    for i in np.flatnonzero(forced).tolist():
        sel.whole.add((int(cls_node[i]), int(table.cell[i]), tuple(table.allowed_of(i).tolist())))
    dropped, less, less_oq, fine = sel.settle()
    t = info.mark("cells", t)
    # run again: the whole sub-cells, and the single subjects' queries outside them
    ranges = sel.ranges
    whole_cells = {(n, c) for n, c, m in sel.whole if m is None}
    keep: dict[tuple, set | None] = {}
    for n, c, m in sel.whole:
        key = (n, ranges[n][c])
        if (n, c) in whole_cells:
            keep[key] = None
        elif keep.get(key, set()) is not None:
            keep.setdefault(key, set()).add(m)
    cells = sorted({(n, c) for n, c, _ in sel.whole})
    info.cells_total = sum(len(r) for r in ranges)
    served = np.array([taskset.names.index(t) if t in taskset.names else -1 for t in weights.expert_tasks], np.int64)
    off = np.concatenate([[0], np.cumsum([e.width for e in weights.experts])]).astype(np.int64)
    watched = watched_since(old, weights, cor)
    watch = np.concatenate(watched) if watched else np.zeros(0, bool)
    recorder = ClassRecorder(taskset, trie, old.plan, served, off, epsilon, watch, vocab_size=len(weights.vocab))
    names = taskset.names
    scratch = Report(epsilon, {}, task_records(taskset, weights), 0)     # the reruns' counterexamples
    scratch.routing_matrix = np.zeros((len(names), len(weights.experts)), np.int64)
    state = Tally(taskset, trie, scratch, served, epsilon, Names.of(weights), exact=True)
    cell_parts = [(nid, ranges[nid][c]) for nid, c in cells]
    rerun_count = 0
    # the experts a rerun query may need: those its class was routed to before, and the
    # edited tasks' (a query routed elsewhere is run again over the full weights)
    touched_cls = np.flatnonzero(dropped | (less > 0))
    wanted = {int(cor.experts[e]) for e in np.unique(table.expert[touched_cls]).tolist() if cor.experts[e] >= 0}
    wanted |= {int(k) for k in np.flatnonzero(np.isin(served, [taskset.index(t) for t in (edited or ())]))}
    todo = list(batches_of(taskset, trie, cell_parts, keep=keep)) + \
        list(batches_of_subjects(taskset, trie, fine, drop=sel.in_whole))
    touched_cells = set(cells)
    for batch, res in _run(taskset, trie, weights, tmap, todo, watched, served, sorted(wanted)):
        state.record(batch, res)
        recorder.record(batch, res)
        rerun_count += len(batch)
        if progress:
            progress(rerun_count, -1)
    for nid, s in fine.items():
        touched_cells.update((nid, int(c)) for c in np.unique(sel.cell_of(nid, s)).tolist())
    info.cells_rerun = len(touched_cells)
    state.finish()
    t = info.mark("rerun", t)
    # the reused classes, in the new numbering, less the queries of the subjects run again
    kept = np.flatnonzero(~dropped)
    reused = table.take(kept)
    reused.counts = reused.counts.copy()
    columns = count_columns()
    reused.counts[:, columns.index("queries")] -= less[kept]
    reused.counts[:, columns.index("object_queries")] -= less_oq[kept]
    for c in catalogue.counted():               # a class that loses queries has no failure: each query
        if not c.failures:                      # it loses held every check
            reused.counts[:, columns.index(c.column)] -= (less_oq if c.objects else less)[kept]
    reused.floats = new_floats[kept]
    reused.expert = cor.experts[reused.expert]
    reused = _map_active(reused, cor)
    fresh = recorder.table()
    merged = ClassTable.concat([reused, fresh])
    # a fresh class with the key of a reused one (a subject's query run again, beside the
    # cell's other queries) is made one with it, as a full run records them
    pair = merged.node.astype(np.int64) * (int(merged.cell.max(initial=0)) + 1) + merged.cell
    merged = merge_classes(merged, np.flatnonzero(np.isin(pair, pair[len(reused):])))
    info.classes_reused = len(reused)
    info.classes_partly_reused = int(np.count_nonzero(less[kept]))
    info.queries_rerun = rerun_count
    info.queries_reused = int(reused.counts[:, 0].sum()) if len(reused) else 0
    report = _report(taskset, weights, epsilon, merged, state)
    report.enumerated = report.queries
    t = info.mark("merge", t)
    rerun_tasks = set(fresh.allowed.tolist())
    info.tasks_reused = [names[k] for k in range(len(names)) if k not in rerun_tasks]
    info.seconds = time.perf_counter() - start
    report.seconds = report.verify_seconds = info.seconds
    return report, merged, watched, info


class _Selection:
    """What runs again (steps 2 to 5 of the module docstring), at two grains.

    * ``whole``: sub-cells (node id, cell, M), the queries of a cell whose consistent tasks
      are M, or (node id, cell, None), every query of the cell. Their classes of the
      certificate are dropped and all their queries run again.
    * single subjects, (node id, subject): every query of that subject at that node runs
      again on the new task set, and the certificate's queries of that subject there leave
      their classes (:meth:`settle`). A query's consistent tasks and valid next tokens come
      from its own subject's facts only, so a subject's queries can be taken out of a class
      and put back as run again.

    Taking queries out of a class keeps its summary sound for the rest: a largest upper end
    or smallest lower end over fewer queries is at most (at least) what it was over all.
    It keeps it *exact* while the class's worst query and its query of the smallest margin
    stay (their values are the extremes of the rest too), so a class loses queries only
    then, when it is the only class of its sub-cell (a query's class is known by its
    sub-cell alone), and when it is not forced to run again; otherwise its whole sub-cell
    runs again. Subjects are numbered in the new task set; the certificate's queries are
    built from the certificate's task set, in its numbering, and found in its cells by the
    same plan (cells are ranges of names).
    """

    def __init__(self, old: Certificate, taskset: TaskSet, trie: StructureTrie, keys: list[str],
                 new_of_old_rows: np.ndarray, back: np.ndarray, cls_node: np.ndarray) -> None:
        self.old, self.taskset, self.trie, self.cls_node = old, taskset, trie, cls_node
        self.old_ts = old.taskset
        self.old_trie = structure_of(self.old_ts)
        by_key = {_key(self.old_trie, n): n for n in self.old_trie}
        self.old_nodes = [by_key.get(k) for k in keys]
        # certificate's task-set id -> new task-set id (-1: gone), and back
        self.new_of_old = np.where(new_of_old_rows >= 0, back[np.maximum(new_of_old_rows, 0)], -1)
        self.old_of_new = np.full(taskset.vocabulary.size, -1, np.int64)
        ok = self.new_of_old >= 0
        self.old_of_new[self.new_of_old[ok]] = np.flatnonzero(ok)
        plan = old.plan
        self.thresholds = [plan.thresholds(k, taskset) for k in keys]
        self.old_thresholds = [plan.thresholds(k, self.old_ts) for k in keys]
        self.ranges = [plan.ranges(k, taskset) if trie.nodes[i].has_subject else [None] for i, k in enumerate(keys)]
        self.subject_nodes: list[list[int]] = [[] for _ in taskset.tasks]
        self.object_nodes: list[list[int]] = [[] for _ in taskset.tasks]
        self.word_nodes: dict[int, list[int]] = {}
        for node in trie:
            for k in node.tasks:
                if node.has_subject:
                    self.subject_nodes[k].append(node.id)
                if node.has_object:
                    self.object_nodes[k].append(node.id)
            for c in set(node.symbols):
                if c >= 0:
                    self.word_nodes.setdefault(int(c), []).append(node.id)
        self.whole: set[tuple[int, int, tuple | None]] = set()
        self._new: dict[int, list[np.ndarray]] = {}      # node -> subjects (new ids)
        self._gone: dict[int, list[np.ndarray]] = {}     # node -> subjects gone from the vocabulary (old ids)
        self._routed: dict[int, dict[tuple[int, int], list[int]]] = {}
        self._whole_cells: set = set()
        self._whole_sub: set = set()

    def cell_of(self, nid: int, subjects: np.ndarray) -> np.ndarray:
        t = self.thresholds[nid]
        return np.searchsorted(t, subjects, side="right") if t.size else np.zeros(np.size(subjects), np.int64)

    def _classes_routed(self, k_old: int) -> dict[tuple[int, int], list[int]]:
        """(node, cell) -> the certificate's classes there routed to expert ``k_old``."""
        out = self._routed.get(k_old)
        if out is None:
            out = {}
            t = self.old.table
            for i in np.flatnonzero(t.expert == k_old).tolist():
                out.setdefault((int(self.cls_node[i]), int(t.cell[i])), []).append(i)
            self._routed[k_old] = out
        return out

    def _add(self, nid: int, subjects: np.ndarray, routed: int | None) -> None:
        if subjects.size == 0:
            return
        if routed is not None:
            here = self._classes_routed(routed)
            cells = self.cell_of(nid, subjects)
            subjects = subjects[np.fromiter(((nid, c) in here for c in cells.tolist()), bool, cells.size)]
        if subjects.size:
            self._new.setdefault(nid, []).append(subjects)

    def tokens(self, ids: np.ndarray, routed: int | None = None) -> None:
        """The queries holding one of these tokens (new ids): every cell of a node with the
        word; for an entity, its queries as a subject, and past ⋆2 as an object, in the
        new task set and the certificate's. With ``routed``: only where a class of the
        certificate there was routed to that (old) expert."""
        ids = np.unique(np.asarray(ids, np.int64))
        if ids.size == 0:
            return
        n_words = self.taskset.vocabulary.n_words
        for w in ids[ids < n_words].tolist():
            for nid in self.word_nodes.get(w, []):
                n_cells = len(self.ranges[nid])
                if routed is None:
                    self.whole.update((nid, c, None) for c in range(n_cells))
                else:
                    t = self.old.table
                    for c in range(n_cells):
                        for i in self._classes_routed(routed).get((nid, c), []):
                            self.whole.add((nid, c, tuple(t.allowed_of(i).tolist())))
        ents = ids[ids >= n_words]
        if ents.size == 0:
            return
        old_ents = np.unique(self.old_of_new[ents])
        old_ents = old_ents[old_ents >= 0]
        for k in range(len(self.taskset.tasks)):
            for (s, o), e, to_new in ((self.taskset.fact_ids[k], ents, None),
                                      (self.old_ts.fact_ids[k], old_ents, self.new_of_old)):
                if s.size == 0 or e.size == 0:
                    continue
                as_subject, as_object = s[_member(s, e)], s[_member(o, e)]
                if to_new is not None:        # a subject gone from the vocabulary is a changed one (see changed)
                    as_subject, as_object = to_new[as_subject], to_new[as_object]
                    as_subject, as_object = as_subject[as_subject >= 0], as_object[as_object >= 0]
                for nid in self.subject_nodes[k]:
                    self._add(nid, as_subject, routed)
                for nid in self.object_nodes[k]:
                    self._add(nid, as_object, routed)

    def changed(self, k: int, names: set[str]) -> None:
        """The queries of subjects whose fact in task k was added, removed or changed: theirs
        at every node of k."""
        if not names:
            return
        vocab, old_vocab = self.taskset.vocabulary, self.old_ts.vocabulary
        new = np.array(sorted(vocab.id(n) for n in names if n in vocab), np.int64)
        gone = np.array(sorted(old_vocab.id(n) for n in names if n not in vocab and n in old_vocab), np.int64)
        for nid in self.subject_nodes[k]:
            self._add(nid, new, None)
            if gone.size:
                self._gone.setdefault(nid, []).append(gone)

    def in_whole(self, nid: int, g) -> np.ndarray:
        """Rows of a new group (node ``nid``) inside a sub-cell that runs again whole."""
        cells = self.cell_of(nid, g.subjects)
        return np.fromiter(((nid, c) in self._whole_cells or
                            (nid, c, tuple(g.allowed_of(i).tolist())) in self._whole_sub
                            for i, c in enumerate(cells.tolist())), bool, len(g))

    def _classes_of(self, keys: list[tuple], pair: np.ndarray, width: int) -> dict[tuple, list[int]]:
        """Sub-cell (node, cell, M) -> the certificate's classes in it: found by a code of
        (node, cell, M) (:func:`verifier.checks.classes.set_codes`), then compared exactly."""
        t = self.old.table
        if not keys or not len(t):
            return {}
        mult = np.uint64(0xD6E8FEB86659FD93)
        with np.errstate(over="ignore"):
            code = pair.astype(np.uint64) * mult + set_codes(t.allowed_ptr, t.allowed)
            order = np.argsort(code, kind="stable")
            sorted_code = code[order]
            m_ptr = np.zeros(len(keys) + 1, np.int64)
            np.cumsum([len(k[2]) for k in keys], out=m_ptr[1:])
            m_val = np.fromiter((x for k in keys for x in k[2]), np.int64, int(m_ptr[-1]))
            want = np.array([a * width + c for a, c, _ in keys], np.int64).astype(np.uint64) * mult + \
                set_codes(m_ptr, m_val)
        lo, hi = np.searchsorted(sorted_code, want, "left"), np.searchsorted(sorted_code, want, "right")
        out: dict[tuple, list[int]] = {}
        for key, a, b in zip(keys, lo.tolist(), hi.tolist()):
            n, c, m = key
            out[key] = [i for i in sorted(order[a:b].tolist())
                        if self.cls_node[i] == n and t.cell[i] == c and tuple(t.allowed_of(i).tolist()) == m]
        return out

    def settle(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        """(dropped, less, less_oq, subjects): per class of the certificate whether it is
        dropped (its sub-cell runs again whole, or nothing of it is left) and how many of
        its queries and object queries leave it; per node the subjects (new ids) whose
        queries run again. Adds to ``whole`` the sub-cells whose classes cannot lose queries."""
        t = self.old.table
        n = len(t)
        nodes = set(self._new) | set(self._gone)
        subj_new, subj_old = {}, {}
        for nid in nodes:
            new = np.unique(np.concatenate(self._new.get(nid, [np.zeros(0, np.int64)])))
            old = self.old_of_new[new]
            gone = self._gone.get(nid, [])
            subj_old[nid] = np.unique(np.concatenate([old[old >= 0]] + gone))
            if new.size:
                subj_new[nid] = new
        self._whole_cells = {(a, c) for a, c, m in self.whole if m is None}
        self._whole_sub = {x for x in self.whole if x[2] is not None}
        # the certificate's queries of those subjects, by sub-cell: how many, how many object
        # queries, and their names
        out: dict[tuple, list] = {}
        tok = self.old_ts.vocabulary.tokens
        for nid, S in sorted(subj_old.items()):
            if S.size == 0:
                continue
            g = build_group(self.old_ts, self.old_trie, self.old_nodes[nid], subjects=S)
            th = self.old_thresholds[nid]
            cells = np.searchsorted(th, g.subjects, side="right") if th.size else np.zeros(len(g), np.int64)
            oq = g.object_query & (g.determined >= 0)
            for i, c in enumerate(cells.tolist()):
                if (nid, c) in self._whole_cells:
                    continue
                key = (nid, c, tuple(g.allowed_of(i).tolist()))
                if key in self._whole_sub:
                    continue
                r = out.setdefault(key, [0, 0, set()])
                r[0] += 1
                r[1] += bool(oq[i])
                r[2].add((tok[int(g.subjects[i])], tok[int(g.objects[i])] if g.objects[i] >= 0 else ""))
        # the certificate's classes of those sub-cells, and of the ones run again whole
        width = int(t.cell.max(initial=0)) + 2
        pair = self.cls_node * width + t.cell
        by_sub = self._classes_of(list(out) + list(self._whole_sub), pair, width)
        less, less_oq = np.zeros(n, np.int64), np.zeros(n, np.int64)
        margin, err_hi = t.column("margin"), t.column("err_hi")
        for key, (nq, noq, names) in out.items():
            held = by_sub.get(key, [])
            i = held[0] if len(held) == 1 else -1
            if i >= 0 and t.counts[i, 0] >= nq and t.counts[i, 1] >= noq and not np.isnan(margin[i]) \
                    and t.worst[i] not in names and t.least[i] not in names \
                    and (t.worst[i][0] != "" or not np.isfinite(err_hi[i])) \
                    and (t.least[i][0] != "" or not np.isfinite(margin[i])):
                less[i], less_oq[i] = nq, noq
            elif i >= 0 and t.counts[i, 0] == nq and t.counts[i, 1] == noq:
                less[i], less_oq[i] = nq, noq          # every query of the class leaves it: dropped
            else:
                self.whole.add(key)
                self._whole_sub.add(key)
        dropped = np.isin(pair, [a * width + c for a, c in self._whole_cells])
        for key in self._whole_sub:
            for i in by_sub.get(key, []):
                dropped[i] = True
        dropped |= (less > 0) & (t.counts[:, 0] - less <= 0)
        return dropped, less, less_oq, subj_new


def _run(taskset: TaskSet, trie, weights: Weights, tmap: np.ndarray, todo: list, watched: list[np.ndarray],
         served: np.ndarray, experts: list[int] | None = None):
    """(batch, result) for the batches ``todo``, run on the weights cut to their cone
    (:meth:`verifier.running.runner.Runner.run_cut`: bitwise the full pass's results), rows reaching
    beyond it (a candidate expert outside) run again on the full weights."""
    if not todo:
        return iter(())
    # E keeps the rows of the query tokens only; a valid next token needs just its U row and
    # a compact id (verifier.running.shards: the claim is about the tokens the queries contain)
    inputs = np.unique(np.concatenate([tmap[b.tokens].reshape(-1) for b in todo]))
    tokens = np.union1d(inputs, np.concatenate([tmap[b.valid] for b in todo]))
    if experts is None:
        tasks = np.unique(np.concatenate([b.allowed for b in todo]))
        experts = np.flatnonzero(np.isin(served, tasks))
    runner = Runner(weights, tmap, PassSpec.for_taskset(taskset, weights, tmap), watched=watched)
    return runner.run_cut(todo, runner.part(np.asarray(experts, np.int64), inputs, tokens))


def _member(x: np.ndarray, sorted_values: np.ndarray) -> np.ndarray:
    """Bool mask: which of ``x`` are in the sorted array."""
    if sorted_values.size == 0 or x.size == 0:
        return np.zeros(x.size, bool)
    pos = np.minimum(np.searchsorted(sorted_values, x), sorted_values.size - 1)
    return sorted_values[pos] == x


def _key(trie, node) -> str:
    from verifier.checks.classes import node_key
    return node_key(trie, node)


def watched_since(old: Certificate, new: Weights, cor: Correspondence) -> list[np.ndarray]:
    """The watched neurons in the new numbering: exactly the old ones that remain. A new
    neuron is never watched: the reused classes recorded nothing about it, so a later edit
    must locate it by the tokens that reach its first-layer row (always sound)."""
    out = [np.zeros(e.width, bool) for e in new.experts]
    for k_old, k_new in enumerate(cor.experts.tolist()):
        if k_new < 0:
            continue
        nm = cor.neurons[k_old]
        ok = nm >= 0
        out[k_new][nm[ok]] = old.watched[k_old][ok]
    return out


def _map_active(t: ClassTable, cor: Correspondence) -> ClassTable:
    """Active neuron lists of reused classes in the new numbering (a neuron that is gone is dropped).
    ``t.expert`` is already new; each list is mapped through its old expert's neuron map."""
    inv_exp = np.full(max(int(cor.experts.max(initial=-1)) + 1, 1), -1, np.int64)
    ok = cor.experts >= 0
    inv_exp[cor.experts[ok]] = np.flatnonzero(ok)
    counts = np.diff(t.active_ptr)
    owner = np.repeat(np.arange(len(t)), counts)
    # every old expert's neuron map laid end to end: an active neuron n of old expert k is
    # entry start[k] + n
    start = np.concatenate([[0], np.cumsum([m.size for m in cor.neurons])]).astype(np.int64)
    flat = np.concatenate([np.asarray(m, np.int64) for m in cor.neurons] + [np.zeros(0, np.int64)])
    k_old = inv_exp[t.expert[owner]] if owner.size else np.zeros(0, np.int64)
    width = np.diff(start)
    if owner.size and ((k_old < 0) | (t.active < 0) | (t.active >= width[np.maximum(k_old, 0)])).any():
        raise TaskError("the certificate's active neuron lists name neurons its experts do not have",
                        fix="write the certificate again with 'check --certificate DIR'")
    mapped = flat[start[k_old] + t.active] if owner.size else np.zeros(0, np.int64)
    keep = mapped >= 0
    new_counts = np.bincount(owner[keep], minlength=len(t)) if owner.size else np.zeros(len(t), np.int64)
    ptr = np.zeros(len(t) + 1, np.int64)
    np.cumsum(new_counts, out=ptr[1:])
    t.active_ptr, t.active = ptr, mapped[keep]
    return t


def _report(taskset: TaskSet, weights: Weights, epsilon: float, table: ClassTable, state: Tally) -> Report:
    """The report from the merged classes; counterexamples from the queries run again."""
    report = assemble_report(taskset, weights, epsilon, 0)
    record_totals(report, records(table, taskset, len(weights.experts)))
    report.counterexamples = list(state.report.counterexamples)
    close_report(report, [e.width for e in weights.experts])
    return report
