"""The forward pass as deployed in a floating-point format, enclosed for every execution.

:mod:`verifier.forward` encloses the *exact* forward pass of :mod:`layout` (real
arithmetic on the stored values). A deployed model computes in float32 or bfloat16, in
whatever order its kernels choose. This module encloses **every** execution of the
layout's equations in a format F (:mod:`layout.formats`; unit roundoff u, smallest
subnormal η, largest finite Ω) that satisfies the execution model:

(F1) The weights are the stored values rounded to F (:func:`layout.formats.round_weights`).
(F2) Every operation of the equations is carried out in F, with gradual underflow or
     with results below the normal range flushed to zero, and with inputs below it read
     as zero or not (denormals-are-zero, e.g. ``torch.set_flush_denormal(True)``: a
     product x·w then loses less than 2^emin·(|x| + |w|), which Lemma F1 adds);
     the runtime may be dense (it multiplies every value, also by zero weights, so
     one non-finite intermediate value anywhere in a query's computation can make its
     output NaN: such a query is never certified, see (F4)). Top-1 dispatch computes
     the routed expert (or discards the others' outputs by selection, as the ONNX
     graph's ``Where`` does; multiplying every expert's output by a one-hot weight is
     outside the model, since a non-finite output of an expert that cannot win would
     spread). Inputs are the query itself: a batch padded to a longer length, whose
     padded positions are masked but still multiplied, is outside the model. h = E[x] + P[i] is one
     addition; every matrix product (with its bias, if any) is a sum of products
     computed in **any order and grouping**, with or without fused multiply-add, each
     product and addition rounded to nearest in F; the residual r = h + Σ_m W_O^m c_m
     is one such sum over h and all heads' products (so per-head products added
     afterwards, or one product over the concatenated heads, are both covered);
     ReLU and argmax are exact; c·W_2 a (scaled gate) is one multiplication per entry
     after the product, and y = r + that one addition.
(F3) Every softmax subtracts the row maximum (an element of the row), exponentiates,
     sums in any order, and divides; ``exp`` and the division (or a reciprocal and a
     multiplication, counted together) are within ``ulps`` units in the last place of
     the exact result (``--ulps``, default 4: a relative error of at most κ = 2·ulps·u,
     or an absolute one of max(ulps, 1)·2^emin below the normal range, which covers an
     exp that flushes tiny results to zero).
(F4) No intermediate value overflows: checked, not assumed. Every intermediate value of
     a query whose enclosure is not finite (one that may overflow: any key, value,
     score, hidden neuron of a candidate expert, residual or logit entry, whether or not
     a later weight reads it) makes that query undecided: margin −∞, error [0, 1].
(F5) Optionally (``Deployment.acc``, ``--accumulate float32``): sums, exp and divisions
     are computed in a wider format and each result is rounded once to F (bfloat16
     with float32 accumulation, as mixed-precision kernels do); the bounds below then
     use the wider format's u and add one rounding to F per stored result.

Lemmas used (Higham §3.1, with underflow as in :mod:`verifier.interval`; every bound
holds for any order of the additions because each term passes through at most n − 1
of them):

**Lemma F1** (dot products in F). For x̂ ∈ X (an interval vector) and weights b,
fl_F(Σ_j x̂_j b_j + b_0) lies within γ^F_{n+1}·(Σ_j |x̂_j||b_j| + |b_0|) + 2(n+1)·η_op of
the exact Σ_j x̂_j b_j + b_0, where n is the number of terms, γ^F_n = n·u/(1 − n·u), and
η_op = 2·2^emin: the sum has at most 2n + 2 operations (products, additions, the
bias), each losing less than 2^emin to underflow (η/2 for a product with gradual
underflow, nothing for an addition; less than 2^emin when results are flushed), and
a lost amount is carried through the later roundings by a factor <= 1 + γ <= 2. Inputs
read as zero add less than 2·2^emin·n·(max|x̂_j| + max|b_j|) (:func:`_daz`). So
:func:`product` encloses the exact product of X (by :func:`verifier.interval.matmul`) and
widens each entry by that bound, with Σ|x̂_j||b_j| bounded above by the product of
the point matrix up(|mid| + rad) with |B| (itself enclosed, and its upper end taken).
Partial sums are bounded by (1 + γ)·Σ|terms|; where that reaches Ω, an execution may
overflow and the entry is unbounded (radius ∞), so (F4) is proven per entry, not assumed.

**Lemma F2** (softmax in F). Let ŝ be the computed scores, M = max ŝ, t_j = fl(ŝ_j − M)
(|t_j − (ŝ_j − M)| <= u·(M − ŝ_j) + 2^emin <= u·W_j + 2^emin, W_j = max_l hi_l − lo_j), ê_j = e^{t_j}(1+δ_j)
+ ζ_j (|δ_j| <= κ, |ζ_j| <= ζ = ulps·2^emin), Ŝ = fl(Σ ê) ∈ Σê·[1 − γ_{n−1}, 1 + γ_{n−1}],
p̂_j = ê_j/Ŝ·(1 + δ'_j) + ζ'_j. The shift M is common to every e^{t_j} and cancels in
ê_j/Σê except through the ζ's; since t = 0 at the maximum, Σê >= 1 − κ >= 1/2, and the ζ's
move the ratio by at most 4(n+1)·ζ (Σê >= 1/4 once they are counted). Hence p̂_j lies in
[R_lo·(1 − κ)/(1 + γ) − τ, R_hi·(1 + κ)/(1 − γ) + τ], τ = (8n + 9)·ζ, where [R_lo, R_hi]
encloses e_j/Σ_l e_l over e_l ∈ [e^{lo_l − uW_l}(1 − κ), e^{hi_l + uW_l}(1 + κ)]
(:func:`verifier.forward.ratio_bounds`, any common shift). A sum of p̂_j over a set of
tokens (the valid next tokens) is bounded the same way from the two sums A (the set)
and B (the rest), A/(A + B) being increasing in A and decreasing in B, with τ for the
whole sum ((17n + 9)·ζ). The deployed outputs need not sum to 1: the error 1 − Σ_valid p̂_j may be
slightly negative, and is at most 1 (every p̂_j >= 0).

Everything is computed in float64 with the outward rounding of :mod:`verifier.interval`.
This pass is written for clarity, not speed: sparse products of scipy per batch and per
expert, no compiled kernels. It serves every batch :func:`verifier.verify.verify` sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from layout import Weights
from layout.formats import FORMATS, Format, round_weights
from verifier import execution
from verifier import interval as I
from verifier.forward import BatchResult
from verifier.interval import ratio_bounds
from verifier.interval import SparseInterval

#: Default accuracy of exp and of the division in the deployed softmax, in ulps (F3).
DEFAULT_ULPS = 4.0


@dataclass(frozen=True)
class Deployment:
    """A floating-point format, the format its sums and softmaxes accumulate in, and the
    accuracy assumed of exp and division.

    ``acc`` (default: ``fmt`` itself) models the common mixed-precision deployment of
    bfloat16: weights and every stored activation in ``fmt``, but each operation (a
    product's sum, an addition, exp, a softmax's sum and division) computed in ``acc``
    (float32) and its result rounded to ``fmt``, including intermediates a runtime keeps
    (the shifted scores, the exps and their sum of a softmax written as separate tensor
    operations; each partial residual when the heads are added one by one; a product
    before its bias is added). Which results may be stored is the execution model's table
    (:mod:`verifier.execution`); every bound of the module uses acc's unit roundoff for
    the arithmetic and one factor 1 ± u_fmt per stored result on a term's path
    (:meth:`stored`, :meth:`rel`).
    """

    fmt: Format
    ulps: float = DEFAULT_ULPS
    acc: Format | None = None

    @classmethod
    def named(cls, name: str, ulps: float = DEFAULT_ULPS, accumulate: str | None = None) -> "Deployment":
        fmt = FORMATS[name]
        acc = FORMATS[accumulate] if accumulate is not None else None
        if acc is not None and acc.p <= fmt.p:
            raise ValueError(f"accumulating in {acc.name} is not wider than {fmt.name}")
        return cls(fmt, float(ulps), acc)

    @property
    def work(self) -> Format:
        """The format sums, exp and divisions are computed in."""
        return self.acc if self.acc is not None else self.fmt

    @property
    def kappa(self) -> float:
        """Relative error bound of exp and the division: ulps·ulp(x) <= 2·ulps·u·|x|."""
        return float(I.up(2.0 * self.ulps * self.work.u))

    @property
    def eta_op(self) -> float:
        """Absolute underflow error of one operation, as carried through later additions (F1)."""
        return 2.0 * 2.0 ** max(self.fmt.emin, self.work.emin)

    def stored(self, steps: tuple[str, ...], heads: int = 0) -> int:
        """The results rounded to the storage format on a term's path through ``steps`` of the
        execution model (:mod:`verifier.execution`) beyond the arithmetic's own roundings:
        their count there under ``--accumulate``, 0 otherwise (a result computed in the
        storage format is stored by the rounding that produced it). Every rounding bound of
        this module is derived through here, so a stored intermediate the table lists is
        counted; a test records the steps asked for."""
        count = execution.stores(steps, heads)
        return count if self.acc is not None else 0

    def rel(self, ops: int, steps: tuple[str, ...], heads: int = 0) -> float:
        """ρ with |fl(Σ t) − Σ t| <= ρ·Σ|t| (plus underflow, :meth:`floor`) for a computation
        whose terms each pass through at most ``ops`` roundings in the working format and the
        stored results of ``steps``: (1 + u_A)^ops·(1 + u_F)^s − 1 <= (1 + γ^A_ops)(1 + u_F)^s − 1
        (the module docstring of :mod:`verifier.execution`); ∞ when γ^A_ops is."""
        return _grow(self.gamma_work(ops), self.fmt.u, self.stored(steps, heads))

    def floor(self, ops: int, steps: tuple[str, ...], heads: int = 0) -> float:
        """The absolute underflow allowance of such a computation of ``ops`` products and
        additions (and a bias): at most 2·ops + 2 operations and s stores, each losing less
        than 2^emin, carried through later roundings by at most a factor 2."""
        carry = max(2.0, float(I.up(1.0 + self.rel(ops, steps, heads))))     # 1 + ρ, at least 2
        return float(I.up(I.up((2.0 * (ops + 1) + self.stored(steps, heads)) * 2.0 ** max(self.fmt.emin, self.work.emin))
                          * carry))

    def zeta(self, steps: tuple[str, ...]) -> float:
        """Absolute error of exp or of the division below the normal range (F3), with its stores."""
        return float(I.up((max(self.ulps, 1.0) + self.stored(steps)) * 2.0 ** max(self.fmt.emin, self.work.emin)))

    def gamma_work(self, n: int) -> float:
        """An upper bound of γ_n = n·u/(1 − n·u) in the working format; ∞ when n·u >= 1/2."""
        nu = float(I.up(n * self.work.u))
        if nu >= 0.5:
            return float("inf")
        return float(I.up(nu / float(I.down(1.0 - nu))))

    def describe(self) -> str:
        acc = (f"; every operation in {self.acc.name}, its result and any stored intermediate (shifted scores, exps "
               f"and sums of a softmax, partial residuals head by head, a product before its bias) rounded to "
               f"{self.fmt.name}" if self.acc is not None else "")
        return (f"{self.fmt.name} (u = 2^-{self.fmt.p}; any summation order, with or without FMA, flushing subnormals or not{acc}; "
                f"exp and division within {self.ulps:g} ulps)")


def error_floor(V: int, dep: Deployment) -> float:
    """The least upper error bound this certificate can give for V tokens, whatever the
    weights: the output softmax's factor (1 − κ)/(1 + γ_{V−1}) alone leaves
    1 − Σ_valid p̂ <= ε unprovable for ε below 1 − that factor (Lemma F2)."""
    f_lo, _, _ = _factors(V, dep, mass=True)
    return float(I.up(1.0 - f_lo))


# --- the execution model as the numbers the compiled pass adds ------------------------------------


def _row_counts(M) -> np.ndarray:
    """Stored entries per row of a sparse matrix (the terms of an entry of M·x)."""
    M = sp.csr_matrix(M)
    return np.diff(M.indptr).astype(np.int64)


def row_sums(M) -> np.ndarray:
    """Upper bounds of Σ_j |M_ij| per row (rounded up)."""
    M = sp.csr_matrix(M)
    out = np.zeros(M.shape[0])
    if M.nnz:
        np.add.at(out, np.repeat(np.arange(M.shape[0]), np.diff(M.indptr)), np.abs(M.data))
    return I.up(I.up(out) * I.sum_factor(max(int(np.diff(M.indptr).max(initial=1)), 1)))


@dataclass(frozen=True)
class Stages:
    """Every stage's rounding, for weights as deployed (already rounded to the format): the
    execution model of :mod:`verifier.execution` read through :meth:`Deployment.rel` and
    :meth:`Deployment.floor`, for the numbers of terms these weights have. The compiled pass
    (:mod:`verifier.forward`, :mod:`verifier.kernels`) adds, at each stage, ``rho`` times the
    stage's sum of |terms| (which it already accumulates for its own float64 rounding) and
    the stage's absolute ``floor`` (underflow) and ``daz`` allowance (inputs read as zero:
    each product x·w loses less than e_min·(|x| + |w|), so a sum loses less than
    e_min·(Σ|x| + Σ|w|), carried through later roundings by at most a factor 2).

    Names: ``h`` the embedding sum, ``q``/``k``/``v`` the head projections, ``s`` the scores,
    ``mix`` the attention-weighted values, ``or`` the head outputs with the residual sum
    (one sum of ``n_residual`` terms, per residual coordinate with the stores of the heads
    writing it), ``g`` the gate with its bias, ``z`` an expert's first layer with its bias,
    ``o`` its second layer, ``sc`` the gate scale (top1-scaled), ``y`` the output sum,
    ``l`` the logits. Row sums ``rs_*`` (upper bounds of Σ|w| per output entry) carry an
    earlier stage's absolute error through a later product.
    """

    e_min: float
    largest: float
    rho_h: float
    f_h: float
    rho_q: float
    f_q: float
    rho_k: float
    f_k: float
    rho_v: float
    f_v: float
    rho_s: float
    f_s: float
    rho_mix: float
    f_mix: float
    rho_or: np.ndarray          # (d,) per residual coordinate
    f_or: np.ndarray            # (d,)
    rho_g: float
    f_g: float
    rho_z: float
    f_z: float
    rho_o: float
    f_o: float
    rho_sc: float
    f_sc: float
    rho_y: float
    f_y: float
    rho_l: float
    f_l: float
    rs_q: np.ndarray            # (Σ d_h,) the heads' query rows side by side
    rs_k: np.ndarray
    rs_v: float                 # the largest row sum of any W_V
    rs_o: np.ndarray            # (d,) Σ over heads of the row sums of W_O
    rs_z: np.ndarray            # (total neurons,) per first-layer row, all experts side by side
    rs_2: np.ndarray            # (d,) the largest row sum of any expert's W_2 at each coordinate
    rs_l: np.ndarray            # (V,) per token's row of U
    rs_g: float                 # the largest row sum of W_G
    dv: int                     # the most value coordinates of a head

    def cut(self, coords: np.ndarray, tokens: np.ndarray, neurons: np.ndarray) -> "Stages":
        """These stages for a cut of the weights (verifier.shards.compact): the residual
        coordinates ``coords``, the tokens ``tokens`` (rows of U) and the neurons
        ``neurons`` it keeps, in its numbering. The scalars are the full weights': a cut's
        enclosures are then the full pass's bit for bit."""
        from dataclasses import replace

        return replace(self, rho_or=self.rho_or[coords], f_or=self.f_or[coords], rs_o=self.rs_o[coords],
                       rs_2=self.rs_2[coords], rs_l=self.rs_l[tokens], rs_z=self.rs_z[neurons])

    @property
    def k_value(self) -> float:
        """The relative error of an attention-weighted value Σ_j â_j·(W_V ĥ_j) against
        Σ_j â_j·(W_V h_j) (the enclosed weights â, the exact h): (1 + ρ_h)(1 + ρ_v)(1 + ρ_mix) − 1."""
        return float(I.up(I.up(I.up(I.up(1.0 + self.rho_h) * I.up(1.0 + self.rho_v)) * I.up(1.0 + self.rho_mix)) - 1.0))

    def kernel_constants(self) -> np.ndarray:
        """The scalars the kernels read, in the order :data:`KERNEL_CONSTANTS` names them."""
        values = {name: getattr(self, name) for name in KERNEL_CONSTANTS if name != "k_value"}
        values["k_value"] = self.k_value
        return np.array([float(values[n]) for n in KERNEL_CONSTANTS])


#: The scalar constants the kernels receive (an array, in this order); verifier.kernels reads
#: them by these positions (KC_* there).
KERNEL_CONSTANTS = ("e_min", "largest", "rho_h", "f_h", "k_value", "rho_g", "f_g", "rho_z", "f_z", "rho_o", "f_o",
                    "rho_sc", "f_sc", "rho_y", "f_y", "rho_l", "f_l")


def stages(weights: Weights, dep: Deployment) -> Stages:
    """The :class:`Stages` of ``weights`` (as deployed: rounded to ``dep.fmt``) in ``dep``."""
    heads = weights.heads
    d = weights.d

    def most(counts) -> int:
        return int(max((int(c.max(initial=0)) for c in counts), default=0))

    n_q = most(_row_counts(h.W_Q) for h in heads)
    n_k = most(_row_counts(h.W_K) for h in heads)
    n_v = most(_row_counts(h.W_V) for h in heads)
    d_h = max((h.W_Q.shape[0] for h in heads), default=0)
    n_pos = weights.P.shape[0]
    n_o = [_row_counts(h.W_O) for h in heads]                   # per head, per residual coordinate
    n_residual = 1 + sum(int(c.max(initial=0)) for c in n_o)
    writers = np.zeros(d, np.int64)
    for c in n_o:
        writers += c > 0
    rho_or, f_or = np.zeros(d), np.zeros(d)
    steps_or = ("head output", "residual")
    for w in np.unique(writers):
        at = writers == w
        rho_or[at], f_or[at] = dep.rel(n_residual, steps_or, int(w)), dep.floor(n_residual, steps_or, int(w))
    if not d:
        dep.stored(steps_or)
    n_g = int(_row_counts(weights.W_G).max(initial=0))
    n_z = most(_row_counts(e.W_1) for e in weights.experts)
    n_o2 = most(_row_counts(e.W_2) for e in weights.experts)
    n_l = int(_row_counts(weights.U).max(initial=0))
    scaled = weights.gate_mode == "top1-scaled"
    rs_o = np.zeros(d)
    for h in heads:
        rs_o = I.up(rs_o + row_sums(h.W_O))
    rs_2 = np.zeros(d)
    for e in weights.experts:
        rs_2 = np.maximum(rs_2, row_sums(e.W_2))
    cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0))   # noqa: E731
    return Stages(
        e_min=2.0 ** max(dep.fmt.emin, dep.work.emin), largest=dep.fmt.largest,
        rho_h=dep.rel(1, ("embedding",)), f_h=dep.floor(2, ("embedding",)),
        rho_q=dep.rel(n_q, ("query",)), f_q=dep.floor(n_q, ("query",)),
        rho_k=dep.rel(n_k, ("key",)), f_k=dep.floor(n_k, ("key",)),
        rho_v=dep.rel(n_v, ("value",)), f_v=dep.floor(n_v, ("value",)),
        rho_s=dep.rel(d_h, ("score",)), f_s=dep.floor(d_h, ("score",)),
        rho_mix=dep.rel(n_pos, ("mix",)), f_mix=dep.floor(n_pos, ("mix",)),
        rho_or=rho_or, f_or=f_or,
        rho_g=dep.rel(n_g + 1, ("gate product", "gate bias")), f_g=dep.floor(n_g + 1, ("gate product", "gate bias")),
        rho_z=dep.rel(n_z + 1, ("expert product", "expert bias")),
        f_z=dep.floor(n_z + 1, ("expert product", "expert bias")),
        rho_o=dep.rel(n_o2, ("expert output",)), f_o=dep.floor(n_o2, ("expert output",)),
        rho_sc=dep.rel(1, ("gate scale",)) if scaled else 0.0, f_sc=dep.floor(0, ("gate scale",)) if scaled else 0.0,
        rho_y=dep.rel(1, ("output sum",)), f_y=dep.floor(2, ("output sum",)),
        rho_l=dep.rel(n_l, ("logits",)), f_l=dep.floor(n_l, ("logits",)),
        rs_q=cat([row_sums(h.W_Q) for h in heads]), rs_k=cat([row_sums(h.W_K) for h in heads]),
        rs_v=float(max((float(row_sums(h.W_V).max(initial=0.0)) for h in heads), default=0.0)),
        rs_o=rs_o, rs_z=cat([row_sums(e.W_1) for e in weights.experts]), rs_2=rs_2,
        rs_l=row_sums(weights.U), rs_g=float(row_sums(weights.W_G).max(initial=0.0)),
        dv=max((h.W_V.shape[0] for h in heads), default=0))


def _grow(rel: float, u: float, s: int) -> float:
    """An upper bound of (1 + rel)(1 + u)^s − 1: s more roundings of relative error at most u."""
    for _ in range(s):
        rel = float(I.up(rel + I.up(u * I.up(1.0 + rel))))
    return rel


# --- rounding of one operation -----------------------------------------------------------------


def _unbounded(X: SparseInterval) -> np.ndarray:
    """Per row of X: some stored entry's enclosure is not finite (the value may be ±inf or NaN)."""
    return X.nonfinite_rows() if X.nnz else np.zeros(X.shape[0], bool)


def _unbounded_dense(m: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Per row (first axis): some entry's enclosure is not finite."""
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(m) & np.isfinite(r)
    return ~ok.reshape(ok.shape[0], -1).all(axis=1)


def _columns_terms(B: sp.csr_matrix) -> int:
    """The most stored entries in a column of B: the most terms of an entry of X·B."""
    return int(np.bincount(B.indices, minlength=1).max()) if B.nnz else 0


def _point(X: SparseInterval) -> SparseInterval:
    """The point matrix up(|mid| + rad) on X's pattern: an entry-wise upper bound of |x̂|."""
    with np.errstate(invalid="ignore", over="ignore"):
        mag = I.up(np.abs(X.mid) + X.rad)
    return SparseInterval(X.shape, X.indptr, X.indices, np.where(np.isfinite(mag), mag, np.inf), np.zeros(X.nnz))


def _widen(mid, rad, mag, gamma: float, floor: float, largest: float):
    """rad + γ·mag + floor, and ∞ where a partial sum could reach the format's largest value."""
    with np.errstate(invalid="ignore", over="ignore"):
        r = I.add_rad(rad, I.up(gamma * mag), floor)
        over = ~(I.up(mag * I.up(1.0 + gamma)) < largest) | ~np.isfinite(mag)
        return np.where(over, np.inf, I.guard(mid, r))


def _row_max(X: SparseInterval) -> np.ndarray:
    """Per row, an upper bound of |x̂| over its stored entries (0 for an empty row)."""
    out = np.zeros(X.shape[0])
    if X.nnz:
        np.maximum.at(out, X.row_ids(), _point(X).mid)
    return out


def _col_max(absB: sp.csr_matrix) -> np.ndarray:
    """Per column of |B|, its largest entry (0 for an empty column)."""
    out = np.zeros(absB.shape[1])
    if absB.nnz:
        np.maximum.at(out, absB.indices, absB.data)
    return out


def _daz(n_terms: int, x_max, w_max, dep: Deployment):
    """Lemma F1's allowance for inputs read as 0 below the normal range (denormals-are-zero):
    each of n terms x·w loses less than 2^emin·(|x| + |w|) (the operand read as 0 is below
    2^emin, the other is at most |x| or |w|), carried through by at most 1 + γ <= 2."""
    with np.errstate(invalid="ignore", over="ignore"):
        return I.up(I.up(2.0 * n_terms * 2.0 ** dep.fmt.emin) * I.up(x_max + w_max))


def product(X: SparseInterval, B: sp.csr_matrix, absB: sp.csr_matrix, n_terms: int, dep: Deployment,
            steps: tuple[str, ...]) -> SparseInterval:
    """Enclosure of fl_F(x̂·B) for every x̂ ∈ X and every execution (Lemma F1); ``steps``: the
    execution model's steps the product is (their stored results counted)."""
    exact = I.matmul(X, B, absB)
    if exact.nnz == 0:
        return exact
    mag = I.matmul(_point(X), absB, absB)
    g = dep.rel(n_terms, steps)
    daz = _daz(n_terms, _row_max(X)[exact.row_ids()], _col_max(absB)[exact.indices], dep)
    rad = _widen(exact.mid, exact.rad, I.upper(mag.mid, mag.rad), g, 0.0, dep.fmt.largest)
    rad = I.add_rad(rad, daz, dep.floor(n_terms, steps))
    return SparseInterval(exact.shape, exact.indptr, exact.indices, exact.mid, rad)


def affine(X: SparseInterval, B: sp.csr_matrix, absB: sp.csr_matrix, n_terms: int, bias: np.ndarray,
           dep: Deployment, steps: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Dense enclosure (mid, rad) of fl_F(x̂·B + b) (the bias is one more term of each sum;
    ``steps``: the product's and the bias's, whose results may both be stored)."""
    exact = I.matmul(X, B, absB)
    mag = I.matmul(_point(X), absB, absB)
    m, r = exact.dense()
    mm, mr = mag.dense()
    with np.errstate(invalid="ignore", over="ignore"):
        mid = m + bias[None, :]
        r = I.add_rad(r, I.up(I.U * np.abs(mid)))                      # the float64 addition of the bias
        upper_mag = I.add_rad(I.upper(mm, mr), np.abs(bias)[None, :])
    g = dep.rel(n_terms + 1, steps)
    daz = _daz(n_terms + 1, _row_max(X)[:, None], np.maximum(_col_max(absB), np.abs(bias))[None, :], dep)
    rad = _widen(mid, r, upper_mag, g, 0.0, dep.fmt.largest)
    return mid, I.add_rad(rad, daz, dep.floor(n_terms + 1, steps))


def rounded_sum(S: SparseInterval, mag: np.ndarray, n_terms: int, dep: Deployment,
                steps: tuple[str, ...]) -> SparseInterval:
    """S (the exact sum of n_terms terms per entry, enclosed) widened to cover fl_F of
    that sum in any order: γ^F_{n−1}·Σ|terms| (with the stores of ``steps``), plus η_op
    per addition (an addition is exact below the normal range unless results are flushed
    to zero)."""
    g = dep.rel(max(n_terms - 1, 1), steps)
    rad = _widen(S.mid, S.rad, mag, g, dep.floor(n_terms, steps), dep.fmt.largest)
    return SparseInterval(S.shape, S.indptr, S.indices, S.mid, rad)


def _aligned(pattern: SparseInterval, X: SparseInterval) -> np.ndarray:
    """Upper ends of |X| on ``pattern``'s entries (X's pattern ⊆ pattern's); 0 elsewhere."""
    P = _point(X)
    full = sp.csr_matrix((P.mid, P.indices, P.indptr), shape=P.shape)
    return I._align(sp.csr_matrix((np.ones(pattern.nnz), pattern.indices, pattern.indptr), shape=pattern.shape),
                    full.tocsr()) if X.nnz else np.zeros(pattern.nnz)


def dense_interval(mid: np.ndarray, rad: np.ndarray) -> SparseInterval:
    """A dense interval matrix as a SparseInterval with every entry stored."""
    n, m = mid.shape
    ptr = np.arange(0, n * m + 1, m, dtype=np.int64) if m else np.zeros(n + 1, np.int64)
    return SparseInterval((n, m), ptr, np.tile(np.arange(m, dtype=np.int64), n), mid.reshape(-1).copy(),
                          rad.reshape(-1).copy())


def dot_last(am, ar, bm, br, dep: Deployment, steps: tuple[str, ...] = ("score",)):
    """Enclosure of fl_F(Σ_t â_t b̂_t) over the last axis (Lemma F1, both factors intervals)."""
    t = max(am.shape[-1], bm.shape[-1])
    m, r = I.dot_rows(am, ar, bm, br)
    with np.errstate(invalid="ignore", over="ignore"):
        ma = I.up(np.abs(am) + ar)
        mb = I.up(np.abs(bm) + br)
        pm, pr = I.dot_rows(ma, np.zeros_like(ma), mb, np.zeros_like(mb))
        daz = _daz(t, np.max(ma, axis=-1, initial=0.0), np.max(mb, axis=-1, initial=0.0), dep)
    rad = _widen(m, r, I.upper(pm, pr), dep.rel(t, steps), 0.0, dep.fmt.largest)
    return m, I.add_rad(rad, daz, dep.floor(t, steps))


def weighted_rows(Vv: SparseInterval, am: np.ndarray, ar: np.ndarray, group: int, dep: Deployment) -> SparseInterval:
    """Enclosure of fl_F(Σ_j â_j v̂_j) over each run of ``group`` consecutive rows of Vv
    (row i·group + j is v̂_j of output row i; â ∈ [am ± ar] per row of Vv): Lemma F1 with
    ``group`` terms, the magnitudes from |â| <= up(|am| + ar) and |v̂| <= up(|mid| + rad)."""
    n = Vv.shape[0] // group
    rows = Vv.row_ids() // group
    T = I.scale_rows(Vv, am, ar)
    S = I.sum_terms((n, Vv.shape[1]), rows, Vv.indices, T.mid, T.rad)
    with np.errstate(invalid="ignore", over="ignore"):
        amag = I.up(np.abs(am) + ar)
        terms = I.up(_point(Vv).mid * amag[Vv.row_ids()])
    M = I.sum_terms(S.shape, rows, Vv.indices, terms, np.zeros(Vv.nnz))
    mag = I.upper(M.mid, M.rad)                       # the same pattern as S (same entries summed)
    a_max = np.zeros(n)
    np.maximum.at(a_max, np.arange(am.size) // group, amag)
    v_max = np.zeros(n)
    if Vv.nnz:
        np.maximum.at(v_max, rows, _point(Vv).mid)
    daz = _daz(group, a_max, v_max, dep)[S.row_ids()]
    rad = _widen(S.mid, S.rad, mag, dep.rel(group, ("mix",)), 0.0, dep.fmt.largest)
    return SparseInterval(S.shape, S.indptr, S.indices, S.mid, I.add_rad(rad, daz, dep.floor(group, ("mix",))))


# --- softmax ----------------------------------------------------------------------------------


def _shrink(f: float, u: float, s: int) -> float:
    """A lower bound of f·(1 − u)^s (f >= 0): s more roundings, each of relative error at most u."""
    for _ in range(s):
        f = float(I.down(f * I.down(1.0 - u)))
    return f


def _exp_constants(dep: Deployment) -> tuple[float, float, float, float]:
    """(rel, tiny, lower factor, upper factor) of Lemma F2's exps: the shifted score t̂ =
    fl_F(fl_A(ŝ − M)) is within rel·|ŝ − M| + tiny of ŝ − M, and ê = e^{t̂}(1 + δ)(1 + σ)^s
    (δ exp's error, σ the stores of its result) lies between the two factors times e^{t̂}."""
    kappa, u_F = dep.kappa, dep.fmt.u
    s_shift, s_exp = dep.stored(("softmax shift",)), dep.stored(("softmax exp",))
    rel = _grow(dep.work.u, u_F, s_shift)
    tiny = 2.0 ** dep.work.emin if not s_shift else 2.0 * (1 + s_shift) * 2.0 ** max(dep.fmt.emin, dep.work.emin)
    lo_factor = _shrink(float(I.down(1.0 - kappa)), u_F, s_exp)
    hi_factor = float(I.up(1.0 + _grow(kappa, u_F, s_exp)))
    return rel, tiny, lo_factor, hi_factor


def softmax_constants(V: int, dep: Deployment) -> np.ndarray:
    """The output softmax's constants for the compiled pass (verifier.kernels: SM_*): the
    exps' (:func:`_exp_constants`) and the valid mass's factors and τ (:func:`_factors`)."""
    return np.array([*_exp_constants(dep), *_factors(V, dep, mass=True)])


def _exp_terms(lo, hi, Mhi, c, dep: Deployment):
    """Lower and upper bounds of ê = e^{t̂}(1 + δ)(1 + σ)^s relative to the common shift c
    (Lemma F2; :func:`_exp_constants`)."""
    rel, tiny, lo_factor, hi_factor = _exp_constants(dep)
    with np.errstate(invalid="ignore", over="ignore"):
        theta = I.up(I.up(rel * I.up(Mhi - lo)) + tiny)   # + a flushed difference
        e_lo = I.down(I.exp_lo_unique(I.down(I.down(lo - theta) - c)) * lo_factor)
        e_hi = I.up(I.exp_hi_unique(I.up(I.up(hi + theta) - c)) * hi_factor)
    e_lo = np.where(np.isnan(e_lo), 0.0, np.maximum(e_lo, 0.0))
    e_hi = np.where(np.isnan(e_hi), np.inf, e_hi)
    return e_lo, e_hi


def _factors(n: int, dep: Deployment, mass: bool = False) -> tuple[float, float, float]:
    """(lower factor, upper factor, τ) of Lemma F2 for n terms; ``mass``: τ for a sum of
    outputs ((17n + 9)·ζ: the ζ's move the set's share by 8n·ζ, doubled by the
    upper factor, plus one ζ' per output). The factors are those of the sum Ŝ and the
    normalisation, with their stored results (:mod:`verifier.execution`)."""
    g = dep.rel(max(n - 1, 1), ("softmax sum",))
    kappa, u_F = dep.kappa, dep.fmt.u
    s_norm = dep.stored(("softmax normalise",))
    exp_lo = _shrink(float(I.down(1.0 - kappa)), u_F, dep.stored(("softmax exp",)))
    if not (kappa <= 0.5 and g <= 0.25 and exp_lo >= 0.5):
        return 0.0, float("inf"), 0.0
    f_lo = float(I.down(_shrink(float(I.down(1.0 - kappa)), u_F, s_norm) / I.up(1.0 + g)))
    f_hi = float(I.up(I.up(1.0 + _grow(kappa, u_F, s_norm)) / I.down(1.0 - g)))
    tau = float(I.up(((17.0 if mass else 8.0) * n + 9.0) * dep.zeta(("softmax exp", "softmax normalise"))))
    return f_lo, f_hi, tau


def softmax(lo: np.ndarray, hi: np.ndarray, mid: np.ndarray, dep: Deployment):
    """Enclosure (lo, hi) of the deployed softmax over the last axis (Lemma F2)."""
    n = lo.shape[-1]
    Mhi = np.max(hi, axis=-1, keepdims=True)
    c = np.max(np.where(np.isfinite(mid), mid, -np.inf), axis=-1, keepdims=True)
    c = np.where(np.isfinite(c), c, 0.0)
    e_lo, e_hi = _exp_terms(lo, hi, Mhi, c, dep)
    r_lo, r_hi = ratio_bounds(e_lo, e_hi)
    f_lo, f_hi, tau = _factors(n, dep)
    with np.errstate(invalid="ignore", over="ignore"):
        p_lo = np.maximum(I.down(I.down(r_lo * f_lo) - tau), 0.0)
        p_hi = I.up(I.up(r_hi * f_hi) + tau)
    return p_lo, np.where(np.isnan(p_hi), np.inf, p_hi)


def valid_mass_error(L: SparseInterval, V: int, valid_ptr: np.ndarray, valid: np.ndarray, dep: Deployment):
    """Enclosure (lo, hi) of 1 − Σ_{j valid} p̂_j for each row of logits L (n x V; absent
    logits are exactly 0 in every execution: a sum of no non-zero product), and the
    argmax token of the midpoints (−1 when a zero logit is at least as large)."""
    n = L.shape[0]
    rows = L.row_ids()
    lo, hi = I.lower(L.mid, L.rad), I.upper(L.mid, L.rad)
    # which stored logits are of valid tokens
    vrows = np.repeat(np.arange(n, dtype=np.int64), np.diff(valid_ptr))
    vkey = np.unique(vrows * V + np.asarray(valid, np.int64))
    is_valid = np.isin(rows * V + L.indices, vkey)
    n_stored = np.diff(L.indptr)
    zeros = V - n_stored                                     # logits exactly 0
    valid_stored = np.bincount(rows[is_valid], minlength=n)
    valid_zero = np.bincount(vkey // V, minlength=n) - valid_stored
    invalid_zero = zeros - valid_zero
    neg = np.full(n, -np.inf)
    Mhi = neg.copy()
    np.maximum.at(Mhi, rows, hi)
    Mhi = np.where(zeros > 0, np.maximum(Mhi, 0.0), Mhi)
    c = neg.copy()
    np.maximum.at(c, rows, np.where(np.isfinite(L.mid), L.mid, -np.inf))
    c = np.where(zeros > 0, np.maximum(c, 0.0), c)
    c = np.where(np.isfinite(c), c, 0.0)
    e_lo, e_hi = _exp_terms(lo, hi, Mhi[rows], c[rows], dep)
    z_lo, z_hi = _exp_terms(np.zeros(n), np.zeros(n), Mhi, c, dep)
    with np.errstate(invalid="ignore", over="ignore"):
        # A: the valid tokens' terms (lower and upper), B: the others'; every sum of
        # non-negative floats enclosed by Lemma 1 of verifier.interval.
        A_lo = np.bincount(rows[is_valid], weights=e_lo[is_valid], minlength=n) + I.down(valid_zero * z_lo)
        A_hi = np.bincount(rows[is_valid], weights=e_hi[is_valid], minlength=n) + I.up(valid_zero * z_hi)
        B_lo = np.bincount(rows[~is_valid], weights=e_lo[~is_valid], minlength=n) + I.down(invalid_zero * z_lo)
        B_hi = np.bincount(rows[~is_valid], weights=e_hi[~is_valid], minlength=n) + I.up(invalid_zero * z_hi)
        terms = int(n_stored.max(initial=0)) + 2
        A_lo, B_lo = I.down(A_lo * I.down(1.0 - I.gamma(terms))), I.down(B_lo * I.down(1.0 - I.gamma(terms)))
        A_hi, B_hi = I.up(A_hi * I.sum_factor(terms)), I.up(B_hi * I.sum_factor(terms))
        r_lo = I.down(A_lo / I.up(A_lo + B_hi))
        r_hi = I.up(A_hi / I.down(A_hi + B_lo))
    r_lo = np.where(np.isnan(r_lo), 0.0, r_lo)
    r_hi = np.where(np.isnan(r_hi), 1.0, np.minimum(r_hi, 1.0))
    f_lo, f_hi, tau = _factors(V, dep, mass=True)
    with np.errstate(invalid="ignore", over="ignore"):
        mass_lo = np.maximum(I.down(I.down(r_lo * f_lo) - tau), 0.0)
        total_hi = I.up(f_hi + tau)                  # Σ over every token of p̂_j
        mass_hi = np.minimum(I.up(I.up(r_hi * f_hi) + tau), total_hi)
    err_lo = I.down(1.0 - mass_hi)
    err_hi = np.minimum(I.up(1.0 - mass_lo), 1.0)
    # the argmax of the midpoints (for reports only)
    best = np.full(n, -1, np.int64)
    if L.nnz:
        order = np.lexsort((-L.mid, rows))
        first = order[np.concatenate([[0], np.cumsum(n_stored)[:-1]])[n_stored > 0]]
        has = np.flatnonzero(n_stored > 0)
        top = L.mid[first]
        best[has] = np.where((zeros[has] > 0) & (top <= 0), -1, L.indices[first])
    return err_lo, err_hi, best


# --- the pass ---------------------------------------------------------------------------------


def _t(M: sp.spmatrix) -> tuple[sp.csr_matrix, sp.csr_matrix, int]:
    """(Mᵀ as CSR, |Mᵀ|, the most terms per entry of X·Mᵀ)."""
    T = I.as_csr(sp.csr_matrix(M).T.tocsr())
    T.sort_indices()
    return T, abs(T), _columns_terms(T)


def FloatPass(weights: Weights, dep: Deployment, source: str = "weights"):
    """The deployed forward pass of ``weights`` in ``dep.fmt``, enclosed for every execution:
    the compiled pass of :mod:`verifier.forward` with the deployment's stages added
    (:class:`verifier.forward.Prepared` with ``deployment``)."""
    from verifier.forward import Prepared

    weights.validate(source)
    return Prepared(weights, deployment=dep)


class NumpyFloatPass:
    """The deployed forward pass of ``weights`` in ``dep.fmt``, enclosed (see the module
    docstring); weights are rounded to the format once, here."""

    def __init__(self, weights: Weights, dep: Deployment, source: str = "weights") -> None:
        I.check_platform()
        weights.validate(source)
        self.dep = dep
        self.weights = weights
        w = round_weights(weights, dep.fmt, source)
        self.rounded = w
        self.E = I.as_csr(sp.csr_matrix(w.E))
        self.P = I.as_csr(sp.csr_matrix(w.P))
        self.heads = [tuple(_t(M) for M in (h.W_Q, h.W_K, h.W_V, h.W_O)) for h in w.heads]
        self.n_residual = 1 + sum(h[3][2] for h in self.heads)     # terms of r = h + Σ_m W_O^m c_m
        # per residual coordinate, the heads whose W_O writes it: only their additions round
        # (o_m is exactly 0 there for the others, and adding an exact 0 is exact)
        self.writers = np.zeros(self.E.shape[1], np.int64)
        for h in self.heads:
            self.writers += np.bincount(h[3][0].indices, minlength=self.E.shape[1]) > 0
        self.WG = _t(w.W_G)
        self.b_G = np.asarray(w.b_G, np.float64)
        self.W1 = [_t(e.W_1) for e in w.experts]
        self.W2 = [_t(e.W_2) for e in w.experts]
        self.b1 = [np.asarray(e.b_1, np.float64) for e in w.experts]
        self.UT = _t(w.U)

    # the embedding sums h_i = E[x_i] + P[i] (one addition each in F)
    def _embed(self, ids: np.ndarray) -> SparseInterval:
        n, p1 = ids.shape
        E, P = self.E, self.P
        flat = ids.reshape(-1)
        pos = np.tile(np.arange(p1), n)
        Er = E[flat].tocoo()
        Pr = P[pos].tocoo()
        S = I.sum_terms((flat.size, E.shape[1]), np.concatenate([Er.row, Pr.row]), np.concatenate([Er.col, Pr.col]),
                        np.concatenate([Er.data, Pr.data]), np.zeros(Er.nnz + Pr.nnz))
        return rounded_sum(S, I.upper(np.abs(S.mid), S.rad), 2, self.dep, ("embedding",))

    def residual(self, ids: np.ndarray) -> tuple[SparseInterval, np.ndarray]:
        """Enclosure of the deployed r at the last position of each row of ids (BOS first),
        and per row whether any intermediate value may be non-finite (:func:`_unbounded`)."""
        n, p1 = ids.shape
        dep = self.dep
        Hall = self._embed(ids)                                   # (n·(p+1), d)
        bad = _unbounded(Hall).reshape(n, p1).any(axis=1)
        last = Hall.rows(np.arange(n) * p1 + p1 - 1)
        terms = [last]
        mags = [_point(last)]
        o_max = np.zeros(n)                     # per row: the largest |c| or |W_O| of a product term
        for (WQ, WK, WV, WO) in self.heads:
            Q = product(last, *WQ, dep, ("query",))
            K = product(Hall, *WK, dep, ("key",))
            Vv = product(Hall, *WV, dep, ("value",))
            bad |= _unbounded(Q) | _unbounded(K).reshape(n, p1).any(axis=1) | _unbounded(Vv).reshape(n, p1).any(axis=1)
            qm, qr = Q.dense()
            km, kr = K.dense()
            km, kr = km.reshape(n, p1, -1), kr.reshape(n, p1, -1)
            sm, sr = dot_last(qm[:, None, :], qr[:, None, :], km, kr, dep)           # (n, p+1)
            bad |= _unbounded_dense(sm, sr)
            a_lo, a_hi = softmax(I.lower(sm, sr), I.upper(sm, sr), sm, dep)
            am, ar = I.from_bounds(a_lo, a_hi)
            C = weighted_rows(Vv, am.reshape(-1), ar.reshape(-1), p1, dep)            # (n, d_v)
            bad |= _unbounded(C)
            terms.append(I.matmul(C, WO[0], WO[1]))
            mags.append(I.matmul(_point(C), WO[1], WO[1]))
            o_max = np.maximum(o_max, I.up(_row_max(C) + _col_max(WO[1]).max(initial=0.0)))
        S = I.sum_terms((n, self.E.shape[1]), np.concatenate([t.row_ids() for t in terms]),
                        np.concatenate([t.indices for t in terms]), np.concatenate([t.mid for t in terms]),
                        np.concatenate([t.rad for t in terms]))
        M = I.sum_terms(S.shape, np.concatenate([t.row_ids() for t in mags]), np.concatenate([t.indices for t in mags]),
                        np.concatenate([I.upper(t.mid, t.rad) for t in mags]), np.zeros(sum(t.nnz for t in mags)))
        mag = _aligned(S, SparseInterval(M.shape, M.indptr, M.indices, M.mid, M.rad))
        # every term passes through at most n_residual roundings in the working format and,
        # mixed, the head output's store and one per partial sum with a head writing its
        # coordinate (head by head; the execution model's "residual" step)
        steps = ("head output", "residual")
        writers = self.writers[S.indices]
        kinds = np.unique(writers)
        rel = np.zeros(writers.size)
        floor = np.zeros(writers.size)
        for w in kinds:
            at = writers == w
            rel[at], floor[at] = dep.rel(self.n_residual, steps, int(w)), dep.floor(self.n_residual, steps, int(w))
        if not kinds.size:
            dep.stored(steps)                       # (no entry: nothing rounds; the step is still consulted)
        rad = _widen(S.mid, S.rad, mag, rel, 0.0, dep.fmt.largest)
        daz = _daz(self.n_residual, o_max, 0.0, dep)[S.row_ids()]
        R = SparseInterval(S.shape, S.indptr, S.indices, S.mid, I.add_rad(rad, daz, floor))
        return R, bad | _unbounded(R)

    def _logits_error(self, Y: SparseInterval, valid_ptr, valid):
        """The error enclosure of each row, and whether its logits may be non-finite."""
        L = product(Y, *self.UT, self.dep, ("logits",))
        return valid_mass_error(L, len(self.weights.vocab), valid_ptr, valid, self.dep), _unbounded(L)

    def run_batch(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray,
                  ablate: np.ndarray | None = None, scores: bool = True) -> BatchResult:
        """The deployed pass over a batch (n x p token ids, weights' ids), as
        :func:`verifier.forward.run_batch` reports the exact one; rows are taken
        ``self.rows_per_chunk`` at a time so that the dense intermediates stay bounded."""
        tokens = np.asarray(tokens, np.int64)
        if tokens.ndim == 1:
            tokens = tokens[None, :]
        n = tokens.shape[0]
        vptr, vals = np.asarray(valid_ptr, np.int64), np.asarray(valid, np.int64)
        ablate = np.ones(n, bool) if ablate is None else np.asarray(ablate, bool)
        step = self.rows_per_chunk(tokens.shape[1] + 1)
        parts = []
        for a in range(0, n, step):
            rows = np.arange(a, min(a + step, n))
            vp, vv = _take(vptr, vals, rows)
            parts.append(self._run_chunk(tokens[rows], vp, vv, ablate[rows], scores))
        return _concat(parts) if len(parts) != 1 else parts[0]

    def rows_per_chunk(self, p1: int) -> int:
        """Rows per chunk: about 2·10⁶ entries in the widest dense intermediate."""
        widest = max([len(self.weights.experts), p1 * 64] + [e.width for e in self.weights.experts])
        return max(1, 2_000_000 // widest)

    def _run_chunk(self, tokens: np.ndarray, valid_ptr: np.ndarray, valid: np.ndarray, ablate: np.ndarray,
                   scores: bool) -> BatchResult:
        dep, w = self.dep, self.weights
        n = tokens.shape[0]
        K = len(w.experts)
        ids = np.concatenate([np.full((n, 1), w.bos, np.int64), tokens], axis=1)
        R, bad = self.residual(ids)
        gm, gr = affine(R, *self.WG, self.b_G, dep, ("gate product", "gate bias"))   # (n, K)
        bad |= _unbounded_dense(gm, gr)
        g_lo, g_hi = I.lower(gm, gr), I.upper(gm, gr)
        e = np.argmax(np.where(np.isfinite(gm), gm, -np.inf), axis=1)
        win_lo = g_lo[np.arange(n), e]
        others = g_hi.copy()
        others[np.arange(n), e] = -np.inf
        margin = I.down(win_lo - others.max(axis=1)) if K > 1 else np.where(np.isfinite(win_lo), np.inf, -np.inf)
        margin = np.where(np.isnan(margin), -np.inf, margin)
        may_win = g_hi >= win_lo[:, None]
        may_win[np.arange(n), e] = True
        may_win |= ~np.isfinite(win_lo)[:, None]
        cand_rows, cand = np.nonzero(may_win)
        cand_ptr = np.concatenate([[0], np.cumsum(may_win.sum(axis=1))]).astype(np.int64)
        if w.gate_mode == "top1-scaled":
            p_lo, p_hi = softmax(g_lo, g_hi, gm, dep)
            scale = (p_lo[cand_rows, cand], p_hi[cand_rows, cand])
        vptr = np.asarray(valid_ptr, np.int64)
        vals = np.asarray(valid, np.int64)
        err_lo, err_hi = np.full(n, np.inf), np.full(n, -np.inf)
        predicted = np.full(n, -1, np.int64)
        for k in np.unique(cand):
            sel = np.flatnonzero(cand == k)
            rows = cand_rows[sel]
            Rk = R.rows(rows)
            zm, zr = affine(Rk, *self.W1[k], self.b1[k], dep, ("expert product", "expert bias"))
            bad_k = _unbounded_dense(zm, zr)
            z_lo, z_hi = np.maximum(I.lower(zm, zr), 0.0), np.maximum(I.upper(zm, zr), 0.0)   # ReLU is exact
            Z = dense_interval(*I.from_bounds(z_lo, z_hi)).prune()   # ReLU(x) = 0 exactly where x <= 0
            Wz = product(Z, *self.W2[k], dep, ("expert output",))
            if w.gate_mode == "top1-scaled":
                cm, cr = I.from_bounds(scale[0][sel], scale[1][sel])
                Wz = I.scale_rows(Wz, cm, cr)
                with np.errstate(invalid="ignore", over="ignore"):
                    Wz = SparseInterval(Wz.shape, Wz.indptr, Wz.indices, Wz.mid,
                                        I.add_rad(_widen(Wz.mid, Wz.rad, I.upper(np.abs(Wz.mid), Wz.rad),
                                                         dep.rel(1, ("gate scale",)), dep.floor(0, ("gate scale",)),
                                                         dep.fmt.largest),
                                                  _daz(1, I.up(np.abs(cm) + cr)[Wz.row_ids()],
                                                       I.upper(np.abs(Wz.mid), Wz.rad), dep)))
            S = I.add(Rk, Wz)
            Y = rounded_sum(S, I.upper(np.abs(S.mid), S.rad), 2, dep, ("output sum",))
            vp, vv = _take(vptr, vals, rows)
            (lo, hi, pred), bad_L = self._logits_error(Y, vp, vv)
            np.logical_or.at(bad, rows, bad_k | _unbounded(Wz) | _unbounded(Y) | bad_L)
            np.minimum.at(err_lo, rows, lo)
            np.maximum.at(err_hi, rows, hi)
            routed = e[rows] == k
            predicted[rows[routed]] = pred[routed]
        ab_lo, ab_hi = np.full(n, np.nan), np.full(n, np.nan)
        ab = np.flatnonzero(ablate)
        if ab.size:
            vp, vv = _take(vptr, vals, ab)
            (ab_lo[ab], ab_hi[ab], _), bad_ab = self._logits_error(R.rows(ab), vp, vv)
            ab_lo[ab[bad_ab]], ab_hi[ab[bad_ab]] = 0.0, 1.0
        # A row any of whose intermediate values may be non-finite decides nothing: a dense
        # runtime multiplies every value, also by zero weights, and 0·inf = NaN spreads.
        ab_lo, ab_hi = np.where(bad & ablate, 0.0, ab_lo), np.where(bad & ablate, 1.0, ab_hi)
        margin = np.where(bad, -np.inf, margin)
        # (reported as the exact pass reports an undecided row: error [0, 1], margin −∞)
        err_lo, err_hi = np.where(bad, 0.0, err_lo), np.where(bad, 1.0, err_hi)
        top = np.argsort(-np.where(np.isfinite(gm), gm, -np.inf), axis=1, kind="stable")[:, :3]
        pad = 3 - top.shape[1]
        top_lo = np.take_along_axis(g_lo, top, axis=1)
        top_hi = np.take_along_axis(g_hi, top, axis=1)
        if pad > 0:
            top = np.concatenate([top, np.full((n, pad), -1)], axis=1)
            top_lo = np.concatenate([top_lo, np.full((n, pad), np.nan)], axis=1)
            top_hi = np.concatenate([top_hi, np.full((n, pad), np.nan)], axis=1)
        grad = np.where(np.isfinite(win_lo) & ~bad, np.max(np.where(np.isfinite(gr), gr, np.inf), axis=1), np.inf)
        return BatchResult(e.astype(np.int64), margin, ~(margin > 0), gm if scores else None, grad, err_lo, err_hi,
                           ab_lo, ab_hi, predicted, (top.astype(np.int64), top_lo, top_hi), (cand_ptr, cand.astype(np.int64)))


def _concat(parts: list[BatchResult]) -> BatchResult:
    """One result from results of consecutive row ranges."""
    def cat(get):
        return np.concatenate([get(r) for r in parts])

    offsets = np.cumsum([0] + [r.candidates[0][-1] for r in parts[:-1]])
    ptr = np.concatenate([[0]] + [r.candidates[0][1:] + o for r, o in zip(parts, offsets)]).astype(np.int64)
    top = tuple(cat(lambda r, i=i: r.top_gate[i]) for i in range(3))
    gm = cat(lambda r: r.gate_mid) if parts[0].gate_mid is not None else None
    return BatchResult(cat(lambda r: r.expert), cat(lambda r: r.margin), cat(lambda r: r.ambiguous), gm,
                       cat(lambda r: r.gate_rad), cat(lambda r: r.err_lo), cat(lambda r: r.err_hi),
                       cat(lambda r: r.ablated_lo), cat(lambda r: r.ablated_hi), cat(lambda r: r.predicted), top,
                       (ptr, cat(lambda r: r.candidates[1])))


def _take(ptr: np.ndarray, vals: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from verifier.batches import take_csr

    return take_csr(ptr, vals, rows)
