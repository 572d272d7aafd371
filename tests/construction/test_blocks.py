"""``inspect --block`` and ``plot --block``: the symbolic weights with labels, in every format.

The listing is checked against an independent path: every entry it prints (under
``--all``) must be exactly the entry that :meth:`SymMatrix.entry` computes for the same
labels, and every structurally nonzero entry must be printed once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from budget import examples

from cli.main import main
from construction.listing import LIST_UP_TO, named_blocks, patterns, select
from construction.params import BETA, GAMMA
from construction.printing import render
from tasks.strategies import task_sets
from repository import ROOT

CAPITALS = str(ROOT / "examples" / "capitals.yaml")
GEOGRAPHY = str(ROOT / "examples" / "geography" / "tasks.yaml")
FORMATS = ("text", "markdown", "latex", "json")


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _entries_by_label(block) -> dict[tuple[str, str], sympy.Expr]:
    m = block.matrix
    return {(m.rows.label(i), m.cols.label(j)): e for i, j, e in m.nonzeros() if e != 0}


def test_every_block_of_capitals_prints_in_every_format(capsys, capitals_model):
    names = [b.name for b in named_blocks(capitals_model)]
    assert {"E", "P", "U", "structure1.W_Q", "subject.W_O", "gate.W_G", "gate.b_G", "expert:capital.W_1",
            "expert:located.b_1", "expert:continent.W_2"} <= set(names)
    for fmt in FORMATS:
        code, out, err = _run(capsys, "inspect", CAPITALS, "--block", "all", "--format", fmt)
        assert code == 0 and err == ""
        for name in names:
            assert name in out, (fmt, name)
        if fmt == "json":
            assert [b["block"] for b in json.loads(out)] == names


def test_json_listing_equals_the_exact_entries(capsys, capitals_model):
    """--all --json: every nonzero entry once, with exactly the symbolic value SymMatrix.entry gives."""
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "all", "--all", "--json", "-")
    assert code == 0
    listed = {b["block"]: b for b in json.loads(out)}
    for block in named_blocks(capitals_model):
        want = _entries_by_label(block)
        got: dict[tuple[str, str], sympy.Expr] = {}
        for p in listed[block.name]["patterns"]:
            for row, col in p["entries"]:
                assert (row, col) not in got, (block.name, row, col)
                got[row, col] = sympy.sympify(p["value"], locals={"beta": BETA, "gamma": GAMMA})
        assert got.keys() == want.keys(), block.name
        for key, expr in want.items():
            assert sympy.simplify(got[key] - expr) == 0, (block.name, key, got[key], expr)
        assert listed[block.name]["nonzero"] == len(want)


def test_known_entries_of_the_proofs(capsys, capitals_model):
    """The entries the docstrings' proofs name: W_Q of structure head m is β on pos:i for
    i ≥ m (score:at) and on pos:i for i < m (score:before); W_K reads pos:m and pos:0;
    the subject head's query is β·one and its key L·entity − j·pos:j; U is γ on next:t; fact neurons read subj:s with 2
    and have bias −1."""
    L = capitals_model.taskset.L
    for m in range(1, L):
        code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", f"structure{m}.W_Q")
        assert code == 0
        lines = {line.split("   ")[0].strip(): line.split()[-1] for line in out.splitlines()[1:]}
        for i in range(L):
            assert lines[f"score:{'at' if i >= m else 'before'} ← pos:{i}"] == "β"
        code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", f"structure{m}.W_K")
        assert f"score:at ← pos:{m}" in out and "score:before ← pos:0" in out
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "subject.W_Q", "--format", "latex")
    assert r"\text{score:first} & \beta" in out
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "subject.W_K", "--all")
    lines = {line.split("   ")[0].strip(): line.split()[-1] for line in out.splitlines()[1:] if "←" in line}
    assert lines["score:first ← entity"] == str(L)           # entities above words and BOS ...
    for j in range(1, L):
        assert lines[f"score:first ← pos:{j}"] == str(-j)     # ... and the earliest entity above the others
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "U")
    assert "token:<x> ← next:<x>   γ" in out
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "expert:capital", "--all")
    assert "neuron:fact:France ← subj:France" in out and "neuron:fact:France ← bias" in out
    fr = [line for line in out.splitlines() if "neuron:fact:France ← subj:France" in line][0]
    assert fr.split()[-1] == "2"
    bias = [line for line in out.splitlines() if "neuron:fact:France ← bias" in line][0]
    assert bias.split()[-1] == "-1"


def test_at_substitutes_exact_values(capsys, capitals_model):
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "structure2.W_Q", "--at", "beta=9/2")
    assert code == 0 and "score:at ← pos:2" in out and "9/2" in out and "β" not in out.split("\n", 1)[1]
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "U", "--at", "gamma=2.5", "--json", "-")
    value = json.loads(out)[0]["patterns"][0]["value"]
    assert sympy.Rational(value) == sympy.Rational(5, 2)
    # a parameter left out takes the model's value
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "subject.W_Q", "--at", "gamma=1")
    assert str(capitals_model.beta) in out.splitlines()[1]


def test_task_restricts_to_its_expert_and_gate_row(capsys):
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "gate", "--task", "located", "--json", "-")
    assert code == 0
    rows = {p["row"] for b in json.loads(out) for p in b["patterns"]}
    assert rows == {"expert:located"}
    code, out, _ = _run(capsys, "inspect", CAPITALS, "--block", "W_1", "--task", "capital")
    assert "expert:capital.W_1" in out and "expert:located" not in out and "expert:continent" not in out


def test_grouping_keeps_geography_readable(capsys):
    """A geography-size block prints one line per pattern, and patterns are honest: every
    member has the pattern's expression and, for <x>, the same item on both sides."""
    code, out, _ = _run(capsys, "inspect", GEOGRAPHY, "--block", "subject.W_V")
    assert code == 0
    assert out.splitlines()[1].split()[:3] == ["entity:<x>", "←", "id:<x>"] and len(out.splitlines()) == 2
    code, out, _ = _run(capsys, "inspect", GEOGRAPHY, "--block", "all")
    assert code == 0 and len(out.splitlines()) < 1000


def _check_partition(model) -> None:
    """Every structurally nonzero entry in exactly one pattern, with the pattern's exact
    expression; '<x>' patterns name the same item on both sides; the text stays short."""
    for block in named_blocks(model):
        listing = patterns(block)
        m = block.matrix
        seen = set()
        for p in listing.patterns:
            for i, j in zip(p.rows, p.cols):
                assert (int(i), int(j)) not in seen
                seen.add((int(i), int(j)))
                assert m.entry(int(i), int(j)) == p.expr
                if p.same:
                    a, b = m.rows.locate(int(i))[1], m.cols.locate(int(j))[1]
                    a, b = str(a), str(b)
                    assert b in (a, a.removeprefix("fact:")) or a == b.removeprefix("fact:"), (block.name, a, b)
        assert seen == {(int(i), int(j)) for i, j, e in m.nonzeros() if e != 0}, block.name
        assert len(render([listing], "text").splitlines()) <= 1 + max(1, len(listing.patterns) * LIST_UP_TO)


def test_patterns_partition_the_entries(capitals_model):
    from construction.model import build
    from tasks.synthetic import wikidata_like

    _check_partition(capitals_model)
    _check_partition(build(wikidata_like(400, n_tasks=4, seed=3)))


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task_sets(max_tasks=3, max_facts=4, max_template_length=5))
def test_patterns_partition_the_entries_of_any_task_set(ts):
    from construction.gate import RoutingError
    from construction.model import build

    try:
        model = build(ts)
    except RoutingError:
        return
    _check_partition(model)


@pytest.mark.parametrize("argv, words", [
    (["--block", "W_X"], "no block called 'W_X'"),
    (["--block", "gate", "--task", "nope"], "--task 'nope'"),
    (["--block", "U", "--at", "delta=3"], "--at 'delta=3'"),
    (["--block", "U", "--at", "gamma=abc"], "not a (finite) number"),
    (["--task", "capital"], "apply to --block"),
])
def test_bad_block_arguments_are_one_line(capsys, argv, words):
    code, out, err = _run(capsys, "inspect", CAPITALS, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err


def test_plot_block_draws_a_heat_map(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code, out, _ = _run(capsys, "plot", CAPITALS, "--block", "gate", "--out", str(tmp_path))
    assert code == 0
    paths = out.split()
    assert [Path(p).name for p in paths] == ["capitals_gate_W_G.png", "capitals_gate_b_G.png"]
    for p in paths:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grid_bins_large_blocks_and_keeps_the_largest_magnitude(capitals_model):
    """Each binned cell holds the weight of largest magnitude among those it covers
    (brute force over the dense block), and an unbinned grid is the dense block itself."""
    from construction.listing import grid

    for name, limit in (("E", 5), ("expert:capital.b_1", 3), ("expert:capital.W_1", 4), ("gate.W_G", 7)):
        block = select(named_blocks(capitals_model), name)[0]
        listing = patterns(block)
        dense = block.matrix.numeric({BETA: float(capitals_model.beta), GAMMA: float(capitals_model.gamma)}).toarray()
        rows, cols = np.flatnonzero(np.abs(dense).sum(1)), np.flatnonzero(np.abs(dense).sum(0))
        sub = dense[np.ix_(rows, cols)]
        full = grid(listing, capitals_model.values)
        assert not full.binned and np.array_equal(full.values, sub), name
        g = grid(listing, capitals_model.values, limit=limit)
        rc, cc = (np.arange(rows.size) * limit) // rows.size, (np.arange(cols.size) * limit) // cols.size
        if rows.size <= limit:
            rc = np.arange(rows.size)
        if cols.size <= limit:
            cc = np.arange(cols.size)
        want = np.zeros((rc.max() + 1, cc.max() + 1))
        for a in range(sub.shape[0]):
            for b in range(sub.shape[1]):
                if abs(sub[a, b]) > abs(want[rc[a], cc[b]]):
                    want[rc[a], cc[b]] = sub[a, b]
        assert g.binned == (rows.size > limit or cols.size > limit)
        assert np.array_equal(g.values, want), name
