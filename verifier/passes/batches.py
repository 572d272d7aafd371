"""Queries in vectorised batches: same prefix length, rows sorted by task, bounded size.

All queries of one length p are concatenated across structure groups (the per-group
arrays of :mod:`tasks.queries`), sorted by their first consistent task so that a chunk
touches few experts, and cut into chunks of at most ``chunk`` rows. Memory stays
bounded by the chunk size whatever the number of facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from tasks.model import TaskSet
from tasks.queries import Part, QueryGroup, build_group, group_parts
from tasks.structure import OBJ, SUBJ, StructureTrie
from tasks.structure import structure_of


#: Rows per part of a large structure group (queries built at once).
GROUP_ROWS = 500_000

#: Rows per batch of the certified pass (:func:`batch_rows`).
BATCH_ROWS = 20_000


def batch_rows(n_experts: int, rows: int = BATCH_ROWS) -> int:
    """Rows per batch for weights of ``n_experts`` experts: ``rows``, fewer where a batch's
    gate scores (rows × experts) would pass 20M entries, and at least 1000."""
    return max(1_000, min(rows, 20_000_000 // max(n_experts, 1)))


def take_csr(ptr: np.ndarray, vals: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``idx`` of a CSR (ptr, vals), in that order."""
    counts = ptr[idx + 1] - ptr[idx]
    new_ptr = np.zeros(idx.size + 1, np.int64)
    np.cumsum(counts, out=new_ptr[1:])
    total = int(new_ptr[-1])
    if total == 0:
        return new_ptr, np.zeros(0, vals.dtype)
    starts = np.repeat(ptr[idx] - new_ptr[:-1], counts)
    return new_ptr, vals[starts + np.arange(total)]


def concat_csr(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    ptrs, vals, offset = [np.zeros(1, np.int64)], [], 0
    for ptr, v in parts:
        ptrs.append(ptr[1:] + offset)
        vals.append(v)
        offset += int(ptr[-1])
    return np.concatenate(ptrs), (np.concatenate(vals) if vals else np.zeros(0, np.int64))


@dataclass
class Batch:
    """n queries of length p (task-set token ids), with what the checks need per row."""

    p: int
    tokens: np.ndarray          # (n, p) token ids
    valid_ptr: np.ndarray
    valid: np.ndarray           # valid next token ids (task-set ids)
    allowed_ptr: np.ndarray
    allowed: np.ndarray         # consistent task indices
    determined: np.ndarray      # (n,) task or -1
    object_query: np.ndarray    # (n,) bool
    node: np.ndarray            # (n,) structure-trie node of the row's group
    part: np.ndarray            # (n, 2) subject range [lo, hi) of the group's part ((-1, -1): the whole group)
    index: np.ndarray           # (n,) index within that part
    #: (n,) the object of a determined object query (task-set id), else -1 (:func:`object_targets`)
    target: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.target is None:
            self.target = np.full(self.tokens.shape[0], -1, np.int64)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, idx: np.ndarray) -> "Batch":
        """Rows ``idx`` of this batch, in that order."""
        vp, vv = take_csr(self.valid_ptr, self.valid, idx)
        ap, av = take_csr(self.allowed_ptr, self.allowed, idx)
        return Batch(self.p, self.tokens[idx], vp, vv, ap, av, self.determined[idx], self.object_query[idx],
                     self.node[idx], self.part[idx], self.index[idx], self.target[idx])


def group_tokens(group: QueryGroup) -> np.ndarray:
    cols = []
    n = len(group)
    for c in group.node.symbols:
        cols.append(group.subjects if c == SUBJ else group.objects if c == OBJ else np.full(n, c, np.int64))
    return np.stack(cols, axis=1)


def object_targets(valid_ptr: np.ndarray, valid: np.ndarray, object_query: np.ndarray,
                   determined: np.ndarray) -> np.ndarray:
    """Per row, the object o of a determined object query (task-set id), else -1.

    Why the last valid token is o: such a query has a subject s and one consistent task k
    (``tasks.queries``), so its valid next tokens are the words that follow it in k's
    templates and the one object of s in k (a task maps a subject to one object). Words are
    numbered before entities (``tasks.model.Vocabulary``), and the valid tokens are sorted,
    so the only entity, o, comes last."""
    n = valid_ptr.size - 1
    out = np.full(n, -1, np.int64)
    rows = np.flatnonzero(object_query & (determined >= 0) & (np.diff(valid_ptr) > 0))
    out[rows] = valid[valid_ptr[rows + 1] - 1]
    return out


def _rows(g: QueryGroup, part: Part | None, idx: np.ndarray, tokens: np.ndarray) -> dict:
    """Rows ``idx`` of group ``g`` as a batch's arrays (``tokens``: :func:`group_tokens` of g,
    made once for all its chunks)."""
    vp, vv = take_csr(g.valid_ptr, g.valid, idx)
    ap, av = take_csr(g.allowed_ptr, g.allowed, idx)
    return {"tokens": tokens[idx], "valid": (vp, vv), "allowed": (ap, av), "determined": g.determined[idx],
            "object_query": g.object_query[idx], "node": np.full(idx.size, g.node.id, np.int64),
            "part": np.tile(np.asarray(part if part is not None else (-1, -1), np.int64), (idx.size, 1)), "index": idx,
            "target": object_targets(vp, vv, g.object_query[idx], g.determined[idx])}


def _emit(p: int, parts: list[dict]) -> Batch:
    vp, vv = concat_csr([x["valid"] for x in parts])
    ap, av = concat_csr([x["allowed"] for x in parts])
    cat = lambda key: np.concatenate([x[key] for x in parts])  # noqa: E731
    return Batch(p, cat("tokens"), vp, vv, ap, av, cat("determined"), cat("object_query"), cat("node"), cat("part"),
                 cat("index"), cat("target"))


def batches(taskset: TaskSet, trie: StructureTrie | None = None, chunk: int = 20_000) -> Iterator[Batch]:
    """Every query, in batches of one prefix length and at most ``chunk`` rows.

    Groups are built one structure node at a time, a large one in parts of about
    ``GROUP_ROWS`` rows (:func:`tasks.queries.group_parts`), and their rows sorted by
    first consistent task, so memory is bounded by one part plus one chunk whatever the
    number of facts.
    """
    trie = trie or structure_of(taskset)
    by_depth: dict[int, list] = {}
    for node in trie:
        by_depth.setdefault(node.depth, []).append(node)
    for p in sorted(by_depth):
        def rows(p: int = p):           # this length's groups, read as the batches are made
            for node in sorted(by_depth[p], key=lambda n: n.tasks[0]):
                for part in group_parts(taskset, node, GROUP_ROWS):
                    g = build_group(taskset, trie, node, part)
                    yield _part_rows(g, part), np.argsort(g.allowed[g.allowed_ptr[:-1]], kind="stable")
        yield from _chunked(p, rows(), chunk)


def _part_rows(g: QueryGroup, part: Part | None):
    """Rows of group ``g`` (idx -> their arrays), each naming the group's part."""
    tokens = group_tokens(g)
    return lambda idx: _rows(g, part, idx, tokens)


def _chunked(p: int, groups: Iterator, chunk: int) -> Iterator[Batch]:
    """Batches of prefix length ``p`` and at most ``chunk`` rows from (rows, row order)
    pairs, in that order: ``rows(idx)`` gives a group's rows ``idx`` as arrays."""
    parts: list[dict] = []
    size = 0
    for make, order in groups:
        for lo in range(0, order.size, chunk):
            idx = order[lo: lo + chunk]
            parts.append(make(idx))
            size += idx.size
            if size >= chunk:
                yield _emit(p, parts)
                parts, size = [], 0
    if parts:
        yield _emit(p, parts)


def allowed_keys(g: QueryGroup) -> list[tuple[int, ...]]:
    """Each query's set of consistent tasks, as a tuple."""
    return [tuple(g.allowed[g.allowed_ptr[i]: g.allowed_ptr[i + 1]].tolist()) for i in range(len(g))]


def batches_of(taskset: TaskSet, trie: StructureTrie, cells: list[tuple[int, Part | None]],
               chunk: int = 20_000, keep: dict | None = None) -> Iterator[Batch]:
    """The queries of some cells only: (node id, subject range or None for the whole node),
    in batches of one prefix length and at most ``chunk`` rows (as :func:`batches`). A
    range beyond ``GROUP_ROWS`` facts is built in parts. ``keep[(node id, range)]``, when
    given and not None, is the set of consistent-task tuples whose queries are wanted."""
    by_depth: dict[int, list] = {}
    for nid, part in cells:
        by_depth.setdefault(trie.nodes[nid].depth, []).append((nid, part))
    cuts: dict[int, list] = {}          # per node, its parts (group_parts is linear in the entities)
    for p in sorted(by_depth):
        def rows(p: int = p):           # this length's groups, read as the batches are made
            for nid, part in sorted(by_depth[p], key=lambda c: (c[0], c[1] or (-1, -1))):
                node = trie.nodes[nid]
                wanted = None if keep is None else keep.get((nid, part))
                if nid not in cuts:
                    cuts[nid] = group_parts(taskset, node, GROUP_ROWS)
                for sub in _split(node, part, cuts[nid]):
                    g = build_group(taskset, trie, node, sub)
                    order = np.argsort(g.allowed[g.allowed_ptr[:-1]], kind="stable")
                    if wanted is not None:
                        keys = allowed_keys(g)
                        order = order[np.fromiter((keys[i] in wanted for i in order.tolist()), bool, order.size)]
                    yield _part_rows(g, sub), order
        yield from _chunked(p, rows(), chunk)


def batches_of_subjects(taskset: TaskSet, trie: StructureTrie, subjects: dict[int, np.ndarray], drop=None,
                        chunk: int = 20_000) -> Iterator[Batch]:
    """The queries of some subjects only: ``subjects[node id]`` a sorted array of subject
    token ids, every query of those subjects at that node (``drop(node id, group)``, when
    given, a bool mask of rows to leave out). Each row names the part of its own subject,
    (s, s + 1), and its index in it, as a row of :func:`batches` names its group's part:
    the queries of one subject at a node are that part, in the same order."""
    by_depth: dict[int, list[int]] = {}
    for nid in sorted(subjects):
        by_depth.setdefault(trie.nodes[nid].depth, []).append(nid)
    for p in sorted(by_depth):
        def rows(p: int = p):
            for nid in by_depth[p]:
                g = build_group(taskset, trie, trie.nodes[nid], subjects=np.asarray(subjects[nid], np.int64))
                n = len(g)
                if n == 0:
                    continue
                first = np.flatnonzero(np.r_[True, g.subjects[1:] != g.subjects[:-1]])   # rows sorted by subject
                rank = np.arange(n) - np.repeat(first, np.diff(np.r_[first, n]))
                order = np.argsort(g.allowed[g.allowed_ptr[:-1]], kind="stable")
                if drop is not None:
                    order = order[~np.asarray(drop(nid, g), bool)[order]]
                yield _subject_rows(g, rank), order
        yield from _chunked(p, rows(), chunk)


def _subject_rows(g: QueryGroup, rank: np.ndarray):
    """Rows of group ``g`` (idx -> their arrays), each naming its subject's part (s, s + 1)
    and its index ``rank`` there."""
    tokens = group_tokens(g)

    def make(idx: np.ndarray) -> dict:
        r = _rows(g, None, idx, tokens)
        r["part"] = np.stack([g.subjects[idx], g.subjects[idx] + 1], axis=1)
        r["index"] = rank[idx]
        return r
    return make


def _split(node, part: Part | None, parts: list[Part | None]) -> list[Part | None]:
    """``part`` cut where the node's ``parts`` (:func:`tasks.queries.group_parts`) cut it
    (bounded memory)."""
    if part is None or not node.has_subject:
        return [None] if not node.has_subject else parts
    cuts = [c for c in parts if c is not None]
    out, (lo, hi) = [], part
    for a, b in cuts:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            out.append((a, b))
    return out or [part]
