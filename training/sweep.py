"""The experiment grid: tasks x experts x objectives x seeds, written to ``docs/training/``.

For each number of tasks K the task set is ``tasks.synthetic.wikidata_like`` with
``facts_per_task · K`` facts and ``data_seed`` (one fixed set per K; the seeds vary the
training). Each run trains (:mod:`training.loop`), evaluates in float64, exports with
the majority expert -> task mapping, runs the verifier (:func:`verifier.checks.verify.verify`)
and the verifier's per-query certified pass (:mod:`training.compare`), and records the
agreement between the two. The hand-built model (:func:`construction.model.build`) of
the same set is verified beside them.

The ``localize`` objective (the recipe aimed at the certificate) trains with
counterexample rounds (:func:`training.rounds.until_certified`), experts sized to c(k)
and the declared mapping (expert k serves task k). ``--sets`` adds larger task sets
(``FACTSxTASKS[@DATA_SEED]``, e.g. ``1000x16 10000x16``), trained with
``--set-objectives`` (default: localize only), minibatches and a time budget.

Every run also records the *strengthened entanglement check* per object query in
float64 (:func:`training.metrics.localization`: with the routed expert's output
removed, P(object) ≤ 1/|O_k| and the object not the top token) and the share of queries
passing each check per task (:class:`training.rounds.QueryChecks`). Its *certified*
column is the verifier's verdict together with that localization measure on every
object query; where the verifier certifies localization itself (its task records carry
``worst_ablated_object_probability``) its figures are recorded beside.

Outputs (``--out``, default ``docs/training``):

* ``results.md``: the command, the per-run table, the per-configuration means, the
  side-by-side comparison with the hand-built model, the verifier's verdicts on trained
  weights (with one ``python -m verifier check`` transcript), and the heat maps;
* ``results.json``: every number (``--render`` re-renders the report from it);
* ``routing-K<K>.png``, ``routing-F<FACTS>-K<TASKS>-d<SEED>.png``: Figure-2-style task x
  expert heat maps (needs matplotlib);
* ``tasks-K<K>.yaml``, ``tasks-F<FACTS>-K<TASKS>-d<SEED>.yaml``: the task sets, for
  ``python -m verifier check``.

Trained weights go to ``--weights-dir`` (default ``build/training``, ignored by git).

Usage::

    python -m training.sweep                       # 4, 8, 16 tasks; 4 objectives; seeds 0 1 2; the large sets
    python -m training.sweep --configs 4x4 --seeds 0 --steps 300 --sets --out /tmp/quick
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
    n_facts: int
    data_seed: int
    epsilon: float
    threads: int
    weights_dir: str | None
    train: dict  # TrainConfig fields (objective, seed, n_experts filled in per run)
    rounds: dict  # until_certified arguments (localize): max_rounds, round_steps, time_budget
    group: str = "grid"   # "grid" or "sets" (the larger task sets)

    @property
    def name(self) -> str:
        data = f"F{self.n_facts}-d{self.data_seed}-" if self.group == "sets" else ""
        return f"{data}K{self.n_tasks}-E{self.n_experts}-{self.objective}-s{self.seed}"


@lru_cache(maxsize=8)
def task_set(n_facts: int, n_tasks: int, data_seed: int):
    """The synthetic set of a configuration (WikiData5M-shaped, see tasks.synthetic)."""
    from tasks.synthetic import wikidata_like

    return wikidata_like(n_facts, n_tasks=n_tasks, seed=data_seed)


def _check_failures(report) -> dict[str, int]:
    """Per verifier check, the number of tasks failing it (and foreign queries)."""
    from verifier.checks import catalogue

    return {
        **{c.name: sum(not r.ok(c) for r in report.tasks) for c in catalogue.CHECKS},
        "foreign_queries": int(report.foreign),
        "misrouted_queries": int(report.misrouted_queries),
    }


def _verifier_localization(report) -> dict[str, Any]:
    """The verifier's own localization figure: the largest certified upper end of
    P_ablated(o) over the tasks with object queries (None without any)."""
    worst = [r.worst_p_ablated for r in report.tasks if r.object_queries]
    if not worst:
        return {"verifier_worst_ablated_object_probability": None}
    return {"verifier_worst_ablated_object_probability": float(max(worst))}


def _graded(data, weights, cert, ev, epsilon: float) -> dict[str, Any]:
    """The per-check shares: overall and, per task, the share of its queries passing."""
    from training.rounds import query_checks

    checks = query_checks(data, weights, cert, ev.localization, epsilon, slack=False)
    per_task = {c: [None if np.isnan(x) else float(x) for x in v] for c, v in checks.task_shares(data).items()}
    return {"shares": checks.shares(), "task_shares": per_task}


def _localization_record(ev, data) -> dict[str, Any]:
    loc = ev.localization
    T = len(data.task_names)
    return {"localized": bool(loc.holds.all()),
            "worst_ablated_object_probability_per_task": [None if np.isnan(x) else float(x)
                                                          for x in loc.worst_probability(T)],
            "localized_share_per_task": [None if np.isnan(x) else float(x) for x in loc.share_per_task(T)],
            "n_objects": data.n_objects.tolist()}


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Train, evaluate, export, verify one configuration; a JSON-able record."""
    import torch

    from training.compare import agreement, certified_pass, routing_failures
    from training.data import query_data
    from training.export import to_weights
    from training.metrics import distinct_experts, parameter_counts
    from training.loop import TrainConfig, evaluate, train
    import layout
    from verifier.checks.verify import verify

    torch.set_num_threads(spec.threads)
    ts = task_set(spec.n_facts, spec.n_tasks, spec.data_seed)
    data = query_data(ts)
    config = TrainConfig(**{**spec.train, "objective": spec.objective, "seed": spec.seed, "n_experts": spec.n_experts,
                            "epsilon": spec.epsilon})
    rounds, cert, report = None, None, None
    if spec.objective == "localize":
        from training.rounds import until_certified

        def said(r) -> None:
            print(f"{spec.name}: round {r.round}, {r.steps} steps in {r.train_seconds:.0f}s, certified share "
                  f"{r.shares['certified']:.4f} {r.shares}", file=sys.stderr, flush=True)

        res = until_certified(ts, config, data=data, log=said, **spec.rounds)
        model, ev, weights = res.model, res.evaluation, res.weights
        rounds = [r.to_dict() for r in res.rounds]
        train_seconds, steps = res.train_seconds, res.steps
        cert = res.cert              # the last round's pass on these very weights (minutes at 10,000 facts), if run
        report = res.report          # the verifier's report on these very weights, if the last round ran it
    else:
        result = train(ts, config, data=data, log_every=0)
        model, train_seconds, steps = result.model, result.seconds, result.steps
        ev = evaluate(model, data)
        weights = to_weights(model, ts, "majority", routing=ev.routing, config=config,
                             extra={"rounds": 1, "total_steps": steps, "train_seconds": round(train_seconds, 2),
                                    "check_seconds": 0.0})
    t0 = time.perf_counter()
    if report is None:
        report = verify(ts, weights, spec.epsilon, source=spec.name)
    # 0 when the last round's verify is reused (its time is in the round's checks)
    verify_seconds = time.perf_counter() - t0
    if cert is None:
        cert = certified_pass(ts, weights, data, ablate_objects=True)
    path = None
    if spec.weights_dir:
        os.makedirs(spec.weights_dir, exist_ok=True)
        path = os.path.join(spec.weights_dir, spec.name + ".npz")
        # the same floats (float32-exact), a third of the bytes
        layout.save(weights, path, small_indices=True, narrow=True)
    loc = _localization_record(ev, data)
    return {
        "kind": "trained", "group": spec.group, "name": spec.name, "n_tasks": spec.n_tasks, "n_experts": spec.n_experts,
        "n_facts": spec.n_facts, "data_seed": spec.data_seed,
        "objective": spec.objective, "seed": spec.seed, "queries": len(data),
        "object_queries": int(data.object_query.sum()), "vocabulary": data.V,
        **ev.summary(), "distinct_top_experts": distinct_experts(ev.routing),
        "routing_matrix": ev.routing.tolist(),
        "verifier_routing_matrix_equal": bool(np.array_equal(report.routing_matrix, ev.routing)),
        "agreement": agreement(ev, cert), "params": parameter_counts(weights, ev.expert),
        "routing_check": routing_failures(data, cert, weights.expert_tasks),
        "verifier_certified": bool(report.certified), **loc,
        "certified": bool(report.certified) and loc["localized"],
        "failures": _check_failures(report), **_verifier_localization(report),
        **_graded(data, weights, cert, ev, spec.epsilon),
        "verifier_worst_error": float(report.measured_worst),
        "train_seconds": round(train_seconds, 2), "steps": steps, "verify_seconds": round(verify_seconds, 2),
        "rounds": rounds, "expert_tasks": list(weights.expert_tasks),
        "expert_widths": [e.width for e in weights.experts],
        "weights": path, "config": asdict(config),
    }


def hand_built(n_facts: int, n_tasks: int, data_seed: int, group: str = "grid") -> dict[str, Any]:
    """Build and verify the hand-constructed model of a configuration's task set.

    Its ablated logits are exactly 0 when U reads no direction E, P or a head writes
    (:func:`training.metrics.ablated_logits_vanish`, the hand-built structure): then
    P_ablated(o) = 1/V exactly for every object query. Otherwise the float64 measure of
    the torch copy is recorded (small sets only)."""
    from construction.model import build
    from training.compare import certified_pass
    from training.data import query_data
    from workflow.check import check_built
    from training.metrics import ablated_logits_vanish, distinct_experts, entropy, parameter_counts, purity

    ts = task_set(n_facts, n_tasks, data_seed)
    model = build(ts)
    weights = model.instantiate()
    # The rebuild-without-each-task evidence (isolation) rebuilds the construction once per task:
    # minutes at 10,000 facts, and evidence about the construction only; the larger sets skip it.
    report = check_built(ts, model, weights=weights, isolation=group == "grid")
    data = query_data(ts)
    cert = certified_pass(ts, weights, data)
    rows = np.arange(len(data))
    correct = (cert.predicted >= 0) & data.valid[rows, np.maximum(cert.predicted, 0)]
    m = report.routing_matrix
    if ablated_logits_vanish(weights):
        worst, how, localized = 1.0 / len(weights.vocab), "exact: ablated logits all 0 (sparsity)", True
    else:
        import torch

        from training.export import from_weights
        from training.loop import evaluate

        ev = evaluate(from_weights(weights, torch.float64), data)
        worst, how = float(ev.localization.probability.max()), "float64"
        localized = bool(ev.localization.holds.all())
    return {
        "kind": "hand-built", "group": group, "n_tasks": n_tasks, "n_facts": n_facts, "data_seed": data_seed,
        "n_experts": len(weights.experts), "queries": len(data), "vocabulary": data.V,
        "object_accuracy": float(correct[data.object_query].mean()), "next_token_accuracy": float(correct.mean()),
        "max_error": float(report.measured_worst), "routing_purity": purity(m), "routing_entropy": entropy(m),
        "distinct_top_experts": distinct_experts(m), "routing_matrix": m.tolist(),
        "params": parameter_counts(weights, cert.expert), "verifier_certified": bool(report.certified),
        "certified": bool(report.certified) and localized, "localized": localized,
        "worst_ablated_object_probability": worst, "ablated_measure": how, **_verifier_localization(report),
        "failures": _check_failures(report), "isolation_checked": group == "grid", "epsilon": model.epsilon,
        "beta": str(model.beta), "gamma": str(model.gamma),
        "d": weights.d, "widths": [e.width for e in weights.experts], "verify_seconds": round(report.seconds, 2),
    }


def _set_name(n_facts: int, n_tasks: int, data_seed: int) -> str:
    return f"F{n_facts}-K{n_tasks}-d{data_seed}"


def _dump_tasks(n_facts: int, n_tasks: int, data_seed: int, out: str, name: str) -> str:
    from tasks.io import dump_tasks

    path = os.path.join(out, f"tasks-{name}.yaml")
    dump_tasks(task_set(n_facts, n_tasks, data_seed), path)
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


def _g(x: float | None) -> str:
    """A probability or error in 3 significant digits."""
    return "-" if x is None else f"{x:.3g}"


def _ms(values: Sequence[float], digits: int = 3) -> str:
    v = np.asarray(values, float)
    if v.size == 1:
        return _f(float(v[0]), digits)
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def _off_top(r: dict) -> int:
    """Task-determining queries that do not reach their task's most used expert."""
    m = np.asarray(r["routing_matrix"])
    return int(m.sum() - m.max(axis=1).sum())


def _failed_checks(r: dict) -> str:
    f, n_tasks = r["failures"], r["n_tasks"]
    parts = [f"{k} {f[k]}/{n_tasks}" for k in ("error", "routing", "size", "entanglement") if f[k]]
    loc = r.get("localized_share_per_task") or []
    bad = sum(1 for x in loc if x is not None and x < 1)
    if bad:
        parts.append(f"localization {bad}/{n_tasks}")
    return ", ".join(parts) if parts else "none"


def _worst_task_shares(r: dict) -> str:
    """Per check, the smallest share of a task's queries passing it (the graded report)."""
    ts = r["task_shares"]
    out = []
    for c in ("error", "routing", "entanglement", "localization"):
        v = [x for x in ts[c] if x is not None and not (isinstance(x, float) and np.isnan(x))]
        out.append(_f(min(v), 3) if v else "-")
    return " / ".join(out)


def _rounds(r: dict) -> str:
    rs = r.get("rounds") or []
    return " → ".join(f"{x['shares']['certified']:.4f}" for x in rs) if rs else "-"


def _runs(runs: list[dict], **key) -> list[dict]:
    return [r for r in runs if all(r.get(k) == v for k, v in key.items())]


def _wall(r: dict) -> float:
    """Training seconds plus, for counterexample rounds, the checks between rounds."""
    return r["train_seconds"] + sum(x["check_seconds"] for x in (r.get("rounds") or []))


def render(data: dict[str, Any], out: str) -> str:
    """results.md from the sweep's JSON record."""
    runs = [r for r in data["runs"] if r["kind"] == "trained" and r.get("group", "grid") == "grid"]
    sets = [r for r in data["runs"] if r["kind"] == "trained" and r.get("group") == "sets"]
    built = {r["n_tasks"]: r for r in data["runs"] if r["kind"] == "hand-built" and r.get("group", "grid") == "grid"}
    built_sets = {(r["n_facts"], r["n_tasks"], r["data_seed"]): r for r in data["runs"]
                  if r["kind"] == "hand-built" and r.get("group") == "sets"}
    args = data["settings"]
    eps = args["epsilon"]
    objectives = [o for o in OBJECTIVES if _runs(runs, objective=o) or _runs(sets, objective=o)]
    L: list[str] = []
    L.append("# Training experiments: routing under four objectives, and trained models the verifier certifies")
    L.append("")
    commands = data.get("commands") or [data["command"]]
    L.append("Generated by `training/sweep.py`; do not edit by hand. "
             + ("Command:" if len(commands) == 1 else "Commands (run side by side, then merged with `--merge`):"))
    L.append("")
    L.append("```sh")
    L.extend(commands)
    L.append("```")
    L.append("")
    L.append(f"Environment: Python {data['python']}, torch {data['torch']}, {data['cpus']} CPU(s) (shared with other "
             f"work while this ran, so the times are upper bounds), {args['threads']} torch thread(s) per grid run, "
             f"{(sets[0].get('set_settings') or args if sets else args).get('set_threads', args['threads'])} per "
             f"large-set run, {args['jobs']} run(s) in parallel "
             f"per command; total {data['seconds']:.0f} s of wall time summed over the commands.")
    src = data.get("source") or {}
    if src.get("commit"):
        changed = src.get("local_changes") or []
        L.append("")
        L.append(f"Code: commit `{src['commit']}`"
                 + (f", with local changes to {', '.join(f'`{c}`' for c in changed[:12])}"
                    f"{' ...' if len(changed) > 12 else ''}" if changed else ", no local changes")
                 + " (the task sets come from `tasks/synthetic.py`; a different generator gives different sets).")
    L.append("")
    t = args["train"]
    L.append("**Setup.** Grid task sets: `tasks.synthetic.wikidata_like(facts_per_task · K, n_tasks=K, "
             f"seed={args['data_seed']})` with facts_per_task = {args['facts_per_task']} (Zipf dictionary sizes, "
             "1-5 templates per task, shared entity pool and shared template prefixes); one set per K, the seeds vary "
             "the initialisation. Model: the verifier's layout (`layout/`) with "
             f"d = {t['d']}, {t['n_heads']} heads of width {t['d_head']}, experts of {t['expert_width']} ReLU neurons, "
             "gate_mode `top1-scaled` (y = r + softmax(g)_e · expert_e(r)), no layer norm. Training: every query "
             "(proper prefix) once per step, full batch, Adam lr "
             f"{t['lr']}, {t['steps']} steps (warm-up {t['warmup']}, cosine to 10%), float32. Objectives: **CE** "
             "(−log Σ_{v valid} p(v), the verifier's error 1 − P(valid) in log form); **CE + load balancing** "
             f"α·K·Σ_i f_i·P_i with α = {t['alpha']}; **CE + task router** λ·CE(gate scores, task) on task-determining "
             f"queries, λ = {t['lam']}, expert i ↔ task i; these three export with the majority expert → task mapping.")
    L.append("")
    L.append("**The certificate recipe** (`--objective localize`, `training/objectives.py`): CE plus one hinge per "
             f"check, each zero once its check holds with room: *error*, log(1 − P(valid)) ≤ log({t['error_room']}·ε); "
             "*routing* on **every** prefix, shared ones included: the gate's set cross-entropy over the experts of "
             "the prefix's consistent tasks and a hinge asking the best consistent expert's score to beat every other "
             f"by {t['route_margin']}; *localization* on object queries, with the ablated logits U·r: the object's "
             f"logit {t['ablation_margin']} below the best other token's (L2), log P_ablated(o) ≤ "
             f"log({t['ablation_room']}/|O_k|) (L1), and the ablated error ≥ min(1/2, 4ε) (the older criterion). "
             f"Experts sized to the verifier's bound: expert k has min({t['expert_width']}, c(k)) neurons (the others "
             "masked, so the exported width is what trained), expert k serves task k (declared mapping). "
             f"**Counterexample rounds** (`training/rounds.py`): after {t['steps']} steps every query is screened on "
             "the float64 evaluation (the verifier's certified pass finds the counterexamples when the verifier runs "
             f"and does not certify); failing queries have their weight multiplied by {args['rounds']['boost']} and "
             f"training continues {args['rounds']['round_steps'] or t['steps'] // 2} steps, at most "
             f"{args['rounds']['max_rounds']} more rounds, until `verifier.checks.verify.verify` certifies the export "
             "and every object query passes the localization measure.")
    L.append("")
    L.append("**Measures** (float64 evaluation of the trained weights, all queries): *object acc.* = share of object "
             "queries (⋆2 next) whose argmax token is the fact's object; *purity* = per task, share of its "
             "task-determining queries at its most used expert, averaged over tasks; *entropy* = per task, entropy "
             "(bits) of its routing distribution, averaged; *top experts* = number of distinct experts that are some "
             "task's most used one; *off top* = task-determining queries not at their task's most used expert. "
             "*Worst ablated P(o)* = the largest probability of the object over the object queries with the routed "
             "expert's output removed (y = r), and *localized* = share of object queries where that probability is at "
             "most 1/|O_k| (|O_k|: the task's distinct objects) **and** another token's ablated logit is at least the "
             "object's (the strengthened entanglement check, L1 and L2, here measured in float64); *still top* = share "
             "of object queries whose ablated top token is still the object (what the older check, ablated error ≥ ε, "
             "allowed). *certified* = the verifier's verdict (`verifier.checks.verify.verify` at "
             f"ε = {eps}: error, routing, size, entanglement) **and** L1/L2 on every object query. *agrees*: the "
             "verifier's certified pass routes every query to the same expert as the float64 torch pass, and every "
             "float64 error lies in the certified enclosure (± 1e-9).")
    L.append("")
    L.append("**Which checks apply to trained weights.** Error, routing, size, entanglement (ablated error ≥ ε) and "
             "localization (L1, L2) read only the weights and the task set: they apply to any weights. The isolation "
             "check (each expert rebuilt from its task alone, and after removing other tasks) and the closed-form "
             "bound are evidence about the construction, which the verifier is given only when the tool built the "
             "model; they do not apply to trained weights.")
    L.append("")
    if any(r.get("verifier_worst_ablated_object_probability") is None for r in runs + sets):
        L.append("**Status of the localization figures.** Some runs here were recorded before the verifier certified "
                 "L1/L2 (they carry no verifier figure), so the localization columns are the float64 measure of "
                 "`training/metrics.py` (not enclosures); the counterexample rounds require it with a relative slack "
                 "of 1e-6 toward failing, and the recipe trains it with margins of a whole logit and a factor 2 in "
                 "probability. The saved recipe models, re-verified with the verifier that certifies L1/L2 (its L1 "
                 "bounds the object's probability alone), all certify; their certified figures are in docs/training.md "
                 "(*The localization figures*). For the hand-built models the figure is exact: their U reads no "
                 "direction that E, P or a head writes, so every ablated logit is exactly 0 and P_ablated(o) = 1/V.")
        L.append("")

    # Per-configuration means.
    L.append("## Summary (mean ± std over seeds)")
    L.append("")
    L.append("| tasks | objective | object acc. | purity | entropy (bits) | top experts | off top | localized | "
             "still top | worst ablated P(o) | train s | certified |")
    L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    configs = sorted({(r["n_tasks"], r["n_experts"]) for r in runs})
    for K, E in configs:
        for obj in objectives:
            rs = _runs(runs, n_tasks=K, n_experts=E, objective=obj)
            if not rs:
                continue
            L.append(f"| {K} | {OBJECTIVE_NAMES[obj]} | {_ms([r['object_accuracy'] for r in rs])} | "
                     f"{_ms([r['routing_purity'] for r in rs])} | {_ms([r['routing_entropy'] for r in rs], 2)} | "
                     f"{_ms([r['distinct_top_experts'] for r in rs], 1)} | "
                     f"{_ms([_off_top(r) for r in rs], 1)} / {int(np.sum(rs[0]['routing_matrix']))} | "
                     f"{_ms([r['localized_share'] for r in rs])} | "
                     f"{_ms([r['ablated_object_still_top_share'] for r in rs])} | "
                     f"{_g(max(r['worst_ablated_object_probability'] for r in rs))} | "
                     f"{_ms([_wall(r) for r in rs], 0)} | {sum(r['certified'] for r in rs)}/{len(rs)} |")
    L.append("")

    # Figures.
    figs = [f for f in data.get("figures", []) if f]
    if figs:
        L.append("## Routing heat maps (Figure 2 style)")
        L.append("")
        L.append("Rows: tasks; columns: experts in index order; cell: share of the task's task-determining queries "
                 "routed to the expert. The hand-built model, then seed 0 of each objective (the certificate recipe's "
                 "panels are certified trained models where their title says so); for the larger sets the hand-built "
                 "model beside the recipe's.")
        L.append("")
        for f in figs:
            L.append(f"![routing]({os.path.basename(f)})")
            L.append("")

    # Side by side.
    L.append("## Hand-built versus trained")
    L.append("")
    L.append("Parameters count **nonzero entries**: for the dense trained models that is every parameter except a "
             "few biases b_1 still at their initial 0; the hand-built model is sparse and its structural zeros are not "
             "counted. *Active per query* = all non-expert parameters (embeddings, heads, gate, unembedding) + the "
             "routed expert's, averaged over the queries. Trained rows: mean over seeds (worst ablated P(o): the "
             "largest over seeds). *train s*: training wall time, with the checks between counterexample rounds.")
    L.append("")
    L.append("| tasks | model | d | total params | active / query | object acc. | purity | max error | "
             "worst ablated P(o) | train s | certified |")
    L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for K in sorted({c[0] for c in configs} | set(built)):
        if K in built:
            b = built[K]
            L.append(f"| {K} | hand-built (Theorem 4.2), {b['n_experts']} experts, "
                     f"widths {min(b['widths'])}-{max(b['widths'])} | {b['d']} | {b['params']['total']:,} | "
                     f"{b['params']['active']:,.0f} | {_f(b['object_accuracy'])} | "
                     f"{_f(b['routing_purity'])} | {b['max_error']:.2e} | {_g(b['worst_ablated_object_probability'])} "
                     f"| - | {'yes' if b['certified'] else 'no'} |")
        for E in sorted({c[1] for c in configs if c[0] == K}):
            for obj in objectives:
                rs = _runs(runs, n_tasks=K, n_experts=E, objective=obj)
                if not rs:
                    continue
                widths = sorted({w for r in rs for w in r["expert_widths"]})
                shape = (f"{E} experts × {widths[0]}" if len(widths) == 1
                         else f"{E} experts, widths {widths[0]}-{widths[-1]}")
                L.append(f"| {K} | trained, {OBJECTIVE_NAMES[obj]}, {shape} | "
                         f"{rs[0]['config']['d']} | {np.mean([r['params']['total'] for r in rs]):,.0f} | "
                         f"{np.mean([r['params']['active'] for r in rs]):,.0f} | "
                         f"{_f(np.mean([r['object_accuracy'] for r in rs]))} | "
                         f"{_f(np.mean([r['routing_purity'] for r in rs]))} | "
                         f"{np.mean([r['max_error'] for r in rs]):.2e} | "
                         f"{_g(max(r['worst_ablated_object_probability'] for r in rs))} | "
                         f"{np.mean([_wall(r) for r in rs]):.0f} | {sum(r['certified'] for r in rs)}/{len(rs)} |")
    L.append("")

    if sets:
        L.append("## Larger task sets")
        L.append("")
        L.append("`tasks.synthetic.wikidata_like(FACTS, n_tasks=TASKS, seed=DATA_SEED)`; the certificate recipe with "
                 "minibatches drawn with replacement (in proportion to the query weights, half of each batch in "
                 "proportion to the query's last seen loss), experts of min(W, c(k)) neurons. *setup*: d, the cap W, "
                 "the batch size, the first round's steps (later rounds: as given in the command) and the training "
                 "budget over all rounds. *train s* is the training time (the rounds' sum); *check s* the certified "
                 "passes, float64 measures and verifier runs between and after the rounds. The hand-built rows are "
                 "verified without the rebuild-without-each-task evidence (isolation) where it says so (it rebuilds "
                 "the construction once per task; evidence about the construction, not about the weights).")
        L.append("")
        L.append("| facts | tasks | data seed | model | queries | V | total params | active / query | object acc. | "
                 "purity | max error | worst ablated P(o) | rounds: certified share | train s | check s | certified |")
        L.append("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|")
        for key in sorted({(r["n_facts"], r["n_tasks"], r["data_seed"]) for r in sets} | set(built_sets)):
            F, K, ds = key
            if key in built_sets:
                b = built_sets[key]
                iso = "" if b.get("isolation_checked", True) else ", isolation not checked"
                L.append(f"| {F:,} | {K} | {ds} "
                         f"| hand-built, d = {b['d']}, widths {min(b['widths'])}-{max(b['widths'])}{iso} "
                         f"| {b['queries']:,} | {b['vocabulary']:,} | {b['params']['total']:,} "
                         f"| {b['params']['active']:,.0f} | {_f(b['object_accuracy'])} | {_f(b['routing_purity'])} "
                         f"| {b['max_error']:.2e} | {_g(b['worst_ablated_object_probability'])} | - | - "
                         f"| {b['verify_seconds']:.0f} | {'yes' if b['certified'] else 'no'} |")
            for r in sorted(_runs(sets, n_facts=F, n_tasks=K, data_seed=ds),
                            key=lambda r: OBJECTIVES.index(r["objective"])):
                checks = r["verify_seconds"] + sum(x["check_seconds"] for x in (r.get("rounds") or []))
                c = r["config"]
                setup = (f"d = {c['d']}, W = {c['expert_width']}, batch {c['batch_size']}, {c['steps']} steps, "
                         f"budget {_f((r.get('set_settings') or args).get('set_time_budget'), 0)} s")
                L.append(f"| {F:,} | {K} | {ds} | trained, {OBJECTIVE_NAMES[r['objective']]}, {setup} | "
                         f"{r['queries']:,} | {r['vocabulary']:,} | {r['params']['total']:,} | "
                         f"{r['params']['active']:,.0f} | {_f(r['object_accuracy'])} | {_f(r['routing_purity'])} | "
                         f"{r['max_error']:.2e} | {_g(r['worst_ablated_object_probability'])} | {_rounds(r)} | "
                         f"{r['train_seconds']:.0f} | {checks:.0f} | "
                         f"{'yes' if r['certified'] else 'no: ' + _failed_checks(r)} |")
        L.append("")

    # Counterexample rounds.
    loc_runs = _runs(runs, objective="localize") + _runs(sets, objective="localize")
    if loc_runs:
        L.append("## Counterexample rounds")
        L.append("")
        L.append("Per run of the certificate recipe: the share of queries passing every check that applies to them "
                 "after each round (round 0 = the first training), and the steps of each round.")
        L.append("")
        L.append("| run | rounds: certified share | steps | worst ablated P(o) per round | certified |")
        L.append("|---|---|---|---|---|")
        for r in loc_runs:
            rs = r.get("rounds") or []
            L.append(f"| {r['name']} | {_rounds(r)} | {' + '.join(str(x['steps']) for x in rs)} | "
                     f"{' → '.join(_g(x['worst_ablated_object_probability']) for x in rs)} | "
                     f"{'yes' if r['certified'] else 'no'} |")
        L.append("")

    # Every run.
    L.append("## Every run (grid)")
    L.append("")
    L.append("*Worst task's share* (the graded report): per check, the smallest share over the tasks of a task's "
             "queries passing it (error / routing / entanglement / localization; entanglement and localization over "
             "object queries). Full per-task shares are in `results.json` (`task_shares`).")
    L.append("")
    L.append("| tasks | objective | seed | object acc. | purity | off top | max error | worst ablated P(o) "
             "| still top | failing checks (tasks) | worst task's share | agrees | train s | verify s |")
    L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|---:|")
    for r in sorted(runs, key=lambda r: (r["n_tasks"], r["n_experts"], OBJECTIVES.index(r["objective"]), r["seed"])):
        a = r["agreement"]
        agrees = a["expert_mismatches"] == 0 and a["outside"] == 0 and r["verifier_routing_matrix_equal"]
        L.append(f"| {r['n_tasks']} | {OBJECTIVE_NAMES[r['objective']]} | {r['seed']} | "
                 f"{_f(r['object_accuracy'])} | {_f(r['routing_purity'])} | {_off_top(r)} | {r['max_error']:.2e} | "
                 f"{_g(r['worst_ablated_object_probability'])} | {_f(r['ablated_object_still_top_share'])} | "
                 f"{'certified' if r['certified'] else _failed_checks(r)} | {_worst_task_shares(r)} | "
                 f"{'yes' if agrees else 'NO'} ({a['queries']} queries) | {_wall(r):.0f} | {r['verify_seconds']:.1f} |")
    cut = [r["name"] for r in runs if r.get("rounds") is None and r["steps"] < r["config"]["steps"]]
    if cut:
        L.append(f"Stopped early by the time limit ({args['time_limit']} s): {', '.join(cut)}.")
    L.append("")

    # Verifier transcript.
    transcripts = data.get("transcripts") or [t for t in [data.get("transcript")] if t]
    if transcripts:
        L.append("## The verifier on trained weights")
        L.append("")
    for tr in transcripts:
        L.append(f"Transcript of a check of trained weights (exit status {tr['exit']}: 0 certified, 1 not certified):")
        L.append("")
        L.append("```text")
        L.append(f"$ {tr['command']}")
        L.append(tr["stdout"].rstrip())
        L.append("```")
        L.append("")
    L.extend(_saved_weights(runs + sets))
    L.extend(_two_hops(out))
    L.append("## What held, against the paper's claims")
    L.append("")
    L.extend(_claims(runs, built, sets, built_sets))
    L.append("")
    return "\n".join(L)


def _two_hops(out: str) -> list[str]:
    """The two-hop experiment's table and figure (:mod:`training.two_hops`), when its record
    ``two_hops.json`` is in the output directory: does training find a composition?"""
    path = os.path.join(out, "two_hops.json")
    if not os.path.exists(path):
        return []
    from training.two_hops import _commands_said, setup, summary_lines

    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    lines = ["## Two hops: does training find a composition?", "",
             f"Generated by `training/two_hops.py` (its page: [two_hops.md](two_hops.md)). {_commands_said(record)}",
             "", "```sh", *record["commands"], "```", "", setup(record), "", *summary_lines(record), ""]
    if os.path.exists(os.path.join(out, "two_hops.png")):
        lines += ["![Held-out composed queries: accuracy and certified share](two_hops.png)", ""]
    return lines


def _tasks_file(r: dict) -> str:
    """The task set file the sweep wrote for a run (in the output directory)."""
    name = (f"K{r['n_tasks']}" if r.get("group", "grid") == "grid"
            else _set_name(r["n_facts"], r["n_tasks"], r["data_seed"]))
    return f"tasks-{name}.yaml"


def _saved_weights(runs: list[dict]) -> list[str]:
    """Where the weights of every certified trained model are, and the command that re-verifies each."""
    saved = [r for r in runs if r["certified"] and r.get("weights")]
    if not saved:
        return []
    out = ["## Saved weights of the certified models", "",
           "Every trained model this page reports as certified, as written by the sweep (`.npz`, the weight layout; "
           "float32-exact values stored narrow, the same floats). Re-verify one with the verifier of any later "
           "commit (the strengthened entanglement check, once merged, included):", "",
           "```sh", f"python -m verifier check docs/training/{_tasks_file(saved[0])} --weights {saved[0]['weights']}",
           "```", "", "| run | weights | tasks |", "|---|---|---|"]
    for r in saved:
        out.append(f"| {r['name']} | `{r['weights']}` | `docs/training/{_tasks_file(r)}` |")
    out.append("")
    return out


def merge(parts: list[dict]) -> dict[str, Any]:
    """One record from the records of several sweep commands run side by side (e.g. the
    grid on one core and the 10,000-fact set on the other): the runs of all (a hand-built
    model once per task set), every command, the wall times summed; the settings are the
    first part's, and a larger set's run keeps the settings of the command that ran it."""
    if not parts:
        raise ValueError("nothing to merge")
    data = {**parts[0], "runs": [], "commands": [], "transcripts": [], "seconds": 0.0}
    built: set = set()
    for part in parts:
        data["commands"].extend(part.get("commands") or [part["command"]])
        data["transcripts"].extend(part.get("transcripts") or [t for t in [part.get("transcript")] if t])
        data["seconds"] += part["seconds"]
        for r in part["runs"]:
            if r["kind"] == "hand-built":
                key = (r.get("group", "grid"), r["n_facts"], r["n_tasks"], r["data_seed"])
                if key in built:
                    continue
                built.add(key)
            elif r.get("group") == "sets" and "set_settings" not in r:
                r = {**r, "set_settings": part["settings"]}
            data["runs"].append(r)
    data.pop("command", None)
    data.pop("transcript", None)
    return data


def _claims(runs: list[dict], built: dict[int, dict], sets: list[dict], built_sets: dict) -> list[str]:
    """Plain statements computed from the numbers (no tuning of the wording to the result)."""
    out = []

    def mean(obj: str, key: str) -> float:
        v = [r[key] for r in runs if r["objective"] == obj]
        return float(np.mean(v)) if v else float("nan")

    present = [o for o in OBJECTIVES if any(r["objective"] == o for r in runs)]
    out.append("* **Routing.** Mean purity over all configurations and seeds: "
               + "; ".join(f"{OBJECTIVE_NAMES[o]} {mean(o, 'routing_purity'):.3f}" for o in present)
               + "; mean entropy " + " / ".join(f"{mean(o, 'routing_entropy'):.2f}" for o in present) + " bits.")
    for o in ("router", "localize"):
        rs = [r for r in runs if r["objective"] == o]
        if rs:
            one = sum(r["distinct_top_experts"] == min(r["n_tasks"], r["n_experts"]) for r in rs)
            out.append(f"  Under {OBJECTIVE_NAMES[o]} {one}/{len(rs)} runs route one-to-one (every task has its own "
                       "most used expert).")
    out.append("* **Accuracy.** Mean object-query accuracy: "
               + "; ".join(f"{OBJECTIVE_NAMES[o]} {mean(o, 'object_accuracy'):.3f}" for o in present) + ".")
    out.append("* **Localization.** Share of object queries still answered (the object the ablated model's top "
               "token) with the routed expert's output removed, mean over runs: "
               + "; ".join(f"{OBJECTIVE_NAMES[o]} {mean(o, 'ablated_object_still_top_share'):.3f}" for o in present)
               + "; worst ablated P(o): " + "; ".join(
                   f"{OBJECTIVE_NAMES[o]} "
                   f"{_g(max(r['worst_ablated_object_probability'] for r in runs if r['objective'] == o))}"
                   for o in present)
               + (f"; hand-built {_g(max(b['worst_ablated_object_probability'] for b in built.values()))} (1/V)."
                  if built else "."))
    cert = sum(r["certified"] for r in runs)
    out.append(f"* **Verification.** {cert}/{len(runs)} trained grid models certify (the verifier's verdict and "
               f"L1/L2); {sum(b['certified'] for b in built.values())}/{len(built)} hand-built models do.")
    for obj in present:
        rs = [r for r in runs if r["objective"] == obj]
        fails = ", ".join(f"{c} {sum(r['failures'][c] > 0 for r in rs)}/{len(rs)}"
                          for c in ("error", "routing", "size", "entanglement"))
        loc = sum(not r["localized"] for r in rs)
        rc = [r["routing_check"] for r in rs if "routing_check" in r]
        split = ""
        if rc:
            split = (f"; the verifier's routing rule fails on {sum(c['determined_misrouted'] for c in rc)} of "
                     f"{sum(c['determined'] for c in rc)} task-determining queries and "
                     f"{sum(c['shared_misrouted'] for c in rc)} of {sum(c['shared'] for c in rc)} prefixes "
                     "shared by several tasks")
        out.append(f"  {OBJECTIVE_NAMES[obj]}: {sum(r['certified'] for r in rs)}/{len(rs)} certified; runs failing "
                   f"each check: {fails}, localization {loc}/{len(rs)}{split}.")
    for r in sets:
        key = (r["n_facts"], r["n_tasks"], r["data_seed"])
        b = built_sets.get(key)
        out.append(f"* **{r['n_facts']:,} facts, {r['n_tasks']} tasks (data seed {r['data_seed']}), "
                   f"{OBJECTIVE_NAMES[r['objective']]}:** {'certified' if r['certified'] else 'not certified'} after "
                   f"{len(r.get('rounds') or [1])} round(s), {r['train_seconds']:.0f} s of training; "
                   f"worst ablated P(o) {_g(r['worst_ablated_object_probability'])}"
                   + (f" (hand-built {_g(b['worst_ablated_object_probability'])})" if b else "") + ".")
    agree = sum(r["agreement"]["expert_mismatches"] == 0 and r["agreement"]["outside"] == 0 for r in runs + sets)
    out.append(f"* **Consistency.** In {agree}/{len(runs) + len(sets)} runs the verifier's certified pass and the "
               "training code's float64 pass agree on every query's expert and error.")
    return out


# --- driver ------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    from training.loop import TrainConfig

    from tasks.console import Parser, epsilon
    from training.options import DefaultsFormatter, add_model_flags, count, seconds, steps

    p = Parser(prog="python -m training.sweep", formatter_class=DefaultsFormatter, description=(
        "Train single-layer MoE transformers under four objectives over a grid of tasks x experts x seeds and on "
        "larger task sets, verify them, and write docs/training/results.md with heat maps."))
    p.add_argument("--configs", nargs="*", default=["4x4", "8x8", "16x16"], metavar="TASKSxEXPERTS",
                   help="configurations, e.g. 4x4 8x8 16x16 (default)")
    p.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES),
                   help="training objectives of the grid")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="training seeds of the grid")
    p.add_argument("--facts-per-task", type=int, default=20, help="facts per task of the grid's task sets")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the grid's synthetic task sets")
    p.add_argument("--epsilon", type=epsilon, default=0.01, help="the verifier's target error")
    add_model_flags(p, TrainConfig())
    p.add_argument("--time-limit", type=float, default=150.0, help="seconds of training per grid run at most")
    p.add_argument("--max-rounds", type=count, default=5, help="localize: counterexample rounds after the first")
    p.add_argument("--round-steps", type=steps, help="localize: steps of each later round (default: half of --steps)")
    p.add_argument("--boost", type=float, default=4.0, help="localize: weight factor of a failing query per round")
    p.add_argument("--sets", nargs="*", default=["1000x16", "1000x16@1", "1000x16@2", "10000x16"],
                   metavar="FACTSxTASKS[@SEED]", help="larger task sets (default: three of 1,000 facts and one of "
                                                       "10,000, 16 tasks each); none with an empty list")
    p.add_argument("--set-objectives", nargs="+", choices=OBJECTIVES, default=["localize"],
                   help="training objectives on the larger sets")
    p.add_argument("--set-steps", type=steps, default=4000, help="first-round steps on the larger sets")
    p.add_argument("--set-batch-size", type=steps, default=2048, help="minibatch size on the larger sets")
    p.add_argument("--set-time-budget", type=seconds, default=1800.0,
                   help="seconds of training over all rounds on a larger set (default 1800: 30 minutes)")
    p.add_argument("--set-width", type=steps,
                   help="neurons per expert on the larger sets, at most c(k) (default: --width)")
    p.add_argument("--set-threads", type=int, default=2, help="torch threads per larger-set run")
    p.add_argument("--jobs", type=int, default=1, help="grid runs in parallel (processes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per grid run")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default docs/training)")
    p.add_argument("--weights-dir", default=DEFAULT_WEIGHTS, help="where trained .npz files go ('' for nowhere)")
    p.add_argument("--no-plots", action="store_true", help="skip the heat maps")
    p.add_argument("--render", action="store_true", help="only re-render results.md (and plots) from OUT/results.json")
    p.add_argument("--merge", nargs="+", metavar="RESULTS.json",
                   help="write OUT/results.json and results.md from the records of several sweep commands (and copy "
                        "their task set files next to them)")
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


def _parse_set(text: str) -> tuple[int, int, int]:
    """FACTSxTASKS[@DATA_SEED] -> (facts, tasks, data seed)."""
    try:
        body, _, seed = text.partition("@")
        a, b = body.lower().split("x")
        F, K, ds = int(a), int(b), int(seed or 0)
    except ValueError:
        raise SystemExit(f"error: task set {text!r} is not FACTSxTASKS[@SEED] (e.g. 10000x16@0)") from None
    if K < 1 or F < K:
        raise SystemExit(f"error: task set {text!r} needs at least one task and one fact per task")
    return F, K, ds


def _figures(data: dict[str, Any], out: str) -> list[str]:
    from training.plots import routing_panels

    runs = [r for r in data["runs"] if r["kind"] == "trained" and r.get("group", "grid") == "grid"]
    sets = [r for r in data["runs"] if r["kind"] == "trained" and r.get("group") == "sets"]
    built = {r["n_tasks"]: r for r in data["runs"] if r["kind"] == "hand-built" and r.get("group", "grid") == "grid"}
    built_sets = {(r["n_facts"], r["n_tasks"], r["data_seed"]): r for r in data["runs"]
                  if r["kind"] == "hand-built" and r.get("group") == "sets"}

    def title(r: dict) -> str:
        return (f"{OBJECTIVE_NAMES[r['objective']]} (seed {r['seed']})\npurity {r['routing_purity']:.2f}, "
                f"obj. acc. {r['object_accuracy']:.2f}{', certified' if r['certified'] else ''}")

    paths = []
    for K, E in sorted({(r["n_tasks"], r["n_experts"]) for r in runs}):
        panels = []
        if K in built and built[K]["n_experts"] == E:
            b = built[K]
            panels.append((f"hand-built\npurity {b['routing_purity']:.2f}{', certified' if b['certified'] else ''}",
                           np.array(b["routing_matrix"])))
        for obj in OBJECTIVES:
            rs = sorted(_runs(runs, n_tasks=K, n_experts=E, objective=obj), key=lambda r: r["seed"])
            if rs:
                panels.append((title(rs[0]), np.array(rs[0]["routing_matrix"])))
        name = f"routing-K{K}.png" if K == E else f"routing-K{K}-E{E}.png"
        paths.append(routing_panels(panels, os.path.join(out, name), f"{K} tasks, {E} experts"))
    for key in sorted({(r["n_facts"], r["n_tasks"], r["data_seed"]) for r in sets}):
        F, K, ds = key
        panels = []
        if key in built_sets:
            b = built_sets[key]
            panels.append((f"hand-built\npurity {b['routing_purity']:.2f}{', certified' if b['certified'] else ''}",
                           np.array(b["routing_matrix"])))
        for r in _runs(sets, n_facts=F, n_tasks=K, data_seed=ds):
            panels.append((title(r), np.array(r["routing_matrix"])))
        paths.append(routing_panels(panels, os.path.join(out, f"routing-{_set_name(F, K, ds)}.png"),
                                    f"{F:,} facts, {K} tasks (data seed {ds})"))
    return paths


def _specs(args, base: dict, configs, sets) -> list[RunSpec]:
    rounds = {"max_rounds": args.max_rounds, "round_steps": args.round_steps, "boost": args.boost}
    grid = [RunSpec(K, E, obj, s, args.facts_per_task * K, args.data_seed, args.epsilon, args.threads,
                    args.weights_dir or None, base, rounds)
            for K, E in configs for obj in args.objectives for s in args.seeds]
    big = {**base, "batch_size": args.set_batch_size, "steps": args.set_steps, "time_limit": None,
           "expert_width": args.set_width or base["expert_width"]}
    big_rounds = {**rounds, "time_budget": args.set_time_budget}
    large = [RunSpec(K, K, obj, 0, F, ds, args.epsilon, args.set_threads, args.weights_dir or None, big,
                     big_rounds, group="sets")
             for F, K, ds in sets for obj in args.set_objectives]
    return grid + large


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = args.out
    os.makedirs(out, exist_ok=True)
    json_path = os.path.join(out, "results.json")
    if args.merge:
        import shutil

        parts = []
        for path in args.merge:
            try:
                with open(path, encoding="utf-8") as f:
                    parts.append(json.load(f))
            except (OSError, ValueError) as exc:
                print(f"error: {path}: cannot read a sweep record ({exc}); give the results.json of a sweep",
                      file=sys.stderr)
                return 2
            here = os.path.dirname(path)
            for name in os.listdir(here or "."):
                if (name.startswith("tasks-") and name.endswith(".yaml")
                        and os.path.abspath(here) != os.path.abspath(out)):
                    shutil.copyfile(os.path.join(here, name), os.path.join(out, name))
        data = merge(parts)
    elif args.render:
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
    else:
        import torch

        from training.loop import TrainConfig

        configs = [_parse_config(c) for c in args.configs]
        sets = [_parse_set(s) for s in args.sets]
        from training.options import model_changes

        base = asdict(replace(TrainConfig(), time_limit=args.time_limit, **model_changes(args)))
        specs = _specs(args, base, configs, sets)
        start = time.perf_counter()
        source = _source_state()
        runs: list[dict] = []
        for K in sorted({K for K, _ in configs}):
            _dump_tasks(args.facts_per_task * K, K, args.data_seed, out, f"K{K}")
            print(f"hand-built model, {K} tasks ...", file=sys.stderr, flush=True)
            runs.append(hand_built(args.facts_per_task * K, K, args.data_seed))
        for F, K, ds in sets:
            _dump_tasks(F, K, ds, out, _set_name(F, K, ds))
            print(f"hand-built model, {F} facts, {K} tasks, data seed {ds} ...", file=sys.stderr, flush=True)
            runs.append(hand_built(F, K, ds, group="sets"))

        partial = os.path.join(out, "runs.partial.jsonl")
        open(partial, "w", encoding="utf-8").close()

        def done(r: dict) -> None:
            runs.append(r)
            with open(partial, "a", encoding="utf-8") as f:   # a crash later loses no finished run's numbers
                f.write(json.dumps(r) + "\n")
            print(f"{r['name']}: object acc {r['object_accuracy']:.3f}, purity {r['routing_purity']:.3f}, "
                  f"{'certified' if r['certified'] else 'not certified'}, {r['train_seconds']:.0f}s",
                  file=sys.stderr, flush=True)

        grid = [s for s in specs if s.group == "grid"]
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                for r in pool.map(run_one, grid):
                    done(r)
        else:
            for s in grid:
                done(run_one(s))
        for s in specs:                      # the larger sets one at a time, on --set-threads threads
            if s.group == "sets":
                done(run_one(s))
        transcript = None
        saved = [r for r in runs if r["kind"] == "trained" and r.get("weights")]
        saved.sort(key=lambda r: (not r["certified"], r["objective"] != "localize", r["group"] != "grid",
                                  r["n_tasks"], r["seed"]))
        example = saved[0] if saved else None
        if example is not None:
            name = (f"K{example['n_tasks']}" if example["group"] == "grid"
                    else _set_name(example["n_facts"], example["n_tasks"], example["data_seed"]))
            transcript = _cli_transcript(os.path.join(out, f"tasks-{name}.yaml"), example["weights"])
        settings = {k: v for k, v in vars(args).items() if k not in ("render",)}
        settings["train"] = base
        settings["set_train"] = {**base, "batch_size": args.set_batch_size, "steps": args.set_steps,
                                 "expert_width": args.set_width or base["expert_width"]}
        settings["rounds"] = {"max_rounds": args.max_rounds, "round_steps": args.round_steps, "boost": args.boost}
        data = {
            "command": "python -m training.sweep"
                       + ("" if not argv and len(sys.argv) <= 1
                          else " " + shlex.join(list(argv if argv is not None else sys.argv[1:]))),
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
