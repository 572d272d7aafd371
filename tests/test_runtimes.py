"""Runtimes nobody here wrote run the same weights and land inside the float certificates:
ONNX Runtime on the exported graph (float32), and the PyTorch model of ``training/``
loaded with hand-built weights (float32 and float64). Every batch of the bundled examples
and of a generated set; by default (tests/budget.py) a spread part of a large batch's rows,
every row in the full profile."""

from __future__ import annotations

import math

import numpy as np
import pytest
from budget import part

from construction.model import build
from tasks.io import load_tasks
from tasks.synthetic import wikidata_like
from verifier.passes.batches import batches
from verifier.passes.floating import Deployment
from verifier.passes.forward import FloatPass
from verifier.checks.verify import token_map

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

SETS = {
    "capitals": lambda: load_tasks("examples/capitals.yaml"),
    "geography": lambda: load_tasks("examples/geography/tasks.yaml"),
    "generated": lambda: wikidata_like(3000, n_tasks=6, seed=11),
}


@pytest.fixture(scope="module", params=list(SETS))
def model(request):
    ts = SETS[request.param]()
    return request.param, ts, build(ts).instantiate()


def _rows(b, share: int = 8):
    """Batch ``b``, or by default (tests/budget.py) a spread part of a large batch's rows
    (every ``share``-th, the first included), so that every batch, and with it every prefix
    length, is run: a runtime's dense pass over the geography example's 8432 coordinates
    takes minutes for all of its rows."""
    n = len(b)
    return b if n <= 512 else b.take(np.asarray(part(range(n), share), np.int64))


def _check(ts, weights, precision: str, run) -> tuple[int, float]:
    """Every query: the runtime's valid mass lies in the certificate's enclosure and its
    routed expert is the certified one. ``run(tokens) -> (probs, experts)``. Returns the
    number of queries and the smallest distance from an output to its enclosure's ends."""
    fp = FloatPass(weights, Deployment.named(precision))
    tmap = token_map(ts, weights)
    n, slack = 0, math.inf
    for b in map(_rows, batches(ts, chunk=4096)):
        tokens, vptr, valid = tmap[b.tokens], b.valid_ptr, tmap[b.valid]
        res = fp.run_batch(tokens, vptr, valid)
        probs, experts = run(tokens)
        assert np.all(res.margin > 0)                          # the bundled models route certifiably
        assert np.array_equal(experts, res.expert)
        for i in range(tokens.shape[0]):
            err = 1.0 - math.fsum(probs[i, valid[vptr[i]:vptr[i + 1]]].astype(np.float64))
            assert res.err_lo[i] <= err <= res.err_hi[i], (i, err, res.err_lo[i], res.err_hi[i])
            slack = min(slack, err - res.err_lo[i], res.err_hi[i] - err)
        n += tokens.shape[0]
    return n, slack


def test_onnx_runtime_lands_in_float32_enclosures(model, tmp_path):
    from layout.onnx_graph import save_onnx

    name, ts, weights = model
    path = tmp_path / f"{name}.onnx"
    save_onnx(weights, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(tokens):
        probs, expert, _ = session.run(None, {"tokens": tokens.astype(np.int64)})
        assert probs.dtype == np.float32
        return probs, expert

    n, slack = _check(ts, weights, "float32", run)
    assert n > 0 and slack >= 0


@pytest.mark.parametrize("precision", ["float32", "float64"])
@pytest.mark.parametrize("name", ["capitals", "generated-small"])
def test_torch_model_lands_in_enclosures(name, precision):
    """The torch model pads every head to the widest value map (the subject head's, one row
    per subject), so it runs on the smaller sets only; ONNX covers the rest."""
    torch = pytest.importorskip("torch")
    from training.export import from_weights

    ts = load_tasks("examples/capitals.yaml") if name == "capitals" else wikidata_like(600, n_tasks=4, seed=12)
    weights = build(ts).instantiate()
    dtype = {"float32": torch.float32, "float64": torch.float64}[precision]
    net = from_weights(weights, dtype)

    def run(tokens):
        n, p = tokens.shape
        ids = torch.from_numpy(np.concatenate([np.full((n, 1), weights.bos), tokens], axis=1).astype(np.int64))
        with torch.no_grad():
            out = net(ids, torch.full((n,), p, dtype=torch.int64))
            probs = torch.softmax(out.logits, dim=-1)
        assert probs.dtype == dtype
        return probs.numpy(), out.expert.numpy()

    n, slack = _check(ts, weights, precision, run)
    assert n > 0 and slack >= 0


def test_export_command_writes_a_graph_runtime_reads(tmp_path):
    from cli.main import main

    out = tmp_path / "capitals.onnx"
    assert main(["export", "examples/capitals.yaml", "--onnx", str(out), "--quiet"]) == 0
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["probs", "expert", "gate"]
    probs, expert, gate = session.run(None, {"tokens": np.zeros((2, 3), np.int64)})
    assert probs.shape == (2, 23) and expert.shape == (2,) and gate.shape == (2, 3)


def test_export_refuses_missing_directory(tmp_path, capsys):
    from cli.main import main

    assert main(["export", "examples/capitals.yaml", "--onnx", str(tmp_path / "no" / "m.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err
