"""Running the verifier's work units on a Dask cluster (the ``dask`` extra).

:class:`DaskExecutor` implements :class:`verifier.running.parallel.Executor` on a
``distributed.Client``, in two ways:

* :meth:`DaskExecutor.map_keyed` (the certified pass): the verifier cuts the weights into
  shards of tasks (:mod:`verifier.running.shards`); each shard's weights are built on the client
  when first needed and scattered to *one* worker (the one holding the fewest bytes of
  this run's shards per thread), and each work unit (a batch's rows of that shard) refers
  to its shard by future and runs on that worker, so a worker holds only the shards it
  serves, builds each shard's tables once, and a unit ships only its rows; what comes
  back is the rows' share of the report's records (computed on the worker,
  :meth:`verifier.running.runner.Runner.run_reduced`), not every row's enclosures;
* :meth:`DaskExecutor.map` (the evidence phase's leave-one-out rebuilds): the same with a
  single part, the shared state (task set and experts), scattered to one worker; a
  worker that runs a unit fetches it from a holder.

At most ``window`` units per worker thread are in flight and results are taken in the
order they were submitted, so the client holds a bounded number of results and the
report is the one a local run gives (a unit is a pure function of its part and
payload, so running it again gives the same result).

**Why the units of a shard are pinned to its holder.** Left to itself, the scheduler
moves units to an idle worker (work stealing, and placement that weighs a transfer as
cheap), which then fetches the shard; its active memory manager drops that extra copy
again a few seconds later, so the shards travelled back and forth and every copy built
its tables anew: at 300k facts, 27 table builds for 3 shards, which took more CPU than
the units themselves. A unit is therefore submitted with its holder as a strict worker
restriction (``allow_other_workers=False``, which stealing respects).

**Faults.** What a run survives, with the report a local run gives (tested on a real
deployment, ``dask scheduler`` and two ``dask worker`` processes with nannies, by SIGKILL
of a worker and its nanny in the evidence phase and in the certified pass):

* a worker lost while it runs units: the scheduler runs them again on another worker
  (a unit that was running on ``distributed.scheduler.allowed-failures`` + 1 workers
  that died, 4 by default, is taken for the cause, ``KilledWorker``, and ends the run);
* a worker lost with the only copy of a part (a shard, or the shared state): the
  scheduler drops the units that need it (they come back cancelled); each is submitted
  again, the part built and scattered again first (once per loss, however many units it
  dropped), up to ``retries`` times per unit;
* a worker that leaves the cluster holding a shard (lost, or retired with its data moved
  elsewhere): the units pinned to it could run nowhere else, so once the scheduler no
  longer lists it, they are submitted again, on a copy of the shard scattered to a worker
  that is there (counted like a drop);
* no running worker for less than ``timeout`` seconds (all lost, none started yet, or
  all paused): the run waits for one.

Nothing relies on copies that Dask may drop or never make. There is no ``broadcast``:
the scheduler's replication loop retried a dead worker forever (the run hung, the
surviving worker logging "Could not find data"), and Dask's active memory manager drops
the replicas of data no waiting task needs anyway (then the run stopped on a unit
"cancelled" for lost data).

What ends the run, with a :class:`ClusterError` (one line, exit status 2; no report, and
in particular no certificate):

* ``timeout`` seconds (``--cluster-timeout``, default 60) in which no unit completed and
  the scheduler never said it had a running worker (no answer counts as none);
* the connection to the scheduler lost (the client then drops every future): at once,
  or, when a scatter was under way, once the client gives up reconnecting
  (``min(CONNECT_TIMEOUT, timeout)``);
* a unit dropped more than ``retries`` times, or taken for the cause of its workers'
  deaths; a scatter that failed more than ``retries`` times while workers were running.

Every wait is bounded: a unit's completion is awaited ``poll`` seconds (at most 1) at a
time and, between two, the scheduler is asked how many workers it has running (within
``timeout``); a result is fetched within ``timeout``, a failed fetch tried again; a
scatter waits ``poll`` seconds for a worker, and its transfer is bounded by Dask's
connection timeouts (``distributed.comm.timeouts``). A unit that runs on a live worker
is waited for however long it takes (a worker that stops answering is removed by the
scheduler after ``distributed.scheduler.worker-ttl``, 5 minutes by default, and its
units run again). The report also counts the queries sent and the queries whose
results were recorded, and certifies only when they agree.

:func:`connect` opens a client from the command line's ``--scheduler`` value:
``local:N`` starts a ``LocalCluster`` of N single-threaded worker processes on this
machine; anything else is a scheduler address such as ``tcp://10.0.0.5:8786``. Given a
``warm_up`` function, the executor submits it once to each worker as it is made (the
command line's loads the project and the compiled kernels there while the client builds
the model); nothing waits for it or reads it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TypeVar

from tasks.errors import TaskError

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")

INSTALL_HINT = "install the dask extra: pip install -e .[dask]"
CONNECT_TIMEOUT = "20s"
#: seconds without a completed unit and without a running worker before a run stops
NO_WORKER_TIMEOUT = 60.0
#: Units in flight per worker thread: enough that a worker always has its next unit queued
#: while the client records a result (4 left workers idle between units at 1M facts).
WINDOW = 8
#: Rows of the certified pass per unit: a unit carries the pieces of several batches of one
#: shard (each still run as a batch of its own). Every unit costs round trips between the
#: client's threads, the scheduler and a worker, tens of milliseconds when the workers
#: hold the cores: at 1M facts on 2 cores, units of one batch (20k rows) took 30 s where
#: units of 80k rows took 22 s.
UNIT_ROWS = 80_000
NO_REPORT = "no report was produced"


class ClusterError(TaskError):
    """The cluster could not complete the run (no report is produced)."""


def require_distributed():
    try:
        import distributed
    except ImportError:
        raise TaskError("dask.distributed is not installed", fix=INSTALL_HINT) from None
    return distributed


def _failed(exc: BaseException) -> ClusterError:
    return ClusterError(f"the Dask cluster could not complete the run ({type(exc).__name__}: {exc}); {NO_REPORT}",
                        fix="check the workers (memory, logs) and run again")


def _scheduler_lost(detail: str = "") -> ClusterError:
    return ClusterError(f"the connection to the Dask scheduler was lost{detail}; {NO_REPORT}",
                        fix="check the scheduler (its log, the network) and run again")


class DaskExecutor:
    """Work units on a Dask cluster through ``client``; see the module docstring.

    ``shards``: how many shards of tasks the certified pass cuts the weights into
    (default: one per worker thread; the shards are balanced in work, and each costs its
    own tables, which overlap in the entities that tasks share: at 1M facts four shards
    took 6.1 s of table building where the whole weights take 2.7 s), each scattered to
    one worker. ``window``: units in flight per worker thread. ``timeout``: seconds a run
    may go without a completed unit while no worker is running before it stops.
    ``unit_rows``: about how many rows of the certified pass one unit carries
    (:data:`UNIT_ROWS`). ``warm_up``: a function of no arguments submitted once to each
    worker the scheduler has now (:meth:`_warm`)."""

    shares_memory = False

    def __init__(self, client, window: int = WINDOW, shards: int | None = None, retries: int = 3,
                 timeout: float = NO_WORKER_TIMEOUT, unit_rows: int = UNIT_ROWS,
                 warm_up: Callable[[], object] | None = None) -> None:
        self.client, self.window, self.retries, self.timeout = client, window, retries, timeout
        self.unit_rows = unit_rows
        self._shards = shards
        self._warming = self._warm(warm_up) if warm_up is not None else []

    def _warm(self, fn: Callable[[], object]) -> list:
        """``fn()`` submitted once to each worker the scheduler has now and not waited for,
        so that a fresh worker does what a first unit would otherwise do inside the run
        (import the verifier, load the compiled kernels) while the client is still busy
        building the model and the shards. Nothing depends on it: its futures are kept,
        never read, and dropped with the executor; a failure or a lost worker changes no
        report; a worker that joins later warms up on its first unit, as without it; a
        scheduler that does not answer leaves the run to find that out itself."""
        try:
            workers = sorted(self.client.nthreads(callback_timeout=self.timeout))
        except (OSError, TimeoutError):
            return []
        return [self.client.submit(fn, pure=False, workers=[w], allow_other_workers=True) for w in workers]

    @property
    def shards(self) -> int:
        return self._shards if self._shards is not None else self._threads()

    def _slots(self) -> int:
        return max(2, self.window * self._threads())

    def _threads(self) -> int:
        """The cluster's worker threads (at least 1), as the scheduler says within ``timeout`` s."""
        if self.client.status != "running":
            raise _scheduler_lost()
        try:
            return sum(self.client.nthreads(callback_timeout=self.timeout).values()) or 1
        except (OSError, TimeoutError):
            raise _scheduler_lost() from None

    def map(self, fn: Callable[[S, T], R], shared: S, items: Iterable[T]) -> Iterator[tuple[T, R]]:
        """``fn(shared, item)`` for each item, in order: :meth:`map_keyed` with one part,
        ``shared``, so that it is scattered to one worker and scattered again if lost."""
        for (_, item), result in self._map(fn, lambda _key: shared, ((None, item) for item in items), pin=False):
            yield item, result

    def map_keyed(self, fn: Callable[[S, T], R], part: Callable[[object], S],
                  items: Iterable[tuple[object, T]]) -> Iterator[tuple[tuple[object, T], R]]:
        """``fn(part(key), payload)`` for each ``(key, payload)``, in order. Each ``part(key)``
        is built here when first needed and scattered to one worker (no copy elsewhere);
        when a worker dies with it, it is built and scattered again and the units that
        needed it are resubmitted (up to ``retries`` times per unit). Each unit runs on the
        worker that holds its part (module docstring)."""
        return self._map(fn, part, items, pin=True)

    def _map(self, fn, part, items, pin: bool):
        distributed = require_distributed()
        run = _Run(self.client, fn, part, self.retries, _Liveness(self.client, self.timeout), pin)
        try:
            slots = self._slots()
            for key, payload in items:
                run.pending.append(run.submit(key, payload))
                if len(run.pending) >= slots:
                    yield run.take()
            while run.pending:
                yield run.take()
        except (distributed.KilledWorker, CancelledError, OSError, TimeoutError) as exc:
            # KilledWorker: the scheduler took a unit for the cause of its workers' deaths;
            # OSError (CommClosedError among them), TimeoutError: a transfer failed for good
            raise _failed(exc) from None
        finally:
            run.release()


@dataclass(frozen=True)
class _Unit:
    """A work unit in flight: its future, and the scattered copy of its part it was submitted against."""

    key: object
    payload: object
    future: object
    generation: int           # of the part's scattered copy (0: the first; +1 each time it is scattered again)
    resubmitted: int = 0      # times the unit was dropped and submitted again


@dataclass(frozen=True)
class _Copy:
    """A scattered copy of a part: its future, its generation, the worker it was scattered
    to (None: where Dask put it, the units not pinned) and its size in bytes."""

    future: object
    generation: int
    holder: str | None
    size: int


class _Liveness:
    """The bound on every wait of one run: :meth:`check` raises a :class:`ClusterError` once
    ``timeout`` seconds have passed with no unit completed (:meth:`progressed`) and no
    running worker seen. The scheduler is given ``timeout`` seconds to answer (a busy
    scheduler on a loaded machine may take seconds); no answer counts as no worker, so a
    scheduler that stops answering also ends the run, and the error then names the
    scheduler rather than the workers (a killed scheduler's client may still count as
    running while its requests time out: which of the two the error names rests on
    whether the scheduler answered, not on which of the client's threads saw it first)."""

    def __init__(self, client, timeout: float) -> None:
        self.client, self.timeout = client, timeout
        self.poll = max(0.05, min(1.0, timeout / 4))
        self.since = self.answered = time.monotonic()

    def progressed(self) -> None:
        self.since = time.monotonic()

    def running_workers(self) -> dict[str, int]:
        """Address -> threads of the running workers, as the scheduler says within ``timeout``
        s (no answer: none). A client that lost its connection to the scheduler (and with it
        every future of the run) ends the run."""
        return self._ask(self.client.scheduler.ncores_running)

    def workers(self) -> dict[str, int]:
        """Address -> threads of every worker the scheduler lists (paused ones too), as
        :meth:`running_workers` asks."""
        return self._ask(self.client.scheduler.ncores)

    def _ask(self, rpc) -> dict[str, int]:
        if self.client.status != "running":
            raise _scheduler_lost()
        try:
            answer = dict(self.client.sync(rpc, callback_timeout=self.timeout))
        except (OSError, TimeoutError):
            return {}
        self.answered = time.monotonic()
        return answer

    def check(self) -> dict[str, int]:
        """The running workers (address -> threads); raises when there have been none for
        ``timeout`` s."""
        workers = self.running_workers()
        if workers:
            self.since = time.monotonic()
        elif time.monotonic() - self.since > self.timeout:
            if self.client.status != "running" or time.monotonic() - self.answered > self.timeout:
                raise _scheduler_lost(f" (it has not answered for {self.timeout:g} s)")
            raise ClusterError(f"no Dask worker has been running for {self.timeout:g} s and no work unit completed; "
                               f"{NO_REPORT}", fix="start workers (dask worker SCHEDULER-ADDRESS) and run again, "
                                                  "or give them longer with --cluster-timeout SECONDS")
        return workers


class _Run:
    """One :meth:`DaskExecutor.map_keyed` call: the scattered parts and the units in flight.

    ``parts[key]`` is the current :class:`_Copy` of a part. When the scheduler loses every
    copy of a part (its holder died), it drops the units that need it (they are cancelled,
    as is any unit submitted against it later). A dropped unit is submitted again; its
    part is scattered again first if the unit was submitted against the copy now current,
    or if the client knows that copy lost too (a unit submitted against an older copy
    otherwise finds the new one already there), so one loss costs one scatter however many
    units it dropped. With ``pin``, each part is scattered to the running worker holding
    the fewest bytes of this run's parts per thread and its units are restricted to that
    worker; units whose holder the scheduler no longer lists are submitted again the same
    way, on a copy scattered to a worker that is there."""

    def __init__(self, client, fn: Callable, part: Callable, retries: int, liveness: _Liveness, pin: bool) -> None:
        self.client, self.fn, self.part, self.retries, self.liveness = client, fn, part, retries, liveness
        self.pin = pin
        self.wait = require_distributed().wait
        self.parts: dict[object, _Copy] = {}
        self.load: dict[str, int] = {}          # bytes of this run's parts scattered to each worker
        self.pending: deque[_Unit] = deque()

    def submit(self, key, payload, resubmitted: int = 0) -> _Unit:
        if key not in self.parts:
            self.parts[key] = self._scatter(self.part(key), 0)
        copy = self.parts[key]
        pinned = {} if copy.holder is None else {"workers": [copy.holder], "allow_other_workers": False}
        import dask

        # a unit's payload is its rows (UNIT_ROWS of them, some megabytes), sent with the
        # task on purpose: Dask's warning about large graphs is not for this
        with dask.config.set({"distributed.admin.large-graph-warning-threshold": "1GiB"}):
            future = self.client.submit(self.fn, copy.future, payload, pure=False, **pinned)
        return _Unit(key, payload, future, copy.generation, resubmitted)

    def _scatter(self, value, generation: int) -> _Copy:
        """``value`` on one worker, as a :class:`_Copy`. Unpinned, the scheduler waits
        ``poll`` seconds for a worker; pinned, the target is chosen among the running
        workers (none: wait ``poll`` seconds). A failed transfer (its target died) is tried
        again, up to ``retries`` times while the scheduler has running workers; with none,
        the liveness bound decides."""
        from dask.sizeof import sizeof

        size = int(sizeof(value)) if self.pin else 0
        failures = 0
        while True:
            target = None
            if self.pin:
                target = self._target(size)
                if target is None:
                    time.sleep(self.liveness.poll)
                    self.liveness.check()
                    continue
            try:
                # a one-element list: one key for the whole value, even a tuple
                future = self.client.scatter([value], hash=False, timeout=self.liveness.poll,
                                             workers=None if target is None else [target])[0]
            except (OSError, TimeoutError):
                if self.liveness.check():
                    failures += 1
                    if failures > self.retries:
                        raise
                continue
            if target is not None:
                self.load[target] = self.load.get(target, 0) + size
            return _Copy(future, generation, target, size)

    def _target(self, size: int) -> str | None:
        """The running worker that would hold the fewest bytes of this run's parts per
        thread with ``size`` more (ties: the first address); None if none is running."""
        running = self.liveness.running_workers()
        if not running:
            return None
        return min(sorted(running), key=lambda w: (self.load.get(w, 0) + size) / max(running[w], 1))

    def take(self) -> tuple[tuple[object, object], object]:
        """The oldest unit's ``((key, payload), result)``, once it has one. Its completion is
        awaited ``poll`` seconds at a time (between two, pinned units whose holder left are
        submitted again); then its result is fetched within ``timeout`` seconds (a fetch
        that fails or is cut short is tried again after the liveness check: the scheduler
        computes a result lost with its holder again, or drops it with its part)."""
        while True:
            unit = self.pending[0]
            try:
                self.wait([unit.future], timeout=self.liveness.poll)
            except TimeoutError:
                self.liveness.check()
                if self.pin:
                    self._resubmit_stranded()
                continue
            except CancelledError:
                pass
            try:
                result = unit.future.result(timeout=self.liveness.timeout)
            except CancelledError:
                self._resubmit_dropped()
                continue
            except (OSError, TimeoutError):
                if unit.future.status == "error":      # the unit itself raised it
                    raise
                self.liveness.check()                  # the fetch failed: its holder lost, or the scheduler
                continue
            self.liveness.progressed()
            self.pending.popleft()
            return (unit.key, unit.payload), result

    def _resubmit_dropped(self) -> None:
        """Submit again every unit in flight that the scheduler dropped (the client drops
        them all when it loses the scheduler: then the run ends)."""
        if self.client.status != "running":
            raise _scheduler_lost()
        self._resubmit(lambda unit: unit.future.cancelled(), lambda copy: False)

    def _resubmit_stranded(self) -> None:
        """Submit again every unfinished unit pinned to a worker the scheduler no longer lists
        (no answer, or no worker at all: nothing is decided here, the liveness bound is)."""
        listed = self.liveness.workers()
        if not listed:
            return
        gone = {key for key, copy in self.parts.items() if copy.holder is not None and copy.holder not in listed}
        if gone:
            self._resubmit(lambda unit: unit.key in gone and unit.future.status != "finished",
                           lambda copy: copy.holder not in listed)

    def _resubmit(self, dropped: Callable[[_Unit], bool], stale: Callable[[_Copy], bool]) -> None:
        """Submit again the units in flight that ``dropped`` names, each part first scattered
        again if the unit's copy is current, the client knows it lost, or it is ``stale``."""
        for n, unit in enumerate(self.pending):
            if not dropped(unit):
                continue
            if unit.resubmitted >= self.retries:
                raise ClusterError(f"a work unit was dropped {unit.resubmitted + 1} times, its data lost each time "
                                   f"with the worker that held it (a unit that kills its worker does this); "
                                   f"{NO_REPORT}",
                                   fix="check the workers (memory, logs) and run again")
            copy = self.parts[unit.key]
            if copy.generation == unit.generation or copy.future.status != "finished" or stale(copy):
                if copy.holder is not None:
                    self.load[copy.holder] = self.load.get(copy.holder, 0) - copy.size
                self.parts[unit.key] = self._scatter(self.part(unit.key), copy.generation + 1)
                copy.future.release()
            unit.future.release()
            self.pending[n] = self.submit(unit.key, unit.payload, unit.resubmitted + 1)

    def release(self) -> None:
        """Let the cluster forget this run's units and parts (non-blocking, even with the scheduler gone)."""
        for unit in self.pending:
            unit.future.release()
        for copy in self.parts.values():
            copy.future.release()
        self.pending.clear()
        self.parts.clear()


def local_cluster(n: int):
    """A ``LocalCluster`` of ``n`` single-threaded worker processes, without the
    ``MALLOC_TRIM_THRESHOLD_`` Dask puts in its workers' environment: with it, glibc hands
    every large temporary array back to the system and maps it again, and the certified
    pass ran 1.5× slower per unit (measured at 300k facts: 35.6 s of unit time against
    24.0 s without it). Setting it to any value would not do: glibc then also stops
    adapting its mmap threshold, which is what keeps large arrays off fresh mappings."""
    import dask

    distributed = require_distributed()
    # a None value unsets the variable (distributed.nanny._get_env_variables); other keys stay
    with dask.config.set({"distributed.nanny.pre-spawn-environ": {"MALLOC_TRIM_THRESHOLD_": None}}):
        return distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0")


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """No log record below CRITICAL in this process while inside: the client's own log
    lines (e.g. tracebacks as it gives up reconnecting to a lost scheduler, or the
    messages of a ``LocalCluster``'s scheduler and nannies, which live here) would break
    the command's one-line error. The faults they tell of are handled, or end the run
    with that line; the workers' and a remote scheduler's logs keep them."""
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def connect(spec: str, timeout: float = NO_WORKER_TIMEOUT,
            warm_up: Callable[[], object] | None = None) -> Iterator[DaskExecutor]:
    """An executor on the cluster named by ``spec`` (``local:N`` or a scheduler address);
    ``timeout``, ``warm_up``: see :class:`DaskExecutor`. A remote scheduler is given
    ``min(CONNECT_TIMEOUT, timeout)`` to answer, first and after a lost connection."""
    import dask.utils

    distributed = require_distributed()
    with _quiet_logs():
        if spec.startswith("local:"):
            try:
                n = int(spec.split(":", 1)[1])
            except ValueError:
                n = 0
            if n < 1:
                raise TaskError(f"--scheduler {spec}: the number of local workers must be a positive integer",
                                fix="write e.g. --scheduler local:2")
            with local_cluster(n) as cluster, distributed.Client(cluster) as client:
                yield DaskExecutor(client, timeout=timeout, warm_up=warm_up)
            return
        try:
            client = distributed.Client(spec, timeout=min(dask.utils.parse_timedelta(CONNECT_TIMEOUT), timeout))
        except (OSError, TimeoutError, ValueError) as exc:
            raise TaskError(f"--scheduler {spec}: cannot reach a Dask scheduler ({exc})",
                            fix="start one with `dask scheduler` and give its address, e.g. tcp://HOST:8786, "
                                "or use --scheduler local:N") from None
        with client:
            yield DaskExecutor(client, timeout=timeout, warm_up=warm_up)
