"""User-written retention policies: ``IdleBytes`` for ``tiering replay --policy
examples.replay_policies:IdleBytes`` (live requests), ``KeepHeads`` for ``--block-policy
examples.replay_policies:KeepHeads`` (cached prefix blocks).

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
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import numpy as np
from tiering.policies import CandidateBatch, Policy
from tiering.policies.blocks import BlockInfo, BlockPolicy


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


class KeepHeads(BlockPolicy):
    """A block policy: least recently used first, but the first ``head`` blocks of every
    chain (a system prompt, a conversation's opening turns) only after every deeper one.

    For ``tiering replay --block-policy lru,chain,examples.replay_policies:KeepHeads``;
    it passes ``tiering.testing.blocks.check_block_policy`` like the built-ins.
    """

    name = "keep-heads"

    def __init__(self, capacity: int | None = None, head: int = 4) -> None:
        if isinstance(head, bool) or not isinstance(head, int) or head < 1:
            raise ValueError(f"KeepHeads.head must be an int >= 1, got {head!r}")
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
        ):
            raise ValueError(f"KeepHeads.capacity must be an int >= 1, got {capacity!r}")
        self.head = head
        self._heads: OrderedDict[Hashable, None] = OrderedDict()  # depth < head, oldest first
        self._deep: OrderedDict[Hashable, None] = OrderedDict()  # the rest, oldest first

    def __len__(self) -> int:
        return len(self._heads) + len(self._deep)

    def __contains__(self, key: object) -> bool:
        return key in self._heads or key in self._deep

    def _queue_of(self, key: Hashable) -> OrderedDict | None:
        if key in self._deep:
            return self._deep
        return self._heads if key in self._heads else None

    def on_insert(self, info: BlockInfo, now: float) -> None:
        if info.key in self:
            raise ValueError(f"keep-heads: on_insert of block {info.key!r}, already tracked")
        (self._heads if info.depth < self.head else self._deep)[info.key] = None

    def on_hit(self, info: BlockInfo, now: float) -> None:
        queue = self._queue_of(info.key)
        if queue is None:
            raise ValueError(f"keep-heads: on_hit of block {info.key!r}, not tracked")
        queue.move_to_end(info.key)

    def on_remove(self, key: Hashable) -> None:
        queue = self._queue_of(key)
        if queue is None:
            raise ValueError(f"keep-heads: on_remove of block {key!r}, not tracked")
        del queue[key]

    def victims(self, now: float) -> Iterator[Hashable]:
        yield from self._deep
        yield from self._heads
