"""The symbolic weights as a reader sees them: named blocks, labelled entries, patterns.

Every matrix of the construction is a :class:`~construction.symbolic.SymMatrix` whose
rows and columns are labelled spaces, so each nonzero weight reads as::

    row label ← column label : expression in β, γ

(``y = W x``: the entry carries the column direction of the input into the row
direction of the output; for ``E``, ``P`` and ``U`` the rows are tokens or positions
and a row is the vector of that token.)

A block of a million facts has millions of entries but only a handful of *patterns*:
entries with the same row block, column block and expression, and the same relation
between their labels — ``subj:Paris ← id:Paris`` and ``subj:Rome ← id:Rome`` are one
pattern ``subj:<x> ← id:<x>`` (same label on both sides), ``next:Paris ←
neuron:fact:France`` is one of the pattern ``next:<*> ← neuron:<*>``. :func:`patterns`
groups them with a few vectorised passes (sort and unique over integer keys), so the
grouping costs a few seconds at a million entries and nothing at example size.

Names of the blocks (:func:`named_blocks`): ``E``, ``P``, ``U``; ``<head>.W_Q``,
``<head>.W_K``, ``<head>.W_V``, ``<head>.W_O`` for the heads ``structure1`` …
``structure<L-1>`` and ``subject``; ``gate.W_G`` and ``gate.b_G``; and
``expert:<task>.W_1``, ``expert:<task>.b_1``, ``expert:<task>.W_2``. A selection
(:func:`select`) is a full name, a group (``structure1``, ``gate``,
``expert:capital``) or a matrix name across groups (``W_Q``, ``W_1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np
import sympy

from construction.bases import Prefixed, Space
from construction.params import BY_NAME
from construction.symbolic import SymMatrix, rational
from tasks.errors import TaskError

#: A pattern with at most this many entries is listed entry by entry (no placeholder).
LIST_UP_TO = 8
#: Blocks of at most this many directions (``score``, ``bias``, the experts of a few
#: tasks) are never hidden behind a placeholder: their label splits patterns.
SPLIT_UP_TO = 8


@dataclass(frozen=True)
class NamedBlock:
    """One matrix of the model under its public name; ``task`` is the task index of an
    expert's matrix, or ``None``; ``task_rows`` says that rows are indexed by task (the gate)."""

    name: str
    matrix: SymMatrix
    task: int | None = None
    task_rows: bool = False

    @property
    def group(self) -> str:
        return self.name.rsplit(".", 1)[0] if "." in self.name else self.name

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def named_blocks(model) -> tuple[NamedBlock, ...]:
    """Every matrix of a :class:`construction.model.SymbolicModel`, in forward order."""
    out = [NamedBlock("E", model.E), NamedBlock("P", model.P)]
    for h in model.heads:
        for part in ("W_Q", "W_K", "W_V", "W_O"):
            out.append(NamedBlock(f"{h.name}.{part}", getattr(h, part)))
    out.append(NamedBlock("gate.W_G", model.gate.W_G, task_rows=True))
    out.append(NamedBlock("gate.b_G", model.gate.b_G, task_rows=True))
    for k, e in enumerate(model.experts):
        for part in ("W_1", "b_1", "W_2"):
            out.append(NamedBlock(f"expert:{e.task}.{part}", getattr(e, part), task=k))
    out.append(NamedBlock("U", model.U))
    return tuple(out)


def select(blocks: Sequence[NamedBlock], name: str, task: int | None = None) -> list[NamedBlock]:
    """The blocks called ``name`` (full name, group or matrix name), restricted to one
    task's expert when ``task`` is given; a :class:`TaskError` listing the names if none."""
    chosen = list(blocks) if name == "all" else [b for b in blocks if name in (b.name, b.group, b.short)]
    if not chosen:
        groups = sorted({b.group for b in blocks if b.task is None} | {"expert:<task>"})
        raise TaskError(f"no block called '{name}'",
                        fix=f"give one of {', '.join(groups)}, a matrix name such as W_Q or W_1, or a full name "
                            f"such as structure1.W_Q (python -m verifier inspect TASKS --block all lists every block)")
    if task is not None:
        chosen = [b for b in chosen if b.task is None or b.task == task]
    return chosen


def parse_values(text: str | None,
                 default: Mapping[sympy.Symbol, sympy.Rational]) -> dict[sympy.Symbol, sympy.Rational] | None:
    """``beta=4,gamma=1/2`` as exact rationals (``None`` for no substitution); a name left
    out takes its value from ``default`` (the model's)."""
    if text is None:
        return None
    out = dict(default)
    for item in (t for t in text.split(",") if t.strip()):
        key, sep, value = item.partition("=")
        key = key.strip().lower().replace("β", "beta").replace("γ", "gamma")
        if not sep or key not in BY_NAME:
            raise TaskError(f"--at '{item.strip()}' is not NAME=VALUE for a parameter",
                            fix=f"write e.g. --at beta=4,gamma=2 (parameters: {', '.join(BY_NAME)})")
        try:
            number = Fraction(value.strip())       # NaN and infinities are no fraction: refused here
        except (ValueError, ZeroDivisionError):
            raise TaskError(f"--at {key}={value.strip()} is not a (finite) number",
                            fix="write a decimal or a fraction, e.g. 4, 2.5 or 9/2") from None
        if number <= 0:
            raise TaskError(f"--at {key}={value.strip()} is not positive",
                            fix=f"{key} is a positive number, e.g. --at {key}=4")
        out[BY_NAME[key]] = sympy.Rational(number)
    return out


@dataclass(frozen=True)
class Pattern:
    """Entries of one block sharing row block, column block, expression and label relation.

    ``same`` means every entry's row label equals its column label (``subj:<x> ← id:<x>``);
    ``rows`` and ``cols`` are the entries' coordinates, in row-major order."""

    row_block: str
    col_block: str
    same: bool
    expr: sympy.Expr
    rows: np.ndarray
    cols: np.ndarray

    @property
    def count(self) -> int:
        return int(self.rows.size)


@dataclass(frozen=True)
class Listing:
    """One block's nonzero entries grouped into patterns; ``values`` the substitution shown."""

    block: NamedBlock
    patterns: tuple[Pattern, ...]
    values: dict | None
    rows_only: tuple[str, ...] = ()   # labels of the rows kept, when restricted

    @property
    def matrix(self) -> SymMatrix:
        return self.block.matrix

    @property
    def nnz(self) -> int:
        return sum(p.count for p in self.patterns)

    def row_label(self, i: int) -> str:
        return self.matrix.rows.label(int(i))

    def col_label(self, j: int) -> str:
        return self.matrix.cols.label(int(j))

    def show(self, expr: sympy.Expr) -> sympy.Expr:
        """The expression as printed: symbolic, or substituted (exact) under ``--at``."""
        return sympy.nsimplify(expr.subs(self.values)) if self.values else expr

    def placeholder(self, p: Pattern) -> tuple[str, str]:
        """The pattern's row and column as text: the labels themselves for one entry,
        ``name:<x>`` for a label shared by both sides, ``name:<*>`` for any label."""
        if p.count == 1:
            return self.row_label(p.rows[0]), self.col_label(p.cols[0])
        return (_placeholder(self.matrix.rows, p.rows, p.row_block, p.same),
                _placeholder(self.matrix.cols, p.cols, p.col_block, p.same))


def _placeholder(space: Space, idx: np.ndarray, name: str, same: bool) -> str:
    """``name:<x>`` (the item both sides share), ``name:<*>`` (any), or the one label all
    entries have; a :class:`Prefixed` block keeps its kind (``neuron:fact:<x>``)."""
    if np.all(idx == idx[0]):
        return space.label(int(idx[0]))
    labels = space.block(name).labels
    kind = ""
    if isinstance(labels, Prefixed):
        pos = int(idx[0]) - space.offset(name)
        kind = labels.prefix if pos >= len(labels.head) else labels.head[pos].split(":", 1)[0] + ":"
    return f"{name}:{kind}<x>" if same else f"{name}:{kind}<*>"


def _entries(m: SymMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, cols, per-term values (n, T)) of every structurally nonzero entry."""
    parts = []
    for t, (_, mat) in enumerate(m.terms):
        coo = mat.tocoo()
        parts.append((coo.row.astype(np.int64), coo.col.astype(np.int64), np.full(coo.nnz, t), coo.data))
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0))
    r, c, t, v = (np.concatenate(x) for x in zip(*parts))
    lin = r * max(m.cols.dim, 1) + c
    keys, inv = np.unique(lin, return_inverse=True)
    values = np.zeros((keys.size, len(m.terms)))
    np.add.at(values, (inv, t), v)
    return keys // max(m.cols.dim, 1), keys % max(m.cols.dim, 1), values


def _block_of(space: Space, idx: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(space.offsets), idx, side="right") - 1


def _item(labels, i: int):
    """The label at position ``i`` without a :class:`Prefixed` block's kind prefix."""
    if isinstance(labels, Prefixed) and i >= len(labels.head):
        return labels.items[i - len(labels.head)]
    return labels[i]


def _kinds(space: Space, b: int, pos: np.ndarray) -> np.ndarray:
    """A kind id per position: a :class:`Prefixed` block's head labels (kind 0) and its
    prefixed items (kind 1) are kept apart (``neuron:template:…`` and ``neuron:fact:…``);
    other blocks have one kind."""
    labels = space.blocks[b].labels
    if isinstance(labels, Prefixed):
        return (pos >= len(labels.head)).astype(np.int64)
    return np.zeros(pos.size, np.int64)


def _same_labels(rows: Space, cols: Space, rb: int, cb: int, rp: np.ndarray, cp: np.ndarray) -> np.ndarray:
    """Whether row label ``rp`` of block ``rb`` names the same item as column label ``cp``
    of block ``cb`` (``neuron:fact:Paris`` and ``subj:Paris`` do)."""
    a, b = rows.blocks[rb], cols.blocks[cb]
    if len(a) == 1 or len(b) == 1:
        return np.zeros(rp.size, bool)
    if a.labels is b.labels or (not isinstance(a.labels, Prefixed) and not isinstance(b.labels, Prefixed)
                                and len(a) == len(b) and a.labels == b.labels):
        return rp == cp
    # general case: compare the items at the positions present (each distinct one once)
    ur, inv_r = np.unique(rp, return_inverse=True)
    uc, inv_c = np.unique(cp, return_inverse=True)
    left = [_item(a.labels, int(i)) for i in ur]
    right = {int(j): _item(b.labels, int(j)) for j in uc}
    lookup = {}
    for j, item in right.items():
        lookup.setdefault(item, j)
    to_col = np.asarray([lookup.get(x, -1) for x in left], dtype=np.int64)
    out = to_col[np.asarray(inv_r).reshape(-1)] == cp
    # an item present twice among the columns: compare label by label there
    if len(lookup) < len(right):
        out = np.asarray([_item(a.labels, int(i)) == right[int(j)] for i, j in zip(rp, cp)], bool)
    return out


def patterns(block: NamedBlock, rows_only: Sequence[int] | None = None, values: dict | None = None) -> Listing:
    """Group the block's nonzero entries (``rows_only``: keep these rows) into patterns.

    The expression of an entry is ``Σ_t c_t · v_t`` over the matrix's terms; entries whose
    expression is exactly 0 (terms that cancel) are not listed.
    """
    m = block.matrix
    r, c, vals = _entries(m)
    if rows_only is not None:
        keep = np.isin(r, np.asarray(rows_only, np.int64))
        r, c, vals = r[keep], c[keep], vals[keep]
    rb, cb = _block_of(m.rows, r), _block_of(m.cols, c)
    rp = r - np.asarray(m.rows.offsets, np.int64)[rb] if r.size else r
    cp = c - np.asarray(m.cols.offsets, np.int64)[cb] if c.size else c
    same = np.zeros(r.size, bool)
    pair = rb * len(m.cols.blocks) + cb
    for key in np.unique(pair):
        sel = pair == key
        same[sel] = _same_labels(m.rows, m.cols, int(key // len(m.cols.blocks)),
                                 int(key % len(m.cols.blocks)), rp[sel], cp[sel])
    _, value_id = np.unique(vals, axis=0, return_inverse=True) if vals.size else (None, np.zeros(0, np.int64))
    value_id = np.asarray(value_id).reshape(-1)
    kind_r = np.zeros(r.size, np.int64)
    kind_c = np.zeros(c.size, np.int64)
    for b in np.unique(rb):
        kind_r[rb == b] = _kinds(m.rows, int(b), rp[rb == b])
    for b in np.unique(cb):
        kind_c[cb == b] = _kinds(m.cols, int(b), cp[cb == b])
    small_r = np.asarray([len(b) <= SPLIT_UP_TO for b in m.rows.blocks])[rb] if r.size else np.zeros(0, bool)
    small_c = np.asarray([len(b) <= SPLIT_UP_TO for b in m.cols.blocks])[cb] if c.size else np.zeros(0, bool)
    keys = np.stack([rb, cb, same.astype(np.int64), value_id, np.where(small_r, rp, -1), np.where(small_c, cp, -1),
                     kind_r, kind_c], axis=1) if r.size else np.zeros((0, 8), np.int64)
    uniq, group = np.unique(keys, axis=0, return_inverse=True)
    group = np.asarray(group).reshape(-1)
    order = np.argsort(group, kind="stable")
    bounds = np.searchsorted(group[order], np.arange(uniq.shape[0] + 1))
    out = []
    for g, (b_r, b_c, s, *_) in enumerate(uniq):
        members = order[bounds[g]:bounds[g + 1]]
        first = members[0]
        expr = sympy.Integer(0)
        for (coef, _), v in zip(m.terms, vals[first]):
            if v != 0:
                expr += coef * rational(v)
        expr = sympy.simplify(expr) if len(m.terms) > 1 else expr
        if expr == 0:
            continue
        out.append(Pattern(m.rows.blocks[b_r].name, m.cols.blocks[b_c].name, bool(s), expr, r[members], c[members]))
    out.sort(key=lambda p: (int(p.rows[0]), int(p.cols[0])))
    kept = tuple(m.rows.label(int(i)) for i in rows_only) if rows_only is not None else ()
    return Listing(block, tuple(out), values, kept)


@dataclass(frozen=True)
class Grid:
    """A block as a picture: the numeric values of its nonzero rows and columns (binned
    when there are more than ``limit``: each cell then holds the value of largest
    magnitude among the entries it covers), their labels, and the spans of the label
    blocks along each axis (``(start, stop, name)`` in cell coordinates)."""

    name: str
    values: np.ndarray
    row_labels: tuple[str, ...]
    col_labels: tuple[str, ...]
    row_spans: tuple[tuple[int, int, str], ...]
    col_spans: tuple[tuple[int, int, str], ...]
    binned: bool
    at: str


def _axis(space: Space, idx: np.ndarray, limit: int) -> tuple[np.ndarray, tuple[str, ...], tuple]:
    """Cell of each coordinate in ``idx`` (sorted unique), cell labels, label-block spans."""
    n = idx.size
    cells = np.arange(n) if n <= limit else (np.arange(n) * limit) // n
    n_cells = int(cells[-1]) + 1 if n else 0
    labels = []
    for c in range(n_cells):
        members = idx[cells == c]
        first, last = space.label(int(members[0])), space.label(int(members[-1]))
        labels.append(first if members.size == 1 else f"{first} … {last}")
    blocks = _block_of(space, idx)
    spans = []
    for b in np.unique(blocks):
        where = cells[blocks == b]
        spans.append((int(where.min()), int(where.max()) + 1, space.blocks[int(b)].name))
    return cells, tuple(labels), tuple(spans)


def grid(listing: Listing, values: Mapping[sympy.Symbol, sympy.Rational], limit: int = 160) -> Grid:
    """The listing's block as a picture at ``values`` (the listing's own substitution if it has one)."""
    at = listing.values or values
    rows = np.unique(np.concatenate([p.rows for p in listing.patterns])) if listing.patterns else np.zeros(0, np.int64)
    cols = np.unique(np.concatenate([p.cols for p in listing.patterns])) if listing.patterns else np.zeros(0, np.int64)
    rcell, rlab, rspan = _axis(listing.matrix.rows, rows, limit)
    ccell, clab, cspan = _axis(listing.matrix.cols, cols, limit)
    out = np.zeros((len(rlab), len(clab)))
    for p in listing.patterns:
        v = float(p.expr.subs(at))
        i, j = rcell[np.searchsorted(rows, p.rows)], ccell[np.searchsorted(cols, p.cols)]
        current = out[i, j]
        out[i, j] = np.where(np.abs(v) > np.abs(current), v, current)
        # several entries of one pattern in one cell share v, so the order above is immaterial
    shown = ", ".join(f"{str(k).replace('beta', 'β').replace('gamma', 'γ')} = {v}" for k, v in at.items())
    return Grid(listing.block.name, out, rlab, clab, rspan, cspan, rows.size > limit or cols.size > limit, shown)
