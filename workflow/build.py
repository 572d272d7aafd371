"""Build a task set's model: plainly, or aimed at a floating-point deployment, and (``build``)
written out with the margins it leaves.

:func:`model` is the construction every command runs; :func:`model_for` aims it at a
deployment (:func:`workflow.check.build_for`) and says what that took; :func:`build_file`
is ``python -m verifier build``.
"""

from __future__ import annotations

from dataclasses import dataclass

import layout
from construction.model import SymbolicModel, build
from tasks.model import TaskSet
from verifier.checks.verify import Report, verify
from verifier.passes.floating import Deployment
from verifier.running.parallel import Executor
from workflow.check import build_for, failing_checks


def model(taskset: TaskSet, epsilon: float | None = None, beta: float | None = None,
          gamma: float | None = None) -> SymbolicModel:
    """The construction for the exact forward pass (parameters not given are computed)."""
    return build(taskset, epsilon=epsilon, beta=beta, gamma=gamma)


def model_for(taskset: TaskSet, deployment: Deployment | None, epsilon: float | None = None,
              beta: float | None = None, gamma: float | None = None,
              executor: Executor | None = None) -> tuple[SymbolicModel, list[str], Report | None]:
    """The construction, aimed at ``deployment`` when one is given (:func:`workflow.check.build_for`):
    (model, notes on the targets tried, the deployed pass's report of the model if it ran)."""
    if deployment is None:
        return model(taskset, epsilon, beta, gamma), [], None
    built, attempts = build_for(taskset, deployment, epsilon=epsilon, beta=beta, gamma=gamma, executor=executor)
    verified = attempts[-1].get("report")
    if len(attempts) == 1:
        return built, [], verified
    tried = "; ".join(f"target {a['target']:.3g}: beta={a['beta']}, gamma={a['gamma']}, worst {a['worst_error']:.3g}"
                      for a in attempts)
    return built, [f"built for {deployment.fmt.name}: the construction's target error was tightened until the "
                   f"{deployment.fmt.name} certificate held ({tried})"], verified


def margins(taskset: TaskSet, built: SymbolicModel, deployment: Deployment,
            verified: Report | None = None) -> list[dict]:
    """Worst error and margin ε − worst of the built weights, exact and in ``deployment``
    (``verified``: the deployed report build_for already has)."""
    weights = built.instantiate()
    out = []
    for dep in (None, deployment):
        rep = verified if dep is not None and verified is not None else verify(taskset, weights, built.epsilon,
                                                                                deployment=dep)
        out.append({"precision": "exact" if dep is None else dep.fmt.name, "worst_error": rep.measured_worst,
                    "margin": built.epsilon - rep.measured_worst, "certified": rep.certified,
                    "failing": failing_checks(rep)})
    return out


@dataclass(frozen=True)
class Built:
    """What ``build`` wrote: the model, the notes on its parameters, and (for a deployment)
    its margins exact and deployed."""
    model: SymbolicModel
    notes: list[str]
    margins: list[dict] | None

    @property
    def certified(self) -> bool:
        """Every certificate asked for holds (built for a precision with the parameters
        pinned, the weights are written as asked and checked)."""
        return all(m["certified"] for m in self.margins or ())


def build_file(taskset: TaskSet, output: str, precision: str = "exact", ulps: float | None = None,
               accumulate: str | None = None, epsilon: float | None = None, beta: float | None = None,
               gamma: float | None = None) -> Built:
    """``build``: the model (for the deployment of ``precision``, with its margins: see
    :func:`workflow.execution.deployment`) written to ``output`` (.npz)."""
    from workflow.execution import deployment as deployment_of

    deployment = deployment_of(precision, ulps, accumulate)
    built, notes, verified = model_for(taskset, deployment, epsilon, beta, gamma)
    found = margins(taskset, built, deployment, verified) if deployment is not None else None
    layout.save(built.instantiate(), output)
    return Built(built, notes, found)
