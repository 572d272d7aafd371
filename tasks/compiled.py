"""Reading a tasks file against facts read before: the facts files whose bytes did not change.

A saved certificate keeps the task set it certified as arrays (the vocabulary, and per task
its facts as token ids) and, per task, the SHA-256 of each of its facts files. Reading the
tasks file again after an edit, :class:`FactsCache` gives back the facts of every task
whose facts files hash the same, without reading those files (at a million facts,
reading them is most of the time: every name checked in Python), and the loader reads
only the others. What is skipped was checked when the same bytes were first read (the
same parser, the same rules); what must be checked again because other tasks changed is
checked again on the whole set (:meth:`FactsCache.assemble`): no token both a word and an
entity, and no object query shared by two tasks where one of them changed.
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np

from tasks.errors import TaskError
from tasks.facts_files import parse_mode
from tasks.model import Facts, Task, TaskSet, Vocabulary


def file_hash(path: str) -> str:
    """SHA-256 of a file's bytes, read in blocks (for a lookup: the bytes hashed are not kept)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def facts_file_key(path: str) -> str:
    """What a facts file's facts depend on: how it is parsed (its name's extension) and the
    SHA-256 of its bytes, as ``"tsv:<hex>"`` or ``"csv:<hex>"`` (the same bytes renamed from
    .tsv to .csv are other facts). OSError for what is not a regular file (a FIFO or a
    device would block or never end; the loader reports it)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except ValueError as e:              # a NUL in the path
        raise OSError(str(e)) from None
    if not stat.S_ISREG(mode):
        raise OSError(f"not a regular file: {path}")
    return f"{parse_mode(path)}:{file_hash(path)}"


def _names(names) -> np.ndarray:
    return np.asarray(names, dtype=str) if len(names) else np.zeros(0, "U1")


class FactsCache:
    """Facts of an earlier read of a tasks file (``taskset``), with its facts files' hashes."""

    def __init__(self, taskset: TaskSet, hashes: dict[str, list[str]], composed: dict | None = None) -> None:
        self.taskset, self.hashes = taskset, hashes
        #: (file, text) -> YAML node graph, shared by successive reads (a watcher's): a tasks
        #: file whose text is unchanged is not composed again (the loader only reads nodes)
        self.composed = composed if composed is not None else {}
        self.reused: set[str] = set()
        #: per task looked up: the keys of its facts files this time (the loader records them
        #: for the next certificate when the cached facts are given back; for facts it parses
        #: it records the keys of the bytes it parsed, see ``Sources.facts_keys``)
        self.seen: dict[str, list[str]] = {}
        self._keys: dict[str, str] = {}        # facts_file_key of files hashed ahead (warm)

    def warm(self, paths: Sequence[str], threads: int = 2) -> None:
        """Hash these files ahead, on ``threads`` threads (hashlib releases the GIL), for the
        lookups that follow; each hash is used by one lookup, and a file that cannot be read
        is left to it."""
        from concurrent.futures import ThreadPoolExecutor

        def key(path: str) -> tuple[str, str | None]:
            try:
                return path, facts_file_key(path)
            except OSError:
                return path, None

        with ThreadPoolExecutor(max(1, threads)) as pool:
            for path, k in pool.map(key, sorted({os.path.abspath(p) for p in paths})):
                if k is not None:
                    self._keys[path] = k

    def compose(self, text: str, file: str, lines):
        """The YAML node graph of ``text`` (``tasks.yaml_nodes.compose``), kept for the next
        read of the same file and text; the one kept before is dropped."""
        from tasks.yaml_nodes import compose

        key = (file, text)
        if key not in self.composed:
            root = compose(text, file, lines)
            self.composed.clear()
            self.composed[key] = root
        return self.composed[key]

    def lookup(self, name: str, files: Sequence[str]) -> Facts | None:
        """The cached facts of task ``name`` if it read exactly these files' bytes before, in
        the same order and parse modes."""
        try:
            got = [self._keys.pop(os.path.abspath(f), None) or facts_file_key(f) for f in files]
        except OSError:
            return None
        self.seen[name] = got
        want = self.hashes.get(name)
        if not files or want is None or got != want or name not in self.taskset.names:
            return None
        self.reused.add(name)
        return self.taskset.tasks[self.taskset.index(name)].facts

    def assemble(self, tasks: list[Task], epsilon, parameters, sources) -> TaskSet:
        """The task set of ``tasks`` (cached facts among them), its vocabulary and fact ids
        computed from the cache's arrays; the whole-set rules checked (module docstring).

        The old vocabulary's entities that some task still uses keep their order; the edited
        tasks' names not among them are inserted where they sort. So an old entity's new id
        is its rank among those kept plus the number of names inserted before it (integers,
        no string compared), and the task set records that map (:func:`token_map_from`)."""
        old = self.taskset
        old_vocab = old.vocabulary
        W_old = old_vocab.n_words
        old_entities = old_vocab.entity_array
        words = sorted({w for t in tasks for tpl in t.templates for w in tpl.words})
        ids, names = [], []
        local: dict[str, tuple[np.ndarray, np.ndarray]] = {}   # edited task -> (its names, sorted; each fact name's rank)
        for t in tasks:
            if t.name in self.reused:
                ids.extend(old.fact_ids[old.index(t.name)])
            else:
                both = np.concatenate([_names(t.facts.subjects), _names(t.facts.objects)])
                uniq, rank = np.unique(both, return_inverse=True)
                local[t.name] = (uniq, rank.reshape(-1))
                names.append(uniq)
        used = np.zeros(old_entities.size, bool)        # the old entities in use: integers first, cheap
        if any(a.size and (int(a.min()) < W_old or int(a.max()) >= old_vocab.size) for a in ids):
            raise TaskError("the certificate's task set has fact ids that are not its entities' ids",
                            fix="write the certificate again with 'check --certificate DIR'")
        for a in ids:
            used[a - W_old] = True                      # fact ids are entity ids (>= the words)
        kept = old_entities[used]
        entities = kept                  # sorted and distinct: old entities are, and ids are unique
        inserted = np.zeros(0, np.int64)  # positions in ``kept`` before which names are inserted
        if names:                        # the edited tasks' names merged in (the sort of only those)
            extra = names[0] if len(names) == 1 else np.unique(np.concatenate(names))
            kept = kept.astype(np.result_type(kept.dtype, extra.dtype))   # wide enough for every name
            at = np.searchsorted(kept, extra)
            hit = at < kept.size
            hit[hit] = kept[at[hit]] == extra[hit]
            inserted = at[~hit]
            entities = np.insert(kept, inserted, extra[~hit])
            # where each of ``extra`` is now: a kept name moved by the names inserted up to it,
            # an inserted one where np.insert put it (integers; ``at`` and ``inserted`` are sorted)
            extra_at = np.empty(extra.size, np.int64)
            extra_at[hit] = at[hit] + np.searchsorted(inserted, at[hit], side="right")
            extra_at[~hit] = inserted + np.arange(inserted.size)
        entity_names = tuple(entities.tolist())
        if words and entities.size:
            w = np.asarray(words, dtype=str)
            at = np.minimum(np.searchsorted(entities, w), entities.size - 1)
            clash = w[entities[at] == w]                 # sorted, as the words are
            if clash.size:
                raise TaskError(f"token '{clash[0]}' is a template word and also an entity of a fact",
                                fix="a token is either a template word or an entity; rename one of them")
        W = len(words)
        # an old token id -> the new one (the same name): words by name, entities by rank
        to_new = np.full(old_vocab.size, -1, np.int64)
        word_at = {w: i for i, w in enumerate(words)}
        for i, w in enumerate(old_vocab.words):
            to_new[i] = word_at.get(w, -1)
        rank = np.flatnonzero(used)                     # kept entity r is old entity rank[r]
        r = np.arange(rank.size)
        to_new[W_old + rank] = W + r + np.searchsorted(inserted, r, side="right")
        if inserted.size and old_entities.size:         # inserted names may be old entities no reused task uses
            new_at = inserted + np.arange(inserted.size)    # where np.insert put them (``inserted`` is sorted)
            names_in = entities[new_at]
            j = np.minimum(np.searchsorted(old_entities, names_in), old_entities.size - 1)
            was = old_entities[j] == names_in
            to_new[W_old + j[was]] = W + new_at[was]
        tokens = tuple(words) + entity_names
        out_tasks, ids = [], []
        for t in tasks:
            if t.name in self.reused:
                s, o = old.fact_ids[old.index(t.name)]
                s, o = to_new[s], to_new[o]          # both vocabularies sorted: the order is kept
                s.setflags(write=False)
                o.setflags(write=False)
                t = Task(t.name, t.templates, Facts.lazy(tokens, s, o))
            else:
                # a name's id: its rank among the task's names, placed in the merged entities
                uniq, rank_of = local[t.name]
                at = (extra_at if len(names) == 1 else np.searchsorted(entities, uniq).astype(np.int64)) + W
                both, n = at[rank_of], len(t.facts)
                order = np.argsort(both[:n], kind="stable")
                s, o = both[:n][order], both[n:][order]
                s.setflags(write=False)
                o.setflags(write=False)
            out_tasks.append(t)
            ids.append((s, o))
        ts = TaskSet.trusted(tuple(out_tasks), tuple(words), entity_names, tuple(ids), epsilon, parameters)
        ts.vocabulary.__dict__["entity_array"] = entities        # the cached properties, already computed here
        ts.vocabulary.__dict__["tokens"] = tokens
        ts.__dict__["_token_map_from"] = (old_vocab, to_new)
        object.__setattr__(ts, "sources", sources)
        return ts

    def changed(self, taskset: TaskSet) -> list[int]:
        """Indices of the tasks not taken from the cache."""
        return [k for k, t in enumerate(taskset.tasks) if t.name not in self.reused]


def token_map_from(taskset: TaskSet, old: Vocabulary) -> np.ndarray | None:
    """For each token id of the vocabulary ``old``, the id of the same token in ``taskset``'s
    (-1: gone), if ``taskset`` was assembled from a cache of a task set with that very
    vocabulary object (:meth:`FactsCache.assemble`); else None."""
    got = taskset.__dict__.get("_token_map_from")
    return got[1] if got is not None and got[0] is old else None
