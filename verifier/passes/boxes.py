"""A certified forward pass over input *boxes*: every input vector an interval per coordinate.

The project's certified pass (:mod:`verifier.passes.forward`) runs on token prefixes. This
module runs the same equations (docs/reference.md, "Weight layout") when some input vectors are
not token embeddings but arbitrary vectors known only to lie in a box: a *soft prompt*
X ∈ R^{m×d} replaces E[x_i] at positions i = 1..m (P[i] is still added), and every
vector in [X − ρ, X + ρ] (per coordinate) must be covered. With ρ = 0 and X = E[x] it is
a token prompt. It is a small, dense, numpy-only pass built from the primitives of
:mod:`verifier.arithmetic.interval` (mid-radius intervals, every radius rounded up, enclosed exp),
written for the accessibility analysis (:mod:`verifier.accessibility.accessible`), which asks one
question per step: is the greedy next token the same, and unique, for every input in
the box?

**What is enclosed.** For a batch of B sequences of one length p + 1 (BOS at 0), the
pass encloses, for the last position p and for *every* choice of the inputs in their
boxes, in exact real arithmetic on the stored float64 weights:

* the gate scores g = W_G r + b_G (one interval per expert), hence the set of experts
  that may win somewhere in the box (the *candidates*: k such that no j has a lower
  end above k's upper end, and the enclosure of the gap g_e − g_k to the likeliest
  winner e, from the difference of the gate rows, is not above 0
  (:func:`_beaten_by_winner`); every expert that attains the maximum at some point of
  the box is one of them, whatever tie-break the runtime uses);
* for each candidate expert e, the logits U y with y = r + c·W_2^e ReLU(W_1^e r + b_1^e),
  c = 1 or the enclosed softmax(g)_e ("top1-scaled").

The greedy token is **certified** at a row when every candidate's logits have the same
unique argmax t: lower(logit_t) > upper(logit_v) for every v ≠ t. Then at every point of
the box, whichever expert routes it, t has the strictly largest logit: the step's
output is t. Anything else is *undecided* (−1), never a token.

**Why the enclosures hold** (each step is a lemma of :mod:`verifier.arithmetic.interval`):

1. inputs: h_j = x_j + P[j], summed by :func:`verifier.arithmetic.interval.sum_terms` from the
   exact stored entries of E and P and the soft prompt's [X ± ρ] terms (Lemma 1 bounds
   the rounding of the midpoint sum; the radius carries ρ);
2. every linear map (W_Q, W_K, W_V, W_O, W_G, W_1, W_2, U) is
   :func:`verifier.arithmetic.interval.matmul` (structural pattern, Lemma 2), whose radius covers
   every input in the interval, not only the midpoint;
3. scores are :func:`verifier.arithmetic.interval.dot_segments` of the query and key intervals,
   the attention weights :func:`verifier.passes.forward.softmax_bounds` (the weight of j
   increases in s_j and decreases in the others: the extreme ends are enclosed with an
   enclosed exp); a weight is then an interval, and a head's output
   Σ_j a_j·v_j is summed (:func:`verifier.arithmetic.interval.sum_terms`) from the interval products
   (:func:`verifier.arithmetic.interval.mul_rad`) of the value entries stored in the structural
   pattern of W_V h_j (an absent entry is exactly 0, and so is its product);
4. ReLU is monotone: ReLU([lo, hi]) = [max(lo, 0), max(hi, 0)], re-centred by
   :func:`verifier.arithmetic.interval.from_bounds`; a neuron whose upper end is ≤ 0 is exactly 0
   and dropped;
5. additions of two enclosures (residuals) are sums of at most two terms per entry
   (:func:`_sum`, Lemma 1), a bias one IEEE addition with radius up(u·|fl|) on top of the
   terms' radii (A1).

Every bound is computed row by row (the sums' term counts are fixed per step, not taken
from the batch), so a row's enclosures are the same in any batch or chunk.

An enclosure with a non-finite end decides nothing (:func:`verifier.arithmetic.interval.lower` /
:func:`verifier.arithmetic.interval.upper` read it as (−∞, ∞)): its row is undecided.

The pass is cross-checked against :mod:`verifier.passes.forward` on the task set's queries and
against an independent high-precision evaluation (:func:`audit.exact.exact_logits`) at
random points inside boxes (``tests/verifier/accessibility/test_accessible.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from layout import Weights
from verifier.arithmetic import interval as I
from verifier.passes.forward import softmax_bounds
from verifier.arithmetic.interval import SparseInterval

#: Rows of a batch computed together, at most (bounds the arrays' memory).
CHUNK = 1024
#: Soft-prompt entries (rows x soft positions x d) of a chunk, at most.
SOFT_ENTRIES = 1 << 22


@dataclass(frozen=True)
class BoxModel:
    """The weights as the maps the box pass applies (transposed CSR, heads side by side).

    Head m owns columns ``q_starts[m] .. + q_widths[m]`` of the stacked query/key maps and
    ``v_starts[m] .. + v_widths[m]`` of the stacked value map; W_O of every head side by
    side, [W_O^1 .. W_O^H], so that Σ_m W_O^m o_m is one product (one rounding bound).
    """

    weights: Weights
    WQT: sp.csr_matrix
    WKT: sp.csr_matrix
    WVT: sp.csr_matrix
    WOT: sp.csr_matrix
    q_starts: np.ndarray
    q_widths: np.ndarray
    v_head: np.ndarray        # (Σd_v,) the head of each stacked value column
    WGT: sp.csr_matrix
    W1T: tuple[sp.csr_matrix, ...]
    W2T: tuple[sp.csr_matrix, ...]
    UT: sp.csr_matrix

    @property
    def d(self) -> int:
        return self.weights.d

    @property
    def vocab_size(self) -> int:
        return len(self.weights.vocab)

    @property
    def n_experts(self) -> int:
        return len(self.weights.experts)


def _stack_rows(mats: list, d: int) -> sp.csr_matrix:
    """The matrices one above the other, as exact canonical CSR (entries are moved, never added)."""
    if not mats:
        return sp.csr_matrix((0, d))
    return I.as_csr(sp.vstack([I.as_csr(M) for M in mats], format="csr"))


def _transposed(M) -> sp.csr_matrix:
    """M^T as canonical CSR (a transpose moves entries; no arithmetic)."""
    T = sp.csr_matrix(I.as_csr(M).T)
    T.sort_indices()
    return T


def prepare(weights: Weights) -> BoxModel:
    """The :class:`BoxModel` of validated ``weights`` (checks the platform's arithmetic first)."""
    I.check_platform()
    weights.validate()
    d, heads = weights.d, weights.heads
    q_widths = np.array([h.W_Q.shape[0] for h in heads], np.int64)
    q_starts = np.concatenate([[0], np.cumsum(q_widths)[:-1]]).astype(np.int64)
    v_widths = np.array([h.W_V.shape[0] for h in heads], np.int64)
    v_head = np.repeat(np.arange(len(heads), dtype=np.int64), v_widths)
    WO = I.as_csr(sp.hstack([h.W_O for h in heads], format="csr")) if heads else sp.csr_matrix((d, 0))
    return BoxModel(
        weights=weights,
        WQT=_transposed(_stack_rows([h.W_Q for h in heads], d)),
        WKT=_transposed(_stack_rows([h.W_K for h in heads], d)),
        WVT=_transposed(_stack_rows([h.W_V for h in heads], d)),
        WOT=_transposed(WO),
        q_starts=q_starts, q_widths=q_widths, v_head=v_head,
        WGT=_transposed(weights.W_G),
        W1T=tuple(_transposed(e.W_1) for e in weights.experts),
        W2T=tuple(_transposed(e.W_2) for e in weights.experts),
        UT=_transposed(weights.U),
    )


# --- inputs -----------------------------------------------------------------------------------------


def input_rows(model: BoxModel, tokens: np.ndarray, soft: np.ndarray | None = None,
               radius: float = 0.0) -> SparseInterval:
    """The inputs h_j = x_j + P[j] of every position of every sequence, as rows (b, j) -> b·(p+1) + j.

    ``tokens`` (B, p+1): token ids per position, BOS (``weights.bos``) at 0, and -1 at a
    soft position; ``soft`` (B, m, d): the soft prompt's centres for positions 1..m (the
    tokens there must be -1), each coordinate anywhere in [X − radius, X + radius].
    Every stored entry of E, P and X is a term of :func:`verifier.arithmetic.interval.sum_terms`
    (Lemma 1), the soft terms with radius ``radius``; a coordinate no term reaches is
    exactly 0.
    """
    w = model.weights
    tokens = np.asarray(tokens, np.int64)
    B, p1 = tokens.shape
    if p1 > w.n_positions:
        raise ValueError(f"sequences of {p1} positions exceed the model's {w.n_positions}")
    if not (radius >= 0 and np.isfinite(radius)):
        raise ValueError(f"the box radius must be a finite number >= 0, got {radius!r}")
    E, P = I.as_csr(w.E), I.as_csr(w.P)
    row_of = np.arange(B * p1, dtype=np.int64).reshape(B, p1)
    parts_r, parts_c, parts_m, parts_s = [], [], [], []

    def gather(M: sp.csr_matrix, which: np.ndarray, rows: np.ndarray) -> None:
        counts = M.indptr[which + 1] - M.indptr[which]
        pos = np.repeat(M.indptr[which], counts) + (np.arange(int(counts.sum()))
                                                    - np.repeat(np.cumsum(counts) - counts, counts))
        parts_r.append(np.repeat(rows, counts))
        parts_c.append(M.indices[pos].astype(np.int64))
        parts_m.append(M.data[pos])
        parts_s.append(np.zeros(pos.size))

    is_token = tokens >= 0
    gather(E, tokens[is_token], row_of[is_token])
    gather(P, np.broadcast_to(np.arange(p1), (B, p1)).reshape(-1), row_of.reshape(-1))
    if soft is not None:
        soft = np.asarray(soft, np.float64)
        m = soft.shape[1]
        if soft.shape != (B, m, w.d) or m >= p1 or np.any(is_token[:, 1:m + 1]) or not np.all(np.isfinite(soft)):
            raise ValueError("soft prompts must be finite (B, m, d) arrays for positions 1..m marked -1 in tokens")
        rows = np.repeat(row_of[:, 1:m + 1].reshape(-1), w.d)
        parts_r.append(rows)
        parts_c.append(np.tile(np.arange(w.d, dtype=np.int64), B * m))
        parts_m.append(soft.reshape(-1))
        parts_s.append(np.full(rows.size, float(radius)))
    elif np.any(~is_token):
        raise ValueError("a position is marked soft (-1) but no soft prompt is given")
    return _sum((B * p1, w.d), np.concatenate(parts_r), np.concatenate(parts_c), np.concatenate(parts_m),
                np.concatenate(parts_s), 3)                  # E, P and the soft prompt: one entry each at most


# --- the pass ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepEnclosure:
    """Enclosures at the last position of each row of a batch (see the module docstring).

    ``logit_lo``/``logit_hi`` hold, per candidate (row, expert) pair, the logits' ends;
    ``pair_row``/``pair_expert`` name the pair. ``token`` is the certified greedy token
    of each row, or -1 (undecided); ``margin`` a lower bound of logit_token − max_{v ≠
    token} logit_v over the box (the smallest over the candidates; ≤ 0 when undecided).
    """

    gate_lo: np.ndarray        # (B, K)
    gate_hi: np.ndarray
    candidates: np.ndarray     # (B, K) bool: the experts that may win somewhere in the box
    pair_row: np.ndarray       # (n_pairs,)
    pair_expert: np.ndarray
    logit_lo: np.ndarray       # (n_pairs, V)
    logit_hi: np.ndarray
    token: np.ndarray          # (B,) certified greedy token, -1 undecided
    margin: np.ndarray         # (B,)

    @property
    def routed(self) -> np.ndarray:
        """(B,) the certified unique gate winner, or -1 where several experts may win."""
        single = self.candidates.sum(axis=1) == 1
        return np.where(single, np.argmax(self.candidates, axis=1), -1)

    @property
    def gate_margin(self) -> np.ndarray:
        """(B,) lower bound of g_e − max_{k≠e} g_k for the winner e (≤ 0 when not unique)."""
        K = self.gate_lo.shape[1]
        if K == 1:
            return np.full(self.gate_lo.shape[0], np.inf)
        e = np.argmax(self.gate_lo, axis=1)
        rows = np.arange(e.size)
        others = self.gate_hi.copy()
        others[rows, e] = -np.inf
        return I.down(self.gate_lo[rows, e] - others.max(axis=1))


def _sum(shape, rows, cols, mids, rads, terms: int) -> SparseInterval:
    """Σ of interval terms with equal (row, col) (:func:`verifier.arithmetic.interval.sum_terms`),
    with the rounding bound of ``terms`` terms per entry (at least the most any entry has). A
    fixed count makes an entry's enclosure depend on its own terms only, never on the other
    rows of the batch: a row's result is the same in any chunk (a proof re-runs alone)."""
    return I.sum_terms(shape, rows, cols, mids, rads, terms=terms)


def _add(A: SparseInterval, B: SparseInterval) -> SparseInterval:
    """A + B (same shape), the union of both patterns: :func:`_sum` of two terms at most."""
    return _sum(A.shape, np.concatenate([A.row_ids(), B.row_ids()]), np.concatenate([A.indices, B.indices]),
                np.concatenate([A.mid, B.mid]), np.concatenate([A.rad, B.rad]), 2)


def _dense_add_exact(mid: np.ndarray, rad: np.ndarray, b: np.ndarray):
    """[mid ± rad] + b for exact floats b: one IEEE addition, radius + up(u·|fl|) (A1)."""
    m = mid + b
    return m, I.guard(m, I.add_rad(rad, I.up(I.U * np.abs(m))))


def _from_dense(mid: np.ndarray, rad: np.ndarray) -> SparseInterval:
    """A dense interval matrix as a SparseInterval storing every entry that is not exactly 0."""
    keep = (mid != 0) | (rad != 0)
    rows, cols = np.nonzero(keep)
    return I.from_coo(mid.shape, rows, cols, mid[rows, cols], rad[rows, cols])


def _attention_output(model: BoxModel, H: SparseInterval, B: int, p1: int) -> SparseInterval:
    """Σ_m W_O^m Σ_j a^m_pj W_V^m h_j at the last position p of each row, enclosed."""
    n_h = model.q_widths.size
    d = model.d
    if n_h == 0:
        return _from_dense(np.zeros((B, d)), np.zeros((B, d)))
    last = np.arange(B, dtype=np.int64) * p1 + (p1 - 1)
    qm, qr = I.matmul(H.rows(last), model.WQT).dense()                       # (B, Σd_h)
    km, kr = I.matmul(H, model.WKT).dense()                                   # (B·p1, Σd_h)
    km, kr = km.reshape(B, p1, -1), kr.reshape(B, p1, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        s_m, s_r = I.dot_segments(qm[:, None, :], qr[:, None, :], km, kr, model.q_starts, model.q_widths)
        s_m, s_r = s_m.transpose(0, 2, 1), s_r.transpose(0, 2, 1)            # (B, H, p1)
        a_lo, a_hi = softmax_bounds(I.lower(s_m, s_r), I.upper(s_m, s_r), s_m)
    am, ar = I.from_bounds(a_lo, a_hi)                                         # (B, H, p1)
    Vv = I.matmul(H, model.WVT)                                               # rows (b, j), stored entries only
    rows = Vv.row_ids()
    b, j, c = rows // p1, rows % p1, Vv.indices
    wm, wr = am[b, model.v_head[c], j], ar[b, model.v_head[c], j]
    with np.errstate(invalid="ignore", over="ignore"):
        pm, pr = wm * Vv.mid, I.mul_rad(wm, wr, Vv.mid, Vv.rad)
    O = _sum((B, Vv.shape[1]), b, c, pm, pr, p1)                             # Σ_j over each (row, column)
    return I.matmul(O, model.WOT)


def _argmax_certified(lo: np.ndarray, hi: np.ndarray, mid: np.ndarray):
    """Per row: (the argmax t of the midpoints, lower(logit_t) − max_{v≠t} upper(logit_v))."""
    n, V = mid.shape
    t = np.argmax(np.where(np.isfinite(mid), mid, -np.inf), axis=1) if V else np.zeros(n, np.int64)
    rows = np.arange(n)
    if V == 1:
        return t, np.full(n, np.inf)
    others = hi.copy()
    others[rows, t] = -np.inf
    with np.errstate(invalid="ignore"):
        margin = I.down(lo[rows, t] - others.max(axis=1))
    return t, np.where(np.isnan(margin), -np.inf, margin)


def step(model: BoxModel, tokens: np.ndarray, soft: np.ndarray | None = None, radius: float = 0.0) -> StepEnclosure:
    """The enclosures at the last position of every row (see :func:`input_rows` for the arguments),
    computed a chunk of rows at a time (each row's enclosures depend on that row only)."""
    tokens = np.asarray(tokens, np.int64)
    chunk = CHUNK if soft is None else max(1, min(CHUNK, SOFT_ENTRIES // max(1, soft.shape[1] * soft.shape[2])))
    parts = []
    for a in range(0, tokens.shape[0], chunk):
        b = min(a + chunk, tokens.shape[0])
        parts.append(_step(model, tokens[a:b], None if soft is None else soft[a:b], radius))
    if not parts:
        parts.append(_step(model, tokens, soft, radius))
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [p.token.size for p in parts[:-1]])
    cat = np.concatenate
    return StepEnclosure(cat([p.gate_lo for p in parts]), cat([p.gate_hi for p in parts]),
                         cat([p.candidates for p in parts]), cat([p.pair_row + o for p, o in zip(parts, offsets)]),
                         cat([p.pair_expert for p in parts]), cat([p.logit_lo for p in parts]),
                         cat([p.logit_hi for p in parts]), cat([p.token for p in parts]),
                         cat([p.margin for p in parts]))


def _step(model: BoxModel, tokens: np.ndarray, soft: np.ndarray | None, radius: float) -> StepEnclosure:
    w = model.weights
    B, p1 = tokens.shape
    V, K = model.vocab_size, model.n_experts
    H = input_rows(model, tokens, soft, radius)
    last = np.arange(B, dtype=np.int64) * p1 + (p1 - 1)
    R = _add(H.rows(last), _attention_output(model, H, B, p1))                # r at the last position
    gm, gr = I.matmul(R, model.WGT).dense()
    with np.errstate(invalid="ignore", over="ignore"):
        gm, gr = _dense_add_exact(gm, gr, np.asarray(w.b_G, np.float64)[None, :])
        g_lo, g_hi = I.lower(gm, gr), I.upper(gm, gr)
    cand = _candidates(g_lo, g_hi) & _beaten_by_winner(model, R, gm)
    if w.gate_mode == "top1-scaled":
        with np.errstate(invalid="ignore", over="ignore"):
            c_lo, c_hi = softmax_bounds(g_lo, g_hi, np.where(np.isfinite(gm), gm, 0.0))
    pair_row, pair_expert = np.nonzero(cand)
    logit_lo = np.empty((pair_row.size, V))
    logit_hi = np.empty((pair_row.size, V))
    logit_mid = np.empty((pair_row.size, V))
    for k in range(K):
        sel = np.flatnonzero(pair_expert == k)
        if not sel.size:
            continue
        rows = pair_row[sel]
        Rk = R.rows(rows)
        zm, zr = I.matmul(Rk, model.W1T[k]).dense()
        with np.errstate(invalid="ignore", over="ignore"):
            zm, zr = _dense_add_exact(zm, zr, np.asarray(w.experts[k].b_1, np.float64)[None, :])
            a_lo = np.maximum(I.lower(zm, zr), 0.0)
            a_hi = np.maximum(I.upper(zm, zr), 0.0)
            am, ar = I.from_bounds(a_lo, a_hi)
            out = I.matmul(_from_dense(am, I.guard(am, ar)), model.W2T[k])
            if w.gate_mode == "top1-scaled":
                cm, cr = I.from_bounds(c_lo[rows, k], c_hi[rows, k])
                out = I.scale_rows(out, cm, cr)
            Y = _add(Rk, out)
            lm, lr = I.matmul(Y, model.UT).dense()
            logit_lo[sel], logit_hi[sel], logit_mid[sel] = I.lower(lm, lr), I.upper(lm, lr), lm
    tok, mar = _argmax_certified(logit_lo, logit_hi, logit_mid)
    # a row's token is certified when every candidate certifies (margin > 0) one same token
    t_min, t_max = np.full(B, V, np.int64), np.full(B, -1, np.int64)
    np.minimum.at(t_min, pair_row, tok)
    np.maximum.at(t_max, pair_row, tok)
    margin = np.full(B, np.inf)
    np.minimum.at(margin, pair_row, mar)
    ok = (t_min == t_max) & (margin > 0)
    token = np.where(ok, t_min, -1).astype(np.int64)
    margin = np.where(ok, margin, np.where(np.isfinite(margin), np.minimum(margin, 0.0), -np.inf))
    return StepEnclosure(g_lo, g_hi, cand, pair_row.astype(np.int64), pair_expert.astype(np.int64),
                         logit_lo, logit_hi, token, margin)


def _candidates(g_lo: np.ndarray, g_hi: np.ndarray) -> np.ndarray:
    """(B, K) bool: expert k may attain the maximum score somewhere in the box, i.e. no other
    expert's lower end exceeds k's upper end (an expert attaining the maximum at a point is
    beaten there by none, so it is never left out; non-finite ends read as (−∞, ∞))."""
    B, K = g_lo.shape
    if K == 1:
        return np.ones((B, 1), bool)
    order = np.argsort(-g_lo, axis=1)
    best = np.take_along_axis(g_lo, order[:, :1], axis=1)
    second = np.take_along_axis(g_lo, order[:, 1:2], axis=1)
    other_best = np.where(np.arange(K)[None, :] == order[:, :1], second, best)   # max_{j≠k} lo_j
    return ~(other_best > g_hi)


def _beaten_by_winner(model: BoxModel, R: SparseInterval, gm: np.ndarray) -> np.ndarray:
    """(B, K) bool: False for an expert k whose score is certainly below the midpoint winner
    e's at every point of the box, from an enclosure of the *difference* g_e − g_k.

    Separate enclosures of g_e and g_k lose that both read the same residual r (a
    coordinate moving both scores up is counted once up for one and once down for the
    other); the difference row W_G[e] − W_G[k] reads it once. Its entries are rounded
    float subtractions, so it is split into D = fl(W_G[e] − W_G[k]), exact floats, and a
    remainder of at most u·|D| per entry (A1: a subtraction's error is at most u·|fl|):
    (g_e − g_k)(r) = D·r + (remainder)·r + (b_e − b_k), with |remainder·r| ≤ Σ_i u|D_i|·|r_i|
    and |r_i| ≤ |rm_i| + rr_i. D·r is :func:`verifier.arithmetic.interval.matmul`; the remainder's
    bound is the upper end of a product of non-negative enclosures. An expert attaining the
    maximum somewhere has g_e − g_k ≤ 0 there, so its lower end is ≤ 0 and it stays.
    """
    W = model.weights
    B, K = gm.shape
    keep = np.ones((B, K), bool)
    if K == 1 or B == 0:
        return keep
    finite = np.isfinite(gm).all(axis=1)
    winner = np.argmax(np.where(np.isfinite(gm), gm, -np.inf), axis=1)
    WG = I.as_csr(W.W_G)
    bG = np.asarray(W.b_G, np.float64)
    for e in np.unique(winner[finite]):
        rows = np.flatnonzero(finite & (winner == e))
        D = (sp.csr_matrix(np.ones((K, 1))) @ WG[e] - WG).tocsr()      # fl(W_G[e] − W_G[k]), one subtraction each
        D.sort_indices()
        D.eliminate_zeros()                                              # a computed 0 is an exact 0 (A1: x − x = 0)
        Dr = sp.csr_matrix((I.up(I.U * np.abs(D.data)), D.indices, D.indptr), shape=D.shape)
        Re = R.rows(rows)
        dm, dr = I.matmul(Re, _transposed(D)).dense()                   # D·r
        absR = SparseInterval(Re.shape, Re.indptr, Re.indices, I.upper(np.abs(Re.mid), Re.rad), np.zeros(Re.nnz))
        em, er = I.matmul(absR, _transposed(Dr)).dense()                 # ≥ Σ u|D_i|·|r_i|
        with np.errstate(invalid="ignore", over="ignore"):
            bd = bG[e] - bG                                              # fl(b_e − b_k)
            mid = dm + bd[None, :]
            rad = I.add_rad(dr, I.upper(em, er), I.up(I.U * np.abs(bd))[None, :], I.up(I.U * np.abs(mid)))
            lo = I.lower(mid, I.guard(mid, rad))
        beaten = lo > 0
        beaten[:, e] = False
        keep[rows] = ~beaten
    return keep
