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
import time
from dataclasses import asdict
from typing import Sequence

from training.data import query_data
from training.loop import TrainConfig, evaluate, train
from training.objectives import OBJECTIVES


def parser() -> argparse.ArgumentParser:
    from tasks.console import Parser, add_json, add_quiet, epsilon
    from training.options import DefaultsFormatter, add_model_flags, add_recipe_flags, count, seconds, steps

    p = Parser(prog="python -m training.train", formatter_class=DefaultsFormatter, description=(
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
    p.add_argument("--seed", type=int, default=0, help="training seed (initial weights, minibatches)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own setting)")
    p.add_argument("--expert-tasks", choices=("none", "majority", "declared"),
                   help="expert_tasks written to the file: none ('' for every expert; the default except with "
                        "localize), majority (each expert: the task routed to it most), declared (expert i: task "
                        "i, the assignment the task-router and localize losses train; the default with localize)")
    p.add_argument("--until-certified", action="store_true",
                   help="counterexample rounds (needs --objective localize): after training, screen every query "
                        "on the float64 evaluation and, once all pass, run the verifier (its certified pass finds "
                        "the failing queries if it does not certify); raise the weights of the failing ones and "
                        "train again, until the verifier certifies the weights at --epsilon or the rounds or the "
                        "time budget are spent (exit 1 then; the last weights are written)")
    p.add_argument("--max-rounds", type=count, default=5, help="rounds after the first (default 5)")
    p.add_argument("--round-steps", type=steps, help="steps of each later round (default: half of --steps)")
    p.add_argument("--boost", type=float, default=4.0, help="weight factor of a failing query per round (default 4)")
    p.add_argument("--time-budget", type=seconds,
                   help="seconds of training in all rounds at most, shared out ahead (the first round 3/4, the "
                        "later ones equal parts of the rest); each round's learning-rate decay fits its share; the "
                        "checks between rounds are not counted (default: none, the steps alone end a round)")
    p.add_argument("--epsilon", type=epsilon, default=TrainConfig().epsilon,
                   help="the verifier's target error, for the localize recipe and the rounds (default 0.01)")
    add_json(p, "the evaluation")
    add_quiet(p)
    return p


def _round_line(r) -> str:
    sh = r.shares
    verdict = "certified" if r.certified else "verified, not certified" if r.verified else "not certified"
    return (f"round {r.round}: {r.steps} steps in {r.train_seconds:.1f}s, checks {r.check_seconds:.1f}s; certified "
            f"share {sh['certified']:.4f} (error {sh['error']:.4f}, routing {sh['routing']:.4f}, entanglement "
            f"{sh['entanglement']:.4f}, localization {sh['localization']:.4f}); {r.failing} failing queries; worst "
            f"ablated P(object) {r.worst_ablated_object_probability:.3g}; {verdict}")


#: Steps between two updates of a progress bar.
PROGRESS_EVERY = 10


class Progress:
    """Progress bars on stderr (:func:`tasks.console.progress_bar`: only on a terminal and
    without ``--quiet``): per round (one bar for a run without rounds), its steps done of
    its steps at most, the current loss and, under a time limit, the share of the round's
    time spent; while a round's checks run, "checking"; then its certified share.
    ``active`` is False where no bar would be drawn, and the trainer then logs nothing."""

    def __init__(self, quiet: bool, rounds: bool = True) -> None:
        self.active = not quiet and sys.stderr.isatty()     # as tasks.console.progress_bar decides
        self.rounds = rounds
        self.bar = None
        self.round: int | None = None
        self.shown: dict[str, str] = {}

    def step(self, entry: dict) -> None:
        """An entry of :func:`train`'s log (it names its round and the round's steps)."""
        if entry["round"] != self.round:
            self.close()
            self.round = entry["round"]
            if self.active:     # tasks.console.progress_bar's bar, with whole steps (no unit scaling: 30/30, not 30.0)
                from tqdm import tqdm

                self.bar = tqdm(total=entry["of"], desc=f"round {self.round}" if self.rounds else "training",
                                unit="step", file=sys.stderr, leave=True, dynamic_ncols=True)
        if self.bar is None:
            return
        self.bar.update(entry["step"] + 1 - self.bar.n)
        self.shown = {"loss": f"{entry['loss']:.4g}"}
        if entry.get("time_limit"):
            self.shown["time"] = f"{min(1.0, entry['seconds'] / entry['time_limit']):.0%}"
        self.bar.set_postfix(self.shown)

    def checking(self, round_no: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix({**self.shown, "checks": "running"})

    def checked(self, record) -> None:
        """A round's record: its certified share shown, its bar closed."""
        if self.bar is not None:
            self.bar.set_postfix({**self.shown, "certified": f"{record.shares['certified']:.4f}"})
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = None


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse (TaskError) an output path where no file can be written, or that is the tasks
    file, before the task set is read: a training run is not lost to a path it cannot write."""
    import os

    from tasks.errors import TaskError
    from tasks.files import check_target

    for flag, path in (("-o", args.output), ("--json", args.json)):
        if path is None or (flag == "--json" and path == "-"):
            continue
        target = check_target(path)
        if os.path.exists(args.tasks) and os.path.abspath(args.tasks) == target:
            raise TaskError(f"{flag} would overwrite the tasks file", file=path, fix="choose another output path")


def main(argv: Sequence[str] | None = None) -> int:
    from tasks.console import EXIT_BAD_INPUT, EXIT_NOT_CERTIFIED
    from tasks.errors import TaskError
    from tasks.files import write_text_atomic
    from tasks.io import load_tasks
    from training.export import to_weights
    from training.options import model_changes, recipe_changes
    import layout

    args = parser().parse_args(argv)
    start = time.perf_counter()
    if args.until_certified and args.objective != "localize":
        print("error: --until-certified trains toward the certificate; it needs --objective localize", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.boost >= 1:
        print(f"error: --boost must be at least 1, got {args.boost:g}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        _check_outputs(args)                # before any training: a path that cannot be written is refused now
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
    progress = Progress(args.quiet, rounds=args.until_certified)
    step_log = progress.step if progress.active else None
    if args.until_certified:
        from training.rounds import until_certified

        def log_round(r) -> None:
            progress.checked(r)
            if not args.quiet:
                print(_round_line(r), file=sys.stderr, flush=True)

        rounds = until_certified(taskset, config, max_rounds=args.max_rounds, round_steps=args.round_steps,
                                 boost=args.boost, time_budget=args.time_budget, data=data, log=log_round,
                                 step_log=step_log, step_every=PROGRESS_EVERY,
                                 checking=progress.checking if progress.active else None)
        model, ev, certified = rounds.model, rounds.evaluation, rounds.certified
        run = rounds.run_parameters()
        summary["rounds"] = [r.to_dict() for r in rounds.rounds]
        summary["certified"] = certified
    else:
        result = train(taskset, config, data=data, log=step_log, log_every=PROGRESS_EVERY if step_log else 0)
        progress.close()
        model = result.model
        run = {"rounds": 1, "total_steps": result.steps, "train_seconds": round(result.seconds, 2),
               "check_seconds": 0.0}
        ev = evaluate(model, data)
    weights = to_weights(model, taskset, expert_tasks=mapping, routing=ev.routing, config=config, extra=run)
    # trained floats are float32-exact: the same weights, smaller
    layout.save(weights, args.output, small_indices=True, narrow=True)
    steps, seconds, checks = run["total_steps"], run["train_seconds"], run["check_seconds"]
    summary = {**ev.summary(), "steps": steps, "seconds": seconds, "check_seconds": checks, **summary,
               "config": asdict(config), "expert_tasks": list(weights.expert_tasks),
               "expert_widths": [e.width for e in weights.experts], "routing_matrix": ev.routing.tolist()}
    line = (f"wrote {args.output}: {len(data)} queries, object-query accuracy {ev.object_accuracy:.3f}, "
            f"next-token accuracy {ev.next_token_accuracy:.3f}, routing purity {ev.purity:.3f}, "
            f"entropy {ev.entropy:.3f} bits")
    if "worst_ablated_object_probability" in summary:
        line += (f", worst ablated P(object) {summary['worst_ablated_object_probability']:.3g} (float64, "
                 f"{summary['localized_share']:.3f} of object queries localized)")
    if certified is not None:
        line += (f"; the verifier certifies it at epsilon {config.epsilon:g}" if certified else
                 f"; NOT certified at epsilon {config.epsilon:g} within the rounds' budget")
    wall = time.perf_counter() - start
    summary["wall_seconds"] = round(wall, 2)
    rounds_said = f" in {run['rounds']} round{'s' if run['rounds'] != 1 else ''}" if args.until_certified else ""
    line += (f"; {steps} steps{rounds_said}, training {seconds:.1f}s"
             + (f", checks {checks:.1f}s" if args.until_certified else "") + f", wall {wall:.1f}s")
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    else:
        if args.json:
            write_text_atomic(args.json, json.dumps(summary, indent=2) + "\n")
        print(line)
    return EXIT_NOT_CERTIFIED if certified is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
