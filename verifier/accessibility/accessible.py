"""Certified accessibility: which sequences can the model be made to generate greedily?

After *How Many Different Outputs Can a Transformer Generate?* (Meyer, Michelessa, Chaux,
Tan; arXiv 2605.22223). Decoding is greedy. A *prompt* is m input vectors placed after
BOS at positions 1..m (h_i = x_i + P[i]); the generated tokens follow as ordinary
tokens. The model has ``n_positions`` = P.shape[0] positions, so a prompt of m vectors
is continued by at most n_positions − m tokens (the last generated token is never fed
back): m + n ≤ n_positions. That caps every length measured here; P is never extended.

A sequence t = t_1..t_n is **accessible** from a prompt *box* (centres X, radius ρ per
coordinate) when, for every input in the box and every k ≤ n, the greedy token after
(BOS, X, t_1..t_{k−1}) is t_k. It is **certified** so when :func:`verifier.passes.boxes.step`
certifies each step: every expert that may route the step (somewhere in the box) gives
t_k a logit whose lower end exceeds every other token's upper end. Then the greedy
continuation of every prompt in the box starts with t, whatever tie-break picks an
expert among tied gate scores. A step that is not so certified is *undecided*: counted,
never called accessible. The record of a certified sequence (the prompt, and per step
the token, its certified logit margin, the experts that may route it and the gate
margin) is its :class:`Proof`, which :func:`recheck` runs again.

* **Token prompts** (:func:`token_accessibility`): every prompt of up to m tokens is a
  box of radius 0 around its embeddings; the enumeration is exhaustive, refused with
  the count above a limit (|V|^m grows fast).
* **Soft prompts** (the paper's definition, :func:`certify`): X ∈ R^{m×d}, accessible at
  precision ε when the box X ± ε/2 is certified. The box contains the paper's Euclidean
  ball B(X, ε/2), so a certified box is a certified ball. The prompts come from a search
  (gradient descent, ``training.cramming``); only the certificate counts.

**The paper's bound** (:func:`paper_bound`): with inputs in a support of norm at most r,
#accessible ≤ (1 + 2r/ε)^{d·m}, so inaccessible sequences exist once n > C·m,
C = d·ln(1 + 2r/ε)/ln|V|; anisotropic form C = Σ_i ln(1 + r_i/ε)/ln|V| with per-coordinate
widths r_i. Convention here (:func:`support`): r is the largest Euclidean norm of a token
embedding row E[v] (v < |V|, BOS excluded), r_i the width of the range of coordinate i
over those rows and 0; ε is absolute (default 2^-10, as the paper's Table 1). The search
keeps its prompts in that support (the box of ranges and the ball of radius r), so the
bound counts every prompt certified here; the report checks that the centres X lie there
(the centres only: a box X ± ε/2 around one may reach beyond).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from layout import Weights
from tasks.errors import TaskError
from tasks.model import TaskSet
from verifier.passes import boxes
from verifier.passes.boxes import BoxModel

#: The paper's precision ε (absolute), as in their Table 1.
PAPER_EPSILON = 2.0 ** -10


# --- proofs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One certified greedy step: ``token`` wins at every input of the box.

    ``margin``: a lower bound, over the box and every expert in ``experts``, of the
    token's logit minus every other logit (> 0). ``experts``: the experts that may route
    the step somewhere in the box (one: the routing is certified). ``gate_margin``: a
    lower bound of the winner's gate score minus every other (≤ 0 when several may win).
    """

    token: int
    margin: float
    experts: tuple[int, ...]
    gate_margin: float


@dataclass(frozen=True)
class Proof:
    """A prompt box and its certified greedy steps (possibly none): the sequence
    ``tokens[:n]`` is accessible for every n ≤ len(steps)."""

    prompt: tuple[int, ...] | None       # token ids of a token prompt, or None
    soft: np.ndarray | None              # (m, d) centres of a soft prompt, or None
    radius: float                        # box radius per coordinate (0 for a token prompt)
    steps: tuple[Step, ...]

    @property
    def m(self) -> int:
        return len(self.prompt) if self.prompt is not None else int(self.soft.shape[0])

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(s.token for s in self.steps)


@dataclass(frozen=True)
class Run:
    """Greedy steps of a batch of prompt boxes, as arrays (B rows, n steps): ``token`` is
    the certified token of each step or -1 (undecided, or a step after one that was not
    certified, or after a target token that was not the certified one)."""

    token: np.ndarray         # (B, n)
    margin: np.ndarray        # (B, n) logit margin (NaN where the step did not run)
    gate_margin: np.ndarray   # (B, n)
    candidates: np.ndarray    # (B, n, K) bool
    undecided: np.ndarray     # (B, n) bool: the step ran and was not certified

    @property
    def certified_length(self) -> np.ndarray:
        """(B,) how many leading steps are certified."""
        bad = self.token < 0
        return np.where(bad.any(axis=1), np.argmax(bad, axis=1), self.token.shape[1])

    def proof(self, i: int, prompt: tuple[int, ...] | None, soft: np.ndarray | None, radius: float,
              n: int | None = None) -> Proof:
        """Row i's certified steps (the first ``n``) as a :class:`Proof`."""
        k = int(self.certified_length[i]) if n is None else n
        steps = tuple(Step(int(self.token[i, s]), float(self.margin[i, s]),
                           tuple(int(e) for e in np.flatnonzero(self.candidates[i, s])), float(self.gate_margin[i, s]))
                      for s in range(k))
        return Proof(prompt, None if soft is None else np.array(soft, np.float64), float(radius), steps)


def max_continuation(weights: Weights, m: int) -> int:
    """The most tokens a prompt of m vectors can be continued by: n_positions − m."""
    return max(0, weights.n_positions - m)


def run(model: BoxModel, prompts: np.ndarray | None, n: int, soft: np.ndarray | None = None, radius: float = 0.0,
        targets: np.ndarray | None = None) -> Run:
    """Certified greedy steps of B prompt boxes: token prompts ``prompts`` (B, m) with radius
    0, or soft prompts ``soft`` (B, m, d) with ``radius``. Without ``targets`` each step
    feeds back the certified token and a row stops at its first undecided step; with
    ``targets`` (B, n) it feeds the target token and stops where the certified token is
    not the target (a target is then accessible iff all n steps are certified)."""
    w = model.weights
    if (prompts is None) == (soft is None):
        raise ValueError("give token prompts or soft prompts")
    B, m = (prompts.shape if prompts is not None else soft.shape[:2])
    if m < 1 or n < 0 or m + n > w.n_positions:
        raise ValueError(f"a prompt of {m} vectors continued by {n} tokens needs {m + n} positions; "
                         f"the model has {w.n_positions}")
    K = len(w.experts)
    seq = np.full((B, 1 + m + n), -1, np.int64)
    seq[:, 0] = w.bos
    if prompts is not None:
        seq[:, 1:1 + m] = np.asarray(prompts, np.int64)
    out = Run(np.full((B, n), -1, np.int64), np.full((B, n), np.nan), np.full((B, n), np.nan),
              np.zeros((B, n, K), bool), np.zeros((B, n), bool))
    active = np.arange(B)
    for s in range(n):
        if not active.size:
            break
        st = boxes.step(model, seq[active, :1 + m + s], None if soft is None else soft[active], radius)
        out.margin[active, s] = st.margin
        out.gate_margin[active, s] = st.gate_margin
        out.candidates[active, s] = st.candidates
        out.undecided[active, s] = st.token < 0
        ok = st.token >= 0
        if targets is not None:
            ok &= st.token == targets[active, s]
        out.token[active[ok], s] = st.token[ok]
        seq[active, 1 + m + s] = np.where(ok, st.token, 0)
        active = active[ok]
    return out


def certify(model: BoxModel, soft: np.ndarray, radius: float, targets: np.ndarray) -> list[Proof]:
    """For soft prompts (B, m, d) and targets (B, n): each row's proof, with all n steps when
    the target is certified accessible from the box ``soft ± radius`` (fewer otherwise)."""
    r = run(model, None, targets.shape[1], soft=soft, radius=radius, targets=targets)
    return [r.proof(i, None, soft[i], radius) for i in range(soft.shape[0])]


def recheck(weights: Weights | BoxModel, proof: Proof, radius: float | None = None) -> int:
    """How many of ``proof``'s steps certify again, from scratch, for its prompt with its own
    radius or ``radius`` (a wider box): the proof holds iff this is len(proof.steps)."""
    model = weights if isinstance(weights, BoxModel) else boxes.prepare(weights)
    rad = proof.radius if radius is None else radius
    target = np.array([proof.tokens], np.int64)
    if proof.prompt is not None and rad == 0:
        r = run(model, np.array([proof.prompt], np.int64), target.shape[1], targets=target)
    else:
        soft = proof.soft if proof.soft is not None else model.weights.E[list(proof.prompt)].toarray()
        r = run(model, None, target.shape[1], soft=soft[None], radius=rad, targets=target)
    return int(r.certified_length[0])


# --- the task set's sentences ---------------------------------------------------------------------


SENTENCE, PART, OUTSIDE = "sentence", "part of a sentence", "not in any sentence"
#: The classes in order: a sequence's class is the best any of its prompts gives it.
_RANK = {OUTSIDE: 0, PART: 1, SENTENCE: 2}


@dataclass(frozen=True)
class Sentences:
    """The task set's sentences as token-id tuples, and every contiguous run of their tokens.

    A certified sequence is classed **with its prompt**: the tokens of a token prompt
    followed by the sequence form a whole sentence of the task set (``sentence``: e.g.
    ``France`` → ``has capital Paris``), a contiguous part of one (``part of a sentence``:
    ``France`` → ``has``), or neither (``not in any sentence``: ``France`` → ``has capital
    Paris Paris``, a statement the model can be made to say that is not its knowledge).
    The same sequence may follow several prompts of m tokens; it takes the best class any
    of them gives it (:meth:`witnesses`), and the report gives the proof of the first prompt
    that gives it (besides that of its first prompt, when that is another)."""

    whole: frozenset
    parts: frozenset

    @classmethod
    def of(cls, taskset: TaskSet, weights: Weights) -> "Sentences":
        index = {t: i for i, t in enumerate(weights.vocab)}
        whole, parts = set(), set()
        for sentence, *_ in taskset.sentences():
            ids = tuple(index[t] for t in sentence)
            whole.add(ids)
            for a in range(len(ids)):
                for b in range(a + 1, len(ids) + 1):
                    parts.add(ids[a:b])
        return cls(frozenset(whole), frozenset(parts))

    def classify(self, tokens: tuple[int, ...]) -> str:
        """A whole sentence, a contiguous part of one, or in none (a statement the model can be
        made to say that is not a piece of its knowledge); ``tokens``: a prompt's and then
        its continuation's."""
        return SENTENCE if tokens in self.whole else PART if tokens in self.parts else OUTSIDE

    def witnesses(self, V: int, m: int, table: np.ndarray) -> dict[tuple[int, ...], tuple[str, int]]:
        """The certified continuations of prompts of m tokens that some prompt makes into a
        whole sentence or a part of one: continuation -> (its best class, the first prompt in
        :func:`prompts_of` order that gives it). ``table``: each prompt's certified tokens
        (|V|^m rows in that order, −1 after the last). Only a prompt that is itself a part of
        a sentence can give either class, so only those rows are read; every other
        continuation is in no sentence with any of its prompts."""
        out: dict[tuple[int, ...], tuple[str, int]] = {}
        for i, prompt in sorted((prompt_index(V, p), p) for p in self.parts if len(p) == m):
            row = table[i]
            for n in range(1, row.shape[0] + 1):
                if row[n - 1] < 0:
                    break
                seq = tuple(int(t) for t in row[:n])
                klass = self.classify(prompt + seq)
                if klass == OUTSIDE:
                    break                         # a longer one is no part of a sentence either
                if seq not in out or _RANK[klass] > _RANK[out[seq][0]]:
                    out[seq] = (klass, i)
        return out


# --- token prompts, exhaustively ------------------------------------------------------------------


def prompt_counts(V: int, m: int) -> list[int]:
    """|V|^k for k = 1..m (exact integers)."""
    return [V ** k for k in range(1, m + 1)]


def choose_m(weights: Weights, max_prompts: int, m: int | None = None) -> tuple[int, str]:
    """The longest token prompt to enumerate and why: ``m`` if given (refused, with the count,
    when Σ_{k≤m} |V|^k exceeds ``max_prompts`` or m leaves no position to generate into),
    else the largest m within the limit and the positions."""
    V, cap = len(weights.vocab), weights.n_positions - 1
    if m is not None:
        if m < 1 or m > cap:
            raise TaskError(f"token prompts of {m} tokens leave no position to generate into: the model has "
                            f"{weights.n_positions} positions (m + n <= {weights.n_positions})",
                            fix=f"choose --token-m between 1 and {cap}")
        total = sum(prompt_counts(V, m))
        if total > max_prompts:
            raise TaskError(f"token prompts of up to {m} tokens number {total:,} (|V| = {V}: |V|^{m} = {V ** m:,}), "
                            f"more than --max-prompts {max_prompts:,}",
                            fix=f"lower --token-m, or raise --max-prompts to {total:,}")
        return m, "as asked"
    best = 0
    while best < cap and sum(prompt_counts(V, best + 1)) <= max_prompts:
        best += 1
    if best == cap:
        return best, f"every prompt length the {weights.n_positions} positions allow"
    nxt = sum(prompt_counts(V, best + 1))
    return best, f"m = {best + 1} would need {nxt:,} prompts, more than --max-prompts {max_prompts:,}"


def prompts_of(V: int, k: int, start: int, stop: int | None = None) -> np.ndarray:
    """Prompts number start..stop−1 of length k (or the prompts numbered by the array
    ``start``), in the order of base-|V| numerals."""
    idx = np.arange(start, stop, dtype=np.int64) if stop is not None else np.asarray(start, np.int64)
    return np.stack([(idx // V ** (k - 1 - i)) % V for i in range(k)], axis=1).reshape(idx.size, k)


def prompt_index(V: int, prompt: tuple[int, ...]) -> int:
    """The number of ``prompt`` in :func:`prompts_of` order."""
    i = 0
    for t in prompt:
        i = i * V + int(t)
    return i


@dataclass
class TokenLevel:
    """The prompts of exactly ``m`` tokens: per continuation length n = 1..n_max, the number
    of distinct certified sequences, of prompts undecided at step n, and each distinct
    sequence's first proving prompt (its index in :func:`prompts_of` order)."""

    m: int
    prompts: int
    n_max: int
    distinct: list[int] = field(default_factory=list)
    undecided: list[int] = field(default_factory=list)
    sequences: dict = field(default_factory=dict)      # (tokens,) -> prompt index


#: Token prompts run through the pass together.
PROMPT_CHUNK = 8192


def token_level(model: BoxModel, m: int, progress=None) -> tuple[TokenLevel, np.ndarray, np.ndarray]:
    """Every prompt of exactly m tokens, continued greedily by up to n_positions − m certified
    tokens: (the level, every prompt's certified tokens (|V|^m, n_max), each step's logit
    margin)."""
    V = model.vocab_size
    n_max = max_continuation(model.weights, m)
    total = V ** m
    tokens = np.full((total, n_max), -1, np.int64)
    margins = np.full((total, n_max), np.nan)
    undecided = np.zeros(n_max, np.int64)
    for a in range(0, total, PROMPT_CHUNK):
        b = min(a + PROMPT_CHUNK, total)
        r = run(model, prompts_of(V, m, a, b), n_max)
        tokens[a:b], margins[a:b] = r.token, r.margin
        undecided += r.undecided.sum(axis=0)
        if progress is not None:
            progress(b - a)
    level = TokenLevel(m, total, n_max, undecided=[int(u) for u in undecided])
    for n in range(1, n_max + 1):
        ok = np.flatnonzero((tokens[:, :n] >= 0).all(axis=1))
        if not ok.size:
            level.distinct.append(0)
            continue
        uniq, first = np.unique(tokens[ok, :n], axis=0, return_index=True)
        level.distinct.append(int(uniq.shape[0]))
        for row, i in zip(uniq, ok[first]):
            level.sequences[tuple(int(t) for t in row)] = int(i)
    return level, tokens, margins


# --- facts ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FactAccess:
    """Whether a fact's object is certified accessible (the one-token sequence (object,)), by
    which kind of prompt, with the proof; and whether the fact's own object query (a
    template's prefix up to ⋆2, when it has at most m tokens) is a proof."""

    task: str
    subject: str
    object: str
    proof: Proof | None
    kind: str | None              # "token", "soft" or None
    own_query: bool | None        # None: every own query is longer than the prompts enumerated


def object_queries(taskset: TaskSet, weights: Weights) -> list[tuple[str, str, str, int, list[tuple[int, ...]]]]:
    """Per fact: (task, subject, object, the object's token id, the token ids of each template's
    prefix up to ⋆2)."""
    index = {t: i for i, t in enumerate(weights.vocab)}
    out = []
    for task in taskset.tasks:
        for s, o in task.facts.items():
            queries = [tuple(index[t] for t in tpl.fill(s, o)[:tpl.object_index]) for tpl in task.templates]
            out.append((task.name, s, o, index[o], queries))
    return out


# --- the paper's bound ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Support:
    """Where prompts may lie for the bound: per coordinate [lo_i, hi_i] (the range of the token
    embedding rows and 0) and the Euclidean ball of radius ``r`` (the largest row norm)."""

    lo: np.ndarray
    hi: np.ndarray
    r: float

    def contains(self, X: np.ndarray) -> bool:
        """Every vector of X (…, d) within the ranges and the ball."""
        X = np.asarray(X, np.float64)
        return bool(np.all(X >= self.lo) and np.all(X <= self.hi)
                    and np.all(np.sqrt(np.sum(X * X, axis=-1)) <= self.r))


def support(weights: Weights) -> Support:
    """:class:`Support` of the token embedding rows E[0..|V|−1] (BOS is no prompt input)."""
    E = weights.E.tocsr()[: len(weights.vocab)]
    lo = np.minimum(np.asarray(E.min(axis=0).toarray()).reshape(-1), 0.0)
    hi = np.maximum(np.asarray(E.max(axis=0).toarray()).reshape(-1), 0.0)
    r = float(np.sqrt(np.max(np.asarray(E.multiply(E).sum(axis=1)).reshape(-1), initial=0.0)))
    return Support(lo, hi, r)


@dataclass(frozen=True)
class PaperBound:
    """The paper's slopes for this model: C (isotropic) and C_aniso, tokens per prompt vector
    beyond which inaccessible sequences must exist; ``log10_count(m)`` bounds the number of
    accessible sequences with m vectors. Floating point (a comparison, not a verdict)."""

    d: int
    V: int
    epsilon: float
    r: float
    C: float
    C_aniso: float
    widths_nonzero: int

    def log10_count(self, m: int) -> float:
        """log10 of (1 + 2r/ε)^{d·m}."""
        return self.d * m * math.log10(1 + 2 * self.r / self.epsilon)

    def to_dict(self) -> dict:
        return {"d": self.d, "V": self.V, "epsilon": self.epsilon, "r": self.r, "C": self.C,
                "C_anisotropic": self.C_aniso, "coordinates_with_width": self.widths_nonzero,
                "convention": "r = largest Euclidean norm of a token embedding row E[v] (BOS excluded); "
                              "r_i = width of coordinate i's range over those rows and 0; epsilon absolute"}


def paper_bound(weights: Weights, epsilon: float = PAPER_EPSILON) -> PaperBound:
    """C = d·ln(1 + 2r/ε)/ln|V| and C_aniso = Σ_i ln(1 + r_i/ε)/ln|V| (:func:`support`)."""
    sup = support(weights)
    V, d = len(weights.vocab), weights.d
    widths = sup.hi - sup.lo
    lnV = math.log(V) if V > 1 else float("nan")
    C = d * math.log1p(2 * sup.r / epsilon) / lnV
    C_aniso = float(np.sum(np.log1p(widths / epsilon))) / lnV
    return PaperBound(d, V, float(epsilon), sup.r, C, C_aniso, int(np.count_nonzero(widths)))


def n50(successes: list[int], trials: list[int]) -> tuple[float, bool]:
    """The length at which half the targets are certified, from counts at n = 1, 2, ...:
    the last n of a run of fractions ≥ 1/2 from n = 1, interpolated linearly towards the
    next n (0 when fewer than half succeed at n = 1). ``capped``: every measured length
    had ≥ 1/2 (the positions end the measurement, n50 is then a lower bound)."""
    frac = [s / t if t else 0.0 for s, t in zip(successes, trials)]
    n = 0
    while n < len(frac) and frac[n] >= 0.5:
        n += 1
    if n == len(frac):
        return float(n), True
    if n == 0:
        return 0.0, False
    prev, nxt = frac[n - 1], frac[n]
    return n + (prev - 0.5) / (prev - nxt), False


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of ys against xs, None with fewer than two distinct xs."""
    if len(set(xs)) < 2:
        return None
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope), float(intercept)


# --- the token report -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accessible:
    """A certified accessible sequence: the first ``n`` steps of proof ``proof`` (an index into
    the report's proofs: the first prompt, in :func:`prompts_of` order, that yields it), for
    prompts of ``m`` vectors, with its class against the task set's sentences, of a prompt
    and the sequence together (:class:`Sentences`): of the proof's prompt, or where a later
    prompt gives it a better class, of ``witness``'s (an index into the report's witnesses)."""

    m: int
    tokens: tuple[int, ...]
    proof: int
    kind: str                 # "token" or "soft"
    klass: str
    witness: int | None = None


@dataclass
class TokenReport:
    """Token prompts of up to ``m`` tokens, enumerated exhaustively (``why`` says why m)."""

    m: int
    why: str
    levels: list[TokenLevel]
    union: list[int]                      # per n: distinct sequences over prompts of <= m tokens
    proofs: list[Proof]                   # of each sequence's first prompt
    sequences: list[Accessible]
    facts: list[FactAccess]
    seconds: float = 0.0
    witnesses: list[Proof] = field(default_factory=list)    # of the prompts giving a sequence a better class

    def class_proof(self, a: Accessible) -> Proof:
        """The proof whose prompt, followed by ``a``'s tokens, has ``a``'s class."""
        return self.proofs[a.proof] if a.witness is None else self.witnesses[a.witness]


def token_accessibility(model: BoxModel, taskset: TaskSet, m: int, why: str = "", progress=None) -> TokenReport:
    """Every prompt of 1..m tokens, continued greedily as far as the positions allow; each
    distinct certified sequence with the proof of its first prompt (in numeral order), its
    class and, where another prompt gives it that class, the first such prompt's proof
    (:class:`Sentences`); and every fact's object: accessible (with a proof, the fact's own
    object query when it is one of the prompts and certified) or not by these prompts."""
    start = time.monotonic()
    w = model.weights
    V = model.vocab_size
    sentences = Sentences.of(taskset, w)
    levels, tables, proofs, sequences, witnesses = [], {}, [], [], []
    n_top = max_continuation(w, 1)
    union: list[set] = [set() for _ in range(n_top)]
    for k in range(1, m + 1):
        level, tokens, _ = token_level(model, k, progress)
        levels.append(level)
        tables[k] = tokens
        # each sequence's class: the best that any of its prompts gives it (its first prompt's
        # when none makes it part of a sentence: in no sentence), with that prompt's proof
        best = sentences.witnesses(V, k, tokens)
        chosen = {seq: best.get(seq, (OUTSIDE, i)) for seq, i in level.sequences.items()}
        reps = sorted(set(level.sequences.values()))
        extra = sorted({i for _, i in chosen.values()} - set(reps))
        prompts = prompts_of(V, k, np.array(reps + extra, np.int64))
        r = run(model, prompts, level.n_max)
        ids, wids = {}, {}
        for row, i in enumerate(reps + extra):
            proof = r.proof(row, tuple(int(t) for t in prompts[row]), None, 0.0)
            if row < len(reps):
                ids[i] = len(proofs)
                proofs.append(proof)
            else:
                wids[i] = len(witnesses)
                witnesses.append(proof)
        for seq, i in sorted(level.sequences.items(), key=lambda kv: (len(kv[0]), kv[1])):
            klass, j = chosen[seq]
            if j != i and j not in wids:                  # another sequence's first prompt gives it its class
                wids[j] = len(witnesses)
                witnesses.append(proofs[ids[j]])
            a = Accessible(k, seq, ids[i], "token", klass, wids[j] if j != i else None)
            shown = proofs[a.proof] if a.witness is None else witnesses[a.witness]
            if proofs[a.proof].tokens[:len(seq)] != seq or shown.tokens[:len(seq)] != seq:
                raise AssertionError("a prompt's certified continuation changed when it ran again")
            if sentences.classify(shown.prompt + seq) != klass:
                raise AssertionError("a sequence's class is not its prompt's")
            sequences.append(a)
            union[len(seq) - 1].add(seq)
    facts = _facts_by_tokens(model, taskset, m, tables, proofs, sequences)
    return TokenReport(m, why, levels, [len(u) for u in union], proofs, sequences, facts,
                       time.monotonic() - start, witnesses)


def _facts_by_tokens(model: BoxModel, taskset: TaskSet, m: int, tables: dict, proofs: list[Proof],
                     sequences: list[Accessible]) -> list[FactAccess]:
    """Per fact: the proof that its object is accessible by a token prompt of <= m tokens (its
    own object query's when that is certified, else the first prompt found), or None."""
    V = model.vocab_size
    first = {}
    for a in sequences:
        if len(a.tokens) == 1 and a.tokens[0] not in first:
            first[a.tokens[0]] = proofs[a.proof]
    out = []
    own_proofs: dict[tuple[int, ...], Proof] = {}
    for task, s, o, obj, queries in object_queries(taskset, model.weights):
        short = [q for q in queries if len(q) <= m]
        own = None
        proof = None
        if short:
            own = False
            for q in short:
                if int(tables[len(q)][prompt_index(V, q), 0]) == obj:
                    if q not in own_proofs:
                        own_proofs[q] = run(model, np.array([q], np.int64), 1).proof(0, q, None, 0.0)
                    own, proof = True, own_proofs[q]
                    break
        if proof is None and obj in first:
            proof = first[obj]
        out.append(FactAccess(task, s, o, proof, "token" if proof is not None else None, own))
    return out


# --- soft prompts -----------------------------------------------------------------------------------


RANDOM, OBJECT, TOKEN_BOX = "random", "object", "token prompt box"


@dataclass(frozen=True)
class SoftTarget:
    """A target searched for (or a token prompt's box), with the best certified proof over the
    restarts: the target is certified accessible iff every one of its steps is proven.
    ``found``: some restart reproduced it greedily in floating point (None: no search).
    ``centre_only``: not certified on its box, but certified at the box's centre alone
    (radius 0: a token prompt's proof, or a found restart's centre run again), so that the
    box's width is why it is not: over the box the enclosures leave a step undecided, which
    is no proof that some prompt of the box says something else."""

    m: int
    target: tuple[int, ...]
    purpose: str
    found: bool | None
    proof: Proof
    centre_only: bool = False

    @property
    def certified(self) -> bool:
        return len(self.proof.steps) == len(self.target)


@dataclass
class SoftLevel:
    """Soft prompts of ``m`` vectors: per n = 1..n_max, random targets tried, found by the
    search, certified; distinct certified sequences (every purpose); n50 and the longest
    certified length."""

    m: int
    n_max: int
    trials: list[int]
    found: list[int]
    certified: list[int]
    distinct: list[int]
    n50: float
    capped: bool
    longest: int


@dataclass
class SoftReport:
    epsilon: float
    radius: float
    bound: PaperBound
    targets: list[SoftTarget]
    levels: list[SoftLevel]
    fit: tuple[float, float] | None          # (slope, intercept) of n50 against m, over fit_levels
    fit_levels: list[int]                    # the m whose n50 is not capped by the positions
    in_support: bool                         # every certified prompt's centres (not whole boxes) lie in the support
    settings: dict
    seconds: float = 0.0

    @property
    def centre_only(self) -> list[SoftTarget]:
        """The targets certified at the centre of a box but not on it (:class:`SoftTarget`)."""
        return [t for t in self.targets if t.centre_only]

    @property
    def ratio(self) -> dict:
        """The paper's C over the measured slope (isotropic and anisotropic); None unless the slope is > 0."""
        if self.fit is None or not self.fit[0] > 0:
            return {"C": None, "C_anisotropic": None}
        return {"C": self.bound.C / self.fit[0], "C_anisotropic": self.bound.C_aniso / self.fit[0]}


def soft_accessibility(model: BoxModel, tokens: TokenReport, propose, m_values: list[int], per_length: int = 8,
                       restarts: int = 2, seed: int = 0, epsilon: float = PAPER_EPSILON, objects: int | None = None,
                       progress=None) -> SoftReport:
    """Soft prompts: for each m, ``per_length`` random targets of each length n (uniform tokens,
    seeded) searched by ``propose(targets, m, seed) -> (prompts, found)`` from ``restarts``
    starts each, then certified on the box prompt ± ε/2; the objects no token prompt
    reaches, searched with m = 1 (all of them, or ``objects`` of them drawn with the seed;
    0: none); and every token proof's prompt box (its embeddings ± ε/2), certified with
    its continuation. Only certificates count."""
    start = time.monotonic()
    w = model.weights
    V, radius = model.vocab_size, epsilon / 2
    rng = np.random.default_rng(seed)
    sup = support(w)
    jobs: dict[int, list[tuple[tuple[int, ...], str]]] = {}
    for m in m_values:
        for n in range(1, max_continuation(w, m) + 1):
            for _ in range(per_length):
                jobs.setdefault(m, []).append((tuple(int(t) for t in rng.integers(0, V, n)), RANDOM))
    reached = {f.object for f in tokens.facts if f.proof is not None}
    missing = sorted({f.object for f in tokens.facts} - reached)
    if objects is not None and objects < len(missing):
        missing = sorted(missing[i] for i in rng.choice(len(missing), objects, replace=False))
    if missing and max_continuation(w, 1) >= 1:
        index = {t: i for i, t in enumerate(w.vocab)}
        jobs.setdefault(1, []).extend(((index[o],), OBJECT) for o in missing)
    found_targets: list[SoftTarget] = []
    for m in sorted(jobs):
        for n in sorted({len(t) for t, _ in jobs[m]}):      # one search per length: rows cost m + n positions
            found_targets += _search_level(model, propose, m, [j for j in jobs[m] if len(j[0]) == n], restarts,
                                           seed + 7919 * m + 104729 * n, radius)
            if progress is not None:
                progress(1)
    found_targets += _token_boxes(model, tokens, radius)
    levels = _soft_levels(w, found_targets, sorted(set(m_values)))
    usable = [(lv.m, lv.n50) for lv in levels if not lv.capped]        # a capped n50 is only a lower bound
    fit = fit_line([float(x) for x, _ in usable], [y for _, y in usable])
    in_sup = all(sup.contains(t.proof.soft) for t in found_targets if t.proof.soft is not None and t.proof.steps)
    settings = {"m": sorted(set(m_values)), "per_length": per_length, "restarts": restarts, "seed": seed,
                "objects_searched": len(missing),
                "objects_unreached_by_tokens": len(set(f.object for f in tokens.facts) - reached)}
    return SoftReport(epsilon, radius, paper_bound(w, epsilon), found_targets, levels, fit, [m for m, _ in usable],
                      in_sup, settings, time.monotonic() - start)


def _search_level(model: BoxModel, propose, m: int, jobs: list, restarts: int, seed: int,
                  radius: float) -> list[SoftTarget]:
    """One search for every target of prompts of m vectors (padded to the longest, repeated
    ``restarts`` times), each proposal certified; per target the longest certified proof."""
    n = max(len(t) for t, _ in jobs)
    targets = np.full((len(jobs) * restarts, n), -1, np.int64)
    for i, (t, _) in enumerate(jobs * restarts):
        targets[i, :len(t)] = t
    prompts, found = propose(targets, m, seed)
    prompts = np.asarray(prompts, np.float64)
    found = np.asarray(found, bool)
    out = []
    by_length: dict[int, list[int]] = {}
    for i, (t, _) in enumerate(jobs * restarts):
        by_length.setdefault(len(t), []).append(i)
    proofs: dict[int, Proof] = {}
    centre: set[int] = set()               # found, not certified on the box, certified at its centre
    for length, rows in by_length.items():
        rows = np.array(rows)
        r = run(model, None, length, soft=prompts[rows], radius=radius, targets=targets[rows, :length])
        for j, i in enumerate(rows):
            proofs[int(i)] = r.proof(j, None, prompts[i], radius)
        again = np.array([i for i in rows if found[i] and len(proofs[int(i)].steps) < length], np.int64)
        if again.size and radius > 0:
            r0 = run(model, None, length, soft=prompts[again], radius=0.0, targets=targets[again, :length])
            centre |= {int(i) for j, i in enumerate(again) if r0.certified_length[j] == length}
    for i, (t, purpose) in enumerate(jobs):
        tries = [i + k * len(jobs) for k in range(restarts)]
        best = max(tries, key=lambda x: len(proofs[x].steps))
        out.append(SoftTarget(m, t, purpose, bool(np.any(found[tries])), proofs[best],
                              len(proofs[best].steps) < len(t) and any(x in centre for x in tries)))
    return out


def _token_boxes(model: BoxModel, tokens: TokenReport, radius: float) -> list[SoftTarget]:
    """Each token proof's prompt as a soft prompt: its embeddings ± radius, certified with the
    token prompt's continuation (every prompt vector is an embedding row: in the support)."""
    out = []
    by_m: dict[int, list[Proof]] = {}
    for p in tokens.proofs:
        if p.steps:
            by_m.setdefault(p.m, []).append(p)
    E = model.weights.E.tocsr()
    for m, group in by_m.items():
        for length in sorted({len(p.steps) for p in group}):
            same = [p for p in group if len(p.steps) == length]
            soft = np.stack([E[list(p.prompt)].toarray() for p in same])
            targets = np.array([p.tokens for p in same], np.int64)
            r = run(model, None, length, soft=soft, radius=radius, targets=targets)
            out += [SoftTarget(m, p.tokens, TOKEN_BOX, None, r.proof(j, None, soft[j], radius),
                               int(r.certified_length[j]) < length)           # its centre: the token prompt
                    for j, p in enumerate(same)]
    return out


def _soft_levels(weights: Weights, targets: list[SoftTarget], m_values: list[int]) -> list[SoftLevel]:
    levels = []
    for m in m_values:
        n_max = max_continuation(weights, m)
        here = [t for t in targets if t.m == m]
        rand = [t for t in here if t.purpose == RANDOM]
        trials = [sum(1 for t in rand if len(t.target) == n) for n in range(1, n_max + 1)]
        found = [sum(1 for t in rand if len(t.target) == n and t.found) for n in range(1, n_max + 1)]
        cert = [sum(1 for t in rand if len(t.target) == n and t.certified) for n in range(1, n_max + 1)]
        seqs: list[set] = [set() for _ in range(n_max)]
        for t in here:
            for k in range(1, len(t.proof.steps) + 1):
                seqs[k - 1].add(t.proof.tokens[:k])
        value, capped = n50(cert, trials)
        longest = max((len(t.proof.steps) for t in here), default=0)
        levels.append(SoftLevel(m, n_max, trials, found, cert, [len(x) for x in seqs], value, capped, longest))
    return levels


# --- facts, the verdict, the report -----------------------------------------------------------------


def facts_with_soft(facts: list[FactAccess], soft: SoftReport | None, vocab: tuple[str, ...]) -> list[FactAccess]:
    """The facts, with the objects no token prompt reaches but a certified soft prompt does
    (a certified one-token target, searched as an object or drawn at random)."""
    if soft is None:
        return facts
    by_object: dict[str, Proof] = {}
    for t in soft.targets:
        if t.certified and len(t.target) == 1 and t.purpose != TOKEN_BOX:
            by_object.setdefault(vocab[t.target[0]], t.proof)
    return [FactAccess(f.task, f.subject, f.object, by_object[f.object], "soft", f.own_query)
            if f.proof is None and f.object in by_object else f for f in facts]


@dataclass(frozen=True)
class Analysis:
    """Everything the accessibility command reports."""

    weights: Weights
    tokens: TokenReport
    soft: SoftReport | None
    facts: list[FactAccess]

    @property
    def every_object(self) -> bool:
        """Every fact's object is certified accessible (the command's exit status 0)."""
        return all(f.proof is not None for f in self.facts)
