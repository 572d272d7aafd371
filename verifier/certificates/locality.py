"""What a change of the weights can reach: the difference of two weight files, and its reach.

An edit replaces certified weights W by new weights W'. Which queries can compute something
different? This module answers from the two weight files alone (the verifier knows
nothing of how W' was made), given a *correspondence* between their numberings: for
tokens, residual coordinates, each head's query/key and value coordinates, experts and
each expert's neurons, the index in W' of each index of W (-1: gone).

:func:`diff` maps W's entries into W''s numbering and compares them entry by entry: an
entry is *changed* if it differs in value, exists on one side only, or lies in a row or
column that exists on one side only. Any injective correspondence gives a sound answer:
whatever it pairs, the entries that agree under it are equal, so a computation that
reads only agreeing entries (and its inputs correspond) gives equal values in W and W'.

**Reach.** A token t *reaches* residual coordinate c if its embedding row E[t] has c, or
some head m has W_O^m[c, v] != 0 and W_V^m[v, c'] != 0 for a coordinate c' of E[t] (the
head's output at any query containing t has c in its support, whatever the attention
weights, which are all positive). A position reaches c likewise through P. The residual of
a query is supported in what its tokens and positions reach. :func:`reaching` finds the
tokens and positions that reach a set of coordinates (backwards through the heads);
:func:`reach_counts` counts, per coordinate, the tokens that reach it (forwards; with
multiplicity, an upper bound).

**Watched neurons.** A neuron whose first-layer row reads a coordinate reached by a
position, or by more than :data:`SPARSE_TOKENS` tokens, may be on almost anywhere: for
those a certificate records, per class of queries, which ones may be on there
(``BatchResult.active``); for the others (a fact neuron reading one subject's coordinate)
the tokens that reach its row say where it may be on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from layout import Weights

#: A neuron read by at most this many tokens (and no position) is located by reach.
SPARSE_TOKENS = 16


def _pattern(m: sp.spmatrix) -> sp.csr_matrix:
    p = sp.csr_matrix(m, dtype=np.float64, copy=True)
    p.data[:] = 1.0
    return p


def reach_counts(w: Weights) -> tuple[np.ndarray, np.ndarray]:
    """Per residual coordinate: how many tokens reach it (an upper bound: paths counted with
    multiplicity), and whether some position does."""
    E, P = _pattern(w.E), _pattern(w.P)
    tok = np.asarray(E.sum(axis=0)).reshape(-1)
    pos = np.asarray(P.sum(axis=0)).reshape(-1) > 0
    for h in w.heads:
        WV, WO = _pattern(h.W_V), _pattern(h.W_O)
        tok = tok + np.asarray((E @ WV.T).sum(axis=0) @ WO.T).reshape(-1)
        pos |= np.asarray((P @ WV.T).sum(axis=0) @ WO.T).reshape(-1) > 0
    return tok, pos


def watched_neurons(w: Weights, counts: tuple[np.ndarray, np.ndarray] | None = None) -> list[np.ndarray]:
    """Per expert, the neurons (bool mask) whose activity a certificate records: those whose
    first-layer row reads a coordinate reached by a position or by more than
    :data:`SPARSE_TOKENS` tokens, and those with a positive bias."""
    tok, pos = counts if counts is not None else reach_counts(w)
    dense_coord = pos | (tok > SPARSE_TOKENS)
    out = []
    for e in w.experts:
        W1 = sp.csr_matrix(e.W_1)
        hit = np.zeros(W1.shape[0], bool)
        if W1.nnz:
            rows = np.repeat(np.arange(W1.shape[0]), np.diff(W1.indptr))
            hit[rows[dense_coord[W1.indices]]] = True
        out.append(hit | (np.asarray(e.b_1) > 0))
    return out


def reaching(w: Weights, coords: np.ndarray) -> tuple[np.ndarray, bool]:
    """(bool mask of the tokens (rows of E, BOS included) that reach a coordinate of the mask
    ``coords``, whether some position does)."""
    coords = np.asarray(coords, bool)
    inputs = coords.copy()                         # coordinates whose presence in an embedding reaches coords
    for h in w.heads:
        WO = sp.csc_matrix(h.W_O)
        values = np.zeros(WO.shape[1], bool)
        if WO.nnz and coords.any():
            cols = np.repeat(np.arange(WO.shape[1]), np.diff(WO.indptr))
            values[cols[coords[WO.indices]]] = True
        if values.any():
            WV = sp.csr_matrix(h.W_V)
            rows = np.repeat(np.arange(WV.shape[0]), np.diff(WV.indptr))
            inputs[WV.indices[values[rows]]] = True
    E, P = sp.csr_matrix(w.E), sp.csr_matrix(w.P)
    tokens = np.zeros(E.shape[0], bool)
    if E.nnz:
        rows = np.repeat(np.arange(E.shape[0]), np.diff(E.indptr))
        tokens[rows[inputs[E.indices]]] = True
    position = bool(P.nnz and inputs[P.indices].any())
    return tokens, position


@dataclass(frozen=True)
class Correspondence:
    """Index in the new weights of each index of the old ones (-1: gone), per space."""

    tokens: np.ndarray                 # rows of E (BOS included) and of U (the first V entries)
    coords: np.ndarray                 # residual coordinates
    qk: tuple[np.ndarray, ...]         # per head: query/key coordinates
    values: tuple[np.ndarray, ...]     # per head: value coordinates
    experts: np.ndarray                # expert indices
    neurons: tuple[np.ndarray, ...]    # per old expert: its neurons in the new expert


@dataclass
class MatrixChange:
    """Changed entries of one matrix: in the new numbering (``rows``, ``cols``), and entries
    of the old one that have no place in the new one (``gone_rows``, ``gone_cols``, old numbering)."""

    name: str
    rows: np.ndarray
    cols: np.ndarray
    gone_rows: np.ndarray
    gone_cols: np.ndarray

    @property
    def count(self) -> int:
        return int(self.rows.size + self.gone_rows.size)


@dataclass
class Diff:
    """Every changed entry of W' against W under a :class:`Correspondence`."""

    matrices: dict[str, MatrixChange] = field(default_factory=dict)
    vectors: dict[str, np.ndarray] = field(default_factory=dict)     # b_G, experts.k.b_1: changed new indices
    new_experts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    gone_experts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    shape_change: str = ""             # why the two files cannot be compared part by part ("" if they can)

    @property
    def changed(self) -> dict[str, int]:
        out = {k: m.count for k, m in self.matrices.items() if m.count}
        out.update({k: int(v.size) for k, v in self.vectors.items() if v.size})
        return out


def _entries(m: sp.spmatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    c = sp.coo_matrix(m)
    return c.row.astype(np.int64), c.col.astype(np.int64), c.data


def _increasing(m: np.ndarray, memo: dict | None = None) -> bool:
    """Whether the map's kept values increase (``memo``: results by array, for one diff's maps)."""
    if memo is not None and id(m) in memo:
        return memo[id(m)][1]
    kept = m[m >= 0]
    out = bool((kept[1:] > kept[:-1]).all())
    if memo is not None:
        memo[id(m)] = (m, out)           # the array is held, so its id is not reused meanwhile
    return out


def _identity(m: np.ndarray, n: int, memo: dict | None = None) -> bool:
    """Whether the map sends each of 0..n-1 to itself (``memo`` as in :func:`_increasing`)."""
    key = ("identity", id(m), n)
    if memo is not None and key in memo:
        return memo[key][1]
    out = m.shape == (n,) and bool(np.array_equal(m, np.arange(n)))
    if memo is not None:
        memo[key] = (m, out)
    return out


def _same(old: sp.spmatrix, new: sp.spmatrix, rmap: np.ndarray, cmap: np.ndarray, memo: dict | None = None) -> bool:
    """True when ``new`` is exactly ``old`` renumbered (a check in one pass, no sorting): both in
    the same compressed format, the maps increasing, every old entry kept, and the renumbered
    pointer, index and value arrays equal. False means only: not shown equal this way."""
    if old.format != new.format or old.format not in ("csr", "csc"):
        return False
    if old is new and _identity(rmap, old.shape[0], memo) and _identity(cmap, old.shape[1], memo):
        return True                      # one matrix, every index mapped to itself
    major, minor = (rmap, cmap) if old.format == "csr" else (cmap, rmap)
    if not (_increasing(major, memo) and _increasing(minor, memo)):
        return False
    if (minor[old.indices] < 0).any() if old.indices.size else False:
        return False
    if not (old.indptr is new.indptr and _identity(major, old.indptr.size - 1, memo)):
        counts = np.diff(old.indptr)
        if (major[counts > 0] < 0).any():
            return False
        n_major = new.indptr.size - 1
        new_counts = np.zeros(n_major, np.int64)
        kept = major >= 0
        new_counts[major[kept]] = counts[kept]
        if not np.array_equal(new_counts, np.diff(new.indptr)):
            return False
    # (one array object is equal to itself: a renumbered matrix shares its values)
    return bool(np.array_equal(minor[old.indices], new.indices) and (old.data is new.data
                                                                     or np.array_equal(old.data, new.data)))


def _keep_majors(m: sp.spmatrix, keep: np.ndarray) -> sp.spmatrix:
    """``m`` with only the entries of the major rows (CSR) or columns (CSC) in ``keep``."""
    counts = np.diff(m.indptr)
    mask = np.repeat(keep, counts)
    ptr = np.zeros(m.indptr.size, np.int64)
    np.cumsum(np.where(keep, counts, 0), out=ptr[1:])
    cls = sp.csr_matrix if m.format == "csr" else sp.csc_matrix
    return cls((m.data[mask], m.indices[mask], ptr), shape=m.shape)


def _differing_majors(old: sp.spmatrix, new: sp.spmatrix, rmap: np.ndarray, cmap: np.ndarray, memo: dict | None = None):
    """(old majors, new majors) that may differ, as bool masks, when the maps are increasing
    and keep every old entry; None otherwise. A major row of the same length whose entries
    renumber to the new ones exactly is equal; any other is returned."""
    if old.format != new.format or old.format not in ("csr", "csc"):
        return None
    major, minor = (rmap, cmap) if old.format == "csr" else (cmap, rmap)
    if not (_increasing(major, memo) and _increasing(minor, memo)):
        return None
    o_counts = np.diff(old.indptr)
    if old.indices.size and (minor[old.indices] < 0).any():
        return None
    if (major[o_counts > 0] < 0).any():
        return None
    n_major = new.indptr.size - 1
    n_counts = np.diff(new.indptr)
    kept = major >= 0
    o_at = np.full(n_major, -1, np.int64)            # new major -> old major
    o_at[major[kept]] = np.flatnonzero(kept)
    mapped_counts = np.where(o_at >= 0, o_counts[np.maximum(o_at, 0)], 0)
    differ = mapped_counts != n_counts
    same_len = np.flatnonzero(~differ & (n_counts > 0))
    if same_len.size:
        # entries of the same-length majors, in order, on both sides
        starts_n = new.indptr[same_len]
        starts_o = old.indptr[o_at[same_len]]
        lens = n_counts[same_len]
        offs = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        en = np.repeat(starts_n, lens) + offs
        eo = np.repeat(starts_o, lens) + offs
        bad = (minor[old.indices[eo]] != new.indices[en]) | (old.data[eo] != new.data[en])
        owner = np.repeat(same_len, lens)
        differ[owner[bad]] = True
    n_sel = differ
    o_sel = np.zeros(o_counts.size, bool)
    o_sel[o_at[differ & (o_at >= 0)]] = True
    return o_sel, n_sel


def _compare(name: str, old: sp.spmatrix, new: sp.spmatrix, rmap: np.ndarray, cmap: np.ndarray,
             memo: dict | None = None) -> MatrixChange:
    """Entries of ``new`` that differ from ``old`` mapped by (rmap, cmap), and old entries with no place."""
    if _same(old, new, rmap, cmap, memo):
        z = np.zeros(0, np.int64)
        return MatrixChange(name, z, z, z, z)
    rows_only = _differing_majors(old, new, rmap, cmap, memo)
    if rows_only is not None:                # compare entry by entry within the differing rows only
        o_sel, n_sel = rows_only
        old, new = _keep_majors(old, o_sel), _keep_majors(new, n_sel)
    r0, c0, v0 = _entries(old)
    nr, nc = new.shape
    r1, c1, v1 = _entries(new)
    mr = rmap[r0] if r0.size else r0
    mc = cmap[c0] if c0.size else c0
    placed = (mr >= 0) & (mc >= 0)
    gone = ~placed
    key0 = mr[placed] * nc + mc[placed]
    val0 = v0[placed]
    key1 = r1 * nc + c1
    o0, o1 = np.argsort(key0, kind="stable"), np.argsort(key1, kind="stable")
    key0, val0, key1, val1 = key0[o0], val0[o0], key1[o1], v1[o1]
    both, i0, i1 = np.intersect1d(key0, key1, assume_unique=True, return_indices=True)
    differ = both[val0[i0] != val1[i1]]
    only_new = np.setdiff1d(key1, both, assume_unique=True)
    only_old = np.setdiff1d(key0, both, assume_unique=True)
    # rows or columns of the new matrix that no old index maps to are new, whatever their entries
    keys = np.concatenate([differ, only_new, only_old])
    rows, cols = keys // nc, keys % nc
    return MatrixChange(name, rows, cols, r0[gone], c0[gone])


def _inverse(m: np.ndarray, size: int) -> np.ndarray:
    inv = np.full(size, -1, np.int64)
    ok = m >= 0
    inv[m[ok]] = np.flatnonzero(ok)
    return inv


def _misfit(old: Weights, new: Weights, cor: Correspondence) -> str:
    """Why the correspondence does not fit the two files ("" if it does): each map must cover
    the old indices and point at new ones, injectively."""
    def bad(m: np.ndarray, n_old: int, n_new: int) -> bool:
        m = np.asarray(m)
        if m.shape != (n_old,) or (m >= n_new).any():
            return True
        hit = m[m >= 0]
        return bool(hit.size) and int(np.bincount(hit, minlength=n_new).max()) > 1
    checks = [("tokens", cor.tokens, old.E.shape[0], new.E.shape[0]), ("coordinates", cor.coords, old.d, new.d),
              ("experts", cor.experts, len(old.experts), len(new.experts))]
    if len(cor.qk) != len(old.heads) or len(cor.values) != len(old.heads) or len(cor.neurons) != len(old.experts):
        return "the correspondence does not fit the weights (heads or experts)"
    for m, (a, b) in enumerate(zip(old.heads, new.heads)):
        checks += [(f"head {m} query/key", cor.qk[m], a.W_Q.shape[0], b.W_Q.shape[0]),
                   (f"head {m} values", cor.values[m], a.W_V.shape[0], b.W_V.shape[0])]
        if a.W_K.shape[0] != a.W_Q.shape[0] or b.W_K.shape[0] != b.W_Q.shape[0]:
            return f"head {m}'s query and key maps differ in height"
    for k, j in enumerate(np.asarray(cor.experts).tolist()):
        if 0 <= j < len(new.experts):
            checks.append((f"expert {k}'s neurons", cor.neurons[k], old.experts[k].width, new.experts[j].width))
    for name, m, n_old, n_new in checks:
        if bad(m, n_old, n_new):
            return f"the correspondence does not fit the weights ({name})"
    if old.bos != len(old.vocab) or cor.tokens[old.bos] != new.bos:
        return "BOS does not correspond to BOS"
    return ""


def diff(old: Weights, new: Weights, cor: Correspondence) -> Diff:
    """Every changed entry (module docstring). Heads and positions must correspond one to
    one (same number of heads, ``P`` of the same shape); otherwise ``shape_change`` says why."""
    out = Diff()
    if len(old.heads) != len(new.heads):
        out.shape_change = f"the number of heads changed ({len(old.heads)} -> {len(new.heads)})"
        return out
    if old.P.shape[0] != new.P.shape[0]:
        out.shape_change = f"the number of positions changed ({old.P.shape[0]} -> {new.P.shape[0]})"
        return out
    if old.gate_mode != new.gate_mode:
        out.shape_change = "the gate mode changed"
        return out
    problem = _misfit(old, new, cor)
    if problem:
        out.shape_change = problem
        return out
    pos = np.arange(old.P.shape[0], dtype=np.int64)
    memo: dict = {}
    M = out.matrices
    M["E"] = _compare("E", old.E, new.E, cor.tokens, cor.coords, memo)
    M["P"] = _compare("P", old.P, new.P, pos, cor.coords, memo)
    for m, (a, b) in enumerate(zip(old.heads, new.heads)):
        M[f"heads.{m}.W_Q"] = _compare(f"heads.{m}.W_Q", a.W_Q, b.W_Q, cor.qk[m], cor.coords, memo)
        M[f"heads.{m}.W_K"] = _compare(f"heads.{m}.W_K", a.W_K, b.W_K, cor.qk[m], cor.coords, memo)
        M[f"heads.{m}.W_V"] = _compare(f"heads.{m}.W_V", a.W_V, b.W_V, cor.values[m], cor.coords, memo)
        M[f"heads.{m}.W_O"] = _compare(f"heads.{m}.W_O", a.W_O, b.W_O, cor.coords, cor.values[m], memo)
    M["W_G"] = _compare("W_G", old.W_G, new.W_G, cor.experts, cor.coords, memo)
    V_old = len(old.vocab)
    M["U"] = _compare("U", old.U, new.U, cor.tokens[:V_old], cor.coords, memo)
    bg = np.full(len(new.experts), np.nan)
    ok = cor.experts >= 0
    bg[cor.experts[ok]] = np.asarray(old.b_G)[ok]
    out.vectors["b_G"] = np.flatnonzero(~(bg == np.asarray(new.b_G)))
    out.new_experts = np.flatnonzero(_inverse(cor.experts, len(new.experts)) < 0)
    out.gone_experts = np.flatnonzero(cor.experts < 0)
    for k_old, k_new in enumerate(cor.experts.tolist()):
        if k_new < 0:
            continue
        a, b, nm = old.experts[k_old], new.experts[k_new], cor.neurons[k_old]
        M[f"experts.{k_new}.W_1"] = _compare(f"experts.{k_new}.W_1", a.W_1, b.W_1, nm, cor.coords, memo)
        M[f"experts.{k_new}.W_2"] = _compare(f"experts.{k_new}.W_2", a.W_2, b.W_2, cor.coords, nm, memo)
        b1 = np.full(b.width, np.nan)
        okn = nm >= 0
        b1[nm[okn]] = np.asarray(a.b_1)[okn]
        out.vectors[f"experts.{k_new}.b_1"] = np.flatnonzero(~(b1 == np.asarray(b.b_1)))
        out.vectors[f"experts.{k_new}.gone"] = np.flatnonzero(~okn)          # old neurons with no place (old ids)
        out.vectors[f"experts.{k_new}.new"] = np.flatnonzero(_inverse(nm, b.width) < 0)
    return out
