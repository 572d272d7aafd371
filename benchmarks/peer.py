"""An uncertified PyTorch forward pass over the same weights and queries: the yardstick.

    python benchmarks/peer.py --facts 100000 [--dtype float64 float32] [--sample 2000]
    python benchmarks/peer.py --facts 100000 1000000 --runs 3     # end to end against check -> RESULTS.md

The best plain pass we could write for this layout, float64 or float32, one thread:

* queries batched by prefix length (the verifier's own enumeration, so both passes see
  the same rows in the same order);
* per-token and per-position query/key projections precomputed (all heads side by
  side), scores and softmax dense over (rows, heads, positions);
* the residual stream is a weighted sum of *pieces* (rows of E and P, each head's
  W_O·W_V·E and W_O·W_V·P rows, weighted 1 or by attention). Every later map is linear
  in it, so each piece's image is tabulated once: its gate scores (a dense table of the
  distinct rows), its pre-activations in each expert, its logits (scipy products when the
  tables are built). A batch is then a sparse matrix A of piece weights (rows × pieces)
  and three products: ``A·G`` (gate, sparse times dense; top-1 routing by argmax),
  ``A_k·Z_k`` for the rows routed to expert k
  only (its neurons, nothing of the other experts), and ``relu(·)·(U·W_2)_k`` over the
  neurons that fire (positive-bias neurons as a constant);
* logits only for the tokens some firing neuron reaches; every other token has logit 0
  and enters the softmax as a count, never materialised; P(valid) from the valid
  tokens' logits found by binary search.

It returns, per query, the routed expert and the error 1 − P(valid), and the benchmark
checks them against the verifier's enclosures on a sample (:func:`measure`). Used by
``benchmarks/scale.py``. With ``--runs``, :func:`paired` times whole processes in
interleaved rounds: the peer end to end (reading the files, enumerating the queries,
building its tables, the pass) against ``python -m verifier check --jobs 1`` of the same
task set, with and without ``--weights``, and writes the block "peer" of RESULTS.md.
"""

from __future__ import annotations

import gc

# Run as a program, the same start-up as `python -m verifier` (cli.main.settle): no cyclic
# collection while the modules load; end_to_end freezes them and turns the collector on
# again once its modules are in (main turns it on at once otherwise).
if __name__ == "__main__":
    gc.disable()

import argparse  # noqa: E402
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import scipy.sparse as sp
from tasks.structure import structure_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _csr(M: sp.spmatrix, torch, dtype):
    """A scipy matrix as a torch sparse CSR tensor of ``dtype``."""
    M = sp.csr_matrix(M)
    return torch.sparse_csr_tensor(torch.from_numpy(M.indptr.astype(np.int64)),
                                   torch.from_numpy(M.indices.astype(np.int64)),
                                   torch.from_numpy(M.data.astype(np.float64)).to(dtype), size=M.shape)


def _distinct_rows(M: sp.csr_matrix, chunk: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
    """(row -> index of its distinct row, the distinct rows dense); index 0 is the zero row."""
    M = sp.csr_matrix(M)
    M.sort_indices()
    ids: dict[bytes, int] = {b"": 0}
    rows = [np.zeros(M.shape[1])]
    out = np.zeros(M.shape[0], np.int64)
    for a in range(0, M.shape[0], chunk):
        D = np.ascontiguousarray(M[a:a + chunk].toarray())
        view = D.view(np.dtype((np.void, D.dtype.itemsize * D.shape[1]))).reshape(-1)
        uniq, first, inv = np.unique(view, return_index=True, return_inverse=True)
        local = np.empty(uniq.size, np.int64)
        for u, f in enumerate(first):
            key = D[f].tobytes() if D[f].any() else b""
            if key not in ids:
                ids[key] = len(rows)
                rows.append(D[f])
            local[u] = ids[key]
        out[a:a + chunk] = local[inv.reshape(-1)]
    return out, np.vstack(rows)


class Peer:
    """The weights, prepared once for the PyTorch pass: per-piece tables.

    A *piece* is a row the residual stream is a weighted sum of: ``E[t]`` (weight 1, the
    last token), ``P[p]`` (weight 1) and, per head h and position j, ``W_O W_V E[t_j]`` and
    ``W_O W_V P[j]`` (weight: the attention a_hj). Every map after the residual is
    linear in it, so each piece's image is tabulated once: its gate scores (pieces × K),
    its pre-activations in every expert (pieces × width_k, one table per expert) and its
    logits (pieces × V). A query is then a sparse row of piece weights A, and the pass is
    three sparse products: ``A·G`` (gate), ``A_k·Z_k`` (the routed expert's neurons only),
    ``relu(·)·(U W_2)_k`` (logits of the tokens the expert reaches).
    """

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
        self.V1, self.npos = E.shape[0], P.shape[0]
        blocks = [E, P]
        if self.H:
            self.QE = t(np.hstack([(E @ h.W_Q.T).toarray() for h in w.heads]))
            self.QP = t(np.hstack([(P @ h.W_Q.T).toarray() for h in w.heads]))
            self.KE = t(np.hstack([(E @ h.W_K.T).toarray() for h in w.heads]))
            self.KP = t(np.hstack([(P @ h.W_K.T).toarray() for h in w.heads]))
            widths = [h.W_Q.shape[0] for h in w.heads]
            self.head_of = torch.from_numpy(np.repeat(np.arange(self.H), widths).astype(np.int64))
            # pieces: E rows, P rows, then head m's W_O W_V E rows, then head m's W_O W_V P rows
            blocks += [E @ h.W_V.T @ h.W_O.T for h in w.heads] + [P @ h.W_V.T @ h.W_O.T for h in w.heads]
        pieces = sp.vstack(blocks).tocsr()
        self.n_pieces = pieces.shape[0]
        # The gate: each piece's gate scores, as a dense table of the distinct rows (most
        # pieces share a few: none, or a task's structure weights), so that a batch's scores
        # are one sparse-times-dense product (a sparse-times-sparse one with many experts
        # was most of the pass).
        self.gate_of, Gu = _distinct_rows((pieces @ w.W_G.T).tocsr())
        self.gate_of = torch.from_numpy(self.gate_of)
        self.Gu = t(Gu)
        self.bG = t(w.b_G)
        LU = (pieces @ w.U.T).tocsr()
        self.LU = _csr(LU, torch, self.dtype) if LU.nnz else None       # logits the residual reaches directly
        W1 = sp.vstack([sp.csr_matrix(e.W_1) for e in w.experts]).tocsr()
        Z = (pieces @ W1.T).tocsc()
        self.experts, off = [], 0
        for e in w.experts:
            width = e.W_1.shape[0]
            b = np.asarray(e.b_1, np.float64)
            W2 = sp.csc_matrix(e.W_2)
            UW2 = (w.U @ W2).T.tocsr()                                  # (width, V): a neuron's logits
            positive = np.flatnonzero(b > 0)
            const = sp.csr_matrix(UW2[positive].T @ b[positive]).reshape(1, -1) if positive.size else None
            self.experts.append((_csr(Z[:, off:off + width], torch, self.dtype), t(b), _csr(UW2, torch, self.dtype),
                                 None if const is None or const.nnz == 0 else _csr(const, torch, self.dtype)))
            off += width

    @property
    def gate_scaled(self) -> bool:
        return self.w.gate_mode == "top1-scaled"

    def run(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray):
        """(routed expert, error) per row of a batch of one prefix length (weights' token ids)."""
        torch = self.torch
        if self.gate_scaled:
            raise NotImplementedError("gate_mode top1-scaled")
        w, n = self.w, tokens.shape[0]
        p = tokens.shape[1]
        ids = torch.from_numpy(np.concatenate([np.full((n, 1), w.bos), tokens], axis=1).astype(np.int64))
        cols = [ids[:, p:], torch.full((n, 1), self.V1 + p, dtype=torch.int64)]
        vals = [torch.ones(n, 2, dtype=self.dtype)]
        if self.H:
            q = self.QE[ids[:, p]] + self.QP[p]                                  # (n, Σd_h)
            k = self.KE[ids] + self.KP[: p + 1]                                  # (n, p+1, Σd_h)
            s = torch.zeros(n, p + 1, self.H, dtype=self.dtype).index_add_(2, self.head_of, q[:, None, :] * k)
            a = torch.softmax(s.transpose(1, 2), dim=-1).reshape(n, -1)         # (n, H·(p+1))
            heads = torch.arange(self.H)[None, :, None]
            base = self.V1 + self.npos
            cols.append((base + heads * self.V1 + ids[:, None, :]).reshape(n, -1))
            cols.append((base + self.H * self.V1 + heads * self.npos + torch.arange(p + 1))
                        .expand(n, -1, -1).reshape(n, -1))
            vals += [a, a]
        col = torch.cat(cols, 1)
        val = torch.cat(vals, 1)
        m = col.shape[1]
        gcol = self.gate_of[col.reshape(-1)]
        keep = gcol != 0                                  # pieces the gate does not read add nothing
        crow = torch.zeros(n + 1, dtype=torch.int64)
        crow[1:] = torch.cumsum(keep.reshape(n, m).sum(1), 0)
        A = torch.sparse_csr_tensor(crow, gcol[keep], val.reshape(-1)[keep], size=(n, self.Gu.shape[0]))
        g = torch.sparse.mm(A, self.Gu) + self.bG
        e = torch.argmax(g, dim=1)
        err = torch.empty(n, dtype=torch.float64)
        order = torch.argsort(e, stable=True)
        bounds = torch.searchsorted(e[order], torch.arange(self.K + 1)).tolist()
        vp = torch.from_numpy(np.asarray(valid_ptr, np.int64))
        vt = torch.from_numpy(np.asarray(valid, np.int64))
        for x in range(self.K):
            if bounds[x + 1] > bounds[x]:
                rows = order[bounds[x]:bounds[x + 1]]
                Ak = torch.sparse_csr_tensor(torch.arange(rows.numel() + 1) * m, col[rows].reshape(-1),
                                             val[rows].reshape(-1), size=(rows.numel(), self.n_pieces))
                err[rows] = self._error(x, Ak, rows, vp, vt).to(torch.float64)
        return e.numpy(), err.numpy()

    def _error(self, x, Ak, rows, vp, vt):
        """1 − P(valid) for the rows ``rows`` routed to expert ``x`` (piece weights ``Ak``)."""
        torch = self.torch
        Z, b1, UW2, const = self.experts[x]
        nk = rows.numel()
        z = Ak @ Z                                                   # reached neurons only
        zc, zv = z.col_indices(), z.values()
        act = torch.relu(zv + b1[zc]) - torch.relu(b1[zc])           # net of the constant relu(b1)
        on = act != 0                                                # neurons below threshold add nothing
        zrow = torch.repeat_interleave(torch.arange(nk), z.crow_indices().diff())
        crow = torch.zeros(nk + 1, dtype=torch.int64)
        crow[1:] = torch.cumsum(torch.bincount(zrow[on], minlength=nk), 0)
        h = torch.sparse_csr_tensor(crow, zc[on], act[on], size=z.shape)
        L = h @ UW2                                                  # logits of the reached tokens
        if self.LU is not None:
            L = L + Ak @ self.LU
        if const is not None:
            L = L + torch.sparse_csr_tensor(torch.arange(nk + 1), torch.zeros(nk, dtype=torch.int64),
                                            torch.ones(nk, dtype=self.dtype), size=(nk, 1)) @ const
        crow, lcol, logit = L.crow_indices(), L.col_indices(), L.values()
        reached = crow[1:] - crow[:-1]
        M = torch.segment_reduce(logit, "max", offsets=crow, initial=-float("inf")) if logit.numel() \
            else torch.full((nk,), -float("inf"), dtype=self.dtype)
        M = torch.where(reached < self.V, torch.clamp(M, min=0.0), M)   # V − reached tokens have logit 0
        lrow = torch.repeat_interleave(torch.arange(nk), reached)
        ex = torch.exp(logit - M[lrow])
        e0 = torch.exp(-M)
        total = torch.zeros(nk, dtype=self.dtype).index_add_(0, lrow, ex) + (self.V - reached) * e0
        # valid tokens: count · e^{−M}, corrected on those reached (sorted keys, a binary search each)
        start, count = vp[rows], vp[rows + 1] - vp[rows]
        vrow = torch.repeat_interleave(torch.arange(nk), count)
        vkey = vrow * self.V + vt[start[vrow] + torch.arange(vrow.numel()) - torch.repeat_interleave(
            torch.cumsum(count, 0) - count, count)]
        vkey = torch.sort(vkey).values
        good = count.to(self.dtype) * e0
        if vkey.numel() and logit.numel():
            lkey = lrow * self.V + lcol
            pos = torch.searchsorted(vkey, lkey).clamp(max=vkey.numel() - 1)
            hit = vkey[pos] == lkey
            good = good.index_add_(0, lrow[hit], ex[hit] - e0[lrow[hit]])
        return 1.0 - good / total


def measure(taskset, weights, work: Iterable, dtypes: Sequence[str], sample: int = 2000, seed: int = 0) -> list[dict]:
    """Time the certified pass (this process) and the peer (one thread) batch by batch on
    the same rows, interleaved so both see the same machine; check a sample.

    ``work`` yields (tokens, valid_ptr, valid, ablate) in the weights' token ids, as the
    verifier's batches do. The certified pass is exactly the one ``verify`` runs per
    batch (the factored exact pass of ``taskset``, ablation on object queries, no full
    gate matrix). Per batch about ``sample // 20`` rows are compared: the routed expert
    where the verifier certified the routing, and the peer's error against the
    verifier's enclosure.
    """
    import torch

    from verifier.checks.verify import token_map
    from verifier.running.runner import PassSpec

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")
    warnings.filterwarnings("ignore", message="Sparse (CSR tensor support|invariant checks)")
    prep = PassSpec.for_taskset(taskset, weights, token_map(taskset, weights)).build(weights)
    peers = {dt: Peer(weights, dt) for dt in dtypes}
    rng = np.random.default_rng(seed)
    cert_s, queries, batches_seen, warm = 0.0, 0, 0, False
    stats = {dt: {"peer_s": 0.0, "checked": 0, "expert_disagreements": 0, "outside_enclosure": 0} for dt in dtypes}
    for tok, vp, vv, ab in work:
        if not warm:                                   # compile (numba) and warm up both on two rows
            prep.run_batch(tok[:2], vp[:3], vv[: int(vp[2])], ablate=ab[:2], scores=False)
            for peer in peers.values():
                peer.run(tok[:2], vp[:3], vv[: int(vp[2])])
            warm = True
        t = time.perf_counter()
        res = prep.run_batch(tok, vp, vv, ablate=ab, scores=False).compact()
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
    from verifier.passes.batches import batch_rows, batches

    tmap = weights.token_ids(taskset.vocabulary.tokens)    # as verify's token map: by exact string
    for i, b in enumerate(batches(taskset, structure_of(taskset), batch_rows(len(weights.experts)))):
        if i % every == 0:
            yield tmap[b.tokens], b.valid_ptr, tmap[b.valid], b.object_query & (b.determined >= 0)


def compare(facts: int, dtypes: list[str], sample: int, seed: int = 0) -> list[dict]:
    """Build the WikiData5M-shaped set of ``facts`` facts and :func:`measure` every batch."""
    from construction.model import build
    from tasks.synthetic import wikidata_like

    ts = wikidata_like(facts, seed=seed)
    weights = build(ts).instantiate()
    return [{"facts": facts, **r} for r in measure(ts, weights, verifier_batches(ts, weights), dtypes, sample, seed)]


def end_to_end(directory: str, dtype: str) -> dict:
    """What a user's uncertified pass does, as one process: read the tasks and the weights,
    enumerate the queries (batched by prefix length), build the tables, run every batch,
    one thread. Returns the phase times and the number of queries."""
    import torch

    from layout.npz import load
    from tasks.io import load_tasks
    import tasks.structure  # noqa: F401  (structure_of, for verifier_batches: loaded with the rest)
    from verifier.passes.batches import batches  # noqa: F401  (not the verifier's pass: nothing of numba)

    if not gc.isenabled():              # what `python -m verifier` does once its modules are in
        gc.freeze()
        gc.enable()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    ts = load_tasks(str(Path(directory) / "tasks.yaml"))
    weights = load(str(Path(directory) / "weights.npz"))
    t1 = time.perf_counter()
    peer = Peer(weights, dtype)
    t2 = time.perf_counter()
    queries, enumerate_s, forward_s = 0, 0.0, 0.0
    it = iter(verifier_batches(ts, weights))
    while True:
        t = time.perf_counter()
        batch = next(it, None)
        enumerate_s += time.perf_counter() - t
        if batch is None:
            break
        t = time.perf_counter()
        peer.run(*batch[:3])
        forward_s += time.perf_counter() - t
        queries += batch[0].shape[0]
    return {"dtype": dtype, "queries": queries, "read_s": t1 - t0, "tables_s": t2 - t1, "enumerate_s": enumerate_s,
            "forward_s": forward_s}


def _commands(directory: str) -> dict[str, list[str]]:
    """The processes timed against each other: the peer end to end in each dtype, ``check`` of
    the same weights, and the whole ``check`` (construction and its evidence included)."""
    py, here = sys.executable, str(Path(__file__).resolve())
    tasks, weights = str(Path(directory) / "tasks.yaml"), str(Path(directory) / "weights.npz")
    return {
        "PyTorch peer, float64": [py, here, "--end-to-end", directory, "--dtype", "float64"],
        "PyTorch peer, float32": [py, here, "--end-to-end", directory, "--dtype", "float32"],
        "`check --weights`": [py, "-m", "verifier", "check", tasks, "--weights", weights, "--jobs", "1", "--quiet"],
        "`check` (whole)": [py, "-m", "verifier", "check", tasks, "--jobs", "1", "--quiet"],
    }


def paired(facts: int, runs: int, work: Path, seed: int = 0) -> tuple[list[dict], dict[str, list[float]]]:
    """Generate the set of ``facts`` facts into ``work``, build its weights with ``python -m verifier
    build``, then run every command of :func:`_commands` in turn, ``runs`` rounds (a warm-up round
    first, not counted): the wall time of each whole process, interleaved so that drift in the
    machine's speed falls on all of them alike. Also returns each peer's phases (last round)."""
    import subprocess

    from tasks.io import dump_tasks
    from tasks.synthetic import wikidata_like

    work.mkdir(parents=True, exist_ok=True)
    dump_tasks(wikidata_like(facts, seed=seed), work / "tasks.yaml", facts_dir=work)
    subprocess.run([sys.executable, "-m", "verifier", "build", str(work / "tasks.yaml"), "-o",
                    str(work / "weights.npz"),
                    "--quiet"], check=True)
    cmds = _commands(str(work))
    # Python's default: modules' bytecode cached on first import (the warm-up round), as on a
    # user's machine; an environment that turns it off would time compiling the project's
    # sources in every process instead (about 0.2 s of each command's start-up here)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times: dict[str, list[float]] = {k: [] for k in cmds}
    phases: dict[str, dict] = {}
    for r in range(runs + 1):
        for name, cmd in cmds.items():
            t = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t
            if out.returncode not in (0, 1):
                raise RuntimeError(f"{cmd}: exit {out.returncode}: {out.stderr[-2000:]}")
            if r:
                times[name].append(wall)
            if "--end-to-end" in cmd:
                phases[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return list(phases.values()), times


def peer_block(rows: list[dict], command: str) -> str:
    """The "peer" block of RESULTS.md from :func:`main`'s rows."""
    from benchmarks.results import machine

    out = ["## PyTorch peer, end to end", "",
           f"Machine: {machine()}. Command: `{command}`.", "",
           "| facts | queries | process | median wall (s) | runs (s) | ÷ whole `check` | ÷ `check --weights` |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        whole = float(np.median(r["times"]["`check` (whole)"]))
        given = float(np.median(r["times"]["`check --weights`"]))
        for name, ts in r["times"].items():
            med = float(np.median(ts))
            out.append(f"| {r['facts']:,} | {r['queries']:,} | {name} | {med:.2f} | "
                       f"{', '.join(f'{x:.2f}' for x in ts)} | {med / whole:.2f}× | {med / given:.2f}× |")
    out += ["", "Peer phases, last run (s): " + "; ".join(
        f"{r['facts']:,} facts {p['dtype']}: read {p['read_s']:.2f}, tables {p['tables_s']:.2f}, enumerate "
        f"{p['enumerate_s']:.2f}, forward {p['forward_s']:.2f}" for r in rows for p in r["phases"]), "",
        "| facts | dtype | rows compared | expert disagreements | errors outside the enclosure |",
        "|---|---|---|---|---|"]
    for r in rows:
        for c in r["compared"]:
            out.append(f"| {r['facts']:,} | {c['dtype']} | {c['checked']:,} | {c['expert_disagreements']} | "
                       f"{c['outside_enclosure']} |")
    out += ["", "Each process is timed whole (interpreter start-up, imports, reading the files included), one core "
            "each (`--jobs 1`, one torch thread), the commands in turn within each round so that the machine's drift "
            "falls on all alike, after a warm-up round that also leaves the modules' bytecode cached (Python's "
            "default, whatever this shell's PYTHONDONTWRITEBYTECODE); the median of the rounds. Both start alike: no "
            "cyclic garbage collection while their modules load, which are then frozen out of the collector's reach "
            "(`cli.main.settle`). The peer reads the tasks and the weights, enumerates the "
            "queries batched by prefix length, builds its tables and runs every query (docstring of "
            "`benchmarks/peer.py`); `check --weights` verifies the same weights (every query, every check); the whole "
            "`check` also builds the model and its evidence (closed form, modularity rebuilds). The rows compared are "
            "a sample of every batch, in one process: the peer's routed expert against the certified one and its "
            "error against the certified enclosure."]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--facts", type=int, nargs="+", default=[100_000])
    p.add_argument("--dtype", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    p.add_argument("--sample", type=int, default=2000, help="queries checked against the verifier's enclosures")
    p.add_argument("--runs", type=int, default=0,
                   help="time the peer end to end against `check`, this many interleaved rounds, and write the "
                        "block 'peer' of benchmarks/RESULTS.md (0: only the in-process comparison)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"), help="markdown file to write")
    p.add_argument("--end-to-end", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.end_to_end:
        print(json.dumps(end_to_end(args.end_to_end, args.dtype[0])))
        return 0
    gc.enable()
    rows = []
    for facts in args.facts:
        compared = compare(facts, args.dtype, args.sample)
        for r in compared:
            print(f"{r['facts']:,} facts, {r['queries']:,} queries, {r['dtype']}: certified {r['certified_s']:.2f} s "
                  f"({r['certified_qps']:,.0f}/s), PyTorch {r['peer_s']:.2f} s ({r['peer_qps']:,.0f}/s), "
                  f"certified/PyTorch throughput {r['ratio']:.2f}x; sample of {r['checked']}: "
                  f"{r['expert_disagreements']} expert disagreements, {r['outside_enclosure']} errors "
                  "outside the enclosure")
        if args.runs:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                phases, times = paired(facts, args.runs, Path(tmp))
            rows.append({"facts": facts, "queries": compared[0]["queries"], "compared": compared, "phases": phases,
                         "times": times})
            for name, ts in times.items():
                print(f"{facts:,} facts: {name}: median {np.median(ts):.2f} s ({', '.join(f'{x:.2f}' for x in ts)})")
    if rows:
        from benchmarks.results import write_block

        given = list(argv if argv is not None else sys.argv[1:])
        if "--out" in given:
            i = given.index("--out")
            del given[i:i + 2]
        write_block("peer", peer_block(rows, ("python benchmarks/peer.py " + " ".join(given)).strip()), Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
