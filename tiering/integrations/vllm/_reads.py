"""Reads from the disk tier that serve loads (``DiskReads``): a disk block is promoted
into a host slot when one can be freed, else read (checked) into a row of the load
staging file and loaded from there."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future

import torch

from tiering.core.executor import RELOAD
from tiering.core.pools import PagePool
from tiering.disk import DiskCorruptionError
from tiering.disk.ledger import DiskExtent
from tiering.integrations.vllm._ctx import Ctx, finished
from tiering.integrations.vllm._disk import DiskTier
from tiering.integrations.vllm._host import HostTier
from tiering.integrations.vllm._state import MAX_LOAD_ROWS, PROMOTED_HOLD_STEPS, log
from tiering.types import Tier

__all__ = ["DiskReads"]


def _job(entry: tuple) -> Future:
    return entry[0]


def _reason(exc: BaseException) -> str:
    return "corrupt" if isinstance(exc, DiskCorruptionError) else "read_failed"


class DiskReads:
    """Promotions (``promoting``: key -> its read into the host slot the index's move
    names) and the load staging rows (with a staging directory ``root``): ``rows`` (a
    ``PagePool`` of rows, one per block), ``row_jobs`` (key -> (its read, row)),
    ``row_of`` (key -> the row holding its checked bytes) and ``row_at`` (key -> the
    step its row became ready, while not loaded yet). The files are
    ``f"{load_staging}.r{rank}"``, created at the first read.

    ``make_room(need, evicted, protect)`` frees host slots (the cascade's);
    ``drop(key, reason)`` drops a block with its descendants."""

    def __init__(self, ctx: Ctx, host: HostTier, disk: DiskTier, root: str | None,
                 make_room: Callable[[int, list[bytes], set[bytes]], bool],
                 drop: Callable[..., bool]) -> None:
        self._ctx, self._host, self._disk = ctx, host, disk
        self._make_room, self._drop = make_room, drop
        self.promoting: dict[bytes, Future] = {}
        self.load_staging: str | None = None
        self.rows: PagePool | None = None
        if root is not None:
            assert disk.disk is not None
            self.load_staging = os.path.join(root, f"load-{os.getpid()}")
            self.rows = PagePool("load rows",
                                 max(1, min(disk.disk.capacity_pages, MAX_LOAD_ROWS)),
                                 host.page_bytes)
        self._row_fds: list[int] = []
        self.row_jobs: dict[bytes, tuple[Future, int]] = {}
        self.row_of: dict[bytes, int] = {}
        self.row_at: dict[bytes, int] = {}

    def busy(self) -> bool:
        return bool(self.promoting or self.row_jobs)

    def futures(self) -> list[Future]:
        return [*self.promoting.values(), *(j[0] for j in self.row_jobs.values())]

    # -- promotions ----------------------------------------------------------------------

    def start_promotion(self, key: bytes) -> bool:
        ctx = self._ctx
        evicted: list[bytes] = []
        if not self._make_room(1, evicted, {key}):
            return False
        loc = ctx.index.location(key)
        if loc is None or loc.tier is not Tier.DISK or loc.moving_to is not None:
            return False
        slots = self._host.pool.allocate(key, 1)
        assert slots is not None
        ctx.index.begin_move(key, Tier.HOST, slots[0])
        ctx.counters.promotions_started += 1
        ctx.dirty = True
        assert self._disk.disk is not None
        self.promoting[key] = ctx.io.submit(RELOAD, self._host.read_into, self._disk.disk,
                                            loc.handle, slots[0])
        return True

    def reap_promotions(self, now: float) -> None:
        ctx, host = self._ctx, self._host
        for key, fut in finished(self.promoting):
            ctx.dirty = True
            exc = fut.exception()
            if exc is None:
                old = ctx.index.finish_move(key)  # now on HOST; its disk copy stays
                ctx.rules.moved(key, Tier.DISK, Tier.HOST, now)
                self._disk.promoted(key, old.handle)
                host.promoted(key)
                ctx.event((key,), "host", False)
                ctx.counters.promotions_ok += 1
            else:
                log.warning("tiering: block %s failed promotion (%s): dropped, will be recomputed",
                            key.hex(), exc)
                ctx.counters.promotions_failed += 1
                dest = ctx.index.fail_move(key)
                host.pool.release(key, [dest.handle])
                self._drop(key, _reason(exc))

    # -- load staging rows ---------------------------------------------------------------

    def start_row_read(self, key: bytes, ext: DiskExtent) -> bool:
        if self.rows is None:
            return False
        if not self._row_fds:  # created at the first use; each worker removes its file's name
            for r in range(len(self._host.slabs)):  # once it has opened it (TieredMover)
                self._row_fds.append(os.open(f"{self.load_staging}.r{r}",
                                             os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))
        got = self.rows.allocate(key, 1)
        if got is None:
            return False
        ctx = self._ctx
        ctx.index.acquire(key)  # not evicted from disk while it is read
        ctx.counters.direct_reads_started += 1
        self.row_jobs[key] = (ctx.io.submit(RELOAD, self._read_to_row, ext, got[0]), got[0])
        ctx.dirty = True
        return True

    def _read_to_row(self, ext: DiskExtent, row: int) -> None:
        """I/O thread: read a block from disk (checked) into ``row`` of every rank's file."""
        assert self._disk.disk is not None
        buf = torch.empty((1, self._host.page_bytes), dtype=torch.uint8)
        self._disk.disk.read(ext, buf)  # checked before any byte reaches the file
        data = buf.numpy()
        off = 0
        for fd, slab in zip(self._row_fds, self._host.slabs, strict=True):
            view = memoryview(data[0, off : off + slab.slot_bytes])
            done = 0
            while done < slab.slot_bytes:
                done += os.pwrite(fd, view[done:], row * slab.slot_bytes + done)
            off += slab.slot_bytes

    def reap_rows(self) -> None:
        ctx = self._ctx
        for key, (fut, row) in finished(self.row_jobs, _job):
            ctx.index.release(key)
            ctx.dirty = True
            exc = fut.exception()
            if exc is None and key not in ctx.lost:
                self.row_of[key] = row
                self.row_at[key] = ctx.step
                continue
            assert self.rows is not None
            self.rows.release(key, [row])
            if exc is not None:
                log.warning("tiering: block %s failed its read from disk (%s): dropped, will be "
                            "recomputed", key.hex(), exc)
                ctx.counters.direct_reads_failed += 1
                self._drop(key, _reason(exc))

    def take_row(self, key: bytes) -> int:
        """A load takes ``key`` from its row: the spec's slot number (``num_slots + row``)."""
        self.row_at.pop(key, None)
        return self._host.num_slots + self.row_of[key]

    def drop_row(self, key: bytes) -> None:
        row = self.row_of.pop(key, None)
        self.row_at.pop(key, None)
        if row is not None:
            assert self.rows is not None
            self.rows.release(key, [row])

    def expire(self, pins: Mapping[bytes, int]) -> None:
        """Free the rows not loaded within ``PROMOTED_HOLD_STEPS`` steps (``pins``: the
        load pins per key; a pinned row is kept)."""
        for key, at in list(self.row_at.items()):
            if self._ctx.step - at >= PROMOTED_HOLD_STEPS and not pins.get(key):
                self._ctx.counters.promotions_unused += 1
                self.drop_row(key)

    def close(self) -> None:
        for fd in self._row_fds:
            os.close(fd)
        self._row_fds = []

    def problems(self) -> list[str]:
        """What is inconsistent in the rows' tables (each against the index and the pool)."""
        if self.rows is None:
            return []
        out = []
        rows = {k: [r] for k, r in self.row_of.items()}
        for k, (_, r) in self.row_jobs.items():
            if k in rows:
                out.append(f"{k.hex()}: a staging row ready and being read")
            rows[k] = [r]
        stray = [k for k in rows if k not in self._ctx.index]
        if stray:
            out.append(f"staging rows of blocks not in the index: {stray[0].hex()}")
        if not set(self.row_at) <= set(self.row_of):
            out.append("a staging row hold without its row")
        try:
            self.rows.check_integrity(rows)
        except AssertionError as exc:
            out.append(f"load staging rows: {exc}")
        return out
