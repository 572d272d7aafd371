"""Labelled vector spaces: a direct sum of named blocks of basis directions.

In the spirit of tracr's ``craft/bases.py``: every coordinate of every space has a
readable label such as ``word:capital``, ``pos:3``, ``slot2:of``, ``subj:Paris``.
A space is stored as an ordered tuple of :class:`Block` (a name and a tuple of
labels), so spaces with millions of entity directions stay cheap: a label is only
formatted when asked for, and an index is an offset plus a position in the block.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class Block:
    """A named block of directions; ``labels`` name its coordinates."""

    name: str
    labels: Sequence   # a tuple, or a Prefixed sequence formatted on demand

    def __len__(self) -> int:
        return len(self.labels)

    @cached_property
    def _index(self) -> dict:
        return {label: i for i, label in enumerate(self.labels)}

    @cached_property
    def _string_search(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """(the labels sorted, as a numpy string array; their positions, None if already in
        order) when every label is a ``str``, else None: such a block is searched, without a
        dict. (numpy orders strings by code point, as ``sorted`` does.)"""
        if not isinstance(self.labels, tuple) or len(self) < 2 or set(map(type, self.labels)) != {str}:
            return None
        a = np.asarray(self.labels, dtype=str)
        if bool((a[1:] > a[:-1]).all()):
            return a, None
        order = np.argsort(a, kind="stable")
        a = a[order]
        return (a, order) if bool((a[1:] > a[:-1]).all()) else None

    def positions(self, labels: Sequence) -> np.ndarray:
        """Position in this block of each of ``labels`` (-1: none). Without building the
        block's dict where it can: a block of names is searched, and a block of prefixed
        names (neurons ``fact:<subject>``) maps another such block item by item."""
        mine = self.labels
        if "_index" not in self.__dict__ and len(labels) > 64:
            search = self._string_search
            if search is not None and len(labels) and set(map(type, labels)) == {str}:
                pos = search_sorted(search[0], np.asarray(list(labels), dtype=str))
                return pos if search[1] is None else np.where(pos >= 0, search[1][np.maximum(pos, 0)], -1)
            if isinstance(mine, Prefixed) and isinstance(labels, Prefixed) and mine.prefix == labels.prefix:
                out = mine.positions_of(labels)
                if out is not None:
                    return out
        index = self._index
        return np.fromiter((index.get(x, -1) for x in labels), dtype=np.int64, count=len(labels))

    def position(self, label) -> int:
        try:
            return self._index[label]
        except KeyError:
            raise KeyError(f"{self.name}:{label}") from None

    def __contains__(self, label) -> bool:
        return label in self._index


def sorted_strings(labels: Sequence, strict: bool = True) -> np.ndarray | None:
    """``labels`` as a numpy string array if every one is a ``str`` and they increase (strictly,
    or not decreasing), else None. (numpy orders strings by code point, as ``sorted`` does.)"""
    if len(labels) < 2 or set(map(type, labels)) != {str}:
        return None
    a = np.asarray(list(labels), dtype=str)
    up = (a[1:] > a[:-1]) if strict else (a[1:] >= a[:-1])
    return a if bool(up.all()) else None


def search_sorted(b: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Position in the sorted distinct array ``b`` of each of ``a`` (-1: none); every hit compared exactly."""
    pos = np.minimum(np.searchsorted(b, a), b.size - 1)
    return np.where(b[pos] == a, pos, -1).astype(np.int64)


@dataclass(frozen=True)
class Space:
    """An ordered direct sum of blocks."""

    blocks: tuple[Block, ...]

    @staticmethod
    def of(*blocks: Block) -> "Space":
        names = [b.name for b in blocks]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate block names in {names}")
        return Space(tuple(blocks))

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, total = [], 0
        for b in self.blocks:
            out.append(total)
            total += len(b)
        return tuple(out)

    @cached_property
    def dim(self) -> int:
        return sum(len(b) for b in self.blocks)

    def __len__(self) -> int:
        return self.dim

    @cached_property
    def _by_name(self) -> dict[str, int]:
        return {b.name: i for i, b in enumerate(self.blocks)}

    def block(self, name: str) -> Block:
        return self.blocks[self._by_name[name]]

    def has_block(self, name: str) -> bool:
        return name in self._by_name

    def offset(self, name: str) -> int:
        return self.offsets[self._by_name[name]]

    def index(self, name: str, label) -> int:
        """The coordinate of direction ``name:label``."""
        b = self._by_name[name]
        return self.offsets[b] + self.blocks[b].position(label)

    def indices(self, name: str, labels: Iterable) -> list[int]:
        b = self._by_name[name]
        off, block = self.offsets[b], self.blocks[b]
        return [off + block.position(label) for label in labels]

    def span(self, name: str) -> range:
        """The coordinates of a whole block."""
        off = self.offset(name)
        return range(off, off + len(self.block(name)))

    def locate(self, i: int) -> tuple[str, object]:
        """(block name, label) of coordinate ``i``."""
        b = bisect_right(self.offsets, i) - 1
        if not 0 <= i < self.dim:
            raise IndexError(i)
        return self.blocks[b].name, self.blocks[b].labels[i - self.offsets[b]]

    def label(self, i: int) -> str:
        name, label = self.locate(i)
        return name if len(self.blocks[self._by_name[name]]) == 1 and label == "" else f"{name}:{label}"

    def labels(self) -> list[str]:
        return [self.label(i) for i in range(self.dim)]


class Prefixed(Sequence):
    """The labels ``head`` followed by ``prefix + items[i]`` for each item, formatted only
    when read: a block of a million fact neurons holds no string of its own. Equal to
    any sequence of the same labels (compared label by label)."""

    def __init__(self, head: tuple[str, ...], prefix: str, items: Sequence[str]) -> None:
        self.head, self.prefix, self.items = tuple(head), prefix, items

    def __len__(self) -> int:
        return len(self.head) + len(self.items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        h = len(self.head)
        return self.head[i] if i < h else self.prefix + self.items[i - h]

    def __iter__(self):
        yield from self.head
        for x in self.items:
            yield self.prefix + x

    def positions_of(self, other: "Prefixed") -> np.ndarray | None:
        """Position here of each label of ``other`` (-1: none), for the same prefix and sorted
        items on both sides (else None: the caller uses a dict). A head label can equal a
        prefixed item of the other side only if it starts with the prefix; those few are
        looked up one by one, every other label by its item, by binary search."""
        assert other.prefix == self.prefix
        mine, theirs = sorted_strings(self.items), sorted_strings(other.items)
        if mine is None or theirs is None:
            return None
        n = len(self.prefix)
        head = {h: i for i, h in enumerate(self.head)}
        out = np.empty(len(other), np.int64)
        for i, h in enumerate(other.head):
            j = head.get(h, -1)
            if j < 0 and isinstance(h, str) and h.startswith(self.prefix):
                hit = search_sorted(mine, np.asarray([h[n:]], dtype=str))[0]
                j = -1 if hit < 0 else len(self.head) + int(hit)
            out[i] = j
        hit = search_sorted(mine, theirs)
        out[len(other.head):] = np.where(hit >= 0, hit + len(self.head), -1)
        for h, j in head.items():                  # my head labels that look like a prefixed item
            if isinstance(h, str) and h.startswith(self.prefix):
                k = search_sorted(theirs, np.asarray([h[n:]], dtype=str))[0]
                if k >= 0:
                    out[len(other.head) + k] = j
        return out

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str) or len(other) != len(self):
            return False
        if isinstance(other, Prefixed) and other.prefix == self.prefix and tuple(other.head) == tuple(self.head):
            return list(self.items) == list(other.items)        # the same prefix: compare the items
        return all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Prefixed({len(self)} labels)"


def block(name: str, labels: Sequence = ("",)) -> Block:
    """A block; ``labels`` is kept as given if it is a :class:`Prefixed`, else made a tuple."""
    return Block(name, labels if isinstance(labels, Prefixed) else tuple(labels))
