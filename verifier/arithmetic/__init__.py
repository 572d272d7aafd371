"""Claim: every number this room returns encloses the real value it stands for.

Mid-radius intervals in float64 with every radius rounded upward (:mod:`.interval`), the
same operations compiled row by row, and the one set of constants both use
(:mod:`.constants`), so that the numpy and the compiled enclosures are the same (a test
compares them bit for bit).

The compiled kernels, in one vocabulary: the rounding steps and factors
(:mod:`.rounding`), the sparse accumulators and the rows they hand back
(:mod:`.accumulate`), the exponential's enclosure (:mod:`.exponential`), what a deployed
format's rounding adds (:mod:`.deployed`), then one module per stage of a layer, each with
the plain pass's kernel beside its factored twin over the same functions: the residual
(:mod:`.residual`), the gate (:mod:`.gate`), the experts (:mod:`.experts`), and the readout
run once on top (:mod:`.logits`: logits, the error, the ablation). How they run, ahead of
time or just in time: :mod:`.kernel_forms`.
"""
