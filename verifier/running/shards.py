"""Shards of the weights for runs past one machine: each worker holds only what its tasks need.

A *shard* is a set of tasks (about equal in work: :class:`Plan`), the tokens its
queries can contain (every template word, BOS, and the entities of its tasks) and the
experts that serve its tasks. :func:`restrict` cuts the weights down to the shard's
*cone of influence*, keeping every shape and every coordinate number (:func:`compact`
then renumbers what is left, so that a worker's memory follows its share of the model
rather than the whole model's size):

* ``E`` keeps the rows of the shard's tokens (and BOS); ``P`` is kept whole;
* C0 = the residual coordinates those rows and ``P`` touch; each head keeps the columns
  of ``W_Q``, ``W_K``, ``W_V`` in C0, and ``W_O`` the columns (value coordinates) that
  ``W_V`` can write from C0;
* C1 = C0 plus the residual rows those ``W_O`` columns write; ``W_G`` keeps its columns
  in C1, every expert of the shard keeps the columns of ``W_1`` in C1 and its whole
  ``b_1`` and ``W_2``; every other expert becomes width 0;
* C2 = C1 plus the rows the kept ``W_2`` write; ``U`` keeps its columns in C2.

*Claim.* For a query whose tokens are the shard's and whose candidate experts (those the
gate cannot rule out) serve the shard's tasks, the certified pass over the restricted
weights computes bitwise the same enclosures as over the full weights.

*Proof.* By induction along the pass. The embedding of the query is supported in C0
(its rows of ``E`` and ``P`` are unchanged). Every entry dropped from ``W_Q``, ``W_K``,
``W_V`` lies in a column outside C0, so it multiplies a coordinate that is absent
(structurally zero) from every embedding of the query: the sparse kernels never form
that product, so the same terms are summed in the same order; and every rounding
bound of a row is computed from that row's own term counts (:func:`verifier.arithmetic.interval.matmul`
bounds row by row; the gate's longest row is passed in as ``gate_terms``), so no bound
changes when other rows or columns are dropped. Likewise for ``W_O``
(value coordinates outside the reach of C0 are absent), for ``W_G`` and the kept ``W_1``
(the residual is supported in C1), and for ``U`` (the residual plus the routed expert's
output is supported in C2). The experts that became width 0 are never evaluated for such
a query. Shapes and coordinate numbers are unchanged, so every index agrees. ∎

A query that does not meet the claim's conditions (a candidate expert outside the shard,
which happens only for misrouted or undecided queries, or a token outside it) is
*deferred*: the worker reports it and the caller runs it again over the full weights.
The bitwise claim is also tested directly (``tests/verifier/running/test_cluster.py``): every batch of
several task sets, built and mutated, gives identical results both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from layout import Expert, Head, Weights
from tasks.model import TaskSet


def distinct_ids(ids: np.ndarray) -> np.ndarray:
    """``np.unique`` of non-negative integer ids (sorted, each once), by marking them in a
    table over 0..max instead of sorting; ids already strictly increasing come back as
    they are."""
    ids = np.asarray(ids, np.int64)
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):
        return ids
    if ids.min() < 0:
        return np.unique(ids)
    seen = np.zeros(int(ids.max()) + 1, bool)
    seen[ids] = True
    return np.flatnonzero(seen)


def _keep(m: sp.spmatrix, rows: np.ndarray | None = None, cols: np.ndarray | None = None):
    """``m`` (CSR or CSC, canonical) with only the entries whose row is in the mask ``rows``
    and column in the mask ``cols``; the order of the kept entries, the format and the
    shape are unchanged."""
    if m.format not in ("csr", "csc"):
        m = m.tocsr()
    major, minor = (rows, cols) if m.format == "csr" else (cols, rows)
    per_major = np.diff(m.indptr)
    keep = np.ones(m.indices.size, bool)
    if minor is not None:
        keep &= minor[m.indices]
    if major is not None:
        keep &= np.repeat(major, per_major)
    # the kept entries before each row's (column's) first entry: a running count of ``keep``
    ptr = np.concatenate([[0], np.cumsum(keep)])[m.indptr].astype(m.indptr.dtype)
    cls = sp.csr_matrix if m.format == "csr" else sp.csc_matrix
    out = cls((m.data[keep], m.indices[keep], ptr), shape=m.shape)
    out.has_sorted_indices = m.has_sorted_indices
    out.has_canonical_format = m.has_canonical_format
    return out


def _rows_touching(m: sp.spmatrix, cols: np.ndarray) -> np.ndarray:
    """Bool mask of the rows of ``m`` with an entry in a column of the mask ``cols``."""
    c = m.tocoo()
    out = np.zeros(m.shape[0], bool)
    out[c.row[cols[c.col]]] = True
    return out


def _cols_of(m: sp.spmatrix, rows: np.ndarray | None = None) -> np.ndarray:
    """Bool mask of the columns of ``m`` with an entry in a row of the mask ``rows`` (all rows if None)."""
    c = m.tocoo()
    out = np.zeros(m.shape[1], bool)
    sel = c.col if rows is None else c.col[rows[c.row]]
    out[sel] = True
    return out


def restrict(weights: Weights, tokens: np.ndarray, experts: np.ndarray) -> Weights:
    """The weights cut to the cone of influence of ``tokens`` (weights' token ids; BOS is
    always kept) with only ``experts`` evaluable; see the module docstring for the proof."""
    V1, d = weights.E.shape
    keep_tok = np.zeros(V1, bool)
    keep_tok[np.asarray(tokens, np.int64)] = True
    keep_tok[weights.bos] = True
    E = _keep(weights.E, rows=keep_tok)
    C0 = _cols_of(E) | _cols_of(weights.P)
    heads, C1 = [], C0.copy()
    for h in weights.heads:
        W_V = _keep(h.W_V, cols=C0)
        value = _rows_touching(W_V, C0)
        W_O = _keep(h.W_O, cols=value)
        heads.append(Head(_keep(h.W_Q, cols=C0), _keep(h.W_K, cols=C0), W_V, W_O))
        C1 |= _rows_touching(W_O, value)
    wanted = np.zeros(len(weights.experts), bool)
    wanted[np.asarray(experts, np.int64)] = True
    out_experts, C2 = [], C1.copy()
    for k, e in enumerate(weights.experts):
        if not wanted[k]:
            out_experts.append(Expert(sp.csr_matrix((0, d)), np.zeros(0), sp.csc_matrix((d, 0))))
            continue
        out_experts.append(Expert(_keep(e.W_1, cols=C1), e.b_1, e.W_2))
        C2 |= _rows_touching(e.W_2, np.ones(e.W_2.shape[1], bool))
    W_G = _keep(weights.W_G, cols=C1)
    U = _keep(weights.U, cols=C2)
    return weights.replace(E=E, heads=tuple(heads), W_G=W_G, experts=tuple(out_experts), U=U,
                           residual_labels=None, neuron_labels=None)


@dataclass(frozen=True)
class Compact:
    """Restricted weights renumbered to what they hold: the tokens a shard's queries can
    meet or its logits can touch, and the residual coordinates of its cone (C2), each
    kept in its original order. ``tokens[i]`` is the full weights' id of compact token i
    (BOS is the compact vocabulary's BOS); ``coords[j]`` the full coordinate of compact
    coordinate j; ``vocab_size`` the full vocabulary's size, which the error needs (a
    token of no kept row of U has logit exactly 0 and is counted, not stored)."""

    weights: Weights
    tokens: np.ndarray
    coords: np.ndarray
    vocab_size: int

    def token_map(self, full_ids: np.ndarray) -> np.ndarray:
        """Compact ids of full weights' token ids (−1 for a token the shard does not hold)."""
        V1 = self.vocab_size + 1
        out = np.full(V1, -1, np.int64)
        out[self.tokens] = np.arange(self.tokens.size)
        out[V1 - 1] = self.tokens.size                 # BOS
        return out[np.asarray(full_ids, np.int64)]


def compact(restricted: Weights, tokens: np.ndarray) -> Compact:
    """The restricted weights (:func:`restrict`) keeping only the rows of their tokens
    (``tokens``, full ids, and every token with an entry of U) and the residual
    coordinates their entries touch, renumbered monotonically.

    *Claim.* On the shard's queries the certified pass over the compact weights (told the
    full vocabulary size) computes bitwise what it computes over the restricted ones.
    *Proof.* Renumbering keeps the order of the stored entries in every row and column,
    and the kernels and products visit entries in that order and accumulate them in that
    order, so every sum has the same terms in the same order; every rounding bound of a
    row depends on its own term counts only (:func:`verifier.arithmetic.interval.matmul` bounds per
    row; the gate's count is passed in as before). A coordinate dropped is touched by no
    kept entry: it is exactly 0 in every enclosure on both sides. A token dropped has no
    entry in E's kept rows (no query of the shard contains it) and none in U: its logit
    is exactly 0 in both passes, and the error counts it from ``vocab_size``. ∎
    """
    w = restricted
    V = len(w.vocab)
    keep_tok = np.zeros(V, bool)
    keep_tok[np.asarray(tokens, np.int64)[np.asarray(tokens) < V]] = True
    keep_tok |= np.diff(w.U.tocsr().indptr) > 0
    kept = np.flatnonzero(keep_tok)
    coords = np.zeros(w.d, bool)
    for M in [w.E, w.P, w.W_G, w.U] + [m for h in w.heads for m in (h.W_Q, h.W_K, h.W_V)] \
            + [e.W_1 for e in w.experts]:
        coords |= _cols_of(M)
    for h in w.heads:
        coords |= _rows_touching(h.W_O, np.ones(h.W_O.shape[1], bool))
    for e in w.experts:
        coords |= _rows_touching(e.W_2, np.ones(e.W_2.shape[1], bool))
    cols = np.flatnonzero(coords)

    at = np.full(w.d, -1, np.int64)
    at[cols] = np.arange(cols.size)

    def renumbered(M, fmt: str, shape: tuple[int, int]):
        """M (canonical, in ``fmt``) with its minor indices renumbered by ``at``: every stored
        minor index is in ``cols`` (they are the coordinates its entries touch), the map is
        increasing, so the entries keep their order and the result is canonical too."""
        cls = sp.csr_matrix if fmt == "csr" else sp.csc_matrix
        idx = at[M.indices]
        if idx.size and idx.min() < 0:
            return None
        return cls((M.data, idx.astype(M.indices.dtype), M.indptr), shape=shape)

    def c(M, rows=None):
        """Columns ``cols`` (and rows ``rows``) of M, in order, in M's format."""
        fmt = M.format
        if rows is None and fmt == "csr" and M.has_canonical_format:
            out = renumbered(M, "csr", (M.shape[0], cols.size))
            if out is not None:
                return out
        M = sp.csc_matrix(M)[:, cols] if rows is None else sp.csc_matrix(M)[rows][:, cols]
        M.sort_indices()
        return M.asformat(fmt)

    def r(M):
        """Rows ``cols`` of M (a map into the residual), in order, in M's format."""
        fmt = M.format
        if fmt == "csc" and M.has_canonical_format:
            out = renumbered(M, "csc", (cols.size, M.shape[1]))
            if out is not None:
                return out
        M = sp.csr_matrix(M)[cols]
        M.sort_indices()
        return M.asformat(fmt)

    E_rows = np.append(kept, w.bos)
    heads = tuple(Head(c(h.W_Q), c(h.W_K), c(h.W_V), r(h.W_O)) for h in w.heads)
    experts = tuple(Expert(c(e.W_1), e.b_1, r(e.W_2)) for e in w.experts)
    out = w.replace(vocab=tuple([w.vocab[i] for i in kept.tolist()]), E=c(w.E, E_rows), P=c(w.P), heads=heads,
                    W_G=c(w.W_G), experts=experts, U=c(w.U, kept), residual_labels=None, neuron_labels=None)
    return Compact(out, kept, cols, V)


@dataclass(frozen=True)
class Plan:
    """Tasks cut into ``n`` shards of about equal work, and per shard its tokens and
    experts (weights' ids). A task's work is its facts times the length of its templates
    summed (about its queries); tasks go, largest first, to the shard with the least
    work so far (longest-processing-time packing: the largest shard is at most 4/3 of the
    best possible, and a task larger than 1/n of the whole is a shard of its own)."""

    shard_of_task: np.ndarray          # (K_tasks,) shard index
    tokens: tuple[np.ndarray, ...]     # per shard: weights' token ids
    experts: tuple[np.ndarray, ...]    # per shard: expert indices

    @staticmethod
    def make(taskset: TaskSet, weights: Weights, tmap: np.ndarray, n: int) -> "Plan":
        work = np.array([max(t.n_facts, 1) * max(sum(len(tp.parts) for tp in t.templates), 1)
                         for t in taskset.tasks], np.int64)
        n = max(1, min(n, work.size))
        load = np.zeros(n, np.int64)
        shard = np.zeros(work.size, np.int64)
        for k in np.argsort(-work, kind="stable"):
            s = int(np.argmin(load))
            shard[k] = s
            load[s] += work[k]
        words = np.arange(taskset.vocabulary.n_words, dtype=np.int64)
        expert_of = {name: k for k, name in enumerate(weights.expert_tasks) if name}
        tokens, experts = [], []
        for s in range(n):
            members = np.flatnonzero(shard == s)
            ents = [words]
            for k in members:
                subj, obj = taskset.fact_ids[k]
                ents += [subj, obj]
            tokens.append(distinct_ids(tmap[np.concatenate(ents)]))
            experts.append(np.array(sorted(expert_of[taskset.tasks[k].name] for k in members
                                           if taskset.tasks[k].name in expert_of), np.int64))
        return Plan(shard, tuple(tokens), tuple(experts))

    @property
    def n(self) -> int:
        return len(self.tokens)

    def split(self, batch) -> list[tuple[int, np.ndarray]]:
        """(shard, rows) covering the batch: each row goes to the shard of its first consistent task."""
        counts = np.diff(batch.allowed_ptr)
        first = batch.allowed[np.minimum(batch.allowed_ptr[:-1], max(batch.allowed.size - 1, 0))] \
            if batch.allowed.size else np.zeros(counts.size, np.int64)
        shard = np.where(counts > 0, self.shard_of_task[first], 0)   # (every query has a consistent task)
        out = []
        for s in np.unique(shard):
            out.append((int(s), np.flatnonzero(shard == s)))
        return out
