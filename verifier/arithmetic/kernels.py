"""Compiled row kernels of the certified pass (numba): residual, gate, experts, logits, error.

Every function here computes, one query row at a time, exactly the enclosures that
:mod:`verifier.arithmetic.interval` defines, with the same arithmetic model (A1)–(A3) and the same
two lemmas; only the bookkeeping differs. Instead of batched sparse products (which
sort, allocate and compute structural patterns separately), each row accumulates its
terms in a *sparse accumulator*: a dense scratch array indexed by column, plus a list
of the columns touched for this row (a stamp per column says which row last touched
it, so nothing is ever cleared). A column is touched exactly when some term of the
forward pass contributes to it, so "absent" is structural by construction: an entry
no term reaches is exactly 0, and an entry whose terms underflowed keeps its floor
2n·η.

Per entry with n terms t_1..t_n (each a product of a float x and a weight w, or a
plain interval), the kernels accumulate, in the order the terms arrive:

* ``mid``: the float sum of the terms' midpoints (products rounded to nearest);
* ``A``: the float sum of the terms' own radii, each rounded up (``up(xr·|w|)``);
* ``B``: the float sum of ``up(|xm|·|w|)`` (for the rounding of ``mid``);

and the entry's radius is ``up(up(c_n·up(A + up(γ_n·B))) + 2n·η)``. By Lemma 1 the
true sums are at most c_n times the computed ones (non-negative terms, additions
only), and by Lemma 2 the midpoint's own error is at most γ_n·ΣB + n·η: the radius
bounds |exact − mid|. A non-finite mid or radius makes the whole row undecided.

The rounding steps (``up``, ``down``, ``up_nonneg``) and the rounding factors are those of
:mod:`verifier.arithmetic.rounding`, which also probes the arithmetic of compiled code.
"""

from __future__ import annotations

import math

import numpy as np
from verifier.arithmetic.compiled import kernel

from verifier.arithmetic.accumulate import (ATTENTION, B1, CSR, F1, F2, HEADS, I1, I2, J1, J2, LOGITS, PART, add_term,
                                            entry_radius, mul_interval, prod_terms, slot, touch)
from verifier.arithmetic.constants import FLOOR, U
from verifier.arithmetic.deployed import DEPLOYED, KC, SM, widen, widen_logit, widen_output, widen_residual, zero_read
from verifier.arithmetic.exponential import exp_lower, exp_upper
from verifier.arithmetic.rounding import down, gamma, sum_factor, up, up_nonneg, up_one_plus

# --- experts, logits and the error ----------------------------------------------------------------


@kernel(args=(I1, I1, I1), returns=I1)
def logits_bound(R_ptr, R_idx, UT_ptr):
    """Per row, an upper bound on the number of logits U·r reaches (for allocation and chunking)."""
    n = R_ptr.size - 1
    out = np.zeros(n, np.int64)
    for i in range(n):
        c = 0
        for e in range(R_ptr[i], R_ptr[i + 1]):
            j = R_idx[e]
            c += UT_ptr[j + 1] - UT_ptr[j]
        out[i] = c
    return out


@kernel(args=(I1, I1, F1, F1, I1, I1, F1, F2, I1, J1, "i64", "i64"), returns=LOGITS)
def logits(R_ptr, R_idx, R_mid, R_rad, UT_ptr, UT_idx, UT_val, Lacc, Ltouched, Lwhere, stamp0, capacity):
    """U·r for every row, as CSR (ptr, idx, mid, rad, mag): the logits without any expert's
    output, and per logit an upper bound of Σ_j |U_tj|·(|r_j| + rad_j) (the magnitude the
    deployed pass's rounding is relative to).

    By linearity U·y = U·r + U·(c·W_2·a): these enclose the first part once per row, for
    the ablation and for every expert that may win. A token no entry of r reaches is
    absent (its logit from r is exactly 0). The sums are kept in a compact accumulator
    (``Lacc``, ``Ltouched``, ``Lwhere``: :func:`_at`).
    """
    n = R_ptr.size - 1
    out_ptr = np.zeros(n + 1, np.int64)
    out_idx = np.empty(capacity, np.int64)
    out_mid = np.empty(capacity)
    out_rad = np.empty(capacity)
    out_mag = np.empty(capacity)
    e_out = 0
    for i in range(n):
        s = stamp0 + i
        nt = 0
        for e in range(R_ptr[i], R_ptr[i + 1]):
            j = R_idx[e]
            for q in range(UT_ptr[j], UT_ptr[j + 1]):
                sl, nt = slot(UT_idx[q], Lacc, s, Ltouched, nt, Lwhere)
                m, a, b = prod_terms(R_mid[e], R_rad[e], UT_val[q])
                add_term(sl, m, a, b, Lacc)
        for u in range(nt):
            r = entry_radius(Lacc[u, 2], Lacc[u, 3], int(Lacc[u, 4]))
            out_idx[e_out] = Ltouched[u]
            out_mid[e_out] = Lacc[u, 1]
            out_rad[e_out] = r if np.isfinite(Lacc[u, 1]) and np.isfinite(r) else np.inf
            out_mag[e_out] = up_nonneg(Lacc[u, 2] + Lacc[u, 3])         # >= Σ_j |U_tj|·|r̂_j| (the deployed pass's)
            e_out += 1
        out_ptr[i + 1] = e_out
    return out_ptr, out_idx[:e_out], out_mid[:e_out], out_rad[:e_out], out_mag[:e_out]


@kernel()
def _error(nt, Ltouched, Lacc, V, vptr_lo, vptr_hi, valid, vstamp, s):
    """Enclosure (lo, hi) of 1 − P(valid), the argmax token (−1: a zero logit), and an
    enclosure (rho_lo, rho_hi) of ρ = e^(0 − M)/(S_inv + S_val), the probability one token
    of logit exactly 0 has, from the logits in the accumulator (for the ``nt`` tokens in
    ``Ltouched``, mid in column 1 and *radius* in column 2). A token not touched has logit
    exactly 0 and is counted, not enumerated. error = S_inv/(S_inv + S_val) with S the sums
    of e^(l − M): increasing in S_inv, decreasing in S_val. (ρ lets a saved certificate
    account for tokens added to or removed from the vocabulary: verifier.certificates.incremental.)
    """
    n_valid = 0
    for q in range(vptr_lo, vptr_hi):
        if vstamp[valid[q]] != s:
            vstamp[valid[q]] = s
            n_valid += 1
    zeros = V - nt
    M = 0.0 if zeros > 0 else -np.inf
    bad = False
    best = -np.inf
    arg = -1
    for u in range(nt):
        t = Ltouched[u]
        if not (np.isfinite(Lacc[t, 1]) and np.isfinite(Lacc[t, 2])):
            bad = True
        M = max(M, Lacc[t, 1])
        if Lacc[t, 1] > best:
            best = Lacc[t, 1]
            arg = t
    if bad or not np.isfinite(M):
        return 0.0, 1.0, arg, np.nan, np.nan
    if zeros > 0 and best < 0.0:
        arg = -1
    inv_lo = 0.0
    inv_hi = 0.0
    val_lo = 0.0
    val_hi = 0.0
    touched_valid = 0
    for u in range(nt):
        t = Ltouched[u]
        lo = down(down(Lacc[t, 1] - Lacc[t, 2]) - M)
        hi = up(up(Lacc[t, 1] + Lacc[t, 2]) - M)
        if vstamp[t] == s:
            touched_valid += 1
            val_lo += exp_lower(lo)
            val_hi += exp_upper(hi)
        else:
            inv_lo += exp_lower(lo)
            inv_hi += exp_upper(hi)
    c = sum_factor(nt + 1)
    dd = down(1.0 - gamma(nt + 1))
    z_lo = exp_lower(down(-M))
    z_hi = exp_upper(up(-M))
    zero_valid = n_valid - touched_valid
    zero_invalid = zeros - zero_valid
    inv_hi = up(up(c * inv_hi) + up(zero_invalid * z_hi))
    val_hi = up(up(c * val_hi) + up(zero_valid * z_hi))
    inv_lo = down(down(dd * inv_lo) + down(zero_invalid * z_lo))
    val_lo = down(down(dd * val_lo) + down(zero_valid * z_lo))
    err_hi = up(inv_hi / down(inv_hi + val_lo))
    err_lo = down(inv_lo / up(inv_lo + val_hi))
    if not (err_hi <= 1.0):
        err_hi = 1.0
    if not (err_lo >= 0.0):
        err_lo = 0.0
    rho_hi = up(z_hi / down(inv_lo + val_lo))
    rho_lo = down(z_lo / up(inv_hi + val_hi))
    if not (rho_hi <= 1.0):
        rho_hi = 1.0
    if not (rho_lo >= 0.0):
        rho_lo = 0.0
    return err_lo, err_hi, arg, rho_lo, rho_hi


@kernel()
def _error_deployed(nt, Ltouched, Lacc, V, vptr_lo, vptr_hi, valid, vstamp, s, sm):
    """Enclosure (lo, hi) of 1 − Σ_valid p̂ for the deployed pass (Lemma F2 of
    verifier.passes.floating with the valid tokens' mass, as its softmax constants ``sm`` give
    it): each logit's exp relative to a common shift, widened by the shift's rounding
    θ = rel·(M_hi − lo) + tiny and the exp's and its stores' factors; the sums of the valid
    and the other tokens' terms; the ratio's factors and τ. Also the argmax token as
    :func:`_error` gives it; ρ is not defined here (NaN)."""
    n_valid = 0
    for q in range(vptr_lo, vptr_hi):
        if vstamp[valid[q]] != s:
            vstamp[valid[q]] = s
            n_valid += 1
    zeros = V - nt
    bad = False
    best = -np.inf
    arg = -1
    Mhi = 0.0 if zeros > 0 else -np.inf
    c = 0.0 if zeros > 0 else -np.inf
    for u in range(nt):
        t = Ltouched[u]
        m_, r_ = Lacc[t, 1], Lacc[t, 2]
        if not (np.isfinite(m_) and np.isfinite(r_)):
            bad = True
        Mhi = max(Mhi, up(m_ + r_))
        c = max(c, m_)
        if m_ > best:
            best = m_
            arg = t
    if bad or not (np.isfinite(Mhi) and np.isfinite(c)):
        return 0.0, 1.0, arg
    if zeros > 0 and best < 0.0:
        arg = -1
    rel, tiny, lo_f, hi_f = sm[SM.rel], sm[SM.tiny], sm[SM.lo], sm[SM.hi]
    A_lo = 0.0
    A_hi = 0.0
    B_lo = 0.0
    B_hi = 0.0
    touched_valid = 0
    for u in range(nt):
        t = Ltouched[u]
        lo = down(Lacc[t, 1] - Lacc[t, 2])
        hi = up(Lacc[t, 1] + Lacc[t, 2])
        theta = up_nonneg(up_nonneg(rel * up(Mhi - lo)) + tiny)
        e_lo = max(down(exp_lower(down(down(lo - theta) - c)) * lo_f), 0.0)
        e_hi = up(exp_upper(up(up(hi + theta) - c)) * hi_f)
        if vstamp[t] == s:
            touched_valid += 1
            A_lo += e_lo
            A_hi += e_hi
        else:
            B_lo += e_lo
            B_hi += e_hi
    theta0 = up_nonneg(up_nonneg(rel * up(Mhi - 0.0)) + tiny)
    z_lo = max(down(exp_lower(down(down(0.0 - theta0) - c)) * lo_f), 0.0)
    z_hi = up(exp_upper(up(up(0.0 + theta0) - c)) * hi_f)
    zero_valid = n_valid - touched_valid
    zero_invalid = zeros - zero_valid
    cf = sum_factor(nt + 2)
    dd = down(1.0 - gamma(nt + 2))
    A_hi = up(up(cf * A_hi) + up(zero_valid * z_hi))
    B_hi = up(up(cf * B_hi) + up(zero_invalid * z_hi))
    A_lo = down(down(dd * A_lo) + down(zero_valid * z_lo))
    B_lo = down(down(dd * B_lo) + down(zero_invalid * z_lo))
    r_lo = down(A_lo / up(A_lo + B_hi))
    r_hi = up(A_hi / down(A_hi + B_lo))
    if not (r_lo >= 0.0):
        r_lo = 0.0
    if not (r_hi <= 1.0):
        r_hi = 1.0
    f_lo, f_hi, tau = sm[SM.f_lo], sm[SM.f_hi], sm[SM.tau]
    mass_lo = max(down(down(r_lo * f_lo) - tau), 0.0)
    total_hi = up(f_hi + tau)
    mass_hi = min(up(up(r_hi * f_hi) + tau), total_hi)
    err_lo = down(1.0 - mass_hi)
    err_hi = min(up(1.0 - mass_lo), 1.0)
    return err_lo, err_hi, arg


@kernel(args=((I1, I1), (F1, F1), PART, LOGITS, CSR, (I1, F1, I1, I1), CSR, CSR, "i64", (I1, I1),
               (F2, I1, F2, I1, F2, I1, F1), "i64", B1, I2, DEPLOYED), returns=(F1, F1, I1, F1, F1, B1))
def experts(pairs, scale, R, L, W1T, first, W2T, UT, V, valid, scratch, stamp0, watch, active, deployed):
    """For each pair (row ``rows[q]``, expert ``experts_of[q]``) of ``pairs``, with the
    expert's output scaled by [cm ± cr] (``scale``; 1 ± 0 in gate mode "top1"): error
    enclosure, argmax token, the zero-logit probability ρ (:func:`_error`), and whether a
    value of the pair may be non-finite (then the error is [0, 1]).

    Arguments by group: ``R`` the residual rows (ptr, idx, mid, rad), ``L`` their logits U·r
    (:func:`logits`, the same form), ``W1T``, ``W2T``, ``UT`` the first layers of all experts,
    the second layers and the unembedding as transposed CSR (ptr, idx, val), ``first`` where
    each expert's neurons start (``off``), their biases ``b1`` and the positive-bias neurons
    of each expert (``pos_ptr``, ``pos_idx``), ``V`` the vocabulary size, ``valid`` each row's
    valid next tokens (ptr, tokens), ``scratch`` the sparse accumulators (z, y and logits
    with their touched lists, and the valid-token stamps).

    ``watch`` (bool per neuron, over all experts; empty: none) selects neurons whose
    possible activity is recorded: ``active[q, :R]`` receives up to R = active.shape[1] − 1
    watched neurons that may be on for pair q (upper end of ReLU(z) above 0, or a positive
    bias), ``active[q, R]`` how many there were (more than R: the list is incomplete).

    z = W_1 r + b_1 per neuron the row reaches (a neuron it does not reach has
    pre-activation exactly b_1 and contributes max(b_1, 0)); a = ReLU(z);
    o = c·W_2·a; the logits are U·r (``L``, :func:`logits`) plus U·o, summed per token.

    ``deployed`` = (on, constants, the output softmax's constants, row sums of W_1, of W_2
    and of U, each row's Σ|r̂|, a per-token scratch array): in the deployed pass of a format
    each neuron's pre-activation, each output coordinate and each logit also carries its
    stage's rounding (relative to the magnitudes the accumulators hold), floor and
    inputs-read-as-zero allowance (verifier.passes.floating: Stages), a magnitude that may reach
    the format's largest value makes the pair undecided, and the error is Lemma F2's
    (:func:`_error_deployed`; no ρ).
    """
    rows, experts_of = pairs
    cm, cr = scale
    R_ptr, R_idx, R_mid, R_rad = R
    L_ptr, L_idx, L_mid, L_rad, L_mag = L
    on, fp, sm, rs_z, rs_2, rs_l, l1r, lmag = deployed
    W1T_ptr, W1T_idx, W1T_val = W1T
    off, b1, pos_ptr, pos_idx = first
    W2T_ptr, W2T_idx, W2T_val = W2T
    UT_ptr, UT_idx, UT_val = UT
    valid_ptr, valid = valid
    zacc, ztouched, yacc, ytouched, Lacc, Ltouched, vstamp = scratch
    P = rows.size
    err_lo = np.empty(P)
    err_hi = np.empty(P)
    rho_lo = np.empty(P)
    rho_hi = np.empty(P)
    pred = np.empty(P, np.int64)
    undecided = np.zeros(P, np.bool_)
    watching = watch.size > 0
    R_act = active.shape[1] - 1
    for q in range(P):
        i = rows[q]
        k = experts_of[q]
        s = stamp0 + q
        lo_n, hi_n = off[k], off[k + 1]
        bad = False
        scaled = cr[q] != 0.0 or cm[q] != 1.0
        # z = W_1 r over the neurons of expert k that row i reaches
        nz = 0
        for e in range(R_ptr[i], R_ptr[i + 1]):
            j = R_idx[e]
            xm = R_mid[e]
            xr = R_rad[e]
            if not (np.isfinite(xm) and np.isfinite(xr)):
                bad = True
            # the entries of W_1^T row j that belong to expert k: neurons lo_n..hi_n−1 (sorted)
            a0 = W1T_ptr[j]
            a1 = W1T_ptr[j + 1]
            start = a0 + np.searchsorted(W1T_idx[a0:a1], lo_n)
            for t in range(start, a1):
                g = W1T_idx[t]
                if g >= hi_n:
                    break
                loc = g - lo_n
                nz = touch(loc, zacc, s, ztouched, nz)
                m, a, b = prod_terms(xm, xr, W1T_val[t])
                add_term(loc, m, a, b, zacc)
        # o = c·W_2·a: the reached neurons that are on, then the positive-bias neurons not reached
        ny = 0
        l1a = 0.0
        for u in range(nz):
            loc = ztouched[u]
            g = lo_n + loc
            zm = zacc[loc, 1] + b1[g]
            zr = up_nonneg(entry_radius(zacc[loc, 2], zacc[loc, 3], int(zacc[loc, 4])) + up_nonneg(U * abs(zm)))
            if on:
                zr = widen(zr, up_nonneg(up_nonneg(zacc[loc, 2] + zacc[loc, 3]) + abs(b1[g])), fp[KC.rho_z],
                                     fp[KC.f_z], zero_read(fp, up_nonneg(l1r[i] + rs_z[g])), fp[KC.largest])
            if not (np.isfinite(zm) and np.isfinite(zr)):
                bad = True
                continue
            a_lo = max(down(zm - zr), 0.0)
            a_hi = max(up(zm + zr), 0.0)
            if a_hi == 0.0:
                continue                                  # exactly 0: the neuron is off
            l1a = up_nonneg(l1a + a_hi)
            if watching and watch[g]:
                c_act = active[q, R_act]
                if c_act < R_act:
                    active[q, c_act] = g
                active[q, R_act] = c_act + 1
            if a_lo == a_hi:
                am, ar = a_lo, 0.0
            else:
                am = 0.5 * a_lo + 0.5 * a_hi
                ar = max(up(a_hi - am), up(am - a_lo))
            if scaled:
                am, ar = mul_interval(am, ar, cm[q], cr[q])
            for t in range(W2T_ptr[g], W2T_ptr[g + 1]):
                j = W2T_idx[t]
                ny = touch(j, yacc, s, ytouched, ny)
                m, a, b = prod_terms(am, ar, W2T_val[t])
                add_term(j, m, a, b, yacc)
        for t in range(pos_ptr[k], pos_ptr[k + 1]):
            g = pos_idx[t]
            loc = g - lo_n
            if zacc[loc, 0] == s:
                continue                                  # reached: handled above
            if watching and watch[g]:
                c_act = active[q, R_act]
                if c_act < R_act:
                    active[q, c_act] = g
                active[q, R_act] = c_act + 1
            am, ar = b1[g], 0.0
            l1a = up_nonneg(l1a + abs(am))
            if scaled:
                am, ar = mul_interval(am, ar, cm[q], cr[q])
            for u in range(W2T_ptr[g], W2T_ptr[g + 1]):
                j = W2T_idx[u]
                ny = touch(j, yacc, s, ytouched, ny)
                m, a, b = prod_terms(am, ar, W2T_val[u])
                add_term(j, m, a, b, yacc)
        if bad:
            err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q] = 0.0, 1.0, -1, np.nan, np.nan
            undecided[q] = True
            continue
        # logits: U·r (one interval term per token) plus U·o (product terms)
        nt = 0
        for e in range(L_ptr[i], L_ptr[i + 1]):
            t = L_idx[e]
            if on and Lacc[t, 0] != s:
                lmag[t] = 0.0
            nt = touch(t, Lacc, s, Ltouched, nt)
            add_term(t, L_mid[e], L_rad[e], abs(L_mid[e]), Lacc)
            if on:
                lmag[t] = up_nonneg(lmag[t] + L_mag[e])
        cmax = up_nonneg(abs(cm[q]) + cr[q]) if scaled else 1.0
        l1o = 0.0
        for u in range(ny):
            j = ytouched[u]
            om = yacc[j, 1]
            orad = entry_radius(yacc[j, 2], yacc[j, 3], int(yacc[j, 4]))
            if on:
                orad = widen_output(orad, up_nonneg(yacc[j, 2] + yacc[j, 3]), fp, cmax,
                                        zero_read(fp, up_nonneg(l1a + rs_2[j])))
                l1o = up_nonneg(l1o + up_nonneg(abs(om) + orad))
            if not (np.isfinite(om) and np.isfinite(orad)):
                bad = True
            for t in range(UT_ptr[j], UT_ptr[j + 1]):
                tok = UT_idx[t]
                if on and Lacc[tok, 0] != s:
                    lmag[tok] = 0.0
                nt = touch(tok, Lacc, s, Ltouched, nt)
                m, a, b = prod_terms(om, orad, UT_val[t])
                add_term(tok, m, a, b, Lacc)
                if on:
                    lmag[tok] = up_nonneg(lmag[tok] + up_nonneg(a + b))
        if bad:
            err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q] = 0.0, 1.0, -1, np.nan, np.nan
            undecided[q] = True
            continue
        # the output sum y = r + o and its logits: ||ŷ||_1 <= (1 + ρ_y)(||r̂||_1 + ||ô||_1) + (its entries)·floor
        # (deployed pass only: in the exact pass fp and l1r are one-element placeholders)
        l1y = 0.0
        if on:
            l1y = up_nonneg(up_nonneg(up_one_plus(fp[KC.rho_y]) * up_nonneg(l1r[i] + l1o)) + up_nonneg((R_ptr[i + 1] - R_ptr[i] + ny) * fp[KC.f_y]))
        for u in range(nt):
            t = Ltouched[u]
            Lacc[t, 2] = entry_radius(Lacc[t, 2], Lacc[t, 3], int(Lacc[t, 4]))   # column 2 becomes the radius
            if on:
                Lacc[t, 2] = widen_logit(Lacc[t, 2], lmag[t], fp, rs_l[t], l1y, True)
        if on:
            for u in range(nt):
                if not np.isfinite(Lacc[Ltouched[u], 2]):
                    undecided[q] = True
            err_lo[q], err_hi[q], pred[q] = _error_deployed(nt, Ltouched, Lacc, V, valid_ptr[i], valid_ptr[i + 1],
                                                            valid, vstamp, s, sm)
            rho_lo[q], rho_hi[q] = np.nan, np.nan
        else:
            err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q] = _error(nt, Ltouched, Lacc, V, valid_ptr[i],
                                                                         valid_ptr[i + 1], valid, vstamp, s)
    return err_lo, err_hi, pred, rho_lo, rho_hi, undecided


@kernel()
def _top_gap(nt, Ltouched, Lacc, V, o):
    """A lower bound of max_{t != o} z_t − z_o over the logits in the accumulator (the
    ``nt`` tokens of ``Ltouched``, mid in column 1 and radius in column 2; every other
    token of the ``V`` has logit exactly 0), and the number of tokens other than ``o`` of
    logit exactly 0.

    Why it is a lower bound: z_o <= hi(z_o) (its enclosure's upper end, or exactly 0 when
    ``o`` is not touched), and max_{t != o} z_t >= lo(z_t) for each touched t != o, and
    >= 0 when some token other than o is untouched; the difference is rounded downward,
    and where the two floats compare best >= hi(z_o) the exact difference is >= 0, so 0
    is a lower bound too (an exact tie, as between two logits of exactly 0, is kept).
    A non-finite enclosure among the touched logits decides nothing (−∞). The bound is
    >= 0 exactly when some token t != o is certified to have z_t >= z_o (L2: o is not the
    strict top token; a tie counts, as a greedy argmax may return either)."""
    hi_o = 0.0
    touched_o = False
    best = -np.inf
    for u in range(nt):
        t = Ltouched[u]
        m, r = Lacc[t, 1], Lacc[t, 2]
        if not (np.isfinite(m) and np.isfinite(r)):
            return -np.inf, V - nt
        if t == o:
            hi_o = up(m + r)
            touched_o = True
        else:
            lo = down(m - r)
            if lo > best:
                best = lo
    zeros = V - nt - (0 if touched_o else 1)
    if zeros > 0 and best < 0.0:
        best = 0.0
    if not np.isfinite(best):
        return -np.inf, zeros
    if best >= hi_o:               # the exact difference is >= 0: a tie is certified as such
        return max(down(best - hi_o), 0.0), zeros
    return down(best - hi_o), zeros


@kernel()
def _pair_gap(i, t, o, R, Urows, ut, uo, ustamp, s):
    """A lower bound of z_t − z_o = Σ_j (U_tj − U_oj)·r_j for row i of the residual ``R``
    (CSR: ptr, idx, mid, rad; r_j exactly 0 off its entries), from the difference of the two
    rows of U (``Urows``: U as CSR by token) rather than of the two logits' enclosures: a
    coordinate where U_tj = U_oj contributes exactly 0 whatever r_j is, so a common part of
    the two rows (a shared offset, however large) costs nothing. Each other term is the
    interval r_j times the float d_j = U_tj − U_oj when that difference is exact (checked
    by TwoSum); the terms are summed as every entry of the pass is (the module docstring's
    radius). Returns −∞ when a difference is not exact or a value is not finite (the caller
    keeps its other bound); exactly 0 when no coordinate contributes."""
    R_ptr, R_idx, R_mid, R_rad = R
    U_ptr, U_idx, U_val = Urows
    width = ut.size                              # coordinates beyond it meet no entry of r
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
    for e in range(R_ptr[i], R_ptr[i + 1]):
        j = R_idx[e]
        a = ut[j] if ustamp[j, 0] == s else 0.0
        b = uo[j] if ustamp[j, 1] == s else 0.0
        if a == b:
            continue
        d = a - b
        bb = d - a                               # TwoSum: d + err = a − b exactly
        err = (a - (d - bb)) + (-b - bb)
        if err != 0.0 or not np.isfinite(d):
            return -np.inf
        m, ta, tb = prod_terms(R_mid[e], R_rad[e], d)
        mid += m
        A = up_nonneg(A + ta)
        B = up_nonneg(B + tb)
        n += 1
    if n == 0:
        return 0.0
    r = entry_radius(A, B, n)
    if not (np.isfinite(mid) and np.isfinite(r)):
        return -np.inf
    return down(mid - r)


@kernel(args=(I1, LOGITS, "i64", I1, I1, F2, I1, F1, "i64", DEPLOYED, I1, PART, CSR, (F1, F1, F2)),
        returns=(F1, F1, F1, F1, F1, I1, F1))
def ablated(rows, L, V, valid_ptr, valid, Lacc, Ltouched, vstamp, stamp0, deployed, target, R, Urows, u_scratch):
    """The error enclosure of softmax(U·r) (the routed expert's output removed) for ``rows``,
    from the logits of :func:`logits`, and its zero-logit probability ρ (:func:`_error`). In
    the deployed pass (``deployed`` as :func:`experts` takes it) the logits U·r̂ carry their
    rounding (there is no output sum: y = r̂) and the error is Lemma F2's (no ρ).

    Also, per row i with ``target[i] >= 0`` (the object o of an object query), the lower
    bound of max_{t != o} z_t − z_o of :func:`_top_gap` over the same logit enclosures (the
    deployed ones in the deployed pass) and the count of tokens other than o of logit
    exactly 0 (NaN, −1 where there is no target). In the exact pass, where that bound is
    negative, the touched token t != o of the largest midpoint is also compared with o
    directly (:func:`_pair_gap`, from ``R``, the rows' residual, and ``Urows``, U by token),
    and the better of the two lower bounds is kept (both bound the same maximum).

    And per such row a lower end of 1 − P(o), o alone (L1 bounds the object's probability,
    not the valid set's): the same error enclosure with the valid set {o}, from the same
    logits and stamps ``stamp0 + P + q`` (``2P`` stamps are reserved), so the enclosure's
    argument is the one above; where the valid set is {o} already it is the error's lower
    end itself (NaN where there is no target).

    ``u_scratch``: (ut, uo, ustamp), work arrays of :func:`_pair_gap` over the residual
    coordinates (stamp 0: no row's), kept by the caller across calls."""
    L_ptr, L_idx, L_mid, L_rad, L_mag = L
    on, fp, sm, rs_z, rs_2, rs_l, l1r, lmag = deployed
    P = rows.size
    err_lo = np.empty(P)
    err_hi = np.empty(P)
    rho_lo = np.empty(P)
    rho_hi = np.empty(P)
    gap = np.full(P, np.nan)
    zeros = np.full(P, -1, np.int64)
    obj_lo = np.full(P, np.nan)
    only = np.empty(1, np.int64)                 # the valid set {o}
    ut, uo, ustamp = u_scratch
    for q in range(P):
        i = rows[q]
        s = stamp0 + q
        nt = 0
        for e in range(L_ptr[i], L_ptr[i + 1]):
            t = L_idx[e]
            nt = touch(t, Lacc, s, Ltouched, nt)
            Lacc[t, 1] = L_mid[e]
            Lacc[t, 2] = L_rad[e] if not on else widen_logit(L_rad[e], L_mag[e], fp, rs_l[t], l1r[i], False)
        if target[i] >= 0:
            o = target[i]
            gap[q], zeros[q] = _top_gap(nt, Ltouched, Lacc, V, o)
            if not on and not (gap[q] >= 0.0):
                best_t = -1
                best_m = -np.inf
                for u in range(nt):
                    t = Ltouched[u]
                    if t != o and Lacc[t, 1] > best_m:
                        best_m = Lacc[t, 1]
                        best_t = t
                if best_t >= 0:
                    pg = _pair_gap(i, best_t, o, R, Urows, ut, uo, ustamp, float(s))
                    if pg > gap[q]:
                        gap[q] = pg
        if on:
            lo, hi, _ = _error_deployed(nt, Ltouched, Lacc, V, valid_ptr[i], valid_ptr[i + 1], valid, vstamp, s, sm)
            r_lo, r_hi = np.nan, np.nan
        else:
            lo, hi, _, r_lo, r_hi = _error(nt, Ltouched, Lacc, V, valid_ptr[i], valid_ptr[i + 1], valid, vstamp, s)
        err_lo[q], err_hi[q], rho_lo[q], rho_hi[q] = lo, hi, r_lo, r_hi
        if target[i] >= 0:
            only[0] = target[i]
            v_lo, v_hi = valid_ptr[i], valid_ptr[i + 1]
            if v_hi - v_lo == 1 and valid[v_lo] == only[0]:
                obj_lo[q] = lo
            elif on:
                obj_lo[q] = _error_deployed(nt, Ltouched, Lacc, V, 0, 1, only, vstamp, s + P, sm)[0]
            else:
                obj_lo[q] = _error(nt, Ltouched, Lacc, V, 0, 1, only, vstamp, s + P)[0]
    return err_lo, err_hi, rho_lo, rho_hi, gap, zeros, obj_lo
