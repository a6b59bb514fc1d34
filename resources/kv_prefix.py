"""Prefix reuse for ``PagedKVCache``: content-addressed KV blocks on device, host and disk.

``PrefixCache`` is the cache's block store. It owns the ``BlockIndex`` (key ->
location, reference counts), one retention policy per tier, the crc32c of
every block taken when it was published, and the pages the index holds: in
the device and host pools those pages belong to the owner ``BLOCKS``; on disk
blocks are packed, a batch of them per extent, and an extent is released when
its last block leaves.

Layout: ``PrefixCache`` (this module: set-up, publish / lookup / attach, loads,
integrity) owns the index, the policies' rules, the crc table and the counters, and
hands them to its two parts: ``BlockMoves`` (``kv_prefix_moves``: the cache's block
space, whose ``RoomMaker`` (``kv_prefix_room``, the replay's too) makes room, drops and
keeps the disk extents) and ``SharedBlocks`` (``kv_prefix_shared``, with
``SharedLink``: the shared cold tier).
Its small types are in ``kv_prefix_types``; every name stays importable from here.
Every call into a block policy goes through ``kv_prefix_rules.BlockRules``, the rules
the replay's block store runs too (what an attach maps, who is told what and when,
what each tier admits, which block leaves first).

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

import hashlib
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tiering.policies.blocks import DEFAULT_BLOCK_POLICY, make_block_policy
from tiering.resources.kv_prefix_moves import BlockMoves
from tiering.resources.kv_prefix_rules import BlockRules
from tiering.resources.kv_prefix_shared import SharedBlocks, SharedLink
from tiering.resources.kv_prefix_types import BLOCKS, BlockParts, PrefixHit, PrefixLoad, crc_page

from tiering.blocks import BlockIndex, KeyRoot, block_keys
from tiering.blocks.keys import KEY_BYTES
from tiering.core.transfer import coalesce, copy_runs
from tiering.errors import CorruptBlock
from tiering.types import Tier

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.kv_records import RequestRecord
    from tiering.resources.kv_storage import KVStorage

log = logging.getLogger("tiering.kv_prefix")

__all__ = ["BLOCKS", "PrefixCache", "PrefixHit", "PrefixLoad", "SharedLink", "as_root", "crc_page",
           "derive_key_root"]


class PrefixCache:
    """The block store of one ``PagedKVCache`` (see the module docstring)."""

    def __init__(self, storage: KVStorage, clock: Callable[[], float], owner: str, root: bytes,
                 policy: str = DEFAULT_BLOCK_POLICY, disk_batch_pages: int = 16, shared=None,
                 shared_refresh_s: float = 10.0) -> None:
        if not isinstance(root, bytes) or not root:
            raise ValueError(f"enable_prefix_cache: root must be non-empty bytes, got {root!r:.80}")
        if isinstance(disk_batch_pages, bool) or not isinstance(disk_batch_pages, int) \
                or disk_batch_pages < 1:
            raise ValueError(f"disk_batch_pages must be an int >= 1, got {disk_batch_pages!r}")
        self.storage = storage  # the cache's tiers: pools, tensors, disk, streams
        self._clock = clock
        self.root = root  # what the engine gave; keys chain from key_root (root + geometry)
        self._derived: tuple[bytes, bytes] | None = None
        self.index = BlockIndex()
        # each tier's policy is sized by the tier (a block is one page), as the replay's
        cap = {Tier.DEVICE: storage.device_pool.num_pages, Tier.HOST: storage.host_pool.num_pages,
               Tier.DISK: max(1, getattr(storage.disk, "capacity_pages", 1))}
        # every policy call goes through the rules the replay runs too (kv_prefix_rules)
        self.rules = BlockRules(self.index, {t: make_block_policy(policy, capacity=cap[t])
                                             for t in Tier})
        self.policies = self.rules.policies
        self.told: weakref.WeakSet[RequestRecord] = weakref.WeakSet()  # told since attach
        self.crc: dict[Hashable, int] = {}
        self.disk_batch_pages = disk_batch_pages
        self.orphans: list[tuple[Any, Any]] = []  # (future, load) of removed loaders
        self.stats: Counter[str] = Counter()
        # moving blocks down, dropping them, the disk extents they are packed in
        parts = BlockParts(storage, self.index, self.rules, self.crc, self.stats, clock)
        self.moves = BlockMoves(parts, disk_batch_pages)
        # the shared cold tier: its link, fetches in flight, publishes to retry
        self.sharing = SharedBlocks(parts, self.moves)
        if shared is not None:  # last: a store that cannot be reached leaves nothing behind
            self.sharing.open(shared, self.key_root, shared_refresh_s, owner)

    # -- keys -----------------------------------------------------------------

    @property
    def key_root(self) -> bytes:
        """The root the block keys chain from: a digest of ``root`` and the geometry's
        fingerprint, so caches of different dtypes or layouts never share a key."""
        if self._derived is None or self._derived[0] is not self.root:
            self._derived = (self.root, derive_key_root(self.root, self.storage.geometry.fingerprint()))
        return self._derived[1]

    def keys(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[bytes]:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        return block_keys(self.key_root, token_ids, self.storage.geometry.page_tokens)

    def _now(self) -> float:
        return float(self._clock())

    # -- the shared cold tier: SharedBlocks, resources.kv_prefix_shared

    shared = property(lambda self: self.sharing.link)  # SharedLink | None
    fetching = property(lambda self: self.sharing.fetching)  # blocks on their way here
    unpublished = property(lambda self: self.sharing.unpublished)  # refused publishes

    def _refresh(self) -> None:
        self.sharing.refresh()

    def shared_counters(self) -> tuple[str, ...]:
        return self.sharing.shared_counters()

    def fetch_pending(self, r: RequestRecord) -> bool:
        """Whether a block of ``r`` is still on its way from the shared tier."""
        return self.sharing.fetch_pending(r)

    def poll_shared(self) -> None:
        """The step path: apply finished publishes and fetches, land arrived blocks, run the
        refresh timer. Never waits; never raises for a store fault."""
        self.sharing.poll_shared()

    def wait_shared(self, timeout: float) -> tuple[bool, float]:
        """Wait (bounded) for the shared tier's queue to go idle: (idle, what is left of
        ``timeout``)."""
        return self.sharing.wait_shared(timeout)

    def close(self, timeout_s: float) -> None:
        self.sharing.close(timeout_s)

    # -- making room, dropping (caller's thread): BlockMoves, resources.kv_prefix_moves

    @property
    def extents(self) -> dict[int, list]:
        return self.moves.extents

    def unmapped(self, tier: Tier) -> int:
        """Blocks on ``tier`` no live request maps and that are not moving (space the cache can free)."""
        return self.index.idle_count(tier)

    def ensure_device(self, n: int) -> bool:
        """Move unmapped device blocks down until the device pool has ``n`` free pages;
        False, with nothing moved, when the blocks that may leave would not free enough."""
        return self.moves.ensure_device(n)

    def ensure_host(self, n: int) -> bool:
        """Move unmapped host blocks to disk (or drop them) until the host pool has ``n`` free
        pages for a live request; False, with nothing moved, when the blocks that may leave
        would not free enough (``RoomMaker.ensure_request``)."""
        return self.moves.ensure_host(n)

    def ensure_disk(self, n: int) -> bool:
        """Drop unmapped disk blocks until the disk can take ``n`` pages of a live request;
        False when it cannot (``RoomMaker.ensure_request``)."""
        return self.moves.ensure_disk(n)

    def _drop(self, key: Hashable, reason: str) -> int:
        """Drop ``key`` and its descendants; frees what they held. Returns blocks dropped."""
        return self.moves.drop(key, reason)

    def _free_location(self, tier: Tier, handle: Hashable) -> None:
        self.moves.free_location(tier, handle)

    # -- publish / lookup / attach ----------------------------------------------------

    def publish(self, r: RequestRecord, token_ids) -> int:
        """Key ``r``'s full pages of ``token_ids``; returns the blocks it maps afterwards."""
        c = self.storage
        arr = token_ids.detach().cpu().numpy() if isinstance(token_ids, torch.Tensor) else token_ids
        n_tok = len(arr)
        if n_tok > r.num_tokens:
            raise ValueError(
                f"publish_prefix({r.rid!r}): {n_tok} token ids but the request holds"
                f" {r.num_tokens} tokens"
            )
        keys = self.keys(arr)
        have = len(r.blocks)
        T = c.geometry.page_tokens
        written = r.written_tokens(c.geometry.num_layers, have * T) // T
        if written < len(keys):  # allocated but not written: another request's leftover KV
            self.stats["publish_unwritten_pages"] += len(keys) - written
            keys = keys[:max(written, have)]
        for i in range(min(have, len(keys))):
            if r.blocks[i] != keys[i]:
                raise ValueError(
                    f"publish_prefix({r.rid!r}): page {i} was published from other token ids"
                )
        now = self._now()
        if r not in self.told:  # a request that never attached is told at its first publish
            self.rules.tell(keys, (), now)
            self.told.add(r)
        def passed(key: bytes, loc) -> None:
            """The same bytes are cached: map them, free the request's own page."""
            self.index.acquire(key)
            own = r.device.pop(0)
            c.device_pool.release(r.rid, [own])
            r.shared.append(loc.handle)
            r.blocks.append(key)
            self.stats["publish_dedup"] += 1

        # each block of a run has an own page of the request: its room is what is left
        _, refused = self.rules.publish(
            keys, have, now, room=lambda left: left,
            insert=lambda part, parent: self._publish_own(r, part, now),
            passed=passed, busy=self.fetching)  # on their way from the shared tier
        if refused:
            self.stats["publish_refused"] += refused
        r.index = None
        return len(r.blocks)

    def _publish_own(self, r: RequestRecord, keys: Sequence[bytes], now: float) -> int:
        """``r``'s next own pages become the blocks ``keys`` (admitted); returns how many."""
        c = self.storage
        n = 0
        for key in keys:
            own = r.device[0]
            page = c.dev[own].cpu()
            crc = crc_page(page)
            if not self.index.insert(key, r.blocks[-1] if r.blocks else None, Tier.DEVICE, own,
                                     now):
                break
            c.device_pool.transfer_ownership(r.rid, BLOCKS, [own])
            self.index.acquire(key)
            self.crc[key] = crc
            r.device.pop(0)
            r.shared.append(own)
            r.blocks.append(key)
            self.stats["blocks_published"] += 1
            self.sharing.publish(key, page)  # last: the block is whole in the cache first
            n += 1
        return n

    def lookup(self, token_ids) -> PrefixHit:
        keys = self.keys(token_ids)
        m = self.index.match(keys)
        T = self.storage.geometry.page_tokens
        remote = 0
        sh = self.shared
        if sh is not None and sh.blocks.breaker.would_allow():
            for key in keys[m.blocks:]:
                f = self.fetching.get(key)
                if (f is not None and f.req is not None) or not sh.known.peek(key):
                    break
                remote += 1
        return PrefixHit((m.blocks + remote) * T, m.count(Tier.DEVICE) * T, m.count(Tier.HOST) * T,
                         m.count(Tier.DISK) * T, remote * T)

    def attach(self, r: RequestRecord, token_ids, chain=None) -> int:
        """Map the longest usable cached prefix of ``token_ids`` into fresh request ``r``;
        the policies are told the request as reading the full pages of ``chain`` (default
        ``token_ids``)."""
        c = self.storage
        T = c.geometry.page_tokens
        keys = self.keys(token_ids)
        n_tok = len(token_ids)
        limit = max(0, (n_tok - 1) // T)  # the last token is always run (its logits are needed)
        idx = self.index
        tiers = self.rules.attachable(keys, n_tok, T)
        positions, loads = [], []
        for i, (key, t) in enumerate(zip(keys, tiers, strict=False)):
            idx.acquire(key)
            if t is Tier.DEVICE:
                r.shared.append(idx.location(key).handle)
            else:
                r.shared.append(-1)
                positions.append(i)
                loads.append(t)
            r.blocks.append(key)
            self.stats[f"hit_tokens_{t.value}"] += T
        self.rules.tell(keys if chain is None else self.keys(chain), tiers, self._now())
        self.told.add(r)
        d = len(tiers)
        if self.shared is not None and d < limit and keys[d] not in idx:
            self.sharing.attach(r, keys, d, limit, positions, loads)
        r.num_tokens = len(r.blocks) * T
        r.index = None
        self.stats["attached_tokens"] += r.num_tokens
        if positions:
            r.prefix_load = PrefixLoad(tuple(positions), tuple(loads))
        return r.num_tokens

    def release_request(self, r: RequestRecord) -> None:
        """``r`` stops mapping its blocks (removed, lost, or a load undone)."""
        for key in r.blocks:
            if not self.sharing.let_go(r, key):
                self.index.release(key)
        r.blocks, r.shared = [], []
        r.prefix_load = None

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
        c = self.storage
        out: list[str | None] = []
        for key, tier, handle, page, crc in work:
            try:
                if tier is Tier.HOST:
                    src, slot = c.host, handle
                else:
                    ext_id, i = handle
                    src = torch.empty((1, *c.geometry.page_shape), dtype=c.geometry.dtype)
                    c.read_disk(self.extents[ext_id][0], src, i)
                    slot = 0
                if crc is None or crc_page(src[slot]) != crc:
                    raise CorruptBlock(f"block {key.hex()} does not match its crc32c")
                copy_runs(c.streams, src, c.dev, coalesce([slot], [page]), "h2d",
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
        landed, sources = [], []
        for j, ((key, tier, _h, page, _crc), res) in enumerate(zip(work, results, strict=True)):
            if res is None and first_bad is None:
                old = self.index.finish_move(key)
                landed.append(key)
                sources.append(tier)
                self._free_location(old.tier, old.handle)
                self.stats[f"blocks_{tier.value}_to_device"] += 1
                if r is not None:
                    r.shared[r.prefix_load.positions[j]] = page
                continue
            dest = self.index.fail_move(key)
            self.storage.device_pool.release(BLOCKS, [dest.handle])
            if first_bad is None:
                first_bad, reason = j, res
        self.rules.landed(landed, sources, self._now())
        return (len(work) if first_bad is None else first_bad), reason

    def truncate(self, r: RequestRecord, keep: int, reason: str | None) -> None:
        """``r`` keeps only its first ``keep`` blocks; a failed block is dropped with its descendants."""
        bad_key = r.blocks[keep] if keep < len(r.blocks) else None
        for key in r.blocks[keep:]:
            self.index.release(key)
        r.blocks, r.shared = r.blocks[:keep], r.shared[:keep]
        r.num_tokens = keep * self.storage.geometry.page_tokens
        r.forget_written_from(r.num_tokens)
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
        for t in Tier:
            slow = sum(1 for k in self.index.keys(t)
                       if self.index.get(k).refs == 0 and self.index.location(k).moving_to is None)
            if slow != self.index.idle_count(t):
                problems.append(f"{t.value}: idle_count {self.index.idle_count(t)}, counted {slow}")
        problems += self.rules.check()  # each tier's policy tracks exactly its blocks
        if set(self.crc) != set(self.index.keys()):
            problems.append("crc table does not cover exactly the cached blocks")
        problems += self.moves.room.problems()  # the disk extents hold exactly their blocks
        problems += self.sharing.check(reqs)
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


def derive_key_root(root: bytes, geometry_fingerprint: str) -> bytes:
    """The ``KEY_BYTES`` key root of an engine's ``root`` (any non-empty bytes: a digest, a
    model tag) under one page geometry: both length-prefixed into one BLAKE2b digest."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"tiering/kv-root")
    for part in (bytes(root), geometry_fingerprint.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def as_root(root: bytes | KeyRoot) -> bytes:
    """A root as bytes (a ``KeyRoot`` gives its ``key``)."""
    if isinstance(root, KeyRoot):
        return root.key
    return root
