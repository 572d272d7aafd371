"""Evidence benchmark: what the construction's modularity evidence costs at scale.

    python benchmarks/evidence.py                          # -> benchmarks/RESULTS.md, block "evidence"
    python benchmarks/evidence.py --facts 2000 --out /tmp/r.md   # quick

For each size a generated set (``tasks.synthetic.wikidata_like``) is built once; then
:func:`construction.evidence.isolation` runs ``--runs`` times in this process, serially
(one core): every expert rebuilt from its task alone, and the model rebuilt without each
of the chosen tasks (all tasks up to 12, else 12 spread evenly; 4 beyond 200k facts),
each rebuilt expert compared with the full model's by labelled weights. Columns: the
median wall time, and the two parts of the last run (the single-task rebuilds, the
leave-one-out rebuilds). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, write_block  # noqa: E402


def measure(facts: int, runs: int, seed: int = 0) -> dict:
    """Time the isolation evidence of a generated set of ``facts`` facts."""
    from construction import evidence as ev
    from construction.model import build
    from tasks.synthetic import wikidata_like

    ts = wikidata_like(facts, seed=seed)
    model = build(ts)
    times, parts = [], {}
    for _ in range(runs):
        spent = {"alone": 0.0, "leave-one-out": 0.0}

        def timed_map(fn, shared, items):
            for item in items:
                t = time.perf_counter()
                out = fn(shared, item)
                spent["leave-one-out"] += time.perf_counter() - t
                yield item, out

        t = time.perf_counter()
        isolated, notes = ev.isolation(ts, model, timed_map)
        total = time.perf_counter() - t
        spent["alone"] = total - spent["leave-one-out"]
        times.append(total)
        parts = spent
    chosen = ev.leave_one_out_tasks(len(ts.tasks), ts.n_facts) if len(ts.tasks) > 1 else []
    return {"facts": ts.n_facts, "tasks": len(ts.tasks), "removed": len(chosen), "times": times,
            "median": statistics.median(times), "parts": parts, "isolated": sum(isolated)}


def block(rows: list[dict], command: str) -> str:
    out = ["## Modularity evidence", "",
           f"Machine: {machine()}. Command: `{command}`.", "",
           "| facts | tasks | leave-one-out rebuilds | median wall (s) | runs (s) | single-task rebuilds, last run (s) "
           "| leave-one-out rebuilds, last run (s) | experts isolated |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['facts']:,} | {r['tasks']} | {r['removed']} | {r['median']:.2f} | "
                   f"{', '.join(f'{x:.2f}' for x in r['times'])} | {r['parts']['alone']:.2f} | "
                   f"{r['parts']['leave-one-out']:.2f} | {r['isolated']} of {r['tasks']} |")
    out += ["", "One process, serial (the `check` command runs the leave-one-out rebuilds on its worker "
            "processes); generation and the construction itself are not timed."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--facts", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/RESULTS.md)")
    args = p.parse_args(argv)
    rows = [measure(f, args.runs) for f in args.facts]
    command = "python benchmarks/evidence.py" + ("" if args.facts == [100_000, 1_000_000] else
                                                 " --facts " + " ".join(map(str, args.facts))) \
        + ("" if args.runs == 3 else f" --runs {args.runs}")
    text = block(rows, command)
    print(text)
    if args.out is not None:
        write_block("evidence", text, args.out)
    else:
        write_block("evidence", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
