"""The checks are one catalogue (verifier.checks.catalogue): a new per-query check is one entry.

A check registered here, in the test only (the shipped catalogue is untouched, so every
shipped report stays as it is), is decided for every row by the one decision, counted in the
per-task records by the full pass and by the query classes a certificate keeps, shown in the
report's JSON and text and in the failing checks, and refused by a re-certification that
cannot reuse its classes. Everything it needs is the entry below: the catalogue's module is
the one shipped code file a new per-query check touches (with, when its number is new, the
module that computes it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from construction.model import build
from tasks.model import Facts, Task, TaskSet
from verifier.checks import catalogue
from verifier.checks.catalogue import QueryCheck

#: a gate margin below this is "thin" (the capitals model's smallest margins are 0.37 to 0.56)
THIN = 0.5


def _margin_holds(rows: catalogue.Rows) -> np.ndarray:
    return rows.result.margin >= THIN


def _margin_numbers(d: catalogue.RowDecisions, i: int) -> dict:
    return {"margin": float(d.rows.result.margin[i]), "at_least": THIN}


def _margin_line(c: dict) -> str:
    return f"certified gate margin {catalogue.number(c['margin'])}, below {c['at_least']}"


#: "every query is routed with room to spare": a check users could want, made up for the test
MARGIN = QueryCheck("margin", "margin", _margin_holds, "thin_margin", "thin_margin", failures=True,
                    describe=_margin_numbers, explain=_margin_line)


@pytest.fixture
def registered(monkeypatch):
    """The catalogue with MARGIN registered, for this test only."""
    monkeypatch.setattr(catalogue, "CHECKS", catalogue.CHECKS + (MARGIN,))
    monkeypatch.setattr(catalogue, "PER_QUERY", catalogue.PER_QUERY + (MARGIN,))
    return MARGIN


def test_the_shipped_catalogue_reproduces_the_reports_order():
    """The two orders of the catalogue: verdicts (error, routing, size, entanglement) and what a
    batch records (routing, error, entanglement, each check's parts before it)."""
    assert [c.name for c in catalogue.CHECKS] == ["error", "routing", "size", "entanglement"]
    assert [c.count for c in catalogue.counted()] == ["misrouted", "over_epsilon", "l1_held", "l2_held",
                                                      "ablation_broken", "localized"]
    assert [c.name for c in catalogue.graded()] == ["error", "routing", "entanglement", "l1", "l2", "size"]
    assert set(catalogue.PER_QUERY) == {c for c in catalogue.CHECKS if isinstance(c, QueryCheck)}
    from verifier.checks.classes import COUNTS, count_columns

    assert count_columns() == COUNTS and {c.column for c in catalogue.counted()} <= set(COUNTS)


def test_a_registered_check_is_decided_counted_and_reported(capitals_set, capitals_model, registered):
    from verifier.checks.report import report_json, summary
    from verifier.checks.verify import verify
    from workflow.check import failing_checks

    weights = capitals_model.instantiate()
    report = verify(capitals_set, weights, capitals_model.epsilon)
    # every other check holds: the report fails on the new one alone
    assert not report.certified
    assert all(r.error_ok and r.routing_ok and r.size_ok and r.entanglement_ok for r in report.tasks)
    thin = {r.name: r.counts["thin_margin"] for r in report.tasks}
    assert thin["located"] > 0 and not all(r.ok(MARGIN) for r in report.tasks)
    assert [r.ok(MARGIN) for r in report.tasks] == [n == 0 for n in thin.values()]
    # one decision per row: what the per-task counts add up from
    from verifier.passes.batches import batches
    from verifier.checks.verify import token_map
    from verifier.running.runner import PassSpec

    tmap = token_map(capitals_set, weights)
    prepared = PassSpec.for_taskset(capitals_set, weights, tmap).build(weights)
    per_task = np.zeros(len(capitals_set.tasks), np.int64)
    distinct = 0
    serves = np.array([capitals_set.names.index(t) for t in weights.expert_tasks], np.int64)
    rules = catalogue.Rules(serves, capitals_model.epsilon, np.zeros(len(capitals_set.tasks)), len(weights.vocab))
    for b in batches(capitals_set):
        ablate = b.object_query & (b.determined >= 0)
        res = prepared.run_batch(tmap[b.tokens], b.valid_ptr, tmap[b.valid], ablate=ablate, scores=True,
                                 target=np.where(ablate & (b.target >= 0), tmap[np.maximum(b.target, 0)], -1))
        d = catalogue.decide(rules, b, res)
        assert np.array_equal(d.holds["margin"], res.margin >= THIN)
        bad = d.failing(MARGIN)
        distinct += int(bad.sum())
        np.add.at(per_task, b.allowed[np.repeat(bad, np.diff(b.allowed_ptr))], 1)
    assert list(thin.values()) == per_task.tolist() and report.failing["margin"] == distinct > 0
    # the report: its count, verdict and share per task, its counterexamples, the failing checks
    js = report_json(report)
    task = next(t for t in js["tasks"] if t["name"] == "located")
    assert task["thin_margin"] == thin["located"] and task["checks"]["margin"] is False
    assert 0 < task["graded"]["margin"] < 1 and list(task["checks"]) == ["error", "routing", "size", "entanglement",
                                                                          "margin"]
    found = [c for c in js["counterexamples"] if c["check"] == "margin"]
    assert found and all(c["margin"] < THIN for c in found)
    text = summary(report)
    shares = next(line for line in text.splitlines() if line.startswith("task") and "entanglement" in line)
    assert shares.split()[1:8] == ["error", "routing", "entanglement", "L1", "L2", "margin", "size"]
    assert f"certified gate margin {catalogue.number(found[0]['margin'])}, below {THIN}" in text
    assert failing_checks(report) == f"margin on {distinct} queries"
    json.dumps(js)


def test_a_registered_check_is_kept_by_the_query_classes(capitals_set, capitals_model, registered):
    """The classes a certificate keeps count the new check in a column of their own, and the
    per-task records computed from them agree with the full pass's."""
    from verifier.checks.classes import count_columns, records
    from workflow.certificates import check_and_record

    report, cert = check_and_record(capitals_set, capitals_model, isolation=False)
    assert count_columns()[-1] == "thin_margin"
    tot = records(cert.table, capitals_set, len(cert.weights.experts))
    assert tot.counts["thin_margin"].tolist() == [r.counts["thin_margin"] for r in report.tasks]
    assert tot.failing["margin"] == report.failing["margin"] > 0


def test_a_check_whose_classes_are_not_reused_gets_a_full_recertification(tmp_path, capitals_set, registered):
    """A re-certification keeps a class's counts only for the checks it knows how to decide for
    reused classes (``QueryCheck.reused``); for any other it runs the full check, and its report
    is the full check's."""
    from verifier.checks.verify import verify
    from workflow.certificates import check_and_save
    from workflow.since import check_since

    model = build(capitals_set)
    d = str(tmp_path / "cert")
    check_and_save(capitals_set, model, d, isolation=False)
    tasks = list(capitals_set.tasks)
    capital = tasks[0]
    tasks[0] = Task(capital.name, capital.templates, Facts({**dict(capital.facts.items()), "Spain": "Madrid"}))
    edited = TaskSet(tuple(tasks), capitals_set.epsilon, capitals_set.parameters)
    inc, _ = check_since(edited, d, isolation=False)
    assert inc.incremental["mode"] == "full" and "'margin'" in inc.incremental["reason"]
    full = verify(edited, build(edited, beta=float(model.beta), gamma=float(model.gamma)).instantiate(), model.epsilon)
    assert [r.counts for r in inc.tasks] == [r.counts for r in full.tasks]
