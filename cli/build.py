"""``build``: the weights written out (:func:`workflow.build.build_file`)."""

from __future__ import annotations

import argparse
import json

from cli.common import PRECISIONS, inputs, load, model_flags, output_path, settle, write_text
from tasks.console import EXIT_NOT_CERTIFIED, EXIT_OK, add_json, add_quiet, positive

#: Where ``--help`` lists the command (:data:`cli.main.COMMANDS`).
ORDER = 3
HELP = "export the weights"
DESCRIPTION = "Build the model and write its weights (.npz, documented layout)."


def arguments(b: argparse.ArgumentParser) -> None:
    model_flags(b)
    b.add_argument("-o", "--output", required=True, help="output .npz file")
    b.add_argument("--precision", choices=PRECISIONS, default="exact",
                   help="choose the parameters so that the certificate holds for every execution in this format "
                        "(docs/precision.md); prints the margin left at exact and at this precision")
    b.add_argument("--ulps", type=positive, default=None, metavar="K",
                   help="with --precision: assume exp and division accurate to K ulps (default 4)")
    b.add_argument("--accumulate", choices=("float32", "float64"), default=None,
                   help="with --precision: sums, exp and division in this wider format (mixed precision)")
    add_json(b, "a summary (experts, widths, parameters)")
    add_quiet(b)


def run(args) -> int:
    from workflow import build as W

    settle()
    from workflow import layers as WL

    layers, taskset = WL.layers_of_file(args.tasks, args.layers)
    out = output_path(args.output, inputs(args))            # refused before the build (and again at the write)
    if layers == 2:
        built = WL.build_file(taskset, out, args.epsilon, args.beta, args.gamma, precision=args.precision,
                              ulps=args.ulps, accumulate=args.accumulate)
        stack = built.instantiate()
        if args.json:
            data = {"output": args.output, "layers": 2,
                    "experts": [len(stack.first.experts), len(stack.second.experts)],
                    "widths": [[e.width for e in stack.first.experts], [e.width for e in stack.second.experts]],
                    "beta": str(built.beta), "gamma": str(built.gamma), "epsilon": built.epsilon}
            write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), inputs(args) + [args.output])
        if not args.quiet and args.json != "-":
            w1, w2 = [e.width for e in stack.first.experts], [e.width for e in stack.second.experts]
            print(f"wrote {args.output}: two layers, {len(w1)} + {len(w2)} experts, widths {w1} + {w2}, "
                  f"beta = {built.beta}, gamma = {built.gamma}")
        return EXIT_OK
    taskset = taskset if taskset is not None else load(args)
    built = W.build_file(taskset, out, args.precision, args.ulps, args.accumulate, args.epsilon, args.beta, args.gamma)
    model, notes, margins = built.model, built.notes, built.margins
    if args.json:
        data = {"output": args.output, "experts": len(model.experts), "widths": list(model.widths),
                "beta": str(model.beta), "gamma": str(model.gamma), "epsilon": model.epsilon,
                "precision": args.precision, "margins": margins, "notes": notes}
        write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), inputs(args) + [args.output])
    if not args.quiet and args.json != "-":
        print(f"wrote {args.output}: {len(model.experts)} experts, widths {list(model.widths)}, beta = {model.beta}, "
              f"gamma = {model.gamma}")
        for note in notes:
            print(f"note: {note}")
        for m in margins or []:
            print(f"{m['precision']}: worst error {m['worst_error']:.6g}, margin {m['margin']:.3g} below epsilon = "
                  f"{model.epsilon:g}" + ("" if m["certified"] else f" (NOT certified: failing {m['failing']})"))
    # built for a precision with the parameters pinned, the weights are written as asked and
    # checked: exit 1 when a certificate does not hold (check --precision shows why, query by query)
    return EXIT_OK if built.certified else EXIT_NOT_CERTIFIED
