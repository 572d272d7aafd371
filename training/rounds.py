"""Counterexample-guided training: train, check every query, feed the failing ones back, repeat.

Round 0 trains a new model for ``config.steps`` steps with the ``localize`` objective
(:mod:`training.objectives`). After every round the model is exported (expert k serves
task k, the mapping the objective trains) and every query is checked; a query failing a
check has its weight multiplied by ``boost`` (at most ``max_weight``), and the next round
continues the same model for ``round_steps`` steps (a fresh optimiser and schedule) with
those weights. Rounds stop when the verifier certifies the weights or when ``max_rounds``
rounds or the ``time_budget`` (seconds of training) are spent.

**The per-query checks** (:class:`QueryChecks`) are the verifier's rules, applied to its
certified pass on every query (:func:`training.compare.certified_pass`, the enclosures
:func:`verifier.checks.verify.verify` computes):

* *error*: the error enclosure's upper end is below ε;
* *routing*: a certified unique gate winner (margin > 0) serving a task consistent with
  the prefix;
* *entanglement* (object queries): the ablated error's lower end is at least ε;
* *localization* (object queries): with the routed expert's output removed, the object's
  probability is at most 1/|O_k| (L1) and another token's logit is at least the object's
  (L2). The certified pass does not give these per query, so this one is the float64
  measure of :func:`training.metrics.localization` (uncertified, with a slack that errs
  toward failing);
* *size*, per task: the width of expert k is at most c(k) (the widths are sized so, and
  it is checked anyway).

**The verdict** is the verifier's: when every query passes, :func:`verifier.checks.verify.verify`
runs on the exported weights, and the round is certified when its report is certified
and the float64 localization measure holds with its slack on every object query. Where the verifier
certifies localization itself (a ``worst_ablated_object_probability`` in its task
records), that check is part of ``report.certified``, and the float64 measure can only
make a round continue, never certify one.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from tasks.model import TaskSet
from training.compare import CertifiedPass, certified_pass
from training.data import QueryData, query_data
from training.export import to_weights
from training.metrics import Localization
from training.model import MoETransformer
from training.train import Evaluation, TrainConfig, evaluate, train
from layout import Weights
from verifier.checks.verify import Report, verify

CHECKS = ("error", "routing", "entanglement", "localization")


@dataclass(frozen=True)
class QueryChecks:
    """Per query, whether each check holds (True where a check does not apply)."""

    error: np.ndarray          # (Q,) bool
    routing: np.ndarray        # (Q,) bool
    entanglement: np.ndarray   # (Q,) bool, True on queries that are not object queries
    localization: np.ndarray   # (Q,) bool, True on queries that are not object queries
    size: np.ndarray           # (T,) bool, per task
    object_query: np.ndarray   # (Q,) bool

    @property
    def passing(self) -> np.ndarray:
        """(Q,) the query passes every check that applies to it."""
        return self.error & self.routing & self.entanglement & self.localization

    @property
    def all_pass(self) -> bool:
        return bool(self.passing.all() and self.size.all())

    def shares(self) -> dict[str, float]:
        """The share of queries passing each check (object queries only for entanglement and
        localization), and ``certified``: the share passing every check that applies."""
        oq = self.object_query
        per = {"error": self.error.mean(), "routing": self.routing.mean(),
               "entanglement": self.entanglement[oq].mean() if oq.any() else 1.0,
               "localization": self.localization[oq].mean() if oq.any() else 1.0,
               "size": self.size.mean(), "certified": self.passing.mean()}
        return {k: float(v) for k, v in per.items()}

    def task_shares(self, data: QueryData) -> dict[str, list[float]]:
        """Per task, the share of its queries passing each check. A query counts for every
        task consistent with it (as in the verifier's per-task counts); entanglement and
        localization count the task's object queries; NaN where a task has none."""
        T = len(data.task_names)
        cons = data.consistent
        n = cons.sum(axis=0).astype(np.float64)
        oq = cons & self.object_query[:, None]
        n_oq = oq.sum(axis=0).astype(np.float64)

        def share(ok: np.ndarray, rows: np.ndarray, total: np.ndarray) -> list[float]:
            good = (rows & ok[:, None]).sum(axis=0)
            return np.divide(good, total, out=np.full(T, np.nan), where=total > 0).tolist()

        return {"error": share(self.error, cons, n), "routing": share(self.routing, cons, n),
                "entanglement": share(self.entanglement, oq, n_oq), "localization": share(self.localization, oq, n_oq),
                "size": self.size.astype(np.float64).tolist(), "certified": share(self.passing, cons, n)}


def query_checks(data: QueryData, weights: Weights, cert: CertifiedPass, loc: Localization,
                 epsilon: float, slack: bool = True) -> QueryChecks:
    """The verifier's rules per query (see the module docstring); ``cert`` must have the
    object queries' ablated enclosures (``certified_pass(..., ablate_objects=True)``).
    ``slack``: localization with the slack that errs toward failing (what the rounds
    require; False: the criterion itself, ties allowed)."""
    if cert.ablated_lo is None:
        raise ValueError("the checks need the ablated enclosures: certified_pass(..., ablate_objects=True)")
    names = list(data.task_names)
    serves = np.array([names.index(t) if t in names else -1 for t in weights.expert_tasks], np.int64)
    served = serves[cert.expert]
    rows = np.arange(len(data))
    routing = (cert.margin > 0) & (served >= 0) & data.consistent[rows, np.maximum(served, 0)]
    oq = data.object_query
    entanglement = ~oq.copy()
    entanglement[oq] = cert.ablated_lo[oq] >= epsilon
    localization = ~oq.copy()
    localization[loc.rows] = loc.holds_with_slack if slack else loc.holds
    expert_of = {t: e for e, t in enumerate(weights.expert_tasks) if t}
    size = np.array([t in expert_of and weights.experts[expert_of[t]].width <= data.bounds[k]
                     for k, t in enumerate(names)], bool)
    return QueryChecks(error=cert.err_hi < epsilon, routing=routing, entanglement=entanglement,
                       localization=localization, size=size, object_query=oq)


@dataclass(frozen=True)
class RoundRecord:
    """One round: its training, the checks' certified shares, and the verdict."""

    round: int
    steps: int
    train_seconds: float         # this round's training
    check_seconds: float         # the certified pass, the float64 measure and (if run) verify
    shares: dict[str, float]     # QueryChecks.shares()
    failing: int                 # queries failing some check (their weights are raised)
    certified: bool              # the verifier's verdict and the localization measure (False if verify did not run)
    verified: bool               # verify() ran (every query passed the per-query checks)
    worst_ablated_object_probability: float   # float64 measure, over every object query
    max_error: float             # the largest certified error upper end

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RoundsResult:
    model: MoETransformer
    config: TrainConfig
    weights: Weights
    evaluation: Evaluation
    checks: QueryChecks
    report: Report | None                 # the verifier's report of the last round (None: not run)
    rounds: list[RoundRecord] = field(default_factory=list)
    query_weights: np.ndarray | None = None
    cert: CertifiedPass | None = None     # the last round's certified pass (object queries ablated too)

    @property
    def certified(self) -> bool:
        return bool(self.rounds and self.rounds[-1].certified)

    @property
    def train_seconds(self) -> float:
        return float(sum(r.train_seconds for r in self.rounds))

    @property
    def steps(self) -> int:
        return int(sum(r.steps for r in self.rounds))


def reweight(weights: np.ndarray, failing: np.ndarray, boost: float, max_weight: float) -> np.ndarray:
    """The next round's query weights: a failing query's weight times ``boost``, at most
    ``max_weight``; the others keep theirs (so a query that failed once stays emphasised)."""
    out = np.asarray(weights, np.float64).copy()
    out[failing] = np.minimum(out[failing] * boost, max_weight)
    return out


def check_round(taskset: TaskSet, model: MoETransformer, config: TrainConfig, data: QueryData, epsilon: float,
                extra: dict | None = None) -> tuple[Weights, Evaluation, CertifiedPass, QueryChecks, Report | None]:
    """Export, evaluate in float64, run the certified pass and the per-query checks; when
    every query passes, run :func:`verifier.checks.verify.verify` for the verdict."""
    ev = evaluate(model, data)
    weights = to_weights(model, taskset, "declared", config=config, extra=extra)
    cert = certified_pass(taskset, weights, data, ablate_objects=True)
    checks = query_checks(data, weights, cert, ev.localization, epsilon)
    report = verify(taskset, weights, epsilon, source="trained weights") if checks.all_pass else None
    return weights, ev, cert, checks, report


def until_certified(taskset: TaskSet, config: TrainConfig, *, epsilon: float | None = None, max_rounds: int = 5,
                    round_steps: int | None = None, boost: float = 4.0, max_weight: float = 256.0,
                    time_budget: float | None = None, data: QueryData | None = None,
                    log: Callable[[RoundRecord], None] | None = None,
                    step_log: Callable[[dict], None] | None = None) -> RoundsResult:
    """Train with counterexample rounds until certified (see the module docstring).

    ``max_rounds``: rounds after the first (so at most ``1 + max_rounds`` trainings);
    ``round_steps``: steps of each later round (default half of ``config.steps``);
    ``time_budget``: seconds of training in all (a round is cut at the budget, and no
    round starts after it). ``epsilon`` defaults to ``config.epsilon``."""
    if config.objective != "localize":
        raise ValueError("counterexample rounds train toward the certificate: they need the localize objective")
    if max_rounds < 0 or boost < 1 or max_weight < 1 or (time_budget is not None and not time_budget > 0):
        raise ValueError("max_rounds must be >= 0, boost and max_weight >= 1, time_budget > 0")
    epsilon = config.epsilon if epsilon is None else float(epsilon)
    data = data or query_data(taskset)
    round_steps = round_steps or max(1, config.steps // 2)
    qw = np.ones(len(data))
    model = None
    records: list[RoundRecord] = []
    spent = 0.0
    result = None
    for r in range(max_rounds + 1):
        left = None if time_budget is None else time_budget - spent
        if left is not None and left <= 0:
            break
        limits = [x for x in (config.time_limit, left) if x is not None]
        limit = min(limits) if limits else None
        cfg = TrainConfig(**{**asdict(config), "time_limit": limit})
        trained = train(taskset, cfg, data=data, model=model, query_weights=None if r == 0 else qw,
                        steps=config.steps if r == 0 else round_steps, warmup=None if r == 0 else min(config.warmup, 20),
                        round_no=r, log=step_log, log_every=100 if step_log else 0)
        model = trained.model
        spent += trained.seconds
        total_steps = trained.steps + sum(x.steps for x in records)
        t0 = time.perf_counter()
        weights, ev, cert, checks, report = check_round(taskset, model, config, data, epsilon,
                                                        {"rounds": r + 1, "total_steps": total_steps})
        loc = ev.localization
        certified = bool(report is not None and report.certified and loc.holds_with_slack.all())
        failing = ~checks.passing
        rec = RoundRecord(round=r, steps=trained.steps, train_seconds=round(trained.seconds, 2),
                          check_seconds=round(time.perf_counter() - t0, 2), shares=checks.shares(),
                          failing=int(failing.sum()), certified=certified, verified=report is not None,
                          worst_ablated_object_probability=float(loc.probability.max()) if loc.rows.size else 0.0,
                          max_error=float(np.max(cert.err_hi)))
        records.append(rec)
        if log:
            log(rec)
        result = RoundsResult(model, config, weights, ev, checks, report, records, qw.copy(), cert)
        if certified:
            break
        qw = reweight(qw, failing, boost, max_weight)
    return result
