"""A compact shard (the weights cut to a shard's cone of influence and renumbered,
verifier.running.shards) computes bit for bit what the full weights compute on the shard's queries."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from construction.model import build
from tasks.io import load_tasks
from tasks.synthetic import wikidata_like
from verifier.passes.batches import batches
from verifier.passes.forward import Prepared, run_batch
from verifier.running.shards import Plan
from verifier.running.runner import PassSpec, ShardPart, verify_shard_batch
from verifier.checks.verify import token_map

SETS = {
    "capitals": lambda: load_tasks("examples/capitals.yaml"),
    "generated": lambda: wikidata_like(1500, n_tasks=7, seed=4),
    "geography": lambda: load_tasks("examples/geography/tasks.yaml"),
}


def _same(a, b) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


@pytest.mark.parametrize("factored", [False, True], ids=["plain", "factored"])
@pytest.mark.parametrize("name", sorted(SETS))
def test_compact_shards_are_bitwise_the_full_pass(name, factored):
    """Both exact passes: the plain one, and the factored one with the full weights' split
    (verifier.passes.factored). (Row-local rounding bounds, which the claim needs, are
    tested directly in tests/verifier/arithmetic/test_interval.py.)"""
    ts = SETS[name]()
    weights = build(ts).instantiate()
    tmap = token_map(ts, weights)
    spec = PassSpec.for_taskset(ts, weights, tmap) if factored else PassSpec()
    full = spec.build(weights)
    plan = Plan.make(ts, weights, tmap, 3)
    gate_terms = int(np.diff(weights.W_G.tocsr().indptr).max(initial=1))
    parts = {}
    compared = 0
    for b in batches(ts, chunk=3000):
        ablate = b.object_query & (b.determined >= 0)
        ref = full.run_batch(tmap[b.tokens], b.valid_ptr, tmap[b.valid], ablate=ablate, scores=False,
                             target=np.where(ablate & (b.target >= 0), tmap[np.maximum(b.target, 0)], -1)).compact()
        for s, rows in plan.split(b):
            if s not in parts:
                parts[s] = ShardPart(weights, plan.experts[s], plan.tokens[s], replace(spec, gate_terms=gate_terms))
                assert isinstance(parts[s].prepared(), type(full))
                assert parts[s].weights.d < weights.d or plan.n == 1
            got, outside = verify_shard_batch(parts[s], parts[s].localize(b.take(rows), tmap))
            keep = ~outside
            for field in ("expert", "margin", "err_lo", "err_hi", "ablated_lo", "ablated_hi", "predicted",
                          "ablated_gap", "ablated_zeros", "ablated_object_lo"):
                assert _same(getattr(got, field)[keep], getattr(ref, field)[rows][keep]), (name, s, field)
            for i in range(3):
                assert _same(got.top_gate[i][keep], ref.top_gate[i][rows][keep])
            compared += int(keep.sum())
    assert compared > 0


def test_a_token_with_only_a_row_of_u_is_not_held():
    """compact keeps tokens that only have a row of U (for their logits); a query containing
    one is not the shard's to answer (its E row is gone) and must be deferred."""
    import scipy.sparse as sp

    ts = SETS["generated"]()
    weights = build(ts).instantiate()
    tmap = token_map(ts, weights)
    plan = Plan.make(ts, weights, tmap, 7)
    s = int(np.argmin([t.size for t in plan.tokens]))
    # give a token outside shard 0 the row of U of one inside it (a permuted unembedding)
    outside_tok = np.setdiff1d(np.arange(len(weights.vocab)), plan.tokens[s])[0]
    inside_tok = plan.tokens[s][-1]
    order = np.arange(len(weights.vocab))
    order[[outside_tok, inside_tok]] = order[[inside_tok, outside_tok]]
    U = sp.csr_matrix(weights.U[order])
    U.sort_indices()
    weights = weights.replace(U=U)
    gate_terms = int(np.diff(weights.W_G.tocsr().indptr).max(initial=1))
    part = ShardPart(weights, plan.experts[s], plan.tokens[s], PassSpec(gate_terms=gate_terms))
    extra = np.setdiff1d(part.tokens, plan.tokens[s])
    b = next(iter(batches(ts, chunk=3000)))
    tokens = b.tokens.copy()
    inv = np.full(len(weights.vocab) + 1, -1)
    inv[tmap] = np.arange(tmap.size)
    if extra.size == 0:
        pytest.skip("no token kept only for its row of U in this set")
    tokens[0, 0] = inv[extra[0]]
    from dataclasses import replace

    _, outside = part.localize(replace(b, tokens=tokens), tmap)
    assert outside[0]


def test_a_deferred_row_reaches_the_kernels_with_ids_of_the_part():
    """Every batch of the generated set on every shard, localized: rows holding a token, a
    valid next token or an object outside the part are deferred, and still every id the
    part's kernels index by is one of its tokens (the kernels do not check bounds; a valid
    token mapped past the part's vocabulary would write past an array). The pass refuses
    ids outside the weights' vocabulary instead of reading past it."""
    ts = SETS["generated"]()
    weights = build(ts).instantiate()
    tmap = token_map(ts, weights)
    plan = Plan.make(ts, weights, tmap, 3)
    gate_terms = int(np.diff(weights.W_G.tocsr().indptr).max(initial=1))
    deferred = 0
    for s in range(plan.n):
        part = ShardPart(weights, plan.experts[s], plan.tokens[s], PassSpec(gate_terms=gate_terms))
        V = part.tokens.size
        for b in batches(ts, chunk=3000):
            local, outside = part.localize(b, tmap)
            deferred += int(outside.sum())
            assert local.tokens.min() >= 0 and local.tokens.max() <= V          # BOS is V
            assert local.valid.min() >= 0 and local.valid.max() < V
            assert local.target.max() < V
    assert deferred > 0
    full = Prepared(weights)
    V = len(weights.vocab)
    with pytest.raises(ValueError):
        run_batch(full, np.array([[0, 1]]), np.array([0, 1]), np.array([V]))
    with pytest.raises(ValueError):
        run_batch(full, np.array([[0, 1]]), np.array([0, 1]), np.array([0]), target=np.array([V]))


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(0, 300), max_size=60), st.booleans())
def test_distinct_ids_is_np_unique(ids, increasing):
    from verifier.running.shards import distinct_ids

    a = np.array(sorted(set(ids)) if increasing else ids, np.int64)
    got = distinct_ids(a)
    assert got.dtype == np.int64 and np.array_equal(got, np.unique(a))
