"""The discrete knowledge model (docs/design.md §2): templates, tasks, task sets.

A *template* is a sequence of words with exactly one subject slot ⋆1 and one object
slot ⋆2, ⋆1 first. A *task* is a non-empty set of templates and a finite dictionary
mapping each subject to one object. A *task set* is an ordered tuple of tasks with
unique names; its vocabulary is the template words followed by the entities, each
sorted, so token ids do not depend on the order in which tasks or facts were given.

Rules checked here (each raises :class:`~tasks.errors.TaskError`):

* a template has exactly one ⋆1 and one ⋆2, ⋆1 before ⋆2, and non-empty words
  without whitespace or control characters;
* a name (task, subject, object) is stripped, non-empty, and holds no tab, line break,
  control character (Unicode category Cc), NUL or lone surrogate;
* a task has a name, at least one template, no template twice, at least one fact;
* a subject has one object (a second, different object is an error; the same fact
  twice is harmless and kept once);
* task names are unique;
* no token is both a template word and an entity. Allowing it would make a prefix's
  parse ambiguous (is ``Of`` the subject or the word?), so it is rejected with both
  uses named.

The data-level routability rule (no object query shared by two tasks) needs the
prefix structure and lives in :mod:`tasks.structure`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from tasks.composition import check_compositions
from tasks.errors import TaskError


class Slot(enum.Enum):
    """The two wildcard slots of a template."""

    SUBJECT = "⋆1"
    OBJECT = "⋆2"

    def __str__(self) -> str:
        return self.value


SUBJECT = Slot.SUBJECT
OBJECT = Slot.OBJECT
Symbol = "str | Slot"

#: Spellings accepted for the slots in template text: the paper's and ASCII.
SLOT_SPELLINGS: dict[str, Slot] = {"⋆1": SUBJECT, "⋆2": OBJECT, "*1": SUBJECT, "*2": OBJECT}


#: Longest name (task name, template word, subject, object) accepted, in characters. Real
#: labels are far shorter (a Wikidata label holds at most 250); the limit keeps one name
#: from costing more than the tasks it names (every name is stored and compared whole).
MAX_NAME_LENGTH = 1000
#: Longest template the tools build, in words (the slots counted): the construction has L − 1
#: structure heads and every query's residual holds about L·p leak entries, so verification
#: grows like L³ per sentence; the structure trie holds every prefix (about L²/2 symbols).
#: The tasks file reader refuses a longer template before any of that work, and
#: :func:`construction.model.route` one given in Python.
MAX_TEMPLATE_LENGTH = 1000


#: A tab, or a character at which ``str.splitlines`` breaks (inside a stripped name: a second line).
_TAB_OR_LINE_BREAK = re.compile("[\t\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
#: NUL or a lone surrogate: not storable in a weights file's string arrays.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
#: A control character (Unicode category Cc: the C0 controls, DEL and the C1 controls). A
#: name that holds one prints as something else (or as nothing), and nothing a task means
#: needs one.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
#: Every character :func:`check_name` refuses inside a stripped name, in one class (the
#: union of the three above: the tab and the line breaks below U+0080 and U+0085 are
#: control characters), for the bulk check :func:`plain_names`.
_REFUSED = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def control_character(text: str) -> str | None:
    """The first control character of ``text`` as ``U+XXXX`` (for a message), or None."""
    m = _CONTROL.search(text)
    return None if m is None else f"U+{ord(m.group()):04X}"


def long_template(length: int) -> str:
    """What is wrong with a template of ``length`` words, longer than :data:`MAX_TEMPLATE_LENGTH`."""
    return (f"a template of {length} words is longer than the {MAX_TEMPLATE_LENGTH} the construction builds (it "
            f"needs {length - 1} structure heads, and verification grows like L³ per sentence)")


def too_long(name: str, what: str) -> TaskError:
    """The error for a name longer than :data:`MAX_NAME_LENGTH` (its start shown, not all of it)."""
    return TaskError(f"{what} {name[:20]!r}... is {len(name):,} characters long, more than the "
                     f"{MAX_NAME_LENGTH:,} a name may have", fix="shorten it")


def check_name(text: object, what: str) -> str:
    """A token (word or entity) name: a string, stripped, non-empty, at most
    :data:`MAX_NAME_LENGTH` characters, one line, no control character."""
    if not isinstance(text, str):
        raise TaskError(
            f"{what} {text!r} is a {type(text).__name__}, not a string",
            fix="write it in quotes",
        )
    name = text.strip()
    if not name:
        raise TaskError(f"{what} is empty", fix="give it a name")
    if len(name) > MAX_NAME_LENGTH:
        raise too_long(name, what)
    if _TAB_OR_LINE_BREAK.search(name):
        raise TaskError(f"{what} {name!r} contains a tab or line break", fix="remove it")
    if _UNSTORABLE.search(name):
        raise TaskError(f"{what} {name!r} contains a NUL character or a lone surrogate",
                        fix="remove it (a weights file could not store the name)")
    control = control_character(name)
    if control is not None:
        raise TaskError(f"{what} {name!r} contains the control character {control}",
                        fix="remove it (names may not hold control characters)")
    if name in SLOT_SPELLINGS:
        raise TaskError(f"{what} {name!r} is spelled like a slot marker", fix="rename it")
    return name


def plain_names(names: Sequence[str], longest: int | None = None) -> bool:
    """True when :func:`check_name` accepts every one of ``names`` (each already stripped)
    and returns it unchanged: checked in bulk, for facts files of millions of lines. (A space
    joins them: it is none of the refused characters.) ``longest``: a bound on the names'
    lengths that the caller knows (:func:`tasks.facts_files.read_plain` gives fields of at
    most :data:`MAX_NAME_LENGTH` characters); without it they are measured."""
    if not all(names) or not SLOT_SPELLINGS.keys().isdisjoint(names):
        return False
    if (longest if longest is not None else max(map(len, names), default=0)) > MAX_NAME_LENGTH:
        return False
    return _REFUSED.search(" ".join(names)) is None


@dataclass(frozen=True)
class Template:
    """A word sequence with one subject slot and one object slot (subject first).

    ``parts`` holds words (``str``) and the two :class:`Slot` markers. Positions are
    1-based in the theorem's notation; the attributes here are 0-based indices into
    ``parts``.
    """

    parts: tuple

    def __post_init__(self) -> None:
        parts = tuple(self.parts)
        object.__setattr__(self, "parts", parts)
        text = " ".join(str(p) for p in parts)
        if not parts:
            raise TaskError("a template is empty", fix="write words with ⋆1 and ⋆2, e.g. 'the capital of ⋆1 is ⋆2'")
        for slot, name in ((SUBJECT, "subject slot ⋆1"), (OBJECT, "object slot ⋆2")):
            count = sum(1 for p in parts if p is slot)
            if count == 0:
                raise TaskError(
                    f"template '{text}' has no {name}",
                    fix=f"put {slot.value} (or *{slot.value[-1]}) where the {name.split()[0]} goes",
                )
            if count > 1:
                raise TaskError(f"template '{text}' has {count} {name.replace(' slot', ' slots')}",
                                fix="keep exactly one")
        if parts.index(OBJECT) < parts.index(SUBJECT):
            raise TaskError(
                f"template '{text}' has ⋆2 before ⋆1",
                fix="the subject ⋆1 must come first; swap the slots or reverse the relation",
            )
        for p in parts:
            if not isinstance(p, Slot):
                if not isinstance(p, str) or not p or any(c.isspace() for c in p):
                    raise TaskError(f"template '{text}' has a bad word {p!r}",
                                    fix="words are non-empty and contain no spaces")
                if len(p) > MAX_NAME_LENGTH:
                    raise too_long(p, "template word")
                if p in SLOT_SPELLINGS:
                    raise TaskError(f"template '{text}' has a word {p!r} spelled like a slot marker",
                                    fix="use Slot.SUBJECT / Slot.OBJECT for slots")
                control = control_character(p)
                if control is not None:
                    raise TaskError(f"template word {p!r} contains the control character {control}",
                                    fix="remove it (template words may not hold control characters)")

    @classmethod
    def parse(cls, text: object) -> "Template":
        """Parse ``'the capital of ⋆1 is ⋆2'`` (``*1``/``*2`` also accepted)."""
        if not isinstance(text, str):
            raise TaskError(f"template {text!r} is a {type(text).__name__}, not a string", fix="write it in quotes")
        words = text.split()
        if not words:
            raise TaskError("a template is empty", fix="write words with ⋆1 and ⋆2, e.g. 'the capital of ⋆1 is ⋆2'")
        for w in words:
            glued = next((s for s in SLOT_SPELLINGS if s in w and s != w), None)
            if glued:
                raise TaskError(f"template '{text}' has the word {w!r}: a slot {glued} must be a word of its own",
                                fix=f"put spaces around {glued}, e.g. '{w.replace(glued, ' ' + glued + ' ').strip()}'")
        return cls(tuple(SLOT_SPELLINGS.get(w, w) for w in words))

    @property
    def length(self) -> int:
        """|t|: the number of parts, slots included."""
        return len(self.parts)

    @property
    def subject_index(self) -> int:
        return self.parts.index(SUBJECT)

    @property
    def object_index(self) -> int:
        return self.parts.index(OBJECT)

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(p for p in self.parts if isinstance(p, str))

    def fill(self, subject: str, obj: str) -> tuple[str, ...]:
        """The sentence t[⋆1 := subject, ⋆2 := obj] as a token tuple."""
        return tuple(subject if p is SUBJECT else obj if p is OBJECT else p for p in self.parts)

    def text(self, ascii: bool = False) -> str:
        marks = {SUBJECT: "*1", OBJECT: "*2"} if ascii else {SUBJECT: "⋆1", OBJECT: "⋆2"}
        return " ".join(marks[p] if isinstance(p, Slot) else p for p in self.parts)

    def __str__(self) -> str:
        return self.text()


class Facts(Mapping[str, str]):
    """An immutable dictionary subject -> object.

    Stored as two parallel tuples of names (subjects in first-seen order). Lookups go
    through a lazily built dict. The compiled, integer form used for enumeration and
    model building lives in :class:`TaskSet` (``fact_ids``).
    """

    __slots__ = ("_subjects", "_objects", "_index", "_ids")

    def __init__(self, pairs: Iterable[tuple[str, str]] | Mapping[str, str] = ()) -> None:
        items = pairs.items() if isinstance(pairs, Mapping) else pairs
        index: dict[str, int] = {}
        subjects: list[str] = []
        objects: list[str] = []
        for pair in items:
            subject, obj = pair
            subject = check_name(subject, "subject")
            obj = check_name(obj, "object")
            if subject in index:
                old = objects[index[subject]]
                if old != obj:
                    raise TaskError(
                        f"subject '{subject}' has two objects, '{old}' and '{obj}'",
                        fix="a task maps each subject to one object; keep one",
                    )
                continue
            index[subject] = len(subjects)
            subjects.append(subject)
            objects.append(obj)
        self._subjects = tuple(subjects)
        self._objects = tuple(objects)
        self._index = None      # built again on the first lookup (saves a dict per task at scale)
        self._ids = None
        del index

    @classmethod
    def trusted(cls, subjects: tuple[str, ...], objects: tuple[str, ...]) -> "Facts":
        """Facts from names already checked (a saved certificate's task set, which was
        validated when it was first read): distinct subjects, valid names. No check here."""
        out = cls.__new__(cls)
        out._subjects, out._objects, out._index, out._ids = tuple(subjects), tuple(objects), None, None
        return out

    @classmethod
    def checked_pairs(cls, pairs: Sequence[tuple[str, str]]) -> "Facts":
        """Facts from (subject, object) pairs of names already checked, subjects distinct (a
        composed task's derived facts: its first part's subjects, its second part's objects)."""
        return cls.trusted(tuple(s for s, _ in pairs), tuple(o for _, o in pairs))

    @classmethod
    def lazy(cls, names: Sequence[str], subject_ids: np.ndarray, object_ids: np.ndarray) -> "Facts":
        """Trusted facts given as positions in ``names`` (a certificate's entities): the name
        tuples are made only when asked for, so a task set of millions of facts read back
        from a certificate costs arrays, not strings."""
        out = cls.__new__(cls)
        out._subjects = out._objects = out._index = None
        out._ids = (names, np.asarray(subject_ids), np.asarray(object_ids))
        return out

    def _names(self) -> None:
        names, s, o = self._ids
        self._subjects = tuple(names[i] for i in s.tolist())
        self._objects = tuple(names[i] for i in o.tolist())

    @property
    def subjects(self) -> tuple[str, ...]:
        if self._subjects is None:
            self._names()
        return self._subjects

    @property
    def objects(self) -> tuple[str, ...]:
        if self._objects is None:
            self._names()
        return self._objects

    def __getitem__(self, subject: str) -> str:
        return self.objects[self._lookup()[subject]]

    def __contains__(self, subject: object) -> bool:
        return subject in self._lookup()

    def _lookup(self) -> dict[str, int]:
        if self._index is None:
            self._index = {s: i for i, s in enumerate(self.subjects)}
        return self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self.subjects)

    def __len__(self) -> int:
        return len(self._subjects) if self._subjects is not None else int(self._ids[1].size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return len(self) == len(other) and all(other.get(s, None) == o for s, o in self.items())

    def __hash__(self) -> int:
        return hash(frozenset(zip(self.subjects, self.objects)))

    def __repr__(self) -> str:
        shown = ", ".join(f"{s!r}: {o!r}" for s, o in list(self.items())[:4])
        more = ", ..." if len(self) > 4 else ""
        return f"Facts({{{shown}{more}}})"

    def items(self):  # type: ignore[override]
        return zip(self.subjects, self.objects)


@dataclass(frozen=True)
class Task:
    """A knowledge task k = (T(k), D_k).

    ``compose``: for a composed task, the names of the two tasks it chains (its facts are
    theirs chained, :mod:`tasks.composition`, checked by the task set); None for a task
    with facts of its own."""

    name: str
    templates: tuple[Template, ...]
    facts: Facts
    compose: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        name = check_name(self.name, "task name")
        object.__setattr__(self, "name", name)
        if self.compose is not None:
            object.__setattr__(self, "compose", tuple(check_name(p, "composed task") for p in self.compose))
        templates = tuple(t if isinstance(t, Template) else Template.parse(t) for t in self.templates)
        object.__setattr__(self, "templates", templates)
        if not isinstance(self.facts, Facts):
            object.__setattr__(self, "facts", Facts(self.facts))
        if not templates:
            raise TaskError(f"task '{name}' has no templates", fix="give it at least one template")
        seen: set[tuple] = set()
        for t in templates:
            if t.parts in seen:
                raise TaskError(f"task '{name}' lists template '{t}' twice", fix="remove the copy")
            seen.add(t.parts)
        if len(self.facts) == 0:
            raise TaskError(f"task '{name}' has an empty dictionary", fix="give it at least one fact")

    @property
    def n_templates(self) -> int:
        """|T(k)|."""
        return len(self.templates)

    @property
    def n_facts(self) -> int:
        """N_k = |D_k|."""
        return len(self.facts)

    @property
    def composed(self) -> bool:
        """The task's facts are two other tasks' chained (:mod:`tasks.composition`)."""
        return self.compose is not None

    def sentences(self) -> Iterator[tuple[tuple[str, ...], Template, str]]:
        """Every dataset sentence of this task, with its template and subject."""
        for t in self.templates:
            for s, o in self.facts.items():
                yield t.fill(s, o), t, s


#: Up to this many entities a vocabulary looks names up in a dict (about 100 bytes an entity),
#: faster than the binary search in a string array it uses beyond.
DICT_ENTITIES = 200_000


@dataclass(frozen=True)
class Vocabulary:
    """Token ids: template words 0..W-1 (sorted), then entities W..V-1 (sorted)."""

    words: tuple[str, ...]
    entities: tuple[str, ...]

    @cached_property
    def _word_ids(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.words)}

    @cached_property
    def _entity_ids(self) -> dict[str, int]:
        # built only when an entity is looked up: a template's words need only the small map
        W = len(self.words)
        return {e: W + i for i, e in enumerate(self.entities)}

    @property
    def n_words(self) -> int:
        return len(self.words)

    @property
    def size(self) -> int:
        """|V|: the number of tokens the model can predict."""
        return len(self.words) + len(self.entities)

    def __len__(self) -> int:
        return self.size

    def find(self, token: object) -> int | None:
        """The id of ``token``, or None. An entity is looked up in the entity dict once that
        is built, else by binary search in ``entity_array`` (a few lookups need no dict of a
        million names)."""
        i = self._word_ids.get(token)  # type: ignore[arg-type]
        if i is not None or not isinstance(token, str):
            return i
        if "_entity_ids" in self.__dict__ or not self.entities:
            return self._entity_ids.get(token)
        entities = self.entity_array
        at = int(np.searchsorted(entities, token))
        return len(self.words) + at if at < entities.size and entities[at] == token else None

    def __contains__(self, token: object) -> bool:
        return self.find(token) is not None

    def id(self, token: str) -> int:
        i = self.find(token)
        if i is None:
            raise TaskError(f"unknown token {token!r}", fix="use a template word or an entity of the task set")
        return i

    def token(self, i: int) -> str:
        i = int(i)
        return self.words[i] if i < len(self.words) else self.entities[i - len(self.words)]

    def is_entity(self, i: int) -> bool:
        return int(i) >= len(self.words)

    @cached_property
    def tokens(self) -> tuple[str, ...]:
        return self.words + self.entities

    @cached_property
    def entity_array(self) -> np.ndarray:
        """The entities as a numpy string array (sorted, as ``entities`` is)."""
        return np.asarray(self.entities, dtype=str) if self.entities else np.zeros(0, "U1")

    def entity_ids(self, names: Sequence[str]) -> np.ndarray:
        """Token ids of entity names (KeyError for a name that is not an entity). Looked up
        in the entity dict when it is built or small to build (up to ``DICT_ENTITIES``
        entities); else by binary search in ``entity_array``: numpy orders strings by code
        point, as ``sorted`` does, and an exact comparison confirms every hit."""
        if len(names) < 1000 or "_entity_ids" in self.__dict__ or len(self.entities) <= DICT_ENTITIES:
            return np.fromiter(map(self._entity_ids.__getitem__, names), dtype=np.int64, count=len(names))
        entities = self.entity_array
        want = np.asarray(names, dtype=str)
        at = np.minimum(np.searchsorted(entities, want), max(entities.size - 1, 0))
        if not entities.size or not np.array_equal(entities[at], want):
            missing = [n for n in names if n not in self._entity_ids]
            raise KeyError(missing[0] if missing else names[0])
        return at.astype(np.int64) + len(self.words)


@dataclass(frozen=True)
class Sources:
    """Where a loaded task set's parts were written: for messages about them (file:line), and
    per task the key (``tasks.facts_files.facts_key``) of each facts file its facts were
    read from: the hash of the very bytes they were parsed from (or, for facts a
    certificate's cache gave back, the key they were recorded with)."""

    file: str
    templates: Mapping[tuple[int, int], int] = field(default_factory=dict)   # (task, template) -> line
    parameters: Mapping[str, int] = field(default_factory=dict)              # beta / gamma -> line
    epsilon: int | None = None
    facts_keys: Mapping[str, tuple[str, ...]] | None = None                 # task -> its facts files' keys


def _names(names: tuple[str, ...], rows: np.ndarray) -> tuple[str, ...]:
    """``names[i]`` for i in ``rows``, as a tuple."""
    if rows.size == 0:
        return ()
    got = itemgetter(*rows.tolist())(names)
    return got if rows.size > 1 else (got,)


def sorted_fact_ids(vocab: "Vocabulary", facts: "Facts") -> tuple[np.ndarray, np.ndarray]:
    """A dictionary's (subject ids, object ids) in ``vocab``, sorted by subject id, read-only."""
    s = vocab.entity_ids(facts.subjects)
    o = vocab.entity_ids(facts.objects)
    order = np.argsort(s, kind="stable")
    s, o = s[order], o[order]
    s.setflags(write=False)
    o.setflags(write=False)
    return s, o


@dataclass(frozen=True)
class TaskSet:
    """An ordered set of tasks with unique names, plus optional ε and parameters.

    ``sources`` (set by the loader; not part of equality) says where each template and
    parameter was written, so that later stages can name ``file:line`` in their errors.
    """

    tasks: tuple[Task, ...]
    epsilon: float | None = None
    parameters: Mapping[str, float] = field(default_factory=dict)
    sources: Sources | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        tasks = tuple(self.tasks)
        object.__setattr__(self, "tasks", tasks)
        object.__setattr__(self, "parameters", dict(self.parameters))
        if not tasks:
            raise TaskError("the task set has no tasks", fix="add at least one task under 'tasks:'")
        names: dict[str, int] = {}
        for k, task in enumerate(tasks):
            if task.name in names:
                raise TaskError(f"two tasks are named '{task.name}'", fix="give every task its own name")
            names[task.name] = k
        check_compositions(tasks)
        if self.epsilon is not None and not (0 < self.epsilon < 1):
            raise TaskError(f"epsilon {self.epsilon} is not between 0 and 1", fix="use a number such as 0.01")
        self._check_words_are_not_entities()

    def _check_words_are_not_entities(self) -> None:
        word_use: dict[str, tuple[Template, str]] = {}     # a word -> its first use (the text made if reported)
        for task in self.tasks:
            for t in task.templates:
                for w in t.words:
                    word_use.setdefault(w, (t, task.name))
        words = word_use.keys()
        for task in self.tasks:
            if words.isdisjoint(task.facts.subjects) and words.isdisjoint(task.facts.objects):
                continue                                   # (set operations: the common case, at C speed)
            for s, o in task.facts.items():                # the first offending fact, in order, for the message
                for name, role in ((s, "subject"), (o, "object")):
                    if name in word_use:
                        t, first = word_use[name]
                        raise TaskError(
                            f"token '{name}' is a word of template '{t}' in task '{first}' and also the {role} of a "
                            f"fact in task '{task.name}'",
                            fix="a token is either a template word or an entity; rename one of them",
                        )

    # --- sizes -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def index(self, name: str) -> int:
        for k, t in enumerate(self.tasks):
            if t.name == name:
                return k
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tasks)

    @cached_property
    def L(self) -> int:
        """The largest template length (slots counted)."""
        return max(t.length for task in self.tasks for t in task.templates)

    def complexity(self, k: int) -> int:
        """c(k) = L·|T(k)| + N_k, the bound of Theorem 4.2 on expert k's width."""
        task = self.tasks[k]
        return self.L * task.n_templates + task.n_facts

    @cached_property
    def vocabulary(self) -> Vocabulary:
        words = sorted({w for task in self.tasks for t in task.templates for w in t.words})
        entities: set[str] = set()
        for task in self.tasks:
            entities.update(task.facts.subjects)
            entities.update(task.facts.objects)
        return Vocabulary(tuple(words), tuple(sorted(entities)))

    @cached_property
    def fact_ids(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """Per task, (subject ids, object ids) as token ids, sorted by subject id."""
        return tuple(sorted_fact_ids(self.vocabulary, task.facts) for task in self.tasks)

    def __getstate__(self) -> dict:
        """The state pickled (for a worker process or a cluster): everything but the
        structure trie (:func:`tasks.structure.structure_of` keeps it with the task set),
        which is built again where it is needed rather than travelling with every copy."""
        state = dict(self.__dict__)
        state.pop("_structure", None)
        return state

    def sentences(self) -> Iterator[tuple[tuple[str, ...], int, Template, str]]:
        """Every dataset sentence: (tokens, task index, template, subject)."""
        for k, task in enumerate(self.tasks):
            for sentence, t, s in task.sentences():
                yield sentence, k, t, s

    @property
    def n_facts(self) -> int:
        return sum(t.n_facts for t in self.tasks)

    def template_source(self, k: int, t: int) -> tuple[str | None, int | None]:
        """(file, line) where template t of task k was written, if known."""
        if self.sources is None:
            return None, None
        return self.sources.file, self.sources.templates.get((k, t))

    def parameter_source(self, name: str) -> tuple[str | None, int | None]:
        """(file, line) of a parameter (``beta``, ``gamma``, ``epsilon``) given in the file, if known."""
        if self.sources is None:
            return None, None
        line = self.sources.epsilon if name == "epsilon" else self.sources.parameters.get(name)
        return self.sources.file, line

    @classmethod
    def trusted(cls, tasks: tuple[Task, ...], words: tuple[str, ...], entities: tuple[str, ...],
                fact_ids: tuple[tuple[np.ndarray, np.ndarray], ...], epsilon: float | None = None,
                parameters: Mapping[str, float] | None = None) -> "TaskSet":
        """A task set whose parts were validated before (a saved certificate's), with its
        vocabulary and fact ids given rather than recomputed. Only the cheap rules are
        checked again (names unique, ε in range); the caller vouches for the rest."""
        out = cls.__new__(cls)
        object.__setattr__(out, "tasks", tuple(tasks))
        object.__setattr__(out, "epsilon", epsilon)
        object.__setattr__(out, "parameters", dict(parameters or {}))
        object.__setattr__(out, "sources", None)
        if len({t.name for t in out.tasks}) != len(out.tasks) or not out.tasks:
            raise TaskError("a saved task set has no tasks or two tasks of one name", fix="check the certificate")
        out.__dict__["vocabulary"] = Vocabulary(tuple(words), tuple(entities))
        out.__dict__["fact_ids"] = tuple(fact_ids)
        return out

    def alone(self, k: int) -> "TaskSet":
        """Task k by itself: what ``TaskSet((task,))`` gives (its template words and its
        entities, each sorted, as its vocabulary; its fact ids in it), computed from this
        set's arrays. Its entities are some of this vocabulary's, in the same (sorted)
        order, so an entity's new id is its rank among the task's entity ids, and the facts
        stay sorted by subject."""
        task = self.tasks[k]
        vocab = self.vocabulary
        W = vocab.n_words
        s, o = self.fact_ids[k]
        ids = self.entity_rows([k]) + W                     # the task's entity ids, sorted
        words = tuple(sorted({w for t in task.templates for w in t.words}))
        entities = _names(vocab.entities, ids - W)
        rank = np.empty(len(vocab), np.int64)               # an entity id's rank among the task's (a lookup)
        rank[ids] = np.arange(ids.size)
        new_s = rank[s] + len(words)
        new_o = rank[o] + len(words)
        new_s.setflags(write=False)
        new_o.setflags(write=False)
        out = TaskSet.trusted((task,), words, entities, ((new_s, new_o),))
        if "entity_array" in vocab.__dict__:
            out.vocabulary.__dict__["entity_array"] = vocab.entity_array[ids - W]
        return out

    def entity_rows(self, tasks: Sequence[int]) -> np.ndarray:
        """The entities of ``tasks`` (indices), as sorted rows of ``vocabulary.entities``: a
        mask over the entities, set at every fact's subject and object (no sort)."""
        W = self.vocabulary.n_words
        mask = np.zeros(len(self.vocabulary.entities), bool)
        for k in tasks:
            for a in self.fact_ids[k]:
                mask[a - W] = True
        return np.flatnonzero(mask).astype(np.int64)

    def without(self, name: str) -> "TaskSet":
        """The same task set without one task (for modularity checks): what
        ``TaskSet(the other tasks, ...)`` gives, computed from this set's arrays as
        :meth:`alone` is. The other tasks' entities are some of this vocabulary's, in the same
        (sorted) order, and their template words some of its words, also sorted; so a token's
        new id is its rank among the kept words, or the number of kept words plus its rank
        among the kept entities, and facts stay sorted by subject. A part of a valid task set
        is valid (names stay unique, no word becomes an entity)."""
        keep = [k for k, t in enumerate(self.tasks) if t.name != name]
        if len(keep) == len(self.tasks) or not keep:
            return TaskSet(tuple(self.tasks[k] for k in keep), self.epsilon, self.parameters)
        vocab = self.vocabulary
        W = vocab.n_words
        words = tuple(sorted({w for k in keep for t in self.tasks[k].templates for w in t.words}))
        ids = self.entity_rows(keep) + W                    # kept entity ids, sorted
        entities = _names(vocab.entities, ids - W)
        rank = np.empty(len(vocab), np.int64)               # a kept entity id's rank among them (a lookup)
        rank[ids] = np.arange(ids.size)
        fact_ids = []
        for k in keep:
            s, o = (rank[a] + len(words) for a in self.fact_ids[k])
            s.setflags(write=False)
            o.setflags(write=False)
            fact_ids.append((s, o))
        out = TaskSet.trusted(tuple(self.tasks[k] for k in keep), words, entities, tuple(fact_ids), self.epsilon,
                              self.parameters)
        if "entity_array" in vocab.__dict__:
            out.vocabulary.__dict__["entity_array"] = vocab.entity_array[ids - W]
        return out
