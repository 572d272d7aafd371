"""What a demanding new user hit, each as a regression test (one line, exit 2, file:line; no hang).

Parameters that cannot be used, long templates, explain on entities that contain template
words, construction refusals without a location, flags every command accepts, readable
counterexamples and messages, no wall-clock assertions in the suite, and a test command
that shows its own summary.
"""

from __future__ import annotations

import ast
import configparser
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from construction.model import MAX_TEMPLATE_LENGTH, build
from tasks.errors import TaskError
from tasks.io import loads_tasks
from repository import ROOT

EXAMPLE = ROOT / "examples" / "capitals.yaml"


def one_line_exit_2(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, (code, out.err, out.out)
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    return lines[0]


def write(tmp_path, text: str, name: str = "tasks.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


CAPITAL = ("tasks:\n  - name: capital\n    templates: [the capital of *1 is *2]\n"
           "    facts: {France: Paris, Japan: Tokyo}\n")


# --- 1 and 4: parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["check", "inspect", "build", "explain", "plot"])
def test_beta_without_a_reachable_gamma_is_bad_input_in_every_command(tmp_path, capsys, command):
    extra = {"build": ["-o", tmp_path / "w.npz"], "explain": ["the capital of France is"],
             "plot": ["--out", tmp_path]}[command] if command in ("build", "explain", "plot") else []
    line = one_line_exit_2(capsys, [command, EXAMPLE, "--beta", "3", *extra])
    assert "no gamma" in line and "beta" in line


def test_beta_from_the_file_is_reported_at_its_line(tmp_path, capsys):
    path = write(tmp_path, "parameters:\n  beta: 3\n" + CAPITAL)
    line = one_line_exit_2(capsys, ["check", path])
    assert f"{path}:2:" in line and "no gamma" in line


@pytest.mark.parametrize("value", ["1e-9", "0.000001"])
def test_parameters_that_round_to_zero_are_refused(tmp_path, capsys, value):
    assert "rounds to 0" in one_line_exit_2(capsys, ["check", EXAMPLE, "--beta", value])
    assert "rounds to 0" in one_line_exit_2(capsys, ["check", EXAMPLE, "--gamma", value])
    path = write(tmp_path, f"parameters:\n  gamma: {value}\n" + CAPITAL)
    assert f"{path}:2:" in one_line_exit_2(capsys, ["check", path])


# --- 2: long templates -------------------------------------------------------------------------------


def long_set(words: int, facts: int = 3) -> str:
    body = [f"w{i}" for i in range(words - 2)]
    template = " ".join(body[: len(body) // 2] + ["*1"] + body[len(body) // 2:] + ["*2"])
    return (f'tasks:\n  - name: long\n    templates: ["{template}"]\n    facts:\n'
            + "".join(f"      S{i}: O{i}\n" for i in range(facts)))


def test_a_100_word_template_certifies(tmp_path, capsys):
    path = write(tmp_path, long_set(100))
    assert main(["check", str(path), "--quiet"]) == 0
    assert "CERTIFIED" in capsys.readouterr().out


def test_a_template_beyond_the_limit_is_refused_up_front(tmp_path, capsys):
    path = write(tmp_path, long_set(MAX_TEMPLATE_LENGTH + 1))
    line = one_line_exit_2(capsys, ["check", path])
    assert f"{path}:3:" in line and "longer than" in line


# --- 3: explain and entities that contain template words -----------------------------------------------


AMBIGUOUS = ("tasks:\n  - name: capital\n    templates: [the capital of *1 is *2]\n"
             "    facts: {the capital: Paris, France: Paris}\n")


def test_explain_picks_the_reading_that_is_a_query(tmp_path, capsys):
    path = write(tmp_path, AMBIGUOUS)
    assert main(["explain", str(path), "the capital of the capital is"]) == 0
    out = capsys.readouterr().out
    assert "prefix: the | capital | of | the capital | is" in out and "readings" in out
    assert "valid next: ['Paris']" in out


def test_explain_takes_explicit_tokens(tmp_path, capsys):
    path = write(tmp_path, AMBIGUOUS)
    assert main(["explain", str(path), "--sep", "|", "the|capital|of|the capital|is", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prefix"] == ["the", "capital", "of", "the capital", "is"] and data["note"] is None


def test_explain_says_when_a_text_is_ambiguous_between_queries(tmp_path, capsys):
    # 'x a b' is the query 'x' + entity 'a b' and also 'x' + entity 'a' + word 'b'
    path = write(tmp_path, "tasks:\n  - name: t\n    templates: [x *1 y *2, x *1 b *2]\n    facts: {a b: o1, a: o2}\n")
    line = one_line_exit_2(capsys, ["explain", path, "x a b"])
    assert "ambiguous" in line and "--sep" in line


def test_explain_labels_the_subject_head(capsys):
    assert main(["explain", str(EXAMPLE), "the capital of France is"]) == 0
    out = capsys.readouterr().out
    assert "(subject head, writes subj)" in out and "(structure head, writes slot1)" in out


# --- 5: construction refusals name the file and line ----------------------------------------------------


SHARED_TEMPLATE = ("tasks:\n  - name: a\n    templates: [\"*1 is in *2\"]\n    facts: {P: F}\n"
                   "  - name: b\n    templates: [\"*1 is in *2\"]\n    facts: {F: E}\n")


@pytest.mark.parametrize("text,line", [
    (SHARED_TEMPLATE.replace("{F: E}", "{P: E}"), 3),                 # a shared subject: no model can route it
    ("tasks:\n  - name: same\n    templates: [p p *1 *2, q q *1 *2]\n    facts: {A: B}\n"
     "  - name: diff\n    templates: [p q *1 *2, q p *1 *2]\n    facts: {C: D}\n", 3),   # XOR: proven, no gate
])
def test_construction_refusals_name_the_template_line(tmp_path, capsys, text, line):
    path = write(tmp_path, text)
    message = one_line_exit_2(capsys, ["check", path])
    assert message.startswith(f"error: {path}:{line}:") and "the other template is on line" in message
    assert f"'python -m verifier inspect {path}' lists the smallest changes" in message


def test_a_template_shared_by_two_tasks_with_their_own_subjects_certifies(tmp_path, capsys):
    """Once refused ('the structure gate cannot tell them apart'): the subject tells them apart."""
    assert main(["check", str(write(tmp_path, SHARED_TEMPLATE)), "--quiet"]) == 0


# --- 6: smaller things -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command,extra", [("check", []), ("inspect", []), ("build", ["-o", "{tmp}/w.npz"]),
                                           ("explain", ["the capital of France is"]), ("plot", ["--out", "{tmp}/p"])])
def test_every_command_takes_quiet_and_json(tmp_path, command, extra):
    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    out = subprocess.run([sys.executable, "-m", "verifier", command, str(EXAMPLE), *extra, "--quiet",
                          "--json", str(tmp_path / "out.json")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""           # stderr is not a terminal here: no progress either way
    json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))


def test_plot_prints_no_progress_when_stderr_is_not_a_terminal(tmp_path):
    out = subprocess.run([sys.executable, "-m", "verifier", "plot", str(EXAMPLE), "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stderr == ""


def test_parameters_are_read_as_the_report_prints_them(capsys):
    """The report prints β and γ as fractions (gamma=31/4); --beta and --gamma take them back."""
    assert main(["check", str(EXAMPLE), "--json", "-", "--quiet"]) == 0
    params = json.loads(capsys.readouterr().out)["parameters"]
    assert "/" in params["gamma"]
    assert main(["check", str(EXAMPLE), "--beta", params["beta"], "--gamma", params["gamma"],
                 "--json", "-", "--quiet"]) == 0
    again = json.loads(capsys.readouterr().out)["parameters"]
    assert (again["beta"], again["gamma"]) == (params["beta"], params["gamma"])
    for bad in ("1/0", "-3/4", "x/2"):
        with pytest.raises(SystemExit) as stop:
            main(["check", str(EXAMPLE), "--gamma", bad])
        assert stop.value.code == 2 and "argument --gamma" in capsys.readouterr().err


def test_counterexamples_read_as_text_not_python(capsys):
    assert main(["check", str(EXAMPLE), "--gamma", "3", "--quiet"]) == 1
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "counterexample" in line or line.startswith("  ")]
    assert lines and not any("{'" in line or "None" in line for line in lines)
    assert "error 1 - P(valid) in [" in out and "subject None" not in out


@pytest.mark.parametrize("text,fragment", [
    ('epsilon: "abc"\n' + CAPITAL, "write a number such as 0.01"),
    ('epsilon: "0.05"\n' + CAPITAL, "remove the quotes"),
    ('parameters: {beta: "big"}\n' + CAPITAL, "write a number such as 8"),
    ("tasks:\n  - name: c\n    templates: [\"*1is *2\"]\n    facts: {F: P}\n", "must be a word of its own"),
])
def test_messages_say_what_is_meant(text, fragment):
    with pytest.raises(TaskError, match=fragment.replace("(", r"\(")):
        loads_tasks(text, file="t.yaml")


# --- 7 and 8: the test suite itself ------------------------------------------------------------------------


def test_no_wall_clock_assertions_in_the_tests():
    """Timing belongs in benchmarks: an assertion on elapsed time fails on a busy machine."""
    clocks = {"perf_counter", "monotonic", "time", "process_time"}
    for path in (ROOT / "tests").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                reads_clock = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                                  and c.func.attr in clocks
                                  for c in ast.walk(node))
                asserts = [a for a in ast.walk(node) if isinstance(a, ast.Assert)]
                assert not (reads_clock and asserts), (path, node.name, "reads a clock and asserts")


def test_the_readme_test_command_shows_its_summary():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    addopts = cfg["tool:pytest"].get("addopts", "")
    assert "-q" not in addopts.split()       # -q plus the README's 'python -m pytest' hid the 'N passed' line
    assert "python -m pytest" in (ROOT / "README.md").read_text(encoding="utf-8").split("\n\n")[1]


def test_build_refusals_are_task_errors():
    ts = loads_tasks("parameters: {beta: 3}\n" + CAPITAL, file="t.yaml")
    with pytest.raises(TaskError, match="t.yaml:1"):
        build(ts)


# --- the closed-form bound is called proven only where its side conditions hold ------------------


def test_inspect_calls_the_bound_proven_only_where_its_conditions_hold(capsys):
    assert main(["inspect", str(EXAMPLE), "--beta", "5"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "at these parameters" in x)
    assert "proven upper bound" not in line
    assert "NOT a proven bound: the gate needs leak delta < 0.00298, and delta is up to 0.0326" in line
    assert main(["inspect", str(EXAMPLE), "--beta", "5", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bound_proven"] is False and len(data["unproven_conditions"]) == 1
    assert main(["inspect", str(EXAMPLE), "--json", "-"]) == 0        # the construction's β: proven
    data = json.loads(capsys.readouterr().out)
    assert data["bound_proven"] is True and data["unproven_conditions"] == []


def test_check_says_when_the_bound_is_not_proven(capsys):
    assert main(["check", str(EXAMPLE), "--beta", "5", "--no-isolation", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "(not proven: its side conditions fail, see the note)" in out and "(proven upper bound)" not in out
    assert "note: the closed-form bound is not proven at beta = 5: the gate needs leak delta < 0.00298" in out
    assert main(["check", str(EXAMPLE), "--beta", "5", "--no-isolation", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["closed_form"]["bound_proven"] is False
    assert main(["check", str(EXAMPLE), "--no-isolation", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["closed_form"]["bound_proven"] is True and not any("not proven" in n for n in data["notes"])


def test_a_side_condition_is_proven_only_strictly():
    from fractions import Fraction

    from construction import bound

    d = Fraction(bound.leak_upper(6, Fraction(9)))
    assert bound.unproven_conditions(6, Fraction(9), d + Fraction(1, 10 ** 30)) == []
    assert len(bound.unproven_conditions(6, Fraction(9), d)) == 1         # the leak's upper bound is not below it
    assert bound.unproven_conditions(6, Fraction(9), None) == []
    assert len(bound.unproven_conditions(40, Fraction(1, 2), None)) == 2  # the neurons' and the subject head's


def test_check_since_from_the_certificates_weights_does_not_claim_the_gate_condition(tmp_path, capsys):
    cert = tmp_path / "cert"
    assert main(["check", str(EXAMPLE), "--certificate", str(cert), "--no-isolation", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["check", str(EXAMPLE), "--since", str(cert), "--no-isolation", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["incremental"]["model"] == "patched from the certificate's weights"
    assert data["closed_form"]["bound_proven"] is None          # the gate's condition was not computed again


def test_check_since_no_isolation_says_what_was_carried_over_and_what_was_not_checked(tmp_path, capsys):
    """It said 'isolation: carried over from the certificate for unedited tasks, built alone
    for edited ones' with nothing built alone, and reported no task's isolation."""
    path = tmp_path / "capitals.yaml"
    path.write_text(EXAMPLE.read_text(encoding="utf-8"), encoding="utf-8")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet"]) == 0
    assert main(["edit", str(path), "capital", "--set", "Spain=Madrid", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--since", str(cert), "--no-isolation", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["incremental"]["mode"] == "incremental" and data["incremental"]["edited_tasks"] == ["capital"]
    assert [t["isolated"] for t in data["tasks"]] == [None, True, True]
    assert [n for n in data["notes"] if n.startswith("isolation")] == [
        "isolation: carried over from the certificate for the 2 unedited tasks 'continent', 'located'; "
        "not checked for the edited task 'capital' (--no-isolation)"]
    # the certificate now holds no check of 'capital': the next --since with isolation builds it alone
    assert main(["check", str(path), "--since", str(cert), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [t["isolated"] for t in data["tasks"]] == [True, True, True]
    assert [n for n in data["notes"] if n.startswith("isolation")] == [
        "isolation: carried over from the certificate for the 2 unedited tasks 'continent', 'located'; "
        "built alone and checked for the unedited task 'capital'"]


# --- messages that name the user's path and the real problem ------------------------------------


@pytest.mark.parametrize("command", ["build", "export"])
def test_output_paths_are_refused_by_the_users_path(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "notes.txt").write_text("notes", encoding="utf-8")
    flag = "-o" if command == "build" else "--onnx"
    cases = {"out": "error: out: is a directory; give a file path",
             "": "error: the output path is empty; give a file path",
             "notes.txt/m.bin": "error: notes.txt/m.bin: 'notes.txt' is a file, not a directory",
             "notes.txt/x/m.bin": "error: notes.txt/x/m.bin: 'notes.txt' is a file, not a directory",
             "no/m.bin": "error: no/m.bin: the output directory does not exist; create it first"}
    for path, expected in cases.items():
        line = one_line_exit_2(capsys, [command, EXAMPLE, flag, path])
        assert line.startswith(expected) and ".tmp" not in line, line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["notes.txt", "out"]


def test_atomic_writes_name_the_target_not_a_temporary_file(tmp_path):
    from tasks.files import atomic_file, atomic_files

    (tmp_path / "d").mkdir()
    with pytest.raises(TaskError, match=r"d: is a directory"):
        with atomic_file(tmp_path / "d") as f:
            f.write(b"x")
    with pytest.raises(TaskError, match=r"d: is a directory"):
        atomic_files([(str(tmp_path / "a.txt"), b"a"), (str(tmp_path / "d"), b"d")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_explain_says_the_weights_lack_a_token_of_the_task_set(tmp_path, capsys):
    weights = tmp_path / "m.npz"
    assert main(["build", str(EXAMPLE), "-o", str(weights), "--quiet"]) == 0
    edited = write(tmp_path, EXAMPLE.read_text(encoding="utf-8").replace("Berlin", "Bank"))
    for argv in (["Bank is a city in"], ["Bank|is|a", "--sep", "|"]):
        line = one_line_exit_2(capsys, ["explain", edited, *argv, "--weights", weights])
        assert "the weights' vocabulary lacks 'Bank', a token of the task set" in line
    line = one_line_exit_2(capsys, ["explain", edited, "Bonn is a city in", "--weights", weights])
    assert "the prefix has an unknown token 'Bonn'" in line


# --- accepted silently no more -------------------------------------------------------------------


@pytest.mark.parametrize("value, problem", [("-3", "expected 0 (one per CPU) or more processes, got -3"),
                                            ("1.5", "expected a whole number of processes, got '1.5'")])
def test_jobs_must_be_a_whole_number_not_below_zero(tmp_path, capsys, value, problem):
    for argv in (["check", EXAMPLE], ["watch", EXAMPLE, "--certificate", tmp_path / "cert", "--max-checks", "1"]):
        with pytest.raises(SystemExit) as stop:          # argparse's bad usage: exit 2, one line
            main([str(a) for a in [*argv, "--jobs", value]])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and f"argument --jobs: {problem}" in err
    assert not (tmp_path / "cert").exists()


@pytest.mark.parametrize("command", ["inspect", "plot"])
def test_at_takes_positive_finite_parameters_only(tmp_path, capsys, command):
    extra = ["--out", tmp_path] if command == "plot" else []
    for value, problem in (("-1", "is not positive"), ("0", "is not positive"), ("nan", "is not a (finite) number"),
                           ("inf", "is not a (finite) number")):
        line = one_line_exit_2(capsys, [command, EXAMPLE, *extra, "--block", "gate", "--at", f"beta={value}"])
        assert f"--at beta={value} {problem}" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("where", ["inline", "facts file"])
def test_an_edit_that_changes_nothing_writes_nothing(tmp_path, capsys, where):
    # inline facts with a comment (a rewrite would drop it), or a facts file
    facts = "    facts:\n      France: Paris\n      Japan: Tokyo   # a comment\n"
    if where == "facts file":
        (tmp_path / "capital.tsv").write_text("France\tParis\nJapan\tTokyo\n", encoding="utf-8")
        facts = "    facts_file: capital.tsv\n"
    path = write(tmp_path, "tasks:\n  - name: capital\n    templates: [the capital of *1 is *2]\n" + facts)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    assert main(["edit", str(path), "capital", "--set", "Japan=Tokyo"]) == 0
    out = capsys.readouterr().out
    assert "kept 'Japan' -> 'Tokyo' (unchanged)" in out and "nothing changed; no file written" in out
    assert "wrote" not in out
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()} == before
    assert main(["edit", str(path), "capital", "--set", "Japan=Kyoto", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["written"] == [str(tmp_path / ("tasks.yaml" if where == "inline"
                                                                              else "capital.tsv"))]


def test_the_readme_gate_example_is_what_the_tool_prints(capsys):
    """The README's listings are the tool's output, and the templates its gate paragraph
    names are the capital task's, up to ⋆2 (the symbols the gate reads)."""
    import re

    from tasks.io import load_tasks

    from documents import text

    readme = text("docs/construction.md")
    for argv in (["--block", "structure2"], ["--block", "gate", "--task", "capital"]):
        assert main(["inspect", str(EXAMPLE), *argv]) == 0
        assert capsys.readouterr().out.rstrip("\n") in readme, argv
    paragraph = readme[readme.index("These are the three terms of g_k"):].split("\n\n")[0]
    named = re.findall(r"`([^`]*⋆1[^`]*)`", paragraph)
    ts = load_tasks(EXAMPLE)
    capital = ts.tasks[ts.index("capital")]
    assert sorted(named) == sorted(" ".join(map(str, t.parts[:t.object_index])) for t in capital.templates)


def test_every_command_settles_the_heap_its_loading_made():
    """``python -m verifier`` loads a command's modules with the cyclic collector off; each
    command turns it on again (freezing what the loading made) before its work, so no
    command runs with the collector off; called with it on, ``settle`` changes nothing."""
    import gc

    from cli.common import settle
    from cli.main import COMMANDS

    for name, module in COMMANDS.items():
        assert "settle" in module.run.__code__.co_names, name
    assert gc.isenabled()
    before = gc.get_freeze_count()
    settle()
    assert gc.isenabled() and gc.get_freeze_count() == before


def test_the_command_line_turns_the_collector_on_again(tmp_path):
    """Run as ``python -m verifier``, the collector is off while modules load and on, with
    the loaded objects frozen, once the command runs: the check's work sees it on."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import gc, runpy, sys\n"
        "import workflow.check as W\n"
        "real = W.check_built\n"
        "def probe(*a, **k):\n"
        "    print('collector', gc.isenabled(), gc.get_freeze_count() > 0, file=sys.stderr)\n"
        "    return real(*a, **k)\n"
        "W.check_built = probe\n"
        "sys.argv = ['verifier', 'check', sys.argv[1], '--quiet', '--json', '-']\n"
        "runpy.run_module('verifier', run_name='__main__')\n")
    out = subprocess.run([sys.executable, str(script), str(ROOT / "examples" / "capitals.yaml")], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "collector True True" in out.stderr


def test_checking_given_weights_does_not_load_the_construction(tmp_path):
    """``check --weights`` verifies weights however they were made: it loads neither the
    construction nor sympy (its start-up is the verifier's alone); a whole check does."""
    weights = tmp_path / "w.npz"
    assert main(["build", str(EXAMPLE), "-o", str(weights), "--quiet"]) == 0
    probe = ("import runpy, sys\n"
             "sys.argv = ['verifier', 'check', sys.argv[1], *sys.argv[2:], '--quiet']\n"
             "try:\n"
             "    runpy.run_module('verifier', run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    print('status', e.code, 'sympy' in sys.modules, 'construction.model' in "
             "sys.modules, file=sys.stderr)\n")
    for extra, loaded in ((["--weights", str(weights)], False), ([], True)):
        out = subprocess.run([sys.executable, "-c", probe, str(EXAMPLE), *extra], capture_output=True, text=True,
                             cwd=ROOT)
        assert f"status 0 {loaded} {loaded}" in out.stderr, (extra, out.stderr)
