"""``watch``: keep the certificate in memory and re-certify each edit as it is saved, and the
lines it prints for each check (the watcher itself is :mod:`workflow.watching`)."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from cli.common import inputs, output_path, settle, write_text
from tasks.console import EXIT_BAD_INPUT, EXIT_NOT_CERTIFIED, EXIT_OK, add_json, add_quiet
from tasks.console import jobs as _jobs
from tasks.console import positive
from tasks.errors import TaskError

if TYPE_CHECKING:
    from workflow.watching import Outcome

#: Where ``--help`` lists the command (:data:`cli.main.COMMANDS`).
ORDER = 6
HELP = "keep the certificate in memory and re-certify each edit as it is saved"
DESCRIPTION = ("Hold the certificate in DIR in memory (or make it with a full check when DIR "
               "holds none) and watch the tasks file and its facts files: after each change, "
               "re-certify as 'check --since DIR' does, print one line with the verdict, and "
               "save the new certificate to DIR. A watcher pays start-up and reading the "
               "certificate once (docs/editing.md). Stop it with Ctrl-C (exit status "
               "130); with --max-checks the exit status is the last check's (0 certified, 1 not "
               "certified, 2 bad input, or a certificate or --json report not saved).")


def arguments(w: argparse.ArgumentParser) -> None:
    w.add_argument("tasks", help="the tasks.yaml file")
    w.add_argument("--certificate", metavar="DIR", required=True,
                   help="the certificate directory to start from and to keep up to date")
    add_json(w, "each check's report (to a file: the latest, replaced atomically; '-': one JSON object per line)")
    add_quiet(w)
    w.add_argument("--no-isolation", action="store_true",
                   help="skip the rebuild-without-each-task check of edited tasks")
    w.add_argument("--jobs", type=_jobs, default=1, metavar="N",
                   help="worker processes (0: one per CPU); the result does not depend on it")
    w.add_argument("--interval", type=positive, default=0.1, metavar="SECONDS",
                   help="how often the files are looked at (default 0.1)")
    w.add_argument("--max-checks", type=int, default=None, metavar="N",
                   help="stop after N checks, the first included (default: until Ctrl-C)")


def run(args) -> int:
    from workflow import watching as W

    settle()
    if args.max_checks is not None and args.max_checks < 1:
        raise TaskError("--max-checks must be at least 1", fix="give a positive number, or leave it out")
    directory = args.certificate
    W.require_directory(args.tasks, directory)           # before the first check, and again at each save
    if args.json not in (None, "-"):
        output_path(args.json, inputs(args))          # refused before the first check, not after it
    watcher = W.watcher(args.tasks, directory, jobs=args.jobs, isolation=not args.no_isolation)
    if not args.quiet and args.json != "-":
        print(f"watching {args.tasks} and its facts files; certificate in {directory} (Ctrl-C stops)", flush=True)

    def emit(outcome) -> None:
        if args.json and outcome.report is not None:
            if args.json == "-":
                print(json.dumps(W.report_json(outcome.report), ensure_ascii=False), flush=True)
            else:
                try:       # a report that cannot be written is an error line; the certificate is still saved
                    write_text(args.json, W.dumps(outcome.report), inputs(args))
                except (TaskError, OSError) as exc:
                    outcome.report_error = W.one_line(exc)
        elif args.json == "-":
            print(json.dumps({"error": outcome.error}, ensure_ascii=False), flush=True)
        if args.json != "-":
            print(verdict_line(outcome, directory), flush=True)
        if outcome.report_error is not None:
            print(f"error: the JSON report was not written: {outcome.report_error}", flush=True)

    def saved(outcome) -> None:
        if outcome.save_error is not None:
            print(json.dumps({"error": saved_line(outcome, directory)}, ensure_ascii=False) if args.json == "-"
                  else saved_line(outcome, directory), flush=True)
        elif not args.quiet and args.json != "-":
            print(saved_line(outcome, directory), flush=True)

    last = W.watch(watcher, emit, saved=saved, interval=args.interval, max_checks=args.max_checks)   # Ctrl-C: 130
    if last is None or last.report is None or last.save_error is not None or last.report_error is not None:
        return EXIT_BAD_INPUT
    return EXIT_OK if last.report.certified else EXIT_NOT_CERTIFIED


def verdict_line(outcome: Outcome, directory: str) -> str:
    """One line per check: the time of day, what was checked, the verdict, the seconds to it."""
    stamp = time.strftime("%H:%M:%S")
    if outcome.report is None:
        return f"{stamp} error: {outcome.error}"
    r = outcome.report
    inc = r.incremental or {}
    verdict = f"{r.verdict.upper()} at epsilon = {r.epsilon}"
    failed = [t.name for t in r.tasks if not t.certified]
    if failed:
        verdict += f" (failing tasks: {', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''})"
    if not inc:
        what = f"full check of {len(r.tasks)} tasks"
    elif inc.get("mode") == "full":
        what = f"full check ({inc.get('reason')})"
    else:
        edited = (", ".join(outcome.edited[:5]) + (" ..." if len(outcome.edited) > 5 else "")) or "no task"
        what = (f"edited {edited}: {inc['queries_rerun']:,} queries run again, "
                f"{len(inc['tasks_reused'])} of {len(r.tasks)} tasks reused")
    return f"{stamp} {what}; {verdict} in {outcome.seconds:.2f} s"


def saved_line(outcome: Outcome, directory: str) -> str:
    """The line after the verdict's: where the certificate went (or why it did not)."""
    if outcome.save_error is not None:
        return f"error: the certificate was not saved: {outcome.save_error}"
    return f"  certificate saved to {directory} in {outcome.saved_seconds:.2f} s"
