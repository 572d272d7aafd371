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
