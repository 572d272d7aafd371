"""Moved to :mod:`verifier.accessibility.accessible` (the accessibility room); this name stays
for the command line's import until it imports the new one."""

from verifier.accessibility.accessible import *  # noqa: F401,F403
