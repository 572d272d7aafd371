"""Claim: a CERTIFIED verdict is a proof that every check holds on every query.

:mod:`.verify` decides error, routing, size and entanglement over every query and names a
counterexample for each failure; :mod:`.classes` groups the per-query numbers a certificate
keeps; :mod:`.report` and :mod:`.plots` render the verdict; :mod:`.certify` and
:mod:`.explain` answer for single prefixes; :mod:`.accessible` proves which sequences greedy
decoding can be made to output.
"""
