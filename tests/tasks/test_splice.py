"""Reading an edited facts file against its previous bytes (tasks.splice, and the facts
cache's use of it) gives the facts a full read gives: random files, random edits of their
lines (good and bad ones), compared with the bulk reader on the new bytes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

from tasks.facts_files import read_plain
from tasks.splice import fact_lines, plain_form, splice

NAMES = st.text(alphabet="abcXYZ é東-_.", min_size=1, max_size=6)
#: lines an edit may write: a fact (maybe padded, maybe with '\r'), or one the reader refuses or skips
BAD = ["# a comment", "", "   ", "a\tb\tc", "onlyone", "x\t", '"q",r', "\x00z\ty", "subject\tobject"]


def _line(s: str, o: str, pad: bool, cr: bool) -> str:
    return (f" {s} \t {o} " if pad else f"{s}\t{o}") + ("\r" if cr else "")


@st.composite
def files(draw):
    """(old bytes, new bytes, the .tsv/.csv path): old a file of distinct subjects, new old
    with some lines replaced, inserted or deleted."""
    csv = draw(st.booleans())
    sep = "," if csv else "\t"
    subjects = draw(st.lists(NAMES, min_size=1, max_size=12, unique=True))
    lines = [_line(s, draw(NAMES), draw(st.booleans()), draw(st.booleans())) for s in subjects]
    if draw(st.booleans()):
        lines.insert(0, "subject\tobject")
    lines = [x.replace("\t", sep) for x in lines]
    end = draw(st.sampled_from(["\n", ""]))
    old = "\n".join(lines) + end
    new_lines = list(lines)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "insert", "delete", "grow", "grow"]))
        at = draw(st.integers(0, len(new_lines)))
        pick = draw(st.sampled_from(subjects + ["fresh", "new one"]))
        text = draw(st.sampled_from(BAD)) if draw(st.integers(0, 4)) == 0 else _line(
            pick, draw(NAMES), draw(st.booleans()), False).replace("\t", sep)
        if op == "insert":
            new_lines.insert(at, text)
        elif op == "grow" and new_lines and at < len(new_lines):     # a line lengthened at one end
            bit = draw(st.sampled_from(["x", sep, "x" + sep, sep + "q", " "]))
            new_lines[at] = bit + new_lines[at] if draw(st.booleans()) else new_lines[at] + bit
        elif new_lines and at < len(new_lines):
            if op == "set":
                new_lines[at] = text
            else:
                del new_lines[at]
    new = "\n".join(new_lines) + draw(st.sampled_from([end, "\n", ""]))
    return old.encode("utf-8"), new.encode("utf-8"), "f.csv" if csv else "f.tsv"


def _full(data: bytes, path: str) -> dict[str, str] | None:
    """The facts the bulk reader and the loader's bulk path take from ``data`` (None: the
    file would be read line by line: a problem to report, or a subject twice)."""
    got = read_plain(path, data)
    if got is None:
        return None
    subjects, objects = [x.strip() for x in got[0]], [x.strip() for x in got[1]]
    pairs = dict(zip(subjects, objects))
    return pairs if len(pairs) == len(subjects) and all(subjects) and all(objects) else None


@settings(max_examples=examples(600), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(files())
def test_a_splice_gives_what_the_full_read_gives(case):
    old, new, path = case
    before = _full(old, path)
    if before is None or not plain_form(old, path):
        assert splice(old, new, path, len(before or {}) + 1) is None or before is None
        return
    assert fact_lines(old, path) == len(before)
    cut = splice(old, new, path, len(before))
    if cut is None:
        return
    removed = set(cut.removed_subjects)
    assert removed <= before.keys() and len(removed) == len(cut.removed_subjects)
    distinct = (len(set(cut.added_subjects)) == len(cut.added_subjects)
                and not (set(cut.added_subjects) & (before.keys() - removed)))
    spliced = {s: o for s, o in before.items() if s not in removed}
    spliced.update(zip(cut.added_subjects, cut.added_objects))
    after = read_plain(path, new)
    assert after is not None                     # the new file is in the bulk reader's form
    subjects = [x.strip() for x in after[0]]
    assert distinct == (len(set(subjects)) == len(subjects))
    if distinct:
        assert dict(zip(subjects, [x.strip() for x in after[1]])) == spliced


def test_an_edit_of_one_line_is_spliced_and_the_first_line_is_not():
    old = b"subject\tobject\nFrance\tParis\nJapan\tTokyo\nChile\tSantiago\n"
    cut = splice(old, old.replace(b"Tokyo", b"Kyoto"), "c.tsv", 3)
    assert (cut.removed_subjects, cut.added_subjects, cut.added_objects) == (["Japan"], ["Japan"], ["Kyoto"])
    cut = splice(old, old + b"Peru\tLima\n", "c.tsv", 3)
    assert (cut.removed_subjects, cut.added_subjects) == ([], ["Peru"])
    cut = splice(old, old.replace(b"Japan\tTokyo\n", b""), "c.tsv", 3)
    assert (cut.removed_subjects, cut.added_subjects) == (["Japan"], [])
    assert splice(old, old.replace(b"subject", b"country"), "c.tsv", 3) is None      # the header line
    assert splice(old, old.replace(b"Tokyo", b"Tokyo\tx"), "c.tsv", 3) is None      # three fields
    assert splice(old, old.replace(b"Tokyo\n", b"Tokyo\n# note\n"), "c.tsv", 3) is None
    assert splice(old, old.replace(b"Tokyo", b"Kyoto"), "c.tsv", 2) is None       # not the facts counted


def test_a_first_line_of_lower_case_names_is_read_in_full():
    """Whether it is a likely header (refused) depends on the line after it: an edit there
    (a capital written) is read in full, which refuses it, not spliced onto the old facts."""
    old = b"language\tcreator\npython\tguido\n"
    assert read_plain("c.tsv", old) is not None
    new = old.replace(b"python", b"Python")
    assert read_plain("c.tsv", new) is None
    assert splice(old, new, "c.tsv", 2) is None
    assert splice(old, old + b"c\tritchie\n", "c.tsv", 2) is None


@pytest.fixture
def watched(tmp_path):
    from workflow.certificates import check_and_save
    from construction.model import build
    from tasks.io import load_tasks

    facts = tmp_path / "capital.tsv"
    facts.write_text("subject\tobject\n" + "".join(f"C{i}\tK{i}\n" for i in range(40)), encoding="utf-8")
    path = tmp_path / "tasks.yaml"
    path.write_text("tasks:\n  - name: capital\n    templates: [the capital of *1 is *2]\n    facts_file: capital.tsv\n"
                    "  - name: continent\n    templates: [the continent of *1 is *2]\n    facts: {C1: Europe}\n",
                    encoding="utf-8")
    ts = load_tasks(path)
    check_and_save(ts, build(ts), str(tmp_path / "cert"), isolation=False, tasks_path=str(path))
    return path, facts


@pytest.mark.parametrize("edit", [("C5\tK5\n", "C5\tK7\n"), ("C5\tK5\n", "C5\tK5\nNew\tK0\n"), ("C5\tK5\n", ""),
                                  ("C5\tK5\n", "C5\tK5\nC6\tK9\n"), ("C5\tK5\n", "C5\tcontinent\n"),
                                  ("C5\tK5\n", "C5\tK5\n# note\n")])
def test_the_watcher_reads_an_edited_file_against_its_bytes_before(watched, monkeypatch, edit):
    """Through the watcher: the spliced read is taken when it applies, and its task set (and
    the verdict and saved certificate) is what a fresh read gives, a subject twice and a
    word as an entity (refused) included."""
    import tasks.compiled as compiled
    from workflow.watching import Watcher
    from tasks.errors import TaskError
    from tasks.io import load_tasks

    path, facts = watched
    calls = []
    real = compiled.FactsCache._spliced
    monkeypatch.setattr(compiled.FactsCache, "_spliced",
                        lambda self, *a: calls.append(real(self, *a)) or calls[-1])
    watcher = Watcher(str(path), str(path.parent / "cert"), isolation=False)
    assert watcher.check().report.certified
    facts.write_text(facts.read_text(encoding="utf-8").replace(*edit), encoding="utf-8")
    outcome = watcher.check()
    try:
        fresh = load_tasks(path)
    except TaskError:                 # refused input (a subject twice, a word as an entity): refused too
        assert outcome.report is None and outcome.error
        return
    assert outcome.report is not None and outcome.report.certified
    held = watcher.cert.taskset
    assert held.vocabulary == fresh.vocabulary
    for a, b in zip(held.tasks, fresh.tasks):
        assert dict(a.facts.items()) == dict(b.facts.items())
    for (s1, o1), (s2, o2) in zip(held.fact_ids, fresh.fact_ids):
        assert s1.tolist() == s2.tolist() and o1.tolist() == o2.tolist()
    simple = edit[1].count("\n") >= 1 and "#" not in edit[1] and "C6" not in edit[1] and "continent" not in edit[1]
    assert (calls and calls[-1] is not None) == (simple or edit[1] == "")


@pytest.mark.parametrize("before", ["    facts_file: [a.tsv, b.tsv]\n", "    facts: {a: b, c: d}\n"])
def test_a_task_that_had_other_sources_is_read_in_full(tmp_path, before):
    """A task of two facts files, or of inline facts, that now has one facts file is read in
    full: its old facts are not one file's (a review found the first file's bytes taken for
    both files' facts, and an inline task's empty key list crashing the watcher)."""
    from workflow.certificates import check_and_save
    from workflow.since import read_since
    from construction.model import build
    from tasks.facts_files import facts_key
    from tasks.io import load_tasks
    from verifier.certificates.certificate import load_certificate

    (tmp_path / "a.tsv").write_text("a\tb\na\tb\n", encoding="utf-8")      # the same fact twice: one fact
    (tmp_path / "b.tsv").write_text("c\td\n", encoding="utf-8")
    head = "tasks:\n  - name: t\n    templates: [the t of *1 is *2]\n"
    path = tmp_path / "tasks.yaml"
    path.write_text(head + before, encoding="utf-8")
    ts = load_tasks(path)
    check_and_save(ts, build(ts), str(tmp_path / "cert"), isolation=False, tasks_path=str(path))
    path.write_text(head + "    facts_file: a.tsv\n", encoding="utf-8")
    old = load_certificate(tmp_path / "cert")
    a = str(tmp_path / "a.tsv")
    data = (tmp_path / "a.tsv").read_bytes()
    previous = {a: (facts_key(a, data), data), str(tmp_path / "b.tsv"): (facts_key(a, b"c\td\n"), b"c\td\n")}
    got, _ = read_since(str(path), old, None, previous)
    assert dict(got.tasks[0].facts.items()) == {"a": "b"} == dict(load_tasks(path).tasks[0].facts.items())
