"""What a user of ``python -m training.train`` sees: its help, its progress, its last line,
and what the weights file records of the run.

Skipped when torch (the ``train`` extra) is missing. The runs are a few dozen steps on the
capitals example (seconds on one core).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import pytest

pytest.importorskip("torch")

from tasks.io import dump_tasks  # noqa: E402
import layout  # noqa: E402
from training import sweep  # noqa: E402
from training import train as training  # noqa: E402

SMALL = ["--objective", "localize", "--d", "16", "--heads", "2", "--d-head", "4", "--width", "8", "--threads", "1"]
RUN_KEYS = {"rounds", "total_steps", "train_seconds", "check_seconds"}
LAST_LINE = re.compile(r"; (\d+) steps(?: in (\d+) rounds?)?, training ([\d.]+)s(?:, checks ([\d.]+)s)?, "
                       r"wall ([\d.]+)s$")


@pytest.fixture
def tasks_file(capitals_set, tmp_path):
    path = tmp_path / "tasks.yaml"
    dump_tasks(capitals_set, path)
    return path


def expanded_help(p: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help as ``--help`` prints it, one line."""
    formatter = p._get_formatter()
    return {a.option_strings[-1]: " ".join(formatter._expand_help(a).split())
            for a in p._actions if a.option_strings and a.help}


@pytest.mark.parametrize("module", [training, sweep], ids=["train", "sweep"])
def test_help_names_every_default(module, capsys):
    """Every option that takes a value says its default in ``--help`` (flags are off unless
    given; a required option has none)."""
    p = module.parser()
    helps = expanded_help(p)
    for action in p._actions:
        if (action.option_strings and action.nargs != 0 and not action.required
                and action.default is not argparse.SUPPRESS):
            assert "default" in helps[action.option_strings[-1]], action.option_strings
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "optimiser steps (default 1000)" in out and "learning rate (Adam) (default 0.003)" in out
    if module is training:
        assert "training seed (initial weights, minibatches) (default 0)" in out
        assert "(default: none, the steps alone end a round)" in out
    else:
        assert "training seeds of the grid (default 0 1 2)" in out
        assert "seconds of training per grid run at most (default 150.0)" in out


def test_help_formatter_shows_values_verbatim():
    from training.options import DefaultsFormatter

    p = argparse.ArgumentParser(formatter_class=DefaultsFormatter)
    p.add_argument("--share", default="50%", help="a share")
    p.add_argument("--x", type=int, help="x (default: all of them)")
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--out", required=True, help="where")
    helps = expanded_help(p)
    assert helps == {"--help": "show this help message and exit", "--share": "a share (default 50%)",
                     "--x": "x (default: all of them)", "--flag": "a flag", "--out": "where"}


def test_rounds_record_the_run_in_the_weights_and_the_last_line(tasks_file, tmp_path, capsys):
    """Off a terminal: stderr has the round lines only (no progress bar), stdout the last line,
    which gives the steps, rounds, training, checks and wall seconds; the weights file records
    the rounds, the steps in all and the seconds of training and of the checks."""
    npz, js = tmp_path / "w.npz", tmp_path / "run.json"
    status = training.main([str(tasks_file), "-o", str(npz), *SMALL, "--until-certified", "--max-rounds", "1",
                            "--steps", "40", "--round-steps", "10", "--json", str(js)])
    assert status in (0, 1)
    out, err = capsys.readouterr()
    rep = json.loads(js.read_text(encoding="utf-8"))
    rounds = rep["rounds"]
    assert err.splitlines() and all(line.startswith(f"round {i}: ") for i, line in enumerate(err.splitlines()))
    assert len(err.splitlines()) == len(rounds) and "\r" not in err and "%|" not in err
    [line] = out.splitlines()
    found = LAST_LINE.search(line)
    assert found, line
    steps, n_rounds, train_s, check_s, wall = found.groups()
    assert int(steps) == sum(r["steps"] for r in rounds) == rep["steps"] and int(n_rounds) == len(rounds)
    assert float(train_s) == pytest.approx(rep["seconds"], abs=0.051)
    assert float(check_s) == pytest.approx(rep["check_seconds"], abs=0.051)
    assert float(wall) == pytest.approx(rep["wall_seconds"], abs=0.051)
    assert rep["wall_seconds"] >= rep["seconds"] + rep["check_seconds"] - 0.02     # the wall time holds both
    params = layout.load(str(npz)).parameters
    assert RUN_KEYS <= set(params)
    assert params["rounds"] == len(rounds) and params["total_steps"] == rep["steps"]
    assert params["train_seconds"] == pytest.approx(sum(r["train_seconds"] for r in rounds), abs=0.011)
    assert params["check_seconds"] == pytest.approx(sum(r["check_seconds"] for r in rounds), abs=0.011)
    assert params["steps"] == 40 and params["objective"] == "localize"


def test_a_run_without_rounds_records_it_too(tasks_file, tmp_path, capsys):
    npz = tmp_path / "w.npz"
    assert training.main([str(tasks_file), "-o", str(npz), *SMALL, "--steps", "12"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert re.search(r"; 12 steps, training [\d.]+s, wall [\d.]+s$", out.strip()), out
    params = layout.load(str(npz)).parameters
    assert params["rounds"] == 1 and params["total_steps"] == 12 and params["check_seconds"] == 0
    assert params["train_seconds"] >= 0


def test_json_to_stdout(tasks_file, tmp_path, capsys, monkeypatch):
    """``--json -`` writes the evaluation to stdout, alone (as the verifier's commands do), not
    to a file named '-'."""
    monkeypatch.chdir(tmp_path)
    assert training.main([str(tasks_file), "-o", "w.npz", *SMALL, "--steps", "5", "--json", "-"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["steps"] == 5 and not (tmp_path / "-").exists()


def test_progress_on_a_terminal(tasks_file, tmp_path, capsys, monkeypatch):
    """On a terminal a bar per round shows its steps, the loss and, after its checks, the
    certified share; with --quiet nothing is printed on stderr."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = [str(tasks_file), "-o", str(tmp_path / "w.npz"), *SMALL, "--until-certified", "--max-rounds", "1",
            "--steps", "30", "--round-steps", "10"]
    assert training.main(argv) in (0, 1)
    err = capsys.readouterr().err
    assert re.search(r"round 0: .*/30 .*step.*loss=", err), err
    assert re.search(r"round 0: .*certified=[01]\.\d{4}", err), err
    assert re.search(r"^round 0: 30 steps in ", err, re.M), err                # and the round's line
    assert training.main([*argv, "--quiet"]) in (0, 1)
    assert capsys.readouterr().err == ""
    assert training.main([str(tasks_file), "-o", str(tmp_path / "v.npz"), *SMALL, "--steps", "20"]) == 0
    assert re.search(r"training: .*/20 .*loss=", capsys.readouterr().err)


def test_the_time_limit_logs_the_last_step(capitals_set, monkeypatch):
    """A run cut by its time limit logs the step it stopped at (the history's last entry is
    the last step trained), whatever log_every is."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(training.time, "perf_counter", lambda: float(next(ticks)))
    config = training.TrainConfig(objective="router", d=8, n_heads=1, d_head=4, expert_width=4, steps=1000,
                                  warmup=2, time_limit=30.0, threads=1)
    seen = []
    result = training.train(capitals_set, config, log=seen.append, log_every=1000)
    assert 1 < result.steps < 1000
    assert [e["step"] for e in result.history] == [0, result.steps - 1] and seen == result.history
    assert seen[-1]["round"] == 0 and seen[-1]["of"] == 1000 and seen[-1]["time_limit"] == 30.0


def test_unwritable_outputs_are_refused_before_training(tasks_file, tmp_path, capsys):
    """An output path where no file can be written (or the tasks file itself) is one line and
    exit 2 before any training; the run was trained first and then ended in a traceback."""
    for argv, said in ((["-o", str(tmp_path / "no" / "w.npz")], "the output directory does not exist"),
                       (["-o", str(tmp_path / "w.npz"), "--json", str(tmp_path / "no" / "r.json")],
                        "the output directory does not exist"),
                       (["-o", str(tmp_path)], "is a directory"),
                       (["-o", str(tasks_file)], "-o would overwrite the tasks file")):
        assert training.main([str(tasks_file), *argv, *SMALL, "--steps", "5"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and said in err and err.startswith("error: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks.yaml"]
