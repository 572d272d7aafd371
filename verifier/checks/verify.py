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
from verifier.checks.classes import ClassRecorder
from verifier.checks.localization import l1_thresholds, localization, object_lows, p_upper, row_gaps
from verifier.passes.floating import Deployment
from verifier.running.parallel import Executor, LocalPool
from verifier.running.runner import PassSpec, Runner, require_allowed, verify_batch
from layout import Weights
from layout.digest import weights_digest

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
    misrouted: int = 0
    over_epsilon: int = 0
    ablation_broken: int = 0     # object queries broken by ablating this task's expert: ablated error >= ε ((b))
    isolated: bool | None = None  # expert built alone is identical (None: not checked)
    closed_form_bound: float | None = None
    objects: int = 0             # |O_k|: the task's distinct objects
    l1_held: int = 0             # object queries certified P_ablated(o) <= 1/|O_k|
    l2_held: int = 0             # object queries whose object is certified not the strict top token once ablated
    localized: int = 0           # object queries with (b), L1 and L2 all certified
    min_ablated_lower: float = float("inf")   # smallest lower end of the ablated error over object queries
    min_object_lower: float = float("inf")    # smallest lower end of 1 − P_ablated(o) (o alone) over them
    min_gap: float = float("inf")             # smallest certified L2 gap over object queries (−inf: undecided)

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

    @property
    def l1_ok(self) -> bool:
        return self.l1_held == self.object_queries

    @property
    def l2_ok(self) -> bool:
        return self.l2_held == self.object_queries

    def graded(self) -> dict[str, Any]:
        """Per check, the share of this task's queries certified (entanglement: of its object
        queries, all three of (b), L1 and L2; None where there are none); size: yes/no."""
        share = lambda good, n: (good / n) if n else None  # noqa: E731
        return {"error": share(self.queries - self.over_epsilon, self.queries),
                "routing": share(self.queries - self.misrouted, self.queries),
                "entanglement": share(self.localized, self.object_queries),
                "l1": share(self.l1_held, self.object_queries), "l2": share(self.l2_held, self.object_queries),
                "size": self.size_ok}

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
        return (self.ablation_broken == self.object_queries and self.localized == self.object_queries
                and self.l1_ok and self.l2_ok and self.isolated is not False)

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
    over_epsilon_queries: int = 0              # queries whose error is not certified below ε (each once)
    misrouted_queries: int = 0                 # queries whose routing is not certified (each once)
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
        raise TaskError(f"the weights have {weights.n_positions} positions; prefixes up to length {taskset.L - 1} need {taskset.L}",
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
    expert_of_task = {name: k for k, name in enumerate(weights.expert_tasks) if name}
    K_tasks, K_exp = len(names), len(weights.experts)
    expert_task_index = np.array([names.index(t) if t in names else -1 for t in weights.expert_tasks], np.int64)
    records = []
    n_objects, _ = l1_thresholds(taskset)
    for k, task in enumerate(taskset.tasks):
        e = expert_of_task.get(task.name)
        records.append(TaskRecord(task.name, task.n_templates, task.n_facts, taskset.L, taskset.complexity(k),
                                  e, weights.experts[e].width if e is not None else None, objects=int(n_objects[k])))
    trie = taskset.structure
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
    # Size: every expert that receives a task's determined queries counts, not only the named one.
    for k, r in enumerate(records):
        for e in np.flatnonzero(report.routing_matrix[k]):
            if widths[e] > (r.width or 0):
                r.width, r.expert = widths[e], int(e)
    report.measured_worst = max((r.worst_error for r in records), default=0.0)
    report.seconds = report.verify_seconds = time.perf_counter() - start
    return report


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
    pass), the task names and each expert's task. Tokens are named later, by
    :meth:`Tally.add` (the vocabulary is not small)."""

    serves: np.ndarray
    epsilon: float
    l1_thr: np.ndarray
    n_objects: np.ndarray
    exact_vocab: int | None
    task_names: tuple[str, ...]
    expert_tasks: tuple[str, ...]


@dataclass
class BatchTally:
    """What one batch (or some of its rows) adds to the per-task records (:func:`tally`):
    counts, extremes, its worst query per task and its counterexamples, each category in
    row order (up to ``MAX_COUNTEREXAMPLES`` each; :meth:`Tally.add` keeps the first of all
    batches in order). ``worst_at`` and ``pending_at`` hold the batch row of each worst
    query and counterexample, so that shares of row subsets combine into the batch's own
    (:meth:`combine`)."""

    n: int
    counts: dict[str, np.ndarray]          # per task: queries, misrouted, over ε, object queries, L1/L2/...
    lows: dict[str, np.ndarray]            # per task: smallest ablated lower end, object lower end, gap, margin
    worst: list[tuple[int, float, float, tuple[int, int, int], int]]   # (task, err_hi, err_lo, ref, index)
    routing: tuple[np.ndarray, np.ndarray, np.ndarray]                  # (task, expert, count) of determined rows
    foreign: int
    pending: tuple[list, list, list]       # routing, error, entanglement counterexamples
    worst_at: list[int]                    # batch row of each entry of worst
    pending_at: tuple[list, list, list]    # batch row of each counterexample
    #: queries over ε and misrouted, each counted once (a row of several consistent tasks
    #: is in each of their ``counts``, so the per-task counts do not add up to these)
    distinct: tuple[int, int] = (0, 0)

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
        for c in range(3):
            found = sorted(((row, j, entry) for j, t in enumerate(shares)
                            for entry, row in zip(t.pending[c], t.pending_at[c])), key=lambda x: x[0])
            found = found[:MAX_COUNTEREXAMPLES]
            pending.append([entry for _, _, entry in found])
            pending_at.append([row for row, _, _ in found])
        return BatchTally(n, counts, lows, [best[k][2] for k in ks], routing, sum(t.foreign for t in shares),
                          tuple(pending), [best[k][1] for k in ks], tuple(pending_at),
                          (sum(t.distinct[0] for t in shares), sum(t.distinct[1] for t in shares)))


def tally(rules: TallyRules, b, res, rows: np.ndarray | None = None) -> BatchTally:
    """The records' share of batch ``b`` with results ``res``: a pure function, so it can
    run where the batch ran and only its small summary travel (:meth:`Tally.add`).
    ``rows``: the rows of a larger batch that ``b`` holds (increasing; default: b is the
    whole batch), recorded with the worst queries and counterexamples so that the shares
    of a partition combine exactly (:meth:`BatchTally.combine`)."""
    n, K = len(b), len(rules.task_names)
    at = np.arange(n) if rows is None else np.asarray(rows, np.int64)
    eps = rules.epsilon
    rows = np.arange(n)
    e = res.expert
    served = rules.serves[e]
    counts = np.diff(b.allowed_ptr)
    pr = np.repeat(rows, counts)
    pt = b.allowed
    member = np.zeros(n, bool)                   # the routed expert serves a consistent task
    member[pr[np.repeat(served, counts) == pt]] = True
    route_ok = (~res.ambiguous) & (served >= 0) & member
    err_bad = ~(res.err_hi < eps)
    det = b.determined
    has = det >= 0
    # the distinct (determined task, routed expert) pairs, by one integer key (a sort of
    # integers, not of rows): key = task·(K_exp + 1) + (expert + 1), in the same order
    span = rules.serves.size + 1
    keys, hits = np.unique(det[has].astype(np.int64) * span + (e[has].astype(np.int64) + 1), return_counts=True)
    pairs = np.stack([keys // span, keys % span - 1])
    foreign = int(np.count_nonzero(has & (served != det) & (served >= 0)))
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
    b_ok, l1, l2, loc = localization(res, det, oq, eps, rules.l1_thr, rules.exact_vocab)
    ab_low = np.full(K, np.inf)
    np.minimum.at(ab_low, det[oq], np.where(np.isnan(res.ablated_lo[oq]), -np.inf, res.ablated_lo[oq]))
    obj = object_lows(res, n)
    obj_low = np.full(K, np.inf)
    np.minimum.at(obj_low, det[oq], np.where(np.isnan(obj[oq]), -np.inf, obj[oq]))
    gap = row_gaps(res, n)
    gaps = np.full(K, np.inf)
    np.minimum.at(gaps, det[oq], gap[oq])
    out_counts = {"queries": np.bincount(pt, minlength=K), "misrouted": np.bincount(pt[~route_ok[pr]], minlength=K),
                  "over_epsilon": np.bincount(pt[err_bad[pr]], minlength=K),
                  "object_queries": np.bincount(det[oq], minlength=K), "ablation_broken": np.bincount(det[b_ok], minlength=K),
                  "l1_held": np.bincount(det[l1], minlength=K), "l2_held": np.bincount(det[l2], minlength=K),
                  "localized": np.bincount(det[loc], minlength=K)}
    lows = {"min_ablated_lower": ab_low, "min_object_lower": obj_low, "min_gap": gaps, "min_margin": margins}
    worst_rows = [(int(k), float(res.err_hi[i]), float(res.err_lo[i]), _ref(b, i), int(b.index[i]))
                  for i, k in zip(top_rows.tolist(), top_tasks.tolist())]
    names = rules.task_names
    routing_cx = []
    routing_rows = np.flatnonzero(~route_ok)[:MAX_COUNTEREXAMPLES]
    for i in routing_rows:
        k = int(e[i])
        routing_cx.append(("routing", _ref(b, i), int(b.index[i]), {
            "routed_expert": k, "routed_task": names[served[i]] if served[i] >= 0 else None,
            "margin": float(res.margin[i]), "gate_scores": _top_gate(res, i, rules.expert_tasks)}))
    error_cx = []
    error_rows = np.flatnonzero(err_bad)[:MAX_COUNTEREXAMPLES]
    for i in error_rows:
        error_cx.append(("error", _ref(b, i), int(b.index[i]), {      # "predicted": a token id (Tally.add names it)
            "routed_expert": int(e[i]), "routed_task": names[served[i]] if served[i] >= 0 else None, "error_lower": float(res.err_lo[i]), "error_upper": float(res.err_hi[i]),
            "epsilon": eps, "predicted": int(res.predicted[i])}))
    entangled_rows = np.flatnonzero(oq & ~loc)[:MAX_COUNTEREXAMPLES]
    entangled_cx = []
    for i in entangled_rows:
        k = int(det[i])
        failed = [name for name, ok in (("ablation", b_ok[i]), ("L1", l1[i]), ("L2", l2[i])) if not ok]
        entangled_cx.append(("entanglement", _ref(b, i), int(b.index[i]), {
            "routed_expert": int(e[i]), "routed_task": names[served[i]] if served[i] >= 0 else None,
            "ablated_error_lower": float(res.ablated_lo[i]), "epsilon": eps,
            "p_ablated_upper": p_upper(obj[i]), "objects": int(rules.n_objects[k]),
            "uniform_bound": 1.0 / int(rules.n_objects[k]) if rules.n_objects[k] else None,
            "l2_gap": float(gap[i]), "failed": failed,
            "why": "with its expert's output removed the model still answers this object query: "
                   "the knowledge is not (only) in that expert"}))
    return BatchTally(n, out_counts, lows, worst_rows, (pairs[0], pairs[1], hits), foreign,
                      (routing_cx, error_cx, entangled_cx), at[top_rows].tolist(),
                      tuple(at[r].tolist() for r in (routing_rows, error_rows, entangled_rows)),
                      (int(np.count_nonzero(err_bad)), int(np.count_nonzero(~route_ok))))


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
        rep.over_epsilon_queries += t.distinct[0]
        rep.misrouted_queries += t.distinct[1]
        c, lo = t.counts, t.lows
        for k in np.flatnonzero(c["queries"]):
            r = rep.tasks[k]
            r.queries += int(c["queries"][k]); r.misrouted += int(c["misrouted"][k])
            r.over_epsilon += int(c["over_epsilon"][k])
            r.object_queries += int(c["object_queries"][k]); r.ablation_broken += int(c["ablation_broken"][k])
            r.l1_held += int(c["l1_held"][k]); r.l2_held += int(c["l2_held"][k]); r.localized += int(c["localized"][k])
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
        for found in t.pending:
            room = MAX_COUNTEREXAMPLES - len(self.pending)
            for check, ref, index, numbers in found[:max(room, 0)]:
                if check == "error":
                    pred = numbers["predicted"]
                    numbers = {**numbers, "predicted": vocab[pred] if pred >= 0 else "(a zero-logit token)"}
                self.pending.append((check, ref, index, numbers))

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


def _top_gate(res, i: int, expert_tasks) -> list[dict[str, Any]]:
    ids, lo, hi = res.top_gate
    return [{"expert": int(k), "task": expert_tasks[k] or None, "lower": float(a), "upper": float(b)}
            for k, a, b in zip(ids[i], lo[i], hi[i]) if k >= 0]
