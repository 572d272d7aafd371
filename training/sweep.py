"""The experiment grid: tasks x experts x objectives x seeds, written to ``docs/training/``.

For each number of tasks K the task set is ``tasks.synthetic.wikidata_like`` with
``facts_per_task · K`` facts and ``data_seed`` (one fixed set per K; the seeds vary the
training). Each run trains (:mod:`training.train`), evaluates in float64, exports with
the majority expert -> task mapping, runs the verifier (:func:`verifier.checks.verify.verify`)
and the verifier's per-query certified pass (:mod:`training.compare`), and records the
agreement between the two. The hand-built model (:func:`construction.model.build`) of
the same set is verified beside them.

Outputs (``--out``, default ``docs/training``):

* ``results.md``: the command, the per-run table, the per-configuration means, the
  side-by-side comparison with the hand-built model, the verifier's verdicts on trained
  weights (with one ``python -m verifier check`` transcript), and the heat maps;
* ``results.json``: every number (``--render`` re-renders the report from it);
* ``routing-K<K>.png``: Figure-2-style task x expert heat maps (needs matplotlib);
* ``tasks-K<K>.yaml``: the task sets, for ``python -m verifier check``.

Trained weights go to ``--weights-dir`` (default ``build/training``, ignored by git).

Usage::

    python -m training.sweep                       # 4, 8, 16 tasks; 3 objectives; seeds 0 1 2
    python -m training.sweep --configs 4x4 --seeds 0 --steps 300 --out /tmp/quick
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from training.objectives import OBJECTIVE_NAMES, OBJECTIVES

DEFAULT_OUT = os.path.join("docs", "training")
DEFAULT_WEIGHTS = os.path.join("build", "training")


@dataclass(frozen=True)
class RunSpec:
    n_tasks: int
    n_experts: int
    objective: str
    seed: int
    facts_per_task: int
    data_seed: int
    epsilon: float
    threads: int
    weights_dir: str | None
    train: dict  # TrainConfig fields (objective, seed, n_experts filled in per run)

    @property
    def name(self) -> str:
        return f"K{self.n_tasks}-E{self.n_experts}-{self.objective}-s{self.seed}"


@lru_cache(maxsize=8)
def task_set(n_tasks: int, facts_per_task: int, data_seed: int):
    """The synthetic set of a configuration (WikiData5M-shaped, see tasks.synthetic)."""
    from tasks.synthetic import wikidata_like

    return wikidata_like(facts_per_task * n_tasks, n_tasks=n_tasks, seed=data_seed)


def _check_failures(report) -> dict[str, int]:
    """Per verifier check, the number of tasks failing it (and foreign queries)."""
    return {
        "error": sum(not r.error_ok for r in report.tasks),
        "routing": sum(not r.routing_ok for r in report.tasks),
        "size": sum(not r.size_ok for r in report.tasks),
        "entanglement": sum(not r.entanglement_ok for r in report.tasks),
        "foreign_queries": int(report.foreign),
        "misrouted_queries": int(sum(r.misrouted for r in report.tasks)),
    }


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Train, evaluate, export, verify one configuration; a JSON-able record."""
    import torch

    from training.compare import agreement, certified_pass, routing_failures
    from training.data import query_data
    from training.export import to_weights
    from training.metrics import distinct_experts, parameter_counts
    from training.train import TrainConfig, evaluate, train
    import layout
    from verifier.checks.verify import verify

    torch.set_num_threads(spec.threads)
    ts = task_set(spec.n_tasks, spec.facts_per_task, spec.data_seed)
    data = query_data(ts)
    config = TrainConfig(**{**spec.train, "objective": spec.objective, "seed": spec.seed, "n_experts": spec.n_experts})
    result = train(ts, config, data=data, log_every=0)
    ev = evaluate(result.model, data)
    weights = to_weights(result.model, ts, "majority", routing=ev.routing, config=config)
    t0 = time.perf_counter()
    report = verify(ts, weights, spec.epsilon, source=spec.name)
    verify_seconds = time.perf_counter() - t0
    cert = certified_pass(ts, weights, data)
    path = None
    if spec.weights_dir:
        os.makedirs(spec.weights_dir, exist_ok=True)
        path = os.path.join(spec.weights_dir, spec.name + ".npz")
        layout.save(weights, path)
    return {
        "kind": "trained", "name": spec.name, "n_tasks": spec.n_tasks, "n_experts": spec.n_experts,
        "objective": spec.objective, "seed": spec.seed, "queries": len(data),
        **ev.summary(), "distinct_top_experts": distinct_experts(ev.routing),
        "routing_matrix": ev.routing.tolist(), "verifier_routing_matrix_equal": bool(np.array_equal(report.routing_matrix, ev.routing)),
        "agreement": agreement(ev, cert), "params": parameter_counts(weights, ev.expert),
        "routing_check": routing_failures(data, cert, weights.expert_tasks),
        "certified": bool(report.certified), "failures": _check_failures(report),
        "verifier_worst_error": float(report.measured_worst),
        "train_seconds": round(result.seconds, 2), "steps": result.steps, "verify_seconds": round(verify_seconds, 2),
        "expert_tasks": list(weights.expert_tasks), "weights": path, "config": asdict(config),
    }


def hand_built(n_tasks: int, facts_per_task: int, data_seed: int) -> dict[str, Any]:
    """Build and verify the hand-constructed model of a configuration's task set."""
    from construction.model import build
    from training.compare import certified_pass
    from training.data import query_data
    from workflow.check import check_built
    from training.metrics import distinct_experts, entropy, parameter_counts, purity

    ts = task_set(n_tasks, facts_per_task, data_seed)
    model = build(ts)
    weights = model.instantiate()
    report = check_built(ts, model, weights=weights)
    data = query_data(ts)
    cert = certified_pass(ts, weights, data)
    rows = np.arange(len(data))
    correct = (cert.predicted >= 0) & data.valid[rows, np.maximum(cert.predicted, 0)]
    m = report.routing_matrix
    return {
        "kind": "hand-built", "n_tasks": n_tasks, "n_experts": len(weights.experts), "queries": len(data),
        "object_accuracy": float(correct[data.object_query].mean()), "next_token_accuracy": float(correct.mean()),
        "max_error": float(report.measured_worst), "routing_purity": purity(m), "routing_entropy": entropy(m),
        "distinct_top_experts": distinct_experts(m), "routing_matrix": m.tolist(),
        "params": parameter_counts(weights, cert.expert), "certified": bool(report.certified),
        "failures": _check_failures(report), "epsilon": model.epsilon, "beta": str(model.beta), "gamma": str(model.gamma),
        "d": weights.d, "widths": [e.width for e in weights.experts], "verify_seconds": round(report.seconds, 2),
    }


def _dump_tasks(n_tasks: int, facts_per_task: int, data_seed: int, out: str) -> str:
    from tasks.io import dump_tasks

    path = os.path.join(out, f"tasks-K{n_tasks}.yaml")
    dump_tasks(task_set(n_tasks, facts_per_task, data_seed), path)
    return path


def _source_state() -> dict[str, Any]:
    """The repository commit and whether the code the sweep uses has local changes (read-only git)."""
    def git(*a: str) -> str | None:
        try:
            proc = subprocess.run(["git", *a], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "tasks", "construction", "verifier", "training")
    return {"commit": commit.strip() if commit else None,
            "local_changes": sorted(line[3:] for line in dirty.splitlines() if line.strip()) if dirty else []}


def _cli_transcript(tasks_yaml: str, weights: str) -> dict[str, Any]:
    """Run ``python -m verifier check`` on trained weights; keep the command and its output."""
    cmd = [sys.executable, "-m", "verifier", "check", tasks_yaml, "--weights", weights, "--quiet"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    shown = "python -m verifier check " + shlex.join([tasks_yaml, "--weights", weights])
    return {"command": shown, "exit": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


# --- rendering -------------------------------------------------------------------------

def _f(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _ms(values: Sequence[float], digits: int = 3) -> str:
    v = np.asarray(values, float)
    if v.size == 1:
        return _f(float(v[0]), digits)
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def _off_top(r: dict) -> int:
    """Task-determining queries that do not reach their task's most used expert."""
    m = np.asarray(r["routing_matrix"])
    return int(m.sum() - m.max(axis=1).sum())


def _failed_checks(f: dict[str, int], n_tasks: int) -> str:
    parts = [f"{k} {f[k]}/{n_tasks}" for k in ("error", "routing", "size", "entanglement") if f[k]]
    return ", ".join(parts) if parts else "none"


def render(data: dict[str, Any], out: str) -> str:
    """results.md from the sweep's JSON record."""
    runs = [r for r in data["runs"] if r["kind"] == "trained"]
    built = {r["n_tasks"]: r for r in data["runs"] if r["kind"] == "hand-built"}
    args = data["settings"]
    L: list[str] = []
    L.append("# Training experiments: routing under three objectives (reproducing the paper's section 6)")
    L.append("")
    L.append("Generated by `training/sweep.py`; do not edit by hand. Command:")
    L.append("")
    L.append("```sh")
    L.append(data["command"])
    L.append("```")
    L.append("")
    L.append(f"Environment: Python {data['python']}, torch {data['torch']}, {data['cpus']} CPU(s), "
             f"{args['threads']} torch thread(s) per run, {args['jobs']} run(s) in parallel; total {data['seconds']:.0f} s.")
    src = data.get("source") or {}
    if src.get("commit"):
        changed = src.get("local_changes") or []
        L.append("")
        L.append(f"Code: commit `{src['commit']}`" + (f", with local changes to {', '.join(f'`{c}`' for c in changed[:12])}"
                                                       f"{' ...' if len(changed) > 12 else ''}" if changed else ", no local changes")
                 + " (the task sets come from `tasks/synthetic.py`; a different generator gives different sets).")
    L.append("")
    t = args["train"]
    L.append("**Setup.** Task sets: `tasks.synthetic.wikidata_like(facts_per_task · K, n_tasks=K, "
             f"seed={args['data_seed']})` with facts_per_task = {args['facts_per_task']} (Zipf dictionary sizes, "
             "1-5 templates per task, shared entity pool and shared template prefixes); one set per K, the seeds vary "
             "the initialisation. Model: the verifier's layout (`layout/`) with "
             f"d = {t['d']}, {t['n_heads']} heads of width {t['d_head']}, experts of {t['expert_width']} ReLU neurons, "
             "gate_mode `top1-scaled` (y = r + softmax(g)_e · expert_e(r)), no layer norm. Training: every query "
             "(proper prefix) once per step, full batch, loss −log Σ_{v valid} p(v) (the verifier's error "
             f"1 − P(valid) in log form; no sampling of a target), Adam lr {t['lr']}, {t['steps']} steps "
             f"(warm-up {t['warmup']}, cosine to 10%), float32. Objectives: **CE**; **CE + load balancing** "
             f"α·K·Σ_i f_i·P_i with α = {t['alpha']}; **CE + task router** λ·CE(gate scores, task) on task-determining "
             f"queries, λ = {t['lam']}, expert i ↔ task i.")
    L.append("")
    L.append("**Measures** (float64 evaluation of the trained weights, all queries): *object acc.* = share of object "
             "queries (⋆2 next) whose argmax token is the fact's object; *next-token acc.* = share of all queries "
             "whose argmax is a valid next token; *purity* = per task, share of its task-determining queries at its most "
             "used expert, averaged over tasks; *entropy* = per task, entropy (bits) of its routing distribution, "
             "averaged (0 = one expert, log2 K = uniform); *top experts* = number of distinct experts that are some "
             "task's most used one (K = one-to-one); *off top* = task-determining queries not at their task's most used "
             "expert (purity is rounded; this count is exact). *verifier* = verdict of `verifier.checks.verify.verify` at "
             f"ε = {args['epsilon']} on the exported weights with the majority expert → task mapping, and which checks "
             "fail (number of tasks failing each). *agrees*: the verifier's certified pass routes every query to the "
             "same expert as the float64 torch pass, and every float64 error lies in the certified enclosure (± 1e-9).")
    L.append("")

    # Per-configuration means.
    L.append("## Summary (mean ± std over seeds)")
    L.append("")
    L.append("| tasks | experts | objective | object acc. | next-token acc. | purity | entropy (bits) | top experts | off top | certified |")
    L.append("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    configs = sorted({(r["n_tasks"], r["n_experts"]) for r in runs})
    for K, E in configs:
        for obj in OBJECTIVES:
            rs = [r for r in runs if (r["n_tasks"], r["n_experts"], r["objective"]) == (K, E, obj)]
            if not rs:
                continue
            L.append(f"| {K} | {E} | {OBJECTIVE_NAMES[obj]} | {_ms([r['object_accuracy'] for r in rs])} | "
                     f"{_ms([r['next_token_accuracy'] for r in rs])} | {_ms([r['routing_purity'] for r in rs])} | "
                     f"{_ms([r['routing_entropy'] for r in rs], 2)} | {_ms([r['distinct_top_experts'] for r in rs], 1)} | "
                     f"{_ms([_off_top(r) for r in rs], 1)} / {int(np.sum(rs[0]['routing_matrix']))} | "
                     f"{sum(r['certified'] for r in rs)}/{len(rs)} |")
    L.append("")

    # Figures.
    figs = [f for f in data.get("figures", []) if f]
    if figs:
        L.append("## Routing heat maps (Figure 2 style)")
        L.append("")
        L.append("Rows: tasks; columns: experts in index order; cell: share of the task's task-determining queries "
                 "routed to the expert. Seed 0 of each objective, and the hand-built model.")
        L.append("")
        for f in figs:
            L.append(f"![routing]({os.path.basename(f)})")
            L.append("")

    # Side by side.
    L.append("## Hand-built versus trained")
    L.append("")
    L.append("Parameters count **nonzero entries**: for the dense trained models that is every parameter except a "
             "few biases b_1 still at their initial 0 (neurons that never fired, hence the small differences); the "
             "hand-built model is sparse and its structural zeros are not counted. *Active per query* = all "
             "non-expert parameters (embeddings, heads, gate, unembedding) + the routed expert's, averaged over the "
             "queries. Trained rows: mean over seeds. *certified*: the verifier's verdict at ε = "
             f"{args['epsilon']}.")
    L.append("")
    L.append("| tasks | model | d | total params | active / query | object acc. | next-token acc. | purity | max error | certified |")
    L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for K in sorted({c[0] for c in configs} | set(built)):
        if K in built:
            b = built[K]
            L.append(f"| {K} | hand-built (Theorem 4.2), {b['n_experts']} experts, widths {min(b['widths'])}-{max(b['widths'])} | {b['d']} | "
                     f"{b['params']['total']:,} | {b['params']['active']:,.0f} | {_f(b['object_accuracy'])} | "
                     f"{_f(b['next_token_accuracy'])} | {_f(b['routing_purity'])} | {b['max_error']:.2e} | "
                     f"{'yes' if b['certified'] else 'no'} |")
        for E in sorted({c[1] for c in configs if c[0] == K}):
            for obj in OBJECTIVES:
                rs = [r for r in runs if (r["n_tasks"], r["n_experts"], r["objective"]) == (K, E, obj)]
                if not rs:
                    continue
                L.append(f"| {K} | trained, {OBJECTIVE_NAMES[obj]}, {E} experts × {rs[0]['config']['expert_width']} | "
                         f"{rs[0]['config']['d']} | {rs[0]['params']['total']:,} | "
                         f"{np.mean([r['params']['active'] for r in rs]):,.0f} | {_f(np.mean([r['object_accuracy'] for r in rs]))} | "
                         f"{_f(np.mean([r['next_token_accuracy'] for r in rs]))} | {_f(np.mean([r['routing_purity'] for r in rs]))} | "
                         f"{np.mean([r['max_error'] for r in rs]):.2e} | {sum(r['certified'] for r in rs)}/{len(rs)} |")
    L.append("")

    # Every run.
    L.append("## Every run")
    L.append("")
    L.append("| tasks | experts | objective | seed | object acc. | next-token acc. | purity | entropy (bits) | "
             "top experts | off top | max error | verifier: failing checks | agrees | train s | verify s |")
    L.append("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
    for r in sorted(runs, key=lambda r: (r["n_tasks"], r["n_experts"], OBJECTIVES.index(r["objective"]), r["seed"])):
        a = r["agreement"]
        agrees = a["expert_mismatches"] == 0 and a["outside"] == 0 and r["verifier_routing_matrix_equal"]
        L.append(f"| {r['n_tasks']} | {r['n_experts']} | {OBJECTIVE_NAMES[r['objective']]} | {r['seed']} | "
                 f"{_f(r['object_accuracy'])} | {_f(r['next_token_accuracy'])} | {_f(r['routing_purity'])} | "
                 f"{_f(r['routing_entropy'], 2)} | {r['distinct_top_experts']} | {_off_top(r)} | {r['max_error']:.2e} | "
                 f"{'certified' if r['certified'] else _failed_checks(r['failures'], r['n_tasks'])} | "
                 f"{'yes' if agrees else 'NO'} ({a['queries']} queries) | {r['train_seconds']:.0f} | {r['verify_seconds']:.1f} |")
    cut = [r["name"] for r in runs if r["steps"] < r["config"]["steps"]]
    if cut:
        L.append(f"Stopped early by the time limit ({args['time_limit']} s): {', '.join(cut)}.")
    L.append("")

    # Verifier transcript.
    tr = data.get("transcript")
    if tr:
        L.append("## The verifier on trained weights")
        L.append("")
        L.append("Trained models are not expected to certify. Transcript of one check (exit status "
                 f"{tr['exit']}: 0 certified, 1 not certified):")
        L.append("")
        L.append("```text")
        L.append(f"$ {tr['command']}")
        L.append(tr["stdout"].rstrip())
        L.append("```")
        L.append("")
    L.append("## What held, against the paper's claims")
    L.append("")
    L.extend(_claims(runs, built))
    L.append("")
    return "\n".join(L)


def _claims(runs: list[dict], built: dict[int, dict]) -> list[str]:
    """Plain statements computed from the numbers (no tuning of the wording to the result)."""
    out = []

    def mean(obj: str, key: str) -> float:
        v = [r[key] for r in runs if r["objective"] == obj]
        return float(np.mean(v)) if v else float("nan")

    pr, pc, pl = mean("router", "routing_purity"), mean("ce", "routing_purity"), mean("lb", "routing_purity")
    out.append(f"* **Routing.** Mean purity over all configurations and seeds: CE {pc:.3f}, CE + load balancing "
               f"{pl:.3f}, CE + task router {pr:.3f}; mean entropy {mean('ce', 'routing_entropy'):.2f} / "
               f"{mean('lb', 'routing_entropy'):.2f} / {mean('router', 'routing_entropy'):.2f} bits.")
    one_to_one = [r for r in runs if r["objective"] == "router"
                  and r["distinct_top_experts"] == min(r["n_tasks"], r["n_experts"])]
    n_router = sum(r["objective"] == "router" for r in runs)
    out.append(f"  Under the task-router loss {len(one_to_one)}/{n_router} runs route one-to-one (every task has its "
               "own most used expert).")
    oc, ol, orr = mean("ce", "object_accuracy"), mean("lb", "object_accuracy"), mean("router", "object_accuracy")
    out.append(f"* **Accuracy.** Mean object-query accuracy: CE {oc:.3f}, CE + load balancing {ol:.3f}, "
               f"CE + task router {orr:.3f}; next-token accuracy {mean('ce', 'next_token_accuracy'):.3f} / "
               f"{mean('lb', 'next_token_accuracy'):.3f} / {mean('router', 'next_token_accuracy'):.3f}.")
    cert = sum(r["certified"] for r in runs)
    out.append(f"* **Verification.** {cert}/{len(runs)} trained models certify at the verifier's ε; "
               f"{sum(b['certified'] for b in built.values())}/{len(built)} hand-built models do.")
    for obj in OBJECTIVES:
        rs = [r for r in runs if r["objective"] == obj]
        if rs:
            fails = ", ".join(f"{c} {sum(r['failures'][c] > 0 for r in rs)}/{len(rs)}"
                              for c in ("error", "routing", "size", "entanglement"))
            off = sum(_off_top(r) for r in rs)
            det = sum(int(np.sum(r["routing_matrix"])) for r in rs)
            rc = [r["routing_check"] for r in rs if "routing_check" in r]
            split = ""
            if rc:
                split = (f"; the verifier's routing rule (certified winner serving a consistent task, majority mapping) "
                         f"fails on {sum(c['determined_misrouted'] for c in rc)} of {sum(c['determined'] for c in rc)} "
                         f"task-determining queries and {sum(c['shared_misrouted'] for c in rc)} of "
                         f"{sum(c['shared'] for c in rc)} prefixes shared by several tasks")
            out.append(f"  {OBJECTIVE_NAMES[obj]}: runs failing each check: {fails}; task-determining queries off "
                       f"their task's top expert: {off} of {det}{split}.")
    agree = sum(r["agreement"]["expert_mismatches"] == 0 and r["agreement"]["outside"] == 0 for r in runs)
    out.append(f"* **Consistency.** In {agree}/{len(runs)} runs the verifier's certified pass and the training "
               "code's float64 pass agree on every query's expert and error.")
    return out


# --- driver ------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    from training.train import TrainConfig

    from tasks.console import Parser, epsilon
    from training.options import add_model_flags

    p = Parser(prog="python -m training.sweep", description=(
        "Train single-layer MoE transformers under three objectives over a grid of tasks x experts x seeds, "
        "verify them, and write docs/training/results.md with heat maps."))
    p.add_argument("--configs", nargs="+", default=["4x4", "8x8", "16x16"], metavar="TASKSxEXPERTS",
                   help="configurations, e.g. 4x4 8x8 16x16 (default)")
    p.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--facts-per-task", type=int, default=20)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--epsilon", type=epsilon, default=0.01, help="the verifier's target error")
    add_model_flags(p, TrainConfig())
    p.add_argument("--time-limit", type=float, default=150.0, help="seconds of training per run at most")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default docs/training)")
    p.add_argument("--weights-dir", default=DEFAULT_WEIGHTS, help="where trained .npz files go ('' for nowhere)")
    p.add_argument("--no-plots", action="store_true", help="skip the heat maps")
    p.add_argument("--render", action="store_true", help="only re-render results.md (and plots) from OUT/results.json")
    return p


def _parse_config(text: str) -> tuple[int, int]:
    try:
        a, b = text.lower().split("x")
        K, E = int(a), int(b)
    except ValueError:
        raise SystemExit(f"error: configuration {text!r} is not TASKSxEXPERTS (e.g. 8x8)") from None
    if K < 1 or E < 1:
        raise SystemExit(f"error: configuration {text!r} needs at least one task and one expert")
    return K, E


def _figures(data: dict[str, Any], out: str) -> list[str]:
    from training.plots import routing_panels

    runs = [r for r in data["runs"] if r["kind"] == "trained"]
    built = {r["n_tasks"]: r for r in data["runs"] if r["kind"] == "hand-built"}
    paths = []
    for K, E in sorted({(r["n_tasks"], r["n_experts"]) for r in runs}):
        panels = []
        if K in built and built[K]["n_experts"] == E:
            b = built[K]
            panels.append((f"hand-built\npurity {b['routing_purity']:.2f}", np.array(b["routing_matrix"])))
        for obj in OBJECTIVES:
            rs = sorted([r for r in runs if (r["n_tasks"], r["n_experts"], r["objective"]) == (K, E, obj)],
                        key=lambda r: r["seed"])
            if rs:
                r = rs[0]
                panels.append((f"{OBJECTIVE_NAMES[obj]} (seed {r['seed']})\npurity {r['routing_purity']:.2f}, "
                               f"obj. acc. {r['object_accuracy']:.2f}", np.array(r["routing_matrix"])))
        name = f"routing-K{K}.png" if K == E else f"routing-K{K}-E{E}.png"
        paths.append(routing_panels(panels, os.path.join(out, name), f"{K} tasks, {E} experts"))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = args.out
    os.makedirs(out, exist_ok=True)
    json_path = os.path.join(out, "results.json")
    if args.render:
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
    else:
        import torch

        from training.train import TrainConfig

        configs = [_parse_config(c) for c in args.configs]
        from training.options import model_changes

        base = replace(TrainConfig(), time_limit=args.time_limit, **model_changes(args))
        specs = [RunSpec(K, E, obj, s, args.facts_per_task, args.data_seed, args.epsilon, args.threads,
                         args.weights_dir or None, asdict(base))
                 for K, E in configs for obj in args.objectives for s in args.seeds]
        start = time.perf_counter()
        source = _source_state()
        runs: list[dict] = []
        for K in sorted({K for K, _ in configs}):
            _dump_tasks(K, args.facts_per_task, args.data_seed, out)
            print(f"hand-built model, {K} tasks ...", file=sys.stderr, flush=True)
            runs.append(hand_built(K, args.facts_per_task, args.data_seed))

        def done(r: dict) -> None:
            runs.append(r)
            print(f"{r['name']}: object acc {r['object_accuracy']:.3f}, purity {r['routing_purity']:.3f}, "
                  f"{r['train_seconds']:.0f}s", file=sys.stderr, flush=True)

        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                for r in pool.map(run_one, specs):
                    done(r)
        else:
            for s in specs:
                done(run_one(s))
        transcript = None
        saved = [r for r in runs if r["kind"] == "trained" and r.get("weights")]
        saved.sort(key=lambda r: (r["objective"] != "router", r["n_tasks"], r["seed"]))
        example = saved[0] if saved else None
        if example is not None:
            transcript = _cli_transcript(os.path.join(out, f"tasks-K{example['n_tasks']}.yaml"), example["weights"])
        settings = {k: v for k, v in vars(args).items() if k not in ("render",)}
        settings["train"] = asdict(base)
        data = {
            "command": "python -m training.sweep" + ("" if not argv and len(sys.argv) <= 1 else " " + shlex.join(list(argv if argv is not None else sys.argv[1:]))),
            "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "seconds": time.perf_counter() - start, "settings": settings, "runs": runs, "transcript": transcript,
            "source": source,
        }
    if not args.no_plots:
        try:
            data["figures"] = _figures(data, out)
        except RuntimeError as exc:
            print(f"note: no heat maps ({exc})", file=sys.stderr)
            data["figures"] = []
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(render(data, out))
    print(f"wrote {os.path.join(out, 'results.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
