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

Every query is one prediction (the last position of its prefix), so a token in the
Switch formulas is a query here.
"""

from __future__ import annotations

import torch

from training.model import Output

OBJECTIVES = ("ce", "lb", "router")
OBJECTIVE_NAMES = {"ce": "CE", "lb": "CE + load balancing", "router": "CE + task router"}


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


def objective_loss(objective: str, out: Output, valid: torch.Tensor, determined: torch.Tensor,
                   alpha: float = 0.01, lam: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The total loss of ``objective`` and its parts (as floats, for logging)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
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
