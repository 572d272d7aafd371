"""Composed tasks (:mod:`tasks.composition`): derived facts, refusals, and every command that reads them.

The derivation is checked against a brute-force chaining on random composed task sets,
which also round-trip through the YAML writer; a task set built in Python with facts that
are not its parts' chained is refused; the commands (``check``, ``inspect``, ``edit``,
``--certificate``/``--since``) are run on a small file as a user would. Malformed
compositions in tasks files are in the bad corpus (``tests/data/bad/compose_*.yaml``,
``tests/tasks/test_io.py``).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from budget import examples

from cli.main import main
from tasks import Facts, Task, TaskError, TaskSet, check_routable, dumps_tasks, load_tasks, loads_tasks
from tasks.composition import composed_facts
from tasks.strategies import composed_task_sets

PROPERTY = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])

TWO_HOPS = """\
tasks:
  - name: born_in
    templates: [⋆1 was born in ⋆2]
    facts: {Curie: Poland, Einstein: Germany, Bohr: Denmark}
  - name: capital
    templates: [the capital of ⋆1 is ⋆2]
    facts: {Poland: Warsaw, Germany: Berlin, Denmark: Copenhagen, France: Paris}
  - name: born_capital
    templates: [the capital of the country where ⋆1 was born is ⋆2]
    compose: [born_in, capital]
"""


@pytest.fixture
def two_hops(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(TWO_HOPS, encoding="utf-8")
    return path


def test_the_facts_are_the_parts_chained(two_hops):
    ts = load_tasks(two_hops)
    task = ts.tasks[ts.index("born_capital")]
    assert task.compose == ("born_in", "capital")
    assert dict(task.facts.items()) == {"Curie": "Warsaw", "Einstein": "Berlin", "Bohr": "Copenhagen"}


def test_an_object_that_is_no_subject_of_the_second_task_is_refused(two_hops):
    text = two_hops.read_text(encoding="utf-8").replace("Bohr: Denmark}", "Bohr: Denmark, Fermi: Italy}")
    with pytest.raises(TaskError, match="the object 'Italy' of 'Fermi' in 'born_in' is not a subject of 'capital'"):
        loads_tasks(text)


def test_a_task_may_be_both_parts():
    parent = Task("parent", ("the parent of ⋆1 is ⋆2",), {"a": "b", "b": "c", "c": "a"})
    grand = Task("grandparent", ("the grandparent of ⋆1 is ⋆2",), {"a": "c", "b": "a", "c": "b"},
                 compose=("parent", "parent"))
    ts = TaskSet((parent, grand))
    check_routable(ts)
    assert ts.tasks[1].composed and not ts.tasks[0].composed


@pytest.mark.parametrize("facts, compose, problem", [
    ({"a": "d"}, ("parent", "parent"), "are not those of 'parent' then 'parent'"),
    ({"a": "c"}, ("parent", "parent"), "are not those of 'parent' then 'parent'"),   # two missing
    ({"a": "c", "b": "d"}, ("parent", "mother"), "composes 'mother', which is not a task of the set"),
    ({"a": "c", "b": "d"}, ("parent", "parent"), "the object 'd' of 'c' in 'parent' is not a subject of 'parent'"),
    ({"a": "c", "b": "d"}, ("parent",), "composes 1 tasks"),
    ({"a": "c", "b": "d"}, ("grandparent", "parent"), "composes itself"),
])
def test_python_task_sets_are_checked_too(facts, compose, problem):
    parent = Task("parent", ("the parent of ⋆1 is ⋆2",), {"a": "b", "b": "c", "c": "a"})
    if "not a subject" in problem:
        parent = Task("parent", ("the parent of ⋆1 is ⋆2",), {"a": "b", "b": "c", "c": "d"})
    with pytest.raises(TaskError, match=problem):
        TaskSet((parent, Task("grandparent", ("the grandparent of ⋆1 is ⋆2",), facts, compose=compose)))


def test_three_hops_are_refused_in_python():
    parent = Task("parent", ("the parent of ⋆1 is ⋆2",), {"a": "b", "b": "c", "c": "a"})
    grand = Task("grand", ("grand ⋆1 is ⋆2",), {"a": "c", "b": "a", "c": "b"}, compose=("parent", "parent"))
    great = Task("great", ("great ⋆1 is ⋆2",), {"a": "a", "b": "b", "c": "c"}, compose=("grand", "parent"))
    with pytest.raises(TaskError, match="itself composed: that chains more than 2 hops"):
        TaskSet((parent, grand, great))


@PROPERTY
@given(composed_task_sets())
def test_random_composed_sets_derive_round_trip_and_route(ts):
    check_routable(ts)
    stored = {t.name: dict(t.facts.items()) for t in ts if not t.composed}
    for t in ts:
        if t.composed:
            first, second = (stored[p] for p in t.compose)
            brute = {s: second[b] for s, b in first.items() if b in second}
            assert dict(t.facts.items()) == brute and brute
            assert composed_facts(first, second) == list(brute.items())
    back = loads_tasks(dumps_tasks(ts))
    assert back == ts and [t.compose for t in back] == [t.compose for t in ts]


def test_one_layer_check_certifies_and_reports_the_composition(two_hops, tmp_path, capsys):
    """With --layers 1 the composed task's facts are stored as facts of their own (the
    two-layer model is tests/verifier/test_layers.py's)."""
    out = tmp_path / "report.json"
    assert main(["check", str(two_hops), "--layers", "1", "--json", str(out), "--quiet"]) == 0
    tasks = {t["name"]: t for t in json.loads(out.read_text())["tasks"]}
    assert tasks["born_capital"]["compose"] == ["born_in", "capital"]
    assert tasks["born_capital"]["facts"] == 3 and tasks["born_capital"]["certified"]
    assert "compose" not in tasks["born_in"] and "compose" not in tasks["capital"]


def test_inspect_names_the_composition(two_hops, tmp_path, capsys):
    assert main(["inspect", str(two_hops), "--layers", "1"]) == 0
    text = capsys.readouterr().out
    assert "born_capital composes born_in then capital: its 3 facts are derived" in text
    out = tmp_path / "inspect.json"
    assert main(["inspect", str(two_hops), "--layers", "1", "--json", str(out)]) == 0
    experts = {e["task"]: e for e in json.loads(out.read_text())["experts"]}
    assert experts["born_capital"]["compose"] == ["born_in", "capital"] and "compose" not in experts["capital"]


def test_editing_a_part_derives_the_composition_again(two_hops, capsys):
    assert main(["edit", str(two_hops), "born_in", "--set", "Fermi=France"]) == 0
    assert "composed task 'born_capital' now has 4 facts" in capsys.readouterr().out
    ts = load_tasks(two_hops)
    assert ts.tasks[ts.index("born_capital")].facts["Fermi"] == "Paris"
    assert main(["edit", str(two_hops), "capital", "--set", "France=Lyon"]) == 0
    assert "composed task 'born_capital' now has 4 facts" in capsys.readouterr().out
    assert load_tasks(two_hops).tasks[2].facts["Fermi"] == "Lyon"
    assert "compose: [born_in, capital]" in two_hops.read_text(encoding="utf-8")   # the rest byte for byte


@pytest.mark.parametrize("argv, problem", [
    (["born_capital", "--set", "Curie=Paris"], "task 'born_capital' is composed: its facts are those of 'born_in'"),
    (["born_in", "--delete-task"], "task 'born_in' is composed by 'born_capital'"),
    (["capital", "--remove", "Poland"], "the object 'Poland' of 'Curie' in 'born_in' is not a subject of 'capital'"),
    (["born_in", "--set", "Fermi=Italy"], "the object 'Italy' of 'Fermi' in 'born_in' is not a subject of 'capital'"),
])
def test_edits_that_would_break_a_composition_are_refused(two_hops, capsys, argv, problem):
    before = two_hops.read_bytes()
    assert main(["edit", str(two_hops), *argv]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1
    assert two_hops.read_bytes() == before


def test_since_after_an_edit_of_a_part_equals_a_full_check(two_hops, tmp_path, capsys):
    cert = tmp_path / "cert"
    assert main(["check", str(two_hops), "--layers", "1", "--certificate", str(cert), "--quiet"]) == 0
    assert main(["edit", str(two_hops), "capital", "--set", "Poland=Krakow"]) == 0
    since, full = tmp_path / "since.json", tmp_path / "full.json"
    assert main(["check", str(two_hops), "--layers", "1", "--since", str(cert), "--json", str(since), "--quiet"]) == 0
    assert main(["check", str(two_hops), "--layers", "1", "--json", str(full), "--quiet"]) == 0
    a, b = json.loads(since.read_text()), json.loads(full.read_text())
    tasks = {t["name"]: t for t in a["tasks"]}
    assert tasks["born_capital"]["compose"] == ["born_in", "capital"]
    assert [t["certified"] for t in a["tasks"]] == [t["certified"] for t in b["tasks"]] == [True] * 3
    assert [(t["name"], t["facts"], t["queries"]) for t in a["tasks"]] == \
        [(t["name"], t["facts"], t["queries"]) for t in b["tasks"]]


def test_a_composed_task_without_its_parts_keeps_its_facts():
    """``TaskSet.without`` (the construction's leave-one-out checks) of a part: the composed
    task stays, with its facts, as the one-layer model stores them."""
    ts = loads_tasks(TWO_HOPS)
    rest = ts.without("capital")
    kept = rest.tasks[rest.index("born_capital")]
    assert isinstance(kept.facts, Facts) and kept.facts == ts.tasks[ts.index("born_capital")].facts
