"""The disk tier's page store: KV pages in one zarr array, under a hard byte cap.

Modules. ``DiskPageStore`` is one class written in five modules, because its parts
share one owner's state (the ledger, the backend, the counters, the manifest lock)
and the rules below span them: this module (set-up, the public reserve / write /
read / commit / release API, close), ``store_io`` (``ChunkIOPart``: chunk jobs,
bindings, timeouts, faults), ``store_manifest`` (``ManifestPart``: manifest writes
and the flusher), ``store_start`` (``StartPart``: reattach or clear at start) and
``store_stats`` (``StatsPart``: counters, ``stats``, ``check_integrity``). Every
name stays importable from here.

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
slots are adjacent; on the direct path one write job moves a run of up to
``pages_per_chunk`` adjacent slots (``chunk_bytes`` of pages) in slot order, and
a read's ``io_threads`` jobs take its slots in order from one shared cursor, so
the device sees one sequential stream.

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
store writes the caller's page bytes where they lie and reads into a reused
scratch buffer that is copied into ``out`` once every chunk passed its checks
(``SlotFileStore.write_chunk``/``read_chunk``; a failed read leaves ``out``
untouched), computing or checking the crc32c over the same memory with the GIL released.
``read(..., out_is_scratch=True)`` skips that copy: each piece is taken from the page
cache straight into ``out`` (``preadv`` with ``RWF_NOWAIT``, which never waits for the
device), and what was not cached lands in a small bounce buffer per I/O thread and is
copied into ``out``; both go through a gate that a failed read shuts before it returns
(``out`` then holds unspecified bytes, and stray I/O after a timeout ends in the bounce
buffer, which stays out of the pool until its ``preadv`` has returned). The chunk bytes on disk
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

import errno
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from zarr.abc.store import Store

from tiering.core.validate import check_budget
from tiering.disk.array import CODECS  # noqa: F401 (re-exported)
from tiering.disk.backend import ArrayGeometry, PageBackend
from tiering.disk.config import DiskConfig, check_capacity_pages
from tiering.disk.ledger import (
    ChunkLedger,
    DiskExtent,
    DiskIntegrityError,  # noqa: F401 (re-exported)
    check_owner,
)
from tiering.disk.lock import DiskPathInUseError
from tiering.disk.pages import PageFormat
from tiering.disk.store_io import ChunkIOPart, ReadScratch
from tiering.disk.store_manifest import ManifestPart
from tiering.disk.store_start import StartPart, _random_store_id
from tiering.disk.store_stats import StatsPart, _Counters
from tiering.errors import (
    DiskCorruptionError,  # noqa: F401 (re-exported)
    DiskIOError,
)

# The module's own name; CODECS, DiskConfig, DiskExtent and the errors stay importable
# from here (older imports), and ``tiering.disk`` lists the package's public names.
__all__ = ["DiskPageStore"]

log = logging.getLogger(__name__)


class DiskPageStore(ChunkIOPart, ManifestPart, StartPart, StatsPart):
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
        for name, fn in (("wrap_store", wrap_store), ("new_store_id", new_store_id)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be callable or None, got {type(fn).__name__}")
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
        self.capacity_pages = check_capacity_pages(config.capacity_bytes, self.page_bytes)
        self.capacity_chunks = self.capacity_pages  # one slot per page
        if self.capacity_pages < 1:
            raise ValueError(
                f"DiskConfig.capacity_bytes {config.capacity_bytes} is smaller than one page "
                f"({self.page_bytes} bytes)"
            )
        self.capacity_bytes = config.capacity_bytes

        self._ledger = ChunkLedger(self.capacity_pages, 1)
        self._counters = _Counters()
        # where reads land before their checks pass (see ``read``); one kept per I/O thread
        self._read_scratch = ReadScratch(keep=config.io_threads)
        # the bounce buffers of reads with ``out_is_scratch`` (one piece each, per thread)
        self._bounces = ReadScratch(keep=config.io_threads)
        self._backend_closed = False  # the file and the lock or lease have been let go
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
        old manifest still listed them. ValueError after ``close`` (which makes the
        last retry itself)."""
        if self._ledger.closed:  # the path may no longer be held: write nothing there
            raise ValueError("disk store is closed")
        if not self._persistent or not self._manifest_dirty:
            return True
        return self._persist_quietly("retrying an earlier failed write")

    # ------------------------------------------------------------------ I/O

    def write(
        self, extent: DiskExtent, pages: torch.Tensor | np.ndarray, *, first_page: int = 0
    ) -> None:
        """Store ``pages`` ([k, *page_shape]) as pages ``[first_page, first_page + k)`` of
        the extent.

        Any non-empty range inside the extent is allowed (every page is its own
        chunk, so a range never splits one; a staging ring of buffers of any size
        fits). ValueError naming the range when it is empty or runs past the
        extent's end. The extent may be read or committed
        only once every one of its pages has been written. Synchronous.
        ``pages`` must not be modified until it returns (on the direct path it
        is written from where it lies). Raises ValueError for bad input
        (nothing changes) and DiskIOError on an I/O fault (the chunks of the
        range are then unwritten; the extent stays reserved).
        """
        self._transfer("write", extent, pages, first_page)

    def read(
        self, extent: DiskExtent, out: torch.Tensor | np.ndarray, *, first_page: int = 0,
        out_is_scratch: bool = False,
    ) -> None:
        """Fill ``out`` ([k, *page_shape], CPU, contiguous) with pages
        ``[first_page, first_page + k)`` of the extent (the same range rule as ``write``).

        Every chunk read must be a completely written chunk of this reservation:
        its checksum and its binding (store, slot, owner, generation) are
        checked, so a damaged, misplaced, stale or foreign chunk raises
        DiskCorruptionError and is never handed back as good. Raises ValueError
        for bad input or a range not completely written; DiskIOError /
        DiskCorruptionError on a fault. A read that fails, for any reason
        (bad input, a fault, a corrupt or misplaced chunk, a timeout), leaves
        ``out`` exactly as it was: the pages land in a reused scratch buffer and
        are copied into ``out`` only once every chunk of the range has passed
        its checks (one copy of the range on the good path), so even I/O still
        running after a timeout never writes into ``out``.

        ``out_is_scratch=True``: the caller treats ``out`` as its own staging and
        discards it when the read fails, so the store skips that copy. On the
        direct path what the page cache holds is read straight into ``out`` and
        the rest through a small buffer of the store's, every piece checked; a
        read that fails after its I/O started leaves
        ``out`` holding unspecified bytes (bad input still changes nothing). When
        it returns, successfully or not, nothing writes into ``out`` any more, even
        I/O still running after a timeout (for an ``out`` mapped from a file, whose
        page faults may wait on that file's device, the wait for a copy under way
        gives up after ``io_timeout_s`` with a warning). On other paths the read is
        staged as without the flag.
        """
        if not isinstance(out_is_scratch, bool):
            raise ValueError(f"out_is_scratch must be a bool, got {out_is_scratch!r}")
        self._transfer("read", extent, out, first_page, out_is_scratch)

    @property
    def direct_io(self) -> bool:
        """Whether chunk I/O bypasses zarr's codec pipeline (see the module docstring)."""
        return self._backend.direct is not None

    @property
    def store_id(self) -> str:
        """This store's identity (hex): made at a clear, kept by a reattach."""
        return self._store_id.hex()

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

    # ------------------------------------------------------------------ life cycle (stats, checks: StatsPart)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no read or write (timed-out ones included) is still running.

        Returns False if some still are after ``timeout`` seconds.
        """
        return self._ledger.wait_idle(check_budget("wait_idle timeout", timeout))

    def close(self) -> None:
        """Stop accepting work; wait (bounded) for in-flight I/O; close a store we opened.

        If I/O is still running after ``io_timeout_s`` (an operation that timed out),
        the file and the lock or lease are kept and a warning is logged; call ``close``
        again once ``wait_idle`` says the I/O has ended to let them go. In ``reattach``
        mode a manifest write that failed earlier is retried (once, quietly) before the
        location is let go; nothing is written there after that. Idempotent."""
        if not self._stop_work("closed"):
            return
        if self._persistent and self._manifest_dirty and self._flusher is None:
            # the last chance while the path is still held: a manifest that still lists
            # released extents would bring them back at the next start
            self._persist_quietly("retrying an earlier failed write before closing")
        self._backend_closed = True
        self._backend.close()

    def discard(self) -> None:
        """``close`` for a store whose owner failed to start around it (nothing of its own
        was written here): also removes what this store's start created, as a failed
        constructor does (the directory if it made it, else the files it added), so a
        preallocated slot file is not left behind. Idempotent, and a no-op after ``close``."""
        if not self._stop_work("discarded"):
            return
        self._backend_closed = True
        self._backend.discard()

    def _stop_work(self, what: str) -> bool:
        """Stop accepting work (the first time) and wait, bounded, for in-flight I/O; True
        when the backend may be let go (``what``: closed or discarded, for the warning)."""
        if self._ledger.close():
            self._read_scratch.clear()
            self._bounces.clear()
            self._stop_flusher(2 * self.config.io_timeout_s)
        elif self._backend_closed:
            return False
        if not self.wait_idle(self.config.io_timeout_s):
            log.warning(f"disk store {what} with I/O still in flight; its file stays open "
                        "until close() is called again after the I/O has ended")
            return False
        return True

    def __enter__(self) -> DiskPageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    @property
    def _persistent(self) -> bool:
        return self.config.on_start == "reattach"
