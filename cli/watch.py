"""``watch`` on the command line: the lines it prints for each check (the watcher itself is
:mod:`workflow.watching`)."""

from __future__ import annotations

import time

from workflow.watching import Outcome


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
