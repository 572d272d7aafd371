"""``accessible``: which sequences the model can be made to generate, with proofs
(:func:`workflow.accessibility.accessibility`)."""

from __future__ import annotations

import argparse
import functools
import json

from cli.common import count, inputs, load, model_flags, output_path, picture_name, settle, whole, write_text
from tasks.console import EXIT_NOT_CERTIFIED, EXIT_OK, add_json, add_quiet, positive
from tasks.errors import TaskError

#: Where ``--help`` lists the command (:data:`cli.main.COMMANDS`).
ORDER = 9
HELP = "which sequences can the model be made to generate? (certified accessibility)"
DESCRIPTION = ("Count, with proofs, the sequences the model generates greedily: every prompt of "
               "up to m tokens (exhaustive), and soft prompts (m free input vectors) found by "
               "gradient search and certified on the box X +- epsilon/2, beside the bound of "
               "'How Many Different Outputs Can a Transformer Generate?' (docs/accessibility.md). "
               "Exit status 0: every fact's object is certified accessible; 1: some is not "
               "(within these prompts and budgets; not a proof that none exists); 2: bad input.")


def arguments(ac: argparse.ArgumentParser) -> None:
    model_flags(ac)
    ac.add_argument("--weights", help="analyse these weights (an .npz in the documented layout) instead of building")
    ac.add_argument("--token-m", type=count, metavar="M", help="enumerate token prompts of 1..M tokens (default: the "
                    "longest within --max-prompts); refused, with the count, above --max-prompts")
    ac.add_argument("--max-prompts", type=count, default=300_000, metavar="N",
                    help="most token prompts enumerated (default 300000)")
    ac.add_argument("--no-soft", action="store_true", help="token prompts only (no search; needs no torch)")
    ac.add_argument("--soft-m", type=count, nargs="+", metavar="M",
                    help="soft prompt lengths (default: every m the positions allow)")
    ac.add_argument("--targets", type=count, default=8, metavar="N", help="random targets per (m, n) (default 8)")
    ac.add_argument("--restarts", type=count, default=1, metavar="R", help="search starts per target (default 1)")
    ac.add_argument("--steps", type=count, default=150, metavar="S", help="Adam steps per search (default 150)")
    ac.add_argument("--lr", type=positive, default=0.05, help="Adam learning rate (default 0.05)")
    ac.add_argument("--seconds", type=positive, default=None, metavar="S",
                    help="time limit per search, each (m, n) is one search (default: none, the steps decide)")
    ac.add_argument("--objects", type=whole, default=32, metavar="N",
                    help="objects no token prompt reaches searched with one soft vector (default 32, drawn with "
                         "the seed; 0: none)")
    ac.add_argument("--seed", type=whole, default=0, help="seed of the targets and of the search (default 0)")
    ac.add_argument("--prompt-epsilon", type=positive, default=2.0 ** -10, metavar="EPS",
                    help="the paper's precision: soft prompts are certified on X +- EPS/2 (default 2^-10 = "
                         "0.0009765625, absolute, as the paper's Table 1; a fraction such as 1/1024 is read exactly)")
    ac.add_argument("--plot", metavar="FILE.png",
                    help="draw accessible length against m, with the bound (needs matplotlib)")
    ac.add_argument("--list", type=whole, default=10, metavar="N", help="examples listed per list (default 10)")
    add_json(ac, "the report, every accessible sequence with its proof")
    add_quiet(ac)


def run(args) -> int:
    """Exit 0 iff every fact's object is certified accessible."""
    from workflow import accessibility as W

    settle()
    from workflow.layers import refuse_two_layers

    refuse_two_layers("accessible", args.tasks, args.layers, getattr(args, "weights", None))
    taskset = load(args)
    read = inputs(args)
    for path in (args.json, args.plot):
        if path and path != "-":
            output_path(path, read)                  # refused before the work (and again at the write)
    if args.plot:
        W.require_matplotlib()
    if args.no_soft and (args.soft_m or args.seconds):
        raise TaskError("--soft-m and --seconds set the soft-prompt search, which --no-soft turns off",
                        fix="drop --no-soft, or the soft-prompt flags")
    prompts = W.Prompts(token_m=args.token_m, max_prompts=args.max_prompts,
                        soft_m=tuple(args.soft_m) if args.soft_m else None, targets=args.targets,
                        restarts=args.restarts, objects=args.objects, seed=args.seed,
                        prompt_epsilon=args.prompt_epsilon)
    analysis = W.accessibility(taskset, prompts, search=None if args.no_soft else functools.partial(_search, args),
                               weights=args.weights, epsilon=args.epsilon, beta=args.beta, gamma=args.gamma,
                               quiet=args.quiet)
    name = picture_name(args.tasks)            # as plot names its pictures
    if args.plot:
        W.save_plot(analysis, name, output_path(args.plot, read))
    if args.json:
        write_text(args.json, json.dumps(W.report_json(analysis, args.tasks, args.weights), indent=1,
                                         ensure_ascii=False), read)
    if args.json != "-":
        print("\n".join(W.render(analysis, name, args.list)))
        if args.plot:
            print(f"wrote {args.plot}")
    return EXIT_OK if analysis.every_object else EXIT_NOT_CERTIFIED


def _search(args, weights):
    """The soft-prompt search for ``weights`` (:mod:`training.cramming`, torch: the train
    extra) with the flags' budget: the command line composes it into the workflow."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise TaskError("the soft-prompt search needs torch",
                        fix='pip install -e ".[train]", or pass --no-soft') from None
    from training.cramming import SearchBudget, proposer

    return proposer(weights, SearchBudget(steps=args.steps, lr=args.lr, seconds=args.seconds, seed=args.seed))
