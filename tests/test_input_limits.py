"""Refusals that cost less than the work they refuse: every limit of the tasks reader is checked
before any work that grows faster than the input, and no template's text is made per word.

The limits: templates of at most 1,000 words (tasks.model.MAX_TEMPLATE_LENGTH), checked as each
is parsed (before the structure trie, which holds every prefix). No test here times anything:
each asserts *where* the refusal happens (the trie never built, the template's text made a
bounded number of times) and what it says.
"""

from __future__ import annotations

import pytest

from cli.main import main
from tasks.errors import TaskError
from tasks.io import load_tasks
from tasks.model import MAX_TEMPLATE_LENGTH, Task, TaskSet, Template
from tasks.structure import StructureTrie
from tasks.yaml_nodes import _Loader


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
    return f'tasks:\n  - name: long\n    templates: ["{long_template(words)}"]\n    facts:\n      S0: O0\n      S1: O1\n'


@pytest.fixture
def counted(monkeypatch):
    """Counts of the costly steps: a template's text made, a structure trie built, a YAML
    composer started. Each still runs (a count, not a block)."""
    calls = {"text": 0, "trie": 0, "compose": 0}
    text, trie, loader = Template.text, StructureTrie.__init__, _Loader.__init__

    def count(name, original):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(Template, "text", count("text", text))
    monkeypatch.setattr(StructureTrie, "__init__", count("trie", trie))
    monkeypatch.setattr(_Loader, "__init__", count("compose", loader))
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
