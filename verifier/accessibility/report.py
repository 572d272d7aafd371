"""The accessibility analysis as a report: JSON (every sequence with its proof) and text.

The JSON fields are documented in the docs/accessibility.md; a proof entry
reads back into a :class:`verifier.accessibility.accessible.Proof` with :func:`proof_from_json`, for
:func:`verifier.accessibility.accessible.recheck`.
"""

from __future__ import annotations

import base64
import math

import numpy as np

from layout import Weights
from verifier.accessibility.accessible import (OUTSIDE, PART, SENTENCE, TOKEN_BOX, Analysis, Proof, SoftReport, Step)


def _finite(x: float) -> float | None:
    """A JSON number, or null for ±∞ / NaN (a gate with one expert has nothing to beat)."""
    return float(x) if math.isfinite(x) else None


def _proof_json(proof: Proof, ident: int, vocab: tuple[str, ...], kind: str) -> dict:
    """A proof as JSON: the prompt (token strings, or the soft prompt's float64 centres,
    little-endian, base64: exact), the box radius, and each certified step."""
    out: dict = {"id": ident, "kind": kind, "m": proof.m, "radius": proof.radius}
    if proof.prompt is not None:
        out["prompt"] = [vocab[t] for t in proof.prompt]
    else:
        out["soft_prompt"] = {"shape": list(proof.soft.shape), "dtype": "float64 little-endian",
                              "base64": base64.b64encode(proof.soft.astype("<f8").tobytes()).decode("ascii")}
    out["steps"] = [{"token": vocab[s.token], "logit_margin": _finite(s.margin), "experts": list(s.experts),
                     "gate_margin": _finite(s.gate_margin)} for s in proof.steps]
    return out


def proof_from_json(data: dict, vocab: tuple[str, ...]) -> Proof:
    """The :class:`Proof` a report's JSON entry describes (for :func:`recheck`)."""
    index = {t: i for i, t in enumerate(vocab)}
    steps = tuple(Step(index[s["token"]], math.inf if s["logit_margin"] is None else s["logit_margin"],
                       tuple(s["experts"]), math.inf if s["gate_margin"] is None else s["gate_margin"])
                  for s in data["steps"])
    if "prompt" in data:
        return Proof(tuple(index[t] for t in data["prompt"]), None, float(data["radius"]), steps)
    sp_ = data["soft_prompt"]
    soft = np.frombuffer(base64.b64decode(sp_["base64"]), "<f8").reshape(sp_["shape"]).astype(np.float64)
    return Proof(None, soft, float(data["radius"]), steps)


def report_json(analysis: Analysis, source: dict) -> dict:
    """The JSON report (docs/accessibility.md: every field)."""
    w, tok, soft = analysis.weights, analysis.tokens, analysis.soft
    vocab = w.vocab
    text = lambda ids: " ".join(vocab[t] for t in ids)  # noqa: E731
    proofs: list[dict] = []
    ids: dict[int, int] = {}

    def ref(proof: Proof, kind: str) -> int:
        key = id(proof)
        if key not in ids:
            ids[key] = len(proofs)
            proofs.append(_proof_json(proof, len(proofs), vocab, kind))
        return ids[key]

    sequences = [{"m": a.m, "n": len(a.tokens), "tokens": [vocab[t] for t in a.tokens], "text": text(a.tokens),
                  "kind": a.kind, "class": a.klass, "proof": ref(tok.proofs[a.proof], "token")} for a in tok.sequences]
    for entry, a in zip(sequences, tok.sequences):
        if a.witness is not None:
            entry["class_proof"] = None                   # numbered after every other proof (below)
    classes = {c: sum(1 for a in tok.sequences if a.klass == c) for c in (SENTENCE, PART, OUTSIDE)}
    facts = [{"task": f.task, "subject": f.subject, "object": f.object, "accessible": f.proof is not None,
              "kind": f.kind, "own_query": f.own_query,
              "proof": None if f.proof is None else ref(f.proof, "token" if f.kind == "token" else "soft")}
             for f in analysis.facts]
    out = {
        "format": "moe-accessibility/1",
        **source,
        "vocabulary": len(vocab), "d": w.d, "n_positions": w.n_positions, "experts": len(w.experts),
        "positions": f"a prompt of m vectors is continued by at most n_positions - m = {w.n_positions} - m tokens "
                     "(m + n <= n_positions; the last generated token is never fed back); lengths are capped there",
        "token_prompts": {
            "m": tok.m, "why": tok.why, "seconds": round(tok.seconds, 3),
            "levels": [{"m": lv.m, "prompts": lv.prompts, "n_max": lv.n_max, "distinct": lv.distinct,
                        "undecided": lv.undecided} for lv in tok.levels],
            "distinct_up_to_m": tok.union,
            "classes": classes,
        },
        "sequences": sequences,
        "facts": {
            "total": len(facts), "object_accessible": sum(f["accessible"] for f in facts),
            "by_token_prompt": sum(f["kind"] == "token" for f in facts),
            "by_soft_prompt": sum(f["kind"] == "soft" for f in facts),
            "own_query_enumerated": sum(f["own_query"] is not None for f in facts),
            "own_query_certified": sum(f["own_query"] is True for f in facts),
            "list": facts,
        },
        "soft_prompts": None if soft is None else _soft_json(soft, vocab, ref),
        "proofs": proofs,
        "every_object_accessible": analysis.every_object,
    }
    for entry, a in zip(sequences, tok.sequences):
        if a.witness is not None:
            entry["class_proof"] = ref(tok.witnesses[a.witness], "token")
    return out


def _soft_json(soft: SoftReport, vocab, ref) -> dict:
    b = soft.bound
    targets = [{"m": t.m, "target": [vocab[x] for x in t.target], "purpose": t.purpose, "found": t.found,
                "certified": t.certified, "certified_steps": len(t.proof.steps),
                "proof": ref(t.proof, "soft" if t.purpose != TOKEN_BOX else TOKEN_BOX) if t.proof.steps else None}
               for t in soft.targets]
    fit = None if soft.fit is None else {"slope": soft.fit[0], "intercept": soft.fit[1], "levels": soft.fit_levels}
    return {
        "epsilon": soft.epsilon, "radius": soft.radius, "seconds": round(soft.seconds, 3), "settings": soft.settings,
        "levels": [{"m": lv.m, "n_max": lv.n_max, "random_trials": lv.trials, "random_found": lv.found,
                    "random_certified": lv.certified, "distinct_certified": lv.distinct, "n50": lv.n50,
                    "n50_capped": lv.capped, "longest_certified": lv.longest} for lv in soft.levels],
        "n50_fit": fit,
        "bound": {**b.to_dict(), "log10_count_bound": {str(lv.m): b.log10_count(lv.m) for lv in soft.levels}},
        "ratio": soft.ratio,
        "paper_ratio": "about 5 to 20 (the paper's Table 1, pretrained models)",
        "in_support": soft.in_support,
        "targets": targets,
    }


def render(analysis: Analysis, name: str, shown: int = 10) -> list[str]:
    """The command's text report (``shown``: examples listed per list)."""
    w, tok, soft = analysis.weights, analysis.tokens, analysis.soft
    vocab = w.vocab
    text = lambda ids: " ".join(f"[{vocab[t]}]" if " " in vocab[t] else vocab[t] for t in ids)  # noqa: E731
    lines = [f"{name}: |V| = {len(vocab)}, d = {w.d}, {len(w.experts)} experts, {w.n_positions} positions: "
             f"a prompt of m vectors is continued by at most {w.n_positions} - m tokens"]
    total = sum(lv.prompts for lv in tok.levels)
    lines.append(f"token prompts of 1..{tok.m} tokens ({tok.why}): {total:,} prompts, {tok.seconds:.1f} s")
    lines.append("   m    prompts  distinct certified sequences, n = 1, 2, ...   undecided at step n")
    for lv in tok.levels:
        lines.append(f"  {lv.m:>2} {lv.prompts:>10,}  {' '.join(str(x) for x in lv.distinct):<42}  "
                     f"{' '.join(str(x) for x in lv.undecided)}")
    lines.append(f"  up to m = {tok.m}: {' '.join(str(x) for x in tok.union)} distinct sequences by length")
    outside = [a for a in tok.sequences if a.klass == OUTSIDE]
    counts = {c: sum(1 for a in tok.sequences if a.klass == c) for c in (SENTENCE, PART, OUTSIDE)}
    lines.append(f"  {len(tok.sequences):,} certified (m, sequence) pairs: {counts[SENTENCE]} whole sentences, "
                 f"{counts[PART]} parts of a sentence, {counts[OUTSIDE]} in no sentence of the task set")
    for a in outside[:shown]:
        lines.append(f"    not knowledge: \"{text(a.tokens)}\" after \"{text(tok.class_proof(a).prompt)}\"")
    n_facts = len(analysis.facts)
    ok = sum(f.proof is not None for f in analysis.facts)
    by_soft = sum(f.kind == "soft" for f in analysis.facts)
    own = [f for f in analysis.facts if f.own_query is not None]
    lines.append(f"facts: {ok}/{n_facts} objects certified accessible ({ok - by_soft} by token prompts, {by_soft} by "
                 f"soft prompts); the fact's own object query, for the {len(own)} facts whose query has <= {tok.m} "
                 f"tokens: {sum(f.own_query is True for f in own)} certified")
    for f in [f for f in analysis.facts if f.proof is None][:shown]:
        lines.append(f"    no certified prompt: {f.task}: {f.subject} -> {f.object}")
    if soft is not None:
        lines += _render_soft(soft, w, shown)
    lines.append("every fact's object is certified accessible" if analysis.every_object
                 else "NOT every fact's object is certified accessible (within these prompts and budgets)")
    return lines


def _render_soft(soft: SoftReport, w: Weights, shown: int) -> list[str]:
    b = soft.bound
    st = soft.settings
    lines = [f"soft prompts (box X +- epsilon/2, epsilon = {soft.epsilon:g}): {st['per_length']} random targets per "
             f"(m, n), {st['restarts']} start(s) each, {st['objects_searched']} of the "
             f"{st['objects_unreached_by_tokens']} objects no token prompt reaches; {soft.seconds:.1f} s",
             "   m  random certified / found / tried, n = 1, 2, ...   n50    longest  distinct certified by n"]
    for lv in soft.levels:
        cells = " ".join(f"{c}/{f}/{t}" for c, f, t in zip(lv.certified, lv.found, lv.trials))
        lines.append(f"  {lv.m:>2}  {cells:<44} {lv.n50:>5.2f}{'+' if lv.capped else ' '} {lv.longest:>6}   "
                     f"{' '.join(str(x) for x in lv.distinct)}")
    fit = ("none (fewer than two uncapped m)" if soft.fit is None
           else f"{soft.fit[0]:.3g} tokens per vector (intercept {soft.fit[1]:.3g}; m = {soft.fit_levels})")
    lines.append(f"  n50 slope: {fit}; '+': capped by the positions (a lower bound, left out of the fit)")
    lines.append(f"  the paper's bound: C = {b.C:.4g} (anisotropic {b.C_aniso:.4g}) tokens per vector, from d = {b.d}, "
                 f"|V| = {b.V}, r = {b.r:.4g}, epsilon = {b.epsilon:g}; #accessible <= 10^{b.log10_count(1):.4g} per "
                 f"vector")
    ratio = soft.ratio
    lines.append("  C / measured slope: " + ("undefined (the measured slope is not positive)" if ratio["C"] is None else
                                              f"{ratio['C']:.3g} (anisotropic {ratio['C_anisotropic']:.3g})")
                 + "; the paper: about 5 to 20 on pretrained models")
    width = soft.centre_only
    if width:
        by_token = sum(t.purpose == TOKEN_BOX for t in width)
        none = "" if any(t.certified for t in soft.targets) else f"no box certifies at epsilon = {soft.epsilon:g}: "
        lines.append(f"  {none}{len(width)} targets certified at the centre of their box (radius 0: {by_token} token "
                     f"prompts, {len(width) - by_token} found by the search) are not certified on the box X +- "
                     f"epsilon/2: over a box this wide the enclosures leave a step undecided (their width, not a "
                     f"proven change of output inside the box); a smaller --prompt-epsilon narrows them")
    lines.append(f"  every certified soft prompt's centre lies in the bound's support: "
                 f"{'yes' if soft.in_support else 'NO'} (the centres X only, not the whole boxes X +- epsilon/2)")
    return lines
