"""Shared, content-addressed blocks on an object store.

A published block is a write-once object named ``blocks/<root hex>/<geometry tag>/<key hex>``
(relative to the store's prefix; the tag is a digest of the geometry, so workers of different
models or dtypes never share a name), framed with its key, root and geometry, a crc32c and a
keyed MAC under the deployment secret (:mod:`.frame`, :mod:`.trust`), written by
create-if-absent. Any worker with the same root, geometry and secret reads what another wrote;
a duplicate write is refused by the store and counted as harmless. Every read is bounded: the
size known from the listing is checked against the largest frame a block may have before any
request, and the GET asks for at most one byte more than that, so an oversized object costs
one capped request and is refused (counted in ``refusals``). An object that fails the frame
check is a miss, counted and logged, never served; only one that names exactly this block but
is damaged is deleted (never one of another key, geometry or secret). There is no manifest: the objects under a root's
prefix are the index, and a list of that prefix (``refresh_index``) is how a worker learns what
others published. What a worker knows exists is kept in a bounded local LRU
(:class:`KnownBlocks`); the step path only asks that cache, so a miss in it is a miss, never a
network round trip.

:class:`SharedBlockStore` does the I/O synchronously and never raises for a store fault: it
returns a result whose status says what happened. :class:`BlockQueue` is what the step path
uses: ``submit_*`` only enqueue (False when refused: a full queue, an open breaker, a
closed queue), worker threads run the I/O with the
client's timeouts, ``poll`` hands back finished results without waiting. A
:class:`CircuitBreaker` in front of every request means a store that stopped answering costs
one timeout, after which queued requests are skipped at once until the cooldown's trial succeeds.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from tiering.core.frozen import frozen_nested
from tiering.core.validate import check_budget, check_threads

from ._io import Fault, classify, short
from .breaker import BreakerConfig, CircuitBreaker
from .frame import (
    KIND_BLOCK,
    MAX_ID_BYTES,
    FrameDamaged,
    FrameRefused,
    FrameUnauthenticated,
    crc32c_value,
    frame,
    framed_size,
    unframe,
)
from .s3 import check_storage_options, parse_s3_url
from .trust import TRUST_MODES, MacKeys, TrustConfig, resolve_keys

log = logging.getLogger("tiering.coldtier")

__all__ = ["BlockQueue", "BlockResult", "BlockStatus", "ColdTierConfig", "KnownBlocks",
           "SharedBlockStore", "SharedTierConfig", "block_path", "geometry_tag"]


class BlockStatus(str, Enum):
    WRITTEN = "written"  # this worker created the object
    DUPLICATE = "duplicate"  # it was already there (harmless)
    HIT = "hit"  # read back and checked; payload holds the bytes
    LOST = "lost"  # missing, or refused by the frame check; reason says which
    UNAVAILABLE = "unavailable"  # transient fault: the block is left where it is, retry later
    SKIPPED = "skipped"  # the breaker is open: no request was made
    REFUSED = "refused"  # a publish whose payload no longer matches its recorded crc: not sent
    DELETED = "deleted"
    LISTED = "listed"  # a refresh of the known cache finished


class BlockResult(NamedTuple):
    op: str  # "publish" | "fetch" | "delete"
    key: bytes
    status: BlockStatus
    payload: bytes | None = None
    nbytes: int = 0  # object bytes written or read
    reason: str = ""


#: the largest ``ColdTierConfig.max_block_bytes``: a read's byte range (64-bit in the object
#: store's API) must hold the whole framed block, header and trailer included
MAX_BLOCK_BYTES = 1 << 62


@dataclass(frozen=True)
class ColdTierConfig:
    """Knobs of a worker's view of the shared tier (validated here)."""

    io_threads: int = 4
    max_queued: int = 256  # submit_* refuse (False) beyond this many unfinished requests
    known_capacity: int = 65536  # entries of the local cache of blocks known to exist
    max_block_bytes: int = 256 << 20
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self) -> None:
        for name in ("io_threads", "max_queued", "known_capacity", "max_block_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ColdTierConfig.{name} must be an int >= 1, got {v!r}")
        check_threads("ColdTierConfig.io_threads", self.io_threads)
        if self.max_block_bytes > MAX_BLOCK_BYTES:
            raise ValueError(
                f"ColdTierConfig.max_block_bytes must be at most {MAX_BLOCK_BYTES} (2**62: a read "
                f"asks the store for a byte range, 64-bit, holding the whole framed block), "
                f"got {self.max_block_bytes!r}")
        if not isinstance(self.breaker, BreakerConfig):
            raise ValueError(f"ColdTierConfig.breaker must be a BreakerConfig, got {type(self.breaker).__name__}")


@dataclass(frozen=True)
class SharedTierConfig:
    """Where a worker's shared block tier lives: ``s3://bucket/prefix`` plus ``storage_options``
    (the names of :func:`~tiering.coldtier.open_s3_store`), its :class:`ColdTierConfig`, and
    ``trust``: a :class:`~tiering.coldtier.TrustConfig` (the deployment secret, or the
    environment variable it is read from when the tier is opened), or the words
    ``"unauthenticated"``. Checked here with no I/O; the store is opened (and probed), and the
    secret resolved, by whoever builds from it."""

    url: str
    storage_options: Mapping[str, Any] | None = None
    tier: ColdTierConfig = field(default_factory=ColdTierConfig)
    trust: TrustConfig | str = field(default_factory=TrustConfig)

    def __post_init__(self) -> None:
        loc = parse_s3_url(self.url)
        if not loc.prefix:
            raise ValueError(f"SharedTierConfig.url {self.url!r} names a bucket root; give a prefix")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ValueError("SharedTierConfig.storage_options must be a mapping, got "
                             f"{type(self.storage_options).__name__}")
        check_storage_options(self.storage_options)
        # read-only all the way down: a nested mapping (client_kwargs) is copied too, so what
        # was checked here is what the store is opened with
        object.__setattr__(self, "storage_options", frozen_nested(self.storage_options))
        if not isinstance(self.tier, ColdTierConfig):
            raise ValueError(f"SharedTierConfig.tier must be a ColdTierConfig, got {type(self.tier).__name__}")
        if isinstance(self.trust, str):
            if self.trust not in TRUST_MODES:
                raise ValueError(f"SharedTierConfig.trust must be a TrustConfig or one of {TRUST_MODES},"
                                 f" got {self.trust!r}")
            object.__setattr__(self, "trust", TrustConfig(trust=self.trust))
        elif not isinstance(self.trust, TrustConfig):
            raise ValueError(f"SharedTierConfig.trust must be a TrustConfig, got {type(self.trust).__name__}")


class Got(NamedTuple):
    """What ``get_capped`` read: the object's bytes, or its size when over the cap,
    or the result of a get that failed (LOST when the object is missing, else
    UNAVAILABLE). Exactly one is set."""

    raw: bytes | None = None
    oversize: int | None = None
    failed: BlockResult | None = None


def get_capped(store: Any, path: str, op: str, key: bytes, cap: int,
               breaker: CircuitBreaker) -> Got:
    """Read the object at ``path``, at most ``cap + 1`` bytes of it, telling
    ``breaker`` whether the store answered."""
    import obstore

    try:
        got = obstore.get(store, path, options={"range": (0, cap + 1)})
        size = int(got.meta["size"])
        if size > cap:
            breaker.record_success()
            return Got(oversize=size)
        raw = got.bytes()
    except Exception as exc:
        fault = classify(exc)
        if fault is Fault.MISSING or fault is Fault.RANGE:
            breaker.record_success()
            return Got(failed=BlockResult(op, key, BlockStatus.LOST, reason="missing" if fault is
                                          Fault.MISSING else "refused: empty object"))
        breaker.record_failure()
        return Got(failed=BlockResult(op, key, BlockStatus.UNAVAILABLE, reason=short(exc)))
    breaker.record_success()
    return Got(raw=raw)


def _check_wait(what: str, timeout_s: object) -> float:
    """Every wait is bounded: ``timeout_s`` is a finite number (None or infinity would wait for
    ever, NaN is no bound); a negative one is an expired budget: do not wait."""
    return check_budget(f"BlockQueue.{what}: timeout_s", timeout_s)


def geometry_tag(geometry: bytes) -> str:
    """The path segment naming a geometry (16 hex digits of its BLAKE2b digest)."""
    return hashlib.blake2b(bytes(geometry), digest_size=8, person=b"tiering/geometry").hexdigest()


def block_path(root: bytes, geometry: bytes, key: bytes) -> str:
    return f"blocks/{bytes(root).hex()}/{geometry_tag(geometry)}/{bytes(key).hex()}"


class KnownBlocks:
    """A bounded LRU of block keys known to exist in the shared tier, with their object sizes."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"KnownBlocks capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._d: OrderedDict[bytes, int] = OrderedDict()

    def add(self, key: bytes, size: int) -> None:
        if not isinstance(key, bytes) or not key:
            raise ValueError(f"KnownBlocks.add: key must be non-empty bytes, got {key!r:.60}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"KnownBlocks.add: size of block {key.hex()} must be an int >= 1, got {size!r}")
        with self._lock:
            self._d[key] = size
            self._d.move_to_end(key)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._d.pop(key, None)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return True
            return False

    def size(self, key: bytes) -> int | None:
        """The object size recorded for ``key`` (from a listing or a write), without a use."""
        with self._lock:
            return self._d.get(key)

    def peek(self, key: bytes) -> bool:
        """Whether ``key`` is known, without counting it as a use (a read-only lookup)."""
        with self._lock:
            return key in self._d

    def __len__(self) -> int:
        with self._lock:
            return len(self._d)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._d)

    def check_integrity(self) -> None:
        with self._lock:
            if not (len(self._d) <= self.capacity):
                raise AssertionError(f"{len(self._d)} entries over capacity {self.capacity}")
            for k, s in self._d.items():
                if not (isinstance(k, bytes) and k):
                    raise AssertionError(f"known block key {k!r} is not non-empty bytes")
                if not (isinstance(s, int) and s > 0):
                    raise AssertionError(f"known block {k.hex()} has size {s!r}")


class SharedBlockStore:
    """Synchronous block I/O for one root and geometry; store faults come back as statuses.

    ``trust``: a :class:`TrustConfig`, :class:`MacKeys` or ``"unauthenticated"``; left out, the
    secret is read from ``TIERING_COLDTIER_SECRET`` and the store refuses (ValueError) to open
    without one. ``block_bytes``: the payload size every block has (a page), if fixed; it bounds
    reads more tightly than ``config.max_block_bytes``."""

    def __init__(self, store, root: bytes, geometry: bytes, *, trust: TrustConfig | MacKeys | str | None = None,
                 block_bytes: int | None = None, config: ColdTierConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, breaker: CircuitBreaker | None = None,
                 on_hit: Callable[[bytes], None] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        if not isinstance(root, bytes) or not isinstance(geometry, bytes):
            raise ValueError("SharedBlockStore root and geometry must be bytes")
        if not root or len(root) > MAX_ID_BYTES or len(geometry) > MAX_ID_BYTES:
            # an empty root names no prefix ("blocks//..."): every request would fail, and
            # open the breaker, as if the store were down
            raise ValueError(f"SharedBlockStore root must be 1-{MAX_ID_BYTES} bytes and geometry at"
                             f" most {MAX_ID_BYTES}, got {len(root)} and {len(geometry)}")
        if config is not None and not isinstance(config, ColdTierConfig):
            raise ValueError(f"SharedBlockStore config must be a ColdTierConfig, got {type(config).__name__}")
        if breaker is not None and not isinstance(breaker, CircuitBreaker):
            raise ValueError(f"SharedBlockStore breaker must be a CircuitBreaker, got {type(breaker).__name__}")
        cfg = config or ColdTierConfig()
        if block_bytes is not None and (not isinstance(block_bytes, int) or isinstance(block_bytes, bool)
                                        or not 1 <= block_bytes <= cfg.max_block_bytes):
            raise ValueError(f"SharedBlockStore block_bytes must be None or an int in 1..max_block_bytes"
                             f" ({cfg.max_block_bytes}), got {block_bytes!r}")
        self.keys = resolve_keys(trust, "SharedBlockStore", environ)  # last check: reads the secret
        self.store = store
        self.root = root
        self.geometry = geometry
        self.block_bytes = block_bytes
        self.config = cfg
        self.breaker = breaker or CircuitBreaker(self.config.breaker, clock=clock)
        self.known = KnownBlocks(self.config.known_capacity)
        self._on_hit = on_hit
        self._prefix = f"blocks/{root.hex()}/{geometry_tag(geometry)}/"
        self._refusals: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    @property
    def authenticated(self) -> bool:
        return self.keys is not None

    def path(self, key: bytes) -> str:
        """The object name of block ``key`` (relative to the store's prefix)."""
        return self._prefix + self._key(key).hex()

    def max_object_bytes(self, key: bytes) -> int:
        """The largest object block ``key`` may be: its frame around the largest payload."""
        return framed_size(key, self.root, self.geometry, self.block_bytes or self.config.max_block_bytes)

    def refusals(self) -> dict[str, int]:
        """Objects refused, by reason: ``mac`` (no valid MAC under our keys), ``foreign`` (another
        key, root, geometry or kind), ``damaged``, ``oversized`` (over the frame's maximum: not
        downloaded), ``size`` (a payload that is not ``block_bytes``), ``crc`` (a publish whose
        payload no longer matched its record)."""
        with self._count_lock:
            return dict(self._refusals)

    def _refuse(self, why: str, key: bytes, detail: str) -> None:
        with self._count_lock:
            self._refusals[why] += 1
        log.warning("shared block %s under %s refused (%s): %s", key.hex(), self._prefix, why, detail)

    # -- operations -------------------------------------------------------------------------
    def publish(self, key: bytes, payload, crc: int | None = None) -> BlockResult:
        """Write block ``key`` once. With ``crc`` (the crc32c the payload was recorded under),
        a payload that no longer matches it is not sent (status REFUSED)."""
        key = self._key(key)
        nbytes = memoryview(payload).nbytes
        if nbytes > self.config.max_block_bytes:
            raise ValueError(f"block {key.hex()} is {nbytes} bytes; max_block_bytes is {self.config.max_block_bytes}")
        if self.block_bytes is not None and nbytes != self.block_bytes:
            raise ValueError(f"block {key.hex()} is {nbytes} bytes; this store's blocks are {self.block_bytes}")
        if crc is not None and crc32c_value(payload) != crc:
            self._refuse("crc", key, "payload changed since it was recorded; not published")
            return BlockResult("publish", key, BlockStatus.REFUSED,
                               reason="refused: the payload no longer matches its recorded crc32c")
        data = frame(KIND_BLOCK, key, self.root, self.geometry, payload, keys=self.keys)
        if not self.breaker.allow():
            return BlockResult("publish", key, BlockStatus.SKIPPED, reason="store not answering")
        import obstore

        try:
            obstore.put(self.store, self.path(key), data, mode="create")
        except Exception as exc:
            fault = classify(exc)
            if fault is Fault.EXISTS or fault is Fault.PRECONDITION:
                self.breaker.record_success()
                self.known.add(key, len(data))
                return BlockResult("publish", key, BlockStatus.DUPLICATE, nbytes=0)
            self.breaker.record_failure()
            return BlockResult("publish", key, BlockStatus.UNAVAILABLE, reason=short(exc))
        self.breaker.record_success()
        self.known.add(key, len(data))
        return BlockResult("publish", key, BlockStatus.WRITTEN, nbytes=len(data))

    def fetch(self, key: bytes) -> BlockResult:
        key = self._key(key)
        if not self.breaker.allow():
            return BlockResult("fetch", key, BlockStatus.SKIPPED, reason="store not answering")
        path = self.path(key)
        cap = self.max_object_bytes(key)
        listed = self.known.size(key)
        if listed is not None and listed > cap:  # known too large: no request at all
            return self._lost_oversized(key, listed, cap)
        got = get_capped(self.store, path, "fetch", key, cap, self.breaker)
        if got.oversize is not None:
            return self._lost_oversized(key, got.oversize, cap)
        if got.failed is not None:
            if got.failed.status is BlockStatus.LOST:
                self.known.discard(key)
            return got.failed
        raw = got.raw
        try:
            payload = bytes(unframe(KIND_BLOCK, raw, key, self.root, self.geometry, keys=self.keys))
        except FrameRefused as exc:
            why = ("damaged" if isinstance(exc, FrameDamaged) else
                   "mac" if isinstance(exc, FrameUnauthenticated) else "foreign")
            lost = self._lost_refused(key, why, str(exc), len(raw))
            if isinstance(exc, FrameDamaged):
                self._remove_bad(path)  # ours, damaged: it can never become right
            return lost
        if self.block_bytes is not None and len(payload) != self.block_bytes:
            return self._lost_refused(key, "size", f"payload is {len(payload)} bytes, a block is"
                                      f" {self.block_bytes}", len(raw))
        self.known.add(key, len(raw))
        if self._on_hit is not None:
            self._on_hit(key)
        return BlockResult("fetch", key, BlockStatus.HIT, payload=payload, nbytes=len(raw))

    def _lost_refused(self, key: bytes, why: str, detail: str, nbytes: int) -> BlockResult:
        """A fetched object refused for reason ``why``: forgotten, counted, a LOST result."""
        self.known.discard(key)
        self._refuse(why, key, detail)
        return BlockResult("fetch", key, BlockStatus.LOST, nbytes=nbytes, reason=f"refused: {detail}")

    def delete(self, key: bytes) -> BlockResult:
        key = self._key(key)
        self.known.discard(key)
        if not self.breaker.allow():
            return BlockResult("delete", key, BlockStatus.SKIPPED, reason="store not answering")
        import obstore

        try:
            obstore.delete(self.store, self.path(key))
        except Exception as exc:
            if classify(exc) is not Fault.MISSING:
                self.breaker.record_failure()
                return BlockResult("delete", key, BlockStatus.UNAVAILABLE, reason=short(exc))
        self.breaker.record_success()
        return BlockResult("delete", key, BlockStatus.DELETED)

    def refresh_index(self, limit: int | None = None) -> int | None:
        """List this root's prefix into the known cache (newest last); how many were seen, or None
        when the store did not answer. Bounded by the cache's capacity unless ``limit`` is less
        (``limit=0``: list, but add nothing)."""
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise ValueError(f"refresh_index: limit must be None or an int >= 0, got {limit!r}")
        if not self.breaker.allow():
            return None
        import obstore

        seen: list[tuple[float, bytes, int]] = []
        try:
            for chunk in obstore.list(self.store, prefix=self._prefix, chunk_size=1000):
                for meta in chunk:
                    name = meta["path"].rsplit("/", 1)[-1]
                    try:
                        key = bytes.fromhex(name)
                    except ValueError:
                        continue
                    size = int(meta["size"])
                    if not key or size < framed_size(key, self.root, self.geometry, 0) \
                            or size > self.max_object_bytes(key):
                        continue  # too short or too long to be a block's frame: not one of ours
                    seen.append((meta["last_modified"].timestamp(), key, size))
        except Exception as exc:
            if classify(exc) is not Fault.MISSING:
                self.breaker.record_failure()
                return None
        self.breaker.record_success()
        seen.sort()
        cap = self.known.capacity if limit is None else min(self.known.capacity, limit)
        for _, key, size in (seen[-cap:] if cap else ()):
            self.known.add(key, size)
        return len(seen)

    def object_size(self, key: bytes, payload_len: int) -> int:
        return framed_size(self._key(key), self.root, self.geometry, payload_len)

    # -- helpers ----------------------------------------------------------------------------
    def _key(self, key) -> bytes:
        if not isinstance(key, bytes) or not key:
            raise ValueError(f"block key must be non-empty bytes, got {key!r:.60}")
        return key

    def _lost_oversized(self, key: bytes, size: int, cap: int) -> BlockResult:
        self.known.discard(key)
        self._refuse("oversized", key, f"object is {size} bytes, a frame at most {cap}")
        return BlockResult("fetch", key, BlockStatus.LOST,
                           reason=f"refused: object is {size} bytes, over the frame's maximum {cap}")

    def _remove_bad(self, path: str) -> None:
        """A damaged object of this block can never become right (objects are write-once):
        delete it so the block can be published again. Best effort."""
        import obstore

        try:
            obstore.delete(self.store, path)
        except Exception:
            pass

    def check_integrity(self) -> None:
        self.known.check_integrity()
        self.breaker.check_integrity()


class BlockQueue:
    """The step path's side: enqueue publishes and fetches, poll results; never waits on I/O."""

    def __init__(self, blocks: SharedBlockStore) -> None:
        if not isinstance(blocks, SharedBlockStore):
            raise ValueError(f"BlockQueue needs a SharedBlockStore, got {type(blocks).__name__}")
        self.blocks = blocks
        self._pool = ThreadPoolExecutor(blocks.config.io_threads, thread_name_prefix="coldtier")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending: dict[tuple[str, bytes], Future] = {}
        self._done: list[BlockResult] = []
        self._closed = False
        self._owner: str | None = None

    # -- ownership: poll hands every result to one reader -----------------------------------
    def claim(self, owner: str) -> None:
        """Make ``owner`` the one reader of this queue's results. ``poll`` hands each result to
        whoever calls it, so a second reader would take the first one's fetches: a claim by
        another name while one is held raises ValueError naming the holder. Idempotent."""
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"BlockQueue.claim: owner must be a non-empty str, got {owner!r}")
        with self._lock:
            if self._owner is not None and self._owner != owner:
                raise ValueError(f"BlockQueue is already used by {self._owner}; {owner} needs a"
                                 " queue of its own (give it the SharedBlockStore or a SharedTierConfig)")
            self._owner = owner

    def release(self, owner: str) -> None:
        """``owner`` stops reading this queue (a release by another name changes nothing)."""
        with self._lock:
            if self._owner == owner:
                self._owner = None

    @property
    def owner(self) -> str | None:
        with self._lock:
            return self._owner

    def submit_publish(self, key: bytes, payload, crc: int | None = None) -> bool:
        """Queue a publish; False (nothing queued) if the block is known to exist, the same
        request is queued, the queue is full, or the breaker is open. With ``crc`` the worker
        thread checks the copied payload against it before anything is sent."""
        key = self.blocks._key(key)
        if key in self.blocks.known:
            return False
        data = bytes(memoryview(payload).cast("B"))  # the caller may reuse its buffer
        return self._submit(("publish", key), lambda: self.blocks.publish(key, data, crc))

    def submit_fetch(self, key: bytes) -> bool:
        """Queue a reload of a block known to exist; False on a local miss (no network asked),
        a full queue or an open breaker."""
        key = self.blocks._key(key)
        if key not in self.blocks.known:
            return False
        return self._submit(("fetch", key), lambda: self.blocks.fetch(key))

    def submit_refresh(self) -> bool:
        """Queue a listing of the root's prefix into the known cache (run it on a timer); its
        result has op "refresh", status LISTED (nbytes = objects seen) or UNAVAILABLE."""
        def run() -> BlockResult:
            n = self.blocks.refresh_index()
            if n is None:
                return BlockResult("refresh", b"", BlockStatus.UNAVAILABLE, reason="list failed")
            return BlockResult("refresh", b"", BlockStatus.LISTED, nbytes=n)

        return self._submit(("refresh", b""), run)

    def submit_delete(self, key: bytes) -> bool:
        key = self.blocks._key(key)
        return self._submit(("delete", key), lambda: self.blocks.delete(key))

    def _submit(self, tag: tuple[str, bytes], fn) -> bool:
        with self._lock:
            if self._closed:
                return False  # refused like a full queue: a caller's step path never raises
            if tag in self._pending or len(self._pending) >= self.blocks.config.max_queued:
                return False
            if not self.blocks.breaker.would_allow():
                return False
            fut = self._pool.submit(fn)
            self._pending[tag] = fut
        fut.add_done_callback(lambda f, tag=tag: self._finish(tag, f))
        return True

    def _finish(self, tag: tuple[str, bytes], fut: Future) -> None:
        try:
            res = fut.result()
        except Exception as exc:  # a bug, not a store fault: report it as a lost request
            res = BlockResult(tag[0], tag[1], BlockStatus.UNAVAILABLE, reason=f"internal: {short(exc)}")
        with self._lock:
            self._pending.pop(tag, None)
            self._done.append(res)
            self._changed.notify_all()

    def poll(self) -> list[BlockResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def outstanding(self, op: str, key: bytes) -> bool:
        """Whether a request (op, key) is queued, running, or finished but not yet polled."""
        with self._lock:
            if (op, key) in self._pending:
                return True
            return any(r.op == op and r.key == key for r in self._done)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (bounded by ``timeout_s``) until nothing is queued or running; results stay for
        ``poll``. True when idle. For ``synchronize``-style calls, never the step path."""
        timeout_s = _check_wait("wait_idle", timeout_s)
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending, timeout=timeout_s)

    def drain(self, timeout_s: float) -> list[BlockResult]:
        """Wait (bounded by ``timeout_s``) until nothing is queued, then poll. For tests,
        shutdown and benchmarks; the step path uses poll."""
        timeout_s = _check_wait("drain", timeout_s)
        with self._changed:
            self._changed.wait_for(lambda: not self._pending, timeout=timeout_s)
        return self.poll()

    def close(self, timeout_s: float = 30.0) -> list[BlockResult]:
        _check_wait("close", timeout_s)
        res = self.drain(timeout_s)
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        return res

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        with self._lock:
            if not (len(self._pending) <= self.blocks.config.max_queued):
                raise AssertionError(
                    f"{len(self._pending)} queued operations, over max_queued "
                    f"{self.blocks.config.max_queued}"
                )


