"""What the certified pass keeps in memory while it runs.

At scale the symbolic model (sympy coefficients, labelled spaces) is a large part of a
process; ``check`` needs it for the construction's evidence only, so it must be gone by
the time the pass builds its tables and forks its workers, in the command users run as
in ``workflow.check.check_built``.
"""

from __future__ import annotations

import gc
import weakref

import workflow.check
from cli.main import main
from repository import ROOT


def test_check_releases_the_symbolic_model_before_the_pass(monkeypatch, capsys):
    import workflow.build as W

    built, seen = [], []
    build, verify = W.model, workflow.check.verify

    def building(*args, **kwargs):
        model = build(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    def spying(*args, **kwargs):
        gc.collect()
        seen.append([ref() is None for ref in built])
        return verify(*args, **kwargs)

    monkeypatch.setattr(W, "model", building)
    monkeypatch.setattr(workflow.check, "verify", spying)
    assert main(["check", str(ROOT / "examples" / "capitals.yaml"), "--quiet"]) == 0
    assert "CERTIFIED" in capsys.readouterr().out
    assert seen == [[True]]


def test_the_pass_holds_no_weights_once_its_tables_are_built(monkeypatch, capsys, tmp_path):
    """``check`` and ``check --weights`` hand the weights over: during the pass only its
    tables (and the weights' frame) are alive, not the weights this command made."""
    import layout
    import verifier.checks.verify as V
    from construction.model import SymbolicModel

    made, seen = [], []
    tallied, load, instantiate = V._tallied, layout.load, SymbolicModel.instantiate

    def loading(*args, **kwargs):
        w = load(*args, **kwargs)
        made.append(weakref.ref(w))
        return w

    def instantiating(self, *args, **kwargs):
        w = instantiate(self, *args, **kwargs)
        made.append(weakref.ref(w))
        return w

    def spying(shared, batch):
        gc.collect()
        seen.append([ref() is None for ref in made])
        return tallied(shared, batch)

    monkeypatch.setattr(layout, "load", loading)
    monkeypatch.setattr(SymbolicModel, "instantiate", instantiating)
    monkeypatch.setattr(V, "_tallied", spying)
    example = ROOT / "examples" / "capitals.yaml"
    assert main(["check", str(example), "--quiet"]) == 0
    assert len(made) == 1 and seen and all(s == [True] for s in seen)
    npz = tmp_path / "w.npz"
    assert main(["build", str(example), "-o", str(npz), "--quiet"]) == 0
    made.clear()
    seen.clear()
    assert main(["check", str(example), "--weights", str(npz), "--quiet"]) == 0
    assert len(made) == 1 and seen and all(s == [True] for s in seen)
    assert "CERTIFIED" in capsys.readouterr().out


def _rss_after_free(call: bool) -> tuple[int, int]:
    """In a fresh interpreter: (RSS growth while a 4 MB array lives, RSS growth once it is
    freed). glibc is first told to keep blocks up to 64 MB in its heap and never to trim it
    (the state its own dynamic threshold reaches after large arrays are freed, set here
    explicitly so the control does not depend on the process's history); ``call`` then
    calls map_large_allocations()."""
    import json
    import subprocess
    import sys

    code = f"""
import ctypes, json, numpy as np
from verifier.running.parallel import map_large_allocations
libc = ctypes.CDLL(None)
libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
assert libc.mallopt(-3, 64 << 20) == 1     # M_MMAP_THRESHOLD
assert libc.mallopt(-1, 1 << 30) == 1      # M_TRIM_THRESHOLD
if {call}:
    map_large_allocations()
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
base = rss()
b = np.ones(1 << 19)                 # 4 MB
guard = np.ones(1 << 10)             # 8 KB after it, so the heap's top is not the 4 MB
live = rss() - base
del b
print(json.dumps([live, rss() - base]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return tuple(json.loads(out.stdout))


def test_large_allocations_go_back_to_the_system_when_freed():
    """After map_large_allocations() a freed 4 MB array leaves the process's resident
    memory; in the control (glibc keeping large blocks in its heap) it stays, so the test
    fails if the call stops doing anything."""
    import ctypes
    import sys

    import pytest

    if not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("glibc's mallopt only")
    live, kept = _rss_after_free(call=False)
    assert live >= 3 << 20
    if kept < 3 << 20:
        pytest.skip("this system's resident size does not show a heap's freed pages")
    live, kept = _rss_after_free(call=True)
    assert live >= 3 << 20 and kept < 1 << 20


def test_map_large_allocations_sets_glibcs_mapping_threshold(monkeypatch):
    """The call itself, independent of how a system reports resident memory: one
    mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)."""
    import ctypes

    import verifier.running.parallel as parallel

    calls = []

    def mallopt(option, value):
        calls.append((option, value))
        return 1

    class Libc:
        pass

    libc = Libc()
    libc.mallopt = mallopt
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    parallel.map_large_allocations()
    assert calls == [(-3, parallel.MAPPED_FROM)] and parallel.M_MMAP_THRESHOLD == -3


def test_check_maps_large_allocations_only_when_it_forks(monkeypatch, capsys):
    import verifier.running.parallel as parallel

    calls = []
    monkeypatch.setattr(parallel, "map_large_allocations", lambda: calls.append(1))
    example = str(ROOT / "examples" / "capitals.yaml")
    assert main(["check", example, "--quiet", "--no-isolation"]) == 0
    assert calls == []
    assert main(["check", example, "--quiet", "--no-isolation", "--jobs", "2"]) == 0
    assert calls == [1]
    capsys.readouterr()


def test_a_frame_keeps_the_sizes_and_refuses_the_entries(capitals_model):
    """Weights.frame: what a pass reads after building its tables (sizes, BOS, the gate's
    biases, each expert's width) is there; a matrix's entries are not, and asking for them
    raises instead of giving an empty matrix."""
    import numpy as np
    import pytest

    w = capitals_model.instantiate()
    f = w.frame()
    assert (f.d, f.bos, f.n_positions, f.gate_mode, f.vocab) == (w.d, w.bos, w.n_positions, w.gate_mode, w.vocab)
    assert [e.width for e in f.experts] == [e.width for e in w.experts] and np.array_equal(f.b_G, w.b_G)
    assert f.E.shape == w.E.shape and f.E.nnz == w.E.nnz and f.U.shape == w.U.shape
    for get in (lambda: f.E.data, lambda: f.U.toarray(), lambda: f.experts[0].W_2.indices, lambda: f.heads[0].W_Q.T):
        with pytest.raises(AttributeError, match="released"):
            get()
    with pytest.raises(TypeError):
        np.asarray(f.W_G)
