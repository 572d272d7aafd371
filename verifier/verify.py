"""The checks of the brief's section 5, over every query of a task set.

:func:`verify` runs the certified forward pass (:mod:`verifier.forward`) on every
query, grouped by template structure and chunked, and decides:

1. **error**: every query's error enclosure lies below ε (upper end < ε);
2. **routing**: every query has a certified unique winner (margin > 0) serving a task
   consistent with the prefix; determined prefixes (object queries included) thus go
   to their own task's expert;
3. **size**: the width of the expert serving task k is at most c(k) = L·|T(k)| + N_k;
4. **entanglement**: (a) no query determined by task i reaches expert j != i (from 2:
   ablating expert j, whose output only queries routed to j see, changes no
   prediction of another task); (b) ablating the expert of task j (removing its
   output) breaks every object query of j: the ablated error's lower end is >= ε;
   (c) when the verifier built the model: each expert built from its task alone equals
   its expert in the full model, and building without a task leaves the other experts
   identical (all tasks when there are at most 12, else 12 chosen evenly);
5. **closed form**: the construction's bound beside the measured worst error (when
   the model was built here);
6. **counterexamples** for every failure: task, template, subject, prefix, numbers.

The verifier reads only :class:`verifier.layout.Weights` and the task set; the
construction is consulted only for the closed form and the isolation check (4c).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tasks.errors import TaskError
from tasks.model import TaskSet
from tasks.queries import QueryGroup, build_group
from tasks.structure import StructureTrie
from verifier.batches import batches
from verifier.forward import Prepared, run_batch
from verifier.parallel import ordered_map
from verifier.layout import Weights

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
    queries: int
    counterexamples: list[dict[str, Any]] = field(default_factory=list)
    closed_form: str | None = None
    closed_form_value: float | None = None
    measured_worst: float = 0.0
    gate: str | None = None
    routing_matrix: np.ndarray | None = None   # tasks x experts, determined queries
    foreign: int = 0                           # determined queries routed to another task's expert
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def certified(self) -> bool:
        return all(t.certified for t in self.tasks) and self.foreign == 0

    @property
    def verdict(self) -> str:
        return "certified" if self.certified else "not certified"


def token_map(taskset: TaskSet, weights: Weights, source: str = "weights") -> np.ndarray:
    """Task-set token id -> weights token id (by name)."""
    index = {t: i for i, t in enumerate(weights.vocab)}
    missing = [t for t in taskset.vocabulary.tokens if t not in index]
    if missing:
        raise TaskError(f"the weights' vocabulary lacks {len(missing)} token(s) of the task set, e.g. {missing[0]!r}",
                        file=source, fix="verify weights built for this task set")
    return np.array([index[t] for t in taskset.vocabulary.tokens], np.int64)


def verify(
    taskset: TaskSet,
    weights: Weights,
    epsilon: float,
    *,
    model=None,
    source: str = "weights",
    progress: Callable[[int, int], None] | None = None,
    isolation: bool = True,
    jobs: int = 1,
) -> Report:
    """Run every check; ``model`` is the SymbolicModel if the weights were built here.

    ``jobs`` worker processes share the batches (0: one per CPU); the result does not
    depend on it.
    """
    start = time.perf_counter()
    weights.validate(source)
    tmap = token_map(taskset, weights, source)
    if weights.n_positions < taskset.L:
        raise TaskError(f"the weights have {weights.n_positions} positions; prefixes up to length {taskset.L - 1} need {taskset.L}",
                        file=source, fix="verify weights built for this task set")
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
    # Progress needs only an estimate (an upper bound: subjects counted once per task through
    # each node); the report's count is the exact number of queries processed.
    sizes = [t.n_facts for t in taskset.tasks]
    total = sum(1 if not n.has_subject else sum(sizes[k] for k in n.tasks) for n in trie)
    report = Report(epsilon, dict(weights.parameters), records, 0)
    report.routing_matrix = np.zeros((K_tasks, K_exp), np.int64)
    prep = Prepared(weights)
    state = _State(taskset, trie, report, expert_task_index, epsilon)
    chunk = max(1_000, min(CHUNK, 20_000_000 // max(K_exp, 1)))
    done = 0

    def work(batch):
        return run_batch(prep, tmap[batch.tokens], batch.valid_ptr, tmap[batch.valid],
                         ablate=batch.object_query & (batch.determined >= 0)).compact()

    for batch, res in ordered_map(work, batches(taskset, trie, chunk), jobs):
        state.record(batch, res, weights)
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
    if model is not None:
        report.closed_form = str(model.error_bound())
        report.closed_form_value = model.bound_value()
        report.gate = model.gate.method
        for r in records:
            r.closed_form_bound = report.closed_form_value
        if isolation:
            _isolation(taskset, model, records, report, jobs)
    report.seconds = time.perf_counter() - start
    return report


class _State:
    """Accumulates per-task results over batches, vectorised; describes failures at the end."""

    def __init__(self, taskset, trie, report: Report, expert_task_index: np.ndarray, epsilon: float) -> None:
        self.taskset, self.trie, self.report = taskset, trie, report
        self.serves = expert_task_index
        self.epsilon = epsilon
        K = len(taskset.tasks)
        self.worst = np.full(K, -1.0)
        self.worst_ref: list[tuple[int, int] | None] = [None] * K
        self.pending: list[tuple[str, int, int, dict]] = []  # (check, node, index, numbers)
        self._groups: dict[int, object] = {}

    def record(self, b, res, weights) -> None:
        n, K = len(b), len(self.taskset.tasks)
        rep, eps = self.report, self.epsilon
        rows = np.arange(n)
        e = res.expert
        served = self.serves[e]
        counts = np.diff(b.allowed_ptr)
        pr = np.repeat(rows, counts)
        pt = b.allowed
        allowed_keys = pr * (K + 1) + pt
        route_ok = (~res.ambiguous) & (served >= 0) & np.isin(rows * (K + 1) + served, allowed_keys)
        err_bad = ~(res.err_hi < eps)
        det = b.determined
        has = det >= 0
        np.add.at(rep.routing_matrix, (det[has], e[has]), 1)
        rep.foreign += int(np.count_nonzero(has & (served != det) & (served >= 0)))
        q = np.bincount(pt, minlength=K)
        bad_r = np.bincount(pt[~route_ok[pr]], minlength=K)
        bad_e = np.bincount(pt[err_bad[pr]], minlength=K)
        # worst error per task, with the row that attains it
        order = np.lexsort((-res.err_hi[pr], pt))
        first = np.ones(order.size, bool)
        first[1:] = pt[order][1:] != pt[order][:-1]
        top_rows, top_tasks = pr[order][first], pt[order][first]
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
                self.worst_ref[k] = (int(b.node[i]), int(b.index[i]))
        room = MAX_COUNTEREXAMPLES - len(self.pending)
        names = self.taskset.names
        for i in np.flatnonzero(~route_ok)[:max(room, 0)]:
            k = int(e[i])
            self.pending.append(("routing", int(b.node[i]), int(b.index[i]), {
                "routed_expert": k, "routed_task": names[served[i]] if served[i] >= 0 else None,
                "margin": float(res.margin[i]), "gate_scores": _top_gate(res, i, weights)}))
        room = MAX_COUNTEREXAMPLES - len(self.pending)
        for i in np.flatnonzero(err_bad)[:max(room, 0)]:
            pred = res.predicted[i]
            self.pending.append(("error", int(b.node[i]), int(b.index[i]), {
                "routed_expert": int(e[i]), "error_lower": float(res.err_lo[i]), "error_upper": float(res.err_hi[i]),
                "epsilon": eps, "predicted": weights.vocab[pred] if pred >= 0 else "(a zero-logit token)"}))
        room = MAX_COUNTEREXAMPLES - len(self.pending)
        for i in np.flatnonzero(oq & ~(res.ablated_lo >= eps))[:max(room, 0)]:
            self.pending.append(("entanglement", int(b.node[i]), int(b.index[i]), {
                "routed_expert": int(e[i]), "ablated_error_lower": float(res.ablated_lo[i]), "epsilon": eps,
                "why": "with its expert's output removed the model still answers this object query: "
                       "the knowledge is not (only) in that expert"}))

    def group(self, node: int):
        if node not in self._groups:
            self._groups[node] = build_group(self.taskset, self.trie, self.trie.nodes[node])
        return self._groups[node]

    def finish(self) -> None:
        vocab = self.taskset.vocabulary
        for k, ref in enumerate(self.worst_ref):
            if ref is not None:
                self.report.tasks[k].worst_query = " ".join(self.group(ref[0]).prefix_tokens(ref[1], vocab))
        for check, node, i, numbers in self.pending:
            self.report.counterexamples.append({"check": check, **_describe(self.taskset, self.group(node), i), **numbers})


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
            for k, a, b in zip(ids[i], lo[i], hi[i])]


def leave_one_out_tasks(K: int, n_facts: int) -> list[int]:
    """Which tasks the leave-one-out rebuild removes: all up to 12 tasks, else 12 spread
    evenly (4 beyond 200k facts, where each rebuild costs a full construction)."""
    count = 12 if n_facts <= 200_000 else 4
    return list(range(K)) if K <= count else sorted(set(np.linspace(0, K - 1, count).astype(int).tolist()))


def _isolation(taskset: TaskSet, model, records: list[TaskRecord], report: Report, jobs: int = 1) -> None:
    """Expert k built from task k alone, and from the set without task j, is unchanged."""
    from construction.experts import build_expert, column_map, same_expert
    from construction.residual import residual_space

    for k, task in enumerate(taskset.tasks):
        alone = TaskSet((task,))
        records[k].isolated = same_expert(build_expert(alone, 0, residual_space(alone)), model.experts[k])
    K = len(taskset.tasks)
    if K < 2:
        return
    chosen = leave_one_out_tasks(K, taskset.n_facts)

    def changed(j: int) -> list[str]:
        rest = taskset.without(taskset.tasks[j].name)
        space = residual_space(rest)
        to_full = column_map(space, model.residual)
        return [task.name for k_new, task in enumerate(rest.tasks)
                if not same_expert(build_expert(rest, k_new, space), model.experts[taskset.index(task.name)], to_full)]

    for j, names in ordered_map(changed, chosen, jobs):
        for name in names:
            records[taskset.index(name)].isolated = False
            report.notes.append(f"expert '{name}' changes when task '{taskset.tasks[j].name}' is removed")
    report.notes.append(f"leave-one-out rebuilds checked for {len(chosen)} of {K} tasks")


def stderr_progress(quiet: bool) -> Callable[[int, int], None] | None:
    if quiet or not sys.stderr.isatty():
        return None
    state = {"last": 0.0}

    def show(done: int, total: int) -> None:
        """``total < 0`` marks the end: the line is completed."""
        if total < 0:
            if state["last"]:
                sys.stderr.write(f"\rverified: {done:,} queries{' ' * 20}\n")
                sys.stderr.flush()
            return
        now = time.perf_counter()
        if now - state["last"] > 0.5:
            state["last"] = now
            sys.stderr.write(f"\rverifying: {done:,} queries (about {min(100, 100 * done / max(total, 1)):.0f}%)   ")
            sys.stderr.flush()

    return show
