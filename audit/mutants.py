"""Mutation testing of the verifier: the operators (:mod:`audit.operators`) and the
campaign that judges their mutants (:mod:`audit.campaign`), under one name."""

from audit.campaign import *  # noqa: F401,F403
from audit.campaign import _false_failure_reason, _oracle, _reason_key  # noqa: F401
from audit.operators import *  # noqa: F401,F403
from audit.operators import (_arrays_with_entries, _csr, _labels, _neuron_label, _non_canonical,  # noqa: F401
                             _residual, _residual_label, _set, _task, _with_dimension)
