"""Counterexample-guided training: train, check every query, feed the failing ones back, repeat.

Round 0 trains a new model for ``config.steps`` steps with the ``localize`` objective
(:mod:`training.objectives`). After every round the model is exported (expert k serves
task k, the mapping the objective trains) and every query is checked; a query failing a
check has its weight multiplied by ``boost`` (at most ``max_weight``), and the next round
continues the same model for ``round_steps`` steps (a fresh optimiser and schedule, at
:data:`ROUND_LR` of the learning rate) with those weights. Rounds stop when the verifier
certifies the weights or when ``max_rounds``
rounds or the ``time_budget`` (seconds of training) are spent; the budget is shared out
ahead (:func:`round_share`), and each round's learning-rate schedule fits its share.

**The per-query checks** (:class:`QueryChecks`) are the verifier's rules. Between rounds
they are first *screened* on the float64 evaluation (:func:`screen_checks`, with a
relative slack toward failing, :data:`SCREEN_SLACK`): one float64 pass, where the
certified pass over every query and its ablation cost more than the training itself at
10,000 facts. Only when the screen passes every query does :func:`verify` run; if it does
not certify, the checks are redone on the verifier's certified pass on every query
(:func:`training.compare.certified_pass`, the enclosures :func:`verify` computes) to find
the counterexamples:

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
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np

from tasks.model import TaskSet
from training.compare import CertifiedPass, certified_pass
from training.data import QueryData, query_data
from training.export import to_weights
from training.metrics import Localization
from training.model import MoETransformer
from training.loop import Evaluation, TrainConfig, evaluate, train
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
    return QueryChecks(error=cert.err_hi < epsilon, routing=routing, entanglement=entanglement,
                       localization=localization, size=_sizes(data, weights), object_query=oq)


def _sizes(data: QueryData, weights: Weights) -> np.ndarray:
    """(T,) per task: an expert serves it and its width is at most c(k)."""
    expert_of = {t: e for e, t in enumerate(weights.expert_tasks) if t}
    return np.array([t in expert_of and weights.experts[expert_of[t]].width <= data.bounds[k]
                     for k, t in enumerate(data.task_names)], bool)


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
    max_error: float             # the largest error: the certified upper end, or float64 when only screened
    measure: str = "certified"   # the per-query shares: "float64" (the screen) or "certified" (the certified pass)

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

    @property
    def check_seconds(self) -> float:
        return float(sum(r.check_seconds for r in self.rounds))

    def run_parameters(self) -> dict:
        """What the weights file records of the run (``parameters``, informational): the
        rounds, their steps in all, and the seconds of training and of the checks between
        rounds (the screen, verify and the certified pass)."""
        return {"rounds": len(self.rounds), "total_steps": self.steps,
                "train_seconds": round(self.train_seconds, 2), "check_seconds": round(self.check_seconds, 2)}


#: A counterexample round's peak learning rate, as a share of the configured one: the rate
#: the first round's schedule ends at (:func:`training.loop._rate` decays to 10%). A round
#: starts a fresh optimiser on a model that already passes nearly every query; at the full
#: rate its first steps undid more than they fixed (a 30,000-fact model with 4 failing
#: queries after round 0 had 422, 814 and 716 after three full-rate rounds), so a round
#: continues at the rate training had reached, and decays from there.
ROUND_LR = 0.1

#: The first round's share of a time budget (the rest is left to counterexample rounds).
FIRST_SHARE = 0.75


def round_share(left: float, budget: float, round_no: int, max_rounds: int, first_share: float) -> float:
    """Seconds round ``round_no`` may train, of ``left`` seconds still unspent: the first
    round ``first_share`` of the budget (all of it without later rounds), a later round an
    equal part of what is left over the rounds still allowed (so none is starved by the
    one before it). Never more than ``left``."""
    if round_no == 0:
        return min(left, budget if max_rounds == 0 else first_share * budget)
    return left / (max_rounds + 1 - round_no)


def reweight(weights: np.ndarray, failing: np.ndarray, boost: float, max_weight: float) -> np.ndarray:
    """The next round's query weights: a failing query's weight times ``boost``, at most
    ``max_weight``; the others keep theirs (so a query that failed once stays emphasised)."""
    out = np.asarray(weights, np.float64).copy()
    out[failing] = np.minimum(out[failing] * boost, max_weight)
    return out


#: The float64 screen between rounds errs toward failing by this relative distance from
#: each threshold (error and ablated error against ε, the gate's margin against 0): the
#: certified pass encloses the same real numbers, and its enclosures are far narrower
#: than this on trained weights (``agreement``'s ``max_width``), so a query the screen
#: passes is one the verifier's enclosures pass in practice; when they do not, the verdict
#: (always :func:`verify`'s) says so and the certified pass supplies the counterexamples.
SCREEN_SLACK = 1e-3


def screen_checks(data: QueryData, weights: Weights, ev: Evaluation, epsilon: float) -> QueryChecks:
    """The per-query checks on the float64 evaluation (uncertified, a screen that errs toward
    failing by :data:`SCREEN_SLACK`; the localization measure with its own slack): which
    queries to feed back, at the cost of one float64 pass instead of the certified pass
    over every query and its ablation (which took longer than the training itself at
    10,000 facts). Never a verdict."""
    names = list(data.task_names)
    serves = np.array([names.index(t) if t in names else -1 for t in weights.expert_tasks], np.int64)
    served = serves[ev.expert]
    rows = np.arange(len(data))
    top2 = np.sort(ev.gate, axis=1)[:, -2:] if ev.gate.shape[1] > 1 else np.concatenate([ev.gate - np.inf, ev.gate], 1)
    margin = top2[:, 1] - top2[:, 0]
    routing = (margin > SCREEN_SLACK * np.maximum(1.0, np.abs(top2[:, 1]))) & (served >= 0) \
        & data.consistent[rows, np.maximum(served, 0)]
    oq = data.object_query
    loc = ev.localization
    entanglement = ~oq.copy()
    localization = ~oq.copy()
    if loc is not None and loc.rows.size:
        entanglement[loc.rows] = loc.ablated_error >= epsilon * (1 + SCREEN_SLACK)
        localization[loc.rows] = loc.holds_with_slack
    return QueryChecks(error=ev.error < epsilon * (1 - SCREEN_SLACK), routing=routing, entanglement=entanglement,
                       localization=localization, size=_sizes(data, weights), object_query=oq)


def check_round(taskset: TaskSet, model: MoETransformer, config: TrainConfig, data: QueryData, epsilon: float,
                extra: dict | None = None
                ) -> tuple[Weights, Evaluation, CertifiedPass | None, QueryChecks, Report | None]:
    """Export and evaluate in float64; screen every query (:func:`screen_checks`); when the
    screen passes them all, run :func:`verifier.checks.verify.verify` for the verdict, and
    only if it does not certify, the certified pass over every query for the per-query
    counterexamples (:func:`query_checks`). The certified pass is None when not run."""
    ev = evaluate(model, data)
    weights = to_weights(model, taskset, "declared", config=config, extra=extra)
    checks = screen_checks(data, weights, ev, epsilon)
    if not checks.all_pass:
        return weights, ev, None, checks, None
    report = verify(taskset, weights, epsilon, source="trained weights")
    if report.certified:
        return weights, ev, None, checks, report
    cert = certified_pass(taskset, weights, data, ablate_objects=True)
    return weights, ev, cert, query_checks(data, weights, cert, ev.localization, epsilon), report


def until_certified(taskset: TaskSet, config: TrainConfig, *, epsilon: float | None = None, max_rounds: int = 5,
                    round_steps: int | None = None, boost: float = 4.0, max_weight: float = 256.0,
                    time_budget: float | None = None, first_share: float = FIRST_SHARE,
                    data: QueryData | None = None, log: Callable[[RoundRecord], None] | None = None,
                    step_log: Callable[[dict], None] | None = None, step_every: int = 100,
                    checking: Callable[[int], None] | None = None) -> RoundsResult:
    """Train with counterexample rounds until certified (see the module docstring).

    ``max_rounds``: rounds after the first (so at most ``1 + max_rounds`` trainings);
    ``round_steps``: steps of each later round (default half of ``config.steps``);
    ``time_budget``: seconds of training in all, shared out ahead: the first round may
    use ``first_share`` of it, each later round an equal share of what is left over the
    rounds still allowed; a round's learning-rate schedule is fitted to its share
    (:func:`training.loop._rate`), so it ends decayed rather than cut. ``epsilon``
    defaults to ``config.epsilon``.

    Progress: ``step_log`` gets :func:`training.loop.train`'s entries every ``step_every``
    steps (they name their round), ``checking`` the round's number when its checks start,
    and ``log`` each round's record when they end. The result's weights record the run
    (:meth:`RoundsResult.run_parameters`) in their ``parameters``."""
    if config.objective != "localize":
        raise ValueError("counterexample rounds train toward the certificate: they need the localize objective")
    if max_rounds < 0 or boost < 1 or max_weight < 1 or (time_budget is not None and not time_budget > 0) \
            or not 0 < first_share <= 1:
        raise ValueError("max_rounds must be >= 0, boost and max_weight >= 1, time_budget > 0, first_share in (0, 1]")
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
        share = None if left is None else round_share(left, time_budget, r, max_rounds, first_share)
        limits = [x for x in (config.time_limit, share) if x is not None]
        limit = min(limits) if limits else None
        cfg = TrainConfig(**{**asdict(config), "time_limit": limit})
        trained = train(taskset, cfg, data=data, model=model, query_weights=None if r == 0 else qw,
                        steps=config.steps if r == 0 else round_steps,
                        warmup=None if r == 0 else min(config.warmup, 20),
                        lr_scale=1.0 if r == 0 else ROUND_LR, round_no=r,
                        log=step_log, log_every=step_every if step_log else 0)
        model = trained.model
        spent += trained.seconds
        total_steps = trained.steps + sum(x.steps for x in records)
        if checking:
            checking(r)
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
                          max_error=float(np.max(cert.err_hi if cert is not None else ev.error)),
                          measure="float64" if cert is None else "certified")
        records.append(rec)
        if log:
            log(rec)
        result = RoundsResult(model, config, weights, ev, checks, report, records, qw.copy(), cert)
        if certified:
            break
        qw = reweight(qw, failing, boost, max_weight)
    if result is not None:
        result.weights = replace(result.weights, parameters={**result.weights.parameters, **result.run_parameters()})
    return result
