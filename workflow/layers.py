"""The commands on two layers: ``check``, ``build`` and ``inspect`` of a task set with composed
tasks (:mod:`construction.layers`, :mod:`verifier.checks.layers`).

A task set with a composed task gets the two-layer model unless ``--layers 1`` asks for the
one-layer model, which stores every composed fact as a fact of its own; weights given with
``--weights`` are checked in the form their file holds. What the two-layer path does not do
yet is refused in one line, naming the flag: a floating-point ``--precision``, ``--jobs``
other than 1, ``--scheduler``, ``--certificate``/``--since``.
"""

from __future__ import annotations

import json
from typing import Any

from tasks.errors import TaskError
from tasks.model import TaskSet

#: The flags the two-layer path refuses, with the value that means "not given".
UNSUPPORTED = {"precision": "exact", "ulps": None, "accumulate": None, "jobs": 1, "scheduler": None,
               "cluster_timeout": None, "certificate": None, "since": None}


def layers_of_file(tasks: str, layers: int | None, weights: str | None = None) -> tuple[int, TaskSet | None]:
    """(layers, the task set if it was read) for a command on the tasks file ``tasks``: with
    ``weights``, as many as the file holds; else a file whose text does not hold the word
    'compose' has no composed task and is not read here (the one-layer commands read it
    themselves), and one that does is read (:func:`layers_for`)."""
    from layout.layers import layers_of
    from tasks.io import load_tasks

    if weights:
        held = layers_of(weights)
        if layers is not None and layers != held:
            raise TaskError(f"--layers {layers} was given, but the weights file holds {held} layer(s)",
                            file=weights, fix="drop --layers (the file says how many layers it holds)")
        return (2, load_tasks(tasks)) if held == 2 else (1, None)
    if layers is None:
        try:
            with open(tasks, "rb") as f:
                text = f.read(8 << 20)
        except OSError:
            text = b"compose"           # the loader says what is wrong with the path
        if b"compose" not in text:
            return 1, None
    taskset = load_tasks(tasks)
    return layers_for(taskset, layers), taskset


def refuse_two_layers(command: str, tasks: str, layers: int | None, weights: str | None = None) -> None:
    """One line when ``command`` (which has no two-layer form) would run on two layers."""
    n, _ = layers_of_file(tasks, layers, weights)
    if n == 2:
        raise TaskError(f"'{command}' has no two-layer form yet, and this task set gets two layers",
                        fix="add --layers 1 (one layer, storing every composed fact)")


def layers_for(taskset: TaskSet, layers: int | None) -> int:
    """1 or 2: the layers of the model built for ``taskset`` (the module docstring)."""
    composed = any(t.composed for t in taskset.tasks)
    if layers == 2 and not composed:
        raise TaskError("--layers 2 needs a composed task (a task with 'compose: [first, second]')",
                        fix="drop --layers, or add a composed task")
    return layers if layers is not None else (2 if composed else 1)


def refuse_unsupported(**given: Any) -> None:
    """One line for the first flag the two-layer path does not support."""
    for name, value in given.items():
        if name in UNSUPPORTED and value is not None and value != UNSUPPORTED[name]:
            flag = "--" + name.replace("_", "-")
            raise TaskError(f"{flag} is not supported for two-layer models yet",
                            fix=f"drop {flag}, or add --layers 1 (one layer, storing every composed fact)")


def model(taskset: TaskSet, epsilon: float | None = None, beta: float | None = None, gamma: float | None = None):
    """The two-layer construction (:func:`construction.layers.build_two_layers`)."""
    from construction.layers import build_two_layers

    return build_two_layers(taskset, epsilon, beta, gamma)


def check(taskset: TaskSet, *, weights: str | None = None, epsilon: float | None = None, beta: float | None = None,
          gamma: float | None = None, **flags: Any):
    """``check`` on two layers: the weights given (a two-layer file), or the construction's,
    verified on every query (:func:`verifier.checks.layers.verify_layers`)."""
    from verifier.checks.layers import verify_layers

    refuse_unsupported(**flags)
    if weights:
        from layout.layers import load

        return verify_layers(taskset, load(weights), epsilon or taskset.epsilon or 0.01, source=weights)
    built = model(taskset, epsilon, beta, gamma)
    report = verify_layers(taskset, built.instantiate(labels=False), built.epsilon,
                           source="the two-layer construction")                 # (the report names no direction)
    report.parameters.update({"bound": built.bound_value(), "bound_proven": not built.unproven_conditions()})
    return report


def dumps(report) -> str:
    return json.dumps(report.to_json(), indent=2, ensure_ascii=False)


def summary(report) -> str:
    from verifier.checks.layers import report_text

    lines = report_text(report)
    lines.insert(-1, "note: the leave-one-out rebuilds (isolation) are not run for two layers")
    p = report.parameters
    if "bound" in p:
        proven = "proven" if p.get("bound_proven") else "NOT proven"
        lines.insert(-1, f"parameters: beta={p.get('beta')}, gamma={p.get('gamma')}; closed-form bound "
                         f"max(eps1, eps2) = {p['bound']:.4e} ({proven})")
    return "\n".join(lines)


def build_file(taskset: TaskSet, output: str, epsilon: float | None = None, beta: float | None = None,
               gamma: float | None = None, **flags: Any):
    """``build`` on two layers: the two-layer weights written to ``output`` (.npz)."""
    from layout.layers import save

    refuse_unsupported(**flags)
    built = model(taskset, epsilon, beta, gamma)
    save(built.instantiate(), output)
    return built


def inspect_data(taskset: TaskSet, epsilon: float | None = None, beta: float | None = None,
                 gamma: float | None = None) -> dict:
    """``inspect`` on two layers: the parameters, the bound and its conditions, and per task
    its neurons in each layer against one layer storing every composed fact."""
    built = model(taskset, epsilon, beta, gamma)
    stack = built.instantiate()
    costs = built.costs()
    return {"layers": 2, "epsilon": built.epsilon,
            "parameters": {"beta": str(built.beta), "gamma": str(built.gamma)},
            "bound": built.bound_value(), "unproven_conditions": built.unproven_conditions(),
            "residual_width": stack.d, "second_layer_experts": list(stack.second.expert_tasks),
            "parameter_counts": stack.parameter_counts(), "tasks": costs,
            "neurons": {"two_layers": sum(c["layer1"] + c["layer2"] for c in costs),
                        "one_layer": sum(c["one_layer"] for c in costs)}}


def inspect_text(data: dict) -> list[str]:
    rows = [("task", "composes", "|T|", "N_k", "layer 1", "layer 2", "one layer")]
    for c in data["tasks"]:
        rows.append((c["task"], " then ".join(c["compose"]) if c["compose"] else "-", str(c["templates"]),
                     f"{c['facts']:,}", f"{c['layer1']:,}", f"{c['layer2']:,}", f"{c['one_layer']:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [f"two layers: beta = {data['parameters']['beta']}, gamma = {data['parameters']['gamma']}, epsilon = "
           f"{data['epsilon']}; closed-form bound max(eps1, eps2) = {data['bound']:.4e} ("
           + ("proven" if not data["unproven_conditions"] else "NOT proven: " + "; ".join(data["unproven_conditions"]))
           + f"); residual width d = {data['residual_width']}"]
    out += ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    n = data["neurons"]
    out.append("neurons per task: a stored task's template and dictionary neurons in layer 1 and, used as a second "
               "hop, its facts again in layer 2; a composed task's template neurons and detectors (in its first "
               "hop's expert); 'one layer': what one layer storing every composed fact needs")
    out.append(f"neurons in all: {n['two_layers']:,} in two layers, {n['one_layer']:,} in one layer; parameters "
               f"(stored entries): {data['parameter_counts']['total']:,}")
    return out
