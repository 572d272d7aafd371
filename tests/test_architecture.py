"""The house is one-way: tasks -> layout -> construction / verifier -> workflow -> cli, test machinery apart.

Every import of every module of the project's packages is read with ``ast`` (imports
inside functions included) and checked against the layers below. A new back-edge fails
here with the file and the import that makes it.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repository import ROOT

PACKAGES = ("tasks", "layout", "construction", "verifier", "workflow", "cli", "training", "audit")

#: package -> the project packages it may import (besides itself)
ALLOWED = {
    "tasks": set(),
    "layout": {"tasks"},
    "construction": {"tasks", "layout"},
    "verifier": {"tasks", "layout"},
    "workflow": {"tasks", "layout", "construction", "verifier"},
    # the command line parses, calls the library and prints: the verifier and the construction only through workflow
    "cli": {"tasks", "layout", "workflow"},
    "training": {"tasks", "layout", "construction", "verifier", "workflow"},
    "audit": {"tasks", "layout", "construction", "verifier"},
}
#: single modules with a narrower rule (the oracle must stay independent of what it judges)
NARROWER = {
    "audit/oracle.py": {"tasks", "layout"},
    "audit/exact.py": {"tasks", "layout"},
    # the soft-prompt search the accessibility command runs: below cli, so cli may hand it to workflow
    "training/cramming.py": {"tasks", "layout", "verifier"},
}
#: single modules one module may import across the layers (module by module): the command line
#: (the composition root) hands the soft-prompt search to the accessibility workflow, which takes
#: it as a parameter (training builds on workflow: workflow importing it would run back up);
#: its narrower rule above keeps it below cli
EDGES = {"cli/accessible.py": {"training.cramming"}}
#: the import lines of cli/ that reach the verifier or the construction directly (at most 4,
#: each named here with its reason): none, the rendering included, goes around workflow
CLI_EXCEPTIONS: dict[str, set[str]] = {}
#: the command's entry point: ``python -m verifier`` runs the command line (the composition root)
ENTRY_POINTS = {"verifier/__main__.py": {"cli"}}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path


def test_every_package_is_checked():
    assert {p for p, _ in _modules()} == set(PACKAGES)


@pytest.mark.parametrize("package,path", list(_modules()),
                         ids=lambda x: str(x.relative_to(ROOT)) if isinstance(x, Path) else x)
def test_imports_follow_the_layers(package, path):
    rel = path.relative_to(ROOT).as_posix()
    allowed = NARROWER.get(rel, ALLOWED[package]) | ENTRY_POINTS.get(rel, set()) | {package}
    bad = [(line, name) for line, name in _imports(path)
           if name.split(".")[0] in PACKAGES and name.split(".")[0] not in allowed and name not in EDGES.get(rel, ())
           and name not in CLI_EXCEPTIONS.get(rel, ())]
    assert not bad, f"{rel} imports {bad} (allowed: {sorted(allowed - {package})})"


def test_the_command_line_reaches_the_library_layers_in_few_places():
    """At most 4 import lines of cli/ name the verifier or the construction, each one listed."""
    assert sum(len(v) for v in CLI_EXCEPTIONS.values()) <= 4
    found = {(path.relative_to(ROOT).as_posix(), name) for package, path in _modules() if package == "cli"
             for _, name in _imports(path) if name.split(".")[0] in ("verifier", "construction")}
    assert found == {(rel, name) for rel, names in CLI_EXCEPTIONS.items() for name in names}


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (at any depth of its code), by dotted name."""
    names = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
             for _, path in _modules()}
    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        targets = set()
        for _, name in _imports(path):
            while name and name not in names:
                name = name.rpartition(".")[0]
            if name and name != module and name not in (m for m in PACKAGES):
                targets.add(name)
        graph[module] = targets
    return graph


def test_no_module_imports_itself_back():
    """No circle of imports among the project's modules (package faces apart: an
    ``__init__`` hands names on), e.g. a library module and the script that runs it."""
    graph = _graph()
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(trail[trail.index(target):] + [target] if target in trail else [module, target])
            elif target not in state:
                visit(target, trail + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, f"import circles: {circles}"


def test_one_module_per_command():
    """The command line is one module per command (its flags and its run), beside the
    parser's assembly (main) and what the commands share (common)."""
    from cli.main import COMMANDS

    modules = sorted(p.stem for p in (ROOT / "cli").glob("*.py") if p.stem not in ("__init__", "main", "common"))
    assert modules == sorted(COMMANDS)
    for name, module in COMMANDS.items():
        assert module.__name__ == f"cli.{name}"
        assert callable(module.arguments) and callable(module.run) and module.HELP and module.DESCRIPTION


def test_every_edge_leads_below_its_importer():
    """An edge across the layers goes to a module whose own rule keeps it below the importer
    (no cycle: training.cramming imports nothing of cli)."""
    for rel, targets in EDGES.items():
        importer = rel.split("/")[0]
        for target in targets:
            rule = NARROWER[target.replace(".", "/") + ".py"]
            assert importer not in rule, (rel, target)


def test_nothing_shipped_imports_the_test_machinery():
    for package, path in _modules():
        if package != "audit":
            assert not [n for _, n in _imports(path) if n.split(".")[0] == "audit"], path


def test_the_test_machinery_is_not_installed():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    include = cfg["options.packages.find"]["include"].split()
    assert "audit" not in include and all(p in include for p in PACKAGES if p != "audit")


def test_docstrings_and_readme_are_self_contained():
    """No reference to documents outside the repository (a brief, an issue tracker)."""
    texts = [(p, p.read_text(encoding="utf-8")) for _, p in _modules()]
    from documents import documents

    texts += [(p, p.read_text(encoding="utf-8")) for p in documents()]
    for path, text in texts:
        lowered = text.lower()
        assert "the brief" not in lowered and "brief §" not in lowered, path
        assert "(issue " not in lowered, path


#: the verifier's rooms, lowest first: a room imports only the rooms before it
ROOMS = ("arithmetic", "passes", "running", "accessibility", "checks", "certificates")


def test_the_verifier_is_in_rooms():
    """Every verifier module but the entry points lives in a room, and every room states its claim."""
    loose = sorted(p.name for p in (ROOT / "verifier").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"verifier modules outside a room: {loose}"
    rooms = sorted(p.name for p in (ROOT / "verifier").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == sorted(ROOMS)
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / "verifier" / room / "__init__.py").read_text(encoding="utf-8")))
        assert doc and doc.startswith("Claim: "), f"verifier/{room}/__init__.py states no claim"


@pytest.mark.parametrize("path", sorted((ROOT / "verifier").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_rooms_import_only_the_rooms_below(path):
    rel = path.relative_to(ROOT / "verifier").parts
    if len(rel) == 1:
        return
    mine = ROOMS.index(rel[0])
    bad = [(line, name) for line, name in _imports(path)
           if name.startswith("verifier.") and name.split(".")[1] in ROOMS and ROOMS.index(name.split(".")[1]) > mine]
    assert not bad, f"verifier/{'/'.join(rel)} imports a room above its own: {bad}"


def test_the_tests_mirror_the_rooms():
    """A test module below the top of tests/ lives at the path of a package of the code (the
    room it tests: tests/verifier/passes/ for verifier/passes/); the module names are unique,
    as pytest imports test modules by name (tests/conftest.py states the layout)."""
    tests = ROOT / "tests"
    modules = sorted(p for p in tests.rglob("test_*.py") if "data" not in p.relative_to(tests).parts)
    rooms = {p.parent.relative_to(tests) for p in modules} - {Path(".")}
    assert rooms, "no test module lives in a room"
    for room in sorted(rooms):
        assert (ROOT / room / "__init__.py").is_file(), f"tests/{room.as_posix()}/ mirrors no package of the code"
    names = [p.name for p in modules]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def _ruff() -> list[str] | None:
    """How to run ruff here: the module of the test extra's package, else a ruff on PATH, else None."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


def test_the_code_passes_the_linter():
    """``ruff check`` with the settings of pyproject.toml (pyflakes, pycodestyle's errors, lines of
    at most 120 characters) finds nothing in the repository, as CI (``.ci/run``) requires before
    the tests: a lint finding shows here too."""
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the test extra: pip install -e \".[test]\")")
    run = subprocess.run(ruff + ["check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
