"""``export``: the certified model written as an ONNX graph (:func:`workflow.export.export`)."""

from __future__ import annotations

import argparse
import json

from cli.common import inputs, load, model_flags, output_path, settle, write_text
from tasks.console import EXIT_OK, add_json, add_quiet, positive

#: Where ``--help`` lists the command (:data:`cli.main.COMMANDS`).
ORDER = 4
HELP = "write the certified model as an ONNX graph (float32)"
DESCRIPTION = ("Write the forward pass as an ONNX graph in float32 (needs the onnx extra): the "
               "model 'check --precision float32' builds and certifies (the same rebuild rule), "
               "or with --precision exact the one plain 'check' certifies, or the weights of a "
               "saved --certificate, or --weights. The graph's metadata names the weights "
               "(weights_sha256, as check's report gives it) and the precision they were "
               "certified for. Inputs and outputs: docs/precision.md, 'ONNX export'.")


def arguments(x: argparse.ArgumentParser) -> None:
    model_flags(x)
    x.add_argument("--weights", help="export these weights (an .npz in the documented layout) instead of building; "
                                     "they must fit the task set, as check requires")
    x.add_argument("--certificate", metavar="DIR", help="export the weights of the certificate in DIR (it must be a "
                                                        "certified one of this task set)")
    x.add_argument("--precision", choices=("float32", "exact"), default=None,
                   help="when building: the precision the model is built and certified for (default float32, "
                        "the graph's; exact: the model plain 'check' certifies)")
    x.add_argument("--ulps", type=positive, default=None, metavar="K",
                   help="with --precision float32: assume exp and division accurate to K ulps (default 4), as check")
    x.add_argument("--onnx", required=True, metavar="FILE", help="output .onnx file")
    add_json(x, "a summary (inputs, outputs, size)")
    add_quiet(x)


def run(args) -> int:
    from workflow.export import export

    settle()
    from workflow.layers import refuse_two_layers

    refuse_two_layers("export", args.tasks, args.layers, getattr(args, "weights", None))
    taskset = load(args)
    out = output_path(args.onnx, inputs(args))              # refused before the build (and again at the write)
    done = export(taskset, out, weights=args.weights, certificate=args.certificate, precision=args.precision,
                  ulps=args.ulps, epsilon=args.epsilon, beta=args.beta, gamma=args.gamma)
    meta, notes = done.metadata, done.notes
    if args.json:
        data = {"output": args.onnx, "bytes": done.bytes, "inputs": {"tokens": ["N", "T", "int64"]},
                "outputs": {"probs": ["N", done.vocabulary, "float32"], "expert": ["N", "int64"],
                            "gate": ["N", done.experts, "float32"]}, "metadata": meta, "notes": notes}
        write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), inputs(args) + [args.onnx])
    if not args.quiet and args.json != "-":
        print(f"wrote {args.onnx}: {done.bytes / 1e6:.1f} MB, float32; input tokens (N, T) int64 without BOS; "
              f"outputs probs (N, {done.vocabulary}), expert (N,), gate (N, {done.experts})")
        print(f"weights: sha256 {meta['weights_sha256']}; {meta['certified']}")
        for note in notes:
            print(f"note: {note}")
    return EXIT_OK
