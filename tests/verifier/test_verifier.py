"""The verifier: exactness of its enclosures, and every check shown failing on a model that violates it."""

from __future__ import annotations

import json
import subprocess
import sys

import mpmath
import numpy as np
import pytest
import scipy.sparse as sp
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.queries import query_groups
import layout
from audit.exact import exact_forward
from verifier.passes.batches import group_tokens
from verifier.passes.forward import run_batch
from layout import Expert
from workflow.check import check_built
from verifier.checks.verify import verify
from repository import DATA, ROOT

EXAMPLE = ROOT / "examples" / "capitals.yaml"


@pytest.fixture(scope="module")
def weights(capitals_model):
    return capitals_model.instantiate()


def checks(report):
    return {r.name: r for r in report.tasks}


def test_example_certifies(capitals_set, capitals_model, weights):
    report = check_built(capitals_set, capitals_model, weights=weights)
    assert report.certified, report.counterexamples
    assert report.queries == 67
    assert all(r.isolated for r in report.tasks)
    assert all(r.ablation_broken == r.object_queries > 0 for r in report.tasks)
    assert report.measured_worst < 0.01
    # tight up to the subject head's leak e^-β, which the closed form assumes at every object query
    assert max(r.worst_error_lower for r in report.tasks) <= report.closed_form_value
    assert report.measured_worst == pytest.approx(report.closed_form_value, rel=1e-2)


@pytest.mark.parametrize("hot", [1, 2, 16])
def test_enclosures_contain_the_exact_values(capitals_set, weights, hot, monkeypatch):
    """An independent 60-digit evaluation lies inside every enclosure the verifier reports,
    whichever gate columns are treated as shared ("hot": read by >= ``hot`` experts; with
    1, every gate input is shared and each batch cycles through many cached groups)."""
    import verifier.passes.forward as F
    import verifier.passes.tables as T

    monkeypatch.setattr(T, "HOT_READERS", hot)
    prep = F.Prepared(weights)
    assert (prep.layer.wg_hot.sum() > 0) == (hot <= 2)
    vocab = capitals_set.vocabulary
    checked = 0
    for g in query_groups(capitals_set):
        res = run_batch(prep, group_tokens(g), g.valid_ptr, g.valid)
        for i in range(len(g)):
            ex = exact_forward(weights, list(g.prefix_ids(i, vocab)), set(g.valid_of(i).tolist()))
            assert ex["expert"] == res.expert[i]
            assert mpmath.mpf(res.err_lo[i]) <= ex["error"] <= mpmath.mpf(res.err_hi[i])
            for k, gk in enumerate(ex["gates"]):
                assert mpmath.mpf(res.gate_lo[i, k]) <= gk <= mpmath.mpf(res.gate_hi[i, k])
            e = int(res.expert[i])
            others = max(gk for k, gk in enumerate(ex["gates"]) if k != e)
            assert mpmath.mpf(res.margin[i]) <= ex["gates"][e] - others
            checked += 1
    assert checked == 67


def test_token_chunks_change_nothing(capitals_set, weights, monkeypatch):
    """The per-token tables are built a chunk of tokens at a time and merged by class:
    with chunks of 3 tokens, every enclosure is bitwise the one of a single chunk
    (value rows of mostly-distinct chunks are kept unmerged: more rows, same values)."""
    import verifier.passes.forward as F

    whole = F.Prepared(weights)
    monkeypatch.setattr(F, "TOKEN_CHUNK", 3)
    chunked = F.Prepared(weights)
    assert chunked.QE[0].shape == whole.QE[0].shape      # query/key classes merged across chunks
    for g in query_groups(capitals_set):
        a = run_batch(whole, group_tokens(g), g.valid_ptr, g.valid)
        b = run_batch(chunked, group_tokens(g), g.valid_ptr, g.valid)
        for field in ("expert", "margin", "err_lo", "err_hi", "ablated_lo", "ablated_hi", "gate_mid", "gate_rad"):
            assert np.array_equal(getattr(a, field), getattr(b, field), equal_nan=True), field


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 12), st.integers(1, 4))
def test_per_distinct_rows_is_the_product_of_every_row(seed, n, kinds):
    """forward._by_distinct computes a product once per distinct row where the matrix reads
    it: rows that differ only in columns it does not read share a result, and that result
    is, bit for bit, the product of each of them (radii included: they depend on the terms)."""
    import verifier.passes.forward as F
    from verifier.arithmetic import interval as I

    rng = np.random.default_rng(seed)
    d, w = 9, 3
    W = sp.random(w, d, density=0.3, random_state=rng, format="csr")
    W.data = np.ldexp(rng.integers(1, 64, W.nnz).astype(float), rng.integers(-1080, 900, W.nnz))
    base = sp.random(kinds, d, density=0.5, random_state=rng, format="csr")
    base.data = np.ldexp(rng.integers(-64, 64, base.nnz).astype(float), rng.integers(-1080, 900, base.nnz))
    base = sp.vstack([base, base.multiply(2.0)]).tocsr()    # rows of one pattern, other values
    kinds *= 2
    X = sp.lil_matrix(base[rng.integers(0, kinds, n)])
    unread = np.flatnonzero(np.diff(sp.csc_matrix(W).indptr) == 0)
    for i in range(n):                                  # noise where W^T reads nothing
        for j in unread[: rng.integers(0, unread.size + 1)]:
            X[i, j] = float(rng.integers(1, 9))
    X = sp.csr_matrix(X)
    X.sort_indices()
    thin = I.Thin.transpose_of(W)
    with np.errstate(all="ignore"):
        f = lambda M: I.matmul(I.exact(M), thin)  # noqa: E731
        part, which = F._by_distinct(X, thin.rows, f)
        got, want = part.rows(which), f(X)
    assert np.array_equal(got.indptr, want.indptr) and np.array_equal(got.indices, want.indices)
    assert np.array_equal(got.mid.view(np.int64), want.mid.view(np.int64))
    assert np.array_equal(got.rad.view(np.int64), want.rad.view(np.int64))
    assert part.shape[0] <= kinds and which.size == n             # the rows read alike are computed once
    with np.errstate(all="ignore"):                                # and found once for maps reading alike
        again, which_again = F._by_distinct(X, thin.rows, f, F._distinct_rows(X, thin.rows))
    assert np.array_equal(which_again, which) and np.array_equal(again.mid.view(np.int64), part.mid.view(np.int64))


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from(["int32", "int64", "float64"]), st.booleans())
def test_distinct_rows_are_exactly_the_equal_rows(seed, dtype, collide):
    """forward._unique_rows groups rows by a hash first and then compares them: its groups
    are exactly the rows of one value (bitwise: 0.0 and -0.0 differ), also when every hash
    collides (the multipliers made 0) and the rows are grouped by their bytes instead."""
    import verifier.passes.forward as F

    rng = np.random.default_rng(seed)
    base = rng.integers(-3, 3, (4, 3)).astype(dtype)
    if dtype == "float64":
        base[0, 0], base[1, 0] = 0.0, -0.0
    rows = base[rng.integers(0, 4, 20)]
    mix = F._MIX
    try:
        if collide:
            F._MIX = np.zeros_like(mix)
        first, inv = F._unique_rows(rows[:, :1], rows[:, 1:])
    finally:
        F._MIX = mix
    bits = rows.view(np.int64) if dtype == "float64" else rows.astype(np.int64)
    assert np.array_equal(bits, bits[first[inv]])                      # each row is its group's row
    distinct = {r.tobytes() for r in bits}
    assert len(first) == len(distinct) == len({bits[f].tobytes() for f in first})
    assert all(inv[f] == k for k, f in enumerate(first))


# --- every check fails on a model that violates it -------------------------------------------


def _expert(weights, k, W_1=None, b_1=None, W_2=None):
    e = weights.experts[k]
    new = Expert(W_1 if W_1 is not None else e.W_1, b_1 if b_1 is not None else e.b_1,
                 W_2 if W_2 is not None else e.W_2)
    experts = list(weights.experts)
    experts[k] = new
    labels = weights.neuron_labels
    if labels is not None and len(labels[k]) != new.width:  # labels describe the old neurons: drop them
        labels = None
    return weights.replace(experts=tuple(experts), neuron_labels=labels)


def _neuron(weights, k, label):
    return weights.neuron_labels[k].index(label)


def test_swapped_facts_fail_with_counterexample(capitals_set, weights):
    i, j = _neuron(weights, 0, "fact:France"), _neuron(weights, 0, "fact:Germany")
    W_2 = weights.experts[0].W_2.tolil()
    ci, cj = W_2[:, i].copy(), W_2[:, j].copy()
    W_2[:, i], W_2[:, j] = cj, ci
    report = verify(capitals_set, _expert(weights, 0, W_2=W_2.tocsr()), 0.01)
    assert not report.certified
    assert not checks(report)["capital"].error_ok
    assert checks(report)["continent"].certified and checks(report)["located"].certified
    bad = [c for c in report.counterexamples if c["check"] == "error"]
    assert {c["subject"] for c in bad} == {"France", "Germany"}
    assert all(c["task"] == "capital" and c["error_lower"] > 0.5 for c in bad)
    assert any(c["prefix"] == "the capital of France is" and c["predicted"] == "Berlin" for c in bad)


def test_beta_too_small_fails(capitals_set, capitals_model):
    report = verify(capitals_set, capitals_model.instantiate(beta=1), 0.01)
    assert not report.certified
    assert any(not r.error_ok for r in report.tasks)


def test_gamma_too_small_fails(capitals_set, capitals_model):
    report = verify(capitals_set, capitals_model.instantiate(gamma=capitals_model.gamma - 1), 0.01)
    assert not report.certified
    assert {c["check"] for c in report.counterexamples} == {"error"}
    assert all(not r.error_ok for r in report.tasks)


def test_disturbed_gate_row_misroutes(capitals_set, weights):
    W_G = weights.W_G.tolil()
    W_G[1] = W_G[1] + W_G[0] * 2  # 'continent' now also claims every 'capital' feature
    report = verify(capitals_set, weights.replace(W_G=W_G.tocsr()), 0.01)
    assert not report.certified
    assert not checks(report)["capital"].routing_ok
    bad = [c for c in report.counterexamples if c["check"] == "routing"]
    assert bad and all(c["routed_task"] == "continent" for c in bad)
    assert report.foreign > 0


def test_removed_template_neuron_fails(capitals_set, weights):
    drop = _neuron(weights, 0, "template:the capital")
    keep = [i for i in range(weights.experts[0].width) if i != drop]
    e = weights.experts[0]
    report = verify(capitals_set, _expert(weights, 0, e.W_1[keep], e.b_1[keep], e.W_2[:, keep]), 0.01)
    assert not report.certified
    bad = [c for c in report.counterexamples if c["check"] == "error"]
    assert [c["prefix"] for c in bad] == ["the capital"]


def test_ablated_expert_fails(capitals_set, weights):
    e = weights.experts[2]
    report = verify(capitals_set, _expert(weights, 2, W_2=sp.csr_matrix(e.W_2.shape)), 0.01)
    assert not checks(report)["located"].error_ok
    assert checks(report)["capital"].certified


def test_oversized_expert_fails_size(capitals_set, weights):
    e = weights.experts[2]
    extra = 10  # zero neurons: harmless for the predictions, but over the bound c(k) = 11
    W_1 = sp.vstack([e.W_1, sp.csr_matrix((extra, e.W_1.shape[1]))]).tocsr()
    W_2 = sp.hstack([e.W_2, sp.csr_matrix((e.W_2.shape[0], extra))]).tocsr()
    report = verify(capitals_set, _expert(weights, 2, W_1, np.concatenate([e.b_1, -np.ones(extra)]), W_2), 0.01)
    rec = checks(report)["located"]
    assert rec.error_ok and rec.routing_ok and not rec.size_ok and not report.certified


def test_knowledge_outside_the_expert_fails_entanglement(capitals_set, weights):
    # The unembedding itself maps subj:France -> Paris: ablating the capital expert no longer breaks that fact.
    U = weights.U.tolil()
    U[weights.vocab.index("Paris"), weights.residual_labels.index("subj:France")] = 1000.0
    report = verify(capitals_set, weights.replace(U=U.tocsr()), 0.01)
    rec = checks(report)["capital"]
    assert not rec.entanglement_ok
    assert any(c["check"] == "entanglement" and c["subject"] == "France" for c in report.counterexamples)


def _u(weights, entries):
    """``weights`` with U[token, residual direction] set for each ((token, label), value)."""
    U = weights.U.tolil()
    for (token, label), value in entries.items():
        U[weights.vocab.index(token), weights.residual_labels.index(label)] = value
    return weights.replace(U=U.tocsr())


#: U made to know France -> Paris by itself (the shared path answers without the expert), by
#: how much: (entries, the localization parts its 'France' object queries fail).
ANSWERS_WITHOUT_EXPERT = {
    # P_ablated(Paris) ≈ e^3.5/(e^3.5 + 22) ≈ 0.6 > 1/4 and Paris on top: the old criterion (ablated error >= ε) passes
    "answers": ({("Paris", "subj:France"): 3.5}, ["L1", "L2"]),
    # Paris on top with P ≈ e^0.5/(e^0.5 + 22) ≈ 0.07 <= 1/4: only L2 fails
    "top token only": ({("Paris", "subj:France"): 0.5}, ["L2"]),
    # Berlin above Paris, but P(Paris) ≈ 0.35 > 1/4: only L1 fails
    "likely only": ({("Paris", "subj:France"): 3.5, ("Berlin", "subj:France"): 3.7}, ["L1"]),
}


@pytest.mark.parametrize("precision", [None, "float32"])
@pytest.mark.parametrize("case", sorted(ANSWERS_WITHOUT_EXPERT))
def test_a_model_that_answers_without_its_expert_is_not_certified(capitals_set, weights, case, precision):
    """The strengthened entanglement check (L1: P_ablated(o) <= 1/|O_k|; L2: o not the strict
    top token) rejects each violation alone, in the exact and in the deployed pass, where the
    old criterion (ablated error >= ε) alone would pass."""
    from verifier.passes.floating import Deployment

    entries, parts = ANSWERS_WITHOUT_EXPERT[case]
    deployment = None if precision is None else Deployment.named(precision)
    report = verify(capitals_set, _u(weights, entries), 0.01, deployment=deployment)
    rec = checks(report)["capital"]
    assert not rec.entanglement_ok and not report.certified
    assert rec.ablation_broken == rec.object_queries == 8            # the old criterion holds everywhere
    assert rec.l1_ok == ("L1" not in parts) and rec.l2_ok == ("L2" not in parts)
    assert rec.objects == 4 and rec.uniform_bound == 0.25
    found = [c for c in report.counterexamples if c["check"] == "entanglement"]
    assert found and all(c["subject"] == "France" and c["task"] == "capital" for c in found)
    assert all(c["failed"] == parts for c in found)
    for c in found:
        assert ("L1" in parts) == (c["p_ablated_upper"] > c["uniform_bound"])
        assert ("L2" in parts) == (c["l2_gap"] < 0)
    assert rec.localized == rec.object_queries - len(found) == 6     # both queries of France, the others fine
    assert rec.graded()["entanglement"] == 6 / 8
    from verifier.checks.report import report_json, summary

    js = report_json(report)
    task = next(t for t in js["tasks"] if t["name"] == "capital")
    assert task["graded"]["entanglement"] == 0.75 and task["localization"]["localized"] == 6
    assert js["localization"]["worst_p_ablated_upper"] >= task["localization"]["worst_p_ablated_upper"]
    assert "share of each task's queries certified" in summary(report)


def test_the_built_model_cannot_answer_without_its_experts(capitals_set, weights):
    """Hand-built: ablated, every logit of an object query is exactly 0 (uniform over the 23
    tokens): P(o) <= 1/23 against 1/|O_k|, and the object ties with every other token."""
    report = verify(capitals_set, weights, 0.01)
    for r in report.tasks:
        assert r.localized == r.l1_held == r.l2_held == r.object_queries > 0
        assert r.worst_p_ablated <= 1 / 23 * (1 + 1e-12) and r.worst_p_ablated <= r.uniform_bound
        assert r.min_gap == 0.0


def test_l1_threshold_is_exact():
    from fractions import Fraction

    from verifier.checks.localization import l1_threshold

    assert l1_threshold(1) == 0.0 and l1_threshold(0) == 0.0          # L1 is vacuous for one object
    for m in (2, 3, 7, 10, 49, 3 ** 20, 10 ** 17):
        x = l1_threshold(m)
        exact = 1 - Fraction(1, m)
        assert Fraction(x) >= exact and Fraction(float(np.nextafter(x, -np.inf))) < exact, m


def test_isolation_check_detects_a_non_modular_construction(capitals_set, capitals_model, monkeypatch):
    import construction.evidence as evidence
    import construction.experts as experts

    import dataclasses

    real = experts.expert_entries

    def leaky(taskset, k, residual):  # depends on how many tasks there are
        e = real(taskset, k, residual)
        if len(taskset.tasks) > 1:
            r, c, v = e.W_1
            return dataclasses.replace(e, W_1=(r, c, v + v))
        return e

    monkeypatch.setattr(evidence, "expert_entries", leaky)
    report = check_built(capitals_set, capitals_model, weights=capitals_model.instantiate())
    assert all(r.isolated is False for r in report.tasks)
    assert not report.certified


# --- command line -------------------------------------------------------------------------------


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "verifier", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_check_certifies_and_json():
    out = run("check", str(EXAMPLE), "--json", "-")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["verdict"] == "certified" and data["epsilon"] == 0.01
    assert [t["name"] for t in data["tasks"]] == ["capital", "continent", "located"]
    t = data["tasks"][0]
    assert {"bound", "width", "queries", "worst_error_bound", "worst_error_measured", "min_gate_margin",
            "checks"} <= set(t)


def test_cli_weights_round_trip_and_perturbed_fails(tmp_path, capitals_set, weights):
    path = tmp_path / "w.npz"
    assert run("build", str(EXAMPLE), "-o", str(path)).returncode == 0
    assert run("check", str(EXAMPLE), "--weights", str(path)).returncode == 0
    w = layout.load(path)
    i, j = _neuron(w, 0, "fact:France"), _neuron(w, 0, "fact:Japan")
    W_2 = w.experts[0].W_2.tolil()
    ci, cj = W_2[:, i].copy(), W_2[:, j].copy()
    W_2[:, i], W_2[:, j] = cj, ci
    bad = tmp_path / "bad.npz"
    layout.save(_expert(w, 0, W_2=W_2.tocsr()), bad)
    out = run("check", str(EXAMPLE), "--weights", str(bad), "--json", str(tmp_path / "r.json"))
    assert out.returncode == 1
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "not certified"
    assert any(c["subject"] == "France" and c["check"] == "error" for c in data["counterexamples"])
    assert "counterexample [error]" in out.stdout


def test_cli_bad_inputs_exit_2(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04 truncated")
    out = run("check", str(EXAMPLE), "--weights", str(junk))
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = run("check", str(tmp_path / "missing.yaml"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    out = run("explain", str(EXAMPLE), "the capital of Atlantis is")
    assert out.returncode == 2 and "Atlantis" in out.stderr


def test_cli_explain_and_inspect():
    out = run("explain", str(EXAMPLE), "the capital of France is")
    assert out.returncode == 0, out.stderr
    assert "routed to expert 0 (capital)" in out.stdout and "fact:France" in out.stdout and "next: Paris" in out.stdout
    out = run("inspect", str(EXAMPLE), "--json", "-")
    data = json.loads(out.stdout)
    assert [e["width"] for e in data["experts"]] == [10, 10, 9]
    assert [e["bound"] for e in data["experts"]] == [16, 16, 11]


def test_words_after_the_object_and_self_facts_certify():
    """Past ⋆2 the subject head sees two entities (or the same one twice, when s -> s)."""
    from construction.model import build
    from tasks.model import Task, TaskSet

    ts = TaskSet((
        Task("successor", ("after ⋆1 comes ⋆2 .", "⋆1 is followed by ⋆2 in order"),
             {"one": "two", "two": "three", "three": "three"}),
        Task("same", ("⋆1 equals ⋆2 exactly", "⋆1 same as ⋆2 itself ."), {"one": "one", "two": "two", "four": "one"}),
    ), epsilon=0.01)
    model = build(ts)
    report = check_built(ts, model, weights=model.instantiate())
    assert report.certified, report.counterexamples
    assert report.measured_worst <= report.closed_form_value
    assert [t.queries for t in report.tasks] == [28, 21]


def test_shared_gate_groups_decide_as_rows_do(monkeypatch):
    """With every gate input shared (HOT_READERS = 1) the rows of a batch fall into many
    groups, far more than the kernel caches (GATE_CLASSES), so groups are rebuilt and
    evicted; every decision and every enclosure must overlap the row-by-row ones."""
    import verifier.passes.forward as F
    from verifier.arithmetic import gate
    from tasks.synthetic import wikidata_like
    from construction.model import build
    from verifier.passes.batches import batches
    from tasks.structure import StructureTrie

    ts = wikidata_like(3000, seed=3)
    w = build(ts).instantiate()
    plain = F.Prepared(w)
    import verifier.passes.tables as T

    monkeypatch.setattr(T, "HOT_READERS", 1)
    shared = F.Prepared(w)
    assert shared.layer.wg_hot.sum() > 0 and not plain.layer.wg_hot.any()
    tmap = np.array([w.vocab.index(ts.vocabulary.token(i)) for i in range(len(ts.vocabulary))])
    rows = groups = 0
    for b in batches(ts, StructureTrie(ts), 500):
        a = run_batch(plain, tmap[b.tokens], b.valid_ptr, tmap[b.valid])
        c = run_batch(shared, tmap[b.tokens], b.valid_ptr, tmap[b.valid])
        assert np.array_equal(a.expert, c.expert)
        assert np.all((a.margin > 0) == (c.margin > 0))
        assert np.all(np.maximum(a.err_lo, c.err_lo) <= np.minimum(a.err_hi, c.err_hi))
        assert np.all(np.maximum(a.gate_lo, c.gate_lo) <= np.minimum(a.gate_hi, c.gate_hi))
        rows += len(b)
        groups += len({bytes(t) for t in b.tokens})
    assert rows > 1000 and groups > gate.GATE_CLASSES * 10


def test_certify_gives_the_l2_gap_of_an_object_query(weights):
    """The public per-query API reports L2's gap: 0 (a tie) for the built model, negative once
    U makes the object the top token without its expert, NaN without ablation or one object."""
    from verifier.checks.certify import certify

    query, other = ["the", "capital", "of", "France", "is"], ["the", "capital", "of"]
    built = certify(weights, [query, other], [["Paris"], ["France", "Germany"]], ablate=True)
    assert built.ablated_gap[0] == 0.0 and np.isnan(built.ablated_gap[1])
    answers = certify(_u(weights, {("Paris", "subj:France"): 0.5}), [query], [["Paris"]], ablate=True)
    assert answers.ablated_gap[0] < 0
    assert np.isnan(certify(weights, [query], [["Paris"]]).ablated_gap[0])


def test_l1_on_its_bound_is_decided_exactly():
    """Every token an object of the one task (V = |O_k| = 2): without the expert the built
    model is uniform, P(o) = 1/2 exactly on L1's bound, where the rounded enclosure of the
    error lies just below the threshold. The exact pass proves L1 (every other logit exactly
    0, z_o <= 0); a deployed float32 execution may round P(o) above 1/2, so it is not proven
    there. (Found by tests/test_fuzz.py.)"""
    from construction.model import build
    from tasks.model import Facts, Slot, Task, TaskSet, Template
    from verifier.passes.floating import Deployment

    ts = TaskSet((Task("0", (Template((Slot.SUBJECT, Slot.OBJECT)),), Facts({"0 #2": "0 #2", "0 #3": "0 #3"})),),
                 0.01, {})
    model = build(ts)
    w = model.instantiate()
    assert len(w.vocab) == 2
    exact = verify(ts, w, model.epsilon)
    rec = exact.tasks[0]
    assert exact.certified and rec.l1_held == rec.l2_held == rec.object_queries == 2
    assert rec.worst_p_ablated > 0.5 >= rec.uniform_bound          # the enclosure alone would not prove it
    deployed = verify(ts, w, model.epsilon, deployment=Deployment.named("float32"))
    assert not deployed.certified and deployed.tasks[0].l1_held == 0 and deployed.tasks[0].l2_held == 2


#: One task whose object queries ``X lives in`` have two valid next tokens: the object and
#: the template word "the" (a second template), and a second task beside it.
WORD_AND_OBJECT = DATA / "word_and_object.yaml"


def _word_and_object():
    from construction.model import build
    from tasks.reading import load_tasks

    ts = load_tasks(WORD_AND_OBJECT)
    model = build(ts)
    return ts, model.instantiate(), model.epsilon


def test_l1_encloses_the_objects_probability_alone():
    """For object queries whose valid set holds a word besides the object, the lower end of
    1 − P_ablated(o) the pass gives (``ablated_object_lo``) contains the exact value (the
    oracle's, at 60 digits, with the valid set {o}) and is at least the valid set's ablated
    error's lower end, for the built model and for one whose shared path predicts the word
    (or the object) without the expert."""
    from audit.oracle import Oracle, _Fingerprints
    from verifier.passes.batches import batches
    from verifier.passes.forward import Prepared
    from verifier.checks.verify import token_map

    ts, w, _ = _word_and_object()
    oracle = Oracle(dps=60)
    for edit in ({}, {("the", "subj:Ann"): 3.0}, {("Rome", "subj:Ann"): 3.5}):
        we = _u(w, edit)
        prep, tmap, fp = Prepared(we), token_map(ts, we, "weights"), _Fingerprints(we)
        seen = 0
        for b in batches(ts):
            tokens = tmap[b.tokens]
            res = run_batch(prep, tokens, b.valid_ptr, tmap[b.valid],
                            target=np.where(b.target >= 0, tmap[b.target], -1))
            for i in np.flatnonzero(b.target >= 0):
                valid = tmap[b.valid[b.valid_ptr[i]:b.valid_ptr[i + 1]]]
                if valid.size < 2:
                    assert res.ablated_object_lo[i] == res.ablated_lo[i]
                    continue
                seen += 1
                o = int(tmap[b.target[i]])
                ex = oracle.evaluate(we, fp, tuple(int(t) for t in tokens[i]), frozenset({o}), True, 60)
                assert mpmath.mpf(float(res.ablated_object_lo[i])) <= ex["ablated"], (edit, i)
                assert res.ablated_object_lo[i] >= res.ablated_lo[i]
        assert seen == 4                     # "X lives in" for the four subjects of 'home'


@pytest.mark.parametrize("precision", [None, "float32"])
def test_l1_passes_a_model_that_predicts_the_word_and_fails_one_that_predicts_the_object(precision):
    """Without its expert the model may rightly predict the template word "the" after
    "Ann lives in" (shared knowledge): P(valid set) is then far above 1/|O_k| but P(Rome)
    is below it, and L1 holds (a bound on the valid set's mass would have refused it).
    Predicting the object itself without the expert fails L1 (and L2), in the exact and
    the deployed pass."""
    from verifier.passes.floating import Deployment

    ts, w, eps = _word_and_object()
    deployment = None if precision is None else Deployment.named(precision)
    word = verify(ts, _u(w, {("the", "subj:Ann"): 3.0}), eps, deployment=deployment)
    home = checks(word)["home"]
    assert home.objects == 3 and home.l1_ok and home.l2_ok
    assert home.min_ablated_lower < 1 - 1 / 3 < 1 - home.worst_p_ablated   # P(valid) > 1/3 > P(o)
    obj = verify(ts, _u(w, {("Rome", "subj:Ann"): 3.5}), eps, deployment=deployment)
    home = checks(obj)["home"]
    assert not home.l1_ok and not home.l2_ok and not obj.certified
    found = [c for c in obj.counterexamples if c["check"] == "entanglement"]
    assert found and all(c["subject"] == "Ann" and "L1" in c["failed"] for c in found)
    assert all(c["p_ablated_upper"] > c["uniform_bound"] for c in found)


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 6), st.integers(1, 40), st.booleans())
def test_row_classes_of_repeated_rows_are_their_originals(seed, kinds, n, collide):
    """The classes of rows each a copy of some row of ``part`` (every row of part copied at
    least once) are the classes of part's rows they copy: the same ids, also when every
    hash collides (the rows then ranked by their bytes); None for wide rows."""
    import verifier.passes.forward as F
    from verifier.arithmetic.interval import SparseInterval

    rng = np.random.default_rng(seed)
    width = int(rng.integers(1, 6))
    base = sp.random(kinds, 7, density=0.4, random_state=rng, format="csr")
    base.data = rng.choice([0.0, -0.0, 1.0, 2.5, np.ldexp(1.0, -1074)], base.nnz)
    base = sp.csr_matrix(base[:, :width] if width < 7 else base)
    base.sort_indices()
    part = SparseInterval(base.shape, base.indptr.astype(np.int64), base.indices.astype(np.int64),
                          base.data.astype(np.float64), np.abs(base.data) * 0.5)
    which = np.concatenate([np.arange(kinds), rng.integers(0, kinds, n)])
    rng.shuffle(which)
    mix = F._MIX
    try:
        if collide:
            F._MIX = np.zeros_like(mix)
        want = F._sparse_row_classes(part.rows(which))
        got = F._repeated_row_classes(part, which)
        wide = F._repeated_row_classes(part, which, max_nnz=0)
    finally:
        F._MIX = mix
    assert got is not None and np.array_equal(got, want)
    assert wide is None or int(np.diff(part.indptr).max(initial=0)) == 0
