"""The trainable model: exactly the forward pass of :mod:`layout`, in torch.

For a prefix x_1..x_n with x_0 = BOS (token id V)::

    h_i    = E[x_i] + P[i]
    s^m_ij = (W_Q^m h_i) · (W_K^m h_j)          j <= i, no 1/sqrt(d) scaling
    r_n    = h_n + Σ_m W_O^m Σ_{j<=n} softmax_j(s^m_nj) W_V^m h_j
    g      = W_G r_n + b_G,  e = argmax_k g_k   (top-1; ties: the lowest index, as numpy)
    c      = softmax(g)_e ("top1-scaled", Switch-style)  or  1 ("top1")
    y      = r_n + c · W_2^e ReLU(W_1^e r_n + b_1^e)
    logits = U y

Only the last position n is computed (the prediction for the query). No layer norm, no
output bias, no scaling of attention scores: the layout has none, so a trained model
exports without approximation. With ``gate_mode = "top1-scaled"`` the gate gets a
gradient through c (as in the Switch Transformer); with plain ``"top1"`` it would get
none from the cross-entropy.

Parameters are stored stacked per head / per expert (``W_Q`` is (H, d_head, d), ``W_1``
is (K, w, d), ...). Experts may have different widths (``expert_widths``, e.g. sized
to the verifier's bound c(k)): the stack is as wide as the widest, and expert k's
neurons from ``expert_widths[k]`` on are *masked*: their activation is multiplied by an
exact 0, so they contribute nothing to the forward pass, receive no gradient, and the
export (:func:`training.export.to_weights`) keeps only the first ``expert_widths[k]``
neurons of expert k, computing the same floats. Initialisation scales: embeddings N(0, 1) per coordinate, query
and key maps so that initial scores are O(1) (the 1/sqrt(d_head) of standard attention
folded into W_Q), small gate (std 0.02 / sqrt(d), as in Switch), fan-in scaling
elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a :class:`MoETransformer`."""

    vocab_size: int          # V (BOS is the extra embedding row V)
    n_positions: int         # BOS + the longest prefix (the task set's L)
    d: int = 64              # residual width
    n_heads: int = 4
    d_head: int = 16         # width of W_Q, W_K, W_V rows per head (d_h = d_v)
    n_experts: int = 4
    expert_width: int = 32   # hidden neurons per expert (the stack's width)
    gate_mode: str = "top1-scaled"
    expert_widths: tuple[int, ...] | None = None   # per expert, each <= expert_width (None: all expert_width)

    def __post_init__(self) -> None:
        if self.expert_widths is not None:
            widths = tuple(int(w) for w in self.expert_widths)
            if len(widths) != self.n_experts or min(widths) < 1 or max(widths) > self.expert_width:
                raise ValueError(f"expert_widths must give {self.n_experts} widths in 1..{self.expert_width}, "
                                 f"got {self.expert_widths}")
            object.__setattr__(self, "expert_widths", widths)

    @property
    def widths(self) -> tuple[int, ...]:
        """The width of each expert (the exported W_1 has this many rows)."""
        return self.expert_widths or (self.expert_width,) * self.n_experts

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Output:
    """The forward pass of a batch of queries."""

    logits: torch.Tensor      # (B, V)
    gate: torch.Tensor        # (B, K) gate scores g
    expert: torch.Tensor      # (B,) chosen expert e
    gate_probs: torch.Tensor  # (B, K) softmax(g)
    residual: torch.Tensor    # (B, d) r_n
    ablated: torch.Tensor | None = None   # (A, V) logits U·r_n of the rows asked for (expert output removed)
    spread: torch.Tensor | None = None    # (B, H) per head, the largest minus the smallest visible attention score


class MoETransformer(nn.Module):
    """Single-layer MoE transformer in the layout of :mod:`layout`."""

    def __init__(self, config: ModelConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if config.gate_mode not in ("top1", "top1-scaled"):
            raise ValueError(f"gate_mode must be 'top1' or 'top1-scaled', got {config.gate_mode!r}")
        self.config = c = config
        V, d, H, dh, K, w = c.vocab_size, c.d, c.n_heads, c.d_head, c.n_experts, c.expert_width

        def normal(*shape: int, std: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator) * std)

        self.E = normal(V + 1, d, std=1.0)
        self.P = normal(c.n_positions, d, std=1.0)
        self.W_Q = normal(H, dh, d, std=1.0 / math.sqrt(d) / dh ** 0.25)
        self.W_K = normal(H, dh, d, std=1.0 / math.sqrt(d) / dh ** 0.25)
        self.W_V = normal(H, dh, d, std=1.0 / math.sqrt(d))
        self.W_O = normal(H, d, dh, std=1.0 / math.sqrt(dh * H))
        self.W_G = normal(K, d, std=0.02 / math.sqrt(d))
        self.b_G = nn.Parameter(torch.zeros(K))
        self.W_1 = normal(K, w, d, std=1.0 / math.sqrt(d))
        self.b_1 = nn.Parameter(torch.zeros(K, w))
        self.W_2 = normal(K, d, w, std=1.0 / math.sqrt(w))
        self.U = normal(V, d, std=1.0 / math.sqrt(d))
        mask = torch.arange(w)[None, :] < torch.tensor(c.widths)[:, None]
        self.register_buffer("neuron_mask", mask.to(self.W_1.dtype))           # (K, w), exact 0/1

    def residual(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """r_n for each row: tokens (B, T) with BOS first, lengths (B,) = n."""
        return self._residual(tokens, lengths)[0]

    def _residual(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """r_n for each row (see :meth:`residual`) and, per row and head, the spread of the
        visible attention scores (max − min over positions j <= n).

        The maps are linear, so W h_j = W E[x_j] + W P[j]: each head's query, key and value
        maps are applied once per vocabulary row and per position and then looked up (as
        the verifier's pass does), not once per (row, position); the same function in real
        arithmetic, and a float32 training step several times cheaper."""
        B, T = tokens.shape
        H, dh, d = self.W_Q.shape
        rows = torch.arange(B, device=tokens.device)
        last = tokens[rows, lengths]
        h_n = self.E[last] + self.P[lengths]                                # (B, d)

        def project(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            flat = W.reshape(H * dh, d).T
            return self.E @ flat, self.P[:T] @ flat                          # (V+1, H*dh), (T, H*dh)

        (EQ, PQ), (EK, PK), (EV, PV) = project(self.W_Q), project(self.W_K), project(self.W_V)
        q = (EQ[last] + PQ[lengths]).view(B, 1, H, dh)
        k = (EK[tokens] + PK.unsqueeze(0)).view(B, T, H, dh)
        s = (q * k).sum(-1)                                                 # (B, T, H)
        visible = torch.arange(T, device=tokens.device)[None, :] <= lengths[:, None]   # (B, T)
        spread = s.masked_fill(~visible[:, :, None], float("-inf")).amax(1) \
            - s.masked_fill(~visible[:, :, None], float("inf")).amin(1)    # (B, H)
        s = s.masked_fill(~visible[:, :, None], float("-inf"))
        a = torch.softmax(s, dim=1)                                         # over positions j <= n
        v = (EV[tokens] + PV.unsqueeze(0)).view(B, T, H, dh)
        o = (a.unsqueeze(-1) * v).sum(1).reshape(B, H * dh)                 # (B, H*dv)
        W_O = self.W_O.permute(1, 0, 2).reshape(d, H * dh)                  # [W_O^1 .. W_O^H]
        return h_n + o @ W_O.T, spread

    def expert_output(self, r: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """W_2^e ReLU(W_1^e r + b_1^e) for each row's expert e (computed per expert; the
        masked neurons' activations are multiplied by an exact 0)."""
        out = torch.zeros_like(r)
        for k in torch.unique(expert).tolist():
            idx = torch.nonzero(expert == k, as_tuple=True)[0]
            z = torch.relu(r[idx] @ self.W_1[k].T + self.b_1[k]) * self.neuron_mask[k].to(r.dtype)
            out = out.index_copy(0, idx, z @ self.W_2[k].T)
        return out

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor, expert: torch.Tensor | None = None,
                ablate: torch.Tensor | None = None) -> Output:
        """The layout's forward pass; ``expert`` overrides the routing. ``ablate`` (row
        indices or a bool mask) asks for those rows' logits with the routed expert's output
        removed (y = r, the layout's ablation): ``Output.ablated`` = U·r_n."""
        r, spread = self._residual(tokens, lengths)
        g = r @ self.W_G.T + self.b_G
        probs = torch.softmax(g, dim=-1)
        e = torch.argmax(g, dim=-1) if expert is None else expert
        out = self.expert_output(r, e)
        if self.config.gate_mode == "top1-scaled":
            out = probs.gather(1, e[:, None]) * out
        y = r + out
        ablated = None if ablate is None else r[ablate] @ self.U.T
        return Output(logits=y @ self.U.T, gate=g, expert=e, gate_probs=probs, residual=r, ablated=ablated,
                      spread=spread)

    def n_parameters(self) -> dict[str, int]:
        """Parameter counts of the exported model: total, largest expert, shared (everything
        but the experts); masked neurons are not parameters."""
        c = self.config
        per_expert = [2 * w * c.d + w for w in c.widths]
        stacked = sum(p.numel() for p in (self.W_1, self.b_1, self.W_2))
        shared = sum(p.numel() for p in self.parameters()) - stacked
        return {"total": shared + sum(per_expert), "per_expert": max(per_expert), "shared": shared}
