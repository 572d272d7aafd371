"""The exponential's enclosure in compiled code: the same floats as :func:`verifier.arithmetic.interval.exp_enclosure`.

Neither bound trusts the platform's ``exp``: x = k·ln2 + r with |r| <= 0.35 (ln2 enclosed
by two floats, :data:`verifier.arithmetic.constants.LN2_LO` and ``LN2_HI``), the degree-14
Taylor polynomial of e^r by Horner, its error below ``HORNER_ERR``, and the scaling by 2^k
with ``ldexp``, each step rounded outward (the module docstring of
:mod:`verifier.arithmetic.interval`); a test compares both implementations bit for bit.

The softmax of a row evaluates the bounds at the same arguments again and again (the rows
of one cohort share their logits): :func:`exp_memo` remembers them in a small table, which changes nothing but the time.
"""

from __future__ import annotations

import math

import numpy as np

from verifier.arithmetic.kernel_forms import kernel
from verifier.arithmetic.constants import EXP_MAX, EXP_MIN, HORNER_ERR, INV_LN2, LN2_HI, LN2_LO, TINY
from verifier.arithmetic.constants import TAYLOR as _TAYLOR
from verifier.arithmetic.rounding import down, up

TAYLOR = np.array(_TAYLOR)
#: Slots of the memo of exp bounds (a power of two).
MEMO = 256


@kernel()
def horner(coefficients, r):
    """Σ_i c_i·r^i by Horner's rule, in float arithmetic (its error bounded where it is used)."""
    n = coefficients.size
    acc = coefficients[n - 1]
    for i in range(n - 2, -1, -1):
        acc = acc * r + coefficients[i]
    return acc


@kernel()
def _horner(r):
    return horner(TAYLOR, r)


@kernel()
def _scaled(xs, sign):
    """e^xs bounded below (``sign`` −1) or above (+1), for xs in [−740, 709]: every step rounded
    toward sign·∞ (nextafter, as :func:`verifier.arithmetic.rounding.up` and ``down`` round),
    k·ln2 taken with the float of ln 2 that moves r = xs − k·ln2 the same way (the largest
    candidate of k·ln2 for a lower bound, the smallest for an upper), the polynomial's error
    bound added in that direction."""
    toward = sign * np.inf
    k = np.rint(xs * INV_LN2)
    ln2 = LN2_LO if (k >= 0) == (sign > 0) else LN2_HI
    r = np.nextafter(np.nextafter(xs - np.nextafter(k * ln2, -toward), toward), toward)
    t = np.nextafter(_horner(r) + sign * HORNER_ERR, toward)
    return np.nextafter(math.ldexp(t, int(k)), toward)


@kernel()
def exp_lower(x):
    """A lower bound of e^x (0 below −740 and for NaN).

    For |x| <= 2^-60: e^x >= 1 + x >= 1 − 2^-60 > 1 − 2^-53 = down(1) (and no subnormal
    arithmetic in the polynomial).
    """
    if not (x >= EXP_MIN):
        return 0.0
    if abs(x) <= TINY:
        return down(1.0)
    return max(_scaled(min(x, EXP_MAX), -1.0), 0.0)


@kernel()
def exp_upper(x):
    """An upper bound of e^x (+inf above 709 and for NaN).

    For |x| <= 2^-60: e^x <= 1 + x + x² < 1 + 2^-59 < 1 + 2^-52 = up(1).
    """
    if not (x <= EXP_MAX):
        return np.inf
    if abs(x) <= TINY:
        return up(1.0)
    return _scaled(max(x, EXP_MIN), 1.0)


@kernel()
def _memo_slot(x):
    m, e = math.frexp(x)
    return (int(m * 1073741824.0) ^ (e * 40503)) & (MEMO - 1)


@kernel(borrows=True)
def exp_memo(x, memo, sign):
    """exp_lower(x) (``sign`` −1) or exp_upper(x) (+1), remembered in ``memo`` (a (4, MEMO)
    array: rows 0 and 1 the lower bounds' arguments and values, rows 2 and 3 the upper
    bounds'); a remembered value is the function's for that argument. None: nothing is
    remembered."""
    if memo is None or not (abs(x) < 1e300):
        return exp_upper(x) if sign > 0 else exp_lower(x)
    row = 2 if sign > 0 else 0
    h = _memo_slot(x)
    if memo[row, h] == x:
        return memo[row + 1, h]
    v = exp_upper(x) if sign > 0 else exp_lower(x)
    memo[row, h] = x
    memo[row + 1, h] = v
    return v
