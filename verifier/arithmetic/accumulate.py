"""Sparse accumulators: how the compiled kernels sum a row's terms, and the rows they hand back.

Every stage kernel computes, one query row at a time, exactly the enclosures that
:mod:`verifier.arithmetic.interval` defines, with the same arithmetic model (A1)–(A3) and
the same two lemmas; only the bookkeeping differs. Instead of batched sparse products
(which sort, allocate and compute structural patterns separately), each row accumulates
its terms in a *sparse accumulator*: one accumulator row per column the row touches,
plus the list of the columns touched (a stamp per accumulator row says which query row
last started it, so nothing is ever cleared; stamps are never reused). A column is
touched exactly when some term of the forward pass contributes to it, so "absent" is
structural by construction: an entry no term reaches is exactly 0, and an entry whose
terms underflowed keeps its floor 2n·η.

Per entry with n terms t_1..t_n (each a product of a float x and a weight w, or a
plain interval), the kernels accumulate, in the order the terms arrive (:func:`add_term`):

* ``mid``: the float sum of the terms' midpoints (products rounded to nearest);
* ``A``: the float sum of the terms' own radii, each rounded up (``up(xr·|w|)``);
* ``B``: the float sum of ``up(|xm|·|w|)`` (for the rounding of ``mid``);

and the entry's radius is ``up(up(c_n·up(A + up(γ_n·B))) + 2n·η)`` (:func:`entry_radius`).
By Lemma 1 the true sums are at most c_n times the computed ones (non-negative terms,
additions only), and by Lemma 2 the midpoint's own error is at most γ_n·ΣB + n·η: the
radius bounds |exact − mid|. A non-finite mid or radius makes the whole row undecided.
The rounding steps are :mod:`verifier.arithmetic.rounding`'s.

*Two layouts.* An accumulator is a (rows, 5) float array, (stamp, mid, A, B, count) per row
in one cache line (stamps and counts are integers below 2^53, exact in float64), with the
list ``touched`` of the columns a query row reached, in the order first touched.

* **dense** (:func:`touch`): a column's accumulator row is the column's own index. Over a
  whole pass every column a row ever reached holds a resident row of 40 bytes (at 20M
  facts, d = 15M residual columns: 600 MB per worker); the plain pass keeps its sums so.
* **compact** (:func:`slot`): a query row's columns take slots in the order they are first
  touched: slot u of ``acc`` and ``touched[u]`` (its column) for u < nt, and ``where[col]``
  (int32) remembers the last slot given to col. Only the first slots of ``acc`` are ever
  written (as many as a row touches at most), and ``where`` costs 4 bytes per column.

The sums are the same operations in the same order in either layout: only where they are
kept changes. :func:`place` is either, as its ``where`` says (None: dense), so that one
kernel function serves both (numba compiles it once for each); :func:`row_of` finds a
column's row in either.

*Rows handed back.* A stage returns its rows as CSR arrays (ptr, idx, mid, rad) made with
:func:`new_rows`, :func:`put` and :func:`trimmed`; the declared types of the exported
kernels' arguments (:data:`CSR`, :data:`PART`, ...) are listed here too.
"""

from __future__ import annotations

import numpy as np

from verifier.arithmetic.kernel_forms import kernel
from verifier.arithmetic.constants import FLOOR, U
from verifier.arithmetic.rounding import FACTOR, GAMMA1, TABLE, gamma, sum_factor, up_nonneg

# The declared types of the kernels called from Python (verifier.arithmetic.kernel_forms.Spec):
# each exported ahead of time with exactly these; a call of other types runs just in time.
I1, I2, F1, F2, F3 = "i64[1]", "i64[2]", "f64[1]", "f64[2]", "f64[3]"
B1, B2, J1, J2 = "bool[1]", "bool[2]", "i32[1]", "i32[2]"
CSR = (I1, I1, F1)                  # a sparse matrix: (indptr, indices, values)
PART = (I1, I1, F1, F1)             # rows of intervals: (indptr, indices, mid, rad)
LOGITS = (I1, I1, F1, F1, F1)       # logit rows: (indptr, indices, mid, rad, magnitude)
ATTENTION = (I1, F3, F3)            # (attention class per row, mid, rad)
HEADS = ("i64", J2, "i64")          # (heads, value row per head and token, positions)
ACC = (F2, I1, J1)                  # a compact accumulator: (acc, touched, where)


# --- one entry's sums ----------------------------------------------------------------------------


@kernel(borrows=True)
def entry_radius(A, B, n):
    """Radius of an entry of n terms from its accumulated A and B (module docstring)."""
    if n == 0:
        return 0.0
    if n < TABLE:
        g, c = GAMMA1[n], FACTOR[n]
    else:
        g, c = gamma(n + 1), sum_factor(n)
    r = up_nonneg(up_nonneg(c * up_nonneg(A + up_nonneg(g * B))) + 2.0 * n * FLOOR)
    return r


@kernel(borrows=True)
def prod_terms(xm, xr, w):
    """(mid, A-term, B-term) of the product of an interval [xm ± xr] and an exact float w."""
    aw = abs(w)
    return xm * w, up_nonneg(xr * aw), up_nonneg(abs(xm) * aw)


@kernel(borrows=True)
def mul_interval(am, ar, bm, br):
    """[am ± ar]·[bm ± br]: midpoint fl(am·bm) and a radius that covers the product's rounding."""
    m = am * bm
    r = up_nonneg(up_nonneg(up_nonneg(up_nonneg(abs(am) * br) + up_nonneg(ar * abs(bm))) + up_nonneg(ar * br))
                  + up_nonneg(U * abs(m)))
    r = up_nonneg(r + FLOOR)
    if not (np.isfinite(m) and np.isfinite(r)):
        r = np.inf
    return m, r


# --- accumulators --------------------------------------------------------------------------------


@kernel(borrows=True)
def start(acc, u, s):
    """Accumulator row ``u`` begun for stamp ``s``: no terms yet."""
    acc[u, 0] = s
    acc[u, 1] = 0.0
    acc[u, 2] = 0.0
    acc[u, 3] = 0.0
    acc[u, 4] = 0.0


@kernel(borrows=True)
def add_term(u, m, a, b, acc):
    """A term (midpoint m, A-term a, B-term b) added to accumulator row ``u``."""
    acc[u, 1] += m
    acc[u, 2] = up_nonneg(acc[u, 2] + a)
    acc[u, 3] = up_nonneg(acc[u, 3] + b)
    acc[u, 4] += 1.0


@kernel(borrows=True)
def touch(col, acc, s, touched, nt):
    """Dense: start column ``col``'s row of the accumulator for stamp ``s`` if it is new;
    return the touched count."""
    if acc[col, 0] != s:
        start(acc, col, s)
        touched[nt] = col
        nt += 1
    return nt


@kernel(borrows=True)
def slot(col, acc, s, touched, nt, where):
    """Compact: (slot of column ``col`` for stamp ``s``, count of slots): the slot
    ``where[col]`` if it is col's for this stamp, else the next free one, started (a new slot nt).

    *Why a remembered slot is col's exactly when it carries stamp s and lists col:* slots
    of stamp s are given one per column, in order, each recording its column in
    ``touched`` and s in ``acc[u, 0]``; a slot carrying s was therefore given during
    stamp s, and to the column it lists. Any other slot (an older stamp's, or one given
    to another column since) fails one of the two tests. Stamps are never reused."""
    u = where[col]
    if acc[u, 0] == s and touched[u] == col:
        return u, nt
    where[col] = nt
    start(acc, nt, s)
    touched[nt] = col
    return nt, nt + 1


@kernel(borrows=True)
def slot_of(col, acc, s, touched, where):
    """Compact: column ``col``'s slot for stamp ``s``, or −1 if it has none (:func:`slot`)."""
    u = where[col]
    if acc[u, 0] == s and touched[u] == col:
        return u
    return -1


@kernel(borrows=True)
def row_of(col, acc, s, touched, where):
    """Column ``col``'s accumulator row for stamp ``s``, or −1 if it has none: dense when
    ``where`` is None, else compact (:func:`slot_of`)."""
    if where is None:
        return col if acc[col, 0] == s else -1
    return slot_of(col, acc, s, touched, where)


@kernel(borrows=True)
def place(col, acc, s, touched, nt, where):
    """(accumulator row of column ``col`` for stamp ``s``, touched count), the row started if
    new: dense when ``where`` is None (the row is col's own), else compact (:func:`slot`)."""
    if where is None:
        return col, touch(col, acc, s, touched, nt)
    return slot(col, acc, s, touched, nt, where)


@kernel(borrows=True)
def product_terms(ptr, idx, val, row, xm, xr, acc, s, touched, nt, where):
    """[xm ± xr] times row ``row`` of an exact matrix (CSR: ptr, idx, val) added to the
    accumulator, a product term per entry; returns the touched count."""
    for t in range(ptr[row], ptr[row + 1]):
        u, nt = place(idx[t], acc, s, touched, nt, where)
        m, a, b = prod_terms(xm, xr, val[t])
        add_term(u, m, a, b, acc)
    return nt


# --- sorted indices --------------------------------------------------------------------------------


@kernel(borrows=True)
def lower_bound(a, lo, hi, x):
    """The first position in ``a[lo:hi]`` (sorted) holding a value >= x (hi if none)."""
    while lo < hi:
        m = (lo + hi) >> 1
        if a[m] < x:
            lo = m + 1
        else:
            hi = m
    return lo


# --- rows handed back --------------------------------------------------------------------------


@kernel()
def grow(a, need):
    """``a`` with room for at least ``need`` entries (doubled), its contents kept."""
    if need <= a.size:
        return a
    out = np.empty(max(2 * a.size, need), a.dtype)
    out[:a.size] = a
    return out


@kernel()
def new_rows(n, capacity):
    """Empty CSR rows of intervals for ``n`` rows, room for ``capacity`` entries: (ptr, idx, mid, rad)."""
    return np.zeros(n + 1, np.int64), np.empty(capacity, np.int64), np.empty(capacity), np.empty(capacity)


@kernel()
def room(out, need):
    """The rows ``out`` (ptr, idx, mid, rad) with room for at least ``need`` entries."""
    ptr, idx, mid, rad = out
    if need <= idx.size:
        return out
    return ptr, grow(idx, need), grow(mid, need), grow(rad, need)


@kernel(borrows=True)
def put(out, e, col, m, r):
    """Entry ``e`` of the rows ``out``: column ``col``, [m ± r] (an infinite radius where m or r
    is not finite); returns e + 1."""
    out[1][e] = col
    out[2][e] = m
    out[3][e] = r if np.isfinite(m) and np.isfinite(r) else np.inf
    return e + 1


@kernel()
def trimmed(out, e):
    """The rows ``out`` cut to their ``e`` entries."""
    ptr, idx, mid, rad = out
    return ptr, idx[:e], mid[:e], rad[:e]
