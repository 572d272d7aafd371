"""Token and position embeddings, and the unembedding.

Embedding (exact, no parameters)::

    E[word w]   = one + word:w
    E[entity e] = one + entity + id:e
    E[BOS]      = one
    P[i]        = pos:i                     i = 0 .. L-1

Unembedding: ``U = γ · Σ_t  t ⊗ next:t``, i.e. the logit of token t is γ times the
``next:t`` coordinate of the final residual. Only the experts write ``next:``, so
logits are γ times the expert's evidence, exactly.
"""

from __future__ import annotations

import numpy as np

from construction.bases import Space, block
from construction.params import GAMMA
from construction.symbolic import SymMatrix
from tasks.model import TaskSet


def token_space(taskset: TaskSet) -> Space:
    """Rows of E: the vocabulary, then BOS."""
    return Space.of(block("token", taskset.vocabulary.tokens + ("<BOS>",)))


def position_space(taskset: TaskSet) -> Space:
    return Space.of(block("position", range(taskset.L)))


def vocabulary_space(taskset: TaskSet) -> Space:
    return Space.of(block("token", taskset.vocabulary.tokens))


def embedding(taskset: TaskSet, residual: Space) -> SymMatrix:
    rows = token_space(taskset)
    vocab = taskset.vocabulary
    W, V = vocab.n_words, vocab.size
    one, entity = residual.index("one", ""), residual.index("entity", "")
    words = np.arange(W)
    ents = np.arange(W, V)
    r = np.concatenate([np.arange(V + 1), words, ents, ents])  # one (BOS too), word:w, entity, id:e
    c = np.concatenate([
        np.full(V + 1, one),
        residual.offset("word") + words,
        np.full(V - W, entity),
        residual.offset("id") + (ents - W),
    ])
    return SymMatrix.build(rows, residual, (r, c, np.ones(r.size)))


def positions(taskset: TaskSet, residual: Space) -> SymMatrix:
    L = taskset.L
    return SymMatrix.build(position_space(taskset), residual,
                           (list(range(L)), residual.indices("pos", range(L)), [1.0] * L))


def unembedding(taskset: TaskSet, residual: Space) -> SymMatrix:
    V = taskset.vocabulary.size
    cols = residual.offset("next") + np.arange(V)          # the block "next", in token order
    assert len(residual.span("next")) == V
    return SymMatrix.build(vocabulary_space(taskset), residual, (np.arange(V), cols, np.ones(V)), GAMMA)
