"""``python -m verifier explain``: one prefix traced through the model (attention, gate,
neurons, next tokens), of given weights or of the model built (:mod:`verifier.checks.explain`)."""

from __future__ import annotations

from typing import Sequence

from tasks.model import TaskSet
from verifier.checks.explain import explain as trace
from verifier.checks.explain import render  # noqa: F401  (the trace as explain prints it)


def explain(taskset: TaskSet, prefix: str | Sequence[str], weights: str | None = None, epsilon: float | None = None,
            beta: float | None = None, gamma: float | None = None) -> dict:
    """The trace of ``prefix`` (a string split into tokens, or the tokens) through the
    weights in the file ``weights``, else through the model built for ``taskset``."""
    import layout

    if weights:
        loaded = layout.load(weights)
    else:
        from workflow.build import model

        loaded = model(taskset, epsilon, beta, gamma).instantiate()
    return trace(taskset, loaded, prefix)
