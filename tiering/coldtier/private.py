"""A worker's private objects (its own request offloads) under a prefix it holds by lease.

``PrivatePrefix.open`` takes the lease at ``private/<name>/LEASE`` (raising :class:`LeaseHeld`
if another live worker holds it) and starts renewing it. Objects live at
``private/<name>/obj/<object name>``, framed like blocks (bound to their name and the prefix)
and written whole (never multipart, so an interrupted write leaves nothing behind), with the
deployment MAC (``trust``, as for shared blocks). A read asks for at most the frame of
``max_object_bytes`` (plus one byte) and refuses a larger object unread. Every write
first checks that the lease is still held; a worker whose lease was taken over gets a SKIPPED
result with reason "lease not held" and writes nothing. ``delete`` removes an object the worker
released; ``clear`` removes all of them (only while held).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from ._io import Fault, classify, short
from .blocks import BlockResult, BlockStatus, get_capped
from .breaker import CircuitBreaker
from .frame import KIND_PRIVATE, FrameRefused, frame, framed_size, unframe
from .lease import Lease, LeaseConfig, LeaseKeeper
from .trust import MacKeys, TrustConfig, resolve_keys

__all__ = ["PrivatePrefix"]

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def _check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} {name!r} must be 1-200 characters of [A-Za-z0-9._-]")
    return name


class PrivatePrefix:
    def __init__(self, store, name: str, owner: str, *, lease_config: LeaseConfig | None = None,
                 clock: Callable[[], float] = time.time, breaker: CircuitBreaker | None = None,
                 geometry: bytes = b"", trust: TrustConfig | MacKeys | str | None = None,
                 max_object_bytes: int = 256 << 20) -> None:
        if not isinstance(geometry, bytes):
            raise ValueError(f"PrivatePrefix geometry must be bytes, got {type(geometry).__name__}")
        if not isinstance(max_object_bytes, int) or isinstance(max_object_bytes, bool) or max_object_bytes < 1:
            raise ValueError(f"PrivatePrefix max_object_bytes must be an int >= 1, got {max_object_bytes!r}")
        self.keys = resolve_keys(trust, "PrivatePrefix")
        self.max_object_bytes = max_object_bytes
        self.store = store
        self.name = _check_name("private prefix", name)
        self.base = f"private/{name}/"
        self.lease = Lease(store, self.base + "LEASE", owner, config=lease_config, clock=clock)
        self.breaker = breaker or CircuitBreaker(clock=time.monotonic)
        self.geometry = geometry
        self._keeper: LeaseKeeper | None = None

    @classmethod
    def open(cls, store, name: str, owner: str, *, renew: bool = True, **kwargs) -> PrivatePrefix:
        p = cls(store, name, owner, **kwargs)
        p.lease.acquire()
        if renew:
            p._keeper = LeaseKeeper(p.lease).start()
        return p

    def _path(self, obj: str) -> str:
        return self.base + "obj/" + _check_name("object name", obj)

    def put(self, obj: str, payload) -> BlockResult:
        path = self._path(obj)
        key = obj.encode()
        data = frame(KIND_PRIVATE, key, self.base.encode(), self.geometry, payload, keys=self.keys)
        if not self.lease.held:
            return BlockResult("put", key, BlockStatus.SKIPPED, reason="lease not held")
        if not self.breaker.allow():
            return BlockResult("put", key, BlockStatus.SKIPPED, reason="store not answering")
        import obstore

        try:
            obstore.put(self.store, path, data, mode="overwrite", use_multipart=False)
        except Exception as exc:
            self.breaker.record_failure()
            return BlockResult("put", key, BlockStatus.UNAVAILABLE, reason=short(exc))
        self.breaker.record_success()
        return BlockResult("put", key, BlockStatus.WRITTEN, nbytes=len(data))

    def get(self, obj: str) -> BlockResult:
        path = self._path(obj)
        key = obj.encode()
        if not self.breaker.allow():
            return BlockResult("get", key, BlockStatus.SKIPPED, reason="store not answering")
        cap = framed_size(key, self.base.encode(), self.geometry, self.max_object_bytes)
        got = get_capped(self.store, path, "get", key, cap, self.breaker)
        if got.oversize is not None:
            return BlockResult("get", key, BlockStatus.LOST, reason=f"refused: object is"
                               f" {got.oversize} bytes, over the frame's maximum {cap}")
        if got.failed is not None:
            return got.failed
        raw = got.raw
        try:
            payload = bytes(unframe(KIND_PRIVATE, raw, key, self.base.encode(), self.geometry, keys=self.keys))
        except FrameRefused as exc:
            return BlockResult("get", key, BlockStatus.LOST, nbytes=len(raw), reason=f"refused: {exc}")
        return BlockResult("get", key, BlockStatus.HIT, payload=payload, nbytes=len(raw))

    def delete(self, obj: str) -> BlockResult:
        path = self._path(obj)
        key = obj.encode()
        if not self.lease.held:
            return BlockResult("delete", key, BlockStatus.SKIPPED, reason="lease not held")
        import obstore

        try:
            obstore.delete(self.store, path)
        except Exception as exc:
            if classify(exc) is not Fault.MISSING:
                return BlockResult("delete", key, BlockStatus.UNAVAILABLE, reason=short(exc))
        return BlockResult("delete", key, BlockStatus.DELETED)

    def names(self) -> list[str]:
        import obstore

        out: list[str] = []
        for chunk in obstore.list(self.store, prefix=self.base + "obj/", chunk_size=1000):
            out.extend(m["path"].rsplit("/", 1)[-1] for m in chunk)
        return sorted(out)

    def clear(self) -> int:
        """Delete every object under the prefix (only while the lease is held); how many."""
        if not self.lease.held:
            return 0
        names = self.names()
        for n in names:
            self.delete(n)
        return len(names)

    def close(self, *, clear: bool = False) -> None:
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        if clear:
            self.clear()
        self.lease.release()
