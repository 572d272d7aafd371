"""Trained torch weights -> :class:`layout.Weights` (scipy CSR, float64).

The torch model *is* the layout's forward pass (see :mod:`training.model`), so the
export is a copy: ``E``, ``P``, per head ``W_Q``, ``W_K``, ``W_V``, ``W_O``, ``W_G``, ``b_G``,
per expert ``W_1``, ``b_1``, ``W_2``, ``U``, each converted to float64 (float32 values are
exact in float64) and stored as CSR (exact zeros are dropped, which changes nothing).
Expert k keeps its first ``config.widths[k]`` neurons: the others are masked in the
torch model (their activation times an exact 0 adds an exact 0 to every output), so
dropping them changes no float, and the exported width is what the verifier's size
check reads.
``gate_mode`` is the model's (``"top1-scaled"`` by default); ``vocab`` is the task set's.

``expert_tasks`` (which task each expert serves) is a claim the verifier checks; a
trained model makes no such claim, so the default is ``""`` for every expert (the
verifier then reports every query as misrouted). On request:

* ``"majority"``: each expert is labelled with the task routed to it most, made
  one-to-one as the layout requires (an expert serves one task and a task one expert):
  the assignment maximising the determined queries that reach their own task's expert
  (:func:`training.metrics.majority_mapping`);
* ``"declared"``: expert i serves task i, the assignment the task-router loss trains.

``parameters`` records the objective, seed and steps, and the mapping used (kept short:
the verifier prints them on one line).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from tasks.model import TaskSet
from training.metrics import declared_mapping, majority_mapping
from training.model import ModelConfig, MoETransformer
from layout import Expert, Head, Weights

MAPPINGS = ("none", "majority", "declared")


def _csr(t: torch.Tensor) -> sp.csr_matrix:
    return sp.csr_matrix(t.detach().to(torch.float64).cpu().numpy())


def _vec(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy().copy()


def to_weights(model: MoETransformer, taskset: TaskSet, expert_tasks: str | tuple[str, ...] = "none",
               routing: np.ndarray | None = None, config=None, extra: dict | None = None) -> Weights:
    """The layout's weights of ``model``; ``expert_tasks``: a mode of :data:`MAPPINGS` or names.

    ``routing`` (tasks x experts, determined queries) is needed for ``"majority"``;
    ``config`` (a TrainConfig) is recorded in ``parameters``, with ``extra`` (e.g. the
    counterexample rounds and their total steps).
    """
    K = model.config.n_experts
    names = taskset.names
    if isinstance(expert_tasks, str):
        if expert_tasks == "none":
            mapping = ("",) * K
        elif expert_tasks == "majority":
            if routing is None:
                raise ValueError("the majority mapping needs the routing matrix (training.loop.evaluate(...).routing)")
            mapping = majority_mapping(routing, names)
        elif expert_tasks == "declared":
            mapping = declared_mapping(names, K)
        else:
            raise ValueError(f"expert_tasks must be one of {MAPPINGS} or a tuple of task names, got {expert_tasks!r}")
        mode = expert_tasks
    else:
        mapping = tuple(expert_tasks)
        mode = "given"
    if len(mapping) != K:
        raise ValueError(f"expert_tasks has {len(mapping)} entries for {K} experts")
    if len(taskset.vocabulary.tokens) != model.config.vocab_size:
        raise ValueError("the model was not trained on this task set's vocabulary")
    heads = tuple(Head(_csr(model.W_Q[m]), _csr(model.W_K[m]), _csr(model.W_V[m]), _csr(model.W_O[m]))
                  for m in range(model.config.n_heads))
    widths = model.config.widths
    experts = tuple(Expert(_csr(model.W_1[k, :w]), _vec(model.b_1[k, :w]), _csr(model.W_2[k, :, :w]))
                    for k, w in enumerate(widths))
    parameters: dict = {"trained": "torch", "expert_tasks": mode}
    if config is not None:
        parameters.update({"objective": config.objective, "seed": config.seed, "steps": config.steps})
    parameters.update(extra or {})
    weights = Weights(
        vocab=taskset.vocabulary.tokens,
        E=_csr(model.E), P=_csr(model.P), heads=heads,
        W_G=_csr(model.W_G), b_G=_vec(model.b_G),
        experts=experts, U=_csr(model.U),
        expert_tasks=mapping, gate_mode=model.config.gate_mode,
        parameters=parameters,
    )
    weights.validate("trained weights")
    return weights


def from_weights(weights: Weights, dtype: torch.dtype = torch.float32) -> MoETransformer:
    """A :class:`MoETransformer` computing ``weights``' forward pass (the inverse of
    :func:`to_weights`), with its parameters in ``dtype`` (rounded to nearest, as
    ``Tensor.to`` does).

    The torch model stacks heads and experts with one shape each, so narrower ones are
    padded with zeros: a head's extra query/key rows add 0·0 = 0 to every score, its extra
    value rows give values 0 that its extra W_O columns multiply by 0, and an expert's
    extra neurons have W_1 rows and b_1 of 0 (ReLU(0) = 0) and W_2 columns of 0 (and are
    masked: ``expert_widths`` are the weights' widths, so :func:`to_weights` gives them
    back). Every added term is an exact zero, so the padded model computes the same floats.
    """
    H = len(weights.heads)
    dh = max([1] + [max(h.W_Q.shape[0], h.W_V.shape[0]) for h in weights.heads])
    width = max(e.width for e in weights.experts)
    config = ModelConfig(vocab_size=len(weights.vocab), n_positions=weights.n_positions, d=weights.d,
                         n_heads=max(H, 1), d_head=dh, n_experts=len(weights.experts), expert_width=max(width, 1),
                         gate_mode=weights.gate_mode,
                         expert_widths=tuple(max(e.width, 1) for e in weights.experts))
    model = MoETransformer(config)

    def dense(M, shape) -> torch.Tensor:
        out = np.zeros(shape)
        A = M.toarray() if hasattr(M, "toarray") else np.asarray(M)
        out[tuple(slice(0, s) for s in A.shape)] = A
        return torch.from_numpy(out)

    d = weights.d
    with torch.no_grad():
        params = {"E": dense(weights.E, (config.vocab_size + 1, d)), "P": dense(weights.P, (config.n_positions, d)),
                  "W_G": dense(weights.W_G, (config.n_experts, d)), "b_G": torch.from_numpy(np.asarray(weights.b_G)),
                  "U": dense(weights.U, (config.vocab_size, d))}
        params["W_Q"] = torch.stack([dense(h.W_Q, (dh, d)) for h in weights.heads]) if H else torch.zeros(1, dh, d)
        params["W_K"] = torch.stack([dense(h.W_K, (dh, d)) for h in weights.heads]) if H else torch.zeros(1, dh, d)
        params["W_V"] = torch.stack([dense(h.W_V, (dh, d)) for h in weights.heads]) if H else torch.zeros(1, dh, d)
        params["W_O"] = torch.stack([dense(h.W_O, (d, dh)) for h in weights.heads]) if H else torch.zeros(1, d, dh)
        params["W_1"] = torch.stack([dense(e.W_1, (config.expert_width, d)) for e in weights.experts])
        params["b_1"] = torch.stack([dense(e.b_1, (config.expert_width,)) for e in weights.experts])
        params["W_2"] = torch.stack([dense(e.W_2, (d, config.expert_width)) for e in weights.experts])
        for name, value in params.items():
            setattr(model, name, torch.nn.Parameter(value.to(torch.float64).to(dtype)))
    return model
