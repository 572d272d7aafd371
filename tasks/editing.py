"""Editing a tasks file: set, change or remove facts of a task, or remove a task, in place.

``python -m verifier edit tasks.yaml TASK --set SUBJECT=OBJECT --remove SUBJECT`` (several
of each at once) changes the file where the task's facts are written and nothing else:

* a **facts file** (TSV or CSV) is edited line by line: a changed fact's line is rewritten
  (``subject<TAB>object``, or CSV with quotes where needed; the subject as it was
  written), a removed fact's lines are dropped, a new fact is appended to the task's last
  facts file; comments, blank lines, the header and every other line stay byte for byte;
* **inline facts** in the YAML are rewritten as one block in the style they were written
  in (a block mapping at the same indentation, a flow mapping, a list of pairs): the rest
  of the YAML file stays byte for byte, but comments between the facts are not kept;
* ``--delete-task`` removes the task's item from the ``tasks`` list.

An edit that changes nothing (every ``--set`` fact already there) writes no file.

Before anything is written, the edited task set is built and checked like a loaded one
(names, one object per subject, tokens either words or entities, no object query shared
by two tasks), and each new file's text is read back and must give exactly the intended
facts. Then every changed file is written to a temporary file and moved into place
(:func:`tasks.files.atomic_files`): an error leaves every file as it was.

An edit refused because the edited set would be ill-posed (a subject it adds is also a
subject of another task whose template shares the object-query prefix) is an
:class:`EditRefusal`: it names the subjects, the two templates and the prefix, and how to
make the edit (leave the subjects out, remove them from the other task first, or make the
templates differ). The file is unchanged, so nothing about the file as it is applies.
"""

from __future__ import annotations

import csv
import io
import os
import shlex
from dataclasses import dataclass, field

import yaml
from yaml.nodes import MappingNode, SequenceNode

from tasks.composition import check_parts, derive, users
from tasks.errors import TaskError
from tasks.facts_files import iter_facts_file
from tasks.files import atomic_files
from tasks.messages import show_name
from tasks.model import Facts, Task, TaskSet, check_name
from tasks.reading import loads_tasks, task_sources
from tasks.structure import Collision, check_routable, object_query_collisions
from tasks.structure import structure_of


@dataclass(frozen=True)
class Edit:
    """The facts to set (subject -> object) and to remove in one task, or the task's removal."""

    task: str
    set: tuple[tuple[str, str], ...] = ()
    remove: tuple[str, ...] = ()
    delete_task: bool = False


class EditRefusal(TaskError):
    """An edit refused for what it would make of the task set; no file was changed, so
    advice about the file as it is (``inspect``) does not apply."""


@dataclass
class EditResult:
    taskset: TaskSet                       # the edited task set
    written: list[str] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)   # one line per change, for people


def parse_pair(text: str) -> tuple[str, str]:
    """``SUBJECT=OBJECT`` (split at the first '='; names with '=' use ``--set-pair``)."""
    if "=" not in text:
        raise TaskError(f"--set {text!r} has no '='", fix="write --set SUBJECT=OBJECT (or --set-pair SUBJECT OBJECT)")
    s, o = text.split("=", 1)
    return check_name(s, "subject of --set"), check_name(o, "object of --set")


def apply(taskset: TaskSet, edit: Edit, path: str | None = None) -> tuple[TaskSet, list[str]]:
    """The edited task set, checked, and the changes in words. Raises TaskError (an
    :class:`EditRefusal` for an edit that would make a routable set ill-posed; ``path``,
    the tasks file, is named in its fix)."""
    if edit.task not in taskset.names:
        raise TaskError(f"no task is named {show_name(edit.task)}", fix=f"give one of: {', '.join(taskset.names)}")
    k = taskset.index(edit.task)
    tasks = list(taskset.tasks)
    chained = users(tasks, edit.task)
    if edit.delete_task:
        if len(tasks) == 1:
            raise TaskError(f"task {show_name(edit.task)} is the only task", fix="a task set needs at least one task")
        if chained:
            raise TaskError(f"task {show_name(edit.task)} is composed by {', '.join(map(show_name, chained))}",
                            fix="delete the composed tasks first (--delete-task)")
        del tasks[k]
        out = TaskSet(tuple(tasks), taskset.epsilon, taskset.parameters)
        check_routable(out)
        return out, [f"removed task {show_name(edit.task)} ({taskset.tasks[k].n_facts} facts)"]
    task = tasks[k]
    if task.compose is not None:
        first, second = task.compose
        raise TaskError(f"task {show_name(edit.task)} is composed: its facts are those of {show_name(first)} then "
                        f"{show_name(second)}", fix=f"edit {show_name(first)} or {show_name(second)} instead")
    facts = dict(task.facts.items())
    changes = []
    for s in edit.remove:
        s = check_name(s, "subject of --remove")
        if s not in facts:
            raise TaskError(f"task {show_name(edit.task)} has no fact of {show_name(s)} to remove",
                            fix="give a subject of the task")
        changes.append(f"removed {show_name(s)} -> {show_name(facts.pop(s))}")
    seen: dict[str, str] = {}
    for s, o in edit.set:
        if s in seen and seen[s] != o:
            raise TaskError(f"--set gives {show_name(s)} two objects, {show_name(seen[s])} and {show_name(o)}",
                            fix="give each subject one object")
        seen[s] = o
        if s in edit.remove:
            raise TaskError(f"{show_name(s)} is both set and removed", fix="keep one of --set and --remove for it")
        old = facts.get(s)
        if old == o:
            changes.append(f"kept {show_name(s)} -> {show_name(o)} (unchanged)")
        elif old is None:
            changes.append(f"added {show_name(s)} -> {show_name(o)}")
        else:
            changes.append(f"changed {show_name(s)} -> {show_name(o)} (was {show_name(old)})")
        facts[s] = o
    if not facts:
        raise TaskError(f"the edit leaves task {show_name(edit.task)} without facts",
                        fix="keep at least one fact, or remove the task with --delete-task")
    tasks[k] = Task(task.name, task.templates, Facts(facts.items()))
    if chained:
        before = {t.name: t.facts for t in tasks if t.compose is not None}
        tasks = recompose(tasks)
        for t in tasks:
            if t.compose is not None and t.facts != before[t.name]:
                changes.append(f"composed task {show_name(t.name)} now has {t.n_facts} facts (derived)")
    out = TaskSet(tuple(tasks), taskset.epsilon, taskset.parameters)
    _refuse_if_ill_posed(taskset, out, k, set(facts) - set(task.facts.keys()), path)
    return out, changes


def recompose(tasks: list[Task]) -> list[Task]:
    """``tasks`` with every composed task's facts derived again from its parts (after an
    edit of a part); the tasks that are not composed are returned as they are."""
    stored = {t.name: t for t in tasks if t.compose is None}
    composed = {t.name: t for t in tasks if t.compose is not None}
    out = []
    for t in tasks:
        if t.compose is not None:
            first, second = check_parts(t.name, t.compose, stored, composed)
            t = Task(t.name, t.templates, Facts.checked_pairs(derive(t.name, first, second, stored[first].facts,
                                                                     stored[second].facts)), compose=t.compose)
        out.append(t)
    return out


def _refuse_if_ill_posed(before: TaskSet, after: TaskSet, k: int, added: set[str], path: str | None) -> None:
    """Raise an :class:`EditRefusal` if subjects ``added`` to task k make ``after`` ill-posed
    (an object query of two tasks). A set that was ill-posed before the edit gets
    :func:`tasks.structure.check_routable`'s error about the set itself."""
    trie = structure_of(after)
    collisions = object_query_collisions(trie)
    if not collisions:
        return
    hit: dict[int, tuple[Collision, list[str]]] = {}     # per other task: its first collision, the clashing subjects
    for c in collisions:
        if k not in (c.first[0], c.second[0]):
            continue
        other = c.second[0] if c.first[0] == k else c.first[0]
        clash = sorted(added & set(after.tasks[other].facts.keys()))
        if clash and other not in hit:
            hit[other] = (c, clash)
    if not hit:
        check_routable(after, trie)      # not the edit's doing: the error about the set as it is
        return
    other, (c, clash) = next(iter(hit.items()))
    mine, theirs = (c.first, c.second) if c.first[0] == k else (c.second, c.first)
    task, rival = after.tasks[k], after.tasks[other]

    def template(ref: tuple[int, int]) -> str:
        _, line = before.template_source(*ref)
        return f"template '{after.tasks[ref[0]].templates[ref[1]]}'" + (f" (line {line})" if line else "")

    shown = [show_name(s) for s in clash[:3]] + ([f"{len(clash) - 3} more"] if len(clash) > 3 else [])
    names = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"
    also = [f"{', '.join(show_name(s) for s in hit[j][1][:3])}{' and more' if len(hit[j][1]) > 3 else ''} with task "
            f"{show_name(after.tasks[j].name)}" for j in hit if j != other]
    one = len(clash) == 1
    prefix = c.structure.replace("⋆1", clash[0])
    problem = (f"the edit would make the task set ill-posed, so no file was changed: {names}, added to task "
               f"{show_name(task.name)}, {'is' if one else 'are'} also {'a subject' if one else 'subjects'} of task "
               f"{show_name(rival.name)}, and {template(mine)} of {show_name(task.name)} and {template(theirs)} of "
               f"{show_name(rival.name)} share the object-query prefix '{prefix}' (no model could tell which "
               f"task's object comes next)" + (f"; likewise {'; '.join(also)}" if also else ""))
    first = "them" if not one else show_name(clash[0])
    remove = ""
    if path is not None and len(clash) <= 3:
        flags = " ".join(f"--remove {shlex.quote(s)}" for s in clash)
        remove = f" (python -m verifier edit {shlex.quote(path)} {shlex.quote(rival.name)} {flags})"
    fix = (f"leave {first} out of task {show_name(task.name)}, or remove {'it' if one else 'them'} from task "
           f"{show_name(rival.name)} first{remove}, or make the two templates differ before ⋆2 in the tasks file")
    raise EditRefusal(problem, file=path, fix=fix)


# --- facts files -----------------------------------------------------------------------------


def _fact_lines(text: str, is_csv: bool) -> list[tuple[int, str, str] | None]:
    """Per line of a facts file: (index, subject as stripped, object stripped), or None for a
    comment, blank line or the header (the rules of tasks.facts_files)."""
    out: list[tuple[int, str, str] | None] = []
    header_done = False
    for i, line in enumerate(text.splitlines()):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            out.append(None)
            continue
        fields = next(csv.reader([line], skipinitialspace=True)) if is_csv and '"' in line else \
            line.split(",") if is_csv else line.split("\t")
        if not header_done:
            header_done = True
            if [f.strip() for f in fields] == ["subject", "object"]:
                out.append(None)
                continue
        out.append((i, fields[0].strip(), fields[1].strip()) if len(fields) == 2 else None)
    return out


def _line(subject: str, obj: str, is_csv: bool, path: str) -> str:
    if is_csv:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="").writerow([subject, obj])
        return buf.getvalue()
    if subject.lstrip().startswith("#") or "\t" in subject + obj:
        raise TaskError(f"{show_name(subject)} cannot be written to a tab-separated file (it would read as a "
                        f"comment)", file=path, fix="give the task a .csv facts file or inline facts")
    return f"{subject}\t{obj}"


def _edit_file(path: str, facts: dict[str, str], removed: set[str], appended: list[tuple[str, str]]) -> str:
    """The new text of a facts file: lines of changed subjects rewritten, removed ones dropped,
    ``appended`` facts added at the end."""
    is_csv = path.lower().endswith(".csv")
    with open(path, "rb") as f:
        raw = f.read()
    bom = raw.startswith(b"\xef\xbb\xbf")
    text = raw[3:].decode("utf-8") if bom else raw.decode("utf-8")
    newline = "\r\n" if "\r\n" in text else "\n"
    lines = text.splitlines()
    out = []
    for line, parsed in zip(lines, _fact_lines(text, is_csv)):
        if parsed is None:
            out.append(line)
            continue
        _, s, o = parsed
        if s in removed:
            continue
        if s in facts and facts[s] != o:
            out.append(_line(s, facts[s], is_csv, path))
        else:
            out.append(line)
    out += [_line(s, o, is_csv, path) for s, o in appended]
    return ("\ufeff" if bom else "") + newline.join(out) + newline


# --- inline facts ------------------------------------------------------------------------------


def _scalar(value: str) -> str:
    text = yaml.safe_dump(value, allow_unicode=True, width=1 << 30)
    if text.endswith("\n...\n"):
        text = text[: -len("\n...\n")]
    return text.rstrip("\n")


def _render_inline(node, facts: dict[str, str], indent: int) -> str:
    pairs = list(facts.items())
    if isinstance(node, MappingNode):
        if node.flow_style:
            return "{" + ", ".join(f"{_scalar(s)}: {_scalar(o)}" for s, o in pairs) + "}"
        pad = " " * indent
        return "\n".join(f"{pad}{_scalar(s)}: {_scalar(o)}" for s, o in pairs)
    if node.flow_style:
        return "[" + ", ".join(f"[{_scalar(s)}, {_scalar(o)}]" for s, o in pairs) + "]"
    pad = " " * indent
    return "\n".join(f"{pad}- [{_scalar(s)}, {_scalar(o)}]" for s, o in pairs)


def _replace_inline(text: str, node, facts: dict[str, str]) -> str:
    if not isinstance(node, (MappingNode, SequenceNode)) or not node.value:
        raise TaskError("the task's inline facts are not a mapping or a list of pairs", fix="edit the file by hand")
    if node.flow_style:
        a, b = node.start_mark.index, node.end_mark.index
        return text[:a] + _render_inline(node, facts, 0) + text[b:]
    lines = text.splitlines(keepends=True)
    first = node.start_mark.line
    items = node.value
    last_node = items[-1][1] if isinstance(node, MappingNode) else items[-1]
    last = last_node.end_mark.line if last_node.end_mark.column > 0 else last_node.end_mark.line - 1
    indent = node.start_mark.column if isinstance(node, MappingNode) else lines[first].index("-")
    ending = "\r\n" if lines[last].endswith("\r\n") else "\n"
    block = _render_inline(node, facts, indent).replace("\n", ending) + ending
    return "".join(lines[:first]) + block + "".join(lines[last + 1:])


def _delete_item(text: str, nodes: list, k: int) -> str:
    """The YAML without the k-th task of the ``tasks`` list (from its dash to the next item)."""
    lines = text.splitlines(keepends=True)
    start = nodes[k].start_mark.line
    end = nodes[k + 1].start_mark.line if k + 1 < len(nodes) else nodes[k].end_mark.line + \
        (1 if nodes[k].end_mark.column > 0 else 0)
    return "".join(lines[:start]) + "".join(lines[end:])


# --- the command -------------------------------------------------------------------------------


def edit_tasks_file(path: str | os.PathLike, taskset: TaskSet, edit: Edit) -> EditResult:
    """Apply ``edit`` to the tasks file at ``path`` (which loads as ``taskset``); see the module docstring."""
    path = os.fspath(path)
    new, changes = apply(taskset, edit, path)
    text, sources = task_sources(path)
    src = next(s for s in sources if s.name == edit.task)
    outputs: list[tuple[str, bytes]] = []
    if edit.delete_task:
        k = [s.name for s in sources].index(edit.task)
        outputs.append((path, _delete_item(text, [s.node for s in sources], k).encode("utf-8")))
    else:
        wanted = dict(new.tasks[new.index(edit.task)].facts.items())
        old = dict(taskset.tasks[taskset.index(edit.task)].facts.items())
        if wanted == old:                 # every --set already holds: no file is rewritten (nor restyled)
            return EditResult(new, [], changes)
        removed = set(old) - set(wanted)
        if src.facts_node is not None:
            outputs.append((path, _replace_inline(text, src.facts_node, wanted).encode("utf-8")))
        else:
            in_files: dict[str, set[str]] = {}
            for f in src.files:
                in_files[f] = {s for s, _, _, _ in iter_facts_file(f, edit.task, path, 0)}
            everywhere = set().union(*in_files.values())
            appended = [(s, o) for s, o in wanted.items() if s not in everywhere]
            for i, f in enumerate(src.files):
                mine = {s.strip() for s in in_files[f]}
                changed = any(s in mine and wanted.get(s) != old.get(s) for s in wanted) or bool(mine & removed)
                extra = appended if i == len(src.files) - 1 else []
                if changed or extra:
                    outputs.append((f, _edit_file(f, wanted, removed, extra).encode("utf-8")))
    _check_outputs(path, outputs, new, edit, src.files)
    atomic_files(outputs)
    return EditResult(new, [p for p, _ in outputs], changes)


def _check_outputs(path: str, outputs: list[tuple[str, bytes]], new: TaskSet, edit: Edit, files: list[str]) -> None:
    """Read every new text back: it must describe ``new`` (the YAML), or the edited task's
    facts (its facts files, changed or not, read together)."""
    import tempfile

    by_path = dict(outputs)
    if path in by_path:
        got = loads_tasks(by_path[path].decode("utf-8"), file=path, base_dir=os.path.dirname(path), routable=False)
        if got.tasks != new.tasks:
            raise TaskError("the edited YAML does not read back as the edited task set (an internal check)",
                            file=path, fix="edit the file by hand")
        return
    read: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, f in enumerate(files):
            source = f
            if f in by_path:
                source = os.path.join(tmp, f"{i}{os.path.splitext(f)[1]}")
                with open(source, "wb") as out:
                    out.write(by_path[f])
            try:
                for s, o, _, _ in iter_facts_file(source, edit.task, path, 0):
                    read[s.strip()] = o.strip()
            except TaskError as e:        # named at the file edited, not at the copy read back
                if source == f:
                    raise
                raise EditRefusal(f"after the edit (refused; no file was changed), {e.problem}", file=f,
                                  line=e.line, fix=e.fix) from None
    if read != dict(new.tasks[new.index(edit.task)].facts.items()):
        raise TaskError("the edited facts files do not read back as the intended facts (an internal check)",
                        file=outputs[0][0] if outputs else path, fix="edit the file by hand")
