"""Sparse matrices with exact symbolic entries.

A :class:`SymMatrix` is a finite sum ``Σ_t c_t · M_t`` where each ``c_t`` is a sympy
expression in the construction's parameters (β, γ) and each ``M_t`` is a
``scipy.sparse`` matrix whose entries are exact binary fractions (integers, 1/2,
1/16, ...), so float64 stores them without rounding. Entry (i, j) is the exact
expression ``Σ_t c_t · M_t[i, j]``.

Instantiation substitutes parameter values. When the values are themselves binary
fractions of few bits (the construction chooses them so), every product ``c_t · M_t``
is exact in float64, and :func:`SymMatrix.numeric` equals :func:`SymMatrix.exact`
entry for entry; ``tests/construction/test_construction.py`` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Iterator, Mapping

import numpy as np
import scipy.sparse as sp
import sympy

from construction.bases import Space


ONE = sympy.Integer(1)


def rational(x: float) -> sympy.Rational:
    """The exact rational value of a float (binary fraction)."""
    f = Fraction(float(x))
    return sympy.Rational(f.numerator, f.denominator)


@dataclass(frozen=True)
class SymMatrix:
    rows: Space
    cols: Space
    terms: tuple[tuple[sympy.Expr, sp.spmatrix], ...]   # CSR, or CSC for tall matrices

    @staticmethod
    def build(rows: Space, cols: Space, entries, coefficient: sympy.Expr = ONE) -> "SymMatrix":
        """From (row, col, value) triples; ``value`` a float that is an exact binary fraction.
        Repeated (row, col) entries are summed and zero entries dropped."""
        r, c, v = (np.asarray(a) for a in entries) if entries else (np.zeros(0, int), np.zeros(0, int), np.zeros(0))
        r, c, v = r.astype(np.int64), c.astype(np.int64), v.astype(np.float64)
        # a tall matrix (W_2, W_O: residual rows) is stored by columns, so its offsets
        # grow with its few columns, not with the residual width
        tall = rows.dim > cols.dim
        m = _in_order(c, r, v, (rows.dim, cols.dim), tall) if tall else _in_order(r, c, v, (rows.dim, cols.dim), tall)
        if m is None:
            coo = sp.coo_matrix((v, (r, c)), shape=(rows.dim, cols.dim))
            m = coo.tocsc() if tall else coo.tocsr()
            m.sum_duplicates()
            m.eliminate_zeros()
        return SymMatrix(rows, cols, ((sympy.sympify(coefficient), m),))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows.dim, self.cols.dim)

    @property
    def nnz(self) -> int:
        return sum(m.nnz for _, m in self.terms)

    @property
    def free_symbols(self) -> set[sympy.Symbol]:
        out: set[sympy.Symbol] = set()
        for c, _ in self.terms:
            out |= c.free_symbols
        return out

    def __add__(self, other: "SymMatrix") -> "SymMatrix":
        assert self.shape == other.shape
        return SymMatrix(self.rows, self.cols, self.terms + other.terms)

    def entry(self, i: int, j: int) -> sympy.Expr:
        """The exact symbolic entry (i, j)."""
        total = sympy.Integer(0)
        for c, m in self.terms:
            v = m[i, j]
            if v != 0:
                total += c * rational(v)
        return sympy.simplify(total) if len(self.terms) > 1 else total

    def entry_by_label(self, row: tuple[str, object], col: tuple[str, object]) -> sympy.Expr:
        return self.entry(self.rows.index(*row), self.cols.index(*col))

    def nonzeros(self) -> Iterator[tuple[int, int, sympy.Expr]]:
        """Every structurally nonzero entry with its exact expression."""
        support = self.support()
        for i, j in zip(*support.nonzero()):
            yield int(i), int(j), self.entry(int(i), int(j))

    def support(self) -> sp.csr_matrix:
        total = None
        for _, m in self.terms:
            s = (m != 0).astype(np.int8)
            total = s if total is None else total + s
        return total.tocsr()

    def numeric(self, values: Mapping[sympy.Symbol, float]) -> sp.csr_matrix:
        """Float64 instantiation (exact when parameters are short binary fractions).

        A single term with coefficient 1 is returned as is (shared, not copied: the
        matrices are never modified), so instantiation costs no memory for them.
        """
        if len(self.terms) == 1 and not self.terms[0][0].free_symbols and float(self.terms[0][0]) == 1.0:
            m = self.terms[0][1]
            if m.dtype == np.float64 and m.format in ("csr", "csc") and m.has_canonical_format:
                return m
        fmt = self.terms[0][1].format if self.terms else "csr"
        out = sp.csr_matrix(self.shape, dtype=np.float64).asformat(fmt)
        for c, m in self.terms:
            factor = float(c.subs(values)) if c.free_symbols else float(c)
            out = out + factor * m
        out = out.asformat(fmt)
        out.sum_duplicates()
        out.eliminate_zeros()
        return out

    def exact(self, values: Mapping[sympy.Symbol, sympy.Rational]) -> dict[tuple[int, int], sympy.Rational]:
        """Exact rational instantiation of every nonzero entry."""
        out: dict[tuple[int, int], sympy.Rational] = {}
        for c, m in self.terms:
            factor = sympy.nsimplify(c.subs(values), rational=True) if c.free_symbols else c
            coo = m.tocoo()
            for i, j, v in zip(coo.row, coo.col, coo.data):
                key = (int(i), int(j))
                out[key] = out.get(key, sympy.Integer(0)) + factor * rational(v)
        return {k: v for k, v in out.items() if v != 0}

    def describe(self, i: int, j: int) -> str:
        return f"[{self.rows.label(i)}, {self.cols.label(j)}] = {self.entry(i, j)}"


def _in_order(major: np.ndarray, minor: np.ndarray, values: np.ndarray, shape: tuple[int, int],
              by_columns: bool) -> sp.spmatrix | None:
    """The CSR (CSC when ``by_columns``) matrix of entries given already in its order: major
    index non-decreasing, minor index strictly increasing within a major index, no zero
    value. Such entries are the canonical arrays themselves (nothing to sum, sort or drop),
    so this is the matrix the general path (COO, sum duplicates, drop zeros) builds, array
    for array. None when the entries are not in that order."""
    n_major = shape[1] if by_columns else shape[0]
    if major.size and (np.any(major[1:] < major[:-1]) or major[0] < 0 or major[-1] >= n_major
                       or minor.min() < 0 or minor.max() >= (shape[0] if by_columns else shape[1])):
        return None
    same = major[1:] == major[:-1]
    if np.any(same & (minor[1:] <= minor[:-1])) or np.any(values == 0):
        return None
    indptr = np.zeros(n_major + 1, np.int64)
    np.cumsum(np.bincount(major, minlength=n_major), out=indptr[1:])
    return (sp.csc_matrix if by_columns else sp.csr_matrix)((values, minor, indptr), shape=shape)


def vector_space(n: int, name: str = "index") -> Space:
    from construction.bases import Block

    return Space((Block(name, tuple(range(n))),))
