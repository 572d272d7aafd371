"""Writing output files so that nothing is ever half-written.

Every file the project writes goes through :func:`atomic_file`: the content goes to a
temporary file in the same directory, which replaces the target only when complete
(``os.replace`` is atomic on one file system). On any failure the temporary file is
removed and the previous target, if any, is untouched.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None,
                newline: str | None = None) -> Iterator[IO]:
    """Open a temporary file next to ``path``; on success it becomes ``path`` (mode 0644)."""
    target = os.path.abspath(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(target)[1], dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as f:
            yield f
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
