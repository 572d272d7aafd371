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

from construction.bases import Prefixed, Space, block, search_sorted, sorted_strings
from construction.experts import EntityNames, column_map, template_nodes
from construction.residual import residual_space, symbols
from tasks.model import TaskSet


@dataclass(frozen=True)
class Numbering:
    tokens: tuple[str, ...]            # rows of E: the vocabulary, then BOS
    residual: Space
    qk: tuple[Space, ...]              # per head (structure heads 1..L-1, then the subject head)
    values: tuple[Space, ...]
    experts: tuple[str, ...]           # the task each expert serves
    taskset: TaskSet

    def neurons(self, k: int) -> Space:
        """Expert k's neurons (built on demand: a million fact labels cost time)."""
        return neuron_space(self.taskset, k)

    def width(self, k: int) -> int:
        task = self.taskset.tasks[k]
        return len(template_nodes(task)) + task.n_facts


BOS = "<BOS>"


def neuron_space(taskset: TaskSet, k: int) -> Space:
    """Expert k's neurons as :func:`construction.experts.build_expert` names them."""
    task = taskset.tasks[k]
    vocab = taskset.vocabulary
    W = vocab.n_words
    subjects = EntityNames(vocab.entities, taskset.fact_ids[k][0] - W)     # read through, not copied
    labels = Prefixed(tuple(f"template:{' '.join(sigma)}" for sigma, _, _ in template_nodes(task)), "fact:", subjects)
    return Space.of(block("neuron", labels))


def numbering(taskset: TaskSet) -> Numbering:
    L = taskset.L
    structure_qk = Space.of(block("score", ("at", "before")))
    structure_v = Space.of(block("symbol", symbols(taskset)))
    qk = (structure_qk,) * (L - 1) + (Space.of(block("score", ("first",))),)
    values = (structure_v,) * (L - 1) + (Space.of(block("entity", taskset.vocabulary.entities)),)
    return Numbering(taskset.vocabulary.tokens + (BOS,), residual_space(taskset), qk, values, taskset.names, taskset)


def _by_name(old, new, memo: dict | None = None) -> np.ndarray:
    """Position in ``new`` of each name of ``old`` (-1: none). Sorted sequences of strings (the
    vocabulary's entities and tokens) are matched by binary search, others by a dict.
    ``memo`` (optional, kept by the caller for one comparison of two models) remembers the
    answer per pair of sequence objects: the residual stream and the subject head label
    several blocks by one vocabulary tuple, a million names each at scale."""
    if memo is not None:
        hit = memo.get((id(old), id(new)))
        if hit is not None and hit[0] is old and hit[1] is new:
            return hit[2]
        out = _by_name(old, new)
        memo[(id(old), id(new))] = (old, new, out)      # the objects are kept: their ids stay theirs
        return out
    if len(old) == 0:
        return np.zeros(0, np.int64)
    if old is new or (len(old) == len(new) and tuple(old) == tuple(new)):
        return np.arange(len(old), dtype=np.int64)
    a, b = sorted_strings(old, strict=False), sorted_strings(new)
    if a is not None and b is not None:
        return search_sorted(b, a)
    index = {name: i for i, name in enumerate(new)}
    return np.fromiter((index.get(name, -1) for name in old), np.int64, len(old))


def space_map(old: Space, new: Space, memo: dict | None = None) -> np.ndarray:
    """For each coordinate of ``old``, the coordinate of the same (block, label) in ``new``
    (-1: none); ``memo`` as in :func:`_by_name`."""
    out = np.full(old.dim, -1, np.int64)
    for blk, off in zip(old.blocks, old.offsets):
        if new.has_block(blk.name):
            other = new.block(blk.name)
            pos = _by_name(blk.labels, other.labels, memo)
            out[off: off + len(blk)] = np.where(pos >= 0, pos + new.offset(blk.name), -1)
    return out


def seed_maps(memo: dict, old: TaskSet, new: TaskSet, token_map: np.ndarray, numberings=()) -> None:
    """Put into ``memo`` (as :func:`_by_name` keeps it) the maps between the two task sets'
    name sequences that ``token_map`` gives: for each token id of ``old``'s vocabulary, the
    id of the same token in ``new``'s (-1: gone), as the reader that assembled ``new`` from
    ``old`` computed it (tasks.compiled.token_map_from). The vocabularies' entity and token
    sequences, and each pair of numberings' tokens (then BOS), are then not searched again
    name by name: at a million entities that search is a large part of a small edit."""
    va, vb = old.vocabulary, new.vocabulary
    token_map = np.asarray(token_map, np.int64)
    ent = token_map[va.n_words:] - vb.n_words
    ent = np.where(ent >= 0, ent, -1)
    pairs = [(va.entities, vb.entities, ent), (va.tokens, vb.tokens, token_map)]
    pairs += [(a.tokens, b.tokens, np.concatenate([token_map, [len(b.tokens) - 1]])) for a, b in numberings]
    for x, y, m in pairs:
        memo[(id(x), id(y))] = (x, y, m)


def same_subjects(old: TaskSet, new: TaskSet, token_map: np.ndarray) -> set[str]:
    """The tasks of both task sets (templates equal) whose subjects are the same names in the
    same order: the old subject ids sent by ``token_map`` (as in :func:`seed_maps`) are the
    new ones. Such a task's expert has the same neurons (a template's, then a fact's per
    subject, in subject order), whatever its objects."""
    out = set()
    for k, task in enumerate(new.tasks):
        if task.name not in old.names:
            continue
        j = old.index(task.name)
        if old.tasks[j].templates != task.templates:
            continue
        s_old, s_new = old.fact_ids[j][0], new.fact_ids[k][0]
        if s_old.size == s_new.size and np.array_equal(token_map[s_old], s_new):
            out.add(task.name)
    return out


def correspondence(old: Numbering, new: Numbering, same_experts: set[str] | None = None,
                   memo: dict | None = None) -> dict[str, object]:
    """For each index of the old model, the index of the same name in the new one (-1: none).
    Keys: ``tokens``, ``coords``, ``qk``, ``values`` (per head), ``experts``, ``neurons`` (per
    old expert). Heads correspond one to one only if both models have as many. The experts of
    ``same_experts`` (tasks whose templates and subjects are unchanged: :func:`same_subjects`)
    have the same neurons in the same order, so their map is the identity (not recomputed label by label). ``memo``
    as in :func:`_by_name` (shared with other comparisons of the same two task sets)."""
    memo = {} if memo is None else memo
    experts = _by_name(old.experts, new.experts)
    heads = len(old.qk) == len(new.qk)
    same = same_experts or set()

    def neurons(k: int, j: int) -> np.ndarray:
        if j < 0:
            return np.full(old.width(k), -1, np.int64)
        if old.experts[k] in same and old.width(k) == new.width(j):
            return np.arange(old.width(k), dtype=np.int64)
        return column_map(old.neurons(k), new.neurons(j))

    return {
        "tokens": _by_name(old.tokens, new.tokens, memo),
        "coords": space_map(old.residual, new.residual, memo),
        "qk": tuple(space_map(a, b, memo) for a, b in zip(old.qk, new.qk)) if heads else (),
        "values": tuple(space_map(a, b, memo) for a, b in zip(old.values, new.values)) if heads else (),
        "experts": experts,
        "neurons": tuple(neurons(k, int(j)) for k, j in enumerate(experts.tolist())),
    }
