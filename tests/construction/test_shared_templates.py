"""Tasks that share template text and differ only by their subjects (construction.gate,
construction.heads): they build, certify, and the exact oracle agrees.

Two relations phrased alike, ``⋆1 is located in ⋆2`` for cities → countries and for
countries → continents, are well-posed (a query's subject says which task it belongs
to), and a country is both an object of one task and a subject of the other, so past ⋆2
both sit in the prefix: the subject head must read the *first* entity there.
"""

from __future__ import annotations

import pytest

from audit.oracle import Oracle
from workflow.check import check_built
from construction.model import build
from layout import Head, Weights
from tasks.model import Task, TaskSet
from tasks.queries import iter_queries

#: Subjects and objects per sharing task, unicode included; each task's object is the
#: next task's subject (a chain), so past ⋆2 a query holds a subject of another task.
CHAIN = [
    {"São Paulo": "Brasil", "Kraków": "Polska", "Ōsaka": "日本"},
    {"Brasil": "América do Sul", "Polska": "Europa", "日本": "アジア"},
    {"América do Sul": "Terra", "Europa": "Terra", "アジア": "Terra"},
    {"Terra": "Sistema Solar"},
    {"Sistema Solar": "Via Láctea"},
]


def chain(n: int, template: str = "⋆1 is located in ⋆2 today", extra: bool = True) -> TaskSet:
    """n tasks sharing ``template`` word for word, plus (``extra``) one template of their own each."""
    tasks = []
    for k in range(n):
        own = (f"the place ⋆1 belongs to ⋆2 in list{k}",) if extra else ()
        tasks.append(Task(f"level{k}", (template,) + own, CHAIN[k]))
    return TaskSet(tuple(tasks))


def certify(ts: TaskSet):
    model = build(ts)
    report = check_built(ts, model, weights=model.instantiate())
    assert report.certified, report.counterexamples[:3]
    assert all(w <= b for w, b in zip(model.widths, model.bounds))
    assert all(r.isolated for r in report.tasks)
    return model, report


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_two_to_five_tasks_sharing_a_template_certify(n):
    ts = chain(n)
    model, report = certify(ts)
    # past ⋆2 ('São Paulo is located in Brasil') the prefix holds a subject of the next task
    past = [q for q in iter_queries(ts) if q.prefix[-1] in {o for t in ts for o in t.facts.objects}
            and q.prefix[-1] != q.prefix[0] and not q.object_query]
    assert past and all(q.determined for q in past)
    assert max(r.worst_error_lower for r in report.tasks) <= report.closed_form_value


@pytest.mark.parametrize("template", ["⋆1 ⋆2", "⋆1 is ⋆2", "in ⋆1 one finds ⋆2 and more", "⋆1 ⋆2 , surely ."])
def test_shapes_of_the_shared_template(template):
    certify(chain(3, template, extra=False))


def test_the_oracle_agrees_on_a_shared_template_set():
    """Independent exact evaluation: every requirement holds (no violation) on the model
    the verifier certified, and every gate margin past ⋆2 is about λ = 1/2 (the subject)."""
    ts = chain(3)
    model, _ = certify(ts)
    result = Oracle().judge(ts, model.instantiate(), model.epsilon)
    assert not result.violating, result.violations[:3]
    past = [p for p in result.records if len(p) >= 5 and p[:1] != p[-1:] and p[-1] == "today"]
    assert not past     # 'today' ends the template: no query ends with it
    margins = [result.records[q.prefix][1] for q in iter_queries(ts)
               if q.prefix[1:4] == ("is", "located", "in") and len(q.prefix) == 5]
    assert margins and min(margins) > 0.2


def _all_entities_head(w: Weights, taskset: TaskSet) -> Weights:
    """The earlier subject head: attends to every entity alike (key = entity only)."""
    import scipy.sparse as sp

    from construction.residual import residual_space

    space = residual_space(taskset)
    key = sp.csr_matrix(([1.0], ([0], [space.index("entity", "")])), shape=(1, w.d))
    heads = list(w.heads)
    h = heads[-1]
    heads[-1] = Head(h.W_Q, key, h.W_V, h.W_O)
    from dataclasses import replace
    return replace(w, heads=tuple(heads))


def test_reading_every_entity_alike_fails_past_the_object():
    """Why the subject head reads the first entity: with the earlier head (every entity
    alike), past ⋆2 subject and object each get about half the weight, the object is a
    subject of the next task, and the verifier finds queries it cannot route."""
    ts = TaskSet(tuple(reversed(chain(3).tasks)))     # the object's task now wins the gate's tie-break
    model = build(ts)
    certify(ts)
    w = _all_entities_head(model.instantiate(), ts)
    report = check_built(ts, model, weights=w, isolation=False)
    assert not report.certified
    bad = [c for c in report.counterexamples if c["check"] == "routing"]
    entities = set(ts.vocabulary.entities)
    past_object = {" ".join(q.prefix) for q in iter_queries(ts) if sum(t in entities for t in q.prefix) == 2}
    assert bad and all(c["prefix"] in past_object for c in bad)


def test_shared_template_with_a_shared_subject_is_ill_posed():
    """The limit of the class: a subject in both sharing tasks makes the object query
    'Brasil is located in' belong to both; no model can route it (and the loader says so)."""
    from tasks.errors import TaskError
    from tasks.structure import check_routable

    ts = TaskSet((Task("a", ("⋆1 is located in ⋆2",), {"Brasil": "América do Sul"}),
                  Task("b", ("⋆1 is located in ⋆2",), {"Brasil": "Terra"})))
    with pytest.raises(TaskError, match="no model can route"):
        check_routable(ts)
