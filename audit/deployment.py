"""A real Dask deployment on this machine, to lose parts of it on purpose (test machinery).

:func:`deploy` starts what a user starts: ``dask scheduler`` and ``workers`` ``dask
worker`` processes (``--nworkers 1 --nthreads 1``, each with its nanny), on loopback at
free ports, each in a session of its own so that it ends with everything it started.
:class:`Deployment` watches the scheduler through a client of its own and kills on
demand: :meth:`Deployment.busy_with` waits until a unit of a phase (a key prefix) is
processing, :meth:`Deployment.only_copies` drops the extra copies of scattered data (as
Dask's active memory manager does on its own) and names their holders, and
:meth:`Deployment.kill_worker` SIGKILLs a worker and its nanny. Used by
``tests/test_cluster_faults.py`` and ``benchmarks/cluster_faults.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

#: the key prefixes of the work units of each phase of ``check``
EVIDENCE, PASS = "changed_experts", "reduce_shard_group"


class PhaseMissed(RuntimeError):
    """The watched run ended before a unit of the phase was seen processing."""


@dataclass(frozen=True)
class Deployment:
    address: str
    client: object                          # our own client, to watch the scheduler
    scheduler: subprocess.Popen
    nannies: tuple[subprocess.Popen, ...]   # the `dask worker` processes
    directory: Path                         # logs (scheduler.log, worker<n>.log) and scratch space

    def scheduler_log(self) -> str:
        return (self.directory / "scheduler.log").read_text(errors="replace")

    def pids(self) -> dict[str, tuple[int, int]]:
        """Worker address -> (the worker process's id, its nanny's)."""
        return self.client.run(lambda: (os.getpid(), os.getppid()))

    def busy_with(self, prefix: str, run: subprocess.Popen, bound: float) -> list[str]:
        """The workers processing a unit whose key starts with ``prefix``, as soon as there is
        one (polled every 10 ms); :class:`PhaseMissed` if ``run`` ends (or ``bound`` s pass) first."""
        deadline = time.monotonic() + bound
        while run.poll() is None and time.monotonic() < deadline:
            busy = sorted(w for w, keys in self.client.processing().items()
                          if any(str(k).startswith(prefix) for k in keys))
            if busy:
                return busy
            time.sleep(0.01)
        raise PhaseMissed(f"the run ended (or {bound} s passed) before a {prefix} unit was seen processing")

    def only_copies(self) -> set[str]:
        """Drop every extra copy of the scattered data (Dask's active memory manager drops
        copies no waiting task needs every 2 s on its own) and name the workers that hold one."""
        async def reduce(dask_scheduler):
            keys = [k for k, ts in dask_scheduler.tasks.items() if ts.state == "memory" and ts.run_spec is None]
            if keys:
                await dask_scheduler.replicate(keys=keys, n=1)
            return {ws.address for k in keys for ws in dask_scheduler.tasks[k].who_has or ()}

        return self.client.run_on_scheduler(reduce)

    def victim(self, prefix: str, run: subprocess.Popen, bound: float) -> str:
        """As soon as a unit of the phase is processing: a worker that holds the only copy of
        some scattered data (the shared state, a shard), one running such a unit if possible."""
        busy = self.busy_with(prefix, run, bound)
        holders = self.only_copies()
        if not holders:
            raise PhaseMissed(f"no scattered data while a {prefix} unit was processing")
        return sorted(holders, key=lambda w: (w not in busy, w))[0]

    @staticmethod
    def kill_worker(pids: tuple[int, int]) -> None:
        """SIGKILL a worker process and its nanny (which would otherwise start it again)."""
        for pid in pids:
            os.kill(pid, signal.SIGKILL)


def _spawn(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _end(proc: subprocess.Popen) -> None:
    """SIGKILL the process's session (it and whatever it started), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def deploy(directory: Path, env: dict, workers: int = 2, start_timeout: float = 60) -> Iterator[Deployment]:
    """A scheduler and ``workers`` workers with nannies, logs and scratch space in ``directory``;
    every process is ended on leaving."""
    import distributed

    scheduler_file = directory / "scheduler.json"
    procs: list[subprocess.Popen] = []
    client = None
    try:
        procs.append(_spawn(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
                             "--no-dashboard", "--scheduler-file", str(scheduler_file)],
                            directory / "scheduler.log", env))
        for n in range(workers):
            procs.append(_spawn(["distributed.cli.dask_worker", "--scheduler-file", str(scheduler_file),
                                 "--host", "127.0.0.1", "--nworkers", "1", "--nthreads", "1", "--no-dashboard",
                                 "--local-directory", str(directory)], directory / f"worker{n}.log", env))
        deadline = time.monotonic() + start_timeout
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        client = distributed.Client(scheduler_file=str(scheduler_file), timeout=f"{start_timeout}s")
        client.wait_for_workers(workers, timeout=start_timeout)
        yield Deployment(client.scheduler.address, client, procs[0], tuple(procs[1:]), directory)
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close(timeout=5)
        for proc in reversed(procs):
            _end(proc)
