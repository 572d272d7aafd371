"""The gate: a linear function of the residual whose argmax routes every query.

**Closed form.** With F_k = {(m, c) : symbol c is at position m of a template of k}
(positions of proper prefixes only), λ = 1/2 and η_k = (K − 1 − k)·η₀ where
η₀ = 2^-(q+2), 2^q >= K (so 0 <= η_k < 1/4, dyadic, earlier tasks first)::

    g_k = Σ_{(m,c) ∈ F_k} slot<m>:c  +  λ·Σ_{s ∈ dom D_k} subj:s  +  η_k

Requirement (brief §5.2): at a query with structure σ (length p) and subject s, the
argmax is a *consistent* task: k ∈ K(σ) with s ∈ dom D_k (the set "allowed"); a
determined query therefore goes to its own task.

*Ideal scores* (β = ∞, no leak): Ŝ_k(σ) = #{m <= p : (m, σ_m) ∈ F_k} = p for k ∈ K(σ).
Call σ *mixed* for j ∉ K(σ) if Ŝ_j(σ) = p anyway (every position of σ matches some
template of j, but no single one). The routing cells are (σ, allowed set M) with the
designated winner w = min M; for a competitor j the subject terms differ by at least

    Δ_T = 0   (j ∈ M, or plain σ, or j ∉ K(σ) before ⋆2)
    Δ_T = λ   (j ∈ K(σ) \\ M: j lacks the subject)
    Δ_T = −λ/2 (past ⋆2: the object also feeds the subject head, each < 1/2)

*Claim.* If no σ is mixed and no object-query structure is shared by two tasks, every
cell has ideal margin Ŝ_w − Ŝ_j + Δ_T + η_w − η_j >= η₀ > 0.

*Proof.* j ∈ M: Ŝ equal, η_w − η_j >= η₀. j ∈ K(σ)\\M: Ŝ equal, λ − 1/4 = 1/4 >= η₀.
j ∉ K(σ): Ŝ_w − Ŝ_j >= 1, Δ_T >= −1/4 (λ/2), η_w − η_j > −1/4: margin > 1/2. ∎

*Leak.* The actual slot features differ from the ideal ones by at most 2δ_p in ℓ1 per
head (construction.heads), so each score moves by at most 2δ_p·A_k, where
A_k = Σ_m max_c |W_k[m, c]|; the subject term λ·(1−δ_p) loses λδ_p. Hence the
actual margin is at least t − δ_p·(4A + λ), A = max_k A_k, and routing is as
designed whenever δ_{L−1} < t/(4A + λ). :class:`GateResult` records t and A.

**Linear programme.** When the closed form fails (a mixed σ), the same cells define
a linear programme over the slot weights and biases (subject weights fixed at λ),
solved for the maximum margin t with weights in [−1, 1] (scipy.optimize.linprog,
HiGHS). If the optimum is <= 0 even with only the determined cells as constraints,
no gate over these features exists: that is a proof, reported with the colliding
templates. Never is a gate returned whose ideal margin is not positive.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from construction.bases import Space, block
from construction.params import LAMBDA
from construction.residual import symbol_label
from construction.symbolic import SymMatrix
from tasks.errors import TaskError
from tasks.model import TaskSet
from tasks.queries import build_group
from tasks.structure import StructureTrie, object_query_collisions

LP_MAX_VARIABLES = 200_000


class RoutingError(TaskError):
    """The construction cannot route this task set; names the colliding templates."""


@dataclass(frozen=True)
class Cells:
    """Routing cells: per row a structure node, the designated winner and Δ_T per task."""

    node: np.ndarray        # (n_cells,) trie node ids
    winner: np.ndarray      # (n_cells,) task index
    delta: np.ndarray       # (n_cells, K) subject-term lower bound Δ_T for each competitor
    determined: np.ndarray  # (n_cells,) bool: the cell's allowed set is a single task


@dataclass(frozen=True)
class GateResult:
    W_G: SymMatrix
    b_G: SymMatrix
    method: str             # "closed form" or "linear programme"
    ideal_margin: Fraction  # t: smallest ideal margin over all cells
    weight_mass: Fraction   # A = max_k Σ_m max_c |W_k[m, c]|

    def beta_condition(self):
        """δ_{L-1} must stay below this for routing to be as designed."""
        return self.ideal_margin / (4 * self.weight_mass + Fraction(LAMBDA.p, LAMBDA.q))


def features(taskset: TaskSet, trie: StructureTrie) -> tuple[dict[tuple[int, str], int], sp.csr_matrix]:
    """Feature index (m, symbol) -> column, and Φ (nodes x features): σ's ideal slots."""
    index: dict[tuple[int, str], int] = {}
    rows, cols = [], []
    for node in trie:
        for m, code in enumerate(node.symbols, start=1):
            f = index.setdefault((m, symbol_label(code, taskset)), len(index))
            rows.append(node.id)
            cols.append(f)
    phi = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(trie), len(index)))
    return index, phi


def task_features(taskset: TaskSet, trie: StructureTrie, index: dict[tuple[int, str], int]) -> sp.csr_matrix:
    """F_k as a 0/1 matrix (K x features)."""
    rows, cols = [], []
    for (k, _), path in trie.paths.items():
        for nid in path:
            node = trie.nodes[nid]
            m = node.depth
            rows.append(k)
            cols.append(index[(m, symbol_label(node.symbols[-1], taskset))])
    m = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(taskset.tasks), len(index)))
    m.data[:] = 1.0
    return m


def routing_cells(taskset: TaskSet, trie: StructureTrie) -> Cells:
    K = len(taskset.tasks)
    lam = float(LAMBDA)
    node_ids, winners, deltas, determined = [], [], [], []
    for node in trie:
        group = build_group(taskset, trie, node)
        in_k = np.zeros(K, bool)
        in_k[list(node.tasks)] = True
        patterns = {tuple(group.allowed_of(i).tolist()) for i in range(len(group))}
        for pattern in sorted(patterns):
            d = np.zeros(K)
            if group.kind == "subject":
                in_m = np.zeros(K, bool)
                in_m[list(pattern)] = True
                d[in_k & ~in_m] = lam
            elif group.kind == "object":
                d[:] = -lam / 2
            node_ids.append(node.id)
            winners.append(pattern[0])
            deltas.append(d)
            determined.append(len(pattern) == 1)
    return Cells(np.asarray(node_ids, np.int64), np.asarray(winners, np.int64),
                 np.asarray(deltas).reshape(-1, K), np.asarray(determined, bool))


def ideal_margins(S: np.ndarray, b: np.ndarray, cells: Cells) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: the smallest margin over competitors, and the competitor attaining it.

    ``S`` is the ideal structural score per (node, task). Exact for dyadic weights.
    """
    scores = S[cells.node] + b[None, :] + 0.0  # (cells, K)
    w = cells.winner
    rows = np.arange(w.size)
    margin = scores[rows, w][:, None] - scores + cells.delta
    margin[rows, w] = np.inf
    j = np.argmin(margin, axis=1)
    return margin[rows, j], j


def _assemble(taskset: TaskSet, residual: Space, index, W_struct: np.ndarray | sp.spmatrix, b: np.ndarray) -> tuple[SymMatrix, SymMatrix]:
    K = len(taskset.tasks)
    W_struct = sp.csr_matrix(W_struct)
    coo = W_struct.tocoo()
    by_col = {f: key for key, f in index.items()}
    r = list(coo.row)
    c = [residual.index(f"slot{by_col[f][0]}", by_col[f][1]) for f in coo.col]
    v = list(coo.data)
    W = taskset.vocabulary.n_words
    subj_off = residual.offset("subj")
    r_parts, c_parts, v_parts = [np.asarray(r, np.int64)], [np.asarray(c, np.int64)], [np.asarray(v, float)]
    for k, (s, _) in enumerate(taskset.fact_ids):
        r_parts.append(np.full(s.size, k, np.int64))
        c_parts.append(subj_off + (s - W))
        v_parts.append(np.full(s.size, float(LAMBDA)))
    experts = Space.of(block("expert", taskset.names))
    W_G = SymMatrix.build(experts, residual, (np.concatenate(r_parts), np.concatenate(c_parts), np.concatenate(v_parts)))
    b_G = SymMatrix.build(experts, Space.of(block("bias")), (np.arange(K), np.zeros(K, np.int64), np.asarray(b, float)))
    return W_G, b_G


def _mass(W_struct: sp.csr_matrix, index) -> Fraction:
    """A = max_k Σ_m max_c |W_k[m, c]|."""
    positions = np.array([m for (m, _), f in sorted(index.items(), key=lambda kv: kv[1])], np.int64)
    best = Fraction(0)
    W_struct = sp.csr_matrix(W_struct)
    for k in range(W_struct.shape[0]):
        row = W_struct.getrow(k).tocoo()
        per_m: dict[int, float] = {}
        for f, v in zip(row.col, row.data):
            m = int(positions[f])
            per_m[m] = max(per_m.get(m, 0.0), abs(float(v)))
        best = max(best, sum((Fraction(x) for x in per_m.values()), Fraction(0)))
    return best


def _collision_message(taskset: TaskSet, trie: StructureTrie, cells: Cells, bad: np.ndarray, rivals: np.ndarray) -> str:
    i = int(bad[0])
    node = trie.nodes[int(cells.node[i])]
    w, j = int(cells.winner[i]), int(rivals[i])
    tw, tj = taskset.tasks[w], taskset.tasks[j]
    j_templates = ", ".join(f"'{t}'" for t in tj.templates)
    return (f"prefix structure '{trie.describe(node)}' of task '{tw.name}' (template '{tw.templates[node.templates[w][0]]}') "
            f"cannot be told apart linearly from task '{tj.name}' (templates {j_templates})"
            + (f"; {bad.size - 1} more such prefixes" if bad.size > 1 else ""))


def _solve_lp(S_phi: sp.csr_matrix, cells: Cells, K: int, F: int, keep: np.ndarray):
    """max t  s.t.  Φ_σ·(W_w − W_j) + b_w − b_j + Δ_T >= t  for the kept cells, j != w."""
    n_var = K * F + K + 1
    rows_idx, cols_idx, vals, rhs = [], [], [], []
    r = 0
    phi = S_phi.tocsr()
    for i in np.flatnonzero(keep):
        node, w = int(cells.node[i]), int(cells.winner[i])
        feats = phi.indices[phi.indptr[node]:phi.indptr[node + 1]]
        for j in range(K):
            if j == w:
                continue
            # −(Φ·W_w − Φ·W_j + b_w − b_j) + t <= Δ_T
            cols = np.concatenate([w * F + feats, j * F + feats, [K * F + w, K * F + j, K * F + K]])
            v = np.concatenate([-np.ones(feats.size), np.ones(feats.size), [-1.0, 1.0, 1.0]])
            rows_idx.append(np.full(cols.size, r)); cols_idx.append(cols); vals.append(v)
            rhs.append(cells.delta[i, j])
            r += 1
    A = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows_idx), np.concatenate(cols_idx))), shape=(r, n_var))
    c = np.zeros(n_var)
    c[-1] = -1.0
    bounds = [(-1.0, 1.0)] * (K * F + K) + [(None, 1.0)]
    res = linprog(c, A_ub=A, b_ub=np.asarray(rhs), bounds=bounds, method="highs")
    if res.status != 0:
        return None, -np.inf
    return res.x, float(res.x[-1])


def build_gate(taskset: TaskSet, residual: Space, trie: StructureTrie) -> GateResult:
    K = len(taskset.tasks)
    structural = object_query_collisions(trie, structural=True)
    if structural:
        c = structural[0]
        raise RoutingError(
            f"the construction routes by template structure, and {c.message(taskset)} (their subjects differ, "
            f"so the set is well-posed, but the structure gate cannot tell them apart)",
            fix="make the templates differ before ⋆2, e.g. by naming the relation")
    index, phi = features(taskset, trie)
    cells = routing_cells(taskset, trie)
    F_k = task_features(taskset, trie, index)
    q = max(1, int(np.ceil(np.log2(max(K, 2)))))
    eta0 = 2.0 ** -(q + 2)
    eta = (K - 1 - np.arange(K)) * eta0
    S = (phi @ F_k.T).toarray()
    margin, rivals = ideal_margins(S, eta, cells)
    if margin.size == 0 or margin.min() > 0:
        W_G, b_G = _assemble(taskset, residual, index, F_k, eta)
        finite = margin[np.isfinite(margin)]
        t = Fraction(float(finite.min())) if finite.size else Fraction(1)  # one task: no competitor
        return GateResult(W_G, b_G, "closed form", t, _mass(F_k, index))

    bad = np.flatnonzero(margin <= 0)
    F = len(index)
    if K * F + K + 1 > LP_MAX_VARIABLES:
        raise RoutingError(_collision_message(taskset, trie, cells, bad, rivals) + f"; the closed-form gate fails and the set is too large for the linear programme ({K * F} weights)",
                           fix="make the templates of different tasks differ at the same positions")
    x, t = _solve_lp(phi, cells, K, F, np.ones(cells.node.size, bool))
    if x is not None and t > 1e-6:
        # Round to a dyadic grid so the weights are exact, then re-check the ideal margins exactly.
        grid = 2.0 ** 16
        x = np.round(x * grid) / grid
        W_struct = x[: K * F].reshape(K, F)
        b = x[K * F: K * F + K]
        margin2, _ = ideal_margins(np.asarray(phi @ W_struct.T), b, cells)
        if margin2.min() > 0:
            W_G, b_G = _assemble(taskset, residual, index, W_struct, b)
            return GateResult(W_G, b_G, "linear programme", Fraction(float(margin2.min())), _mass(sp.csr_matrix(W_struct), index))
    # No gate with the designated winners. With only the determined cells, infeasibility is a proof.
    _, t_det = _solve_lp(phi, cells, K, F, cells.determined)
    proof = ("no linear gate over the template-structure features routes these prefixes (the linear programme over "
             "the determined prefixes alone has optimum margin <= 0)") if t_det <= 1e-9 else (
             "the linear programme found no gate with the designated tie-breaking (not proven impossible)")
    raise RoutingError(_collision_message(taskset, trie, cells, bad, rivals) + "; " + proof,
                       fix="make the templates of different tasks differ at the same positions")
