"""Test machinery for the verifier, kept apart from the shipped certification core.

* :mod:`audit.oracle`: an independent judge of whether weights truly violate a
  requirement (its own query enumeration, exact linear algebra, exp at 40+ digits);
* :mod:`audit.exact`: a straightforward 60-digit forward pass (mpmath);
* :mod:`audit.mutants`: mutation operators on weights and the campaign that compares
  the verifier's verdict with the oracle's (``scripts/mutation_testing.py``).

Nothing in :mod:`tasks`, :mod:`layout`, :mod:`construction` or :mod:`verifier` imports
this package; it is not installed (the tests and scripts run it from the repository).
"""
