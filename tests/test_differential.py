"""The differential tester (audit.differential): PyTorch, ONNX Runtime and the numpy
emulator against the float certificates, on tiny adversarial models.

Two classes of executions fell outside the earlier mixed-precision (``--accumulate``)
enclosures, and the tester found both by its own search: softmax intermediates stored in the
format (class 1) and the residual summed head by head with each addition stored (class 2).
The execution model (verifier/passes/execution.py) now counts every stored intermediate; their
regression instances and the mixed-precision property hold."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from audit.deployed import Deployed, round_in
from audit.differential import (COVERS, MOTIFS, Runner, TorchConfig, alternatives, cases, causes, certificate, check,
                                compare, flushing, main, make_case, residual_heads_model, run_torch, runners, search,
                                softmax_equal_model, subnormal_model, torch_runner)
from layout.formats import FORMATS

PURE = ("float32", "bfloat16")
MIXED = ("bfloat16+float32", "float32+float64")


@pytest.fixture(scope="module")
def runtimes():
    """Every runner; PyTorch and ONNX Runtime must be there (else the test is skipped, saying so)."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    runs = runners()
    assert {r.family for r in runs} == {"torch", "onnxruntime", "numpy"}
    return runs


def _only(name: str) -> list[Runner]:
    return [r for r in runners([name]) if r.name == name]


# --- the tester's parts ------------------------------------------------------------------------


def test_round_in_rounds_as_the_formats_do():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=200) * 2.0 ** rng.integers(-160, 130, 200),
                        [1 + 2.0 ** -24, 1 + 3 * 2.0 ** -24, 1.5 * 2.0 ** -149, 2.5 * 2.0 ** -149, 2.0 ** -150,
                         3.4028235e38, -3.5e38, 1 + 2.0 ** -8, 2.0 ** -133 * 1.5]])
    with np.errstate(over="ignore"):
        f32 = x.astype(np.float32).astype(np.float64)
    assert np.array_equal(round_in(x, FORMATS["float32"]), f32)
    # bfloat16 from float32 values (one rounding, as deployed weights are)
    assert np.array_equal(round_in(f32, FORMATS["bfloat16"]), FORMATS["bfloat16"].round(f32))


def test_stored_emulation_reproduces_class_1():
    """The emulator storing the softmax's sum in bfloat16: 259 equal exps sum to 259, stored
    as 260, each output bf16(1/260); the error is 67/16384 (PyTorch's number, below)."""
    w = softmax_equal_model(300, 259, 0.0, 200.0)
    for stored, expected in ((True, 67 / 16384), (False, None)):
        p, _ = Deployed(w, FORMATS["bfloat16"], "sequential", acc=FORMATS["float32"], stored=stored).run([0])
        err = 1.0 - math.fsum(p[:259])
        assert err == expected if stored else abs(err) < 2.0 ** -12


#: a parameter region each motif must reach (its adversarial extreme)
EXTREMES = {
    "softmax-equal": lambda p: p["m"] >= 257 and p["valid"] == "equal",   # sums bfloat16 cannot hold
    "residual-heads": lambda p: p["heads"] >= 7 and p["p"] == 8,          # more lost half-ulps than the radius
    "subnormal": lambda p: p["tiny"] < 2.0 ** -133,                       # below bfloat16's subnormals too
    "cancel": lambda p: p["big"] >= 2.0 ** 30,
    "bias-tie": lambda p: p["tie_half_ulps"] == 1 and p["bias_half_ulps"] == 1,
    "attention-equal": lambda p: p["equal_scores"],
    "random": lambda p: True,
}


@pytest.mark.parametrize("motif", list(MOTIFS))
def test_every_motif_generates_valid_cases_and_reaches_its_extreme(motif):
    reached = []

    @settings(max_examples=30 if motif == "random" else 60, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(cases([motif]))
    def collect(case):
        assert case.motif == motif
        case.weights.validate("case")
        n, p = case.tokens.shape
        assert 1 <= n and 1 <= p < case.weights.n_positions
        assert case.tokens.max() < len(case.weights.vocab)
        assert np.all(np.diff(case.valid_ptr) >= 1) and case.valid.max() < len(case.weights.vocab)
        reached.append(EXTREMES[motif](dict(case.params)))

    collect()
    assert any(reached)


def test_flush_denormal_is_restored_and_has_its_effect(runtimes):
    before = flushing()
    case = make_case(subnormal_model(2.0 ** -140, 2.0 ** 120, "E", 2.0), [[0]], [[0]])
    kept, _ = run_torch(TorchConfig("float32"), case)
    flushed, _ = run_torch(TorchConfig("float32", flush=True), case)
    assert flushing() == before
    assert kept[0, 0] != flushed[0, 0] and flushed[0, 0] == 0.5        # the subnormal read as 0: two equal logits


# --- the oracle can fail -----------------------------------------------------------------------


def test_the_oracle_catches_too_narrow_enclosures_and_wrong_routing():
    case = make_case(residual_heads_model(8, 1, 1.0, -1, 1.0, 64, 0, 4.0), [[0], [1]], [[0], [0]])
    res = certificate(case, "bfloat16")
    probs, experts = _only("numpy:bfloat16")[0].run(case)
    assert compare(case, "r", "bfloat16", res, probs, experts) == []
    err = np.array([1.0 - probs[i, 0] for i in range(2)])
    narrow = replace(res, err_lo=err + 1e-9, err_hi=err + 2e-9)                  # misses the execution
    assert [v.kind for v in compare(case, "r", "d", narrow, probs, experts)] == ["error", "error"]
    assert res.margin[0] > 0
    other = replace(res, expert=1 - res.expert)                                  # certifies the other expert
    kinds = {v.kind for v in compare(case, "r", "d", other, probs, experts)}
    assert kinds == {"routing"}
    no_candidates = replace(res, margin=np.full(2, -1.0), candidates=(np.array([0, 1, 2]), 1 - res.expert))
    assert {v.kind for v in compare(case, "r", "d", no_candidates, probs, experts)} == {"gate"}
    undecided = replace(narrow, margin=np.full(2, -np.inf), err_lo=np.zeros(2), err_hi=np.ones(2))
    assert compare(case, "r", "d", undecided, np.full_like(probs, np.nan), experts) == []


def test_a_runtime_outside_its_claimed_deployment_is_caught(runtimes):
    """bfloat16 executions presented as float32 ones: the float32 enclosures miss them."""
    liar = Runner("bfloat16-as-float32", "torch", "float32", lambda c: run_torch(TorchConfig("bfloat16"), c))
    found = []

    @settings(max_examples=10, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases(["random", "attention-equal"]))
    def probe(case):
        found.extend(check(case, [liar]))

    probe()
    assert found and all(v.deployment == "float32" for v in found)


def test_causes_are_found_by_contrast_of_variants(runtimes):
    """A violation that only the op-by-op softmax shows is put down to it: against an
    enclosure [−2^-10, 2^-10] (set in the case's memo, as if certified), the stored softmax's
    error 67/16384 falls outside and torch.softmax's (1.4e-4) inside."""
    case = make_case(softmax_equal_model(300, 259, 0.0, 200.0), [[0]], [list(range(259))])
    res = certificate(case, "bfloat16+float32")
    case.memo[("certificate", "bfloat16+float32")] = replace(res, err_lo=np.array([-2.0 ** -10]),
                                                             err_hi=np.array([2.0 ** -10]))
    runner = torch_runner(TorchConfig("bfloat16", "per-head", "explicit", "add"))
    assert [label for label, _ in alternatives(runner)] == ["softmax stored op by op", "residual head by head",
                                                           "bias added after the product"]
    (v,) = check(case, [runner], deployments=["bfloat16+float32"])
    assert v.kind == "error" and v.error == 67 / 16384
    assert causes(case, v, runner) == ("softmax stored op by op",)
    assert alternatives(torch_runner(TorchConfig("float32", "fused", "torch", "addmm"))) == []


def test_search_finds_and_shrinks_a_counterexample(runtimes):
    liar = Runner("bfloat16-as-float32", "torch", "float32", lambda c: run_torch(TorchConfig("bfloat16"), c))
    found = search(10, 0, [liar], lambda case, v: v.kind == "error", ["bias-tie"])
    assert found is not None and found.first_at >= 1
    assert found.violations and {v.runner for v in found.violations} == {"bfloat16-as-float32"}
    assert found.violating_runners == ["bfloat16-as-float32 vs float32"]


# --- the property ------------------------------------------------------------------------------


def _property(runs, deployments, examples: int, motifs=None) -> None:
    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases(motifs))
    def probe(case):
        bad = check(case, runs, deployments=deployments)
        assert not bad, "\n".join(v.line() for v in bad[:5])

    probe()


@pytest.mark.parametrize("motif", list(MOTIFS))
def test_runtimes_land_in_the_pure_format_enclosures(runtimes, motif):
    """Every runner against float32 and bfloat16, the deployments computing in one format:
    PyTorch float32 (every variant, flushing or not), ONNX Runtime, PyTorch bfloat16 and
    float64-accumulated float32 (whose every rounding the pure bounds count at the
    storage format's precision), the emulator in random orders. (Per motif: hypothesis's
    choice among motifs is far from even over a few derandomized examples.)"""
    _property(runtimes, PURE, examples=6, motifs=[motif])


def test_runtimes_land_in_the_mixed_precision_enclosures(runtimes):
    """Every runner against bfloat16 with float32 sums and float32 with float64 sums."""
    _property(runtimes, MIXED, examples=20)


# --- regression instances of the two classes ---------------------------------------------------

#: class 1: format -> (model, valid tokens, the runners storing the softmax's intermediates)
CLASS_1 = {
    # 259 tokens share logit 0: the sum 259 stored as 260 in bfloat16, each output bf16(1/260)
    "bfloat16": (softmax_equal_model(300, 259, 0.0, 200.0), list(range(259)),
                 ("torch:bfloat16:per-head:explicit:add", "numpy:bfloat16+float32:stored")),
    # four tokens at logit 0, one at −8: the exps stored in float32 (a relative 2^-24 each)
    "float32": (softmax_equal_model(5, 4, 0.0, 8.0), [0, 1, 2, 3],
                ("torch:float32+float64:per-head:explicit:add", "numpy:float32+float64:stored")),
}
#: class 2: eight heads each add half an ulp to the coordinate holding 1; the gate reads it
CLASS_2 = {"bfloat16": (8, "torch:bfloat16:per-head:torch:add"),
           "float32": (24, "torch:float32+float64:per-head:torch:add")}


def _mixed(fmt: str) -> str:
    return {"bfloat16": "bfloat16+float32", "float32": "float32+float64"}[fmt]


@pytest.mark.parametrize("fmt", list(CLASS_1))
def test_class_1_instance_is_real_and_inside_the_pure_format(runtimes, fmt):
    w, valid, names = CLASS_1[fmt]
    case = make_case(w, [[0]], [valid])
    errs = {1.0 - math.fsum(_only(name)[0].run(case)[0][0, valid]) for name in names}
    assert len(errs) == 1 and (fmt != "bfloat16" or errs == {67 / 16384})     # PyTorch and the emulator agree
    assert check(case, [r for name in names for r in _only(name)], deployments=[fmt]) == []
    assert COVERS[_mixed(fmt)] == (_mixed(fmt), fmt)


@pytest.mark.parametrize("fmt", list(CLASS_1))
def test_class_1_stored_softmax_intermediates_are_contained(runtimes, fmt):
    w, valid, names = CLASS_1[fmt]
    case = make_case(w, [[0]], [valid])
    bad = check(case, [r for name in names for r in _only(name)], deployments=[_mixed(fmt)])
    assert not bad, "\n".join(v.line() for v in bad)


def _class_2_case(fmt: str):
    p, name = CLASS_2[fmt]
    return make_case(residual_heads_model(p, 8, 1.0, 1, 1.0, 2, 0, 4.0), [[0]], [[0]]), name


@pytest.mark.parametrize("fmt", list(CLASS_2))
def test_class_2_instance_is_real_and_inside_the_pure_format(runtimes, fmt):
    case, name = _class_2_case(fmt)
    _, per_head = _only(name)[0].run(case)
    _, concat = _only(name.replace("per-head", "concat"))[0].run(case)
    assert per_head[0] == 1 and concat[0] == 0               # the coordinate stayed 1: the competitor wins
    assert certificate(case, _mixed(fmt)).expert[0] == 0        # the exact winner (certified before the fix)
    assert check(case, _only(name), deployments=[fmt]) == []


@pytest.mark.parametrize("fmt", list(CLASS_2))
def test_class_2_residual_summed_head_by_head_is_contained(runtimes, fmt):
    case, name = _class_2_case(fmt)
    bad = check(case, _only(name), deployments=[_mixed(fmt)])
    assert not bad, "\n".join(v.line() for v in bad)


# --- the command line --------------------------------------------------------------------------


def test_command_line_surveys_and_reports(capsys):
    assert main(["--examples", "3", "--seed", "1", "--runtime", "numpy:float32", "--motif", "random"]) == 0
    out = capsys.readouterr().out
    assert "numpy:float32" in out and "0 violations in 3 examples" in out


def test_command_line_refuses_bad_arguments(capsys):
    assert main(["--examples", "0"]) == 2
    assert main(["--examples", "2", "--runtime", "no-such-runtime"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("audit.differential: ") for line in err)
