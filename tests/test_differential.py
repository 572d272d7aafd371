"""The differential tester (audit.differential): PyTorch, ONNX Runtime and the numpy
emulator against the float certificates, on tiny adversarial models.

Two classes of executions fell outside the earlier mixed-precision (``--accumulate``)
enclosures, and the tester found both by its own search: softmax intermediates stored in the
format (class 1) and the residual summed head by head with each addition stored (class 2).
The execution model (verifier/passes/execution.py) now counts every stored intermediate; their
regression instances and the mixed-precision property hold.

The ablated model (the execution model's ``ablation`` row, y = r) is run too, the routed expert
removed in each covered way (not run, selected away, multiplied by 0), against the localization
check's numbers. Its "overflow" motif found, on the code before, a gate whose partial sums
overflow (class 3) and an expert output that overflows before its gate scale (class 4), and,
those two fixed, with the expert multiplied by 0, an ablation certified where the gate decided
nothing (class 5)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from audit.deployed import Deployed, round_in
from audit.deployed import ABLATIONS
from audit.differential import (COVERS, MOTIFS, Runner, TorchConfig, alternatives, cases, causes, certificate, check,
                                compare, compare_ablated, flushing, main, make_case, overflow_model,
                                residual_heads_model, run_torch, runners, search, softmax_equal_model, subnormal_model,
                                torch_runner)
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
    "dense": lambda p: True,                      # every case dense: test_dense_cases_take_the_dense_pass
    "overflow": lambda p: p["a"] >= 2.0 ** 127 or p["out"] >= 2.0 ** 127,   # doubled: beyond the formats
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


def test_dense_cases_take_the_dense_pass():
    """The motif of trained-like weights (every entry non-zero) is verified by the dense pass,
    which the certificate of each of its cases then is."""
    from verifier.passes.dense import is_dense

    @settings(max_examples=20, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases(["dense"]))
    def collect(case):
        assert is_dense(case.weights)

    collect()


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


# --- the ablated model (the execution model's ablation row) --------------------------------------


def _ablated(name_part: str) -> list[Runner]:
    return [r for r in runners([name_part]) if r.ablation is not None]


def test_every_family_removes_the_expert_in_every_covered_way(runtimes):
    """Each ablated runner computes y = r: on a model whose expert writes 1 into the coordinate
    token 0 reads, every way of removing it gives logits exactly 0 (U·r) and the uniform
    distribution, while the model itself does not."""
    case = make_case(overflow_model(0.0, 1.0, 0.5, 2.0), [[0], [1]], [[0], [0]])
    ablated = [r for r in runtimes if r.ablation is not None]
    families = {(r.family, r.computes, r.ablation) for r in ablated}
    assert {a for _, _, a in families} == set(ABLATIONS)
    assert {(f, c) for f, c, _ in families} >= {("torch", "float32"), ("torch", "bfloat16+float32"),
                                                 ("onnxruntime", "float32"), ("numpy", "float32")}
    for r in ablated:
        probs, _, logits = r.run(case)
        assert np.array_equal(logits, np.zeros((2, 2))) and np.array_equal(probs, np.full((2, 2), 0.5)), r.name
    probs, _ = _only("torch:float32:per-head:torch:add")[0].run(case)
    assert probs[0, 0] > 0.8                                    # the expert's output: logit 2 for token 0


def test_the_oracle_catches_ablated_claims_that_miss_the_execution(runtimes):
    """Against enclosures that miss the ablated executions (as if certified), every kind of
    ablated violation is reported; the true certificate has none."""
    case = make_case(overflow_model(0.0, 1.0, 0.5, 2.0), [[0]], [[0]])
    res = certificate(case, "float32")
    probs, experts, logits = _ablated("numpy:float32:ablate-drop")[0].run(case)
    assert compare_ablated(case, "r", "float32", res, probs, experts, logits) == []
    assert res.ablated_gap[0] == 0.0 and res.ablated_object_lo[0] > 0.49      # a tie of two zero logits; P(o) = 1/2
    wrong = replace(res, ablated_lo=np.array([0.6]), ablated_hi=np.array([0.7]), ablated_gap=np.array([1e-30]),
                    ablated_object_lo=np.array([0.51]))
    kinds = [v.kind for v in compare_ablated(case, "r", "d", wrong, probs, experts, logits)]
    assert kinds == ["ablated error", "ablated object", "ablated gap"]
    nothing = replace(res, ablated_lo=np.zeros(1), ablated_hi=np.ones(1), ablated_gap=np.array([-np.inf]),
                      ablated_object_lo=np.zeros(1))
    assert compare_ablated(case, "r", "d", nothing, np.full_like(probs, np.nan), experts, logits + np.nan) == []


def test_an_ablation_by_zero_is_not_certified_where_the_gate_decides_nothing(runtimes):
    """Class 5: the gate's partial sums may overflow, so a runtime routes to expert 1, whose
    output 2^128 is ∞ in float32; multiplied by 0 it is NaN, and so is every ablated logit.
    The certificate (which had checked only expert 0's output) claims no ablation there now;
    dropping the expert or selecting it away gives the exact-zero logits."""
    case = make_case(overflow_model(1.5 * 2.0 ** 127, 2.0 ** 110, 10.0, 1.0, loser=2.0 ** 127), [[0]], [[0]])
    zero = _ablated(":ablate-zero")
    outs = {r.name: r.run(case) for r in zero if r.computes in ("float32", "bfloat16+float32")}
    assert any(np.isnan(o[2]).all() and o[1][0] == 1 for o in outs.values())      # torch and ONNX Runtime
    for dep in ("float32", "bfloat16"):
        res = certificate(case, dep)
        assert res.ablated_gap[0] == -np.inf and res.ablated_object_lo[0] == 0.0
    assert check(case, _ablated(":ablate-")) == []


#: classes 3 and 4 (found by the overflow motif on the code before): the certificate's claim
#: and what the runtimes did
CLASSES_3_4 = {
    "gate partial sums": (dict(a=1.5 * 2.0 ** 127, gate_gap=2.0 ** 110, out=2.0 ** 120, read=2.0 ** -130, V=3),
                          "routed to expert 1 (the sum a + a overflows) while expert 0 was certified"),
    "output before its gate scale": (dict(a=0.0, gate_gap=1.0, out=2.0 ** 127, read=2.0 ** -122,
                                          gate_mode="top1-scaled"),
                                     "NaN: W_2·a = 2^128 overflows before the scale c = 0.73"),
}


@pytest.mark.parametrize("name", list(CLASSES_3_4))
def test_classes_3_and_4_are_real_and_not_certified(runtimes, name):
    kw, _ = CLASSES_3_4[name]
    case = make_case(overflow_model(**kw), [[0]], [[0]])
    probs, experts = _only("torch:float32:per-head:torch:add")[0].run(case)
    if name == "gate partial sums":
        assert experts[0] == 1
    else:
        assert np.isnan(probs).all()
    res = certificate(case, "float32")
    assert res.margin[0] == -np.inf and (res.err_lo[0], res.err_hi[0]) == (0.0, 1.0)
    assert check(case, runtimes) == []


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
