"""Claim: every number this room returns encloses the real value it stands for.

Mid-radius intervals in float64 with every radius rounded upward (:mod:`.interval`), the
same operations compiled row by row (:mod:`.kernels`), and the one set of constants both
use (:mod:`.constants`), so that the numpy and the compiled enclosures are the same
(a test compares them bit for bit).
"""
