"""Floating-point formats a model is deployed in, and the weights as stored in one.

A binary floating-point format with ``p`` significand bits (the implicit one included)
and exponents ``emin..emax`` has unit roundoff u = 2^-p (round to nearest: every result
is within u·|x| of the exact x, or within η/2 below the normal range), smallest
subnormal η = 2^(emin − p + 1) and largest finite number Ω = (2 − 2^(1−p))·2^emax.

============  ===  ======  =====  =========  ============
format        p    emin    emax   u          η
============  ===  ======  =====  =========  ============
float64       53   −1022   1023   2^-53      2^-1074
float32       24   −126    127    2^-24      2^-149
bfloat16      8    −126    127    2^-8       2^-133
============  ===  ======  =====  =========  ============

Deployed weights are the stored float64 values rounded to the format, to nearest with
ties to even. For bfloat16 the rounding goes through float32 first (float64 → float32 →
bfloat16, each to nearest even), which is what PyTorch's ``.to(torch.bfloat16)`` and an
ONNX ``Cast`` from a float32 model do; it can differ from one direct rounding in the last
place (a float64 value just above a bfloat16 tie lands on the tie in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from layout.weights import Expert, Head, Weights
from tasks.errors import TaskError


@dataclass(frozen=True)
class Format:
    """A binary floating-point format (see the module docstring)."""

    name: str
    p: int
    emin: int
    emax: int

    @property
    def u(self) -> float:
        return 2.0 ** -self.p

    @property
    def eta(self) -> float:
        return 2.0 ** (self.emin - self.p + 1)

    @property
    def largest(self) -> float:
        return (2.0 - 2.0 ** (1 - self.p)) * 2.0 ** self.emax

    def round(self, x: np.ndarray) -> np.ndarray:
        """``x`` (float64) rounded to this format, as float64 values (±inf on overflow)."""
        x = np.asarray(x, np.float64)
        with np.errstate(over="ignore"):
            if self.name == "float64":
                return x.copy()
            f32 = x.astype(np.float32)
            if self.name == "float32":
                return f32.astype(np.float64)
        # bfloat16: the upper 16 bits of a float32, rounded to nearest even on the lower 16.
        bits = f32.view(np.uint32).astype(np.uint64)
        finite = np.isfinite(f32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = np.where(finite, rounded, bits).astype(np.uint32).view(np.float32)
        return out.astype(np.float64)


FORMATS: dict[str, Format] = {
    "float64": Format("float64", 53, -1022, 1023),
    "float32": Format("float32", 24, -126, 127),
    "bfloat16": Format("bfloat16", 8, -126, 127),
}


def _round_matrix(M: sp.spmatrix, fmt: Format, name: str, source: str) -> sp.spmatrix:
    data = fmt.round(M.data)
    _finite(data, fmt, name, source)
    out = M.copy()
    out.data = data
    return out


def _finite(values: np.ndarray, fmt: Format, name: str, source: str) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise TaskError(f"{name} has a value that overflows {fmt.name} (largest finite {fmt.largest:.4g})",
                        file=source, fix=f"scale the weights into {fmt.name}'s range, or check at a wider precision")


def round_weights(weights: Weights, fmt: Format, source: str = "weights") -> Weights:
    """The weights as deployed in ``fmt``: every stored value rounded (a value that rounds
    to 0 stays stored, as an exact 0). Raises :class:`TaskError` if a value overflows."""
    if fmt.name == "float64":
        return weights

    def m(M, name):
        return _round_matrix(M, fmt, name, source)

    def v(x, name):
        out = fmt.round(x)
        _finite(out, fmt, name, source)
        return out

    heads = tuple(Head(m(h.W_Q, f"heads.{i}.W_Q"), m(h.W_K, f"heads.{i}.W_K"), m(h.W_V, f"heads.{i}.W_V"),
                       m(h.W_O, f"heads.{i}.W_O")) for i, h in enumerate(weights.heads))
    experts = tuple(Expert(m(e.W_1, f"experts.{k}.W_1"), v(e.b_1, f"experts.{k}.b_1"), m(e.W_2, f"experts.{k}.W_2"))
                    for k, e in enumerate(weights.experts))
    return weights.replace(E=m(weights.E, "E"), P=m(weights.P, "P"), heads=heads, W_G=m(weights.W_G, "W_G"),
                           b_G=v(weights.b_G, "b_G"), experts=experts, U=m(weights.U, "U"))
