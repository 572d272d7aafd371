"""``python -m verifier``: check, inspect, build, export, edit, watch, explain, plot and
accessible (each with ``--help``; the README's table says what each does).

Exit status: 0 certified (or the command succeeded), 1 not certified, 2 bad input
(one line on stderr, no traceback), 3 internal error; see :mod:`tasks.console`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import sys
from typing import Sequence

from layout.formats import FORMATS
from tasks.console import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_NOT_CERTIFIED, EXIT_OK, Parser, add_json, add_quiet, counter
from tasks.console import epsilon as _epsilon
from tasks.console import jobs as _jobs
from tasks.console import positive as _positive
from tasks.errors import TaskError
from tasks.files import write_text_atomic


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m verifier", description=(
        "Construct a single-layer mixture-of-experts transformer for a set of knowledge tasks "
        "(Theorem 4.2) and verify it soundly: error below epsilon on every query, routing to each "
        "task's own expert, expert sizes within L|T(k)| + N_k, no cross-task entanglement."))
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("tasks", help="the tasks.yaml file")
        sp.add_argument("--epsilon", type=_epsilon, help="target error (default: the file's, else 0.01)")
        sp.add_argument("--beta", type=_positive, help="attention inverse temperature (default: computed)")
        sp.add_argument("--gamma", type=_positive, help="logit scale (default: computed)")

    c = sub.add_parser("check", help="build (or load) the model and verify it", description="Build the model (or load --weights) and verify every query.")
    common(c)
    c.add_argument("--weights", help="verify these weights (an .npz in the documented layout) instead of building")
    add_json(c, "the JSON report")
    add_quiet(c)
    c.add_argument("--no-isolation", action="store_true", help="skip the rebuild-without-each-task modularity check")
    c.add_argument("--jobs", type=_jobs, default=1, metavar="N", help="worker processes (0: one per CPU); the result does not depend on it")
    c.add_argument("--scheduler", metavar="ADDRESS", help="run the work on a Dask cluster instead: a scheduler address "
                   "(tcp://HOST:8786) or local:N for N local workers (needs the dask extra); the report is the same")
    c.add_argument("--cluster-timeout", type=_positive, default=None, metavar="SECONDS",
                   help="with --scheduler: stop (exit status 2, no report) after this long with no work unit "
                        "completed while the scheduler has no running worker or does not answer (default 60)")
    c.add_argument("--precision", choices=PRECISIONS, default="exact",
                   help="what is certified: the exact forward pass (default), or every execution of the model "
                        "deployed in this floating-point format (weights rounded to it, any summation order, "
                        "with or without FMA; docs/precision.md)")
    c.add_argument("--ulps", type=_positive, default=None, metavar="K",
                   help="with --precision: assume exp and division accurate to K units in the last place (default 4)")
    c.add_argument("--accumulate", choices=("float32", "float64"), default=None,
                   help="with --precision: sums, exp and division computed in this wider format, each result "
                        "rounded to the precision (mixed-precision bfloat16)")
    c.add_argument("--certificate", metavar="DIR",
                   help="also save the certificate (weights, task set, query classes) to DIR, so that an edit "
                        "can be re-certified with --since DIR (docs/editing.md); DIR is replaced, so it "
                        "must be new, empty, or an earlier certificate")
    c.add_argument("--since", metavar="DIR",
                   help="re-certify from the certificate in DIR: rebuild with its beta and gamma, run again only "
                        "the queries the edit can reach, reuse the rest (parameters the construction chose are "
                        "chosen anew, with a full check, when the edit goes beyond them); writes the updated "
                        "certificate back to DIR (or to --certificate)")

    i = sub.add_parser("inspect", help="expert sizes against the bound, parameters, closed-form bound; --block: the symbolic weights",
                       description="Show the construction without verifying it. With --block, list a block's symbolic "
                                   "weights as 'row label <- column label : expression in beta, gamma'. For a task "
                                   "set the construction refuses: why (what is proven), and the smallest edits of "
                                   "the tasks file that make it constructible, each checked (exit status 2).")
    common(i)
    add_json(i, "the same")
    add_quiet(i)
    block_flags(i)
    i.add_argument("--all", action="store_true", help="with --block: every entry, not one line per pattern")
    i.add_argument("--format", choices=("text", "markdown", "latex", "json"), default="text",
                   help="with --block: output format (default text)")

    b = sub.add_parser("build", help="export the weights", description="Build the model and write its weights (.npz, documented layout).")
    common(b)
    b.add_argument("-o", "--output", required=True, help="output .npz file")
    b.add_argument("--precision", choices=PRECISIONS, default="exact",
                   help="choose the parameters so that the certificate holds for every execution in this format "
                        "(docs/precision.md); prints the margin left at exact and at this precision")
    b.add_argument("--ulps", type=_positive, default=None, metavar="K",
                   help="with --precision: assume exp and division accurate to K ulps (default 4)")
    b.add_argument("--accumulate", choices=("float32", "float64"), default=None,
                   help="with --precision: sums, exp and division in this wider format (mixed precision)")
    add_json(b, "a summary (experts, widths, parameters)")
    add_quiet(b)

    x = sub.add_parser("export", help="write the certified model as an ONNX graph (float32)",
                       description="Write the forward pass as an ONNX graph in float32 (needs the onnx extra): the "
                                   "model 'check --precision float32' builds and certifies (the same rebuild rule), "
                                   "or with --precision exact the one plain 'check' certifies, or the weights of a "
                                   "saved --certificate, or --weights. The graph's metadata names the weights "
                                   "(weights_sha256, as check's report gives it) and the precision they were "
                                   "certified for. Inputs and outputs: docs/precision.md, 'ONNX export'.")
    common(x)
    x.add_argument("--weights", help="export these weights (an .npz in the documented layout) instead of building; "
                                     "they must fit the task set, as check requires")
    x.add_argument("--certificate", metavar="DIR", help="export the weights of the certificate in DIR (it must be a "
                                                        "certified one of this task set)")
    x.add_argument("--precision", choices=("float32", "exact"), default=None,
                   help="when building: the precision the model is built and certified for (default float32, "
                        "the graph's; exact: the model plain 'check' certifies)")
    x.add_argument("--ulps", type=_positive, default=None, metavar="K",
                   help="with --precision float32: assume exp and division accurate to K ulps (default 4), as check")
    x.add_argument("--onnx", required=True, metavar="FILE", help="output .onnx file")
    add_json(x, "a summary (inputs, outputs, size)")
    add_quiet(x)

    ed = sub.add_parser("edit", help="set, change or remove facts of a task in the tasks file",
                        description="Edit the tasks file (or the task's facts file) in place: --set adds or changes "
                                    "a fact, --remove drops one, --delete-task removes the task. The edited set is "
                                    "checked like a loaded one before anything is written, and every file is "
                                    "replaced atomically. Then 'check --since DIR' re-certifies it.")
    ed.add_argument("tasks", help="the tasks.yaml file")
    ed.add_argument("task", help="the task to edit (its name)")
    ed.add_argument("--set", action="append", default=[], metavar="SUBJECT=OBJECT",
                    help="add the fact, or change the subject's object (split at the first '='); repeatable")
    ed.add_argument("--set-pair", action="append", nargs=2, default=[], metavar=("SUBJECT", "OBJECT"),
                    help="the same, for names that contain '='; repeatable")
    ed.add_argument("--remove", action="append", default=[], metavar="SUBJECT", help="remove the subject's fact; repeatable")
    ed.add_argument("--delete-task", action="store_true", help="remove the whole task")
    add_json(ed, "what changed")
    add_quiet(ed)

    w = sub.add_parser("watch", help="keep the certificate in memory and re-certify each edit as it is saved",
                       description="Hold the certificate in DIR in memory (or make it with a full check when DIR "
                                   "holds none) and watch the tasks file and its facts files: after each change, "
                                   "re-certify as 'check --since DIR' does, print one line with the verdict, and "
                                   "save the new certificate to DIR. A watcher pays start-up and reading the "
                                   "certificate once (docs/editing.md). Stop it with Ctrl-C (exit status "
                                   "130); with --max-checks the exit status is the last check's (0 certified, 1 not "
                                   "certified, 2 bad input, or a certificate or --json report not saved).")
    w.add_argument("tasks", help="the tasks.yaml file")
    w.add_argument("--certificate", metavar="DIR", required=True, help="the certificate directory to start from and to keep up to date")
    add_json(w, "each check's report (to a file: the latest, replaced atomically; '-': one JSON object per line)")
    add_quiet(w)
    w.add_argument("--no-isolation", action="store_true", help="skip the rebuild-without-each-task check of edited tasks")
    w.add_argument("--jobs", type=_jobs, default=1, metavar="N", help="worker processes (0: one per CPU); the result does not depend on it")
    w.add_argument("--interval", type=_positive, default=0.1, metavar="SECONDS",
                   help="how often the files are looked at (default 0.1)")
    w.add_argument("--max-checks", type=int, default=None, metavar="N",
                   help="stop after N checks, the first included (default: until Ctrl-C)")

    e = sub.add_parser("explain", help="trace one prefix through the model", description="Show one query's attention, gate, neurons and next tokens.")
    common(e)
    e.add_argument("prefix", help="the prefix, e.g. \"the capital of France is\" (split into tokens; see --sep)")
    e.add_argument("--sep", metavar="SEP", help="the prefix is its tokens joined by SEP, e.g. --sep '|' "
                                                "\"the | capital | of | the capital | is\" (for entities holding template words)")
    e.add_argument("--weights", help="use these weights instead of building")
    add_json(e, "the trace")
    add_quiet(e)

    pl = sub.add_parser("plot", help="draw routing, widths and bound-vs-beta pictures (PNG)", description=(
        "Build and verify the model, then write NAME_routing.png (task x expert routing), NAME_widths.png (expert "
        "width against c(k)) and NAME_bound_vs_beta.png (closed-form bound and measured worst error against beta at "
        "the model's gamma; each beta is a full verification). Needs matplotlib: pip install -e .[plots]"))
    common(pl)
    pl.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    block_flags(pl, "draw these blocks as heat maps (NAME_<block>.png) instead of verifying")
    pl.add_argument("--name", help="file name prefix, without path separators (default: the tasks file's name, or its "
                                   "directory's for tasks.yaml); the pictures are written in --out")
    pl.add_argument("--betas", type=_positive, nargs="+", metavar="BETA",
                    help="beta values for the bound-vs-beta picture (default: integers from the chosen beta - 4 to + 3)")
    add_json(pl, "the list of pictures written")
    add_quiet(pl)

    ac = sub.add_parser("accessible", help="which sequences can the model be made to generate? (certified accessibility)",
                        description="Count, with proofs, the sequences the model generates greedily: every prompt of "
                                    "up to m tokens (exhaustive), and soft prompts (m free input vectors) found by "
                                    "gradient search and certified on the box X +- epsilon/2, beside the bound of "
                                    "'How Many Different Outputs Can a Transformer Generate?' (docs/accessibility.md). "
                                    "Exit status 0: every fact's object is certified accessible; 1: some is not "
                                    "(within these prompts and budgets; not a proof that none exists); 2: bad input.")
    common(ac)
    ac.add_argument("--weights", help="analyse these weights (an .npz in the documented layout) instead of building")
    ac.add_argument("--token-m", type=_count, metavar="M", help="enumerate token prompts of 1..M tokens (default: the "
                    "longest within --max-prompts); refused, with the count, above --max-prompts")
    ac.add_argument("--max-prompts", type=_count, default=300_000, metavar="N",
                    help="most token prompts enumerated (default 300000)")
    ac.add_argument("--no-soft", action="store_true", help="token prompts only (no search; needs no torch)")
    ac.add_argument("--soft-m", type=_count, nargs="+", metavar="M",
                    help="soft prompt lengths (default: every m the positions allow)")
    ac.add_argument("--targets", type=_count, default=8, metavar="N", help="random targets per (m, n) (default 8)")
    ac.add_argument("--restarts", type=_count, default=1, metavar="R", help="search starts per target (default 1)")
    ac.add_argument("--steps", type=_count, default=150, metavar="S", help="Adam steps per search (default 150)")
    ac.add_argument("--lr", type=_positive, default=0.05, help="Adam learning rate (default 0.05)")
    ac.add_argument("--seconds", type=_positive, default=None, metavar="S",
                    help="time limit per search, each (m, n) is one search (default: none, the steps decide)")
    ac.add_argument("--objects", type=_whole, default=32, metavar="N",
                    help="objects no token prompt reaches searched with one soft vector (default 32, drawn with "
                         "the seed; 0: none)")
    ac.add_argument("--seed", type=_whole, default=0, help="seed of the targets and of the search (default 0)")
    ac.add_argument("--prompt-epsilon", type=_positive, default=2.0 ** -10, metavar="EPS",
                    help="the paper's precision: soft prompts are certified on X +- EPS/2 (default 2^-10 = "
                         "0.0009765625, absolute, as the paper's Table 1; a fraction such as 1/1024 is read exactly)")
    ac.add_argument("--plot", metavar="FILE.png", help="draw accessible length against m, with the bound (needs matplotlib)")
    ac.add_argument("--list", type=_whole, default=10, metavar="N", help="examples listed per list (default 10)")
    add_json(ac, "the report, every accessible sequence with its proof")
    add_quiet(ac)
    return p


def _count(text: str) -> int:
    """A whole number >= 1 (argparse type): 0 and a negative number get the same message
    (a negative one once said '>= 0', as if 0 were accepted)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _whole(text: str) -> int:
    """A whole number >= 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


def block_flags(sp: argparse.ArgumentParser, what: str = "list this block's symbolic weights") -> None:
    sp.add_argument("--block", metavar="NAME", help=f"{what}: E, P, U, a head (structure1, ..., subject) or one of its "
                    "W_Q/W_K/W_V/W_O (structure1.W_Q), gate (W_G, b_G), expert:TASK (W_1, b_1, W_2), a matrix name "
                    "across groups (W_Q, W_1), or all")
    sp.add_argument("--task", metavar="NAME", help="with --block: only this task's expert and gate row")
    sp.add_argument("--at", metavar="beta=B,gamma=G", help="with --block: substitute these values (exact; a "
                    "parameter left out takes the model's); default: symbols")


def _write_text(path: str, text: str, inputs: Sequence[str]) -> None:
    """Write atomically; never overwrite an input file."""
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    write_text_atomic(_output_path(path, inputs), text + "\n")


def _output_path(path: str, inputs: Sequence[str]) -> str:
    """The absolute path of an output file, refused (TaskError) if it is an input, or where no
    file can be written (empty, a directory, no such directory: tasks.files.check_target)."""
    from tasks.files import check_target

    target = os.path.abspath(path) if path else ""
    for src in inputs:
        if target and src and os.path.exists(src) and os.path.abspath(src) == target:
            raise TaskError("refusing to overwrite an input file", file=path, fix="choose another output path")
    return check_target(path)


def _load(args, routable: bool = True):
    from tasks.io import load_tasks

    return load_tasks(args.tasks, routable=routable)


def _inputs(args) -> list[str]:
    """Every file this run reads: never to be overwritten by an output."""
    from tasks.io import input_files

    return input_files(args.tasks) + ([args.weights] if getattr(args, "weights", None) else [])


def _build(args, taskset):
    from construction.model import build

    return build(taskset, epsilon=args.epsilon, beta=args.beta, gamma=args.gamma)


def _build_for(args, taskset, deployment, executor=None):
    """The construction, aimed at ``deployment`` when one is given (workflow.check.build_for):
    (model, notes on the targets tried, the deployed pass's report of the model if it ran)."""
    if deployment is None:
        return _build(args, taskset), [], None
    from workflow.check import build_for

    model, attempts = build_for(taskset, deployment, epsilon=args.epsilon, beta=args.beta, gamma=args.gamma,
                                executor=executor)
    verified = attempts[-1].get("report")
    if len(attempts) == 1:
        return model, [], verified
    tried = "; ".join(f"target {a['target']:.3g}: beta={a['beta']}, gamma={a['gamma']}, worst {a['worst_error']:.3g}"
                      for a in attempts)
    return model, [f"built for {deployment.fmt.name}: the construction's target error was tightened until the "
                   f"{deployment.fmt.name} certificate held ({tried})"], verified


@contextlib.contextmanager
def _executor(args, deployment=None):
    """Where the work units run: ``--jobs`` local processes, or the Dask cluster of
    ``--scheduler`` (its workers warmed up for ``deployment`` as the client connects:
    workflow.warming)."""
    from verifier.running.parallel import LocalPool, before_forking

    if args.scheduler is None:
        if args.cluster_timeout is not None:
            raise TaskError("--cluster-timeout needs --scheduler", fix="drop it, or run on a cluster with --scheduler")
        before_forking(args.jobs)
        yield LocalPool(args.jobs)
        return
    if args.jobs != 1:
        raise TaskError("--jobs and --scheduler exclude each other", fix="size the cluster instead (local:N, or its workers)")
    from verifier.running.cluster import NO_WORKER_TIMEOUT, connect
    from workflow.warming import warm_up

    timeout = args.cluster_timeout if args.cluster_timeout is not None else NO_WORKER_TIMEOUT
    with connect(args.scheduler, timeout, functools.partial(warm_up, deployment)) as executor:
        yield executor


#: what --precision accepts: the exact pass, or a floating-point format of :mod:`layout.formats`
PRECISIONS = ("exact", *FORMATS)


def _deployment(args):
    """The floating-point deployment of --precision (None: the exact pass)."""
    if args.precision == "exact":
        if args.ulps is not None or args.accumulate is not None:
            flag = "--ulps" if args.ulps is not None else "--accumulate"
            raise TaskError(f"{flag} needs a floating-point --precision", fix="add e.g. --precision float32")
        return None
    from verifier.passes.floating import DEFAULT_ULPS, Deployment

    try:
        return Deployment.named(args.precision, args.ulps if args.ulps is not None else DEFAULT_ULPS, args.accumulate)
    except ValueError as exc:
        raise TaskError(f"--accumulate {args.accumulate}: {exc}",
                        fix="accumulate in a format wider than --precision (e.g. bfloat16 with float32)") from None


def cmd_check(args) -> int:
    import layout
    from verifier.checks.report import dumps, summary
    from verifier.checks.verify import verify

    if not args.weights:             # the construction and its evidence (sympy): not for weights given
        from workflow.check import check_built
    settle()
    deployment = _deployment(args)
    progress = counter(args.quiet, "verifying", "queries")
    if args.certificate or args.since:
        return _check_certificate(args, deployment, progress)
    taskset = _load(args)
    with _executor(args, deployment) as executor:
        if args.weights:
            epsilon = args.epsilon or taskset.epsilon or 0.01
            # the weights handed over, not kept here: verify lets them go once its pass has its tables
            report = verify(taskset, layout.load(args.weights), epsilon, source=args.weights, progress=progress,
                            executor=executor, deployment=deployment)
        else:
            built = list(_build_for(args, taskset, deployment, executor))
            notes, verified = built[1], built[2]
            # the model handed over, not kept here: check_built releases it before the pass
            report = check_built(taskset, built.pop(0), isolation=not args.no_isolation, progress=progress,
                                 executor=executor, deployment=deployment, verified=verified)
            report.notes.extend(notes)
    if args.json:
        _write_text(args.json, dumps(report), _inputs(args))
    code = EXIT_OK if report.certified else EXIT_NOT_CERTIFIED
    if args.json != "-":
        try:
            print(summary(report))
            sys.stdout.flush()
        except BrokenPipeError:  # the reader stopped early; the verdict still decides the status
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


def _refuse_inputs_in(directory: str, inputs: Sequence[str]) -> None:
    """A certificate directory is replaced as a whole when it is saved: refused (TaskError)
    if it is an input file or holds one."""
    target = os.path.abspath(directory)
    for p in inputs:
        p = os.path.abspath(p)
        if p == target or os.path.commonpath([p, target]) == target:
            raise TaskError(f"the certificate directory {directory} is or holds an input file ({p}); saving "
                            f"replaces the whole directory", fix="give a directory of its own")


def _check_certificate(args, deployment, progress) -> int:
    """check --certificate / --since: a full check that saves its certificate, or a re-certification from one."""
    from workflow.certificates import check_and_save
    from workflow.since import check_since, load_since
    from tasks.io import input_signature
    from verifier.certificates.certificate import require_replaceable
    from verifier.checks.report import dumps, summary
    from verifier.running.parallel import before_forking
    from verifier.running.runner import COMBINATIONS

    for flag, bad in (("--weights", args.weights), ("--cluster-timeout", getattr(args, "cluster_timeout", None))):
        if bad:
            raise TaskError(f"--certificate and --since work on models this tool builds, on local processes; {flag} "
                            f"does not combine with them", fix=f"drop {flag}")
    refusal = COMBINATIONS[("exact" if deployment is None else "float",
                            "cluster" if getattr(args, "scheduler", None) else "local", True)]
    if refusal is not None:
        raise TaskError(refusal.why, fix=refusal.fix)
    for d in (args.since, args.certificate):
        if d:
            _refuse_inputs_in(d, _inputs(args))
    require_replaceable(args.certificate or args.since)      # before the check, and again at the save
    if args.since:
        for name, given in (("beta", args.beta), ("gamma", args.gamma)):
            if given is not None:
                raise TaskError(f"--since keeps the certificate's beta and gamma; --{name} does not combine with it",
                                fix=f"drop --{name}, or run a full check with --certificate")
        if args.epsilon is not None:
            raise TaskError("--since takes epsilon from the tasks file (else the certificate); --epsilon does not combine with it",
                            fix="drop --epsilon, or run a full check with --certificate")
        import time
        start = time.perf_counter()
        read_as = input_signature(args.tasks)
        old, taskset, cache = load_since(args.tasks, args.since)
        read = time.perf_counter() - start
        before_forking(args.jobs)
        report, _ = check_since(taskset, args.since, args.certificate, old=old, cache=cache,
                                isolation=not args.no_isolation, jobs=args.jobs, progress=progress,
                                source=args.tasks, tasks_path=args.tasks, read_as=read_as)
        report.incremental["phases"] = {"read certificate and tasks": round(read, 3), **report.incremental["phases"]}
    else:
        from workflow.certificates import build_for_certificate

        read_as = input_signature(args.tasks)
        taskset = _load(args)
        before_forking(args.jobs)
        model, choice = build_for_certificate(taskset, epsilon=args.epsilon, beta=args.beta, gamma=args.gamma)
        report = check_and_save(taskset, model, args.certificate, isolation=not args.no_isolation, jobs=args.jobs,
                                progress=progress, source=args.tasks, tasks_path=args.tasks, read_as=read_as,
                                choice=choice)
    if args.json:
        _write_text(args.json, dumps(report), _inputs(args))
    if args.json != "-":
        print(summary(report))
    return EXIT_OK if report.certified else EXIT_NOT_CERTIFIED


def cmd_watch(args) -> int:
    from cli.watch import saved_line, verdict_line
    from workflow.watching import Watcher, one_line, watch
    from verifier.certificates.certificate import require_replaceable
    from verifier.checks.report import dumps, report_json
    from verifier.running.parallel import before_forking

    settle()
    if args.max_checks is not None and args.max_checks < 1:
        raise TaskError("--max-checks must be at least 1", fix="give a positive number, or leave it out")
    directory = args.certificate
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise TaskError("exists and is not a directory", file=directory, fix="give a directory for the certificate")
    if not os.path.isdir(os.path.dirname(os.path.abspath(directory))):
        raise TaskError("the certificate's parent directory does not exist", file=directory, fix="create it first")
    _refuse_inputs_in(directory, _inputs(args))
    require_replaceable(directory)                      # before the first check, and again at each save
    if args.json not in (None, "-"):
        _output_path(args.json, _inputs(args))          # refused before the first check, not after it
    before_forking(args.jobs)
    watcher = Watcher(args.tasks, directory, jobs=args.jobs, isolation=not args.no_isolation)
    if not args.quiet and args.json != "-":
        print(f"watching {args.tasks} and its facts files; certificate in {directory} (Ctrl-C stops)", flush=True)

    def emit(outcome) -> None:
        if args.json and outcome.report is not None:
            if args.json == "-":
                print(json.dumps(report_json(outcome.report), ensure_ascii=False), flush=True)
            else:
                try:       # a report that cannot be written is an error line; the certificate is still saved
                    _write_text(args.json, dumps(outcome.report), _inputs(args))
                except (TaskError, OSError) as exc:
                    outcome.report_error = one_line(exc)
        elif args.json == "-":
            print(json.dumps({"error": outcome.error}, ensure_ascii=False), flush=True)
        if args.json != "-":
            print(verdict_line(outcome, directory), flush=True)
        if outcome.report_error is not None:
            print(f"error: the JSON report was not written: {outcome.report_error}", flush=True)

    def saved(outcome) -> None:
        if outcome.save_error is not None:
            print(json.dumps({"error": saved_line(outcome, directory)}, ensure_ascii=False) if args.json == "-"
                  else saved_line(outcome, directory), flush=True)
        elif not args.quiet and args.json != "-":
            print(saved_line(outcome, directory), flush=True)

    last = watch(watcher, emit, saved=saved, interval=args.interval, max_checks=args.max_checks)   # Ctrl-C: 130
    if last is None or last.report is None or last.save_error is not None or last.report_error is not None:
        return EXIT_BAD_INPUT
    return EXIT_OK if last.report.certified else EXIT_NOT_CERTIFIED


def cmd_edit(args) -> int:
    from tasks.editing import Edit, edit_tasks_file, parse_pair

    settle()
    pairs = [parse_pair(x) for x in args.set] + [tuple(p) for p in args.set_pair]
    if not pairs and not args.remove and not args.delete_task:
        raise TaskError("nothing to edit", fix="give --set SUBJECT=OBJECT, --remove SUBJECT or --delete-task")
    if args.delete_task and (pairs or args.remove):
        raise TaskError("--delete-task removes the whole task; it does not combine with --set or --remove",
                        fix="give one or the other")
    taskset = _load(args)
    result = edit_tasks_file(args.tasks, taskset, Edit(args.task, tuple(pairs), tuple(args.remove), args.delete_task))
    data = {"task": args.task, "changes": result.changes, "written": result.written}
    if args.json:
        _write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), [])
    if args.json != "-" and not args.quiet:
        for change in result.changes:
            print(f"{args.task}: {change}")
        print(f"wrote {', '.join(result.written)}" if result.written else "nothing changed; no file written")
    return EXIT_OK


def inspect_data(model) -> dict:
    ts = model.taskset
    counts = model.instantiate().parameter_counts()
    counts["facts_per_parameter"] = ts.n_facts / counts["total"] if counts["total"] else None
    return {
        "parameter_counts": counts,
        "epsilon": model.epsilon,
        "parameters": {"beta": str(model.beta), "gamma": str(model.gamma)},
        "gate": model.gate.method,
        "gate_ideal_margin": float(model.gate.ideal_margin),
        "closed_form": str(model.error_bound()),
        "bound": model.bound_value(),
        "bound_proven": not model.unproven_conditions(),
        "unproven_conditions": model.unproven_conditions(),
        "conditions": model.conditions(),
        "L": ts.L,
        "vocabulary": ts.vocabulary.size,
        "residual_width": model.residual.dim,
        "experts": [{"task": t.name, "templates": t.n_templates, "facts": t.n_facts, "width": w, "bound": c,
                     "template_neurons": w - t.n_facts, "dictionary_neurons": t.n_facts, "parameters": n}
                    for t, w, c, n in zip(ts.tasks, model.widths, model.bounds, counts["per_expert"])],
    }


def _listings(args, model):
    """The listings selected by --block, --task and --at (a TaskError for an unknown name)."""
    from construction.listing import named_blocks, parse_values, patterns, select

    names = model.taskset.names
    if args.task is not None and args.task not in names:
        raise TaskError(f"--task '{args.task}' is not a task of {args.tasks}", fix=f"give one of: {', '.join(names)}")
    task = names.index(args.task) if args.task is not None else None
    values = parse_values(args.at, model.values)
    chosen = select(named_blocks(model), args.block, task)
    return [patterns(b, rows_only=[task] if task is not None and b.task_rows else None, values=values) for b in chosen]


def _explain_refusal(args, taskset, refusal) -> int:
    """inspect on a refused set: the refusal, what it proves, the smallest checked changes (exit 2)."""
    from construction.remedies import smallest_changes, summarize

    changes = smallest_changes(taskset, refusal)
    if args.json:
        data = {"constructible": False, "refusal": refusal.as_dict(), "changes": [c.as_dict() for c in changes]}
        _write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), _inputs(args))
    if args.json != "-":
        print(f"not constructible ({refusal.kind}): {refusal.error}")
        print(f"proven: {refusal.proven}")
        if changes:
            print("smallest changes that make it constructible (each checked by running the construction on the edited set):")
            for n, steps in enumerate(summarize(changes), start=1):
                print(f"  {n}. {steps[0]}" if len(steps) == 1 else f"  {n}. these {len(steps)} edits together:")
                for step in steps[1:] if len(steps) == 1 else steps:
                    print(f"       - {step}")
        else:
            print("no single edit of the templates or facts it names makes it constructible")
    print(f"error: {refusal.error}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_inspect(args) -> int:
    from construction.remedies import diagnose

    settle()
    taskset = _load(args, routable=False)      # a set nobody could route is explained, not just refused
    refusal = diagnose(taskset)
    if refusal is not None:
        return _explain_refusal(args, taskset, refusal)
    model = _build(args, taskset)
    if args.block is None and (args.task is not None or args.at is not None or args.all or args.format != "text"):
        raise TaskError("--task, --at, --all and --format apply to --block", fix="add --block NAME (e.g. --block gate)")
    if args.block is not None:
        from construction.printing import render

        listings = _listings(args, model)
        if args.json:
            _write_text(args.json, render(listings, "json", all_entries=args.all), _inputs(args))
        if args.json != "-":
            print(render(listings, args.format, all_entries=args.all))
        return EXIT_OK
    data = inspect_data(model)
    if args.json:
        _write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), _inputs(args))
        if args.json == "-":
            return EXIT_OK
    print(f"L = {data['L']}, |V| = {data['vocabulary']}, residual width d = {data['residual_width']}, gate: {data['gate']}")
    print(f"parameters: beta = {data['parameters']['beta']}, gamma = {data['parameters']['gamma']}, epsilon = {data['epsilon']}")
    print(f"closed-form bound: eps(beta, gamma) = {data['closed_form']}")
    proven = ("proven upper bound" if data["bound_proven"] else
              f"NOT a proven bound: {'; '.join(data['unproven_conditions'])}")
    print(f"  at these parameters: {data['bound']:.6g} ({proven}); leak delta = {data['conditions']['delta']:.3g} "
          f"(gate needs < {data['conditions']['delta_max_gate']:.3g}); subject-head leak e^-beta = "
          f"{data['conditions']['delta_subject']:.3g} (needs < 1/2)")
    name_w = max(4, *(len(e["task"]) for e in data["experts"]))
    print(f"{'task'.ljust(name_w)}  |T|  N_k  template  dictionary  width  bound L|T|+N_k  parameters")
    for e in data["experts"]:
        print(f"{e['task'].ljust(name_w)}  {e['templates']:>3}  {e['facts']:>3}  {e['template_neurons']:>8}  {e['dictionary_neurons']:>10}  "
              f"{e['width']:>5}  {e['bound']:>5}  {'ok  ' if e['width'] <= e['bound'] else 'OVER'}  {e['parameters']:>10,}")
    c = data["parameter_counts"]
    print(f"parameters (stored entries): {c['total']:,} in total, {c['shared']:,} shared, {c['active_per_query']:,} "
          f"active per query; {c['facts_per_parameter']:.3g} facts per parameter; dense shapes would hold {c['dense_total']:,}")
    return EXIT_OK


def cmd_build(args) -> int:
    import layout

    settle()
    taskset = _load(args)
    out = _output_path(args.output, _inputs(args))            # refused before the build (and again at the write)
    deployment = _deployment(args)
    model, notes, verified = _build_for(args, taskset, deployment)
    margins = _margins(taskset, model, deployment, verified) if deployment is not None else None
    layout.save(model.instantiate(), out)
    certified = all(m["certified"] for m in margins or ())
    if args.json:
        data = {"output": args.output, "experts": len(model.experts), "widths": list(model.widths),
                "beta": str(model.beta), "gamma": str(model.gamma), "epsilon": model.epsilon,
                "precision": args.precision, "margins": margins, "notes": notes}
        _write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), _inputs(args) + [args.output])
    if not args.quiet and args.json != "-":
        print(f"wrote {args.output}: {len(model.experts)} experts, widths {list(model.widths)}, beta = {model.beta}, gamma = {model.gamma}")
        for note in notes:
            print(f"note: {note}")
        for m in margins or []:
            print(f"{m['precision']}: worst error {m['worst_error']:.6g}, margin {m['margin']:.3g} below epsilon = "
                  f"{model.epsilon:g}" + ("" if m["certified"] else f" (NOT certified: failing {m['failing']})"))
    # built for a precision with the parameters pinned, the weights are written as asked and
    # checked: exit 1 when a certificate does not hold (check --precision shows why, query by query)
    return EXIT_OK if certified else EXIT_NOT_CERTIFIED


def _margins(taskset, model, deployment, verified=None) -> list[dict]:
    """Worst error and margin ε − worst of the built weights, exact and in ``deployment``
    (``verified``: the deployed report build_for already has)."""
    from verifier.checks.verify import verify
    from workflow.check import failing_checks

    weights = model.instantiate()
    out = []
    for dep in (None, deployment):
        rep = verified if dep is not None and verified is not None else verify(taskset, weights, model.epsilon,
                                                                                deployment=dep)
        out.append({"precision": "exact" if dep is None else dep.fmt.name, "worst_error": rep.measured_worst,
                    "margin": model.epsilon - rep.measured_worst, "certified": rep.certified,
                    "failing": failing_checks(rep)})
    return out


def cmd_export(args) -> int:
    from layout.onnx_graph import save_onnx

    settle()
    taskset = _load(args)
    out = _output_path(args.onnx, _inputs(args))              # refused before the build (and again at the write)
    weights, meta, notes = _exported(args, taskset)
    save_onnx(weights, out, source=args.weights or args.certificate or "weights", metadata=meta)
    size = os.path.getsize(out)
    if args.json:
        data = {"output": args.onnx, "bytes": size, "inputs": {"tokens": ["N", "T", "int64"]},
                "outputs": {"probs": ["N", len(weights.vocab), "float32"], "expert": ["N", "int64"],
                            "gate": ["N", len(weights.experts), "float32"]}, "metadata": meta, "notes": notes}
        _write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), _inputs(args) + [args.onnx])
    if not args.quiet and args.json != "-":
        print(f"wrote {args.onnx}: {size / 1e6:.1f} MB, float32; input tokens (N, T) int64 without BOS; "
              f"outputs probs (N, {len(weights.vocab)}), expert (N,), gate (N, {len(weights.experts)})")
        print(f"weights: sha256 {meta['weights_sha256']}; {meta['certified']}")
        for note in notes:
            print(f"note: {note}")
    return EXIT_OK


def _exported(args, taskset):
    """(the weights export writes, the graph's metadata, notes): built by the rule of ``check
    --precision`` (float32 by default: build_for; exact: the plain build), or taken from
    ``--certificate`` or ``--weights``, which must fit the task set as ``check`` requires."""
    import layout
    from layout.digest import weights_digest
    from verifier.checks.verify import fitting

    given = [flag for flag, v in (("--weights", args.weights), ("--certificate", args.certificate)) if v]
    if len(given) > 1:
        raise TaskError("--weights and --certificate exclude each other", fix="export one of them")
    if given and (args.precision is not None or args.ulps is not None or args.beta or args.gamma):
        flag = next(f for f, v in (("--precision", args.precision), ("--ulps", args.ulps), ("--beta", args.beta),
                                   ("--gamma", args.gamma)) if v is not None)
        raise TaskError(f"{flag} chooses how the model is built; {given[0]} exports given weights",
                        fix=f"drop {flag}, or drop {given[0]} to build")
    notes: list[str] = []
    if args.certificate:
        weights, epsilon, certified = _certified_weights(args.certificate, taskset)
    elif args.weights:
        weights = layout.load(args.weights)
        epsilon, certified = None, ("not checked here: run check --weights on the same file for its certificate "
                                    "(the same sha256)")
    else:
        precision = args.precision or "float32"
        if precision == "exact":
            if args.ulps is not None:
                raise TaskError("--ulps needs --precision float32", fix="drop --ulps")
            model = _build(args, taskset)
            certified = "built as 'check' builds: plain check certifies the exact forward pass of these weights"
        else:
            from verifier.passes.floating import DEFAULT_ULPS, Deployment

            dep = Deployment.named("float32", args.ulps if args.ulps is not None else DEFAULT_ULPS)
            model, notes, verified = _build_for(args, taskset, dep)
            if not verified.certified:          # parameters pinned (else build_for refuses): nothing to export
                from workflow.check import failing_checks

                raise NotCertified(f"the float32 certificate does not hold at beta = {model.beta}, gamma = "
                                   f"{model.gamma} (failing: {failing_checks(verified)}); nothing written "
                                   f"(check --precision float32 with the same parameters shows the counterexamples)")
            certified = (f"built as 'check --precision float32' builds: the float32 certified pass (error, "
                         f"routing, size, entanglement) held at epsilon = {model.epsilon:g} for these weights; "
                         f"check --precision float32 certifies the same sha256")
        weights, epsilon = model.instantiate(), model.epsilon
    fitting(taskset, weights, args.weights or args.certificate or "weights")
    meta = {"weights_sha256": weights_digest(weights), "certified": certified,
            "precision": args.precision or ("float32" if not given else ("exact" if args.certificate else "")),
            "epsilon": "" if epsilon is None else repr(float(epsilon)),
            "parameters": json.dumps({k: str(v) for k, v in (weights.parameters or {}).items()
                                      if k in ("beta", "gamma")}, ensure_ascii=False)}
    return weights, meta, notes


def _certified_weights(directory: str, taskset):
    """(weights, ε, the claim) of the certificate in ``directory``, which must be certified and
    be of ``taskset`` as it is now (every task's content hash the certificate's)."""
    from verifier.certificates.certificate import load_certificate, task_hash

    cert = load_certificate(directory)
    if not cert.certified:
        raise TaskError(f"the certificate in {directory} is NOT CERTIFIED; there is no certified model to export",
                        fix="fix what check reports, then check --certificate again")
    now = {t.name: task_hash(t, taskset) for t in taskset.tasks}
    if now != cert.resolved_hashes():
        raise TaskError(f"the certificate in {directory} is of another version of this task set",
                        file=directory, fix="re-certify the edit first (check --since DIR), then export")
    return cert.weights, cert.epsilon, (f"the weights of the certificate in {directory}: plain check certified their "
                                        f"exact forward pass at epsilon = {cert.epsilon:g}")


class NotCertified(Exception):
    """A command verified what it was asked to and the certificate does not hold, so it
    stops: one line, exit status 1 (not bad input)."""


def cmd_explain(args) -> int:
    import layout
    from verifier.checks.explain import explain, render

    settle()
    taskset = _load(args)
    weights = layout.load(args.weights) if args.weights else _build(args, taskset).instantiate()
    prefix = args.prefix.split(args.sep) if args.sep else args.prefix
    info = explain(taskset, weights, prefix)
    if args.json:
        _write_text(args.json, json.dumps(info, indent=2, ensure_ascii=False), _inputs(args))
        if args.json == "-":
            return EXIT_OK
    print(render(info))
    return EXIT_OK


def cmd_plot(args) -> int:
    from workflow.plots import plot_all
    from verifier.checks.plots import require_matplotlib

    settle()
    _check_file_prefix(args.name)
    require_matplotlib()
    taskset = _load(args)
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise TaskError("is not a directory", file=args.out, fix="give a directory for the pictures")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise TaskError(f"cannot create the output directory: {exc.strerror or exc}", file=args.out) from None
    name = args.name
    if not name:
        stem = os.path.splitext(os.path.basename(args.tasks))[0]
        parent = os.path.basename(os.path.dirname(os.path.abspath(args.tasks)))
        name = parent if stem == "tasks" and parent else stem
    model = _build(args, taskset)
    if args.block is not None:
        paths = _plot_blocks(args, model, args.out, name)
    else:
        if args.task is not None or args.at is not None:
            raise TaskError("--task and --at apply to --block", fix="add --block NAME (e.g. --block gate)")
        paths = plot_all(taskset, model, args.out, name, args.betas, quiet=args.quiet)
    if args.json:
        _write_text(args.json, json.dumps({"pictures": paths}, indent=2, ensure_ascii=False), _inputs(args))
    if args.json != "-":
        for path in paths:
            print(path)
    return EXIT_OK


def _check_file_prefix(name: str | None) -> None:
    """``plot --name``: a file name prefix, so that every picture is written in ``--out``
    (a separator would put them in another directory: ``../x`` outside ``--out``)."""
    if name is None:
        return
    held = [c for c in dict.fromkeys(("/", os.sep, os.altsep or "/", "\0")) if c in name]
    if held:
        shown = ", ".join("NUL" if c == "\0" else repr(c) for c in held)
        raise TaskError(f"--name {name!r} is not a file name prefix (it holds {shown}): the pictures would be "
                        f"written in another directory than --out",
                        fix="give a name without path separators, e.g. --name demo; --out chooses the directory")


def _plot_blocks(args, model, out: str, name: str) -> list[str]:
    """One heat map per selected block: ``<name>_<block>.png`` (':' and '.' become '_')."""
    import re

    from construction.listing import grid
    from verifier.checks.plots import plot_block, save_png

    paths = []
    for listing in _listings(args, model):
        stem = re.sub(r"[^A-Za-z0-9_-]+", "_", listing.block.name)
        path = os.path.join(out, f"{name}_{stem}.png")
        paths.append(save_png(plot_block(grid(listing, model.values), title=name), path))
    return paths


def cmd_accessible(args) -> int:
    """Token prompts exhaustively, soft prompts by search, every sequence certified
    (:mod:`verifier.checks.accessible`); exit 0 iff every fact's object is certified accessible."""
    import layout
    from tasks.console import progress_bar
    from verifier.checks import accessible as A
    from verifier.checks import accessible_report as R
    from verifier.passes import boxes
    from verifier.checks.verify import fitting

    settle()
    taskset = _load(args)
    inputs = _inputs(args)
    for path in (args.json, args.plot):
        if path and path != "-":
            _output_path(path, inputs)                  # refused before the work (and again at the write)
    if args.plot:
        from verifier.checks.plots import require_matplotlib

        require_matplotlib()
    if args.no_soft and (args.soft_m or args.seconds):
        raise TaskError("--soft-m and --seconds set the soft-prompt search, which --no-soft turns off",
                        fix="drop --no-soft, or the soft-prompt flags")
    weights = layout.load(args.weights) if args.weights else _build(args, taskset).instantiate()
    fitting(taskset, weights, args.weights or "weights")
    m, why = A.choose_m(weights, args.max_prompts, args.token_m)
    soft_m = sorted(set(args.soft_m or range(1, weights.n_positions)))
    if soft_m and soft_m[-1] >= weights.n_positions:
        raise TaskError(f"--soft-m {soft_m[-1]} leaves no position to generate into: the model has "
                        f"{weights.n_positions} positions", fix=f"choose prompt lengths 1..{weights.n_positions - 1}")
    propose = None if args.no_soft else _proposer(args, weights)
    model = boxes.prepare(weights)
    bar = progress_bar(args.quiet, "token prompts", "prompts", total=sum(A.prompt_counts(len(weights.vocab), m)))
    tokens = A.token_accessibility(model, taskset, m, why, None if bar is None else bar.update)
    if bar is not None:
        bar.close()
    soft = None
    if propose is not None:
        bar = progress_bar(args.quiet, "soft prompts", "searches")
        soft = A.soft_accessibility(model, tokens, propose, soft_m, args.targets, args.restarts, args.seed,
                                    args.prompt_epsilon, args.objects, None if bar is None else bar.update)
        if bar is not None:
            bar.close()
    analysis = A.Analysis(weights, tokens, soft, A.facts_with_soft(tokens.facts, soft, weights.vocab))
    stem = os.path.splitext(os.path.basename(args.tasks))[0]
    parent = os.path.basename(os.path.dirname(os.path.abspath(args.tasks)))
    name = parent if stem == "tasks" and parent else stem            # as plot names its pictures
    if args.plot:
        from verifier.checks.accessible_plots import plot_accessibility
        from verifier.checks.plots import save_png

        save_png(plot_accessibility(analysis, name), _output_path(args.plot, inputs))
    if args.json:
        from layout.digest import weights_digest

        source = {"tasks": args.tasks, "weights": args.weights or "built", "weights_sha256": weights_digest(weights)}
        _write_text(args.json, json.dumps(R.report_json(analysis, source), indent=1, ensure_ascii=False), inputs)
    if args.json != "-":
        print("\n".join(R.render(analysis, name, args.list)))
        if args.plot:
            print(f"wrote {args.plot}")
    return EXIT_OK if analysis.every_object else EXIT_NOT_CERTIFIED


def _proposer(args, weights):
    """The soft-prompt search (training.cramming, torch: the train extra) with the flags' budget."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise TaskError("the soft-prompt search needs torch", fix='pip install -e ".[train]", or pass --no-soft') from None
    from training.cramming import SearchBudget, proposer

    return proposer(weights, SearchBudget(steps=args.steps, lr=args.lr, seconds=args.seconds, seed=args.seed))


COMMANDS = {"check": cmd_check, "inspect": cmd_inspect, "build": cmd_build, "export": cmd_export, "explain": cmd_explain,
            "plot": cmd_plot, "edit": cmd_edit, "watch": cmd_watch, "accessible": cmd_accessible}


def _refusal_hint(args, exc: TaskError) -> str:
    """For a task set the construction refuses: where to find the smallest changes. Not for
    a refused edit (tasks.editing.EditRefusal): the file is unchanged, so inspecting it finds
    nothing wrong; the refusal itself says what the edit would break and how to make it."""
    from construction.gate import RoutingError
    from tasks.editing import EditRefusal

    if isinstance(exc, EditRefusal):
        return ""
    if args.command != "inspect" and (isinstance(exc, RoutingError) or "no model can route" in exc.problem):
        return f" ('python -m verifier inspect {args.tasks}' lists the smallest changes that make it constructible)"
    return ""


def settle() -> None:
    """A command has loaded its modules: freeze what the loading made and collect cycles again.

    ``python -m verifier`` turns Python's cyclic garbage collector off before anything is
    imported (``verifier/__main__.py``): sympy and scipy (and numba, where the kernels
    run just in time) make up to a million long-lived objects as they load, and each full
    collection on the way would scan them all again (up to a fifth of a second at 100k
    facts). Each command calls this once its modules are in: ``gc.freeze`` moves every object alive now to a generation that is
    never scanned, and the collector is on again, with its usual thresholds, for what the
    work makes (forked workers inherit the frozen heap untouched). Nothing computed
    depends on it; the cycles made while loading (few) stay. Called with the collector
    on (a program or a test calling :func:`main`), it does nothing."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except TaskError as exc:
        print(f"error: {exc}{_refusal_hint(args, exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NotCertified as exc:
        print(f"not certified: {exc}", file=sys.stderr)
        return EXIT_NOT_CERTIFIED
    except RecursionError:
        print("error: input nested too deeply", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. `python -m verifier check ... | head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
    except OSError as exc:
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}".replace("\n", " "), file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemoryError:
        print("error: out of memory on this input", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: never exit 1 ("not certified") or 0 for it
        if os.environ.get("MOE_VERIFIER_DEBUG"):
            raise
        print(f"internal error: {type(exc).__name__}: {exc}".replace("\n", " ")
              + " (a bug: please report it with the command; MOE_VERIFIER_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_INTERNAL
