"""What a deployed format's rounding adds to a compiled enclosure, stage by stage.

The deployed pass of a floating-point format (:mod:`verifier.passes.floating`: Lemma F1 and
its ``Stages``) runs the exact pass's kernels with each stage's enclosure widened by that
stage's rounding: ρ times the stage's sum of |terms| (which the kernels accumulate for their
own float64 rounding anyway), the stage's absolute floor (underflow) and its allowance for
inputs read as zero (:func:`zero_read`); a value whose magnitude may reach the format's
largest makes its row undecided. The kernels receive the stages' scalars as one array
``fp`` and the output softmax's (Lemma F2) as ``sm``; the names of their entries, in order,
are defined once, here (:data:`KERNEL_CONSTANTS`, :data:`SOFTMAX_CONSTANTS`): the kernels
read ``fp[KC.rho_z]``, ``sm[SM.tau]``, and :mod:`verifier.passes.floating` builds the arrays
in the same order from the same names.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from verifier.arithmetic.accumulate import F1
from verifier.arithmetic.kernel_forms import kernel
from verifier.arithmetic.rounding import up_nonneg, up_one_plus

#: The stages' scalars the kernels receive (``fp``, an array in this order): attributes of
#: :class:`verifier.passes.floating.Stages` (``k_value`` a property of it).
KERNEL_CONSTANTS = ("e_min", "largest", "rho_h", "f_h", "k_value", "rho_g", "f_g", "rho_z", "f_z", "rho_o", "f_o",
                    "rho_sc", "f_sc", "rho_y", "f_y", "rho_l", "f_l")
#: Each kernel constant's position: ``fp[KC.rho_z]``.
KC = namedtuple("KernelConstantPositions", KERNEL_CONSTANTS)(*range(len(KERNEL_CONSTANTS)))

#: The output softmax's scalars (``sm``, in this order; verifier.passes.floating.softmax_constants):
#: the exps' relative and absolute shift error, their lower and upper factors, and the valid
#: mass's factors and τ (Lemma F2).
SOFTMAX_CONSTANTS = ("rel", "tiny", "lo", "hi", "f_lo", "f_hi", "tau")
#: Each softmax constant's position: ``sm[SM.tau]``.
SM = namedtuple("SoftmaxConstantPositions", SOFTMAX_CONSTANTS)(*range(len(SOFTMAX_CONSTANTS)))

#: The declared type of the experts' and the ablation's ``deployed`` argument: (on, fp, sm,
#: row sums of W_1, of W_2 and of U, each row's Σ|r̂|, a per-token scratch array).
DEPLOYED = ("bool", F1, F1, F1, F1, F1, F1, F1)


@kernel(borrows=True)
def zero_read(fp, l1):
    """The allowance for inputs read as zero, 2·e_min·l1, for a stage whose inputs and
    weights sum to at most ``l1`` in magnitude."""
    return up_nonneg(up_nonneg(2.0 * fp[KC.e_min]) * l1)


@kernel()
def widen(rad, mag, rho, floor, daz, largest):
    """``rad`` widened by a stage's rounding (ρ·mag, mag >= the stage's Σ|terms|), its floor
    and its inputs-read-as-zero allowance; ∞ where the value may reach ``largest``."""
    if not (up_nonneg(up_one_plus(rho) * mag) < largest):
        return np.inf
    return up_nonneg(rad + up_nonneg(up_nonneg(rho * mag) + up_nonneg(floor + daz)))


@kernel(borrows=True)
def widen_residual(r_, hm, vm, fp, rho_or, f_or, cv, rs_o, extra):
    """A residual entry's radius in the deployed pass: the exact enclosure of
    E + P + Σ â·(W_O W_V h) widened by ĥ's rounding (ρ_h·Σ|E|+|P|, plus its floor), the
    value path's (K_value·Σ â_hi·|W_O||W_V||h|, plus the floors ``cv`` carried through W_O)
    and the head outputs' and residual sum's (ρ_or times every term's magnitude, plus its
    floor and the inputs-read-as-zero allowance); ∞ where a magnitude may reach the
    format's largest value."""
    rh, fh, kv = fp[KC.rho_h], fp[KC.f_h], fp[KC.k_value]
    dev = up_nonneg(up_nonneg(up_nonneg(rh * hm) + fh) + up_nonneg(up_nonneg(kv * vm) + cv))
    mag = up_nonneg(up_nonneg(up_nonneg(up_one_plus(rh) * hm) + fh) + up_nonneg(up_nonneg(up_one_plus(kv) * vm) + cv))
    r_ = up_nonneg(r_ + up_nonneg(up_nonneg(dev + up_nonneg(rho_or * mag))
                                  + up_nonneg(up_nonneg(f_or + zero_read(fp, rs_o)) + extra)))
    if not (up_nonneg(up_one_plus(rho_or) * mag) < fp[KC.largest]):
        return np.inf
    return r_


@kernel(borrows=True)
def widen_output(orad, mag, fp, cmax, daz):
    """An expert output coordinate c·(W_2 a) in the deployed pass: the product's rounding
    ρ_o relative to Σ|W_2||c·a| (``mag``), the gate scale's rounding ρ_sc on top, and the
    product's floor and allowance scaled by |c| (``cmax``)."""
    rho = up_nonneg(fp[KC.rho_o] + up_nonneg(fp[KC.rho_sc] * up_one_plus(fp[KC.rho_o])))
    absolute = up_nonneg(up_nonneg(up_nonneg(cmax * up_nonneg(fp[KC.f_o] + daz)) * up_one_plus(fp[KC.rho_sc]))
                         + fp[KC.f_sc])
    return widen(orad, mag, rho, absolute, 0.0, fp[KC.largest])


@kernel(borrows=True)
def widen_logit(rad, mag, fp, rs_l, l1y, with_sum):
    """A logit in the deployed pass: U·ŷ with ŷ = fl(r̂ + ô) (``with_sum``; ŷ = r̂ when the
    expert's output is removed): the output sum's rounding ρ_y and the logits' ρ_l relative
    to Σ|U_t||r̂| + Σ|U_t||ô| (``mag``), the sum's floor through U (row sum ``rs_l``), the
    logits' floor and allowance."""
    rho = up_nonneg(fp[KC.rho_y] + up_nonneg(fp[KC.rho_l] * up_one_plus(fp[KC.rho_y]))) if with_sum else fp[KC.rho_l]
    sum_floor = up_nonneg(up_nonneg(rs_l * fp[KC.f_y]) * up_one_plus(fp[KC.rho_l])) if with_sum else 0.0
    absolute = up_nonneg(up_nonneg(sum_floor + fp[KC.f_l]) + zero_read(fp, up_nonneg(l1y + rs_l)))
    return widen(rad, mag, rho, absolute, 0.0, fp[KC.largest])
