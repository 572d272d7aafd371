"""Rendering a :class:`verifier.checks.verify.Report`: the per-task table and the JSON record.

JSON field names are stable (documented in docs/reference.md, "JSON report").
"""

from __future__ import annotations

import json
import math
from typing import Any

from verifier.checks import catalogue
from verifier.checks.catalogue import number as _g, printable as _printable
from verifier.checks.verify import Report, TaskRecord

QUERY_DEFINITION = ("every non-empty proper prefix of every sentence (1 to |t| - 1 tokens); "
                    "the empty prefix (BOS alone) is not a query")


def _num(x: float | None) -> float | None:
    if x is None or (isinstance(x, float) and (math.isinf(x) or math.isnan(x))):
        return None
    return float(x)


def task_json(r: TaskRecord) -> dict[str, Any]:
    return {
        "name": r.name,
        "templates": r.templates,
        "facts": r.facts,
        **({"compose": list(r.compose)} if r.compose is not None else {}),   # only for a composed task
        "L": r.L,
        "bound": r.bound,
        "expert": r.expert,
        "width": r.width,
        "queries": r.queries,
        "object_queries": r.object_queries,
        "worst_error_bound": _num(r.closed_form_bound),
        "worst_error_measured": _num(r.worst_error),
        "worst_error_measured_lower": _num(r.worst_error_lower),
        "worst_query": r.worst_query,
        "min_gate_margin": _num(r.min_margin),
        **{c.count: r.counts[c.count] for c in catalogue.counted() if c.json == "task"},
        "isolated": r.isolated,
        "localization": {
            "objects": r.objects,
            "uniform_bound": _num(r.uniform_bound),
            "worst_p_ablated_upper": _num(r.worst_p_ablated),
            "min_l2_gap": _num(r.min_gap) if r.object_queries else None,
            **{c.count: r.counts[c.count] for c in catalogue.counted() if c.json == "localization"},
            **{p.name: r.ok(p) for c in catalogue.PER_QUERY for p in c.parts},
        },
        "graded": r.graded(),
        "checks": {c.name: r.ok(c) for c in catalogue.CHECKS},
        "certified": r.certified,
    }


def localization_json(report: Report) -> dict[str, Any]:
    """The worst case of the localization check over every task: the largest certified
    upper end of P_ablated(o) (with its task and that task's bound 1/|O_k|), the largest
    ratio of it to its task's bound (<= 1: L1 holds everywhere), and the smallest L2 gap
    (>= 0: the object is never the strict top token without its expert)."""
    rows = [r for r in report.tasks if r.object_queries]
    if not rows:
        return {"worst_p_ablated_upper": None, "task": None, "uniform_bound": None, "worst_ratio_to_bound": None,
                "ratio_task": None, "min_l2_gap": None, "gap_task": None, "min_ablated_error_lower": None}
    worst = max(rows, key=lambda r: r.worst_p_ablated)
    ratio = max(rows, key=lambda r: r.worst_p_ablated * r.objects)
    gap = min(rows, key=lambda r: r.min_gap)
    low = min(rows, key=lambda r: r.min_ablated_lower)
    return {"worst_p_ablated_upper": worst.worst_p_ablated, "task": worst.name, "uniform_bound": worst.uniform_bound,
            "worst_ratio_to_bound": ratio.worst_p_ablated * ratio.objects, "ratio_task": ratio.name,
            "min_l2_gap": _num(gap.min_gap), "gap_task": gap.name,
            "min_ablated_error_lower": _num(low.min_ablated_lower)}


def report_json(report: Report) -> dict[str, Any]:
    ratio = None
    if report.closed_form_value and report.measured_worst:
        ratio = report.closed_form_value / report.measured_worst
    return {
        "verdict": report.verdict,
        "certified": report.certified,
        "epsilon": report.epsilon,
        "precision": report.precision,
        "precision_model": report.precision_model,
        "parameters": report.parameters,
        "queries": report.queries,
        "enumerated_queries": report.enumerated,
        "query_definition": QUERY_DEFINITION,
        "seconds": round(report.seconds, 3),
        "gate": report.gate,
        "closed_form": {
            "expression": report.closed_form,
            "bound": _num(report.closed_form_value),
            "bound_proven": report.closed_form_proven,
            "measured_worst": _num(report.measured_worst),
            "bound_over_measured": _num(ratio),
        },
        "parameter_counts": report.parameter_counts,
        "weights_sha256": report.weights_sha256,
        "foreign_queries": report.foreign,
        "localization": localization_json(report),
        "tasks": [task_json(r) for r in report.tasks],
        "counterexamples": report.counterexamples,
        "notes": report.notes,
        "incremental": report.incremental,
    }


def dumps(report: Report) -> str:
    return json.dumps(report_json(report), indent=2, ensure_ascii=False)


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isinf(x)):
        return "-"
    return f"{x:.{digits}e}" if (x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4)) else f"{x:.{digits + 2}g}"


#: what names a counterexample's query (the rest of its numbers are its check's)
_QUERY_KEYS = ("check", "task", "template", "subject", "prefix", "valid_next", "consistent_tasks")


def counterexample_lines(c: dict) -> list[str]:
    """Two readable lines: which query, and the numbers that fail it."""
    subject = f", subject '{_printable(c['subject'])}'" if c.get("subject") is not None else ""
    valid = ", ".join(f"'{_printable(v)}'" for v in c.get("valid_next", [])) or "none"
    head = (f"counterexample [{c['check']}]: task '{_printable(c['task'])}', template "
            f"'{_printable(c['template'])}'{subject}, prefix '{_printable(c['prefix'])}' (valid next: {valid})")
    check = catalogue.find(c["check"])
    if check is not None and check.explain is not None:
        what = check.explain(c)
    else:
        numbers = ", ".join(f"{k} {_printable(v)}" for k, v in c.items() if k not in _QUERY_KEYS)
        what = f"fails {c['check']}: {numbers}"
    return [head, f"  {what}"]


def table(report: Report) -> str:
    columns = [c for c in catalogue.CHECKS if isinstance(c, catalogue.QueryCheck) and c.table]
    head = ["task", "|T|", "N", "L", "c(k)", "width", "queries", "err bound", "err measured", "margin",
            *(c.label for c in columns), "ok"]
    rows = []
    for r in report.tasks:
        rows.append([
            r.name, str(r.templates), str(r.facts), str(r.L), str(r.bound), "-" if r.width is None else str(r.width),
            str(r.queries), _fmt(r.closed_form_bound), _fmt(r.worst_error), _fmt(r.min_margin),
            *("ok" if r.ok(c) else f"{r.counts[c.count]} bad" for c in columns), "yes" if r.certified else "NO",
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def graded_table(report: Report) -> str:
    """Per task, the share of its queries each check certifies (entanglement: of its object
    queries, L1 and L2 shown apart), the size check yes/no, and the localization's worst case."""
    checks = catalogue.graded()
    head = ["task", *(c.label for c in checks), "P abl max", "1/|O|", "L2 gap"]
    rows = []
    for r in report.tasks:
        g = r.graded()
        rows.append([r.name,
                     *(_share(g[c.name]) if isinstance(c, catalogue.QueryCheck) else "yes" if g[c.name] else "NO"
                       for c in checks),
                     _g(r.worst_p_ablated), _g(r.uniform_bound), _g(r.min_gap) if r.object_queries else "-"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def localization_line(report: Report) -> str | None:
    """One line: the localization check's worst case (None without object queries)."""
    loc = localization_json(report)
    if loc["worst_p_ablated_upper"] is None:
        return None
    gap = loc["min_l2_gap"]
    tie = " (a tie: some other token's logit equals the object's)" if gap == 0.0 else ""
    return (f"without its expert: worst P(object) {_g(loc['worst_p_ablated_upper'])} (task "
            f"'{_printable(loc['task'])}', bound 1/|O_k| = {_g(loc['uniform_bound'])}), at most "
            f"{_g(loc['worst_ratio_to_bound'])} x its task's bound (task '{_printable(loc['ratio_task'])}'); smallest "
            f"top-token gap {_g(gap)}{tie}; smallest ablated error {_g(loc['min_ablated_error_lower'])} (epsilon "
            f"{_g(report.epsilon)})")


def summary(report: Report) -> str:
    lines = [table(report), ""]
    if report.closed_form:
        lines.append(f"closed-form bound: eps(beta, gamma) = {report.closed_form}")
        proven = {True: " (proven upper bound)", False: " (not proven: its side conditions fail, see the note)"}
        lines.append(f"  at the parameters: {_fmt(report.closed_form_value, 4)}"
                     f"{proven.get(report.closed_form_proven, '')}; measured worst error: "
                     f"{_fmt(report.measured_worst, 4)}")
    loc = localization_line(report)
    if loc:
        lines.append(loc)
    if not report.certified:
        lines += ["share of each task's queries certified, per check (entanglement: of its object queries):",
                  graded_table(report)]
    params = ", ".join(f"{_printable(k)}={_printable(v)}" for k, v in report.parameters.items())
    gate = "" if "gate" in report.parameters else f"; gate: {report.gate or 'given weights'}"
    lines.append(f"parameters: {params or 'none stored'}{gate}; queries: {report.queries} (non-empty proper prefixes); "
                 f"time: {report.seconds:.2f}s")
    c = report.parameter_counts
    if c:
        per_fact = f"; {c['facts_per_parameter']:.3g} facts per parameter" if c.get("facts_per_parameter") else ""
        lines.append(f"size: {c['total']:,} parameters stored ({c['shared']:,} shared, experts "
                     f"{min(c['per_expert'], default=0):,}..{max(c['per_expert'], default=0):,}); "
                     f"{c['active_per_query']:,} active per query{per_fact}; dense shapes would hold "
                     f"{c['dense_total']:,}")
    for note in report.notes:
        lines.append(f"note: {note}")
    inc = report.incremental
    if inc:
        if inc["mode"] == "full":
            lines.append(f"since the certificate: a full check ({inc['reason']})")
        else:
            changed = ", ".join(f"{k} {v}" for k, v in list(inc["changed_weights"].items())[:8]) or "none"
            lines.append(f"since the certificate: {inc['queries_rerun']:,} queries run again in {inc['cells_rerun']:,} "
                         f"of {inc['cells_total']:,} cells, {inc['queries_reused']:,} reused "
                         f"({inc['classes_reused']:,} classes, {inc.get('classes_partly_reused', 0):,} of them in "
                         f"part); vocabulary {inc['vocabulary_delta']:+d} tokens; changed entries: {changed}")
            for array, entries in list((inc.get("changed_rows") or {}).items())[:8]:
                lines.append(f"  changed {array}: {', '.join(entries[:4])}{' ...' if len(entries) > 4 else ''}")
            reused = inc["tasks_reused"]
            lines.append(f"  tasks reused whole: {len(reused)} of {len(report.tasks)}"
                         + (f" ({', '.join(reused[:6])}{' ...' if len(reused) > 6 else ''})" if reused else ""))
    for c in report.counterexamples[:5]:
        lines.extend(counterexample_lines(c))
    if len(report.counterexamples) > 5:
        lines.append(f"... {len(report.counterexamples) - 5} more counterexamples in the JSON report")
    failed = [r.name for r in report.tasks if not r.certified]
    if report.precision_model:
        lines.append(f"precision: every execution in {report.precision_model}")
        if report.weights_sha256:
            lines.append(f"weights: sha256 {report.weights_sha256} (export --onnx writes the digest of what it "
                         f"exports into the graph's metadata)")
    at = "" if report.precision == "exact" else f" in {report.precision}"
    verdict = f"verdict: {report.verdict.upper()} at epsilon = {report.epsilon}{at}"
    if failed:
        verdict += f" (failing tasks: {', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''})"
    if report.foreign:
        verdict += f"; {report.foreign} determined queries reached another task's expert"
    if not report.complete:
        verdict += f"; only {report.queries} of {report.enumerated} enumerated queries have results"
    lines.append(verdict)
    return "\n".join(lines)
