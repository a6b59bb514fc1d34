"""Reference points for prefix reuse on one trace: an infinite cache and Belady's MIN.

Both work on blocks (``block_tokens`` prompt tokens per block id, as in a
Mooncake trace) and count hits the way the replay does: a request reuses
the longest run of its leading full prompt blocks that the cache holds, and
always computes at least its last prompt token. Requests are taken in
arrival order and each one's full blocks are in the cache from the next
request on (the replay only keeps them once the request finishes, so both
figures are upper bounds for it).

- ``infinite``: nothing is ever evicted.
- ``belady``: ``capacity_blocks`` blocks under ``tiering.blocks.belady`` (the
  block index's offline MIN: a block is not admitted when its next use is
  farther than every cached block's; ties broken deepest first, which keeps
  the cached set prefix-closed and makes it the optimum of the prefix
  metric), at the replay's whole capacity (device + host + disk), not per
  tier.

``BoundResult`` holds the block and token hit rates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from tiering.apps.replay.traces import TraceRequest
from tiering.blocks.belady import belady_hit_rate


class BoundResult(NamedTuple):
    """Hit rates of one bound: blocks reused / full prompt blocks, tokens reused /
    prompt tokens (requests with block ids only)."""

    name: str
    capacity_blocks: float  # math.inf for the infinite cache
    block_hit_rate: float
    token_hit_rate: float
    blocks: int
    tokens: int


def _chains(trace: Sequence[TraceRequest], block_tokens: int) -> list[tuple[tuple[int, ...], int]]:
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    return [
        (tuple(t.hash_ids[: t.input_tokens // block_tokens]), t.input_tokens)
        for t in sorted(trace, key=lambda t: t.arrival_s)
        if t.hash_ids
    ]


def _result(name: str, cap: float, chains, depths: list[int], block_tokens: int) -> BoundResult:
    blocks = sum(len(c) for c, _ in chains)
    tokens = sum(n for _, n in chains)
    reused = sum(min(d * block_tokens, n - 1) if d else 0
                 for d, (_, n) in zip(depths, chains, strict=True))
    return BoundResult(name, cap, sum(depths) / blocks if blocks else 0.0,
                       reused / tokens if tokens else 0.0, blocks, tokens)


def infinite(trace: Sequence[TraceRequest], block_tokens: int) -> BoundResult:
    """Hit rates with a cache that keeps every block forever."""
    chains = _chains(trace, block_tokens)
    seen: set[int] = set()
    depths = []
    for chain, _ in chains:
        d = 0
        for b in chain:
            if b not in seen:
                break
            d += 1
        depths.append(d)
        seen.update(chain)
    return _result("infinite", math.inf, chains, depths, block_tokens)


def belady(trace: Sequence[TraceRequest], block_tokens: int, capacity_blocks: int) -> BoundResult:
    """Hit rates of Belady's MIN with ``capacity_blocks`` blocks: the block index's own
    ``tiering.blocks.belady`` (ties broken deepest first, so it is the optimum of the
    prefix metric), over the same chains as ``infinite``.

    Its block hit rate is exact. Its token hit rate counts ``block_tokens`` per hit
    block: it leaves out the one-token clip of a prompt that is an exact multiple of
    the block size and hits in full, so it may be above the exact figure by at most
    (such prompts) / (prompt tokens) -- still an upper bound for the replay. It is
    then cut to the infinite cache's exact figure: MIN only ever holds blocks already
    seen, so no request reuses more under it than under the infinite cache (without
    the cut, a trace of such prompts showed a Belady bound above the infinite one).
    """
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or (
        capacity_blocks < 0
    ):
        raise ValueError(f"capacity_blocks must be an int >= 0, got {capacity_blocks!r}")
    chains = _chains(trace, block_tokens)
    blocks = sum(len(c) for c, _ in chains)
    tokens = sum(n for _, n in chains)
    hits = belady_hit_rate([c for c, _ in chains], capacity_blocks).hits if (
        capacity_blocks and blocks
    ) else 0
    token_rate = min(hits * block_tokens, tokens) / tokens if tokens else 0.0
    if hits:
        token_rate = min(token_rate, infinite(trace, block_tokens).token_hit_rate)
    return BoundResult("belady", capacity_blocks, hits / blocks if blocks else 0.0,
                       token_rate, blocks, tokens)
