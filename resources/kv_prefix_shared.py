"""The block store's shared cold tier: the link, the fetches in flight, publishes.

``SharedLink`` is a ``PrefixCache``'s handle on the ``BlockQueue``; ``SharedBlocks``
publishes blocks there, maps blocks known to exist there as pending fetches, lands
them as host blocks and checks that bookkeeping. ``PrefixCache`` hands it the index,
the rules, the crc table, the counters and its ``BlockMoves``; the rules are in
``tiering.resources.kv_prefix``'s module docstring.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tiering.resources.kv_prefix_moves import BlockMoves
from tiering.resources.kv_prefix_types import BLOCKS, BlockParts, PrefixLoad, crc_page

from tiering.types import Tier

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.kv_records import RequestRecord


@dataclass
class _Fetch:
    """A block being fetched from the shared tier (not in the index until it lands).

    ``req`` maps it at ``pos`` (``shared`` -1); None once that request let it
    go (removed, cut), until the result arrives. ``payload`` / ``failed``: the
    result, kept until the blocks before it have landed."""

    key: bytes
    parent: bytes | None
    req: Any
    pos: int
    payload: bytes | None = None
    failed: str | None = None


class SharedLink:
    """A ``PrefixCache``'s handle on the shared cold tier: the queue, who owns it, the refresh timer."""

    def __init__(self, queue, owned: bool, refresh_s: float, now: float, source=None,
                 owner: str = "") -> None:
        self.source = source  # what enable_prefix_cache was given
        self.queue = queue
        self.blocks = queue.blocks
        self.owned = owned
        self.owner = owner
        self.refresh_s = refresh_s
        self.next_refresh = now

    @classmethod
    def open(cls, shared, root: bytes, geometry: bytes, clock, refresh_s, *, owner: str,
             block_bytes: int) -> SharedLink:
        """From a ``SharedTierConfig`` (its secret resolved first, then the store opened and
        probed: ``ColdTierUnavailable`` if it cannot be reached), a ``SharedBlockStore`` or a
        ``BlockQueue`` (claimed by ``owner``: one given to another cache is refused by name).
        ``root`` is the cache's key root (already derived with the geometry)."""
        from tiering.coldtier import BlockQueue, SharedBlockStore, SharedTierConfig, open_s3_store

        if isinstance(refresh_s, bool) or not isinstance(refresh_s, (int, float)) or not refresh_s > 0:
            raise ValueError(f"enable_prefix_cache: shared_refresh_s must be a number > 0, got {refresh_s!r}")
        if isinstance(shared, SharedTierConfig):
            keys = shared.trust.keys()  # no secret: refused before anything is opened
            store = open_s3_store(shared.url, shared.storage_options)
            blocks = SharedBlockStore(store, root, geometry, trust=keys if keys is not None else "unauthenticated",
                                      block_bytes=block_bytes, config=shared.tier, clock=clock)
            queue = BlockQueue(blocks)
            queue.claim(owner)
            return cls(queue, True, float(refresh_s), clock(), shared, owner)
        if isinstance(shared, SharedBlockStore):
            cls._check_ids(shared, root, geometry, block_bytes)
            queue = BlockQueue(shared)
            queue.claim(owner)
            return cls(queue, True, float(refresh_s), clock(), shared, owner)
        if isinstance(shared, BlockQueue):
            cls._check_ids(shared.blocks, root, geometry, block_bytes)
            shared.claim(owner)  # ValueError naming the cache that reads it already
            return cls(shared, False, float(refresh_s), clock(), shared, owner)
        raise ValueError("enable_prefix_cache: shared must be a SharedTierConfig, SharedBlockStore or"
                         f" BlockQueue, got {type(shared).__name__}")

    @staticmethod
    def _check_ids(blocks, root: bytes, geometry: bytes, block_bytes: int) -> None:
        if blocks.root != root:
            raise ValueError("enable_prefix_cache: the shared block store is under another root"
                             " (a cache's is derived from its root and geometry: use"
                             " PrefixCache.key_root)")
        if blocks.geometry != geometry:
            raise ValueError(f"enable_prefix_cache: the shared block store is for geometry"
                             f" {blocks.geometry!r}, the cache's is {geometry!r}")
        if blocks.block_bytes not in (None, block_bytes):
            raise ValueError(f"enable_prefix_cache: the shared block store's blocks are"
                             f" {blocks.block_bytes} bytes, the cache's pages {block_bytes}")

    @property
    def known(self):
        return self.blocks.known

    def same_source(self, shared) -> bool:
        return shared is self.source or (type(shared) is type(self.source) and shared == self.source)

    def close(self, timeout_s: float) -> None:
        if self.owned:
            self.queue.close(timeout_s)
        else:
            self.queue.release(self.owner)


class SharedBlocks:
    """The shared cold tier of one block store (see the module doc). It owns the link
    (``link``, None without a shared tier), the fetches in flight (``fetching``) and the
    refused publishes to retry (``unpublished``)."""

    def __init__(self, parts: BlockParts, moves: BlockMoves) -> None:
        self._s, self._index, self._rules, self._crc, self._stats, self._clock = parts
        self._moves = moves
        self.link: SharedLink | None = None
        self.fetching: dict[bytes, _Fetch] = {}
        self.unpublished: OrderedDict[bytes, None] = OrderedDict()

    def open(self, shared, root: bytes, refresh_s: float, owner: str) -> None:
        """Open the link (``SharedLink.open``) and queue its first refresh."""
        g = self._s.geometry
        self.link = SharedLink.open(shared, root, g.fingerprint().encode(), self._clock,
                                    refresh_s, owner=owner, block_bytes=g.page_bytes)
        self.refresh()

    def _now(self) -> float:
        return float(self._clock())

    def refresh(self) -> None:
        sh = self.link
        if sh.queue.submit_refresh():
            self._stats["shared_refreshes_queued"] += 1
        sh.next_refresh = self._now() + sh.refresh_s

    def publish(self, key: bytes, page: torch.Tensor) -> None:
        """Queue the write of a freshly published block (bytes copied now, written by the
        queue's threads). Refused when the block is known to exist there (no write needed),
        the queue is full or the store is not answering: then it is not written by this worker."""
        sh = self.link
        if sh is None:
            return
        if key in sh.known:
            self._stats["shared_publish_known"] += 1
            return
        if sh.queue.submit_publish(key, page.contiguous().view(torch.uint8).numpy(), self._crc.get(key)):
            self._stats["shared_publish_queued"] += 1
        else:
            self._stats["shared_publish_refused"] += 1
            self._retry_later(key)

    def _retry_later(self, key: bytes) -> None:
        """Remember a refused publish (bounded: the oldest is forgotten first)."""
        self.unpublished[key] = None
        self.unpublished.move_to_end(key)
        while len(self.unpublished) > self.link.blocks.config.max_queued:
            self.unpublished.popitem(last=False)
            self._stats["shared_publish_given_up"] += 1

    def _retry_publishes(self) -> None:
        """Queue refused publishes again while the queue has room and the store answers. A
        block no longer cached on the device or the host (or moving) is not retried."""
        sh = self.link
        c = self._s
        room = sh.blocks.config.max_queued - sh.queue.in_flight
        while self.unpublished and room > 0 and sh.blocks.breaker.would_allow():
            key, _ = self.unpublished.popitem(last=False)
            loc = self._index.location(key)
            if loc is None or loc.moving_to is not None or loc.tier is Tier.DISK or key in sh.known:
                continue
            page = c.dev[loc.handle].cpu() if loc.tier is Tier.DEVICE else c.host[loc.handle]
            # the worker thread checks the copy against the crc recorded at publish: a page
            # damaged since (on the host, say) is not sent for every other worker to map
            payload = page.contiguous().view(torch.uint8).numpy()
            if not sh.queue.submit_publish(key, payload, self._crc.get(key)):
                self.unpublished[key] = None
                self.unpublished.move_to_end(key, last=False)
                return
            room -= 1
            self._stats["shared_publish_retried"] += 1

    def attach(self, r: RequestRecord, keys, start: int, limit: int,
                       positions: list, tiers: list) -> None:
        """Map blocks ``keys[start:limit]`` known to exist on the shared tier as pending
        fetches (asks the local cache only; each fetch is queued, never waited for)."""
        sh = self.link
        T = self._s.geometry.page_tokens
        cap = self._s.host_pool.num_pages  # each lands in a host page
        for i in range(start, limit):
            key = keys[i]
            if key in self._index:
                break
            f = self.fetching.get(key)
            if f is not None:
                if f.req is not None:
                    break  # another request is fetching it
                f.req, f.pos = r, i  # a let-go fetch still in flight: adopt it
                self._stats["shared_fetch_adopted"] += 1
            else:
                if len(self.fetching) >= cap or key not in sh.known:
                    break
                if not sh.queue.submit_fetch(key):
                    self._stats["shared_fetch_refused"] += 1
                    break
                self.fetching[key] = _Fetch(key, keys[i - 1] if i else None, r, i)
                self._stats["shared_fetches_queued"] += 1
            r.shared.append(-1)
            r.blocks.append(key)
            positions.append(i)
            tiers.append(Tier.DISK)
            self._stats["hit_tokens_shared"] += T

    #: counters ``prefix_stats`` always shows when the shared tier is on
    SHARED_COUNTERS = (
        "shared_published", "shared_duplicates", "shared_fetched", "shared_unavailable",
        "shared_lost", "shared_publish_failed", "shared_publish_refused", "shared_publish_known",
        "shared_prefetched", "hit_tokens_shared", "shared_reload_waits", "shared_bytes_written",
        "shared_refreshes", "shared_refresh_failed", "shared_publish_retried",
        "shared_publish_given_up", "shared_fetch_adopted", "load_shared_unavailable",
        "load_shared_lost", "shared_publish_corrupt",
    )

    def shared_counters(self) -> tuple[str, ...]:
        return self.SHARED_COUNTERS if self.link is not None else ()

    def fetch_pending(self, r: RequestRecord) -> bool:
        return any(f.req is r for f in self.fetching.values()) if self.fetching else False

    def poll_shared(self) -> None:
        sh = self.link
        if sh is None:
            return
        if self._now() >= sh.next_refresh:
            self.refresh()
        for res in sh.queue.poll():
            self._apply_shared(res)
        if self.unpublished:
            self._retry_publishes()
        if self.fetching:
            waiting = {id(f.req): f.req for f in self.fetching.values() if f.req is not None}
            for r in waiting.values():
                self._land_fetches(r)

    def wait_shared(self, timeout: float) -> tuple[bool, float]:
        sh = self.link
        if sh is None:
            return True, timeout
        t0 = time.monotonic()  # a real-time budget, whatever the cache's clock
        idle = sh.queue.wait_idle(timeout)
        return idle, max(0.0, timeout - (time.monotonic() - t0))

    def _apply_shared(self, res) -> None:
        from tiering.coldtier import BlockStatus as B

        st = self._stats
        if res.op == "publish":
            name = {B.WRITTEN: "shared_published", B.DUPLICATE: "shared_duplicates"}
            st[name.get(res.status, "shared_publish_failed")] += 1
            if res.status is B.WRITTEN:
                st["shared_bytes_written"] += res.nbytes
            elif res.status is B.REFUSED:
                st["shared_publish_corrupt"] += 1  # damaged since publish: never retried
            elif res.status is not B.DUPLICATE:
                self._retry_later(res.key)  # not written (timeout, 5xx, breaker open): later
            return
        if res.op == "refresh":
            st["shared_refreshes" if res.status is B.LISTED else "shared_refresh_failed"] += 1
            return
        if res.op != "fetch":
            return
        f = self.fetching.get(res.key)
        if f is None:  # nothing waits for it (cannot happen: every fetch is recorded)
            st["shared_fetch_stray"] += 1
            return
        if res.status is B.HIT:
            if len(res.payload) != self._s.geometry.page_bytes:
                f.failed = f"lost: {len(res.payload)} bytes, a page is {self._s.geometry.page_bytes}"
                st["shared_lost"] += 1
            else:
                f.payload = res.payload
        elif res.status is B.LOST:
            f.failed = f"lost: {res.reason}"
            st["shared_lost"] += 1
        else:
            f.failed = f"unavailable: {res.reason}"
            st["shared_unavailable"] += 1
        if f.req is None:
            self._settle(f)

    def _land_fetches(self, r: RequestRecord) -> None:
        """Land ``r``'s arrived fetches in chain order; at a failed one, cut ``r`` there."""
        for pos in r.prefix_load.positions:
            f = self.fetching.get(r.blocks[pos])
            if f is None or f.req is not r:
                continue  # a local block, or one landed already
            if f.failed is not None:
                self._cut(r, pos, f.failed)
                return
            if f.payload is None:
                return  # later blocks wait for this one (a block needs its parent)
            if not self._land(f, mapped=True):
                self._cut(r, pos, "unavailable: no host page to land it in")
                return

    def _land(self, f: _Fetch, mapped: bool) -> bool:
        """Put an arrived block on the host tier, in the index (mapped by its request or not)."""
        c = self._s
        if c.host_pool.free_pages < 1 and not (mapped and self._moves.ensure_host(1)):
            return False
        if f.parent is not None and f.parent not in self._index:
            return False
        slot = c.host_pool.allocate(BLOCKS, 1)[0]
        dst = c.host[slot].view(torch.uint8).reshape(-1)
        dst.numpy()[:] = np.frombuffer(f.payload, dtype=np.uint8)
        crc = crc_page(c.host[slot])
        if not self._index.insert(f.key, f.parent, Tier.HOST, slot, self._now()):
            c.host_pool.release(BLOCKS, [slot])
            return False
        if mapped:
            self._index.acquire(f.key)
        self._crc[f.key] = crc
        self._rules.arrived(f.key, Tier.HOST, self._now())
        del self.fetching[f.key]
        self._stats["shared_fetched" if mapped else "shared_prefetched"] += 1
        return True

    def _settle(self, f: _Fetch) -> None:
        """A let-go fetch's result: keep the block as an unmapped host block when there is a
        free page and its parent is cached, else forget it."""
        if f.payload is not None and self._land(f, mapped=False):
            return
        self.fetching.pop(f.key, None)

    def let_go(self, r: RequestRecord, key: bytes) -> bool:
        """``r`` stops waiting for ``key``'s fetch (True), or ``key`` is not one of its fetches."""
        f = self.fetching.get(key)
        if f is None or f.req is not r:
            return False
        f.req = None
        if f.payload is not None or f.failed is not None:
            self._settle(f)
        return True

    def _cut(self, r: RequestRecord, pos: int, reason: str) -> None:
        """Before its load: ``r`` keeps blocks before ``pos`` (a fetch failed; it recomputes the rest)."""
        for key in r.blocks[pos:]:
            if not self.let_go(r, key):
                self._index.release(key)
        r.blocks, r.shared = r.blocks[:pos], r.shared[:pos]
        r.num_tokens = pos * self._s.geometry.page_tokens
        r.forget_written_from(r.num_tokens)
        r.index = None
        pl = r.prefix_load
        keep = [j for j, p in enumerate(pl.positions) if p < pos]
        r.prefix_load = PrefixLoad(tuple(pl.positions[j] for j in keep), tuple(pl.tiers[j] for j in keep),
                                   pl.failed or reason)
        self._stats[f"load_shared_{reason.split(':', 1)[0]}"] += 1

    def close(self, timeout_s: float) -> None:
        if self.link is not None:
            self.link.close(timeout_s)

    def check(self, reqs) -> list[str]:
        problems = []
        if self.link is None:
            if self.fetching:
                problems.append("fetches recorded with no shared tier")
            return problems
        try:
            self.link.queue.check_integrity()
        except AssertionError as exc:
            problems.append(f"shared tier: {exc}")
        live = {id(r) for r in reqs}
        if len(self.unpublished) > self.link.blocks.config.max_queued:
            problems.append(f"{len(self.unpublished)} publishes to retry, over max_queued")
        if len(self.fetching) > self._s.host_pool.num_pages:
            problems.append(f"{len(self.fetching)} fetches, over the {self._s.host_pool.num_pages} host pages")
        for key, f in self.fetching.items():
            if f.key != key:
                problems.append(f"fetch of {key.hex()} records key {f.key.hex()}")
            if key in self._index:
                problems.append(f"block {key.hex()} is both cached and being fetched")
            if f.req is not None:
                if id(f.req) not in live:
                    problems.append(f"block {key.hex()} is fetched for a request the cache does not hold")
                elif f.pos >= len(f.req.blocks) or f.req.blocks[f.pos] != key:
                    problems.append(f"block {key.hex()} is fetched for {f.req.rid} at {f.pos}, not mapped there")
            elif f.payload is not None or f.failed is not None:
                problems.append(f"let-go fetch of {key.hex()} holds a result it did not settle")
            if f.payload is None and f.failed is None and not self.link.queue.outstanding("fetch", key):
                problems.append(f"fetch of {key.hex()} waits for a result the queue does not hold")
        return problems
