"""Least recently used first: the request idle the longest goes first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from policies.base import Candidate, Policy, check_now, rank_by

_LAST_USED = attrgetter("last_used")


@dataclass(frozen=True)
class LRU(Policy):
    """Smallest ``last_used`` first; ties by ``rid`` (then ``resource``).

    Needs no priority from any resource.
    """

    name = "lru"
    needs_priority_from = None

    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        check_now(now)
        return rank_by(candidates, _LAST_USED)
