"""Order-preserving parallel map over batches, with bounded memory: the executor seam.

The verifier hands its work units to an :class:`Executor`: ``map(fn, shared, items)``
yields ``(item, fn(shared, item))`` in the order of ``items``, where ``shared`` is the
large read-only state every unit needs (the weights), sent to each worker once (again
only after a worker died with it: ``verifier.running.cluster``).
:class:`LocalPool` is the fork-based pool below: its workers share the caller's memory
(``shares_memory``). An executor whose workers do not (``verifier.running.cluster.DaskExecutor``)
also offers ``map_keyed(fn, part, items)`` over ``(key, payload)`` items, each unit
needing only ``part(key)`` (one shard of the weights, :mod:`verifier.running.shards`), and says
how many ``shards`` it wants. The order of results, and so the report, does not depend
on the executor.

The local pool:

Workers are forked after the per-weights preparation, so they share it copy-on-write
and nothing large is pickled: only each batch goes out and its (compact) result comes
back. Before forking, every existing object is moved out of the garbage collector's
reach (``gc.freeze``): a collection in a worker would otherwise write to the header of
every container object it inherited (the task set's millions of tuples and strings'
containers), copying each page that holds one, so that each worker ends up with a
private copy of the parent's Python objects. Before that, the C heap's free pages go back
to the system (:func:`return_free_heap`): building the tables leaves freed temporaries
that the allocator keeps resident, and that would otherwise stay resident in the parent
for the whole pass (some 230 MB at 1M facts, 37% of the process). At most ``2 × jobs`` batches are in flight, so memory
stays bounded whatever the number of queries. With ``jobs <= 1`` (or where fork is unavailable) it runs inline.

:func:`in_background` runs one function in a forked child while the caller goes on (a
re-certification checks a large edited expert's isolation so, during its pass); the
answer is the function's whatever happens to the child.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import pickle
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Iterator, Protocol, TypeVar

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")


class Executor(Protocol):
    """Runs ``fn(shared, item)`` for every item, yielding ``(item, result)`` in order."""

    #: whether workers see the caller's memory (then ``shared`` is best fully prepared first)
    shares_memory: bool

    def map(self, fn: Callable[[S, T], R], shared: S, items: Iterable[T]) -> Iterator[tuple[T, R]]: ...


@dataclass(frozen=True)
class LocalPool:
    """``jobs`` forked worker processes on this machine (1: inline; 0: one per CPU)."""

    jobs: int = 1
    shares_memory: bool = True

    def map(self, fn: Callable[[S, T], R], shared: S, items: Iterable[T]) -> Iterator[tuple[T, R]]:
        return ordered_map(partial(fn, shared), items, self.jobs)

_FN: Callable | None = None  # set in the parent just before forking; read by the workers


def _call(item):
    assert _FN is not None
    return _FN(item)


def available_jobs(jobs: int) -> int:
    """``jobs``, with 0 meaning one per CPU."""
    return max(1, os.cpu_count() or 1) if jobs == 0 else max(1, jobs)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], jobs: int = 1) -> Iterator[tuple[T, R]]:
    global _FN
    jobs = available_jobs(jobs)
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for item in items:
            yield item, fn(item)
        return
    _FN = fn
    gc.collect()
    return_free_heap()
    gc.freeze()
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            pending: deque = deque()
            for item in items:
                pending.append((item, pool.apply_async(_call, (item,))))
                if len(pending) >= 2 * jobs:
                    done, result = pending.popleft()
                    yield done, result.get()
            while pending:
                done, result = pending.popleft()
                yield done, result.get()
    finally:
        _FN = None
        gc.unfreeze()


#: glibc's mallopt parameter M_MMAP_THRESHOLD, and the size from which a worker maps each allocation.
M_MMAP_THRESHOLD, MAPPED_FROM = -3, 1 << 20


def map_large_allocations() -> None:
    """From now on, in this process and the workers it forks, allocate every block of
    ``MAPPED_FROM`` bytes or more as a mapping of its own, returned to the system when
    freed (glibc's ``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising that
    threshold itself, up to 32 MB, as mapped blocks are freed; elsewhere nothing).

    For a process that will fork workers, called before the construction: with glibc's
    default, the construction's and the tables' freed arrays of a few MB leave holes in
    the heap, and forked workers that allocate there (and write the allocator's headers
    beside the parent's blocks) each end up with private copies of much of it. Measured
    at 5M facts with 2 workers: each worker's private memory peaked at 627 - 700 MB,
    against 317 - 402 MB when this is called before the construction (and 545 - 583 MB
    when called only after it). The price is a page fault per 4 KB of each new large
    array: about 5% of a 100k-fact check, which is why a single process does not call it."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)


def before_forking(jobs: int) -> None:
    """Called by a process that will fork ``jobs`` workers, before it builds what they
    share: maps large allocations (:func:`map_large_allocations`) when more than one
    worker will run; a single process keeps glibc's default."""
    if available_jobs(jobs) > 1:
        map_large_allocations()


def return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Freed memory the allocator keeps counts in the process's resident size until
    it is reused; a forked child shares it and so inherits its cost."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def in_background(fn: Callable[[], R], fork: bool = True) -> Callable[[], R]:
    """Start ``fn()`` in a forked child (it sees this process's memory as it is now, and
    sends back only its pickled result) and return a function that waits for the result.
    The caller goes on meanwhile, on the other core. Without fork, or with ``fork=False``,
    that function is ``fn`` itself (it runs when waited for). If the child fails in any way
    (an exception, a result that does not pickle, the child killed), the waiting function
    runs ``fn()`` itself: the answer is ``fn``'s either way, and so is any exception. Wait
    for every child started (the waiting reaps it)."""
    if not fork or "fork" not in multiprocessing.get_all_start_methods():
        return fn
    read, write = os.pipe()
    return_free_heap()
    pid = os.fork()
    if pid == 0:                                   # the child: compute, send, and leave at once
        try:
            os.close(read)
            try:
                data = pickle.dumps((True, fn()))
            except BaseException:
                data = pickle.dumps((False, None))
            with os.fdopen(write, "wb") as out:
                out.write(data)
        finally:
            os._exit(0)
    os.close(write)

    def join() -> R:
        with os.fdopen(read, "rb") as got:
            data = got.read()
        os.waitpid(pid, 0)
        try:
            ok, value = pickle.loads(data)
        except Exception:
            ok, value = False, None
        return value if ok else fn()

    return join
