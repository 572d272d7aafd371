"""Regression test: gate scores that overflow float64 must not certify routing.

Found by mutation testing. The weights are finite, but the exact gate scores
are about ±3e308, beyond float64: the verifier's gate midpoints become ±inf, the lower
(or upper) ends NaN, and the certified margin NaN. Since commit 4c824a6
``BatchResult.ambiguous`` is ``margin <= 0``, which is False for NaN, so the query
counts as certainly routed to ``argmax`` of the midpoints (the first of two infs),
and ``cand = g_hi >= g_lo[e]`` (also False for NaN) leaves the true winner out of the
error check. The exact forward pass (60 digits, :mod:`audit.exact`) routes every
query to the unnamed shadow expert, whose output is zero, and errs by 5/6.
The verifier before 4c824a6 used ``margin > 0`` and rejected this model.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from construction.model import build
from tasks.model import Task, TaskSet
from audit.exact import exact_forward
from layout import Expert, Weights
from verifier.checks.verify import verify


def overflowing_gate(sign: float) -> tuple[TaskSet, Weights]:
    """One task; expert 1 is an unnamed copy of expert 0 with W_2 = 0; both gate rows ~ sign·3e308."""
    ts = TaskSet((Task("a", ("x ⋆1 y ⋆2",), {"A": "B", "C": "D"}),), epsilon=0.01)
    w = build(ts).instantiate()
    e0 = w.experts[0]
    shadow = Expert(e0.W_1, e0.b_1, sp.csr_matrix(e0.W_2.shape))
    W_G = np.zeros((2, w.d))
    cols = [i for i, label in enumerate(w.residual_labels) if label == "one" or label.startswith("pos:")]
    W_G[:, cols] = sign * 1.5e308   # 'one' + the position one-hot: every exact score is sign·3e308 (+ bias)
    b_G = np.array([0.0, 1e300])      # expert 1 (the shadow) wins by 1e300 on every query
    return ts, w.replace(experts=(e0, shadow), W_G=sp.csr_matrix(W_G), b_G=b_G,
                         expert_tasks=("a", ""), neuron_labels=None)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_exact_pass_routes_to_the_shadow(sign):
    ts, w = overflowing_gate(sign)
    vocab = ts.vocabulary
    ex = exact_forward(w, [vocab.id("x"), vocab.id("A"), vocab.id("y")], {vocab.id("B")})
    assert ex["expert"] == 1 and ex["gates"][1] - ex["gates"][0] > 1e299
    assert ex["error"] > 0.8  # 5/6: the shadow's output is zero


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_overflowing_gate_is_not_certified(sign):
    ts, w = overflowing_gate(sign)
    with np.errstate(all="ignore"):
        report = verify(ts, w, 0.01)
    assert not report.certified
