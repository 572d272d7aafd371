"""Two layers: the construction for composed tasks, its certified pass against the exact
oracle, checks that fail when the model is wrong, and the commands around it.

* every enclosure of :mod:`verifier.passes.layers` contains the value the independent
  oracle (:mod:`audit.layers`, exact linear algebra, 60 digits) computes, on every query
  of a small set and of random composed sets;
* the construction certifies random composed sets, except where a composition is a
  fixpoint (D_g(b) = b: the second hop changes nothing, so removing it leaves the object
  answered), and there the second hop's entanglement fails;
* each mutant of either layer is caught (not certified), and the oracle confirms that it
  truly answers some query wrong;
* the command line: two layers by default for a composed set, ``--layers 1`` for one,
  ``--weights`` round trips, and every unsupported combination refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

from audit.layers import LayersOracle, judge
from cli.main import main
from construction.layers import build_two_layers
from layout import Expert, canonical
from layout.layers import MoELayer, Stack, layers_of, load, save
from tasks import loads_tasks
from tasks.errors import TaskError
from tasks.strategies import composed_task_sets
from tasks.structure import structure_of
from verifier.checks.layers import verify_layers
from verifier.passes.batches import batches
from verifier.passes.layers import LayersPass

PROPERTY = settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])

TWO_HOPS = """\
tasks:
  - name: born_in
    templates: [⋆1 was born in ⋆2]
    facts: {Curie: Poland, Einstein: Germany, Bohr: Denmark}
  - name: capital
    templates: [the capital of ⋆1 is ⋆2, ⋆1 has the capital ⋆2]
    facts: {Poland: Warsaw, Germany: Berlin, Denmark: Copenhagen, France: Paris}
  - name: born_capital
    templates: [the capital of the country where ⋆1 was born is ⋆2]
    compose: [born_in, capital]
"""


@pytest.fixture(scope="module")
def small():
    ts = loads_tasks(TWO_HOPS)
    model = build_two_layers(ts)
    return ts, model, model.instantiate()


def _fixpoints(ts) -> set[tuple[str, str]]:
    """(composed task, subject) whose bridge is its own object."""
    out = set()
    for t in ts.tasks:
        if t.compose is not None:
            f, g = (ts.tasks[ts.index(p)].facts for p in t.compose)
            out |= {(t.name, s) for s, b in f.items() if g[b] == b}
    return out


def _contains_oracle(ts, stack, factored: bool = True) -> int:
    """Every query's enclosures against the oracle, the residual enclosed factored over
    cohorts or row by row; returns the number of queries compared."""
    oracle = LayersOracle(60)
    pas = LayersPass(stack, np.arange(ts.vocabulary.n_words, len(ts.vocabulary)) if factored else None)
    n = 0
    for b in batches(ts, structure_of(ts)):
        oq = b.object_query & (b.determined >= 0)
        res = pas.run_batch(b.tokens, b.valid_ptr, b.valid, b.target, oq, oq)
        for i in range(len(b)):
            valid = frozenset(b.valid[b.valid_ptr[i]:b.valid_ptr[i + 1]].tolist())
            target = int(b.target[i]) if oq[i] else None
            ex = oracle.query(stack, tuple(b.tokens[i].tolist()), valid, target)
            assert res.err_lo[i] <= ex["error"] <= res.err_hi[i], (i, res.err_lo[i], ex["error"], res.err_hi[i])
            if res.margin1[i] > 0:
                assert res.expert1[i] == ex["expert1"] and res.margin1[i] <= ex["margin1"]
            if res.margin2[i] > 0 and res.margin1[i] > 0:
                assert res.expert2[i] == ex["expert2"] and res.margin2[i] <= ex["margin2"]
            if oq[i] and res.margin1[i] > 0 and res.margin2[i] > 0:
                for hop in (1, 2):
                    lo, hi = res.ablated[hop][0][i], res.ablated[hop][1][i]
                    assert lo <= ex[f"ablated{hop}"] <= hi, (hop, lo, ex[f"ablated{hop}"], hi)
                assert res.ablated[2][2][i] <= ex["ablated2_object"]       # the lower end of 1 − P(o)
            n += 1
    return n


@pytest.mark.parametrize("factored", [True, False])
def test_enclosures_contain_the_exact_values(small, factored):
    ts, _, stack = small
    assert _contains_oracle(ts, stack, factored) == verify_layers(ts, stack, 0.01).queries


def test_the_small_set_certifies_within_the_bound(small):
    ts, model, stack = small
    report = verify_layers(ts, stack, model.epsilon)
    assert report.certified, report.to_json()
    assert not model.unproven_conditions()
    assert report.worst_error <= model.bound_value() * (1 + 1e-9)     # an enclosure of a tight bound
    composed = [t for t in report.tasks if t.compose]
    assert composed and all(t.worst_error < 1e-3 for t in composed)      # eps2 is far below eps1


@PROPERTY
@given(composed_task_sets(max_tasks=3, max_facts=4, max_template_length=5))
def test_random_composed_sets(ts):
    model = build_two_layers(ts)
    stack = model.instantiate()
    report = verify_layers(ts, stack, model.epsilon)
    fix = _fixpoints(ts)
    failing = {c: v for c, v in report.failing_queries.items() if v}
    if not fix:
        assert report.certified, (failing, report.to_json())
    else:
        assert set(failing) <= {"entanglement2", "localization2"} and failing["entanglement2"] > 0
    assert report.worst_error <= model.bound_value() * (1 + 1e-9)     # an enclosure of a tight bound


@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(composed_task_sets(max_tasks=2, max_composed=1, max_facts=3, max_template_length=4))
def test_random_enclosures_contain_the_exact_values(ts):
    _contains_oracle(ts, build_two_layers(ts).instantiate())


# --- mutants -----------------------------------------------------------------------------------


def _with_second(stack: Stack, **changes) -> Stack:
    return Stack(stack.first, replace(stack.second, **changes))


def _set(m, i, j, v):
    m = sp.lil_matrix(m, copy=True)
    m[i, j] = v
    return canonical(m.tocsr())


def _expert2(stack, k, **changes):
    experts = list(stack.second.experts)
    experts[k] = replace(experts[k], **changes)
    return _with_second(stack, experts=tuple(experts))


def _mutants(stack: Stack):
    """(name, mutant) for each way of breaking one layer."""
    s, w = stack.second, stack.first
    e = s.experts[1]
    col = e.W_2.tocsc()[:, 0]
    obj_row = int(col.indices[np.argmax(col.data)])         # the neuron's +2 on next:D_g(b)
    yield "layer 2 forgets an object", _expert2(stack, 1, W_2=_set(e.W_2, obj_row, 0, 0.0))
    yield "layer 2 answers a wrong object", _expert2(stack, 1, W_2=_set(_set(e.W_2, obj_row, 0, 0.0),
                                                                      (obj_row + 1) % stack.d, 0, 2.0))
    yield "layer 2 routes to the pass", _with_second(stack, b_G=np.array([1.0, *s.b_G[1:]]))
    yield "layer 2's neuron never fires", _expert2(stack, 1, b_1=np.full(e.width, -3.0))
    # layer 1: the detector of the composed task removed (its output column zeroed)
    k = next(i for i, ex in enumerate(w.experts) if w.neuron_labels and any(
        lab.startswith("detector:") for lab in w.neuron_labels[i]))
    ex = w.experts[k]
    W2 = ex.W_2.tolil(copy=True)
    W2[:, ex.width - 1] = 0
    experts = list(w.experts)
    experts[k] = Expert(ex.W_1, ex.b_1, canonical(W2.tocsr()))
    yield "layer 1 loses its detector", Stack(w.replace(experts=tuple(experts)), s)
    # layer 1: the gate sends everything to one expert
    yield "layer 1 routes everything to one expert", Stack(w.replace(b_G=np.array([100.0] + [0.0] * (len(w.b_G) - 1))),
                                                           s)


@pytest.mark.parametrize("name", ["layer 2 forgets an object", "layer 2 answers a wrong object",
                                  "layer 2 routes to the pass", "layer 2's neuron never fires",
                                  "layer 1 loses its detector", "layer 1 routes everything to one expert"])
def test_every_mutant_is_caught_and_truly_wrong(small, name):
    ts, model, stack = small
    mutant = dict(_mutants(stack))[name]
    report = verify_layers(ts, mutant, model.epsilon)
    assert not report.certified
    # the oracle agrees: some query's exact error is at least epsilon, or a layer routes it wrong
    oracle = LayersOracle(40)
    names1, names2 = mutant.first.expert_tasks, mutant.second.expert_tasks
    wrong = 0
    for b in batches(ts, structure_of(ts)):
        for i in range(len(b)):
            valid = frozenset(b.valid[b.valid_ptr[i]:b.valid_ptr[i + 1]].tolist())
            ex = oracle.query(mutant, tuple(b.tokens[i].tolist()), valid)
            det = int(b.determined[i])
            task = ts.tasks[det] if det >= 0 else None
            owner = task.compose[0] if task is not None and task.compose else (task.name if task else None)
            composed_oq = bool(b.object_query[i] and task is not None and task.compose)
            want2 = task.compose[1] if composed_oq else ""
            wrong += bool(ex["error"] >= model.epsilon or (owner and names1[ex["expert1"]] != owner)
                          or names2[ex["expert2"]] != want2)
    assert wrong > 0


# --- the layout -------------------------------------------------------------------------------


def test_files_round_trip_and_say_their_layers(small, tmp_path):
    _, _, stack = small
    path = tmp_path / "two.npz"
    save(stack, path)
    back = load(path)
    assert layers_of(path) == 2 and back.second.expert_tasks == stack.second.expert_tasks
    for a, b in zip(back.second.experts, stack.second.experts):
        assert (a.W_1 != b.W_1).nnz == 0 and (a.W_2 != b.W_2).nnz == 0 and np.array_equal(a.b_1, b.b_1)
    import layout
    with pytest.raises(TaskError, match="holds a model of 2 layers, not one"):
        layout.load(path)
    one = tmp_path / "one.npz"
    layout.save(stack.first, one)
    assert layers_of(one) == 1
    with pytest.raises(TaskError, match="one-layer model, not two layers"):
        load(one)


def test_a_malformed_second_layer_is_refused(small):
    _, _, stack = small
    bad = _with_second(stack, W_G=canonical(sp.csr_matrix((3, stack.d))))
    with pytest.raises(TaskError, match="layer2.W_G has shape"):
        bad.validate()
    with pytest.raises(TaskError, match="names a task for several experts"):
        _with_second(stack, expert_tasks=("capital", "capital")).validate()


def test_a_scaled_first_gate_is_refused(small):
    """The two-layer pass encloses unscaled top-1 experts: weights that scale by the gate are refused, not misread."""
    _, _, stack = small
    with pytest.raises(TaskError, match="routes both layers top-1 unscaled"):
        Stack(stack.first.replace(gate_mode="top1-scaled"), stack.second).validate()


def test_second_layer_without_experts_is_refused(small):
    _, _, stack = small
    empty = MoELayer(canonical(sp.csr_matrix((0, stack.d))), np.zeros(0), (), ())
    with pytest.raises(TaskError, match="layer2.experts: there are none"):
        Stack(stack.first, empty).validate()


# --- the command line -------------------------------------------------------------------------


@pytest.fixture
def two_hops(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(TWO_HOPS, encoding="utf-8")
    return path


def _one_line(capsys, argv, fragment):
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_check_uses_two_layers_and_one_on_request(two_hops, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["check", str(two_hops), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "two layers:" in text and "verdict: CERTIFIED" in text
    data = json.loads(out.read_text())
    assert data["layers"] == 2 and data["certified"]
    composed = next(t for t in data["tasks"] if t["compose"])
    assert composed["compose"] == ["born_in", "capital"] and composed["failing"]["entanglement2"] == 0
    assert main(["check", str(two_hops), "--layers", "1", "--json", str(out), "--quiet"]) == 0
    assert "layers" not in json.loads(out.read_text())


def test_build_then_check_the_weights(two_hops, tmp_path, capsys):
    w = tmp_path / "w.npz"
    assert main(["build", str(two_hops), "-o", str(w)]) == 0
    assert "two layers" in capsys.readouterr().out
    assert main(["check", str(two_hops), "--weights", str(w)]) == 0
    _one_line(capsys, ["check", two_hops, "--weights", w, "--layers", "1"], "the weights file holds 2 layer(s)")


def test_inspect_prints_the_cost_per_task(two_hops, tmp_path, capsys):
    assert main(["inspect", str(two_hops)]) == 0
    text = capsys.readouterr().out
    assert "layer 1" in text and "one layer" in text and "born_capital" in text
    out = tmp_path / "i.json"
    assert main(["inspect", str(two_hops), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    row = next(c for c in data["tasks"] if c["task"] == "born_capital")
    assert row["layer2"] == 0 and row["layer1"] < row["one_layer"]
    assert next(c for c in data["tasks"] if c["task"] == "capital")["layer2"] == 3    # its facts used as a 2nd hop


@pytest.mark.parametrize("extra, fragment", [
    (["--precision", "float32"], "--precision is not supported for two-layer models yet"),
    (["--jobs", "2"], "--jobs is not supported for two-layer models yet"),
    (["--scheduler", "local:1"], "--scheduler is not supported for two-layer models yet"),
    (["--ulps", "2"], "--ulps is not supported"),
])
def test_unsupported_check_flags_are_refused(two_hops, capsys, extra, fragment):
    _one_line(capsys, ["check", two_hops, *extra], fragment)


def test_certificates_are_refused(two_hops, tmp_path, capsys):
    _one_line(capsys, ["check", two_hops, "--certificate", tmp_path / "c"], "--certificate is not supported")
    _one_line(capsys, ["check", two_hops, "--since", tmp_path / "c"], "--since is not supported")


@pytest.mark.parametrize("argv, fragment", [
    (["export", "{tasks}", "--onnx", "{tmp}/m.onnx"], "'export' has no two-layer form yet"),
    (["explain", "{tasks}", "Curie was born in"], "'explain' has no two-layer form yet"),
    (["accessible", "{tasks}"], "'accessible' has no two-layer form yet"),
    (["inspect", "{tasks}", "--block", "gate"], "the two-layer model has no listing yet"),
])
def test_commands_without_a_two_layer_form_refuse(two_hops, tmp_path, capsys, argv, fragment):
    _one_line(capsys, [a.format(tasks=two_hops, tmp=tmp_path) for a in argv], fragment)


def test_two_layers_need_a_composed_task(tmp_path, capsys):
    path = tmp_path / "one.yaml"
    path.write_text("tasks:\n  - name: a\n    templates: [x ⋆1 y ⋆2]\n    facts: {p: q}\n", encoding="utf-8")
    _one_line(capsys, ["check", path, "--layers", "2"], "--layers 2 needs a composed task")


# --- a layer's arithmetic ----------------------------------------------------------------------


def _interval_rows(rng, n: int, d: int, density: float, scale: float):
    """(random interval rows at ``scale``, their midpoints, their radii), dense arrays beside."""
    from verifier.arithmetic import interval as I

    mask = rng.random((n, d)) < density
    mid = np.where(mask, rng.normal(size=(n, d)) * scale, 0.0)
    rad = np.where(mask, np.abs(rng.normal(size=(n, d))) * scale * rng.choice([0.0, 1e-3, 0.5]), 0.0)
    rows, cols = np.nonzero(mask)
    return I.from_coo((n, d), rows, cols, mid[mask], rad[mask]), mid, rad


def _random_experts(rng, d: int, scale: float) -> list:
    """Experts of widths 5, 0 and 3 over d directions, positive biases and ``scale`` included."""
    experts = []
    for w in (5, 0, 3):
        W1 = canonical(sp.random(w, d, density=0.5, random_state=rng, data_rvs=lambda k: rng.normal(size=k)).tocsr())
        W2 = canonical(sp.random(d, w, density=0.5, random_state=rng,
                                 data_rvs=lambda k: rng.normal(size=k) * rng.choice([1.0, scale])).tocsr())
        b = rng.choice([-1.0, 0.0, 0.5, 2.0], size=w) * rng.choice([1.0, scale])
        experts.append(Expert(W1, b, W2))
    return experts


def _assert_layer_enclosed(out, pairs, experts, keep, point, scale) -> None:
    """The layer kernel's rows ``out`` (ptr, idx, mid, rad, bad; one per pair (row, expert))
    hold y = x + W_2 ReLU(W_1 x + b_1) exactly in fractions at the points ``point(row,
    corner)`` (x, a list of fractions), in every column ``keep`` marks and no other; an entry
    outside the pattern is exactly 0; nothing is flagged at scale 1."""
    from fractions import Fraction

    from verifier.arithmetic import interval as I

    ptr, idx, ym, yr, bad = out
    pr, pk = pairs
    d = keep.size
    Y = I.SparseInterval((pr.size, d), ptr, idx, ym, yr)
    Ym, Yr = Y.dense()
    stored = np.zeros((pr.size, d), bool)
    stored[Y.row_ids(), Y.indices] = True
    assert not stored[:, ~keep].any()
    for q in range(pr.size):
        e = experts[int(pk[q])]
        W1, W2 = e.W_1.toarray(), e.W_2.toarray()
        for corner in range(4):
            x = point(int(pr[q]), corner)
            a = [max(sum((Fraction(float(W1[g, j])) * x[j] for j in range(d)), Fraction(float(e.b_1[g]))), Fraction(0))
                 for g in range(e.width)]
            for j in np.flatnonzero(keep):
                exact = x[j] + sum((Fraction(float(W2[j, g])) * a[g] for g in range(e.width)), Fraction(0))
                if bad[q]:
                    continue
                if not stored[q, j]:
                    assert exact == 0, (q, j, exact)
                    continue
                lo = Fraction(float(Ym[q, j])) - Fraction(float(Yr[q, j]))
                hi = Fraction(float(Ym[q, j])) + Fraction(float(Yr[q, j]))
                assert lo <= exact <= hi, (q, j, float(lo), float(exact), float(hi))
    if scale == 1.0:
        assert not bad.any()                        # nothing near the float range: every pair decides


def _corner(rng, mid, rad, i: int, corner: int) -> list:
    """Row i of the intervals [mid ± rad] at its centre or a random corner, in fractions."""
    from fractions import Fraction

    sign = np.array([1, -1, 0, 1])[corner] * np.where(rng.random(mid.shape[1]) < 0.5, 1, -1)
    return [Fraction(float(mid[i, j])) + sign[j] * Fraction(float(rad[i, j])) for j in range(mid.shape[1])]


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(0, 2 ** 31), st.sampled_from([1.0, 1e-300, 1e300]))
def test_layer_rows_enclose_the_layer_at_every_point(seed, scale):
    """y = x + W_2 ReLU(W_1 x + b_1), exact in fractions for x at the centre and at corners of
    random interval rows, lies in the enclosure of the compiled layer
    (:func:`verifier.arithmetic.experts.layer_rows`) for every (row, expert) pair, positive
    biases, a width-0 expert and extreme scales included, in every column it is asked to keep
    (and in no other); an entry of those outside the pattern is exactly 0 there, and a pair
    whose values may overflow is flagged."""
    from verifier.arithmetic import experts as experts_k
    from verifier.passes.tables import LayerTables

    rng = np.random.default_rng(seed)
    n, d = 3, 6
    X, mid, rad = _interval_rows(rng, n, d, 0.6, scale)
    experts = _random_experts(rng, d, scale)
    t = LayerTables.of(sp.csr_matrix((len(experts), d)), np.zeros(len(experts)), experts, d)
    pr = np.repeat(np.arange(n, dtype=np.int64), len(experts))
    pk = np.tile(np.arange(len(experts), dtype=np.int64), n)
    keep = rng.random(d) < 0.7                      # the columns a reader of y reads: only those are formed
    width = t.max_width
    scratch = (np.zeros((width, 5)), np.zeros(width, np.int64), np.zeros((d, 6)), np.zeros(d, np.int64))
    with np.errstate(invalid="ignore", over="ignore"):
        out = experts_k.layer_rows((pr, pk), (X.indptr, X.indices, X.mid, X.rad), t.W1T, t.first, t.W2T, keep,
                                   scratch, 1)
    _assert_layer_enclosed(out, (pr, pk), experts, keep, lambda i, corner: _corner(rng, mid, rad, i, corner), scale)


@settings(max_examples=examples(40), deadline=None)
@given(st.integers(0, 2 ** 31), st.sampled_from([1.0, 1e-300, 1e300]))
def test_the_factored_layer_encloses_the_layer_at_every_point(seed, scale):
    """The layer on rows given in parts, x = s_c + o_i (:func:`verifier.arithmetic.experts.layer_rows_parts`):
    y = x + W_2 ReLU(W_1 x + b_1), exact in fractions at corners of both parts' intervals,
    lies in its enclosure for every (row, expert) pair, shared and own parts reaching the
    same neurons, positive biases, a width-0 expert and extreme scales included, in every
    kept column and no other; a pair whose values may overflow is flagged."""
    from verifier.arithmetic import experts as experts_k
    from verifier.passes.tables import LayerTables

    rng = np.random.default_rng(seed)
    n, d, C = 5, 6, 2
    S, s_mid, s_rad = _interval_rows(rng, C, d, 0.6, scale)
    O, o_mid, o_rad = _interval_rows(rng, n, d, 0.3, scale)
    cohort = rng.integers(0, C, size=n).astype(np.int64)
    experts = _random_experts(rng, d, scale)
    t = LayerTables.of(sp.csr_matrix((len(experts), d)), np.zeros(len(experts)), experts, d)
    pr = np.repeat(np.arange(n, dtype=np.int64), len(experts))
    pk = np.tile(np.arange(len(experts), dtype=np.int64), n)
    order = np.lexsort((pk, cohort[pr]))
    pr, pk = np.ascontiguousarray(pr[order]), np.ascontiguousarray(pk[order])
    keep = rng.random(d) < 0.7
    w = t.max_width
    acc = lambda: (np.zeros((w, 5)), np.zeros(w, np.int64), np.zeros(w, np.int32))  # noqa: E731
    scratch = (*acc(), np.zeros(w), np.zeros(w), np.zeros(w), np.zeros(w), np.zeros(w, bool), *acc(),
               np.zeros((d, 6)), np.zeros(d, np.int64), np.zeros(d), np.zeros(d), np.zeros(d, np.int64))
    parts = lambda M: (M.indptr, M.indices, M.mid, M.rad)  # noqa: E731
    with np.errstate(invalid="ignore", over="ignore"):
        out = experts_k.layer_rows_parts((pr, pk), parts(S), parts(O), cohort, t.W1T, t.first, t.W2T, keep,
                                         scratch, 1)

    def point(i, corner):                           # s_c and o_i each at a centre or corner of its own
        s, o = _corner(rng, s_mid, s_rad, int(cohort[i]), corner), _corner(rng, o_mid, o_rad, i, 3 - corner)
        return [a + b for a, b in zip(s, o)]

    _assert_layer_enclosed(out, (pr, pk), experts, keep, point, scale)


def test_mutation_campaign_on_both_layers(small):
    """Every mutation operator on each layer: no false pass (a certified mutant the oracle
    finds violating), and the truly violating mutants of layer 2 caught as all of layer 1's."""
    from audit.layers import campaign

    ts, model, stack = small
    rows = campaign(ts, stack, model.epsilon, draws=1, seed=1, oracle=LayersOracle(40))
    false_passes = [r for r in rows if r[3] and r[4]]
    assert not false_passes, false_passes
    for layer in (1, 2):
        violating = [r for r in rows if r[0] == layer and r[3]]
        assert len(violating) >= 10 and not any(r[4] for r in violating), layer


# --- hostile weights: regressions of the adversarial review -------------------------------------


def _overflowing_ablation(stack: Stack) -> Stack:
    """Layer 2's gate scaled by 2^995 (exact) and two experts appended, both named "": A (width
    0) and B, whose gate row is A's with a bias one ulp larger (so B beats A exactly at every
    query). Their scores are H·[word:in] − G·Σ[next:bridge] + 2^980 with H + 2^980 = 2^1024: at
    'X was born in' with the first layer's expert, G·[next:bridge] brings them far below the
    pass expert's 2^985; without it (hop 1 ablated) they round to +inf while exactly B wins,
    and B answers 'Curie was born in' with Poland: its object is answered without hop 1."""
    w, s = stack.first, stack.second
    col = list(w.residual_labels).index
    d = stack.d
    two = lambda e: float(np.ldexp(1.0, e))    # noqa: E731
    H = two(1023) * (2 - 2.0 ** -43)
    G = two(1023) * (2 - 2.0 ** -40) / 0.9999999999999982
    WG = s.W_G.toarray() * two(995)
    bG = s.b_G * two(995)
    bG[0] = two(985)
    row = np.zeros(d)
    row[col("word:in")] = H
    for bridge in ("Poland", "Denmark", "Germany"):
        row[col("next:" + bridge)] = -G
    A = Expert(canonical(sp.csr_matrix((0, d))), np.zeros(0), canonical(sp.csr_matrix((d, 0))))
    W1 = np.zeros((1, d))
    W1[0, [col("subj:Curie"), col("word:in")]] = 1.0
    W2 = np.zeros((d, 1))
    W2[col("next:Poland"), 0] = 50.0
    B = Expert(canonical(sp.csr_matrix(W1)), np.array([-1.5]), canonical(sp.csr_matrix(W2)))
    return Stack(w, MoELayer(canonical(sp.csr_matrix(np.vstack([WG, row, row]))),
                             np.concatenate([bG, [two(980), float(np.nextafter(two(980), np.inf))]]),
                             s.experts + (A, B), s.expert_tasks + ("", "")))


def test_an_overflowing_ablated_gate_may_route_to_any_expert(small):
    """Hop 1 ablated, layer 2's gate may overflow where the unablated one does not: every
    expert may then win (the exact scores are finite), not the first infinite midpoint alone.
    The old pass took A alone (its error without hop 1 is large) and certified a model whose
    exact hop-1 ablation routes to B and answers."""
    from audit.layers import judge

    ts, model, stack = small
    bad = _overflowing_ablation(stack)
    assert judge(ts, bad, model.epsilon, LayersOracle(40)) == ["entanglement1"]
    report = verify_layers(ts, bad, model.epsilon)
    assert not report.certified
    assert report.failing_queries["entanglement1"] >= 1
    assert {c for c, v in report.failing_queries.items() if v} <= {"entanglement1", "localization1"}


# --- each check of the two-layer verdict, shown failing ------------------------------------


@pytest.mark.parametrize("name, check", [("layer 2 forgets an object", "error"),
                                         ("layer 1 routes everything to one expert", "routing1"),
                                         ("layer 2 routes to the pass", "routing2")])
def test_each_query_check_fails_on_its_mutant(small, name, check):
    ts, model, stack = small
    report = verify_layers(ts, dict(_mutants(stack))[name], model.epsilon)
    assert report.failing_queries[check] > 0 and not report.certified


def test_a_fixpoint_fails_the_second_hops_entanglement_and_localization():
    """g(f(p)) = f(p): without layer 2 the composed object of p is still answered (only
    there: q's composition is no fixpoint)."""
    ts = loads_tasks("tasks:\n  - name: f\n    templates: [⋆1 f ⋆2]\n    facts: {p: x, q: y}\n"
                     "  - name: g\n    templates: [⋆1 g ⋆2]\n    facts: {x: x, y: z}\n"
                     "  - name: c\n    templates: [⋆1 c ⋆2]\n    compose: [f, g]\n")
    model = build_two_layers(ts)
    report = verify_layers(ts, model.instantiate(), model.epsilon)
    failing = {c: v for c, v in report.failing_queries.items() if v}
    assert failing == {"entanglement2": 1, "localization2": 1}
    assert judge(ts, model.instantiate(), model.epsilon, LayersOracle(40)) == ["entanglement2"]   # truly


@pytest.mark.parametrize("layer", [1, 2])
def test_an_expert_over_its_bound_fails_the_size_check(small, layer):
    """Dead neurons (off everywhere) added until an expert exceeds its bound: every query
    still passes, and the verdict is NOT CERTIFIED for the size alone."""
    ts, model, stack = small
    part = stack.first if layer == 1 else stack.second
    k = next(i for i, t in enumerate(part.expert_tasks) if t == "capital")
    e = part.experts[k]
    extra = (ts.L * 3 + 4) + 1 if layer == 1 else 5
    grown = Expert(canonical(sp.vstack([e.W_1, sp.csr_matrix((extra, stack.d))])),
                   np.concatenate([e.b_1, np.full(extra, -1.0)]),
                   canonical(sp.hstack([e.W_2, sp.csr_matrix((stack.d, extra))])))
    experts = list(part.experts)
    experts[k] = grown
    if layer == 1:
        mutant = Stack(stack.first.replace(experts=tuple(experts), neuron_labels=None), stack.second)
    else:
        mutant = _with_second(stack, experts=tuple(experts))
    report = verify_layers(ts, mutant, model.epsilon)
    capital = next(t for t in report.tasks if t.name == "capital")
    assert not any(report.failing_queries.values())
    assert not capital.size_ok and not report.certified


def _query(stack: Stack, words: str, valid: list[str], target: str, factored_ts=None):
    """The pass on one query of the weights' tokens (row by row, or factored over ``factored_ts``'s
    entities): its result."""
    ids = [stack.vocab.index(t) for t in words.split()]
    entities = None if factored_ts is None else np.arange(factored_ts.vocabulary.n_words,
                                                           len(factored_ts.vocabulary))
    pas = LayersPass(stack, entities)
    vals = np.array(sorted(stack.vocab.index(t) for t in valid), np.int64)
    yes = np.array([True])
    return pas.run_batch(np.array([ids]), np.array([0, vals.size]), vals, np.array([stack.vocab.index(target)]),
                         yes, yes)


@pytest.mark.parametrize("factored", [False, True])
def test_an_error_of_exactly_zero_is_enclosed_when_every_exp_underflows(small, factored):
    """Every token valid: the error (and each ablated one) is exactly 0. With U scaled by 2^64
    the logits' radii exceed 740, so every exp's lower end is 0 and the valid mass's lower end
    rounds below 0; the old ratio divided by that negative denominator and gave the upper end
    −3 (the enclosure [0, −3] missed 0)."""
    ts, _, stack = small
    w = stack.first
    big = Stack(w.replace(U=canonical(sp.csr_matrix(w.U) * 2.0 ** 64)), stack.second)
    res = _query(big, "Curie was born in", list(w.vocab), "Poland", ts if factored else None)
    ex = LayersOracle(60).query(big, tuple(w.vocab.index(t) for t in "Curie was born in".split()),
                                frozenset(range(len(w.vocab))), w.vocab.index("Poland"))
    assert ex["error"] == 0 and ex["ablated1"] == 0 and ex["ablated2"] == 0
    assert res.err_lo[0] <= 0.0 <= res.err_hi[0], (res.err_lo, res.err_hi)
    for hop in (1, 2):
        assert res.ablated[hop][0][0] <= 0.0 <= res.ablated[hop][1][0], (hop, res.ablated[hop])


def test_the_one_layer_passes_readout_of_the_same_row_is_sound(small):
    """The readout's ratio is the one-layer passes' too (row by row and factored): the same
    row, every token valid, contains its error 0 there, and ρ (a probability, >= 0) gets no
    upper end below 0 (the old ρ upper ends were −12.3 and −2.4e-15: the masses' lower ends,
    all 0, rounded below 0 and divided by)."""
    from verifier.passes.factored import FactoredPass, Split
    from verifier.passes.forward import Prepared, run_batch

    ts, _, stack = small
    w = stack.first
    big = w.replace(U=canonical(sp.csr_matrix(w.U) * 2.0 ** 64))
    V = len(w.vocab)
    tokens = np.array([[w.vocab.index(t) for t in "Curie was born in".split()]])
    plain = run_batch(Prepared(big), tokens, np.array([0, V]), np.arange(V))
    factored = FactoredPass(Prepared(big), Split.of(big, np.arange(ts.vocabulary.n_words, V))).run_batch(
        tokens, np.array([0, V]), np.arange(V))
    for res in (plain, factored):
        assert res.err_lo[0] <= 0.0 <= res.err_hi[0], (res.err_lo, res.err_hi)
        assert not (res.rho_hi[0] < 0.0), res.rho_hi


@pytest.mark.parametrize("factored", [False, True])
def test_a_gap_below_the_float_range_is_bounded_by_minus_infinity(small, factored):
    """U reads Warsaw's logit as LARGEST·(y_one + y_pos:10), where both coordinates are exactly 1
    at the composed object query (with or without either layer's expert): its exact logit is
    2·LARGEST and every other token's is small, so the exact gap max_{t != o} z_t − z_o is about
    −3.6e308, below every float. Its lower bound must be −∞; the old pass turned the −∞ of a
    row whose logits overflow into −LARGEST (numpy's nan_to_num), above the exact gap."""
    ts, _, stack = small
    w = stack.first
    labels = list(w.residual_labels)
    U = sp.lil_matrix(w.U, copy=True)
    for col in ("one", "pos:10"):
        U[w.vocab.index("Warsaw"), labels.index(col)] = np.finfo(float).max
    big = Stack(w.replace(U=canonical(U.tocsr())), stack.second)
    res = _query(big, "the capital of the country where Curie was born is", ["Warsaw"], "Warsaw",
                 ts if factored else None)
    for hop in (1, 2):
        assert res.ablated[hop][3][0] == -np.inf, (hop, res.ablated[hop])
