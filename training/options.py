"""The command-line flags the training commands share (``training.train``, ``training.sweep``).

Both describe the same model and optimiser, so the flags are declared once here, with
the defaults of :class:`training.train.TrainConfig`; both parsers follow the project's
conventions (:mod:`tasks.console`: one-line errors, exit status 2).
"""

from __future__ import annotations

import argparse


def add_model_flags(p: argparse.ArgumentParser, defaults) -> None:
    """Architecture and optimiser flags; ``defaults`` is a TrainConfig."""
    p.add_argument("--d", type=int, default=defaults.d, help="residual width")
    p.add_argument("--heads", type=int, default=defaults.n_heads, help="attention heads")
    p.add_argument("--d-head", type=int, default=defaults.d_head, help="query/key/value width per head")
    p.add_argument("--width", type=int, default=defaults.expert_width, help="neurons per expert")
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimiser steps")
    p.add_argument("--lr", type=float, default=defaults.lr, help="learning rate (Adam)")
    p.add_argument("--alpha", type=float, default=defaults.alpha, help="load-balancing weight")
    p.add_argument("--lam", type=float, default=defaults.lam, help="task-router weight")


def model_changes(args: argparse.Namespace) -> dict:
    """The TrainConfig fields set by :func:`add_model_flags`."""
    return {"d": args.d, "n_heads": args.heads, "d_head": args.d_head, "expert_width": args.width,
            "steps": args.steps, "lr": args.lr, "alpha": args.alpha, "lam": args.lam}
