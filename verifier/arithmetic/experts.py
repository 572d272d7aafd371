"""The experts stage: an expert applied to a residual row, and the one-layer readout fused with it.

**One expert on one row** (:func:`expert_output`). z = W_1 x + b_1 per neuron of expert k the
row x reaches (:func:`_z_terms`; a neuron it does not reach has pre-activation exactly b_1 and
contributes max(b_1, 0)), a = ReLU(z) (:func:`_activity`), and the expert's output
o = c·W_2·a into an accumulator, c the gate's scale (1 in gate mode "top1"). The layer's output
row is y = r + o: a layer above would add r's entries to the same accumulator as interval
terms and read y from it (each entry a sum of terms, :mod:`verifier.arithmetic.accumulate`).

**The one-layer readout, fused.** The logits are U·y = U·r + U·o: U·r is enclosed once per
row (:func:`verifier.arithmetic.logits.logits`), shared by the ablation and every expert that
may win, so the kernels here do not form y: per (row, expert) pair they apply the expert,
add U·o to the row's U·r (:func:`verifier.arithmetic.logits.row_logits`) and read the
output softmax's error from the logits, in one pass over the pair's accumulators.

* :func:`experts` (the plain pass): each pair from scratch, in dense accumulators, stepping
  with nextafter; in the deployed pass of a format each neuron's pre-activation, each output
  coordinate and each logit also carries its stage's rounding
  (:mod:`verifier.arithmetic.deployed`).
* :func:`experts_parts` (the factored pass): per (cohort, expert) once, the expert applied to
  the cohort's shared part s_c (:func:`expert_output` again, keeping each neuron's z and
  activity) and the shared logits; per pair only what the row's own part o_i changes
  (:func:`_own_pairs`), in compact accumulators, with the two-flop steps.

*Layers.* A stack of layers would apply, per layer, residual → gate → experts to its rows
(:mod:`verifier.arithmetic.residual`, :mod:`verifier.arithmetic.gate`, :func:`expert_output`
for each expert that may win, forming y), and the readout (logits, error, ablation:
:mod:`verifier.arithmetic.logits`) once, on the top layer's rows; the one-layer model is a
stack of one, whose readout is fused with its experts here.
"""

from __future__ import annotations

import numpy as np

from verifier.arithmetic.accumulate import (ACC, B1, CSR, F1, F2, I1, I2, J1, LOGITS, PART, add_term, entry_radius,
                                            lower_bound, mul_interval, new_rows, place, prod_terms, product_terms,
                                            put, room, row_of, trimmed)
from verifier.arithmetic.kernel_forms import kernel
from verifier.arithmetic.constants import U
from verifier.arithmetic.deployed import DEPLOYED, KC, widen, widen_logit, zero_read
from verifier.arithmetic.logits import (TABLE_ARRAYS, cohort_table, error_enclosure, error_enclosure_deployed,
                                        error_enclosure_parts, position, row_logits, to_radii)
from verifier.arithmetic.rounding import QUICK, step_down, step_up, up_nonneg, up_one_plus

# The declared type of the factored kernel's work arrays (experts_parts).
SCRATCH = (*ACC, F1, F1, F1, F1, B1, *ACC, *ACC, *ACC, F1, TABLE_ARRAYS, I1, F2)


# --- one expert on one row ---------------------------------------------------------------------------


@kernel(borrows=True)
def _z_terms(X, row, W1T, lo_n, hi_n, zacc, s, ztouched, nz, zwhere):
    """W_1 x for row ``row`` of residual rows X (CSR: ptr, idx, mid, rad) over the neurons
    lo_n..hi_n − 1 (one expert's; W1T: W_1^T as CSR, each row sorted by neuron), as product
    terms in the z accumulator (neuron g at column g − lo_n). Returns (touched count, an
    entry of x not finite)."""
    ptr, idx, mid, rad = X
    W1T_ptr, W1T_idx, W1T_val = W1T
    bad = False
    for e in range(ptr[row], ptr[row + 1]):
        j = idx[e]
        if not (np.isfinite(mid[e]) and np.isfinite(rad[e])):
            bad = True
        for t in range(lower_bound(W1T_idx, W1T_ptr[j], W1T_ptr[j + 1], lo_n), W1T_ptr[j + 1]):
            if W1T_idx[t] >= hi_n:
                break
            u, nz = place(W1T_idx[t] - lo_n, zacc, s, ztouched, nz, zwhere)
            m, a, b = prod_terms(mid[e], rad[e], W1T_val[t])
            add_term(u, m, a, b, zacc)
    return nz, bad


@kernel()
def _biased(zmid, zrad, b):
    """The pre-activation [zm ± zr] = [zmid ± zrad] + b (the addition's rounding u·|zm| added)."""
    zm = zmid + b
    return zm, up_nonneg(zrad + up_nonneg(U * abs(zm)))


@kernel()
def _activity(zm, zr, quick):
    """ReLU of [zm ± zr] as (mid, rad, upper end): the upper end is exactly 0 where the neuron
    is off (and then mid = rad = 0)."""
    a_lo = max(step_down(zm - zr, quick), 0.0)
    a_hi = max(step_up(zm + zr, quick), 0.0)
    if a_hi == 0.0:
        return 0.0, 0.0, 0.0
    if a_lo == a_hi:
        return a_lo, 0.0, a_hi
    am = 0.5 * a_lo + 0.5 * a_hi
    return am, max(step_up(a_hi - am, quick), step_up(am - a_lo, quick)), a_hi


@kernel(borrows=True)
def _record(lst, g):
    """Neuron g appended to ``lst``, whose last entry counts the neurons recorded (more than
    its room: counted, not listed)."""
    room = lst.size - 1
    c = lst[room]
    if c < room:
        lst[c] = g
    lst[room] = c + 1


@kernel(borrows=True)
def _unscaled(W2T, g, mag, y, s, new, ny):
    """Neuron g's share of the magnitudes of W_2·a before the gate scale: mag·|W_2[j, g]|
    (``mag`` >= a_g's upper end) added to column 5 of each of its output coordinates' rows
    of the y accumulator ``y`` (stamp s), after zeroing column 5 of the rows the neuron's
    terms started (touched positions ``new`` .. ``ny`` − 1)."""
    W2T_ptr, W2T_idx, W2T_val = W2T
    yacc, ytouched, ywhere = y
    for u in range(new, ny):
        yacc[ytouched[u] if ywhere is None else u, 5] = 0.0
    for t in range(W2T_ptr[g], W2T_ptr[g + 1]):
        v = row_of(W2T_idx[t], yacc, s, ytouched, ywhere)
        yacc[v, 5] = up_nonneg(yacc[v, 5] + up_nonneg(mag * abs(W2T_val[t])))


@kernel(borrows=True)
def expert_output(X, row, k, scale, first, W1T, W2T, z, y, s, watch, rec, keep, dep, quick):
    """Expert k applied to row ``row`` of residual rows X (CSR: ptr, idx, mid, rad): its output
    o = c·W_2·ReLU(W_1 x + b_1) into the y accumulator ``y`` = (acc, touched, where), stamp s,
    with c in ``scale`` = (cm, cr) (1 ± 0: not scaled); the z accumulator ``z`` likewise.
    ``first`` = (where each expert's neurons start, their biases b_1, the positive-bias
    neurons of each expert as CSR); ``W1T``, ``W2T``: W_1^T and W_2^T of all experts as CSR.

    The neurons x reaches that may be on, then the positive-bias neurons it does not reach
    (activity exactly b_1). ``watch`` (bool per neuron; empty: none) selects neurons whose
    possible activity is recorded in ``rec`` (:func:`_record`). ``keep`` (None: not kept) =
    per slot of z: its sum's midpoint and radius, the activity's mid and radius, whether it
    may be on. ``dep`` (the deployed pass; None: the exact one): the arrays of
    :func:`experts`' ``deployed`` but its first (:data:`verifier.arithmetic.deployed.DEPLOYED`):
    each pre-activation widened by its stage's rounding. ``quick``: the rounding steps
    (:mod:`verifier.arithmetic.rounding`).

    With a gate scale (c != 1) in the deployed pass a runtime computes W_2·a before
    multiplying by c (the execution model's order), so each output coordinate's unscaled
    magnitude Σ_g |W_2[j, g]|·a_g's upper end is kept too, in column 5 of the y accumulator
    (which must have six columns), and checked against the format's largest value: c·W_2·a
    finite does not make W_2·a finite (c may be as small as 1/K), and an infinite W_2·a
    gives c·∞ = ∞, or 0·∞ = NaN where a runtime removes the expert by a zero scale.

    Returns (the y accumulator's touched count, a value not finite or one that may overflow,
    Σ of the activities' upper ends (for the deployed pass's allowances))."""
    off, b1, pos_ptr, pos_idx = first
    W2T_ptr, W2T_idx, W2T_val = W2T
    zacc, ztouched, zwhere = z
    yacc, ytouched, ywhere = y
    cm, cr = scale
    scaled = cr != 0.0 or cm != 1.0
    unscaled = scaled and dep is not None              # W_2·a's own magnitude is checked (column 5 of y)
    lo_n = off[k]
    nz, bad = _z_terms(X, row, W1T, lo_n, off[k + 1], zacc, s, ztouched, 0, zwhere)
    ny = 0
    l1a = 0.0
    for u in range(nz):
        g = lo_n + ztouched[u]
        v = ztouched[u] if zwhere is None else u
        zrad = entry_radius(zacc[v, 2], zacc[v, 3], int(zacc[v, 4]))
        zm, zr = _biased(zacc[v, 1], zrad, b1[g])
        if dep is not None:
            fp, rs_z, l1r = dep[0], dep[2], dep[5]
            zr = widen(zr, up_nonneg(up_nonneg(zacc[v, 2] + zacc[v, 3]) + abs(b1[g])), fp[KC.rho_z], fp[KC.f_z],
                       zero_read(fp, up_nonneg(l1r[row] + rs_z[g])), fp[KC.largest])
        if keep is not None:
            keep[0][u], keep[1][u], keep[4][u] = zacc[v, 1], zrad, False
        if not (np.isfinite(zm) and np.isfinite(zr)):
            bad = True
            continue
        am, ar, a_hi = _activity(zm, zr, quick)
        if keep is not None:
            keep[2][u], keep[3][u], keep[4][u] = am, ar, a_hi != 0.0
        if a_hi == 0.0:
            continue                                   # exactly 0: the neuron is off
        l1a = up_nonneg(l1a + a_hi)
        if watch.size > 0 and watch[g]:
            _record(rec, g)
        if scaled:
            am, ar = mul_interval(am, ar, cm, cr)
        seen = ny
        ny = product_terms(W2T_ptr, W2T_idx, W2T_val, g, am, ar, yacc, s, ytouched, ny, ywhere)
        if unscaled:
            _unscaled(W2T, g, a_hi, y, s, seen, ny)
    for t in range(pos_ptr[k], pos_ptr[k + 1]):
        g = pos_idx[t]
        if row_of(g - lo_n, zacc, s, ztouched, zwhere) >= 0:
            continue                                   # reached: handled above
        if watch.size > 0 and watch[g]:
            _record(rec, g)
        am, ar = b1[g], 0.0
        l1a = up_nonneg(l1a + abs(am))
        if scaled:
            am, ar = mul_interval(am, ar, cm, cr)
        seen = ny
        ny = product_terms(W2T_ptr, W2T_idx, W2T_val, g, am, ar, yacc, s, ytouched, ny, ywhere)
        if unscaled:
            _unscaled(W2T, g, abs(b1[g]), y, s, seen, ny)
    if dep is not None:                                # W_2·a itself may overflow before the scale
        if scaled:
            fp = dep[0]
            grow_o = up_one_plus(fp[KC.rho_o])
            for u in range(ny):
                if not (up_nonneg(grow_o * yacc[ytouched[u] if ywhere is None else u, 5]) < fp[KC.largest]):
                    bad = True
    return ny, bad, l1a


@kernel(borrows=True)
def _interval_terms(X, row, keep, acc, s, touched, nt):
    """Row ``row`` of interval rows X (CSR: ptr, idx, mid, rad), its entries in the columns
    ``keep`` marks, into the dense accumulator (stamp s), one interval term each. Returns
    (touched count, an entry not finite)."""
    ptr, idx, mid, rad = X
    bad = False
    for t in range(ptr[row], ptr[row + 1]):
        if not keep[idx[t]]:
            continue
        u, nt = place(idx[t], acc, s, touched, nt, None)
        add_term(u, mid[t], rad[t], abs(mid[t]), acc)
        if not (np.isfinite(mid[t]) and np.isfinite(rad[t])):
            bad = True
    return nt, bad


@kernel(borrows=True)
def _put_row(out, e, acc, touched, ny, n_o, keep):
    """The y accumulator's entries in the columns ``keep`` marks into the rows ``out`` from
    entry e (room made by the caller): an entry first touched at slot n_o or later holding
    one term is that interval term as it is, any other entry enclosed by
    :func:`entry_radius`. Returns (the row's end, an entry not finite)."""
    bad = False
    for u in range(ny):
        col = touched[u]
        if not keep[col]:
            continue
        if u >= n_o and acc[col, 4] == 1.0:
            r_ = acc[col, 2]
        else:
            r_ = entry_radius(acc[col, 2], acc[col, 3], int(acc[col, 4]))
        if not (np.isfinite(acc[col, 1]) and np.isfinite(r_)):
            bad = True
        e = put(out, e, col, acc[col, 1], r_)
    return e, bad


@kernel(args=((I1, I1), PART, CSR, (I1, F1, I1, I1), CSR, B1, (F2, I1, F2, I1), "i64"), returns=(*PART, B1))
def layer_rows(pairs, X, W1T, first, W2T, keep, scratch, stamp0):
    """A layer's output rows y = x + W_2·ReLU(W_1·x + b_1) for each pair (row ``rows[q]`` of X,
    expert ``experts_of[q]``) of ``pairs``, as CSR rows of intervals (ptr, idx, mid, rad), one
    per pair, and per pair whether a value may be non-finite (its row then decides nothing).
    Only the entries of the columns ``keep`` marks are formed and stored (those a reader of y
    reads; an entry of another column is left out, not made 0: y is exact where it is read).

    Per pair: the expert's output o into the dense y accumulator (:func:`expert_output`, gate
    scale 1: the gate routes top-1 unscaled), then each entry of x as one interval term
    (midpoint, radius, |midpoint|: the terms of :mod:`verifier.arithmetic.accumulate`), and
    each touched entry's enclosure from its sums by Lemmas 1 and 2 (:func:`entry_radius`:
    the products' rounding and the additions'), except an entry o does not reach: x's term
    alone, as it is (no product, no addition); an expert of no neurons gives y = x as it is.
    An entry no term reaches is exactly 0 and is not stored. The rounding steps are the
    two-flop ones (:data:`verifier.arithmetic.rounding.QUICK`). ``scratch`` = (the z accumulator
    and its touched list, the y accumulator (six columns) and its touched list). Stamps
    ``stamp0`` .. ``stamp0 + P − 1`` are this call's."""
    rows, experts_of = pairs
    zacc, ztouched, yacc, ytouched = scratch
    X_ptr, X_idx, X_mid, X_rad = X
    P = rows.size
    out = new_rows(P, max(X_idx.size, 1))
    bad_out = np.zeros(P, np.bool_)
    none = np.zeros(0, np.bool_)
    rec = np.zeros(1, np.int64)
    e = 0
    off = first[0]
    for q in range(P):
        i, s, k = rows[q], stamp0 + q, experts_of[q]
        if off[k] == off[k + 1]:                       # an expert of no neurons: y = x, as it is
            bad = False
            if e + X_ptr[i + 1] - X_ptr[i] > out[1].size:
                out = room(out, e + X_ptr[i + 1] - X_ptr[i])
            for t in range(X_ptr[i], X_ptr[i + 1]):
                if not keep[X_idx[t]]:
                    continue
                if not (np.isfinite(X_mid[t]) and np.isfinite(X_rad[t])):
                    bad = True
                e = put(out, e, X_idx[t], X_mid[t], X_rad[t])
            out[0][q + 1] = e
            bad_out[q] = bad
            continue
        ny, bad, _ = expert_output(X, i, k, (1.0, 0.0), first, W1T, W2T, (zacc, ztouched, None),
                                   (yacc, ytouched, None), s, none, rec, None, None, QUICK)
        n_o = ny                                       # the entries o reaches (their terms are products)
        ny, bad_x = _interval_terms(X, i, keep, yacc, s, ytouched, ny)     # x itself, one interval term per entry
        if e + ny > out[1].size:
            out = room(out, e + ny)
        e, bad_y = _put_row(out, e, yacc, ytouched, ny, n_o, keep)
        out[0][q + 1] = e
        bad_out[q] = bad or bad_x or bad_y
    ptr, idx, mid, rad = trimmed(out, e)
    return ptr, idx, mid, rad, bad_out


@kernel(borrows=True)
def _group_end(rows, experts_of, cohort, q0):
    """The end of the run of pairs from ``q0`` of one (cohort, expert) (the pairs grouped so)."""
    c, k = cohort[rows[q0]], experts_of[q0]
    q1 = q0 + 1
    while q1 < rows.size and cohort[rows[q1]] == c and experts_of[q1] == k:
        q1 += 1
    return q1


@kernel(borrows=True)
def _corrections(O, i, W1T, lo_n, hi_n, first, W2T, z_own, shared, y, s, watch, rec):
    """For row i's own part o_i (rows O) and one expert (neurons lo_n..hi_n − 1), the terms
    W_2[:, g]·(a_g − a^c_g) of every neuron g that o_i reaches, into the y accumulator
    ``y`` = (acc, touched, where), stamp s, from its first slot: a_g from z = [z^c] (one
    interval term, where s_c reaches g too) + the products of o_i + b_1, a^c_g the shared
    activity (b_1 where s_c does not reach g, exactly 0 when it is off; −a^c_g·w is
    a^c_g·(−w) to the bit). ``shared`` = (the shared z's compact accumulator (acc, touched,
    where), its stamp, per slot z^c's mid and radius and a^c's mid, radius and whether it may
    be on). Watched neurons (``watch``; empty: none) that may be on go to ``rec``
    (:func:`_record`). Returns (the y accumulator's touched count, a value not finite)."""
    b1 = first[1]
    W2T_ptr, W2T_idx, W2T_val = W2T
    zacc2, ztouched2, zwhere2 = z_own
    zc, sg, zc_mid, zc_rad, ac_mid, ac_rad, ac_on = shared
    yacc, ytouched, ywhere = y
    nz, bad = _z_terms(O, i, W1T, lo_n, hi_n, zacc2, s, ztouched2, 0, zwhere2)
    ny = 0
    for u in range(nz):
        g = lo_n + ztouched2[u]
        mid_, A, B, cnt = zacc2[u, 1], zacc2[u, 2], zacc2[u, 3], int(zacc2[u, 4])
        uc = row_of(ztouched2[u], zc[0], sg, zc[1], zc[2])   # the neuron's slot in the shared z, −1: not reached
        if uc >= 0:                                    # the shared z as one interval term
            mid_ += zc_mid[uc]
            A = up_nonneg(A + zc_rad[uc])
            B = up_nonneg(B + abs(zc_mid[uc]))
            cnt += 1
        zm, zr = _biased(mid_, entry_radius(A, B, cnt), b1[g])
        if not (np.isfinite(zm) and np.isfinite(zr)):
            bad = True
            continue
        am, ar, a_hi = _activity(zm, zr, QUICK)
        if a_hi != 0.0 and watch.size > 0 and watch[g]:
            _record(rec, g)
        if uc >= 0:
            cm_, cr_, con = ac_mid[uc], ac_rad[uc], ac_on[uc]
        else:
            cm_, cr_, con = b1[g], 0.0, b1[g] > 0.0
        if a_hi != 0.0:
            ny = product_terms(W2T_ptr, W2T_idx, W2T_val, g, am, ar, yacc, s, ytouched, ny, ywhere)
        if con:                                        # −a^c_g·W_2[:, g]: (−cm)·w is cm·(−w) to the bit
            ny = product_terms(W2T_ptr, W2T_idx, W2T_val, g, -cm_, cr_, yacc, s, ytouched, ny, ywhere)
    return ny, bad


@kernel(args=((I1, I1), PART, PART, I1, CSR, (I1, F1, I1, I1), CSR, B1,
              (F2, I1, J1, F1, F1, F1, F1, B1, F2, I1, J1, F2, I1, F1, F1, I1), "i64"), returns=(*PART, B1))
def layer_rows_parts(pairs, S, O, cohort, W1T, first, W2T, keep, scratch, stamp0):
    """:func:`layer_rows` for rows given in two parts, x_i = s_c + o_i (c = ``cohort[i]``: the
    shared parts ``S``, a row per cohort, and the own parts ``O``, a row per row, of
    :func:`verifier.arithmetic.residual.residual_part`), the pairs grouped by (cohort, expert).

    **Per (cohort c, expert k), once.** The expert applied to s_c (:func:`expert_output`,
    keeping each neuron's z^c = W_1·s_c, enclosed before the bias, and its activity a^c),
    and its output W_2·a^c, each column an enclosed sum (kept as one interval term).

    **Per pair**, what o_i changes: a neuron o_i does not reach has z = z^c + b_1 (the same
    terms), hence a^c; one it reaches gets z = [z^c] (one interval term, where s_c reaches
    it too) + the products of o_i + b_1, and its activity a. So, term for term,

        y_i = s_c + o_i + W_2·a^c + Σ_{g reached by o_i} W_2[:, g]·(a_g − a^c_g)

    (a^c_g = b_1 for a neuron s_c does not reach, exactly 0 when it is off; −a^c_g·w is
    a^c_g·(−w) to the bit): the corrections as product terms, then W_2·a^c, s_c and o_i as
    interval terms, each column enclosed as :func:`layer_rows` encloses it, in the columns
    ``keep`` marks. ``scratch`` = (the shared z's compact accumulator (acc, touched, where),
    per slot of it z^c's mid and radius and a^c's mid, radius and whether it may be on, the
    row's z accumulator (compact), the dense y accumulator and its touched list, the shared
    output's mid and radius per column and its columns). Stamps ``stamp0`` .. ``stamp0 +
    2P − 1`` are this call's."""
    rows, experts_of = pairs
    (zacc, ztouched, zwhere, zc_mid, zc_rad, ac_mid, ac_rad, ac_on, zacc2, ztouched2, zwhere2, yacc, ytouched,
     sy_mid, sy_rad, sy_cols) = scratch
    off = first[0]
    P = rows.size
    out = new_rows(P, max(O[1].size, 16))
    bad_out = np.zeros(P, np.bool_)
    none = np.zeros(0, np.bool_)
    rec = np.zeros(1, np.int64)
    kept = (zc_mid, zc_rad, ac_mid, ac_rad, ac_on)
    e = 0
    n_groups = 0
    q0 = 0
    while q0 < P:                                      # the pairs of one (cohort, expert)
        c, k = cohort[rows[q0]], experts_of[q0]
        q1 = _group_end(rows, experts_of, cohort, q0)
        sg = stamp0 + P + n_groups
        n_groups += 1
        nsy, bad_c, _ = expert_output(S, c, k, (1.0, 0.0), first, W1T, W2T, (zacc, ztouched, zwhere),
                                      (yacc, ytouched, None), sg, none, rec, kept, None, QUICK)
        for u in range(nsy):                           # W_2·a^c, each column enclosed
            col = ytouched[u]
            sy_cols[u] = col
            sy_mid[col] = yacc[col, 1]
            sy_rad[col] = entry_radius(yacc[col, 2], yacc[col, 3], int(yacc[col, 4]))
        shared = ((zacc, ztouched, zwhere), float(sg), *kept)
        for q in range(q0, q1):
            i, s = rows[q], stamp0 + q
            ny, bad = _corrections(O, i, W1T, off[k], off[k + 1], first, W2T, (zacc2, ztouched2, zwhere2), shared,
                                   (yacc, ytouched, None), s, none, rec)
            n_o = ny
            for u in range(nsy):                       # W_2·a^c, one interval term per column
                col = sy_cols[u]
                if keep[col]:
                    v, ny = place(col, yacc, s, ytouched, ny, None)
                    add_term(v, sy_mid[col], sy_rad[col], abs(sy_mid[col]), yacc)
            ny, bad_s = _interval_terms(S, c, keep, yacc, s, ytouched, ny)
            ny, bad_o = _interval_terms(O, i, keep, yacc, s, ytouched, ny)
            need = e + ny
            if need > out[1].size:
                out = room(out, need)
            e, bad_y = _put_row(out, e, yacc, ytouched, ny, n_o, keep)
            out[0][q + 1] = e
            bad_out[q] = bad or bad_c or bad_s or bad_o or bad_y
        q0 = q1
    ptr, idx, mid, rad = trimmed(out, e)
    return ptr, idx, mid, rad, bad_out


@kernel()
def _pair_outputs(P):
    """Per pair: error lower and upper end, argmax token, ρ's lower and upper end."""
    return np.empty(P), np.empty(P), np.empty(P, np.int64), np.empty(P), np.empty(P)


# --- the plain pass ----------------------------------------------------------------------------------


@kernel(borrows=True)
def _fused_pairs(rows, experts_of, cm, cr, R, L, net, V, valid, scratch, stamp0, watch, active, out, dep):
    """The pairs of :func:`experts` (its arguments), each pair q: expert ``experts_of[q]``
    applied to residual row ``rows[q]`` (:func:`expert_output`), U·o added to the row's U·r,
    and the error read from the logits, into row q of ``out``: (err_lo, err_hi, argmax,
    rho_lo, rho_hi, undecided). ``dep`` (the deployed pass; None: the exact one): the arrays
    of :func:`experts`' ``deployed`` but its first (constants, the output softmax's, the row
    sums of W_1, W_2 and U, each row's Σ|r̂|, the logits' magnitudes)."""
    W1T, first, W2T, UT = net
    valid_ptr, valid_ = valid
    zacc, ztouched, yacc, ytouched, Lacc, Ltouched, vstamp = scratch
    err_lo, err_hi, pred, rho_lo, rho_hi, undecided = out
    R_ptr = R[0]
    y = (yacc, ytouched, None)
    for q in range(rows.size):
        i, s = rows[q], stamp0 + q
        ny, bad, l1a = expert_output(R, i, experts_of[q], (cm[q], cr[q]), first, W1T, W2T, (zacc, ztouched, None), y,
                                     s, watch, active[q], None, dep, None)
        if not bad:                                    # logits: U·r (interval terms) plus U·o (product terms)
            cmax = up_nonneg(abs(cm[q]) + cr[q]) if (cr[q] != 0.0 or cm[q] != 1.0) else 1.0
            nt, bad, l1o = row_logits(L, i, UT, y, ny, Lacc, s, Ltouched, None, dep, cmax, l1a)
        if bad:
            err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q], undecided[q] = 0.0, 1.0, -1, np.nan, np.nan, True
            continue
        to_radii(Lacc, Ltouched, nt, None)
        if dep is None:
            err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q] = error_enclosure(
                nt, Ltouched, Lacc, V, valid_ptr[i], valid_ptr[i + 1], valid_, vstamp, s)
            continue
        # the output sum y = r + o and its logits: ||ŷ||_1 <= (1 + ρ_y)(||r̂||_1 + ||ô||_1) + (its entries)·floor
        fp, sm, rs_l, l1r, lmag = dep[0], dep[1], dep[4], dep[5], dep[6]
        l1y = up_nonneg(up_nonneg(up_one_plus(fp[KC.rho_y]) * up_nonneg(l1r[i] + l1o))
                        + up_nonneg((R_ptr[i + 1] - R_ptr[i] + ny) * fp[KC.f_y]))
        for u in range(nt):
            t = Ltouched[u]
            Lacc[t, 2] = widen_logit(Lacc[t, 2], lmag[t], fp, rs_l[t], l1y, True)
            if not np.isfinite(Lacc[t, 2]):
                undecided[q] = True
        err_lo[q], err_hi[q], pred[q] = error_enclosure_deployed(nt, Ltouched, Lacc, V, valid_ptr[i], valid_ptr[i + 1],
                                                                 valid_, vstamp, s, sm)
        rho_lo[q], rho_hi[q] = np.nan, np.nan


@kernel(args=((I1, I1), (F1, F1), PART, LOGITS, CSR, (I1, F1, I1, I1), CSR, CSR, "i64", (I1, I1),
              (F2, I1, F2, I1, F2, I1, F1), "i64", B1, I2, DEPLOYED), returns=(F1, F1, I1, F1, F1, B1))
def experts(pairs, scale, R, L, W1T, first, W2T, UT, V, valid, scratch, stamp0, watch, active, deployed):
    """For each pair (row ``rows[q]``, expert ``experts_of[q]``) of ``pairs``, with the
    expert's output scaled by [cm ± cr] (``scale``; 1 ± 0 in gate mode "top1"): error
    enclosure, argmax token, the zero-logit probability ρ
    (:func:`verifier.arithmetic.logits.error_enclosure`), and whether a value of the pair
    may be non-finite (then the error is [0, 1]).

    Arguments by group: ``R`` the residual rows (ptr, idx, mid, rad), ``L`` their logits U·r
    (:func:`verifier.arithmetic.logits.logits`, the same form), ``W1T``, ``W2T``, ``UT`` the
    first layers of all experts, the second layers and the unembedding as transposed CSR
    (ptr, idx, val), ``first`` where each expert's neurons start (``off``), their biases
    ``b1`` and the positive-bias neurons of each expert (``pos_ptr``, ``pos_idx``), ``V`` the
    vocabulary size, ``valid`` each row's valid next tokens (ptr, tokens), ``scratch`` the
    dense accumulators (z, y and logits with their touched lists, and the valid-token stamps).

    ``watch`` (bool per neuron, over all experts; empty: none) selects neurons whose
    possible activity is recorded: ``active[q, :R]`` receives up to R = active.shape[1] − 1
    watched neurons that may be on for pair q (upper end of ReLU(z) above 0, or a positive
    bias), ``active[q, R]`` how many there were (more than R: the list is incomplete).

    ``deployed`` = (on, constants, the output softmax's constants, row sums of W_1, of W_2
    and of U, each row's Σ|r̂|, a per-token scratch array): in the deployed pass of a format
    each neuron's pre-activation, each output coordinate and each logit also carries its
    stage's rounding (relative to the magnitudes the accumulators hold), floor and
    inputs-read-as-zero allowance (verifier.passes.floating: Stages), a magnitude that may reach
    the format's largest value makes the pair undecided, and the error is Lemma F2's
    (:func:`verifier.arithmetic.logits.error_enclosure_deployed`; no ρ).
    """
    rows, experts_of = pairs
    cm, cr = scale
    net = (W1T, first, W2T, UT)
    out = _pair_outputs(rows.size) + (np.zeros(rows.size, np.bool_),)
    if deployed[0]:
        _fused_pairs(rows, experts_of, cm, cr, R, L, net, V, valid, scratch, stamp0, watch, active, out, deployed[1:])
    else:
        _fused_pairs(rows, experts_of, cm, cr, R, L, net, V, valid, scratch, stamp0, watch, active, out, None)
    return out


# --- the factored pass -------------------------------------------------------------------------------


@kernel(borrows=True)
def _own_pairs(q0, q1, pairs, O, Lo, net, V, valid, z_own, shared, y, L_scratch, stamp0, watch, active, out):
    """The pairs q0..q1 − 1 of :func:`experts_parts` (its arguments), one group (cohort c,
    expert k), each of a row whose residual is s_c + o_i, into row q of ``out``: (err_lo,
    err_hi, argmax, rho_lo, rho_hi). ``shared`` = (the shared z's compact accumulator (acc,
    touched, where), its stamp, per slot the shared z and activity (:func:`expert_output`'s
    ``keep``), the watched shared neurons, the cohort's table, its meta (number of tokens,
    M_c, the float sums of its bounds, its stamp), whether a shared value is not finite, the
    exp memo).

    **The output.** The neurons o_i reaches get z = [zc ± ρc] (one interval term, where s_c
    reaches the neuron too) + the products of o_i + b_1, and their activity a; the output is
    W_2·a^c + Σ_{g reached by o_i} W_2[:, g]·(a_g − a^c_g), an identity (a^c_g = b_1 for a
    neuron s_c does not reach, exactly 0 when it is off): into the y accumulator, from an
    empty one, the correction terms only (the shared output is in the cohort's table).
    Watched neurons that may be on, and the shared part's watched ones the row leaves as they
    were, go to ``active[q]``. **The logits**: U·o_i and U times the correction, plus the
    shared logit as one interval term, at every token they reach; every other token keeps the
    shared logit (:func:`verifier.arithmetic.logits.error_enclosure_parts`)."""
    rows, experts_of = pairs
    W1T, first, W2T, UT = net
    valid_ptr, valid_ = valid
    off = first[0]
    zacc2, ztouched2, zwhere2 = z_own
    zc, sg, keep, cw, table, meta, bad_c, memo = shared
    Lacc, Ltouched, Lwhere, vstamp = L_scratch
    tbl_mid, tbl_rad = table[1], table[2]
    err_lo, err_hi, pred, rho_lo, rho_hi = out
    k = experts_of[q0]
    lo_n = off[k]
    for q in range(q0, q1):
        i, s = rows[q], stamp0 + q
        ny, bad = _corrections(O, i, W1T, lo_n, off[k + 1], first, W2T, z_own, (zc, sg, *keep), y, s,
                               watch, active[q])
        for u in range(cw[cw.size - 1]):               # the shared neurons the row left as they were
            if row_of(cw[u] - lo_n, zacc2, s, ztouched2, zwhere2) < 0:
                _record(active[q], cw[u])
        if not (bad or bad_c):
            nt, bad, _ = row_logits(Lo, i, UT, y, ny, Lacc, s, Ltouched, Lwhere, None, 1.0, 0.0)
        if bad or bad_c:
            err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q] = 0.0, 1.0, -1, np.nan, np.nan
            continue
        for u in range(nt):                            # the cohort's logits completed by the row's
            w = position(Ltouched[u], meta[0], table)
            if w >= 0:                                 # the shared logit as one interval term
                add_term(u, tbl_mid[w], tbl_rad[w], abs(tbl_mid[w]), Lacc)
            Lacc[u, 2] = entry_radius(Lacc[u, 2], Lacc[u, 3], int(Lacc[u, 4]))   # column 2 becomes the radius
            Lacc[u, 4] = w                             # column 4 becomes the table position
        err_lo[q], err_hi[q], pred[q], rho_lo[q], rho_hi[q] = error_enclosure_parts(
            nt, Ltouched, Lacc, Lwhere, s, table, meta, V, valid_ptr[i], valid_ptr[i + 1], valid_, vstamp, s, memo)


@kernel(args=((I1, I1), I1, PART, PART, LOGITS, LOGITS, CSR, (I1, F1, I1, I1), CSR, CSR, "i64", (I1, I1),
              SCRATCH, "i64", B1, I2), returns=(F1, F1, I1, F1, F1))
def experts_parts(pairs, cohort, S, O, Ls, Lo, W1T, first, W2T, UT, V, valid, scratch, stamp0, watch, active):
    """For each pair (row ``rows[q]``, expert ``experts_of[q]``), the pairs grouped by
    (cohort, expert): error enclosure, argmax token and the zero-logit probability ρ, as
    :func:`experts` gives them for gate mode "top1".

    **Per (cohort c, expert k), once.** The expert applied to the shared part s_c
    (:func:`expert_output`, keeping each neuron's z^c = W_1·s_c, enclosed [zc ± ρc] before
    the bias, and its activity a^c = ReLU(z^c + b_1), with the plain kernel's rounding of the
    bias), and the shared logits U·s_c + U·W_2·a^c as a cohort table
    (:func:`verifier.arithmetic.logits.cohort_table`), each an enclosed sum of its terms.

    **Per pair**, only what the row's own part o_i changes (:func:`_own_pairs`).

    ``scratch`` = (the shared z's compact accumulator (acc, touched, where), per slot of it
    the shared z and activity (zc mid and radius, a mid and radius, on), the row's z
    accumulator, the y accumulator, the logit accumulator (each compact), valid stamps, the
    cohort table, the watched shared neurons (the last entry their count) and the exp memo).
    Returns per pair (err_lo, err_hi, argmax, rho_lo, rho_hi); ``active`` as the plain
    kernel fills it.
    """
    rows, experts_of = pairs
    (zacc, ztouched, zwhere, zc_mid, zc_rad, ac_mid, ac_rad, ac_on, zacc2, ztouched2, zwhere2, yacc, ytouched, ywhere,
     Lacc, Ltouched, Lwhere, vstamp, table, cw, memo) = scratch
    z, y = (zacc, ztouched, zwhere), (yacc, ytouched, ywhere)
    keep = (zc_mid, zc_rad, ac_mid, ac_rad, ac_on)
    net = (W1T, first, W2T, UT)
    P = rows.size
    out = _pair_outputs(P)
    n_groups = 0
    q0 = 0
    while q0 < P:                                      # the pairs of one (cohort, expert)
        c, k = cohort[rows[q0]], experts_of[q0]
        q1 = _group_end(rows, experts_of, cohort, q0)
        sg = stamp0 + P + n_groups
        n_groups += 1
        cw[cw.size - 1] = 0
        ny, bad_c, _ = expert_output(S, c, k, (1.0, 0.0), first, W1T, W2T, z, y, sg, watch, cw, keep, None, QUICK)
        nL, y_bad, _ = row_logits(Ls, c, UT, y, ny, Lacc, sg, Ltouched, Lwhere, None, 1.0, 0.0)
        to_radii(Lacc, Ltouched, nL, Lwhere)
        M_c, c_lo, c_hi, t_bad = cohort_table(nL, Ltouched, Lacc, table, sg)
        shared = (z, float(sg), keep, cw, table, (nL, M_c, c_lo, c_hi, float(sg)), bad_c or y_bad or t_bad, memo)
        _own_pairs(q0, q1, pairs, O, Lo, net, V, valid, (zacc2, ztouched2, zwhere2), shared, y,
                   (Lacc, Ltouched, Lwhere, vstamp), stamp0, watch, active, out)
        q0 = q1
    return out
