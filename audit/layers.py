"""The independent oracle for two-layer models (:class:`layout.layers.Stack`): the forward pass
of the two-layer layout in high-precision arithmetic, one query at a time.

Written apart from the verifier, as :mod:`audit.oracle` is, whose exact linear algebra and
layer-1 residual it reuses (:class:`audit.oracle.Oracle`: every linear map exact, only exp
and division rounded at ``dps`` digits). For a prefix it gives the exact values the
verifier's two-layer pass (:mod:`verifier.passes.layers`) encloses: both layers' gate
winners and margins, the error, and the errors with each layer's routed expert removed.
"""

from __future__ import annotations

from typing import Any

from audit.oracle import DPS, Oracle, _Fingerprints
from layout.layers import Stack


class LayersOracle:
    """Exact values of a two-layer model's queries (module docstring)."""

    def __init__(self, dps: int = DPS) -> None:
        self.oracle = Oracle(dps)
        self.dps = dps

    def _gate(self, c, W_G, b_G, y: dict[int, Any]) -> tuple[int, Any]:
        """(argmax, winner's score minus the runner-up's), exactly; a tie has margin 0."""
        rows = c.row_dicts(W_G)
        scores = []
        for k, row in enumerate(rows):
            pairs = [(a, y[j]) for j, a in row.items() if j in y]
            b = c.mp.mpf(float(b_G[k]))
            if b:
                pairs.append((b, c.one))
            scores.append(c.xdot(pairs) if pairs else c.zero)
        best = max(range(len(scores)), key=lambda k: scores[k])
        others = [s for k, s in enumerate(scores) if k != best]
        return best, (scores[best] - max(others)) if others else c.mp.inf

    def _expert(self, c, e, y: dict[int, Any]) -> dict[int, Any]:
        """y + W_2 ReLU(W_1 y + b_1), exactly."""
        act = {}
        for i, row in enumerate(c.row_dicts(e.W_1)):
            pairs = [(a, y[j]) for j, a in row.items() if j in y]
            b = c.mp.mpf(float(e.b_1[i]))
            if b:
                pairs.append((b, c.one))
            z = c.xdot(pairs) if pairs else c.zero
            if z > 0:
                act[i] = z
        out = dict(y)
        for i, v in c.matvec(c.rows(e.W_2), act).items():
            out[i] = c.xadd(out[i], v) if i in out else v
        return {j: v for j, v in out.items() if v}

    def query(self, stack: Stack, ids: tuple[int, ...], valid: frozenset[int], target: int | None = None
              ) -> dict[str, Any]:
        """The exact values of the query ``ids`` (the weights' token ids, BOS not included);
        with ``target`` (an object o) also ``ablated2_object``, 1 − P(o) with layer 2's expert removed."""
        o = self.oracle
        c = o.ctx(self.dps)
        w, s = stack.first, stack.second
        fp = _Fingerprints(w)
        _, r, _ = o._residual(c, w, fp, tuple(ids))
        e1, m1 = self._gate(c, w.W_G, w.b_G, r)
        y = self._expert(c, w.experts[e1], r)
        e2, m2 = self._gate(c, s.W_G, s.b_G, y)
        y2 = self._expert(c, s.experts[e2], y)
        err, _ = o._error(c, w, fp, y2, valid)
        # hop 1 removed: layer 2 runs on r; hop 2 removed: the logits of y
        a2, _ = self._gate(c, s.W_G, s.b_G, r)
        ab1, _ = o._error(c, w, fp, self._expert(c, s.experts[a2], r), valid)
        ab2, _ = o._error(c, w, fp, y, valid)
        out = {"expert1": e1, "margin1": m1, "expert2": e2, "margin2": m2, "error": err,
               "ablated1": ab1, "ablated2": ab2}
        if target is not None:
            out["ablated2_object"], _ = o._error(c, w, fp, y, frozenset({target}))
        return out


# --- judging a two-layer model, and mutating either layer ------------------------------------


def judge(taskset, stack: Stack, epsilon: float, oracle: LayersOracle | None = None) -> list[str]:
    """The requirements ``stack`` truly violates on ``taskset`` (exact values, the oracle's
    precision): ``names`` (layer 1 names a task twice), ``error`` (some query's error >= ε),
    ``routing1`` (layer 1's argmax serves no task the query is consistent with, a composed
    task counting as its first hop; or a tie), ``routing2`` (layer 2's argmax is not the
    expert holding g at an object query of a composed task (f, g), nor one holding no task
    elsewhere; or a tie), ``entanglement1`` (an object query answered within ε without its
    layer-1 expert), ``entanglement2`` (a composed object query whose object o has
    1 − P(o) < ε without its layer-2 expert), ``size`` (an expert over its bound). Queries are enumerated from the
    task set's sentences (:func:`audit.oracle.enumerate_queries`)."""
    from audit.oracle import enumerate_queries

    oracle = oracle or LayersOracle()
    w, s = stack.first, stack.second
    out: set[str] = set()
    named = [t for t in w.expert_tasks if t]
    if len(named) != len(set(named)):
        out.add("names")
    index = {tok: i for i, tok in enumerate(w.vocab)}
    owner = [t.compose[0] if t.compose else t.name for t in taskset.tasks]
    L = taskset.L
    for t in taskset.tasks:
        if t.compose is None:
            templates = t.n_templates + sum(x.n_templates for x in taskset.tasks
                                            if x.compose and x.compose[0] == t.name)
            for e, name in enumerate(w.expert_tasks):
                if name == t.name and w.experts[e].width > L * templates + t.n_facts:
                    out.add("size")
            for e, name in enumerate(s.expert_tasks):
                if name == t.name and s.experts[e].width > t.n_facts:
                    out.add("size")
    for q in enumerate_queries(taskset):
        if any(tok not in index for tok in q.prefix) or any(tok not in index for tok in q.valid):
            out.add("layout")
            continue
        task = taskset.tasks[q.determined] if q.determined is not None else None
        object_query = task is not None and q.determined in q.object_of
        target = None
        if object_query and task.compose:
            target = index[task.facts[next(tok for tok in q.prefix if tok in task.facts)]]
        ex = oracle.query(stack, tuple(index[t] for t in q.prefix), frozenset(index[t] for t in q.valid), target)
        if ex["error"] >= epsilon:
            out.add("error")
        if ex["margin1"] <= 0 or not any(owner[k] == w.expert_tasks[ex["expert1"]] for k in q.tasks):
            out.add("routing1")
        composed_oq = bool(object_query and task.compose)
        want = task.compose[1] if composed_oq else ""
        if ex["margin2"] <= 0 or s.expert_tasks[ex["expert2"]] != want:
            out.add("routing2")
        if object_query:
            if ex["ablated1"] < epsilon:
                out.add("entanglement1")
            if composed_oq and ex["ablated2_object"] < epsilon:
                out.add("entanglement2")
    return sorted(out)


def second_layer_view(stack: Stack):
    """Layer 2 as one-layer weights (its gate and experts with layer 1's embeddings and
    unembedding), so that the one-layer mutation operators (:mod:`audit.operators`) act on
    it; its neurons labelled ``fact:<bridge>``."""
    w, s = stack.first, stack.second
    names = w.residual_labels

    def label(e, i: int) -> str:
        row = e.W_1.indices[e.W_1.indptr[i]:e.W_1.indptr[i + 1]]
        read = names[int(row[0])].split(":", 1)[-1] if names is not None and row.size else str(i)
        return f"fact:{read}"

    labels = tuple(tuple(label(e, i) for i in range(e.width)) for e in s.experts)
    return w.replace(W_G=s.W_G, b_G=s.b_G, experts=s.experts, expert_tasks=s.expert_tasks, neuron_labels=labels)


def from_view(stack: Stack, view) -> Stack:
    """The stack whose layer 2 (and shared blocks) are the mutated view's."""
    from layout.layers import MoELayer

    first = stack.first.replace(E=view.E, P=view.P, heads=view.heads, U=view.U)
    return Stack(first, MoELayer(view.W_G, view.b_G, view.experts, view.expert_tasks))


def mutate(stack: Stack, layer: int, op, rng) -> tuple[Stack, str]:
    """``op`` (an :class:`audit.operators.Operator`) applied to one layer of the stack."""
    if layer == 1:
        mutant, what = op(stack.first, rng)
        return Stack(mutant, stack.second), what
    view, what = op(second_layer_view(stack), rng)
    return from_view(stack, view), what


def campaign(taskset, stack: Stack, epsilon: float, draws: int = 1, seed: int = 0, oracle: LayersOracle | None = None):
    """Every one-layer mutation operator (:data:`audit.operators.OPERATORS`) applied ``draws``
    times to each layer; per mutant (layer, operator, what changed, the oracle's violations
    or None for weights the layout refuses, the verifier's verdict). A *false pass* is a
    mutant the verifier certifies that truly violates a requirement."""
    import numpy as np

    from audit.operators import OPERATORS, NotApplicable
    from tasks.errors import TaskError
    from verifier.checks.layers import verify_layers

    rng = np.random.default_rng(seed)
    oracle = oracle or LayersOracle()
    rows = []
    for layer in (1, 2):
        for name, op in OPERATORS.items():
            for _ in range(draws):
                try:
                    mutant, what = mutate(stack, layer, op, rng)
                except NotApplicable:
                    continue
                try:
                    mutant.validate()
                except TaskError:
                    rows.append((layer, name, what, None, False))
                    continue
                rows.append((layer, name, what, judge(taskset, mutant, epsilon, oracle),
                             verify_layers(taskset, mutant, epsilon).certified))
    return rows
