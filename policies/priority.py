"""Priority first: the request its resource most wants gone goes first."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tiering.policies.base import CandidateBatch, Policy


@dataclass(frozen=True)
class Priority(Policy):
    """Highest ``Candidate.priority`` first, then least recently used, then ``rid``.

    ``resource`` names the resource whose ``get_offload_priority`` fills
    ``Candidate.priority``; the controller asks that resource only, and leaves
    ``priority`` at 0.0 for everything else (so those rank by recency alone).
    Needs no reclaimable bytes to order.
    """

    resource: str
    name = "priority"
    reads_reclaimable = False

    def __post_init__(self) -> None:
        if not isinstance(self.resource, str) or not self.resource:
            raise ValueError(
                f"Priority.resource must be a non-empty str naming a resource, "
                f"got {self.resource!r}"
            )

    @property
    def needs_priority_from(self) -> str:  # type: ignore[override]
        return self.resource

    def sort_keys(self, batch: CandidateBatch, now: float) -> tuple[np.ndarray, ...]:
        return (-batch.priority, batch.last_used)
