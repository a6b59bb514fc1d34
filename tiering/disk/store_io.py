"""Chunk I/O of ``DiskPageStore``: ranges of pages to and from their slots.

``ChunkIOPart`` holds the store's methods that check a range, group its slots into jobs
(the slot file's direct path or zarr's pipeline, with the chunk bindings), run them on
zarr's loop under the I/O timeout and turn failures into counted ``DiskIOError`` /
``DiskCorruptionError``. It is a part of that one class, not an object of its own: it
reads and writes the state ``DiskPageStore.__init__`` sets up, and the contract is in
``tiering.disk.store``'s module docstring. Split out so each file stays readable; the
state stays in one owner.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from tiering.disk.ledger import (
    DiskExtent,
    ExtentState,
    check_extent,
)
from tiering.disk.slotio import BOUNCE_BYTES, CopyGate, make_binding
from tiering.errors import DiskCorruptionError, DiskIOError

log = logging.getLogger(__name__)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _leading(pages: object, name: str) -> int:
    """The page count of a batch (its leading dimension); ValueError naming ``name``."""
    shape = getattr(pages, "shape", None)
    if not isinstance(pages, (torch.Tensor, np.ndarray)) or shape is None or len(shape) < 1:
        raise ValueError(
            f"{name} must be a torch.Tensor or numpy.ndarray of pages, got {type(pages).__name__}"
        )
    return int(shape[0])


def _copy_bytes(dest: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src``'s bytes over ``dest``'s (both C-contiguous, the same size) in one
    ``memmove``, with the GIL released."""
    if not (dest.flags.c_contiguous and src.flags.c_contiguous and dest.nbytes == src.nbytes):
        raise ValueError("a copy needs two C-contiguous buffers of the same size")
    ctypes.memmove(dest.ctypes.data, src.ctypes.data, dest.nbytes)


class ReadScratch:
    """Reusable byte buffers that reads land in before their checks pass.

    ``take(n)`` hands out an ``n``-byte view of a kept buffer at least that large (or of
    a new one); ``give`` returns it after a successful read. At most ``keep`` buffers are
    kept (the largest); a read that fails never gives its buffer back, so I/O that is
    still running after a timeout writes into memory nobody else is handed. Thread-safe.
    """

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                best = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
                return best[:nbytes]
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, view: np.ndarray) -> None:
        base = view if view.base is None else view.base
        assert isinstance(base, np.ndarray)
        with self._lock:
            self._free.append(base)
            self._free.sort(key=lambda b: b.nbytes, reverse=True)
            del self._free[self._keep :]

    def kept(self) -> list[int]:
        """The sizes of the kept buffers (for tests and stats)."""
        with self._lock:
            return [b.nbytes for b in self._free]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class ChunkIOPart:
    """``DiskPageStore``'s chunk I/O (see the module docstring)."""

    def _transfer(
        self, kind: str, extent: DiskExtent, arr: torch.Tensor | np.ndarray, first_page: object,
        out_is_scratch: bool = False,
    ) -> None:
        """One synchronous ``write`` (from ``arr``) or ``read`` (into ``arr``) of a range."""
        check_extent(extent)
        reading = kind == "read"
        what = "out" if reading else "pages"
        count = _leading(arr, what)
        positions = self._positions(extent, first_page, count)
        rows = self.format.rows(arr, count, what, writable=reading)
        direct = self._backend.direct
        # A read lands in a scratch buffer and reaches ``out`` only once every chunk of
        # the range has passed its checks: a failed read leaves ``out`` untouched, and a
        # timed-out read's stray I/O can never write into it later. With
        # ``out_is_scratch`` on the direct path, checked pieces are copied into ``out``
        # through a gate that is shut before a failed read returns (see ``read``).
        gate = CopyGate() if reading and out_is_scratch and direct is not None else None
        state = self._ledger.begin(extent, kind, positions)
        scratch = None
        try:
            scratch = self._read_scratch.take(rows.nbytes) if reading and gate is None else None
            target = rows if scratch is None else scratch.view(rows.dtype).reshape(rows.shape)
            batches = self._batches(extent, positions, target)
            if direct is not None and reading:
                jobs = self._direct_read_jobs(state, batches, gate)
            elif direct is not None:
                jobs = self._direct_jobs(direct.write_chunk, state, batches)
            else:
                jobs = (self._read_jobs if reading else self._write_jobs)(state, batches)
        except BaseException:
            self._ledger.finish(extent, state)
            if scratch is not None:  # no I/O ran into it: it can serve the next read
                self._read_scratch.give(scratch)
            raise
        try:
            self._run_io(extent, state, jobs, kind)  # on a failure the scratch is dropped
        except BaseException:
            # I/O may still be running (a timeout): once the gate is shut, none of it
            # reaches ``out``. The wait is for copies under way, never for I/O.
            if gate is not None and not gate.shut(self.config.io_timeout_s):
                log.warning("a copy into out outlived io_timeout_s after a failed read")
            raise
        if scratch is not None:
            _copy_bytes(rows, scratch)
            self._read_scratch.give(scratch)
        with self._stats_lock:
            if reading:
                self._counters.reads += 1
                self._counters.bytes_read += count * self.page_bytes
            else:
                self._counters.writes += 1
                self._counters.bytes_written += count * self.page_bytes

    def _positions(self, extent: DiskExtent, first_page: object, count: int) -> range:
        """The page positions ``[first_page, first_page + count)``; ValueError naming
        what is wrong unless the range is non-empty and inside the extent."""
        if not _is_int(first_page) or first_page < 0:
            raise ValueError(f"first_page must be an int >= 0, got {first_page!r}")
        first = int(first_page)
        end = first + count
        if count < 1 or end > extent.num_pages:
            raise ValueError(
                f"pages [{first}, {end}) are not inside the extent of {extent.num_pages} pages"
            )
        return range(first, end)

    def _binding(self, state: ExtentState, chunk: int) -> bytes:
        return make_binding(self._store_id, chunk, state.generation, state.owner)

    def _batches(
        self, extent: DiskExtent, positions: range, rows: np.ndarray
    ) -> list[list[tuple[int, np.ndarray]]]:
        """(slot, that page's row) pairs, grouped into runs of adjacent slots of at most
        ``pages_per_chunk`` pages: one job moves a run, in slot order."""
        batches: list[list[tuple[int, np.ndarray]]] = []
        previous = -2
        for i, pos in enumerate(positions):
            slot = extent.chunks[pos]
            if slot != previous + 1 or len(batches[-1]) >= self.pages_per_chunk:
                batches.append([])
            batches[-1].append((slot, rows[i : i + 1]))
            previous = slot
        return batches

    def _direct_jobs(
        self, chunk_io: Callable[..., None], state: ExtentState,
        batches: list[list[tuple[int, np.ndarray]]],
    ) -> list[tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]]:
        """One job per batch of adjacent slots on the slot file's direct path:
        ``chunk_io`` (``write_chunk`` or ``read_chunk``) per slot, off the loop."""

        def run(batch: list[tuple[int, np.ndarray]]) -> None:
            for slot, row in batch:
                chunk_io(slot, row, 0, self._binding(state, slot))

        async def one_direct(batch: list[tuple[int, np.ndarray]]) -> None:
            await asyncio.to_thread(run, batch)

        return [(one_direct, (batch,)) for batch in batches]

    def _direct_read_jobs(
        self, state: ExtentState, batches: list[list[tuple[int, np.ndarray]]],
        gate: CopyGate | None = None,
    ) -> list[tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]]:
        """Reads on the slot file's direct path: ``io_threads`` jobs take the range's
        slots one at a time, in order, from one shared cursor, so the device sees one
        sequential stream (jobs on runs far apart would make it seek between them) while
        adjacent slots are checksummed in parallel. Every job stops at the first failure.

        With ``gate``, each job reads through its own bounce buffer of ``BOUNCE_BYTES``
        (see ``SlotFileStore.read_chunk``), taken from the store's pool and given back
        only when the job's last ``preadv`` has returned, so no buffer with I/O still
        running into it is handed to another read."""
        direct = self._backend.direct
        assert direct is not None
        pairs = iter([pair for batch in batches for pair in batch])
        cursor = threading.Lock()
        failed = threading.Event()

        def run() -> None:
            bounce = None if gate is None else self._bounces.take(BOUNCE_BYTES)
            lane = None if gate is None else gate.lane()
            try:
                while not failed.is_set():
                    with cursor:
                        pair = next(pairs, None)
                    if pair is None:
                        return
                    slot, row = pair
                    try:
                        direct.read_chunk(
                            slot, row, 0, self._binding(state, slot), bounce=bounce, lane=lane
                        )
                    except BaseException:
                        failed.set()
                        raise
            finally:
                if bounce is not None:
                    self._bounces.give(bounce)

        async def one_reader() -> None:
            await asyncio.to_thread(run)

        count = sum(len(batch) for batch in batches)
        return [(one_reader, ()) for _ in range(min(self.config.io_threads, count))]

    def _write_jobs(
        self, state: ExtentState, batches: list[list[tuple[int, np.ndarray]]]
    ) -> list[tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]]:
        """One job per slot through zarr's pipeline, then its binding."""
        array = self._require_array()
        backend = self._backend
        slots = backend.slots

        async def one(slot: int, row: np.ndarray) -> None:
            binding = self._binding(state, slot)
            await array.setitem((slice(slot, slot + 1), slice(None)), row)
            if slots is not None:
                await asyncio.to_thread(slots.bind_slot, slot, binding)
            else:
                await backend.write_binding(slot, backend.binding_record(binding, row))

        return [(one, pair) for batch in batches for pair in batch]

    def _read_jobs(
        self, state: ExtentState, batches: list[list[tuple[int, np.ndarray]]]
    ) -> list[tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]]:
        """One job per slot through zarr's pipeline, then its binding's check."""
        prototype = default_buffer_prototype()
        array = self._require_array()
        backend = self._backend
        slots = backend.slots

        async def one(slot: int, dest: np.ndarray) -> None:
            out_buf = prototype.nd_buffer.from_numpy_array(dest)
            selection = (slice(slot, slot + 1), slice(None))
            await array.get_orthogonal_selection(selection, out=out_buf, prototype=prototype)
            binding = self._binding(state, slot)
            if slots is not None:
                await asyncio.to_thread(slots.check_slot_binding, slot, binding)
                return
            record = await backend.read_binding(slot)
            if record is None:
                raise OSError(errno.ENODATA, f"chunk {slot} has no binding record")
            backend.check_binding_record(slot, record, binding, dest)

        return [(one, pair) for batch in batches for pair in batch]

    def _require_array(self) -> zarr.AsyncArray[Any]:
        assert self._backend.array is not None
        return self._backend.array

    def _run_io(
        self,
        extent: DiskExtent,
        state: ExtentState,
        jobs: list[tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]],
        what: str,
    ) -> None:
        """Run per-chunk coroutines on zarr's loop, at most ``io_threads`` at a time,
        wait for every one of them, and turn failures into DiskIOError. The ledger
        hears ``finish`` exactly once, when the last chunk's I/O has ended."""
        started = threading.Event()
        finished = threading.Event()
        once = threading.Lock()
        limit = self.config.io_threads

        def finish_once(ok: bool) -> None:
            with once:
                if finished.is_set():
                    return
                finished.set()
            self._ledger.finish(extent, state, wrote=ok and what == "write")

        async def run_all() -> list[BaseException | None]:
            started.set()
            ok = False
            try:
                sem = asyncio.Semaphore(limit)
                failed = False

                async def guarded(
                    fn: Callable[..., Awaitable[None]], args: tuple[Any, ...]
                ) -> None:
                    nonlocal failed
                    async with sem:
                        if failed:  # fail fast: a job that has not started is skipped
                            return
                        try:
                            await fn(*args)
                        except BaseException:
                            failed = True
                            raise

                results = await asyncio.gather(
                    *(guarded(fn, args) for fn, args in jobs), return_exceptions=True
                )
                ok = not any(isinstance(r, BaseException) for r in results)
                return results
            finally:
                finish_once(ok)

        coro = run_all()
        try:
            results = sync(coro, timeout=self.config.io_timeout_s)
        except TimeoutError as exc:
            if finished.is_set():
                raise self._fault(what, extent, exc) from exc
            self._ledger.mark_timed_out(state)
            with self._stats_lock:
                self._counters.timeouts += 1
            raise self._fault(
                what,
                extent,
                OSError(errno.ETIMEDOUT, f"no answer within {self.config.io_timeout_s} s"),
            ) from exc
        except BaseException:
            if not started.is_set():  # never scheduled: nothing runs, so settle it here
                coro.close()
                finish_once(False)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise self._fault(what, extent, errors[0], count=len(errors)) from errors[0]

    def _fault(
        self, what: str, extent: DiskExtent, exc: BaseException, count: int = 1
    ) -> DiskIOError:
        """Classify one failed operation, count it, and build the error to raise."""
        where = f"{what} of extent {extent.chunks}"
        more = f" (and {count - 1} more chunk errors)" if count > 1 else ""
        if isinstance(exc, OSError):  # store faults, missing chunks, timeouts
            code = exc.errno if exc.errno is not None else errno.EIO
            err: DiskIOError = DiskIOError(code, f"{where} failed: {exc}{more}")
        elif what == "read" and isinstance(exc, (ValueError, RuntimeError)):
            err = DiskCorruptionError(
                errno.EBADMSG, f"{where}: stored chunk is corrupt: {exc}{more}"
            )
        else:
            err = DiskIOError(errno.EIO, f"{where} failed: {exc!r}{more}")
        with self._stats_lock:
            c = self._counters
            if isinstance(err, DiskCorruptionError):
                c.corruptions += 1
            if what == "write":
                c.write_faults += 1
            else:
                c.read_faults += 1
            name = errno.errorcode.get(err.errno or errno.EIO, str(err.errno))
            c.errnos[name] = c.errnos.get(name, 0) + 1
        return err
