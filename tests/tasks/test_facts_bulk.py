"""The bulk facts-file reader (tasks.facts_files.read_plain with tasks.model.plain_names)
must give exactly the facts the line-by-line reader gives, or decline: random files built
from the characters every rule of the format is about (line ends, BOMs, tabs, commas,
quotes, comments, Unicode line breaks and spaces, slot spellings, invalid UTF-8, NUL)."""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

from tasks.errors import TaskError
from tasks.io import loads_tasks
from tasks.reading import _Builder

PIECES = ["a", "b", "Paris", "é", "\t", ",", '"', " ", "  ", "#", "\r", "\n", "\r\n", "\x85", "\u2028", "\u00a0",
          "\v", "\x1c", "⋆1", "*2", "subject", "object", "subject\tobject", "\ufeff", "capital"]
RAW = [b"\xef\xbb\xbf", b"\xff\xfe", b"\xff", b"\x00", b"\xed\xa0\x80"]

TEMPLATE = "tasks:\n  - name: t\n    templates: ['the capital of \u22c61 is \u22c62']\n    facts_file: {name}\n"


NAME = st.lists(st.sampled_from(["a", "b", "Paris", "é", " ", "\u00a0", "x1"] * 3 + PIECES), min_size=1,
                max_size=3).map("".join)


@st.composite
def files(draw):
    name = draw(st.sampled_from(["f.tsv", "f.csv", "f.txt"]))
    sep = "," if name.endswith(".csv") else "\t"
    fact = st.tuples(NAME, st.sampled_from([sep] * 6 + ["\t", ","]), NAME).map("".join)
    noise = st.lists(st.sampled_from(PIECES), min_size=0, max_size=6).map("".join)
    other = st.sampled_from(["", "# c", "subject\tobject", "subject,object", " a\tb ", "a\tb\r"])
    lines = draw(st.lists(st.one_of(fact, fact, fact, fact, noise, other), min_size=1, max_size=8))
    data = "\n".join(lines).encode("utf-8")
    if draw(st.booleans()):
        data += b"\n"
    if draw(st.integers(0, 5)) == 0:
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from(RAW)) + data[at:]
    return data, name


def _read(directory: str, name: str, bulk: bool):
    """The task set's facts (or the error line), read with or without the bulk path."""
    text = TEMPLATE.format(name=name)
    original = _Builder.plain_facts
    if not bulk:
        _Builder.plain_facts = lambda self, head, words: None
    try:
        ts = loads_tasks(text, file=os.path.join(directory, "tasks.yaml"), base_dir=directory)
        return "ok", list(ts.tasks[0].facts.items())
    except TaskError as e:
        return "error", str(e)
    finally:
        _Builder.plain_facts = original


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files())
def test_bulk_reader_agrees_with_the_line_reader(case):
    data, name = case
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
        assert _read(d, name, bulk=True) == _read(d, name, bulk=False)


def test_bulk_reader_is_used_for_plain_files(tmp_path):
    (tmp_path / "f.tsv").write_text("subject\tobject\nFrance\tParis\n# note\n\nItaly \t Rome\r\n", encoding="utf-8")
    head_calls = []
    original = _Builder.plain_facts

    def spy(self, head, words):
        out = original(self, head, words)
        head_calls.append(out is not None)
        return out

    _Builder.plain_facts = spy
    try:
        ts = loads_tasks(TEMPLATE.format(name="f.tsv"), file=str(tmp_path / "tasks.yaml"), base_dir=str(tmp_path))
    finally:
        _Builder.plain_facts = original
    assert head_calls == [True]
    assert list(ts.tasks[0].facts.items()) == [("France", "Paris"), ("Italy", "Rome")]


def test_bulk_reader_declines_what_must_be_reported(tmp_path):
    from tasks.facts_files import read_plain

    for body in [b"a\tb\tc\n", b"a\x00\tb\n", b"\xff\xfea\tb\n", b"a\xff\tb\n"]:
        (tmp_path / "f.tsv").write_bytes(body)
        assert read_plain(str(tmp_path / "f.tsv")) is None
    (tmp_path / "g.csv").write_bytes(b'"a,b",c\n')
    assert read_plain(str(tmp_path / "g.csv")) is None
    os.mkfifo(tmp_path / "p.tsv")
    assert read_plain(str(tmp_path / "p.tsv")) is None          # refused, not read (it would block)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(files())
def test_bulk_reader_agrees_on_the_line_length_limit(monkeypatch, case):
    import tasks.facts_files as ff

    monkeypatch.setattr(ff, "MAX_LINE_BYTES", 12)
    test_bulk_reader_agrees_with_the_line_reader.hypothesis.inner_test(case)
