"""Certified accessibility (verifier.passes.boxes, verifier.accessibility.accessible, training.cramming, the command).

The box pass is held to an independent 60-digit evaluation at random points inside boxes
and to the project's certified pass on the task set's queries; a certified sequence is
refused once its box is widened to hold a prompt that says something else; the token
enumeration is counted by hand on a model small enough to reason about; the command's
JSON, exit statuses and refusals are checked.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.sparse as sp

from audit.exact import exact_logits
from layout import Expert, Weights
from tasks.errors import TaskError
from verifier.accessibility import accessible as A
from verifier.accessibility import report as R
from verifier.passes import boxes
from verifier.passes.reference import forward

CAPITALS = "examples/capitals.yaml"


@pytest.fixture(scope="module")
def weights(capitals_model):
    return capitals_model.instantiate()


@pytest.fixture(scope="module")
def model(weights):
    return boxes.prepare(weights)


def _ids(weights, text: str) -> list[int]:
    index = {t: i for i, t in enumerate(weights.vocab)}
    return [index[t] for t in text.split("|")]


# --- the box pass -----------------------------------------------------------------------------------


def test_random_points_inside_boxes_land_inside_the_enclosures(weights, model):
    """Soft prompts around perturbed embeddings (radius 0.05 per coordinate): at random points
    of each box, the 60-digit gate scores lie in the gate enclosures, every expert attaining
    the maximum is a candidate, and its exact logits lie in that candidate's enclosures."""
    rng = np.random.default_rng(3)
    V, m, B, rad = len(weights.vocab), 2, 4, 0.05
    soft = (weights.E[rng.integers(0, V, B * m)].toarray().reshape(B, m, weights.d)
            + rng.normal(0, 0.2, (B, m, weights.d)))
    tokens = np.concatenate([np.full((B, 1), weights.bos), np.full((B, m), -1), rng.integers(0, V, (B, 1))], axis=1)
    st = boxes.step(model, tokens, soft, rad)
    for b in range(B):
        for _ in range(2):
            x = soft[b] + rng.uniform(-rad, rad, soft[b].shape)
            ex = exact_logits(weights, [int(tokens[b, 0])] + list(x) + [int(tokens[b, -1])])
            gates = np.array([float(g) for g in ex["gates"]])
            assert np.all(st.gate_lo[b] <= gates) and np.all(gates <= st.gate_hi[b])
            for e, logits in ex["logits"].items():
                assert st.candidates[b, e]
                pair = np.flatnonzero((st.pair_row == b) & (st.pair_expert == e))[0]
                lo, hi = st.logit_lo[pair], st.logit_hi[pair]
                assert all(lo[t] <= logits[t] <= hi[t] for t in range(V))
                if st.token[b] >= 0:                           # a certified token is the exact argmax
                    assert int(np.argmax([float(v) for v in logits])) == st.token[b]


def test_the_box_pass_agrees_with_the_certified_pass_on_every_query(capitals_set, weights, model):
    """Radius 0, every query of the task set: the certified token is the float64 reference's
    argmax and the routed expert is the certified pass's (verifier.passes.forward); a query the
    box pass leaves undecided has several most likely tokens (a tie the task set makes)."""
    from verifier.passes.forward import run_batch

    index = {t: i for i, t in enumerate(weights.vocab)}
    queries = sorted({s[:p] for s, *_ in capitals_set.sentences() for p in range(1, len(s))})
    for p in range(1, weights.n_positions):
        qs = [q for q in queries if len(q) == p]
        tokens = np.array([[index[t] for t in q] for q in qs])
        st = boxes.step(model, np.concatenate([np.full((len(qs), 1), weights.bos), tokens], axis=1))
        ref = run_batch(weights, tokens, np.arange(len(qs) + 1), np.zeros(len(qs), np.int64))
        for i in range(len(qs)):
            probs, expert, _ = forward(weights, tokens[i].tolist())
            assert st.routed[i] == ref.expert[i] == expert
            if st.token[i] >= 0:
                assert st.token[i] == np.argmax(probs) == ref.predicted[i]
            else:
                assert np.sum(probs >= probs.max() - 1e-9) > 1
    rows = np.array([[weights.bos] + _ids(weights, "the|capital|of|France|is")])
    st = boxes.step(model, rows)
    ex = exact_logits(weights, rows[0].tolist())
    (e, logits), = ex["logits"].items()
    assert all(st.logit_lo[0, t] <= logits[t] <= st.logit_hi[0, t] for t in range(len(weights.vocab)))
    assert weights.vocab[st.token[0]] == "Paris"


def test_a_row_is_enclosed_alike_alone_and_in_any_batch(weights, model):
    """The pass works row by row (fixed term counts): a prompt's enclosures, hence its proof,
    are bit for bit those it gets alone, whatever else shares its batch."""
    rng = np.random.default_rng(5)
    V, B = len(weights.vocab), 12
    rows = np.concatenate([np.full((B, 1), weights.bos), rng.integers(0, V, (B, 3))], axis=1)
    soft = weights.E[rng.integers(0, V, B)].toarray()[:, None, :] + rng.normal(0, 0.1, (B, 1, weights.d))
    rows[:, 1] = -1
    together = boxes.step(model, rows, soft, 2.0 ** -11)
    for b in (0, 7):
        alone = boxes.step(model, rows[b:b + 1], soft[b:b + 1], 2.0 ** -11)
        pairs = np.flatnonzero(together.pair_row == b)
        assert np.array_equal(alone.logit_lo, together.logit_lo[pairs])
        assert np.array_equal(alone.logit_hi, together.logit_hi[pairs])
        assert np.array_equal(alone.gate_lo[0], together.gate_lo[b]) and alone.margin[0] == together.margin[b]


def test_a_certified_sequence_is_refused_once_its_box_holds_a_prompt_that_says_otherwise(weights, model):
    """'France' is continued by '... Paris ...'; the box of radius 1 around E[France] holds
    E[Germany] (0/1 embeddings), at which the exact model says something else at some step:
    recheck refuses the proof there, and keeps it at its own radius and at a small one."""
    r = A.run(model, np.array([_ids(weights, "France")]), A.max_continuation(weights, 1))
    proof = r.proof(0, tuple(_ids(weights, "France")), None, 0.0)
    assert len(proof.steps) >= 3 and A.recheck(model, proof) == len(proof.steps)
    assert A.recheck(model, proof, radius=2.0 ** -11) == len(proof.steps)
    germany = weights.E[_ids(weights, "Germany")].toarray()[0]
    france = weights.E[_ids(weights, "France")].toarray()[0]
    assert np.max(np.abs(germany - france)) <= 1.0
    differs = None
    for k in range(len(proof.steps)):
        logits = exact_logits(weights, [weights.bos, germany] + list(proof.tokens[:k]))["logits"]
        if any(int(np.argmax([float(v) for v in lg])) != proof.tokens[k] for lg in logits.values()):
            differs = k
            break
    assert differs is not None                      # the widened box really leaves the region
    assert A.recheck(model, proof, radius=1.0) <= differs


# --- token prompts, counted by hand -----------------------------------------------------------------


def _tiny() -> Weights:
    """V = {a, b, c}, d = 2, no heads, one expert that outputs 0, three positions:
    E[a] = (1, 0), E[b] = (0, 1), E[c] = (1, 1); logit(a) = h_2, logit(b) = h_1, logit(c) = 0.
    After a comes b, after b comes a, after c a tie of a and b (undecided)."""
    csr = lambda a: sp.csr_matrix(np.asarray(a, np.float64))  # noqa: E731
    return Weights(vocab=("a", "b", "c"), E=csr([[1, 0], [0, 1], [1, 1], [0, 0]]), P=csr(np.zeros((3, 2))),
                   heads=(), W_G=csr([[0, 0]]), b_G=np.zeros(1),
                   experts=(Expert(csr(np.zeros((1, 2))), np.zeros(1), csr(np.zeros((2, 1)))),),
                   U=csr([[0, 1], [1, 0], [0, 0]]), expert_tasks=("t",))


def test_token_prompts_are_counted_as_by_hand():
    model = boxes.prepare(_tiny())
    one, tokens, _ = A.token_level(model, 1)
    # a -> b a, b -> a b, c -> undecided: lengths 1 and 2 have {b, a} and {ba, ab}
    assert one.prompts == 3 and one.n_max == 2
    assert one.distinct == [2, 2] and one.undecided == [1, 0]
    assert tokens.tolist() == [[1, 0], [0, 1], [-1, -1]]
    assert set(one.sequences) == {(1,), (0,), (1, 0), (0, 1)}
    two, tokens, _ = A.token_level(model, 2)
    # the last token decides: ?a -> b, ?b -> a, ?c undecided (3 of 9)
    assert two.prompts == 9 and two.n_max == 1 and two.distinct == [2] and two.undecided == [3]
    assert A.prompts_of(3, 2, 0, 9).tolist()[5] == [1, 2] and A.prompt_index(3, (1, 2)) == 5


def _two_experts(second_writes: int) -> Weights:
    """V = {a, b}, d = 2, no heads: g_k = h_k (expert 0 wins on a, expert 1 on b); expert 0 adds
    10·(h_1 + h_2) to coordinate 0 (token a's logit), expert 1 to coordinate ``second_writes``."""
    csr = lambda a: sp.csr_matrix(np.asarray(a, np.float64))  # noqa: E731
    w2 = np.zeros((2, 1))
    w2[second_writes, 0] = 10.0
    return Weights(vocab=("a", "b"), E=csr([[1, 0], [0, 1], [0, 0]]), P=csr(np.zeros((2, 2))), heads=(),
                   W_G=csr(np.eye(2)), b_G=np.zeros(2),
                   experts=(Expert(csr([[1, 1]]), np.zeros(1), csr([[10], [0]])),
                            Expert(csr([[1, 1]]), np.zeros(1), csr(w2))),
                   U=csr(np.eye(2)), expert_tasks=("s", "t"))


def test_a_step_whose_routing_may_flip_is_certified_only_when_every_expert_agrees():
    centre = np.array([[[0.5, 0.5]]])
    rows = np.array([[2, -1]])                                        # BOS, one soft vector
    disagree, agree = boxes.prepare(_two_experts(1)), boxes.prepare(_two_experts(0))
    for radius in (0.0, 0.1):                                         # an exact tie of the gate, and a box around it
        st = boxes.step(disagree, rows, centre, radius)
        assert st.candidates[0].tolist() == [True, True] and st.token[0] == -1 and st.margin[0] <= 0
        st = boxes.step(agree, rows, centre, radius)
        assert st.candidates[0].tolist() == [True, True] and st.token[0] == 0 and st.margin[0] > 0
    st = boxes.step(disagree, rows, np.array([[[0.9, 0.1]]]), 0.1)   # the box stays on expert 0's side
    assert st.candidates[0].tolist() == [True, False] and st.token[0] == 0 and st.routed[0] == 0


def test_a_routing_gap_is_enclosed_as_a_difference():
    """g_0 = x_1 + x_2 and g_1 = x_1 + x_2/2 around x = (1, 1), radius 0.3: the scores' own
    enclosures overlap ([1.4, 2.6] and [1.05, 1.95]), their difference x_2/2 lies in
    [0.35, 0.65]: expert 1 never wins and the step is certified. At x = (1, 0) ± 0.3 the
    difference x_2/2 may be 0 or below: both stay, and the experts disagree."""
    w = _two_experts(1).replace(W_G=sp.csr_matrix(np.array([[1.0, 1.0], [1.0, 0.5]])))
    model = boxes.prepare(w)
    rows = np.array([[2, -1]])
    st = boxes.step(model, rows, np.array([[[1.0, 1.0]]]), 0.3)
    assert st.gate_hi[0, 1] > st.gate_lo[0, 0]                        # the separate enclosures overlap
    assert st.candidates[0].tolist() == [True, False] and st.token[0] == 0 and st.routed[0] == 0
    rng = np.random.default_rng(0)
    for _ in range(20):                                                # and the exact model agrees inside the box
        x = np.array([1.0, 1.0]) + rng.uniform(-0.3, 0.3, 2)
        assert exact_logits(w, [2, x])["logits"].keys() == {0}
    st = boxes.step(model, rows, np.array([[[1.0, 0.0]]]), 0.3)
    assert st.candidates[0].tolist() == [True, True] and st.token[0] == -1
    x = np.array([1.0, -0.3])                                          # a point of that box where expert 1 wins
    assert exact_logits(w, [2, x])["logits"].keys() == {1}


def test_the_support_holds_the_embeddings_and_nothing_beyond():
    sup = A.support(_tiny())
    assert sup.contains(_tiny().E[:3].toarray())
    assert not sup.contains(np.array([1.0, 1.0 + 2.0 ** -40]))        # out of coordinate 1's range
    assert not sup.contains(np.array([-1e-9, 0.0]))
    wide = A.Support(np.array([-2.0, -2.0]), np.array([2.0, 2.0]), 1.0)
    assert wide.contains(np.array([0.6, 0.8])) and not wide.contains(np.array([0.6, 0.81]))   # the ball


def test_the_paper_bound_of_the_tiny_model():
    b = A.paper_bound(_tiny())
    assert b.r == pytest.approx(math.sqrt(2))
    assert b.C == pytest.approx(2 * math.log(1 + 2 * math.sqrt(2) * 1024) / math.log(3))
    assert b.C_aniso == pytest.approx(2 * math.log(1 + 1024) / math.log(3))
    assert b.log10_count(2) == pytest.approx(4 * math.log10(1 + 2 * math.sqrt(2) * 1024))


def test_n50_and_the_fit():
    assert A.n50([8, 8, 2], [8, 8, 8]) == (pytest.approx(2 + 0.5 / 0.75), False)
    assert A.n50([1, 0], [8, 8]) == (0.0, False)
    assert A.n50([5, 4], [8, 8]) == (2.0, True)                 # the positions end it: a lower bound
    assert A.fit_line([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == (pytest.approx(2.0), pytest.approx(0.0))
    assert A.fit_line([1.0], [2.0]) is None


# --- facts and refusals on capitals -----------------------------------------------------------------


def test_every_fact_object_of_capitals_is_accessible_by_two_token_prompts(capitals_set, weights, model):
    report = A.token_accessibility(model, capitals_set, 2)
    assert len(report.facts) == capitals_set.n_facts
    for f in report.facts:
        assert f.proof is not None and f.kind == "token"
        assert weights.vocab[f.proof.tokens[0]] == f.object and A.recheck(model, f.proof) == len(f.proof.steps)
    own = [f for f in report.facts if f.own_query is not None]        # 'France lies in' has 3 tokens: none here
    assert own == []
    assert report.union[0] == len({a.tokens for a in report.sequences if len(a.tokens) == 1})


def test_a_sequence_is_classed_with_its_prompt(capitals_set, weights, model):
    """A certified sequence's class is of its prompt and itself together, the best that any
    prompt of m tokens yielding it gives, and its proof is the first such prompt: 'France' ->
    'has capital Paris' is a whole sentence of the task set; 'Paris' after three tokens is
    one too ('France has capital'), though the first three-token prompt that yields it,
    'a a France', makes none; 'France' -> 'has capital Paris Paris' is in no sentence.
    Checked against every prompt of up to 3 tokens."""
    report = A.token_accessibility(model, capitals_set, 3)
    sentences = A.Sentences.of(capitals_set, weights)
    text = lambda ids: "|".join(weights.vocab[t] for t in ids)  # noqa: E731
    by = {(a.m, text(a.tokens)): (a.klass, text(report.class_proof(a).prompt)) for a in report.sequences}
    assert by[(1, "has|capital|Paris")] == (A.SENTENCE, "France")
    assert by[(3, "Paris")] == (A.SENTENCE, "France|has|capital")
    assert by[(1, "has|capital|Paris|Paris")] == (A.OUTSIDE, "France")
    rank = [A.OUTSIDE, A.PART, A.SENTENCE]
    V = len(weights.vocab)
    for m in (1, 2, 3):
        _, table, _ = A.token_level(model, m)
        best = {}                                             # every prompt, by hand
        for i, row in enumerate(table):
            prompt = tuple(int(t) for t in A.prompts_of(V, m, i, i + 1)[0])
            for n in range(1, row.shape[0] + 1):
                if row[n - 1] < 0:
                    break
                seq = tuple(int(t) for t in row[:n])
                klass = sentences.classify(prompt + seq)
                if seq not in best or rank.index(klass) > rank.index(best[seq][0]):
                    best[seq] = (klass, text(prompt))
        here = {k[1]: v for k, v in by.items() if k[0] == m}
        assert here == {text(seq): v for seq, v in best.items()}


def test_too_many_prompts_are_refused_with_the_count(weights):
    with pytest.raises(TaskError) as info:
        A.choose_m(weights, 500, 2)
    assert "552" in str(info.value) and "--max-prompts" in str(info.value)
    assert A.choose_m(weights, 552, 2)[0] == 2
    m, why = A.choose_m(weights, 600)
    assert m == 2 and "12,719" in why
    with pytest.raises(TaskError):
        A.choose_m(weights, 10 ** 9, weights.n_positions)        # no position left to generate into


# --- the search and the command ---------------------------------------------------------------------


def test_the_search_model_is_the_layout_forward_pass(weights):
    torch = pytest.importorskip("torch")
    from training.cramming import SoftModel

    sm = SoftModel(weights, torch.float64)
    ids = _ids(weights, "the|capital|of|France|is|Paris")
    X = torch.from_numpy(weights.E[ids[:2]].toarray())[None]
    logits = sm.logits(X, np.array([ids[2:]]))[0].numpy()
    for k in range(4):
        probs, _, _ = forward(weights, ids[:2 + k])
        assert np.allclose(np.exp(logits[k] - logits[k].max()) / np.exp(logits[k] - logits[k].max()).sum(), probs)


def _run(capsys, *argv):
    from cli.main import main

    try:
        code = main(["accessible", CAPITALS, *argv])
    except SystemExit as exc:                 # argparse's own refusals (one line, status 2)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_reports_json_and_exit_statuses(capsys, capitals_set, weights, model):
    code, out, err = _run(capsys, "--no-soft", "--token-m", "2", "--json", "-", "--quiet")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["format"] == "moe-accessibility/1" and data["every_object_accessible"] is True
    assert data["token_prompts"]["m"] == 2 and [lv["prompts"] for lv in data["token_prompts"]["levels"]] == [23, 529]
    assert data["soft_prompts"] is None and data["facts"]["object_accessible"] == data["facts"]["total"] == 13
    sentences = [tuple(s) for s, *_ in capitals_set.sentences()]

    def klass(tokens: tuple) -> str:                     # the class, read from the task set's sentences alone
        if tokens in sentences:
            return A.SENTENCE
        parts = any(s[a:a + len(tokens)] == tokens for s in sentences for a in range(len(s)))
        return A.PART if parts else A.OUTSIDE

    for seq in data["sequences"]:
        for key in ("proof", "class_proof"):             # each proof yields the sequence, certified again
            if key in seq:
                proof = R.proof_from_json(data["proofs"][seq[key]], weights.vocab)
                assert [weights.vocab[t] for t in proof.tokens[:seq["n"]]] == seq["tokens"]
                assert A.recheck(model, proof) == len(proof.steps) and len(proof.prompt) == seq["m"]
        shown = data["proofs"][seq.get("class_proof", seq["proof"])]
        assert klass(tuple(shown["prompt"] + seq["tokens"])) == seq["class"]
    assert {s["class"] for s in data["sequences"]} == {A.SENTENCE, A.PART, A.OUTSIDE}
    assert any("class_proof" in s for s in data["sequences"])
    code, out, _ = _run(capsys, "--no-soft", "--token-m", "1", "--quiet")      # one token never names an object
    assert code == 1 and "NOT every fact's object" in out


def test_the_command_certifies_soft_prompts(capsys, weights, model):
    pytest.importorskip("torch")
    code, out, _ = _run(capsys, "--token-m", "1", "--soft-m", "5", "--targets", "2", "--steps", "30",
                        "--objects", "0", "--json", "-", "--quiet")
    assert code == 1
    soft = json.loads(out)["soft_prompts"]
    assert soft["radius"] == 2.0 ** -11 and [lv["m"] for lv in soft["levels"]] == [5]
    assert soft["bound"]["d"] == weights.d and soft["bound"]["V"] == len(weights.vocab) and soft["in_support"]
    data = json.loads(out)
    boxes_ = [t for t in soft["targets"] if t["purpose"] == A.TOKEN_BOX and t["certified"]]
    assert boxes_                                   # the token prompts' boxes at radius 2^-11
    for t in boxes_:
        proof = R.proof_from_json(data["proofs"][t["proof"]], weights.vocab)
        assert proof.radius == 2.0 ** -11 and A.recheck(model, proof) == len(t["target"])


def test_a_box_too_wide_to_certify_what_its_centre_certifies_is_told_apart(capitals_set, weights, model):
    """'France' -> 'has' is certified at E[France] (radius 0); a search that proposes E[France]
    for it is certified on the box of radius 2^-11 and not on that of radius 1/4, where the
    report names the box's width as the cause. A proposal 'found' whose centre does not say
    its target is no such case, nor is one certified on its box."""
    ids = {t: i for i, t in enumerate(weights.vocab)}
    france = weights.E[[ids["France"]]].toarray()[None]

    def propose(targets, m, seed):                          # every target proposed at E[France], "found"
        return np.repeat(france, len(targets), axis=0), np.ones(len(targets), bool)

    jobs = [((ids["has"],), A.RANDOM), ((ids["Paris"],), A.RANDOM)]
    narrow = A._search_level(model, propose, 1, jobs, 1, 0, 2.0 ** -11)
    wide = A._search_level(model, propose, 1, jobs, 1, 0, 0.25)
    assert [(t.certified, t.centre_only) for t in narrow] == [(True, False), (False, False)]
    assert [(t.certified, t.centre_only) for t in wide] == [(False, True), (False, False)]
    tokens = A.token_accessibility(model, capitals_set, 1)
    for radius, says in ((2.0 ** -11, False), (0.25, True)):
        boxes_ = A._token_boxes(model, tokens, radius)
        assert boxes_ and [t.centre_only for t in boxes_] == [not t.certified for t in boxes_]
        assert all(A.recheck(model, p) == len(p.steps) for p in tokens.proofs)       # each centre: certified
        soft = A.SoftReport(2 * radius, radius, A.paper_bound(weights, 2 * radius), wide + boxes_, [], None, [], True,
                            {"per_length": 1, "restarts": 1, "objects_searched": 0, "objects_unreached_by_tokens": 0})
        lines = R._render_soft(soft, weights, 10)
        width = [x for x in lines if "certified at the centre of their box" in x]
        assert len(width) == 1 and "their width, not a proven change" in width[0]
        assert (f"{len(soft.centre_only)} targets" in width[0]) and (width[0].lstrip().startswith("no box")) == says
        assert "centres X only" in lines[-1]


@pytest.mark.parametrize("argv, says", [
    (["--token-m", "3", "--max-prompts", "1000", "--no-soft"], "12,719"),
    (["--soft-m", "6"], "--soft-m 6"),
    (["--targets", "0"], "expected a whole number >= 1"),
    (["--max-prompts", "0"], "argument --max-prompts: expected a whole number >= 1, got 0"),
    (["--max-prompts", "-5"], "argument --max-prompts: expected a whole number >= 1, got -5"),    # said '>= 0'
    (["--token-m", "-1"], "argument --token-m: expected a whole number >= 1, got -1"),
    (["--no-soft", "--soft-m", "2"], "--no-soft"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, says):
    code, out, err = _run(capsys, *argv, "--quiet")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err
