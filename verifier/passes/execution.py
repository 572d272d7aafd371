"""The deployed forward pass as data: every operation, where its result is stored, what a runtime may do.

A floating-point certificate (``check --precision F``) is a statement about every
execution of the layout's forward pass that this table allows. Each :class:`Step` is one
operation of the equations (docs/reference.md, *Weight layout*): what it computes, and for a
mixed-precision deployment (``--accumulate A``: values stored in F, arithmetic in the
wider A) how many results a term of it may have **rounded to the storage format F** on
its way through (``stores``), besides the roundings of the arithmetic itself in A.

The rule the table encodes: an operation is computed in A and its result is stored in F;
a sum may be computed in any order and grouping, and a runtime may store any partial sum
(``r ← r + o_m`` head by head stores each one), so a term's path can cross several
stored results. :mod:`verifier.passes.floating` asks :func:`stores` for the steps a quantity
passes through and bounds the rounding from that count, so every stored intermediate
listed here is counted; a test runs the float pass over a model exercising every step
and checks that each step was asked for, and the table in docs/precision.md is :func:`markdown`'s
output (tested too).

Why counting stores per path is enough (the bound :func:`verifier.passes.floating.Deployment.rel`
uses): a computed sum is Σ_i t_i·Π_{k ∈ path(i)} (1 + δ_k), the product over the
roundings term i passes through (Higham §3.1); a rounding in A has |δ| ≤ u_A, one to F
has |δ| ≤ u_F. With at most n roundings in A and s in F on any path,
|fl(Σ t) − Σ t| ≤ ((1 + u_A)^n (1 + u_F)^s − 1)·Σ|t_i|, whatever the order and grouping.
When A = F (no ``--accumulate``) storing a result is the rounding of the operation that
produced it, already among the n, so stores add nothing.

``stores`` of a step is ``fixed + per_head·H``: only the residual depends on H, the number
of heads whose W_O writes the coordinate (o_m is exactly 0 elsewhere, and adding an exact
zero is exact, so only those heads' additions round).

The ``ablation`` row is the model the localization check (L1, L2 and the ablated error,
:mod:`verifier.checks.localization`) certifies in a deployed pass: y = r exactly, so its
logits are U·r̂ through the ``logits`` row alone (``output sum`` is not on their path,
:func:`verifier.arithmetic.logits.ablated`), and its row says which ways of removing the
expert give exactly that y.
"""

from __future__ import annotations

from dataclasses import dataclass

ANY_ORDER = "a sum of products in any order and grouping, with or without fused multiply-add"


@dataclass(frozen=True)
class Step:
    """One operation of the deployed forward pass (see the module docstring)."""

    name: str
    computes: str
    stores: int                 # results rounded to the storage format on a term's path (mixed precision)
    allowed: str                # the orders, groupings and forms a runtime may use
    per_head: int = 0           # more stores per attention head (the residual summed head by head)
    exact: bool = False         # the operation itself is exact (max, ReLU, argmax, selection)

    def stores_for(self, heads: int) -> int:
        return self.stores + self.per_head * heads


#: The softmax's steps; every softmax of the pass (attention, gate scale, output) is these four.
SOFTMAX = ("softmax max", "softmax shift", "softmax exp", "softmax sum", "softmax normalise")

STEPS: tuple[Step, ...] = (
    Step("embedding", "h_i = E[x_i] + P[i]", 1, "one addition"),
    Step("query", "q = W_Q^m h_n", 1, ANY_ORDER),
    Step("key", "k_j = W_K^m h_j", 1, ANY_ORDER),
    Step("value", "v_j = W_V^m h_j", 1, ANY_ORDER),
    Step("score", "s_j = q · k_j", 1, ANY_ORDER + "; no scaling"),
    Step("softmax max", "M = max_j x_j", 0, "exact (an element of the row)", exact=True),
    Step("softmax shift", "t_j = x_j − M", 1, "one subtraction"),
    Step("softmax exp", "e_j = exp(t_j)", 1, "within K ulps (K·2^emin below the normal range)"),
    Step("softmax sum", "S = Σ_j e_j", 1, "any order and grouping"),
    Step("softmax normalise", "p_j = e_j / S", 1,
         "a division, or e_j times a reciprocal 1/S kept in the accumulation format; within K ulps"),
    Step("mix", "c_m = Σ_j a_j v_j", 1, ANY_ORDER),
    Step("head output", "o_m = W_O^m c_m", 1, ANY_ORDER),
    Step("residual", "r = h_n + Σ_m o_m", 0,
         "any order and grouping, each partial sum stored or not: head by head (r ← r + o_m), "
         "or one product over the concatenated heads; a coordinate no row of W_O^m writes gets an "
         "exact 0 from head m, whose addition is exact", per_head=1),
    Step("gate product", "W_G r", 1, ANY_ORDER),
    Step("gate bias", "g = W_G r + b_G", 1, "added after the product (MatMul, Add) or inside its sum"),
    Step("gate argmax", "e = argmax_k g_k", 0, "exact; a certified winner is strict", exact=True),
    Step("expert product", "W_1^e r", 1, ANY_ORDER),
    Step("expert bias", "z = W_1^e r + b_1^e", 1, "added after the product or inside its sum"),
    Step("relu", "ReLU(z)", 0, "exact", exact=True),
    Step("expert output", "W_2^e ReLU(z)", 1, ANY_ORDER + "; only the routed expert's output is used "
         "(the others not run, or discarded by selection)"),
    Step("gate scale", "c · W_2^e ReLU(z), c = softmax(g)_e", 1, "one multiplication (top1-scaled only)"),
    Step("output sum", "y = r + c · W_2^e ReLU(z)", 1, "one addition"),
    Step("ablation", "y = r", 0,
         "exact: the model the entanglement check (L1, L2, ablated error) is about, the routed expert removed, "
         "whichever expert that is, its logits the next row's with y = r; removed by not running its branch, by "
         "selecting exact zeros for its neurons or its output (a mask, `Where`: y = r + 0; a gate scale c applied "
         "after is finite wherever the gate decides), or by multiplying its "
         "output by 0 or setting its gate scale c to 0, which is exact only where that output is finite (0 · ∞ is "
         "NaN): the pass certifies the output W_2^e ReLU(z) of every expert that may be routed finite in the "
         "format, and a query where one may not be, or whose gate decides nothing, certifies no ablation. Not "
         "covered: every expert's output multiplied by a weight that is 0 for the removed one", exact=True),
    Step("logits", "l = U y", 1, ANY_ORDER),
)

_BY_NAME = {s.name: s for s in STEPS}
assert len(_BY_NAME) == len(STEPS) and all(n in _BY_NAME for n in SOFTMAX)


def step(name: str) -> Step:
    return _BY_NAME[name]


def stores(names: tuple[str, ...], heads: int = 0) -> int:
    """The most results rounded to the storage format on a term's path through ``names``."""
    return sum(_BY_NAME[n].stores_for(heads) for n in names)


def markdown() -> str:
    """The table as docs/precision.md shows it (docs/precision.md)."""
    rows = ["| step | computes | results stored in the format on a term's path (mixed precision) | allowed |",
            "|---|---|---|---|"]
    for s in STEPS:
        per = "per head writing the coordinate"
        count = "exact" if s.exact else (f"{s.per_head} {per}" if s.stores == 0 and s.per_head
                                         else str(s.stores) + (f" + {s.per_head} {per}" if s.per_head else ""))
        rows.append(f"| {s.name} | `{s.computes}` | {count} | {s.allowed} |")
    return "\n".join(rows)
