"""Why a task set is refused, and the smallest edits of its tasks file that would let it build.

:func:`diagnose` classifies a refusal (:func:`construction.model.route`), and
:func:`smallest_changes` searches for edits that make the set constructible, each one
*checked* by running the construction's routing again on the edited set (no edit is
suggested on the strength of a heuristic alone). The edits tried are those a person
would make to the templates and facts the refusal names:

* remove a template (its task keeps at least one);
* replace a word of a template by a word used nowhere else (``q`` -> ``q′``), or insert
  such a word just before ⋆2, so that the template's prefixes differ from the other
  task's (this keeps or grows the template by one word);
* remove the subjects two colliding tasks share, from one of them (as many facts as
  they share).

Single edits come first, ordered by size (facts removed count one each, every other
edit one); when none suffices (several independent collisions), edits are chained
greedily, each chosen to leave the fewest collisions, up to :data:`MAX_CHAIN` of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from construction.gate import RoutingError
from tasks.errors import TaskError
from tasks.model import Facts, Task, TaskSet, Template
from tasks.structure import count_collisions, object_query_collisions
from tasks.structure import structure_of

#: Longest chain of edits tried when no single edit makes the set constructible.
MAX_CHAIN = 6
#: Candidate edits evaluated at most per step.
MAX_CANDIDATES = 60


@dataclass(frozen=True)
class Refusal:
    """What stopped the construction, and what is proven about it."""

    kind: str        # "ill-posed", "no gate (proven)", "no gate found", "template too long"
    message: str     # the construction's one-line error
    proven: str      # what is proven, and for which models
    error: TaskError

    def as_dict(self) -> dict:
        return {"kind": self.kind, "message": str(self.error), "proven": self.proven}


@dataclass(frozen=True)
class Edit:
    """One edit of the task set: see the module docstring."""

    action: str                     # "remove template", "replace word", "insert word", "remove facts"
    task: int
    template: int = -1
    position: int = -1              # 0-based index in the template's parts
    word: str = ""                  # the new word
    subjects: tuple[str, ...] = ()  # for "remove facts"

    @property
    def size(self) -> int:
        return len(self.subjects) if self.action == "remove facts" else 1

    def apply(self, ts: TaskSet) -> TaskSet:
        tasks = list(ts.tasks)
        task = tasks[self.task]
        templates = list(task.templates)
        facts = task.facts
        if self.action == "remove template":
            del templates[self.template]
        elif self.action in ("replace word", "insert word"):
            parts = list(templates[self.template].parts)
            if self.action == "replace word":
                parts[self.position] = self.word
            else:
                parts.insert(self.position, self.word)
            templates[self.template] = Template(tuple(parts))
        elif self.action == "remove facts":
            gone = set(self.subjects)
            facts = Facts([(s, o) for s, o in task.facts.items() if s not in gone])
        # a composed task keeps its parts while its facts are its parts' (a template remedy);
        # with facts removed it stands for a stored task of the remaining facts
        compose = task.compose if facts is task.facts else None
        tasks[self.task] = Task(task.name, tuple(templates), facts, compose=compose)
        return TaskSet(tuple(tasks), ts.epsilon, ts.parameters)      # lines of the file no longer apply

    def describe(self, ts: TaskSet) -> str:
        task = ts.tasks[self.task]
        where = ""
        if self.template >= 0:
            file, line = ts.template_source(self.task, self.template)
            where = f" (line {line})" if line is not None else ""
        if self.action == "remove template":
            return f"remove template '{task.templates[self.template]}' from task '{task.name}'{where}"
        if self.action == "replace word":
            old = task.templates[self.template].parts[self.position]
            return (f"in template '{task.templates[self.template]}' of task '{task.name}'{where}, replace word "
                    f"{self.position + 1} '{old}' by a word no other template uses, e.g. '{self.word}'")
        if self.action == "insert word":
            return (f"in template '{task.templates[self.template]}' of task '{task.name}'{where}, insert a word of "
                    f"its own before ⋆2, e.g. '{self.word}'")
        shown = ", ".join(f"'{s}'" for s in self.subjects[:4]) + (f" and {len(self.subjects) - 4} more"
                                                                 if len(self.subjects) > 4 else "")
        return f"remove the fact{'s' if len(self.subjects) > 1 else ''} of {shown} from task '{task.name}'"

    def as_dict(self, ts: TaskSet) -> dict:
        task = ts.tasks[self.task]
        file, line = ts.template_source(self.task, self.template) if self.template >= 0 else (None, None)
        return {"edit": self.describe(ts), "action": self.action, "task": task.name,
                "template": str(task.templates[self.template]) if self.template >= 0 else None,
                "line": line, "word": self.word or None, "subjects": list(self.subjects), "size": self.size}


@dataclass(frozen=True)
class Change:
    """A sequence of edits (usually one) after which the set routes; ``sets[i]`` is the set
    edit i applies to (``sets[0]`` the original), so each is described in its own terms."""

    edits: tuple[Edit, ...]
    sets: tuple[TaskSet, ...]

    @property
    def size(self) -> int:
        return sum(e.size for e in self.edits)

    def describe(self) -> list[str]:
        return [e.describe(ts) for e, ts in zip(self.edits, self.sets)]

    def as_dict(self) -> dict:
        return {"size": self.size, "edits": [e.as_dict(ts) for e, ts in zip(self.edits, self.sets)]}

    def result(self) -> TaskSet:
        return self.edits[-1].apply(self.sets[-1])


def diagnose(taskset: TaskSet) -> Refusal | None:
    """The refusal of :func:`construction.model.route` for this set, or None if it routes."""
    from construction.model import route

    try:
        route(taskset)
    except RoutingError as err:
        cert = getattr(err, "certificate", None)
        if cert is not None:
            family = ("no gate linear in this construction's residual stream, at any β" if cert.plain else
                      "no gate of the construction's form (symbols per position, a bias and a subject-membership "
                      "weight per task)")
            return Refusal("no gate (proven)", err.problem, family + "; other single-layer heads are not ruled out",
                           err)
        return Refusal("no gate found", err.problem, "nothing: the linear programme found no gate and no "
                       "certificate that none exists", err)
    except TaskError as err:
        if "no model can route" in err.problem:
            return Refusal("ill-posed", err.problem, "every model: an object query belongs to two tasks", err)
        if "longer than" in err.problem:
            return Refusal("template too long", err.problem, "nothing: a limit of this tool's verification cost", err)
        raise
    return None


def _fresh(ts: TaskSet, base: str) -> str:
    """A word that is neither a word nor an entity of ``ts``: ``base′``, ``base′2``, ..."""
    taken = set(ts.vocabulary.tokens)
    candidate, n = base + "′", 2
    while candidate in taken:
        candidate, n = f"{base}′{n}", n + 1
    return candidate


def _template_edits(ts: TaskSet, k: int, t: int, upto: int) -> list[Edit]:
    """Remove template t of task k, replace one of its words at index < ``upto``, or insert a
    word before ⋆2."""
    template = ts.tasks[k].templates[t]
    out = []
    if ts.tasks[k].n_templates > 1:
        out.append(Edit("remove template", k, t))
    for i, part in enumerate(template.parts[:upto]):
        if isinstance(part, str):
            out.append(Edit("replace word", k, t, i, _fresh(ts, part)))
    out.append(Edit("insert word", k, t, template.object_index, _fresh(ts, ts.tasks[k].name.split()[0][:12] or "w")))
    return out


def _candidates(ts: TaskSet, refusal: Refusal) -> list[Edit]:
    trie = structure_of(ts)
    out: list[Edit] = []
    if refusal.kind == "ill-posed":
        for c in object_query_collisions(trie):
            (k1, t1), (k2, t2) = c.first, c.second
            depth = trie.nodes[c.node].depth
            out += _template_edits(ts, k1, t1, depth) + _template_edits(ts, k2, t2, depth)
            shared = tuple(sorted(set(ts.tasks[k1].facts) & set(ts.tasks[k2].facts)))
            for k in (k1, k2):
                if len(shared) < ts.tasks[k].n_facts:
                    out.append(Edit("remove facts", k, subjects=shared))
    elif refusal.kind in ("no gate (proven)", "no gate found"):
        cert = getattr(refusal.error, "certificate", None)
        refs = getattr(refusal.error, "refs", None) or []
        pairs: list[tuple[int, int, int]] = []
        if cert is not None:
            for term in cert.terms:
                node = trie.nodes[term.node]
                for k in (term.winner, term.rival):
                    for t in node.templates.get(k, []):
                        pairs.append((k, t, node.depth))
        pairs += [(k, t, ts.L) for k, t in refs]
        for k, t, depth in dict.fromkeys(pairs):
            out += _template_edits(ts, k, t, depth)
    unique = list(dict.fromkeys(out))
    return sorted(unique, key=lambda e: e.size)[:MAX_CANDIDATES]


def _badness(ts: TaskSet) -> tuple[int, int]:
    """(0, 0) when the set routes; otherwise how far it is from routing (fewer is closer)."""
    try:
        refusal = diagnose(ts)
    except TaskError:
        return (10 ** 9, 0)
    if refusal is None:
        return (0, 0)
    if refusal.kind == "ill-posed":
        return (1 + count_collisions(structure_of(ts)), 0)
    return (1, 1)


def _applies(edit: Edit, ts: TaskSet) -> TaskSet | None:
    try:
        return edit.apply(ts)
    except TaskError:
        return None


def smallest_changes(taskset: TaskSet, refusal: Refusal | None = None, limit: int = MAX_CANDIDATES) -> list[Change]:
    """Up to ``limit`` changes that make the set constructible, smallest first.

    Each is checked: the edited set routes (:func:`construction.model.route`). A change of
    several edits comes only when no single edit works (then one greedy chain).
    """
    refusal = refusal if refusal is not None else diagnose(taskset)
    if refusal is None:
        return []
    single: list[Change] = []
    for edit in _candidates(taskset, refusal):
        edited = _applies(edit, taskset)
        if edited is not None and _badness(edited) == (0, 0):
            single.append(Change((edit,), (taskset,)))
    if single:
        return sorted(single, key=lambda c: c.size)[:limit]
    edits: list[Edit] = []
    sets: list[TaskSet] = []
    current, current_refusal = taskset, refusal
    for _ in range(MAX_CHAIN):
        scored = []
        for edit in _candidates(current, current_refusal):
            edited = _applies(edit, current)
            if edited is not None:
                scored.append((_badness(edited), edit.size, len(scored), edit, edited))
        if not scored:
            return []
        badness, _, _, edit, edited = min(scored, key=lambda x: x[:3])
        edits.append(edit)
        sets.append(current)
        if badness == (0, 0):
            return [Change(tuple(edits), tuple(sets))]
        current, current_refusal = edited, diagnose(edited)
        if current_refusal is None:
            return [Change(tuple(edits), tuple(sets))]
    return []


_ORDER = {"remove facts": 0, "remove template": 1, "replace word": 2, "insert word": 3}


def summarize(changes: list[Change], limit: int = 6) -> list[list[str]]:
    """The changes as text, one entry per alternative (a list of steps), smallest first;
    word replacements in the same template are one entry naming every word that works."""
    singles = sorted((c for c in changes if len(c.edits) == 1),
                     key=lambda c: (c.size, _ORDER[c.edits[0].action], c.edits[0].task, c.edits[0].template))
    entries: list[list[str] | tuple[int, int]] = []       # text, or the key of a group of replacements
    groups: dict[tuple[int, int], list[Change]] = {}
    for c in singles:
        e = c.edits[0]
        if e.action != "replace word":
            entries.append(c.describe())
            continue
        key = (e.task, e.template)
        if key not in groups:
            groups[key] = []
            entries.append(key)
        groups[key].append(c)
    text: list[list[str]] = []
    for entry in entries:
        if isinstance(entry, list):
            text.append(entry)
            continue
        group = groups[entry]
        ts, (k, t) = group[0].sets[0], entry
        task = ts.tasks[k]
        words = [f"{c.edits[0].position + 1} '{task.templates[t].parts[c.edits[0].position]}'" for c in group]
        _, line = ts.template_source(k, t)
        where = f" (line {line})" if line is not None else ""
        which = f"one of its words {', '.join(words)}" if len(words) > 1 else f"its word {words[0]}"
        text.append([f"in template '{task.templates[t]}' of task '{task.name}'{where}, replace {which} by a word "
                     f"no other template uses, e.g. '{group[0].edits[0].word}'"])
    text += [c.describe() for c in changes if len(c.edits) > 1]
    return text[:limit]
