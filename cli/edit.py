"""``edit``: set, change or remove facts of a task in the tasks file (:func:`tasks.editing.edit_tasks_file`)."""

from __future__ import annotations

import argparse
import json

from cli.common import load, settle, write_text
from tasks.console import EXIT_OK, add_json, add_quiet
from tasks.errors import TaskError

#: Where ``--help`` lists the command (:data:`cli.main.COMMANDS`).
ORDER = 5
HELP = "set, change or remove facts of a task in the tasks file"
DESCRIPTION = ("Edit the tasks file (or the task's facts file) in place: --set adds or changes "
               "a fact, --remove drops one, --delete-task removes the task. The edited set is "
               "checked like a loaded one before anything is written, and every file is "
               "replaced atomically. Then 'check --since DIR' re-certifies it.")


def arguments(ed: argparse.ArgumentParser) -> None:
    ed.add_argument("tasks", help="the tasks.yaml file")
    ed.add_argument("task", help="the task to edit (its name)")
    ed.add_argument("--set", action="append", default=[], metavar="SUBJECT=OBJECT",
                    help="add the fact, or change the subject's object (split at the first '='); repeatable")
    ed.add_argument("--set-pair", action="append", nargs=2, default=[], metavar=("SUBJECT", "OBJECT"),
                    help="the same, for names that contain '='; repeatable")
    ed.add_argument("--remove", action="append", default=[], metavar="SUBJECT",
                    help="remove the subject's fact; repeatable")
    ed.add_argument("--delete-task", action="store_true", help="remove the whole task")
    add_json(ed, "what changed")
    add_quiet(ed)


def run(args) -> int:
    from tasks.editing import Edit, edit_tasks_file, parse_pair

    settle()
    pairs = [parse_pair(x) for x in args.set] + [tuple(p) for p in args.set_pair]
    if not pairs and not args.remove and not args.delete_task:
        raise TaskError("nothing to edit", fix="give --set SUBJECT=OBJECT, --remove SUBJECT or --delete-task")
    if args.delete_task and (pairs or args.remove):
        raise TaskError("--delete-task removes the whole task; it does not combine with --set or --remove",
                        fix="give one or the other")
    taskset = load(args)
    result = edit_tasks_file(args.tasks, taskset, Edit(args.task, tuple(pairs), tuple(args.remove), args.delete_task))
    data = {"task": args.task, "changes": result.changes, "written": result.written}
    if args.json:
        write_text(args.json, json.dumps(data, indent=2, ensure_ascii=False), [])
    if args.json != "-" and not args.quiet:
        for change in result.changes:
            print(f"{args.task}: {change}")
        print(f"wrote {', '.join(result.written)}" if result.written else "nothing changed; no file written")
    return EXIT_OK
