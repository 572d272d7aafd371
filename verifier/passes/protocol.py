"""The pass protocol: what a certified forward pass of fixed weights offers whoever runs it.

Every certified pass runs a batch of queries the same way: the exact pass
(:class:`verifier.passes.forward.Prepared`), the exact pass factored over cohorts
(:class:`verifier.passes.factored.FactoredPass`) and the deployed pass of a floating-point
format (:func:`verifier.passes.forward.FloatPass`). :mod:`verifier.running` builds a pass
for some weights and runs batches through it by this protocol alone.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from verifier.passes.forward import BatchResult


class Pass(Protocol):
    """A certified forward pass of fixed weights (:mod:`verifier.passes.forward`: the exact pass;
    :mod:`verifier.passes.floating`: every execution in a floating-point format)."""

    def run_batch(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
                  ablate: np.ndarray | None = None, scores: bool = True,
                  target: np.ndarray | None = None) -> BatchResult: ...
