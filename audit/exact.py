"""An independent high-precision forward pass (mpmath, 60 digits), for small sets.

Written apart from :mod:`verifier.passes.forward` (dense, straight from the layout's
equations, no interval logic). Weights are floats, hence exact rationals, and are
converted to mpmath numbers exactly; at 60 significant digits the only error is
mpmath's own rounding, some 40 orders of magnitude below the verifier's enclosure
widths. Tests check that every enclosure the verifier reports contains these values.
"""

from __future__ import annotations

import mpmath

from layout import Weights


def _row(m, i, ctx):
    row = m.getrow(i).tocoo()
    return {int(j): ctx.mpf(float(v)) for j, v in zip(row.col, row.data)}


def _apply(m, vec: dict, ctx) -> dict:
    """m @ vec for a sparse matrix m and a sparse dict vector."""
    out: dict = {}
    csc = m.tocsc()
    for j, x in vec.items():
        for p in range(csc.indptr[j], csc.indptr[j + 1]):
            i = int(csc.indices[p])
            out[i] = out.get(i, ctx.mpf(0)) + ctx.mpf(float(csc.data[p])) * x
    return out


def _add(a: dict, b: dict, ctx, scale=1) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, ctx.mpf(0)) + scale * v
    return out


def exact_forward(weights: Weights, token_ids: list[int], valid: set[int], dps: int = 60) -> dict:
    """Gate scores, chosen expert and error 1 − P(valid) at ``dps`` digits."""
    ctx = mpmath.mp.clone()
    ctx.dps = dps
    ids = [weights.bos] + list(token_ids)
    H = [_add(_row(weights.E, t, ctx), _row(weights.P, j, ctx), ctx) for j, t in enumerate(ids)]
    r = dict(H[-1])
    for head in weights.heads:
        q = _apply(head.W_Q, H[-1], ctx)
        scores = []
        for h in H:
            k = _apply(head.W_K, h, ctx)
            scores.append(ctx.fsum(q[i] * k[i] for i in q if i in k))
        top = max(scores)
        ex = [ctx.exp(s - top) for s in scores]
        z = ctx.fsum(ex)
        mixed: dict = {}
        for a, h in zip(ex, H):
            mixed = _add(mixed, _apply(head.W_V, h, ctx), ctx, a / z)
        r = _add(r, _apply(head.W_O, mixed, ctx), ctx)
    g = _apply(weights.W_G, r, ctx)
    gates = [g.get(k, ctx.mpf(0)) + ctx.mpf(float(weights.b_G[k])) for k in range(len(weights.experts))]
    e = max(range(len(gates)), key=lambda k: gates[k])
    ex = weights.experts[e]
    pre = _apply(ex.W_1, r, ctx)
    act = {}
    for i in range(ex.width):
        v = pre.get(i, ctx.mpf(0)) + ctx.mpf(float(ex.b_1[i]))
        if v > 0:
            act[i] = v
    out = _apply(ex.W_2, act, ctx)
    if weights.gate_mode == "top1-scaled":
        gmax = max(gates)
        c = ctx.exp(gates[e] - gmax) / ctx.fsum(ctx.exp(x - gmax) for x in gates)
        out = {k: c * v for k, v in out.items()}
    y = _add(r, out, ctx)
    logits = _apply(weights.U, y, ctx)
    V = len(weights.vocab)
    full = [logits.get(t, ctx.mpf(0)) for t in range(V)]
    top = max(full)
    ex_l = [ctx.exp(x - top) for x in full]
    z = ctx.fsum(ex_l)
    err = ctx.fsum(ex_l[t] for t in range(V) if t not in valid) / z
    return {"gates": gates, "expert": e, "error": err}


def exact_logits(weights: Weights, inputs: list, dps: int = 60) -> dict:
    """Gate scores and, for every expert attaining the maximum score, the logits at the last
    position, at ``dps`` digits, for inputs given per position (BOS first): a token id
    (h_j = E[x] + P[j]) or a float vector x (h_j = x + P[j], a soft prompt's vector).

    The same equations as :func:`exact_forward`, written for arbitrary input vectors (the
    accessibility analysis's soft prompts); floats convert to mpmath exactly.
    """
    ctx = mpmath.mp.clone()
    ctx.dps = dps
    H = []
    for j, x in enumerate(inputs):
        if isinstance(x, (int,)) or (hasattr(x, "ndim") and x.ndim == 0):
            e = _row(weights.E, int(x), ctx)
        else:
            e = {i: ctx.mpf(float(v)) for i, v in enumerate(x) if v != 0}
        H.append(_add(e, _row(weights.P, j, ctx), ctx))
    r = dict(H[-1])
    for head in weights.heads:
        q = _apply(head.W_Q, H[-1], ctx)
        scores = []
        for h in H:
            k = _apply(head.W_K, h, ctx)
            scores.append(ctx.fsum(q[i] * k[i] for i in q if i in k))
        top = max(scores)
        ex = [ctx.exp(s - top) for s in scores]
        z = ctx.fsum(ex)
        mixed: dict = {}
        for a, h in zip(ex, H):
            mixed = _add(mixed, _apply(head.W_V, h, ctx), ctx, a / z)
        r = _add(r, _apply(head.W_O, mixed, ctx), ctx)
    g = _apply(weights.W_G, r, ctx)
    gates = [g.get(k, ctx.mpf(0)) + ctx.mpf(float(weights.b_G[k])) for k in range(len(weights.experts))]
    best = max(gates)
    logits = {}
    for e in (k for k, v in enumerate(gates) if v == best):
        ex = weights.experts[e]
        pre = _apply(ex.W_1, r, ctx)
        act = {}
        for i in range(ex.width):
            v = pre.get(i, ctx.mpf(0)) + ctx.mpf(float(ex.b_1[i]))
            if v > 0:
                act[i] = v
        out = _apply(ex.W_2, act, ctx)
        if weights.gate_mode == "top1-scaled":
            c = ctx.exp(gates[e] - best) / ctx.fsum(ctx.exp(x - best) for x in gates)
            out = {k: c * v for k, v in out.items()}
        y = _add(r, out, ctx)
        lg = _apply(weights.U, y, ctx)
        logits[e] = [lg.get(t, ctx.mpf(0)) for t in range(len(weights.vocab))]
    return {"gates": gates, "logits": logits}
