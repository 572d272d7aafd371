"""What every command of the command line shares: the flags several take, the reading of the
tasks file, the writing of outputs (never over an input) and the start of the work (:func:`settle`)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Sequence

from layout.formats import FORMATS
from tasks.console import epsilon as _epsilon
from tasks.console import positive
from tasks.errors import TaskError
from tasks.files import write_text_atomic

#: what --precision accepts: the exact pass, or a floating-point format of :mod:`layout.formats`
PRECISIONS = ("exact", *FORMATS)


def settle() -> None:
    """A command has loaded its modules: freeze what the loading made and collect cycles again.

    ``python -m verifier`` turns Python's cyclic garbage collector off before anything is
    imported (``verifier/__main__.py``): sympy and scipy (and numba, where the kernels
    run just in time) make up to a million long-lived objects as they load, and each full
    collection on the way would scan them all again (up to a fifth of a second at 100k
    facts). Each command calls this once its modules are in: ``gc.freeze`` moves every object alive now to a generation
    that is never scanned, and the collector is on again, with its usual thresholds, for what the
    work makes (forked workers inherit the frozen heap untouched). Nothing computed
    depends on it; the cycles made while loading (few) stay. Called with the collector
    on (a program or a test calling :func:`cli.main.main`), it does nothing."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def model_flags(sp: argparse.ArgumentParser) -> None:
    """The tasks file and the construction's parameters (the commands that build a model)."""
    sp.add_argument("tasks", help="the tasks.yaml file")
    sp.add_argument("--epsilon", type=_epsilon, help="target error (default: the file's, else 0.01)")
    sp.add_argument("--beta", type=positive, help="attention inverse temperature (default: computed)")
    sp.add_argument("--gamma", type=positive, help="logit scale (default: computed)")
    sp.add_argument("--layers", type=int, choices=(1, 2), default=None,
                    help="the model's layers: 2 composes stored facts (the default for a task set with a composed "
                         "task), 1 stores every composed fact (docs/two-hops.md)")


def block_flags(sp: argparse.ArgumentParser, what: str = "list this block's symbolic weights") -> None:
    sp.add_argument("--block", metavar="NAME", help=f"{what}: E, P, U, a head (structure1, ..., subject) or one of its "
                    "W_Q/W_K/W_V/W_O (structure1.W_Q), gate (W_G, b_G), expert:TASK (W_1, b_1, W_2), a matrix name "
                    "across groups (W_Q, W_1), or all")
    sp.add_argument("--task", metavar="NAME", help="with --block: only this task's expert and gate row")
    sp.add_argument("--at", metavar="beta=B,gamma=G", help="with --block: substitute these values (exact; a "
                    "parameter left out takes the model's); default: symbols")


def count(text: str) -> int:
    """A whole number >= 1 (argparse type): 0 and a negative number get the same message
    (a negative one once said '>= 0', as if 0 were accepted)."""
    return _at_least(text, 1)


def whole(text: str) -> int:
    """A whole number >= 0 (argparse type)."""
    return _at_least(text, 0)


def _at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {value}")
    return value


def write_text(path: str, text: str, inputs: Sequence[str]) -> None:
    """Write atomically; never overwrite an input file."""
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    write_text_atomic(output_path(path, inputs), text + "\n")


def output_path(path: str, inputs: Sequence[str]) -> str:
    """The absolute path of an output file, refused (TaskError) if it is an input, or where no
    file can be written (empty, a directory, no such directory: tasks.files.check_target)."""
    from tasks.files import check_target

    target = os.path.abspath(path) if path else ""
    for src in inputs:
        if target and src and os.path.exists(src) and os.path.abspath(src) == target:
            raise TaskError("refusing to overwrite an input file", file=path, fix="choose another output path")
    return check_target(path)


def load(args, routable: bool = True):
    """The task set of ``args.tasks``."""
    from tasks.io import load_tasks

    return load_tasks(args.tasks, routable=routable)


def inputs(args) -> list[str]:
    """Every file this run reads: never to be overwritten by an output."""
    from tasks.io import input_files

    return input_files(args.tasks) + ([args.weights] if getattr(args, "weights", None) else [])


def picture_name(tasks: str) -> str:
    """The name pictures and reports of a tasks file go by: the file's stem, or its directory's
    for ``tasks.yaml``."""
    stem = os.path.splitext(os.path.basename(tasks))[0]
    parent = os.path.basename(os.path.dirname(os.path.abspath(tasks)))
    return parent if stem == "tasks" and parent else stem
