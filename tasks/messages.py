"""Wording shared by the tasks-file messages: names quoted, lines referred to, keys suggested.

Every message is one line (:func:`one_line` escapes any line break a name may hold).
"""

from __future__ import annotations

import difflib

from tasks.errors import TaskError
from tasks.yaml_nodes import LINE_BREAKS



def show_name(text: str) -> str:
    """A name quoted for a message; escaped if it holds unprintable characters."""
    return f"'{text}'" if text.isprintable() else repr(text)


def one_line(err: TaskError) -> TaskError:
    """The same error with every kind of line break in it escaped."""

    def clean(text: str | None) -> str | None:
        if text is None or not any(c in LINE_BREAKS for c in text):
            return text
        return "".join(repr(c)[1:-1] if c in LINE_BREAKS else c for c in text)

    problem, fix = clean(err.problem), clean(err.fix)
    if problem == err.problem and fix == err.fix:
        return err
    out = TaskError(problem or "", file=err.file, line=err.line, fix=fix)
    if hasattr(err, "refs"):
        out.refs = err.refs  # type: ignore[attr-defined]
    return out


def quoted(value: str) -> str:
    return f'"{value}"' if "'" in value else f"'{value}'"


def where_line(file: str, line: int | None, here: str) -> str:
    """``line N`` if ``file`` is the file being reported, else ``file:N``."""
    if line is None:
        return file
    return f"line {line}" if file == here else f"{file}:{line}"


def suggest_key(key: str, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    listed = ", ".join(allowed)
    return f"did you mean '{close[0]}'? allowed: {listed}" if close else f"allowed: {listed}"
