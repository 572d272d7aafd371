"""Certified results for any prefixes: the verifier's public per-query API.

:func:`verify` (:mod:`verifier.checks.verify`) enumerates a task set's queries and aggregates;
:func:`certify` answers for prefixes you choose, one result per prefix, in your order::

    import layout
    from verifier.checks.certify import certify

    w = layout.load("model.npz")
    res = certify(w, [["the", "capital", "of", "France", "is"]], [["Paris"]], ablate=True)
    res.err_hi[0]      # an upper bound of 1 − P(Paris | the capital of France is)
    res.margin[0] > 0  # the gate's winner res.expert[0] is certified unique

Every number is an enclosure of the exact forward pass of :mod:`layout` (the same
certified pass :func:`verify` runs): ``gate_lo <= g <= gate_hi`` per expert,
``err_lo <= 1 − P(valid) <= err_hi`` (over every expert that may win the gate),
``ablated_lo <= error with the routed expert's output removed <= ablated_hi`` (when
``ablate``), and ``margin <= g_e − max_{k != e} g_k`` for the reported ``expert`` e. With
``ablate``, a prefix with exactly one valid next token o (an object query) also gets
``ablated_gap <= max_{t != o} z_t − z_o``, z the logits with the routed expert's output
removed (>= 0: o is not the strict top token without its expert; the localization check's
L2, docs/verification.md); NaN otherwise.

Prefixes are sequences of token strings (matched by exact string) or of the weights'
token ids; BOS is added. ``valid`` gives each prefix's valid next tokens the same way.
For many calls on the same weights, :func:`prepare` them once and pass the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np

from layout import Weights
from tasks.errors import TaskError
from verifier.passes.dense import DensePass, is_dense
from verifier.passes.forward import Prepared

CHUNK = 20_000


def prepare(weights: Weights) -> Prepared | DensePass:
    """Validate the weights and compute their per-token projections (reusable): the pass
    :func:`verifier.checks.verify.verify` runs on them, the dense one for dense weights
    (:func:`verifier.passes.dense.is_dense`)."""
    return DensePass(weights) if is_dense(weights) else Prepared(weights)


@dataclass(frozen=True)
class Certified:
    """Certified results for n prefixes, in the order given."""

    expert: np.ndarray       # (n,) the gate's winner (argmax of the midpoints)
    margin: np.ndarray       # (n,) lower bound of g_e − max_{k != e} g_k (> 0: certified unique winner)
    gate_lo: np.ndarray      # (n, K) enclosures of the gate scores
    gate_hi: np.ndarray
    err_lo: np.ndarray       # (n,) enclosure of 1 − P(valid next tokens)
    err_hi: np.ndarray
    ablated_lo: np.ndarray   # (n,) the same with the routed expert's output removed (NaN unless ablate)
    ablated_hi: np.ndarray
    predicted: np.ndarray    # (n,) token id with the largest logit midpoint (-1: a token whose logit is 0)
    # (n,) lower bound of max_{t != o} z_t − z_o without the expert (NaN unless ablate, one valid o)
    ablated_gap: np.ndarray

    def __len__(self) -> int:
        return self.expert.shape[0]


def _ids(weights: Weights, tokens, what: str) -> np.ndarray:
    tokens = list(tokens)
    if tokens and all(isinstance(t, str) for t in tokens):
        return weights.token_ids(tokens, what)
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    V = len(weights.vocab)
    if ids.size and (ids.min() < 0 or ids.max() >= V):
        raise TaskError(f"{what}: token id {int(ids[(ids < 0) | (ids >= V)][0])} is not in the vocabulary (0..{V - 1})")
    return ids


def certify(weights: Weights | Prepared | DensePass, prefixes: Sequence[Sequence], valid: Sequence[Collection], *,
            ablate: bool = False, chunk: int = CHUNK) -> Certified:
    """Run the certified forward pass on each prefix (see the module docstring)."""
    prep = weights if isinstance(weights, (Prepared, DensePass)) else prepare(weights)
    w = prep.weights
    if len(prefixes) != len(valid):
        raise TaskError(f"{len(prefixes)} prefixes but {len(valid)} sets of valid next tokens")
    rows = [_ids(w, p, "prefix") for p in prefixes]
    vals = [np.unique(_ids(w, v, "valid next tokens")) for v in valid]
    lengths = np.array([r.size for r in rows], np.int64)
    if lengths.size and lengths.min() == 0:
        raise TaskError("the empty prefix is not a query", fix="give at least one token")
    if lengths.size and lengths.max() >= w.n_positions:
        raise TaskError(f"a prefix has {int(lengths.max())} tokens; the weights take at most {w.n_positions - 1}")
    n, K = len(rows), len(w.experts)
    out = {name: np.full(n, np.nan) for name in ("margin", "err_lo", "err_hi", "ablated_lo", "ablated_hi",
                                                 "ablated_gap")}
    expert, predicted = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    gate_lo, gate_hi = np.full((n, K), np.nan), np.full((n, K), np.nan)
    for p in np.unique(lengths):
        idx_p = np.flatnonzero(lengths == p)
        for lo in range(0, idx_p.size, chunk):
            idx = idx_p[lo: lo + chunk]
            tokens = np.stack([rows[i] for i in idx])
            ptr = np.concatenate([[0], np.cumsum([vals[i].size for i in idx])]).astype(np.int64)
            flat = np.concatenate([vals[i] for i in idx]) if ptr[-1] else np.zeros(0, np.int64)
            target = np.array([vals[i][0] if vals[i].size == 1 else -1 for i in idx], np.int64)
            res = prep.run_batch(tokens, ptr, flat, ablate=np.full(idx.size, ablate), target=target)
            expert[idx], predicted[idx] = res.expert, res.predicted
            out["margin"][idx], out["err_lo"][idx], out["err_hi"][idx] = res.margin, res.err_lo, res.err_hi
            out["ablated_lo"][idx], out["ablated_hi"][idx] = res.ablated_lo, res.ablated_hi
            if res.ablated_gap is not None:
                gap = np.asarray(res.ablated_gap, dtype=float)
                out["ablated_gap"][idx] = np.where((target >= 0) & ablate, gap, np.nan)
            gate_lo[idx], gate_hi[idx] = res.gate_lo, res.gate_hi
    return Certified(expert, out["margin"], gate_lo, gate_hi, out["err_lo"], out["err_hi"], out["ablated_lo"],
                     out["ablated_hi"], predicted, out["ablated_gap"])
