"""The attention heads: structure heads (one per position) and the subject head.

Notation: a query is a prefix of length p; with BOS the sequence has positions 0..p
and the query position is p. All scores below are exact; the leak is the weight a
head puts on positions other than the one it looks for.

**Structure head m** (m = 1..L-1) reads the symbol at absolute position m.
Query/key space ("at", "before")::

    W_Q: pos:i -> β·at  if i >= m,   β·before  if i < m
    W_K: pos:m -> at,   pos:0 -> before
    W_V: word:w -> w,   entity -> ⋆          W_O: symbol c -> slot<m>:c

So s_ij = β if (i >= m and j = m) or (i < m and j = 0), else 0.

*Claim.* At a prefix of length p, with δ_p = p/(e^β + p) and ν_p = 1/(e^β + p):

* m <= p: head m puts 1-δ_p on position m and ν_p on each other position, so
  slot<m>:c = (1-δ_p)[σ_m = c] + ν_p·#{j <= p, j != m : σ_j = c};
* m > p: head m puts 1-δ_p on BOS (whose value is 0) and ν_p on each token, so
  slot<m>:c = ν_p·#{j <= p : σ_j = c}.

*Proof.* Exactly one of the p+1 visible positions scores β, the others 0; softmax
gives e^β/(e^β+p) and 1/(e^β+p). BOS has no word or entity coordinate, so its value
is 0; every other position's value is the one-hot of its symbol. ∎

In words: each slot block holds the one-hot symbol at its position up to a leak of
total mass δ_p (and is ~0 beyond the prefix), exactly as a function of β and σ.

**Subject head** copies the identity of the *first* entity of the prefix, the subject::

    W_Q: one -> β·first      W_K: entity -> L·first,  pos:j -> −j·first
    W_V: id:e -> e           W_O: e -> subj:e

So s_ij = β·(L·[x_j is an entity] − j): entities score above words and BOS, and among
entities the earlier one scores higher (a positional tie-break).

*Claim.* Let the prefix have length p and its first entity (if any) be at position f.
Every other position j scores at least β below f, so the head puts weight a_f >= 1 − δ_p
on f and at most δ_p on all other positions together. Hence

* no entity: subj = 0 exactly;
* one entity s (⋆1 the last token, or between ⋆1 and ⋆2): subj = a_f·subj:s, with
  a_f ∈ [1 − δ_p, 1];
* two entities, s at f and o after it (past ⋆2): subj:s ∈ [1 − δ_p, 1] and, if o != s,
  subj:o <= δ_p; every other subj coordinate is 0.

*Proof.* An entity at j > f: s_f − s_j = β(j − f) >= β. A word or BOS at j:
s_f − s_j = β(L − f + j) >= β(L − f) >= β, since f <= p <= L − 1 (positions run 0..L−1).
With p other positions each at least β below, a_f >= e^β/(e^β + p) = 1 − δ_p. Words
and BOS have value 0 (W_V reads only ``id``), an entity at j writes a_j·subj:x_j, and
the weights sum to 1. ∎

*Sharper, with one entity.* Then every other position is a word or BOS, and the gaps
s_f − s_j = β(L − f + j) are distinct integers times β, all >= β; so
Σ_{j != f} e^{s_j − s_f} < Σ_{i >= 1} e^{−βi} = 1/(e^β − 1) and a_f > 1 − e^−β = 1 − δ_S,
whatever p and L. (This is the leak the error bound uses at object queries,
construction.bound.)

In words: the subject head reads the subject wherever the prefix stops, past ⋆2
included, with at most the leak δ_p of a structure head (at most e^−β before ⋆2). (Attending to every entity alike
would average subject and object past ⋆2, and tasks that share a template, told apart
only by their subjects, could not be routed there.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from construction.bases import Space, block
from construction.params import BETA
from construction.residual import ENTITY_SYMBOL, symbols
from construction.symbolic import SymMatrix
from tasks.model import TaskSet


@dataclass(frozen=True)
class SymHead:
    name: str
    W_Q: SymMatrix
    W_K: SymMatrix
    W_V: SymMatrix
    W_O: SymMatrix


def structure_head(taskset: TaskSet, residual: Space, m: int) -> SymHead:
    L = taskset.L
    qk = Space.of(block("score", ("at", "before")))
    at, before = 0, 1
    q_rows = [at if i >= m else before for i in range(L)]
    W_Q = SymMatrix.build(qk, residual, (q_rows, residual.indices("pos", range(L)), [1.0] * L), BETA)
    W_K = SymMatrix.build(qk, residual,
                          ([at, before], [residual.index("pos", m), residual.index("pos", 0)], [1.0, 1.0]))
    alphabet = symbols(taskset)
    val = Space.of(block("symbol", alphabet))
    W = len(alphabet) - 1
    v_rows = list(range(W)) + [W]
    v_cols = list(residual.span("word")) + [residual.index("entity", "")]
    W_V = SymMatrix.build(val, residual, (v_rows, v_cols, [1.0] * (W + 1)))
    W_O = SymMatrix.build(residual, val, (residual.indices(f"slot{m}", alphabet), list(range(W + 1)), [1.0] * (W + 1)))
    return SymHead(f"structure{m}", W_Q, W_K, W_V, W_O)


def subject_head(taskset: TaskSet, residual: Space) -> SymHead:
    L = taskset.L
    qk = Space.of(block("score", ("first",)))
    W_Q = SymMatrix.build(qk, residual, ([0], [residual.index("one", "")], [1.0]), BETA)
    positions = list(range(1, L))
    W_K = SymMatrix.build(qk, residual, (
        [0] * (1 + len(positions)),
        [residual.index("entity", "")] + residual.indices("pos", positions),
        [float(L)] + [-float(j) for j in positions]))
    entities = taskset.vocabulary.entities
    n = len(entities)
    val = Space.of(block("entity", entities))
    idx = np.arange(n)
    W_V = SymMatrix.build(val, residual, (idx, residual.offset("id") + idx, np.ones(n)))
    W_O = SymMatrix.build(residual, val, (residual.offset("subj") + idx, idx, np.ones(n)))
    return SymHead("subject", W_Q, W_K, W_V, W_O)


def heads(taskset: TaskSet, residual: Space) -> tuple[SymHead, ...]:
    """Structure heads 1..L-1, then the subject head."""
    return tuple(structure_head(taskset, residual, m) for m in range(1, taskset.L)) + (subject_head(taskset, residual),)


__all__ = ["SymHead", "heads", "structure_head", "subject_head", "ENTITY_SYMBOL"]
