"""The block store's moves down the tiers: making room and dropping blocks.

``BlockMoves`` frees a block's location, drops a block with its descendants, and
moves unmapped blocks down (device -> host -> disk) when the cache needs room, on
the caller's thread. Which block leaves, and whether the tier below takes it, are
the store's rules (``tiering.resources.kv_prefix_rules.BlockRules``, which the
replay runs too): a victim moves down when the tier below admits it and room can be
made there (a device victim the host refuses goes to disk when the disk admits it),
else it is dropped. ``PrefixCache`` hands it the index, the rules, the
crc table and the counters it shares, and calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch
from tiering.resources.kv_prefix_types import BLOCKS, DISK_OWNER, BlockParts

from tiering.types import Tier

if TYPE_CHECKING:  # pragma: no cover
    pass

log = logging.getLogger("tiering.kv_prefix")


class BlockMoves:
    """Moving blocks down and dropping them (see the module doc). It owns the disk
    extents blocks are packed in (``extents``: id -> [DiskExtent, live blocks])."""

    def __init__(self, parts: BlockParts, disk_batch_pages: int) -> None:
        self._s, self._index, self._rules, self._crc, self._stats, self._clock = parts
        self._batch = disk_batch_pages
        self.extents: dict[int, list] = {}
        self._extent_ids = 0

    def _now(self) -> float:
        return float(self._clock())

    def free_location(self, tier: Tier, handle: Hashable) -> None:
        c = self._s
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

    def drop(self, key: Hashable, reason: str) -> int:
        try:
            gone = self._index.drop(key, reason)
        except ValueError as exc:
            log.error("could not drop block %s: %s", key.hex() if isinstance(key, bytes) else key, exc)
            return 0
        self._rules.dropped(gone)
        for d in gone:
            self._crc.pop(d.key, None)
            self.free_location(d.tier, d.handle)
        self._stats[f"dropped_{reason}"] += 1
        return len(gone)

    def ensure_device(self, n: int) -> bool:
        pool = self._s.device_pool
        if self._out_of_reach(Tier.DEVICE, pool, n):
            return False
        while pool.free_pages < n:
            key = self._rules.victim(Tier.DEVICE, self._now())
            if key is None:
                return False
            self._move_device_block_down(key)
        return True

    def ensure_host(self, n: int) -> bool:
        pool = self._s.host_pool
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
        return not self._rules.reachable(tier, n - pool.free_pages, self._now())

    def _move_device_block_down(self, key: Hashable) -> None:
        c = self._s
        page = self._index.location(key).handle
        slot = None
        if self._rules.admits(Tier.HOST, key, self._now()):
            room = c.host_pool.free_pages > 0 or self.ensure_host(1)
            if key not in self._index:
                # making room on the host dropped an ancestor of this block (a host victim
                # takes its descendants with it), and this block with it: its page is free
                self._stats["dropped_with_ancestor"] += 1
                return
            if room:
                got = c.host_pool.allocate(BLOCKS, 1)
                slot = got[0] if got else None
        if slot is None:  # the host refused it or has no room: the disk may take it
            if c.disk is not None and self._rules.admits(Tier.DISK, key, self._now()):
                self._device_block_to_disk(key, page)
            else:
                self.drop(key, "evicted")  # nowhere below: it leaves the cache
            return
        self._index.begin_move(key, Tier.HOST, slot)
        try:
            c.host[slot].copy_(c.dev[page])
            if c.device.type == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.current_stream(c.device).synchronize()
        except Exception as exc:
            log.error("block demotion device->host failed: %s", exc)
            self._index.fail_move(key)
            c.host_pool.release(BLOCKS, [slot])
            self.drop(key, "demote_failed")
            return
        old = self._index.finish_move(key)
        self._rules.moved(key, Tier.DEVICE, Tier.HOST, self._now())
        self.free_location(old.tier, old.handle)
        self._stats["blocks_device_to_host"] += 1

    def _disk_extent(self, n: int):
        """A disk extent of ``n`` pages for blocks whose moves have begun, room made by
        dropping the bottom tier's victims (never an ancestor of a moving block: those are
        held while their descendants move); None when the disk cannot make the room."""
        c = self._s
        extent = c.disk.reserve(DISK_OWNER, n)
        while extent is None:
            key = self._rules.victim(Tier.DISK, self._now())
            if key is None:
                break
            self.drop(key, "evicted")
            extent = c.disk.reserve(DISK_OWNER, n)
        return extent

    def _device_block_to_disk(self, key: Hashable, page: int) -> None:
        """A device victim the host refused (or had no room for) and the disk admitted goes
        straight to disk in a write of its own (room made there by dropping disk victims,
        never an ancestor: those are held while it moves); no room, or a failed write,
        drops it."""
        c = self._s
        rules = self._rules
        ext_id = self._extent_ids + 1
        self._index.begin_move(key, Tier.DISK, (ext_id, 0))
        extent = self._disk_extent(1)
        if extent is None:  # the disk is full of blocks that may not leave
            self._index.fail_move(key)
            self.drop(key, "evicted")
            return
        try:
            c.disk.write(extent, c.dev[page : page + 1].to("cpu").contiguous(), first_page=0)
        except Exception as exc:
            log.error("block demotion device->disk failed: %s", exc)
            self._index.fail_move(key)
            c.disk_call(c.disk.release, extent)
            self.drop(key, "demote_failed")
            return
        self._extent_ids = ext_id
        self.extents[ext_id] = [extent, 1]
        old = self._index.finish_move(key)
        rules.moved(key, Tier.DEVICE, Tier.DISK, self._now())
        self.free_location(old.tier, old.handle)
        self._stats["blocks_device_to_disk"] += 1
        self._stats["disk_block_writes"] += 1

    def _host_blocks_down(self, want: int) -> bool:
        """Move up to a batch of unmapped host blocks to disk in one write: each victim the
        disk policy admits is marked for disk, one it refuses is dropped; then room is
        made on disk (its victims dropped) and the batch written. With no disk, or no room
        there, the first victim is dropped instead (the rest stay); a failed write drops
        the batch. False when there is nothing to move."""
        c = self._s
        rules = self._rules
        if c.disk is None:
            key = rules.victim(Tier.HOST, self._now())
            if key is None:
                return False
            self.drop(key, "evicted")
            return True
        batch = max(want, min(self._batch, self._index.count(Tier.HOST)))
        ext_id = self._extent_ids + 1
        keys, refused = rules.disk_batch(
            batch, self._now, lambda key: self.drop(key, "evicted"),
            lambda key, i: self._index.begin_move(key, Tier.DISK, (ext_id, i)))
        chosen = [(key, self._index.location(key).handle) for key in keys]  # host slots
        if not chosen:
            return refused > 0
        extent = self._disk_extent(len(chosen))
        if extent is None:  # the disk cannot take them: the best victim leaves, the rest stay
            for key, _ in chosen:
                self._index.fail_move(key)
            self.drop(chosen[0][0], "evicted")
            return True
        self._extent_ids = ext_id
        slots = [s for _, s in chosen]
        try:
            pages = c.host[torch.tensor(slots, dtype=torch.long)]
            c.disk.write(extent, pages.contiguous(), first_page=0)
        except Exception as exc:
            log.error("block demotion host->disk failed, dropping %d blocks: %s", len(chosen), exc)
            for key, _ in chosen:
                self._index.fail_move(key)
            c.disk_call(c.disk.release, extent)
            for key, _ in chosen:  # ancestors first: a drop takes the chosen blocks below it
                if key in self._index:
                    self.drop(key, "demote_failed")
            return True
        self.extents[ext_id] = [extent, len(chosen)]
        now = self._now()
        for key, _slot in chosen:
            old = self._index.finish_move(key)
            rules.moved(key, Tier.HOST, Tier.DISK, now)
            self.free_location(old.tier, old.handle)
        self._stats["blocks_host_to_disk"] += len(chosen)
        self._stats["disk_block_writes"] += 1
        return True
