"""A saved certificate's parameters and the edits that follow it: parameters the construction
chose leave room for growth (γ for a vocabulary four times the task set's) and are chosen anew
when an edit goes beyond them, so ``check --since`` (and ``watch``) certify whenever a full
check of the edited files does; pinned parameters stay, and the report names the one that
fails with the value that would serve; a certificate of another task set is refused."""

from __future__ import annotations

import json
import shutil

import pytest

from workflow.certificates import VOCABULARY_HEADROOM
from cli.main import main
from workflow.watching import Watcher
from tasks.io import load_tasks
from repository import EXAMPLES


def _json(args, capsys, code=None) -> dict:
    got = main([*args, "--no-isolation", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    if code is not None:
        assert got == code, data.get("counterexamples", [])[:2]
    return data


@pytest.mark.parametrize("example,edit", [
    ("capitals.yaml", ["capital", "--set", "Spain=Madrid"]),
    ("geography/tasks.yaml", ["capital", "--set", "Indonesia=Nusantara"]),
])
def test_the_readme_flow_with_new_entities_certifies(tmp_path, capsys, example, edit):
    """certificate, an edit that adds entities, check --since: certified, incrementally, and a
    full check of the edited files certifies too (the outside review's case: the certificate's
    minimal gamma did not serve two more tokens, and --since said NOT CERTIFIED)."""
    src = EXAMPLES / example
    shutil.copytree(src.parent, tmp_path / "set") if example.startswith("geography") else None
    path = tmp_path / "set" / "tasks.yaml" if example.startswith("geography") else tmp_path / "capitals.yaml"
    if not example.startswith("geography"):
        shutil.copy(src, path)
    cert = tmp_path / "cert"
    made = _json(["check", str(path), "--certificate", str(cert)], capsys, 0)
    saved = json.loads((cert / "certificate.json").read_text())["parameter_choice"]
    V = load_tasks(path).vocabulary.size
    assert saved == {"beta": "chosen", "gamma": "chosen", "vocabulary": VOCABULARY_HEADROOM * V,
                     "L": load_tasks(path).L}
    assert main(["edit", str(path), *edit, "--quiet"]) == 0
    capsys.readouterr()
    since = _json(["check", str(path), "--since", str(cert)], capsys, 0)
    assert since["incremental"]["mode"] == "incremental" and since["incremental"]["vocabulary_delta"] >= 1
    assert since["parameters"]["gamma"] == made["parameters"]["gamma"]
    assert _json(["check", str(path)], capsys)["certified"]


def test_an_edit_beyond_the_reach_chooses_parameters_anew(tmp_path, capsys):
    path = tmp_path / "capitals.yaml"
    shutil.copy(EXAMPLES / "capitals.yaml", path)
    cert = tmp_path / "cert"
    made = _json(["check", str(path), "--certificate", str(cert)], capsys, 0)
    reach = json.loads((cert / "certificate.json").read_text())["parameter_choice"]["vocabulary"]
    # enough facts with new names to pass the vocabulary the certificate's gamma was chosen for
    n = reach // 2 + 1
    sets = [f"Land{i}=Town{i}" for i in range(n)]
    assert main(["edit", str(path), "capital", *sum((["--set", x] for x in sets), []), "--quiet"]) == 0
    capsys.readouterr()
    since = _json(["check", str(path), "--since", str(cert)], capsys, 0)
    inc = since["incremental"]
    assert inc["mode"] == "full" and "chosen anew" in inc["reason"] and f"more than the {reach}" in inc["reason"]
    assert since["parameters"]["gamma"] != made["parameters"]["gamma"]
    # the new certificate records its own reach, and a full check of the edited file agrees
    assert json.loads((cert / "certificate.json").read_text())["parameter_choice"]["vocabulary"] > reach
    assert _json(["check", str(path)], capsys)["certified"]


def test_the_watcher_chooses_anew_too(tmp_path):
    path = tmp_path / "capitals.yaml"
    shutil.copy(EXAMPLES / "capitals.yaml", path)
    watcher = Watcher(str(path), str(tmp_path / "cert"), isolation=False)
    first = watcher.check()
    assert first.report is not None and first.report.certified
    reach = watcher.cert.choice["vocabulary"]
    sets = sum((["--set", f"Land{i}=Town{i}"] for i in range(reach // 2 + 1)), [])
    assert main(["edit", str(path), "capital", *sets, "--quiet"]) == 0
    second = watcher.check()
    assert second.report.certified and second.report.incremental["mode"] == "full"
    assert "chosen anew" in second.report.incremental["reason"]


def test_pinned_parameters_stay_and_the_report_names_them(tmp_path, capsys):
    path = tmp_path / "capitals.yaml"
    shutil.copy(EXAMPLES / "capitals.yaml", path)
    cert = tmp_path / "cert"
    assert _json(["check", str(path), "--certificate", str(cert), "--gamma", "7.75"], capsys)["certified"]
    assert json.loads((cert / "certificate.json").read_text())["parameter_choice"]["gamma"] == "pinned"
    sets = sum((["--set", f"Land{i}=Town{i}"] for i in range(30)), [])
    assert main(["edit", str(path), "capital", *sets, "--quiet"]) == 0
    capsys.readouterr()
    since = _json(["check", str(path), "--since", str(cert)], capsys, 1)
    assert since["parameters"]["gamma"] == "31/4"
    note = next(n for n in since["notes"] if "pinned" in n)
    assert "gamma = 31/4 (pinned when the certificate was made)" in note and "would choose gamma = " in note


def test_a_certificate_of_another_task_set_is_refused(tmp_path, capsys):
    a, b = tmp_path / "capitals.yaml", tmp_path / "other.yaml"
    shutil.copy(EXAMPLES / "capitals.yaml", a)
    b.write_text("tasks:\n  - name: author\n    templates: ['*1 was written by *2']\n"
                 "    facts: {Emma: Austen, Ulysses: Joyce}\n", encoding="utf-8")
    cert = tmp_path / "cert"
    assert main(["check", str(a), "--certificate", str(cert), "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in cert.iterdir()}
    capsys.readouterr()
    assert main(["check", str(b), "--since", str(cert)]) == 2
    err = capsys.readouterr().err
    assert "another task set" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in cert.iterdir()} == before          # nothing overwritten
