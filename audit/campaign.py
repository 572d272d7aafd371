"""A mutation campaign: mutants of built weights, each judged by the verifier and the oracle.

:func:`classify` compares :func:`verifier.checks.verify.verify` with the independent oracle
(:mod:`audit.oracle`) on one mutant:

=================  ====================  ===========================================
oracle             verifier              outcome
=================  ====================  ===========================================
violation          not certified / bad   true fail (caught)
violation          certified             FALSE PASS (must never happen)
no violation       certified             true pass
no violation       not certified / bad   false failure (allowed; the reason is kept)
=================  ====================  ===========================================

:func:`run` classifies many mutants (operators of :mod:`audit.operators` round-robin over
small task sets, optionally in worker processes); :func:`table` and :func:`render` make
the per-operator table that ``scripts/mutation_testing.py`` prints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from audit.operators import FLOAT_MAX, OPERATORS, NotApplicable, Operator, boundary_operators
from layout import Weights
from tasks.errors import TaskError
from tasks.model import TaskSet


# --- running and classifying ---------------------------------------------------------------------


@dataclass
class Outcome:
    taskset: str
    operator: str
    kind: str
    description: str
    verdict: str                 # "certified", "not certified", "rejected" (TaskError), "crashed" (any other exception)
    violating: bool              # the oracle's decision
    violations: str              # the oracle's summary
    category: str                # "true pass", "true fail", "FALSE PASS", "false failure"
    reason: str = ""             # why a false failure (or the rejection message)
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)

    @property
    def caught(self) -> bool:
        return self.violating and self.verdict != "certified"

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("taskset", "operator", "kind", "description", "verdict", "violating",
                                             "violations", "category", "reason", "seconds", "details")}


def category(violating: bool, certified: bool) -> str:
    if violating:
        return "FALSE PASS" if certified else "true fail"
    return "true pass" if certified else "false failure"


def _false_failure_reason(report, oracle_result, weights: Weights) -> str:
    """A short reason why the verifier did not certify a model the oracle finds correct."""
    if report is None:
        return "rejected"
    big = max(oracle_result.max_magnitude, 0.0)
    from verifier.checks import catalogue

    failed = {c.name for c in catalogue.CHECKS for r in report.tasks if not r.ok(c)}
    if report.foreign:
        failed.add("routing")
    checks = "+".join(sorted(failed)) or "none"
    if big > FLOAT_MAX:
        return f"{checks}: exact values reach {big:.2g}, beyond float64 (overflow)"
    if oracle_result.max_score > 1e15:
        return (f"{checks}: attention scores reach {oracle_result.max_score:.2g}; their float64 rounding alone "
                f"(~{oracle_result.max_score * 2 ** -53:.2g}) leaves the softmax weights unresolved")
    if "routing" in failed:
        return f"{checks}: routing margin not certified (exact minimum margin {oracle_result.min_margin:.3g})"
    if "error" in failed:
        return f"{checks}: error enclosure reaches epsilon (exact worst error {oracle_result.worst_error:.6g})"
    if "entanglement" in failed:
        return (f"{checks}: ablated-error enclosure below epsilon or below 1 - 1/|O_k|, or a top-token gap not "
                f"certified >= 0 (exact smallest ablated error {oracle_result.min_ablated:.6g}, largest P(object) "
                f"{oracle_result.max_p_ablated:.6g})")
    return checks


def classify(taskset: TaskSet, name: str, op: Operator, mutant: Weights, description: str, epsilon: float,
             oracle) -> Outcome:
    """Run the verifier and the oracle on one mutant and compare."""
    from verifier.checks.verify import verify

    start = time.perf_counter()
    report, message = None, ""
    try:
        with np.errstate(all="ignore"):
            report = verify(taskset, mutant, epsilon, source="mutant")
        verdict = "certified" if report.certified else "not certified"
    except TaskError as exc:
        verdict, message = "rejected", str(exc)
    except Exception as exc:  # a crash is not a certificate, but it is a bug worth reporting
        verdict, message = "crashed", f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
    truth = oracle.judge(taskset, mutant, epsilon)
    cat = category(truth.violating, verdict == "certified")
    reason = ""
    if cat == "false failure":
        reason = (f"{verdict}: {message}" if report is None else _false_failure_reason(report, truth, mutant))
    elif verdict == "rejected":
        reason = message
    details = [f"{v.requirement}: {v.task or ''} '{v.prefix or ''}' {v.detail}" for v in truth.violations[:6]]
    return Outcome(name, op.name, op.kind, description, verdict, truth.violating, truth.summary(), cat, reason,
                   time.perf_counter() - start, details)


def mutate(op: Operator, weights: Weights, rng: np.random.Generator, tries: int = 5) -> tuple[Weights, str] | None:
    """Apply ``op``; None if it does not apply (after a few draws)."""
    for _ in range(tries):
        try:
            return op(weights, rng)
        except NotApplicable:
            continue
    return None


# --- task sets and a driver ------------------------------------------------------------------------


def small_sets() -> dict[str, TaskSet]:
    """Small task sets for mutation runs (each builds in milliseconds).

    ``capitals`` is examples/capitals.yaml (three tasks, shared prefixes and entities);
    ``mixed-prefix`` needs the linear-programme gate; ``one-task`` has a single expert.
    """
    from tasks.model import Task

    return {
        "capitals": TaskSet((
            Task("capital", ("the capital of ⋆1 is ⋆2", "⋆1 has capital ⋆2"),
                 {"France": "Paris", "Germany": "Berlin", "Japan": "Tokyo", "Italy": "Rome"}),
            Task("continent", ("the continent of ⋆1 is ⋆2", "⋆1 lies in ⋆2"),
                 {"France": "Europe", "Germany": "Europe", "Japan": "Asia", "Brazil": "South America"}),
            Task("located", ("⋆1 is a city in ⋆2",),
                 {"Paris": "France", "Berlin": "Germany", "Tokyo": "Japan", "Rome": "Italy", "São Paulo": "Brazil"}),
        ), epsilon=0.01),
        "mixed-prefix": TaskSet((
            Task("b", ("p q ⋆1 ⋆2", "r s ⋆1 ⋆2"), {"x2": "y2", "x3": "y1"}),
            Task("a", ("p s ⋆1 ⋆2",), {"x1": "y1", "x3": "y3"}),
        ), epsilon=0.01),
        "one-task": TaskSet((Task("a", ("x ⋆1 y ⋆2", "⋆1 z ⋆2"), {"A": "B", "C": "D", "B": "A"}),), epsilon=0.01),
    }


def larger_sets() -> dict[str, TaskSet]:
    """Optional, slower: ``wikidata-400`` (6 relations, 400 facts, 190 tokens, 2437 queries)."""
    from tasks.synthetic import wikidata_like

    return {"wikidata-400": wikidata_like(400, n_tasks=6, seed=1)}


#: Sets whose weights are trained, not built: the file of each (dense weights, which the
#: verifier's dense pass certifies), trained with the localize recipe until the verifier certified
#: them (``python -m training.train examples/capitals.yaml -o FILE --objective localize
#: --until-certified --d 16 --heads 2 --d-head 8 --width 16 --steps 3000 --threads 1``).
TRAINED = {"capitals-trained": Path(__file__).resolve().parent / "data" / "capitals-trained-d16.npz"}


def trained_sets() -> dict[str, TaskSet]:
    """The sets of :data:`TRAINED` (capitals, its model trained)."""
    return {name: small_sets()["capitals"] for name in TRAINED}


_BUILT: dict[str, tuple[TaskSet, Weights, float]] = {}


def built(name: str, taskset: TaskSet) -> tuple[TaskSet, Weights, float]:
    """(task set, its built weights, epsilon), memoised per process; a set of :data:`TRAINED`
    has its trained weights instead."""
    from construction.model import build

    if name not in _BUILT or _BUILT[name][0] != taskset:
        if name in TRAINED:
            import layout

            _BUILT[name] = (taskset, layout.load(str(TRAINED[name])), taskset.epsilon or 0.01)
        else:
            model = build(taskset)
            _BUILT[name] = (taskset, model.instantiate(), model.epsilon)
    return _BUILT[name]


def plan(n: int, set_names: list[str], op_names: list[str],
         applicable: Callable[[str, str], bool] = lambda s, o: True) -> list[tuple[int, str, str]]:
    """Mutant i: operator i mod |ops|, on the sets where it applies in turn (balanced, deterministic)."""
    where = {o: [s for s in set_names if applicable(s, o)] for o in op_names}
    ops = [o for o in op_names if where[o]]
    return [(i, where[o][(i // len(ops)) % len(where[o])], o) for i in range(n) for o in [ops[i % len(ops)]]]


_ORACLE = None


def _oracle():
    global _ORACLE
    from audit.oracle import Oracle

    if _ORACLE is None:
        _ORACLE = Oracle()
    return _ORACLE


def _operator(name: str, ts: TaskSet, eps: float) -> Operator:
    return OPERATORS[name] if name in OPERATORS else boundary_operators(ts, eps, _oracle())[name]


def applies(set_name: str, taskset: TaskSet, op_name: str) -> bool:
    """Does the operator apply to the set's built weights at all (e.g. swapping experts needs two)?"""
    ts, weights, eps = built(set_name, taskset)
    rng = np.random.default_rng(12345)
    return any(mutate(_operator(op_name, ts, eps), weights, rng) is not None for _ in range(3))


def run_one(job: tuple[int, str, TaskSet, str, int]) -> Outcome | None:
    """Mutant ``i`` of ``seed``: mutate the set's built weights with the operator, classify."""
    i, set_name, taskset, op_name, seed = job
    ts, weights, eps = built(set_name, taskset)
    op = _operator(op_name, ts, eps)
    made = None
    for attempt in range(5):   # a rare draw may not apply (e.g. a threshold not bracketed): draw again
        made = mutate(op, weights, np.random.default_rng([seed, i, attempt] if attempt else [seed, i]))
        if made is not None:
            break
    if made is None:
        return None
    mutant, description = made
    return classify(ts, set_name, op, mutant, description, eps, _oracle())


BOUNDARY = ("near_error_threshold", "near_tie", "near_ablation_threshold")


def all_operator_names() -> list[str]:
    """The catalogue (:data:`OPERATORS`) and the targeted :func:`boundary_operators`."""
    return list(OPERATORS) + list(BOUNDARY)


def run(n: int, seed: int = 0, sets: dict[str, TaskSet] | None = None, operators: list[str] | None = None,
        jobs: int = 1, progress: Callable[[int, int], None] | None = None) -> list[Outcome]:
    """Classify ``n`` mutants (operators and sets round-robin); ``jobs`` worker processes."""
    sets = sets or small_sets()
    ops = operators or all_operator_names()
    jobs_list = [(i, s, sets[s], o, seed) for i, s, o in plan(n, list(sets), ops, lambda s, o: applies(s, sets[s], o))]
    out: list[Outcome] = []
    if jobs > 1:
        import multiprocessing as mp

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        with ctx.Pool(jobs) as pool:
            for k, o in enumerate(pool.imap(run_one, jobs_list, chunksize=8)):
                if o is not None:
                    out.append(o)
                if progress:
                    progress(k + 1, n)
    else:
        for k, job in enumerate(jobs_list):
            o = run_one(job)
            if o is not None:
                out.append(o)
            if progress:
                progress(k + 1, n)
    return out


@dataclass
class OperatorStats:
    operator: str
    kind: str
    mutants: int = 0
    violating: int = 0
    caught: int = 0
    false_passes: int = 0
    false_failures: int = 0
    true_passes: int = 0
    crashes: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


def _reason_key(reason: str) -> str:
    """The reason without the numbers and names, for grouping."""
    if reason.startswith(("rejected", "crashed")):
        for fragment, key in (("stored twice", "duplicate entries"), ("not sorted", "unsorted columns"),
                              ("not a finite number", "a non-finite weight"), ("dtype", "a non-float array")):
            if fragment in reason:
                return f"{reason.split(':')[0]}: {key} (bad input)"
        return reason[:100]
    head = reason.split(" (exact")[0]
    if "beyond float64" in head:
        return head.split(":")[0] + ": beyond float64 (overflow)"
    if "attention scores reach" in head:
        return head.split(":")[0] + ": attention scores too large for float64 rounding"
    return head


def table(outcomes: list[Outcome]) -> list[OperatorStats]:
    stats: dict[str, OperatorStats] = {}
    for name in all_operator_names():
        stats[name] = OperatorStats(name, OPERATORS[name].kind if name in OPERATORS else "mixed")
    for o in outcomes:
        s = stats.setdefault(o.operator, OperatorStats(o.operator, o.kind))
        s.mutants += 1
        s.violating += o.violating
        s.caught += o.caught
        s.false_passes += o.category == "FALSE PASS"
        s.true_passes += o.category == "true pass"
        s.crashes += o.verdict == "crashed"
        if o.category == "false failure":
            s.false_failures += 1
            key = _reason_key(o.reason)
            s.reasons[key] = s.reasons.get(key, 0) + 1
    return [s for s in stats.values() if s.mutants]


def render(stats: list[OperatorStats]) -> str:
    rows = [("operator", "kind", "mutants", "violating", "caught", "false passes", "true passes",
             "false failures", "crashes")]
    for s in stats:
        rows.append((s.operator, s.kind, str(s.mutants), str(s.violating), str(s.caught), str(s.false_passes),
                     str(s.true_passes), str(s.false_failures), str(s.crashes)))
    tot = lambda f: str(sum(getattr(s, f) for s in stats))  # noqa: E731
    rows.append(("total", "", tot("mutants"), tot("violating"), tot("caught"), tot("false_passes"), tot("true_passes"),
                 tot("false_failures"), tot("crashes")))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for n, r in enumerate(rows):
        lines.append("  ".join(x.ljust(wd) if c < 2 else x.rjust(wd)
                               for c, (x, wd) in enumerate(zip(r, widths))).rstrip())
        if n == 0 or n == len(rows) - 2:
            lines.append("  ".join("-" * wd for wd in widths))
    reasons = [(s.operator, k, v) for s in stats for k, v in sorted(s.reasons.items(), key=lambda kv: -kv[1])]
    if reasons:
        lines.append("")
        lines.append("false failures (the model is correct, the verifier does not certify it), by reason:")
        for op, k, v in reasons:
            lines.append(f"  {op}: {v} x {k}")
    return "\n".join(lines)
