"""Largest first: free the most bytes with the fewest offloads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from policies.base import Candidate, Policy, check_now, rank_by

_RECLAIMABLE = attrgetter("reclaimable")


@dataclass(frozen=True)
class LargestFirst(Policy):
    """Most ``reclaimable`` bytes first, then least recently used, then ``rid``."""

    name = "largest"
    needs_priority_from = None

    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        check_now(now)
        # int64 keys: byte counts compare exactly, even above 2**53.
        sizes = np.fromiter(map(_RECLAIMABLE, candidates), dtype=np.int64, count=len(candidates))
        return rank_by(candidates, sizes, descending=True, then=("last_used", "rid", "resource"))
