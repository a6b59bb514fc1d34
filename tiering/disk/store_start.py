"""Start-up of ``DiskPageStore``: reattach to what a manifest lists, or clear.

``StartPart`` holds the store's methods that describe its layout, decode a manifest
against it and, at start, either adopt the listed entries under a new generation epoch
or clear the store under a new identity. It is a part of that one class, not an object
of its own: it reads and writes the state ``DiskPageStore.__init__`` sets up, and the
contract is in ``tiering.disk.store``'s module docstring. Split out so each file stays
readable; the state stays in one owner.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from tiering.disk.backend import StartRefused
from tiering.disk.ledger import DiskExtent
from tiering.disk.manifest import Manifest, decode_manifest
from tiering.errors import DiskIOError

log = logging.getLogger("tiering.disk.store")  # the store's own log: these are its parts


GENERATION_EPOCH_BITS = 32  # each reattached run hands out generations from a new epoch


def _random_store_id() -> bytes:
    return os.urandom(16)


class StartPart:
    """``DiskPageStore``'s start-up (see the module docstring)."""

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
