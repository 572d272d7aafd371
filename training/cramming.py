"""Soft-prompt search by gradient descent ("cramming"), as the accessibility paper measures.

After Meyer, Michelessa, Chaux, Tan (arXiv 2605.22223) and the cramming experiments they
adapt (Kuratov et al., ACL 2025): m input vectors X ∈ R^{m×d} are optimised with Adam so
that the model, fed (BOS, X, t_1..t_{n−1}), predicts t_1..t_n at positions m..m+n−1
(cross-entropy, teacher forcing: every step's argmax being its target token is exactly
greedy reproduction). This module only *proposes* prompts: it is no proof. The verifier
(:func:`verifier.accessibility.accessible.certify`) then decides, in interval arithmetic over the box
X ± ε/2, whether the target is accessible.

The model is the layout's forward pass (docs/reference.md, "Weight layout") for soft inputs,
written here as gathers and scatter-adds over the stored entries of each matrix (the
built models are sparse and wide: the geography model has d = 8432), in float32 by
default (a proposal needs no more). Routing is the hard top-1 argmax, so the
gradient flows through the chosen expert (and through softmax(g)_e for "top1-scaled").

The search keeps X in the bound's support (:class:`verifier.accessibility.accessible.Support`): after
each step every vector is clamped to the per-coordinate ranges and scaled into the ball
of radius r (the ranges contain 0, so the scaling stays inside them). It stops when every
target is reproduced with a logit margin of at least ``margin`` (or the step or time
budget ends), and returns, per target, the prompt at its best margin.

Needs the ``train`` extra (torch). :mod:`verifier` never imports this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from layout import Weights
from verifier.accessibility.accessible import Support


#: While the model is smoothed, its own logits are looked at every this many steps.
CHECK_EVERY = 10


@dataclass(frozen=True)
class SearchBudget:
    """Adam steps per batch of targets, learning rate (betas (0.9, 0.9) and weight decay 0.01 as
    the paper's cramming runs), the logit margin a reproduced target must reach before the
    search stops, a time limit in seconds per batch (None: none), the seed, and the
    smoothing: the search starts at ``temperature`` (:meth:`SoftModel.logits`) and lowers
    it linearly to 0 (the model itself) over the first ``anneal`` fraction of the steps; it
    stops early once no target's best margin has grown for ``patience`` steps."""

    steps: int = 300
    lr: float = 0.05
    margin: float = 1.0
    seconds: float | None = None
    seed: int = 0
    temperature: float = 1.0
    anneal: float = 0.7
    patience: int = 40


@dataclass(frozen=True)
class _Linear:
    """x ↦ x @ W^T for a sparse W (out, in), as a gather of the columns W reads, a product by
    its entries and a scatter-add into its rows (each a plain torch op with a gradient)."""

    rows: torch.Tensor
    cols: torch.Tensor
    vals: torch.Tensor
    out: int

    @classmethod
    def of(cls, M, dtype: torch.dtype) -> "_Linear":
        C = sp.coo_matrix(M)
        return cls(torch.from_numpy(C.row.astype(np.int64)), torch.from_numpy(C.col.astype(np.int64)),
                   torch.from_numpy(C.data.astype(np.float64)).to(dtype), int(C.shape[0]))

    def terms(self, x: torch.Tensor) -> torch.Tensor:
        """The products x_j·W_ij, one per stored entry (..., nnz)."""
        return x.index_select(-1, self.cols) * self.vals

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out).index_add(-1, self.rows, self.terms(x))


class SoftModel:
    """The layout's forward pass with soft inputs at positions 1..m, in torch (``dtype``: the
    weights rounded to it; float32 by default, as fast and as good for proposing: the
    certificate is computed from the stored float64 weights)."""

    def __init__(self, weights: Weights, dtype: torch.dtype = torch.float32) -> None:
        self.weights = weights
        self.dtype = dtype

        def vec(v) -> torch.Tensor:
            return torch.from_numpy(np.asarray(v, np.float64)).to(dtype)

        self.heads = [tuple(_Linear.of(M, dtype) for M in (h.W_Q, h.W_K, h.W_V, h.W_O)) for h in weights.heads]
        self.W_G = _Linear.of(weights.W_G, dtype)
        self.b_G = vec(weights.b_G)
        self.experts = [(_Linear.of(e.W_1, dtype), vec(e.b_1), _Linear.of(e.W_2, dtype)) for e in weights.experts]
        self.U = _Linear.of(weights.U, dtype)
        self.E = weights.E.tocsr()
        self.P = vec(weights.P.toarray())

    def embed(self, ids: np.ndarray) -> torch.Tensor:
        """E[ids] as a dense tensor (..., d)."""
        ids = np.asarray(ids, np.int64)
        return torch.from_numpy(self.E[ids.reshape(-1)].toarray()).to(self.dtype).reshape(*ids.shape, -1)

    def logits(self, X: torch.Tensor, targets: np.ndarray, temperature: float = 0.0) -> torch.Tensor:
        """Logits (B, n, V) at positions m..m+n−1, for prompts X (B, m, d) and targets (B, n).

        ``temperature`` t > 0 smooths the model for the search (never for a decision):
        attention scores divided by 1 + t, and every expert's output weighted by
        softmax(g / t) instead of the hard top-1 choice. t = 0 is the model itself."""
        B, m, d = X.shape
        n = targets.shape[1]
        w = self.weights
        bos = self.embed(np.full((B, 1), w.bos))
        fed = self.embed(targets[:, : n - 1]) if n > 1 else X.new_zeros((B, 0, d))
        T = 1 + m + n - 1
        h = torch.cat([bos, X, fed], dim=1) + self.P[:T]
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
        rows, terms = [], []
        for W_Q, W_K, W_V, W_O in self.heads:
            s = W_Q(h) @ W_K(h).transpose(1, 2) / (1.0 + temperature)         # (B, T, T)
            a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
            rows.append(W_O.rows)
            terms.append(W_O.terms((a @ W_V(h))[:, m:]))
        r = h[:, m:]                                                           # the n prediction positions
        if terms:                                                              # + Σ_m W_O^m (heads' outputs)
            r = r.index_add(-1, torch.cat(rows), torch.cat(terms, dim=-1))
        g = self.W_G(r) + self.b_G
        if temperature > 0:
            mix = torch.softmax(g / temperature, dim=-1)
            out = sum(mix[..., k:k + 1] * W_2(torch.relu(W_1(r) + b_1))
                      for k, (W_1, b_1, W_2) in enumerate(self.experts))
            return self.U(r + out)
        e = torch.argmax(g, dim=-1)
        out = torch.zeros_like(r)
        for k, (W_1, b_1, W_2) in enumerate(self.experts):
            sel = e == k
            if sel.any():
                o = W_2(torch.relu(W_1(r[sel]) + b_1))
                if w.gate_mode == "top1-scaled":
                    o = torch.softmax(g[sel], dim=-1)[:, k:k + 1] * o
                out = out.index_put(sel.nonzero(as_tuple=True), o)
        return self.U(r + out)


def _margins(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,) the smallest, over a row's target steps, of the target logit minus the largest other."""
    t = targets.clamp_min(0)[..., None]
    gap = logits.gather(-1, t)[..., 0] - logits.scatter(-1, t, float("-inf")).max(dim=-1).values
    return torch.where(valid, gap, torch.full_like(gap, float("inf"))).min(dim=1).values


def _project(X: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, r: float) -> None:
    """Into the support: clamp per coordinate, then scale each vector into the ball of radius r."""
    with torch.no_grad():
        X.copy_(torch.maximum(torch.minimum(X, hi), lo))
        norm = X.norm(dim=-1, keepdim=True)
        # a little inside the ball: the scaled vector's computed norm must not round above r
        X.mul_(torch.where(norm > r, r * (1 - 2.0 ** -30) / norm.clamp_min(1e-300), torch.ones_like(norm)))


def search(weights: Weights, targets: np.ndarray, m: int, support: Support, budget: SearchBudget = SearchBudget(),
           model: SoftModel | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Soft prompts (B, m, d) proposed for ``targets`` (B, n) token ids (-1 pads a shorter
    target at its end), and whether each reproduced its target greedily in the search's
    arithmetic (a positive margin at every target step; the certificate decides). Each row starts from the embeddings of
    m random tokens (seeded): a point of the support."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # many small operations: one thread, and no spinning against other processes
    try:
        return _search(weights, targets, m, support, budget, model or SoftModel(weights))
    finally:
        torch.set_num_threads(threads)


def _search(weights: Weights, targets: np.ndarray, m: int, support: Support, budget: SearchBudget,
            model: SoftModel) -> tuple[np.ndarray, np.ndarray]:
    targets = np.asarray(targets, np.int64)
    B, n = targets.shape
    gen = np.random.default_rng(budget.seed)
    X = model.embed(gen.integers(0, len(weights.vocab), (B, m))).clone().requires_grad_(True)
    lo, hi = (torch.from_numpy(support.lo).to(model.dtype), torch.from_numpy(support.hi).to(model.dtype))
    _project(X, lo, hi, support.r)
    opt = torch.optim.AdamW([X], lr=budget.lr, betas=(0.9, 0.9), weight_decay=0.01)
    tgt = torch.from_numpy(targets)
    valid = tgt >= 0
    fed = np.maximum(targets, 0)                      # a pad is fed as token 0: it comes after every target step
    best = X.detach().clone()
    best_margin = torch.full((B,), -float("inf"), dtype=model.dtype)
    start = time.monotonic()

    last_gain = 0

    def keep(exact: torch.Tensor, i: int) -> torch.Tensor:
        nonlocal best_margin, last_gain
        with torch.no_grad():
            worst = _margins(exact, tgt, valid)
            better = worst > best_margin
            best[better] = X.detach()[better]
            best_margin = torch.where(better, worst, best_margin)
            if bool(better.any()):
                last_gain = i
        return best_margin

    for i in range(budget.steps):
        t = budget.temperature * max(0.0, 1.0 - i / max(1.0, budget.anneal * budget.steps))
        logits = model.logits(X, fed, t)
        if t == 0 or i % CHECK_EVERY == 0:               # the model itself: keep each row's best prompt
            with torch.no_grad():
                exact = logits if t == 0 else model.logits(X, fed)
            if bool((keep(exact, i) >= budget.margin).all()) or i - last_gain > budget.patience:
                break
        if budget.seconds is not None and time.monotonic() - start > budget.seconds:
            break
        loss = torch.nn.functional.cross_entropy(logits[valid], tgt[valid], reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
        _project(X, lo, hi, support.r)
    else:
        with torch.no_grad():
            keep(model.logits(X, fed), budget.steps)
    return support_projection(best.to(torch.float64).numpy(), support), (best_margin > 0).numpy()


def support_projection(X: np.ndarray, support: Support) -> np.ndarray:
    """X (…, d) moved into the support in float64: clamped to the ranges, then each vector
    longer than r scaled down (the ranges hold 0, so it stays in them) until its computed
    norm is at most r."""
    X = np.clip(np.asarray(X, np.float64), support.lo, support.hi)
    for _ in range(8):
        norm = np.sqrt(np.sum(X * X, axis=-1, keepdims=True))
        if np.all(norm <= support.r):
            return X
        X = np.where(norm > support.r, X * (support.r / np.maximum(norm, 1e-300) * (1 - 2.0 ** -40)), X)
    raise AssertionError("a prompt could not be scaled into the support")


def proposer(weights: Weights, budget: SearchBudget = SearchBudget()):
    """The search as :func:`verifier.accessibility.accessible.soft_accessibility` calls it:
    ``propose(targets, m, seed) -> (prompts, found)``, in the bound's support, with one
    torch model built once."""
    from dataclasses import replace

    from verifier.accessibility.accessible import support

    model, sup = SoftModel(weights), support(weights)

    def propose(targets: np.ndarray, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        return search(weights, targets, m, sup, replace(budget, seed=seed), model)

    return propose
