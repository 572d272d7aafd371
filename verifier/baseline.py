"""The plain float64 forward pass over every query: the benchmark's baseline.

Same batches, same precomputed projections and the same sharing of identical rows as
the certified pass (:mod:`verifier.forward`), but ordinary floating point: no radii,
``np.exp`` instead of the enclosure, no ablation pass. It certifies nothing; it shows
what certification costs.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from verifier.forward import Prepared, _csr_rows, _unique_rows
from layout import Weights


def _softmax(s: np.ndarray) -> np.ndarray:
    z = np.exp(s - s.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def residual(prep: Prepared, tokens: np.ndarray) -> sp.csr_matrix:
    w = prep.weights
    n, p = tokens.shape
    ids = np.concatenate([np.full((n, 1), w.bos, np.int64), tokens], axis=1)
    rows, cols, vals = [], [], []
    for M, src in ((w.E.tocsr(), ids[:, p]), (w.P.tocsr(), np.full(n, p, np.int64))):
        r, c, v = _csr_rows(M, src)
        rows.append(r); cols.append(c); vals.append(v)
    for m, h in enumerate(prep.heads):
        first, inv = _unique_rows(prep.qk_class[m][ids])
        rep = ids[first]
        q = h.QE[0][rep[:, p]] + h.QP[0][p]
        s = np.stack([np.sum(q * (h.KE[0][rep[:, j]] + h.KP[0][j]), axis=1) for j in range(p + 1)], axis=1)
        a = _softmax(s)
        cfirst, cinv = _unique_rows(np.concatenate([inv[:, None], prep.v_class[m][ids]], axis=1))
        crep, ca = ids[cfirst], a[inv[cfirst]]
        r_l, c_l, v_l = [], [], []
        for j in range(p + 1):
            for M, src in ((h.OE.mid_csr(), crep[:, j]), (h.OP.mid_csr(), np.full(cfirst.size, j, np.int64))):
                r, c, v = _csr_rows(M, src)
                r_l.append(r); c_l.append(c); v_l.append(v * ca[r, j])
        O = sp.csr_matrix((np.concatenate(v_l), (np.concatenate(r_l), np.concatenate(c_l))), shape=(cfirst.size, w.d))[cinv]
        r = np.repeat(np.arange(n), np.diff(O.indptr))
        rows.append(r); cols.append(O.indices); vals.append(O.data)
    return sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, w.d))


def run_batch(prep: Prepared, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray):
    """(expert, error) per row, in plain float64."""
    w = prep.weights
    n = tokens.shape[0]
    V = len(w.vocab)
    R = residual(prep, tokens)
    G = np.asarray((R @ prep.WGT).toarray()) + w.b_G[None, :]
    e = np.argmax(G, axis=1)
    err = np.empty(n)
    for k in np.unique(e):
        idx = np.flatnonzero(e == k)
        W1T, b1, W2T, _ = prep.experts[k]
        Z = (R[idx] @ W1T).tocsr()
        Z.data += b1[Z.indices]
        Z.data = np.maximum(Z.data, 0.0)
        Z.eliminate_zeros()
        out = Z @ W2T
        if w.gate_mode == "top1-scaled":
            out = sp.diags(_softmax(G[idx])[np.arange(idx.size), k]) @ out
        L = ((R[idx] + out) @ prep.UT).tocsr()
        err[idx] = _error(L, V, valid_ptr, valid, idx)
    return e, err


def _error(L: sp.csr_matrix, V: int, valid_ptr, valid, idx) -> np.ndarray:
    """1 − P(valid) from sparse logits (absent logits are 0), vectorised."""
    n = idx.size
    rows = np.repeat(np.arange(n), np.diff(L.indptr))
    stored = np.diff(L.indptr)
    vp = valid_ptr[idx + 1] - valid_ptr[idx]
    vrow = np.repeat(np.arange(n), vp)
    starts = np.repeat(valid_ptr[idx] - np.concatenate([[0], np.cumsum(vp)[:-1]]), vp)
    vals = valid[starts + np.arange(vp.sum())]
    vkey = np.sort(vrow.astype(np.int64) * V + vals)
    key = rows.astype(np.int64) * V + L.indices
    pos = np.minimum(np.searchsorted(vkey, key), max(vkey.size - 1, 0))
    is_valid = (vkey[pos] == key) if vkey.size else np.zeros(key.size, bool)
    M = np.zeros(n)
    np.maximum.at(M, rows, L.data)
    z = np.exp(L.data - M[rows])
    z0 = np.exp(-M)
    total = np.bincount(rows, weights=z, minlength=n) + (V - stored) * z0
    good = np.bincount(rows, weights=np.where(is_valid, z, 0.0), minlength=n)
    good += (vp - np.bincount(rows, weights=is_valid, minlength=n)) * z0
    return 1.0 - good / total


def plain_pass(weights: Weights, taskset, chunk: int = 20_000, jobs: int = 1) -> tuple[int, float]:
    """Run over every query (same batches and workers as the certified pass); (queries, worst error)."""
    from verifier.batches import batches
    from verifier.parallel import ordered_map
    from verifier.verify import token_map

    prep = Prepared(weights)
    tmap = token_map(taskset, weights)
    K = len(weights.experts)
    chunk = max(1_000, min(chunk, 20_000_000 // max(K, 1)))

    def work(b):
        return run_batch(prep, tmap[b.tokens], b.valid_ptr, tmap[b.valid])

    n, worst = 0, 0.0
    for b, (_, err) in ordered_map(work, batches(taskset, chunk=chunk), jobs):
        n += len(b)
        worst = max(worst, float(err.max()))
    return n, worst
