"""The watcher (cli.watch): the certificate it holds in memory gives what ``check --since``
gives from the saved directory; bad input is one line and leaves the held certificate; a
directory written elsewhere is read again; a check whose inputs change while it reads them
is run again; and ``check --since`` refuses to save over inputs written during its read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from workflow.certificates import check_and_save

from workflow.since import check_since
from cli.main import main
from cli.watch import verdict_line
from workflow.watching import Watcher, watch
from verifier.certificates.certificate import FORMAT
from construction.model import build
from tasks.editing import Edit, edit_tasks_file
from tasks.io import load_tasks

TASKS = ("tasks:\n"
         "  - name: capital\n    templates: ['the capital of *1 is *2', '*1 has capital *2']\n"
         "    facts_file: capital.tsv\n"
         "  - name: continent\n    templates: [the continent of *1 is *2]\n"
         "    facts: {France: Europe, Japan: Asia, Chile: South America}\n"
         "  - name: currency\n    templates: [the currency of *1 is *2]\n    facts_file: currency.tsv\n")
CAPITALS = "subject\tobject\nFrance\tParis\nGermany\tBerlin\nJapan\tTokyo\nChile\tSantiago\n"
CURRENCIES = "France\teuro\nJapan\tyen\nChile\tpeso\n"

#: A sequence of edits of every kind: an object changed, a fact with new entities, a fact
#: removed, an object changed to an entity of another task, a whole task removed.
EDITS = [Edit("capital", (("France", "Lyon"),)),
         Edit("currency", (("Peru", "sol"),)),
         Edit("capital", (), ("Germany",)),
         Edit("capital", (("Japan", "Europe"),)),
         Edit("currency", (), (), True)]


def _files(tmp_path: Path) -> Path:
    (tmp_path / "capital.tsv").write_text(CAPITALS, encoding="utf-8")
    (tmp_path / "currency.tsv").write_text(CURRENCIES, encoding="utf-8")
    path = tmp_path / "tasks.yaml"
    path.write_text(TASKS, encoding="utf-8")
    return path


def _edit(path: Path, edit: Edit) -> None:
    edit_tasks_file(str(path), load_tasks(path), edit)


def _arrays(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for name in ("weights.npz", "tasks.npz", "classes.npz"):
        with np.load(directory / name, allow_pickle=False) as z:
            out.update({f"{name}:{k}": z[k] for k in z.files})
    return out


def _same_arrays(a: Path, b: Path) -> None:
    x, y = _arrays(a), _arrays(b)
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
        assert np.array_equal(x[k], y[k], equal_nan=x[k].dtype.kind == "f"), k


def _records(report) -> list:
    from dataclasses import asdict
    return [asdict(t) for t in report.tasks]


def test_the_held_certificate_gives_what_check_since_gives(tmp_path):
    """The same edits through a watcher (its certificate held in memory) and through
    ``check --since`` (the certificate read back from disk each time): the same reports,
    and saved certificates with the same arrays."""
    path = _files(tmp_path)
    ts = load_tasks(path)
    model = build(ts)
    check_and_save(ts, model, str(tmp_path / "disk"), isolation=False, tasks_path=str(path))
    shutil.copytree(tmp_path / "disk", tmp_path / "held")
    verdicts = []
    watcher = Watcher(str(path), str(tmp_path / "held"), isolation=False)
    first = watcher.check()
    assert first.report.certified and first.report.incremental["queries_rerun"] == 0
    held_before = watcher.cert
    for edit in EDITS:
        _edit(path, edit)
        assert watcher.changed()
        outcome = watcher.check()
        assert not watcher.changed()
        assert watcher.cert is not held_before          # the new certificate is held, not read back
        held_before = watcher.cert
        from workflow.since import load_since
        old, taskset, cache = load_since(str(path), str(tmp_path / "disk"))
        report, edited = check_since(taskset, str(tmp_path / "disk"), old=old, cache=cache, isolation=False,
                                     tasks_path=str(path))
        assert outcome.error is None and outcome.edited == edited
        assert outcome.report.verdict == report.verdict and _records(outcome.report) == _records(report)
        for key in ("mode", "queries_rerun", "queries_reused", "changed_weights", "tasks_reused"):
            assert outcome.report.incremental[key] == report.incremental[key], key
        _same_arrays(tmp_path / "held", tmp_path / "disk")
        # and both are the verdict of a full check at the certificate's β and γ
        full = load_tasks(path)
        from verifier.checks.verify import verify
        rebuilt = build(full, beta=float(model.beta), gamma=float(model.gamma))
        assert verify(full, rebuilt.instantiate(), model.epsilon).verdict == report.verdict
        verdicts.append(report.verdict)
    assert "not certified" in verdicts and "certified" in verdicts     # both kinds of verdict were carried


def test_no_certificate_yet_is_a_full_check_that_writes_one(tmp_path):
    path = _files(tmp_path)
    watcher = Watcher(str(path), str(tmp_path / "cert"), isolation=False)
    outcome = watcher.check()
    assert outcome.report.certified and not outcome.report.incremental
    assert (tmp_path / "cert" / "certificate.json").is_file()
    assert "full check of 3 tasks; CERTIFIED" in verdict_line(outcome, "cert")
    _edit(path, EDITS[0])
    again = watcher.check()
    assert again.report.incremental["mode"] == "incremental" and again.edited == ["capital"]
    assert "edited capital:" in verdict_line(again, "cert")


def test_bad_input_is_one_line_and_the_held_certificate_stays(tmp_path):
    path = _files(tmp_path)
    watcher = Watcher(str(path), str(tmp_path / "cert"), isolation=False)
    assert watcher.check().report.certified
    held, saved = watcher.cert, (tmp_path / "cert" / "certificate.json").read_bytes()
    good = (tmp_path / "capital.tsv").read_text(encoding="utf-8")
    (tmp_path / "capital.tsv").write_text(good + "France\tLyon\n", encoding="utf-8")    # two objects
    bad = watcher.check()
    assert bad.report is None and "\n" not in bad.error and "capital.tsv:6" in bad.error
    assert "error: " in verdict_line(bad, "cert")
    assert watcher.cert is held and (tmp_path / "cert" / "certificate.json").read_bytes() == saved
    assert not watcher.changed()                 # the next check waits for the next change
    path.write_text("tasks: [", encoding="utf-8")
    assert watcher.changed() and watcher.check().report is None
    path.write_text(TASKS, encoding="utf-8")
    (tmp_path / "capital.tsv").write_text(good.replace("Tokyo", "Kyoto"), encoding="utf-8")
    fixed = watcher.check()
    assert fixed.report.certified and fixed.edited == ["capital"]


def test_a_directory_written_elsewhere_is_read_again(tmp_path):
    path = _files(tmp_path)
    watcher = Watcher(str(path), str(tmp_path / "cert"), isolation=False)
    watcher.check()
    held = watcher.cert
    _edit(path, EDITS[1])
    ts = load_tasks(path)
    check_and_save(ts, build(ts), str(tmp_path / "cert"), isolation=False, tasks_path=str(path))   # another process
    outcome = watcher.check()
    assert watcher.cert is not held
    # read from the new directory: the edit is already in it, nothing to run again
    assert outcome.report.incremental["queries_rerun"] == 0 and outcome.edited == []


def test_a_check_whose_inputs_change_while_it_reads_runs_again(tmp_path, monkeypatch):
    path = _files(tmp_path)
    watcher = Watcher(str(path), str(tmp_path / "cert"), isolation=False)
    watcher.check()
    real, calls = watcher._certify, []

    def racing():
        calls.append(1)
        got = real()
        if len(calls) == 1:              # a write lands after the first read
            text = (tmp_path / "capital.tsv").read_text(encoding="utf-8")
            (tmp_path / "capital.tsv").write_text(text.replace("Berlin", "Bonn"), encoding="utf-8")
        return got

    _edit(path, EDITS[0])
    monkeypatch.setattr(watcher, "_certify", racing)
    outcome = watcher.check()
    assert len(calls) == 2 and not watcher.changed()
    facts = dict(watcher.cert.taskset.tasks[0].facts.items())
    assert facts["France"] == "Lyon" and facts["Germany"] == "Bonn"
    assert outcome.report.certified


def test_check_since_refuses_to_save_over_inputs_written_during_the_read(tmp_path, monkeypatch, capsys):
    import workflow.since as compose

    path = _files(tmp_path)
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet"]) == 0
    _edit(path, EDITS[0])
    before = (cert / "certificate.json").read_bytes()
    real = compose.recertify_since

    def racing(*args, **kwargs):
        got = real(*args, **kwargs)
        (tmp_path / "currency.tsv").write_text(CURRENCIES + "Peru\tsol\n", encoding="utf-8")
        return got

    monkeypatch.setattr(compose, "recertify_since", racing)
    capsys.readouterr()
    assert main(["check", str(path), "--since", str(cert), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "written while it was being checked" in err and err.count("\n") == 1
    assert (cert / "certificate.json").read_bytes() == before


def test_the_loop_checks_after_each_change_only(tmp_path):
    """``watch`` with a sleep that edits: one check at the start, one per edit, none while
    nothing changes."""
    path = _files(tmp_path)
    watcher = Watcher(str(path), str(tmp_path / "cert"), isolation=False)
    edits, naps, seen = list(EDITS[:2]), [], []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) % 3 == 0 and edits:         # two idle polls, then an edit
            _edit(path, edits.pop(0))

    last = watch(watcher, seen.append, interval=0.25, max_checks=3, sleep=sleep)
    assert [o.edited for o in seen] == [["capital", "continent", "currency"], ["capital"], ["currency"]]
    assert len(naps) == 6 and set(naps) == {0.25} and last is seen[-1]
    # two new tokens: the certificate's γ was chosen for four times the vocabulary, so it still
    # serves them, and the edit stays incremental (before, the minimal γ refuted it)
    assert seen[1].report.certified and last.report.certified
    assert last.report.incremental["mode"] == "incremental"


def test_a_refuted_edit_is_reported_not_certified(tmp_path, capsys):
    """ε made smaller than the model's error in the tasks file, with γ pinned there: a full check
    (ε changed) that does not certify, and the exit status says so. (With γ left to the
    construction it is chosen anew for the new ε, and certifies.)"""
    path = _files(tmp_path)
    cert = tmp_path / "cert"
    assert main(["watch", str(path), "--certificate", str(cert), "--max-checks", "1", "--quiet"]) == 0
    path.write_text("epsilon: 1.0e-12\nparameters: {gamma: 8}\n" + TASKS, encoding="utf-8")
    assert main(["watch", str(path), "--certificate", str(cert), "--max-checks", "1", "--json", "-"]) == 1
    line = capsys.readouterr().out.strip().splitlines()[-1]
    data = json.loads(line)
    assert data["verdict"] != "certified" and data["incremental"]["mode"] == "full"


def test_the_command_line(tmp_path, capsys):
    path = _files(tmp_path)
    cert = tmp_path / "cert"
    assert main(["watch", str(path), "--certificate", str(cert), "--max-checks", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("watching ") and "full check of 3 tasks; CERTIFIED" in out[1]
    assert out[2].startswith(f"  certificate saved to {cert} in ")
    report = tmp_path / "report.json"
    assert main(["watch", str(path), "--certificate", str(cert), "--max-checks", "1", "--json", str(report),
                 "--quiet"]) == 0
    assert json.loads(report.read_text())["incremental"]["queries_rerun"] == 0
    assert capsys.readouterr().out.count("\n") == 1              # --quiet: the verdict line only
    for bad in (["--max-checks", "0"], ["--json", str(path)], ["--interval", "-1"]):
        with pytest.raises(SystemExit) if bad[0] == "--interval" else _no_raise():
            assert main(["watch", str(path), "--certificate", str(cert), *bad]) == 2
    (tmp_path / "file").write_text("x")
    assert main(["watch", str(path), "--certificate", str(tmp_path / "file"), "--max-checks", "1"]) == 2
    assert main(["watch", str(path), "--certificate", str(path), "--max-checks", "1"]) == 2
    assert main(["watch", str(path), "--certificate", str(tmp_path / "no" / "cert"), "--max-checks", "1"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert all(e.startswith("error: ") for e in errors) and len(errors) >= 4
    assert os.path.isfile(path)


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_verdict_comes_before_the_save_and_a_failed_save_is_an_error(tmp_path, monkeypatch, capsys):
    import workflow.watching as watch_module
    from tasks.errors import TaskError

    path = _files(tmp_path)
    watcher = Watcher(str(path), str(tmp_path / "cert"), isolation=False)
    watcher.check()
    held, order = watcher.cert, []
    real = watch_module.save_certificate

    def failing(cert, directory):
        order.append("save")
        raise TaskError("cannot write the certificate beside 'cert': No space left on device", fix="free space")

    monkeypatch.setattr(watch_module, "save_certificate", failing)
    _edit(path, EDITS[0])
    outcome = watcher.check(lambda o: order.append(("verdict", o.report.verdict)))
    assert order == [("verdict", "certified"), "save"]
    assert outcome.save_error.startswith("cannot write the certificate") and watcher.cert is held
    assert main(["watch", str(path), "--certificate", str(tmp_path / "cert"), "--max-checks", "1"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert "CERTIFIED" in out[1] and out[2].startswith("error: the certificate was not saved: cannot write")
    monkeypatch.setattr(watch_module, "save_certificate", real)
    assert main(["watch", str(path), "--certificate", str(tmp_path / "cert"), "--max-checks", "1", "--quiet"]) == 0


def test_a_certificate_directory_that_holds_an_input_is_refused(tmp_path, capsys):
    """Saving replaces the whole directory: one that holds the tasks file or a facts file
    would delete it."""
    path = _files(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for command in (["watch", str(path), "--certificate", str(tmp_path), "--max-checks", "1"],
                    ["check", str(path), "--certificate", str(tmp_path)],
                    ["check", str(path), "--since", str(tmp_path)]):
        assert main(command) == 2
        assert "holds an input file" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("text, problem", [
    ("tasks:\n  - name: a\n    templates: ['*1 is *2']\n    facts: " + "[" * 100_000 + "]" * 100_000 + "\n",
     "nested too deeply"),
    ("tasks:\n  - name: a\n    templates: ['*1 is *2']\n    facts: {Rome: 2024-02-30}\n", "2024-02-30"),
    ("tasks:\n  - name: a\n    templates: ['*1 is *2']\n    facts_file: \"cap\\0ital.tsv\"\n",
     "contains a NUL character"),
])
def test_input_that_breaks_yaml_readers_is_one_line_while_watching(tmp_path, capsys, text, problem):
    """A document nested 100,000 deep, a date that does not exist, a NUL in a path: the
    list of input files and their status never fail (the loader reports the problem), so
    a watcher prints one line and waits; check --certificate is exit 2 with one line."""
    from tasks.io import input_files, input_signature

    path = _files(tmp_path)
    watcher = Watcher(str(path), str(tmp_path / "cert"), isolation=False)
    assert watcher.check().report.certified
    path.write_text(text, encoding="utf-8")
    assert input_files(path)[0] == str(path) and input_signature(path)
    bad = watcher.check()
    assert bad.report is None and "\n" not in bad.error and problem in bad.error, bad.error
    capsys.readouterr()
    assert main(["check", str(path), "--certificate", str(tmp_path / "cert2")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    path.write_text(TASKS, encoding="utf-8")
    assert watcher.check().report.certified


def test_a_report_that_cannot_be_written_is_an_error_line_and_the_certificate_is_saved(tmp_path, monkeypatch, capsys):
    """``--json FILE`` failing mid-watch (a full disk) is one line after the verdict; the
    watcher saves the certificate all the same, and the exit status is 2."""
    import cli.common as main_module

    path = _files(tmp_path)
    cert, report = tmp_path / "cert", tmp_path / "report.json"
    assert main(["watch", str(path), "--certificate", str(cert), "--max-checks", "1", "--quiet"]) == 0
    capsys.readouterr()
    before = (cert / "certificate.json").read_bytes()

    def full(path, text):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(main_module, "write_text_atomic", full)
    _edit(path, EDITS[0])
    assert main(["watch", str(path), "--certificate", str(cert), "--max-checks", "1", "--json", str(report),
                 "--quiet"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert "edited capital" in out[0] and "CERTIFIED" in out[0]
    assert out[1].startswith("error: the JSON report was not written: ") and "No space left on device" in out[1]
    assert not report.exists() and (cert / "certificate.json").read_bytes() != before
    assert main(["check", str(path), "--since", str(cert), "--json", "-"]) == 0  # the saved one is the edit's:
    assert json.loads(capsys.readouterr().out)["incremental"]["queries_rerun"] == 0   # nothing left to run


def test_edited_tasks_are_hashed_at_the_save_and_a_reordered_file_is_no_edit(tmp_path):
    """An edited task's content hash is computed when the certificate is saved (after the
    verdict) and is the hash of a fresh read; a facts file rewritten with the same facts in
    another order is read again but found unedited (the same fact ids through the token map)."""
    from verifier.certificates.certificate import load_certificate, task_hash

    path = _files(tmp_path)
    cert = tmp_path / "cert"
    watcher = Watcher(str(path), str(cert), isolation=False)
    watcher.check()
    _edit(path, EDITS[0])
    outcome = watcher.check()
    assert outcome.edited == ["capital"] and outcome.save_error is None
    fresh = load_tasks(path)
    assert load_certificate(cert).task_hashes == {t.name: task_hash(t) for t in fresh.tasks}
    assert watcher.cert.task_hashes == load_certificate(cert).task_hashes       # resolved in memory too
    lines = (tmp_path / "capital.tsv").read_text(encoding="utf-8").splitlines()
    (tmp_path / "capital.tsv").write_text("\n".join([lines[0]] + lines[1:][::-1]) + "\n", encoding="utf-8")
    outcome = watcher.check()
    assert outcome.report.certified and outcome.edited == []
    assert outcome.report.incremental["queries_rerun"] == 0


def test_a_certificate_of_an_older_format_is_replaced_by_a_full_check(tmp_path):
    path = _files(tmp_path)
    cert = tmp_path / "cert"
    assert Watcher(str(path), str(cert), isolation=False).check().report.certified
    manifest = json.loads((cert / "certificate.json").read_text(encoding="utf-8"))
    manifest["format"] = "moe-knowledge-certificate/2"
    (cert / "certificate.json").write_text(json.dumps(manifest), encoding="utf-8")
    outcome = Watcher(str(path), str(cert), isolation=False).check()
    assert outcome.report.certified and not outcome.report.incremental
    assert "full check of 3 tasks" in verdict_line(outcome, str(cert))
    assert json.loads((cert / "certificate.json").read_text(encoding="utf-8"))["format"] == FORMAT


def test_watch_refuses_a_directory_of_the_users_files_before_the_first_check(tmp_path, capsys, monkeypatch):
    path = _files(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("notes", encoding="utf-8")
    monkeypatch.setattr(Watcher, "check", lambda self, verdict=None: pytest.fail("a check ran"))
    assert main(["watch", str(path), "--certificate", str(work), "--max-checks", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a certificate this tool wrote" in err and "'notes.txt'" in err
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    monkeypatch.chdir(work)
    assert main(["watch", str(path), "--certificate", ".", "--max-checks", "1", "--quiet"]) == 2
    assert "current directory" in capsys.readouterr().err
