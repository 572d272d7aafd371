"""Routability analysis: the conflict graph between templates of different tasks."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

from tasks.model import Task, TaskSet
from tasks.strategies import task_sets
from tasks.structure import StructureTrie, conflict_graph, object_query_collisions, open_tasks
from tasks.structure import structure_of
from repository import EXAMPLES, ROOT


def test_conflict_graph_of_the_example(capitals_set):
    g = conflict_graph(StructureTrie(capitals_set))
    assert g.number_of_nodes() == 5
    assert g.nodes[(0, 0)] == {"task": "capital", "template": "the capital of ⋆1 is ⋆2"}
    # 'the capital ...' and 'the continent ...' share 'the'; '⋆1 has capital', '⋆1 lies in', '⋆1 is a city' share '⋆1'
    assert g.edges[(0, 0), (1, 0)] == {"prefix": "the", "depth": 1, "object_query": False, "shared_subjects": 3}
    assert g.edges[(0, 1), (2, 0)]["prefix"] == "⋆1"
    assert g.edges[(0, 1), (2, 0)]["shared_subjects"] == 0
    assert not g.has_edge((0, 0), (0, 1))  # same task: no conflict edge
    assert not any(d["object_query"] for _, _, d in g.edges(data=True))


def test_conflict_graph_marks_object_query_collisions():
    ts = TaskSet((
        Task("a", ("⋆1 is ⋆2", "the a of ⋆1 is ⋆2"), {"x": "y"}),
        Task("b", ("⋆1 is ⋆2 too",), {"z": "w"}),
    ))
    g = conflict_graph(StructureTrie(ts))
    edge = g.edges[(0, 0), (1, 0)]
    assert edge["prefix"] == "⋆1 is" and edge["depth"] == 2 and edge["object_query"] is True
    assert edge["shared_subjects"] == 0  # structural only: routable by subject, refused by the construction
    assert not g.has_edge((0, 1), (1, 0))
    structural = object_query_collisions(StructureTrie(ts), structural=True)
    assert [c.structure for c in structural] == ["⋆1 is"]
    assert object_query_collisions(StructureTrie(ts)) == []


def test_open_tasks(capitals_set):
    assert open_tasks(capitals_set, ("the",)) == ("capital", "continent")
    assert open_tasks(capitals_set, ("France",)) == ("capital", "continent")
    assert open_tasks(capitals_set, ("Paris",)) == ("located",)
    assert open_tasks(capitals_set, ("Brazil", "has")) == ()  # Brazil has no capital fact
    assert open_tasks(capitals_set, ("the", "capital", "of", "France", "is")) == ("capital",)


def test_example_file_is_the_test_fixture(capitals_set):
    from tasks.io import load_tasks

    assert load_tasks(EXAMPLES / "capitals.yaml") == capitals_set


def _rows_of(group):
    """Each query of a group as a hashable record: prefix ids, allowed tasks, valid next tokens."""
    out = set()
    for i in range(len(group)):
        out.add((int(group.subjects[i]), int(group.objects[i]), tuple(group.allowed_of(i).tolist()),
                 tuple(group.valid_of(i).tolist()), bool(group.object_query[i]), int(group.determined[i]),
                 int(group.witness_task[i]), int(group.witness_template[i])))
    assert len(out) == len(group) or len(group) == 1
    return out


def test_group_parts_partition_every_group():
    """Built a part at a time (parts of about 7 facts), every structure group holds exactly
    the queries of the whole group, each once."""
    from tasks.queries import build_group, group_parts
    from tasks.synthetic import wikidata_like

    ts = wikidata_like(600, seed=5)
    trie = StructureTrie(ts)
    split = 0
    for node in trie:
        whole = build_group(ts, trie, node)
        parts = group_parts(ts, node, 7)
        rows: list = []
        for part in parts:
            rows += list(_rows_of(build_group(ts, trie, node, part)))
        assert len(rows) == len(set(rows)) and set(rows) == _rows_of(whole)
        split += len(parts) > 1
    assert split >= 3


def test_verify_in_parts_reports_the_same(monkeypatch):
    """verify with tiny group parts reaches the same numbers as with whole groups (rows
    come in another order, so only which example is shown may differ)."""
    import verifier.passes.batches as B
    from construction.model import build
    from tasks.synthetic import wikidata_like
    from verifier.checks.report import report_json
    from verifier.checks.verify import verify

    ts = wikidata_like(1500, seed=2)
    w = build(ts).instantiate(beta=2)            # beta too small: failures, counterexamples, worst queries

    def summary():
        r = report_json(verify(ts, w, 0.01))
        for t in r["tasks"]:
            t.pop("worst_query")
        return r["verdict"], r["queries"], r["tasks"], len(r["counterexamples"]), sorted(
            (c["check"], c["task"]) for c in r["counterexamples"])

    whole = summary()
    monkeypatch.setattr(B, "GROUP_ROWS", 5)
    assert summary() == whole
    assert whole[0] == "not certified" and whole[3] > 0


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task_sets())
def test_a_group_of_one_task_is_built_as_the_general_construction(ts):
    """Where one task passes through a node, its group's CSRs of consistent tasks and valid
    next tokens are made without sorting (``_one_task``); they are the arrays the general
    construction from (row, task) pairs gives, row for row."""
    import numpy as np

    from tasks.queries import _one_task, _rows_of_tasks

    trie = StructureTrie(ts)
    seen = 0
    for node in trie:
        if not node.has_subject or len(node.tasks) != 1:
            continue
        k = node.tasks[0]
        s, o = ts.fact_ids[k]
        n = s.size
        fast = _one_task(node, k, o, n)
        general = _rows_of_tasks(node, np.arange(n), np.array([0, n]), np.full(n, k, np.int64), o, n)
        for a, b in zip(fast, general):
            assert np.array_equal(a, b)
        seen += 1
    assert seen


@given(st.lists(st.integers(-5, 40), max_size=30), st.booleans())
def test_distinct_keys_are_numpys_unique(values, increasing):
    """The group's query keys: the shortcut for strictly increasing keys gives what np.unique does."""
    import numpy as np

    from tasks.queries import _distinct

    key = np.array(sorted(set(values)) if increasing else values, np.int64)
    uniq, inverse = _distinct(key)
    want, want_inv = np.unique(key, return_inverse=True)
    assert np.array_equal(uniq, want) and np.array_equal(inverse, want_inv.reshape(-1))
    assert np.array_equal(uniq[inverse], key)


# --- object-query collisions found from shared subjects, as the pairwise search found them -------------


def _pairwise_collisions(trie, structural=False, only=None):
    """The search object_query_collisions made before it sorted subjects (every pair of tasks
    through a node compared): the reference its results must equal."""
    from tasks.model import OBJECT
    from tasks.structure import Collision, _followed_by
    import numpy as np

    taskset, out, ids, vocab, common = trie.taskset, [], trie.taskset.fact_ids, trie.taskset.vocabulary, {}
    for node in trie:
        oq = node.object_query_tasks()
        if not oq or len(node.children) < 2:
            continue
        mine = None if only is None else set(only)
        for k in oq:
            for j in node.tasks:
                if j == k or (mine is not None and k not in mine and j not in mine):
                    continue
                pair = (min(k, j), max(k, j))
                shared = common.get(pair)
                if shared is None:
                    shared = common[pair] = np.intersect1d(ids[k][0], ids[j][0], assume_unique=True)
                if shared.size == 0 and not structural:
                    continue
                if j in oq and j < k:
                    continue
                subject = vocab.token(shared[0]) if shared.size else None
                first = (k, next(t for t in node.templates[k] if _followed_by(taskset, k, t, node.depth, OBJECT)))
                out.append(Collision(node.id, trie.describe(node), first, (j, node.templates[j][0]), subject,
                                     int(shared.size)))
    return out


@st.composite
def _crowded_sets(draw):
    """Tasks over two words and four entities: templates share structures and tasks share
    subjects, so most nodes collide, often in several runs of subjects and pairs."""
    from tasks.model import OBJECT, SUBJECT, Template

    tasks = []
    for k in range(draw(st.integers(2, 7))):
        shapes = draw(st.lists(st.lists(st.sampled_from(["a", "b"]), min_size=0, max_size=2), min_size=3, max_size=3))
        templates = {}
        for _ in range(draw(st.integers(1, 3))):
            before, between, after = draw(st.sampled_from([shapes, shapes[::-1], [[], ["a"], []]]))
            t = Template(tuple(before) + (SUBJECT,) + tuple(between) + (OBJECT,) + tuple(after))
            templates[t.parts] = t
        subjects = draw(st.lists(st.sampled_from("wxyz"), min_size=1, max_size=4, unique=True))
        tasks.append(Task(f"t{k}", tuple(templates.values()), {s: draw(st.sampled_from("wxyz")) for s in subjects}))
    return TaskSet(tuple(tasks))


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_crowded_sets(), st.data())
def test_collisions_from_shared_subjects_are_the_pairwise_ones(ts, data):
    from tasks.errors import TaskError
    from tasks.structure import check_routable, count_collisions

    trie = StructureTrie(ts)
    only = data.draw(st.one_of(st.none(), st.lists(st.integers(0, len(ts.tasks) - 1), max_size=3)))
    for structural in (False, True):
        assert object_query_collisions(trie, structural, only) == _pairwise_collisions(trie, structural, only)
    want = _pairwise_collisions(trie, False, only)
    assert count_collisions(trie, only) == len(want)
    if not want:
        check_routable(ts, trie, only)
        return
    try:
        check_routable(ts, trie, only)
        raise AssertionError("routable")
    except TaskError as e:
        assert e.refs == [want[0].first, want[0].second]
        more = f" ({len(want) - 1} more such collisions)" if len(want) > 1 else ""
        assert e.problem == f"no model can route this task set: {want[0].message(ts)}{more}"


def test_thousands_of_tasks_through_one_node_are_not_compared_pair_by_pair(monkeypatch):
    """3,000 tasks with the template '⋆1 r ⋆2': routable by their subjects, and checked from
    the sort of their subjects, without intersecting their subjects pair by pair (4.5 million
    pairs, which took 19 s and 1.2 GB); with one subject in all of them, refused naming the
    first pair and the count of the others, still with no pairwise intersection."""
    import numpy as np

    from tasks.errors import TaskError
    from tasks.structure import check_routable

    calls, intersect1d = [], np.intersect1d
    monkeypatch.setattr(np, "intersect1d", lambda *a, **k: calls.append(1) or intersect1d(*a, **k))
    n = 3000
    ts = TaskSet(tuple(Task(f"t{k}", ("⋆1 r ⋆2",), {f"S{k}": "O"}) for k in range(n)))
    check_routable(ts)
    assert calls == []
    ts = TaskSet(tuple(Task(f"t{k}", ("⋆1 r ⋆2",), {"S": f"O{k}", f"S{k}": "O"}) for k in range(n)))
    try:
        check_routable(ts)
        raise AssertionError("routable")
    except TaskError as e:
        assert e.problem.endswith(f"share the object-query prefix 'S r' ({n * (n - 1) // 2 - 1} more such collisions)")
    assert len(calls) <= 1                              # the message's pair


def _sliced_trie(ts):
    """The trie as it was built before (a node per distinct prefix tuple, keyed by it):
    (symbols, parent, children, templates) per node, in id order, and the paths."""
    from tasks.structure import symbol_code

    nodes, index, paths = [], {}, {}
    for k, task in enumerate(ts.tasks):
        for ti, template in enumerate(task.templates):
            codes = tuple(symbol_code(p, ts.vocabulary) for p in template.parts)
            path, parent = [], -1
            for depth in range(1, len(codes)):
                key = codes[:depth]
                if key not in index:
                    index[key] = len(nodes)
                    nodes.append((key, parent, {}, {}))
                nid = index[key]
                nodes[nid][2].setdefault(k, set()).add(codes[depth])
                nodes[nid][3].setdefault(k, []).append(ti)
                path.append(nid)
                parent = nid
            paths[(k, ti)] = path
    return nodes, paths


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_crowded_sets(), task_sets(allow_structural_collisions=True)))
def test_the_trie_keyed_by_parent_and_symbol_is_the_trie_of_prefixes(ts):
    trie = StructureTrie(ts)
    nodes, paths = _sliced_trie(ts)
    assert [(n.symbols, n.parent, n.children, n.templates) for n in trie] == nodes
    assert trie.paths == paths
    assert all(n.depth == len(n.symbols) for n in trie)
    for n in trie:
        assert trie.node(n.symbols) is n
    assert trie.node(()) is None and trie.node((10 ** 9,)) is None


def test_a_long_template_costs_the_trie_one_node_per_word_not_its_prefixes():
    """50 templates of 1,000 words that differ in their first word: 50,000 nodes that share
    their template's symbols, where the trie held every prefix as a tuple (25 million
    symbols). The symbols of a node are made when asked for."""
    words = " ".join(f"w{i}" for i in range(997))
    ts = TaskSet((Task("t", tuple(f"a{t} {words} ⋆1 ⋆2" for t in range(50)), {"S": "O"}),))
    trie = StructureTrie(ts)
    assert len(trie) == 50 * 999
    assert len({id(n.path) for n in trie}) == 50                 # one tuple per template
    assert all(len(key) == 2 for key in trie._index)             # (parent, symbol)
    assert not any("symbols" in vars(n) for n in trie)           # none made while building and checking
    from tasks.structure import check_routable

    check_routable(ts, trie)
    assert not any("symbols" in vars(n) for n in trie)
    assert trie.nodes[-1].symbols == trie.nodes[-1].path[:999]


def test_the_task_structure_is_constructed_in_one_place_outside_the_tests():
    """Every stage takes the trie from :func:`tasks.structure.structure_of` (built once per task
    set), so the only ``StructureTrie(...)`` call of the shipped code is that function's."""
    import ast

    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("tests/", ".")) or "/." in rel:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call)
                    and getattr(node.func, "id", getattr(node.func, "attr", None)) == "StructureTrie"):
                found.append(rel)
    assert found == ["tasks/structure.py"], found


def test_a_check_builds_each_task_sets_structure_once(capitals_set, monkeypatch):
    """A whole ``check`` (routing, construction, evidence, verification, certificate) builds the
    trie of its task set once; the task sets the evidence makes (each task alone, the set
    without one) are other task sets, each with a trie of its own, built at most once."""
    from tasks.io import load_tasks
    from workflow.certificates import check_and_record
    from construction.model import build

    built: list[int] = []
    original = StructureTrie.__init__

    def counting(self, taskset):
        built.append(id(taskset))
        original(self, taskset)

    monkeypatch.setattr(StructureTrie, "__init__", counting)
    ts = load_tasks("examples/capitals.yaml")
    report, _ = check_and_record(ts, build(ts))
    assert report.certified
    assert built.count(id(ts)) == 1 and all(built.count(i) == 1 for i in built)


def test_an_edited_task_set_has_its_own_structure_and_pickles_without_it(capitals_set):
    import pickle

    trie = structure_of(capitals_set)
    assert structure_of(capitals_set) is trie and trie.taskset is capitals_set
    edited = capitals_set.without(capitals_set.tasks[0].name)
    assert structure_of(edited) is not trie and len(structure_of(edited)) < len(trie)
    assert structure_of(edited).taskset is edited
    copy = pickle.loads(pickle.dumps(capitals_set))
    assert "structure" not in copy.__dict__ and copy == capitals_set
    assert [n.symbols for n in structure_of(copy)] == [n.symbols for n in trie]
