"""The localization check's numbers: "without its expert, the model cannot answer".

For an object query q of task k (object o), with z = U·r the logits once the routed
expert's output is removed (:mod:`verifier.passes.forward`, step 5), the entanglement check
(:mod:`verifier.checks.verify`, item 4) certifies

* **L1**: P_ablated(o) <= 1/|O_k| (O_k: the task's distinct objects), decided as
  "the lower end of 1 − P_ablated(o) is >= :func:`l1_threshold` (|O_k|)", that lower end
  enclosing o's probability alone (``BatchResult.ablated_object_lo``: a query may have
  valid next tokens besides o, template words the model may rightly predict without the
  expert), or, in the exact pass, by
  an exact argument where every token but o has logit exactly 0 and z_o <= 0 is certified
  (the construction's models: :func:`localization`);
* **L2**: some t != o has z_t >= z_o, decided as "the kernels' lower bound of
  max_{t != o} z_t − z_o is >= 0" (``BatchResult.ablated_gap``);
* **(b)**: the ablated error's lower end is >= ε (the original criterion).

This module holds the thresholds and the per-row decisions of the check's parts
(:data:`verifier.checks.catalogue.ENTANGLEMENT`), which the one decision of a batch
(:func:`verifier.checks.catalogue.decide`) takes for the full pass's tally and the query
classes a certificate keeps alike.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from tasks.model import TaskSet
from verifier.arithmetic import interval as I


def p_upper(ablated_lower: float) -> float:
    """An upper end of P_ablated(o) from a lower end of 1 − P_ablated(o) (:func:`object_lows`):
    1 − lower, rounded upward (1 where the lower end is not a number)."""
    lo = float(ablated_lower)
    if not lo >= 0.0:
        return 1.0
    return min(1.0, float(I.up(1.0 - lo)))


def l1_threshold(n_objects: int) -> float:
    """The smallest float x with x >= 1 − 1/m (m = ``n_objects``), found in exact rationals:
    for a float a, a >= 1 − 1/m exactly when a >= x (x is the first float at or above the
    rational, and a is a float). m <= 1: 0.0 (L1 is vacuous: every error is >= 0)."""
    if n_objects <= 1:
        return 0.0
    exact = 1 - Fraction(1, int(n_objects))
    x = float(exact)                       # nearest float: one step up if it lies below
    if Fraction(x) < exact:
        x = float(np.nextafter(x, np.inf))
    return x


def l1_thresholds(taskset: TaskSet) -> tuple[np.ndarray, np.ndarray]:
    """Per task, |O_k| (its distinct objects) and :func:`l1_threshold` of it."""
    counts = np.array([np.unique(o).size for _, o in taskset.fact_ids], np.int64)
    return counts, np.array([l1_threshold(int(m)) for m in counts], np.float64)


def row_gaps(res, n: int) -> np.ndarray:
    """The L2 gaps of a result (NaN, read as not certified, where the pass gave none)."""
    return np.full(n, np.nan) if res.ablated_gap is None else np.asarray(res.ablated_gap, float)


def object_lows(res, n: int) -> np.ndarray:
    """Per row, a lower end of 1 − P_ablated(o) for the row's object o alone: the pass's
    ``ablated_object_lo``, or, where a result has none, the ablated error's lower end
    (1 − P(valid) <= 1 − P(o), o being valid: also a lower end, a looser one)."""
    if res.ablated_object_lo is None:
        return np.asarray(res.ablated_lo, float)[:n]
    return np.asarray(res.ablated_object_lo, float)


def localization(res, det: np.ndarray, oq: np.ndarray, eps: float, l1_thr: np.ndarray,
                 exact_vocab: int | None = None):
    """Per row, whether (b) (ablated error >= ε), L1 and L2 (gap >= 0) are certified, and all
    three, for the object queries ``oq`` (False elsewhere; a NaN compares False: not certified).

    L1 holds where the lower end of 1 − P_ablated(o) (:func:`object_lows`) is >= the task's
    :func:`l1_threshold`, or,
    in the exact pass (``exact_vocab`` = V, the weights' vocabulary size), where all V − 1
    tokens other than o have logit exactly 0 (``ablated_zeros``) and the gap is >= 0. Proof
    of the second: the gap bounds 0 − z_o from below, so z_o <= 0, and then
    P(o) = e^{z_o}/(e^{z_o} + V − 1) <= 1/V <= 1/|O_k|, the task's distinct objects being
    distinct tokens of the vocabulary. It decides exactly the case an enclosure cannot: the
    uniform distribution when every token is an object of the task (V = |O_k|), where
    P(o) = 1/|O_k| sits on the bound and the rounded error enclosure lies just below the
    threshold. Not in a deployed pass, whose rounded softmax may put P(o) an ulp above 1/V."""
    ab = np.asarray(res.ablated_lo, float)
    thr = l1_thr[np.maximum(det, 0)] if l1_thr.size else np.zeros(det.size)
    gaps = row_gaps(res, det.size)
    with np.errstate(invalid="ignore"):
        b_ok = oq & (ab >= eps)
        l1 = oq & (object_lows(res, det.size) >= thr)
        l2 = oq & (gaps >= 0.0)
        if exact_vocab is not None and res.ablated_zeros is not None:
            l1 |= l2 & (np.asarray(res.ablated_zeros, np.int64) == exact_vocab - 1)
    return b_ok, l1, l2, b_ok & l1 & l2
