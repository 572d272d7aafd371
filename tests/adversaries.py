"""Adversarial weights for the soundness properties (tests/test_adversarial.py, tests/verifier/passes/test_factored.py).

Hypothesis draws weights from the built models of small task sets and then applies up to
three adversarial edits: any mutation operator (encodings, underflow paths, huge
cancelling pairs, rescaled directions, ...) or a single entry set to ±m·2^e with e anywhere
in float64's exponent range. ``ORACLE`` is the independent oracle (exact linear algebra,
exp at 60 digits) the properties compare with.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import scipy.sparse as sp
from hypothesis import strategies as st

from audit import mutants as M
from audit.oracle import Oracle
from tasks.reading import load_tasks
from repository import DATA

SETS = M.small_sets()
#: Object queries "X lives in" with two valid next tokens, the object and the word "the":
#: L1 encloses P_ablated(o) alone there (:func:`verifier.arithmetic.logits.ablated`).
WORD_AND_OBJECT = {"word-and-object": load_tasks(DATA / "word_and_object.yaml")}
OPERATORS = sorted(M.OPERATORS)
ORACLE = Oracle(dps=60)


def _value():
    exponent = st.one_of(st.integers(-1074, 1010), st.integers(-1074, -1000), st.integers(990, 1010),
                         st.integers(-40, 40))
    return st.builds(lambda m, e, s: s * math.ldexp(m, e), st.integers(1, 255), exponent, st.sampled_from([1.0, -1.0]))


@st.composite
def adversarial(draw, sets: dict = SETS):
    name = draw(st.sampled_from(sorted(sets)))
    taskset, w, eps = M.built(name, sets[name])
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            op = draw(st.sampled_from(OPERATORS))
            try:
                made = M.mutate(M.OPERATORS[op], w, np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1))))
            except ValueError:   # an earlier step stored a matrix non-canonically: it cannot be edited further
                made = None
            if made is None:
                continue
            w, text = made
            steps.append(f"{op}: {text}")
        else:
            arrays = [(n, g, p) for n, g, p, _ in M._arrays_with_entries(w)]
            aname, get, put = arrays[draw(st.integers(0, len(arrays) - 1))]
            m = get()
            v = draw(_value())
            if sp.issparse(m):
                i, j = draw(st.integers(0, m.shape[0] - 1)), draw(st.integers(0, m.shape[1] - 1))
                try:
                    lil = sp.lil_matrix(m, copy=True)
                    lil[i, j] = v
                    w = put(M._csr(lil))
                except ValueError:
                    continue
                steps.append(f"{aname}[{i}, {j}] = {v!r}")
            else:
                i = draw(st.integers(0, m.size - 1))
                vec = np.array(m, np.float64, copy=True)
                vec[i] = v
                w = put(vec)
                steps.append(f"{aname}[{i}] = {v!r}")
    return name, taskset, w, eps, steps


@st.composite
def entities_moved(draw, sets: dict = SETS):
    """A built model whose embedding rows of one to three subjects get an entry changed
    (any coordinate; a small value or one of any exponent): entities that differ from the
    others where some head's value, query or key reads them, or nowhere."""
    name = draw(st.sampled_from(sorted(sets)))
    taskset, w, eps = M.built(name, sets[name])
    tmap = w.token_ids(taskset.vocabulary.tokens, "weights")
    subjects = np.unique(np.concatenate([taskset.fact_ids[k][0] for k in range(len(taskset.tasks))]))
    E = sp.lil_matrix(w.E, copy=True)
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        x = int(tmap[subjects[draw(st.integers(0, subjects.size - 1))]])
        j = draw(st.integers(0, w.d - 1))
        v = draw(st.one_of(st.sampled_from([0.5, 1.0, -1.0, 2.0, 1e-3]), _value()))
        E[x, j] = v
        steps.append(f"E[{w.vocab[x]}, {w.residual_labels[j] if w.residual_labels else j}] = {v!r}")
    return name, taskset, w.replace(E=M._csr(E)), eps, steps


def inside(lo, value, hi) -> bool:
    """lo <= value <= hi, exactly (a NaN bound reads as unbounded, as every check reads it)."""
    lo, hi = float(lo), float(hi)
    if math.isnan(lo) or math.isnan(hi):
        return True
    return mpmath.mpf(lo) <= value <= mpmath.mpf(hi)
