"""Reading YAML into a node graph, with the file's line numbers, refusing what a tasks file never needs.

PyYAML's safe loader, composed (not constructed) so that every value keeps its line:
aliases, merge keys and nesting deeper than :data:`MAX_DEPTH` are refused with their
line; lines are counted as editors count them (PyYAML also breaks lines at U+0085,
U+2028 and U+2029); syntax errors become one-line :class:`~tasks.errors.TaskError`
values with a hint. :func:`describe` names a node's YAML type for messages.

Where PyYAML has its libyaml binding, :func:`scan` reads the text's event stream with
libyaml first (some 20 times faster than the pure-Python parser, in constant memory) and
refuses there what the composer would refuse (:func:`compose` runs it before the composer):
so a malformed file costs the C parser's time, not the composer's, whatever its size.
"""

from __future__ import annotations

import bisect
import os
import re
import stat

import yaml
from yaml.events import (AliasEvent, DocumentStartEvent, MappingEndEvent, MappingStartEvent, ScalarEvent,
                         SequenceEndEvent, SequenceStartEvent, StreamEndEvent)
from yaml.nodes import MappingNode, Node, SequenceNode

from tasks.errors import TaskError

try:                                         # PyYAML's C parser (libyaml), or None where PyYAML has none
    from yaml.cyaml import CParser
except ImportError:                          # pragma: no cover -- PyYAML built without libyaml
    CParser = None  # type: ignore[assignment,misc]

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
#: Largest tasks file accepted, in bytes (4 MiB: about 100,000 facts written inline). A
#: file is refused for its YAML (:func:`scan`) at libyaml's speed, about 0.1 s a MB, and one
#: that passes is composed by PyYAML's pure-Python composer, at about 1.6 s and 50 MB of
#: memory per MB of inline facts; facts at scale belong in facts files, read in bulk.
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
            raise _alias(event.anchor, self._file, self._lines.line(event.start_mark))
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _too_deep(self._file, self._lines.line(self.peek_event().start_mark))
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _line_break_count(text: str, end: int) -> int:
    """Line ends (\\n, \\r\\n, \\r) in ``text[:end]``."""
    return text.count("\n", 0, end) + text.count("\r", 0, end) - text.count("\r\n", 0, end)


def _mark(text: str, index: int, file: str) -> yaml.Mark:
    """A PyYAML mark at a character offset, its line counted from the offset (as
    :class:`LineMap` counts lines; libyaml also counts a line past a last line that has no
    line end)."""
    index = max(0, min(index, len(text)))
    line = _line_break_count(text, index)
    start = max(text.rfind("\n", 0, index), text.rfind("\r", 0, index)) + 1
    return yaml.Mark(file, index, line, index - start, None, None)


def _c_error(e: yaml.MarkedYAMLError, text: str, file: str, shift: int) -> yaml.MarkedYAMLError:
    """libyaml's syntax error with its marks' lines counted from their offsets (``shift`` added:
    see :func:`scan`) and, where its wording names no character, the character at the mark
    (as PyYAML's does)."""
    problem = e.problem
    mark = _mark(text, e.problem_mark.index + shift, file) if e.problem_mark is not None else None
    context_mark = _mark(text, e.context_mark.index + shift, file) if e.context_mark is not None else None
    if mark is not None and mark.index < len(text):
        if problem == "found character that cannot start any token":
            problem = f"found character {text[mark.index]!r} that cannot start any token"
        elif problem == "found unknown escape character" and text[mark.index] == "\\" and mark.index + 1 < len(text):
            problem = f"found unknown escape character {text[mark.index + 1]!r}"
    return type(e)(e.context, context_mark, problem, mark)


_UNSURE = -2                                 # a tab the scan cannot place: the composer decides
_BREAK = re.compile("[\r\n\x85\u2028\u2029]")  # PyYAML's line breaks
_QUOTE = re.compile("['\"]")
_QUOTE_OR_BLOCK = re.compile("['\"|>]")
_BLOCK = re.compile("[|>]")
_QUESTION_END = re.compile(r"\?[,\]}]")
_YAML_TAG = re.compile(r"tag:yaml\.org,2002:[a-z]+\Z|!\Z")   # YAML's own tags (!!str), and '!'


class _LineStarts:
    """Where the line (as PyYAML counts lines) that holds a position starts, asked for
    positions that do not decrease: each line end is read once."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.start = 0

    def __call__(self, at: int) -> int:
        for end in _BREAK.finditer(self.text, self.start, at):
            self.start = end.end()
        return self.start


def scan(text: str, file: str, lines: LineMap) -> None:
    """Refuse, with the error :func:`compose` would give, a text that the composer would
    refuse, without composing it: read with libyaml's parser, event by event, so that a
    malformed file costs about 0.1 s a MB and no memory that grows with it. Does nothing
    where PyYAML has no libyaml (the composer then refuses as before).

    Refused here, in the order the composer meets them: a character PyYAML does not read
    (PyYAML's own check); a syntax error (libyaml's message, its lines counted as editors
    count them); what libyaml reads and PyYAML refuses, with PyYAML's message: a tab outside
    quotes, block scalars and comments (libyaml reads it as white space), a '?' inside a
    plain scalar in a flow collection, a block scalar's first line; an alias (as
    :class:`_Loader`, before it nests); nesting deeper than :data:`MAX_DEPTH`; an anchor
    defined twice; a second document. A text that passes is read by PyYAML as before: the
    scan only refuses. Where it cannot tell whether PyYAML refuses a tab (one after a '#'
    that may not start a comment, or one libyaml had not placed when it met an error after
    it, past a quote), or where the two may read differently (a byte-order mark inside the
    text, a tag other than YAML's own such as !!str, a directive, a tab starting a block
    scalar, '[?]'), it stops and leaves the text to the composer.
    """
    if CParser is None:
        return
    yaml.reader.Reader(text)                 # PyYAML's check of the characters, its ReaderError
    if text.find("\ufeff", 1) >= 0:
        return                               # a byte-order mark inside: PyYAML reads it as text, libyaml not
    parser = CParser(text)
    shift = 1 if text.startswith("\ufeff") else 0       # libyaml counts from after a byte-order mark
    open_: list[int] = []                    # per collection open: where its '[' or '{' is, -1 (a block one, a
    flows: list[int] = []                    # flow pair without braces), -2 (after an anchor or a tag); and
    opened = -1                              # those of the flow ones; where the last event opened one
    anchors: dict[str, int] = {}             # where each anchor is
    documents = 0
    last = 0                                 # where the last event starts: every token before it was read
    tab = text.find("\t")                   # the first tab not yet placed
    starts = _LineStarts(text)
    try:
        while True:
            try:
                event = parser.get_event()
            except yaml.MarkedYAMLError as e:
                if _libyaml_only(e, text, shift):
                    return
                end = e.problem_mark.index + shift if e.problem_mark is not None else len(text)
                if 0 <= tab < end:           # a tab before the error, perhaps in a token not yet read
                    if e.context_mark is not None and "quoted scalar" in (e.context or ""):
                        end = min(end, e.context_mark.index + shift)     # from there on, in the quoted scalar
                    if _tabs(text, tab, end, file, starts, unread=last) == _UNSURE:
                        return
                raise _c_error(e, text, file, shift) from None
            start = last = event.start_mark.index + shift
            stop = event.end_mark.index + shift
            just_opened, opened = opened, -1
            if 0 <= tab < start:             # no quoted or block scalar holds these tabs
                tab = _tabs(text, tab, start, file, starts, bool(flows))
                if tab == _UNSURE:
                    return
            kind = type(event)
            if kind is ScalarEvent or kind is MappingStartEvent or kind is SequenceStartEvent:
                if event.tag is not None and not _YAML_TAG.match(event.tag):
                    return                   # a tag of its own: PyYAML's reading of it may differ
                if len(open_) >= MAX_DEPTH:
                    raise _too_deep(file, lines.line(_mark(text, start, file)))
                anchor = event.anchor
                if anchor is not None:
                    if anchor in anchors:
                        raise yaml.composer.ComposerError(
                            f"found duplicate anchor {anchor!r}; first occurrence",
                            _mark(text, anchors[anchor], file), "second occurrence", _mark(text, start, file))
                    anchors[anchor] = start
                if kind is ScalarEvent:
                    block = _BLOCK.search(text, start, stop) if event.style in ("|", ">") else None
                    if block is not None:            # (its '|' or '>' after an anchor or a tag, which hold neither)
                        _block_header(text, block.start(), file)
                    if event.style in ("'", '"', "|", ">"):
                        if 0 <= tab < stop:
                            tab = text.find("\t", stop)
                    elif flows:
                        tab = _flow_question(text, start, stop, flows[-1], tab, file,
                                             anchor is None and event.tag is None, starts)
                        if tab == _UNSURE:
                            return
                else:
                    if just_opened == start and open_[-1] != -1:
                        open_[-1] = -1       # the one opened here is a pair without braces, this its key
                        flows.pop()
                    first = text[start:start + 1]
                    bracket = -1 if not event.flow_style else start if first == (
                        "[" if kind is SequenceStartEvent else "{") else -2 if first in ("&", "!") else -1
                    open_.append(bracket)
                    if bracket != -1:
                        flows.append(bracket)
                    opened = start
            elif kind is MappingEndEvent or kind is SequenceEndEvent:
                if open_.pop() != -1:
                    flows.pop()
            elif kind is AliasEvent:
                raise _alias(event.anchor, file, lines.line(_mark(text, start, file)))
            elif kind is DocumentStartEvent:
                documents += 1
                if documents > 1:
                    raise yaml.composer.ComposerError("expected a single document in the stream", None,
                                                      "but found another document", _mark(text, start, file))
            elif kind is StreamEndEvent:
                _tabs(text, tab, len(text) + 1, file, starts, False)
                return
    finally:
        parser.dispose()


def _libyaml_only(e: yaml.MarkedYAMLError, text: str, shift: int) -> bool:
    """An error libyaml finds where PyYAML may read on: a tab that starts the first line of a
    block scalar, a tag, a directive, a '?' right before a flow collection's ',', ']' or '}'
    (left to the composer)."""
    said = f"{e.context or ''} {e.problem or ''}"
    if (e.problem or "").startswith("did not find expected ',' or ") and e.context_mark is not None \
            and e.problem_mark is not None:
        return _QUESTION_END.search(text, e.context_mark.index + shift, e.problem_mark.index + shift + 1) is not None
    return ("where an indentation space is expected" in said or "tag" in said or "URI" in said
            or "directive" in said or "YAML document" in said)


def _block_header(text: str, start: int, file: str) -> None:
    """PyYAML's check of a block scalar's first line, from its '|' or '>' at ``start``: its
    indicators, then spaces, a comment, the line's end. libyaml also takes a tab there, and
    a '#' right after the indicators."""
    def at(i: int) -> str:
        return text[i] if i < len(text) else "\0"

    def zero(i: int) -> yaml.scanner.ScannerError:
        return yaml.scanner.ScannerError("while scanning a block scalar", _mark(text, start, file),
                                         "expected indentation indicator in the range 1-9, but found 0",
                                         _mark(text, i, file))

    i = start + 1
    if at(i) in "+-":
        i += 1
        if at(i) in "0123456789":
            if at(i) == "0":
                raise zero(i)
            i += 1
    elif at(i) in "0123456789":
        if at(i) == "0":
            raise zero(i)
        i += 1
        if at(i) in "+-":
            i += 1
    if at(i) not in "\0 \r\n\x85\u2028\u2029":
        raise yaml.scanner.ScannerError("while scanning a block scalar", _mark(text, start, file),
                                        f"expected chomping or indentation indicators, but found {at(i)!r}",
                                        _mark(text, i, file))
    while at(i) == " ":
        i += 1
    if at(i) == "#":
        return                               # a comment to the end of the line
    if at(i) not in "\0\r\n\x85\u2028\u2029":
        raise yaml.scanner.ScannerError("while scanning a block scalar", _mark(text, start, file),
                                        f"expected a comment or a line break, but found {at(i)!r}",
                                        _mark(text, i, file))


def _flow_question(text: str, start: int, end: int, bracket: int, tab: int, file: str, bare: bool,
                   starts: _LineStarts) -> int:
    """A plain scalar in a flow collection (its '[' or '{' at ``bracket``, -2 if not known),
    from ``start`` to ``end``, ``bare`` if no anchor or tag comes before it: libyaml reads a
    '?' in it as part of it, PyYAML ends it there and refuses the '?' (a key indicator)
    after it: PyYAML's error, unless a tab before it is refused first. Returns the next tab,
    or _UNSURE (a '?' after an anchor or a tag, or in a collection whose bracket is not
    known)."""
    question = text.find("?", start + bare, end)
    if question < 0:
        return tab
    if 0 <= tab < question:
        tab = _tabs(text, tab, question, file, starts)          # (in the flow collection)
        if tab == _UNSURE:
            return tab
    if bracket < 0 or not bare:
        return _UNSURE
    sequence = text[bracket] == "["
    raise yaml.parser.ParserError(f"while parsing a flow {'sequence' if sequence else 'mapping'}",
                                  _mark(text, bracket, file),
                                  f"expected ',' or '{']' if sequence else '}'}', but got '?'",
                                  _mark(text, question, file))


def _tabs(text: str, tab: int, end: int, file: str, starts: _LineStarts, flow: bool = True,
          unread: int | None = None) -> int:
    """Place the tabs from ``tab`` to ``end``, none in a quoted or block scalar: PyYAML's error
    at the first that is not in a comment. Returns the next tab after those (-1: none), or
    _UNSURE where it cannot tell. ``flow``: whether they may be in a flow collection. With
    ``unread``: libyaml stopped at an error, and the tokens from ``unread`` on may not have
    been read, so a tab after a quote or a block scalar's '|' or '>' there is unsure."""
    while 0 <= tab < end:
        if unread is not None and _QUOTE_OR_BLOCK.search(text, unread, tab):
            return _UNSURE
        comment = _comment(text, starts(tab), tab, flow)
        if comment is None:
            return _UNSURE
        if not comment:
            raise yaml.scanner.ScannerError("while scanning for the next token", None,
                                            "found character '\\t' that cannot start any token",
                                            _mark(text, tab, file))
        after = _BREAK.search(text, tab)     # the comment runs to the end of its line
        tab = text.find("\t", after.end()) if after else -1
    return tab


def _comment(text: str, line_start: int, tab: int, flow: bool) -> bool | None:
    """Whether a tab that no quoted or block scalar holds is in a comment (None: cannot tell).

    A comment starts at a '#' at the start of a line or after a space (PyYAML reads it so
    anywhere outside a quoted or block scalar) and runs to the end of the line (PyYAML's
    lines, from ``line_start``): the tab is in one if such a '#' comes before it on its line
    with no quote between them (a quote could close a scalar that holds the '#'). A '#' after a
    character a plain scalar can hold is in that scalar, or in a token PyYAML refuses there
    (an anchor, a tag), not a comment; after a quote, a bracket or a comma it may start one,
    and after ':' or '?' too in a flow collection (an indicator there)."""
    hash_ = text.find("#", line_start, tab)
    while hash_ >= 0:
        before = text[hash_ - 1] if hash_ > line_start else " "
        if before == " ":
            return None if _QUOTE.search(text, hash_, tab) else True
        if before in "'\"[]{}," or (flow and before in ":?"):
            return None
        hash_ = text.find("#", hash_ + 1, tab)
    return False


def _alias(anchor: str, file: str, line: int | None) -> TaskError:
    if anchor and anchor[0].isdigit():
        return TaskError(f"'*{anchor}' is read by YAML as an alias", file=file, line=line,
                         fix="put a template that starts with *1 in quotes: \"*1 has capital *2\"")
    return TaskError(f"alias '*{anchor}' is not supported in a tasks file", file=file, line=line,
                     fix="write the value out instead of referring to an anchor")


def _too_deep(file: str, line: int | None) -> TaskError:
    return TaskError(f"the YAML is nested too deeply (more than {MAX_DEPTH} levels)", file=file, line=line,
                     fix="a tasks file needs only a few levels; check the brackets")


def _syntax_fix(problem: str) -> str:
    if "mapping values are not allowed" in problem:
        return "put text that contains ': ' in quotes"
    if "'\\t'" in problem or "tab character" in problem:
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
        scan(text, file, lines)
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
