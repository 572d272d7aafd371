"""Figure-2-style heat maps: task x expert routing, one panel per model (needs matplotlib).

Each panel shows, per task (row), the share of its task-determined queries that each
expert (column) receives; experts are in their own index order (no reordering), so a
one-to-one routing shows as a permutation matrix, and as the diagonal when the task-router
loss fixed expert i <-> task i. matplotlib is imported lazily with the Agg backend
(``pip install -e ".[plots]"``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from verifier.checks.plots import save_png


def _pyplot():
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - depends on the environment
        raise RuntimeError("matplotlib is not installed: pip install -e \".[plots]\"") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def routing_panels(panels: Sequence[tuple[str, np.ndarray]], path: str, suptitle: str = "") -> str:
    """Write one PNG with a heat map per (title, tasks x experts count matrix)."""
    plt = _pyplot()
    n = len(panels)
    K = max(m.shape[0] for _, m in panels)
    side = 2.2 + 0.22 * K
    fig, axes = plt.subplots(1, n, figsize=(side * n + 1.0, side + 0.6), squeeze=False)
    im = None
    for ax, (title, counts) in zip(axes[0], panels):
        counts = np.asarray(counts, float)
        totals = counts.sum(axis=1, keepdims=True)
        share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
        im = ax.imshow(share, cmap="viridis", vmin=0.0, vmax=1.0, aspect="equal", interpolation="nearest")
        T, E = share.shape
        step = 1 if max(T, E) <= 8 else 2 if max(T, E) <= 16 else 4
        ax.set_xticks(range(0, E, step))
        ax.set_yticks(range(0, T, step))
        ax.tick_params(labelsize=7)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_ylabel("task", fontsize=8)
        ax.set_title(title, fontsize=9)
    if im is not None:
        cb = fig.colorbar(im, ax=list(axes[0]), fraction=0.025, pad=0.02)
        cb.set_label("share of the task's determined queries", fontsize=8)
        cb.ax.tick_params(labelsize=7)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    return save_png(fig, path)
