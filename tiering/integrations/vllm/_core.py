"""The engine-independent part of the vLLM backend: config, the shared host slab,
the scheduler-side manager (on the project's block index, block policies and the
block store's rules) and the worker-side mover. The config and slab live in
``_config``, the mover in ``_mover``, the manager's small types in ``_state``, how
its tiers map onto ``BlockRules`` in ``_rules``; this module holds the manager
and re-exports the rest.

Size: the module is over 500 lines because ``TieredBlockManager`` is about 1,400
on purpose. It is the single owner of every block's state (index entry, host
slot, disk extent, pins, promotions, demotions, staging rows and shared-tier
fetches in flight); every policy decision is the rules' (``self.rules``), but
applying one changes several of those tables together, its I/O threads only
move bytes (``reap`` applies their results on the caller's thread), and
``check_integrity`` checks the tables against each other. Split across classes,
each change would cross objects and the invariant would have no single owner.

Nothing here imports vLLM, so all of it is unit-tested in the project's own
environment; ``_spec`` wraps it in vLLM's classes.

Processes and ownership. vLLM runs the manager in its scheduler process and one
worker per rank in other processes. The host tier is a slab of ``num_slots``
page slots per rank, kept in a shared memory file that both sides map
(``HostSlab``). The manager owns every decision and every piece of book-keeping:
where each block is (``tiering.blocks.BlockIndex``), the retention order of each
tier (``tiering.policies.blocks``, by name), the host slot pool
(``tiering.core.pools.PagePool``), the disk tier (``DiskPageStore``) and the
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

import errno
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from tiering.blocks import BlockIndex
from tiering.core.executor import OFFLOAD, RELOAD, WRITE, PriorityExecutor
from tiering.core.pools import PagePool
from tiering.core.validate import check_timeout
from tiering.disk import DiskCorruptionError, DiskIOError, DiskPageStore
from tiering.disk.ledger import DiskExtent
from tiering.errors import CacheClosed, TableIntegrityError
from tiering.integrations.vllm._config import (
    OUR_KEYS,
    HostSlab,
    TieredConfig,
    _write_json,
    default_host_dir,
    open_disk,
    remove_leftover_slabs,
    slab_path,
)
from tiering.integrations.vllm._mover import (
    GroupLayout,
    JobResult,
    LayerCopy,
    TieredMover,
    plan_blocks,
)
from tiering.integrations.vllm._rules import admits_arrival, manager_rules, victim_except
from tiering.integrations.vllm._state import (
    MAX_ABSENT,
    MAX_FETCHES,
    MAX_LOAD_ROWS,
    PROMOTED_HOLD_STEPS,
    RESET_HOLD_STEPS,
    SHARED_ABSENT_HOLD_S,
    BlockView,
    Counters,
    DiskState,
    Event,
    HostState,
    LoadWindow,
    Lookup,
    StoreDecision,
    clear_staging,
    payload_offset,
    unlink_staging,
)
from tiering.policies.blocks import BlockPolicy, make_block_policy
from tiering.types import Tier

__all__ = [
    "OUR_KEYS",
    "PROMOTED_HOLD_STEPS",
    "RESET_HOLD_STEPS",
    "BlockView",
    "Counters",
    "DiskState",
    "Event",
    "GroupLayout",
    "HostSlab",
    "HostState",
    "JobResult",
    "LayerCopy",
    "LoadWindow",
    "Lookup",
    "StoreDecision",
    "TableIntegrityError",
    "TieredBlockManager",
    "TieredConfig",
    "TieredMover",
    "default_host_dir",
    "open_disk",
    "plan_blocks",
    "remove_leftover_slabs",
    "slab_path",
]

log = logging.getLogger(__name__)

class TieredBlockManager:
    """The scheduler-side manager on the project's ``BlockIndex`` (engine independent).

    Where a block is lives in ``self.index`` (a ``tiering.blocks.BlockIndex``):
    its location is HOST with its host slot as handle while it has a host copy,
    else DISK with its ``DiskExtent``; a promotion is a move DISK -> HOST in
    flight. Load pins and the pin of a demotion in flight are the index's
    reference counts. What the index cannot express is kept here, per tier and
    nothing else: slots reserved for stores in flight (a block enters the index
    when its bytes have landed), the disk copy of a block whose location is HOST
    (being written, or a clean copy, so evicting its host copy is a move to DISK
    that drops nothing), which host copies came from disk, and blocks found
    damaged that cannot be dropped yet (a descendant is busy; they answer MISS).

    Chains: vLLM's keys are opaque; a block is inserted after the parent vLLM's
    side names (the previous block of the same request and KV group, when that
    block is in the index), else as a chain's first block. Dropping a block
    drops its cached descendants (a prefix lookup stops at the first miss).

    Policies: one ``tiering.policies.blocks`` policy per tier (``cfg.policy``), every
    call to them made by the block store's rules (``self.rules``, a
    ``tiering.resources.kv_prefix_rules.BlockRules``, as in the cache and the
    replay; what vLLM's API changes is in ``_rules``). ``slabs`` are the per-rank
    host slabs; ``disk`` is optional. Not
    thread-safe: all calls come from vLLM's scheduler thread; disk I/O runs on
    ``executor`` threads and is reaped on that thread.
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
        shared: Any = None,
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
        self.index = BlockIndex()
        # each tier's policy, sized by its tier; every call to them goes through the
        # block store's rules (see ``_rules``), which hold them
        self.rules = manager_rules(
            self.index, make_block_policy(cfg.policy, capacity=n),
            make_block_policy(cfg.policy, capacity=max(1, disk.capacity_pages))
            if disk is not None else None)
        self._told: weakref.WeakSet[Any] = weakref.WeakSet()  # requests told (``request=``)
        # host blocks with no disk copy, oldest arrival first: what write-ahead takes next
        self._unwritten: dict[bytes, None] = {}
        # write-through by default: a host block with a disk copy is evicted for free
        self.headroom = cfg.demote_headroom if cfg.demote_headroom is not None else n
        self.load_budget = n  # blocks one request may hold for one load (rows added below)
        self.staging = cfg.staging if disk is not None else None
        if self.staging is not None:
            os.makedirs(self.staging, exist_ok=True)
            clear_staging(self.staging)
        self._stage_seq = 0
        # blocks going straight to disk: key -> (extent, parent, staging file, row);
        # from prepare_store until their disk write is reaped
        self._staged: dict[bytes, tuple[DiskExtent, bytes | None, str, int]] = {}
        # staging file -> (its disk job, [(key, extent, parent)], abandoned by a reset)
        self._stage_jobs: dict[str, tuple[Future, list[tuple[bytes, DiskExtent, bytes | None]],
                                          bool]] = {}
        self._refusing = False  # the last store batch was refused (logged once)
        # Loads straight from disk: a disk block with no host slot free for it is read
        # (checked) into a row of the load staging file (one per rank) and loaded from
        # there; the row is freed when its loads complete.
        self.load_staging: str | None = None
        self.rows: PagePool | None = None  # see load_budget: host slots + these rows
        self._row_fds: list[int] = []
        if self.staging is not None:
            assert disk is not None
            self.load_staging = os.path.join(self.staging, f"load-{os.getpid()}")
            self.rows = PagePool("load rows", max(1, min(disk.capacity_pages, MAX_LOAD_ROWS)),
                                 self.page_bytes)
        self._row_jobs: dict[bytes, tuple[Future, int]] = {}  # key -> (read job, row)
        self._rows: dict[bytes, int] = {}  # key -> row holding its checked bytes
        self._row_at: dict[bytes, int] = {}  # ready and not loaded yet: key -> step
        if self.rows is not None:
            self.load_budget = n + self.rows.num_pages
        # the shared cold tier (a tiering.coldtier.SharedBlockStore), below the disk tier
        if shared is not None and disk is None:
            raise ValueError("TieredBlockManager: a shared tier needs the disk tier")
        self.shared = shared
        # key -> (job, its disk extent once the block was found, parent)
        self._fetching: dict[bytes, tuple[Future, DiskExtent | None, bytes | None]] = {}
        self._fetch_abandoned: list[tuple[Future, DiskExtent | None]] = []  # by a reset
        self._absent: dict[bytes, float] = {}  # not in the shared tier: key -> when asked
        self.counters = Counters()
        self._reported = Counters()
        self.events: list[Event] = []
        self._clock = clock
        self._own_executor = executor is None
        self._io = executor or PriorityExecutor(cfg.io_threads, "tiering-vllm-io")
        self._storing: dict[bytes, tuple[int, bytes | None]] = {}  # key -> (slot, parent)
        self._disk_copy: dict[bytes, DiskExtent] = {}  # disk copies of blocks located on HOST
        self._from_disk: set[bytes] = set()
        self._load_pins: dict[bytes, int] = {}
        self._lost: dict[bytes, str] = {}  # damaged, drop deferred: key -> reason
        self._orphaned: set[bytes] = set()  # being stored under a block dropped since
        self._promoting: dict[bytes, Future] = {}
        self._demoting: dict[bytes, Future] = {}
        self._dirty = True
        self._dump: Future | None = None
        self._closed = False
        self._step = 0  # maintain() calls: one per vLLM scheduler step
        # promoted for a lookup that answered "pending" and not loaded yet: key -> step
        self._fresh: dict[bytes, int] = {}
        # after a reset: slots of stores that were in flight (slot -> step of the reset),
        # and load pins that were (key -> (pins, step)); taken back RESET_HOLD_STEPS later
        self._abandoned: dict[int, int] = {}
        self._reset_loads: dict[bytes, tuple[int, int]] = {}

    # ------------------------------------------------------------------ reading

    @property
    def host_policy(self) -> BlockPolicy:
        return self.rules.policies[Tier.HOST]

    @property
    def disk_policy(self) -> BlockPolicy | None:
        """The disk tier's policy (None without a disk tier)."""
        return self.rules.policies[Tier.DISK] if self.disk is not None else None

    def block(self, key: bytes) -> BlockView | None:
        """The block's state in both tiers, or None when no tier holds (or stores) it."""
        st = self._storing.get(key)
        if st is not None:
            return BlockView(key, HostState.STORING, st[0], DiskState.NONE, None, 0, False,
                             st[1], 0)
        sg = self._staged.get(key)
        if sg is not None:
            return BlockView(key, HostState.NONE, None, DiskState.WRITING, sg[0], 0, False,
                             sg[1], 0)
        loc = self.index.location(key)
        if loc is None:
            return None
        info = self.index.get(key)
        assert info is not None
        if loc.tier is Tier.HOST:
            ext = self._disk_copy.get(key)
            disk = (DiskState.NONE if ext is None else
                    DiskState.WRITING if key in self._demoting else DiskState.READY)
            return BlockView(key, HostState.READY, loc.handle, disk, ext,
                             self._load_pins.get(key, 0), key in self._from_disk,
                             info.parent, info.depth)
        host = HostState.PROMOTING if loc.moving_to is Tier.HOST else HostState.NONE
        return BlockView(key, host, loc.dest_handle, DiskState.READY, loc.handle, 0, False,
                         info.parent, info.depth)

    def keys(self) -> list[bytes]:
        """Every block a tier holds or is storing."""
        return [*self.index.keys(), *self._storing, *self._staged]

    def loaded_from_disk(self, key: bytes) -> bool:
        return key in self._from_disk

    # ------------------------------------------------------------------ helpers

    def _slot_view(self, slot: int) -> list[torch.Tensor]:
        return [s.tensor[slot] for s in self.slabs]

    def _open(self, op: str) -> None:
        if self._closed:
            raise CacheClosed(f"TieredBlockManager.{op}: the manager is shut down")

    @staticmethod
    def _keys(op: str, keys: Iterable[bytes]) -> list[bytes]:
        """``keys`` as a list of offload keys (non-empty ``bytes``); a ValueError naming
        the first bad one (a ``str`` or ``bytes`` given for the whole list included)."""
        if isinstance(keys, (str, bytes, bytearray, memoryview)):
            raise ValueError(f"{op}: keys must be a sequence of bytes keys, got {keys!r}")
        out = list(keys)
        for k in out:
            TieredBlockManager._check_key(op, k)
        return out

    @staticmethod
    def _check_key(op: str, key: object) -> None:
        if type(key) is not bytes or not key:
            raise ValueError(f"{op}: every key must be non-empty bytes, got {key!r}")

    def _owner(self, key: bytes) -> str:
        return "k" + key.hex()

    def _disk_ready_copy(self, key: bytes) -> bool:
        return key in self._disk_copy and key not in self._demoting

    def _tell(self, request: object, parent: bytes | None, keys: Sequence[bytes],
              tiers: Sequence[Tier], now: float) -> None:
        """Tell every tier's policy a request once (``BlockRules.tell``): its chain is the
        blocks the index links above ``keys`` (held by vLLM on the GPU: device hits),
        then ``keys``, of which the leading ``len(tiers)`` are hits there. ``request``: the
        caller's object for the request (None: each call is a request of its own)."""
        if request is not None:
            if request in self._told:
                return
            self._told.add(request)
        above = self._chain_to(parent)
        chain, hit = list(above), [Tier.DEVICE] * len(above)
        seen = set(above)
        for i, k in enumerate(keys):  # a chain names each block once (a caller may repeat one)
            if k in seen:
                if i < len(tiers):
                    break  # the hits must lead: none after a repeated one
                continue
            seen.add(k)
            chain.append(k)
            if i < len(tiers) and len(hit) == len(chain) - 1:
                hit.append(tiers[i])
        self.rules.tell(chain, hit, now)

    def _chain_to(self, parent: bytes | None) -> list[bytes]:
        if parent is None or parent not in self.index:
            return []
        return list(self.index.chain_keys(parent))

    def _release_disk(self, ext: DiskExtent) -> None:
        assert self.disk is not None
        try:
            self.disk.release(ext)
        except (ValueError, DiskIOError) as exc:  # stays quarantined in the ledger
            log.warning("tiering: releasing disk extent %s: %s", ext, exc)

    def _remove(self, key: bytes, reason: str, evicted: list[bytes] | None = None) -> bool:
        """Drop a block and its cached descendants from every tier and free what they
        held; a block being stored under one of them is not stored (it would start a
        chain the index does not link: the cache drops a block with its descendants).
        False (and the block answers MISS until a later retry succeeds) when it or a
        descendant is busy (loading, being written down or promoted)."""
        if not self.index.evictable(key):
            if key not in self._lost:
                self.counters.drops_deferred += 1
            self._lost[key] = reason
            return False
        host_gone: list[bytes] = []
        disk_gone: list[bytes] = []
        gone = self.index.drop(key, reason)
        self.rules.dropped(gone)
        for d in gone:
            k = d.key
            if d.tier is Tier.HOST:
                self.pool.release(k, [d.handle])
                host_gone.append(k)
                self._from_disk.discard(k)
                self._unwritten.pop(k, None)
                self._forget_fresh(k)
                ext = self._disk_copy.pop(k, None)
                if ext is not None:
                    self._release_disk(ext)
                    disk_gone.append(k)
            else:
                self._release_disk(d.handle)
                disk_gone.append(k)
                self._drop_row(k)
            self._lost.pop(k, None)
            self.counters.dropped += 1
            if evicted is not None:
                evicted.append(k)
        if self._storing:
            keys = {d.key for d in gone}
            for k, (_, parent) in self._storing.items():
                if parent in keys:
                    self._orphaned.add(k)
        if host_gone:
            self.events.append(Event(tuple(host_gone), "host", True))
        if disk_gone:
            self.events.append(Event(tuple(disk_gone), "disk", True))
        self._dirty = True
        return True

    def _retry_lost(self) -> None:
        for k in list(self._lost):
            reason = self._lost.get(k)
            if reason is None:
                continue  # dropped meanwhile, as a descendant of another lost block
            if k in self.index:
                self._remove(k, reason)
            else:
                self._lost.pop(k, None)

    def _ancestors(self, keys: Iterable[bytes]) -> set[bytes]:
        out: set[bytes] = set()
        for k in keys:
            if k in self.index:
                out.update(self.index.chain_keys(k))
        return out

    def _forget_fresh(self, key: bytes) -> None:
        if self._fresh.pop(key, None) is not None:
            self.counters.promotions_unused += 1

    def _held_fresh(self, key: bytes) -> bool:
        """A block promoted for a pending lookup is kept for ``PROMOTED_HOLD_STEPS``
        steps or until it is loaded: evicting it first would make concurrent
        requests undo each other's promotions (and retry them forever)."""
        at = self._fresh.get(key)
        return at is not None and self._step - at < PROMOTED_HOLD_STEPS

    def _free_host_slots(
        self, need: int, evicted: list[bytes], protect: set[bytes], partial: bool = False
    ) -> bool:
        """Make ``need`` host slots free by the block rules; all or nothing (with
        ``partial``, as many as it can: the caller reads ``pool.free_pages``).

        As in the cache (``BlockRules``): refused at once, nothing moved, unless enough
        host blocks may leave (``reachable``); each victim is the host policy's and
        moves to disk when the disk's policy admits it, else it is dropped with its
        cached descendants. What vLLM changes: a move down only hands over the disk
        copy written ahead (``demote_headroom``), so a victim whose copy is not written
        yet is passed over; the chains above ``protect`` (blocks being stored or
        promoted) and blocks promoted for a waiting lookup stay."""
        short = need - self.pool.free_pages
        if short <= 0:
            return True
        now = self._clock()
        skip = self._ancestors(protect)
        skip.update(k for k in self._fresh if self._held_fresh(k))
        index = self.index
        # skipped blocks the policy could offer: counted on top, so that enough others may leave
        extra = sum(1 for k in skip if index.evictable(k) and index.location(k).tier is Tier.HOST)
        want = short if not partial else min(short, max(0, index.idle_count(Tier.HOST) - extra))
        if want and not self.rules.reachable(Tier.HOST, want + extra, now):
            return False
        while self.pool.free_pages < need:
            k = victim_except(self.rules, Tier.HOST, now, skip)
            if k is None:
                break
            if self.disk is not None and not self._disk_ready_copy(k):
                skip.add(k)  # not on disk yet: it cannot leave now (its write is ahead)
                continue
            self._host_victim_leaves(k, evicted, now)
        return self.pool.free_pages >= need

    def _host_victim_leaves(self, key: bytes, evicted: list[bytes], now: float) -> None:
        """A host victim moves down (its disk copy is ready) if the disk's policy admits
        it, else it is dropped with its descendants (``BlockRules.admits``)."""
        self.counters.host_evictions += 1
        if self.disk is not None:
            if self.rules.admits(Tier.DISK, key, now):
                self._evict_clean_host_copy(key, now)
                return
            self.counters.demotions_not_admitted += 1
        self._remove(key, "evicted", evicted)

    def _evict_clean_host_copy(self, key: bytes, now: float | None = None) -> None:
        """``key`` leaves the host for the disk, where its copy is (``BlockRules.moved``)."""
        if now is None:
            now = self._clock()
        ext = self._disk_copy.pop(key)
        self.index.begin_move(key, Tier.DISK, ext)
        old = self.index.finish_move(key)  # the bytes are on disk already
        self.rules.moved(key, Tier.HOST, Tier.DISK, now)
        self.pool.release(key, [old.handle])
        self._from_disk.discard(key)
        self._forget_fresh(key)
        self.events.append(Event((key,), "host", True))
        self._dirty = True

    def _reserve_disk(self, key: bytes, evicted: list[bytes], copies: bool = True
                      ) -> DiskExtent | None:
        """A disk extent for ``key``, making room by the rules (a disk victim, the disk
        policy's, is dropped; never an ancestor of ``key``); with ``copies``, then by
        letting go of disk copies of host blocks (oldest first: the host copy stays).
        None when neither makes room."""
        assert self.disk is not None
        ext = self.disk.reserve(self._owner(key), 1)
        if ext is not None:
            return ext
        now = self._clock()
        guarded = self._ancestors([key])
        while True:
            k = victim_except(self.rules, Tier.DISK, now, guarded)
            if k is None:
                break
            self.counters.disk_evictions += 1
            self._remove(k, "evicted", evicted)
            ext = self.disk.reserve(self._owner(key), 1)
            if ext is not None:
                return ext
        if not copies:
            return None
        for k in list(self._disk_copy):
            if k in guarded or not self._disk_ready_copy(k):
                continue
            self._release_disk(self._disk_copy.pop(k))
            self._unwritten[k] = None
            self.events.append(Event((k,), "disk", True))
            self.counters.disk_evictions += 1
            ext = self.disk.reserve(self._owner(key), 1)
            if ext is not None:
                return ext
        return None

    # ------------------------------------------------------------------ reaping I/O

    def reap(self) -> None:
        """Settle finished promotions, demotions and stores to disk (non-blocking)."""
        now = self._clock()
        if self._stage_jobs:
            self._reap_staging(now)
        if self._fetching or self._fetch_abandoned:
            self._reap_fetches(now)
        if self._row_jobs:
            self._reap_rows()
        for key, fut in list(self._promoting.items()):
            if not fut.done():
                continue
            del self._promoting[key]
            self._dirty = True
            exc = fut.exception()
            if exc is None:
                old = self.index.finish_move(key)  # now on HOST; its disk copy stays
                self.rules.moved(key, Tier.DISK, Tier.HOST, now)
                self._disk_copy[key] = old.handle
                self._from_disk.add(key)
                self._fresh[key] = self._step
                self.events.append(Event((key,), "host", False))
                self.counters.promotions_ok += 1
            else:
                log.warning("tiering: block %s failed promotion (%s): dropped, will be recomputed",
                            key.hex(), exc)
                self.counters.promotions_failed += 1
                dest = self.index.fail_move(key)
                self.pool.release(key, [dest.handle])
                reason = "corrupt" if isinstance(exc, DiskCorruptionError) else "read_failed"
                self._remove(key, reason)
        for key, fut in list(self._demoting.items()):
            if not fut.done():
                continue
            del self._demoting[key]
            self.index.release(key)
            self._dirty = True
            exc = fut.exception()
            if exc is None:  # a copy: the block stays on the host (no policy is told)
                self.events.append(Event((key,), "disk", False))
                self.counters.demotions_ok += 1
                self._count_publish(fut.result())
            else:
                log.warning("tiering: demotion of %s failed: %s", key.hex(), exc)
                self.counters.demotions_failed += 1
                self._release_disk(self._disk_copy.pop(key))
                self._unwritten[key] = None
        if self._lost:
            self._retry_lost()

    # ------------------------------------------------------------------ vLLM-facing operations

    def lookup(self, key: bytes, window: LoadWindow | None = None) -> Lookup:
        """Where ``key`` is for a load: HIT (on host, checked), PENDING (being stored or
        promoted: ask again), MISS. With the request's ``window`` (see ``LoadWindow``)
        a request never holds more than ``load_budget`` blocks in one pass nor waits
        longer than ``cfg.load_wait_s``: past either, the answer is MISS."""
        self._open("lookup")
        self._check_key("lookup", key)  # one key per call, on the scheduler's path: no list
        if window is not None and not isinstance(window, LoadWindow):
            raise ValueError(f"lookup: window must be a LoadWindow or None, got {window!r}")
        self.reap()
        self.counters.lookups += 1
        if window is None:
            return self._lookup(key, may_wait=True)
        if key in window.seen:
            window._restart()
        window.seen.add(key)
        if window.held >= self.load_budget:
            self.counters.lookups_over_budget += 1
            return Lookup.MISS
        now = self._clock()
        waited = window.since is not None and now - window.since >= self.cfg.load_wait_s
        if waited and self._would_wait(key):
            self.counters.lookups_timed_out += 1
            return Lookup.MISS
        r = self._lookup(key, may_wait=not waited, parent=window.last)
        if r is Lookup.MISS:
            return r
        if r is Lookup.PENDING:
            window.pending = True
            if window.since is None:
                window.since = now
        window.held += 1
        window.last = key
        return r

    def _would_wait(self, key: bytes) -> bool:
        loc = self.index.location(key)
        return key in self._storing or key in self._staged or key in self._fetching or (
            loc is not None and loc.tier is not Tier.HOST and key not in self._lost
            and key not in self._rows
        )

    def _lookup(self, key: bytes, may_wait: bool, parent: bytes | None = None) -> Lookup:
        """``may_wait``: a miss may start a fetch from the shared tier (a wait)."""
        if key in self._storing or key in self._staged or key in self._fetching:
            self.counters.pending_answers += 1
            return Lookup.PENDING
        loc = self.index.location(key)
        if key in self._lost:
            return Lookup.MISS
        if loc is None:
            if may_wait and self._start_fetch(key, parent):
                self.counters.pending_answers += 1
                return Lookup.PENDING
            return Lookup.MISS
        if loc.tier is Tier.HOST:
            # the policies hear it at the load (once per request); until then the chain
            # of a block this request promotes is not a host victim (_free_host_slots)
            self.counters.host_hits += 1
            return Lookup.HIT
        if key in self._rows:  # read into the load staging file, checked
            self.counters.host_hits += 1
            return Lookup.HIT
        if loc.moving_to is None and key not in self._row_jobs:
            # Without a host slot (or a staging row) now, every one is held by something
            # that ends on its own (a store, a promotion, a load): ask vLLM to come back.
            if not self._start_promotion(key) and not self._start_row_read(key, loc.handle):
                self.counters.promotions_deferred += 1
        self.counters.pending_answers += 1
        return Lookup.PENDING

    # ------------------------------------------------------------------ loads straight from disk

    def _start_row_read(self, key: bytes, ext: DiskExtent) -> bool:
        if self.rows is None:
            return False
        if not self._row_fds:  # created at the first use; each worker removes its file's name
            for r in range(len(self.slabs)):  # once it has opened it (TieredMover)
                self._row_fds.append(os.open(f"{self.load_staging}.r{r}",
                                             os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))
        got = self.rows.allocate(key, 1)
        if got is None:
            return False
        self.index.acquire(key)  # not evicted from disk while it is read
        self.counters.direct_reads_started += 1
        self._row_jobs[key] = (self._io.submit(RELOAD, self._read_to_row, ext, got[0]), got[0])
        self._dirty = True
        return True

    def _read_to_row(self, ext: DiskExtent, row: int) -> None:
        """I/O thread: read a block from disk (checked) into ``row`` of every rank's file."""
        assert self.disk is not None
        buf = torch.empty((1, self.page_bytes), dtype=torch.uint8)
        self.disk.read(ext, buf)  # checked before any byte reaches the file
        data = buf.numpy()
        off = 0
        for fd, slab in zip(self._row_fds, self.slabs, strict=True):
            view = memoryview(data[0, off : off + slab.slot_bytes])
            done = 0
            while done < slab.slot_bytes:
                done += os.pwrite(fd, view[done:], row * slab.slot_bytes + done)
            off += slab.slot_bytes

    def _reap_rows(self) -> None:
        for key, (fut, row) in list(self._row_jobs.items()):
            if not fut.done():
                continue
            del self._row_jobs[key]
            self.index.release(key)
            self._dirty = True
            exc = fut.exception()
            if exc is None and key not in self._lost:
                self._rows[key] = row
                self._row_at[key] = self._step
                continue
            assert self.rows is not None
            self.rows.release(key, [row])
            if exc is not None:
                log.warning("tiering: block %s failed its read from disk (%s): dropped, will be "
                            "recomputed", key.hex(), exc)
                self.counters.direct_reads_failed += 1
                reason = "corrupt" if isinstance(exc, DiskCorruptionError) else "read_failed"
                self._remove(key, reason)

    def _drop_row(self, key: bytes) -> None:
        row = self._rows.pop(key, None)
        self._row_at.pop(key, None)
        if row is not None:
            assert self.rows is not None
            self.rows.release(key, [row])

    def _expire_rows(self) -> None:
        for key, at in list(self._row_at.items()):
            if self._step - at >= PROMOTED_HOLD_STEPS and not self._load_pins.get(key):
                self.counters.promotions_unused += 1
                self._drop_row(key)

    # ------------------------------------------------------------------ the shared tier

    def _start_fetch(self, key: bytes, parent: bytes | None) -> bool:
        """Ask the shared tier for a block no local tier has. Two jobs: the fetch (its
        frame and MAC checked), then, once a disk extent is reserved for the block
        found, its write to disk; the block enters the index at DISK after both."""
        if self.shared is None:
            return False
        at = self._absent.get(key)
        if at is not None and self._clock() - at < SHARED_ABSENT_HOLD_S:
            return False
        if len(self._fetching) >= MAX_FETCHES:
            return False
        self.counters.shared_fetches += 1
        self._fetching[key] = (self._io.submit(RELOAD, self._fetch, key), None, parent)
        self._dirty = True
        return True

    def _fetch(self, key: bytes) -> tuple[str, torch.Tensor | None]:
        """I/O thread: the shared tier's answer for ``key``: (status, page or None)."""
        assert self.shared is not None
        res = self.shared.fetch(key)
        if res.status.value != "hit":
            return res.status.value, None
        if len(res.payload) != self.page_bytes:
            return "lost", None
        return "hit", torch.frombuffer(bytearray(res.payload), dtype=torch.uint8).view(1, -1)

    def _write_fetched(self, ext: DiskExtent, page: torch.Tensor) -> tuple[str, None]:
        assert self.disk is not None
        self.disk.write(ext, page)
        return "written", None

    def _publish(self, key: bytes | None, page: torch.Tensor) -> bool | None:
        """I/O thread: offer a block that just reached the disk tier to the shared tier;
        whether it is there now (None: no shared tier). Counted by the reaper."""
        if self.shared is None or key is None:
            return None
        try:
            res = self.shared.publish(key, page.numpy().tobytes())
        except Exception as exc:  # a store fault is a status; anything else is logged
            log.warning("tiering: publishing %s to the shared tier: %r", key.hex(), exc)
            return False
        return res.status.value in ("written", "duplicate")

    def _count_publish(self, ok: bool | None) -> None:
        if ok is True:
            self.counters.shared_published += 1
        elif ok is False:
            self.counters.shared_publish_failed += 1

    def _reap_fetches(self, now: float) -> None:
        for fut, ext in [f for f in self._fetch_abandoned if f[0].done()]:
            self._fetch_abandoned.remove((fut, ext))
            if ext is not None:
                self._release_disk(ext)
        for key, (fut, ext, parent) in list(self._fetching.items()):
            if not fut.done():
                continue
            del self._fetching[key]
            self._dirty = True
            exc = fut.exception()
            status, page = ("error", None) if exc is not None else fut.result()
            if status == "hit":  # found: now a disk extent for it (evicting, as a store)
                evicted: list[bytes] = []
                ext = None if key in self.index else self._reserve_disk(key, evicted)
                if ext is not None:
                    self._fetching[key] = (self._io.submit(RELOAD, self._write_fetched, ext,
                                                           page), ext, parent)
                continue
            if status != "written":
                if ext is not None:
                    self._release_disk(ext)
                if status in ("unavailable", "skipped", "error"):
                    self.counters.shared_unavailable += 1
                    if exc is not None:
                        log.warning("tiering: block %s from the shared tier: %r", key.hex(), exc)
                else:
                    self.counters.shared_misses += 1
                self._absent[key] = now
                if len(self._absent) > MAX_ABSENT:
                    del self._absent[next(iter(self._absent))]
                continue
            assert ext is not None
            if key in self.index:  # stored meanwhile by this engine: keep that copy
                self._release_disk(ext)
                continue
            self._absent.pop(key, None)
            self._insert_on_disk(key, parent, ext, now)
            self.counters.shared_hits += 1
            self.events.append(Event((key,), "disk", False))

    def _insert_on_disk(self, key: bytes, parent: bytes | None, ext: Any, now: float) -> None:
        """Index ``key`` as held on the disk tier at ``ext`` and tell the disk policy; a
        parent that is gone or lost is not linked."""
        if parent is not None and (parent not in self.index or parent in self._lost):
            parent = None
        ok = self.index.insert(key, parent, Tier.DISK, ext, now)
        assert ok
        self.rules.arrived(key, Tier.DISK, now)

    def _start_promotion(self, key: bytes) -> bool:
        evicted: list[bytes] = []
        if not self._free_host_slots(1, evicted, {key}):
            return False
        loc = self.index.location(key)
        if loc is None or loc.tier is not Tier.DISK or loc.moving_to is not None:
            return False
        slots = self.pool.allocate(key, 1)
        assert slots is not None
        self.index.begin_move(key, Tier.HOST, slots[0])
        self.counters.promotions_started += 1
        self._dirty = True
        self._promoting[key] = self._io.submit(RELOAD, self._read_page, loc.handle, slots[0])
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

    # ------------------------------------------------------------------ straight to disk

    def _finish_staging(self, staging: str, success: bool) -> None:
        """The workers have written (``success``) or failed the blocks of ``staging``:
        copy them into the disk tier on an I/O thread, or let their extents go."""
        items = [(k, v[0], v[1], v[3]) for k, v in self._staged.items() if v[2] == staging]
        if staging in self._stage_jobs or not items:
            return
        if not success:
            for k, ext, _, _ in items:
                del self._staged[k]
                self._release_disk(ext)
            self.counters.stores_failed += len(items)
            self.counters.stores_staged_failed += len(items)
            unlink_staging(staging, len(self.slabs))
            self._dirty = True
            return
        fut = self._io.submit(OFFLOAD, self._stage_in, staging,
                              [(k, e, r) for k, e, _, r in items])
        self._stage_jobs[staging] = (fut, [(k, e, p) for k, e, p, _ in items], False)

    def _stage_in(self, staging: str, items: list[tuple[bytes, DiskExtent, int]]) -> list:
        """Copy staging rows into their disk extents, then publish them (I/O thread);
        per item (None or the exception, what ``_publish`` said). The staging files
        are removed whatever happens."""
        assert self.disk is not None
        fds: list[int] = []
        try:
            try:
                for r in range(len(self.slabs)):
                    fds.append(os.open(f"{staging}.r{r}", os.O_RDONLY))
            except OSError as exc:
                return [(exc, None)] * len(items)
            buf = torch.empty((1, self.page_bytes), dtype=torch.uint8)
            arr = buf.numpy()
            out: list = []
            for key, ext, row in items:
                try:
                    off = 0
                    for fd, slab in zip(fds, self.slabs, strict=True):
                        n = os.preadv(fd, [memoryview(arr[0, off : off + slab.slot_bytes])],
                                      row * slab.slot_bytes)
                        if n != slab.slot_bytes:
                            raise OSError(errno.EIO, f"staging row {row}: {n} of "
                                          f"{slab.slot_bytes} bytes")
                        off += slab.slot_bytes
                    self.disk.write(ext, buf)
                except Exception as exc:  # handed back per block; the others go on
                    out.append((exc, None))
                    continue
                out.append((None, self._publish(key, buf)))
            return out
        finally:
            for fd in fds:
                os.close(fd)
            unlink_staging(staging, len(self.slabs))

    def _reap_staging(self, now: float) -> None:
        for staging, (fut, items, abandoned) in list(self._stage_jobs.items()):
            if not fut.done():
                continue
            del self._stage_jobs[staging]
            self._dirty = True
            exc = fut.exception()
            results = fut.result() if exc is None else [(exc, None)] * len(items)
            landed = []
            for (k, ext, parent), (err, published) in zip(items, results, strict=True):
                if not abandoned:
                    del self._staged[k]
                if abandoned or err is not None:
                    if err is not None:
                        log.warning("tiering: block %s did not reach the disk tier: %s",
                                    k.hex(), err)
                        self.counters.stores_failed += 1
                        self.counters.stores_staged_failed += 1
                    self._release_disk(ext)
                    continue
                self._insert_on_disk(k, parent, ext, now)
                self.counters.stores_completed += 1
                self._count_publish(published)
                landed.append(k)
            if landed:
                self.events.append(Event(tuple(landed), "disk", False))

    def _write_page(self, extent: DiskExtent, slot: int, key: bytes | None = None) -> bool | None:
        """Write a host slot to disk, then (with ``key``) publish it; see ``_publish``."""
        assert self.disk is not None
        if len(self.slabs) == 1:
            page = self.slabs[0].tensor[slot : slot + 1]
        else:
            page = torch.cat(self._slot_view(slot)).view(1, -1)
        self.disk.write(extent, page)
        return self._publish(key, page)

    def prepare_load(self, keys: Sequence[bytes], request: object = None) -> list[int]:
        """Pin the keys for a load; per key its host slot, or ``num_slots + row`` for a
        block loaded straight from disk through row ``row`` of ``load_staging``'s file
        (``f"{load_staging}.r{rank}"``). Every key must have answered HIT. The first
        load or store of a ``request`` (the caller's object for it; None: this call is
        a request of its own) tells the policies the request and these hits."""
        self._open("prepare_load")
        keys = self._keys("prepare_load", keys)
        for k in keys:
            loc = self.index.location(k)
            if loc is None or (loc.tier is not Tier.HOST and k not in self._rows) or (
                k in self._lost
            ):
                b = self.block(k)
                raise ValueError(
                    f"prepare_load: block {k.hex()} is not loadable from host "
                    f"(state {None if b is None else b.host.value})"
                )
        now = self._clock()
        if keys:
            self._tell(request, self.index.get(keys[0]).parent, keys,
                       [self.index.location(k).tier for k in keys], now)
        slots = []
        for k in keys:
            self.index.acquire(k)
            self._load_pins[k] = self._load_pins.get(k, 0) + 1
            self._fresh.pop(k, None)
            loc = self.index.location(k)
            assert loc is not None
            if loc.tier is not Tier.HOST:  # straight from disk, through its staging row
                self._row_at.pop(k, None)
                self.counters.loads_from_disk += 1
                slots.append(self.num_slots + self._rows[k])
                continue
            if k in self._from_disk:
                self.counters.loads_from_disk += 1
            else:
                self.counters.loads_from_host += 1
            slots.append(loc.handle)
        self._dirty = True
        return slots

    def complete_load(self, keys: Iterable[bytes]) -> None:
        self._open("complete_load")
        keys = self._keys("complete_load", keys)
        need: dict[bytes, int] = {}
        for k in keys:
            need[k] = need.get(k, 0) + 1
        for k, n in need.items():
            if self._load_pins.get(k, 0) < n:
                raise ValueError(f"complete_load: block {k.hex()} has no load in flight")
        for k, n in need.items():
            r = self._reset_loads.get(k)
            if r is not None:
                if r[0] > n:
                    self._reset_loads[k] = (r[0] - n, r[1])
                else:
                    del self._reset_loads[k]
        for k in keys:
            self.index.release(k)
            left = self._load_pins[k] - 1
            if left:
                self._load_pins[k] = left
            else:
                del self._load_pins[k]
                if k in self._rows:  # its staging row has served its loads
                    self._drop_row(k)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark the blocks held as used now (the index's last use). The policies hear a
        request's hits once, at its load (``BlockRules.tell``), not here."""
        self._open("touch")
        keys = self._keys("touch", keys)
        now = self._clock()
        for k in keys:
            if k in self.index:
                self.index.touch(k, now)

    def prepare_store(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None,
        request: object = None,
    ) -> StoreDecision | None:
        """Host slots for the keys not yet held; None (nothing changed) if they do not fit.

        ``parents[i]`` is the block before ``keys[i]`` in its request (None: unknown).
        Each new block arrives on the host as a device victim does in the cache: the
        host's policy admits it (``admit``, root first); a refused block is not stored,
        nor are the blocks after it in this batch. Room is then made for the admitted
        ones by the rules (``_free_host_slots``); a block whose parent left while room
        was made is not stored either. With a disk tier, what does not fit on the host
        goes straight to disk. ``request``: as for ``prepare_load``."""
        self._open("prepare_store")
        keys = self._keys("prepare_store", keys)
        if parents is not None and len(parents) != len(keys):
            raise ValueError(
                f"prepare_store: {len(keys)} keys but {len(parents)} parents"
            )
        self.reap()
        seen: set[bytes] = set()
        batch: list[tuple[bytes, bytes | None]] = []
        for i, k in enumerate(keys):
            if k in seen:
                continue
            seen.add(k)
            p = parents[i] if parents is not None else None
            if p is not None and not isinstance(p, bytes):
                raise ValueError(f"prepare_store: parent of {k.hex()} must be bytes or None, got {p!r}")
            batch.append((k, None if p == k else p))
        now = self._clock()
        if batch:
            self._tell(request, batch[0][1], [k for k, _ in batch], (), now)
        depth: dict[bytes, int] = {}
        skipped: set[bytes] = set()
        new: list[tuple[bytes, bytes | None]] = []
        for k, p in batch:
            if k in self.index or k in self._storing or k in self._staged:
                if k in self.index:
                    depth[k] = self.index.get(k).depth
                continue
            if p is not None and p in skipped:
                skipped.add(k)
                continue
            pinfo = self.index.get(p) if p is not None else None
            d = pinfo.depth + 1 if pinfo is not None else depth.get(p, -1) + 1 if p else 0
            if not admits_arrival(self.rules, Tier.HOST, k, d, now):
                skipped.add(k)
                self.counters.stores_not_admitted += 1
                continue
            depth[k] = d
            new.append((k, p))
        evicted: list[bytes] = []
        if self.disk is None:
            if not self._free_host_slots(len(new), evicted, set(keys)):
                return self._refuse(len(new))
            n_host = len(new)
        else:  # what does not fit on host now goes straight to disk
            self._free_host_slots(len(new), evicted, set(keys), partial=True)
            n_host = min(len(new), self.pool.free_pages)
        host = new[:n_host]
        staged: list[tuple[bytes, bytes | None, DiskExtent]] = []
        for k, p in new[n_host:]:
            ext = self._reserve_disk(k, evicted)
            if ext is None:
                break  # the disk is full of busy blocks: the rest is not stored
            staged.append((k, p, ext))
        orphans = 0
        if evicted:  # a block whose parent was dropped meanwhile left with it, as in the cache
            gone = set(evicted)
            for k, p in new:
                if p is not None and p in gone:
                    gone.add(k)
                    orphans += 1
            host = [(k, p) for k, p in host if k not in gone]
            for k, _, ext in staged:
                if k in gone:
                    self._release_disk(ext)
            staged = [x for x in staged if x[0] not in gone]
            self.counters.dropped += orphans
        if new and not host and not staged and not orphans:
            return self._refuse(len(new))
        self._refusing = False
        slots = self.pool.allocate(("batch",), len(host)) if host else []
        assert slots is not None
        for (k, p), s in zip(host, slots, strict=True):
            self.pool.transfer_ownership(("batch",), k, [s])
            self._storing[k] = (s, p)
        staging = None
        if staged:
            assert self.staging is not None
            self._stage_seq += 1
            staging = os.path.join(self.staging, f"store-{os.getpid()}-{self._stage_seq}")
            for j, (k, p, ext) in enumerate(staged):
                self._staged[k] = (ext, p, staging, j)
                slots.append(self.num_slots + j)
            self.counters.stores_staged += len(staged)
        self.counters.stores_started += len(host) + len(staged)
        self._dirty = True
        return StoreDecision([*(k for k, _ in host), *(k for k, _, _ in staged)], slots,
                             evicted, staging)

    def _refuse(self, n: int) -> None:
        """A store batch of which no block could be placed: counted, the state file
        marked changed, logged once until a store succeeds again."""
        self.counters.stores_refused += 1
        self._dirty = True
        if not self._refusing:
            self._refusing = True
            log.warning("tiering: a store of %d block(s) was refused: every tier is full of "
                        "pinned blocks (counted in stores_refused; logged once until a store "
                        "is accepted again)", n)
        return None

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Settle stores: their blocks enter the index (``success``) or their slots are
        freed. Keys with no store in flight are skipped (vLLM repeats keys across jobs)."""
        self._open("complete_store")
        keys = self._keys("complete_store", keys)
        if not isinstance(success, bool):
            raise ValueError(f"complete_store: success must be a bool, got {success!r}")
        stored = []
        now = self._clock()
        files = {self._staged[k][2] for k in keys if k in self._staged}
        for f in sorted(files):
            self._finish_staging(f, success)
        for k in keys:
            st = self._storing.pop(k, None)
            if st is None:
                continue  # already complete (keys repeat across jobs), staged, or never ours
            slot, parent = st
            if k in self._orphaned:  # its parent was dropped meanwhile: it goes too
                self._orphaned.discard(k)
                self.pool.release(k, [slot])
                self.counters.dropped += 1
            elif success:
                if parent is not None and (parent not in self.index or parent in self._lost):
                    parent = None  # not stored (yet): a chain's first block
                ok = self.index.insert(k, parent, Tier.HOST, slot, now)
                assert ok
                self.rules.arrived(k, Tier.HOST, now)
                if self.disk is not None:
                    self._unwritten[k] = None
                stored.append(k)
                self.counters.stores_completed += 1
            else:
                self.pool.release(k, [slot])
                self.counters.stores_failed += 1
        if stored:
            self.events.append(Event(tuple(stored), "host", False))
        self._dirty = True
        self._settle()  # not a step: vLLM completes many stores in one

    def maintain(self) -> None:
        """One scheduler step's end (vLLM's on_schedule_end): count the step (the holds,
        ``PROMOTED_HOLD_STEPS`` and ``RESET_HOLD_STEPS``, are in these steps), reap I/O,
        write cold host blocks down to disk to keep headroom, dump state."""
        self._open("maintain")
        self._step += 1
        if self._abandoned or self._reset_loads:
            self._take_back_after_reset()
        if self._row_at:
            self._expire_rows()
        self._settle()

    def _settle(self) -> None:
        """Reap I/O, keep the demotion headroom, dump state (no step is counted)."""
        self.reap()
        if self.disk is not None:
            self._demote_for_headroom()
        if self.cfg.state_path is not None and self._dirty and (
            self._dump is None or self._dump.done()
        ):
            if self._dump is not None and self._dump.exception() is not None:
                log.warning("tiering: writing the state file %s failed: %r",
                            self.cfg.state_path, self._dump.exception())
            self._dirty = False
            self._dump = self._io.submit(WRITE, _write_json, self.cfg.state_path, self.state())

    def _demote_for_headroom(self) -> None:
        """Write host blocks with no disk copy down, oldest arrival first, until
        ``headroom`` slots are free or clean. A copy, not a decision: no policy is asked
        (the disk's policy admits the block when it leaves the host); disk room for the
        copy is made by the rules, never by letting go of another copy."""
        if self.pool.free_pages >= self.headroom:
            return  # the common case costs nothing per step
        spare = self.pool.free_pages + len(self._disk_copy) - len(self._demoting)
        for k in list(self._unwritten):
            if spare >= self.headroom or len(self._demoting) >= 4 * self.cfg.io_threads:
                return
            if k not in self._unwritten:
                continue  # dropped while room was made for another one
            info = self.index.get(k)
            if info is None or info.refs or k in self._lost:
                continue
            loc = self.index.location(k)
            assert loc is not None and loc.tier is Tier.HOST
            ext = self._reserve_disk(k, [], copies=False)
            if ext is None:
                return
            if k not in self._unwritten:  # made room by dropping its own chain: let it go
                self._release_disk(ext)
                continue
            del self._unwritten[k]
            self._disk_copy[k] = ext
            self.index.acquire(k)  # pinned until the write is reaped
            self.counters.demotions_started += 1
            self._demoting[k] = self._io.submit(OFFLOAD, self._write_page, ext, loc.handle, k)
            spare += 1
            self._dirty = True

    def has_pending_work(self) -> bool:
        return bool(self._promoting or self._demoting or self._stage_jobs or self._fetching
                    or self._fetch_abandoned or self._row_jobs) or (
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
        for k in self.index.keys():
            b = self.block(k)
            assert b is not None
            if b.disk is DiskState.READY and b.extent is not None:
                chunk = b.extent.chunks[0]
                disk_blocks.append(
                    {"key": k.hex(), "chunk": chunk,
                     "payload_offset": payload_offset(self.disk, chunk),
                     "on_host": b.host is HostState.READY}
                )
        return {
            "time": self._clock(),
            "counters": dict(self.counters.__dict__),
            "host_slots": self.num_slots,
            "host_used": self.pool.used_pages,
            "page_bytes": self.page_bytes,
            "disk_root": self.disk_root,
            "disk_blocks": disk_blocks,
            "policy": self.cfg.policy,
            "index": {
                "blocks": len(self.index),
                "on_host": self.index.count(Tier.HOST),
                "on_disk": self.index.count(Tier.DISK),
                "chained": sum(1 for k in self.index.keys() if self.index.get(k).parent is not None),
                "dropped": dict(self.index.dropped),
            },
        }

    def reset(self) -> None:
        """Forget every block (vLLM's reset_cache: after it, no block stored before may
        be loaded, e.g. after a weight update). A block that a load, a demotion or a
        promotion uses answers "miss" at once and is dropped, with its descendants,
        when that job ends. Stores in flight are abandoned: they never enter the
        index and their slots stay reserved while the worker may still write them.
        vLLM flushes the jobs in flight at a reset and never completes them, so
        ``RESET_HOLD_STEPS`` steps later the abandoned slots and the load pins left
        from before the reset are taken back (a ``complete_load`` before that still
        settles its pins)."""
        self._open("reset")
        self.reap()
        for k in list(self.index.keys()):
            if k in self.index and k not in self._lost:  # not gone with an ancestor
                self._remove(k, "reset")
        for k in list(self._disk_copy):
            if k in self.index and self._disk_ready_copy(k):
                self._release_disk(self._disk_copy.pop(k))
                self._unwritten[k] = None
                self.events.append(Event((k,), "disk", True))
        for k, (slot, _) in self._storing.items():
            self.pool.transfer_ownership(k, ("reset", slot), [slot])
            self._abandoned[slot] = self._step
        self._storing.clear()
        self._orphaned.clear()
        for staging, (fut, items, _) in list(self._stage_jobs.items()):
            self._stage_jobs[staging] = (fut, items, True)  # its extents go when it ends
            for k, _, _ in items:
                self._staged.pop(k, None)
        for fut, ext, _ in self._fetching.values():  # its extent goes when it ends
            self._fetch_abandoned.append((fut, ext))
        self._fetching.clear()
        self._absent.clear()
        for ext, _, _, _ in self._staged.values():  # not written yet: a late
            self._release_disk(ext)  # complete_store finds nothing to do
        self._staged.clear()
        for k, n in self._load_pins.items():
            self._reset_loads[k] = (n, self._step)
        self._dirty = True

    def _take_back_after_reset(self) -> None:
        for slot, at in list(self._abandoned.items()):
            if self._step - at >= RESET_HOLD_STEPS:
                del self._abandoned[slot]
                self.pool.release(("reset", slot), [slot])
        for k, (n, at) in list(self._reset_loads.items()):
            if self._step - at < RESET_HOLD_STEPS:
                continue
            del self._reset_loads[k]
            left = min(n, self._load_pins.get(k, 0))
            if left:
                log.warning("tiering: %d load(s) of %s never completed after a reset; "
                            "taken back", left, k.hex())
                self.complete_load([k] * left)

    def wait_io(self, timeout: float = 30.0) -> bool:
        """Wait (at most ``timeout``) for disk I/O in flight, then reap it; True if none is left.
        Never called on vLLM's step path (tests and shutdown only). A timeout that is
        not a finite number >= 0 is a ValueError."""
        timeout = check_timeout("TieredBlockManager.wait_io", timeout)
        deadline = time.monotonic() + timeout
        while True:  # a job reaped may start the next (a block found in the shared tier)
            futs = [*self._promoting.values(), *self._demoting.values(),
                    *(j[0] for j in self._stage_jobs.values()),
                    *(f[0] for f in self._fetching.values()),
                    *(f[0] for f in self._fetch_abandoned),
                    *(j[0] for j in self._row_jobs.values()),
                    *([self._dump] if self._dump is not None else [])]
            for fut in futs:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:  # a fault is handled (and logged) by reap
                    pass
            self.reap()
            idle = not (self._promoting or self._demoting or self._stage_jobs
                        or self._fetching or self._fetch_abandoned or self._row_jobs)
            if idle or time.monotonic() >= deadline:
                return idle

    def shutdown(self, timeout: float = 30.0) -> None:
        """Wait (bounded) for disk I/O, write the final state, stop the I/O threads and
        close the disk tier (its path is free for a new manager). Every later call
        that changes state raises ``CacheClosed``; reading (``block``, ``keys``,
        ``state``, counters, ``check_integrity``) still works. A second call does
        nothing; a bad ``timeout`` is a ValueError and shuts nothing down."""
        timeout = check_timeout("TieredBlockManager.shutdown", timeout)
        if self._closed:
            return
        self.wait_io(timeout)
        self._closed = True
        if self.cfg.state_path is not None:
            self._dirty = False
            try:
                _write_json(self.cfg.state_path, self.state())
            except OSError as exc:
                log.warning("tiering: final state dump failed: %s", exc)
        if self._own_executor:
            self._io.shutdown(timeout)
        if self.disk is not None:
            try:
                self.disk.close()
            except Exception as exc:  # closing is best effort; the process may be ending
                log.warning("tiering: closing the disk tier failed: %r", exc)
        for fd in self._row_fds:
            os.close(fd)
        self._row_fds = []
        if self.staging is not None:
            clear_staging(self.staging)
            try:
                os.rmdir(self.staging)
            except OSError:  # not empty (not ours) or gone: left as it is
                pass

    # ------------------------------------------------------------------ checking

    def check_integrity(self) -> None:
        problems = []
        try:
            self.index.check_integrity()
        except AssertionError as exc:
            problems.append(f"block index: {exc}")
        holdings: dict[Any, list[int]] = {}
        host_ready: set[bytes] = set()
        extents: dict[Any, bytes] = {}
        for k, (slot, _) in self._storing.items():
            if k in self.index:
                problems.append(f"{k.hex()}: storing and already in the index")
            holdings[k] = [slot]
        for slot in self._abandoned:
            holdings[("reset", slot)] = [slot]
        for k, (n, _) in self._reset_loads.items():  # a part of the key's load pins
            pins = self._load_pins.get(k, 0)
            if not 0 < n <= pins:
                problems.append(f"{k.hex()}: {n} load(s) from before a reset, {pins} load pin(s)")
                break
        for k in self.index.keys():
            loc = self.index.location(k)
            info = self.index.get(k)
            if not (loc is not None and info is not None):
                raise AssertionError(f"block {k.hex()}: listed by the index without a location")
            pins = (self._load_pins.get(k, 0) + (1 if k in self._demoting else 0)
                    + (1 if k in self._row_jobs else 0))
            if info.refs != pins:
                problems.append(f"{k.hex()}: {info.refs} refs, {pins} load/demotion pins")
            if loc.tier is Tier.HOST:
                host_ready.add(k)
                holdings[k] = [loc.handle]
                if loc.moving_to is not None:
                    problems.append(f"{k.hex()}: a host block moving to {loc.moving_to.value}")
                ext = self._disk_copy.get(k)
                if ext is not None:
                    if ext in extents:
                        problems.append(f"{k.hex()}: extent {ext} held twice")
                    extents[ext] = k
            elif loc.tier is Tier.DISK:
                if loc.handle in extents:
                    problems.append(f"{k.hex()}: extent {loc.handle} held twice")
                extents[loc.handle] = k
                if (loc.moving_to is Tier.HOST) != (k in self._promoting):
                    problems.append(f"{k.hex()}: promoting state and job disagree")
                if loc.moving_to is Tier.HOST:
                    holdings[k] = [loc.dest_handle]
                if (self._load_pins.get(k) and k not in self._rows) or k in self._disk_copy or (
                    k in self._from_disk
                ):
                    problems.append(f"{k.hex()}: a disk-only block with host-side state")
            else:
                problems.append(f"{k.hex()}: on {loc.tier.value}, which this manager has not")
        for k, (ext, _, staging, _) in self._staged.items():
            if k in self.index or k in self._storing:
                problems.append(f"{k.hex()}: going straight to disk and held elsewhere too")
            if ext in extents:
                problems.append(f"{k.hex()}: extent {ext} held twice")
            extents[ext] = k
            job = self._stage_jobs.get(staging)
            if job is not None and (job[2] or k not in {i[0] for i in job[1]}):
                problems.append(f"{k.hex()}: staged, but its job does not list it")
        for staging, (_, items, abandoned) in self._stage_jobs.items():
            for k, ext, _ in items:
                if abandoned:
                    extents[ext] = ("abandoned", k)
                elif self._staged.get(k, (None,))[0] != ext:
                    problems.append(f"{k.hex()}: a job of {staging} for a block not staged")
        for k, (_, ext, _) in self._fetching.items():
            if ext is not None:
                extents[ext] = ("fetch", k)
        for _, ext in self._fetch_abandoned:
            if ext is not None:
                extents[ext] = ("fetch abandoned", ext)
        stray = [k for k in self._fresh if k not in host_ready]
        if stray:
            problems.append(f"{stray[0].hex()}: held as freshly promoted but not on host")
        for name, keys in (("disk copies", self._disk_copy), ("demotions", self._demoting),
                           ("promotions", self._promoting), ("from-disk marks", self._from_disk),
                           ("load pins", self._load_pins), ("lost blocks", self._lost)):
            stray = [k for k in keys if k not in self.index]
            if stray:
                problems.append(f"{name} of blocks not in the index: {stray[0].hex()}")
        if not set(self._demoting) <= set(self._disk_copy):
            problems.append("a demotion without its disk copy")
        problems += self.rules.check()  # each tier's policy tracks exactly its blocks
        if not self._orphaned <= set(self._storing):
            problems.append("an orphaned store that is not in flight")
        unwritten = ({k for k in host_ready if k not in self._disk_copy}
                     if self.disk is not None else set())
        if set(self._unwritten) != unwritten:
            problems.append(f"{len(self._unwritten)} blocks listed to write down, "
                            f"{len(unwritten)} host blocks without a disk copy")
        try:
            self.pool.check_integrity(holdings)
        except AssertionError as exc:
            problems.append(f"host pool: {exc}")
        if self.rows is not None:
            rows = {k: [r] for k, r in self._rows.items()}
            for k, (_, r) in self._row_jobs.items():
                if k in rows:
                    problems.append(f"{k.hex()}: a staging row ready and being read")
                rows[k] = [r]
            stray = [k for k in rows if k not in self.index]
            if stray:
                problems.append(f"staging rows of blocks not in the index: {stray[0].hex()}")
            if not set(self._row_at) <= set(self._rows):
                problems.append("a staging row hold without its row")
            try:
                self.rows.check_integrity(rows)
            except AssertionError as exc:
                problems.append(f"load staging rows: {exc}")
        if self.disk is not None:
            try:
                self.disk.check_integrity()
            except AssertionError as exc:
                problems.append(str(exc))
            if self.disk.used_bytes() < len(extents) * self.disk.chunk_alloc_bytes:
                problems.append("disk ledger holds fewer chunks than the blocks' extents")
        elif extents:
            problems.append("disk extents without a disk tier")
        if problems:
            raise TableIntegrityError("tiering vLLM manager: " + "; ".join(problems[:20]))
