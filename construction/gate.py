"""The gate: a linear function of the residual whose argmax routes every query.

**Closed form.** With F_k = {(m, c) : symbol c is at position m of a template of k}
(positions of proper prefixes only), λ = 1/2 and η_k = (K − 1 − k)·η₀ where
η₀ = 2^-(q+2), 2^q >= K (so 0 <= η_k < 1/4, dyadic, earlier tasks first)::

    g_k = Σ_{(m,c) ∈ F_k} slot<m>:c  +  λ·Σ_{s ∈ dom D_k} subj:s  +  η_k

Requirement (routing, docs/design.md §5): at a query with structure σ (length p) and subject s, the
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
from tasks.queries import build_group, group_parts
from tasks.structure import StructureTrie, object_query_collisions

LP_MAX_VARIABLES = 200_000
#: Rows per part when a large structure group's queries are built (memory stays bounded).
GROUP_ROWS = 500_000


class RoutingError(TaskError):
    """The construction cannot route the set; ``refs`` names two colliding (task, template) pairs."""

    refs: list = []

    """The construction cannot route this task set; names the colliding templates."""


@dataclass(frozen=True)
class Cells:
    """Routing cells: per row a structure node, the designated winner and Δ_T per task.

    Δ_T is not stored densely (a million cells times a thousand tasks would not fit):
    it is a per-node row (λ on the node's tasks for a subject node, −λ/2 everywhere for
    an object node, 0 for a plain one) with the cell's own allowed set T set to 0 for a
    subject cell (there Δ_T = λ on the node's tasks outside T). :meth:`delta_rows`
    rebuilds it for any rows, exactly (all values are dyadic).
    """

    node: np.ndarray        # (n_cells,) trie node ids
    winner: np.ndarray      # (n_cells,) task index
    determined: np.ndarray  # (n_cells,) bool: the cell's allowed set is a single task
    node_delta: np.ndarray  # (n_nodes, K) the node's part of Δ_T
    subject: np.ndarray     # (n_cells,) bool: a subject cell (its allowed set is subtracted)
    allowed_ptr: np.ndarray  # CSR of each cell's allowed set T
    allowed: np.ndarray

    def delta_rows(self, idx: np.ndarray) -> np.ndarray:
        """Δ_T for the cells ``idx``, (len(idx), K)."""
        idx = np.asarray(idx, np.int64)
        out = self.node_delta[self.node[idx]].copy()
        counts = self.allowed_ptr[idx + 1] - self.allowed_ptr[idx]
        rows = np.repeat(np.arange(idx.size), counts)
        starts = np.repeat(self.allowed_ptr[idx], counts) + (np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts))
        sub = self.subject[idx][rows]
        out[rows[sub], self.allowed[starts][sub]] = 0.0
        return out


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
    index: dict[tuple, int] = {}
    rows, cols = [], []
    for node in trie:
        for m, code in enumerate(node.symbols, start=1):
            f = index.setdefault((m, symbol_label(code, taskset)), len(index))
            rows.append(node.id)
            cols.append(f)
    # Position features ("pos", p): exact in the residual (no leak); used by the linear programme only.
    for node in trie:
        rows.append(node.id)
        cols.append(index.setdefault(("pos", node.depth), len(index)))
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


def _patterns(group) -> set[tuple[int, ...]]:
    """The distinct allowed sets of a group's queries (vectorised for the common single-task rows)."""
    counts = np.diff(group.allowed_ptr)
    single = counts == 1
    out = {(int(k),) for k in np.unique(group.allowed[group.allowed_ptr[:-1][single]])}
    for i in np.flatnonzero(~single):
        out.add(tuple(group.allowed_of(i).tolist()))
    return out


def routing_cells(taskset: TaskSet, trie: StructureTrie) -> Cells:
    K = len(taskset.tasks)
    lam = float(LAMBDA)
    node_delta = np.zeros((len(trie.nodes), K))
    node_ids, winners, determined, subject, sets = [], [], [], [], []
    for node in trie:
        patterns: set[tuple[int, ...]] = set()
        for part in group_parts(taskset, node, GROUP_ROWS):    # a large group a part at a time
            group = build_group(taskset, trie, node, part)
            patterns |= _patterns(group)
        if group.kind == "subject":
            node_delta[node.id, list(node.tasks)] = lam
        elif group.kind == "object":
            node_delta[node.id, :] = -lam / 2
        for pattern in sorted(patterns):
            node_ids.append(node.id)
            winners.append(pattern[0])
            determined.append(len(pattern) == 1)
            subject.append(group.kind == "subject")
            sets.append(pattern)
    ptr = np.zeros(len(sets) + 1, np.int64)
    np.cumsum([len(t) for t in sets], out=ptr[1:])
    allowed = np.fromiter((k for t in sets for k in t), np.int64, int(ptr[-1]))
    return Cells(np.asarray(node_ids, np.int64), np.asarray(winners, np.int64), np.asarray(determined, bool),
                 node_delta, np.asarray(subject, bool), ptr, allowed)


#: Cells whose scores are held at once when margins are computed (memory: CELL_CHUNK × K).
CELL_CHUNK = 8192


def ideal_margins(S: np.ndarray, b: np.ndarray, cells: Cells) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: the smallest margin over competitors, and the competitor attaining it.

    ``S`` is the ideal structural score per (node, task). Exact for dyadic weights.
    Computed :data:`CELL_CHUNK` cells at a time.
    """
    n = cells.node.size
    best, who = np.zeros(n), np.zeros(n, np.int64)
    for lo in range(0, n, CELL_CHUNK):
        idx = np.arange(lo, min(n, lo + CELL_CHUNK))
        scores = S[cells.node[idx]] + b[None, :] + 0.0  # (chunk, K)
        w = cells.winner[idx]
        rows = np.arange(idx.size)
        margin = scores[rows, w][:, None] - scores + cells.delta_rows(idx)
        margin[rows, w] = np.inf
        j = np.argmin(margin, axis=1)
        best[idx], who[idx] = margin[rows, j], j
    return best, who


def _assemble(taskset: TaskSet, residual: Space, index, W_struct: np.ndarray | sp.spmatrix, b: np.ndarray) -> tuple[SymMatrix, SymMatrix]:
    K = len(taskset.tasks)
    W_struct = sp.csr_matrix(W_struct)
    coo = W_struct.tocoo()
    by_col = {f: key for key, f in index.items()}
    r = list(coo.row)
    c = [residual.index("pos", by_col[f][1]) if by_col[f][0] == "pos" else residual.index(f"slot{by_col[f][0]}", by_col[f][1])
         for f in coo.col]
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
    """A = max_k Σ_m max_c |W_k[m, c]| over the (leaky) slot features; position features are exact."""
    positions = np.array([-1 if m == "pos" else m for (m, _), f in sorted(index.items(), key=lambda kv: kv[1])], np.int64)
    best = Fraction(0)
    W_struct = sp.csr_matrix(W_struct)
    for k in range(W_struct.shape[0]):
        row = W_struct.getrow(k).tocoo()
        per_m: dict[int, float] = {}
        for f, v in zip(row.col, row.data):
            m = int(positions[f])
            if m < 0:
                continue
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


def _solve_lp(phi: sp.csr_matrix, cells: Cells, S_fixed: np.ndarray, Q: np.ndarray, active: np.ndarray):
    """Maximum-margin gate rows for the tasks ``Q``, the other rows fixed (scores ``S_fixed``).

    max t  s.t.  score_w(σ) − score_j(σ) + Δ_T >= t  for the active cells and every j != w,
    with weights and biases of the rows in Q in [−1, 1] and t <= 1. Returns
    (weights (|Q| x F), biases (|Q|,), t, solved) — solved is False unless HiGHS reports
    an optimum.
    """
    nQ, F = Q.size, phi.shape[1]
    pos_in_Q = np.full(S_fixed.shape[1], -1, np.int64)
    pos_in_Q[Q] = np.arange(nQ)
    T = nQ * F + nQ
    r_idx, c_idx, vals, rhs = [], [], [], []
    row = 0

    def emit(cols, v, b):
        nonlocal row
        r_idx.append(np.full(len(cols), row)); c_idx.append(np.asarray(cols, np.int64)); vals.append(np.asarray(v, float))
        rhs.append(b)
        row += 1

    for i in np.flatnonzero(active):
        node, w = int(cells.node[i]), int(cells.winner[i])
        delta = cells.delta_rows(np.array([i]))[0]
        feats = phi.indices[phi.indptr[node]:phi.indptr[node + 1]]
        one = np.ones(feats.size)
        qw = pos_in_Q[w]
        if qw >= 0:
            for j in Q:
                if j == w:
                    continue
                qj = pos_in_Q[j]
                emit(np.concatenate([qw * F + feats, qj * F + feats, [nQ * F + qw, nQ * F + qj, T]]),
                     np.concatenate([-one, one, [-1.0, 1.0, 1.0]]), delta[j])
            fixed = np.ones(S_fixed.shape[1], bool)
            fixed[Q] = False
            if fixed.any():
                emit(np.concatenate([qw * F + feats, [nQ * F + qw, T]]), np.concatenate([-one, [-1.0, 1.0]]),
                     float(np.min(delta[fixed] - S_fixed[node, fixed])))
        else:
            for j in Q:
                qj = pos_in_Q[j]
                emit(np.concatenate([qj * F + feats, [nQ * F + qj, T]]), np.concatenate([one, [1.0, 1.0]]),
                     float(S_fixed[node, w] + delta[j]))
    if row == 0:
        return np.zeros((nQ, F)), np.zeros(nQ), 1.0, True
    A = sp.csr_matrix((np.concatenate(vals), (np.concatenate(r_idx), np.concatenate(c_idx))), shape=(row, T + 1))
    c = np.zeros(T + 1)
    c[-1] = -1.0
    bounds = [(-1.0, 1.0)] * T + [(None, 1.0)]
    res = linprog(c, A_ub=A, b_ub=np.asarray(rhs), bounds=bounds, method="highs")
    if res.status != 0:
        return None, None, -np.inf, False
    x = res.x
    return x[: nQ * F].reshape(nQ, F), x[nQ * F: T], float(x[-1]), True


def _lp_gate(phi, cells, F_k, eta, margin, rivals):
    """Cutting planes: re-solve for the tasks in conflict until every cell has a positive margin.

    Returns (W_struct (K x F), b (K,), ideal margin) or None.
    """
    K, F = F_k.shape[0], phi.shape[1]
    W = F_k.toarray().astype(float)
    W = np.concatenate([W, np.zeros((K, F - W.shape[1]))], axis=1) if W.shape[1] < F else W
    b = eta.astype(float).copy()
    bad = margin <= 0
    Q = np.unique(np.concatenate([cells.winner[bad], rivals[bad]]))
    active = bad.copy()
    active |= np.isin(cells.winner, Q)
    grid = 2.0 ** 16
    for _ in range(12):
        if Q.size * F + Q.size + 1 > LP_MAX_VARIABLES:
            return None
        fixed = np.ones(K, bool)
        fixed[Q] = False
        S_fixed = np.asarray(phi @ W.T) + b[None, :]
        WQ, bQ, t, solved = _solve_lp(phi, cells, S_fixed, Q, active)
        if not solved or t <= 1e-6:
            return None
        W2, b2 = W.copy(), b.copy()
        W2[Q] = np.round(WQ * grid) / grid
        b2[Q] = np.round(bQ * grid) / grid
        m2, r2 = ideal_margins(np.asarray(phi @ W2.T), b2, cells)
        if m2.min() > 0:
            return W2, b2, float(m2.min())
        # add the violated cells (and their tasks) and solve again
        bad2 = m2 <= 0
        active |= bad2
        Q = np.unique(np.concatenate([Q, cells.winner[bad2], r2[bad2]]))
        active |= np.isin(cells.winner, Q)
    return None


def build_gate(taskset: TaskSet, residual: Space, trie: StructureTrie) -> GateResult:
    K = len(taskset.tasks)
    structural = object_query_collisions(trie, structural=True)
    if structural:
        c = structural[0]
        err = RoutingError(
            f"the construction routes by template structure, and {c.message(taskset)} (their subjects differ, "
            f"so the set is well-posed, but the structure gate cannot tell them apart)",
            fix="make the templates differ before ⋆2, e.g. by naming the relation")
        err.refs = [c.first, c.second]
        raise err
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
    found = _lp_gate(phi, cells, F_k, eta, margin, rivals)
    if found is not None:
        W_struct, b, t = found
        W_G, b_G = _assemble(taskset, residual, index, W_struct, b)
        return GateResult(W_G, b_G, "linear programme", Fraction(t), _mass(sp.csr_matrix(W_struct), index))
    # No gate found. Over the determined prefixes alone (ties are free), with every row free,
    # an optimum <= 0 proves that no linear gate over these features exists.
    F = phi.shape[1]
    proof = "the linear programme found no gate (not proven impossible)"
    if K * F + K + 1 <= LP_MAX_VARIABLES:
        _, _, t_det, solved = _solve_lp(phi, cells, np.zeros((phi.shape[0], K)), np.arange(K), cells.determined)
        if solved and t_det <= 1e-9:
            proof = ("no linear gate over the template-structure and position features routes these prefixes "
                     "(the linear programme over the determined prefixes alone has optimum margin <= 0)")
    err = RoutingError(_collision_message(taskset, trie, cells, bad, rivals) + "; " + proof,
                       fix="make the templates of different tasks differ at the same positions")
    i = int(bad[0])
    node = trie.nodes[int(cells.node[i])]
    w, j = int(cells.winner[i]), int(rivals[i])
    err.refs = [(w, int(node.templates[w][0])), (j, 0)]
    raise err
