"""The readout: logits, the output softmax's error, and the ablation, from the top layer's rows.

**Logits.** By linearity U·y = U·r + U·o for the layer's output y = r + o (o the routed
expert's output, :mod:`verifier.arithmetic.experts`): :func:`logits` encloses U·r once per
residual row, for the ablation and for every expert that may win; :func:`row_logits` adds
those enclosures to a row's logit accumulator as interval terms, and the terms of U·o. A
token nothing reaches has logit exactly 0.

**The error.** 1 − P(valid) from a row's logit enclosures: with M the shift (the largest
midpoint, and 0 when a token has logit 0) and S the sums of e^(z − M) over the valid and the
other tokens (:func:`_tally`, each float sum widened by c_{n+1} upward and 1 − γ_{n+1}
downward, :func:`_widened`), error = S_inv/(S_inv + S_val), increasing in S_inv and
decreasing in S_val (:func:`_ratio`). Three forms: :func:`error_enclosure` (the plain pass,
with ρ = 1/Σ_t e^(z_t), the probability one token of logit exactly 0 has (above 1 when
every token has a negative logit: not capped, :func:`_error_rho`), which lets a saved certificate
account for tokens added to or removed from the vocabulary:
:mod:`verifier.certificates.incremental`), :func:`error_enclosure_deployed` (Lemma F2 of
:mod:`verifier.passes.floating`) and :func:`error_enclosure_parts` (the factored pass: a
row's logits are its cohort's table but at the tokens the row changes).

**The ablation.** The same error with the routed expert's output removed (y = r), the
lower bound of max_{t != o} z_t − z_o for an object query's object o (:func:`_gap`, and the
direct comparison of two rows of U, :func:`_pair_gap`), and 1 − P(o) for o alone:
:func:`ablated` (plain) and :func:`ablated_parts` (factored).

*Layers.* The readout runs once, on the top layer's rows: in a stack of layers the logits
read the last layer's output rows y (each layer's residual → gate → experts,
:mod:`verifier.arithmetic.experts`); the one-layer model reads U·y as U·r + U·o, r its
residual rows. The plain kernels keep a row's logits in dense accumulators, the factored
ones in compact ones (:mod:`verifier.arithmetic.accumulate`), and each pass rounds with its
own steps (:mod:`verifier.arithmetic.rounding`).
"""

from __future__ import annotations

import numpy as np

from verifier.arithmetic.accumulate import (ACC, CSR, F1, F2, I1, J1, LOGITS, PART, add_term, entry_radius,
                                            lower_bound, new_rows, place, prod_terms, product_terms, put, row_of,
                                            trimmed)
from verifier.arithmetic.kernel_forms import kernel
from verifier.arithmetic.deployed import DEPLOYED, SM, widen_logit, widen_output, zero_read
from verifier.arithmetic.exponential import exp_lower, exp_memo, exp_upper
from verifier.arithmetic.rounding import QUICK, down, factor, shrink, step_down, step_up, up, up_nonneg

# The declared type of a cohort's logit table (error_enclosure_parts).
TABLE_ARRAYS = (I1, F1, F1, F1, F1, I1, I1, I1, I1)


# --- logits ------------------------------------------------------------------------------------------


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
    deployed pass's rounding is relative to). The sums are kept in a compact accumulator
    (``Lacc``, ``Ltouched``, ``Lwhere``: :func:`verifier.arithmetic.accumulate.slot`)."""
    n = R_ptr.size - 1
    out = new_rows(n, capacity)
    out_mag = np.empty(capacity)
    e = 0
    for i in range(n):
        s = stamp0 + i
        nt = 0
        for q in range(R_ptr[i], R_ptr[i + 1]):
            nt = product_terms(UT_ptr, UT_idx, UT_val, R_idx[q], R_mid[q], R_rad[q], Lacc, s, Ltouched, nt, Lwhere)
        for u in range(nt):
            out_mag[e] = up_nonneg(Lacc[u, 2] + Lacc[u, 3])           # >= Σ_j |U_tj|·|r̂_j| (the deployed pass's)
            e = put(out, e, Ltouched[u], Lacc[u, 1], entry_radius(Lacc[u, 2], Lacc[u, 3], int(Lacc[u, 4])))
        out[0][i + 1] = e
    return trimmed(out, e) + (out_mag[:e],)


@kernel(borrows=True)
def _logit_term(t, m, a, b, mag, Lacc, s, Ltouched, nt, Lwhere, dep):
    """A term (midpoint m, A-term a, B-term b) of token t's logit into the accumulator; in the
    deployed pass (``dep``, as :func:`row_logits` takes it) also ``mag`` into the token's
    magnitude (0 when the token is new). Returns the touched count."""
    if dep is not None:
        if Lacc[t, 0] != s:
            dep[6][t] = 0.0
    u, nt = place(t, Lacc, s, Ltouched, nt, Lwhere)
    add_term(u, m, a, b, Lacc)
    if dep is not None:
        dep[6][t] = up_nonneg(dep[6][t] + mag)
    return nt


@kernel(borrows=True)
def row_logits(L, row, UT, y, ny, Lacc, s, Ltouched, Lwhere, dep, cmax, l1a):
    """U·y = U·r + U·o for one row into an empty logit accumulator (stamp s): row ``row`` of
    U·r (:func:`logits`' rows ``L``), one interval term per token, then U·o, each of the ``ny``
    entries of an expert's output o (the accumulator ``y`` = (acc, touched, where)) enclosed
    and times its column of U (``UT``: U^T as CSR), as product terms. In the deployed pass
    (``dep``: the arrays of :func:`verifier.arithmetic.experts.experts`' ``deployed`` but its
    first; dense accumulators; None: the exact pass) each output entry is widened by its
    stage's rounding (:func:`verifier.arithmetic.deployed.widen_output`; ``cmax``: |c| of the
    gate scale, ``l1a``: Σ a_hi of the activities) and each token's magnitude accumulated
    (its last array). Returns (touched count, a value of o not finite, Σ|ô| in the deployed
    pass, else 0)."""
    L_ptr, L_idx, L_mid, L_rad, L_mag = L
    UT_ptr, UT_idx, UT_val = UT
    yacc, ytouched, ywhere = y
    nt = 0
    for e in range(L_ptr[row], L_ptr[row + 1]):
        nt = _logit_term(L_idx[e], L_mid[e], L_rad[e], abs(L_mid[e]), L_mag[e], Lacc, s, Ltouched, nt, Lwhere, dep)
    bad = False
    l1o = 0.0
    for u in range(ny):
        j = ytouched[u]
        v = j if ywhere is None else u
        om = yacc[v, 1]
        orad = entry_radius(yacc[v, 2], yacc[v, 3], int(yacc[v, 4]))
        if dep is not None:
            fp, rs_2 = dep[0], dep[3]
            orad = widen_output(orad, up_nonneg(yacc[v, 2] + yacc[v, 3]), fp, cmax,
                                zero_read(fp, up_nonneg(l1a + rs_2[j])))
            l1o = up_nonneg(l1o + up_nonneg(abs(om) + orad))
        if not (np.isfinite(om) and np.isfinite(orad)):
            bad = True
        for t in range(UT_ptr[j], UT_ptr[j + 1]):
            m, a, b = prod_terms(om, orad, UT_val[t])
            nt = _logit_term(UT_idx[t], m, a, b, up_nonneg(a + b), Lacc, s, Ltouched, nt, Lwhere, dep)
    return nt, bad, l1o


@kernel(borrows=True)
def to_radii(Lacc, Ltouched, nt, Lwhere):
    """Column 2 of the accumulator's ``nt`` rows becomes each entry's radius (column 1 its
    midpoint)."""
    for u in range(nt):
        v = Ltouched[u] if Lwhere is None else u
        Lacc[v, 2] = entry_radius(Lacc[v, 2], Lacc[v, 3], int(Lacc[v, 4]))


# --- the error -----------------------------------------------------------------------------------------


@kernel(borrows=True)
def _count_valid(valid, lo, hi, vstamp, sv, small):
    """The number of distinct valid tokens ``valid[lo:hi]``: by scanning them (``small``), else
    marking each with the stamp ``sv`` in ``vstamp``."""
    n_valid = 0
    for q in range(lo, hi):
        if small:
            if _first_time(valid, lo, q):
                n_valid += 1
        elif vstamp[valid[q]] != sv:
            vstamp[valid[q]] = sv
            n_valid += 1
    return n_valid


@kernel(borrows=True)
def _exp_terms(m, r, M, memo, quick):
    """Bounds of e^(z − M) for a logit z in [m ± r] (``memo``: exponential.exp_memo's, or None)."""
    lo = step_down(step_down(m - r, quick) - M, quick)
    hi = step_up(step_up(m + r, quick) - M, quick)
    return exp_memo(lo, memo, -1.0), exp_memo(hi, memo, 1.0)


@kernel(borrows=True)
def _zero_terms(M, memo, quick):
    """Bounds of e^(0 − M), a token of logit exactly 0's term."""
    return exp_memo(step_down(-M, quick), memo, -1.0), exp_memo(step_up(-M, quick), memo, 1.0)


@kernel()
def _tally(sums, is_valid, e_lo, e_hi):
    """``sums`` = (invalid lower, invalid upper, valid lower, valid upper, valid tokens,
    tokens) with one token's bounds added on its side."""
    inv_lo, inv_hi, val_lo, val_hi, n_val, n = sums
    if is_valid:
        return inv_lo, inv_hi, val_lo + e_lo, val_hi + e_hi, n_val + 1, n + 1
    return inv_lo + e_lo, inv_hi + e_hi, val_lo, val_hi, n_val, n + 1


@kernel()
def _tally_logit(sums, is_valid, m, r, M, memo, quick):
    """:func:`_tally` of the bounds of e^(z − M) for a logit z in [m ± r]."""
    e_lo, e_hi = _exp_terms(m, r, M, memo, quick)
    return _tally(sums, is_valid, e_lo, e_hi)


@kernel()
def _widened(sums, n, zeros, n_valid, z_lo, z_hi, quick):
    """The float sums of ``n`` tokens' bounds (:func:`_tally`) widened to bounds of the exact
    sums (c_{n+1}·Σ upward, (1 − γ_{n+1})·Σ downward), each with its share of the ``zeros``
    tokens of logit exactly 0 (``n_valid`` valid tokens in all), each of which has e^(0 − M)
    in [z_lo, z_hi]: (invalid lower, invalid upper, valid lower, valid upper)."""
    inv_lo, inv_hi, val_lo, val_hi, n_val = sums[:5]
    c = factor(n + 1)
    dd = shrink(n)
    zero_valid = n_valid - n_val
    zero_invalid = zeros - zero_valid
    return (step_down(step_down(dd * inv_lo, quick) + step_down(zero_invalid * z_lo, quick), quick),
            step_up(step_up(c * inv_hi, quick) + step_up(zero_invalid * z_hi, quick), quick),
            step_down(step_down(dd * val_lo, quick) + step_down(zero_valid * z_lo, quick), quick),
            step_up(step_up(c * val_hi, quick) + step_up(zero_valid * z_hi, quick), quick))


@kernel()
def _ratio(x_lo, x_hi, y_lo, y_hi, quick):
    """Bounds of x/(x + y) for x in [x_lo, x_hi], y in [y_lo, y_hi] (x, y >= 0), within [0, 1]:
    increasing in x, decreasing in y. A lower end rounded down from 0 is a little below 0
    (:func:`_widened`): where the upper end's denominator x_hi + y_lo is not above 0 (x_hi
    itself that small: no x at all), the ratio is bounded by 1 alone, not by a quotient of
    the wrong sign."""
    lo = step_down(x_lo / step_up(x_lo + y_hi, quick), quick)
    den = step_down(x_hi + y_lo, quick)
    hi = step_up(x_hi / den, quick) if den > 0.0 else 1.0
    return (lo if lo >= 0.0 else 0.0), (hi if hi <= 1.0 else 1.0)


@kernel()
def _error_rho(masses, z_lo, z_hi, quick):
    """(err_lo, err_hi, rho_lo, rho_hi) from the masses (:func:`_widened`): the error
    S_inv/(S_inv + S_val) and ρ = e^(0 − M)/(S_inv + S_val) = 1/Σ_t e^(z_t). ρ is a
    probability (at most 1) only when the row has a token of logit exactly 0; when every
    token is reached and every logit is below 0 (M < 0), ρ = e^(−M)/(S_inv + S_val) exceeds 1
    as soon as Σ_t e^(z_t) < 1, so its upper end is the rounded quotient, not capped at 1
    (a cap there would put the upper end below ρ, and :mod:`verifier.certificates.incremental`
    would under-estimate the error of a class reused after tokens are added). Its lower end
    is clipped at 0. Where the masses' lower ends add up to nothing above 0 (every exp's
    lower end underflowed), ρ has no upper bound here: NaN for both (no ρ), not a quotient
    of the wrong sign."""
    inv_lo, inv_hi, val_lo, val_hi = masses
    err_lo, err_hi = _ratio(inv_lo, inv_hi, val_lo, val_hi, quick)
    den = step_down(inv_lo + val_lo, quick)
    if not (den > 0.0):
        return err_lo, err_hi, np.nan, np.nan
    rho_hi = step_up(z_hi / den, quick)
    rho_lo = step_down(z_lo / step_up(inv_hi + val_hi, quick), quick)
    return err_lo, err_hi, (rho_lo if rho_lo >= 0.0 else 0.0), rho_hi


@kernel(borrows=True)
def error_enclosure(nt, Ltouched, Lacc, V, vptr_lo, vptr_hi, valid, vstamp, s):
    """Enclosure (lo, hi) of 1 − P(valid), the argmax token (−1: a zero logit), and an
    enclosure (rho_lo, rho_hi) of ρ = e^(0 − M)/(S_inv + S_val), the probability one token
    of logit exactly 0 has (or would have beside the row's tokens: above 1 when every token
    is touched with a negative logit, :func:`_error_rho`), from the logits in the dense
    accumulator (for the ``nt`` tokens in ``Ltouched``, mid in column 1 and *radius* in
    column 2). A token not touched has logit exactly 0 and is counted, not enumerated. The
    valid tokens are marked with ``s`` in ``vstamp``."""
    n_valid = _count_valid(valid, vptr_lo, vptr_hi, vstamp, s, False)
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
    sums = (0.0, 0.0, 0.0, 0.0, 0, 0)
    for u in range(nt):
        t = Ltouched[u]
        sums = _tally_logit(sums, vstamp[t] == s, Lacc[t, 1], Lacc[t, 2], M, None, None)
    z_lo, z_hi = _zero_terms(M, None, None)
    err_lo, err_hi, rho_lo, rho_hi = _error_rho(_widened(sums, nt, zeros, n_valid, z_lo, z_hi, None), z_lo, z_hi,
                                                None)
    return err_lo, err_hi, arg, rho_lo, rho_hi


@kernel(borrows=True)
def _deployed_exp(lo, hi, Mhi, c, sm):
    """Bounds of a deployed exp of a logit in [lo, hi] (Lemma F2): relative to the common shift
    c, widened by the shift's rounding θ = rel·(M_hi − lo) + tiny and the exp's and its
    stores' factors."""
    theta = up_nonneg(up_nonneg(sm[SM.rel] * up(Mhi - lo)) + sm[SM.tiny])
    e_lo = max(down(exp_lower(down(down(lo - theta) - c)) * sm[SM.lo]), 0.0)
    e_hi = up(exp_upper(up(up(hi + theta) - c)) * sm[SM.hi])
    return e_lo, e_hi


@kernel(borrows=True)
def error_enclosure_deployed(nt, Ltouched, Lacc, V, vptr_lo, vptr_hi, valid, vstamp, s, sm):
    """Enclosure (lo, hi) of 1 − Σ_valid p̂ for the deployed pass (Lemma F2 of
    verifier.passes.floating with the valid tokens' mass, as its softmax constants ``sm`` give
    it): each logit's exp relative to a common shift (:func:`_deployed_exp`); the sums of
    the valid and the other tokens' terms; the ratio's factors and τ. Also the argmax token
    as :func:`error_enclosure` gives it; ρ is not defined here (NaN)."""
    n_valid = _count_valid(valid, vptr_lo, vptr_hi, vstamp, s, False)
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
    sums = (0.0, 0.0, 0.0, 0.0, 0, 0)
    for u in range(nt):
        t = Ltouched[u]
        e_lo, e_hi = _deployed_exp(down(Lacc[t, 1] - Lacc[t, 2]), up(Lacc[t, 1] + Lacc[t, 2]), Mhi, c, sm)
        sums = _tally(sums, vstamp[t] == s, e_lo, e_hi)
    z_lo, z_hi = _deployed_exp(0.0, 0.0, Mhi, c, sm)
    B_lo, B_hi, A_lo, A_hi = _widened(sums, nt + 1, zeros, n_valid, z_lo, z_hi, None)
    r_lo, r_hi = _ratio(A_lo, A_hi, B_lo, B_hi, None)
    f_lo, f_hi, tau = sm[SM.f_lo], sm[SM.f_hi], sm[SM.tau]
    mass_lo = max(down(down(r_lo * f_lo) - tau), 0.0)
    total_hi = up(f_hi + tau)
    mass_hi = min(up(up(r_hi * f_hi) + tau), total_hi)
    return down(1.0 - mass_hi), min(up(1.0 - mass_lo), 1.0), arg


# --- the factored pass's: a cohort's logits, and the error from them and a row's --------------------------


#: A cohort table of at most this many logits is summed again for each row (as the plain
#: kernel sums), rather than subtracting a row's tokens from the table's sum: a difference
#: of two rounded sums is only as precise as the larger one, which costs digits when the
#: table holds the row's dominant valid token.
DIRECT = 64
#: A row with at most this many valid next tokens has them looked up by scanning its list
#: (in the plain kernel's stamps otherwise).
SMALL_VALID = 8


@kernel()
def cohort_table(nL, Ltouched, Lacc, table, sg):
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
        elo[u], ehi[u] = _exp_terms(mid[u], rad[u], M, None, QUICK)
        s_lo += elo[u]
        s_hi += ehi[u]
    key = np.empty(nL)
    for u in range(nL):
        key[u] = -mid[by_tok[u]]
    srt = np.argsort(key, kind="mergesort")
    for u in range(nL):
        by_mid[u] = by_tok[srt[u]]
    for u in range(nL):
        key[u] = -step_down(mid[by_tok[u]] - rad[by_tok[u]], QUICK)
    srt = np.argsort(key, kind="mergesort")
    for u in range(nL):
        by_lo[u] = by_tok[srt[u]]
    return M, s_lo, s_hi, bad


@kernel(borrows=True)
def position(t, nL, table):
    """Token t's position in a cohort's table, −1 if it is not there (binary search in the
    table's sorted tokens: a row looks up a few tokens in a table that stays in cache)."""
    srt_tok, srt_pos = table[7], table[8]
    u = lower_bound(srt_tok, 0, nL, t)
    if u < nL and srt_tok[u] == t:
        return srt_pos[u]
    return -1


@kernel(borrows=True)
def _is_valid(t, small, valid, lo, hi, vstamp, sv):
    """Whether token t is one of the row's valid next tokens ``valid[lo:hi]`` (``small``: by
    scanning them; else by the stamps ``vstamp[t] == sv`` or ``sv + 0.5`` set beforehand)."""
    if small:
        for q in range(lo, hi):
            if valid[q] == t:
                return True
        return False
    return vstamp[t] == sv or vstamp[t] == sv + 0.5


@kernel(borrows=True)
def _first_time(valid, lo, q):
    """Whether ``valid[q]`` does not occur in ``valid[lo:q]``."""
    for r in range(lo, q):
        if valid[r] == valid[q]:
            return False
    return True


@kernel(borrows=True)
def _in_table(sub, w, elo, ehi):
    """``sub`` = (float sums of table bounds, count) with the table's token at position ``w``
    added (none: −1)."""
    if w >= 0:
        return sub[0] + elo[w], sub[1] + ehi[w], sub[2] + 1
    return sub


@kernel(borrows=True)
def _unchanged_valid(q, small, valid, lo, vstamp, sv, Lacc, s, Ltouched, Lwhere, nL, table):
    """The table position of the valid token ``valid[q]`` if the row did not change its logit
    and it is the first time it occurs among ``valid[lo:q + 1]``; −1 otherwise. (A large set
    of valid tokens is marked ``sv`` in ``vstamp``; a token's first occurrence moves its mark
    to sv + 0.5, which no stamp is.)"""
    t = valid[q]
    if small:
        if not _first_time(valid, lo, q):
            return -1                                  # seen already
    elif vstamp[t] != sv:
        return -1                                      # seen already
    else:
        vstamp[t] = sv + 0.5                           # still valid
    if row_of(t, Lacc, s, Ltouched, Lwhere) >= 0:
        return -1
    return position(t, nL, table)


@kernel(borrows=True)
def _table_rest(c_lo, c_hi, nL, sub, M_c, M, memo):
    """Σ over a cohort table's tokens outside Q, relative to M: the table's sum (of ``nL``
    tokens, float sums ``c_lo``, ``c_hi`` relative to M_c) minus Q's share (``sub``: the float
    sums of its tokens' table bounds and their count, :func:`_in_table`), each widened
    outward and the difference clamped at 0, scaled by e^(M_c − M)."""
    s_hi = step_up(factor(nL + 1) * c_hi, QUICK)
    s_lo = step_down(shrink(nL) * c_lo, QUICK)
    q_hi = step_up(factor(sub[2] + 1) * sub[1], QUICK)
    q_lo = step_down(shrink(sub[2]) * sub[0], QUICK)
    rest_hi = max(step_up(s_hi - q_lo, QUICK), 0.0)
    rest_lo = max(step_down(s_lo - q_hi, QUICK), 0.0)
    if M_c != M:                                       # e^(z − M) = e^(z − M_c)·e^(M_c − M)
        rest_hi = step_up(rest_hi * exp_memo(step_up(M_c - M, QUICK), memo, 1.0), QUICK)
        rest_lo = step_down(rest_lo * exp_memo(step_down(M_c - M, QUICK), memo, -1.0), QUICK)
    return rest_lo, rest_hi


@kernel(borrows=True)
def error_enclosure_parts(nt, Ltouched, Lacc, Lwhere, s, table, cohort, V, vptr_lo, vptr_hi, valid, vstamp, sv, memo):
    """Enclosure of 1 − P(valid), the argmax token (−1: a zero logit), and an enclosure of
    ρ = e^(0 − M)/Σ_t e^(z_t − M) (as :func:`error_enclosure` returns them) for a row whose
    logits are the cohort's (``table``, ``cohort`` = (number of tokens, M_c, the float sums
    of the bounds, the table's stamp)) except at the ``nt`` row tokens of ``Ltouched``, the
    first slots of the compact accumulator ``Lacc`` (slot map ``Lwhere``; stamp ``s`` in
    column 0, the row's enclosure of the whole logit in columns 1 and 2, its position in
    the table in column 4, −1 if none); every other token has logit exactly 0. The row's
    valid tokens ``valid[vptr_lo:vptr_hi]`` are looked up by scanning when few, else marked
    with ``sv`` in ``vstamp``.

    With M the shift (the largest midpoint of the row's logits, and 0 when a token has
    logit 0) and Q the row tokens together with the valid tokens of the table: the
    invalid mass is e^(M_c − M)·(Σ_table − Σ_{Q ∩ table}) (every other table token is
    invalid and not a row token, :func:`_table_rest`) plus the invalid tokens of Q plus the
    zero-logit invalid ones; the valid mass is that of the valid tokens of Q plus the
    zero-logit valid ones. A table of at most ``DIRECT`` tokens, or of at most twice as many
    as the row has valid tokens (their lookups cost as much), is not subtracted from: its
    tokens the row did not change are summed with the row's, exactly as the plain kernel
    sums its logits."""
    tok, mid, rad, elo, ehi, by_mid = table[0], table[1], table[2], table[3], table[4], table[5]
    nL, M_c, c_lo, c_hi, sg = cohort
    small = vptr_hi - vptr_lo <= SMALL_VALID
    n_valid = _count_valid(valid, vptr_lo, vptr_hi, vstamp, sv, small)
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
        if row_of(t, Lacc, s, Ltouched, Lwhere) >= 0:
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
    sums = (0.0, 0.0, 0.0, 0.0, 0, 0)
    sub = (0.0, 0.0, 0)                                # Q ∩ table: its table bounds' float sums, count
    for u in range(nt):
        sums = _tally_logit(sums, _is_valid(Ltouched[u], small, valid, vptr_lo, vptr_hi, vstamp, sv), Lacc[u, 1],
                            Lacc[u, 2], M, memo, QUICK)
        sub = _in_table(sub, int(Lacc[u, 4]), elo, ehi)
    direct = nL <= DIRECT or 2 * (vptr_hi - vptr_lo) >= nL
    if direct:
        # a short table, or one the row's valid tokens would cover for the most part: its
        # tokens the row did not change are summed here, as the plain kernel sums them
        for w in range(nL):
            if row_of(tok[w], Lacc, s, Ltouched, Lwhere) < 0:
                sums = _tally_logit(sums, _is_valid(tok[w], small, valid, vptr_lo, vptr_hi, vstamp, sv), mid[w],
                                    rad[w], M, memo, QUICK)
    else:
        for q in range(vptr_lo, vptr_hi):              # the valid tokens of the table the row did not change
            w = _unchanged_valid(q, small, valid, vptr_lo, vstamp, sv, Lacc, s, Ltouched, Lwhere, nL, table)
            if w >= 0:
                sums = _tally_logit(sums, True, mid[w], rad[w], M, memo, QUICK)
                sub = _in_table(sub, w, elo, ehi)
    # and Σ over the table's other tokens (none left when its tokens were summed directly)
    rest_lo, rest_hi = (0.0, 0.0) if direct else _table_rest(c_lo, c_hi, nL, sub, M_c, M, memo)
    z_lo, z_hi = _zero_terms(M, memo, QUICK)
    inv_lo, inv_hi, val_lo, val_hi = _widened(sums, sums[5], zeros, n_valid, z_lo, z_hi, QUICK)
    inv_lo = step_down(inv_lo + rest_lo, QUICK)
    inv_hi = step_up(inv_hi + rest_hi, QUICK)
    err_lo, err_hi, rho_lo, rho_hi = _error_rho((inv_lo, inv_hi, val_lo, val_hi), z_lo, z_hi, QUICK)
    return err_lo, err_hi, arg, rho_lo, rho_hi


# --- the ablation ----------------------------------------------------------------------------------------


@kernel()
def _gap(best, hi_o, zeros, quick):
    """A lower bound of max_{t != o} z_t − z_o from ``best``, the largest lower end among the
    logits of the tokens other than o that are enclosed, and ``hi_o``, the upper end of z_o
    (exactly 0 when o's logit is exactly 0); ``zeros``: the number of other tokens of logit
    exactly 0 (their maximum is then >= 0).

    Why it is a lower bound: z_o <= hi_o, and max_{t != o} z_t >= lo(z_t) for each enclosed
    t != o, and >= 0 when some other token has logit 0; the difference is rounded downward,
    and where the two floats compare best >= hi_o the exact difference is >= 0, so 0 is a
    lower bound too (an exact tie, as between two logits of exactly 0, is kept). The bound
    is >= 0 exactly when some token t != o is certified to have z_t >= z_o (L2: o is not the
    strict top token; a tie counts, as a greedy argmax may return either)."""
    if zeros > 0 and best < 0.0:
        best = 0.0
    if not np.isfinite(best):
        return -np.inf
    if best >= hi_o:               # the exact difference is >= 0: a tie is certified as such
        return max(step_down(best - hi_o, quick), 0.0)
    return step_down(best - hi_o, quick)


@kernel(borrows=True)
def _top_gap(nt, Ltouched, Lacc, V, o):
    """:func:`_gap` over the logits in the dense accumulator (the ``nt`` tokens of
    ``Ltouched``, mid in column 1 and radius in column 2; every other token of the ``V`` has
    logit exactly 0), and the number of tokens other than ``o`` of logit exactly 0. A
    non-finite enclosure among the touched logits decides nothing (−∞)."""
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
    return _gap(best, hi_o, zeros, None), zeros


@kernel(borrows=True)
def _mark(Urows, row, dest, ustamp, side, s):
    """Row ``row`` of U (``Urows``: U as CSR by token) into ``dest``, each coordinate stamped
    ``s`` in column ``side`` of ``ustamp`` (coordinates beyond dest's size meet no residual entry)."""
    U_ptr, U_idx, U_val = Urows
    for q in range(U_ptr[row], U_ptr[row + 1]):
        if U_idx[q] < dest.size:
            dest[U_idx[q]] = U_val[q]
            ustamp[U_idx[q], side] = s


@kernel(borrows=True)
def _pair_terms(X, row, ut, uo, ustamp, s, sums):
    """The terms (U_tj − U_oj)·r_j of row ``row`` of residual rows X (CSR: ptr, idx, mid, rad)
    added to ``sums`` = (mid, A, B, n) as every entry of the pass is summed; a coordinate where
    U_tj = U_oj contributes exactly 0 and is skipped. Returns (sums, whether every difference
    was exact (checked by TwoSum) and finite)."""
    ptr, idx, rm, rr = X
    mid, A, B, n = sums
    for e in range(ptr[row], ptr[row + 1]):
        j = idx[e]
        a = ut[j] if ustamp[j, 0] == s else 0.0
        b = uo[j] if ustamp[j, 1] == s else 0.0
        if a == b:
            continue
        d = a - b
        bb = d - a                                     # TwoSum: d + err = a − b exactly
        err = (a - (d - bb)) + (-b - bb)
        if err != 0.0 or not np.isfinite(d):
            return (mid, A, B, n), False
        m, ta, tb = prod_terms(rm[e], rr[e], d)
        mid += m
        A = up_nonneg(A + ta)
        B = up_nonneg(B + tb)
        n += 1
    return (mid, A, B, n), True


@kernel(borrows=True)
def _pair_gap(X, row, Y, row_y, t, o, Urows, u_scratch, s, quick):
    """A lower bound of z_t − z_o = Σ_j (U_tj − U_oj)·r_j for a residual row r, given as row
    ``row`` of X plus (Y not None: the factored pass's two parts) row ``row_y`` of Y (r_j
    exactly 0 off their entries; a coordinate in both contributes two terms), from the
    difference of the two rows of U rather than of the two logits' enclosures: a coordinate
    where U_tj = U_oj contributes exactly 0 whatever r_j is, so a common part of the two
    rows (a shared offset, however large) costs nothing. Each other term is the interval r_j
    times the float d_j = U_tj − U_oj when that difference is exact (:func:`_pair_terms`).
    Returns −∞ when a difference is not exact or a value is not finite (the caller keeps its
    other bound); exactly 0 when no coordinate contributes. ``u_scratch`` = (ut, uo, ustamp)."""
    ut, uo, ustamp = u_scratch
    _mark(Urows, t, ut, ustamp, 0, s)
    _mark(Urows, o, uo, ustamp, 1, s)
    sums, ok = _pair_terms(X, row, ut, uo, ustamp, s, (0.0, 0.0, 0.0, 0))
    if Y is not None and ok:
        sums, ok = _pair_terms(Y, row_y, ut, uo, ustamp, s, sums)
    mid, A, B, n = sums
    if not ok:
        return -np.inf
    if n == 0:
        return 0.0
    r = entry_radius(A, B, n)
    if not (np.isfinite(mid) and np.isfinite(r)):
        return -np.inf
    return step_down(mid - r, quick)


@kernel()
def _ablated_outputs(P):
    """Per row: error lower and upper end, ρ's lower and upper end, gap (NaN: no target), the
    count of other tokens of logit 0 (−1: no target), 1 − P(o)'s lower end (NaN: no target)."""
    return (np.empty(P), np.empty(P), np.empty(P), np.empty(P), np.full(P, np.nan), np.full(P, -1, np.int64),
            np.full(P, np.nan))


@kernel(borrows=True)
def _alone(valid, lo, hi, o):
    """Whether the valid tokens ``valid[lo:hi]`` are o alone."""
    return hi - lo == 1 and valid[lo] == o


@kernel(borrows=True)
def _put_logits(L, row, Lacc, s, Ltouched, nt, Lwhere, dep):
    """Row ``row`` of logit rows L (:func:`logits`' form) into the accumulator as they are,
    midpoint in column 1 and radius in column 2; in the deployed pass (``dep`` as
    :func:`row_logits` takes it; None: the exact pass) each radius widened by the logits'
    rounding (there being no output sum: y = r̂). Returns the touched count."""
    L_ptr, L_idx, L_mid, L_rad, L_mag = L
    for e in range(L_ptr[row], L_ptr[row + 1]):
        u, nt = place(L_idx[e], Lacc, s, Ltouched, nt, Lwhere)
        Lacc[u, 1] = L_mid[e]
        Lacc[u, 2] = L_rad[e]
        if dep is not None:
            Lacc[u, 2] = widen_logit(L_rad[e], L_mag[e], dep[0], dep[4][L_idx[e]], dep[5][row], False)
    return nt


@kernel(borrows=True)
def _ablated_rows(rows, L, V, valid_ptr, valid, scratch, stamp0, target, R, Urows, u_scratch, out, dep):
    """The rows of :func:`ablated` (its arguments) into ``out`` (:func:`_ablated_outputs`);
    ``dep`` (the deployed pass; None: the exact one) as :func:`row_logits` takes it."""
    Lacc, Ltouched, vstamp, only = scratch
    err_lo, err_hi, rho_lo, rho_hi, gap, zeros, obj_lo = out
    P = rows.size
    for q in range(P):
        i, s, o = rows[q], stamp0 + q, target[rows[q]]
        nt = _put_logits(L, i, Lacc, s, Ltouched, 0, None, dep)
        if o >= 0:
            gap[q], zeros[q] = _top_gap(nt, Ltouched, Lacc, V, o)
            if dep is None and not (gap[q] >= 0.0):
                best_t = -1                            # the token other than o of the largest midpoint
                best_m = -np.inf
                for u in range(nt):
                    t = Ltouched[u]
                    if t != o and Lacc[t, 1] > best_m:
                        best_m = Lacc[t, 1]
                        best_t = t
                if best_t >= 0:
                    pg = _pair_gap(R, i, None, 0, best_t, o, Urows, u_scratch, float(s), None)
                    if pg > gap[q]:
                        gap[q] = pg
        if dep is None:
            lo, hi, _, rho_lo[q], rho_hi[q] = error_enclosure(nt, Ltouched, Lacc, V, valid_ptr[i], valid_ptr[i + 1],
                                                              valid, vstamp, s)
        else:
            lo, hi, _ = error_enclosure_deployed(nt, Ltouched, Lacc, V, valid_ptr[i], valid_ptr[i + 1], valid, vstamp,
                                                 s, dep[1])
            rho_lo[q], rho_hi[q] = np.nan, np.nan
        err_lo[q], err_hi[q] = lo, hi
        if o < 0:
            continue
        only[0] = o                                    # L1: 1 − P(o) for o alone
        if _alone(valid, valid_ptr[i], valid_ptr[i + 1], o):
            obj_lo[q] = lo
        elif dep is None:
            obj_lo[q] = error_enclosure(nt, Ltouched, Lacc, V, 0, 1, only, vstamp, s + P)[0]
        else:
            obj_lo[q] = error_enclosure_deployed(nt, Ltouched, Lacc, V, 0, 1, only, vstamp, s + P, dep[1])[0]


@kernel(args=(I1, LOGITS, "i64", I1, I1, F2, I1, F1, "i64", DEPLOYED, I1, PART, CSR, (F1, F1, F2)),
        returns=(F1, F1, F1, F1, F1, I1, F1))
def ablated(rows, L, V, valid_ptr, valid, Lacc, Ltouched, vstamp, stamp0, deployed, target, R, Urows, u_scratch):
    """The error enclosure of softmax(U·r) (the routed expert's output removed) for ``rows``,
    from the logits of :func:`logits`, and its zero-logit probability ρ
    (:func:`error_enclosure`). In the deployed pass (``deployed`` as
    :func:`verifier.arithmetic.experts.experts` takes it) the logits U·r̂ carry their rounding
    (there is no output sum: y = r̂) and the error is Lemma F2's (no ρ).

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
    P = rows.size
    out = _ablated_outputs(P)
    scratch = (Lacc, Ltouched, vstamp, np.empty(1, np.int64))   # the last: the valid set {o}
    if deployed[0]:
        _ablated_rows(rows, L, V, valid_ptr, valid, scratch, stamp0, target, R, Urows, u_scratch, out, deployed[1:])
    else:
        _ablated_rows(rows, L, V, valid_ptr, valid, scratch, stamp0, target, R, Urows, u_scratch, out, None)
    return out


@kernel(borrows=True)
def _first_unchanged(order, nL, tok, o, Lacc, s, Ltouched, Lwhere):
    """The first table position in ``order`` whose token is not o and not one the row changed; −1 if none."""
    for u in range(nL):
        t = tok[order[u]]
        if t != o and row_of(t, Lacc, s, Ltouched, Lwhere) < 0:
            return order[u]
    return -1


@kernel(borrows=True)
def _gap_parts(i, c, o, nt, Lacc, Ltouched, Lwhere, s, table, nL, V, S, O, Urows, u_scratch):
    """:func:`_gap` for a row of the factored pass (its logits the cohort's table but at its
    ``nt`` tokens, :func:`error_enclosure_parts`): the largest lower end among the other
    tokens, a token of logit 0 counting 0, against the upper end of z_o; where negative,
    also the direct comparison of the largest other token with o (:func:`_pair_gap` over the
    two parts S and O). Returns (gap, the number of other tokens of logit exactly 0)."""
    tok, mid, rad, by_mid, by_lo = table[0], table[1], table[2], table[5], table[6]
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
            hi_o = step_up(m_ + r_, QUICK)
            o_touched = True
        else:
            best = max(best, step_down(m_ - r_, QUICK))
            if m_ > best_m or (m_ == best_m and t < best_t):
                best_m = m_
                best_t = t
    w_o = position(o, nL, table) if not o_touched else -1
    if w_o >= 0:
        hi_o = step_up(mid[w_o] + rad[w_o], QUICK)
        o_touched = True
    w = _first_unchanged(by_lo, nL, tok, o, Lacc, s, Ltouched, Lwhere)
    if w >= 0:
        best = max(best, step_down(mid[w] - rad[w], QUICK))
    w = _first_unchanged(by_mid, nL, tok, o, Lacc, s, Ltouched, Lwhere)
    if w >= 0 and (mid[w] > best_m or (mid[w] == best_m and tok[w] < best_t)):
        best_m = mid[w]
        best_t = tok[w]
    zero = V - nL - new - (0 if o_touched else 1)
    if not finite:
        return -np.inf, zero
    gap = _gap(best, hi_o, zero, QUICK)
    if not (gap >= 0.0) and best_t >= 0:
        pg = _pair_gap(S, c, O, i, best_t, o, Urows, u_scratch, float(s), QUICK)
        if pg > gap:
            gap = pg
    return gap, zero


@kernel(args=(I1, I1, LOGITS, LOGITS, "i64", I1, I1, ACC, F1, TABLE_ARRAYS, F2, "i64", I1, PART, PART, CSR,
              (F1, F1, F2)), returns=(F1, F1, F1, F1, F1, I1, F1))
def ablated_parts(rows, cohort, Ls, Lo, V, valid_ptr, valid, L_scratch, vstamp, table, memo, stamp0, target, S,
                  O, Urows, u_scratch):
    """The ablated quantities of :func:`ablated` (exact pass) for ``rows`` (grouped by
    cohort), from the logits U·r = U·s_c + U·o_i: the error enclosure and ρ
    (:func:`error_enclosure_parts` over the cohort's table of U·s_c and the row's tokens),
    and for a row with a target o the lower bound of max_{t != o} z_t − z_o
    (:func:`_gap_parts`), the count of other tokens of logit exactly 0, and a lower end of
    1 − P(o) for o alone. A token in both parts has the logit [m_s ± ρ_s] + [m_o ± ρ_o], two
    interval terms. Stamps: ``stamp0 + q`` and ``stamp0 + P + q`` per row, ``stamp0 + 2P + g``
    per cohort. ``L_scratch``: the logits' compact accumulator (acc, touched, where:
    :func:`verifier.arithmetic.accumulate.slot`). ``u_scratch``: the work arrays (ut, uo,
    ustamp) of :func:`_pair_gap`, over the residual coordinates (stamp 0: no row's), kept by
    the caller: allocating them per call cost a pass over d coordinates per batch (at 20M
    facts, d = 15M: most of the ablation's time)."""
    Lo_ptr, Lo_idx, Lo_mid, Lo_rad, Lo_mag = Lo
    mid, rad = table[1], table[2]
    P = rows.size
    out = _ablated_outputs(P)
    err_lo, err_hi, rho_lo, rho_hi, gap, zeros, obj_lo = out
    only = np.empty(1, np.int64)
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
            nL = _put_logits(Ls, c, Lacc, sg, Ltouched, 0, Lwhere, None)
            M_c, c_lo, c_hi, bad_c = cohort_table(nL, Ltouched, Lacc, table, sg)
            meta = (nL, M_c, c_lo, c_hi, sg)
        nL = meta[0]
        nt = 0
        for e in range(Lo_ptr[i], Lo_ptr[i + 1]):
            t = Lo_idx[e]
            sl, nt = place(t, Lacc, s, Ltouched, nt, Lwhere)
            w = position(t, nL, table)
            if w >= 0:
                Lacc[sl, 1] = Lo_mid[e] + mid[w]
                Lacc[sl, 2] = entry_radius(up_nonneg(Lo_rad[e] + rad[w]), up_nonneg(abs(Lo_mid[e]) + abs(mid[w])), 2)
            else:
                Lacc[sl, 1] = Lo_mid[e]
                Lacc[sl, 2] = Lo_rad[e]
            Lacc[sl, 4] = w
        o = target[i]
        if bad_c:
            err_lo[q], err_hi[q], rho_lo[q], rho_hi[q] = 0.0, 1.0, np.nan, np.nan
            if o >= 0:
                gap[q], zeros[q], obj_lo[q] = -np.inf, V - nL - nt, 0.0
            continue
        lo, hi, _, rho_lo[q], rho_hi[q] = error_enclosure_parts(nt, Ltouched, Lacc, Lwhere, s, table, meta, V,
                                                                valid_ptr[i], valid_ptr[i + 1], valid, vstamp, s, memo)
        err_lo[q], err_hi[q] = lo, hi
        if o < 0:
            continue
        gap[q], zeros[q] = _gap_parts(i, c, o, nt, Lacc, Ltouched, Lwhere, s, table, nL, V, S, O, Urows, u_scratch)
        only[0] = o                                    # L1: 1 − P(o) for o alone
        obj_lo[q] = lo if _alone(valid, valid_ptr[i], valid_ptr[i + 1], o) else error_enclosure_parts(
            nt, Ltouched, Lacc, Lwhere, s, table, meta, V, 0, 1, only, vstamp, s + P, memo)[0]
    return out
