"""The byte copies behind every move of ``PagedKVCache``, run on worker threads.

``CopyJobs`` holds no records and changes none: each job copies pages between
the device, the host slab and the disk tier of a ``KVStorage`` (straight, or through the staging
ring on a GPU), optionally computes a checksum, and returns a value (or
raises) that the cache's ``poll`` applies on the caller's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tiering.core.checksum import ChecksumMismatch, crc_of, crc_of_pages
from tiering.core.staging import StagingTimeout
from tiering.core.transfer import coalesce, copy_runs, issue_runs

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.kv_storage import KVStorage


class CopyJobs:
    """The worker-thread half of the cache's moves (one per ``Move``).

    It reads the storage's tensors, streams, disk tier, ring and fault hook when
    a job runs (so a hook swapped in by a test applies to the next copy)."""

    def __init__(self, storage: KVStorage) -> None:
        self._s = storage

    def offload_host(self, dev_slots, host_slots, marker):
        copy_runs(self._s.streams, self._s.dev, self._s.host, coalesce(dev_slots, host_slots), "d2h",
                  after=marker, fault_hook=self._s.fault)
        return crc_of_pages(self._s.host, host_slots) if self._s.verify else None

    def offload_disk(self, dev_slots, extent, marker):
        if self._s.stage:
            return self._staged_write(dev_slots, extent, marker)
        crc = 0  # a CPU device: each run of pages goes to disk from where it lies
        for r in coalesce(dev_slots, range(len(dev_slots))):
            self._s.fault("d2h")
            pages = self._s.dev[r.src : r.src + r.length]
            crc = crc_of(pages, crc) if self._s.verify else 0
            self._s.disk.write(extent, pages, first_page=r.dst)
        return crc if self._s.verify else None

    def demote(self, host_slots, extent):
        # the request's host slots stay its own until the write completes; each
        # run of host pages is written from where it lies
        for r in coalesce(host_slots, range(len(host_slots))):
            self._s.disk.write(extent, self._s.host[r.src : r.src + r.length], first_page=r.dst)

    def reload_host(self, host_slots, dev_slots, checksum, marker, progress):
        try:
            if checksum is not None and crc_of_pages(self._s.host, host_slots) != checksum:
                raise ChecksumMismatch("host copy does not match the checksum taken at offload")
            runs = coalesce(host_slots, dev_slots)
            if not progress.layerwise:
                done = copy_runs(self._s.streams, self._s.host, self._s.dev, runs,
                                 "h2d", after=marker, fault_hook=self._s.fault)
                progress.landed_all(done)
                return done
            done = None
            for layer in range(progress.num_layers):  # layer L is readable while L+1 copies
                done = issue_runs(self._s.streams, self._s.host, self._s.dev, runs, "h2d",
                                  after=marker if layer == 0 else None,
                                  fault_hook=self._s.fault, layer=layer)
                progress.landed(layer, done)
            if done is not None:
                done.synchronize()  # the job ends (and the host slots go back) after the last copy
            return done
        except BaseException as exc:
            progress.fail(progress.ready, f"{type(exc).__name__}: {exc}")
            raise

    def reload_disk(self, extent, dev_slots, checksum, marker, progress):
        """Every layer of a disk reload lands at once: a page on disk is one verified
        chunk holding all its layers."""
        try:
            self._reload_disk(extent, dev_slots, checksum, marker)
        except BaseException as exc:
            progress.fail(0, f"{type(exc).__name__}: {exc}")
            raise
        progress.landed_all()

    def _reload_disk(self, extent, dev_slots, checksum, marker):
        if self._s.stage:
            crc = self._staged_read(extent, dev_slots, marker)
        else:
            # a CPU device: straight into the destination; the slots are this
            # reload's own and are not readable until the completion lands
            crc = 0
            for r in coalesce(range(len(dev_slots)), dev_slots):
                self._s.fault("h2d")
                dst = self._s.dev[r.dst : r.dst + r.length]
                self._s.read_disk(extent, dst, r.src)
                crc = crc_of(dst, crc) if checksum is not None else 0
        if checksum is not None and crc != checksum:
            raise ChecksumMismatch("disk copy does not match the checksum taken at offload")
        return None

    def _acquire_staging(self) -> torch.Tensor:
        buf = self._s.ring.acquire()
        if buf is None:
            raise StagingTimeout(
                f"no staging buffer came free within {self._s.ring.config.timeout_s}s"
            )
        return buf

    def _staged_write(self, dev_slots, extent, marker):
        """Device pages to disk through the ring, a piece at a time: the copy
        of piece i+1 is queued before piece i is written."""
        P, n = self._s.ring.pages, len(dev_slots)
        crc = 0
        pending: list[tuple[torch.Tensor, int, int, Any]] = []  # (buf, first page, count, event)
        held: list[torch.Tensor] = []

        def drain_one() -> None:
            nonlocal crc
            buf, p, k, ev = pending.pop(0)
            if ev is not None:
                ev.synchronize()
            if self._s.verify:
                crc = crc_of(buf[:k], crc)
            self._s.disk.write(extent, buf[:k], first_page=p)
            held.remove(buf)
            self._s.ring.release(buf)

        try:
            for p in range(0, n, P):
                k = min(P, n - p)
                if pending and self._s.ring.free_count() == 0:
                    drain_one()  # never wait for a buffer this job itself holds
                buf = self._acquire_staging()
                held.append(buf)
                ev = issue_runs(self._s.streams, self._s.dev, buf,
                                coalesce(dev_slots[p : p + k], range(k)), "d2h",
                                after=marker if p == 0 else None, fault_hook=self._s.fault)
                pending.append((buf, p, k, ev))
                if len(pending) > 1:
                    drain_one()
            while pending:
                drain_one()
        finally:
            for _, _, _, ev in pending:  # fence copies still queued before the buffers go back
                if ev is not None:
                    ev.synchronize()
            for buf in held:
                self._s.ring.release(buf)
        return crc if self._s.verify else None

    def _staged_read(self, extent, dev_slots, marker) -> int:
        """Disk pages to the device through the ring, a piece at a time: piece
        i+1 is read while piece i is being copied. Returns the crc of all pages."""
        P, n = self._s.ring.pages, len(dev_slots)
        crc = 0
        pending: list[tuple[torch.Tensor, Any]] = []
        try:
            for p in range(0, n, P):
                k = min(P, n - p)
                if len(pending) > 1 or (pending and self._s.ring.free_count() == 0):
                    # at most two pieces in flight per job, and never wait for
                    # a buffer this job itself holds
                    buf, ev = pending.pop(0)
                    if ev is not None:
                        ev.synchronize()
                    self._s.ring.release(buf)
                buf = self._acquire_staging()
                pending.append((buf, None))
                self._s.read_disk(extent, buf[:k], p)
                crc = crc_of(buf[:k], crc)
                ev = issue_runs(self._s.streams, buf, self._s.dev,
                                coalesce(range(k), dev_slots[p : p + k]), "h2d",
                                after=marker if p == 0 else None, fault_hook=self._s.fault)
                pending[-1] = (buf, ev)
        finally:
            for buf, ev in pending:  # every copy has finished before a slot or buffer is freed
                if ev is not None:
                    ev.synchronize()
                self._s.ring.release(buf)
        return crc
