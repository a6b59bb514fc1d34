"""Largest first: free the most bytes with the fewest offloads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tiering.policies.base import CandidateBatch, Policy


@dataclass(frozen=True)
class LargestFirst(Policy):
    """Most ``reclaimable`` bytes first, then least recently used, then ``rid``."""

    name = "largest"
    needs_priority_from = None

    def sort_keys(self, batch: CandidateBatch, now: float) -> tuple[np.ndarray, ...]:
        # int64 keys: byte counts compare exactly, even above 2**53; every
        # count is in [0, 2**63), so its negation cannot overflow.
        return (-batch.reclaimable, batch.last_used)
