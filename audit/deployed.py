"""Concrete deployed executions of the forward pass, for testing the float certificates.

Written apart from :mod:`verifier.passes.floating` (it shares only the layout and the format
table): the equations of :mod:`layout` evaluated one operation at a time in a format
(float32 or bfloat16, emulated in float64 with one rounding to nearest per operation),
with the weights rounded as deployed, in a chosen order of summation (optionally with
sums, exp and divisions in a wider format and each result rounded to the format:
mixed precision):

* ``"sequential"``: terms added left to right in a random permutation;
* ``"pairwise"``: a balanced tree over a random permutation;
* ``"fma"``: left to right in a random permutation, each step one fused multiply-add
  (the product is not rounded; products of two values of at most 24 significand bits
  are exact in float64, so the float64 sum rounded once is the fused result);
* ``"float64-accumulate"``: the exact sum of the products rounded once at the end.

Softmax subtracts the row maximum, and exp and the division are evaluated in float64
and rounded once (within 1 ulp: inside the verifier's default assumption of 4).
Small dense models only (a query at a time).

Every rounding is to nearest even with gradual underflow (a result below the normal
range keeps the format's absolute quantum η) and overflows to ±inf past the largest
finite value (:func:`round_in`).

``stored=True`` is a tensor library's mixed precision taken op by op (PyTorch's bfloat16
tensors: each operation computed in float32, its result rounded to bfloat16 and stored):
besides every product and the softmax outputs, the softmax's shifted scores, its exps
and its sum are each stored in the format; the residual is added head by head
(r = r + W_O^m c_m, each head's product stored, each addition's result stored); and a
product's bias is added after the product is stored (MatMul, then Add).

``forward(prefix, ablate=...)`` also runs the model with the routed expert removed (the
localization check's ablated model, y = r) in each way the execution model's ``ablation``
row names (:data:`ABLATIONS`), and returns the logits too.
"""

from __future__ import annotations

import math

import numpy as np

from layout import Weights
from layout.formats import Format

ORDERS = ("sequential", "pairwise", "fma", "float64-accumulate")
#: The ways of removing the routed expert (the execution model's "ablation" row): not run,
#: its output selected away, its output (or gate scale) multiplied by 0.
ABLATIONS = ("drop", "select", "zero")


def round_to(x, p: int):
    """x rounded to nearest (ties to even) to p significand bits, directly from float64
    (normal range only; these tests never leave it)."""
    x = np.asarray(x, np.float64)
    m, e = np.frexp(x)                       # x = m·2^e, 0.5 <= |m| < 1
    return np.ldexp(np.rint(np.ldexp(m, p)), e - p)


def round_in(x, fmt: Format):
    """x (float64) rounded to nearest even in ``fmt``, with gradual underflow and overflow.

    x = m·2^e with 0.5 <= |m| < 1 has the quantum 2^(e − p) in a normal binade (e − 1 >= emin);
    below the normal range the quantum stays 2^(emin + 1 − p) = η, so e is raised to emin + 1
    there. x·2^(p − e) is then exact in float64 (a power-of-two scaling, its result at least
    2^(emin_64) for every x this module meets), ``rint`` rounds it to nearest even, and the
    scaling back is exact. A result beyond the largest finite value is ±inf (a value that
    rounds to 2^(emax + 1) overflows)."""
    x = np.asarray(x, np.float64)
    if fmt.p >= 53:
        return x.copy()
    _, e = np.frexp(x)
    e = np.maximum(e, fmt.emin + 1)
    out = np.ldexp(np.rint(np.ldexp(x, fmt.p - e)), e - fmt.p)
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(out) > fmt.largest, np.copysign(np.inf, x), out)


class Deployed:
    """The layout's forward pass in ``fmt``, one rounding per operation."""

    def __init__(self, weights: Weights, fmt: Format, order: str, seed: int = 0, acc: Format | None = None,
                 daz: bool = False, stored: bool = False) -> None:
        """``acc``: sums, exp and divisions in this wider format, each result rounded to ``fmt``.
        ``daz``: flush-to-zero and denormals-are-zero: every operand and result below the
        normal range is 0. ``stored``: every intermediate result stored in ``fmt`` (see
        the module docstring)."""
        assert order in ORDERS
        self.fmt, self.order, self.stored = fmt, order, stored
        self.tiny = 2.0 ** fmt.emin if daz else 0.0
        self.work = acc if acc is not None else fmt
        self.acc_p = self.work.p
        self.rng = np.random.default_rng(seed)
        d = lambda M: fmt.round(M.toarray())           # noqa: E731  (weights as deployed: F1)
        self.w = weights
        self.E, self.P, self.U, self.WG = d(weights.E), d(weights.P), d(weights.U), d(weights.W_G)
        self.bG = fmt.round(weights.b_G)
        self.heads = [tuple(d(M) for M in (h.W_Q, h.W_K, h.W_V, h.W_O)) for h in weights.heads]
        self.experts = [(d(e.W_1), fmt.round(e.b_1), d(e.W_2)) for e in weights.experts]

    def flush(self, x):
        """Below the normal range: 0 (with ``daz``), else unchanged."""
        x = np.asarray(x, np.float64)
        return np.where(np.abs(x) < self.tiny, 0.0, x) if self.tiny else x

    def r(self, x):
        """One operation inside a sum, exp or division (the working precision)."""
        return self.flush(round_in(x, self.work))

    def store(self, x):
        """A computed result stored in the format."""
        return self.flush(round_in(x, self.fmt))

    def _sum(self, terms: list[float]) -> float:
        terms = [terms[i] for i in self.rng.permutation(len(terms))]
        if not terms:
            return 0.0
        if self.order == "pairwise":
            while len(terms) > 1:
                terms = [self.r(terms[i] + terms[i + 1]) if i + 1 < len(terms) else terms[i]
                         for i in range(0, len(terms), 2)]
            return float(terms[0])
        s = terms[0]
        for t in terms[1:]:
            s = self.r(s + t)
        return float(s)

    def dot(self, x: np.ndarray, w: np.ndarray, bias: float | None = None) -> float:
        x, w = self.flush(x), self.flush(w)
        bias = None if bias is None else float(self.flush(bias))
        nz = np.flatnonzero((x != 0) & (w != 0))
        if self.order == "float64-accumulate":
            exact = math.fsum([float(x[j]) * float(w[j]) for j in nz] + ([bias] if bias else []))
            return float(self.r(exact))
        if self.order == "fma":
            idx = list(self.rng.permutation(nz))
            s = float(bias) if bias else 0.0
            for j in idx:
                s = float(self.r(s + float(x[j]) * float(w[j])))
            return s
        terms = [float(self.r(float(x[j]) * float(w[j]))) for j in nz] + ([float(bias)] if bias else [])
        return self._sum(terms)

    def matvec(self, W: np.ndarray, x: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        if self.stored and b is not None:           # the product stored, then the bias added and stored
            return self.store(self.r(self.matvec(W, x) + self.flush(b)))
        return self.store(np.array([self.dot(x, W[i], None if b is None else float(b[i])) for i in range(W.shape[0])]))

    def softmax(self, s: np.ndarray) -> np.ndarray:
        keep = self.store if self.stored else (lambda v: v)
        with np.errstate(over="ignore", invalid="ignore"):
            t = keep(self.r(s - s.max()))
            e = keep(self.r(np.exp(t)))
            S = keep(self._sum(list(e)))
            return self.store(self.r(e / S))

    def _heads(self, h: list[np.ndarray]):
        """Per head, (W_O, c) at the last position."""
        last = h[-1]
        for WQ, WK, WV, WO in self.heads:
            q = self.matvec(WQ, last)
            s = self.store(np.array([self.dot(q, self.matvec(WK, hj)) for hj in h]))
            a = self.softmax(s)
            vs = [self.matvec(WV, hj) for hj in h]
            yield WO, self.store(np.array([self.dot(a, np.array([v[l] for v in vs])) for l in range(WV.shape[0])]))

    def _residual(self, h: list[np.ndarray]) -> np.ndarray:
        """r = h + Σ_m W_O^m c_m at the last position: one sum per entry over h and every
        head's products (or, ``stored``, head by head, each product and addition stored)."""
        if self.stored:
            r = h[-1]
            for WO, c in self._heads(h):
                r = self.store(self.r(r + self.matvec(WO, c)))
            return r
        resid_terms = [[float(v)] for v in h[-1]]
        for WO, c in self._heads(h):
            for k in range(WO.shape[0]):
                resid_terms[k].extend(float(self.r(WO[k, l] * c[l])) if self.order != "float64-accumulate"
                                      else float(WO[k, l] * c[l]) for l in np.flatnonzero((WO[k] != 0) & (c != 0)))
        if self.order == "float64-accumulate":
            r = np.array([float(self.r(math.fsum(t))) for t in resid_terms])
        else:
            r = np.array([self._sum(t) for t in resid_terms])
        return self.store(r)

    def run(self, prefix: list[int], ablate: str | None = None) -> tuple[np.ndarray, int]:
        """(the output distribution p̂ at the last position, the routed expert) for a
        prefix of token ids (BOS is prepended); ``ablate``: see :meth:`forward`."""
        p, e, _ = self.forward(prefix, ablate)
        return p, e

    def forward(self, prefix: list[int], ablate: str | None = None) -> tuple[np.ndarray, int, np.ndarray]:
        """(p̂, the routed expert, the logits) for a prefix. ``ablate`` removes the routed
        expert (:data:`ABLATIONS`): "drop" (y = r, the expert not run), "select" (its
        output replaced by zeros by selection, ``np.where``), "zero" (its output, or in
        gate mode top1-scaled its gate scale, multiplied by 0: NaN where the output is
        infinite)."""
        assert ablate in (None, *ABLATIONS)
        with np.errstate(over="ignore", invalid="ignore"):      # an overflow is a value here (±inf, NaN)
            return self._forward(prefix, ablate)

    def _forward(self, prefix: list[int], ablate: str | None) -> tuple[np.ndarray, int, np.ndarray]:
        ids = [self.w.bos] + list(prefix)
        h = [self.store(self.E[t] + self.P[i]) for i, t in enumerate(ids)]
        r = self._residual(h)
        g = self.matvec(self.WG, r, self.bG)
        e = int(np.argmax(g))
        if ablate == "drop":
            y = r
        else:
            W1, b1, W2 = self.experts[e]
            z = np.maximum(self.matvec(W1, r, b1), 0.0)
            o = self.matvec(W2, z)
            if self.w.gate_mode == "top1-scaled":
                o = self.store(self.r((0.0 if ablate == "zero" else self.softmax(g)[e]) * o))
            elif ablate == "zero":
                o = self.store(self.r(0.0 * o))
            if ablate == "select":
                o = np.where(np.zeros(o.shape, bool), o, 0.0)
            y = self.store(r + o)
        logits = self.matvec(self.U, y)
        return self.softmax(logits), e, logits
