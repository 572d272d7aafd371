"""The picture of ``python -m verifier accessible --plot FILE.png``: accessible length against m.

Drawn from an :class:`verifier.accessibility.accessible.Analysis` (this module computes nothing): for
each prompt length m, the longest certified accessible sequence from token prompts and
from soft prompts, the soft prompts' n50 (hollow where the positions cap it), the
positions' cap n_positions − m, and the paper's bound lines C·m and C_aniso·m. The
lengths span a few tokens and the bound thousands, so the y axis is linear up to 10 and
logarithmic above (symlog). matplotlib is the ``plots`` extra, imported lazily
(:func:`tasks.console.require_matplotlib`).
"""

from __future__ import annotations

import math

from verifier.accessibility.accessible import Analysis
from tasks.console import require_matplotlib


def plot_accessibility(analysis: Analysis, title: str = ""):
    """The figure (see the module docstring)."""
    plt = require_matplotlib()
    w = analysis.weights
    ms = list(range(1, w.n_positions))
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    ax.plot(ms, [w.n_positions - m for m in ms], "--", color="0.5", label="positions' cap n_positions - m")
    tok = analysis.tokens
    tok_longest = [max((n for n, c in enumerate(lv.distinct, 1) if c), default=0) for lv in tok.levels]
    ax.plot([lv.m for lv in tok.levels], tok_longest, "o-", color="tab:blue", ms=10, mfc="none",
            label="token prompts: longest certified")
    soft = analysis.soft
    if soft is not None:
        lv = soft.levels
        ax.plot([x.m for x in lv], [x.longest for x in lv], "s-", color="tab:green",
                label="soft prompts: longest certified")
        full = [x for x in lv if not x.capped]
        capped = [x for x in lv if x.capped]
        ax.plot([x.m for x in full], [x.n50 for x in full], "D", color="tab:red",
                label="soft prompts: n50 (random targets)")
        if capped:
            ax.plot([x.m for x in capped], [x.n50 for x in capped], "D", mfc="none", color="tab:red",
                    label="n50 capped by the positions (lower bound)")
        b = soft.bound
        ax.plot(ms, [b.C * m for m in ms], "-", color="tab:purple", label=f"paper's bound C·m (C = {b.C:.3g})")
        ax.plot(ms, [b.C_aniso * m for m in ms], ":", color="tab:purple",
                label=f"anisotropic C·m (C = {b.C_aniso:.3g})")
    ax.set_yscale("symlog", linthresh=10, linscale=3)
    top = max([w.n_positions] + ([soft.bound.C * ms[-1]] if soft is not None else []))
    ax.set_yticks(list(range(w.n_positions + 1)) + [10.0 ** k for k in range(1, int(math.log10(max(top, 10))) + 2)])
    ax.set_xticks(ms)
    ax.set_xlabel("prompt length m (vectors after BOS)")
    ax.set_ylabel("accessible sequence length n (tokens)")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylim(bottom=0)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
