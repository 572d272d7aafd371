"""Facts files: a task's dictionary in a TSV or CSV file beside the tasks file.

A file whose name ends in ``.csv`` is read with Python's :mod:`csv` module
(comma-separated, double quotes for fields containing commas, exactly 2 columns); any
other name is tab-separated with exactly 2 fields per line (no quoting). Files are
UTF-8 (a byte-order mark is tolerated); blank lines and ``#`` comments are skipped, and
a first line ``subject<sep>object`` is a header. Every problem names the file and line.

No other first line is a header, and a header with other names must not silently become
a fact: a first line whose two fields are both lower-case names (:func:`column_names`:
ASCII a-z, digits, ``_``, ``-`` and spaces, beginning with a letter), such as
``language<TAB>creator``, above a line with an upper-case letter (``Python<TAB>Guido van
Rossum``) is refused as a likely header (:func:`header_error`): written as
``subject<sep>object`` or commented out with ``#`` it is a header; a fact of that form is
kept by writing the header ``subject<sep>object`` above it. A first line over a line
without capitals tells nothing apart and stays a fact, as does the only line of a file.
"""

from __future__ import annotations

import csv
import io
import operator
import os
import re
import stat
from typing import Iterator

from tasks.errors import TaskError
from tasks.messages import show_name
from tasks.model import MAX_NAME_LENGTH
from tasks.yaml_nodes import UTF8_BOM, UTF16_BOMS

#: Longest line accepted in a facts file, in bytes.
MAX_LINE_BYTES = 1 << 20


def parse_mode(path: str) -> str:
    """How a facts file is read: "csv" (a name ending in .csv, any case) or "tsv"."""
    return "csv" if path.lower().endswith(".csv") else "tsv"


def facts_key(path: str, data: bytes) -> str:
    """What the facts read from ``data`` (the bytes of the facts file ``path``) depend on: how
    they are parsed (the name's extension) and the bytes' SHA-256, ``"tsv:<hex>"`` or
    ``"csv:<hex>"`` (the same bytes renamed from .tsv to .csv are other facts)."""
    import hashlib

    return f"{parse_mode(path)}:{hashlib.sha256(data).hexdigest()}"


def _regular_file(path: str, task: str, yaml_file: str, yaml_line: int) -> None:
    """Refuse (TaskError, at the ``facts_file`` line) a path that is missing, unreadable, a
    directory, or not a regular file (a FIFO or a device would block or never end)."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise _unreadable(path, task, e, yaml_file, yaml_line) from None
    if stat.S_ISDIR(info.st_mode) or not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise TaskError(f"facts file '{path}' of task {show_name(task)} is {kind}", file=yaml_file, line=yaml_line,
                        fix="give the path of a TSV or CSV file")


def facts_file_bytes(path: str, task: str, yaml_file: str, yaml_line: int) -> bytes:
    """The bytes of a facts file, read once: what :func:`read_plain` and :func:`iter_facts_file`
    parse when given them, and what :func:`facts_key` hashes, so that the key recorded for
    a task's facts is the key of the very bytes they were parsed from (a file rewritten
    between two reads cannot pair one file's hash with another's facts). Refused as
    :func:`iter_facts_file` refuses a path."""
    _regular_file(path, task, yaml_file, yaml_line)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise _unreadable(path, task, e, yaml_file, yaml_line) from None


def _unreadable(path: str, task: str, e: OSError, yaml_file: str, yaml_line: int) -> TaskError:
    """The one line for a facts file that cannot be opened or read (at its ``facts_file`` line)."""
    if isinstance(e, FileNotFoundError):
        return TaskError(f"facts file '{path}' of task {show_name(task)} not found", file=yaml_file, line=yaml_line,
                         fix="check the path; it is relative to the YAML file's directory")
    if isinstance(e, PermissionError):
        return TaskError(f"facts file '{path}' cannot be read: permission denied", file=yaml_file, line=yaml_line,
                         fix="check its permissions")
    return TaskError(f"facts file '{path}' cannot be read: {e.strerror or e}", file=yaml_file, line=yaml_line,
                     fix="check the path")


#: A field that reads as a column's name rather than an entity (see the module docstring).
_COLUMN_NAME = re.compile(r"[a-z][a-z0-9_ -]*")


def column_names(fields: list[str]) -> bool:
    """Whether two fields, stripped, are both lower-case names (module docstring)."""
    return len(fields) == 2 and all(_COLUMN_NAME.fullmatch(f.strip()) for f in fields)


def likely_header(first: list[str], second: list[str]) -> bool:
    """Whether the first fact line ``first`` (not ``subject<sep>object``) is refused as a
    header with other names, given the next fact line ``second``: its fields are lower-case
    names and the next line has an upper-case letter (a name written as names are)."""
    return column_names(first) and len(second) == 2 and any(c.isupper() for c in second[0] + second[1])


def header_error(fields: list[str], path: str, line: int) -> TaskError:
    """The one line for a first line :func:`likely_header` refuses."""
    sep = "," if parse_mode(path) == "csv" else "<TAB>"
    s, o = (f.strip() for f in fields)
    return TaskError(f"the first line '{s}{sep}{o}' looks like a header naming the columns, but the only header is "
                     f"'subject{sep}object' (this line would be read as the fact '{s}' -> '{o}')", file=path,
                     line=line, fix=f"write the header as 'subject{sep}object' or comment it out with '#'; if it is "
                                    f"a fact, put the header line 'subject{sep}object' above it")


def iter_facts_file(path: str, task: str, yaml_file: str, yaml_line: int,
                    data: bytes | None = None) -> Iterator[tuple[str, str, str, int]]:
    """(subject, object, path, line) for every fact of a facts file (see the module doc):
    read from the file, or from ``data``, its bytes read before (:func:`facts_file_bytes`)."""
    if data is None:
        _regular_file(path, task, yaml_file, yaml_line)
    is_csv = parse_mode(path) == "csv"
    header_done = False
    held: tuple[list[str], int] | None = None     # a first fact line of column names, until the next shows what it is
    for line, text in _file_lines(path, task, yaml_file, yaml_line, data):
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = _split_csv(text, path, line) if is_csv else text.split("\t")
        first = not header_done
        if first:
            header_done = True
            if [f.strip() for f in fields] == ["subject", "object"]:
                continue
        if len(fields) != 2:
            raise _bad_line(fields, text, is_csv, path, line)
        if first and column_names(fields):
            held = (fields, line)
            continue
        if held is not None:
            if likely_header(held[0], fields):
                raise header_error(held[0], path, held[1])
            yield held[0][0], held[0][1], path, held[1]
            held = None
        yield fields[0], fields[1], path, line
    if held is not None:
        yield held[0][0], held[0][1], path, held[1]


def read_plain(path: str, data: bytes | None = None) -> tuple[list[str], list[str]] | None:
    """The raw (subject, object) fields of every fact line of a facts file, in order, read in
    bulk, or None when the file needs :func:`iter_facts_file` (any problem to report, or a CSV
    line with quotes). Whenever it returns fields they are, once stripped, the fields
    :func:`iter_facts_file` yields (an object may keep the "\\r" of a "\\r\\n" line end), so
    the caller may use them in its place and read the file again line by line only to
    locate a problem.

    Why the same: the line reader splits the bytes at b"\\n" and decodes each line; a UTF-8
    sequence never contains the byte 0x0A, so decoding the whole file succeeds exactly when
    every line decodes, and splitting the text at "\\n" gives the same lines. Everything the
    line reader refuses (a UTF-16 mark, a NUL byte, a line longer than the limit, bytes that
    are not UTF-8, a line without exactly 2 fields, a likely header) makes this return None
    instead, and so does a field longer than :data:`~tasks.model.MAX_NAME_LENGTH` characters
    (its name may be too long): every field returned is at most that long. The fields are
    measured only in a file with a line that long (a field has no more characters than its
    line bytes).

    ``data``: the file's bytes, read before (:func:`facts_file_bytes`); else the file is read.
    """
    if data is None:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):     # a FIFO would block the read below
                return None
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
    if data.startswith(UTF16_BOMS) or b"\x00" in data:
        return None
    longest = len(data)                # bytes of the longest line, its line end counted
    if longest > min(MAX_NAME_LENGTH, MAX_LINE_BYTES):
        import numpy as np

        ends = np.flatnonzero(np.frombuffer(data, np.uint8) == 0x0A)
        if ends.size:
            longest = max(int(np.diff(ends).max(initial=0)), int(ends[0]) + 1, len(data) - int(ends[-1]) - 1)
        if longest > MAX_LINE_BYTES:
            return None
    if data.startswith(UTF8_BOM):
        data = data[len(UTF8_BOM):]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    is_csv = parse_mode(path) == "csv"
    if is_csv and '"' in text:
        return None
    sep = "," if is_csv else "\t"
    subjects: list[str] = []
    objects: list[str] = []
    header_done = headerless = False
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()                   # the text after the last line break: no line
    if "#" not in text and lines and set(map(operator.methodcaller("count", sep), lines)) == {1}:
        # every line is one field, the separator, one field (no comment, no blank line: a line
        # that is blank has no separator): the fields alternate, subject first
        fields = sep.join(lines).split(sep)
        if longest > MAX_NAME_LENGTH and max(map(len, fields)) > MAX_NAME_LENGTH:
            return None
        first = [x.strip() for x in fields[:2]]
        start = 2 if first == ["subject", "object"] else 0
        if start == 0 and likely_header(fields[:2], fields[2:4]):
            return None
        return fields[start::2], fields[start + 1::2]     # a "\r" before a line end: stripped by the caller
    for line in lines:
        line = line.rstrip("\r")     # the line reader strips "\r\n"; only "\r" can remain here
        stripped = line.strip()
        if not stripped or stripped[0] == "#":
            continue
        fields = line.split(sep)
        if not header_done:
            header_done = True
            if [x.strip() for x in fields] == ["subject", "object"]:
                continue
            headerless = True
        if len(fields) != 2:
            return None
        if headerless and len(subjects) == 1 and likely_header([subjects[0], objects[0]], fields):
            return None
        subjects.append(fields[0])
        objects.append(fields[1])
    if longest > MAX_NAME_LENGTH and max(map(len, subjects + objects), default=0) > MAX_NAME_LENGTH:
        return None
    return subjects, objects


def _file_lines(path: str, task: str, yaml_file: str, yaml_line: int,
                data: bytes | None = None) -> Iterator[tuple[int, str]]:
    """Decoded lines (1-based number, text without the line end) of a UTF-8 file, or of its
    bytes ``data`` read before (the same lines: a file and a buffer of its bytes read
    alike, line by line)."""
    try:
        f = open(path, "rb") if data is None else io.BytesIO(data)
    except OSError as e:
        raise _unreadable(path, task, e, yaml_file, yaml_line) from None
    offset = 0
    with f:
        number = 0
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as e:
                raise TaskError(f"cannot read the file: {e.strerror or e}", file=path, line=number + 1) from None
            if not raw:
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise TaskError(f"line is longer than {MAX_LINE_BYTES} bytes", file=path, line=number,
                                fix="is this a facts file? one fact per line")
            start = 0
            if number == 1:
                if raw.startswith(UTF16_BOMS):
                    raise TaskError("the file is UTF-16 text, not UTF-8", file=path, line=1, fix="save it as UTF-8")
                if raw.startswith(UTF8_BOM):
                    start = len(UTF8_BOM)
            nul = raw.find(b"\x00")
            if nul >= 0:
                raise TaskError(f"the file contains a NUL byte (offset {offset + nul}): it looks like a binary file",
                                file=path, line=number, fix="give a UTF-8 text file with one fact per line")
            try:
                text = raw[start:].decode("utf-8")
            except UnicodeDecodeError as e:
                bad = start + e.start
                raise TaskError(
                    f"the file is not UTF-8 text: byte 0x{raw[bad]:02x} at offset {offset + bad} cannot be decoded",
                    file=path, line=number, fix="save the file as UTF-8",
                ) from None
            offset += len(raw)
            yield number, text.rstrip("\r\n")


def _split_csv(text: str, path: str, line: int) -> list[str]:
    if '"' not in text:
        return text.split(",")
    try:
        return next(csv.reader([text], skipinitialspace=True, strict=True))
    except (csv.Error, StopIteration) as e:
        raise TaskError(f"badly formed CSV line: {e}", file=path, line=line,
                        fix="put a field in double quotes and double any quote inside it") from None


def _bad_line(fields: list[str], text: str, is_csv: bool, path: str, line: int) -> TaskError:
    n = len(fields)
    if is_csv:
        return TaskError(f"line has {n} comma-separated columns, expected 2 (subject,object)", file=path, line=line,
                         fix="put a field that contains a comma in double quotes")
    fix = "separate subject and object by one tab"
    if n == 1 and "," in text:
        fix += "; this file is read as tab-separated (name it .csv for comma-separated)"
    elif n == 1 and "  " in text:
        fix += " (spaces do not separate fields)"
    return TaskError(f"line has {n} tab-separated fields, expected 2 (subject<TAB>object)", file=path, line=line,
                     fix=fix)
