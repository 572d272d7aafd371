"""One mixture-of-experts layer as the compiled kernels read it: its gate and its experts.

A layer is a gate W_G, b_G over the residual directions and experts k, each
y ↦ W_2 ReLU(W_1 y + b_1) (:mod:`layout`). The kernels (:mod:`verifier.arithmetic.gate`,
:mod:`verifier.arithmetic.experts`) take it as plain arrays, built here once per layer:

* the gate: W_G^T as CSR (a row per residual direction), per direction the largest |W_G[k, j]|
  (the gate radius's row bound), the directions read by at least :data:`HOT_READERS` experts
  (their part of the scores is shared by rows: the gate's classes), b_G, and the most terms
  of a score (γ of the rounding bound);
* the experts side by side: neuron g of expert k is global neuron off[k] + g; W_1^T as CSR
  (each row sorted by global neuron), W_2^T (a row per global neuron), the biases b_1, and
  the neurons of positive bias per expert (as CSR: a neuron no entry of a row reaches is on
  exactly when its bias is positive).

The one-layer pass (:class:`verifier.passes.forward.Prepared`) holds one; a stack of layers
(:mod:`verifier.passes.layers`) one per layer. Building the tables changes no value: every
array is the weights' own entries, reordered.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from verifier.arithmetic import interval as I

#: A residual direction read by at least this many rows of W_G is "hot" (gate.gate).
HOT_READERS = 16


def csr_arrays(M: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indptr, indices, data) of a canonical CSR matrix as int64/float64 arrays."""
    M = sp.csr_matrix(M)
    M.sort_indices()
    return (M.indptr.astype(np.int64), M.indices.astype(np.int64), M.data.astype(np.float64))


@dataclass(frozen=True, eq=False)
class LayerTables:
    """A layer's gate and experts as the kernels' arrays (module docstring)."""

    WGT: tuple[np.ndarray, np.ndarray, np.ndarray]      # W_G^T as CSR
    wg_colmax: np.ndarray                               # (d,) max_k |W_G[k, j]| (0: no expert reads j)
    wg_hot: np.ndarray                                  # (d,) bool: read by >= HOT_READERS experts
    b_G: np.ndarray                                     # (K,)
    wg_max_terms: int                                   # the most entries of a row of W_G (at least gate_terms)
    off: np.ndarray                                     # (K + 1,) where each expert's neurons start
    W1T: tuple[np.ndarray, np.ndarray, np.ndarray]      # W_1^T of all experts as CSR
    W2T: tuple[np.ndarray, np.ndarray, np.ndarray]      # W_2^T of all experts as CSR
    b1: np.ndarray                                      # every neuron's bias
    pos_ptr: np.ndarray                                 # positive-bias neurons per expert (CSR)
    pos_idx: np.ndarray
    max_width: int                                      # the widest expert (1 if none is wider)

    @classmethod
    def of(cls, W_G, b_G, experts, d: int, gate_terms: int = 0) -> "LayerTables":
        """The tables of gate (W_G, b_G) and ``experts`` over d residual directions;
        ``gate_terms`` a lower limit for the most terms of a score (:class:`Prepared`)."""
        WGT = csr_arrays(sp.csr_matrix(W_G).T.tocsr())
        WG = I.as_csr(W_G)
        colmax = np.zeros(d)
        np.maximum.at(colmax, WG.indices, np.abs(WG.data))
        max_terms = max(int(np.diff(WG.indptr).max(initial=1)), int(gate_terms))
        hot = np.diff(WGT[0]) >= HOT_READERS
        widths = np.array([e.width for e in experts], np.int64)
        off = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        W1 = sp.vstack([e.W_1 for e in experts]).tocsr() if widths.sum() else sp.csr_matrix((0, d))
        W1T = csr_arrays(W1.T.tocsr())
        del W1
        W2T = csr_arrays(sp.hstack([e.W_2 for e in experts]).T.tocsr() if widths.sum() else sp.csr_matrix((0, d)))
        b1 = np.concatenate([e.b_1 for e in experts]) if widths.sum() else np.zeros(0)
        pos = [np.flatnonzero(e.b_1 > 0) + off[k] for k, e in enumerate(experts)]
        pos_ptr = np.concatenate([[0], np.cumsum([x.size for x in pos])]).astype(np.int64)
        pos_idx = np.concatenate(pos).astype(np.int64) if pos else np.zeros(0, np.int64)
        return cls(WGT, colmax, hot, np.asarray(b_G, np.float64), max_terms, off, W1T, W2T,
                   np.asarray(b1, np.float64), pos_ptr, pos_idx, int(widths.max(initial=1)))

    @property
    def K(self) -> int:
        return int(self.b_G.size)

    @property
    def first(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The experts kernels' ``first`` argument: (off, b1, pos_ptr, pos_idx)."""
        return self.off, self.b1, self.pos_ptr, self.pos_idx
