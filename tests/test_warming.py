"""The cluster workers' warm-up (workflow.warming) loads every compiled kernel a run uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# In a fresh interpreter (this one has loaded kernels already): the warm-up for a precision,
# then runs of other task sets in it (and, after a float32 warm-up, in exact arithmetic
# too); the kernels' signatures after each.
_SCRIPT = """
import json, sys
from numba.core.registry import CPUDispatcher
from construction.model import build
from tasks.io import load_tasks
from tasks.synthetic import wikidata_like
from verifier.arithmetic import kernels
from verifier.checks.verify import verify
from verifier.passes.floating import Deployment
from verifier.running.parallel import LocalPool
from workflow.warming import warm_up

def loaded():
    return {n: sorted(map(str, f.signatures)) for n, f in vars(kernels).items() if isinstance(f, CPUDispatcher)}

deployment = None if sys.argv[2] == "exact" else Deployment.named(sys.argv[2])
warm_up(deployment)
after_warm_up = loaded()
for ts in (wikidata_like(1500, seed=3), load_tasks(sys.argv[1])):
    model = build(ts)
    weights = model.instantiate()
    for each in {None, deployment}:
        verify(ts, weights, model.epsilon, executor=LocalPool(1), deployment=each)
print(json.dumps([after_warm_up, loaded()]))
"""


@pytest.mark.parametrize("precision", ["exact", "float32"])
def test_the_warm_up_loads_every_kernel_a_run_uses(precision):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT / "examples" / "capitals.yaml"), precision], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    warm, run = json.loads(out.splitlines()[-1])
    assert sum(map(len, warm.values())) > 0           # the warm-up did load kernels
    assert {n: s for n, s in run.items() if s != warm[n]} == {}
