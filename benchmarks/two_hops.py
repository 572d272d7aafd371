"""Two hops at scale: a composed task set checked on two layers against the one-layer check
of its one-hop tasks.

    python benchmarks/two_hops.py [--people 15000 ...] [--runs 3] [--draws 3] [--no-write]

Writes a synthetic set (seeded) per size: ``born_in`` (``--people`` people → 200 countries),
``capital`` (country → its capital), ``continent`` (country → one of 6 continents) and two
composed tasks, ``born_capital`` = born_in then capital and ``born_continent`` = born_in
then continent (no composition has a fixpoint). Times, in its own process each, the median
of ``--runs``: ``python -m verifier check`` of the one-hop tasks alone (one layer), and of
the whole set (two layers, every composed query included), each from start-up to verdict.
Then the mutation campaign (:func:`audit.layers.campaign`): every one-layer mutation
operator applied ``--draws`` times to each layer of the construction's model of a small
composed set, each mutant judged by the exact oracle and by the verifier. Writes the block
"two-hops" of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import machine, publish  # noqa: E402

COUNTRIES, CONTINENTS = 200, 6


def write_sets(directory: Path, people: int) -> tuple[Path, Path]:
    """(one-hop tasks file, the whole set's file), facts in TSV files beside them."""
    import numpy as np

    rng = np.random.default_rng(0)
    born = {f"person {i}": f"country {int(rng.integers(COUNTRIES))}" for i in range(people)}
    capital = {f"country {c}": f"capital {c}" for c in range(COUNTRIES)}
    continent = {f"country {c}": f"continent {c % CONTINENTS}" for c in range(COUNTRIES)}
    for name, facts in (("born_in", born), ("capital", capital), ("continent", continent)):
        (directory / f"{name}.tsv").write_text("subject\tobject\n" + "".join(f"{s}\t{o}\n" for s, o in facts.items()),
                                               encoding="utf-8")
    one = """epsilon: 0.01
tasks:
- name: born_in
  templates: [⋆1 was born in ⋆2, the birthplace of ⋆1 is ⋆2]
  facts_file: born_in.tsv
- name: capital
  templates: [the capital of ⋆1 is ⋆2]
  facts_file: capital.tsv
- name: continent
  templates: [⋆1 lies on the continent ⋆2]
  facts_file: continent.tsv
"""
    composed = one + """- name: born_capital
  templates: [the capital of the country where ⋆1 was born is ⋆2]
  compose: [born_in, capital]
- name: born_continent
  templates: [⋆1 was born on the continent ⋆2]
  compose: [born_in, continent]
"""
    a, b = directory / "one-hop.yaml", directory / "two-hops.yaml"
    a.write_text(one, encoding="utf-8")
    b.write_text(composed, encoding="utf-8")
    return a, b


def timed(path: Path, runs: int) -> tuple[float, float, str]:
    """(median wall seconds, median CPU seconds, the verdict line) of ``check`` on ``path``."""
    walls, cpus, verdict = [], [], ""
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "verifier", "check", str(path), "--no-isolation"],
                             capture_output=True, text=True, cwd=ROOT)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        verdict = next((x for x in out.stdout.splitlines() if x.startswith("verdict")), out.stderr.strip())
    return statistics.median(walls), statistics.median(cpus), verdict


SMALL = """tasks:
  - name: born_in
    templates: [⋆1 was born in ⋆2]
    facts: {Curie: Poland, Einstein: Germany, Bohr: Denmark}
  - name: capital
    templates: [the capital of ⋆1 is ⋆2, ⋆1 has the capital ⋆2]
    facts: {Poland: Warsaw, Germany: Berlin, Denmark: Copenhagen, France: Paris}
  - name: born_capital
    templates: [the capital of the country where ⋆1 was born is ⋆2]
    compose: [born_in, capital]
"""


def campaign_lines(draws: int) -> list[str]:
    """The mutation campaign's table (the module docstring)."""
    from audit.layers import LayersOracle, campaign
    from construction.layers import build_two_layers
    from tasks import loads_tasks

    ts = loads_tasks(SMALL)
    model = build_two_layers(ts)
    rows = campaign(ts, model.instantiate(), model.epsilon, draws=draws, seed=0, oracle=LayersOracle(40))
    out = [f"Mutation campaign (`--draws {draws}`: every operator of `audit/operators.py` {draws} times per layer, on "
           "the construction's two-layer model of a 3-task set; truth from the exact oracle `audit/layers.py`):", "",
           "| layer | mutants | refused by the layout | truly violating | caught | false passes | harmless "
           "certified | harmless rejected |", "|---|---|---|---|---|---|---|---|"]
    for layer in (1, 2):
        mine = [r for r in rows if r[0] == layer]
        refused = [r for r in mine if r[3] is None]
        bad = [r for r in mine if r[3]]
        good = [r for r in mine if r[3] == []]
        out.append(f"| {layer} | {len(mine)} | {len(refused)} | {len(bad)} | {sum(not r[4] for r in bad)} | "
                   f"{sum(r[4] for r in bad)} | {sum(r[4] for r in good)} | {sum(not r[4] for r in good)} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--people", type=int, nargs="+", default=[15_000], help="one set per size")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--draws", type=int, default=3, help="mutants per operator and layer")
    p.add_argument("--no-write", action="store_true", help="print the block only")
    args = p.parse_args(argv)
    sizes = " ".join(map(str, args.people))
    lines = [f"Machine: {machine()}.",
             f"Command: `python benchmarks/two_hops.py --people {sizes} --runs {args.runs}` (medians of "
             f"{args.runs}, one process each, start-up included, `check --no-isolation`).", "",
             "| people | check | queries | wall s | CPU s | verdict | ratio, wall (CPU) |",
             "|---|---|---|---|---|---|---|"]
    for people in args.people:
        with tempfile.TemporaryDirectory() as tmp:
            one, two = write_sets(Path(tmp), people)
            from tasks import load_tasks
            from tasks.queries import count_queries

            n_all = count_queries(load_tasks(two))
            n_one = count_queries(load_tasks(one))
            w1, c1, v1 = timed(one, args.runs)
            w2, c2, v2 = timed(two, args.runs)
        lines += [f"| {people:,} | one-hop tasks, one layer | {n_one:,} | {w1:.2f} | {c1:.2f} | {v1} | |",
                  f"| {people:,} | with 2 composed tasks, two layers | {n_all:,} ({n_all - n_one:,} composed) | "
                  f"{w2:.2f} | {c2:.2f} | {v2} | {w2 / w1:.2f}x ({c2 / c1:.2f}x) |"]
    lines += ["", "Ratio: the two-layer check of the whole set over the one-layer check of its one-hop tasks "
              "(target: at most 2x at 100,000 composed queries or more).", "", *campaign_lines(args.draws)]
    publish("two-hops", lines, not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
