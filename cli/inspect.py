"""``inspect``: the construction shown without verifying it (:func:`workflow.inspect.inspect`)."""

from __future__ import annotations

import argparse
import json
import sys

from cli.common import block_flags, inputs, load, model_flags, settle, write_text
from tasks.console import EXIT_BAD_INPUT, EXIT_OK, add_json, add_quiet
from tasks.errors import TaskError

#: Where ``--help`` lists the command (:data:`cli.main.COMMANDS`).
ORDER = 2
HELP = "expert sizes against the bound, parameters, closed-form bound; --block: the symbolic weights"
DESCRIPTION = ("Show the construction without verifying it. With --block, list a block's symbolic "
               "weights as 'row label <- column label : expression in beta, gamma'. For a task "
               "set the construction refuses: why (what is proven), and the smallest edits of "
               "the tasks file that make it constructible, each checked (exit status 2).")


def arguments(i: argparse.ArgumentParser) -> None:
    model_flags(i)
    add_json(i, "the same")
    add_quiet(i)
    block_flags(i)
    i.add_argument("--all", action="store_true", help="with --block: every entry, not one line per pattern")
    i.add_argument("--format", choices=("text", "markdown", "latex", "json"), default="text",
                   help="with --block: output format (default text)")


def run(args) -> int:
    from workflow import inspect as W

    settle()
    from workflow import layers as WL

    layers, _ = WL.layers_of_file(args.tasks, args.layers)
    if layers == 2:
        return _inspect_two_layers(args)
    taskset = load(args, routable=False)      # a set nobody could route is explained, not just refused
    inspection = W.inspect(taskset, args.epsilon, args.beta, args.gamma)
    if inspection.refusal is not None:
        return _refused(args, inspection)
    model = inspection.model
    if args.block is None and (args.task is not None or args.at is not None or args.all or args.format != "text"):
        raise TaskError("--task, --at, --all and --format apply to --block", fix="add --block NAME (e.g. --block gate)")
    if args.block is not None:
        listings = W.listings(model, args.block, args.task, args.at, args.tasks)
        if args.json:
            write_text(args.json, W.render_listings(listings, "json", all_entries=args.all), inputs(args))
        if args.json != "-":
            print(W.render_listings(listings, args.format, all_entries=args.all))
        return EXIT_OK
    data = W.inspect_data(model)
    if args.json:
        write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), inputs(args))
        if args.json == "-":
            return EXIT_OK
    print(f"L = {data['L']}, |V| = {data['vocabulary']}, residual width d = {data['residual_width']}, "
          f"gate: {data['gate']}")
    print(f"parameters: beta = {data['parameters']['beta']}, gamma = {data['parameters']['gamma']}, "
          f"epsilon = {data['epsilon']}")
    print(f"closed-form bound: eps(beta, gamma) = {data['closed_form']}")
    proven = ("proven upper bound" if data["bound_proven"] else
              f"NOT a proven bound: {'; '.join(data['unproven_conditions'])}")
    print(f"  at these parameters: {data['bound']:.6g} ({proven}); leak delta = {data['conditions']['delta']:.3g} "
          f"(gate needs < {data['conditions']['delta_max_gate']:.3g}); subject-head leak e^-beta = "
          f"{data['conditions']['delta_subject']:.3g} (needs < 1/2)")
    name_w = max(4, *(len(e["task"]) for e in data["experts"]))
    print(f"{'task'.ljust(name_w)}  |T|  N_k  template  dictionary  width  bound L|T|+N_k  parameters")
    for e in data["experts"]:
        print(f"{e['task'].ljust(name_w)}  {e['templates']:>3}  {e['facts']:>3}  {e['template_neurons']:>8}  "
              f"{e['dictionary_neurons']:>10}  {e['width']:>5}  {e['bound']:>5}  "
              f"{'ok  ' if e['width'] <= e['bound'] else 'OVER'}  {e['parameters']:>10,}")
    for e in data["experts"]:
        if "compose" in e:
            first, second = e["compose"]
            print(f"{e['task']} composes {first} then {second}: its {e['facts']:,} facts are derived, and the "
                  f"one-layer model stores each again ({e['dictionary_neurons']:,} dictionary neurons)")
    c = data["parameter_counts"]
    print(f"parameters (stored entries): {c['total']:,} in total, {c['shared']:,} shared, {c['active_per_query']:,} "
          f"active per query; {c['facts_per_parameter']:.3g} facts per parameter; dense shapes would hold "
          f"{c['dense_total']:,}")
    return EXIT_OK


def _refused(args, inspection) -> int:
    """A refused set: the refusal, what it proves, the smallest checked changes (exit 2)."""
    refusal = inspection.refusal
    if args.json:
        write_text(args.json, json.dumps(inspection.refusal_json(), indent=2, ensure_ascii=False), inputs(args))
    if args.json != "-":
        print(f"not constructible ({refusal.kind}): {refusal.error}")
        print(f"proven: {refusal.proven}")
        if inspection.changes:
            print("smallest changes that make it constructible (each checked by running the "
                  "construction on the edited set):")
            for n, steps in enumerate(inspection.steps, start=1):
                print(f"  {n}. {steps[0]}" if len(steps) == 1 else f"  {n}. these {len(steps)} edits together:")
                for step in steps[1:] if len(steps) == 1 else steps:
                    print(f"       - {step}")
        else:
            print("no single edit of the templates or facts it names makes it constructible")
    print(f"error: {refusal.error}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _inspect_two_layers(args) -> int:
    """``inspect`` of the two-layer model: per task its neurons in each layer against one layer."""
    from workflow import layers as WL

    if args.block is not None:
        raise TaskError("--block lists the one-layer model's symbolic weights; the two-layer model has no listing yet",
                        fix="add --layers 1 to list the one-layer model's blocks")
    data = WL.inspect_data(load(args), args.epsilon, args.beta, args.gamma)
    if args.json:
        write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), inputs(args))
        if args.json == "-":
            return EXIT_OK
    print("\n".join(WL.inspect_text(data)))
    return EXIT_OK
