"""The checks of a two-layer model over every query of a task set with composed tasks.

For every query (every non-empty proper prefix of every sentence, composed tasks' included),
with the enclosures of :class:`verifier.passes.layers.LayersPass`:

* **error**: the upper end of 1 − P(valid next tokens) is below ε;
* **routing, layer 1**: a certified unique winner (margin > 0) whose expert serves a task
  consistent with the query, a composed task being served by the expert of its first hop;
* **routing, layer 2**: a certified unique winner, and it is the expert that holds g at a
  determined object query of a composed task (f, g), an expert that holds no task ("") at
  every other query;
* **entanglement, per hop**: at every determined object query, with its layer-1 expert
  removed, the error's lower end is at least ε (as for one layer); at a composed task's,
  with its layer-2 expert removed, the composed object is not answered: the lower end of
  1 − P(o) for the object o alone is at least ε (a template word that layer 1 predicts
  there, valid at a prefix that is also another template's, is not the composed answer).
  Localization, per hop, on the same rows: L1, the upper end of P(o) at most 1/|O_k| (the
  task's distinct objects), and L2, another token's logit at least the object's;
* **size**, per task: a stored task's layer-1 expert within L·|T¹(f)| + N_f (T¹: its own
  templates and those of the composed tasks it starts), its layer-2 expert (as a second
  hop) within N_f.

The verdict is CERTIFIED when every check holds on every query and task.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from layout.layers import Stack
from tasks.model import TaskSet
from tasks.structure import structure_of
from verifier.checks.localization import l1_thresholds
from verifier.passes.batches import batches
from verifier.passes.layers import LayersPass

#: The per-query checks, in report order.
CHECKS = ("error", "routing1", "routing2", "entanglement1", "entanglement2", "localization1", "localization2")


@dataclass
class LayersTask:
    """One task's counts (queries consistent with it, failing each check)."""

    name: str
    compose: tuple[str, str] | None
    templates: int
    facts: int
    queries: int = 0
    object_queries: int = 0
    worst_error: float = 0.0
    worst_query: str = ""
    min_margin1: float = float("inf")
    min_margin2: float = float("inf")
    failing: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CHECKS})
    width1: int | None = None
    bound1: int | None = None
    width2: int | None = None
    bound2: int | None = None

    @property
    def size_ok(self) -> bool:
        ok1 = self.compose is not None or (self.width1 is not None and self.width1 <= self.bound1)
        ok2 = self.width2 is None or self.width2 <= self.bound2
        return ok1 and ok2

    @property
    def certified(self) -> bool:
        return self.size_ok and not any(self.failing.values())

    def to_json(self) -> dict:
        return {"name": self.name, "compose": list(self.compose) if self.compose else None,
                "templates": self.templates, "facts": self.facts, "queries": self.queries,
                "object_queries": self.object_queries, "worst_error": self.worst_error,
                "worst_query": self.worst_query, "min_gate_margin": {"layer1": _num(self.min_margin1),
                                                                      "layer2": _num(self.min_margin2)},
                "failing": dict(self.failing),
                "size": {"layer1": {"width": self.width1, "bound": self.bound1},
                         "layer2": {"width": self.width2, "bound": self.bound2}, "ok": self.size_ok},
                "certified": self.certified}


def _num(x: float) -> float | None:
    return None if not np.isfinite(x) else float(x)


@dataclass
class LayersReport:
    """The two-layer verdict and its per-task records."""

    tasks: list[LayersTask]
    epsilon: float
    queries: int
    failing_queries: dict[str, int]
    seconds: float
    source: str
    parameters: dict

    @property
    def certified(self) -> bool:
        return all(t.certified for t in self.tasks) and not any(self.failing_queries.values())

    @property
    def verdict(self) -> str:
        return "CERTIFIED" if self.certified else "NOT CERTIFIED"

    @property
    def worst_error(self) -> float:
        return max((t.worst_error for t in self.tasks), default=0.0)

    def to_json(self) -> dict:
        return {"layers": 2, "verdict": self.verdict, "certified": self.certified, "epsilon": self.epsilon,
                "queries": self.queries, "worst_error": self.worst_error, "failing_queries": self.failing_queries,
                "parameters": self.parameters, "source": self.source, "tasks": [t.to_json() for t in self.tasks]}


def _owner(taskset: TaskSet) -> np.ndarray:
    """Per task, the stored task whose layer-1 expert serves it (a composed task: its first hop)."""
    return np.array([taskset.index(t.compose[0]) if t.compose is not None else k
                     for k, t in enumerate(taskset.tasks)], np.int64)


def verify_layers(taskset: TaskSet, stack: Stack, epsilon: float, source: str = "weights",
                  chunk: int = 4000) -> LayersReport:
    """Check ``stack`` on every query of ``taskset`` (module docstring)."""
    t0 = time.perf_counter()
    epsilon = float(epsilon)
    names = taskset.names
    w1, s2 = stack.first, stack.second
    ids = w1.token_ids(taskset.vocabulary.tokens, source)
    serves1 = np.array([names.index(t) if t in names else -1 for t in w1.expert_tasks], np.int64)
    serves2 = np.array([names.index(t) if t in names else -1 for t in s2.expert_tasks], np.int64)
    owner = _owner(taskset)
    second = np.array([taskset.index(t.compose[1]) if t.compose is not None else -1 for t in taskset.tasks], np.int64)
    n_objects, l1_thr = l1_thresholds(taskset)
    records = [LayersTask(t.name, t.compose, t.n_templates, t.n_facts) for t in taskset.tasks]
    failing = {c: 0 for c in CHECKS}
    total = 0
    pas = LayersPass(stack, ids[taskset.vocabulary.n_words:])        # the residual factored over the entities
    vocab = taskset.vocabulary
    for b in batches(taskset, structure_of(taskset), chunk=chunk):
        n = len(b)
        total += n
        det = b.determined
        oq = b.object_query & (det >= 0)
        composed_oq = oq & (second[np.maximum(det, 0)] >= 0)
        res = pas.run_batch(ids[b.tokens], b.valid_ptr, ids[b.valid], np.where(b.target >= 0, ids[np.maximum(
            b.target, 0)], -1), oq, composed_oq)
        rows_of = np.repeat(np.arange(n), np.diff(b.allowed_ptr))
        # layer 1: the winner serves (as owner) some consistent task
        served1 = serves1[res.expert1]
        ok1 = np.zeros(n, bool)
        hit = owner[b.allowed] == served1[rows_of]
        ok1[rows_of[hit & (served1[rows_of] >= 0)]] = True
        ok1 &= res.margin1 > 0
        want2 = np.where(composed_oq, second[np.maximum(det, 0)], -1)
        e2 = np.maximum(res.expert2, 0)
        ok2 = (res.margin2 > 0) & (res.expert2 >= 0) & (serves2[e2] == want2) \
            & ((want2 >= 0) | (np.asarray(s2.expert_tasks, dtype=object)[e2] == ""))
        err = res.err_hi < epsilon
        thr = l1_thr[np.maximum(det, 0)]
        ab = res.ablated
        ent1 = ~oq | (ab[1][0] >= epsilon)
        ent2 = ~composed_oq | (ab[2][2] >= epsilon)
        loc1 = ~oq | ((ab[1][2] >= thr) & (ab[1][3] >= 0))
        loc2 = ~composed_oq | ((ab[2][2] >= thr) & (ab[2][3] >= 0))
        checks = {"error": err, "routing1": ok1, "routing2": ok2, "entanglement1": ent1,
                  "entanglement2": ent2, "localization1": loc1, "localization2": loc2}
        for c, ok in checks.items():
            failing[c] += int((~ok).sum())
        for k in range(len(records)):
            mine = np.zeros(n, bool)
            mine[rows_of[b.allowed == k]] = True
            if not mine.any():
                continue
            r = records[k]
            r.queries += int(mine.sum())
            r.object_queries += int((mine & oq).sum())
            for c, ok in checks.items():
                r.failing[c] += int((mine & ~ok).sum())
            i = int(np.flatnonzero(mine)[np.argmax(res.err_hi[mine])])
            if res.err_hi[i] > r.worst_error or not r.worst_query:
                r.worst_error = float(res.err_hi[i])
                r.worst_query = " ".join(vocab.token(t) for t in b.tokens[i])
            r.min_margin1 = min(r.min_margin1, float(res.margin1[mine].min()))
            r.min_margin2 = min(r.min_margin2, float(res.margin2[mine].min()))
    # sizes: layer-1 experts against L·|T¹(f)| + N_f, layer-2 experts against N_f
    L = taskset.L
    for k, (t, r) in enumerate(zip(taskset.tasks, records)):
        if t.compose is not None:
            continue
        templates = t.n_templates + sum(x.n_templates for x in taskset.tasks if x.compose and x.compose[0] == t.name)
        r.bound1 = L * templates + t.n_facts
        e = [i for i, s in enumerate(w1.expert_tasks) if s == t.name]
        r.width1 = w1.experts[e[0]].width if e else None
        e2 = [i for i, s in enumerate(s2.expert_tasks) if s == t.name]
        if e2:
            r.width2, r.bound2 = s2.experts[e2[0]].width, t.n_facts
    params = {key: w1.parameters.get(key) for key in ("beta", "gamma") if key in w1.parameters}
    return LayersReport(records, epsilon, total, failing, time.perf_counter() - t0, source, params)


def report_text(report: LayersReport) -> list[str]:
    """The per-task table and the verdict, as lines."""
    head = ("task", "composes", "queries", "worst err", "margin L1", "margin L2", "width L1/bound", "width L2/bound",
            "failing", "ok")
    rows = []
    for t in report.tasks:
        fails = ", ".join(f"{c} {v}" for c, v in t.failing.items() if v) or "-"
        rows.append((t.name, " then ".join(t.compose) if t.compose else "-", f"{t.queries:,}",
                     f"{t.worst_error:.3g}", f"{t.min_margin1:.4g}", f"{t.min_margin2:.4g}",
                     f"{t.width1}/{t.bound1}" if t.width1 is not None else "-",
                     f"{t.width2}/{t.bound2}" if t.width2 is not None else "-", fails, "yes" if t.certified else "NO"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    out.append("")
    out.append(f"two layers: {report.queries:,} queries (non-empty proper prefixes, composed tasks' included); worst "
               f"error {report.worst_error:.4g} (upper end of its enclosure); epsilon {report.epsilon:g}; "
               f"time {report.seconds:.2f}s")
    bad = {c: v for c, v in report.failing_queries.items() if v}
    if bad:
        out.append("failing queries: " + ", ".join(f"{c} {v:,}" for c, v in bad.items()))
    out.append(f"verdict: {report.verdict} at epsilon = {report.epsilon:g}")
    return out
