"""An independent oracle: does a model *truly* violate a requirement? (mutation testing)

Written apart from the verifier: it shares only the weight layout
(:class:`layout.Weights`, the contract) and the task model
(:mod:`tasks.model`). It enumerates its own queries from ``TaskSet.sentences()`` and
evaluates the forward pass of :mod:`layout` in high-precision arithmetic
(mpmath, 40 significant digits by default) from the equations, one query at a time;
nothing of :mod:`verifier.passes.forward`, :mod:`verifier.arithmetic.interval`, :mod:`audit.exact`,
:mod:`verifier.checks.verify`, :mod:`tasks.queries` or :mod:`tasks.structure` is used.

A model **violates** the requirements when (each is a :class:`Violation`):

* ``names``: ``expert_tasks`` names one task for several experts;
* ``layout``: the model cannot be evaluated on the task set (a token missing from the
  vocabulary, too few positions, inconsistent shapes, a non-finite weight);
* ``error``: some query's exact error 1 − P(valid next tokens) is >= ε;
* ``routing``: some query's exact gate argmax is an expert whose task is not consistent
  with the prefix (an unnamed expert, or one named for another task); an exact tie for
  the maximum counts as a violation (the model's choice is undefined);
* ``size``: an expert named for task k, or receiving one of k's determined queries, is
  wider than c(k) = L·|T(k)| + N_k;
* ``entanglement``: an object query of task k whose error with the routed expert's
  output removed is < ε.

**Precision.** Weights are floats, hence exact rationals, converted exactly. Every
linear map is evaluated *exactly* (exact products, sums without rounding: mpmath's
``mpf_sum`` at precision 0), so sums of huge and tiny terms, or of values beyond
float64's range, lose nothing; only ``exp`` and divisions (softmax, the error) round,
at 40 significant digits by default. One exception keeps exact sums finite: when the
terms of a sum span more than 2^16 binades (only possible once a rounded ``exp`` of a
huge score has entered, e.g. a softmax weight of 2^-(2^1000)), the sum is rounded at
the working precision plus 64 bits, like the ``exp`` that produced the tiny term. A decision (margin > 0, error >= ε,
ablated error >= ε) is *settled* at 40 digits when its distance to the threshold exceeds
1e-20. Otherwise, and for every query of a model with extreme weights (a magnitude
above 1e12 or below 1e-12), the query is evaluated again at twice the digits: a
decision there is settled when its distance to the threshold is more than twice
(four times for margins) the change between the two precisions, an estimate of the
lower precision's error that bounds the higher one's many times over. Up to 320
digits; a decision still unsettled there counts as a violation (a tie).

Expensive intermediate results are cached across calls by fingerprints (hashes) of
the arrays they depend on: per (token, position) head projections, residuals, expert
outputs and errors. Mutants that change one block reuse the rest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import mpmath
import numpy as np
from mpmath.libmp import mpf_mul, mpf_sum
import scipy.sparse as sp

from tasks.model import OBJECT, TaskSet
from layout import Weights

DPS = 40
MAX_DPS = 320
SETTLE = 1e-20          # first-level distance to a threshold that settles a decision
EXTREME_HIGH = 1e12     # weights beyond these magnitudes: every query at two precisions
EXTREME_LOW = 1e-12
CACHE_LIMIT = 400_000   # entries per cache before it is cleared


# --- queries ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OracleQuery:
    prefix: tuple[str, ...]
    valid: frozenset[str]        # tokens that follow the prefix in some sentence
    tasks: tuple[int, ...]       # consistent tasks (a sentence of the task starts with the prefix)
    object_of: tuple[int, ...]   # tasks in which ⋆2 follows the prefix

    @property
    def determined(self) -> int | None:
        return self.tasks[0] if len(self.tasks) == 1 else None


def enumerate_queries(taskset: TaskSet) -> list[OracleQuery]:
    """Every proper, non-empty prefix of every sentence, with its valid next tokens."""
    table: dict[tuple[str, ...], tuple[set, set, set]] = {}
    for sentence, k, template, _subject in taskset.sentences():
        for p in range(1, len(sentence)):
            valid, tasks, obj = table.setdefault(sentence[:p], (set(), set(), set()))
            valid.add(sentence[p])
            tasks.add(k)
            if template.parts[p] is OBJECT:
                obj.add(k)
    return [OracleQuery(prefix, frozenset(v), tuple(sorted(t)), tuple(sorted(o)))
            for prefix, (v, t, o) in sorted(table.items())]


def size_bound(taskset: TaskSet, k: int) -> int:
    """c(k) = L·|T(k)| + N_k, L the longest template of the whole set."""
    L = max(len(t.parts) for task in taskset.tasks for t in task.templates)
    task = taskset.tasks[k]
    return L * len(task.templates) + len(task.facts)


# --- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Violation:
    requirement: str            # names, layout, error, routing, size, entanglement
    task: str | None
    prefix: str | None
    detail: str


@dataclass
class OracleResult:
    violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    queries: int = 0
    escalated: int = 0               # queries evaluated at more than the base precision
    max_dps: int = DPS
    worst_error: float = 0.0         # largest exact error (as a float)
    min_margin: float = float("inf")
    min_ablated: float = float("inf")  # smallest ablated error over object queries
    max_p_ablated: float = 0.0         # largest P(object) with the routed expert's output removed
    max_magnitude: float = 0.0       # largest |value| among residuals, gate scores and logits (inf: beyond float)
    max_score: float = 0.0           # largest |attention score|
    #: per query prefix: (routed expert, margin, error, ablated error or None), as floats
    records: dict[tuple[str, ...], tuple[int, float, float, float | None]] = field(default_factory=dict)

    @property
    def violating(self) -> bool:
        return bool(self.violations)

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(sorted(self.counts))

    def add(self, requirement: str, task: str | None, prefix: str | None, detail: str, keep: int = 5) -> None:
        n = self.counts.get(requirement, 0)
        self.counts[requirement] = n + 1
        if n < keep:
            self.violations.append(Violation(requirement, task, prefix, detail))

    def summary(self) -> str:
        if not self.violations:
            return "no violation"
        return "; ".join(f"{r} x{n}" for r, n in sorted(self.counts.items()))


# --- fingerprints and conversions -----------------------------------------------------------


def _triplets(m) -> tuple[tuple[int, int], np.ndarray, np.ndarray, np.ndarray]:
    """(shape, rows, cols, values) of a sparse or dense matrix exactly as stored: duplicate
    entries are kept (they are summed exactly later), nothing is sorted or merged."""
    if sp.issparse(m):
        c = m.tocoo(copy=True) if m.format != "coo" else m
        return tuple(m.shape), np.asarray(c.row, np.int64), np.asarray(c.col, np.int64), np.asarray(c.data)
    a = np.asarray(m)
    return tuple(a.shape), np.zeros(0, np.int64), np.zeros(0, np.int64), a.reshape(-1)


def fingerprint(*arrays) -> bytes:
    """A hash of arrays' shapes and stored values (sparse: every stored entry, in storage order)."""
    h = hashlib.blake2b(digest_size=20)
    for m in arrays:
        if sp.issparse(m):
            shape, rows, cols, vals = _triplets(m)
            h.update(b"S" + np.asarray(shape, np.int64).tobytes() + rows.tobytes() + cols.tobytes())
            h.update(np.asarray(vals).dtype.str.encode() + np.ascontiguousarray(vals).tobytes())
        else:
            a = np.ascontiguousarray(np.asarray(m))
            h.update(b"D" + np.asarray(a.shape, np.int64).tobytes() + a.dtype.str.encode() + a.tobytes())
    return h.digest()


class _Fingerprints:
    def __init__(self, w: Weights) -> None:
        self.E = fingerprint(w.E)
        self.P = fingerprint(w.P)
        self.heads = tuple(fingerprint(h.W_Q, h.W_K, h.W_V, h.W_O) for h in w.heads)
        self.experts = tuple(fingerprint(e.W_1, e.b_1, e.W_2) for e in w.experts)
        self.U = fingerprint(w.U)
        self.gate = fingerprint(w.W_G, w.b_G)


#: Exact sums are used while their terms span at most this many binades (an exact sum
#: of terms 2^e apart needs an e-bit integer: beyond this it would not fit in memory).
SPREAD = 1 << 16


def _precision(terms: list, rounded: int) -> int:
    """0 (exact) for terms within ``SPREAD`` binades of each other, else ``rounded`` bits."""
    lo = hi = None
    for sign, man, exp, bc in terms:
        if man:
            lo = exp if lo is None else min(lo, exp)
            hi = exp + bc if hi is None else max(hi, exp + bc)
    return 0 if lo is None or hi - lo <= SPREAD else rounded


class _Ctx:
    """An mpmath context at one precision, with exact float conversion."""

    def __init__(self, dps: int) -> None:
        self.dps = dps
        self.mp = mpmath.mp.clone()
        self.mp.dps = dps
        self.zero = self.mp.mpf(0)
        self.one = self.mp.mpf(1)

    def exact_entries(self, m) -> dict[tuple[int, int], Any]:
        """Every entry's exact value: stored duplicates summed exactly (no floating-point merge)."""
        _, rows, cols, vals = _triplets(m)
        mpf = self.mp.mpf
        parts: dict[tuple[int, int], list] = {}
        for i, j, v in zip(rows.tolist(), cols.tolist(), vals.tolist()):
            parts.setdefault((i, j), []).append(mpf(v)._mpf_)
        out = {}
        for key, ps in parts.items():
            v = self.mp.make_mpf(mpf_sum(ps, 0))   # float64 terms: at most ~2200 binades apart
            if v:
                out[key] = v
        return out

    def rows(self, m) -> list[tuple[int, list[tuple[int, Any]]]]:
        """Non-empty rows of a sparse matrix: (row, [(column, exact value)])."""
        by_row: dict[int, list] = {}
        for (i, j), v in sorted(self.exact_entries(m).items()):
            by_row.setdefault(i, []).append((j, v))
        return sorted(by_row.items())

    def row_dicts(self, m) -> list[dict[int, Any]]:
        """Every row as a sparse dict of exact values."""
        out: list[dict[int, Any]] = [{} for _ in range(m.shape[0])]
        for (i, j), v in self.exact_entries(m).items():
            out[i][j] = v
        return out

    # Linear algebra is exact: products of exact numbers and sums without rounding
    # (mpmath's mpf_sum with prec=0). Only exp and division round (at ``dps`` digits).
    def _sum(self, terms: list) -> Any:
        """Σ terms (raw mpf tuples): exact, unless they span more than ``SPREAD`` binades."""
        return self.mp.make_mpf(mpf_sum(terms, _precision(terms, self.mp.prec + 64)))

    def xdot(self, pairs) -> Any:
        """Σ a·b exactly (see :meth:`_sum`)."""
        return self._sum([mpf_mul(a._mpf_, b._mpf_) for a, b in pairs])

    def xsum(self, values) -> Any:
        """Σ v exactly (see :meth:`_sum`)."""
        return self._sum([v._mpf_ for v in values])

    def xadd(self, a, b) -> Any:
        return self._sum([a._mpf_, b._mpf_])

    def matvec(self, rows, x: dict[int, Any]) -> dict[int, Any]:
        """M x (exact) for M given by :meth:`rows` and a sparse dict x."""
        out = {}
        for i, entries in rows:
            pairs = [(a, x[j]) for j, a in entries if j in x]
            if pairs:
                v = self.xdot(pairs)
                if v:
                    out[i] = v
        return out

    def dot(self, a: dict[int, Any], b: dict[int, Any]) -> Any:
        """a · b (exact)."""
        if len(a) > len(b):
            a, b = b, a
        return self.xdot([(v, b[j]) for j, v in a.items() if j in b])


# --- the oracle -----------------------------------------------------------------------------


class Oracle:
    """Decides violations exactly (see the module docstring); caches across calls."""

    def __init__(self, dps: int = DPS, max_dps: int = MAX_DPS) -> None:
        self.base_dps = dps
        self.max_dps = max_dps
        self._ctx: dict[int, _Ctx] = {}
        self._conv: dict[tuple, Any] = {}
        self._proj: dict[tuple, Any] = {}
        self._res: dict[tuple, Any] = {}
        self._out: dict[tuple, Any] = {}
        self._err: dict[tuple, Any] = {}

    # ---- plumbing
    def ctx(self, dps: int) -> _Ctx:
        if dps not in self._ctx:
            self._ctx[dps] = _Ctx(dps)
        return self._ctx[dps]

    def _cached(self, cache: dict, key, make):
        if key in cache:
            return cache[key]
        if len(cache) > CACHE_LIMIT:
            cache.clear()
        value = cache[key] = make()
        return value

    def _rows(self, c: _Ctx, fp: bytes, name: str, m):
        return self._cached(self._conv, (c.dps, fp, name, "rows"), lambda: c.rows(m))

    def _row_dicts(self, c: _Ctx, fp: bytes, name: str, m):
        return self._cached(self._conv, (c.dps, fp, name, "dicts"), lambda: c.row_dicts(m))

    def _vector(self, c: _Ctx, v) -> list:
        return [c.mp.mpf(x) for x in np.asarray(v).tolist()]   # exact: Python floats and ints

    # ---- the forward pass, from layout/weights.py's equations
    def _h(self, c: _Ctx, w: Weights, fp: _Fingerprints, token: int, pos: int) -> dict[int, Any]:
        """h = E[token] + P[pos]."""
        E = self._row_dicts(c, fp.E, "E", w.E)
        P = self._row_dicts(c, fp.P, "P", w.P)
        out = dict(E[token])
        for j, v in P[pos].items():
            out[j] = c.xadd(out[j], v) if j in out else v
        return {j: v for j, v in out.items() if v}

    def _projection(self, c, w, fp, m: int, token: int, pos: int):
        """(W_Q h, W_K h, W_O W_V h) for head m at (token, position)."""
        def make():
            head = w.heads[m]
            fh = fp.heads[m]
            h = self._h(c, w, fp, token, pos)
            q = c.matvec(self._rows(c, fh, "Q", head.W_Q), h)
            k = c.matvec(self._rows(c, fh, "K", head.W_K), h)
            v = c.matvec(self._rows(c, fh, "V", head.W_V), h)
            o = c.matvec(self._rows(c, fh, "O", head.W_O), v)
            return q, k, o
        return self._cached(self._proj, (c.dps, fp.E, fp.P, fp.heads[m], token, pos), make)

    def _residual(self, c, w, fp, ids: tuple[int, ...]) -> tuple[tuple, dict[int, Any], Any]:
        """r at the last position of BOS + ids; returns (cache key, r, largest |attention score|)."""
        key = (c.dps, fp.E, fp.P, fp.heads, ids)

        def make():
            seq = (w.bos,) + ids
            n = len(seq) - 1
            terms: dict[int, list] = {}
            biggest = c.zero
            for j, v in self._h(c, w, fp, seq[n], n).items():
                terms.setdefault(j, []).append(v)
            for m in range(len(w.heads)):
                projs = [self._projection(c, w, fp, m, seq[j], j) for j in range(n + 1)]
                q = projs[n][0]
                scores = [c.dot(q, kj) for _, kj, _ in projs]
                top = max(scores)
                biggest = max(biggest, abs(top), abs(min(scores)))
                ex = [c.mp.exp(s - top) for s in scores]
                z = c.mp.fsum(ex)
                a = [e / z for e in ex]
                mixed: dict[int, list] = {}
                for aj, (_, _, oj) in zip(a, projs):
                    for i, v in oj.items():
                        mixed.setdefault(i, []).append((aj, v))
                for i, pairs in mixed.items():
                    terms.setdefault(i, []).append(c.xdot(pairs))
            r = {}
            for j, vs in terms.items():
                v = c.xsum(vs)
                if v:
                    r[j] = v
            return r, biggest
        r, biggest = self._cached(self._res, key, make)
        return key, r, biggest

    def _expert_out(self, c, w, fp, k: int, rkey, r) -> dict[int, Any]:
        """W_2^k ReLU(W_1^k r + b_1^k)."""
        def make():
            ex = w.experts[k]
            fe = fp.experts[k]
            W1 = self._row_dicts(c, fe, "W_1", ex.W_1)
            b1 = self._cached(self._conv, (c.dps, fe, "b_1"), lambda: self._vector(c, ex.b_1))
            act = {}
            for i in range(len(W1)):
                pairs = [(a, r[j]) for j, a in W1[i].items() if j in r]
                if b1[i]:
                    pairs.append((b1[i], c.one))
                z = c.xdot(pairs) if pairs else c.zero
                if z > 0:
                    act[i] = z
            return c.matvec(self._rows(c, fe, "W_2", ex.W_2), act)
        return self._cached(self._out, (rkey, fp.experts[k]), make)

    def _error(self, c, w, fp, y: dict[int, Any], valid: frozenset[int]) -> tuple[Any, Any]:
        """1 − Σ_{t valid} softmax(U y)_t, as Σ_{t invalid} / Σ_t (no cancellation); and max |logit|.

        Tokens whose U row meets no non-zero of y have logit exactly 0: their exp is
        evaluated once and counted.
        """
        columns = self._cached(self._conv, (c.dps, fp.U, "U columns"), lambda: _columns(c.row_dicts(w.U)))
        pairs: dict[int, list] = {}
        for j, v in y.items():
            for t, a in columns.get(j, ()):
                pairs.setdefault(t, []).append((a, v))
        logits = {t: c.xdot(p) for t, p in pairs.items()}
        logits = {t: v for t, v in logits.items() if v}
        V = len(w.vocab)
        zeros = V - len(logits)
        zeros_valid = sum(1 for t in valid if t not in logits)
        values = list(logits.values())
        top = max(values + ([c.zero] if zeros else []))
        e0 = c.mp.exp(-top) if zeros else c.zero
        ex = {t: c.mp.exp(v - top) for t, v in logits.items()}
        bad = c.mp.fsum([e for t, e in ex.items() if t not in valid] + [e0 * (zeros - zeros_valid)])
        total = c.mp.fsum(list(ex.values()) + [e0 * zeros])
        biggest = max([abs(v) for v in values] + [c.zero])
        return bad / total, biggest

    def _localization(self, c, w, fp, y: dict[int, Any], o: int) -> tuple[Any, Any, bool]:
        """For the ablated logits z = U y and the object o: P(o) = softmax(z)_o, the gap
        max_{t != o} z_t − z_o, and whether it is >= 0 by structure (some t != o has the same
        row of U as o on the non-zeros of y, so z_t = z_o exactly)."""
        columns = self._cached(self._conv, (c.dps, fp.U, "U columns"), lambda: _columns(c.row_dicts(w.U)))
        pairs: dict[int, list] = {}
        for j, v in y.items():
            for t, a in columns.get(j, ()):
                pairs.setdefault(t, []).append((a, v))
        logits = {t: c.xdot(p) for t, p in pairs.items()}
        logits = {t: v for t, v in logits.items() if v}
        V = len(w.vocab)
        zeros = V - len(logits)                        # tokens of logit exactly 0 (o among them or not)
        z_o = logits.get(o, c.zero)
        others = [v for t, v in logits.items() if t != o]
        zeros_other = zeros - (0 if o in logits else 1)
        if zeros_other > 0:
            others.append(c.zero)
        gap = (max(others) - z_o) if others else -c.mp.inf
        top = max(list(logits.values()) + ([c.zero] if zeros else []))
        total = c.mp.fsum([c.mp.exp(v - top) for v in logits.values()] + [c.mp.exp(-top) * zeros])
        p_o = c.mp.exp(z_o - top) / total
        # an exact tie by structure: some t != o whose row of U equals o's on the non-zeros of
        # y (both logits the same sum of the same terms; two untouched tokens: both exactly 0)
        rows: dict[int, dict[int, Any]] = {}
        for j in y:
            for t, a in columns.get(j, ()):
                rows.setdefault(t, {})[j] = a
        mine = rows.get(o, {})
        tie = (not mine and V - len(rows) - (0 if o in rows else 1) > 0) or \
            any(t != o and row == mine for t, row in rows.items())
        if tie:
            gap = max(gap, c.zero)
        return p_o, gap, tie

    def evaluate(self, w: Weights, fp: _Fingerprints, ids: tuple[int, ...], valid: frozenset[int],
                 want_ablated: bool, dps: int, target: int | None = None) -> dict[str, Any]:
        """Gate scores, routed expert, margin, error and ablated error of one query (and, for
        an object query's object ``target``, P_ablated(o) and the ablated top-token gap)."""
        c = self.ctx(dps)
        rkey, r, biggest_score = self._residual(c, w, fp, ids)
        WG = self._row_dicts(c, fp.gate, "W_G", w.W_G)
        bG = self._cached(self._conv, (c.dps, fp.gate, "b_G"), lambda: self._vector(c, w.b_G))
        gates = []
        for k in range(len(w.experts)):
            pairs = [(a, r[j]) for j, a in WG[k].items() if j in r]
            if bG[k]:
                pairs.append((bG[k], c.one))
            gates.append(c.xdot(pairs) if pairs else c.zero)
        e = max(range(len(gates)), key=lambda k: gates[k])
        others = [g for k, g in enumerate(gates) if k != e]
        margin = gates[e] - max(others) if others else c.mp.inf
        out = self._expert_out(c, w, fp, e, rkey, r)
        if w.gate_mode == "top1-scaled":
            scale = 1 / c.mp.fsum(c.mp.exp(g - gates[e]) for g in gates)
            out = {i: scale * v for i, v in out.items()}
            err_key = None
        else:
            err_key = (rkey, fp.U, fp.experts[e], valid)
        y = dict(r)
        for i, v in out.items():
            y[i] = c.xadd(y[i], v) if i in y else v
        err, big = (self._cached(self._err, err_key, lambda: self._error(c, w, fp, y, valid)) if err_key
                    else self._error(c, w, fp, y, valid))
        abl = None
        loc = (None, None, False)
        if want_ablated:
            abl, big_a = self._cached(self._err, (rkey, fp.U, None, valid), lambda: self._error(c, w, fp, r, valid))
            big = max(big, big_a)
            if target is not None:
                loc = self._cached(self._err, (rkey, fp.U, "localization", target),
                                   lambda: self._localization(c, w, fp, r, target))
        big = max([big] + [abs(g) for g in gates] + [abs(v) for v in r.values()])
        return {"gates": gates, "expert": e, "margin": margin, "error": err, "ablated": abl,
                "dps": dps, "magnitude": big,
                "score": biggest_score, "p_object": loc[0], "gap": loc[1], "gap_structural": loc[2]}

    # ---- decisions with escalation
    def _decide(self, w, fp, ids, valid, want_ablated, epsilon: float, extreme: bool, target: int | None = None,
                uniform=None) -> tuple[dict, dict[str, bool]]:
        """Evaluate, escalating precision until every decision is settled.

        Returns the values at the last precision and, per decision, whether it is
        settled ('margin', 'error', 'ablated'); an unsettled decision is a violation.
        """
        dps = self.base_dps
        prev = None
        while True:
            cur = self.evaluate(w, fp, ids, valid, want_ablated, dps, target)
            settled = self._settled(self.ctx(dps), cur, prev, epsilon, uniform)
            if prev is None and extreme:
                settled = {k: False for k in settled}
            if all(settled.values()) or dps >= self.max_dps:
                return cur, settled
            prev, dps = cur, min(dps * 2, self.max_dps)      # the last step at max_dps itself

    @staticmethod
    def _settled(c: _Ctx, cur, prev, epsilon: float, uniform=None) -> dict[str, bool]:
        """Is each decision's distance to its threshold beyond the estimated error? (The
        localization's: P(o) against ``uniform`` = 1/|O_k|, the gap against 0; a gap exactly
        0 by structure is settled.)"""
        mp = c.mp
        eps = mp.mpf(float(epsilon))
        margin = cur["margin"]
        out = {}
        if prev is None:
            out["margin"] = bool(margin > SETTLE)
            out["error"] = bool(abs(cur["error"] - eps) > SETTLE)
            if cur["ablated"] is not None:
                out["ablated"] = bool(abs(cur["ablated"] - eps) > SETTLE)
            if cur["p_object"] is not None:
                out["l1"] = uniform is None or uniform >= 1 or bool(abs(cur["p_object"] - uniform) > SETTLE)
                out["l2"] = bool(cur["gap_structural"] or abs(cur["gap"]) > SETTLE)
            return out
        tiny = mp.mpf(10) ** (-(c.dps - 8))
        dg = max([abs(a - b) for a, b in zip(cur["gates"], prev["gates"])] + [c.zero])
        out["margin"] = bool(cur["expert"] == prev["expert"] and margin > 4 * dg + tiny)
        de = abs(cur["error"] - prev["error"])
        out["error"] = bool(abs(cur["error"] - eps) > 2 * de + tiny)
        if cur["ablated"] is not None:
            da = abs(cur["ablated"] - prev["ablated"])
            out["ablated"] = bool(abs(cur["ablated"] - eps) > 2 * da + tiny)
        if cur["p_object"] is not None:
            dp = abs(cur["p_object"] - prev["p_object"])
            out["l1"] = uniform is None or uniform >= 1 or bool(abs(cur["p_object"] - uniform) > 2 * dp + tiny)
            gap, pg = cur["gap"], prev["gap"]
            dg = abs(gap - pg) if mp.isfinite(gap) and mp.isfinite(pg) else mp.inf
            out["l2"] = bool(cur["gap_structural"] or (mp.isfinite(gap) and abs(gap) > 2 * dg + tiny)
                             or (gap == -mp.inf))
        return out

    def query(self, taskset: TaskSet, w: Weights, prefix: tuple[str, ...]) -> dict[str, Any]:
        """The values of one query at the base precision (gates, expert, margin, error, ablated)."""
        q = next(q for q in enumerate_queries(taskset) if q.prefix == tuple(prefix))
        index = {tok: i for i, tok in enumerate(w.vocab)}
        return self.evaluate(w, _Fingerprints(w), tuple(index[t] for t in q.prefix),
                             frozenset(index[t] for t in q.valid),
                             True, self.base_dps)

    # ---- the whole judgement
    def judge(self, taskset: TaskSet, w: Weights, epsilon: float) -> OracleResult:
        res = OracleResult()
        names = list(taskset.names)
        # names: one expert per task
        named = [t for t in w.expert_tasks if t]
        for t in sorted({t for t in named if named.count(t) > 1}):
            res.add("names", t, None, f"expert_tasks names task {t!r} for {named.count(t)} experts")
        # layout: can the model be evaluated at all?
        problem = _layout_problem(taskset, w)
        if problem:
            res.add("layout", None, None, problem)
            return res
        # size, by name
        bound = {t.name: size_bound(taskset, k) for k, t in enumerate(taskset.tasks)}
        for e, t in enumerate(w.expert_tasks):
            if t in bound and w.experts[e].width > bound[t]:
                res.add("size", t, None, f"expert {e} named '{t}' has width {w.experts[e].width} > c = {bound[t]}")
        fp = _Fingerprints(w)
        extreme = _extreme(w)
        index = {tok: i for i, tok in enumerate(w.vocab)}
        eps = mpmath.mpf(float(epsilon))  # exact: a float
        receivers: dict[int, set[int]] = {}
        queries = enumerate_queries(taskset)
        res.queries = len(queries)
        words = set(taskset.vocabulary.words)
        objects = [len(set(t.facts.objects)) for t in taskset.tasks]
        for q in queries:
            ids = tuple(index[t] for t in q.prefix)
            valid = frozenset(index[t] for t in q.valid)
            text = " ".join(q.prefix)
            entities = [t for t in q.valid if t not in words]
            # an object query of one task: its object is its one valid entity (templates' words are no entity)
            target = index[entities[0]] if len(q.object_of) == 1 and len(q.tasks) == 1 and len(entities) == 1 else None
            m = objects[q.object_of[0]] if target is not None else 0
            uniform = mpmath.mpf(1) / m if m else None
            cur, settled = self._decide(w, fp, ids, valid, bool(q.object_of), epsilon, extreme, target, uniform)
            if cur["dps"] > self.base_dps:
                res.escalated += 1
                res.max_dps = max(res.max_dps, cur["dps"])
            e = cur["expert"]
            res.max_magnitude = max(res.max_magnitude, float(cur["magnitude"]))
            res.max_score = max(res.max_score, float(cur["score"]))
            res.records[q.prefix] = (e, float(cur["margin"]), float(cur["error"]),
                                     None if cur["ablated"] is None else float(cur["ablated"]))
            task_name = names[q.tasks[0]]
            margin = cur["margin"]
            if mpmath.isfinite(margin):
                res.min_margin = min(res.min_margin, float(margin))
            served = w.expert_tasks[e]
            consistent = {names[k] for k in q.tasks}
            if not settled["margin"] or not margin > 0:
                res.add("routing", task_name, text,
                        f"no unique gate winner (top expert {e}, margin {mpmath.nstr(margin, 5)})")
            elif served not in consistent:
                res.add("routing", task_name, text,
                        f"routed to expert {e} ({served or 'no task'!s}), consistent: {sorted(consistent)}")
            if q.determined is not None:
                receivers.setdefault(q.determined, set()).add(e)
            err = cur["error"]
            res.worst_error = max(res.worst_error, float(err))
            if not settled["error"] or err >= eps:
                res.add("error", task_name, text, f"exact error {mpmath.nstr(err, 6)} >= epsilon {epsilon}"
                        + ("" if settled["error"] else " (undecided at the highest precision)"))
            for k in q.object_of:
                abl = cur["ablated"]
                res.min_ablated = min(res.min_ablated, float(abl))
                if not settled["ablated"] or abl < eps:
                    res.add("entanglement", names[k], text,
                            f"error with expert {e}'s output removed is {mpmath.nstr(abl, 6)} < epsilon")
                if cur["p_object"] is not None:
                    p_o, gap = cur["p_object"], cur["gap"]
                    res.max_p_ablated = max(res.max_p_ablated, float(p_o))
                    if not settled["l1"] or p_o > uniform:
                        res.add("entanglement", names[k], text,
                                f"without expert {e}, P(object) = {mpmath.nstr(p_o, 6)} > "
                                f"1/|O_k| = {mpmath.nstr(uniform, 6)} (L1)")
                    if not settled["l2"] or not gap >= 0:
                        res.add("entanglement", names[k], text,
                                f"without expert {e}, the object is the strict top token "
                                f"(gap {mpmath.nstr(gap, 6)}, L2)")
        for k, experts in sorted(receivers.items()):
            for e in sorted(experts):
                if w.experts[e].width > bound[names[k]] and w.expert_tasks[e] != names[k]:
                    res.add("size", names[k], None,
                            f"expert {e} receives determined queries of '{names[k]}' and has width "
                            f"{w.experts[e].width} > c = {bound[names[k]]}")
        return res


def _columns(rows: list[dict[int, Any]]) -> dict[int, list[tuple[int, Any]]]:
    """Column j -> [(row, value)] of a matrix given as row dicts."""
    out: dict[int, list] = {}
    for i, row in enumerate(rows):
        for j, v in row.items():
            out.setdefault(j, []).append((i, v))
    return out


def _layout_problem(taskset: TaskSet, w: Weights) -> str | None:
    """Why the model cannot be evaluated on the task set, or None."""
    V = len(w.vocab)
    if len(set(w.vocab)) != V:
        return "repeated tokens in the vocabulary"
    missing = [t for t in taskset.vocabulary.tokens if t not in set(w.vocab)]
    if missing:
        return f"the vocabulary lacks {missing[0]!r}"
    d = w.E.shape[1]
    longest = max(len(t.parts) for task in taskset.tasks for t in task.templates)
    if w.P.shape[0] < longest:
        return f"{w.P.shape[0]} positions, prefixes need {longest}"
    shapes = [w.E.shape == (V + 1, d), w.P.shape[1] == d, w.U.shape == (V, d), len(w.experts) >= 1,
              w.W_G.shape == (len(w.experts), d), np.shape(w.b_G) == (len(w.experts),),
              len(w.expert_tasks) == len(w.experts), w.gate_mode in ("top1", "top1-scaled")]
    for h in w.heads:
        shapes += [h.W_Q.shape[1] == d, h.W_K.shape == h.W_Q.shape, h.W_V.shape[1] == d,
                   h.W_O.shape == (d, h.W_V.shape[0])]
    for e in w.experts:
        n = e.W_1.shape[0]
        shapes += [e.W_1.shape == (n, d), np.shape(e.b_1) == (n,), e.W_2.shape == (d, n)]
    if not all(shapes):
        return "array shapes do not fit together"
    for m in _all_arrays(w):
        data = m.data if sp.issparse(m) else np.asarray(m)
        if data.dtype.kind not in "fiu" or (data.dtype.kind == "f" and data.dtype.itemsize > 8):
            return f"a weight array has dtype {data.dtype}, not real numbers"
        if not np.all(np.isfinite(data)):
            return "a weight is not a finite number"
    return None


def _all_arrays(w: Weights):
    yield from (w.E, w.P, w.W_G, w.b_G, w.U)
    for h in w.heads:
        yield from (h.W_Q, h.W_K, h.W_V, h.W_O)
    for e in w.experts:
        yield from (e.W_1, e.b_1, e.W_2)


def _extreme(w: Weights) -> bool:
    """Any non-zero weight of magnitude above EXTREME_HIGH or below EXTREME_LOW."""
    for m in _all_arrays(w):
        data = np.abs(m.data if sp.issparse(m) else np.asarray(m, np.float64))
        data = data[data != 0]
        if data.size and (data.max() > EXTREME_HIGH or data.min() < EXTREME_LOW):
            return True
    return False


_DEFAULT: Oracle | None = None


def judge(taskset: TaskSet, weights: Weights, epsilon: float) -> OracleResult:
    """:meth:`Oracle.judge` with a process-wide cache."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Oracle()
    return _DEFAULT.judge(taskset, weights, epsilon)
