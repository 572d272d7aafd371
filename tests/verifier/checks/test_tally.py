"""A batch's share of the records computed in pieces (the rows of each shard of a cluster
run) combines into exactly the share of the whole batch (BatchTally.combine).

The weights are made to fail everywhere (a tiny ε, the experts' tasks rotated, the
unembedding scaled down), so that every category has more counterexamples than are
kept, and every task's worst error is attained by many rows (ties decided by row order).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from construction.model import build
from tasks.structure import StructureTrie
from tasks.synthetic import wikidata_like
from verifier.checks.verify import MAX_COUNTEREXAMPLES, BatchTally, Names, Report, Tally, tally, token_map
from verifier.passes.batches import batches
from verifier.running.runner import PassSpec


def _setting():
    ts = wikidata_like(600, n_tasks=5, seed=3)
    model = build(ts)
    weights = model.instantiate()
    weights = replace(weights, U=weights.U * 0.25)
    tmap = token_map(ts, weights)
    spec = PassSpec.for_taskset(ts, weights, tmap)
    prepared = spec.build(weights)
    names = ts.names
    serves = np.array([names.index(t) if t in names else -1 for t in weights.expert_tasks], np.int64)
    rules = Tally(ts, StructureTrie(ts), Report(0.01, {}, [], 0), serves, 0.01, Names.of(weights), exact=True).rules
    out = []
    for b in batches(ts, chunk=400):
        ablate = b.object_query & (b.determined >= 0)
        res = prepared.run_batch(tmap[b.tokens], b.valid_ptr, tmap[b.valid], ablate=ablate, scores=False,
                                 target=np.where(ablate & (b.target >= 0), tmap[np.maximum(b.target, 0)], -1)).compact()
        out.append((b, res))
    return out, rules


SETTING = _setting()
RULES = {"rotated": lambda r: replace(r, serves=np.roll(r.serves, 1), epsilon=1e-12),
         "as built": lambda r: replace(r, epsilon=1e-12)}


def _equal(a: BatchTally, b: BatchTally) -> None:
    assert a.n == b.n and a.foreign == b.foreign and a.distinct == b.distinct
    for key in a.counts:
        assert np.array_equal(a.counts[key], b.counts[key]), key
    for key in a.lows:
        assert np.array_equal(a.lows[key], b.lows[key], equal_nan=True), key
    assert a.worst == b.worst and a.worst_at == b.worst_at
    assert a.pending == b.pending and a.pending_at == b.pending_at
    ma, mb = {}, {}
    for m, t in ((ma, a), (mb, b)):
        for k, e, c in zip(*t.routing):
            m[(int(k), int(e))] = m.get((int(k), int(e)), 0) + int(c)
    assert ma == mb


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_shares_of_a_partition_combine_into_the_whole_batch(data):
    items, base = SETTING
    b, res = items[data.draw(st.integers(0, len(items) - 1), label="batch")]
    rules = RULES[data.draw(st.sampled_from(sorted(RULES)), label="rules")](base)
    n = len(b)
    piece = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="piece of each row"))
    whole = tally(rules, b, res)
    shares = []
    for p in np.unique(piece):
        rows = np.flatnonzero(piece == p)
        shares.append(tally(rules, b.take(rows), res.take(rows), rows))
    order = data.draw(st.permutations(range(len(shares))), label="order of the shares")
    _equal(BatchTally.combine(n, [shares[i] for i in order]), whole)


def test_the_setting_has_more_counterexamples_and_ties_than_are_kept():
    """The property above is not vacuous: categories overflow, worst errors tie across rows."""
    items, base = SETTING
    rules = RULES["rotated"](base)
    b, res = max(items, key=lambda it: len(it[0]))
    t = tally(rules, b, res)
    assert all(len(found) == MAX_COUNTEREXAMPLES for found in t.pending[:2])
    ties = [np.count_nonzero(res.err_hi[np.repeat(np.arange(len(b)), np.diff(b.allowed_ptr))[b.allowed == k]] == hi)
            for k, hi, *_ in t.worst]
    assert max(ties) > 1


def test_a_lost_row_is_refused():
    items, base = SETTING
    b, res = items[0]
    rows = np.arange(1, len(b))
    try:
        BatchTally.combine(len(b), [tally(base, b.take(rows), res.take(rows), rows)])
    except RuntimeError as exc:
        assert "rows for a batch of" in str(exc)
    else:
        raise AssertionError("a share missing a row was combined")
