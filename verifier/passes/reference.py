"""A plain float64 forward pass, written straight from the layout's equations.

Uncertified: a quick reference in tests and in ``explain``.
The verifier's certified pass is :mod:`verifier.passes.forward`.
"""

from __future__ import annotations

import numpy as np

from layout import Weights


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def forward(weights: Weights, token_ids: list[int], expert_mask: np.ndarray | None = None):
    """Next-token distribution after the prefix ``token_ids`` (weights' token ids).

    Returns (probabilities over the vocabulary, chosen expert, gate scores).
    ``expert_mask`` (bool per expert) zeroes the output of the masked experts (ablation).
    """
    ids = [weights.bos] + list(token_ids)
    n = len(ids)
    H = weights.E[ids].toarray() + weights.P[:n].toarray()
    R = H.copy()
    for head in weights.heads:
        Q = H @ head.W_Q.T.toarray()
        Kt = H @ head.W_K.T.toarray()
        S = Q @ Kt.T
        S = np.where(np.tril(np.ones((n, n), bool)), S, -np.inf)
        A = softmax(S)
        R += (A @ (H @ head.W_V.T.toarray())) @ head.W_O.T.toarray()
    r = R[-1]
    g = weights.W_G @ r + weights.b_G
    e = int(np.argmax(g))
    ex = weights.experts[e]
    out = ex.W_2 @ np.maximum(ex.W_1 @ r + ex.b_1, 0.0)
    if weights.gate_mode == "top1-scaled":
        out = softmax(g)[e] * out
    if expert_mask is not None and expert_mask[e]:
        out = np.zeros_like(out)
    y = r + out
    return softmax(weights.U @ y), e, g
