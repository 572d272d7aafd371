"""Mutation testing: no mutant that truly violates a requirement is certified.

A few hundred mutants of the built weights of three small task sets (capitals from
conftest, one that needs the linear-programme gate, one with a single task) are
verified and judged by the independent oracle (audit/oracle.py). Asserted: zero
false passes, every operator meant to violate is caught at least once, the harmless
operators make no violating mutant, and every false failure has a reason. The full
run is ``python scripts/mutation_testing.py --mutants 2000 --seed 0``.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from budget import examples

from tasks.errors import TaskError
from tasks.queries import iter_queries
from audit import mutants as M
from audit.exact import exact_forward
from audit.oracle import Oracle, enumerate_queries, fingerprint
from repository import ROOT

ENCODINGS = ("non_canonical_storage", "cancelling_duplicates", "unsorted_columns")
N_PER_OPERATOR = examples(20, floor=10)   # x 41 operators = 820 mutants over the three sets (410 by default)

#: The issue's list of operators -> the catalogue's names.
REQUIRED = {
    "swap the objects of two dictionary neurons": "swap_facts",
    "delete a dictionary neuron": "delete_fact_neuron",
    "delete a template neuron": "delete_template_neuron",
    "lower beta below what epsilon needs": "lower_beta",
    "lower gamma below what epsilon needs": "lower_gamma",
    "perturb one gate row": "perturb_gate_row",
    "swap two experts (matrices, not names)": "swap_experts",
    "zero an attention head's W_O": "zero_head_output",
    "shift a position embedding": "shift_position",
    "small noise on one weight": "small_noise",
    "change one bias": "change_bias",
    "permute rows of U": "permute_unembedding",
    "move a fact into another task's expert": "move_fact",
    "shadow expert (both variants)": "shadow_expert",
    "gate overflow": "gate_overflow",
    "overflow in the residual": "residual_overflow",
    "overflow in the logits": "logit_overflow",
    "harmless: dead neuron within the bound": "dead_neuron",
    "harmless: rename tokens with their E and U rows": "rename_tokens",
    "harmless: idle extra expert": "idle_expert",
    "harmless: permute experts with gate rows and names": "permute_experts",
}


@pytest.fixture(scope="module")
def sets(capitals_set):
    small = M.small_sets()
    assert small["capitals"].tasks == capitals_set.tasks
    return {"capitals": capitals_set, "mixed-prefix": small["mixed-prefix"], "one-task": small["one-task"]}


@pytest.fixture(scope="module")
def outcomes(sets):
    names = M.all_operator_names()
    return M.run(N_PER_OPERATOR * len(names), seed=0, sets=sets)


# --- the catalogue ------------------------------------------------------------------------------


def test_catalogue():
    assert len(M.OPERATORS) >= 12
    assert set(REQUIRED.values()) <= set(M.OPERATORS)
    for op in M.OPERATORS.values():
        assert op.kind in ("violating", "harmless", "mixed")
        assert op.doc, op.name
    assert {op.kind for op in M.OPERATORS.values()} == {"violating", "harmless", "mixed"}


def test_operators_do_not_modify_their_input(capitals_model):
    w = capitals_model.instantiate()
    before = [fingerprint(m) for _, m in w.arrays()] + [w.expert_tasks, w.vocab, w.neuron_labels]
    for name, op in M.OPERATORS.items():
        for seed in range(3):
            made = M.mutate(op, w, np.random.default_rng(seed))
            assert made is not None, name
            mutant, description = made
            assert isinstance(description, str) and description and "\n" not in description
            try:
                mutant.validate()
            except TaskError:   # a shadow named like its original repeats a name; encodings are not canonical
                assert (name == "shadow_expert" and "named-" in description) or name in ENCODINGS, (name, description)
    after = [fingerprint(m) for _, m in w.arrays()] + [w.expert_tasks, w.vocab, w.neuron_labels]
    assert before == after


# --- the oracle ---------------------------------------------------------------------------------


def test_oracle_enumerates_the_capitals_queries(capitals_set):
    mine = {(q.prefix, q.valid, tuple(capitals_set.names[k] for k in q.tasks),
             capitals_set.names[q.determined] if q.determined is not None else None, bool(q.object_of))
            for q in enumerate_queries(capitals_set)}
    theirs = {(q.prefix, q.valid, q.tasks, q.determined, q.object_query) for q in iter_queries(capitals_set)}
    assert len(mine) == 67 and mine == theirs


def test_oracle_finds_the_built_model_correct(capitals_set, capitals_model):
    res = Oracle().judge(capitals_set, capitals_model.instantiate(), 0.01)
    assert not res.violating and res.queries == 67
    # between (V-1)/(e^γ + V - 1) (an object query's error when the subject head does not leak) and the bound
    floor = 22 / (np.exp(float(capitals_model.gamma)) + 22)
    assert floor <= res.worst_error <= capitals_model.bound_value()
    assert res.worst_error == pytest.approx(floor, rel=1e-5)
    assert res.min_ablated == pytest.approx(22 / 23)   # ablated: uniform over the 23 tokens


@pytest.mark.parametrize("op", ["swap_facts", "lower_gamma", "perturb_gate_row", "scaled_gate",
                                "small_noise", "dead_neuron"])
def test_oracle_agrees_with_the_60_digit_pass(capitals_set, capitals_model, op):
    """The oracle's routing and errors equal audit/exact.py's (written separately) to 30 digits."""
    w, _ = M.OPERATORS[op](capitals_model.instantiate(), np.random.default_rng(1))
    oracle = Oracle()
    res = oracle.judge(capitals_set, w, 0.01)
    index = {t: i for i, t in enumerate(w.vocab)}
    for q in enumerate_queries(capitals_set):
        ex = exact_forward(w, [index[t] for t in q.prefix], {index[t] for t in q.valid})
        mine = oracle.query(capitals_set, w, q.prefix)
        assert mine["expert"] == ex["expert"] == res.records[q.prefix][0]
        assert abs(mine["error"] - ex["error"]) < mpmath.mpf(10) ** -30
        for a, b in zip(mine["gates"], ex["gates"]):
            assert abs(a - b) < mpmath.mpf(10) ** -30


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_oracle_catches_both_earlier_false_passes(capitals_set, capitals_model):
    gate_overflow = _module(ROOT / "tests" / "verifier" / "passes" / "test_gate_overflow.py", "_gate_overflow")
    overflowing_gate = gate_overflow.overflowing_gate

    oracle = Oracle()
    for sign in (1.0, -1.0):   # the gate overflow of tests/verifier/passes/test_gate_overflow.py
        ts, w = overflowing_gate(sign)
        res = oracle.judge(ts, w, 0.01)
        assert res.counts.get("routing") and res.counts.get("error"), res.summary()
    w = capitals_model.instantiate()  # the shadow expert: a second, oversized expert named 'capital' gets the traffic
    rng = np.random.default_rng(0)
    seen = set()
    while len(seen) < 3:
        mutant, text = M.OPERATORS["shadow_expert"](w, rng)
        variant = text.split(", ")[2].split(":")[0]
        seen.add(variant)
        res = oracle.judge(capitals_set, mutant, 0.01)
        assert res.violating
        if variant.startswith("named"):
            assert res.counts.get("names") and res.counts.get("size")
        else:
            assert res.counts.get("routing")


def test_oracle_counts_an_exact_tie_as_a_violation(capitals_set, capitals_model):
    w = capitals_model.instantiate()
    mutant, text = M.OPERATORS["tie_expert"](w, np.random.default_rng(0))
    res = Oracle().judge(capitals_set, mutant, 0.01)
    assert res.counts.get("routing") and "no unique gate winner" in " ".join(v.detail for v in res.violations)


def test_oracle_sees_through_float_overflow(capitals_set, capitals_model):
    """Harmless overflow: a common shift of every gate score or logit by 2e308 changes nothing exactly."""
    w = capitals_model.instantiate()
    clean = Oracle().judge(capitals_set, w, 0.01)
    oracle = Oracle()
    for name, word in (("gate_overflow", "harmless"), ("logit_overflow", "harmless"),
                       ("residual_overflow", "harmless")):
        rng = np.random.default_rng(0)
        for _ in range(40):
            mutant, text = M.OPERATORS[name](w, rng)
            if f"({word})" in text:
                break
        else:
            pytest.fail(f"{name} never drew {word}")
        res = oracle.judge(capitals_set, mutant, 0.01)
        assert not res.violating, (text, res.summary())
        assert res.worst_error == pytest.approx(clean.worst_error, rel=1e-12)


# --- the mutation run -----------------------------------------------------------------------------


def test_no_false_pass(outcomes):
    bad = [(o.taskset, o.operator, o.description, o.details) for o in outcomes if o.category == "FALSE PASS"]
    assert not bad


def test_enough_mutants_of_every_operator(outcomes):
    counts = Counter(o.operator for o in outcomes)
    assert sum(counts.values()) >= 300
    assert set(counts) == set(M.all_operator_names())
    assert all(n >= 5 for n in counts.values()), counts


def test_every_violating_operator_is_caught(outcomes):
    stats = {s.operator: s for s in M.table(outcomes)}
    for name, s in stats.items():
        if s.kind == "violating":
            assert s.violating >= 1 and s.caught >= 1, name
        if s.violating:
            assert s.caught == s.violating, name
    for name in ("gate_overflow", "residual_overflow", "logit_overflow", "lower_beta", "lower_gamma",
                 "near_error_threshold", "near_ablation_threshold"):
        assert stats[name].caught >= 1, name


def test_harmless_operators_are_harmless_and_certified(outcomes):
    for o in outcomes:
        if o.kind == "harmless":
            assert not o.violating, (o.operator, o.description, o.details)
    certified = Counter(o.operator for o in outcomes if o.kind == "harmless" and o.verdict == "certified")
    for name, op in M.OPERATORS.items():
        if op.kind == "harmless" and name not in ENCODINGS:
            assert certified[name] >= 1, name


def test_non_canonical_encodings_are_refused_not_merged(outcomes):
    """The same matrix stored with duplicates or unsorted rows is bad input (the layout asks for canonical CSR)."""
    seen = Counter()
    for o in outcomes:
        if o.operator in ENCODINGS:
            seen[o.operator] += 1
            assert o.verdict == "rejected", (o.operator, o.description, o.verdict)
            assert "stored twice" in o.reason or "not sorted" in o.reason, o.reason
    assert all(seen[name] >= 1 for name in ENCODINGS), seen


def test_false_failures_have_reasons(outcomes):
    for o in outcomes:
        assert o.verdict != "crashed", (o.operator, o.description, o.reason)
        if o.category == "false failure":
            assert o.reason, (o.operator, o.description)


def test_both_earlier_false_passes_are_caught(outcomes):
    seen = Counter()
    for o in outcomes:
        if o.operator == "shadow_expert":
            seen[o.description.split(", ")[2].split(":")[0]] += 1
            assert o.caught, o.description
        if o.operator == "gate_overflow" and "(shadow)" in o.description:
            seen["gate-overflow-shadow"] += 1
            assert o.caught, o.description
    assert seen["gate-overflow-shadow"] >= 1 and sum(v for k, v in seen.items() if k.startswith("named")) >= 1


CHUNKED_OPS = ["swap_facts", "delete_fact_neuron", "delete_template_neuron", "swap_experts",
               "change_bias", "small_noise",
               "shadow_expert", "gate_overflow", "permute_unembedding", "lower_gamma", "dead_neuron", "rename_tokens"]


def test_mutants_of_a_larger_chunked_set(monkeypatch):
    """2437 queries in batches of 1000 (the verifier's smallest chunk): chunk boundaries, 190 tokens."""
    import verifier.checks.verify

    monkeypatch.setattr(verifier.checks.verify, "CHUNK", 1000)
    out = M.run(2 * len(CHUNKED_OPS), seed=0, sets=M.larger_sets(), operators=CHUNKED_OPS)
    assert len(out) == 2 * len(CHUNKED_OPS)
    assert not [(o.operator, o.description) for o in out if o.category == "FALSE PASS"]
    stats = {s.operator: s for s in M.table(out)}
    for name in CHUNKED_OPS:
        if M.OPERATORS[name].kind == "violating":
            assert stats[name].caught >= 1, name
    assert all(o.verdict == "certified" for o in out if o.operator in ("dead_neuron", "rename_tokens"))


def test_script_runs_and_writes_json(tmp_path, capsys):
    main = _module(ROOT / "scripts" / "mutation_testing.py", "_mutation_testing").main

    out = tmp_path / "m.json"
    assert main(["--mutants", "40", "--seed", "3", "--json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "false passes" in printed and "total" in printed
    data = json.loads(out.read_text())
    assert data["mutants"] == len(data["outcomes"]) > 30
    assert sum(op["false_passes"] for op in data["operators"]) == 0


def _listed_pair(w, rng):
    """swap_facts's choice as it was written first: every differing pair listed."""
    from audit.operators import _neurons, _pick

    pairs = [(k, i, j) for k, i in _neurons(w, "fact:") for k2, j in _neurons(w, "fact:")
             if k2 == k and j > i and (w.experts[k].W_2[:, i] != w.experts[k].W_2[:, j]).nnz]
    return _pick(rng, pairs)


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_swap_facts_chooses_as_listing_every_pair_would(capitals_model, data):
    """The counted choice of two differing W_2 columns equals the listed one for the same
    seed, on columns drawn from few values (ties), stored zeros, -0.0 and NaN."""
    import dataclasses

    import scipy.sparse as sp
    from audit.operators import NotApplicable, _pick_differing_pair, _neurons

    w = capitals_model.instantiate()
    experts = list(w.experts)
    for k, e in enumerate(experts):
        d, n = e.W_2.shape
        cells = data.draw(st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.0, float("nan")]),
                                   min_size=n * 3, max_size=n * 3))
        rows = data.draw(st.lists(st.integers(0, min(d, 3) - 1), min_size=n * 3, max_size=n * 3))
        cols = np.repeat(np.arange(n), 3)
        W_2 = sp.coo_matrix((cells, (rows, cols)), shape=(d, n)).tocsr()   # duplicates summed, zeros stored
        experts[k] = dataclasses.replace(e, W_2=W_2)
    w = dataclasses.replace(w, experts=tuple(experts))
    seed = data.draw(st.integers(0, 2**32 - 1))
    try:
        want = _listed_pair(w, np.random.default_rng(seed))
    except NotApplicable:
        with pytest.raises(NotApplicable):
            _pick_differing_pair(w, np.random.default_rng(seed), _neurons(w, "fact:"))
        return
    assert _pick_differing_pair(w, np.random.default_rng(seed), _neurons(w, "fact:")) == want
