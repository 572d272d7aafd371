"""Re-certifying after an edit: reuse what did not change, run again what might have.

Given a saved certificate (:mod:`verifier.certificate`: the old weights W, the old task
set, its query classes) and new weights W' for an edited task set, :func:`recertify` gives
the report a full ``verify`` of W' would give, running only part of the queries:

1. **What changed in the weights.** :func:`verifier.locality.diff` compares W and W' entry
   by entry under a correspondence of their numberings (given by the caller; any
   injective one gives a sound answer).
2. **Which queries it can reach.** A changed entry of ``E``, of a head's ``W_Q``, ``W_K``,
   ``W_V`` (column c) matters only to queries with a token whose embedding has c; of
   ``W_O`` (value v) only to queries with a token whose embedding feeds v; of ``W_G`` or of
   an expert's ``W_1`` (column c) only to queries with a token that *reaches* c
   (:func:`verifier.locality.reaching`); of ``U`` (row t, column c) only to the logit of t,
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
4. The **cells** (``verifier.classes``) holding any such query are run again, on W'. Every
   other class is reused: its queries compute, in exact arithmetic, what they computed
   under W, except that the vocabulary has Δ = |V'| − |V| more tokens, each of logit
   exactly 0 there (a new token's logit is written only where its unembedding row's
   coordinates are reached, which step 2 excludes; a removed token had logit 0 there, and
   was not a valid next token, else step 3 would have found the query). With ρ the
   probability one token of logit 0 has, the error e becomes 1 − (1 − e)/(1 + Δρ), and ρ
   becomes ρ/(1 + Δρ): :func:`_grown` encloses both, monotone in e and ρ, rounded outward.
   The ablated error changes the same way; margins do not change.
5. A reused class that is not decided (a failure in it, no ρ, or an updated bound within a
   band of 1e-9 of ε when Δ != 0, or a margin below the band when the gate's longest row
   changed, which changes the rounding bound of every gate score in a full check) is run
   again too, so every failure in the report, and every counterexample, comes from a query
   run on W'. The band keeps the verdict the full check's: a full check encloses the same
   exact values, so it can only disagree where its own enclosure is wider than the band.

The classes of the new run and the reused ones (with their updated bounds) form the new
certificate's table, and the per-task records are computed from it
(:func:`verifier.classes.records`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import scipy.sparse as sp

from layout import Weights
from tasks.errors import TaskError
from tasks.model import TaskSet
from tasks.structure import StructureTrie, check_routable
from verifier.batches import batches_of
from verifier.certificate import Certificate
from verifier.classes import FLOATS, ClassRecorder, ClassTable, records
from verifier.locality import Correspondence, Diff, diff, reaching
from verifier.parallel import Executor, LocalPool
from verifier.verify import Report, Shard, TaskRecord, _State, token_map, verify_batch

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
    queries_rerun: int = 0
    queries_reused: int = 0
    tasks_reused: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _up(x):
    return np.nextafter(x, np.inf)


def _down(x):
    return np.nextafter(x, -np.inf)


def _grown(e_lo, e_hi, r_lo, r_hi, d: int):
    """Enclosures of e' = 1 − (1 − e)/(1 + dρ) and ρ' = ρ/(1 + dρ) for e ∈ [e_lo, e_hi],
    ρ ∈ [r_lo, r_hi] and d more tokens of logit 0 (d < 0: fewer). e' increases in e, and
    in ρ when d > 0 (decreases when d < 0); ρ' increases in ρ. NaN where 1 + dρ may be <= 0."""
    e_lo, e_hi, r_lo, r_hi = (np.asarray(a, float) for a in (e_lo, e_hi, r_lo, r_hi))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        r_for_hi, r_for_lo = (r_hi, r_lo) if d > 0 else (r_lo, r_hi)
        den_hi = _up(1.0 + _up(d * r_for_hi))          # largest 1 + dρ for the upper end of e'
        den_lo = _down(1.0 + _down(d * r_for_lo))      # smallest, for the lower end
        hi = _up(1.0 - _down(_down(1.0 - e_hi) / den_hi))
        lo = _down(1.0 - _up(_up(1.0 - e_lo) / den_lo))
        rho_hi = _up(r_hi / _down(1.0 + _down(d * r_hi)))
        rho_lo = _down(r_lo / _up(1.0 + _up(d * r_lo)))
        bad = ~((den_lo > 0) & (_down(1.0 + _down(d * r_hi)) > 0)) | ~np.isfinite(r_lo) | ~np.isfinite(r_hi)
    for a in (hi, lo, rho_hi, rho_lo):
        a[bad] = np.nan
    return np.clip(lo, 0.0, 1.0), np.clip(hi, 0.0, 1.0), np.maximum(rho_lo, 0.0), np.minimum(rho_hi, 1.0)


def full_reason(old: Certificate, taskset: TaskSet, weights: Weights, epsilon: float, d: Diff) -> str:
    """Why the edit cannot be re-certified part by part ("" if it can)."""
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
        cn = sp.csr_matrix(e_new.W_1)[n_new].indices if n_new is not None else np.zeros(0, np.int64)
        co = sp.csr_matrix(e_old.W_1)[n_old].indices if n_old is not None else np.zeros(0, np.int64)
        self.reach(np.asarray(cn, np.int64), np.asarray(co, np.int64), expert=k_old)

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
    return T


def changed_subjects(old: TaskSet, new: TaskSet) -> tuple[list[set[str]], list[bool]]:
    """Per task (same order in both): the subjects whose fact was added, removed or changed,
    and whether its set of subjects changed (step 3 of the module docstring)."""
    out, sets = [], []
    for a, b in zip(old.tasks, new.tasks):
        fa, fb = dict(a.facts.items()), dict(b.facts.items())
        ch = {s for s in fa.keys() | fb.keys() if fa.get(s) != fb.get(s)}
        out.append(ch)
        sets.append(fa.keys() != fb.keys())
    return out, sets


def recertify(old: Certificate, taskset: TaskSet, weights: Weights, cor: Correspondence, epsilon: float, *,
              executor: Executor | None = None, jobs: int = 1, source: str = "weights",
              progress: Callable[[int, int], None] | None = None):
    """(report, class table, watched neurons per expert, :class:`Incremental`): the report a
    full check of ``weights`` would give. When the edit needs a full check, the first three
    are None and ``Incremental.reason`` says why."""
    start = time.perf_counter()
    weights.validate(source)
    d = diff(old.weights, weights, cor)
    reason = full_reason(old, taskset, weights, epsilon, d)
    info = Incremental("incremental", changed_weights=d.changed)
    if reason:
        info.mode, info.reason = "full", reason
        return None, None, None, info
    T = touched(old, weights, cor, d)
    if T.position or T.tokens[weights.bos]:
        info.mode, info.reason = "full", "a changed weight is reached by a position embedding or by BOS (every query)"
        return None, None, None, info
    trie = StructureTrie(taskset)
    check_routable(taskset, trie)
    tmap = token_map(taskset, weights, source)
    back = np.full(weights.E.shape[0], -1, np.int64)
    back[tmap] = np.arange(tmap.size)             # weights' token id -> task set's id
    touched_ids = back[np.flatnonzero(T.tokens)]
    touched_ids = touched_ids[touched_ids >= 0]
    plan = old.plan
    table = old.table
    Δ = len(weights.vocab) - len(old.weights.vocab)
    info.vocabulary_delta = Δ
    ch_subj, ch_set = changed_subjects(old.taskset, taskset)
    vocab = taskset.vocabulary
    keys = [_key(trie, n) for n in trie]
    node_of_key = {k: i for i, k in enumerate(keys)}
    thresholds = [plan.thresholds(k, taskset) for k in keys]
    ranges = [plan.ranges(k, taskset) if trie.nodes[i].has_subject else [None] for i, k in enumerate(keys)]
    rerun: set[tuple[int, int]] = set()           # (node id, cell)

    def cell_of(nid: int, subject_ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(thresholds[nid], subject_ids, side="right") if thresholds[nid].size else \
            np.zeros(subject_ids.size, np.int64)

    # tokens: where each touched token (and each changed subject) sits in the new queries
    subj_sets = [set(s.tolist()) for s, _ in taskset.fact_ids]
    old_subjects = [set(vocab.id(x) for x in t.facts.subjects if x in vocab) for t in old.taskset.tasks]
    # a changed subject's place in the new numbering: its id, or (gone from the vocabulary) the
    # id it would have; either way the cell whose name range holds it
    from verifier.classes import _entity_array
    ents = _entity_array(taskset)
    place = lambda names: (vocab.n_words + np.searchsorted(ents, np.asarray(sorted(names), dtype=ents.dtype))  # noqa: E731
                           if names else np.zeros(0, np.int64)).astype(np.int64)
    changed_ids = [place(ch) for ch in ch_subj]
    rerun |= _token_cells(trie, taskset, touched_ids, cell_of, old_subjects, subj_sets)
    for node in trie:
        nid = node.id
        if not node.has_subject:
            if any(ch_set[k] for k in node.tasks):
                rerun.add((nid, 0))
            continue
        ids = np.unique(np.concatenate([changed_ids[k] for k in node.tasks]))
        if ids.size:
            rerun.update((nid, int(c)) for c in cell_of(nid, ids).tolist())
    # old classes: mapped to new nodes
    cls_node = np.array([node_of_key.get(table.nodes[int(n)], -1) for n in table.node.tolist()], np.int64)
    if (cls_node < 0).any():
        info.mode, info.reason = "full", "the certificate's structures do not match the task set's"
        return None, None, None, info
    # tokens at which something changed only for queries routed to one expert: the cells
    # holding them, where a class of the old table was routed to that expert
    for k_old, mask in T.by_expert.items():
        ids = back[np.flatnonzero(mask)]
        ids = ids[ids >= 0]
        if ids.size == 0:
            continue
        routed_here = {(int(n), int(c)) for n, c, e in zip(cls_node.tolist(), table.cell.tolist(), table.expert.tolist())
                       if e == k_old}
        rerun.update(_token_cells(trie, taskset, ids, cell_of, old_subjects, subj_sets) & routed_here)
    counts = table.counts
    F = table.floats
    col = {name: i for i, name in enumerate(FLOATS)}
    failing = (counts[:, 2] > 0) | (counts[:, 3] > 0) | (counts[:, 5] > 0) | (counts[:, 4] < counts[:, 1])
    forced = T.classes | failing | np.isin(table.expert, list(T.experts))
    no_rho = ~(np.isfinite(F[:, col["rho_lo"]]) & np.isfinite(F[:, col["rho_hi"]]))
    no_ab_rho = (counts[:, 1] > 0) & ~(np.isfinite(F[:, col["ab_rho_lo"]]) & np.isfinite(F[:, col["ab_rho_hi"]]))
    new_floats = F.copy()
    if Δ != 0:
        forced |= no_rho | no_ab_rho
        lo, hi, rlo, rhi = _grown(F[:, col["err_lo"]], F[:, col["err_hi"]], F[:, col["rho_lo"]], F[:, col["rho_hi"]], Δ)
        alo, _, arlo, arhi = _grown(F[:, col["ab_lo"]], F[:, col["ab_lo"]], F[:, col["ab_rho_lo"]],
                                    F[:, col["ab_rho_hi"]], Δ)
        has_oq = counts[:, 1] > 0
        new_floats[:, col["err_lo"]], new_floats[:, col["err_hi"]] = lo, hi
        new_floats[:, col["rho_lo"]], new_floats[:, col["rho_hi"]] = rlo, rhi
        new_floats[has_oq, col["ab_lo"]] = alo[has_oq]
        new_floats[has_oq, col["ab_rho_lo"]], new_floats[has_oq, col["ab_rho_hi"]] = arlo[has_oq], arhi[has_oq]
        undecided = ~(hi < epsilon - BAND) | (has_oq & ~(alo >= epsilon + BAND))
        forced |= undecided
    gate_terms = lambda w: int(np.diff(sp.csr_matrix(w.W_G).indptr).max(initial=1))  # noqa: E731
    if gate_terms(weights) != gate_terms(old.weights):
        # the gate's rounding bound counts its longest row: a full check's margins differ in the
        # last bits, so a margin within the band is decided by running it again
        forced |= ~(F[:, col["margin_all"]] > BAND)
    for i in np.flatnonzero(forced).tolist():
        rerun.add((int(cls_node[i]), int(table.cell[i])))
    # run the cells again on the new weights
    cells = sorted(rerun)
    info.cells_total = sum(len(r) for r in ranges)
    info.cells_rerun = len(cells)
    reused_mask = np.array([(int(n), int(c)) not in rerun for n, c in zip(cls_node.tolist(), table.cell.tolist())],
                           bool) if len(table) else np.zeros(0, bool)
    served = np.array([taskset.names.index(t) if t in taskset.names else -1 for t in weights.expert_tasks], np.int64)
    off = np.concatenate([[0], np.cumsum([e.width for e in weights.experts])]).astype(np.int64)
    watched = watched_since(old, weights, cor)
    watch = np.concatenate(watched) if watched else np.zeros(0, bool)
    recorder = ClassRecorder(taskset, trie, plan, served, off, epsilon, watch)
    names = taskset.names
    recs = [TaskRecord(t.name, t.n_templates, t.n_facts, taskset.L, taskset.complexity(k), None, None)
            for k, t in enumerate(taskset.tasks)]
    scratch = Report(epsilon, dict(weights.parameters), recs, 0)
    scratch.routing_matrix = np.zeros((len(names), len(weights.experts)), np.int64)
    state = _State(taskset, trie, scratch, served, epsilon)
    executor = executor if executor is not None else LocalPool(jobs)
    shard = Shard(weights, tmap)
    shard.prepared().watch = watch
    cell_parts = [(nid, ranges[nid][c]) for nid, c in cells]
    rerun_count = 0
    for batch, res in executor.map(verify_batch, shard, batches_of(taskset, trie, cell_parts)):
        state.record(batch, res, weights)
        recorder.record(batch, res)
        rerun_count += len(batch)
        if progress:
            progress(rerun_count, -1)
    state.finish()
    # the reused classes, in the new numbering
    reused = table.take(np.flatnonzero(reused_mask))
    reused.floats = new_floats[reused_mask]
    reused.expert = cor.experts[reused.expert]
    reused = _map_active(reused, cor)
    merged = ClassTable.concat([reused, recorder.table()])      # the recorder's table: the classes run again
    info.classes_reused = len(reused)
    info.queries_rerun = rerun_count
    info.queries_reused = int(reused.counts[:, 0].sum()) if len(reused) else 0
    report = _report(taskset, weights, epsilon, merged, state, trie)
    report.enumerated = report.queries
    fresh = recorder.table()
    rerun_tasks = set(fresh.allowed.tolist())
    info.tasks_reused = [names[k] for k in range(len(names)) if k not in rerun_tasks]
    info.seconds = time.perf_counter() - start
    report.seconds = report.verify_seconds = info.seconds
    return report, merged, watched, info


def _token_cells(trie, taskset: TaskSet, ids: np.ndarray, cell_of, old_subjects, subj_sets) -> set[tuple[int, int]]:
    """The cells (node, cell) holding a query with one of the tokens ``ids`` (task-set ids):
    every cell of a node with such a word; for an entity, the cell of its subject place
    at the nodes of the tasks it is (or was) a subject of, and past ⋆2 the cells of the
    subjects whose object it is."""
    vocab = taskset.vocabulary
    words = {int(t) for t in ids.tolist() if not vocab.is_entity(int(t))}
    ents = np.array([t for t in ids.tolist() if vocab.is_entity(int(t))], np.int64)
    out: set[tuple[int, int]] = set()
    for node in trie:
        nid = node.id
        if words & {c for c in node.symbols if c >= 0}:
            n_cells = int(cell_of(nid, np.array([vocab.size], np.int64))[0]) + 1 if node.has_subject else 1
            out.update((nid, c) for c in range(n_cells))
            continue
        if not node.has_subject or ents.size == 0:
            continue
        subjects = []
        for k in node.tasks:
            subjects.append(np.array([t for t in ents.tolist() if t in subj_sets[k] or t in old_subjects[k]], np.int64))
            if node.has_object:
                s, o = taskset.fact_ids[k]
                subjects.append(s[np.isin(o, ents)])
        here = np.unique(np.concatenate(subjects)) if subjects else np.zeros(0, np.int64)
        if here.size:
            out.update((nid, int(c)) for c in cell_of(nid, here).tolist())
    return out


def _key(trie, node) -> str:
    from verifier.classes import node_key
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
    """Active neuron lists of reused classes in the new numbering (a neuron that is gone is dropped)."""
    acts, over = [t.active_of(i) for i in range(len(t))], t.overflow.copy()
    # the expert indices are already new; the neuron ids are mapped through the old expert's map
    inv_exp = {int(k_new): k_old for k_old, k_new in enumerate(cor.experts.tolist()) if k_new >= 0}
    new_acts = []
    for i, a in enumerate(acts):
        nm = cor.neurons[inv_exp[int(t.expert[i])]]
        m = nm[a] if a.size else a
        new_acts.append(np.sort(m[m >= 0]))
    ptr = np.zeros(len(t) + 1, np.int64)
    np.cumsum([a.size for a in new_acts], out=ptr[1:])
    t.active_ptr = ptr
    t.active = np.concatenate(new_acts).astype(np.int64) if new_acts else np.zeros(0, np.int64)
    t.overflow = over
    return t


def _report(taskset: TaskSet, weights: Weights, epsilon: float, table: ClassTable, state: _State, trie) -> Report:
    """The report from the merged classes; counterexamples from the queries run again."""
    tot = records(table, taskset, len(weights.experts))
    expert_of_task = {name: k for k, name in enumerate(weights.expert_tasks) if name}
    recs = []
    for k, task in enumerate(taskset.tasks):
        e = expert_of_task.get(task.name)
        r = TaskRecord(task.name, task.n_templates, task.n_facts, taskset.L, taskset.complexity(k), e,
                       weights.experts[e].width if e is not None else None)
        r.queries, r.object_queries = int(tot.queries[k]), int(tot.object_queries[k])
        r.misrouted, r.over_epsilon, r.ablation_broken = int(tot.misrouted[k]), int(tot.over_epsilon[k]), int(tot.broken[k])
        r.min_margin = float(tot.min_margin[k])
        if tot.worst[k] > -np.inf:
            r.worst_error, r.worst_error_lower, r.worst_query = float(tot.worst[k]), float(tot.worst_lower[k]), tot.worst_query[k]
        recs.append(r)
    report = Report(epsilon, dict(weights.parameters), recs, tot.total_queries)
    report.routing_matrix = tot.routing
    report.foreign = tot.foreign
    report.counterexamples = list(state.report.counterexamples)
    counts = weights.parameter_counts()
    counts["facts_per_parameter"] = taskset.n_facts / counts["total"] if counts["total"] else None
    report.parameter_counts = counts
    for k, r in enumerate(recs):
        for e in np.flatnonzero(report.routing_matrix[k]):
            if weights.experts[e].width > (r.width or 0):
                r.width, r.expert = weights.experts[e].width, int(e)
    report.measured_worst = max((r.worst_error for r in recs), default=0.0)
    return report
