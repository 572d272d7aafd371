"""The arithmetic's constants, one definition for the numpy code and the compiled kernels.

:mod:`verifier.arithmetic.interval` (numpy) and the compiled kernels (numba) compute the same
enclosures with the same arithmetic model; every constant either uses is defined here, so
the two cannot drift apart (``tests/verifier/arithmetic/test_interval.py`` checks each constant against exact
arithmetic, and that the two implementations enclose alike).
"""

from __future__ import annotations

import math

#: Unit roundoff of float64 (round to nearest).
U = 2.0 ** -53
#: The smallest positive subnormal float64.
ETA = 2.0 ** -1074
#: The underflow allowance per product in radii. Lemma 2 of verifier.arithmetic.interval needs at least
#: η/2 per product; any larger bound is as sound, and the smallest normal number keeps radii
#: out of the subnormal range, where x86 arithmetic takes a microcode path many times slower.
FLOOR = 2.0 ** -1022
#: x·STEP + FLOOR >= nextafter(x, +inf) for x >= 0 (verifier.arithmetic.rounding.up_nonneg).
STEP = 1.0 + 2.0 ** -52
#: The floats just below and just above ln 2 (checked in tests).
LN2_LO = 0.6931471805599452862
LN2_HI = 0.6931471805599453972
INV_LN2 = 1.0 / 0.6931471805599453
#: Taylor coefficients of e^r, degree 14.
TAYLOR = tuple(1.0 / math.factorial(i) for i in range(15))
#: >= (γ_28 + u)·e^0.35 + 0.35^15/15!·e^0.35 + coefficient rounding (≈ 4.6e-15).
HORNER_ERR = 1e-14
#: Below this |x|, e^x is enclosed by [down(1), up(1)] without the polynomial.
TINY = 2.0 ** -60
#: exp's enclosure gives 0 below this argument and +inf above the next.
EXP_MIN = -740.0
EXP_MAX = 709.0
