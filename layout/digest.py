"""A name for a model: the SHA-256 of what its forward pass computes with.

``check`` records the digest of the weights it certified (``weights_sha256`` in the JSON
report), and ``export --onnx`` writes the digest of the weights it exported into the
graph's metadata, so a deployed graph can be paired with the certificate that covers it.

What is hashed: the vocabulary, every array of the layout in the order of
:meth:`layout.weights.Weights.arrays`, ``expert_tasks`` and ``gate_mode``; not the labels
or the informational ``parameters`` (they do not change a single output). The encoding is
injective: every field is a tag, then its length, then its bytes (strings as UTF-8 with
lone surrogates kept by ``surrogatepass``); a matrix is its shape, then the canonical
compressed form along its shorter side (CSR when it has at most as many rows as columns,
else CSC: sorted indices, no duplicates, int64 offsets and indices, float64 values, little
endian): the same entries stored as CSR or CSC hash the same; an explicitly stored 0 is an
entry (it changes the digest, though not the outputs).
"""

from __future__ import annotations

import hashlib

import numpy as np
import scipy.sparse as sp

from layout.weights import Weights


def _field(h, tag: bytes, payload: bytes) -> None:
    h.update(tag + len(payload).to_bytes(8, "little") + payload)


def _strings(h, tag: bytes, values) -> None:
    encoded = [v.encode("utf-8", "surrogatepass") for v in values]
    _field(h, tag, len(encoded).to_bytes(8, "little") + b"".join(len(e).to_bytes(8, "little") + e for e in encoded))


def _array(h, name: str, m) -> None:
    _field(h, b"name", name.encode("utf-8"))
    if sp.issparse(m):
        rows, cols = m.shape
        c = m.tocsr() if rows <= cols else m.tocsc()
        if c is m:
            c = c.copy()
        c.sort_indices()
        _field(h, b"shape", np.asarray(m.shape, "<i8").tobytes())
        _field(h, b"ptr", np.asarray(c.indptr, "<i8").tobytes())
        _field(h, b"idx", np.asarray(c.indices, "<i8").tobytes())
        _field(h, b"val", np.asarray(c.data, "<f8").tobytes())
    else:
        v = np.asarray(m, "<f8")
        _field(h, b"vector", v.tobytes())


def weights_digest(weights: Weights) -> str:
    """The hex SHA-256 of ``weights`` (see the module docstring)."""
    h = hashlib.sha256(b"moe-knowledge-weights-digest/1")
    _strings(h, b"vocab", weights.vocab)
    for name, m in weights.arrays():
        _array(h, name, m)
    _strings(h, b"expert_tasks", weights.expert_tasks)
    _field(h, b"gate_mode", weights.gate_mode.encode("utf-8"))
    return h.hexdigest()
