"""The residual stage: a query row's residual stream at its last position, enclosed entry by entry.

r = E[x_p] + P[p] + Σ_m Σ_j a_mj·(W_O W_V h_j): the last token's and position's embedding
rows (exact) and, for each head m and position j, the head's value row of the token and of
the position (:class:`verifier.passes.forward.Prepared` encloses them once per token class)
scaled by the attention weight's enclosure [a ± ρ] (the product's radius from
:func:`verifier.arithmetic.accumulate.mul_interval`). Each entry is a sum of these terms in
a sparse accumulator (:mod:`verifier.arithmetic.accumulate`); a sum whose products are
rounded already errs by at most γ_n·Σ|mid_t| and its radii add, and an entry of one term is
that term (:func:`_summed`).

Two kernels, one set of terms (:func:`_shared_terms`, :func:`_exact_terms`, :func:`_value_terms`):

* :func:`residual` (the plain pass, :mod:`verifier.passes.forward`): every term of a row,
  in a dense accumulator; in the deployed pass of a format each entry also accumulates the
  magnitudes its rounding is relative to and is widened by it
  (:func:`verifier.arithmetic.deployed.widen_residual`);
* :func:`residual_part` (the factored pass, :mod:`verifier.passes.factored`): the row's
  terms split in two parts, r = s_c + o_i, the shared part of its cohort and its own part
  (a compact accumulator). The plain pass's terms of a row are its shared part's with no
  own token: the same function sums both, in the same order.

*Layers.* The model is a stack of one layer. The residual stage is the only one that reads
the embeddings: a layer above it would read the layer below's output rows y (the experts
stage: :mod:`verifier.arithmetic.experts`) in place of E and P, and its heads' values of
them, and hand its residual rows, in the same CSR form, to its gate and its experts
(:mod:`verifier.arithmetic.gate`, :mod:`verifier.arithmetic.experts`); the readout
(:mod:`verifier.arithmetic.logits`) runs once, on the top layer's rows.
"""

from __future__ import annotations

import numpy as np

from verifier.arithmetic.accumulate import (ACC, ATTENTION, B1, B2, CSR, F1, F2, HEADS, I1, I2, J2, PART, add_term,
                                            entry_radius, mul_interval, new_rows, place, put, room, trimmed)
from verifier.arithmetic.kernel_forms import kernel
from verifier.arithmetic.deployed import widen_residual
from verifier.arithmetic.rounding import up_nonneg


@kernel(args=(I2, I1, I1, I1, I1, "i64", J2, "i64"), returns="i64")
def residual_bound(ids, E_ptr, P_ptr, OE_ptr, OP_ptr, H, v_row, npos):
    """An upper bound on the number of residual entries of every row (for allocation)."""
    n, p1 = ids.shape
    p = p1 - 1
    total = 0
    for i in range(n):
        c = (E_ptr[ids[i, p] + 1] - E_ptr[ids[i, p]]) + (P_ptr[p + 1] - P_ptr[p])
        for m in range(H):
            for j in range(p1):
                t = v_row[m, ids[i, j]]
                c += OE_ptr[t + 1] - OE_ptr[t]
                q = m * npos + j
                c += OP_ptr[q + 1] - OP_ptr[q]
        total += c
    return total


# --- a row's terms ---------------------------------------------------------------------------------


@kernel(borrows=True)
def _place(col, acc, s, touched, nt, where, macc):
    """:func:`verifier.arithmetic.accumulate.place`, also starting the deployed pass's
    magnitude columns of ``col`` when it is new (``macc``: dense accumulators only; None: none)."""
    if macc is not None:
        if acc[col, 0] != s:
            macc[col, 0] = 0.0
            macc[col, 1] = 0.0
    return place(col, acc, s, touched, nt, where)


@kernel(borrows=True)
def _exact_terms(X, row, acc, s, touched, nt, where, macc):
    """Row ``row`` of an exact matrix (E or P; CSR ptr, idx, val), each entry a term of no
    radius; with ``macc`` also Σ|entries| per column (magnitude column 0). Returns the
    touched count."""
    ptr, idx, val = X
    for q in range(ptr[row], ptr[row + 1]):
        u, nt = _place(idx[q], acc, s, touched, nt, where, macc)
        add_term(u, val[q], 0.0, abs(val[q]), acc)
        if macc is not None:
            macc[idx[q], 0] = up_nonneg(macc[idx[q], 0] + abs(val[q]))
    return nt


@kernel(borrows=True)
def _value_terms(X, row, wm, wr, acc, s, touched, nt, where, macc, mag):
    """Row ``row`` of value rows (OE or OP; CSR ptr, idx, mid, rad) times the attention weight
    [wm ± wr], each entry a term; with ``macc`` also Σ â_hi·``mag`` per column (magnitude
    column 1; ``mag`` aligned with the rows' entries; None with ``macc``). Returns the
    touched count."""
    ptr, idx, mid, rad = X
    w_hi = up_nonneg(abs(wm) + wr)
    for q in range(ptr[row], ptr[row + 1]):
        u, nt = _place(idx[q], acc, s, touched, nt, where, macc)
        pm, pr = mul_interval(wm, wr, mid[q], rad[q])
        add_term(u, pm, pr, abs(pm), acc)
        if macc is not None:
            macc[idx[q], 1] = up_nonneg(macc[idx[q], 1] + up_nonneg(w_hi * mag[q]))
    return nt


@kernel(borrows=True)
def _shared_terms(i, ids, own, diverse, attention, E, P, OE, OP, heads, acc, s, touched, where, macc, OE_mag,
                  OP_mag):
    """Row i's terms that are not its own, in the order E[x_p], P[p], then per head m and
    position j the value row of x_j and the one of j; ``own`` None: every term (the plain
    pass). A term is own when its token is one of the row's own (``own[i, j]``: an entity)
    and it is E[x_p], or its value row in a head whose entities' value rows differ
    (``diverse[m]``). An attention weight that is exactly 0 contributes exactly 0 and is
    skipped. Returns the touched count."""
    att, am, ar = attention
    H, v_row, npos = heads
    p = ids.shape[1] - 1
    nt = 0
    if own is None or not own[i, p]:
        nt = _exact_terms(E, ids[i, p], acc, s, touched, nt, where, macc)
    nt = _exact_terms(P, p, acc, s, touched, nt, where, macc)
    a_row = att[i]
    for m in range(H):
        for j in range(p + 1):
            wm = am[a_row, m, j]
            wr = ar[a_row, m, j]
            if wm == 0.0 and wr == 0.0:
                continue
            if own is None or not (own[i, j] and diverse[m]):
                nt = _value_terms(OE, v_row[m, ids[i, j]], wm, wr, acc, s, touched, nt, where, macc, OE_mag)
            nt = _value_terms(OP, m * npos + j, wm, wr, acc, s, touched, nt, where, macc, OP_mag)
    return nt


@kernel(borrows=True)
def _summed(acc, u):
    """(mid, radius) of accumulator row ``u``, a sum of terms whose products were rounded
    already: error <= γ_n·Σ|mid_t|, radii add; one term is its own midpoint (no addition)
    with its own radius."""
    n_ = int(acc[u, 4])
    return acc[u, 1], (entry_radius(acc[u, 2], acc[u, 3], n_) if n_ > 1 else acc[u, 2])


@kernel(borrows=True)
def _row(i, ids, attention, E, P, OE, OP, heads, acc, touched, s, out, e, dep):
    """Row i of :func:`residual` (every term, a dense accumulator) into the rows ``out`` from
    their entry ``e``; ``dep`` (the deployed pass; None: the exact one) = :func:`residual`'s
    ``deployed`` but its first. Returns the row's end."""
    if dep is None:
        nt = _shared_terms(i, ids, None, None, attention, E, P, OE, OP, heads, acc, s, touched, None, None, None, None)
    else:
        nt = _shared_terms(i, ids, None, None, attention, E, P, OE, OP, heads, acc, s, touched, None, dep[1], dep[2],
                           dep[3])
    for u in range(nt):
        col = touched[u]
        m_, r_ = _summed(acc, col)
        if dep is not None:
            fp, macc_, _, _, rho_or, f_or, zeta, rs_o, row_extra = dep
            r_ = widen_residual(r_, macc_[col, 0], macc_[col, 1], fp, rho_or[col], f_or[col],
                                up_nonneg(rs_o[col] * zeta[i]), rs_o[col], row_extra[i])
        e = put(out, e, col, m_, r_)
    out[0][i + 1] = e
    return e


# --- the kernels -------------------------------------------------------------------------------------


@kernel(args=(I2, ATTENTION, CSR, CSR, PART, PART, HEADS, (F2, I1), "i64", "i64",
              ("bool", F1, F2, F1, F1, F1, F1, F1, F1, F1)), returns=PART)
def residual(ids, attention, E, P, OE, OP, heads, scratch, stamp0, capacity, deployed):
    """r = E[x_p] + P[p] + Σ_m Σ_j a_mj (W_O W_V h_j) for every row, as CSR (ptr, idx, mid, rad).

    ``attention`` = (att, am, ar): ``att[i]`` selects row i's attention intervals
    ``am/ar[att[i], m, j]``. ``E``, ``P``: CSR (ptr, idx, val). ``heads`` = (H, v_row, npos):
    head m's value row of token x is row ``v_row[m, x]`` of ``OE`` (tokens with equal rows
    share one), its row for position j is row m·npos + j of ``OP`` (both (ptr, idx, mid,
    rad)). ``scratch`` = (a dense accumulator, its touched list). ``capacity``: at least the
    rows' entries (:func:`residual_bound`).

    ``deployed`` = (on, constants, magnitude accumulator, OE magnitudes, OP magnitudes,
    ρ_or, floor_or, per-row value floors ζ (times W_O's row sums), W_O row sums, per-row
    allowance (∞ for a row undecided before the residual)): for the deployed pass
    of a format (verifier.passes.floating: Stages), each entry also accumulates the magnitudes of
    its embedding terms (Σ |E| + |P|) and of its value terms (Σ â_hi·(|W_O||W_V||h_j|), from
    the magnitude rows aligned with OE and OP), and its radius grows by the embedding's
    rounding, the value path's (attention-weighted values, relative K_value), and the head
    outputs' and residual sum's (ρ_or per coordinate) with their absolute allowances; an
    entry whose magnitude may reach the format's largest value makes the row undecided.
    """
    acc, touched = scratch
    n = ids.shape[0]
    out = new_rows(n, capacity)
    e = 0
    for i in range(n):
        if deployed[0]:
            e = _row(i, ids, attention, E, P, OE, OP, heads, acc, touched, stamp0 + i, out, e, deployed[1:])
        else:
            e = _row(i, ids, attention, E, P, OE, OP, heads, acc, touched, stamp0 + i, out, e, None)
    return trimmed(out, e)


@kernel(args=(I2, B2, B1, "bool", ATTENTION, CSR, CSR, PART, PART, HEADS, ACC, "i64"), returns=PART)
def residual_part(ids, own, diverse, shared, attention, E, P, OE, OP, heads, scratch, stamp0):
    """One part of r = E[x_p] + P[p] + Σ_m Σ_j a_mj·(W_O W_V h_j) for every row of ``ids``, as
    CSR (ptr, idx, mid, rad): with ``shared`` the shared part (:func:`_shared_terms`), else
    the own part (in the same order, the own positions of the diverse heads only), the
    arguments as :func:`residual` takes them.

    The terms are :func:`residual`'s, in its order, and each goes to exactly one part: a
    row's own part holds E[x_p] when x_p is one of the row's own tokens (``own[i, p]``: an
    entity) and, for each position j holding an own token, its value row in every head m
    whose entity value rows differ (``diverse[m]``); the shared part holds every other
    term (P[p], the positional value rows, the words', and the entities' value rows in the
    heads where every entity has the same one). So r = shared + own term by term, and each
    part's entries are enclosed as the plain kernel encloses a sum of terms (a column's
    radius from its own terms only). ``scratch`` = a compact accumulator (acc, touched,
    where: :func:`verifier.arithmetic.accumulate.slot`).
    """
    acc, touched, where = scratch
    att, am, ar = attention
    v_row = heads[1]
    n, p1 = ids.shape
    p = p1 - 1
    out = new_rows(n, max(8 * n, 16))
    div_heads = np.flatnonzero(diverse)
    own_pos = np.empty(p1, np.int64)
    e = 0
    for i in range(n):
        s = stamp0 + i
        if shared:
            nt = _shared_terms(i, ids, own, diverse, attention, E, P, OE, OP, heads, acc, s, touched, where, None,
                               None, None)
        else:                                          # own terms: E[x_p] if own, own positions of diverse heads
            nt = _exact_terms(E, ids[i, p], acc, s, touched, 0, where, None) if own[i, p] else 0
            n_own = 0
            for j in range(p1):
                if own[i, j]:
                    own_pos[n_own] = j
                    n_own += 1
            for h in range(div_heads.size):
                for u in range(n_own):
                    m, j = div_heads[h], own_pos[u]
                    wm, wr = am[att[i], m, j], ar[att[i], m, j]
                    if wm != 0.0 or wr != 0.0:
                        nt = _value_terms(OE, v_row[m, ids[i, j]], wm, wr, acc, s, touched, nt, where, None, None)
        if e + nt > out[1].size:
            out = room(out, e + nt)
        for u in range(nt):
            m_, r_ = _summed(acc, u)
            e = put(out, e, touched[u], m_, r_)
        out[0][i + 1] = e
    return trimmed(out, e)


@kernel(args=(PART, PART, I1, B1, (F2, I1), "i64"), returns=PART)
def parts_sum(S, O, cohort, keep, scratch, stamp0):
    """r_i = s_c + o_i for every row i, c = ``cohort[i]``, from the shared parts ``S`` (a row
    per cohort) and the own parts ``O`` (a row per row) of :func:`residual_part`, as CSR
    (ptr, idx, mid, rad), only in the columns ``keep`` marks (those a reader of r reads: an
    entry of another column is left out). Each part's entry is one interval term
    (midpoint, radius, |midpoint|); a column of one term is that term as it is (no
    addition), of two the sum enclosed by Lemmas 1 and 2 (:func:`_summed`). ``scratch`` =
    (a dense accumulator, its touched list); stamps ``stamp0`` .. ``stamp0 + n − 1``."""
    acc, touched = scratch
    S_ptr, S_idx, S_mid, S_rad = S
    O_ptr, O_idx, O_mid, O_rad = O
    n = O_ptr.size - 1
    out = new_rows(n, max(O_idx.size, 16))
    e = 0
    for i in range(n):
        s = stamp0 + i
        nt = 0
        c = cohort[i]
        for t in range(S_ptr[c], S_ptr[c + 1]):
            if keep[S_idx[t]]:
                u, nt = place(S_idx[t], acc, s, touched, nt, None)
                add_term(u, S_mid[t], S_rad[t], abs(S_mid[t]), acc)
        for t in range(O_ptr[i], O_ptr[i + 1]):
            if keep[O_idx[t]]:
                u, nt = place(O_idx[t], acc, s, touched, nt, None)
                add_term(u, O_mid[t], O_rad[t], abs(O_mid[t]), acc)
        if e + nt > out[1].size:
            out = room(out, e + nt)
        for u in range(nt):
            m_, r_ = _summed(acc, touched[u])
            e = put(out, e, touched[u], m_, r_)
        out[0][i + 1] = e
    return trimmed(out, e)
