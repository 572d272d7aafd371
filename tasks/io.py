"""Load and dump task sets: the ``tasks.yaml`` format.

Format
======

.. code-block:: yaml

    epsilon: 0.01            # optional, 0 < epsilon < 1
    parameters:              # optional construction parameters: positive numbers
      beta: 12               # allowed names: beta, gamma
      gamma: 20
    tasks:                   # required, a non-empty list
      - name: capital        # required string, unique among the tasks
        templates:           # required non-empty list of strings (one string is also accepted)
          - the capital of ⋆1 is ⋆2      # ⋆1/⋆2 (U+22C6) or ASCII *1/*2
          - "*1 has capital *2"          # quote a template that starts with *
        facts:               # inline: a mapping subject: object ...
          France: Paris
          New York City: United States   # entities may contain spaces and any unicode
      - name: continent
        templates: [the continent of *1 is *2]
        facts:               # ... or a list of [subject, object] pairs
          - [France, Europe]
      - name: currency
        templates: [the currency of *1 is *2]
        facts_file: currency.tsv         # or a facts file (or a list of them)

Rules
-----

* Top-level keys: ``epsilon``, ``parameters``, ``tasks``; task keys: ``name``,
  ``templates``, ``facts``, ``facts_file``. Any other key is an error (typo protection).
* Templates are split into words on whitespace. ``⋆1``/``*1`` is the subject slot,
  ``⋆2``/``*2`` the object slot; exactly one of each, ⋆1 first. YAML reads an unquoted
  ``*1`` at the start of a value as an alias, so quote such templates.
* A task has exactly one of ``facts`` (inline) and ``facts_file``. Inline facts are a
  mapping ``subject: object`` or a list of ``[subject, object]`` pairs.
* Names (task names, subjects, objects) must be YAML *strings*. YAML 1.1 reads ``no``,
  ``yes``, ``on``, ``off``, ``true``, ``null``, ``~``, ``1984``, ``3.5``, ``2001-01-01``
  as other types: write such names in quotes (``Norway: 'no'``). Names are stripped of
  surrounding whitespace and must not contain tabs or line breaks.
* The same fact twice is harmless (kept once); a subject with two different objects in
  one task is an error naming both places.
* No token may be both a template word and an entity, and no two tasks may share an
  object-query prefix (nobody could route it): both are errors naming the lines.
* Anchors are allowed, aliases (``*name``) and merge keys (``<<``) are not: write the
  value out. Nesting deeper than 32 levels is refused.
* The file is UTF-8 (a UTF-8 byte-order mark is tolerated).

Facts files
-----------

``facts_file`` is a path relative to the YAML file's directory (or absolute), or a
non-empty list of such paths (their facts are merged). A file whose name ends in
``.csv`` is read with Python's :mod:`csv` module (comma-separated, double quotes for
fields containing commas, exactly 2 columns); any other name (``.tsv``, ``.tab``,
``.txt``, ...) is tab-separated with exactly 2 fields per line (no quoting). In both:

* files are UTF-8 (a byte-order mark is tolerated); lines end in ``\\n`` or ``\\r\\n``;
* blank lines and lines whose first non-blank character is ``#`` are skipped;
* the first remaining line is skipped if it is exactly the header
  ``subject<sep>object``;
* fields are stripped of surrounding whitespace.

Errors
------

Every problem is one :class:`~tasks.errors.TaskError` whose string is one line,
``file:line: what is wrong; how to fix it``; the line is 1-based and refers to the
facts file when the problem is in one.

Dumping
-------

:func:`dumps_tasks` writes facts inline. :func:`dump_tasks` with ``facts_dir`` writes
each task's facts to ``<facts_dir>/<safe task name>.tsv`` (header line included) and
refers to it by a relative ``facts_file``; a task whose entities cannot be written
safely to a tab-separated file (a subject starting with ``#``, control characters)
keeps its facts inline. ``ascii=True`` writes the YAML in ASCII (``*1``/``*2`` and
escapes); facts files are always UTF-8. Every output file is written to a temporary
file in the same directory and moved into place with :func:`os.replace`, so a failed
dump leaves the previous files untouched and no partial file behind.
"""

from __future__ import annotations

import bisect
import csv
import difflib
import math
import os
import re
import secrets
import stat
import unicodedata
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from tasks.errors import TaskError
from tasks.model import SLOT_SPELLINGS, Facts, Task, TaskSet, Template, check_name
from tasks.structure import check_routable

__all__ = ["load_tasks", "loads_tasks", "dump_tasks", "dumps_tasks", "PARAMETER_NAMES"]

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
_IMPLICIT = {BOOL, INT, FLOAT, NULL, _TAG + "timestamp"}

TOP_KEYS = ("epsilon", "parameters", "tasks")
TASK_KEYS = ("name", "templates", "facts", "facts_file")
#: Construction parameters a tasks file may set.
PARAMETER_NAMES = ("beta", "gamma")
#: Deepest YAML nesting accepted (the format itself needs 6 levels).
MAX_DEPTH = 32
#: Longest line accepted in a facts file, in bytes.
MAX_LINE_BYTES = 1 << 20

_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


# --------------------------------------------------------------------------- helpers


def _show(text: str) -> str:
    """A name quoted for a message; escaped if it holds unprintable characters."""
    return f"'{text}'" if text.isprintable() else repr(text)


def _one_line(err: TaskError) -> TaskError:
    """The same error with every kind of line break in it escaped."""

    def clean(text: str | None) -> str | None:
        if text is None or not any(c in _LINE_BREAKS for c in text):
            return text
        return "".join(repr(c)[1:-1] if c in _LINE_BREAKS else c for c in text)

    problem, fix = clean(err.problem), clean(err.fix)
    if problem == err.problem and fix == err.fix:
        return err
    out = TaskError(problem or "", file=err.file, line=err.line, fix=fix)
    if hasattr(err, "refs"):
        out.refs = err.refs  # type: ignore[attr-defined]
    return out


def _line_of(data: bytes | str, offset: int) -> int:
    """1-based line of a byte (or character) offset."""
    return data.count(b"\n" if isinstance(data, bytes) else "\n", 0, offset) + 1


def _quote(value: str) -> str:
    return f'"{value}"' if "'" in value else f"'{value}'"


def _where(file: str, line: int | None, here: str) -> str:
    """``line N`` if ``file`` is the file being reported, else ``file:N``."""
    if line is None:
        return file
    return f"line {line}" if file == here else f"{file}:{line}"


def _suggest(key: str, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    listed = ", ".join(allowed)
    return f"did you mean '{close[0]}'? allowed: {listed}" if close else f"allowed: {listed}"


# --------------------------------------------------------------------------- reading


def _read_bytes(path: str, what: str) -> bytes:
    """The bytes of a regular file, or a :class:`TaskError` (without location) saying why not."""
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
    try:
        with open(path, "rb") as f:
            return f.read()
    except PermissionError:
        raise TaskError(f"{what} '{path}' cannot be read: permission denied", fix="check its permissions") from None
    except OSError as e:
        raise TaskError(f"{what} '{path}' cannot be read: {e.strerror or e}", fix="check the path") from None


def _decode(data: bytes, file: str) -> str:
    """UTF-8 text of a whole file (BOM tolerated), or a located :class:`TaskError`."""
    if data.startswith(_UTF16_BOMS):
        raise TaskError("the file is UTF-16 text, not UTF-8", file=file, line=1, fix="save it as UTF-8")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise TaskError(
            f"the file contains a NUL byte (offset {nul}): it looks like a binary file, not YAML text",
            file=file, line=_line_of(data, nul), fix="give the path of the tasks YAML file",
        )
    skip = len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = skip + e.start
        raise TaskError(
            f"the file is not UTF-8 text: byte 0x{data[offset]:02x} at offset {offset} cannot be decoded",
            file=file, line=_line_of(data, offset), fix="save the file as UTF-8",
        ) from None


class _LineMap:
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

    def __init__(self, text: str, file: str, lines: _LineMap) -> None:
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


def _marked(e: yaml.MarkedYAMLError, file: str, lines: _LineMap) -> TaskError:
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


def _compose(text: str, file: str, lines: _LineMap) -> Node | None:
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
            file=file, line=_line_of(text, e.position) if e.position is not None else None,
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


# --------------------------------------------------------------------------- the node walk


def _describe(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if node.tag == STR:
        return "a string"
    return _TAG_NAMES.get(node.tag, f"tagged {node.tag}")


@dataclass
class _TaskHead:
    """A task's name and templates, with the lines they came from."""

    name: str
    line: int
    templates: list[Template] = field(default_factory=list)
    template_lines: list[int] = field(default_factory=list)
    facts_node: Node | None = None
    files: list[tuple[str, int]] = field(default_factory=list)  # (path as written, YAML line)
    facts_line: int = 0


class _Builder:
    """Walks the YAML node graph of one tasks file and builds the :class:`TaskSet`."""

    def __init__(self, file: str, base_dir: str, lines: _LineMap) -> None:
        self.file = file
        self.base_dir = base_dir
        self._lines = lines
        self._constructor = yaml.constructor.SafeConstructor()

    # --- generic checks ---------------------------------------------------------------

    def line(self, node: Node) -> int:
        """The 1-based line where a node starts."""
        return self._lines.line(node.start_mark)  # type: ignore[return-value]

    def error(self, problem: str, node: Node | None = None, fix: str | None = None,
              line: int | None = None) -> TaskError:
        if line is None and node is not None:
            line = self.line(node)
        return TaskError(problem, file=self.file, line=line, fix=fix)

    def string(self, node: Node, what: str) -> str:
        """A YAML string scalar, or an error saying what it is instead."""
        if isinstance(node, ScalarNode) and node.tag == STR:
            return node.value
        raise self.not_a_string(node, what)

    def not_a_string(self, node: Node, what: str) -> TaskError:
        if isinstance(node, ScalarNode):
            if node.tag == NULL and node.value in ("", "~"):
                return self.error(f"{what} is empty", node, fix="give it a value")
            if node.style is None and node.tag in _IMPLICIT:
                return self.error(
                    f"{what} is {_show(node.value)}, which YAML reads as {_describe(node)}, not a string",
                    node, fix=f"write it in quotes: {_quote(node.value)}",
                )
            return self.error(f"{what} is {_show(node.value)} with the tag {node.tag}, not a string", node,
                              fix="remove the tag")
        hint = "put text that contains ': ' in quotes" if isinstance(node, MappingNode) else "write a single string"
        return self.error(f"{what} is {_describe(node)}, not a string", node, fix=hint)

    def name(self, text: str, what: str, file: str, line: int) -> str:
        """A stripped, valid token name (located error otherwise)."""
        try:
            return check_name(text, what)
        except TaskError as e:
            raise e.located(file, line) from None

    def mapping(self, node: Node, allowed: tuple[str, ...], where: str) -> dict[str, tuple[Node, Node]]:
        """The keys of a mapping node, each a known, unique string."""
        if node.tag != MAP:
            raise self.error(f"the mapping {where} has the tag {node.tag}", node, fix="remove the tag")
        out: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            if key_node.tag == MERGE:
                raise self.error("merge keys (<<) are not supported", key_node, fix="write the keys out")
            key = self.string(key_node, f"a key {where}")
            if key not in allowed:
                raise self.error(f"unknown key '{key}' {where}", key_node, fix=_suggest(key, allowed))
            if key in out:
                first = self.line(out[key][0])
                raise self.error(f"key '{key}' appears twice {where} (lines {first} and {self.line(key_node)})",
                                 key_node, fix="keep one")
            out[key] = (key_node, value_node)
        return out

    def sequence_items(self, node: Node, what: str) -> list[Node]:
        if node.tag != SEQ:
            raise self.error(f"{what} has the tag {node.tag}", node, fix="remove the tag")
        return list(node.value)

    def number(self, node: Node, what: str) -> int | float:
        """An int or a finite float (an unquoted ``1e-3`` is accepted too)."""
        plain_str = isinstance(node, ScalarNode) and node.tag == STR and node.style is None
        if isinstance(node, ScalarNode) and node.tag == STR and not plain_str:
            raise self.error(f"{what} is the quoted string {_show(node.value)}, not a number", node,
                             fix="remove the quotes")
        if not isinstance(node, ScalarNode) or (node.tag not in (INT, FLOAT) and not plain_str):
            raise self.error(f"{what} is {_describe(node)}, not a number", node, fix="write a number such as 0.01")
        try:
            if node.tag == INT:
                value: int | float = self._constructor.construct_yaml_int(node)
            elif node.tag == FLOAT:
                value = self._constructor.construct_yaml_float(node)
            else:
                value = float(node.value)
        except (ValueError, OverflowError, TypeError):
            raise self.error(f"{what} is {_show(node.value)}, not a number", node,
                             fix="write a number such as 0.01") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise self.error(f"{what} is {_show(node.value)}, not a finite number", node,
                             fix="write a number such as 0.01")
        return value

    # --- top level --------------------------------------------------------------------

    def build(self, root: Node | None) -> TaskSet:
        if root is None:
            raise self.error("the file has no tasks", fix="add a 'tasks:' list (see the format in the README)")
        if not isinstance(root, MappingNode):
            raise self.error(f"the top level is {_describe(root)}, not a mapping", root,
                             fix="start the file with 'tasks:' (and optionally 'epsilon:' and 'parameters:')")
        items = self.mapping(root, TOP_KEYS, "at the top level")
        epsilon = self.epsilon(items["epsilon"][1]) if "epsilon" in items else None
        parameters = self.parameters(items["parameters"][1]) if "parameters" in items else {}
        if "tasks" not in items:
            raise self.error("the file has no tasks", root, fix="add a 'tasks:' list")
        heads = self.task_heads(items["tasks"][0], items["tasks"][1])
        words = self.word_uses(heads)
        tasks = []
        for head in heads:
            facts = self.facts(head, words)
            try:
                tasks.append(Task(head.name, tuple(head.templates), facts))
            except TaskError as e:
                raise e.located(self.file, head.line) from None
        try:
            taskset = TaskSet(tuple(tasks), epsilon, parameters)
        except TaskError as e:
            raise e.located(self.file) from None
        self.check_routable(taskset, heads)
        return taskset

    def epsilon(self, node: Node) -> float:
        value = self.number(node, "epsilon")
        if not 0 < value < 1:
            raise self.error(f"epsilon {_show(node.value)} is not between 0 and 1", node,
                             fix="use a small number such as 0.01")
        return float(value)

    def parameters(self, node: Node) -> dict[str, int | float]:
        if isinstance(node, ScalarNode) and node.tag == NULL:
            return {}
        if not isinstance(node, MappingNode):
            raise self.error(f"parameters is {_describe(node)}, not a mapping", node,
                             fix=f"write 'name: value' lines under it; names: {', '.join(PARAMETER_NAMES)}")
        out: dict[str, int | float] = {}
        for key, (_, value_node) in self.mapping(node, PARAMETER_NAMES, "under 'parameters'").items():
            value = self.number(value_node, f"parameter '{key}'")
            if value <= 0:
                raise self.error(f"parameter '{key}' is {_show(value_node.value)}, not positive", value_node,
                                 fix="use a positive number")
            out[key] = value
        return out

    # --- tasks, names, templates -----------------------------------------------------------

    def task_heads(self, key_node: Node, node: Node) -> list[_TaskHead]:
        if isinstance(node, ScalarNode) and node.tag == NULL:
            raise self.error("'tasks' is empty: the file has no tasks", key_node,
                             fix="list at least one task under 'tasks:'")
        if not isinstance(node, SequenceNode):
            raise self.error(f"'tasks' is {_describe(node)}, not a list", node,
                             fix="start each task with '- name:' under 'tasks:'")
        items = self.sequence_items(node, "'tasks'")
        if not items:
            raise self.error("'tasks' is an empty list: the file has no tasks", node, fix="list at least one task")
        heads: list[_TaskHead] = []
        seen: dict[str, int] = {}
        for index, task_node in enumerate(items):
            head = self.task_head(index, task_node)
            if head.name in seen:
                raise self.error(f"two tasks are named {_show(head.name)} (lines {seen[head.name]} and {head.line})",
                                 line=head.line, fix="give every task its own name")
            seen[head.name] = head.line
            heads.append(head)
        return heads

    def task_head(self, index: int, node: Node) -> _TaskHead:
        label = f"task {index + 1}"
        if not isinstance(node, MappingNode):
            raise self.error(f"{label} is {_describe(node)}, not a mapping", node,
                             fix="write each task as '- name: ...' with 'templates:' and 'facts:' under it")
        for key_node, value_node in node.value:  # name the task in messages about its keys, if we can
            if key_node.tag == STR and key_node.value == "name" and value_node.tag == STR and value_node.value.strip():
                label = f"task {_show(value_node.value.strip())}"
        items = self.mapping(node, TASK_KEYS, f"in {label}")
        if "name" not in items:
            raise self.error(f"{label} has no name", node, fix="add 'name: ...'")
        name_node = items["name"][1]
        raw = self.string(name_node, f"the name of {label}")
        name = self.name(raw, "task name", self.file, self.line(name_node))
        label = f"task {_show(name)}"
        head = _TaskHead(name, self.line(node))
        if "templates" not in items:
            raise self.error(f"{label} has no templates", node, fix="add 'templates:' with at least one template")
        self.templates(head, label, *items["templates"])
        has_facts, has_file = "facts" in items, "facts_file" in items
        if has_facts and has_file:
            later = max(self.line(items["facts"][0]), self.line(items["facts_file"][0]))
            raise self.error(f"{label} has both 'facts' and 'facts_file'", line=later, fix="keep one of them")
        if not has_facts and not has_file:
            raise self.error(f"{label} has no facts", node,
                             fix="add 'facts:' (inline) or 'facts_file:' (a TSV/CSV file)")
        if has_facts:
            head.facts_node = items["facts"][1]
            head.facts_line = self.line(items["facts"][0])
        else:
            head.files = self.facts_files(label, *items["facts_file"])
            head.facts_line = self.line(items["facts_file"][0])
        return head

    def templates(self, head: _TaskHead, label: str, key_node: Node, node: Node) -> None:
        if isinstance(node, ScalarNode) and node.tag == STR:
            nodes = [node]
        elif isinstance(node, SequenceNode):
            nodes = self.sequence_items(node, f"the templates of {label}")
        elif isinstance(node, ScalarNode) and node.tag == NULL:
            nodes = []
        else:
            raise self.error(f"the templates of {label} are {_describe(node)}, not a list of strings", node,
                             fix="write '- the capital of ⋆1 is ⋆2' lines under 'templates:'")
        if not nodes:
            raise self.error(f"{label} has no templates", key_node, fix="give it at least one template")
        seen: dict[tuple, int] = {}
        for t_node in nodes:
            text = self.string(t_node, f"a template of {label}")
            line = self.line(t_node)
            try:
                template = Template.parse(text)
            except TaskError as e:
                raise e.located(self.file, line) from None
            if template.parts in seen:
                raise self.error(f"{label} lists template '{template}' twice (lines {seen[template.parts]} and {line})",
                                 line=line, fix="remove the copy")
            seen[template.parts] = line
            head.templates.append(template)
            head.template_lines.append(line)

    def word_uses(self, heads: list[_TaskHead]) -> dict[str, tuple[str, str, int]]:
        """word -> (template text, task name, YAML line) of its first use."""
        uses: dict[str, tuple[str, str, int]] = {}
        for head in heads:
            for template, line in zip(head.templates, head.template_lines):
                for w in template.words:
                    uses.setdefault(w, (str(template), head.name, line))
        return uses

    # --- facts ----------------------------------------------------------------------------

    def facts_files(self, label: str, key_node: Node, node: Node) -> list[tuple[str, int]]:
        if isinstance(node, SequenceNode):
            nodes = self.sequence_items(node, f"the facts_file of {label}")
            if not nodes:
                raise self.error(f"the facts_file list of {label} is empty", node, fix="name at least one file")
        else:
            nodes = [node]
        out = []
        for n in nodes:
            path = self.string(n, f"the facts_file of {label}").strip()
            if not path:
                raise self.error(f"the facts_file of {label} is empty", n, fix="give the path of a TSV or CSV file")
            out.append((path, self.line(n)))
        return out

    def facts(self, head: _TaskHead, words: dict[str, tuple[str, str, int]]) -> Facts:
        """The task's dictionary, each fact checked where it was written."""
        label = f"task {_show(head.name)}"
        pairs: dict[str, str] = {}
        for raw_s, raw_o, file, line in self.iter_facts(head):
            s = self.name(raw_s, "subject", file, line)
            o = self.name(raw_o, "object", file, line)
            for token, role in ((s, "subject"), (o, "object")):
                if token in words:
                    text, task, t_line = words[token]
                    raise TaskError(
                        f"{_show(token)} is the {role} of a fact of {label} and also a word of template '{text}' "
                        f"of task {_show(task)} ({_where(self.file, t_line, file)})",
                        file=file, line=line, fix="a token is either a template word or an entity; rename one of them",
                    )
            old = pairs.setdefault(s, o)
            if old != o:
                first_file, first_line = self.first_occurrence(head, s)
                raise TaskError(
                    f"subject {_show(s)} of {label} has two objects: {_show(old)} "
                    f"({_where(first_file, first_line, file)}) and {_show(o)}",
                    file=file, line=line, fix="a task maps each subject to one object; keep one",
                )
        if not pairs:
            where = f"(facts file {', '.join(p for p, _ in head.files)}) " if head.files else ""
            raise self.error(f"{label} has an empty dictionary {where}".rstrip(), line=head.facts_line,
                             fix="give it at least one fact")
        return Facts(pairs)

    def first_occurrence(self, head: _TaskHead, subject: str) -> tuple[str, int]:
        for raw_s, _, file, line in self.iter_facts(head):
            if raw_s.strip() == subject:
                return file, line
        return self.file, head.facts_line  # not reached: the subject was seen before

    def iter_facts(self, head: _TaskHead) -> Iterator[tuple[str, str, str, int]]:
        """(subject, object, file, line) for every fact of a task, in order, unstripped."""
        if head.facts_node is not None:
            yield from self.iter_inline(head)
        for path, yaml_line in head.files:
            full = path if os.path.isabs(path) else os.path.normpath(os.path.join(self.base_dir, path))
            yield from _iter_facts_file(full, head.name, self.file, yaml_line)

    def iter_inline(self, head: _TaskHead) -> Iterator[tuple[str, str, str, int]]:
        label = f"task {_show(head.name)}"
        node = head.facts_node
        assert node is not None
        if isinstance(node, MappingNode):
            if node.tag != MAP:
                raise self.error(f"the facts of {label} have the tag {node.tag}", node, fix="remove the tag")
            for key_node, value_node in node.value:
                if key_node.tag == MERGE:
                    raise self.error("merge keys (<<) are not supported", key_node, fix="write the facts out")
                s = self.string(key_node, f"a subject of {label}")
                o = self.string(value_node, f"the object of {_show(s.strip())} in {label}")
                yield s, o, self.file, self.line(key_node)
        elif isinstance(node, SequenceNode):
            for item in self.sequence_items(node, f"the facts of {label}"):
                if not isinstance(item, SequenceNode) or len(item.value) != 2:
                    size = f"a list of {len(item.value)}" if isinstance(item, SequenceNode) else _describe(item)
                    raise self.error(f"a fact of {label} is {size}, not a [subject, object] pair", item,
                                     fix="write each fact as '- [subject, object]'")
                s = self.string(item.value[0], f"a subject of {label}")
                o = self.string(item.value[1], f"the object of {_show(s.strip())} in {label}")
                yield s, o, self.file, self.line(item)
        elif isinstance(node, ScalarNode) and node.tag == NULL:
            return
        else:
            raise self.error(f"the facts of {label} are {_describe(node)}", node,
                             fix="write a mapping 'subject: object' or a list of [subject, object] pairs")

    # --- routability -------------------------------------------------------------------

    def check_routable(self, taskset: TaskSet, heads: list[_TaskHead]) -> None:
        try:
            check_routable(taskset)
        except TaskError as e:
            refs = getattr(e, "refs", None)
            if not refs or len(refs) < 2:
                raise e.located(self.file) from None
            (k1, t1), (k2, t2) = refs[0], refs[1]
            first, second = heads[k1].template_lines[t1], heads[k2].template_lines[t2]
            err = TaskError(f"{e.problem} (the other template is on line {second})", file=self.file, line=first,
                            fix=e.fix)
            err.refs = refs  # type: ignore[attr-defined]
            raise err from None


# --------------------------------------------------------------------------- facts files


def _iter_facts_file(path: str, task: str, yaml_file: str, yaml_line: int) -> Iterator[tuple[str, str, str, int]]:
    """(subject, object, path, line) for every fact of a facts file (see the module doc)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise TaskError(f"facts file '{path}' of task {_show(task)} not found", file=yaml_file, line=yaml_line,
                        fix="check the path; it is relative to the YAML file's directory") from None
    except OSError as e:
        raise TaskError(f"facts file '{path}' cannot be read: {e.strerror or e}", file=yaml_file, line=yaml_line,
                        fix="check the path") from None
    if stat.S_ISDIR(info.st_mode) or not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise TaskError(f"facts file '{path}' of task {_show(task)} is {kind}", file=yaml_file, line=yaml_line,
                        fix="give the path of a TSV or CSV file")
    is_csv = path.lower().endswith(".csv")
    header_done = False
    for line, text in _file_lines(path, yaml_file, yaml_line):
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = _split_csv(text, path, line) if is_csv else text.split("\t")
        if not header_done:
            header_done = True
            if [f.strip() for f in fields] == ["subject", "object"]:
                continue
        if len(fields) != 2:
            raise _bad_line(fields, text, is_csv, path, line)
        yield fields[0], fields[1], path, line


def _file_lines(path: str, yaml_file: str, yaml_line: int) -> Iterator[tuple[int, str]]:
    """Decoded lines (1-based number, text without the line end) of a UTF-8 file."""
    try:
        f = open(path, "rb")
    except PermissionError:
        raise TaskError(f"facts file '{path}' cannot be read: permission denied", file=yaml_file, line=yaml_line,
                        fix="check its permissions") from None
    except OSError as e:
        raise TaskError(f"facts file '{path}' cannot be read: {e.strerror or e}", file=yaml_file, line=yaml_line,
                        fix="check the path") from None
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
                if raw.startswith(_UTF16_BOMS):
                    raise TaskError("the file is UTF-16 text, not UTF-8", file=path, line=1, fix="save it as UTF-8")
                if raw.startswith(_UTF8_BOM):
                    start = len(_UTF8_BOM)
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


# --------------------------------------------------------------------------- public loading


def loads_tasks(text: str | bytes, file: str = "<string>", base_dir: str | None = None) -> TaskSet:
    """Parse a tasks document.

    ``file`` names the document in messages; relative ``facts_file`` paths are resolved
    against ``base_dir`` (the current directory when None). Raises :class:`TaskError`.
    """
    try:
        if isinstance(text, (bytes, bytearray)):
            text = _decode(bytes(text), file)
        elif not isinstance(text, str):
            raise TaskError(f"a tasks document must be text, not {type(text).__name__}", file=file)
        nul = text.find("\x00")
        if nul >= 0:
            raise TaskError("the text contains a NUL character: it looks like binary data, not YAML",
                            file=file, line=_line_of(text, nul), fix="give the tasks YAML text")
        lines = _LineMap(text)
        root = _compose(text, file, lines)
        return _Builder(file, "" if base_dir is None else os.fspath(base_dir), lines).build(root)
    except TaskError as e:
        raise _one_line(e) from None
    except RecursionError:
        raise TaskError("the input is nested too deeply", file=file) from None


def load_tasks(path: str | os.PathLike) -> TaskSet:
    """Read a ``tasks.yaml`` file (see the module docstring for the format)."""
    file = os.fspath(path)
    try:
        data = _read_bytes(file, "tasks file")
    except TaskError as e:
        raise _one_line(e.located(file)) from None
    if not data:
        raise TaskError("the file is empty: it has no tasks", file=file, fix="add a 'tasks:' list")
    try:
        text = _decode(data, file)
    except TaskError as e:
        raise _one_line(e) from None
    return loads_tasks(text, file=file, base_dir=os.path.dirname(file))


# --------------------------------------------------------------------------- dumping


class _Dumper(yaml.SafeDumper):
    """SafeDumper that double-quotes strings holding unicode line breaks.

    PyYAML (6.0) writes such strings single-quoted with ``allow_unicode`` and reads
    them back folded into spaces; double quotes escape them (``\\N``, ``\\L``, ``\\P``).
    """


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    if any(c in data for c in "\x85\u2028\u2029"):
        return dumper.represent_scalar(STR, data, style='"')
    return dumper.represent_str(data)


_Dumper.add_representer(str, _represent_str)


def _plain_number(value: object, what: str) -> int | float:
    if isinstance(value, bool):
        raise TaskError(f"{what} is a boolean, not a number")
    if isinstance(value, int):
        return int(value)
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TaskError(f"{what} {value!r} is not a number") from None


def _template_text(template: Template, ascii: bool) -> str:
    for w in template.words:
        if w in SLOT_SPELLINGS:
            raise TaskError(f"template word '{w}' would be read back as a slot", fix="rename the word")
    return template.text(ascii=ascii)


def _document(taskset: TaskSet, ascii: bool, facts_files: Mapping[int, str]) -> dict:
    """The plain-data form of a task set (facts inline unless in ``facts_files``)."""
    doc: dict = {}
    if taskset.epsilon is not None:
        doc["epsilon"] = float(taskset.epsilon)
    if taskset.parameters:
        doc["parameters"] = {str(k): _plain_number(v, f"parameter '{k}'") for k, v in taskset.parameters.items()}
    tasks = []
    for k, task in enumerate(taskset.tasks):
        entry: dict = {"name": task.name, "templates": [_template_text(t, ascii) for t in task.templates]}
        if k in facts_files:
            entry["facts_file"] = facts_files[k]
        else:
            entry["facts"] = dict(task.facts.items())
        tasks.append(entry)
    doc["tasks"] = tasks
    return doc


def _emit(doc: dict, ascii: bool) -> str:
    return yaml.dump(doc, Dumper=_Dumper, allow_unicode=not ascii, sort_keys=False,
                     default_flow_style=False, width=1_000_000, indent=2)


def dumps_tasks(taskset: TaskSet, ascii: bool = False) -> str:
    """The YAML text of a task set, facts inline; ``loads_tasks`` reads it back equal."""
    return _emit(_document(taskset, ascii, {}), ascii)


def _tsv_safe(facts: Facts) -> bool:
    """Whether every fact survives a round trip through a tab-separated file."""
    for s, o in facts.items():
        if s.startswith("#"):
            return False
        for name in (s, o):
            if not name.isprintable() and any(unicodedata.category(c) in ("Cc", "Cs") for c in name):
                return False
    return True


_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}


def _safe_file_names(names: tuple[str, ...]) -> list[str]:
    """File-name stems for task names: ASCII, unique even on case-insensitive file systems."""
    used: set[str] = set()
    out = []
    for name in names:
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._-")[:64] or "task"
        if base.lower() in _RESERVED:
            base = f"task_{base}"
        stem, i = base, 2
        while stem.lower() in used:
            stem, i = f"{base}-{i}", i + 1
        used.add(stem.lower())
        out.append(stem)
    return out


def _tsv_bytes(facts: Facts) -> bytes:
    lines = ["subject\tobject\n"]
    lines.extend(f"{s}\t{o}\n" for s, o in facts.items())
    return "".join(lines).encode("utf-8")


def _write_temp(target: str, data: bytes) -> str:
    """Write ``data`` to a new temporary file beside ``target``; return its path."""
    directory = os.path.dirname(target) or "."
    tmp = os.path.join(directory, f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))  # keep an existing file's mode
        except OSError:
            pass
    except BaseException:
        _remove(tmp)
        raise
    return tmp


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _write_all(outputs: list[tuple[str, bytes]]) -> None:
    """Write every file to a temporary file first, then move them all into place."""
    staged: list[tuple[str, str]] = []
    target = ""
    try:
        for target, data in outputs:
            staged.append((_write_temp(target, data), target))
        while staged:
            tmp, target = staged[0]
            os.replace(tmp, target)
            staged.pop(0)
    except OSError as e:
        raise TaskError(f"cannot write '{target}': {e.strerror or e}",
                        fix="check the directory and its permissions") from None
    finally:
        for tmp, _ in staged:
            _remove(tmp)


def dump_tasks(taskset: TaskSet, path: str | os.PathLike, *, facts_dir: str | os.PathLike | None = None,
               ascii: bool = False) -> None:
    """Write a task set to ``path`` as YAML (see the module docstring).

    With ``facts_dir``, each task's facts go to ``<facts_dir>/<safe task name>.tsv``,
    referenced from the YAML by a path relative to the YAML file's directory (a task
    whose entities do not fit a TSV file stays inline). Every file is first written in
    full to a temporary file beside its target, then moved into place with
    :func:`os.replace` (the YAML file last): a failure never leaves a partial file, and a
    failure before the moves changes no file. Raises :class:`TaskError` if a file cannot
    be written or if the YAML file would be overwritten by a facts file.
    """
    path = os.fspath(path)
    outputs: list[tuple[str, bytes]] = []
    files: dict[int, str] = {}
    if facts_dir is not None:
        facts_dir = os.fspath(facts_dir)
        try:
            os.makedirs(facts_dir, exist_ok=True)
        except OSError as e:
            raise TaskError(f"cannot create the facts directory '{facts_dir}': {e.strerror or e}") from None
        yaml_dir = os.path.dirname(os.path.abspath(path))
        for k, stem in enumerate(_safe_file_names(taskset.names)):
            facts = taskset.tasks[k].facts
            if not _tsv_safe(facts):
                continue
            target = os.path.join(facts_dir, stem + ".tsv")
            outputs.append((target, _tsv_bytes(facts)))
            try:
                ref = os.path.relpath(os.path.abspath(target), yaml_dir)
            except ValueError:  # another drive on Windows
                ref = os.path.abspath(target)
            files[k] = ref.replace(os.sep, "/")
    text = _emit(_document(taskset, ascii, files), ascii)
    outputs.append((path, text.encode("utf-8")))
    real = [os.path.realpath(p) for p, _ in outputs]
    if len(set(real)) != len(real):
        raise TaskError(f"the output file '{path}' would be overwritten by a facts file",
                        fix="choose another path or facts_dir")
    _write_all(outputs)


def input_files(path: str | os.PathLike) -> list[str]:
    """The files a (valid) tasks file reads: itself and its facts files, as absolute paths.

    For the command line's "never overwrite an input" rule. Call it after
    :func:`load_tasks` succeeded; it reads the YAML again, without aliases.
    """
    file = os.path.abspath(os.fspath(path))
    out = [file]
    try:
        with open(file, encoding="utf-8-sig") as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return out
    base = os.path.dirname(file)
    for task in (doc or {}).get("tasks") or [] if isinstance(doc, dict) else []:
        refs = task.get("facts_file") if isinstance(task, dict) else None
        for ref in ([refs] if isinstance(refs, str) else refs if isinstance(refs, list) else []):
            if isinstance(ref, str):
                out.append(os.path.abspath(ref if os.path.isabs(ref) else os.path.join(base, ref)))
    return out
