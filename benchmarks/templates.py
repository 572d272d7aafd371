"""Certification time against template length (a long sentence is ordinary text).

    python benchmarks/templates.py [--lengths 10 20 40 100 300] [--facts 10]

One task, one template of L words (⋆1 in the middle, ⋆2 last), ``--facts`` facts; each
length runs ``python -m verifier check`` in its own process and records the wall time,
the verification time (the report's ``seconds``), the queries and the peak memory. The
construction has L − 1 structure heads, and every query's residual holds about L·p leak
entries, so the work per sentence grows like L³ numbers; the verifier handles every
head and position of a batch in the same array operations, so the Python-level work
grows like L per sentence. Writes its block of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, write_block  # noqa: E402


def tasks_yaml(length: int, facts: int) -> str:
    words = [f"w{i}" for i in range(length - 2)]
    half = len(words) // 2
    template = " ".join(words[:half] + ["*1"] + words[half:] + ["*2"])
    lines = ["tasks:", "  - name: long", "    templates:", f'      - "{template}"', "    facts:"]
    lines += [f"      S{i}: O{i}" for i in range(facts)]
    return "\n".join(lines) + "\n"


def one(length: int, facts: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tasks.yaml")
        Path(path).write_text(tasks_yaml(length, facts), encoding="utf-8")
        report = os.path.join(tmp, "report.json")
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "verifier", "check", path, "--quiet", "--json", report],
                             capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if out.returncode not in (0, 1):
            return {"length": length, "facts": facts, "error": out.stderr.strip()[:200], "wall_s": wall}
        data = json.loads(Path(report).read_text(encoding="utf-8"))
    return {"length": length, "facts": facts, "queries": data["queries"], "wall_s": wall, "check_s": data["seconds"],
            "verdict": data["verdict"], "peak_mb": max(peak, before) / 1024}


def table(rows: list[dict]) -> str:
    out = ["| words | facts | queries | check (s) | wall, with start-up (s) | growth per doubling "
           "| peak memory (MB) | verdict |",
           "|---|---|---|---|---|---|---|---|"]
    prev = None
    for r in rows:
        if "error" in r:
            out.append(f"| {r['length']} | {r['facts']} | - | - | {r['wall_s']:.1f} | - | - | refused: {r['error']} |")
            continue
        growth = "-"
        if prev is not None:
            import math

            growth = f"{(r['check_s'] / prev['check_s']) ** (1 / math.log2(r['length'] / prev['length'])):.2f}x"
        out.append(f"| {r['length']} | {r['facts']} | {r['queries']:,} | {r['check_s']:.2f} | {r['wall_s']:.1f} "
                   f"| {growth} | {r['peak_mb']:,.0f} | {r['verdict']} |")
        prev = r
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[10, 20, 40, 100, 300])
    p.add_argument("--facts", type=int, default=10)
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    rows = []
    for length in args.lengths:
        print(f"[{length} words] ...", file=sys.stderr, flush=True)
        rows.append(one(length, args.facts))
    command = "python benchmarks/templates.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = "\n".join([
        "## Template length", "",
        f"Machine: {machine()}. Command: `{command.strip()}`.", "",
        table(rows), "",
        "Check = the certified pass over every query and the isolation check (the report's seconds); wall = the whole "
        "command (interpreter start-up, imports, loading, the construction and the check). Growth per doubling: the "
        "factor by which check time grows when the template length doubles (2.0x is linear, 4.0x quadratic, 8.0x "
        "cubic). Peak memory: the largest resident set of the child processes.",
    ])
    print(text)
    if not args.no_write:
        write_block("templates", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
