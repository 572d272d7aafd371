"""Editing: re-certification after an edit (``check --since``) against a full check.

Builds a WikiData5M-shaped set (``tasks.synthetic.wikidata_like``, seed 0) with its facts in
TSV files, certifies it with ``check --certificate``, then applies edits with the ``edit``
command and re-certifies each with ``check --since``, timing the whole process as a user
runs it (start-up, reading, the certificate's files, the pass, writing the new certificate).
After every edit a full ``check`` of the same model (the certificate's β and γ) runs too, and
the two verdicts and per-task counts must agree. Writes the block "editing" of
``benchmarks/RESULTS.md``::

    python benchmarks/editing.py                     # 1M facts: about 15 minutes on 2 cores
    python benchmarks/editing.py --facts 100000      # about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, phase_lines, publish  # noqa: E402


def run(args: list[str], cwd: str) -> tuple[float, int, str]:
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "verifier", *args], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return time.perf_counter() - start, p.returncode, p.stdout


def counts(report: dict) -> list:
    return [(t["name"], t["queries"], t["object_queries"], t["misrouted"], t["over_epsilon"], t["ablation_broken"])
            for t in report["tasks"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--facts", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=1000, help="facts changed by the batch edit (default 1000)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    from tasks.io import dump_tasks
    from tasks.synthetic import wikidata_like

    work = tempfile.mkdtemp(prefix="editing-bench-")
    ts = wikidata_like(args.facts, seed=0)
    dump_tasks(ts, os.path.join(work, "tasks.yaml"), facts_dir=work)
    full_s, code, _ = run(["check", "tasks.yaml", "--certificate", "cert", "--jobs", "2", "--quiet",
                           "--json", "full.json"], work)
    params = json.load(open(os.path.join(work, "full.json")))["parameters"]
    beta, gamma = params["beta"], params["gamma"]
    print(f"full check with --certificate: {full_s:.1f} s (exit {code})", file=sys.stderr)
    rng = random.Random(0)
    sizes = sorted(range(len(ts.tasks)), key=lambda k: ts.tasks[k].n_facts)
    median = ts.tasks[sizes[len(sizes) // 2]]
    largest = ts.tasks[sizes[-1]]
    entities = list(ts.vocabulary.entities)

    def pick(task, n):
        return rng.sample(list(task.facts.items()), n)

    edits = []
    s, o = pick(median, 1)[0]
    edits.append(("change one object (median task)", median.name, ["--set", f"{s}={rng.choice(entities)}"], 1))
    edits.append(("add a fact with two new entities (median task)", median.name, ["--set", "Qnew1=Qnew2"], 1))
    s, o = pick(median, 1)[0]
    edits.append(("remove a fact (median task)", median.name, ["--remove", s], 1))
    s, o = pick(largest, 1)[0]
    edits.append((f"change one object (largest task, {largest.n_facts:,} facts)", largest.name,
                  ["--set", f"{s}={rng.choice(entities)}"], 1))
    batch = []
    for s, _ in pick(largest, args.batch):
        batch += ["--set", f"{s}={rng.choice(entities)}"]
    edits.append((f"change {args.batch:,} objects (largest task)", largest.name, batch, args.batch))
    rows = []
    for label, task, flags, n in edits:
        run(["edit", "tasks.yaml", task, *flags, "--quiet"], work)
        since_s, code_i, _ = run(["check", "tasks.yaml", "--since", "cert", "--jobs", "2", "--quiet",
                                  "--json", "since.json"],
                                 work)
        inc = json.load(open(os.path.join(work, "since.json")))
        ref_s, code_f, _ = run(["check", "tasks.yaml", "--beta", beta, "--gamma", gamma,
                                "--no-isolation", "--jobs", "2",
                                "--quiet", "--json", "ref.json"], work)
        ref = json.load(open(os.path.join(work, "ref.json")))
        same = inc["verdict"] == ref["verdict"] and counts(inc) == counts(ref)
        i = inc["incremental"]
        rows.append((label, n, i["mode"], i["queries_rerun"], i["queries_reused"], since_s, i["recertify_seconds"],
                     i["phases"], ref_s, inc["verdict"], ref["verdict"], same))
        print(f"{label}: since {since_s:.2f} s ({i['mode']}, {i['queries_rerun']:,} rerun), full {ref_s:.1f} s, "
              f"same verdict and counts: {same}", file=sys.stderr)
    lines = ["## Editing", "",
             f"`python benchmarks/editing.py --facts {args.facts}` on {machine()}: a set of {args.facts:,} facts "
             f"({len(ts.tasks)} tasks, seed 0) certified with `check --certificate` in "
             f"{full_s:.1f} s (2 jobs); each edit made with `edit`, re-certified with `check --since --jobs 2` (the "
             f"whole process, as run), and checked against a full `check` of the same model (β = {beta}, "
             f"γ = {gamma}, 2 jobs).", "",
             "| edit | facts | mode | queries run again | reused | `check --since` (s) | of which re-certification (s) "
             "| full check (s) | verdict | full check's | same verdict and counts |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---|---|"]
    for label, n, mode, rerun, reused, since_s, rec_s, phases, ref_s, v_i, v_f, same in rows:
        lines.append(f"| {label} | {n:,} | {mode} | {rerun:,} | {reused:,} | {since_s:.2f} | {rec_s:.2f} | {ref_s:.1f} "
                     f"| {v_i} | {v_f} | {'yes' if same else 'NO'} |")
    lines += ["", "Where the time of `check --since` goes (seconds, per phase, first and last edit):", ""]
    lines += phase_lines([(r[0], r[7]) for r in (rows[0], rows[-1])])
    publish("editing", lines, write=not args.no_write)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
