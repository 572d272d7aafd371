"""What the construction can say about a model it built, beside the verifier's pass.

The verifier certifies any weights from the forward pass alone. For weights built here
the construction adds evidence of its own, attached to the verifier's report by the
command line (the composition root):

* **closed form**: the worst-case error ε(β, γ) as a sympy expression, a proven upper
  bound on its value at the chosen parameters (:mod:`construction.bound`), whether the
  theorem's side conditions hold there (only then does ε(β, γ) bound every query's error;
  a note says which fail), and how the gate was found (closed form or linear programme);
* **isolation** (modularity): expert k built from task k alone has exactly the labelled
  weights of expert k in the full model, and building the model without another task j
  leaves every other expert's labelled weights identical. All tasks are removed in turn
  when there are at most 12 (4 beyond 200k facts, where each rebuild is a full
  construction), else 12 spread evenly.

A failed isolation check makes the report's entanglement check fail for that task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

from construction.experts import alone_column_map, column_map, expert_entries, same_as_built, subset_column_map
from construction.residual import residual_space
from tasks.model import TaskSet

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")
#: ``map_fn(fn, shared, items)`` yields ``(item, fn(shared, item))`` in order (the caller
#: may run it in parallel, sending ``shared`` to each worker once).
MapFn = Callable[[Callable[[S, T], R], S, Iterable[T]], Iterator[tuple[T, R]]]


def serial_map(fn: Callable[[S, T], R], shared: S, items: Iterable[T]) -> Iterator[tuple[T, R]]:
    for item in items:
        yield item, fn(shared, item)


@dataclass(frozen=True)
class Evidence:
    closed_form: str                    # ε(β, γ) as a sympy expression
    bound: float                        # a proven upper bound of the closed form ε at the model's (β, γ)
    gate: str                           # "closed form" or "linear programme"
    isolated: tuple[bool, ...] | None   # per task; None when not checked
    notes: tuple[str, ...] = ()
    bound_proven: bool = True           # the side conditions hold: the closed form bounds every query's error


def leave_one_out_tasks(K: int, n_facts: int) -> list[int]:
    """Which tasks the leave-one-out rebuild removes: all up to 12 tasks, else 12 spread
    evenly (4 beyond 200k facts, where each rebuild costs a full construction)."""
    count = 12 if n_facts <= 200_000 else 4
    return list(range(K)) if K <= count else sorted(set(np.linspace(0, K - 1, count).astype(int).tolist()))


def changed_experts(shared, j: int) -> list[str]:
    """The tasks whose expert changes when task ``j`` is removed and the model rebuilt
    (``shared`` = (task set, the full model's residual space, its experts)): a work unit. The rebuilt set comes from the
    full set's arrays (:meth:`TaskSet.without`), so its residual maps into the full one by entity rows rather
    than by names (:func:`subset_column_map`); the comparison is of labelled weights."""
    taskset, residual, experts = shared
    rest = taskset.without(taskset.tasks[j].name)
    space = residual_space(rest)
    rows = taskset.entity_rows([k for k in range(len(taskset.tasks)) if k != j])
    to_full = subset_column_map(taskset, rest, rows, space, residual)
    out = []
    for k_new, task in enumerate(rest.tasks):
        k = taskset.index(task.name)
        to_b = to_full if experts[k].W_1.cols is residual else column_map(space, experts[k].W_1.cols)
        if not same_as_built(expert_entries(rest, k_new, space), experts[k], to_b):
            out.append(task.name)
    return out


def isolation(taskset: TaskSet, model, map_fn: MapFn = serial_map) -> tuple[tuple[bool, ...], tuple[str, ...]]:
    """(per task: its expert is unchanged when built alone and without each removed task, notes)."""
    isolated = []
    for k in range(len(taskset.tasks)):
        alone = taskset.alone(k)                 # TaskSet((task,)), from this set's arrays
        by_itself = expert_entries(alone, 0, residual_space(alone))
        to_full = alone_column_map(taskset, k, alone, by_itself.residual, model.experts[k].W_1.cols)
        isolated.append(same_as_built(by_itself, model.experts[k], to_full))
    K = len(taskset.tasks)
    if K < 2:
        return tuple(isolated), ()
    chosen = leave_one_out_tasks(K, taskset.n_facts)

    notes = []
    for j, names in map_fn(changed_experts, (taskset, model.residual, model.experts), chosen):
        for name in names:
            isolated[taskset.index(name)] = False
            notes.append(f"expert '{name}' changes when task '{taskset.tasks[j].name}' is removed")
    notes.append(f"leave-one-out rebuilds checked for {len(chosen)} of {K} tasks")
    return tuple(isolated), tuple(notes)


def evidence(taskset: TaskSet, model, *, check_isolation: bool = True, map_fn: MapFn = serial_map) -> Evidence:
    """The construction's evidence for ``model`` (a :class:`construction.model.SymbolicModel`)."""
    isolated, notes = isolation(taskset, model, map_fn) if check_isolation else (None, ())
    unproven = model.unproven_conditions()
    return Evidence(str(model.error_bound()), model.bound_value(), model.gate.method, isolated,
                    notes + tuple(unproven_note(model.beta, unproven)), not unproven)


def unproven_note(beta, unproven: list[str]) -> list[str]:
    """The report's note when the closed form is not a proven bound (none when it is)."""
    if not unproven:
        return []
    return [f"the closed-form bound is not proven at beta = {beta}: {'; '.join(unproven)} (it is the expression's "
            f"value, not a bound; the verdict does not rest on it)"]
