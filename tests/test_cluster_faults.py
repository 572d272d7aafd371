"""``check --scheduler`` on a real deployment that loses workers: the same report, or one line.

Each test starts what a user starts (:mod:`audit.deployment`): ``dask scheduler`` and two
``dask worker`` processes (each ``--nworkers 1 --nthreads 1``, with its nanny) on loopback
at free ports, and runs ``python -m verifier check --scheduler`` as a subprocess on a
generated set of 10k facts, whose evidence phase (the leave-one-out rebuilds) and
certified pass each take a few seconds. The test watches the scheduler and, as soon as a
unit of the phase it targets is processing, makes a worker the only holder of the
scattered data (the shared state of the evidence phase, or some shards) and SIGKILLs it
and its nanny: the data is lost, which is the worst case. Then:

* one worker killed in the evidence phase, or in the certified pass: the JSON report
  equals the local run's, timings aside;
* every worker killed, or the scheduler killed: exit status 2, one line on stderr, no
  report written.

Every run has a bound (the subprocess's timeout, far above its few seconds): a run that
hangs fails its test instead of hanging the suite. This checks liveness, not speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from repository import ROOT

distributed = pytest.importorskip("distributed")

from audit.deployment import EVIDENCE, PASS, PhaseMissed, deploy  # noqa: E402
from cli.main import main  # noqa: E402
from tasks.synthetic import wikidata_like  # noqa: E402
from tasks.writing import dump_tasks  # noqa: E402

FACTS = 10_000
BOUND = 180            # seconds: far above a run's few seconds; reached only by a hang
NO_WORKER = "3"        # --cluster-timeout of these runs


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "tasks.yaml"
    dump_tasks(wikidata_like(FACTS, seed=3), path, facts_dir=path.parent / "facts")
    return path


@pytest.fixture(scope="module")
def local_report(tasks_file) -> dict:
    out = tasks_file.parent / "local.json"
    assert main(["check", str(tasks_file), "--json", str(out), "--quiet"]) == 0
    return _comparable(out)


def _comparable(path: Path) -> dict:
    report = json.loads(path.read_text())
    report.pop("seconds")
    return report


@pytest.fixture
def deployment(tmp_path):
    with deploy(tmp_path, _env()) as d:
        yield d


def _check(deployment, tasks_file: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "verifier", "check", str(tasks_file), "--scheduler",
                             deployment.address, "--cluster-timeout", NO_WORKER, "--json", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)


def _finish(run: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = run.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        run.kill()
        run.communicate()
        pytest.fail(f"the run did not end within {BOUND} s (a hang)")
    return run.returncode, err


def _hit(deployment, tasks_file: Path, tmp_path: Path, act, attempts: int = 3):
    """A check started, and ``act(run)``, which waits for a unit of a phase to be processing
    and then injects the fault: (the run, its report's path). A run that ends before the
    scheduler is seen with such a unit (on a loaded machine a phase's units can come and go
    between two polls) had no fault injected and proves nothing: it is started again, at
    most ``attempts`` times in all, and the test fails if no run was hit."""
    for attempt in range(attempts):
        out = tmp_path / f"remote-{attempt}.json"
        run = _check(deployment, tasks_file, out)
        try:
            act(run)
            return run, out
        except PhaseMissed as exc:
            run.kill()
            missed = f"{exc}: {run.communicate()[1]}"
    pytest.fail(f"in each of {attempts} runs, {missed}")


def _killed_in(deployment, tasks_file: Path, tmp_path: Path, phase: str):
    """:func:`_hit` by killing, as soon as a unit of ``phase`` is processing, a worker that
    holds the only copy of scattered data."""
    pids = deployment.pids()
    return _hit(deployment, tasks_file, tmp_path,
                lambda run: deployment.kill_worker(pids[deployment.victim(phase, run, BOUND)]))


@pytest.mark.parametrize("phase", [EVIDENCE, PASS])
def test_a_worker_lost_in_each_phase_changes_nothing(deployment, tasks_file, local_report, tmp_path, phase):
    """The worker killed holds the only copy of scattered data: that data is scattered
    again and its units rerun, and the report is the local one."""
    run, out = _killed_in(deployment, tasks_file, tmp_path, phase)
    code, err = _finish(run)
    assert code == 0, err
    assert "lose scattered data" in deployment.scheduler_log()     # the worst case did happen
    assert _comparable(out) == local_report


def test_every_worker_lost_ends_with_one_line(deployment, tasks_file, tmp_path):
    """Killed in the evidence phase: the shared state is lost with them, and scattering it
    again finds no worker until the timeout."""
    pids = deployment.pids()

    def kill_all(run):
        deployment.busy_with(EVIDENCE, run, BOUND)
        for worker in pids.values():
            deployment.kill_worker(worker)

    run, out = _hit(deployment, tasks_file, tmp_path, kill_all)
    code, err = _finish(run)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"no Dask worker has been running for {NO_WORKER} s" in err and "no report was produced" in err
    assert not out.exists()


def test_the_scheduler_lost_ends_with_one_line(deployment, tasks_file, tmp_path):
    def kill_scheduler(run):
        deployment.busy_with(PASS, run, BOUND)
        os.kill(deployment.scheduler.pid, signal.SIGKILL)

    run, out = _hit(deployment, tasks_file, tmp_path, kill_scheduler)
    code, err = _finish(run)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "connection to the Dask scheduler was lost" in err and "no report was produced" in err
    assert not out.exists()
