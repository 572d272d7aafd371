"""Writing benchmark tables into ``benchmarks/RESULTS.md`` without losing anything else.

Each benchmark owns one generated block, between ``<!-- begin NAME -->`` and
``<!-- end NAME -->``; a rerun replaces that block and keeps every other line of the
file (other benchmarks' blocks, hand-written analysis). A new block is appended.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from tasks.files import write_text_atomic

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2 ** 20:.0f} GB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return (f"{cpu}, {os.cpu_count()} CPUs{mem}; Python {platform.python_version()}, {platform.system()} "
            f"{platform.machine()}")


def write_block(name: str, text: str, path: Path = RESULTS) -> None:
    """Replace (or append) the generated block ``name`` of the results file."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end) + 1:]
    else:
        new = old.rstrip() + "\n\n" + block
    write_text_atomic(path, new)


def phase_lines(rows: list[tuple[str, dict[str, float]]]) -> list[str]:
    """Markdown bullets "label: phase seconds, ..." for (label, phases) pairs."""
    return [f"* {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) for label, phases in rows]


def publish(name: str, lines: list[str], write: bool = True) -> None:
    """Print a benchmark's block and (``write``) put it into the results file."""
    text = "\n".join(lines)
    print(text)
    if write:
        write_block(name, text)
