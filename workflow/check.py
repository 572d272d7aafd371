"""Check a task set: build the model (for a precision, if asked), verify it, attach the construction's evidence.

The verifier (:mod:`verifier`) certifies weights without knowing how they were made;
the construction (:mod:`construction`) knows its closed-form bound and can rebuild each
expert to check isolation. :func:`check_built` is where both meet; :func:`build_for`
aims the construction at a floating-point deployment (``python -m verifier check`` as a
whole is :mod:`workflow.checking`).
"""

from __future__ import annotations

import time
from typing import Callable

from construction.evidence import evidence
from construction.model import SymbolicModel
from layout import Weights
from tasks.model import TaskSet
from verifier.passes.floating import Deployment
from verifier.checks import catalogue
from verifier.running.parallel import Executor, LocalPool
from verifier.checks.verify import Report, verify


def check_built(taskset: TaskSet, model: SymbolicModel, *, weights: Weights | None = None, isolation: bool = True,
                jobs: int = 1, progress: Callable[[int, int], None] | None = None, source: str = "weights",
                executor: Executor | None = None, deployment: Deployment | None = None,
                classes=None, verified: Report | None = None) -> Report:
    """Verify the model's weights and attach the closed form and (``isolation``) the
    rebuild-without-each-task check; ``report.seconds`` covers both. Both run their work
    units on ``executor`` (default: ``jobs`` local processes). ``verified``: the verifier's
    report of these very weights in ``deployment``, already computed (:func:`build_for`
    verifies the model it returns), which is then not computed again.

    The construction's evidence is gathered first, so that the symbolic model can be
    released before the verification (at scale it is the larger part of memory; the
    numeric weights share its coefficient-1 matrices), and the weights are handed over to
    the verification, which lets them go once its pass has built its tables (the caller
    hands the model over in turn: ``check_built(taskset, build(taskset))``).
    """
    start = time.perf_counter()
    # held, not named: handed over to verify, which lets them go once the pass has its
    # tables (weights a caller passed in stay the caller's)
    held = [weights if weights is not None else model.instantiate(labels=False)]   # (the report names none)
    del weights
    epsilon = model.epsilon
    executor = executor if executor is not None else LocalPool(jobs)
    ev = evidence(taskset, model, check_isolation=isolation, map_fn=executor.map)
    del model
    if verified is not None and classes is None:
        report = verified
    else:
        report = verify(taskset, held.pop(), epsilon, source=source, progress=progress, executor=executor,
                        deployment=deployment, classes=classes)
    notes = list(ev.notes)
    if deployment is not None:
        notes.append(f"the closed-form bound is the exact model's; the measured errors are of every execution in "
                     f"{deployment.fmt.name}")
    report.attach(ev.closed_form, ev.bound, ev.gate, ev.isolated, notes, ev.bound_proven)
    report.seconds = time.perf_counter() - start
    return report


#: Construction targets tried by :func:`build_for` (each half the previous).
ATTEMPTS = 12


def build_for(taskset: TaskSet, deployment: Deployment, epsilon: float | None = None, beta: float | None = None,
              gamma: float | None = None, *, executor: Executor | None = None) -> tuple[SymbolicModel, list[dict]]:
    """A model for ``deployment``: the parameters searched for when they are free, taken as
    given when the user pins them.

    The construction's parameters come from a target error: for the exact model that
    target is ε itself. Rounding adds error, so when the deployed certificate fails the
    construction is asked for a smaller target ε' = ε/2, ε/4, ... (a larger logit scale γ,
    and with it a larger β where the gate needs one), at most :data:`ATTEMPTS` times, until
    the certificate at ε holds in the format. That search moves γ, so it runs only when γ
    is free: with ``gamma`` given (the user pinned it) the model is built once, with the
    parameters given, and verified: the caller gets it with its report whether or not it
    certifies (a check of the user's model, not a search). Returns the model (its
    ``epsilon`` is ε) and one record per attempt (target, β, γ, worst error, certified,
    the failing checks, and the deployed ``report`` of the last one).

    Raises TaskError when a search can find nothing: the certificate's own floor for |V|
    tokens (:func:`verifier.passes.floating.error_floor`) is at least ε (known before
    building), or every target failed. With γ pinned neither is a refusal: the floor is a
    note, and the report says what fails.
    """
    from dataclasses import replace

    from construction.model import build
    from tasks.errors import TaskError
    from verifier.passes.floating import error_floor

    epsilon = epsilon if epsilon is not None else (taskset.epsilon if taskset.epsilon is not None else 0.01)
    floor = error_floor(taskset.vocabulary.size, deployment)
    name = deployment.fmt.name
    pinned = gamma is not None
    below_floor = (f"no parameters can certify epsilon = {epsilon:g} in {name}: with {taskset.vocabulary.size} "
                   f"tokens summed in {name} in any order, the output softmax alone leaves an error bound of "
                   f"at least {floor:.3g} (1 - (1 - kappa)/(1 + gamma_(V-1)), kappa = {deployment.kappa:.3g})")
    if floor >= epsilon and not pinned:
        raise TaskError(below_floor, fix=f"raise epsilon above {floor:.3g}, or deploy in a wider format")
    attempts: list[dict] = []
    target = epsilon
    for _ in range(1 if pinned else ATTEMPTS):
        try:
            model = replace(build(taskset, epsilon=target, beta=beta, gamma=gamma), epsilon=epsilon)
        except TaskError:
            if not attempts:
                raise
            break                     # no parameters reach this target: the previous ones were the last

        report = verify(taskset, model.instantiate(), epsilon, executor=executor, deployment=deployment)
        attempts.append({"target": target, "beta": str(model.beta), "gamma": str(model.gamma),
                         "worst_error": report.measured_worst, "certified": report.certified,
                         "failing": failing_checks(report)})
        if report.certified or pinned:
            attempts[-1]["report"] = report       # the verifier's report of the model returned
            if not report.certified and floor >= epsilon:
                report.notes.append(f"{below_floor}: the parameters were given, so the model was checked as given")
            return model, attempts
        target /= 2.0
    shown = attempts if len(attempts) <= 2 else [attempts[0], attempts[-1]]
    tried = (f"{len(attempts)} targets from {attempts[0]['target']:.3g} to {attempts[-1]['target']:.3g}: "
             if len(attempts) > 2 else "") + ", ".join(
        f"{a['target']:.3g} (worst error {a['worst_error']:.3g}; failing: {a['failing']})" for a in shown)
    raise TaskError(f"no construction target made the {name} certificate hold at epsilon = {epsilon:g}; "
                    f"tried {tried}", fix="raise epsilon, deploy in a wider format, or pin --beta and --gamma "
                                          "to check one model and see its counterexamples")


def failing_checks(report: Report) -> str:
    """Which checks failed and on how many queries (for build_for's refusal): a worst error
    below epsilon with routing failing says that routing, not the error, is out of reach.
    A query consistent with several tasks counts once (the report's distinct counts;
    :func:`verifier.checks.catalogue.failing`)."""
    return catalogue.failing(report)
