"""The project's documents: the README (the front page) and docs/ (the rest), for tests that
hold what they say to what the code does."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def documents() -> list[Path]:
    """README.md and every Markdown file of docs/ (generated results included)."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def text(name: str | None = None) -> str:
    """One document's text (``name`` relative to the root, e.g. "docs/precision.md"), or all of them."""
    if name is not None:
        return (ROOT / name).read_text(encoding="utf-8")
    return "\n\n".join(p.read_text(encoding="utf-8") for p in documents())
