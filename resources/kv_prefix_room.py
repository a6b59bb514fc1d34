"""Making room down the tiers, written once for every block store.

``RoomMaker`` frees pages of a block store's device or host tier by moving its
unmapped blocks down (device -> host -> disk) or dropping them, and owns the disk
extents blocks are packed in (a batch of blocks per extent; the extent's room is given
back when its last block leaves). Which block leaves, and whether the tier below takes
it, are the store's rules (``BlockRules``); where the bytes are and how they are copied
is the store's ``BlockSpace``. The cache's ``PrefixCache`` (real pools, copies and disk
writes) and the replay's ``PrefixBlocks`` (modelled pages and links) each give one, so
both make room by the same steps in the same order:

- **Device** (``ensure(DEVICE, n)``): refused at once, nothing moved, unless the device
  holds ``n`` pages and enough of its blocks may leave. Then, until ``n`` pages are
  free, the device policy's victim goes to the host when the host policy admits it and
  room can be made there (``ensure(HOST, ...)``); else (refused by the host, or no room)
  to the disk in a write of its own when the disk policy admits it and room can be made
  there; else it is dropped with its cached descendants. Making room on the host may drop
  an ancestor of the victim, and the victim with it: then its pages are free already.
- **Host** (``ensure(HOST, n)``): refused the same way; then up to ``disk_batch``
  victims the disk policy admits go to disk in one write (one it refuses is dropped);
  with no disk, or no room there, the first victim is dropped and the rest stay.
- **Disk room**: disk victims are dropped until the space reserves the extent (never an
  ancestor of a block moving there: those are held while it moves).
- **Room for a live request** (``ensure_request``): its offload to the host, or its
  offload or demotion to disk, comes before cached blocks. Host blocks go down (as
  above) and disk blocks are dropped until the request fits on one tier of that role
  (``request_fits``: a request's pages land in one tier, blocks spread over them).
- **A failed copy** leaves nothing half-moved: the moves are undone, the room given back,
  and the blocks dropped (reason ``demote_failed``); no byte is read from them again.

A block is ``block_pages`` pages of the space (1 in the cache). The disk handle of a
block is ``(extent id, place in its batch)``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from tiering.blocks.index import BlockIndex, Dropped
from tiering.types import Tier

__all__ = ["BlockSpace", "RoomMaker"]


class BlockSpace(Protocol):
    """Where a block store's bytes are: what ``RoomMaker`` asks and tells its store.

    ``block_pages``: pages per block; ``has_disk``: a disk tier is there;
    ``request_fits(tier, n)``: one tier of that role (host or disk) can take ``n`` pages of
    a request now; ``instant``:
    copies land at once and never fail (a modelled store; it needs no ``copy`` and no
    ``unreserve``: neither is called).
    ``reserve(tier, n)``: room for ``n`` blocks on the host (n = 1: the block's handle
    there) or the disk (an extent), None when short; ``unreserve`` gives unused room back.
    ``copy(keys, handles, src, dst, room)``: the bytes of ``keys`` (at ``handles`` on
    ``src``) into ``room``; False when it failed (nothing of it is used).
    ``settle(keys, handles, src, dst)``: the move landed (the index says so): the old
    places on ``src`` are the space's to free (``handles`` empty for an instant space). ``release(tier, handles)``: device or host
    pages of blocks that left; ``release_extent(room)``: a disk extent no block uses.
    ``dropped(key, reason, gone)``: ``key`` and its descendants (``gone``) left the store
    (reason ``with_ancestor``, ``gone`` empty: a victim an ancestor's drop took before).
    """

    block_pages: int
    has_disk: bool
    instant: bool

    def free_pages(self, tier: Tier) -> int: ...
    def request_fits(self, tier: Tier, n: int) -> bool: ...
    def capacity_pages(self, tier: Tier) -> int: ...
    def reserve(self, tier: Tier, n: int) -> Any: ...
    def unreserve(self, tier: Tier, room: Any) -> None: ...
    def copy(self, keys: Sequence[Hashable], handles: Sequence[Any], src: Tier, dst: Tier,
             room: Any) -> bool: ...
    def settle(self, keys: Sequence[Hashable], handles: Sequence[Any], src: Tier,
               dst: Tier) -> None: ...
    def release(self, tier: Tier, handles: Sequence[Any]) -> None: ...
    def release_extent(self, room: Any) -> None: ...
    def dropped(self, key: Hashable, reason: str, gone: Sequence[Dropped]) -> None: ...


class RoomMaker:
    """Moves a store's blocks down and drops them (see the module docstring).

    ``clock()``: the time, a float; ``move``: device victims go down a tier (False: they
    are dropped); ``disk_batch``: the most host blocks one write to disk packs. Owns ``extents`` (id -> [room, live blocks]).
    """

    def __init__(self, index: BlockIndex, rules: Any, space: BlockSpace,
                 clock: Callable[[], float], *, disk_batch: int = 16, move: bool = True) -> None:
        if isinstance(disk_batch, bool) or not isinstance(disk_batch, int) or disk_batch < 1:
            raise ValueError(f"disk_batch must be an int >= 1, got {disk_batch!r}")
        self.index = index
        self.rules = rules
        self.space = space
        self._clock = clock
        self.disk_batch = disk_batch
        self.move = bool(move)
        self.extents: dict[int, list] = {}
        self._extent_ids = 0

    # -- making room --------------------------------------------------------------------

    def ensure(self, tier: Tier, n: int) -> bool:
        """Free pages of ``tier`` (device or host) until ``n`` are free; False at once, with
        nothing changed, when the tier is smaller or the blocks that may leave would not
        free enough (some may have gone before a False when the policy offers no more)."""
        if tier is Tier.DISK:
            raise ValueError("RoomMaker.ensure: the disk makes room with ensure_request")
        space = self.space
        free = space.free_pages
        have = free(tier)
        if have >= n:
            return True
        bp = space.block_pages
        if n > space.capacity_pages(tier) or not self.rules.reachable(
                tier, -(-(n - have) // bp), self._clock()):
            return False
        if tier is Tier.DEVICE:
            while free(tier) < n:
                if not self._device_victim_down():
                    return False
            return True
        while free(tier) < n:
            if not self._host_batch_down(-(-(n - free(tier)) // bp)):
                return False
        return True

    def ensure_request(self, tier: Tier, n: int) -> bool:
        """Make room on ``tier`` (HOST or DISK) for ``n`` pages of a live request (its
        offload or demotion comes before cached blocks): host blocks no request maps go
        down, disk ones are dropped, in the tier policy's order, until the request fits
        (``request_fits``). False at once, nothing moved, when there is no such tier, it is
        smaller, or no block may leave; some may have gone before a False when the policy
        offers no more."""
        if tier is not Tier.HOST and tier is not Tier.DISK:
            raise ValueError(f"RoomMaker.ensure_request: tier must be HOST or DISK, "
                             f"got {tier!r}")
        space = self.space
        if tier is Tier.DISK and not space.has_disk:
            return False
        fits = space.request_fits
        if fits(tier, n):
            return True
        bp = space.block_pages
        # the blocks that must leave at least: all of the shortfall (the host), or one (the
        # disk, which drops them: a victim's descendants go with it)
        least = max(1, -(-(n - space.free_pages(tier)) // bp)) if tier is Tier.HOST else 1
        if n > space.capacity_pages(tier) or not self.rules.reachable(tier, least,
                                                                      self._clock()):
            return False
        while not fits(tier, n):
            if tier is Tier.HOST:
                short = max(1, -(-(n - space.free_pages(tier)) // bp))
                if not self._host_batch_down(short):
                    return False
                continue
            key = self.rules.victim(Tier.DISK, self._clock())
            if key is None:
                return False
            self.drop(key, "evicted")
        return True

    def _device_victim_down(self) -> bool:
        """One victim of the device policy leaves (``demote``); False if the policy offers
        nothing that may leave."""
        now = self._clock()
        key = self.rules.victim(Tier.DEVICE, now)
        if key is None:
            return False
        self.demote(key, now)
        return True

    def demote(self, key: Hashable, now: float | None = None) -> None:
        """``key``, an unmapped device block not moving, leaves the device as a victim does
        (see the module docstring): to the host, else the disk, else dropped."""
        rules, index, space = self.rules, self.index, self.space
        if now is None:
            now = self._clock()
        if self.move:
            if rules.admits(Tier.HOST, key, now):
                room = space.free_pages(Tier.HOST) >= space.block_pages or self.ensure(
                    Tier.HOST, space.block_pages)
                if key not in index:  # a host victim dropped an ancestor, and this block with it
                    space.dropped(key, "with_ancestor", ())
                    return
                slot = space.reserve(Tier.HOST, 1) if room else None
                if slot is not None:
                    self._land([key], Tier.DEVICE, Tier.HOST, slot, 0, now)
                    return
            if space.has_disk and rules.admits(Tier.DISK, key, now):  # refused or no room above
                self._to_disk([key], Tier.DEVICE, now)
                return
        self.drop(key, "evicted")

    def _host_batch_down(self, want: int) -> bool:
        """Up to a batch of host victims go to disk in one write (see the module docstring).
        False when the host policy offers nothing."""
        rules, index = self.rules, self.index
        if not self.space.has_disk:
            key = rules.victim(Tier.HOST, self._clock())
            if key is None:
                return False
            self.drop(key, "evicted")
            return True
        batch = max(want, min(self.disk_batch, index.count(Tier.HOST)))
        ext = self._extent_ids + 1
        keys, refused = rules.disk_batch(
            batch, self._clock, lambda key: self.drop(key, "evicted"),
            lambda key, i: index.begin_move(key, Tier.DISK, (ext, i)))
        if not keys:
            return refused > 0
        self._to_disk(keys, Tier.HOST, self._clock(), ext)
        return True

    def _to_disk(self, keys: list[Hashable], src: Tier, now: float, ext: int = 0) -> None:
        """``keys`` (on ``src``) go to disk in one write as extent ``ext`` (0: a new one,
        their moves not begun yet), room made there first; with no room the first of them
        is dropped and the rest stay where they are."""
        index = self.index
        if not ext:  # held while disk victims are dropped for it
            ext = self._extent_ids + 1
            for i, key in enumerate(keys):
                index.begin_move(key, Tier.DISK, (ext, i))
        room = self._disk_room(len(keys))
        if room is None:  # the disk is full of blocks that may not leave
            for key in keys:
                index.fail_move(key)
            self.drop(keys[0], "evicted")
            return
        self._land(keys, src, Tier.DISK, room, ext, now)

    def _disk_room(self, n: int) -> Any:
        """An extent of ``n`` blocks, room made by dropping disk victims; None when the disk
        cannot make it."""
        space = self.space
        room = space.reserve(Tier.DISK, n)
        while room is None:
            key = self.rules.victim(Tier.DISK, self._clock())
            if key is None:
                break
            self.drop(key, "evicted")
            room = space.reserve(Tier.DISK, n)
        return room

    def _land(self, keys: list[Hashable], src: Tier, dst: Tier, room: Any, ext: int,
              now: float) -> None:
        """Copy ``keys`` from ``src`` into ``room`` on ``dst`` (a host slot, or disk extent
        ``ext`` whose moves have begun) and settle the books; a failed copy drops them."""
        index, space = self.index, self.space
        if space.instant:  # the books change at once; the old places are the space's to settle
            handles: list = []
            if dst is Tier.HOST:
                index.move(keys[0], dst, room)
                self._moved(keys, handles, src, dst, now)
                return
        else:
            handles = [index.location(k).handle for k in keys]
            if dst is Tier.HOST:
                index.begin_move(keys[0], dst, room)
        if not space.instant and not space.copy(keys, handles, src, dst, room):
            for key in keys:
                index.fail_move(key)
            space.unreserve(dst, room)
            for key in keys:  # ancestors first: a drop takes the chosen blocks below it
                if key in index:
                    self.drop(key, "demote_failed")
            return
        if dst is Tier.DISK:
            self._extent_ids = ext
            self.extents[ext] = [room, len(keys)]
        for key in keys:
            index.finish_move(key)
        self._moved(keys, handles, src, dst, now)

    def _moved(self, keys: list[Hashable], handles: list, src: Tier, dst: Tier,
               now: float) -> None:
        moved = self.rules.moved
        for key in keys:
            moved(key, src, dst, now)
        self.space.settle(keys, handles, src, dst)

    # -- dropping, freeing ----------------------------------------------------------------

    def drop(self, key: Hashable, reason: str) -> list[Dropped]:
        """Drop ``key`` and its cached descendants; what they held is given back. Raises
        ValueError (nothing changed) if ``key`` is mapped or moving."""
        gone = self.index.drop(key, reason)
        self.rules.dropped(gone)
        self.free(gone)
        self.space.dropped(key, reason, gone)
        return gone

    def free(self, gone: Sequence[Dropped]) -> None:
        """Give back the places of blocks that left the index."""
        if len(gone) == 1:
            d = gone[0]
            self.free_location(d.tier, d.handle)
            return
        by_tier: dict[Tier, list] = {}
        for d in gone:
            if d.tier is Tier.DISK:
                self.free_location(d.tier, d.handle)
            else:
                by_tier.setdefault(d.tier, []).append(d.handle)
        for tier, handles in by_tier.items():
            self.space.release(tier, handles)

    def free_location(self, tier: Tier, handle: Any) -> None:
        """The block at ``handle`` on ``tier`` left it: its place there is free (on disk,
        its extent's room once no block of the extent is left)."""
        if tier is not Tier.DISK:
            self.space.release(tier, [handle])
            return
        ext_id, _ = handle
        entry = self.extents[ext_id]
        entry[1] -= 1
        if entry[1] == 0:
            del self.extents[ext_id]
            self.space.release_extent(entry[0])

    def problems(self) -> list[str]:
        """Problems found (empty: none): each extent's live count is the blocks held in it
        (at rest or moving there), and no block names an extent that is not held."""
        live: dict[int, int] = {}
        for key in self.index.keys():
            loc = self.index.location(key)
            for tier, handle in ((loc.tier, loc.handle), (loc.moving_to, loc.dest_handle)):
                if tier is Tier.DISK:
                    live[handle[0]] = live.get(handle[0], 0) + 1
        out = [f"disk extent {ext_id}: {n} live blocks recorded, {live.get(ext_id, 0)} held"
               for ext_id, (_, n) in self.extents.items() if live.get(ext_id, 0) != n]
        if set(live) - set(self.extents):
            out.append("a block names a disk extent the store does not hold")
        return out
