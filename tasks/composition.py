"""Composed tasks: a task whose facts are two stored tasks' facts chained.

A composed task c = (first, second) has templates of its own and no facts of its own.
Its dictionary is

    D_c = { s ↦ D_second(D_first(s)) : s a subject of first },

for example ``compose: [born_in, capital]`` with the template ``the capital of the country
where ⋆1 was born is ⋆2`` answers with the capital of the country a person was born in.
The object D_first(s) is the *bridge* entity. Every object of ``first`` must be a subject
of ``second``: a composed task asks its question of every subject of its first task (a
person born in a country without a stored capital has no answer, and the tasks file
says so rather than leaving a hole in the composed task).

Rules (each a :class:`~tasks.errors.TaskError`):

* both parts are tasks of the set, and neither is itself composed: a composition has two
  hops, not more (so there are no cycles either). A task may be both parts
  (``compose: [parent, parent]`` is a grandparent relation);
* the composed task's facts are exactly the derived ones (a task set built in Python with
  other facts is refused, so a composed task never contradicts its parts);
* every object of the first task is a subject of the second.

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
    """The chained dictionary of ``first`` then ``second``, in the order of ``first``'s
    subjects (a subject whose object ``second`` lacks is left out: :func:`derive` refuses it)."""
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
    """The facts of composed task ``name``; refused when an object of ``first`` is not a
    subject of ``second`` (the first such fact is named)."""
    pairs = composed_facts(first_facts, second_facts)
    if len(pairs) != len(first_facts):
        s, b = next((s, b) for s, b in first_facts.items() if b not in second_facts)
        none = "" if pairs else f" (none of the objects of {show_name(first)} is: check the order)"
        raise TaskError(f"task {show_name(name)} composes {show_name(first)} and {show_name(second)}, but the object "
                        f"{show_name(b)} of {show_name(s)} in {show_name(first)} is not a subject of "
                        f"{show_name(second)}{none}",
                        fix=f"add a fact for {show_name(b)} to {show_name(second)}, or remove {show_name(s)} from "
                            f"{show_name(first)}")
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


def users(tasks: Sequence, name: str) -> list[str]:
    """The composed tasks of ``tasks`` that chain task ``name``."""
    return [t.name for t in tasks if t.compose is not None and name in t.compose]
