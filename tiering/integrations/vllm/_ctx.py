"""What the vLLM manager's parts share: one ``Ctx``, made by ``TieredBlockManager``.

Each part of the manager (``_host``, ``_disk``, ``_reads``, ``_staging``, ``_cold``,
``_cascade``, ``_protocol``) owns its own tables; what every one of them reads and
updates is here, owned by this object alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from tiering.blocks import BlockIndex
from tiering.integrations.vllm._config import TieredConfig
from tiering.integrations.vllm._state import Counters, Event
from tiering.resources.kv_prefix_rules import BlockRules
from tiering.types import Tier

__all__ = ["Ctx", "finished"]


def finished(jobs: dict[Any, Any], job: Callable[[Any], Future] = lambda v: v) -> Iterator:
    """Take the entries of ``jobs`` whose job (``job(value)``) is done out of it, in order,
    as (key, value) pairs; each is checked when reached, so one that finishes meanwhile
    is taken too."""
    for k, v in list(jobs.items()):
        if job(v).done():
            del jobs[k]
            yield k, v


class Ctx:
    """The manager's shared book.

    ``index`` (where every block is) and ``rules`` (every policy call) over it; the
    ``counters``; the KV ``events`` not yet taken; the I/O executor ``io``; the
    injected ``clock``; ``step`` (scheduler steps counted by ``maintain``); ``lost``
    (blocks found damaged whose drop waits for a busy job: key -> reason; they answer
    MISS); ``dirty`` (the state file is stale). Not thread-safe: the scheduler thread only.
    """

    rules: BlockRules  # set by the manager once its tiers' sizes are known
    io: Any  # set by the manager once its config is checked

    def __init__(self, cfg: TieredConfig, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.index = BlockIndex()
        self.clock = clock
        self.counters = Counters()
        self.events: list[Event] = []
        self.lost: dict[bytes, str] = {}
        self.step = 0
        self.dirty = True
        self._told: weakref.WeakSet[Any] = weakref.WeakSet()  # requests told (``tell``)

    def event(self, keys: Iterable[bytes], tier: str, removed: bool) -> None:
        self.events.append(Event(tuple(keys), tier, removed))

    def insert(self, key: bytes, parent: bytes | None, tier: Tier, handle: Any,
               now: float) -> None:
        """Index ``key`` on ``tier`` at ``handle`` and tell that tier's policy; a parent
        the index lacks, or holds as lost, is not linked (a chain's first block)."""
        if parent is not None and (parent not in self.index or parent in self.lost):
            parent = None
        ok = self.index.insert(key, parent, tier, handle, now)
        assert ok
        self.rules.arrived(key, tier, now)

    def ancestors(self, keys: Iterable[bytes]) -> set[bytes]:
        """The keys and every block the index links above them."""
        out: set[bytes] = set()
        for k in keys:
            if k in self.index:
                out.update(self.index.chain_keys(k))
        return out

    def tell(self, request: object, parent: bytes | None, keys: Sequence[bytes],
             tiers: Sequence[Tier], now: float) -> None:
        """Tell every tier's policy a request once (``BlockRules.tell``): its chain is the
        blocks the index links above ``keys`` (held by vLLM on the GPU: device hits),
        then ``keys``, of which the leading ``len(tiers)`` are hits there. ``request``: the
        caller's object for the request (None: each call is a request of its own)."""
        if request is not None:
            if request in self._told:
                return
            self._told.add(request)
        above = (list(self.index.chain_keys(parent))
                 if parent is not None and parent in self.index else [])
        chain, hit = list(above), [Tier.DEVICE] * len(above)
        seen = set(above)
        for i, k in enumerate(keys):  # a chain names each block once (a caller may repeat one)
            if k in seen:
                if i < len(tiers):
                    break  # the hits must lead: none after a repeated one
                continue
            seen.add(k)
            chain.append(k)
            if i < len(tiers) and len(hit) == len(chain) - 1:
                hit.append(tiers[i])
        self.rules.tell(chain, hit, now)
