"""How and where a check runs: the floating-point deployment it certifies (or the exact pass)
and the executor of its work units (local processes, or a Dask cluster).

Light on purpose: verifying given weights (``check --weights``) goes through here without
loading the construction.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

from tasks.errors import TaskError
from verifier.passes.floating import DEFAULT_ULPS, Deployment
from verifier.running.parallel import Executor, LocalPool, before_forking
from verifier.running.runner import require_combination


def deployment(precision: str = "exact", ulps: float | None = None, accumulate: str | None = None) -> Deployment | None:
    """The floating-point deployment of ``precision`` (None: the exact pass), exp and
    division accurate to ``ulps`` (default :data:`~verifier.passes.floating.DEFAULT_ULPS`),
    sums in ``accumulate`` when given (a TaskError names the flag that does not fit)."""
    if precision == "exact":
        if ulps is not None or accumulate is not None:
            flag = "--ulps" if ulps is not None else "--accumulate"
            raise TaskError(f"{flag} needs a floating-point --precision", fix="add e.g. --precision float32")
        return None
    try:
        return Deployment.named(precision, ulps if ulps is not None else DEFAULT_ULPS, accumulate)
    except ValueError as exc:
        raise TaskError(f"--accumulate {accumulate}: {exc}",
                        fix="accumulate in a format wider than --precision (e.g. bfloat16 with float32)") from None


def require_allowed(deployment: Deployment | None, scheduler: str | None, classes: bool) -> None:
    """Refuse (TaskError) before any work what the verifier's table of combinations
    (:data:`verifier.running.runner.COMBINATIONS`) refuses: this pass, on a cluster or not,
    recording query classes or not."""
    require_combination("exact" if deployment is None else "float", "cluster" if scheduler else "local", classes)


@contextlib.contextmanager
def executor(jobs: int = 1, scheduler: str | None = None, cluster_timeout: float | None = None,
             deployment: Deployment | None = None) -> Iterator[Executor]:
    """Where the work units run: ``jobs`` local processes, or the Dask cluster at
    ``scheduler`` (its workers warmed up for ``deployment`` as the client connects:
    :mod:`workflow.warming`)."""
    if scheduler is None:
        if cluster_timeout is not None:
            raise TaskError("--cluster-timeout needs --scheduler", fix="drop it, or run on a cluster with --scheduler")
        before_forking(jobs)
        yield LocalPool(jobs)
        return
    if jobs != 1:
        raise TaskError("--jobs and --scheduler exclude each other",
                        fix="size the cluster instead (local:N, or its workers)")
    from verifier.running.cluster import NO_WORKER_TIMEOUT, connect
    from workflow.warming import warm_up

    timeout = cluster_timeout if cluster_timeout is not None else NO_WORKER_TIMEOUT
    with connect(scheduler, timeout, functools.partial(warm_up, deployment)) as pool:
        yield pool
