"""Claim: for every query of a batch, each pass returns enclosures of what the model computes.

:mod:`.batches` cuts the queries into arrays of one prefix length; :mod:`.forward` is the
certified pass (the exact model, or with :mod:`.floating` every execution deployed in a
floating-point format, whose operations and stored results :mod:`.execution` lists as
data), :mod:`.factored` the exact pass with what query rows share enclosed once, and
:mod:`.protocol` what each of them offers whoever runs it; :mod:`.boxes` runs over input
boxes (soft prompts); :mod:`.reference` is a plain float64 pass for comparison, certifying
nothing.
"""
