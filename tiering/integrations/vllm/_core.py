"""The engine-independent part of the vLLM backend: config, the shared host slab,
the scheduler-side manager (on the project's block index, block policies and the
block store's rules) and the worker-side mover. The config and slab live in
``_config``, the mover in ``_mover``, the manager's small types in ``_state``, how
its tiers map onto ``BlockRules`` in ``_rules``; this module holds the manager's
front and re-exports the rest. Nothing here imports vLLM (``_spec`` wraps it in
vLLM's classes), so all of it is unit-tested in the project's own environment.

The manager is made of parts, each the one owner of its tables (docs/vllm.md,
"Inside the manager"): the shared book (``_ctx``), the host tier (``_host``), the
disk tier and its write-ahead (``_disk``), the reads that serve loads from disk
(``_reads``), stores straight to disk (``_staging``), the shared cold tier
(``_cold``, ``_publish``), the cascade (``_cascade``), vLLM's load and store
protocol (``_protocol``) and the integrity check (``_integrity``).
``TieredBlockManager`` wires them and is the only API.

Processes and ownership. vLLM runs the manager in its scheduler process and one
worker per rank in other processes. The host tier is a slab of ``num_slots``
page slots per rank, kept in a shared memory file that both sides map
(``HostSlab``). The manager makes every decision (through the rules) and keeps
every table; its I/O threads only move bytes host <-> disk (``reap`` applies
their results on the caller's thread), reading or writing only slots that no
worker job can touch at that time (a slot being demoted is pinned; a slot being
promoted is not yet visible). The worker only copies bytes between vLLM's
per-layer KV tensors and the slab slots named in a load or store spec.

A block is loadable only when its bytes are in a host slot and known good: a
disk hit is promoted into the host tier first (its chunk crc32c checked by the
disk store) while lookup answers "pending"; a promotion that fails its check
drops the block, and lookup answers "miss", so vLLM recomputes it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tiering.core.executor import WRITE, PriorityExecutor
from tiering.core.validate import check_timeout
from tiering.disk import DiskPageStore
from tiering.errors import CacheClosed, TableIntegrityError
from tiering.integrations.vllm._cascade import Cascade
from tiering.integrations.vllm._cold import ColdFetches
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
from tiering.integrations.vllm._ctx import Ctx
from tiering.integrations.vllm._disk import DiskTier
from tiering.integrations.vllm._host import HostTier
from tiering.integrations.vllm._integrity import check_manager
from tiering.integrations.vllm._mover import (
    GroupLayout,
    JobResult,
    LayerCopy,
    TieredMover,
    plan_blocks,
)
from tiering.integrations.vllm._protocol import Loads, Stores, check_key, check_keys
from tiering.integrations.vllm._publish import Publisher
from tiering.integrations.vllm._reads import DiskReads
from tiering.integrations.vllm._rules import manager_rules
from tiering.integrations.vllm._staging import StoreStaging
from tiering.integrations.vllm._state import (
    PROMOTED_HOLD_STEPS,
    RESET_HOLD_STEPS,
    BlockView,
    Counters,
    DiskState,
    Event,
    HostState,
    LoadWindow,
    Lookup,
    StoreDecision,
    clear_staging,
    log,
    manager_state,
)
from tiering.policies.blocks import BlockPolicy, make_block_policy
from tiering.types import Tier

__all__ = [  # the manager, and what the tests and ``_spec`` import from here
    "OUR_KEYS", "PROMOTED_HOLD_STEPS", "RESET_HOLD_STEPS", "BlockView", "Counters", "DiskState",
    "Event", "GroupLayout", "HostSlab", "HostState", "JobResult", "LayerCopy", "LoadWindow",
    "Lookup", "StoreDecision", "TableIntegrityError", "TieredBlockManager", "TieredConfig",
    "TieredMover", "default_host_dir", "open_disk", "plan_blocks", "remove_leftover_slabs",
    "slab_path",
]


class TieredBlockManager:
    """The scheduler-side manager on the project's ``BlockIndex`` (engine independent).

    Where a block is lives in ``index`` (a ``tiering.blocks.BlockIndex``): its
    location is HOST with its host slot as handle while it has a host copy, else
    DISK with its ``DiskExtent``; a promotion is a move DISK -> HOST in flight. Load
    pins and the pin of a demotion in flight are the index's reference counts. What
    the index cannot express is kept by the tier it belongs to: slots reserved for
    stores in flight (a block enters the index when its bytes have landed), the disk
    copy of a block whose location is HOST (being written, or a clean copy, so
    evicting its host copy is a move to DISK that drops nothing), which host copies
    came from disk, and blocks found damaged that cannot be dropped yet (a
    descendant is busy; they answer MISS).

    Chains: vLLM's keys are opaque; a block is inserted after the parent vLLM's
    side names (the previous block of the same request and KV group, when that
    block is in the index), else as a chain's first block. Dropping a block
    drops its cached descendants (a prefix lookup stops at the first miss).

    Policies: one ``tiering.policies.blocks`` policy per tier (``cfg.policy``), every
    call to them made by the block store's rules (``rules``, a
    ``tiering.resources.kv_prefix_rules.BlockRules``, as in the cache and the
    replay; what vLLM's API changes is in ``_rules``). ``slabs`` are the per-rank
    host slabs; ``disk`` is optional. Not thread-safe: all calls come from vLLM's
    scheduler thread; disk I/O runs on ``executor`` threads and is reaped on that
    thread.
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
        self.cfg = cfg
        self.disk_root = disk_root
        ctx = self._book = Ctx(cfg, clock)
        host = self.host_tier = HostTier(ctx, slabs)
        n = host.num_slots
        publisher = self.publisher = Publisher(ctx, shared)
        # write-through by default: a host block with a disk copy is evicted for free
        headroom = cfg.demote_headroom if cfg.demote_headroom is not None else n
        self.disk_tier = DiskTier(ctx, host, disk, headroom, self._remove, publisher)
        # each tier's policy, sized by its tier; every call to them goes through the
        # block store's rules (see ``_rules``), which hold them
        ctx.rules = manager_rules(
            ctx.index, make_block_policy(cfg.policy, capacity=n),
            make_block_policy(cfg.policy, capacity=max(1, disk.capacity_pages))
            if disk is not None else None)
        self.staging = cfg.staging if disk is not None else None
        if self.staging is not None:
            os.makedirs(self.staging, exist_ok=True)
            clear_staging(self.staging)
        self.cascade = Cascade(ctx, host, self.disk_tier)
        # loads straight from disk: a disk block with no host slot free for it is read
        # (checked) into a row of the load staging file (one per rank) and loaded from there
        self.disk_reads = DiskReads(ctx, host, self.disk_tier, self.staging,
                                    self.cascade.free_host_slots, self._remove)
        self.cascade.attach(self.disk_reads)
        self.cold = ColdFetches(ctx, shared, self.disk_tier, host.page_bytes)
        self.store_staging = StoreStaging(ctx, host, self.disk_tier, publisher, self.staging)
        self.loads = Loads(ctx, host, self.store_staging, self.cold, self.disk_reads)
        self.stores = Stores(ctx, host, self.disk_tier, self.store_staging, self.cascade)
        self._own_executor = executor is None
        ctx.io = executor or PriorityExecutor(cfg.io_threads, "tiering-vllm-io")
        self._reported = Counters()  # what stats_delta reported last
        self._dump: Any = None
        self._closed = False

    # ------------------------------------------------------------------ the parts' state

    index = property(lambda self: self._book.index, doc="where every block is")
    rules = property(lambda self: self._book.rules, doc="every policy call (``BlockRules``)")
    counters = property(lambda self: self._book.counters)
    slabs = property(lambda self: self.host_tier.slabs)
    num_slots = property(lambda self: self.host_tier.num_slots)
    page_bytes = property(lambda self: self.host_tier.page_bytes)
    pool = property(lambda self: self.host_tier.pool, doc="the host slots (``PagePool``)")
    disk = property(lambda self: self.disk_tier.disk, doc="the disk tier (None: host only)")
    headroom = property(lambda self: self.disk_tier.headroom)
    shared = property(lambda self: self.cold.shared, doc="the shared cold tier, or None")
    rows = property(lambda self: self.disk_reads.rows, doc="load staging rows (``PagePool``)")
    load_staging = property(lambda self: self.disk_reads.load_staging)
    load_budget = property(lambda self: self.loads.budget,
                           doc="blocks one request may hold for one load: host slots + rows")

    @property
    def clock(self) -> Callable[[], float]:
        """The injected clock every part reads (settable: a test's own clock)."""
        return self._book.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._book.clock = clock

    @property
    def host_policy(self) -> BlockPolicy:
        return self._book.rules.policies[Tier.HOST]

    @property
    def disk_policy(self) -> BlockPolicy | None:
        """The disk tier's policy (None without a disk tier)."""
        return self._book.rules.policies[Tier.DISK] if self.disk is not None else None

    # ------------------------------------------------------------------ reading

    def block(self, key: bytes) -> BlockView | None:
        """The block's state in both tiers, or None when no tier holds (or stores) it."""
        st = self.host_tier.storing.get(key)
        if st is not None:
            return BlockView(key, HostState.STORING, st[0], DiskState.NONE, None, 0, False,
                             st[1], 0)
        sg = self.store_staging.staged.get(key)
        if sg is not None:
            return BlockView(key, HostState.NONE, None, DiskState.WRITING, sg[0], 0, False,
                             sg[1], 0)
        index = self._book.index
        loc = index.location(key)
        if loc is None:
            return None
        info = index.get(key)
        assert info is not None
        if loc.tier is Tier.HOST:
            ext = self.disk_tier.copies.get(key)
            disk = (DiskState.NONE if ext is None else
                    DiskState.WRITING if key in self.disk_tier.demoting else DiskState.READY)
            return BlockView(key, HostState.READY, loc.handle, disk, ext,
                             self.loads.pins.get(key, 0), key in self.host_tier.from_disk,
                             info.parent, info.depth)
        host = HostState.PROMOTING if loc.moving_to is Tier.HOST else HostState.NONE
        return BlockView(key, host, loc.dest_handle, DiskState.READY, loc.handle, 0, False,
                         info.parent, info.depth)

    def keys(self) -> list[bytes]:
        """Every block a tier holds or is storing."""
        return [*self._book.index.keys(), *self.host_tier.storing, *self.store_staging.staged]

    def loaded_from_disk(self, key: bytes) -> bool:
        return key in self.host_tier.from_disk

    def _open(self, op: str) -> None:
        if self._closed:
            raise CacheClosed(f"TieredBlockManager.{op}: the manager is shut down")

    def _remove(self, key: bytes, reason: str, evicted: list[bytes] | None = None) -> bool:
        return self.cascade.remove(key, reason, evicted)

    # ------------------------------------------------------------------ reaping I/O

    def reap(self) -> None:
        """Settle finished promotions, demotions and stores to disk (non-blocking)."""
        ctx = self._book
        now = ctx.clock()
        if self.store_staging.jobs:
            self.store_staging.reap(now)
        if self.cold.busy():
            self.cold.reap(now)
        if self.disk_reads.row_jobs:
            self.disk_reads.reap_rows()
        self.disk_reads.reap_promotions(now)
        self.disk_tier.reap()
        if ctx.lost:
            self.cascade.retry_lost()

    # ------------------------------------------------------------------ vLLM-facing operations

    def lookup(self, key: bytes, window: LoadWindow | None = None) -> Lookup:
        """Where ``key`` is for a load: HIT (on host, checked), PENDING (being stored or
        promoted: ask again), MISS. With the request's ``window`` (see ``LoadWindow``)
        a request never holds more than ``load_budget`` blocks in one pass nor waits
        longer than ``cfg.load_wait_s``: past either, the answer is MISS."""
        self._open("lookup")
        check_key("lookup", key)  # one key per call, on the scheduler's path: no list
        if window is not None and not isinstance(window, LoadWindow):
            raise ValueError(f"lookup: window must be a LoadWindow or None, got {window!r}")
        self.reap()
        return self.loads.lookup(key, window)

    def prepare_load(self, keys: Sequence[bytes], request: object = None) -> list[int]:
        """Pin the keys for a load; per key its host slot, or ``num_slots + row`` for a
        block loaded straight from disk through row ``row`` of ``load_staging``'s file
        (``f"{load_staging}.r{rank}"``). Every key must have answered HIT. The first
        load or store of a ``request`` (the caller's object for it; None: this call is
        a request of its own) tells the policies the request and these hits."""
        self._open("prepare_load")
        keys = check_keys("prepare_load", keys)
        for k in keys:
            if not self.loads.loadable(k):
                b = self.block(k)
                raise ValueError(
                    f"prepare_load: block {k.hex()} is not loadable from host "
                    f"(state {None if b is None else b.host.value})"
                )
        return self.loads.prepare(keys, request)

    def complete_load(self, keys: Iterable[bytes]) -> None:
        self._open("complete_load")
        self.loads.complete(check_keys("complete_load", keys))

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark the blocks held as used now (the index's last use). The policies hear a
        request's hits once, at its load (``BlockRules.tell``), not here."""
        self._open("touch")
        keys = check_keys("touch", keys)
        ctx = self._book
        now = ctx.clock()
        for k in keys:
            if k in ctx.index:
                ctx.index.touch(k, now)

    def prepare_store(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None,
        request: object = None,
    ) -> StoreDecision | None:
        """Host slots for the keys not yet held; None (nothing changed) if they do not fit.

        ``parents[i]`` is the block before ``keys[i]`` in its request (None: unknown).
        Each new block arrives on the host as a device victim does in the cache: the
        host's policy admits it (``admit``, root first), and a block it refuses goes on
        to the disk, whose policy admits it or not; a block no tier admits is not stored,
        nor are the blocks after it in this batch. Room is then made for the admitted
        ones by the rules (``Cascade.free_host_slots``); a block whose parent left while
        room was made is not stored either. With a disk tier, what does not fit on the
        host goes straight to disk. ``request``: as for ``prepare_load``."""
        self._open("prepare_store")
        keys = check_keys("prepare_store", keys)
        if parents is not None and len(parents) != len(keys):
            raise ValueError(
                f"prepare_store: {len(keys)} keys but {len(parents)} parents"
            )
        batch = self.stores.batch(keys, parents)  # refused before any I/O is reaped
        self.reap()
        return self.stores.prepare(keys, batch, request)

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Settle stores: their blocks enter the index (``success``) or their slots are
        freed. Keys with no store in flight are skipped (vLLM repeats keys across jobs)."""
        self._open("complete_store")
        keys = check_keys("complete_store", keys)
        if not isinstance(success, bool):
            raise ValueError(f"complete_store: success must be a bool, got {success!r}")
        self.stores.complete(keys, success)
        self._settle()  # not a step: vLLM completes many stores in one

    def maintain(self) -> None:
        """One scheduler step's end (vLLM's on_schedule_end): count the step (the holds,
        ``PROMOTED_HOLD_STEPS`` and ``RESET_HOLD_STEPS``, are in these steps), reap I/O,
        write cold host blocks down to disk to keep headroom, dump state."""
        self._open("maintain")
        self._book.step += 1
        if self.host_tier.abandoned or self.loads.reset_loads:
            self.host_tier.take_back()
            self.loads.take_back()
        if self.disk_reads.row_at:
            self.disk_reads.expire(self.loads.pins)
        self._settle()

    def _settle(self) -> None:
        """Reap I/O, keep the demotion headroom, dump state (no step is counted)."""
        self.reap()
        if self.disk is not None:
            self.disk_tier.demote_for_headroom()
        ctx = self._book
        if self.cfg.state_path is not None and ctx.dirty and (
            self._dump is None or self._dump.done()
        ):
            if self._dump is not None and self._dump.exception() is not None:
                log.warning("tiering: writing the state file %s failed: %r",
                            self.cfg.state_path, self._dump.exception())
            ctx.dirty = False
            self._dump = ctx.io.submit(WRITE, _write_json, self.cfg.state_path, self.state())

    def _busy(self) -> bool:
        return bool(self.disk_reads.busy() or self.disk_tier.demoting or self.store_staging.jobs
                    or self.cold.busy())

    def has_pending_work(self) -> bool:
        return self._busy() or (
            self.cfg.state_path is not None
            and (self._book.dirty or (self._dump is not None and not self._dump.done()))
        )

    def take_events(self) -> list[Event]:
        ctx = self._book
        out, ctx.events = ctx.events, []
        return out

    def stats_delta(self) -> dict[str, int]:
        """Counter increases since the last call (for vLLM's stats hook)."""
        now = self._book.counters
        out = {}
        for f in now.__dataclass_fields__:
            d = getattr(now, f) - getattr(self._reported, f)
            if d:
                out[f] = d
        self._reported = Counters(**now.__dict__)
        return out

    def state(self) -> dict[str, Any]:
        """What the state file holds (``manager_state``)."""
        return manager_state(self)

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
        ctx = self._book
        for k in list(ctx.index.keys()):
            if k in ctx.index and k not in ctx.lost:  # not gone with an ancestor
                self.cascade.remove(k, "reset")
        self.disk_tier.reset()
        self.host_tier.abandon_stores()
        self.store_staging.reset()
        self.cold.reset()
        self.loads.reset()
        ctx.dirty = True

    def wait_io(self, timeout: float = 30.0) -> bool:
        """Wait (at most ``timeout``) for disk I/O in flight, then reap it; True if none is left.
        Never called on vLLM's step path (tests and shutdown only). A timeout that is
        not a finite number >= 0 is a ValueError."""
        timeout = check_timeout("TieredBlockManager.wait_io", timeout)
        deadline = time.monotonic() + timeout
        while True:  # a job reaped may start the next (a block found in the shared tier)
            futs = [*self.disk_reads.futures(), *self.disk_tier.demoting.values(),
                    *(j[0] for j in self.store_staging.jobs.values()), *self.cold.futures(),
                    *([self._dump] if self._dump is not None else [])]
            for fut in futs:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:  # a fault is handled (and logged) by reap
                    pass
            self.reap()
            idle = not self._busy()
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
            self._book.dirty = False
            try:
                _write_json(self.cfg.state_path, self.state())
            except OSError as exc:
                log.warning("tiering: final state dump failed: %s", exc)
        if self._own_executor:
            self._book.io.shutdown(timeout)
        if self.disk is not None:
            try:
                self.disk.close()
            except Exception as exc:  # closing is best effort; the process may be ending
                log.warning("tiering: closing the disk tier failed: %r", exc)
        self.disk_reads.close()
        if self.staging is not None:
            clear_staging(self.staging)
            try:
                os.rmdir(self.staging)
            except OSError:  # not empty (not ours) or gone: left as it is
                pass

    def check_integrity(self) -> None:
        """Raise ``TableIntegrityError`` naming what is inconsistent between the parts'
        tables, the block index, the host pool and the disk store's ledger."""
        check_manager(self._book, self.host_tier, self.disk_tier, self.disk_reads,
                      self.store_staging, self.cold, self.loads)
