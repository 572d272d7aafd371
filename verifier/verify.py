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
from tasks.queries import QueryGroup, query_groups
from tasks.structure import OBJ, SUBJ, StructureTrie
from verifier.forward import run_batch
from verifier.layout import Weights

CHUNK = 50_000
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


def _positions(group: QueryGroup, idx: slice, tmap: np.ndarray, bos: int) -> list:
    out: list = [bos]
    for c in group.node.symbols:
        if c == SUBJ:
            out.append(tmap[group.subjects[idx]])
        elif c == OBJ:
            out.append(tmap[group.objects[idx]])
        else:
            out.append(int(tmap[c]))
    return out


def _slice_csr(ptr: np.ndarray, vals: np.ndarray, lo: int, hi: int, tmap: np.ndarray | None = None):
    p = ptr[lo: hi + 1] - ptr[lo]
    v = vals[ptr[lo]: ptr[hi]]
    return p, (tmap[v] if tmap is not None else v)


def verify(
    taskset: TaskSet,
    weights: Weights,
    epsilon: float,
    *,
    model=None,
    source: str = "weights",
    progress: Callable[[int, int], None] | None = None,
    isolation: bool = True,
) -> Report:
    """Run every check; ``model`` is the SymbolicModel if the weights were built here."""
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
    total = sum(len(g) for g in query_groups(taskset, trie))
    report = Report(epsilon, dict(weights.parameters), records, total)
    report.routing_matrix = np.zeros((K_tasks, K_exp), np.int64)
    done = 0
    for group in query_groups(taskset, trie):
        for lo in range(0, len(group), CHUNK):
            hi = min(lo + CHUNK, len(group))
            _check_chunk(taskset, weights, group, lo, hi, tmap, expert_task_index, epsilon, report)
            done += hi - lo
            if progress:
                progress(done, total)
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
            _isolation(taskset, model, records, report)
    report.seconds = time.perf_counter() - start
    return report


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


def _add_counterexample(report: Report, kind: str, base: dict[str, Any], **numbers) -> None:
    if len(report.counterexamples) < MAX_COUNTEREXAMPLES:
        report.counterexamples.append({"check": kind, **base, **numbers})


def _check_chunk(taskset, weights, group, lo, hi, tmap, expert_task_index, epsilon, report) -> None:
    n = hi - lo
    vptr, vals = _slice_csr(group.valid_ptr, group.valid, lo, hi, tmap)
    res = run_batch(weights, _positions(group, slice(lo, hi), tmap, weights.bos), n, vptr, vals)
    names = taskset.names
    cand = res.candidates.tocsr()
    for i in range(n):
        q = lo + i
        allowed = group.allowed_of(q)
        served = expert_task_index[cand.indices[cand.indptr[i]:cand.indptr[i + 1]]]
        ok_route = res.margin[i] > 0 and np.all(np.isin(served, allowed))
        det = int(group.determined[q])
        e = int(res.expert[i])
        if det >= 0:
            report.routing_matrix[det, e] += 1
            if expert_task_index[e] != det:
                report.foreign += int(expert_task_index[e] >= 0)
        for k in allowed:
            rec = report.tasks[k]
            rec.queries += 1
            if res.err_hi[i] > rec.worst_error:
                rec.worst_error, rec.worst_error_lower = float(res.err_hi[i]), float(res.err_lo[i])
                rec.worst_query = " ".join(group.prefix_tokens(q, taskset.vocabulary))
            if not ok_route:
                rec.misrouted += 1
            elif det == k:
                rec.min_margin = min(rec.min_margin, float(res.margin[i]))
            if not res.err_hi[i] < epsilon:
                rec.over_epsilon += 1
        if not ok_route:
            _add_counterexample(report, "routing", _describe(taskset, group, q), routed_expert=e,
                                routed_task=names[expert_task_index[e]] if expert_task_index[e] >= 0 else None,
                                margin=float(res.margin[i]), gate_scores=_top_gate(res, i, weights))
        if not res.err_hi[i] < epsilon:
            _add_counterexample(report, "error", _describe(taskset, group, q), routed_expert=e,
                                error_lower=float(res.err_lo[i]), error_upper=float(res.err_hi[i]), epsilon=epsilon,
                                predicted=weights.vocab[res.predicted[i]] if res.predicted[i] >= 0 else "(a zero-logit token)")
        if group.object_query[q] and det >= 0:
            rec = report.tasks[det]
            rec.object_queries += 1
            if res.ablated_lo[i] >= epsilon:
                rec.ablation_broken += 1
            else:
                _add_counterexample(report, "entanglement", _describe(taskset, group, q), routed_expert=e,
                                    ablated_error_lower=float(res.ablated_lo[i]), epsilon=epsilon,
                                    why="with its expert's output removed the model still answers this object query: "
                                        "the knowledge is not (only) in that expert")


def _top_gate(res, i: int, weights: Weights, top: int = 3) -> list[dict[str, Any]]:
    order = np.argsort(-res.gate_hi[i])[:top]
    return [{"expert": int(k), "task": weights.expert_tasks[k] or None, "lower": float(res.gate_lo[i, k]),
             "upper": float(res.gate_hi[i, k])} for k in order]


def _isolation(taskset: TaskSet, model, records: list[TaskRecord], report: Report) -> None:
    """Expert k built from task k alone, and from the set without task j, is unchanged."""
    from construction.experts import build_expert, labelled_entries
    from construction.residual import residual_space

    full = [labelled_entries(e) for e in model.experts]
    for k, task in enumerate(taskset.tasks):
        alone = TaskSet((task,))
        records[k].isolated = labelled_entries(build_expert(alone, 0, residual_space(alone))) == full[k]
    K = len(taskset.tasks)
    if K < 2:
        return
    chosen = range(K) if K <= 12 else sorted(set(np.linspace(0, K - 1, 12).astype(int).tolist()))
    for j in chosen:
        rest = taskset.without(taskset.tasks[j].name)
        res_space = residual_space(rest)
        for k_new, task in enumerate(rest.tasks):
            k_old = taskset.index(task.name)
            if labelled_entries(build_expert(rest, k_new, res_space)) != full[k_old]:
                records[k_old].isolated = False
                report.notes.append(f"expert '{task.name}' changes when task '{taskset.tasks[j].name}' is removed")
    report.notes.append(f"leave-one-out rebuilds checked for {len(chosen)} of {K} tasks")


def stderr_progress(quiet: bool) -> Callable[[int, int], None] | None:
    if quiet or not sys.stderr.isatty():
        return None
    state = {"last": 0.0}

    def show(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - state["last"] > 0.5 or done == total:
            state["last"] = now
            sys.stderr.write(f"\rverifying: {done}/{total} queries ({100 * done / max(total, 1):.0f}%)")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    return show
