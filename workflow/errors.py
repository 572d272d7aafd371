"""What a command stops on besides bad input (:class:`tasks.errors.TaskError`)."""

from __future__ import annotations


class NotCertified(Exception):
    """A command verified what it was asked to and the certificate does not hold, so it
    stops: one line, exit status 1 (not bad input)."""


def unconstructible(exc: Exception) -> bool:
    """The error is the construction's refusal of the task set (no gate routes it, or no model
    can route it), for which ``inspect`` lists the smallest changes that make it constructible."""
    from construction.gate import RoutingError

    return isinstance(exc, RoutingError) or "no model can route" in getattr(exc, "problem", "")
