"""How much each property test runs: the default run and the full one.

``python -m pytest`` runs every property with a quarter of its examples (at least a few),
so that the whole suite stays within minutes on a 2-core machine; ``MOE_TESTS=full python -m
pytest`` (what CI runs, ``.ci/run``) runs the counts each test names. Heavy single tests
that sweep a large set (every query of a large example, every mutant of a generated set)
take an evenly spread part of it in the default run (:func:`part`) and all of it in the
full one. Nothing here changes what a test asserts, only how many inputs it tries.
"""

from __future__ import annotations

import os

FULL = os.environ.get("MOE_TESTS", "").strip().lower() == "full"


def examples(n: int, floor: int = 5) -> int:
    """``max_examples`` for a property named with ``n`` examples: ``n`` in the full run, a
    quarter of it (at least ``floor``) by default."""
    return n if FULL else max(min(floor, n), n // 4)


def part(items: list, share: int = 4) -> list:
    """All of ``items`` in the full run; every ``share``-th one (the first included) by default."""
    return list(items) if FULL else list(items)[::share]
