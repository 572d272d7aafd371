"""The compiled kernels' rounding steps and rounding factors, and the probe of their arithmetic.

Every radius the kernels compute is a chain of float operations, each followed by a step
outward (the arithmetic model of :mod:`verifier.arithmetic.interval`, (A1) and (A2)). The
steps, by the direction they round and the values they take:

* :func:`up`, :func:`down`: the next float above (below) x, for any x: C's ``nextafter``,
  exact, and a library call (some 13 ns). :func:`verifier.arithmetic.interval.up` and
  ``down`` are the same steps on numpy arrays.
* :func:`up_nonneg`: at least the next float above x, for x >= 0 (every radius, every sum
  of radii), in two flops: x·(1 + 2^-52) + 2^-1022. For x in [2^e, 2^(e+1)) the product
  exceeds x by x·2^-52 >= 2^(e−52) = ulp(x), so rounding to nearest gives at least
  x + ulp(x) (adding a positive number keeps it there); for a subnormal x or 0 the product
  rounds to x and adding 2^-1022 >= η exceeds nextafter; a fused multiply-add gives the
  same. Applied to the float result of one operation, it rounds that operation upward, as
  nextafter does. (On a negative x it would step downward: never given one.)
* :func:`up_signed`, :func:`down_signed`: at least the next float above (below) x, for any
  x, in two flops and a sign test; :func:`up_nonneg` for x >= 0 (see :func:`up_signed`).
* :func:`up_one_plus`: an upper bound of 1 + x, for x >= 0.

Underflow allowances use 2^-1022 (the smallest normal, :data:`FLOOR`) instead of η: as
sound, and radii never become subnormal, whose arithmetic is many times slower.

*Which steps a kernel takes.* Each step is at least one float outward, so any of them
makes a bound; but each pass keeps its own, so that its floats are its own: the plain pass
(:mod:`verifier.passes.forward`) steps a value of either sign with :func:`up` and
:func:`down`, the factored pass (:mod:`verifier.passes.factored`) with :func:`up_signed`
and :func:`down_signed`. A kernel function both passes run takes an argument ``quick``:
None (the plain pass) or :data:`QUICK` (the factored pass), and steps with :func:`step_up`
and :func:`step_down`. Which step that is, is decided when numba compiles the function for
the argument's type (None or not), so each pass's compiled code calls its own steps
directly, with no test at run time.

*Rounding factors.* :func:`gamma` bounds γ_n = n·u/(1 − n·u) and :func:`sum_factor` is
c_n = up(1 + 2γ_n) (Lemma 1 of :mod:`verifier.arithmetic.interval`); :func:`factor` and
:func:`shrink` (down(1 − γ_{n+1})) read them from tables for n < :data:`TABLE`, computed
with the same operations, so a table's value is the function's to the bit.

*The probe.* Compilation is numba's (LLVM) without fast-math, so IEEE semantics are kept;
:func:`check` verifies round-to-nearest and gradual underflow inside compiled code, in every
form a process runs (ahead of time, just in time: :mod:`verifier.arithmetic.kernel_forms`), as
:func:`verifier.arithmetic.interval.check_platform` does for numpy and scipy.
"""

from __future__ import annotations

import numpy as np

from verifier.arithmetic.kernel_forms import KERNELS, kernel
from verifier.arithmetic.constants import ETA, FLOOR, STEP, U

#: 1 − 2^-52: a negative number times it moves toward zero by at least one unit in the last place.
STEP_DOWN = 1.0 - 2.0 ** -52
#: The largest finite float64.
LARGEST = np.finfo(np.float64).max


@kernel(args=("f64",), returns="f64")
def up(x):
    """The next float above x (nextafter: exact, any sign)."""
    return np.nextafter(x, np.inf)


@kernel()
def down(x):
    """The next float below x (nextafter: exact, any sign)."""
    return np.nextafter(x, -np.inf)


@kernel()
def up_nonneg(x):
    """At least the next float above x, for x >= 0 (the module docstring): two flops."""
    return x * STEP + FLOOR


@kernel()
def down_nonneg(x):
    """At most the next float below x, for x >= 0, and not below 0: max(x·(1 − 2^-52) −
    2^-1022, 0). For a normal x in [2^e, 2^(e+1)), x·2^-52 >= ulp(x), so the exact product
    lies at least one unit below x and rounds (monotonically) to at most the float below x;
    subtracting the floor cannot raise it. A subnormal x or 0 goes to 0 or below, clamped."""
    return max(x * STEP_DOWN - FLOOR, 0.0)


@kernel()
def up_one_plus(x):
    """An upper bound of 1 + x, for x >= 0."""
    return up_nonneg(1.0 + x)


@kernel()
def up_signed(x):
    """At least the next float above x, for any x, in two flops (:func:`up` is a library call).
    For x >= 0 it is :func:`up_nonneg`. For x < 0, with y = −x in [2^e, 2^(e+1)): the exact
    y·2^-52 is at least the gap below y, so fl(x·(1 − 2^-52)) lies at or above −(the float
    below y) = nextafter(x, +∞) (a subnormal or zero product stays x, and the floor 2^-1022
    then exceeds the smallest step); adding the floor never lowers a value. −∞ gives −(the
    largest float), as nextafter does; NaN stays NaN."""
    if x >= 0.0:
        return x * STEP + FLOOR
    if x != -np.inf:
        return x * STEP_DOWN + FLOOR
    return -LARGEST


@kernel()
def up_finite(x):
    """At least the next float above a finite x of either sign, branch-free (as a loop over
    many values wants it; :func:`up_signed` also takes −∞): x + |x|·2^-52 + 2^-1022.

    For |x| >= 2^-970 the product |x|·2^-52 is exact and at least the unit in the last
    place of x on the side toward +∞ (for x = −2^e the unit below 2^e is half as large);
    so the exact x + |x|·2^-52 lies at or beyond nextafter(x, +∞), a float, and rounding
    to nearest, being monotone, keeps it there; adding 2^-1022 cannot lower it. For
    |x| < 2^-970 the unit is at most 2^-1022, and fl(x + |x|·2^-52) >= x, so the exact
    sum with 2^-1022 is at least x + 2^-1022 >= nextafter(x, +∞), kept by rounding.
    +∞ stays +∞; −∞ and NaN give NaN (a caller checks finiteness)."""
    return (x + abs(x) * 2.0 ** -52) + FLOOR


@kernel()
def down_finite(x):
    """At most the next float below a finite x: −up_finite(−x) (the same proof, mirrored)."""
    return (x - abs(x) * 2.0 ** -52) - FLOOR


@kernel()
def down_signed(x):
    """At least the next float below x, for any x: −up_signed(−x)."""
    return -up_signed(-x)


#: The ``quick`` argument that makes :func:`step_up` and :func:`step_down` the two-flop steps
#: (None: nextafter).
QUICK = True


@kernel()
def step_up(x, quick):
    """At least the next float above x: :func:`up` (nextafter) when ``quick`` is None, else
    :func:`up_signed` (two flops; the module docstring: which steps a kernel takes)."""
    if quick is None:
        return up(x)
    return up_signed(x)


@kernel()
def step_down(x, quick):
    """At least the next float below x: :func:`down` (nextafter) when ``quick`` is None, else
    :func:`down_signed` (two flops)."""
    if quick is None:
        return down(x)
    return down_signed(x)


# --- rounding factors -----------------------------------------------------------------------------


@kernel()
def gamma(n):
    """An upper bound of γ_n = n·u/(1 − n·u) (n < 2^50)."""
    nu = n * U
    return up(up(nu) / down(1.0 - nu))


@kernel()
def sum_factor(n):
    """c_n = up(1 + 2γ_n) (Lemma 1)."""
    return up(1.0 + 2.0 * gamma(n))


#: The rounding factors of up to this many terms are read from tables.
TABLE = 4096


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """γ_{n+1}, c_n and down(1 − γ_{n+1}) for n < TABLE, each rounded exactly as
    :func:`gamma`, :func:`sum_factor` and :func:`shrink` round them."""
    n = np.arange(TABLE, dtype=np.float64)
    nu = (n + 1) * U
    g1 = np.nextafter(np.nextafter(nu, np.inf) / np.nextafter(1.0 - nu, -np.inf), np.inf)
    nu0 = n * U
    g0 = np.nextafter(np.nextafter(nu0, np.inf) / np.nextafter(1.0 - nu0, -np.inf), np.inf)
    c = np.nextafter(1.0 + 2.0 * g0, np.inf)
    return g1, c, np.nextafter(1.0 - g1, -np.inf)


#: γ_{n+1}, c_n and down(1 − γ_{n+1}) for n < TABLE.
GAMMA1, FACTOR, SHRINK = _tables()


@kernel()
def factor(n):
    """c_n = sum_factor(n), from the table where it holds it."""
    return FACTOR[n] if n < TABLE else sum_factor(n)


@kernel()
def shrink(n):
    """down(1 − γ_{n+1}), from the table where it holds it: Σ t >= shrink(n)·fl(Σ t) for
    the float sum of n + 1 non-negative terms."""
    return SHRINK[n] if n < TABLE else down(1.0 - gamma(n + 1))


# --- the probe ----------------------------------------------------------------------------------


@kernel(args=("f64", "f64"), returns=("f64", "f64"))
def _probe(a, b):
    return a * b, a + b


def _ieee(form) -> None:
    """Round to nearest and gradual underflow inside compiled code of one form (``form(k)``
    gives kernel k's function in it): see :func:`verifier.arithmetic.interval.check_platform`."""
    probe, step = form(_probe), form(up)
    prod, _ = probe(2.0 ** -537, 2.0 ** -537)
    _, tie = probe(1.0, 2.0 ** -53)
    _, above = probe(1.0, 3 * 2.0 ** -54)
    ok = prod == 2.0 ** -1074 and tie == 1.0 and above == 1.0 + 2.0 ** -52 and step(0.0) == ETA
    if not ok:
        raise RuntimeError("compiled code does not compute in IEEE-754 binary64 round-to-nearest with gradual "
                           "underflow; certified results would not be proofs")


KERNELS.add_probe(_ieee)


def check() -> None:
    """Probe the compiled code this process runs (:func:`_ieee`), in every form it runs in:
    each form (ahead of time, just in time) is probed when first used, and again here, as
    the floating-point unit's modes may change during a process (a library loaded later)."""
    _probe(1.0, 1.0)
    for form in KERNELS.forms():
        _ieee(form)
