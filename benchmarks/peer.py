"""An uncertified PyTorch forward pass over the same weights and queries: the yardstick.

    python benchmarks/peer.py --facts 100000 [--dtype float64 float32] [--sample 2000]

What a researcher would write instead of certifying, from the weight layout of docs/reference.md,
done competently for weights this sparse (a residual width of about three times the
vocabulary, so no row of the residual is ever dense):

* queries batched by prefix length (the verifier's own batches, so both passes see the
  same rows in the same order), one thread, float64 or float32;
* per-token and per-position query/key projections precomputed (all heads side by
  side), scores and softmax dense over (rows, heads, positions);
* the residual as a list of (row, column, value) terms: E and P rows and every head's
  value rows W_O·W_V·h_j weighted by attention, gathered from flat CSR tables; terms
  are never merged (every later map is linear in the residual);
* the gate by gathering W_G's columns for each term and ``index_add`` into (rows, K);
  top-1 routing by argmax;
* experts grouped by the routed expert: W_1·r as gathered (row, neuron) terms summed
  with ``unique`` + ``index_add``, ReLU, W_2·a gathered, and the positive-bias neurons
  a row does not reach added as a constant (exactly the layout's function);
* logits U·y gathered the same way, only for tokens some term reaches; every other
  token has logit 0 and is counted in the softmax without being materialised.

It returns, per query, the routed expert and the error 1 − P(valid), and the benchmark
checks them against the verifier's enclosures on a sample (:func:`measure`). Used by
``benchmarks/scale.py``; runs alone as above.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import scipy.sparse as sp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


PAD = 8   # rows of at most this many entries, nearly all full, are stored padded (a gather is one indexing)


def _flat(M: sp.csr_matrix, torch, dtype):
    """A CSR matrix as torch tensors: padded (rows x m) columns and values when every row has at
    most PAD entries (zeros fill the padding; a zero term adds exactly nothing), else (indptr, indices, data)."""
    M = sp.csr_matrix(M)
    M.sort_indices()
    counts = np.diff(M.indptr)
    m = int(counts.max(initial=0))
    if M.nnz == 0:
        return ("empty",)
    if m <= PAD and M.nnz >= 0.75 * M.shape[0] * m:          # padding costs at most a quarter more terms
        cols = np.zeros((M.shape[0], max(m, 1)), np.int64)
        vals = np.zeros((M.shape[0], max(m, 1)))
        rows = np.repeat(np.arange(M.shape[0]), counts)
        pos = np.arange(M.nnz) - np.repeat(M.indptr[:-1], counts)
        cols[rows, pos] = M.indices
        vals[rows, pos] = M.data
        return ("padded", torch.from_numpy(cols), torch.from_numpy(vals).to(dtype))
    return (torch.from_numpy(M.indptr.astype(np.int64)), torch.from_numpy(M.indices.astype(np.int64)),
            torch.from_numpy(M.data.astype(np.float64)).to(dtype))


def _gather(table, rows, torch):
    """The entries of ``table``'s rows ``rows``: (position of the row in ``rows``, column, value)."""
    if table[0] == "empty":
        return rows[:0], rows[:0], torch.zeros(0)
    if isinstance(table[0], str):
        _, cols, vals = table
        m = cols.shape[1]
        owner = torch.arange(rows.numel()).repeat_interleave(m) if m > 1 else torch.arange(rows.numel())
        return owner, cols[rows].reshape(-1), vals[rows].reshape(-1)
    ptr, idx, val = table
    start = ptr[rows]
    counts = ptr[rows + 1] - start
    owner = torch.repeat_interleave(torch.arange(rows.numel()), counts)
    if owner.numel() == 0:
        return owner, idx[:0], val[:0]
    offsets = torch.arange(owner.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    pos = start[owner] + offsets
    return owner, idx[pos], val[pos]


class Peer:
    """The weights, prepared once for the PyTorch pass."""

    def __init__(self, weights, dtype: str = "float64") -> None:
        import torch

        self.torch = torch
        self.dtype = getattr(torch, dtype)
        w = weights
        self.w = w
        self.V, self.K = len(w.vocab), len(w.experts)
        t = lambda a: torch.from_numpy(np.asarray(a, np.float64)).to(self.dtype)  # noqa: E731
        E, P = w.E.tocsr(), w.P.tocsr()
        self.H = len(w.heads)
        if self.H:
            self.QE = t(np.hstack([(E @ h.W_Q.T).toarray() for h in w.heads]))
            self.QP = t(np.hstack([(P @ h.W_Q.T).toarray() for h in w.heads]))
            self.KE = t(np.hstack([(E @ h.W_K.T).toarray() for h in w.heads]))
            self.KP = t(np.hstack([(P @ h.W_K.T).toarray() for h in w.heads]))
            widths = [h.W_Q.shape[0] for h in w.heads]
            self.head_of = torch.from_numpy(np.repeat(np.arange(self.H), widths).astype(np.int64))
            # value paths: head m's W_O W_V E rows after m·(V+1), its W_O W_V P rows after m·n_pos
            self.OE = _flat(sp.vstack([E @ h.W_V.T @ h.W_O.T for h in w.heads]).tocsr(), torch, self.dtype)
            self.OP = _flat(sp.vstack([P @ h.W_V.T @ h.W_O.T for h in w.heads]).tocsr(), torch, self.dtype)
        self.E, self.P = _flat(E, torch, self.dtype), _flat(P, torch, self.dtype)
        self.WGT = _flat(w.W_G.T.tocsr(), torch, self.dtype)
        self.bG = t(w.b_G)
        self.UT = _flat(w.U.T.tocsr(), torch, self.dtype)
        self.experts = []
        for e in w.experts:
            b = np.asarray(e.b_1, np.float64)
            positive = np.flatnonzero(b > 0)
            W2 = sp.csc_matrix(e.W_2)
            const = (W2[:, positive] @ sp.csc_matrix(b[positive].reshape(-1, 1))).T if positive.size \
                else sp.csr_matrix((1, w.d))
            # W_1^T over the residual directions this expert reads (searchsorted maps a direction
            # to its row), so the table grows with the expert, not with d
            W1 = sp.csr_matrix(e.W_1)
            read = np.unique(W1.indices)
            self.experts.append((torch.from_numpy(read.astype(np.int64)), _flat(W1[:, read].T.tocsr(), torch, self.dtype),
                                 t(b), _flat(W2.T.tocsr(), torch, self.dtype), _flat(const, torch, self.dtype)))

    def run(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray):
        """(routed expert, error) per row of a batch of one prefix length (weights' token ids)."""
        torch = self.torch
        w, n = self.w, tokens.shape[0]
        p = tokens.shape[1]
        ids = torch.from_numpy(np.concatenate([np.full((n, 1), w.bos), tokens], axis=1).astype(np.int64))
        rows_E, cols_E, vals_E = _gather(self.E, ids[:, p], torch)
        rows_P, cols_P, vals_P = _gather(self.P, torch.full((n,), p, dtype=torch.int64), torch)
        parts = [(rows_E, cols_E, vals_E), (rows_P, cols_P, vals_P)]
        if self.H:
            q = self.QE[ids[:, p]] + self.QP[p]                                  # (n, Σd_h)
            k = self.KE[ids] + self.KP[: p + 1]                                  # (n, p+1, Σd_h)
            prod = q[:, None, :] * k
            s = torch.zeros(n, p + 1, self.H, dtype=self.dtype).index_add_(2, self.head_of, prod)
            a = torch.softmax(s.transpose(1, 2), dim=-1)                         # (n, H, p+1)
            heads = torch.arange(self.H)
            V1, npos = w.E.shape[0], w.P.shape[0]
            keys_E = (heads[None, :, None] * V1 + ids[:, None, :]).reshape(-1)   # (n·H·(p+1))
            keys_P = (heads[None, :, None] * npos + torch.arange(p + 1)[None, None, :]).expand(n, self.H, p + 1).reshape(-1)
            weight = a.reshape(-1)
            for table, keys in ((self.OE, keys_E), (self.OP, keys_P)):
                owner, cols, vals = _gather(table, keys, torch)
                parts.append((owner // (self.H * (p + 1)), cols, vals * weight[owner]))
        r_rows = torch.cat([x[0] for x in parts])
        r_cols = torch.cat([x[1] for x in parts])
        r_vals = torch.cat([x[2] for x in parts])
        # gate
        owner, experts, wv = _gather(self.WGT, r_cols, torch)
        g = torch.zeros(n * self.K, dtype=self.dtype).index_add_(0, r_rows[owner] * self.K + experts, r_vals[owner] * wv)
        g = g.view(n, self.K) + self.bG
        e = torch.argmax(g, dim=1)
        err = torch.empty(n, dtype=torch.float64)
        order = torch.argsort(e[r_rows], stable=True)
        r_rows_s, r_cols_s, r_vals_s = r_rows[order], r_cols[order], r_vals[order]
        ek_sorted = e[r_rows_s]
        bounds = torch.searchsorted(ek_sorted, torch.arange(self.K + 1))
        for k in torch.unique(e).tolist():
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            rows_k = torch.nonzero(e == k).reshape(-1)
            err[rows_k] = self._expert_error(k, rows_k, r_rows_s[lo:hi], r_cols_s[lo:hi], r_vals_s[lo:hi],
                                             valid_ptr, valid).to(torch.float64)
        if self.gate_scaled:
            raise NotImplementedError("gate_mode top1-scaled")
        return e.numpy(), err.numpy()

    @property
    def gate_scaled(self) -> bool:
        return self.w.gate_mode == "top1-scaled"

    def _expert_error(self, k, rows_k, t_rows, t_cols, t_vals, valid_ptr, valid):
        torch = self.torch
        read, W1T, b1, W2T, const = self.experts[k]
        nk = rows_k.numel()
        local = torch.full((int(rows_k.max()) + 1,), -1, dtype=torch.int64)
        local[rows_k] = torch.arange(nk)
        lr = local[t_rows]                                           # row within this expert's rows
        width = b1.numel()
        if read.numel():
            at = torch.searchsorted(read, t_cols).clamp(max=read.numel() - 1)
            hit = torch.nonzero(read[at] == t_cols).reshape(-1)       # the terms on directions W_1 reads
            owner, neurons, wv = _gather(W1T, at[hit], torch)
            owner = hit[owner]
        else:
            owner, neurons, wv = _gather(("empty",), t_cols, torch)
        key = lr[owner] * max(width, 1) + neurons
        uk, inv = torch.unique(key, return_inverse=True)
        z = torch.zeros(uk.numel(), dtype=self.dtype).index_add_(0, inv, t_vals[owner] * wv)
        zr, zn = uk // max(width, 1), uk % max(width, 1)
        z = z + b1[zn]
        act = torch.relu(z) - torch.relu(b1[zn])                     # reached neurons, net of the constant
        on = act != 0
        zr, zn, act = zr[on], zn[on], act[on]
        o_owner, o_cols, o_vals = _gather(W2T, zn, torch)
        y_rows = torch.cat([lr, zr[o_owner]])
        y_cols = torch.cat([t_cols, o_cols])
        y_vals = torch.cat([t_vals, act[o_owner] * o_vals])
        c_owner, c_cols, c_vals = _gather(const, torch.zeros(1, dtype=torch.int64), torch)
        if c_cols.numel():
            y_rows = torch.cat([y_rows, torch.arange(nk).repeat_interleave(c_cols.numel())])
            y_cols = torch.cat([y_cols, c_cols.repeat(nk)])
            y_vals = torch.cat([y_vals, c_vals.repeat(nk)])
        l_owner, tok, uv = _gather(self.UT, y_cols, torch)
        key = y_rows[l_owner] * self.V + tok
        uk, inv = torch.unique(key, return_inverse=True)
        logit = torch.zeros(uk.numel(), dtype=self.dtype).index_add_(0, inv, y_vals[l_owner] * uv)
        lrow, ltok = uk // self.V, uk % self.V
        # softmax over V tokens: the reached ones, and V − reached tokens with logit 0
        reached = torch.bincount(lrow, minlength=nk)
        M = torch.zeros(nk, dtype=self.dtype).index_reduce_(0, lrow, logit, "amax", include_self=False)
        M = torch.where(reached < self.V, torch.clamp(M, min=0.0), M)
        ex = torch.exp(logit - M[lrow])
        total = torch.zeros(nk, dtype=self.dtype).index_add_(0, lrow, ex) + (self.V - reached) * torch.exp(-M)
        vp = torch.from_numpy(np.asarray(valid_ptr, np.int64))
        v_owner, v_tok, _ = _gather((vp, torch.from_numpy(np.asarray(valid, np.int64)),
                                     torch.zeros(len(valid), dtype=self.dtype)), rows_k, torch)   # ragged: few rows
        vkey = v_owner * self.V + v_tok
        pos = torch.searchsorted(uk, vkey).clamp(max=max(uk.numel() - 1, 0))
        hit = (uk[pos] == vkey) if uk.numel() else torch.zeros_like(vkey, dtype=torch.bool)
        good = torch.zeros(nk, dtype=self.dtype).index_add_(0, v_owner[hit], ex[pos[hit]])
        missing = torch.bincount(v_owner[~hit], minlength=nk).to(self.dtype)
        good = good + missing * torch.exp(-M)
        return 1.0 - good / total


def measure(weights, work: Iterable, dtypes: Sequence[str], sample: int = 2000, seed: int = 0) -> list[dict]:
    """Time the certified pass (this process) and the peer (one thread) batch by batch on
    the same rows, interleaved so both see the same machine; check a sample.

    ``work`` yields (tokens, valid_ptr, valid, ablate) in the weights' token ids, as the
    verifier's batches do. The certified pass is exactly the one ``verify`` runs per
    batch (ablation on object queries, no full gate matrix). Per batch about
    ``sample // 20`` rows are compared: the routed expert where the verifier certified
    the routing, and the peer's error against the verifier's enclosure.
    """
    import torch

    from verifier.passes.forward import Prepared, run_batch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")
    prep = Prepared(weights)
    peers = {dt: Peer(weights, dt) for dt in dtypes}
    rng = np.random.default_rng(seed)
    cert_s, queries, batches_seen, warm = 0.0, 0, 0, False
    stats = {dt: {"peer_s": 0.0, "checked": 0, "expert_disagreements": 0, "outside_enclosure": 0} for dt in dtypes}
    for tok, vp, vv, ab in work:
        if not warm:                                   # compile (numba) and warm up both on two rows
            run_batch(prep, tok[:2], vp[:3], vv[: int(vp[2])], ablate=ab[:2], scores=False)
            for peer in peers.values():
                peer.run(tok[:2], vp[:3], vv[: int(vp[2])])
            warm = True
        t = time.perf_counter()
        res = run_batch(prep, tok, vp, vv, ablate=ab, scores=False).compact()
        cert_s += time.perf_counter() - t
        queries += tok.shape[0]
        batches_seen += 1
        idx = rng.choice(tok.shape[0], size=min(tok.shape[0], max(1, sample // 20)), replace=False)
        certain = res.margin[idx] > 0
        for dt, peer in peers.items():
            t = time.perf_counter()
            e, err = peer.run(tok, vp, vv)
            st = stats[dt]
            st["peer_s"] += time.perf_counter() - t
            st["checked"] += idx.size
            st["expert_disagreements"] += int(np.sum(certain & (e[idx] != res.expert[idx])))
            slack = 1e-12 if dt == "float64" else 1e-4
            st["outside_enclosure"] += int(np.sum(certain & ((err[idx] < res.err_lo[idx] - slack)
                                                             | (err[idx] > res.err_hi[idx] + slack))))
    out = []
    for dt in dtypes:
        st = stats[dt]
        out.append({"queries": queries, "batches": batches_seen, "dtype": dt, "certified_s": cert_s,
                    "certified_qps": queries / cert_s if cert_s else 0.0,
                    "peer_qps": queries / st["peer_s"] if st["peer_s"] else 0.0,
                    "ratio": st["peer_s"] / cert_s if cert_s else 0.0, **st})
    return out


def verifier_batches(taskset, weights, every: int = 1):
    """The verifier's batches (every ``every``-th) as (tokens, valid_ptr, valid, ablate) in the
    weights' token ids: the same rows, order and batch sizes as ``verify``."""
    from tasks.structure import StructureTrie
    from verifier.passes.batches import batches
    from verifier.checks.verify import CHUNK, token_map

    tmap = token_map(taskset, weights)
    chunk = max(1_000, min(CHUNK, 20_000_000 // max(len(weights.experts), 1)))
    for i, b in enumerate(batches(taskset, StructureTrie(taskset), chunk)):
        if i % every == 0:
            yield tmap[b.tokens], b.valid_ptr, tmap[b.valid], b.object_query & (b.determined >= 0)


def compare(facts: int, dtypes: list[str], sample: int, seed: int = 0) -> list[dict]:
    """Build the WikiData5M-shaped set of ``facts`` facts and :func:`measure` every batch."""
    from construction.model import build
    from tasks.synthetic import wikidata_like

    ts = wikidata_like(facts, seed=seed)
    weights = build(ts).instantiate()
    return [{"facts": facts, **r} for r in measure(weights, verifier_batches(ts, weights), dtypes, sample, seed)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--facts", type=int, default=100_000)
    p.add_argument("--dtype", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    p.add_argument("--sample", type=int, default=2000, help="queries checked against the verifier's enclosures")
    args = p.parse_args(argv)
    for r in compare(args.facts, args.dtype, args.sample):
        print(f"{r['facts']:,} facts, {r['queries']:,} queries, {r['dtype']}: certified {r['certified_s']:.2f} s "
              f"({r['certified_qps']:,.0f}/s), PyTorch {r['peer_s']:.2f} s ({r['peer_qps']:,.0f}/s), certified/PyTorch "
              f"throughput {r['ratio']:.2f}x; sample of {r['checked']}: {r['expert_disagreements']} expert "
              f"disagreements, {r['outside_enclosure']} errors outside the enclosure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
