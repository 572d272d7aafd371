"""Moved to :mod:`verifier.accessibility.report` (the accessibility room); this name stays
for the command line's import until it imports the new one."""

from verifier.accessibility.report import *  # noqa: F401,F403
