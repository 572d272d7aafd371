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
from training.train import TrainConfig, evaluate, train  # noqa: E402
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
    assert len(data) == sum(1 for _ in __import__("tasks.queries", fromlist=["iter_queries"]).iter_queries(capitals_set))
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
    args = ["--configs", "2x2", "--seeds", "0", "--steps", "30", "--objectives", "ce", "router",
            "--facts-per-task", "5", "--out", str(out), "--weights-dir", str(wdir), *plots]
    assert sweep.main(args) == 0
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    kinds = sorted(r["kind"] for r in data["runs"])
    assert kinds == ["hand-built", "trained", "trained"]
    assert all(r["agreement"]["expert_mismatches"] == 0 and r["agreement"]["outside"] == 0
               for r in data["runs"] if r["kind"] == "trained")
    assert data["transcript"]["exit"] in (0, 1)
    text = (out / "results.md").read_text(encoding="utf-8")
    assert "python -m training.sweep --configs 2x2" in text and "## Hand-built versus trained" in text
    assert (out / "tasks-K2.yaml").exists() and len(list(wdir.glob("*.npz"))) == 2
    assert sweep.main(["--render", "--out", str(out), *plots]) == 0
