"""The discrete knowledge model: templates, tasks, task sets, queries (docs/design.md §2)."""

from tasks.errors import TaskError
from tasks.io import dump_tasks, dumps_tasks, load_tasks, loads_tasks
from tasks.model import OBJECT, SUBJECT, Facts, Slot, Task, TaskSet, Template, Vocabulary
from tasks.queries import Query, QueryGroup, count_queries, iter_queries, query_groups
from tasks.structure import StructureTrie, check_routable, conflict_graph, object_query_collisions, open_tasks

__all__ = [
    "TaskError", "load_tasks", "loads_tasks", "dump_tasks", "dumps_tasks", "Slot", "SUBJECT", "OBJECT", "Template",
    "Facts", "Task", "TaskSet", "Vocabulary",
    "Query", "QueryGroup", "query_groups", "iter_queries", "count_queries",
    "StructureTrie", "check_routable", "conflict_graph", "object_query_collisions", "open_tasks",
]
