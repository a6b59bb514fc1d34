"""The engine-independent part of the vLLM backend: config, block table, policies,
the shared host slab, the scheduler-side manager and the worker-side mover.

Nothing here imports vLLM, so all of it is unit-tested in the project's own
environment; ``_spec`` wraps it in vLLM's classes.

Processes and ownership. vLLM runs the manager in its scheduler process and one
worker per rank in other processes. The host tier is a slab of ``num_slots``
page slots per rank, kept in a shared memory file that both sides map
(``HostSlab``). The manager owns every decision and every piece of book-keeping:
the block table (key -> host slot and/or disk extent, state, pins), the host
slot pool (``tiering.core.pools.PagePool``), the disk tier (``DiskPageStore``) and the
cascade between them. The worker only copies bytes between vLLM's per-layer KV
tensors and the slab slots that the manager named in a load or store spec. The
manager itself moves host <-> disk (demotion and promotion) on its own I/O
threads, reading or writing only slots that no worker job can touch at that
time (a slot being demoted is pinned; a slot being promoted is not yet visible).

A block is loadable only when its bytes are in a host slot and known good: a
disk hit is promoted into the host tier first (its chunk crc32c checked by the
disk store) while lookup answers "pending"; a promotion that fails its check
drops the block, and lookup answers "miss", so vLLM recomputes it.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import torch

from tiering.core.executor import OFFLOAD, RELOAD, WRITE, PriorityExecutor
from tiering.core.pools import PagePool
from tiering.core.transfer import StreamSet, coalesce, copy_runs
from tiering.disk import DiskConfig, DiskIOError, DiskPageStore
from tiering.disk.ledger import DiskExtent
from tiering.errors import TableIntegrityError

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- config


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


OUR_KEYS = frozenset(
    {
        "host_bytes",
        "disk_path",
        "disk_bytes",
        "policy",
        "host_dir",
        "state_path",
        "demote_headroom",
        "io_threads",
        "copy_threads",
        "test_corrupt_loads",
    }
)


@dataclass(frozen=True)
class TieredConfig:
    """Our part of ``kv_connector_extra_config``; validated on construction.

    ``host_bytes``: bytes of host slots per rank (required, > 0). ``disk_path`` and
    ``disk_bytes``: the disk tier (both or neither; host only without them).
    ``policy``: a registered block policy name (``POLICIES``). ``host_dir``: where
    the shared slab files live (default /dev/shm when present). ``state_path``: a
    JSON file the manager rewrites (off the step path) with its counters and disk
    table, for tests and monitoring. ``demote_headroom``: host slots the manager
    keeps free or backed by disk by writing cold blocks down early (default a
    quarter of the slots). ``io_threads``/``copy_threads``: threads for disk I/O in
    the scheduler and for copies in each worker. ``test_corrupt_loads``: TEST ONLY,
    the worker flips bytes of every block it loads (a negative control).
    """

    host_bytes: int
    disk_path: str | None = None
    disk_bytes: int | None = None
    policy: str = "lru"
    host_dir: str | None = None
    state_path: str | None = None
    demote_headroom: int | None = None
    io_threads: int = 2
    copy_threads: int = 2
    test_corrupt_loads: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.host_bytes) or self.host_bytes <= 0:
            raise ValueError(
                f"kv_connector_extra_config.host_bytes must be a positive int, got {self.host_bytes!r}"
            )
        if (self.disk_path is None) != (self.disk_bytes is None):
            raise ValueError(
                "kv_connector_extra_config.disk_path and disk_bytes must be given together "
                f"(got disk_path={self.disk_path!r}, disk_bytes={self.disk_bytes!r})"
            )
        if self.disk_path is not None and (
            not isinstance(self.disk_path, str) or not self.disk_path
        ):
            raise ValueError(
                f"kv_connector_extra_config.disk_path must be a non-empty str, got {self.disk_path!r}"
            )
        if self.disk_bytes is not None and (not _is_int(self.disk_bytes) or self.disk_bytes <= 0):
            raise ValueError(
                f"kv_connector_extra_config.disk_bytes must be a positive int, got {self.disk_bytes!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(
                f"kv_connector_extra_config.policy must be one of {sorted(POLICIES)}, got {self.policy!r}"
            )
        for name in ("host_dir", "state_path"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"kv_connector_extra_config.{name} must be a non-empty str, got {v!r}")
        if self.demote_headroom is not None and (
            not _is_int(self.demote_headroom) or self.demote_headroom < 0
        ):
            raise ValueError(
                "kv_connector_extra_config.demote_headroom must be an int >= 0, "
                f"got {self.demote_headroom!r}"
            )
        for name in ("io_threads", "copy_threads"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"kv_connector_extra_config.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.test_corrupt_loads, bool):
            raise ValueError(
                "kv_connector_extra_config.test_corrupt_loads must be a bool, "
                f"got {self.test_corrupt_loads!r}"
            )

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> TieredConfig:
        """Ours from vLLM's extra config (other keys belong to vLLM and are left alone)."""
        if not isinstance(extra, Mapping):
            raise ValueError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
        if "host_bytes" not in extra:
            raise ValueError("kv_connector_extra_config.host_bytes is required (bytes of host slots)")
        return cls(**{k: extra[k] for k in OUR_KEYS if k in extra})


# ----------------------------------------------------------------------------- policies


class BlockPolicy:
    """Victim choice for one tier. The table calls the hooks; ``victims`` yields keys
    coldest first (the caller skips ineligible ones). Pure book-keeping, no I/O."""

    def on_insert(self, key: bytes) -> None:
        raise NotImplementedError

    def on_access(self, key: bytes) -> None:
        raise NotImplementedError

    def on_evict(self, key: bytes) -> None:
        raise NotImplementedError

    def victims(self) -> Iterator[bytes]:
        """Keys coldest first, lazily: a caller that changes the policy while walking
        it must take a list first."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class LruPolicy(BlockPolicy):
    """Least recently inserted or accessed first."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes) -> None:
        if key in self._order:
            raise ValueError(f"lru policy: key {key.hex()} inserted twice")
        self._order[key] = None

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_evict(self, key: bytes) -> None:
        if self._order.pop(key, 0) is not None:
            raise ValueError(f"lru policy: evicting unknown key {key.hex()}")

    def victims(self) -> Iterator[bytes]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class FifoPolicy(LruPolicy):
    """Oldest inserted first; accesses do not reorder."""

    def on_access(self, key: bytes) -> None:
        return


POLICIES: dict[str, Callable[[], BlockPolicy]] = {"lru": LruPolicy, "fifo": FifoPolicy}


# ----------------------------------------------------------------------------- host slab


def default_host_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def slab_path(host_dir: str, engine_id: str, rank: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(engine_id))
    return os.path.join(host_dir, f"tiering-vllm-{safe}-r{rank}.slab")


class HostSlab:
    """``num_slots`` slots of ``slot_bytes`` in a shared file, mapped as a uint8 tensor.

    Both the manager (scheduler process) and a worker open the same file; whichever
    comes first creates it at its full size (``created``), and the second one removes
    its name as soon as it has mapped it (``unlink_if_second``): both mappings stay,
    and no file is left behind however the processes end. Bytes of a slot are only
    read after the manager has seen them written, so stale contents are never served.
    """

    def __init__(self, path: str, num_slots: int, slot_bytes: int) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"host slab {path}: num_slots and slot_bytes must be >= 1")
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        size = num_slots * slot_bytes
        d = os.path.dirname(path) or "."
        st = os.statvfs(d)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            have = os.fstat(fd).st_size
            if have not in (0, size):
                raise ValueError(
                    f"host slab {path} exists with {have} bytes, expected {size} "
                    "(another engine with the same id and a different host_bytes?)"
                )
            self.created = have == 0
            if have == 0:
                if st.f_bavail * st.f_frsize < size:
                    raise ValueError(
                        f"host_bytes: {size} bytes do not fit in {d} "
                        f"({st.f_bavail * st.f_frsize} bytes free); lower host_bytes or set host_dir"
                    )
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8).view(num_slots, slot_bytes)

    def unlink_if_second(self) -> None:
        """Remove the file's name if the other side created it (it has mapped it already)."""
        if not self.created:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self, unlink: bool = False) -> None:
        self.tensor = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# ----------------------------------------------------------------------------- block table


class HostState(Enum):
    NONE = "none"
    STORING = "storing"  # slot reserved, a worker job is writing it
    PROMOTING = "promoting"  # slot reserved, the manager is reading it from disk
    READY = "ready"


class DiskState(Enum):
    NONE = "none"
    WRITING = "writing"  # demotion in flight (host slot pinned)
    READY = "ready"


@dataclass
class Entry:
    key: bytes
    host: HostState = HostState.NONE
    slot: int | None = None
    disk: DiskState = DiskState.NONE
    extent: DiskExtent | None = None
    load_pins: int = 0
    from_disk: bool = False  # its host copy was promoted from disk


class Lookup(Enum):
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"


class StoreDecision(NamedTuple):
    keys_to_store: list[bytes]
    slots: list[int]
    evicted: list[bytes]  # keys that are gone from every tier


@dataclass
class Counters:
    lookups: int = 0
    host_hits: int = 0
    pending_answers: int = 0
    stores_started: int = 0
    stores_completed: int = 0
    stores_failed: int = 0
    stores_refused: int = 0
    loads_from_host: int = 0  # blocks handed to vLLM whose bytes were stored into host
    loads_from_disk: int = 0  # blocks handed to vLLM whose bytes were promoted from disk
    promotions_started: int = 0
    promotions_ok: int = 0
    promotions_failed: int = 0  # failed their check or I/O: dropped, recomputed
    promotions_deferred: int = 0  # no host slot could be freed yet: lookup said pending
    demotions_started: int = 0
    demotions_ok: int = 0
    demotions_failed: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    dropped: int = 0  # blocks gone from every tier


class Event(NamedTuple):
    keys: tuple[bytes, ...]
    tier: str  # "host" or "disk"
    removed: bool


class TieredBlockManager:
    """The scheduler-side manager on our block table (engine independent).

    ``host`` is a list of per-rank slabs (the manager reads and writes whole
    pages across ranks when it moves blocks to and from disk). ``disk`` is
    optional. Not thread-safe: all calls come from vLLM's scheduler thread; disk
    I/O runs on ``executor`` threads and is reaped on that thread.
    """

    def __init__(
        self,
        cfg: TieredConfig,
        slabs: Sequence[HostSlab],
        disk: DiskPageStore | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        executor: PriorityExecutor | None = None,
        disk_root: str | None = None,
    ) -> None:
        if not slabs:
            raise ValueError("TieredBlockManager: at least one host slab is needed")
        n = slabs[0].num_slots
        if any(s.num_slots != n for s in slabs):
            raise ValueError("TieredBlockManager: every rank's slab must have the same slots")
        self.cfg = cfg
        self.slabs = list(slabs)
        self.num_slots = n
        self.page_bytes = sum(s.slot_bytes for s in slabs)
        self.pool = PagePool("host", n, self.page_bytes)
        self.disk = disk
        if disk is not None and disk.page_bytes != self.page_bytes:
            raise ValueError(
                f"disk page {disk.page_bytes} B != host page {self.page_bytes} B (all ranks)"
            )
        self.disk_root = disk_root
        self.table: dict[bytes, Entry] = {}
        self.host_policy = POLICIES[cfg.policy]()
        self.disk_policy = POLICIES[cfg.policy]()
        self.headroom = (
            cfg.demote_headroom if cfg.demote_headroom is not None else max(1, n // 4)
        )
        self.counters = Counters()
        self._reported = Counters()
        self.events: list[Event] = []
        self._clock = clock
        self._own_executor = executor is None
        self._io = executor or PriorityExecutor(cfg.io_threads, "tiering-vllm-io")
        self._promoting: dict[bytes, Future] = {}
        self._demoting: dict[bytes, Future] = {}
        self._dirty = True
        self._dump: Future | None = None
        self._closed = False

    # ------------------------------------------------------------------ helpers

    def _slot_view(self, slot: int) -> list[torch.Tensor]:
        return [s.tensor[slot] for s in self.slabs]

    def _owner(self, key: bytes) -> str:
        return "k" + key.hex()

    def _host_evictable(self, e: Entry) -> bool:
        return e.host is HostState.READY and e.load_pins == 0 and e.disk is not DiskState.WRITING

    def _disk_evictable(self, e: Entry) -> bool:
        return e.disk is DiskState.READY and e.host is not HostState.PROMOTING

    def _drop_host(self, e: Entry) -> None:
        assert e.slot is not None
        self.pool.release(e.key, [e.slot])
        if e.host is HostState.READY:
            self.host_policy.on_evict(e.key)
            self.events.append(Event((e.key,), "host", True))
        e.host, e.slot, e.from_disk = HostState.NONE, None, False

    def _drop_disk(self, e: Entry) -> None:
        assert self.disk is not None and e.extent is not None
        self.disk.release(e.extent)
        if e.disk is DiskState.READY:
            self.disk_policy.on_evict(e.key)
            self.events.append(Event((e.key,), "disk", True))
        e.disk, e.extent = DiskState.NONE, None

    def _forget_if_empty(self, e: Entry, evicted: list[bytes] | None = None) -> None:
        if e.host is HostState.NONE and e.disk is DiskState.NONE:
            del self.table[e.key]
            self.counters.dropped += 1
            if evicted is not None:
                evicted.append(e.key)

    def _free_host_slots(self, need: int, evicted: list[bytes], protect: set[bytes]) -> bool:
        """Make ``need`` host slots free, evicting cold blocks; all or nothing."""
        short = need - self.pool.free_pages
        if short <= 0:
            return True
        chosen: list[Entry] = []
        clean_first = sorted(
            (self.table[k] for k in self.host_policy.victims()),
            key=lambda e: e.disk is not DiskState.READY,
        )  # stable: policy order within "backed by disk" and "not backed"
        for e in clean_first:
            if e.key not in protect and self._host_evictable(e):
                chosen.append(e)
                if len(chosen) == short:
                    break
        if len(chosen) < short:
            return False
        for e in chosen:
            self._drop_host(e)
            self.counters.host_evictions += 1
            self._forget_if_empty(e, evicted)
        return True

    def _reserve_disk(self, key: bytes, evicted: list[bytes]) -> DiskExtent | None:
        assert self.disk is not None
        ext = self.disk.reserve(self._owner(key), 1)
        if ext is not None:
            return ext
        for k in list(self.disk_policy.victims()):
            e = self.table[k]
            if k != key and self._disk_evictable(e):
                self._drop_disk(e)
                self.counters.disk_evictions += 1
                self._forget_if_empty(e, evicted)
                ext = self.disk.reserve(self._owner(key), 1)
                if ext is not None:
                    return ext
        return None

    # ------------------------------------------------------------------ reaping I/O

    def reap(self) -> None:
        """Settle finished promotions and demotions (non-blocking)."""
        for key, fut in list(self._promoting.items()):
            if not fut.done():
                continue
            del self._promoting[key]
            e = self.table[key]
            self._dirty = True
            if fut.exception() is None:
                e.host, e.from_disk = HostState.READY, True
                self.host_policy.on_insert(key)
                self.events.append(Event((key,), "host", False))
                self.counters.promotions_ok += 1
            else:
                log.warning("tiering: block %s failed promotion (%s): dropped, will be recomputed",
                            key.hex(), fut.exception())
                self.counters.promotions_failed += 1
                self.pool.release(key, [e.slot])
                e.host, e.slot = HostState.NONE, None
                self._drop_disk(e)
                self._forget_if_empty(e)
        for key, fut in list(self._demoting.items()):
            if not fut.done():
                continue
            del self._demoting[key]
            e = self.table[key]
            self._dirty = True
            if fut.exception() is None:
                e.disk = DiskState.READY
                self.disk_policy.on_insert(key)
                self.events.append(Event((key,), "disk", False))
                self.counters.demotions_ok += 1
            else:
                log.warning("tiering: demotion of %s failed: %s", key.hex(), fut.exception())
                self.counters.demotions_failed += 1
                e.disk = DiskState.NONE
                ext, e.extent = e.extent, None
                try:
                    assert self.disk is not None and ext is not None
                    self.disk.release(ext)
                except (ValueError, DiskIOError) as exc:  # stays quarantined in the ledger
                    log.warning("tiering: releasing failed extent: %s", exc)

    # ------------------------------------------------------------------ vLLM-facing operations

    def lookup(self, key: bytes) -> Lookup:
        self.reap()
        self.counters.lookups += 1
        e = self.table.get(key)
        if e is None:
            return Lookup.MISS
        if e.host is HostState.READY:
            # A hit is about to be loaded: make it the most recent, so that promotions
            # started for the same request evict other blocks first.
            self.host_policy.on_access(key)
            self.counters.host_hits += 1
            return Lookup.HIT
        if e.host in (HostState.STORING, HostState.PROMOTING):
            self.counters.pending_answers += 1
            return Lookup.PENDING
        if e.disk is DiskState.READY:
            # Without a host slot now, every slot is held by something that ends on its
            # own (a store, a promotion, a load, a demotion): ask vLLM to come back.
            if not self._start_promotion(e):
                self.counters.promotions_deferred += 1
            self.counters.pending_answers += 1
            return Lookup.PENDING
        return Lookup.MISS

    def _start_promotion(self, e: Entry) -> bool:
        evicted: list[bytes] = []
        if not self._free_host_slots(1, evicted, {e.key}):
            return False
        slots = self.pool.allocate(e.key, 1)
        assert slots is not None
        e.slot, e.host = slots[0], HostState.PROMOTING
        self.counters.promotions_started += 1
        self._dirty = True
        self._promoting[e.key] = self._io.submit(RELOAD, self._read_page, e.extent, e.slot)
        return True

    def _read_page(self, extent: DiskExtent, slot: int) -> None:
        assert self.disk is not None
        if len(self.slabs) == 1:
            self.disk.read(extent, self.slabs[0].tensor[slot : slot + 1])
            return
        buf = torch.empty((1, self.page_bytes), dtype=torch.uint8)
        self.disk.read(extent, buf)  # checked before any byte reaches a slot
        off = 0
        for s in self.slabs:
            s.tensor[slot].copy_(buf[0, off : off + s.slot_bytes])
            off += s.slot_bytes

    def _write_page(self, extent: DiskExtent, slot: int) -> None:
        assert self.disk is not None
        if len(self.slabs) == 1:
            self.disk.write(extent, self.slabs[0].tensor[slot : slot + 1])
            return
        self.disk.write(extent, torch.cat(self._slot_view(slot)).view(1, -1))

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        slots = []
        for k in keys:
            e = self.table.get(k)
            if e is None or e.host is not HostState.READY:
                raise ValueError(
                    f"prepare_load: block {k.hex()} is not loadable from host "
                    f"(state {None if e is None else e.host.value})"
                )
        for k in keys:
            e = self.table[k]
            e.load_pins += 1
            self.host_policy.on_access(k)
            if e.disk is DiskState.READY:
                self.disk_policy.on_access(k)
            if e.from_disk:
                self.counters.loads_from_disk += 1
            else:
                self.counters.loads_from_host += 1
            slots.append(e.slot)
        self._dirty = True
        return slots

    def complete_load(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            e = self.table.get(k)
            if e is None or e.load_pins <= 0:
                raise ValueError(f"complete_load: block {k.hex()} has no load in flight")
            e.load_pins -= 1

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            e = self.table.get(k)
            if e is None:
                continue
            if e.host is HostState.READY:
                self.host_policy.on_access(k)
            if e.disk is DiskState.READY:
                self.disk_policy.on_access(k)

    def prepare_store(self, keys: Sequence[bytes]) -> StoreDecision | None:
        """Host slots for the keys not yet held; None (nothing changed) if they do not fit."""
        self.reap()
        seen: set[bytes] = set()
        new = []
        for k in keys:
            if k not in self.table and k not in seen:
                new.append(k)
                seen.add(k)
        evicted: list[bytes] = []
        if not self._free_host_slots(len(new), evicted, set(keys)):
            self.counters.stores_refused += 1
            return None
        slots = self.pool.allocate(("batch",), len(new)) if new else []
        assert slots is not None
        for k, s in zip(new, slots, strict=True):
            self.pool.transfer_ownership(("batch",), k, [s])
            self.table[k] = Entry(k, HostState.STORING, s)
        self.counters.stores_started += len(new)
        self._dirty = True
        return StoreDecision(new, slots, evicted)

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        stored = []
        for k in keys:
            e = self.table.get(k)
            if e is None or e.host is not HostState.STORING:
                continue  # already complete (keys repeat across jobs) or never ours
            if success:
                e.host = HostState.READY
                self.host_policy.on_insert(k)
                stored.append(k)
                self.counters.stores_completed += 1
            else:
                self.pool.release(k, [e.slot])
                e.host, e.slot = HostState.NONE, None
                self.counters.stores_failed += 1
                self._forget_if_empty(e)
        if stored:
            self.events.append(Event(tuple(stored), "host", False))
        self._dirty = True
        self.maintain()

    def maintain(self) -> None:
        """Reap I/O, write cold host blocks down to disk to keep headroom, dump state."""
        self.reap()
        if self.disk is not None:
            self._demote_for_headroom()
        if self.cfg.state_path is not None and self._dirty and (
            self._dump is None or self._dump.done()
        ):
            self._dirty = False
            self._dump = self._io.submit(WRITE, _write_json, self.cfg.state_path, self.state())

    def _demote_for_headroom(self) -> None:
        if self.pool.free_pages >= self.headroom:
            return  # the common case costs nothing per step
        clean = sum(
            1
            for e in self.table.values()
            if e.host is HostState.READY and e.disk is not DiskState.NONE
        )
        spare = self.pool.free_pages + clean
        for k in list(self.host_policy.victims()):
            if spare >= self.headroom or len(self._demoting) >= 4 * self.cfg.io_threads:
                return
            e = self.table[k]
            if e.disk is not DiskState.NONE or not self._host_evictable(e):
                continue
            evicted: list[bytes] = []
            ext = self._reserve_disk(k, evicted)
            if ext is None:
                return
            e.extent, e.disk = ext, DiskState.WRITING
            self.counters.demotions_started += 1
            self._demoting[k] = self._io.submit(OFFLOAD, self._write_page, ext, e.slot)
            spare += 1
            self._dirty = True

    def has_pending_work(self) -> bool:
        return bool(self._promoting or self._demoting) or (
            self.cfg.state_path is not None
            and (self._dirty or (self._dump is not None and not self._dump.done()))
        )

    def take_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def stats_delta(self) -> dict[str, int]:
        """Counter increases since the last call (for vLLM's stats hook)."""
        now = self.counters
        out = {}
        for f in now.__dataclass_fields__:
            d = getattr(now, f) - getattr(self._reported, f)
            if d:
                out[f] = d
        self._reported = Counters(**now.__dict__)
        return out

    def state(self) -> dict[str, Any]:
        disk_blocks = []
        direct = getattr(getattr(self.disk, "_backend", None), "direct", None)
        for e in self.table.values():
            if e.disk is DiskState.READY and e.extent is not None:
                chunk = e.extent.chunks[0]
                off = direct.payload_offset(chunk) if direct is not None else None
                disk_blocks.append(
                    {"key": e.key.hex(), "chunk": chunk, "payload_offset": off,
                     "on_host": e.host is HostState.READY}
                )
        return {
            "time": self._clock(),
            "counters": dict(self.counters.__dict__),
            "host_slots": self.num_slots,
            "host_used": self.pool.used_pages,
            "page_bytes": self.page_bytes,
            "disk_root": self.disk_root,
            "disk_blocks": disk_blocks,
        }

    def reset(self) -> None:
        """Forget every block that no job uses (vLLM's reset_cache)."""
        self.reap()
        for e in list(self.table.values()):
            if e.key in self._promoting or e.key in self._demoting:
                continue
            if e.host is HostState.READY and e.load_pins == 0:
                self._drop_host(e)
            if e.disk is DiskState.READY:
                self._drop_disk(e)
            self._forget_if_empty(e)
        self._dirty = True

    def wait_io(self, timeout: float = 30.0) -> bool:
        """Wait (at most ``timeout``) for disk I/O in flight, then reap it; True if none is left.
        Never called on vLLM's step path (tests and shutdown only)."""
        deadline = time.monotonic() + timeout
        for fut in [*self._promoting.values(), *self._demoting.values(),
                    *([self._dump] if self._dump is not None else [])]:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # a fault is handled (and logged) by reap
                pass
        self.reap()
        return not (self._promoting or self._demoting)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.wait_io(timeout)
        if self.cfg.state_path is not None:
            self._dirty = False
            try:
                _write_json(self.cfg.state_path, self.state())
            except OSError as exc:
                log.warning("tiering: final state dump failed: %s", exc)
        if self._own_executor:
            self._io.shutdown(timeout)

    # ------------------------------------------------------------------ checking

    def check_integrity(self) -> None:
        problems = []
        holdings: dict[Any, list[int]] = {}
        host_ready = set()
        disk_ready = set()
        for k, e in self.table.items():
            if e.key != k:
                problems.append(f"{k.hex()}: entry key differs")
            if (e.host is HostState.NONE) != (e.slot is None):
                problems.append(f"{k.hex()}: host {e.host.value} with slot {e.slot}")
            if (e.disk is DiskState.NONE) != (e.extent is None):
                problems.append(f"{k.hex()}: disk {e.disk.value} with extent {e.extent}")
            if e.host is HostState.NONE and e.disk is DiskState.NONE:
                problems.append(f"{k.hex()}: in no tier but still in the table")
            if e.load_pins < 0 or (e.load_pins and e.host is not HostState.READY):
                problems.append(f"{k.hex()}: {e.load_pins} load pins with host {e.host.value}")
            if (e.host is HostState.PROMOTING) != (k in self._promoting):
                problems.append(f"{k.hex()}: promoting state and job disagree")
            if (e.disk is DiskState.WRITING) != (k in self._demoting):
                problems.append(f"{k.hex()}: demoting state and job disagree")
            if e.disk is DiskState.WRITING and e.host is not HostState.READY:
                problems.append(f"{k.hex()}: demoting without a ready host copy")
            if e.slot is not None:
                holdings[k] = [e.slot]
            if e.host is HostState.READY:
                host_ready.add(k)
            if e.disk is DiskState.READY:
                disk_ready.add(k)
        if set(self.host_policy.victims()) != host_ready or len(self.host_policy) != len(host_ready):
            problems.append("host policy does not hold exactly the host-ready blocks")
        if set(self.disk_policy.victims()) != disk_ready or len(self.disk_policy) != len(disk_ready):
            problems.append("disk policy does not hold exactly the disk-ready blocks")
        try:
            self.pool.check_integrity(holdings)
        except AssertionError as exc:
            problems.append(str(exc))
        if self.disk is not None:
            try:
                self.disk.check_integrity()
            except AssertionError as exc:
                problems.append(str(exc))
            extents = [e for e in self.table.values() if e.extent is not None]
            if self.disk.used_bytes() < len(extents) * self.disk.chunk_alloc_bytes:
                problems.append("disk ledger holds fewer chunks than the table's extents")
        if problems:
            raise TableIntegrityError("tiering vLLM block table: " + "; ".join(problems[:20]))


def _write_json(path: str, obj: Mapping[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def open_disk(cfg: TieredConfig, page_bytes: int, fingerprint: str) -> DiskPageStore | None:
    """The disk tier for pages of ``page_bytes`` (one page per chunk), or None."""
    if cfg.disk_path is None:
        return None
    assert cfg.disk_bytes is not None
    if cfg.disk_bytes < page_bytes:
        raise ValueError(
            f"kv_connector_extra_config.disk_bytes {cfg.disk_bytes} is smaller than one block "
            f"({page_bytes} bytes)"
        )
    return DiskPageStore(
        DiskConfig(
            path=cfg.disk_path,
            capacity_bytes=cfg.disk_bytes,
            chunk_bytes=page_bytes,
            io_threads=1,
            io_timeout_s=60.0,
        ),
        (page_bytes,),
        torch.uint8,
        fingerprint=fingerprint,
    )


# ----------------------------------------------------------------------------- worker side


class LayerCopy(NamedTuple):
    """One KV tensor of a group: ``tensor`` (num_blocks, >= nbytes) uint8 view; its
    bytes go to ``offset`` .. ``offset + nbytes`` of a block's part of a host slot."""

    tensor: torch.Tensor
    offset: int
    nbytes: int


class GroupLayout(NamedTuple):
    copies: tuple[LayerCopy, ...]
    block_bytes: int  # bytes of one vLLM block of this group across its layers


def plan_blocks(
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slots: Sequence[int],
    blocks_per_chunk: int,
) -> list[tuple[int, list[int], list[int]]]:
    """Per KV group: (group, vLLM block ids, host rows) where a host row is
    ``slot * blocks_per_chunk + block-within-chunk``; slots are listed group by group,
    one per offloaded chunk the group's blocks touch."""
    if sum(group_sizes) != len(block_ids) or len(block_indices) != len(group_sizes):
        raise ValueError(
            f"spec: {len(block_ids)} block ids vs group sizes {list(group_sizes)} "
            f"and block indices {list(block_indices)}"
        )
    out = []
    b = 0
    k = 0
    for g, (n, b0) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n == 0:
            continue
        first_chunk = b0 // blocks_per_chunk
        n_keys = (b0 + n - 1) // blocks_per_chunk - first_chunk + 1
        if k + n_keys > len(slots):
            raise ValueError(f"spec: group {g} needs {n_keys} host slots, {len(slots) - k} left")
        rows = []
        for j in range(n):
            idx = b0 + j
            slot = slots[k + idx // blocks_per_chunk - first_chunk]
            rows.append(int(slot) * blocks_per_chunk + idx % blocks_per_chunk)
        out.append((g, [int(x) for x in block_ids[b : b + n]], rows))
        b += n
        k += n_keys
    if k != len(slots):
        raise ValueError(f"spec: {len(slots)} host slots but the blocks use {k}")
    return out


class JobResult(NamedTuple):
    job_id: int
    success: bool
    nbytes: int
    seconds: float


class TieredMover:
    """Worker side: copies between vLLM's per-layer block tensors and this rank's slab.

    ``groups[g]`` says where group g's layers lie in a host block row. A slot holds
    ``blocks_per_chunk`` block rows. Each job runs on a worker thread (the copy
    streams on a GPU); adjacent blocks that are adjacent in the slab are one copy
    per layer.
    """

    def __init__(
        self,
        groups: Sequence[GroupLayout],
        slab: HostSlab,
        blocks_per_chunk: int,
        *,
        threads: int = 2,
        device: torch.device | None = None,
        corrupt_loads: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.groups = list(groups)
        self.slab = slab
        self.bpc = blocks_per_chunk
        row_bytes = max(g.block_bytes for g in self.groups)
        if row_bytes * blocks_per_chunk > slab.slot_bytes:
            raise ValueError(
                f"host slot of {slab.slot_bytes} B cannot hold {blocks_per_chunk} blocks "
                f"of {row_bytes} B"
            )
        self.row_bytes = slab.slot_bytes // blocks_per_chunk
        self.rows = slab.tensor.view(slab.num_slots * blocks_per_chunk, self.row_bytes)
        dev = device or (self.groups[0].copies[0].tensor.device if self.groups else torch.device("cpu"))
        self.streams = StreamSet(dev)
        self.corrupt_loads = corrupt_loads
        self._clock = clock
        self._exec = PriorityExecutor(threads, "tiering-vllm-copy")
        self._jobs: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.counters = {"jobs": 0, "bytes": 0, "failed": 0}

    def submit(self, job_id: int, store: bool, block_ids, group_sizes, block_indices, slots) -> bool:
        try:
            plan = plan_blocks(block_ids, group_sizes, block_indices, slots, self.bpc)
        except ValueError as exc:
            log.error("tiering: job %d refused: %s", job_id, exc)
            return False
        marker = self.streams.compute_marker()
        fut = self._exec.submit(RELOAD if not store else OFFLOAD, self._run, store, plan, marker)
        with self._lock:
            self._jobs[job_id] = fut
        return True

    def _run(self, store: bool, plan, marker) -> tuple[int, float]:
        t0 = self._clock()
        nbytes = 0
        for g, blocks, rows in plan:
            layout = self.groups[g]
            if store:
                runs = coalesce(blocks, rows)
            else:
                runs = coalesce(rows, blocks)
            for c in layout.copies:
                dev = c.tensor[:, : c.nbytes]
                host = self.rows[:, c.offset : c.offset + c.nbytes]
                if store:
                    copy_runs(self.streams, dev, host, runs, "d2h", after=marker)
                else:
                    copy_runs(self.streams, host, dev, runs, "h2d", after=marker)
                    if self.corrupt_loads:  # TEST ONLY negative control
                        for b in blocks:
                            c.tensor[b, : c.nbytes].bitwise_xor_(0x5A)
                nbytes += len(blocks) * c.nbytes
        return nbytes, self._clock() - t0

    def get_finished(self) -> list[JobResult]:
        out = []
        with self._lock:
            done = [(j, f) for j, f in self._jobs.items() if f.done()]
            for j, _ in done:
                del self._jobs[j]
        for j, f in done:
            exc = f.exception()
            if exc is None:
                n, t = f.result()
                self.counters["jobs"] += 1
                self.counters["bytes"] += n
                out.append(JobResult(j, True, n, t))
            else:
                log.error("tiering: copy job %d failed: %r", j, exc)
                self.counters["failed"] += 1
                out.append(JobResult(j, False, 0, 0.0))
        return out

    def wait(self, job_ids: Iterable[int], timeout: float = 120.0) -> None:
        with self._lock:
            futs = [self._jobs[j] for j in job_ids if j in self._jobs]
        deadline = time.monotonic() + timeout
        for f in futs:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # reported by get_finished
                pass

    def shutdown(self) -> None:
        self._exec.shutdown(30.0)
