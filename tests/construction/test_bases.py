"""Label lookups in labelled spaces (construction.bases): the searches that avoid a dict
(sorted names, prefixed neuron names) give exactly what a dict of the labels gives."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from budget import examples

from construction.bases import Block, Prefixed

NAMES = st.text(alphabet="ab:é1 ", min_size=0, max_size=4)


def _by_dict(labels, other) -> list[int]:
    index = {x: i for i, x in enumerate(labels)}
    return [index.get(x, -1) for x in other]


def _labels(draw, kind: str, pool: list[str]):
    names = sorted(set(draw(st.lists(st.sampled_from(pool), min_size=0, max_size=200)
                            | st.lists(st.sampled_from(pool), min_size=150, max_size=250))))
    if kind == "tuple":
        return tuple(names)
    if kind == "unsorted":
        return tuple(draw(st.permutations(names)))
    head = tuple(sorted(set(draw(st.lists(st.sampled_from(["template:x", "fact:a", "fact:", "t"] + pool),
                                          max_size=3)))))
    prefix = draw(st.sampled_from(["fact:", "f", ""]))
    items = [x for x in names if prefix + x not in head]
    return Prefixed(head, prefix, items)


@settings(max_examples=examples(150), deadline=None)
@given(st.data())
def test_positions_equal_a_dict_lookup(data):
    pool = sorted(set(data.draw(st.lists(NAMES, min_size=100, max_size=300))))
    kinds = st.sampled_from(["tuple", "unsorted", "prefixed"])
    mine, theirs = _labels(data.draw, data.draw(kinds), pool), _labels(data.draw, data.draw(kinds), pool)
    if len(set(mine)) != len(mine) or len(set(theirs)) != len(theirs):
        return                                   # a block's labels are distinct
    got = Block("b", mine).positions(theirs)
    assert got.tolist() == _by_dict(list(mine), list(theirs))
    if isinstance(mine, Prefixed) and isinstance(theirs, Prefixed) and mine.prefix == theirs.prefix:
        direct = mine.positions_of(theirs)
        assert direct is None or direct.tolist() == _by_dict(list(mine), list(theirs))


def test_sorted_names_never_match_other_types():
    block = Block("pos", ("1", "2", "3") + tuple(f"n{i}" for i in range(100)))
    assert block.positions([1, 2] + [f"n{i}" for i in range(70)]).tolist()[:2] == [-1, -1]
    assert Block("pos", tuple(range(100))).positions([str(i) for i in range(70)]).tolist() == [-1] * 70


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_prefixed_blocks_map_like_a_dict(data):
    """Two neuron blocks with one prefix, where head labels of each side spell prefixed items
    of the other (the cases positions_of looks up one by one)."""
    pool = sorted(data.draw(st.lists(NAMES, min_size=80, max_size=200, unique=True)))
    prefix = data.draw(st.sampled_from(["fact:", ""]))

    def one() -> Prefixed:
        names = sorted(data.draw(st.lists(st.sampled_from(pool), min_size=70, max_size=80, unique=True)))
        head = tuple(set(data.draw(st.lists(st.sampled_from([prefix + x for x in pool] + ["template:x"]), max_size=4))))
        return Prefixed(head, prefix, [x for x in names if prefix + x not in head])

    mine, theirs = one(), one()
    want = _by_dict(list(mine), list(theirs))
    assert mine.positions_of(theirs).tolist() == want
    assert Block("b", mine).positions(theirs).tolist() == want
