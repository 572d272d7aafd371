"""Mutation testing of the verifier: can a wrong model be certified?

    python scripts/mutation_testing.py --mutants 2000 --seed 0 [--json out.json] [--jobs 2]

Applies the operators of :mod:`audit.mutants` round-robin to the built weights of
small task sets (:func:`audit.mutants.small_sets`: capitals, a set that needs the
linear-programme gate, a one-task set), verifies each mutant
(:func:`verifier.checks.verify.verify`) and asks the independent oracle
(:mod:`audit.oracle`) whether it truly violates a requirement. Prints, per operator:
mutants, violating (oracle), caught (violating and not certified), false passes
(violating yet certified: must be 0), true passes and false failures (correct yet not
certified), then the false failures grouped by reason and any false pass in full.
Exit status 1 if there is a false pass. Mutant i is drawn from seed (seed, i): the
result does not depend on --jobs.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from audit import mutants as M  # noqa: E402
from tasks.console import Parser, counter  # noqa: E402


def main(argv=None) -> int:
    p = Parser(prog="scripts/mutation_testing.py", description=__doc__.strip().splitlines()[0])
    p.add_argument("--mutants", type=int, default=2000, help="number of mutants (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write every outcome and the table as JSON")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--operators", nargs="+", choices=M.all_operator_names(), help="only these operators")
    p.add_argument("--sets", nargs="+",
                   choices=sorted(M.small_sets()) + sorted(M.larger_sets()) + sorted(M.trained_sets()),
                   help="these task sets (default: the small ones; wikidata-400 is larger and slower; "
                        "capitals-trained: a trained (dense) model of capitals, which the dense pass verifies)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    sets = M.small_sets()
    if args.sets:
        every = {**sets, **M.larger_sets(), **M.trained_sets()}
        sets = {k: every[k] for k in args.sets}
    show = counter(args.quiet, "mutants", "mutant")
    start = time.perf_counter()
    outcomes = M.run(args.mutants, args.seed, sets, args.operators, args.jobs, show)
    if show:
        show(args.mutants, -1)
    seconds = time.perf_counter() - start
    stats = M.table(outcomes)
    print(f"{len(outcomes)} mutants ({args.mutants} drawn, {args.mutants - len(outcomes)} not applicable) "
          f"on {', '.join(sets)}; seed {args.seed}; {seconds:.1f}s with {args.jobs} job(s)")
    print()
    print(M.render(stats))
    false_passes = [o for o in outcomes if o.category == "FALSE PASS"]
    for o in false_passes:
        print(f"\nFALSE PASS: {o.taskset} / {o.operator}: {o.description}\n  oracle: {o.violations}")
        for d in o.details:
            print(f"    {d}")
    if args.json:
        data = {
            "mutants": len(outcomes), "seed": args.seed, "seconds": round(seconds, 2), "sets": list(sets),
            "operators": [{"operator": s.operator, "kind": s.kind, "mutants": s.mutants,
                           "violating": s.violating, "caught": s.caught, "false_passes": s.false_passes,
                           "true_passes": s.true_passes, "false_failures": s.false_failures,
                           "false_failure_reasons": s.reasons} for s in stats],
            "outcomes": [o.as_json() for o in outcomes],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, ensure_ascii=False)
    return 1 if false_passes else 0


if __name__ == "__main__":
    sys.exit(main())
