"""The verifier's per-query numbers, lined up with :class:`training.data.QueryData` rows.

:func:`verifier.checks.verify.verify` reports aggregates (per task, the routing matrix). To check
that the exported weights compute what the training code computed, :func:`certified_pass`
runs the verifier's certified forward pass (:func:`verifier.checks.certify.certify`) on every
query, batched by prefix length, and returns, per query row: the chosen
expert, the certified gate margin, the error enclosure [err_lo, err_hi] of
1 - P(valid), the predicted token and, on object queries (``ablate_objects``), the
enclosure [ablated_lo, ablated_hi] of the error with the routed expert's output removed. :func:`agreement` compares them
with a float64
:class:`training.loop.Evaluation`; :func:`routing_failures` applies the verifier's routing
rule per query, split into task-determining queries and prefixes shared by several tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.model import TaskSet
from training.data import QueryData
from layout import Weights
from verifier.checks.certify import certify, prepare

CHUNK = 20_000


@dataclass(frozen=True)
class CertifiedPass:
    expert: np.ndarray      # (Q,)
    margin: np.ndarray      # (Q,) certified gate margin (<= 0: not a certified unique winner)
    err_lo: np.ndarray      # (Q,) enclosure of 1 - P(valid)
    err_hi: np.ndarray
    predicted: np.ndarray   # (Q,) weights' token id of the largest logit midpoint (-1: a zero-logit token)
    ablated_lo: np.ndarray | None = None   # (Q,) ablated error enclosure on object queries (NaN elsewhere)
    ablated_hi: np.ndarray | None = None


def certified_pass(taskset: TaskSet, weights: Weights, data: QueryData, chunk: int = CHUNK,
                   ablate_objects: bool = False) -> CertifiedPass:
    """Run the verifier's certified pass (:func:`verifier.checks.certify.certify`) on every
    query; rows in ``data``'s order. With ``ablate_objects`` the object queries also get
    their ablated error enclosure (the verifier's entanglement measure)."""
    tmap = weights.token_ids(taskset.vocabulary.tokens)
    prep = prepare(weights)
    Q = len(data)
    expert, predicted = np.zeros(Q, np.int64), np.zeros(Q, np.int64)
    out = {k: np.full(Q, np.nan) for k in ("margin", "err_lo", "err_hi", "ablated_lo", "ablated_hi")}
    for ablate in ((False, True) if ablate_objects else (None,)):
        rows = np.arange(Q) if ablate is None else np.flatnonzero(data.object_query == ablate)
        if not rows.size:
            continue
        prefixes = [tmap[data.tokens[q, 1: data.lengths[q] + 1]] for q in rows]
        valid = [tmap[np.flatnonzero(data.valid[q])] for q in rows]
        res = certify(prep, prefixes, valid, chunk=chunk, ablate=bool(ablate))
        expert[rows], predicted[rows] = res.expert, res.predicted
        for k in ("margin", "err_lo", "err_hi") + (("ablated_lo", "ablated_hi") if ablate else ()):
            out[k][rows] = getattr(res, k)
    return CertifiedPass(expert, out["margin"], out["err_lo"], out["err_hi"], predicted,
                         out["ablated_lo"] if ablate_objects else None, out["ablated_hi"] if ablate_objects else None)


def agreement(evaluation, cert: CertifiedPass, tol: float = 1e-9) -> dict[str, float | int]:
    """How the float64 evaluation and the certified pass agree.

    ``expert_mismatches``: queries routed differently; ``outside``: queries whose float64
    error lies outside [err_lo - tol, err_hi + tol]; ``max_gap``: the largest distance of
    the float64 error from the enclosure (0 when inside); ``max_width``: the widest
    enclosure.
    """
    err = evaluation.error
    gap = np.maximum(cert.err_lo - err, err - cert.err_hi)
    return {
        "queries": int(err.size),
        "expert_mismatches": int(np.sum(evaluation.expert != cert.expert)),
        "outside": int(np.sum(gap > tol)),
        "max_gap": float(max(0.0, np.max(gap))) if err.size else 0.0,
        "max_width": float(np.max(cert.err_hi - cert.err_lo)) if err.size else 0.0,
    }


def routing_failures(data: QueryData, cert: CertifiedPass, expert_tasks: tuple[str, ...]) -> dict[str, int]:
    """The verifier's routing rule per query, split by whether the prefix determines a task.

    A query is well routed when its gate winner is certified (margin > 0) and the winning
    expert serves a task consistent with the prefix (``expert_tasks``, "" = none).
    """
    names = list(data.task_names)
    serves = np.array([names.index(t) if t in names else -1 for t in expert_tasks], np.int64)
    served = serves[cert.expert]
    rows = np.arange(len(data))
    ok = (cert.margin > 0) & (served >= 0) & data.consistent[rows, np.maximum(served, 0)]
    det = data.determined >= 0
    return {"determined": int(det.sum()), "determined_misrouted": int((~ok & det).sum()),
            "shared": int((~det).sum()), "shared_misrouted": int((~ok & ~det).sum())}
