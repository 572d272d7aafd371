"""Time of ``python -m verifier accessible`` on the examples, with its default budgets.

    python benchmarks/accessible.py [--sets capitals geography] [--extra ARG ...] [--out FILE]

Each set runs the command in its own process (``--json`` to a temporary file, ``--quiet``)
and records the wall time, the token and soft phases' seconds (the report's), the peak
memory, and the numbers the README quotes: prompts enumerated, distinct certified
sequences, facts whose object is certified accessible, certified soft targets, the n50
slope and the paper's C. ``--extra`` passes more flags to every run (e.g. ``--no-soft``).
Writes its block of ``benchmarks/RESULTS.md`` unless ``--out`` names another file (or
``-`` to print only). No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, write_block  # noqa: E402

SETS = {"capitals": "examples/capitals.yaml", "geography": "examples/geography/tasks.yaml"}


def one(name: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "verifier", "accessible", SETS[name], "--quiet", "--json", report,
                              *extra], capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        if out.returncode not in (0, 1):
            raise SystemExit(f"{name}: exit {out.returncode}: {out.stderr.strip()}")
        data = json.loads(Path(report).read_text(encoding="utf-8"))
    peak = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before) / 2 ** 20
    return {"name": name, "wall": wall, "peak": peak, "exit": out.returncode, "data": data}


def row(r: dict) -> str:
    d = r["data"]
    tok, soft, facts = d["token_prompts"], d["soft_prompts"], d["facts"]
    prompts = sum(lv["prompts"] for lv in tok["levels"])
    distinct = " ".join(str(x) for x in tok["distinct_up_to_m"])
    if soft is None:
        soft_cells = "- | - | - | -"
    else:
        rand = [t for t in soft["targets"] if t["purpose"] == "random"]
        fit = soft["n50_fit"]
        soft_cells = (f"{soft['seconds']:.1f} | {sum(t['certified'] for t in rand)}/{len(rand)} | "
                      f"{'-' if fit is None else format(fit['slope'], '.3g')} | "
                      f"{soft['bound']['C']:.4g} ({soft['bound']['C_anisotropic']:.4g})")
    return (f"| {r['name']} | {d['vocabulary']:,} | {d['d']:,} | {d['n_positions']} | {tok['m']} | {prompts:,} | "
            f"{tok['seconds']:.1f} | {distinct} | {facts['object_accessible']:,}/{facts['total']:,} | {soft_cells} | "
            f"{r['wall']:.1f} | {r['peak']:.2f} | {r['exit']} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", nargs="+", choices=sorted(SETS), default=["capitals", "geography"])
    p.add_argument("--extra", default="", help="more flags for every run, one string (e.g. '--no-soft')")
    p.add_argument("--out", default=None,
                   help="write the block into this file instead of benchmarks/RESULTS.md ('-': print)")
    args = p.parse_args(argv)
    extra = shlex.split(args.extra)
    results = [one(name, extra) for name in args.sets]
    command = "python benchmarks/accessible.py" + (f" --extra {shlex.quote(args.extra)}" if extra else "")
    lines = ["## Accessibility", "",
             f"Machine: {machine()}. Command: `{command}` (each set: `python -m verifier accessible SET` with the "
             "default budgets" + (f" and `{args.extra}`" if extra else "") + ").", "",
             "| set | V | d | positions | token m | prompts | token (s) | distinct certified sequences, n = 1, 2, ... "
             "| facts' objects accessible | soft (s) | random targets certified | n50 slope | paper's C (anisotropic) "
             "| wall (s) | peak memory (GB) | exit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [row(r) for r in results]
    text = "\n".join(lines)
    print(text)
    if args.out != "-":
        if args.out:
            write_block("accessible", text, Path(args.out))
        else:
            write_block("accessible", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
