"""The checks, one entry each: what is decided per query or per task, counted, reported and named.

A **per-query check** (:class:`QueryCheck`) is decided for every row of a batch by its
``holds`` function, all of them at once by :func:`decide`, the one decision that the full
pass's tally (:func:`verifier.checks.verify.tally`), the query classes a certificate keeps
(:class:`verifier.checks.classes.ClassRecorder`) and a re-certification's reruns all use. Per
task it is counted (:attr:`QueryCheck.count`): over every query, for each task consistent
with it, or over the object queries, for the task they determine; the task holds it when no
query fails it (and its further per-task condition, :attr:`QueryCheck.also`, holds). A check
with parts (entanglement: ablation, L1, L2) holds where all of its parts hold; each part is
counted and shown too. A **per-task check** (:class:`TaskCheck`: size) is decided from a
task's record. A report is certified when every task holds every check, no determined query
reaches another task's expert and every enumerated query has its result
(:attr:`verifier.checks.verify.Report.certified`).

The per-task records (:class:`verifier.checks.verify.TaskRecord`), the query classes' count
columns, the re-certification's reuse of classes, the report's columns, JSON keys and
shares (:mod:`verifier.checks.report`), the refusal's list of failing checks
(:func:`failing`) and the training sweep's failure counts all iterate this catalogue, so a
new per-query check is an entry here (and the function computing its number, here or
beside the others it reads, :mod:`verifier.checks.localization`), registered in
:data:`CHECKS` and :data:`PER_QUERY`.

Two orders, as the report has always shown them: :data:`CHECKS` is the order of the
verdicts (error, routing, size, entanglement: the JSON's ``checks`` and ``graded``, the
failing checks), :data:`PER_QUERY` the order a batch records them in (routing, error,
entanglement: the per-task counts in a task's JSON, the counterexamples of each kind).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Sequence

import numpy as np

from verifier.checks.localization import localization, object_lows, p_upper, row_gaps


# --- the decision of a batch's rows ------------------------------------------------------


class Rows:
    """A batch's rows with its results, as the checks read them: the routed expert and the task
    it serves, the determined task, the object queries, and (computed once, when a check
    asks) the localization check's decisions."""

    def __init__(self, rules, batch, result) -> None:
        self.rules, self.batch, self.result = rules, batch, result
        self.n = len(batch)
        self.expert = np.asarray(result.expert, np.int64)
        self.served = np.asarray(rules.serves)[self.expert]
        self.determined = batch.determined
        self.object_query = batch.object_query & (batch.determined >= 0)

    @cached_property
    def localized(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ablation, L1, L2, all three) per row (:func:`verifier.checks.localization.localization`)."""
        r = self.rules
        return localization(self.result, self.determined, self.object_query, r.epsilon, r.l1_thr, r.exact_vocab)

    @cached_property
    def object_lows(self) -> np.ndarray:
        """Per row, a lower end of 1 − P_ablated(o) (:func:`verifier.checks.localization.object_lows`)."""
        return object_lows(self.result, self.n)

    @cached_property
    def gaps(self) -> np.ndarray:
        """Per row, the L2 gap (:func:`verifier.checks.localization.row_gaps`)."""
        return row_gaps(self.result, self.n)


@dataclass(frozen=True)
class RowDecisions:
    """Every check's decision for each row of a batch (:func:`decide`)."""

    rows: Rows
    holds: dict[str, np.ndarray]     # per check and part, by name: where it holds (object checks: False elsewhere)
    foreign: np.ndarray              # determined queries routed to an expert serving another task

    def counted(self, check: "QueryCheck") -> np.ndarray:
        """The rows the check's per-task count counts: those failing it, or those holding it."""
        return self.failing(check) if check.failures else self.holds[check.name]

    def failing(self, check: "QueryCheck") -> np.ndarray:
        """The rows that fail the check (for an object check, its object queries that fail it)."""
        bad = ~self.holds[check.name]
        return bad & self.rows.object_query if check.objects else bad


def decide(rules, batch, result) -> RowDecisions:
    """Per row of ``batch`` (results ``result``), whether each check of ``rules.checks`` and
    each of its parts holds, and which determined queries reach another task's expert.

    ``rules`` holds what the decisions need, all of it small: ``serves`` (per expert, the task
    index it serves, -1 none), ``epsilon``, ``l1_thr`` (per task, L1's threshold),
    ``exact_vocab`` (the weights' vocabulary size in the exact pass, for L1's exact argument;
    None in a deployed one) and ``checks`` (the per-query checks, :data:`PER_QUERY`)."""
    rows = Rows(rules, batch, result)
    holds: dict[str, np.ndarray] = {}
    for check in rules.checks:
        for part in check.parts:
            holds[part.name] = part.holds(rows)
        holds[check.name] = check.holds(rows) if check.holds is not None else \
            np.logical_and.reduce([holds[p.name] for p in check.parts])
    det = rows.determined
    foreign = (det >= 0) & (rows.served != det) & (rows.served >= 0)
    return RowDecisions(rows, holds, foreign)


@dataclass(frozen=True)
class Rules:
    """What :func:`decide` needs (the query classes' recorder; the full pass's tally carries
    the same fields in :class:`verifier.checks.verify.TallyRules`)."""

    serves: np.ndarray
    epsilon: float
    l1_thr: np.ndarray
    exact_vocab: int | None
    checks: tuple["QueryCheck", ...] = field(default_factory=lambda: PER_QUERY)


# --- the entries ---------------------------------------------------------------------------


@dataclass(frozen=True)
class QueryCheck:
    """A check decided for every query (see the module docstring)."""

    name: str                    # its key in a task's JSON ("checks", "graded"), a counterexample's "check"
    label: str                   # its name in the text report ("L1")
    holds: Callable[[Rows], np.ndarray] | None   # per row, where it holds (None: where all its parts hold)
    count: str                   # the per-task count: TaskRecord.counts key and the task JSON's key
    column: str                  # the query classes' count column (verifier.checks.classes)
    failures: bool               # the count is of the queries failing it (else of those holding it)
    # decided on object queries, counted for their task (else every query, for each consistent task)
    objects: bool = False
    json: str = "task"           # where its count sits in a task's JSON: "task", or its "localization" block
    graded: bool = True          # its share of a task's queries is reported ("graded", the shares table)
    parts: tuple["QueryCheck", ...] = ()
    also: Callable[[Any], bool] | None = None    # a further condition on the task's record
    table: bool = False          # a column of the summary table ("ok", or how many queries fail)
    describe: Callable[[RowDecisions, int], dict] | None = None   # a failing row's numbers (its counterexample)
    explain: Callable[[dict], str] | None = None                  # a counterexample's second line
    token_keys: tuple[str, ...] = ()   # numbers of the counterexample that are token ids of the weights (named later)
    reused: bool = False         # check --since decides it for the classes it reuses (else an edit gets a full check)

    def total(self, record) -> int:
        """The task's queries the check is decided on."""
        return record.object_queries if self.objects else record.queries

    def task_holds(self, record) -> bool:
        n = record.counts[self.count]
        ok = n == 0 if self.failures else n == self.total(record)
        return ok and all(p.task_holds(record) for p in self.parts) and (self.also is None or self.also(record))

    def share(self, record) -> float | None:
        """The share of the task's queries that hold it (None: none to decide)."""
        total = self.total(record)
        good = total - record.counts[self.count] if self.failures else record.counts[self.count]
        return (good / total) if total else None


@dataclass(frozen=True)
class TaskCheck:
    """A check decided per task, from its record."""

    name: str
    label: str
    task_holds: Callable[[Any], bool]

    def share(self, record) -> bool:
        return self.task_holds(record)


# number formatting for the failure lines (the text report uses the same)

def number(x: Any) -> str:
    """A number for a reader: 4 significant digits, inf/nan spelled out."""
    if x is None:
        return "-"
    x = float(x)
    return "inf" if x == math.inf else "-inf" if x == -math.inf else "nan" if math.isnan(x) else f"{x:.4g}"


def printable(value: Any) -> str:
    """``str(value)`` with every unprintable character escaped: text from a weights file
    (its ``parameters``) can never start a line of its own in the report."""
    text = str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _expert(c: dict) -> str:
    task = c.get("routed_task")
    return f"expert {c['routed_expert']}" + (f" ({task})" if task else "")


def _routed(d: RowDecisions, i: int) -> dict[str, Any]:
    served = d.rows.served
    return {"routed_expert": int(d.rows.expert[i]),
            "routed_task": d.rows.rules.task_names[served[i]] if served[i] >= 0 else None}


# routing: a certified unique winner serving a task consistent with the prefix

def _routing_holds(rows: Rows) -> np.ndarray:
    b, res = rows.batch, rows.result
    counts = np.diff(b.allowed_ptr)
    pr = np.repeat(np.arange(rows.n), counts)
    member = np.zeros(rows.n, bool)                   # the routed expert serves a consistent task
    member[pr[np.repeat(rows.served, counts) == b.allowed]] = True
    return (~res.ambiguous) & (rows.served >= 0) & member


def _has_expert(record) -> bool:
    return record.expert is not None


def _routing_numbers(d: RowDecisions, i: int) -> dict[str, Any]:
    res = d.rows.result
    ids, lo, hi = res.top_gate
    tasks = d.rows.rules.expert_tasks
    scores = [{"expert": int(k), "task": tasks[k] or None, "lower": float(a), "upper": float(b)}
              for k, a, b in zip(ids[i], lo[i], hi[i]) if k >= 0]
    return {**_routed(d, i), "margin": float(res.margin[i]), "gate_scores": scores}


def _routing_line(c: dict) -> str:
    scores = ", ".join(f"expert {s['expert']}{' (' + str(s['task']) + ')' if s.get('task') else ''} "
                       f"[{number(s['lower'])}, {number(s['upper'])}]" for s in c.get("gate_scores", []))
    return (f"routed to {_expert(c)}, serving {'no task' if not c.get('routed_task') else repr(c['routed_task'])}; "
            f"certified margin {number(c['margin'])} (must be > 0 and the task consistent: "
            f"{', '.join(c.get('consistent_tasks', []))}); gate scores {scores}")


# error: the error enclosure's upper end below ε

def _error_holds(rows: Rows) -> np.ndarray:
    return rows.result.err_hi < rows.rules.epsilon


def _error_numbers(d: RowDecisions, i: int) -> dict[str, Any]:
    res = d.rows.result
    return {**_routed(d, i), "error_lower": float(res.err_lo[i]), "error_upper": float(res.err_hi[i]),
            "epsilon": d.rows.rules.epsilon, "predicted": int(res.predicted[i])}


def _error_line(c: dict) -> str:
    return (f"routed to {_expert(c)}; error 1 - P(valid) in [{number(c['error_lower'])}, {number(c['error_upper'])}], "
            f"not below epsilon {number(c['epsilon'])}; the top token is '{printable(c['predicted'])}'")


# entanglement: without its expert, the model cannot answer an object query
# (verifier.checks.localization: (b) the ablated error >= ε, L1, L2)

def _ablation_holds(rows: Rows) -> np.ndarray:
    return rows.localized[0]


def _l1_holds(rows: Rows) -> np.ndarray:
    return rows.localized[1]


def _l2_holds(rows: Rows) -> np.ndarray:
    return rows.localized[2]


def _isolated(record) -> bool:
    return record.isolated is not False


def _entanglement_numbers(d: RowDecisions, i: int) -> dict[str, Any]:
    rows, res = d.rows, d.rows.result
    k = int(rows.determined[i])
    m = int(rows.rules.n_objects[k])
    failed = [p.label for p in (ABLATION, L1, L2) if not d.holds[p.name][i]]
    return {**_routed(d, i), "ablated_error_lower": float(res.ablated_lo[i]), "epsilon": rows.rules.epsilon,
            "p_ablated_upper": p_upper(rows.object_lows[i]), "objects": m,
            "uniform_bound": 1.0 / m if m else None, "l2_gap": float(rows.gaps[i]), "failed": failed,
            "why": "with its expert's output removed the model still answers this object query: "
                   "the knowledge is not (only) in that expert"}


def _entanglement_line(c: dict) -> str:
    failed = c.get("failed") or ["ablation"]
    parts = []
    if "L1" in failed:
        parts.append(f"P(object) may be up to {number(c.get('p_ablated_upper'))} > 1/|O_k| = "
                     f"{number(c.get('uniform_bound'))} (L1: no better than a uniform guess among the task's "
                     f"{c.get('objects')} objects)")
    if "L2" in failed:
        parts.append("the object may be the strict top token (L2: certified gap "
                     f"{number(c.get('l2_gap'))}, must be >= 0)")
    if "ablation" in failed:
        parts.append(f"the error's lower end is {number(c['ablated_error_lower'])} < epsilon {number(c['epsilon'])}")
    return (f"with {_expert(c)}'s output removed, {'; '.join(parts)}: the model still answers, "
            f"the knowledge is not (only) in that expert")


def _size_holds(record) -> bool:
    return record.width is not None and record.width <= record.bound


ROUTING = QueryCheck("routing", "routing", _routing_holds, "misrouted", "route_bad", failures=True, also=_has_expert,
                     table=True, describe=_routing_numbers, explain=_routing_line, reused=True)
ERROR = QueryCheck("error", "error", _error_holds, "over_epsilon", "err_bad", failures=True,
                   describe=_error_numbers, explain=_error_line, token_keys=("predicted",), reused=True)
#: the parts of entanglement, in the order the localization block of a task's JSON shows them
L1 = QueryCheck("l1", "L1", _l1_holds, "l1_held", "l1", failures=False, objects=True, json="localization", reused=True)
L2 = QueryCheck("l2", "L2", _l2_holds, "l2_held", "l2", failures=False, objects=True, json="localization", reused=True)
ABLATION = QueryCheck("ablation", "ablation", _ablation_holds, "ablation_broken", "broken", failures=False,
                      objects=True, graded=False, reused=True)
ENTANGLEMENT = QueryCheck("entanglement", "entanglement", None, "localized", "localized", failures=False, objects=True,
                          json="localization", parts=(L1, L2, ABLATION), also=_isolated,
                          describe=_entanglement_numbers, explain=_entanglement_line, reused=True)
SIZE = TaskCheck("size", "size", _size_holds)

#: every check, in the order of the verdicts
CHECKS: tuple[QueryCheck | TaskCheck, ...] = (ERROR, ROUTING, SIZE, ENTANGLEMENT)
#: the per-query checks, in the order a batch records them
PER_QUERY: tuple[QueryCheck, ...] = (ROUTING, ERROR, ENTANGLEMENT)


# --- what the rest iterates ----------------------------------------------------------------


def counted(checks: Sequence[QueryCheck] | None = None) -> list[QueryCheck]:
    """Every per-query check and part with a per-task count, in recording order (each
    check's parts before it)."""
    return [c for check in (PER_QUERY if checks is None else checks) for c in (*check.parts, check)]


def zero_counts() -> dict[str, int]:
    """A task's counts before any query is recorded."""
    return {c.count: 0 for c in counted()}


def graded() -> list[QueryCheck | TaskCheck]:
    """What a task's shares show, in order: each per-query check (then its graded parts),
    then the per-task checks."""
    out: list[QueryCheck | TaskCheck] = []
    for c in CHECKS:
        if isinstance(c, QueryCheck):
            out += [x for x in (c, *c.parts) if x.graded]
    return out + [c for c in CHECKS if isinstance(c, TaskCheck)]


def find(name: str) -> QueryCheck | None:
    """The per-query check (or part) of that name."""
    return next((c for c in counted() if c.name == name), None)


def failing(report) -> str:
    """Which checks failed and on how many queries (a check over every query: each query
    counted once, :attr:`verifier.checks.verify.Report.failing`) or tasks (the others)."""
    parts = []
    for c in CHECKS:
        if isinstance(c, QueryCheck) and not c.objects:
            n = report.failing.get(c.name, 0)
            parts += [f"{c.name} on {n:,} queries"] if n else []
        else:
            n = sum(not c.task_holds(t) for t in report.tasks)
            parts += [f"{c.name} of {n} tasks"] if n else []
    return ", ".join(parts) or "none"
