"""``plot``: the routing, widths and bound-vs-beta pictures, or heat maps of blocks (:func:`workflow.plots.plot`)."""

from __future__ import annotations

import argparse
import json
import os

from cli.common import block_flags, inputs, model_flags, picture_name, settle, write_text
from tasks.console import EXIT_OK, add_json, add_quiet, positive
from tasks.errors import TaskError

#: Where ``--help`` lists the command (:data:`cli.main.COMMANDS`).
ORDER = 8
HELP = "draw routing, widths and bound-vs-beta pictures (PNG)"
DESCRIPTION = (
    "Build and verify the model, then write NAME_routing.png (task x expert routing), NAME_widths.png (expert "
    "width against c(k)) and NAME_bound_vs_beta.png (closed-form bound and measured worst error against beta at "
    "the model's gamma; each beta is a full verification); with --weights, the routing and widths pictures of "
    "those weights. Needs matplotlib: pip install -e .[plots]")


def arguments(pl: argparse.ArgumentParser) -> None:
    model_flags(pl)
    pl.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    pl.add_argument("--weights", metavar="NPZ", help="verify these weights (an .npz in the documented layout, e.g. a "
                    "trained model) instead of building, and draw NAME_routing.png and NAME_widths.png")
    block_flags(pl, "draw these blocks as heat maps (NAME_<block>.png) instead of verifying")
    pl.add_argument("--name", help="file name prefix, without path separators (default: the tasks file's name, or its "
                                   "directory's for tasks.yaml); the pictures are written in --out")
    pl.add_argument("--betas", type=positive, nargs="+", metavar="BETA",
                    help="beta values for the bound-vs-beta picture "
                         "(default: integers from the chosen beta - 4 to + 3)")
    add_json(pl, "the list of pictures written")
    add_quiet(pl)


def run(args) -> int:
    from workflow.plots import plot

    settle()
    _check_file_prefix(args.name)
    paths = plot(args.tasks, args.out, args.name or picture_name(args.tasks), block=args.block, task=args.task,
                 at=args.at, betas=args.betas, epsilon=args.epsilon, beta=args.beta, gamma=args.gamma,
                 quiet=args.quiet, weights=args.weights)
    if args.json:
        write_text(args.json, json.dumps({"pictures": paths}, indent=2, ensure_ascii=False), inputs(args))
    if args.json != "-":
        for path in paths:
            print(path)
    return EXIT_OK


def _check_file_prefix(name: str | None) -> None:
    """``plot --name``: a file name prefix, so that every picture is written in ``--out``
    (a separator would put them in another directory: ``../x`` outside ``--out``)."""
    if name is None:
        return
    held = [c for c in dict.fromkeys(("/", os.sep, os.altsep or "/", "\0")) if c in name]
    if held:
        shown = ", ".join("NUL" if c == "\0" else repr(c) for c in held)
        raise TaskError(f"--name {name!r} is not a file name prefix (it holds {shown}): the pictures would be "
                        f"written in another directory than --out",
                        fix="give a name without path separators, e.g. --name demo; --out chooses the directory")
