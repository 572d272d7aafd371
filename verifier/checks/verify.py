"""The checks, over every query of a task set: the certification core's verdict.

:func:`verify` runs the certified forward pass (:mod:`verifier.passes.forward`) on every
query, grouped by template structure and chunked, and decides:

1. **error**: every query's error enclosure lies below ε (upper end < ε);
2. **routing**: every query has a certified unique winner (margin > 0) serving a task
   consistent with the prefix; determined prefixes (object queries included) thus go
   to their own task's expert;
3. **size**: the width of every expert serving task k (named for it, or receiving one
   of its determined queries) is at most c(k) = L·|T(k)| + N_k;
4. **entanglement** (localization): (a) no query determined by task i reaches expert
   j != i (so ablating expert j, whose output only queries routed to j see, changes no
   prediction of another task); and for every object query q of task k (subject s,
   object o, routed expert e), with z = U·r the logits once e's output is removed (r the
   residual; the same ablated computation as (b)), the model *cannot answer q without
   its expert*:

   * **L1**: P_ablated(o) <= 1/|O_k|, O_k the distinct objects of task k (no better than
     a uniform guess among the task's objects), certified by a lower end of
     1 − P_ablated(o), o's probability alone (the ablated error of the valid set {o},
     ``BatchResult.ablated_object_lo``: q's valid words do not count against the expert),
     being >= 1 − 1/|O_k|, compared with the smallest float at or above that rational
     (:func:`l1_threshold`: exact, never a float rounded the wrong way), or in the exact
     pass by the exact argument of :func:`verifier.checks.localization.localization`.
     |O_k| = 1 makes L1 vacuous (1 − 1/1 = 0);
   * **L2**: o is not the strict top token: some t != o has z_t >= z_o, certified by a
     lower bound of max_{t != o} z_t − z_o that is >= 0 (computed by the kernels from the
     enclosures of the ablated logits: max_{t != o} lo(z_t) − hi(z_o), an untouched
     token's logit being exactly 0; a tie counts, since a greedy argmax may return either);
   * **(b)** (the original criterion): the ablated error's lower end is >= ε, the whole
     valid set's error (L1, of o alone, does not imply it).

   The per-task worst case is reported: the largest certified upper end of P_ablated(o)
   beside 1/|O_k|, and the smallest L2 gap;
5. **counterexamples** for every failure: task, template, subject, prefix, numbers.

Each check is an entry of :mod:`verifier.checks.catalogue`, and each batch's rows are decided
once, by :func:`verifier.checks.catalogue.decide` (the query classes of a certificate take
the same decision); the per-task records, their counts and the report iterate the catalogue.

Per task the report also grades each check: the share of its queries certified (error,
routing; entanglement over its object queries), so that weights that do not certify
(trained ones) show how far they are.

The verifier reads only a :class:`layout.Weights` and the task set; it knows nothing of
how the weights were made. Evidence that only the construction can give (the closed
form, the rebuild-without-each-task isolation check) is attached to the :class:`Report`
by the library layer above it (:mod:`workflow.check`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from tasks.errors import TaskError
from tasks.model import TaskSet
from tasks.queries import QueryGroup, build_group
from tasks.structure import check_routable
from verifier.passes.batches import BATCH_ROWS, batch_rows, batches
from verifier.checks import catalogue
from verifier.checks.classes import ClassRecorder
from verifier.checks.localization import l1_thresholds, p_upper
from verifier.passes.floating import Deployment
from verifier.running.parallel import Executor, LocalPool
from verifier.running.runner import PassSpec, Runner, require_allowed, verify_batch
from layout import Weights
from layout.digest import weights_digest
from tasks.structure import structure_of

CHUNK = BATCH_ROWS
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
    isolated: bool | None = None  # expert built alone is identical (None: not checked)
    closed_form_bound: float | None = None
    objects: int = 0             # |O_k|: the task's distinct objects
    min_ablated_lower: float = float("inf")   # smallest lower end of the ablated error over object queries
    min_object_lower: float = float("inf")    # smallest lower end of 1 − P_ablated(o) (o alone) over them
    min_gap: float = float("inf")             # smallest certified L2 gap over object queries (−inf: undecided)
    #: per count of the catalogue (verifier.checks.catalogue.counted): the queries failing a
    #: check (misrouted, over_epsilon) or holding it (ablation_broken: the ablated error >= ε,
    #: (b); l1_held, l2_held; localized: (b), L1 and L2 all certified)
    counts: dict[str, int] = field(default_factory=catalogue.zero_counts)
    compose: tuple[str, str] | None = None    # a composed task's two parts (tasks.composition)

    @property
    def uniform_bound(self) -> float | None:
        """1/|O_k| (as a float, for reading; the check compares exactly: :func:`l1_threshold`)."""
        return 1.0 / self.objects if self.objects else None

    @property
    def worst_p_ablated(self) -> float | None:
        """The largest certified upper end of P_ablated(o) over the object queries,
        1 − (smallest lower end of 1 − P_ablated(o)) rounded up; None without object queries."""
        if not self.object_queries:
            return None
        return p_upper(self.min_object_lower)

    def ok(self, check: "catalogue.QueryCheck | catalogue.TaskCheck") -> bool:
        """Whether this task holds the check (an entry of :mod:`verifier.checks.catalogue`)."""
        return check.task_holds(self)

    def graded(self) -> dict[str, Any]:
        """Per check, the share of this task's queries certified (entanglement: of its object
        queries, all three of (b), L1 and L2; None where there are none); size: yes/no."""
        return {c.name: c.share(self) for c in catalogue.graded()}

    @property
    def certified(self) -> bool:
        return all(c.task_holds(self) for c in catalogue.CHECKS)

    # the catalogue's counts and verdicts under the names they have always had
    misrouted = property(lambda self: self.counts["misrouted"])
    over_epsilon = property(lambda self: self.counts["over_epsilon"])
    ablation_broken = property(lambda self: self.counts["ablation_broken"])
    l1_held = property(lambda self: self.counts["l1_held"])
    l2_held = property(lambda self: self.counts["l2_held"])
    localized = property(lambda self: self.counts["localized"])
    error_ok = property(lambda self: catalogue.ERROR.task_holds(self))
    routing_ok = property(lambda self: catalogue.ROUTING.task_holds(self))
    size_ok = property(lambda self: catalogue.SIZE.task_holds(self))
    entanglement_ok = property(lambda self: catalogue.ENTANGLEMENT.task_holds(self))
    l1_ok = property(lambda self: catalogue.L1.task_holds(self))
    l2_ok = property(lambda self: catalogue.L2.task_holds(self))


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
    #: per check over every query (error, routing), the queries failing it, each once (a query
    #: consistent with several tasks is in each of their counts)
    failing: dict[str, int] = field(default_factory=dict)
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

    @property
    def over_epsilon_queries(self) -> int:
        """Queries whose error is not certified below ε (each once)."""
        return self.failing.get("error", 0)

    @property
    def misrouted_queries(self) -> int:
        """Queries whose routing is not certified (each once)."""
        return self.failing.get("routing", 0)

    def attach(self, closed_form: str, bound: float, gate: str, isolated: Sequence[bool | None] | None,
               notes: Sequence[str] = (), bound_proven: bool | None = None) -> None:
        """Add evidence from whoever built the weights: a closed-form error bound (shown beside
        the measured worst error; ``bound_proven``: whether its side conditions hold, so
        that it bounds every query's error, None if not checked) and, per task, whether its
        expert is isolated (a ``False`` fails that task's entanglement check; None, for
        every task or for one, not checked)."""
        self.closed_form, self.closed_form_value, self.gate = closed_form, bound, gate
        self.closed_form_proven = bound_proven
        for i, r in enumerate(self.tasks):
            r.closed_form_bound = bound
            if isolated is not None and isolated[i] is not None:
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
        raise TaskError(f"the weights have {weights.n_positions} positions; prefixes up to length "
                        f"{taskset.L - 1} need {taskset.L}",
                        file=source, fix="verify weights built for this task set")
    return tmap


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

    ``deployment`` (a floating-point format, :mod:`verifier.passes.floating`): certify every
    execution of the model deployed in that format instead of the exact forward pass.

    ``classes`` (:class:`verifier.checks.classes.ClassRecorder`, exact pass on local processes
    only): also aggregate every batch into query classes, for a saved certificate; the
    recorder's ``watch`` mask says which neurons' possible activity to record.

    On local processes nothing here holds ``weights`` once the pass has built its tables
    (:meth:`verifier.running.runner.Runner.release`): a caller that hands them over
    (``verify(taskset, load(path), ...)``) lets their memory go for the pass.
    """
    start = time.perf_counter()
    tmap = fitting(taskset, weights, source)
    names = taskset.names
    expert_task_index = np.array([names.index(t) if t in names else -1 for t in weights.expert_tasks], np.int64)
    trie = structure_of(taskset)
    check_routable(taskset, trie)   # object queries must determine their task (else: bad input)
    # Progress needs only an estimate (an upper bound: subjects counted once per task through
    # each node); the report's count is the exact number of queries processed.
    sizes = [t.n_facts for t in taskset.tasks]
    total = sum(1 if not n.has_subject else sum(sizes[k] for k in n.tasks) for n in trie)
    report = assemble_report(taskset, weights, epsilon, 0)
    if deployment is not None:
        report.precision, report.precision_model = deployment.fmt.name, deployment.describe()
    K_exp = len(weights.experts)
    executor = executor if executor is not None else LocalPool(jobs)
    spec = PassSpec.for_taskset(taskset, weights, tmap, deployment)
    require_allowed(spec, executor, classes is not None)
    runner = Runner(weights, tmap, spec, executor, taskset=taskset,
                    watched=None if classes is None else [classes.watch[a:b] for a, b in
                                                          zip(classes.off[:-1], classes.off[1:])])
    naming, widths = Names.of(weights), [e.width for e in weights.experts]
    if executor.shares_memory:
        runner.release()                     # built once, before any worker starts; the weights let go
    del weights                              # (a caller that handed them over holds none either)
    state = Tally(taskset, trie, report, expert_task_index, epsilon, naming, exact=deployment is None)
    chunk = batch_rows(K_exp, CHUNK)
    done = 0

    def sent(stream):
        for batch in stream:
            report.enumerated += len(batch)
            yield batch

    stream = sent(batches(taskset, trie, chunk))
    if executor.shares_memory and classes is None:
        # each batch's share of the records is computed where the batch ran (only a small
        # summary comes back), so that the workers, not this process, do the per-row work
        shares = executor.map(_tallied, (runner.full(), state.rules), stream)
    elif classes is None:
        # on a cluster a batch is cut by shards: each unit's share is computed where it ran,
        # and the shares of one batch combine into the batch's own
        shares = ((batch, BatchTally.combine(len(batch), got))
                  for batch, got in runner.run_reduced(stream, partial(tally, state.rules)))
    else:
        shares = ((batch, res) for batch, res in runner.run(stream))
    for batch, got in shares:
        if isinstance(got, BatchTally):
            state.add(got)
        else:
            state.record(batch, got)
            if classes is not None:
                classes.record(batch, got)
        report.deferred = runner.deferred
        done += len(batch)
        report.queries = done
        if progress:
            progress(done, total)
    state.finish()
    if progress:
        progress(done, -1)
    close_report(report, widths)
    report.seconds = report.verify_seconds = time.perf_counter() - start
    return report


def task_records(taskset: TaskSet, weights: Weights) -> list[TaskRecord]:
    """A record per task, nothing recorded yet: its size, its bound c(k), |O_k|, and the expert
    named for it with that expert's width."""
    expert_of_task = {name: k for k, name in enumerate(weights.expert_tasks) if name}
    n_objects, _ = l1_thresholds(taskset)
    records = []
    for k, task in enumerate(taskset.tasks):
        e = expert_of_task.get(task.name)
        records.append(TaskRecord(task.name, task.n_templates, task.n_facts, taskset.L, taskset.complexity(k),
                                  e, weights.experts[e].width if e is not None else None, objects=int(n_objects[k]),
                                  compose=task.compose))
    return records


def assemble_report(taskset: TaskSet, weights: Weights, epsilon: float, queries: int) -> Report:
    """The report of ``weights`` on ``taskset`` before its queries' results are recorded
    (by :class:`Tally`, or from query classes, :func:`record_totals`): the task records, the
    weights' digest and parameter counts, an empty routing matrix. :func:`close_report`
    finishes it. The one assembly of a full check's report and a re-certification's."""
    report = Report(epsilon, dict(weights.parameters), task_records(taskset, weights), queries)
    report.weights_sha256 = weights_digest(weights)
    counts = weights.parameter_counts()
    counts["facts_per_parameter"] = taskset.n_facts / counts["total"] if counts["total"] else None
    report.parameter_counts = counts
    report.routing_matrix = np.zeros((len(taskset.tasks), len(weights.experts)), np.int64)
    return report


def close_report(report: Report, widths: Sequence[int]) -> None:
    """What follows from the recorded queries: the size check's width (every expert that
    receives a task's determined queries counts, not only the named one; ``widths`` per
    expert) and the worst error measured."""
    for k, r in enumerate(report.tasks):
        for e in np.flatnonzero(report.routing_matrix[k]):
            if widths[e] > (r.width or 0):
                r.width, r.expert = widths[e], int(e)
    report.measured_worst = max((r.worst_error for r in report.tasks), default=0.0)


def record_totals(report: Report, tot) -> None:
    """Record a table of query classes' totals (:func:`verifier.checks.classes.records`) in
    ``report``: per task its counts, extremes and worst query; the routing matrix, the
    foreign queries, the queries failing each check (each once) and the queries recorded."""
    for k, r in enumerate(report.tasks):
        r.queries, r.object_queries = int(tot.queries[k]), int(tot.object_queries[k])
        for name, values in tot.counts.items():
            r.counts[name] = int(values[k])
        r.min_ablated_lower, r.min_gap = float(tot.min_ablated_lower[k]), float(tot.min_gap[k])
        r.min_object_lower = float(tot.min_object_lower[k])
        r.min_margin = float(tot.min_margin[k])
        if tot.worst[k] > -np.inf:
            r.worst_error, r.worst_error_lower, r.worst_query = (float(tot.worst[k]),
                                                                 float(tot.worst_lower[k]), tot.worst_query[k])
    report.queries = tot.total_queries
    report.routing_matrix = tot.routing
    report.foreign = tot.foreign
    report.failing = dict(tot.failing)


@dataclass(frozen=True)
class Names:
    """What a counterexample names from the weights: token strings and each expert's task."""

    vocab: Sequence[str]
    expert_tasks: Sequence[str]

    @staticmethod
    def of(weights: Weights) -> "Names":
        return Names(weights.vocab, weights.expert_tasks)           # the weights' own sequences, not copied


@dataclass(frozen=True)
class TallyRules:
    """What deciding and describing a batch's queries needs, all of it small (it travels
    with every work unit of a cluster): per expert the task it serves, ε, per task L1's
    threshold and |O_k|, the vocabulary size for L1's exact argument (None: a deployed
    pass), the task names and each expert's task, and the per-query checks
    (:data:`verifier.checks.catalogue.PER_QUERY`; :func:`verifier.checks.catalogue.decide`).
    Tokens are named later, by :meth:`Tally.add` (the vocabulary is not small)."""

    serves: np.ndarray
    epsilon: float
    l1_thr: np.ndarray
    n_objects: np.ndarray
    exact_vocab: int | None
    task_names: tuple[str, ...]
    expert_tasks: tuple[str, ...]
    checks: tuple[catalogue.QueryCheck, ...] = field(default_factory=lambda: catalogue.PER_QUERY)


@dataclass
class BatchTally:
    """What one batch (or some of its rows) adds to the per-task records (:func:`tally`):
    counts, extremes, its worst query per task and its counterexamples, each category (a
    per-query check, in the order of ``TallyRules.checks``) in row order (up to
    ``MAX_COUNTEREXAMPLES`` each; :meth:`Tally.add` keeps the first of all batches in
    order). ``worst_at`` and ``pending_at`` hold the batch row of each worst query and
    counterexample, so that shares of row subsets combine into the batch's own
    (:meth:`combine`)."""

    n: int
    counts: dict[str, np.ndarray]          # per task: queries, object queries, and each count of the catalogue
    lows: dict[str, np.ndarray]            # per task: smallest ablated lower end, object lower end, gap, margin
    worst: list[tuple[int, float, float, tuple[int, int, int], int]]   # (task, err_hi, err_lo, ref, index)
    routing: tuple[np.ndarray, np.ndarray, np.ndarray]                  # (task, expert, count) of determined rows
    foreign: int
    pending: tuple[list, ...]              # per check, its counterexamples
    worst_at: list[int]                    # batch row of each entry of worst
    pending_at: tuple[list, ...]           # batch row of each counterexample
    #: per check over every query, the queries failing it, each counted once (a row of several
    #: consistent tasks is in each of their ``counts``, so the per-task counts do not add up to these)
    distinct: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def combine(n: int, shares: "Sequence[BatchTally]") -> "BatchTally":
        """The share of a whole batch of ``n`` rows from the shares of a partition of its
        rows, equal to :func:`tally` of the whole batch, field by field (up to the order of
        the routing triples, which are summed).

        Proof sketch. Counts (per task and distinct) and routing triples are sums over rows; the lows are minima
        (``np.minimum``, NaN-propagating like the whole batch's ``minimum.at``), and both
        are associative over a partition. The worst query of task k is the first row in
        batch order of the largest error: the largest of the shares' largest, then the
        smallest batch row among the shares attaining it. Each category's counterexamples
        are the first ``MAX_COUNTEREXAMPLES`` flagged rows in batch order; every share
        holds its own first ones (its rows in increasing batch order), and the first of the
        union are among those, so sorting the shares' entries by batch row and keeping the
        first ``MAX_COUNTEREXAMPLES`` gives the whole batch's."""
        if sum(t.n for t in shares) != n:
            raise RuntimeError(f"work units returned {sum(t.n for t in shares)} rows for a batch of {n}")
        if len(shares) == 1:
            return shares[0]
        first = shares[0]
        counts = {key: sum(t.counts[key] for t in shares) for key in first.counts}
        lows = {key: np.minimum.reduce([t.lows[key] for t in shares]) for key in first.lows}
        best: dict[int, tuple[float, int, tuple]] = {}
        for t in shares:
            for entry, row in zip(t.worst, t.worst_at):
                k, hi = entry[0], entry[1]
                held = best.get(k)
                if held is None or hi > held[0] or (hi == held[0] and row < held[1]):
                    best[k] = (hi, row, entry)
        ks = sorted(best)
        routing = tuple(np.concatenate([t.routing[i] for t in shares]) for i in range(3))
        pending, pending_at = [], []
        for c in range(len(first.pending)):
            found = sorted(((row, j, entry) for j, t in enumerate(shares)
                            for entry, row in zip(t.pending[c], t.pending_at[c])), key=lambda x: x[0])
            found = found[:MAX_COUNTEREXAMPLES]
            pending.append([entry for _, _, entry in found])
            pending_at.append([row for row, _, _ in found])
        return BatchTally(n, counts, lows, [best[k][2] for k in ks], routing, sum(t.foreign for t in shares),
                          tuple(pending), [best[k][1] for k in ks], tuple(pending_at),
                          {key: sum(t.distinct[key] for t in shares) for key in first.distinct})


def tally(rules: TallyRules, b, res, rows: np.ndarray | None = None) -> BatchTally:
    """The records' share of batch ``b`` with results ``res``: a pure function, so it can
    run where the batch ran and only its small summary travel (:meth:`Tally.add`).
    ``rows``: the rows of a larger batch that ``b`` holds (increasing; default: b is the
    whole batch), recorded with the worst queries and counterexamples so that the shares
    of a partition combine exactly (:meth:`BatchTally.combine`). Each row is decided once,
    by :func:`verifier.checks.catalogue.decide`."""
    n, K = len(b), len(rules.task_names)
    at = np.arange(n) if rows is None else np.asarray(rows, np.int64)
    d = catalogue.decide(rules, b, res)
    e, det, oq = d.rows.expert, b.determined, d.rows.object_query
    counts = np.diff(b.allowed_ptr)
    pr = np.repeat(np.arange(n), counts)
    pt = b.allowed
    has = det >= 0
    # the distinct (determined task, routed expert) pairs, by one integer key (a sort of
    # integers, not of rows): key = task·(K_exp + 1) + (expert + 1), in the same order
    span = rules.serves.size + 1
    keys, hits = np.unique(det[has].astype(np.int64) * span + (e[has].astype(np.int64) + 1), return_counts=True)
    pairs = np.stack([keys // span, keys % span - 1])
    foreign = int(np.count_nonzero(d.foreign))
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
    ok_det = has & d.holds[catalogue.ROUTING.name]
    margins = np.full(K, np.inf)
    np.minimum.at(margins, det[ok_det], res.margin[ok_det])
    ab_low = np.full(K, np.inf)
    np.minimum.at(ab_low, det[oq], np.where(np.isnan(res.ablated_lo[oq]), -np.inf, res.ablated_lo[oq]))
    obj = d.rows.object_lows
    obj_low = np.full(K, np.inf)
    np.minimum.at(obj_low, det[oq], np.where(np.isnan(obj[oq]), -np.inf, obj[oq]))
    gap = d.rows.gaps
    gaps = np.full(K, np.inf)
    np.minimum.at(gaps, det[oq], gap[oq])
    out_counts = {"queries": np.bincount(pt, minlength=K), "object_queries": np.bincount(det[oq], minlength=K)}
    for c in catalogue.counted(rules.checks):
        mask = d.counted(c)
        out_counts[c.count] = np.bincount(det[mask] if c.objects else pt[mask[pr]], minlength=K)
    lows = {"min_ablated_lower": ab_low, "min_object_lower": obj_low, "min_gap": gaps, "min_margin": margins}
    worst_rows = [(int(k), float(res.err_hi[i]), float(res.err_lo[i]), _ref(b, i), int(b.index[i]))
                  for i, k in zip(top_rows.tolist(), top_tasks.tolist())]
    pending, pending_rows = [], []
    for c in rules.checks:
        found = np.flatnonzero(d.failing(c))[:MAX_COUNTEREXAMPLES] if c.describe is not None else np.zeros(0, np.int64)
        pending.append([(c.name, _ref(b, i), int(b.index[i]), c.describe(d, i)) for i in found])
        pending_rows.append(found)
    distinct = {c.name: int(np.count_nonzero(d.failing(c))) for c in rules.checks if not c.objects}
    return BatchTally(n, out_counts, lows, worst_rows, (pairs[0], pairs[1], hits), foreign, tuple(pending),
                      at[top_rows].tolist(), tuple(at[r].tolist() for r in pending_rows), distinct)


def _tallied(state: tuple, batch) -> BatchTally:
    """A work unit: the certified pass over one batch (``state`` = (the full weights'
    :class:`verifier.running.runner.Shard`, the :class:`TallyRules`)) and its share of the records."""
    shard, rules = state
    return tally(rules, batch, verify_batch(shard, batch))


def _ref(b, i: int) -> tuple[int, int, int]:
    """(node, lo, hi): the group part holding row i of batch b."""
    return int(b.node[i]), int(b.part[i, 0]), int(b.part[i, 1])


class Tally:
    """Accumulates per-task results over batches (each batch's share computed by
    :func:`tally`, here or where the batch ran); describes failures at the end."""

    def __init__(self, taskset, trie, report: Report, expert_task_index: np.ndarray, epsilon: float,
                 names: Names, *, exact: bool) -> None:
        self.taskset, self.trie, self.report, self.names = taskset, trie, report, names
        n_objects, l1_thr = l1_thresholds(taskset)
        #: the exact pass decides L1 at its bound exactly (verifier.checks.localization); a deployed one cannot
        self.rules = TallyRules(expert_task_index, epsilon, l1_thr, n_objects, len(names.vocab) if exact else None,
                                tuple(taskset.names), tuple(names.expert_tasks))
        self.epsilon = epsilon
        K = len(taskset.tasks)
        self.worst = np.full(K, -1.0)
        self.worst_ref: list[tuple[tuple[int, int, int], int] | None] = [None] * K    # (part, index)
        self.pending: list[tuple[str, tuple[int, int, int], int, dict]] = []  # (check, part, index, numbers)

    def record(self, b, res) -> None:
        self.add(tally(self.rules, b, res))

    def add(self, t: BatchTally) -> None:
        """Merge one batch's share (batches in order: the first of equal worst errors, and
        the first counterexamples of each category, as the rows come)."""
        rep = self.report
        np.add.at(rep.routing_matrix, (t.routing[0], t.routing[1]), t.routing[2])
        rep.foreign += t.foreign
        for name, n in t.distinct.items():
            rep.failing[name] = rep.failing.get(name, 0) + n
        c, lo = t.counts, t.lows
        named = [name for name in c if name not in ("queries", "object_queries")]
        for k in np.flatnonzero(c["queries"]):
            r = rep.tasks[k]
            r.queries += int(c["queries"][k])
            r.object_queries += int(c["object_queries"][k])
            for name in named:
                r.counts[name] += int(c[name][k])
            r.min_ablated_lower = min(r.min_ablated_lower, float(lo["min_ablated_lower"][k]))
            r.min_object_lower = min(r.min_object_lower, float(lo["min_object_lower"][k]))
            r.min_gap = min(r.min_gap, float(lo["min_gap"][k]))
            r.min_margin = min(r.min_margin, float(lo["min_margin"][k]))
        for k, hi, low, ref, index in t.worst:
            if hi > self.worst[k]:
                self.worst[k] = hi
                rec = rep.tasks[k]
                rec.worst_error, rec.worst_error_lower = hi, low
                self.worst_ref[k] = (ref, index)
        vocab = self.names.vocab
        for check, found in zip(self.rules.checks, t.pending):
            room = MAX_COUNTEREXAMPLES - len(self.pending)
            for name, ref, index, numbers in found[:max(room, 0)]:
                for key in check.token_keys:
                    token = numbers[key]
                    numbers = {**numbers, key: vocab[token] if token >= 0 else "(a zero-logit token)"}
                self.pending.append((name, ref, index, numbers))

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
