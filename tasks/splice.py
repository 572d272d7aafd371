"""An edited facts file read against its previous bytes: only the lines that changed.

An edit of a large facts file (one object changed, a line added or removed) leaves almost
all of its bytes where they were. Given the bytes a task's facts were read from before
(``old``) and the file's bytes now (``new``), :func:`splice` finds the lines between
their longest common prefix and suffix, and returns what those lines held before and
hold now. The caller (:class:`tasks.compiled.FactsCache`) then takes the task's facts
as the old facts without the subjects of the old lines, plus the facts of the new lines.

**Why that is the facts a full read gives.** Let ``old`` be in *plain form*: no byte-order
mark, no NUL, no ``#``, UTF-8, every line exactly one separator (and, in a ``.csv``, no
quote), no line longer than the reader's limit. The bulk reader
(:func:`tasks.facts_files.read_plain`) then reads each line as one fact (the first line
is skipped when it is the header ``subject<sep>object``), and a file of that form whose
fact lines outnumber none of its distinct subjects (``old_facts``: the count the old read
gave) has no subject twice. The common prefix is cut back to a line start and holds at
least the first line, and the common suffix starts at a line start, so the lines of each
file are the prefix's lines, then the middle's, then the suffix's, and the prefix and
suffix lines (the first line among them) are the same in both. If every middle line of
``new`` is in plain form too, ``new`` is in plain form, each of its lines is one fact,
and the first line is a header in both files or in neither (a first line of lower-case
names, which the reader refuses as a likely header or not by the line after it, is read
in full: None). So the facts of ``new`` are
those of the common lines, i.e. the old facts without the subjects of the old middle lines
(each subject is on one line), plus the facts of the new middle lines; and ``new`` has
no subject twice exactly when the new middle lines' subjects are distinct and none of
them is an old subject outside the old middle lines (the caller checks that on ids).
Anything else returns None, and the file is read in full.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.facts_files import MAX_LINE_BYTES, column_names, parse_mode
from tasks.yaml_nodes import UTF8_BOM, UTF16_BOMS


@dataclass(frozen=True)
class Splice:
    """The middle lines of an edited facts file: the names on them before and now (stripped,
    in line order; ``added`` are the facts of the new lines, subject and object)."""

    removed_subjects: list[str]
    added_subjects: list[str]
    added_objects: list[str]


def _separator(path: str) -> bytes:
    return b"," if parse_mode(path) == "csv" else b"\t"


def _lines_one_separator_each(data: bytes, sep: bytes) -> bool:
    """Whether every line of ``data`` (split at b"\\n", the empty piece after a final line
    break not a line) has exactly one ``sep`` byte and at most ``MAX_LINE_BYTES`` bytes."""
    if not data:
        return True
    a = np.frombuffer(data, np.uint8)
    breaks = np.flatnonzero(a == 0x0A)
    n_lines = breaks.size + (data[-1:] != b"\n")
    starts = np.concatenate(([0], breaks + 1))[:n_lines]
    stops = np.concatenate((breaks + 1, [len(data)]))[:n_lines]
    if int((stops - starts).max()) > MAX_LINE_BYTES:
        return False
    line_of_sep = np.searchsorted(breaks, np.flatnonzero(a == sep[0]))    # a separator's line: breaks before it
    return bool((np.bincount(line_of_sep, minlength=n_lines)[:n_lines] == 1).all()) and line_of_sep.size == n_lines


def plain_form(data: bytes, path: str) -> bool:
    """Whether the bytes of the facts file ``path`` are in plain form (module docstring)."""
    if data.startswith(UTF16_BOMS) or data.startswith(UTF8_BOM) or b"\x00" in data or b"#" in data:
        return False
    if parse_mode(path) == "csv" and b'"' in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return _lines_one_separator_each(data, _separator(path))


def fact_lines(data: bytes, path: str) -> int:
    """The number of facts a file in plain form holds: its lines, less a header line."""
    n = data.count(b"\n") + (data[-1:] not in (b"", b"\n"))
    first = data.split(b"\n", 1)[0].decode("utf-8").split(_separator(path).decode())
    return n - (n > 0 and [x.strip() for x in first] == ["subject", "object"])


def _fields(middle: bytes, sep: str) -> tuple[list[str], list[str]]:
    """The stripped (subjects, objects) of lines in plain form."""
    lines = middle.decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    fields = sep.join(lines).split(sep) if lines else []
    return [x.strip() for x in fields[0::2]], [x.strip() for x in fields[1::2]]


def splice(old: bytes, new: bytes, path: str, old_facts: int, max_lines: int | None = None) -> Splice | None:
    """The middle lines of ``new`` against ``old`` (module docstring), or None when the file
    must be read in full: ``old`` not in plain form or with a subject twice (more fact lines
    than ``old_facts``) or a first line of lower-case names, an edit that reaches the first line, a new middle line not
    in plain form (a comment, a blank line, a quote in a ``.csv``, ...), or middles of more
    than ``max_lines`` lines together (the caller's choice: reading the file costs no more)."""
    if not plain_form(old, path) or fact_lines(old, path) != old_facts:
        return None
    first = old.split(b"\n", 1)[0].decode("utf-8").split(_separator(path).decode())
    if [x.strip() for x in first] != ["subject", "object"] and column_names(first):
        return None                                         # whether it is a likely header depends on the next line
    n = min(len(old), len(new))
    a, b = np.frombuffer(old, np.uint8), np.frombuffer(new, np.uint8)
    differ = np.flatnonzero(a[:n] != b[:n])
    prefix = int(differ[0]) if differ.size else n
    start = old.rfind(b"\n", 0, prefix) + 1                 # the prefix cut back to a line start
    if start == 0:
        return None                                         # the first line may differ: header, mark
    room = n - start                                        # the suffix may not reach into the prefix
    suffix = 0
    if room:
        tail_differ = np.flatnonzero(a[len(old) - room:][::-1] != b[len(new) - room:][::-1])
        suffix = int(tail_differ[0]) if tail_differ.size else room
    stop_old, stop_new = len(old) - suffix, len(new) - suffix
    if old[stop_old - 1:stop_old] != b"\n" or new[stop_new - 1:stop_new] != b"\n":
        # the suffix moved on to a line start in both files (after a line break it holds)
        brk = old.find(b"\n", stop_old)
        step = (brk + 1 if brk >= 0 else len(old)) - stop_old
        stop_old, stop_new = stop_old + step, stop_new + step
    middle_old, middle_new = old[start:stop_old], new[start:stop_new]
    if max_lines is not None and middle_old.count(b"\n") + middle_new.count(b"\n") > max_lines + 2:
        return None
    if b"\x00" in middle_new or b"#" in middle_new or (parse_mode(path) == "csv" and b'"' in middle_new):
        return None
    try:
        middle_new.decode("utf-8")
    except UnicodeDecodeError:
        return None
    sep = _separator(path)
    if not _lines_one_separator_each(middle_new, sep):
        return None
    removed, _ = _fields(middle_old, sep.decode())
    subjects, objects = _fields(middle_new, sep.decode())
    return Splice(removed, subjects, objects)
