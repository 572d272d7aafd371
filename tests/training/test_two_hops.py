"""The two-hop training experiment's parts: the two-layer model exports to the two-layer
layout as exactly the function it computes, its verdicts come from the certified pass,
and the task sets it trains and judges on share one vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from training.data import query_data  # noqa: E402
from training.loop import TrainConfig, evaluate, train  # noqa: E402
from training.two_hops import TwoLayerMoE, _layers_errors, run, task_sets, to_stack  # noqa: E402


def test_the_sets_share_one_vocabulary_and_split_the_people():
    full, train_set, held = task_sets(40, 5, 0.5, 0)
    assert full.vocabulary.tokens == train_set.vocabulary.tokens == held.vocabulary.tokens
    trained = set(train_set.tasks[2].facts.keys())
    held_out = set(held.tasks[2].facts.keys())
    assert not trained & held_out and len(trained) + len(held_out) == 40
    assert full.tasks[2].compose == ("born_in", "capital")
    _, none, _ = task_sets(40, 5, 0.0, 0)
    assert len(none.tasks) == 2 and none.vocabulary.tokens == full.vocabulary.tokens


def test_the_exported_stack_computes_the_trained_function():
    """The float64 errors of the torch model lie in the verifier's enclosures of the exported
    two-layer weights (up to float64 rounding of the torch pass)."""
    _, train_set, held = task_sets(30, 4, 0.5, 1)
    config = TrainConfig(objective="ce", d=16, n_heads=2, d_head=8, n_experts=1, expert_width=16, steps=30,
                         seed=1, gate_mode="top1")
    data = query_data(train_set)
    model = TwoLayerMoE(config.model_config(data), generator=torch.Generator().manual_seed(1))
    trained = train(train_set, config, data=data, model=model).model
    data_held = query_data(held)
    err = evaluate(trained, data_held).error
    stack = to_stack(trained, held, config)
    hi = _layers_errors(stack, data_held)
    assert np.all(err <= hi + 1e-9)
    assert np.any(err > 1e-3)                  # a barely trained model: the enclosures are not all trivial


def test_a_scaled_gate_is_refused():
    config = TrainConfig(objective="ce", n_experts=1, gate_mode="top1-scaled")
    _, train_set, _ = task_sets(10, 2, 0.5, 0)
    with pytest.raises(ValueError, match="gate_mode must be 'top1'"):
        TwoLayerMoE(config.model_config(query_data(train_set)))


def test_one_run_reports_the_held_out_queries():
    row = run(20, 3, 0.5, 0, 2, steps=5)
    assert row.layers == 2 and row.held_out == 10 and 0 <= row.accuracy <= 1 and 0 <= row.certified <= 1


def test_a_model_trained_on_no_composed_fact_is_judged_on_all_of_them():
    """With no composed fact trained on, the composed template is longer than any trained
    prefix: the model has positions for it, and every composed object query is held out."""
    row = run(20, 3, 0.0, 0, 1, steps=5)
    assert row.layers == 1 and row.held_out == 20


def test_the_certificate_recipe_trains_one_expert_per_task_and_ablates_the_first_hop():
    """Under ``localize`` each trained task has its expert (three with composed facts trained on),
    and the objective's ablation is layer 1's expert removed with layer 2 applied."""
    row = run(20, 3, 0.5, 0, 2, steps=5, objective="localize")
    assert row.objective == "localize" and row.layers == 2 and row.held_out == 10
    _, train_set, _ = task_sets(20, 3, 0.5, 0)
    config = TrainConfig(objective="localize", d=16, n_heads=2, d_head=8, expert_width=16, steps=1, seed=0,
                         gate_mode="top1")
    data = query_data(train_set)
    model = TwoLayerMoE(config.model_config(data), generator=torch.Generator().manual_seed(0))
    assert model.W_1.shape[0] == len(train_set.tasks) == 3
    tokens, lengths = torch.from_numpy(data.tokens), torch.from_numpy(data.lengths)
    rows = torch.arange(4)
    out = model(tokens, lengths, ablate=rows)
    r = out.residual[rows]
    second = r + torch.relu(r @ model.W_1b.T + model.b_1b) @ model.W_2b.T
    assert torch.allclose(out.ablated, second @ model.U.T)


def test_the_record_renders_in_the_training_results_page(tmp_path):
    """results.md (training.sweep.render) carries the two-hop table when its record is beside it."""
    from training.sweep import _two_hops
    from training.two_hops import summary_lines

    record = {"commands": ["python -m training.two_hops"], "people": 20, "countries": 3, "steps": 5,
              "hand_built": {"composed_facts": 20, "two_layers": 40, "one_layer": 60, "composed_layer1": 10,
                             "capital_layer2": 3},
              "rows": [{"objective": "localize", "layers": 2, "share": 0.5, "seed": 0, "held_out": 10, "accuracy": 0.1,
                        "certified": 0.0, "one_hop_certified": 1.0, "parameters": 123}]}
    lines = summary_lines(record)
    assert any(x.startswith("| certificate recipe (localize) | 2 | 0.5 | 10 | 0.100 | 0.000 | 1.000 | 123 |")
               for x in lines)
    assert _two_hops(str(tmp_path)) == []
    import json

    (tmp_path / "two_hops.json").write_text(json.dumps(record), encoding="utf-8")
    page = _two_hops(str(tmp_path))
    assert page[0].startswith("## Two hops") and all(x in page for x in lines)
