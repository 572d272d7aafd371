"""Saved certificates: the full check that records its query classes, and its parameters.

``check --certificate DIR`` (and a watcher's first check) build the model with parameters
that leave room for growth (:func:`build_for_certificate`), run the full check recording
the query classes a later edit reuses (:func:`check_and_record`), and save the directory
(:func:`save_if_unchanged`; the format is :mod:`verifier.certificates.certificate`).
A directory that is or holds an input file is refused before anything is saved to it
(:func:`refuse_inputs_in`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from construction.model import SymbolicModel
from tasks.model import TaskSet
from verifier.checks.verify import Report
from workflow.check import check_built
from tasks.structure import structure_of


def summary_json(report: Report) -> dict:
    """The report as the certificate records it: plain JSON values, as they read back (a copy,
    so that what is added to the report later is not in it)."""
    import json

    from verifier.checks.report import report_json
    return json.loads(json.dumps(report_json(report), default=float))


def refuse_inputs_in(directory: str, inputs: Sequence[str]) -> None:
    """A certificate directory is replaced as a whole when it is saved: refused (TaskError)
    if it is an input file or holds one."""
    import os

    from tasks.errors import TaskError

    target = os.path.abspath(directory)
    for p in inputs:
        p = os.path.abspath(p)
        if p == target or os.path.commonpath([p, target]) == target:
            raise TaskError(f"the certificate directory {directory} is or holds an input file ({p}); saving "
                            f"replaces the whole directory", fix="give a directory of its own")


#: A saved certificate's computed γ serves a vocabulary this many times the task set's, so that
#: edits adding entities keep its parameters and stay incremental (docs/editing.md).
VOCABULARY_HEADROOM = 4


def build_for_certificate(taskset: TaskSet, epsilon: float | None = None, beta: float | None = None,
                          gamma: float | None = None) -> tuple[SymbolicModel, dict]:
    """The model a saved certificate is made of, and how its parameters were set: β and γ
    given (``beta``, ``gamma``) or written in the tasks file are kept ("pinned"); else the
    construction chooses them ("chosen"), γ for a vocabulary of :data:`VOCABULARY_HEADROOM`
    times the task set's, so that the certificate's parameters still serve an edit that adds
    entities up to that size (the proven bound grows with |V|, so a γ for more tokens also
    holds for fewer)."""
    from construction.model import build

    file = taskset.parameters
    reach = VOCABULARY_HEADROOM * taskset.vocabulary.size
    model = build(taskset, epsilon=epsilon, beta=beta, gamma=gamma, vocabulary_reach=reach)
    choice = {name: "pinned" if given is not None or name in file else "chosen"
              for name, given in (("beta", beta), ("gamma", gamma))}
    choice.update(vocabulary=reach if choice["gamma"] == "chosen" else taskset.vocabulary.size, L=taskset.L)
    return model, choice


def check_and_save(taskset: TaskSet, model: SymbolicModel, directory: str, *, isolation: bool = True, jobs: int = 1,
                   progress: Callable[[int, int], None] | None = None, source: str = "weights",
                   tasks_path: str | None = None, cell_queries: int | None = None, read_as=None,
                   choice: dict | None = None) -> Report:
    """``check --certificate DIR``: :func:`check_and_record`, the certificate saved to DIR
    (see :func:`save_if_unchanged` for ``read_as``; ``choice`` as :func:`build_for_certificate` returns it)."""
    report, cert = check_and_record(taskset, model, isolation=isolation, jobs=jobs, progress=progress, source=source,
                                    cell_queries=cell_queries, choice=choice)
    save_if_unchanged(cert, directory, tasks_path, read_as)
    report.notes.append(f"certificate saved to {directory}")
    return report


def save_if_unchanged(cert, directory: str, tasks_path: str | None, read_as=None) -> None:
    """Save ``cert`` to ``directory``, unless an input file of ``tasks_path`` was written since
    its status was ``read_as`` (:func:`tasks.io.input_signature`, taken before the inputs were
    read): the tasks file and its facts files may then have been read in versions that never
    existed together. (The certificate's pairing of each facts file's hash with its facts
    does not rest on this check, which sees only sizes and timestamps: the loader hashes
    the bytes it parses, ``Sources.facts_keys``.)"""
    from tasks.errors import TaskError
    from tasks.io import input_signature
    from verifier.certificates.certificate import save_certificate

    if read_as is not None and tasks_path is not None and input_signature(tasks_path) != read_as:
        raise TaskError("an input file was written while it was being checked; nothing was saved", file=tasks_path,
                        fix="run the check again once the files are saved")
    save_certificate(cert, directory)


def check_and_record(taskset: TaskSet, model: SymbolicModel, *, isolation: bool = True, jobs: int = 1,
                     progress: Callable[[int, int], None] | None = None, source: str = "weights",
                     cell_queries: int | None = None, choice: dict | None = None):
    """The full check, with the certificate that records its query classes for later edits
    (cells of about ``cell_queries`` queries, default ``verifier.checks.classes.CELL_QUERIES``):
    (report, certificate), nothing saved. ``choice``: how the model's parameters were set
    (:func:`build_for_certificate`), recorded in the certificate."""
    from verifier.certificates.certificate import Certificate, task_hash
    from verifier.checks.classes import CellPlan, ClassRecorder
    from verifier.certificates.locality import watched_neurons

    weights = model.instantiate()
    trie = structure_of(taskset)
    plan = CellPlan.of(taskset, trie) if cell_queries is None else CellPlan.of(taskset, trie, cell_queries)
    watched = watched_neurons(weights)
    recorder = ClassRecorder.for_weights(taskset, trie, plan, weights, model.epsilon, watched)
    report = check_built(taskset, model, weights=weights, isolation=isolation, jobs=jobs, progress=progress,
                         source=source, classes=recorder)
    cert = Certificate(model.epsilon, report.verdict, taskset, weights, recorder.table(), plan, watched,
                       summary_json(report), {t.name: task_hash(t) for t in taskset.tasks}, read_keys(taskset),
                       dict(choice or {}))
    return report, cert


def read_keys(taskset: TaskSet) -> dict[str, list[str]]:
    """What a certificate records of the facts files: per task, the keys of the bytes its
    facts were read from, as the loader recorded them (``Sources.facts_keys``). Never a
    second read of the files: a file written after the load would pair its hash with the
    facts of the bytes before, and a later ``check --since`` would reuse facts the file no
    longer holds. A task set not loaded from a file records none (its facts files, if any,
    are read again by the next ``check --since``)."""
    keys = taskset.sources.facts_keys if taskset.sources is not None else None
    if not keys:
        return {}
    return {t.name: list(keys[t.name]) for t in taskset.tasks if t.name in keys}
