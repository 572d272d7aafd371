"""The cluster workers' warm-up (workflow.warming) loads every compiled kernel a run uses,
in either form (verifier.arithmetic.kernel_forms): the extension, or numba's JIT dispatchers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from repository import ROOT


# In a fresh interpreter (this one has loaded kernels already): the warm-up for a precision,
# then runs of other task sets in it (and, after a float32 warm-up, in exact arithmetic
# too); after each, whether the extension is loaded and the JIT signatures of the plain
# pass's kernels called from Python (a float32 warm-up does not reach the factored exact
# pass's own; every helper is compiled inside the kernels that call it).
_SCRIPT = """
import json, sys
from construction.model import build
from tasks.io import load_tasks
from tasks.synthetic import wikidata_like
from verifier.arithmetic.kernel_forms import KERNELS
from verifier.checks.verify import verify
from verifier.passes.floating import Deployment
from verifier.running.parallel import LocalPool
from workflow.warming import warm_up

FACTORED = {"residual_part", "gate_parts", "experts_parts", "ablated_parts"}

def loaded():
    jit = {k.__name__: sorted(map(str, k._jit.signatures)) for k in KERNELS.kernels
           if k._jit is not None and k.args is not None and k.__name__ not in FACTORED}
    return {"extension": KERNELS.module not in (None, False), "jit": jit}

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


@pytest.mark.parametrize("form", ["ahead of time", "jit"])
@pytest.mark.parametrize("precision", ["exact", "float32"])
def test_the_warm_up_loads_every_kernel_a_run_uses(precision, form):
    env = {**os.environ, "MOE_KERNELS": "jit" if form == "jit" else ""}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT / "examples" / "capitals.yaml"), precision], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=env).stdout
    warm, run = json.loads(out.splitlines()[-1])
    if form == "jit":
        assert not warm["extension"] and sum(map(len, warm["jit"].values())) > 0   # it did load kernels
    elif not warm["extension"]:
        pytest.skip("no compiled extension on this machine")
    else:
        assert warm["jit"] == {}                     # every kernel call ran ahead of time
    assert run == warm
