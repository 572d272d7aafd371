"""ρ, the weight of a token of logit exactly 0 relative to a row's softmax sum
(verifier.arithmetic.logits.error_enclosure), is enclosed whatever the row: a probability
(at most 1) when the row has such a token, above 1 when every token is reached with a
negative logit. Its upper end is never capped at 1 there (incremental re-certification
grows a reused class's error with it)."""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
import pytest

from verifier.arithmetic import logits


def _enclosure(mids: list[float], V: int, valid: list[int]):
    """error_enclosure of a row whose first len(mids) tokens have these exact logits."""
    nt = len(mids)
    Lacc = np.zeros((V, 5))
    Lacc[:nt, 1] = mids
    return logits.error_enclosure(nt, np.arange(nt, dtype=np.int64), Lacc, V, 0, len(valid),
                                  np.array(valid, np.int64), np.zeros(V, np.int64), 7)


def _exact_rho(mids: list[float], V: int):
    """ρ = 1/Σ_t e^(z_t) (the untouched tokens' logit 0 included), at 60 digits."""
    with mpmath.workdps(60):
        return 1 / (sum(mpmath.exp(mpmath.mpf(Fraction(z).numerator) / Fraction(z).denominator) for z in mids)
                    + (V - len(mids)))


@pytest.mark.parametrize("mids", [[-1.0, -2.0, -3.0], [-1.5, -2.25], [-40.0, -41.5, -38.0, -45.0], [-3.0] * 7])
def test_rho_above_one_is_enclosed_when_every_logit_is_negative(mids):
    """Every token reached, every logit below 0: ρ = 1/Σ e^z > 1 (1.81 for logits −1, −2, −3;
    2.7·10¹⁶ for the third row), inside the returned enclosure. (The upper end used to be
    capped at 1, below ρ.)"""
    V = len(mids)
    lo, hi, _, rho_lo, rho_hi = _enclosure(mids, V, [0])
    rho = _exact_rho(mids, V)
    assert rho > 1
    assert 0 <= rho_lo <= rho <= rho_hi
    assert rho_hi <= rho * (1 + 1e-12)                 # and tight: the quotient, not a stand-in


@pytest.mark.parametrize("mids, V", [([-1.0, -2.0], 3), ([2.0, -1.0], 4), ([0.5, 0.25, -7.0], 3)])
def test_rho_is_enclosed_as_a_probability_when_a_token_has_logit_zero_or_one_is_positive(mids, V):
    lo, hi, _, rho_lo, rho_hi = _enclosure(mids, V, [0])
    rho = _exact_rho(mids, V)
    assert rho <= 1
    assert 0 <= rho_lo <= rho <= rho_hi
