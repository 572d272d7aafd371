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
from typing import Mapping, Sequence

import numpy as np

from tasks.errors import TaskError
from tasks.facts_files import facts_key, parse_mode
from tasks.model import Facts, Task, TaskSet, Vocabulary


def file_hash(path: str) -> str:
    """SHA-256 of a file's bytes, read in blocks (for a lookup: the bytes hashed are not kept)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _require_regular(path: str) -> None:
    """OSError for what is not a regular file (a FIFO or a device would block or never end;
    the loader reports it)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except ValueError as e:              # a NUL in the path
        raise OSError(str(e)) from None
    if not stat.S_ISREG(mode):
        raise OSError(f"not a regular file: {path}")


def _regular_file_bytes(path: str) -> bytes:
    """A regular file's bytes (OSError for anything else, :func:`_require_regular`)."""
    _require_regular(path)
    with open(path, "rb") as f:
        return f.read()


def facts_file_key(path: str) -> str:
    """What a facts file's facts depend on: how it is parsed (its name's extension) and the
    SHA-256 of its bytes, as ``"tsv:<hex>"`` or ``"csv:<hex>"`` (the same bytes renamed from
    .tsv to .csv are other facts). OSError for what is not a regular file."""
    _require_regular(path)
    return f"{parse_mode(path)}:{file_hash(path)}"


def _names(names) -> np.ndarray:
    return np.asarray(names, dtype=str) if len(names) else np.zeros(0, "U1")


def _multipliers(width: int) -> np.ndarray:
    """Fixed pseudo-random odd 64-bit multipliers, one per position (splitmix64 of 1, 2, ...):
    without the linear pattern that makes swapped characters cancel."""
    z = np.arange(1, width + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def _string_hash(a: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each string of the str array ``a``: the sum, wrapping mod 2^64, of its
    code points times fixed multipliers, one per position. Equal strings hash equal whatever
    the arrays' widths (numpy pads a shorter string with zero code points, which add
    nothing). Used only to propose matches, each then compared exactly."""
    n, width = a.size, a.dtype.itemsize // 4
    codes = a.view(np.uint32).reshape(n, width) if n and width else np.zeros((n, 0), np.uint32)
    mult = _multipliers(width)
    out = np.zeros(n, np.uint64)
    for j in range(width):
        out += codes[:, j].astype(np.uint64) * mult[j]
    return out


def _positions_in(names: np.ndarray, among: np.ndarray) -> np.ndarray:
    """For each of ``names``, its position in the sorted str array ``among`` of distinct
    strings, or -1.

    Why exact: a name gets position j only if ``among[j] == name`` was compared true; a name
    whose hash no string of ``among`` has is not among them (equal strings hash equal); the
    names left, whose hash some string has but not the one compared (a collision, or a run
    of equal hashes), are looked up by binary search. Integers are sorted, not strings: for
    a hundred thousand names several times faster than sorting them."""
    out = np.full(names.size, -1, np.int64)
    if not names.size or not among.size:
        return out
    h_among = _string_hash(among)
    order = np.argsort(h_among)
    sorted_h = h_among[order]
    h = _string_hash(names)
    by_h = np.argsort(h)                         # sorted needles: a cache-friendly search
    at = np.empty(names.size, np.int64)
    at[by_h] = np.searchsorted(sorted_h, h[by_h])
    at = np.minimum(at, among.size - 1)
    same_h = sorted_h[at] == h
    cand = order[at]
    ok = same_h & (among[cand] == names)
    out[ok] = cand[ok]
    doubt = np.flatnonzero(same_h & ~ok)
    if doubt.size:
        j = np.minimum(np.searchsorted(among, names[doubt]), among.size - 1)
        out[doubt] = np.where(among[j] == names[doubt], j, -1)
    return out


#: An edited file whose changed lines (before and now) number more than this, and more
#: than a quarter of its facts, is read in full: the spliced read would cost as much.
SPLICED_LINES = 10_000


def _entity_ids_or_none(vocab: Vocabulary, names: Sequence[str]) -> np.ndarray:
    """The token id of each name among ``vocab``'s entities, -1 for a name that is not one
    (binary search in the sorted entities, each hit compared exactly)."""
    out = np.full(len(names), -1, np.int64)
    entities = vocab.entity_array
    if not len(names) or not entities.size:
        return out
    want = _names(names)
    at = np.minimum(np.searchsorted(entities, want), entities.size - 1)
    hit = entities[at] == want
    out[hit] = at[hit] + vocab.n_words
    return out


class FactsCache:
    """Facts of an earlier read of a tasks file (``taskset``), with its facts files' hashes."""

    def __init__(self, taskset: TaskSet, hashes: dict[str, list[str]], composed: dict | None = None,
                 previous: dict[str, tuple[str, bytes]] | None = None) -> None:
        self.taskset, self.hashes = taskset, hashes
        #: (file, text) -> YAML node graph, shared by successive reads (a watcher's): a tasks
        #: file whose text is unchanged is not composed again (the loader only reads nodes)
        self.composed = composed if composed is not None else {}
        #: path -> (key, bytes) of facts files as an earlier read found them (a watcher's last
        #: read), or None: then files are hashed without keeping their bytes. An edited file
        #: whose earlier bytes have the key its task's facts were recorded with is read
        #: against them (tasks.splice); ``read_now`` is the same for this read, for the next.
        self.previous = previous
        self.read_now: dict[str, tuple[str, bytes]] = {}
        #: edited task -> (its old subject ids kept, their object ids, the new lines' subjects,
        #: their objects): facts read against their earlier bytes, for :meth:`assemble`
        self.spliced: dict[str, tuple[np.ndarray, np.ndarray, list[str], list[str]]] = {}
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

        keep = self.previous is not None

        def key(path: str) -> tuple[str, str | None, bytes | None]:
            try:
                if not keep:
                    return path, facts_file_key(path), None
                data = _regular_file_bytes(path)
                return path, facts_key(path, data), data
            except OSError:
                return path, None, None

        with ThreadPoolExecutor(max(1, threads)) as pool:
            for path, k, data in pool.map(key, sorted({os.path.abspath(p) for p in paths})):
                if k is not None:
                    self._keys[path] = k
                    if keep:
                        before = self.previous.get(path)
                        self.read_now[path] = before if before is not None and before[0] == k else (k, data)

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

    def lookup(self, name: str, files: Sequence[str], words: Mapping[str, object] | None = None) -> Facts | None:
        """The cached facts of task ``name`` if it read exactly these files' bytes before, in
        the same order and parse modes; or, for a task of one facts file whose bytes before
        are known (``previous``), its facts read against them (:meth:`_spliced`; ``words``:
        the template words, which no name may be)."""
        try:
            got = [self._keys.pop(os.path.abspath(f), None) or facts_file_key(f) for f in files]
        except OSError:
            return None
        self.seen[name] = got
        want = self.hashes.get(name)
        if not files or want is None or name not in self.taskset.names:
            return None
        if got != want:                  # one file then and now (a task of two files, or inline, is read in full)
            if len(files) == len(want) == len(got) == 1 and self.previous is not None and words is not None:
                return self._spliced(name, os.path.abspath(files[0]), want[0], got[0], words)
            return None
        self.reused.add(name)
        return self.taskset.tasks[self.taskset.index(name)].facts

    def _spliced(self, name: str, path: str, want: str, got: str, words: Mapping[str, object]) -> Facts | None:
        """Task ``name``'s facts from its one facts file ``path``, read against the bytes its
        facts were read from before, or None (then the file is read in full).

        ``previous[path]`` has the key ``want`` the certificate recorded for the task, so the
        task's old facts are exactly what those bytes hold (a certificate records the key of
        the bytes its facts were parsed from); ``read_now[path]``, of key ``got``, is what the
        file holds now, and the facts returned are what a full read of those bytes gives
        (tasks.splice): the old facts less the old middle lines' subjects, plus the new
        middle lines' facts, with the new lines' names checked as the full read checks them,
        and no subject twice (checked on ids). The key recorded for the task is ``got``."""
        from tasks.model import plain_names
        from tasks.splice import splice

        before, now = self.previous.get(path), self.read_now.get(path)
        if before is None or now is None or before[0] != want or now[0] != got:
            return None
        old = self.taskset
        k = old.index(name)
        s_old, o_old = old.fact_ids[k]
        limit = max(SPLICED_LINES, s_old.size // 4)       # (an edit of most lines: the full read costs no more)
        cut = splice(before[1], now[1], path, int(s_old.size), limit)
        if cut is None or len(cut.removed_subjects) + len(cut.added_subjects) > limit:
            return None
        added_s, added_o = cut.added_subjects, cut.added_objects
        if (added_s and not (plain_names(added_s) and plain_names(added_o))) or len(set(added_s)) != len(added_s) \
                or not words.keys().isdisjoint(added_s) or not words.keys().isdisjoint(added_o):
            return None                  # a line to report, or a subject twice: the full read says which
        vocab = old.vocabulary
        removed = _entity_ids_or_none(vocab, cut.removed_subjects)
        at = np.minimum(np.searchsorted(s_old, removed), max(s_old.size - 1, 0))
        if removed.size and not (s_old.size and (s_old[at] == removed).all() and np.unique(at).size == at.size):
            return None                  # not distinct old subjects: the bytes were not these facts'
        keep = np.ones(s_old.size, bool)
        keep[at] = False
        if s_old.size - removed.size + len(added_s) < 1:
            return None                  # an empty dictionary: the full read reports it
        again = _entity_ids_or_none(vocab, added_s)
        again = again[again >= 0]
        if again.size:                   # a new line's subject on a line kept: a subject twice
            j = np.minimum(np.searchsorted(s_old, again), s_old.size - 1)
            if (keep[j] & (s_old[j] == again)).any():
                return None
        kept_s, kept_o = s_old[keep], o_old[keep]
        self.spliced[name] = (kept_s, kept_o, list(added_s), list(added_o))
        names = vocab.tokens + tuple(added_s) + tuple(added_o)
        n_old, n_add = vocab.size, len(added_s)
        return Facts.lazy(names, np.concatenate([kept_s, np.arange(n_old, n_old + n_add)]),
                          np.concatenate([kept_o, np.arange(n_old + n_add, n_old + 2 * n_add)]))

    def assemble(self, tasks: list[Task], epsilon, parameters, sources) -> TaskSet:
        """The task set of ``tasks`` (cached facts among them), its vocabulary and fact ids
        computed from the cache's arrays; the whole-set rules checked (module docstring).

        **Ids without sorting names.** Every name of an edited task is first given its id in
        the old vocabulary, if it has one: among the names the task had before (an edit keeps
        most of them; matched by hash, each match compared exactly, :func:`_positions_in`),
        else by binary search among the old entities (a task read against its file's earlier
        bytes, :meth:`_spliced`, has the old ids of the lines kept, and only its new lines'
        names are looked up). The names with no old id (``extra``, sorted; a few, for an
        edit) are not old entities, so inserting them where they sort among the old entities
        still in use (which keep their order) gives the sorted, distinct entities of the new
        set. An old entity's new id is then its rank among those kept plus the number of
        names inserted before it, and an extra name's is where it was inserted: integers, no
        name compared beyond the lookups. The task set records the old-to-new map
        (:func:`token_map_from`)."""
        old = self.taskset
        old_vocab = old.vocabulary
        W_old = old_vocab.n_words
        old_entities = old_vocab.entity_array
        words = sorted({w for t in tasks for tpl in t.templates for w in tpl.words})
        ids = [old.fact_ids[old.index(t.name)] for t in tasks if t.name in self.reused]   # reused tasks' old ids
        coded: dict[str, np.ndarray] = {}   # edited task -> each fact name's old id, or -1 (none)
        fresh: dict[str, tuple] = {}        # edited task -> (its names with no old id, sorted; positions; which)
        old_names = set(old.names)
        if any(a.size and (int(a.min()) < W_old or int(a.max()) >= old_vocab.size)
               for t in tasks if t.name in old_names for a in old.fact_ids[old.index(t.name)]):
            raise TaskError("the certificate's task set has fact ids that are not its entities' ids",
                            fix="write the certificate again with 'check --certificate DIR'")
        for t in tasks:
            if t.name in self.reused:
                continue
            if t.name in self.spliced:   # the lines kept have their old ids; the new lines' names are looked up
                kept_s, kept_o, add_s, add_o = self.spliced[t.name]
                blank = np.full(len(add_s), -1, np.int64)
                code = np.concatenate([kept_s, blank, kept_o, blank])
                missing = np.flatnonzero(code < 0)
                missing_names = _names(add_s + add_o)              # in the order of ``missing``
            else:
                names = _names(t.facts.subjects + t.facts.objects)
                code = np.full(names.size, -1, np.int64)
                if t.name in old_names:  # among the names this task had before (an edit keeps most)
                    s_old, o_old = old.fact_ids[old.index(t.name)]
                    had = np.zeros(old_vocab.size, bool)
                    had[s_old] = had[o_old] = True
                    before = np.flatnonzero(had)     # its old ids, sorted: so are their names
                    at = _positions_in(names, old_entities[before - W_old])
                    code[at >= 0] = before[at[at >= 0]]
                missing = np.flatnonzero(code < 0)
                missing_names = names[missing]
            if missing.size:             # the rest: by binary search among all old entities
                rest, where = np.unique(missing_names, return_inverse=True)
                where = where.reshape(-1)
                if old_entities.size:
                    rest = rest.astype(np.result_type(rest.dtype, old_entities.dtype))
                    at = np.minimum(np.searchsorted(old_entities, rest), old_entities.size - 1)
                    found = np.where(old_entities[at] == rest, at + W_old, -1)
                    code[missing] = found[where]
                    still = np.flatnonzero(code[missing] < 0)
                    missing, where = missing[still], where[still]
                fresh[t.name] = (rest, missing, where)
            coded[t.name] = code
        used = np.zeros(old_entities.size, bool)        # the old entities in use: integers first, cheap
        for pair in ids:
            for a in pair:
                used[a - W_old] = True                  # fact ids are entity ids (>= the words)
        for code in coded.values():
            used[code[code >= 0] - W_old] = True
        kept = old_entities[used]        # sorted and distinct: old entities are, and ids are unique
        entities = kept
        inserted = np.zeros(0, np.int64)  # positions in ``kept`` before which names are inserted
        news = [rest[np.unique(where)] for rest, _, where in fresh.values() if where.size]
        if news:                         # names with no old id: none is an old entity
            extra = news[0] if len(news) == 1 else np.unique(np.concatenate(news))
            kept = kept.astype(np.result_type(kept.dtype, extra.dtype))   # wide enough for every name
            inserted = np.searchsorted(kept, extra)
            entities = np.insert(kept, inserted, extra)
            extra_at = inserted + np.arange(inserted.size)       # where np.insert put them (``inserted`` sorts)
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
        tokens = tuple(words) + entity_names
        out_tasks, ids = [], []
        for t in tasks:
            if t.name in self.reused:
                s, o = old.fact_ids[old.index(t.name)]
                s, o = to_new[s], to_new[o]          # both vocabularies sorted: the order is kept
                s.setflags(write=False)
                o.setflags(write=False)
                t = Task(t.name, t.templates, Facts.lazy(tokens, s, o), compose=t.compose)
            else:
                code = coded[t.name]
                both = np.where(code >= 0, to_new[np.maximum(code, 0)], -1)
                if t.name in fresh:
                    rest, missing, where = fresh[t.name]
                    if missing.size:
                        both[missing] = W + extra_at[np.searchsorted(extra, rest[where])]
                n = len(t.facts)
                order = np.argsort(both[:n], kind="stable")
                s, o = both[:n][order], both[n:][order]
                s.setflags(write=False)
                o.setflags(write=False)
                if t.name in self.spliced:   # its names read through the new vocabulary
                    t = Task(t.name, t.templates, Facts.lazy(tokens, s, o), compose=t.compose)
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
