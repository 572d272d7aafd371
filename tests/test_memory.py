"""What the certified pass keeps in memory while it runs.

At scale the symbolic model (sympy coefficients, labelled spaces) is a large part of a
process; ``check`` needs it for the construction's evidence only, so it must be gone by
the time the pass builds its tables and forks its workers, in the command users run as
in ``workflow.check.check_built``.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import workflow.check
from cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def test_check_releases_the_symbolic_model_before_the_pass(monkeypatch, capsys):
    import cli.main as cli

    built, seen = [], []
    build, verify = cli._build, workflow.check.verify

    def building(*args, **kwargs):
        model = build(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    def spying(*args, **kwargs):
        gc.collect()
        seen.append([ref() is None for ref in built])
        return verify(*args, **kwargs)

    monkeypatch.setattr(cli, "_build", building)
    monkeypatch.setattr(workflow.check, "verify", spying)
    assert main(["check", str(ROOT / "examples" / "capitals.yaml"), "--quiet"]) == 0
    assert "CERTIFIED" in capsys.readouterr().out
    assert seen == [[True]]


def test_the_pass_holds_no_weights_once_its_tables_are_built(monkeypatch, capsys, tmp_path):
    """``check`` and ``check --weights`` hand the weights over: during the pass only its
    tables (and the weights' frame) are alive, not the weights this command made."""
    import layout
    import verifier.checks.verify as V
    from construction.model import SymbolicModel

    made, seen = [], []
    tallied, load, instantiate = V._tallied, layout.load, SymbolicModel.instantiate

    def loading(*args, **kwargs):
        w = load(*args, **kwargs)
        made.append(weakref.ref(w))
        return w

    def instantiating(self, *args, **kwargs):
        w = instantiate(self, *args, **kwargs)
        made.append(weakref.ref(w))
        return w

    def spying(shared, batch):
        gc.collect()
        seen.append([ref() is None for ref in made])
        return tallied(shared, batch)

    monkeypatch.setattr(layout, "load", loading)
    monkeypatch.setattr(SymbolicModel, "instantiate", instantiating)
    monkeypatch.setattr(V, "_tallied", spying)
    example = ROOT / "examples" / "capitals.yaml"
    assert main(["check", str(example), "--quiet"]) == 0
    assert len(made) == 1 and seen and all(s == [True] for s in seen)
    npz = tmp_path / "w.npz"
    assert main(["build", str(example), "-o", str(npz), "--quiet"]) == 0
    made.clear()
    seen.clear()
    assert main(["check", str(example), "--weights", str(npz), "--quiet"]) == 0
    assert len(made) == 1 and seen and all(s == [True] for s in seen)
    assert "CERTIFIED" in capsys.readouterr().out
