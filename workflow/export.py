"""``python -m verifier export``: the certified model written as an ONNX graph (float32).

The weights are built by the rule of ``check --precision`` (float32 by default:
:func:`workflow.check.build_for`; exact: the plain build), or taken from a saved
certificate or a weights file, which must fit the task set as ``check`` requires; the
graph's metadata names them (their sha256) and what certified them (:func:`exported`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from layout import Weights
from layout.digest import weights_digest
from layout.onnx_graph import save_onnx
from tasks.errors import TaskError
from tasks.model import TaskSet
from verifier.checks.verify import fitting
from workflow.errors import NotCertified


@dataclass(frozen=True)
class Exported:
    """What export wrote: the graph's size in bytes, the weights' vocabulary size and number
    of experts, the graph's metadata and notes on how the weights were built."""
    bytes: int
    vocabulary: int
    experts: int
    metadata: dict
    notes: list[str]


def export(taskset: TaskSet, output: str, *, weights: str | None = None, certificate: str | None = None,
           precision: str | None = None, ulps: float | None = None, epsilon: float | None = None,
           beta: float | None = None, gamma: float | None = None) -> Exported:
    """Write the graph of :func:`exported`'s weights to ``output`` (.onnx; needs the onnx extra)."""
    found, meta, notes = exported(taskset, weights=weights, certificate=certificate, precision=precision, ulps=ulps,
                                  epsilon=epsilon, beta=beta, gamma=gamma)
    save_onnx(found, output, source=weights or certificate or "weights", metadata=meta)
    return Exported(os.path.getsize(output), len(found.vocab), len(found.experts), meta, notes)


def exported(taskset: TaskSet, *, weights: str | None = None, certificate: str | None = None,
             precision: str | None = None, ulps: float | None = None, epsilon: float | None = None,
             beta: float | None = None, gamma: float | None = None) -> tuple[Weights, dict, list[str]]:
    """(the weights export writes, the graph's metadata, notes): built by the rule of ``check
    --precision`` (float32 by default: build_for; exact: the plain build), or taken from
    ``certificate`` or ``weights``, which must fit the task set as ``check`` requires."""
    import layout

    given = [flag for flag, v in (("--weights", weights), ("--certificate", certificate)) if v]
    if len(given) > 1:
        raise TaskError("--weights and --certificate exclude each other", fix="export one of them")
    if given and (precision is not None or ulps is not None or beta or gamma):
        flag = next(f for f, v in (("--precision", precision), ("--ulps", ulps), ("--beta", beta),
                                   ("--gamma", gamma)) if v is not None)
        raise TaskError(f"{flag} chooses how the model is built; {given[0]} exports given weights",
                        fix=f"drop {flag}, or drop {given[0]} to build")
    notes: list[str] = []
    if certificate:
        found, found_epsilon, certified = certified_weights(certificate, taskset)
    elif weights:
        found = layout.load(weights)
        found_epsilon, certified = None, ("not checked here: run check --weights on the same file for its certificate "
                                          "(the same sha256)")
    else:
        from workflow.build import model, model_for

        chosen = precision or "float32"
        if chosen == "exact":
            if ulps is not None:
                raise TaskError("--ulps needs --precision float32", fix="drop --ulps")
            built = model(taskset, epsilon, beta, gamma)
            certified = "built as 'check' builds: plain check certifies the exact forward pass of these weights"
        else:
            from verifier.passes.floating import DEFAULT_ULPS, Deployment
            from workflow.check import failing_checks

            dep = Deployment.named("float32", ulps if ulps is not None else DEFAULT_ULPS)
            built, notes, verified = model_for(taskset, dep, epsilon, beta, gamma)
            if not verified.certified:          # parameters pinned (else build_for refuses): nothing to export
                raise NotCertified(f"the float32 certificate does not hold at beta = {built.beta}, gamma = "
                                   f"{built.gamma} (failing: {failing_checks(verified)}); nothing written "
                                   f"(check --precision float32 with the same parameters shows the counterexamples)")
            certified = (f"built as 'check --precision float32' builds: the float32 certified pass (error, "
                         f"routing, size, entanglement) held at epsilon = {built.epsilon:g} for these weights; "
                         f"check --precision float32 certifies the same sha256")
        found, found_epsilon = built.instantiate(), built.epsilon
    fitting(taskset, found, weights or certificate or "weights")
    meta = {"weights_sha256": weights_digest(found), "certified": certified,
            "precision": precision or ("float32" if not given else ("exact" if certificate else "")),
            "epsilon": "" if found_epsilon is None else repr(float(found_epsilon)),
            "parameters": json.dumps({k: str(v) for k, v in (found.parameters or {}).items()
                                      if k in ("beta", "gamma")}, ensure_ascii=False)}
    return found, meta, notes


def certified_weights(directory: str, taskset: TaskSet) -> tuple[Weights, float, str]:
    """(weights, ε, the claim) of the certificate in ``directory``, which must be certified and
    be of ``taskset`` as it is now (every task's content hash the certificate's)."""
    from verifier.certificates.certificate import load_certificate, task_hash

    cert = load_certificate(directory)
    if not cert.certified:
        raise TaskError(f"the certificate in {directory} is NOT CERTIFIED; there is no certified model to export",
                        fix="fix what check reports, then check --certificate again")
    now = {t.name: task_hash(t, taskset) for t in taskset.tasks}
    if now != cert.resolved_hashes():
        raise TaskError(f"the certificate in {directory} is of another version of this task set",
                        file=directory, fix="re-certify the edit first (check --since DIR), then export")
    return cert.weights, cert.epsilon, (f"the weights of the certificate in {directory}: plain check certified their "
                                        f"exact forward pass at epsilon = {cert.epsilon:g}")
