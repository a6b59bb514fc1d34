"""Space reclaim for the shared tier: a cap on its bytes, enforced by one elected sweeper.

The choice: eviction of the least recently used shared blocks by a sweeper that one worker runs
at a time (elected by holding the lease ``sweeper/LEASE``; any worker may run
:meth:`Sweeper.sweep_once` on a timer, and only the holder does anything). Per-worker quotas
were rejected because a block is shared: whoever wrote it first would be charged for a block
every worker reads, and a dead worker's blocks would never be reclaimed.

Recency: the later of an object's last-modified time and the latest hit reported for it.
Workers report hits by writing small write-once objects ``hits/<owner>/<seq>-<token>`` (a
:class:`HitLog` flushed on a timer, at most ``MAX_HITS_PER_REPORT`` hits an object: no shared
object is ever overwritten); the sweeper reads and deletes them. A report is read with a
ranged GET of at most ``MAX_REPORT_BYTES`` (a larger one is dropped unread); a reported time is
clamped to the report object's own last-modified time (the store's clock: no hit can be later
than the report that carries it), and the table keeps only blocks the last listing found, so
it never holds more entries than the tier has blocks. Each pass lists ``blocks/``, and if the total is over ``cap_bytes`` deletes
the least recently used blocks until the total is at most ``low_fraction * cap_bytes``.

What holds: after each pass the shared tier is under the cap; between passes it can exceed the
cap by what the workers write in one interval (``interval x write rate``), so size the cap
with that margin. A deleted block that a worker still believed present turns its next fetch
into a miss (status LOST, reason "missing"), never into wrong bytes.
"""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tiering.core.validate import check_int, check_number

from ._io import Fault, classify
from .blocks import geometry_tag
from .errors import ColdTierUnavailable, LeaseHeld
from .lease import Lease, LeaseConfig

__all__ = ["MAX_HITS_PER_REPORT", "MAX_REPORT_BYTES", "HitLog", "SweepResult", "Sweeper",
           "SweeperConfig"]

MAX_HITS_PER_REPORT = 8192  # about 100 bytes of JSON each
MAX_REPORT_BYTES = 2 << 20


@dataclass(frozen=True)
class SweeperConfig:
    cap_bytes: int
    low_fraction: float = 0.9

    def __post_init__(self) -> None:
        check_int("SweeperConfig", "cap_bytes", self.cap_bytes, 1)
        check_number("SweeperConfig", "low_fraction", self.low_fraction, maximum=1)


class SweepResult(NamedTuple):
    total_before: int
    total_after: int
    deleted: int
    bytes_deleted: int
    hit_reports: int


class HitLog:
    """A worker's record of shared-block hits, flushed as one write-once object per flush."""

    def __init__(self, owner: str, *, token_factory: Callable[[], str] = lambda: secrets.token_hex(4)):
        if not isinstance(owner, str) or not owner or "/" in owner:
            raise ValueError(f"HitLog owner must be a non-empty str without '/', got {owner!r}")
        self.owner = owner
        self._token = token_factory
        self._lock = threading.Lock()
        self._hits: dict[str, float] = {}
        self._seq = 0

    def record(self, root: bytes, geometry: bytes, key: bytes, at: float) -> None:
        if not isinstance(root, bytes) or not isinstance(geometry, bytes) \
                or not isinstance(key, bytes) or not key:
            raise ValueError(f"HitLog.record: root, geometry and key must be bytes (a non-empty key),"
                             f" got {type(root).__name__}, {type(geometry).__name__} and {key!r:.40}")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise ValueError(f"HitLog.record: at must be a finite time, got {at!r}")
        with self._lock:
            self._hits[f"{root.hex()}/{geometry_tag(geometry)}/{key.hex()}"] = at

    def hook(self, root: bytes, geometry: bytes,
             clock: Callable[[], float] = time.time) -> Callable[[bytes], None]:
        """An ``on_hit`` callback for a SharedBlockStore of ``root`` and ``geometry``."""
        return lambda key: self.record(root, geometry, key, clock())

    def flush(self, store) -> bool:
        """Write the hits seen since the last flush; False (hits kept) if the store failed."""
        import obstore

        with self._lock:
            if not self._hits:
                return True
            hits, self._hits = self._hits, {}
        items = list(hits.items())
        for i in range(0, len(items), MAX_HITS_PER_REPORT):
            part = dict(items[i : i + MAX_HITS_PER_REPORT])
            with self._lock:
                self._seq += 1
                name = f"hits/{self.owner}/{self._seq:012d}-{self._token()}"
            try:
                obstore.put(store, name, json.dumps(part).encode(), mode="create")
            except Exception:
                with self._lock:
                    for k, t in items[i:]:
                        self._hits[k] = max(t, self._hits.get(k, t))
                return False
        return True


class Sweeper:
    def __init__(self, store, owner: str, config: SweeperConfig, *,
                 lease_config: LeaseConfig | None = None, clock: Callable[[], float] = time.time):
        if not isinstance(config, SweeperConfig):
            raise ValueError(f"Sweeper config must be a SweeperConfig, got {type(config).__name__}")
        self.store = store
        self.config = config
        self._clock = clock
        self.lease = Lease(store, "sweeper/LEASE", owner, config=lease_config, clock=clock)
        self._recency: dict[str, float] = {}

    def leader(self) -> bool:
        """Hold (or renew, or take over) the sweeper lease; False if another worker holds it."""
        if self.lease.info is not None and self.lease.renew():
            return True
        try:
            self.lease.acquire()
            return True
        except (LeaseHeld, ColdTierUnavailable):
            return False

    def sweep_once(self) -> SweepResult | None:
        """One pass if this worker is the sweeper; None if it is not or the store failed."""
        if not self.leader():
            return None
        import obstore

        try:
            reports = self._read_hits(obstore)
            objects: list[tuple[float, str, int]] = []
            listed: dict[str, float] = {}
            for chunk in obstore.list(self.store, prefix="blocks/", chunk_size=1000):
                for m in chunk:
                    name = m["path"]
                    rel = name[len("blocks/"):] if name.startswith("blocks/") else name
                    at = max(m["last_modified"].timestamp(), self._recency.get(rel, 0.0))
                    if rel in self._recency:
                        listed[rel] = self._recency[rel]
                    objects.append((at, name, int(m["size"])))
            self._recency = listed  # what the listing did not find is forgotten
        except Exception as exc:
            if classify(exc) is Fault.TRANSIENT:
                return None
            raise
        total = sum(size for _, _, size in objects)
        before = total
        deleted = freed = 0
        if total > self.config.cap_bytes:
            target = int(self.config.cap_bytes * self.config.low_fraction)
            objects.sort()
            victims = []
            for _at, name, size in objects:
                if total <= target:
                    break
                victims.append((name, size))
                total -= size
            for i in range(0, len(victims), 500):
                batch = victims[i : i + 500]
                try:
                    obstore.delete(self.store, [name for name, _ in batch])
                except Exception:
                    break  # the rest stay; the record counts only the batches that went
                deleted += len(batch)
                freed += sum(size for _, size in batch)
                for name, _ in batch:
                    self._recency.pop(name[len("blocks/"):], None)
            total = before - freed
        return SweepResult(before, total, deleted, freed, reports)

    def _read_hits(self, obstore) -> int:
        reports = [(m["path"], int(m["size"]), m["last_modified"].timestamp())
                   for chunk in obstore.list(self.store, prefix="hits/", chunk_size=1000)
                   for m in chunk]
        for name, size, written in reports:
            hits: object = {}
            if 0 < size <= MAX_REPORT_BYTES:
                try:
                    got = obstore.get(self.store, name, options={"range": (0, MAX_REPORT_BYTES + 1)})
                    if int(got.meta["size"]) <= MAX_REPORT_BYTES:
                        hits = json.loads(bytes(got.bytes()))
                except Exception as exc:
                    if classify(exc) in (Fault.MISSING, Fault.RANGE):
                        continue
                    if not isinstance(exc, ValueError):
                        raise
            if not isinstance(hits, dict):
                hits = {}  # a damaged or foreign report: nothing to learn from it
            for k, t in hits.items():
                if isinstance(k, str) and isinstance(t, (int, float)) and not isinstance(t, bool) \
                        and math.isfinite(t):
                    t = min(float(t), written)  # no hit is later than the report holding it
                    self._recency[k] = max(t, self._recency.get(k, 0.0))
        names = [name for name, _, _ in reports]
        for i in range(0, len(names), 500):
            obstore.delete(self.store, names[i : i + 500])
        return len(names)

    def close(self) -> None:
        self.lease.release()
