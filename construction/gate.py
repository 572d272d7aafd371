"""The gate: a linear function of the residual whose argmax routes every query.

**Features.** At a prefix with structure σ (length p) and first entity s (the subject,
if any) the gate reads three kinds of residual coordinates (construction.heads):

* the *slot* features slot<m>:c, ideally [σ_m = c] (the symbol at position m);
* the *position* features pos:q, exactly [p = q] (no leak);
* the *subject* features subj:e, ideally [e = s] (0 before ⋆1).

A gate row k is g_k = Σ W_k[m, c]·slot<m>:c + Σ_q W_k[pos, q]·pos:q + λ_k·Σ_{e ∈ dom D_k} subj:e
+ b_k: its subject term is λ_k·[s ∈ dom D_k], the subject's *membership* in task k.

**Routing cells.** Requirement (routing, docs/design.md §5): at a query with structure σ
and subject s, the argmax is a *consistent* task (the set M, "allowed": k ∈ K(σ) with
s ∈ dom D_k, and past ⋆2 also D_k(s) = o); a determined query goes to its own task.
The cells are the distinct (σ, M), with the designated winner w = min M. For a
competitor j the subject terms of w and j are λ_w·e and λ_j·c_j, where e = 1 if σ holds
an entity (0 for a plain σ) and

    c_j = 0   if j ∈ K(σ) \\ M: j lacks the subject;
    c_j = 1   if j ∈ M, or j ∉ K(σ) (j may have s as a subject: counted as if it had).

(Past ⋆2 a task j ∈ K(σ) \\ M lacks s, not just the object: j shares the object-query
structure with w, and a subject of both would make σ's object query shared, which the
well-posedness check refuses. So past ⋆2 cells are like the cells between ⋆1 and ⋆2.)

**Closed form.** With F_k = {(m, c) : symbol c at position m of a template of k}
(positions of proper prefixes only), λ_k = λ = 1/2, b_k = η_k = (K − 1 − k)·η₀,
η₀ = 2^-(q+2), 2^q >= K (so 0 <= η_k < 1/4, dyadic, earlier tasks first)::

    g_k = Σ_{(m,c) ∈ F_k} slot<m>:c  +  λ·Σ_{s ∈ dom D_k} subj:s  +  η_k

*Ideal scores* (β = ∞, no leak): Ŝ_k(σ) = #{m <= p : (m, σ_m) ∈ F_k} = p for k ∈ K(σ).
Call σ *mixed* for j ∉ K(σ) if Ŝ_j(σ) = p anyway (every position of σ matches some
template of j, but no single one). The ideal margin of a cell against j is
Ŝ_w − Ŝ_j + λ(e − c_j) + η_w − η_j.

*Claim.* If no σ is mixed, every cell has ideal margin >= η₀ > 0. Tasks that share a
template (word for word), and are told apart only by their subjects, are no exception.

*Proof.* j ∈ M: Ŝ equal, e = c_j, η_w − η_j >= η₀. j ∈ K(σ) \\ M (only in a cell with an
entity): Ŝ equal, λ(e − c_j) = λ, and λ − 1/4 = 1/4 >= η₀. j ∉ K(σ): Ŝ_w − Ŝ_j >= 1,
λ(e − c_j) = 0, η_w − η_j > −1/4: margin > 3/4. ∎

*Leak.* The actual slot features differ from the ideal ones by at most 2δ_p in ℓ1 per
head (construction.heads), so each score moves by at most 2δ_p·A_k, where
A_k = Σ_m max_c |W_k[m, c]|. The subject features: subj = a_s e_s + a_o e_o with
a_s ∈ [1 − δ_p, 1], a_o <= δ_p (the subject-head claim), so task k's subject term moves by
at most λ_kδ_p. Hence the actual margin is at least t − δ_p·(4A + 2Λ), A = max_k A_k,
Λ = max_k λ_k, and routing is as designed whenever δ_{L−1} < t/(4A + 2Λ).
:class:`GateResult` records t, A and Λ.

**Linear programme.** When the closed form fails (a mixed σ), the same cells define a
linear programme over the slot and position weights, biases and subject weights λ_k of
the tasks in conflict, solved for the maximum margin t with weights in [−1, 1], λ_k in
[0, 1] (scipy.optimize.linprog, HiGHS), by cutting planes; the solution is rounded to
the 2^-16 grid and its margins recomputed exactly. Never is a gate returned whose ideal
margin is not positive. When no gate is found, :mod:`construction.separation` looks for
a proof that none exists (an exact certificate) and the error carries it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import scipy.sparse as sp

from construction.bases import Space, block
from construction.params import LAMBDA
from construction.residual import symbol_label
from construction.symbolic import SymMatrix
from tasks.errors import TaskError
from tasks.model import TaskSet
from tasks.queries import build_group, group_parts
from tasks.structure import StructureTrie

LP_MAX_VARIABLES = 200_000
#: Rows per part when a large structure group's queries are built (memory stays bounded).
GROUP_ROWS = 500_000
#: Grid of the linear programme's rounded weights (exact binary fractions).
LP_GRID = 2.0 ** 16


class RoutingError(TaskError):
    """The construction cannot route this task set; ``refs`` names two colliding
    (task, template) pairs and ``certificate`` (if any) proves that no gate of the
    construction's form exists (:class:`construction.separation.Certificate`)."""

    refs: list = []
    certificate = None


@dataclass(frozen=True)
class Cells:
    """Routing cells: per row a structure node, the designated winner and its allowed set.

    Nothing of size cells × tasks is stored (a million cells times a thousand tasks would
    not fit): the subject coefficients c_j come from the node's task set K(σ)
    (``node_tasks``, nodes × tasks) and the cell's allowed set, for any rows on demand
    (:meth:`subject_coefficients`).
    """

    node: np.ndarray        # (n_cells,) trie node ids
    winner: np.ndarray      # (n_cells,) task index
    determined: np.ndarray  # (n_cells,) bool: the cell's allowed set is a single task
    entity: np.ndarray      # (n_cells,) bool: the cell's prefixes hold an entity (e = 1)
    node_tasks: np.ndarray  # (n_nodes, K) bool: K(σ)
    allowed_ptr: np.ndarray  # CSR of each cell's allowed set M
    allowed: np.ndarray
    subject: np.ndarray     # (n_cells,) the subject token id of one query of the cell (-1: none)

    def subject_coefficients(self, idx: np.ndarray) -> np.ndarray:
        """c_j for the cells ``idx``, (len(idx), K) in {0, 1} (see the module docstring)."""
        idx = np.asarray(idx, np.int64)
        in_node = self.node_tasks[self.node[idx]]
        c = np.where(in_node, 0.0, 1.0)
        counts = self.allowed_ptr[idx + 1] - self.allowed_ptr[idx]
        rows = np.repeat(np.arange(idx.size), counts)
        starts = np.repeat(self.allowed_ptr[idx], counts) + (np.arange(rows.size)
                                                             - np.repeat(np.cumsum(counts) - counts, counts))
        c[rows, self.allowed[starts]] = 1.0
        c[~self.entity[idx]] = 0.0
        return c

    def allowed_of(self, i: int) -> np.ndarray:
        return self.allowed[self.allowed_ptr[i]: self.allowed_ptr[i + 1]]


@dataclass(frozen=True)
class GateResult:
    W_G: SymMatrix
    b_G: SymMatrix
    method: str               # "closed form" or "linear programme"
    ideal_margin: Fraction    # t: smallest ideal margin over all cells
    weight_mass: Fraction     # A = max_k Σ_m max_c |W_k[m, c]|
    subject_weight: Fraction = Fraction(LAMBDA.p, LAMBDA.q)   # Λ = max_k λ_k

    def beta_condition(self) -> Fraction:
        """δ_{L-1} must stay below this for routing to be as designed: t/(4A + 2Λ)."""
        return self.ideal_margin / (4 * self.weight_mass + 2 * self.subject_weight)


def features(taskset: TaskSet, trie: StructureTrie) -> tuple[dict[tuple, int], sp.csr_matrix]:
    """Feature index (m, symbol) or ("pos", p) -> column, and Φ (nodes x features): σ's ideal features."""
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


def task_features(taskset: TaskSet, trie: StructureTrie, index: dict[tuple, int]) -> sp.csr_matrix:
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


def _patterns(group) -> dict[tuple[int, ...], int]:
    """The distinct allowed sets of a group's queries, each with the subject of its first
    query (vectorised for the common single-task rows)."""
    counts = np.diff(group.allowed_ptr)
    single = np.flatnonzero(counts == 1)
    out: dict[tuple[int, ...], int] = {}
    tasks = group.allowed[group.allowed_ptr[:-1][single]]
    uniq, first = np.unique(tasks, return_index=True)
    for k, i in zip(uniq.tolist(), single[first].tolist()):
        out[(k,)] = int(group.subjects[i])
    multi = np.flatnonzero(counts != 1)
    if multi.size:                         # each distinct allowed set once, with its first row
        width = max(int(counts[multi].max()), 1)
        pad = np.full((multi.size, width), -1, np.int64)
        take = np.repeat(np.arange(multi.size), counts[multi])
        at = np.arange(take.size) - np.repeat(np.cumsum(counts[multi]) - counts[multi], counts[multi])
        pad[take, at] = group.allowed[np.repeat(group.allowed_ptr[multi], counts[multi]) + at]
        # rows grouped by a hash, each then compared with its group's first (exact; should two
        # sets share a hash, every row is taken one by one)
        with np.errstate(over="ignore"):
            h = (pad * (np.arange(width, dtype=np.int64) * 40503 + 1000003)).sum(axis=1)
        _, first_row, inv = np.unique(h, return_index=True, return_inverse=True)
        rows = first_row if np.array_equal(pad, pad[first_row[inv.reshape(-1)]]) else np.arange(multi.size)
        for r in np.sort(rows).tolist():
            out.setdefault(tuple(t for t in pad[r].tolist() if t >= 0), int(group.subjects[multi[r]]))
    return out


def node_patterns(taskset: TaskSet, trie: StructureTrie, node) -> dict[tuple[int, ...], int]:
    """The distinct allowed sets of the queries whose prefix has structure ``node``, each
    with the subject of the first query that has it (-1: the queries have none), in the
    order :func:`tasks.queries.build_group` gives the queries (parts in subject order).

    A node one task passes through needs no queries: each of its queries is consistent
    with that task alone, and the first has the task's smallest subject (the queries come
    by subject, and a task has at least one fact), or none before ⋆1. Otherwise from the
    queries, a large group a part at a time."""
    if len(node.tasks) == 1:
        k = node.tasks[0]
        return {(k,): int(taskset.fact_ids[k][0][0]) if node.has_subject else -1}
    patterns: dict[tuple[int, ...], int] = {}
    for part in group_parts(taskset, node, GROUP_ROWS):
        for pattern, s in _patterns(build_group(taskset, trie, node, part)).items():
            patterns.setdefault(pattern, s)
    return patterns


def routing_cells(taskset: TaskSet, trie: StructureTrie) -> Cells:
    K = len(taskset.tasks)
    node_tasks = np.zeros((len(trie.nodes), K), bool)
    node_ids, winners, determined, entity, subjects, sets = [], [], [], [], [], []
    for node in trie:
        node_tasks[node.id, list(node.tasks)] = True
        patterns = node_patterns(taskset, trie, node)
        for pattern in sorted(patterns):
            node_ids.append(node.id)
            winners.append(pattern[0])
            determined.append(len(pattern) == 1)
            entity.append(node.has_subject)                    # the queries hold an entity
            subjects.append(patterns[pattern])
            sets.append(pattern)
    ptr = np.zeros(len(sets) + 1, np.int64)
    np.cumsum([len(t) for t in sets], out=ptr[1:])
    allowed = np.fromiter((k for t in sets for k in t), np.int64, int(ptr[-1]))
    return Cells(np.asarray(node_ids, np.int64), np.asarray(winners, np.int64), np.asarray(determined, bool),
                 np.asarray(entity, bool), node_tasks, ptr, allowed, np.asarray(subjects, np.int64))


#: Cells whose scores are held at once when margins are computed (memory: CELL_CHUNK × K).
CELL_CHUNK = 8192


def ideal_margins(S: np.ndarray, b: np.ndarray, lam: np.ndarray, cells: Cells) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: the smallest ideal margin over competitors, and the competitor attaining it.

    ``S`` is the ideal structural score per (node, task), ``b`` the biases, ``lam`` the
    subject weights λ_k. Exact for dyadic weights of few bits. Computed
    :data:`CELL_CHUNK` cells at a time.
    """
    n = cells.node.size
    best, who = np.zeros(n), np.zeros(n, np.int64)
    for lo in range(0, n, CELL_CHUNK):
        idx = np.arange(lo, min(n, lo + CELL_CHUNK))
        scores = S[cells.node[idx]] + b[None, :] + 0.0  # (chunk, K)
        w = cells.winner[idx]
        rows = np.arange(idx.size)
        own = scores[rows, w] + np.where(cells.entity[idx], lam[w], 0.0)
        margin = own[:, None] - (scores + cells.subject_coefficients(idx) * lam[None, :])
        margin[rows, w] = np.inf
        j = np.argmin(margin, axis=1)
        best[idx], who[idx] = margin[rows, j], j
    return best, who


def _assemble(taskset: TaskSet, residual: Space, index, W_struct, b: np.ndarray,
              lam: np.ndarray) -> tuple[SymMatrix, SymMatrix]:
    K = len(taskset.tasks)
    W_struct = sp.csr_matrix(W_struct)
    coo = W_struct.tocoo()
    by_col = {f: key for key, f in index.items()}
    r = list(coo.row)
    c = [residual.index("pos", by_col[f][1]) if by_col[f][0] == "pos"
         else residual.index(f"slot{by_col[f][0]}", by_col[f][1])
         for f in coo.col]
    v = list(coo.data)
    W = taskset.vocabulary.n_words
    subj_off = residual.offset("subj")
    r_parts, c_parts, v_parts = [np.asarray(r, np.int64)], [np.asarray(c, np.int64)], [np.asarray(v, float)]
    for k, (s, _) in enumerate(taskset.fact_ids):
        if lam[k] == 0:
            continue
        r_parts.append(np.full(s.size, k, np.int64))
        c_parts.append(subj_off + (s - W))
        v_parts.append(np.full(s.size, float(lam[k])))
    experts = Space.of(block("expert", taskset.names))
    W_G = SymMatrix.build(experts, residual,
                          (np.concatenate(r_parts), np.concatenate(c_parts), np.concatenate(v_parts)))
    b_G = SymMatrix.build(experts, Space.of(block("bias")), (np.arange(K), np.zeros(K, np.int64), np.asarray(b, float)))
    return W_G, b_G


def _mass(W_struct: sp.csr_matrix, index) -> Fraction:
    """A = max_k Σ_m max_c |W_k[m, c]| over the (leaky) slot features; position features are exact."""
    positions = np.array([-1 if m == "pos" else m for (m, _), f in sorted(index.items(), key=lambda kv: kv[1])],
                         np.int64)
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
    return (f"prefix structure '{trie.describe(node)}' of task '{tw.name}' (template "
            f"'{tw.templates[node.templates[w][0]]}') cannot be told apart linearly from task '{tj.name}' "
            f"(templates {j_templates})"
            + (f"; {bad.size - 1} more such prefixes" if bad.size > 1 else ""))


def _solve_lp(phi: sp.csr_matrix, cells: Cells, S_fixed: np.ndarray, lam_fixed: np.ndarray, Q: np.ndarray,
              active: np.ndarray):
    """Maximum-margin gate rows for the tasks ``Q``, the other rows fixed.

    ``S_fixed`` (nodes x K) holds the fixed rows' structural scores plus biases and
    ``lam_fixed`` their subject weights. Maximises t subject to
    score_w(σ) + λ_w·e − score_j(σ) − λ_j·c_j >= t for the active cells and every j != w,
    with the free rows' weights and biases in [−1, 1], their λ in [0, 1] and t <= 1.
    Returns (weights (|Q| x F), biases (|Q|,), λ (|Q|,), t, solved): solved is False
    unless HiGHS reports an optimum.
    """
    nQ, F = Q.size, phi.shape[1]
    K = S_fixed.shape[1]
    pos_in_Q = np.full(K, -1, np.int64)
    pos_in_Q[Q] = np.arange(nQ)
    fixed = np.ones(K, bool)
    fixed[Q] = False
    B0, L0, T = nQ * F, nQ * F + nQ, nQ * F + 2 * nQ     # offsets of the biases, the λs, t
    r_idx, c_idx, vals, rhs = [], [], [], []
    row = 0

    def emit(cols, v, b):
        nonlocal row
        r_idx.append(np.full(len(cols), row))
        c_idx.append(np.asarray(cols, np.int64))
        vals.append(np.asarray(v, float))
        rhs.append(b)
        row += 1

    act = np.flatnonzero(active)
    coeffs = cells.subject_coefficients(act) if act.size else np.zeros((0, K))
    for i, c in zip(act, coeffs):
        node, w, e = int(cells.node[i]), int(cells.winner[i]), float(cells.entity[i])
        feats = phi.indices[phi.indptr[node]:phi.indptr[node + 1]]
        one = np.ones(feats.size)
        qw = pos_in_Q[w]
        if qw >= 0:
            # −(own score) + (rival's score) + t <= 0
            for j in Q:
                if j == w:
                    continue
                qj = pos_in_Q[j]
                emit(np.concatenate([qw * F + feats, qj * F + feats, [B0 + qw, B0 + qj, L0 + qw, L0 + qj, T]]),
                     np.concatenate([-one, one, [-1.0, 1.0, -e, c[j], 1.0]]), 0.0)
            if fixed.any():
                best = float(np.max(S_fixed[node, fixed] + c[fixed] * lam_fixed[fixed]))
                emit(np.concatenate([qw * F + feats, [B0 + qw, L0 + qw, T]]), np.concatenate([-one, [-1.0, -e, 1.0]]),
                     -best)
        else:
            own = float(S_fixed[node, w] + e * lam_fixed[w])
            for j in Q:
                qj = pos_in_Q[j]
                emit(np.concatenate([qj * F + feats, [B0 + qj, L0 + qj, T]]), np.concatenate([one, [1.0, c[j], 1.0]]),
                     own)
    if row == 0:
        return np.zeros((nQ, F)), np.zeros(nQ), np.full(nQ, float(LAMBDA)), 1.0, True
    A = sp.csr_matrix((np.concatenate(vals), (np.concatenate(r_idx), np.concatenate(c_idx))), shape=(row, T + 1))
    cost = np.zeros(T + 1)
    cost[-1] = -1.0
    bounds = [(-1.0, 1.0)] * (nQ * F + nQ) + [(0.0, 1.0)] * nQ + [(None, 1.0)]
    from scipy.optimize import linprog          # here: only the LP gate needs it (a slow import)

    res = linprog(cost, A_ub=A, b_ub=np.asarray(rhs), bounds=bounds, method="highs")
    if res.status != 0:
        return None, None, None, -np.inf, False
    x = res.x
    return x[:B0].reshape(nQ, F), x[B0:L0], x[L0:T], float(x[-1]), True


def _lp_gate(phi, cells, F_k, eta, margin, rivals):
    """Cutting planes: re-solve for the tasks in conflict until every cell has a positive margin.

    Returns ((W_struct (K x F), b (K,), λ (K,), ideal margin), None) or (None, Q), Q the
    tasks in conflict when it gave up.
    """
    K, F = F_k.shape[0], phi.shape[1]
    W = F_k.toarray().astype(float)
    W = np.concatenate([W, np.zeros((K, F - W.shape[1]))], axis=1) if W.shape[1] < F else W
    b = eta.astype(float).copy()
    lam = np.full(K, float(LAMBDA))
    bad = margin <= 0
    Q = np.unique(np.concatenate([cells.winner[bad], rivals[bad]]))
    active = bad.copy()
    active |= np.isin(cells.winner, Q)
    for _ in range(12):
        if Q.size * F + 2 * Q.size + 1 > LP_MAX_VARIABLES:
            return None, Q
        S_fixed = np.asarray(phi @ W.T) + b[None, :]
        WQ, bQ, lQ, t, solved = _solve_lp(phi, cells, S_fixed, lam, Q, active)
        if not solved or t <= 1e-6:
            return None, Q
        W2, b2, lam2 = W.copy(), b.copy(), lam.copy()
        W2[Q] = np.round(WQ * LP_GRID) / LP_GRID
        b2[Q] = np.round(bQ * LP_GRID) / LP_GRID
        lam2[Q] = np.round(lQ * LP_GRID) / LP_GRID
        m2, r2 = ideal_margins(np.asarray(phi @ W2.T), b2, lam2, cells)
        if m2.min() > 0:
            return (W2, b2, lam2, float(m2.min())), None
        # add the violated cells (and their tasks) and solve again
        bad2 = m2 <= 0
        active |= bad2
        Q = np.unique(np.concatenate([Q, cells.winner[bad2], r2[bad2]]))
        active |= np.isin(cells.winner, Q)
    return None, Q


def build_gate(taskset: TaskSet, residual: Space, trie: StructureTrie) -> GateResult:
    from construction.separation import find_certificate

    K = len(taskset.tasks)
    index, phi = features(taskset, trie)
    cells = routing_cells(taskset, trie)
    F_k = task_features(taskset, trie, index)
    q = max(1, int(np.ceil(np.log2(max(K, 2)))))
    eta0 = 2.0 ** -(q + 2)
    eta = (K - 1 - np.arange(K)) * eta0
    lam = np.full(K, float(LAMBDA))
    S = (phi @ F_k.T).toarray()
    margin, rivals = ideal_margins(S, eta, lam, cells)
    if margin.size == 0 or margin.min() > 0:
        W_G, b_G = _assemble(taskset, residual, index, F_k, eta, lam)
        finite = margin[np.isfinite(margin)]
        t = Fraction(float(finite.min())) if finite.size else Fraction(1)  # one task: no competitor
        return GateResult(W_G, b_G, "closed form", t, _mass(F_k, index), Fraction(LAMBDA.p, LAMBDA.q))

    bad = np.flatnonzero(margin <= 0)
    found, conflict = _lp_gate(phi, cells, F_k, eta, margin, rivals)
    if found is not None:
        W_struct, b, lam, t = found
        W_G, b_G = _assemble(taskset, residual, index, W_struct, b, lam)
        return GateResult(W_G, b_G, "linear programme", Fraction(t), _mass(sp.csr_matrix(W_struct), index),
                          max(Fraction(float(x)) for x in lam))
    # No gate found: look for a proof that none of this form exists.
    tasks = np.unique(np.concatenate([conflict, cells.winner[bad], rivals[bad]]))
    certificate = find_certificate(taskset, trie, cells, tasks)
    i = int(bad[0])
    node = trie.nodes[int(cells.node[i])]
    w, j = int(cells.winner[i]), int(rivals[i])
    if certificate is not None:
        err = RoutingError(certificate.message(taskset, trie), fix=certificate.fix(taskset, trie))
        err.refs = certificate.refs(trie)
    else:
        err = RoutingError(_collision_message(taskset, trie, cells, bad, rivals)
                           + "; the linear programme found no gate and no proof that none exists was found (the "
                             "search for a certificate looks at prefixes of one length at a time)",
                           fix="make the templates of different tasks differ at the same positions")
        err.refs = [(w, int(node.templates[w][0])), (j, int(trie.nodes[int(cells.node[i])].templates.get(j, [0])[0]))]
    err.certificate = certificate
    raise err
