"""Shard memory: what one worker of a sharded run holds, against the whole model.

    python benchmarks/shard_memory.py                   # 1M facts, 16 shards -> benchmarks/RESULTS.md
    python benchmarks/shard_memory.py --facts 20000 --shards 4 --out /tmp/r.md

Builds the seeded WikiData5M-like set, cuts it into shards as ``check --scheduler`` does
(:class:`verifier.running.shards.Plan`), and for the whole model and each shard (restricted and
compacted, :func:`verifier.running.shards.restrict` and :func:`verifier.running.shards.compact`) sums
the bytes of the weights' arrays, of the certified pass's interval tables
(:class:`verifier.passes.forward.Prepared`) and of its work arrays (the kernels' accumulators).
These are the arrays a worker keeps between batches; a batch's own temporaries come on
top. Nothing is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, write_block  # noqa: E402


def _arrays_bytes(obj) -> int:
    import numpy as np

    total = 0
    for key, value in vars(obj).items():
        if key in ("weights", "_scratch"):
            continue
        for x in (value if isinstance(value, tuple) else (value,)):
            if isinstance(x, np.ndarray):
                total += x.nbytes
            elif hasattr(x, "mid"):
                total += x.mid.nbytes + x.rad.nbytes + x.indices.nbytes + x.indptr.nbytes
    return total


def _scratch_bytes(prep) -> int:
    total = 0
    for value in prep.scratch().values():
        for x in (value if isinstance(value, tuple) else (value,)):
            total += x.nbytes
    return total


def measure(weights, **kw) -> dict:
    from benchmarks.cluster import nbytes
    from verifier.passes.forward import Prepared

    prep = Prepared(weights, **kw)
    return {"V": len(weights.vocab), "d": weights.d, "weights": nbytes(weights) / 1e6,
            "tables": _arrays_bytes(prep) / 1e6, "work": _scratch_bytes(prep) / 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--facts", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import numpy as np

    from construction.model import build
    from tasks.synthetic import wikidata_like
    from verifier.running.shards import Plan, compact, restrict
    from verifier.checks.verify import token_map

    ts = wikidata_like(args.facts, seed=0)
    weights = build(ts).instantiate()
    tmap = token_map(ts, weights)
    plan = Plan.make(ts, weights, tmap, args.shards)
    gate_terms = int(np.diff(weights.W_G.tocsr().indptr).max(initial=1))
    rows = [("whole model", measure(weights), None)]
    for s in range(plan.n):
        facts = sum(ts.tasks[k].n_facts for k in np.flatnonzero(plan.shard_of_task == s))
        restricted = restrict(weights, plan.tokens[s], plan.experts[s])
        comp = compact(restricted, plan.tokens[s])
        rows.append((f"shard {s} ({facts:,} facts)", measure(restricted, gate_terms=gate_terms),
                     measure(comp.weights, gate_terms=gate_terms, vocab_size=comp.vocab_size)))
        print(f"shard {s} done", file=sys.stderr)

    def total(m):
        return m["weights"] + m["tables"] + m["work"]

    lines = ["| | restricted: V × d | restricted: weights + tables + work (MB) | compact: V × d | "
             "compact: weights + tables + work (MB) |", "|---|---|---|---|---|"]
    whole = rows[0][1]
    lines.append(f"| whole model | {whole['V']:,} × {whole['d']:,} | {whole['weights']:.1f} + {whole['tables']:.1f} + "
                 f"{whole['work']:.1f} = {total(whole):.1f} | | |")
    for name, r, c in rows[1:]:
        lines.append(f"| {name} | {r['V']:,} × {r['d']:,} | {total(r):.1f} | {c['V']:,} × {c['d']:,} | "
                     f"{c['weights']:.1f} + {c['tables']:.1f} + {c['work']:.1f} = {total(c):.1f} |")
    comp_totals = [total(c) for _, _, c in rows[1:]]
    text = (f"## Shard memory\n\nMachine: {machine()}. Command: `python benchmarks/shard_memory.py --facts "
            f"{args.facts} --shards {args.shards}`.\n\n" + "\n".join(lines) +
            f"\n\nCompact shards: largest {max(comp_totals):.1f} MB, median "
            f"{sorted(comp_totals)[len(comp_totals) // 2]:.1f} MB, {sum(comp_totals):.1f} MB summed over the shards, "
            f"against {total(whole):.1f} MB for the whole model. A shard's size follows its tasks (a task is never "
            "split; the generator's task sizes are Zipf-distributed).")
    write_block("shard-memory", text, **({"path": args.out} if args.out else {}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
