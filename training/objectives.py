"""The three training objectives of the paper's experiments.

* ``"ce"``: cross-entropy against the *set* of valid next tokens,
  ``-log Σ_{v valid} p(v)`` per query, averaged over the queries. A prefix such as
  ``the`` has several valid continuations (from several templates and tasks); this loss
  asks for probability mass on the set, not on one sampled member. It is exactly
  ``-log(1 - err)`` with ``err = 1 - P(valid)`` the error the verifier bounds.
* ``"lb"``: CE + the Switch Transformer load-balancing loss
  ``α · K · Σ_i f_i · P_i``, where over the batch's queries f_i is the fraction routed
  (top-1) to expert i and P_i the mean router probability softmax(g)_i. Only P_i carries
  a gradient. Default α = 0.01 (Switch's).
* ``"router"``: CE + λ · task-router loss: the cross-entropy of the gate scores g against
  the query's task, on the queries whose prefix determines a task (expert i <-> task i;
  with fewer experts than tasks, task i <-> expert i mod K). Default λ = 1.
* ``"localize"``: a recipe aimed at the verifier's certificate (:func:`localize_loss`),
  one term per check, each a hinge that is zero once the check holds with room:

  - *error*: CE (−log P(valid)) + a hinge on log(1 − P(valid)) above log(ρ_err·ε), both
    from one softmax per query (:func:`log_masses`: P(valid) in log space where it
    underflows, so a query far from learned keeps its gradient), so every query's error
    is below ε with room (the verifier certifies the exact pass of the float64 export;
    float32 training weights are exact in float64, and the room absorbs the float32
    training arithmetic);
  - *routing*, on **every** prefix, shared ones included: the gate's set cross-entropy
    −log Σ_{e consistent} softmax(g)_e (the task router, extended to prefixes several
    tasks share) and a hinge asking the best consistent expert's score to exceed every
    inconsistent one by ``route_margin``. A consistent expert is one serving a task
    consistent with the prefix (expert k <-> task k), so the gate's winner then serves a
    consistent task, the verifier's routing rule;
  - *localization*, on object queries, with the ablated logits z = U·r (the routed
    expert's output removed, as the verifier ablates): a hinge on the object's logit
    above the best other token's minus ``ablation_margin`` (the object is not the top
    token, check L2), a hinge on log P_ablated(o) above log(ρ_abl / |O_k|) (no better
    than a uniform guess among the task's objects, check L1), and a hinge on the
    ablated probability of the valid set above 1 − min(1/2, 4ε) (the verifier's older
    entanglement criterion, ablated error ≥ ε, which L1 does not imply when an object
    query has other valid tokens).

  - *attention spread* (``attention_spread``, optional): per head, a hinge on the largest
    minus the smallest visible attention score above that many nats. No check reads it:
    it keeps every position's attention weight away from 0, where its gradient vanishes
    (a head saturated on the template tokens never learns to read the subject: the
    residuals of a whole query group then coincide, and no weight on its queries helps).

  Every term is per query and weighted by the query's weight (counterexample rounds,
  :mod:`training.rounds`, raise the weights of failing queries).

Every query is one prediction (the last position of its prefix), so a token in the
Switch formulas is a query here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from training.model import Output

OBJECTIVES = ("ce", "lb", "router", "localize")
OBJECTIVE_NAMES = {"ce": "CE", "lb": "CE + load balancing", "router": "CE + task router",
                   "localize": "certificate recipe (localize)"}


@dataclass(frozen=True)
class Targets:
    """What the ``localize`` terms need beyond the valid tokens, per query of a batch."""

    consistent: torch.Tensor   # (B, K) bool: expert e serves a task consistent with the prefix
    object_token: torch.Tensor  # (B,) int64: D_k(s) for object queries, -1 otherwise
    bound: torch.Tensor        # (B,) 1/|O_k| for object queries (the localization bound), NaN otherwise
    weight: torch.Tensor       # (B,) the query's weight (> 0)

    def rows(self, idx: torch.Tensor) -> "Targets":
        return Targets(self.consistent[idx], self.object_token[idx], self.bound[idx], self.weight[idx])


@dataclass(frozen=True)
class Recipe:
    """The ``localize`` objective's margins (see the module docstring)."""

    epsilon: float = 0.01        # the verifier's target error
    error_room: float = 0.1      # error hinge at error_room · ε
    route_margin: float = 2.0    # gate: best consistent score above every inconsistent one
    ablation_margin: float = 1.0  # ablated logits: another token above the object by this much
    ablation_room: float = 0.5   # ablated P(object) at most ablation_room / |O_k|
    attention_spread: float | None = None   # per head, visible attention scores within this many nats (None: free)


def valid_set_ce(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per query ``-log Σ_{v valid} softmax(logits)_v`` (valid: bool (B, V))."""
    all_lse = torch.logsumexp(logits, dim=-1)
    valid_lse = torch.logsumexp(logits.masked_fill(~valid, float("-inf")), dim=-1)
    return all_lse - valid_lse


def valid_error(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per query ``err = 1 - P(valid) = Σ_{v invalid} p(v)``, computed without cancellation."""
    all_lse = torch.logsumexp(logits, dim=-1)
    invalid_lse = torch.logsumexp(logits.masked_fill(valid, float("-inf")), dim=-1)
    return torch.exp(invalid_lse - all_lse)


def load_balancing(out: Output) -> torch.Tensor:
    """Switch load-balancing loss K · Σ_i f_i · P_i (equals 1 when perfectly balanced)."""
    K = out.gate.shape[1]
    f = torch.bincount(out.expert, minlength=K).to(out.gate_probs.dtype) / out.expert.shape[0]
    P = out.gate_probs.mean(dim=0)
    return K * torch.sum(f * P)


def task_router(out: Output, determined: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the gate scores against the determined task (expert = task mod K)."""
    keep = determined >= 0
    if not bool(keep.any()):
        return out.gate.sum() * 0.0
    K = out.gate.shape[1]
    return torch.nn.functional.cross_entropy(out.gate[keep], determined[keep] % K)


#: Probabilities are floored here before their log. A floored log is harmless in a hinge
#: that pushes a probability *down* (the error, P_ablated(o)): below 1e-30 it is inactive
#: anyway. A term that pushes a mass *up* (−log P(valid); the ablated error) must not see
#: the floor, or a mass that float32 rounds to 0 gets no gradient: :func:`log_masses`.
TINY = 1e-30

#: Below this the fast (softmax) value of a mass that must be raised is replaced by its
#: log-space value (well inside float32's range, so the fast value above it is accurate).
FLOOR = 1e-20


def _log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.clamp_min(TINY))


def _log_mass(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row ``log Σ_{v in mask} softmax(logits)_v`` in log space (no probability formed,
    so nothing underflows): the masked log-sum-exp minus the full one. The masked-out
    entries are the dtype's most negative finite number, not −∞, so a row whose mask is
    empty gives about −3.4e38 (float32) and no −∞ − (−∞) = NaN in the backward pass."""
    neg = torch.finfo(logits.dtype).min
    return torch.logsumexp(logits.masked_fill(~mask, neg), dim=-1) - torch.logsumexp(logits, dim=-1)


def log_masses(logits: torch.Tensor, valid: torch.Tensor, p: torch.Tensor | None = None,
               exact: str = "valid") -> tuple[torch.Tensor, torch.Tensor]:
    """Per query (log P(valid), log(1 − P(valid))), from one softmax (``p``, computed if not
    given), each mass summed over its own tokens (the error is a sum of the invalid tokens'
    probabilities, not 1 minus a number near 1, so it keeps its relative precision).

    The mass named by ``exact`` ("valid" or "error"), the one a loss pushes up, is exact
    in log space on the rows where its softmax value is below :data:`FLOOR` (recomputed by
    :func:`_log_mass` on those rows only: few, and the fast path elsewhere); the other is
    floored at :data:`TINY`. This matters: a query whose valid tokens sit 70 or more nats
    below the top token has P(valid) < 1e-30, which float32 rounds to 0; a loss on the
    floored log of that 0 has no gradient, and the query is never learned however often
    it is drawn or weighted (``of P1101 a Q169`` in a 1,000-fact run before this form:
    log P(valid) = −99). Here −log P(valid) keeps its gradient, P(invalid) ≈ 1."""
    if exact not in ("valid", "error"):
        raise ValueError(f"exact must be 'valid' or 'error', got {exact!r}")
    p = torch.softmax(logits, dim=-1) if p is None else p
    zero = p.new_zeros(())
    mass = {"valid": torch.where(valid, p, zero).sum(dim=-1), "error": torch.where(valid, zero, p).sum(dim=-1)}
    logs = {name: _log(m) for name, m in mass.items()}
    low = torch.nonzero(mass[exact] < FLOOR, as_tuple=True)[0]
    if low.numel():
        mask = valid[low] if exact == "valid" else ~valid[low]
        logs[exact] = logs[exact].index_put((low,), _log_mass(logits[low], mask))
    return logs["valid"], logs["error"]


def error_hinge(logits: torch.Tensor, valid: torch.Tensor, target: float) -> torch.Tensor:
    """Per query ``max(0, log(1 − P(valid)) − log target)``: zero once the error is at most
    ``target`` (a query with every token valid has error 0 and a zero hinge)."""
    return torch.relu(log_masses(logits, valid)[1] - math.log(target))


def routing_hinge(gate: torch.Tensor, consistent: torch.Tensor, margin: float) -> torch.Tensor:
    """Per query ``max(0, margin − (max_{e consistent} g_e − max_{e not consistent} g_e))``.

    Zero exactly when the best consistent expert's score exceeds every other expert's by
    ``margin``, so the gate's (unique) winner serves a consistent task. A prefix that every
    expert is consistent with has no inconsistent expert and a zero hinge."""
    neg = torch.finfo(gate.dtype).min
    best_in = gate.masked_fill(~consistent, neg).max(dim=-1).values
    best_out = gate.masked_fill(consistent, neg).max(dim=-1).values
    has_out = (~consistent).any(dim=-1)
    return torch.where(has_out, torch.relu(margin - (best_in - best_out)), torch.zeros_like(best_in))


def gate_set_ce(gate: torch.Tensor, consistent: torch.Tensor) -> torch.Tensor:
    """Per query ``−log Σ_{e consistent} softmax(g)_e``: the task router's loss, extended to
    prefixes shared by several tasks (any consistent expert will do)."""
    return torch.logsumexp(gate, dim=-1) - torch.logsumexp(gate.masked_fill(~consistent, float("-inf")), dim=-1)


def ablation_hinges(ablated: torch.Tensor, obj: torch.Tensor, valid: torch.Tensor, bound: torch.Tensor,
                    recipe: Recipe) -> dict[str, torch.Tensor]:
    """The localization terms on object queries' ablated logits ``ablated`` (A, V).

    * ``top``: ``max(0, margin + z_o − max_{v != o} z_v)``, zero once another token's
      ablated logit exceeds the object's by ``ablation_margin`` (check L2 with room);
    * ``probability``: ``max(0, log p_o − log(room · bound))`` with p = softmax(z), zero once
      P_ablated(o) ≤ ablation_room / |O_k| (check L1 with room);
    * ``valid``: ``max(0, log min(1/2, 4ε) − log(1 − P_ablated(valid)))``, zero once the
      ablated error is at least min(1/2, 4ε) ≥ ε (the older entanglement criterion); in
      the log of the error, whose gradient does not vanish as P_ablated(valid) nears 1
      (a row with every token valid has no error to raise and a zero term).
    """
    rows = torch.arange(ablated.shape[0])
    z_o = ablated[rows, obj]
    best2 = torch.topk(ablated, 2, dim=-1) if ablated.shape[1] > 1 else None
    if best2 is None:           # one token: it is the object, nothing can beat it
        best_other = torch.full_like(z_o, float("-inf"))
    else:
        best_other = torch.where(best2.indices[:, 0] == obj, best2.values[:, 1], best2.values[:, 0])
    top = torch.relu(recipe.ablation_margin + z_o - best_other)
    p = torch.softmax(ablated, dim=-1)
    probability = torch.relu(_log(p[rows, obj]) - torch.log(recipe.ablation_room * bound))
    has_invalid = (~valid).any(dim=-1)
    log_error = log_masses(ablated, valid, p=p, exact="error")[1]
    wrong = min(0.5, 4 * recipe.epsilon)
    valid_term = torch.where(has_invalid, torch.relu(math.log(wrong) - log_error), torch.zeros_like(log_error))
    return {"top": top, "probability": probability, "valid": valid_term}


def localize_terms(out: Output, valid: torch.Tensor, targets: Targets, recipe: Recipe,
                   objects: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every term of the ``localize`` objective per query of the batch, (B,) each (the
    ablation terms are 0 on rows that are not object queries).

    ``objects``: the batch rows of the object queries, in the order of ``out.ablated``
    (the forward pass was asked for their ablated logits)."""
    log_valid, log_err = log_masses(out.logits, valid)
    terms = {
        "ce": -log_valid,
        "error": torch.relu(log_err - math.log(recipe.error_room * recipe.epsilon)),
        "gate": gate_set_ce(out.gate, targets.consistent),
        "route": routing_hinge(out.gate, targets.consistent, recipe.route_margin),
    }
    if recipe.attention_spread is not None and out.spread is not None:
        terms["attention"] = torch.relu(out.spread - recipe.attention_spread).sum(dim=-1)
    if objects.numel():
        ab = ablation_hinges(out.ablated, targets.object_token[objects], valid[objects], targets.bound[objects], recipe)
        for name, v in ab.items():
            terms["ablated_" + name] = torch.zeros_like(log_valid).index_put((objects,), v)
    return terms


def localize_loss(out: Output, valid: torch.Tensor, targets: Targets, recipe: Recipe,
                  objects: torch.Tensor) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The ``localize`` objective: the weighted mean over the batch of every term; its parts
    (floats, for logging) and each query's total (detached, for the minibatch sampler)."""
    terms = localize_terms(out, valid, targets, recipe, objects)
    w = targets.weight
    total = w.sum().detach()
    per_query = sum(terms.values())
    loss = (w * per_query).sum() / total
    parts = {name: float((w * v).sum().detach() / total) for name, v in terms.items()}
    return loss, parts, per_query.detach()


def objective_loss(objective: str, out: Output, valid: torch.Tensor, determined: torch.Tensor,
                   alpha: float = 0.01, lam: float = 1.0, targets: Targets | None = None,
                   recipe: Recipe | None = None, objects: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """The total loss of ``objective`` and its parts (as floats, for logging).

    ``localize`` needs ``targets``, ``recipe`` and ``objects`` (see :func:`localize_loss`);
    the other objectives ignore them (their loss is the unweighted mean)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "localize":
        if targets is None or recipe is None or objects is None:
            raise ValueError("the localize objective needs targets, a recipe and the object rows")
        return localize_loss(out, valid, targets, recipe, objects)[:2]
    ce = valid_set_ce(out.logits, valid).mean()
    parts = {"ce": float(ce.detach())}
    loss = ce
    if objective == "lb":
        lb = load_balancing(out)
        parts["lb"] = float(lb.detach())
        loss = loss + alpha * lb
    elif objective == "router":
        tr = task_router(out, determined)
        parts["router"] = float(tr.detach())
        loss = loss + lam * tr
    return loss, parts
