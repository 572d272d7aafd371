"""The weight layout: a single-layer MoE transformer as data (arrays, labels, load/save).

Both the construction (which produces weights) and the verifier (which checks them)
depend on this package; it depends on neither. :mod:`layout.weights` defines the arrays
and their rules, :mod:`layout.npz` the file format.
"""

from layout.npz import FORMAT, load, save, to_arrays
from layout.weights import GATE_MODES, Expert, Head, Weights, canonical, csr_problem, sparse_problem, vector_problem

__all__ = ["FORMAT", "GATE_MODES", "Expert", "Head", "Weights", "canonical", "csr_problem",
           "sparse_problem", "vector_problem",
           "load", "save", "to_arrays"]
