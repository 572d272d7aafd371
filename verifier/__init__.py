"""The verifier: reads a :class:`layout.Weights` and a task set, and proves (or refutes) the checks.

It knows nothing of how the weights were made. Five rooms, each importing only the
rooms before it (``tests/test_architecture.py`` holds the order):

1. :mod:`verifier.arithmetic`: enclosures of real numbers in float64 (interval arithmetic,
   the compiled kernels, their shared constants);
2. :mod:`verifier.passes`: forward passes over batches of queries (the certified exact pass,
   the deployed floating-point pass with its execution model, the box pass, a plain float64
   reference);
3. :mod:`verifier.running`: where a pass runs (local processes, shards, a Dask cluster) behind
   one runner;
4. :mod:`verifier.checks`: the verdict over every query of a task set (error, routing, size,
   entanglement), its report, per-query results and explanations, accessibility;
5. :mod:`verifier.certificates`: a verdict kept on disk, and re-certifying an edit from it.
"""
