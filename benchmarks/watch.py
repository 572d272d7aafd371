"""Watching: edit-to-verdict time of ``watch``, the certificate held in memory.

Builds the set of ``benchmarks/editing.py`` (``tasks.synthetic.wikidata_like``, seed 0,
facts in TSV files) and certifies it with ``check --certificate`` (or, with ``--reuse DIR``,
starts from a directory that ``benchmarks/editing.py`` left: its ``tasks.yaml`` and
``cert``), starts ``python -m verifier watch tasks.yaml --certificate cert --jobs 2
--json -`` and makes the edits of ``benchmarks/editing.py`` with the ``edit`` command, one
at a time. For each it measures the wall time from the moment the edited file took its place
(its change time: ``edit`` renames it into place) to the watcher's JSON line (the verdict), which includes the poll
interval, reading the edited files and hashing the others; the watcher saves the certificate after the line.
After each edit a full ``check`` of the same model (the certificate's β and γ) runs, and
the verdicts and per-task counts must agree. Writes the block "watch" of
``benchmarks/RESULTS.md``::

    python benchmarks/watch.py                           # 1M facts: about 10 minutes on 2 cores
    python benchmarks/watch.py --reuse /tmp/editing-bench-XXXX
    python benchmarks/watch.py --facts 100000            # about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.editing import counts, run  # noqa: E402
from benchmarks.results import machine, phase_lines, publish  # noqa: E402


def edits_for(ts, batch: int, rng: random.Random) -> list[tuple[str, str, list[str], int]]:
    """(label, task, edit flags, facts changed): the edits of benchmarks/editing.py, and each
    object change made twice (to show the spread)."""
    sizes = sorted(range(len(ts.tasks)), key=lambda k: ts.tasks[k].n_facts)
    median, largest = ts.tasks[sizes[len(sizes) // 2]], ts.tasks[sizes[-1]]
    entities = list(ts.vocabulary.entities)

    def other(o: str) -> str:                    # an object that changes the fact
        while True:
            new = rng.choice(entities)
            if new != o:
                return new

    out = []
    for _ in range(3):
        s, o = rng.choice(list(median.facts.items()))
        out.append(("change one object (median task)", median.name, ["--set", f"{s}={other(o)}"], 1))
    out.append(("add a fact with two new entities (median task)", median.name, ["--set", "Qwatch1=Qwatch2"], 1))
    s, _o = rng.choice(list(median.facts.items()))
    out.append(("remove a fact (median task)", median.name, ["--remove", s], 1))
    for _ in range(3):
        s, o = rng.choice(list(largest.facts.items()))
        out.append((f"change one object (largest task, {largest.n_facts:,} facts)", largest.name,
                    ["--set", f"{s}={other(o)}"], 1))
    flags = []
    for s, o in rng.sample(list(largest.facts.items()), batch):
        flags += ["--set", f"{s}={other(o)}"]
    out.append((f"change {batch:,} objects (largest task)", largest.name, flags, batch))
    return out


def newest_input(work: str) -> float:
    """When the last of the tasks file and its facts files took its place (s since the epoch):
    their latest change time. ``edit`` writes a new file beside the old one, reads it back,
    and renames it into place; the rename sets the change time, not the modification time,
    and the watcher can see the edit only from then on."""
    from tasks.io import input_files

    return max(os.stat(p).st_ctime_ns for p in input_files(os.path.join(work, "tasks.yaml"))) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--facts", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--reuse", metavar="DIR", help="start from a directory benchmarks/editing.py left (copied)")
    p.add_argument("--no-reference", action="store_true", help="skip the full check after each edit")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    from tasks.io import dump_tasks, load_tasks
    from tasks.synthetic import wikidata_like

    work = tempfile.mkdtemp(prefix="watch-bench-")
    if args.reuse:
        shutil.rmtree(work)
        shutil.copytree(args.reuse, work)
        ts = load_tasks(os.path.join(work, "tasks.yaml"))
        full_s = None
    else:
        ts = wikidata_like(args.facts, seed=0)
        dump_tasks(ts, os.path.join(work, "tasks.yaml"), facts_dir=work)
        full_s, _, _ = run(["check", "tasks.yaml", "--certificate", "cert", "--jobs", "2", "--quiet"], work)
    params = json.load(open(os.path.join(work, "cert", "certificate.json")))["summary"]["parameters"]
    beta, gamma = params["beta"], params["gamma"]
    watcher = subprocess.Popen([sys.executable, "-m", "verifier", "watch", "tasks.yaml", "--certificate", "cert",
                                "--jobs", "2", "--json", "-"], cwd=work, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put((time.time(), line)) for line in watcher.stdout], daemon=True).start()
    try:
        start = time.time()
        _, first = lines.get(timeout=900)
        startup = time.time() - start
        print(f"watcher up, first check done in {startup:.1f} s", file=sys.stderr)
        rows = []
        for label, task, flags, n in edits_for(ts, args.batch, random.Random(1)):
            run(["edit", "tasks.yaml", task, *flags, "--quiet"], work)
            exited = time.time()
            written = newest_input(work)
            arrived, line = lines.get(timeout=900)
            report = json.loads(line)
            if "error" in report:
                raise SystemExit(f"{label}: the watcher reported {report['error']}")
            inc = report["incremental"]
            same = None
            if not args.no_reference:
                _, _, _ = run(["check", "tasks.yaml", "--beta", beta, "--gamma", gamma, "--no-isolation", "--jobs",
                               "2", "--quiet", "--json", "ref.json"], work)
                ref = json.load(open(os.path.join(work, "ref.json")))
                same = ref["verdict"] == report["verdict"] and counts(ref) == counts(report)
            rows.append((label, n, inc["mode"], inc["queries_rerun"], arrived - written, inc["seconds"],
                         report["verdict"], same, inc["phases"], exited - written))
            print(f"{label}: verdict {arrived - written:.2f} s after the write (re-certification "
                  f"{inc['seconds']:.2f} s, {inc['queries_rerun']:,} rerun), same as full: {same}; {inc['phases']}",
                  file=sys.stderr)
            time.sleep(1.5)                 # the watcher saves the certificate after the line
    finally:
        watcher.terminate()
        watcher.wait(timeout=60)
    one = [r[4] for r in rows if r[1] == 1]
    lines_md = ["## Watch", "",
                f"`python benchmarks/watch.py{' --reuse DIR' if args.reuse else f' --facts {args.facts}'}` on "
                f"{machine()}: {ts.n_facts:,} facts ({len(ts.tasks)} tasks), `watch tasks.yaml --certificate cert "
                f"--jobs 2` (first check {startup:.1f} s: start-up, reading the certificate"
                + (f"; the full check with --certificate took {full_s:.1f} s" if full_s else "") + "). "
                "Each edit made with the `edit` command; *edit to verdict* is the wall time from the moment the "
                "edited file took its place (its change time: `edit` renames it into place) to the watcher's verdict "
                "line (poll interval 0.1 s, reading the tasks file and its facts files, the re-certification); the "
                "certificate is saved after the line. *Same as full*: the verdict and per-task counts of a full "
                "`check` of the same model.", "",
                "| edit | facts | mode | queries run again | edit to verdict (s) | of which re-certification (s) "
                "| `edit` exits after its rename (s) | verdict | same as full |",
                "|---|---:|---|---:|---:|---:|---:|---|---|"]
    for label, n, mode, rerun, latency, rec, verdict, same, _, tail in rows:
        lines_md.append(f"| {label} | {n:,} | {mode} | {rerun:,} | {latency:.2f} | {rec:.2f} | {tail:.2f} | {verdict} "
                        f"| {'-' if same is None else 'yes' if same else 'NO'} |")
    lines_md += ["", f"One-fact edits: median {statistics.median(one):.2f} s, slowest {max(one):.2f} s "
                 f"({len(one)} edits). Where the seconds go (per phase, first and last edit; the rest of *edit to "
                 f"verdict* is the poll, the status of the input files taken before and after the read, and the "
                 f"`edit` process, which exits on the same two cores after its rename):", ""]
    lines_md += phase_lines([(r[0], r[8]) for r in (rows[0], rows[-1])])
    publish("watch", lines_md, write=not args.no_write)
    return 0 if all(r[7] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
