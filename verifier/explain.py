"""One query through the model: attention, gate, expert neurons, next tokens.

The numbers shown are a plain float64 evaluation (readable); the certified enclosure
of the error and the gate margin for the same query come from the certified pass.
"""

from __future__ import annotations

import numpy as np

from tasks.errors import TaskError
from tasks.model import TaskSet
from verifier.certify import certify
from layout import Weights
from verifier.reference import softmax


def tokenize(text: str, vocab: tuple[str, ...]) -> list[str]:
    """Split a prefix into tokens: the longest run of words that is a token wins.

    Entities may contain spaces (``New York City``); template words do not.
    """
    known = set(vocab)
    longest = max((len(t.split()) for t in vocab), default=1)
    words = text.split()
    out, i = [], 0
    while i < len(words):
        for span in range(min(longest, len(words) - i), 0, -1):
            cand = " ".join(words[i:i + span])
            if cand in known:
                out.append(cand)
                i += span
                break
        else:
            raise TaskError(f"the prefix has an unknown token {words[i]!r}", fix="use template words and entities of the task set")
    if not out:
        raise TaskError("the prefix is empty", fix="give at least one token, e.g. 'the capital of France is'")
    return out


def explain(taskset: TaskSet, weights: Weights, prefix: str, top: int = 5) -> dict:
    tokens = tokenize(prefix, weights.vocab)
    if len(tokens) >= weights.n_positions:
        raise TaskError(f"the prefix has {len(tokens)} tokens; the model takes at most {weights.n_positions - 1}",
                        fix="give a shorter prefix")
    index = {t: i for i, t in enumerate(weights.vocab)}
    ids = [weights.bos] + [index[t] for t in tokens]
    n = len(ids)
    H = weights.E[ids].toarray() + weights.P[:n].toarray()
    R = H.copy()
    heads = []
    for m, head in enumerate(weights.heads):
        q = H[-1] @ head.W_Q.T.toarray()
        k = H @ head.W_K.T.toarray()
        a = softmax(k @ q)
        heads.append({"head": m, "attention": {("<BOS>" if j == 0 else tokens[j - 1]) + f"@{j}": float(a[j]) for j in range(n)}})
        R[-1] += (a @ (H @ head.W_V.T.toarray())) @ head.W_O.T.toarray()
    r = R[-1]
    g = weights.W_G @ r + weights.b_G
    e = int(np.argmax(g))
    ex = weights.experts[e]
    z = ex.W_1 @ r + ex.b_1
    act = np.maximum(z, 0.0)
    labels = weights.neuron_labels[e] if weights.neuron_labels else None
    firing = [{"neuron": labels[i] if labels else int(i), "activation": float(act[i])} for i in np.argsort(-act)[:top] if act[i] > 0]
    out = ex.W_2 @ act
    if weights.gate_mode == "top1-scaled":
        out = softmax(g)[e] * out
    p = softmax(weights.U @ (r + out))
    best = np.argsort(-p)[:top]
    valid = _valid_next(taskset, tokens)
    cert = certify(weights, [tokens], [sorted(valid)])
    return {
        "prefix": tokens,
        "heads": heads,
        "gate": [{"expert": int(k), "task": weights.expert_tasks[k] or None, "score": float(g[k])} for k in np.argsort(-g)[:top]],
        "expert": e,
        "expert_task": weights.expert_tasks[e] or None,
        "neurons": firing,
        "next_tokens": [{"token": weights.vocab[t], "p": float(p[t])} for t in best],
        "valid_next": sorted(valid),
        "certified_error": [float(cert.err_lo[0]), float(cert.err_hi[0])] if valid else None,
        "certified_gate_margin": float(cert.margin[0]),
    }


def _valid_next(taskset: TaskSet, tokens: list[str]) -> set[str]:
    n = len(tokens)
    out = set()
    for sentence, _, _, _ in taskset.sentences():
        if len(sentence) > n and list(sentence[:n]) == tokens:
            out.add(sentence[n])
    return out


def render(info: dict) -> str:
    lines = [f"prefix: {' | '.join(info['prefix'])}"]
    for h in info["heads"]:
        att = ", ".join(f"{k} {v:.3f}" for k, v in h["attention"].items())
        lines.append(f"  head {h['head']}: {att}")
    lines.append("gate: " + ", ".join(f"expert {x['expert']} ({x['task']}) {x['score']:.4f}" for x in info["gate"]))
    lines.append(f"routed to expert {info['expert']} ({info['expert_task']}); certified margin {info['certified_gate_margin']:.4g}")
    lines.append("neurons: " + (", ".join(f"{x['neuron']} = {x['activation']:.4f}" for x in info["neurons"]) or "none fire"))
    lines.append("next: " + ", ".join(f"{x['token']} {x['p']:.4f}" for x in info["next_tokens"]))
    if info["certified_error"] is not None:
        lo, hi = info["certified_error"]
        lines.append(f"valid next: {info['valid_next']}; error in [{lo:.6g}, {hi:.6g}]")
    else:
        lines.append("this prefix is not a query of the task set (no valid next token)")
    return "\n".join(lines)
