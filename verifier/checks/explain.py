"""One query through the model: attention, gate, expert neurons, next tokens.

The numbers shown are a plain float64 evaluation (readable); the certified enclosure
of the error and the gate margin for the same query come from the certified pass.
"""

from __future__ import annotations

import numpy as np

from tasks.errors import TaskError
from tasks.model import TaskSet
from verifier.checks.certify import certify
from layout import Weights
from verifier.passes.reference import softmax


MAX_READINGS = 20


def readings(text: str, vocab: tuple[str, ...], limit: int = MAX_READINGS) -> list[list[str]]:
    """Every way (up to ``limit``) to split ``text`` into tokens of the vocabulary.

    Entities may contain spaces (``New York City``) and words of templates (``the
    capital``), so a text can have several readings; they are listed longest tokens
    first. Raises :class:`TaskError` if there is none (naming the first unknown word).
    """
    known = set(vocab)
    longest = max((len(t.split()) for t in vocab), default=1)
    words = text.split()
    if not words:
        raise TaskError("the prefix is empty", fix="give at least one token, e.g. 'the capital of France is'")
    n = len(words)
    # tails[i]: the readings of words[i:], at most ``limit`` of them
    tails: list[list[list[str]]] = [[] for _ in range(n)] + [[[]]]
    for i in range(n - 1, -1, -1):
        for span in range(min(longest, n - i), 0, -1):
            cand = " ".join(words[i:i + span])
            if cand in known:
                for rest in tails[i + span]:
                    if len(tails[i]) < limit:
                        tails[i].append([cand] + rest)
    if not tails[0]:
        bad = next((words[i] for i in range(n) if not any(" ".join(words[i:i + s]) in known
                                                           for s in range(1, min(longest, n - i) + 1))), words[0])
        raise TaskError(f"the prefix has an unknown token {bad!r}",
                        fix="use template words and entities of the task set")
    return tails[0]


def tokenize(text: str, vocab: tuple[str, ...], is_query=None) -> tuple[list[str], str | None]:
    """The one reading of ``text`` (see :func:`readings`), and a note when it had to be chosen.

    With several readings, the one that is a query of the task set (``is_query``) wins; if
    none or several are queries the text is ambiguous and a :class:`TaskError` says so,
    listing readings and how to give the tokens explicitly (``--sep``).
    """
    options = readings(text, vocab)
    if len(options) == 1:
        return options[0], None
    shown = "; ".join(" | ".join(r) for r in options[:3]) + (" ..." if len(options) > 3 else "")
    queries = [r for r in options if is_query is not None and is_query(r)]
    if len(queries) == 1:
        return queries[0], f"the text has {len(options)} readings as tokens; the only one that is a query is used"
    raise TaskError(f"the prefix is ambiguous: it reads as {len(options)}{'+' if len(options) >= MAX_READINGS else ''} "
                    f"token sequences ({shown}){'' if queries or is_query is None else ', none of them a query'}",
                    fix="give the tokens explicitly, e.g. --sep '|' \"" + " | ".join(options[0]) + "\"")


def _lacking(token: str) -> TaskError:
    """The error for a token of the task set that the weights' vocabulary does not have."""
    return TaskError(f"the weights' vocabulary lacks {token!r}, a token of the task set (the weights were made for "
                     f"another task set)", fix="give weights built for this task set ('build' writes them)")


def explain(taskset: TaskSet, weights: Weights, prefix: str | list[str], top: int = 5) -> dict:
    """Trace one prefix: text (split into tokens, see :func:`tokenize`) or a list of tokens."""
    note = None
    if isinstance(prefix, str):
        try:
            tokens, note = tokenize(prefix, weights.vocab, lambda r: bool(_valid_next(taskset, r)))
        except TaskError as e:
            if not e.problem.startswith("the prefix has an unknown token"):
                raise
            try:                      # a token of the task set that the weights lack, or unknown to both?
                by_task_set = readings(prefix, taskset.vocabulary.tokens)
            except TaskError:
                raise e from None
            known = set(weights.vocab)
            raise _lacking(next(t for t in by_task_set[0] if t not in known)) from None
    else:
        tokens = [t.strip() for t in prefix]
        unknown = [t for t in tokens if t not in set(weights.vocab)]
        if unknown and unknown[0] in taskset.vocabulary.tokens:
            raise _lacking(unknown[0])
        if unknown or not tokens:
            raise TaskError(f"the prefix has an unknown token {unknown[0]!r}" if unknown else "the prefix is empty",
                            fix="use template words and entities of the task set")
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
        heads.append({"head": m, "role": _head_role(weights, m),
                      "attention": {("<BOS>" if j == 0 else tokens[j - 1]) + f"@{j}": float(a[j]) for j in range(n)}})
        R[-1] += (a @ (H @ head.W_V.T.toarray())) @ head.W_O.T.toarray()
    r = R[-1]
    g = weights.W_G @ r + weights.b_G
    e = int(np.argmax(g))
    ex = weights.experts[e]
    z = ex.W_1 @ r + ex.b_1
    act = np.maximum(z, 0.0)
    labels = weights.neuron_labels[e] if weights.neuron_labels else None
    firing = [{"neuron": labels[i] if labels else int(i), "activation": float(act[i])}
              for i in np.argsort(-act)[:top] if act[i] > 0]
    out = ex.W_2 @ act
    if weights.gate_mode == "top1-scaled":
        out = softmax(g)[e] * out
    p = softmax(weights.U @ (r + out))
    best = np.argsort(-p)[:top]
    valid = _valid_next(taskset, tokens)
    cert = certify(weights, [tokens], [sorted(valid)])
    return {
        "prefix": tokens,
        "note": note,
        "heads": heads,
        "gate": [{"expert": int(k), "task": weights.expert_tasks[k] or None, "score": float(g[k])}
                 for k in np.argsort(-g)[:top]],
        "expert": e,
        "expert_task": weights.expert_tasks[e] or None,
        "neurons": firing,
        "next_tokens": [{"token": weights.vocab[t], "p": float(p[t])} for t in best],
        "valid_next": sorted(valid),
        "certified_error": [float(cert.err_lo[0]), float(cert.err_hi[0])] if valid else None,
        "certified_gate_margin": float(cert.margin[0]),
    }


def _head_role(weights: Weights, m: int) -> str:
    """What head m writes, from the residual labels (``structure head: slot3``, ``subject head: subj``)."""
    if weights.residual_labels is None:
        return ""
    rows = np.unique(weights.heads[m].W_O.tocoo().row)
    blocks = sorted({weights.residual_labels[int(r)].split(":")[0] for r in rows})
    if blocks == ["subj"]:
        return "subject head, writes subj"
    if len(blocks) == 1 and blocks[0].startswith("slot"):
        return f"structure head, writes {blocks[0]}"
    return ("writes " + ", ".join(blocks[:4]) + (" ..." if len(blocks) > 4 else "")) if blocks else "writes nothing"


def _valid_next(taskset: TaskSet, tokens: list[str]) -> set[str]:
    n = len(tokens)
    out = set()
    for sentence, _, _, _ in taskset.sentences():
        if len(sentence) > n and list(sentence[:n]) == tokens:
            out.add(sentence[n])
    return out


def render(info: dict) -> str:
    lines = [f"prefix: {' | '.join(info['prefix'])}"]
    if info.get("note"):
        lines.append(f"note: {info['note']}")
    for h in info["heads"]:
        att = ", ".join(f"{k} {v:.3f}" for k, v in h["attention"].items())
        role = f" ({h['role']})" if h.get("role") else ""
        lines.append(f"  head {h['head']}{role}: {att}")
    lines.append("gate: " + ", ".join(f"expert {x['expert']} ({x['task']}) {x['score']:.4f}" for x in info["gate"]))
    lines.append(f"routed to expert {info['expert']} ({info['expert_task']}); certified margin "
                 f"{info['certified_gate_margin']:.4g}")
    lines.append("neurons: "
                 + (", ".join(f"{x['neuron']} = {x['activation']:.4f}" for x in info["neurons"]) or "none fire"))
    lines.append("next: " + ", ".join(f"{x['token']} {x['p']:.4f}" for x in info["next_tokens"]))
    if info["certified_error"] is not None:
        lo, hi = info["certified_error"]
        lines.append(f"valid next: {info['valid_next']}; error in [{lo:.6g}, {hi:.6g}]")
    else:
        lines.append("this prefix is not a query of the task set (no valid next token)")
    return "\n".join(lines)
