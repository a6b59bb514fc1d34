"""Bookkeeping the eviction controller needs between pressure samples.

Two pieces of state live here, each with one owner (the controller that
created them):

``InFlightLedger``
    Device bytes this controller has moved that the pressure source may not
    show yet. A pressure sample is a picture of the past: a reload whose slots
    were reserved a moment ago, or an offload whose source slots were freed a
    moment ago, may or may not be in it.

    Freshness is measured in *stamps*. For a source with sequence numbers
    (``latest().seq``) a stamp is a sequence number observed by the
    controller. A move that took effect after stamp ``b`` was observed is
    certainly *not* in a sample with ``seq <= b`` (published before it), and
    certainly *is* in a sample with ``seq >= a + 2``, where ``a`` is the stamp
    observed right after the move took effect: sample ``a + 1`` may have begun
    before that moment and been published after it, but sample ``a + 2`` began
    after ``a + 1`` was published. In between, it may or may not be. For a
    source without sequence numbers every ``read()`` is synchronous, the stamp
    is the number of reads made so far, and the next read certainly shows the
    move (``b == a`` and one newer read is enough).

    The two uses lean opposite ways, each to its safe side. Admission must not
    oversubscribe, so it counts a reload until the source *certainly* shows it
    (``reserved_bytes``). Eviction must not offload needlessly, so it counts a
    reload only while the reading *certainly* lacks it
    (``unseen_reload_bytes``), and subtracts an offload's release until the
    source certainly shows it (``releasing_bytes``); at worst it evicts a
    sample late, never twice for the same bytes.

    Reloads count from the moment ``reload()`` returns (the resource reserves
    the destination slots before it returns). Offloads count from the moment
    the resource says the request has left the device (``tier_of`` is no longer
    DEVICE, i.e. the copy completed and the source slots were freed); a
    resource without ``tier_of`` is assumed to free them before ``offload``
    returns. Admission never subtracts offloads: until a copy completes its
    source slots are really in use.

``ReloadQueue``
    Reloads that were refused for lack of room, in an order that cannot
    starve. See its docstring for the rule.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field


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

    def __bool__(self) -> bool:
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
        """Stop tracking an in-flight offload (its request is gone)."""
        nbytes = self._moving.pop(key, 0)
        self._releasing -= nbytes

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

    def max_wait(self, now: float) -> float:
        # a copy first: an exporter thread may call this while the worker changes the queue
        return max((now - e.enqueued_at for e in tuple(self._entries.values())), default=0.0)
