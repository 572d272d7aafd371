"""Claim: a CERTIFIED verdict is a proof that every check holds on every query.

:mod:`.catalogue` lists the checks, one entry each (how a query is decided, what is counted
per task, when a task holds it, how a failure reads); :mod:`.verify` decides error, routing,
size and entanglement over every query and names a counterexample for each failure;
:mod:`.classes` groups the per-query numbers a certificate keeps; :mod:`.report` and
:mod:`.plots` render the verdict; :mod:`.certify` and :mod:`.explain` answer for single
prefixes. (``accessible``, ``accessible_report`` and ``accessible_plots`` here only name the
modules of :mod:`verifier.accessibility`, for the command line's imports.)
"""
