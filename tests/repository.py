"""Where the tests find the repository, wherever a test file lives under tests/: its root,
its bundled examples and the tests' own data (tests/data)."""

from __future__ import annotations

from pathlib import Path

#: the tests' directory (tests/), where the shared helpers and tests/data are
TESTS = Path(__file__).resolve().parent
#: the repository's root: the packages, examples/, docs/, README.md
ROOT = TESTS.parent
EXAMPLES = ROOT / "examples"
DATA = TESTS / "data"
