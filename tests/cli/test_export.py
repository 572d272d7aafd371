"""``export --onnx`` writes the certified model: the weights ``check --precision float32`` builds
and certifies (the same rebuild rule), or those of a certificate, or given weights that fit the
task set; the graph's metadata names them by digest, as ``check``'s report does."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from cli.main import main
from construction.model import build
from layout.digest import weights_digest
from tasks.io import load_tasks

onnx = pytest.importorskip("onnx")

CAPITALS = "examples/capitals.yaml"


def _meta(path) -> dict:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def _report(args, tmp_path, name) -> dict:
    out = tmp_path / f"{name}.json"
    main(["check", *args, "--json", str(out), "--quiet"])
    return json.loads(out.read_text())


def test_export_writes_the_model_the_float32_check_certifies(tmp_path):
    """At β = 16 and ε just above the closed form, the default model certifies exactly but not in
    float32, and check --precision float32 rebuilds it for a tighter target: export must write that
    rebuilt model, not the default (an outside review found the two commands building different models)."""
    ts = load_tasks(CAPITALS)
    eps = repr(build(ts, beta=16).bound_value() * (1 + 1e-7))
    flags = [CAPITALS, "--beta", "16", "--epsilon", eps]
    f32 = _report([*flags, "--precision", "float32"], tmp_path, "f32")
    exact = _report(flags, tmp_path, "exact")
    assert f32["certified"] and any("built for float32" in n for n in f32["notes"])
    assert f32["weights_sha256"] != exact["weights_sha256"]
    out = tmp_path / "m.onnx"
    assert main(["export", *flags, "--onnx", str(out), "--quiet"]) == 0
    meta = _meta(out)
    assert meta["weights_sha256"] == f32["weights_sha256"] and meta["precision"] == "float32"
    assert float(meta["epsilon"]) == float(eps)
    # the graph holds those weights, rounded to float32 (read back independently of the exporter)
    npz = tmp_path / "m.npz"
    assert main(["build", *flags, "--precision", "float32", "-o", str(npz), "--quiet"]) == 0
    import layout

    w = layout.load(str(npz))
    assert weights_digest(w) == meta["weights_sha256"]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    assert np.array_equal(inits["E"], w.E.toarray().astype(np.float32))
    assert np.array_equal(inits["U_T"], w.U.toarray().astype(np.float32).T)
    # and --precision exact writes the model plain check certifies
    out2 = tmp_path / "e.onnx"
    assert main(["export", *flags, "--precision", "exact", "--onnx", str(out2), "--quiet"]) == 0
    assert _meta(out2)["weights_sha256"] == exact["weights_sha256"]


def test_export_refuses_weights_of_another_task_set(tmp_path, capsys):
    other = tmp_path / "located.npz"
    assert main(["build", "examples/located.yaml", "-o", str(other), "--quiet"]) == 0
    out = tmp_path / "m.onnx"
    assert main(["export", CAPITALS, "--weights", str(other), "--onnx", str(out)]) == 2
    err = capsys.readouterr().err
    assert "lacks" in err and err.count("\n") == 1 and not out.exists()
    assert main(["check", CAPITALS, "--weights", str(other)]) == 2        # as check refuses them


def test_export_of_given_weights_names_them(tmp_path):
    npz, out = tmp_path / "w.npz", tmp_path / "m.onnx"
    assert main(["build", CAPITALS, "-o", str(npz), "--quiet"]) == 0
    assert main(["export", CAPITALS, "--weights", str(npz), "--onnx", str(out), "--quiet"]) == 0
    meta = _meta(out)
    assert meta["weights_sha256"] == _report([CAPITALS, "--weights", str(npz)], tmp_path, "w")["weights_sha256"]
    assert meta["precision"] == "" and "not checked here" in meta["certified"]


def test_export_from_a_certificate(tmp_path, capsys):
    tasks = tmp_path / "capitals.yaml"
    shutil.copy(CAPITALS, tasks)
    cert, out = tmp_path / "cert", tmp_path / "m.onnx"
    rep = _report([str(tasks), "--certificate", str(cert)], tmp_path, "c")
    assert main(["export", str(tasks), "--certificate", str(cert), "--onnx", str(out), "--quiet"]) == 0
    meta = _meta(out)
    assert meta["weights_sha256"] == rep["weights_sha256"] and meta["precision"] == "exact"
    # an edit since the certificate: its weights are not the task set's certified model any more
    assert main(["edit", str(tasks), "capital", "--set", "France=Lyon", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["export", str(tasks), "--certificate", str(cert), "--onnx", str(tmp_path / "n.onnx")]) == 2
    assert "another version of this task set" in capsys.readouterr().err
    # choosing how to build and exporting given weights exclude each other
    assert main(["export", str(tasks), "--certificate", str(cert), "--precision", "exact", "--onnx", str(out)]) == 2
