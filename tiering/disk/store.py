"""The disk tier's page store: KV pages in one zarr array, under a hard byte cap.

Layout. Pages live as rows of a single zarr v3 array of shape
``[capacity_pages, page_elems]``, chunked by single rows ``[1, page_elems]``:
every page has its own chunk, its slot. A page's bytes are stored
reinterpreted as an unsigned integer of the dtype's width (``uint16`` for
bf16/fp16, ``uint8`` for odd widths), so dtypes numpy lacks round-trip bit for
bit. Every chunk carries zarr's crc32c codec (after the optional zstd or
bitshuffled blosc compressor), so a damaged chunk is refused at read. Chunks
are written with ``write_empty_chunks`` on: a page of zeros is stored like any
other. The array's attributes carry the store identity (``tiering_store_id``).

Allocation (packing). The unit is one page. ``reserve`` hands an owner
``num_pages`` slots, preferring one adjacent run (best fit), else the longest
free runs, so requests of any size from one page up fill the tier completely
(no per-request rounding) and two owners never share a chunk: a write of one
owner never reads, rewrites or tears another owner's bytes.
``capacity_pages = capacity_bytes // page_bytes``; the ledger counts reserved
pages times ``page_bytes`` (``chunk_alloc_bytes`` is that unit) and never
exceeds ``capacity_bytes``. A reservation that would exceed it returns None and
is counted as a refusal. Large requests keep large sequential I/O: their
slots are adjacent, and one job moves a run of up to ``pages_per_chunk``
adjacent slots (``chunk_bytes`` of pages) in slot order on the direct path.

Chunk binding. A crc32c over a chunk's own bytes cannot tell an intact chunk in
the wrong place from the right one. So every chunk is also bound to the store
identity (16 random bytes made at a clear, kept by a reattach), its slot, its
reservation's generation (unique within the store: a counter, persisted in
the manifest, and a new epoch of 2**32 at every reattach so a generation the
last run handed out unrecorded is never reused) and its owner (a crc32c of the
owner id). Where the binding lives: on the slot file (``DiskConfig.path``, any
codec, direct path or zarr) a 40-byte block just before the slot header holds
the binding and crc32c(binding + the chunk's stored crc32c), so the block
vouches for exactly those chunk bytes; on any other store a small record per
chunk (``tiering-bind/<slot>``) holds the binding, the crc32c of the chunk's
page bytes, and a crc32c of both. ``read`` checks the binding of every chunk
against the live reservation; a chunk of another slot, an older generation, or
another store (swapped slots, a misdirected or lost write, a slot file copied
from elsewhere) raises ``DiskCorruptionError``. A ``DiskExtent`` carries its
generation, so a stale handle kept after a release is refused (ValueError).

Locking. A local directory is held exclusively by ``fcntl.flock`` on
``<dir>/.tiering.lock`` (see ``tiering.disk.lock``), taken before anything
in the directory is touched: a second store on the same directory, in this
process or another, fails with ``DiskPathInUseError`` naming the path and the
holder's pid and host; the kernel drops the lock when the holder dies. Other
stores take a ``DiskConfig.lease`` (``PathLease``: ``acquire``/``release``), the
seam for an object-store lease. The lock or lease is released at ``close()``
(unless I/O is still in flight: the file then stays open and held) and when
the constructor fails; a failed constructor also removes what it created.
A clear refuses a location that holds anything the tier did not write, and a
bucket root named by URL.

I/O. ``write`` and ``read`` are synchronous and safe to call from several
threads on distinct extents; ``first_page`` selects any page range of the
extent, so a caller can pipeline through a ring of staging buffers. Each call
is one round trip to zarr's event loop that issues its jobs (at most
``io_threads`` in flight) and waits for all of them, so when a call returns,
successfully or not, no I/O for that extent is still running. After the first
failing job the jobs not yet started are skipped. An extent may be read only
over pages that hold a completed write, and committed only once every page
has been written.

A failure surfaces as ``DiskIOError`` (with the errno when known), a checksum
or binding mismatch or undecodable chunk as ``DiskCorruptionError``, a chunk
that vanished from the store as ``DiskIOError(ENODATA)``. A failed write
leaves the pages of its range reserved but unwritten (they cannot be read,
nor the extent committed, until rewritten); the caller decides whether to
release it. An operation that outlives ``io_timeout_s`` raises
``DiskIOError(ETIMEDOUT)``; its slots stay out of circulation (still counted)
until the stray I/O has finished, even if the extent is released meanwhile.

Direct path. For the default local store with codec ``none`` and no
``wrap_store``, a chunk does not go through zarr's codec pipeline: the slot
store writes the caller's page bytes where they lie and reads straight into
``out`` (``SlotFileStore.write_chunk``/``read_chunk``), computing or checking
the crc32c over the same memory with the GIL released. The chunk bytes on disk
are exactly what the pipeline (bytes codec, then crc32c) would store, so plain
zarr reads the array through ``SlotFileStore`` (it does not see the binding
blocks, so it cannot check them), and this path reads chunks zarr wrote.
Everything else (compressed codecs, other stores, and any wrapped store, so
that fault injection sees every chunk operation) goes through zarr, one zarr
call per page. ``direct_io`` tells which path is in use. On the direct path
``pages`` must not change while ``write`` runs.

Stores. ``DiskConfig.path`` names a local directory (also as ``file://``), kept
as one preallocated slot file by ``SlotFileStore``; any other URL opens a zarr
``FsspecStore``; ``DiskConfig.store`` takes any zarr store (or ``StorePath``)
instead. ``wrap_store`` wraps the store before use (the fault-injection seam,
see ``tiering.disk.faults``, which also fails manifest writes on demand).

Modules. This one holds the public API and the I/O; ``config`` the config;
``ledger`` the allocation state (one owner); ``lock`` the exclusive hold;
``pages`` the byte view of a page; ``array`` the zarr array and codecs;
``backend`` the store and start-up; ``slotfile`` the slot-file store and its
direct chunk I/O; ``crc`` the GIL-free crc32c; ``manifest`` the manifest
format; ``faults`` fault injection.

Start-up. With ``on_start="clear"`` (the default) everything an earlier process
left in the store is removed first and a new store identity is made: stale
bytes are never served, and commits are kept in memory only. With
``on_start="reattach"`` every ``commit``, ``uncommit``, ``release`` of a
committed extent and ``forget`` rewrites a manifest (``tiering.disk.manifest``;
atomically replaced, and for the slot file after an fsync of the data). At
start, if the manifest parses, its checksum matches, it was written by the
store identity the array carries, its fingerprint and layout equal ours, the
array metadata matches and every listed chunk is present, its entries are
adopted (reserved in the ledger, returned by ``reattached()``), every other
chunk is deleted and the manifest is rewritten with the new generation epoch.
If anything is off the whole store is cleared and the reason logged. Since
``commit`` is only accepted for a completely written extent, a crash in the
middle of a write leaves nothing committed, and the next start clears it.

Manifest off the step path. On an ``s3://`` path (a network store) the
manifest rewrites that ``commit``, ``uncommit``, ``release``, ``forget`` and
``retry_manifest`` ask for are not done by the caller: they set a flag (a
queue bounded at one pending write, since a write always lists the ledger's
current entries, so requests coalesce) and a flusher thread writes the
manifest, retrying a failed write with a growing pause (at most 5 s).
``commit`` then returns as soon as the entry is in the ledger: the entry
survives a restart once the next write lands (``manifest_pending`` in
``stats()``; ``wait_manifest(timeout)`` waits for it), and a crash before
that restarts as if the commit had not happened. Chunks stay quarantined
until a manifest that no longer lists them is written, exactly as for a
synchronous write. ``close`` does the last write (bounded) before letting
go of the prefix. The start-up write stays synchronous.

Manifest faults. A manifest write that fails (ENOSPC, EROFS, EIO, ...) is an
I/O fault like any other. ``commit`` raises ``DiskIOError`` and records
nothing. ``release``, ``uncommit`` and ``forget`` never raise for it: they
log it, count it (``manifest_faults``, ``manifest_dirty`` in ``stats()``), keep
every slot the manifest on disk may still list quarantined (counted, not
reusable), and the next manifest write (or ``retry_manifest()``) retries.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import field
from typing import Any

import google_crc32c
import numpy as np
import torch
import zarr
from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from tiering.core.counters import counter_record
from tiering.disk.array import CODECS
from tiering.disk.backend import ArrayGeometry, PageBackend, StartRefused
from tiering.disk.config import DiskConfig
from tiering.disk.crc import crc32c_bytes, crc32c_extend
from tiering.disk.ledger import (
    ChunkLedger,
    DiskExtent,
    DiskIntegrityError,
    ExtentState,
    check_extent,
    check_owner,
)
from tiering.disk.lock import DiskPathInUseError
from tiering.disk.manifest import Manifest, ManifestEntry, decode_manifest, encode_manifest
from tiering.disk.pages import PageFormat
from tiering.disk.slotfile import ChunkChecksumError, describe_binding, make_binding
from tiering.errors import DiskCorruptionError, DiskIOError

__all__ = [
    "CODECS",
    "DiskConfig",
    "DiskCorruptionError",
    "DiskExtent",
    "DiskIOError",
    "DiskIntegrityError",
    "DiskPageStore",
]

log = logging.getLogger(__name__)
GENERATION_EPOCH_BITS = 32  # each reattached run hands out generations from a new epoch


def _random_store_id() -> bytes:
    return os.urandom(16)


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


def _binding_record(binding: bytes, data_crc: int) -> bytes:
    """The zarr path's binding record: the binding, the crc32c of the chunk's page bytes,
    and a crc32c of both."""
    body = binding + crc32c_bytes(data_crc)
    return body + crc32c_bytes(google_crc32c.value(body))


def _check_binding_record(chunk: int, record: bytes, expected: bytes, dest: np.ndarray) -> None:
    n = len(expected)
    body, vouch = record[: n + 4], record[n + 4 :]
    if len(record) != n + 8 or crc32c_bytes(google_crc32c.value(body)) != vouch:
        raise ChunkChecksumError(f"chunk {chunk}: its binding record is damaged")
    if body[:n] != expected:
        raise ChunkChecksumError(
            f"chunk {chunk}: the chunk is bound to {describe_binding(body[:n])}, "
            f"not to {describe_binding(expected)} (misplaced, stale or foreign)"
        )
    if body[n:] != crc32c_bytes(crc32c_extend(0, dest)):
        raise ChunkChecksumError(
            f"chunk {chunk}: its pages are not the ones its binding record vouches for"
        )


_Counters = counter_record(
    "_Counters",
    "writes reads bytes_written bytes_read write_faults read_faults corruptions timeouts"
    " manifest_faults",
    doc="What the store did and what failed; ``errnos`` counts faults by errno name.",
    module=__name__,
    extra=[("errnos", dict[str, int], field(default_factory=dict))],
)


class DiskPageStore:
    """Fixed-size KV pages on disk, in whole-chunk extents, under a hard byte cap.

    ``page_shape`` is one page's shape; ``dtype`` its element type (torch or
    numpy). ``fingerprint`` describes the caller's geometry; a reattach refuses
    data written under another. ``wrap_store`` (optional) wraps the underlying
    zarr store, e.g. ``lambda s: FaultyStore(s, plan)``. See the module docstring
    for the full contract.
    """

    def __init__(
        self,
        config: DiskConfig,
        page_shape: tuple[int, ...],
        dtype: torch.dtype | np.dtype | str,
        *,
        fingerprint: str = "",
        wrap_store: Callable[[Store], Store] | None = None,
        new_store_id: Callable[[], bytes] | None = None,
    ) -> None:
        if not isinstance(config, DiskConfig):
            raise ValueError(f"config must be a DiskConfig, got {type(config).__name__}")
        if not isinstance(fingerprint, str):
            raise ValueError(f"fingerprint must be a str, got {type(fingerprint).__name__}")
        self.config = config
        self.fingerprint = fingerprint
        self._new_store_id = new_store_id if new_store_id is not None else _random_store_id
        self._store_id = b""
        self.format = PageFormat.of(page_shape, dtype)
        self.page_shape = self.format.page_shape
        self.dtype = dtype
        self.page_bytes = self.format.page_bytes
        # Allocation is per page: every page has its own slot (a zarr chunk of one
        # row), so requests of any size pack the tier and never share a chunk.
        # ``pages_per_chunk`` is the I/O batch: adjacent slots one job moves in order.
        self.pages_per_chunk = max(1, config.chunk_bytes // self.page_bytes)
        self.chunk_alloc_bytes = self.page_bytes  # the allocation unit: one page
        self.capacity_pages = config.capacity_bytes // self.page_bytes
        self.capacity_chunks = self.capacity_pages  # one slot per page
        if self.capacity_pages < 1:
            raise ValueError(
                f"DiskConfig.capacity_bytes {config.capacity_bytes} is smaller than one page "
                f"({self.page_bytes} bytes)"
            )
        self.capacity_bytes = config.capacity_bytes

        self._ledger = ChunkLedger(self.capacity_pages, 1)
        self._counters = _Counters()
        self._stats_lock = threading.Lock()
        self._manifest_lock = threading.Lock()
        self._reattached: dict[str, tuple[DiskExtent, dict[str, Any]]] = {}
        self._manifest_dirty = False  # a manifest write failed; the next one retries it
        # the background flusher of a network store's manifest (see the module docstring)
        self._flush_cv = threading.Condition(threading.Lock())
        self._flush_wanted: str | None = None  # why the next write is wanted (None: not)
        self._flush_data = False
        self._flush_busy = False
        self._flush_stop = False
        self._flusher: threading.Thread | None = None

        self._geometry = ArrayGeometry(
            rows=self.capacity_pages,
            row_elems=self.format.row_elems,
            pages_per_chunk=1,
            dtype=self.format.storage_dtype,
            codec=config.codec,
        )
        try:
            self._backend = PageBackend(
                config,
                num_slots=self.capacity_pages,
                chunk_bytes=self.page_bytes,
                wrap_store=wrap_store,
            )
        except DiskPathInUseError:
            raise
        except OSError as exc:
            where = repr(config.path) if config.store is None else repr(config.store)
            raise DiskIOError(
                exc.errno or errno.EIO, f"disk store {where}: cannot start: {exc}"
            ) from exc
        try:
            self._start()
        except BaseException:
            self._backend.discard()
            raise

    # ------------------------------------------------------------------ sizing and ledger

    def chunk_offset(self, chunk: int) -> int | None:
        """Byte offset of chunk ``chunk``'s payload in the slot file, or None when
        chunk I/O goes through zarr's pipeline (for tools that inspect the file)."""
        direct = self._backend.direct
        return None if direct is None else direct.payload_offset(chunk)

    def used_bytes(self) -> int:
        """Bytes the ledger holds: reserved (and quarantined) chunks times the chunk size."""
        return self._ledger.used_chunks() * self.chunk_alloc_bytes

    def bytes_for(self, num_pages: int) -> int:
        """What reserving ``num_pages`` would add to the ledger (whole chunks)."""
        return self._ledger.chunks_for(num_pages) * self.chunk_alloc_bytes

    def can_reserve(self, num_pages: int) -> bool:
        """Whether ``reserve(owner, num_pages)`` would succeed now."""
        return self._ledger.can_reserve(num_pages)

    def reserve(self, owner: str, num_pages: int) -> DiskExtent | None:
        """Reserve whole chunks for ``num_pages`` pages; None (counted) when the cap forbids it."""
        return self._ledger.reserve(owner, num_pages)

    def release(self, extent: DiskExtent) -> None:
        """Return an extent's chunks to the free pool, forgetting its committed entry.

        Raises ValueError for an extent that is not live or has an operation in
        flight (nothing changes). Chunks stay reserved (quarantined, still
        counted) while a timed-out operation's I/O is still running, and while
        the manifest on disk may still list them. The manifest is rewritten
        here; if that write fails (ENOSPC, EROFS, EIO, ...) this does NOT raise:
        the failure is logged and counted (``manifest_faults``), the chunks stay
        quarantined, and the rewrite is retried by the next manifest write
        (any ``commit``, ``release``, ``uncommit``, ``forget`` or
        ``retry_manifest``). The ledger is consistent either way.
        """
        if self._ledger.release(extent, persistent=self._persistent) or self._manifest_dirty:
            self._persist_quietly(f"releasing extent {extent.chunks}")

    def uncommit(self, extent: DiskExtent) -> None:
        """Forget the committed entry of ``extent``, keeping its reservation; idempotent.

        After this the extent's owner id can be committed again with another
        extent at once (a request id reused while its old copy is still being
        read). ValueError for an extent that is not reserved here. In
        ``reattach`` mode the manifest is rewritten; a failure of that write is
        logged and retried later, never raised (the extent's chunks then count
        as listed on disk, so they are quarantined when released).
        """
        if self._ledger.uncommit(extent) or self._manifest_dirty:
            self._persist_quietly(f"uncommitting extent {extent.chunks}")

    def retry_manifest(self) -> bool:
        """Rewrite the manifest if an earlier write failed; True when it is now current.

        A successful write frees chunks that were quarantined only because the
        old manifest still listed them."""
        if not self._persistent or not self._manifest_dirty:
            return True
        return self._persist_quietly("retrying an earlier failed write")

    # ------------------------------------------------------------------ I/O

    def write(
        self, extent: DiskExtent, pages: torch.Tensor | np.ndarray, *, first_page: int = 0
    ) -> None:
        """Store ``pages`` ([k, *page_shape]) as pages ``[first_page, first_page + k)`` of
        the extent.

        A range starts on a chunk boundary (``first_page`` a multiple of
        ``pages_per_chunk``) and ends on one or at the extent's end, so every
        chunk is written whole, by one call (a staging ring of buffers of
        ``m * pages_per_chunk`` pages fits). The extent may be read or committed
        only once every one of its pages has been written. Synchronous.
        ``pages`` must not be modified until it returns (on the direct path it
        is written from where it lies). Raises ValueError for bad input
        (nothing changes) and DiskIOError on an I/O fault (the chunks of the
        range are then unwritten; the extent stays reserved).
        """
        check_extent(extent)
        count = _leading(pages, "pages")
        positions = self._positions(extent, first_page, count)
        rows = self.format.rows(pages, count, "pages", writable=False)
        state = self._ledger.begin(extent, "write", positions)
        try:
            jobs = self._write_jobs(extent, state, positions, rows)
        except BaseException:
            self._ledger.finish(extent, state)
            raise
        self._run_io(extent, state, jobs, "write")
        with self._stats_lock:
            self._counters.writes += 1
            self._counters.bytes_written += count * self.page_bytes

    def read(
        self, extent: DiskExtent, out: torch.Tensor | np.ndarray, *, first_page: int = 0
    ) -> None:
        """Fill ``out`` ([k, *page_shape], CPU, contiguous) with pages
        ``[first_page, first_page + k)`` of the extent (the same range rule as ``write``).

        Every chunk read must be a completely written chunk of this reservation:
        its checksum and its binding (store, slot, owner, generation) are
        checked, so a damaged, misplaced, stale or foreign chunk raises
        DiskCorruptionError and is never handed back as good. Raises ValueError
        for bad input or a range not completely written; DiskIOError /
        DiskCorruptionError on a fault, in which case the contents of ``out``
        are unspecified and must not be used (on the direct path the bytes land
        in ``out`` before their checks).
        """
        check_extent(extent)
        count = _leading(out, "out")
        positions = self._positions(extent, first_page, count)
        rows = self.format.rows(out, count, "out", writable=True)
        state = self._ledger.begin(extent, "read", positions)
        try:
            jobs = self._read_jobs(extent, state, positions, rows)
        except BaseException:
            self._ledger.finish(extent, state)
            raise
        self._run_io(extent, state, jobs, "read")
        with self._stats_lock:
            self._counters.reads += 1
            self._counters.bytes_read += count * self.page_bytes

    @property
    def direct_io(self) -> bool:
        """Whether chunk I/O bypasses zarr's codec pipeline (see the module docstring)."""
        return self._backend.direct is not None

    @property
    def store_id(self) -> str:
        """This store's identity (hex): made at a clear, kept by a reattach."""
        return self._store_id.hex()

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

    def _write_jobs(
        self, extent: DiskExtent, state: ExtentState, positions: range, rows: np.ndarray
    ) -> list[tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]]:
        direct = self._backend.direct
        batches = self._batches(extent, positions, rows)
        if direct is not None:
            return self._direct_jobs(direct.write_chunk, state, batches)
        array = self._require_array()
        backend = self._backend
        slots = backend.slots

        async def one(slot: int, row: np.ndarray) -> None:
            binding = self._binding(state, slot)
            await array.setitem((slice(slot, slot + 1), slice(None)), row)
            if slots is not None:
                await asyncio.to_thread(slots.bind_slot, slot, binding)
            else:
                await backend.write_binding(slot, _binding_record(binding, crc32c_extend(0, row)))

        return [(one, pair) for batch in batches for pair in batch]

    def _read_jobs(
        self, extent: DiskExtent, state: ExtentState, positions: range, rows: np.ndarray
    ) -> list[tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]]:
        direct = self._backend.direct
        batches = self._batches(extent, positions, rows)
        if direct is not None:
            return self._direct_jobs(direct.read_chunk, state, batches)
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
            _check_binding_record(slot, record, binding, dest)

        return [(one, pair) for batch in batches for pair in batch]

    # ------------------------------------------------------------------ manifest

    def commit(self, owner: str, extent: DiskExtent, meta: Mapping[str, Any] | None = None) -> None:
        """Record that ``owner``'s completely written extent should survive a restart.

        ``meta`` must be JSON-serialisable (it comes back from ``reattached()``
        as JSON types). In ``reattach`` mode the manifest is rewritten (after the
        data is flushed); DiskIOError if that fails, and nothing is committed.
        """
        check_owner(owner)
        try:
            # A JSON round trip both checks and copies: the caller may mutate its dict later.
            meta_dict = json.loads(json.dumps(dict(meta or {}), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"commit of {owner!r}: meta is not JSON-serialisable: {exc}") from exc
        previous = self._ledger.commit(owner, extent, meta_dict)
        if self._flusher is not None:  # a network store: written by the flusher, not here
            self._want_manifest(f"committing {owner!r}", flush_data=True)
            return
        if self._persistent:
            try:
                self._persist_manifest(f"committing {owner!r}", flush_data=True)
            except DiskIOError:
                self._ledger.undo_commit(owner, extent, meta_dict, previous)
                raise

    def forget(self, owner: str) -> bool:
        """Drop ``owner``'s committed entry (its chunks stay reserved); False if it had none.

        A failed manifest write is logged and retried later (as for ``release``)."""
        if not self._ledger.forget(owner):
            return False
        if self._persistent:
            self._persist_quietly(f"forgetting {owner!r}")
        return True

    def reattached(self) -> dict[str, tuple[DiskExtent, dict[str, Any]]]:
        """Entries adopted at start-up (owner -> (extent, meta)); empty after a clear."""
        return {owner: (ext, dict(meta)) for owner, (ext, meta) in self._reattached.items()}

    # ------------------------------------------------------------------ checks, stats, life cycle

    def check_integrity(self) -> None:
        """Raise DiskIntegrityError unless every chunk is free, held by exactly one live
        extent, or quarantined; the ledger equals the reserved chunks times the chunk
        size and stays under the cap; every committed entry names a live, written
        extent of the same owner."""
        self._ledger.check()
        ledger = self.used_bytes()
        if ledger > self.capacity_bytes:
            raise DiskIntegrityError(f"ledger {ledger} bytes exceeds the cap {self.capacity_bytes}")

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy, as a fresh dict."""
        counts = self._ledger.counts()
        with self._stats_lock:
            c = self._counters
            return {
                "writes": c.writes,
                "reads": c.reads,
                "bytes_written": c.bytes_written,
                "bytes_read": c.bytes_read,
                "refusals": counts["refusals"],
                "write_faults": c.write_faults,
                "read_faults": c.read_faults,
                "corruptions": c.corruptions,
                "timeouts": c.timeouts,
                "manifest_faults": c.manifest_faults,
                "manifest_dirty": self._manifest_dirty,
                "manifest_pending": self._flush_wanted is not None or self._flush_busy,
                "manifest_async": self._flusher is not None,
                "faults": c.write_faults + c.read_faults + c.manifest_faults,
                "fault_errnos": dict(c.errnos),
                "extents": counts["extents"],
                "committed": counts["committed"],
                "quarantined_chunks": counts["quarantined_chunks"],
                "in_flight": counts["in_flight"],
                "used_bytes": counts["used_chunks"] * self.chunk_alloc_bytes,
                "capacity_bytes": self.capacity_bytes,
            }

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no read or write (timed-out ones included) is still running.

        Returns False if some still are after ``timeout`` seconds.
        """
        return self._ledger.wait_idle(timeout)

    def close(self) -> None:
        """Stop accepting work; wait (bounded) for in-flight I/O; close a store we opened."""
        if not self._ledger.close():
            return
        self._stop_flusher(2 * self.config.io_timeout_s)
        if not self.wait_idle(self.config.io_timeout_s):
            log.warning("disk store closed with I/O still in flight; its file stays open")
            return
        self._backend.close()

    def __enter__(self) -> DiskPageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals: I/O

    @property
    def _persistent(self) -> bool:
        return self.config.on_start == "reattach"

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

    # ------------------------------------------------------------------ internals: start-up

    def _layout(self) -> dict[str, Any]:
        return {
            "page_shape": list(self.page_shape),
            "dtype": self.format.dtype_name,
            "page_bytes": self.page_bytes,
            "storage_dtype": str(self.format.storage_dtype),
            "pages_per_slot": 1,
            "capacity_pages": self.capacity_pages,
            "codec": self.config.codec,
            # where chunk bindings live: a block in the slot (direct path) or a record
            "binding": "slot-block" if self._backend.slots is not None else "record",
        }

    def _decode(self, raw: bytes, store_id: str) -> Manifest:
        return decode_manifest(
            raw,
            fingerprint=self.fingerprint,
            layout=self._layout(),
            capacity_chunks=self.capacity_pages,
            pages_per_chunk=1,
            store_id=store_id,
        )

    def _start(self) -> None:
        where = self._backend.where
        if self.config.on_start == "reattach":
            try:
                store_id, manifest = self._backend.reattach(self._geometry, self._decode)
                self._store_id = bytes.fromhex(store_id)
                if len(self._store_id) != 16:
                    raise StartRefused(f"store identity {store_id!r} is not 16 bytes")
            except (StartRefused, ValueError) as exc:
                level = (
                    logging.INFO
                    if isinstance(exc, StartRefused) and exc.nothing_there
                    else logging.WARNING
                )
                log.log(level, "disk store %s: not reattaching, clearing it: %s", where, exc)
            else:
                # A new epoch of generations: the last run may have handed out ones its
                # manifest never recorded, and none of them may come back.
                self._ledger.start_generations_at(
                    ((manifest.next_generation >> GENERATION_EPOCH_BITS) + 1)
                    << GENERATION_EPOCH_BITS
                )
                for owner, entry in manifest.entries.items():
                    extent = DiskExtent(tuple(entry.chunks), entry.num_pages, entry.generation)
                    self._ledger.adopt(owner, extent, dict(entry.meta))
                    self._reattached[owner] = (extent, dict(entry.meta))
                self._persist_manifest("recording the new generation epoch at start-up")
                log.info("disk store %s: reattached %d entries", where, len(manifest.entries))
                self._start_flusher()
                return
        new_id = self._new_store_id()
        if not isinstance(new_id, bytes) or len(new_id) != 16:
            raise ValueError(f"new_store_id must return 16 bytes, got {new_id!r}")
        self._store_id = new_id
        try:
            self._backend.clear_and_create(self._geometry, new_id.hex())
        except OSError as exc:
            raise DiskIOError(
                exc.errno or errno.EIO, f"disk store {where}: cannot start: {exc}"
            ) from exc
        if self._persistent:
            self._start_flusher()

    # ------------------------------------------------------------------ the manifest flusher

    FLUSH_RETRY_S = (0.05, 5.0)  # the pause after a failed background write: first, at most

    def _start_flusher(self) -> None:
        """On a network store (an ``s3://`` path), manifest writes leave the caller's thread."""
        if self._backend.hold is None:
            return
        self._flusher = threading.Thread(target=self._flush_loop, name="tiering-manifest", daemon=True)
        self._flusher.start()

    def _want_manifest(self, why: str, *, flush_data: bool = False) -> None:
        with self._flush_cv:
            self._flush_wanted = why if self._flush_wanted is None else self._flush_wanted
            self._flush_data = self._flush_data or flush_data
            self._flush_cv.notify_all()

    def _flush_loop(self) -> None:
        pause = self.FLUSH_RETRY_S[0]
        cv = self._flush_cv
        while True:
            with cv:
                cv.wait_for(lambda: self._flush_wanted is not None or self._flush_stop, timeout=1.0)
                if self._flush_wanted is None:
                    if self._flush_stop:
                        return
                    continue
                why, flush = self._flush_wanted, self._flush_data
                self._flush_wanted, self._flush_data, self._flush_busy = None, False, True
            ok = False
            try:
                self._persist_manifest(why, flush_data=flush)
                ok = True
            except DiskIOError as exc:
                log.warning("disk store %s: %s; will retry", self._backend.where, exc)
            except Exception:  # a bug: keep the flusher alive, retry later
                log.exception("disk store %s: manifest write (%s) failed", self._backend.where, why)
            with cv:
                self._flush_busy = False
                if not ok:
                    self._flush_wanted = self._flush_wanted or why
                    self._flush_data = self._flush_data or flush
                cv.notify_all()
                if ok:
                    pause = self.FLUSH_RETRY_S[0]
                    continue
                if self._flush_stop:
                    return  # closing: the last try failed; the manifest stays dirty
                cv.wait_for(lambda: self._flush_stop, timeout=pause)
                pause = min(self.FLUSH_RETRY_S[1], pause * 2)

    def wait_manifest(self, timeout: float) -> bool:
        """Wait (bounded) until no manifest write is pending or running; True when the
        manifest on the store is current (always True where writes are synchronous)."""
        if self._flusher is None:
            return not self._manifest_dirty
        with self._flush_cv:
            self._flush_cv.wait_for(lambda: self._flush_wanted is None and not self._flush_busy,
                                    timeout=max(0.0, timeout))
            return self._flush_wanted is None and not self._flush_busy and not self._manifest_dirty

    def _stop_flusher(self, timeout: float) -> None:
        """The last write of the manifest (bounded), then the flusher ends."""
        t = self._flusher
        if t is None:
            return
        with self._flush_cv:
            self._flush_stop = True
            self._flush_cv.notify_all()
        t.join(timeout)
        if t.is_alive():
            log.warning("disk store %s: the manifest flusher did not finish within %.1fs",
                        self._backend.where, timeout)

    def _persist_quietly(self, why: str) -> bool:
        """``_persist_manifest`` for paths that must not raise: log and retry later. On a
        network store the write is handed to the flusher (True: asked for, not yet written)."""
        if not self._persistent:
            return True
        if self._flusher is not None:
            self._want_manifest(why)
            return True
        try:
            self._persist_manifest(why)
        except DiskIOError as exc:
            log.warning("disk store %s: %s; will retry", self._backend.where, exc)
            return False
        return True

    def _persist_manifest(self, why: str, *, flush_data: bool = False) -> None:
        """Write the manifest from the committed entries; the ledger then frees released
        chunks that were waiting for the old manifest to stop listing them. On failure
        the manifest is marked dirty (every later manifest write retries it) and the
        entries it tried to list count as possibly on disk."""
        with self._manifest_lock:
            committed = self._ledger.committed()
            entries = {
                owner: ManifestEntry(ext.chunks, ext.num_pages, meta, ext.generation)
                for owner, (ext, meta) in committed.items()
            }
            body = encode_manifest(
                self.fingerprint,
                self._layout(),
                entries,
                store_id=self.store_id,
                next_generation=self._ledger.next_generation,
            )
            try:
                self._backend.write_manifest(body, flush_data=flush_data)
            except OSError as exc:
                self._manifest_dirty = True
                self._ledger.manifest_failed(committed)
                with self._stats_lock:
                    self._counters.manifest_faults += 1
                code = exc.errno or errno.EIO
                name = errno.errorcode.get(code, str(code))
                with self._stats_lock:
                    self._counters.errnos[name] = self._counters.errnos.get(name, 0) + 1
                raise DiskIOError(code, f"manifest write ({why}) failed: {exc}") from exc
            self._manifest_dirty = False
            self._ledger.manifest_written(committed)
