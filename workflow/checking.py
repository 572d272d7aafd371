"""``python -m verifier check`` as a library call: given weights verified, a model built (for
a precision, if asked) and checked with the construction's evidence, or a certificate saved
or brought up to date (:func:`check`).

Verifying given weights loads the verifier alone: the construction (and sympy with it),
the certificates and the re-certification are imported only on the paths that use them.
"""

from __future__ import annotations

import time
from typing import Callable

import layout
from tasks.errors import TaskError
from tasks.io import input_files, input_signature, load_tasks
from verifier.checks.report import dumps, summary  # noqa: F401  (the report as check prints it)
from verifier.checks.verify import Report, verify
from verifier.passes.floating import Deployment
from verifier.running.parallel import before_forking
from workflow.execution import deployment as deployment_of
from workflow.execution import executor as executor_of
from workflow.execution import require_allowed


def check(tasks: str, *, weights: str | None = None, epsilon: float | None = None, beta: float | None = None,
          gamma: float | None = None, isolation: bool = True, jobs: int = 1, scheduler: str | None = None,
          cluster_timeout: float | None = None, precision: str = "exact", ulps: float | None = None,
          accumulate: str | None = None, certificate: str | None = None, since: str | None = None,
          progress: Callable[[int, int], None] | None = None) -> Report:
    """``python -m verifier check``: verify the ``weights`` given (an .npz), or build the
    model (for the deployment of ``precision``) and check it with the construction's
    evidence; with ``certificate`` or ``since``, the full check that saves a certificate or
    the re-certification from one (:func:`check_with_certificate`).
    The work runs on ``jobs`` local processes or the cluster at ``scheduler``."""
    deployment = deployment_of(precision, ulps, accumulate)
    if certificate or since:
        return check_with_certificate(tasks, deployment, weights=weights, epsilon=epsilon, beta=beta, gamma=gamma,
                                      isolation=isolation, jobs=jobs, scheduler=scheduler,
                                      cluster_timeout=cluster_timeout, certificate=certificate, since=since,
                                      progress=progress)
    taskset = load_tasks(tasks)
    with executor_of(jobs, scheduler, cluster_timeout, deployment) as executor:
        if weights:
            # the weights handed over, not kept here: verify lets them go once its pass has its tables
            return verify(taskset, layout.load(weights), epsilon or taskset.epsilon or 0.01, source=weights,
                          progress=progress, executor=executor, deployment=deployment)
        from workflow.build import model_for
        from workflow.check import check_built

        built = list(model_for(taskset, deployment, epsilon, beta, gamma, executor))
        notes, verified = built[1], built[2]
        # the model handed over, not kept here: check_built releases it before the pass
        report = check_built(taskset, built.pop(0), isolation=isolation, progress=progress, executor=executor,
                             deployment=deployment, verified=verified)
    report.notes.extend(notes)
    return report


def check_with_certificate(tasks: str, deployment: Deployment | None = None, *, weights: str | None = None,
                           epsilon: float | None = None, beta: float | None = None, gamma: float | None = None,
                           isolation: bool = True, jobs: int = 1, scheduler: str | None = None,
                           cluster_timeout: float | None = None,
                           certificate: str | None = None, since: str | None = None,
                           progress: Callable[[int, int], None] | None = None) -> Report:
    """``check --certificate DIR`` / ``--since DIR``: a full check that saves its certificate
    (:func:`check_and_save`), or a re-certification from one (:func:`workflow.since.check_since`).
    What does not combine with them (given weights, a cluster, a floating-point deployment:
    the verifier's table of combinations) is refused before anything is read."""
    from verifier.certificates.certificate import require_replaceable
    from workflow.certificates import build_for_certificate, check_and_save, refuse_inputs_in
    from workflow.since import check_since, load_since

    for flag, bad in (("--weights", weights), ("--cluster-timeout", cluster_timeout)):
        if bad:
            raise TaskError(f"--certificate and --since work on models this tool builds, on local processes; {flag} "
                            f"does not combine with them", fix=f"drop {flag}")
    require_allowed(deployment, scheduler, classes=True)
    for d in (since, certificate):
        if d:
            refuse_inputs_in(d, input_files(tasks))
    require_replaceable(certificate or since)      # before the check, and again at the save
    if since:
        for name, given in (("beta", beta), ("gamma", gamma)):
            if given is not None:
                raise TaskError(f"--since keeps the certificate's beta and gamma; --{name} does not combine with it",
                                fix=f"drop --{name}, or run a full check with --certificate")
        if epsilon is not None:
            raise TaskError("--since takes epsilon from the tasks file (else the certificate); --epsilon "
                            "does not combine with it",
                            fix="drop --epsilon, or run a full check with --certificate")
        start = time.perf_counter()
        read_as = input_signature(tasks)
        old, taskset, cache = load_since(tasks, since)
        read = time.perf_counter() - start
        before_forking(jobs)
        report, _ = check_since(taskset, since, certificate, old=old, cache=cache, isolation=isolation, jobs=jobs,
                                progress=progress, source=tasks, tasks_path=tasks, read_as=read_as)
        report.incremental["phases"] = {"read certificate and tasks": round(read, 3), **report.incremental["phases"]}
        return report
    read_as = input_signature(tasks)
    taskset = load_tasks(tasks)
    before_forking(jobs)
    model, choice = build_for_certificate(taskset, epsilon=epsilon, beta=beta, gamma=gamma)
    return check_and_save(taskset, model, certificate, isolation=isolation, jobs=jobs, progress=progress, source=tasks,
                          tasks_path=tasks, read_as=read_as, choice=choice)
