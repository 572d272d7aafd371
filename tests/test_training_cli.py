"""What a user of ``python -m training.train`` sees: its help.

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
        if action.option_strings and action.nargs != 0 and not action.required and action.default is not argparse.SUPPRESS:
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
