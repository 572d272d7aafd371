"""Writing task sets: YAML text, and facts files beside it, never half-written.

:func:`dumps_tasks` writes facts inline. :func:`dump_tasks` with ``facts_dir`` writes
each task's facts to ``<facts_dir>/<safe task name>.tsv`` (header line included) and
refers to it by a relative ``facts_file``; a task whose entities cannot be written
safely to a tab-separated file (a subject starting with ``#``, control characters) keeps
its facts inline. All files are written together through :func:`tasks.files.atomic_files`.
"""

from __future__ import annotations

import os
import re
import unicodedata
from typing import Mapping

import yaml

from tasks.errors import TaskError
from tasks.files import atomic_files
from tasks.model import SLOT_SPELLINGS, Facts, TaskSet, Template
from tasks.yaml_nodes import STR, check_size



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
        if task.compose is not None:
            entry["compose"] = list(task.compose)     # its facts are derived when read back
        elif k in facts_files:
            entry["facts_file"] = facts_files[k]
        else:
            entry["facts"] = dict(task.facts.items())
        tasks.append(entry)
    doc["tasks"] = tasks
    return doc


def _emit(doc: dict, ascii: bool) -> str:
    return yaml.dump(doc, Dumper=_Dumper, allow_unicode=not ascii, sort_keys=False,
                     default_flow_style=False, width=1_000_000, indent=2)


def _readable(text: str, file: str) -> bytes:
    """The UTF-8 bytes of ``text``, refused (:class:`TaskError`) if the reader would refuse
    them for their size (:func:`tasks.yaml_nodes.check_size`): nothing is written that
    cannot be read back."""
    data = text.encode("utf-8")
    try:
        check_size(data, file)
    except TaskError as e:
        raise TaskError(f"the YAML would not be read back: {e.problem}", file=e.file, line=e.line,
                        fix="write the facts to facts files: dump_tasks(..., facts_dir=DIRECTORY)") from None
    return data


def dumps_tasks(taskset: TaskSet, ascii: bool = False) -> str:
    """The YAML text of a task set, facts inline; ``loads_tasks`` reads it back equal. A text
    the reader would refuse for its size (over 4 MiB, or a line over 1 MiB) is refused."""
    text = _emit(_document(taskset, ascii, {}), ascii)
    _readable(text, "<string>")
    return text


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


def dump_tasks(taskset: TaskSet, path: str | os.PathLike, *, facts_dir: str | os.PathLike | None = None,
               ascii: bool = False) -> None:
    """Write a task set to ``path`` as YAML (see the module docstring).

    With ``facts_dir``, each task's facts go to ``<facts_dir>/<safe task name>.tsv``,
    referenced from the YAML by a path relative to the YAML file's directory (a task
    whose entities do not fit a TSV file stays inline). Every file is first written in
    full to a temporary file beside its target, then moved into place with
    :func:`os.replace` (the YAML file last): a failure never leaves a partial file, and a
    failure before the moves changes no file. Raises :class:`TaskError` if a file cannot
    be written, if the YAML file would be overwritten by a facts file, or if the YAML would
    be too large for the reader (facts inline: give ``facts_dir``).
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
            if taskset.tasks[k].compose is not None or not _tsv_safe(facts):
                continue
            target = os.path.join(facts_dir, stem + ".tsv")
            outputs.append((target, _tsv_bytes(facts)))
            try:
                ref = os.path.relpath(os.path.abspath(target), yaml_dir)
            except ValueError:  # another drive on Windows
                ref = os.path.abspath(target)
            files[k] = ref.replace(os.sep, "/")
    text = _emit(_document(taskset, ascii, files), ascii)
    outputs.append((path, _readable(text, path)))
    real = [os.path.realpath(p) for p, _ in outputs]
    if len(set(real)) != len(real):
        raise TaskError(f"the output file '{path}' would be overwritten by a facts file",
                        fix="choose another path or facts_dir")
    atomic_files(outputs)


