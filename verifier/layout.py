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

computed in exact real arithmetic on the stored values. The prediction for a query is
p_n. No scaling of attention scores (fold 1/sqrt(d) into W_Q). Arrays (``d`` is the
residual width, ``V`` the vocabulary size, ``K`` the number of experts):

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

The file (``.npz``, written by :func:`save`, read by :func:`load`)
-------------------------------------------------------------------
A zip archive of ``.npy`` members, one per array, each name used once:

* a matrix ``X`` is CSR in four members: ``X.data`` (float64 values), ``X.indices``
  (integer column of each value), ``X.indptr`` (integer, rows + 1 offsets starting at
  0, non-decreasing, ending at the number of values) and ``X.shape`` (two integers).
  **Canonical form is required**: within a row the columns strictly increase (sorted,
  no duplicate entry). A duplicate would be ambiguous (its float sum depends on the
  order) and is refused, never merged. An explicitly stored 0 is the value 0, the same
  as an absent entry. Matrix names: ``E``, ``P``, ``heads.<m>.W_Q|W_K|W_V|W_O`` for
  m = 0..n_heads−1, ``W_G``, ``experts.<k>.W_1|W_2`` for k = 0..n_experts−1, ``U``;
* vectors ``b_G`` and ``experts.<k>.b_1``: float64 arrays;
* ``vocab`` and ``expert_tasks``: unicode string arrays;
* ``meta``: a unicode string holding a JSON object (each key once) with ``format``
  (required, ``"moe-knowledge-weights/1"``), ``n_heads`` (required integer >= 0),
  ``n_experts`` (required integer >= 1), ``gate_mode`` (``"top1"``, the default, or
  ``"top1-scaled"``), and optional ``residual_labels`` (d strings), ``neuron_labels``
  (K lists, list k of w_k strings) and ``parameters`` (an object, informational).

Values must be finite. Numeric members may also be stored as float16/float32 (exact in
float64) or as integers of magnitude at most 2^53; anything else (complex, boolean,
strings, Python objects, float128) is refused. Every other member, key or type is
refused: one line naming the member, the row and column where it applies, and the fix.
``expert_tasks`` names each task for at most one expert.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import scipy.sparse as sp

from tasks.errors import TaskError
from tasks.files import atomic_file

FORMAT = "moe-knowledge-weights/1"
GATE_MODES = ("top1", "top1-scaled")
META_KEYS = ("format", "gate_mode", "n_heads", "n_experts", "residual_labels", "neuron_labels", "parameters")
_LAYOUT_FIX = "the weights do not follow the documented layout (README, 'Weight layout')"


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


def csr_problem(m: Any) -> str | None:
    """Why ``m`` is not a canonical float64 CSR matrix with finite values, or None.

    Canonical form is computed from the index arrays, never read from scipy's cached
    flags (which a caller can set to anything).
    """
    if not (sp.issparse(m) and m.format == "csr"):
        return f"is a {type(m).__name__}, not a scipy CSR matrix"
    if m.dtype != np.float64:
        return f"has dtype {m.dtype}, not float64"
    n_rows, n_cols = m.shape
    ptr, idx = np.asarray(m.indptr), np.asarray(m.indices)
    if ptr.shape != (n_rows + 1,) or ptr[0] != 0 or np.any(np.diff(ptr) < 0) or ptr[-1] != idx.size or m.data.size != idx.size:
        return "has an inconsistent indptr (it must start at 0, never decrease and end at the number of entries)"
    if idx.size:
        if idx.min() < 0 or idx.max() >= n_cols:
            bad = int(np.flatnonzero((idx < 0) | (idx >= n_cols))[0])
            return f"row {_row_of(ptr, bad)}: column {int(idx[bad])} is out of range 0..{n_cols - 1}"
        rows = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(ptr))
        same_row = rows[1:] == rows[:-1]
        step = np.diff(idx.astype(np.int64))
        dup = np.flatnonzero(same_row & (step == 0))
        if dup.size:
            i = int(dup[0])
            return (f"row {int(rows[i])}, column {int(idx[i])} is stored twice (duplicate entries): store each entry once, "
                    "with its exact value")
        unsorted = np.flatnonzero(same_row & (step < 0))
        if unsorted.size:
            i = int(unsorted[0])
            return f"row {int(rows[i])}: columns are not sorted ({int(idx[i])} before {int(idx[i + 1])}); sort each row's columns"
        bad = np.flatnonzero(~np.isfinite(m.data))
        if bad.size:
            i = int(bad[0])
            return f"row {int(rows[i])}, column {int(idx[i])} is {float(m.data[i])!r}, not a finite number"
    return None


def _row_of(ptr: np.ndarray, position: int) -> int:
    return int(np.searchsorted(ptr, position, side="right") - 1)


def vector_problem(v: Any, n: int) -> str | None:
    """Why ``v`` is not a finite float64 vector of length n, or None."""
    if not isinstance(v, np.ndarray):
        return f"is a {type(v).__name__}, not a numpy array"
    if v.dtype != np.float64:
        return f"has dtype {v.dtype}, not float64"
    if v.shape != (n,):
        return f"has shape {v.shape}, expected ({n},)"
    bad = np.flatnonzero(~np.isfinite(v))
    if bad.size:
        return f"entry {int(bad[0])} is {float(v[bad[0]])!r}, not a finite number"
    return None


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
        """Types, canonical storage, finite values, shapes and names agree with the layout.

        Raises :class:`TaskError` naming the array (and the row and column) otherwise.
        """
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise TaskError(what, file=source, fix=_LAYOUT_FIX)

        need(isinstance(self.vocab, tuple) and all(isinstance(t, str) for t in self.vocab), "vocab must be a tuple of strings")
        need(sp.issparse(self.E) and len(self.E.shape) == 2, "E is not a sparse matrix")
        V, d = len(self.vocab), self.d
        K = len(self.experts)
        need(len(set(self.vocab)) == V, "vocab has repeated tokens")
        for name, m in self.arrays():
            problem = csr_problem(m) if name not in ("b_G",) and not name.endswith(".b_1") else None
            if problem:
                need(False, f"{name} {problem}")
        need(self.E.shape == (V + 1, d), f"E has shape {self.E.shape}, expected ({V + 1}, d)")
        need(self.P.shape[1] == d and self.P.shape[0] >= 1, f"P has shape {self.P.shape}, expected (n_pos, {d})")
        for m, h in enumerate(self.heads):
            need(h.W_Q.shape[1] == d and h.W_K.shape == h.W_Q.shape, f"head {m}: W_Q {h.W_Q.shape} / W_K {h.W_K.shape} do not match d={d}")
            need(h.W_V.shape[1] == d and h.W_O.shape == (d, h.W_V.shape[0]), f"head {m}: W_V {h.W_V.shape} / W_O {h.W_O.shape} do not match d={d}")
        need(K >= 1, "there are no experts")
        need(self.W_G.shape == (K, d), f"W_G has shape {self.W_G.shape}, expected ({K}, {d})")
        problem = vector_problem(self.b_G, K)
        need(problem is None, f"b_G {problem}")
        for k, e in enumerate(self.experts):
            w = e.W_1.shape[0]
            need(e.W_1.shape == (w, d) and e.W_2.shape == (d, w), f"expert {k}: W_1 {e.W_1.shape}, W_2 {e.W_2.shape} do not fit d={d}")
            problem = vector_problem(e.b_1, w)
            need(problem is None, f"experts.{k}.b_1 {problem}")
        need(self.U.shape == (V, d), f"U has shape {self.U.shape}, expected ({V}, {d})")
        need(isinstance(self.expert_tasks, tuple) and all(isinstance(t, str) for t in self.expert_tasks),
             "expert_tasks must be a tuple of strings")
        need(len(self.expert_tasks) == K, f"expert_tasks has {len(self.expert_tasks)} entries for {K} experts")
        need(self.gate_mode in GATE_MODES, f"gate_mode {self.gate_mode!r} is not one of {GATE_MODES}")
        named = [t for t in self.expert_tasks if t]
        dup = sorted({t for t in named if named.count(t) > 1})
        need(not dup, f"expert_tasks names task {dup[0]!r} for several experts; an expert serves one task and a task one expert" if dup else "")
        if self.residual_labels is not None:
            need(len(self.residual_labels) == d and all(isinstance(x, str) for x in self.residual_labels),
                 f"residual_labels has {len(self.residual_labels)} entries for d = {d} (one string per residual direction)")
        if self.neuron_labels is not None:
            need(len(self.neuron_labels) == K, f"neuron_labels has {len(self.neuron_labels)} lists for {K} experts")
            for k, (labels, e) in enumerate(zip(self.neuron_labels, self.experts)):
                need(len(labels) == e.width and all(isinstance(x, str) for x in labels),
                     f"neuron_labels[{k}] has {len(labels)} entries for expert {k} of width {e.width}")
        need(isinstance(self.parameters, dict), "parameters must be a dict")

    def arrays(self) -> Iterator[tuple[str, Any]]:
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


def canonical(m: sp.spmatrix) -> sp.csr_matrix:
    """A float64 CSR copy in canonical form, for producers of weights whose matrices are
    already free of duplicates (scipy conversions from dense or COO with unique entries).

    Raises ValueError on duplicate entries rather than summing them in floating point.
    """
    m = sp.csr_matrix(m, dtype=np.float64, copy=True)
    m.has_sorted_indices = False
    m.sort_indices()
    problem = csr_problem(m)
    if problem and "duplicate" in problem:
        raise ValueError(f"matrix {problem}")
    return m


def _put(out: dict, name: str, m) -> None:
    if sp.issparse(m):
        out[f"{name}.data"] = m.data.astype(np.float64)
        out[f"{name}.indices"] = m.indices.astype(np.int64)
        out[f"{name}.indptr"] = m.indptr.astype(np.int64)
        out[f"{name}.shape"] = np.asarray(m.shape, dtype=np.int64)
    else:
        out[name] = np.asarray(m, dtype=np.float64)


def to_arrays(weights: Weights) -> dict[str, np.ndarray]:
    """The file's members, by name (what :func:`save` writes)."""
    weights.validate()
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
    return arrays


def save(weights: Weights, path: str | os.PathLike) -> None:
    """Write an ``.npz`` file atomically (a temporary file, then rename)."""
    arrays = to_arrays(weights)
    with atomic_file(path) as f:
        np.savez(f, **arrays)


# --- reading a file -------------------------------------------------------------------------------


class _Reader:
    """Typed access to the members of one weights file; every problem is a one-line TaskError."""

    def __init__(self, path: str, members: dict[str, np.ndarray]) -> None:
        self.path = path
        self.members = members
        self.used: set[str] = set()

    def fail(self, what: str, fix: str = "export the weights again (verifier.layout.save writes the layout)") -> TaskError:
        return TaskError(what, file=self.path, fix=fix)

    def get(self, name: str) -> np.ndarray:
        if name not in self.members:
            raise self.fail(f"member '{name}' is missing")
        self.used.add(name)
        return self.members[name]

    def numbers(self, name: str, ndim: int = 1, finite: bool = True) -> np.ndarray:
        """A numeric member as float64, refusing every conversion that could change a value."""
        a = self.get(name)
        if a.ndim != ndim:
            raise self.fail(f"'{name}' has {a.ndim} dimensions, expected {ndim}")
        kind = a.dtype.kind
        if kind == "f" and a.dtype.itemsize <= 8:
            out = a.astype(np.float64)
        elif kind in "iu":
            if a.size and (a.max() > 2 ** 53 or (kind == "i" and a.min() < -(2 ** 53))):
                raise self.fail(f"'{name}' holds integers beyond 2^53, not exact in float64", fix="store float64 values")
            out = a.astype(np.float64)
        else:
            raise self.fail(f"'{name}' has dtype {a.dtype} ({_kind_name(a.dtype)}); weights are real numbers",
                            fix="store float64 values")
        bad = np.flatnonzero(~np.isfinite(out.reshape(-1)))
        if finite and bad.size:
            raise self.fail(f"'{name}' entry {int(bad[0])} is {float(out.reshape(-1)[bad[0]])!r}, not a finite number",
                            fix="every weight must be finite")
        return out

    def integers(self, name: str) -> np.ndarray:
        a = self.get(name)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise self.fail(f"'{name}' must be a one-dimensional integer array (it has dtype {a.dtype}, shape {a.shape})")
        return a.astype(np.int64)

    def strings(self, name: str) -> tuple[str, ...]:
        a = self.get(name)
        if a.ndim != 1 or a.dtype.kind != "U":
            raise self.fail(f"'{name}' must be a one-dimensional array of unicode strings (it has dtype {a.dtype}, shape {a.shape})")
        return tuple(str(t) for t in a)

    def matrix(self, name: str) -> sp.csr_matrix:
        shape = self.integers(f"{name}.shape")
        if shape.shape != (2,) or shape.min() < 0:
            raise self.fail(f"'{name}.shape' must be two non-negative integers, got {shape.tolist()}")
        data = self.numbers(f"{name}.data", finite=False)   # csr_problem names the row and column
        indices = self.integers(f"{name}.indices")
        indptr = self.integers(f"{name}.indptr")
        rows, cols = int(shape[0]), int(shape[1])
        if indptr.shape != (rows + 1,):
            raise self.fail(f"'{name}.indptr' has {indptr.size} entries for {rows} rows (expected {rows + 1})")
        if indices.size != data.size:
            raise self.fail(f"'{name}' has {data.size} values but {indices.size} column indices")
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != data.size:
            raise self.fail(f"'{name}.indptr' must start at 0, never decrease and end at {data.size} (the number of values)")
        if indices.size and (indices.min() < 0 or indices.max() >= cols):
            i = int(np.flatnonzero((indices < 0) | (indices >= cols))[0])
            raise self.fail(f"'{name}' row {_row_of(indptr, i)}: column {int(indices[i])} is out of range 0..{cols - 1}")
        m = sp.csr_matrix((data, indices, indptr), shape=(rows, cols))
        problem = csr_problem(m)
        if problem:
            raise self.fail(f"'{name}' {problem}", fix="write canonical CSR (verifier.layout.save does)")
        return m


def _kind_name(dtype: np.dtype) -> str:
    return {"c": "complex numbers", "b": "booleans", "U": "strings", "S": "bytes", "O": "Python objects",
            "V": "raw records", "f": "extended precision", "M": "dates", "m": "time spans"}.get(dtype.kind, dtype.kind)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"key {dup[0]!r} appears twice")
    return dict(pairs)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _read_meta(r: _Reader) -> dict[str, Any]:
    raw = r.get("meta")
    if raw.ndim != 0 or raw.dtype.kind != "U":
        raise r.fail(f"'meta' must be one unicode string holding a JSON object (it has dtype {raw.dtype}, shape {raw.shape})")
    try:
        meta = json.loads(str(raw), object_pairs_hook=_json_object, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise r.fail(f"'meta' is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise r.fail(f"'meta' must be a JSON object, got {type(meta).__name__}")
    unknown = sorted(set(meta) - set(META_KEYS))
    if unknown:
        raise r.fail(f"'meta' has an unknown key {unknown[0]!r} (known: {', '.join(META_KEYS)})")
    if meta.get("format") != FORMAT:
        raise r.fail(f"unknown weights format {meta.get('format')!r}", fix=f"expected meta.format = {FORMAT!r}")

    def integer(key: str, least: int) -> int:
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise r.fail(f"meta.{key} must be an integer >= {least}, got {v!r}")
        return v

    meta["n_heads"] = integer("n_heads", 0)
    meta["n_experts"] = integer("n_experts", 1)
    mode = meta.get("gate_mode", "top1")
    if mode not in GATE_MODES:
        raise r.fail(f"meta.gate_mode must be one of {', '.join(GATE_MODES)}, got {mode!r}")
    meta["gate_mode"] = mode
    labels = meta.get("residual_labels")
    if labels is not None and not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)):
        raise r.fail("meta.residual_labels must be null or a list of strings")
    neurons = meta.get("neuron_labels")
    if neurons is not None and not (isinstance(neurons, list)
                                    and all(isinstance(x, list) and all(isinstance(y, str) for y in x) for x in neurons)):
        raise r.fail("meta.neuron_labels must be null or a list of lists of strings")
    params = meta.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise r.fail("meta.parameters must be null or a JSON object")
    return meta


def _members(path: str) -> dict[str, np.ndarray]:
    """The archive's arrays by name; refuses repeated or non-.npy members and pickled arrays."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except FileNotFoundError:
        raise TaskError("weights file not found", file=path, fix="check the path") from None
    except PermissionError:
        raise TaskError("weights file is not readable", file=path, fix="check its permissions") from None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise TaskError(f"not a readable .npz weights file ({type(exc).__name__}: {exc})".replace("\n", " "), file=path,
                        fix="it may be truncated or corrupt; export it again with 'verifier build'") from None
    stripped = [n[:-4] if n.endswith(".npy") else n for n in names]
    for n in names:
        if not n.endswith(".npy"):
            raise TaskError(f"archive member {n!r} is not a .npy array", file=path, fix="export it again with 'verifier build'")
    dup = sorted({n for n in stripped if stripped.count(n) > 1})
    if dup:
        raise TaskError(f"archive member {dup[0]!r} appears twice (ambiguous)", file=path, fix="export it again with 'verifier build'")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    except ValueError as exc:
        if "pickle" in str(exc):
            raise TaskError("an array holds Python objects (pickled data), which the layout does not allow", file=path,
                            fix="store numbers as float64 and text as unicode string arrays") from None
        raise TaskError(f"not a readable .npz weights file ({exc})".replace("\n", " "), file=path,
                        fix="it may be truncated or corrupt; export it again with 'verifier build'") from None
    except (zipfile.BadZipFile, OSError, EOFError, KeyError) as exc:
        raise TaskError(f"not a readable .npz weights file ({type(exc).__name__}: {exc})".replace("\n", " "), file=path,
                        fix="it may be truncated or corrupt; export it again with 'verifier build'") from None


def load(path: str | os.PathLike) -> Weights:
    """Read a weights file strictly (module docstring); any problem is a one-line TaskError."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise TaskError("is a directory, not a weights file", file=path, fix="give the .npz file written by 'verifier build'")
    r = _Reader(path, _members(path))
    meta = _read_meta(r)
    heads = tuple(Head(r.matrix(f"heads.{m}.W_Q"), r.matrix(f"heads.{m}.W_K"), r.matrix(f"heads.{m}.W_V"), r.matrix(f"heads.{m}.W_O"))
                  for m in range(meta["n_heads"]))
    experts = tuple(Expert(r.matrix(f"experts.{k}.W_1"), r.numbers(f"experts.{k}.b_1"), r.matrix(f"experts.{k}.W_2"))
                    for k in range(meta["n_experts"]))
    weights = Weights(
        vocab=r.strings("vocab"),
        E=r.matrix("E"), P=r.matrix("P"), heads=heads, W_G=r.matrix("W_G"), b_G=r.numbers("b_G"),
        experts=experts, U=r.matrix("U"), expert_tasks=r.strings("expert_tasks"),
        gate_mode=meta["gate_mode"],
        residual_labels=tuple(meta["residual_labels"]) if meta.get("residual_labels") is not None else None,
        neuron_labels=tuple(tuple(x) for x in meta["neuron_labels"]) if meta.get("neuron_labels") is not None else None,
        parameters=dict(meta.get("parameters") or {}),
    )
    r.used.add("meta")
    extra = sorted(set(r.members) - r.used)
    if extra:
        raise r.fail(f"member '{extra[0]}' is not part of the layout (n_heads = {meta['n_heads']}, n_experts = {meta['n_experts']})",
                     fix="remove it, or correct meta.n_heads / meta.n_experts")
    weights.validate(path)
    return weights
