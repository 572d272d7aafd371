"""The independent oracle for two-layer models (:class:`layout.layers.Stack`): the forward pass
of the two-layer layout in high-precision arithmetic, one query at a time.

Written apart from the verifier, as :mod:`audit.oracle` is, whose exact linear algebra and
layer-1 residual it reuses (:class:`audit.oracle.Oracle`: every linear map exact, only exp
and division rounded at ``dps`` digits). For a prefix it gives the exact values the
verifier's two-layer pass (:mod:`verifier.passes.layers`) encloses: both layers' gate
winners and margins, the error, and the errors with each layer's routed expert removed.
"""

from __future__ import annotations

from typing import Any

from audit.oracle import DPS, Oracle, _Fingerprints
from layout.layers import Stack


class LayersOracle:
    """Exact values of a two-layer model's queries (module docstring)."""

    def __init__(self, dps: int = DPS) -> None:
        self.oracle = Oracle(dps)
        self.dps = dps

    def _gate(self, c, W_G, b_G, y: dict[int, Any]) -> tuple[int, Any]:
        """(argmax, winner's score minus the runner-up's), exactly; a tie has margin 0."""
        rows = c.row_dicts(W_G)
        scores = []
        for k, row in enumerate(rows):
            pairs = [(a, y[j]) for j, a in row.items() if j in y]
            b = c.mp.mpf(float(b_G[k]))
            if b:
                pairs.append((b, c.one))
            scores.append(c.xdot(pairs) if pairs else c.zero)
        best = max(range(len(scores)), key=lambda k: scores[k])
        others = [s for k, s in enumerate(scores) if k != best]
        return best, (scores[best] - max(others)) if others else c.mp.inf

    def _expert(self, c, e, y: dict[int, Any]) -> dict[int, Any]:
        """y + W_2 ReLU(W_1 y + b_1), exactly."""
        act = {}
        for i, row in enumerate(c.row_dicts(e.W_1)):
            pairs = [(a, y[j]) for j, a in row.items() if j in y]
            b = c.mp.mpf(float(e.b_1[i]))
            if b:
                pairs.append((b, c.one))
            z = c.xdot(pairs) if pairs else c.zero
            if z > 0:
                act[i] = z
        out = dict(y)
        for i, v in c.matvec(c.rows(e.W_2), act).items():
            out[i] = c.xadd(out[i], v) if i in out else v
        return {j: v for j, v in out.items() if v}

    def query(self, stack: Stack, ids: tuple[int, ...], valid: frozenset[int]) -> dict[str, Any]:
        """The exact values of the query ``ids`` (the weights' token ids, BOS not included)."""
        o = self.oracle
        c = o.ctx(self.dps)
        w, s = stack.first, stack.second
        fp = _Fingerprints(w)
        _, r, _ = o._residual(c, w, fp, tuple(ids))
        e1, m1 = self._gate(c, w.W_G, w.b_G, r)
        y = self._expert(c, w.experts[e1], r)
        e2, m2 = self._gate(c, s.W_G, s.b_G, y)
        y2 = self._expert(c, s.experts[e2], y)
        err, _ = o._error(c, w, fp, y2, valid)
        # hop 1 removed: layer 2 runs on r; hop 2 removed: the logits of y
        a2, _ = self._gate(c, s.W_G, s.b_G, r)
        ab1, _ = o._error(c, w, fp, self._expert(c, s.experts[a2], r), valid)
        ab2, _ = o._error(c, w, fp, y, valid)
        return {"expert1": e1, "margin1": m1, "expert2": e2, "margin2": m2, "error": err,
                "ablated1": ab1, "ablated2": ab2}
