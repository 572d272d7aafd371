"""A block's listing (:mod:`construction.listing`) as text, Markdown, LaTeX or JSON.

Text is one line per pattern (``row ← column   expression   × count   e.g. …``);
a pattern of at most :data:`~construction.listing.LIST_UP_TO` entries, or every
pattern under ``all_entries``, is one line per entry. LaTeX is a labelled matrix
(sympy's printer for the entries) when the block's nonzero rows and columns are few,
else the list of patterns. JSON carries both the expression (sympy syntax) and its
LaTeX, so a script can rebuild the symbols.
"""

from __future__ import annotations

import json

import sympy

from construction.listing import LIST_UP_TO, Listing

#: Largest number of nonzero rows and of nonzero columns drawn as a LaTeX matrix.
LATEX_MATRIX_UP_TO = 24
EXAMPLES = 2


def _text(expr: sympy.Expr) -> str:
    return str(expr).replace("beta", "β").replace("gamma", "γ")


def _header(listing: Listing) -> str:
    m, b = listing.matrix, listing.block
    symbols = sorted({_text(s) for p in listing.patterns for s in listing.show(p.expr).free_symbols})
    where = f"; at {', '.join(f'{_text(k)} = {v}' for k, v in listing.values.items())}" if listing.values else \
        (f"; in {', '.join(symbols)}" if symbols else "")
    only = f" (row{'' if len(listing.rows_only) == 1 else 's'} {', '.join(listing.rows_only)} only)" \
        if listing.rows_only else ""
    return (f"{b.name}: {m.rows.dim} × {m.cols.dim}{only}, {listing.nnz:,} nonzero "
            f"entr{'y' if listing.nnz == 1 else 'ies'} in {len(listing.patterns)} pattern"
            f"{'' if len(listing.patterns) == 1 else 's'}{where}")


def _lines(listing: Listing, all_entries: bool) -> list[tuple[str, str, str]]:
    """(left side, value, note) rows: an entry, or a pattern standing for many, in
    row-major order of their (first) coordinates."""
    out = []
    for p in listing.patterns:
        value = _text(listing.show(p.expr))
        if all_entries or p.count <= LIST_UP_TO:
            out += [(int(i), int(j), f"{listing.row_label(i)} ← {listing.col_label(j)}", value, "")
                    for i, j in zip(p.rows, p.cols)]
            continue
        row, col = listing.placeholder(p)
        examples = ", ".join(f"{listing.row_label(i)} ← {listing.col_label(j)}"
                             for i, j in zip(p.rows[:EXAMPLES], p.cols[:EXAMPLES]))
        out.append((int(p.rows[0]), int(p.cols[0]), f"{row} ← {col}", value, f"× {p.count:,}   e.g. {examples}"))
    out.sort(key=lambda x: (x[0], x[1]))
    return [x[2:] for x in out]


def text(listing: Listing, all_entries: bool = False) -> str:
    rows = _lines(listing, all_entries)
    left = max((len(a) for a, _, _ in rows), default=0)
    mid = max((len(b) for _, b, _ in rows), default=0)
    body = [f"  {a.ljust(left)}   {b.ljust(mid)}   {c}".rstrip() for a, b, c in rows]
    return "\n".join([_header(listing)] + (body or ["  (no nonzero entries)"]))


def markdown(listing: Listing, all_entries: bool = False) -> str:
    cell = lambda s: s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")  # noqa: E731
    out = [f"#### `{listing.block.name}`", "", _header(listing), "", "| entry | value | note |", "|---|---|---|"]
    for a, b, c in _lines(listing, all_entries):
        out.append(f"| {cell(a)} | {cell(b)} | {cell(c)} |")
    return "\n".join(out)


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "⋆": r"$\star$", "<": r"$\langle$", ">": r"$\rangle$"}


def _tex_label(label: str) -> str:
    return r"\text{" + "".join(_LATEX_ESCAPES.get(ch, ch) for ch in label) + "}"


def latex(listing: Listing, all_entries: bool = False) -> str:
    """A labelled matrix of the nonzero rows and columns when both are at most
    :data:`LATEX_MATRIX_UP_TO`, else an aligned list of the patterns."""
    import numpy as np

    head = "% " + _header(listing)
    rows = np.unique(np.concatenate([p.rows for p in listing.patterns])) if listing.patterns else np.zeros(0, int)
    cols = np.unique(np.concatenate([p.cols for p in listing.patterns])) if listing.patterns else np.zeros(0, int)
    if not listing.patterns:
        return head + "\n% (no nonzero entries)"
    if rows.size <= LATEX_MATRIX_UP_TO and cols.size <= LATEX_MATRIX_UP_TO:
        cells = {}
        for p in listing.patterns:
            v = sympy.latex(listing.show(p.expr))
            for i, j in zip(p.rows, p.cols):
                cells[int(i), int(j)] = v
        out = [head, r"\[", r"\begin{array}{r|" + "c" * cols.size + "}",
               " & " + " & ".join(_tex_label(listing.col_label(j)) for j in cols) + r" \\ \hline"]
        for i in rows:
            out.append(_tex_label(listing.row_label(i)) + " & "
                       + " & ".join(cells.get((int(i), int(j)), "0") for j in cols) + r" \\")
        return "\n".join(out + [r"\end{array}", r"\]"])
    out = [head, r"\begin{align*}"]
    for p in listing.patterns:
        v = sympy.latex(listing.show(p.expr))
        if all_entries or p.count <= LIST_UP_TO:
            out += [f"{_tex_label(listing.row_label(i))} \\leftarrow {_tex_label(listing.col_label(j))} &: {v} \\\\"
                    for i, j in zip(p.rows, p.cols)]
        else:
            row, col = listing.placeholder(p)
            out.append(f"{_tex_label(row)} \\leftarrow {_tex_label(col)} &: {v} && (\\times {p.count}) \\\\")
    return "\n".join(out + [r"\end{align*}"])


def data(listing: Listing, all_entries: bool = False) -> dict:
    m = listing.matrix
    pats = []
    for p in listing.patterns:
        row, col = listing.placeholder(p)
        shown = listing.show(p.expr)
        item = {"row": row, "col": col, "same_label": p.same, "value": str(shown), "latex": sympy.latex(shown),
                "count": p.count,
                "examples": [[listing.row_label(i), listing.col_label(j)]
                             for i, j in zip(p.rows[:EXAMPLES], p.cols[:EXAMPLES])]}
        if all_entries:
            item["entries"] = [[listing.row_label(i), listing.col_label(j)] for i, j in zip(p.rows, p.cols)]
        pats.append(item)
    return {"block": listing.block.name, "shape": [m.rows.dim, m.cols.dim], "nonzero": listing.nnz,
            "at": {str(k): str(v) for k, v in listing.values.items()} if listing.values else None,
            "patterns": pats}


def render(listings: list[Listing], fmt: str, all_entries: bool = False) -> str:
    if fmt == "json":
        return json.dumps([data(x, all_entries) for x in listings], indent=2, ensure_ascii=False)
    one = {"text": text, "markdown": markdown, "latex": latex}[fmt]
    return "\n\n".join(one(x, all_entries) for x in listings)
