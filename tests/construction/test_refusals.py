"""Refusals name their proof, and inspect's suggested changes are real.

* every refusal of the construction is one of the documented kinds (construction.remedies):
  ill-posed (no model), no gate with an exact certificate, no gate found (not proven), a
  template too long;
* a certificate is checked here a second time, independently: Σ y_r (g_w − g_j)(prefix_r)
  is recomputed for random gates of the family and is exactly 0;
* every change ``inspect`` suggests, applied to the set, makes it constructible, and
  ``inspect`` on a refused set prints the refusal, what is proven and the changes (exit 2).
"""

from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from budget import examples

from cli.main import main
from construction.gate import RoutingError
from construction.model import build, route
from construction.remedies import diagnose, smallest_changes, summarize
from construction.residual import symbol_label
from tasks.model import Task, TaskSet
from tasks.strategies import ill_posed_task_sets
from tasks.structure import SUBJ, StructureTrie

XOR = TaskSet((Task("a", ("p p ⋆1 ⋆2", "q q ⋆1 ⋆2"), {"x1": "y1"}),
               Task("b", ("p q ⋆1 ⋆2", "q p ⋆1 ⋆2"), {"x2": "y2"})))
#: The same XOR after ⋆1, with a subject both tasks share: 'p p x' and 'p q x' must be told apart.
XOR_SHARED_SUBJECT = TaskSet((Task("a", ("⋆1 p p ⋆2", "⋆1 q q ⋆2"), {"x": "y1", "z": "w"}),
                              Task("b", ("⋆1 p q ⋆2", "⋆1 q p ⋆2"), {"x": "y2", "u": "v"})))
#: Three-symbol XOR-like pattern over two positions (a Latin square: each symbol once per row and column).
LATIN = TaskSet((Task("a", ("p p ⋆1 ⋆2", "q r ⋆1 ⋆2", "r q ⋆1 ⋆2"), {"x1": "y"}),
                 Task("b", ("p q ⋆1 ⋆2", "q p ⋆1 ⋆2", "r r ⋆1 ⋆2"), {"x2": "y"}),
                 Task("c", ("p r ⋆1 ⋆2", "q q ⋆1 ⋆2", "r p ⋆1 ⋆2"), {"x3": "y"})))


def _certificate(ts: TaskSet):
    with pytest.raises(RoutingError) as info:
        route(ts)
    cert = info.value.certificate
    assert cert is not None, str(info.value)
    return cert, str(info.value)


def _random_gate_margin_sum(ts: TaskSet, cert, rng: random.Random) -> Fraction:
    """Σ_r y_r (g_w − g_j)(prefix_r) for one random gate of the family, in exact fractions:
    slot weights W[k][(m, symbol)], biases b[k], subject weights λ[k], all random rationals."""
    trie = StructureTrie(ts)
    W: dict = {}
    draw = lambda: Fraction(rng.randint(-50, 50), rng.randint(1, 9))  # noqa: E731
    b = [draw() for _ in ts.tasks]
    lam = [draw() for _ in ts.tasks]
    subjects = [set(t.facts.subjects) for t in ts.tasks]
    vocab = ts.vocabulary

    def g(k: int, term) -> Fraction:
        node = trie.nodes[term.node]
        total = b[k]
        for m, code in enumerate(node.symbols, start=1):
            total += W.setdefault((k, m, symbol_label(code, ts)), draw())
        if SUBJ in node.symbols and vocab.token(term.subject) in subjects[k]:
            total += lam[k]
        return total

    return sum((t.weight * (g(t.winner, t) - g(t.rival, t)) for t in cert.terms), Fraction(0))


@pytest.mark.parametrize("ts, plain", [(XOR, True), (XOR_SHARED_SUBJECT, False), (LATIN, True)])
def test_certificates_are_proofs(ts, plain):
    cert, message = _certificate(ts)
    assert cert.plain == plain
    assert sum(t.weight for t in cert.terms) == 1 and all(t.weight > 0 for t in cert.terms)
    rng = random.Random(0)
    for _ in range(50):
        assert _random_gate_margin_sum(ts, cert, rng) == 0       # every gate: the weighted margins cancel
    assert "exact certificate" in message
    assert ("no gate linear in it routes them at any beta" in message) == plain
    # every determined prefix in the certificate is routed to its own task by the definition
    for t in cert.terms:
        assert t.winner != t.rival


def test_a_certificate_is_not_found_where_a_gate_exists():
    """The shared-template and mixed-prefix sets route; nothing is refused."""
    for ts in (TaskSet((Task("a", ("⋆1 is ⋆2",), {"x": "y"}), Task("b", ("⋆1 is ⋆2",), {"y": "z"}))),
               TaskSet((Task("b", ("p q ⋆1 ⋆2", "r s ⋆1 ⋆2"), {"x2": "y2"}), Task("a", ("p s ⋆1 ⋆2",), {"x1": "y1"})))):
        route(ts)
        assert diagnose(ts) is None and smallest_changes(ts) == []


@pytest.mark.parametrize("ts", [XOR, XOR_SHARED_SUBJECT, LATIN])
def test_suggested_changes_make_the_set_constructible(ts):
    changes = smallest_changes(ts)
    assert changes and (ts is LATIN or all(c.size == 1 for c in changes))    # the Latin square needs two
    for c in changes:
        build(c.result())                       # raises if the edit did not help
    assert len(summarize(changes)) <= 6


@settings(max_examples=examples(40), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(ill_posed_task_sets(max_tasks=3, max_templates=2, max_facts=4, max_template_length=5))
def test_ill_posed_sets_get_checked_changes(tasks):
    ts = TaskSet(tasks)
    refusal = diagnose(ts)
    assert refusal is not None and refusal.kind == "ill-posed" and "every model" in refusal.proven
    changes = smallest_changes(ts)
    assert changes, "no change found"
    for c in changes[:5]:
        assert diagnose(c.result()) is None     # each change checked again, independently of the search
    assert changes == sorted(changes, key=lambda c: c.size) or len(changes) == 1


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "tasks.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


XOR_YAML = ("tasks:\n  - name: a\n    templates: [p p *1 *2, q q *1 *2]\n    facts: {x1: y1}\n"
            "  - name: b\n    templates: [p q *1 *2, q p *1 *2]\n    facts: {x2: y2}\n")
ILL_YAML = ("tasks:\n  - name: city\n    templates: [\"*1 is located in *2\"]\n"
            "    facts: {Paris: France, Lyon: France}\n  - name: country\n    templates: [\"*1 is located in *2\"]\n"
            "    facts: {France: Europe, Paris: Europe}\n")


def test_inspect_explains_a_proven_refusal(tmp_path, capsys):
    path = _write(tmp_path, XOR_YAML)
    assert main(["inspect", path]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("not constructible (no gate (proven)):")
    assert "proven: no gate linear in this construction's residual stream" in out
    assert "1. remove template 'p p ⋆1 ⋆2' from task 'a' (line 3)" in out
    assert err.count("\n") == 1 and err.startswith("error: ")


def test_inspect_explains_an_ill_posed_set_and_check_points_to_it(tmp_path, capsys):
    path = _write(tmp_path, ILL_YAML)
    assert main(["inspect", path, "--json", "-"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["constructible"] is False and data["refusal"]["kind"] == "ill-posed"
    edits = [e["edit"] for c in data["changes"] for e in c["edits"]]
    assert "remove the fact of 'Paris' from task 'city'" in edits
    assert all(c["size"] >= 1 for c in data["changes"])
    assert main(["check", path]) == 2
    err = capsys.readouterr().err
    assert "no model can route this task set" in err and f"'python -m verifier inspect {path}'" in err


@pytest.mark.parametrize("bad", [b"Paris", 7, None])
def test_weights_whose_vocabulary_is_not_strings_are_refused(capitals_set, bad):
    """validate checks every token's type (per type, in bulk): one token that is not a str
    is refused; a str subclass is a str."""
    from tasks.errors import TaskError

    w = build(capitals_set).instantiate()
    w.replace(vocab=tuple(type("Name", (str,), {})(t) for t in w.vocab)).validate()
    with pytest.raises(TaskError, match="vocab must be a tuple of strings"):
        w.replace(vocab=w.vocab[:-1] + (bad,)).validate()


@pytest.mark.parametrize("bad", [b"subj:Paris", 7, None])
def test_weights_whose_labels_are_not_strings_are_refused(capitals_set, bad):
    """validate checks the residual's and each expert's neuron labels by type, in bulk, as
    the vocabulary: one label that is not a str is refused, a str subclass is a str."""
    from tasks.errors import TaskError

    w = build(capitals_set).instantiate()
    Name = type("Name", (str,), {})
    w.replace(residual_labels=tuple(map(Name, w.residual_labels)),
              neuron_labels=tuple(tuple(map(Name, labels)) for labels in w.neuron_labels)).validate()
    with pytest.raises(TaskError, match="residual_labels has"):
        w.replace(residual_labels=w.residual_labels[:-1] + (bad,)).validate()
    with pytest.raises(TaskError, match=r"neuron_labels\[1\] has"):
        w.replace(neuron_labels=(w.neuron_labels[0], w.neuron_labels[1][:-1] + (bad,)) + w.neuron_labels[2:]).validate()


def test_what_was_checked_of_a_vocabulary_is_not_carried_to_another(capitals_set):
    """validate remembers its vocabulary verdict per tuple object (layout.weights): a copy with
    the same tuple keeps it, a copy with another tuple (a token repeated) is checked anew,
    as is the repeated token in token_ids' fast path."""
    from tasks.errors import TaskError

    w = build(capitals_set).instantiate()
    w.validate()
    assert w.replace(E=w.E).__dict__["_vocab_memo"][0] is w.vocab          # carried: the same tuple
    repeated = w.vocab[:-1] + (w.vocab[0],)
    twice = w.replace(vocab=repeated)
    assert "_vocab_memo" not in twice.__dict__
    with pytest.raises(TaskError, match="vocab has repeated tokens"):
        twice.validate()
    ids = twice.token_ids(repeated[:3])        # not the in-order shortcut: the repeat's last place
    assert ids[0] == len(repeated) - 1 and ids[1:].tolist() == [1, 2]
