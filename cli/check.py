"""``check``: build (or load) the model and verify it (:func:`workflow.checking.check`)."""

from __future__ import annotations

import argparse
import os
import sys

from cli.common import PRECISIONS, inputs, model_flags, settle, write_text
from tasks.console import EXIT_NOT_CERTIFIED, EXIT_OK, add_json, add_quiet, counter
from tasks.console import jobs as _jobs
from tasks.console import positive

#: Where ``--help`` lists the command (:data:`cli.main.COMMANDS`).
ORDER = 1
HELP = "build (or load) the model and verify it"
DESCRIPTION = "Build the model (or load --weights) and verify every query."


def arguments(c: argparse.ArgumentParser) -> None:
    model_flags(c)
    c.add_argument("--weights", help="verify these weights (an .npz in the documented layout) instead of building")
    add_json(c, "the JSON report")
    add_quiet(c)
    c.add_argument("--no-isolation", action="store_true", help="skip the rebuild-without-each-task modularity check")
    c.add_argument("--jobs", type=_jobs, default=1, metavar="N",
                   help="worker processes (0: one per CPU); the result does not depend on it")
    c.add_argument("--scheduler", metavar="ADDRESS", help="run the work on a Dask cluster instead: a scheduler address "
                   "(tcp://HOST:8786) or local:N for N local workers (needs the dask extra); the report is the same")
    c.add_argument("--cluster-timeout", type=positive, default=None, metavar="SECONDS",
                   help="with --scheduler: stop (exit status 2, no report) after this long with no work unit "
                        "completed while the scheduler has no running worker or does not answer (default 60)")
    c.add_argument("--precision", choices=PRECISIONS, default="exact",
                   help="what is certified: the exact forward pass (default), or every execution of the model "
                        "deployed in this floating-point format (weights rounded to it, any summation order, "
                        "with or without FMA; docs/precision.md)")
    c.add_argument("--ulps", type=positive, default=None, metavar="K",
                   help="with --precision: assume exp and division accurate to K units in the last place (default 4)")
    c.add_argument("--accumulate", choices=("float32", "float64"), default=None,
                   help="with --precision: sums, exp and division computed in this wider format, each result "
                        "rounded to the precision (mixed-precision bfloat16)")
    c.add_argument("--certificate", metavar="DIR",
                   help="also save the certificate (weights, task set, query classes) to DIR, so that an edit "
                        "can be re-certified with --since DIR (docs/editing.md); DIR is replaced, so it "
                        "must be new, empty, or an earlier certificate")
    c.add_argument("--since", metavar="DIR",
                   help="re-certify from the certificate in DIR: rebuild with its beta and gamma, run again only "
                        "the queries the edit can reach, reuse the rest (parameters the construction chose are "
                        "chosen anew, with a full check, when the edit goes beyond them); writes the updated "
                        "certificate back to DIR (or to --certificate)")


def run(args) -> int:
    from workflow import layers as WL

    layers, taskset = WL.layers_of_file(args.tasks, args.layers, args.weights)
    if layers == 2:
        return _run_two_layers(args, taskset)
    from workflow import checking as W

    if not args.weights:
        import workflow.build  # noqa: F401  (the construction and its evidence, sympy: not for weights given)
    settle()
    progress = counter(args.quiet, "verifying", "queries")
    report = W.check(args.tasks, weights=args.weights, epsilon=args.epsilon, beta=args.beta, gamma=args.gamma,
                     isolation=not args.no_isolation, jobs=args.jobs, scheduler=args.scheduler,
                     cluster_timeout=args.cluster_timeout, precision=args.precision, ulps=args.ulps,
                     accumulate=args.accumulate, certificate=args.certificate, since=args.since, progress=progress)
    if args.json:
        write_text(args.json, W.dumps(report), inputs(args))
    code = EXIT_OK if report.certified else EXIT_NOT_CERTIFIED
    if args.json != "-" and (args.certificate or args.since):
        print(W.summary(report))
    elif args.json != "-":
        try:
            print(W.summary(report))
            sys.stdout.flush()
        except BrokenPipeError:  # the reader stopped early; the verdict still decides the status
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


def _run_two_layers(args, taskset) -> int:
    """``check`` of a two-layer model (:mod:`workflow.layers`)."""
    from workflow import layers as WL

    settle()
    report = WL.check(taskset, weights=args.weights, epsilon=args.epsilon, beta=args.beta, gamma=args.gamma,
                      precision=args.precision, ulps=args.ulps, accumulate=args.accumulate, jobs=args.jobs,
                      scheduler=args.scheduler, cluster_timeout=args.cluster_timeout, certificate=args.certificate,
                      since=args.since)
    if args.json:
        write_text(args.json, WL.dumps(report), inputs(args))
    if args.json != "-":
        print(WL.summary(report))
    return EXIT_OK if report.certified else EXIT_NOT_CERTIFIED
