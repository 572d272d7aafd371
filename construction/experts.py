"""Expert k: template neurons and an associative memory of task k's dictionary.

Built from task k alone (its templates and facts), so building the model without
another task leaves this expert's labelled weights identical.

**Template neuron** for each structure σ = (σ_1..σ_p) that is a proper prefix of a
template of task k and is followed, in some template of k, by a word or by ⋆1::

    z = 2·Σ_{m<=p} slot<m>:σ_m + 2·pos:p − (2p + 1)
    writes 2·next:w for each word w that follows σ in k,
    and    2·next:s for every subject s of k if ⋆1 follows σ.

*Claim* (δ = δ_p < 1/2, heads as in construction.heads). At a prefix of length p
with structure σ the neuron's activation is in [1 − 2pδ, 1]; at every other prefix
it is exactly 0.

*Proof.* Each slot<m>:σ_m <= 1 and pos:p ∈ {0, 1}. Match: every slot<m>:σ_m >= 1−δ,
so z >= 2p(1−δ) + 2 − 2p − 1 = 1 − 2pδ, and z <= 1. Same length, some m with
σ'_m != σ_m: that slot holds only leak (<= δ), so z <= 2(p − 1 + δ) + 2 − 2p − 1 =
2δ − 1 < 0. Other length q: pos:p = 0; if q > p, z <= 2p − 2p − 1 < 0; if q < p,
slots beyond q hold <= δ in total, z <= 2(q + δ) − 2p − 1 < 0. ∎

**Dictionary neuron** for each fact s -> D_k(s)::

    z = 2·subj:s − 1,     writes 1·next:D_k(s).

*Claim.* Wherever the prefix has an entity, its first entity s is the subject: the
neuron of s (if s is a subject of task k) has activation in [1 − 2δ_p, 1] (in
[1 − 2δ_S, 1], δ_S = e^−β, when the prefix holds one entity) and every other dictionary
neuron is 0. Before ⋆1 every dictionary neuron is 0.

*Proof.* By the subject-head claim (construction.heads), subj:s ∈ [1 − δ_p, 1]
(∈ [1 − δ_S, 1] with one entity), so z ∈ [1 − 2δ_p, 1]; every other subj coordinate is at most δ_p < 1/2 (the object,
past ⋆2) or 0, so its neuron has z < 0. Before ⋆1, subj = 0 and z = −1. ∎

So at an object query the subject's neuron writes D_k(s), the valid token; elsewhere at
most that one neuron writes at most 1 on one token (past ⋆2: D_k(s), the object just
read, which is not a valid next token there), and the bound (construction.bound) counts
it as invalid mass.

Width: the template neurons number at most Σ_t (|t| − 2) <= (L − 2)·|T(k)| (a prefix
followed only by ⋆2 needs none, and there is one per template), the dictionary
neurons N_k: width <= L·|T(k)| + N_k, the bound of Theorem 4.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from construction.bases import Prefixed, Space, block
from construction.residual import ENTITY_SYMBOL
from construction.symbolic import ONE, SymMatrix
from tasks.model import SUBJECT, Slot, Task, TaskSet


@dataclass(frozen=True)
class SymExpert:
    task: str
    neurons: Space
    W_1: SymMatrix
    b_1: SymMatrix  # (width, 1)
    W_2: SymMatrix

    @property
    def width(self) -> int:
        return self.neurons.dim


def _symbol(part) -> str:
    return ENTITY_SYMBOL if isinstance(part, Slot) else part


def template_nodes(task: Task) -> list[tuple[tuple[str, ...], list[str], bool]]:
    """(structure σ as slot labels, words following σ, ⋆1 follows σ) for task k's neurons.

    One entry per distinct proper prefix σ of a template of k that is followed by a word
    or by ⋆1 in some template of k; in first-seen order.
    """
    follow: dict[tuple[str, ...], tuple[list[str], list[bool]]] = {}
    for t in task.templates:
        parts = t.parts
        for p in range(1, len(parts)):
            sigma = tuple(_symbol(x) for x in parts[:p])
            words, subj = follow.setdefault(sigma, ([], [False]))
            nxt = parts[p]
            if isinstance(nxt, str):
                if nxt not in words:
                    words.append(nxt)
            elif nxt is SUBJECT:
                subj[0] = True
    return [(sigma, words, subj[0]) for sigma, (words, subj) in follow.items() if words or subj[0]]


class EntityNames(Sequence):
    """``entities[i]`` for i in ``ids``: names read through the vocabulary, not copied."""

    def __init__(self, entities: Sequence[str], ids: np.ndarray) -> None:
        self.entities, self.ids = entities, ids

    def __len__(self) -> int:
        return int(self.ids.size)

    def __getitem__(self, i):
        return self.entities[int(self.ids[i])]

    def __iter__(self):
        return map(self.entities.__getitem__, self.ids.tolist())


@dataclass(frozen=True)
class ExpertEntries:
    """Expert k's weights as :func:`expert_entries` lists them, before they are matrices:
    each matrix a (row, column, value) triple of arrays, W_1 by rows (a row's columns
    increasing), b_1 by neuron, W_2 by columns (a column's rows increasing), the order of
    the matrices :func:`build_expert` makes of them (:meth:`expert`)."""
    task: str
    neurons: Space
    residual: Space
    W_1: tuple[np.ndarray, np.ndarray, np.ndarray]
    b_1: tuple[np.ndarray, np.ndarray, np.ndarray]
    W_2: tuple[np.ndarray, np.ndarray, np.ndarray]

    def expert(self) -> SymExpert:
        bias = Space.of(block("bias"))
        return SymExpert(self.task, self.neurons, SymMatrix.build(self.neurons, self.residual, self.W_1),
                         SymMatrix.build(self.neurons, bias, self.b_1),
                         SymMatrix.build(self.residual, self.neurons, self.W_2))


def build_expert(taskset: TaskSet, k: int, residual: Space) -> SymExpert:
    return expert_entries(taskset, k, residual).expert()


def expert_entries(taskset: TaskSet, k: int, residual: Space) -> ExpertEntries:
    task = taskset.tasks[k]
    vocab = taskset.vocabulary
    nodes = template_nodes(task)
    subj_ids, obj_ids = (np.asarray(a, np.int64) for a in taskset.fact_ids[k])
    n_t, n_d = len(nodes), int(subj_ids.size)
    W = vocab.n_words
    subjects = EntityNames(vocab.entities, subj_ids - W)
    labels = Prefixed(tuple(f"template:{' '.join(sigma)}" for sigma, _, _ in nodes), "fact:", subjects)
    neurons = Space.of(block("neuron", labels))

    r1, c1, b = [], [], []
    r2, c2 = [], []                     # W_2's word entries since the last piece, as ints
    pieces = []                         # W_2 in pieces (rows, columns): one at each node ⋆1 follows
    next_off = residual.offset("next")
    # Entries are listed in the matrices' own order (a row's or column's indices
    # increasing), so SymMatrix.build takes them as they are: pos comes before the slot
    # blocks in the residual, and words before entities among the tokens. Every template
    # entry of W_1 and W_2 is 2, every fact entry of W_1 is 2 and of W_2 is 1.
    for n, (sigma, words, subj_follows) in enumerate(nodes):
        p = len(sigma)
        r1.append(n)
        c1.append(residual.index("pos", p))
        for m, sym in enumerate(sigma, start=1):
            r1.append(n)
            c1.append(residual.index(f"slot{m}", sym))
        b.append(-(2.0 * p + 1.0))
        # "next" is labelled by the vocabulary's tokens in id order
        nxt = sorted(next_off + vocab.id(w) for w in words)
        r2 += nxt
        c2 += [n] * len(nxt)
        if subj_follows:
            pieces += [(np.asarray(r2, np.int64), np.asarray(c2, np.int64)),
                       (next_off + subj_ids, np.full(n_d, n, np.int64))]
            r2, c2 = [], []
    pieces.append((np.asarray(r2, np.int64), np.asarray(c2, np.int64)))
    n_template = sum(r.size for r, _ in pieces)

    rows = np.arange(n_t, n_t + n_d)
    W_1 = (np.concatenate([np.asarray(r1, np.int64), rows]),
           np.concatenate([np.asarray(c1, np.int64), residual.offset("subj") + (subj_ids - W)]),
           np.full(len(r1) + n_d, 2.0))
    b_1 = (np.arange(n_t + n_d), np.zeros(n_t + n_d, np.int64),
           np.concatenate([np.asarray(b, np.float64), np.full(n_d, -1.0)]))
    W_2 = (np.concatenate([r for r, _ in pieces] + [next_off + obj_ids]),
           np.concatenate([c for _, c in pieces] + [rows]),
           np.concatenate([np.full(n_template, 2.0), np.ones(n_d)]))
    return ExpertEntries(task.name, neurons, residual, W_1, b_1, W_2)


def labelled_entries(expert: SymExpert) -> dict[tuple[str, str, str], str]:
    """Every nonzero weight of an expert keyed by (matrix, row label, column label).

    Labels, not indices, so experts of different task sets can be compared.
    """
    out: dict[tuple[str, str, str], str] = {}
    for name, m in (("W_1", expert.W_1), ("b_1", expert.b_1), ("W_2", expert.W_2)):
        for i, j, expr in m.nonzeros():
            out[(name, m.rows.label(i), m.cols.label(j))] = str(expr)
    return out


def column_map(src: Space, dst: Space) -> np.ndarray:
    """For each coordinate of ``src``, the coordinate of the same label in ``dst`` (-1: none).

    Uses each destination block's cached label index (or, for a block of sorted names,
    its cached array, searched), so mapping many spaces into one full space builds that
    index once. Blocks labelled by the same sequences on both sides (the residual's blocks
    of entity names share the vocabulary's tuple) are matched once.
    """
    out = np.full(src.dim, -1, np.int64)
    seen: dict[tuple[int, int], np.ndarray] = {}       # the label objects are alive for the whole call
    for blk, off in zip(src.blocks, src.offsets):
        if dst.has_block(blk.name):
            other = dst.block(blk.name)
            key = (id(blk.labels), id(other.labels))
            pos = seen.get(key)
            if pos is None:
                pos = seen[key] = other.positions(blk.labels)
            out[off: off + len(blk)] = np.where(pos >= 0, pos + dst.offset(blk.name), -1)
    return out


def alone_column_map(taskset: TaskSet, k: int, alone: TaskSet, src: Space, dst: Space) -> np.ndarray:
    """:func:`column_map` from ``src`` (the residual of ``alone = taskset.alone(k)``) to ``dst``
    (the residual of ``taskset``): :func:`subset_column_map` with task k's entities."""
    return subset_column_map(taskset, alone, taskset.entity_rows([k]), src, dst)


def subset_column_map(taskset: TaskSet, part: TaskSet, rows: np.ndarray, src: Space, dst: Space) -> np.ndarray:
    """:func:`column_map` from ``src`` (the residual of ``part``, made from ``taskset``'s
    arrays by :meth:`TaskSet.alone` or :meth:`TaskSet.without`) to ``dst`` (the residual of
    ``taskset``), without searching names. ``rows``: the rows in ``taskset``'s entities of
    ``part``'s entities, in order (both sorted: part's entity i is taskset's entity
    ``rows[i]``, as those methods make it). A block labelled by part's entities (or tokens)
    maps each to its row in ``taskset``, known as an integer; other blocks (a few words,
    positions, symbols) are mapped by :meth:`Block.positions`, as in :func:`column_map`."""
    W = taskset.vocabulary.n_words
    words = part.vocabulary.words
    out = np.full(src.dim, -1, np.int64)
    for blk, off in zip(src.blocks, src.offsets):
        if not dst.has_block(blk.name):
            continue
        other = dst.block(blk.name)
        if blk.labels is part.vocabulary.entities and other.labels is taskset.vocabulary.entities:
            pos = rows
        elif blk.labels is part.vocabulary.tokens and other.labels is taskset.vocabulary.tokens:
            found = [taskset.vocabulary.find(w) for w in words]           # words come first among tokens
            word_pos = np.array([-1 if i is None or i >= W else i for i in found], np.int64)
            pos = np.concatenate([word_pos, W + rows])
        else:
            pos = other.positions(blk.labels)
        out[off: off + len(blk)] = np.where(pos >= 0, pos + dst.offset(blk.name), -1)
    return out


def _canonical(m, rows: np.ndarray | None, cols: np.ndarray | None):
    coo = m.tocoo()
    r = coo.row.astype(np.int64) if rows is None else rows[coo.row]
    c = coo.col.astype(np.int64) if cols is None else cols[coo.col]
    order = np.lexsort((c, r))
    return r[order], c[order], coo.data[order]


def _same_neurons(a: SymExpert | ExpertEntries, b: SymExpert, to_b: np.ndarray | None) -> bool:
    """Whether the two experts' neurons have the same labels, in order.

    Fast where both are labelled as :func:`build_expert` labels them (template labels, then
    ``fact:<subject>`` read through the vocabulary's entities) and ``to_b`` maps a's
    residual to b's: a fact neuron's subject is also the label of a coordinate of the
    residual's ``subj`` block (a block of the same entity sequence), so two subjects are the
    same name exactly when ``to_b`` takes a's coordinate to b's (``to_b`` pairs coordinates
    of equal labels, and a block's labels are distinct). Else label by label."""
    la, lb = a.neurons.blocks[0].labels, b.neurons.blocks[0].labels
    ra = a.residual if isinstance(a, ExpertEntries) else a.W_1.cols
    rb = b.W_1.cols
    fast = (to_b is not None and isinstance(la, Prefixed) and isinstance(lb, Prefixed)
            and isinstance(la.items, EntityNames) and isinstance(lb.items, EntityNames)
            and ra.has_block("subj") and rb.has_block("subj")
            and la.items.entities is ra.block("subj").labels
            and lb.items.entities is rb.block("subj").labels)
    if not fast:
        return la == lb
    if la.prefix != lb.prefix or tuple(la.head) != tuple(lb.head) or len(la.items) != len(lb.items):
        return False
    mapped = to_b[ra.offset("subj") + np.asarray(la.items.ids, np.int64)]
    return bool(np.array_equal(mapped, rb.offset("subj") + np.asarray(lb.items.ids, np.int64)))


def _sorted_minor(indptr: np.ndarray, indices: np.ndarray) -> bool:
    """Whether every row (CSR) or column (CSC) lists strictly increasing minor indices."""
    if indices.size < 2:
        return True
    starts = np.zeros(indices.size, bool)
    starts[indptr[:-1][np.diff(indptr) > 0]] = True
    return bool(np.all((np.diff(indices) > 0) | starts[1:]))


def _same_matrix(xa, xb, rows: np.ndarray | None, cols: np.ndarray | None) -> bool:
    """Whether ``xa`` with its rows and columns mapped (``rows``, ``cols``: a's index -> b's,
    None: the same) has exactly the entries of ``xb``.

    Fast where the map applies to the minor index of a compressed format both share (W_1
    by rows with its columns mapped, W_2 by columns with its rows mapped) and both list
    their minor indices strictly increasing (after the map, for a): the two matrices then
    hold the same entries exactly when their pointers, their (mapped) minor indices and
    their values are equal array for array, as both lists are the entries in one order
    (by major, then minor index), without duplicates. Else by sorting the entries
    (:func:`_canonical`)."""
    fmt = xa.format
    minor, major = (cols, rows) if fmt == "csr" else (rows, cols)
    if fmt in ("csr", "csc") and xb.format == fmt and major is None:
        if not np.array_equal(xa.indptr, xb.indptr):
            return False
        mapped = xa.indices.astype(np.int64) if minor is None else minor[xa.indices]
        if (mapped < 0).any():
            return False
        if _sorted_minor(xa.indptr, mapped) and _sorted_minor(xb.indptr, xb.indices):
            return bool(np.array_equal(mapped, xb.indices) and np.array_equal(xa.data, xb.data))
    ra, ka, va = _canonical(xa, rows, cols)
    rb, kb, vb = _canonical(xb, None, None)
    if (ra < 0).any() or (ka < 0).any():
        return False
    return bool(np.array_equal(ra, rb) and np.array_equal(ka, kb) and np.array_equal(va, vb))


def same_expert(a: SymExpert, b: SymExpert, to_b: np.ndarray | None = None) -> bool:
    """Exactly the same labelled weights (labels compared, not indices); vectorised.

    Equivalent to ``labelled_entries(a) == labelled_entries(b)`` for this construction's
    experts, but linear-time in numpy. ``to_b`` is ``column_map`` from a's residual space
    to b's, if already computed (it must pair exactly the coordinates of equal labels).
    """
    if to_b is None:
        to_b = column_map(a.W_1.cols, b.W_1.cols)
    if a.task != b.task or not _same_neurons(a, b, to_b):
        return False
    for ma, mb, rows, cols in ((a.W_1, b.W_1, None, to_b), (a.b_1, b.b_1, None, None), (a.W_2, b.W_2, to_b, None)):
        if len(ma.terms) != len(mb.terms):
            return False
        for (ca, xa), (cb, xb) in zip(ma.terms, mb.terms):
            if ca != cb:
                return False
            if not _same_matrix(xa, xb, rows, cols):
                return False
    return True


def _listed_as(entries: tuple[np.ndarray, np.ndarray, np.ndarray], m: SymMatrix, rows: np.ndarray | None,
               cols: np.ndarray | None) -> bool:
    """Whether ``SymMatrix.build(m.rows', m.cols', entries)`` (rows and columns mapped by
    ``rows``, ``cols``: index -> m's, None: the same) would be ``m``, decided from the
    entries as listed: True only where ``m`` is one matrix with coefficient 1 and the
    entries, none zero, are its stored entries one for one, in its storage order (by
    major index, then as stored), with the major index unmapped. Then the two are the same
    matrix: each is the sum of the same entries (a map pairs distinct coordinates with
    distinct coordinates), and build keeps entries listed in order as they are. False
    says nothing (the entries may be listed in another order)."""
    if len(m.terms) != 1 or m.terms[0][0] != ONE:
        return False
    x = m.terms[0][1]
    r, c, v = entries
    if x.format == "csr":
        major, minor, major_map, minor_map = r, c, rows, cols
    elif x.format == "csc":
        major, minor, major_map, minor_map = c, r, cols, rows
    else:
        return False
    if major_map is not None or v.size != x.indices.size or x.indptr[-1] != v.size or not np.all(v != 0):
        return False
    mapped = minor if minor_map is None else minor_map[minor]
    stored_major = np.repeat(np.arange(x.indptr.size - 1), np.diff(x.indptr))
    return bool(np.array_equal(major, stored_major) and np.array_equal(mapped, x.indices)
                and np.array_equal(v, x.data))


def same_as_built(a: ExpertEntries, b: SymExpert, to_b: np.ndarray | None = None) -> bool:
    """``same_expert(a.expert(), b, to_b)``, without making a's matrices where its entries
    are listed as b stores them (:func:`_listed_as`; the case of an unchanged expert, as
    :func:`expert_entries` lists entries in storage order); else by making them."""
    if to_b is None:
        to_b = column_map(a.residual, b.W_1.cols)
    if (a.task == b.task and _same_neurons(a, b, to_b) and _listed_as(a.W_1, b.W_1, None, to_b)
            and _listed_as(a.b_1, b.b_1, None, None) and _listed_as(a.W_2, b.W_2, to_b, None)):
        return True
    return same_expert(a.expert(), b, to_b)
