"""Mutation operators on weights, for testing that the verifier cannot be fooled.

Each operator is a small function ``(weights, rng) -> (mutant, description)``: it
returns new :class:`~layout.Weights` (the input is never modified) and one line saying
what changed, by name where the weights carry labels (``weights.neuron_labels`` such as
``fact:France``, ``weights.residual_labels`` such as ``subj:France``). An operator that
does not apply to the given weights raises :class:`NotApplicable`.

Operators are *intended* to violate a requirement (``violating``), to leave the model
correct (``harmless``: true negatives), or either depending on the draw (``mixed``).
The intent is documentation only: whether a mutant truly violates a requirement is
decided by the independent oracle (:mod:`audit.oracle`) in a campaign
(:mod:`audit.campaign`).

Operators that need the construction's labels (fact and template neurons, ``subj:`` and
``next:`` directions) raise :class:`NotApplicable` on unlabelled weights. Besides the
catalogue :data:`OPERATORS`, :func:`boundary_operators` makes three targeted operators
per task set that put a mutant within 10^-k of a threshold (error = ε, a gate tie,
ablated error = ε), on either side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp

from layout import Expert, Head, Weights, canonical
from tasks.model import TaskSet

HUGE = 1e308           # with a second such term the exact value exceeds float64's range
FLOAT_MAX = float(np.finfo(np.float64).max)


class NotApplicable(Exception):
    """The operator cannot act on these weights (e.g. no two distinct facts)."""


Mutation = Callable[[Weights, np.random.Generator], "tuple[Weights, str]"]


@dataclass(frozen=True)
class Operator:
    name: str
    kind: str            # "violating", "harmless" or "mixed"
    fn: Mutation

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0]

    def __call__(self, weights: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
        return self.fn(weights, rng)


OPERATORS: dict[str, Operator] = {}


def operator(kind: str):
    def register(fn: Mutation) -> Mutation:
        OPERATORS[fn.__name__] = Operator(fn.__name__, kind, fn)
        return fn
    return register


# --- helpers ---------------------------------------------------------------------------------


def _csr(m) -> sp.csr_matrix:
    """Canonical float64 CSR (column indexing and stacking may leave rows unsorted)."""
    return canonical(m)


def _set(m, entries) -> sp.csr_matrix:
    """A copy of ``m`` with ``entries`` {(i, j): value} set."""
    lil = sp.lil_matrix(m, dtype=np.float64, copy=True)
    for (i, j), v in entries.items():
        lil[i, j] = v
    return _csr(lil)


def _pick(rng: np.random.Generator, seq):
    seq = list(seq)
    if not seq:
        raise NotApplicable("nothing to choose from")
    return seq[int(rng.integers(len(seq)))]


def _task(w: Weights, k: int) -> str:
    return w.expert_tasks[k] or "no task"


def _labels(w: Weights, k: int) -> list[str]:
    if w.neuron_labels is None:
        raise NotApplicable("the weights carry no neuron labels")
    return list(w.neuron_labels[k])


def _neuron_label(w: Weights, k: int, i: int) -> str:
    if w.neuron_labels is not None and i < len(w.neuron_labels[k]):
        return w.neuron_labels[k][i]
    return f"neuron {i}"


def _residual_label(w: Weights, j: int) -> str:
    if w.residual_labels is not None and j < len(w.residual_labels):
        return w.residual_labels[j]
    return f"direction {j}"


def _residual(w: Weights, label: str) -> int:
    if w.residual_labels is None or label not in w.residual_labels:
        raise NotApplicable(f"no residual direction {label!r}")
    return w.residual_labels.index(label)


def _replace_expert(w: Weights, k: int, expert: Expert, labels: list[str] | None = None) -> Weights:
    experts = list(w.experts)
    experts[k] = expert
    changes: dict[str, Any] = {"experts": tuple(experts)}
    if w.neuron_labels is not None:
        nl = list(w.neuron_labels)
        nl[k] = tuple(labels if labels is not None else nl[k])
        if len(nl[k]) != expert.width:
            nl[k] = tuple(f"neuron {i}" for i in range(expert.width))
        changes["neuron_labels"] = tuple(nl)
    return w.replace(**changes)


def _keep_neurons(e: Expert, keep: list[int]) -> Expert:
    return Expert(_csr(e.W_1[keep]), np.asarray(e.b_1)[keep].copy(), _csr(e.W_2[:, keep]))


def _append_neurons(e: Expert, W_1_rows, b, W_2_cols) -> Expert:
    return Expert(_csr(sp.vstack([e.W_1, _csr(W_1_rows)])), np.concatenate([e.b_1, np.asarray(b, np.float64)]),
                  _csr(sp.hstack([e.W_2, _csr(W_2_cols)])))


def _written(w: Weights, e: Expert, i: int) -> str:
    """The residual directions neuron i writes, as text."""
    col = e.W_2[:, i].tocoo()
    return ", ".join(_residual_label(w, int(r)) for r in col.row[:3]) or "nothing"


def _neurons(w: Weights, prefix: str) -> list[tuple[int, int]]:
    if w.neuron_labels is None:
        raise NotApplicable("the weights carry no neuron labels")
    return [(k, i) for k, labels in enumerate(w.neuron_labels)
            for i, lab in enumerate(labels) if lab.startswith(prefix)]


def _append_expert(w: Weights, expert: Expert, gate_row, bias: float, name: str, labels: list[str]) -> Weights:
    changes: dict[str, Any] = {
        "experts": w.experts + (expert,),
        "W_G": _csr(sp.vstack([w.W_G, _csr(gate_row).reshape(1, -1)])),
        "b_G": np.concatenate([w.b_G, [bias]]),
        "expert_tasks": w.expert_tasks + (name,),
    }
    if w.neuron_labels is not None:
        changes["neuron_labels"] = w.neuron_labels + (tuple(labels),)
    return w.replace(**changes)


def _with_dimension(w: Weights, label: str) -> tuple[Weights, int]:
    """The same model with one more residual direction, which nothing reads or writes."""
    d = w.d
    col = lambda m: _csr(sp.hstack([m, sp.csr_matrix((m.shape[0], 1))]))  # noqa: E731
    row = lambda m: _csr(sp.vstack([m, sp.csr_matrix((1, m.shape[1]))]))  # noqa: E731
    heads = tuple(Head(col(h.W_Q), col(h.W_K), col(h.W_V), row(h.W_O)) for h in w.heads)
    experts = tuple(Expert(col(e.W_1), e.b_1.copy(), row(e.W_2)) for e in w.experts)
    labels = w.residual_labels + (label,) if w.residual_labels is not None else None
    return w.replace(E=col(w.E), P=col(w.P), heads=heads, W_G=col(w.W_G), experts=experts, U=col(w.U),
                     residual_labels=labels), d


def _fraction(text: Any) -> Fraction:
    try:
        return Fraction(str(text))
    except (ValueError, ZeroDivisionError):
        raise NotApplicable(f"parameter {text!r} is not a number") from None


def _scale(m, factor: float) -> sp.csr_matrix:
    out = _csr(m).copy()
    out.data = out.data * factor
    return out


# --- operators that should be caught -----------------------------------------------------------


def _column_class(W_2) -> np.ndarray:
    """One integer per column of ``W_2``, equal for two columns exactly when ``W_2[:, i] !=
    W_2[:, j]`` has no entry: the same nonzero entries at the same rows (stored zeros and
    -0.0 count as zero, and a column holding a NaN equals no column, as ``!=`` says)."""
    csc = sp.csc_matrix(W_2)
    classes: dict[tuple, int] = {}
    out = np.empty(csc.shape[1], np.int64)
    for c in range(csc.shape[1]):
        rows, vals = csc.indices[csc.indptr[c]:csc.indptr[c + 1]], csc.data[csc.indptr[c]:csc.indptr[c + 1]]
        nz = vals != 0
        order = np.argsort(rows[nz], kind="stable")
        rows, vals = rows[nz][order], vals[nz][order]
        key = ("nan", c) if np.isnan(vals).any() else (rows.tobytes(), vals.astype(np.float64).tobytes())
        out[c] = classes.setdefault(key, len(classes))
    return out


def _pick_differing_pair(w: Weights, rng: np.random.Generator, neurons: list[tuple[int, int]]) -> tuple[int, int, int]:
    """``_pick(rng, pairs)`` over the pairs ``(k, i, j)``, ``i < j`` neurons of ``neurons`` in
    one expert whose W_2 columns differ, in the order (k, i, j): the same choice as
    listing them, for the same ``rng``, without listing the pairs (quadratic in the facts
    of an expert: 80 s for 1000 facts). Position ``a`` of an expert's neurons has
    ``(n - 1 - a) - (later neurons of its class)`` partners after it; the m-th pair is
    found by cumulative counts."""
    by_expert: dict[int, list[int]] = {}
    for k, i in neurons:
        by_expert.setdefault(k, []).append(i)
    blocks = []
    for k in sorted(by_expert):
        idx = np.asarray(sorted(by_expert[k]), np.int64)
        cls = _column_class(w.experts[k].W_2)[idx]
        n = idx.size
        later_same = np.zeros(n, np.int64)           # neurons after position a in a's class
        seen: dict[int, int] = {}
        for a in range(n - 1, -1, -1):
            later_same[a] = seen.get(int(cls[a]), 0)
            seen[int(cls[a])] = later_same[a] + 1
        partners = (n - 1 - np.arange(n)) - later_same
        blocks.append((k, idx, cls, partners))
    total = sum(int(b[3].sum()) for b in blocks)
    if total == 0:
        raise NotApplicable("nothing to choose from")
    m = int(rng.integers(total))
    for k, idx, cls, partners in blocks:
        here = int(partners.sum())
        if m >= here:
            m -= here
            continue
        cum = np.cumsum(partners)
        a = int(np.searchsorted(cum, m, side="right"))
        r = m - (int(cum[a - 1]) if a else 0)
        b = a + 1 + int(np.flatnonzero(cls[a + 1:] != cls[a])[r])
        return k, int(idx[a]), int(idx[b])
    raise AssertionError("unreachable: m < total")


@operator("violating")
def swap_facts(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Swap the objects two dictionary neurons of one expert write (W_2 columns)."""
    k, i, j = _pick_differing_pair(w, rng, _neurons(w, "fact:"))
    e = w.experts[k]
    W_2 = sp.lil_matrix(e.W_2, copy=True)
    ci, cj = W_2[:, i].copy(), W_2[:, j].copy()
    W_2[:, i], W_2[:, j] = cj, ci
    return (_replace_expert(w, k, Expert(e.W_1, e.b_1, _csr(W_2))),
            f"expert {k} ({_task(w, k)}): {_neuron_label(w, k, i)} and {_neuron_label(w, k, j)} swap objects "
            f"({_written(w, e, i)} <-> {_written(w, e, j)})")


def _delete_neuron(w: Weights, rng: np.random.Generator, prefix: str) -> tuple[Weights, str]:
    """Delete one neuron whose label starts with ``prefix``."""
    k, i = _pick(rng, _neurons(w, prefix))
    keep = [n for n in range(w.experts[k].width) if n != i]
    labels = [lab for n, lab in enumerate(_labels(w, k)) if n != i]
    return (_replace_expert(w, k, _keep_neurons(w.experts[k], keep), labels),
            f"expert {k} ({_task(w, k)}): deleted {_neuron_label(w, k, i)}")


@operator("violating")
def delete_fact_neuron(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Delete one dictionary neuron (a fact is forgotten)."""
    return _delete_neuron(w, rng, "fact:")


@operator("violating")
def delete_template_neuron(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Delete one template neuron (a next word, or the subjects, is no longer predicted)."""
    return _delete_neuron(w, rng, "template:")


@operator("mixed")
def lower_beta(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Lower the attention inverse temperature β (every head's W_Q scaled by β'/β < 1)."""
    if "beta" not in w.parameters:
        raise NotApplicable("no beta in the parameters")
    beta = _fraction(w.parameters["beta"])
    new = beta * Fraction(int(rng.integers(1, 16)), 16)
    f = float(new / beta)
    heads = tuple(Head(_scale(h.W_Q, f), h.W_K, h.W_V, h.W_O) for h in w.heads)
    return (w.replace(heads=heads, parameters={**w.parameters, "beta": str(new)}),
            f"beta {beta} -> {new} (every W_Q x {new / beta})")


@operator("mixed")
def lower_gamma(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Lower the logit scale γ (U scaled by γ'/γ < 1)."""
    if "gamma" not in w.parameters:
        raise NotApplicable("no gamma in the parameters")
    gamma = _fraction(w.parameters["gamma"])
    new = gamma * Fraction(int(rng.integers(8, 16)), 16) if rng.random() < 0.7 else gamma - Fraction(1, 16)
    f = float(new / gamma)
    return (w.replace(U=_scale(w.U, f), parameters={**w.parameters, "gamma": str(new)}),
            f"gamma {gamma} -> {new} (U x {new / gamma})")


@operator("mixed")
def perturb_gate_row(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Perturb one gate row: add another row to it, add noise, or zero it."""
    K = len(w.experts)
    k = int(rng.integers(K))
    W_G = sp.lil_matrix(w.W_G, copy=True)
    how = _pick(rng, ["add", "noise", "zero"] if K > 1 else ["noise", "zero"])
    if how == "add":
        j = _pick(rng, [x for x in range(K) if x != k])
        c = float(_pick(rng, [0.25, 0.5, 1.0, 2.0]))
        W_G[k] = W_G[k] + c * W_G[j]
        text = f"gate row {k} ({_task(w, k)}) += {c} x row {j} ({_task(w, j)})"
    elif how == "noise":
        sigma = float(10.0 ** rng.uniform(-8, 0.5))
        row = W_G[k].toarray().reshape(-1)
        nz = np.flatnonzero(row)
        if nz.size == 0:
            nz = np.arange(row.size)
        row[nz] += rng.normal(0, sigma, nz.size)
        W_G[k] = row
        text = f"gate row {k} ({_task(w, k)}): gaussian noise, sigma {sigma:.3g}, on its {nz.size} entries"
    else:
        W_G[k] = 0
        text = f"gate row {k} ({_task(w, k)}) zeroed"
    return w.replace(W_G=_csr(W_G)), text


@operator("violating")
def swap_experts(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Swap two experts' matrices; names and gate rows stay where they were."""
    K = len(w.experts)
    if K < 2:
        raise NotApplicable("one expert")
    i, j = (int(x) for x in rng.choice(K, 2, replace=False))
    experts = list(w.experts)
    experts[i], experts[j] = experts[j], experts[i]
    labels = None
    if w.neuron_labels is not None:
        nl = list(w.neuron_labels)
        nl[i], nl[j] = nl[j], nl[i]
        labels = tuple(nl)
    return (w.replace(experts=tuple(experts), neuron_labels=labels),
            f"experts {i} ({_task(w, i)}) and {j} ({_task(w, j)}) swapped (matrices, not names)")


@operator("violating")
def zero_head_output(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Zero one attention head's W_O (the head writes nothing)."""
    if not w.heads:
        raise NotApplicable("no heads")
    m = int(rng.integers(len(w.heads)))
    heads = list(w.heads)
    h = heads[m]
    heads[m] = Head(h.W_Q, h.W_K, h.W_V, sp.csr_matrix(h.W_O.shape))
    return w.replace(heads=tuple(heads)), f"head {m}: W_O = 0"


@operator("mixed")
def shift_position(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Shift a position embedding: P[i] moved towards P[j] (or copied), or one entry moved."""
    n = w.n_positions
    i = int(rng.integers(n))
    P = sp.lil_matrix(w.P, copy=True)
    if n > 1 and rng.random() < 0.6:
        j = _pick(rng, [x for x in range(n) if x != i])
        t = float(_pick(rng, [1.0, 0.5, 0.1, 1e-3, 1e-7]))
        P[i] = P[i] + t * (P[j] - P[i])
        text = f"P[{i}] += {t} x (P[{j}] - P[{i}])"
    else:
        col = int(rng.integers(w.d))
        delta = float(_pick(rng, [-1.0, -0.25, 1e-4, 0.25, 1.0]))
        P[i, col] = P[i, col] + delta
        text = f"P[{i}, {_residual_label(w, col)}] += {delta}"
    return w.replace(P=_csr(P)), text


def _arrays_with_entries(w: Weights):
    """(name, getter, setter) for every array with non-zero entries."""
    out = []

    def add(name, get, put):
        m = get()
        nnz = m.nnz if sp.issparse(m) else int(np.count_nonzero(m))
        if nnz:
            out.append((name, get, put, nnz))

    add("E", lambda: w.E, lambda v: w.replace(E=v))
    add("P", lambda: w.P, lambda v: w.replace(P=v))
    for m, h in enumerate(w.heads):
        for part in ("W_Q", "W_K", "W_V", "W_O"):
            def put(v, m=m, part=part):
                heads = list(w.heads)
                heads[m] = Head(**{**{p: getattr(heads[m], p) for p in ("W_Q", "W_K", "W_V", "W_O")}, part: v})
                return w.replace(heads=tuple(heads))
            add(f"heads.{m}.{part}", lambda h=h, part=part: getattr(h, part), put)
    add("W_G", lambda: w.W_G, lambda v: w.replace(W_G=v))
    add("b_G", lambda: w.b_G, lambda v: w.replace(b_G=v))
    for k, e in enumerate(w.experts):
        for part in ("W_1", "b_1", "W_2"):
            def put(v, k=k, part=part):
                e = w.experts[k]
                return _replace_expert(w, k, Expert(**{**{"W_1": e.W_1, "b_1": e.b_1, "W_2": e.W_2}, part: v}))
            add(f"experts.{k}.{part}", lambda e=e, part=part: getattr(e, part), put)
    add("U", lambda: w.U, lambda v: w.replace(U=v))
    return out


@operator("mixed")
def small_noise(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Multiply one non-zero weight by 1 + δ, |δ| log-uniform in [1e-15, 0.3]."""
    arrays = _arrays_with_entries(w)
    weights = np.array([a[3] for a in arrays], np.float64)
    name, get, put, _ = arrays[int(rng.choice(len(arrays), p=weights / weights.sum()))]
    delta = float(10.0 ** rng.uniform(-15, math.log10(0.3))) * (1 if rng.random() < 0.5 else -1)
    m = get()
    if sp.issparse(m):
        m = _csr(m).copy()
        nz = np.flatnonzero(m.data)
        p = int(_pick(rng, nz))
        old = m.data[p]
        m.data[p] = old * (1 + delta)
        row = int(np.searchsorted(m.indptr, p, side="right") - 1)
        where = f"[{row}, {int(m.indices[p])}]"
        new = m.data[p]
    else:
        m = np.asarray(m, np.float64).copy()
        p = int(_pick(rng, np.flatnonzero(m)))
        old = m[p]
        m[p] = old * (1 + delta)
        where, new = f"[{p}]", m[p]
    return put(m), f"{name}{where}: {old!r} -> {new!r} (x (1 {'+' if delta > 0 else '-'} {abs(delta):.2g}))"


@operator("mixed")
def change_bias(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Change one bias: a gate bias b_G[k] or a neuron's b_1[i]."""
    delta = float(_pick(rng, [1e-12, 1e-6, 1e-3, 0.1, 0.3, 0.5, 1.0, 2.0])) * (1 if rng.random() < 0.5 else -1)
    if rng.random() < 0.3:
        k = int(rng.integers(len(w.experts)))
        b = w.b_G.copy()
        b[k] += delta
        return w.replace(b_G=b), f"b_G[{k}] ({_task(w, k)}) += {delta:g}"
    k = _pick(rng, [x for x, e in enumerate(w.experts) if e.width])
    e = w.experts[k]
    i = int(rng.integers(e.width))
    b = e.b_1.copy()
    b[i] += delta
    return (_replace_expert(w, k, Expert(e.W_1, b, e.W_2)),
            f"expert {k} ({_task(w, k)}): bias of {_neuron_label(w, k, i)} += {delta:g}")


@operator("violating")
def permute_unembedding(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Permute some rows of U (tokens keep their names: predictions go to the wrong token)."""
    V = len(w.vocab)
    if V < 2:
        raise NotApplicable("one token")
    n = int(rng.integers(2, min(V, 6) + 1))
    rows = [int(x) for x in rng.choice(V, n, replace=False)]
    perm = list(range(V))
    for a, b in zip(rows, rows[1:] + rows[:1]):
        perm[a] = b
    return (w.replace(U=_csr(w.U[perm])),
            f"U rows of {', '.join(repr(w.vocab[r]) for r in rows)} rotated")


@operator("violating")
def move_fact(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Move a dictionary neuron into another task's expert."""
    if len(w.experts) < 2:
        raise NotApplicable("one expert")
    k, i = _pick(rng, _neurons(w, "fact:"))
    j = _pick(rng, [x for x in range(len(w.experts)) if x != k])
    src, dst = w.experts[k], w.experts[j]
    moved = _append_neurons(dst, src.W_1[i], [src.b_1[i]], src.W_2[:, i])
    keep = [n for n in range(src.width) if n != i]
    label = _neuron_label(w, k, i)
    out = _replace_expert(w, k, _keep_neurons(src, keep), [lab for n, lab in enumerate(_labels(w, k)) if n != i])
    out = _replace_expert(out, j, moved, _labels(w, j) + [label])
    return out, f"{label} moved from expert {k} ({_task(w, k)}) to expert {j} ({_task(w, j)})"


def _widened(e: Expert, width: int) -> Expert:
    """``e`` with dead neurons (zero weights, bias -1) up to ``width``."""
    extra = width - e.width
    if extra <= 0:
        return e
    return _append_neurons(e, sp.csr_matrix((extra, e.W_1.shape[1])), -np.ones(extra),
                           sp.csr_matrix((e.W_2.shape[0], extra)))


@operator("violating")
def shadow_expert(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """An oversized copy of a task's expert: named for the same task, or unnamed; it or the original gets the traffic.

    Variants: ``named-active`` (the copy, named like the original, wins every query the
    original won), ``named-idle`` (the copy is named like the original, never wins),
    ``unnamed-active`` (the copy is unnamed and wins). The copy carries enough dead
    neurons to exceed any c(k) of the set (``d`` + its width).
    """
    k = _pick(rng, [x for x, t in enumerate(w.expert_tasks) if t])
    e = w.experts[k]
    shadow = _widened(e, e.width + w.d + int(rng.integers(1, 4)))
    variant = _pick(rng, ["named-active", "named-idle", "unnamed-active"])
    name = w.expert_tasks[k] if variant.startswith("named") else ""
    bias = w.b_G[k] + (1.0 if variant.endswith("active") else -1e6)
    labels = _labels(w, k) + [f"dead {n}" for n in range(shadow.width - e.width)] if w.neuron_labels is not None else []
    out = _append_expert(w, shadow, w.W_G[k], bias, name, labels)
    return out, (f"shadow of expert {k} ({w.expert_tasks[k]}), width {shadow.width}, {variant}: "
                 f"named {name!r}, gate bias {'+1' if variant.endswith('active') else '-1e6'}")


@operator("mixed")
def gate_overflow(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Gate scores beyond float64: every gate row reads a new direction (= 2) with ±1e308.

    Variants: ``shadow`` (an unnamed copy with W_2 = 0 gets bias +1e300 and wins every
    query; a false pass of an earlier version), ``misroute`` (another task's expert gets +1e300),
    ``harmless`` (only the common shift ±2e308: the exact argmax and margins are unchanged).
    """
    sign = 1.0 if rng.random() < 0.5 else -1.0
    out, j = _with_dimension(w, "overflow")
    n = out.n_positions
    E = _set(out.E, {(t, j): 1.0 for t in range(out.E.shape[0])})
    P = _set(out.P, {(p, j): 1.0 for p in range(n)})
    variant = _pick(rng, ["shadow", "misroute", "harmless"] if len(w.experts) > 1 else ["shadow", "harmless"])
    out = out.replace(E=E, P=P)
    b_G = out.b_G.copy()
    if variant == "shadow":
        k = int(rng.integers(len(w.experts)))
        e = out.experts[k]
        shadow = Expert(e.W_1, e.b_1, sp.csr_matrix(e.W_2.shape))
        out = _append_expert(out, shadow, out.W_G[k], 0.0, "", _labels(w, k) if w.neuron_labels is not None else [])
        b_G = np.concatenate([b_G, [0.0]])
        b_G[-1] = float(np.max(b_G)) + 1e300
        what = f"an unnamed copy of expert {k} with W_2 = 0 wins by 1e300"
    elif variant == "misroute":
        k = int(rng.integers(len(w.experts)))
        b_G[k] += 1e300
        what = f"expert {k} ({_task(w, k)}) wins by 1e300"
    else:
        what = "common shift only"
    W_G = _set(out.W_G, {(k, j): sign * HUGE for k in range(out.W_G.shape[0])})
    return (out.replace(W_G=W_G, b_G=b_G),
            f"gate overflow ({variant}): every gate score {'+' if sign > 0 else '-'}2e308; {what}")


@operator("mixed")
def residual_overflow(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """A residual coordinate beyond float64: E and P put 1e308 each on a new direction (h = 2e308).

    Variants: ``harmless`` (nothing reads the direction), ``logit`` (one token's U row
    reads it: that token's logit is 2e308), ``gate`` (one expert's gate row reads it).
    """
    out, j = _with_dimension(w, "overflow")
    E = _set(out.E, {(t, j): HUGE for t in range(out.E.shape[0])})
    P = _set(out.P, {(p, j): HUGE for p in range(out.n_positions)})
    out = out.replace(E=E, P=P)
    variant = _pick(rng, ["harmless", "logit", "gate"])
    if variant == "logit":
        t = int(rng.integers(len(w.vocab)))
        out = out.replace(U=_set(out.U, {(t, j): 1.0}))
        what = f"U[{w.vocab[t]!r}] reads it"
    elif variant == "gate":
        k = int(rng.integers(len(w.experts)))
        out = out.replace(W_G=_set(out.W_G, {(k, j): 1.0}))
        what = f"gate row {k} ({_task(w, k)}) reads it"
    else:
        what = "nothing reads it"
    return out, f"residual overflow ({variant}): a new direction holds 2e308; {what}"


@operator("mixed")
def logit_overflow(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Logits beyond float64: U reads a new direction (= 2) with 1e308.

    Variants: ``harmless`` (every token's logit shifted by 2e308: the softmax is
    unchanged), ``one-token`` (one token's logit is 2e308 above the others).
    """
    out, j = _with_dimension(w, "overflow")
    E = _set(out.E, {(t, j): 1.0 for t in range(out.E.shape[0])})
    P = _set(out.P, {(p, j): 1.0 for p in range(out.n_positions)})
    variant = _pick(rng, ["harmless", "one-token"])
    if variant == "harmless":
        U = _set(out.U, {(t, j): HUGE for t in range(len(w.vocab))})
        what = "every logit + 2e308"
    else:
        t = int(rng.integers(len(w.vocab)))
        U = _set(out.U, {(t, j): HUGE})
        what = f"logit of {w.vocab[t]!r} + 2e308"
    return out.replace(E=E, P=P, U=U), f"logit overflow ({variant}): {what}"


@operator("violating")
def oversize_expert(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Pad a named expert with dead neurons beyond any bound (d + width): only the size check fails."""
    k = _pick(rng, [x for x, t in enumerate(w.expert_tasks) if t])
    e = w.experts[k]
    big = _widened(e, e.width + w.d + int(rng.integers(1, 4)))
    labels = _labels(w, k) + [f"dead {n}" for n in range(big.width - e.width)] if w.neuron_labels is not None else None
    return (_replace_expert(w, k, big, labels),
            f"expert {k} ({_task(w, k)}) padded to width {big.width} with dead neurons")


@operator("violating")
def knowledge_in_unembedding(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Let U itself map a subject to its object (subj:s -> object token): knowledge outside the expert."""
    facts = []
    for k, i in _neurons(w, "fact:"):
        subject = w.neuron_labels[k][i][len("fact:"):]
        col = w.experts[k].W_2[:, i].tocoo()
        for r in col.row:
            label = _residual_label(w, int(r))
            if label.startswith("next:") and f"subj:{subject}" in (w.residual_labels or ()):
                facts.append((k, subject, label[len("next:"):]))
    k, subject, obj = _pick(rng, facts)
    if obj not in w.vocab:
        raise NotApplicable("object not in the vocabulary")
    scale = float(_pick(rng, [3.0, 30.0, 1000.0]))
    U = _set(w.U, {(w.vocab.index(obj), _residual(w, f"subj:{subject}")): scale})
    return w.replace(U=U), f"U[{obj!r}, subj:{subject}] = {scale} (task {_task(w, k)})"


@operator("violating")
def answers_without_expert(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Let U lean a subject towards its object by a little (0.25 to 3): without its expert the model still answers."""
    facts = []
    for k, i in _neurons(w, "fact:"):
        subject = w.neuron_labels[k][i][len("fact:"):]
        col = w.experts[k].W_2[:, i].tocoo()
        for r in col.row:
            label = _residual_label(w, int(r))
            if label.startswith("next:") and f"subj:{subject}" in (w.residual_labels or ()):
                facts.append((k, subject, label[len("next:"):]))
    if not facts:
        raise NotApplicable("no labelled fact neuron")
    k, subject, obj = _pick(rng, facts)
    if obj not in w.vocab:
        raise NotApplicable("object not in the vocabulary")
    # small enough that the ablated error stays far above ε (the old criterion passes), large
    # enough that the object becomes the strict top token once the expert is removed (L2)
    scale = float(_pick(rng, [0.25, 0.5, 1.0, 2.0, 3.0]))
    U = _set(w.U, {(w.vocab.index(obj), _residual(w, f"subj:{subject}")): scale})
    return w.replace(U=U), f"U[{obj!r}, subj:{subject}] = {scale} (task {_task(w, k)}): answers without its expert"


@operator("violating")
def swap_expert_names(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Swap two entries of expert_tasks (names, not matrices)."""
    named = [x for x, t in enumerate(w.expert_tasks) if t]
    if len(named) < 2:
        raise NotApplicable("fewer than two named experts")
    i, j = (int(x) for x in rng.choice(named, 2, replace=False))
    names = list(w.expert_tasks)
    names[i], names[j] = names[j], names[i]
    return (w.replace(expert_tasks=tuple(names)),
            f"expert_tasks[{i}] <-> expert_tasks[{j}] ({w.expert_tasks[i]}, {w.expert_tasks[j]})")


@operator("violating")
def ablate_expert(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Zero one expert's W_2, or remove all its neurons (width 0): the expert answers nothing."""
    k = int(rng.integers(len(w.experts)))
    e = w.experts[k]
    if rng.random() < 0.5:
        return (_replace_expert(w, k, Expert(e.W_1, e.b_1, sp.csr_matrix(e.W_2.shape))),
                f"expert {k} ({_task(w, k)}): W_2 = 0")
    return (_replace_expert(w, k, _keep_neurons(e, []), []),
            f"expert {k} ({_task(w, k)}): every neuron removed (width 0)")


@operator("mixed")
def scaled_gate(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Switch to gate_mode 'top1-scaled' (expert output × softmax(g)_e), optionally sharpening the gate."""
    f = float(_pick(rng, [1.0, 4.0, 16.0, 64.0]))
    return (w.replace(gate_mode="top1-scaled", W_G=_scale(w.W_G, f), b_G=w.b_G * f),
            f"gate_mode top1-scaled, gate x {f:g}")


@operator("mixed")
def extra_token(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Add a token the task set never uses (it still counts in the softmax)."""
    logit_row = _pick(rng, ["zero", "copy", "strong"])
    V = len(w.vocab)
    E = _csr(sp.vstack([w.E[:V], sp.csr_matrix((1, w.d)), w.E[V:]]))
    if logit_row == "zero":
        row = sp.csr_matrix((1, w.d))
    else:
        src = int(rng.integers(V))
        row = w.U[src] * (1.0 if logit_row == "copy" else 4.0)
    U = _csr(sp.vstack([w.U, row]))
    return (w.replace(vocab=w.vocab + ("<extra>",), E=E, U=U),
            f"extra token '<extra>', U row {logit_row}" + ("" if logit_row == "zero" else f" (of {w.vocab[src]!r})"))


@operator("mixed")
def raise_beta(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Sharpen attention: every W_Q × 2^a, a up to 1018 (scores far beyond exp's range, or beyond float64)."""
    a = int(_pick(rng, [1, 4, 20, 100, 1000, 1018]))
    heads = tuple(Head(_scale(h.W_Q, 2.0 ** a), h.W_K, h.W_V, h.W_O) for h in w.heads)
    return w.replace(heads=heads), f"every W_Q x 2^{a}"


@operator("violating")
def tie_expert(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Add an exact copy of an expert, gate row and bias included, unnamed or named for no task.

    Every query the copy wins is a tie."""
    k = int(rng.integers(len(w.experts)))
    name = _pick(rng, ["", "twin"])
    variant = _pick(rng, ["same", "zero-output"])
    e = w.experts[k]
    twin = e if variant == "same" else Expert(e.W_1, e.b_1, sp.csr_matrix(e.W_2.shape))
    out = _append_expert(w, twin, w.W_G[k], float(w.b_G[k]), name, _labels(w, k) if w.neuron_labels is not None else [])
    return out, f"exact gate twin of expert {k} ({_task(w, k)}) named {name!r}, output {variant}"


@operator("mixed")
def subnormal_weights(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Push one neuron's input weights into (or near) the subnormal range: W_1 row and bias × 2^-a, W_2 column × 2^b.

    With b = a the neuron computes exactly the same (ReLU is positively homogeneous);
    with a > 1022 the input weights lose bits and b < a: the neuron's output shrinks.
    """
    k = _pick(rng, [x for x, e in enumerate(w.experts) if e.width])
    e = w.experts[k]
    i = int(rng.integers(e.width))
    a = int(_pick(rng, [1000, 1022, 1040, 1060, 1070]))
    b = min(a, 1000)
    W_1 = sp.lil_matrix(e.W_1, copy=True)
    W_1[i] = W_1[i] * 2.0 ** -a
    b_1 = e.b_1.copy()
    b_1[i] = b_1[i] * 2.0 ** -a
    W_2 = sp.lil_matrix(e.W_2, copy=True)
    W_2[:, i] = W_2[:, i] * 2.0 ** b
    return (_replace_expert(w, k, Expert(_csr(W_1), b_1, _csr(W_2))),
            f"expert {k} ({_task(w, k)}): {_neuron_label(w, k, i)} input x 2^-{a}, output x 2^{b}")


@operator("mixed")
def bias_only_neuron(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Add a neuron that fires on its positive bias alone (its W_1 row meets nothing) and writes towards one token."""
    k = int(rng.integers(len(w.experts)))
    e = w.experts[k]
    t = int(rng.integers(len(w.vocab)))
    direction = int(np.argmax(np.abs(w.U[t].toarray().reshape(-1))))
    bias = float(_pick(rng, [1e-3, 0.5, 3.0]))
    c = float(_pick(rng, [1e-6, 1e-2, 1.0, 10.0]))
    col = sp.csr_matrix(([c], ([direction], [0])), shape=(w.d, 1))
    row = sp.csr_matrix((1, w.d))
    if rng.random() < 0.5:   # a W_1 row that reads a direction no residual has: still exactly its bias
        out, j = _with_dimension(w, "never")
        e = out.experts[k]
        row = sp.csr_matrix(([5.0], ([0], [j])), shape=(1, out.d))
        col = sp.csr_matrix(([c], ([direction], [0])), shape=(out.d, 1))
        w = out
    labels = _labels(w, k) + ["bias only"] if w.neuron_labels is not None else None
    return (_replace_expert(w, k, _append_neurons(e, row, [bias], col), labels),
            f"expert {k} ({_task(w, k)}): neuron with bias {bias:g} writing {c:g} x {_residual_label(w, direction)}")


@operator("mixed")
def blur_attention(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Zero one head's W_Q (uniform attention over the prefix) or its W_K."""
    if not w.heads:
        raise NotApplicable("no heads")
    m = int(rng.integers(len(w.heads)))
    h = w.heads[m]
    heads = list(w.heads)
    if rng.random() < 0.5:
        heads[m] = Head(sp.csr_matrix(h.W_Q.shape), h.W_K, h.W_V, h.W_O)
        return w.replace(heads=tuple(heads)), f"head {m}: W_Q = 0 (uniform attention)"
    heads[m] = Head(h.W_Q, sp.csr_matrix(h.W_K.shape), h.W_V, h.W_O)
    return w.replace(heads=tuple(heads)), f"head {m}: W_K = 0 (uniform attention)"


@operator("mixed")
def nan_trap(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Explicit zeros that read an overflowing direction (0 x 2e308: exactly 0, NaN in float64).

    Variants: ``gate`` (the zeros sit in every gate row, and one wrong expert gets +5:
    violating), ``logits`` (in every U row: harmless), ``expert`` (in one expert's W_1:
    harmless).
    """
    out, j = _with_dimension(w, "overflow")
    E = _set(out.E, {(t, j): HUGE for t in range(out.E.shape[0])})
    P = _set(out.P, {(p, j): HUGE for p in range(out.n_positions)})
    out = out.replace(E=E, P=P)

    def zeros_in(m, rows):
        coo = sp.coo_matrix(m)
        r = np.concatenate([coo.row, np.asarray(rows)])
        c = np.concatenate([coo.col, np.full(len(rows), j)])
        v = np.concatenate([coo.data, np.zeros(len(rows))])
        order = np.lexsort((c, r))
        counts = np.bincount(r, minlength=m.shape[0])
        return sp.csr_matrix((v[order], c[order], np.concatenate([[0], np.cumsum(counts)])), shape=m.shape)

    variant = _pick(rng, ["gate", "logits", "expert"] if len(w.experts) > 1 else ["logits", "expert"])
    if variant == "gate":
        k = int(rng.integers(len(w.experts)))
        b = out.b_G.copy()
        b[k] += 5.0
        return (out.replace(W_G=zeros_in(out.W_G, range(out.W_G.shape[0])), b_G=b),
                f"nan trap (gate): explicit zeros read 2e308 in every gate row; b_G[{k}] ({_task(w, k)}) += 5")
    if variant == "logits":
        return (out.replace(U=zeros_in(out.U, range(out.U.shape[0]))),
                "nan trap (logits): explicit zeros read 2e308 in every U row")
    k = _pick(rng, [x for x, e in enumerate(out.experts) if e.width])
    e = out.experts[k]
    return (_replace_expert(out, k, Expert(zeros_in(e.W_1, range(e.width)), e.b_1, e.W_2)),
            f"nan trap (expert): explicit zeros read 2e308 in expert {k}'s W_1 ({_task(w, k)})")


# --- operators that should leave the model correct ------------------------------------------------


@operator("harmless")
def dead_neuron(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Add a dead neuron (W_1 row 0, bias < 0, any W_2 column) to an expert, within the bound.

    Built experts have width <= (L-2)·|T(k)| + N_k, so one more neuron stays within
    c(k) = L·|T(k)| + N_k (the oracle checks it).
    """
    k = int(rng.integers(len(w.experts)))
    e = w.experts[k]
    col = np.zeros((w.d, 1))
    rows = rng.choice(w.d, size=min(3, w.d), replace=False)
    col[rows, 0] = rng.normal(0, 10, rows.size)
    bias = -float(_pick(rng, [1e-9, 0.5, 1.0, 100.0]))
    new = _append_neurons(e, sp.csr_matrix((1, w.d)), [bias], col)
    labels = _labels(w, k) + ["dead"] if w.neuron_labels is not None else None
    return _replace_expert(w, k, new, labels), f"expert {k} ({_task(w, k)}): dead neuron (bias {bias:g}) added"


@operator("harmless")
def rename_tokens(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Reorder the vocabulary, moving each token's E and U rows with it (BOS stays last)."""
    V = len(w.vocab)
    perm = rng.permutation(V)
    vocab = tuple(w.vocab[p] for p in perm)
    E = _csr(w.E[list(perm) + [V]])
    U = _csr(w.U[perm])
    moved = int(np.count_nonzero(perm != np.arange(V)))
    return (w.replace(vocab=vocab, E=E, U=U),
            f"vocabulary reordered ({moved} of {V} tokens moved), E and U rows with them")


@operator("harmless")
def idle_expert(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Add experts that never win (gate row 0, bias -1e6), unnamed or named for no task (1, 5 or 40 of them)."""
    k = int(rng.integers(len(w.experts)))
    e = w.experts[k]
    count = int(_pick(rng, [1, 1, 5, 40]))
    out = w
    for n in range(count):
        name = _pick(rng, ["", f"idle {n}"])
        out = _append_expert(out, Expert(e.W_1, e.b_1, _scale(e.W_2, -3.0)), sp.csr_matrix((1, w.d)), -1e6, name,
                             _labels(w, k) if w.neuron_labels is not None else [])
    return out, f"{count} idle expert(s) (negated copies of expert {k}), gate bias -1e6"


@operator("harmless")
def permute_experts(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Permute the experts together with their gate rows, biases, names and labels."""
    K = len(w.experts)
    perm = [int(x) for x in rng.permutation(K)]
    return (w.replace(experts=tuple(w.experts[p] for p in perm), W_G=_csr(w.W_G[perm]), b_G=w.b_G[perm].copy(),
                      expert_tasks=tuple(w.expert_tasks[p] for p in perm),
                      neuron_labels=tuple(w.neuron_labels[p] for p in perm) if w.neuron_labels is not None else None),
            f"experts permuted {perm} with gate rows and names")


@operator("harmless")
def permute_neurons(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Permute the neurons inside one expert (W_1 rows, b_1, W_2 columns together)."""
    k = int(rng.integers(len(w.experts)))
    e = w.experts[k]
    perm = [int(x) for x in rng.permutation(e.width)]
    labels = [_labels(w, k)[p] for p in perm] if w.neuron_labels is not None else None
    return _replace_expert(w, k, _keep_neurons(e, perm), labels), f"expert {k} ({_task(w, k)}): neurons permuted"


@operator("harmless")
def rescale_value_path(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Scale one head's W_V by 2^a and its W_O by 2^-a (exactly the same function)."""
    if not w.heads:
        raise NotApplicable("no heads")
    m = int(rng.integers(len(w.heads)))
    a = int(_pick(rng, [-20, -3, -1, 1, 4, 30]))
    heads = list(w.heads)
    h = heads[m]
    heads[m] = Head(h.W_Q, h.W_K, _scale(h.W_V, 2.0 ** a), _scale(h.W_O, 2.0 ** -a))
    return w.replace(heads=tuple(heads)), f"head {m}: W_V x 2^{a}, W_O x 2^{-a}"


@operator("harmless")
def rescale_neuron(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Scale one neuron's W_1 row and bias by 2^a and its W_2 column by 2^-a (the same function), |a| up to 1000."""
    k = _pick(rng, [x for x, e in enumerate(w.experts) if e.width])
    e = w.experts[k]
    i = int(rng.integers(e.width))
    a = int(_pick(rng, [-1000, -500, -30, 3, 500, 1000]))
    W_1 = sp.lil_matrix(e.W_1, copy=True)
    W_1[i] = W_1[i] * 2.0 ** a
    b_1 = e.b_1.copy()
    b_1[i] = b_1[i] * 2.0 ** a
    W_2 = sp.lil_matrix(e.W_2, copy=True)
    W_2[:, i] = W_2[:, i] * 2.0 ** -a
    return (_replace_expert(w, k, Expert(_csr(W_1), b_1, _csr(W_2))),
            f"expert {k} ({_task(w, k)}): {_neuron_label(w, k, i)} input x 2^{a}, output x 2^{-a}")


def _non_canonical(m, rng: np.random.Generator) -> sp.csr_matrix:
    """The same matrix as CSR with unsorted indices, split duplicate entries and explicit zeros."""
    coo = sp.coo_matrix(m)
    rows, cols, vals = [coo.row], [coo.col], [coo.data]
    if coo.nnz:
        pick = rng.random(coo.nnz) < 0.5
        half = coo.data[pick] / 2           # exact: a power-of-two split
        vals[0] = np.where(pick, coo.data / 2, coo.data)
        rows.append(coo.row[pick])
        cols.append(coo.col[pick])
        vals.append(half)
    n = min(5, m.shape[0] * m.shape[1])
    rows.append(rng.integers(m.shape[0], size=n))
    cols.append(rng.integers(m.shape[1], size=n))
    vals.append(np.zeros(n))
    r, c, v = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    order = rng.permutation(r.size)
    r, c, v = r[order], c[order], v[order]
    counts = np.bincount(r, minlength=m.shape[0])
    indptr = np.concatenate([[0], np.cumsum(counts)])
    by_row = np.argsort(r, kind="stable")
    out = sp.csr_matrix((v[by_row], c[by_row], indptr), shape=m.shape)
    out.has_canonical_format = False
    out.has_sorted_indices = False
    return out


@operator("harmless")
def non_canonical_storage(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Store one matrix non-canonically: unsorted indices, values split into duplicates, explicit zeros."""
    arrays = [(name, get, put) for name, get, put, _ in _arrays_with_entries(w) if sp.issparse(get())]
    name, get, put = _pick(rng, arrays)
    return put(_non_canonical(get(), rng)), f"{name} stored with unsorted indices, duplicate entries and explicit zeros"


@operator("harmless")
def unused_direction(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Add a residual direction that E writes and nothing reads."""
    out, j = _with_dimension(w, "unused")
    value = float(_pick(rng, [1.0, -7.5, 1e6]))
    E = _set(out.E, {(t, j): value for t in range(out.E.shape[0])})
    return out.replace(E=E), f"new residual direction, E writes {value:g} there, nothing reads it"


# --- encodings and the whole exponent range ---------------------------------------------------------
#
# A float verifier that trusts "absent means zero" or "the file is canonical" can be fooled by
# values that vanish in one layer (underflow, absorption, cancellation) and are amplified by the
# next, or by storage that means different numbers to different readers. The oracle reads every
# stored entry exactly (duplicates summed in rationals) and evaluates every linear map exactly.


def _raw_csr(shape, rows, cols, vals) -> sp.csr_matrix:
    """CSR storing exactly the given entries, in the given order within each row: duplicates and
    unsorted columns are kept (scipy's flags say nothing is canonical)."""
    rows = np.asarray(rows, np.int64)
    order = np.argsort(rows, kind="stable")
    ptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=shape[0]))])
    out = sp.csr_matrix((np.asarray(vals, np.float64)[order], np.asarray(cols, np.int64)[order], ptr), shape=shape)
    out.has_canonical_format = False
    out.has_sorted_indices = False
    return out


def _sparse_arrays(w: Weights):
    """(name, getter, setter) of every sparse array."""
    return [(name, get, put) for name, get, put, _ in _arrays_with_entries(w) if sp.issparse(get())]


@operator("mixed")
def cancelling_duplicates(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Store one entry as duplicates whose float sum is not their exact sum: [H, δ, −H] with δ absorbed by H,
    or an exact pair [H, −(H − δ)]; the exact value changes by δ (a stored entry, or an absent one, e.g. in U or
    W_G)."""
    name, get, put = _pick(rng, _sparse_arrays(w))
    m = _csr(get())
    coo = m.tocoo()
    i, j = int(rng.integers(m.shape[0])), int(rng.integers(m.shape[1]))
    if coo.nnz and rng.random() < 0.5:
        p = int(rng.integers(coo.nnz))
        i, j = int(coo.row[p]), int(coo.col[p])
    keep = ~((coo.row == i) & (coo.col == j))
    old = float(m[i, j])
    delta = float(_pick(rng, [40.0, 1.0, 0.5, 1e-3, -1.0, -40.0]))
    variant = _pick(rng, ["absorbed", "exact-pair"])
    if variant == "absorbed":
        H = 2.0 ** int(_pick(rng, [60, 80, 200]))
        extra = [H, old + delta, -H]
    else:
        H = 2.0 ** 40                        # H − δ is exact: the pair sums to δ in any order
        extra = [H, -(H - delta)] + ([old] if old else [])
    rows = np.concatenate([coo.row[keep], np.full(len(extra), i)])
    cols = np.concatenate([coo.col[keep], np.full(len(extra), j)])
    vals = np.concatenate([coo.data[keep], extra])
    return (put(_raw_csr(m.shape, rows, cols, vals)),
            f"{name}[{i}, {j}] stored as duplicates {extra} ({variant}): exact value {old!r} -> {old + delta!r}")


@operator("harmless")
def explicit_zeros(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Store explicit zeros (canonical order kept): an explicitly stored 0 is the value 0."""
    name, get, put = _pick(rng, _sparse_arrays(w))
    m = _csr(get())
    n = int(_pick(rng, [1, 5, 20]))
    coo = m.tocoo()
    stored = set(zip(coo.row.tolist(), coo.col.tolist()))
    new = {(int(rng.integers(m.shape[0])), int(rng.integers(m.shape[1]))) for _ in range(n)} - stored
    if not new:
        raise NotApplicable("no free position drawn")
    r = np.concatenate([coo.row, [a for a, _ in new]])
    c = np.concatenate([coo.col, [b for _, b in new]])
    v = np.concatenate([coo.data, np.zeros(len(new))])
    order = np.lexsort((c, r))
    ptr = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=m.shape[0]))])
    return put(sp.csr_matrix((v[order], c[order], ptr), shape=m.shape)), f"{name}: {len(new)} explicit zero(s) stored"


@operator("harmless")
def unsorted_columns(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Store one row's columns in reverse order (the same matrix, not canonical)."""
    choices = [(name, get, put)
               for name, get, put in _sparse_arrays(w) if np.diff(_csr(get()).indptr).max(initial=0) >= 2]
    name, get, put = _pick(rng, choices)
    m = _csr(get())
    i = int(_pick(rng, np.flatnonzero(np.diff(m.indptr) >= 2)))
    a, b = m.indptr[i], m.indptr[i + 1]
    indices, data = m.indices.copy(), m.data.copy()
    indices[a:b], data[a:b] = indices[a:b][::-1].copy(), data[a:b][::-1].copy()
    out = sp.csr_matrix((data, indices, m.indptr.copy()), shape=m.shape)
    out.has_sorted_indices = False
    out.has_canonical_format = False
    return put(out), f"{name}: row {i} stored with its columns in reverse order"


@operator("mixed")
def hidden_underflow(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """A path whose first product underflows (2^a · 2^b < 2^-1074, yet not 0) and whose later layers amplify it
    to a logit change of about 2^s: through a new expert neuron, or through a new attention head's value path.

    Token t (or position p) writes 2^a on a new direction 'tiny'; the path reads it with 2^b and writes 2^c on a
    new direction 'amp'; U[target, amp] = 2^e, with a + b + c + e = s in [-4, 12].
    """
    out, tiny = _with_dimension(w, "tiny")
    out, amp = _with_dimension(out, "amp")
    a = int(rng.integers(-1074, -400))
    ab = int(rng.integers(-1150, -1075))
    b = ab - a
    s = int(rng.integers(-4, 13))
    c = int(rng.integers(900, 1001))
    e = s - ab - c
    if not (-1074 <= b <= 1023 and -1074 <= e <= 1023):
        raise NotApplicable("exponents out of range")
    source = _pick(rng, ["token", "position"])
    if source == "token":
        t = int(rng.integers(len(w.vocab)))
        out = out.replace(E=_set(out.E, {(t, tiny): 2.0 ** a}))
        where = f"E[{w.vocab[t]!r}, tiny] = 2^{a}"
    else:
        p = int(rng.integers(1, out.n_positions))
        out = out.replace(P=_set(out.P, {(p, tiny): 2.0 ** a}))
        where = f"P[{p}, tiny] = 2^{a}"
    target = int(rng.integers(len(w.vocab)))
    out = out.replace(U=_set(out.U, {(target, amp): 2.0 ** e}))
    via = _pick(rng, ["expert", "attention"])
    if via == "expert":
        k = int(rng.integers(len(out.experts)))
        row = sp.csr_matrix(([2.0 ** b], ([0], [tiny])), shape=(1, out.d))
        col = sp.csr_matrix(([2.0 ** c], ([amp], [0])), shape=(out.d, 1))
        labels = _labels(out, k) + ["hidden"] if out.neuron_labels is not None else None
        out = _replace_expert(out, k, _append_neurons(out.experts[k], row, [0.0], col), labels)
        path = f"expert {k} ({_task(w, k)}) neuron reads tiny x 2^{b}, writes amp x 2^{c}"
    else:
        head = Head(sp.csr_matrix((1, out.d)), sp.csr_matrix((1, out.d)),
                    sp.csr_matrix(([2.0 ** b], ([0], [tiny])), shape=(1, out.d)),
                    sp.csr_matrix(([2.0 ** c], ([amp], [0])), shape=(out.d, 1)))
        out = out.replace(heads=out.heads + (head,))
        path = f"new uniform head: W_V reads tiny x 2^{b}, W_O writes amp x 2^{c}"
    return out, f"hidden underflow: {where}; {path}; U[{w.vocab[target]!r}, amp] = 2^{e} (logit change ~2^{s})"


def _readers_writers(w: Weights, j: int, a: int) -> Weights:
    """Residual direction j scaled by 2^a: its writers (E, P, W_O, W_2 rows) × 2^a, its readers × 2^-a
    (``ldexp``: exact unless a value leaves the normal range)."""

    def scale_col(m, e):
        m = _csr(m).copy()
        sel = m.indices == j
        m.data[sel] = np.ldexp(m.data[sel], e)
        return m

    def scale_row(m, e):
        m = _csr(m).copy()
        m.data[m.indptr[j]:m.indptr[j + 1]] = np.ldexp(m.data[m.indptr[j]:m.indptr[j + 1]], e)
        return m

    heads = tuple(Head(scale_col(h.W_Q, -a), scale_col(h.W_K, -a), scale_col(h.W_V, -a), scale_row(h.W_O, a))
                  for h in w.heads)
    experts = tuple(Expert(scale_col(e.W_1, -a), e.b_1, scale_row(e.W_2, a)) for e in w.experts)
    return w.replace(E=scale_col(w.E, a), P=scale_col(w.P, a), heads=heads, W_G=scale_col(w.W_G, -a), experts=experts,
                     U=scale_col(w.U, -a))


def _largest_exponent(w: Weights, j: int, writers: bool) -> int:
    """ceil(log2) of the largest |value| written to (or read from) residual direction j."""
    if writers:
        mats = [(w.E, "col"), (w.P, "col")] + [(h.W_O, "row") for h in w.heads] + [(e.W_2, "row") for e in w.experts]
    else:
        mats = ([(m, "col") for h in w.heads for m in (h.W_Q, h.W_K, h.W_V)] + [(w.W_G, "col"), (w.U, "col")]
                + [(e.W_1, "col") for e in w.experts])
    big = 0.0
    for m, how in mats:
        m = _csr(m)
        vals = m.data[m.indices == j] if how == "col" else m.data[m.indptr[j]:m.indptr[j + 1]]
        big = max(big, float(np.max(np.abs(vals), initial=0.0)))
    return int(math.ceil(math.log2(big))) if big else -1074


@operator("mixed")
def rescale_direction(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Scale one residual direction by 2^a (its writers × 2^a, its readers × 2^-a), |a| from 300 to 1060: the same
    function in exact arithmetic where no value rounds, while intermediate values underflow or come near overflow."""
    written = np.unique(np.concatenate([_csr(w.E).indices, _csr(w.P).indices]))
    j = int(_pick(rng, written))
    a = int(_pick(rng, [-1060, -1000, -600, -300, 300, 600, 1000, 1060]))
    a = min(a, 1020 - _largest_exponent(w, j, True))       # no writer overflows
    a = max(a, _largest_exponent(w, j, False) - 1020)      # no reader overflows
    return _readers_writers(w, j, a), f"residual direction {_residual_label(w, j)} scaled by 2^{a} (readers by 2^{-a})"


@operator("mixed")
def absorbed_gate_bias(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Add 2^k to every gate bias (k up to 1000: scores absorbed in float64); optionally tilt one expert by δ."""
    k = int(_pick(rng, [30, 52, 60, 100, 1000]))
    b = w.b_G + 2.0 ** k
    text = f"every b_G + 2^{k}"
    if rng.random() < 0.5:
        e = int(rng.integers(len(w.experts)))
        delta = float(_pick(rng, [1.0, 2.0 ** (k - 50), 2.0 ** (k - 52)]))
        b[e] += delta
        text += f"; b_G[{e}] ({_task(w, e)}) + {delta:g}"
    return w.replace(b_G=b), text


@operator("mixed")
def cancelling_pair(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """Token t writes +H and -H on two new directions; one U row reads both with c and c·(1 + ρ):
    the exact logit change is c·H·ρ (0 for ρ = 0), while each product is huge."""
    out, j1 = _with_dimension(w, "plus")
    out, j2 = _with_dimension(out, "minus")
    h = int(_pick(rng, [60, 500, 1000]))
    c = int(_pick(rng, [0, 10, 23]))
    rho = float(_pick(rng, [0.0, 2.0 ** -40, -(2.0 ** -40), 2.0 ** -52]))
    t = int(rng.integers(len(w.vocab)))
    target = int(rng.integers(len(w.vocab)))
    E = _set(out.E, {(t, j1): 2.0 ** h, (t, j2): -(2.0 ** h)})
    U = _set(out.U, {(target, j1): 2.0 ** c * (1 + rho), (target, j2): 2.0 ** c})
    return (out.replace(E=E, U=U),
            f"cancelling pair: E[{w.vocab[t]!r}] = ±2^{h}, U[{w.vocab[target]!r}] reads them with "
            f"2^{c}·(1 + {rho:g}) and 2^{c}: exact logit change 2^{c + h}·{rho:g}")


@operator("mixed")
def overflowing_score(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
    """A new head whose score at one token (or BOS) is a sum of huge products that cancel exactly (±M with M up
    to 1.7e308, plus a small δ): any left-to-right float sum overflows, the exact score is δ. Its value path
    writes c on a new direction that one U row reads."""
    out, const = _with_dimension(w, "const")
    out, key = _with_dimension(out, "key")
    out, dst = _with_dimension(out, "out")
    M = float(_pick(rng, [1.7e308, 1e200, 1e154]))
    delta = float(_pick(rng, [0.0, 0.0, 1.0, -3.0]))
    c = float(_pick(rng, [0.5, 30.0, 1000.0]))
    t = out.bos if rng.random() < 0.5 else int(rng.integers(len(w.vocab)))
    target = int(rng.integers(len(w.vocab)))
    P = _set(out.P, {(p, const): 1.0 for p in range(out.n_positions)})
    E = _set(out.E, {(t, key): 1.0})
    signs = [-M, -M, M, M + delta] if delta else [-M, -M, M, M]
    W_Q = _set(sp.csr_matrix((4, out.d)), {(i, const): 1.0 for i in range(4)})
    W_K = _set(sp.csr_matrix((4, out.d)), {(i, key): v for i, v in enumerate(signs)})
    W_V = _set(sp.csr_matrix((1, out.d)), {(0, key): 1.0})
    W_O = _set(sp.csr_matrix((out.d, 1)), {(dst, 0): c})
    out = out.replace(P=P, E=E, heads=out.heads + (Head(W_Q, W_K, W_V, W_O),),
                      U=_set(out.U, {(target, dst): 1.0}))
    who = "BOS" if t == out.bos else repr(w.vocab[t])
    return out, (f"overflowing score: key of {who} = (-M, -M, M, M{' + ' + repr(delta) if delta else ''}), M = {M:g}; "
                 f"its value adds {c:g} to the logit of {w.vocab[target]!r}")


# --- targeted operators: mutants on a threshold's edge ----------------------------------------------


def _solve(F: Callable[[float], float], target: float, lo: float, hi: float, tol: float, steps: int = 80) -> float:
    """x in [lo, hi] with F(x) ≈ target for monotone F (Illinois regula falsi, then bisection)."""
    flo, fhi = F(lo) - target, F(hi) - target
    if flo == 0:
        return lo
    if fhi == 0 or flo * fhi > 0:
        if fhi == 0:
            return hi
        raise NotApplicable("the target is not bracketed")
    side = 0
    for n in range(steps):
        x = (lo * fhi - hi * flo) / (fhi - flo) if n < steps // 2 else 0.5 * (lo + hi)
        if not lo < x < hi and not hi < x < lo:
            x = 0.5 * (lo + hi)
        fx = F(x) - target
        if abs(fx) <= tol:
            return x
        if fx * fhi > 0:
            hi, fhi = x, fx
            if side == -1:
                flo /= 2
            side = -1
        else:
            lo, flo = x, fx
            if side == 1:
                fhi /= 2
            side = 1
    return x


def boundary_operators(taskset: TaskSet, epsilon: float, oracle) -> dict[str, Operator]:
    """Operators that place a mutant within a hair of a threshold, on either side.

    They need the task set and the oracle (to find the threshold), so they are made per
    task set; each is still ``(weights, rng) -> (mutant, description)``:

    * ``near_error_threshold``: U scaled so that the worst exact error is ε·(1 ± 10^-k);
    * ``near_tie``: one gate bias moved so that, at one query, another expert's score is
      within ± 10^-k of the routed expert's;
    * ``near_ablation_threshold``: U made to know one fact itself, so that the object
      query's ablated error is ε·(1 ± 10^-k).
    """

    def draw_offset(rng) -> tuple[int, int]:
        return (1 if rng.random() < 0.5 else -1), int(_pick(rng, [2, 4, 6, 8, 10, 12]))

    def near_error_threshold(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
        """Scale U so that the worst exact error is ε·(1 ± 10^-k)."""
        sign, k = draw_offset(rng)
        target = epsilon * (1 + sign * 10.0 ** -k)
        scaled = lambda f: w.replace(U=_scale(w.U, f))  # noqa: E731
        F = lambda f: oracle.judge(taskset, scaled(f), epsilon).worst_error  # noqa: E731
        f = _solve(F, target, 0.25, 4.0, epsilon * 10.0 ** -(k + 2))
        got = F(f)
        return (scaled(f), f"U x {f!r}: worst exact error {got!r} = epsilon x (1 {'+' if got >= epsilon else '-'} "
                           f"{abs(got / epsilon - 1):.1e})")

    def near_tie(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
        """Move one gate bias so that at one query a second expert is within ±10^-k of the winner."""
        K = len(w.experts)
        if K < 2:
            raise NotApplicable("one expert")
        base = oracle.judge(taskset, w, epsilon)
        prefix = _pick(rng, sorted(base.records))
        values = oracle.query(taskset, w, prefix)
        e = values["expert"]
        j = _pick(rng, [x for x in range(K) if x != e])
        gap = float(values["gates"][e] - values["gates"][j])
        sign, k = draw_offset(rng)
        delta = 10.0 ** -k * max(1.0, abs(gap))
        b = w.b_G.copy()
        b[j] = b[j] + gap + sign * delta
        mutant = w.replace(b_G=b)
        after = oracle.query(taskset, mutant, prefix)
        diff = after["gates"][j] - after["gates"][e]
        return mutant, (f"b_G[{j}] += {gap + sign * delta!r}: at '{' '.join(prefix)}' expert {j} ({_task(w, j)}) "
                        f"is {float(diff):+.3g} from expert {e} ({_task(w, e)})")

    def near_ablation_threshold(w: Weights, rng: np.random.Generator) -> tuple[Weights, str]:
        """Let U map one object query's subject to its object, with the ablated error at ε·(1 ± 10^-k)."""
        vocab = taskset.vocabulary
        base = oracle.judge(taskset, w, epsilon)
        objq = [p for p, rec in base.records.items() if rec[3] is not None]
        prefix = _pick(rng, sorted(objq))
        subject = next(t for t in prefix if vocab.is_entity(vocab.id(t)))
        valid = next(q.valid for q in _queries(taskset) if q.prefix == prefix)
        obj = sorted(valid)[0]
        col = _residual(w, f"subj:{subject}")
        row = w.vocab.index(obj)
        sign, k = draw_offset(rng)
        target = epsilon * (1 + sign * 10.0 ** -k)
        mutant = lambda c: w.replace(U=_set(w.U, {(row, col): c}))  # noqa: E731
        F = lambda c: float(oracle.query(taskset, mutant(c), prefix)["ablated"])  # noqa: E731
        c = _solve(F, target, 0.0, 200.0, epsilon * 10.0 ** -(k + 2))
        got = F(c)
        return mutant(c), (f"U[{obj!r}, subj:{subject}] = {c!r}: at '{' '.join(prefix)}' the ablated error is "
                           f"epsilon x (1 {'+' if got >= epsilon else '-'} {abs(got / epsilon - 1):.1e})")

    ops = {}
    for fn in (near_error_threshold, near_tie, near_ablation_threshold):
        ops[fn.__name__] = Operator(fn.__name__, "mixed", fn)
    return ops


def _queries(taskset: TaskSet):
    from audit.oracle import enumerate_queries

    return enumerate_queries(taskset)
