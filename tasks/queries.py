"""Every query of a task set, with its valid next tokens, in vectorised groups.

A *query* is a non-empty proper prefix of a dataset sentence (1 to |t| − 1 tokens; the
empty prefix, BOS alone, is not a query: the theorem makes no claim about the first
token); its *valid next tokens* are the tokens that follow it in some dataset sentence. Queries are grouped by the
structure trie node σ of their prefix (:mod:`tasks.structure`), which makes enumeration linear in
the number of facts:

* ``plain`` group (σ has no entity): one query, the structure itself;
* ``subject`` group (σ contains ⋆1, not ⋆2): one query per subject s of a task in K(σ);
* ``object`` group (σ contains ⋆1 and ⋆2): one query per (s, D_k(s)) pair.

Within a group, per query:

* ``subjects`` / ``objects``: entity token ids (-1 where absent);
* ``allowed`` (CSR ``allowed_ptr``/``allowed``): the consistent tasks, ascending;
* ``valid`` (CSR ``valid_ptr``/``valid``): the valid next token ids, ascending;
* ``object_query``: True if ⋆2 follows for a consistent task;
* ``determined``: the task index if exactly one task is consistent, else -1;
* ``witness``: a (task, template) whose sentence has this prefix, for messages.

A prefix *determines* task k when every sentence starting with it belongs to k, i.e.
when k is its only consistent task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from tasks.model import TaskSet
from tasks.structure import OBJ, SUBJ, Node, StructureTrie
from tasks.structure import structure_of


@dataclass(frozen=True)
class QueryGroup:
    node: Node
    kind: str  # "plain", "subject" or "object"
    subjects: np.ndarray
    objects: np.ndarray
    allowed_ptr: np.ndarray
    allowed: np.ndarray
    valid_ptr: np.ndarray
    valid: np.ndarray
    object_query: np.ndarray
    determined: np.ndarray
    witness_task: np.ndarray
    witness_template: np.ndarray

    def __len__(self) -> int:
        return len(self.subjects)

    @property
    def depth(self) -> int:
        return self.node.depth

    def prefix_ids(self, i: int, vocab) -> tuple[int, ...]:
        """Token ids of query i's prefix."""
        out = []
        for c in self.node.symbols:
            out.append(int(self.subjects[i]) if c == SUBJ else int(self.objects[i]) if c == OBJ else c)
        return tuple(out)

    def prefix_tokens(self, i: int, vocab) -> tuple[str, ...]:
        return tuple(vocab.token(t) for t in self.prefix_ids(i, vocab))

    def allowed_of(self, i: int) -> np.ndarray:
        return self.allowed[self.allowed_ptr[i] : self.allowed_ptr[i + 1]]

    def valid_of(self, i: int) -> np.ndarray:
        return self.valid[self.valid_ptr[i] : self.valid_ptr[i + 1]]


@dataclass(frozen=True)
class Query:
    """One query in readable form."""

    prefix: tuple[str, ...]
    valid: frozenset[str]
    tasks: tuple[str, ...]          # consistent tasks
    determined: str | None          # the task it determines, if any
    object_query: bool
    witness: tuple[str, str]        # (task name, template text)


def _csr(rows: np.ndarray, values: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Unique (row, value) pairs as CSR with ascending values per row."""
    if rows.size:
        order = np.lexsort((values, rows))
        rows, values = rows[order], values[order]
        keep = np.ones(rows.size, dtype=bool)
        keep[1:] = (rows[1:] != rows[:-1]) | (values[1:] != values[:-1])
        rows, values = rows[keep], values[keep]
    ptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.add.at(ptr, rows + 1, 1)
    return np.cumsum(ptr), values.astype(np.int64)


def _words(children: set[int]) -> np.ndarray:
    return np.array(sorted(c for c in children if c >= 0), dtype=np.int64)


#: A part of a structure group: the queries whose subject token id is in [lo, hi).
Part = tuple[int, int]


def group_parts(taskset: TaskSet, node: Node, max_rows: int) -> list[Part | None]:
    """Subject ranges splitting ``node``'s queries into parts of about ``max_rows`` rows.

    ``[None]`` (the whole group) when the node has no subject or at most ``max_rows``
    facts pass through it. A query's key starts with its subject, so parts by subject
    range are disjoint and together hold every query; a part holds at most ``max_rows``
    facts plus those of one subject (at most one per task through the node).
    """
    ids = taskset.fact_ids
    total = sum(int(ids[k][0].size) for k in node.tasks)
    if not node.has_subject or total <= max_rows:
        return [None]
    W, n_entities = taskset.vocabulary.n_words, len(taskset.vocabulary.entities)
    counts = np.zeros(n_entities, np.int64)
    for k in node.tasks:
        counts[ids[k][0] - W] += 1          # a task's subjects are distinct
    cum = np.cumsum(counts)
    cuts = np.searchsorted(cum, np.arange(max_rows, total, max_rows), side="right")
    bounds = np.unique(np.concatenate([[0], cuts, [n_entities]]))
    return [(W + int(a), W + int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def build_group(taskset: TaskSet, trie: StructureTrie, node: Node, part: Part | None = None,
                subjects: np.ndarray | None = None) -> QueryGroup:
    """The queries whose prefix has structure ``node`` (and, with ``part = (lo, hi)``, whose
    subject token id is in [lo, hi): see :func:`group_parts`; with ``subjects``, a sorted
    array of token ids, whose subject is one of them). A query's consistent tasks and valid
    next tokens come from its own subject's facts only, so the queries kept are exactly the
    full group's rows with those subjects."""
    ids = taskset.fact_ids
    tasks = node.tasks
    if not node.has_subject:
        # One query: the words of σ. Consistent with every task through σ.
        allowed = np.array(tasks, dtype=np.int64)
        valid_parts = []
        for k in tasks:
            valid_parts.append(_words(node.children[k]))
            if SUBJ in node.children[k]:
                valid_parts.append(ids[k][0])
        valid = np.unique(np.concatenate(valid_parts)) if valid_parts else np.zeros(0, np.int64)
        oq = np.zeros(1, dtype=bool)
        return QueryGroup(
            node, "plain",
            np.full(1, -1, np.int64), np.full(1, -1, np.int64),
            np.array([0, allowed.size], np.int64), allowed,
            np.array([0, valid.size], np.int64), valid.astype(np.int64),
            oq, np.array([tasks[0] if len(tasks) == 1 else -1], np.int64),
            np.array([tasks[0]], np.int64), np.array([node.templates[tasks[0]][0]], np.int64),
        )

    with_object = node.has_object
    # (query key, task) pairs: one per fact of each task through σ.
    subj_parts, obj_parts, task_parts = [], [], []
    for k in tasks:
        s, o = ids[k]
        if part is not None:
            a, b = np.searchsorted(s, part)     # subjects are sorted within a task
            s, o = s[a:b], o[a:b]
        if subjects is not None:           # a task's subjects are distinct and sorted
            at = np.searchsorted(s, subjects)
            hit = at < s.size
            hit[hit] = s[at[hit]] == subjects[hit]
            s, o = s[at[hit]], o[at[hit]]
        subj_parts.append(s)
        obj_parts.append(o)
        task_parts.append(np.full(s.size, k, np.int64))
    offsets = np.concatenate([[0], np.cumsum([x.size for x in subj_parts])])   # task tasks[i]: rows offsets[i]..
    subj = np.concatenate(subj_parts)
    obj = np.concatenate(obj_parts)
    task = np.concatenate(task_parts)
    if with_object:
        base = int(taskset.vocabulary.size) + 1
        uniq, inverse = _distinct(subj * base + obj)          # (subject, object) as one integer
        q_subj, q_obj = uniq // base, uniq % base
    else:
        q_subj, inverse = _distinct(subj)
        q_obj = np.full(q_subj.size, -1, np.int64)
    n = q_subj.size
    if len(tasks) == 1 and np.array_equal(inverse, np.arange(n)):
        allowed_ptr, allowed, valid_ptr, valid, oq = _one_task(node, tasks[0], obj, n)
    else:
        allowed_ptr, allowed, valid_ptr, valid, oq = _rows_of_tasks(node, inverse, offsets, task, obj, n)

    counts = np.diff(allowed_ptr)
    first = allowed[allowed_ptr[:-1]]
    determined = np.where(counts == 1, first, -1)
    first_template = np.zeros(max(tasks) + 1, np.int64)
    first_template[list(tasks)] = [node.templates[k][0] for k in tasks]
    witness_template = first_template[first] if n else np.zeros(0, np.int64)
    return QueryGroup(
        node, "object" if with_object else "subject",
        q_subj.astype(np.int64), q_obj.astype(np.int64),
        allowed_ptr, allowed, valid_ptr, valid, oq, determined.astype(np.int64),
        first.astype(np.int64), witness_template,
    )


def _distinct(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(key, return_inverse=True)``, without the sort where ``key`` is already
    strictly increasing (one task's keys are: its subjects are distinct and sorted), which
    the comparison of neighbours decides exactly."""
    if key.size < 2 or bool((key[1:] > key[:-1]).all()):
        return key, np.arange(key.size)
    uniq, inverse = np.unique(key, return_inverse=True)
    return uniq, inverse.reshape(-1)


def _rows_of_tasks(node: Node, inverse: np.ndarray, offsets: np.ndarray, task: np.ndarray, obj: np.ndarray, n: int):
    """(allowed_ptr, allowed, valid_ptr, valid, object_query) of a group from its (query
    row, task) pairs: ``inverse`` the row of each pair, the pairs of ``node.tasks[i]`` at
    ``offsets[i]`` .. ``offsets[i + 1]``, ``task`` and ``obj`` their task and object."""
    allowed_ptr, allowed = _csr(inverse, task, n)
    # Valid next tokens: each consistent task's word children, and D_k(s) where ⋆2 follows.
    v_rows, v_vals = [], []
    oq = np.zeros(n, dtype=bool)
    for i, k in enumerate(node.tasks):
        rows_k = inverse[offsets[i]:offsets[i + 1]]
        words = _words(node.children[k])
        if words.size:
            v_rows.append(np.repeat(rows_k, words.size))
            v_vals.append(np.tile(words, rows_k.size))
        if OBJ in node.children[k]:
            v_rows.append(rows_k)
            v_vals.append(obj[offsets[i]:offsets[i + 1]])
            oq[rows_k] = True
    valid_ptr, valid = _csr(np.concatenate(v_rows), np.concatenate(v_vals), n)
    return allowed_ptr, allowed, valid_ptr, valid, oq


def _one_task(node: Node, k: int, obj: np.ndarray, n: int):
    """(allowed_ptr, allowed, valid_ptr, valid, object_query) of a group whose rows are the
    facts of one task k in order (row i: its i-th fact): the CSRs :func:`_csr` builds,
    without sorting. Every row is consistent with k alone; its valid next tokens are k's
    word children (sorted, distinct) and, where ⋆2 follows, the fact's object, an entity,
    whose id is above every word's: each row is sorted and distinct already (the same arrays
    as :func:`_rows_of_tasks`: tests/tasks/test_structure.py)."""
    words = _words(node.children[k])
    has_object = OBJ in node.children[k]
    per = words.size + int(has_object)
    valid = np.empty((n, per), np.int64)
    valid[:, :words.size] = words
    if has_object:
        valid[:, per - 1] = obj
    return (np.arange(n + 1, dtype=np.int64), np.full(n, k, np.int64), np.arange(n + 1, dtype=np.int64) * per,
            valid.reshape(-1), np.full(n, has_object))


def query_groups(taskset: TaskSet, trie: StructureTrie | None = None) -> Iterator[QueryGroup]:
    """Every query of the task set, one group per structure node."""
    trie = trie or structure_of(taskset)
    for node in trie:
        yield build_group(taskset, trie, node)


def iter_queries(taskset: TaskSet, trie: StructureTrie | None = None) -> Iterator[Query]:
    """Every query in readable form (small sets; use :func:`query_groups` at scale)."""
    vocab = taskset.vocabulary
    names = taskset.names
    for g in query_groups(taskset, trie):
        for i in range(len(g)):
            k = int(g.witness_task[i])
            yield Query(
                prefix=g.prefix_tokens(i, vocab),
                valid=frozenset(vocab.token(t) for t in g.valid_of(i)),
                tasks=tuple(names[j] for j in g.allowed_of(i)),
                determined=names[g.determined[i]] if g.determined[i] >= 0 else None,
                object_query=bool(g.object_query[i]),
                witness=(names[k], str(taskset.tasks[k].templates[int(g.witness_template[i])])),
            )


def count_queries(taskset: TaskSet, trie: StructureTrie | None = None) -> int:
    return sum(len(g) for g in query_groups(taskset, trie))
