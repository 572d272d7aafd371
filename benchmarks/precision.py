"""Precision benchmark: what a float certificate costs, against the runtimes users run.

    python benchmarks/precision.py                       # -> benchmarks/RESULTS.md, block "precision"
    python benchmarks/precision.py --sets capitals --out /tmp/r.md   # quick

For each task set (the two bundled examples and generated sets) the model is built once;
then, over every query, one process each: the exact certified pass
(:func:`verifier.checks.verify.verify`), the float32 certified pass (``deployment=float32``),
ONNX Runtime on the exported float32 graph (uncertified; default optimisations, its own
threads), and the PyTorch model of ``training/`` loaded with the same weights in float32
(uncertified; skipped where its dense padded heads would not fit). Columns: seconds of
each, the float32 certificate's worst error and margin below ε, and the ratio of the
float32 certificate's time to ONNX Runtime's. One run each; nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, write_block  # noqa: E402

SETS = ("capitals", "geography", "generated-3k", "generated-30k", "generated-100k")
FILES = {"capitals": "examples/capitals.yaml", "geography": "examples/geography/tasks.yaml"}


def load(name: str):
    from tasks.io import load_tasks
    from tasks.synthetic import wikidata_like

    if name == "capitals":
        return load_tasks(str(ROOT / "examples/capitals.yaml"))
    if name == "geography":
        return load_tasks(str(ROOT / "examples/geography/tasks.yaml"))
    n = int(name.split("-")[1].rstrip("k")) * 1000
    return wikidata_like(n, seed=0)


def one(name: str) -> dict:
    import numpy as np

    from construction.model import build
    from verifier.passes.batches import batches
    from verifier.passes.floating import Deployment
    from verifier.checks.verify import token_map, verify

    ts = load(name)
    weights = build(ts).instantiate()
    eps = ts.epsilon or 0.01
    row = {"set": name, "facts": ts.n_facts, "V": len(weights.vocab), "d": weights.d}
    start = time.perf_counter()
    exact = verify(ts, weights, eps)
    row["exact"] = time.perf_counter() - start
    row["queries"] = exact.queries
    start = time.perf_counter()
    f32 = verify(ts, weights, eps, deployment=Deployment.named("float32"))
    row["float32"] = time.perf_counter() - start
    row["worst"], row["certified"] = f32.measured_worst, f32.certified
    row["margin"] = eps - f32.measured_worst
    tmap = token_map(ts, weights)
    queries = [tmap[b.tokens] for b in batches(ts, chunk=4096)]
    try:
        import onnxruntime as ort

        from layout.onnx_graph import to_onnx

        session = ort.InferenceSession(to_onnx(weights).SerializeToString(), providers=["CPUExecutionProvider"])
        start = time.perf_counter()
        for tokens in queries:
            session.run(None, {"tokens": tokens})
        row["onnx"] = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - a missing extra or a model too large for ONNX
        row["onnx"] = None
        row["onnx_why"] = str(exc).splitlines()[0][:60]
    if name in FILES:        # the whole command, as a user runs it (start-up, build, evidence, pass)
        import subprocess

        for label, extra in (("check", []), ("check_f32", ["--precision", "float32"])):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "verifier", "check", str(ROOT / FILES[name]), "--quiet", *extra],
                           check=True, capture_output=True, cwd=str(ROOT))
            row[label] = time.perf_counter() - start
    dh = max([0] + [max(h.W_Q.shape[0], h.W_V.shape[0]) for h in weights.heads])
    if len(weights.heads) * dh * weights.d * 4 * 4 < 2e9:
        import torch

        from training.export import from_weights

        net = from_weights(weights, torch.float32)
        start = time.perf_counter()
        with torch.no_grad():
            for tokens in queries:
                n, p = tokens.shape
                ids = torch.from_numpy(np.concatenate([np.full((n, 1), weights.bos), tokens], axis=1))
                torch.softmax(net(ids, torch.full((n,), p, dtype=torch.int64)).logits, dim=-1)
        row["torch"] = time.perf_counter() - start
    else:
        row["torch"] = None
    return row


def table(rows: list[dict]) -> str:
    def s(x):
        return "—" if x is None else f"{x:.2f}"

    lines = ["| set | facts | queries | V | d | exact pass (s) | float32 pass (s) | float32 ÷ exact pass "
             "| `check` (s) | `check --precision float32` (s) | float32 ÷ exact, whole command "
             "| ONNX Runtime float32 (s) | PyTorch float32 (s) | float32 worst error | margin | certified |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        whole = f"{r['check_f32'] / r['check']:.2f}×" if r.get("check") else "—"
        lines.append(f"| {r['set']} | {r['facts']:,} | {r['queries']:,} | {r['V']:,} | {r['d']:,} | {s(r['exact'])} | "
                     f"{s(r['float32'])} | {r['float32'] / r['exact']:.2f}× | {s(r.get('check'))} | "
                     f"{s(r.get('check_f32'))} | {whole} | {s(r.get('onnx'))} | {s(r.get('torch'))} | "
                     f"{r['worst']:.4e} | {r['margin']:.2e} | {'yes' if r['certified'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    p.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/RESULTS.md)")
    args = p.parse_args(argv)
    rows = []
    for name in args.sets:
        print(f"[{name}] running ...", file=sys.stderr)
        rows.append(one(name))
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    text = (f"## Precision\n\nMachine: {machine()}. Command: `python benchmarks/precision.py` (one run each).\n\n"
            f"{table(rows)}\n\nThe certified passes cover every query with enclosures (exact: the exact forward "
            f"pass; float32: every float32 execution, docs/precision.md), both on the compiled kernels, one "
            f"process; the whole commands (examples only) include start-up, the build, the construction's "
            f"evidence and the pass. ONNX Runtime and PyTorch compute one float32 execution of the same weights, "
            f"uncertified (ONNX Runtime with dense matrices, refused beyond 1.5 GB; PyTorch with heads padded to "
            f"the widest, skipped where that does not fit).")
    kwargs = {"path": args.out} if args.out else {}
    write_block("precision", text, **kwargs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
