"""The two-layer layout: a one-layer model with a second mixture-of-experts layer on top.

A :class:`Stack` is the one-layer :class:`~layout.weights.Weights` (embeddings, the first
layer's heads, gate and experts, the unembedding) and a :class:`MoELayer`, the second
layer, which has a gate and experts and **no attention heads**: it reads the residual at
the query's own position after the first layer. For a prefix, with r the first layer's
residual at the last position (:mod:`layout.weights`)::

    y   = r + c · W_2^{e} ReLU(W_1^{e} r + b_1^{e})          layer 1, e = argmax (W_G r + b_G)
    g'  = W'_G y + b'_G                                      one score per second-layer expert
    e'  = argmax_k g'_k                                      top-1 routing
    y'  = y + W'_2^{e'} ReLU(W'_1^{e'} y + b'_1^{e'})        layer 2 (gate mode "top1": c' = 1)
    p   = softmax(U y')

in exact real arithmetic on the stored values. A second-layer expert may have width 0
(it adds nothing: the queries that need no second hop are routed there). ``expert_tasks``
of the second layer names, per expert, the task whose facts it holds as a second hop
("" for an expert that serves none). Arrays, with d the residual width and K' the number
of second-layer experts:

==========================  ================  ========================================
name                        shape             meaning
==========================  ================  ========================================
layer2.W_G, layer2.b_G      (K', d), (K',)    the second layer's gate
layer2.experts.k.W_1, b_1   (w_k, d), (w_k,)  first layer of its expert k
layer2.experts.k.W_2        (d, w_k)          second layer of its expert k
layer2.expert_tasks         (K',)             the task each expert holds ("" if none)
==========================  ================  ========================================

Matrices follow the rules of :mod:`layout.weights` (canonical float64 CSR or CSC, finite).
A file holds the one-layer members and these (:func:`save`, :func:`load`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import scipy.sparse as sp

from layout.weights import Expert, Weights, mixture_problem, sparse_problem
from tasks.errors import TaskError

#: The meta key that marks a file as a two-layer stack, and its only value.
LAYERS = 2
_FIX = "the weights do not follow the two-layer layout (docs/two-hops.md, 'Layout')"


@dataclass(frozen=True)
class MoELayer:
    """A mixture-of-experts layer without attention heads (the module docstring)."""

    W_G: sp.csr_matrix
    b_G: np.ndarray
    experts: tuple[Expert, ...]
    expert_tasks: tuple[str, ...]

    def arrays(self) -> Iterator[tuple[str, Any]]:
        yield "layer2.W_G", self.W_G
        yield "layer2.b_G", self.b_G
        for k, e in enumerate(self.experts):
            yield f"layer2.experts.{k}.W_1", e.W_1
            yield f"layer2.experts.{k}.b_1", e.b_1
            yield f"layer2.experts.{k}.W_2", e.W_2


@dataclass(frozen=True)
class Stack:
    """Two layers: ``first`` (a one-layer model, its unembedding read after ``second``) and ``second``."""

    first: Weights
    second: MoELayer

    @property
    def d(self) -> int:
        return self.first.d

    @property
    def vocab(self) -> tuple[str, ...]:
        return self.first.vocab

    def validate(self, source: str = "weights") -> None:
        """The first layer's rules (:meth:`Weights.validate`) and the second's: shapes, canonical
        storage, finite values, one name per expert."""
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise TaskError(what, file=source, fix=_FIX)

        self.first.validate(source)
        need(self.first.gate_mode == "top1", f"the first layer's gate_mode is {self.first.gate_mode!r}; a two-layer "
                                             "model routes both layers top-1 unscaled ('top1')")
        s, d = self.second, self.d
        for name, m in s.arrays():
            problem = sparse_problem(m) if not name.endswith("b_G") and not name.endswith(".b_1") else None
            need(problem is None, f"{name} {problem}")
        problem = mixture_problem(s.W_G, s.b_G, s.experts, d, "layer2.")
        need(problem is None, problem or "")
        K = len(s.experts)
        need(isinstance(s.expert_tasks, tuple) and all(isinstance(t, str) for t in s.expert_tasks)
             and len(s.expert_tasks) == K, f"layer2.expert_tasks must be {K} strings")
        named = [t for t in s.expert_tasks if t]
        need(len(named) == len(set(named)), "layer2.expert_tasks names a task for several experts")

    def parameter_counts(self) -> dict[str, Any]:
        """The first layer's counts (:meth:`Weights.parameter_counts`) and the second's experts
        and gate, counted the same way (stored entries)."""
        first = self.first.parameter_counts()
        stored = lambda M: int(M.nnz) if sp.issparse(M) else int(np.asarray(M).size)  # noqa: E731
        second = [stored(e.W_1) + stored(e.b_1) + stored(e.W_2) for e in self.second.experts]
        gate = stored(self.second.W_G) + stored(self.second.b_G)
        return {**first, "second_layer_experts": second, "second_layer_gate": gate,
                "total": first["total"] + gate + sum(second),
                "active_per_query": first["active_per_query"] + gate + max(second, default=0)}


def save(stack: Stack, path: str | os.PathLike) -> None:
    """Write a two-layer ``.npz`` file atomically: the one-layer members, the second layer's,
    and ``layers`` = 2 in the metadata."""
    from layout.npz import _put, to_arrays
    from tasks.files import atomic_file

    stack.validate()
    arrays = to_arrays(stack.first, validated=True)
    meta = json.loads(str(arrays["meta"]))
    meta["layers"] = LAYERS
    meta["layer2_experts"] = len(stack.second.experts)
    arrays["meta"] = np.array(json.dumps(meta, default=str))
    for name, m in stack.second.arrays():
        _put(arrays, name, m, np.int64, False)
    arrays["layer2.expert_tasks"] = np.array(stack.second.expert_tasks, dtype=str)
    with atomic_file(path) as f:
        np.savez(f, **arrays)


def load(path: str | os.PathLike) -> Stack:
    """Read a two-layer file strictly (every rule of :mod:`layout.npz` and this module's);
    any problem is a one-line TaskError."""
    from layout.npz import _open, _weights

    path = os.fspath(path)
    r, meta = _open(path, True, stack=True)
    if meta.get("layers") != LAYERS:
        raise r.fail("the file holds a one-layer model, not two layers",
                     fix="give the two-layer weights written by 'verifier build' for a set with composed tasks")
    n2 = meta.get("layer2_experts")
    if not isinstance(n2, int) or isinstance(n2, bool) or n2 < 1:
        raise r.fail(f"meta.layer2_experts must be an integer >= 1, got {n2!r}")
    first = _weights(r, meta)
    experts = tuple(Expert(r.matrix(f"layer2.experts.{k}.W_1"), r.numbers(f"layer2.experts.{k}.b_1"),
                           r.matrix(f"layer2.experts.{k}.W_2")) for k in range(n2))
    second = MoELayer(r.matrix("layer2.W_G"), r.numbers("layer2.b_G"), experts, r.strings("layer2.expert_tasks"))
    r.used.add("meta")
    extra = sorted(set(r.members) - r.used)
    if extra:
        raise r.fail(f"member '{extra[0]}' is not part of the two-layer layout", fix="remove it")
    stack = Stack(first, second)
    stack.validate(path)
    return stack


def layers_of(path: str | os.PathLike) -> int:
    """1 or 2: how many layers the weights file at ``path`` holds (its metadata says; a file
    that cannot be read is left to the loader to refuse, and counted as 1)."""
    try:
        with np.load(os.fspath(path), allow_pickle=False) as z:
            if "meta" not in z.files:
                return 1
            meta = json.loads(str(z["meta"]))
    except Exception:       # the loader refuses it in one line
        return 1
    return LAYERS if isinstance(meta, dict) and meta.get("layers") == LAYERS else 1
