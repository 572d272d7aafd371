"""Cluster benchmark: the certified pass on local processes against a Dask LocalCluster.

    python benchmarks/cluster.py                          # 100k and 1M facts -> benchmarks/RESULTS.md
    python benchmarks/cluster.py --sizes 2000 --out /tmp/r.md   # the CI smoke test

On one machine a cluster cannot be faster than the fork pool (same cores, plus
serialisation and a scheduler); what this measures is the *overhead* of the cluster
path and the *memory* a sharded worker needs. For each size (the seeded WikiData5M-like
generator), the model is built once, then verified by :func:`verifier.checks.verify.verify`
with ``--jobs`` local processes and on a ``LocalCluster`` of as many single-threaded
workers. Columns: time of each certified pass (building the shards, scattering and
running the units, recording; the cluster's timed on the same workers a second time,
the first run on fresh workers in a column of its own: they import the verifier and load
the compiled kernels, in the warm-up the executor submits to each as it is made, here just
before the run, where `check --scheduler` makes it before building the model); overhead = cluster ÷ local; the shards
and the queries rerun over the full weights; the size of the full weights and of the largest (compact) shard
(sum of the arrays' bytes); each worker's peak resident set (``ru_maxrss`` read on the
worker); whether the three JSON reports are equal (timings aside). Nothing is
asserted on time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, write_block  # noqa: E402


def nbytes(weights) -> int:
    total = 0
    for _, a in weights.arrays():
        if hasattr(a, "indptr"):
            total += a.data.nbytes + a.indices.nbytes + a.indptr.nbytes
        else:
            total += a.nbytes
    return total


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(n: int, seed: int, workers: int, runs: int = 1) -> dict:
    import distributed

    from construction.model import build
    from tasks.synthetic import wikidata_like
    from verifier.running.cluster import DaskExecutor, local_cluster
    from verifier.running.parallel import LocalPool
    from verifier.checks.report import report_json
    from verifier.running.shards import Plan, compact, restrict
    from verifier.checks.verify import token_map, verify
    from workflow.warming import warm_up

    warm = wikidata_like(2_000, seed=seed)          # load the compiled kernels before anything is timed
    verify(warm, build(warm).instantiate(), 0.01, executor=LocalPool(workers))
    ts = wikidata_like(n, seed=seed)
    model = build(ts)
    weights = model.instantiate()
    eps = model.epsilon
    del model
    local_s, cold_s, remote_s = [], [], []
    for _ in range(runs):                   # interleaved, so that the machine's drift falls on all alike
        start = time.perf_counter()
        local = verify(ts, weights, eps, executor=LocalPool(workers))          # no cluster running meanwhile
        local_s.append(time.perf_counter() - start)
        with local_cluster(workers) as cluster, distributed.Client(cluster) as client:
            start = time.perf_counter()
            executor = DaskExecutor(client, warm_up=warm_up)         # as `check --scheduler` connects
            cold = verify(ts, weights, eps, executor=executor)       # fresh workers: imports, compiled kernels
            cold_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            remote = verify(ts, weights, eps, executor=executor)     # the same workers again
            remote_s.append(time.perf_counter() - start)
            worker_peak = max(client.run(_peak_rss_mb).values())
            shards = executor.shards
    plan = Plan.make(ts, weights, token_map(ts, weights), shards)
    largest = max(nbytes(compact(restrict(weights, plan.tokens[s], plan.experts[s]), plan.tokens[s]).weights)
                  for s in range(plan.n))
    a, b, c = report_json(local), report_json(remote), report_json(cold)
    a.pop("seconds"), b.pop("seconds"), c.pop("seconds")
    return {"facts": n, "tasks": len(ts.tasks), "queries": local.queries, "local_s": float(np.median(local_s)),
            "cold_s": float(np.median(cold_s)), "cluster_s": float(np.median(remote_s)), "local_runs": local_s,
            "cluster_runs": remote_s,
            "shards": plan.n, "deferred": remote.deferred, "weights_mb": nbytes(weights) / 2 ** 20,
            "shard_mb": largest / 2 ** 20, "worker_peak_mb": worker_peak, "equal": a == b == c,
            "certified": local.certified}


def table(rows: list[dict], workers: int) -> str:
    out = [f"| facts | tasks | queries | local, {workers} processes (s) | LocalCluster, {workers} workers (s) "
           "| overhead | first run on fresh workers (s) | shards | rerun on the client | full weights (MB) "
           "| largest shard (MB) | worker peak RSS (MB) | reports equal | rounds, local / cluster (s) |",
           "|" + "---|" * 14]
    for r in rows:
        out.append(f"| {r['facts']:,} | {r['tasks']} | {r['queries']:,} | {r['local_s']:.1f} | {r['cluster_s']:.1f} | "
                   f"{r['cluster_s'] / r['local_s']:.2f}× | {r['cold_s']:.1f} ({r['cold_s'] / r['local_s']:.2f}×) | "
                   f"{r['shards']} | {r['deferred']} | {r['weights_mb']:.0f} | "
                   f"{r['shard_mb']:.0f} | {r['worker_peak_mb']:.0f} | {'yes' if r['equal'] else 'NO'} | "
                   f"{', '.join(f'{a:.1f} / {b:.1f}' for a, b in zip(r['local_runs'], r['cluster_runs']))} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], help="numbers of facts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="local processes and cluster workers")
    p.add_argument("--runs", type=int, default=3, help="interleaved rounds of local and cluster (medians)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"), help="markdown file to write")
    args = p.parse_args(argv)
    rows = []
    for n in args.sizes:
        print(f"[{n:,} facts] running ...", file=sys.stderr, flush=True)
        rows.append(one(n, args.seed, args.workers, args.runs))
        print(table(rows, args.workers).splitlines()[-1], file=sys.stderr, flush=True)
    given = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--out" in given:
        i = given.index("--out")
        del given[i:i + 2]
    text = "\n".join([
        "## Cluster",
        "",
        f"Machine: {machine()}. Command: `{('python benchmarks/cluster.py ' + ' '.join(given)).strip()}` "
        f"(seed {args.seed}).",
        "",
        table(rows, args.workers),
        "",
        "Both passes verify the same weights with the same checks; the cluster run cuts the weights into shards of "
        "tasks (one per worker, balanced in work), scatters each to one worker, runs its units there and reruns over "
        "the full weights, on the client, any query whose candidate experts lie outside its shard. One machine shows "
        "the overhead of that path, not a speed-up. The local pool forks from a parent that has loaded the compiled "
        "kernels (a warm-up on 2,000 facts); the cluster's workers are timed twice: the first run on fresh workers "
        "(which import the verifier and load the kernels inside it, in the warm-up the executor submits to each "
        "worker as it is made, here at the start of the timed run) and again on the same workers (the overhead "
        "column), in interleaved rounds (the local pool with no cluster running, then a new cluster), "
        "medians of the rounds.",
    ])
    write_block("cluster", text, Path(args.out))
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
