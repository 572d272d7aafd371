"""Proofs that no gate of the construction's form routes a task set.

When the gate's linear programme (construction.gate) finds no gate, this module looks
for a *certificate* that none exists, and checks it in exact rational arithmetic.

**The family.** At prefix length p, a gate of the construction's form scores task k as

    g_k = Σ_m W_k[m, σ_m] + b_k + λ_k·[s ∈ dom D_k]

(the symbol at each position, a bias per task and per length, and the subject's
membership in task k, all weights free, of any sign). A determined prefix with task w
needs g_w − g_j > 0 for every other task j.

**Certificate** (Gordan's theorem). The system "a_r · x > 0 for every row r" (a row is
a determined prefix, its task w and a rival j; x all the weights) has no solution if and
only if some y >= 0, Σ y_r = 1, has Σ_r y_r a_r = 0. Then for *every* gate,
Σ_r y_r (g_w − g_j)(r) = 0, so some margin is <= 0. :func:`find_certificate` solves for
y by linear programming (scipy.optimize.linprog, HiGHS, a vertex of few rows) over the
determined prefixes of one length at a time, then recomputes it in exact fractions on
its support and checks Σ y_r a_r = 0 and y >= 0 exactly; only a checked certificate is
returned. Using fewer rows than all is a relaxation, so a certificate over some rows
is a proof for all of them. (A prefix with a subject gives one row per rival for each
distinct pattern of its subjects' membership in the tasks considered, each written for
one such subject: every row is one of the true constraints.)

**What it proves.**

* For every prefix in the certificate without an entity (a *plain* prefix, e.g. the
  words before ⋆1), the residual stream of this construction at length p is an affine
  function of the one-hot symbols (token embedding, positions, and structure heads
  whose weights depend only on p and β; the subject head writes 0). So when every row
  is plain, *no gate linear in the residual stream* routes these prefixes, whatever
  its weights and whatever β. That is the strongest statement: it covers every gate
  this construction's residual could feed.
* With entities in the rows, it proves that no gate of the family above routes them
  (the residual also holds the identity of the last token and per-entity subject
  coordinates, which a gate with per-entity weights could read; not ruled out).
* Not covered in either case: a single-layer transformer with *other* heads (for
  example a head comparing two positions computes an equality feature that separates
  ``p p``/``q q`` from ``p q``/``q p``), whose residual carries features this one lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import scipy.sparse as sp

from construction.residual import symbol_label
from tasks.model import TaskSet
from tasks.structure import SUBJ, OBJ, StructureTrie

#: Largest Gordan programme tried (rows x variables); beyond it no certificate is sought.
MAX_ENTRIES = 4_000_000
#: Certificate rows shown in a message.
SHOWN = 6


@dataclass(frozen=True)
class Term:
    """One row of a certificate: at the prefix of ``node`` (with ``subject``), task ``winner``
    must beat task ``rival``; the row's weight y_r is ``weight``."""

    node: int
    winner: int
    rival: int
    subject: int      # token id of the subject of the prefix shown, -1 for a plain prefix
    weight: Fraction


@dataclass(frozen=True)
class Certificate:
    """Σ_r weight_r·(g_winner − g_rival)(prefix_r) = 0 for every gate of the family."""

    length: int
    terms: tuple[Term, ...]

    @property
    def plain(self) -> bool:
        return all(t.subject < 0 for t in self.terms)

    def prefix(self, taskset: TaskSet, trie: StructureTrie, term: Term) -> str:
        vocab = taskset.vocabulary
        words = []
        node = trie.nodes[term.node]
        for c in node.symbols:
            if c == SUBJ:
                words.append(vocab.token(term.subject))
            elif c == OBJ:
                words.append("⋆2")
            else:
                words.append(vocab.token(c))
        return " ".join(words)

    def rows_text(self, taskset: TaskSet, trie: StructureTrie) -> list[str]:
        names = taskset.names
        return [f"{t.weight}·(g_{names[t.winner]} − g_{names[t.rival]})('{self.prefix(taskset, trie, t)}')"
                for t in self.terms]

    def message(self, taskset: TaskSet, trie: StructureTrie) -> str:
        rows = self.rows_text(taskset, trie)
        shown = " + ".join(rows[:SHOWN]) + (f" + {len(rows) - SHOWN} more terms" if len(rows) > SHOWN else "")
        tasks = sorted({taskset.names[t.winner] for t in self.terms})
        prefixes = sorted({self.prefix(taskset, trie, t) for t in self.terms})
        head = (f"no gate routes the determined prefixes {', '.join(repr(p) for p in prefixes)} (of tasks "
                f"{', '.join(repr(t) for t in tasks)}) to their own experts: for every gate of the construction's "
                f"form (weights of any sign on the symbol at each position, a bias per task and the subject's "
                f"membership in each task), {shown} = 0, so one of these margins is <= 0 (an exact certificate, "
                f"Gordan's theorem)")
        if self.plain:
            return head + ("; these prefixes hold no entity, so this construction's residual stream there is an "
                           "affine function of their words, and no gate linear in it routes them at any beta; a "
                           "single-layer transformer with other heads (e.g. one comparing two positions) is not "
                           "ruled out")
        return head + ("; gates with per-entity weights, and single-layer transformers with other heads, are not "
                       "ruled out")

    def fix(self, taskset: TaskSet, trie: StructureTrie) -> str:
        return ("make the templates of these tasks differ at some position in a way no weighted sum of positions "
                "can undo (e.g. a word of each task's own before ⋆1), or remove one of them")

    def refs(self, trie: StructureTrie) -> list[tuple[int, int]]:
        """Two (task, template) pairs the certificate involves, for file:line in messages."""
        out: list[tuple[int, int]] = []
        for t in self.terms:
            ref = (t.winner, int(trie.nodes[t.node].templates[t.winner][0]))
            if all(r[0] != ref[0] for r in out):
                out.append(ref)
        return out[:2]


def _memberships(taskset: TaskSet, trie: StructureTrie, node_id: int, winner: int, tasks: np.ndarray) -> dict:
    """For the determined queries of ``winner`` at a node: one subject per distinct pattern of
    membership in ``tasks`` (pattern -> subject token id). Each pattern is a different true
    constraint on the subject weights, so each gets its own rows."""
    from tasks.queries import build_group

    group = build_group(taskset, trie, trie.nodes[node_id])
    counts = np.diff(group.allowed_ptr)
    mine = np.flatnonzero((counts == 1) & (group.allowed[group.allowed_ptr[:-1]] == winner))
    subjects = np.unique(group.subjects[mine])
    out: dict[tuple[bool, ...], int] = {}
    members = [taskset.fact_ids[k][0] for k in tasks.tolist()]
    inside = (np.stack([np.isin(subjects, m) for m in members], axis=1) if subjects.size
              else np.zeros((0, len(members)), bool))
    for s, pattern in zip(subjects.tolist(), map(tuple, inside.tolist())):
        out.setdefault(pattern, s)
    return out


def _rows(taskset: TaskSet, trie: StructureTrie, cells, tasks: np.ndarray, depth: int):
    """The Gordan rows of the determined cells of one length with winners in ``tasks``:
    (list of (cell, winner, rival, subject), A as a sparse matrix over the variables).

    A cell with an entity gives rows for each distinct membership of its subjects in
    ``tasks`` (:func:`_memberships`); every row is one of the true constraints."""
    in_tasks = np.zeros(len(taskset.tasks), bool)
    in_tasks[tasks] = True
    depth_of = np.array([n.depth for n in trie.nodes], np.int64)
    chosen = np.flatnonzero(cells.determined & (depth_of[cells.node] == depth) & in_tasks[cells.winner])
    if chosen.size < 2:
        return [], None
    position = {k: n for n, k in enumerate(tasks.tolist())}
    feature: dict[tuple[int, int, str], int] = {}   # (task, m, symbol) -> variable
    n_tasks = len(taskset.tasks)
    base_b, base_l = 0, n_tasks                      # biases 0..K-1, subject weights K..2K-1; features after
    offset = 2 * n_tasks

    def var(k: int, m: int, sym: str) -> int:
        return feature.setdefault((k, m, sym), offset + len(feature))

    rows, r_idx, c_idx, vals = [], [], [], []
    for i in chosen.tolist():
        node = trie.nodes[int(cells.node[i])]
        w = int(cells.winner[i])
        syms = [symbol_label(c, taskset) for c in node.symbols]
        reps = _memberships(taskset, trie, node.id, w, tasks) if cells.entity[i] else {None: -1}
        for pattern, s in reps.items():
            for j in tasks.tolist():
                if j == w:
                    continue
                entries: dict[int, float] = {}
                for m, sym in enumerate(syms, start=1):
                    entries[var(w, m, sym)] = entries.get(var(w, m, sym), 0.0) + 1.0
                    entries[var(j, m, sym)] = entries.get(var(j, m, sym), 0.0) - 1.0
                entries[base_b + w] = 1.0
                entries[base_b + j] = -1.0
                if pattern is not None:
                    entries[base_l + w] = 1.0                    # w has the subject (it is consistent)
                    if pattern[position[j]]:
                        entries[base_l + j] = -1.0
                r = len(rows)
                for col, v in entries.items():
                    if v != 0.0:
                        r_idx.append(r)
                        c_idx.append(col)
                        vals.append(v)
                rows.append((i, w, j, s))
    A = sp.csr_matrix((vals, (r_idx, c_idx)), shape=(len(rows), offset + len(feature)))
    return rows, A


def _exact_nonnegative_solution(M: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction] | None:
    """A solution y >= 0 of M y = rhs in exact fractions: Gauss-Jordan elimination, free
    variables set to 0 (a basic solution); None if inconsistent or negative."""
    n_rows, n_cols = len(M), len(M[0]) if M else 0
    aug = [row[:] + [b] for row, b in zip(M, rhs)]
    pivots = []
    r = 0
    for c in range(n_cols):
        p = next((i for i in range(r, n_rows) if aug[i][c] != 0), None)
        if p is None:
            continue
        aug[r], aug[p] = aug[p], aug[r]
        piv = aug[r][c]
        aug[r] = [x / piv for x in aug[r]]
        for i in range(n_rows):
            if i != r and aug[i][c] != 0:
                f = aug[i][c]
                aug[i] = [a - f * b for a, b in zip(aug[i], aug[r])]
        pivots.append(c)
        r += 1
        if r == n_rows:
            break
    if any(all(x == 0 for x in row[:-1]) and row[-1] != 0 for row in aug):
        return None
    y = [Fraction(0)] * n_cols
    for i, c in enumerate(pivots):
        y[c] = aug[i][-1]
    return y if all(v >= 0 for v in y) else None


def _certify_rows(A: sp.csr_matrix, support: np.ndarray) -> list[Fraction] | None:
    """Exact y >= 0 on ``support`` with Σ y = 1 and Σ y_r A_r = 0, checked exactly."""
    sub = A[support].tocsr()
    used = np.unique(sub.indices)            # the variables these rows involve
    M = [[Fraction(0)] * support.size for _ in range(used.size)] + [[Fraction(1)] * support.size]
    col_of = {int(c): n for n, c in enumerate(used)}
    coo = sub.tocoo()
    for r, c, v in zip(coo.row, coo.col, coo.data):
        M[col_of[int(c)]][int(r)] += Fraction(float(v))
    rhs = [Fraction(0)] * used.size + [Fraction(1)]
    y = _exact_nonnegative_solution(M, rhs)
    if y is None:
        return None
    # the check, independent of the elimination: Σ y = 1, y >= 0, Σ y_r A_r = 0 exactly
    if sum(y) != 1 or any(v < 0 for v in y):
        return None
    total: dict[int, Fraction] = {}
    for r, c, v in zip(coo.row, coo.col, coo.data):
        total[int(c)] = total.get(int(c), Fraction(0)) + y[int(r)] * Fraction(float(v))
    return y if all(v == 0 for v in total.values()) else None


def find_certificate(taskset: TaskSet, trie: StructureTrie, cells, tasks: np.ndarray) -> Certificate | None:
    """A checked certificate that no gate of the family routes the determined prefixes of
    some length among ``tasks`` (see the module docstring), or None if none was found."""
    tasks = np.unique(np.asarray(tasks, np.int64))
    if tasks.size < 2:
        return None
    for depth in sorted({n.depth for n in trie.nodes}):
        rows, A = _rows(taskset, trie, cells, tasks, depth)
        if not rows or A.shape[0] * A.shape[1] > MAX_ENTRIES:
            continue
        n = A.shape[0]
        A_eq = sp.vstack([A.T, sp.csr_matrix(np.ones((1, n)))]).tocsr()
        b_eq = np.zeros(A_eq.shape[0])
        b_eq[-1] = 1.0
        from scipy.optimize import linprog      # here: only a proof of no separating gate needs it (a slow import)

        res = linprog(np.zeros(n), A_eq=A_eq, b_eq=b_eq, bounds=[(0, None)] * n, method="highs-ds")
        if res.status != 0:
            continue
        support = np.flatnonzero(res.x > 1e-9)
        y = _certify_rows(A, support)
        if y is None:
            continue
        terms = tuple(Term(int(cells.node[rows[r][0]]), rows[r][1], rows[r][2], rows[r][3], weight)
                      for r, weight in zip(support.tolist(), y) if weight != 0)
        return Certificate(depth, terms)
    return None
