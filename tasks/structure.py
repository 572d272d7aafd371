"""Prefix structure of a task set: the structure trie, routability and conflicts.

The *structure* of a prefix replaces its entities by the slot they fill: the prefix
``the capital of France is`` has structure ``the capital of ⋆1 is``. Because template
words and entities are disjoint token sets (see :mod:`tasks.model`), a token prefix of
a dataset sentence determines its structure, so prefixes of different structures are
different prefixes.

The *structure trie* has one node per distinct structure σ that is a proper prefix of
some template (depth 1 .. |t|-1). For each node it records

* ``tasks``: K(σ), the tasks with a template passing through σ;
* ``children[k]``: the symbols that follow σ in task k's templates (word ids, or
  ``SUBJ``/``OBJ`` for the slots).

Routing facts that follow (used by the construction and the verifier):

* A prefix with structure σ and no entity is consistent with exactly the tasks K(σ).
* A prefix σ[s] whose structure contains ⋆1 (not ⋆2) is consistent with
  {k ∈ K(σ) : s ∈ dom D_k}; past ⋆2 additionally D_k(s) must equal the object.
* An *object query* is σ[s] where some consistent task k has ⋆2 next. It is well-posed
  only if k is its only consistent task; otherwise no model can route it, and
  :func:`object_query_collisions` names the two templates and the prefix.

A *structural* object-query collision is weaker: two tasks share the structure up to ⋆2
but no subject, so every actual prefix is still determined by its subject.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Iterator

import numpy as np

from tasks.errors import TaskError
from tasks.model import OBJECT, SUBJECT, Slot, TaskSet

if TYPE_CHECKING:
    import networkx

#: Symbol codes in the trie: word ids are >= 0.
SUBJ = -1
OBJ = -2


def symbol_code(part: object, vocab) -> int:
    if part is SUBJECT:
        return SUBJ
    if part is OBJECT:
        return OBJ
    return vocab.id(part)


@dataclass
class Node:
    """One structure σ (a proper template prefix), with the tasks passing through it.

    σ is kept as the symbols of the first template that passes through it (``path``, shared
    by all of that template's nodes) and its length, and made a tuple only when asked for
    (:attr:`symbols`): the trie of a template of L words holds L nodes, not L²/2 symbols."""

    id: int
    path: tuple[int, ...]
    depth: int
    parent: int
    #: task index -> set of next symbols in that task's templates
    children: dict[int, set[int]] = field(default_factory=dict)
    #: task index -> template indices (within the task) passing through σ
    templates: dict[int, list[int]] = field(default_factory=dict)

    @cached_property
    def symbols(self) -> tuple[int, ...]:
        """σ's symbols: word ids, ``SUBJ``, ``OBJ``."""
        return self.path[:self.depth]

    @property
    def tasks(self) -> tuple[int, ...]:
        """K(σ), sorted."""
        return tuple(sorted(self.children))

    @property
    def has_subject(self) -> bool:
        return SUBJ in self.symbols

    @property
    def has_object(self) -> bool:
        return OBJ in self.symbols

    @property
    def subject_position(self) -> int:
        """0-based index of ⋆1 in σ, or -1."""
        return self.symbols.index(SUBJ) if SUBJ in self.symbols else -1

    @property
    def object_position(self) -> int:
        return self.symbols.index(OBJ) if OBJ in self.symbols else -1

    def object_query_tasks(self) -> tuple[int, ...]:
        """Tasks for which ⋆2 follows σ (σ is their object-query structure)."""
        return tuple(k for k in sorted(self.children) if OBJ in self.children[k])


class StructureTrie:
    """The trie of template structures of a task set (see the module docstring)."""

    def __init__(self, taskset: TaskSet) -> None:
        self.taskset = taskset
        vocab = taskset.vocabulary
        self.nodes: list[Node] = []
        self._index: dict[tuple[int, int], int] = {}     # (parent id, next symbol) -> node id
        #: (task, template) -> node ids of its proper prefixes, depth 1..|t|-1
        self.paths: dict[tuple[int, int], list[int]] = {}
        for k, task in enumerate(taskset.tasks):
            for ti, template in enumerate(task.templates):
                codes = tuple(symbol_code(p, vocab) for p in template.parts)
                path = []
                parent = -1
                for depth in range(1, len(codes)):
                    key = (parent, codes[depth - 1])
                    nid = self._index.get(key)
                    if nid is None:
                        nid = len(self.nodes)
                        self._index[key] = nid
                        self.nodes.append(Node(nid, codes, depth, parent))
                    node = self.nodes[nid]
                    node.children.setdefault(k, set()).add(codes[depth])
                    node.templates.setdefault(k, []).append(ti)
                    path.append(nid)
                    parent = nid
                self.paths[(k, ti)] = path

    def node(self, symbols: tuple[int, ...]) -> Node | None:
        nid = -1
        for c in symbols:
            nid = self._index.get((nid, c))
            if nid is None:
                return None
        return None if nid < 0 else self.nodes[nid]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def describe(self, node: Node) -> str:
        """The structure as text: 'the capital of ⋆1 is'."""
        vocab = self.taskset.vocabulary
        return " ".join("⋆1" if c == SUBJ else "⋆2" if c == OBJ else vocab.token(c) for c in node.symbols)

    def template_text(self, k: int, ti: int) -> str:
        task = self.taskset.tasks[k]
        return f"'{task.templates[ti]}' of task '{task.name}'"

    @cached_property
    def max_depth(self) -> int:
        return max((n.depth for n in self.nodes), default=0)


@dataclass(frozen=True)
class Collision:
    """Two templates of different tasks that share an object-query prefix."""

    node: int
    structure: str
    first: tuple[int, int]   # (task, template) for which ⋆2 follows the shared prefix
    second: tuple[int, int]  # (task, template) of the other task through the same prefix
    subject: str | None      # a shared subject (data-level collision), or None (structural only)
    n_shared_subjects: int

    def message(self, taskset: TaskSet) -> str:
        (k1, t1), (k2, t2) = self.first, self.second
        a, b = taskset.tasks[k1], taskset.tasks[k2]
        prefix = self.structure.replace("⋆1", self.subject) if self.subject else self.structure
        return (
            f"template '{a.templates[t1]}' of task '{a.name}' and template '{b.templates[t2]}' of task '{b.name}' "
            f"share the object-query prefix '{prefix}'"
        )


def object_query_collisions(trie: StructureTrie, structural: bool = False,
                            only: list[int] | None = None) -> list[Collision]:
    """Object-query structures shared by two tasks.

    With ``structural=False`` only data-level collisions are returned: a subject of
    both tasks makes an actual prefix that is an object query of one task and a
    prefix of the other's sentence, so no model can route it. With ``structural=True``
    every shared object-query *structure* is returned (shared subjects or not). With
    ``only`` (task indices), only collisions involving one of those tasks are looked for
    (the others' were ruled out before, when none of them changed).

    In order: by node, then by the task k that has ⋆2 next, then by the other task j (a
    pair of tasks that both have ⋆2 next once, k < j). Data-level collisions are found
    from the subjects the node's tasks share (:func:`_collision_codes`), so that a node
    that thousands of tasks pass through costs the sort of their subjects and the
    collisions found, not a comparison per pair of tasks.
    """
    if structural:
        return _structural_collisions(trie, only)
    K = len(trie.taskset.tasks)
    common: dict[tuple[int, int], np.ndarray] = {}      # the subjects two tasks share, per pair (nodes repeat pairs)
    out: list[Collision] = []
    for node, codes in _collision_codes(trie, only):
        structure = trie.describe(node)
        out += [_collision(trie, node, structure, *divmod(code, K), common) for code in codes.tolist()]
    return out


def count_collisions(trie: StructureTrie, only: list[int] | None = None) -> int:
    """``len(object_query_collisions(trie, only=only))``, without making the collisions."""
    return sum(codes.size for _, codes in _collision_codes(trie, only))


def _collision_codes(trie: StructureTrie, only: list[int] | None) -> Iterator[tuple[Node, np.ndarray]]:
    """Per node with data-level collisions, in trie order: the node and its collisions as
    codes k·K + j (K tasks), distinct and ascending (the order of
    :func:`object_query_collisions`).

    A collision at a node is a task k with ⋆2 next and another task j through the node that
    share a subject. The subjects of the node's tasks are sorted together; a run of one
    subject held by two tasks or more (each task holds a subject once) of which one has ⋆2
    next gives its pairs (k in the run with ⋆2 next, j another task of the run; a pair of
    two such tasks once, from the smaller). A pair that shares several subjects is found in
    several runs and kept once. The work is the sort and the pairs found: a set nobody can
    route may have many, a set that routes has none."""
    taskset = trie.taskset
    ids = taskset.fact_ids
    K = len(taskset.tasks)
    mine = None
    if only is not None:
        mine = np.zeros(K, bool)
        mine[list(only)] = True
    for node in trie:
        oq = node.object_query_tasks()
        if not oq or len(node.children) < 2:
            continue
        tasks = node.tasks
        if mine is not None and not mine[list(tasks)].any():
            continue                                     # every collision involves a task of ``only``
        is_oq = np.zeros(K, bool)
        is_oq[list(oq)] = True
        subjects = [ids[t][0] for t in tasks]
        held = np.concatenate(subjects)
        order = np.argsort(held, kind="stable")
        sub = held[order]
        lab = np.repeat(np.asarray(tasks, np.int32), [s.size for s in subjects])[order]   # (K < 2³¹ tasks)
        starts = np.flatnonzero(np.concatenate(([True], sub[1:] != sub[:-1]))) if sub.size else np.zeros(0, np.int64)
        lengths = np.diff(np.append(starts, sub.size))
        with_oq = np.add.reduceat(is_oq[lab].astype(np.int64), starts) if sub.size else np.zeros(0, np.int64)
        runs = (lengths >= 2) & (with_oq >= 1)
        codes = []
        for start, n in zip(starts[runs].tolist(), lengths[runs].tolist()):
            run = lab[start:start + n]
            ks = run[is_oq[run]]
            k, j = np.repeat(ks, n), np.tile(run, ks.size)
            keep = (j != k) & ~(is_oq[j] & (j < k))
            if mine is not None:
                keep &= mine[k] | mine[j]
            codes.append(k[keep].astype(np.int64) * K + j[keep])
        if len(codes) > 1:                               # (one run's codes are distinct and ascending)
            found = np.sort(np.concatenate(codes))
            codes = [found[np.concatenate(([True], found[1:] != found[:-1]))] if found.size else found]
        if codes and codes[0].size:
            yield node, codes[0]


def _collision(trie: StructureTrie, node: Node, structure: str, k: int, j: int,
               common: dict[tuple[int, int], np.ndarray]) -> Collision:
    """The collision of task k (⋆2 next) and task j at ``node``, as the caller found it."""
    taskset = trie.taskset
    ids = taskset.fact_ids
    pair = (min(k, j), max(k, j))
    shared = common.get(pair)
    if shared is None:
        shared = common[pair] = np.intersect1d(ids[k][0], ids[j][0], assume_unique=True)
    subject = taskset.vocabulary.token(shared[0]) if shared.size else None
    first = (k, next(t for t in node.templates[k] if _followed_by(taskset, k, t, node.depth, OBJECT)))
    second = (j, node.templates[j][0])
    return Collision(node.id, structure, first, second, subject, int(shared.size))


def _structural_collisions(trie: StructureTrie, only: list[int] | None) -> list[Collision]:
    """Every shared object-query structure (:func:`object_query_collisions` with ``structural``)."""
    out: list[Collision] = []
    common: dict[tuple[int, int], np.ndarray] = {}
    mine = None if only is None else set(only)
    for node in trie:
        oq = node.object_query_tasks()
        if not oq or len(node.children) < 2:
            continue
        structure = trie.describe(node)
        for k in oq:
            for j in node.tasks:
                if j == k or (mine is not None and k not in mine and j not in mine):
                    continue
                if j in oq and j < k:
                    continue  # a pair of object-query tasks is reported once
                out.append(_collision(trie, node, structure, k, j, common))
    return out


def _followed_by(taskset: TaskSet, k: int, ti: int, depth: int, slot: Slot) -> bool:
    return taskset.tasks[k].templates[ti].parts[depth] is slot


def check_routable(taskset: TaskSet, trie: StructureTrie | None = None, only: list[int] | None = None) -> None:
    """Raise :class:`TaskError` if two tasks share an object-query prefix (data level);
    ``only`` as in :func:`object_query_collisions`."""
    trie = trie or structure_of(taskset)
    found = _collision_codes(trie, only)
    got = next(found, None)                              # the first collision; the others only counted
    if got is not None:
        node, codes = got
        total = codes.size + sum(more.size for _, more in found)
        c = _collision(trie, node, trie.describe(node), *divmod(int(codes[0]), len(taskset.tasks)), {})
        more = f" ({total - 1} more such collisions)" if total > 1 else ""
        err = TaskError(
            f"no model can route this task set: {c.message(taskset)}{more}",
            fix="make the templates differ before ⋆2, or remove the shared subject from one task",
        )
        err.refs = [c.first, c.second]  # type: ignore[attr-defined]
        raise err


def conflict_graph(trie: StructureTrie) -> "networkx.Graph":
    """Templates as nodes, an edge between templates of different tasks sharing a prefix.

    Node keys are ``(task index, template index)`` with attributes ``task`` (name) and
    ``template`` (text). Edge attributes:

    * ``prefix``: the longest shared structure, as text;
    * ``depth``: its length;
    * ``object_query``: True if the shared prefix is the object-query structure of
      either template (structural collision);
    * ``shared_subjects``: how many subjects the two tasks share (a data-level
      collision when ``object_query`` is also True).
    """
    import networkx as nx                   # here: the trie itself does not need it (a slow import)

    taskset = trie.taskset
    graph = nx.Graph()
    for k, task in enumerate(taskset.tasks):
        for ti, t in enumerate(task.templates):
            graph.add_node((k, ti), task=task.name, template=str(t))
    ids = taskset.fact_ids
    for node in trie:  # parents come before children, so deeper nodes overwrite
        if len(node.children) < 2:
            continue
        members = [(k, ti) for k in node.tasks for ti in node.templates[k]]
        for a in range(len(members)):
            for b in range(a + 1, len(members)):
                (k1, t1), (k2, t2) = members[a], members[b]
                if k1 == k2:
                    continue
                oq = (_followed_by(taskset, k1, t1, node.depth, OBJECT)
                      or _followed_by(taskset, k2, t2, node.depth, OBJECT))
                graph.add_edge(
                    members[a],
                    members[b],
                    prefix=trie.describe(node),
                    depth=node.depth,
                    object_query=oq,
                    shared_subjects=int(np.intersect1d(ids[k1][0], ids[k2][0], assume_unique=True).size),
                )
    return graph


def open_tasks(taskset: TaskSet, prefix: tuple[str, ...], trie: StructureTrie | None = None) -> tuple[str, ...]:
    """The names of the tasks consistent with a token prefix (data level)."""
    trie = trie or structure_of(taskset)
    vocab = taskset.vocabulary
    codes = []
    entities = []
    for tok in prefix:
        i = vocab.id(tok)
        if vocab.is_entity(i):
            codes.append(SUBJ if not entities else OBJ)
            entities.append(tok)
        else:
            codes.append(i)
    node = trie.node(tuple(codes))
    if node is None:
        return ()
    names = []
    for k in node.tasks:
        facts = taskset.tasks[k].facts
        if entities and entities[0] not in facts:
            continue
        if len(entities) > 1 and facts[entities[0]] != entities[1]:
            continue
        names.append(taskset.tasks[k].name)
    return tuple(names)


def structure_of(taskset: TaskSet) -> StructureTrie:
    """The structure trie of ``taskset``'s templates, built once per task set and kept with it
    (shared by every stage that walks the prefixes' structures: routability, the gate, the
    queries, the verifier and its certificates). A task set is immutable, so its trie never
    goes stale; an edited set is another task set, with its own. It is not pickled with the
    task set (:meth:`tasks.model.TaskSet.__getstate__`)."""
    trie = taskset.__dict__.get("_structure")
    if trie is None:
        trie = taskset.__dict__["_structure"] = StructureTrie(taskset)
    return trie
