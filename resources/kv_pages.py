"""What a request of ``PagedKVCache`` holds: growing its pages, giving them back.

``RequestPages`` grows a request on the device (``allocate``; past the device, a
streamed request's window spills its oldest pages to a host head) and gives back
what a record holds per tier: the release table the cache's ``Lifecycle`` calls;
``adopt_reattached`` places the requests a reattached disk tier still holds.
It changes only the slot lists of the record it is handed; the pools are the
storage's and the mapped prefix blocks the block store's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiering.resources.kv_options import KVContext
from tiering.resources.kv_records import RequestRecord, admitted_early

from tiering.core.lifecycle import Op, guard
from tiering.types import RequestState

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.kv_prefix_api import PrefixReuse

log = logging.getLogger("tiering.kv_cache")


def adopt_reattached(disk, records: dict[str, RequestRecord], clock: Callable[[], float]) -> None:
    """Requests an earlier process left intact on ``disk`` come back as ON_DISK."""
    for rid, (extent, meta) in disk.reattached().items():
        records[rid] = RequestRecord(  # placed at rest on disk, not moved there
            rid, None, clock(), int(meta["num_tokens"]), RequestState.ON_DISK,
            disk=extent, checksum=meta.get("checksum"))


class RequestPages:
    """Allocation and release of a request's slots (see the module doc)."""

    def __init__(self, ctx: KVContext, reuse: PrefixReuse) -> None:
        self._s, self._stream, o = ctx.storage, ctx.stream, ctx.options
        self._g, self._reuse = self._s.geometry, reuse
        self._window, self._stream_pages = o.stream_window_pages, o.stream_buffer_pages

    def allocate(self, r: RequestRecord, num_tokens: int) -> bool:
        early = admitted_early(r)
        if not early:
            guard(r, Op.ALLOCATE)
        if num_tokens <= r.num_tokens:
            return True
        g = self._g
        extra = g.pages_for(num_tokens) - len(r.device) - len(r.shared) - len(r.head)
        if extra > 0 and self._stream is not None and (
                r.head or g.pages_for(num_tokens) - len(r.shared) > self.longest()):
            if early:  # its later layers still copy into its device pages: stream once landed
                return False
            return self._allocate_streamed(r, num_tokens, extra)
        if extra > 0:
            prefix = self._reuse.blocks
            if prefix is not None and not prefix.ensure_device(extra):
                return False
            slots = self._s.device_pool.allocate(r.rid, extra)
            if slots is None:
                return False
            r.device.extend(slots)
            r.index = None
        r.num_tokens = num_tokens
        return True

    def longest(self) -> int:
        """The most pages a request can ever hold on the device (past it, it streams)."""
        return self._s.device_pool.num_pages - self._stream_pages

    def _allocate_streamed(self, r: RequestRecord, num_tokens: int, extra: int) -> bool:
        """Grow a request longer than the device: its window keeps its last
        ``stream_window_pages`` pages (where the new tokens go); older window pages move
        to the host head. False (nothing changed) when the host or device is short."""
        what, W, T = f"allocate({r.rid!r})", self._window, self._g.page_tokens
        s = self._s
        if r.shared or r.blocks or r.prefix_load is not None:
            raise ValueError(f"{what}: a request mapping prefix blocks cannot stream past the device")
        total = self._g.pages_for(num_tokens)
        touched = total - r.num_tokens // T  # the pages the coming writes fill
        if touched > W:
            raise ValueError(
                f"{what}: growing from {r.num_tokens} to {num_tokens} tokens writes {touched} pages"
                f" at once; a streamed request's window (stream_window_pages) holds {W}")
        spill = max(0, len(r.device) + extra - W)
        host = s.host_pool.allocate(r.rid, spill) if spill else []
        if host is None or s.device_pool.free_pages + spill < extra:
            if host:
                s.host_pool.release(r.rid, host)
            return False
        old = r.device[:spill]
        for d, h in zip(old, host, strict=True):  # in stream order before the slots are reused
            s.host[h].copy_(s.dev[d], non_blocking=s.device.type == "cuda")
        if old and s.device.type == "cuda":
            s.streams.compute_marker().synchronize()  # the head is read by the copy thread
        s.device_pool.release(r.rid, old)
        new = s.device_pool.allocate(r.rid, extra)
        r.head.extend(host)
        r.device = r.device[spill:] + new
        r.index = None
        r.num_tokens = num_tokens
        if spill:
            self._stream.forget(r.rid)
        return True

    # the lifecycle's release table (one function per tier) and what a loss adds

    def release_device(self, r: RequestRecord) -> None:
        self._s.device_pool.release(r.rid, r.device)
        r.device, r.index = [], None

    def release_host(self, r: RequestRecord) -> None:
        self._s.host_pool.release(r.rid, r.host)
        r.host = []
        if r.head:
            self._stream.forget(r.rid)
            self._s.host_pool.release(r.rid, r.head)
            r.head = []

    def release_disk(self, r: RequestRecord) -> None:
        extent, r.disk = r.disk, None
        if extent is not None:
            self._s.disk_call(self._s.disk.release, extent)  # also forgets its committed entry

    def release_all(self, r: RequestRecord) -> None:
        prefix = self._reuse.blocks
        if prefix is not None and (r.blocks or r.prefix_load is not None):
            prefix.release_request(r)
        self.release_device(r)
        self.release_host(r)
        self.release_disk(r)

    @staticmethod
    def on_lost(r: RequestRecord, reason: str) -> None:
        log.error("request %r lost: %s", r.rid, reason)
        r.checksum = None
