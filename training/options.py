"""The command-line flags the training commands share (``training.train``, ``training.sweep``).

Both describe the same model and optimiser, so the flags are declared once here, with
the defaults of :class:`training.loop.TrainConfig`; both parsers follow the project's
conventions (:mod:`tasks.console`: one-line errors, exit status 2).
"""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` names every option's default: ``(default X)`` is added to the help of an
    option that takes a value unless its text already says what its default is (the word
    "default"); a flag (``store_true``) is off unless given, and a required option has
    none: they get nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.required or action.nargs == 0
                or action.default is argparse.SUPPRESS or "default" in text):
            return text
        shown = action.default
        if shown is None:
            shown = "none"
        elif isinstance(shown, (list, tuple)):
            shown = " ".join(map(str, shown))
        shown = str(shown).replace("%", "%%")      # argparse %-formats the help text
        return f"{text} (default {shown})".lstrip()


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
    p.add_argument("--batch-size", type=int, default=defaults.batch_size,
                   help="queries per step, the next chunk of a walk through shuffled epochs (default: every "
                        "query, full batch)")


def model_changes(args: argparse.Namespace) -> dict:
    """The TrainConfig fields set by :func:`add_model_flags`."""
    return {"d": args.d, "n_heads": args.heads, "d_head": args.d_head, "expert_width": args.width,
            "steps": args.steps, "lr": args.lr, "alpha": args.alpha, "lam": args.lam,
            "batch_size": args.batch_size}


def add_recipe_flags(p: argparse.ArgumentParser, defaults) -> None:
    """The localize recipe's flags and the expert widths; ``defaults`` is a TrainConfig."""
    p.add_argument("--expert-widths", choices=("auto", "uniform", "bound"), default=defaults.expert_widths,
                   help="uniform: every expert --width neurons; bound: expert k min(--width, c(k)), the "
                        "verifier's size bound; auto (default): bound with localize, uniform otherwise")
    p.add_argument("--route-margin", type=float, default=defaults.route_margin,
                   help="localize: gate margin of the consistent experts over the others")
    p.add_argument("--ablation-margin", type=float, default=defaults.ablation_margin,
                   help="localize: ablated logit of another token above the object's")
    p.add_argument("--attention-spread", type=spread, default=defaults.attention_spread,
                   help=f"localize: per head, every visible attention score within this many nats of the largest "
                        f"(a hinge; 'none': no such term; default {defaults.attention_spread})")


def recipe_changes(args: argparse.Namespace) -> dict:
    """The TrainConfig fields set by :func:`add_recipe_flags`."""
    return {"expert_widths": args.expert_widths, "route_margin": args.route_margin,
            "ablation_margin": args.ablation_margin, "attention_spread": args.attention_spread}


def _whole(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {minimum} or more, got {value}")
    return value


def count(text: str) -> int:
    """A whole number >= 0 (rounds)."""
    return _whole(text, 0)


def steps(text: str) -> int:
    """A whole number >= 1 (steps)."""
    return _whole(text, 1)


def _positive(text: str, unit: str, other: str = "") -> float:
    """A finite number > 0 (of ``unit``; ``other``: what else the option takes, for the message)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of {unit}{other}, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of {unit}, got {text}")
    return value


def spread(text: str) -> float | None:
    """A positive number of nats, or 'none'."""
    if text.strip().lower() == "none":
        return None
    return _positive(text, "nats", " or 'none'")


def seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    return _positive(text, "seconds")
