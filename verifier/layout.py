"""The weight layout: what the verifier runs, and the file format it reads.

This module is the contract between whoever makes weights (the construction, a
training run, a user) and the verifier. The forward pass, for a prefix x_1..x_n with
the beginning-of-sequence token x_0 = BOS prepended::

    h_i   = E[x_i] + P[i]                                   i = 0..n
    s^m_ij = (W_Q^m h_i) · (W_K^m h_j)                       j <= i, head m
    a^m_ij = exp(s^m_ij) / Σ_{l<=i} exp(s^m_il)
    r_i   = h_i + Σ_m W_O^m Σ_{j<=i} a^m_ij W_V^m h_j
    g_i   = W_G r_i + b_G                                   one score per expert
    e_i   = argmax_k g_ik                                   top-1 routing
    c_i   = 1                      (gate_mode "top1")
          = softmax(g_i)_{e_i}     (gate_mode "top1-scaled", Switch-style)
    y_i   = r_i + c_i · W_2^{e_i} ReLU(W_1^{e_i} r_i + b_1^{e_i})
    p_i   = softmax(U y_i)                                  over the |V| tokens

The prediction for a query is p_n. No scaling of attention scores (fold 1/sqrt(d) into
W_Q). Arrays (``d`` is the residual width, ``V`` the vocabulary size):

==================  ==============  ==================================================
name                shape           meaning
==================  ==============  ==================================================
vocab               (V,)            token strings; token id = position
E                   (V+1, d)        token embeddings; row V is BOS
P                   (n_pos, d)      position embeddings, position 0 is BOS's
heads[m].W_Q/W_K    (d_h, d)        query / key maps of head m
heads[m].W_V        (d_v, d)        value map
heads[m].W_O        (d, d_v)        output map
W_G, b_G            (K, d), (K,)    gate
experts[k].W_1,b_1  (w_k, d),(w_k,) first layer of expert k (w_k = its width)
experts[k].W_2      (d, w_k)        second layer
U                   (V, d)          unembedding
expert_tasks        (K,)            name of the task each expert serves ("" if none)
==================  ==============  ==================================================

Matrices are ``scipy.sparse`` CSR. In a file (``.npz``, written by :func:`save`) a
matrix ``X`` is stored as ``X.data``, ``X.indices``, ``X.indptr``, ``X.shape``; vectors
as plain arrays; ``meta`` is a JSON string with ``format``, ``gate_mode``, ``n_heads``,
``n_experts``, optional ``residual_labels``, ``neuron_labels`` and ``parameters``.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import scipy.sparse as sp

from tasks.errors import TaskError
from tasks.files import atomic_file

FORMAT = "moe-knowledge-weights/1"
GATE_MODES = ("top1", "top1-scaled")


@dataclass(frozen=True)
class Head:
    W_Q: sp.csr_matrix
    W_K: sp.csr_matrix
    W_V: sp.csr_matrix
    W_O: sp.csr_matrix


@dataclass(frozen=True)
class Expert:
    W_1: sp.csr_matrix
    b_1: np.ndarray
    W_2: sp.csr_matrix

    @property
    def width(self) -> int:
        return self.W_1.shape[0]


@dataclass(frozen=True)
class Weights:
    vocab: tuple[str, ...]
    E: sp.csr_matrix
    P: sp.csr_matrix
    heads: tuple[Head, ...]
    W_G: sp.csr_matrix
    b_G: np.ndarray
    experts: tuple[Expert, ...]
    U: sp.csr_matrix
    expert_tasks: tuple[str, ...]
    gate_mode: str = "top1"
    residual_labels: tuple[str, ...] | None = None
    neuron_labels: tuple[tuple[str, ...], ...] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def d(self) -> int:
        return self.E.shape[1]

    @property
    def n_positions(self) -> int:
        return self.P.shape[0]

    @property
    def bos(self) -> int:
        return len(self.vocab)

    def replace(self, **changes) -> "Weights":
        return replace(self, **changes)

    def validate(self, source: str = "weights") -> None:
        """Shapes and values agree with the layout; raises TaskError naming the array."""
        V, d = len(self.vocab), self.d
        K = len(self.experts)

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise TaskError(f"{what}", file=source, fix="the weights do not follow the documented layout (README, 'Weight layout')")

        need(self.E.shape == (V + 1, d), f"E has shape {self.E.shape}, expected ({V + 1}, d)")
        need(self.P.shape[1] == d and self.P.shape[0] >= 1, f"P has shape {self.P.shape}, expected (n_pos, {d})")
        for m, h in enumerate(self.heads):
            need(h.W_Q.shape[1] == d and h.W_K.shape == h.W_Q.shape, f"head {m}: W_Q {h.W_Q.shape} / W_K {h.W_K.shape} do not match d={d}")
            need(h.W_V.shape[1] == d and h.W_O.shape == (d, h.W_V.shape[0]), f"head {m}: W_V {h.W_V.shape} / W_O {h.W_O.shape} do not match d={d}")
        need(K >= 1, "there are no experts")
        need(self.W_G.shape == (K, d), f"W_G has shape {self.W_G.shape}, expected ({K}, {d})")
        need(self.b_G.shape == (K,), f"b_G has shape {self.b_G.shape}, expected ({K},)")
        for k, e in enumerate(self.experts):
            w = e.W_1.shape[0]
            need(e.W_1.shape == (w, d) and e.b_1.shape == (w,) and e.W_2.shape == (d, w), f"expert {k}: W_1 {e.W_1.shape}, b_1 {e.b_1.shape}, W_2 {e.W_2.shape} do not fit d={d}")
        need(self.U.shape == (V, d), f"U has shape {self.U.shape}, expected ({V}, {d})")
        need(len(self.expert_tasks) == K, f"expert_tasks has {len(self.expert_tasks)} entries for {K} experts")
        need(self.gate_mode in GATE_MODES, f"gate_mode {self.gate_mode!r} is not one of {GATE_MODES}")
        need(len(set(self.vocab)) == V, "vocab has repeated tokens")
        named = [t for t in self.expert_tasks if t]
        dup = sorted({t for t in named if named.count(t) > 1})
        need(not dup, f"expert_tasks names task {dup[0]!r} for several experts; an expert serves one task and a task one expert" if dup else "")
        for name, m in self.arrays():
            data = m.data if sp.issparse(m) else m
            need(np.all(np.isfinite(data)), f"{name} has non-finite entries")

    def arrays(self):
        yield "E", self.E
        yield "P", self.P
        for m, h in enumerate(self.heads):
            yield f"heads.{m}.W_Q", h.W_Q
            yield f"heads.{m}.W_K", h.W_K
            yield f"heads.{m}.W_V", h.W_V
            yield f"heads.{m}.W_O", h.W_O
        yield "W_G", self.W_G
        yield "b_G", self.b_G
        for k, e in enumerate(self.experts):
            yield f"experts.{k}.W_1", e.W_1
            yield f"experts.{k}.b_1", e.b_1
            yield f"experts.{k}.W_2", e.W_2
        yield "U", self.U


def _put(out: dict, name: str, m) -> None:
    if sp.issparse(m):
        m = m.tocsr()
        out[f"{name}.data"] = m.data.astype(np.float64)
        out[f"{name}.indices"] = m.indices.astype(np.int64)
        out[f"{name}.indptr"] = m.indptr.astype(np.int64)
        out[f"{name}.shape"] = np.asarray(m.shape, dtype=np.int64)
    else:
        out[name] = np.asarray(m, dtype=np.float64)


def save(weights: Weights, path: str | os.PathLike) -> None:
    """Write an ``.npz`` file atomically (a temporary file, then rename)."""
    arrays: dict[str, np.ndarray] = {"vocab": np.array(weights.vocab, dtype=str)}
    for name, m in weights.arrays():
        _put(arrays, name, m)
    arrays["expert_tasks"] = np.array(weights.expert_tasks, dtype=str)
    meta = {
        "format": FORMAT,
        "gate_mode": weights.gate_mode,
        "n_heads": len(weights.heads),
        "n_experts": len(weights.experts),
        "residual_labels": list(weights.residual_labels) if weights.residual_labels is not None else None,
        "neuron_labels": [list(x) for x in weights.neuron_labels] if weights.neuron_labels is not None else None,
        "parameters": weights.parameters,
    }
    arrays["meta"] = np.array(json.dumps(meta, default=str))
    with atomic_file(path) as f:
        np.savez(f, **arrays)


def load(path: str | os.PathLike) -> Weights:
    """Read a weights file; any problem is a one-line TaskError."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise TaskError("is a directory, not a weights file", file=path, fix="give the .npz file written by 'verifier build'")
    try:
        with np.load(path, allow_pickle=False) as z:
            files = {name: z[name] for name in z.files}
    except FileNotFoundError:
        raise TaskError("weights file not found", file=path, fix="check the path") from None
    except PermissionError:
        raise TaskError("weights file is not readable", file=path, fix="check its permissions") from None
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as exc:
        raise TaskError(f"not a readable .npz weights file ({type(exc).__name__}: {exc})".replace("\n", " "), file=path,
                        fix="it may be truncated or corrupt; export it again with 'verifier build'") from None
    try:
        meta = json.loads(str(files["meta"]))
        if meta.get("format") != FORMAT:
            raise TaskError(f"unknown weights format {meta.get('format')!r}", file=path, fix=f"expected {FORMAT}")

        def mat(name: str) -> sp.csr_matrix:
            shape = tuple(int(x) for x in files[f"{name}.shape"])
            m = sp.csr_matrix((np.asarray(files[f"{name}.data"], np.float64), files[f"{name}.indices"], files[f"{name}.indptr"]), shape=shape)
            m.check_format(full_check=True)
            return m

        heads = tuple(Head(mat(f"heads.{m}.W_Q"), mat(f"heads.{m}.W_K"), mat(f"heads.{m}.W_V"), mat(f"heads.{m}.W_O"))
                      for m in range(int(meta["n_heads"])))
        experts = tuple(Expert(mat(f"experts.{k}.W_1"), np.asarray(files[f"experts.{k}.b_1"], np.float64), mat(f"experts.{k}.W_2"))
                        for k in range(int(meta["n_experts"])))
        weights = Weights(
            vocab=tuple(str(t) for t in files["vocab"]),
            E=mat("E"), P=mat("P"), heads=heads, W_G=mat("W_G"), b_G=np.asarray(files["b_G"], np.float64),
            experts=experts, U=mat("U"), expert_tasks=tuple(str(t) for t in files["expert_tasks"]),
            gate_mode=str(meta.get("gate_mode", "top1")),
            residual_labels=tuple(meta["residual_labels"]) if meta.get("residual_labels") else None,
            neuron_labels=tuple(tuple(x) for x in meta["neuron_labels"]) if meta.get("neuron_labels") else None,
            parameters=dict(meta.get("parameters") or {}),
        )
    except TaskError:
        raise
    except (KeyError, ValueError, TypeError, IndexError, json.JSONDecodeError) as exc:
        raise TaskError(f"weights file is missing or has a malformed array ({type(exc).__name__}: {exc})".replace("\n", " "),
                        file=path, fix="export it again with 'verifier build'") from None
    weights.validate(path)
    return weights
