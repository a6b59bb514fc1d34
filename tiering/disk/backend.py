"""Where the disk tier's zarr array lives: the store, and starting, clearing and
reattaching it.

``PageBackend`` opens the zarr store named by a ``DiskConfig`` (a local
directory becomes a ``SlotFileStore``; an ``s3://bucket/prefix`` URL the
cold tier's ``LeasedZarrStore`` on obstore, held by a lease object and checked
against it before every write; another URL an ``FsspecStore`` with the config's
``storage_options``; a given store or ``StorePath`` is used as it is), wraps it so that a missing chunk is an
error rather than fill values, and holds the page array. It knows nothing of
owners or ledgers: ``reattach`` returns the manifest's entries, or raises
``StartRefused`` saying why they cannot be trusted, and the caller then clears.
All store calls go through zarr's event loop and are bounded by the configured
timeout.

Binding records (the zarr path, ``tiering-bind/<slot>``): the chunk's binding followed, on a
local or in-memory store, by the crc32c of its page bytes and a crc32c of both; on an s3://
path, where anyone with write access to the bucket could rewrite a chunk and recompute those
crcs, by a keyed BLAKE2b MAC over the binding, the array geometry, the length and the page
bytes (``tiering.coldtier.trust``). Its key is the deployment secret of ``DiskConfig.trust`` or
``TIERING_COLDTIER_SECRET``; without one, a random key of this tier's own (``reattach`` then
refuses what an earlier process wrote, since nothing can vouch for it).

``direct`` is the slot-file store when chunk I/O may bypass zarr's codec
pipeline: the store is our own ``SlotFileStore``, nothing wraps it (a wrapper,
such as the fault-injection store, must see every chunk operation, so a
wrapped store always goes through zarr), and the array's chunks are raw bytes
plus crc32c (``raw_crc_chunks``). Otherwise it is None and every chunk goes
through zarr.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import google_crc32c
import numpy as np
import zarr
import zarr.api.asynchronous as zasync
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, StorePath, WrapperStore

from tiering.disk.array import (
    create_page_array,
    max_encoded_bytes,
    page_array_mismatch,
    raw_crc_chunks,
)
from tiering.disk.config import DiskConfig, s3_url
from tiering.disk.crc import crc32c_bytes, crc32c_extend
from tiering.disk.lock import LOCK_FILE_NAME, DiskPathInUseError, LocalDirLock
from tiering.disk.manifest import MANIFEST_KEY, Manifest, ManifestError
from tiering.disk.slotfile import SLOT_FILE_NAME, SlotFileStore
from tiering.errors import ChunkChecksumError, StartRefused

_T = TypeVar("_T")
STORE_ID_ATTR = "tiering_store_id"  # the page array's attribute naming the store identity
BINDING_DIR = "tiering-bind"  # the zarr path's per-chunk binding records


@dataclass(frozen=True)
class ArrayGeometry:
    """The page array's shape, chunking, storage dtype and codec."""

    rows: int
    row_elems: int
    pages_per_chunk: int
    dtype: np.dtype
    codec: str


class _MissingChunk(OSError):
    pass


class _RequireChunks(WrapperStore[Store]):
    """Turns a missing chunk into ``OSError(ENODATA)``: zarr would hand back fill values."""

    def _with_store(self, store: Store) -> _RequireChunks:
        return _RequireChunks(store)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        value = await self._store.get(key, prototype, byte_range)
        if value is None and (key.startswith("c/") or "/c/" in key):
            raise _MissingChunk(errno.ENODATA, "chunk is missing from the store", key)
        return value


def local_dir(path: str | os.PathLike[str]) -> str | None:
    """The local directory a path or ``file://`` URL names; None for other URLs."""
    text = os.fspath(path)
    parsed = urlparse(text)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"DiskConfig.path {text!r}: file URLs must name a local path")
        return unquote(parsed.path)
    if len(parsed.scheme) > 1 and "://" in text:
        return None
    return text


class PageBackend:
    """The zarr store and page array of one disk tier.

    ``num_slots`` and ``chunk_bytes`` size the slot file when the config names a
    local directory. ``wrap_store`` wraps the base store (fault injection).
    ``direct`` (set once the array exists) is the slot store when chunks may be
    moved without zarr's pipeline, else None.
    """

    def __init__(
        self,
        config: DiskConfig,
        *,
        num_slots: int,
        chunk_bytes: int,
        wrap_store: Callable[[Store], Store] | None = None,
    ) -> None:
        self.config = config
        self.slots: SlotFileStore | None = None
        self.prefix = ""
        self._owns_store = config.store is None
        self.lock: LocalDirLock | None = None
        self.lease = config.lease
        self._leased = False
        self.hold: Any = None  # the cold tier's HeldPrefix of an s3:// path
        self.mac: Any = None  # MacKeys of an s3:// path's binding records
        self.mac_persistent = False  # keyed by a deployment secret (another process has it too)
        self._geometry_tag = b""
        self._created: list[str] = []  # files (relative to a local root) this start created
        if isinstance(config.store, StorePath):
            base: Store = config.store.store
            self.prefix = config.store.path
        elif config.store is not None:
            base = config.store
        else:
            assert config.path is not None
            local = local_dir(config.path)
            url = s3_url(config.path)
            if url is not None:
                self.mac, self.mac_persistent = _chunk_keys(config)  # before any I/O
                self.hold = _hold_s3(config, url)
                base = self.hold.zarr_store
            elif local is None:
                base = FsspecStore.from_url(
                    os.fspath(config.path), storage_options=dict(config.storage_options or {})
                )
            else:
                # Lock first: nothing may touch a directory another live tier uses.
                self.lock = LocalDirLock(local)
                self.lock.acquire()
                try:
                    self.slots = SlotFileStore(
                        local,
                        num_slots=num_slots,
                        slot_capacity=max_encoded_bytes(config.codec, chunk_bytes),
                        read_buffers=2 * config.io_threads,
                    )
                    self._created = [
                        name
                        for name in (SLOT_FILE_NAME, "zarr.json", MANIFEST_KEY)
                        if not (self.slots.root / name).exists()
                    ]
                    self.slots.open_sync()
                except BaseException:
                    self.discard()
                    raise
                base = self.slots
        if self.lease is not None:
            try:
                self.lease.acquire()
            except BaseException:
                self.discard()
                raise
            self._leased = True
        try:
            wrapped = wrap_store(base) if wrap_store is not None else base
            if not isinstance(wrapped, Store):
                raise ValueError(
                    f"wrap_store must return a zarr Store, got {type(wrapped).__name__}"
                )
        except BaseException:
            self.discard()
            raise
        self.store: Store = _RequireChunks(wrapped)
        self.store_path = StorePath(self.store, self.prefix)
        self.array: zarr.AsyncArray[Any] | None = None
        self.direct: SlotFileStore | None = None
        self._unwrapped_slots = self.slots is not None and wrapped is base

    @property
    def where(self) -> str:
        return repr(self.config.path) if self.config.store is None else repr(self.config.store)

    def call(self, aw: Awaitable[_T]) -> _T:
        """Run a store or array coroutine on zarr's loop, bounded by the I/O timeout."""
        return sync(_as_coroutine(aw), timeout=self.config.io_timeout_s)

    def close(self) -> None:
        """Close the slot file if this backend opened one (no I/O may be running), then
        give up the location: the directory lock, or the lease (idempotent)."""
        if self._owns_store and self.slots is not None:
            self.slots.close()
        self._release_hold()

    def discard(self) -> None:
        """After a failed start: close, remove what this start created (the whole
        directory if it made it, else the files it added), then give up the location."""
        if self._owns_store and self.slots is not None:
            self.slots.close()
        lock = self.lock
        if lock is not None and lock.held:
            if lock.created_root:
                for entry in sorted(lock.root.rglob("*"), reverse=True):
                    if entry.name == LOCK_FILE_NAME and entry.parent == lock.root:
                        continue
                    if entry.is_dir() and not entry.is_symlink():
                        entry.rmdir()
                    else:
                        entry.unlink(missing_ok=True)
            else:
                for name in self._created:
                    (lock.root / name).unlink(missing_ok=True)
            lock.discard()
            if lock.created_root:
                try:
                    lock.root.rmdir()
                except OSError:
                    pass
        self._release_hold()

    def _release_hold(self) -> None:
        if self.lock is not None:
            self.lock.release()
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.close()
        if self._leased and self.lease is not None:
            self._leased = False
            self.lease.release()

    # ------------------------------------------------------------------ start-up

    def clear_and_create(self, geometry: ArrayGeometry, store_id: str) -> None:
        """Remove everything an earlier process left, then create an empty page array
        carrying the new store identity ``store_id`` in its attributes.

        Refuses (``OSError(EEXIST)``) a location that holds anything the tier did not
        write, and a bucket root named by URL: a clear there would destroy other data."""
        self._refuse_foreign()
        if self.slots is not None:
            self.slots.clear_sync()
        elif self.prefix:
            self.call(self.store.delete_dir(self.prefix))
        else:
            try:
                self.call(self.store.clear())
            except FileNotFoundError:
                pass
        self._geometry_tag = _geometry_tag(geometry)
        array = self.call(create_page_array(self.store_path, **asdict(geometry)))
        self.call(array.update_attributes({STORE_ID_ATTR: store_id}))
        self._set_array(array)

    def _refuse_foreign(self) -> None:
        where = self.where
        if self.slots is not None:
            foreign = self.slots.foreign_entries()
        else:
            if self._owns_store and isinstance(self.store_path.store, _RequireChunks):
                fs_path = getattr(_innermost(self.store_path.store), "path", None)
                if isinstance(fs_path, str) and "/" not in fs_path.strip("/"):
                    raise OSError(
                        errno.EEXIST,
                        f"disk store {where}: refusing to clear a bucket root; "
                        f"give the disk tier a prefix of its own",
                    )
            prefix = f"{self.prefix}/" if self.prefix else ""
            try:
                keys = self.call(_collect(self.store.list_prefix(prefix)))
            except (FileNotFoundError, NotImplementedError):
                keys = []
            foreign = [k for k in keys if not _tier_key(k[len(prefix) :])]
        if foreign:
            raise OSError(
                errno.EEXIST,
                f"disk store {where}: refusing to clear a location holding files the disk tier "
                f"did not write: {sorted(foreign)[:10]}",
            )

    def reattach(
        self, geometry: ArrayGeometry, decode: Callable[[bytes, str], Manifest]
    ) -> tuple[str, Manifest]:
        """Open the existing array and return its store identity and the manifest
        (decoded and verified by ``decode`` against that identity), after deleting
        every chunk the manifest does not list. Raises StartRefused if anything is
        missing, unreadable or different (a manifest of another store included)."""
        if self.slots is not None and not self.slots.found_existing:
            raise StartRefused("no slot file (first start)", nothing_there=True)
        if self.slots is not None and not self.slots.matched_existing:
            raise StartRefused("the slot file was made for another geometry")
        try:
            raw = self.call(self.store.get(self._manifest_key(), default_buffer_prototype()))
        except OSError as exc:
            raise StartRefused(f"manifest unreadable: {exc}") from exc
        if raw is None:
            raise StartRefused("no manifest", nothing_there=True)
        if self.mac is not None and not self.mac_persistent:
            raise StartRefused(
                "no deployment secret (DiskConfig.trust or TIERING_COLDTIER_SECRET): the chunks an"
                " earlier process wrote cannot be authenticated")
        self._geometry_tag = _geometry_tag(geometry)
        try:
            array = self.call(zasync.open_array(store=self.store_path, zarr_format=3))
        except Exception as exc:  # noqa: BLE001 - any failure to open means "do not trust it"
            raise StartRefused(f"array metadata unreadable: {exc!r}") from exc
        mismatch = page_array_mismatch(array, **asdict(geometry))
        if mismatch is not None:
            raise StartRefused(mismatch)
        store_id = array.attrs.get(STORE_ID_ATTR)
        if not isinstance(store_id, str) or not store_id:
            raise StartRefused("the array carries no store identity")
        try:
            manifest = decode(raw.to_bytes(), store_id)
        except ManifestError as exc:
            raise StartRefused(str(exc)) from exc
        self._drop_unlisted_chunks({c for e in manifest.entries.values() for c in e.chunks})
        self._set_array(array)
        return store_id, manifest

    def binding_record(self, binding: bytes, row: np.ndarray) -> bytes:
        """The record that vouches for chunk bytes ``row`` under ``binding`` (see the module
        docstring: a MAC on s3://, crc32c elsewhere)."""
        if self.mac is not None:
            return binding + self.mac.key_id + self.mac.tag(*self._mac_parts(binding, row))
        body = binding + crc32c_bytes(crc32c_extend(0, row))
        return body + crc32c_bytes(google_crc32c.value(body))

    def check_binding_record(self, chunk: int, record: bytes, expected: bytes, dest: np.ndarray) -> None:
        """ChunkChecksumError unless ``record`` vouches for ``dest`` under ``expected``."""
        from tiering.disk.slotfile import describe_binding

        n = len(expected)
        if self.mac is not None:
            if len(record) != n + 8 + 32:
                raise ChunkChecksumError(f"chunk {chunk}: its binding record is damaged or unkeyed")
        else:
            if len(record) != n + 8 or crc32c_bytes(google_crc32c.value(record[: n + 4])) != record[n + 4 :]:
                raise ChunkChecksumError(f"chunk {chunk}: its binding record is damaged")
        if record[:n] != expected:
            raise ChunkChecksumError(
                f"chunk {chunk}: the chunk is bound to {describe_binding(record[:n])}, "
                f"not to {describe_binding(expected)} (misplaced, stale or foreign)"
            )
        if self.mac is not None:
            key_id, tag = record[n : n + 8], record[n + 8 :]
            if not self.mac.verify(key_id, tag, *self._mac_parts(expected, dest)):
                raise ChunkChecksumError(
                    f"chunk {chunk}: its MAC does not verify: the pages were not written by a"
                    " holder of the deployment secret (forged or damaged)")
        elif record[n : n + 4] != crc32c_bytes(crc32c_extend(0, dest)):
            raise ChunkChecksumError(
                f"chunk {chunk}: its pages are not the ones its binding record vouches for"
            )

    def _mac_parts(self, binding: bytes, row: np.ndarray) -> tuple:
        data = memoryview(np.ascontiguousarray(row).reshape(-1).view(np.uint8))
        head = b"tiering/disk-chunk\0" + len(self._geometry_tag).to_bytes(4, "little")
        return (head, self._geometry_tag, binding, data.nbytes.to_bytes(8, "little"), data)

    async def write_binding(self, chunk: int, record: bytes) -> None:
        """Store chunk ``chunk``'s binding record (the zarr path; see the store docstring)."""
        buf = default_buffer_prototype().buffer.from_bytes(record)
        await self.store.set(self._binding_key(chunk), buf)

    async def read_binding(self, chunk: int) -> bytes | None:
        value = await self.store.get(self._binding_key(chunk), default_buffer_prototype())
        return None if value is None else value.to_bytes()

    def _binding_key(self, chunk: int) -> str:
        key = f"{BINDING_DIR}/{chunk}"
        return f"{self.prefix}/{key}" if self.prefix else key

    def _set_array(self, array: zarr.AsyncArray[Any]) -> None:
        self.array = array
        direct = self._unwrapped_slots and not self.prefix and raw_crc_chunks(array)
        self.direct = self.slots if direct else None

    def write_manifest(self, body: bytes, *, flush_data: bool) -> None:
        """Replace the manifest (after flushing the slot file when ``flush_data``)."""
        if flush_data and self.slots is not None:
            self.slots.fsync()
        buf = default_buffer_prototype().buffer.from_bytes(body)
        self.call(self.store.set(self._manifest_key(), buf))

    def _manifest_key(self) -> str:
        return f"{self.prefix}/{MANIFEST_KEY}" if self.prefix else MANIFEST_KEY

    def _drop_unlisted_chunks(self, listed: set[int]) -> None:
        """Delete every chunk not in ``listed``; refuse if a listed one is missing."""
        prefix = f"{self.prefix}/c/" if self.prefix else "c/"
        try:
            keys = self.call(_collect(self.store.list_prefix(prefix)))
            present: set[int] = set()
            strays: list[str] = []
            for key in keys:
                parts = key[len(prefix) :].split("/")
                index = int(parts[0]) if len(parts) == 2 and parts[0].isdigit() else -1
                if parts[-1] == "0" and index in listed:
                    present.add(index)
                else:
                    strays.append(key)
            missing = listed - present
            if missing:
                raise StartRefused(
                    f"manifest lists chunks missing from the store: {sorted(missing)[:20]}"
                )
            for key in strays:
                self.call(self.store.delete(key))
        except OSError as exc:
            raise StartRefused(f"store listing failed: {exc}") from exc


def _hold_s3(config: DiskConfig, url: str) -> Any:
    """Open and hold ``url`` through the cold tier: probed, leased, renewed. The cold tier's
    errors become the disk tier's own: ``DiskPathInUseError`` naming the prefix and its holder,
    or an ``OSError`` (``DiskIOError`` once the store wraps it) naming the URL and the cause."""
    from tiering.coldtier import ColdTierUnavailable, LeaseConfig, LeaseHeld, hold_zarr_prefix

    ttl = float(config.lease_ttl_s)
    owner = f"pid {os.getpid()} host {socket.gethostname()} tier {secrets.token_hex(4)}"
    try:
        return hold_zarr_prefix(
            url,
            config.storage_options,
            owner=owner,
            lease_config=LeaseConfig(ttl_s=ttl, renew_every_s=ttl / 3, safety_s=ttl / 15),
        )
    except LeaseHeld as exc:
        raise DiskPathInUseError(
            errno.EBUSY,
            f"disk tier path {url!r} is in use by another live disk tier ({exc}); "
            "each cache needs its own disk path",
        ) from exc
    except ColdTierUnavailable as exc:
        text = str(exc)
        code = (
            errno.EACCES
            if any(w in text for w in ("PermissionDenied", "Unauthenticated", "403"))
            else errno.EHOSTUNREACH
        )
        raise OSError(code, text) from exc


def _chunk_keys(config: DiskConfig) -> tuple[Any, bool]:
    """(MacKeys for an s3:// tier's binding records, whether they come from a deployment
    secret). ``trust="unauthenticated"`` gives (None, False): crc32c records."""
    from tiering.coldtier.trust import SECRET_ENV, MacKeys, TrustConfig

    trust = config.trust
    if trust is None:
        if not os.environ.get(SECRET_ENV):
            return MacKeys(secrets.token_bytes(32)), False
        trust = TrustConfig()
    keys = trust.keys()
    return keys, keys is not None


def _geometry_tag(geometry: ArrayGeometry) -> bytes:
    text = repr((geometry.rows, geometry.row_elems, geometry.pages_per_chunk,
                 np.dtype(geometry.dtype).str, geometry.codec))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _tier_key(key: str) -> bool:
    """Whether a key (relative to the tier's prefix) is one the disk tier writes."""
    return key in ("zarr.json", MANIFEST_KEY) or key.startswith(("c/", f"{BINDING_DIR}/"))


def _innermost(store: Store) -> Store:
    while isinstance(store, WrapperStore):
        store = store._store
    return store


async def _as_coroutine(aw: Awaitable[_T]) -> _T:
    return await aw


async def _collect(it: Any) -> list[str]:
    return [key async for key in it]
