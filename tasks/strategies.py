"""Hypothesis strategies for random task sets, for property-based tests.

This module needs the ``test`` extra (``pip install -e .[test]``), because it imports
:mod:`hypothesis` at module level; nothing else in the package imports it.

Usage::

    from hypothesis import given
    from tasks.strategies import ill_posed_task_sets, task_sets
    from tasks import StructureTrie, TaskSet, check_routable

    @given(task_sets(max_tasks=3))
    def test_my_property(taskset):
        check_routable(taskset)          # always passes: the sets are well-posed
        ...

    @given(ill_posed_task_sets())
    def test_rejected(tasks):
        taskset = TaskSet(tasks)         # constructs: the local rules hold
        with pytest.raises(TaskError):
            check_routable(taskset)      # but no model can route it

Strategies:

* :func:`words`: a template word (unicode, no whitespace, not a slot marker);
* :func:`entity_names`: an entity name (unicode, inner spaces allowed, no tab or line
  break, stripped, non-empty, not a slot marker);
* :func:`templates`: a :class:`~tasks.model.Template` over given words;
* :func:`task_sets`: a well-posed :class:`~tasks.model.TaskSet` (see its docstring for
  what "well-posed" means and which features it produces);
* :func:`shared_template_task_sets`: a well-posed task set in which 2 to 5 tasks share
  the same template text and are told apart by their (disjoint) subjects;
* :func:`composed_task_sets`: a well-posed task set with composed tasks
  (:mod:`tasks.composition`) chaining its stored ones;
* :func:`ill_posed_task_sets`: tasks that two-by-two obey every local rule but share
  an object-query prefix with a shared subject.

How :func:`task_sets` stays well-posed without filtering: every task *k* owns a
*marker* word that no other task uses, and every template of *k* has it somewhere
before ⋆2. The object-query structure of a template (its parts up to ⋆2) therefore
contains the marker, so no other task's template passes through it: no structural
collision, hence no data-level one. All other template words come from a small pool
shared by all tasks, so prefixes such as ``the ⋆1`` are shared between tasks, and
entities come from one small shared pool, so subjects are shared between tasks and
an object of one task is often a subject of another.

With ``allow_structural_collisions=True`` some tasks have no marker; their subjects
are then reserved (no other task has them as subjects), so any shared object-query
structure is only structural and the set still passes
:func:`~tasks.structure.check_routable`.
"""

from __future__ import annotations

from typing import Sequence

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from tasks.model import OBJECT, SLOT_SPELLINGS, SUBJECT, Facts, Task, TaskSet, Template

__all__ = ["words", "entity_names", "task_names", "templates", "task_sets", "shared_template_task_sets",
           "ill_posed_task_sets"]

#: Unicode letters, numbers, punctuation and symbols: no whitespace, no control characters.
_VISIBLE = ("L", "N", "P", "S")


def _not_slot(text: str) -> bool:
    return text not in SLOT_SPELLINGS


def _no_slot_inside(text: str) -> bool:
    return not any(s in text for s in SLOT_SPELLINGS)


def words(max_size: int = 8) -> SearchStrategy[str]:
    """A template word: non-empty unicode without whitespace, containing no slot spelling
    (``0*1`` would be read as a slot glued to a word when a template is parsed)."""
    alphabet = st.characters(categories=_VISIBLE)
    return st.text(alphabet, min_size=1, max_size=max_size).filter(_no_slot_inside)


def entity_names(max_size: int = 12) -> SearchStrategy[str]:
    """An entity name: unicode, inner spaces allowed (``New York``), stripped, non-empty.

    Never contains a tab or line break and is never spelled like a slot marker, so
    :func:`~tasks.model.check_name` accepts it unchanged.
    """
    head = st.characters(categories=_VISIBLE)
    rest = st.text(st.characters(categories=_VISIBLE, include_characters=" "), max_size=max_size - 1)
    return st.builds(lambda h, r: (h + r).rstrip(), head, rest).filter(_not_slot)


def task_names() -> SearchStrategy[str]:
    """A task name (same rules as an entity name)."""
    return entity_names(max_size=10)


_default_words = words


def _slot_position(max_position: int) -> SearchStrategy[int]:
    """A position in 0..max_position, about uniform (0: the template starts with ⋆1)."""
    return st.sampled_from(range(max_position + 1))


@st.composite
def templates(
    draw: st.DrawFn,
    words: SearchStrategy[str] | None = None,
    max_length: int = 6,
    min_length: int = 2,
) -> Template:
    """A template of length ``min_length..max_length`` over ``words`` (default :func:`words`).

    Often starts with ⋆1 (⋆1's position is about uniform); ⋆1 and ⋆2 may be adjacent.
    """
    if min_length < 2 or max_length < min_length:
        raise ValueError(f"need 2 <= min_length <= max_length, got {min_length}, {max_length}")
    word = words if words is not None else _default_words()
    n = draw(st.integers(min_length, max_length))
    i = draw(_slot_position(n - 2))
    j = draw(st.integers(i + 1, n - 1))
    parts: list = [SUBJECT if p == i else OBJECT if p == j else draw(word) for p in range(n)]
    return Template(tuple(parts))


@st.composite
def _marked_templates(draw: st.DrawFn, pool: Sequence[str], marker: str, max_length: int) -> Template:
    """A template with ``marker`` somewhere before ⋆2 and pool words elsewhere."""
    n = draw(st.integers(3, max_length))
    i = draw(_slot_position(n - 2))               # ⋆1
    j = draw(st.integers(max(i + 1, 2), n - 1))   # ⋆2, room for the marker before it
    m = draw(st.sampled_from([p for p in range(j) if p != i]))
    fixed = {i: SUBJECT, j: OBJECT, m: marker}
    parts: list = [fixed[p] if p in fixed else draw(st.sampled_from(pool)) for p in range(n)]
    return Template(tuple(parts))


def _make_unique(names: Sequence[str], taken: set[str], sep: str) -> list[str]:
    """``names`` made distinct from each other and from ``taken`` by numbered suffixes.

    Drawing a list and renaming repeats (``a``, ``a~1``) never rejects an example,
    unlike a ``unique=True`` list, which hypothesis aborts when it keeps drawing repeats.
    """
    out = []
    seen = set(taken)
    for name in names:
        candidate, n = name, 1
        while candidate in seen:
            candidate, n = f"{name}{sep}{n}", n + 1
        seen.add(candidate)
        out.append(candidate)
    return out


def _check_sizes(min_tasks: int, max_tasks: int, max_templates: int, max_facts: int, max_template_length: int) -> None:
    if not 1 <= min_tasks <= max_tasks:
        raise ValueError(f"need 1 <= min_tasks <= max_tasks, got {min_tasks}, {max_tasks}")
    if max_templates < 1 or max_facts < 1:
        raise ValueError("max_templates and max_facts must be at least 1")
    if max_template_length < 3:
        raise ValueError("max_template_length must be at least 3 (⋆1, a task's own word, ⋆2)")


@st.composite
def _task_list(
    draw: st.DrawFn,
    min_tasks: int,
    max_tasks: int,
    max_templates: int,
    max_facts: int,
    max_template_length: int,
    allow_structural_collisions: bool,
) -> list[Task]:
    """The tasks of a well-posed set (see :func:`task_sets`)."""
    n_tasks = draw(st.integers(min_tasks, max_tasks))
    n_pool = draw(st.integers(1, 3))
    vocab = _make_unique(draw(st.lists(words(), min_size=n_pool + n_tasks, max_size=n_pool + n_tasks)), set(), "~")
    pool, markers = vocab[:n_pool], vocab[n_pool:]
    n_entities = draw(st.integers(1, max_facts + 2))
    # A space in the suffix: a renamed entity can never be a word.
    entities = _make_unique(draw(st.lists(entity_names(), min_size=n_entities, max_size=n_entities)), set(vocab), " #")
    names = _make_unique(draw(st.lists(task_names(), min_size=n_tasks, max_size=n_tasks)), set(), " #")
    marked = [True] * n_tasks
    if allow_structural_collisions:
        marked = draw(st.lists(st.booleans(), min_size=n_tasks, max_size=n_tasks))

    used: set[str] = set()      # subjects of any task so far
    reserved: set[str] = set()  # subjects of unmarked tasks: no other task may have them
    tasks = []
    for k in range(n_tasks):
        if marked[k]:
            available = [e for e in entities if e not in reserved]
        else:
            # entities[0] is never reserved, so a marked task always has a subject.
            available = [e for e in entities[1:] if e not in used]
            if not available:
                marked[k] = True
                available = [e for e in entities if e not in reserved]
        subjects = draw(
            st.lists(st.sampled_from(available), min_size=1, max_size=min(max_facts, len(available)), unique=True)
        )
        objects = draw(st.lists(st.sampled_from(entities), min_size=len(subjects), max_size=len(subjects)))
        used.update(subjects)
        if not marked[k]:
            reserved.update(subjects)
        if marked[k]:
            template = _marked_templates(pool, markers[k], max_template_length)
        else:
            template = templates(words=st.sampled_from(pool), max_length=max_template_length)
        chosen = draw(st.lists(template, min_size=1, max_size=max_templates, unique_by=lambda t: t.parts))
        tasks.append(Task(names[k], tuple(chosen), Facts(zip(subjects, objects))))
    return tasks


def task_sets(
    min_tasks: int = 1,
    max_tasks: int = 4,
    max_templates: int = 3,
    max_facts: int = 6,
    max_template_length: int = 6,
    allow_structural_collisions: bool = False,
) -> SearchStrategy[TaskSet]:
    """A well-posed :class:`~tasks.model.TaskSet`.

    Well-posed: the set constructs, :func:`~tasks.structure.check_routable` passes, and
    (unless ``allow_structural_collisions``) no two tasks share even an object-query
    *structure*: ``object_query_collisions(structure_of(ts), structural=True)`` is
    empty. This holds by construction (no filtering; see the module docstring).

    Features produced with good probability: several templates per task, templates
    starting with ⋆1, template prefixes shared across tasks, subjects shared across
    tasks, and entities that are an object in one task and a subject in another.
    ``max_template_length`` must be at least 3 (⋆1, the task's own word, ⋆2).
    """
    _check_sizes(min_tasks, max_tasks, max_templates, max_facts, max_template_length)
    return _task_list(
        min_tasks, max_tasks, max_templates, max_facts, max_template_length, allow_structural_collisions
    ).map(lambda tasks: TaskSet(tuple(tasks)))


def _chunks(draw: st.DrawFn, items: Sequence[str], sizes: Sequence[int]) -> list[list[str]]:
    """Consecutive disjoint chunks of a random permutation of ``items`` (``sum(sizes) <= len(items)``)."""
    order = draw(st.permutations(list(items)))
    out, at = [], 0
    for n in sizes:
        out.append(order[at: at + n])
        at += n
    return out


def shared_template_task_sets(
    min_sharing: int = 2,
    max_sharing: int = 5,
    max_groups: int = 2,
    max_other_tasks: int = 2,
    max_templates: int = 3,
    max_facts: int = 4,
    max_template_length: int = 6,
) -> SearchStrategy[TaskSet]:
    """A well-posed :class:`~tasks.model.TaskSet` in which several tasks share template text.

    Up to ``max_groups`` *sharing groups*, each of ``min_sharing..max_sharing`` tasks that
    all have the group's first shared template (word for word) and some of its others,
    plus templates of their own; then up to ``max_other_tasks`` tasks of their own. This is
    the case of two relations phrased alike (``⋆1 is located in ⋆2`` for cities → countries
    and for countries → continents): the subject tells which task a query belongs to.

    Well-posed without filtering: within a group the subjects are pairwise disjoint (so no
    object query σ[s] is shared), and no template outside the group passes through a shared
    template's object-query structure. That holds in one of two ways, drawn per group:

    * *marked*: the group's shared templates carry the group's own word before ⋆2, and every
      other template carries its task's own word before ⋆2 (as in :func:`task_sets`), so
      subjects may be shared with tasks outside the group;
    * *unmarked*: the shared templates use pool words only (``⋆1 is ⋆2``), so other tasks'
      templates may pass through them; the group's subjects are then reserved: no other
      task has them as subjects. (Two unmarked groups may draw the same text, which
      more tasks then share.)

    Objects are drawn from all entities, so an object of one sharing task is often a
    subject of another (the country that cities are located in is itself located in a
    continent); templates often have words after ⋆2, and entities are unicode.
    """
    if not 2 <= min_sharing <= max_sharing:
        raise ValueError(f"need 2 <= min_sharing <= max_sharing, got {min_sharing}, {max_sharing}")
    _check_sizes(1, 1, max_templates, max_facts, max_template_length)
    return _shared_template_sets(min_sharing, max_sharing, max_groups, max_other_tasks, max_templates, max_facts,
                                 max_template_length)


@st.composite
def _shared_template_sets(draw: st.DrawFn, min_sharing: int, max_sharing: int, max_groups: int,
                          max_other_tasks: int, max_templates: int, max_facts: int,
                          max_template_length: int) -> TaskSet:
    """The sets of :func:`shared_template_task_sets` (arguments checked there)."""
    n_groups = draw(st.integers(1, max_groups))
    sizes = [draw(st.integers(min_sharing, max_sharing)) for _ in range(n_groups)]
    marked_group = [draw(st.booleans()) for _ in range(n_groups)]
    n_other = draw(st.integers(0, max_other_tasks))
    n_tasks = sum(sizes) + n_other
    n_pool = draw(st.integers(1, 3))
    vocab = _make_unique(draw(st.lists(words(), min_size=n_pool + n_groups + n_tasks,
                                       max_size=n_pool + n_groups + n_tasks)), set(), "~")
    pool, group_words, task_words = vocab[:n_pool], vocab[n_pool:n_pool + n_groups], vocab[n_pool + n_groups:]
    counts = [[draw(st.integers(1, max_facts)) for _ in range(n)] for n in sizes]
    reserved_total = sum(sum(c) for c, m in zip(counts, marked_group) if not m)
    open_total = max([sum(c) for c, m in zip(counts, marked_group) if m] + [1])
    n_entities = reserved_total + open_total + draw(st.integers(0, 2))
    entities = _make_unique(draw(st.lists(entity_names(), min_size=n_entities, max_size=n_entities)), set(vocab), " #")
    names = _make_unique(draw(st.lists(task_names(), min_size=n_tasks, max_size=n_tasks)), set(), " #")
    # The first reserved_total entities (in a random order) are the unmarked groups' subjects.
    shuffled = draw(st.permutations(entities))
    reserved, open_pool = shuffled[:reserved_total], shuffled[reserved_total:]

    def own_templates(k: int, n: int) -> list[Template]:
        if n <= 0:
            return []
        return draw(st.lists(_marked_templates(pool, task_words[k], max_template_length),
                             min_size=0, max_size=n, unique_by=lambda t: t.parts))

    tasks: list[Task] = []
    k = 0
    reserved_at = 0
    for g, n in enumerate(sizes):
        if marked_group[g]:
            shared_t = _marked_templates(pool, group_words[g], max_template_length)
            subject_sets = _chunks(draw, open_pool, counts[g])
        else:
            shared_t = templates(words=st.sampled_from(pool), max_length=max_template_length, min_length=2)
            subject_sets = [reserved[reserved_at + sum(counts[g][:i]): reserved_at + sum(counts[g][:i + 1])]
                            for i in range(n)]
            reserved_at += sum(counts[g])
        shared = draw(st.lists(shared_t, min_size=1, max_size=2, unique_by=lambda t: t.parts))
        for i in range(n):
            mine = [shared[0]] + [t for t in shared[1:] if draw(st.booleans())]
            mine += own_templates(k, max_templates - len(mine))
            subjects = subject_sets[i]
            objects = draw(st.lists(st.sampled_from(entities), min_size=len(subjects), max_size=len(subjects)))
            tasks.append(Task(names[k], tuple(mine), Facts(zip(subjects, objects))))
            k += 1
    for _ in range(n_other):
        subjects = draw(st.lists(st.sampled_from(open_pool), min_size=1, max_size=min(max_facts, len(open_pool)),
                                 unique=True))
        objects = draw(st.lists(st.sampled_from(entities), min_size=len(subjects), max_size=len(subjects)))
        chosen = draw(st.lists(_marked_templates(pool, task_words[k], max_template_length),
                               min_size=1, max_size=max_templates, unique_by=lambda t: t.parts))
        tasks.append(Task(names[k], tuple(chosen), Facts(zip(subjects, objects))))
        k += 1
    order = draw(st.permutations(range(len(tasks))))
    return TaskSet(tuple(tasks[i] for i in order))


@st.composite
def ill_posed_task_sets(
    draw: st.DrawFn,
    max_tasks: int = 4,
    max_templates: int = 3,
    max_facts: int = 6,
    max_template_length: int = 6,
) -> tuple[Task, ...]:
    """Tasks that fail :func:`~tasks.structure.check_routable`, as a tuple of :class:`Task`.

    Built from a well-posed set by giving a task B a template that passes through the
    object-query structure σ (the parts before ⋆2) of a template of another task A,
    and a subject s of A. The prefix σ[s] is then an object query of A (⋆2 follows)
    and also a prefix of a sentence of B, so no model can route it.

    Returned as tasks, not a TaskSet, because ``TaskSet(tasks)`` *succeeds*: its
    constructor checks the local rules only, and routability is a property of the
    whole set that :func:`~tasks.structure.check_routable` decides. The caller builds
    the set and asserts that ``check_routable`` raises, naming both templates.
    """
    tasks = list(
        draw(task_sets(2, max(2, max_tasks), max_templates, max_facts, max(3, max_template_length - 1))).tasks
    )
    a, b = draw(st.lists(st.integers(0, len(tasks) - 1), min_size=2, max_size=2, unique=True))
    task_a, task_b = tasks[a], tasks[b]
    template_a = draw(st.sampled_from(task_a.templates))
    sigma = template_a.parts[: template_a.object_index]
    all_words = sorted({w for task in tasks for t in task.templates for w in t.words})
    word = draw(st.sampled_from(all_words))
    tail = draw(st.sampled_from([(OBJECT,), (word, OBJECT), (OBJECT, word)]))
    new_template = Template(sigma + tail)
    templates_b = task_b.templates + (() if new_template in task_b.templates else (new_template,))
    subject = draw(st.sampled_from(task_a.facts.subjects))
    facts_b = list(task_b.facts.items())
    if subject not in task_b.facts:
        entities = sorted({e for task in tasks for pair in task.facts.items() for e in pair})
        facts_b.append((subject, draw(st.sampled_from(entities))))
    tasks[b] = Task(task_b.name, templates_b, Facts(facts_b))
    return tuple(tasks)


@st.composite
def composed_task_sets(draw: st.DrawFn, min_tasks: int = 2, max_tasks: int = 4, max_composed: int = 2,
                       max_facts: int = 6, max_template_length: int = 6) -> TaskSet:
    """A well-posed task set with 1 to ``max_composed`` composed tasks
    (:mod:`tasks.composition`) chaining its stored tasks, a task possibly with itself.

    Without filtering: the stored tasks are :func:`task_sets`' (each with its marker
    word); every object of a composition's first task is pointed at a subject of its
    second (of each of its seconds, when it starts several compositions; a pair whose
    seconds share no subject is left out); each composed task has a marker word of its own
    before ⋆2 in every template (and no other word), so it shares no object-query
    structure with another task."""
    stored = draw(_task_list(max(2, min_tasks), max(2, min_tasks, max_tasks), 2, max_facts, max_template_length,
                             False))
    n = draw(st.integers(1, max_composed))
    pairs = [(draw(st.integers(0, len(stored) - 1)), draw(st.integers(0, len(stored) - 1))) for _ in range(n)]
    # every object of a first task must be a subject of each of its second tasks (and a task
    # that is both a first and a second hop keeps its subjects): point each first task's
    # objects at subjects common to its second tasks, dropping a pair that leaves none
    kept: list[tuple[int, int]] = []
    for a, b in pairs:
        seconds = [y for x, y in kept if x == a] + [b]
        common = set.intersection(*(set(stored[y].facts.subjects) for y in seconds))
        if common:
            kept.append((a, b))
    pairs = kept
    for a in sorted({x for x, _ in pairs}):
        seconds = [y for x, y in pairs if x == a]
        common = sorted(set.intersection(*(set(stored[y].facts.subjects) for y in seconds)))
        task = stored[a]
        o = [common[draw(st.integers(0, len(common) - 1))] for _ in task.facts.subjects]
        stored[a] = Task(task.name, task.templates, Facts(zip(task.facts.subjects, o)))
    words_used = {w for t in stored for tp in t.templates for w in tp.words}
    entities = {e for t in stored for e in (*t.facts.subjects, *t.facts.objects)}
    markers = _make_unique(draw(st.lists(words(), min_size=n, max_size=n)), words_used | entities, "~")
    names = _make_unique(draw(st.lists(task_names(), min_size=n, max_size=n)), {t.name for t in stored}, " #")
    tasks = list(stored)
    for (a, b), marker, name in zip(pairs, markers, names):
        # its other words are its marker too: another task's word could let a prefix of it
        # run through that task's object query
        chosen = draw(st.lists(_marked_templates([marker], marker, max_template_length), min_size=1, max_size=2,
                               unique_by=lambda t: t.parts))
        first, second = stored[a], stored[b]
        facts = Facts([(s, second.facts[x]) for s, x in first.facts.items()])
        tasks.append(Task(name, tuple(chosen), facts, compose=(first.name, second.name)))
    return TaskSet(tuple(tasks))
