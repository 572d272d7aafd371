"""``python -m verifier inspect``: the construction shown without verifying it.

:func:`inspect` builds the model, or, for a task set the construction refuses, says why
(what is proven) with the smallest edits of the tasks file that make it constructible,
each checked (:mod:`construction.remedies`). An :class:`Inspection` then gives the
summary (:func:`inspect_data`: widths against the bound, parameters, the closed form) or the
symbolic weights of the blocks asked for (:func:`listings`, rendered by
:func:`render_listings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from construction.listing import named_blocks, parse_values, patterns, select
from construction.model import SymbolicModel, build
from construction.printing import render as render_listings  # noqa: F401  (the listings as inspect prints them)
from construction.remedies import diagnose, smallest_changes, summarize
from tasks.errors import TaskError
from tasks.model import TaskSet


@dataclass(frozen=True)
class Inspection:
    """The model of a task set, or the construction's refusal (``refusal``, with the
    smallest checked ``changes`` and, per change, its ``steps`` in words)."""
    taskset: TaskSet
    model: SymbolicModel | None = None
    refusal: object | None = None
    changes: list = field(default_factory=list)
    steps: list[list[str]] = field(default_factory=list)

    def refusal_json(self) -> dict:
        """The refusal as inspect's JSON gives it."""
        return {"constructible": False, "refusal": self.refusal.as_dict(),
                "changes": [c.as_dict() for c in self.changes]}


def inspect(taskset: TaskSet, epsilon: float | None = None, beta: float | None = None,
            gamma: float | None = None) -> Inspection:
    """The model of ``taskset``, or why there is none and the smallest changes that make one
    (load the set with ``routable=False``: a set nobody could route is explained, not just refused)."""
    refusal = diagnose(taskset)
    if refusal is not None:
        changes = smallest_changes(taskset, refusal)
        return Inspection(taskset, refusal=refusal, changes=changes, steps=summarize(changes) if changes else [])
    return Inspection(taskset, build(taskset, epsilon=epsilon, beta=beta, gamma=gamma))


def inspect_data(model: SymbolicModel) -> dict:
    """Widths against the bound, parameter counts, the parameters, the closed form and its
    conditions (inspect's JSON)."""
    ts = model.taskset
    counts = model.instantiate().parameter_counts()
    counts["facts_per_parameter"] = ts.n_facts / counts["total"] if counts["total"] else None
    return {
        "parameter_counts": counts,
        "epsilon": model.epsilon,
        "parameters": {"beta": str(model.beta), "gamma": str(model.gamma)},
        "gate": model.gate.method,
        "gate_ideal_margin": float(model.gate.ideal_margin),
        "closed_form": str(model.error_bound()),
        "bound": model.bound_value(),
        "bound_proven": not model.unproven_conditions(),
        "unproven_conditions": model.unproven_conditions(),
        "conditions": model.conditions(),
        "L": ts.L,
        "vocabulary": ts.vocabulary.size,
        "residual_width": model.residual.dim,
        "experts": [{"task": t.name, "templates": t.n_templates, "facts": t.n_facts, "width": w, "bound": c,
                     "template_neurons": w - t.n_facts, "dictionary_neurons": t.n_facts, "parameters": n,
                     **({"compose": list(t.compose)} if t.compose is not None else {})}
                    for t, w, c, n in zip(ts.tasks, model.widths, model.bounds, counts["per_expert"])],
    }


def listings(model: SymbolicModel, block: str, task: str | None = None, at: str | None = None,
             tasks_path: str = "the tasks file") -> list:
    """The listings of the blocks named ``block``, only ``task``'s expert and gate row when a
    task is given, at the values ``at`` ("beta=B,gamma=G"; default: symbols). A TaskError
    for an unknown name."""
    names = model.taskset.names
    if task is not None and task not in names:
        raise TaskError(f"--task '{task}' is not a task of {tasks_path}", fix=f"give one of: {', '.join(names)}")
    row = names.index(task) if task is not None else None
    values = parse_values(at, model.values)
    chosen = select(named_blocks(model), block, row)
    return [patterns(b, rows_only=[row] if row is not None and b.task_rows else None, values=values) for b in chosen]
