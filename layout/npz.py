"""The weights file: an ``.npz`` archive, read strictly and written atomically.

A zip archive of ``.npy`` members, one per array, each name used once:

* a matrix ``X`` is five members: ``X.format`` (``"csr"``: compressed rows, or ``"csc"``:
  compressed columns), ``X.data`` (float64 values), ``X.indices`` (the integer column,
  for CSR, or row, for CSC, of each value), ``X.indptr`` (integer, one offset per row
  (CSR) or column (CSC) plus one, starting at 0, non-decreasing, ending at the number of
  values) and ``X.shape`` (two integers). **Canonical form is required**: within a row
  (CSR) or column (CSC) the indices strictly increase (sorted, no duplicate entry). A duplicate would be ambiguous (its
  float sum depends on the order) and is refused, never merged. An explicitly stored 0 is the value 0, the same
  as an absent entry. Matrix names: ``E``, ``P``, ``heads.<m>.W_Q|W_K|W_V|W_O`` for
  m = 0..n_heads−1, ``W_G``, ``experts.<k>.W_1|W_2`` for k = 0..n_experts−1, ``U``;
* vectors ``b_G`` and ``experts.<k>.b_1``: float64 arrays;
* ``vocab`` and ``expert_tasks``: unicode string arrays;
* ``meta``: a unicode string holding a JSON object (each key once) with ``format``
  (required, ``"moe-knowledge-weights/2"``; files of version 1, in which every matrix is
  CSR without an ``X.format`` member, are read too), ``n_heads`` (required integer >= 0),
  ``n_experts`` (required integer >= 1), ``gate_mode`` (``"top1"``, the default, or
  ``"top1-scaled"``), and optional ``residual_labels`` (d strings), ``neuron_labels``
  (K lists, list k of w_k strings) and ``parameters`` (an object, informational).

Values must be finite. Numeric members may also be stored as float16/float32 (exact in
float64) or as integers of magnitude at most 2^53; anything else (complex, boolean,
strings, Python objects, float128) is refused. Every other member, key or type is
refused: one line naming the member, the row and column where it applies, and the fix.
"""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
from typing import Any, Iterator

import numpy as np
import scipy.sparse as sp

from layout.weights import GATE_MODES, Expert, Head, Weights, _row_of, sparse_problem
from tasks.errors import TaskError
from tasks.files import atomic_file

FORMAT = "moe-knowledge-weights/2"
#: Formats read: /1 (every matrix CSR, no ``X.format`` member) and /2 (each matrix names its format).
FORMATS = ("moe-knowledge-weights/1", FORMAT)
META_KEYS = ("format", "gate_mode", "n_heads", "n_experts", "residual_labels", "neuron_labels", "parameters")


def _narrowest(values: np.ndarray) -> np.ndarray:
    """``values`` (float64) as float16 or float32 when that holds every one exactly (checked
    by converting back), else as they are: the reader converts them back to the same float64s."""
    for t in (np.float16, np.float32):
        with np.errstate(over="ignore"):
            narrow = values.astype(t)
        if np.array_equal(narrow.astype(np.float64), values):
            return narrow
    return values


def _put(out: dict, name: str, m, index_dtype=np.int64, narrow: bool = False) -> None:
    if sp.issparse(m):
        out[f"{name}.format"] = np.array(m.format)
        data = m.data.astype(np.float64)
        out[f"{name}.data"] = _narrowest(data) if narrow else data
        small = index_dtype == np.int32 and max(m.shape + (m.nnz,)) < 2 ** 31
        out[f"{name}.indices"] = m.indices.astype(np.int32 if small else np.int64)
        out[f"{name}.indptr"] = m.indptr.astype(np.int32 if small else np.int64)
        out[f"{name}.shape"] = np.asarray(m.shape, dtype=np.int64)
    else:
        data = np.asarray(m, dtype=np.float64)
        out[name] = _narrowest(data) if narrow else data


def to_arrays(weights: Weights, small_indices: bool = False, narrow: bool = False,
              validated: bool = False) -> dict[str, np.ndarray]:
    """The file's members, by name (what :func:`save` writes); ``small_indices``: index arrays
    as int32 where they fit (the layout reads any integer type); ``narrow``: values as float16
    or float32 where every value of the array is exact in it (the layout reads those too);
    ``validated``: the caller has just validated these very weights (else they are here)."""
    if not validated:
        weights.validate()
    arrays: dict[str, np.ndarray] = {"vocab": np.array(weights.vocab, dtype=str)}
    for name, m in weights.arrays():
        _put(arrays, name, m, np.int32 if small_indices else np.int64, narrow)
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


def save(weights: Weights, path: str | os.PathLike, small_indices: bool = False, narrow: bool = False,
         validated: bool = False) -> None:
    """Write an ``.npz`` file atomically (a temporary file, then rename); the options as in
    :func:`to_arrays` (smaller files, the same weights read back)."""
    arrays = to_arrays(weights, small_indices, narrow, validated)
    with atomic_file(path) as f:
        np.savez(f, **arrays)


# --- reading a file -------------------------------------------------------------------------------


class _Reader:
    """Typed access to the members of one weights file; every problem is a one-line TaskError."""

    def __init__(self, path: str, members: dict[str, np.ndarray]) -> None:
        self.path = path
        self.members = members
        self.used: set[str] = set()
        self.version = FORMAT
        self.trusted = False       # load(validate=False): the canonical-form check is skipped too

    def fail(self, what: str, fix: str = "export the weights again (layout.save writes the layout)") -> TaskError:
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
                raise self.fail(f"'{name}' holds integers beyond 2^53, not exact in float64",
                                fix="store float64 values")
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
            raise self.fail(f"'{name}' must be a one-dimensional integer array (it has dtype "
                            f"{a.dtype}, shape {a.shape})")
        return a.astype(np.int64)

    def strings(self, name: str) -> tuple[str, ...]:
        a = self.get(name)
        if a.ndim != 1 or a.dtype.kind != "U":
            raise self.fail(f"'{name}' must be a one-dimensional array of unicode strings (it has dtype "
                            f"{a.dtype}, shape {a.shape})")
        out = tuple(a.tolist())
        if _BAD_TEXT.search("\x01".join(out)):            # one scan; then find the entry to name it
            for i, t in enumerate(out):
                problem = text_problem(t)
                if problem:
                    raise self.fail(f"'{name}' entry {i} {problem}", fix="names are text: no NUL, no lone surrogate")
        return out

    def matrix(self, name: str) -> sp.spmatrix:
        fmt = "csr"
        if self.version != "moe-knowledge-weights/1":
            raw = self.get(f"{name}.format")
            if raw.ndim != 0 or raw.dtype.kind != "U" or str(raw) not in ("csr", "csc"):
                raise self.fail(f"'{name}.format' must be the string 'csr' or 'csc'")
            fmt = str(raw)
        shape = self.integers(f"{name}.shape")
        if shape.shape != (2,) or shape.min() < 0:
            raise self.fail(f"'{name}.shape' must be two non-negative integers, got {shape.tolist()}")
        data = self.numbers(f"{name}.data", finite=False)   # sparse_problem names the row and column
        indices = self.integers(f"{name}.indices")
        indptr = self.integers(f"{name}.indptr")
        rows, cols = int(shape[0]), int(shape[1])
        n_major, n_minor = (rows, cols) if fmt == "csr" else (cols, rows)
        major, minor = ("row", "column") if fmt == "csr" else ("column", "row")
        if indptr.shape != (n_major + 1,):
            raise self.fail(f"'{name}.indptr' has {indptr.size} entries for {n_major} {major}s "
                            f"(expected {n_major + 1})")
        if indices.size != data.size:
            raise self.fail(f"'{name}' has {data.size} values but {indices.size} {minor} indices")
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != data.size:
            raise self.fail(f"'{name}.indptr' must start at 0, never decrease and end at {data.size} "
                            "(the number of values)")
        if indices.size and (indices.min() < 0 or indices.max() >= n_minor):
            i = int(np.flatnonzero((indices < 0) | (indices >= n_minor))[0])
            raise self.fail(f"'{name}' {major} {_row_of(indptr, i)}: {minor} {int(indices[i])} is out of range "
                            f"0..{n_minor - 1}")
        make = sp.csr_matrix if fmt == "csr" else sp.csc_matrix
        m = make((data, indices, indptr), shape=(rows, cols))
        if self.trusted:
            return m
        problem = sparse_problem(m)
        if problem:
            raise self.fail(f"'{name}' {problem}", fix="write canonical CSR or CSC (layout.save does)")
        return m


_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")


def text_problem(text: str) -> str | None:
    """Why a string cannot be a name in the file (it would not survive writing or printing), or None."""
    bad = _BAD_TEXT.search(text)
    if bad is None:
        return None
    if bad.group() == "\x00":
        return "contains a NUL character"
    return "contains a lone surrogate (not valid unicode text)"


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


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is beyond float64 (not a finite number)")
    return value


def _texts(value: Any) -> Iterator[str]:
    """Every string in a JSON value (keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _texts(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _texts(v)


#: The metadata keys of a two-layer file (:mod:`layout.layers`), beside :data:`META_KEYS`.
STACK_KEYS = ("layers", "layer2_experts")


def _read_meta(r: _Reader, stack: bool = False) -> dict[str, Any]:
    raw = r.get("meta")
    if raw.ndim != 0 or raw.dtype.kind != "U":
        raise r.fail("'meta' must be one unicode string holding a JSON object (it has dtype "
                     f"{raw.dtype}, shape {raw.shape})")
    try:
        meta = json.loads(str(raw), object_pairs_hook=_json_object, parse_constant=_no_constants,
                          parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise r.fail(f"'meta' is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise r.fail(f"'meta' must be a JSON object, got {type(meta).__name__}")
    for text in _texts(meta):
        problem = text_problem(text)
        if problem:
            raise r.fail(f"a string in 'meta' {problem}", fix="write text without NUL or lone surrogates")
    if not stack and "layers" in meta:
        raise r.fail(f"the file holds a model of {meta['layers']!r} layers, not one",
                     fix="check it against a task set with composed tasks (docs/two-hops.md)")
    unknown = sorted(set(meta) - set(META_KEYS) - set(STACK_KEYS if stack else ()))
    if unknown:
        raise r.fail(f"'meta' has an unknown key {unknown[0]!r} (known: {', '.join(META_KEYS)})")
    if meta.get("format") not in FORMATS:
        raise r.fail(f"unknown weights format {meta.get('format')!r}", fix=f"expected meta.format = {FORMAT!r}")
    r.version = meta["format"]

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
                                    and all(isinstance(x, list)
                                            and all(isinstance(y, str) for y in x) for x in neurons)):
        raise r.fail("meta.neuron_labels must be null or a list of lists of strings")
    params = meta.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise r.fail("meta.parameters must be null or a JSON object")
    return meta


def _members(path: str) -> dict[str, np.ndarray]:
    """The archive's arrays by name, each parsed as a ``.npy`` member (never unpickled).

    The file must be a zip archive (no sniffing: a file that is itself a ``.npy`` is
    refused), every member a ``.npy`` array, every name used once.
    """
    bad = lambda what: TaskError(  # noqa: E731
        what, file=path, fix="it may be truncated or corrupt; export it again with 'verifier build'")
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                raise bad("not a readable .npz weights file (not a zip archive)")
        members: dict[str, np.ndarray] = {}
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            names = [i.filename for i in infos]
            for n in names:
                if not n.endswith(".npy"):
                    raise TaskError(f"archive member {n!r} is not a .npy array", file=path,
                                    fix="export it again with 'verifier build'")
            stripped = [n[:-4] for n in names]
            dup = sorted({n for n in stripped if stripped.count(n) > 1})
            if dup:
                raise TaskError(f"archive member {dup[0]!r} appears twice (ambiguous)", file=path,
                                fix="export it again with 'verifier build'")
            for info, name in zip(infos, stripped):
                with zf.open(info) as f:
                    try:
                        members[name] = np.lib.format.read_array(f, allow_pickle=False)
                    except ValueError as exc:
                        if "pickle" in str(exc):
                            raise TaskError(f"array '{name}' holds Python objects (pickled data), which the layout "
                                            "does not allow", file=path,
                                            fix="store numbers as float64 and text as unicode string arrays") from None
                        raise bad(f"archive member '{name}' is not a readable .npy array ({exc})"
                                  .replace("\n", " ")) from None
        return members
    except TaskError:
        raise
    except FileNotFoundError:
        raise TaskError("weights file not found", file=path, fix="check the path") from None
    except PermissionError:
        raise TaskError("weights file is not readable", file=path, fix="check its permissions") from None
    except MemoryError:
        raise bad("an array of the file does not fit in memory (a corrupt header?)") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, KeyError, RuntimeError,
            NotImplementedError, UnicodeError, OverflowError) as exc:
        raise bad(f"not a readable .npz weights file ({type(exc).__name__}: {exc})".replace("\n", " ")) from None


def load(path: str | os.PathLike, validate: bool = True) -> Weights:
    """Read a weights file strictly (module docstring); any problem is a one-line TaskError.
    ``validate=False`` skips the whole-array checks of the layout's rules (each matrix's
    canonical form, and :meth:`Weights.validate`): only for a file this tool wrote, from
    validated weights, and whose hash was checked (a saved certificate's)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise TaskError("is a directory, not a weights file", file=path,
                        fix="give the .npz file written by 'verifier build'")
    r, meta = _open(path, validate)
    weights = _weights(r, meta)
    r.used.add("meta")
    extra = sorted(set(r.members) - r.used)
    if extra:
        raise r.fail(f"member '{extra[0]}' is not part of the layout (n_heads = {meta['n_heads']}, n_experts = "
                     f"{meta['n_experts']})",
                     fix="remove it, or correct meta.n_heads / meta.n_experts")
    if validate:
        weights.validate(path)
    return weights


def _open(path: str, validate: bool, stack: bool = False) -> tuple[_Reader, dict[str, Any]]:
    """The file's reader and its metadata (``stack``: a two-layer file's keys allowed)."""
    if os.path.isdir(path):
        raise TaskError("is a directory, not a weights file", file=path,
                        fix="give the .npz file written by 'verifier build'")
    r = _Reader(path, _members(path))
    r.trusted = not validate
    return r, _read_meta(r, stack)


def _weights(r: _Reader, meta: dict[str, Any]) -> Weights:
    """The one-layer weights the reader's members hold (not validated)."""
    heads = tuple(Head(r.matrix(f"heads.{m}.W_Q"), r.matrix(f"heads.{m}.W_K"), r.matrix(f"heads.{m}.W_V"),
                       r.matrix(f"heads.{m}.W_O"))
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
    return weights
