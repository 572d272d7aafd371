"""``python -m verifier``: the commands of :data:`COMMANDS`, each with ``--help`` (the
README's table says what each does).

Each command is a module of :mod:`cli`: its sub-parser (``arguments``, with ``HELP`` and
``DESCRIPTION``) and ``run(args)``, which checks the flags, calls the library
(:mod:`workflow`) and prints. A command's module imports its library only when it runs,
so that start-up loads what that command needs and no more (``check --weights`` never
loads the construction). This module assembles the parser and maps what a command raises
to the exit status.

Exit status: 0 certified (or the command succeeded), 1 not certified, 2 bad input
(one line on stderr, no traceback), 3 internal error; see :mod:`tasks.console`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from typing import Sequence

import cli
from cli.common import settle  # noqa: F401  (each command calls it once its modules are loaded)
from tasks.console import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_NOT_CERTIFIED, EXIT_OK, Parser
from tasks.errors import TaskError
from workflow.errors import NotCertified, unconstructible


def _commands() -> dict:
    """Every module of :mod:`cli` that is a command (it defines ``arguments`` and ``run``),
    by name, in the order of their ``ORDER``."""
    found = {}
    for info in pkgutil.iter_modules(cli.__path__):
        module = importlib.import_module(f"cli.{info.name}")
        if callable(getattr(module, "run", None)) and callable(getattr(module, "arguments", None)):
            found[info.name] = module
    return dict(sorted(found.items(), key=lambda item: item[1].ORDER))


#: The commands, in the order ``--help`` lists them: name -> its module (``ORDER``, ``HELP``,
#: ``DESCRIPTION``, ``arguments(parser)``, ``run(args) -> exit status``), found among the
#: modules of :mod:`cli`, so that a new command is its module (and its library in
#: :mod:`workflow`): the parser is made from this, and the README's table is tested against it.
COMMANDS = _commands()


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m verifier", description=(
        "Construct a single-layer mixture-of-experts transformer for a set of knowledge tasks "
        "(Theorem 4.2) and verify it soundly: error below epsilon on every query, routing to each "
        "task's own expert, expert sizes within L|T(k)| + N_k, no cross-task entanglement."))
    sub = p.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.arguments(sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION))
    return p


def _refusal_hint(args, exc: TaskError) -> str:
    """For a task set the construction refuses: where to find the smallest changes. Not for
    a refused edit (tasks.editing.EditRefusal): the file is unchanged, so inspecting it finds
    nothing wrong; the refusal itself says what the edit would break and how to make it."""
    from tasks.editing import EditRefusal

    if isinstance(exc, EditRefusal):
        return ""
    if args.command != "inspect" and unconstructible(exc):
        return f" ('python -m verifier inspect {args.tasks}' lists the smallest changes that make it constructible)"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except TaskError as exc:
        print(f"error: {exc}{_refusal_hint(args, exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NotCertified as exc:
        print(f"not certified: {exc}", file=sys.stderr)
        return EXIT_NOT_CERTIFIED
    except RecursionError:
        print("error: input nested too deeply", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. `python -m verifier check ... | head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
    except OSError as exc:
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}".replace("\n", " "), file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemoryError:
        print("error: out of memory on this input", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: never exit 1 ("not certified") or 0 for it
        if os.environ.get("MOE_VERIFIER_DEBUG"):
            raise
        print(f"internal error: {type(exc).__name__}: {exc}".replace("\n", " ")
              + " (a bug: please report it with the command; MOE_VERIFIER_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL
