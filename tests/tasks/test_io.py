"""Tests for tasks.io: loading and dumping tasks.yaml, bad input, round trips, atomic writes."""

from __future__ import annotations

import os
import re
import stat
import tempfile
import textwrap
import unicodedata
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

import tasks.facts_files
import tasks.files
import tasks.io as tio
import tasks.writing
import tasks.yaml_nodes
from tasks.errors import TaskError
from tasks.io import dump_tasks, dumps_tasks, load_tasks, loads_tasks
from tasks.model import OBJECT, SLOT_SPELLINGS, SUBJECT, Facts, Task, TaskSet, Template, check_name
from repository import DATA, ROOT

BAD = DATA / "bad"
GOOD = DATA / "good"

# --------------------------------------------------------------------------- the bad corpus

#: file -> (expected line or None, a substring of the message[, the file the message names])
BAD_CASES: dict[str, tuple] = {
    # unreadable files
    "empty_file.yaml": (None, "is empty"),
    "only_comment.yaml": (None, "has no tasks"),
    "not_utf8.yaml": (6, "not UTF-8 text: byte 0xfc at offset 90"),
    "binary_junk.yaml": (1, "NUL byte"),
    "utf16.yaml": (1, "UTF-16"),
    "control_char.yaml": (6, "unacceptable character #x0007"),
    # YAML syntax
    "syntax_unclosed.yaml": (4, "YAML syntax error"),
    "tab_indent.yaml": (3, "tabs"),
    "colon_in_template.yaml": (3, "put text that contains ': ' in quotes"),
    "two_documents.yaml": (7, "more than one YAML document"),
    "template_unquoted_star.yaml": (4, "read by YAML as an alias"),
    "deep_nesting.yaml": (2, "nested too deeply"),
    # aliases, tags
    "alias_bomb.yaml": (2, "alias '*a' is not supported"),
    "alias_facts.yaml": (8, "alias '*f' is not supported"),
    "merge_key.yaml": (6, "merge keys"),
    "python_tag.yaml": (1, "python/object/apply"),
    "custom_tag.yaml": (6, "tag !city"),
    # top level
    "root_list.yaml": (1, "top level is a list, not a mapping"),
    "root_scalar.yaml": (1, "top level is a string, not a mapping"),
    "no_tasks_key.yaml": (1, "has no tasks"),
    "tasks_empty_list.yaml": (2, "has no tasks"),
    "tasks_null.yaml": (2, "has no tasks"),
    "tasks_mapping.yaml": (2, "'tasks' is a mapping, not a list"),
    "unknown_top_key.yaml": (1, "unknown key 'taks' at the top level; did you mean 'tasks'"),
    "duplicate_top_key.yaml": (7, "key 'tasks' appears twice at the top level (lines 1 and 7)"),
    # epsilon and parameters
    "epsilon_string.yaml": (1, "epsilon is 'small', not a number"),
    "epsilon_quoted.yaml": (1, "quoted string"),
    "epsilon_range.yaml": (1, "not between 0 and 1"),
    "epsilon_zero.yaml": (1, "not between 0 and 1"),
    "epsilon_nan.yaml": (1, "not a finite number"),
    "parameters_list.yaml": (1, "parameters is a list, not a mapping"),
    "parameters_unknown.yaml": (3, "unknown key 'gama' under 'parameters'; did you mean 'gamma'"),
    "parameters_negative.yaml": (2, "not positive"),
    "parameters_string.yaml": (2, "parameter 'gamma' is 'large', not a number"),
    # tasks and names
    "task_not_mapping.yaml": (2, "task 1 is a string, not a mapping"),
    "task_no_name.yaml": (2, "has no name"),
    "task_name_empty.yaml": (2, "task name is empty"),
    "task_name_int.yaml": (2, "write it in quotes: '1984'"),
    "duplicate_task_names.yaml": (7, "two tasks are named 'capital' (lines 2 and 7)"),
    "unknown_task_key.yaml": (3, "unknown key 'template' in task 'capital'; did you mean 'templates'"),
    # templates
    "no_templates.yaml": (2, "has no templates"),
    "templates_empty.yaml": (3, "has no templates"),
    "template_not_string.yaml": (5, "reads as an integer, not a string"),
    "template_no_subject.yaml": (4, "has no subject slot"),
    "template_no_object.yaml": (4, "has no object slot"),
    "template_two_subjects.yaml": (4, "has 2 subject slot"),
    "template_object_first.yaml": (4, "⋆2 before ⋆1"),
    "template_duplicate.yaml": (5, "twice (lines 4 and 5)"),
    # inline facts
    "facts_empty.yaml": (5, "empty dictionary"),
    "facts_null.yaml": (5, "empty dictionary"),
    "facts_and_file.yaml": (7, "both 'facts' and 'facts_file'"),
    "no_facts.yaml": (2, "has no facts"),
    "facts_scalar.yaml": (5, "facts of task 'capital' are a string"),
    "pair_three.yaml": (7, "a list of 3, not a [subject, object] pair"),
    "pair_not_list.yaml": (7, "is a string, not a [subject, object] pair"),
    "duplicate_subject.yaml": (8, "'France' of task 'capital' has two objects: 'Paris' (line 6) and 'Lyon'"),
    "duplicate_subject_pairs.yaml": (8, "two objects: 'Paris' (line 6) and 'Lyon'"),
    "object_bool.yaml": (6, "'no', which YAML reads as a boolean, not a string; write it in quotes"),
    "subject_int.yaml": (6, "'1984', which YAML reads as an integer"),
    "subject_date.yaml": (6, "reads as a date"),
    "object_null.yaml": (6, "object of 'France' in task 'capital' is empty"),
    "entity_tab.yaml": (6, "contains a tab"),
    "entity_slot_name.yaml": (6, "spelled like a slot marker"),
    # cross-task rules
    "word_entity_clash.yaml": (7, "'of' is the subject of a fact of task 'capital' and also a word of template"),
    "collision.yaml": (4, "the other template is on line 10"),
    # composed tasks (tasks.composition)
    "compose_unknown_task.yaml": (10, "composes 'capitol', which is not a task of the set; did you mean 'capital'"),
    "compose_three_tasks.yaml": (10, "composes 3 tasks; a composition chains exactly 2"),
    "compose_itself.yaml": (10, "task 'born_capital' composes itself"),
    "compose_cycle.yaml": (10, "composes 'b', which is itself composed: that chains more than 2 hops"),
    "compose_three_hops.yaml": (13, "composes 'born_capital', which is itself composed"),
    "compose_no_facts.yaml": (10, "the object 'Warsaw' of 'Poland' in 'capital' is not a subject of 'born_in' "
                                  "(none of the objects of 'capital' is: check the order)"),
    "compose_object_missing.yaml": (10, "the object 'Germany' of 'Einstein' in 'born_in' is not a subject of "
                                        "'capital'"),
    "compose_and_facts.yaml": (11, "is composed and also has 'facts'"),
    "compose_scalar.yaml": (10, "'compose' of task 'born_capital' is a string, not a list of two task names"),
    "compose_number.yaml": (10, "'7', which YAML reads as an integer, not a string"),
    "compose_contradiction.yaml": (3, "share the object-query prefix 'Curie was born in' (the other template is on "
                                      "line 9)"),
    # facts files
    "file_missing.yaml": (5, "'tests/data/bad/does_not_exist.tsv' of task 'capital' not found"),
    "file_is_directory.yaml": (5, "is a directory"),
    "file_latin1.yaml": (3, "not UTF-8 text: byte 0xfc at offset 36", "latin1.tsv"),
    "file_bad_fields.yaml": (5, "3 tab-separated fields, expected 2", "bad_fields.tsv"),
    "file_spaces.yaml": (1, "spaces do not separate fields", "spaces.tsv"),
    "file_bad_columns.yaml": (3, "3 comma-separated columns", "bad_columns.csv"),
    "file_bad_quote.yaml": (2, "badly formed CSV line", "bad_quote.csv"),
    "file_nul.yaml": (2, "NUL byte", "nul.tsv"),
    "file_conflict_two_files.yaml": (2, "two objects: 'Paris' (tests/data/bad/conflict_a.tsv:1) and 'Lyon'",
                                     "conflict_b.tsv"),
    "file_only_header.yaml": (5, "empty dictionary (facts file only_header.tsv)"),
    "file_word_clash.yaml": (2, "'is' is the subject of a fact", "clash.tsv"),
    "file_list_empty.yaml": (5, "facts_file list of task 'capital' is empty"),
    "file_other_header.yaml": (2, "the first line 'language<TAB>creator' looks like a header", "other_header.tsv"),
}


@pytest.fixture
def in_repo(monkeypatch):
    """Run from the repository root so that messages show tests/data/... paths."""
    monkeypatch.chdir(ROOT)


def test_bad_corpus_is_complete():
    files = sorted(p.name for p in BAD.glob("*.yaml"))
    assert len(files) >= 30
    assert set(files) == set(BAD_CASES), set(files) ^ set(BAD_CASES)


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_input(name, in_repo):
    line, fragment, *rest = BAD_CASES[name]
    named = rest[0] if rest else name
    path = os.path.join("tests", "data", "bad", name)
    with pytest.raises(TaskError) as info:
        load_tasks(path)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message
    assert named in message
    assert message.startswith(os.path.join("tests", "data", "bad", named))
    if line is not None:
        assert f"{named}:{line}: " in message, message
        assert info.value.line == line
    else:
        assert f"{named}: " in message, message
    assert fragment in message, message
    assert "Traceback" not in message


def test_bad_input_also_fails_from_a_string(in_repo):
    """loads_tasks gives the same message as load_tasks (for text that decodes)."""
    path = BAD / "duplicate_subject.yaml"
    with pytest.raises(TaskError) as a:
        load_tasks(path)
    with pytest.raises(TaskError) as b:
        loads_tasks(path.read_text(encoding="utf-8"), file=str(path))
    assert str(a.value) == str(b.value)


# --------------------------------------------------------------------------- generated bad input


def test_missing_file():
    with pytest.raises(TaskError, match=r"nope\.yaml: tasks file .* not found"):
        load_tasks("nope.yaml")


def test_directory_as_tasks_file(tmp_path):
    with pytest.raises(TaskError, match="is a directory"):
        load_tasks(tmp_path)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can read anything")
def test_permission_denied(tmp_path):
    path = tmp_path / "tasks.yaml"
    path.write_text("tasks: []\n")
    path.chmod(0)
    with pytest.raises(TaskError, match="permission denied"):
        load_tasks(path)


def test_very_deep_nesting_is_refused():
    """Refused by depth, before any nested value is built (no wall-clock assertion: machines are shared)."""
    for text in ("tasks: " + "[" * 200_000, "tasks: " + "{a: " * 50_000,
                 "".join("  " * i + "a:\n" for i in range(300))):
        with pytest.raises(TaskError, match="nested too deeply"):
            loads_tasks(text, file="deep.yaml")


def test_billion_laughs_is_refused_at_the_first_alias():
    """The first alias is refused, so the 10^29 expansion never starts."""
    levels = ["a0: &a0 [" + ", ".join(["lol"] * 10) + "]"]
    for i in range(1, 30):
        levels.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    text = "\n".join(levels) + "\ntasks: *a29\n"
    with pytest.raises(TaskError, match=r"bomb\.yaml:2: alias '\*a0' is not supported"):
        loads_tasks(text, file="bomb.yaml")


def test_nul_in_text_and_bytes_input():
    with pytest.raises(TaskError, match=r"x\.yaml:2: .*NUL"):
        loads_tasks("tasks:\n  - \x00\n", file="x.yaml")
    with pytest.raises(TaskError, match=r"x\.yaml:1: .*not UTF-8"):
        loads_tasks(b"tasks: \xff\n", file="x.yaml")
    ts = loads_tasks(b"tasks:\n  - name: a\n    templates: [x *1 y *2]\n    facts: {A: B}\n")
    assert ts.tasks[0].facts == {"A": "B"}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("epsilon: 1e-3\n", None),  # YAML 1.1 reads this as a string; accepted as a number
        ("epsilon: 1.0e-3\n", None),
        ("epsilon: true\n", "epsilon is a boolean, not a number"),
        ("epsilon: [0.1]\n", "epsilon is a list, not a number"),
        ("epsilon: 1\n", "not between 0 and 1"),
        ("epsilon: -0.5\n", "not between 0 and 1"),
        ("epsilon: 1" + "0" * 5000 + "\n", "not a number"),
        ("parameters:\n  beta: 0\n", "not positive"),
        ("parameters:\n  beta: .inf\n", "not a finite number"),
        ("parameters:\n  beta: yes\n", "boolean"),
        ("parameters: 3\n", "parameters is an integer, not a mapping"),
        ("parameters:\n", None),
    ],
)
def test_epsilon_and_parameters(text, fragment):
    doc = text + "tasks:\n  - name: a\n    templates: [x *1 y *2]\n    facts: {A: B}\n"
    if fragment is None:
        loads_tasks(doc)
    else:
        with pytest.raises(TaskError, match=re.escape(fragment)) as info:
            loads_tasks(doc, file="p.yaml")
        assert str(info.value).startswith("p.yaml:")


def test_numbers_keep_their_type():
    ts = loads_tasks("epsilon: 1e-3\nparameters: {beta: 12, gamma: 2.5}\ntasks:\n"
                     "  - name: a\n    templates: [x *1 y *2]\n    facts: {A: B}\n")
    assert ts.epsilon == 0.001
    assert ts.parameters == {"beta": 12, "gamma": 2.5}
    assert isinstance(ts.parameters["beta"], int)


def test_rule_messages_break_when_the_rule_is_broken():
    """Each rule fails when broken; the fixed document loads."""
    good = "tasks:\n  - name: a\n    templates: [x *1 y *2]\n    facts: {A: B, C: D}\n"
    loads_tasks(good)
    broken = {
        "facts: {A: B, C: D}": "facts: {A: B, A: D}",
        "x *1 y *2": "x *1 y",
        "name: a": "name: ''",
        "facts:": "fact:",
    }
    for old, new in broken.items():
        with pytest.raises(TaskError):
            loads_tasks(good.replace(old, new))


def test_error_messages_are_one_line_even_for_odd_names():
    text = 'tasks:\n  - name: "a\\u2028b"\n    templates: [x *1 y *2]\n    facts: {"C\\x85D": 12}\n'
    with pytest.raises(TaskError) as info:
        loads_tasks(text, file="odd.yaml")
    message = str(info.value)
    assert message.startswith("odd.yaml:2: ") and "line break" in message  # U+2028 splits lines: refused
    assert len(message.splitlines()) == 1


def test_routability_error_keeps_refs():
    with pytest.raises(TaskError) as info:
        load_tasks(BAD / "collision.yaml")
    assert info.value.refs == [(0, 0), (1, 1)]


# --------------------------------------------------------------------------- good input


def _docstring_example() -> str:
    doc = tio.__doc__
    block = doc.split(".. code-block:: yaml", 1)[1].split("\nRules", 1)[0]
    return textwrap.dedent(block).strip() + "\n"


def test_module_docstring_example_loads():
    ts = loads_tasks(_docstring_example(), file="example.yaml", base_dir=str(GOOD))
    assert ts.names == ("capital", "continent", "currency")
    assert ts.epsilon == 0.01 and ts.parameters == {"beta": 12, "gamma": 20}
    assert ts.tasks[0].facts["New York City"] == "United States"
    assert [t.text() for t in ts.tasks[0].templates] == ["the capital of ⋆1 is ⋆2", "⋆1 has capital ⋆2"]
    assert dict(ts.tasks[2].facts) == {"France": "Euro", "Japan": "Yen"}


def test_csv_with_quoted_commas_and_tsv_with_header_and_comments():
    ts = load_tasks(GOOD / "tasks.yaml")
    assert ts.epsilon == 0.001
    assert ts.parameters == {"beta": 12, "gamma": 20.5}
    capital, located, river = ts.tasks
    assert dict(capital.facts) == {"France": "Paris", "Norway": "no", "1984": "Orwell"}
    assert dict(located.facts) == {
        "Washington, D.C.": "United States",
        "Paris": "France",
        'The "Big" Apple': "New York, USA",
    }
    assert located.templates == (Template(("the", "city", SUBJECT, "lies", "in", OBJECT)),)
    assert dict(river.facts) == {"Paris": "Seine", "London": "Thames"}


def test_load_accepts_pathlike_and_str():
    assert load_tasks(GOOD / "tasks.yaml") == load_tasks(str(GOOD / "tasks.yaml"))


def test_identical_duplicate_facts_are_kept_once(tmp_path):
    (tmp_path / "f.tsv").write_text("A\tB\nA\tB\n", encoding="utf-8")
    (tmp_path / "t.yaml").write_text(
        "tasks:\n  - name: a\n    templates: [x *1 y *2]\n    facts_file: [f.tsv, f.tsv]\n"
        "  - name: b\n    templates: [z *1 y *2]\n    facts: [[A, B], [A, B], [' A ', B]]\n",
        encoding="utf-8",
    )
    ts = load_tasks(tmp_path / "t.yaml")
    assert [len(t.facts) for t in ts.tasks] == [1, 1]


def test_facts_file_relative_to_yaml_directory(tmp_path, monkeypatch):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "f.tsv").write_text("A\tB\n", encoding="utf-8")
    (sub / "t.yaml").write_text("tasks:\n  - name: a\n    templates: [x *1 y *2]\n    facts_file: f.tsv\n")
    monkeypatch.chdir(tmp_path)
    assert load_tasks("sub/t.yaml").tasks[0].facts == {"A": "B"}
    with pytest.raises(TaskError, match="f.tsv' of task 'a' not found"):
        loads_tasks((sub / "t.yaml").read_text())
    assert loads_tasks((sub / "t.yaml").read_text(), base_dir="sub").tasks[0].facts == {"A": "B"}


# --------------------------------------------------------------------------- round trips

AWKWARD = [
    "no", "null", "1984", "true", "- x", "a: b", "#x", "~", "Zürich", "東京", "New York City", "'quoted'", '"dq"',
    "[x]", "{y}", "&anchor", "*star", "!bang", "%pct", "@at", "`tick", "x #y", "?", ":", "0x1F", "1_000", "1:20",
    ".inf", "2001-01-01", "=", "<<", "---", "...", "|", ">", "\ufeffbom", "a\\b", "e\u0301",
    "Yes", "OFF", "3.5", "-", "x" * 300, "a  b", "subject", "object",
]


def _awkward_taskset() -> TaskSet:
    subjects = AWKWARD
    objects = AWKWARD[1:] + AWKWARD[:1]
    return TaskSet(
        (
            Task("capital", (Template.parse("the capital of ⋆1 is ⋆2"), Template.parse("*1 has # capital -- *2 über")),
                 Facts(zip(subjects, objects))),
            Task("no", (Template.parse("& ⋆1 :: ⋆2 !"),), Facts({"#x": "no", "a: b": "1984"})),
            Task("1984 / odd name: #1", (Template.parse("的 ⋆1 ⋆2"),), Facts({"null": "true"})),
        ),
        epsilon=1e-5,
        parameters={"beta": 12, "gamma": 0.5},
    )


def test_round_trip_awkward_names():
    ts = _awkward_taskset()
    text = dumps_tasks(ts)
    assert loads_tasks(text) == ts
    ascii_text = dumps_tasks(ts, ascii=True)
    assert ascii_text.isascii() and "*1" in ascii_text and "⋆" not in ascii_text
    assert loads_tasks(ascii_text) == ts
    assert "⋆1" in text and "東京" in text


def test_dump_with_facts_dir_round_trip(tmp_path):
    ts = _awkward_taskset()
    out = tmp_path / "out" / "tasks.yaml"
    out.parent.mkdir()
    dump_tasks(ts, out, facts_dir=tmp_path / "facts")
    assert load_tasks(out) == ts
    doc = yaml.safe_load(out.read_text(encoding="utf-8"))
    # 'capital' has a subject starting with '#' and control characters: it stays inline.
    assert "facts" in doc["tasks"][0] and "facts_file" not in doc["tasks"][0]
    assert doc["tasks"][2]["facts_file"] == "../facts/1984_odd_name_1.tsv"
    assert (tmp_path / "facts" / "1984_odd_name_1.tsv").read_text(encoding="utf-8") == "subject\tobject\nnull\ttrue\n"
    assert sorted(os.listdir(tmp_path / "facts")) == ["1984_odd_name_1.tsv"]


def test_safe_file_names_are_unique():
    from tasks.writing import _safe_file_names

    names = _safe_file_names(("Capital", "capital", "capital?", "..", "con", "東京", ""))
    assert len({n.lower() for n in names}) == len(names)
    assert all(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", n) for n in names)
    assert names[0] == "Capital" and names[4] == "task_con"


def test_words_spelled_like_slots_are_refused():
    # Such a template could not be written and read back: the model refuses it outright.
    with pytest.raises(TaskError, match="spelled like a slot"):
        Template(("*1", SUBJECT, OBJECT))


_WORD = st.text(alphabet="abcdefghij", min_size=1, max_size=3)


def _is_entity(text: str) -> bool:
    try:
        ok = check_name(text, "entity") == text
    except TaskError:
        return False
    return ok and not re.fullmatch(r"[a-k0-9]+", text)


_ENTITY = st.one_of(st.sampled_from(AWKWARD), st.text(min_size=1, max_size=6)).filter(_is_entity)
_TASK_NAME = st.text(min_size=1, max_size=8).filter(lambda s: _is_entity(s) or s.isalnum())


@st.composite
def _template(draw, k: int) -> Template:
    before, between, after = (draw(st.lists(_WORD, max_size=2)) for _ in range(3))
    return Template((f"k{k}", *before, SUBJECT, *between, OBJECT, *after))


@st.composite
def tasksets(draw) -> TaskSet:
    """Small routable task sets: each task's templates start with its own marker word."""
    n = draw(st.integers(1, 3))
    names = draw(st.lists(_TASK_NAME, min_size=n, max_size=n, unique_by=str.strip))
    tasks = []
    for k, name in enumerate(names):
        templates = draw(st.lists(_template(k), min_size=1, max_size=2, unique_by=lambda t: t.parts))
        facts = draw(st.dictionaries(_ENTITY, _ENTITY, min_size=1, max_size=4))
        tasks.append(Task(name, tuple(templates), Facts(facts)))
    epsilon = draw(st.none() | st.floats(min_value=0, max_value=1, exclude_min=True, exclude_max=True))
    numbers = st.integers(1, 10**6) | st.floats(min_value=1e-6, max_value=1e6)
    parameters = draw(st.dictionaries(st.sampled_from(tio.PARAMETER_NAMES), numbers))
    return TaskSet(tuple(tasks), epsilon, parameters)


_SETTINGS = settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(tasksets(), st.booleans())
def test_property_dumps_loads_round_trip(ts, ascii):
    text = dumps_tasks(ts, ascii=ascii)
    assert loads_tasks(text) == ts
    if ascii:
        assert text.isascii()


@_SETTINGS
@given(tasksets())
def test_property_dump_with_facts_dir_round_trip(ts):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tasks.yaml")
        dump_tasks(ts, path, facts_dir=os.path.join(tmp, "facts"))
        assert load_tasks(path) == ts
        dump_tasks(ts, path)  # inline, over the previous file
        assert load_tasks(path) == ts
        assert not [n for n in os.listdir(tmp) if n.endswith(".tmp")]


# --------------------------------------------------------------------------- atomic writes


def _small() -> TaskSet:
    return TaskSet((Task("a", (Template.parse("x ⋆1 y ⋆2"),), Facts({"A": "B"})),))


def test_dump_failure_leaves_old_file_and_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "tasks.yaml"
    path.write_text("old content\n", encoding="utf-8")

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(tasks.writing.yaml, "dump", boom)
    with pytest.raises(RuntimeError):
        dump_tasks(_small(), path, facts_dir=tmp_path / "facts")
    assert path.read_text(encoding="utf-8") == "old content\n"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["tasks.yaml"]


def test_dump_failure_while_writing_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "tasks.yaml"
    path.write_text("old content\n", encoding="utf-8")
    (tmp_path / "facts").mkdir()
    (tmp_path / "facts" / "a.tsv").write_text("old facts\n", encoding="utf-8")
    calls = []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:  # the facts file was staged, the YAML file fails
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(tasks.files.os, "fsync", fsync)
    with pytest.raises(TaskError, match="No space left on device"):
        dump_tasks(_small(), path, facts_dir=tmp_path / "facts")
    assert path.read_text(encoding="utf-8") == "old content\n"
    assert (tmp_path / "facts" / "a.tsv").read_text(encoding="utf-8") == "old facts\n"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["a.tsv", "tasks.yaml"]


def test_dump_replaces_atomically_and_keeps_mode(tmp_path):
    path = tmp_path / "tasks.yaml"
    path.write_text("old\n", encoding="utf-8")
    path.chmod(0o640)
    dump_tasks(_small(), path)
    assert load_tasks(path) == _small()
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["tasks.yaml"]


def test_dump_over_its_own_source(tmp_path):
    """Loading a file and dumping to the same path is safe (the new content is complete first)."""
    (tmp_path / "a.tsv").write_text("# comment\nA\tB\n", encoding="utf-8")
    path = tmp_path / "tasks.yaml"
    path.write_text("tasks:\n  - name: a\n    templates: [x *1 y *2]\n    facts_file: a.tsv\n", encoding="utf-8")
    ts = load_tasks(path)
    dump_tasks(ts, path, facts_dir=tmp_path)
    assert load_tasks(path) == ts
    assert (tmp_path / "a.tsv").read_text(encoding="utf-8") == "subject\tobject\nA\tB\n"


def test_dump_refuses_output_that_is_a_facts_file(tmp_path):
    with pytest.raises(TaskError, match="would be overwritten"):
        dump_tasks(_small(), tmp_path / "a.tsv", facts_dir=tmp_path)
    assert os.listdir(tmp_path) == []


def test_dump_to_missing_directory_is_a_task_error(tmp_path):
    with pytest.raises(TaskError, match="missing/tasks.yaml: the output directory does not exist"):
        dump_tasks(_small(), tmp_path / "missing" / "tasks.yaml")


def test_slot_spellings_cover_the_documented_ones():
    assert set(SLOT_SPELLINGS) == {"⋆1", "⋆2", "*1", "*2"}


def test_tsv_round_trip_of_a_fact_that_looks_like_the_header(tmp_path):
    ts = TaskSet((Task("a", (Template.parse("x ⋆1 y ⋆2"),), Facts({"subject": "object", "A #b": "é"})),))
    dump_tasks(ts, tmp_path / "t.yaml", facts_dir=tmp_path)
    assert (tmp_path / "a.tsv").read_text(encoding="utf-8") == "subject\tobject\nsubject\tobject\nA #b\té\n"
    assert load_tasks(tmp_path / "t.yaml") == ts


LIKELY_HEADER = "language{0}creator\nPython{0}Guido van Rossum\nC{0}Dennis Ritchie\n"


def _creator_set(tmp_path, facts: str, name: str = "c.tsv") -> Path:
    (tmp_path / name).write_text(facts, encoding="utf-8")
    (tmp_path / "t.yaml").write_text(f"tasks:\n  - name: creator\n    templates: [\"*1 was created by *2\"]\n"
                                     f"    facts_file: {name}\n", encoding="utf-8")
    return tmp_path / "t.yaml"


@pytest.mark.parametrize("name", ["c.tsv", "c.csv"])
def test_a_header_with_other_names_is_refused_not_read_as_a_fact(tmp_path, name):
    """'language<TAB>creator' above the facts was read as the fact 'language' -> 'creator',
    without a word."""
    sep = "," if name.endswith(".csv") else "\t"
    path = _creator_set(tmp_path, "\n# creators\n" + LIKELY_HEADER.format(sep), name)
    with pytest.raises(TaskError) as info:
        load_tasks(path)
    shown = "," if sep == "," else "<TAB>"
    assert str(info.value) == (
        f"{tmp_path / name}:3: the first line 'language{shown}creator' looks like a header naming the columns, but "
        f"the only header is 'subject{shown}object' (this line would be read as the fact 'language' -> 'creator'); "
        f"write the header as 'subject{shown}object' or comment it out with '#'; if it is a fact, put the header "
        f"line 'subject{shown}object' above it")
    # the bulk reader leaves it to the line reader
    assert tasks.facts_files.read_plain(str(tmp_path / name)) is None


@pytest.mark.parametrize("facts,expected", [
    ("subject\tobject\n" + LIKELY_HEADER.format("\t"),                   # the header above it: a fact
     {"language": "creator", "Python": "Guido van Rossum", "C": "Dennis Ritchie"}),
    ("# " + LIKELY_HEADER.format("\t"), {"Python": "Guido van Rossum", "C": "Dennis Ritchie"}),
    ("python\tguido van rossum\nc\tdennis ritchie\n", {"python": "guido van rossum", "c": "dennis ritchie"}),
    ("language\tcreator\n", {"language": "creator"}),                        # the only line
    ("Language\tCreator\nPython\tGuido\n", {"Language": "Creator", "Python": "Guido"}),
])
def test_what_is_not_a_likely_header_stays_a_fact(tmp_path, facts, expected):
    path = _creator_set(tmp_path, facts)
    assert dict(load_tasks(path).tasks[0].facts) == expected
    got = tasks.facts_files.read_plain(str(tmp_path / "c.tsv"))
    assert got is not None and dict(zip(*[[x.strip() for x in f] for f in got])) == expected


def test_line_numbers_count_only_real_line_ends():
    """PyYAML counts U+2028 as a line break; messages count lines as editors and grep do."""
    text = ('tasks:\n  - name: "a"\n    templates: ["x\u2028y *1 z *2"]\n'
            "    facts:\n      France: Paris\n      France: Lyon\n")
    with pytest.raises(TaskError) as info:
        loads_tasks(text, file="ls.yaml")
    assert str(info.value).startswith("ls.yaml:6: subject 'France'")
    assert "(line 5)" in str(info.value)


def test_permission_denied_simulated(tmp_path, monkeypatch):
    """The same as test_permission_denied, also when running as root."""
    (tmp_path / "f.tsv").write_text("A\tB\n", encoding="utf-8")
    path = tmp_path / "t.yaml"
    path.write_text("tasks:\n  - name: a\n    templates: [x *1 y *2]\n    facts_file: f.tsv\n", encoding="utf-8")
    real_open = open

    def guarded_open(file, *args, **kwargs):
        if str(file).endswith(guarded):
            raise PermissionError(13, "Permission denied")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(tasks.yaml_nodes, "open", guarded_open, raising=False)   # the tasks file
    monkeypatch.setattr(tasks.facts_files, "open", guarded_open, raising=False)  # its facts files
    guarded = "t.yaml"
    with pytest.raises(TaskError, match=r"t\.yaml: tasks file .* cannot be read: permission denied"):
        load_tasks(path)
    guarded = "f.tsv"
    with pytest.raises(TaskError, match=r"t\.yaml:4: facts file .*f\.tsv' cannot be read: permission denied"):
        load_tasks(path)


# --------------------------------------------------------------------------- control characters

#: Every control character (Unicode category Cc) but NUL, tabs and line breaks, which have
#: their own messages.
CONTROLS = [c for c in map(chr, range(0xA0))
            if unicodedata.category(c) == "Cc" and c not in "\x00\t\n\r\v\f\x1c\x1d\x1e\x85"]


def test_the_control_characters_are_exactly_the_category_cc():
    from tasks.model import _CONTROL, _REFUSED, control_character

    every = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    assert [c for c in every if _CONTROL.search(c)] == [c for c in every if unicodedata.category(c) == "Cc"]
    assert control_character("a\x03b\x7f") == "U+0003" and control_character("né") is None
    for c in map(chr, range(0x3000)):            # the bulk check refuses exactly what check_name refuses
        try:
            accepted = check_name(f"a{c}b", "name") == f"a{c}b"
        except TaskError:
            accepted = False
        assert tasks.model.plain_names([f"a{c}b"]) == accepted == (_REFUSED.search(c) is None), repr(c)


@pytest.mark.parametrize("c", CONTROLS[::7] + ["\x7f", "\x9f"])
def test_names_with_a_control_character_are_refused_with_file_line_and_code(tmp_path, c):
    code = f"U+{ord(c):04X}"
    escaped = '"\\x%02x"' % ord(c)       # a YAML double-quoted escape: the YAML reader refuses the raw byte
    cases = [
        ("tasks:\n  - name: " + escaped[:-1] + 't"\n    templates: [a *1 b *2]\n    facts: {x: y}\n', 2, "task name"),
        ("tasks:\n  - name: t\n    templates: [" + escaped[:-1] + ' *1 b *2"]\n    facts: {x: y}\n',
         3, "template word"),
        ("tasks:\n  - name: t\n    templates: [a *1 b *2]\n    facts:\n      x: y\n      " + escaped + ": y\n",
         6, "subject"),
    ]
    for text, line, what in cases:
        with pytest.raises(TaskError) as e:
            loads_tasks(text, file="t.yaml")
        assert str(e.value).startswith(f"t.yaml:{line}: {what} ") and code in str(e.value), (what, str(e.value))
        assert "\n" not in str(e.value) and c not in str(e.value)
    for name, body in (("f.tsv", f"x\ty\nz\tw{c}v\n"), ("f.csv", f'x,y\nz,"w{c}v"\n'), ("g.csv", f"x,y\nz{c},w\n")):
        (tmp_path / name).write_text(body, encoding="utf-8")
        path = tmp_path / "tasks.yaml"
        path.write_text(f"tasks:\n  - name: t\n    templates: [a *1 b *2]\n    facts_file: {name}\n", encoding="utf-8")
        with pytest.raises(TaskError) as e:
            load_tasks(path)
        assert str(e.value).startswith(f"{tmp_path / name}:2: ") and code in str(e.value), str(e.value)
        assert "remove it" in str(e.value) and c not in str(e.value)
