"""Reading YAML into a node graph, with the file's line numbers, refusing what a tasks file never needs.

PyYAML's safe loader, composed (not constructed) so that every value keeps its line:
aliases, merge keys and nesting deeper than :data:`MAX_DEPTH` are refused with their
line; lines are counted as editors count them (PyYAML also breaks lines at U+0085,
U+2028 and U+2029); syntax errors become one-line :class:`~tasks.errors.TaskError`
values with a hint. :func:`describe` names a node's YAML type for messages.
"""

from __future__ import annotations

import bisect
import os
import re
import stat

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode

from tasks.errors import TaskError

_TAG = "tag:yaml.org,2002:"
STR, MAP, SEQ = _TAG + "str", _TAG + "map", _TAG + "seq"
NULL, BOOL, INT, FLOAT = _TAG + "null", _TAG + "bool", _TAG + "int", _TAG + "float"
MERGE = _TAG + "merge"
_TAG_NAMES = {
    BOOL: "a boolean",
    INT: "an integer",
    FLOAT: "a number",
    NULL: "empty (null)",
    _TAG + "timestamp": "a date",
    _TAG + "binary": "binary data",
    _TAG + "set": "a set",
    _TAG + "omap": "an ordered mapping",
    _TAG + "pairs": "a list of pairs",
}

#: Tags that PyYAML's resolver gives to unquoted scalars.
IMPLICIT = {BOOL, INT, FLOAT, NULL, _TAG + "timestamp"}

#: Deepest YAML nesting accepted (the format itself needs 6 levels).
MAX_DEPTH = 32
#: Largest tasks file accepted, in bytes (4 MiB: about 100,000 facts written inline). The
#: YAML is read by PyYAML's pure-Python composer, at about 2 s and 60 MB of memory per MB
#: of inline facts; facts at scale belong in facts files, which are read in bulk.
MAX_TASKS_FILE_BYTES = 4 << 20
#: Longest line of a tasks file accepted, in bytes (1 MiB, as for a facts file): a fact on
#: its line holds two names of at most 1,000 characters (tasks.model.MAX_NAME_LENGTH), and
#: a flow-style mapping of tens of thousands of facts fits on one line.
MAX_TASKS_LINE_BYTES = 1 << 20

UTF8_BOM = b"\xef\xbb\xbf"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"




def line_of(data: bytes | str, offset: int) -> int:
    """1-based line of a byte (or character) offset."""
    return data.count(b"\n" if isinstance(data, bytes) else "\n", 0, offset) + 1


def check_size(data: bytes, file: str) -> None:
    """Refuse (a located :class:`TaskError`) a tasks file larger than :data:`MAX_TASKS_FILE_BYTES`
    or with a line longer than :data:`MAX_TASKS_LINE_BYTES`: checked on the raw bytes, before
    any YAML is parsed, so that neither costs the composer's time (about 0.25 s a megabyte
    even for one long scalar) nor becomes a name of megabytes. A line ends at \\n or \\r, as
    :class:`LineMap` counts lines."""
    if len(data) > MAX_TASKS_FILE_BYTES:
        raise too_large(f"{len(data):,} bytes", file)
    if len(data) <= MAX_TASKS_LINE_BYTES:
        return
    import numpy as np

    a = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero((a == 0x0A) | (a == 0x0D))
    bounds = np.concatenate(([-1], ends, [len(data)]))
    lengths = np.diff(bounds) - 1                         # the bytes between two line ends
    i = int(np.argmax(lengths))
    if lengths[i] > MAX_TASKS_LINE_BYTES:
        start = int(bounds[i]) + 1
        line = data.count(b"\n", 0, start) + data.count(b"\r", 0, start) - data.count(b"\r\n", 0, start) + 1
        raise TaskError(f"line is {int(lengths[i]):,} bytes long, more than the {MAX_TASKS_LINE_BYTES:,} a line of a "
                        f"tasks file may have", file=file, line=line,
                        fix="a name has at most 1,000 characters; write one fact per line, or put the facts in a "
                            "facts file (facts_file: a TSV or CSV file)")


def too_large(size: str, file: str) -> TaskError:
    """The error for a tasks file (or text) of ``size`` ("5,000,000 bytes"), over the limit."""
    return TaskError(f"the file is {size}, more than the {MAX_TASKS_FILE_BYTES:,} bytes a tasks file may have",
                     file=file, fix="put large dictionaries in facts files (facts_file: a TSV or CSV file), "
                                    "read in bulk")


def read_bytes(path: str, what: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file, or a :class:`TaskError` (without location) saying why not.
    With ``limit``, a file of more bytes is refused before it is read (a located error, as
    :func:`check_size` gives), and no more than ``limit + 1`` bytes are ever read (a file that
    grows meanwhile is refused by :func:`check_size`)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise TaskError(f"{what} '{path}' not found", fix="check the path") from None
    except PermissionError:
        raise TaskError(f"{what} '{path}' cannot be read: permission denied", fix="check its permissions") from None
    except OSError as e:
        raise TaskError(f"{what} '{path}' cannot be read: {e.strerror or e}", fix="check the path") from None
    if stat.S_ISDIR(info.st_mode):
        raise TaskError(f"{what} '{path}' is a directory", fix="give the path of a file")
    if not stat.S_ISREG(info.st_mode):
        raise TaskError(f"{what} '{path}' is not a regular file", fix="give the path of a file")
    if limit is not None and info.st_size > limit:
        raise too_large(f"{info.st_size:,} bytes", path)
    try:
        with open(path, "rb") as f:
            return f.read() if limit is None else f.read(limit + 1)
    except PermissionError:
        raise TaskError(f"{what} '{path}' cannot be read: permission denied", fix="check its permissions") from None
    except OSError as e:
        raise TaskError(f"{what} '{path}' cannot be read: {e.strerror or e}", fix="check the path") from None


def decode(data: bytes, file: str) -> str:
    """UTF-8 text of a whole file (BOM tolerated), or a located :class:`TaskError`."""
    if data.startswith(UTF16_BOMS):
        raise TaskError("the file is UTF-16 text, not UTF-8", file=file, line=1, fix="save it as UTF-8")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise TaskError(
            f"the file contains a NUL byte (offset {nul}): it looks like a binary file, not YAML text",
            file=file, line=line_of(data, nul), fix="give the path of the tasks YAML file",
        )
    skip = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = skip + e.start
        raise TaskError(
            f"the file is not UTF-8 text: byte 0x{data[offset]:02x} at offset {offset} cannot be decoded",
            file=file, line=line_of(data, offset), fix="save the file as UTF-8",
        ) from None


class LineMap:
    """1-based line numbers of YAML marks, counting only ``\n``, ``\r\n`` and ``\r`` as line ends.

    PyYAML also counts U+0085, U+2028 and U+2029 as line breaks; editors, grep and git
    do not, so in a text that holds them the lines are recounted from the offsets.
    """

    def __init__(self, text: str) -> None:
        self.starts: list[int] | None = None
        if any(c in text for c in "\x85\u2028\u2029"):
            self.starts = [m.end() for m in re.finditer(r"\r\n|\r|\n", text)]

    def line(self, mark: yaml.Mark | None) -> int | None:
        if mark is None:
            return None
        if self.starts is None:
            return mark.line + 1
        return bisect.bisect_right(self.starts, mark.index) + 1


class _Loader(yaml.SafeLoader):
    """A SafeLoader whose composer refuses aliases and deep nesting, with their line."""

    def __init__(self, text: str, file: str, lines: LineMap) -> None:
        super().__init__(text)
        self._file = file
        self._lines = lines
        self._depth = 0

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(AliasEvent):
            event = self.peek_event()
            line = self._lines.line(event.start_mark)
            if event.anchor and event.anchor[0].isdigit():
                raise TaskError(
                    f"'*{event.anchor}' is read by YAML as an alias",
                    file=self._file, line=line,
                    fix="put a template that starts with *1 in quotes: \"*1 has capital *2\"",
                )
            raise TaskError(
                f"alias '*{event.anchor}' is not supported in a tasks file",
                file=self._file, line=line, fix="write the value out instead of referring to an anchor",
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise TaskError(
                    f"the YAML is nested too deeply (more than {MAX_DEPTH} levels)",
                    file=self._file, line=self._lines.line(mark),
                    fix="a tasks file needs only a few levels; check the brackets",
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _syntax_fix(problem: str) -> str:
    if "mapping values are not allowed" in problem:
        return "put text that contains ': ' in quotes"
    if "'\\t'" in problem:
        return "indent with spaces, not tabs"
    if "found undefined alias" in problem or "expected alphabetic or numeric character" in problem:
        return "put text that starts with * or & in quotes"
    return "check the indentation, quotes, colons and brackets near this line"


def _marked(e: yaml.MarkedYAMLError, file: str, lines: LineMap) -> TaskError:
    """A PyYAML syntax error as a one-line :class:`TaskError` at its line."""
    mark = e.problem_mark or e.context_mark
    problem = e.problem or "bad YAML"
    if e.context:
        problem = f"{problem} ({e.context}"
        if e.context_mark is not None and mark is not None and e.context_mark.line != mark.line:
            problem += f" on line {lines.line(e.context_mark)}"
        problem += ")"
    return TaskError(f"YAML syntax error: {problem}", file=file,
                     line=lines.line(mark), fix=_syntax_fix(problem))


def compose(text: str, file: str, lines: LineMap) -> Node | None:
    """The YAML node graph of a document, or a located :class:`TaskError`."""
    loader: _Loader | None = None
    try:
        loader = _Loader(text, file, lines)
        return loader.get_single_node()
    except TaskError:
        raise
    except RecursionError:
        raise TaskError("the YAML is nested too deeply", file=file, fix="check the brackets") from None
    except yaml.composer.ComposerError as e:
        if e.context and "single document" in e.context and e.problem_mark is not None:
            raise TaskError("the file holds more than one YAML document", file=file, line=lines.line(e.problem_mark),
                            fix="remove the '---' line and everything after it, or merge the documents") from None
        raise _marked(e, file, lines) from None
    except yaml.MarkedYAMLError as e:
        raise _marked(e, file, lines) from None
    except yaml.reader.ReaderError as e:
        raise TaskError(
            f"unacceptable character #x{e.character:04x} in the file" if isinstance(e.character, int)
            else f"cannot read the YAML: {e.reason}",
            file=file, line=line_of(text, e.position) if e.position is not None else None,
            fix="remove control characters; write them as escapes in double quotes",
        ) from None
    except yaml.YAMLError as e:
        raise TaskError(f"cannot read the YAML: {e}", file=file, fix="check the YAML syntax") from None
    except Exception as e:  # noqa: BLE001 -- a PyYAML bug must still give one line, not a traceback
        raise TaskError(f"cannot read the YAML: {type(e).__name__}: {e}", file=file,
                        fix="check the YAML syntax") from None
    finally:
        if loader is not None:
            loader.dispose()


def describe(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if node.tag == STR:
        return "a string"
    return _TAG_NAMES.get(node.tag, f"tagged {node.tag}")
