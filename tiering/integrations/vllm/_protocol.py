"""vLLM's load and store protocol over the manager's parts: lookups and load pins
(``Loads``), store batches placed on host or straight to disk (``Stores``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tiering.disk.ledger import DiskExtent
from tiering.integrations.vllm._cascade import Cascade
from tiering.integrations.vllm._cold import ColdFetches
from tiering.integrations.vllm._ctx import Ctx
from tiering.integrations.vllm._disk import DiskTier
from tiering.integrations.vllm._host import HostTier
from tiering.integrations.vllm._reads import DiskReads
from tiering.integrations.vllm._staging import StoreStaging
from tiering.integrations.vllm._state import (
    RESET_HOLD_STEPS,
    LoadWindow,
    Lookup,
    StoreDecision,
    log,
)
from tiering.types import Tier

__all__ = ["Loads", "Stores", "check_key", "check_keys"]


def check_key(op: str, key: object) -> None:
    if type(key) is not bytes or not key:
        raise ValueError(f"{op}: every key must be non-empty bytes, got {key!r}")


def check_keys(op: str, keys: Iterable[bytes]) -> list[bytes]:
    """``keys`` as a list of offload keys (non-empty ``bytes``); a ValueError naming
    the first bad one (a ``str`` or ``bytes`` given for the whole list included)."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"{op}: keys must be a sequence of bytes keys, got {keys!r}")
    out = list(keys)
    for k in out:
        check_key(op, k)
    return out


class Loads:
    """Lookups and loads: ``pins`` (key -> loads in flight; each also a reference in the
    index) and ``reset_loads`` (key -> (those of its pins from before a reset, the
    step of the reset): taken back ``RESET_HOLD_STEPS`` later)."""

    def __init__(self, ctx: Ctx, host: HostTier, staging: StoreStaging, cold: ColdFetches,
                 reads: DiskReads) -> None:
        self._ctx, self._host, self._staging, self._cold, self._reads = (
            ctx, host, staging, cold, reads)
        self.budget = host.num_slots + (reads.rows.num_pages if reads.rows is not None else 0)
        self.pins: dict[bytes, int] = {}
        self.reset_loads: dict[bytes, tuple[int, int]] = {}

    def lookup(self, key: bytes, window: LoadWindow | None) -> Lookup:
        ctx = self._ctx
        ctx.counters.lookups += 1
        if window is None:
            return self._lookup(key, may_wait=True)
        if key in window.seen:
            window.restart()
        window.seen.add(key)
        if window.held >= self.budget:
            ctx.counters.lookups_over_budget += 1
            return Lookup.MISS
        now = ctx.clock()
        waited = window.since is not None and now - window.since >= ctx.cfg.load_wait_s
        if waited and self._would_wait(key):
            ctx.counters.lookups_timed_out += 1
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

    def _in_flight(self, key: bytes) -> bool:
        return key in self._host.storing or key in self._staging.staged or key in self._cold.fetching

    def _would_wait(self, key: bytes) -> bool:
        loc = self._ctx.index.location(key)
        return self._in_flight(key) or (
            loc is not None and loc.tier is not Tier.HOST and key not in self._ctx.lost
            and key not in self._reads.row_of
        )

    def _lookup(self, key: bytes, may_wait: bool, parent: bytes | None = None) -> Lookup:
        """``may_wait``: a miss may start a fetch from the shared tier (a wait)."""
        ctx = self._ctx
        if self._in_flight(key):
            ctx.counters.pending_answers += 1
            return Lookup.PENDING
        loc = ctx.index.location(key)
        if key in ctx.lost:
            return Lookup.MISS
        if loc is None:
            if may_wait and self._cold.start(key, parent):
                ctx.counters.pending_answers += 1
                return Lookup.PENDING
            return Lookup.MISS
        if loc.tier is Tier.HOST:
            # the policies hear it at the load (once per request); until then the chain
            # of a block this request promotes is not a host victim (free_host_slots)
            ctx.counters.host_hits += 1
            return Lookup.HIT
        reads = self._reads
        if key in reads.row_of:  # read into the load staging file, checked
            ctx.counters.host_hits += 1
            return Lookup.HIT
        if loc.moving_to is None and key not in reads.row_jobs:
            # Without a host slot (or a staging row) now, every one is held by something
            # that ends on its own (a store, a promotion, a load): ask vLLM to come back.
            if not reads.start_promotion(key) and not reads.start_row_read(key, loc.handle):
                ctx.counters.promotions_deferred += 1
        ctx.counters.pending_answers += 1
        return Lookup.PENDING

    def loadable(self, key: bytes) -> bool:
        loc = self._ctx.index.location(key)
        return not (loc is None or (loc.tier is not Tier.HOST and key not in self._reads.row_of)
                    or key in self._ctx.lost)

    def prepare(self, keys: list[bytes], request: object) -> list[int]:
        """Pin loadable ``keys``; per key its host slot or ``num_slots + row``."""
        ctx = self._ctx
        index = ctx.index
        now = ctx.clock()
        if keys:
            ctx.tell(request, index.get(keys[0]).parent, keys,
                     [index.location(k).tier for k in keys], now)
        slots = []
        for k in keys:
            index.acquire(k)
            self.pins[k] = self.pins.get(k, 0) + 1
            self._host.loaded(k)
            loc = index.location(k)
            assert loc is not None
            if loc.tier is not Tier.HOST:  # straight from disk, through its staging row
                ctx.counters.loads_from_disk += 1
                slots.append(self._reads.take_row(k))
                continue
            if k in self._host.from_disk:
                ctx.counters.loads_from_disk += 1
            else:
                ctx.counters.loads_from_host += 1
            slots.append(loc.handle)
        ctx.dirty = True
        return slots

    def complete(self, keys: list[bytes]) -> None:
        need: dict[bytes, int] = {}
        for k in keys:
            need[k] = need.get(k, 0) + 1
        for k, n in need.items():
            if self.pins.get(k, 0) < n:
                raise ValueError(f"complete_load: block {k.hex()} has no load in flight")
        for k, n in need.items():
            r = self.reset_loads.get(k)
            if r is not None:
                if r[0] > n:
                    self.reset_loads[k] = (r[0] - n, r[1])
                else:
                    del self.reset_loads[k]
        for k in keys:
            self._ctx.index.release(k)
            left = self.pins[k] - 1
            if left:
                self.pins[k] = left
            else:
                del self.pins[k]
                if k in self._reads.row_of:  # its staging row has served its loads
                    self._reads.drop_row(k)

    def reset(self) -> None:
        for k, n in self.pins.items():
            self.reset_loads[k] = (n, self._ctx.step)

    def take_back(self) -> None:
        """Complete the loads left from a reset ``RESET_HOLD_STEPS`` steps ago."""
        step = self._ctx.step
        for k, (n, at) in list(self.reset_loads.items()):
            if step - at < RESET_HOLD_STEPS:
                continue
            del self.reset_loads[k]
            left = min(n, self.pins.get(k, 0))
            if left:
                log.warning("tiering: %d load(s) of %s never completed after a reset; "
                            "taken back", left, k.hex())
                self.complete([k] * left)

    def problems(self) -> list[str]:
        for k, (n, _) in self.reset_loads.items():  # a part of the key's load pins
            pins = self.pins.get(k, 0)
            if not 0 < n <= pins:
                return [f"{k.hex()}: {n} load(s) from before a reset, {pins} load pin(s)"]
        return []


class Stores:
    """Store batches: each new block is admitted by the host's policy, then placed in a
    host slot or, with a disk tier, straight to disk; a block the host's policy refuses
    goes straight to disk when the disk's policy admits it. ``refusing``: the last batch was
    refused (logged once until one is accepted)."""

    def __init__(self, ctx: Ctx, host: HostTier, disk: DiskTier, staging: StoreStaging,
                 cascade: Cascade) -> None:
        self._ctx, self._host, self._disk, self._staging, self._cascade = (
            ctx, host, disk, staging, cascade)
        self.refusing = False

    @staticmethod
    def batch(keys: list[bytes], parents: Sequence[bytes | None] | None
              ) -> list[tuple[bytes, bytes | None]]:
        """``keys`` with their parents, each key once (its first); a ValueError naming a
        parent that is neither bytes nor None. Changes nothing."""
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
        return batch

    def prepare(self, keys: list[bytes], batch: list[tuple[bytes, bytes | None]],
                request: object) -> StoreDecision | None:
        """Place ``batch`` (``Stores.batch`` of ``keys``)."""
        ctx, host, index = self._ctx, self._host, self._ctx.index
        now = ctx.clock()
        if batch:
            ctx.tell(request, batch[0][1], [k for k, _ in batch], (), now)
        depth: dict[bytes, int] = {}
        skipped: set[bytes] = set()
        new: list[tuple[bytes, bytes | None]] = []  # admitted by the host's policy
        past_host: list[tuple[bytes, bytes | None]] = []  # refused there, the disk's takes it
        accepted: list[tuple[bytes, bytes | None]] = []  # both, in the batch's order
        has_disk = self._disk.disk is not None
        for k, p in batch:
            if k in index or k in host.storing or k in self._staging.staged:
                if k in index:
                    depth[k] = index.get(k).depth
                continue
            if p is not None and p in skipped:
                skipped.add(k)
                continue
            pinfo = index.get(p) if p is not None else None
            d = pinfo.depth + 1 if pinfo is not None else depth.get(p, -1) + 1 if p else 0
            if ctx.rules.admits(Tier.HOST, k, now, depth=d):
                new.append((k, p))
            elif has_disk and ctx.rules.admits(Tier.DISK, k, now, depth=d):
                past_host.append((k, p))
            else:
                skipped.add(k)
                ctx.counters.stores_not_admitted += 1
                continue
            depth[k] = d
            accepted.append((k, p))
        evicted: list[bytes] = []
        if not has_disk:
            if not self._cascade.free_host_slots(len(new), evicted, set(keys)):
                return self._refuse(len(new))
            n_host = len(new)
        else:  # what does not fit on host, or the host refused, goes straight to disk
            self._cascade.free_host_slots(len(new), evicted, set(keys), partial=True)
            n_host = min(len(new), host.pool.free_pages)
        on_host = new[:n_host]
        to_disk = new[n_host:] + past_host
        staged: list[tuple[bytes, bytes | None, DiskExtent]] = []
        for k, p in to_disk:
            ext = self._disk.reserve(k, evicted)
            if ext is None:
                break  # the disk is full of busy blocks: the rest is not stored
            staged.append((k, p, ext))
        orphans = 0
        if evicted:  # a block whose parent was dropped meanwhile left with it, as in the cache
            gone = set(evicted)
            for k, p in accepted:
                if p is not None and p in gone:
                    gone.add(k)
                    orphans += 1
            on_host = [(k, p) for k, p in on_host if k not in gone]
            for k, _, ext in staged:
                if k in gone:
                    self._disk.release(ext)
            staged = [x for x in staged if x[0] not in gone]
            ctx.counters.dropped += orphans
        if accepted and not on_host and not staged and not orphans:
            return self._refuse(len(accepted))
        self.refusing = False
        slots = host.begin_stores(on_host)
        staging = None
        if staged:
            staging, rows = self._staging.stage(staged)
            slots.extend(rows)
            ctx.counters.stores_staged += len(staged)
        ctx.counters.stores_started += len(on_host) + len(staged)
        ctx.dirty = True
        return StoreDecision([*(k for k, _ in on_host), *(k for k, _, _ in staged)], slots,
                             evicted, staging)

    def _refuse(self, n: int) -> None:
        """A store batch of which no block could be placed: counted, the state file
        marked changed, logged once until a store succeeds again."""
        self._ctx.counters.stores_refused += 1
        self._ctx.dirty = True
        if not self.refusing:
            self.refusing = True
            log.warning("tiering: a store of %d block(s) was refused: every tier is full of "
                        "pinned blocks (counted in stores_refused; logged once until a store "
                        "is accepted again)", n)
        return None

    def complete(self, keys: list[bytes], success: bool) -> None:
        ctx, host = self._ctx, self._host
        stored = []
        now = ctx.clock()
        for f in self._staging.files(keys):
            self._staging.finish(f, success)
        for k in keys:
            st = host.end_store(k)
            if st is None:
                continue  # already complete (keys repeat across jobs), staged, or never ours
            slot, parent, orphan = st
            if orphan:  # its parent was dropped meanwhile: it goes too
                host.pool.release(k, [slot])
                ctx.counters.dropped += 1
            elif success:
                ctx.insert(k, parent, Tier.HOST, slot, now)  # an unknown parent: a chain's first
                self._disk.stored(k)
                stored.append(k)
                ctx.counters.stores_completed += 1
            else:
                host.pool.release(k, [slot])
                ctx.counters.stores_failed += 1
        if stored:
            ctx.event(stored, "host", False)
        ctx.dirty = True
