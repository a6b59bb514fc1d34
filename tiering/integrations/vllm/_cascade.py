"""The vLLM manager's cascade (``Cascade``): making host room by the block rules, a
host victim moving down or being dropped, and dropping a block with its descendants
from every tier. It owns no table: it applies the rules' decisions to the parts that do."""

from __future__ import annotations

from tiering.integrations.vllm._ctx import Ctx
from tiering.integrations.vllm._disk import DiskTier
from tiering.integrations.vllm._host import HostTier
from tiering.integrations.vllm._reads import DiskReads
from tiering.types import Tier

__all__ = ["Cascade"]


class Cascade:
    """Room and drops over the host tier, the disk tier and the load rows. ``reads`` is
    attached after it is made (it makes room through this object)."""

    def __init__(self, ctx: Ctx, host: HostTier, disk: DiskTier) -> None:
        self._ctx = ctx
        self._host = host
        self._disk = disk
        self._reads: DiskReads | None = None

    def attach(self, reads: DiskReads) -> None:
        self._reads = reads

    def remove(self, key: bytes, reason: str, evicted: list[bytes] | None = None) -> bool:
        """Drop a block and its cached descendants from every tier and free what they
        held; a block being stored under one of them is not stored (it would start a
        chain the index does not link: the cache drops a block with its descendants).
        False (and the block answers MISS until a later retry succeeds) when it or a
        descendant is busy (loading, being written down or promoted)."""
        ctx, host, disk = self._ctx, self._host, self._disk
        if not ctx.index.evictable(key):
            if key not in ctx.lost:
                ctx.counters.drops_deferred += 1
            ctx.lost[key] = reason
            return False
        assert self._reads is not None
        host_gone: list[bytes] = []
        disk_gone: list[bytes] = []
        gone = ctx.index.drop(key, reason)
        ctx.rules.dropped(gone)
        for d in gone:
            k = d.key
            if d.tier is Tier.HOST:
                host.left(k, d.handle)
                host_gone.append(k)
                if disk.forget(k):
                    disk_gone.append(k)
            else:
                disk.release(d.handle)
                disk_gone.append(k)
                self._reads.drop_row(k)
            ctx.lost.pop(k, None)
            ctx.counters.dropped += 1
            if evicted is not None:
                evicted.append(k)
        if host.storing:
            host.orphan_under({d.key for d in gone})
        if host_gone:
            ctx.event(host_gone, "host", True)
        if disk_gone:
            ctx.event(disk_gone, "disk", True)
        ctx.dirty = True
        return True

    def retry_lost(self) -> None:
        lost = self._ctx.lost
        for k in list(lost):
            reason = lost.get(k)
            if reason is None:
                continue  # dropped meanwhile, as a descendant of another lost block
            if k in self._ctx.index:
                self.remove(k, reason)
            else:
                lost.pop(k, None)

    def free_host_slots(
        self, need: int, evicted: list[bytes], protect: set[bytes], partial: bool = False
    ) -> bool:
        """Make ``need`` host slots free by the block rules; all or nothing (with
        ``partial``, as many as it can: the caller reads ``pool.free_pages``).

        As in the cache (``BlockRules``): refused at once, nothing moved, unless enough
        host blocks may leave (``reachable``); each victim is the host policy's and
        moves to disk when the disk's policy admits it, else it is dropped with its
        cached descendants. What vLLM changes: a move down only hands over the disk
        copy written ahead (``demote_headroom``), so a victim whose copy is not written
        yet is passed over; the chains above ``protect`` (blocks being stored or
        promoted) and blocks promoted for a waiting lookup stay."""
        ctx, pool = self._ctx, self._host.pool
        short = need - pool.free_pages
        if short <= 0:
            return True
        now = ctx.clock()
        skip = ctx.ancestors(protect)
        skip.update(self._host.held())
        index = ctx.index
        # skipped blocks the policy could offer: counted on top, so that enough others may leave
        extra = sum(1 for k in skip if index.evictable(k) and index.location(k).tier is Tier.HOST)
        want = short if not partial else min(short, max(0, index.idle_count(Tier.HOST) - extra))
        if want and not ctx.rules.reachable(Tier.HOST, want + extra, now):
            return False
        has_disk = self._disk.disk is not None
        while pool.free_pages < need:
            k = ctx.rules.victim(Tier.HOST, now, skip)
            if k is None:
                break
            if has_disk and not self._disk.ready_copy(k):
                skip.add(k)  # not on disk yet: it cannot leave now (its write is ahead)
                continue
            self._host_victim_leaves(k, evicted, now)
        return pool.free_pages >= need

    def _host_victim_leaves(self, key: bytes, evicted: list[bytes], now: float) -> None:
        """A host victim moves down (its disk copy is ready) if the disk's policy admits
        it, else it is dropped with its descendants (``BlockRules.admits``)."""
        ctx = self._ctx
        ctx.counters.host_evictions += 1
        if self._disk.disk is not None:
            if ctx.rules.admits(Tier.DISK, key, now):
                self.evict_clean_host_copy(key, now)
                return
            ctx.counters.demotions_not_admitted += 1
        self.remove(key, "evicted", evicted)

    def evict_clean_host_copy(self, key: bytes, now: float | None = None) -> None:
        """``key`` leaves the host for the disk, where its copy is (``BlockRules.moved``)."""
        ctx = self._ctx
        if now is None:
            now = ctx.clock()
        ext = self._disk.hand_over(key)
        old = ctx.index.move(key, Tier.DISK, ext)  # the bytes are on disk already
        ctx.rules.moved(key, Tier.HOST, Tier.DISK, now)
        self._host.left(key, old.handle)
        ctx.event((key,), "host", True)
        ctx.dirty = True
