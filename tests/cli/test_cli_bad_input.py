"""The command line on bad input: exit 2, one line on stderr, no traceback, fast.

In-process (``cli.main.main``, stderr captured) on every ``tests/data/bad/*.yaml``
and on corrupt or inconsistent weights files generated here; a few subprocess runs of
``python -m verifier check``. Then "nothing lost": ``check --json OUT`` and
``build -o OUT`` leave OUT's previous content and no partial or temporary file when the
write fails midway, and refuse to overwrite an input.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import layout
from cli.main import main
from repository import ROOT

BAD = ROOT / "tests" / "data" / "bad"
GOOD = ROOT / "tests" / "data" / "good"
EXAMPLE = ROOT / "examples" / "capitals.yaml"
BAD_YAML = sorted(p.name for p in BAD.glob("*.yaml"))


def one_line_exit_2(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, (code, out.err, out.out)
    assert len(lines) == 1, out.err
    assert "Traceback" not in out.err and "Traceback" not in out.out
    assert lines[0].startswith("error: ")
    return lines[0]


# --- every bad tasks file ---------------------------------------------------------------------


def test_the_bad_corpus_is_there():
    assert len(BAD_YAML) >= 77


@pytest.mark.parametrize("name", BAD_YAML)
def test_bad_tasks_file(name, capsys):
    line = one_line_exit_2(capsys, ["check", BAD / name, "--quiet"])
    assert "data/bad/" in line or "data\\bad\\" in line


@pytest.mark.parametrize("name", ["collision.yaml", "duplicate_subject.yaml", "alias_bomb.yaml"])
def test_bad_tasks_file_other_commands(name, capsys, tmp_path):
    one_line_exit_2(capsys, ["inspect", BAD / name])
    one_line_exit_2(capsys, ["build", BAD / name, "-o", tmp_path / "w.npz"])
    assert not (tmp_path / "w.npz").exists()


# --- bad weights files --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_npz(tmp_path_factory) -> Path:
    from construction.model import build
    from tasks.io import load_tasks

    path = tmp_path_factory.mktemp("weights") / "good.npz"
    layout.save(build(load_tasks(EXAMPLE)).instantiate(), path)
    return path


def arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def write(path: Path, a: dict[str, np.ndarray]) -> Path:
    with open(path, "wb") as f:
        np.savez(f, **a)
    return path


def _meta(a, **changes):
    meta = json.loads(str(a["meta"]))
    meta.update(changes)
    a["meta"] = np.array(json.dumps(meta))
    return a


def _drop(a, *names):
    for n in names:
        del a[n]
    return a


def _set(a, name, value):
    a[name] = value
    return a


def _vocab_without(a, token):
    v = [str(t) for t in a["vocab"]]
    v[v.index(token)] = token + " (renamed)"
    a["vocab"] = np.array(v)
    return a


def _csr_replace(a, name, dense):
    import scipy.sparse as sp

    m = sp.csr_matrix(dense)
    a[f"{name}.data"], a[f"{name}.indices"], a[f"{name}.indptr"] = (m.data, m.indices.astype(np.int64),
                                                                    m.indptr.astype(np.int64))
    a[f"{name}.shape"] = np.asarray(m.shape, np.int64)
    a[f"{name}.format"] = np.array("csr")
    return a


def _nan(a, name):
    d = a[name].copy()
    d[0] = np.nan
    a[name] = d
    return a


def _inf(a, name):
    d = a[name].astype(np.float64).copy()
    d[-1] = np.inf
    a[name] = d
    return a


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _dir(path: Path) -> Path:
    path.mkdir()
    return path


#: name -> (a function of (tmp_path, good npz path) returning the bad path, a fragment of the message)
WEIGHTS_CASES = {
    "truncated": (lambda t, g: _bytes(t / "w.npz", g.read_bytes()[: g.stat().st_size // 2]), "not a readable .npz"),
    "truncated_to_header": (lambda t, g: _bytes(t / "w.npz", g.read_bytes()[:30]), "not a readable .npz"),
    "random_bytes": (lambda t, g: _bytes(t / "w.npz", np.random.default_rng(0).bytes(4096)), "not a readable .npz"),
    "empty_file": (lambda t, g: _bytes(t / "w.npz", b""), "not a readable .npz"),
    "directory": (lambda t, g: _dir(t / "dir.npz"), "is a directory"),
    "missing_file": (lambda t, g: t / "absent.npz", "not found"),
    "text_file": (lambda t, g: _bytes(t / "w.npz", b"hello\n"), "not a readable .npz"),
    "tasks_yaml_as_weights": (lambda t, g: EXAMPLE, "not a readable .npz"),
    "zip_not_npz": (lambda t, g: _zip(t / "w.npz"), "not a .npy array"),
    "missing_array": (lambda t, g: write(t / "w.npz", _drop(arrays(g), "U.data")), "is missing"),
    "missing_meta": (lambda t, g: write(t / "w.npz", _drop(arrays(g), "meta")), "is missing"),
    "missing_head": (lambda t, g: write(t / "w.npz", _meta(arrays(g), n_heads=9)), "is missing"),
    "missing_expert": (lambda t, g: write(t / "w.npz", _meta(arrays(g), n_experts=4)), "is missing"),
    "meta_not_json": (lambda t, g: write(t / "w.npz", _set(arrays(g), "meta", np.array("{not json"))),
                      "not valid JSON"),
    "unknown_format": (lambda t, g: write(t / "w.npz", _meta(arrays(g), format="other/9")), "unknown weights format"),
    "unknown_gate_mode": (lambda t, g: write(t / "w.npz", _meta(arrays(g), gate_mode="top2")), "gate_mode"),
    "W_G_wrong_shape": (lambda t, g: write(t / "w.npz", _csr_replace(arrays(g), "W_G", np.ones((3, 5)))),
                        "W_G has shape"),
    "W_G_too_many_rows": (lambda t, g: write(t / "w.npz", _csr_replace(arrays(g), "W_G", np.ones((4, 122)))),
                          "W_G has shape"),
    "b_G_wrong_length": (lambda t, g: write(t / "w.npz", _set(arrays(g), "b_G", np.zeros(2))), "b_G has shape"),
    "U_wrong_shape": (lambda t, g: write(t / "w.npz", _csr_replace(arrays(g), "U", np.ones((22, 122)))), "U has shape"),
    "E_wrong_shape": (lambda t, g: write(t / "w.npz", _csr_replace(arrays(g), "E", np.ones((23, 122)))), "E has shape"),
    "expert_W_2_wrong_shape": (lambda t, g: write(t / "w.npz",
                                                  _csr_replace(arrays(g), "experts.0.W_2", np.ones((122, 3)))),
                               "expert 0"),
    "head_W_O_wrong_shape": (lambda t, g: write(t / "w.npz", _csr_replace(arrays(g), "heads.0.W_O", np.ones((5, 5)))),
                             "head 0"),
    "csr_index_out_of_range": (lambda t, g: write(t / "w.npz",
                                                  _set(arrays(g), "U.indices", arrays(g)["U.indices"] + 10_000)),
                               "out of range"),
    "csr_indptr_short": (lambda t, g: write(t / "w.npz", _set(arrays(g), "E.indptr", arrays(g)["E.indptr"][:-3])),
                         "indptr"),
    "matrix_format_missing": (lambda t, g: write(t / "w.npz", _drop(arrays(g), "experts.0.W_2.format")), "is missing"),
    "matrix_format_unknown": (lambda t, g: write(t / "w.npz", _set(arrays(g), "U.format", np.array("coo"))),
                              "must be the string 'csr' or 'csc'"),
    "matrix_format_not_text": (lambda t, g: write(t / "w.npz", _set(arrays(g), "U.format", np.array([1, 2]))),
                               "'U.format'"),
    "csc_read_as_csr": (lambda t, g: write(t / "w.npz", _set(arrays(g), "experts.0.W_2.format", np.array("csr"))),
                        "experts.0.W_2.indptr"),
    "negative_shape": (lambda t, g: write(t / "w.npz", _set(arrays(g), "P.shape", np.array([-6, 122]))),
                       "non-negative"),
    "nan_weight": (lambda t, g: write(t / "w.npz", _nan(arrays(g), "E.data")), "not a finite number"),
    "inf_bias": (lambda t, g: write(t / "w.npz", _inf(arrays(g), "b_G")), "not a finite number"),
    "vocabulary_lacks_a_token": (lambda t, g: write(t / "w.npz", _vocab_without(arrays(g), "Paris")), "lacks 1 token"),
    "vocabulary_repeats_a_token": (lambda t, g: write(t / "w.npz", _set(arrays(g), "vocab", np.array(["Asia"] * 23))),
                                   "repeated tokens"),
    "repeated_expert_tasks": (lambda t, g: write(t / "w.npz", _set(arrays(g), "expert_tasks",
                                                                   np.array(["capital", "capital", "located"]))),
                              "names task 'capital' for several experts"),
    "expert_tasks_too_short": (lambda t, g: write(t / "w.npz", _set(arrays(g), "expert_tasks", np.array(["capital"]))),
                               "expert_tasks has 1 entries"),
    "too_few_positions": (lambda t, g: write(t / "w.npz", _csr_replace(arrays(g), "P", np.ones((3, 122)))),
                          "positions"),
    "pickled_object_array": (lambda t, g: write(t / "w.npz",
                                                _set(arrays(g), "vocab", np.array([1, "a", None], dtype=object))),
                             "Python objects"),
}


def _zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("hello.txt", "not an array")
    return path


def test_enough_inputs():
    assert len(BAD_YAML) + len(WEIGHTS_CASES) >= 40 and len(WEIGHTS_CASES) >= 30


@pytest.mark.parametrize("case", sorted(WEIGHTS_CASES))
def test_bad_weights_file(case, tmp_path, good_npz, capsys):
    make, fragment = WEIGHTS_CASES[case]
    path = make(tmp_path, good_npz)
    line = one_line_exit_2(capsys, ["check", EXAMPLE, "--weights", path, "--quiet"])
    assert fragment in line, line
    assert os.fspath(path) in line or path.name in line, line


def test_the_good_weights_file_certifies(good_npz, capsys):
    assert main(["check", str(EXAMPLE), "--weights", str(good_npz), "--quiet"]) == 0
    capsys.readouterr()


def test_bad_weights_for_explain(tmp_path, good_npz, capsys):
    path = WEIGHTS_CASES["truncated"][0](tmp_path, good_npz)
    one_line_exit_2(capsys, ["explain", EXAMPLE, "the capital of France is", "--weights", path])


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "verifier", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


@pytest.mark.parametrize("args", [
    ("check", "tests/data/bad/alias_bomb.yaml"),
    ("check", "tests/data/bad/binary_junk.yaml"),
    ("check", "examples/capitals.yaml", "--weights", "tests/data/bad"),
    ("check", "examples/capitals.yaml", "--weights", "examples/capitals.yaml"),
])
def test_subprocess(args):
    out = run(*args)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("error: "), out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_subprocess_random_weights(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(np.random.default_rng(1).bytes(10_000))
    out = run("check", "examples/capitals.yaml", "--weights", junk)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


# --- nothing lost ---------------------------------------------------------------------------------


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_check_json_write_failure_keeps_the_old_report(tmp_path, capsys, monkeypatch):
    import cli.main as cli

    out = tmp_path / "report.json"
    out.write_text("previous report\n")
    real_fdopen = os.fdopen

    def failing_fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        real_write = f.write

        def write(text):
            real_write(text[: len(text) // 2])   # half of it reaches the temporary file, then the disk "fills"
            f.flush()
            raise OSError(28, "No space left on device")

        f.write = write
        return f

    monkeypatch.setattr(cli.os, "fdopen", failing_fdopen)
    code = main(["check", str(EXAMPLE), "--json", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "No space left" in err
    assert out.read_text() == "previous report\n"
    assert files(tmp_path) == ["report.json"]


def test_check_json_interrupted_keeps_the_old_report(tmp_path, capsys, monkeypatch):
    import cli.main as cli

    out = tmp_path / "report.json"
    out.write_text("previous report\n")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.os, "replace", interrupted)
    assert main(["check", str(EXAMPLE), "--json", str(out), "--quiet"]) == 130
    capsys.readouterr()
    assert out.read_text() == "previous report\n"
    assert files(tmp_path) == ["report.json"]


def test_build_write_failure_keeps_the_old_weights(tmp_path, capsys, monkeypatch):
    out = tmp_path / "model.npz"
    out.write_bytes(b"previous weights")
    real_savez = np.savez

    def failing_savez(f, **arrays):
        half = dict(list(arrays.items())[: len(arrays) // 2])
        real_savez(f, **half)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", failing_savez)
    code = main(["build", str(EXAMPLE), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == b"previous weights"
    assert files(tmp_path) == ["model.npz"]


def test_build_then_check_round_trip_writes_complete_files(tmp_path, capsys):
    out, rep = tmp_path / "m.npz", tmp_path / "r.json"
    assert main(["build", str(EXAMPLE), "-o", str(out)]) == 0
    assert main(["check", str(EXAMPLE), "--weights", str(out), "--json", str(rep), "--quiet"]) == 0
    capsys.readouterr()
    assert json.loads(rep.read_text())["verdict"] == "certified"
    assert files(tmp_path) == ["m.npz", "r.json"]


@pytest.fixture
def good_copy(tmp_path) -> Path:
    for p in GOOD.iterdir():
        shutil.copy(p, tmp_path / p.name)
    return tmp_path


def test_check_refuses_to_overwrite_the_tasks_file(good_copy, capsys):
    before = (good_copy / "tasks.yaml").read_bytes()
    line = one_line_exit_2(capsys, ["check", good_copy / "tasks.yaml", "--json", good_copy / "tasks.yaml", "--quiet"])
    assert "refusing to overwrite an input file" in line
    assert (good_copy / "tasks.yaml").read_bytes() == before


def test_check_refuses_to_overwrite_the_weights(tmp_path, good_npz, capsys):
    w = tmp_path / "w.npz"
    shutil.copy(good_npz, w)
    before = w.read_bytes()
    line = one_line_exit_2(capsys, ["check", EXAMPLE, "--weights", w, "--json", w, "--quiet"])
    assert "refusing to overwrite" in line and w.read_bytes() == before


def test_build_refuses_to_overwrite_the_tasks_file(good_copy, capsys):
    before = (good_copy / "tasks.yaml").read_bytes()
    one_line_exit_2(capsys, ["build", good_copy / "tasks.yaml", "-o", good_copy / "tasks.yaml"])
    assert (good_copy / "tasks.yaml").read_bytes() == before


@pytest.mark.parametrize("command", ["check", "build", "inspect"])
def test_refuses_to_overwrite_a_facts_file(good_copy, capsys, command):
    facts = good_copy / "places.csv"   # read by tasks.yaml (facts_file: places.csv)
    before = facts.read_bytes()
    flag = "-o" if command == "build" else "--json"
    code = main([command, str(good_copy / "tasks.yaml"), flag, str(facts)]
                + (["--quiet"] if command == "check" else []))
    capsys.readouterr()
    assert code == 2 and facts.read_bytes() == before


def test_version_1_files_are_still_read(good_npz, tmp_path, capsys):
    """Version 1 of the layout stored every matrix as CSR with no ``X.format`` member."""
    import scipy.sparse as sp

    a = arrays(good_npz)
    for key in [k for k in a if k.endswith(".format")]:
        name = key[: -len(".format")]
        m = (sp.csc_matrix if str(a[key]) == "csc" else sp.csr_matrix)(
            (a[f"{name}.data"], a[f"{name}.indices"], a[f"{name}.indptr"]), shape=tuple(a[f"{name}.shape"]))
        _drop(a, key)
        _csr_replace(a, name, m)
        _drop(a, key)
    path = write(tmp_path / "v1.npz", _meta(a, format="moe-knowledge-weights/1"))
    assert main(["check", str(EXAMPLE), "--weights", str(path), "--quiet"]) == 0
    capsys.readouterr()
    # a version-1 file that nevertheless stores a CSC matrix is read as CSR and refused
    b = arrays(good_npz)
    path = write(tmp_path / "v1-csc.npz", _meta(b, format="moe-knowledge-weights/1"))
    line = one_line_exit_2(capsys, ["check", EXAMPLE, "--weights", path, "--quiet"])
    assert "v1-csc.npz" in line


def test_a_csc_matrix_with_a_duplicate_is_refused(good_npz, tmp_path, capsys):
    a = arrays(good_npz)
    name = "experts.0.W_2"
    assert str(a[f"{name}.format"]) == "csc"
    idx = a[f"{name}.indices"].copy()
    ptr = a[f"{name}.indptr"]
    col = int(np.flatnonzero(np.diff(ptr) >= 2)[0])
    idx[ptr[col] + 1] = idx[ptr[col]]
    line = one_line_exit_2(capsys, ["check", EXAMPLE, "--weights",
                                    write(tmp_path / "w.npz", _set(a, f"{name}.indices", idx)),
                                    "--quiet"])
    assert "stored twice" in line and f"column {col}" in line, line


# --- a certificate directory: only a certificate (or nothing) is replaced ----------------------


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


@pytest.fixture
def no_check(monkeypatch):
    """A refusal comes before the check: running one fails the test."""
    import workflow.certificates
    import workflow.since

    def fail(*args, **kwargs):
        raise AssertionError("the check ran before the certificate directory was refused")
    monkeypatch.setattr(workflow.certificates, "check_and_record", fail)
    monkeypatch.setattr(workflow.since, "load_since", fail)


def test_a_directory_of_the_users_files_is_refused_before_the_check(tmp_path, capsys, monkeypatch, no_check):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("notes", encoding="utf-8")
    (work / "sub").mkdir()
    before = _tree(tmp_path)
    line = one_line_exit_2(capsys, ["check", EXAMPLE, "--certificate", work, "--quiet"])
    assert f"{work}: is not empty and not a certificate" in line and "'notes.txt'" in line
    monkeypatch.chdir(work)
    line = one_line_exit_2(capsys, ["check", EXAMPLE, "--certificate", ".", "--quiet"])
    assert "current directory" in line
    assert _tree(tmp_path) == before


def test_files_named_like_a_certificate_but_not_ones_are_refused(tmp_path, capsys, no_check):
    d = tmp_path / "d"
    d.mkdir()
    for name in ("certificate.json", "weights.npz", "tasks.npz", "classes.npz"):
        (d / name).write_text('{"format": "my-own-format/1"}', encoding="utf-8")
    before = _tree(tmp_path)
    assert "not a certificate" in one_line_exit_2(capsys, ["check", EXAMPLE, "--certificate", d, "--quiet"])
    (d / "certificate.json").unlink()                 # three of the four: not one either
    assert "not a certificate" in one_line_exit_2(capsys, ["check", EXAMPLE, "--certificate", d, "--quiet"])
    assert "parent directory does not exist" in one_line_exit_2(
        capsys, ["check", EXAMPLE, "--certificate", tmp_path / "no" / "cert", "--quiet"])
    assert _tree(tmp_path).keys() == before.keys() - {"d/certificate.json"}


def test_a_missing_an_empty_and_a_certificate_directory_are_written(tmp_path, capsys, monkeypatch):
    cert, empty = tmp_path / "cert", tmp_path / "empty"
    empty.mkdir()
    for d in (cert, empty, cert):                 # the third run replaces a certificate
        assert main(["check", str(EXAMPLE), "--certificate", str(d), "--quiet", "--no-isolation"]) == 0
        assert sorted(p.name for p in d.iterdir()) == ["certificate.json", "classes.npz", "tasks.npz", "weights.npz"]
    (cert / "notes.txt").write_text("notes", encoding="utf-8")
    capsys.readouterr()
    # --since from a certificate writes to --certificate OUT, refused as any other directory
    line = one_line_exit_2(capsys, ["check", EXAMPLE, "--since", empty, "--certificate", cert, "--quiet"])
    assert "not a certificate" in line and (cert / "notes.txt").read_text(encoding="utf-8") == "notes"
    # the current directory is refused even when it is a certificate: replacing it would
    # leave the process (and the shell it was started from) in a deleted directory
    monkeypatch.chdir(empty)
    assert "current directory" in one_line_exit_2(capsys, ["check", EXAMPLE, "--since", ".", "--quiet"])
    assert (empty / "certificate.json").is_file()


def test_the_save_looks_again_and_puts_back_a_directory_written_in_between(tmp_path, monkeypatch):
    """The directory is checked before the check and again at the save; one that changed after
    that second look (between the look and the move) is moved back untouched."""
    import verifier.certificates.certificate as vc
    from workflow.certificates import check_and_record
    from construction.model import build
    from tasks.errors import TaskError
    from tasks.io import load_tasks

    ts = load_tasks(EXAMPLE)
    _, cert = check_and_record(ts, build(ts), isolation=False)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("notes", encoding="utf-8")
    with pytest.raises(TaskError, match="not a certificate"):
        vc.save_certificate(cert, work)
    monkeypatch.setattr(vc, "require_replaceable", lambda directory: None)    # the file came after the look
    with pytest.raises(TaskError, match="changed while the certificate was saved"):
        vc.save_certificate(cert, work)
    assert _tree(tmp_path) == {"work": None, "work/notes.txt": b"notes"}
