"""Refusals that cost less than the work they refuse: every limit of the tasks reader is checked
before any work that grows faster than the input, and no template's text is made per word.

The limits (tasks.yaml_nodes, tasks.model, tasks.facts_files): a tasks file of at most 4 MiB
and lines of at most 1 MiB, checked on the raw bytes before PyYAML composes anything;
templates of at most 1,000 words, checked as each is parsed (before the structure trie, which
holds every prefix); names of at most 1,000 characters; facts-file lines of at most 1 MiB.
Malformed YAML (a syntax error, a tab PyYAML refuses, an alias, nesting too deep, an anchor
defined twice, a second document) is refused from libyaml's event stream before the
pure-Python composer starts (tasks.yaml_nodes.scan), with the composer's line and, but for
libyaml's wording of a syntax error, its message; a text that passes is composed from the
same events (the composer's node graph: tests/tasks/test_yaml_composition.py), so a problem of
the tasks themselves is found without the composer too.
No test here times anything: each asserts *where* the refusal happens (the composer or the
trie never entered, the template's text made a bounded number of times) and what it says.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

import tasks.facts_files
import tasks.model
import test_facts_bulk
import tasks.reading
import tasks.yaml_nodes
from cli.main import main
from tasks.errors import TaskError
from tasks.io import dumps_tasks, input_files, load_tasks, loads_tasks
from tasks.model import MAX_NAME_LENGTH, MAX_TEMPLATE_LENGTH, Task, TaskSet, Template
from tasks.structure import StructureTrie
from tasks.yaml_nodes import MAX_TASKS_FILE_BYTES, MAX_TASKS_LINE_BYTES, _Loader, _Tree
from repository import DATA, EXAMPLES


def one_line_exit_2(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, (code, out.err[:500], out.out[:500])
    assert len(lines) == 1 and "Traceback" not in out.err, out.err[:500]
    return lines[0]


def long_template(words: int) -> str:
    body = [f"w{i}" for i in range(words - 2)]
    return " ".join(body[: len(body) // 2] + ["*1"] + body[len(body) // 2:] + ["*2"])


def long_set(words: int) -> str:
    return (f'tasks:\n  - name: long\n    templates: ["{long_template(words)}"]\n    facts:\n'
            '      S0: O0\n      S1: O1\n')


@pytest.fixture
def counted(monkeypatch):
    """Counts of the costly steps: a template's text made, a structure trie built, PyYAML's
    pure-Python composer started ("compose"), a node graph built from libyaml's events
    ("libyaml"). Each still runs (a count, not a block)."""
    calls = {"text": 0, "trie": 0, "compose": 0, "libyaml": 0}
    text, trie, loader, tree = Template.text, StructureTrie.__init__, _Loader.__init__, _Tree.__init__

    def count(name, original):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(Template, "text", count("text", text))
    monkeypatch.setattr(StructureTrie, "__init__", count("trie", trie))
    monkeypatch.setattr(_Loader, "__init__", count("compose", loader))
    monkeypatch.setattr(_Tree, "__init__", count("libyaml", tree))
    return calls


# --- templates: the text made once, the length refused before the trie --------------------------------


def test_a_long_template_is_read_without_making_its_text_per_word(tmp_path, counted):
    """A template of 900 words (under the limit) loads; its text is made for messages only.
    The reader once made it for every word it holds (twice: the word/entity check of the
    reader and of the task set), n² steps for n words."""
    path = tmp_path / "t.yaml"
    path.write_text(long_set(900), encoding="utf-8")
    ts = load_tasks(path)
    assert ts.L == 900 and counted["trie"] == 1
    assert counted["text"] <= 2, counted        # Template's own checks build it once


def test_the_word_and_entity_check_of_a_task_set_does_not_make_texts():
    counts = []
    original = Template.text
    Template.text = lambda self, ascii=False: counts.append(1) or original(self, ascii)
    try:
        template = Template.parse(long_template(500))
        TaskSet((Task("a", (template,), {"S": "O"}),))
        assert counts == []
        with pytest.raises(TaskError, match=r"token 'w3' is a word of template 'w0 w1 w2 w3 .*' in task 'a' "
                                            r"and also the object of a fact in task 'b'"):
            TaskSet((Task("a", (template,), {"S": "O"}), Task("b", ("x ⋆1 y ⋆2",), {"T": "w3"})))
        assert len(counts) == 1                      # the message's
    finally:
        Template.text = original


@pytest.mark.parametrize("command", [["check"], ["inspect"], ["build", "-o", "w.npz"]])
def test_a_10002_word_template_is_refused_before_the_structure_trie(tmp_path, capsys, counted, command):
    path = tmp_path / "long.yaml"
    path.write_text(long_set(10_002), encoding="utf-8")
    argv = [command[0], path] + [tmp_path / a if a.endswith(".npz") else a for a in command[1:]]
    line = one_line_exit_2(capsys, argv)
    assert line.startswith(f"error: {path}:3: a template of 10002 words is longer than the {MAX_TEMPLATE_LENGTH}")
    assert "split the sentence into shorter templates" in line
    assert counted["trie"] == 0 and counted["text"] <= 2, counted
    assert not (tmp_path / "w.npz").exists()


def test_the_longest_template_accepted_is_read(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(long_set(MAX_TEMPLATE_LENGTH), encoding="utf-8")
    assert load_tasks(path).L == MAX_TEMPLATE_LENGTH
    path.write_text(long_set(MAX_TEMPLATE_LENGTH + 1), encoding="utf-8")
    with pytest.raises(TaskError, match=r"t\.yaml:3: a template of 1001 words is longer than the 1000"):
        load_tasks(path)


# --- the tasks file: size and lines checked on the bytes, before YAML ---------------------------------


def test_a_20_MB_one_line_scalar_is_refused_before_yaml_composes_it(tmp_path, capsys, counted):
    path = tmp_path / "big.yaml"
    path.write_text('tasks:\n  - name: big\n    templates: ["x *1 y *2"]\n    facts: {A: "' + "a" * 20_000_000 + '"}\n',
                    encoding="utf-8")
    line = one_line_exit_2(capsys, ["check", path])
    assert line == (f"error: {path}: the file is 20,000,069 bytes, more than the 4,194,304 bytes a tasks file may "
                    f"have; put large dictionaries in facts files (facts_file: a TSV or CSV file), read in bulk")
    assert counted["compose"] == 0


def test_a_2_MB_line_is_refused_at_its_line_before_yaml_composes_it(tmp_path, capsys, counted):
    path = tmp_path / "name.yaml"
    path.write_text('tasks:\n  - name: big\n    templates: ["x *1 y *2"]\n    facts:\n      A: B\n      C: '
                    + "c" * 2_000_000 + "\n      D: E\n", encoding="utf-8")
    line = one_line_exit_2(capsys, ["check", path])
    assert line.startswith(f"error: {path}:6: line is 2,000,009 bytes long, more than the 1,048,576 a line of a "
                           f"tasks file may have; a name has at most 1,000 characters")
    assert counted["compose"] == 0


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_the_long_line_is_counted_as_editors_count_lines(monkeypatch, end):
    monkeypatch.setattr(tasks.yaml_nodes, "MAX_TASKS_LINE_BYTES", 20)
    lines = ["tasks:", "- name: a", "  templates:", "  - x *1 y *2", "  facts:", "    A: B", "    C: " + "D" * 20]
    with pytest.raises(TaskError, match=r"^t\.yaml:7: line is 27 bytes long, more than the 20 "):
        loads_tasks(end.join(lines + [""]), file="t.yaml")
    assert loads_tasks(end.join(lines[:-1] + [""]), file="t.yaml").tasks[0].facts == {"A": "B"}


def test_the_limits_hold_for_text_and_bytes_given_in_python(counted):
    big = "tasks: []\n" + "#" * MAX_TASKS_FILE_BYTES
    for text in (big, big.encode(), "é" * (MAX_TASKS_FILE_BYTES // 2 + 1)):
        with pytest.raises(TaskError, match="more than the 4,194,304 bytes a tasks file may have"):
            loads_tasks(text, file="t.yaml")
    with pytest.raises(TaskError, match=r"t\.yaml:2: line is 1,048,577 bytes long"):
        loads_tasks("tasks:\n#" + "x" * MAX_TASKS_LINE_BYTES + "\n", file="t.yaml")
    assert counted["compose"] == 0


def test_a_file_that_grows_is_read_no_further_than_the_limit(tmp_path, monkeypatch):
    """The size is checked before the read and the read stops past the limit, so a file that
    grows between the two is refused all the same, without reading all of it."""
    path = tmp_path / "t.yaml"
    path.write_bytes(b"tasks: []\n" + b"#" * (MAX_TASKS_FILE_BYTES + 100))
    with pytest.raises(TaskError, match=r"t\.yaml: the file is 4,194,414 bytes"):
        load_tasks(path)
    real = os.stat(path)
    small = os.stat_result(tuple(real)[:6] + (10,) + tuple(real)[7:10])      # the size when it was small
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: small if os.fspath(p) == str(path) else real)
    assert len(tasks.yaml_nodes.read_bytes(str(path), "tasks file", MAX_TASKS_FILE_BYTES)) == MAX_TASKS_FILE_BYTES + 1
    with pytest.raises(TaskError, match=r"t\.yaml: the file is 4,194,305 bytes"):
        load_tasks(path)


def test_the_list_of_input_files_does_not_read_a_huge_file(tmp_path, monkeypatch):
    path = tmp_path / "t.yaml"
    path.write_bytes(b"tasks:\n  - name: a\n    facts_file: f.tsv\n" + b"#" * MAX_TASKS_FILE_BYTES)
    opened = []
    real_open = open

    def spy(file, *args, **kwargs):
        opened.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    assert input_files(path) == [str(path)]
    assert str(path) not in opened


def test_a_set_too_large_for_the_reader_is_not_dumped_inline(monkeypatch):
    ts = TaskSet((Task("a", ("x ⋆1 y ⋆2",), {f"S{i}": f"O{i}" for i in range(100)}),))
    text = dumps_tasks(ts)
    monkeypatch.setattr(tasks.yaml_nodes, "MAX_TASKS_FILE_BYTES", len(text.encode()) - 1)
    with pytest.raises(TaskError, match="the YAML would not be read back: the file is .* bytes.*facts_dir"):
        dumps_tasks(ts)
    with pytest.raises(TaskError, match="more than the"):
        loads_tasks(text)


# --- malformed YAML: refused from libyaml's events, before the composer -------------------------------

needs_libyaml = pytest.mark.skipif(tasks.yaml_nodes.CParser is None, reason="PyYAML without libyaml")

#: The facts of a large file: about 3.5 MB, the composer's 6 s and 200 MB.
BIG = 115_000

#: name -> (what ends the file, the line of the refusal from the first line of that end, a
#: part of the message). The messages of the YAML syntax errors are libyaml's.
MALFORMED = {
    "unclosed quote": ('      Last: "never closed\n', 1, "found unexpected end of stream (while scanning a quoted "
                       "scalar on line {0})"),
    "bad indentation": ("     Last: X\n", 0, "did not find expected key (while parsing a block mapping on line 2)"),
    "tab indenting": ("\tLast: X\n", 0, "found a tab character that violates indentation"),
    "tab after a colon": ("      Last:\tX\n", 0, "found character '\\t' that cannot start any token (while scanning "
                          "for the next token); indent with spaces, not tabs"),
    "tab in a flow list": ("      Last: [a,\tb]\n", 0, "found character '\\t' that cannot start any token"),
    "alias": ("      Last: *x\n", 0, "alias '*x' is not supported in a tasks file"),
    "nesting": ("      Last: " + "[" * 40 + "]" * 40 + "\n", 0, "the YAML is nested too deeply (more than 32 levels)"),
    "anchor twice": ("      A: &a x\n      B: &a y\n", 1, "YAML syntax error: second occurrence (found duplicate "
                     "anchor 'a'; first occurrence on line {0})"),
    "two documents": ("---\ntasks: []\n", 0, "the file holds more than one YAML document"),
    "question mark": ("      Last: [what?, x]\n", 0, "YAML syntax error: expected ',' or ']', but got '?' (while "
                      "parsing a flow sequence)"),
    "block scalar": ("      Last: >#c\n        x\n", 0, "expected chomping or indentation indicators, but found '#'"),
    "alias after tabs in comments": ("".join(f"      C{i}: D{i}  # a\tb\n" for i in range(10_000)) + "      Last: *x\n",
                                     10_000, "alias '*x' is not supported in a tasks file"),
}

#: The cases libyaml finds and words (the others have PyYAML's message).
LIBYAML_WORDS = {"unclosed quote", "bad indentation", "tab indenting"}


def malformed(path: Path, end: str, facts: int) -> int:
    """Write a tasks file of ``facts`` inline facts ended by ``end``; the line ``end`` starts on."""
    head = 'tasks:\n  - name: big\n    templates: ["x *1 y *2"]\n    facts:\n'
    path.write_text(head + "".join(f"      Subject{i}: Object{i}\n" for i in range(facts)) + end, encoding="utf-8")
    return 5 + facts


@needs_libyaml
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_large_malformed_file_is_refused_before_the_composer_starts(tmp_path, capsys, counted, case):
    """A 3.5 MB file malformed at its end is refused at its line from libyaml's events; PyYAML's
    composer, some 2 s and 60 MB a MB, never starts."""
    end, offset, fragment = MALFORMED[case]
    path = tmp_path / "big.yaml"
    first = malformed(path, end, BIG)
    assert path.stat().st_size > 3_000_000
    line = one_line_exit_2(capsys, ["check", path])
    assert line.startswith(f"error: {path}:{first + offset}: "), line
    assert fragment.format(first) in line, line
    assert counted["compose"] == 0


#: name -> (what ends the file, the line of the refusal from the first line of that end, a
#: part of the message): problems of the tasks themselves, found in the node graph.
TASK_LEVEL = {
    "key twice in a task": ("    name: again\n", 0, "key 'name' appears twice in task 'again' (lines 2 and {0})"),
    "subject with two objects": ("      Subject5: Other\n", 0,
                                 "subject 'Subject5' of task 'big' has two objects: 'Object5' (line 10) and 'Other'"),
    "template without its object slot": ('  - name: second\n    templates: ["x *1 y"]\n    facts: {A: B}\n', 1,
                                         "template 'x ⋆1 y' has no object slot ⋆2"),
    "a word as a subject": ("      x: Other\n", 0, "'x' is the subject of a fact of task 'big' and also a word of "
                            "template 'x ⋆1 y ⋆2' of task 'big' (line 3)"),
    "an object not a string": ("      Last: [a, b]\n", 0, "the object of 'Last' in task 'big' is a list, not a string"),
}


@needs_libyaml
@pytest.mark.parametrize("case", sorted(TASK_LEVEL))
def test_a_problem_of_the_tasks_in_a_large_file_is_found_without_the_composer(tmp_path, capsys, counted, case):
    """A 3.5 MB file whose YAML passes is composed from the same libyaml events that the scan
    read (tasks.yaml_nodes._Tree), and its inline facts are read in bulk: a problem of the
    tasks at its end is refused at its line without PyYAML's composer, and the valid file
    loads without it."""
    end, offset, fragment = TASK_LEVEL[case]
    path = tmp_path / "big.yaml"
    first = malformed(path, end, BIG)
    assert path.stat().st_size > 3_000_000
    line = one_line_exit_2(capsys, ["check", path])
    assert line.startswith(f"error: {path}:{first + offset}: "), line
    assert fragment.format(first) in line, line
    assert counted["compose"] == 0 and counted["libyaml"] == 1


@needs_libyaml
def test_a_large_valid_file_loads_without_the_composer(tmp_path, counted):
    path = tmp_path / "big.yaml"
    malformed(path, "", BIG)
    ts = load_tasks(path)
    assert len(ts.tasks[0].facts) == BIG and ts.tasks[0].facts["Subject7"] == "Object7"
    assert counted["compose"] == 0 and counted["libyaml"] == 1


@needs_libyaml
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_the_scan_refuses_as_the_composer_does(monkeypatch, case):
    """The same files, small, read without the scan (the composer refuses them as it always
    did): the same line, and the same message but for libyaml's wording of a syntax error."""
    end, _, _ = MALFORMED[case]
    head = 'tasks:\n  - name: t\n    templates: ["x *1 y *2"]\n    facts:\n      A: B\n'
    with pytest.raises(TaskError) as scanned:
        loads_tasks(head + end, file="t.yaml")
    monkeypatch.setattr(tasks.yaml_nodes, "CParser", None)
    with pytest.raises(TaskError) as composed:
        loads_tasks(head + end, file="t.yaml")
    assert scanned.value.line == composed.value.line
    if case in LIBYAML_WORDS:
        assert scanned.value.problem.startswith("YAML syntax error") and scanned.value.fix == composed.value.fix
    else:
        assert str(scanned.value) == str(composed.value)


@needs_libyaml
@pytest.mark.parametrize("text", [
    "tasks: " + "[" * 31 + "]" * 31 + "\n",                    # the deepest node at depth 32: read
    "tasks: " + "[" * 32 + "]" * 32 + "\n",                    # at 33: refused
    "tasks:\n" + "".join("  " * i + "- \n" for i in range(1, 34)),
    "a: &x 1\nb: [&y 2, &x 3]\n", "a: !!str &x 1\nb: &x 2\n",  # an anchor twice, with a tag before it
    "a: 1\n--- \nb: 2\n", "--- a\n...\n",                     # two documents, one
    "a: 'x\ty'\nb: \"\tz\"\nc: |\n  \tw\nd: *x\n",               # tabs in scalars, then an alias
    "a: [b, c?]\n", "a: {b: c?d}\n", "a: [b, {c: d?}]\n", "a: [b, c: d?]\n", "a: [?b]\n", "a: &q [x?y]\n",
    "a: [&p {x: y?z}]\n", "a: [{x: y}: b?c]\n", "a: [[x]: b?c]\n", "a: {[x]: y, z: w?}\n", "[a]: [b?]\n",
    "a: |2-\n   x\n", "a: >-3 # c\n    x\n", "a: |\t\n x\n",
    "a: !!python/object/apply:os.sy[stem [x]\n", "%YAML 1.3\n---\na: 1\n", "a: 1\n\ufeffb: *x\n",   # libyaml refuses
    "a: [?]\nb: *x\n", "\ufeffa: |\n  x\nb: *y\n",
])
def test_small_cases_are_refused_as_the_composer_refuses_them(monkeypatch, text):
    def read():
        try:
            return loads_tasks(text, file="t.yaml", routable=False)
        except TaskError as e:
            return e.line, str(e)

    scanned = read()
    monkeypatch.setattr(tasks.yaml_nodes, "CParser", None)
    assert scanned == read()


def test_without_libyaml_the_composer_refuses_as_before(tmp_path, monkeypatch, counted):
    """Where PyYAML has no libyaml, nothing is scanned: the composer refuses, with PyYAML's
    wording (the limits of size still hold)."""
    monkeypatch.setattr(tasks.yaml_nodes, "CParser", None)
    path = tmp_path / "t.yaml"
    first = malformed(path, "    templates: [a, b\n", 3)
    with pytest.raises(TaskError, match=rf"t\.yaml:{first + 1}: YAML syntax error: expected ',' or '\]', but got "
                                        r"'<stream end>' \(while parsing a flow sequence on line \d+\)"):
        load_tasks(path)
    assert counted["compose"] == 1


@needs_libyaml
def test_a_tab_in_a_comment_or_quotes_is_not_refused(counted):
    """Tabs PyYAML reads: in quotes, in a block scalar, in a comment (after a '#' at the start
    of a line or after a space)."""
    text = ('tasks:  # the\ttasks\n  - name: "t"\n    templates: ["x *1 y *2"]   #\tone\n'
            "# a\tcomment\n    facts: {A: B}\nepsilon: |\n  not\ta number\n")
    with pytest.raises(TaskError, match=r"^t\.yaml:6: epsilon is the quoted string 'not\\ta number\\n', not a number"):
        loads_tasks(text, file="t.yaml")
    assert counted["compose"] == 0 and counted["libyaml"] == 1          # read from libyaml's events alone
    ts = loads_tasks(text.replace("epsilon: |\n  not\ta number\n", "epsilon: 0.5 # \t\n"), file="t.yaml")
    assert ts.epsilon == 0.5 and ts.tasks[0].facts == {"A": "B"}


SEEDS = [EXAMPLES / "capitals.yaml", EXAMPLES / "located.yaml", DATA / "good" / "tasks.yaml"]
#: What one edit inserts: YAML's indicators, white space, quotes, comments, line breaks PyYAML
#: counts (a byte-order mark inside the text, a tag and a directive left out: libyaml refuses
#: some that PyYAML reads, see tasks.yaml_nodes.scan).
PIECES = ["\t", "\t", " ", "  ", "\n", "\r", ":", ": ", "- ", "[", "]", "{", "}", ",", "'", '"', "\\", "#", "# \t",
          "&a ", "*a", "*1", "---", "---\n", "...", "|", ">", "?", "@", "`", "é", "\x85", "\u2028", "\n  ", "\n    ",
          "\n\t", "'a\tb'", '"a\\tb"', '"\\q"', "|\n  a\tb\n", "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["]


@needs_libyaml
@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(SEEDS), where=st.floats(0, 1), piece=st.sampled_from(PIECES),
       how=st.sampled_from(["insert", "replace", "delete"]))
def test_one_edit_of_a_valid_file_is_read_as_without_the_scan(seed, where, piece, how):
    """One edit of a valid tasks file: read with and without the scan, the same task set, or
    refusals at the same line, with the same message but for libyaml's wording of a syntax
    error. (The scan refuses; it never changes what is read.)"""
    text = seed.read_text(encoding="utf-8")
    i = int(where * len(text))
    text = {"insert": text[:i] + piece + text[i:], "replace": text[:i] + piece + text[i + len(piece):],
            "delete": text[:i] + text[i + 1 + len(piece) % 3:]}[how]

    def read():
        try:
            return loads_tasks(text, file="t.yaml", base_dir=str(seed.parent))
        except TaskError as e:
            return e

    scanned = read()
    real = tasks.yaml_nodes.CParser
    tasks.yaml_nodes.CParser = None
    try:
        composed = read()
    finally:
        tasks.yaml_nodes.CParser = real
    if isinstance(composed, TaskSet):
        assert scanned == composed
        return
    assert isinstance(scanned, TaskError) and scanned.line == composed.line, (str(scanned), str(composed))
    if not (scanned.problem.startswith("YAML syntax error") and composed.problem.startswith("YAML syntax error")):
        assert str(scanned) == str(composed)


def test_the_scan_leaves_lines_to_the_composer_it_cannot_place(counted):
    """A tab after a '#' that may not start a comment (after a bracket: it does), and one
    libyaml had not placed when it met an error, past a quote: the composer decides."""
    for text, line in (("tasks: []#c\tz\nx: *a\n", 2), ("'a\tb' - c\n", 1)):
        counted["compose"] = 0
        with pytest.raises(TaskError) as info:
            loads_tasks(text, file="t.yaml")
        assert info.value.line == line and counted["compose"] == 1, str(info.value)


# --- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where, line", [("subject", 5), ("object", 5), ("task", 2), ("word", 3)])
def test_a_name_longer_than_the_limit_is_refused_at_its_line(tmp_path, capsys, where, line):
    long = "n" * (MAX_NAME_LENGTH + 1)
    name, template, s, o = "t", "x *1 y *2", "A", "B"
    if where == "subject":
        s = long
    elif where == "object":
        o = long
    elif where == "task":
        name = long
    else:
        template = f"x *1 {long} *2"
    path = tmp_path / "t.yaml"
    path.write_text(f'tasks:\n  - name: {name}\n    templates: ["{template}"]\n    facts:\n      {s}: {o}\n',
                    encoding="utf-8")
    got = one_line_exit_2(capsys, ["check", path])
    assert f"{path}:{line}: " in got
    assert "'nnnnnnnnnnnnnnnnnnnn'... is 1,001 characters long, more than the 1,000" in got
    assert len(got) < 400                            # the name is not printed whole


def test_the_longest_name_accepted_is_read(tmp_path):
    long = "n" * MAX_NAME_LENGTH
    (tmp_path / "f.tsv").write_text(f"{long}\t{long}x\n", encoding="utf-8")
    text = f'tasks:\n  - name: {long}\n    templates: ["x *1 {long[:-1]}y *2"]\n    facts:\n      {long}: B\n'
    ts = loads_tasks(text)
    assert ts.tasks[0].name == long and ts.tasks[0].facts == {long: "B"}
    with pytest.raises(TaskError, match=r"f\.tsv:1: object 'n.*is 1,001 characters long"):
        loads_tasks(text.replace("facts:\n      " + long + ": B", "facts_file: f.tsv"), base_dir=str(tmp_path))


@pytest.mark.parametrize("body, line", [
    ("subject\tobject\nA\tB\nC\t{long}\n", 3),                     # one line of one fact
    ("A\tB\n# {long}\nC\t {long} \nD\tE\n", 3),                     # a long comment, then the name
    ("{long}\tB\n", 1),
])
def test_a_long_name_in_a_facts_file_is_refused_by_the_bulk_reader_too(tmp_path, capsys, body, line):
    (tmp_path / "f.tsv").write_text(body.format(long="y" * 500_000), encoding="utf-8")
    path = tmp_path / "t.yaml"
    path.write_text("tasks:\n  - name: t\n    templates: [x *1 y *2]\n    facts_file: f.tsv\n", encoding="utf-8")
    got = one_line_exit_2(capsys, ["check", path])
    assert f"f.tsv:{line}: " in got and "is 500,000 characters long, more than the 1,000 a name may have" in got


def test_a_20_MB_facts_field_is_refused_at_its_line(tmp_path, capsys):
    (tmp_path / "f.tsv").write_text("subject\tobject\nA\tB\nC\t" + "x" * 20_000_000 + "\nD\tE\n", encoding="utf-8")
    path = tmp_path / "t.yaml"
    path.write_text("tasks:\n  - name: t\n    templates: [x *1 y *2]\n    facts_file: f.tsv\n", encoding="utf-8")
    got = one_line_exit_2(capsys, ["check", path])
    assert f"{tmp_path / 'f.tsv'}:3: line is longer than 1048576 bytes" in got


def test_the_bulk_reader_measures_names_only_where_a_line_is_long(monkeypatch):
    """Its fields' lengths are measured only in a file with a line longer than a name may be
    (a field has no more characters than its line has bytes)."""
    measured = []
    real_max = max

    def spy(*args, **kwargs):
        measured.append(1)
        return real_max(*args, **kwargs)

    monkeypatch.setattr(tasks.facts_files, "max", spy, raising=False)
    data = b"".join(b"Q%d\tQ%d\n" % (i, 7 * i) for i in range(100_000))
    subjects, objects = tasks.facts_files.read_plain("f.tsv", data)
    assert len(subjects) == 100_000 and measured == [1]              # the longest line only
    measured.clear()
    assert tasks.facts_files.read_plain("f.tsv", data + b"A\t" + b"b" * (MAX_NAME_LENGTH + 1) + b"\n") is None
    assert len(measured) == 2                                        # the line, then the fields


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(case=test_facts_bulk.files())
def test_bulk_reader_agrees_on_the_name_length_limit(monkeypatch, case):
    """With names of at most 8 characters, the bulk reader gives the line reader's facts or declines."""
    for module in (tasks.model, tasks.facts_files, tasks.reading):
        monkeypatch.setattr(module, "MAX_NAME_LENGTH", 8)
    test_facts_bulk.test_bulk_reader_agrees_with_the_line_reader.hypothesis.inner_test(case)
