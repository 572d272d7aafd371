"""A differential tester of the floating-point certificates against real runtimes.

``FloatPass(weights, dep).run_batch(...)`` (:mod:`verifier.passes.forward`; for dense weights
the dense pass, :class:`verifier.passes.dense.DeployedDensePass`) claims, for every
execution its execution model covers, per query: the deployed error 1 − Σ_{valid} p̂ lies
in [err_lo, err_hi], and where ``margin > 0`` the routed expert is ``expert``. This
module runs small adversarial models through executions that claim to be covered and
checks each claim:

* **models** (:func:`cases`): hypothesis strategies of tiny models in the layout
  (:class:`layout.Weights`: d <= 16, 0-8 heads, 1-4 experts, both gate modes, up to 6
  positions, up to 400 tokens) with queries and non-empty valid sets. Generic random
  weights are mixed with adversarial *motifs* whose parameters hypothesis draws (so
  its search and shrinking move through them): values at rounding ties, many equal
  terms in the output or attention softmax, per-head half-ulp additions to a residual
  coordinate the gate reads, subnormals amplified, huge products that cancel exactly,
  a product and its bias both at ties, gate sums and expert outputs that overflow the
  format on the way (:data:`MOTIFS`);
* **runners** (:func:`runners`), each giving per query the output distribution (as
  float64 numbers of the stored outputs) and the routed expert:

  - PyTorch written op by op (each operation one tensor op, its result stored in the
    tensor dtype): float32; bfloat16 tensors (PyTorch computes each op in float32 and
    rounds its result to bfloat16); float32 tensors with every op computed in float64
    (operands cast up, result rounded back); variants: residual head by head, one
    product over the concatenated heads then added, or one ``addmm`` of both;
    ``torch.softmax`` or ``exp(x − max) / sum``,
    matmul then bias or ``addmm``, ``torch.set_flush_denormal`` on or off (the previous
    setting restored afterwards);
  - ONNX Runtime (CPU) on :func:`layout.onnx_graph.to_onnx`, with default graph
    optimisations or none;
  - the numpy emulator :class:`audit.deployed.Deployed` in a random summation order,
    pure, mixed precision, or mixed precision with every intermediate stored;
  - **ablated** runners: some of each family with the routed expert removed in each way
    the execution model's ``ablation`` row covers (:data:`audit.deployed.ABLATIONS`: the
    expert not run, its output selected away, its output or gate scale multiplied by 0;
    ONNX Runtime on the exported graph edited so, :func:`ablated_graph`), giving the
    logits too;

* **the oracle** (:func:`compare`): each runner is paired with the deployments that
  claim to cover it (:data:`COVERS`); for every query whose row is decided (not
  ``err = [0, 1], margin = −∞``, which claims nothing), a violation is

  - ``routing``: ``margin > 0`` and the runner routed to another expert than ``expert``;
  - ``gate``: the runner routed to an expert outside the candidates (the experts that
    may win; no execution inside the gate enclosures can pick another);
  - ``error``: the runner routed to a candidate and its error lies outside
    [err_lo, err_hi] (the enclosure is the worst over the candidates, so it holds for
    every candidate; ``tests/verifier/passes/test_precision.py`` excuses any expert other than
    ``expert``, which this check does not need to);
  - for an ablated runner, against the localization check's numbers (the certificate
    computed with each query's first valid token as its object): ``ablated error``
    outside [ablated_lo, ablated_hi], ``ablated object`` 1 − p̂(o) below
    ``ablated_object_lo`` (L1's), ``ablated gap`` max_{t != o} ẑ_t − ẑ_o below
    ``ablated_gap`` (L2's), on every query whose ablation is decided
    (:func:`compare_ablated`).

**Causes** (:func:`causes`): a violation by an op-by-op PyTorch variant (or the emulator
storing its intermediates) is put down to each of its choices whose fused form alone (
``torch.softmax``, one ``addmm`` for the residual or for a bias; intermediates not
stored) removes it.

The command line (``python -m audit.differential --examples N --seed S``) surveys N
examples and prints a table per runner and deployment, and the first violation per
runner, deployment and kind; ``--shrink`` then searches again (same seed) for each
(deployment, kind, cause) found, with the first runner that showed it, and prints the
counterexample hypothesis shrinks it to and every runner violating on it. Exit status 1
when a violation was found, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import numpy as np
import scipy.sparse as sp
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from audit.deployed import ABLATIONS, ORDERS, Deployed
from layout import Expert, Head, Weights
from layout.formats import FORMATS, round_weights
from layout.weights import GATE_MODES
from tasks.errors import TaskError
from verifier.passes.floating import Deployment
from verifier.passes.dense import DeployedDensePass, is_dense
from verifier.passes.forward import FloatPass
from verifier.passes.forward import BatchResult

try:  # several failures at once, as hypothesis raises them: a builtin from Python 3.11, its backport before
    _GROUP = BaseExceptionGroup
except NameError:  # Python 3.10
    from exceptiongroup import BaseExceptionGroup as _GROUP

# --- deployments -------------------------------------------------------------------------------

#: The deployments by the name this module uses: "FMT" or "FMT+ACC" (accumulating in ACC).
DEPLOYMENTS = ("float32", "bfloat16", "bfloat16+float32", "float32+float64")


def deployment(name: str) -> Deployment:
    """The :class:`Deployment` of a name of :data:`DEPLOYMENTS`."""
    fmt, _, acc = name.partition("+")
    return Deployment.named(fmt, accumulate=acc or None)


#: Which deployments claim to cover a runtime computing in a storage format and a
#: working format: the mixed one and the pure storage format (whose bound counts every
#: rounding at the storage format's precision, so covers a wider computation too).
COVERS = {
    "float32": ("float32",),
    "bfloat16": ("bfloat16",),
    "bfloat16+float32": ("bfloat16+float32", "bfloat16"),
    "float32+float64": ("float32+float64", "float32"),
}


# --- cases -------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Case:
    """A model, its queries (one length: token ids without BOS, as ``run_batch`` takes
    them) with their valid sets (CSR), the motif that made it and the motif's parameters,
    and a seed for the emulator's summation orders. ``memo`` caches what is derived from
    the case once (deployed tensors, the ONNX model, each deployment's certificate)."""

    motif: str
    params: tuple[tuple[str, Any], ...]
    weights: Weights
    tokens: np.ndarray
    valid_ptr: np.ndarray
    valid: np.ndarray
    seed: int = 0
    memo: dict = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        w = self.weights
        shape = (f"V={len(w.vocab)} d={w.d} heads={len(w.heads)} experts={len(w.experts)} positions={w.n_positions} "
                 f"{w.gate_mode}")
        params = " ".join(f"{k}={_short(v)}" for k, v in self.params)
        return f"motif {self.motif} [{params}] ({shape}); queries {self.tokens.tolist()}"

    def valid_of(self, i: int) -> np.ndarray:
        return self.valid[self.valid_ptr[i]:self.valid_ptr[i + 1]]


def _short(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and math.isfinite(v) and float(np.log2(abs(v))).is_integer():
            return ("-" if v < 0 else "") + f"2^{int(np.log2(abs(v)))}"
        return f"{v:.9g}"
    return str(v)


def _csr(a: np.ndarray) -> sp.csr_matrix:
    m = sp.csr_matrix(np.asarray(a, np.float64))
    m.eliminate_zeros()
    m.sort_indices()
    return m


def dense_model(E, P, heads, W_G, b_G, experts, U, gate_mode: str = "top1") -> Weights:
    """:class:`Weights` from dense arrays (heads: (W_Q, W_K, W_V, W_O); experts: (W_1, b_1,
    W_2)); zeros are not stored; tokens are named t0, t1, ...; no expert names a task."""
    U = np.asarray(U, np.float64)
    w = Weights(tuple(f"t{i}" for i in range(U.shape[0])), _csr(E), _csr(P),
                tuple(Head(*map(_csr, h)) for h in heads), _csr(W_G), np.asarray(b_G, np.float64).copy(),
                tuple(Expert(_csr(w1), np.asarray(b1, np.float64).copy(), _csr(w2)) for w1, b1, w2 in experts),
                _csr(U), ("",) * len(experts), gate_mode)
    w.validate("differential case")
    return w


def _valid_csr(sets: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.concatenate([[0], np.cumsum([len(s) for s in sets])]).astype(np.int64)
    return ptr, np.array([t for s in sets for t in s], np.int64)


@st.composite
def _queries(draw, V: int, n_pos: int, valid: list[int] | None = None, max_rows: int = 3):
    """(tokens (n, p), valid_ptr, valid) for 1..max_rows prefixes of one length p <= n_pos − 1."""
    p = draw(st.integers(1, n_pos - 1))
    n = draw(st.integers(1, max_rows))
    tokens = np.array([[draw(st.integers(0, V - 1)) for _ in range(p)] for _ in range(n)], np.int64)
    if valid is None:
        sets = [sorted(draw(st.sets(st.integers(0, V - 1), min_size=1, max_size=min(V, 6)))) for _ in range(n)]
    else:
        sets = [sorted(valid)] * n
    return (tokens, *_valid_csr(sets))


def _case(draw, motif: str, params: dict, weights: Weights, valid: list[int] | None = None, max_rows: int = 3) -> Case:
    tokens, ptr, vals = draw(_queries(len(weights.vocab), weights.n_positions, valid, max_rows))
    return Case(motif, tuple(params.items()), weights, tokens, ptr, vals, draw(st.integers(0, 2 ** 16)))


def make_case(weights: Weights, prefixes: list[list[int]], valid_sets: list[list[int]], motif: str = "given",
              params: dict | None = None, seed: int = 0) -> Case:
    """A case built directly: prefixes of one length (token ids, without BOS), one valid set each."""
    tokens = np.array(prefixes, np.int64).reshape(len(prefixes), -1)
    ptr, vals = _valid_csr([sorted(v) for v in valid_sets])
    return Case(motif, tuple((params or {}).items()), weights, tokens, ptr, vals, seed)


#: Significands on and between the grids: bfloat16 keeps 8 bits (1 + 2^-8 is a tie there),
#: float32 24 (1 + 2^-24 a tie); 1 + 3·2^-8 and 1 + 3·2^-24 are ties rounding up.
_MANTISSAS = (1.0, 1.5, 1.25, 3.0, 1.0 + 2.0 ** -7, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -23,
              1.0 + 2.0 ** -24, 1.0 + 3 * 2.0 ** -24)


def grid_values(min_exp: int = -10, max_exp: int = 4) -> st.SearchStrategy[float]:
    """±m·2^k, m from :data:`_MANTISSAS`: values on the formats' grids and at their ties."""
    return st.builds(lambda s, m, k: s * m * 2.0 ** k, st.sampled_from((1.0, -1.0)), st.sampled_from(_MANTISSAS),
                     st.integers(min_exp, max_exp))


def entries() -> st.SearchStrategy[float]:
    """A weight: zero (often), a grid or tie value, or any float in [−4, 4]."""
    return st.one_of(st.just(0.0), grid_values(),
                     st.floats(-4.0, 4.0, allow_nan=False, allow_infinity=False, allow_subnormal=False))


# --- motifs ------------------------------------------------------------------------------------


def _generic(draw, el: st.SearchStrategy[float], least_d: int, name: str) -> Case:
    """A model of generic shapes (vocabulary, width, positions, heads, experts and their widths
    drawn small) whose every entry is drawn from ``el``, ``least_d`` the smallest width."""
    V, d, n_pos = draw(st.integers(2, 10)), draw(st.integers(least_d, 6)), draw(st.integers(2, 5))
    H, K = draw(st.integers(0, 3)), draw(st.integers(1, 4))

    def a(*shape):
        return draw(arrays(np.float64, shape, elements=el))

    heads = []
    for _ in range(H):
        dh, dv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        heads.append((a(dh, d), a(dh, d), a(dv, d), a(d, dv)))
    experts = [(a(width, d), a(width), a(d, width)) for width in (draw(st.integers(1, 3)) for _ in range(K))]
    gate_mode = draw(st.sampled_from(GATE_MODES))
    w = dense_model(a(V + 1, d), a(n_pos, d), heads, a(K, d), a(K), experts, a(V, d), gate_mode)
    return _case(draw, name, {}, w)


@st.composite
def random_models(draw) -> Case:
    """Generic weights: every entry from :func:`entries` (zeros, grid and tie values, floats)."""
    return _generic(draw, entries(), 1, "random")


def nonzero_entries() -> st.SearchStrategy[float]:
    """A weight that is never zero: a grid or tie value, or any non-zero float in [−4, 4]."""
    return st.one_of(grid_values(), st.floats(-4.0, 4.0, allow_nan=False, allow_infinity=False,
                                              allow_subnormal=False).filter(lambda x: x != 0.0))


@st.composite
def dense_models(draw) -> Case:
    """Dense weights (every entry non-zero, as trained weights are), which the verifier's dense
    pass certifies (:mod:`verifier.passes.dense`); values on the grids and at ties among them."""
    return _generic(draw, nonzero_entries(), 2, "dense")


def _empty_expert(d: int):
    return (np.zeros((1, d)), np.zeros(1), np.zeros((d, 1)))


def _params(**kw) -> dict:
    return kw


def softmax_equal_model(V: int, m: int, a: float, gap: float) -> Weights:
    """The output softmax over many equal terms: tokens 0..m−1 have logit a, the other
    V − m logit a − gap (d = 1, a constant coordinate read by U; no heads, an expert of
    output 0). With m >= 257 (odd, rounding up) the sum of m equal exps is not a bfloat16
    number, and stored it makes every output too small (class 1)."""
    U = np.full((V, 1), a - gap)
    U[:m, 0] = a
    return dense_model(np.ones((V + 1, 1)), np.zeros((2, 1)), [], np.zeros((1, 1)), np.zeros(1), [_empty_expert(1)], U)


@st.composite
def softmax_equal(draw) -> Case:
    """:func:`softmax_equal_model`: few equal terms, many (100..400), or just past 2^8 (the
    first counts bfloat16 cannot hold: 257..271); the valid set is the equal group or the rest."""
    m = draw(st.one_of(st.integers(1, 16), st.integers(100, 400), st.integers(257, 271)))
    V = min(400, m + draw(st.integers(0, 20)))
    a = draw(st.sampled_from((0.0, 1.0, -1.0, 0.5, 3.0, -7.25)))
    gap = draw(st.one_of(st.sampled_from((200.0, 100.0, 20.0, 1.0)), st.floats(0.0, 30.0, allow_subnormal=False)))
    first = draw(st.booleans()) or m == V
    valid = list(range(m)) if first else list(range(m, V))
    return _case(draw, "softmax-equal", _params(V=V, m=m, a=a, gap=gap, valid="equal" if first else "rest"),
                 softmax_equal_model(V, m, a, gap), valid, max_rows=1)


@st.composite
def attention_equal(draw) -> Case:
    """Attention over up to 6 positions with equal scores (queries and keys read only the
    constant coordinate) or not, values on the grids and at their ties, heads writing
    into the coordinate the logits read."""
    n_pos, V, H = draw(st.integers(2, 6)), draw(st.integers(2, 6)), draw(st.integers(1, 4))
    g = grid_values(-6, 3)
    E = np.zeros((V + 1, 2))
    E[:, 0], E[:, 1] = 1.0, [draw(g) for _ in range(V + 1)]
    P = np.zeros((n_pos, 2))
    P[:, 1] = [draw(st.one_of(st.just(0.0), g)) for _ in range(n_pos)]
    equal = draw(st.booleans())
    col = 0 if equal else 1
    heads = []
    for _ in range(H):
        WQ, WK = np.zeros((1, 2)), np.zeros((1, 2))
        WQ[0, col], WK[0, col] = draw(g), draw(g)
        heads.append((WQ, WK, np.array([[0.0, 1.0]]), np.array([[0.0], [draw(g)]])))
    U = np.array([[draw(g), draw(g)] for _ in range(V)])
    w = dense_model(E, P, heads, np.zeros((1, 2)), np.zeros(1), [_empty_expert(2)], U)
    return _case(draw, "attention-equal", _params(equal_scores=equal, heads=H), w)


def _routing_experts(target: int, L: float, out: int, d: int):
    """Two experts of constant output ±L into coordinate ``out`` (target: +L, the valid
    token 0 likely; the other: −L), so the routing moves the error."""
    experts = []
    for k in range(2):
        W2 = np.zeros((d, 1))
        W2[out, 0] = L if k == target else -L
        experts.append((np.zeros((1, d)), np.ones(1), W2))
    return experts


def _reading_0(V: int, d: int, out: int) -> np.ndarray:
    """U whose token 0 reads coordinate ``out`` with weight 1 (the others read nothing)."""
    U = np.zeros((V, d))
    U[0, out] = 1.0
    return U


def residual_heads_model(p: int, heads: int, base: float, half_ulps: int, gate_scale: float,
                         competitor_half_ulps: int, target: int, L: float, V: int = 2, n_pos: int = 2,
                         gate_mode: str = "top1") -> Weights:
    """``heads`` heads each add δ = half_ulps·η to the residual coordinate 1, which holds
    ``base``; η = 2^(e − p) is half the ulp of base in a format of p significand bits (8 for
    bfloat16, 24 for float32; 2^e <= base < 2^(e+1)). Coordinate 0 holds 1 and is each
    head's value; queries and keys are 0. Added head by head with each result stored, each
    addition of one half-ulp is a tie and the coordinate stays ``base`` (ties to even,
    for a base whose last significand bit is 0; class 2); the exact value is base + heads·δ.
    The gate's expert ``target`` reads coordinate 1 with ``gate_scale`` s, against the
    other expert's bias s·(base ± competitor_half_ulps·η) (the sign of half_ulps): a
    competitor between the stored and the exact value (or equal to the stored one, argmax
    taking the first) is routed to, while the exact pass routes to ``target``. The
    experts write ±L into coordinate 2, which token 0 reads."""
    E = np.zeros((V + 1, 3))
    E[:, 0], E[:, 1] = 1.0, base
    eta = 2.0 ** (math.floor(math.log2(base)) - p)
    head = (np.zeros((1, 3)), np.zeros((1, 3)), np.array([[1.0, 0.0, 0.0]]),
            np.array([[0.0], [half_ulps * eta], [0.0]]))
    W_G = np.zeros((2, 3))
    W_G[target, 1] = gate_scale
    b_G = np.zeros(2)
    b_G[1 - target] = gate_scale * (base + np.sign(half_ulps) * competitor_half_ulps * eta)
    return dense_model(E, np.zeros((n_pos, 3)), [head] * heads, W_G, b_G, _routing_experts(target, L, 2, 3),
                       _reading_0(V, 3, 2), gate_mode)


@st.composite
def residual_heads(draw) -> Case:
    """:func:`residual_heads_model` with drawn parameters (many heads often: a flip needs
    the lost half-ulps to exceed the certificate's radius of about 3 of them, and the
    competitor within 4 half-ulps of the stored value); valid: token 0."""
    H = draw(st.one_of(st.integers(1, 8), st.integers(6, 8)))
    kw = _params(p=draw(st.sampled_from((8, 24))), heads=H,
                 base=draw(st.sampled_from((1.0, 1.5, 1.0 + 2.0 ** -7))) * 2.0 ** draw(st.integers(-2, 2)),
                 half_ulps=draw(st.sampled_from((1, 1, 3, -1))), gate_scale=2.0 ** draw(st.integers(0, 4)),
                 competitor_half_ulps=draw(st.integers(0, min(H, 4))), target=draw(st.integers(0, 1)),
                 L=float(draw(st.integers(1, 8))), V=draw(st.integers(2, 4)), n_pos=draw(st.integers(2, 4)),
                 gate_mode=draw(st.sampled_from(GATE_MODES)))
    return _case(draw, "residual-heads", kw, residual_heads_model(**kw), [0])


def bias_tie_model(p: int, where: str, base: float, tie_half_ulps: int, bias_half_ulps: int, scale: float,
                   competitor_half_ulps: int, target: int, L: float, cancel: bool = False, V: int = 2,
                   gate_mode: str = "top1") -> Weights:
    """A product at a tie of p significand bits and a bias at another: the residual holds
    base (coordinate 0) and tie_half_ulps·base·2^-p (coordinate 1); a row reads both with
    ``scale`` s, so its product is s·base·(1 + tie_half_ulps·2^-p), a tie for odd
    tie_half_ulps, and its bias is bias_half_ulps·s·base·2^-p. Stored after the product and
    stored again, the row rounds twice. In the gate (``where`` "gate": expert ``target``'s
    row, against the other's bias s·base·(1 + competitor_half_ulps·2^-p)) or in the one
    expert's first layer (``where`` "expert", minus s·base when ``cancel``), whose neuron
    writes L/(s·base) times itself into coordinate 2, which token 0 reads."""
    half = base * 2.0 ** -p
    E = np.zeros((V + 1, 3))
    E[:, 0], E[:, 1] = base, tie_half_ulps * half
    if where == "gate":
        W_G = np.zeros((2, 3))
        W_G[target, :2] = scale
        b_G = np.zeros(2)
        b_G[target] = bias_half_ulps * scale * half
        b_G[1 - target] = scale * base * (1 + competitor_half_ulps * 2.0 ** -p)
        experts = _routing_experts(target, L, 2, 3)
    else:
        W2 = np.zeros((3, 1))
        W2[2, 0] = L / (scale * base)
        b1 = bias_half_ulps * scale * half - (scale * base if cancel else 0.0)
        experts = [(np.array([[scale, scale, 0.0]]), np.array([b1]), W2)]
        W_G, b_G = np.zeros((1, 3)), np.zeros(1)
    return dense_model(E, np.zeros((2, 3)), [], W_G, b_G, experts, _reading_0(V, 3, 2), gate_mode)


@st.composite
def bias_ties(draw) -> Case:
    """:func:`bias_tie_model` with drawn parameters; valid: token 0."""
    kw = _params(p=draw(st.sampled_from((8, 24))), where=draw(st.sampled_from(("gate", "expert"))),
                 base=2.0 ** draw(st.integers(-2, 2)), tie_half_ulps=draw(st.sampled_from((1, 3))),
                 bias_half_ulps=draw(st.sampled_from((1, 3, -1))), scale=2.0 ** draw(st.integers(0, 3)),
                 competitor_half_ulps=draw(st.integers(0, 8)), target=draw(st.integers(0, 1)),
                 L=float(draw(st.integers(1, 8))), cancel=draw(st.booleans()), V=draw(st.integers(2, 4)),
                 gate_mode=draw(st.sampled_from(GATE_MODES)))
    return _case(draw, "bias-tie", kw, bias_tie_model(**kw), [0])


def subnormal_model(tiny: float, big: float, where: str, logit_scale: float, competitor: float = 0.5, V: int = 2,
                    gate_mode: str = "top1") -> Weights:
    """A subnormal ``tiny`` times a large ``big`` (their product in the normal range): tiny
    in an activation (``where`` "E": the embedding's coordinate 1, read by the expert's
    W_1 with big), in a weight (``where`` "W_1": W_1 reads coordinate 0, which holds big,
    with tiny), or in the gate (``where`` "W_G": expert 0's row reads big with tiny,
    against expert 1's bias competitor·tiny·big). The neuron's output is scaled to about
    ``logit_scale`` in coordinate 2, which token 0 reads; flushed to zero, it is 0."""
    E = np.zeros((V + 1, 3))
    E[:, 0] = big if where == "W_1" else 1.0
    E[:, 1] = tiny if where == "E" else big
    if where == "W_G":
        W_G = np.array([[0.0, tiny, 0.0], [0.0, 0.0, 0.0]])
        b_G = np.array([0.0, competitor * tiny * big])
        experts = _routing_experts(0, logit_scale, 2, 3)
    else:
        W1 = np.array([[tiny, 0.0, 0.0]]) if where == "W_1" else np.array([[0.0, big, 0.0]])
        W2 = np.zeros((3, 1))
        W2[2, 0] = logit_scale / (tiny * big)
        experts = [(W1, np.zeros(1), W2)]
        W_G, b_G = np.zeros((1, 3)), np.zeros(1)
    return dense_model(E, np.zeros((2, 3)), [], W_G, b_G, experts, _reading_0(V, 3, 2), gate_mode)


@st.composite
def subnormals(draw) -> Case:
    """:func:`subnormal_model`: tiny = m·2^te, te in −146..−118 (below 2^-126, the normal
    range of both formats; at least float32's smallest subnormal), big = 2^ta with
    2^(te + ta) in 2^-20..2^3; valid: token 0."""
    te = draw(st.integers(-146, -118))
    ta = draw(st.integers(max(0, -20 - te), min(126, 3 - te)))
    kw = _params(tiny=draw(st.sampled_from((1.0, 1.5, 3.0))) * 2.0 ** te, big=2.0 ** ta,
                 where=draw(st.sampled_from(("E", "W_1", "W_G"))), logit_scale=2.0 ** draw(st.integers(-2, 3)),
                 competitor=draw(st.sampled_from((0.5, 0.75, -0.5))), V=draw(st.integers(2, 4)),
                 gate_mode=draw(st.sampled_from(GATE_MODES)))
    return _case(draw, "subnormal", kw, subnormal_model(**kw), [0])


def cancel_model(big: float, where: str, signal: float, token_signals: tuple[float, ...], reads: tuple[float, ...],
                 bias: float, n_pos: int = 2, gate_mode: str = "top1") -> Weights:
    """Coordinates 0 and 2 hold 1; a row reads them with +big and −big (an exact 0) beside
    a small signal: in the logits (``where`` "U": every token, which also reads coordinate
    1, the token's own ``token_signals`` value, with ``reads``), in the gate ("W_G": expert
    0's row adds ``signal``·coordinate 1, against expert 1's bias), in the expert's first
    layer ("W_1", with ``bias``; the neuron is written into coordinate 3, which token 0
    reads), or two heads writing ±big into coordinate 3 ("W_O", which holds ``signal``
    and every token reads with ``reads``): an order adding ±big first loses the signal."""
    V, d = len(token_signals), 4
    E = np.zeros((V + 1, d))
    E[:, 0], E[:, 2] = 1.0, 1.0
    E[:V, 1] = token_signals
    U = _reading_0(V, d, 3)
    U[:, 1] = reads
    W_G, b_G, heads, experts = np.zeros((1, d)), np.zeros(1), [], [_empty_expert(d)]
    if where == "U":
        U[:, 0], U[:, 2] = big, -big
    elif where == "W_G":
        W_G = np.array([[big, signal, -big, 0.0], [0.0, 0.0, 0.0, 0.0]])
        b_G = np.array([0.0, bias])
        experts = _routing_experts(0, 4.0, 3, d)
    elif where == "W_1":
        W2 = np.zeros((d, 1))
        W2[3, 0] = 1.0
        experts = [(np.array([[big, signal, -big, 0.0]]), np.array([bias]), W2)]
    else:
        up = (np.zeros((1, d)), np.zeros((1, d)), np.array([[1.0, 0, 0, 0]]), np.array([[0.0], [0.0], [0.0], [big]]))
        heads = [up, (up[0], up[1], up[2], -up[3])]
        U[:, 3] = reads
        E[:, 3] = signal
    return dense_model(E, np.zeros((n_pos, d)), heads, W_G, b_G, experts, U, gate_mode)


@st.composite
def cancelling(draw) -> Case:
    """:func:`cancel_model` with big = 2^k, k in 0..100, signals on the grids."""
    V = draw(st.integers(2, 5))
    g = grid_values(-3, 2)
    kw = _params(big=2.0 ** draw(st.integers(0, 100)), where=draw(st.sampled_from(("U", "W_G", "W_1", "W_O"))),
                 signal=draw(g), token_signals=tuple(draw(g) for _ in range(V)),
                 reads=tuple(draw(grid_values(-2, 2)) for _ in range(V)), bias=draw(g),
                 n_pos=draw(st.integers(2, 4)), gate_mode=draw(st.sampled_from(GATE_MODES)))
    return _case(draw, "cancel", kw, cancel_model(**kw))


def overflow_model(a: float, gate_gap: float, out: float, read: float, gate_mode: str = "top1",
                   V: int = 2, loser: float | None = None) -> Weights:
    """Values near the formats' largest (about 2^128 in float32 and bfloat16 alike).
    Coordinates 0 to 3 hold 1; expert 1's gate row reads them with +a, +a, −a, −a (its
    score is exactly 0, but a sum adding a + a first overflows where 2a is beyond the
    largest value, and routes there), expert 0's bias is ``gate_gap``. Each expert has two
    neurons of activity 1 writing ``out`` (expert 0) or ``loser`` (expert 1; default −out)
    into coordinate 4, so W_2·a = 2·out may overflow where out does not (and, in gate mode
    top1-scaled, c·W_2·a may be finite where W_2·a is not); token 0 reads coordinate 4
    with ``read``. Removing the expert by multiplying its output by 0 then gives NaN (0·∞)."""
    d = 5
    E = np.zeros((V + 1, d))
    E[:, :4] = 1.0

    def expert(v):
        W2 = np.zeros((d, 2))
        W2[4, :] = v
        return np.zeros((2, d)), np.ones(2), W2

    U = np.zeros((V, d))
    U[0, 4] = read
    return dense_model(E, np.zeros((2, d)), [], np.array([[0.0] * d, [a, a, -a, -a, 0.0]]),
                       np.array([gate_gap, 0.0]), [expert(out), expert(-out if loser is None else loser)], U, gate_mode)


@st.composite
def overflowing(draw) -> Case:
    """:func:`overflow_model`: a = m·2^k or 0 and out = m·2^k, k in {127, 126, 124, 120}
    (m·2^127 overflows when doubled), read = 2^-j so that the logit is about 2^(k + 1 − j);
    valid: token 0."""
    big = st.builds(lambda m, k: m * 2.0 ** k, st.sampled_from((1.0, 1.5, 1.25)), st.sampled_from((127, 126, 124, 120)))
    kw = _params(a=draw(st.one_of(big, st.just(0.0))),
                 gate_gap=draw(st.sampled_from((2.0 ** 110, 1.0, 0.25, 4.0, 2.0 ** 20))), out=draw(big),
                 read=2.0 ** -draw(st.integers(118, 132)), gate_mode=draw(st.sampled_from(GATE_MODES)),
                 V=draw(st.integers(2, 3)), loser=draw(st.one_of(st.just(None), big)))
    return _case(draw, "overflow", kw, overflow_model(**kw), [0], max_rows=1)


#: Motif name -> strategy of :class:`Case`.
MOTIFS: dict[str, Callable[[], st.SearchStrategy[Case]]] = {
    "random": random_models,
    "dense": dense_models,
    "softmax-equal": softmax_equal,
    "attention-equal": attention_equal,
    "residual-heads": residual_heads,
    "bias-tie": bias_ties,
    "subnormal": subnormals,
    "cancel": cancelling,
    "overflow": overflowing,
}


def cases(motifs: Iterable[str] | None = None) -> st.SearchStrategy[Case]:
    """Cases of the named motifs (all by default), hypothesis choosing among them."""
    names = list(MOTIFS) if motifs is None else list(motifs)
    unknown = [m for m in names if m not in MOTIFS]
    if unknown:
        raise ValueError(f"unknown motif {unknown[0]!r}; motifs: {', '.join(MOTIFS)}")
    return st.one_of(*[MOTIFS[m]() for m in names])


# --- runners -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Runner:
    """A runtime configuration: ``run(case) -> (probs (n, V) float64, experts (n,))``;
    ``computes`` is "FMT" or "FMT+ACC" (storage and working format), whose
    :data:`COVERS` entry names the deployments claiming to cover it. An ablated runner
    (``ablation``: how it removes the routed expert) returns the logits (n, V) too, and is
    held to the certificate's ablated claims (:func:`compare_ablated`)."""

    name: str
    family: str
    computes: str
    run: Callable[[Case], tuple]
    config: Any = None
    ablation: str | None = None

    @property
    def deployments(self) -> tuple[str, ...]:
        return COVERS[self.computes]


def _ids(case: Case) -> np.ndarray:
    n = case.tokens.shape[0]
    return np.concatenate([np.full((n, 1), case.weights.bos, np.int64), case.tokens], axis=1)


# PyTorch

@dataclass(frozen=True)
class TorchConfig:
    """``dtype``: "float32", "bfloat16" (each op in float32, result rounded to bfloat16)
    or "float32+float64" (float32 tensors, each op computed in float64 and rounded back);
    ``residual``: "per-head" (r = r + W_O^m c_m per head, each stored), "concat" (one
    product over the concatenated heads, stored, then h added) or "fused" (one addmm of h
    and that product); ``softmax``: "torch" (torch.softmax) or "explicit" (exp(x − max) /
    sum, each op stored); ``bias`` (the gate's and the experts' first layers): "add"
    (matmul, then the bias added) or "addmm"; ``flush``: torch.set_flush_denormal(True);
    ``onednn``: products through oneDNN (PyTorch's default where it applies) or through
    PyTorch's own kernels (oneDNN off: ``torch.backends.mkldnn.flags(enabled=False)``;
    oneDNN builds a kernel per new shape, about 10 ms, so most variants run without it);
    ``ablation``: the model with the routed expert removed (:data:`audit.deployed.ABLATIONS`:
    "drop", y = r; "select", its output replaced by zeros with ``torch.where``; "zero",
    its output, or its gate scale in gate mode top1-scaled, multiplied by 0), the run then
    also returning the logits."""

    dtype: str
    residual: str = "per-head"
    softmax: str = "torch"
    bias: str = "add"
    flush: bool = False
    onednn: bool = False
    ablation: str | None = None

    @property
    def name(self) -> str:
        return (f"torch:{self.dtype}:{self.residual}:{self.softmax}:{self.bias}" + (":flush" if self.flush else "")
                + (":onednn" if self.onednn else "") + (f":ablate-{self.ablation}" if self.ablation else ""))

    @property
    def computes(self) -> str:
        return {"float32": "float32", "bfloat16": "bfloat16+float32", "float32+float64": "float32+float64"}[self.dtype]


def _torch():
    import torch

    return torch


def flushing() -> bool:
    """Whether PyTorch currently flushes subnormals (a subnormal times 1 is 0)."""
    torch = _torch()
    tiny = torch.tensor([2.0 ** -140], dtype=torch.float32)
    return bool((tiny * 1.0).item() == 0.0)


@contextmanager
def flush_denormal(on: bool):
    """``torch.set_flush_denormal(on)`` for the block, the previous setting restored after."""
    torch = _torch()
    before = flushing()
    torch.set_flush_denormal(on)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


@contextmanager
def _one_thread():
    """One intra-op thread for the block (the previous count restored after): on a loaded
    machine two threads' synchronisation made these tiny ops up to 20 times slower. (The
    tensors are far below PyTorch's grain for splitting an op between threads, so the
    summation orders are those of one thread either way.)"""
    torch = _torch()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _onednn(on: bool):
    """oneDNN (mkldnn) for the block or not; the warning its flags print about Intel GPUs silenced."""
    torch = _torch()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*TF32.*")
        with torch.backends.mkldnn.flags(enabled=on):
            yield


class _Ops:
    """Each call one tensor operation whose result is stored in the tensors' dtype; with
    ``wide``, float32 operands are cast to float64, the op computed there, and the result
    rounded back to float32 (one rounding of a float64 result)."""

    def __init__(self, torch, wide: bool) -> None:
        self.torch, self.wide = torch, wide

    def __call__(self, f, *xs):
        if not self.wide:
            return f(*xs)
        T = self.torch.Tensor
        return f(*(x.double() if isinstance(x, T) else x for x in xs)).float()


def _torch_weights(case: Case, dtype: str):
    torch = _torch()
    key = ("torch", dtype)
    if key not in case.memo:
        fmt = "bfloat16" if dtype == "bfloat16" else "float32"
        w = round_weights(case.weights, FORMATS[fmt])          # (F1): the deployed values, exact in the dtype
        tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32

        def t(M):
            a = M.toarray() if sp.issparse(M) else np.asarray(M)
            return torch.from_numpy(np.asarray(a, np.float64)).to(tdt)

        case.memo[key] = {
            "E": t(w.E), "P": t(w.P), "heads": [tuple(t(M) for M in (h.W_Q, h.W_K, h.W_V, h.W_O)) for h in w.heads],
            "W_G": t(w.W_G), "b_G": t(w.b_G), "experts": [(t(e.W_1), t(e.b_1), t(e.W_2)) for e in w.experts],
            "U": t(w.U)}
    return case.memo[key]


def run_torch(cfg: TorchConfig, case: Case) -> tuple:
    """The layout's forward pass op by op in PyTorch (see :class:`TorchConfig`); weights
    rounded to the format as deployed (F1); all queries at once (one length, no padding).
    (probs, experts), and the logits too for an ablated configuration."""
    torch = _torch()
    W = _torch_weights(case, cfg.dtype)
    o = _Ops(torch, cfg.dtype == "float32+float64")
    with flush_denormal(cfg.flush), _onednn(cfg.onednn), _one_thread(), torch.no_grad():
        probs, experts, logits = _torch_forward(torch, o, cfg, W, torch.from_numpy(_ids(case)), case.weights.gate_mode)
    return (probs, experts) if cfg.ablation is None else (probs, experts, logits)


def _softmax(torch, o: _Ops, cfg: TorchConfig, x):
    """Softmax over the last axis: torch.softmax, or exp(x − max) / sum with each result stored."""
    if cfg.softmax == "torch":
        return o(lambda t: torch.softmax(t, dim=-1), x)
    m = x.max(dim=-1, keepdim=True).values
    e = o(torch.exp, o(torch.sub, x, m))
    return o(torch.div, e, o(lambda t: t.sum(dim=-1, keepdim=True), e))


def _affine(torch, o: _Ops, cfg: TorchConfig, x, Wt, b):
    """x·Wᵀ + b: a matmul then an addition (each stored), or one addmm."""
    if cfg.bias == "addmm":
        return o(torch.addmm, b, x, Wt.T)
    return o(torch.add, o(torch.matmul, x, Wt.T), b)


def _torch_forward(torch, o: _Ops, cfg: TorchConfig, W: dict, ids, gate_mode: str):
    n, T = ids.shape
    h = o(torch.add, W["E"][ids], W["P"][:T])                                     # (n, T, d)
    last = h[:, -1]
    r, cs = last, []
    for WQ, WK, WV, WO in W["heads"]:
        q = o(torch.matmul, last, WQ.T)                                           # (n, d_h)
        k = o(torch.matmul, h, WK.T)                                              # (n, T, d_h)
        s = o(torch.matmul, k, q[:, :, None])[:, :, 0]                            # (n, T)
        a = _softmax(torch, o, cfg, s)
        v = o(torch.matmul, h, WV.T)                                              # (n, T, d_v)
        c = o(torch.matmul, a[:, None, :], v)[:, 0]                               # (n, d_v)
        if cfg.residual == "per-head":
            r = o(torch.add, r, o(torch.matmul, c, WO.T))
        else:
            cs.append((c, WO))
    if cs:
        C = torch.cat([c for c, _ in cs], dim=1)
        WOc = torch.cat([w for _, w in cs], dim=1)
        r = o(torch.addmm, last, C, WOc.T) if cfg.residual == "fused" else o(torch.add, last, o(torch.matmul, C, WOc.T))
    g = _affine(torch, o, cfg, r, W["W_G"], W["b_G"])                              # (n, K)
    e = torch.argmax(g, dim=1)
    if cfg.ablation == "drop":                                                    # the expert not run: y = r
        y = r
    else:
        out = torch.zeros_like(r)
        pg = _softmax(torch, o, cfg, g) if gate_mode == "top1-scaled" else None
        for k in torch.unique(e).tolist():
            rows = torch.nonzero(e == k, as_tuple=True)[0]
            W1, b1, W2 = W["experts"][k]
            z = torch.relu(_affine(torch, o, cfg, r[rows], W1, b1))
            ok = o(torch.matmul, z, W2.T)
            if pg is not None:                                                    # "zero": the gate scale set to 0
                ok = o(torch.mul, ok, torch.zeros_like(pg[rows, k][:, None]) if cfg.ablation == "zero"
                       else pg[rows, k][:, None])
            elif cfg.ablation == "zero":
                ok = o(torch.mul, ok, torch.zeros((), dtype=ok.dtype))
            if cfg.ablation == "select":
                ok = torch.where(torch.zeros_like(ok, dtype=torch.bool), ok, torch.zeros_like(ok))
            out[rows] = ok
        y = o(torch.add, r, out)
    logits = o(torch.matmul, y, W["U"].T)
    probs = _softmax(torch, o, cfg, logits)
    return (probs.to(torch.float64).numpy(), e.numpy().astype(np.int64),
            logits.to(torch.float64).numpy())


def torch_configs() -> list[TorchConfig]:
    """Per dtype: every combination of residual, softmax and bias without oneDNN; two of
    them (the most op-by-op and the most fused) also with flushing and with oneDNN, and
    with the routed expert removed in each way of :data:`audit.deployed.ABLATIONS`."""
    out = []
    for dt in ("float32", "bfloat16", "float32+float64"):
        out += [TorchConfig(dt, res, sm, b) for res in ("per-head", "concat", "fused") for sm in ("torch", "explicit")
                for b in ("add", "addmm")]
        for extra in ({"flush": True}, {"onednn": True}):
            out += [TorchConfig(dt, "per-head", "explicit", "add", **extra),
                    TorchConfig(dt, "fused", "torch", "addmm", **extra)]
        for way in ABLATIONS:
            out += [TorchConfig(dt, "per-head", "explicit", "add", ablation=way),
                    TorchConfig(dt, "fused", "torch", "addmm", ablation=way)]
    return out


# ONNX Runtime

def run_onnxruntime(optimise: bool, case: Case, ablation: str | None = None) -> tuple:
    """ONNX Runtime's CPU provider on :func:`layout.onnx_graph.to_onnx` (float32), with the
    default graph optimisations or none (``ORT_DISABLE_ALL``); one thread. (Its
    ``session.set_denormal_as_zero`` is not a variant: it sets the thread pool's threads,
    and these tiny graphs run on the caller's thread, whose outputs it did not change.)
    With ``ablation``, on the graph edited to remove the routed expert
    (:func:`ablated_graph`), returning the logits too."""
    import onnxruntime as ort

    from layout.onnx_graph import to_onnx

    if "onnx" not in case.memo:
        case.memo["onnx"] = to_onnx(case.weights, "differential case").SerializeToString()
    graph = case.memo["onnx"] if ablation is None else ablated_graph(case.memo["onnx"], ablation)
    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimise
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    session = ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])
    if ablation is None:
        probs, expert, _ = session.run(None, {"tokens": case.tokens.astype(np.int64)})
        return probs.astype(np.float64), expert.astype(np.int64)
    probs, expert, logits = session.run(["probs", "expert", "logits"], {"tokens": case.tokens.astype(np.int64)})
    return probs.astype(np.float64), expert.astype(np.int64), logits.astype(np.float64)


def ablated_graph(model: bytes, ablation: str) -> bytes:
    """The exported graph (:func:`layout.onnx_graph.to_onnx`) with the routed expert removed
    and the logits as a third output: "drop", y = r (the output sum an ``Identity`` of r);
    "select", the ``Where`` that keeps the routed expert's neurons keeps none (its mask
    ``And``-ed with false: every neuron an exact 0, the output W_2·0 = 0); "zero", the
    expert's output multiplied by 0 (gate mode top1: a ``Mul`` before the output sum;
    top1-scaled: the gate scale's ``Mul`` by 0 in place of c)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m = onnx.load_from_string(model)
    g = m.graph
    nodes = {n.name: n for n in g.node}
    add_y = nodes["Add_y"]
    if ablation == "select":
        g.initializer.append(numpy_helper.from_array(np.zeros(1, bool), "ablate_false"))
    if ablation == "zero":
        g.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), "ablate_zero"))
    new = None
    if ablation == "drop":
        r = add_y.input[0]
        add_y.op_type = "Identity"
        del add_y.input[:]
        add_y.input.append(r)
    elif ablation == "select":
        where = nodes["Where_z"]
        new = helper.make_node("And", [where.input[0], "ablate_false"], ["ablate_mask"], name="And_ablate_mask")
        where.input[0] = "ablate_mask"
        before = where
    elif ablation == "zero":
        if "Mul_expert_scaled" in nodes:
            nodes["Mul_expert_scaled"].input[1] = "ablate_zero"
        else:
            new = helper.make_node("Mul", [add_y.input[1], "ablate_zero"], ["ablate_out"], name="Mul_ablate_out")
            add_y.input[1] = "ablate_out"
            before = add_y
    else:
        raise ValueError(f"unknown ablation {ablation!r}")
    if new is not None:
        at = list(g.node).index(before)
        g.node.insert(at, new)
    g.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", "V"]))
    onnx.checker.check_model(m)
    return m.SerializeToString()


# numpy emulator

@dataclass(frozen=True)
class EmulatorConfig:
    """:class:`audit.deployed.Deployed` in ``fmt`` (sums in ``acc``), flushing subnormals
    (``daz``) or not, every intermediate stored (``stored``) or not; the summation order
    and its permutations come from the case's seed."""

    fmt: str
    acc: str | None = None
    stored: bool = False
    daz: bool = False
    ablation: str | None = None

    @property
    def computes(self) -> str:
        return self.fmt + (f"+{self.acc}" if self.acc else "")

    @property
    def name(self) -> str:
        return (f"numpy:{self.computes}" + (":stored" if self.stored else "") + (":daz" if self.daz else "")
                + (f":ablate-{self.ablation}" if self.ablation else ""))


def run_emulator(cfg: EmulatorConfig, case: Case) -> tuple:
    order = ORDERS[case.seed % len(ORDERS)]
    run = Deployed(case.weights, FORMATS[cfg.fmt], order, seed=case.seed, acc=FORMATS[cfg.acc] if cfg.acc else None,
                   daz=cfg.daz, stored=cfg.stored)
    outs = [run.forward(list(t), cfg.ablation) for t in case.tokens]
    probs, experts = np.array([p for p, _, _ in outs]), np.array([e for _, e, _ in outs], np.int64)
    return (probs, experts) if cfg.ablation is None else (probs, experts, np.array([z for _, _, z in outs]))


def torch_runner(cfg: TorchConfig) -> Runner:
    return Runner(cfg.name, "torch", cfg.computes, lambda case: run_torch(cfg, case), cfg, cfg.ablation)


def emulator_runner(cfg: EmulatorConfig) -> Runner:
    return Runner(cfg.name, "numpy", cfg.computes, lambda case: run_emulator(cfg, case), cfg, cfg.ablation)


def onnx_runner(optimise: bool, ablation: str | None = None) -> Runner:
    name = f"onnxruntime:float32:{'opt' if optimise else 'noopt'}" + (f":ablate-{ablation}" if ablation else "")
    return Runner(name, "onnxruntime", "float32", lambda case: run_onnxruntime(optimise, case, ablation), optimise,
                  ablation)


EMULATORS = (EmulatorConfig("float32"), EmulatorConfig("float32", daz=True), EmulatorConfig("bfloat16"),
             EmulatorConfig("bfloat16", "float32"), EmulatorConfig("bfloat16", "float32", stored=True),
             EmulatorConfig("bfloat16", "float32", stored=True, daz=True), EmulatorConfig("float32", "float64"),
             EmulatorConfig("float32", "float64", stored=True)) + \
    tuple(replace(c, ablation=way) for way in ABLATIONS
          for c in (EmulatorConfig("float32"), EmulatorConfig("bfloat16"),
                    EmulatorConfig("bfloat16", "float32", stored=True),
                    EmulatorConfig("float32", "float64", stored=True)))


def runners(select: Iterable[str] | None = None) -> list[Runner]:
    """The runners whose name contains one of ``select`` (a family, or part of a name:
    "torch:bfloat16", ":explicit", ...); all by default. Families whose package is not
    installed are left out (:func:`available`)."""
    out: list[Runner] = []
    have = available()
    if "torch" in have:
        out += [torch_runner(c) for c in torch_configs()]
    if "onnxruntime" in have:
        out += [onnx_runner(opt, way) for way in (None, *ABLATIONS) for opt in (True, False)]
    out += [emulator_runner(c) for c in EMULATORS]
    if select is not None:
        select = list(select)
        out = [r for r in out if any(s in r.name for s in select)]
    return out


def available() -> set[str]:
    """The runner families whose packages import here."""
    have = {"numpy"}
    for family, module in (("torch", "torch"), ("onnxruntime", "onnxruntime")):
        try:
            __import__(module)
            if family == "onnxruntime":
                __import__("onnx")
            have.add(family)
        except ImportError:
            pass
    return have


# --- the oracle --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Violation:
    """A runner's execution outside a deployment's claim for one query."""

    kind: str               # "error", "routing" or "gate"; ablated: "ablated error", "ablated object", "ablated gap"
    motif: str
    case: str               # the case's description (motif parameters, shape, queries)
    runner: str
    deployment: str
    query: int
    error: float            # the runner's 1 − Σ_valid p̂
    err_lo: float
    err_hi: float
    expert: int             # the runner's routed expert
    certified: int          # res.expert
    margin: float
    candidates: tuple[int, ...]

    def line(self) -> str:
        if self.kind.startswith("ablated"):
            measured = {"ablated error": "ablated error", "ablated object": "1 - P_ablated(o)",
                        "ablated gap": "max_{t != o} z_t - z_o"}[self.kind]
            what = f"{measured} {self.error!r} not in [{self.err_lo!r}, {self.err_hi!r}]"
        elif self.kind == "error":
            what = f"error {self.error!r} not in [{self.err_lo!r}, {self.err_hi!r}]"
        else:
            what = (f"routed to expert {self.expert}, certificate: expert {self.certified} with margin {self.margin!r}"
                    f" (candidates {list(self.candidates)})")
        return f"{self.kind}: {self.runner} vs {self.deployment}, query {self.query}: {what}; {self.case}"


def compare(case: Case, runner: str, dep: str, res: BatchResult, probs: np.ndarray,
            experts: np.ndarray) -> list[Violation]:
    """The violations of ``res``'s claims by a runner's outputs (see the module docstring)."""
    out = []
    ptr, cand = res.candidates
    for i in range(case.tokens.shape[0]):
        lo, hi, margin = float(res.err_lo[i]), float(res.err_hi[i]), float(res.margin[i])
        if margin == -math.inf and lo <= 0.0 and hi >= 1.0:
            continue                                   # undecided: the certificate claims nothing
        p = probs[i, case.valid_of(i)]
        err = 1.0 - math.fsum(p.tolist()) if np.all(np.isfinite(p)) else math.nan
        e, cert = int(experts[i]), int(res.expert[i])
        cands = tuple(int(k) for k in cand[ptr[i]:ptr[i + 1]])

        def violation(kind: str) -> Violation:
            return Violation(kind, case.motif, case.describe(), runner, dep, i, err, lo, hi, e, cert, margin, cands)

        if margin > 0 and e != cert:
            out.append(violation("routing"))
        elif e not in cands:
            out.append(violation("gate"))
        if e in cands and not lo <= err <= hi:
            out.append(violation("error"))
    return out


def targets(case: Case) -> np.ndarray:
    """Each query's object for the ablated claims: its first valid next token."""
    return np.ascontiguousarray(case.valid[case.valid_ptr[:-1]], np.int64)


def _claims_nothing(res: BatchResult, i: int) -> bool:
    """Whether the ablated claims of row i are those of a row the pass decides nothing about
    (error [0, 1], gap −∞, 1 − P(o) >= 0)."""
    gap, obj = float(res.ablated_gap[i]), float(res.ablated_object_lo[i])
    return (float(res.ablated_lo[i]) <= 0.0 and float(res.ablated_hi[i]) >= 1.0
            and not gap > -math.inf and not obj > 0.0)


def compare_ablated(case: Case, runner: str, dep: str, res: BatchResult, probs: np.ndarray, experts: np.ndarray,
                    logits: np.ndarray) -> list[Violation]:
    """The violations of ``res``'s ablated claims by a runner that removed the routed expert
    (the localization check's model, y = r): for every query whose ablation is decided, its
    error 1 − Σ_valid p̂ in [ablated_lo, ablated_hi] ("ablated error"), 1 − p̂(o) at least
    ``ablated_object_lo`` (L1's number, "ablated object") and max_{t != o} ẑ_t − ẑ_o at least
    ``ablated_gap`` (L2's, "ablated gap"; the difference of the runner's logits taken
    exactly), o the query's first valid token (:func:`targets`). A non-finite output fails
    every claim it meets."""
    from fractions import Fraction

    out = []
    target = targets(case)
    ptr, cand = res.candidates
    for i in range(case.tokens.shape[0]):
        if _claims_nothing(res, i):
            continue
        e, cert = int(experts[i]), int(res.expert[i])
        cands = tuple(int(k) for k in cand[ptr[i]:ptr[i + 1]])

        def violation(kind: str, value: float, lo: float, hi: float) -> Violation:
            return Violation(kind, case.motif, case.describe(), runner, dep, i, value, lo, hi, e, cert,
                             float(res.margin[i]), cands)

        p = probs[i, case.valid_of(i)]
        err = 1.0 - math.fsum(p.tolist()) if np.all(np.isfinite(p)) else math.nan
        lo, hi = float(res.ablated_lo[i]), float(res.ablated_hi[i])
        if not lo <= err <= hi:
            out.append(violation("ablated error", err, lo, hi))
        o = int(target[i])
        obj_lo, p_o = float(res.ablated_object_lo[i]), float(probs[i, o])
        if obj_lo > -math.inf:                         # (NaN: no target; −∞: no claim)
            rest = 1 - Fraction(p_o) if math.isfinite(p_o) else None
            if rest is None or not rest >= Fraction(obj_lo):
                out.append(violation("ablated object", math.nan if rest is None else float(rest), obj_lo, math.inf))
        gap, z = float(res.ablated_gap[i]), logits[i]
        if gap > -math.inf:
            others = np.delete(z, o)
            best = Fraction(float(others.max())) - Fraction(float(z[o])) \
                if np.all(np.isfinite(z)) and others.size else None
            if best is None or not best >= Fraction(gap):
                out.append(violation("ablated gap", math.nan if best is None else float(best), gap, math.inf))
    return out


@dataclass
class Tally:
    """Per (runner, deployment): examples and queries compared, claims refused (the
    deployment's weights overflow) and violations; ``found``: (case, violation) pairs."""

    examples: dict = field(default_factory=dict)
    queries: dict = field(default_factory=dict)
    violations: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    found: list = field(default_factory=list)

    def add(self, key, case: Case, violations: list[Violation]) -> None:
        self.examples[key] = self.examples.get(key, 0) + 1
        self.queries[key] = self.queries.get(key, 0) + case.tokens.shape[0]
        self.violations[key] = self.violations.get(key, 0) + len(violations)
        self.found += [(case, v) for v in violations]


def certificate(case: Case, dep: str) -> BatchResult | None:
    """FloatPass's result for the case's queries under a deployment (cached on the case);
    None when the deployment refuses the weights (a value overflows the format)."""
    key = ("certificate", dep)
    if key not in case.memo:
        try:
            case.weights.validate("differential case")
            if is_dense(case.weights):          # the pass the verifier runs on such weights
                fp = DeployedDensePass(case.weights, deployment=deployment(dep))
            else:
                fp = FloatPass(case.weights, deployment(dep), "differential case")
            case.memo[key] = fp.run_batch(case.tokens, case.valid_ptr, case.valid, target=targets(case))
        except TaskError:
            case.memo[key] = None
    return case.memo[key]


def check(case: Case, runs: list[Runner], tally: Tally | None = None,
          deployments: Iterable[str] | None = None) -> list[Violation]:
    """Every runner on the case against every deployment claiming to cover it (or those of
    ``deployments`` among them); the violations (and counts in ``tally``)."""
    out = []
    for runner in runs:
        deps = [d for d in runner.deployments if deployments is None or d in deployments]
        if not deps:
            continue
        try:
            outputs = runner.run(case)
        except TaskError:                 # the runtime cannot hold the weights (ONNX: overflow in float32)
            outputs = None
        for dep in deps:
            res = certificate(case, dep)
            key = (runner.name, dep)
            if res is None or outputs is None:
                if tally is not None:
                    tally.skipped[key] = tally.skipped.get(key, 0) + 1
                continue
            found = (compare(case, runner.name, dep, res, *outputs) if runner.ablation is None
                     else compare_ablated(case, runner.name, dep, res, *outputs))
            if tally is not None:
                tally.add(key, case, found)
            out += found
    return out


def alternatives(runner: Runner) -> list[tuple[str, Runner]]:
    """For each op-by-op choice of ``runner`` that rounds more often than its fused form, that
    choice's label and the runner with it alone replaced by the fused form."""
    cfg, out = runner.config, []
    if isinstance(cfg, TorchConfig):
        if cfg.softmax == "explicit":
            out.append(("softmax stored op by op", replace(cfg, softmax="torch")))
        if cfg.residual != "fused":
            out.append((f"residual {'head by head' if cfg.residual == 'per-head' else 'product, then h'}",
                        replace(cfg, residual="fused")))
        if cfg.bias == "add":
            out.append(("bias added after the product", replace(cfg, bias="addmm")))
        return [(label, torch_runner(c)) for label, c in out]
    if isinstance(cfg, EmulatorConfig) and cfg.stored:
        return [("every intermediate stored", emulator_runner(replace(cfg, stored=False)))]
    return []


def causes(case: Case, v: Violation, runner: Runner) -> tuple[str, ...]:
    """The choices of :func:`alternatives` whose fused form alone removes the violation (no
    violation of its kind, deployment and query): the cause, by contrast of variants."""
    out = []
    for label, alt in alternatives(runner):
        again = check(case, [alt], deployments=[v.deployment])
        if not any(x.kind == v.kind and x.query == v.query for x in again):
            out.append(label)
    return tuple(out)


def table(tally: Tally) -> str:
    """The survey's table: per runner and deployment, examples, queries, refused, violations."""
    keys = sorted(set(tally.examples) | set(tally.skipped))
    width = max([len(r) for r, _ in keys] + [6])
    lines = [f"{'runner':<{width}}  {'deployment':<17} {'examples':>8} {'queries':>8} {'refused':>7} "
             f"{'violations':>10}"]
    for key in keys:
        r, d = key
        lines.append(f"{r:<{width}}  {d:<17} {tally.examples.get(key, 0):>8} {tally.queries.get(key, 0):>8} "
                     f"{tally.skipped.get(key, 0):>7} {tally.violations.get(key, 0):>10}")
    return "\n".join(lines)


# --- searching with hypothesis -----------------------------------------------------------------


class _Found(Exception):
    pass


def _settings(examples: int, shrink: bool):
    from hypothesis import HealthCheck, Phase, Verbosity, settings

    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    return settings(max_examples=examples, deadline=None, database=None, phases=phases, verbosity=Verbosity.quiet,
                    suppress_health_check=list(HealthCheck))


def survey(examples: int, seed: int, runs: list[Runner], motifs=None) -> Tally:
    """``examples`` cases (hypothesis, seeded), every runner against its deployments."""
    from hypothesis import given
    from hypothesis import seed as hseed

    tally = Tally()

    @hseed(seed)
    @_settings(examples, shrink=False)
    @given(cases(motifs))
    def probe(case: Case) -> None:
        check(case, runs, tally)

    probe()
    return tally


@dataclass
class Finding:
    """A shrunk counterexample: the example count at which the first was found, the
    shrunk case's violations, and every runner violating on it."""

    first_at: int
    case: Case
    violations: list[Violation]
    violating_runners: list[str]


def search(examples: int, seed: int, runs: list[Runner], wanted: Callable[[Case, Violation], bool],
           motifs=None, contrast: list[Runner] | None = None) -> Finding | None:
    """Hypothesis search (seeded) for a case with a violation ``wanted`` accepts, shrunk;
    None if none in ``examples`` examples. ``contrast``: runners checked on the shrunk case."""
    from hypothesis import given
    from hypothesis import seed as hseed

    state: dict[str, Any] = {"n": 0, "first": None, "last": None}

    @hseed(seed)
    @_settings(examples, shrink=True)
    @given(cases(motifs))
    def probe(case: Case) -> None:
        state["n"] += 1
        hits = [v for v in check(case, runs) if wanted(case, v)]
        if hits:
            if state["first"] is None:
                state["first"] = state["n"]
            state["last"] = (case, hits)
            raise _Found

    try:
        probe()
    except _Found:
        pass
    except _GROUP as group:                            # several distinct failures: all ours
        if not all(isinstance(e, _Found) for e in group.exceptions):
            raise
    if state["last"] is None:
        return None
    case, hits = state["last"]
    violating = sorted({v.runner + " vs " + v.deployment for v in check(case, contrast or runs)})
    return Finding(state["first"], case, hits, violating)


# --- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audit.differential", description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200, help="hypothesis examples (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--runtime", action="append", help="runners whose name contains this (repeatable): "
                        "torch, onnxruntime, numpy, torch:bfloat16, :explicit, ... (default: all)")
    parser.add_argument("--motif", action="append", choices=list(MOTIFS), help="motifs (repeatable; default: all)")
    parser.add_argument("--shrink", action="store_true",
                        help="for each (deployment, kind, runner) violation found, search again and shrink it")
    args = parser.parse_args(argv)
    if args.examples < 1:
        print("audit.differential: --examples must be at least 1", file=sys.stderr)
        return 2
    runs = runners(args.runtime)
    if not runs:
        print(f"audit.differential: no runner matches {args.runtime} (installed: {sorted(available())})",
              file=sys.stderr)
        return 2
    tally = survey(args.examples, args.seed, runs, args.motif)
    print(table(tally))
    print(f"\n{len(tally.found)} violations in {args.examples} examples")
    by_name = {r.name: r for r in runs}
    firsts: dict[tuple, tuple[Case, Violation]] = {}
    for case, v in tally.found:
        firsts.setdefault((v.deployment, v.kind, v.runner), (case, v))
    groups: dict[tuple, Violation] = {}
    for case, v in firsts.values():
        print("  " + v.line())
        if args.shrink:
            groups.setdefault((v.deployment, v.kind, causes(case, v, by_name[v.runner])), v)
    for (dep, kind, cause), v in groups.items():
        runner = by_name[v.runner]

        def wanted(case: Case, x: Violation, dep=dep, kind=kind, cause=cause, runner=runner) -> bool:
            return (x.deployment == dep and x.kind == kind and x.runner == runner.name
                    and causes(case, x, runner) == cause)

        found = search(args.examples, args.seed, [runner], wanted, args.motif, contrast=runs)
        print(f"\n== {kind} violations of {dep} by {runner.name}; removed by fusing alone: "
              f"{', '.join(cause) if cause else 'no single choice'}")
        if found is None:
            print("   not found again in the search")
            continue
        print(f"   first found at example {found.first_at}; shrunk:")
        for x in found.violations:
            print("   " + x.line())
        print("   runners violating on the shrunk case: " + "; ".join(found.violating_runners))
    return 1 if tally.found else 0


if __name__ == "__main__":
    sys.exit(main())
