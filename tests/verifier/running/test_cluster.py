"""``check --scheduler``: the same report on a Dask cluster, and no certificate with a shard missing.

A two-worker ``LocalCluster`` (separate processes) runs the work units of a generated set
of about 100k facts; its JSON report must equal the local run's, timings aside, for a
model that certifies and for one that does not (same counterexamples). A worker killed
mid-run must leave the same report (its units rerun, its shards scattered again); a
unit that kills every worker, or a cluster without workers, one clear error line, never
a certificate. (tests/test_cluster_faults.py kills workers of a real deployment.)
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from budget import FULL, part
from repository import EXAMPLES

distributed = pytest.importorskip("distributed")

from workflow.check import check_built  # noqa: E402
from cli.main import main  # noqa: E402
from construction.model import build  # noqa: E402
from tasks.synthetic import wikidata_like  # noqa: E402
from verifier.running.cluster import ClusterError, DaskExecutor, _Liveness  # noqa: E402
from verifier.running.parallel import LocalPool  # noqa: E402
from verifier.checks.report import report_json  # noqa: E402
from verifier.checks.verify import verify  # noqa: E402
from tasks.io import load_tasks  # noqa: E402

CAPITALS = str(EXAMPLES / "capitals.yaml")


def _comparable(report) -> dict:
    out = report_json(report)
    out.pop("seconds")
    return out


@pytest.fixture(scope="module")
def client():
    from verifier.running.cluster import local_cluster

    with local_cluster(2) as cluster:
        with distributed.Client(cluster) as c:
            yield c


@pytest.fixture(scope="module")
def big():
    ts = wikidata_like(100_000 if FULL else 20_000, seed=5)      # (tests/budget.py: 20k facts by default)
    model = build(ts)
    return ts, model, model.instantiate()


def test_dask_report_equals_local_on_100k_facts(client, big):
    ts, model, weights = big
    import warnings

    local = check_built(ts, model, weights=weights, executor=LocalPool(1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        remote = check_built(ts, model, weights=weights, executor=DaskExecutor(client, unit_rows=10 ** 9))
    # units of many rows are graphs of several megabytes, sent so on purpose: no warning for the user
    assert not [w for w in seen if "large graph" in str(w.message)], [str(w.message) for w in seen]
    assert local.certified and remote.certified
    assert remote.queries == remote.enumerated == local.queries > (500_000 if FULL else 100_000)
    assert _comparable(remote) == _comparable(local)


def test_dask_report_equals_local_when_not_certified(client, big):
    """Weights with the unembedding scaled down: many queries over ε, the same ones both ways."""
    ts, model, weights = big
    import dataclasses

    weak = dataclasses.replace(weights, U=weights.U * 0.25)
    local = verify(ts, weak, model.epsilon, executor=LocalPool(1))
    remote = verify(ts, weak, model.epsilon, executor=DaskExecutor(client))
    assert not local.certified and local.counterexamples
    assert _comparable(remote) == _comparable(local)


def test_a_worker_killed_mid_run_changes_nothing(client, big):
    ts, model, weights = big
    local = verify(ts, weights, model.epsilon, executor=LocalPool(1))
    pids = client.run(os.getpid)
    victim = sorted(pids.values())[0]
    killed = []

    def progress(done, total):
        if not killed and total > 0:
            os.kill(victim, signal.SIGKILL)
            killed.append(done)

    remote = verify(ts, weights, model.epsilon, executor=DaskExecutor(client), progress=progress)
    assert killed and killed[0] < remote.queries
    assert _comparable(remote) == _comparable(local)
    client.wait_for_workers(2, timeout=60)


def test_the_units_of_a_part_run_where_it_was_scattered(client):
    """Every unit of a part runs on its holder, on the one copy there: left to itself, the
    scheduler gives some to the idle worker, which fetches a copy of its own (and a
    shard's tables were built again for each copy)."""

    class Counted:
        def __init__(self) -> None:
            self.uses = 0

    def use(part, payload):
        import os
        import time

        part.uses += 1
        time.sleep(payload)
        return os.getpid(), part.uses

    results = [r for _, r in DaskExecutor(client).map_keyed(use, lambda key: Counted(), [(0, 0.02)] * 40)]
    assert len({pid for pid, _ in results}) == 1
    assert sorted(uses for _, uses in results) == list(range(1, 41))


def test_the_warm_up_runs_once_on_each_worker_and_decides_nothing(client, capitals_set, capitals_model):
    """The executor submits its warm-up once to each worker as it is made; a warm-up that
    fails leaves the report what it is without one."""

    def pid() -> int:
        import os

        return os.getpid()

    def fails() -> None:
        raise RuntimeError("this warm-up fails")

    warming = DaskExecutor(client, warm_up=pid)._warming
    assert sorted(f.result(timeout=60) for f in warming) == sorted(client.run(pid).values())
    weights, eps = capitals_model.instantiate(), capitals_model.epsilon
    failing = DaskExecutor(client, warm_up=fails)
    report = verify(capitals_set, weights, eps, executor=failing)
    assert {f.exception(timeout=60).args[0] for f in failing._warming} == {"this warm-up fails"}
    assert report.certified
    assert _comparable(report) == _comparable(verify(capitals_set, weights, eps, executor=LocalPool(1)))


def test_a_retired_holder_changes_nothing(big):
    """A worker retired mid-run (its data moved to the other): the units pinned to it could
    run nowhere, so they are submitted again on a copy of their shard scattered to a
    worker that is there, and the report is the local one (before, the run waited for ever)."""
    import threading

    from verifier.running.cluster import local_cluster

    ts, model, weights = big
    local = verify(ts, weights, model.epsilon, executor=LocalPool(1))
    with local_cluster(2) as cluster, distributed.Client(cluster) as c:
        retired, out = [], {}

        def progress(done, total):
            if not retired:
                retired.append(c.retire_workers([sorted(c.nthreads())[0]], close_workers=True))

        def run():
            out["report"] = verify(ts, weights, model.epsilon, executor=DaskExecutor(c), progress=progress)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout=240)
        assert not worker.is_alive(), "the run did not end after a worker was retired (a hang)"
    assert retired and retired[0]
    assert _comparable(out["report"]) == _comparable(local)


def test_a_unit_that_always_kills_its_worker_fails_with_one_line(client):
    """The scheduler gives up on a unit after its allowed failures: a ClusterError, no results."""
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cl:
        with distributed.Client(cl) as c:
            with pytest.raises(ClusterError, match="no report was produced") as info:
                list(DaskExecutor(c).map(lambda shared, item: os._exit(3), None, [1, 2]))
    assert "\n" not in str(info.value)


def test_no_worker_ends_the_run_with_one_line():
    """A cluster without a running worker: the run stops after its timeout (scattering its
    shared state finds no worker), rather than waiting for ever."""
    with distributed.LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cl:
        with distributed.Client(cl) as c:
            with pytest.raises(ClusterError, match="no Dask worker has been running for 1 s") as info:
                list(DaskExecutor(c, timeout=1).map(lambda shared, item: item, None, [1, 2]))
    assert "\n" not in str(info.value)


class _Scheduler:
    """A stand-in for a client whose scheduler answers ``answer`` (an exception: raised),
    the client still counting itself as running (as one does for a while after its
    scheduler was killed)."""

    status = "running"

    def __init__(self, answer) -> None:
        self.answer = answer
        self.scheduler = type("rpc", (), {"ncores_running": None, "ncores": None})()

    def sync(self, rpc, callback_timeout):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer, message", [
    ({}, "no Dask worker has been running for 0.2 s"),
    (TimeoutError(), "the connection to the Dask scheduler was lost (it has not answered for 0.2 s)"),
    (OSError("connection refused"), "the connection to the Dask scheduler was lost (it has not answered for 0.2 s)"),
])
def test_the_liveness_bound_names_what_stopped(answer, message):
    """Out of time, the run names the scheduler when the scheduler stopped answering and
    the workers when it answered that none is running, whichever the client noticed
    first; until then a check returns the (no) running workers."""
    liveness = _Liveness(_Scheduler(answer), timeout=0.2)
    assert liveness.check() == {}
    time.sleep(0.25)
    with pytest.raises(ClusterError) as info:
        liveness.check()
    assert str(info.value).startswith(message) and "no report was produced" in str(info.value)


def test_a_scheduler_that_answers_again_keeps_the_run():
    client = _Scheduler(TimeoutError())
    liveness = _Liveness(client, timeout=0.2)
    time.sleep(0.25)
    client.answer = {"tcp://w": 1}
    assert liveness.check() == {"tcp://w": 1}
    client.answer = {}
    assert liveness.check() == {}                       # workers seen just now: within the bound


class _Lossy:
    """An executor that loses the result of one work unit (as a faulty engine might)."""

    shares_memory = True

    def map(self, fn, shared, items):
        for n, item in enumerate(items):
            if n != 1:
                yield item, fn(shared, item)


def test_a_lost_work_unit_is_never_certified(capitals_set, capitals_model):
    weights = capitals_model.instantiate()
    full = verify(capitals_set, weights, capitals_model.epsilon)
    assert full.certified and full.complete
    lossy = verify(capitals_set, weights, capitals_model.epsilon, executor=_Lossy())
    assert all(t.certified for t in lossy.tasks) and lossy.foreign == 0   # every check it ran passed ...
    assert lossy.queries < lossy.enumerated and not lossy.complete          # ... but a unit is missing
    assert not lossy.certified
    summary = __import__("verifier.checks.report", fromlist=["summary"]).summary
    assert "enumerated queries have results" in summary(lossy)


def test_cli_scheduler_local(capsys, tmp_path):
    out = tmp_path / "r.json"
    assert main(["check", CAPITALS, "--scheduler", "local:2", "--json", str(out), "--quiet"]) == 0
    remote = json.loads(out.read_text())
    assert main(["check", CAPITALS, "--json", str(out), "--quiet"]) == 0
    local = json.loads(out.read_text())
    remote.pop("seconds"), local.pop("seconds")
    assert remote == local and remote["enumerated_queries"] == remote["queries"]


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_deployed_pass_on_shards_equals_the_local_one(client, precision):
    """check --precision on a cluster: the shards run the deployed pass with the full
    weights' stages in their own numbering, so every enclosure is the local run's and the
    report is the same (geography: tokens, coordinates and experts cut and renumbered)."""
    from verifier.passes.floating import Deployment

    ts = load_tasks("examples/geography/tasks.yaml")
    weights = build(ts).instantiate()
    dep = Deployment.named(precision, accumulate="float32" if precision == "bfloat16" else None)
    local = verify(ts, weights, 0.01, deployment=dep, executor=LocalPool(1))
    remote = verify(ts, weights, 0.01, deployment=dep, executor=DaskExecutor(client))
    serial = verify(ts, weights, 0.01, deployment=dep, executor=_SerialShards(3))
    assert _comparable(remote) == _comparable(local) == _comparable(serial)
    assert remote.precision == precision and remote.queries == remote.enumerated > 30_000


def test_cli_scheduler_local_with_a_precision(tmp_path):
    out = tmp_path / "r.json"
    assert main(["check", CAPITALS, "--precision", "float32", "--scheduler", "local:2", "--json", str(out),
                 "--quiet"]) == 0
    remote = json.loads(out.read_text())
    assert main(["check", CAPITALS, "--precision", "float32", "--json", str(out), "--quiet"]) == 0
    local = json.loads(out.read_text())
    remote.pop("seconds"), local.pop("seconds")
    assert remote == local and remote["precision"] == "float32"


@pytest.mark.parametrize("argv, words", [
    (["--scheduler", "local:0"], "positive integer"),
    (["--scheduler", "local:2", "--jobs", "2"], "exclude each other"),
    (["--scheduler", "tcp://127.0.0.1:9"], "cannot reach a Dask scheduler"),
    (["--cluster-timeout", "5"], "needs --scheduler"),
    (["--cluster-timeout", "5", "--certificate", "cert"], "--cluster-timeout does not combine"),
])
def test_scheduler_errors_are_one_line(capsys, monkeypatch, argv, words):
    monkeypatch.setattr("verifier.running.cluster.CONNECT_TIMEOUT", "2s")
    assert main(["check", CAPITALS, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_shard_pickles_without_its_tables(capitals_model):
    """The work unit's shared state travels as weights + token map; tables are rebuilt."""
    import pickle

    from verifier.running.runner import Shard

    shard = Shard(capitals_model.instantiate(), np.arange(10))
    shard.prepared()
    copy = pickle.loads(pickle.dumps(shard))
    assert copy._pass is None and np.array_equal(copy.tmap, shard.tmap)


class _SerialShards:
    """The sharded path without a cluster: each part built once, units run in order."""

    shares_memory = False

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.built: dict = {}

    def map_keyed(self, fn, part, items):
        import pickle

        for key, payload in items:
            if key not in self.built:       # as a worker receives it: pickled, tables rebuilt
                self.built[key] = pickle.loads(pickle.dumps(part(key)))
            yield (key, payload), fn(self.built[key], payload)

    def map(self, fn, shared, items):
        for item in items:
            yield item, fn(shared, item)


def _sets():
    from audit.campaign import small_sets

    out = dict(small_sets())
    out["generated"] = wikidata_like(1000, seed=2)
    return out


#: operators whose mutants send some queries to an expert outside their shard (the deferral path)
MISROUTING = ("permute_experts", "tie_expert", "perturb_gate_row")


@pytest.mark.parametrize("name", sorted(_sets()))
def test_sharded_pass_equals_full_pass_on_every_mutant(name):
    """The cone-of-influence restriction (verifier.running.shards) gives the full pass's report for
    built weights and for one mutant of every operator (misrouting ones included: their
    rows are deferred and rerun over the full weights)."""
    from audit.campaign import mutate
    from audit.operators import OPERATORS

    ts = _sets()[name]
    model = build(ts)
    weights = model.instantiate()
    rng = np.random.default_rng(11)
    seen_deferred = False
    ops = sorted(OPERATORS.items())
    if name == "generated":   # a share of the operators, always with ones that misroute across shards
        ops = sorted(set(part(ops, 6)) | {(n, OPERATORS[n]) for n in MISROUTING})
    for op_name, op in ops:
        got = mutate(op, weights, rng) if op_name else None
        mutant = weights if got is None else got[0]
        try:
            local = verify(ts, mutant, model.epsilon, executor=LocalPool(1))
        except Exception as exc:  # a mutant the verifier refuses as bad input: both ways the same
            with pytest.raises(type(exc)):
                verify(ts, mutant, model.epsilon, executor=_SerialShards(3))
            continue
        sharded = verify(ts, mutant, model.epsilon, executor=_SerialShards(3))
        assert _comparable(sharded) == _comparable(local), (name, op_name)
        seen_deferred |= sharded.deferred > 0
    if name == "generated":
        assert seen_deferred   # some mutant misroutes across shards, and the deferral path ran


class _CountedShards(_SerialShards):
    """:class:`_SerialShards` that counts the pieces each unit carries."""

    def __init__(self, shards: int, unit_rows: int) -> None:
        super().__init__(shards)
        self.unit_rows, self.units = unit_rows, []

    def map_keyed(self, fn, part, items):
        def counted():
            for key, payload in items:
                self.units.append(len(payload))
                yield key, payload
        return super().map_keyed(fn, part, counted())


@pytest.mark.parametrize("unit_rows", [1, 3000, 10 ** 9], ids=["one piece", "a few pieces", "held back at most"])
def test_units_of_several_batches_change_nothing(unit_rows, monkeypatch):
    """A cluster unit carries the pieces of several batches of one part (DaskExecutor.unit_rows):
    the report is the local one, for weights that certify, for weights with many
    counterexamples and for a mutant whose rows are deferred to the full weights."""
    from audit.campaign import mutate
    from audit.operators import OPERATORS

    import dataclasses

    import verifier.checks.verify as checks

    monkeypatch.setattr(checks, "CHUNK", 1000)           # batches of 1000 rows: 14 of them
    ts = wikidata_like(1000, seed=2)
    model = build(ts)
    weights = model.instantiate()
    misrouted = mutate(OPERATORS["tie_expert"], weights, np.random.default_rng(0))[0]   # rows deferred
    got = []
    for w in (weights, dataclasses.replace(weights, U=weights.U * 0.25), misrouted):
        local = verify(ts, w, model.epsilon, executor=LocalPool(1))
        serial = _CountedShards(3, unit_rows)
        sharded = verify(ts, w, model.epsilon, executor=serial)
        assert _comparable(sharded) == _comparable(local)
        got.append(sharded)
    from verifier.running.runner import GROUP_WAIT

    most = max(serial.units)
    assert most == 1 if unit_rows == 1 else 1 < most <= GROUP_WAIT + 1
    assert got[0].certified and not got[1].certified and len(got[1].counterexamples) == 20   # (the most kept)
    assert got[2].deferred > 0
