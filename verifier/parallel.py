"""Order-preserving parallel map over batches, with bounded memory.

Workers are forked after the per-weights preparation, so they share it copy-on-write
and nothing large is pickled: only each batch goes out and its (compact) result comes
back. Before forking, every existing object is moved out of the garbage collector's
reach (``gc.freeze``): a collection in a worker would otherwise write to the header of
every container object it inherited (the task set's millions of tuples and strings'
containers), copying each page that holds one, so that each worker ends up with a
private copy of the parent's Python objects. At most ``2 × jobs`` batches are in flight, so memory stays bounded whatever the
number of queries. With ``jobs <= 1`` (or where fork is unavailable) it runs inline.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections import deque
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")

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
