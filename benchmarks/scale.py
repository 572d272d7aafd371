"""Scale benchmark: build and certify WikiData5M-shaped task sets; the PyTorch peer beside it.

    python benchmarks/scale.py                               # 1M, 5M and 20M facts -> benchmarks/RESULTS.md
    python benchmarks/scale.py --sizes 100000 1000000        # other sizes
    python benchmarks/scale.py --sizes 2000 --out /tmp/r.md  # the CI smoke test

Each size runs in its own process, with the seeded generator
``tasks.synthetic.wikidata_like`` (20M facts: 822 relations, like WikiData5M). What is
measured is what ``python -m verifier check`` runs: construction and instantiation,
then :func:`workflow.check.check_built` with ``--jobs`` worker processes (the closed form
and the modularity rebuilds, the symbolic model released, then the certified pass over
every query with every check). Columns:

* time of the build, of the certified pass, of the evidence (closed form + modularity),
  their total, and certified queries per second;
* **peak memory of the process tree**: the largest sum, over the main process and its
  workers at the same moment, of their proportional set sizes (``benchmarks.memory``),
  sampled every 0.1 s from the start of the generation to the verdict; and per million
  facts;
* **the PyTorch peer** (``benchmarks/peer.py``) in the same run: after the verdict, the
  weights are built again and a sample of the verifier's batches (every k-th, about
  ``--peer-queries`` queries) is run by both the certified pass and the peer, batch by
  batch on the same rows, one process and one thread each; the ratio is the peer's
  time over the certified pass's (above 1: certifying is faster), float64 and float32;
* growth per doubling of the facts against the previous size, for time and memory.

No timing is asserted anywhere: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from benchmarks.results import machine, write_block  # noqa: E402


def one(n_facts: int, seed: int, jobs: int, peer_queries: int) -> dict:
    from benchmarks.memory import PeakSampler
    from benchmarks.peer import measure, verifier_batches
    from workflow.check import check_built
    from construction.model import build
    from tasks.synthetic import wikidata_like
    from verifier.running.parallel import before_forking

    with PeakSampler() as mem:
        t0 = time.perf_counter()
        ts = wikidata_like(n_facts, seed=seed)
        before_forking(jobs)                                # as `check --jobs N` does before building
        t1 = time.perf_counter()
        report = check_built(ts, build(ts), jobs=jobs)     # as the CLI: the model is released inside
        t2 = time.perf_counter()
    row = {
        "facts": ts.n_facts, "tasks": len(ts.tasks), "queries": report.queries, "jobs": jobs,
        "generate_s": t1 - t0, "build_s": (t2 - t1) - report.seconds, "verify_s": report.verify_seconds,
        "evidence_s": report.seconds - report.verify_seconds, "peak_mb": mem.peak_mb,
        "verdict": report.verdict, "worst_error": report.measured_worst, "bound": report.closed_form_value,
    }
    del report
    if peer_queries > 0:
        weights = build(ts).instantiate()
        every = max(1, round(row["queries"] / peer_queries))
        for r in measure(ts, weights, verifier_batches(ts, weights, every), ["float64", "float32"]):
            row[f"peer_{r['dtype']}"] = {k: r[k] for k in ("queries", "batches", "certified_s", "peer_s", "ratio",
                                                           "checked", "expert_disagreements", "outside_enclosure")}
    return row


def _growth(prev: dict | None, r: dict, key) -> str:
    if prev is None or r["facts"] <= prev["facts"]:
        return "-"
    doublings = math.log2(r["facts"] / prev["facts"])
    return f"{(key(r) / key(prev)) ** (1 / doublings):.2f}×"


def table(rows: list[dict]) -> str:
    head = ("| facts | tasks | queries | build (s) | certified pass (s) | evidence (s) | total (s) | queries/s "
            "| peak memory (GB) | MB per 1M facts | ÷ PyTorch f64 | ÷ PyTorch f32 | time per doubling "
            "| memory per doubling | verdict |")
    out = [head, "|" + "---|" * 15]
    prev = None
    for r in rows:
        total = r["build_s"] + r["verify_s"] + r["evidence_s"]
        ratios = []
        for dt in ("float64", "float32"):
            p = r.get(f"peer_{dt}")
            ratios.append(f"{p['ratio']:.2f}×" if p else "-")
        out.append(
            f"| {r['facts']:,} | {r['tasks']} | {r['queries']:,} | {r['build_s']:.1f} | {r['verify_s']:.1f} | "
            f"{r['evidence_s']:.1f} | {total:.1f} | {r['queries'] / r['verify_s']:,.0f} | {r['peak_mb'] / 1024:.2f} | "
            f"{r['peak_mb'] / (r['facts'] / 1e6):,.0f} | {ratios[0]} | {ratios[1]} | "
            f"{_growth(prev, r, lambda x: x['build_s'] + x['verify_s'] + x['evidence_s'])} | "
            f"{_growth(prev, r, lambda x: x['peak_mb'])} | {r['verdict']} |")
        prev = r
    return "\n".join(out)


def peer_table(rows: list[dict]) -> str:
    out = ["| facts | dtype | sampled queries (batches) | certified (s) | PyTorch (s) | PyTorch ÷ certified "
           "| rows compared | expert disagreements | errors outside the enclosure |", "|" + "---|" * 9]
    for r in rows:
        for dt in ("float64", "float32"):
            p = r.get(f"peer_{dt}")
            if p:
                out.append(f"| {r['facts']:,} | {dt} | {p['queries']:,} ({p['batches']}) | {p['certified_s']:.2f} | "
                           f"{p['peer_s']:.2f} | {p['ratio']:.2f}× | {p['checked']:,} | {p['expert_disagreements']} | "
                           f"{p['outside_enclosure']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 5_000_000, 20_000_000], help="numbers of facts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="worker processes of the certified pass (0: one per CPU)")
    p.add_argument("--peer-queries", type=int, default=1_000_000,
                   help="queries (a sample of whole batches) run by both passes for the ratio; 0 skips the peer")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"), help="markdown file to write")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.one, args.seed, args.jobs, args.peer_queries)))
        return 0
    rows = []
    for n in args.sizes:
        cmd = [sys.executable, __file__, "--one", str(n), "--seed", str(args.seed), "--jobs", str(args.jobs),
               "--peer-queries", str(args.peer_queries)]
        print(f"[{n:,} facts] running ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(table(rows).splitlines()[-1], file=sys.stderr, flush=True)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:
        i = given.index("--out")
        del given[i:i + 2]
    command = ("python benchmarks/scale.py " + " ".join(given)).strip()
    text = "\n".join([
        "## Scale",
        "",
        f"Machine: {machine()}. Command: `{command}` (seed {args.seed}, {args.jobs} jobs).",
        "",
        table(rows),
        "",
        "Build = construction + numeric instantiation. Certified pass = every query with every check on it "
        "(error, routing, size, ablation), with the jobs above. Evidence = the closed-form bound and the modularity "
        "rebuilds (each expert from its task alone and after removing tasks). Peak memory = the process tree "
        "(main + workers, summed proportional set sizes) from generation to verdict. ÷ PyTorch = PyTorch time over "
        "certified time on the same sampled batches, one core each (below):",
        "",
        peer_table(rows),
    ])
    write_block("scale", text, Path(args.out))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
