"""The node graph read from libyaml's events is the one PyYAML's pure-Python composer makes.

Where PyYAML has libyaml, :func:`tasks.yaml_nodes.scan` builds the node graph from libyaml's
events as it reads them (``_Tree``), and PyYAML's composer runs only on a text the scan
leaves to it. Here both read the same texts (the composer alone is what runs where PyYAML
has no libyaml: ``tasks.yaml_nodes.CParser = None``): every node must have the same kind,
tag, value, style, flow style and marks (offset, line, column, start and end), and loading
must give the same task set, or a refusal at the same line with the same message (but for
libyaml's wording of a syntax error). The texts: every YAML file of the repository
(examples, the training sets, the good and bad corpora), random task sets written in random
YAML styles, random edits of valid files, and the cases where the two parsers' own
events differ (an empty value in a flow collection, a list in its mapping's column, a
scalar tagged '!', the end of a text without a last line end, a byte-order mark).
"""

from __future__ import annotations

import gc

import pytest
import yaml
from budget import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

import tasks.yaml_nodes as yaml_nodes
from tasks.errors import TaskError
from tasks.io import loads_tasks
from tasks.model import TaskSet
from tasks.reading import _Builder
from tasks.strategies import shared_template_task_sets, task_sets
from tasks.writing import _document, _Dumper
from tasks.yaml_nodes import LineMap, _Loader, _Tree
from test_input_limits import PIECES
from repository import DATA, ROOT

needs_libyaml = pytest.mark.skipif(yaml_nodes.CParser is None, reason="PyYAML without libyaml")

CORPUS = sorted({*ROOT.glob("examples/**/*.yaml"), *ROOT.glob("docs/training/*.yaml"),
                 *DATA.glob("**/*.yaml")})


def shape(node):
    """Everything of a node graph that a reader can see, as nested tuples."""
    if node is None:
        return None

    def mark(m):
        return m.name, m.index, m.line, m.column

    kind = next(k.__name__ for k in (ScalarNode, SequenceNode, MappingNode) if isinstance(node, k))
    head = (kind, node.tag, mark(node.start_mark), mark(node.end_mark))
    if isinstance(node, ScalarNode):
        return head + (node.value, node.style)
    if isinstance(node, SequenceNode):
        return head + (node.flow_style, [shape(n) for n in node.value])
    return head + (node.flow_style, [(shape(k), shape(v)) for k, v in node.value])


class Counting:
    """Counts of the node graphs built from libyaml's events and of the composers started."""

    def __init__(self, monkeypatch):
        self.trees = self.composers = 0
        tree, loader = _Tree.__init__, _Loader.__init__

        def count_tree(*args, **kwargs):
            self.trees += 1
            return tree(*args, **kwargs)

        def count_loader(*args, **kwargs):
            self.composers += 1
            return loader(*args, **kwargs)

        monkeypatch.setattr(_Tree, "__init__", count_tree)
        monkeypatch.setattr(_Loader, "__init__", count_loader)


def without_libyaml(read):
    """``read()`` as where PyYAML has no libyaml: its pure-Python composer alone."""
    real = yaml_nodes.CParser
    yaml_nodes.CParser = None
    try:
        return read()
    finally:
        yaml_nodes.CParser = real


def composed(text: str):
    """The node graph of a text (:func:`shape`), or (line, message) of its refusal."""
    try:
        return "tree", shape(yaml_nodes.compose(text, "t.yaml", LineMap(text)))
    except TaskError as e:
        return "refused", e.line, str(e)


def loaded(text: str, base_dir: str | None = None):
    """The task set a text loads to, or its refusal."""
    try:
        return loads_tasks(text, file="t.yaml", base_dir=base_dir)
    except TaskError as e:
        return e


def same_refusal(a: TaskError, b: TaskError) -> bool:
    """The same line, and the same message but for libyaml's wording of a syntax error."""
    if a.line != b.line:
        return False
    return str(a) == str(b) or (a.problem.startswith("YAML syntax error") and b.problem.startswith("YAML syntax error"))


def assert_read_alike(text: str, base_dir: str | None = None, lines: bool = True) -> bool:
    """Both ways of reading ``text`` agree: the same node graph, and the same task set, or
    both refuse it (``lines``: at the same line, as :func:`same_refusal`). Returns whether
    the libyaml side read it from libyaml's events (else the scan refused it, or left it to
    the composer)."""
    got, want = composed(text), without_libyaml(lambda: composed(text))
    if got[0] == "tree" or want[0] == "tree":
        assert got == want, "the node graphs differ"
    elif lines:
        assert got[1] == want[1], (got, want)
    a, b = loaded(text, base_dir), without_libyaml(lambda: loaded(text, base_dir))
    if isinstance(a, TaskSet) or isinstance(b, TaskSet):
        assert a == b, (a, b)
    elif lines:
        assert same_refusal(a, b), (str(a), str(b))
    try:
        return not isinstance(yaml_nodes.scan(text, "t.yaml", LineMap(text)), yaml_nodes._Left)
    except (TaskError, yaml.YAMLError):
        return False


# --- the files of the repository ---------------------------------------------------------------------


@needs_libyaml
@pytest.mark.parametrize("path", CORPUS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_file_of_the_repository_is_read_alike(path, monkeypatch):
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        pytest.skip("not UTF-8 (refused before any YAML is read)")
    counting = Counting(monkeypatch)
    from_events = assert_read_alike(text, str(path.parent))
    if "bad" not in path.parts:
        assert from_events, "a valid file is read from libyaml's events"
    if from_events:
        assert counting.composers == 2 and counting.trees == 3       # the composer only without libyaml


def test_the_corpus_is_there():
    names = {p.name for p in CORPUS}
    assert {"capitals.yaml", "located.yaml", "tasks.yaml", "duplicate_subject.yaml"} <= names and len(CORPUS) > 50


# --- where libyaml's events and PyYAML's differ -----------------------------------------------------


@needs_libyaml
@pytest.mark.parametrize("text", [
    "a: [b: ]\n", "a: [b: , c]\n", "a: {b: }\n", "a: {b: , c: d}\n", "a: {? b : }\n", "a: {? : }\n", "{? }",
    "a: {b: # x:\n }\n", "a: [b: # x?\n ]\n", "a: {? b # c\n : }\n", "{a: , ? }", "[ ? x : ]", "a: {b}\n",
    "a: [? b]\n", "a: [&x : ]\n", "a: {!!str : b}\n", "a: {? : c, ?}\n",   # empty values in flow collections
    "a:\n- b\n- c\nd:\n  - e\n", "a: &x\n- b\n", "a: !!seq\n- b\n",   # a list in its mapping's column, or not
    "- ! \n- ! ''\n- ! 12\n- !!str\n- &y\n",                      # tagged '!', empty or not
    "a: b", "a: b  ", "a: b\n\n  ", "a: |\n  x", "- [a]\n# c", "a: 'x\ny'", "\ufeffa: b", "\ufeff- a\n- b",
    "a: b\r\nc: d\r\n", "a: b\rc: d", "a: b\x85c: d\u2028e: f\u2029", "a: \"x\\\ny\"\n", "a: >-\n  x\n\n  y\n\n",
    "? [a, b]\n: c\n", "? a\n", "- - a\n  - b\n-\n", "", "# only a comment\n", "---\na: b\n...\n",
    "%YAML 1.1\n---\na: b\n", "a: !!int '3'\nb: !!float 1\nc: 0x1F\nd: 2001-01-01\ne: ~\nf: yes\ng: .inf\n",
])
def test_texts_where_the_two_parsers_events_differ(text):
    assert assert_read_alike(text)


@needs_libyaml
@pytest.mark.parametrize("text", [
    "a: {b:, c: d}\n", "a: [b:]\n", "a: [?: c]\n", "a: [b, ? ]\n", "a: [b, ?\n ]\n",   # PyYAML reads them
    "*a\t# c\nb: c\n", "a: [&x 1, &x 2]\t\n", "a:\n [\n\t b: c\n",   # a tab PyYAML's scanner meets, reading ahead
    "a: b\n--- \t\nc: d\n",
])
def test_texts_the_scan_leaves_to_the_composer(text):
    """Texts libyaml refuses and PyYAML reads, or where PyYAML may meet another problem first:
    the scan leaves them to the composer, which reads them as without libyaml."""
    assert not assert_read_alike(text)


# --- random task sets, in random YAML styles --------------------------------------------------------

STYLES = st.fixed_dictionaries({
    "default_flow_style": st.sampled_from([False, True, None]),
    "default_style": st.sampled_from([None, None, None, '"', "'"]),
    "canonical": st.sampled_from([False, False, False, True]),
    "indent": st.sampled_from([2, 4, 7]),
    "width": st.sampled_from([20, 80, 1_000_000]),
    "allow_unicode": st.booleans(),
    "line_break": st.sampled_from(["\n", "\n", "\r\n", "\r"]),
    "explicit_start": st.booleans(),
    "explicit_end": st.booleans(),
    "version": st.sampled_from([None, None, (1, 1)]),
})


def styled(taskset: TaskSet, style: dict, pairs: bool, bom: bool, last_line_end: bool) -> str:
    doc = _document(taskset, False, {})
    if pairs:                                    # facts as a list of [subject, object]
        for entry in doc["tasks"]:
            entry["facts"] = [[s, o] for s, o in entry["facts"].items()]
    text = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, **style)
    if not last_line_end:
        text = text.rstrip("\r\n")
    return ("\ufeff" if bom else "") + text


@needs_libyaml
@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(taskset=st.one_of(task_sets(max_tasks=3, max_facts=5), shared_template_task_sets()), style=STYLES,
       pairs=st.booleans(), bom=st.booleans(), last_line_end=st.booleans())
def test_random_task_sets_in_random_styles_are_read_alike(taskset, style, pairs, bom, last_line_end):
    text = styled(taskset, style, pairs, bom, last_line_end)
    assert assert_read_alike(text), "a text PyYAML writes is read from libyaml's events"


# --- random edits of valid files --------------------------------------------------------------------

SEEDS = [ROOT / "examples" / "capitals.yaml", ROOT / "examples" / "located.yaml",
         DATA / "good" / "tasks.yaml"]
#: Besides the scan's test pieces: tags, empty values, flow pairs, explicit keys, block scalars.
MORE_PIECES = ["!!str ", "! ", "!!int ", "!!map ", "!!seq ", "&b ", "? ", "~", "null", "- - ", "\n- ", "''", '""',
               '"\\\n"', "a\n  b", ": ", "-", " #", "1e3", "0x1F", ".inf", "2001-01-01", "yes", "<<: ", "=",
               "x:\n", "|-\n  q\n", ">+\n\n  q\n\n", "{a: [b, {c: d}]}", "{? a}", "[a: b]", "{a: }", "[a: ]",
               "\ufeff"]
FLOW_SEED = ('tasks:\n  - {name: a, templates: ["x *1 y *2", z *1 w *2], facts: {A: B, "C": D, ? E : F}}\n'
             "  - name: b\n    templates: [p *1 q *2]\n    facts: [[A, B], [C, D], {E: F}, [G: H]]\nepsilon: 0.1\n")


@needs_libyaml
@settings(max_examples=examples(800), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from([*SEEDS, None]), line_end=st.sampled_from(["\n", "\n", "\r\n", "\r", "\x85"]),
       edits=st.lists(st.tuples(st.floats(0, 1), st.sampled_from(PIECES + MORE_PIECES),
                                st.sampled_from(["insert", "insert", "replace", "delete"])), min_size=1, max_size=4))
def test_random_edits_of_valid_files_are_read_alike(seed, line_end, edits):
    """What one side reads, the other reads the same; what one refuses, the other refuses
    (the scan's refusals at the composer's line, for one edit of a file in block style:
    tests/tasks/test_input_limits.py; after several edits, or in flow style, the two parsers may
    meet two problems in another order)."""
    text = (seed.read_text(encoding="utf-8") if seed is not None else FLOW_SEED).replace("\n", line_end)
    for where, piece, how in edits:
        i = int(where * len(text))
        text = {"insert": text[:i] + piece + text[i:], "replace": text[:i] + piece + text[i + len(piece):],
                "delete": text[:i] + text[i + 1 + len(piece) % 3:]}[how]
    assert_read_alike(text, str(seed.parent) if seed is not None else None, lines=False)


# --- inline facts read in bulk ---------------------------------------------------------------------

NAMES = ["A", "B", "C", " A ", "x", "yes", "1", "~", "", "⋆1", "*2", "a\tb", "é", "'q'", '"A"', "[A]",
         "{A: B}", "!!str C"]


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(facts=st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(NAMES)), min_size=0, max_size=6),
       pairs=st.booleans())
def test_inline_facts_read_in_bulk_as_one_by_one(facts, pairs):
    """Inline facts (names that are fine, empty, words of a template, slots, tabs, not
    strings, a subject twice) read in bulk give what reading them one by one gives: the
    same facts or the same refusal."""
    if pairs:
        body = "".join(f"      - [{s}, {o}]\n" if s or o else "      - []\n" for s, o in facts)
    else:
        body = "".join(f"      {s}: {o}\n" for s, o in facts)
    text = "tasks:\n  - name: t\n    templates: [x *1 y *2]\n    facts:\n" + body

    def read(bulk: bool):
        original = _Builder.plain_facts
        if not bulk:
            _Builder.plain_facts = lambda self, head, words: None
        try:
            ts = loads_tasks(text, file="t.yaml")
            return list(ts.tasks[0].facts.items())
        except TaskError as e:
            return str(e)
        finally:
            _Builder.plain_facts = original

    assert read(True) == read(False)


def test_inline_facts_are_read_in_bulk():
    """A task's inline facts, all plain: no line is made for any of them (a mark each)."""
    made = []
    marks = yaml_nodes._Marks.__call__
    yaml_nodes._Marks.__call__ = lambda self, index: made.append(index) or marks(self, index)
    try:
        text = "tasks:\n  - name: t\n    templates: [x *1 y *2]\n    facts:\n" + "".join(
            f"      S{i}: O{i}\n" for i in range(1000))
        ts = loads_tasks(text)
    finally:
        yaml_nodes._Marks.__call__ = marks
    assert len(ts.tasks[0].facts) == 1000
    if yaml_nodes.CParser is not None:
        assert len(made) < 20, len(made)


# --- the collector ---------------------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_while_reading_and_left_as_it_was(enabled):
    seen = []
    build = _Builder.build

    def spy(self, root):
        seen.append(gc.isenabled())
        return build(self, root)

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    _Builder.build = spy
    try:
        loads_tasks("tasks:\n  - name: t\n    templates: [x *1 y *2]\n    facts: {A: B}\n")
        with pytest.raises(TaskError):
            loads_tasks("tasks:\n  - name: t\n    templates: [x *1 y]\n    facts: {A: B}\n")
        assert gc.isenabled() == enabled
    finally:
        _Builder.build = build
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]


# --- what the scan leaves to the composer, in a large file -----------------------------------------


@needs_libyaml
@pytest.mark.parametrize("end, what", [
    ("      Last: !foo x\n", "a tag other than YAML's own ('!foo')"),
    ("      Last: x\ufeffy\n", "a byte-order mark (U+FEFF) inside the text"),
    ("      Last: [a]#c\tz\n", "a tab after a '#' that may not begin a comment"),
])
def test_what_only_the_composer_reads_is_refused_in_a_large_file(monkeypatch, end, what):
    """Where the scan cannot read a text as PyYAML does, PyYAML's composer reads it: in a
    file of at most MAX_COMPOSED_BYTES; a larger one is refused at the line, before the
    composer starts (it would cost some 1.5 s a MB)."""
    counting = Counting(monkeypatch)
    head = 'tasks:\n  - name: big\n    templates: ["x *1 y *2"]\n    facts:\n'
    text = head + "".join(f"      S{i}: O{i}\n" for i in range(200)) + end
    small = loaded(text)
    assert counting.composers == 1 and what not in str(small)                # read by the composer
    size = len(text.encode("utf-8"))
    monkeypatch.setattr(yaml_nodes, "MAX_COMPOSED_BYTES", size - 1)
    with pytest.raises(TaskError) as large:
        loads_tasks(text, file="t.yaml")
    assert str(large.value) == (
        f"t.yaml:205: {what}, which libyaml and PyYAML may read differently: only a tasks file of at most "
        f"{size - 1:,} bytes may hold it (this one has {size:,}); write it otherwise, or make the file smaller: "
        f"put the facts in facts files (facts_file: a TSV or CSV file)")
    assert counting.composers == 1                                           # not started again
    monkeypatch.setattr(yaml_nodes, "CParser", None)
    assert str(loaded(text)) == str(small)                   # without libyaml: the composer, at any size
