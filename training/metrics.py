"""Routing and size measures shared by the training code, the sweep and the test.

* **routing matrix**: tasks x experts, counting the queries whose prefix *determines*
  the task (the same matrix as :attr:`verifier.checks.verify.Report.routing_matrix`);
* **routing purity**: per task, the share of its determined queries that reach its most
  used expert, averaged over the tasks (1 = every task has one expert; 1/K at worst for
  a uniform spread; permutation invariant, and it does not require different tasks to
  use different experts, see :func:`distinct_experts`);
* **routing entropy**: per task, the entropy (bits) of its distribution over experts,
  averaged over the tasks (0 = one expert per task, log2 K = uniform);
* **majority mapping**: each expert labelled with the task routed to it most, made
  one-to-one as the layout requires (:func:`majority_mapping`), for
  :attr:`layout.Weights.expert_tasks`;
* **localization** (:func:`localization`): per object query, with the routed expert's
  output removed (logits U·r), the object's probability and whether another token's
  logit is at least the object's: the strengthened entanglement check (L1: P_ablated(o)
  ≤ 1/|O_k|; L2: the object is not the top token, ties allowed) measured in float64.
  This is **not a certificate** (no enclosure; the verifier certifies it): training uses
  it to decide which queries to feed back, and the sweep reports it beside the
  verifier's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


#: For decisions (counterexample rounds) the float64 measure errs toward failing: a query
#: within this relative distance of either threshold (p_o near 1/|O_k|, or the object's
#: logit near the best other's) counts as failing (:attr:`Localization.holds_with_slack`),
#: so rounding in the uncertified measure cannot call a query localized that the exact
#: values might not make so. The reported measure (:attr:`Localization.holds`) is the
#: criterion itself, ties allowed.
LOCALIZATION_SLACK = 1e-6


@dataclass(frozen=True)
class Localization:
    """The ablated model on object queries (float64, uncertified); rows = object queries."""

    rows: np.ndarray          # (A,) query rows (QueryData order)
    task: np.ndarray          # (A,) the task the query determines
    probability: np.ndarray   # (A,) P_ablated(o | q), o = D_k(s)
    gap: np.ndarray           # (A,) max_{v != o} z_v − z_o (>= 0: the object is not the sole top token)
    bound: np.ndarray         # (A,) 1/|O_k|
    ablated_error: np.ndarray  # (A,) 1 − P_ablated(valid), the older entanglement measure
    scale: np.ndarray         # (A,) max(1, |z_o|), for the slack on the gap

    @property
    def below_bound(self) -> np.ndarray:
        """L1: P_ablated(o) ≤ 1/|O_k|."""
        return self.probability <= self.bound

    @property
    def not_top(self) -> np.ndarray:
        """L2: another token's ablated logit is at least the object's (ties allowed)."""
        return self.gap >= 0

    @property
    def holds(self) -> np.ndarray:
        """L1 and L2, in float64."""
        return self.below_bound & self.not_top

    @property
    def holds_with_slack(self) -> np.ndarray:
        """L1 and L2 with room: P_ablated(o) ≤ (1 − slack)/|O_k| and another token's logit
        ≥ the object's + slack · max(1, |z_o|) (what the rounds require)."""
        return ((self.probability <= self.bound * (1 - LOCALIZATION_SLACK))
                & (self.gap >= LOCALIZATION_SLACK * self.scale))

    @property
    def object_still_top(self) -> np.ndarray:
        """The ablated model's top token is the object (strictly), what the old check allowed."""
        return self.gap < 0

    def worst_probability(self, n_tasks: int) -> np.ndarray:
        """Per task, the largest P_ablated(o) over its object queries (NaN: none)."""
        out = np.full(n_tasks, -np.inf)
        np.maximum.at(out, self.task, self.probability)
        return np.where(np.isfinite(out), out, np.nan)

    def share_per_task(self, n_tasks: int) -> np.ndarray:
        """Per task, the share of its object queries that hold L1 and L2 (NaN: none)."""
        n = np.bincount(self.task, minlength=n_tasks).astype(np.float64)
        ok = np.bincount(self.task[self.holds], minlength=n_tasks)
        return np.divide(ok, n, out=np.full(n_tasks, np.nan), where=n > 0)


def localization(ablated: np.ndarray, objects: np.ndarray, valid: np.ndarray,
                 bound: np.ndarray) -> dict[str, np.ndarray]:
    """Per row of ablated logits ``ablated`` (A, V, float64): the object's probability, the gap
    max_{v != o} z_v − z_o, the ablated error 1 − P(valid) and max(1, |z_o|).

    Softmax in the log domain (logsumexp with the maximum subtracted), so large logits
    neither overflow nor lose the small probabilities."""
    z = np.asarray(ablated, np.float64)
    rows = np.arange(z.shape[0])
    m = z.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(z - m).sum(axis=1))) if z.size else np.zeros(0)
    z_o = z[rows, objects]
    others = z.copy()
    others[rows, objects] = -np.inf
    invalid = np.where(valid, -np.inf, z)
    mi = invalid.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        inv_lse = np.where(np.isfinite(mi[:, 0]),
                           mi[:, 0] + np.log(np.exp(invalid - np.where(np.isfinite(mi), mi, 0)).sum(axis=1)), -np.inf)
    return {"probability": np.exp(z_o - lse), "gap": others.max(axis=1) - z_o,
            "ablated_error": np.exp(inv_lse - lse), "scale": np.maximum(1.0, np.abs(z_o)),
            "bound": np.asarray(bound, np.float64)}


def routing_matrix(determined: np.ndarray, expert: np.ndarray, n_tasks: int, n_experts: int) -> np.ndarray:
    """Counts (tasks x experts) over the queries with ``determined >= 0``."""
    keep = determined >= 0
    m = np.zeros((n_tasks, n_experts), np.int64)
    np.add.at(m, (determined[keep], expert[keep]), 1)
    return m


def _rows(matrix: np.ndarray) -> np.ndarray:
    m = np.asarray(matrix, np.float64)
    m = m[m.sum(axis=1) > 0]
    return m / m.sum(axis=1, keepdims=True)


def purity(matrix: np.ndarray) -> float:
    """Mean over tasks of the share of its determined queries at its most used expert."""
    rows = _rows(matrix)
    return float(rows.max(axis=1).mean()) if rows.size else float("nan")


def entropy(matrix: np.ndarray) -> float:
    """Mean over tasks of the entropy (bits) of the task's routing distribution."""
    rows = _rows(matrix)
    if not rows.size:
        return float("nan")
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(rows > 0, rows * np.log2(rows), 0.0).sum(axis=1)
    return float(h.mean())


def distinct_experts(matrix: np.ndarray) -> int:
    """How many different experts are some task's most used expert."""
    rows = np.asarray(matrix)
    rows = rows[rows.sum(axis=1) > 0]
    return int(len(set(np.argmax(rows, axis=1).tolist())))


def majority_mapping(matrix: np.ndarray, task_names: tuple[str, ...]) -> tuple[str, ...]:
    """Expert -> task labels by majority routing, one-to-one ("" for unlabelled experts).

    The layout allows each task to name one expert and each expert one task, so the
    labels are the assignment (Hungarian method, ``scipy.optimize.linear_sum_assignment``)
    that maximises the number of determined queries reaching their own task's expert.
    When every expert's majority task is different this is exactly "each expert serves
    the task routed to it most"; otherwise a task routed mostly to one expert that
    another task needs more takes its next best. A pair with no query is left unlabelled.
    """
    from scipy.optimize import linear_sum_assignment

    m = np.asarray(matrix, np.float64)
    tasks, experts = linear_sum_assignment(m, maximize=True)
    out = [""] * m.shape[1]
    for t, e in zip(tasks.tolist(), experts.tolist()):
        if m[t, e] > 0:
            out[e] = task_names[t]
    return tuple(out)


def declared_mapping(task_names: tuple[str, ...], n_experts: int) -> tuple[str, ...]:
    """The task-router loss's assignment: expert i serves task i ("" beyond the tasks).

    With fewer experts than tasks the loss sends task i to expert i mod K; an expert can
    name only one task, so it is labelled with the first (the verifier will report the
    other tasks' queries as misrouted).
    """
    return tuple(task_names[k] if k < len(task_names) else "" for k in range(n_experts))


def _nnz(m) -> int:
    import scipy.sparse as sp

    if sp.issparse(m):
        m = m.tocsr()
        return int(np.count_nonzero(m.data))
    return int(np.count_nonzero(np.asarray(m)))


def parameter_counts(weights, routed_expert: np.ndarray) -> dict[str, float]:
    """Nonzero parameters of :class:`layout.Weights`: total and active per query.

    Counts **nonzero entries** (for a dense trained model that is every parameter; for
    the hand-built sparse model the structural zeros are not parameters). ``shared`` is
    everything but the experts (E, P, the heads, the gate, U); a query activates the
    shared part and its routed expert (W_1, b_1, W_2), so ``active`` is
    shared + the mean over the queries of the routed expert's count
    (``routed_expert``: one expert index per query).
    """
    per_expert = np.array([_nnz(e.W_1) + _nnz(e.b_1) + _nnz(e.W_2) for e in weights.experts], np.int64)
    total = sum(_nnz(m) for _, m in weights.arrays())
    shared = total - int(per_expert.sum())
    routed = np.asarray(routed_expert, np.int64)
    mean_expert = float(per_expert[routed].mean()) if routed.size else 0.0
    return {"total": int(total), "shared": int(shared), "active": shared + mean_expert,
            "largest_expert": int(per_expert.max())}


def _support(M, axis: int) -> np.ndarray:
    """Indices of the columns (axis 1) or rows (axis 0) of M holding a nonzero entry."""
    import scipy.sparse as sp

    C = sp.coo_matrix(M)
    keep = C.data != 0
    return np.unique((C.col if axis == 1 else C.row)[keep])


def ablated_logits_vanish(weights) -> bool:
    """Whether U·r = 0 exactly for every prefix, by sparsity alone (then, with the routed
    expert's output removed, every token has logit 0: P_ablated(o) = 1/V for every object
    query, and the object ties with every token, so L1 and L2 hold exactly).

    The argument: r = h_n + Σ_m W_O^m (·) with h_n = E[x_n] + P[n], so coordinate j of r
    can be nonzero only if column j of E or of P, or row j of some W_O^m, holds a nonzero
    entry (the *written* directions); U·r = Σ_j U[:, j] r_j reads the columns of U holding a
    nonzero entry. If no read direction is written, every term of every logit is an exact
    0, whatever the attention weights are. The hand-built models have this structure (U
    reads only the directions the experts write).
    """
    written = [_support(weights.E, 1), _support(weights.P, 1)] + [_support(h.W_O, 0) for h in weights.heads]
    read = _support(weights.U, 1)
    return not np.intersect1d(read, np.concatenate(written)).size
