"""Command-line conventions shared by every tool of the project.

The verifier's commands (:mod:`cli.main`), the training scripts and the benchmark and
mutation scripts follow the same rules:

* exit status 0: success (or certified), 1: verified and not certified, 2: bad input,
  reported as one line on stderr (``file:line: problem; fix``), never a traceback; 3: an
  internal error (a bug), one line too, so that a crash is never read as a verdict;
* :class:`Parser`: argparse whose usage errors are such one-line bad input;
* flag types that refuse what cannot be meant (ε outside (0, 1), non-positive numbers);
* progress bars (tqdm) on stderr, only when stderr is a terminal and ``--quiet`` is
  not given, so piped and logged runs stay clean;
* pictures through :func:`require_matplotlib`: matplotlib is an optional extra, and its
  absence is one line of bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
from fractions import Fraction
from typing import Callable

EXIT_OK, EXIT_NOT_CERTIFIED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: bad arguments are bad input like any other (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"error: {self.prog}: {message} (see --help)\n")


def epsilon(text: str) -> float:
    """A target error: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"epsilon must be a number such as 0.01, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"epsilon must be between 0 and 1 (exclusive), got {value:g}")
    return value


def positive(text: str) -> float:
    """A finite number > 0, written as a decimal or as a fraction such as ``273/16`` (the form
    in which reports print β and γ; a dyadic fraction is read exactly)."""
    try:
        value = float(Fraction(text.strip())) if "/" in text else float(text)
    except (ValueError, ZeroDivisionError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value:g}")
    return value


def jobs(text: str) -> int:
    """A number of worker processes: a whole number, 0 (one per CPU) or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (one per CPU) or more processes, got {value}")
    return value


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def add_json(p: argparse.ArgumentParser, what: str = "the report") -> None:
    p.add_argument("--json", metavar="PATH", help=f"write {what} as JSON to PATH ('-' for stdout)")


def progress_bar(quiet: bool, desc: str, unit: str = "it", total: int | None = None):
    """A tqdm bar on stderr, or None when quiet or when stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr, leave=True, dynamic_ncols=True)


def counter(quiet: bool, desc: str, unit: str = "it") -> Callable[[int, int], None] | None:
    """A ``progress(done, total)`` callback drawing a tqdm bar (``total < 0`` closes it)."""
    bar = progress_bar(quiet, desc, unit)
    if bar is None:
        return None

    def update(done: int, total: int) -> None:
        if total < 0:
            bar.update(done - bar.n)
            bar.total = bar.n
            bar.close()
            return
        if total and bar.total != total:
            bar.total = max(total, done)
        bar.update(done - bar.n)

    return update


#: What to install for pictures (matplotlib, the ``plots`` extra).
PLOTS_HINT = "install the plots extra: pip install -e .[plots]"


def require_matplotlib():
    """The pyplot module (Agg backend), or a TaskError saying how to install it."""
    from tasks.errors import TaskError

    try:
        import matplotlib
    except ImportError:
        raise TaskError("matplotlib is not installed", fix=PLOTS_HINT) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt
