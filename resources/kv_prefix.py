"""Prefix reuse for ``PagedKVCache``: content-addressed KV blocks on device, host and disk.

``PrefixCache`` is the cache's block store. It owns the ``BlockIndex`` (key ->
location, reference counts), one retention policy per tier, the crc32c of
every block taken when it was published, and the pages the index holds: in
the device and host pools those pages belong to the owner ``BLOCKS``; on disk
blocks are packed, a batch of them per extent, and an extent is released when
its last block leaves.

Rules (``check_integrity`` proves them together with the cache's own check):

- A request maps a run of *leading* blocks: ``RequestRecord.blocks`` (keys) and
  ``RequestRecord.shared`` (their device pages, ``-1`` while a load is
  pending); its own pages (``RequestRecord.device``) follow them.
- A block off the device is mapped by at most one request: the one loading it.
  An attach stops at a block that is moving or that another request is loading.
- Unmapped blocks move down the tiers when the cache needs room (device ->
  host -> disk, each by a move, so a block is never copied to a tier holding
  it) and leave the bottom tier by the retention policy. These moves run on
  the caller's thread (local copies only; see ``docs/prefix.md``).
- A block is checked against its crc32c before its bytes are mapped on a
  load; a mismatch or a failed read drops it and its descendants from the
  index, and the loading request keeps only the blocks before it.
- With a shared cold tier (``shared=``), a block is written there when it is
  published (the page copied out on the caller's thread, the write on the
  ``BlockQueue``'s threads). An attach that misses the index goes on with
  blocks the bounded ``KnownBlocks`` cache says exist remotely: each is
  fetched asynchronously and mapped as a pending load (``shared`` -1, not in
  the index, in ``fetching``). ``poll`` lands arrived fetches, in chain order,
  as host blocks the request maps; a fetch that comes back lost or
  unavailable leaves the request with the blocks before it. ``reload``
  refuses (False) while a fetch of the request is still out.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from policies.blocks import make_block_policy
from tiering.blocks import BlockIndex, KeyRoot, block_keys
from tiering.blocks.keys import KEY_BYTES
from tiering.core.transfer import coalesce, copy_runs
from tiering.disk.crc import crc32c_extend
from tiering.errors import CorruptBlock
from tiering.types import Tier

if TYPE_CHECKING:  # pragma: no cover
    from resources.kv_cache import PagedKVCache
    from resources.kv_records import RequestRecord

log = logging.getLogger("tiering.kv_prefix")

#: Pool owner of every device or host page the block index holds.
BLOCKS = ("prefix-blocks",)
_DISK_OWNER = "prefix-blocks"


class PrefixHit(NamedTuple):
    """What ``cached_prefix`` found: leading tokens cached, and how many on each tier
    (``shared``: known to exist on the shared cold tier, fetched by an attach)."""

    tokens: int
    device: int
    host: int
    disk: int
    shared: int = 0


class PrefixLoad(NamedTuple):
    """A pending load of an attached request: block positions and their source tiers
    (a block fetched from the shared tier is marked DISK until it lands on the host);
    ``failed``: why blocks were cut from it before the load ran (a failed fetch)."""

    positions: tuple[int, ...]
    tiers: tuple[Tier, ...]
    failed: str | None = None


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

    def __init__(self, queue, owned: bool, refresh_s: float, now: float, source=None) -> None:
        self.source = source  # what enable_prefix_cache was given
        self.queue = queue
        self.blocks = queue.blocks
        self.owned = owned
        self.refresh_s = refresh_s
        self.next_refresh = now

    @classmethod
    def open(cls, shared, root: bytes, geometry: bytes, clock, refresh_s) -> SharedLink:
        """From a ``SharedTierConfig`` (the store is opened and probed now: ``ColdTierUnavailable``
        if it cannot be reached), a ``SharedBlockStore`` or a ``BlockQueue``."""
        from tiering.coldtier import BlockQueue, SharedBlockStore, SharedTierConfig, open_s3_store

        if isinstance(refresh_s, bool) or not isinstance(refresh_s, (int, float)) or not refresh_s > 0:
            raise ValueError(f"enable_prefix_cache: shared_refresh_s must be a number > 0, got {refresh_s!r}")
        if isinstance(shared, SharedTierConfig):
            store = open_s3_store(shared.url, shared.storage_options)
            blocks = SharedBlockStore(store, root, geometry, config=shared.tier, clock=clock)
            return cls(BlockQueue(blocks), True, float(refresh_s), clock(), shared)
        if isinstance(shared, SharedBlockStore):
            cls._check_ids(shared, root, geometry)
            return cls(BlockQueue(shared), True, float(refresh_s), clock(), shared)
        if isinstance(shared, BlockQueue):
            cls._check_ids(shared.blocks, root, geometry)
            return cls(shared, False, float(refresh_s), clock(), shared)
        raise ValueError("enable_prefix_cache: shared must be a SharedTierConfig, SharedBlockStore or"
                         f" BlockQueue, got {type(shared).__name__}")

    @staticmethod
    def _check_ids(blocks, root: bytes, geometry: bytes) -> None:
        if blocks.root != root:
            raise ValueError("enable_prefix_cache: the shared block store is under another root")
        if blocks.geometry != geometry:
            raise ValueError(f"enable_prefix_cache: the shared block store is for geometry"
                             f" {blocks.geometry!r}, the cache's is {geometry!r}")

    @property
    def known(self):
        return self.blocks.known

    def same_source(self, shared) -> bool:
        return shared is self.source or (type(shared) is type(self.source) and shared == self.source)

    def close(self, timeout_s: float) -> None:
        if self.owned:
            self.queue.close(timeout_s)


def crc_page(t: torch.Tensor) -> int:
    """crc32c of one page's bytes (a CPU tensor)."""
    arr = t.contiguous().view(torch.uint8).numpy()
    return crc32c_extend(0, arr)


class PrefixCache:
    """The block store of one ``PagedKVCache`` (see the module docstring)."""

    def __init__(self, cache: PagedKVCache, root: bytes, policy: str = "lru",
                 disk_batch_pages: int = 16, shared=None, shared_refresh_s: float = 10.0) -> None:
        if not isinstance(root, bytes) or len(root) != KEY_BYTES:
            raise ValueError(f"enable_prefix_cache: root must be {KEY_BYTES} bytes, got {root!r}")
        if isinstance(disk_batch_pages, bool) or not isinstance(disk_batch_pages, int) \
                or disk_batch_pages < 1:
            raise ValueError(f"disk_batch_pages must be an int >= 1, got {disk_batch_pages!r}")
        self.cache = cache
        self.root = root
        self.index = BlockIndex()
        cap = {Tier.DEVICE: cache.device_pool.num_pages, Tier.HOST: cache.host_pool.num_pages,
               Tier.DISK: max(1, 1 << 20)}
        self.policies = {t: make_block_policy(policy, capacity=cap[t]) for t in Tier}
        self.crc: dict[Hashable, int] = {}
        self.disk_batch_pages = disk_batch_pages
        self.extents: dict[int, list] = {}  # extent id -> [DiskExtent, live blocks]
        self._extent_ids = 0
        self.orphans: list[tuple[Any, Any]] = []  # (future, load) of removed loaders
        self.stats: Counter[str] = Counter()
        self.fetching: dict[bytes, _Fetch] = {}  # blocks on their way from the shared tier
        self.unpublished: OrderedDict[bytes, None] = OrderedDict()  # refused publishes, to retry
        self.shared: SharedLink | None = None
        if shared is not None:  # last: a store that cannot be reached leaves nothing behind
            self.shared = SharedLink.open(shared, root, cache.geometry.fingerprint().encode(),
                                          cache._clock, shared_refresh_s)
            self._refresh()

    # -- keys -----------------------------------------------------------------

    def keys(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[bytes]:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        return block_keys(self.root, token_ids, self.cache.geometry.page_tokens)

    def _now(self) -> float:
        return float(self.cache._clock())

    # -- bookkeeping helpers ------------------------------------------------------

    def _insert_policy(self, key: Hashable, tier: Tier) -> None:
        self.policies[tier].on_insert(self.index.get(key), self._now())

    def _free_location(self, tier: Tier, handle: Hashable) -> None:
        c = self.cache
        if tier is Tier.DEVICE:
            c.device_pool.release(BLOCKS, [handle])
        elif tier is Tier.HOST:
            c.host_pool.release(BLOCKS, [handle])
        else:
            ext_id, _ = handle
            entry = self.extents[ext_id]
            entry[1] -= 1
            if entry[1] == 0:
                del self.extents[ext_id]
                c._disk_call(c.disk.release, entry[0])

    def _drop(self, key: Hashable, reason: str) -> int:
        """Drop ``key`` and its descendants; frees what they held. Returns blocks dropped."""
        try:
            gone = self.index.drop(key, reason)
        except ValueError as exc:
            log.error("could not drop block %s: %s", key.hex() if isinstance(key, bytes) else key, exc)
            return 0
        for d in gone:
            self.policies[d.tier].on_remove(d.key)
            self.crc.pop(d.key, None)
            self._free_location(d.tier, d.handle)
        self.stats[f"dropped_{reason}"] += 1
        return len(gone)

    def unmapped(self, tier: Tier) -> int:
        """Blocks on ``tier`` no live request maps and that are not moving (space the cache can free)."""
        return self.index.idle_count(tier)

    # -- making room (caller's thread) -----------------------------------------------

    def ensure_device(self, n: int) -> bool:
        """Move unmapped device blocks down until the device pool has ``n`` free pages."""
        pool = self.cache.device_pool
        if n > pool.num_pages:
            return False
        while pool.free_pages < n:
            key = self.index.choose_victim(self.policies[Tier.DEVICE], self._now(), Tier.DEVICE)
            if key is None:
                return False
            self._move_device_block_down(key)
        return True

    def ensure_host(self, n: int) -> bool:
        """Move unmapped host blocks to disk (or drop them) until the host pool has ``n`` free pages."""
        pool = self.cache.host_pool
        if n > pool.num_pages:
            return False
        while pool.free_pages < n:
            if not self._host_blocks_down(n - pool.free_pages):
                return False
        return True

    def _move_device_block_down(self, key: Hashable) -> None:
        c = self.cache
        page = self.index.location(key).handle
        slot = None
        room = c.host_pool.free_pages > 0 or self.ensure_host(1)
        if key not in self.index:
            # making room on the host dropped an ancestor of this block (a host victim takes
            # its descendants with it), and this block with it: its page is free already
            self.stats["dropped_with_ancestor"] += 1
            return
        if room:
            got = c.host_pool.allocate(BLOCKS, 1)
            slot = got[0] if got else None
        if slot is None:
            self._drop(key, "evicted")  # nowhere below: the bottom tier for this block
            return
        self.index.begin_move(key, Tier.HOST, slot)
        try:
            c._host[slot].copy_(c._dev[page])
            if c.device.type == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.current_stream(c.device).synchronize()
        except Exception as exc:
            log.error("block demotion device->host failed: %s", exc)
            self.index.fail_move(key)
            c.host_pool.release(BLOCKS, [slot])
            self._drop(key, "evicted")
            return
        old = self.index.finish_move(key)
        self.policies[Tier.DEVICE].on_remove(key)
        self._insert_policy(key, Tier.HOST)
        self._free_location(old.tier, old.handle)
        self.stats["blocks_device_to_host"] += 1

    def _host_blocks_down(self, want: int) -> bool:
        """Move up to a batch of unmapped host blocks to disk in one write; drop them when
        there is no disk or it is full. False when there is nothing to move."""
        c = self.cache
        pol = self.policies[Tier.HOST]
        if c.disk is None:
            key = self.index.choose_victim(pol, self._now(), Tier.HOST)
            if key is None:
                return False
            self._drop(key, "evicted")
            return True
        batch = max(want, min(self.disk_batch_pages, self.index.count(Tier.HOST)))
        extent = c.disk.reserve(_DISK_OWNER, batch)
        while extent is None:
            # the bottom tier: its retention policy's victim leaves
            key = self.index.choose_victim(self.policies[Tier.DISK], self._now(), Tier.DISK)
            if key is None:
                break
            self._drop(key, "evicted")
            extent = c.disk.reserve(_DISK_OWNER, batch)
        if extent is None:
            key = self.index.choose_victim(pol, self._now(), Tier.HOST)
            if key is None:
                return False
            self._drop(key, "evicted")
            return True
        ext_id = self._extent_ids = self._extent_ids + 1
        chosen: list[tuple[Hashable, int]] = []
        for i in range(batch):
            key = self.index.choose_victim(pol, self._now(), Tier.HOST)
            if key is None:
                break
            self.index.begin_move(key, Tier.DISK, (ext_id, i))
            chosen.append((key, self.index.location(key).handle))
        if not chosen:
            c._disk_call(c.disk.release, extent)
            return False
        slots = [s for _, s in chosen]
        try:
            pages = c._host[torch.tensor(slots, dtype=torch.long)]
            if len(chosen) < batch:  # a write covers whole chunks of the extent
                pad = torch.zeros((batch - len(chosen), *pages.shape[1:]), dtype=pages.dtype)
                pages = torch.cat([pages, pad])
            c.disk.write(extent, pages.contiguous(), first_page=0)
        except Exception as exc:
            log.error("block demotion host->disk failed, dropping %d blocks: %s", len(chosen), exc)
            for key, _ in chosen:
                self.index.fail_move(key)
            c._disk_call(c.disk.release, extent)
            for key, _ in chosen:
                self._drop(key, "evicted")
            return True
        self.extents[ext_id] = [extent, len(chosen)]
        for key, _slot in chosen:
            old = self.index.finish_move(key)
            pol.on_remove(key)
            self._insert_policy(key, Tier.DISK)
            self._free_location(old.tier, old.handle)
        self.stats["blocks_host_to_disk"] += len(chosen)
        self.stats["disk_block_writes"] += 1
        return True

    # -- publish / lookup / attach ----------------------------------------------------

    def publish(self, r: RequestRecord, token_ids) -> int:
        """Key ``r``'s full pages of ``token_ids``; returns the blocks it maps afterwards."""
        c = self.cache
        arr = token_ids.detach().cpu().numpy() if isinstance(token_ids, torch.Tensor) else token_ids
        n_tok = len(arr)
        if n_tok > r.num_tokens:
            raise ValueError(
                f"publish_prefix({r.rid!r}): {n_tok} token ids but the request holds"
                f" {r.num_tokens} tokens"
            )
        keys = self.keys(arr)
        have = len(r.blocks)
        for i in range(min(have, len(keys))):
            if r.blocks[i] != keys[i]:
                raise ValueError(
                    f"publish_prefix({r.rid!r}): page {i} was published from other token ids"
                )
        now = self._now()
        for i in range(have, len(keys)):
            key = keys[i]
            parent = keys[i - 1] if i else None
            own = r.device[0]
            loc = self.index.location(key)
            if key in self.fetching:
                break  # on its way from the shared tier for another request
            if loc is not None:
                if loc.tier is not Tier.DEVICE or loc.moving_to is not None:
                    break  # held elsewhere: stop here, the rest stays the request's own
                self.index.acquire(key)  # the same bytes are cached: map them, free ours
                self.index.touch(key, now)
                self.policies[Tier.DEVICE].on_hit(self.index.get(key), now)
                r.device.pop(0)
                c.device_pool.release(r.rid, [own])
                r.shared.append(loc.handle)
                r.blocks.append(key)
                self.stats["publish_dedup"] += 1
                continue
            page = c._dev[own].cpu()
            crc = crc_page(page)
            if not self.index.insert(key, parent, Tier.DEVICE, own, now):
                break
            self._publish_shared(key, page)
            c.device_pool.transfer_ownership(r.rid, BLOCKS, [own])
            self.index.acquire(key)
            self.crc[key] = crc
            self.policies[Tier.DEVICE].on_request(keys[: i + 1], now)
            self._insert_policy(key, Tier.DEVICE)
            r.device.pop(0)
            r.shared.append(own)
            r.blocks.append(key)
            self.stats["blocks_published"] += 1
        r.index = None
        return len(r.blocks)

    def lookup(self, token_ids) -> PrefixHit:
        keys = self.keys(token_ids)
        m = self.index.match(keys)
        T = self.cache.geometry.page_tokens
        remote = 0
        sh = self.shared
        if sh is not None and sh.blocks.breaker.would_allow():
            for key in keys[m.blocks:]:
                f = self.fetching.get(key)
                if (f is not None and f.req is not None) or key not in sh.known:
                    break
                remote += 1
        return PrefixHit((m.blocks + remote) * T, m.count(Tier.DEVICE) * T, m.count(Tier.HOST) * T,
                         m.count(Tier.DISK) * T, remote * T)

    def attach(self, r: RequestRecord, token_ids) -> int:
        """Map the longest usable cached prefix of ``token_ids`` into fresh request ``r``."""
        c = self.cache
        T = c.geometry.page_tokens
        keys = self.keys(token_ids)
        n_tok = len(token_ids)
        limit = max(0, (n_tok - 1) // T)  # the last token is always run (its logits are needed)
        idx = self.index
        now = self._now()
        positions, tiers = [], []
        for i, key in enumerate(keys[:limit]):
            loc = idx.location(key)
            if loc is None and self.shared is not None:
                self._attach_shared(r, keys, i, limit, positions, tiers)
                break
            if loc is None or loc.moving_to is not None:
                break
            info = idx.get(key)
            if loc.tier is Tier.DEVICE:
                idx.acquire(key)
                r.shared.append(loc.handle)
            else:
                if info.refs > 0:
                    break  # another request is loading it
                idx.acquire(key)
                r.shared.append(-1)
                positions.append(i)
                tiers.append(loc.tier)
            idx.touch(key, now)
            self.policies[loc.tier].on_hit(idx.get(key), now)
            r.blocks.append(key)
            self.stats[f"hit_tokens_{loc.tier.value}"] += T
        r.num_tokens = len(r.blocks) * T
        r.index = None
        self.stats["attached_tokens"] += r.num_tokens
        if positions:
            r.prefix_load = PrefixLoad(tuple(positions), tuple(tiers))
        return r.num_tokens

    def release_request(self, r: RequestRecord) -> None:
        """``r`` stops mapping its blocks (removed, lost, or a load undone)."""
        for key in r.blocks:
            if not self._let_go(r, key):
                self.index.release(key)
        r.blocks, r.shared = [], []
        r.prefix_load = None

    # -- the shared cold tier ------------------------------------------------------------

    def _refresh(self) -> None:
        sh = self.shared
        if sh.queue.submit_refresh():
            self.stats["shared_refreshes_queued"] += 1
        sh.next_refresh = self._now() + sh.refresh_s

    def _publish_shared(self, key: bytes, page: torch.Tensor) -> None:
        """Queue the write of a freshly published block (bytes copied now, written by the
        queue's threads). Refused when the block is known to exist there (no write needed),
        the queue is full or the store is not answering: then it is not written by this worker."""
        sh = self.shared
        if sh is None:
            return
        if key in sh.known:
            self.stats["shared_publish_known"] += 1
            return
        if sh.queue.submit_publish(key, page.contiguous().view(torch.uint8).numpy()):
            self.stats["shared_publish_queued"] += 1
        else:
            self.stats["shared_publish_refused"] += 1
            self._retry_later(key)

    def _retry_later(self, key: bytes) -> None:
        """Remember a refused publish (bounded: the oldest is forgotten first)."""
        self.unpublished[key] = None
        self.unpublished.move_to_end(key)
        while len(self.unpublished) > self.shared.blocks.config.max_queued:
            self.unpublished.popitem(last=False)
            self.stats["shared_publish_given_up"] += 1

    def _retry_publishes(self) -> None:
        """Queue refused publishes again while the queue has room and the store answers. A
        block no longer cached on the device or the host (or moving) is not retried."""
        sh = self.shared
        c = self.cache
        room = sh.blocks.config.max_queued - sh.queue.in_flight
        while self.unpublished and room > 0 and sh.blocks.breaker.would_allow():
            key, _ = self.unpublished.popitem(last=False)
            loc = self.index.location(key)
            if loc is None or loc.moving_to is not None or loc.tier is Tier.DISK or key in sh.known:
                continue
            page = c._dev[loc.handle].cpu() if loc.tier is Tier.DEVICE else c._host[loc.handle]
            if not sh.queue.submit_publish(key, page.contiguous().view(torch.uint8).numpy()):
                self.unpublished[key] = None
                self.unpublished.move_to_end(key, last=False)
                return
            room -= 1
            self.stats["shared_publish_retried"] += 1

    def _attach_shared(self, r: RequestRecord, keys, start: int, limit: int,
                       positions: list, tiers: list) -> None:
        """Map blocks ``keys[start:limit]`` known to exist on the shared tier as pending
        fetches (asks the local cache only; each fetch is queued, never waited for)."""
        sh = self.shared
        T = self.cache.geometry.page_tokens
        cap = self.cache.host_pool.num_pages  # each lands in a host page
        for i in range(start, limit):
            key = keys[i]
            if key in self.index:
                break
            f = self.fetching.get(key)
            if f is not None:
                if f.req is not None:
                    break  # another request is fetching it
                f.req, f.pos = r, i  # a let-go fetch still in flight: adopt it
                self.stats["shared_fetch_adopted"] += 1
            else:
                if len(self.fetching) >= cap or key not in sh.known:
                    break
                if not sh.queue.submit_fetch(key):
                    self.stats["shared_fetch_refused"] += 1
                    break
                self.fetching[key] = _Fetch(key, keys[i - 1] if i else None, r, i)
                self.stats["shared_fetches_queued"] += 1
            r.shared.append(-1)
            r.blocks.append(key)
            positions.append(i)
            tiers.append(Tier.DISK)
            self.stats["hit_tokens_shared"] += T

    #: counters ``prefix_stats`` always shows when the shared tier is on
    SHARED_COUNTERS = (
        "shared_published", "shared_duplicates", "shared_fetched", "shared_unavailable",
        "shared_lost", "shared_publish_failed", "shared_publish_refused", "shared_publish_known",
        "shared_prefetched", "hit_tokens_shared", "shared_reload_waits", "shared_bytes_written",
        "shared_refreshes", "shared_refresh_failed", "shared_publish_retried",
        "shared_publish_given_up", "shared_fetch_adopted", "load_shared_unavailable",
        "load_shared_lost",
    )

    def shared_counters(self) -> tuple[str, ...]:
        return self.SHARED_COUNTERS if self.shared is not None else ()

    def fetch_pending(self, r: RequestRecord) -> bool:
        """Whether a block of ``r`` is still on its way from the shared tier."""
        return any(f.req is r for f in self.fetching.values()) if self.fetching else False

    def poll_shared(self) -> None:
        """The step path: apply finished publishes and fetches, land arrived blocks, run the
        refresh timer. Never waits; never raises for a store fault."""
        sh = self.shared
        if sh is None:
            return
        if self._now() >= sh.next_refresh:
            self._refresh()
        for res in sh.queue.poll():
            self._apply_shared(res)
        if self.unpublished:
            self._retry_publishes()
        if self.fetching:
            waiting = {id(f.req): f.req for f in self.fetching.values() if f.req is not None}
            for r in waiting.values():
                self._land_fetches(r)

    def wait_shared(self, timeout: float) -> float:
        """Wait (bounded) for the shared tier's queue to go idle; returns what is left of ``timeout``."""
        sh = self.shared
        if sh is None:
            return timeout
        t0 = time.monotonic()  # a real-time budget, whatever the cache's clock
        sh.queue.wait_idle(timeout)
        return max(0.0, timeout - (time.monotonic() - t0))

    def _apply_shared(self, res) -> None:
        from tiering.coldtier import BlockStatus as B

        st = self.stats
        if res.op == "publish":
            name = {B.WRITTEN: "shared_published", B.DUPLICATE: "shared_duplicates"}
            st[name.get(res.status, "shared_publish_failed")] += 1
            if res.status is B.WRITTEN:
                st["shared_bytes_written"] += res.nbytes
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
            if len(res.payload) != self.cache.geometry.page_bytes:
                f.failed = f"lost: {len(res.payload)} bytes, a page is {self.cache.geometry.page_bytes}"
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
        c = self.cache
        if c.host_pool.free_pages < 1 and not (mapped and self.ensure_host(1)):
            return False
        if f.parent is not None and f.parent not in self.index:
            return False
        slot = c.host_pool.allocate(BLOCKS, 1)[0]
        dst = c._host[slot].view(torch.uint8).reshape(-1)
        dst.numpy()[:] = np.frombuffer(f.payload, dtype=np.uint8)
        crc = crc_page(c._host[slot])
        if not self.index.insert(f.key, f.parent, Tier.HOST, slot, self._now()):
            c.host_pool.release(BLOCKS, [slot])
            return False
        if mapped:
            self.index.acquire(f.key)
        self.crc[f.key] = crc
        self._insert_policy(f.key, Tier.HOST)
        del self.fetching[f.key]
        self.stats["shared_fetched" if mapped else "shared_prefetched"] += 1
        return True

    def _settle(self, f: _Fetch) -> None:
        """A let-go fetch's result: keep the block as an unmapped host block when there is a
        free page and its parent is cached, else forget it."""
        if f.payload is not None and self._land(f, mapped=False):
            return
        self.fetching.pop(f.key, None)

    def _let_go(self, r: RequestRecord, key: bytes) -> bool:
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
            if not self._let_go(r, key):
                self.index.release(key)
        r.blocks, r.shared = r.blocks[:pos], r.shared[:pos]
        r.num_tokens = pos * self.cache.geometry.page_tokens
        r.index = None
        pl = r.prefix_load
        keep = [j for j, p in enumerate(pl.positions) if p < pos]
        r.prefix_load = PrefixLoad(tuple(pl.positions[j] for j in keep), tuple(pl.tiers[j] for j in keep),
                                   pl.failed or reason)
        self.stats[f"load_shared_{reason.split(':', 1)[0]}"] += 1

    def close(self, timeout_s: float) -> None:
        if self.shared is not None:
            self.shared.close(timeout_s)

    # -- loads (host/disk blocks into fresh device pages) -----------------------------

    def start_load(self, r: RequestRecord, pages: list[int]) -> list:
        """Reserve device pages for ``r``'s pending blocks; the (key, src, handle, page) jobs."""
        work = []
        for pos, page in zip(r.prefix_load.positions, pages, strict=True):
            key = r.blocks[pos]
            loc = self.index.location(key)
            self.index.begin_move(key, Tier.DEVICE, page)
            work.append((key, loc.tier, loc.handle, page, self.crc.get(key)))
        return work

    def load_job(self, work: list, fault, marker=None) -> list[str | None]:
        """Worker thread: copy each block in, checking its crc32c before it is mapped.

        The copies go through the cache's host-to-device stream and wait on
        ``marker`` (recorded on the compute stream when the load was asked
        for: its fresh pages may just have been freed by kernels still
        queued), like a reload. Returns, per block, None (landed) or the
        reason it is unusable."""
        c = self.cache
        out: list[str | None] = []
        for key, tier, handle, page, crc in work:
            try:
                if tier is Tier.HOST:
                    src, slot = c._host, handle
                else:
                    ext_id, i = handle
                    src = torch.empty((1, *c.geometry.page_shape), dtype=c.geometry.dtype)
                    c.disk.read(self.extents[ext_id][0], src, first_page=i)
                    slot = 0
                if crc is None or crc_page(src[slot]) != crc:
                    raise CorruptBlock(f"block {key.hex()} does not match its crc32c")
                copy_runs(c._streams, src, c._dev, coalesce([slot], [page]), "h2d",
                          after=marker, fault_hook=fault)
                marker = None
                out.append(None)
            except CorruptBlock as exc:
                out.append(f"corrupt: {exc}")
            except Exception as exc:  # a failed read or copy: the block is not used
                out.append(f"read_failed: {type(exc).__name__}: {exc}")
        return out

    def finish_load(self, r: RequestRecord | None, work: list, results) -> tuple[int, str | None]:
        """Apply a finished load. Returns (blocks kept of those loaded, reason of the first failure)."""
        first_bad = None
        reason = None
        for j, ((key, tier, _h, page, _crc), res) in enumerate(zip(work, results, strict=True)):
            if res is None and first_bad is None:
                old = self.index.finish_move(key)
                self.policies[tier].on_remove(key)
                self._insert_policy(key, Tier.DEVICE)
                self._free_location(old.tier, old.handle)
                self.stats[f"blocks_{tier.value}_to_device"] += 1
                if r is not None:
                    r.shared[r.prefix_load.positions[j]] = page
                continue
            dest = self.index.fail_move(key)
            self.cache.device_pool.release(BLOCKS, [dest.handle])
            if first_bad is None:
                first_bad, reason = j, res
        return (len(work) if first_bad is None else first_bad), reason

    def truncate(self, r: RequestRecord, keep: int, reason: str | None) -> None:
        """``r`` keeps only its first ``keep`` blocks; a failed block is dropped with its descendants."""
        bad_key = r.blocks[keep] if keep < len(r.blocks) else None
        for key in r.blocks[keep:]:
            self.index.release(key)
        r.blocks, r.shared = r.blocks[:keep], r.shared[:keep]
        r.num_tokens = keep * self.cache.geometry.page_tokens
        r.index = None
        if bad_key is not None and reason is not None:
            why = reason.split(":", 1)[0]
            if bad_key in self.index and self.index.location(bad_key).tier is not Tier.DEVICE:
                self._drop(bad_key, why)
            self.stats[f"load_{why}"] += 1

    def poll_orphans(self) -> None:
        keep = []
        for fut, work in self.orphans:
            if not fut.done():
                keep.append((fut, work))
                continue
            try:
                results = fut.result()
            except BaseException as exc:  # noqa: BLE001 - any failure: nothing landed
                results = [f"read_failed: {exc}"] * len(work)
            self.finish_load(None, work, results)
            for key, *_ in work:
                self.index.release(key)
        self.orphans = keep

    # -- integrity ---------------------------------------------------------------------

    def check_integrity(self, reqs) -> list[str]:
        """Problems found (empty: none). ``reqs`` are the cache's records."""
        problems = []
        try:
            self.index.check_integrity()
        except AssertionError as exc:
            problems.append(f"block index: {exc}")
        refs: Counter = Counter()
        for r in reqs:
            if len(r.blocks) != len(r.shared):
                problems.append(f"{r.rid}: {len(r.blocks)} blocks but {len(r.shared)} shared pages")
            remote = False
            for i, (key, page) in enumerate(zip(r.blocks, r.shared, strict=False)):
                f = self.fetching.get(key)
                if f is not None and f.req is r:
                    remote = True
                    if f.pos != i or page != -1 or r.prefix_load is None or i not in r.prefix_load.positions:
                        problems.append(f"{r.rid}: block {i} is fetched for position {f.pos},"
                                        f" page {page}, not as a pending load")
                    continue
                if remote:
                    problems.append(f"{r.rid}: block {i} is mapped after a block still being fetched")
                refs[key] += 1
                loc = self.index.location(key)
                if loc is None:
                    problems.append(f"{r.rid}: maps block {i} which is not cached")
                    continue
                if page != -1 and (loc.tier is not Tier.DEVICE or loc.handle != page):
                    problems.append(f"{r.rid}: block {i} on page {page}, index says {loc}")
                if page == -1 and loc.tier is Tier.DEVICE and loc.moving_to is None:
                    problems.append(f"{r.rid}: block {i} is on the device but not mapped")
        for _, work in self.orphans:
            for key, *_ in work:
                refs[key] += 1
        for key in self.index.keys():
            info = self.index.get(key)
            if info.refs != refs.get(key, 0):
                problems.append(f"block {key.hex()}: refs {info.refs}, mappings {refs.get(key, 0)}")
            loc = self.index.location(key)
            if loc.tier is not Tier.DEVICE and info.refs > 1:
                problems.append(f"block {key.hex()} off the device is mapped {info.refs} times")
            if key not in self.crc:
                problems.append(f"block {key.hex()} has no crc32c")
            if key not in self.policies[loc.tier]:
                problems.append(f"block {key.hex()} is not tracked by the {loc.tier.value} policy")
        for t in Tier:
            slow = sum(1 for k in self.index.keys(t)
                       if self.index.get(k).refs == 0 and self.index.location(k).moving_to is None)
            if slow != self.index.idle_count(t):
                problems.append(f"{t.value}: idle_count {self.index.idle_count(t)}, counted {slow}")
            if len(self.policies[t]) != self.index.count(t):
                problems.append(f"{t.value} policy tracks {len(self.policies[t])} blocks,"
                                f" index holds {self.index.count(t)}")
        if set(self.crc) != set(self.index.keys()):
            problems.append("crc table does not cover exactly the cached blocks")
        live: Counter = Counter()
        for key in self.index.keys():
            loc = self.index.location(key)
            for tier, handle in ((loc.tier, loc.handle), (loc.moving_to, loc.dest_handle)):
                if tier is Tier.DISK:
                    live[handle[0]] += 1
        for ext_id, (_, n) in self.extents.items():
            if live.get(ext_id, 0) != n:
                problems.append(f"disk extent {ext_id}: {n} live blocks recorded, {live.get(ext_id, 0)} held")
        if set(live) - set(self.extents):
            problems.append("a block names a disk extent the cache does not hold")
        problems += self._check_shared(reqs)
        return problems

    def _check_shared(self, reqs) -> list[str]:
        problems = []
        if self.shared is None:
            if self.fetching:
                problems.append("fetches recorded with no shared tier")
            return problems
        try:
            self.shared.queue.check_integrity()
        except AssertionError as exc:
            problems.append(f"shared tier: {exc}")
        live = {id(r) for r in reqs}
        if len(self.unpublished) > self.shared.blocks.config.max_queued:
            problems.append(f"{len(self.unpublished)} publishes to retry, over max_queued")
        if len(self.fetching) > self.cache.host_pool.num_pages:
            problems.append(f"{len(self.fetching)} fetches, over the {self.cache.host_pool.num_pages} host pages")
        for key, f in self.fetching.items():
            if f.key != key:
                problems.append(f"fetch of {key.hex()} records key {f.key.hex()}")
            if key in self.index:
                problems.append(f"block {key.hex()} is both cached and being fetched")
            if f.req is not None:
                if id(f.req) not in live:
                    problems.append(f"block {key.hex()} is fetched for a request the cache does not hold")
                elif f.pos >= len(f.req.blocks) or f.req.blocks[f.pos] != key:
                    problems.append(f"block {key.hex()} is fetched for {f.req.rid} at {f.pos}, not mapped there")
            elif f.payload is not None or f.failed is not None:
                problems.append(f"let-go fetch of {key.hex()} holds a result it did not settle")
            if f.payload is None and f.failed is None and not self.shared.queue.outstanding("fetch", key):
                problems.append(f"fetch of {key.hex()} waits for a result the queue does not hold")
        return problems

    def pages_on(self, tier: Tier) -> list[int]:
        """Pages of ``tier`` the index holds (locations and move destinations)."""
        out = []
        for key in self.index.keys():
            loc = self.index.location(key)
            if loc.tier is tier:
                out.append(loc.handle)
            if loc.moving_to is tier:
                out.append(loc.dest_handle)
        return out


def as_root(root: bytes | KeyRoot) -> bytes:
    """A root as bytes (a ``KeyRoot`` gives its ``key``)."""
    if isinstance(root, KeyRoot):
        return root.key
    return root
