"""The vLLM manager's disk tier: extents in the disk store's own ledger, the disk
copies of host blocks, and the write-ahead of host blocks to disk (demotions)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from tiering.core.executor import OFFLOAD
from tiering.disk import DiskIOError, DiskPageStore
from tiering.disk.ledger import DiskExtent
from tiering.integrations.vllm._ctx import Ctx, finished
from tiering.integrations.vllm._host import HostTier
from tiering.integrations.vllm._publish import Publisher
from tiering.integrations.vllm._state import log
from tiering.types import Tier

__all__ = ["DiskTier"]


class DiskTier:
    """The disk tier (``disk``, a ``DiskPageStore`` whose ledger holds every extent; None
    without a disk tier: then nothing here is ever filled) and, per host block:

    - ``copies``: the disk copy of a block located on HOST (being written, or clean:
      evicting its host copy is then a move to DISK that drops nothing);
    - ``demoting``: key -> the write of that copy in flight (the host copy is pinned);
    - ``unwritten``: host blocks without a disk copy, oldest arrival first (what the
      write-ahead takes next).

    ``drop(key, reason, evicted)`` drops a block with its descendants (the cascade's);
    ``publisher`` offers each block written down to the shared tier.
    """

    def __init__(self, ctx: Ctx, host: HostTier, disk: DiskPageStore | None, headroom: int,
                 drop: Callable[..., bool], publisher: Publisher) -> None:
        if disk is not None and disk.page_bytes != host.page_bytes:
            raise ValueError(
                f"disk page {disk.page_bytes} B != host page {host.page_bytes} B (all ranks)"
            )
        self._ctx, self._host, self._drop, self._publisher = ctx, host, drop, publisher
        self.disk = disk
        self.headroom = headroom
        self.copies: dict[bytes, DiskExtent] = {}
        self.demoting: dict[bytes, Future] = {}
        self.unwritten: dict[bytes, None] = {}

    # -- extents -------------------------------------------------------------------------

    def release(self, ext: DiskExtent) -> None:
        assert self.disk is not None
        try:
            self.disk.release(ext)
        except (ValueError, DiskIOError) as exc:  # stays quarantined in the ledger
            log.warning("tiering: releasing disk extent %s: %s", ext, exc)

    def ready_copy(self, key: bytes) -> bool:
        """``key`` (on host) has a disk copy written and checked in."""
        return key in self.copies and key not in self.demoting

    def let_go_of_copy(self, key: bytes) -> None:
        """Release ``key``'s clean disk copy (its host copy stays, to be written again)."""
        self.release(self.copies.pop(key))
        self.unwritten[key] = None
        self._ctx.event((key,), "disk", True)

    def reserve(self, key: bytes, evicted: list[bytes], copies: bool = True
                ) -> DiskExtent | None:
        """A disk extent for ``key``, making room by the rules (a disk victim, the disk
        policy's, is dropped; never an ancestor of ``key``); with ``copies``, then by
        letting go of disk copies of host blocks (oldest first: the host copy stays).
        None when neither makes room."""
        assert self.disk is not None
        owner = "k" + key.hex()
        ext = self.disk.reserve(owner, 1)
        if ext is not None:
            return ext
        ctx = self._ctx
        now = ctx.clock()
        guarded = ctx.ancestors([key])
        while True:
            k = ctx.rules.victim(Tier.DISK, now, guarded)
            if k is None:
                break
            ctx.counters.disk_evictions += 1
            self._drop(k, "evicted", evicted)
            ext = self.disk.reserve(owner, 1)
            if ext is not None:
                return ext
        if not copies:
            return None
        for k in list(self.copies):
            if k in guarded or not self.ready_copy(k):
                continue
            self.let_go_of_copy(k)
            ctx.counters.disk_evictions += 1
            ext = self.disk.reserve(owner, 1)
            if ext is not None:
                return ext
        return None

    # -- a host block's copy --------------------------------------------------------------

    def stored(self, key: bytes) -> None:
        """``key`` entered the host tier: it is to be written down."""
        if self.disk is not None:
            self.unwritten[key] = None

    def promoted(self, key: bytes, ext: DiskExtent) -> None:
        """``key`` was promoted from ``ext``, which stays its disk copy."""
        self.copies[key] = ext

    def hand_over(self, key: bytes) -> DiskExtent:
        """``key`` leaves the host for its clean disk copy: that copy, now no longer one."""
        return self.copies.pop(key)

    def forget(self, key: bytes) -> bool:
        """``key`` was dropped from the host: its disk copy (if any) is released; True if
        it had one."""
        self.unwritten.pop(key, None)
        ext = self.copies.pop(key, None)
        if ext is None:
            return False
        self.release(ext)
        return True

    def reset(self) -> None:
        """Forget the clean copies of host blocks still indexed (the rest go with them)."""
        for k in list(self.copies):
            if k in self._ctx.index and self.ready_copy(k):
                self.let_go_of_copy(k)

    # -- the write-ahead ---------------------------------------------------------------------

    def _write_slot(self, extent: DiskExtent, slot: int, key: bytes) -> bool | None:
        """I/O thread: write ``key``'s host slot to disk, then publish it."""
        assert self.disk is not None
        page = self._host.page(slot)
        self.disk.write(extent, page)
        return self._publisher.publish(key, page)

    def demote_for_headroom(self) -> None:
        """Write host blocks with no disk copy down, oldest arrival first, until
        ``headroom`` slots are free or clean. A copy, not a decision: no policy is asked
        (the disk's policy admits the block when it leaves the host); disk room for the
        copy is made by the rules, never by letting go of another copy."""
        pool = self._host.pool
        if pool.free_pages >= self.headroom:
            return  # the common case costs nothing per step
        ctx = self._ctx
        spare = pool.free_pages + len(self.copies) - len(self.demoting)
        for k in list(self.unwritten):
            if spare >= self.headroom or len(self.demoting) >= 4 * ctx.cfg.io_threads:
                return
            if k not in self.unwritten:
                continue  # dropped while room was made for another one
            info = ctx.index.get(k)
            if info is None or info.refs or k in ctx.lost:
                continue
            loc = ctx.index.location(k)
            assert loc is not None and loc.tier is Tier.HOST
            ext = self.reserve(k, [], copies=False)
            if ext is None:
                return
            if k not in self.unwritten:  # made room by dropping its own chain: let it go
                self.release(ext)
                continue
            del self.unwritten[k]
            self.copies[k] = ext
            ctx.index.acquire(k)  # pinned until the write is reaped
            ctx.counters.demotions_started += 1
            self.demoting[k] = ctx.io.submit(OFFLOAD, self._write_slot, ext, loc.handle, k)
            spare += 1
            ctx.dirty = True

    def reap(self) -> None:
        """Settle finished demotions (non-blocking)."""
        ctx = self._ctx
        for key, fut in finished(self.demoting):
            ctx.index.release(key)
            ctx.dirty = True
            exc = fut.exception()
            if exc is None:  # a copy: the block stays on the host (no policy is told)
                ctx.event((key,), "disk", False)
                ctx.counters.demotions_ok += 1
                self._publisher.count(fut.result())
            else:
                log.warning("tiering: demotion of %s failed: %s", key.hex(), exc)
                ctx.counters.demotions_failed += 1
                self.release(self.copies.pop(key))
                self.unwritten[key] = None
