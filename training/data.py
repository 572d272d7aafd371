"""Every query of a task set as arrays, ready for training and evaluation.

A *query* (see :mod:`tasks.queries`) is a non-empty proper prefix of a dataset sentence
together with its valid next tokens. Here each query becomes one row:

* ``tokens`` (Q, L): ``[BOS, x_1, .., x_n, pad, ..]`` in the task set's token ids
  (``BOS = V``; padding repeats BOS and is never read, because attention is causal and
  the prediction is taken at position ``n``);
* ``lengths`` (Q,): n, the prefix length (the output position);
* ``valid`` (Q, V) bool: the valid next tokens;
* ``object_query`` (Q,) bool: ⋆2 follows for a consistent task;
* ``determined`` (Q,) int: the task the prefix determines, -1 if several are consistent;
* ``consistent`` (Q, T) bool: the tasks with a sentence starting with the prefix;
* ``object_token`` (Q,) int: for an object query of task k with subject s, the object
  o = D_k(s) (the fact's ⋆2); -1 for the other queries. An object query may have other
  valid next tokens too (a word of another template of the same task), so o is not
  simply "the valid token";
* ``n_objects`` (T,) int: |O_k|, the number of distinct objects of task k's facts (the
  uniform guess among them has probability 1/|O_k|, the bound of the localization
  check, :mod:`training.metrics`);
* ``bounds`` (T,) int: c(k) = L·|T(k)| + N_k, the verifier's bound on the width of the
  expert serving task k;
* ``groups``: per row, (structure-trie group number, index in the group), so results can
  be lined up with the verifier's grouped pass.

The model's vocabulary is the task set's (``taskset.vocabulary.tokens``), so token ids
here are token ids in the exported weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.model import TaskSet
from tasks.queries import QueryGroup, query_groups
from tasks.structure import OBJ, SUBJ, StructureTrie
from tasks.structure import structure_of


@dataclass(frozen=True)
class QueryData:
    """The queries of one task set, as numpy arrays (one row per query)."""

    tokens: np.ndarray        # (Q, L) int64, BOS first, padded with BOS
    lengths: np.ndarray       # (Q,) int64, prefix length n >= 1
    valid: np.ndarray         # (Q, V) bool
    object_query: np.ndarray  # (Q,) bool
    determined: np.ndarray    # (Q,) int64, -1 if not determined
    consistent: np.ndarray    # (Q, T) bool, consistent tasks
    object_token: np.ndarray  # (Q,) int64, D_k(s) for object queries, -1 otherwise
    n_objects: np.ndarray     # (T,) int64, |O_k| distinct objects per task
    bounds: np.ndarray        # (T,) int64, c(k)
    group: np.ndarray         # (Q,) int64, structure-trie group number
    index: np.ndarray         # (Q,) int64, index inside the group
    vocab: tuple[str, ...]
    task_names: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def V(self) -> int:
        return len(self.vocab)

    @property
    def bos(self) -> int:
        return len(self.vocab)

    @property
    def n_positions(self) -> int:
        """Positions the model needs: BOS plus the longest prefix (= L)."""
        return int(self.tokens.shape[1])

    def prefix(self, i: int) -> tuple[str, ...]:
        """Query i's prefix as tokens (for messages)."""
        return tuple(self.vocab[t] for t in self.tokens[i, 1 : self.lengths[i] + 1])


def group_rows(group: QueryGroup) -> np.ndarray:
    """The prefixes of a group as an (n, depth) array of task-set token ids."""
    n = len(group)
    cols = []
    for c in group.node.symbols:
        if c == SUBJ:
            cols.append(np.asarray(group.subjects, np.int64))
        elif c == OBJ:
            cols.append(np.asarray(group.objects, np.int64))
        else:
            cols.append(np.full(n, int(c), np.int64))
    return np.stack(cols, axis=1) if cols else np.zeros((n, 0), np.int64)


def object_tokens(taskset: TaskSet, group: QueryGroup) -> np.ndarray:
    """Per query of ``group``: D_k(s) for an object query (k its determined task, s its
    subject), -1 otherwise.

    Object queries determine their task (:func:`tasks.structure.check_routable`, which
    every task set that constructs passes) and have a subject (⋆2 follows ⋆1 in every
    template), so D_k(s) is looked up in task k's facts, whose subject ids are sorted.
    """
    out = np.full(len(group), -1, np.int64)
    rows = np.flatnonzero(np.asarray(group.object_query, bool))
    for k in np.unique(group.determined[rows]).tolist():
        if k < 0:
            raise ValueError("an object query that does not determine its task (the task set is not routable)")
        at = rows[group.determined[rows] == k]
        s, o = taskset.fact_ids[k]
        pos = np.searchsorted(s, group.subjects[at])
        out[at] = o[pos]
    return out


def query_data(taskset: TaskSet, trie: StructureTrie | None = None) -> QueryData:
    """Every query of ``taskset`` (all structure-trie groups, in the verifier's order)."""
    trie = trie or structure_of(taskset)
    vocab = taskset.vocabulary.tokens
    V, L = len(vocab), taskset.L
    bos = V
    tokens, lengths, valid_rows, valid_cols = [], [], [], []
    oq, det, grp, idx, cons_rows, cons_cols, objs = [], [], [], [], [], [], []
    offset = 0
    for g_no, group in enumerate(query_groups(taskset, trie)):
        n = len(group)
        rows = group_rows(group)
        block = np.full((n, L), bos, np.int64)
        block[:, 1 : 1 + rows.shape[1]] = rows
        tokens.append(block)
        lengths.append(np.full(n, rows.shape[1], np.int64))
        counts = np.diff(group.valid_ptr)
        valid_rows.append(offset + np.repeat(np.arange(n), counts))
        valid_cols.append(np.asarray(group.valid, np.int64))
        cons_rows.append(offset + np.repeat(np.arange(n), np.diff(group.allowed_ptr)))
        cons_cols.append(np.asarray(group.allowed, np.int64))
        oq.append(np.asarray(group.object_query, bool))
        det.append(np.asarray(group.determined, np.int64))
        objs.append(object_tokens(taskset, group))
        grp.append(np.full(n, g_no, np.int64))
        idx.append(np.arange(n, dtype=np.int64))
        offset += n
    valid = np.zeros((offset, V), bool)
    valid[np.concatenate(valid_rows), np.concatenate(valid_cols)] = True
    consistent = np.zeros((offset, len(taskset.tasks)), bool)
    consistent[np.concatenate(cons_rows), np.concatenate(cons_cols)] = True
    return QueryData(
        tokens=np.concatenate(tokens), lengths=np.concatenate(lengths), valid=valid,
        object_query=np.concatenate(oq), determined=np.concatenate(det), consistent=consistent,
        object_token=np.concatenate(objs),
        n_objects=np.array([np.unique(taskset.fact_ids[k][1]).size for k in range(len(taskset.tasks))], np.int64),
        bounds=np.array([taskset.complexity(k) for k in range(len(taskset.tasks))], np.int64),
        group=np.concatenate(grp), index=np.concatenate(idx),
        vocab=tuple(vocab), task_names=taskset.names,
    )
