"""Re-certification after the vocabulary grows or shrinks (verifier.certificates.incremental):
ρ = 1/Σ_t e^(z_t), the weight of a token of logit exactly 0 relative to a row's softmax sum,
is a probability only when the row has such a token. A row that reaches every token with a
negative logit has ρ > 1, and a class reused after tokens are added must grow its error with
that ρ, not with ρ capped at 1 (which made e'_hi = 1 − (1 − e)/(1 + Δ) and certified
classes a full check fails, for ε above 1/2)."""

from __future__ import annotations

from fractions import Fraction

from verifier.certificates.incremental import _grown


def _exact(e: Fraction, rho: Fraction, d: int) -> tuple[Fraction, Fraction]:
    return 1 - (1 - e) / (1 + d * rho), rho / (1 + d * rho)


def test_grown_encloses_rho_above_one_after_tokens_are_removed():
    """A row with one token of logit 0, not valid (ρ = 0.8: the other tokens' e^z sum to 1/4;
    error 0.875), loses it (Δ = −1): ρ' = 1/(1/4) = 4, not 1, and e' = 0.375."""
    e, rho = Fraction(0.875), Fraction(0.8)
    lo, hi, r_lo, r_hi = _grown([0.875], [0.875], [0.8], [0.8], -1)
    e_x, rho_x = _exact(e, rho, -1)
    assert abs(rho_x - 4) < 1e-14 and abs(e_x - Fraction(3, 8)) < 1e-14
    assert Fraction(r_lo[0]) <= rho_x <= Fraction(r_hi[0])
    assert Fraction(lo[0]) <= e_x <= Fraction(hi[0])


def test_grown_encloses_the_error_for_rho_above_one():
    """ρ = 35.5 (every token reached, Σ e^z ≈ 0.028), one token added: e' from 0.23 to 0.979."""
    for d in (1, 2, 7):
        e, rho = Fraction(0.23), Fraction(35.5)
        lo, hi, r_lo, r_hi = _grown([0.23], [0.23], [35.5], [35.5], d)
        e_x, rho_x = _exact(e, rho, d)
        assert Fraction(lo[0]) <= e_x <= Fraction(hi[0]) and hi[0] > 0.97
        assert Fraction(r_lo[0]) <= rho_x <= Fraction(r_hi[0])


TEXT = """epsilon: 0.9
parameters: {gamma: 2.125}
tasks:
  - name: home
    templates:
      - ⋆1 lives in ⋆2
    facts: {Ann: Rome, Bob: Oslo, Cid: Lima, Dee: Rome}
  - name: job
    templates:
      - ⋆1 works as ⋆2
    facts: {Bob: baker, Cid: cook}
"""


def test_a_class_whose_rows_reach_every_token_is_not_reused_as_certified_after_a_token_is_added():
    """Weights whose unembedding lowers every token's logit by 8 where the current word is
    "lives" (softmax unchanged there: every query still certifies at ε = 0.9, worst error
    0.23 at "X lives", ρ ≈ 35.6). Adding the fact Eve: cook adds one token, of logit 0
    at "X lives": the error there becomes 0.979 (a full check fails those 4 queries). The
    re-certification reuses their class and must fail them too; with ρ's upper end capped
    at 1 it bounded them by 0.616 and certified the edited set."""
    from construction.model import build
    from construction.numbering import correspondence, numbering
    from tasks.reading import loads_tasks
    from tasks.structure import StructureTrie
    from verifier.certificates.certificate import Certificate, task_hash
    from verifier.certificates.incremental import recertify
    from verifier.certificates.locality import Correspondence, watched_neurons
    from verifier.checks.classes import FLOATS, CellPlan, ClassRecorder
    from verifier.checks.verify import verify

    ts = loads_tasks(TEXT)
    new = loads_tasks(TEXT.replace("Cid: cook}", "Cid: cook, Eve: cook}"))
    model = build(ts)
    old_tokens = list(model.instantiate().vocab)

    def lowered(m):
        """Every token of the old vocabulary 8 lower wherever the current word is "lives"."""
        w = m.instantiate()
        U = w.U.tolil()
        j = w.residual_labels.index("word:lives")
        for name in old_tokens:
            t = list(w.vocab).index(name)
            U[t, j] = U[t, j] - 8.0
        return w.replace(U=U.tocsr())

    w = lowered(model)
    trie = StructureTrie(ts)
    plan, watched = CellPlan.of(ts, trie), watched_neurons(w)
    recorder = ClassRecorder.for_weights(ts, trie, plan, w, model.epsilon, watched)
    report = verify(ts, w, model.epsilon, classes=recorder)
    assert report.verdict == "certified"
    table = recorder.table()
    old = Certificate(model.epsilon, report.verdict, ts, w, table, plan, watched, {},
                      {t.name: task_hash(t) for t in ts.tasks}, {})
    w2 = lowered(build(new, beta=float(model.beta), gamma=float(model.gamma)))
    assert len(w2.vocab) == len(w.vocab) + 1
    cor = Correspondence(**correspondence(numbering(ts), numbering(new)))
    full = verify(new, w2, model.epsilon)
    inc, _, _, info = recertify(old, new, w2, cor, model.epsilon)
    assert info.mode == "incremental" and info.vocabulary_delta == 1
    home_full = next(r for r in full.tasks if r.name == "home")
    home_inc = next(r for r in inc.tasks if r.name == "home")
    assert full.verdict != "certified" and home_full.counts["over_epsilon"] == 4
    assert home_full.worst_error > 0.97
    assert inc.verdict == full.verdict
    assert home_inc.counts == home_full.counts
    assert home_inc.worst_error >= home_full.worst_error_lower
    assert table.floats[:, FLOATS.index("rho_hi")].max() > 35   # the class of "X lives": ρ ≈ 35.6
