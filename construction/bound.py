"""The worst-case next-token error in closed form, and parameters that certify ε.

Notation: V = |vocabulary|, L = largest template length, δ = δ_{L−1} =
(L−1)/(e^β + L−1) the largest leak of a structure head, δ_S = e^−β the largest leak
of the subject head at a prefix with one entity (construction.heads), and

    c_T = 1 − 2(L−1)δ        lower bound on a firing template neuron (experts)
    c_D = 1 − 2δ_S           lower bound on the subject's dictionary neuron at an object query

**Theorem.** If δ < 1/2, δ_S < 1/2 and routing is as designed (δ below the gate's
condition, construction.gate), every query's error 1 − P(valid next tokens) is at most

    ε(β, γ) = max( (e^γ + V − 2) / (e^{2γ c_T} + e^γ + V − 2),
                   (V − 1) / (e^{γ c_D} + V − 1) ).

*Proof.* The query is routed to a consistent task k (gate), and only expert k writes
``next:``; the logit of token t is γ·next:t (embedding). Exactly one template
neuron of k can fire (experts: different structures exclude each other) and it
writes 2 on valid tokens only, since every token that follows σ in task k follows
this prefix in a sentence of k (k is consistent). Dictionary neurons:

1. *Before ⋆1* (no entity): none fires. A template neuron fires (σ is followed by a
   word or ⋆1 in k) with activation >= c_T: >= 1 valid token has logit >= 2γc_T, the
   other <= V − 1 tokens have logit 0. Error <= (V−1)/(e^{2γc_T} + V − 1).
2. *Between ⋆1 and ⋆2, not an object query*, and *past ⋆2*: as in 1, plus at most one
   dictionary neuron (the subject's) writing <= γ on one possibly invalid token.
   Error <= (e^γ + V − 2)/(e^{2γc_T} + e^γ + V − 2), which also bounds case 1.
3. *Object query*: the prefix holds one entity, the subject s, so subj:s >= 1 − δ_S
   (construction.heads) and the subject's dictionary neuron writes γ·c_D or more on
   D_k(s), which is valid; any other write is a template neuron's, on valid tokens;
   every other token has logit 0. Error <= (V−1)/(e^{γ c_D} + V − 1).

Each error has the form a/(a + b) with a the invalid mass (bounded above) and b the
valid mass (bounded below), and a/(a+b) increases in a and decreases in b. ∎

:func:`parameters_for` returns β (the smallest integer meeting the gate and neuron
conditions with c_T >= 3/4) and the smallest γ on a 1/16 grid with ε(β, γ) < ε, found
by bisection on the closed form evaluated in interval arithmetic (mpmath.iv), so the
inequality is proven, not just computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import sympy
from mpmath.ctx_iv import MPIntervalContext

from construction.params import BETA, GAMMA


def leak(L: int, beta=BETA):
    """δ_{L−1} = (L−1)/(e^β + L−1)."""
    return sympy.Integer(L - 1) / (sympy.exp(beta) + L - 1)


def subject_leak(beta=BETA):
    """δ_S = e^−β: the subject head's leak at a prefix with one entity (construction.heads)."""
    return sympy.exp(-beta)


def error_bound(L: int, V: int, beta=BETA, gamma=GAMMA) -> sympy.Expr:
    """ε(β, γ) as a sympy expression (see the module docstring): the maximum of the two
    cases as written (sympy does not try to order them; its printer sorts the two)."""
    d = leak(L, beta)
    c_T = 1 - 2 * (L - 1) * d
    c_D = 1 - 2 * subject_leak(beta)
    word = (sympy.exp(gamma) + V - 2) / (sympy.exp(2 * gamma * c_T) + sympy.exp(gamma) + V - 2)
    obj = sympy.Integer(V - 1) / (sympy.exp(gamma * c_D) + V - 1)
    return sympy.Max(word, obj, evaluate=False)


def _interval_context() -> MPIntervalContext:
    """A private mpmath interval context (120 bits), so no global precision changes."""
    ctx = MPIntervalContext()
    ctx.prec = 120
    return ctx


def _bound_iv(L: int, V: int, beta: Fraction, gamma: Fraction):
    """Interval enclosure of ε(β, γ) with mpmath.iv (outward rounding)."""
    iv = _interval_context()
    b = iv.mpf([beta.numerator, beta.numerator]) / beta.denominator
    g = iv.mpf([gamma.numerator, gamma.numerator]) / gamma.denominator
    d = (L - 1) / (iv.exp(b) + (L - 1))
    c_T = 1 - 2 * (L - 1) * d
    c_D = 1 - 2 / iv.exp(b)
    word = (iv.exp(g) + (V - 2)) / (iv.exp(2 * g * c_T) + iv.exp(g) + (V - 2))
    obj = iv.mpf(V - 1) / (iv.exp(g * c_D) + (V - 1))
    return word, obj


def bound_upper(L: int, V: int, beta: Fraction, gamma: Fraction) -> float:
    """A proven upper bound on ε(β, γ) (rounded up to a float)."""
    word, obj = _bound_iv(L, V, Fraction(beta), Fraction(gamma))
    return float(max(word.b, obj.b)) * (1 + 2 ** -50)


def leak_upper(L: int, beta: Fraction) -> float:
    iv = _interval_context()
    beta = Fraction(beta)
    b = iv.mpf([beta.numerator, beta.numerator]) / beta.denominator
    return float(((L - 1) / (iv.exp(b) + (L - 1))).b) * (1 + 2 ** -50)


def subject_leak_upper(beta: Fraction) -> float:
    """A proven upper bound on δ_S = e^−β."""
    iv = _interval_context()
    beta = Fraction(beta)
    b = iv.mpf([beta.numerator, beta.numerator]) / beta.denominator
    return float((1 / iv.exp(b)).b) * (1 + 2 ** -50)


def unproven_conditions(L: int, beta: Fraction, delta_max_gate: Fraction | None) -> list[str]:
    """The theorem's side conditions (module docstring) not proven at β, each as a phrase;
    none: they hold, and ε(β, γ) is a proven upper bound on every query's error. Each leak's
    proven upper bound (a float, compared as the exact fraction it is) is compared with the
    exact limit, so a condition not listed is proven; one listed may still hold by a hair,
    but nothing here proves it. ``delta_max_gate`` None: the gate's condition is not
    looked at (only the others are)."""
    d, d_s = leak_upper(L, Fraction(beta)), subject_leak_upper(Fraction(beta))
    out = []
    if delta_max_gate is not None and not Fraction(d) < Fraction(delta_max_gate):
        out.append(f"the gate needs leak delta < {float(delta_max_gate):.3g}, and delta is up to {d:.3g}")
    if not Fraction(d) < Fraction(1, 2):
        out.append(f"the neurons need leak delta < 1/2, and delta is up to {d:.3g}")
    if not Fraction(d_s) < Fraction(1, 2):
        out.append(f"the subject head needs e^-beta < 1/2, and it is up to {d_s:.3g}")
    return out


@dataclass(frozen=True)
class Choice:
    beta: Fraction
    gamma: Fraction
    bound: float          # proven upper bound on ε(β, γ)
    delta: float          # proven upper bound on the leak δ_{L−1}


def smallest_beta(L: int, delta_max: Fraction) -> Fraction:
    """Smallest integer β with δ_{L−1} < delta_max and c_T >= 3/4."""
    cap = min(Fraction(delta_max), Fraction(1, 8 * max(L - 1, 1)))
    beta = 1
    while leak_upper(L, Fraction(beta)) >= cap:
        beta += 1
    return Fraction(beta)


def smallest_gamma(L: int, V: int, beta: Fraction, epsilon: float, grid: int = 16) -> Fraction:
    """Smallest γ on a 1/grid lattice with a proven ε(β, γ) < ε (the bound decreases in γ)."""
    lo, hi = 0, grid
    while bound_upper(L, V, beta, Fraction(hi, grid)) >= epsilon:
        lo, hi = hi, hi * 2
        if hi > grid * 10_000:
            raise ValueError(f"no γ reaches ε = {epsilon} at β = {beta}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bound_upper(L, V, beta, Fraction(mid, grid)) < epsilon:
            hi = mid
        else:
            lo = mid
    return Fraction(hi, grid)


def parameters_for(L: int, V: int, epsilon: float, delta_max: Fraction) -> Choice:
    beta = smallest_beta(L, delta_max)
    gamma = smallest_gamma(L, V, beta, epsilon)
    return Choice(beta, gamma, bound_upper(L, V, beta, gamma), leak_upper(L, beta))
