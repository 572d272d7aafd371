"""What the certified pass keeps in memory while it runs.

At scale the symbolic model (sympy coefficients, labelled spaces) is a large part of a
process; ``check`` needs it for the construction's evidence only, so it must be gone by
the time the pass builds its tables and forks its workers, in the command users run as
in ``workflow.check.check_built``.
"""

from __future__ import annotations

import gc
from pathlib import Path

import workflow.check
from cli.main import main
from construction.model import SymbolicModel

ROOT = Path(__file__).resolve().parent.parent


def _live_models() -> int:
    gc.collect()
    return sum(1 for x in gc.get_objects() if isinstance(x, SymbolicModel))


def test_check_releases_the_symbolic_model_before_the_pass(monkeypatch, capsys):
    seen = []
    verify = workflow.check.verify

    def spying(*args, **kwargs):
        seen.append(_live_models())
        return verify(*args, **kwargs)

    monkeypatch.setattr(workflow.check, "verify", spying)
    assert main(["check", str(ROOT / "examples" / "capitals.yaml"), "--quiet"]) == 0
    assert "CERTIFIED" in capsys.readouterr().out
    assert seen == [0]
