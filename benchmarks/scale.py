"""Scale benchmark: build and certify WikiData5M-shaped task sets, against a plain float pass.

    python benchmarks/scale.py                      # 10k, 100k and 1M facts, writes benchmarks/RESULTS.md
    python benchmarks/scale.py --sizes 20000000     # WikiData5M size (822 tasks)
    python benchmarks/scale.py --sizes 2000 --out /tmp/r.md   # the CI smoke test

Each size runs in its own process (so peak memory is that size's), with the seeded
generator ``tasks.synthetic.wikidata_like``. Columns: facts, tasks, queries, build time
(construction + instantiation), verify time (the certified pass and every check, with
``--jobs`` processes), queries per second, the plain float64 pass over the same
queries and weights (``verifier.baseline``, same jobs), the ratio verify/plain, peak
resident memory of the main process and of the largest worker, and the verdict.
No timing is asserted anywhere: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from benchmarks.results import machine, write_block  # noqa: E402


def one(n_facts: int, seed: int, jobs: int, baseline: bool) -> dict:
    from construction.evidence import isolation
    from construction.model import build
    from tasks.synthetic import wikidata_like
    from verifier.baseline import plain_pass
    from verifier.parallel import ordered_map
    from verifier.verify import verify

    t0 = time.perf_counter()
    ts = wikidata_like(n_facts, seed=seed)
    t1 = time.perf_counter()
    model = build(ts)
    weights = model.instantiate()
    t2 = time.perf_counter()
    report = verify(ts, weights, model.epsilon, jobs=jobs)
    t3 = time.perf_counter()
    t_iso = time.perf_counter()
    isolated, notes = isolation(ts, model, lambda fn, items: ordered_map(fn, items, jobs))
    report.attach(str(model.error_bound()), model.bound_value(), model.gate.method, isolated, notes)
    isolation_s = time.perf_counter() - t_iso
    t3b = time.perf_counter()
    plain = None
    if baseline:
        _, _ = plain_pass(weights, ts, jobs=jobs)
        plain = time.perf_counter() - t3b
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "facts": ts.n_facts, "tasks": len(ts.tasks), "queries": report.queries,
        "generate_s": t1 - t0, "build_s": t2 - t1, "verify_s": t3 - t2, "isolation_s": isolation_s, "plain_s": plain,
        "peak_main_mb": self_rss, "peak_worker_mb": child_rss,
        "verdict": report.verdict, "worst_error": report.measured_worst, "bound": report.closed_form_value,
        "jobs": jobs, "certified": report.certified,
    }


def table(rows: list[dict]) -> str:
    head = ("| facts | tasks | queries | build (s) | verify (s) | modularity (s) | total (s) | queries/s | plain float (s) "
            "| verify/plain | peak main (MB) | peak worker (MB) | verdict |")
    out = [head, "|" + "---|" * 13]
    for r in rows:
        ratio = f"{r['verify_s'] / r['plain_s']:.2f}" if r.get("plain_s") else "-"
        plain = f"{r['plain_s']:.1f}" if r.get("plain_s") else "-"
        total = r["build_s"] + r["verify_s"] + r["isolation_s"]
        out.append(f"| {r['facts']:,} | {r['tasks']} | {r['queries']:,} | {r['build_s']:.1f} | {r['verify_s']:.1f} | "
                   f"{r['isolation_s']:.1f} | {total:.1f} | {r['queries'] / r['verify_s']:,.0f} | {plain} | {ratio} | {r['peak_main_mb']:,.0f} | "
                   f"{r['peak_worker_mb']:,.0f} | {r['verdict']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="numbers of facts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="worker processes for verify and the plain pass (0: one per CPU)")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain float pass")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"), help="markdown file to write")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.one, args.seed, args.jobs, not args.no_baseline)))
        return 0
    rows = []
    for n in args.sizes:
        cmd = [sys.executable, __file__, "--one", str(n), "--seed", str(args.seed), "--jobs", str(args.jobs)]
        if args.no_baseline:
            cmd.append("--no-baseline")
        print(f"[{n:,} facts] running ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:
        i = given.index("--out")
        del given[i:i + 2]
    command = "python benchmarks/scale.py " + " ".join(given)
    text = "\n".join([
        "## Scale",
        "",
        f"Machine: {machine()}. Command: `{command.strip()}` (seed {args.seed}, {args.jobs} jobs).",
        "",
        table(rows),
        "",
        "Build = construction + numeric instantiation. Verify = the certified pass over every query with the checks "
        "on it (error, routing, size, ablation). Modularity = rebuilding each expert from its task alone and after "
        "removing tasks (all tasks up to 12, else 12 spread evenly; 4 beyond 200k facts). Total = build + verify + modularity. Plain float = "
        "an uncertified float64 pass over the same queries and weights with the same batching. Peak memory is the "
        "resident set of the main process and of the largest worker.",
    ])
    write_block("scale", text, Path(args.out))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
