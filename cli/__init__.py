"""The composition root: the command line, and the only code that puts the construction
and the verifier together.

* :mod:`cli.main`: ``python -m verifier`` (check, inspect, build, explain, plot);
* :mod:`cli.compose`: build-and-verify, attaching the construction's evidence (closed
  form, isolation) to the verifier's report;
* :mod:`cli.plots`: the pictures that need both (error bound and measured error against β).
"""
