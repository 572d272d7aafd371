"""Reading a tasks file: the YAML node graph walked into a :class:`~tasks.model.TaskSet`.

Every rule of the format (:mod:`tasks.io`) is checked here, each failure one
:class:`~tasks.errors.TaskError` naming the file, the line and the fix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from tasks.composition import check_parts, derive
from tasks.errors import TaskError
from tasks.facts_files import facts_file_bytes, facts_key, iter_facts_file, read_plain
from tasks.messages import one_line, quoted, show_name, suggest_key, where_line
from tasks.model import (MAX_NAME_LENGTH, MAX_TEMPLATE_LENGTH, Facts, Sources, Task, TaskSet, Template, check_name,
                         long_template, plain_names)
from tasks.structure import check_routable
from tasks.yaml_nodes import (FLOAT, IMPLICIT, INT, MAP, MAX_DEPTH, MAX_TASKS_FILE_BYTES, MERGE,
                              NULL, SEQ, STR, LineMap,
                              check_size, collector_paused, compose, decode, describe, line_of, read_bytes,
                              too_large)

TOP_KEYS = ("epsilon", "parameters", "tasks")
TASK_KEYS = ("name", "templates", "facts", "facts_file", "compose")
#: Construction parameters a tasks file may set.
PARAMETER_NAMES = ("beta", "gamma")


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
    compose: tuple[str, ...] | None = None                     # a composed task's parts (tasks.composition)
    compose_line: int = 0


class _Builder:
    """Walks the YAML node graph of one tasks file and builds the :class:`TaskSet`."""

    def __init__(self, file: str, base_dir: str, lines: LineMap, routable: bool = True, cache=None) -> None:
        self.file = file
        self.base_dir = base_dir
        self.routable = routable
        self.cache = cache          # tasks.compiled.FactsCache: facts files read before
        #: per task: the key of each facts file, of the bytes its facts were parsed from
        self.facts_keys: dict[str, tuple[str, ...]] = {}
        self._data: dict[str, bytes] = {}   # the facts files of the task being read, each read once
        self._lines = lines
        self._constructor = yaml.constructor.SafeConstructor()
        self._bulk: tuple[_TaskHead, tuple[list[str], list[str]] | None] | None = None   # (bulk_names)

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
            if node.style is None and node.tag in IMPLICIT:
                return self.error(
                    f"{what} is {show_name(node.value)}, which YAML reads as {describe(node)}, not a string",
                    node, fix=f"write it in quotes: {quoted(node.value)}",
                )
            return self.error(f"{what} is {show_name(node.value)} with the tag {node.tag}, not a string", node,
                              fix="remove the tag")
        hint = "put text that contains ': ' in quotes" if isinstance(node, MappingNode) else "write a single string"
        return self.error(f"{what} is {describe(node)}, not a string", node, fix=hint)

    def name(self, text: str, what: str, file: str, line: int | Node) -> str:
        """A stripped, valid token name (located error otherwise; ``line`` as :meth:`at` takes it)."""
        try:
            return check_name(text, what)
        except TaskError as e:
            raise e.located(file, self.at(line)) from None

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
                raise self.error(f"unknown key '{key}' {where}", key_node, fix=suggest_key(key, allowed))
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

    def number(self, node: Node, what: str, example: str = "0.01") -> int | float:
        """An int or a finite float (an unquoted ``1e-3`` is accepted too)."""
        plain_str = isinstance(node, ScalarNode) and node.tag == STR and node.style is None
        if isinstance(node, ScalarNode) and node.tag == STR and not plain_str:
            try:
                float(node.value)
                fix = "remove the quotes"
            except ValueError:
                fix = f"write a number such as {example}"
            raise self.error(f"{what} is the quoted string {show_name(node.value)}, not a number", node, fix=fix)
        if not isinstance(node, ScalarNode) or (node.tag not in (INT, FLOAT) and not plain_str):
            raise self.error(f"{what} is {describe(node)}, not a number", node, fix=f"write a number such as {example}")
        try:
            if node.tag == INT:
                value: int | float = self._constructor.construct_yaml_int(node)
            elif node.tag == FLOAT:
                value = self._constructor.construct_yaml_float(node)
            else:
                value = float(node.value)
        except (ValueError, OverflowError, TypeError):
            raise self.error(f"{what} is {show_name(node.value)}, not a number", node,
                             fix=f"write a number such as {example}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise self.error(f"{what} is {show_name(node.value)}, not a finite number", node,
                             fix=f"write a number such as {example}")
        return value

    # --- top level --------------------------------------------------------------------

    def build(self, root: Node | None) -> TaskSet:
        if root is None:
            raise self.error("the file has no tasks", fix="add a 'tasks:' list (see the format in docs/tutorial.md)")
        if not isinstance(root, MappingNode):
            raise self.error(f"the top level is {describe(root)}, not a mapping", root,
                             fix="start the file with 'tasks:' (and optionally 'epsilon:' and 'parameters:')")
        items = self.mapping(root, TOP_KEYS, "at the top level")
        epsilon = self.epsilon(items["epsilon"][1]) if "epsilon" in items else None
        parameters = self.parameters(items["parameters"][1]) if "parameters" in items else {}
        parameter_lines = ({key: self.line(value) for key, (_, value) in self.mapping(
            items["parameters"][1], PARAMETER_NAMES, "under 'parameters'").items()}
            if parameters else {})
        if "tasks" not in items:
            raise self.error("the file has no tasks", root, fix="add a 'tasks:' list")
        heads = self.task_heads(items["tasks"][0], items["tasks"][1])
        words = self.word_uses(heads)
        tasks = []
        for head in heads:
            if head.compose is not None:
                tasks.append(None)            # derived below, once every stored task is read
                continue
            facts = self.facts(head, words)
            try:
                tasks.append(Task(head.name, tuple(head.templates), facts))
            except TaskError as e:
                raise e.located(self.file, head.line) from None
        self.composed_tasks(heads, tasks)
        sources = Sources(self.file, {(k, t): line for k, head in enumerate(heads)
                                      for t, line in enumerate(head.template_lines)},
                          parameter_lines, self.line(items["epsilon"][1]) if "epsilon" in items else None,
                          self.facts_keys)
        try:
            if self.cache is not None and (self.cache.reused or self.cache.spliced):
                taskset = self.cache.assemble(tasks, epsilon, parameters, sources)
            else:
                taskset = TaskSet(tuple(tasks), epsilon, parameters, sources)
        except TaskError as e:
            raise e.located(self.file) from None
        if self.routable:
            only = (self.cache.changed(taskset) if self.cache is not None
                    and (self.cache.reused or self.cache.spliced) else None)
            self.check_routable(taskset, heads, only)
        return taskset

    def epsilon(self, node: Node) -> float:
        value = self.number(node, "epsilon")
        if not 0 < value < 1:
            raise self.error(f"epsilon {show_name(node.value)} is not between 0 and 1", node,
                             fix="use a small number such as 0.01")
        return float(value)

    def parameters(self, node: Node) -> dict[str, int | float]:
        if isinstance(node, ScalarNode) and node.tag == NULL:
            return {}
        if not isinstance(node, MappingNode):
            raise self.error(f"parameters is {describe(node)}, not a mapping", node,
                             fix=f"write 'name: value' lines under it; names: {', '.join(PARAMETER_NAMES)}")
        out: dict[str, int | float] = {}
        for key, (_, value_node) in self.mapping(node, PARAMETER_NAMES, "under 'parameters'").items():
            value = self.number(value_node, f"parameter '{key}'", example={"beta": "8", "gamma": "10"}.get(key, "1"))
            if value <= 0:
                raise self.error(f"parameter '{key}' is {show_name(value_node.value)}, not positive", value_node,
                                 fix="use a positive number")
            out[key] = value
        return out

    # --- tasks, names, templates -----------------------------------------------------------

    def task_heads(self, key_node: Node, node: Node) -> list[_TaskHead]:
        if isinstance(node, ScalarNode) and node.tag == NULL:
            raise self.error("'tasks' is empty: the file has no tasks", key_node,
                             fix="list at least one task under 'tasks:'")
        if not isinstance(node, SequenceNode):
            raise self.error(f"'tasks' is {describe(node)}, not a list", node,
                             fix="start each task with '- name:' under 'tasks:'")
        items = self.sequence_items(node, "'tasks'")
        if not items:
            raise self.error("'tasks' is an empty list: the file has no tasks", node, fix="list at least one task")
        heads: list[_TaskHead] = []
        seen: dict[str, int] = {}
        for index, task_node in enumerate(items):
            head = self.task_head(index, task_node)
            if head.name in seen:
                raise self.error(f"two tasks are named {show_name(head.name)} "
                                 f"(lines {seen[head.name]} and {head.line})",
                                 line=head.line, fix="give every task its own name")
            seen[head.name] = head.line
            heads.append(head)
        return heads

    def task_head(self, index: int, node: Node) -> _TaskHead:
        label = f"task {index + 1}"
        if not isinstance(node, MappingNode):
            raise self.error(f"{label} is {describe(node)}, not a mapping", node,
                             fix="write each task as '- name: ...' with 'templates:' and 'facts:' under it")
        for key_node, value_node in node.value:  # name the task in messages about its keys, if we can
            if key_node.tag == STR and key_node.value == "name" and value_node.tag == STR and value_node.value.strip():
                label = f"task {show_name(value_node.value.strip())}"
        items = self.mapping(node, TASK_KEYS, f"in {label}")
        if "name" not in items:
            raise self.error(f"{label} has no name", node, fix="add 'name: ...'")
        name_node = items["name"][1]
        raw = self.string(name_node, f"the name of {label}")
        name = self.name(raw, "task name", self.file, self.line(name_node))
        label = f"task {show_name(name)}"
        head = _TaskHead(name, self.line(node))
        if "templates" not in items:
            raise self.error(f"{label} has no templates", node, fix="add 'templates:' with at least one template")
        self.templates(head, label, *items["templates"])
        has_facts, has_file = "facts" in items, "facts_file" in items
        if "compose" in items:
            if has_facts or has_file:
                key = "facts" if has_facts else "facts_file"
                raise self.error(f"{label} is composed and also has '{key}'", line=self.line(items[key][0]),
                                 fix=f"remove '{key}': a composed task's facts are derived from the tasks it composes")
            head.compose = self.compose(label, *items["compose"])
            head.compose_line = self.line(items["compose"][0])
            return head
        if has_facts and has_file:
            later = max(self.line(items["facts"][0]), self.line(items["facts_file"][0]))
            raise self.error(f"{label} has both 'facts' and 'facts_file'", line=later, fix="keep one of them")
        if not has_facts and not has_file:
            raise self.error(f"{label} has no facts", node,
                             fix="add 'facts:' (inline) or 'facts_file:' (a TSV/CSV file), or 'compose: [first, "
                                 "second]' for a task chaining two others")
        if has_facts:
            head.facts_node = items["facts"][1]
            head.facts_line = self.line(items["facts"][0])
        else:
            head.files = self.facts_files(label, *items["facts_file"])
            head.facts_line = self.line(items["facts_file"][0])
        return head

    def compose(self, label: str, key_node: Node, node: Node) -> tuple[str, ...]:
        """The parts of a composed task: a list of task names (their number and names are
        checked once every task is read, :meth:`composed_tasks`)."""
        if not isinstance(node, SequenceNode):
            raise self.error(f"'compose' of {label} is {describe(node)}, not a list of two task names", node,
                             fix="write 'compose: [first, second]' (the first task's objects are the second's "
                                 "subjects)")
        return tuple(self.name(self.string(item, f"a task composed by {label}"), "composed task", self.file,
                               self.line(item)) for item in self.sequence_items(node, f"'compose' of {label}"))

    def composed_tasks(self, heads: list[_TaskHead], tasks: list[Task | None]) -> None:
        """Fill in the composed tasks (None in ``tasks``): their parts checked, their facts derived."""
        stored = {t.name: t for t in tasks if t is not None}
        composed = {h.name: h for h in heads if h.compose is not None}
        for k, head in enumerate(heads):
            if head.compose is None:
                continue
            try:
                first, second = check_parts(head.name, head.compose, stored, composed)
                facts = Facts.checked_pairs(derive(head.name, first, second, stored[first].facts,
                                                   stored[second].facts))
                tasks[k] = Task(head.name, tuple(head.templates), facts, compose=(first, second))
            except TaskError as e:
                raise e.located(self.file, head.compose_line) from None

    def templates(self, head: _TaskHead, label: str, key_node: Node, node: Node) -> None:
        if isinstance(node, ScalarNode) and node.tag == STR:
            nodes = [node]
        elif isinstance(node, SequenceNode):
            nodes = self.sequence_items(node, f"the templates of {label}")
        elif isinstance(node, ScalarNode) and node.tag == NULL:
            nodes = []
        else:
            raise self.error(f"the templates of {label} are {describe(node)}, not a list of strings", node,
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
            if template.length > MAX_TEMPLATE_LENGTH:     # before any work that grows faster than its length
                raise self.error(long_template(template.length), line=line,
                                 fix="split the sentence into shorter templates")
            if template.parts in seen:
                raise self.error(f"{label} lists template '{template}' twice (lines {seen[template.parts]} and {line})",
                                 line=line, fix="remove the copy")
            seen[template.parts] = line
            head.templates.append(template)
            head.template_lines.append(line)

    def word_uses(self, heads: list[_TaskHead]) -> dict[str, tuple[Template, str, int]]:
        """word -> (template, task name, YAML line) of its first use (the template's text is
        made only for a message: made per word, it cost a template of n words n² steps)."""
        uses: dict[str, tuple[Template, str, int]] = {}
        for head in heads:
            for template, line in zip(head.templates, head.template_lines):
                for w in template.words:
                    uses.setdefault(w, (template, head.name, line))
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
            if "\0" in path:
                raise self.error(f"the facts_file of {label} contains a NUL character", n,
                                 fix="give the path of a TSV or CSV file")
            out.append((path, self.line(n)))
        return out

    def full_path(self, path: str) -> str:
        """A ``facts_file`` path resolved against the tasks file's directory."""
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(self.base_dir, path))

    def file_data(self, head: _TaskHead, path: str, yaml_line: int) -> bytes:
        """The bytes of one of the task's facts files, read once for the whole task."""
        full = self.full_path(path)
        if full not in self._data:
            self._data[full] = facts_file_bytes(full, head.name, self.file, yaml_line)
        return self._data[full]

    def facts(self, head: _TaskHead, words: dict[str, tuple[Template, str, int]]) -> Facts:
        """The task's dictionary, each fact checked where it was written (or, with a cache, the
        facts read before from facts files of the same bytes).

        Each facts file is read once, into memory, and parsed from those bytes; the task's
        ``facts_keys`` are the keys of those bytes (or the keys the cache matched), never of
        a second read that a write in between could have changed."""
        if self.cache is not None and head.files:
            cached = self.cache.lookup(head.name, [self.full_path(p) for p, _ in head.files], words)
            if cached is not None:
                self.facts_keys[head.name] = tuple(self.cache.seen[head.name])
                return cached
        try:
            facts = self.parsed_facts(head, words)
            self.facts_keys[head.name] = tuple(facts_key(self.full_path(p), self.file_data(head, p, line))
                                               for p, line in head.files)
            return facts
        finally:
            self._data.clear()
            self._bulk = None

    def parsed_facts(self, head: _TaskHead, words: dict[str, tuple[Template, str, int]]) -> Facts:
        """The task's dictionary, parsed (:meth:`facts`): in bulk (:meth:`plain_facts`) when
        nothing in it is to be reported, else fact by fact to name the first problem."""
        plain = self.plain_facts(head, words)
        if plain is not None:
            return plain
        # Inline names all valid: only a subject given two objects or a word used as a name is
        # left to find (iter_inline gives them, unstripped).
        checked = head.facts_node is not None and self.bulk_names(head) is not None
        label = f"task {show_name(head.name)}"
        pairs: dict[str, str] = {}
        for raw_s, raw_o, file, line in self.iter_facts(head):
            if checked:
                s, o = raw_s.strip(), raw_o.strip()
            else:
                s = self.name(raw_s, "subject", file, line)
                o = self.name(raw_o, "object", file, line)
            for token, role in ((s, "subject"), (o, "object")):
                if token in words:
                    template, task, t_line = words[token]
                    raise TaskError(
                        f"{show_name(token)} is the {role} of a fact of {label} and also a word of template "
                        f"'{template}' of task {show_name(task)} ({where_line(self.file, t_line, file)})",
                        file=file, line=self.at(line),
                        fix="a token is either a template word or an entity; rename one of them",
                    )
            old = pairs.setdefault(s, o)
            if old != o:
                first_file, first_line = self.first_occurrence(head, s)
                raise TaskError(
                    f"subject {show_name(s)} of {label} has two objects: {show_name(old)} "
                    f"({where_line(first_file, first_line, file)}) and {show_name(o)}",
                    file=file, line=self.at(line), fix="a task maps each subject to one object; keep one",
                )
        if not pairs:
            where = f"(facts file {', '.join(p for p, _ in head.files)}) " if head.files else ""
            raise self.error(f"{label} has an empty dictionary {where}".rstrip(), line=head.facts_line,
                             fix="give it at least one fact")
        return Facts.trusted(tuple(pairs), tuple(pairs.values()))    # (every name checked above)

    def plain_facts(self, head: _TaskHead, words: dict[str, tuple[Template, str, int]]) -> Facts | None:
        """A task's facts read in bulk when nothing in them is to be reported (:meth:`bulk_names`,
        no subject twice, no word as a name): the facts :meth:`facts` would return. None
        otherwise, and :meth:`parsed_facts` reads them one by one to name the problem (or the
        subject written twice, which needs its first line)."""
        names = self.bulk_names(head)
        if names is None:
            return None
        subjects, objects = names
        pairs = dict(zip(subjects, objects))
        if len(pairs) != len(subjects) or not words.keys().isdisjoint(pairs) or not words.keys().isdisjoint(objects):
            return None
        return Facts.trusted(tuple(pairs), tuple(pairs.values()))

    def bulk_names(self, head: _TaskHead) -> tuple[list[str], list[str]] | None:
        """A task's subjects and objects, stripped, when every one is a valid name (as
        :meth:`name` checks them one by one), read in bulk: from its facts files
        (:func:`tasks.facts_files.read_plain`), or written inline (:meth:`inline_names`).
        None when some fact is to be read one by one. (The last task's answer is kept: asked
        again when its facts are read one by one.)"""
        if self._bulk is not None and self._bulk[0] is head:
            return self._bulk[1]
        self._bulk = (head, self._bulk_names(head))
        return self._bulk[1]

    def _bulk_names(self, head: _TaskHead) -> tuple[list[str], list[str]] | None:
        if head.facts_node is not None:
            names = self.inline_names(head.facts_node)
            if names is None:
                return None
            subjects, objects = names
            longest = None
        elif not head.files:
            return None
        else:
            raw_s: list[str] = []
            raw_o: list[str] = []
            for path, yaml_line in head.files:
                got = read_plain(self.full_path(path), self.file_data(head, path, yaml_line))
                if got is None:
                    return None
                raw_s += got[0]
                raw_o += got[1]
            subjects, objects = [x.strip() for x in raw_s], [x.strip() for x in raw_o]
            longest = MAX_NAME_LENGTH    # (read_plain's fields are at most this long, and stripped no longer)
        if not subjects or not plain_names(subjects, longest) or not plain_names(objects, longest):
            return None
        return subjects, objects

    @staticmethod
    def inline_names(node: Node) -> tuple[list[str], list[str]] | None:
        """The stripped subjects and objects of inline facts in which :meth:`iter_inline` finds
        nothing to refuse (a mapping of strings, or a list of lists of two strings), or
        None: read without a line per fact, which costs a mark each."""
        if isinstance(node, MappingNode) and node.tag == MAP:
            pairs = node.value
        elif isinstance(node, SequenceNode) and node.tag == SEQ:
            if not all(isinstance(item, SequenceNode) and len(item.value) == 2 for item in node.value):
                return None
            pairs = [item.value for item in node.value]
        else:
            return None
        subjects: list[str] = []
        objects: list[str] = []
        for s, o in pairs:
            if s.tag != STR or o.tag != STR or not isinstance(s, ScalarNode) or not isinstance(o, ScalarNode):
                return None
            subjects.append(s.value.strip())
            objects.append(o.value.strip())
        return subjects, objects

    def first_occurrence(self, head: _TaskHead, subject: str) -> tuple[str, int]:
        for raw_s, _, file, line in self.iter_facts(head):
            if raw_s.strip() == subject:
                return file, self.at(line)
        return self.file, head.facts_line  # not reached: the subject was seen before

    def at(self, line: int | Node) -> int:
        """A line that :meth:`iter_facts` gives: a line, or the node that starts on it."""
        return line if isinstance(line, int) else self.line(line)

    def iter_facts(self, head: _TaskHead) -> Iterator[tuple[str, str, str, int | Node]]:
        """(subject, object, file, line) for every fact of a task, in order, unstripped; for a
        fact written inline, the node that starts on the line instead of its line (its mark is
        made only for a message: :meth:`at`)."""
        if head.facts_node is not None:
            yield from self.iter_inline(head)
        for path, yaml_line in head.files:
            yield from iter_facts_file(self.full_path(path), head.name, self.file, yaml_line,
                                       self.file_data(head, path, yaml_line))

    def object_of(self, node: Node, subject: str, label: str) -> str:
        """The object of a fact written inline (:meth:`string`; what it is named in a message is
        made only for the message)."""
        if isinstance(node, ScalarNode) and node.tag == STR:
            return node.value
        raise self.not_a_string(node, f"the object of {show_name(subject.strip())} in {label}")

    def iter_inline(self, head: _TaskHead) -> Iterator[tuple[str, str, str, Node]]:
        label = f"task {show_name(head.name)}"
        node = head.facts_node
        assert node is not None
        if isinstance(node, MappingNode):
            if node.tag != MAP:
                raise self.error(f"the facts of {label} have the tag {node.tag}", node, fix="remove the tag")
            for key_node, value_node in node.value:
                if key_node.tag == MERGE:
                    raise self.error("merge keys (<<) are not supported", key_node, fix="write the facts out")
                s = self.string(key_node, f"a subject of {label}")
                yield s, self.object_of(value_node, s, label), self.file, key_node
        elif isinstance(node, SequenceNode):
            for item in self.sequence_items(node, f"the facts of {label}"):
                if not isinstance(item, SequenceNode) or len(item.value) != 2:
                    size = f"a list of {len(item.value)}" if isinstance(item, SequenceNode) else describe(item)
                    raise self.error(f"a fact of {label} is {size}, not a [subject, object] pair", item,
                                     fix="write each fact as '- [subject, object]'")
                s = self.string(item.value[0], f"a subject of {label}")
                yield s, self.object_of(item.value[1], s, label), self.file, item
        elif isinstance(node, ScalarNode) and node.tag == NULL:
            return
        else:
            raise self.error(f"the facts of {label} are {describe(node)}", node,
                             fix="write a mapping 'subject: object' or a list of [subject, object] pairs")

    # --- routability -------------------------------------------------------------------

    def check_routable(self, taskset: TaskSet, heads: list[_TaskHead], only: list[int] | None = None) -> None:
        try:
            check_routable(taskset, only=only)
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




@dataclass
class TaskSource:
    """Where one task of a tasks file is written (for editing the file, :mod:`tasks.editing`)."""

    name: str
    node: Node                       # the task's mapping node in the ``tasks`` list
    facts_node: Node | None          # inline facts, or None
    files: list[str]                 # facts files, resolved against the YAML file's directory


def task_sources(path: str | os.PathLike) -> tuple[str, list[TaskSource]]:
    """(the YAML text, where each task is written) of a tasks file that loads."""
    file = os.fspath(path)
    data = read_bytes(file, "tasks file", MAX_TASKS_FILE_BYTES)
    check_size(data, file)
    text = decode(data, file)
    lines = LineMap(text)
    root = compose(text, file, lines)
    b = _Builder(file, os.path.dirname(file), lines, routable=False)
    items = b.mapping(root, TOP_KEYS, "at the top level") if isinstance(root, MappingNode) else {}
    if "tasks" not in items:
        raise TaskError("the file has no tasks", file=file, fix="add a 'tasks:' list")
    heads = b.task_heads(*items["tasks"])
    nodes = b.sequence_items(items["tasks"][1], "'tasks'")
    out = []
    for head, node in zip(heads, nodes):
        files = [p if os.path.isabs(p) else os.path.normpath(os.path.join(b.base_dir, p)) for p, _ in head.files]
        out.append(TaskSource(head.name, node, head.facts_node, files))
    return text, out


def loads_tasks(text: str | bytes, file: str = "<string>", base_dir: str | None = None,
                routable: bool = True, cache=None) -> TaskSet:
    """Parse a tasks document.

    ``file`` names the document in messages; relative ``facts_file`` paths are resolved
    against ``base_dir`` (the current directory when None). Raises :class:`TaskError`.
    With ``routable=False`` a set in which two tasks share an object-query prefix is
    returned rather than refused (for explaining what to change). ``cache``
    (:class:`tasks.compiled.FactsCache`): facts files whose bytes were read before are not
    read again.
    """
    try:
        if isinstance(text, (bytes, bytearray)):
            check_size(bytes(text), file)
            text = decode(bytes(text), file)
        elif not isinstance(text, str):
            raise TaskError(f"a tasks document must be text, not {type(text).__name__}", file=file)
        elif len(text) > MAX_TASKS_FILE_BYTES:        # (its UTF-8 form is no shorter: not encoded)
            raise too_large(f"{len(text):,} characters", file)
        else:                                          # a lone surrogate counted as 3 bytes, refused later
            check_size(text.encode("utf-8", "surrogatepass"), file)
    except TaskError as e:
        raise one_line(e) from None
    return _load_text(text, file, base_dir, routable, cache)


def _load_text(text: str, file: str, base_dir: str | os.PathLike | None, routable: bool, cache) -> TaskSet:
    """:func:`loads_tasks` on a text whose size was checked."""
    try:
        nul = text.find("\x00")
        if nul >= 0:
            raise TaskError("the text contains a NUL character: it looks like binary data, not YAML",
                            file=file, line=line_of(text, nul), fix="give the tasks YAML text")
        lines = LineMap(text)
        with collector_paused():
            root = cache.compose(text, file, lines) if cache is not None else compose(text, file, lines)
            return _Builder(file, "" if base_dir is None else os.fspath(base_dir), lines, routable, cache).build(root)
    except TaskError as e:
        raise one_line(e) from None
    except RecursionError:
        raise TaskError("the input is nested too deeply", file=file) from None


def load_tasks(path: str | os.PathLike, routable: bool = True, cache=None) -> TaskSet:
    """Read a ``tasks.yaml`` file (see the module docstring for the format); ``routable`` and
    ``cache`` as in :func:`loads_tasks`."""
    file = os.fspath(path)
    try:
        data = read_bytes(file, "tasks file", MAX_TASKS_FILE_BYTES)
    except TaskError as e:
        raise one_line(e.located(file)) from None
    if not data:
        raise TaskError("the file is empty: it has no tasks", file=file, fix="add a 'tasks:' list")
    try:
        check_size(data, file)
        text = decode(data, file)
    except TaskError as e:
        raise one_line(e) from None
    return _load_text(text, file, os.path.dirname(file), routable, cache)


def input_files(path: str | os.PathLike) -> list[str]:
    """The files a (valid) tasks file reads: itself and its facts files, as absolute paths.

    For the command line's "never overwrite an input" rule and for noticing edits (it is
    called on every poll of ``watch``). It reads the YAML's event stream (libyaml where
    installed), tracking the nesting itself without recursion, so that no input (nested
    100,000 deep, a date that does not exist, ...) makes it fail: what does not parse
    yields the tasks file alone, and the loader reports the problem.
    """
    file = os.path.abspath(os.fspath(path))
    out = [file]
    try:
        if os.stat(file).st_size > MAX_TASKS_FILE_BYTES:
            return out                # the loader refuses it without reading it
        with open(file, "rb") as f:
            data = f.read(MAX_TASKS_FILE_BYTES + 1)
        check_size(data, file)
        refs = _facts_file_refs(data)
    except Exception:                 # any problem is the loader's to report, with its line
        return out
    base = os.path.dirname(file)
    for ref in refs:
        ref = ref.strip()                # as the loader reads the path
        if ref:
            out.append(os.path.abspath(ref if os.path.isabs(ref) else os.path.join(base, ref)))
    return out


def _facts_file_refs(data: bytes) -> list[str]:
    """The scalars at tasks[*].facts_file and tasks[*].facts_file[*] of a YAML document, from
    its events. Each open mapping or sequence is a frame on a list (not the call stack):
    its kind, its path from the root (None below depth 4, or inside a key: no wanted path
    is there), for a mapping the key whose value comes next, and whether the frame is
    itself a mapping's key. Memory and time are linear in the document at any depth."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    frames: list[list] = []              # [kind, path, key, is_key]
    refs: list[str] = []
    wanted = {("tasks", "*", "facts_file"), ("tasks", "*", "facts_file", "*")}
    no_key = object()                    # the key of a mapping that awaits its next key

    for event in yaml.parse(data, Loader=loader):
        top = frames[-1] if frames else None
        at_key = top is not None and top[0] == "map" and top[2] is no_key
        if top is None:
            path = ()
        elif top[1] is None:
            path = None                  # deeper than any wanted path: not tracked (no copies)
        elif top[0] == "seq":
            path = top[1] + ("*",)
        else:
            path = top[1] + (top[2] if isinstance(top[2], str) else None,)
        if path is not None and len(path) > 4:
            path = None
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            kind = "map" if isinstance(event, yaml.MappingStartEvent) else "seq"
            if at_key:
                top[2] = None            # a key that is a collection: its value is not looked at
            frames.append([kind, None if at_key else path, no_key, at_key])
            if len(frames) > MAX_DEPTH:
                raise ValueError("nested too deeply")     # the loader refuses it, with its line
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            done = frames.pop()
            if frames and frames[-1][0] == "map" and not done[3]:
                frames[-1][2] = no_key   # the value is complete: the next key comes
        elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
            if at_key:
                top[2] = event.value if isinstance(event, yaml.ScalarEvent) else None
                continue
            if isinstance(event, yaml.ScalarEvent) and path in wanted:
                refs.append(event.value)
            if top is not None and top[0] == "map":
                top[2] = no_key
    return refs


#: What :func:`input_signature` records per file: (size, inode, modification time, change
#: time), the times in ns; None when the file cannot be stat'ed.
Signature = tuple[tuple[str, "tuple[int, int, int, int] | None"], ...]


def input_signature(path: str | os.PathLike) -> Signature:
    """The status of every file of :func:`input_files`: equal before and after a read only if
    no input was written in between. The kernel sets the change time on every write and
    rename and no call sets it to a chosen value, so a write changes it, unless it falls in
    the same clock tick as the previous write (then the size or modification time usually
    differ; the facts cache's hashes are the exact test of content)."""
    return file_signature(input_files(path))


def file_signature(paths: Sequence[str]) -> Signature:
    """Per file, its status as :data:`Signature` records it."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, (st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)))
        except (OSError, ValueError):          # ValueError: a NUL in the path
            out.append((p, None))
    return tuple(out)
