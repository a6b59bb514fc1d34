"""Stores straight to disk: the blocks of a store batch that find no host slot are
written by the workers into a staging file, then copied into their disk extents by the
manager's I/O threads (``StoreStaging``)."""

from __future__ import annotations

import errno
import os
from concurrent.futures import Future

import torch

from tiering.core.executor import OFFLOAD
from tiering.disk.ledger import DiskExtent
from tiering.integrations.vllm._ctx import Ctx, finished
from tiering.integrations.vllm._disk import DiskTier
from tiering.integrations.vllm._host import HostTier
from tiering.integrations.vllm._publish import Publisher
from tiering.integrations.vllm._state import log, unlink_staging
from tiering.types import Tier

__all__ = ["StoreStaging"]

Item = tuple[bytes, DiskExtent, bytes | None]  # key, its extent, its parent


class StoreStaging:
    """Blocks going straight to disk, from ``prepare_store`` until their disk write is
    reaped: ``staged`` (key -> (extent, parent, staging file, row)) and ``jobs`` (staging
    file -> (its disk job, its items, abandoned by a reset)). ``root``: the staging
    directory (files ``<root>/store-<pid>-<n>.r<rank>``)."""

    def __init__(self, ctx: Ctx, host: HostTier, disk: DiskTier, publisher: Publisher,
                 root: str | None) -> None:
        self._ctx, self._host, self._disk, self._publisher = ctx, host, disk, publisher
        self.root = root
        self._seq = 0
        self.staged: dict[bytes, tuple[DiskExtent, bytes | None, str, int]] = {}
        self.jobs: dict[str, tuple[Future, list[Item], bool]] = {}

    def stage(self, blocks: list[tuple[bytes, bytes | None, DiskExtent]]) -> tuple[str, list[int]]:
        """A staging file for ``blocks`` (key, parent, extent): its name and the spec's
        slot numbers (``num_slots + row``)."""
        assert self.root is not None
        self._seq += 1
        staging = os.path.join(self.root, f"store-{os.getpid()}-{self._seq}")
        slots = []
        for j, (k, p, ext) in enumerate(blocks):
            self.staged[k] = (ext, p, staging, j)
            slots.append(self._host.num_slots + j)
        return staging, slots

    def files(self, keys: list[bytes]) -> list[str]:
        """The staging files of those of ``keys`` that are staged, sorted."""
        return sorted({self.staged[k][2] for k in keys if k in self.staged})

    def finish(self, staging: str, success: bool) -> None:
        """The workers have written (``success``) or failed the blocks of ``staging``:
        copy them into the disk tier on an I/O thread, or let their extents go."""
        items = [(k, v[0], v[1], v[3]) for k, v in self.staged.items() if v[2] == staging]
        if staging in self.jobs or not items:
            return
        ctx = self._ctx
        if not success:
            for k, ext, _, _ in items:
                del self.staged[k]
                self._disk.release(ext)
            ctx.counters.stores_failed += len(items)
            ctx.counters.stores_staged_failed += len(items)
            unlink_staging(staging, len(self._host.slabs))
            ctx.dirty = True
            return
        fut = ctx.io.submit(OFFLOAD, self._stage_in, staging,
                            [(k, e, r) for k, e, _, r in items])
        self.jobs[staging] = (fut, [(k, e, p) for k, e, p, _ in items], False)

    def _stage_in(self, staging: str, items: list[tuple[bytes, DiskExtent, int]]) -> list:
        """Copy staging rows into their disk extents, then publish them (I/O thread);
        per item (None or the exception, what ``Publisher.publish`` said). The staging
        files are removed whatever happens."""
        disk = self._disk.disk
        assert disk is not None
        slabs = self._host.slabs
        fds: list[int] = []
        try:
            try:
                for r in range(len(slabs)):
                    fds.append(os.open(f"{staging}.r{r}", os.O_RDONLY))
            except OSError as exc:
                return [(exc, None)] * len(items)
            buf = torch.empty((1, self._host.page_bytes), dtype=torch.uint8)
            arr = buf.numpy()
            out: list = []
            for key, ext, row in items:
                try:
                    off = 0
                    for fd, slab in zip(fds, slabs, strict=True):
                        n = os.preadv(fd, [memoryview(arr[0, off : off + slab.slot_bytes])],
                                      row * slab.slot_bytes)
                        if n != slab.slot_bytes:
                            raise OSError(errno.EIO, f"staging row {row}: {n} of "
                                          f"{slab.slot_bytes} bytes")
                        off += slab.slot_bytes
                    disk.write(ext, buf)
                except Exception as exc:  # handed back per block; the others go on
                    out.append((exc, None))
                    continue
                out.append((None, self._publisher.publish(key, buf)))
            return out
        finally:
            for fd in fds:
                os.close(fd)
            unlink_staging(staging, len(slabs))

    def reap(self, now: float) -> None:
        ctx = self._ctx
        for _, (fut, items, abandoned) in finished(self.jobs, lambda j: j[0]):
            ctx.dirty = True
            exc = fut.exception()
            results = fut.result() if exc is None else [(exc, None)] * len(items)
            landed = []
            for (k, ext, parent), (err, published) in zip(items, results, strict=True):
                if not abandoned:
                    del self.staged[k]
                if abandoned or err is not None:
                    if err is not None:
                        log.warning("tiering: block %s did not reach the disk tier: %s",
                                    k.hex(), err)
                        ctx.counters.stores_failed += 1
                        ctx.counters.stores_staged_failed += 1
                    self._disk.release(ext)
                    continue
                ctx.insert(k, parent, Tier.DISK, ext, now)
                ctx.counters.stores_completed += 1
                self._publisher.count(published)
                landed.append(k)
            if landed:
                ctx.event(landed, "disk", False)

    def reset(self) -> None:
        """A reset: jobs running finish and release their extents; blocks not handed
        to a job yet release theirs now (a late ``complete_store`` finds nothing)."""
        for staging, (fut, items, _) in list(self.jobs.items()):
            self.jobs[staging] = (fut, items, True)  # its extents go when it ends
            for k, _, _ in items:
                self.staged.pop(k, None)
        for ext, _, _, _ in self.staged.values():  # not written yet: a late
            self._disk.release(ext)  # complete_store finds nothing to do
        self.staged.clear()

    def problems(self, index_or_storing: set[bytes], extents: dict) -> list[str]:
        """What is inconsistent; adds the extents held here to ``extents``."""
        out = []
        for k, (ext, _, staging, _) in self.staged.items():
            if k in index_or_storing:
                out.append(f"{k.hex()}: going straight to disk and held elsewhere too")
            if ext in extents:
                out.append(f"{k.hex()}: extent {ext} held twice")
            extents[ext] = k
            job = self.jobs.get(staging)
            if job is not None and (job[2] or k not in {i[0] for i in job[1]}):
                out.append(f"{k.hex()}: staged, but its job does not list it")
        for staging, (_, items, abandoned) in self.jobs.items():
            for k, ext, _ in items:
                if abandoned:
                    extents[ext] = ("abandoned", k)
                elif self.staged.get(k, (None,))[0] != ext:
                    out.append(f"{k.hex()}: a job of {staging} for a block not staged")
        return out
