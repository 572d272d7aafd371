"""Cluster faults benchmark: `check --scheduler` on a real deployment, unkilled and with a worker killed.

    python benchmarks/cluster_faults.py                       # 100k and 1M facts -> benchmarks/RESULTS.md
    python benchmarks/cluster_faults.py --sizes 10000 --out /tmp/r.md

For each size (the seeded WikiData5M-like generator, written as a tasks file), the local
report is made once (``check --jobs 2``); then, each time on a fresh deployment
(:mod:`audit.deployment`: ``dask scheduler`` and two ``dask worker`` processes with
nannies, on loopback), ``python -m verifier check --scheduler`` runs as a subprocess:
unkilled; with a worker and its nanny SIGKILLed as soon as a unit of the evidence phase
(the leave-one-out rebuilds) is processing; and likewise in the certified pass. The
killed worker is first made the only holder of scattered data (the shared state, or
shards), the worst case. Columns: when the kill came (seconds after the run started),
the run's wall time, its exit status, whether the scheduler lost scattered data, and
whether the JSON report equals the local one (timings aside). Nothing is asserted on time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, write_block  # noqa: E402

SCENARIOS = ("unkilled", "evidence", "pass")


def _comparable(path: Path) -> dict | None:
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    report.pop("seconds")
    return report


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def one_run(tasks: Path, scenario: str, directory: Path, timeout: float) -> dict:
    from audit.deployment import EVIDENCE, PASS, deploy

    directory.mkdir()
    out = directory / "report.json"
    with deploy(directory, _env()) as d:
        pids = d.pids()
        start = time.monotonic()
        run = subprocess.Popen([sys.executable, "-m", "verifier", "check", str(tasks), "--scheduler", d.address,
                                "--json", str(out), "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=_env(), text=True)
        killed = None
        if scenario != "unkilled":
            d.kill_worker(pids[d.victim(EVIDENCE if scenario == "evidence" else PASS, run, timeout)])
            killed = time.monotonic() - start
        try:
            _, err = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:      # hung: say so in the table
            run.kill()
            _, err = run.communicate()
        seconds = time.monotonic() - start
        lost = "lose scattered data" in d.scheduler_log()
    return {"scenario": scenario, "killed": killed, "seconds": seconds, "code": run.returncode,
            "lost": lost, "report": _comparable(out), "err": err.strip()}


def one(n: int, seed: int, timeout: float) -> list[dict]:
    from tasks.synthetic import wikidata_like
    from tasks.writing import dump_tasks

    with tempfile.TemporaryDirectory(prefix="cluster-faults-") as tmp:
        base = Path(tmp)
        tasks = base / "tasks.yaml"
        ts = wikidata_like(n, seed=seed)
        dump_tasks(ts, tasks, facts_dir=base / "facts")
        subprocess.run([sys.executable, "-m", "verifier", "check", str(tasks), "--jobs", "2", "--json",
                        str(base / "local.json"), "--quiet"], stdout=subprocess.DEVNULL, env=_env(), check=False)
        local = _comparable(base / "local.json")
        rows = []
        for scenario in SCENARIOS:
            print(f"[{n:,} facts] {scenario} ...", file=sys.stderr, flush=True)
            row = one_run(tasks, scenario, base / scenario, timeout)
            report = row.pop("report")
            row.update(facts=n, tasks=len(ts.tasks), equal=local is not None and report == local)
            rows.append(row)
            print(f"  {row}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| facts | tasks | worker killed | killed at (s) | run (s) | exit | scattered data lost "
           "| report equal to local |",
           "|" + "---|" * 8]
    for r in rows:
        when = "-" if r["killed"] is None else f"{r['killed']:.1f}"
        scenario = {"unkilled": "none", "evidence": "in the evidence phase", "pass": "in the certified pass"}
        out.append(f"| {r['facts']:,} | {r['tasks']} | {scenario[r['scenario']]} | {when} | {r['seconds']:.1f} | "
                   f"{r['code'] if r['code'] != -9 else 'hung'} | {'yes' if r['lost'] else 'no'} | "
                   f"{'yes' if r['equal'] else 'NO'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], help="numbers of facts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds after which a run counts as hung")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"), help="markdown file to write")
    args = p.parse_args(argv)
    rows = [row for n in args.sizes for row in one(n, args.seed, args.timeout)]
    given = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--out" in given:
        i = given.index("--out")
        del given[i:i + 2]
    text = "\n".join([
        "## Cluster faults",
        "",
        f"Machine: {machine()}. Command: `{('python benchmarks/cluster_faults.py ' + ' '.join(given)).strip()}` "
        f"(seed {args.seed}); a real deployment on loopback: `dask scheduler` and two `dask worker --nworkers 1 "
        f"--nthreads 1` (with nannies), a fresh one for each run.",
        "",
        table(rows),
        "",
        "A killed worker is SIGKILLed with its nanny as soon as a unit of the phase is processing, after the "
        "scheduler was made to keep one copy only of the scattered data (the evidence phase's shared state, the "
        "shards), on the worker then killed; run time is from the command's start to its end, start-up and the "
        "model's construction included.",
    ])
    write_block("cluster-faults", text, Path(args.out))
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
