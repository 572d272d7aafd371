"""The optional training package: a tiny model trains, exports, and the verifier agrees.

Skipped when torch (the ``train`` extra) is missing. One training run (about 2 s on one
core) is shared by the tests through a module fixture.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tasks.io import dump_tasks  # noqa: E402
from training.compare import agreement, certified_pass, routing_failures  # noqa: E402
from training.data import query_data  # noqa: E402
from training.export import to_weights  # noqa: E402
from training.metrics import entropy, majority_mapping, parameter_counts, purity, routing_matrix  # noqa: E402
from training.model import ModelConfig, MoETransformer  # noqa: E402
from training.objectives import load_balancing, objective_loss, task_router, valid_error, valid_set_ce  # noqa: E402
from training.loop import TrainConfig, evaluate, train  # noqa: E402
import layout  # noqa: E402
from verifier.passes import reference  # noqa: E402
from cli.main import main as verifier_main  # noqa: E402
from verifier.checks.verify import verify  # noqa: E402

TINY = TrainConfig(objective="router", d=32, n_heads=2, d_head=8, expert_width=16, steps=600, lr=3e-3, warmup=20,
                   seed=0, threads=1)


@pytest.fixture(scope="module")
def trained(capitals_set):
    data = query_data(capitals_set)
    result = train(capitals_set, TINY, data=data, log_every=0)
    return data, result, evaluate(result.model, data)


def test_query_data_matches_the_task_set(capitals_set):
    data = query_data(capitals_set)
    iter_queries = __import__("tasks.queries", fromlist=["iter_queries"]).iter_queries
    assert len(data) == sum(1 for _ in iter_queries(capitals_set))
    assert data.tokens.shape[1] == capitals_set.L and (data.tokens[:, 0] == data.bos).all()
    i = next(i for i in range(len(data)) if data.prefix(i) == ("the", "capital", "of", "France", "is"))
    assert [data.vocab[v] for v in np.flatnonzero(data.valid[i])] == ["Paris"]
    assert data.object_query[i] and data.task_names[data.determined[i]] == "capital"


def test_training_learns_and_routes_by_task(trained):
    data, result, ev = trained
    assert result.steps == TINY.steps
    assert ev.object_accuracy > 0.5
    assert ev.purity >= 0.9                       # the task-router loss at work
    assert ev.routing.sum() == int((data.determined >= 0).sum())


def test_export_agrees_with_the_verifier(trained, capitals_set, tmp_path):
    """Per query: same expert in the certified pass, float64 error inside its enclosure."""
    data, result, ev = trained
    weights = to_weights(result.model, capitals_set, "majority", routing=ev.routing, config=TINY)
    path = tmp_path / "trained.npz"
    layout.save(weights, path)
    loaded = layout.load(path)
    assert loaded.gate_mode == "top1-scaled"
    report = verify(capitals_set, loaded, 0.01)
    assert np.array_equal(report.routing_matrix, ev.routing)
    cert = certified_pass(capitals_set, loaded, data)
    assert np.array_equal(cert.expert, ev.expert)
    assert np.all(cert.err_lo - 1e-9 <= ev.error) and np.all(ev.error <= cert.err_hi + 1e-9)
    a = agreement(ev, cert)
    assert a["expert_mismatches"] == 0 and a["outside"] == 0
    # the verifier counts a misrouted query once per consistent task
    names = list(capitals_set.names)
    serves = np.array([names.index(t) if t in names else -1 for t in loaded.expert_tasks])
    served = serves[cert.expert]
    rows = np.arange(len(data))
    bad = ~((cert.margin > 0) & (served >= 0) & data.consistent[rows, np.maximum(served, 0)])
    assert sum(r.misrouted for r in report.tasks) == int(data.consistent[bad].sum())
    rf = routing_failures(data, cert, loaded.expert_tasks)
    assert rf["determined_misrouted"] + rf["shared_misrouted"] == int(bad.sum())
    assert report.measured_worst >= ev.max_error - 1e-9
    assert max(r.worst_error_lower for r in report.tasks) <= ev.max_error + 1e-9
    # and the plain float reference pass, query by query
    for i in range(len(data)):
        n = int(data.lengths[i])
        p, e, _ = reference.forward(loaded, data.tokens[i, 1: n + 1].tolist())
        assert e == ev.expert[i]
        assert abs(float(p[~data.valid[i]].sum()) - ev.error[i]) < 1e-9


def test_unlabelled_experts_are_all_misrouted(trained, capitals_set):
    data, result, ev = trained
    weights = to_weights(result.model, capitals_set)          # default: expert_tasks all ""
    assert weights.expert_tasks == ("",) * 3
    report = verify(capitals_set, weights, 0.01)
    assert not report.certified
    assert all(r.misrouted == r.queries for r in report.tasks)


def test_verifier_cli_on_trained_weights(trained, capitals_set, tmp_path):
    data, result, ev = trained
    yaml_path, npz, out = tmp_path / "tasks.yaml", tmp_path / "trained.npz", tmp_path / "report.json"
    dump_tasks(capitals_set, yaml_path)
    layout.save(to_weights(result.model, capitals_set, "declared", config=TINY), npz)
    status = verifier_main(["check", str(yaml_path), "--weights", str(npz), "--json", str(out), "--quiet"])
    assert status in (0, 1)
    rep = json.loads(out.read_text(encoding="utf-8"))
    assert [t["name"] for t in rep["tasks"]] == list(capitals_set.names)
    assert rep["parameters"]["objective"] == "router"


def test_torch_forward_is_the_layout_forward(capitals_set):
    """An untrained float64 model: torch and verifier.passes.reference give the same numbers."""
    data = query_data(capitals_set)
    cfg = ModelConfig(vocab_size=data.V, n_positions=data.n_positions, d=16, n_heads=2, d_head=4, n_experts=3,
                      expert_width=8, gate_mode="top1-scaled")
    model = MoETransformer(cfg, generator=torch.Generator().manual_seed(1)).double()
    with torch.no_grad():
        model.b_1.normal_(generator=torch.Generator().manual_seed(2))
        model.b_G.normal_(generator=torch.Generator().manual_seed(3))
        out = model(torch.from_numpy(data.tokens), torch.from_numpy(data.lengths))
        probs = torch.softmax(out.logits, -1).numpy()
    weights = to_weights(model, capitals_set)
    for i in range(0, len(data), 5):
        n = int(data.lengths[i])
        p, e, g = reference.forward(weights, data.tokens[i, 1: n + 1].tolist())
        assert e == int(out.expert[i])
        np.testing.assert_allclose(g, out.gate[i].numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(p, probs[i], rtol=1e-10, atol=1e-14)


def test_objectives():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, False], [False, False, True]])
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(valid_set_ce(logits, valid), -torch.log((p * valid).sum(-1)))
    torch.testing.assert_close(valid_error(logits, valid), (p * ~valid).sum(-1))

    class Out:  # the fields the routing losses read
        pass

    o = Out()
    o.gate = torch.zeros(4, 2, dtype=torch.float64)
    o.gate_probs = torch.full((4, 2), 0.5, dtype=torch.float64)
    o.expert = torch.tensor([0, 1, 0, 1])
    assert float(load_balancing(o)) == pytest.approx(1.0)      # balanced: K · Σ (1/K)(1/K) = 1
    o.expert = torch.tensor([0, 0, 0, 0])
    o.gate_probs = torch.tensor([[1.0, 0.0]] * 4, dtype=torch.float64)
    assert float(load_balancing(o)) == pytest.approx(2.0)      # collapsed: K
    det = torch.tensor([0, -1, 1, -1])
    o.gate = torch.tensor([[5.0, 0.0], [0.0, 0.0], [0.0, 5.0], [9.0, 0.0]], dtype=torch.float64)
    expected = torch.nn.functional.cross_entropy(o.gate[[0, 2]], torch.tensor([0, 1]))
    torch.testing.assert_close(task_router(o, det), expected)
    with pytest.raises(ValueError):
        objective_loss("nope", o, valid, det)


def test_routing_measures():
    m = routing_matrix(np.array([0, 0, 1, 1, -1]), np.array([2, 2, 0, 1, 1]), 2, 3)
    assert m.tolist() == [[0, 0, 2], [1, 1, 0]]
    assert purity(m) == pytest.approx(0.75)
    assert entropy(m) == pytest.approx(0.5)
    # expert 2 is task 0's; experts 0 and 1 both get task 1: only one may name it
    mapping = majority_mapping(m, ("a", "b"))
    assert mapping[2] == "a" and sorted(mapping[:2]) == ["", "b"]
    assert majority_mapping(np.array([[5, 4], [3, 0]]), ("a", "b")) == ("b", "a")  # one-to-one beats greedy


def test_parameter_counts_count_nonzeros(capitals_model):
    weights = capitals_model.instantiate()
    routed = np.zeros(4, np.int64)
    c = parameter_counts(weights, routed)
    nnz = sum(int(np.count_nonzero(m.data if hasattr(m, "data") and not isinstance(m, np.ndarray) else m))
              for _, m in weights.arrays())
    assert c["total"] == nnz and c["shared"] < c["active"] <= c["total"]


def test_sweep_smoke(tmp_path):
    """The sweep CLI end to end on a 2-task set (a few seconds): report, JSON, transcript, re-render."""
    import importlib.util

    from training import sweep

    out, wdir = tmp_path / "out", tmp_path / "w"
    plots = [] if importlib.util.find_spec("matplotlib") else ["--no-plots"]
    args = ["--configs", "2x2", "--seeds", "0", "--steps", "30", "--objectives", "ce", "router", "localize",
            "--max-rounds", "1", "--round-steps", "10", "--sets", "--facts-per-task", "5", "--out", str(out),
            "--weights-dir", str(wdir), *plots]
    assert sweep.main(args) == 0
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    kinds = sorted(r["kind"] for r in data["runs"])
    assert kinds == ["hand-built", "trained", "trained", "trained"]
    built = next(r for r in data["runs"] if r["kind"] == "hand-built")
    assert built["worst_ablated_object_probability"] == 1 / built["vocabulary"] and built["localized"]
    loc = next(r for r in data["runs"] if r.get("objective") == "localize")
    assert 1 <= len(loc["rounds"]) <= 2 and loc["expert_tasks"] == list(sweep.task_set(10, 2, 0).names)
    assert all(0 <= x <= 1 for x in loc["shares"].values()) and set(loc["task_shares"]) >= {"error", "localization"}
    assert all(r["agreement"]["expert_mismatches"] == 0 and r["agreement"]["outside"] == 0
               for r in data["runs"] if r["kind"] == "trained")
    assert data["transcript"]["exit"] in (0, 1)
    text = (out / "results.md").read_text(encoding="utf-8")
    assert "python -m training.sweep --configs 2x2" in text and "## Hand-built versus trained" in text
    assert (out / "tasks-K2.yaml").exists() and len(list(wdir.glob("*.npz"))) == 3
    assert sweep.main(["--render", "--out", str(out), *plots]) == 0

    # Two commands run side by side, merged: every command, each hand-built model once, the task files copied.
    other = dict(data, command="python -m training.sweep --configs --sets 10x2")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(json.dumps(other), encoding="utf-8")
    merged = tmp_path / "merged"
    assert sweep.main(["--merge", str(out / "results.json"), str(tmp_path / "b" / "results.json"),
                       "--out", str(merged), "--no-plots"]) == 0
    both = json.loads((merged / "results.json").read_text(encoding="utf-8"))
    assert both["commands"] == [data["command"], other["command"]]
    assert [r["kind"] for r in both["runs"]].count("hand-built") == 1 and len(both["runs"]) == 7
    assert (merged / "tasks-K2.yaml").exists()
    assert other["command"] in (merged / "results.md").read_text(encoding="utf-8")
    assert sweep.main(["--merge", str(tmp_path / "missing.json"), "--out", str(merged)]) == 2


# --- the localize recipe, sized experts, the localization measure, counterexample rounds ---------

from training.metrics import Localization, localization  # noqa: E402
from training.objectives import Recipe, ablation_hinges, error_hinge, gate_set_ce, routing_hinge  # noqa: E402
from training.rounds import query_checks, reweight, until_certified  # noqa: E402
from training.compare import CertifiedPass  # noqa: E402


def test_localize_terms_vanish_exactly_when_their_check_holds_with_room():
    """Each hinge is zero when its check holds with the recipe's room, positive (with a
    gradient pushing the right way) when it fails."""
    recipe = Recipe(epsilon=0.01, error_room=0.1, route_margin=2.0, ablation_margin=1.0, ablation_room=0.5)
    # error: 1 - P(valid) above / below 0.1 ε
    logits = torch.tensor([[10.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    valid = torch.tensor([[True, False, False], [True, False, False]])
    h = error_hinge(logits, valid, recipe.error_room * recipe.epsilon)
    assert h[0] == 0 and h[1] > 0
    h.sum().backward()
    assert logits.grad[1, 0] < 0 and logits.grad[1, 1] > 0          # descent raises the valid logit
    # routing, on a prefix two experts (0, 1) are consistent with: winner 2 (inconsistent) fails,
    # winner 1 by the margin passes; a prefix every expert is consistent with has no hinge
    gate = torch.tensor([[0.0, 1.0, 3.0], [0.0, 5.0, 1.0], [9.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    cons = torch.tensor([[True, True, False], [True, True, False], [True, True, True]])
    r = routing_hinge(gate, cons, recipe.route_margin)
    assert r.detach().tolist() == [4.0, 0.0, 0.0]
    (r.sum() + gate_set_ce(gate, cons).sum()).backward()
    assert gate.grad[0, 1] < 0 and gate.grad[0, 2] > 0
    # ablated logits: the object (token 0) on top fails L2; far below and unlikely passes all three
    ab = torch.tensor([[5.0, 0.0, 0.0, 0.0], [-5.0, 3.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    obj = torch.tensor([0, 0])
    valid_ab = torch.tensor([[True, False, False, False], [True, False, False, False]])
    terms = ablation_hinges(ab, obj, valid_ab, torch.tensor([0.25, 0.25], dtype=torch.float64), recipe)
    assert all(float(t[1].detach()) == 0.0 for t in terms.values())
    assert float(terms["top"][0].detach()) == pytest.approx(6.0)
    assert terms["probability"][0] > 0 and terms["valid"][0] > 0
    sum(t.sum() for t in terms.values()).backward()
    assert ab.grad[0, 0] > 0                                         # descent lowers the object's ablated logit


def test_routing_loss_covers_shared_prefixes(capitals_set):
    """The task router ignores prefixes several tasks share; the localize routing terms do not."""
    data = query_data(capitals_set)
    shared = np.flatnonzero(data.determined < 0)
    assert shared.size and all(data.consistent[q].sum() >= 2 for q in shared)
    from training.loop import targets

    tg = targets(data)
    K = len(capitals_set.tasks)
    gate = torch.zeros(len(data), K, dtype=torch.float64)
    for q in shared:                       # route every shared prefix to an expert inconsistent with it, if any
        bad = np.flatnonzero(~data.consistent[q])
        if bad.size:
            gate[q, bad[0]] = 5.0
    hit = [q for q in shared if (~data.consistent[q]).any()]
    assert hit
    assert bool((routing_hinge(gate, tg.consistent, 2.0)[hit] > 0).all())
    assert bool((gate_set_ce(gate, tg.consistent)[hit] > 1.0).all())

    class Out:
        pass

    o = Out()
    o.gate = gate
    # blind to them: the determined rows are ties
    assert float(task_router(o, torch.from_numpy(data.determined))) < 2.0


def test_sized_experts_export_their_width_and_compute_the_same(capitals_set):
    """Experts sized to c(k): the export has width min(width, c(k)), the masked neurons take no
    gradient and change nothing, and the exported weights compute the torch float64 pass."""
    data = query_data(capitals_set)
    cfg = TrainConfig(objective="localize", d=16, n_heads=2, d_head=4, expert_width=14, steps=1, seed=3)
    mc = cfg.model_config(data)
    assert mc.widths == tuple(min(14, capitals_set.complexity(k)) for k in range(3)) and min(mc.widths) < 14
    model = MoETransformer(mc, generator=torch.Generator().manual_seed(0))
    tokens, lengths = torch.from_numpy(data.tokens), torch.from_numpy(data.lengths)
    out = model(tokens, lengths)
    out.logits.sum().backward()
    for k, w in enumerate(mc.widths):
        assert not model.W_1.grad[k, w:].any() and not model.W_2.grad[k, :, w:].any()
    with torch.no_grad():                  # a masked neuron's weights do not matter
        k = int(np.argmin(mc.widths))
        model.W_2[k, :, mc.widths[k]:] += 100.0
        model.b_1[k, mc.widths[k]:] += 100.0
        torch.testing.assert_close(model(tokens, lengths).logits, out.logits, rtol=0, atol=0)
    weights = to_weights(model, capitals_set, "declared", config=cfg)
    assert [e.width for e in weights.experts] == list(mc.widths)
    assert all(e.width <= capitals_set.complexity(k) for k, e in enumerate(weights.experts))
    m64 = model.double()
    with torch.no_grad():
        o64 = m64(tokens, lengths)
        probs = torch.softmax(o64.logits, -1).numpy()
    for i in range(0, len(data), 3):
        n = int(data.lengths[i])
        p, e, _ = reference.forward(weights, data.tokens[i, 1: n + 1].tolist())
        assert e == int(o64.expert[i])
        np.testing.assert_allclose(p, probs[i], rtol=1e-10, atol=1e-14)


def test_localization_measure_rejects_a_known_object():
    """L1 and L2 in float64: an ablated model that still ranks the object first, or gives it
    more than 1/|O_k|, fails; a tie (the hand-built model's all-zero ablated logits) passes L2
    but not the slack the rounds require."""
    z = np.array([[3.0, 0.0, 0.0, 0.0],     # object on top: L2 fails, and L1 (p > 1/2)
                  [0.0, 0.0, 0.0, 0.0],     # a tie: uniform 1/4 <= 1/2, L2 holds with the tie
                  [0.0, 2.0, 0.0, 0.0],     # another token on top: holds
                  [1.0, 1.5, -9.0, -9.0]])  # not top but p_o = 0.38 > 1/4: L1 fails
    valid = np.zeros_like(z, bool)
    valid[:, 0] = True
    m = localization(z, np.zeros(4, np.int64), valid, np.array([0.5, 0.5, 0.5, 0.25]))
    loc = Localization(rows=np.arange(4), task=np.array([0, 0, 1, 1]), **m)
    assert loc.holds.tolist() == [False, True, True, False]
    assert loc.not_top.tolist() == [False, True, True, True]
    assert loc.holds_with_slack.tolist() == [False, False, True, False]
    assert loc.probability[1] == pytest.approx(0.25) and loc.ablated_error[2] == pytest.approx(1 - loc.probability[2])
    np.testing.assert_allclose(loc.worst_probability(2), [m["probability"][0], m["probability"][3]])
    assert loc.share_per_task(3).tolist()[:2] == [0.5, 0.5] and np.isnan(loc.share_per_task(3)[2])


def test_query_checks_reject_each_violation(capitals_set, capitals_model):
    """The per-query checks the rounds feed back: each violation is caught by its own check."""
    data = query_data(capitals_set)
    weights = capitals_model.instantiate()
    cert = certified_pass(capitals_set, weights, data, ablate_objects=True)
    from training.export import from_weights

    ev = evaluate(from_weights(weights, torch.float64), data)
    good = query_checks(data, weights, cert, ev.localization, 0.01, slack=False)
    assert good.passing.all() and good.all_pass            # the hand-built model passes every check,
    assert not ev.localization.holds_with_slack.any()      # its ablated logits all tie (all exactly 0)
    oq = np.flatnonzero(data.object_query)
    q_err, q_route, q_ent = 0, 1, int(oq[0])
    margin, err_hi, ab_lo = cert.margin.copy(), cert.err_hi.copy(), cert.ablated_lo.copy()
    err_hi[q_err] = 0.01
    margin[q_route] = 0.0
    ab_lo[q_ent] = 0.0099
    bad_cert = CertifiedPass(cert.expert, margin, cert.err_lo, err_hi, cert.predicted, ab_lo, cert.ablated_hi)
    loc = ev.localization
    gap = loc.gap.copy()
    gap[1] = -1.0                                          # the second object query: object on top
    bad_loc = Localization(loc.rows, loc.task, loc.probability, gap, loc.bound, loc.ablated_error, loc.scale)
    bad = query_checks(data, weights, bad_cert, bad_loc, 0.01, slack=False)
    assert np.flatnonzero(~bad.error).tolist() == [q_err]
    assert np.flatnonzero(~bad.routing).tolist() == [q_route]
    assert np.flatnonzero(~bad.entanglement).tolist() == [q_ent]
    assert np.flatnonzero(~bad.localization).tolist() == [int(oq[1])]
    assert not bad.all_pass and bad.shares()["certified"] == pytest.approx(1 - 4 / len(data))


def test_counterexample_round_upweights_the_failing_queries(capitals_set):
    """Round 1 trains with weight `boost` on exactly the queries round 0 failed (same seed,
    deterministic), and the verdict is the verifier's."""
    assert reweight(np.array([1.0, 4.0, 1.0]), np.array([False, True, True]), 4.0, 8.0).tolist() == [1.0, 8.0, 4.0]
    cfg = TrainConfig(objective="localize", d=16, n_heads=2, d_head=4, expert_width=8, steps=40, warmup=5,
                      seed=0, threads=1)
    first = until_certified(capitals_set, cfg, max_rounds=0)
    assert len(first.rounds) == 1 and not first.certified and first.rounds[0].failing > 0
    failing = ~first.checks.passing
    two = until_certified(capitals_set, cfg, max_rounds=1, round_steps=5, boost=4.0)
    assert len(two.rounds) == 2
    np.testing.assert_array_equal(two.query_weights, np.where(failing, 4.0, 1.0))
    assert two.rounds[0].shares == first.rounds[0].shares
    assert two.weights.parameters["rounds"] == 2 and two.weights.parameters["total_steps"] == 45
    run = two.run_parameters()      # the saved weights (the sweep's) record the run's seconds too
    assert run["train_seconds"] == pytest.approx(sum(r.train_seconds for r in two.rounds), abs=0.011)
    assert run["check_seconds"] == pytest.approx(sum(r.check_seconds for r in two.rounds), abs=0.011)
    assert {k: two.weights.parameters[k] for k in run} == run
    with pytest.raises(ValueError):
        until_certified(capitals_set, TrainConfig(objective="router"), max_rounds=0)


def test_train_cli_until_certified(capitals_set, tmp_path):
    """The CLI's claim is the verifier's: exit 0 (certified) or 1 (not within the budget), and
    `python -m verifier check` then exits the same; bad flags exit 2 and write nothing."""
    from training.train import main as train_main

    yaml_path, npz, js = tmp_path / "tasks.yaml", tmp_path / "w.npz", tmp_path / "train.json"
    dump_tasks(capitals_set, yaml_path)
    assert train_main([str(yaml_path), "-o", str(npz), "--objective", "ce", "--until-certified"]) == 2
    assert train_main([str(yaml_path), "-o", str(npz), "--objective", "localize", "--experts", "2"]) == 2
    assert not npz.exists()
    status = train_main([str(yaml_path), "-o", str(npz), "--objective", "localize", "--until-certified",
                         "--max-rounds", "1", "--steps", "60", "--round-steps", "20", "--d", "16", "--heads", "2",
                         "--d-head", "4", "--width", "8", "--threads", "1", "--json", str(js), "--quiet"])
    assert status in (0, 1)
    rep = json.loads(js.read_text(encoding="utf-8"))
    assert rep["certified"] == (status == 0) and 1 <= len(rep["rounds"]) <= 2
    assert rep["expert_widths"] == [min(8, capitals_set.complexity(k)) for k in range(3)]
    assert verifier_main(["check", str(yaml_path), "--weights", str(npz), "--quiet"]) == status


def test_focused_minibatch_draws_where_the_loss_is_positive():
    """The focused share of a minibatch never draws a query whose last seen loss is 0, and does
    draw the ones not seen yet (scored as the largest seen loss) and the positive ones."""
    from training.loop import _focus

    seen = torch.tensor([0.0, 0.0, 5.0, float("inf"), 0.0])
    idx = _focus(seen, torch.ones(5), 400, torch.Generator().manual_seed(0))
    assert set(idx.tolist()) == {2, 3}
    weighted = _focus(seen, torch.tensor([1.0, 1.0, 1.0, 1e-6, 1.0]), 400, torch.Generator().manual_seed(0))
    assert 2 in weighted.tolist() and 3 not in weighted.tolist()
    rounding = _focus(torch.tensor([-1e-7, 2.0, 0.0]), torch.ones(3), 50, torch.Generator().manual_seed(0))
    assert set(rounding.tolist()) == {1}          # a float32 loss a hair below 0 counts as 0, not as an error
    learned = _focus(torch.zeros(4), torch.ones(4), 50, torch.Generator().manual_seed(0))
    assert learned.shape == (50,) and learned.max() < 4          # every loss 0: uniform, never an error


def test_ablated_logits_vanish_by_sparsity(capitals_model):
    """The hand-built model's U reads no direction that E, P or a head writes: ablated logits are
    exactly 0 (P_ablated(o) = 1/V); one shared nonzero breaks the argument."""
    from training.metrics import ablated_logits_vanish

    weights = capitals_model.instantiate()
    assert ablated_logits_vanish(weights)
    import dataclasses

    import scipy.sparse as sp

    U = sp.lil_matrix(weights.U)
    j = int(sp.coo_matrix(weights.E).col[0])
    U[0, j] = 1.0
    assert not ablated_logits_vanish(dataclasses.replace(weights, U=sp.csr_matrix(U)))


# --- the 1,000/10,000-fact fixes: log-space masses, shuffled epochs, budget-shaped schedule, the screen ----------


def test_an_underflowed_valid_mass_keeps_its_gradient():
    """A query whose valid token sits 100 nats below the top has P(valid) ≈ e^-100, 0 in
    float32: the floored log had no gradient there (the never-learned queries), the
    log-space value has log P(valid) = −100 and a gradient raising the valid logit."""
    from training.objectives import FLOOR, log_masses

    z = torch.tensor([[100.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    valid = torch.tensor([[False, True, False], [True, False, False], [True, True, True]])
    assert float(torch.softmax(z.detach(), -1)[0, 1]) < FLOOR   # the float32 softmax lost it
    floored = -torch.log(torch.softmax(z, -1)[0, 1].clamp_min(1e-30))
    floored.backward()
    assert not z.grad.any()                                   # the old form: no gradient at all
    z.grad = None
    log_valid, log_error = log_masses(z, valid)
    lv, le = log_valid.detach(), log_error.detach()
    assert float(lv[0]) == pytest.approx(-100.0, abs=1e-3)
    p = torch.softmax(z.detach().double(), -1)
    assert float(lv[1]) == pytest.approx(float(torch.log(p[1, 0])), rel=1e-6)
    assert float(le[1]) == pytest.approx(float(torch.log(p[1, 1:].sum())), rel=1e-6)
    assert float(lv[2]) == 0.0 and float(le[2]) < -60   # every token valid: no error, no NaN
    (-log_valid.sum()).backward()
    assert torch.isfinite(z.grad).all() and z.grad[0, 1] < -0.99 and z.grad[0, 0] > 0.99
    # the ablated error, pushed up by its hinge, is exact where it underflows
    z2 = torch.tensor([[0.0, -100.0]], requires_grad=True)
    log_err = log_masses(z2, torch.tensor([[True, False]]), exact="error")[1]
    assert float(log_err.detach()[0]) == pytest.approx(-100.0, abs=1e-3)
    log_err.sum().backward()
    assert z2.grad[0, 1] > 0.99
    with pytest.raises(ValueError):
        log_masses(z2, torch.tensor([[True, False]]), exact="both")


def test_epochs_visit_every_query_once_per_pass():
    """The minibatch walk: every query exactly once per pass, chunks across pass boundaries."""
    from training.loop import Epochs

    walk = Epochs(10, torch.Generator().manual_seed(0))
    drawn = torch.cat([walk.take(4) for _ in range(5)])          # 20 draws: two whole passes
    assert sorted(drawn[:10].tolist()) == list(range(10)) and sorted(drawn[10:].tolist()) == list(range(10))
    assert walk.passes == 1 and walk.take(25).shape == (25,)


def test_the_time_limit_shapes_the_learning_rate_schedule():
    """With a time limit the cosine decay follows the larger of the step and time shares, so
    it has reached its floor (10%) when the time is spent; without one, steps alone."""
    from training.loop import _rate

    by_steps = _rate(10, 1010)
    assert by_steps(0) == pytest.approx(0.1) and by_steps(10) == pytest.approx(1.0)
    assert by_steps(510, 1e9) == pytest.approx(0.55) and by_steps(1010) == pytest.approx(0.1)
    timed = _rate(10, 10**9, time_limit=100.0)
    assert timed(10, 0.0) == pytest.approx(1.0) and timed(20, 50.0) == pytest.approx(0.55)
    assert timed(30, 100.0) == pytest.approx(0.1) and timed(30, 500.0) == pytest.approx(0.1)
    assert timed(5, 99.0) == pytest.approx(0.6)                       # the warm-up is in steps


def test_round_share_splits_the_budget_ahead():
    from training.rounds import round_share

    assert round_share(1000.0, 1000.0, 0, 4, 0.75) == 750.0
    assert round_share(1000.0, 1000.0, 0, 0, 0.75) == 1000.0       # no later round: all of it
    assert round_share(200.0, 1000.0, 1, 4, 0.75) == 50.0           # 4 rounds left share 200 s
    assert round_share(60.0, 1000.0, 4, 4, 0.75) == 60.0


def test_screen_checks_reject_each_violation(capitals_set, capitals_model):
    """The float64 screen between rounds errs toward failing: an error a hair below ε, a gate
    tie and an ablated error of exactly ε each fail their own check."""
    import dataclasses

    from training.export import from_weights
    from training.rounds import SCREEN_SLACK, screen_checks

    data = query_data(capitals_set)
    weights = capitals_model.instantiate()
    ev = evaluate(from_weights(weights, torch.float64), data)
    good = screen_checks(data, weights, ev, 0.01)
    assert good.error.all() and good.routing.all() and good.entanglement.all() and good.size.all()
    assert not good.localization[data.object_query].any()     # the hand-built ablated logits tie: no room
    oq = np.flatnonzero(data.object_query)
    error, gate = ev.error.copy(), ev.gate.copy()
    error[0] = 0.01 * (1 - SCREEN_SLACK / 2)                   # below ε, inside the slack
    gate[1] = gate[1].max()                                    # every expert ties
    loc = ev.localization
    ab = loc.ablated_error.copy()
    ab[0] = 0.01
    bad_ev = dataclasses.replace(ev, error=error, gate=gate,
                                 localization=dataclasses.replace(loc, ablated_error=ab))
    bad = screen_checks(data, weights, bad_ev, 0.01)
    assert np.flatnonzero(~bad.error).tolist() == [0]
    assert np.flatnonzero(~bad.routing).tolist() == [1]
    assert np.flatnonzero(~bad.entanglement).tolist() == [int(loc.rows[0])] and loc.rows[0] == oq[0]


def test_attention_spread_hinge_measures_visible_scores_only(capitals_set):
    """The spread is max − min of each head's scores over the visible positions (j <= n) only,
    and its hinge is positive (with a gradient that narrows it) exactly above the bound."""
    from training.objectives import localize_terms
    from training.options import spread
    from training.loop import targets

    data = query_data(capitals_set)
    cfg = TrainConfig(objective="localize", d=16, n_heads=2, d_head=4, expert_width=8, seed=0)
    model = MoETransformer(cfg.model_config(data), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.W_Q *= 30.0                                            # saturate the heads
    tokens, lengths = torch.from_numpy(data.tokens), torch.from_numpy(data.lengths)
    out = model(tokens, lengths)
    i = int(np.argmax(data.lengths))
    n = int(lengths[i])
    h = model.E[tokens[i, : n + 1]] + model.P[: n + 1]
    q = torch.einsum("hkd,d->hk", model.W_Q, h[n])
    k = torch.einsum("hkd,jd->jhk", model.W_K, h)
    scores = (k * q[None]).sum(-1)                                   # (n+1, H), visible positions only
    torch.testing.assert_close(out.spread[i], scores.max(0).values - scores.min(0).values, rtol=1e-4, atol=1e-3)
    assert float(out.spread.detach().max()) > 20
    terms = localize_terms(out, torch.from_numpy(data.valid), targets(data),
                           Recipe(attention_spread=20.0), torch.zeros(0, dtype=torch.int64))
    expect = torch.relu(out.spread - 20.0).sum(-1)
    torch.testing.assert_close(terms["attention"], expect)
    assert bool((terms["attention"] > 0).any())
    assert bool((terms["attention"][out.spread.max(-1).values <= 20] == 0).all())
    terms["attention"].sum().backward()
    assert model.W_Q.grad.abs().sum() > 0
    assert "attention" not in localize_terms(out, torch.from_numpy(data.valid), targets(data), Recipe(),
                                             torch.zeros(0, dtype=torch.int64))
    assert spread("none") is None and spread("8") == 8.0
    for bad in ("0", "-1", "inf", "x"):
        with pytest.raises(__import__("argparse").ArgumentTypeError):
            spread(bad)
