"""The forward pass as deployed in a floating-point format: the model, its bounds, its stages.

:mod:`verifier.passes.forward` encloses the *exact* forward pass of :mod:`layout` (real
arithmetic on the stored values). A deployed model computes in float32 or bfloat16, in
whatever order its kernels choose. With a :class:`Deployment`, the same compiled pass
encloses **every** execution of the layout's equations in a format F (:mod:`layout.formats`;
unit roundoff u, smallest subnormal η, largest finite Ω) that satisfies the execution model:

(F1) The weights are the stored values rounded to F (:func:`layout.formats.round_weights`).
(F2) Every step of :mod:`verifier.passes.execution`'s table is carried out in F (or, with
     ``--accumulate A``, computed in the wider A and its result rounded to F, any
     intermediate the table lists possibly stored in F), sums in **any order and
     grouping**, with or without fused multiply-add, with gradual underflow or results
     below the normal range flushed to zero, and inputs below it read as zero or not
     (denormals-are-zero, ``torch.set_flush_denormal(True)``). The runtime may be dense
     (it multiplies every value, also by zero weights, so one non-finite intermediate
     value anywhere in a query's computation can make its output NaN: such a query is
     never certified, see F4). Top-1 dispatch computes the routed expert or discards the
     others' outputs by selection; multiplying every expert's output by a one-hot weight,
     and padding a batch to a longer length, are outside the model.
(F3) Every softmax subtracts the row maximum, exponentiates, sums and divides; ``exp``
     and the division are within ``ulps`` units in the last place (``--ulps``, default
     4: relative error at most κ = 2·ulps·u, absolute max(ulps, 1)·2^emin below the
     normal range, which covers an exp that flushes tiny results to zero).
(F4) No intermediate value overflows: checked, not assumed. A query any of whose values
     (a key or value at any position, a score, a neuron of an expert that may win, its
     output W_2·ReLU(z) before the gate scale, a residual or logit entry, or a partial sum
     of any of them) may reach Ω is undecided: margin −∞, error [0, 1].
(F5) The ablated model (the localization check's) is y = r exactly, its logits U·r̂ (the
     execution model's ``ablation`` row): the routed expert's branch not run, or its
     neurons or output replaced by zeros by selection, or its output (or gate scale)
     multiplied by 0. The last is exact only for a finite output; by F4 every expert that
     may win has a finite output wherever a row is decided, and a row whose gate decides
     nothing (a runtime may route it anywhere) has its ablation undecided too.

**Lemma F1** (a stage's rounding; Higham §3.1). A computed sum is Σ_i t_i·Π_k (1 + δ_k)
over the roundings term i passes through; with at most n roundings in the working format
and s stored results on any path (:meth:`Deployment.rel`), it lies within
ρ·Σ_i |t_i| of the exact sum, ρ = (1 + u_A)^n (1 + u_F)^s − 1, whatever the order and
grouping, plus underflow: each of at most 2n + 2 operations and s stores loses less than
2^emin, carried through later roundings by at most 1 + ρ (:meth:`Deployment.floor`); and
inputs read as zero, each product x·w losing less than 2^emin·(|x| + |w|), so a sum less
than 2^emin·(Σ|x| + Σ|w|), carried by at most 2. A stage's input is itself an enclosure
(the stage before it), so the exact value of the stage over its inputs' enclosures, widened
by ρ·Σ|terms| (the terms' magnitudes bounded by |mid| + rad) and the absolute allowances,
encloses the deployed value. :class:`Stages` holds every stage's ρ and floor for given
weights; the compiled pass adds them to the exact pass's enclosures (verifier.passes.forward,
``Deployed``; verifier.arithmetic.deployed, the kernels' ``deployed`` arguments).

**Lemma F2** (softmax in F). Let ŝ be the computed scores, M = max ŝ, t̂_j the shifted
score as computed and stored (|t̂_j − (ŝ_j − M)| <= rel·W_j + tiny, W_j = max_l hi_l − lo_j),
ê_j = e^{t̂_j}(1 + δ_j)(1 + σ_j) + ζ_j (exp's error, its stores, |ζ_j| <= ζ below the normal
range), Ŝ = fl(Σ ê) within (1 ± ρ_S) of Σê (its stores counted), p̂_j = ê_j/Ŝ·(1 ± κ)(1 ± u_F)^s
+ ζ'_j. The shift M is common to every e^{t̂_j} and cancels in ê_j/Σê except through the
ζ's; since t̂ = 0 at the maximum, Σê >= 1/2, and the ζ's move the ratio by at most 4(n+1)·ζ.
Hence p̂_j lies in [R_lo·f_lo − τ, R_hi·f_hi + τ] (:func:`_factors`), where [R_lo, R_hi] encloses
e_j/Σ_l e_l over the exps' enclosures (:func:`verifier.arithmetic.interval.ratio_bounds`, any common
shift). A sum of p̂_j over a set of tokens (the valid next tokens) is bounded the same way
from the two sums A (the set) and B (the rest), A/(A + B) being increasing in A and
decreasing in B, with τ for the whole sum. The deployed outputs need not sum to 1: the
error 1 − Σ_valid p̂_j may be slightly negative, and is at most 1.

Everything is computed in float64 with the outward rounding of :mod:`verifier.arithmetic.interval`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from layout import Weights
from layout.formats import FORMATS, Format
from verifier.passes import execution
from verifier.arithmetic import interval as I
from verifier.arithmetic.deployed import KERNEL_CONSTANTS, SOFTMAX_CONSTANTS
from verifier.arithmetic.interval import ratio_bounds

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
    (:mod:`verifier.passes.execution`); every bound of the module uses acc's unit roundoff for
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
        execution model (:mod:`verifier.passes.execution`) beyond the arithmetic's own roundings:
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
        (the module docstring of :mod:`verifier.passes.execution`); ∞ when γ^A_ops is."""
        return _grow(self.gamma_work(ops), self.fmt.u, self.stored(steps, heads))

    def floor(self, ops: int, steps: tuple[str, ...], heads: int = 0) -> float:
        """The absolute underflow allowance of such a computation of ``ops`` products and
        additions (and a bias): at most 2·ops + 2 operations and s stores, each losing less
        than 2^emin, carried through later roundings by at most a factor 2."""
        carry = max(2.0, float(I.up(1.0 + self.rel(ops, steps, heads))))     # 1 + ρ, at least 2
        return float(I.up(I.up((2.0 * (ops + 1) + self.stored(steps, heads))
                               * 2.0 ** max(self.fmt.emin, self.work.emin))
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
        return (f"{self.fmt.name} (u = 2^-{self.fmt.p}; any summation order, with or without FMA, flushing subnormals "
                f"or not{acc}; exp and division within {self.ulps:g} ulps)")


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
    execution model of :mod:`verifier.passes.execution` read through :meth:`Deployment.rel` and
    :meth:`Deployment.floor`, for the numbers of terms these weights have. The compiled pass
    (:mod:`verifier.passes.forward`, :mod:`verifier.arithmetic.deployed`) adds, at each stage, ``rho`` times the
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
        """These stages for a cut of the weights (verifier.running.shards.compact): the residual
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
        """The scalars the kernels read, in the order
        :data:`verifier.arithmetic.deployed.KERNEL_CONSTANTS` names them (each an attribute here)."""
        return np.array([float(getattr(self, name)) for name in KERNEL_CONSTANTS])


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
    """The output softmax's constants for the compiled pass, in the order
    :data:`verifier.arithmetic.deployed.SOFTMAX_CONSTANTS` names them: the exps'
    (:func:`_exp_constants`) and the valid mass's factors and τ (:func:`_factors`)."""
    values = dict(zip(("rel", "tiny", "lo", "hi"), _exp_constants(dep)))
    values.update(zip(("f_lo", "f_hi", "tau"), _factors(V, dep, mass=True)))
    return np.array([values[name] for name in SOFTMAX_CONSTANTS])


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
    normalisation, with their stored results (:mod:`verifier.passes.execution`)."""
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
