"""A compact shard (the weights cut to a shard's cone of influence and renumbered,
verifier.shards) computes bit for bit what the full weights compute on the shard's queries."""

from __future__ import annotations

import numpy as np
import pytest

from construction.model import build
from tasks.io import load_tasks
from tasks.synthetic import wikidata_like
from verifier.batches import batches
from verifier.forward import Prepared, run_batch
from verifier.shards import Plan, compact, restrict
from verifier.verify import ShardPart, token_map, verify_shard_batch

SETS = {
    "capitals": lambda: load_tasks("examples/capitals.yaml"),
    "generated": lambda: wikidata_like(1500, n_tasks=7, seed=4),
    "geography": lambda: load_tasks("examples/geography/tasks.yaml"),
}


def _same(a, b) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


@pytest.mark.parametrize("name", sorted(SETS))
def test_compact_shards_are_bitwise_the_full_pass(name):
    """(Row-local rounding bounds, which the claim needs, are tested directly in
    tests/test_interval.py.)"""
    ts = SETS[name]()
    weights = build(ts).instantiate()
    tmap = token_map(ts, weights)
    full = Prepared(weights)
    plan = Plan.make(ts, weights, tmap, 3)
    gate_terms = int(np.diff(weights.W_G.tocsr().indptr).max(initial=1))
    parts = {}
    compared = 0
    for b in batches(ts, chunk=3000):
        ref = run_batch(full, tmap[b.tokens], b.valid_ptr, tmap[b.valid],
                        ablate=b.object_query & (b.determined >= 0), scores=False).compact()
        for s, rows in plan.split(b):
            if s not in parts:
                comp = compact(restrict(weights, plan.tokens[s], plan.experts[s]), plan.tokens[s])
                assert comp.weights.d < weights.d or plan.n == 1
                parts[s] = ShardPart(comp, plan.experts[s], gate_terms)
            got, outside = verify_shard_batch(parts[s], parts[s].localize(b.take(rows), tmap))
            keep = ~outside
            for field in ("expert", "margin", "err_lo", "err_hi", "ablated_lo", "ablated_hi", "predicted"):
                assert _same(getattr(got, field)[keep], getattr(ref, field)[rows][keep]), (name, s, field)
            for i in range(3):
                assert _same(got.top_gate[i][keep], ref.top_gate[i][rows][keep])
            compared += int(keep.sum())
    assert compared > 0
