"""Warming a cluster worker up: what its first unit would otherwise spend inside the run.

A fresh Dask worker process has imported none of the project and loaded none of the
verifier's compiled kernels (numba loads each from its on-disk cache on its first call, in
each process anew); the first unit it runs pays for both, while the client waits on it.
:func:`warm_up` certifies a tiny generated task set in the worker, inline, in the
deployment's format (exact arithmetic when none is given): every module and kernel the
certified pass in that format and the construction's evidence use is then loaded (a test
runs other task sets after it and finds no kernel left to load). The command line
hands it to :func:`verifier.running.cluster.connect`, which submits it to each worker as
the client connects, so that it runs while the client builds the model. It decides
nothing: its result is never read.
"""

from __future__ import annotations

from construction.model import build
from tasks.synthetic import wikidata_like
from verifier.passes.floating import Deployment
from verifier.running.parallel import LocalPool
from verifier.checks.verify import verify

#: facts of the tiny task set (one task): enough to reach every kernel of the pass
FACTS = 20


def warm_up(deployment: Deployment | None = None) -> None:
    """Certify a tiny task set here, inline (see the module docstring)."""
    taskset = wikidata_like(FACTS, seed=0)
    model = build(taskset)
    weights = model.instantiate()
    verify(taskset, weights, model.epsilon, executor=LocalPool(1), deployment=deployment)
