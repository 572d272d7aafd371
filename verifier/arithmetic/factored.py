"""Compiled kernels of the factored pass (numba): what rows share is enclosed once.

The kernels of :mod:`verifier.arithmetic.kernels` enclose each query row from scratch.
Most of a row is the same across the queries of one template structure: the words, the
positions, the attention pattern, and whatever an entity contributes regardless of which
entity it is. The factored pass (:mod:`verifier.passes.factored`) therefore writes the
residual of row i as two sums of the forward pass's terms,

    r_i = s_c + o_i,

the *shared part* s_c, a pure function of the row's cohort c (its key: the words, and
each entity's attention class), and the row's *own part* o_i (the terms its entities
bring by themselves). Every linear map is applied to the two parts separately; they are
combined only where the pass is not linear: a neuron's ReLU, the softmax, the gate's
comparisons. What is shared is enclosed once per cohort, or once per (cohort, expert),
and a row costs only what its own part touches.

**Arithmetic.** The enclosures are those of :mod:`verifier.arithmetic.kernels`, with the
same accumulated sums (kept compactly: a row's columns take slots in the order it touches
them, :func:`verifier.arithmetic.kernels._at`, so that a worker's accumulators hold what
one row touches, not a row per residual column), Lemma 1 and Lemma 2 (that module's
docstring). Grouping the terms of a sum differently is covered by both lemmas: the float
sum of n terms computed along *any* summation tree errs by at most γ_{n−1} times the sum
of their magnitudes, and a sum of non-negative numbers rounded upward is at least their
exact sum however it is grouped. A part already enclosed as [m ± ρ] enters a later sum
as one interval term (midpoint m, radius ρ, magnitude |m|), exactly as the plain pass
adds U·r to a logit.
Where a grouping raises the number of terms in a rounding bound (the gate: a residual
coordinate may now come once from each part) the larger count is used. Two identities
are used, both exact: an expert's output is linear in the activities, so the shared
output plus, for each neuron the row touches, (its activity with the row) − (its
activity without it) times its column of W_2 is the output; and a sum over the logits
of a cohort minus the sum over some of them is the sum over the rest (each bound
rounded outward, and clamped at 0, where the exact value lies).

Only the exact pass is factored here, for gate mode "top1" (c_i = 1); the deployed pass
of a format and the scaled gate run the plain kernels.
"""

from __future__ import annotations

import numpy as np
from verifier.arithmetic.compiled import kernel

from verifier.arithmetic.accumulate import (ACC, ATTENTION, B1, B2, CSR, F1, F2, HEADS, I1, I2, LOGITS, PART, add_term,
                                            entry_radius, grow, mul_interval, prod_terms, slot, slot_of)
from verifier.arithmetic.constants import FLOOR, U
from verifier.arithmetic.exponential import exp_lower, exp_memo, exp_upper
from verifier.arithmetic.rounding import down_signed, factor, gamma, shrink, up_nonneg, up_signed

# The declared types of this module's kernels called from Python (as in verifier.arithmetic.kernels).
TABLE_ARRAYS = (I1, F1, F1, F1, F1, I1, I1, I1, I1)      # a cohort's logit table (_cohort_table)
SCRATCH = (*ACC, F1, F1, F1, F1, B1, *ACC, *ACC, *ACC, F1, TABLE_ARRAYS, I1, F2)


# --- a cohort's logits, and the error from them and a row's ----------------------------------------


#: A cohort table of at most this many logits is summed again for each row (as the plain
#: kernel sums), rather than subtracting a row's tokens from the table's sum: a difference
#: of two rounded sums is only as precise as the larger one, which costs digits when the
#: table holds the row's dominant valid token.
DIRECT = 64


@kernel()
def _cohort_table(nL, Ltouched, Lacc, table, sg):
    """The shared logits in the compact accumulator (its first ``nL`` slots, tokens in
    ``Ltouched``, mid in column 1 and radius in column 2) as a cohort's table: per token
    its enclosure and the bounds of e^(z − M_c) for M_c the largest midpoint; the
    (unrounded) float sums of those bounds; the tokens by decreasing midpoint (ties:
    smaller token first), by decreasing lower end, and in increasing order with their
    positions (for :func:`_position`). Returns (M_c, sum of lower bounds, sum of upper
    bounds, bad: a non-finite enclosure)."""
    tok, mid, rad, elo, ehi, by_mid, by_lo, srt_tok, srt_pos = table
    M = -np.inf
    bad = False
    for u in range(nL):
        tok[u] = Ltouched[u]
        mid[u] = Lacc[u, 1]
        rad[u] = Lacc[u, 2]
        if not (np.isfinite(mid[u]) and np.isfinite(rad[u])):
            bad = True
        M = max(M, mid[u])
    by_tok = np.argsort(tok[:nL])                      # tokens are distinct: a total order
    for u in range(nL):
        srt_tok[u] = tok[by_tok[u]]
        srt_pos[u] = by_tok[u]
    s_lo = 0.0
    s_hi = 0.0
    if bad or nL == 0:
        return M, s_lo, s_hi, bad
    for u in range(nL):
        elo[u] = exp_lower(down_signed(down_signed(mid[u] - rad[u]) - M))
        ehi[u] = exp_upper(up_signed(up_signed(mid[u] + rad[u]) - M))
        s_lo += elo[u]
        s_hi += ehi[u]
    key = np.empty(nL)
    for u in range(nL):
        key[u] = -mid[by_tok[u]]
    srt = np.argsort(key, kind="mergesort")
    for u in range(nL):
        by_mid[u] = by_tok[srt[u]]
    for u in range(nL):
        key[u] = -down_signed(mid[by_tok[u]] - rad[by_tok[u]])
    srt = np.argsort(key, kind="mergesort")
    for u in range(nL):
        by_lo[u] = by_tok[srt[u]]
    return M, s_lo, s_hi, bad


@kernel()
def _position(t, nL, table):
    """Token t's position in a cohort's table, −1 if it is not there (binary search in the
    table's sorted tokens: a row looks up a few tokens in a table that stays in cache)."""
    srt_tok, srt_pos = table[7], table[8]
    lo = 0
    hi = nL
    while lo < hi:
        m = (lo + hi) >> 1
        if srt_tok[m] < t:
            lo = m + 1
        else:
            hi = m
    if lo < nL and srt_tok[lo] == t:
        return srt_pos[lo]
    return -1


#: A row with at most this many valid next tokens has them looked up by scanning its list
#: (in the plain kernel's stamps otherwise).
SMALL_VALID = 8


@kernel()
def _is_valid(t, small, valid, lo, hi, vstamp, sv):
    """Whether token t is one of the row's valid next tokens ``valid[lo:hi]`` (``small``: by
    scanning them; else by the stamps ``vstamp[t] == sv`` or ``sv + 0.5`` set beforehand)."""
    if small:
        for q in range(lo, hi):
            if valid[q] == t:
                return True
        return False
    return vstamp[t] == sv or vstamp[t] == sv + 0.5


@kernel()
def _first_time(valid, lo, q):
    """Whether ``valid[q]`` does not occur in ``valid[lo:q]``."""
    for r in range(lo, q):
        if valid[r] == valid[q]:
            return False
    return True


@kernel()
def _error_parts(nt, Ltouched, Lacc, Lwhere, s, table, cohort, V, vptr_lo, vptr_hi, valid, vstamp, sv, memo):
    """Enclosure of 1 − P(valid), the argmax token (−1: a zero logit), and an enclosure of
    ρ = e^(0 − M)/Σ_t e^(z_t − M) (as :func:`verifier.arithmetic.kernels._error` returns
    them) for a row whose logits are the cohort's (``table``, ``cohort`` = (number of
    tokens, M_c, the float sums of the bounds, the table's stamp)) except at the ``nt`` row
    tokens of ``Ltouched``, the first slots of the compact accumulator ``Lacc`` (slot map
    ``Lwhere``; stamp ``s`` in column 0, the row's enclosure of the whole logit in columns
    1 and 2, its position in the table in column 4, −1 if none); every other token has
    logit exactly 0. The row's valid tokens ``valid[vptr_lo:vptr_hi]`` are
    looked up by scanning when few, else marked with ``sv`` in ``vstamp``.

    With M the shift (the largest midpoint of the row's logits, and 0 when a token has
    logit 0) and Q the row tokens together with the valid tokens of the table: the
    invalid mass is e^(M_c − M)·(Σ_table − Σ_{Q ∩ table}) (every other table token is
    invalid and not a row token) plus the invalid tokens of Q plus the zero-logit invalid
    ones; the valid mass is that of the valid tokens of Q plus the zero-logit valid ones.
    Each float sum of k bounds is widened by c_{k+1} (upward) or 1 − γ_{k+1} (downward),
    the difference rounded outward and clamped at 0, and the ratio bounded as in the
    plain kernel (the error is increasing in the invalid mass, decreasing in the valid).
    A table of at most ``DIRECT`` tokens, or of at most twice as many as the row has valid
    tokens (their lookups cost as much), is not subtracted from: its tokens the row did not
    change are summed with the row's, exactly as the plain kernel sums its logits."""
    tok, mid, rad, elo, ehi, by_mid = table[0], table[1], table[2], table[3], table[4], table[5]
    nL, M_c, c_lo, c_hi, sg = cohort
    small = vptr_hi - vptr_lo <= SMALL_VALID
    n_valid = 0
    for q in range(vptr_lo, vptr_hi):
        if small:
            if _first_time(valid, vptr_lo, q):
                n_valid += 1
        elif vstamp[valid[q]] != sv:
            vstamp[valid[q]] = sv
            n_valid += 1
    new = 0                                            # row tokens that are not the table's
    best = -np.inf
    arg = -1
    bad = False
    for u in range(nt):
        t = Ltouched[u]
        m_, r_ = Lacc[u, 1], Lacc[u, 2]
        if not (np.isfinite(m_) and np.isfinite(r_)):
            bad = True
        if Lacc[u, 4] < 0.0:
            new += 1
        if m_ > best or (m_ == best and t < arg):
            best = m_
            arg = t
    for u in range(nL):                                # the table's largest that the row did not change
        t = tok[by_mid[u]]
        if slot_of(t, Lacc, s, Ltouched, Lwhere) >= 0:
            continue
        m_ = mid[by_mid[u]]
        if m_ > best or (m_ == best and t < arg):
            best = m_
            arg = t
        break
    zeros = V - nL - new
    M = max(M_c, best)
    if zeros > 0:
        M = max(M, 0.0)
    if bad or not np.isfinite(M):
        return 0.0, 1.0, arg, np.nan, np.nan
    if zeros > 0 and best < 0.0:
        arg = -1
    inv_lo = 0.0
    inv_hi = 0.0
    val_lo = 0.0
    val_hi = 0.0
    sub_lo = 0.0
    sub_hi = 0.0
    nsub = 0
    nq = 0
    touched_valid = 0
    for u in range(nt):
        t = Ltouched[u]
        lo = down_signed(down_signed(Lacc[u, 1] - Lacc[u, 2]) - M)
        hi = up_signed(up_signed(Lacc[u, 1] + Lacc[u, 2]) - M)
        nq += 1
        if _is_valid(t, small, valid, vptr_lo, vptr_hi, vstamp, sv):
            touched_valid += 1
            val_lo += exp_memo(lo, memo, -1.0)
            val_hi += exp_memo(hi, memo, 1.0)
        else:
            inv_lo += exp_memo(lo, memo, -1.0)
            inv_hi += exp_memo(hi, memo, 1.0)
        w = int(Lacc[u, 4])
        if w >= 0:
            sub_lo += elo[w]
            sub_hi += ehi[w]
            nsub += 1
    rest_lo = 0.0
    rest_hi = 0.0
    if nL <= DIRECT or 2 * (vptr_hi - vptr_lo) >= nL:
        # a short table, or one the row's valid tokens would cover for the most part: its
        # tokens the row did not change are summed here, as the plain kernel sums them
        for u in range(nL):
            t = tok[u]
            if slot_of(t, Lacc, s, Ltouched, Lwhere) >= 0:
                continue
            lo = down_signed(down_signed(mid[u] - rad[u]) - M)
            hi = up_signed(up_signed(mid[u] + rad[u]) - M)
            nq += 1
            if _is_valid(t, small, valid, vptr_lo, vptr_hi, vstamp, sv):
                touched_valid += 1
                val_lo += exp_memo(lo, memo, -1.0)
                val_hi += exp_memo(hi, memo, 1.0)
            else:
                inv_lo += exp_memo(lo, memo, -1.0)
                inv_hi += exp_memo(hi, memo, 1.0)
    else:
        for q in range(vptr_lo, vptr_hi):              # valid tokens of the table the row did not change
            t = valid[q]
            if small:
                if not _first_time(valid, vptr_lo, q):
                    continue                           # seen already
            elif vstamp[t] != sv:
                continue                               # seen already
            else:
                vstamp[t] = sv + 0.5                   # still valid (no stamp is a half-integer)
            if slot_of(t, Lacc, s, Ltouched, Lwhere) >= 0:
                continue
            w = _position(t, nL, table)
            if w < 0:
                continue
            nq += 1
            touched_valid += 1
            val_lo += exp_memo(down_signed(down_signed(mid[w] - rad[w]) - M), memo, -1.0)
            val_hi += exp_memo(up_signed(up_signed(mid[w] + rad[w]) - M), memo, 1.0)
            sub_lo += elo[w]
            sub_hi += ehi[w]
            nsub += 1
        # Σ over the table's other tokens, relative to M_c: the table's sum minus Q's share
        s_hi = up_signed(factor(nL + 1) * c_hi)
        s_lo = down_signed(shrink(nL) * c_lo)
        q_hi = up_signed(factor(nsub + 1) * sub_hi)
        q_lo = down_signed(shrink(nsub) * sub_lo)
        rest_hi = max(up_signed(s_hi - q_lo), 0.0)
        rest_lo = max(down_signed(s_lo - q_hi), 0.0)
        if M_c != M:                                   # e^(z − M) = e^(z − M_c)·e^(M_c − M)
            rest_hi = up_signed(rest_hi * exp_memo(up_signed(M_c - M), memo, 1.0))
            rest_lo = down_signed(rest_lo * exp_memo(down_signed(M_c - M), memo, -1.0))
    c = factor(nq + 1)
    dd = shrink(nq)
    z_lo = exp_memo(down_signed(-M), memo, -1.0)
    z_hi = exp_memo(up_signed(-M), memo, 1.0)
    zero_valid = n_valid - touched_valid
    zero_invalid = zeros - zero_valid
    inv_hi = up_signed(up_signed(up_signed(c * inv_hi) + up_signed(zero_invalid * z_hi)) + rest_hi)
    val_hi = up_signed(up_signed(c * val_hi) + up_signed(zero_valid * z_hi))
    inv_lo = down_signed(down_signed(down_signed(dd * inv_lo) + down_signed(zero_invalid * z_lo)) + rest_lo)
    val_lo = down_signed(down_signed(dd * val_lo) + down_signed(zero_valid * z_lo))
    err_hi = up_signed(inv_hi / down_signed(inv_hi + val_lo))
    err_lo = down_signed(inv_lo / up_signed(inv_lo + val_hi))
    if not (err_hi <= 1.0):
        err_hi = 1.0
    if not (err_lo >= 0.0):
        err_lo = 0.0
    rho_hi = up_signed(z_hi / down_signed(inv_lo + val_lo))
    rho_lo = down_signed(z_lo / up_signed(inv_hi + val_hi))
    if not (rho_hi <= 1.0):
        rho_hi = 1.0
    if not (rho_lo >= 0.0):
        rho_lo = 0.0
    return err_lo, err_hi, arg, rho_lo, rho_hi


# --- experts -----------------------------------------------------------------------------------------


@kernel()
def _first_of(W1T_ptr, W1T_idx, j, lo_n):
    """The first entry of W_1^T row j at or after neuron ``lo_n`` (rows sorted by neuron)."""
    lo = W1T_ptr[j]
    hi = W1T_ptr[j + 1]
    while lo < hi:
        m = (lo + hi) >> 1
        if W1T_idx[m] < lo_n:
            lo = m + 1
        else:
            hi = m
    return lo


@kernel()
def _activity(zm, zr):
    """ReLU of [zm ± zr] as (mid, rad, on): on is False where it is exactly 0."""
    a_lo = max(down_signed(zm - zr), 0.0)
    a_hi = max(up_signed(zm + zr), 0.0)
    if a_hi == 0.0:
        return 0.0, 0.0, False
    if a_lo == a_hi:
        return a_lo, 0.0, True
    am = 0.5 * a_lo + 0.5 * a_hi
    return am, max(up_signed(a_hi - am), up_signed(am - a_lo)), True


@kernel(args=((I1, I1), I1, PART, PART, LOGITS, LOGITS, CSR, (I1, F1, I1, I1), CSR, CSR, "i64", (I1, I1),
               SCRATCH, "i64", B1, I2), returns=(F1, F1, I1, F1, F1))
def experts_parts(pairs, cohort, S, O, Ls, Lo, W1T, first, W2T, UT, V, valid, scratch, stamp0, watch, active):
    """For each pair (row ``rows[q]``, expert ``experts_of[q]``), the pairs grouped by
    (cohort, expert): error enclosure, argmax token and the zero-logit probability ρ, as
    :func:`verifier.arithmetic.kernels.experts` gives them for gate mode "top1".

    **Per (cohort c, expert k), once.** z^c = W_1·s_c over the neurons s_c reaches (each an
    accumulated sum of products, enclosed [zc ± ρc], before the bias); their activity
    a^c = ReLU(z^c + b_1) (the plain kernel's rounding of the bias) and that of the
    positive-bias neurons s_c does not reach (a^c = b_1); the output W_2·a^c over those
    neurons, and the shared logits U·s_c + U·W_2·a^c, each an enclosed sum of its terms.

    **Per pair.** The own part o_i reaches a set N of neurons: z = [zc ± ρc] (one interval
    term, where s_c reaches the neuron too) + the products of o_i + b_1, and its activity
    a. The output is W_2·a^c + Σ_{g ∈ N} W_2[:, g]·(a_g − a^c_g), an identity (a^c_g = 0
    for a neuron that is off without the row). The row's logits: U·o_i and U times that
    correction, plus the shared logit as one interval term, at every token they reach;
    every other token keeps the shared logit (:func:`_error_parts`).

    ``scratch`` = (the shared z's compact accumulator (acc, touched, where: :func:`_at`),
    per slot of it the shared z and activity (zc mid and radius, a mid and radius, on), the
    row's z accumulator, the y accumulator, the logit accumulator (each compact), valid
    stamps, the cohort table (:func:`_cohort_table`), the watched shared neurons and the
    exp memo).
    Returns per pair
    (err_lo, err_hi, argmax, rho_lo, rho_hi); ``active`` as the plain kernel fills it.
    """
    rows, experts_of = pairs
    S_ptr, S_idx, S_mid, S_rad = S
    O_ptr, O_idx, O_mid, O_rad = O
    Ls_ptr, Ls_idx, Ls_mid, Ls_rad, Ls_mag = Ls
    Lo_ptr, Lo_idx, Lo_mid, Lo_rad, Lo_mag = Lo
    W1T_ptr, W1T_idx, W1T_val = W1T
    off, b1, pos_ptr, pos_idx = first
    W2T_ptr, W2T_idx, W2T_val = W2T
    UT_ptr, UT_idx, UT_val = UT
    valid_ptr, valid = valid
    (zacc, ztouched, zwhere, zc_mid, zc_rad, ac_mid, ac_rad, ac_on, zacc2, ztouched2, zwhere2, yacc, ytouched, ywhere,
     Lacc, Ltouched, Lwhere, vstamp, table, cw, memo) = scratch
    P = rows.size
    err_lo = np.empty(P)
    err_hi = np.empty(P)
    rho_lo = np.empty(P)
    rho_hi = np.empty(P)
    pred = np.empty(P, np.int64)
    watching = watch.size > 0
    R_act = active.shape[1] - 1
    cur_c = -1
    cur_k = -1
    sg = 0.0
    n_groups = 0
    bad_c = False
    nzc = 0
    ncw = 0
    meta = (0, -np.inf, 0.0, 0.0, 0.0)
    for q in range(P):
        i = rows[q]
        k = experts_of[q]
        c = cohort[i]
        s = stamp0 + q
        lo_n, hi_n = off[k], off[k + 1]
        if c != cur_c or k != cur_k:
            # ---- the shared part of (c, k), once -------------------------------------------------
            cur_c, cur_k = c, k
            sg = stamp0 + P + n_groups
            n_groups += 1
            bad_c = False
            nzc = 0
            for e in range(S_ptr[c], S_ptr[c + 1]):
                j = S_idx[e]
                xm = S_mid[e]
                xr = S_rad[e]
                if not (np.isfinite(xm) and np.isfinite(xr)):
                    bad_c = True
                for t in range(_first_of(W1T_ptr, W1T_idx, j, lo_n), W1T_ptr[j + 1]):
                    g = W1T_idx[t]
                    if g >= hi_n:
                        break
                    sl, nzc = slot(g - lo_n, zacc, sg, ztouched, nzc, zwhere)
                    m, a, b = prod_terms(xm, xr, W1T_val[t])
                    add_term(sl, m, a, b, zacc)
            ny = 0
            ncw = 0
            for u in range(nzc):
                g = lo_n + ztouched[u]
                zc_mid[u] = zacc[u, 1]
                zc_rad[u] = entry_radius(zacc[u, 2], zacc[u, 3], int(zacc[u, 4]))
                zm = zc_mid[u] + b1[g]
                zr = up_nonneg(zc_rad[u] + up_nonneg(U * abs(zm)))
                if not (np.isfinite(zm) and np.isfinite(zr)):
                    bad_c = True
                    ac_on[u] = False
                    continue
                ac_mid[u], ac_rad[u], ac_on[u] = _activity(zm, zr)
                if not ac_on[u]:
                    continue
                if watching and watch[g]:
                    cw[ncw] = g
                    ncw += 1
                for t in range(W2T_ptr[g], W2T_ptr[g + 1]):
                    sl, ny = slot(W2T_idx[t], yacc, sg, ytouched, ny, ywhere)
                    m, a, b = prod_terms(ac_mid[u], ac_rad[u], W2T_val[t])
                    add_term(sl, m, a, b, yacc)
            for t in range(pos_ptr[k], pos_ptr[k + 1]):
                g = pos_idx[t]
                if slot_of(g - lo_n, zacc, sg, ztouched, zwhere) >= 0:
                    continue                           # reached: handled above
                if watching and watch[g]:
                    cw[ncw] = g
                    ncw += 1
                for u in range(W2T_ptr[g], W2T_ptr[g + 1]):
                    sl, ny = slot(W2T_idx[u], yacc, sg, ytouched, ny, ywhere)
                    m, a, b = prod_terms(b1[g], 0.0, W2T_val[u])
                    add_term(sl, m, a, b, yacc)
            nL = 0
            for e in range(Ls_ptr[c], Ls_ptr[c + 1]):
                sl, nL = slot(Ls_idx[e], Lacc, sg, Ltouched, nL, Lwhere)
                add_term(sl, Ls_mid[e], Ls_rad[e], abs(Ls_mid[e]), Lacc)
            for u in range(ny):
                j = ytouched[u]
                om = yacc[u, 1]
                orad = entry_radius(yacc[u, 2], yacc[u, 3], int(yacc[u, 4]))
                if not (np.isfinite(om) and np.isfinite(orad)):
                    bad_c = True
                for t in range(UT_ptr[j], UT_ptr[j + 1]):
                    sl, nL = slot(UT_idx[t], Lacc, sg, Ltouched, nL, Lwhere)
                    m, a, b = prod_terms(om, orad, UT_val[t])
                    add_term(sl, m, a, b, Lacc)
            for u in range(nL):
                Lacc[u, 2] = entry_radius(Lacc[u, 2], Lacc[u, 3], int(Lacc[u, 4]))
            M_c, c_lo, c_hi, tbad = _cohort_table(nL, Ltouched, Lacc, table, sg)
            bad_c = bad_c or tbad
            meta = (nL, M_c, c_lo, c_hi, sg)
        # ---- the pair's own part ---------------------------------------------------------------
        bad = bad_c
        nz = 0
        for e in range(O_ptr[i], O_ptr[i + 1]):
            j = O_idx[e]
            xm = O_mid[e]
            xr = O_rad[e]
            if not (np.isfinite(xm) and np.isfinite(xr)):
                bad = True
            for t in range(_first_of(W1T_ptr, W1T_idx, j, lo_n), W1T_ptr[j + 1]):
                g = W1T_idx[t]
                if g >= hi_n:
                    break
                sl, nz = slot(g - lo_n, zacc2, s, ztouched2, nz, zwhere2)
                m, a, b = prod_terms(xm, xr, W1T_val[t])
                add_term(sl, m, a, b, zacc2)
        ny = 0
        n_act = 0
        for u in range(nz):
            loc = ztouched2[u]
            g = lo_n + loc
            mid_ = zacc2[u, 1]
            A = zacc2[u, 2]
            B = zacc2[u, 3]
            cnt = int(zacc2[u, 4])
            uc = slot_of(loc, zacc, sg, ztouched, zwhere)   # the neuron's slot in the shared z, −1: not reached
            reached = uc >= 0
            if reached:                                # the shared z as one interval term
                mid_ += zc_mid[uc]
                A = up_nonneg(A + zc_rad[uc])
                B = up_nonneg(B + abs(zc_mid[uc]))
                cnt += 1
            zm = mid_ + b1[g]
            zr = up_nonneg(entry_radius(A, B, cnt) + up_nonneg(U * abs(zm)))
            if not (np.isfinite(zm) and np.isfinite(zr)):
                bad = True
                continue
            am, ar, on = _activity(zm, zr)
            if on and watching and watch[g]:
                if n_act < R_act:
                    active[q, n_act] = g
                n_act += 1
            if reached:
                cm_, cr_, con = ac_mid[uc], ac_rad[uc], ac_on[uc]
            else:
                cm_, cr_, con = b1[g], 0.0, b1[g] > 0.0
            for t in range(W2T_ptr[g], W2T_ptr[g + 1]):
                j = W2T_idx[t]
                w = W2T_val[t]
                if on:
                    sl, ny = slot(j, yacc, s, ytouched, ny, ywhere)
                    m, a, b = prod_terms(am, ar, w)
                    add_term(sl, m, a, b, yacc)
                if con:
                    sl, ny = slot(j, yacc, s, ytouched, ny, ywhere)
                    m, a, b = prod_terms(cm_, cr_, -w)
                    add_term(sl, m, a, b, yacc)
        if watching:                                   # the shared neurons the row left as they were
            for u in range(ncw):
                g = cw[u]
                if slot_of(g - lo_n, zacc2, s, ztouched2, zwhere2) >= 0:
                    continue
                if n_act < R_act:
                    active[q, n_act] = g
                n_act += 1
        active[q, R_act] = n_act
        if bad:
            err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q] = 0.0, 1.0, -1, np.nan, np.nan
            continue
        nt = 0
        for e in range(Lo_ptr[i], Lo_ptr[i + 1]):
            sl, nt = slot(Lo_idx[e], Lacc, s, Ltouched, nt, Lwhere)
            add_term(sl, Lo_mid[e], Lo_rad[e], abs(Lo_mid[e]), Lacc)
        for u in range(ny):
            j = ytouched[u]
            om = yacc[u, 1]
            orad = entry_radius(yacc[u, 2], yacc[u, 3], int(yacc[u, 4]))
            if not (np.isfinite(om) and np.isfinite(orad)):
                bad = True
            for t in range(UT_ptr[j], UT_ptr[j + 1]):
                sl, nt = slot(UT_idx[t], Lacc, s, Ltouched, nt, Lwhere)
                m, a, b = prod_terms(om, orad, UT_val[t])
                add_term(sl, m, a, b, Lacc)
        if bad:
            err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q] = 0.0, 1.0, -1, np.nan, np.nan
            continue
        tbl_mid, tbl_rad = table[1], table[2]
        for u in range(nt):
            w = _position(Ltouched[u], meta[0], table)
            if w >= 0:                                 # the shared logit as one interval term
                add_term(u, tbl_mid[w], tbl_rad[w], abs(tbl_mid[w]), Lacc)
            Lacc[u, 2] = entry_radius(Lacc[u, 2], Lacc[u, 3], int(Lacc[u, 4]))   # column 2 becomes the radius
            Lacc[u, 4] = w                             # column 4 becomes the table position
        err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q] = _error_parts(
            nt, Ltouched, Lacc, Lwhere, s, table, meta, V, valid_ptr[i], valid_ptr[i + 1], valid, vstamp, s, memo)
    return err_lo, err_hi, pred, rho_lo, rho_hi


# --- ablation --------------------------------------------------------------------------------------------


@kernel()
def _pair_gap_parts(c, i, t, o, S, O, Urows, ut, uo, ustamp, s):
    """:func:`verifier.arithmetic.kernels._pair_gap` for a residual in two parts: a lower
    bound of z_t − z_o = Σ_j (U_tj − U_oj)·(s_cj + o_ij), the entries of both parts as
    separate terms (a coordinate in both parts contributes two products)."""
    S_ptr, S_idx, S_mid, S_rad = S
    O_ptr, O_idx, O_mid, O_rad = O
    U_ptr, U_idx, U_val = Urows
    width = ut.size
    for q in range(U_ptr[t], U_ptr[t + 1]):
        if U_idx[q] < width:
            ut[U_idx[q]] = U_val[q]
            ustamp[U_idx[q], 0] = s
    for q in range(U_ptr[o], U_ptr[o + 1]):
        if U_idx[q] < width:
            uo[U_idx[q]] = U_val[q]
            ustamp[U_idx[q], 1] = s
    mid = 0.0
    A = 0.0
    B = 0.0
    n = 0
    for part in range(2):
        ptr, idx, rm, rr, row = (S_ptr, S_idx, S_mid, S_rad, c) if part == 0 else (O_ptr, O_idx, O_mid, O_rad, i)
        for e in range(ptr[row], ptr[row + 1]):
            j = idx[e]
            a = ut[j] if ustamp[j, 0] == s else 0.0
            b = uo[j] if ustamp[j, 1] == s else 0.0
            if a == b:
                continue
            d = a - b
            bb = d - a                                 # TwoSum: d + err = a − b exactly
            err = (a - (d - bb)) + (-b - bb)
            if err != 0.0 or not np.isfinite(d):
                return -np.inf
            m, ta, tb = prod_terms(rm[e], rr[e], d)
            mid += m
            A = up_nonneg(A + ta)
            B = up_nonneg(B + tb)
            n += 1
    if n == 0:
        return 0.0
    r = entry_radius(A, B, n)
    if not (np.isfinite(mid) and np.isfinite(r)):
        return -np.inf
    return down_signed(mid - r)


@kernel(args=(I1, I1, LOGITS, LOGITS, "i64", I1, I1, ACC, F1, TABLE_ARRAYS, F2, "i64", I1, PART, PART, CSR,
               (F1, F1, F2)), returns=(F1, F1, F1, F1, F1, I1, F1))
def ablated_parts(rows, cohort, Ls, Lo, V, valid_ptr, valid, L_scratch, vstamp, table, memo, stamp0, target, S,
                  O, Urows, u_scratch):
    """The ablated quantities of :func:`verifier.arithmetic.kernels.ablated` (exact pass)
    for ``rows`` (grouped by cohort), from the logits U·r = U·s_c + U·o_i: the error
    enclosure and ρ (:func:`_error_parts` over the cohort's table of U·s_c and the row's
    tokens), and for a row with a target o the lower bound of max_{t != o} z_t − z_o
    (the largest lower end among the other tokens, a token of logit 0 counting 0, minus
    the upper end of z_o; where negative, also the direct comparison of the largest
    other token with o, :func:`_pair_gap_parts`), the count of other tokens of logit
    exactly 0, and a lower end of 1 − P(o) for o alone. A token in both parts has the
    logit [m_s ± ρ_s] + [m_o ± ρ_o], two interval terms. Stamps: ``stamp0 + q`` and
    ``stamp0 + P + q`` per row, ``stamp0 + 2P + g`` per cohort. ``L_scratch``: the logits'
    compact accumulator (acc, touched, where: :func:`_at`). ``u_scratch``: the work
    arrays (ut, uo, ustamp) of :func:`_pair_gap_parts`, over the residual coordinates
    (stamp 0: no row's), kept by the caller: allocating them per call cost a pass over d
    coordinates per batch (at 20M facts, d = 15M: most of the ablation's time)."""
    Ls_ptr, Ls_idx, Ls_mid, Ls_rad, Ls_mag = Ls
    Lo_ptr, Lo_idx, Lo_mid, Lo_rad, Lo_mag = Lo
    tok, mid, rad, by_mid, by_lo = table[0], table[1], table[2], table[5], table[6]
    P = rows.size
    err_lo = np.empty(P)
    err_hi = np.empty(P)
    rho_lo = np.empty(P)
    rho_hi = np.empty(P)
    gap = np.full(P, np.nan)
    zeros = np.full(P, -1, np.int64)
    obj_lo = np.full(P, np.nan)
    only = np.empty(1, np.int64)
    ut, uo, ustamp = u_scratch
    Lacc, Ltouched, Lwhere = L_scratch
    cur = -1
    n_groups = 0
    meta = (0, -np.inf, 0.0, 0.0, 0.0)
    bad_c = False
    sg = 0.0
    for q in range(P):
        i = rows[q]
        c = cohort[i]
        s = stamp0 + q
        if c != cur:
            cur = c
            sg = stamp0 + 2 * P + n_groups
            n_groups += 1
            nL = 0
            for e in range(Ls_ptr[c], Ls_ptr[c + 1]):
                sl, nL = slot(Ls_idx[e], Lacc, sg, Ltouched, nL, Lwhere)
                Lacc[sl, 1] = Ls_mid[e]
                Lacc[sl, 2] = Ls_rad[e]
            M_c, c_lo, c_hi, bad_c = _cohort_table(nL, Ltouched, Lacc, table, sg)
            meta = (nL, M_c, c_lo, c_hi, sg)
        nL = meta[0]
        nt = 0
        for e in range(Lo_ptr[i], Lo_ptr[i + 1]):
            t = Lo_idx[e]
            sl, nt = slot(t, Lacc, s, Ltouched, nt, Lwhere)
            w = _position(t, nL, table)
            if w >= 0:
                Lacc[sl, 1] = Lo_mid[e] + mid[w]
                Lacc[sl, 2] = entry_radius(up_nonneg(Lo_rad[e] + rad[w]), up_nonneg(abs(Lo_mid[e]) + abs(mid[w])), 2)
            else:
                Lacc[sl, 1] = Lo_mid[e]
                Lacc[sl, 2] = Lo_rad[e]
            Lacc[sl, 4] = w
        if bad_c:
            err_lo[q], err_hi[q], rho_lo[q], rho_hi[q] = 0.0, 1.0, np.nan, np.nan
            if target[i] >= 0:
                gap[q], zeros[q], obj_lo[q] = -np.inf, V - nL - nt, 0.0
            continue
        lo, hi, _, r_lo, r_hi = _error_parts(nt, Ltouched, Lacc, Lwhere, s, table, meta, V, valid_ptr[i],
                                             valid_ptr[i + 1], valid, vstamp, s, memo)
        err_lo[q], err_hi[q], rho_lo[q], rho_hi[q] = lo, hi, r_lo, r_hi
        o = target[i]
        if o < 0:
            continue
        # L2: the largest lower end among the tokens other than o, against the upper end of z_o
        hi_o = 0.0
        o_touched = False
        best = -np.inf
        best_m = -np.inf
        best_t = -1
        finite = True
        new = 0
        for u in range(nt):
            t = Ltouched[u]
            m_, r_ = Lacc[u, 1], Lacc[u, 2]
            if Lacc[u, 4] < 0.0:
                new += 1
            if not (np.isfinite(m_) and np.isfinite(r_)):
                finite = False
            if t == o:
                hi_o = up_signed(m_ + r_)
                o_touched = True
            else:
                best = max(best, down_signed(m_ - r_))
                if m_ > best_m or (m_ == best_m and t < best_t):
                    best_m = m_
                    best_t = t
        w_o = _position(o, nL, table) if not o_touched else -1
        if w_o >= 0:
            hi_o = up_signed(mid[w_o] + rad[w_o])
            o_touched = True
        for u in range(nL):
            t = tok[by_lo[u]]
            if t == o or slot_of(t, Lacc, s, Ltouched, Lwhere) >= 0:
                continue
            best = max(best, down_signed(mid[by_lo[u]] - rad[by_lo[u]]))
            break
        for u in range(nL):
            t = tok[by_mid[u]]
            if t == o or slot_of(t, Lacc, s, Ltouched, Lwhere) >= 0:
                continue
            if mid[by_mid[u]] > best_m or (mid[by_mid[u]] == best_m and t < best_t):
                best_m = mid[by_mid[u]]
                best_t = t
            break
        zero = V - nL - new - (0 if o_touched else 1)
        zeros[q] = zero
        if not finite:
            gap[q] = -np.inf
        else:
            if zero > 0 and best < 0.0:
                best = 0.0
            if not np.isfinite(best):
                gap[q] = -np.inf
            elif best >= hi_o:                         # the exact difference is >= 0: a tie is certified
                gap[q] = max(down_signed(best - hi_o), 0.0)
            else:
                gap[q] = down_signed(best - hi_o)
            if not (gap[q] >= 0.0) and best_t >= 0:
                pg = _pair_gap_parts(c, i, best_t, o, S, O, Urows, ut, uo, ustamp, float(s))
                if pg > gap[q]:
                    gap[q] = pg
        # L1: 1 − P(o) for o alone
        only[0] = o
        v_lo, v_hi = valid_ptr[i], valid_ptr[i + 1]
        if v_hi - v_lo == 1 and valid[v_lo] == o:
            obj_lo[q] = lo
        else:
            obj_lo[q] = _error_parts(nt, Ltouched, Lacc, Lwhere, s, table, meta, V, 0, 1, only, vstamp, s + P, memo)[0]
    return err_lo, err_hi, rho_lo, rho_hi, gap, zeros, obj_lo
