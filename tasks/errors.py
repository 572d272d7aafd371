"""The one exception type for bad input.

Every problem with a user's input (a tasks file, a facts file, a weights file, a
query string) is reported as a :class:`TaskError`. Its string form is a single line::

    tasks.yaml:12: subject 'France' has two objects in task 'capital' ... ; keep one

naming the file and line where there is one, what is wrong and how to fix it. The
command line prints exactly that line and exits with status 2.
"""

from __future__ import annotations


class TaskError(ValueError):
    """Bad input: names the file, the line, the problem and the fix."""

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        line: int | None = None,
        fix: str | None = None,
    ) -> None:
        self.problem = problem
        self.file = file
        self.line = line
        self.fix = fix
        super().__init__(str(self))

    def located(self, file: str | None, line: int | None = None) -> "TaskError":
        """The same error, with a file and line filled in where they were missing."""
        return TaskError(
            self.problem,
            file=self.file if self.file is not None else file,
            line=self.line if self.line is not None else line,
            fix=self.fix,
        )

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}: " if self.line is not None else f"{self.file}: "
        text = f"{where}{self.problem}"
        if self.fix:
            text += f"; {self.fix}"
        # One line, always: a message must never spill over several lines.
        return " ".join(text.splitlines())
