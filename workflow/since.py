"""Re-certification after an edit: ``check --since DIR`` and each check of a watcher.

The task set is read against the certificate (facts files whose bytes are unchanged are
taken from it, :mod:`tasks.compiled`), the model is patched or built with the
certificate's parameters where they serve the edit, and only the queries the edit can
reach run again (:mod:`verifier.certificates.incremental`); the parameters the construction chose are
chosen anew, with a full check, when they do not (:func:`recertify_since`).
"""

from __future__ import annotations

import time
from typing import Callable

from tasks.structure import structure_of
from tasks.model import TaskSet
from verifier.running.parallel import in_background
from verifier.checks.verify import verify
from workflow.certificates import (VOCABULARY_HEADROOM, summary_json, build_for_certificate, check_and_record,
                                   read_keys, save_if_unchanged)

#: edited tasks with at least this many facts in all are checked for isolation in a forked
#: child while the pass runs (below it, the fork costs more than it saves)
BACKGROUND_FACTS = 20_000


def task_hashes_since(old, taskset: TaskSet, reused: set[str], token_map) -> tuple[dict[str, str | None], set[str]]:
    """(each task's content hash for the new certificate, the tasks edited since ``old``).

    A task taken from the certificate keeps its hash. A task read again is unedited when it
    has the same templates and, through ``token_map`` (old token id -> new id, by name:
    ``tasks.compiled.token_map_from``), the very fact ids it had: same name, templates and
    facts, so the same hash. Else it is edited, and its hash is left to be computed when
    the certificate is saved (None: ``Certificate.resolved_hashes``), after the verdict.
    Without a token map every task read again is hashed and compared, as before."""
    import numpy as np

    from verifier.certificates.certificate import task_hash

    hashes: dict[str, str | None] = {}
    edited: set[str] = set()
    old_ts = old.taskset
    old_names = set(old_ts.names)
    for k, t in enumerate(taskset.tasks):
        before = old.task_hashes.get(t.name)
        if t.name in reused:
            hashes[t.name] = before
            continue
        if token_map is not None and before is not None and t.name in old_names:
            o = old_ts.index(t.name)
            (s0, o0), (s1, o1) = old_ts.fact_ids[o], taskset.fact_ids[k]
            if old_ts.tasks[o].templates == t.templates and s0.size == s1.size \
                    and np.array_equal(token_map[s0], s1) and np.array_equal(token_map[o0], o1):
                hashes[t.name] = before
            else:
                hashes[t.name] = None
                edited.add(t.name)
            continue
        hashes[t.name] = task_hash(t, taskset)
        if before != hashes[t.name]:
            edited.add(t.name)
    return hashes, edited


def pinned_parameters(old, taskset: TaskSet) -> tuple[float, float]:
    """The certificate's β and γ (exact binary fractions), which an edit keeps: only then are
    the weights of what the edit did not touch unchanged."""
    from fractions import Fraction
    p = old.weights.parameters or {}
    try:
        return float(Fraction(p["beta"])), float(Fraction(p["gamma"]))
    except (KeyError, ValueError, ZeroDivisionError):
        from tasks.errors import TaskError
        raise TaskError("the certificate's weights do not record beta and gamma",
                        fix="write a new certificate") from None


def changed_entries(d, names, per_array: int = 6) -> dict[str, list[str]]:
    """A few changed entries of each array, by the construction's names: 'row <- column'."""
    out: dict[str, list[str]] = {}
    for key, m in d.matrices.items():
        if not m.rows.size:
            continue
        parts = key.split(".")
        if key == "E":
            row, col = (lambda i: names.tokens[i]), names.residual.label
        elif key == "U":
            row, col = (lambda i: names.tokens[i]), names.residual.label
        elif key == "W_G":
            row, col = (lambda i: f"expert:{names.experts[i]}"), names.residual.label
        elif parts[0] == "heads":
            h = int(parts[1])
            rows_space = {"W_Q": names.qk[h], "W_K": names.qk[h], "W_V": names.values[h],
                          "W_O": names.residual}[parts[2]]
            cols_space = names.values[h] if parts[2] == "W_O" else names.residual
            row, col = rows_space.label, cols_space.label
        elif parts[0] == "experts":
            neurons = names.neurons(int(parts[1]))
            row, col = ((neurons.label, names.residual.label) if parts[2] == "W_1"
                        else (names.residual.label, neurons.label))
        else:
            continue
        out[key] = [f"{row(int(r))} <- {col(int(c))}" for r, c in zip(m.rows[:per_array], m.cols[:per_array])]
    return out


def load_since(tasks_path: str, directory: str):
    """(the certificate in ``directory``, the tasks file read against it): facts files whose
    bytes are unchanged are taken from the certificate (tasks.compiled)."""
    from verifier.certificates.certificate import load_certificate

    old = load_certificate(directory)
    return (old, *read_since(tasks_path, old))


def read_since(tasks_path: str, old, composed: dict | None = None, previous: dict | None = None):
    """(the tasks file read against the certificate ``old``, the facts cache used);
    ``composed`` and ``previous`` as in :class:`tasks.compiled.FactsCache`."""
    from tasks.compiled import FactsCache
    from tasks.io import input_files, load_tasks

    cache = FactsCache(old.taskset, old.file_hashes, composed, previous)
    cache.warm(input_files(tasks_path)[1:])
    return load_tasks(tasks_path, cache=cache), cache


def check_since(taskset: TaskSet, directory: str | None = None, out: str | None = None, *, old=None, cache=None,
                isolation: bool = True, jobs: int = 1, progress: Callable[[int, int], None] | None = None,
                source: str = "weights", tasks_path: str | None = None, read_as=None):
    """``check --since DIR``: :func:`recertify_since`, then the updated certificate saved to
    ``out`` (default: DIR; see :func:`save_if_unchanged` for ``read_as``). Returns (report,
    edited task names)."""
    report, edited, cert = recertify_since(taskset, directory, old=old, cache=cache, isolation=isolation, jobs=jobs,
                                           progress=progress, source=source)
    t0 = time.perf_counter()
    save_if_unchanged(cert, out or directory, tasks_path, read_as)
    report.incremental["phases"]["save certificate"] = round(time.perf_counter() - t0, 3)
    report.seconds += report.incremental["phases"]["save certificate"]
    report.incremental["seconds"] = round(report.seconds, 3)
    return report, edited


def recertify_since(taskset: TaskSet, directory: str | None = None, *, old=None, cache=None, isolation: bool = True,
                    jobs: int = 1, progress: Callable[[int, int], None] | None = None, source: str = "weights"):
    """Re-certify an edited task set from a saved certificate (``old``, else the one in
    ``directory``). Returns (report, edited task names, the updated certificate), nothing
    saved: ``check --since`` saves it, ``watch`` also keeps it in memory as the next edit's
    ``old``.

    The certificate's β and γ are kept where it can serve the edit (:func:`_recertify_kept`:
    only the queries the edit can reach run again). Parameters the construction chose (not
    pinned by the user or the tasks file) are chosen anew, with a full check and a new
    certificate, when the edit goes beyond what they were chosen for (more tokens than the
    certificate's vocabulary reach, a longer template), or when the kept ones no longer
    certify the edited set and the construction would choose others: what a full check of the
    edited files gives. Pinned parameters are kept; if they no longer certify, the report
    names the parameter and the value the construction would choose. A certificate of
    another task set (no task in common) is refused."""
    from verifier.certificates.certificate import load_certificate

    old = old if old is not None else load_certificate(directory)
    _same_task_set(old, taskset, directory)
    epsilon = taskset.epsilon if taskset.epsilon is not None else old.epsilon
    # a certificate that does not record how its parameters were set (a library caller's model,
    # or an older version's certificate) keeps them, as before
    choice = old.choice or {"beta": "pinned", "gamma": "pinned"}
    free = [p for p in ("beta", "gamma") if choice.get(p) == "chosen" and p not in taskset.parameters]
    beyond = ""
    V, L = taskset.vocabulary.size, taskset.L
    if free and epsilon != old.epsilon:
        beyond = f"epsilon changed ({old.epsilon:g} -> {epsilon:g})"
    elif "gamma" in free and V > int(choice.get("vocabulary", 0)):
        beyond = (f"the edited set has {V} tokens, more than the {choice.get('vocabulary')} the certificate's "
                  f"gamma was chosen for")
    elif free and L != choice.get("L"):
        beyond = (f"the longest template now has {L} tokens (the certificate's parameters were chosen "
                  f"for {choice.get('L')})")
    kept = dict(zip(("beta", "gamma"), pinned_parameters(old, taskset)))
    # parameters the certificate was made with by the user's choice stay (the tasks file's are read by build)
    held = {p: kept[p] for p in ("beta", "gamma") if choice.get(p) != "chosen" and p not in taskset.parameters}
    if beyond:
        anew = " and ".join(p for p in ("beta", "gamma") if p in free)
        model, new_choice = build_for_certificate(taskset, epsilon=epsilon, **held)
        return _recertify_anew(taskset, old, f"{beyond}: {anew} chosen anew", epsilon=epsilon, model=model,
                               choice=new_choice, isolation=isolation, jobs=jobs, progress=progress, source=source,
                               cache=cache)
    report, edited, cert = _recertify_kept(taskset, old=old, cache=cache, isolation=isolation, jobs=jobs,
                                           progress=progress, source=source)
    cert.choice = dict(choice)
    if report.certified:
        return report, edited, cert
    if free:
        model, new_choice = build_for_certificate(taskset, epsilon=epsilon, **held)
        if (model.beta, model.gamma) != tuple(taskset.parameters.get(p, kept[p]) for p in ("beta", "gamma")):
            reason = (f"the certificate's parameters (beta = {_exact(kept['beta'])}, gamma = {_exact(kept['gamma'])}) "
                      f"do not certify the edited set; the construction chooses "
                      + ", ".join(f"{p} = {getattr(model, p)}" for p in free) + " for it")
            return _recertify_anew(taskset, old, reason, epsilon=epsilon, model=model, choice=new_choice,
                                   isolation=isolation, jobs=jobs, progress=progress, source=source, cache=cache)
    pinned = [p for p in ("beta", "gamma") if p not in free]
    if pinned:
        report.notes.append(_pinned_hint(taskset, old, pinned, epsilon))
    return report, edited, cert


def _exact(x: float) -> str:
    """A binary fraction as the construction writes it (31/4, 8)."""
    from fractions import Fraction

    return str(Fraction(x))


def _same_task_set(old, taskset: TaskSet, directory: str | None) -> None:
    """Refuse (TaskError) a certificate that shares no task with ``taskset``: it is of another
    task set, and re-certifying from it would replace it with a certificate of this one."""
    from tasks.errors import TaskError

    if not set(old.taskset.names) & set(taskset.names):
        theirs, ours = ", ".join(old.taskset.names[:4]), ", ".join(taskset.names[:4])
        raise TaskError(f"the certificate{' in ' + directory if directory else ''} is of another task set (its "
                        f"tasks: {theirs}; this file's: {ours}); nothing was changed",
                        fix="give the certificate made from this tasks file, or make one with check "
                            "--certificate NEWDIR")


def _pinned_hint(taskset: TaskSet, old, pinned: list[str], epsilon: float) -> str:
    """Which pinned parameter keeps the edited set from certifying, and the value the
    construction would choose for it (the smallest whose proven bound reaches ε, with the
    other parameter as it is)."""
    from fractions import Fraction

    from construction import bound
    from construction.model import route

    kept = dict(zip(("beta", "gamma"), pinned_parameters(old, taskset)))
    value = {p: taskset.parameters.get(p, kept[p]) for p in ("beta", "gamma")}
    where = []
    for p in pinned:
        file, line = taskset.parameter_source(p) if p in taskset.parameters else (None, None)
        place = f"pinned in {file}, line {line}" if file and line else "pinned when the certificate was made"
        where.append(f"{p} = {_exact(value[p])} ({place})")
    try:
        L = taskset.L
        beta = (bound.smallest_beta(L, route(taskset)[1].beta_condition()) if "beta" in pinned
                else Fraction(value["beta"]))
        gamma = bound.smallest_gamma(L, VOCABULARY_HEADROOM * taskset.vocabulary.size,
                                     Fraction(value["beta"]) if "beta" not in pinned else beta, epsilon)
        choice = {"beta": beta, "gamma": gamma}
        would = ("the construction would choose " + ", ".join(f"{p} = {choice[p]}" for p in pinned)
                 + " for the edited set")
    except Exception as exc:          # the edited set may not be constructible at all (reported elsewhere)
        would = f"the construction chooses no parameters for the edited set ({exc})"
    return f"{'; '.join(where)}: not changed by --since; {would} (remove the pin, or check --certificate anew)"


def isolation_note(how: dict[str, list[str]], edited: set[str]) -> str:
    """The report's note on how each task's isolation was settled by ``check --since``:
    ``how`` maps "carried" (from the certificate: an unedited task's unchanged expert),
    "checked" (built alone now) and "skipped" (isolation off) to task names."""
    def tasks(names: list[str]) -> str:
        kind = "edited " if all(n in edited for n in names) else "unedited " if not edited.intersection(names) else ""
        shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"the {kind}task {shown}" if len(names) == 1 else f"the {len(names)} {kind}tasks {shown}"

    parts = []
    if how["carried"]:
        parts.append(f"carried over from the certificate for {tasks(how['carried'])}")
    if how["checked"]:
        parts.append(f"built alone and checked for {tasks(how['checked'])}")
    if how["skipped"]:
        parts.append(f"not checked for {tasks(how['skipped'])} (--no-isolation)")
    return "isolation: " + "; ".join(parts)


def _recertify_anew(taskset: TaskSet, old, reason: str, *, epsilon: float, model=None, choice=None,
                    isolation: bool = True, jobs: int = 1, progress=None, source: str = "weights", cache=None):
    """A full check of the edited set with parameters chosen for it (the certificate's could
    not serve the edit: ``reason``), and its new certificate; the report says why."""
    from verifier.certificates.incremental import Incremental

    start = time.perf_counter()
    if model is None:
        model, choice = build_for_certificate(taskset, epsilon=epsilon)
    t_model = time.perf_counter() - start
    reused = cache.reused if cache is not None else set()
    _, edited = task_hashes_since(old, taskset, reused, None)
    report, cert = check_and_record(taskset, model, isolation=isolation, jobs=jobs, progress=progress, source=source,
                                    choice=choice)
    info = Incremental("full", reason)
    info.vocabulary_delta = taskset.vocabulary.size - old.taskset.vocabulary.size
    report.incremental = info.as_dict()
    report.incremental.update(phases={"model": round(t_model, 3),
                                      "full check": round(time.perf_counter() - start - t_model, 3)},
                              edited_tasks=sorted(edited), model="built in full, parameters chosen anew",
                              recertify_seconds=round(time.perf_counter() - start, 3))
    report.seconds = time.perf_counter() - start
    report.incremental["seconds"] = round(report.seconds, 3)
    return report, sorted(edited), cert


def _recertify_kept(taskset: TaskSet, *, old, cache=None, isolation: bool = True, jobs: int = 1,
                    progress: Callable[[int, int], None] | None = None, source: str = "weights"):
    """Re-certify with the certificate's β and γ (or the tasks file's), running again only the
    queries the edit can reach (verifier.certificates.incremental); the model is built from the
    certificate's weights where the edit allows (construction.patch)."""
    from fractions import Fraction

    from construction import bound
    from construction.evidence import unproven_note
    from construction.experts import alone_column_map, build_expert, same_expert
    from construction.model import build
    from construction.numbering import correspondence, numbering, same_subjects, seed_maps
    from construction.patch import patched_weights
    from construction.residual import residual_space
    from tasks.compiled import token_map_from
    from verifier.certificates.certificate import Certificate
    from verifier.checks.classes import CellPlan, ClassRecorder
    from verifier.certificates.incremental import recertify
    from verifier.certificates.locality import Correspondence, watched_neurons

    start = t0 = time.perf_counter()
    reused = cache.reused if cache is not None else set()
    pinned = pinned_parameters(old, taskset)
    # parameters written in the tasks file win (if they differ, every weight changes: a full check)
    beta, gamma = taskset.parameters.get("beta", pinned[0]), taskset.parameters.get("gamma", pinned[1])
    token_map = token_map_from(taskset, old.taskset.vocabulary)
    hashes, edited = task_hashes_since(old, taskset, reused, token_map)
    # the certificate's ε, unless the tasks file states one (as a full check would take it); a
    # different ε is a full check (verifier.certificates.incremental.full_reason)
    epsilon = taskset.epsilon if taskset.epsilon is not None else old.epsilon
    names: dict = {}                 # name maps between the two task sets' blocks, computed once
    old_names, new_names = numbering(old.taskset), numbering(taskset)
    if token_map is not None:        # the reader's map of old token ids to new ones (no name searched)
        seed_maps(names, old.taskset, taskset, token_map, [(old_names, new_names)])
    patched = None
    if (beta, gamma) == pinned:
        patched = patched_weights(old.weights, old.taskset, taskset, edited, Fraction(beta), Fraction(gamma), epsilon,
                                  memo=names)
    if patched is not None:
        weights, experts = patched
        model = None
        L, V = taskset.L, taskset.vocabulary.size
        kept = old.summary.get("closed_form") or {}
        if (L, V) == (old.taskset.L, old.taskset.vocabulary.size) and isinstance(kept.get("expression"), str) \
                and isinstance(kept.get("bound"), float) and old.summary.get("gate") == "closed form":
            # the bound is a function of (L, |V|, β, γ) alone, all unchanged: the certificate's
            # (hash-checked) expression and value are what computing them again gives
            closed_form, bound_value = kept["expression"], kept["bound"]
        else:
            closed_form, bound_value = (str(bound.error_bound(L, V)),
                                        bound.bound_upper(L, V, Fraction(beta), Fraction(gamma)))
        gate = "closed form"
        # the gate's condition needs the routing cells, which the patched model does not build:
        # the leak conditions alone can only show the bound unproven (None: not known)
        note_beta, unproven = Fraction(beta), bound.unproven_conditions(L, Fraction(beta), None)
        bound_proven = False if unproven else None
    else:
        model = build(taskset, epsilon=epsilon, beta=beta, gamma=gamma)
        weights, experts = model.instantiate(), {t.name: model.experts[k] for k, t in enumerate(taskset.tasks)}
        closed_form, bound_value, gate = str(model.error_bound()), model.bound_value(), model.gate.method
        note_beta, unproven = model.beta, model.unproven_conditions()
        bound_proven = not unproven
    t_model = time.perf_counter() - t0
    t0 = time.perf_counter()
    same_neurons = set(taskset.names) - edited
    if token_map is not None:
        same_neurons |= same_subjects(old.taskset, taskset, token_map)
    cor = Correspondence(**correspondence(old_names, new_names, same_neurons, memo=names))
    t_cor = time.perf_counter() - t0
    # the edited tasks' isolation (below) does not depend on the pass: a large one is checked
    # on the other core meanwhile (verifier.running.parallel.in_background; the same answer)
    def isolated_alone(k: int) -> bool:
        alone, task = taskset.alone(k), taskset.tasks[k]
        mine = experts.get(task.name) or build_expert(taskset, k, residual_space(taskset))
        by_itself = build_expert(alone, 0, residual_space(alone))
        return same_expert(by_itself, mine, alone_column_map(taskset, k, alone, by_itself.W_1.cols, mine.W_1.cols))

    ahead = [k for k, t in enumerate(taskset.tasks) if t.name in edited] if isolation else []
    big = jobs > 1 and sum(taskset.tasks[k].n_facts for k in ahead) >= BACKGROUND_FACTS
    isolated_ahead = in_background(lambda: {k: isolated_alone(k) for k in ahead}, fork=big)
    try:
        report, table, watched, info = recertify(old, taskset, weights, cor, epsilon, jobs=jobs, source=source,
                                                 progress=progress, edited=edited)
    except BaseException:
        if big:
            isolated_ahead()                 # the child reaped (its answer unused)
        raise
    if report is None:
        trie = structure_of(taskset)
        plan = CellPlan.of(taskset, trie)
        watched = watched_neurons(weights)
        recorder = ClassRecorder.for_weights(taskset, trie, plan, weights, epsilon, watched)
        report = verify(taskset, weights, epsilon, source=source, progress=progress, jobs=jobs, classes=recorder)
        table = recorder.table()
    else:
        plan = old.plan
    # the construction's evidence: the closed form at the new vocabulary; isolation carried over
    # for the tasks the edit left alone (their experts are unchanged, the diff shows it), checked
    # again for the edited ones (and for unedited ones the certificate holds no check of);
    # with isolation off, those are not checked (None)
    t0 = time.perf_counter()
    old_iso = {t["name"]: t.get("isolated") for t in old.summary.get("tasks", [])}
    done = isolated_ahead()
    isolated: list[bool | None] = []
    how: dict[str, list[str]] = {"carried": [], "checked": [], "skipped": []}
    for k, task in enumerate(taskset.tasks):
        if info.mode == "incremental" and task.name not in edited and old_iso.get(task.name):
            isolated.append(True)
            how["carried"].append(task.name)
        elif isolation:
            isolated.append(done[k] if k in done else isolated_alone(k))
            how["checked"].append(task.name)
        else:
            isolated.append(None)
            how["skipped"].append(task.name)
    report.attach(closed_form, bound_value, gate, isolated,
                  ([isolation_note(how, edited)] if info.mode == "incremental" else [])
                  + unproven_note(note_beta, unproven), bound_proven)
    report.incremental = info.as_dict()
    if info.diff is not None:
        report.incremental["changed_rows"] = changed_entries(info.diff, new_names)
    report.incremental["phases"] = {"model": round(t_model, 3), "correspondence": round(t_cor, 3), **info.phases,
                                    "isolation": round(time.perf_counter() - t0, 3)}
    report.incremental["edited_tasks"] = sorted(edited)
    report.incremental["model"] = "patched from the certificate's weights" if patched is not None else "built in full"
    file_hashes = read_keys(taskset)
    report.incremental["recertify_seconds"] = round(time.perf_counter() - start, 3)
    report.seconds = time.perf_counter() - start
    report.incremental["seconds"] = round(report.seconds, 3)
    cert = Certificate(epsilon, report.verdict, taskset, weights, table, plan, watched, summary_json(report),
                       hashes, file_hashes)
    return report, sorted(edited), cert
