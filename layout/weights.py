"""The weight layout as data: the arrays of a single-layer MoE transformer, and their rules.

This package is the contract between whoever makes weights (the construction, a
training run, a user) and whoever checks them (the verifier); it depends on neither.
The forward pass the arrays define, for a prefix x_1..x_n with the beginning-of-sequence
token x_0 = BOS prepended::

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

Matrices are canonical float64 scipy CSR or CSC (sorted indices, no duplicate entries,
finite values; tall matrices such as W_2 and W_O are best stored CSC, whose offsets grow
with their few columns rather than with d); :meth:`Weights.validate` checks every rule, computing canonical form from
the index arrays rather than trusting scipy's flags. The file format is :mod:`layout.npz`.
"""


from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import scipy.sparse as sp

from tasks.errors import TaskError

GATE_MODES = ("top1", "top1-scaled")
_LAYOUT_FIX = "the weights do not follow the documented layout (docs/reference.md, 'Weight layout')"


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


#: The attribute in which a matrix found canonical keeps what was checked (see :func:`sparse_problem`).
_CHECKED = "_moe_checked_canonical"


def _layout(a: np.ndarray) -> tuple:
    """Where and how an array's elements lie: its data pointer, strides, type and shape (an
    array object whose ``strides`` or ``dtype`` is set anew shows other elements)."""
    face = a.__array_interface__
    return face["data"], face["strides"], face["typestr"], face["shape"]


def _checked_before(m: Any) -> bool:
    """Whether ``m`` was found canonical before and cannot have changed since: the same index
    and value arrays (the very objects checked, private copies no other array views),
    laid out as they were, all read-only since the check (a write into them raises), the
    same shape."""
    seen = getattr(m, _CHECKED, None)
    if seen is None:
        return False
    arrays = (m.indptr, m.indices, m.data)
    return (all(a is b for a, b in zip(arrays, seen[:3])) and seen[3] == (m.format, m.shape)
            and all(map(_frozen, arrays)) and tuple(map(_layout, arrays)) == seen[4])


def _frozen(a: Any) -> bool:
    """Whether nothing can write into the memory of the numpy array ``a``: it and every array
    it is a view of are read-only, down to memory an array owns or an immutable ``bytes``
    (a view of a writeable array changes when that array is written)."""
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        a = a.base
    return a is None or isinstance(a, bytes)


def sparse_problem(m: Any) -> str | None:
    """Why ``m`` is not a canonical float64 CSR or CSC matrix with finite values, or None.

    CSR compresses rows (each row lists its columns), CSC columns (each column lists its
    rows); canonical means the listed indices strictly increase within each row (CSR)
    or column (CSC): sorted, no duplicate entry. It is computed from the index arrays,
    never read from scipy's cached flags (which a caller can set to anything).

    **Checked once.** The matrix's three arrays are first replaced by private copies (no
    other array views them); a matrix found canonical has those made read-only and
    remembers them and their layout (data pointer, strides, type, shape); asked again,
    with the same array objects, laid out alike and still read-only, the answer is the
    same without the scan (nothing can have written into them: numpy refuses a write into
    a read-only array, no view of them existed when they were made read-only, and an array
    put in the place of one of them is a different object). A watcher's successive models
    share most of their matrices.
    """
    if not (sp.issparse(m) and m.format in ("csr", "csc")):
        return f"is a {type(m).__name__}, not a scipy CSR or CSC matrix"
    if m.dtype != np.float64:
        return f"has dtype {m.dtype}, not float64"
    if _checked_before(m):
        return None
    arrays = (m.indptr, m.indices, m.data)
    if not all(isinstance(a, np.ndarray) for a in arrays):
        return _scan(m)
    # private copies, scanned and then made read-only: a view of the arrays taken before
    # (writeable, outside any record) would otherwise change what was scanned
    m.indptr, m.indices, m.data = (a.copy() for a in arrays)
    problem = _scan(m)
    if problem is None:
        arrays = (m.indptr, m.indices, m.data)
        for a in arrays:
            a.setflags(write=False)
        setattr(m, _CHECKED, (*arrays, (m.format, m.shape), tuple(map(_layout, arrays))))
    return problem


def _scan(m: Any) -> str | None:
    """:func:`sparse_problem` computed from the arrays."""
    csr = m.format == "csr"
    n_major, n_minor = m.shape if csr else m.shape[::-1]
    major, minor = ("row", "column") if csr else ("column", "row")

    def at(a: int, b: int) -> str:
        return f"row {a}, column {b}" if csr else f"row {b}, column {a}"

    ptr, idx = np.asarray(m.indptr), np.asarray(m.indices)
    if (ptr.shape != (n_major + 1,) or ptr[0] != 0 or np.any(np.diff(ptr) < 0) or ptr[-1] != idx.size
            or m.data.size != idx.size):
        return "has an inconsistent indptr (it must start at 0, never decrease and end at the number of entries)"
    if idx.size:
        if idx.min() < 0 or idx.max() >= n_minor:
            bad = int(np.flatnonzero((idx < 0) | (idx >= n_minor))[0])
            return f"{major} {_row_of(ptr, bad)}: {minor} {int(idx[bad])} is out of range 0..{n_minor - 1}"
        owner = np.repeat(np.arange(n_major, dtype=np.int64), np.diff(ptr))
        same = owner[1:] == owner[:-1]
        step = np.diff(idx.astype(np.int64))
        dup = np.flatnonzero(same & (step == 0))
        if dup.size:
            i = int(dup[0])
            return (f"{at(int(owner[i]), int(idx[i]))} is stored twice (duplicate entries): store each entry once, "
                    "with its exact value")
        unsorted = np.flatnonzero(same & (step < 0))
        if unsorted.size:
            i = int(unsorted[0])
            return (f"{major} {int(owner[i])}: {minor}s are not sorted ({int(idx[i])} before {int(idx[i + 1])}); "
                    f"sort each {major}'s {minor}s")
        bad = np.flatnonzero(~np.isfinite(m.data))
        if bad.size:
            i = int(bad[0])
            return f"{at(int(owner[i]), int(idx[i]))} is {float(m.data[i])!r}, not a finite number"
    return None


csr_problem = sparse_problem   # the name of earlier versions


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


class Released:
    """Where a matrix (or vector) of :meth:`Weights.frame` was: its shape, format and number
    of stored entries, and nothing else. Reading its entries raises, so code that needs them
    fails loudly instead of computing on an empty matrix."""

    __slots__ = ("shape", "format", "nnz")

    def __init__(self, m: Any) -> None:
        self.shape = tuple(m.shape)
        self.format = getattr(m, "format", None)
        self.nnz = int(m.nnz) if sp.issparse(m) else int(np.asarray(m).size)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getattr__(self, name: str):
        raise AttributeError(f"'{name}' of a released weight matrix: the pass keeps tables of its own and "
                             f"not the weights' entries")

    def __array__(self, *args, **kwargs):
        raise TypeError("a released weight matrix has no entries")


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
        """A copy with ``changes``; what was checked or derived of the vocabulary stays known
        when the copy has the same vocabulary tuple (:meth:`_vocab_checked`)."""
        out = replace(self, **changes)
        if out.vocab is self.vocab:
            # (the array: verifier.certificates.incremental.vocab_array)
            for kept in ("_vocab_memo", "_vocab_array"):
                if kept in self.__dict__:
                    object.__setattr__(out, kept, self.__dict__[kept])
        return out

    def frame(self) -> "Weights":
        """These weights without the entries of their matrices and vectors (:class:`Released`
        in their place; ``b_G`` kept): the sizes, the vocabulary, BOS, the gate's biases and
        mode, each expert's width and task. What a pass that has built tables of its own
        still reads; holding it instead of the weights lets the weights' memory go once
        nothing else holds them."""
        gone = Released
        return self.replace(
            E=gone(self.E), P=gone(self.P), W_G=gone(self.W_G), U=gone(self.U),
            heads=tuple(Head(gone(h.W_Q), gone(h.W_K), gone(h.W_V), gone(h.W_O)) for h in self.heads),
            experts=tuple(Expert(gone(e.W_1), gone(e.b_1), gone(e.W_2)) for e in self.experts),
            residual_labels=None, neuron_labels=None)

    def _vocab_checked(self) -> tuple[bool, bool]:
        """(every token a str, no token twice), computed once per vocabulary tuple: a tuple
        cannot change, nor can the strings in it, so the answer for the same object holds."""
        memo = self.__dict__.get("_vocab_memo")
        if memo is None or memo[0] is not self.vocab:
            vocab = self.vocab
            strings = isinstance(vocab, tuple) and _all_strings(vocab)
            memo = (vocab, strings, strings and len(set(vocab)) == len(vocab))
            object.__setattr__(self, "_vocab_memo", memo)
        return memo[1], memo[2]

    def parameter_counts(self) -> dict[str, Any]:
        """Parameters, counted as stored entries (the sparse weights' non-zeros; biases
        count every entry): per expert, shared (everything but the experts) and in total;
        active per query (shared plus the widest expert: a query runs one expert); and
        the dense counts (every entry of every matrix, what a dense model of these
        shapes would hold)."""
        def stored(M) -> int:
            return int(M.nnz) if sp.issparse(M) else int(np.asarray(M).size)

        def dense(M) -> int:
            return int(np.prod(M.shape))

        experts = [stored(e.W_1) + stored(e.b_1) + stored(e.W_2) for e in self.experts]
        shared_arrays = [self.E, self.P, self.W_G, self.b_G, self.U] + [m for h in self.heads
                                                                         for m in (h.W_Q, h.W_K, h.W_V, h.W_O)]
        shared = sum(stored(M) for M in shared_arrays)
        dense_total = sum(dense(M) for M in shared_arrays) + sum(dense(e.W_1) + dense(e.b_1) + dense(e.W_2)
                                                                 for e in self.experts)
        return {"per_expert": experts, "shared": shared, "total": shared + sum(experts),
                "active_per_query": shared + max(experts, default=0), "dense_total": dense_total}

    def token_ids(self, tokens, source: str = "weights") -> np.ndarray:
        """The ids of ``tokens`` (strings) in this vocabulary, matched by exact string.

        Raises :class:`TaskError` naming a missing token (weights built for another set).
        """
        tokens = list(tokens)
        if tuple(tokens) == self.vocab[:len(tokens)] and self._vocab_checked()[1]:
            return np.arange(len(tokens), dtype=np.int64)       # the usual case: the vocabulary in order
        index = {t: i for i, t in enumerate(self.vocab)}
        missing = [t for t in tokens if t not in index]
        if missing:
            raise TaskError(f"the weights' vocabulary lacks {len(missing)} token(s) of the task "
                            f"set, e.g. {missing[0]!r}",
                            file=source, fix="verify weights built for this task set")
        return np.array([index[t] for t in tokens], np.int64)

    def validate(self, source: str = "weights") -> None:
        """Types, canonical storage, finite values, shapes and names agree with the layout.

        Raises :class:`TaskError` naming the array (and the row and column) otherwise.
        """
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise TaskError(what, file=source, fix=_LAYOUT_FIX)

        # every token's type a str type (isinstance, per type rather than per token: a million tokens)
        strings, distinct = self._vocab_checked()
        need(strings, "vocab must be a tuple of strings")
        need(sp.issparse(self.E) and len(self.E.shape) == 2, "E is not a sparse matrix")
        V, d = len(self.vocab), self.d
        K = len(self.experts)
        need(distinct, "vocab has repeated tokens")
        for name, m in self.arrays():
            problem = sparse_problem(m) if name not in ("b_G",) and not name.endswith(".b_1") else None
            if problem:
                need(False, f"{name} {problem}")
        need(self.E.shape == (V + 1, d), f"E has shape {self.E.shape}, expected ({V + 1}, d)")
        need(self.P.shape[1] == d and self.P.shape[0] >= 1, f"P has shape {self.P.shape}, expected (n_pos, {d})")
        for m, h in enumerate(self.heads):
            need(h.W_Q.shape[1] == d and h.W_K.shape == h.W_Q.shape,
                 f"head {m}: W_Q {h.W_Q.shape} / W_K {h.W_K.shape} do not match d={d}")
            need(h.W_V.shape[1] == d and h.W_O.shape == (d, h.W_V.shape[0]),
                 f"head {m}: W_V {h.W_V.shape} / W_O {h.W_O.shape} do not match d={d}")
        problem = mixture_problem(self.W_G, self.b_G, self.experts, d)
        need(problem is None, problem or "")
        need(self.U.shape == (V, d), f"U has shape {self.U.shape}, expected ({V}, {d})")
        need(isinstance(self.expert_tasks, tuple) and all(isinstance(t, str) for t in self.expert_tasks),
             "expert_tasks must be a tuple of strings")
        need(len(self.expert_tasks) == K, f"expert_tasks has {len(self.expert_tasks)} entries for {K} experts")
        need(self.gate_mode in GATE_MODES, f"gate_mode {self.gate_mode!r} is not one of {GATE_MODES}")
        named = [t for t in self.expert_tasks if t]
        dup = sorted({t for t in named if named.count(t) > 1})
        need(not dup, f"expert_tasks names task {dup[0]!r} for several experts; an expert serves one task "
                      "and a task one expert" if dup else "")
        if self.residual_labels is not None:
            need(len(self.residual_labels) == d and _all_strings(self.residual_labels),
                 f"residual_labels has {len(self.residual_labels)} entries for d = {d} (one string "
                 "per residual direction)")
        if self.neuron_labels is not None:
            need(len(self.neuron_labels) == K, f"neuron_labels has {len(self.neuron_labels)} lists for {K} experts")
            for k, (labels, e) in enumerate(zip(self.neuron_labels, self.experts)):
                need(len(labels) == e.width and _all_strings(labels),
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


def mixture_problem(W_G, b_G, experts, d: int, prefix: str = "") -> str | None:
    """The first shape problem of a gate and its experts over a residual of width d (their
    names prefixed by ``prefix``: a second layer's are ``layer2.``), or None."""
    K = len(experts)
    if K < 1:
        return f"{prefix}experts: there are none" if prefix else "there are no experts"
    if W_G.shape != (K, d):
        return f"{prefix}W_G has shape {W_G.shape}, expected ({K}, {d})"
    problem = vector_problem(b_G, K)
    if problem:
        return f"{prefix}b_G {problem}"
    for k, e in enumerate(experts):
        w = e.W_1.shape[0]
        if not (e.W_1.shape == (w, d) and e.W_2.shape == (d, w)):
            return f"{prefix}expert {k}: W_1 {e.W_1.shape}, W_2 {e.W_2.shape} do not fit d={d}"
        problem = vector_problem(e.b_1, w)
        if problem:
            return f"{prefix}experts.{k}.b_1 {problem}"
    return None


def _all_strings(values) -> bool:
    """Whether every value is a str (or of a subclass of str): decided per type, not per
    value (a residual of a million labels has a handful of types)."""
    return all(issubclass(t, str) for t in set(map(type, values)))


def canonical(m: sp.spmatrix) -> sp.csr_matrix:
    """A float64 CSR copy in canonical form, for producers of weights whose matrices are
    already free of duplicates (scipy conversions from dense or COO with unique entries).

    Raises ValueError on duplicate entries rather than summing them in floating point.
    """
    m = sp.csr_matrix(m, dtype=np.float64, copy=True)
    m.has_sorted_indices = False
    m.sort_indices()
    problem = sparse_problem(m)
    if problem and "duplicate" in problem:
        raise ValueError(f"matrix {problem}")
    return m


