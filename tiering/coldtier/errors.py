"""The cold tier's own exceptions (no client library's exception crosses this package)."""

from __future__ import annotations

from tiering.errors import ColdTierError, ColdTierUnavailable, LeaseHeld, LeaseLost

__all__ = ["ColdTierError", "ColdTierUnavailable", "LeaseHeld", "LeaseLost"]
