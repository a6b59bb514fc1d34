"""Reload admission and the bookkeeping it needs between pressure samples.

``InFlightLedger``: device bytes this controller moved that the pressure
source may not show yet, and the demotions in flight (the one in-flight
ledger). ``ReloadQueue``: refused reloads, in an order that cannot starve.
``ReloadAdmission``: starts a reload only if it fits under the admission
limit, and serves the queue. ``docs/controller.md`` explains the stamps, the
two opposite estimates and the passing rule.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiering.control.config import ControllerConfig
from tiering.control.stats import ControllerStats
from tiering.errors import UnknownRequest
from tiering.types import Tier

log = logging.getLogger("tiering.control.controller")

# outcomes of one reload attempt
ADMITTED, GONE, INELIGIBLE, NO_ROOM = range(4)


class InFlightLedger:
    """Reload reservations and offload releases not yet visible to the pressure source.

    ``lag`` is how many newer stamps an entry waits for before the source
    certainly shows it (2 for sequence-numbered sources, 1 for plain reads).
    """

    def __init__(self, lag: int) -> None:
        if lag < 1:
            raise ValueError(f"InFlightLedger: lag must be >= 1, got {lag!r}")
        self._lag = lag
        # (stamp before, expire_at, nbytes), both stamps non-decreasing
        self._reloads: deque[tuple[int, int, int]] = deque()
        self._reserved = 0
        # offloads whose copy has not completed: key -> bytes
        self._moving: dict[Hashable, int] = {}
        # offloads that completed but may not show in the source yet
        self._released: deque[tuple[int, int]] = deque()
        self._releasing = 0
        # host -> disk demotions this controller started, not yet reported done: key -> bytes
        self._demoting: dict[Hashable, int] = {}

    # -- reading ----------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        """Device bytes of admitted reloads the source may not show yet (admission)."""
        return self._reserved

    def unseen_reload_bytes(self, stamp: int) -> int:
        """Device bytes of admitted reloads the sample ``stamp`` certainly lacks (eviction)."""
        total = 0
        for before, _, nbytes in reversed(self._reloads):
            if before < stamp:
                break
            total += nbytes
        return total

    @property
    def releasing_bytes(self) -> int:
        """Device bytes of offloads the source may still count as used."""
        return self._releasing

    @property
    def moving(self) -> dict[Hashable, int]:
        """Offloads still in flight (read-only by convention): key -> bytes."""
        return self._moving

    @property
    def demoting(self) -> dict[Hashable, int]:
        """Demotions still in flight (read-only by convention): key -> host bytes."""
        return self._demoting

    def demoting_bytes(self, name: str) -> int:
        """Host bytes of resource ``name`` that demotions in flight will free."""
        if not self._demoting:
            return 0
        return sum(n for (owner, _), n in self._demoting.items() if owner == name)

    def __bool__(self) -> bool:
        """Whether the pressure reading needs adjusting (demotions do not touch the device)."""
        return bool(self._reloads or self._moving or self._released)

    # -- changing ---------------------------------------------------------------

    def add_reload(self, nbytes: int, before: int, after: int) -> None:
        """Count a reload reserved after stamp ``before`` and before stamp ``after``."""
        if nbytes <= 0:
            return
        expire_at = after + self._lag
        if self._reloads:  # stamps never go backwards; stay ordered if a source misbehaves
            last_before, last_expire, _ = self._reloads[-1]
            before = max(before, last_before)
            expire_at = max(expire_at, last_expire)
        self._reloads.append((before, expire_at, nbytes))
        self._reserved += nbytes

    def add_offload(self, key: Hashable, nbytes: int) -> None:
        """Count an offload whose copy is still in flight (its source slots still held)."""
        if key in self._moving:
            raise ValueError(f"offload {key!r} is already in flight")
        if nbytes <= 0:
            return
        self._moving[key] = nbytes
        self._releasing += nbytes

    def add_released(self, nbytes: int, stamp: int) -> None:
        """Count an offload whose source slots were freed before ``stamp`` was observed."""
        if nbytes <= 0:
            return
        expire_at = stamp + self._lag
        if self._released and self._released[-1][0] > expire_at:
            expire_at = self._released[-1][0]
        self._released.append((expire_at, nbytes))
        self._releasing += nbytes

    def settle_offload(self, key: Hashable, stamp: int) -> None:
        """The offload ``key`` completed before ``stamp`` was observed."""
        nbytes = self._moving.pop(key)
        self._releasing -= nbytes
        self.add_released(nbytes, stamp)

    def forget_offload(self, key: Hashable) -> None:
        """Stop tracking an in-flight offload (its copy failed, or its request is gone)."""
        nbytes = self._moving.pop(key, 0)
        self._releasing -= nbytes

    def add_demotion(self, key: Hashable, nbytes: int) -> None:
        """Count a host -> disk demotion in flight (its host bytes are leaving)."""
        if key in self._demoting:
            raise ValueError(f"demotion {key!r} is already in flight")
        self._demoting[key] = nbytes

    def forget_demotion(self, key: Hashable) -> None:
        """The demotion ``key`` completed, failed, or its request is gone."""
        self._demoting.pop(key, None)

    def forget(self, key: Hashable) -> None:
        """Forget every move in flight of ``key`` (its request was removed)."""
        self.forget_offload(key)
        self.forget_demotion(key)

    def check_integrity(self) -> None:
        """Totals equal the entries they count; raise AssertionError naming the mismatch."""
        reserved = sum(n for _, _, n in self._reloads)
        if reserved != self._reserved:
            raise AssertionError(f"reserved {self._reserved} bytes, entries add to {reserved}")
        releasing = sum(self._moving.values()) + sum(n for _, n in self._released)
        if releasing != self._releasing:
            raise AssertionError(f"releasing {self._releasing} bytes, entries add to {releasing}")
        if any(n <= 0 for n in self._moving.values()) or any(n < 0 for n in self._demoting.values()):
            raise AssertionError("an in-flight entry counts no bytes")

    def expire(self, current: int) -> None:
        """Drop every entry the sample with stamp ``current`` certainly shows."""
        reloads = self._reloads
        while reloads and reloads[0][1] <= current:
            self._reserved -= reloads.popleft()[2]
        released = self._released
        while released and released[0][0] <= current:
            self._releasing -= released.popleft()[1]


@dataclass(slots=True)
class WaitingReload:
    """One refused reload waiting in the queue.

    ``started`` names the resources whose part of the request was already
    reloaded (a request spread over several resources is admitted as a whole,
    but a resource may still refuse its part).
    """

    rid: str
    key: float
    order: int
    enqueued_at: float
    started: set[str] = field(default_factory=set)


class ReloadQueue:
    """Waiting reloads, best first, with aging so that none starves.

    Effective priority of a waiting reload at time ``now`` is
    ``base + (now - enqueued_at) / aging_s``, where ``base`` is the optional
    ``reload_priority(rid)`` taken when it was queued. Every entry ages at the
    same rate, so the order never changes while they wait: it is the order of
    ``enqueued_at / aging_s - base`` (smaller first), ties by arrival. With
    ``aging_s == 0`` aging is infinitely fast and the order is plain arrival.

    The passing rule (applied by the controller when it serves the queue): the
    best waiting reload that is eligible but does not fit is the *head*. Later
    reloads may be admitted past the head only while the head has waited less
    than ``aging_s``; from then on nothing behind it is admitted until it is.
    With bounded base priorities a newcomer ranks behind a waiting reload once
    it arrives more than ``(max base - min base) * aging_s`` later, so only
    finitely many reloads can ever rank ahead of any waiting one; each of them
    in turn becomes the head and, once it has waited ``aging_s``, holds back
    everything behind it, so room it needs is no longer taken by others; the
    controller also offloads idle requests to make that room.
    """

    def __init__(self, aging_s: float) -> None:
        self._aging_s = aging_s
        self._heap: list[tuple[float, int, str]] = []
        self._entries: dict[str, WaitingReload] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries

    def key_for(self, enqueued_at: float, base: float) -> float:
        """The static ordering key (smaller is served first)."""
        if self._aging_s == 0:
            return enqueued_at
        return enqueued_at / self._aging_s - base

    def push(self, rid: str, now: float, base: float = 0.0) -> WaitingReload:
        if rid in self._entries:
            raise ValueError(f"request {rid!r} is already waiting for a reload")
        self._order += 1
        entry = WaitingReload(rid, self.key_for(now, base), self._order, now)
        self._entries[rid] = entry
        heapq.heappush(self._heap, (entry.key, entry.order, rid))
        return entry

    def remove(self, rid: str) -> WaitingReload | None:
        """Forget ``rid``'s waiting reload (its heap slot is skipped later)."""
        return self._entries.pop(rid, None)

    def drain_in_order(self) -> Iterator[WaitingReload]:
        """Yield waiting entries best first, taking each out of the heap.

        The caller must either ``remove`` a yielded entry (admitted or gone) or
        ``restore`` it once it has stopped iterating (restored earlier, it would
        be yielded again); entries not yet yielded when the caller stops stay put.
        """
        heap = self._heap
        entries = self._entries
        while heap:
            key, order, rid = heapq.heappop(heap)
            entry = entries.get(rid)
            if entry is None or entry.order != order:
                continue  # removed, or re-queued since
            yield entry

    def restore(self, entry: WaitingReload) -> None:
        """Put back an entry ``drain_in_order`` yielded and that keeps waiting."""
        if self._entries.get(entry.rid) is entry:
            heapq.heappush(self._heap, (entry.key, entry.order, entry.rid))

    def entries(self) -> list[WaitingReload]:
        """Waiting entries, best first (a copy)."""
        return sorted(self._entries.values(), key=lambda e: (e.key, e.order))

    def check_integrity(self) -> None:
        """Every waiting entry is in the heap (none stranded); AssertionError if not."""
        live = {(e.key, e.order, e.rid) for e in self._entries.values()}
        missing = live - set(self._heap)
        if missing:
            raise AssertionError(f"waiting reloads missing from the heap: {sorted(missing)}")

    def max_wait(self, now: float) -> float:
        # a copy first: an exporter thread may call this while the worker changes the queue
        return max((now - e.enqueued_at for e in tuple(self._entries.values())), default=0.0)


class ReloadAdmission:
    """Admits reloads under the limit and serves the waiting ones best first.

    Shares the controller's request table, ledger and stats. ``members(rid)``:
    the evicting handles of a known request (None if unknown); ``sample()``:
    the pressure fraction now (None before the first sample); ``stamp()``: the
    newest stamp there is now.
    """

    def __init__(
        self,
        config: ControllerConfig,
        table: Any,
        ledger: InFlightLedger,
        stats: ControllerStats,
        members: Callable[[str], Sequence[Any] | None],
        sample: Callable[[], float | None],
        stamp: Callable[[], int],
        clock: Callable[[], float],
        capacity: int,
        reload_priority: Callable[[str], float] | None,
    ) -> None:
        self._config = config
        self._table = table
        self._ledger = ledger
        self._stats = stats
        self._members = members
        self._sample = sample
        self._stamp = stamp
        self._clock = clock
        self._capacity = capacity
        self._reload_priority = reload_priority
        self.limit_bytes = (config.high - config.reload_headroom) * capacity
        self.queue = ReloadQueue(config.aging_s)
        self._head: WaitingReload | None = None  # the head found by the last queue pass

    def refusal(self, rid: str) -> Exception | None:
        """The error ``request(rid)`` would raise (unknown, nothing offloaded, larger than
        the admission limit), or None; asks the resources, changes nothing."""
        members = self._members(rid)
        if members is None:
            return UnknownRequest(f"unknown request {rid!r}")
        if rid in self.queue:
            return None
        parts = [h for h in members if h.is_offloaded(rid)]
        if not parts:
            return ValueError(f"request {rid!r} has nothing offloaded to reload")
        need = sum(h.reload_bytes(rid) for h in parts if h.reload_bytes is not None)
        if need > self.limit_bytes:
            return ValueError(
                f"request {rid!r} needs {need} bytes to reload, more than the admission "
                f"limit of {int(self.limit_bytes)} bytes ((high - reload_headroom) x capacity)"
            )
        return None

    def request(self, rid: str) -> bool:
        """``EvictionController.request_reload``: start now if it fits, else queue."""
        err = self.refusal(rid)
        if err is not None:
            raise err
        queue = self.queue
        if rid in queue:
            return False
        base = 0.0
        if self._reload_priority is not None:
            base = float(self._reload_priority(rid))
            if not math.isfinite(base):
                raise ValueError(f"reload_priority({rid!r}) returned {base!r}; expected finite")
        now = self._clock()
        head = self._head
        may_pass = (
            head is None or head.rid not in queue or now - head.enqueued_at < self._config.aging_s
        )
        entry = queue.push(rid, now, base)
        if may_pass:
            try:
                fraction = self._sample()
            except BaseException:
                queue.remove(rid)  # nothing changed
                raise
            if fraction is not None:
                outcome = self._try(entry, fraction * self._capacity, now)
                if outcome in (ADMITTED, GONE):
                    queue.remove(rid)
                    return outcome == ADMITTED
        self._stats.reload_refusals += 1
        return False

    def need_bytes(self, entry: WaitingReload) -> int:
        """Device bytes the parts of ``entry`` not yet started need (0 if it vanished)."""
        rid = entry.rid
        try:
            return sum(
                h.reload_bytes(rid) for h in self._members(rid) or ()
                if h.name not in entry.started and h.reload_bytes is not None
                and h.is_offloaded(rid)
            )
        except Exception as err:
            self._skip(entry.rid, "reload_bytes", err)
            return 0

    def _skip(self, rid: str, what: str, err: BaseException) -> None:
        self._stats.vanished_skips += 1
        log.warning("request %r: %s failed (%s: %s); its reload is dropped", rid, what,
                    type(err).__name__, err)

    def _try(self, entry: WaitingReload, current_bytes: float, now: float) -> int:
        """Admit and start one waiting reload if it fits; say what happened. A request
        that vanished from a resource, or changed state under it, is GONE (logged)."""
        rid = entry.rid
        ledger = self._ledger
        members = self._members(rid)
        if members is None:
            return GONE
        try:
            parts = [h for h in members if h.name not in entry.started and h.is_offloaded(rid)]
            eligible = all(self._eligible(h, rid) for h in parts)
            if parts and eligible:
                needs = [h.reload_bytes(rid) if h.reload_bytes is not None else 0
                         for h in parts]
                sources = [h.tier_of(rid) if h.tier_of is not None else Tier.HOST
                           for h in parts]
        except Exception as err:  # the resource no longer knows it
            self._skip(rid, "a reload hook", err)
            return GONE
        if not parts:
            if not entry.started:
                return GONE  # back already, or dropped: nothing to reload
            return self._admitted(entry, now)
        if not eligible:
            return INELIGIBLE
        if current_bytes + ledger.reserved_bytes + sum(needs) > self.limit_bytes:
            return NO_ROOM
        stats = self._stats
        for h, need, source in zip(parts, needs, sources, strict=True):
            before = self._stamp()
            try:
                started = h.reload(rid)
            except Exception as err:  # changed state under the controller
                self._skip(rid, "reload", err)
                return GONE
            if not started:
                stats.reload_resource_refusals += 1
                return NO_ROOM
            entry.started.add(h.name)
            ledger.add_reload(need, before, self._stamp())
            stats.bytes_reloaded += need
            if source is Tier.DISK:
                stats.bytes_disk_to_device += need
            else:
                stats.bytes_host_to_device += need
        return self._admitted(entry, now)

    def _eligible(self, h: Any, rid: str) -> bool:
        key = (h.name, rid)
        ledger = self._ledger
        return key not in ledger.moving and key not in ledger.demoting and h.can_reload(rid)

    def _admitted(self, entry: WaitingReload, now: float) -> int:
        stats = self._stats
        stats.reloads_started += 1
        stats.max_wait_s = max(stats.max_wait_s, now - entry.enqueued_at)
        self._table.mark_reload(entry.rid, now)
        return ADMITTED

    def serve(self, fraction: float, now: float, started: list[str]) -> WaitingReload | None:
        """Retry waiting reloads best first; return the head if it may no longer be passed.

        Every entry drained and still waiting is put back, even when this raises.
        """
        queue = self.queue
        current = fraction * self._capacity
        aging = self._config.aging_s
        head: WaitingReload | None = None
        keep: list[WaitingReload] = []
        blocked = False
        try:
            for entry in queue.drain_in_order():
                keep.append(entry)
                outcome = self._try(entry, current, now)
                if outcome in (ADMITTED, GONE):
                    keep.pop()
                    queue.remove(entry.rid)
                    if outcome == ADMITTED:
                        started.append(entry.rid)
                    continue
                if outcome == NO_ROOM and head is None:
                    head = entry
                    if now - entry.enqueued_at >= aging:
                        blocked = True
                        break
        finally:
            for entry in keep:
                queue.restore(entry)
            self._head = head
        return head if blocked else None

    def forget(self, rid: str) -> None:
        self.queue.remove(rid)

    def pending(self) -> list[str]:
        return [e.rid for e in self.queue.entries()]

    def check_integrity(self) -> None:
        """Every waiting entry is in the heap once and names a known request."""
        self.queue.check_integrity()
        for rid in self.pending():
            if self._members(rid) is None:
                raise AssertionError(f"waiting reload {rid!r} names an unknown request")
