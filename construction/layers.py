"""Two hops: the two-layer construction for a task set with composed tasks.

A composed task c = (f, g) answers D_g(D_f(s)) (:mod:`tasks.composition`); every object of
f is a subject of g. The model (:class:`layout.layers.Stack`) stores each fact once per
layer in which it is used:

**Layer 1** is the one-layer construction (Theorem 4.2, :mod:`construction.model`) of the
*first-layer task set* T¹: each stored task f with the templates of every composed task
whose first hop is f added to its own, and f's facts. So a query of c is routed to f's
expert, whose template neurons predict c's template words and whose dictionary neuron of
s writes the bridge b = D_f(s) on ``next:b`` at c's object query. f's expert also gets a
**detector neuron** per object-query structure σ (of length p) of c's templates::

    z = 2·Σ_{m<=p} slot<m>:σ_m + 2·pos:p − (2p + 1),    writes 1·hop:g

(a template neuron's input, :mod:`construction.experts`; its claim: activation in
[1 − 2pδ_p, 1] at a prefix of structure σ, exactly 0 at every other prefix). ``hop:g`` is
a residual direction of its own per second-hop task g.

**Layer 2** has no attention heads. Its gate has a *pass* expert (width 0, score 0) and one
expert per second-hop task g (score hop:g − 1/2). Expert g has one neuron per bridge
entity b (an object of a first hop composed with g)::

    z = 2·next:b − 1,    writes 2·next:D_g(b) − 1·next:b

**Theorem (two hops).** Let the first-layer task set T¹ meet Theorem 4.2's conditions at
(β, γ) with bound ε₁(β, γ) for the vocabulary size V, and let 2pδ_p < 1/2 for every
composed object-query length p, δ_S = e^−β < 1/8, and no template of a composed task share
a prefix structure past ⋆2 with another template of its first task's expert. Then every
query of the task set has error at most max(ε₁, ε₂) with

    ε₂(β, γ) = (e^{2γδ_S} + V − 2) / (e^{γ(2 − 8δ_S)} + e^{2γδ_S} + V − 2),

and is routed, in layer 1, to the expert of its task (a composed task's: its first hop),
in layer 2 to expert g at an object query of a composed task (f, g), to the pass elsewhere.

*Proof.* Layer 1 is Theorem 4.2's model of T¹ with detector neurons added, and they write
only ``hop``, which neither the unembedding nor layer 1 reads. Every query of the task set
is a query of T¹ with the same structure, subject and valid next tokens, except a
composed task's object query (whose object in T¹ is the bridge) and its prefixes past ⋆2
(whose object token differs; the one-layer claims depend on the structure and the
subject only, and by the last condition the words a template neuron writes there are
those of c's own templates, hence valid). (i) *Not an object query of a composed task:*
no detector fires (its structure is an object-query structure of a composed task, whose
prefixes are none of these), so hop = 0 exactly, layer 2 routes to the pass with margin
1/2 and adds nothing: the output is layer 1's, error <= ε₁. (ii) *Object query of
c = (f, g):* routed in layer 1 to f's expert; exactly one detector fires, with activation
a_h ∈ [1 − 2pδ_p, 1], so layer 2's scores are a_h − 1/2 > 0 for g, 0 for the pass and −1/2
for the others: g wins. After layer 1, ``next`` holds a ∈ [1 − 2δ_S, 1] on the bridge b
(the subject's dictionary neuron; the prefix holds one entity) and template words on
valid tokens only. Layer 2's neuron of b has z = 2a − 1 ∈ [1 − 4δ_S, 1]; the others read
``next:e`` = 0 and are off. The object o = D_g(b) then has logit at least γ·2z >= γ(2 − 8δ_S)
(γ(a + z) >= γ(2 − 6δ_S) if o = b), b at most γ(a − z) = γ(1 − a) <= 2γδ_S, every other
invalid token 0: error <= ε₂, as in Theorem 4.2's object case. ∎

**Size.** Layer 1 is Theorem 4.2's model of T¹ plus one detector per composed template:
expert f has width at most L·(|T(f)| + Σ_{c: first f} |T(c)|) + N_f. Layer 2's expert g has
one neuron per bridge entity, at most N_g. A composed task costs parameters in proportion
to its templates (its template neurons and detectors in its first hop's expert, its
gate features), never to its facts; a task used as a second hop is stored once more, in
layer 2, once for every composition that ends in it. A task used both as a first and as a
second hop is stored once per layer: twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import scipy.sparse as sp
from mpmath.ctx_iv import MPIntervalContext

from construction.model import SymbolicModel, build
from construction.residual import ENTITY_SYMBOL
from layout import Expert, Head, canonical
from layout.layers import MoELayer, Stack
from tasks.errors import TaskError
from tasks.messages import show_name
from tasks.model import OBJECT, Slot, Task, TaskSet


def _structure(parts) -> tuple[str, ...]:
    return tuple(ENTITY_SYMBOL if isinstance(x, Slot) else x for x in parts)


def first_layer_tasks(taskset: TaskSet) -> TaskSet:
    """T¹: each stored task with the templates of the composed tasks that start with it (the
    module docstring); the composed tasks themselves are gone."""
    extra: dict[str, list] = {}
    for t in taskset.tasks:
        if t.compose is not None:
            extra.setdefault(t.compose[0], []).extend(t.templates)
    tasks = []
    for t in taskset.tasks:
        if t.compose is None:
            tasks.append(Task(t.name, t.templates + tuple(extra.get(t.name, ())), t.facts))
    return TaskSet(tuple(tasks), taskset.epsilon, taskset.parameters)


def _check_past_object(taskset: TaskSet) -> None:
    """The theorem's last condition: no template of a composed task shares a prefix structure
    reaching past ⋆2 with another template of its first hop's expert (T¹'s task f)."""
    expert: dict[str, list[tuple[str, object]]] = {}
    for t in taskset.tasks:
        owner = t.compose[0] if t.compose is not None else t.name
        expert.setdefault(owner, []).extend((t.name, tp) for tp in t.templates)
    for owner, templates in expert.items():
        for i, (a, ta) in enumerate(templates):
            for b, tb in templates[i + 1:]:
                if a == b or not (taskset.tasks[taskset.index(a)].composed or taskset.tasks[taskset.index(b)].composed):
                    continue
                sa, sb = _structure(ta.parts), _structure(tb.parts)
                j = ta.parts.index(OBJECT)
                if tb.parts.index(OBJECT) == j and len(sa) > j + 1 and len(sb) > j + 1 and sa[:j + 2] == sb[:j + 2]:
                    raise TaskError(f"templates '{ta}' of task {show_name(a)} and '{tb}' of task {show_name(b)} "
                                    f"share a prefix past ⋆2, which the two-layer construction does not build",
                                    fix="make them differ right after ⋆2, or check with --layers 1 (one layer "
                                        "storing every composed fact)")


@dataclass(frozen=True)
class Detector:
    """A layer-1 neuron that fires at the object queries of one structure of a composed task."""

    expert: int                 # its expert in layer 1 (T¹'s task, the composed task's first hop)
    structure: tuple[str, ...]  # σ, the object-query structure (p = len(σ))
    second: str                 # g: the task whose hop direction it writes
    task: str                   # the composed task


@dataclass(frozen=True)
class TwoLayerModel:
    """The two-layer construction of a task set with composed tasks (module docstring)."""

    taskset: TaskSet            # the task set, composed tasks included
    first: SymbolicModel        # layer 1 without the detectors: Theorem 4.2's model of T¹
    detectors: tuple[Detector, ...]
    seconds: tuple[str, ...]    # the second-hop tasks, in layer-2 expert order (after the pass)
    bridges: tuple[tuple[str, ...], ...]    # per second-hop task, its bridge entities (sorted)

    @property
    def epsilon(self) -> float:
        return self.first.epsilon

    @property
    def beta(self) -> Fraction:
        return self.first.beta

    @property
    def gamma(self) -> Fraction:
        return self.first.gamma

    def bound_value(self) -> float:
        """A proven upper bound on max(ε₁, ε₂) at the model's β, γ (interval arithmetic)."""
        return max(self.first.bound_value(), second_bound_upper(self.taskset.vocabulary.size, self.beta, self.gamma))

    def unproven_conditions(self) -> list[str]:
        """The theorem's side conditions not proven at β (none: the bound is proven)."""
        out = list(self.first.unproven_conditions())
        iv = _iv()
        b = iv.mpf([self.beta.numerator, self.beta.numerator]) / self.beta.denominator
        for p in sorted({len(d.structure) for d in self.detectors}):
            leak = 2 * p * p / (iv.exp(b) + p)
            if not leak.b < iv.mpf(0.5).a:
                out.append(f"layer 2's gate needs 2·p·delta_p < 1/2 at p = {p}, and it is up to {float(leak.b):.3g}")
        if not (1 / iv.exp(b)).b < iv.mpf(0.125).a:
            out.append("layer 2's neurons need e^-beta < 1/8")
        return out

    def costs(self) -> list[dict]:
        """Per task, its neurons in each layer and what one layer storing every composed fact
        costs (``inspect``): template neurons and detectors of a composed task sit in its first
        hop's expert; a second-hop task's layer-2 neurons are counted once, with it."""
        ts = self.taskset
        t1 = self.first.taskset
        widths1 = dict(zip(t1.names, self.first.widths))
        bridge = dict(zip(self.seconds, self.bridges))
        out = []
        for task in ts.tasks:
            row = {"task": task.name, "templates": task.n_templates, "facts": task.n_facts,
                   "compose": list(task.compose) if task.compose is not None else None}
            if task.compose is None:
                row["layer1"] = _template_neurons(task) + task.n_facts
                row["layer1_expert_width"] = widths1[task.name] + sum(1 for d in self.detectors
                                                                     if d.expert == t1.index(task.name))
                row["layer2"] = len(bridge.get(task.name, ()))
                row["one_layer"] = row["layer1"]
            else:
                dets = sum(1 for d in self.detectors if d.task == task.name)
                row["layer1"] = _template_neurons(task) + dets
                row["layer2"] = 0
                row["one_layer"] = _template_neurons(task) + task.n_facts
            out.append(row)
        return out

    def instantiate(self, labels: bool = True) -> Stack:
        """The numeric two-layer weights (exact for the dyadic β and γ the construction picks);
        ``labels``: name the residual directions and neurons (as the one-layer model's
        :meth:`~construction.model.SymbolicModel.instantiate`; a check names none)."""
        w = self.first.instantiate(labels=labels)
        d0, G = w.d, len(self.seconds)
        d = d0 + G
        cols = lambda M: canonical(sp.hstack([M, sp.csr_matrix((M.shape[0], G))], format="csr"))  # noqa: E731
        rows = lambda M: canonical(sp.vstack([M, sp.csr_matrix((G, M.shape[1]))], format="csr"))  # noqa: E731
        residual = self.first.residual
        hop = {g: d0 + i for i, g in enumerate(self.seconds)}
        experts = []
        for k, e in enumerate(w.experts):
            mine = [det for det in self.detectors if det.expert == k]
            W1, b1, W2 = cols(e.W_1), np.asarray(e.b_1, np.float64), rows(e.W_2)
            if mine:
                r, c, v, bias, r2, c2 = [], [], [], [], [], []
                for i, det in enumerate(mine):
                    p = len(det.structure)
                    r.append(i)
                    c.append(residual.index("pos", p))
                    for m, sym in enumerate(det.structure, start=1):
                        r.append(i)
                        c.append(residual.index(f"slot{m}", sym))
                    bias.append(-(2.0 * p + 1.0))
                    r2.append(hop[det.second])
                    c2.append(i)
                v = np.full(len(r), 2.0)
                extra1 = sp.csr_matrix((v, (r, c)), shape=(len(mine), d))
                extra2 = sp.csr_matrix((np.ones(len(mine)), (r2, c2)), shape=(d, len(mine)))
                W1 = canonical(sp.vstack([W1, extra1], format="csr"))
                b1 = np.concatenate([b1, np.asarray(bias)])
                W2 = canonical(sp.hstack([W2, extra2], format="csr"))
            experts.append(Expert(W1, b1, W2))
        labels = None
        if w.residual_labels is not None:
            labels = tuple(w.residual_labels) + tuple(f"hop:{g}" for g in self.seconds)
        neuron_labels = None
        if w.neuron_labels is not None:
            neuron_labels = tuple(tuple(ls) + tuple(f"detector:{' '.join(det.structure)}" for det in self.detectors
                                                   if det.expert == k) for k, ls in enumerate(w.neuron_labels))
        first = w.replace(
            E=cols(w.E), P=cols(w.P),
            heads=tuple(Head(cols(h.W_Q), cols(h.W_K), cols(h.W_V), rows(h.W_O)) for h in w.heads),
            W_G=cols(w.W_G), experts=tuple(experts), U=cols(w.U), residual_labels=labels, neuron_labels=neuron_labels,
            parameters={**w.parameters, "layers": 2})
        return Stack(first, self._second_layer(d, d0))

    def _second_layer(self, d: int, d0: int) -> MoELayer:
        vocab = self.taskset.vocabulary
        nxt = self.first.residual.offset("next")
        G = len(self.seconds)
        W_G = canonical(sp.csr_matrix((np.ones(G), (np.arange(1, G + 1), d0 + np.arange(G))), shape=(G + 1, d)))
        b_G = np.concatenate([[0.0], np.full(G, -0.5)])
        experts = [Expert(canonical(sp.csr_matrix((0, d))), np.zeros(0), canonical(sp.csr_matrix((d, 0))))]
        for g, bridges in zip(self.seconds, self.bridges):
            facts = self.taskset.tasks[self.taskset.index(g)].facts
            n = len(bridges)
            ids = np.array([vocab.id(b) for b in bridges], np.int64)
            objs = np.array([vocab.id(facts[b]) for b in bridges], np.int64)
            W_1 = canonical(sp.csr_matrix((np.full(n, 2.0), (np.arange(n), nxt + ids)), shape=(n, d)))
            same = objs == ids
            r = np.concatenate([nxt + objs[~same], nxt + ids[~same], nxt + ids[same]])
            c = np.concatenate([np.flatnonzero(~same), np.flatnonzero(~same), np.flatnonzero(same)])
            v = np.concatenate([np.full(int((~same).sum()), 2.0), np.full(int((~same).sum()), -1.0),
                                np.ones(int(same.sum()))])
            W_2 = canonical(sp.csr_matrix((v, (r, c)), shape=(d, n)))
            experts.append(Expert(W_1, np.full(n, -1.0), W_2))
        return MoELayer(W_G, b_G, tuple(experts), ("",) + self.seconds)


def _template_neurons(task: Task) -> int:
    from construction.experts import template_nodes

    return len(template_nodes(task))


def _iv() -> MPIntervalContext:
    ctx = MPIntervalContext()
    ctx.prec = 120
    return ctx


def second_bound_upper(V: int, beta: Fraction, gamma: Fraction) -> float:
    """A proven upper bound on ε₂(β, γ) (the module docstring), in interval arithmetic."""
    iv = _iv()
    beta, gamma = Fraction(beta), Fraction(gamma)
    b = iv.mpf([beta.numerator, beta.numerator]) / beta.denominator
    g = iv.mpf([gamma.numerator, gamma.numerator]) / gamma.denominator
    ds = 1 / iv.exp(b)
    leak = iv.exp(2 * g * ds)
    value = (leak + (V - 2)) / (iv.exp(g * (2 - 8 * ds)) + leak + (V - 2))
    return float(value.b) * (1 + 2 ** -50)


def build_two_layers(taskset: TaskSet, epsilon: float | None = None, beta: float | None = None,
                     gamma: float | None = None) -> TwoLayerModel:
    """The two-layer model of a task set with composed tasks (module docstring). Raises
    TaskError when T¹ cannot be routed or the past-⋆2 condition fails."""
    if not any(t.composed for t in taskset.tasks):
        raise TaskError("the task set has no composed task: the two-layer construction composes two tasks",
                        fix="add a task with 'compose: [first, second]', or build one layer")
    _check_past_object(taskset)
    t1 = first_layer_tasks(taskset)
    try:
        first = build(t1, epsilon if epsilon is not None else taskset.epsilon, beta, gamma)
    except TaskError as e:
        raise TaskError(f"layer 1 (each composed task's templates added to its first task) cannot be built: "
                        f"{e.problem}", file=taskset.sources.file if taskset.sources else None,
                        fix=e.fix or "check with --layers 1") from None
    detectors = []
    seconds: list[str] = []
    bridges: dict[str, set[str]] = {}
    for t in taskset.tasks:
        if t.compose is None:
            continue
        f, g = t.compose
        k = t1.index(f)
        if g not in bridges:
            seconds.append(g)
            bridges[g] = set()
        bridges[g].update(taskset.tasks[taskset.index(f)].facts.objects)
        seen = set()
        for tp in t.templates:
            sigma = _structure(tp.parts[:tp.parts.index(OBJECT)])
            if sigma not in seen:
                seen.add(sigma)
                detectors.append(Detector(k, sigma, g, t.name))
    vocab = taskset.vocabulary
    order = tuple(tuple(sorted(bridges[g], key=vocab.id)) for g in seconds)
    return TwoLayerModel(taskset, first, tuple(detectors), tuple(seconds), order)
