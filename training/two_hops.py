"""Does training find a composition? Two-layer models trained on one-hop facts and a share of
the composed ones, judged by the verifier on the composed queries held out.

    python -m training.two_hops [--people 300] [--countries 30] [--shares 0 0.5 0.9] [--seeds 0 1]
                                [--objectives ce localize] [--out DIR]

The task set (seeded): ``born_in`` (people → countries), ``capital`` (country → capital) and
``born_capital`` = born_in then capital (:mod:`tasks.composition`). Each model trains
(:func:`training.loop.train`) on every query of born_in and capital and on the composed
queries of a share of the people; the other people's composed object queries are held out.
Two objectives: cross-entropy with one expert, and the certificate recipe (``localize``:
:mod:`training.objectives`) with one expert per trained task, its ablation the first hop's
(layer 1's expert removed, layer 2 applied). Two shapes, the same widths otherwise:

* **one layer** (:class:`training.model.MoETransformer`);
* **two layers** (:class:`TwoLayerMoE`): the same, and a second layer without attention heads
  and one expert, as the two-layer layout has it (:mod:`layout.layers`), so that the
  exported :class:`layout.layers.Stack` is exactly the trained function.

On the held-out composed object queries it reports the float64 accuracy (the argmax is the
object) and the share the verifier **certifies** answered (the upper end of the error's
enclosure below ε: :func:`training.compare.certified_pass` for one layer,
:class:`verifier.passes.layers.LayersPass` for two), beside the hand-built two-layer model
(:mod:`construction.layers`), which certifies every one of them. Writes
``two_hops.json`` and ``two_hops.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from layout import Expert, canonical
from layout.layers import MoELayer, Stack
from tasks.model import Facts, Task, TaskSet
from training.data import query_data
from training.export import _csr, _vec, to_weights
from training.loop import TrainConfig, evaluate, train
from training.model import ModelConfig, MoETransformer, Output
from training.objectives import OBJECTIVE_NAMES

#: The composed template uses the one-hop templates' words only, so that a model trained on
#: no composed fact has the same vocabulary as the sets it is judged on.
TEMPLATES = {"born_in": ("⋆1 was born in ⋆2",), "capital": ("the capital of the country ⋆1 is ⋆2",),
             "born_capital": ("the capital of the country ⋆1 was born in is ⋆2",)}


class TwoLayerMoE(MoETransformer):
    """:class:`MoETransformer` and a second layer without heads: y' = y + W'_2 ReLU(W'_1 y + b'_1)
    (one expert, top-1 unscaled: the two-layer layout's forward pass)."""

    def __init__(self, config: ModelConfig, generator: torch.Generator | None = None) -> None:
        if config.gate_mode != "top1":
            raise ValueError("the two-layer layout routes layer 1 unscaled: gate_mode must be 'top1'")
        super().__init__(config, generator)
        d, w = config.d, config.expert_width
        self.W_1b = nn.Parameter(torch.randn(w, d, generator=generator) / math.sqrt(d))
        self.b_1b = nn.Parameter(torch.zeros(w))
        self.W_2b = nn.Parameter(torch.randn(d, w, generator=generator) / math.sqrt(w))

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor, expert: torch.Tensor | None = None,
                ablate: torch.Tensor | None = None) -> Output:
        """The two-layer forward pass; ``ablate`` asks for the rows' logits with layer 1's
        expert removed (layer 2 then runs on r)."""
        r, spread = self._residual(tokens, lengths)
        g = r @ self.W_G.T + self.b_G
        e = torch.argmax(g, dim=-1) if expert is None else expert
        y = r + self.expert_output(r, e)
        second = lambda x: x + torch.relu(x @ self.W_1b.T + self.b_1b) @ self.W_2b.T  # noqa: E731
        ablated = None if ablate is None else second(r[ablate]) @ self.U.T
        return Output(logits=second(y) @ self.U.T, gate=g, expert=e, gate_probs=torch.softmax(g, dim=-1),
                      residual=r, ablated=ablated, spread=spread)


def to_stack(model: TwoLayerMoE, taskset: TaskSet, config: TrainConfig) -> Stack:
    """The two-layer weights of ``model`` (float32 values, exact in float64)."""
    first = to_weights(model, taskset, "none", config=config)
    d = first.d
    second = MoELayer(canonical(_csr(torch.zeros(1, d))), np.zeros(1),
                      (Expert(_csr(model.W_1b), _vec(model.b_1b), _csr(model.W_2b)),), ("",))
    return Stack(first, second)


def task_sets(people: int, countries: int, share: float, seed: int) -> tuple[TaskSet, TaskSet, TaskSet]:
    """(the composed set, the training set, the held-out set): the training set holds the
    composed facts of ``share`` of the people as a task of their own; the held-out set the rest."""
    rng = np.random.default_rng(seed)
    born = {f"person{i}": f"country{int(rng.integers(countries))}" for i in range(people)}
    capital = {f"country{c}": f"city{c}" for c in range(countries)}
    stored = (Task("born_in", TEMPLATES["born_in"], Facts(born.items())),
              Task("capital", TEMPLATES["capital"], Facts(capital.items())))
    composed = [(s, capital[b]) for s, b in born.items()]
    order = rng.permutation(people)
    cut = int(round(share * people))
    train_rows = [composed[i] for i in sorted(order[:cut])]
    held_rows = [composed[i] for i in sorted(order[cut:])]
    full = TaskSet(stored + (Task("born_capital", TEMPLATES["born_capital"], Facts(composed),
                                  compose=("born_in", "capital")),))
    train_set = TaskSet(stored + ((Task("born_capital", TEMPLATES["born_capital"], Facts(train_rows)),)
                                  if train_rows else ()))
    held = TaskSet(stored + (Task("born_capital", TEMPLATES["born_capital"], Facts(held_rows)),))
    return full, train_set, held


@dataclass
class Row:
    objective: str         # "ce" or "localize" (training.objectives)
    layers: int
    share: float
    seed: int
    held_out: int          # held-out composed object queries
    accuracy: float        # float64 argmax on them
    certified: float       # share certified answered (error enclosure below epsilon)
    one_hop_certified: float   # the same on the one-hop object queries (trained on)
    parameters: int


def _composed_rows(data, name: str) -> np.ndarray:
    k = list(data.task_names).index(name)
    return np.flatnonzero(data.object_query & (data.determined == k))


def run(people: int, countries: int, share: float, seed: int, layers: int, steps: int, epsilon: float = 0.01,
        objective: str = "ce") -> Row:
    """Train one model and judge it on the held-out composed object queries."""
    from training.compare import certified_pass

    full, train_set, held = task_sets(people, countries, share, seed)
    # CE: one expert; the certificate recipe: one expert per trained task, sized to its bound
    config = TrainConfig(objective=objective, d=64, n_heads=4, d_head=16, n_experts=1 if objective == "ce" else None,
                         expert_width=128, steps=steps, lr=3e-3, seed=seed, gate_mode="top1", epsilon=epsilon)
    data_train = query_data(train_set)
    data_held = query_data(held)
    if train_set.vocabulary.tokens != held.vocabulary.tokens:
        raise AssertionError("the training and held-out sets must share one vocabulary")
    # positions for the longest prefix judged, which a model trained on no composed fact never saw
    sizes = replace(config.model_config(data_train), n_positions=max(data_train.n_positions, data_held.n_positions))
    gen = torch.Generator().manual_seed(seed)
    model = TwoLayerMoE(sizes, generator=gen) if layers == 2 else MoETransformer(sizes, generator=gen)
    trained = train(train_set, config, data=data_train, model=model).model
    comp = _composed_rows(data_held, "born_capital")
    one_hop = np.flatnonzero(data_held.object_query & (data_held.determined != list(data_held.task_names).index(
        "born_capital")))
    ev = evaluate(trained, data_held)
    accuracy = float(ev.correct[comp].mean())
    if layers == 1:
        weights = to_weights(trained, held, "none", config=config)
        cert = certified_pass(held, weights, data_held)
        err_hi = cert.err_hi
        n_params = weights.parameter_counts()["total"]
    else:
        stack = to_stack(trained, held, config)
        err_hi = _layers_errors(stack, data_held)
        n_params = stack.parameter_counts()["total"]
    return Row(objective, layers, share, seed, int(comp.size), accuracy, float((err_hi[comp] < epsilon).mean()),
               float((err_hi[one_hop] < epsilon).mean()), n_params)


def _layers_errors(stack: Stack, data) -> np.ndarray:
    """The upper end of every query's error enclosure on two layers (query_data's order)."""
    from verifier.passes.layers import LayersPass

    pas = LayersPass(stack)
    out = np.empty(len(data))
    lengths = data.lengths
    for p in np.unique(lengths):
        rows = np.flatnonzero(lengths == p)
        tokens = data.tokens[rows, 1:p + 1]
        vp = np.zeros(rows.size + 1, np.int64)
        valid_rows, valid_tok = np.nonzero(data.valid[rows])
        np.cumsum(np.bincount(valid_rows, minlength=rows.size), out=vp[1:])
        none = np.zeros(rows.size, bool)
        res = pas.run_batch(tokens, vp, valid_tok, np.full(rows.size, -1), none, none)
        out[rows] = res.err_hi
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.two_hops", description=__doc__.splitlines()[0])
    p.add_argument("--people", type=int, default=300)
    p.add_argument("--countries", type=int, default=30)
    p.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--objectives", nargs="+", choices=("ce", "localize"), default=["ce", "localize"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="docs/training")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="write OUT's page, record and figure from the records of runs made side by side (e.g. "
                        "one objective per core); nothing is trained")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.merge:
        return _write(merge([json.loads(Path(x).read_text(encoding="utf-8")) for x in args.merge]), out)
    torch.set_num_threads(args.threads)
    rows = []
    for objective in args.objectives:
        for layers in (1, 2):
            for share in args.shares:
                for seed in args.seeds:
                    row = run(args.people, args.countries, share, seed, layers, args.steps, objective=objective)
                    rows.append(row)
                    print(json.dumps(row.__dict__), flush=True)
    command = ("python -m training.two_hops --people {} --countries {} --shares {} --seeds {} --steps {} "
               "--objectives {} --out {}".format(args.people, args.countries, " ".join(f"{x:g}" for x in args.shares),
                                                 " ".join(map(str, args.seeds)), args.steps,
                                                 " ".join(args.objectives), args.out))
    record = {"commands": [command], "people": args.people, "countries": args.countries, "steps": args.steps,
              "hand_built": hand_built(args.people, args.countries), "rows": [r.__dict__ for r in rows]}
    return _write(record, out)


def _write(record: dict, out: Path) -> int:
    """The record, its page and its figure into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "two_hops.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    _plot([Row(**r) for r in record["rows"]], out / "two_hops.png")
    (out / "two_hops.md").write_text(_markdown(record), encoding="utf-8")
    return 0


def merge(records: list[dict]) -> dict:
    """One record from the records of runs made side by side: their commands and rows; the
    set (people, countries) and the steps must agree."""
    first = records[0]
    for r in records[1:]:
        if (r["people"], r["countries"], r["steps"]) != (first["people"], first["countries"], first["steps"]):
            raise SystemExit("the records to merge differ in --people, --countries or --steps")
    return {**first, "commands": [c for r in records for c in r["commands"]],
            "rows": [row for r in records for row in r["rows"]]}


def hand_built(people: int, countries: int) -> dict:
    """The hand-built two-layer model of the composed set: its neurons, against one layer
    storing every composed fact, and what the composition costs (:meth:`construction.layers.TwoLayerModel.costs`)."""
    from construction.layers import build_two_layers

    full, _, _ = task_sets(people, countries, 0.0, 0)      # the composed set does not depend on the share
    costs = {c["task"]: c for c in build_two_layers(full).costs()}
    return {"composed_facts": len(full.tasks[2].facts),
            "two_layers": sum(c["layer1"] + c["layer2"] for c in costs.values()),
            "one_layer": sum(c["one_layer"] for c in costs.values()),
            "composed_layer1": costs["born_capital"]["layer1"], "capital_layer2": costs["capital"]["layer2"]}


def summary_lines(record: dict) -> list[str]:
    """The table of a run of this experiment (means over seeds) and the hand-built model's
    count, from its JSON record (``two_hops.json``): for this page and for
    ``docs/training/results.md`` (:func:`training.sweep.render`)."""
    rows = record["rows"]
    lines = ["| objective | layers | share trained | held-out queries | accuracy | certified | one-hop certified "
             "| parameters |", "|---|---|---|---|---|---|---|---|"]
    for objective in ("ce", "localize"):
        for layers in (1, 2):
            for share in sorted({r["share"] for r in rows}):
                mine = [r for r in rows if r.get("objective", "ce") == objective and r["layers"] == layers
                        and r["share"] == share]
                if not mine:
                    continue
                mean = lambda key: float(np.mean([r[key] for r in mine]))  # noqa: E731
                lines.append(f"| {OBJECTIVE_NAMES[objective]} | {layers} | {share:g} | {mine[0]['held_out']} | "
                             f"{mean('accuracy'):.3f} | {mean('certified'):.3f} | {mean('one_hop_certified'):.3f} | "
                             f"{mine[0]['parameters']:,} |")
    h = record["hand_built"]
    lines += ["", f"Hand-built, the same set ({h['composed_facts']} composed facts): the two-layer construction "
              f"certifies every query with {h['two_layers']:,} neurons (one layer storing every composed fact: "
              f"{h['one_layer']:,}); its composed task costs {h['composed_layer1']} neurons in layer 1 and "
              f"`capital`'s {h['capital_layer2']} used facts are stored again in layer 2."]
    return lines


def _markdown(record: dict) -> str:
    """The generated page: setup, the table (means over seeds) and the figure."""
    lines = ["# Does training find a composition?", "",
             "Generated by `training/two_hops.py`; do not edit by hand. " + _commands_said(record), "", "```sh",
             *record["commands"], "```", "", setup(record), "", *summary_lines(record), "",
             "![Held-out composed queries: accuracy and certified share](two_hops.png)", ""]
    return "\n".join(lines)


def _commands_said(record: dict) -> str:
    return "Command:" if len(record["commands"]) == 1 else "Commands (run side by side, then merged with `--merge`):"


def setup(record: dict) -> str:
    """The experiment's setup, in a paragraph."""
    return (f"**Setup.** {record['people']} people born in {record['countries']} countries (`born_in`), each "
            "country's capital (`capital`) and the composed task `born_capital` = born_in then capital. Each model "
            f"trains full batch, Adam, {record['steps']} steps, on every one-hop query and on the composed queries "
            "of a share of the people (as a task of their own); the verifier then judges the other people's "
            "composed object queries (held out). Objectives: cross-entropy (CE), with one expert; the certificate "
            "recipe (`localize`, docs/training.md), with one expert per trained task sized to its bound, where "
            "the ablation is the first hop's: the layer-1 expert removed, layer 2 still applied. One layer: "
            "d = 64, 4 heads of width 16, experts of up to 128 neurons. Two layers: the same and a second layer "
            "without heads and one expert of 128 neurons (the two-layer layout). *Accuracy*: the float64 argmax "
            "is the object; *certified*: the upper end of the verifier's error enclosure is below ε = 0.01; "
            "*one-hop certified*: the same on the one-hop object queries, trained on.")


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objectives = [o for o in ("ce", "localize") if any(r.objective == o for r in rows)]
    fig, axes = plt.subplots(1, len(objectives), figsize=(5 * len(objectives), 3.2), squeeze=False, sharey=True)
    for ax, objective in zip(axes[0], objectives):
        for layers, marker in ((1, "o"), (2, "s")):
            mine = [r for r in rows if r.layers == layers and r.objective == objective]
            shares = sorted({r.share for r in mine})
            acc = [np.mean([r.accuracy for r in mine if r.share == s]) for s in shares]
            cert = [np.mean([r.certified for r in mine if r.share == s]) for s in shares]
            ax.plot(shares, acc, marker=marker, linestyle="--", label=f"{layers} layer{'s' * (layers > 1)}: accuracy")
            ax.plot(shares, cert, marker=marker, label=f"{layers} layer{'s' * (layers > 1)}: certified")
        ax.set_title(OBJECTIVE_NAMES[objective], fontsize=9)
        ax.set_xlabel("share of composed facts trained on")
        ax.set_ylim(-0.03, 1.03)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out composed object queries")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
