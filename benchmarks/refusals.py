"""What refusing a malformed tasks file costs, up to the size limit.

    python benchmarks/refusals.py [--facts 128000] [--no-baseline] [--out PATH] [--no-write]

Writes a tasks file of ``--facts`` inline facts (128,000: 4.13 MB, just under the 4 MiB
limit) malformed at its last line in one way each (YAML errors: an unclosed quote, a line
indented wrong, a tab, an alias, nesting too deep, an anchor twice, a second document, a
'?' in a flow list, a block scalar's first line; and a key written twice in a task, an
error of the tasks themselves), runs ``python -m verifier check`` on each in its own
process and records the refusal's line, the process's CPU time (user and system) and its
peak memory (maxrss). A two-line malformed file gives the command's start-up; the valid
file is loaded (``tasks.io.load_tasks``, in its own process) for the cost of composing it.
The baseline (``--no-baseline`` leaves it out) runs each refusal again with the libyaml
scan turned off (tasks.yaml_nodes.CParser = None), as where PyYAML has no libyaml: PyYAML's
pure-Python composer refuses. Writes its block of ``benchmarks/RESULTS.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, write_block  # noqa: E402

HEAD = 'tasks:\n  - name: big\n    templates: ["x *1 y *2"]\n    facts:\n'

#: name -> what ends the file (after its facts)
ENDS = {
    "unclosed quote": '      Last: "never closed\n',
    "line indented wrong": "     Last: X\n",
    "tab indenting a line": "\tLast: X\n",
    "tab after a colon": "      Last:\tX\n",
    "alias": "      Last: *x\n",
    "nesting 40 deep": "      Last: " + "[" * 40 + "]" * 40 + "\n",
    "anchor defined twice": "      A: &a x\n      B: &a y\n",
    "second document": "---\ntasks: []\n",
    "'?' in a flow list": "      Last: [what?, x]\n",
    "block scalar's first line": "      Last: >#c\n        x\n",
    "key twice in a task (not YAML)": "    name: again\n",
}

#: Python run in the child for the baseline: the command with the scan turned off.
WITHOUT_SCAN = ("import sys, tasks.yaml_nodes as y; y.CParser = None; from cli.main import main; "
                "sys.exit(main(sys.argv[1:]))")
LOAD = "import sys; from tasks.io import load_tasks; load_tasks(sys.argv[1])"


def measure(argv: list[str]) -> dict:
    """CPU seconds (user + system), peak memory (MB) and the first line of stderr of a child."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        line = err.read().decode("utf-8", "replace").strip().split("\n")[0]
    return {"cpu": usage.ru_utime + usage.ru_stime, "mb": usage.ru_maxrss / 1024, "status": child.returncode,
            "line": line}


def where(line: str, path: str) -> str:
    """The refusal without its path: 'line N: what is wrong' (shortened)."""
    rest = line.split(path, 1)[-1].lstrip(":")
    number, _, what = rest.partition(": ")
    depth = 0
    for i, c in enumerate(what):                # the fix follows the first '; ' outside parentheses
        depth += (c == "(") - (c == ")")
        if depth == 0 and what.startswith("; ", i):
            what = what[:i]
            break
    return f"{number}: {what[:70]}{'…' if len(what) > 70 else ''}" if number.isdigit() else rest[:80]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--facts", type=int, default=128_000)
    p.add_argument("--no-baseline", action="store_true", help="leave out the runs without the libyaml scan")
    p.add_argument("--out", type=Path, default=None, help="write the block into this file (default RESULTS.md)")
    p.add_argument("--no-write", action="store_true", help="print the block only")
    args = p.parse_args(argv)
    py = sys.executable
    body = "".join(f"      Subject{i}: Object{i}\n" for i in range(args.facts))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        small = os.path.join(tmp, "small.yaml")
        Path(small).write_text("tasks:\n  - [\n", encoding="utf-8")
        start = measure([py, "-m", "verifier", "check", small])
        rows.append(("two lines, malformed (the start-up)", 29, where(start["line"], small), start, None))
        for name, end in ENDS.items():
            path = os.path.join(tmp, "big.yaml")
            Path(path).write_text(HEAD + body + end, encoding="utf-8")
            print(f"[{name}] ...", file=sys.stderr, flush=True)
            got = measure([py, "-m", "verifier", "check", path])
            assert got["status"] == 2, got
            base = None if args.no_baseline else measure([py, "-c", WITHOUT_SCAN, "check", path])
            rows.append((name, os.path.getsize(path), where(got["line"], path), got, base))
        path = os.path.join(tmp, "big.yaml")
        Path(path).write_text(HEAD + body, encoding="utf-8")
        valid = measure([py, "-c", LOAD, path])
        assert valid["status"] == 0, valid
        rows.append(("valid: loaded, not checked", os.path.getsize(path), "-", valid, None))
    command = "python benchmarks/refusals.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = ["## Refusals", "",
           f"Machine: {machine()}. Command: `{command.strip()}`.", "",
           "| tasks file | bytes | refused at | CPU (s) | peak memory (MB) | without the libyaml scan: CPU (s) | "
           "peak memory (MB) |",
           "|---|---|---|---|---|---|---|"]
    for name, size, refusal, got, base in rows:
        without = f"{base['cpu']:.2f} | {base['mb']:,.0f}" if base else "- | -"
        out.append(f"| {name} | {size:,} | {refusal} | {got['cpu']:.2f} | {got['mb']:,.0f} | {without} |")
    out += ["", "CPU = user + system time of the whole command (interpreter start-up and imports included); peak "
                "memory = its largest resident set. Each malformed file is the valid one with the line(s) named "
                "added at its end."]
    text = "\n".join(out)
    print(text)
    if not args.no_write:
        if args.out is not None:
            write_block("refusals", text, args.out)
        else:
            write_block("refusals", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
