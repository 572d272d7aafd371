"""The training command line: train a single-layer MoE transformer on every query of a task
set (the loop: :mod:`training.loop`; counterexample rounds: :mod:`training.rounds`), export
it in the weight layout and print its evaluation.

CLI::

    python -m training.train TASKS.yaml -o trained.npz --objective router --expert-tasks majority
    python -m training.train TASKS.yaml -o trained.npz --objective localize --until-certified
    python -m verifier check TASKS.yaml --weights trained.npz
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Sequence

from training.data import query_data
from training.loop import TrainConfig, evaluate, train
from training.objectives import OBJECTIVES


def parser() -> argparse.ArgumentParser:
    from tasks.console import Parser, add_json, add_quiet, epsilon
    from training.options import add_model_flags, add_recipe_flags, count, seconds, steps

    p = Parser(prog="python -m training.train", description=(
        "Train a single-layer MoE transformer (the verifier's layout, gate_mode top1-scaled) on every "
        "query of a task set and export it for 'python -m verifier check TASKS --weights OUT'."))
    p.add_argument("tasks", help="the tasks.yaml file")
    p.add_argument("-o", "--output", required=True, help="output .npz (the weight layout)")
    p.add_argument("--objective", choices=OBJECTIVES, default="ce",
                   help="ce: cross-entropy; lb: + load balancing; router: + task-router loss; localize: the "
                        "recipe aimed at the verifier's certificate (routing on every prefix, ablation and error "
                        "hinges, experts sized to c(k)) (default ce)")
    p.add_argument("--experts", type=int, help="number of experts (default: one per task)")
    add_model_flags(p, TrainConfig())
    add_recipe_flags(p, TrainConfig())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--expert-tasks", choices=("none", "majority", "declared"),
                   help="expert_tasks written to the file: none ('' for every expert; the default except with "
                        "localize), majority (each expert: the task routed to it most), declared (expert i: task "
                        "i, the assignment the task-router and localize losses train; the default with localize)")
    p.add_argument("--until-certified", action="store_true",
                   help="counterexample rounds (needs --objective localize): after training, check every query "
                        "with the verifier's certified pass, raise the weights of the failing ones and train "
                        "again, until the verifier certifies the weights at --epsilon or the rounds or the time "
                        "budget are spent (exit 1 then; the last weights are written)")
    p.add_argument("--max-rounds", type=count, default=5, help="rounds after the first (default 5)")
    p.add_argument("--round-steps", type=steps, help="steps of each later round (default: half of --steps)")
    p.add_argument("--boost", type=float, default=4.0, help="weight factor of a failing query per round (default 4)")
    p.add_argument("--time-budget", type=seconds,
                   help="seconds of training in all rounds at most, shared out ahead (the first round 3/4, the "
                        "later ones equal parts of the rest); each round's learning-rate decay fits its share")
    p.add_argument("--epsilon", type=epsilon, default=TrainConfig().epsilon,
                   help="the verifier's target error, for the localize recipe and the rounds (default 0.01)")
    add_json(p, "the evaluation")
    add_quiet(p)
    return p


def _round_line(r) -> str:
    sh = r.shares
    verdict = "certified" if r.certified else "verified, not certified" if r.verified else "not certified"
    return (f"round {r.round}: {r.steps} steps in {r.train_seconds:.1f}s; certified share {sh['certified']:.4f} "
            f"(error {sh['error']:.4f}, routing {sh['routing']:.4f}, entanglement {sh['entanglement']:.4f}, "
            f"localization {sh['localization']:.4f}); {r.failing} failing queries; worst ablated P(object) "
            f"{r.worst_ablated_object_probability:.3g}; {verdict}")


def main(argv: Sequence[str] | None = None) -> int:
    from tasks.console import EXIT_BAD_INPUT, EXIT_NOT_CERTIFIED, progress_bar
    from tasks.errors import TaskError
    from tasks.io import load_tasks
    from training.export import to_weights
    from training.options import model_changes, recipe_changes
    import layout

    args = parser().parse_args(argv)
    if args.until_certified and args.objective != "localize":
        print("error: --until-certified trains toward the certificate; it needs --objective localize", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.boost >= 1:
        print(f"error: --boost must be at least 1, got {args.boost:g}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        taskset = load_tasks(args.tasks)
    except TaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        config = TrainConfig(objective=args.objective, n_experts=args.experts, seed=args.seed, threads=args.threads,
                             epsilon=args.epsilon, **model_changes(args), **recipe_changes(args))
        data = query_data(taskset)
        config.model_config(data)          # refuses sizes the objective cannot train, before any training
    except ValueError as exc:
        print(f"error: {args.tasks}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    mapping = args.expert_tasks or ("declared" if args.objective == "localize" else "none")
    summary: dict = {}
    certified = None
    if args.until_certified:
        from training.rounds import until_certified

        def log_round(r) -> None:
            if not args.quiet:
                print(_round_line(r), file=sys.stderr, flush=True)

        rounds = until_certified(taskset, config, max_rounds=args.max_rounds, round_steps=args.round_steps,
                                 boost=args.boost, time_budget=args.time_budget, data=data, log=log_round)
        model, ev, certified = rounds.model, rounds.evaluation, rounds.certified
        steps, seconds = rounds.steps, rounds.train_seconds
        summary["rounds"] = [r.to_dict() for r in rounds.rounds]
        summary["certified"] = certified
    else:
        bar = progress_bar(args.quiet, "training", "step", total=config.steps)

        def log(entry: dict) -> None:
            bar.update(entry["step"] + 1 - bar.n)
            bar.set_postfix(loss=f"{entry['loss']:.4f}", ce=f"{entry['ce']:.4f}")

        result = train(taskset, config, data=data, log=log if bar is not None else None)
        if bar is not None:
            bar.close()
        model, steps, seconds = result.model, result.steps, result.seconds
        ev = evaluate(model, data)
    weights = to_weights(model, taskset, expert_tasks=mapping, routing=ev.routing, config=config)
    layout.save(weights, args.output, small_indices=True, narrow=True)   # trained floats are float32-exact: the same weights, smaller
    summary = {**ev.summary(), "steps": steps, "seconds": round(seconds, 2), **summary,
               "config": asdict(config), "expert_tasks": list(weights.expert_tasks),
               "expert_widths": [e.width for e in weights.experts], "routing_matrix": ev.routing.tolist()}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    line = (f"wrote {args.output}: {len(data)} queries, object-query accuracy {ev.object_accuracy:.3f}, "
            f"next-token accuracy {ev.next_token_accuracy:.3f}, routing purity {ev.purity:.3f}, "
            f"entropy {ev.entropy:.3f} bits")
    if "worst_ablated_object_probability" in summary:
        line += (f", worst ablated P(object) {summary['worst_ablated_object_probability']:.3g} (float64, "
                 f"{summary['localized_share']:.3f} of object queries localized)")
    line += f", {steps} steps in {seconds:.1f}s"
    if certified is not None:
        line += (f"; the verifier certifies it at epsilon {config.epsilon:g}" if certified else
                 f"; NOT certified at epsilon {config.epsilon:g} within the rounds' budget")
    print(line)
    return EXIT_NOT_CERTIFIED if certified is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
