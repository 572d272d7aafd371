"""Peak memory of a process tree, sampled (Linux ``/proc``).

The figure a user's machine must provide is the memory of the whole tree at its worst
moment: the main process *plus* its worker processes at the same time. ``ru_maxrss``
gives each process's own peak (at different moments, and counting pages shared by a
forked worker twice), so instead a thread samples, every ``interval`` seconds, the sum
of the proportional set sizes (PSS: each shared page split between its sharers) of
this process and all its descendants, and keeps the largest sum. A peak shorter than
the interval can be missed; the figure is a lower bound on the true peak that is tight
for allocations that live longer than the interval (all the large ones here).

Reading a PSS makes the kernel walk the process's page tables: at several GB per
process one reading of the tree costs tens of milliseconds of CPU, taken from the
work being measured. So the sampler waits at least ``overhead_ratio`` times as long
as its last reading took (1 s per 100 ms reading by default): its cost stays below
about 10% of one core whatever the size, at the price of a coarser interval for large
trees, whose allocations live for seconds.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tree_pss_mb(root: int | None = None) -> float:
    """The summed PSS of ``root`` (default: this process) and its descendants, in MB."""
    todo, total = [root if root is not None else os.getpid()], 0
    while todo:
        pid = todo.pop()
        total += _pss_kb(pid)
        todo += _children(pid)
    return total / 1024


class PeakSampler:
    """``with PeakSampler() as s: ...`` then ``s.peak_mb``: the process tree's largest PSS."""

    def __init__(self, interval: float = 0.1, overhead_ratio: float = 10.0) -> None:
        self.interval, self.overhead_ratio = interval, overhead_ratio
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            self.peak_mb = max(self.peak_mb, tree_pss_mb())
            took = time.perf_counter() - start
            if self._stop.wait(max(self.interval, self.overhead_ratio * took)):
                return

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, tree_pss_mb())
