"""``python -m verifier accessible``: which sequences the model can be made to generate, each with a proof.

Token prompts are enumerated exhaustively, soft prompts (free input vectors) are found by
a search the caller hands in and certified on a box around them; the counting and the
proofs are :mod:`verifier.accessibility.accessible`, the report
:mod:`verifier.accessibility.report`. :func:`accessibility` runs both on given
weights or on the model built; :func:`report_json` and :func:`save_plot` write what it
found.

The search is a parameter, not an import: the command line hands in the gradient search of
:mod:`training.cramming` (torch), a package that itself builds on this layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from layout import Weights
from tasks.console import progress_bar
from tasks.errors import TaskError
from tasks.model import TaskSet
from verifier.accessibility import accessible as A
from verifier.accessibility.accessible import Analysis
from verifier.accessibility.report import render  # noqa: F401  (the analysis as accessible prints it)
from verifier.checks.plots import require_matplotlib  # noqa: F401  (before the work, when a picture is asked for)
from verifier.checks.verify import fitting
from verifier.passes import boxes


@dataclass(frozen=True)
class Prompts:
    """The prompts searched: token prompts of 1..``token_m`` tokens (None: the longest
    within ``max_prompts``); soft prompts of the lengths ``soft_m`` (None: every length the
    positions allow), ``targets`` random targets per (m, n), ``restarts`` searches per
    target, ``objects`` unreached objects searched with one soft vector, all drawn with
    ``seed``, certified on the box X ± ``prompt_epsilon``/2."""
    token_m: int | None = None
    max_prompts: int = 300_000
    soft_m: tuple[int, ...] | None = None
    targets: int = 8
    restarts: int = 1
    objects: int = 32
    seed: int = 0
    prompt_epsilon: float = 2.0 ** -10


def accessibility(taskset: TaskSet, prompts: Prompts = Prompts(), *, search: Callable[[Weights], Any] | None = None,
                  weights: str | None = None, epsilon: float | None = None, beta: float | None = None,
                  gamma: float | None = None, quiet: bool = True) -> Analysis:
    """The certified accessibility of the weights in the file ``weights`` (else of the model
    built for ``taskset``) within ``prompts``: token prompts, and soft prompts proposed by
    ``search(weights)`` (a proposer, :func:`verifier.accessibility.accessible.soft_accessibility`;
    None: token prompts only)."""
    import layout

    if weights:
        found = layout.load(weights)
    else:
        from workflow.build import model

        found = model(taskset, epsilon, beta, gamma).instantiate()
    fitting(taskset, found, weights or "weights")
    m, why = A.choose_m(found, prompts.max_prompts, prompts.token_m)
    soft_m = sorted(set(prompts.soft_m or range(1, found.n_positions)))
    if soft_m and soft_m[-1] >= found.n_positions:
        raise TaskError(f"--soft-m {soft_m[-1]} leaves no position to generate into: the model has "
                        f"{found.n_positions} positions", fix=f"choose prompt lengths 1..{found.n_positions - 1}")
    propose = None if search is None else search(found)
    model_boxes = boxes.prepare(found)
    bar = progress_bar(quiet, "token prompts", "prompts", total=sum(A.prompt_counts(len(found.vocab), m)))
    tokens = A.token_accessibility(model_boxes, taskset, m, why, None if bar is None else bar.update)
    if bar is not None:
        bar.close()
    soft = None
    if propose is not None:
        bar = progress_bar(quiet, "soft prompts", "searches")
        soft = A.soft_accessibility(model_boxes, tokens, propose, soft_m, prompts.targets, prompts.restarts,
                                    prompts.seed, prompts.prompt_epsilon, prompts.objects,
                                    None if bar is None else bar.update)
        if bar is not None:
            bar.close()
    return Analysis(found, tokens, soft, A.facts_with_soft(tokens.facts, soft, found.vocab))


def report_json(analysis: Analysis, tasks: str, weights: str | None = None) -> dict:
    """The report (every accessible sequence with its proof), naming its sources: the tasks
    file, the weights file (or "built") and the weights' sha256."""
    from layout.digest import weights_digest
    from verifier.accessibility.report import report_json as as_json

    source = {"tasks": tasks, "weights": weights or "built", "weights_sha256": weights_digest(analysis.weights)}
    return as_json(analysis, source)


def save_plot(analysis: Analysis, name: str, path: str) -> str:
    """Draw accessible length against m, with the bound, to ``path`` (PNG)."""
    from verifier.accessibility.plots import plot_accessibility
    from verifier.checks.plots import save_png

    return save_png(plot_accessibility(analysis, name), path)
