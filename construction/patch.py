"""The model of an edited task set, built from the previous model's weights: only what the edit changes.

An edit of facts (templates, task order and parameters unchanged) changes, in the
construction's model:

* the **vocabulary** (new entities, entities no task uses any more), hence ``E``, ``U``,
  the subject head's value and output maps and the ``id``, ``subj`` and ``next`` blocks
  of the residual: these depend on the vocabulary alone and are built again (O(|V|));
* the **gate**: the closed-form gate's rows are the task's structure features F_k (from
  its templates, unchanged), λ on the subjects of task k, and the tie-break η_k (from the
  task's index and K, unchanged): built again from the task set's fact arrays (O(facts),
  no routing cells); a gate found by the linear programme would have to be found again,
  so then the whole model is built (``None`` here);
* **expert k of an edited task**: built again from task k (construction.experts);
* every other expert is the previous one with its residual coordinates renumbered (the
  expert of task j depends on task j alone: the isolation check of construction.evidence).

When the edit leaves the vocabulary as it was (objects changed to entities in use, and no
entity left unused), the residual is the same space, so ``E``, ``P``, the heads and ``U``
(functions of the vocabulary, the templates, β and γ) are the previous model's arrays
themselves; when, besides, every task keeps its subjects, so is the gate (its rows read
the templates and the subjects only). Nothing is renumbered then, and the diff of the two
models finds those arrays equal at once (the same objects).

The result equals ``build(new task set, β, γ).instantiate()`` array for array (tested); it
only costs time in proportion to the vocabulary, the facts' arrays and the edited tasks.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import scipy.sparse as sp

from construction.embedding import embedding, positions, unembedding
from construction.experts import SymExpert, build_expert
from construction.gate import _assemble, features, task_features
from construction.heads import heads as make_heads
from construction.params import BETA, GAMMA, LAMBDA
from construction.residual import residual_space
from layout import Expert, Head, Weights
from tasks.model import TaskSet
from tasks.structure import structure_of


def _renumber(m: sp.spmatrix, rows: np.ndarray | None, cols: np.ndarray | None, shape: tuple[int, int]) -> sp.spmatrix:
    """``m`` with its row and column indices mapped (increasing maps keep canonical order);
    its values and pointers are shared, not copied (nothing writes into a model's arrays:
    the checked ones are read-only, ``layout.weights.sparse_problem``)."""
    if m.format == "csr":
        assert rows is None
        indices, cls, n_minor = (cols[m.indices] if cols is not None else m.indices), sp.csr_matrix, shape[1]
    else:
        assert cols is None
        indices, cls, n_minor = (rows[m.indices] if rows is not None else m.indices), sp.csc_matrix, shape[0]
    if n_minor <= np.iinfo(m.indices.dtype).max:      # the old index type: scipy then keeps the pointers given
        indices = indices.astype(m.indices.dtype, copy=False)
    return cls((m.data, indices, m.indptr), shape=shape)


def _same_vocabulary(a: TaskSet, b: TaskSet) -> bool:
    va, vb = a.vocabulary, b.vocabulary
    return va.words == vb.words and np.array_equal(va.entity_array, vb.entity_array)


def _gate(ts: TaskSet, residual) -> tuple:
    """The closed-form gate (construction.gate): structure features, λ on the subjects, η."""
    trie = structure_of(ts)
    K = len(ts.tasks)
    index, _ = features(ts, trie)
    F_k = task_features(ts, trie, index)
    q = max(1, int(np.ceil(np.log2(max(K, 2)))))
    eta = (K - 1 - np.arange(K)) * 2.0 ** -(q + 2)
    return _assemble(ts, residual, index, F_k, eta, np.full(K, float(LAMBDA)))


def patched_weights(old: Weights, old_ts: TaskSet, new_ts: TaskSet, edited: set[str], beta: Fraction,
                    gamma: Fraction, epsilon: float,
                    memo: dict | None = None) -> tuple[Weights, dict[str, SymExpert]] | None:
    """The new model's weights (module docstring) and the edited tasks' symbolic experts, or
    None when the previous model's gate was not the closed form. ``memo``: as in
    :func:`construction.numbering.space_map`."""
    if (old.parameters or {}).get("gate") != "closed form":
        return None
    if old_ts.names != new_ts.names or any(a.templates != b.templates for a, b in zip(old_ts.tasks, new_ts.tasks)):
        return None
    values = {BETA: float(beta), GAMMA: float(gamma)}
    num = lambda m: m.numeric(values)  # noqa: E731
    residual = residual_space(new_ts)
    old_residual = residual_space(old_ts)
    from construction.numbering import space_map
    cmap = space_map(old_residual, residual, memo)
    d = residual.dim
    K = len(new_ts.tasks)
    same_space = old.d == d and np.array_equal(cmap, np.arange(d))     # every coordinate where it was
    experts, symbolic = [], {}
    for k, task in enumerate(new_ts.tasks):
        if task.name in edited:
            e = build_expert(new_ts, k, residual)
            symbolic[task.name] = e
            experts.append(Expert(num(e.W_1), np.asarray(num(e.b_1).toarray()).reshape(-1), num(e.W_2)))
        else:
            o = old.experts[k]
            if same_space:
                experts.append(o)
                continue
            if (cmap[o.W_1.indices] < 0).any() or (cmap[o.W_2.indices] < 0).any():
                return None                    # an unedited expert reads a coordinate that is gone: not a facts edit
            experts.append(Expert(_renumber(o.W_1, None, cmap, (o.W_1.shape[0], d)), o.b_1,
                                  _renumber(o.W_2, cmap, None, (d, o.W_2.shape[1]))))
    W_G_num = b_G_num = None
    same_values = same_space and old.parameters.get("beta") == str(beta) \
        and old.parameters.get("gamma") == str(gamma) and _same_vocabulary(old_ts, new_ts)
    if same_values:
        E, P, heads, U = old.E, old.P, old.heads, old.U
        if all(np.array_equal(a[0], b[0]) for a, b in zip(old_ts.fact_ids, new_ts.fact_ids)):
            W_G_num, b_G_num = old.W_G, old.b_G
    else:
        E, P, U = num(embedding(new_ts, residual)), num(positions(new_ts, residual)), num(unembedding(new_ts, residual))
        heads = tuple(Head(num(h.W_Q), num(h.W_K), num(h.W_V), num(h.W_O)) for h in make_heads(new_ts, residual))
    if W_G_num is None:
        W_G, b_G = _gate(new_ts, residual)
        W_G_num, b_G_num = num(W_G), np.asarray(num(b_G).toarray()).reshape(-1)
    widths = [e.width for e in experts]
    neuron_labels = None
    if sum(widths) <= 200_000:
        from construction.numbering import neuron_space
        neuron_labels = tuple(tuple(neuron_space(new_ts, k).blocks[0].labels) for k in range(K))
    vocab = new_ts.vocabulary.tokens
    if same_values and old.vocab == vocab:
        vocab = old.vocab                     # the same tuple: what was checked of it stays known
    fields = dict(
        vocab=vocab, E=E, P=P, heads=heads, W_G=W_G_num, b_G=b_G_num,
        experts=tuple(experts), U=U,
        expert_tasks=new_ts.names, gate_mode="top1",
        residual_labels=tuple(residual.labels()) if residual.dim <= 200_000 else None,
        neuron_labels=neuron_labels,
        parameters={"beta": str(beta), "gamma": str(gamma), "epsilon": epsilon, "gate": "closed form"},
    )
    w = old.replace(**fields) if vocab is old.vocab else Weights(**fields)
    return w, symbolic
