"""The checks, over every query of a task set: the certification core's verdict.

:func:`verify` runs the certified forward pass (:mod:`verifier.forward`) on every
query, grouped by template structure and chunked, and decides:

1. **error**: every query's error enclosure lies below ε (upper end < ε);
2. **routing**: every query has a certified unique winner (margin > 0) serving a task
   consistent with the prefix; determined prefixes (object queries included) thus go
   to their own task's expert;
3. **size**: the width of every expert serving task k (named for it, or receiving one
   of its determined queries) is at most c(k) = L·|T(k)| + N_k;
4. **entanglement**: (a) no query determined by task i reaches expert j != i (so
   ablating expert j, whose output only queries routed to j see, changes no prediction
   of another task); (b) ablating the expert of task j (removing its output) breaks
   every object query of j: the ablated error's lower end is >= ε;
5. **counterexamples** for every failure: task, template, subject, prefix, numbers.

The verifier reads only a :class:`layout.Weights` and the task set; it knows nothing of
how the weights were made. Evidence that only the construction can give (the closed
form, the rebuild-without-each-task isolation check) is attached to the :class:`Report`
by the command line (:mod:`cli.compose`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from tasks.errors import TaskError
from tasks.model import TaskSet
from tasks.queries import QueryGroup, build_group
from tasks.structure import StructureTrie, check_routable
from verifier.batches import batches
from verifier.classes import ClassRecorder
from verifier.floating import Deployment, FloatPass
from verifier.forward import Prepared, run_batch
from verifier.parallel import Executor, LocalPool
from layout import Weights
from layout.digest import weights_digest

CHUNK = 20_000
MAX_COUNTEREXAMPLES = 20


@dataclass
class TaskRecord:
    name: str
    templates: int
    facts: int
    L: int
    bound: int                   # c(k)
    expert: int | None           # index of the expert serving this task
    width: int | None
    queries: int = 0
    object_queries: int = 0
    worst_error: float = 0.0     # upper end of the worst error enclosure
    worst_error_lower: float = 0.0
    worst_query: str = ""
    min_margin: float = float("inf")
    misrouted: int = 0
    over_epsilon: int = 0
    ablation_broken: int = 0     # object queries broken by ablating this task's expert
    isolated: bool | None = None  # expert built alone is identical (None: not checked)
    closed_form_bound: float | None = None

    @property
    def size_ok(self) -> bool:
        return self.width is not None and self.width <= self.bound

    @property
    def routing_ok(self) -> bool:
        return self.misrouted == 0 and self.expert is not None

    @property
    def error_ok(self) -> bool:
        return self.over_epsilon == 0

    @property
    def entanglement_ok(self) -> bool:
        return self.ablation_broken == self.object_queries and self.isolated is not False

    @property
    def certified(self) -> bool:
        return self.size_ok and self.routing_ok and self.error_ok and self.entanglement_ok


@dataclass
class Report:
    epsilon: float
    parameters: dict[str, Any]
    tasks: list[TaskRecord]
    queries: int                               # queries whose results were recorded
    counterexamples: list[dict[str, Any]] = field(default_factory=list)
    closed_form: str | None = None
    closed_form_value: float | None = None
    closed_form_proven: bool | None = None     # the side conditions hold (None: not checked)
    measured_worst: float = 0.0
    gate: str | None = None
    routing_matrix: np.ndarray | None = None   # tasks x experts, determined queries
    foreign: int = 0                           # determined queries routed to another task's expert
    seconds: float = 0.0
    verify_seconds: float = 0.0                # of which the certified pass and its checks
    notes: list[str] = field(default_factory=list)
    enumerated: int = 0                        # queries sent to the certified pass
    deferred: int = 0                          # of which run again over the full weights (sharded runs)
    precision: str = "exact"                   # the forward pass certified: exact, or a floating-point format
    precision_model: str | None = None         # the executions a floating-point certificate covers
    parameter_counts: dict[str, Any] | None = None   # Weights.parameter_counts() and facts per parameter
    incremental: dict[str, Any] | None = None  # check --since: what was reused and what ran again
    weights_sha256: str | None = None          # layout.digest of the weights certified (export writes it too)

    @property
    def complete(self) -> bool:
        """Every enumerated query has its result recorded (and there was at least one)."""
        return self.queries == self.enumerated and self.enumerated > 0

    @property
    def certified(self) -> bool:
        return all(t.certified for t in self.tasks) and self.foreign == 0 and self.complete

    def attach(self, closed_form: str, bound: float, gate: str, isolated: Sequence[bool] | None,
               notes: Sequence[str] = (), bound_proven: bool | None = None) -> None:
        """Add evidence from whoever built the weights: a closed-form error bound (shown beside
        the measured worst error; ``bound_proven``: whether its side conditions hold, so
        that it bounds every query's error, None if not checked) and, per task, whether its
        expert is isolated (a ``False`` fails that task's entanglement check)."""
        self.closed_form, self.closed_form_value, self.gate = closed_form, bound, gate
        self.closed_form_proven = bound_proven
        for i, r in enumerate(self.tasks):
            r.closed_form_bound = bound
            if isolated is not None:
                r.isolated = bool(isolated[i])
        self.notes.extend(notes)

    @property
    def verdict(self) -> str:
        return "certified" if self.certified else "not certified"


def token_map(taskset: TaskSet, weights: Weights, source: str = "weights") -> np.ndarray:
    """Task-set token id -> weights token id (by exact string)."""
    return weights.token_ids(taskset.vocabulary.tokens, source)


def fitting(taskset: TaskSet, weights: Weights, source: str = "weights") -> np.ndarray:
    """The task-set -> weights token map, once the weights are known to fit the task set: in
    the layout (validated), holding every token of the task set, with positions for its
    longest prefix. Raises :class:`TaskError` (weights built for another task set) otherwise."""
    weights.validate(source)
    tmap = token_map(taskset, weights, source)
    if weights.n_positions < taskset.L:
        raise TaskError(f"the weights have {weights.n_positions} positions; prefixes up to length {taskset.L - 1} need {taskset.L}",
                        file=source, fix="verify weights built for this task set")
    return tmap


class Shard:
    """What a worker needs to run any batch: the weights and the task-set → weights token
    map. The interval tables (:class:`Prepared`) are built on first use in the process
    that uses them and are never pickled: a cluster worker receives the weights once and
    builds its own tables; a forked worker inherits the parent's."""

    def __init__(self, weights: Weights, tmap: np.ndarray, gate_terms: int = 0,
                 deployment: Deployment | None = None, vocab_size: int | None = None) -> None:
        self.weights, self.tmap, self.gate_terms, self.deployment = weights, tmap, gate_terms, deployment
        self.vocab_size = vocab_size
        self._prepared: Prepared | FloatPass | None = None

    def prepared(self) -> Prepared | FloatPass:
        """The exact pass's tables, or the deployed pass of a floating-point format."""
        if self._prepared is None:
            if self.deployment is None:
                self._prepared = Prepared(self.weights, gate_terms=self.gate_terms, vocab_size=self.vocab_size)
            else:
                self._prepared = FloatPass(self.weights, self.deployment)
        return self._prepared

    def run(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray, ablate: np.ndarray,
            scores: bool) -> Any:
        prep = self.prepared()
        if isinstance(prep, FloatPass):
            return prep.run_batch(tokens, valid_ptr, valid, ablate=ablate, scores=scores)
        return run_batch(prep, tokens, valid_ptr, valid, ablate=ablate, scores=scores)

    def __getstate__(self) -> dict:
        return {"weights": self.weights, "tmap": self.tmap, "gate_terms": self.gate_terms,
                "deployment": self.deployment, "vocab_size": self.vocab_size, "_prepared": None}


def verify_batch(shard: Shard, batch) -> Any:
    """The certified pass over one batch, reduced to what the checks read (a work unit)."""
    tmap = shard.tmap
    res = shard.run(tmap[batch.tokens], batch.valid_ptr, tmap[batch.valid],
                    ablate=batch.object_query & (batch.determined >= 0), scores=False).compact()
    if res.expert.shape[0] != len(batch):
        raise RuntimeError(f"a work unit returned {res.expert.shape[0]} rows for a batch of {len(batch)}")
    return res


class ShardPart:
    """A worker's share of a sharded run: the weights cut to one shard and renumbered to
    what it holds (:func:`verifier.shards.restrict`, :func:`verifier.shards.compact`),
    its tokens (compact id -> full id) and experts. Work units arrive with their tokens
    already in compact ids (:meth:`localize`, on the client), so a worker holds nothing
    of the size of the whole vocabulary. Like :class:`Shard`, its tables are built where
    it is used."""

    def __init__(self, comp, experts: np.ndarray, gate_terms: int, tokens: np.ndarray) -> None:
        """``tokens``: the shard's own tokens (full ids), the only ones its E rows embed."""
        self.shard = Shard(comp.weights, np.zeros(0, np.int64), gate_terms, vocab_size=comp.vocab_size)
        self.tokens = comp.tokens                      # compact token id -> full id (sorted)
        self.embedded = np.unique(np.asarray(tokens, np.int64))   # query tokens the shard can hold
        self.vocab_size = comp.vocab_size
        self.has_expert = np.zeros(len(comp.weights.experts), bool)
        self.has_expert[experts] = True

    def _compact_ids(self, full_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(compact ids, held?) of full weights' token ids; a token not held maps to BOS."""
        full_ids = np.asarray(full_ids, np.int64)
        pos = np.minimum(np.searchsorted(self.tokens, full_ids), max(self.tokens.size - 1, 0))
        held = (self.tokens.size > 0) & (self.tokens[pos] == full_ids) if self.tokens.size else np.zeros(full_ids.shape, bool)
        bos = full_ids == self.vocab_size
        return np.where(held, pos, self.tokens.size), held | bos

    def localize(self, batch, tmap: np.ndarray):
        """(the batch with compact token ids, rows holding a token outside the shard)."""
        from dataclasses import replace

        full = tmap[batch.tokens]
        tokens, _ = self._compact_ids(full)
        # a query token must be one the shard embeds (compact also keeps tokens that only
        # have a row of U: their E rows are gone)
        pos = np.minimum(np.searchsorted(self.embedded, full), max(self.embedded.size - 1, 0))
        held = (self.embedded[pos] == full) if self.embedded.size else np.zeros(full.shape, bool)
        held |= full == self.vocab_size
        valid, vheld = self._compact_ids(tmap[batch.valid])
        vheld &= tmap[batch.valid] != self.vocab_size     # BOS is never a next token
        outside = ~held.all(axis=1)
        bad_valid = np.repeat(np.arange(len(batch)), np.diff(batch.valid_ptr))[~vheld]
        outside[bad_valid] = True
        return replace(batch, tokens=tokens, valid=valid), outside


def verify_shard_batch(part: ShardPart, payload) -> tuple[Any, np.ndarray]:
    """The certified pass over one batch on a shard (tokens in the shard's compact ids),
    and which rows must be run again over the full weights (a token or a candidate expert
    outside the shard): a work unit."""
    batch, outside = payload
    shard = part.shard
    res = run_batch(shard.prepared(), batch.tokens, batch.valid_ptr, batch.valid,
                    ablate=batch.object_query & (batch.determined >= 0), scores=False)
    cand_ptr, cand = res.candidates
    rows = np.repeat(np.arange(len(batch)), np.diff(cand_ptr))
    outside = outside.copy()
    outside[rows[~part.has_expert[cand]]] = True
    outside |= ~part.has_expert[res.expert]
    res.predicted = np.where(res.predicted >= 0, part.tokens[np.maximum(res.predicted, 0)], -1)
    return res.compact(), outside


def _merge(n: int, pieces: list[tuple[np.ndarray, Any]]) -> Any:
    """One compact result of n rows from results of row subsets ``(rows, result)``."""
    from verifier.forward import BatchResult

    first = pieces[0][1]

    def field(get):
        out = np.empty((n,) + get(first).shape[1:], get(first).dtype)
        for rows, res in pieces:
            out[rows] = get(res)
        return out

    top = tuple(field(lambda r, i=i: r.top_gate[i]) for i in range(3)) if first.top_gate is not None else None
    extra = {}
    if all(res.rho_lo is not None for _, res in pieces):
        for name in ("rho_lo", "rho_hi", "ablated_rho_lo", "ablated_rho_hi", "active"):
            extra[name] = field(lambda r, name=name: getattr(r, name))
    return BatchResult(field(lambda r: r.expert), field(lambda r: r.margin), field(lambda r: r.ambiguous), None, None,
                       field(lambda r: r.err_lo), field(lambda r: r.err_hi), field(lambda r: r.ablated_lo),
                       field(lambda r: r.ablated_hi), field(lambda r: r.predicted), top, **extra)


def _sharded(executor, taskset: TaskSet, weights: Weights, tmap: np.ndarray, stream, shards: int, deferred: list):
    """``(batch, result)`` in order, the batches' rows run on the shards of their tasks and
    the deferred rows again over the full weights (here); ``deferred[0]`` counts them."""
    from collections import deque

    from verifier.shards import Plan, compact, restrict

    plan = Plan.make(taskset, weights, tmap, shards)
    full: list[Shard] = []
    queue: deque = deque()

    gate_terms = int(np.diff(weights.W_G.tocsr().indptr).max(initial=1))   # as the full weights' tables

    parts: dict[int, ShardPart] = {}

    def part(s: int) -> ShardPart:
        if s not in parts:
            comp = compact(restrict(weights, plan.tokens[s], plan.experts[s]), plan.tokens[s])
            parts[s] = ShardPart(comp, plan.experts[s], gate_terms, plan.tokens[s])
        return parts[s]

    def items():
        for batch in stream:
            split = plan.split(batch)
            queue.append((batch, split))
            for s, rows in split:
                yield s, part(s).localize(batch.take(rows), tmap)

    results = executor.map_keyed(verify_shard_batch, part, items())
    while True:
        try:
            item, got = next(results)
        except StopIteration:
            return
        batch, split = queue.popleft()
        pieces, redo = [], []
        for k, (s, rows) in enumerate(split):
            if k:
                item, got = next(results)
            res, outside = got
            pieces.append((rows, res))
            redo.append(rows[outside])
        redo_rows = np.concatenate(redo)
        if redo_rows.size:
            if not full:
                full.append(Shard(weights, tmap))
            deferred[0] += int(redo_rows.size)
            pieces.append((redo_rows, verify_batch(full[0], batch.take(redo_rows))))
        yield batch, _merge(len(batch), pieces)


def verify(
    taskset: TaskSet,
    weights: Weights,
    epsilon: float,
    *,
    source: str = "weights",
    progress: Callable[[int, int], None] | None = None,
    jobs: int = 1,
    executor: Executor | None = None,
    deployment: Deployment | None = None,
    classes: "ClassRecorder | None" = None,
) -> Report:
    """Run every check on ``weights`` (any weights in the layout, however made).

    ``progress(done, total)`` is called after each batch (``total`` an estimate; -1 at
    the end). The batches run on ``executor`` (default: ``jobs`` local worker processes,
    0 meaning one per CPU); the result does not depend on it. Every enumerated query is
    counted when it is sent and again when its result is recorded; the report is
    certified only if the two counts agree (no work unit lost on the way).

    ``deployment`` (a floating-point format, :mod:`verifier.floating`): certify every
    execution of the model deployed in that format instead of the exact forward pass.

    ``classes`` (:class:`verifier.classes.ClassRecorder`, exact pass on local processes
    only): also aggregate every batch into query classes, for a saved certificate; the
    recorder's ``watch`` mask says which neurons' possible activity to record.
    """
    start = time.perf_counter()
    tmap = fitting(taskset, weights, source)
    names = taskset.names
    expert_of_task = {name: k for k, name in enumerate(weights.expert_tasks) if name}
    K_tasks, K_exp = len(names), len(weights.experts)
    expert_task_index = np.array([names.index(t) if t in names else -1 for t in weights.expert_tasks], np.int64)
    records = []
    for k, task in enumerate(taskset.tasks):
        e = expert_of_task.get(task.name)
        records.append(TaskRecord(task.name, task.n_templates, task.n_facts, taskset.L, taskset.complexity(k),
                                  e, weights.experts[e].width if e is not None else None))
    trie = StructureTrie(taskset)
    check_routable(taskset, trie)   # object queries must determine their task (else: bad input)
    # Progress needs only an estimate (an upper bound: subjects counted once per task through
    # each node); the report's count is the exact number of queries processed.
    sizes = [t.n_facts for t in taskset.tasks]
    total = sum(1 if not n.has_subject else sum(sizes[k] for k in n.tasks) for n in trie)
    report = Report(epsilon, dict(weights.parameters), records, 0)
    report.weights_sha256 = weights_digest(weights)
    if deployment is not None:
        report.precision, report.precision_model = deployment.fmt.name, deployment.describe()
    counts = weights.parameter_counts()
    counts["facts_per_parameter"] = taskset.n_facts / counts["total"] if counts["total"] else None
    report.parameter_counts = counts
    report.routing_matrix = np.zeros((K_tasks, K_exp), np.int64)
    executor = executor if executor is not None else LocalPool(jobs)
    if deployment is not None and not executor.shares_memory:
        raise TaskError(f"--precision {deployment.fmt.name} runs on local processes only (the sharded cluster path "
                        "certifies the exact pass)", fix="drop --scheduler, or use --precision exact")
    shard = Shard(weights, tmap, deployment=deployment)
    if classes is not None and (deployment is not None or not executor.shares_memory):
        raise TaskError("a certificate for later edits is saved for the exact pass on local processes only",
                        fix="drop --precision / --scheduler, or drop --certificate")
    if executor.shares_memory:
        prepared = shard.prepared()          # built once, before any worker starts
        if classes is not None:
            prepared.watch = classes.watch
    state = _State(taskset, trie, report, expert_task_index, epsilon)
    chunk = max(1_000, min(CHUNK, 20_000_000 // max(K_exp, 1)))
    done = 0

    def sent(stream):
        for batch in stream:
            report.enumerated += len(batch)
            yield batch

    stream = sent(batches(taskset, trie, chunk))
    deferred = [0]
    if executor.shares_memory:
        results = executor.map(verify_batch, shard, stream)
    else:   # each worker holds the weights of its shard of tasks only
        results = _sharded(executor, taskset, weights, tmap, stream, executor.shards, deferred)
    for batch, res in results:
        state.record(batch, res, weights)
        if classes is not None:
            classes.record(batch, res)
        report.deferred = deferred[0]
        done += len(batch)
        report.queries = done
        if progress:
            progress(done, total)
    state.finish()
    if progress:
        progress(done, -1)
    # Size: every expert that receives a task's determined queries counts, not only the named one.
    for k, r in enumerate(records):
        for e in np.flatnonzero(report.routing_matrix[k]):
            if weights.experts[e].width > (r.width or 0):
                r.width, r.expert = weights.experts[e].width, int(e)
    report.measured_worst = max((r.worst_error for r in records), default=0.0)
    report.seconds = report.verify_seconds = time.perf_counter() - start
    return report


class _State:
    """Accumulates per-task results over batches, vectorised; describes failures at the end."""

    def __init__(self, taskset, trie, report: Report, expert_task_index: np.ndarray, epsilon: float) -> None:
        self.taskset, self.trie, self.report = taskset, trie, report
        self.serves = expert_task_index
        self.epsilon = epsilon
        K = len(taskset.tasks)
        self.worst = np.full(K, -1.0)
        self.worst_ref: list[tuple[tuple[int, int, int], int] | None] = [None] * K    # (part, index)
        self.pending: list[tuple[str, tuple[int, int, int], int, dict]] = []  # (check, part, index, numbers)

    def record(self, b, res, weights) -> None:
        n, K = len(b), len(self.taskset.tasks)
        rep, eps = self.report, self.epsilon
        rows = np.arange(n)
        e = res.expert
        served = self.serves[e]
        counts = np.diff(b.allowed_ptr)
        pr = np.repeat(rows, counts)
        pt = b.allowed
        member = np.zeros(n, bool)                   # the routed expert serves a consistent task
        member[pr[np.repeat(served, counts) == pt]] = True
        route_ok = (~res.ambiguous) & (served >= 0) & member
        err_bad = ~(res.err_hi < eps)
        det = b.determined
        has = det >= 0
        np.add.at(rep.routing_matrix, (det[has], e[has]), 1)
        rep.foreign += int(np.count_nonzero(has & (served != det) & (served >= 0)))
        q = np.bincount(pt, minlength=K)
        bad_r = np.bincount(pt[~route_ok[pr]], minlength=K)
        bad_e = np.bincount(pt[err_bad[pr]], minlength=K)
        # worst error per task, with the first row (in row order) that attains it
        e_hi = res.err_hi[pr]
        worst = np.full(K, -np.inf)
        np.fmax.at(worst, pt, e_hi)
        at_max = np.flatnonzero(e_hi == worst[pt])
        first_at = np.full(K, pr.size, np.int64)
        np.minimum.at(first_at, pt[at_max], at_max)
        top_tasks = np.flatnonzero(first_at < pr.size)
        top_rows = pr[first_at[top_tasks]]
        # smallest certified margin over determined, well-routed queries
        ok_det = has & route_ok
        margins = np.full(K, np.inf)
        np.minimum.at(margins, det[ok_det], res.margin[ok_det])
        oq = b.object_query & has
        oq_count = np.bincount(det[oq], minlength=K)
        broken = np.bincount(det[oq & (res.ablated_lo >= eps)], minlength=K)
        for k in np.flatnonzero(q):
            r = rep.tasks[k]
            r.queries += int(q[k]); r.misrouted += int(bad_r[k]); r.over_epsilon += int(bad_e[k])
            r.object_queries += int(oq_count[k]); r.ablation_broken += int(broken[k])
            r.min_margin = min(r.min_margin, float(margins[k]))
        for i, k in zip(top_rows, top_tasks):
            if res.err_hi[i] > self.worst[k]:
                self.worst[k] = res.err_hi[i]
                rec = rep.tasks[k]
                rec.worst_error, rec.worst_error_lower = float(res.err_hi[i]), float(res.err_lo[i])
                self.worst_ref[k] = (self._ref(b, i), int(b.index[i]))
        room = MAX_COUNTEREXAMPLES - len(self.pending)
        names = self.taskset.names
        for i in np.flatnonzero(~route_ok)[:max(room, 0)]:
            k = int(e[i])
            self.pending.append(("routing", self._ref(b, i), int(b.index[i]), {
                "routed_expert": k, "routed_task": names[served[i]] if served[i] >= 0 else None,
                "margin": float(res.margin[i]), "gate_scores": _top_gate(res, i, weights)}))
        room = MAX_COUNTEREXAMPLES - len(self.pending)
        for i in np.flatnonzero(err_bad)[:max(room, 0)]:
            pred = res.predicted[i]
            self.pending.append(("error", self._ref(b, i), int(b.index[i]), {
                "routed_expert": int(e[i]), "routed_task": names[served[i]] if served[i] >= 0 else None, "error_lower": float(res.err_lo[i]), "error_upper": float(res.err_hi[i]),
                "epsilon": eps, "predicted": weights.vocab[pred] if pred >= 0 else "(a zero-logit token)"}))
        room = MAX_COUNTEREXAMPLES - len(self.pending)
        for i in np.flatnonzero(oq & ~(res.ablated_lo >= eps))[:max(room, 0)]:
            self.pending.append(("entanglement", self._ref(b, i), int(b.index[i]), {
                "routed_expert": int(e[i]), "routed_task": names[served[i]] if served[i] >= 0 else None, "ablated_error_lower": float(res.ablated_lo[i]), "epsilon": eps,
                "why": "with its expert's output removed the model still answers this object query: "
                       "the knowledge is not (only) in that expert"}))

    @staticmethod
    def _ref(b, i: int) -> tuple[int, int, int]:
        """(node, lo, hi): the group part holding row i of batch b."""
        return int(b.node[i]), int(b.part[i, 0]), int(b.part[i, 1])

    def finish(self) -> None:
        """Describe the worst query of each task and the counterexamples, building each
        group part they point into once (in order of parts; one part held at a time)."""
        vocab = self.taskset.vocabulary
        wanted: dict[tuple[int, int, int], list[tuple[str, int, int]]] = {}
        for k, ref in enumerate(self.worst_ref):
            if ref is not None:
                wanted.setdefault(ref[0], []).append(("worst", k, ref[1]))
        for j, (_, ref, i, _) in enumerate(self.pending):
            wanted.setdefault(ref, []).append(("counterexample", j, i))
        described: dict[int, dict[str, Any]] = {}
        for ref in sorted(wanted):
            node, lo, hi = ref
            group = build_group(self.taskset, self.trie, self.trie.nodes[node], None if lo < 0 else (lo, hi))
            for kind, key, i in wanted[ref]:
                if kind == "worst":
                    self.report.tasks[key].worst_query = " ".join(group.prefix_tokens(i, vocab))
                else:
                    described[key] = _describe(self.taskset, group, i)
        for j, (check, _, _, numbers) in enumerate(self.pending):
            self.report.counterexamples.append({"check": check, **described[j], **numbers})


def _describe(taskset: TaskSet, group: QueryGroup, i: int) -> dict[str, Any]:
    vocab = taskset.vocabulary
    k = int(group.witness_task[i])
    task = taskset.tasks[k]
    subject = vocab.token(group.subjects[i]) if group.subjects[i] >= 0 else None
    return {
        "task": task.name,
        "template": str(task.templates[int(group.witness_template[i])]),
        "subject": subject,
        "prefix": " ".join(group.prefix_tokens(i, vocab)),
        "valid_next": sorted(vocab.token(t) for t in group.valid_of(i))[:10],
        "consistent_tasks": [taskset.names[j] for j in group.allowed_of(i)],
    }


def _top_gate(res, i: int, weights: Weights) -> list[dict[str, Any]]:
    ids, lo, hi = res.top_gate
    return [{"expert": int(k), "task": weights.expert_tasks[k] or None, "lower": float(a), "upper": float(b)}
            for k, a, b in zip(ids[i], lo[i], hi[i]) if k >= 0]
