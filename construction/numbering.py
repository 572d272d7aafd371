"""The construction's names for every index of the weights it builds.

A weights file numbers its tokens, residual coordinates, each head's query/key and value
coordinates, its experts and their neurons; the construction names each one (``subj:Paris``,
``fact:France``). Two models built for two versions of a task set (before and after an
edit) are compared through these names: :func:`correspondence` says, for every index of
the old model, the index of the same name in the new one (-1: gone). Computed from the
task sets alone, without building either model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from construction.bases import Prefixed, Space, block
from construction.experts import column_map, template_nodes
from construction.residual import residual_space, symbols
from tasks.model import TaskSet


@dataclass(frozen=True)
class Numbering:
    tokens: tuple[str, ...]            # rows of E: the vocabulary, then BOS
    residual: Space
    qk: tuple[Space, ...]              # per head (structure heads 1..L-1, then the subject head)
    values: tuple[Space, ...]
    experts: tuple[str, ...]           # the task each expert serves
    neurons: tuple[Space, ...]         # per expert


BOS = "<BOS>"


def neuron_space(taskset: TaskSet, k: int) -> Space:
    """Expert k's neurons as :func:`construction.experts.build_expert` names them."""
    task = taskset.tasks[k]
    vocab = taskset.vocabulary
    W = vocab.n_words
    subjects = [vocab.entities[int(i) - W] for i in taskset.fact_ids[k][0]]
    labels = Prefixed(tuple(f"template:{' '.join(sigma)}" for sigma, _, _ in template_nodes(task)), "fact:", subjects)
    return Space.of(block("neuron", labels))


def numbering(taskset: TaskSet) -> Numbering:
    L = taskset.L
    structure_qk = Space.of(block("score", ("at", "before")))
    structure_v = Space.of(block("symbol", symbols(taskset)))
    qk = (structure_qk,) * (L - 1) + (Space.of(block("score", ("first",))),)
    values = (structure_v,) * (L - 1) + (Space.of(block("entity", taskset.vocabulary.entities)),)
    return Numbering(taskset.vocabulary.tokens + (BOS,), residual_space(taskset), qk, values, taskset.names,
                     tuple(neuron_space(taskset, k) for k in range(len(taskset.tasks))))


def _by_name(old: tuple[str, ...], new: tuple[str, ...]) -> np.ndarray:
    index = {name: i for i, name in enumerate(new)}
    return np.fromiter((index.get(name, -1) for name in old), np.int64, len(old))


def correspondence(old: Numbering, new: Numbering) -> dict[str, object]:
    """For each index of the old model, the index of the same name in the new one (-1: none).
    Keys: ``tokens``, ``coords``, ``qk``, ``values`` (per head), ``experts``, ``neurons`` (per
    old expert). Heads correspond one to one only if both models have as many."""
    experts = _by_name(old.experts, new.experts)
    heads = len(old.qk) == len(new.qk)
    return {
        "tokens": _by_name(old.tokens, new.tokens),
        "coords": column_map(old.residual, new.residual),
        "qk": tuple(column_map(a, b) for a, b in zip(old.qk, new.qk)) if heads else (),
        "values": tuple(column_map(a, b) for a, b in zip(old.values, new.values)) if heads else (),
        "experts": experts,
        "neurons": tuple(column_map(old.neurons[k], new.neurons[int(j)]) if j >= 0 else
                         np.full(old.neurons[k].dim, -1, np.int64) for k, j in enumerate(experts.tolist())),
    }
