"""The tasks file read against a certificate (workflow.since.load_since: facts files of the
same bytes taken from the certificate, edited ones read again and merged in by
tasks.compiled.FactsCache.assemble) is the task set a plain read gives: the same tasks,
facts, vocabulary and fact ids, after random edits of random task sets' facts files."""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

from workflow.certificates import check_and_save

from workflow.since import load_since, read_since
from construction.model import build
from tasks.compiled import token_map_from
from tasks.io import dump_tasks, load_tasks
from tasks.reading import task_sources
from tasks.strategies import task_sets


@settings(max_examples=examples(25), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(task_sets(max_tasks=3, max_templates=2, max_facts=6), st.data())
def test_read_against_a_certificate_is_the_plain_read(ts, data):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tasks.yaml")
        dump_tasks(ts, path, facts_dir=d)
        check_and_save(load_tasks(path), build(load_tasks(path)), os.path.join(d, "cert"), isolation=False,
                       tasks_path=path)
        files = {source.name: source.files for source in task_sources(path)[1]}
        before = {f: open(f, "rb").read() for fs in files.values() for f in fs}     # a watcher's bytes before
        entities = sorted(ts.vocabulary.entities) + ["Zz_new", "aa_new", "Ωnew"]
        for k, task in enumerate(ts.tasks):               # rewrite some facts files: change, add, drop facts
            if not files[task.name] or not data.draw(st.booleans()):       # (inline facts: not rewritten here)
                continue
            facts = dict(task.facts.items())
            for s in data.draw(st.lists(st.sampled_from(entities), max_size=3)):
                facts[s] = data.draw(st.sampled_from(entities))
            for s in data.draw(st.lists(st.sampled_from(sorted(facts)), max_size=2)):
                if len(facts) > 1:
                    facts.pop(s, None)
            with open(files[task.name][0], "w", encoding="utf-8") as f:     # (the header kept: spliced reads)
                f.write("subject\tobject\n" * data.draw(st.booleans())
                        + "".join(f"{s}\t{o}\n" for s, o in facts.items()))
        try:
            plain = load_tasks(path)
        except Exception:                                 # an edit the task set refuses: nothing to compare
            return
        old, cached, cache = load_since(path, os.path.join(d, "cert"))
        assert cached.names == plain.names
        assert cached.vocabulary == plain.vocabulary
        for a, b in zip(cached.tasks, plain.tasks):
            assert a.templates == b.templates and dict(a.facts.items()) == dict(b.facts.items())   # (order: the ids')
        for (s1, o1), (s2, o2) in zip(cached.fact_ids, plain.fact_ids):
            assert s1.tolist() == s2.tolist() and o1.tolist() == o2.tolist()
        # the old token ids' new ids, as recorded by the read, are the by-name ones
        by_name = {t: i for i, t in enumerate(plain.vocabulary.tokens)}
        want = [by_name.get(t, -1) for t in old.taskset.vocabulary.tokens]
        got = token_map_from(cached, old.taskset.vocabulary)
        assert (got is None) == (not cache.reused)          # nothing reused: a plain read, no map
        assert got is None or got.tolist() == want
        assert token_map_from(cached, plain.vocabulary) is None
        # read as a watcher reads it, against the facts files' bytes before (tasks.splice)
        from tasks.facts_files import facts_key
        previous = {os.path.abspath(f): (facts_key(f, b), b) for f, b in before.items()}
        spliced, cache = read_since(path, old, None, previous)
        assert spliced.vocabulary == plain.vocabulary
        for a, b in zip(spliced.tasks, plain.tasks):
            assert dict(a.facts.items()) == dict(b.facts.items())
        for (s1, o1), (s2, o2) in zip(spliced.fact_ids, plain.fact_ids):
            assert s1.tolist() == s2.tolist() and o1.tolist() == o2.tolist()
        assert spliced.sources.facts_keys == plain.sources.facts_keys
        assert cached.vocabulary.entity_array.tolist() == list(plain.vocabulary.entities)
        assert cached.vocabulary.tokens == plain.vocabulary.tokens
        if got is not None:          # the maps seeded from it are the ones found name by name
            from construction.numbering import correspondence, numbering, same_subjects, seed_maps

            a, b = numbering(old.taskset), numbering(cached)
            memo: dict = {}
            seed_maps(memo, old.taskset, cached, got, [(a, b)])
            same = same_subjects(old.taskset, cached, got)      # their neurons' maps: the identity, unsearched
            seeded, plain_maps = correspondence(a, b, same, memo=memo), correspondence(a, b)
            for key in ("tokens", "coords", "experts"):
                assert seeded[key].tolist() == plain_maps[key].tolist(), key
            for key in ("qk", "values", "neurons"):
                assert [m.tolist() for m in seeded[key]] == [m.tolist() for m in plain_maps[key]], key


def test_fact_ids_that_are_not_entities_are_refused(capitals_set):
    """A cached task set whose fact ids point below its entities (at a word) is refused, not
    read with the index wrapped round to another entity."""
    import numpy as np
    import pytest

    from tasks.compiled import FactsCache
    from tasks.errors import TaskError
    from tasks.model import TaskSet

    ts = capitals_set
    v = ts.vocabulary
    s, o = ts.fact_ids[0]
    bad = TaskSet.trusted(ts.tasks, v.words, v.entities, ((np.r_[0, s[1:]], o),) + ts.fact_ids[1:])
    cache = FactsCache(bad, {})
    cache.reused = set(bad.names)
    with pytest.raises(TaskError, match="fact ids that are not"):
        cache.assemble(list(bad.tasks), None, {}, None)
    cache = FactsCache(ts, {})
    cache.reused = set(ts.names)
    assert cache.assemble(list(ts.tasks), None, {}, None).vocabulary == v


def _rewrite_keeping_the_times(path: str, text: str) -> None:
    """Write ``text`` (of the file's length) over ``path`` and put its access and modification
    times back: what a file system with coarse timestamps shows of a quick rewrite."""
    st_ = os.stat(path)
    with open(path, "r+", encoding="utf-8") as f:
        f.write(text)
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))


PARIS, LYONS = "France\tParis\nJapan\tTokyo\n", "France\tLyons\nJapan\tTokyo\n"     # the same length


def _capitals(d: str) -> str:
    path = os.path.join(d, "tasks.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write("tasks:\n  - name: capital\n    templates: [the capital of *1 is *2]\n    facts_file: c.tsv\n"
                "  - name: continent\n    templates: [the continent of *1 is *2]\n    facts: {France: Europe}\n")
    with open(os.path.join(d, "c.tsv"), "w", encoding="utf-8") as f:
        f.write(PARIS)
    return path


def _capital_of_france(path: str, cert: str) -> str:
    _, taskset, _ = load_since(path, cert)
    return taskset.tasks[taskset.index("capital")].facts["France"]


def test_a_full_check_records_the_key_of_the_bytes_it_parsed(tmp_path):
    """The facts file rewritten after the load and before the certificate is made (unseen by
    timestamps): the certificate pairs its facts with the hash of the bytes they came from,
    so the next read parses the file again instead of taking the old facts for the new bytes."""
    path, cert = _capitals(str(tmp_path)), str(tmp_path / "cert")
    ts = load_tasks(path)
    assert ts.sources.facts_keys["capital"] and ts.sources.facts_keys["continent"] == ()
    _rewrite_keeping_the_times(os.path.join(tmp_path, "c.tsv"), LYONS)
    check_and_save(ts, build(ts), cert, isolation=False, tasks_path=path)
    assert _capital_of_france(path, cert) == "Lyons"


def test_a_re_read_records_the_key_of_the_bytes_it_parsed(tmp_path, monkeypatch):
    """The facts file changed between the cache's hash (a miss) and the parse: the recorded
    key is the parsed bytes', so changing the file back to the hashed bytes is seen as an edit."""
    import tasks.reading as reading
    from workflow.since import check_since

    path, cert = _capitals(str(tmp_path)), str(tmp_path / "cert")
    facts = os.path.join(tmp_path, "c.tsv")
    check_and_save(load_tasks(path), build(load_tasks(path)), cert, isolation=False, tasks_path=path)
    _rewrite_keeping_the_times(facts, LYONS)
    real = reading.facts_file_bytes

    def reverted_before_the_parse(*args):
        _rewrite_keeping_the_times(facts, PARIS)      # hashed as LYONS, parsed as PARIS
        return real(*args)

    monkeypatch.setattr(reading, "facts_file_bytes", reverted_before_the_parse)
    old, taskset, cache = load_since(path, cert)
    monkeypatch.setattr(reading, "facts_file_bytes", real)
    assert taskset.tasks[taskset.index("capital")].facts["France"] == "Paris"
    check_since(taskset, cert, old=old, cache=cache, isolation=False, tasks_path=path)
    _rewrite_keeping_the_times(facts, LYONS)
    assert _capital_of_france(path, cert) == "Lyons"
