"""The runner (verifier.running.runner): one table says which pass runs where and with what, and its
refusals are the ones every entry point gives; a cut of the weights runs a batch as the full
weights do (the rows it cannot answer are run again over them)."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from tasks.errors import TaskError
from verifier.passes.batches import batches
from verifier.passes.floating import Deployment
from verifier.running.parallel import LocalPool
from verifier.running.runner import COMBINATIONS, PassSpec, Runner, require_allowed
from verifier.checks.verify import token_map, verify


class _Cluster:
    """Stands for an executor whose workers do not share memory (never asked to run here)."""

    shares_memory = False
    shards = 2


def test_the_table_names_every_combination():
    assert set(COMBINATIONS) == set(itertools.product(("exact", "float"), ("local", "cluster"), (False, True)))
    assert COMBINATIONS[("exact", "local", True)] is None and COMBINATIONS[("exact", "cluster", False)] is None


@pytest.mark.parametrize("kind,where,classes", [k for k, v in COMBINATIONS.items() if v is not None])
def test_each_refusal_comes_from_the_table(capitals_set, capitals_model, kind, where, classes):
    spec = PassSpec(Deployment.named("float32") if kind == "float" else None)
    executor = _Cluster() if where == "cluster" else LocalPool(1)
    refusal = COMBINATIONS[(kind, where, classes)]
    with pytest.raises(TaskError, match=re.escape(refusal.why)):
        require_allowed(spec, executor, classes)
    if not classes:          # verify itself refuses with the same words
        with pytest.raises(TaskError, match=re.escape(refusal.why)):
            verify(capitals_set, capitals_model.instantiate(), 0.01, executor=executor, deployment=spec.deployment)


@pytest.mark.parametrize("answers", [False, True])
def test_a_cut_runs_a_batch_as_the_full_weights_do(capitals_set, capitals_model, answers):
    """One expert and the tokens of the queries: the rows inside the cut give the full pass's
    numbers bit for bit, the others are deferred and run over the full weights (``answers``:
    with U leaning France towards Paris and Berlin, so that the localization gaps are not ties)."""
    w = capitals_model.instantiate()
    if answers:
        U = w.U.tolil()
        for token, value in (("Paris", 3.5), ("Berlin", 3.7)):
            U[w.vocab.index(token), w.residual_labels.index("subj:France")] = value
        w = w.replace(U=U.tocsr())
    tmap = token_map(capitals_set, w)
    todo = list(batches(capitals_set))
    runner = Runner(w, tmap)
    inputs = np.unique(np.concatenate([tmap[b.tokens].reshape(-1) for b in todo]))
    part = runner.part(np.array([0]), inputs, np.union1d(inputs, np.concatenate([tmap[b.valid] for b in todo])))
    cut = list(runner.run_cut(todo, part))
    full = list(Runner(w, tmap).run(todo))
    assert runner.deferred > 0
    for (b1, r1), (b2, r2) in zip(cut, full):
        assert b1 is b2
        for field in ("expert", "margin", "err_lo", "err_hi", "ablated_lo", "ablated_hi", "predicted",
                      "ablated_gap", "ablated_zeros"):
            assert np.array_equal(getattr(r1, field), getattr(r2, field), equal_nan=True), field
