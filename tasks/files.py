"""Writing output files so that nothing is ever half-written: the project's one mechanism.

Every file the project writes (reports, weights, pictures, tasks files and their facts
files) is first written in full to a temporary file in the target's directory, flushed
to disk, and then moved onto the target with :func:`os.replace`, which is atomic on one
file system. On any failure the temporary files are removed and every previous target
is untouched. An existing target keeps its permission bits; a new file gets 0644.

* :func:`atomic_files` writes several files as one transaction (all staged before any
  is moved into place, in the order given);
* :func:`atomic_file` is the same for one file, as a context manager that yields the
  open temporary file (for writers that want a file object: numpy, matplotlib);
* :func:`write_text_atomic` writes one UTF-8 text;
* :func:`check_target` refuses, naming the path as given, a target where no file can be
  written (empty, a directory, no such directory), before any temporary file exists.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from typing import IO, Iterator

from tasks.errors import TaskError


def check_target(path: str | os.PathLike) -> str:
    """The absolute path of an output file, or a :class:`TaskError` naming ``path`` as given
    when no file can be written there: the path is empty, is a directory, or its directory
    does not exist (or is a file). Checked before anything is written, so that the message
    names the user's path, not a temporary file beside it."""
    shown = os.fspath(path)
    if not shown:
        raise TaskError("the output path is empty", fix="give a file path")
    target = os.path.abspath(shown)
    if os.path.isdir(target):
        raise TaskError("is a directory", file=shown, fix="give a file path")
    if not os.path.isdir(os.path.dirname(target)):
        up = os.path.dirname(shown)                    # the nearest part of the path that exists
        while up and not os.path.lexists(up) and os.path.dirname(up) != up:
            up = os.path.dirname(up)
        if up and os.path.lexists(up) and not os.path.isdir(up):
            raise TaskError(f"'{up}' is a file, not a directory", file=shown, fix="give a path in a directory")
        raise TaskError("the output directory does not exist", file=shown, fix="create it first")
    return target


def _temporary(target: str) -> tuple[int, str]:
    """A new temporary file beside ``target`` (opened for writing, never an existing file)."""
    directory = os.path.dirname(target) or "."
    tmp = os.path.join(directory, f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
    return fd, tmp


def _finish(tmp: str, target: str) -> None:
    """Give the staged file the target's permission bits (0644 for a new file)."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        mode = 0o644
    os.chmod(tmp, mode)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None,
                newline: str | None = None) -> Iterator[IO]:
    """Open a temporary file next to ``path``; when the block ends without error it becomes
    ``path``. A path where no file can be written is refused first (:func:`check_target`)."""
    target = check_target(path)
    try:
        fd, tmp = _temporary(target)
    except OSError as e:
        raise TaskError(f"cannot write the file: {e.strerror or e}", file=os.fspath(path),
                        fix="check the directory and its permissions") from None
    try:
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _finish(tmp, target)
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def atomic_files(outputs: list[tuple[str, bytes]]) -> None:
    """Write every ``(path, data)`` to a temporary file first, then move them all into place.

    A failure while staging changes no target; a failure while moving (rare: the staged
    files are complete) leaves the targets moved so far replaced and the rest untouched.
    Raises :class:`TaskError` naming the file that could not be written.
    """
    staged: list[tuple[str, str]] = []
    target = ""
    try:
        for target, data in outputs:
            target = check_target(target)
            fd, tmp = _temporary(target)
            staged.append((tmp, target))
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            _finish(tmp, target)
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
