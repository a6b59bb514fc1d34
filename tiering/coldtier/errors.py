"""The cold tier's own exceptions (no client library's exception crosses this package)."""

from __future__ import annotations

__all__ = ["ColdTierError", "ColdTierUnavailable", "LeaseHeld", "LeaseLost"]


class ColdTierError(Exception):
    """Base class of every error the cold tier raises."""


class ColdTierUnavailable(ColdTierError):
    """The object store cannot be reached or refuses our credentials (raised at start-up)."""


class LeaseHeld(ColdTierError):
    """Another live worker holds the private prefix asked for."""


class LeaseLost(ColdTierError):
    """This worker's lease was taken over (it expired without renewal); stop writing."""
