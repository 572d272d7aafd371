"""Running the verifier's work units on a Dask cluster (the ``dask`` extra).

:class:`DaskExecutor` implements :class:`verifier.parallel.Executor` on a
``distributed.Client``, in two ways:

* :meth:`DaskExecutor.map_keyed` (the certified pass): the verifier cuts the weights into
  shards of tasks (:mod:`verifier.shards`); each shard's weights are built on the client
  when first needed and scattered to *one* worker, and each work unit (a batch's rows of
  that shard) refers to its shard by future, so a worker holds only the shards it serves
  and a unit ships only its rows;
* :meth:`DaskExecutor.map` (the leave-one-out rebuilds): one shared state (task set and
  experts) scattered to every worker once (``broadcast=True``).

At most ``window`` units per worker thread are in flight and results are taken in the
order they were submitted, so the client holds a bounded number of compact results and
the report is the one a local run gives.

**Faults.** A worker that dies mid-run takes its units with it; the scheduler runs them
again on another worker (up to ``distributed.scheduler.allowed-failures`` times per
unit). A shard lost with its worker is built and scattered again and its units are
resubmitted (up to ``retries`` times per unit); a broadcast state survives while one
worker holding it does. If a unit still cannot be completed, or the scheduler goes
away, :meth:`map` and :meth:`map_keyed` raise a
:class:`ClusterError` (one line, exit status 2): there is no report, and in particular
no certificate. The report itself also counts the queries sent and the queries whose
results were recorded, and certifies only when they agree.

:func:`connect` opens a client from the command line's ``--scheduler`` value:
``local:N`` starts a ``LocalCluster`` of N single-threaded worker processes on this
machine; anything else is a scheduler address such as ``tcp://10.0.0.5:8786``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import CancelledError
from typing import Callable, Iterable, Iterator, TypeVar

from tasks.errors import TaskError

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")

INSTALL_HINT = "install the dask extra: pip install -e .[dask]"
CONNECT_TIMEOUT = "20s"


class ClusterError(TaskError):
    """The cluster could not complete the run (no report is produced)."""


def require_distributed():
    try:
        import distributed
    except ImportError:
        raise TaskError("dask.distributed is not installed", fix=INSTALL_HINT) from None
    return distributed


class DaskExecutor:
    """Work units on a Dask cluster through ``client``; see the module docstring.

    ``shards``: how many shards of tasks the certified pass cuts the weights into
    (default: two per worker thread), each scattered to one worker."""

    shares_memory = False

    def __init__(self, client, window: int = 2, shards: int | None = None, retries: int = 3) -> None:
        self.client, self.window, self.retries = client, window, retries
        self._shards = shards

    @property
    def shards(self) -> int:
        return self._shards if self._shards is not None else 2 * (sum(self.client.nthreads().values()) or 1)

    def _slots(self) -> int:
        threads = sum(self.client.nthreads().values()) or 1
        return max(2, self.window * threads)

    def map(self, fn: Callable[[S, T], R], shared: S, items: Iterable[T]) -> Iterator[tuple[T, R]]:
        distributed = require_distributed()
        client = self.client
        pending: deque = deque()
        shared_future = None
        try:
            shared_future = client.scatter(shared, broadcast=True, hash=False)
            slots = self._slots()
            for item in items:
                pending.append((item, client.submit(fn, shared_future, item, pure=False)))
                if len(pending) >= slots:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        except (distributed.KilledWorker, distributed.comm.CommClosedError, CancelledError, OSError, TimeoutError) as exc:
            # CancelledError: the scheduler dropped a unit, e.g. after losing every copy of
            # the scattered weights with the workers that held them
            raise ClusterError(f"the Dask cluster could not complete the run ({type(exc).__name__}: {exc}); "
                               f"no report was produced",
                               fix="check the workers (memory, logs) and run again") from None
        finally:
            for _, future in pending:
                future.cancel()
            if shared_future is not None:
                client.cancel([shared_future])


    def map_keyed(self, fn: Callable[[S, T], R], part: Callable[[object], S],
                  items: Iterable[tuple[object, T]]) -> Iterator[tuple[tuple[object, T], R]]:
        """``fn(part(key), payload)`` for each ``(key, payload)``, in order. Each ``part(key)``
        is built here when first needed and scattered to one worker (no copy elsewhere);
        when a worker dies with it, it is built and scattered again and the units that
        needed it are resubmitted (up to ``retries`` times per unit)."""
        distributed = require_distributed()
        client = self.client
        parts: dict = {}
        pending: deque = deque()

        def submit(key, payload):
            if key not in parts:
                parts[key] = client.scatter(part(key), hash=False)
            return client.submit(fn, parts[key], payload, pure=False)

        def result(key, payload, future):
            for attempt in range(self.retries + 1):
                try:
                    return future.result()
                except CancelledError:      # the worker holding the part died with it
                    if attempt == self.retries:
                        raise
                    if key in parts and parts[key].status != "finished":
                        del parts[key]              # lost: build and scatter it again
                    future = submit(key, payload)
            raise AssertionError("unreachable")

        try:
            slots = self._slots()
            for key, payload in items:
                pending.append(((key, payload), submit(key, payload)))
                if len(pending) >= slots:
                    (k, p), future = pending.popleft()
                    yield (k, p), result(k, p, future)
            while pending:
                (k, p), future = pending.popleft()
                yield (k, p), result(k, p, future)
        except (distributed.KilledWorker, distributed.comm.CommClosedError, CancelledError, OSError, TimeoutError) as exc:
            raise ClusterError(f"the Dask cluster could not complete the run ({type(exc).__name__}: {exc}); "
                               f"no report was produced",
                               fix="check the workers (memory, logs) and run again") from None
        finally:
            for _, future in pending:
                future.cancel()
            client.cancel(list(parts.values()))


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
def connect(spec: str) -> Iterator[DaskExecutor]:
    """An executor on the cluster named by ``spec`` (``local:N`` or a scheduler address)."""
    distributed = require_distributed()
    cluster = None
    try:
        if spec.startswith("local:"):
            try:
                n = int(spec.split(":", 1)[1])
            except ValueError:
                n = 0
            if n < 1:
                raise TaskError(f"--scheduler {spec}: the number of local workers must be a positive integer",
                                fix="write e.g. --scheduler local:2")
            cluster = local_cluster(n)
            client = distributed.Client(cluster)
        else:
            try:
                client = distributed.Client(spec, timeout=CONNECT_TIMEOUT)
            except (OSError, TimeoutError, ValueError) as exc:
                raise TaskError(f"--scheduler {spec}: cannot reach a Dask scheduler ({exc})",
                                fix="start one with `dask scheduler` and give its address, e.g. tcp://HOST:8786, "
                                    "or use --scheduler local:N") from None
        with client:
            yield DaskExecutor(client)
    finally:
        if cluster is not None:
            cluster.close()
