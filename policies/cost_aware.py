"""Cost-aware: free the most bytes per second of future reload, favouring the idle.

For every candidate::

    reload_s = reload_cost_s                                          if reload_cost_s > 0
             = default_overhead_s + reclaimable / default_bandwidth_bps  otherwise
    idle_s   = max(0, now - last_used)
    score    = reclaimable / max(reload_s, EPS_S) * (1 + idle_s / aging_s)

(a candidate with nothing to reclaim scores 0.)

Highest score first; equal scores by ``rid`` (then ``resource``).

The first factor is the bytes freed per second it will cost to bring the
request back: a large request that is cheap to reload is the best victim. The
second grows without bound with idle time, so a small request that has not run
for long enough overtakes any fresh large one: with ``idle_s`` = ``aging_s`` its
score has doubled. ``default_overhead_s`` is the fixed part of a reload (stream
synchronisation, allocation), which makes large requests cheaper per byte when
their cost has to be estimated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tiering.policies.base import Candidate, CandidateBatch, Policy, check_batch, check_now

#: Floor on the reload time a score divides by, in seconds.
EPS_S = 1e-9


@dataclass(frozen=True)
class CostAware(Policy):
    """Rank by ``score`` (see the module docstring for the formula), highest first.

    ``aging_s``: idle seconds after which a candidate's score has doubled.
    ``default_bandwidth_bps``: bytes per second assumed for a reload whose cost
    is unknown (``reload_cost_s == 0``). ``default_overhead_s``: fixed seconds
    added to such an estimate.
    """

    aging_s: float = 30.0
    default_bandwidth_bps: float = 10e9
    default_overhead_s: float = 1e-3
    name = "cost"
    needs_priority_from = None

    def __post_init__(self) -> None:
        for field, value in (
            ("aging_s", self.aging_s),
            ("default_bandwidth_bps", self.default_bandwidth_bps),
        ):
            if not _finite_number(value) or value <= 0:
                raise ValueError(f"CostAware.{field} must be a finite number > 0, got {value!r}")
        if not _finite_number(self.default_overhead_s) or self.default_overhead_s < 0:
            raise ValueError(
                f"CostAware.default_overhead_s must be a finite number >= 0, "
                f"got {self.default_overhead_s!r}"
            )

    def reload_seconds(self, candidate: Candidate) -> float:
        """The expected seconds to bring ``candidate`` back (given, or estimated)."""
        if candidate.reload_cost_s > 0:
            return candidate.reload_cost_s
        return self.default_overhead_s + candidate.reclaimable / self.default_bandwidth_bps

    def score(self, candidate: Candidate, now: float) -> float:
        """The score of one candidate at time ``now``; higher is evicted first."""
        check_now(now)
        if not isinstance(candidate, Candidate):
            raise ValueError(
                f"CostAware.score: candidate must be a Candidate, got {type(candidate).__name__}"
            )
        if candidate.reclaimable == 0:
            return 0.0
        idle_s = max(0.0, now - candidate.last_used)
        reload_s = max(self.reload_seconds(candidate), EPS_S)
        return candidate.reclaimable / reload_s * (1.0 + idle_s / self.aging_s)

    def scores(self, candidates: Sequence[Candidate], now: float) -> list[float]:
        """``score`` of every candidate, computed in one vectorised pass."""
        check_now(now)
        if not candidates:
            return []
        return self.batch_scores(CandidateBatch.from_candidates(candidates), now).tolist()

    def batch_scores(self, batch: CandidateBatch, now: float) -> np.ndarray:
        """``score`` of every row of ``batch`` (float64); the batch must carry its bytes."""
        check_now(now)
        check_batch(batch, "CostAware.batch_scores")
        if batch.reclaimable is None:
            raise ValueError(
                "CostAware.batch_scores: the batch's reclaimable bytes were not asked for; "
                "the cost policy scores by them"
            )
        reclaimable = batch.reclaimable.astype(np.float64)
        given = batch.reload_cost_s
        estimated = self.default_overhead_s + reclaimable / self.default_bandwidth_bps
        reload_s = np.maximum(np.where(given > 0, given, estimated), EPS_S)
        with np.errstate(over="ignore", invalid="ignore"):  # extreme clocks give inf, not noise
            idle_s = np.maximum(now - batch.last_used, 0.0)
            score = reclaimable / reload_s * (1.0 + idle_s / self.aging_s)
        return np.where(reclaimable > 0, score, 0.0)

    def sort_keys(self, batch: CandidateBatch, now: float) -> tuple[np.ndarray, ...]:
        return (-self.batch_scores(batch, now),)


def _finite_number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )
