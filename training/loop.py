"""The training loop: train a single-layer MoE transformer on every query of a task set, and evaluate it.

Data: every query (proper prefix, see :mod:`training.data`), weighted equally unless
given weights (counterexample rounds, :mod:`training.rounds`), with the losses of
:mod:`training.objectives` (no sampling of one target). Optimiser: Adam, full batch by
default (the sets are small); with ``batch_size`` a minibatch is the next chunk of a
walk through shuffled epochs (:class:`Epochs`: every query once per pass), each row
weighted by its query weight in the loss (the same expected gradient as the weighted
full-batch loss), and under ``localize`` a share ``focus`` of it is drawn in proportion
to the weight times the loss last seen on the query (the hinges are zero on most
queries once learned; this spends the batch where they are not, and the walk keeps
every query revisited). Learning rate: a short linear warm-up and a cosine decay to
10% over the run's progress, the share of its steps or of its time limit spent,
whichever is larger (so a time budget shapes the schedule). Training runs in float32; evaluation (:func:`evaluate`) runs
in float64 on a copy, which is the arithmetic the exported weights are checked against (float32 values are
exact in float64).

The command line that trains and exports is :mod:`training.train`.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from tasks.model import TaskSet
from training.data import QueryData, query_data
from training.metrics import Localization, entropy, localization, purity, routing_matrix
from training.model import ModelConfig, MoETransformer
from training.objectives import OBJECTIVES, Recipe, Targets, localize_loss, objective_loss, valid_error

WIDTHS = ("auto", "uniform", "bound")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (``n_experts=None``: one per task)."""

    objective: str = "ce"
    d: int = 64
    n_heads: int = 4
    d_head: int = 16
    n_experts: int | None = None
    expert_width: int = 32
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 50
    batch_size: int | None = None
    weight_decay: float = 0.0
    alpha: float = 0.01          # load-balancing weight ("lb")
    lam: float = 1.0             # task-router weight ("router")
    seed: int = 0
    threads: int | None = None   # torch threads (None: leave torch's setting)
    time_limit: float | None = None  # seconds; stop early when exceeded
    gate_mode: str = "top1-scaled"
    expert_widths: str = "auto"  # uniform: every expert expert_width; bound: expert k min(expert_width, c(k));
                                 # auto: bound for localize, uniform otherwise
    epsilon: float = 0.01        # localize: the verifier's target error
    error_room: float = 0.1      # localize: error hinge at error_room · epsilon
    route_margin: float = 2.0    # localize: gate margin of the consistent experts
    ablation_margin: float = 1.0  # localize: ablated logit of another token above the object's
    ablation_room: float = 0.5   # localize: ablated P(object) at most ablation_room / |O_k|
    focus: float = 0.5           # localize with minibatches: share of each batch drawn by last seen loss
    # localize: per head, visible attention scores within this many nats (None: free)
    attention_spread: float | None = 8.0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.expert_widths not in WIDTHS:
            raise ValueError(f"expert_widths must be one of {WIDTHS}, got {self.expert_widths!r}")
        if not 0 <= self.focus < 1:
            raise ValueError(f"focus must be in [0, 1), got {self.focus}")

    @property
    def sized(self) -> bool:
        """Expert k's width is min(expert_width, c(k)) (it serves task k)."""
        return self.expert_widths == "bound" or (self.expert_widths == "auto" and self.objective == "localize")

    def recipe(self) -> Recipe:
        return Recipe(epsilon=self.epsilon, error_room=self.error_room, route_margin=self.route_margin,
                      ablation_margin=self.ablation_margin, ablation_room=self.ablation_room,
                      attention_spread=self.attention_spread)

    def model_config(self, data: QueryData) -> ModelConfig:
        """The model's sizes. Sized widths and the localize objective pair expert k with
        task k (the declared mapping), so they need one expert per task."""
        T = len(data.task_names)
        K = self.n_experts or T
        if (self.sized or self.objective == "localize") and K != T:
            raise ValueError(f"the {self.objective} objective with sized experts pairs expert k with task k: "
                             f"it needs one expert per task ({T}), not {K}")
        widths = tuple(int(min(self.expert_width, b)) for b in data.bounds) if self.sized else None
        return ModelConfig(vocab_size=data.V, n_positions=data.n_positions, d=self.d, n_heads=self.n_heads,
                           d_head=self.d_head, n_experts=K, expert_width=self.expert_width,
                           gate_mode=self.gate_mode, expert_widths=widths)


@dataclass
class TrainResult:
    model: MoETransformer
    config: TrainConfig
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0


@dataclass
class Evaluation:
    """Per-query float64 evaluation of a model, and the summary measures."""

    expert: np.ndarray          # (Q,) chosen expert
    error: np.ndarray           # (Q,) 1 - P(valid), float64
    predicted: np.ndarray       # (Q,) argmax token
    correct: np.ndarray         # (Q,) predicted token is valid
    gate: np.ndarray            # (Q, K) gate scores
    routing: np.ndarray         # tasks x experts over determined queries
    object_query: np.ndarray
    localization: Localization | None = None   # the ablated model on object queries (float64)

    @property
    def next_token_accuracy(self) -> float:
        return float(self.correct.mean())

    @property
    def object_accuracy(self) -> float:
        return float(self.correct[self.object_query].mean()) if self.object_query.any() else float("nan")

    @property
    def mean_error(self) -> float:
        return float(self.error.mean())

    @property
    def max_error(self) -> float:
        return float(self.error.max())

    @property
    def purity(self) -> float:
        return purity(self.routing)

    @property
    def entropy(self) -> float:
        return entropy(self.routing)

    def summary(self) -> dict[str, float]:
        out = {"object_accuracy": self.object_accuracy, "next_token_accuracy": self.next_token_accuracy,
               "mean_error": self.mean_error, "max_error": self.max_error,
               "routing_purity": self.purity, "routing_entropy": self.entropy,
               "experts_used": int((self.routing.sum(axis=0) > 0).sum())}
        loc = self.localization
        if loc is not None and loc.rows.size:
            out.update({
                "worst_ablated_object_probability": float(loc.probability.max()),
                "worst_ablated_probability_over_bound": float((loc.probability / loc.bound).max()),
                "localized_share": float(loc.holds.mean()),
                "ablated_object_still_top_share": float(loc.object_still_top.mean()),
                "min_ablated_error": float(loc.ablated_error.min()),
            })
        return out


def _tensors(data: QueryData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, lengths, valid, determined as tensors (sharing memory with ``data``)."""
    return (torch.from_numpy(data.tokens), torch.from_numpy(data.lengths), torch.from_numpy(data.valid),
            torch.from_numpy(data.determined))


def targets(data: QueryData, weight: np.ndarray | None = None) -> Targets:
    """The localize objective's per-query targets; expert k serves task k (declared).

    ``bound`` is 1/|O_k| on object queries of task k (their determined task) and NaN
    elsewhere (never read there: the ablation terms run on object queries only)."""
    Q = len(data)
    bound = np.full(Q, np.nan)
    oq = data.object_query
    bound[oq] = 1.0 / data.n_objects[data.determined[oq]]
    w = np.ones(Q) if weight is None else np.asarray(weight, np.float64)
    if w.shape != (Q,) or not np.all(w > 0):
        raise ValueError(f"query weights must be {Q} positive numbers")
    return Targets(torch.from_numpy(data.consistent), torch.from_numpy(data.object_token),
                   torch.from_numpy(bound.astype(np.float32)), torch.from_numpy(w.astype(np.float32)))


def _focus(seen: torch.Tensor, weight: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` queries drawn with replacement in proportion to weight × the loss last seen on
    them (not yet seen: the largest seen loss, at least 1), so a step spends part of its
    batch where the objective is still positive. Every query keeps its uniform share in
    the rest of the batch, so a learned query is seen again and its loss updated."""
    known = torch.isfinite(seen)
    # A loss is >= 0 in real arithmetic, but float32 can make it a hair negative (the valid
    # mass summed to 1 + 1e-7 gives −log P(valid) = −1e-7): such a query has nothing to learn.
    seen = torch.where(known, seen.clamp_min(0.0), seen)
    top = float(seen[known].max()) if bool(known.any()) else 1.0
    score = torch.where(known, seen, torch.full_like(seen, max(top, 1.0))) * weight
    if not bool((score > 0).any()):
        return torch.randint(0, seen.shape[0], (n,), generator=gen)
    return torch.multinomial(score, n, replacement=True, generator=gen)


class Epochs:
    """Shuffled epochs over the queries: successive random permutations, read in chunks.

    Every query is drawn exactly once per pass (every ⌈Q / n⌉ chunks of n), however rare
    its prefix: drawing with replacement (the older sampler) leaves a query unseen for a
    whole epoch with probability (1 − 1/Q)^Q ≈ 1/e, and a handful of singleton prefixes
    (``the P807 a``) then go many steps without a gradient."""

    def __init__(self, n_queries: int, generator: torch.Generator) -> None:
        self.n, self.gen = n_queries, generator
        self.order = torch.randperm(n_queries, generator=generator)
        self.at = 0
        self.passes = 0

    def take(self, n: int) -> torch.Tensor:
        """The next ``n`` queries of the walk (a new permutation when one is used up)."""
        out = []
        while n > 0:
            if self.at == self.n:
                self.order, self.at = torch.randperm(self.n, generator=self.gen), 0
                self.passes += 1
            k = min(n, self.n - self.at)
            out.append(self.order[self.at: self.at + k])
            self.at, n = self.at + k, n - k
        return torch.cat(out)


def _rate(warmup: int, steps: int, time_limit: float | None = None) -> Callable[[int, float], float]:
    """The learning-rate factor at (step, seconds elapsed): a linear warm-up over ``warmup``
    steps, then a cosine decay to 10% over the run's progress, the larger of the share of
    ``steps`` done and the share of ``time_limit`` spent. So a run cut by its time budget
    has finished its decay when the budget ends (the budget shapes the schedule rather
    than cutting it in its high-rate middle)."""
    def rate(step: int, elapsed: float = 0.0) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        if time_limit:
            t = max(t, elapsed / time_limit)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return rate


def train(taskset: TaskSet, config: TrainConfig = TrainConfig(), data: QueryData | None = None,
          log: Callable[[dict], None] | None = None, log_every: int = 100, *,
          model: MoETransformer | None = None, query_weights: np.ndarray | None = None,
          steps: int | None = None, warmup: int | None = None, round_no: int = 0,
          lr_scale: float = 1.0) -> TrainResult:
    """Train a model on every query of ``taskset`` (deterministic in ``config.seed``).

    ``model``: continue training this model (a counterexample round) instead of a new one;
    ``query_weights`` (Q,): positive per-query weights (default all 1); ``steps`` and
    ``warmup`` override the config's (a round's own schedule, with a fresh optimiser);
    ``lr_scale`` multiplies the whole schedule (a counterexample round continues at the
    rate the first round ended at, :data:`training.rounds.ROUND_LR`); ``round_no`` makes
    a round draw its own minibatches.

    Every ``log_every`` steps, on the last step and on the step the time limit ends, an
    entry (step, loss and its parts, seconds, and the round, its steps ``of`` and its
    ``time_limit``) is added to the history and given to ``log``."""
    if config.threads:
        torch.set_num_threads(config.threads)
    data = data or query_data(taskset)
    gen = torch.Generator().manual_seed(config.seed)
    if model is None:
        model = MoETransformer(config.model_config(data), generator=gen)
    if round_no:
        gen.manual_seed(config.seed + 1_000_003 * round_no)
    if not lr_scale > 0:
        raise ValueError("lr_scale must be > 0")
    steps = config.steps if steps is None else steps
    warmup = config.warmup if warmup is None else warmup
    tokens, lengths, valid, determined = _tensors(data)
    tg = targets(data, query_weights)
    objects = torch.from_numpy(data.object_query)
    Q = len(data)
    localize = config.objective == "localize"
    recipe = config.recipe()
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    rate = _rate(warmup, steps, config.time_limit)
    minibatch = bool(config.batch_size and config.batch_size < Q)
    focused = int(config.focus * config.batch_size) if minibatch and localize else 0
    seen = torch.full((Q,), float("inf"))     # last seen loss per query (inf: not seen yet)
    walk = Epochs(Q, gen) if minibatch else None
    # the walk's rows carry the query weight (relative to the mean, so 1 when uniform); the
    # focused rows were drawn in proportion to it and carry 1
    relative = tg.weight / tg.weight.mean()
    result = TrainResult(model, config)
    start = time.perf_counter()
    step = 0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = config.lr * lr_scale * rate(step, time.perf_counter() - start)
        if minibatch:
            idx = walk.take(config.batch_size - focused)
            row_weight = relative[idx]
            if focused:
                idx = torch.cat([idx, _focus(seen, tg.weight, focused, gen)])
                row_weight = torch.cat([row_weight, torch.ones(focused)])
            batch = (tokens[idx], lengths[idx], valid[idx], determined[idx])
            btg = tg.rows(idx)
            btg = Targets(btg.consistent, btg.object_token, btg.bound, row_weight)
            brows = torch.nonzero(objects[idx], as_tuple=True)[0]
        else:
            batch, btg = (tokens, lengths, valid, determined), tg
            brows = torch.nonzero(objects, as_tuple=True)[0]
        out = model(batch[0], batch[1], ablate=brows if localize else None)
        if localize:
            loss, parts, per_query = localize_loss(out, batch[2], btg, recipe, brows)
            if focused:
                seen[idx] = per_query
        else:
            loss, parts = objective_loss(config.objective, out, batch[2], batch[3], config.alpha, config.lam)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out_of_time = bool(config.time_limit and time.perf_counter() - start > config.time_limit)
        if log_every and (step % log_every == 0 or step == steps - 1 or out_of_time):
            entry = {"step": step, "loss": float(loss.detach()), **parts, "seconds": time.perf_counter() - start,
                     "round": round_no, "of": steps, "time_limit": config.time_limit}
            result.history.append(entry)
            if log:
                log(entry)
        if out_of_time:
            break
    result.steps = step + 1
    result.seconds = time.perf_counter() - start
    return result


@torch.no_grad()
def evaluate(model: MoETransformer, data: QueryData, dtype: torch.dtype = torch.float64,
             chunk: int = 8192) -> Evaluation:
    """Evaluate every query on a copy of ``model`` in ``dtype`` (float64 by default), and
    the ablated model (the routed expert's output removed) on every object query
    (:func:`training.metrics.localization`)."""
    m = copy.deepcopy(model).to(dtype).eval()
    tokens, lengths, valid, _ = _tensors(data)
    experts, errors, preds, gates, loc = [], [], [], [], []
    for lo in range(0, len(data), chunk):
        sl = slice(lo, lo + chunk)
        rows = np.flatnonzero(data.object_query[sl])
        out = m(tokens[sl], lengths[sl], ablate=torch.from_numpy(rows))
        experts.append(out.expert.numpy())
        errors.append(valid_error(out.logits, valid[sl]).numpy())
        preds.append(torch.argmax(out.logits, dim=-1).numpy())
        gates.append(out.gate.numpy())
        at = lo + rows
        loc.append(localization(out.ablated.numpy(), data.object_token[at], data.valid[at],
                                1.0 / data.n_objects[data.determined[at]]))
    expert = np.concatenate(experts)
    predicted = np.concatenate(preds)
    correct = data.valid[np.arange(len(data)), predicted]
    K = m.config.n_experts
    rows = np.flatnonzero(data.object_query)
    parts = {key: np.concatenate([p[key] for p in loc]) for key in loc[0]} if loc else {}
    located = Localization(rows=rows, task=data.determined[rows], **parts) if loc else None
    return Evaluation(expert=expert, error=np.concatenate(errors), predicted=predicted, correct=correct,
                      gate=np.concatenate(gates),
                      routing=routing_matrix(data.determined, expert, len(data.task_names), K),
                      object_query=data.object_query, localization=located)
