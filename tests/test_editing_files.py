"""The edit command and the certificate directory: files changed in place and nowhere else,
bad edits refused with nothing written, certificates checked when read, patched models equal
to full builds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

from cli.main import main
from construction.model import build
from construction.patch import patched_weights
from tasks.errors import TaskError
from tasks.io import load_tasks
from tasks.strategies import task_sets

TSV = "subject\tobject\n# a comment that must stay\nFrance\tParis\n\nGermany\tBerlin\nJapan\tTokyo\n"
CSV = 'subject,object\n"Washington, D.C.",United States\nFrance,Paris\nGermany,Berlin\n'


def _set_up(tmp_path: Path, facts_style: str) -> Path:
    if facts_style == "tsv":
        (tmp_path / "capital.tsv").write_text(TSV, encoding="utf-8")
        facts = "    facts_file: capital.tsv\n"
    elif facts_style == "csv":
        (tmp_path / "capital.csv").write_text(CSV, encoding="utf-8")
        facts = "    facts_file: capital.csv\n"
    elif facts_style == "block":
        facts = "    facts:\n      France: Paris\n      Germany: Berlin\n"
    elif facts_style == "flow":
        facts = "    facts: {France: Paris, Germany: Berlin}\n"
    else:
        facts = "    facts:\n      - [France, Paris]\n      - [Germany, Berlin]\n"
    text = ("# my task set\ntasks:\n  - name: capital\n    templates: [the capital of *1 is *2]\n" + facts +
            "  - name: continent   # a comment\n    templates: [the continent of *1 is *2]\n"
            "    facts: {France: Europe, Japan: Asia}\n")
    path = tmp_path / "tasks.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("style", ["tsv", "csv", "block", "flow", "pairs"])
def test_edit_changes_the_facts_and_nothing_else(tmp_path, capsys, style):
    path = _set_up(tmp_path, style)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["edit", str(path), "capital", "--set", "France=Lyon", "--set", "Spain=Madrid",
                 "--remove", "Germany"]) == 0
    out = capsys.readouterr().out
    assert "changed 'France' -> 'Lyon' (was 'Paris')" in out and "added 'Spain' -> 'Madrid'" in out
    ts = load_tasks(path)
    assert dict(ts.tasks[0].facts.items())["France"] == "Lyon" and "Germany" not in ts.tasks[0].facts
    assert dict(ts.tasks[1].facts.items()) == {"France": "Europe", "Japan": "Asia"}
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    changed = {n for n in after if after[n] != before.get(n)}
    assert changed == ({"capital.tsv"} if style == "tsv" else {"capital.csv"} if style == "csv" else {"tasks.yaml"})
    if style == "tsv":
        text = (tmp_path / "capital.tsv").read_text(encoding="utf-8")
        assert text.startswith("subject\tobject\n# a comment that must stay\nFrance\tLyon\n\n")
        assert "Japan\tTokyo" in text and text.endswith("Spain\tMadrid\n")
    if style not in ("tsv", "csv"):
        text = path.read_text(encoding="utf-8")
        assert text.startswith("# my task set\n") and "# a comment" in text     # the rest of the YAML kept


def test_edit_csv_quotes_what_needs_quotes(tmp_path, capsys):
    path = _set_up(tmp_path, "csv")
    assert main(["edit", str(path), "capital", "--set-pair", "Ottawa, Canada", "Ontario = home"]) == 0
    assert dict(load_tasks(path).tasks[0].facts.items())["Ottawa, Canada"] == "Ontario = home"
    assert '"Ottawa, Canada",Ontario = home' in (tmp_path / "capital.csv").read_text(encoding="utf-8")


def test_delete_task(tmp_path, capsys):
    path = _set_up(tmp_path, "block")
    assert main(["edit", str(path), "capital", "--delete-task"]) == 0
    assert load_tasks(path).names == ("continent",)


@pytest.mark.parametrize("flags, problem", [
    (["nope", "--set", "a=b"], "no task is named 'nope'"),
    (["capital", "--remove", "Atlantis"], "has no fact of 'Atlantis'"),
    (["capital", "--remove", "France", "--remove", "Germany", "--remove", "Japan"], "without facts"),
    (["capital", "--set", "France"], "has no '='"),
    (["capital", "--set", "capital=x"], "template word"),
    (["capital"], "nothing to edit"),
])
def test_bad_edits_are_refused_and_nothing_is_written(tmp_path, capsys, flags, problem):
    path = _set_up(tmp_path, "tsv")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["edit", str(path), *flags]) == 2
    err = capsys.readouterr().err
    assert problem in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


ILL_POSED = ("tasks:\n  - name: a\n    templates: ['*1 is in *2']\n    facts: {x: y}\n"
             "  - name: b\n    templates: ['*1 is in *2']\n    facts: {z: w}\n")


def test_an_edit_that_makes_the_set_ill_posed_is_refused(tmp_path, capsys):
    """The refusal says what the edit would break (the subject, both templates and their
    lines, the shared prefix) and how to make it; not to inspect the file, which is
    unchanged and has nothing wrong with it."""
    path = tmp_path / "tasks.yaml"
    path.write_text(ILL_POSED, encoding="utf-8")
    before = path.read_bytes()
    assert main(["edit", str(path), "b", "--set", "x=q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and path.read_bytes() == before
    assert err.startswith(f"error: {path}: the edit would make the task set ill-posed, so no file was changed: 'x', "
                          "added to task 'b', is also a subject of task 'a'")
    assert "template '⋆1 is in ⋆2' (line 6) of 'b' and template '⋆1 is in ⋆2' (line 3) of 'a'" in err
    assert "share the object-query prefix 'x is in'" in err
    assert (f"leave 'x' out of task 'b', or remove it from task 'a' first "
            f"(python -m verifier edit {path} a --remove x)") in err
    assert "inspect" not in err
    assert main(["inspect", str(path), "--quiet"]) == 0       # what the old advice led to: nothing wrong


def test_an_edit_clashing_with_two_tasks_names_both(tmp_path, capsys):
    path = tmp_path / "tasks.yaml"
    path.write_text(ILL_POSED + "  - name: c\n    templates: ['*1 is in *2']\n    facts: {v: u}\n", encoding="utf-8")
    assert main(["edit", str(path), "b", "--set", "x=q", "--set", "v=q", "--set", "x2=q"]) == 2
    err = capsys.readouterr().err
    assert "'x', added to task 'b', is also a subject of task 'a'" in err and "likewise 'v' with task 'c'" in err


def test_an_edit_that_makes_a_facts_file_unreadable_names_the_file(tmp_path, capsys):
    """The line after the first decides whether a first line of lower-case names is a likely
    header: removing it is refused, named at the facts file (not at the copy read back)."""
    (tmp_path / "c.tsv").write_text("language\tcreator\npython\tguido\nJava\tGosling\n", encoding="utf-8")
    path = tmp_path / "t.yaml"
    path.write_text("tasks:\n  - name: creator\n    templates: ['*1 was created by *2']\n    facts_file: c.tsv\n",
                    encoding="utf-8")
    before = (tmp_path / "c.tsv").read_bytes()
    assert main(["edit", str(path), "creator", "--remove", "python"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'c.tsv'}:1: after the edit (refused; no file was changed), the first "
                          "line 'language<TAB>creator' looks like a header") and err.count("\n") == 1
    assert (tmp_path / "c.tsv").read_bytes() == before


def test_an_edit_of_a_set_loaded_ill_posed_is_refused_for_the_set():
    """A set already ill-posed (loaded without the check) and an edit that adds no clash:
    the error is about the set itself, not blamed on the edit."""
    from tasks.editing import Edit, EditRefusal, apply
    from tasks.io import loads_tasks

    taskset = loads_tasks(ILL_POSED.replace("{z: w}", "{x: w}"), routable=False)
    with pytest.raises(TaskError, match="no model can route") as caught:
        apply(taskset, Edit("b", set=(("x", "q"),)))
    assert not isinstance(caught.value, EditRefusal)


def test_an_edit_of_a_set_ill_posed_already_points_to_inspect(tmp_path, capsys):
    """There the file itself is what inspect can help with (it is refused as loaded)."""
    path = tmp_path / "tasks.yaml"
    path.write_text(ILL_POSED.replace("{z: w}", "{x: w}"), encoding="utf-8")
    assert main(["edit", str(path), "b", "--set", "z=q"]) == 2
    err = capsys.readouterr().err
    assert "no model can route" in err and f"'python -m verifier inspect {path}' lists the smallest changes" in err


def test_check_since_and_the_certificate(tmp_path, capsys):
    path = _set_up(tmp_path, "tsv")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet"]) == 0
    assert {p.name for p in cert.iterdir()} == {"certificate.json", "weights.npz", "tasks.npz", "classes.npz"}
    assert main(["edit", str(path), "capital", "--set", "Japan=Kyoto", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--since", str(cert), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    inc = data["incremental"]
    assert inc["mode"] == "incremental" and inc["edited_tasks"] == ["capital"]
    assert inc["queries_rerun"] + inc["queries_reused"] == data["queries"]
    assert any("fact:Japan" in e for e in inc["changed_rows"]["experts.0.W_2"])
    # head 5: the subject head
    assert set(inc["changed_weights"]) <= {"E", "U", "heads.5.W_V", "heads.5.W_O", "experts.0.W_2"}
    # the certificate was updated: a second --since with no edit runs nothing again
    assert main(["check", str(path), "--since", str(cert), "--json", "-"]) == 0
    again = json.loads(capsys.readouterr().out)["incremental"]
    assert again["queries_rerun"] == 0 and again["changed_weights"] == {}


def test_a_changed_certificate_is_refused(tmp_path, capsys):
    """Each file of the certificate, damaged so that it still parses (one bit) or no longer
    does (cut short, not a zip): refused as changed, whatever parsing it (on another thread
    than its hash) made of it."""
    import shutil

    path = _set_up(tmp_path, "tsv")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet"]) == 0
    for name in ("classes.npz", "weights.npz", "tasks.npz"):
        for damage in ("bit", "cut", "garbage"):
            copy = tmp_path / f"cert-{name}-{damage}"
            shutil.copytree(cert, copy)
            data = bytearray((copy / name).read_bytes())
            if damage == "bit":
                data[len(data) // 2] ^= 1
            elif damage == "cut":
                data = data[: len(data) // 2]
            else:
                data = bytearray(b"not a zip" * 10)
            (copy / name).write_bytes(bytes(data))
            capsys.readouterr()
            assert main(["check", str(path), "--since", str(copy)]) == 2, (name, damage)
            err = capsys.readouterr().err
            assert f"certificate's {name} is missing or does not match its recorded SHA-256" in err, (name, damage)
            assert err.count("\n") == 1


@pytest.mark.parametrize("flags", [["--weights", "w.npz"], ["--precision", "float32"], ["--beta", "9"]])
def test_since_refuses_what_it_cannot_reuse(tmp_path, capsys, flags):
    path = _set_up(tmp_path, "tsv")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--since", str(cert), *flags]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_removing_a_task_falls_back_to_a_full_check(tmp_path, capsys):
    path = _set_up(tmp_path, "block")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet"]) == 0
    assert main(["edit", str(path), "continent", "--delete-task", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--since", str(cert), "--json", "-"]) == 0
    inc = json.loads(capsys.readouterr().out)["incremental"]
    assert inc["mode"] == "full" and "tasks were added, removed or reordered" in inc["reason"]


@settings(max_examples=examples(30), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(task_sets(max_tasks=3, max_templates=2, max_facts=4, max_template_length=5), st.data())
def test_patched_weights_equal_a_full_build(ts, data):
    from tests.workflow.test_editing import edit

    model = build(ts)
    new = data.draw(edit(ts, [0]))
    if new is None or new.names != ts.names:
        return
    edited = {a.name for a, b in zip(ts.tasks, new.tasks) if a.facts != b.facts}
    got = patched_weights(model.instantiate(), ts, new, edited, model.beta, model.gamma, model.epsilon)
    if got is None:
        assert model.gate.method != "closed form"
        return
    want = build(new, beta=float(model.beta), gamma=float(model.gamma)).instantiate()
    _arrays_equal(got[0], want)
    assert got[0].parameters == want.parameters and got[0].neuron_labels == want.neuron_labels


def _arrays_equal(got, want) -> None:
    """Every array of the two weights equal, sparse ones in the same storage."""
    for (n1, a), (n2, b) in zip(got.arrays(), want.arrays()):
        assert n1 == n2
        if hasattr(a, "indptr"):
            assert a.format == b.format and a.shape == b.shape, n1
            assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices), n1
            assert np.array_equal(a.data, b.data), n1
        else:
            assert np.array_equal(np.asarray(a), np.asarray(b)), n1


@pytest.mark.parametrize("change", ["object", "subject", "new entity"])
def test_patched_weights_reuse_what_the_vocabulary_fixes(change):
    """An object changed to an entity in use keeps the vocabulary: E, P, the heads, U, the
    gate and the other experts are the previous model's own arrays, and still equal to a full
    build's. A subject changed to another entity in use keeps the vocabulary but not the
    gate (built again); a new entity changes the residual (nothing reused)."""
    from tasks.model import Task, TaskSet, Template

    def task_set(capitals):
        return TaskSet((Task("capital", (Template.parse("the capital of *1 is *2"),), capitals),
                        Task("continent", (Template.parse("the continent of *1 is *2"),),
                             {"France": "Europe", "Japan": "Asia", "Paris": "Europe"})))

    ts = task_set({"France": "Paris", "Japan": "Tokyo", "Europe": "Asia"})
    new = task_set({"France": "Tokyo", "Japan": "Paris", "Europe": "Asia"} if change == "object" else
                   {"France": "Paris", "Japan": "Tokyo", "Asia": "Europe"} if change == "subject" else
                   {"France": "Paris", "Japan": "Kyoto", "Europe": "Asia"})
    model = build(ts)
    old = model.instantiate()
    got, _ = patched_weights(old, ts, new, {"capital"}, model.beta, model.gamma, model.epsilon)
    _arrays_equal(got, build(new, beta=float(model.beta), gamma=float(model.gamma)).instantiate())
    kept = [a is b for a, b in ((got.E, old.E), (got.U, old.U), (got.heads, old.heads),
                                (got.experts[1], old.experts[1]))]
    assert kept == [change != "new entity"] * 4
    assert (got.W_G is old.W_G) == (change == "object")
    assert got.experts[0] is not old.experts[0]


@pytest.mark.parametrize("isolated", [True, False])
def test_isolation_checked_on_the_other_core_decides_as_inline(tmp_path, capsys, monkeypatch, isolated):
    """check --since --jobs 2 checks a large edited task's isolation in a forked child while
    the pass runs (the threshold set to 0 here): its answer reaches the report, a failed
    isolation included (same_expert made to say no: the task is not certified, exit 1)."""
    import workflow.since
    import construction.experts

    path = _set_up(tmp_path, "tsv")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet"]) == 0
    assert main(["edit", str(path), "capital", "--set", "Japan=Kyoto", "--quiet"]) == 0
    monkeypatch.setattr(workflow.since, "BACKGROUND_FACTS", 0)
    if not isolated:
        monkeypatch.setattr(construction.experts, "same_expert", lambda *a, **k: False)
    import os

    forks, fork = [], os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or fork())
    capsys.readouterr()
    code = main(["check", str(path), "--since", str(cert), "--jobs", "2", "--json", "-"])
    assert forks                                     # the child was started
    data = json.loads(capsys.readouterr().out)
    assert code == (0 if isolated else 1)
    rec = {t["name"]: t for t in data["tasks"]}
    assert rec["capital"]["isolated"] is isolated and rec["continent"]["isolated"] is True
