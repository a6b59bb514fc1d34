"""A zarr store that keeps every chunk in a fixed slot of one preallocated file.

Size: the module is over 500 lines and ``SlotFileStore`` about 450 on purpose.
The class is the one owner of the slot layout (offsets, slot headers, the
binding block), which both the zarr ``Store`` API and the direct chunk path
read and write; split in two, each half would need the other's layout rules.
What does not depend on the layout (I/O loops, buffer pool, binding format,
async wrappers) is in ``tiering.disk.slotio``.

Zarr's stock local store writes each chunk as a new file (temporary file, then
rename) and reads it back by opening that file: fine for data sets, but for a
cache that rewrites the same few thousand chunks all day the file churn costs
more than the bytes. This store keeps zarr's array model and codec pipeline
(the crc32c codec still guards every chunk) and changes only where the encoded
bytes go:

- ``<root>/chunks.slots`` is created once at its full size (``posix_fallocate``
  where the filesystem allows, so a full disk shows up at start-up rather than
  mid-write) and holds ``num_slots`` slots of ``stride`` bytes each.
- The chunk key ``c/<i>/0`` (the only chunk-key shape of a one-chunk-wide 2-D
  array) maps to slot ``i``. A slot starts with a prefix whose last 56 bytes
  are a 40-byte binding block (see ``write_chunk``) and a 16-byte header
  (magic, encoded length); the encoded chunk follows and is written together
  with its header in one ``pwritev``. The prefix is 4 KiB (page-aligned
  payloads) for slots of 256 KiB or more, else 64 bytes (the disk tier keeps
  one slot per KV page, so small pages must not pay 4 KiB each). A slot whose
  header lacks the magic is empty: ``get`` returns None.
- Every other key (``zarr.json``, a manifest) is a small file under ``root``,
  replaced atomically (temporary file, fsync, ``os.replace``).

Chunk reads land in a small pool of reusable buffers (``read_buffers`` of them):
a buffer goes back to the pool only when the last array viewing it has been
dropped, so reuse never overwrites bytes that zarr's pipeline still holds, and
warm reads skip the page faults of a fresh 32 MiB allocation each time.

All chunk I/O is positional (``os.preadv``/``os.pwritev`` on one descriptor), so
concurrent requests on distinct slots need no lock. A header that was damaged
on disk yields either "empty" (a missing chunk) or a wrong length, which the
crc32c codec then reports as a checksum mismatch: a damaged slot is never read
back as good data.

Direct chunk I/O. Besides the zarr ``Store`` API, ``write_chunk`` and
``read_chunk`` move one chunk of the uncompressed layout (zarr's bytes codec
followed by its crc32c codec: the raw bytes, then their crc32c as 4
little-endian bytes) straight between the caller's buffer and the slot, with
no intermediate copy. The bytes on disk are exactly those zarr's pipeline
writes and reads, so either side can read what the other wrote. A write
checksums the payload, then sends the binding block, header, payload and
crc32c in one ``pwritev``. A read moves the payload in pieces of
``PIECE_BYTES``, each checksummed just after it lands, while it is still in
the CPU cache. The checksum is what separates this path from a bare
``pwrite``/``pread``; it runs on the fastest crc32c installed, with the GIL
released (``tiering.disk.crc``), so threads working on distinct slots
checksum in parallel when there are cores for them. A read of an empty slot
raises ``OSError(ENODATA)``; one whose length or checksum is wrong raises
``ChunkChecksumError``; either way the caller's buffer may hold unverified
bytes and must not be used.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import struct
import threading
from pathlib import Path

import google_crc32c
import numpy as np
from zarr.abc.store import (
    ByteRequest,
    Store,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from tiering.disk.crc import ByteSpan, crc32c_bytes
from tiering.disk.slotio import (
    BINDING_BYTES,
    BOUNCE_BYTES,
    PIECE_BYTES,
    CopyLane,
    SyncBackedStoreMethods,
    _atomic_replace,
    _BufferPool,
    _byte_view,
    _pieces,
    _pread_all,
    _pwrite_all,
    _resolve_range,
    _verify_block,
    describe_binding,
    make_binding,
)
from tiering.errors import ChunkChecksumError

__all__ = [
    "BINDING_BYTES",
    "BOUNCE_BYTES",
    "PIECE_BYTES",
    "SLOT_FILE_NAME",
    "ChunkChecksumError",
    "SlotFileStore",
    "describe_binding",
    "make_binding",
    "slot_chunk_key",
]

SLOT_FILE_NAME = "chunks.slots"
_ALIGN = 4096
_SLOT_PREFIX = 64  # binding block (40 bytes) and header (16) before each payload
_BIG_SLOT = 256 << 10  # slots at least this large get a 4 KiB prefix instead
_FILE_MAGIC = b"TIERSLT1"
_FILE_HEADER = struct.Struct("<8sQQQ")  # magic, num_slots, stride, slot_capacity
_SLOT_MAGIC = b"TSLOTv1\x00"
_SLOT_HEADER = struct.Struct("<8sQ")  # magic, encoded length
_EMPTY_HEADER = bytes(_SLOT_HEADER.size)
_BINDING_BLOCK = BINDING_BYTES + 4  # ... followed by crc32c(binding + the chunk's crc32c)
_CRC_BYTES = 4
_LOCK_NAME = ".tiering.lock"  # tiering.disk.lock.LOCK_FILE_NAME (the holder's lock file)
_OWN_NAMES = (SLOT_FILE_NAME, "zarr.json", "tiering-manifest.json", "tiering-bind", _LOCK_NAME)


def _align_up(n: int, align: int = _ALIGN) -> int:
    return -(-n // align) * align


def slot_chunk_key(index: int) -> str:
    """The zarr chunk key that lands in slot ``index``."""
    return f"c/{index}/0"


class SlotFileStore(SyncBackedStoreMethods, Store):
    """Zarr store over one preallocated slot file plus small metadata files.

    ``slot_capacity`` is the largest encoded chunk a slot must hold (raw chunk
    bytes plus codec overhead); a larger value passed to ``set`` is refused
    with ``OSError(EFBIG)``. An existing slot file whose geometry matches is
    reused as it is (``matched_existing`` tells; ``found_existing`` says whether
    there was a slot file at all); otherwise it is recreated empty when the
    store opens. ``read_buffers`` sizes the read-buffer pool
    (0 disables it).
    """

    supports_writes: bool = True
    supports_deletes: bool = True
    supports_listing: bool = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        num_slots: int,
        slot_capacity: int,
        read_buffers: int = 0,
        read_only: bool = False,
    ) -> None:
        super().__init__(read_only=read_only)
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if slot_capacity < 1:
            raise ValueError(f"slot_capacity must be >= 1, got {slot_capacity}")
        self.root = Path(root)
        self.num_slots = int(num_slots)
        self.slot_capacity = int(slot_capacity)
        # Large slots keep page-aligned payloads (a 4 KiB prefix costs them < 2%);
        # small ones a 64-byte prefix, so one slot per small KV page stays cheap.
        self.prefix = _ALIGN if self.slot_capacity >= _BIG_SLOT else _SLOT_PREFIX
        self.stride = _align_up(self.prefix + self.slot_capacity, self.prefix)
        self.file_bytes = _ALIGN + self.num_slots * self.stride
        self.read_buffers = int(read_buffers)
        self.found_existing = False
        self.matched_existing = False
        self._fd: int | None = None
        self._open_lock = threading.Lock()
        self._pool = _BufferPool(self.slot_capacity, self.read_buffers)
        self._zeros = np.zeros(PIECE_BYTES, dtype=np.uint8)  # the padding source of writes
        self._zeros.flags.writeable = False
        # whether reads through a lane may ask the page cache first (RWF_NOWAIT); turned
        # off for good when the file or the kernel refuses the flag
        self._nowait = hasattr(os, "RWF_NOWAIT")

    # ------------------------------------------------------------------ life cycle

    @property
    def slot_path(self) -> Path:
        return self.root / SLOT_FILE_NAME

    def open_sync(self) -> None:
        """Create the directory and open (or create) the slot file; idempotent."""
        with self._open_lock:
            if self._fd is None:
                self._open_locked()

    def _open_locked(self) -> None:
        if not self.read_only:
            self.root.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDONLY if self.read_only else os.O_RDWR | os.O_CREAT
        fd = os.open(self.slot_path, flags, 0o600)
        try:
            self.found_existing = os.fstat(fd).st_size > 0
            self.matched_existing = self._header_matches(fd)
            if self.found_existing and os.pread(fd, len(_FILE_MAGIC), 0) != _FILE_MAGIC:
                raise OSError(
                    errno.EEXIST,
                    "refusing to overwrite a file the disk tier did not write",
                    str(self.slot_path),
                )
            if not self.matched_existing:
                if self.read_only:
                    raise FileNotFoundError(f"{self.slot_path} is not a matching slot file")
                self._initialise(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._is_open = True

    async def _open(self) -> None:
        if self._is_open:
            raise ValueError("store is already open")
        self.open_sync()

    async def _ensure_open(self) -> None:
        self.open_sync()

    def close(self) -> None:
        """Close the slot file. Only call this when no I/O on the store is running:
        a descriptor number closed under a running ``pwritev`` could be reused."""
        with self._open_lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
            self._is_open = False

    def fsync(self) -> None:
        """Flush the slot file's data to stable storage."""
        if self._fd is not None:
            os.fsync(self._fd)

    def _header_matches(self, fd: int) -> bool:
        raw = os.pread(fd, _FILE_HEADER.size, 0)
        if len(raw) != _FILE_HEADER.size:
            return False
        magic, num_slots, stride, capacity = _FILE_HEADER.unpack(raw)
        return (
            magic == _FILE_MAGIC
            and num_slots == self.num_slots
            and stride == self.stride
            and capacity == self.slot_capacity
            and os.fstat(fd).st_size >= self.file_bytes
        )

    def _initialise(self, fd: int) -> None:
        """Truncate to nothing and preallocate: every slot reads as empty."""
        os.ftruncate(fd, 0)
        try:
            os.posix_fallocate(fd, 0, self.file_bytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, self.file_bytes)  # sparse where fallocate is unsupported
        header = _FILE_HEADER.pack(_FILE_MAGIC, self.num_slots, self.stride, self.slot_capacity)
        _pwrite_all(fd, [header], 0)

    def _require_fd(self) -> int:
        if self._fd is None:
            self.open_sync()
        assert self._fd is not None
        return self._fd

    # ------------------------------------------------------------------ keys

    def _slot_of(self, key: str) -> int | None:
        """Slot index of a chunk key, None for a metadata key."""
        if not key.startswith("c/"):
            return None
        parts = key.split("/")
        if len(parts) != 3 or parts[2] != "0" or not parts[1].isdigit():
            raise ValueError(f"key {key!r} is not a chunk key of a one-chunk-wide slot array")
        index = int(parts[1])
        if index >= self.num_slots:
            raise ValueError(f"key {key!r} names slot {index}; the file has {self.num_slots}")
        return index

    def _meta_path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/") or key == SLOT_FILE_NAME:
            raise ValueError(f"key {key!r} cannot be stored as a metadata file")
        return self.root / key

    def _header_offset(self, index: int) -> int:
        return _ALIGN + index * self.stride + self.prefix - _SLOT_HEADER.size

    def payload_offset(self, index: int) -> int:
        """Where slot ``index``'s encoded chunk starts in the slot file (aligned to the prefix size);
        its 16-byte header (magic, encoded length) lies just before."""
        self._check_slot(index)
        return _ALIGN + index * self.stride + self.prefix

    # ------------------------------------------------------------------ sync primitives

    def slot_length(self, index: int) -> int | None:
        """Encoded length stored in slot ``index``, None when the slot is empty."""
        raw = os.pread(self._require_fd(), _SLOT_HEADER.size, self._header_offset(index))
        if len(raw) != _SLOT_HEADER.size:
            return None
        magic, length = _SLOT_HEADER.unpack(raw)
        if magic != _SLOT_MAGIC:
            return None
        # A damaged length is clamped; the codec's checksum then refuses the bytes.
        return min(length, self.slot_capacity)

    def get_sync(
        self,
        key: str,
        *,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        index = self._slot_of(key)
        if index is None:
            try:
                data = self._meta_path(key).read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
            start, stop = _resolve_range(byte_range, len(data))
            return prototype.buffer.from_bytes(data[start:stop])
        length = self.slot_length(index)
        if length is None:
            return None
        start, stop = _resolve_range(byte_range, length)
        buf = self._pool.take(stop - start)
        offset = self._header_offset(index) + _SLOT_HEADER.size + start
        _pread_all(self._require_fd(), [buf], offset)
        return prototype.buffer.from_array_like(buf)

    def set_sync(self, key: str, value: Buffer) -> None:
        self._check_writable()
        index = self._slot_of(key)
        view = memoryview(value.as_buffer_like()).cast("B")
        if index is None:
            _atomic_replace(self._meta_path(key), view)
            return
        if len(view) > self.slot_capacity:
            raise OSError(
                errno.EFBIG,
                f"encoded chunk of {len(view)} bytes exceeds the slot capacity "
                f"{self.slot_capacity}",
                key,
            )
        header = _SLOT_HEADER.pack(_SLOT_MAGIC, len(view))
        _pwrite_all(self._require_fd(), [header, view], self._header_offset(index))

    def delete_sync(self, key: str) -> None:
        self._check_writable()
        index = self._slot_of(key)
        if index is None:
            try:
                self._meta_path(key).unlink()
            except FileNotFoundError:
                pass
            return
        _pwrite_all(self._require_fd(), [_EMPTY_HEADER], self._header_offset(index))

    # ------------------------------------------------------------------ direct chunk I/O

    def write_chunk(
        self, index: int, data: np.ndarray, pad: int = 0, binding: bytes | None = None
    ) -> None:
        """Store ``data``'s bytes then ``pad`` zero bytes as slot ``index``'s chunk.

        ``binding`` (``BINDING_BYTES`` bytes: who the chunk belongs to) is written,
        in the same ``pwritev`` as the chunk, into a block just before the slot header
        together with crc32c(binding + the chunk's crc32c), so the block vouches for
        exactly these bytes (a write torn anywhere leaves a block that does not vouch
        for what the slot holds). zarr does not see the block; ``read_chunk`` checks it.

        The slot receives what zarr's bytes + crc32c codecs would encode from
        that payload: the bytes followed by their crc32c. ``data`` (any
        C-contiguous array) is written from where it lies and must not change
        until this returns. Raises OSError(EFBIG) for a chunk larger than the
        slot capacity, ValueError for a bad index or buffer, OSError on an I/O
        failure (the slot's contents are then undefined).
        """
        self._check_writable()
        self._check_slot(index)
        payload = _byte_view(data, "data", writable=False)
        if pad < 0:
            raise ValueError(f"pad must be >= 0, got {pad}")
        if binding is not None and len(binding) != BINDING_BYTES:
            raise ValueError(f"binding must be {BINDING_BYTES} bytes, got {len(binding)}")
        length = payload.nbytes + pad + _CRC_BYTES
        if length > self.slot_capacity:
            raise OSError(
                errno.EFBIG,
                f"encoded chunk of {length} bytes exceeds the slot capacity {self.slot_capacity}",
                slot_chunk_key(index),
            )
        span = ByteSpan(payload)
        crc = span.extend(0, 0, None)
        parts: list[bytes | memoryview] = [_SLOT_HEADER.pack(_SLOT_MAGIC, length), span.view]
        for zeros, start, stop in _pieces(ByteSpan(payload[:0]), pad, self._zeros):
            crc = zeros.extend(crc, start, stop)
            parts.append(zeros.view[start:stop])
        trailer = crc32c_bytes(crc)
        parts.append(trailer)
        offset = self._header_offset(index)
        if binding is not None:  # the block goes down with the chunk: one pwritev
            parts.insert(0, self._block(binding, trailer))
            offset -= _BINDING_BLOCK
        _pwrite_all(self._require_fd(), parts, offset)

    def read_chunk(
        self, index: int, out: np.ndarray, pad: int = 0, binding: bytes | None = None,
        *, bounce: np.ndarray | None = None, lane: CopyLane | None = None,
    ) -> None:
        """Fill ``out`` with the payload of slot ``index``'s chunk and verify it.

        With ``bounce`` (a uint8 buffer of at least 4 KiB; ``BOUNCE_BYTES`` is the
        size measured best) and ``lane`` (of a ``CopyGate``), no ``preadv`` writes into
        ``out``: the payload is read in pieces of ``bounce``'s size, each lands in
        ``bounce``, is checksummed there (still in the CPU cache) and is copied into
        ``out`` through ``lane``, which refuses once its gate is shut
        (``OSError(ECANCELED)``). I/O that outlives the caller's interest then ends in
        ``bounce``, never in ``out``. ``pad`` must then be 0.

        With ``binding``, the slot's binding block must hold exactly that binding
        and vouch for the chunk's crc32c, else ``ChunkChecksumError`` (a chunk of
        another store, slot, owner or generation is never accepted).

        The chunk must hold exactly ``out.nbytes + pad`` payload bytes; the last
        ``pad`` of them are read into a scratch buffer (they count towards the
        checksum and are then dropped). Raises OSError(ENODATA) for an empty
        slot, ChunkChecksumError for a wrong length or checksum, OSError(EIO)
        when the file is shorter than the slot. After any exception the
        contents of ``out`` are unspecified and must not be used.
        """
        self._check_slot(index)
        dest = _byte_view(out, "out", writable=True)
        if pad < 0:
            raise ValueError(f"pad must be >= 0, got {pad}")
        expected = dest.nbytes + pad + _CRC_BYTES
        if expected > self.slot_capacity:
            raise ValueError(
                f"a chunk of {expected} encoded bytes cannot be in a slot of {self.slot_capacity}"
            )
        if binding is not None and len(binding) != BINDING_BYTES:
            raise ValueError(f"binding must be {BINDING_BYTES} bytes, got {len(binding)}")
        if (bounce is None) != (lane is None):
            raise ValueError("bounce and lane come together")
        if bounce is not None and (
            not isinstance(bounce, np.ndarray) or bounce.dtype != np.uint8
            or not bounce.flags.c_contiguous or bounce.nbytes < _ALIGN
        ):
            raise ValueError(f"bounce must be a contiguous uint8 array of >= {_ALIGN} bytes")
        if bounce is not None and pad:
            raise ValueError("a read through a bounce buffer takes no pad")
        scratch = self._pool.take(pad + _CRC_BYTES) if pad else np.empty(_CRC_BYTES, np.uint8)
        trailer = scratch[pad:]
        header = bytearray(_SLOT_HEADER.size)
        block = bytearray(_BINDING_BLOCK)
        fd = self._require_fd()
        offset = self._header_offset(index) - _BINDING_BLOCK
        if bounce is not None and lane is not None and dest.nbytes:
            crc = self._read_through(index, fd, offset, dest, bounce, lane,
                                     (block, header, trailer), expected, binding)
        else:
            crc = self._read_in_place(index, fd, offset, dest, pad, scratch,
                                      (block, header, trailer), expected)
        stored = int.from_bytes(trailer.tobytes(), "little")
        if stored != crc:
            raise ChunkChecksumError(
                f"slot {index}: stored crc32c {stored:#010x} does not match the bytes "
                f"read ({crc:#010x})"
            )
        if binding is not None:
            _verify_block(index, bytes(block), trailer.tobytes(), binding)

    def _read_in_place(
        self, index: int, fd: int, offset: int, dest: np.ndarray, pad: int,
        scratch: np.ndarray, parts: tuple[bytearray, bytearray, np.ndarray], expected: int,
    ) -> int:
        """``read_chunk``'s payload straight into ``dest`` (then ``pad`` bytes into
        ``scratch``), in pieces of ``PIECE_BYTES``: the crc32c of all of them."""
        block, header, trailer = parts
        pieces = list(_pieces(ByteSpan(dest), pad, scratch[:pad], advance=True))
        crc = 0
        for i, (span, start, stop) in enumerate(pieces):
            batch: list[bytearray | memoryview | np.ndarray] = [block, header] if i == 0 else []
            batch.append(span.view[start:stop])
            want = stop - start + (_BINDING_BLOCK + _SLOT_HEADER.size if i == 0 else 0)
            if i == len(pieces) - 1:
                batch.append(trailer)
                want += _CRC_BYTES
            offset = _pread_all(fd, batch, offset, want)
            if i == 0:
                self._check_header(index, header, expected)
            crc = span.extend(crc, start, stop)
        if not pieces:  # an empty payload: only the header and the crc
            _pread_all(fd, [block, header, trailer], offset)
            self._check_header(index, header, expected)
        return crc

    def _read_through(
        self, index: int, fd: int, offset: int, dest: np.ndarray, bounce: np.ndarray,
        lane: CopyLane, parts: tuple[bytearray, bytearray, np.ndarray], expected: int,
        binding: bytes | None,
    ) -> int:
        """``read_chunk``'s payload through ``lane``: the crc32c of the bytes it put into
        ``dest``. ``parts`` are the binding block, header and trailer to fill.

        Each piece is first asked of the page cache alone (``lane.read_cached``: a
        ``preadv`` with ``RWF_NOWAIT`` straight into ``dest``, which never waits for the
        device); what it did not bring is read into ``bounce`` and copied into ``dest``.
        The crc32c covers the bytes where they lie in ``dest`` or ``bounce``."""
        block, header, trailer = parts
        step = bounce.nbytes
        land = ByteSpan(bounce)
        out = ByteSpan(dest)
        to, src = dest.ctypes.data, bounce.ctypes.data
        end = dest.nbytes
        crc = 0
        for start in range(0, end, step):
            size = min(step, end - start)
            head = _BINDING_BLOCK + _SLOT_HEADER.size if not start else 0
            tail = _CRC_BYTES if start + size == end else 0
            got = 0
            if self._nowait:
                batch: list = [block, header] if head else []
                batch.append(out.view[start : start + size])
                if tail:
                    batch.append(trailer)
                try:
                    got = lane.read_cached(fd, batch, offset)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    self._nowait = False  # this file or kernel cannot: bounce from now on
            if got < head:  # the header did not all come: read it into the store's buffers
                _pread_all(fd, [block, header], offset, head)
                got = head
            if head:
                self._check_header(index, header, expected)
                if binding is not None and block[:BINDING_BYTES] != binding:
                    _verify_block(index, bytes(block), b"", binding)  # refused before a copy
            cached = min(size, got - head)
            if cached:
                crc = out.extend(crc, start, start + cached)
            rest = size - cached
            if rest or got < head + size + tail:
                batch = [land.view[:rest]] if rest else []
                if tail:
                    batch.append(trailer)
                _pread_all(fd, batch, offset + head + cached, rest + tail)
                if rest:
                    crc = land.extend(crc, 0, rest)
                    lane.copy(to + start + cached, src, rest)
            offset += head + size + tail
        return crc

    @staticmethod
    def _block(binding: bytes, chunk_crc: bytes) -> bytes:
        """The binding block: the binding, then crc32c(binding + the chunk's crc32c)."""
        return binding + crc32c_bytes(google_crc32c.value(binding + chunk_crc))

    def _write_block(self, index: int, binding: bytes, chunk_crc: bytes) -> None:
        block = self._block(binding, chunk_crc)
        _pwrite_all(self._require_fd(), [block], self._header_offset(index) - _BINDING_BLOCK)

    def _stored_crc(self, index: int) -> tuple[bytes, bytes]:
        """(binding block, the stored chunk's trailing crc32c) of slot ``index``."""
        length = self.slot_length(index)
        if length is None or length < _CRC_BYTES:
            raise OSError(errno.ENODATA, "chunk is missing from the store", slot_chunk_key(index))
        fd = self._require_fd()
        block = os.pread(fd, _BINDING_BLOCK, self._header_offset(index) - _BINDING_BLOCK)
        crc = os.pread(fd, _CRC_BYTES, self.payload_offset(index) + length - _CRC_BYTES)
        if len(block) != _BINDING_BLOCK or len(crc) != _CRC_BYTES:
            raise OSError(errno.EIO, f"slot file ended early at slot {index}")
        return block, crc

    def bind_slot(self, index: int, binding: bytes) -> None:
        """Bind the chunk zarr just stored in slot ``index`` (the block ``write_chunk``
        writes, vouching for the chunk's stored crc32c, whatever the codec)."""
        self._check_writable()
        self._check_slot(index)
        if len(binding) != BINDING_BYTES:
            raise ValueError(f"binding must be {BINDING_BYTES} bytes, got {len(binding)}")
        _, crc = self._stored_crc(index)
        self._write_block(index, binding, crc)

    def check_slot_binding(self, index: int, binding: bytes) -> None:
        """ChunkChecksumError unless slot ``index``'s chunk is bound to ``binding``."""
        self._check_slot(index)
        block, crc = self._stored_crc(index)
        _verify_block(index, block, crc, binding)

    def _check_header(self, index: int, header: bytearray, expected: int) -> None:
        magic, length = _SLOT_HEADER.unpack(bytes(header))
        if magic != _SLOT_MAGIC:
            raise OSError(errno.ENODATA, "chunk is missing from the store", slot_chunk_key(index))
        if length != expected:
            raise ChunkChecksumError(
                f"slot {index} holds a chunk of {length} encoded bytes; expected {expected}"
            )

    def _check_slot(self, index: int) -> None:
        if (
            isinstance(index, bool)
            or not isinstance(index, (int, np.integer))
            or not 0 <= index < self.num_slots
        ):
            raise ValueError(f"slot index must be in [0, {self.num_slots}), got {index!r}")

    def occupied_slots(self) -> list[int]:
        """Indices of the slots that hold a chunk."""
        return [i for i in range(self.num_slots) if self.slot_length(i) is not None]

    def foreign_entries(self) -> list[str]:
        """Names under ``root`` that this store does not write (a clear would destroy them)."""
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if entry.name not in _OWN_NAMES
            and not (entry.name.startswith(".") and entry.name.endswith(".tmp"))
        )

    def clear_sync(self) -> None:
        """Remove every key: other files under ``root`` go, every slot becomes empty.

        The lock file (``.tiering.lock``) stays: it is held while the store is open."""
        self._check_writable()
        fd = self._require_fd()
        for entry in self.root.iterdir():
            if entry.name in (SLOT_FILE_NAME, _LOCK_NAME):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)
        self._initialise(fd)

    def _meta_files(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for p in self.root.rglob("*")
            if p.is_file() and p.name != SLOT_FILE_NAME and not p.name.startswith(".")
        )

    def _all_keys(self) -> list[str]:
        keys = [p.relative_to(self.root).as_posix() for p in self._meta_files()]
        keys.extend(slot_chunk_key(i) for i in self.occupied_slots())
        return keys

    # ------------------------------------------------------------------ zarr Store API

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SlotFileStore)
            and other.root == self.root
            and other.num_slots == self.num_slots
            and other.slot_capacity == self.slot_capacity
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SlotFileStore('{self.root}', num_slots={self.num_slots})"

    def with_read_only(self, read_only: bool = False) -> SlotFileStore:
        return SlotFileStore(
            self.root,
            num_slots=self.num_slots,
            slot_capacity=self.slot_capacity,
            read_buffers=self.read_buffers,
            read_only=read_only,
        )

    async def exists(self, key: str) -> bool:
        index = self._slot_of(key)
        if index is None:
            return self._meta_path(key).is_file()
        return await asyncio.to_thread(self.slot_length, index) is not None
