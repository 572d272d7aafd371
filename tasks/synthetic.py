"""Seeded synthetic task sets shaped like the paper's WikiData5M set (numpy only).

The paper's experiments use 822 relations and about 20 million facts derived from
WikiData5M. :func:`wikidata_like` builds task sets of that shape at any size:

* **Tasks** are relations named like WikiData properties (``P17``). By default their
  number grows as a power law through the two anchors 100 tasks at 1M facts and 822
  at 20M (:func:`default_n_tasks`).
* **Dictionary sizes** follow Zipf's law over the tasks' ranks (size ∝ rank^-a,
  ``a = zipf_exponent``), every task at least one fact, summing exactly to
  ``n_facts`` (:func:`zipf_sizes`). Ranks are shuffled over the tasks.
* **Entities** are named like WikiData items (``Q123``) and form one pool shared by
  subjects and objects, so a subject of one task is an object of another and tasks
  share subjects. The pool has about ``n_facts / 4`` entities (WikiData5M has about
  4.6M entities for 20M facts), and at least as many as the largest dictionary, so
  every task can have distinct subjects. Subjects are uniform without replacement
  per task; objects follow a Zipf popularity (same exponent) over a shuffled
  ranking of the entities, so some objects (countries, "human") are very common.
* **Templates**: 1 to 5 per task, from a few common words (``the``, ``of``, ``is``,
  ...) plus the task's own relation word, named early (after the first word, or right
  after ⋆1), always before ⋆2. Some templates
  start with ⋆1 and templates of different tasks share prefixes (``the ⋆1 ...``).

Guarantees: the result constructs, passes :func:`~tasks.structure.check_routable`, and
has no structural object-query collision. The relation word before ⋆2 makes every
object-query structure belong to one task only (relation words are unique per task
and are never entities: ``P`` versus ``Q``). The same arguments give the same set.

Cost: numpy does the sampling; the time goes into :class:`~tasks.model.Facts`, which
checks every subject and object name in Python, and into
:class:`~tasks.model.TaskSet`'s word/entity check. See :func:`wikidata_like`.
"""

from __future__ import annotations

import math
from operator import itemgetter

import numpy as np

from tasks.model import OBJECT, SUBJECT, Facts, Task, TaskSet, Template

__all__ = ["COMMON_WORDS", "default_n_tasks", "zipf_sizes", "wikidata_like"]

#: Template words shared by all tasks. The first few start templates (shared prefixes).
COMMON_WORDS = ("the", "of", "a", "is", "was", "in", "has", "by", "for", "to", "and", "its", "at", "from", "as", "an")
_LEADING = 4  # COMMON_WORDS[:_LEADING] may open a template: "the ⋆1", "of ⋆1", ...

#: Anchors of the default task count: (facts, tasks).
_ANCHOR_SMALL = (1_000_000, 100)
_ANCHOR_LARGE = (20_000_000, 822)


def default_n_tasks(n_facts: int) -> int:
    """Tasks for ``n_facts`` facts: ``round(100 · (n_facts / 10^6)^b)``, clipped to ``1..n_facts``.

    ``b = ln(8.22) / ln(20) ≈ 0.703`` puts the power law through both anchors: 100
    tasks at 1M facts and 822 (the paper's relation count) at 20M. It gives 20 tasks
    at 100k facts and 1 task below about 1,400 facts.
    """
    (f0, k0), (f1, k1) = _ANCHOR_SMALL, _ANCHOR_LARGE
    exponent = math.log(k1 / k0) / math.log(f1 / f0)
    return int(min(n_facts, max(1, round(k0 * (n_facts / f0) ** exponent))))


def zipf_sizes(n_facts: int, n_tasks: int, exponent: float = 1.1) -> np.ndarray:
    """Dictionary sizes by rank: each >= 1, ∝ rank^-exponent, summing exactly to ``n_facts``.

    Every task gets one fact; the other ``n_facts - n_tasks`` are shared in proportion
    to the Zipf weights by the largest-remainder method (ties go to the better rank),
    so the sizes are non-increasing in rank and deterministic.
    """
    if n_tasks < 1 or n_facts < n_tasks:
        raise ValueError(f"need 1 <= n_tasks <= n_facts, got n_tasks={n_tasks}, n_facts={n_facts}")
    weights = np.arange(1, n_tasks + 1, dtype=np.float64) ** -float(exponent)
    quotas = (n_facts - n_tasks) * weights / weights.sum()
    base = np.floor(quotas).astype(np.int64)
    left = (n_facts - n_tasks) - int(base.sum())
    order = np.argsort(-(quotas - base), kind="stable")
    base[order[:left]] += 1
    return base + 1


def _relation_numbers(n_tasks: int, rng: np.random.Generator) -> np.ndarray:
    """Distinct property numbers (P17, P31, ...) for the tasks."""
    return rng.choice(max(2000, 4 * n_tasks), size=n_tasks, replace=False) + 1


def _template(relation: str, rng: np.random.Generator) -> Template:
    """One template: leading words, ⋆1, middle words, ⋆2, maybe a trailing word.

    Like natural relation templates, the relation is named early: right after the first
    leading word (``the P17 of ⋆1 is ⋆2``, "the capital of France is Paris") or, in
    templates that start with ⋆1 (40%), as the first or second middle word
    (``⋆1 P17 ⋆2``, ``⋆1 is P17 ⋆2``). Prefixes of common words are still shared across
    tasks (``the``, ``⋆1 is``), and every object-query structure names its relation.
    """
    n_lead = int(rng.choice(3, p=(0.4, 0.35, 0.25)))
    n_mid = int(rng.integers(0, 3))
    lead = [COMMON_WORDS[int(i)] for i in rng.integers(0, _LEADING, n_lead)]
    mid = [COMMON_WORDS[int(i)] for i in rng.integers(0, len(COMMON_WORDS), n_mid)]
    tail = [COMMON_WORDS[int(rng.integers(0, len(COMMON_WORDS)))]] if rng.random() < 0.2 else []
    if n_lead:
        lead.insert(1, relation)
    else:
        mid.insert(min(int(rng.integers(0, 2)), n_mid), relation)
    return Template(tuple(lead) + (SUBJECT,) + tuple(mid) + (OBJECT,) + tuple(tail))


def _templates(relation: str, count: int, rng: np.random.Generator) -> tuple[Template, ...]:
    """``count`` distinct templates for one relation (fewer only if 100 draws repeat)."""
    chosen: dict[tuple, Template] = {}
    for _ in range(100 * count):
        if len(chosen) == count:
            break
        t = _template(relation, rng)
        chosen.setdefault(t.parts, t)
    return tuple(chosen.values())


def _object_sampler(n_entities: int, exponent: float, rng: np.random.Generator):
    """A function drawing object ids with Zipf popularity over a shuffled entity ranking."""
    ranking = rng.permutation(n_entities)
    cdf = np.cumsum(np.arange(1, n_entities + 1, dtype=np.float64) ** -float(exponent))
    cdf /= cdf[-1]

    def draw(size: int) -> np.ndarray:
        rank = np.searchsorted(cdf, rng.random(size), side="right")
        return ranking[np.minimum(rank, n_entities - 1)]

    return draw


def wikidata_like(
    n_facts: int,
    n_tasks: int | None = None,
    seed: int = 0,
    templates_per_task: tuple[int, int] = (1, 5),
    zipf_exponent: float = 1.1,
    n_entities: int | None = None,
) -> TaskSet:
    """A synthetic task set shaped like WikiData5M (see the module docstring).

    ``n_facts`` facts over ``n_tasks`` tasks (default :func:`default_n_tasks`), with
    Zipf dictionary sizes, ``templates_per_task = (lo, hi)`` templates per task
    (uniform), and ``n_entities`` entities (default ``max(n_facts // 4, largest
    dictionary)``). Deterministic in ``seed``.

    Time (one core, measured): about 0.8 s for 1M facts and 31 s for 20M (2.5 GB
    peak). About 90% of it is in :class:`~tasks.model.Facts`, which checks every
    name of every pair in Python, and in ``TaskSet``'s word/entity check, which
    looks up every fact's names; the numpy sampling is under 10%.
    """
    if n_facts < 1:
        raise ValueError(f"n_facts must be at least 1, got {n_facts}")
    lo, hi = templates_per_task
    if not 1 <= lo <= hi:
        raise ValueError(f"templates_per_task must be (lo, hi) with 1 <= lo <= hi, got {templates_per_task}")
    n_tasks = default_n_tasks(n_facts) if n_tasks is None else int(n_tasks)
    rng = np.random.default_rng(seed)
    sizes = zipf_sizes(n_facts, n_tasks, zipf_exponent)
    sizes = sizes[rng.permutation(n_tasks)]
    largest = int(sizes.max())
    n_entities = max(n_facts // 4, largest) if n_entities is None else int(n_entities)
    if n_entities < largest:
        raise ValueError(f"n_entities={n_entities} is smaller than the largest dictionary ({largest} facts)")

    names = [f"Q{i + 1}" for i in range(n_entities)]
    relations = _relation_numbers(n_tasks, rng)
    draw_objects = _object_sampler(n_entities, zipf_exponent, rng)
    tasks = []
    for k in range(n_tasks):
        relation = f"P{relations[k]}"
        count = int(rng.integers(lo, hi + 1))
        subjects = rng.choice(n_entities, size=int(sizes[k]), replace=False)
        objects = draw_objects(int(sizes[k]))
        facts = Facts(zip(_names(names, subjects), _names(names, objects)))
        tasks.append(Task(relation, _templates(relation, count, rng), facts))
    return TaskSet(tuple(tasks))


def _names(names: list[str], ids: np.ndarray) -> list[str]:
    """The names of entity ids, as a list of Python strings."""
    if ids.size == 1:
        return [names[int(ids[0])]]
    return list(itemgetter(*ids.tolist())(names))
