"""Watching: keep a certificate in memory and re-certify each time the tasks file changes (``watch``).

A fresh ``check --since DIR`` spends most of its seconds on what does not depend on the
edit: starting Python and its libraries, reading and hash-checking the saved certificate
(132 MB at a million facts), writing it back. A watcher pays the first two once. It reads
the certificate in DIR (or, when DIR holds none, or one written by another version of
this tool, runs the full check that writes one), then polls the tasks file and its facts
files; when one changes it runs what ``check --since DIR`` runs, from the certificate it
holds, prints the verdict (which does not wait for the write), saves the new certificate
to DIR and holds that one. If the save fails, that is an error line, and the certificate
held stays the one last saved.

**Why a watcher's verdict is a ``check --since`` verdict.** After every check the
certificate it holds is the object it has just saved to DIR (the report's summary is
copied as plain JSON first, as it reads back), so the next check starts from what
``load_certificate(DIR)`` would return; a test runs the same edits through a watcher
and through ``check --since`` and compares the saved files. If DIR changes under it (a
``check --certificate DIR`` run elsewhere), the watcher reads DIR again before its next
check. The poll only decides *when* to look: each check reads the files afresh and the
facts cache hashes them (the hash recorded for a facts file is of the bytes its facts
were parsed from, whatever the timestamps say). A check during which an input file
changed (its size, inode, or modification or change time differ before and after the
read) is not reported: it may have read some files before a change and some after, so
it runs again.

**An edited facts file is read against its bytes before.** The watcher keeps each facts
file's bytes as its last read found them, with their key. When a task's file has changed
and its bytes before have the key the held certificate recorded for the task, only the
lines between the two versions' common prefix and suffix are read
(:mod:`tasks.splice`, which says why the facts are those a full read gives); otherwise,
or whenever the file is not in the plain form that argument needs, the file is read in
full. At a million facts that is about 30 MB held, the size of the facts files.

**Garbage collection.** The held certificate is millions of Python objects; a full
collection during a check would walk them all, for nothing (they stay alive until the
next save). After each save the watcher collects once (the certificate it dropped goes),
then moves what is left out of the collector's reach (``gc.freeze``): the checks that
follow walk only what they allocate. The verdict does not depend on it.

**Bad input** (a tasks file saved half-written, a fact with two objects) is reported in
one line, and the watcher waits for the next change: the certificate it holds is the
last one certified or refuted, untouched.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from tasks.errors import TaskError
from tasks.io import input_signature
from tasks.reading import Signature, file_signature
from verifier.certificates.certificate import FORMAT, FORMAT_FAMILY, save_certificate, stored_format
from verifier.checks.report import dumps, report_json  # noqa: F401  (each check's report, as watch writes it)


@dataclass
class Outcome:
    """One check: its report (None for bad input) or the error line, the seconds to the
    verdict, the edited tasks, the seconds spent saving the certificate after it (or why
    it was not saved), and why the JSON report was not written, if it was not."""

    report: object | None
    error: str | None
    seconds: float
    edited: list[str] = field(default_factory=list)
    saved_seconds: float = 0.0
    save_error: str | None = None
    report_error: str | None = None


def one_line(exc: Exception) -> str:
    """Bad input or a failed read or write, as the one line the watcher prints for it."""
    if isinstance(exc, TaskError):
        return str(exc)
    return f"{getattr(exc, 'filename', None) or ''}: {getattr(exc, 'strerror', None) or exc}".replace("\n", " ")


def _settle_memory() -> None:
    """One full collection, off the verdict's path, then every object left frozen (module
    docstring): the next check's collections skip the certificate held."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class Watcher:
    """A certificate held in memory for one tasks file and one certificate directory."""

    def __init__(self, tasks_path: str, directory: str, *, jobs: int = 1, isolation: bool = True) -> None:
        self.tasks_path, self.directory = tasks_path, directory
        self.jobs, self.isolation = jobs, isolation
        self.cert = None                     # the certificate last saved to ``directory``
        self.saved: Signature = ()           # certificate.json's status after that save
        self.inputs: Signature | None = None  # the inputs' status when the last check read them
        self.last: Outcome | None = None      # the last check's outcome
        self.composed: dict = {}              # the tasks file's YAML nodes, for the same text
        self.previous: dict = {}              # the facts files' (key, bytes) as the last read found them

    def _manifest(self) -> Signature:
        return file_signature([os.path.join(self.directory, "certificate.json")])

    def _held(self):
        """The certificate to start from: the one held, unless DIR was written by someone else."""
        if self.cert is None or self._manifest() != self.saved:
            from verifier.certificates.certificate import load_certificate

            self.cert = None
            self.cert = load_certificate(self.directory)
            self.saved = self._manifest()
        return self.cert

    def _none_to_start_from(self) -> bool:
        """Whether DIR holds no certificate to start from: none at all, or one this tool's
        other versions wrote (its hashes may mean something else; it is replaced by the full
        check's, as ``check --certificate DIR`` replaces it)."""
        if not os.path.exists(os.path.join(self.directory, "certificate.json")):
            return True
        found = stored_format(self.directory)
        return found is not None and found.startswith(FORMAT_FAMILY) and found != FORMAT

    def changed(self) -> bool:
        """Whether an input differs from what the last check read."""
        return self.inputs is None or input_signature(self.tasks_path) != self.inputs

    def check(self, verdict: Callable[[Outcome], None] | None = None) -> Outcome:
        """Read the inputs and certify them: from the certificate held (what ``check --since``
        does), or in full when DIR holds no certificate yet (``check --certificate``); then
        save the certificate and hold it. ``verdict`` receives the outcome as soon as it is
        known, before the save (the verdict does not wait for the write); the outcome
        returned also has ``saved_seconds``, or ``save_error``. A check during which an
        input changed is run again, unsaved and unreported."""
        while True:
            before = input_signature(self.tasks_path)
            start = time.perf_counter()
            try:
                outcome, cert = self._certify()
            except (TaskError, OSError) as exc:
                outcome, cert = Outcome(None, one_line(exc), time.perf_counter() - start), None
            if input_signature(self.tasks_path) != before:
                continue
            self.inputs, self.last = before, outcome
            if verdict is not None:
                verdict(outcome)
            if cert is not None:
                t0 = time.perf_counter()
                try:
                    save_certificate(cert, self.directory)
                    self.cert, self.saved = cert, self._manifest()
                except (TaskError, OSError) as exc:      # the held certificate stays the last one saved
                    outcome.save_error = one_line(exc)
                outcome.saved_seconds = time.perf_counter() - t0
            _settle_memory()
            return outcome

    def _certify(self):
        from workflow.certificates import build_for_certificate, check_and_record
        from workflow.since import read_since, recertify_since
        from tasks.io import load_tasks

        start = time.perf_counter()
        if self.cert is None and self._none_to_start_from():
            taskset = load_tasks(self.tasks_path)
            model, choice = build_for_certificate(taskset)
            report, cert = check_and_record(taskset, model, isolation=self.isolation, jobs=self.jobs,
                                            source=self.tasks_path, choice=choice)
            return Outcome(report, None, time.perf_counter() - start, list(taskset.names)), cert
        old = self._held()
        taskset, cache = read_since(self.tasks_path, old, self.composed, self.previous)
        self.previous = cache.read_now        # (each entry is used only under the key it was read with)
        read = time.perf_counter() - start
        report, edited, cert = recertify_since(taskset, old=old, cache=cache, isolation=self.isolation,
                                               jobs=self.jobs, source=self.tasks_path)
        report.incremental["phases"] = {"read tasks": round(read, 3), **report.incremental["phases"]}
        return Outcome(report, None, time.perf_counter() - start, edited), cert


def watch(watcher: Watcher, emit: Callable[[Outcome], None], *, saved: Callable[[Outcome], None] | None = None,
          interval: float = 0.1, max_checks: int | None = None,
          sleep: Callable[[float], None] = time.sleep) -> Outcome | None:
    """Check once, then again after each change of an input (looked for every ``interval``
    seconds), until ``max_checks`` checks have been made (or forever). ``emit`` receives
    each outcome as soon as its verdict is known, ``saved`` after the certificate was
    saved. Returns the last outcome."""
    last, done = None, 0
    while max_checks is None or done < max_checks:
        if done and not watcher.changed():
            sleep(interval)
            continue
        last = watcher.check(emit)
        done += 1
        if saved is not None and last.report is not None:
            saved(last)
    return last


def require_directory(tasks_path: str, directory: str) -> None:
    """Refuse (TaskError), before the first check, a certificate directory a watcher cannot
    keep: not a directory, no parent, an input file or one holding one, or one whose
    replacing would lose something of the user's (checked again at each save)."""
    import os

    from tasks.io import input_files
    from verifier.certificates.certificate import require_replaceable
    from workflow.certificates import refuse_inputs_in

    if os.path.exists(directory) and not os.path.isdir(directory):
        raise TaskError("exists and is not a directory", file=directory, fix="give a directory for the certificate")
    if not os.path.isdir(os.path.dirname(os.path.abspath(directory))):
        raise TaskError("the certificate's parent directory does not exist", file=directory, fix="create it first")
    refuse_inputs_in(directory, input_files(tasks_path))
    require_replaceable(directory)


def watcher(tasks_path: str, directory: str, *, jobs: int = 1, isolation: bool = True) -> Watcher:
    """A :class:`Watcher` of ``tasks_path`` keeping the certificate in ``directory``, its
    ``jobs`` workers to be forked from this process."""
    from verifier.running.parallel import before_forking

    before_forking(jobs)
    return Watcher(tasks_path, directory, jobs=jobs, isolation=isolation)
