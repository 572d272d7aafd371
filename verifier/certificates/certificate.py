"""A saved certificate: what a verification certified, kept so that an edit can be re-certified.

``check --certificate DIR`` writes a directory:

==================  ==================================================================
file                holds
==================  ==================================================================
certificate.json    format, ε, verdict, parameters (and whether each was chosen or pinned,
                    with the vocabulary a chosen γ serves), per-task records and content
                    hashes, the construction's evidence, and the SHA-256 of every other file
weights.npz         the certified weights (the layout of ``layout.npz``)
tasks.npz           the certified task set, compiled: vocabulary, per task its name,
                    templates and facts as token ids (``tasks.compiled``)
classes.npz         the query classes (``verifier.checks.classes``): cells, per-class summaries,
                    and which neurons were watched
==================  ==================================================================

**What it can be trusted for.** Every file's SHA-256 is checked when the certificate is
read, and so is a SHA-256 of certificate.json's own fields, so a file or field changed by
accident (or a directory mixed from two runs) is refused. The
directory is this tool's own record, though: whoever can write it can also rewrite the
hashes, and ``check --since`` takes its class summaries as proven. Use ``check --since``
with certificates you made; for weights or certificates from elsewhere, run a full check.

The directory is written in full beside the target and then moved into place: an
interrupted write leaves the previous certificate (or none), never a mixture.

**Only a certificate is replaced.** Saving replaces the target directory as a whole, so
it is written only where that loses nothing (:func:`require_replaceable`, called before a
check starts and again by :func:`save_certificate`): a directory that does not exist, an
empty one, or one that holds exactly a certificate's four files (regular files, its
certificate.json of this tool's format, of any version), and never the current directory
or one holding it (the process, and the shell it was started from, would be left in a
deleted directory). After the old directory is moved aside, its entries are looked at
once more: anything else in it (a file written in between) moves it back, and the save
is refused. Only the certificate's files are deleted from it, then the empty directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layout import Weights, load, save
from tasks.compiled import file_hash
from tasks.errors import TaskError
from tasks.model import OBJECT, SUBJECT, Facts, Task, TaskSet
from verifier.checks.classes import FLOATS, CellPlan, ClassTable, count_columns

#: Version 5: per class also the smallest lower end of 1 − P_ablated(o) for the object
#: alone (L1 bounds the object's probability, not its valid set's), a version 4 certificate
#: is refused. Version 4: the query classes keep the localization check's numbers (per class the object
#: queries certifying L1, L2 and all of it, the smallest L2 gap and the smallest count of
#: exact-zero ablated logits besides the object: ``verifier.checks.classes``), without which
#: ``check --since`` cannot decide that check; a version 3 certificate is refused. Version 3:
#: task hashes of an injective encoding (:func:`task_hash`); a version 2 certificate's hashes
#: joined names with separator characters a name could hold.
FORMAT = "moe-knowledge-certificate/5"
#: What every version of this tool's certificates writes before its number.
FORMAT_FAMILY = "moe-knowledge-certificate/"
FILES = ("weights.npz", "tasks.npz", "classes.npz")
#: Every entry of a certificate directory, and nothing else.
ENTRIES = frozenset(FILES + ("certificate.json",))


@dataclass
class Certificate:
    """A verification's record (see the module docstring)."""

    epsilon: float
    verdict: str
    taskset: TaskSet
    weights: Weights
    table: ClassTable
    plan: CellPlan
    watched: list[np.ndarray]                  # per expert: neurons whose activity the classes record
    summary: dict[str, Any] = field(default_factory=dict)   # per-task records, counts, evidence (JSON)
    #: per task: :func:`task_hash` (None: not computed yet, :meth:`resolved_hashes` computes it)
    task_hashes: dict[str, str | None] = field(default_factory=dict)
    file_hashes: dict[str, list[str]] = field(default_factory=dict)   # per task: SHA-256 of each facts file
    #: how β and γ were set ("chosen" by the construction or "pinned" by the user) and how far the
    #: chosen ones reach (``vocabulary``: the most tokens γ was chosen for; ``L``); empty: unknown,
    #: and then kept by an edit as pinned ones are (workflow.since.recertify_since)
    choice: dict[str, Any] = field(default_factory=dict)

    def resolved_hashes(self) -> dict[str, str]:
        """``task_hashes`` with every one not yet computed computed from the task set (and kept:
        a re-certification defers its edited tasks' hashes until the certificate is saved,
        after the verdict)."""
        for name, h in self.task_hashes.items():
            if h is None:
                self.task_hashes[name] = task_hash(self.taskset.tasks[self.taskset.index(name)], self.taskset)
        return self.task_hashes

    @property
    def certified(self) -> bool:
        return self.verdict == "certified"


def _field(data: bytes) -> bytes:
    """``data`` prefixed with its length (8 bytes, little-endian): a self-delimiting field."""
    return len(data).to_bytes(8, "little") + data


def _utf8(text: str) -> bytes:
    """UTF-8 of any Python string (a lone surrogate too: the readers refuse one, a task built
    in Python may hold one); one-to-one on strings."""
    return text.encode("utf-8", "surrogatepass")


def task_hash(task: Task, taskset: TaskSet | None = None) -> str:
    """SHA-256 of an encoding of a task's content: name, templates, and facts in subject
    order. With the task set holding it, the order is read from its fact ids rather than
    sorted: they are sorted by subject id, and ids follow the names' order (the vocabulary
    is sorted).

    **Why equal hashes mean equal tasks** (up to a SHA-256 collision): the bytes hashed are
    a sequence of items each either of fixed width or prefixed by its length, so they parse
    back in one way only: the name; the number of templates and, per template, its parts
    (a tag byte for ⋆1, ⋆2 or a word, then the word); the number of facts n; the n subject
    lengths and the n object lengths (in characters, 8 bytes each); the subjects' text and
    the objects' text, each one field, which the lengths cut back into the names. So two
    tasks that hash alike have the same name, templates and facts, whatever characters
    their names hold (no separator character is assumed absent from them: a name may hold
    any character a Python string can, and the readers' rules are not needed here)."""
    h = hashlib.sha256()
    h.update(_field(_utf8(task.name)))
    h.update(len(task.templates).to_bytes(8, "little"))
    for t in task.templates:
        h.update(len(t.parts).to_bytes(8, "little"))
        for p in t.parts:
            h.update(b"\x01" if p is SUBJECT else b"\x02" if p is OBJECT else b"\x00" + _field(_utf8(p)))
    if taskset is not None:
        tokens = taskset.vocabulary.tokens
        s, o = taskset.fact_ids[taskset.index(task.name)]
        subjects, objects = list(map(tokens.__getitem__, s.tolist())), list(map(tokens.__getitem__, o.tolist()))
    else:
        pairs = sorted(task.facts.items())
        subjects, objects = [a for a, _ in pairs], [b for _, b in pairs]
    n = len(subjects)
    h.update(n.to_bytes(8, "little"))
    for names in (subjects, objects):
        h.update(np.fromiter(map(len, names), np.int64, count=n).astype("<i8").tobytes())
    for names in (subjects, objects):
        h.update(_field(_utf8("".join(names))))       # one piece: an update per name costs more than the hashing
    return h.hexdigest()


def _strings(values) -> np.ndarray:
    values = list(values)
    return np.asarray(values, dtype=str) if values else np.zeros(0, "U1")


def _save_taskset(ts: TaskSet, path: str) -> None:
    vocab = ts.vocabulary
    arrays: dict[str, np.ndarray] = {"words": _strings(vocab.words), "entities": _strings(vocab.entities),
                                     "names": _strings(ts.names)}
    template_text, template_ptr = [], [0]
    for k, task in enumerate(ts.tasks):
        template_text += [t.text() for t in task.templates]
        template_ptr.append(len(template_text))
        s, o = ts.fact_ids[k]
        arrays[f"subjects.{k}"] = np.asarray(s, np.int32 if vocab.size < 2 ** 31 else np.int64)
        arrays[f"objects.{k}"] = np.asarray(o, np.int32 if vocab.size < 2 ** 31 else np.int64)
        if task.compose is not None:                   # a composed task's parts (absent for the others)
            arrays[f"compose.{k}"] = _strings(task.compose)
    arrays["templates"] = _strings(template_text)
    arrays["template_ptr"] = np.asarray(template_ptr, np.int64)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _load_taskset(path: str, epsilon: float | None, parameters: dict) -> TaskSet:
    with np.load(path, allow_pickle=False) as z:
        words = tuple(z["words"].tolist())
        entity_array = z["entities"]
        entities = tuple(entity_array.tolist())
        names = z["names"].tolist()
        templates = z["templates"].tolist()
        ptr = z["template_ptr"]
        tokens = words + entities
        tasks, ids = [], []
        for k, name in enumerate(names):
            s, o = z[f"subjects.{k}"].astype(np.int64), z[f"objects.{k}"].astype(np.int64)
            compose = tuple(z[f"compose.{k}"].tolist()) if f"compose.{k}" in z.files else None
            tasks.append(Task(name, tuple(templates[ptr[k]: ptr[k + 1]]), Facts.lazy(tokens, s, o), compose=compose))
            s.setflags(write=False)
            o.setflags(write=False)
            ids.append((s, o))
    ts = TaskSet.trusted(tuple(tasks), words, entities, tuple(ids), epsilon, parameters)
    ts.vocabulary.__dict__["entity_array"] = entity_array      # the cached property, as read
    return ts


def _save_classes(cert: Certificate, path: str) -> None:
    t, plan = cert.table, cert.plan
    keys = sorted(plan.boundaries)
    b_ptr = np.zeros(len(keys) + 1, np.int64)
    np.cumsum([len(plan.boundaries[k]) for k in keys], out=b_ptr[1:])
    w_ptr = np.zeros(len(cert.watched) + 1, np.int64)
    np.cumsum([m.size for m in cert.watched], out=w_ptr[1:])
    i32 = lambda a: np.asarray(a, np.int32) if (a.size == 0 or int(np.abs(a).max()) < 2 ** 31) else a  # noqa: E731
    arrays = {
        "nodes": _strings(t.nodes), "node": i32(t.node), "cell": i32(t.cell), "expert": i32(t.expert),
        "allowed_ptr": t.allowed_ptr, "allowed": i32(t.allowed), "counts": i32(t.counts), "floats": t.floats,
        "worst_subject": _strings(w[0] for w in t.worst), "worst_object": _strings(w[1] for w in t.worst),
        "least_subject": _strings(w[0] for w in t.least), "least_object": _strings(w[1] for w in t.least),
        "active_ptr": t.active_ptr, "active": t.active, "overflow": t.overflow,
        "plan_keys": _strings(keys), "plan_ptr": b_ptr,
        "plan_bounds": _strings(b for k in keys for b in plan.boundaries[k]),
        "watched_ptr": w_ptr,
        "watched": np.concatenate(cert.watched) if cert.watched else np.zeros(0, bool),
        "columns": _strings(count_columns() + FLOATS),
    }
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _load_classes(path: str) -> tuple[ClassTable, CellPlan, list[np.ndarray]]:
    with np.load(path, allow_pickle=False) as z:
        if tuple(z["columns"].tolist()) != count_columns() + FLOATS:
            raise TaskError("the certificate's class summaries have other columns than this version writes",
                            file=path, fix="run a full check with --certificate to write a new one")
        worst = list(zip(z["worst_subject"].tolist(), z["worst_object"].tolist()))
        least = list(zip(z["least_subject"].tolist(), z["least_object"].tolist()))
        i64 = lambda name: z[name].astype(np.int64)  # noqa: E731
        t = ClassTable(z["nodes"].tolist(), i64("node"), i64("cell"), i64("expert"), i64("allowed_ptr"), i64("allowed"),
                       i64("counts"), z["floats"], worst, i64("active_ptr"), i64("active"), z["overflow"], least)
        keys, ptr, bounds = z["plan_keys"].tolist(), z["plan_ptr"], z["plan_bounds"].tolist()
        plan = CellPlan({k: tuple(bounds[ptr[i]: ptr[i + 1]]) for i, k in enumerate(keys)})
        wp, wv = z["watched_ptr"], z["watched"]
        watched = [wv[wp[i]: wp[i + 1]].copy() for i in range(wp.size - 1)]
    return t, plan, watched


def _manifest_hash(manifest: dict) -> str:
    """SHA-256 of the manifest's own fields (all but this hash), in a canonical JSON form: an
    edited ε, verdict or hash list is refused like an edited file."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def _only_certificate_entries(directory: str) -> tuple[bool, list[str]]:
    """(whether ``directory`` is empty or holds exactly a certificate's entries, each a regular
    file, its certificate.json of this tool's format; its entries, sorted)."""
    import stat

    entries = sorted(os.listdir(directory))
    if not entries:
        return True, entries
    if set(entries) != ENTRIES:
        return False, entries
    for name in entries:
        if not stat.S_ISREG(os.lstat(os.path.join(directory, name)).st_mode):
            return False, entries
    found = stored_format(directory)
    return found is not None and found.startswith(FORMAT_FAMILY), entries


def require_replaceable(directory: str | os.PathLike) -> None:
    """Refuse (TaskError) to save a certificate to ``directory`` unless replacing it loses
    nothing of the user's (module docstring): it does not exist (its parent does), is empty,
    or is a certificate of this tool; and it is not the current directory or one holding it."""
    shown = os.fspath(directory)
    target = os.path.abspath(shown)
    give = "give a new or empty directory, or one written by 'check --certificate'"
    if not os.path.exists(target):
        if not os.path.isdir(os.path.dirname(target)):
            raise TaskError("the certificate's parent directory does not exist", file=shown, fix="create it first")
        return
    if not os.path.isdir(target):
        raise TaskError("exists and is not a directory", file=shown, fix="give a directory for the certificate")
    try:
        here = os.getcwd()
    except OSError:
        here = None
    if here is not None and os.path.commonpath([here, target]) == target:
        raise TaskError("the certificate directory is the current directory or holds it, and saving replaces the "
                        "directory as a whole", file=shown, fix="give a directory of its own, e.g. cert")
    try:
        ok, entries = _only_certificate_entries(target)
    except OSError as e:
        raise TaskError(f"the directory cannot be read: {e.strerror or e}", file=shown,
                        fix="check its permissions") from None
    if not ok:
        from tasks.messages import show_name

        held = (", ".join(show_name(e) for e in entries[:3])
                + (f" and {len(entries) - 3} more" if len(entries) > 3 else ""))
        raise TaskError(f"is not empty and not a certificate this tool wrote (it holds {held}); saving replaces the "
                        f"whole directory", file=shown, fix=give)


def save_certificate(cert: Certificate, directory: str | os.PathLike) -> None:
    """Write ``cert`` to ``directory`` (created, or replaced as a whole if it is empty or a
    certificate: :func:`require_replaceable`; see the module docstring). ``cert.weights``
    are the weights its verification validated (verify and recertify validate what they
    certify), so they are not validated again here."""
    target = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(target) or "."
    require_replaceable(directory)
    try:
        tmp = tempfile.mkdtemp(prefix=".certificate-", dir=parent)
    except OSError as e:
        raise TaskError(f"cannot write the certificate beside '{directory}': {e.strerror or e}",
                        fix="give a writable directory") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)              # mkdtemp makes it private; a certificate is an ordinary directory
        save(cert.weights, os.path.join(tmp, "weights.npz"), small_indices=True, narrow=True, validated=True)
        _save_taskset(cert.taskset, os.path.join(tmp, "tasks.npz"))
        _save_classes(cert, os.path.join(tmp, "classes.npz"))
        manifest = {
            "format": FORMAT, "epsilon": cert.epsilon, "verdict": cert.verdict,
            "parameters": cert.taskset.parameters, "task_set_epsilon": cert.taskset.epsilon,
            "task_hashes": cert.resolved_hashes(), "file_hashes": cert.file_hashes, "summary": cert.summary,
            "parameter_choice": cert.choice,
            "files": {name: file_hash(os.path.join(tmp, name)) for name in FILES},
        }
        manifest = json.loads(json.dumps(manifest, default=float))     # plain JSON types, as it reads back
        manifest["manifest_sha256"] = _manifest_hash(manifest)
        with open(os.path.join(tmp, "certificate.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, ensure_ascii=False, default=float)
        old = None
        if os.path.isdir(target):
            old = tempfile.mkdtemp(prefix=".certificate-old-", dir=parent)
            os.rmdir(old)
            os.replace(target, old)
            try:
                still = _only_certificate_entries(old)[0]
            except OSError:
                still = False
            if not still:                                 # written to in between: put it back
                os.replace(old, target)
                raise TaskError("the directory changed while the certificate was saved (it holds files a certificate "
                                "does not); nothing was written", file=os.fspath(directory),
                                fix="give a new or empty directory, or one written by 'check --certificate'")
        os.replace(tmp, target)
        if old is not None:
            _remove_certificate(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_certificate(directory: str) -> None:
    """Delete a certificate's files from ``directory``, then the directory if it is empty;
    nothing else is deleted (a failure leaves what remains)."""
    for name in ENTRIES:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def stored_format(directory: str | os.PathLike) -> str | None:
    """The ``format`` field of the certificate.json in ``directory``, or None when there is no
    such field (no file, not a JSON object, no string there)."""
    try:
        with open(os.path.join(os.fspath(directory), "certificate.json"), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    return found if isinstance(found, str) else None


def load_certificate(directory: str | os.PathLike) -> Certificate:
    """Read a certificate written by :func:`save_certificate`, every file's hash checked."""
    d = os.fspath(directory)
    path = os.path.join(d, "certificate.json")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise TaskError(f"'{d}' holds no certificate (certificate.json not found)",
                        fix="give the directory written by 'check --certificate DIR'") from None
    except (OSError, ValueError) as e:
        raise TaskError(f"certificate.json cannot be read: {e}", file=path, fix="write the certificate again") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if isinstance(found, str) and found.startswith(FORMAT_FAMILY) and found != FORMAT:
        raise TaskError(f"the certificate is of format {found}, written by another version of this tool (this one "
                        f"reads {FORMAT})", file=path,
                        fix="write a new one with a full check, 'check TASKS --certificate DIR' (it replaces this one)")
    if found != FORMAT:
        raise TaskError(f"certificate.json is not a certificate of format {FORMAT}", file=path,
                        fix="write the certificate again with this version ('check --certificate DIR')")
    if manifest.get("manifest_sha256") != _manifest_hash(manifest):
        raise TaskError("certificate.json does not match its recorded SHA-256 (it was edited after it was written)",
                        file=path, fix="write the certificate again with 'check --certificate DIR'")
    def refused(name: str) -> TaskError:
        return TaskError(f"the certificate's {name} is missing or does not match its recorded SHA-256",
                         file=os.path.join(d, name),
                         fix="the directory was changed after it was written; write it again")

    for name in FILES:
        if not os.path.isfile(os.path.join(d, name)) or manifest.get("files", {}).get(name) is None:
            raise refused(name)
    # The files are hashed on other threads (hashlib releases the GIL) while this one parses
    # them; nothing parsed is returned, and no parse error is reported, before every hash
    # is known to match: a changed file is refused as changed, whatever its parse did.
    with ThreadPoolExecutor(len(FILES)) as pool:
        hashes = {name: pool.submit(file_hash, os.path.join(d, name)) for name in FILES}
        try:
            taskset = _load_taskset(os.path.join(d, "tasks.npz"), manifest.get("task_set_epsilon"),
                                    manifest.get("parameters") or {})
            table, plan, watched = _load_classes(os.path.join(d, "classes.npz"))
            weights = load(os.path.join(d, "weights.npz"), validate=False)   # written by save_certificate
            problem = None
        except Exception as e:                    # reported only if every hash matches
            problem = e
        for name in FILES:
            if hashes[name].result() != manifest["files"][name]:
                raise refused(name)
    if problem is not None:
        raise problem
    epsilon = float(manifest["epsilon"])
    return Certificate(epsilon, manifest["verdict"], taskset, weights, table, plan, watched,
                       manifest.get("summary") or {}, manifest.get("task_hashes") or {},
                       manifest.get("file_hashes") or {}, manifest.get("parameter_choice") or {})
