"""Priority first: the request its resource most wants gone goes first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from policies.base import Candidate, Policy, check_now, rank_by

_PRIORITY = attrgetter("priority")


@dataclass(frozen=True)
class Priority(Policy):
    """Highest ``Candidate.priority`` first, then least recently used, then ``rid``.

    ``resource`` names the resource whose ``get_offload_priority`` fills
    ``Candidate.priority``; the controller asks that resource only, and leaves
    ``priority`` at 0.0 for everything else (so those rank by recency alone).
    """

    resource: str
    name = "priority"

    def __post_init__(self) -> None:
        if not isinstance(self.resource, str) or not self.resource:
            raise ValueError(
                f"Priority.resource must be a non-empty str naming a resource, "
                f"got {self.resource!r}"
            )

    @property
    def needs_priority_from(self) -> str:  # type: ignore[override]
        return self.resource

    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        check_now(now)
        return rank_by(
            candidates, _PRIORITY, descending=True, then=("last_used", "rid", "resource")
        )
