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


def plot(tasks_path: str, out: str, name: str, *, block: str | None = None, task: str | None = None,
         at: str | None = None, betas: Sequence[float] | None = None, epsilon: float | None = None,
         beta: float | None = None, gamma: float | None = None, quiet: bool = True,
         weights: str | None = None) -> list[str]:
    """``python -m verifier plot``: build the model of the tasks file and write into ``out``
    (created if missing) the pictures of :func:`plot_all`, or with ``block`` a heat map per
    block selected (:func:`plot_blocks`), or with ``weights`` (an .npz) those of
    :func:`plot_weights`; return their paths."""
    from tasks.errors import TaskError
    from tasks.io import load_tasks

    require_matplotlib()
    if weights is not None:
        given = [flag for flag, value in (("--block", block), ("--task", task), ("--at", at), ("--betas", betas),
                                          ("--beta", beta), ("--gamma", gamma)) if value is not None]
        if given:
            raise TaskError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to --weights: "
                            "given weights have no construction parameters and no symbolic blocks",
                            fix="leave them out, or leave out --weights to plot the constructed model")
    taskset = load_tasks(tasks_path)
    _directory(out)
    if weights is not None:
        return plot_weights(taskset, weights, out, name, epsilon)
    from workflow.build import model as build

    model = build(taskset, epsilon, beta, gamma)
    if block is not None:
        return plot_blocks(model, out, name, block, task, at, tasks_path)
    if task is not None or at is not None:
        raise TaskError("--task and --at apply to --block", fix="add --block NAME (e.g. --block gate)")
    return plot_all(taskset, model, out, name, betas, quiet=quiet)


def plot_weights(taskset: TaskSet, path: str, out_dir: str, name: str, epsilon: float | None = None) -> list[str]:
    """Verify the weights at ``path`` (an .npz in the layout, e.g. a trained model) and write
    ``<name>_routing.png`` (which expert each task's queries reach) and ``<name>_widths.png``
    (each task's expert width against c(k)) into ``out_dir``; return their paths. (No
    bound-vs-β picture: given weights have no β.)"""
    import layout

    weights = layout.load(path)
    expert_tasks = weights.expert_tasks
    # the weights handed over, not kept here: verify lets them go once its pass has its tables
    report = verify(taskset, weights, epsilon or taskset.epsilon or 0.01, source=path)
    del weights
    label = (f"{name} ({os.path.basename(path)}): {len(taskset.tasks)} tasks, {taskset.n_facts} facts, "
             f"{report.queries} queries, {'certified' if report.certified else 'not certified'}")
    return [save_png(plot_routing(report, expert_tasks, label), os.path.join(out_dir, f"{name}_routing.png")),
            save_png(plot_widths(report, label, parts=False), os.path.join(out_dir, f"{name}_widths.png"))]


def _directory(out: str) -> None:
    """``out`` made a directory if it is not one yet (TaskError: it is a file, or cannot be made)."""
    from tasks.errors import TaskError

    where = os.path.abspath(out)
    if os.path.exists(where) and not os.path.isdir(where):
        raise TaskError("is not a directory", file=out, fix="give a directory for the pictures")
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as exc:
        raise TaskError(f"cannot create the output directory: {exc.strerror or exc}", file=out) from None


def plot_blocks(model: SymbolicModel, out: str, name: str, block: str, task: str | None = None,
                at: str | None = None, tasks_path: str = "the tasks file") -> list[str]:
    """One heat map per block selected as inspect selects them (:func:`workflow.inspect.listings`):
    ``<name>_<block>.png`` (':' and '.' become '_')."""
    import re

    from construction.listing import grid
    from verifier.checks.plots import plot_block
    from workflow.inspect import listings

    paths = []
    for listing in listings(model, block, task, at, tasks_path):
        stem = re.sub(r"[^A-Za-z0-9_-]+", "_", listing.block.name)
        path = os.path.join(out, f"{name}_{stem}.png")
        paths.append(save_png(plot_block(grid(listing, model.values), title=name), path))
    return paths
