"""Re-certification against inputs an adversarial review built: each case once gave a
verdict, counts or facts other than a full check's; each now gives the full check's.

* weights whose vocabulary names two rows the other way round (no array changed);
* certificate.json edited by hand (its ε), and an ε changed in the tasks file;
* a facts file renamed from .tsv to .csv (same bytes, other facts);
* a subject just before a cell boundary leaving the vocabulary, and a boundary name longer
  than every entity left;
* a new name longer than every token the certificate knew (the facts cache cut it short).
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np

from workflow.certificates import check_and_save

from workflow.since import check_since
from cli.main import main
from construction.model import build
from construction.numbering import correspondence, numbering
from tasks.editing import Edit, apply
from tasks.io import load_tasks
from tasks.model import Facts, Task, TaskSet
from verifier.certificates.certificate import load_certificate
from verifier.certificates.incremental import recertify
from verifier.certificates.locality import Correspondence
from verifier.checks.classes import FLOATS
from verifier.checks.verify import verify
from repository import EXAMPLES


def _counts(report) -> list:
    return [(t.name, t.queries, t.object_queries, t.misrouted, t.over_epsilon, t.ablation_broken) for t in report.tasks]


def _facts_set(spec) -> TaskSet:
    return TaskSet(tuple(Task(n, tuple(t), Facts(list(f.items()))) for n, t, f in spec), 0.01, {})


def _since_equals_full(ts: TaskSet, new: TaskSet, tmp_path: Path) -> dict:
    d = str(tmp_path / "cert")
    model = build(ts)
    check_and_save(ts, model, d, isolation=False)
    inc, _ = check_since(new, d, isolation=False)
    full = verify(new, build(new, beta=float(model.beta), gamma=float(model.gamma)).instantiate(), model.epsilon)
    assert inc.verdict == full.verdict and _counts(inc) == _counts(full)
    assert inc.queries == full.queries and np.array_equal(inc.routing_matrix, full.routing_matrix)
    for a, b in zip(inc.tasks, full.tasks):
        assert a.worst_error_lower <= b.worst_error and b.worst_error_lower <= a.worst_error
    return inc.incremental


def _certified_capitals(tmp_path: Path):
    """(task set, model, its certificate, the same weights built again): capitals.yaml."""
    ts = load_tasks(EXAMPLES / "capitals.yaml")
    d = str(tmp_path / "cert")
    model = build(ts)
    check_and_save(ts, model, d, isolation=False)
    return ts, model, load_certificate(d), build(ts, beta=float(model.beta), gamma=float(model.gamma)).instantiate()


def test_renamed_vocabulary_rows_are_not_taken_for_unchanged_ones(tmp_path):
    ts, model, old, w = _certified_capitals(tmp_path)
    vocab = list(w.vocab)
    i, j = vocab.index("Paris"), vocab.index("Berlin")
    vocab[i], vocab[j] = vocab[j], vocab[i]
    swapped = w.replace(vocab=tuple(vocab))
    full = verify(ts, swapped, model.epsilon)
    assert not full.certified                          # each capital now reads the other's row
    cor = Correspondence(**correspondence(numbering(old.taskset), numbering(ts)))
    report, _, _, info = recertify(old, ts, swapped, cor, model.epsilon)
    assert report is None and info.mode == "full" and "vocabulary" in info.reason


def test_renamed_experts_are_not_taken_for_unchanged_ones(tmp_path):
    ts, model, old, w = _certified_capitals(tmp_path)
    names = list(w.expert_tasks)
    names[0], names[1] = names[1], names[0]
    swapped = w.replace(expert_tasks=tuple(names))
    assert not verify(ts, swapped, model.epsilon).certified     # every query now routed to the other's name
    cor = Correspondence(**correspondence(numbering(old.taskset), numbering(ts)))
    report, _, _, info = recertify(old, ts, swapped, cor, model.epsilon)
    assert report is None and info.mode == "full" and "experts" in info.reason


def test_an_edited_certificate_json_is_refused(tmp_path, capsys):
    path = tmp_path / "tasks.yaml"
    path.write_text((EXAMPLES / "capitals.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet", "--no-isolation"]) == 0
    manifest = json.loads((cert / "certificate.json").read_text(encoding="utf-8"))
    manifest["epsilon"] = 1e-7
    (cert / "certificate.json").write_text(json.dumps(manifest), encoding="utf-8")
    capsys.readouterr()
    assert main(["check", str(path), "--since", str(cert)]) == 2
    err = capsys.readouterr().err
    assert "certificate.json does not match its recorded SHA-256" in err and err.count("\n") == 1


def test_reused_classes_are_compared_with_the_current_epsilon(tmp_path):
    """Even with a certificate whose ε was changed in memory (the counts recorded at another
    ε), the verdict compares the stored enclosures with the ε asked for."""
    ts = load_tasks(EXAMPLES / "capitals.yaml")
    d = str(tmp_path / "cert")
    model = build(ts)
    check_and_save(ts, model, d, isolation=False)
    old = load_certificate(d)
    tight = 1e-7
    old.epsilon = tight
    w = build(ts, beta=float(model.beta), gamma=float(model.gamma)).instantiate()
    cor = Correspondence(**correspondence(numbering(old.taskset), numbering(ts)))
    report, _, _, info = recertify(old, ts, w, cor, tight)
    assert info.mode == "incremental" and info.queries_rerun > 0
    full = verify(ts, w, tight)
    assert report.verdict == full.verdict == "not certified" and _counts(report) == _counts(full)


def test_epsilon_changed_in_the_tasks_file_is_honoured(tmp_path, capsys):
    path = tmp_path / "tasks.yaml"
    text = (EXAMPLES / "capitals.yaml").read_text(encoding="utf-8")
    assert "epsilon: 0.01" in text
    path.write_text(text, encoding="utf-8")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet", "--no-isolation"]) == 0
    path.write_text(text.replace("epsilon: 0.01", "epsilon: 0.0000001"), encoding="utf-8")
    capsys.readouterr()
    # the certificate's parameters were chosen by the construction, so they are chosen anew for the
    # new epsilon: a full check, as a full check of the edited file gives (docs/editing.md)
    assert main(["check", str(path), "--since", str(cert), "--no-isolation", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["epsilon"] == 1e-7 and data["verdict"] == "certified"
    assert data["incremental"]["mode"] == "full" and "epsilon changed" in data["incremental"]["reason"]
    assert "chosen anew" in data["incremental"]["reason"]
    # with gamma pinned in the file it stays, the check fails, and the report names the pin
    path.write_text(text.replace("epsilon: 0.01", "epsilon: 0.0000001")
                    .replace("tasks:", "parameters:\n  gamma: 8\ntasks:", 1), encoding="utf-8")
    assert main(["check", str(path), "--since", str(cert), "--no-isolation", "--json", "-"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "not certified"
    assert any("gamma = 8 (pinned in" in n and "would choose" in n for n in data["notes"]), data["notes"]


TWO_TASKS = ("epsilon: 0.01\ntasks:\n  - name: capital\n    templates:\n      - the capital of *1 is *2\n"
             "    facts_file: {file}\n  - name: continent\n    templates:\n      - the continent of *1 is *2\n"
             "    facts:\n      France: Europe\n      Japan: Asia\n")


def _json_check(args, capsys) -> dict:
    code = main(["check", *args, "--no-isolation", "--json", "-"])
    assert code in (0, 1)
    return json.loads(capsys.readouterr().out)


def test_a_facts_file_renamed_to_csv_is_read_again(tmp_path, capsys):
    # as TSV: three facts with subjects 'France,' 'France' 'Japan,'; as CSV: other splits
    (tmp_path / "cap.tsv").write_text("France,\tParis\nFrance\t,Paris\nJapan,\tTokyo\n", encoding="utf-8")
    path = tmp_path / "tasks.yaml"
    path.write_text(TWO_TASKS.format(file="cap.tsv"), encoding="utf-8")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet", "--no-isolation"]) == 0
    (tmp_path / "cap.tsv").rename(tmp_path / "cap.csv")
    path.write_text(TWO_TASKS.format(file="cap.csv"), encoding="utf-8")
    capsys.readouterr()
    since = _json_check([str(path), "--since", str(cert)], capsys)
    params = load_certificate(cert).weights.parameters
    full = _json_check([str(path), "--beta", str(float(Fraction(params["beta"]))),
                        "--gamma", str(float(Fraction(params["gamma"])))], capsys)
    assert [(t["name"], t["queries"]) for t in since["tasks"]] == [(t["name"], t["queries"]) for t in full["tasks"]]
    assert since["verdict"] == full["verdict"]


def test_a_subject_just_before_a_cell_boundary_leaves(tmp_path):
    facts = {f"e{i:04d}": f"o{i % 5}" for i in range(600)}
    ts = _facts_set([("rel", ["the rel of ⋆1 is ⋆2"], facts),
                     ("other", ["where is ⋆1 ? ⋆2"], {"e0001": "o1", "o3": "o4"})])
    edited = dict(facts)
    del edited["e0255"]                      # the cell boundary is e0256 (256 queries a cell)
    info = _since_equals_full(ts, _facts_set([("rel", ["the rel of ⋆1 is ⋆2"], edited),
                                              ("other", ["where is ⋆1 ? ⋆2"], {"e0001": "o1", "o3": "o4"})]), tmp_path)
    assert info["mode"] == "incremental"


def test_a_boundary_name_longer_than_every_entity_left(tmp_path):
    names = [f"S{i:04d}" for i in range(256)] + ["S0255x"] + [f"S{i:04d}" for i in range(256, 300)]
    facts = {s: f"O{i % 3}" for i, s in enumerate(names)}
    edited = dict(facts)
    del edited["S0255x"]                     # the boundary, and the only name of six characters
    info = _since_equals_full(_facts_set([("rel", ["the rel of ⋆1 is ⋆2"], facts)]),
                              _facts_set([("rel", ["the rel of ⋆1 is ⋆2"], edited)]), tmp_path)
    assert info["mode"] == "incremental" and info["queries_rerun"] > 0


def test_a_new_name_longer_than_every_old_token(tmp_path, capsys):
    """The facts cache merges the edited tasks' names into the certificate's sorted ones: a
    name longer than every old token must keep its length (it was once cut to the old width)."""
    (tmp_path / "a.tsv").write_text("subject\tobject\nab\tcd\nef\tgh\n", encoding="utf-8")
    (tmp_path / "b.tsv").write_text("subject\tobject\nij\tkl\n", encoding="utf-8")
    path = tmp_path / "tasks.yaml"
    path.write_text("tasks:\n  - name: capital\n    templates: [the capital of *1 is *2]\n    facts_file: a.tsv\n"
                    "  - name: other\n    templates: [the other of *1 is *2]\n    facts_file: b.tsv\n",
                    encoding="utf-8")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet", "--no-isolation"]) == 0
    with open(tmp_path / "b.tsv", "a", encoding="utf-8") as f:
        f.write("mnopqrstuv\twxyzlongname\n")
    capsys.readouterr()
    since = _json_check([str(path), "--since", str(cert)], capsys)
    assert since["incremental"]["mode"] == "incremental"
    params = load_certificate(cert).weights.parameters
    full = _json_check([str(path), "--beta", str(float(Fraction(params["beta"]))),
                        "--gamma", str(float(Fraction(params["gamma"])))], capsys)
    assert [(t["name"], t["queries"], t["facts"]) for t in since["tasks"]] == \
        [(t["name"], t["queries"], t["facts"]) for t in full["tasks"]]
    assert since["verdict"] == full["verdict"]


# --- "unchanged" rests on an injective encoding (issue 32) -------------------------------------

#: Facts of task 't' before and after an edit whose fact bytes, joined as "subject \x02 object
#: \x03" (the hash of certificate format 2), are the same; the other facts keep every name of
#: both versions in the vocabulary, so that the vocabulary is unchanged too and an unedited
#: task's expert would be kept as it was.
STALE_OLD = {"a": "x\x03c\x02y", "c": "z"}
STALE_NEW = {"a": "x", "c": "y\x03c\x02z"}
STALE_OTHERS = {"p1": "x", "p2": "z", "p3": "x\x03c\x02y", "p4": "y\x03c\x02z"}


def _stale_set(facts: dict) -> TaskSet:
    """The task set with 't' holding ``facts``, built in Python past the readers (which refuse
    names with control characters): what the task hash must tell apart by itself."""
    from tasks.model import Template

    f = {**facts, **STALE_OTHERS}
    t = Task("t", (Template.parse("the value of *1 is *2"),), Facts.trusted(tuple(f), tuple(f.values())))
    u = Task("u", (Template.parse("u of *1 gives *2"),), Facts({"m": "n", "o": "p"}))
    return TaskSet((t, u), 0.01, {})


def test_task_hash_tells_apart_facts_whose_joined_bytes_agree():
    from verifier.certificates.certificate import task_hash

    old, new = _stale_set(STALE_OLD), _stale_set(STALE_NEW)
    assert old.tasks[0].facts != new.tasks[0].facts
    assert task_hash(old.tasks[0]) != task_hash(new.tasks[0])
    assert task_hash(old.tasks[0], old) != task_hash(new.tasks[0], new)
    assert task_hash(old.tasks[1], old) == task_hash(new.tasks[1], new) == task_hash(new.tasks[1])


def test_a_re_certification_never_keeps_the_expert_of_facts_that_changed():
    from workflow.certificates import check_and_record
    from workflow.since import recertify_since

    old, new = _stale_set(STALE_OLD), _stale_set(STALE_NEW)
    model = build(old)
    _, cert = check_and_record(old, model, isolation=False)
    assert cert.certified
    stale = verify(new, cert.weights, model.epsilon)
    assert not stale.certified                     # the old weights answer 'a' with the old object
    report, edited, after = recertify_since(new, old=cert, isolation=False)
    assert edited == ["t"]
    assert report.verdict == verify(new, after.weights, model.epsilon).verdict == "certified"


def test_names_with_control_characters_are_refused_before_and_after_an_edit(tmp_path, capsys):
    from workflow.certificates import check_and_record
    from verifier.certificates.certificate import save_certificate

    facts = tmp_path / "t.tsv"
    path = tmp_path / "tasks.yaml"
    path.write_text("epsilon: 0.01\ntasks:\n  - name: t\n    templates: ['the value of *1 is *2']\n"
                    "    facts_file: t.tsv\n  - name: u\n    templates: ['u of *1 gives *2']\n"
                    "    facts: {m: n, o: p}\n", encoding="utf-8")

    def write(version: dict) -> None:
        facts.write_text("".join(f"{s}\t{o}\n" for s, o in {**version, **STALE_OTHERS}.items()), encoding="utf-8")

    write(STALE_OLD)
    cert = tmp_path / "cert"
    capsys.readouterr()
    assert main(["check", str(path), "--certificate", str(cert), "--quiet", "--no-isolation"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{facts}:1:" in err and "U+0003" in err and "remove it" in err
    assert not cert.exists()
    # a certificate of the old facts made past the reader; the edit is refused as the full read is
    old = _stale_set(STALE_OLD)
    save_certificate(check_and_record(old, build(old), isolation=False)[1], cert)
    before = {p.name: p.read_bytes() for p in cert.iterdir()}
    write(STALE_NEW)
    assert main(["check", str(path), "--since", str(cert), "--quiet", "--no-isolation"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{facts}:2:" in err and "U+0003" in err
    assert {p.name: p.read_bytes() for p in cert.iterdir()} == before


def _older_format(cert: Path) -> None:
    """Make the certificate in ``cert`` one of format 2 (its hashes another encoding's)."""
    manifest = json.loads((cert / "certificate.json").read_text(encoding="utf-8"))
    manifest["format"] = "moe-knowledge-certificate/2"
    (cert / "certificate.json").write_text(json.dumps(manifest), encoding="utf-8")


def test_a_certificate_of_an_older_format_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "tasks.yaml"
    path.write_text((EXAMPLES / "capitals.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    cert = tmp_path / "cert"
    assert main(["check", str(path), "--certificate", str(cert), "--quiet", "--no-isolation"]) == 0
    _older_format(cert)
    capsys.readouterr()
    assert main(["check", str(path), "--since", str(cert), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "moe-knowledge-certificate/2, written by another version" in err
    assert "--certificate DIR" in err


def test_a_class_without_a_zero_logit_rival_is_run_again_when_the_vocabulary_changes(tmp_path):
    """The L2 gap of a reused class may keep its value across an edit that adds or removes
    tokens only while some other token of logit exactly 0 stays a rival on both sides. A
    certificate whose classes record no such rival (as a trained model's would) must have its
    object classes run again after an edit that grows the vocabulary, and still give a full
    check's verdict and counts."""
    ts = load_tasks(EXAMPLES / "capitals.yaml")
    d = str(tmp_path / "cert")
    model = build(ts, gamma=10)          # room below epsilon, so that the grown vocabulary decides nothing
    check_and_save(ts, model, d, isolation=False)
    new, _ = apply(ts, Edit("capital", set=(("Spain", "Madrid"),)))     # two new entities

    def rerun(zero_rivals: bool) -> tuple:
        old = load_certificate(d)
        if not zero_rivals:
            col = {name: i for i, name in enumerate(FLOATS)}
            old.table.floats[:, col["ab_zeros"]] = 0.0
        w = build(new, beta=float(model.beta), gamma=float(model.gamma)).instantiate()
        c = Correspondence(**correspondence(numbering(old.taskset), numbering(new)))
        report, _, _, info = recertify(old, new, w, c, model.epsilon)
        return report, info, w

    kept, info_kept, w = rerun(True)
    forced, info_forced, _ = rerun(False)
    assert info_kept.mode == info_forced.mode == "incremental" and info_kept.vocabulary_delta > 0
    assert info_forced.queries_rerun > info_kept.queries_rerun
    assert info_forced.classes_reused < info_kept.classes_reused
    full = verify(new, w, model.epsilon)
    for report in (kept, forced):
        assert report.verdict == full.verdict and _counts(report) == _counts(full)
