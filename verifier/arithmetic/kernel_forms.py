"""The kernels' two forms: compiled ahead of time once, with numba's JIT as the fallback.

The kernels (``@kernel``, this module's decorator: :data:`MODULES` lists the modules that
define them) are written for numba's nopython mode.
Compiled just in time, every process pays numba's start-up before its first kernel call:
importing numba, building its typing and target registries, loading each kernel from
numba's on-disk cache (some 0.5 s on the 2-core machine, a fifth of a 100k-fact check).
So the kernels called from Python are also compiled **ahead of time** into one extension
module (numba's ``pycc``), once per version of their sources, and a process that finds it
imports it in milliseconds and never imports numba.

*The same code.* Both forms compile the same Python functions with the same numba and
LLVM, without fast-math: IEEE binary64 operations in the same order, so each kernel
returns bitwise the same arrays in either form (a test compares them), and
:func:`verifier.arithmetic.rounding.check` probes round-to-nearest and gradual underflow
in each form a process runs (:meth:`Kernels.add_probe`).

*Borrowed arrays.* numba counts the references to every array a function is given, on
entry and on exit (an atomic operation each, in its runtime library), unless the call is
inlined. A helper called once per row, per (row, expert) pair or per entry, with a dozen
arrays, spends more time counting than computing. A helper that only reads and writes the
elements of arrays its caller holds, and neither makes nor returns an array, says
``@kernel(borrows=True)``: it is compiled without numba's reference counting (numba's
``_nrt=False``), the arrays staying alive because its caller holds them for as long as it
runs. (Making an array there fails to compile; so does returning one, which its caller
would release without having been given a reference.)

*Only where it fits.* An exported kernel has one declared signature (:data:`Spec`: each
argument's dtype, dimensions and C-contiguous, writable layout, tuples of them, or a
scalar). The extension's wrappers unbox arguments without checking their types, so every
call is checked against the signature first (:func:`matches`), exactly as numba's
``typeof`` would type it; a call that does not fit runs the JIT form instead, which
compiles for whatever it is given. Helpers (kernels without a signature) always run
just in time when called from Python; inside compiled code they are compiled in.

*Which module.* The extension's name carries a key: a hash of the kernel modules' sources
(and :data:`DEPENDS`'), read as the process imports them, and of the numba, llvmlite,
numpy and Python versions; a module is used only by processes that imported those very
sources, and the JIT form caches its compilations in a directory of the same key
(:class:`Kernels`). The extension is built on first use (under a file lock, written to a
temporary name and renamed into place, so a concurrent process waits and never loads half
a file) into the kernels' ``__pycache__``, or a user cache directory when that is not
writable (``NUMBA_CACHE_DIR`` when set, as for numba's own cache), for the platform's
generic CPU. A build that fails in the toolchain leaves a ``.failed`` note with its
reason, and every process of that key runs just in time (delete the note to try again);
so does ``MOE_KERNELS=jit``, and any trouble loading the extension. Extensions of older
keys are left where they are. Loading the extension runs code from that directory, as
numba's cache does: it must be no more writable than the package itself.

*Waiting for another's build.* The lock file records the pid of the process holding it.
A process waits for the lock at most :data:`LOCK_TIMEOUT` seconds
(``MOE_KERNELS_LOCK_TIMEOUT`` sets another number; 0: not at all): a builder that was
stopped holds it for ever. Past that it prints one line to stderr naming the lock file and
the holder's pid, and runs its kernels just in time (leaving no ``.failed`` note: the next
process waits, or builds, again).

*What a build leaves.* A build works in a directory ``.build-<name>-*`` next to the
extension (``<name>`` is the extension's, key included), and numba's own temporary files
of the build (its object files, its test of the C compiler) go inside it too, not to the
system's temporary directory; it is removed when the build ends. A builder that was
killed leaves it behind: the next process that takes the lock removes every
``.build-<name>-*`` directory there, which cannot belong to a live builder, since a builder
holds that lock for as long as its directory exists. Nothing else is removed: not the
directories of other keys (their builders hold other locks), nor files, nor symbolic links.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np

from tasks.errors import TaskError

#: The modules whose kernels go into the extension (imported by name when it is needed).
MODULES = ("verifier.arithmetic.rounding", "verifier.arithmetic.accumulate", "verifier.arithmetic.exponential",
           "verifier.arithmetic.deployed", "verifier.arithmetic.residual", "verifier.arithmetic.gate",
           "verifier.arithmetic.logits", "verifier.arithmetic.experts",
           "verifier.arithmetic.dense")
#: Modules whose values the kernels' compiled code freezes in (besides MODULES): in the key.
DEPENDS = ("verifier.arithmetic.constants", __name__)
#: The prefix of the extension's file and module names (followed by the key).
PREFIX = "moe_kernels_"
#: Seconds a process waits for the lock of another's build before running just in time
#: (``MOE_KERNELS_LOCK_TIMEOUT`` sets another; a build takes about a minute on 2 cores).
LOCK_TIMEOUT = 300.0

#: A kernel argument's declared type: "i64", "f64", "bool" (a Python or numpy scalar of that
#: type), "i64[2]" (a C-contiguous, writable, aligned int64 array of 2 dimensions: dtypes
#: i32, i64, f64, bool), or a tuple of specs.
Spec = Union[str, tuple]

_ARRAY = re.compile(r"^(i32|i64|f64|bool)\[([1-9])\]$")
_DTYPES = {"i32": np.dtype(np.int32), "i64": np.dtype(np.int64), "f64": np.dtype(np.float64),
           "bool": np.dtype(np.bool_)}
_SCALARS = {"i64": (int, np.int64), "f64": (float, np.float64), "bool": (bool, np.bool_)}


def matches(spec: Spec, value: Any) -> bool:
    """Whether ``value`` has exactly the type ``spec`` declares, as numba would type it: an
    ndarray (not a subclass) of that dtype and dimension that is C-contiguous, writable and
    aligned; a Python int in int64's range or numpy int64 for "i64" (never a bool); a
    Python float or numpy float64 for "f64"; a Python or numpy bool for "bool"; a tuple
    (not a subclass) of the same length whose items match."""
    if isinstance(spec, tuple):
        return type(value) is tuple and len(value) == len(spec) and all(map(matches, spec, value))
    m = _ARRAY.match(spec)
    if m is not None:
        if type(value) is not np.ndarray:
            return False
        f = value.flags
        return (value.dtype == _DTYPES[m.group(1)] and value.dtype.fields is None and value.ndim == int(m.group(2))
                and f.c_contiguous and f.writeable and f.aligned)
    kinds = _SCALARS[spec]
    if type(value) not in kinds:
        return False
    return spec != "i64" or type(value) is not int or -2 ** 63 <= value < 2 ** 63


def numba_type(spec: Spec):
    """The numba type a spec declares (imports numba: for the build and for tests)."""
    from numba.core import types
    if isinstance(spec, tuple):
        return types.Tuple([numba_type(s) for s in spec])
    m = _ARRAY.match(spec)
    names = {"i32": types.int32, "i64": types.int64, "f64": types.float64, "bool": types.boolean}
    if m is not None:
        return types.Array(names[m.group(1)], int(m.group(2)), "C")
    return names[spec]


class Kernel:
    """A function written for numba's nopython mode, called like one.

    From Python, a call whose arguments match the declared signature ``args`` runs the
    ahead-of-time form when the process has it; any other call runs numba's JIT form
    (``numba.njit(**options)``, made on first need, cached per key: :class:`Kernels`).
    Inside compiled code a reference to a kernel is typed as its JIT dispatcher
    (``_numba_type_``), so kernels call each other as numba functions do."""

    def __init__(self, py_func: Callable, registry: "Kernels", options: dict,
                 args: tuple | None = None, returns: Spec | None = None) -> None:
        self.py_func = py_func
        self.registry = registry
        self.options = options
        self.args = args
        self.returns = returns
        self.__name__ = py_func.__name__
        self.__qualname__ = py_func.__qualname__
        self.__module__ = py_func.__module__
        self.__doc__ = py_func.__doc__
        self.__wrapped__ = py_func
        self._jit = None
        self._aot = None
        registry.add(self)

    @property
    def export_name(self) -> str:
        return f"{self.__module__.rsplit('.', 1)[-1]}__{self.__name__}"

    def __call__(self, *args):
        if self.args is not None:
            aot = self._aot if self._aot is not None else self.registry.ahead_of_time(self)
            if aot is not False and len(args) == len(self.args) and all(map(matches, self.args, args)):
                return aot(*args)
        return self.jit(*args)

    @property
    def jit(self):
        """The numba dispatcher of this kernel (numba is imported on first need)."""
        if self._jit is not None and self.registry.jit_state == "ok":
            return self._jit
        return self.registry.just_in_time(self)

    @property
    def _numba_type_(self):
        from numba.core import types
        return types.Dispatcher(self.jit)

    def __repr__(self) -> str:
        return f"<kernel {self.__module__}.{self.__name__}>"


class Kernels:
    """The kernels of :data:`MODULES` and the forms they run in, for one process.

    ``ahead_of_time(k)`` gives kernel k's exported function, loading (or first building)
    the extension on the first call; False when there is none. ``just_in_time(k)`` gives
    its numba dispatcher. A probe (:meth:`add_probe`) is called with each form's way of
    calling a kernel when that form is first used, and raises when the form cannot be
    trusted; a form is used only once its probes have passed.

    *What the key is of.* Each module's source bytes are read when its first kernel is
    made, that is as the process imports it (and those of :data:`DEPENDS` with them), so
    the key names the code this process runs and compiles, even if a file changes later.
    The JIT form caches its compilations (numba's ``cache=True``) in a directory of that
    key too: numba validates a cached function by its own file's time stamp only, so a
    kernel compiled with the helpers of an older version of another file would otherwise
    stay in use."""

    def __init__(self, dirs: list[Path] | None = None) -> None:
        self.dirs = dirs              # where the extension may be (None: cache_dirs())
        self.kernels: list[Kernel] = []
        self.sources: dict[str, bytes | None] = {}   # module -> its source bytes as imported
        self.probes: list[Callable[[Callable[[Kernel], Callable]], None]] = []
        self.module = None            # the extension; False: none in this process
        self.jit_state: str | None = None   # None: JIT form not yet probed; "probing"; "ok"
        self.note: str | None = None  # why there is no extension, when there is none
        self.lock = threading.RLock()

    def add(self, kernel: Kernel) -> None:
        self.kernels.append(kernel)
        for name in (kernel.__module__, *DEPENDS):
            if name not in self.sources:
                self.sources[name] = _source_bytes(name)

    def add_probe(self, probe: Callable[[Callable[[Kernel], Callable]], None]) -> None:
        self.probes.append(probe)

    def forms(self) -> list[Callable[[Kernel], Callable]]:
        """The forms this process has run kernels in, each as ``form(k)`` = k's function."""
        out = []
        if self.module not in (None, False):
            out.append(lambda k: k._aot)
        if self.jit_state == "ok":
            out.append(lambda k: k.jit)
        return out

    def exported(self) -> list[Kernel]:
        for name in MODULES:
            importlib.import_module(name)
        return [k for k in self.kernels if k.args is not None]

    def key(self) -> str | None:
        """The hash of :data:`MODULES`' and :data:`DEPENDS`' sources as imported, and of the
        numba, llvmlite, numpy and Python versions and the platform (None: a source could
        not be read). Computed once: once every module is in, its sources are fixed."""
        if "_key" not in self.__dict__:
            self.exported()
            self._key = self._hash()
        return self._key

    def _hash(self) -> str | None:
        h = hashlib.sha256()
        for name in (*MODULES, *DEPENDS):
            src = self.sources.get(name)
            if src is None:
                return None
            h.update(name.encode() + b"\0" + src + b"\0")
        for dist in ("numba", "llvmlite", "numpy"):
            h.update(f"{dist}={importlib.metadata.version(dist)}\0".encode())
        h.update(f"{sys.version}\0{sys.platform}\0{extension_suffix()}".encode())
        return h.hexdigest()[:20]

    def directories(self) -> list[Path]:
        return self.dirs if self.dirs is not None else cache_dirs()

    # -- the JIT form ---------------------------------------------------------------
    def just_in_time(self, kernel: Kernel):
        """Kernel's numba dispatcher, after the probes passed on the JIT form (once per
        process; a failing probe raises here, and again at the next attempt)."""
        with self.lock:
            if kernel._jit is None:
                kernel._jit = self._dispatcher(kernel)
            if self.jit_state is None:
                self.jit_state = "probing"
                try:
                    for probe in self.probes:
                        probe(lambda k: k.jit)
                except BaseException:
                    self.jit_state = None
                    raise
                self.jit_state = "ok"
            return kernel._jit

    def _dispatcher(self, kernel: Kernel):
        """``numba.njit`` of the kernel, caching in this key's directory (not caching where
        no directory is writable); a borrowing kernel's refuses to compile a signature that
        returns an array (:func:`_refuse_returned_arrays`)."""
        from numba import njit
        from numba.core import config
        where = self._jit_cache()
        if where is None:
            dispatcher = njit(cache=False, **kernel.options)(kernel.py_func)
        else:
            saved = config.CACHE_DIR
            config.CACHE_DIR = str(where)         # read once, as the dispatcher finds its cache
            try:
                dispatcher = njit(cache=True, **kernel.options)(kernel.py_func)
            finally:
                config.CACHE_DIR = saved
        if kernel.options.get("_nrt") is False:
            _refuse_returned_arrays(dispatcher, kernel)
        return dispatcher

    def _jit_cache(self) -> Path | None:
        """The JIT form's cache directory for this key: the first writable one (found once)."""
        if "_jit_dir" not in self.__dict__:
            self._jit_dir = None
            key = self.key()
            for d in self.directories() if key is not None else ():
                with contextlib.suppress(OSError):
                    (d / f"numba-{key}").mkdir(parents=True, exist_ok=True)
                    if os.access(d / f"numba-{key}", os.W_OK):
                        self._jit_dir = d / f"numba-{key}"
                        break
        return self._jit_dir

    # -- the ahead-of-time form -------------------------------------------------------
    def ahead_of_time(self, kernel: Kernel):
        """Kernel's exported function (the extension loaded, or built, and probed on the
        first call), or False when this process has no extension."""
        with self.lock:
            if self.module is None:
                try:
                    module = self._load()
                except TaskError:                         # the user's setting: refused, as bad input is
                    raise
                except Exception as e:                    # noqa: BLE001 - whatever the cause: run just in time
                    module = self._fail(f"the compiled kernels could not be loaded ({type(e).__name__}: {e})")
                if module is not False:
                    try:
                        for probe in self.probes:
                            probe(lambda k: getattr(module, k.export_name))
                    except RuntimeError as e:
                        module = self._fail(f"the compiled extension failed its probe: {e}")
                if module is not False:
                    for k in self.exported():
                        k._aot = getattr(module, k.export_name)
                self.module = module
            if self.module is False:
                kernel._aot = False
            return kernel._aot

    def _load(self):
        """The extension for these sources (built first if no directory has it), or False
        with a note saying why there is none."""
        if os.environ.get("MOE_KERNELS", "") == "jit":
            return self._fail("MOE_KERNELS=jit")
        timeout = lock_timeout()
        kernels = self.exported()
        key = self.key()
        if key is None:
            return self._fail("the kernels' sources could not be read")
        name = PREFIX + key
        file = name + extension_suffix()
        where = self.directories()
        for d in where:
            if (d / file).is_file():
                return self._import(name, d / file, kernels)
            if (d / (name + ".failed")).is_file():
                return self._fail((d / (name + ".failed")).read_text(errors="replace").strip())
        for d in where:
            try:
                d.mkdir(parents=True, exist_ok=True)
                lock = _Lock(d / (name + ".lock"), timeout)
            except OSError:
                continue                                  # not writable, or no locks there: the next directory
            except LockTimeout as e:                      # a builder stopped, or slow: not worth waiting for
                print(f"note: {e}; this process runs the verifier's kernels just in time (MOE_KERNELS_LOCK_TIMEOUT "
                      f"sets how many seconds to wait, {LOCK_TIMEOUT:g} unless set)", file=sys.stderr, flush=True)
                return self._fail(str(e))
            with lock:
                remove_stale_builds(d, name)              # a killed builder's: none is live while we hold the lock
                if (d / (name + ".failed")).is_file():    # a concurrent process's build failed
                    return self._fail((d / (name + ".failed")).read_text(errors="replace").strip())
                if not (d / file).is_file():              # a concurrent process may have built it
                    try:
                        build(name, d, kernels)
                    except (OSError, MemoryError) as e:   # the machine's state, not the build's: no note
                        return self._fail(f"building the compiled kernels {name} failed ({type(e).__name__}: {e})")
                    except Exception as e:                # noqa: BLE001 - the toolchain's failure: noted
                        last = (str(e).strip().splitlines() or [""])[-1]
                        reason = f"building the compiled kernels {name} failed ({type(e).__name__}: {last})"
                        with contextlib.suppress(OSError):
                            (d / (name + ".failed")).write_text(reason + "\n")
                        return self._fail(reason)
            return self._import(name, d / file, kernels)
        return self._fail("no writable directory for the compiled kernels")

    def _fail(self, note: str):
        self.note = note
        return False

    def _import(self, name: str, path: Path, kernels: list[Kernel]):
        """The extension at ``path``, or False (with a note) when it cannot be loaded or lacks a kernel."""
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (ImportError, OSError) as e:
            return self._fail(f"{path} could not be loaded: {e}")
        missing = [k.export_name for k in kernels if not hasattr(module, k.export_name)]
        return self._fail(f"{path} lacks {', '.join(missing)}") if missing else module


def _refuse_returned_arrays(dispatcher, kernel: Kernel) -> None:
    """Make ``dispatcher`` (a borrowing kernel's) refuse every compilation, or cached one,
    whose result holds an array: compiled without reference counting, it would hand its
    caller a reference it was never given (the module docstring). Both forms compile a
    helper through its dispatcher, so neither can build such a kernel."""
    from numba.core import types

    def holds_array(t) -> bool:
        if isinstance(t, types.BaseTuple):
            return any(holds_array(x) for x in t.types)
        return isinstance(t, (types.Array, types.Optional, types.Buffer))

    add = dispatcher.add_overload

    def checked(cres):
        if holds_array(cres.signature.return_type):
            raise TypeError(f"{kernel!r} borrows its arrays (borrows=True) and may not return one: {cres.signature}")
        add(cres)
    dispatcher.add_overload = checked


def _source_bytes(name: str) -> bytes | None:
    """The bytes of module ``name``'s source file now (None if it has none or it cannot be read)."""
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin is None:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
    try:
        return Path(origin).read_bytes() if origin else None
    except OSError:
        return None


def extension_suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def cache_dirs() -> list[Path]:
    """Where the extension may be: ``NUMBA_CACHE_DIR`` when set, else the kernels'
    ``__pycache__`` then the user's cache directory (when the user has a home)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return [Path(os.environ["NUMBA_CACHE_DIR"])]
    out = [Path(__file__).resolve().parent / "__pycache__"]
    try:
        out.append(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-knowledge-verifier")
    except RuntimeError:                                  # no home directory to be found
        pass
    return out


def lock_timeout() -> float:
    """Seconds to wait for the build lock: ``MOE_KERNELS_LOCK_TIMEOUT`` when set, else
    :data:`LOCK_TIMEOUT` (TaskError: the setting is not a number of seconds)."""
    text = os.environ.get("MOE_KERNELS_LOCK_TIMEOUT", "").strip()
    if not text:
        return LOCK_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise TaskError(f"MOE_KERNELS_LOCK_TIMEOUT={text!r} is not a number of seconds",
                        fix=f"set it to how long a process waits for another's build of the compiled kernels "
                            f"(e.g. {LOCK_TIMEOUT:g}; 0: not at all), or unset it")
    return value


class LockTimeout(Exception):
    """The lock was held by another process for longer than the timeout (the message says
    which lock, which process as the file records it, and how long this one waited)."""

    def __init__(self, path: Path, holder: int | None, waited: float) -> None:
        self.path = path
        self.holder = holder
        who = f"process {holder}" if holder is not None else "another process"
        super().__init__(f"waited {waited:g} s for the lock {path}, held by {who} building the compiled kernels "
                         f"(or stopped while building them)")


class _Lock:
    """An exclusive lock on a file, taken when made and held to the end of ``with`` (fcntl
    where it exists; elsewhere none). The holder writes its pid into the file. Waits at most
    ``timeout`` seconds (polling): :class:`LockTimeout` then. OSError where the directory is
    not writable or the file system has no locks."""

    #: seconds between two attempts while another process holds the lock
    POLL = 0.25

    def __init__(self, path: Path, timeout: float = LOCK_TIMEOUT) -> None:
        self.file = open(path, "a+")
        try:
            import fcntl
        except ImportError:                               # pragma: no cover - not POSIX
            return
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:                   # held by another open file: another process
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise LockTimeout(path, self._holder(), timeout) from None
                    time.sleep(min(self.POLL, left))
        except BaseException:
            self.file.close()
            raise
        with contextlib.suppress(OSError):                # the pid only informs a waiter
            self.file.truncate(0)
            self.file.write(f"{os.getpid()}\n")
            self.file.flush()

    def _holder(self) -> int | None:
        """The pid the holder wrote into the file (None: none, or not yet written)."""
        with contextlib.suppress(OSError, ValueError):
            self.file.seek(0)
            return int(self.file.read(32).strip())
        return None

    def __enter__(self) -> "_Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()                                 # closing the file releases the lock


def build_prefix(name: str) -> str:
    """The prefix of the directory a build of the extension ``name`` works in."""
    return f".build-{name}-"


def remove_stale_builds(directory: Path, name: str) -> None:
    """Remove the directories ``build_prefix(name)*`` in ``directory``, which builders of
    ``name`` left when they were killed. Call it holding ``name``'s lock only: a builder holds
    it for as long as its directory exists, so none of them is a live builder's. Only
    directories (not symbolic links, not files) with that very prefix; whatever cannot be
    removed stays."""
    prefix = build_prefix(name)
    with contextlib.suppress(OSError):
        with os.scandir(directory) as entries:
            stale = [e.path for e in entries if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _numba_temporaries_in(directory: str):
    """Make numba's pycc put its temporary directories in ``directory`` (its object files,
    and its test of the C compiler, which numba never removes), not in the system's, while
    the ``with`` lasts. Holds numba's compiler lock throughout, so no other thread compiles
    with numba meanwhile; an attribute numba no longer has is left alone."""
    import types as pytypes

    from numba.core.compiler_lock import global_compiler_lock
    from numba.pycc import cc, platform

    def mkdtemp(suffix=None, prefix=None, dir=None):
        return tempfile.mkdtemp(suffix, prefix, directory if dir is None else dir)

    shim = pytypes.ModuleType("tempfile")
    shim.__dict__.update(vars(tempfile))
    shim.mkdtemp = mkdtemp
    with global_compiler_lock:
        saved = [(m, a, getattr(m, a)) for m, a in ((cc, "tempfile"), (platform, "mkdtemp")) if hasattr(m, a)]
        try:
            for m, a, _ in saved:
                setattr(m, a, shim if a == "tempfile" else mkdtemp)
            yield
        finally:
            for m, a, v in saved:
                setattr(m, a, v)


def build(name: str, directory: Path, kernels: list[Kernel]) -> Path:
    """Compile ``kernels`` ahead of time into the extension ``name`` in ``directory``
    (numba.pycc, for the generic CPU of the platform; atomically renamed into place)."""
    import warnings
    from numba.core.errors import NumbaPendingDeprecationWarning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaPendingDeprecationWarning)
        from numba.core import types
        from numba.pycc import CC
        if sys.stderr is not None and sys.stderr.isatty():
            print(f"compiling the verifier's kernels once ({len(kernels)} of them; about a minute)...",
                  file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=directory, prefix=build_prefix(name)) as tmp, \
                _numba_temporaries_in(tmp):
            cc = CC(name)
            cc.output_dir = tmp
            cc.verbose = False
            for k in kernels:
                sig = numba_type(k.returns)(*[numba_type(a) for a in k.args]) if k.returns is not None \
                    else types.none(*[numba_type(a) for a in k.args])
                cc.export(k.export_name, sig)(k.py_func)
            cc.compile()
            built = Path(tmp) / (name + extension_suffix())
            final = directory / built.name
            os.replace(built, final)
    return final


def kernel(args: tuple | None = None, returns: Spec | None = None, borrows: bool = False,
           **options) -> Callable[[Callable], Kernel]:
    """Decorate a nopython-mode function as a :class:`Kernel` of :data:`KERNELS`; ``args``
    and ``returns`` declare the signature it is exported with (none: a helper). ``borrows``:
    a helper that only borrows its arrays, compiled without reference counting (the module
    docstring)."""
    if args is not None and (options or borrows):
        raise TypeError("an exported kernel takes no numba options: the ahead-of-time build would not apply them")
    if borrows:
        options = {**options, "_nrt": False}

    def wrap(f: Callable) -> Kernel:
        return Kernel(f, KERNELS, options, args, returns)
    return wrap


#: This process's kernels (like numba's own dispatchers, one set per process).
KERNELS = Kernels()
