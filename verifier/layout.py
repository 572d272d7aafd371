"""Moved to the top-level package :mod:`layout` (the weight layout is shared by the
construction and the verifier, and belongs to neither). Kept so that existing scripts
importing ``verifier.layout`` keep working."""

from layout import *  # noqa: F401,F403
from layout import __all__  # noqa: F401
