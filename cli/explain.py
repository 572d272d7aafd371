"""``explain``: one prefix traced through the model (:func:`workflow.explain.explain`)."""

from __future__ import annotations

import argparse
import json

from cli.common import inputs, load, model_flags, settle, write_text
from tasks.console import EXIT_OK, add_json, add_quiet

#: Where ``--help`` lists the command (:data:`cli.main.COMMANDS`).
ORDER = 7
HELP = "trace one prefix through the model"
DESCRIPTION = "Show one query's attention, gate, neurons and next tokens."


def arguments(e: argparse.ArgumentParser) -> None:
    model_flags(e)
    e.add_argument("prefix", help="the prefix, e.g. \"the capital of France is\" (split into tokens; see --sep)")
    e.add_argument("--sep", metavar="SEP", help="the prefix is its tokens joined by SEP, e.g. --sep '|' "
                                                "\"the | capital | of | the capital | is\" (for entities "
                                                "holding template words)")
    e.add_argument("--weights", help="use these weights instead of building")
    add_json(e, "the trace")
    add_quiet(e)


def run(args) -> int:
    from workflow import explain as W

    settle()
    from workflow.layers import refuse_two_layers

    refuse_two_layers("explain", args.tasks, args.layers, getattr(args, "weights", None))
    taskset = load(args)
    prefix = args.prefix.split(args.sep) if args.sep else args.prefix
    info = W.explain(taskset, prefix, args.weights, args.epsilon, args.beta, args.gamma)
    if args.json:
        write_text(args.json, json.dumps(info, indent=2, ensure_ascii=False), inputs(args))
        if args.json == "-":
            return EXIT_OK
    print(W.render(info))
    return EXIT_OK
