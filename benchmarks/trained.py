"""Certifying trained (dense) models against running them: ``check --weights`` beside plain passes.

    python benchmarks/trained.py                      # the committed 1k and 10k models and a 50k one -> RESULTS.md
    python benchmarks/trained.py --models F1000 --runs 1 --out /tmp/r.md     # quick
    python benchmarks/trained.py --large-runs 1       # the large model's rounds take minutes each

For each model, one process each, timed as a whole (wall clock, medians of ``--runs``
interleaved rounds after a warm-up round):

* ``python -m verifier check TASKS --weights W --jobs 1 --quiet``: the certified check, every
  query (the dense pass of :mod:`verifier.passes.dense`, one BLAS thread);
* the plain float64 **numpy** pass (:func:`numpy_pass`): read the files, enumerate the queries
  as the verifier does (batched by prefix length), and per batch the forward pass of the
  layout's equations in dense float64 arrays (one BLAS thread): embeddings, every head's
  softmax attention, the gate, the routed expert with its gate scale, the logits, the
  softmax and the error 1 − P(valid), and the logits without the expert for the object
  queries (what the certificate's ablation computes);
* the same in **PyTorch** float64 on one thread (:func:`torch_pass`).

The models: the committed 1,000- and 10,000-fact models (docs/training/weights), and a
dense model of ``--large`` facts (default 50,000) in the layout with the trained models'
shapes (d = 64, 4 heads of 16, experts min(256, c(k)), every entry non-zero), drawn at random
with a gate scaled so that each query has one clear winner (a trained model's routing): its
verdict is NOT CERTIFIED (it was not trained), and what is measured is what certifying every
query costs. The block "trained" of RESULTS.md gets the medians and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMMITTED = {
    "F1000": ("docs/training/tasks-F1000-K16-d0.yaml", "docs/training/weights/F1000-d0-K16-E16-localize-s0.npz"),
    "F10000": ("docs/training/tasks-F10000-K16-d0.yaml", "docs/training/weights/F10000-d0-K16-E16-localize-s0.npz"),
}


def _load(directory_or_pair):
    from layout.npz import load
    from tasks.io import load_tasks

    tasks, weights = directory_or_pair
    return load_tasks(str(tasks)), load(str(weights))


def _batches(ts, w):
    """(tokens (n, p) in the weights' ids, valid CSR, object query's object or -1) per batch,
    in the verifier's order and sizes."""
    from verifier.passes.batches import batch_rows, batches

    tmap = w.token_ids(ts.vocabulary.tokens)
    for b in batches(ts, chunk=batch_rows(len(w.experts))):
        ablate = b.object_query & (b.determined >= 0)
        target = np.where(ablate & (b.target >= 0), tmap[np.maximum(b.target, 0)], -1)
        yield tmap[b.tokens], b.valid_ptr, tmap[b.valid], target


def _softmax(L: np.ndarray) -> np.ndarray:
    L = L - L.max(axis=1, keepdims=True)
    np.exp(L, out=L)
    L /= L.sum(axis=1, keepdims=True)
    return L


def numpy_pass(tasks: str, weights: str) -> dict:
    """The plain float64 pass in numpy, end to end (module docstring); returns its phase
    times, the number of queries and the worst error."""
    from threadpoolctl import threadpool_limits

    t0 = time.perf_counter()
    ts, w = _load((tasks, weights))
    E, P, U, WG = (np.asarray(m.toarray()) for m in (w.E, w.P, w.U, w.W_G))
    heads = [tuple(np.asarray(m.toarray()) for m in (h.W_Q, h.W_K, h.W_V, h.W_O)) for h in w.heads]
    experts = [(e.W_1.toarray(), np.asarray(e.b_1), e.W_2.toarray()) for e in w.experts]
    bG = np.asarray(w.b_G)
    scaled = w.gate_mode == "top1-scaled"
    t1 = time.perf_counter()
    n_q, worst, forward = 0, 0.0, 0.0
    with threadpool_limits(limits=1, user_api="blas"):
        for tokens, vptr, valid, target in _batches(ts, w):
            s = time.perf_counter()
            n, p = tokens.shape
            ids = np.concatenate([np.full((n, 1), w.bos), tokens], axis=1)
            h = E[ids] + P[: p + 1][None]
            r = h[:, -1].copy()
            for WQ, WK, WV, WO in heads:
                sc = np.einsum("nd,npd->np", h[:, -1] @ WQ.T, h @ WK.T)
                sc -= sc.max(axis=1, keepdims=True)
                a = np.exp(sc)
                a /= a.sum(axis=1, keepdims=True)
                r += np.einsum("np,npd->nd", a, h @ WV.T) @ WO.T
            g = r @ WG.T + bG
            e = g.argmax(axis=1)
            y = r.copy()
            c = np.exp(g - g.max(axis=1, keepdims=True))
            c /= c.sum(axis=1, keepdims=True)
            for k in np.unique(e):
                sel = e == k
                W1, b1, W2 = experts[k]
                out = np.maximum(r[sel] @ W1.T + b1, 0.0) @ W2.T
                y[sel] += (c[sel, k][:, None] * out) if scaled else out
            rows = np.repeat(np.arange(n), np.diff(vptr))
            pr = _softmax(y @ U.T)
            mass = np.bincount(rows, weights=pr[rows, valid], minlength=n)
            worst = max(worst, float((1.0 - mass).max(initial=0.0)))
            _softmax(r[target >= 0] @ U.T)                       # without the expert: the object queries
            n_q += n
            forward += time.perf_counter() - s
    return {"queries": n_q, "read_s": t1 - t0, "forward_s": forward, "worst_error": worst}


def torch_pass(tasks: str, weights: str) -> dict:
    """The same pass in PyTorch float64 on one thread."""
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ts, w = _load((tasks, weights))
    T = lambda m: torch.from_numpy(np.asarray(m.toarray() if hasattr(m, "toarray") else m, np.float64))  # noqa: E731
    E, P, U, WG, bG = T(w.E), T(w.P), T(w.U), T(w.W_G), T(np.asarray(w.b_G))
    heads = [tuple(T(m) for m in (h.W_Q, h.W_K, h.W_V, h.W_O)) for h in w.heads]
    experts = [(T(e.W_1), T(np.asarray(e.b_1)), T(e.W_2)) for e in w.experts]
    scaled = w.gate_mode == "top1-scaled"
    t1 = time.perf_counter()
    n_q, worst, forward = 0, 0.0, 0.0
    with torch.no_grad():
        for tokens, vptr, valid, target in _batches(ts, w):
            s = time.perf_counter()
            n, p = tokens.shape
            ids = torch.from_numpy(np.concatenate([np.full((n, 1), w.bos), tokens], axis=1))
            h = E[ids] + P[: p + 1][None]
            r = h[:, -1].clone()
            for WQ, WK, WV, WO in heads:
                a = torch.softmax(torch.einsum("nd,npd->np", h[:, -1] @ WQ.T, h @ WK.T), dim=1)
                r += torch.einsum("np,npd->nd", a, h @ WV.T) @ WO.T
            g = r @ WG.T + bG
            e = g.argmax(dim=1)
            c = torch.softmax(g, dim=1)
            y = r.clone()
            for k in torch.unique(e).tolist():
                sel = e == k
                W1, b1, W2 = experts[k]
                out = torch.relu(r[sel] @ W1.T + b1) @ W2.T
                y[sel] += (c[sel, k][:, None] * out) if scaled else out
            rows = torch.from_numpy(np.repeat(np.arange(n), np.diff(vptr)))
            pr = torch.softmax(y @ U.T, dim=1)
            mass = torch.zeros(n, dtype=torch.float64).index_add_(0, rows, pr[rows, torch.from_numpy(valid)])
            worst = max(worst, float((1.0 - mass).max()))
            tg = torch.from_numpy(target >= 0)
            torch.softmax(r[tg] @ U.T, dim=1)
            n_q += n
            forward += time.perf_counter() - s
    return {"queries": n_q, "read_s": t1 - t0, "forward_s": forward, "worst_error": worst}


def large_model(facts: int, work: Path, seed: int = 0) -> tuple[Path, Path]:
    """A dense random model of ``facts`` facts in the layout (module docstring), written to ``work``."""
    import scipy.sparse as sp

    from layout import Expert, Head, Weights
    from layout.npz import save
    from tasks.io import dump_tasks
    from tasks.synthetic import wikidata_like

    work.mkdir(parents=True, exist_ok=True)
    tasks, weights = work / "tasks.yaml", work / "weights.npz"
    if tasks.exists() and weights.exists():
        return tasks, weights
    ts = wikidata_like(facts, n_tasks=16, seed=seed)
    dump_tasks(ts, tasks, facts_dir=work)
    rng = np.random.default_rng(seed)
    V, K, d = ts.vocabulary.size, len(ts.tasks), 64
    dense = lambda r, c, s: sp.csr_matrix(rng.normal(0.0, s, (r, c)))   # noqa: E731
    heads = tuple(Head(dense(16, d, 0.25), dense(16, d, 0.25), dense(16, d, 0.25), dense(d, 16, 0.25))
                  for _ in range(4))
    experts = tuple(Expert(dense(min(256, ts.complexity(k)), d, 0.125), rng.normal(0, 0.1, min(256, ts.complexity(k))),
                           dense(d, min(256, ts.complexity(k)), 0.125)) for k in range(K))
    w = Weights(tuple(ts.vocabulary.tokens), dense(V + 1, d, 1.0), dense(ts.L, d, 1.0), heads, dense(K, d, 8.0),
                rng.normal(0, 1, K), experts, dense(V, d, 1.0), tuple(ts.names), "top1-scaled",
                parameters={"trained": "random (benchmarks/trained.py)"})
    save(w, str(weights))
    return tasks, weights


def _commands(tasks: str, weights: str) -> dict[str, list[str]]:
    py, here = sys.executable, str(Path(__file__).resolve())
    return {"`check --weights`": [py, "-m", "verifier", "check", tasks, "--weights", weights, "--jobs", "1", "--quiet"],
            "numpy float64": [py, here, "--peer", "numpy", tasks, weights],
            "PyTorch float64": [py, here, "--peer", "torch", tasks, weights]}


def paired(models: dict[str, tuple[str, str, int]]) -> list[dict]:
    """Every command of every model (tasks, weights, runs), its runs in interleaved rounds after
    a warm-up one."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    out = []
    for name, (tasks, weights, runs) in models.items():
        cmds = _commands(tasks, weights)
        times: dict[str, list[float]] = {k: [] for k in cmds}
        info: dict[str, dict] = {}
        for r in range(runs + 1):
            for label, cmd in cmds.items():
                t = time.perf_counter()
                got = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
                wall = time.perf_counter() - t
                if got.returncode not in (0, 1):
                    raise RuntimeError(f"{cmd}: exit {got.returncode}: {got.stderr[-2000:]}")
                if r:
                    times[label].append(wall)
                if "--peer" in cmd:
                    info[label] = json.loads(got.stdout.strip().splitlines()[-1])
                else:
                    info[label] = {"verdict": got.stdout.strip().splitlines()[-1] if got.stdout.strip() else ""}
        out.append({"model": name, "times": times, "info": info})
    return out


def block(rows: list[dict], command: str) -> list[str]:
    from benchmarks.results import machine

    lines = ["## Trained models: certifying against running", "", f"Machine: {machine()}. Command: `{command}`.", "",
             "One process each, wall clock, medians of the runs (one BLAS thread each; the check's dense pass "
             "encloses every product, softmax and ablation the plain passes compute once).", "",
             "| model | queries | process | median (s) | runs (s) | ÷ best plain pass |", "|---|---|---|---|---|---|"]
    for r in rows:
        med = {k: float(np.median(v)) for k, v in r["times"].items()}
        best = min(med["numpy float64"], med["PyTorch float64"])
        q = r["info"]["numpy float64"]["queries"]
        for label, m in med.items():
            lines.append(f"| {r['model']} | {q:,} | {label} | {m:.2f} | "
                         f"{', '.join(f'{x:.2f}' for x in r['times'][label])} | {m / best:.2f}× |")
    lines += ["", "Peers' phases, last run (s): " + "; ".join(
        f"{r['model']} {label}: read {i['read_s']:.2f}, forward {i['forward_s']:.2f}"
        for r in rows for label, i in r["info"].items() if "read_s" in i)]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["F1000", "F10000", "large"],
                    help="F1000, F10000 (committed) and/or large (default: all three)")
    ap.add_argument("--large", type=int, default=50_000, help="facts of the random dense model (default 50000)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--large-runs", type=int, help="runs of the large model (default: --runs)")
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-trained"), help="where the large model is written")
    ap.add_argument("--out", help="write the block to this file instead of benchmarks/RESULTS.md")
    ap.add_argument("--peer", nargs=3, metavar=("KIND", "TASKS", "WEIGHTS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer:
        kind, tasks, weights = args.peer
        print(json.dumps((numpy_pass if kind == "numpy" else torch_pass)(tasks, weights)))
        return 0
    models = {}
    for name in args.models:
        if name == "large":
            t, w = large_model(args.large, Path(args.work) / f"F{args.large}")
            models[f"F{args.large} (random dense)"] = (str(t), str(w), args.large_runs or args.runs)
        else:
            models[name] = (*COMMITTED[name], args.runs)
    rows = paired(models)
    command = "python benchmarks/trained.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = block(rows, command.strip())
    if args.out:
        from benchmarks.results import write_block

        print("\n".join(lines))
        write_block("trained", "\n".join(lines), Path(args.out))
    else:
        from benchmarks.results import publish

        publish("trained", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
