"""Composed tasks: a task whose facts are two stored tasks' facts chained.

A composed task c = (first, second) has templates of its own and no facts of its own.
Its dictionary is

    D_c = { s ↦ D_second(D_first(s)) : s a subject of first whose object is a subject of second },

for example ``compose: [born_in, capital]`` with the template ``the capital of the country
where ⋆1 was born is ⋆2`` answers with the capital of the country a person was born in.
The object D_first(s) is the *bridge* entity. Subjects of ``first`` whose object is not a
subject of ``second`` have no composed fact (the composition is a partial map, as the
dictionaries are); a composition with no fact at all is refused.

Rules (each a :class:`~tasks.errors.TaskError`):

* both parts are tasks of the set, and neither is itself composed: a composition has two
  hops, not more (so there are no cycles either). A task may be both parts
  (``compose: [parent, parent]`` is a grandparent relation);
* the composed task's facts are exactly the derived ones (a task set built in Python with
  other facts is refused, so a composed task never contradicts its parts);
* the composition has at least one fact.

Every other rule holds as for a stored task: the composed task's templates are its own,
and an object query it shares with another task is refused by the routability rule
(:mod:`tasks.structure`), as for any two tasks.

*What the one-layer construction does with it.* A composed task carries its derived
facts, so every stage that reads a task's dictionary (queries, the construction, the
verifier) sees an ordinary task: the single-layer model stores every composed fact, one
dictionary neuron each, which is the baseline a deeper model improves on.
"""

from __future__ import annotations

import difflib
from typing import Mapping, Sequence

from tasks.errors import TaskError
from tasks.messages import show_name

#: The number of tasks a composition chains.
HOPS = 2


def composed_facts(first: Mapping[str, str], second: Mapping[str, str]) -> list[tuple[str, str]]:
    """The chained dictionary of ``first`` then ``second``, in the order of ``first``'s subjects."""
    return [(s, second[b]) for s, b in first.items() if b in second]


def check_parts(name: str, parts: Sequence[str], stored: Mapping[str, object], composed: Mapping[str, object]
                ) -> tuple[str, str]:
    """The two parts of composed task ``name``, checked against the set's tasks: ``stored``
    (name -> the task, one-hop) and ``composed`` (the composed tasks' names). Raises
    TaskError naming the first part that is wrong."""
    parts = tuple(parts)
    if len(parts) != HOPS:
        raise TaskError(f"task {show_name(name)} composes {len(parts)} tasks; a composition chains exactly {HOPS}",
                        fix="write 'compose: [first, second]' (the first task's objects are the second's subjects)")
    for part in parts:
        if part == name:
            raise TaskError(f"task {show_name(name)} composes itself",
                            fix="compose two stored tasks (tasks with facts of their own)")
        if part in composed:
            raise TaskError(f"task {show_name(name)} composes {show_name(part)}, which is itself composed: that "
                            f"chains more than {HOPS} hops, which the tools do not build",
                            fix="compose two stored tasks (tasks with facts of their own)")
        if part not in stored:
            close = difflib.get_close_matches(part, list(stored), n=1, cutoff=0.6)
            names = [show_name(n) for n in list(stored)[:8]]
            known = ", ".join(names) + (f" and {len(stored) - 8:,} more" if len(stored) > 8 else "") or "none"
            raise TaskError(f"task {show_name(name)} composes {show_name(part)}, which is not a task of the set",
                            fix=(f"did you mean {show_name(close[0])}? " if close else "")
                            + f"name stored tasks of the set (they are: {known})")
    return parts[0], parts[1]


def derive(name: str, first: str, second: str, first_facts: Mapping[str, str],
           second_facts: Mapping[str, str]) -> list[tuple[str, str]]:
    """The facts of composed task ``name``; refused when there are none (no object of
    ``first`` is a subject of ``second``)."""
    pairs = composed_facts(first_facts, second_facts)
    if not pairs:
        raise TaskError(f"task {show_name(name)} composes {show_name(first)} and {show_name(second)}, but no object "
                        f"of {show_name(first)} is a subject of {show_name(second)}: the composition has no facts",
                        fix=f"check the order (the objects of the first task must be subjects of the second), "
                            f"or add facts to {show_name(second)} whose subjects are objects of {show_name(first)}")
    return pairs


def check_compositions(tasks: Sequence) -> None:
    """Every composed task of ``tasks`` (:class:`~tasks.model.Task`) composes two stored
    tasks of the same sequence, and its facts are exactly the derived ones."""
    composed = {t.name: t for t in tasks if t.compose is not None}
    if not composed:
        return
    stored = {t.name: t for t in tasks if t.compose is None}
    for task in composed.values():
        first, second = check_parts(task.name, task.compose, stored, composed)
        derived = derive(task.name, first, second, stored[first].facts, stored[second].facts)
        if len(derived) != len(task.facts) or any(task.facts.get(s) != o for s, o in derived):
            raise TaskError(f"the facts of composed task {show_name(task.name)} are not those of {show_name(first)} "
                            f"then {show_name(second)}",
                            fix="give a composed task no facts of its own: they are derived from its parts")


def recompose(tasks: Sequence) -> tuple:
    """``tasks`` with every composed task's facts derived again from its parts (after an
    edit of a part); the tasks that are not composed are returned as they are."""
    from tasks.model import Facts, Task

    stored = {t.name: t for t in tasks if t.compose is None}
    composed = {t.name: t for t in tasks if t.compose is not None}
    out = []
    for t in tasks:
        if t.compose is None:
            out.append(t)
            continue
        first, second = check_parts(t.name, t.compose, stored, composed)
        pairs = derive(t.name, first, second, stored[first].facts, stored[second].facts)
        out.append(Task(t.name, t.templates, Facts(pairs), compose=t.compose))
    return tuple(out)


def users(tasks: Sequence, name: str) -> list[str]:
    """The composed tasks of ``tasks`` that chain task ``name``."""
    return [t.name for t in tasks if t.compose is not None and name in t.compose]
