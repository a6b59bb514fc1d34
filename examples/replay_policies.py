"""A user-written retention policy, for ``tiering replay --policy examples.replay_policies:IdleBytes``.

``IdleBytes`` evicts first what has cost the most memory for nothing: idle
seconds times bytes held, discounted by what bringing it back would cost
(the replay fills ``reload_cost_s`` from the hardware preset's links). Run
it next to the built-ins from the repository root::

    tiering replay benchmarks/traces/mooncake/conversation_trace.jsonl --out out \\
        --policy lru,cost,examples.replay_policies:IdleBytes

It orders the live idle requests the controller offloads; cached prefix
blocks are kept by the block policy (``--block-policy``; see
the README's "Trace replay" section). ``--policy-option cost_weight=2`` sets its option; options go to every policy
named, so give them with this policy alone (the built-ins take no
``cost_weight`` and the run would stop with exit status 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policies import CandidateBatch, Policy


@dataclass(frozen=True)
class IdleBytes(Policy):
    """Highest ``idle_s * bytes / (1 + cost_weight * reload_cost_s)`` first.

    ``cost_weight``: how strongly an expensive reload protects a candidate
    (0: plain idle bytes).
    """

    cost_weight: float = 1.0
    name = "idle-bytes"

    def __post_init__(self) -> None:
        w = self.cost_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (
            math.isfinite(w) and w >= 0
        ):
            raise ValueError(f"IdleBytes.cost_weight must be a finite number >= 0, got {w!r}")

    def sort_keys(self, batch: CandidateBatch, now: float) -> tuple[np.ndarray, ...]:
        idle = np.maximum(now - batch.last_used, 0.0)
        size = batch.reclaimable.astype(np.float64)
        return (-(idle * size) / (1.0 + self.cost_weight * batch.reload_cost_s),)
