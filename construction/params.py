"""The construction's free parameters.

* β (``beta``): inverse temperature of every attention head. Each head puts weight
  e^β/(e^β + p) on the position it looks for at a prefix of length p; the rest,
  δ_p = p/(e^β + p), leaks.
* γ (``gamma``): scale of the unembedding; the right tokens win the final softmax by
  a logit margin proportional to γ.
"""

from __future__ import annotations

import sympy

BETA = sympy.Symbol("beta", positive=True)
GAMMA = sympy.Symbol("gamma", positive=True)
PARAMETERS = (BETA, GAMMA)
BY_NAME = {"beta": BETA, "gamma": GAMMA}

#: Weight of the subject-membership evidence in the gate (see construction.gate).
LAMBDA = sympy.Rational(1, 2)
