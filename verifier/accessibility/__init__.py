"""Claim: a sequence certified accessible is what greedy decoding outputs from every prompt of its box.

:mod:`.accessible` certifies, step by step over input boxes (:mod:`verifier.passes.boxes`),
which sequences greedy decoding can be made to output from token prompts (every one, up to
a length) and from soft prompts (boxes around the centres a search proposes), and bounds
how many there can be; :mod:`.report` renders the analysis (text, JSON, the proofs read
back for a recheck) and :mod:`.plots` draws it.
"""
