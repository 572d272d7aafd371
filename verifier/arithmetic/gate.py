"""The gate stage: which expert a residual row routes to, and which experts may win.

**Scores.** g_k = Σ_j r_j W_G[k, j] + b_G[k]. An expert whose row of W_G meets no entry of r
has score exactly b_G[k] (no term). A touched one has midpoint G_k = fl(Σ_j xm_j W_G[k, j]) +
b_G[k] and one radius per row: |g_k − G_k| <= Σ_j (xr_j + γ|xm_j|)·|W_G[k, j]| + n·η <=
Σ_j s_j·c_j + n·η with c_j = max_k |W_G[k, j]| (the row bound; γ = γ_{n+1}, n the most terms
of a score), plus u·max|G_k| for adding b_G (:func:`decide_rows`). The bound on the float sum
holds for *any* order of the additions (each term passes through at most n − 1 of them).

**Classes.** A column read by many experts (a template-word feature) would cost K
operations per row; rows that share such entries share a *class*: the partial sums h_k
over its entries, the values v_k = h_k + b_G[k] (b_G[k] if no entry reaches k), the experts
sorted by decreasing v_k (ties: smaller k first, :func:`_class_values`), and the class
entries' share of the radius sums. A row then adds its own entries to the few experts
they reach, continuing each partial sum h_k, so every score is the same sum of the same
terms in another order, covered by the bound above; the untouched experts are read from
the sorted list as far as needed (:func:`decide_rows`).

Two kernels, one decision:

* :func:`gate` (the plain pass): a row's class is its hot entries (columns read by at
  least ``HOT_READERS`` experts, :mod:`verifier.passes.tables`), kept per call
  for the last :data:`GATE_CLASSES` of them; steps up and down with nextafter; in the
  deployed pass of a format each score also carries the gate's rounding;
* :func:`gate_parts` (the factored pass): a row's class is its cohort's shared part s_c,
  its own entries its own part o_i (each part meets a row of W_G at most n times: γ_{2n+1});
  the two-flop steps (:mod:`verifier.arithmetic.rounding`).

*The gate's decision for residual rows* (:func:`decide_rows`, for the rows of one class; a
residual row is a run of one) reads the rows as CSR (ptr, idx, mid, rad) and nothing of how
they were made: in a stack of layers each layer's gate decides on its own residual rows
with the same function; the one-layer model is a stack of one. (The rows of a class are
decided in one call, not one call per row: a call's arguments, some thirty arrays, would
cost as much as a row's decision.)
"""

from __future__ import annotations

import math

import numpy as np

from verifier.arithmetic.accumulate import B1, CSR, F1, F2, I1, I2, PART, grow
from verifier.arithmetic.kernel_forms import kernel
from verifier.arithmetic.constants import FLOOR, U
from verifier.arithmetic.deployed import KC, zero_read
from verifier.arithmetic.rounding import QUICK, factor, gamma, step_down, step_up, up_nonneg, up_one_plus

#: Classes of shared gate inputs kept per call (most recently built first to be replaced).
GATE_CLASSES = 8


@kernel()
def _same_float(a, b):
    """Bitwise equality of two finite-or-not floats (0.0 and −0.0 differ; NaN never equal)."""
    return a == b and (a != 0.0 or math.copysign(1.0, a) == math.copysign(1.0, b))


@kernel(borrows=True)
def _insert3(best3, bval, k, v):
    """Keep the three largest (value, −expert) pairs: ties go to the smaller expert."""
    if v > bval[2] or (v == bval[2] and best3[2] >= 0 and k < best3[2]) or best3[2] < 0:
        t = 2
        while t > 0 and (v > bval[t - 1] or (v == bval[t - 1] and k < best3[t - 1])):
            bval[t] = bval[t - 1]
            best3[t] = best3[t - 1]
            t -= 1
        bval[t] = v
        best3[t] = k


@kernel()
def _gate_term(xm, xr, g, rel, on):
    """A residual entry's share of the gate's radius, before its column's largest weight:
    xr + γ|xm| (the verifier's own float64 rounding), and in the deployed pass (``on``) also
    the gate's rounding ρ_g·(|xm| + xr) (``rel`` = ρ_g)."""
    if on:
        return up_nonneg(up_nonneg(up_one_plus(rel) * xr) + up_nonneg(up_nonneg(g + rel) * abs(xm)))
    return up_nonneg(xr + up_nonneg(g * abs(xm)))


# --- a class's partial sums, a row's scores ---------------------------------------------------------


@kernel(borrows=True)
def _class_sums(WG, j, xm, h, touch):
    """Entry [xm ± ·] of column j added to a class's partial sums h_k (``touch[k]``: some
    entry reaches expert k); ``WG``: W_G^T as CSR (ptr, idx, val)."""
    WG_ptr, WG_idx, WG_val = WG
    for q in range(WG_ptr[j], WG_ptr[j + 1]):
        k = WG_idx[q]
        touch[k] = True
        h[k] += xm * WG_val[q]


@kernel()
def _class_values(h, touch, bG, val, order):
    """A class's values v_k = h_k + b_G[k] (b_G[k] where nothing reaches k) into ``val`` and the
    experts by decreasing value (ties: the smaller expert first) into ``order``; returns (the
    largest |v_k| of a touched expert, whether one is not finite)."""
    big = 0.0
    bad = False
    for k in range(bG.size):
        if touch[k]:
            v = h[k] + bG[k]
            if not np.isfinite(v):
                bad = True
            big = max(big, abs(v))
            val[k] = v
        else:
            val[k] = bG[k]
    srt = np.argsort(-val, kind="mergesort")           # stable: ties keep the smaller expert first
    for t in range(bG.size):
        order[t] = srt[t]
    return big, bad


# --- a row's decision -------------------------------------------------------------------------------


@kernel()
def _decisions(n):
    """Per row: winner, margin, radius, top three experts, their lower and upper ends."""
    return (np.empty(n, np.int64), np.empty(n), np.empty(n), np.full((n, 3), -1, np.int64),
            np.full((n, 3), -np.inf), np.full((n, 3), np.inf))


@kernel()
def decide_rows(rows, X, hot, WG, colmax, bG, g, terms, classes, c, scores, stamp0, top3, out, cand, cand_row, ends,
                nc, G_out, want_scores, dep, quick):
    """The gate's decision for each row i of ``rows``, row i of residual rows X (CSR: ptr,
    idx, mid, rad), all of class ``c`` of ``classes`` (per class: partial sums h, which
    experts they touch, the values v_k, the experts in decreasing order of v_k, the radius
    sum S of its ``cnt`` shares, in the deployed pass the terms' magnitudes M =
    Σ_j (|xm_j| + xr_j)·c_j, the largest |v_k| touched, a value not finite), into row i
    of ``out`` (:func:`_decisions`). A residual row's decision is a run of one; the rows of
    a run share its class's sums, and are decided in one call.

    **Scores.** The row's entries outside the class (``hot``: the class's columns; None:
    every entry of X is the row's own) continue the partial sums of the experts they reach;
    their scores (the class's partial sum, the row's terms, then b_G[k]) go to ``scores`` =
    (gmid, gstamp, gtouched): midpoint, stamp ``stamp0 + i`` of the row, and the list of the
    experts touched; every other expert k has its class's value v_k, within the radius where
    the class touches k, exactly b_G[k] otherwise. **Radius**: c_{cnt+1}·S (Lemma 1 over the
    rounded-up shares), 2·``terms``·η (the products' underflow, at most ``terms`` per score)
    and u·max|G_k| (adding b_G); in the deployed pass (``dep`` = (constants, ρ_g, max|b_G|,
    the largest row sum of |W_G|); None: the exact pass) also the gate's rounding of
    :func:`gate`'s docstring. **Decision**: the winner (the largest midpoint), the top three
    (``top3``: work arrays) with their enclosures, the certified margin (lower end of g_e
    minus the largest upper end of the others; −∞ when a value is not finite), and after
    the ``nc`` candidates in ``cand`` (the row of each in ``cand_row``, the end of each row's
    at ``ends[i + 1]``, None: not recorded) the experts that may win: the winner, then every expert whose upper end
    reaches the winner's lower end (only the winner when the radius is not finite: the row
    is then undecided anyway). With ``want_scores`` every score's midpoint goes to row i of
    ``G_out``. Returns (the candidates' arrays, grown as needed, and their number)."""
    ptr, idx, mid, rad = X
    WG_ptr, WG_idx, WG_val = WG
    gmid, gstamp, gtouched = scores
    c_h, c_touch, c_val, c_order, c_S, c_M, c_cnt, c_big, c_bad = classes
    e_out, margin, radius, top, top_lo, top_hi = out
    best3, bval = top3
    K = bG.size
    rel, on = 0.0, False
    if dep is not None:
        rel, on = dep[1], True
    for i in rows:
        s = stamp0 + i
        if nc + K > cand.size:
            cand = grow(cand, nc + K)
            cand_row = grow(cand_row, cand.size)
        nc0 = nc
        # the row's own entries continue the partial sums of the experts they reach
        S, M, cnt, bad, big = c_S[c], c_M[c], c_cnt[c], c_bad[c], c_big[c]
        nt = 0
        for e in range(ptr[i], ptr[i + 1]):
            j = idx[e]
            if not (np.isfinite(mid[e]) and np.isfinite(rad[e])):
                bad = True
            if hot is not None:
                if hot[j]:
                    continue
            if colmax[j] > 0.0:
                S = up_nonneg(S + up_nonneg(_gate_term(mid[e], rad[e], g, rel, on) * colmax[j]))
                if on:
                    M = up_nonneg(M + up_nonneg(up_nonneg(abs(mid[e]) + rad[e]) * colmax[j]))
                cnt += 1
                for q in range(WG_ptr[j], WG_ptr[j + 1]):
                    k = WG_idx[q]
                    if gstamp[k] != s:
                        gstamp[k] = s
                        gmid[k] = c_h[c, k] if c_touch[c, k] else 0.0
                        gtouched[nt] = k
                        nt += 1
                    gmid[k] += mid[e] * WG_val[q]
        for u in range(nt):
            k = gtouched[u]
            gmid[k] += bG[k]
            if not np.isfinite(gmid[k]):
                bad = True
            big = max(big, abs(gmid[k]))
        # the radius
        r = up_nonneg(up_nonneg(factor(cnt + 1) * S) + 2.0 * terms * FLOOR)
        r = step_up(r + step_up(U * big, quick), quick)
        if dep is not None:
            fp, bmax, rs_g = dep[0], dep[2], dep[3]
            l1 = 0.0
            for e in range(ptr[i], ptr[i + 1]):
                l1 = up_nonneg(l1 + up_nonneg(abs(mid[e]) + rad[e]))
            r = up_nonneg(r + up_nonneg(up_nonneg(rel * bmax)
                                        + up_nonneg(fp[KC.f_g] + zero_read(fp, up_nonneg(l1 + rs_g)))))
            if not (up_nonneg(up_one_plus(rel) * up_nonneg(big + r)) < fp[KC.largest]):
                bad = True
            # every partial sum of every score: at most (1 + ρ_g) times its terms' magnitudes
            if not (up_nonneg(up_one_plus(rel) * up_nonneg(M + bmax)) < fp[KC.largest]):
                bad = True
        if bad or not np.isfinite(r):
            r = np.inf
        radius[i] = r
        # the three largest midpoints: the row's own experts, then the class's order
        for t in range(3):
            best3[t] = -1
            bval[t] = -np.inf
        for u in range(nt):
            _insert3(best3, bval, gtouched[u], gmid[gtouched[u]])
        taken = 0
        for u in range(K):
            if taken == 3:
                break
            k = c_order[c, u]
            if gstamp[k] == s:
                continue
            taken += 1
            _insert3(best3, bval, k, c_val[c, k])
        win = best3[0]
        e_out[i] = win
        for t in range(3):
            k = best3[t]
            if k < 0:
                continue
            top[i, t] = k
            rk = r if (gstamp[k] == s or c_touch[c, k]) else 0.0    # an untouched score is exactly b_G
            if np.isfinite(rk):
                top_lo[i, t] = step_down(bval[t] - rk, quick)
                top_hi[i, t] = step_up(bval[t] + rk, quick)
        rw = r if (gstamp[win] == s or c_touch[c, win]) else 0.0
        if not np.isfinite(r):
            margin[i] = -np.inf
        elif K == 1:
            margin[i] = np.inf
        else:
            r2 = r if (gstamp[best3[1]] == s or c_touch[c, best3[1]]) else 0.0
            margin[i] = step_down(step_down(bval[0] - bval[1], quick) - step_up(rw + r2, quick), quick)
        # the experts that may win: upper end >= the winner's lower end
        cand[nc] = win
        nc += 1
        if np.isfinite(r):
            floor_e = step_down(bval[0] - rw, quick)
            for u in range(nt):
                k = gtouched[u]
                if k != win and step_up(gmid[k] + r, quick) >= floor_e:
                    cand[nc] = k
                    nc += 1
            # in the class's order v_k decreases, so once up(v_k + r) < floor_e no later
            # expert reaches it (touched: up(v + r); untouched: v <= up(v + r))
            for u in range(K):
                k = c_order[c, u]
                reach = step_up(c_val[c, k] + r, quick)
                if reach < floor_e:
                    break
                if k == win or gstamp[k] == s:
                    continue
                if (reach if c_touch[c, k] else c_val[c, k]) >= floor_e:
                    cand[nc] = k
                    nc += 1
        if want_scores:
            for k in range(K):
                G_out[i, k] = c_val[c, k]
            for u in range(nt):
                G_out[i, gtouched[u]] = gmid[gtouched[u]]
        for t in range(nc0, nc):
            cand_row[t] = i
        if ends is not None:
            ends[i + 1] = nc
    return cand, cand_row, nc


# --- the kernels -------------------------------------------------------------------------------------


@kernel(borrows=True)
def _in_class(R, i, hot, keys, c):
    """Whether the hot entries of row i are, bitwise, those of the cached class c (:func:`gate`)."""
    R_ptr, R_idx, R_mid, R_rad = R
    c_len, c_idx, c_mid, c_rad = keys
    if c_len[c] < 0:
        return False
    h = 0
    for e in range(R_ptr[i], R_ptr[i + 1]):
        j = R_idx[e]
        if hot[j]:
            if h >= c_len[c] or c_idx[c, h] != j or not _same_float(c_mid[c, h], R_mid[e]) \
                    or not _same_float(c_rad[c, h], R_rad[e]):
                return False
            h += 1
    return h == c_len[c]


@kernel(borrows=True)
def _class_of(R, i, hot, keys):
    """The cached class (:func:`gate`) whose hot entries are row i's, bitwise; −1 if none."""
    for c in range(keys[0].size):
        if _in_class(R, i, hot, keys, c):
            return c
    return -1


@kernel(args=(I1, I1, F1, F1, I1, I1, F1, F1, B1, F1, "i64", F1, F1, I1, "i64", F2, "bool", ("bool", F1, "f64")),
        returns=(I1, F1, F1, I2, F2, F2, I1, I1))
def gate(R_ptr, R_idx, R_mid, R_rad, WG_ptr, WG_idx, WG_val, colmax, hot, bG, max_terms,
         gmid, gstamp, gtouched, stamp0, G_out, want_scores, deployed):
    """The gate's decisions per row of the residual R (CSR ``R_ptr``, ``R_idx``, ``R_mid``,
    ``R_rad``): winner, certified margin, radius, top three, and the experts that may win.
    ``WG_*``: W_G^T as CSR, ``colmax`` the largest |W_G[k, j]| per column j, ``max_terms``
    the most entries of a row of W_G (γ = γ_{max_terms+1}); ``gmid``, ``gstamp``,
    ``gtouched``: per-expert work arrays (stamp −1: no row's).

    **Classes** (the module docstring): the rows are grouped by their hot entries (bitwise
    equal index, mid and radius). The last ``GATE_CLASSES`` groups are kept; a row whose
    group is not among them builds it (K·log K operations) in place of the oldest.

    Returns per row: the winner e, the certified margin, the radius, the top three experts
    with their enclosures, and as CSR (``cand_ptr``, ``cand``) the experts that may win
    (:func:`decide_rows`). With ``want_scores`` the full (n, K) midpoints go to ``G_out``.

    ``deployed`` = (on, constants, the largest row sum of |W_G|): in the deployed pass of a
    format each score also carries the gate's rounding, ρ_g·Σ_j |r̂_j||W_G[k, j]| (bounded
    as the row's radius is, by Σ_j (|xm_j| + xr_j)·c_j) and ρ_g·|b_G[k]|, its floor and its
    inputs-read-as-zero allowance 2·e_min·(Σ_j |r̂_j| + Σ_j |W_G[k, j]|); a row where a
    score, or a partial sum of one, may reach the format's largest value is undecided: a
    runtime sums the terms in any order, so a partial sum is bounded by the terms'
    magnitudes Σ_j |r̂_j||W_G[k, j]| + |b_G[k]| <= Σ_j (|xm_j| + xr_j)·c_j + max|b_G|, not by
    the score (terms of opposite signs that cancel in the score can overflow on the way,
    and the overflowed score routes the query anywhere).
    """
    R = (R_ptr, R_idx, R_mid, R_rad)
    WG = (WG_ptr, WG_idx, WG_val)
    scores = (gmid, gstamp, gtouched)
    n = R_ptr.size - 1
    K = bG.size
    g = gamma(max_terms + 1)
    on, fp, rs_g = deployed
    rel = fp[KC.rho_g] if on else 0.0
    bmax = 0.0
    if on:
        for k in range(K):
            bmax = max(bmax, abs(bG[k]))
    out = _decisions(n)
    cand_ptr = np.zeros(n + 1, np.int64)
    cand = np.empty(2 * n + 16, np.int64)
    cand_row = np.empty(cand.size, np.int64)           # (the rows are cand_ptr's)
    nc = 0
    top3 = (np.empty(3, np.int64), np.empty(3))
    # the class cache: hot entries (key), partial sums, values, order, radius parts
    maxh = 1
    for i in range(n):
        c = 0
        for e in range(R_ptr[i], R_ptr[i + 1]):
            if hot[R_idx[e]]:
                c += 1
        maxh = max(maxh, c)
    C = GATE_CLASSES
    keys = (np.full(C, -1, np.int64), np.empty((C, maxh), np.int64), np.empty((C, maxh)), np.empty((C, maxh)))
    c_len, c_idx, c_mid, c_rad = keys
    c_h = np.empty((C, K))
    c_touch = np.zeros((C, K), np.bool_)
    c_val = np.empty((C, K))
    c_order = np.empty((C, K), np.int64)
    c_S = np.empty(C)
    c_M = np.empty(C)
    c_cnt = np.empty(C, np.int64)
    c_big = np.empty(C)
    c_bad = np.zeros(C, np.bool_)
    classes = (c_h, c_touch, c_val, c_order, c_S, c_M, c_cnt, c_big, c_bad)
    rows = np.arange(n)
    oldest = 0
    i = 0
    while i < n:
        # this row's class (by its hot entries), built if not cached, and the rows after it of that class
        grp = _class_of(R, i, hot, keys)
        if grp < 0:
            grp = oldest
            oldest = (oldest + 1) % C
            h = 0
            S = 0.0
            M = 0.0
            cnt = 0
            bad = False
            c_h[grp, :] = 0.0
            c_touch[grp, :] = False
            for e in range(R_ptr[i], R_ptr[i + 1]):
                j = R_idx[e]
                if not hot[j]:
                    continue
                c_idx[grp, h], c_mid[grp, h], c_rad[grp, h] = j, R_mid[e], R_rad[e]
                h += 1
                if not (np.isfinite(R_mid[e]) and np.isfinite(R_rad[e])):
                    bad = True
                S = up_nonneg(S + up_nonneg(_gate_term(R_mid[e], R_rad[e], g, rel, on) * colmax[j]))
                if on:
                    M = up_nonneg(M + up_nonneg(up_nonneg(abs(R_mid[e]) + R_rad[e]) * colmax[j]))
                cnt += 1
                _class_sums(WG, j, R_mid[e], c_h[grp], c_touch[grp])
            c_big[grp], values_bad = _class_values(c_h[grp], c_touch[grp], bG, c_val[grp], c_order[grp])
            c_len[grp], c_S[grp], c_M[grp], c_cnt[grp], c_bad[grp] = h, S, M, cnt, bad or values_bad
        end = i + 1
        while end < n and _in_class(R, end, hot, keys, grp):
            end += 1
        run = rows[i:end]
        if on:
            cand, cand_row, nc = decide_rows(run, R, hot, WG, colmax, bG, g, max_terms + 1, classes, grp, scores,
                                             stamp0, top3, out, cand, cand_row, cand_ptr, nc, G_out, want_scores,
                                             (fp, rel, bmax, rs_g), None)
        else:
            cand, cand_row, nc = decide_rows(run, R, hot, WG, colmax, bG, g, max_terms + 1, classes, grp, scores,
                                             stamp0, top3, out, cand, cand_row, cand_ptr, nc, G_out, want_scores,
                                             None, None)
        i = end
    return out + (cand_ptr, cand[:nc])


@kernel(args=(PART, PART, I1, I1, CSR, F1, F1, "i64", F1, F1, I1, "i64", F2, "bool"),
        returns=(I1, F1, F1, I2, F2, F2, I1, I1))
def gate_parts(S, O, cohort, order, WG, colmax, bG, max_terms, gmid, gstamp, gtouched, stamp0, G_out, want_scores):
    """The gate's decisions per row from the two parts of its residual: winner, certified
    margin, radius, top three, and the experts that may win, as :func:`gate` returns them
    (the candidates with the row of each, in the order the rows are visited: ``order``,
    rows grouped by cohort).

    **Scores.** g_k = W_G·s_c + W_G·o_i + b_G[k]. Per cohort, once: its class, from the
    shared part's entries. A row continues the partial sums of the experts its own entries
    reach. The midpoint of g_k is then a float sum of at most 2n products (n =
    ``max_terms``, the most entries of a row of W_G: each part meets a row of W_G at most n
    times) and the bias, so with γ = γ_{2n+1}
    |g_k − G_k| <= Σ (xr + γ|xm|)·|W_G[k, j]| + 2(2n + 1)·η + u·|G_k|, the sum over the
    entries of both parts, bounded as the plain kernel bounds it (by the column maxima
    c_j, Lemma 1 for the sum of the rounded-up shares). Every other step (top three,
    margin, candidates) is the plain kernel's (:func:`decide_rows`).
    """
    S_ptr, S_idx, S_mid, S_rad = S
    scores = (gmid, gstamp, gtouched)
    n = O[0].size - 1
    K = bG.size
    g = gamma(2 * max_terms + 1)
    out = _decisions(n)
    cand = np.empty(2 * n + 16, np.int64)
    cand_row = np.empty(cand.size, np.int64)
    nc = 0
    top3 = (np.empty(3, np.int64), np.empty(3))
    # one class, the current cohort's (its shared part's entries)
    classes = (np.zeros((1, K)), np.zeros((1, K), np.bool_), np.empty((1, K)), np.empty((1, K), np.int64),
               np.zeros(1), np.zeros(1), np.zeros(1, np.int64), np.zeros(1), np.zeros(1, np.bool_))
    h, c_touch, c_val, c_order, c_S, c_M, c_cnt, c_big, c_bad = classes
    u0 = 0
    while u0 < n:                                      # the rows of one cohort, of its class
        c = cohort[order[u0]]
        u1 = u0 + 1
        while u1 < n and cohort[order[u1]] == c:
            u1 += 1
        Sc = 0.0
        cnt_c = 0
        bad_c = False
        h[0, :] = 0.0
        c_touch[0, :] = False
        for e in range(S_ptr[c], S_ptr[c + 1]):
            if not (np.isfinite(S_mid[e]) and np.isfinite(S_rad[e])):
                bad_c = True
            j = S_idx[e]
            if colmax[j] > 0.0:
                Sc = up_nonneg(Sc + up_nonneg(_gate_term(S_mid[e], S_rad[e], g, 0.0, False) * colmax[j]))
                cnt_c += 1
                _class_sums(WG, j, S_mid[e], h[0], c_touch[0])
        c_big[0], values_bad = _class_values(h[0], c_touch[0], bG, c_val[0], c_order[0])
        c_S[0], c_cnt[0], c_bad[0] = Sc, cnt_c, bad_c or values_bad
        cand, cand_row, nc = decide_rows(order[u0:u1], O, None, WG, colmax, bG, g, 2 * max_terms + 1, classes, 0,
                                         scores, stamp0, top3, out, cand, cand_row, None, nc, G_out, want_scores,
                                         None, QUICK)
        u0 = u1
    return out + (cand_row[:nc], cand[:nc])
