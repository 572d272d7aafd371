"""The ``plot`` command: three valid PNG files for the bundled example, and a one-line error without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cli.main import main
from repository import ROOT

EXAMPLE = ROOT / "examples" / "capitals.yaml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_three_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = tmp_path / "pictures"  # created by the command
    assert main(["plot", str(EXAMPLE), "--out", str(out), "--betas", "6", "8", "10", "--quiet"]) == 0
    printed = capsys.readouterr().out.split()
    names = ["capitals_routing.png", "capitals_widths.png", "capitals_bound_vs_beta.png"]
    assert [Path(p).name for p in printed] == names
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no temporary file left behind
    for name in names:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
        assert image.std() > 0.01  # not a blank canvas


def test_plot_name_option(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(EXAMPLE), "--out", str(tmp_path), "--name", "demo", "--betas", "8", "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo_bound_vs_beta.png",
                                                          "demo_routing.png", "demo_widths.png"]


@pytest.mark.parametrize("name", ["../x", "sub/x", "/tmp/x", "a\0b"])
def test_plot_name_with_a_path_separator_is_refused(tmp_path, capsys, name):
    """--name ../x wrote the pictures outside --out: a name is a file name prefix."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "in").mkdir()
    assert main(["plot", str(EXAMPLE), "--out", str(out), "--name", name.replace("/tmp", str(tmp_path / "in")),
                 "--betas", "8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --name ") and "is not a file name prefix" in err
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []      # nothing written anywhere


def test_beta_sweep_numbers(capitals_set, capitals_model):
    pytest.importorskip("matplotlib")
    from workflow.plots import beta_sweep

    points = beta_sweep(capitals_set, capitals_model, [4, 8, 12])
    by_beta = {int(p.beta): p for p in points}
    assert not by_beta[4].conditions_hold and not by_beta[4].certified
    for b in (8, 12):
        p = by_beta[b]
        assert p.conditions_hold and p.certified
        # tight up to the subject head's leak e^-β (about 0.5% at β = 8)
        assert p.measured <= p.bound and p.measured == pytest.approx(p.bound, rel=1e-2)
    assert by_beta[12].bound < by_beta[8].bound < 0.01


def test_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["plot", str(EXAMPLE), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "install the plots extra: pip install -e .[plots]" in err
    assert list(tmp_path.iterdir()) == []


def test_plot_out_is_a_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "file.png"
    target.write_bytes(b"x")
    assert main(["plot", str(EXAMPLE), "--out", str(target), "--betas", "8"]) == 2
    assert "not a directory" in capsys.readouterr().err


# --- plot --weights: the pictures of given (trained) weights ------------------------------------

K4 = ROOT / "docs" / "training" / "tasks-K4.yaml"
K4_WEIGHTS = ROOT / "docs" / "training" / "weights" / "K4-E4-localize-s0.npz"


def _drawn(monkeypatch):
    """What plot --weights hands the drawing functions: [(picture, report, expert_tasks, parts)]."""
    import workflow.plots as P

    seen = []
    routing, widths = P.plot_routing, P.plot_widths
    monkeypatch.setattr(P, "plot_routing", lambda r, e, t="": seen.append(("routing", r, e, None)) or routing(r, e, t))
    monkeypatch.setattr(P, "plot_widths",
                        lambda r, t="", parts=True: seen.append(("widths", r, None, parts)) or widths(r, t, parts))
    return seen


def test_plot_weights_draws_the_routing_and_widths_of_the_given_weights(tmp_path, capsys, monkeypatch):
    """--weights: the routing map and the widths of the weights given, from the verifier's
    report of those weights (the one ``check --weights`` makes), widths not split into
    dictionary and template neurons (trained weights have no such parts)."""
    pytest.importorskip("matplotlib")
    import numpy as np

    import layout
    from tasks.io import load_tasks
    from verifier.checks.verify import verify

    seen = _drawn(monkeypatch)
    out = tmp_path / "pictures"
    assert main(["plot", str(K4), "--weights", str(K4_WEIGHTS), "--out", str(out), "--name", "k4"]) == 0
    assert [Path(p).name for p in capsys.readouterr().out.split()] == ["k4_routing.png", "k4_widths.png"]
    assert sorted(p.name for p in out.iterdir()) == ["k4_routing.png", "k4_widths.png"]
    for p in out.iterdir():
        assert p.read_bytes().startswith(PNG_SIGNATURE)
    weights = layout.load(K4_WEIGHTS)
    want = verify(load_tasks(K4), weights, 0.01)
    (_, routed, experts, _), (_, sized, _, parts) = seen
    assert np.array_equal(routed.routing_matrix, want.routing_matrix) and experts == weights.expert_tasks
    assert [t.width for t in sized.tasks] == [t.width for t in want.tasks] and parts is False


def test_plot_weights_draws_a_model_that_misroutes(tmp_path, capsys, monkeypatch):
    """Weights whose gate sends two tasks to each other's expert (its rows swapped) are drawn
    as they are, exit 0 (plot draws; check certifies): the routing map's counts are off the
    diagonal."""
    pytest.importorskip("matplotlib")
    import numpy as np
    import scipy.sparse as sp

    import layout

    weights = layout.load(K4_WEIGHTS)
    order = np.array([1, 0, 2, 3])
    swapped = weights.replace(W_G=sp.csr_matrix(weights.W_G.toarray()[order]), b_G=weights.b_G[order])
    path = tmp_path / "swapped.npz"
    layout.save(swapped, path)
    seen = _drawn(monkeypatch)
    assert main(["plot", str(K4), "--weights", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    counts = np.asarray(seen[0][1].routing_matrix)
    names = [t.name for t in seen[0][1].tasks]
    own = [names.index(t) for t in weights.expert_tasks]
    assert counts[own[0], 1] > 0 and counts[own[1], 0] > 0     # each of the two reaches the other's expert


@pytest.mark.parametrize("flags", [["--beta", "3"], ["--betas", "4", "5"], ["--block", "gate"]])
def test_plot_weights_refuses_the_construction_flags(tmp_path, capsys, flags):
    """Given weights have no β, γ or symbolic blocks: those flags are refused in one line,
    exit 2, nothing written."""
    out = tmp_path / "out"
    assert main(["plot", str(K4), "--weights", str(K4_WEIGHTS), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not apply to --weights" in err and flags[0] in err
    assert not out.exists()
