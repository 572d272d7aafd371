"""Claim: where a pass runs never changes what it returns.

One runner (:mod:`.runner`) cuts the weights, runs batches, defers rows that reach outside
a cut and merges the results in the order sent, whether on local processes
(:mod:`.parallel`), on shards of tasks (:mod:`.shards`) or on a Dask cluster (:mod:`.cluster`).
"""
