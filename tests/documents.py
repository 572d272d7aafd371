"""The project's documents: the README (the front page) and docs/ (the rest), for tests that
hold what they say to what the code does, and the commands they show (``tests/test_docs.py``
runs them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from repository import ROOT


def documents() -> list[Path]:
    """README.md and every Markdown file of docs/ (generated results included)."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def written() -> list[Path]:
    """The documents written by hand: README.md and docs/*.md. (docs/training/ holds what
    ``python -m training.sweep`` generates: its runs, with their own command and time, like
    benchmarks/RESULTS.md.)"""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def text(name: str | None = None) -> str:
    """One document's text (``name`` relative to the root, e.g. "docs/precision.md"), or all of them."""
    if name is not None:
        return (ROOT / name).read_text(encoding="utf-8")
    return "\n\n".join(p.read_text(encoding="utf-8") for p in documents())


# --- the commands the documents show -------------------------------------------------------
#
# A command is shown in one of two fenced forms, and only there:
#
# * a ``sh`` block (``bash`` and ``shell`` are read alike): every line that is not blank or a
#   comment is a command, without output; a line ending in a backslash continues on the next;
# * a ``console`` block: a transcript, each command after a ``$ `` prompt and followed by the
#   output it prints, up to the next prompt. An output line ``...`` stands for any lines (none
#   included), and ``...`` inside a line for any text there.
#
# A trailing comment (`` # ...``) explains a command; one that says ``exit N`` gives the exit
# status the command ends with (0 otherwise).

COMMAND_FENCES = ("sh", "bash", "shell", "console")
PROMPT = "$ "


@dataclass(frozen=True)
class Block:
    """A fenced code block: its document (relative to the root), the line of its opening
    fence (1-based), its info string's language and its lines."""

    document: str
    line: int
    language: str
    lines: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One command a document shows: ``text`` without its comment, the comment (or ""), the
    exit status the comment states (0 if none), and the output shown (None in a ``sh``
    block, which shows none)."""

    block: Block
    line: int
    text: str
    comment: str
    output: tuple[str, ...] | None

    @property
    def status(self) -> int:
        found = re.search(r"\bexit (\d+)\b", self.comment)
        return int(found.group(1)) if found else 0


def blocks(path: Path, content: str | None = None) -> list[Block]:
    """The fenced blocks of a Markdown file (or of ``content``, given as that file's), in
    order. A fence is a line starting with three backticks (indented fences are not used in
    these documents); an unclosed one is an error."""
    lines = (path.read_text(encoding="utf-8") if content is None else content).split("\n")
    found, start, language = [], None, ""
    for number, line in enumerate(lines, start=1):
        if not line.startswith("```"):
            continue
        if start is None:
            start, language = number, line[3:].strip().split(" ")[0]
        else:
            found.append(Block(_name(path), start, language, tuple(lines[start:number - 1])))
            start = None
    if start is not None:
        raise ValueError(f"{path}:{start}: a code fence is never closed")
    return found


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def split_comment(line: str) -> tuple[str, str]:
    """``command  # comment`` -> (command, comment): a ``#`` starts a comment at the start of
    a word and outside quotes, as in the shell."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def _joined(lines: list[str], i: int) -> tuple[str, int]:
    """The command starting at ``lines[i]`` with its backslash continuations joined, and the
    index after it."""
    text = lines[i]
    while text.rstrip().endswith("\\") and i + 1 < len(lines):
        i += 1
        text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
    return text, i + 1


def commands_of(block: Block) -> list[Command]:
    """The commands a command block shows (none for another language)."""
    lines, found, i = list(block.lines), [], 0
    if block.language == "console":
        while i < len(lines):
            if not lines[i].startswith(PROMPT):
                raise ValueError(f"{block.name}: a console block holds prompts and their output; "
                                 f"line {block.line + 1 + i} comes before any prompt")
            first = i
            text, i = _joined(lines, i)
            end = i
            while end < len(lines) and not lines[end].startswith(PROMPT):
                end += 1
            command, comment = split_comment(text[len(PROMPT):])
            found.append(Command(block, block.line + 1 + first, command.strip(), comment, tuple(lines[i:end])))
            i = end
    elif block.language in COMMAND_FENCES:
        while i < len(lines):
            first = i
            text, i = _joined(lines, i)
            command, comment = split_comment(text)
            if command.strip():
                found.append(Command(block, block.line + 1 + first, command.strip(), comment, None))
    return found


def shown_commands(paths: list[Path]) -> list[Command]:
    """Every command the given documents show, in order."""
    return [c for p in paths for b in blocks(p) for c in commands_of(b)]


def _pattern(expected: str) -> re.Pattern:
    """An output line shown in a transcript as a pattern: literal text, with ``...`` for any text."""
    return re.compile(".*".join(re.escape(part) for part in expected.rstrip().split("...")) + r"\Z")


def transcript_matches(expected: list[str], actual: list[str]) -> bool:
    """Whether the printed lines ``actual`` are the transcript ``expected``: line for line
    (trailing spaces aside), an expected line ``...`` standing for any number of lines and
    ``...`` inside a line for any text."""
    expected = [e.rstrip() for e in expected]
    actual = [a.rstrip() for a in actual]
    patterns = [None if e == "..." else _pattern(e) for e in expected]
    # reachable[j]: the first i expected lines can match the first j actual lines
    reachable = [True] + [False] * len(actual)
    for pattern in patterns:
        following = [False] * (len(actual) + 1)
        for j in range(len(actual) + 1):
            if pattern is None:
                following[j] = reachable[j] or (j > 0 and following[j - 1])
            else:
                following[j] = j > 0 and reachable[j - 1] and bool(pattern.match(actual[j - 1]))
        reachable = following
    return reachable[len(actual)]
