"""What the slot-file store is built from, apart from its slot layout: the
positional I/O loops (``_pwrite_all``/``_pread_all``), atomic file replacement,
the read-buffer pool, the binding a direct write stamps on its chunk, and the
zarr ``Store`` async methods as thin wrappers over the synchronous ones.
``tiering.disk.slotfile`` is the public module; it re-exports what callers use."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import struct
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path

import google_crc32c
import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from tiering.disk.crc import ByteSpan, crc32c_bytes
from tiering.errors import ChunkChecksumError

BINDING_BYTES = 36  # what a direct write binds its chunk to (see ``make_binding``)
PIECE_BYTES = 1 << 20  # direct I/O granule: about one core's L2, so crc and copy share it
# The bounce buffer of a read with ``out_is_scratch``: the piece is read into it, checked
# and copied out while it stays in one core's L2 (1 MiB on the machines measured, where
# 256 KiB pieces cost about what a bare pread into the output does, and 1 MiB ones 40% more).
BOUNCE_BYTES = 256 << 10
_IOV_MAX = 512  # buffers one pwritev/preadv is handed (the kernel takes at most IOV_MAX)


class _BufferPool:
    """Up to ``count`` reusable byte buffers of ``size`` bytes.

    ``take`` hands out a numpy array over a pooled buffer through a memoryview,
    so every view derived from it keeps that array alive; when the array is
    collected its buffer returns to the pool. Requests beyond the pool get a
    fresh allocation.
    """

    def __init__(self, size: int, count: int) -> None:
        self._size = size
        self._count = count
        self._free: list[np.ndarray] = []
        self._made = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        block = None
        if nbytes <= self._size:
            with self._lock:
                if self._free:
                    block = self._free.pop()
                elif self._made < self._count:
                    self._made += 1
                    block = np.empty(self._size, dtype=np.uint8)
        if block is None:
            return np.empty(nbytes, dtype=np.uint8)
        arr = np.frombuffer(memoryview(block), dtype=np.uint8, count=nbytes)
        weakref.finalize(arr, self._give_back, block)
        return arr

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            self._free.append(block)


class CopyLane:
    """One reader thread's way into a ``CopyGate``'s buffer (see there)."""

    __slots__ = ("_gate", "_lock")

    def __init__(self, gate: CopyGate) -> None:
        self._gate = gate
        self._lock = threading.Lock()

    def copy(self, dest: int, src: int, nbytes: int) -> None:
        """``memmove(dest, src, nbytes)`` (addresses, GIL released) unless the gate is
        shut: then ``OSError(ECANCELED)`` and nothing is copied."""
        with self._lock:
            if self._gate.is_shut:
                raise OSError(errno.ECANCELED, "the read was abandoned; its bytes are dropped")
            ctypes.memmove(dest, src, nbytes)

    def read_cached(self, fd: int, parts: list, offset: int) -> int:
        """``preadv(fd, parts, offset, RWF_NOWAIT)`` unless the gate is shut: the bytes
        the page cache holds, copied straight into ``parts``; the call never waits for the
        device, so like a copy it cannot outlive the shut. Returns the bytes moved (0 when
        none were cached); ``OSError(ECANCELED)`` once shut, other ``OSError`` as raised
        (EOPNOTSUPP where the file does not take the flag)."""
        with self._lock:
            if self._gate.is_shut:
                raise OSError(errno.ECANCELED, "the read was abandoned; its bytes are dropped")
            try:
                return os.preadv(fd, parts, offset, os.RWF_NOWAIT)
            except BlockingIOError:
                return 0


class CopyGate:
    """Lets reader threads copy checked pieces into a caller's buffer until it is shut.

    Each thread copies through its own ``lane()``, so copies run in parallel. Once
    ``shut(timeout)`` returns True no lane writes into the buffer again: it closes the
    gate, then waits for each lane's copy under way. A copy never waits on I/O, so that
    wait is one memory copy of a piece at most.
    """

    __slots__ = ("_lanes", "_lock", "is_shut")

    def __init__(self) -> None:
        self._lanes: list[CopyLane] = []
        self._lock = threading.Lock()
        self.is_shut = False

    def lane(self) -> CopyLane:
        """A new lane (one per thread); a lane of a shut gate refuses every copy."""
        lane = CopyLane(self)
        with self._lock:
            self._lanes.append(lane)
        return lane

    def shut(self, timeout: float) -> bool:
        """Close the gate; True once no copy is under way (False: one outlived ``timeout``)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            self.is_shut = True
            lanes = list(self._lanes)
        for lane in lanes:
            if not lane._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            lane._lock.release()
        return True


class SyncBackedStoreMethods:
    """zarr's async ``Store`` methods, each run as the store's synchronous
    counterpart on a worker thread (``get_sync``, ``set_sync``, ``delete_sync``,
    ``clear_sync``, ``_all_keys``); ``exists`` is the store's own."""

    async def get(
        self,
        key: str,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        return await asyncio.to_thread(
            self.get_sync, key, prototype=prototype, byte_range=byte_range
        )

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return [await self.get(key, prototype, rng) for key, rng in key_ranges]

    async def set(self, key: str, value: Buffer) -> None:
        await asyncio.to_thread(self.set_sync, key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not await self.exists(key):
            await self.set(key, value)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self.delete_sync, key)

    async def clear(self) -> None:
        await asyncio.to_thread(self.clear_sync)

    async def list(self) -> AsyncIterator[str]:
        for key in await asyncio.to_thread(self._all_keys):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in await asyncio.to_thread(self._all_keys):
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        base = prefix.rstrip("/")
        base = f"{base}/" if base else ""
        seen: set[str] = set()
        for key in await asyncio.to_thread(self._all_keys):
            if key.startswith(base):
                head = key[len(base) :].split("/", 1)[0]
                if head not in seen:
                    seen.add(head)
                    yield head


def _verify_block(index: int, block: bytes, chunk_crc: bytes, binding: bytes) -> None:
    vouch = crc32c_bytes(google_crc32c.value(block[:BINDING_BYTES] + chunk_crc))
    if block[:BINDING_BYTES] != binding or block[BINDING_BYTES:] != vouch:
        found = describe_binding(block[:BINDING_BYTES])
        raise ChunkChecksumError(
            f"slot {index}: the chunk is bound to {found}, not to "
            f"{describe_binding(binding)} (misplaced, stale or foreign)"
        )


def make_binding(store_id: bytes, slot: int, generation: int, owner: str) -> bytes:
    """The ``BINDING_BYTES`` a chunk is bound to: store identity, slot, generation, owner."""
    if len(store_id) != 16:
        raise ValueError(f"store_id must be 16 bytes, got {len(store_id)}")
    owner_hash = google_crc32c.value(owner.encode("utf-8", "surrogatepass"))
    return struct.pack("<16sQQI", store_id, slot, generation, owner_hash)


def describe_binding(binding: bytes) -> str:
    store_id, slot, generation, owner_hash = struct.unpack("<16sQQI", binding)
    return f"store {store_id.hex()} slot {slot} generation {generation} owner#{owner_hash:08x}"


def _resolve_range(byte_range: ByteRequest | None, size: int) -> tuple[int, int]:
    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        return min(byte_range.start, size), min(byte_range.end, size)
    if isinstance(byte_range, OffsetByteRequest):
        return min(byte_range.offset, size), size
    if isinstance(byte_range, SuffixByteRequest):
        return max(0, size - byte_range.suffix), size
    raise TypeError(f"unexpected byte_range {byte_range!r}")


def _byte_view(buf: np.ndarray, name: str, *, writable: bool) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (no copy); ValueError naming ``name``."""
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous numpy array")
    if writable and not buf.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return buf.reshape(-1).view(np.uint8)


def _pieces(
    payload: ByteSpan, pad: int, pad_source: np.ndarray, *, advance: bool = False
) -> Iterator[tuple[ByteSpan, int, int]]:
    """(span, start, stop) ranges of at most PIECE_BYTES: all of ``payload``, then
    ``pad`` bytes of ``pad_source``, taken as consecutive ranges when ``advance``
    (a scratch buffer of ``pad`` bytes) or as its leading range again and again
    (a block of zeros)."""
    for start in range(0, payload.nbytes, PIECE_BYTES):
        yield payload, start, min(payload.nbytes, start + PIECE_BYTES)
    if not pad:
        return
    source = ByteSpan(pad_source)
    step = PIECE_BYTES if advance else min(PIECE_BYTES, source.nbytes)
    done = 0
    while done < pad:
        size = min(step, pad - done)
        yield (source, done, done + size) if advance else (source, 0, size)
        done += size


def _positional_all(io: Callable[[int, list, int], int], fd: int, parts: list, offset: int,
                    short: Callable[[list], str]) -> int:
    """``io`` (``os.pwritev`` or ``os.preadv``) until every byte of ``parts`` has
    moved; returns the offset after the last byte. A call that moves nothing is
    an I/O error, ``short(views left)`` its message."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if len(v)]
    while views:
        moved = io(fd, views[:_IOV_MAX], offset)
        if moved <= 0:
            raise OSError(errno.EIO, short(views))
        offset += moved
        while views and moved >= len(views[0]):
            moved -= len(views[0])
            views.pop(0)
        if views and moved:
            views[0] = views[0][moved:]
    return offset


def _pwrite_all(fd: int, parts: list, offset: int) -> int:
    """pwritev until every byte is down; returns the offset after the last byte.

    A zero-byte write is an I/O error."""
    return _positional_all(os.pwritev, fd, parts, offset, lambda _views: "pwritev wrote nothing")


def _pread_all(fd: int, parts: list, offset: int, nbytes: int | None = None) -> int:
    """preadv until every buffer in ``parts`` is full; returns the offset after them.

    ``nbytes`` (their total size, when the caller knows it) allows one bare ``preadv``
    first; a short one is simply redone in full (positional reads are idempotent).
    A short file is an I/O error."""
    if nbytes is not None and len(parts) <= _IOV_MAX and os.preadv(fd, parts, offset) == nbytes:
        return offset + nbytes
    return _positional_all(
        os.preadv, fd, parts, offset,
        lambda views: f"slot file ended {sum(len(v) for v in views)} bytes early",
    )


def _atomic_replace(path: Path, data: memoryview) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old or the new file, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _pwrite_all(fd, [data], 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
