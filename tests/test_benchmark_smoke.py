"""The scale benchmark runs at its smallest size (a smoke test: no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from repository import ROOT


def test_scale_benchmark_smallest_size(tmp_path):
    out = tmp_path / "results.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--sizes", "2000", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert "| 2,000 |" in text and "certified" in text and "Machine:" in text


def test_peer_benchmark_smallest_size():
    """The PyTorch peer runs and agrees with the verifier's enclosures on its sample."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer.py"), "--facts", "2000"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2, run.stdout
    assert all("0 expert disagreements, 0 errors outside the enclosure" in line for line in lines), run.stdout


def test_cluster_benchmark_smallest_size(tmp_path):
    """Local processes against a LocalCluster: same report (no timing asserted)."""
    import pytest

    pytest.importorskip("distributed")
    out = tmp_path / "results.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster.py"), "--sizes",
                          "2000", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert "| 2,000 |" in text and text.rstrip().count("| yes |") == 1 and "Machine:" in text


def test_precision_benchmark_smallest_set(tmp_path):
    """The float32 certificate, ONNX Runtime and PyTorch on the capitals example."""
    import pytest

    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    out = tmp_path / "results.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "precision.py"), "--sets",
                          "capitals", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert "| capitals | 13 | 67 |" in text and text.rstrip().count("| yes |") == 1 and "Machine:" in text


def test_shard_memory_benchmark_small(tmp_path):
    out = tmp_path / "results.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shard_memory.py"), "--facts",
                          "3000", "--shards", "3",
                          "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert "| whole model |" in text and "| shard 1 (" in text and "Compact shards: largest" in text


def test_watch_benchmark_smallest_size():
    """The watch benchmark at its smallest size, without the reference checks (no timing asserted)."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "watch.py"), "--facts", "2000", "--batch", "10",
                          "--no-reference", "--no-write"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("| incremental |") == 9 and "One-fact edits: median" in run.stdout


def test_accessible_benchmark_quick(tmp_path):
    """The accessibility command through its benchmark, token prompts of two tokens only."""
    out = tmp_path / "results.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accessible.py"), "--sets", "capitals",
                          "--extra", "--no-soft --token-m 2", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert "| capitals | 23 | 122 | 6 | 2 | 552 |" in text and "| 13/13 |" in text and "Machine:" in text


def test_evidence_benchmark_small(tmp_path):
    """The modularity-evidence benchmark on a small generated set (no timing asserted)."""
    out = tmp_path / "r.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "evidence.py"), "--facts", "20000", "--runs", "1",
                          "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    row = next(l for l in out.read_text().splitlines() if l.startswith("| 20,000"))
    tasks = int(row.split("|")[2])
    assert tasks > 1 and row.rstrip(" |").endswith(f"{tasks} of {tasks}")    # every expert isolated


def test_refusals_benchmark_small(tmp_path):
    """Each malformed file of the refusals benchmark refused at its last line (no timing asserted)."""
    out = tmp_path / "r.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "refusals.py"), "--facts", "1000", "--no-baseline",
                          "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [l for l in out.read_text().splitlines() if l.startswith("| ") and "|---" not in l][1:]
    assert len(rows) == 16 and "Machine:" in out.read_text()
    refused = [row.split(" | ")[2] for row in rows[1:-1]]
    assert all(r.startswith(("1005: ", "1006: ")) for r in refused), refused
    assert "alias '*x' is not supported" in refused[4] and rows[-1].split(" | ")[2] == "-"


def test_trained_benchmark_smallest_model(tmp_path):
    """The trained-models benchmark on the committed 1,000-fact model, one run: a row for the
    check and for each plain pass, over the same number of queries (no timing asserted)."""
    out = tmp_path / "t.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trained.py"), "--models", "F1000", "--runs", "1",
                          "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [l.split(" | ") for l in out.read_text().splitlines() if l.startswith("| F1000")]
    assert sorted(r[2] for r in rows) == ["PyTorch float64", "`check --weights`", "numpy float64"]
    assert len({r[1] for r in rows}) == 1 and int(rows[0][1].replace(",", "")) > 1000
