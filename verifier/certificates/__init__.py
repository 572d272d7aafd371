"""Claim: re-certifying an edit from a saved certificate gives the verdict a full check would.

:mod:`.certificate` saves and loads what a verification certified (never replacing a
directory it did not write); :mod:`.locality` computes what a change of the weights can
reach; :mod:`.incremental` runs again only the queries an edit can reach and reuses every
other class, each "unchanged" decision resting on an exact comparison.
"""
