"""Build and verify: the verifier's report with the construction's evidence attached.

The verifier (:mod:`verifier`) certifies weights without knowing how they were made;
the construction (:mod:`construction`) knows its closed-form bound and can rebuild each
expert to check isolation. This module is the one place where both meet.
"""

from __future__ import annotations

import time
from typing import Callable

from construction.evidence import evidence
from construction.model import SymbolicModel
from layout import Weights
from tasks.model import TaskSet
from verifier.floating import Deployment
from verifier.parallel import Executor, LocalPool
from verifier.verify import Report, verify


def check_built(taskset: TaskSet, model: SymbolicModel, *, weights: Weights | None = None, isolation: bool = True,
                jobs: int = 1, progress: Callable[[int, int], None] | None = None, source: str = "weights",
                executor: Executor | None = None, deployment: Deployment | None = None) -> Report:
    """Verify the model's weights and attach the closed form and (``isolation``) the
    rebuild-without-each-task check; ``report.seconds`` covers both. Both run their work
    units on ``executor`` (default: ``jobs`` local processes).

    The construction's evidence is gathered first, so that the symbolic model can be
    released before the verification (at scale it is the larger part of memory; the
    numeric weights share its coefficient-1 matrices).
    """
    start = time.perf_counter()
    weights = weights if weights is not None else model.instantiate()
    epsilon = model.epsilon
    executor = executor if executor is not None else LocalPool(jobs)
    ev = evidence(taskset, model, check_isolation=isolation, map_fn=executor.map)
    del model
    report = verify(taskset, weights, epsilon, source=source, progress=progress, executor=executor,
                    deployment=deployment)
    notes = list(ev.notes)
    if deployment is not None:
        notes.append(f"the closed-form bound is the exact model's; the measured errors are of every execution in "
                     f"{deployment.fmt.name}")
    report.attach(ev.closed_form, ev.bound, ev.gate, ev.isolated, notes)
    report.seconds = time.perf_counter() - start
    return report
