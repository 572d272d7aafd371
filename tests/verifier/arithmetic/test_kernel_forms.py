"""The kernels' two forms (verifier.arithmetic.kernel_forms): ahead of time and just in time.

The ahead-of-time form runs only calls whose arguments match a kernel's declared types,
exactly as numba types them; it returns bitwise what the JIT form returns; a whole check
runs without importing numba; and every way of not having the extension (told not to, a
build that fails, a file that does not load, a probe that fails) runs just in time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numba  # noqa: F401 - imported once here, before any test sets a cache directory
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from construction.layers import build_two_layers
from tasks import loads_tasks
from verifier.arithmetic import kernel_forms, logits, rounding
from verifier.arithmetic.kernel_forms import KERNELS, Kernel, Kernels, matches, numba_type
from repository import ROOT
from verifier.checks.layers import verify_layers


# -- the declared types, against numba's own typing -------------------------------------

class Sub(np.ndarray):
    pass


DTYPES = [np.int32, np.int64, np.float64, np.bool_, np.float32, np.int16, np.uint64, np.dtype(">f8")]
SPECS = ["i64[1]", "i64[2]", "f64[1]", "f64[3]", "bool[1]", "i32[2]", "i64", "f64", "bool",
         ("i64[1]", "f64[1]"), ("i64", ("f64[2]", "bool"))]


@st.composite
def near(draw, spec, change=None):
    """A value of the declared type ``spec``, or (``change`` true, or drawn so half the
    time) one that differs from it in one respect: dtype, byte order, dimensions, layout,
    writability, subclass, scalar type or range, tuple length or kind."""
    change = draw(st.booleans()) if change is None else change
    if isinstance(spec, tuple):
        how = draw(st.sampled_from(["item", "drop", "add", "list"])) if change else None
        where = draw(st.integers(0, len(spec) - 1))
        items = [draw(near(s, how == "item" and i == where)) for i, s in enumerate(spec)]
        if how == "drop":
            items.pop()
        elif how == "add":
            items.append(np.zeros(1))
        return items if how == "list" else tuple(items)
    m = kernel_forms._ARRAY.match(spec)
    if m is None:
        good = {"i64": [0, -(2 ** 63), 2 ** 63 - 1, np.int64(3)], "f64": [1.5, np.float64(2.0)],
                "bool": [True, np.bool_(False)]}[spec]
        other = [2 ** 63, -(2 ** 63) - 1, 2 ** 70, 1.5, 1, True, np.int32(3), np.float32(2.0), np.uint64(1), None, "x"]
        return draw(st.sampled_from(other if change else good))
    dtype, ndim = kernel_forms._DTYPES[m.group(1)], int(m.group(2))
    how = draw(st.sampled_from(["dtype", "ndim", "F", "strided", "readonly", "subclass"])) if change else None
    if how == "dtype":
        dtype = draw(st.sampled_from(DTYPES))
    if how == "ndim":
        ndim = draw(st.integers(1, 3))
    a = np.zeros((3,) * ndim, dtype)
    if how in ("F", "strided"):
        a = np.zeros((3,) * ndim + (2,), dtype)[..., 0]
        a = np.asfortranarray(a) if how == "F" else a
    if how == "readonly":
        a.flags.writeable = False
    return a.view(Sub) if how == "subclass" else a


def _numba_accepts(spec, value) -> bool:
    """Whether numba types ``value`` as exactly ``numba_type(spec)`` (the oracle)."""
    from numba import typeof
    try:
        t = typeof(value)
    except Exception:                                    # noqa: BLE001 - numba cannot type it at all
        return False
    return t == numba_type(spec)


@settings(max_examples=examples(600), deadline=None)
@given(data=st.data())
def test_a_call_fits_a_declared_type_exactly_when_numba_types_it_so(data):
    spec = data.draw(st.sampled_from(SPECS))
    value = data.draw(near(spec))
    # numba also types an ndarray subclass as an array; the extension is never given one
    assert matches(spec, value) == (_numba_accepts(spec, value) and not _subclassed(value))


def _subclassed(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(map(_subclassed, value))
    return isinstance(value, np.ndarray) and type(value) is not np.ndarray


def test_the_declared_types_reject_what_the_extension_would_misread():
    a = np.arange(6, dtype=np.int64)
    assert matches("i64[1]", a)
    for bad in (a.astype(np.int32), a.astype(np.float64), a[::2], a.reshape(2, 3), a.view(Sub)):
        assert not matches("i64[1]", bad)
    ro = a.copy()
    ro.flags.writeable = False
    assert not matches("i64[1]", ro)
    assert not matches("i64", True) and not matches("i64", 2 ** 63) and not matches("i64", 1.0)
    assert matches("i64", -(2 ** 63)) and matches("i64", np.int64(5))
    assert not matches("f64", 1) and not matches("bool", 1)
    assert not matches(("i64[1]",), [a]) and not matches(("i64[1]",), (a, a))


def test_every_exported_kernel_declares_types_numba_can_build():
    exported = KERNELS.exported()
    names = {k.export_name for k in exported}
    assert {"rounding___probe", "rounding__up", "experts__experts", "experts__experts_parts", "logits__ablated_parts",
            "residual__residual_part", "gate__gate"} <= names
    for k in exported:
        numba_type(k.returns)(*[numba_type(a) for a in k.args])


def test_every_module_with_kernels_is_in_the_key():
    """The extension's key hashes the sources of MODULES: a kernel defined in any other module
    would be compiled into the extension without its source in the key (a changed file would
    load a stale extension)."""
    KERNELS.exported()
    assert {k.__module__ for k in KERNELS.kernels} <= set(kernel_forms.MODULES)
    defining = {f"verifier.arithmetic.{p.stem}" for p in (ROOT / "verifier" / "arithmetic").glob("*.py")
                if re.search(r"^@kernel\(", p.read_text(encoding="utf-8"), re.M)}
    assert defining == set(kernel_forms.MODULES)


# -- the same numbers in both forms --------------------------------------------------------

def _bits(x):
    if isinstance(x, tuple):
        return tuple(_bits(v) for v in x)
    a = np.asarray(x)
    return (a.dtype.str, a.shape, a.tobytes())


_TWO_HOPS = """tasks:
  - name: born_in
    templates: [⋆1 was born in ⋆2]
    facts: {Curie: Poland, Einstein: Germany, Bohr: Denmark}
  - name: capital
    templates: [the capital of ⋆1 is ⋆2]
    facts: {Poland: Warsaw, Germany: Berlin, Denmark: Copenhagen}
  - name: born_capital
    templates: [the capital of the country where ⋆1 was born is ⋆2]
    compose: [born_in, capital]
"""


def test_both_forms_return_bitwise_the_same_for_every_call_of_a_check(monkeypatch, capitals_set, capitals_model):
    """Every exported kernel call of certifying capitals (exact, and deployed in float32 and
    bfloat16, gate modes top1 and top1-scaled) is run in both forms on copies of its
    arguments (kernels write into their scratch): the results are the same bits, and so
    are the arguments afterwards."""
    import copy

    from verifier.checks.verify import verify
    from verifier.passes.floating import Deployment
    from verifier.running.parallel import LocalPool

    rounding.check()
    if KERNELS.module is False:
        pytest.skip(f"no compiled extension in this process: {KERNELS.note}")
    seen = {}
    original = Kernel.__call__

    def both(self, *args):
        if self.args is not None and all(map(matches, self.args, args)):
            a1, a2 = copy.deepcopy(args), copy.deepcopy(args)
            r1, r2 = self._aot(*a1), self.jit(*a2)
            assert _bits(r1) == _bits(r2), self.__name__
            assert _bits(a1) == _bits(a2), self.__name__
            seen[self.__name__] = seen.get(self.__name__, 0) + 1
        return original(self, *args)

    monkeypatch.setattr(Kernel, "__call__", both)
    w = capitals_model.instantiate()
    for weights in (w, w.replace(gate_mode="top1-scaled")):
        for dep in (None, Deployment.named("float32"), Deployment.named("bfloat16")):
            verify(capitals_set, weights, capitals_model.epsilon, executor=LocalPool(1), deployment=dep)
    two = loads_tasks(_TWO_HOPS)                        # and the two-layer pass's kernels
    verify_layers(two, build_two_layers(two).instantiate(), 0.01)
    assert set(seen) >= {"residual", "gate", "experts", "ablated", "logits", "logits_bound", "residual_part",
                         "gate_parts", "experts_parts", "ablated_parts", "layer_rows", "layer_rows_parts",
                         "parts_sum"}


def test_a_call_that_does_not_fit_runs_just_in_time():
    rounding.check()
    rows = np.array([0, 2, 3], np.int64)
    idx = np.array([0, 1, 1], np.int64)
    ut = np.array([0, 1, 3], np.int64)
    expected = logits.logits_bound(rows, idx, ut)
    k = logits.logits_bound
    saved = k._aot

    def refuse(*args):
        raise AssertionError("the extension was given arguments of other types")

    k._aot = refuse if saved is not False else False
    try:
        got = k(rows.astype(np.int32), idx, ut)            # int32: numba compiles another signature
        strided = k(np.array([0, 9, 2, 9, 3], np.int64)[::2], idx, ut)
    finally:
        k._aot = saved
    assert np.array_equal(got, expected) and np.array_equal(strided, expected)


# -- running without numba -------------------------------------------------------------------

_NO_NUMBA = """
import sys
from construction.model import build
from tasks.io import load_tasks
from verifier.arithmetic.kernel_forms import KERNELS
from verifier.checks.verify import verify
from verifier.passes.floating import Deployment
from verifier.running.parallel import LocalPool
from workflow.warming import warm_up
for dep in (None, Deployment.named("float32")):
    warm_up(dep)
ts = load_tasks(sys.argv[1])
model = build(ts)
w = model.instantiate()
for weights in (w, w.replace(gate_mode="top1-scaled")):
    verify(ts, weights, model.epsilon, executor=LocalPool(1))
from construction.layers import build_two_layers
from verifier.checks.layers import verify_layers
two = load_tasks(sys.argv[2])
verify_layers(two, build_two_layers(two).instantiate(), 0.01)
print(KERNELS.module is not False, KERNELS.note, "numba" in sys.modules)
"""


def test_a_check_runs_every_kernel_ahead_of_time_without_numba():
    out = subprocess.run([sys.executable, "-c", _NO_NUMBA, str(ROOT / "examples" / "capitals.yaml"),
                          str(ROOT / "examples" / "two-hops.yaml")], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    if out[0] == "False":
        pytest.skip(f"no compiled extension here: {' '.join(out[1:-1])}")
    assert out[-1] == "False"                           # no call fell back: numba was never imported


def test_moe_kernels_jit_runs_just_in_time_and_reports_the_same(tmp_path):
    env_jit = {"MOE_KERNELS": "jit"}
    reports = []
    for env in ({}, env_jit):
        out = tmp_path / f"r{len(reports)}.json"
        subprocess.run([sys.executable, "-m", "verifier", "check", "examples/capitals.yaml", "--precision", "float32",
                        "--json", str(out), "--quiet"], cwd=ROOT, check=True, capture_output=True,
                       env={**_environ(), **env})
        r = json.loads(out.read_text())
        for key in ("seconds", "verify_seconds", "time", "phases"):
            r.pop(key, None)
        reports.append(r)
    assert reports[0] == reports[1]


def _environ():
    import os
    return dict(os.environ)


# -- every way of having no extension ------------------------------------------------------

def _fresh(monkeypatch, tmp_path) -> Kernels:
    """A registry of the real kernels' functions (probed as rounding.py probes its own), with
    its own directory for the extension (every kernel module imported first, whichever test runs alone)."""
    KERNELS.exported()
    reg = Kernels(dirs=[tmp_path])
    by_name = {k.__name__: Kernel(k.py_func, reg, k.options, k.args, k.returns) for k in KERNELS.kernels}
    reg.add_probe(lambda form: rounding._ieee(lambda k: form(by_name[k.__name__])))
    monkeypatch.setattr(reg, "exported", lambda: [k for k in reg.kernels if k.args is not None])
    return reg


def _probe_of(reg: Kernels) -> Kernel:
    return next(k for k in reg.kernels if k.__name__ == "_probe")


def test_a_build_that_fails_leaves_a_note_and_runs_just_in_time(monkeypatch, tmp_path):
    reg = _fresh(monkeypatch, tmp_path)
    calls = []

    def failing(name, directory, kernels_):
        calls.append(name)
        raise RuntimeError("no C compiler\nlinker said: cc not found")

    monkeypatch.setattr(kernel_forms, "build", failing)
    assert _probe_of(reg)(1.0, 2.0) == (2.0, 3.0)
    assert reg.module is False and "cc not found" in reg.note and len(calls) == 1
    failed = list(tmp_path.glob("moe_kernels_*.failed"))
    assert len(failed) == 1 and "cc not found" in failed[0].read_text()
    again = _fresh(monkeypatch, tmp_path)                # a later process reads the note, builds nothing
    assert _probe_of(again)(1.0, 2.0) == (2.0, 3.0) and len(calls) == 1 and again.module is False


def test_an_extension_that_does_not_load_runs_just_in_time(monkeypatch, tmp_path):
    reg = _fresh(monkeypatch, tmp_path)
    name = kernel_forms.PREFIX + reg.key()
    (tmp_path / (name + kernel_forms.extension_suffix())).write_bytes(b"not a shared object")
    monkeypatch.setattr(kernel_forms, "build", lambda *a: pytest.fail("built over an existing file"))
    assert _probe_of(reg)(3.0, 4.0) == (12.0, 7.0)
    assert reg.module is False and "could not be loaded" in reg.note


def test_told_to_run_just_in_time_it_builds_and_loads_nothing(monkeypatch, tmp_path):
    reg = _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("MOE_KERNELS", "jit")
    monkeypatch.setattr(kernel_forms, "build", lambda *a: pytest.fail("built although told not to"))
    assert _probe_of(reg)(1.0, 1.0) == (1.0, 2.0)
    assert reg.module is False and list(tmp_path.glob("moe_kernels_*")) == []


def test_a_form_that_fails_its_probe_is_not_used(monkeypatch, tmp_path):
    """A probe that fails drops the extension (its kernels then run just in time), and a JIT
    form that fails it raises instead of computing; rounding.check refuses such a form too."""
    reg = _fresh(monkeypatch, tmp_path)

    monkeypatch.setattr(reg, "_load", lambda: _ExtensionStandIn(step=lambda x: x))   # not an upward step
    assert _probe_of(reg)(1.0, 1.0) == (1.0, 2.0)        # ran just in time
    assert reg.module is False and "probe" in reg.note

    jit = _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("MOE_KERNELS", "jit")
    jit.probes[:] = [lambda form: (_ for _ in ()).throw(RuntimeError("not round to nearest"))]
    with pytest.raises(RuntimeError, match="round to nearest"):
        _probe_of(jit)(1.0, 1.0)
    with pytest.raises(RuntimeError, match="round to nearest"):  # and again: never trusted half-way
        _probe_of(jit)(1.0, 1.0)
    with pytest.raises(RuntimeError, match="IEEE"):
        rounding._ieee(lambda k: (lambda *a: (0.0, 0.0)) if k is rounding._probe else (lambda x: x))


def test_the_key_is_of_the_sources_as_imported(monkeypatch, tmp_path):
    """Each module compiled (and each whose values it freezes in) changes the key; a file
    changed after the import does not: the key names the code the process runs."""
    reg = _fresh(monkeypatch, tmp_path)
    key = reg.key()
    assert key is not None and set(reg.sources) >= {*kernel_forms.MODULES, *kernel_forms.DEPENDS}
    real = kernel_forms._source_bytes
    for name in (*kernel_forms.MODULES, *kernel_forms.DEPENDS):
        monkeypatch.setattr(kernel_forms, "_source_bytes",
                            lambda n, _name=name: real(n) + (b"#" if n == _name else b""))
        assert reg.key() == key                           # the process's own code: unchanged
        assert _fresh(monkeypatch, tmp_path).key() != key, name   # a process importing the changed file
    monkeypatch.setattr(kernel_forms, "_source_bytes", lambda n: None)
    assert _fresh(monkeypatch, tmp_path).key() is None


def test_the_jit_form_caches_in_the_keys_directory(monkeypatch, tmp_path):
    """numba validates a cached function by its own file only; a directory per key keeps a
    kernel compiled against other versions of its helpers out of use."""
    reg = _fresh(monkeypatch, tmp_path)
    probe = _probe_of(reg)
    assert Path(probe.jit._cache._cache_path).is_relative_to(tmp_path / f"numba-{reg.key()}")


def test_no_extension_is_used_before_its_probe_passed(monkeypatch, tmp_path):
    reg = _fresh(monkeypatch, tmp_path)
    module = _ExtensionStandIn(step=lambda x: x)          # fails the probe
    seen = []
    reg.probes.insert(0, lambda form: seen.append([k._aot for k in reg.kernels if k.args is not None]))
    monkeypatch.setattr(reg, "_load", lambda: module)
    _probe_of(reg)(1.0, 1.0)
    assert seen and all(a is None for a in seen[0])


class _ExtensionStandIn:
    """An extension module's stand-in: every kernel a no-op but ``_probe`` and ``up``."""

    def __init__(self, step):
        self.rounding__up = step
        self.rounding___probe = lambda a, b: (a * b, a + b)

    def __getattr__(self, name):
        return lambda *a: None


def test_the_machines_troubles_run_just_in_time_without_a_traceback(monkeypatch, tmp_path):
    """No locks on the file system, no home directory, a full disk during the build, any
    other error while loading: the kernels run just in time, and only a failure of the
    build itself leaves a note."""
    import fcntl

    reg = _fresh(monkeypatch, tmp_path)
    monkeypatch.setattr(fcntl, "flock", lambda *a: (_ for _ in ()).throw(OSError(37, "No locks available")))
    assert _probe_of(reg)(1.0, 2.0) == (2.0, 3.0) and reg.module is False and "no writable" in reg.note
    monkeypatch.undo()

    reg = _fresh(monkeypatch, tmp_path)
    monkeypatch.setattr(kernel_forms, "build", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    assert _probe_of(reg)(1.0, 2.0) == (2.0, 3.0) and "No space" in reg.note
    assert list(tmp_path.glob("*.failed")) == []

    reg = _fresh(monkeypatch, tmp_path)
    monkeypatch.setattr(reg, "_load", lambda: {}["unexpected"])
    assert _probe_of(reg)(1.0, 2.0) == (2.0, 3.0) and "KeyError" in reg.note

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    assert kernel_forms.cache_dirs() == [Path(kernel_forms.__file__).resolve().parent / "__pycache__"]


def test_an_exported_kernel_takes_no_numba_options():
    with pytest.raises(TypeError, match="options"):
        kernel_forms.kernel(args=("f64",), returns="f64", inline="always")
    with pytest.raises(TypeError, match="options"):
        kernel_forms.kernel(args=("f64",), returns="f64", borrows=True)


def test_a_borrowing_kernel_can_neither_make_nor_return_an_array(monkeypatch, tmp_path):
    """A helper compiled without reference counting (``borrows=True``) must not hand its
    caller an array (the caller would release a reference it was never given): its dispatcher
    refuses to compile such a signature, called from Python or from compiled code; making an
    array there does not compile either. One that reads and writes its arrays compiles."""
    monkeypatch.setenv("MOE_KERNELS", "jit")
    reg = Kernels(dirs=[tmp_path])

    def returns(a):
        return a

    def returns_in_a_tuple(a):
        return 1.0, a[:1]

    def makes(n):
        return np.empty(n).size

    def writes(a, v):
        a[0] = v
        return a.size

    for f, args in ((returns, (np.ones(3),)), (returns_in_a_tuple, (np.ones(3),)), (makes, (3,))):
        k = Kernel(f, reg, {"_nrt": False})
        with pytest.raises(Exception, match="borrows|empty"):
            k(*args)
    k = Kernel(writes, reg, {"_nrt": False})
    a = np.zeros(2)
    assert k(a, 2.5) == 2 and a[0] == 2.5
    borrower = Kernel(returns, reg, {"_nrt": False})

    def calls(a):
        return borrower(a).size
    with pytest.raises(Exception, match="borrows"):
        Kernel(calls, reg, {})(np.ones(3))


# -- another process's build: waiting for it, and what a killed one leaves -------------------

_STUCK_BUILDER = """
import sys, time
from pathlib import Path
import numba.pycc
from verifier.arithmetic import kernel_forms

class Stuck:
    '''numba's CC, stuck in its compile: makes its temporary directories as numba's does, then waits.'''
    def __init__(self, name):
        pass
    def export(self, name, signature):
        return lambda f: f
    def compile(self):
        from numba.pycc import cc, platform
        made = [cc.tempfile.mkdtemp(prefix="pycc-build-stuck-"), platform.mkdtemp()]
        print(*made, flush=True)
        time.sleep(3600)

numba.pycc.CC = Stuck
directory, name = Path(sys.argv[1]), sys.argv[2]
with kernel_forms._Lock(directory / (name + ".lock"), 0):
    kernel_forms.build(name, directory, [])
"""


class _StuckBuilder:
    """Another process building the extension ``name`` in ``directory``, holding the lock,
    stopped mid-build until killed (``made``: numba's temporary directories of its build).
    A watchdog kills it after a while, so a waiter that never gives up fails instead of hanging."""

    def __init__(self, directory: Path, name: str) -> None:
        import threading
        self.proc = subprocess.Popen([sys.executable, "-c", _STUCK_BUILDER, str(directory), name], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.made = [Path(p) for p in self.proc.stdout.readline().split()]
        assert self.made, self.proc.stderr.read()
        self.watchdog = threading.Timer(120, self.kill)
        self.watchdog.start()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()

    def __enter__(self) -> "_StuckBuilder":
        return self

    def __exit__(self, *exc) -> None:
        self.watchdog.cancel()
        self.kill()


def test_a_process_waiting_on_a_stuck_build_gives_up_with_one_line_and_runs_just_in_time(monkeypatch, tmp_path,
                                                                                          capsys):
    reg = _fresh(monkeypatch, tmp_path)
    name = kernel_forms.PREFIX + reg.key()
    monkeypatch.setenv("MOE_KERNELS_LOCK_TIMEOUT", "0.5")
    monkeypatch.setattr(kernel_forms, "build", lambda *a: pytest.fail("built while another process held the lock"))
    rows, idx, ut = np.array([0, 2, 3], np.int64), np.array([0, 1, 1], np.int64), np.array([0, 1, 3], np.int64)
    by_name = {k.__name__: k for k in reg.kernels}
    with _StuckBuilder(tmp_path, name) as holder:
        capsys.readouterr()
        assert _probe_of(reg)(1.0, 2.0) == (2.0, 3.0)
        assert np.array_equal(by_name["logits_bound"](rows, idx, ut), logits.logits_bound(rows, idx, ut))
        lines = capsys.readouterr().err.splitlines()
        assert reg.module is False and reg.jit_state == "ok"         # ran just in time
        assert len(lines) == 1, lines
        assert str(tmp_path / (name + ".lock")) in lines[0] and f"held by process {holder.proc.pid} " in lines[0]
        assert "just in time" in lines[0] and "MOE_KERNELS_LOCK_TIMEOUT" in lines[0]
        assert f"process {holder.proc.pid}" in reg.note
        # numba's own temporaries of the build are in the build's directory, not the system's
        builds = [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]
        assert len(builds) == 1 and builds[0].name.startswith(kernel_forms.build_prefix(name))
        assert all(p.parent == builds[0] for p in holder.made)
    assert list(tmp_path.glob("*.failed")) == []                    # the next process tries again


def test_a_killed_builders_directory_is_removed_and_nothing_else(monkeypatch, tmp_path):
    """The builder's directory (numba's temporaries inside) is removed by the next process
    that takes the lock; other keys' build directories, older ones of another form, files and
    symbolic links with the prefix, and everything else stay."""
    reg = _fresh(monkeypatch, tmp_path)
    name = kernel_forms.PREFIX + reg.key()
    with _StuckBuilder(tmp_path, name) as holder:
        stale = holder.made[0].parent
    assert stale.is_dir() and stale.name.startswith(kernel_forms.build_prefix(name))   # killed: left behind

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_text("x")
    others = {kernel_forms.build_prefix(kernel_forms.PREFIX + "0" * 20) + "abc": "dir",   # another key's builder
              ".build-xyz": "dir", "keep": "dir",
              kernel_forms.build_prefix(name) + "file": "file", "notes.txt": "file",
              kernel_forms.build_prefix(name) + "link": "link"}
    for other, kind in others.items():
        if kind == "dir":
            (tmp_path / other).mkdir()
            (tmp_path / other / "inside").write_text("x")
        elif kind == "file":
            (tmp_path / other).write_text("x")
        else:
            (tmp_path / other).symlink_to(outside, target_is_directory=True)
    seen = []

    def building(name_, directory, kernels_):
        seen.append(sorted(p.name for p in directory.iterdir()))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kernel_forms, "build", building)
    assert _probe_of(reg)(1.0, 2.0) == (2.0, 3.0)
    assert seen and stale.name not in seen[0] and not stale.exists()   # removed before the build
    for other, kind in others.items():
        assert (tmp_path / other).exists(), other
        assert kind != "dir" or (tmp_path / other / "inside").is_file(), other
    assert (tmp_path / (kernel_forms.build_prefix(name) + "link")).is_symlink() and (outside / "kept").is_file()


def test_numbas_temporaries_are_where_the_build_redirects_them():
    """The build points numba's pycc at its own directory through these two names; a numba
    that no longer has them would leave its temporaries in the system's directory again."""
    import tempfile
    import warnings

    from numba.core.errors import NumbaPendingDeprecationWarning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaPendingDeprecationWarning)
        from numba.pycc import cc, platform
    assert cc.tempfile is tempfile and platform.mkdtemp is tempfile.mkdtemp
    with tempfile.TemporaryDirectory() as tmp, kernel_forms._numba_temporaries_in(tmp):
        assert Path(cc.tempfile.mkdtemp(prefix="p-")).parent == Path(tmp) == Path(platform.mkdtemp()).parent
        assert cc.tempfile.gettempdir is tempfile.gettempdir
    assert cc.tempfile is tempfile and platform.mkdtemp is tempfile.mkdtemp


@pytest.mark.parametrize("setting,seconds", [("", kernel_forms.LOCK_TIMEOUT), ("0", 0.0), (" 2.5 ", 2.5)])
def test_the_lock_timeout_is_set_in_seconds(monkeypatch, setting, seconds):
    monkeypatch.setenv("MOE_KERNELS_LOCK_TIMEOUT", setting)
    assert kernel_forms.lock_timeout() == seconds
    assert f"A process waits at most {kernel_forms.LOCK_TIMEOUT:g} s for another's build" in (
        ROOT / "docs" / "verification.md").read_text()                 # the default, as the threat model says


def test_a_lock_timeout_that_is_not_seconds_is_refused_in_one_line(tmp_path):
    from verifier.arithmetic.kernel_forms import TaskError
    for bad in ("-1", "nan", "inf", "five"):
        env = {**_environ(), "MOE_KERNELS_LOCK_TIMEOUT": bad}
        done = subprocess.run([sys.executable, "-m", "verifier", "check", "examples/capitals.yaml",
                               "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, env=env)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"error: MOE_KERNELS_LOCK_TIMEOUT={bad!r} is not a number of seconds")
        assert not (tmp_path / "r.json").exists()
    assert TaskError is not None
