"""The cache's block space: where ``PrefixCache``'s blocks are, and the copies that move them.

``BlockMoves`` is the ``BlockSpace`` of the cache's block store (``tiering.resources
.kv_prefix_room``): device and host blocks hold pages of the owner ``BLOCKS`` in the
cache's pools, disk blocks are packed in extents of the cache's disk tier, and a move
down copies the bytes on the caller's thread. Which block leaves and where it goes is
``RoomMaker``'s, by the store's rules (``BlockRules``, which the replay runs too);
``BlockMoves`` owns one and is what ``PrefixCache`` calls to make room and to drop.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from tiering.resources.kv_prefix_room import RoomMaker
from tiering.resources.kv_prefix_types import BLOCKS, DISK_OWNER, BlockParts

from tiering.blocks.index import Dropped
from tiering.types import Tier

log = logging.getLogger("tiering.kv_prefix")


class BlockMoves:
    """The cache's ``BlockSpace`` and its ``RoomMaker`` (see the module doc); ``extents``
    (id -> [DiskExtent, live blocks]) are the room maker's."""

    block_pages = 1  # a block is one page of the cache
    instant = False

    def __init__(self, parts: BlockParts, disk_batch_pages: int) -> None:
        self._s, self._index, self._rules, self._crc, self._stats, clock = parts
        self.room = RoomMaker(self._index, self._rules, self, lambda: float(clock()),
                              disk_batch=disk_batch_pages)

    @property
    def extents(self) -> dict[int, list]:
        return self.room.extents

    # -- what the store calls -------------------------------------------------------------

    def ensure_device(self, n: int) -> bool:
        return self.room.ensure(Tier.DEVICE, n)

    def ensure_host(self, n: int) -> bool:
        return self.room.ensure_request(Tier.HOST, n)

    def ensure_disk(self, n: int) -> bool:
        return self.room.ensure_request(Tier.DISK, n)

    def free_location(self, tier: Tier, handle: Hashable) -> None:
        self.room.free_location(tier, handle)

    def drop(self, key: Hashable, reason: str) -> int:
        try:
            return len(self.room.drop(key, reason))
        except ValueError as exc:
            log.error("could not drop block %s: %s", key.hex() if isinstance(key, bytes) else key, exc)
            return 0

    # -- BlockSpace -----------------------------------------------------------------------

    @property
    def has_disk(self) -> bool:
        return self._s.disk is not None

    def _pool(self, tier: Tier):
        return self._s.device_pool if tier is Tier.DEVICE else self._s.host_pool

    def free_pages(self, tier: Tier) -> int:
        return self._pool(tier).free_pages

    def capacity_pages(self, tier: Tier) -> int:
        if tier is Tier.DISK:
            return int(self._s.disk.capacity_pages)
        return self._pool(tier).num_pages

    def request_fits(self, tier: Tier, n: int) -> bool:
        if tier is Tier.DISK:
            return self._s.disk.can_reserve(n)
        return self._pool(tier).free_pages >= n

    def reserve(self, tier: Tier, n: int) -> Any:
        if tier is Tier.DISK:
            return self._s.disk.reserve(DISK_OWNER, n)
        got = self._s.host_pool.allocate(BLOCKS, 1)
        return got[0] if got else None

    def unreserve(self, tier: Tier, room: Any) -> None:
        if tier is Tier.DISK:
            self._s.disk_call(self._s.disk.release, room)
        else:
            self._s.host_pool.release(BLOCKS, [room])

    def copy(self, keys: Sequence[Hashable], handles: Sequence[Any], src: Tier, dst: Tier,
             room: Any) -> bool:
        c = self._s
        try:
            if dst is Tier.HOST:
                c.host[room].copy_(c.dev[handles[0]])
                if c.device.type == "cuda":  # pragma: no cover - needs a GPU
                    torch.cuda.current_stream(c.device).synchronize()
            elif src is Tier.DEVICE:
                page = handles[0]
                c.disk.write(room, c.dev[page : page + 1].to("cpu").contiguous(), first_page=0)
            else:
                pages = c.host[torch.tensor(list(handles), dtype=torch.long)]
                c.disk.write(room, pages.contiguous(), first_page=0)
        except Exception as exc:
            log.error("block demotion %s->%s failed (%d blocks): %s", src.value, dst.value,
                      len(keys), exc)
            return False
        return True

    def settle(self, keys: Sequence[Hashable], handles: Sequence[Any], src: Tier,
               dst: Tier) -> None:
        self._pool(src).release(BLOCKS, list(handles))
        self._stats[f"blocks_{src.value}_to_{dst.value}"] += len(keys)
        if dst is Tier.DISK:
            self._stats["disk_block_writes"] += 1

    def release(self, tier: Tier, handles: Sequence[Any]) -> None:
        self._pool(tier).release(BLOCKS, list(handles))

    def release_extent(self, room: Any) -> None:
        self._s.disk_call(self._s.disk.release, room)

    def dropped(self, key: Hashable, reason: str, gone: Sequence[Dropped]) -> None:
        for d in gone:
            self._crc.pop(d.key, None)
        self._stats[f"dropped_{reason}"] += 1
