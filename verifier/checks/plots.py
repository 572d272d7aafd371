"""Pictures of a verified model (``python -m verifier plot``), as PNG files.

Three figures, drawn from numbers given to them (this module computes nothing; the
library layer, :mod:`workflow.plots`, gathers the numbers):

* :func:`plot_routing`: the task x expert routing matrix (``Report.routing_matrix``),
  each row normalised: the share of a task's task-determined queries that each expert
  receives (the paper's Figure 2 view). A certified model shows the identity.
* :func:`plot_widths`: each expert's width (template neurons + dictionary neurons)
  against the theorem's bound c(k) = L·|T(k)| + N_k.
* :func:`plot_bound_vs_beta`: the closed-form bound ε(β, γ) and the measured worst
  error (upper end of the certified enclosure) for a range of β at the model's γ, with
  ε marked; β where the theorem's side conditions fail is shaded (there the closed form
  is not a proven bound).

matplotlib is an optional extra (``pip install -e .[plots]``): it is imported lazily,
with the non-interactive Agg backend, and :func:`tasks.console.require_matplotlib` turns
its absence into a one-line bad-input error. Every file is written atomically (a
temporary file beside the target, then :func:`os.replace`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np

from tasks.console import require_matplotlib
from tasks.files import atomic_file


def save_png(fig, path: str) -> str:
    """Write ``fig`` to ``path`` as PNG: a temporary file in the same directory, then a rename."""
    plt = require_matplotlib()
    try:
        with atomic_file(path) as f:
            fig.savefig(f, format="png", dpi=130, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _tick_font(n: int) -> float:
    return 10 if n <= 12 else 8 if n <= 30 else 6 if n <= 60 else 4


def _thin(n: int, limit: int = 60) -> int:
    """Label every s-th row/column so that at most ``limit`` labels are drawn."""
    return max(1, math.ceil(n / limit))


def plot_routing(report, expert_tasks: Sequence[str], title: str = ""):
    """Heatmap: rows tasks, columns experts, cells the share of the task's determined queries."""
    plt = require_matplotlib()
    counts = np.asarray(report.routing_matrix, dtype=float)
    K, E = counts.shape
    totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    names = [r.name for r in report.tasks]
    cols = [f"{k}: {t}" if t else f"{k}: (none)" for k, t in enumerate(expert_tasks)]
    side = min(16.0, max(4.5, 0.45 * max(K, E) + 2.5))
    fig, ax = plt.subplots(figsize=(side + 1.5, side))
    im = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    step_r, step_c = _thin(K), _thin(E)
    ax.set_yticks(range(0, K, step_r))
    ax.set_yticklabels([f"{names[i]} ({int(totals[i, 0])})" for i in range(0, K, step_r)], fontsize=_tick_font(K))
    ax.set_xticks(range(0, E, step_c))
    ax.set_xticklabels([cols[i] for i in range(0, E, step_c)], fontsize=_tick_font(E), rotation=45 if E > 3 else 0,
                       ha="right" if E > 3 else "center")
    ax.set_xlabel("expert (index: task it serves)")
    ax.set_ylabel("task (number of task-determined queries)")
    if K * E <= 400:
        for i in range(K):
            for j in range(E):
                if counts[i, j] or expert_tasks[j] == names[i]:
                    v = share[i, j]
                    ax.text(j, i, f"{100 * v:.0f}%" if v in (0.0, 1.0) else f"{100 * v:.1f}%", ha="center", va="center",
                            fontsize=max(5, _tick_font(max(K, E)) - 1), color="white" if v > 0.6 else "black")
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    cb.set_label("share of the task's determined queries")
    own = sum(counts[i, j] for i in range(K) for j in range(E) if expert_tasks[j] == names[i])
    off = int(counts.sum() - own)
    ax.set_title((title + "\n" if title else "") +
                 f"routing of task-determined queries; {off} reach another task's expert", fontsize=11)
    return fig


def plot_widths(report, title: str = "", parts: bool = True):
    """Bars: expert width against the bound c(k) per task; with ``parts`` (a constructed
    model) split into its dictionary neurons (one per fact) and template neurons, which
    given weights (a trained model) do not have."""
    plt = require_matplotlib()
    recs = report.tasks
    K = len(recs)
    x = np.arange(K)
    width = np.array([r.width if r.width is not None else 0 for r in recs], float)
    bound = np.array([r.bound for r in recs], float)
    facts = np.array([min(r.facts, r.width or 0) for r in recs], float)
    fig, ax = plt.subplots(figsize=(min(18.0, max(6.0, 0.55 * K + 3)), 4.8))
    bw = 0.38
    if parts:
        ax.bar(x - bw / 2, facts, bw, color="#9ecae1", label="width: dictionary neurons (one per fact, N_k)")
        ax.bar(x - bw / 2, width - facts, bw, bottom=facts, color="#3182bd", label="width: template neurons")
    else:
        ax.bar(x - bw / 2, width, bw, color="#3182bd", label="width: neurons of the task's expert")
    ax.bar(x + bw / 2, bound, bw, color="#fdae6b", label="bound c(k) = L·|T(k)| + N_k")
    log = bound.max() / max(1.0, bound.min()) > 50
    if log:
        ax.set_yscale("log")
        ax.set_ylim(max(0.5, 0.5 * min(bound.min(), facts[facts > 0].min() if (facts > 0).any() else 1)),
                    bound.max() * 3)
    else:
        ax.set_ylim(0, bound.max() * (1.25 if K <= 12 else 1.15))
    if K <= 30:
        for i, r in enumerate(recs):
            ok = r.width is not None and r.width <= r.bound
            ax.text(x[i], max(width[i], bound[i]) * (1.25 if log else 1.02),
                    (f"{int(width[i])} ≤ {int(bound[i])}" if ok else f"{int(width[i])} > {int(bound[i])} OVER")
                    + (f"\n{int(facts[i])} + {int(width[i] - facts[i])}" if K <= 12 and parts else ""), ha="center",
                    va="bottom",
                    fontsize=_tick_font(K), color="black" if ok else "red")
    step = _thin(K)
    ax.set_xticks(x[::step])
    ax.set_xticklabels([recs[i].name for i in range(0, K, step)], rotation=45 if K > 6 else 0,
                       ha="right" if K > 6 else "center", fontsize=_tick_font(K))
    ax.set_ylabel("neurons")
    n_ok = sum(1 for r in recs if r.width is not None and r.width <= r.bound)
    ax.set_title((title + "\n" if title else "") + f"expert width against the bound c(k): {n_ok} of {K} within",
                 fontsize=11)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18 if K > 6 else -0.1), ncol=3, frameon=False)
    return fig


@dataclass
class BetaPoint:
    beta: Fraction
    bound: float           # proven upper bound on ε(β, γ) (closed form)
    measured: float        # upper end of the worst certified error enclosure
    certified: bool        # every check passed at this β
    conditions_hold: bool  # the theorem's side conditions (so the closed form is a proven bound)


def plot_bound_vs_beta(points: Sequence[BetaPoint], epsilon: float, gamma: Fraction, chosen_beta: Fraction,
                       title: str = ""):
    """Closed-form bound and measured worst error against β (log y), ε marked."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    b = np.array([float(p.beta) for p in points])
    ax.plot(b, [p.bound for p in points], "-", color="#e6550d", lw=7, alpha=0.35, solid_capstyle="round",
            label="closed-form bound ε(β, γ)")
    ok = np.array([p.certified for p in points])
    meas = np.array([max(p.measured, 1e-300) for p in points])
    ax.plot(b, meas, "-", color="#3182bd", lw=1, alpha=0.8)
    ax.plot(b[ok], meas[ok], "o", color="#3182bd", ms=6, label="measured worst error (certified)")
    if (~ok).any():
        ax.plot(b[~ok], meas[~ok], "o", mfc="white", mec="#3182bd", ms=6, label="measured worst error (not certified)")
    ax.axhline(epsilon, color="black", ls="--", lw=1)
    ax.annotate(f"ε = {epsilon:g}", xy=(b.max(), epsilon), xytext=(0, 4), textcoords="offset points",
                ha="right", va="bottom", fontsize=9)
    ax.axvline(float(chosen_beta), color="grey", ls=":", lw=1)
    ax.annotate(f"chosen β = {chosen_beta}", xy=(float(chosen_beta), 0.5), xycoords=("data", "axes fraction"),
                xytext=(-3, 0), textcoords="offset points", fontsize=9, color="grey", rotation=90,
                ha="right", va="center")
    bad = [float(p.beta) for p in points if not p.conditions_hold]
    if bad:
        ax.axvspan(b.min() - 0.5, max(bad) + 0.5, color="#dddddd", alpha=0.6, lw=0,
                   label="side conditions fail: bound not proven")
    ax.set_yscale("log")
    ax.set_xlabel("β (attention inverse temperature)")
    ax.set_ylabel("worst next-token error 1 − P(valid)")
    ax.set_xlim(b.min() - 0.5, b.max() + 0.5)
    ax.set_title((title + "\n" if title else "") + f"error bound and measured error against β at γ = {gamma} "
                 f"(= {float(gamma):g})", fontsize=11)
    at = [p for p in points if p.beta == chosen_beta]
    if at:
        ax.text(0.98, 0.97, f"at the chosen β: bound {at[0].bound:.4g}, measured {at[0].measured:.4g}",
                transform=ax.transAxes, ha="right", va="top", fontsize=8,
                bbox=dict(boxstyle="round", fc="white", ec="#cccccc"))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    return fig


def plot_block(grid, title: str = ""):
    """Heat map of one weight block (a :class:`construction.listing.Grid`): its nonzero rows
    and columns with their labels, the label blocks (``pos``, ``slot2``, ``subj``, …) marked
    by lines and named on the axes; values in a diverging colour scale centred on 0."""
    plt = require_matplotlib()
    v = np.asarray(grid.values, float)
    R, C = v.shape
    w = min(22.0, max(5.0, 0.22 * C + 3.5))
    h = min(22.0, max(3.0, 0.22 * R + 2.5))
    fig, ax = plt.subplots(figsize=(w, h))
    top = float(np.abs(v).max()) if v.size else 1.0
    im = ax.imshow(v if v.size else np.zeros((1, 1)), cmap="RdBu_r", vmin=-top or -1, vmax=top or 1,
                   aspect="auto", interpolation="nearest")
    for axis, n, labels, spans in (("y", R, grid.row_labels, grid.row_spans),
                                   ("x", C, grid.col_labels, grid.col_spans)):
        step = _thin(n, 80)
        ticks = list(range(0, n, step))
        text = [labels[i] for i in ticks]
        if axis == "y":
            ax.set_yticks(ticks)
            ax.set_yticklabels(text, fontsize=_tick_font(len(ticks)))
        else:
            ax.set_xticks(ticks)
            ax.set_xticklabels(text, fontsize=_tick_font(len(ticks)), rotation=90)
        for start, stop, name in spans:
            if start > 0:
                (ax.axhline if axis == "y" else ax.axvline)(start - 0.5, color="black", lw=0.6, alpha=0.6)
            mid = (start + stop - 1) / 2
            if axis == "x":
                ax.annotate(name, xy=(mid, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                            textcoords="offset points", ha="center", va="bottom", fontsize=7, color="#444444")
            else:
                ax.annotate(name, xy=(1.0, mid), xycoords=("axes fraction", "data"), xytext=(3, 0),
                            textcoords="offset points", ha="left", va="center", fontsize=7, color="#444444")
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.08)
    cb.set_label(f"weight at {grid.at}")
    note = " (binned: each cell the largest-magnitude weight it covers)" if grid.binned else ""
    ax.set_title((title + "\n" if title else "") + f"{grid.name}: nonzero rows × nonzero columns{note}",
                 fontsize=10, pad=18)
    return fig
