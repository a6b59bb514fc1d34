"""Least recently used first: the request idle the longest goes first."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tiering.policies.base import CandidateBatch, Policy


@dataclass(frozen=True)
class LRU(Policy):
    """Smallest ``last_used`` first; ties by ``rid`` (then ``resource``).

    Needs no priority from any resource, and no reclaimable bytes to order.
    """

    name = "lru"
    needs_priority_from = None
    reads_reclaimable = False

    def sort_keys(self, batch: CandidateBatch, now: float) -> tuple[np.ndarray, ...]:
        return (batch.last_used,)
