"""The prefix cache's moves down the tiers: making room and dropping blocks.

``TierMovesPart`` holds the methods of ``PrefixCache`` (``tiering.resources.kv_prefix``)
that free a block's location, drop a block with its descendants, and move unmapped
blocks down (device -> host -> disk) when the cache needs room, on the caller's
thread. Which block leaves, and whether the tier below takes it, are the store's rules
(``tiering.resources.kv_prefix_rules.BlockRules``, which the replay runs too): a victim
moves down when the tier below admits it and room can be made there, else it is
dropped. It is a part of that one class, not an object of its own: it reads and
writes ``PrefixCache``'s state (``index``, ``rules``, ``crc``, ``extents``,
``stats``), set up in ``PrefixCache.__init__``.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import torch
from tiering.resources.kv_prefix_types import BLOCKS, DISK_OWNER

from tiering.types import Tier

log = logging.getLogger("tiering.kv_prefix")


class TierMovesPart:
    """``PrefixCache``'s methods for moving blocks down and dropping them (module docstring)."""

    def _free_location(self, tier: Tier, handle: Hashable) -> None:
        c = self.storage
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
                c.disk_call(c.disk.release, entry[0])

    def _drop(self, key: Hashable, reason: str) -> int:
        """Drop ``key`` and its descendants; frees what they held. Returns blocks dropped."""
        try:
            gone = self.index.drop(key, reason)
        except ValueError as exc:
            log.error("could not drop block %s: %s", key.hex() if isinstance(key, bytes) else key, exc)
            return 0
        self.rules.dropped(gone)
        for d in gone:
            self.crc.pop(d.key, None)
            self._free_location(d.tier, d.handle)
        self.stats[f"dropped_{reason}"] += 1
        return len(gone)

    def unmapped(self, tier: Tier) -> int:
        """Blocks on ``tier`` no live request maps and that are not moving (space the cache can free)."""
        return self.index.idle_count(tier)

    def ensure_device(self, n: int) -> bool:
        """Move unmapped device blocks down until the device pool has ``n`` free pages;
        False, with nothing moved, when the blocks that may leave would not free enough."""
        pool = self.storage.device_pool
        if self._out_of_reach(Tier.DEVICE, pool, n):
            return False
        while pool.free_pages < n:
            key = self.rules.victim(Tier.DEVICE, self._now())
            if key is None:
                return False
            self._move_device_block_down(key)
        return True

    def ensure_host(self, n: int) -> bool:
        """Move unmapped host blocks to disk (or drop them) until the host pool has ``n`` free
        pages; False, with nothing moved, when the blocks that may leave would not free enough."""
        pool = self.storage.host_pool
        if self._out_of_reach(Tier.HOST, pool, n):
            return False
        while pool.free_pages < n:
            if not self._host_blocks_down(n - pool.free_pages):
                return False
        return True

    def _out_of_reach(self, tier: Tier, pool, n: int) -> bool:
        """Whether ``n`` free pages of ``pool`` are out of reach: more than it holds, or more
        than its cached blocks that may leave would free (asked before any block moves)."""
        if n > pool.num_pages:
            return True
        return not self.rules.reachable(tier, n - pool.free_pages, self._now())

    def _move_device_block_down(self, key: Hashable) -> None:
        c = self.storage
        page = self.index.location(key).handle
        slot = None
        if not self.rules.admits(Tier.HOST, key, self._now()):
            self._drop(key, "evicted")  # the host does not take it: it leaves the cache
            return
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
            c.host[slot].copy_(c.dev[page])
            if c.device.type == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.current_stream(c.device).synchronize()
        except Exception as exc:
            log.error("block demotion device->host failed: %s", exc)
            self.index.fail_move(key)
            c.host_pool.release(BLOCKS, [slot])
            self._drop(key, "demote_failed")
            return
        old = self.index.finish_move(key)
        self.rules.moved(key, Tier.DEVICE, Tier.HOST, self._now())
        self._free_location(old.tier, old.handle)
        self.stats["blocks_device_to_host"] += 1

    def _host_blocks_down(self, want: int) -> bool:
        """Move up to a batch of unmapped host blocks to disk in one write: each victim the
        disk policy admits is marked for disk, one it refuses is dropped; then room is
        made on disk (its victims dropped) and the batch written. With no disk, or no room
        there, the first victim is dropped instead (the rest stay); a failed write drops
        the batch. False when there is nothing to move."""
        c = self.storage
        rules = self.rules
        if c.disk is None:
            key = rules.victim(Tier.HOST, self._now())
            if key is None:
                return False
            self._drop(key, "evicted")
            return True
        batch = max(want, min(self.disk_batch_pages, self.index.count(Tier.HOST)))
        ext_id = self._extent_ids + 1
        chosen: list[tuple[Hashable, int]] = []
        refused = 0
        for _ in range(batch):
            now = self._now()
            key = rules.victim(Tier.HOST, now)
            if key is None:
                break
            if not rules.admits(Tier.DISK, key, now):
                self._drop(key, "evicted")  # the disk does not take it: it leaves the cache
                refused += 1
                continue
            self.index.begin_move(key, Tier.DISK, (ext_id, len(chosen)))
            chosen.append((key, self.index.location(key).handle))
        if not chosen:
            return refused > 0
        extent = c.disk.reserve(DISK_OWNER, len(chosen))
        while extent is None:
            # the bottom tier: its retention policy's victim leaves (never an ancestor of a
            # chosen block: those are held while their descendants move)
            key = rules.victim(Tier.DISK, self._now())
            if key is None:
                break
            self._drop(key, "evicted")
            extent = c.disk.reserve(DISK_OWNER, len(chosen))
        if extent is None:  # the disk cannot take them: the best victim leaves, the rest stay
            for key, _ in chosen:
                self.index.fail_move(key)
            self._drop(chosen[0][0], "evicted")
            return True
        self._extent_ids = ext_id
        slots = [s for _, s in chosen]
        try:
            pages = c.host[torch.tensor(slots, dtype=torch.long)]
            c.disk.write(extent, pages.contiguous(), first_page=0)
        except Exception as exc:
            log.error("block demotion host->disk failed, dropping %d blocks: %s", len(chosen), exc)
            for key, _ in chosen:
                self.index.fail_move(key)
            c.disk_call(c.disk.release, extent)
            for key, _ in chosen:  # ancestors first: a drop takes the chosen blocks below it
                if key in self.index:
                    self._drop(key, "demote_failed")
            return True
        self.extents[ext_id] = [extent, len(chosen)]
        now = self._now()
        for key, _slot in chosen:
            old = self.index.finish_move(key)
            rules.moved(key, Tier.HOST, Tier.DISK, now)
            self._free_location(old.tier, old.handle)
        self.stats["blocks_host_to_disk"] += len(chosen)
        self.stats["disk_block_writes"] += 1
        return True
