"""The pictures of ``python -m verifier plot``: verify, sweep β, draw.

The β sweep needs both sides: the construction's closed-form bound at each β
(:mod:`construction.bound`) and the verifier's measured worst error for the weights
instantiated at that β. The drawing itself is :mod:`verifier.checks.plots`.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from typing import Sequence

from workflow.check import check_built
from construction import bound
from construction.model import SymbolicModel, dyadic
from tasks.console import progress_bar
from tasks.model import TaskSet
from verifier.checks.plots import BetaPoint, plot_bound_vs_beta, plot_routing, plot_widths, require_matplotlib, save_png
from verifier.checks.verify import verify


def beta_sweep(taskset: TaskSet, model: SymbolicModel, betas: Sequence[float], quiet: bool = True,
               reports: dict | None = None) -> list[BetaPoint]:
    """Verify the model at each β (γ fixed at the model's) and evaluate the closed form."""
    L, V, gamma = taskset.L, taskset.vocabulary.size, model.gamma
    gate_max = model.gate.beta_condition()
    points = []
    todo = sorted({dyadic(b) for b in betas})
    bar = progress_bar(quiet, "beta sweep", "beta", total=len(todo))
    for b in todo:
        if reports is not None and b in reports:
            rep = reports[b]
        else:
            rep = verify(taskset, model.instantiate(beta=b), model.epsilon)
        points.append(BetaPoint(b, bound.bound_upper(L, V, b, gamma), rep.measured_worst, rep.certified,
                                not bound.unproven_conditions(L, b, gate_max)))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return points


def default_betas(chosen: Fraction, below: int = 4, above: int = 3) -> list[float]:
    """Integers around the chosen β (at least 1)."""
    c = int(math.floor(chosen))
    return [float(b) for b in range(max(1, c - below), c + above + 1)]


def plot_all(taskset: TaskSet, model: SymbolicModel, out_dir: str, name: str, betas: Sequence[float] | None = None,
             quiet: bool = True) -> list[str]:
    """Verify the model, sweep β, and write ``<name>_routing.png``, ``<name>_widths.png``,
    ``<name>_bound_vs_beta.png`` into ``out_dir``; return their paths."""
    require_matplotlib()
    weights = model.instantiate()
    report = check_built(taskset, model, weights=weights, isolation=False)
    betas = list(betas) if betas else default_betas(model.beta)
    points = beta_sweep(taskset, model, betas, quiet, reports={model.beta: report})
    label = f"{name}: {len(taskset.tasks)} tasks, {taskset.n_facts} facts, {report.queries} queries"
    paths = [
        save_png(plot_routing(report, weights.expert_tasks, label), os.path.join(out_dir, f"{name}_routing.png")),
        save_png(plot_widths(report, label), os.path.join(out_dir, f"{name}_widths.png")),
        save_png(plot_bound_vs_beta(points, model.epsilon, model.gamma, model.beta, label),
                 os.path.join(out_dir, f"{name}_bound_vs_beta.png")),
    ]
    return paths
