"""The manifest writes of ``DiskPageStore``: synchronous, or by the flusher thread.

``ManifestPart`` holds the store's methods that write the manifest from the committed
entries (marking it dirty on a fault), and, on a network store, the background flusher
that takes those writes off the caller's thread. It is a part of that one class, not an
object of its own: it reads and writes the state ``DiskPageStore.__init__`` sets up, and
the contract is in ``tiering.disk.store``'s module docstring. Split out so each file
stays readable; the state stays in one owner.
"""

from __future__ import annotations

import errno
import logging
import threading

from tiering.core.validate import check_budget
from tiering.disk.manifest import ManifestEntry, encode_manifest
from tiering.errors import DiskIOError

log = logging.getLogger("tiering.disk.store")  # the store's own log: these are its parts


class ManifestPart:
    """``DiskPageStore``'s manifest writes and flusher (see the module docstring)."""

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
        manifest on the store is current (always True where writes are synchronous).
        ValueError for a timeout that is not a finite number >= 0."""
        timeout = check_budget("wait_manifest timeout", timeout)
        if self._flusher is None:
            return not self._manifest_dirty
        with self._flush_cv:
            self._flush_cv.wait_for(lambda: self._flush_wanted is None and not self._flush_busy,
                                    timeout=timeout)
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
