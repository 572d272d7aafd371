"""Coverage: which well-posed task sets the construction builds and certifies.

For each public generator of well-posed sets (``tasks.strategies``), draw N examples
(hypothesis, derandomized: the same examples on every run) and record what ``check``
would conclude: certified; built but not certified; refused with a proof that no gate of
the construction's form exists; refused without one. Writes the block "coverage" of
``benchmarks/RESULTS.md``::

    python benchmarks/coverage.py                 # 500 examples per generator, about 2 minutes
    python benchmarks/coverage.py --examples 100

The one-token vocabulary (template ``⋆1 ⋆2`` with a fact x -> x) is counted apart: every
model predicts its single token with certainty, so no expert's removal can raise an
object query's error, and the entanglement check cannot pass for any model.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from benchmarks.results import machine, write_block  # noqa: E402
from workflow.check import check_built# noqa: E402
from construction.gate import RoutingError  # noqa: E402
from construction.model import build  # noqa: E402
from tasks.strategies import shared_template_task_sets, task_sets  # noqa: E402

GENERATORS = {
    "task_sets()": task_sets(),
    "task_sets(allow_structural_collisions=True)": task_sets(allow_structural_collisions=True),
    "shared_template_task_sets()": shared_template_task_sets(),
}
OUTCOMES = ("certified", "not certified", "one-token vocabulary", "refused, proven", "refused, not proven")


def outcome(ts) -> str:
    try:
        model = build(ts)
    except RoutingError as err:
        return "refused, proven" if getattr(err, "certificate", None) is not None else "refused, not proven"
    report = check_built(ts, model, weights=model.instantiate())
    if report.certified:
        return "certified"
    return "one-token vocabulary" if ts.vocabulary.size == 1 else "not certified"


def run(strategy, n: int) -> tuple[Counter, float]:
    counts: Counter = Counter()

    @settings(max_examples=n, phases=[Phase.generate], derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(ts) -> None:
        counts[outcome(ts)] += 1

    start = time.perf_counter()
    collect()
    return counts, time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=500, help="examples per generator (default 500)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows = []
    for name, strategy in GENERATORS.items():
        counts, seconds = run(strategy, args.examples)
        total = sum(counts.values())
        rows.append((name, total, counts, seconds))
        print(f"{name}: {dict(counts)} ({seconds:.0f} s)", file=sys.stderr)
    lines = ["## Coverage", "",
             f"`python benchmarks/coverage.py --examples {args.examples}` on {machine()}: per generator of well-posed "
             f"sets, the examples hypothesis draws (derandomized, so the same on every run) and what `check` "
             f"concludes.", "",
             "| generator | examples | " + " | ".join(OUTCOMES) + " | share certified | time |",
             "|---|---:|" + "---:|" * len(OUTCOMES) + "---:|---:|"]
    for name, total, counts, seconds in rows:
        cells = " | ".join(str(counts.get(o, 0)) for o in OUTCOMES)
        share = counts.get("certified", 0) / total if total else 0.0
        lines.append(f"| `{name}` | {total} | {cells} | {share:.1%} | {seconds:.0f} s |")
    all_total = sum(r[1] for r in rows)
    all_cert = sum(r[2].get("certified", 0) for r in rows)
    lines += ["", f"Overall {all_cert} of {all_total} certified ({all_cert / all_total:.1%})."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_block("coverage", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
