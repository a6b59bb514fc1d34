"""Belady's optimum for the block replay: evict the block whose next use is farthest.

What exactly is computed (``belady_hit_rate``): the offline MIN policy over the
same request sequence, capacity and metric as ``tiering.blocks.replay``.
Next use is measured in requests (blocks of one request are read together).
A block is not admitted when its next use is farther than that of every cached
block, or never comes (bypass). Ties in next use are broken deepest first
(``prefix_ties=True``): a block's next use is never sooner than its parent's
(whoever reads a block reads its whole prefix), so with that tie break the
cached set stays prefix-closed, every cached block that is read is also a
prefix hit, and the result is the optimum of the prefix metric as well as of
the plain block hit rate. ``prefix_ties=False`` breaks ties shallowest first,
as a block cache that knows nothing of chains would; it then evicts parents
whose children stay behind unreachable, and scores a little lower.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import NamedTuple

__all__ = ["BeladyResult", "belady_hit_rate", "next_uses"]

_NEVER = 1 << 62


class BeladyResult(NamedTuple):
    capacity_blocks: int
    accesses: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def next_uses(chains: Sequence[Sequence[Hashable]]) -> list[list[int]]:
    """For each request and block, the index of the next request that reads that block."""
    nxt: dict[Hashable, int] = {}
    out: list[list[int]] = [[]] * len(chains)
    for i in range(len(chains) - 1, -1, -1):
        chain = chains[i]
        out[i] = [nxt.get(b, _NEVER) for b in chain]
        for b in chain:
            nxt[b] = i
    return out


def belady_hit_rate(
    chains: Sequence[Sequence[Hashable]], capacity_blocks: int, prefix_ties: bool = True
) -> BeladyResult:
    if not isinstance(capacity_blocks, int) or isinstance(capacity_blocks, bool) or capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be an int >= 1, got {capacity_blocks!r}")
    nu = next_uses(chains)
    cache: dict[Hashable, int] = {}
    heap: list[tuple[int, int, int, Hashable]] = []  # (-next use, tie, seq, key)
    hits = accesses = seq = 0
    sign = -1 if prefix_ties else 1
    for i, chain in enumerate(chains):
        accesses += len(chain)
        for b in chain:
            if b not in cache:
                break
            hits += 1
        uses = nu[i]
        for depth, b in enumerate(chain):
            n = uses[depth]
            if b in cache:
                cache[b] = n
                seq += 1
                heapq.heappush(heap, (-n, sign * depth, seq, b))
                continue
            if n == _NEVER:
                continue
            if len(cache) >= capacity_blocks:
                while True:  # drop stale heap entries
                    top = heap[0]
                    if cache.get(top[3]) == -top[0]:
                        break
                    heapq.heappop(heap)
                if -top[0] <= n:
                    continue  # every cached block is needed sooner: bypass
                heapq.heappop(heap)
                del cache[top[3]]
            cache[b] = n
            seq += 1
            heapq.heappush(heap, (-n, sign * depth, seq, b))
    return BeladyResult(capacity_blocks, accesses, hits)
