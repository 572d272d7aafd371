"""Query classes: what a saved certificate keeps of a verification, so that an edit can reuse it.

A verification decides, per query, numbers that its checks compare with thresholds. A
certificate cannot keep them per query (millions), and an edit must not need them per
query either. So the queries are grouped:

* a **cell** is the queries of one structure node whose subject's name lies in one range
  of the sorted entity names (:class:`CellPlan`; a node without an entity is one cell). A
  cell (or the part of it with one set of consistent tasks) is what an edit re-runs when
  it cannot take single subjects' queries out of a class (``verifier.certificates.incremental``).
* a **class** is the queries of a cell with the same set M of consistent tasks and the same
  routed expert e. Its *summary* holds exactly what the checks and the per-task records
  need, aggregated: the number of queries; the largest upper end of the error enclosure
  (and that query's lower end, subject and object, to name it); the smallest certified
  margin (and that query's subject and object); the failures counted per check; over the object queries the smallest
  lower end of the ablated error and of 1 − P_ablated(o) (the object alone), how many certify L1, L2 and all of the
  entanglement check (:mod:`verifier.checks.localization`), the smallest L2 gap and the smallest count of
  tokens other than the object whose ablated logit is exactly 0 (which lets a count of
  such tokens change soundly, as for ρ); and the ranges of ρ = 1/Σ_t e^(z_t), the probability one token of
  logit exactly 0 has (with and without the expert's output; above 1 where every token's logit is negative),
  which lets a count of such tokens change soundly (:mod:`verifier.certificates.incremental`); the smallest
  margin over all its queries; and which *watched* neurons of e may be on in some query of the class.

:func:`records` turns a table of classes into the per-task records a :class:`Report` shows,
with the same meaning as the records the full pass accumulates (``verifier.checks.verify``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tasks.model import TaskSet
from tasks.structure import OBJ, SUBJ, StructureTrie
from verifier.checks import catalogue
from verifier.checks.localization import l1_thresholds

#: Queries per cell at most (about): the most an edit re-runs for one subject (a whole cell).
CELL_QUERIES = 256
#: The float summaries of a class, in this order in :attr:`ClassTable.floats`.
FLOATS = ("err_hi", "err_lo", "rho_lo", "rho_hi", "margin", "ab_lo", "ab_rho_lo", "ab_rho_hi", "margin_all",
          "ab_gap", "ab_zeros", "ab_obj_lo")
#: The counts of a class, in this order in :attr:`ClassTable.counts` (the certificate's
#: format): its queries, its object queries, its determined queries routed to another task's
#: expert (``foreign``), and the column of each count of the catalogue
#: (:func:`verifier.checks.catalogue.counted`): ``route_bad`` and ``err_bad`` count the queries
#: failing routing and error; ``broken`` the object queries whose ablated error is certified
#: >= ε; ``l1``, ``l2`` those certifying L1 and L2; ``localized`` those certifying all three.
#: A check added to the catalogue adds its column after these (:func:`count_columns`).
COUNTS = ("queries", "object_queries", "route_bad", "err_bad", "broken", "foreign", "l1", "l2", "localized")


def count_columns() -> tuple[str, ...]:
    """The count columns of a class table: :data:`COUNTS`, then the column of each count of
    the catalogue not among them (none for the checks this tool ships)."""
    return COUNTS + tuple(c.column for c in catalogue.counted() if c.column not in COUNTS)
#: Initial (empty) value of each float summary: the identity of its reduction.
_FLOAT_INIT = {"err_hi": -np.inf, "err_lo": -np.inf, "rho_lo": np.inf, "rho_hi": -np.inf, "margin": np.inf,
               "ab_lo": np.inf, "ab_rho_lo": np.inf, "ab_rho_hi": -np.inf, "margin_all": np.inf,
               "ab_gap": np.inf, "ab_zeros": np.inf, "ab_obj_lo": np.inf}


def node_key(trie: StructureTrie, node) -> str:
    """A node's structure as text, stable across edits that keep the templates:
    words by name, ⋆1 and ⋆2 for the slots, separated by a tab."""
    vocab = trie.taskset.vocabulary
    return "\t".join("⋆1" if c == SUBJ else "⋆2" if c == OBJ else vocab.token(c) for c in node.symbols)


@dataclass(frozen=True)
class CellPlan:
    """Per structure node (by :func:`node_key`), the subject names that start its cells after
    the first, sorted. A subject s falls in cell #{b : b <= s}."""

    boundaries: dict[str, tuple[str, ...]]

    @staticmethod
    def of(taskset: TaskSet, trie: StructureTrie, size: int = CELL_QUERIES) -> "CellPlan":
        vocab = taskset.vocabulary
        ids = taskset.fact_ids
        out: dict[str, tuple[str, ...]] = {}
        for node in trie:
            if not node.has_subject:
                continue
            subjects = np.unique(np.concatenate([ids[k][0] for k in node.tasks]))
            picks = subjects[size::size]
            out[node_key(trie, node)] = tuple(vocab.token(int(s)) for s in picks)
        return CellPlan(out)

    def thresholds(self, key: str, taskset: TaskSet) -> np.ndarray:
        """Token ids at which the node's cells start (after the first) in ``taskset``'s
        vocabulary: the cell of a subject id is ``searchsorted(thresholds, id, 'right')``."""
        b = self.boundaries.get(key, ())
        if not b:
            return np.zeros(0, np.int64)
        # a function of the names and the (immutable) task set alone: kept on the task set, so
        # that a re-certification finds the certificate's, computed when it was the new one
        memo = taskset.__dict__.setdefault("_cell_thresholds", {})
        got = memo.get(b)
        if got is None:
            entities = taskset.vocabulary.entity_array
            # the names keep their own width: cast to the entities' width, a boundary longer than
            # every entity would be cut short and move (``'S0255x'`` read as ``'S0255'``)
            got = taskset.vocabulary.n_words + np.searchsorted(entities, np.asarray(b, dtype=str), side="left")
            got.setflags(write=False)
            memo[b] = got
        return got

    def ranges(self, key: str, taskset: TaskSet) -> list[tuple[int, int]]:
        """The cells of a node as subject-id ranges [lo, hi) in ``taskset``'s numbering."""
        t = self.thresholds(key, taskset)
        W, V = taskset.vocabulary.n_words, taskset.vocabulary.size
        edges = np.concatenate([[W], t, [V]]).astype(np.int64)
        return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


@dataclass
class ClassTable:
    """Classes as columns. ``allowed`` and ``active`` are CSR (pointer, values)."""

    nodes: list[str]                       # node keys; ``node`` indexes this list
    node: np.ndarray                       # (n,) int
    cell: np.ndarray                       # (n,) int
    expert: np.ndarray                     # (n,) int: the routed expert
    allowed_ptr: np.ndarray
    allowed: np.ndarray                    # consistent task indices, ascending
    counts: np.ndarray                     # (n, len(COUNTS)) int
    floats: np.ndarray                     # (n, len(FLOATS)) float
    worst: list[tuple[str, str]]           # (subject, object) names of each class's worst query ("" if none)
    active_ptr: np.ndarray
    active: np.ndarray                     # local neuron ids of the expert that may be on
    overflow: np.ndarray                   # (n,) bool: more watched neurons may be on than listed
    least: list[tuple[str, str]]           # (subject, object) names of the query of the smallest margin ("" if none)

    def __len__(self) -> int:
        return int(self.node.size)

    def allowed_of(self, i: int) -> np.ndarray:
        return self.allowed[self.allowed_ptr[i]: self.allowed_ptr[i + 1]]

    def active_of(self, i: int) -> np.ndarray:
        return self.active[self.active_ptr[i]: self.active_ptr[i + 1]]

    def column(self, name: str) -> np.ndarray:
        return self.floats[:, FLOATS.index(name)] if name in FLOATS else self.counts[:, count_columns().index(name)]

    @staticmethod
    def empty() -> "ClassTable":
        z = np.zeros(0, np.int64)
        return ClassTable([], z, z, z, np.zeros(1, np.int64), z, np.zeros((0, len(count_columns())), np.int64),
                          np.zeros((0, len(FLOATS))), [], np.zeros(1, np.int64), z, np.zeros(0, bool), [])

    def take(self, idx: np.ndarray) -> "ClassTable":
        idx = np.asarray(idx, np.int64)
        from verifier.passes.batches import take_csr
        ap, av = take_csr(self.allowed_ptr, self.allowed, idx)
        cp, cv = take_csr(self.active_ptr, self.active, idx)
        return ClassTable(self.nodes, self.node[idx], self.cell[idx], self.expert[idx], ap, av, self.counts[idx],
                          self.floats[idx], pick(self.worst, idx), cp, cv, self.overflow[idx],
                          pick(self.least, idx))

    @staticmethod
    def concat(parts: list["ClassTable"]) -> "ClassTable":
        """Tables of classes over the same task set, their node lists merged."""
        from verifier.passes.batches import concat_csr
        parts = [p for p in parts if len(p)]
        if not parts:
            return ClassTable.empty()
        nodes: list[str] = []
        index: dict[str, int] = {}
        remapped = []
        for p in parts:
            m = np.array([index.setdefault(k, len(index)) for k in p.nodes], np.int64)
            remapped.append(m[p.node] if p.node.size else p.node)
        nodes = sorted(index, key=index.get)
        ap, av = concat_csr([(p.allowed_ptr, p.allowed) for p in parts])
        cp, cv = concat_csr([(p.active_ptr, p.active) for p in parts])
        return ClassTable(nodes, np.concatenate(remapped), np.concatenate([p.cell for p in parts]),
                          np.concatenate([p.expert for p in parts]), ap, av,
                          np.concatenate([p.counts for p in parts]), np.concatenate([p.floats for p in parts]),
                          [w for p in parts for w in p.worst], cp, cv, np.concatenate([p.overflow for p in parts]),
                          [w for p in parts for w in p.least])


class ClassRecorder:
    """Aggregates a verification's batches into a :class:`ClassTable` (vectorised per batch).

    ``served`` maps an expert to the task index it serves (-1: none); ``off`` is the first
    global neuron of each expert (``Prepared.layer.off``), to store watched neurons locally.
    """

    def __init__(self, taskset: TaskSet, trie: StructureTrie, plan: CellPlan, served: np.ndarray,
                 off: np.ndarray, epsilon: float, watch: np.ndarray | None = None, *, vocab_size: int) -> None:
        self.taskset, self.trie, self.plan = taskset, trie, plan
        self.vocab_size = int(vocab_size)      # the weights' V (classes are recorded by the exact pass)
        #: global neurons whose possible activity is recorded (verifier.certificates.locality.watched_neurons)
        self.watch = np.zeros(0, bool) if watch is None else np.asarray(watch, bool)
        self.served, self.off, self.eps = np.asarray(served, np.int64), np.asarray(off, np.int64), float(epsilon)
        self.l1_thr = l1_thresholds(taskset)[1]
        #: the decision of a batch's rows (the full pass's, verifier.checks.catalogue.decide), and
        #: where each count of the catalogue goes among the class's counts
        self.rules = catalogue.Rules(self.served, self.eps, self.l1_thr, self.vocab_size)
        columns = count_columns()
        self.columns = [(columns.index(c.column), c) for c in catalogue.counted(self.rules.checks)]
        self.keys = [node_key(trie, n) for n in trie]
        self.thresholds = [plan.thresholds(k, taskset) for k in self.keys]
        self.subject_at = np.array([n.subject_position for n in trie], np.int64)
        self.object_at = np.array([n.object_position for n in trie], np.int64)
        self.index: dict[tuple, int] = {}
        self.patterns: dict[tuple[int, ...], int] = {}
        self._n = 0
        self._node, self._cell, self._expert, self._pattern = [], [], [], []
        self._counts = np.zeros((0, len(count_columns())), np.int64)
        self._floats = np.zeros((0, len(FLOATS)))
        self._worst: list[tuple[int, int]] = []
        self._least: list[tuple[int, int]] = []
        self._active: dict[int, set[int]] = {}
        self._overflow: list[bool] = []

    @staticmethod
    def for_weights(taskset: TaskSet, trie: StructureTrie, plan: CellPlan, weights, epsilon: float,
                    watched: list[np.ndarray]) -> "ClassRecorder":
        """A recorder for ``weights`` (experts' served tasks by name), watching ``watched``
        (per expert, a bool mask of its neurons)."""
        names = taskset.names
        served = np.array([names.index(t) if t in names else -1 for t in weights.expert_tasks], np.int64)
        off = np.concatenate([[0], np.cumsum([e.width for e in weights.experts])]).astype(np.int64)
        watch = np.concatenate(watched) if watched else np.zeros(0, bool)
        return ClassRecorder(taskset, trie, plan, served, off, epsilon, watch, vocab_size=len(weights.vocab))

    def _grow(self, n_new: int) -> None:
        self._counts = np.concatenate([self._counts, np.zeros((n_new, self._counts.shape[1]), np.int64)])
        init = np.array([_FLOAT_INIT[name] for name in FLOATS])
        self._floats = np.concatenate([self._floats, np.tile(init, (n_new, 1))])

    def cells_of(self, node_ids: np.ndarray, subjects: np.ndarray) -> np.ndarray:
        out = np.zeros(node_ids.size, np.int64)
        for nid in np.unique(node_ids):
            t = self.thresholds[int(nid)]
            if t.size:
                sel = node_ids == nid
                out[sel] = np.searchsorted(t, subjects[sel], side="right")
        return out

    def record(self, b, res) -> None:
        n = len(b)
        if n == 0:
            return
        K = len(self.taskset.tasks)
        rows = np.arange(n)
        d = catalogue.decide(self.rules, b, res)
        e, det, oq = d.rows.expert, b.determined, d.rows.object_query
        counts = np.diff(b.allowed_ptr)
        has = det >= 0
        node = np.asarray(b.node, np.int64)
        sp_ = self.subject_at[node]
        subj = np.where(sp_ >= 0, b.tokens[rows, np.maximum(sp_, 0)], -1)
        op_ = self.object_at[node]
        obj = np.where(op_ >= 0, b.tokens[rows, np.maximum(op_, 0)], -1)
        cell = self.cells_of(node, subj)
        # pattern of M: a single task k is k; a larger set gets its own number from K on
        pattern = np.where(counts == 1, b.allowed[b.allowed_ptr[:-1]] if n else 0, -1)
        for i in np.flatnonzero(counts != 1):
            tup = tuple(b.allowed[b.allowed_ptr[i]: b.allowed_ptr[i + 1]].tolist())
            pattern[i] = K + self.patterns.setdefault(tup, len(self.patterns))
        stacked = np.stack([node, cell, pattern, e], axis=1)
        uniq, inv = np.unique(stacked, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        cls = np.empty(uniq.shape[0], np.int64)
        new = 0
        for j, key in enumerate(map(tuple, uniq.tolist())):
            c = self.index.get(key)
            if c is None:
                c = self.index[key] = self._n + new
                new += 1
                self._node.append(key[0])
                self._cell.append(key[1])
                self._pattern.append(key[2])
                self._expert.append(key[3])
                self._worst.append((-1, -1))
                self._overflow.append(False)
                self._least.append((-1, -1))
            cls[j] = c
        if new:
            self._grow(new)
            self._n += new
        c = cls[inv]
        C = self._counts
        np.add.at(C[:, COUNTS.index("queries")], c, 1)
        np.add.at(C[:, COUNTS.index("object_queries")], c, oq)
        np.add.at(C[:, COUNTS.index("foreign")], c, d.foreign)
        for j, check in self.columns:
            np.add.at(C[:, j], c, d.counted(check))
        F = self._floats
        before = F[:, 0].copy()
        np.fmax.at(F[:, 0], c, res.err_hi)
        for j in np.unique(c):
            if F[j, 0] > before[j]:                      # a new worst query: the first row attaining it
                i = int(np.flatnonzero((c == j) & (res.err_hi == F[j, 0]))[0])
                F[j, 1] = res.err_lo[i]
                self._worst[j] = (int(subj[i]), int(obj[i]))
        nan = lambda a: np.full(n, np.nan) if a is None else np.asarray(a, float)  # noqa: E731
        rho_lo, rho_hi = nan(res.rho_lo), nan(res.rho_hi)
        np.minimum.at(F[:, 2], c, np.where(np.isnan(rho_lo), -np.inf, rho_lo))    # NaN: no ρ (becomes -inf)
        np.maximum.at(F[:, 3], c, np.where(np.isnan(rho_hi), np.inf, rho_hi))
        ok_det = has & d.holds[catalogue.ROUTING.name]
        before = F[:, 4].copy()
        np.minimum.at(F[:, 4], c[ok_det], res.margin[ok_det])
        for j in np.unique(c[ok_det]):
            if F[j, 4] < before[j]:                      # a new smallest margin: the first row attaining it
                i = int(np.flatnonzero((c == j) & ok_det & (res.margin == F[j, 4]))[0])
                self._least[j] = (int(subj[i]), int(obj[i]))
        np.minimum.at(F[:, 8], c, np.where(np.isnan(res.margin), -np.inf, res.margin))
        ab_lo, a_rlo, a_rhi = np.asarray(res.ablated_lo, float), nan(res.ablated_rho_lo), nan(res.ablated_rho_hi)
        np.minimum.at(F[:, 5], c[oq], np.where(np.isnan(ab_lo[oq]), -np.inf, ab_lo[oq]))
        np.minimum.at(F[:, 6], c[oq], np.where(np.isnan(a_rlo[oq]), -np.inf, a_rlo[oq]))
        np.maximum.at(F[:, 7], c[oq], np.where(np.isnan(a_rhi[oq]), np.inf, a_rhi[oq]))
        gap = d.rows.gaps
        zeros = np.full(n, -1.0) if res.ablated_zeros is None else np.asarray(res.ablated_zeros, float)
        np.minimum.at(F[:, 9], c[oq], np.where(np.isnan(gap[oq]), -np.inf, gap[oq]))
        np.minimum.at(F[:, 10], c[oq], zeros[oq])
        obj = d.rows.object_lows
        np.minimum.at(F[:, 11], c[oq], np.where(np.isnan(obj[oq]), -np.inf, obj[oq]))
        if res.active is not None:
            act = np.asarray(res.active)
            R = act.shape[1] - 1
            over = act[:, R] > R
            for j in np.unique(c[over]):
                self._overflow[j] = True
            rr, kk = np.nonzero(act[:, :R] >= 0)
            if rr.size:
                local = act[rr, kk] - self.off[e[rr]]
                pairs = np.unique(np.stack([c[rr], local], axis=1), axis=0)
                for j, g in pairs.tolist():
                    self._active.setdefault(j, set()).add(g)
        else:
            for j in np.unique(c):
                self._overflow[j] = True

    def table(self) -> ClassTable:
        vocab = self.taskset.vocabulary
        K = len(self.taskset.tasks)
        by_id = {v: k for k, v in self.patterns.items()}
        sets = [(p,) if p < K else by_id[p - K] for p in self._pattern]
        ap = np.zeros(len(sets) + 1, np.int64)
        np.cumsum([len(s) for s in sets], out=ap[1:])
        av = np.fromiter((k for s in sets for k in s), np.int64, int(ap[-1]))
        acts = [sorted(self._active.get(j, ())) for j in range(self._n)]
        cp = np.zeros(self._n + 1, np.int64)
        np.cumsum([len(a) for a in acts], out=cp[1:])
        cv = np.fromiter((g for a in acts for g in a), np.int64, int(cp[-1]))
        name = lambda t: vocab.token(t) if t >= 0 else ""  # noqa: E731
        return ClassTable(list(self.keys), np.asarray(self._node, np.int64), np.asarray(self._cell, np.int64),
                          np.asarray(self._expert, np.int64), ap, av, self._counts.copy(), self._floats.copy(),
                          [(name(s), name(o)) for s, o in self._worst], cp, cv, np.asarray(self._overflow, bool),
                          [(name(s), name(o)) for s, o in self._least])


@dataclass
class Totals:
    """What the per-task records of a report hold, from a class table (:func:`records`)."""

    queries: np.ndarray
    object_queries: np.ndarray
    counts: dict[str, np.ndarray]           # per count of the catalogue (verifier.checks.catalogue.counted)
    min_margin: np.ndarray
    worst: np.ndarray
    worst_lower: np.ndarray
    worst_query: list[str]
    routing: np.ndarray
    foreign: int
    total_queries: int = 0
    min_ablated_lower: np.ndarray | None = None   # smallest ablated error lower end over object queries
    min_gap: np.ndarray | None = None             # smallest L2 gap over object queries
    min_object_lower: np.ndarray | None = None    # smallest lower end of 1 − P_ablated(o) over them
    #: per check over every query, the queries failing it, each once (a class's queries are
    #: in each of its consistent tasks' counts)
    failing: dict[str, int] = field(default_factory=dict)

    @property
    def over_epsilon_queries(self) -> int:
        return self.failing.get("error", 0)

    @property
    def misrouted_queries(self) -> int:
        return self.failing.get("routing", 0)


def records(table: ClassTable, taskset: TaskSet, n_experts: int) -> Totals:
    """Per task: queries consistent with it, object queries, each count of the catalogue,
    smallest margin over its determined well-routed queries, worst error (and its query's
    text), and the routing matrix over determined queries; the same meaning as
    ``verifier.checks.verify``."""
    K = len(taskset.tasks)
    checks = catalogue.counted()
    t = Totals(np.zeros(K, np.int64), np.zeros(K, np.int64), {c.count: np.zeros(K, np.int64) for c in checks},
               np.full(K, np.inf), np.full(K, -np.inf), np.zeros(K), [""] * K, np.zeros((K, n_experts), np.int64), 0,
               0, np.full(K, np.inf), np.full(K, np.inf), np.full(K, np.inf))
    if not len(table):
        return t
    cnt = {name: table.column(name) for name in count_columns()}
    size = np.diff(table.allowed_ptr)
    owner = np.repeat(np.arange(len(table)), size)
    np.add.at(t.queries, table.allowed, cnt["queries"][owner])
    single = size == 1
    det = np.where(single, table.allowed[table.allowed_ptr[:-1]] if len(table) else 0, -1)
    d = det >= 0
    np.add.at(t.object_queries, det[d], cnt["object_queries"][d])
    # a query is counted for each consistent task, an object query for the task it determines
    for c in checks:
        if c.objects:
            np.add.at(t.counts[c.count], det[d], cnt[c.column][d])
        else:
            np.add.at(t.counts[c.count], table.allowed, cnt[c.column][owner])
    has_oq = d & (cnt["object_queries"] > 0)
    np.minimum.at(t.min_ablated_lower, det[has_oq], table.column("ab_lo")[has_oq])
    np.minimum.at(t.min_gap, det[has_oq], table.column("ab_gap")[has_oq])
    np.minimum.at(t.min_object_lower, det[has_oq], table.column("ab_obj_lo")[has_oq])
    np.minimum.at(t.min_margin, det[d], table.column("margin")[d])
    np.add.at(t.routing, (det[d], table.expert[d]), cnt["queries"][d])
    t.foreign = int(cnt["foreign"].sum())
    t.total_queries = int(cnt["queries"].sum())
    t.failing = {c.name: int(cnt[c.column].sum()) if c.failures else t.total_queries - int(cnt[c.column].sum())
                 for c in catalogue.PER_QUERY if not c.objects}
    err_hi, err_lo = table.column("err_hi"), table.column("err_lo")
    # per task, the first of its classes (in table order, which is entry order) with the
    # largest err_hi, as argmax picks it: its first NaN if it has one, else its first entry
    # at its maximum (np.unique's first index of each task among the candidate entries)
    hi = err_hi[owner]
    nan = np.isnan(hi)
    top = np.full(K, -np.inf)
    np.maximum.at(top, table.allowed[~nan], hi[~nan])
    has_nan = np.zeros(K, bool)
    has_nan[table.allowed[nan]] = True
    cand = np.flatnonzero(np.where(has_nan[table.allowed], nan, hi == top[table.allowed]))
    _, at = np.unique(table.allowed[cand], return_index=True)
    for e in cand[at].tolist():
        k, j = int(table.allowed[e]), int(owner[e])
        t.worst[k], t.worst_lower[k] = err_hi[j], err_lo[j]
        t.worst_query[k] = query_text(table.nodes[int(table.node[j])], *table.worst[j])
    return t


def query_text(key: str, subject: str, obj: str) -> str:
    """The query named by a node key and its entities."""
    return " ".join(subject if w == "⋆1" else obj if w == "⋆2" else w for w in key.split("\t"))


def pick(items: list, idx: np.ndarray) -> list:
    """``[items[i] for i in idx]``, in one C loop (operator.itemgetter)."""
    from operator import itemgetter

    idx = np.asarray(idx).tolist()
    if len(idx) == len(items) and idx == list(range(len(items))):
        return list(items)
    return list(itemgetter(*idx)(items)) if len(idx) > 1 else [items[i] for i in idx]


def set_codes(ptr: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row of a CSR (ptr, values) of small non-negative integers, a 64-bit code of its
    values in order: equal rows get equal codes. Unequal rows may collide, so a code only
    narrows a search; rows are compared exactly after it."""
    n = ptr.size - 1
    counts = np.diff(ptr)
    out = np.zeros(n, np.uint64)
    if values.size == 0:
        return out
    position = np.arange(values.size) - np.repeat(ptr[:-1], counts)
    with np.errstate(over="ignore"):
        term = (values.astype(np.uint64) + np.uint64(1)) * (np.uint64(0x9E3779B97F4A7C15)
                                                            ** position.astype(np.uint64) | np.uint64(1))
        np.add.at(out, np.repeat(np.arange(n), counts), term)
    return out


def merge_classes(t: ClassTable, rows: np.ndarray) -> ClassTable:
    """``t`` with the classes among ``rows`` that share node, cell, consistent tasks and
    expert made one, their summaries combined as :class:`ClassRecorder` combines queries:
    counts added; the largest error (fmax, with its query's lower end and names), ρ's and
    the ablated ρ's ranges widened, the smallest margins and ablated error (with the
    smallest margin's names); watched neurons united. A table whose classes were recorded
    in two runs (queries reused and queries run again) so becomes the table one run gives."""
    rows = np.asarray(rows, np.int64)
    code = set_codes(*_take_allowed(t, rows)).view(np.int64)
    # candidate groups by (node, cell, code, expert); only those of two or more rows are
    # compared exactly (a code collision splits into exact groups here)
    _, inv, size = np.unique(np.stack([t.node[rows], t.cell[rows], code, t.expert[rows]], axis=1), axis=0,
                             return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    by_group = rows[np.argsort(inv, kind="stable")]
    end = np.cumsum(size)
    dup: list[list[int]] = []
    for grp in np.flatnonzero(size > 1).tolist():
        exact: dict[tuple, list[int]] = {}
        for i in by_group[end[grp] - size[grp]: end[grp]].tolist():
            exact.setdefault(tuple(t.allowed_of(i).tolist()), []).append(i)
        dup += [g for g in exact.values() if len(g) > 1]
    if not dup:
        return t
    C, F = t.counts.copy(), t.floats.copy()
    worst, least, overflow = list(t.worst), list(t.least), t.overflow.copy()
    col = {name: j for j, name in enumerate(FLOATS)}
    target = np.arange(len(t))
    # every group at once: members listed group by group, each group's first member keeps the
    # merged summary; a reduction per group (reduceat) is the reduction over its members, and
    # the witness is the first member at the extreme, as argmax / argmin pick it
    members = np.fromiter((i for g in dup for i in g), np.int64)
    sizes = np.array([len(g) for g in dup], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    gid = np.repeat(np.arange(len(dup)), sizes)
    first = members[starts]

    def first_where(mask: np.ndarray) -> np.ndarray:
        """Per group, its first member where ``mask`` holds (it holds somewhere in every group)."""
        at = np.where(mask, np.arange(members.size), members.size)
        return members[np.minimum.reduceat(at, starts)]

    C[first] = np.add.reduceat(C[members], starts, axis=0)
    hi = F[members, col["err_hi"]]
    hi = np.where(np.isnan(hi), -np.inf, hi)
    top = np.maximum.reduceat(hi, starts)
    j = first_where(hi == top[gid])
    F[first, col["err_hi"]], F[first, col["err_lo"]] = top, F[j, col["err_lo"]]
    m = F[members, col["margin"]]
    low = np.minimum.reduceat(m, starts)                 # NaN if a member's margin is NaN, as min() gives
    nan = np.isnan(m)
    j_least = first_where(np.where(np.logical_or.reduceat(nan, starts)[gid], nan, m == low[gid]))
    F[first, col["margin"]] = low
    for name in ("rho_lo", "ab_lo", "ab_rho_lo", "margin_all", "ab_gap", "ab_zeros", "ab_obj_lo"):
        F[first, col[name]] = np.minimum.reduceat(F[members, col[name]], starts)
    for name in ("rho_hi", "ab_rho_hi"):
        F[first, col[name]] = np.maximum.reduceat(F[members, col[name]], starts)
    overflow[first] = np.logical_or.reduceat(overflow[members], starts)
    for a, w, q in zip(first.tolist(), j.tolist(), j_least.tolist()):
        worst[a], least[a] = worst[w], least[q]
    target[members] = first[gid]
    kept = np.flatnonzero(target == np.arange(len(t)))
    position = np.full(len(t), -1, np.int64)
    position[kept] = np.arange(kept.size)
    owner = position[target[np.repeat(np.arange(len(t)), np.diff(t.active_ptr))]]
    width = int(t.active.max(initial=0)) + 1
    pairs = owner * width + t.active                      # (class, neuron) pairs, wanted sorted, each once
    # a class that absorbed none keeps its list; when every such list increases already, only
    # the merged classes' pairs need sorting (the result is np.unique's of all pairs either way)
    merged = np.zeros(kept.size, bool)
    merged[position[first]] = True
    inside = merged[owner]
    up = pairs[1:] > pairs[:-1]
    same_owner = owner[1:] == owner[:-1]
    if bool(np.all(up | ~same_owner | inside[1:])):
        done = pairs[~inside]
        fresh = np.unique(pairs[inside])
        pairs = np.insert(done, np.searchsorted(done, fresh), fresh)
    else:
        pairs = np.unique(pairs)
    ptr = np.zeros(kept.size + 1, np.int64)
    np.cumsum(np.bincount(pairs // width, minlength=kept.size), out=ptr[1:])
    from verifier.passes.batches import take_csr
    ap, av = take_csr(t.allowed_ptr, t.allowed, kept)
    return ClassTable(t.nodes, t.node[kept], t.cell[kept], t.expert[kept], ap, av, C[kept], F[kept],
                      pick(worst, kept), ptr, (pairs % width).astype(np.int64), overflow[kept], pick(least, kept))


def _take_allowed(t: ClassTable, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from verifier.passes.batches import take_csr
    return take_csr(t.allowed_ptr, t.allowed, rows)
