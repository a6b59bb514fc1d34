"""The eviction controller: decides what leaves the device, what comes back, and when.

``EvictionController`` composes three parts that share its request table,
in-flight ledger and stats: ``DeviceEviction`` (``tiering.control.eviction``),
``ReloadAdmission`` (``tiering.control.admission``) and ``HostCascade``
(``tiering.control.cascade``). ``docs/controller.md`` tells how a pass works, the
admission rule and why each estimate leans the way it does.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from tiering.control.admission import InFlightLedger, ReloadAdmission
from tiering.control.cascade import HostCascade
from tiering.control.config import ControllerConfig, EvictionReport
from tiering.control.eviction import DeviceEviction
from tiering.control.request_table import RequestTable, ResourceHandle
from tiering.control.stats import ControllerStats
from tiering.core.validate import check_clock, check_timeout, is_integral
from tiering.errors import BadRequestId, UnknownRequest, UnknownRequestError
from tiering.policies.base import Candidate, Policy
from tiering.types import Move, TransferResult

# UnknownRequest(Error) stay importable from here, their old home
__all__ = [
    "ControllerConfig", "EvictionController", "EvictionReport", "UnknownRequest",
    "UnknownRequestError",
]

log = logging.getLogger("tiering.control.controller")

_NO_RIDS: tuple[str, ...] = ()
_OFFLOADS = frozenset({Move.OFFLOAD_TO_HOST, Move.OFFLOAD_TO_DISK})


class EvictionController:
    """Offloads idle requests under device pressure, admits reloads, cascades host to disk.

    ``resources``: name -> resource with the hooks of ``tiering.control.protocols``
    (looked up once here). A resource that does not support eviction is only
    polled. ``pressure``: ``latest()`` returning a reading with ``fraction``
    and ``seq`` (a poller; None or ``seq == 0``: no sample yet, nothing is
    done), or ``read()`` returning a fraction (read once per call).
    ``device_capacity_bytes``: by default the sum of the resources' own.
    ``reload_priority(rid)``: optional base priority of a waiting reload.
    Not thread-safe: call it from the worker's step loop only.
    """

    def __init__(
        self,
        resources: Mapping[str, Any],
        policy: Policy,
        pressure: Any,
        config: ControllerConfig = ControllerConfig(),  # noqa: B008 - frozen, immutable
        *,
        device_capacity_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        reload_priority: Callable[[str], float] | None = None,
    ) -> None:
        if not isinstance(config, ControllerConfig):
            raise TypeError(f"config must be a ControllerConfig, got {type(config).__name__}")
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a tiering.policies.base.Policy, got {type(policy).__name__}")
        if not isinstance(resources, Mapping):
            raise TypeError(f"resources must be a mapping of name -> resource, got "
                            f"{type(resources).__name__}")
        if not resources:
            raise ValueError("resources must name at least one resource")
        check_clock("EvictionController", clock)
        if reload_priority is not None and not callable(reload_priority):
            raise TypeError(f"reload_priority must be callable or None, got {reload_priority!r}")
        for name in resources:
            if not isinstance(name, str) or not name:
                raise ValueError(f"resource names must be non-empty strings, got {name!r}")
        handles = {name: ResourceHandle(name, res) for name, res in resources.items()}
        latest = getattr(pressure, "latest", None)
        read = getattr(pressure, "read", None)
        if not callable(latest) and not callable(read):
            raise TypeError("pressure must offer latest() or read()")
        if device_capacity_bytes is None:
            offered = [h.device_capacity for h in handles.values() if h.device_capacity]
            if not offered:
                raise ValueError(
                    "device_capacity_bytes not given and no resource offers "
                    "device_capacity_bytes"
                )
            device_capacity_bytes = sum(offered)
        if not is_integral(device_capacity_bytes) or device_capacity_bytes <= 0:
            raise ValueError(
                f"device_capacity_bytes must be a positive integer, got {device_capacity_bytes!r}"
            )
        prio_handle = _priority_handle(policy, handles)
        cascade = tuple(h for h in handles.values() if h.cascades)
        if config.on_disk_full == "drop":
            for h in cascade:
                if h.drop is None:
                    raise ValueError(
                        f"on_disk_full='drop' but resource {h.name!r} offers no drop()"
                    )
        self._latest = latest if callable(latest) else None
        self._read = read if self._latest is None else None
        self._config = config
        self._clock = clock
        self._handles = handles
        self._evicting = tuple(h for h in handles.values() if h.evicts)
        # every resource with a poll() is polled; an evicting one's records settle the ledger
        self._polled = tuple((h, h.poll, h.evicts) for h in handles.values() if h.poll is not None)
        # a resource that hands out a completion feed reports to it whoever polls it
        self._feeds = {
            h.name: h.resource.completion_feed()
            for h in self._evicting if callable(getattr(h.resource, "completion_feed", None))
        }
        self._capacity = int(device_capacity_bytes)
        self._reads = 0
        self._stamp = 0
        self._stats = ControllerStats()
        self._table = RequestTable(h.name for h in self._evicting)  # the one membership table
        self._ledger = InFlightLedger(lag=2 if self._latest is not None else 1)
        self._eviction = DeviceEviction(
            handles, policy, config, self._table, self._ledger, self._stats, self._fresh_stamp,
            prio_handle,
            reload_limit_bytes=(config.high - config.reload_headroom) * self._capacity,
        )
        self._admission = ReloadAdmission(config, self._table, self._ledger, self._stats,
                                          self._members, self._sample, self._fresh_stamp,
                                          clock, self._capacity, reload_priority)
        self._cascade = HostCascade(cascade, policy, config, self._table, self._ledger,
                                    self._stats, prio_handle)

    # -- what the worker tells us -------------------------------------------------

    @property
    def config(self) -> ControllerConfig:
        return self._config

    @property
    def device_capacity_bytes(self) -> int:
        return self._capacity

    def add_request(self, rid: str, resource: str | None = None) -> None:
        """Register a live request, with all resources or (repeatable) one named one.

        Idempotent, as the cache's ``ingest_request`` is: registering a request
        with resources it already has changes nothing (not even its last use).
        """
        if not isinstance(rid, str) or not rid:
            raise BadRequestId(f"request id must be a non-empty str, got {rid!r}")
        if resource is not None and (not isinstance(resource, str)
                                     or resource not in self._handles):
            raise ValueError(
                f"request {rid!r}: unknown resource {resource!r}; known: {sorted(self._handles)}"
            )
        table = self._table
        known = table.names.get(rid)
        added = frozenset(self._handles) if resource is None else frozenset((resource,))
        if known is not None and added <= known:
            return
        if known is None:
            table.add(rid, self._clock())
            known = frozenset()
        table.register(rid, known | added)

    def remove_request(self, rid: str) -> None:
        """Forget a request that finished; its waiting reload, if any, is cancelled."""
        _check_rid(rid, "remove_request")
        names = self._table.names.get(rid)
        if names is None:
            raise UnknownRequest(f"unknown request {rid!r}")
        self._table.remove(rid)
        self._admission.forget(rid)
        for name in names:
            self._ledger.forget((name, rid))

    def requests(self) -> list[str]:
        """The registered requests, sorted."""
        return sorted(self._table.names)

    def knows(self, rid: str) -> bool:
        """Whether ``rid`` (a str) is registered."""
        _check_rid(rid, "knows")
        return rid in self._table.names

    def touch(self, rid: str) -> None:
        """The request ran now."""
        _check_rid(rid, "touch")
        table = self._table
        slot = table.slot.get(rid)
        if slot is None:
            raise UnknownRequest(f"unknown request {rid!r}")
        table.last_used[slot] = self._clock()
        self._eviction.touched(rid)

    def last_used(self, rid: str) -> float:
        """When the request last ran (``touch``), or was registered if it never has."""
        _check_rid(rid, "last_used")
        slot = self._table.slot.get(rid)
        if slot is None:
            raise UnknownRequest(f"unknown request {rid!r}")
        return float(self._table.last_used[slot])

    def _members(self, rid: str) -> tuple[ResourceHandle, ...] | None:
        """The evicting resources ``rid`` is registered with (None if unknown)."""
        names = self._table.names.get(rid)
        if names is None:
            return None
        return tuple(h for h in self._evicting if h.name in names)

    # -- pressure and completions ---------------------------------------------------

    def _sample(self) -> float | None:
        """Read the pressure source once; drop ledger entries the reading must show."""
        if self._latest is not None:
            reading = self._latest()
            if reading is None or reading.seq == 0:
                return None  # nothing sampled yet
            fraction = reading.fraction
            self._stamp = reading.seq
        else:
            fraction = self._read()
            self._reads += 1
            self._stamp = self._reads
        if (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real)
                or not 0.0 <= fraction < math.inf):
            raise ValueError(f"pressure source returned {fraction!r}; expected a fraction >= 0")
        if self._ledger:
            self._ledger.expire(self._stamp)
        return float(fraction)

    def _fresh_stamp(self) -> int:
        """The newest stamp there is now (taken just before or after a move)."""
        if self._latest is not None:
            reading = self._latest()
            return reading.seq if reading is not None else self._stamp
        return self._reads

    def _effective(self, fraction: float) -> float:
        """Device occupancy for eviction: never above the truth for long (see admission)."""
        ledger = self._ledger
        if not ledger:
            return fraction
        unseen = ledger.unseen_reload_bytes(self._stamp)
        return fraction + (unseen - ledger.releasing_bytes) / self._capacity

    def poll(self) -> None:
        """Poll every resource and settle the ledger from what each reports.

        ``evict_if_needed`` does this first; a worker that wants completions
        applied at another point of its step calls this, never the resources'
        own ``poll()`` (the records it returns would not reach the ledger).
        """
        try:
            self._poll()
        except BaseException:
            self._eviction.forget_finding()
            raise

    def synchronize(self, timeout: float = 60.0) -> None:
        """Wait for every resource's transfers (``synchronize(timeout)`` where it
        has one, else ``poll()``) and settle the ledger from what each reports.

        A worker that must wait for copies calls this, not a resource's own
        ``synchronize``, for the same reason as ``poll``. A resource's
        TimeoutError is raised after what did finish has been settled. A
        ``timeout`` that is not a finite number >= 0 is refused (ValueError)
        before any resource is waited on."""
        timeout = check_timeout("EvictionController.synchronize", timeout)
        try:
            self._poll(wait=timeout)
        except BaseException:
            self._eviction.forget_finding()
            raise

    def _poll(self, wait: float | None = None) -> None:
        """Poll every resource and settle (before the pressure read, so a completion is
        in that reading for a synchronous source). With ``wait``, a resource that
        offers ``synchronize`` is waited on for at most that long instead."""
        timed_out: TimeoutError | None = None
        for h, poll, evicts in self._polled:
            sync = getattr(h.resource, "synchronize", None) if wait is not None else None
            if sync is not None:
                try:
                    answer = sync(wait)
                except TimeoutError as exc:  # what finished was applied: settle it
                    timed_out = exc
                    answer = None
                if answer is None:  # its records wait for the next poll()
                    answer = poll()
            else:
                answer = poll()
            if not evicts:
                continue
            feed = self._feeds.get(h.name)
            if feed is not None:  # everything reported, also to whoever else polled
                answer = feed.take()
            if isinstance(answer, (str, bytes)) or not isinstance(answer, Sequence):
                raise TypeError(f"resource {h.name!r}: poll() returned {answer!r}; expected "
                                "a sequence of TransferResult records")
            if answer:
                self._settle(h, answer)
        if timed_out is not None:
            raise timed_out

    def _settle(self, h: ResourceHandle, records: Sequence[TransferResult]) -> None:
        ledger = self._ledger
        stamp = None
        for rec in records:
            if not isinstance(rec, TransferResult):
                raise TypeError(f"resource {h.name!r}: poll() reported {rec!r}; expected "
                                "TransferResult records")
            key = (h.name, rec.rid)
            if rec.move in _OFFLOADS:
                if key in ledger.moving:
                    if rec.ok and rec.state is not None:
                        stamp = self._fresh_stamp() if stamp is None else stamp
                        ledger.settle_offload(key, stamp)
                    else:  # failed (still resident) or removed: not leaving any more
                        ledger.forget_offload(key)
            elif rec.move is Move.DEMOTE:
                ledger.forget_demotion(key)
            elif not rec.ok and rec.rid in self._table:
                # a failed reload: the request is offloaded again, a candidate no more
                self._table.clear_reload(self._table.slot[rec.rid])
        self._stats.transfers_reported += len(records)

    # -- one pass -----------------------------------------------------------------

    def evict_if_needed(self, running: Collection[str]) -> EvictionReport:
        """Run one safe-point pass: offload under pressure, serve reloads, cascade.

        ``running``: the requests of this step, never offloaded (any
        collection of rids; unknown ones are ignored). A request that vanished
        from a resource or changed state under the controller is skipped and
        logged (``vanished_skips``). If the pass raises anyway (a resource
        breaking its contract, a bad pressure reading), no waiting reload is
        lost and no finding of that pass is kept. A ``running`` that is one str (not a
        collection of them) or not a collection is a TypeError, before anything is done.
        """
        _check_running(running, "evict_if_needed")
        try:
            return self._pass(running)
        except BaseException:
            self._eviction.forget_finding()
            raise

    def _pass(self, running: Collection[str]) -> EvictionReport:
        stats = self._stats
        stats.evict_calls += 1
        self._poll()
        fraction = self._sample()
        if fraction is None:
            return EvictionReport(math.nan, math.nan, _NO_RIDS, 0, _NO_RIDS, _NO_RIDS, _NO_RIDS, 0)
        before = self._effective(fraction)
        capacity = self._capacity
        offloaded: list[str] = []
        started: list[str] = []
        demoted: list[str] = []
        dropped: list[str] = []
        freed = skipped = 0
        now = None
        if before > self._config.high:
            now = self._clock()
            freed, skipped = self._eviction.offload_until(
                self._config.low * capacity, before * capacity, running, now, offloaded,
                inclusive=False,
            )
        queue = self._admission.queue
        if queue:
            now = self._clock() if now is None else now
            head = self._admission.serve(fraction, now, started)
            if head is not None:  # it has waited aging_s: make room for it
                target = self._admission.limit_bytes - self._admission.need_bytes(head)
                current = self._effective(fraction) * capacity
                if current > target:
                    n_before = len(offloaded)
                    more = self._eviction.offload_until(
                        target, current, running, now, offloaded, inclusive=True
                    )
                    freed += more.freed
                    skipped = max(skipped, more.skipped)
                    stats.make_room_offloads += len(offloaded) - n_before
        if self._cascade.handles:
            self._cascade.run(queue, self._clock, demoted, dropped)
        stats.skipped_running += skipped
        return EvictionReport(
            before, self._effective(fraction), tuple(offloaded), freed, tuple(demoted),
            tuple(dropped), tuple(started), skipped,
        )

    # -- reloads, planning, reporting ---------------------------------------------

    @property
    def demotions_in_flight(self) -> int:
        """Host -> disk demotions this controller started whose results have not come yet."""
        return len(self._ledger.demoting)

    def pending_reloads(self) -> tuple[str, ...]:
        """Waiting reloads, in the order they will be tried."""
        return tuple(e.rid for e in self._admission.queue.entries())

    def request_reload(self, rid: str) -> bool:
        """Start reloading ``rid`` now if it fits, else queue it; True if it started.

        A new request is tried at once unless the head of the queue (as the
        last ``evict_if_needed`` found it) has waited ``aging_s`` or more; then
        it queues behind. Parts on resources that cannot reload it yet make it
        wait. Raises for an unknown request, one with nothing offloaded, or
        one that could never fit under the admission limit; nothing changes
        then. A request already waiting stays where it is (False).
        """
        _check_rid(rid, "request_reload")
        return self._admission.request(rid)

    def serve_reloads(self) -> tuple[str, ...]:
        """Start the waiting reloads that fit now, best first; the rids started.

        What ``evict_if_needed`` does for the queue, without offloading anything to make
        room (that waits for its safe point). Safe to call before a step: a worker's
        ``poll`` calls it, so a request asked back starts once room appears even when no
        pass runs. Nothing is done before the first pressure sample."""
        queue = self._admission.queue
        if not queue:
            return _NO_RIDS
        try:
            fraction = self._sample()
            if fraction is None:
                return _NO_RIDS
            started: list[str] = []
            self._admission.serve(fraction, self._clock(), started)
        except BaseException:
            self._eviction.forget_finding()
            raise
        return tuple(started)

    def make_room(self, need_bytes: int, running: Collection[str]) -> tuple[str, ...]:
        """Offload idle requests, in policy order, until ``need_bytes`` of the device will be
        free once their copies land; the rids offloaded (none when that much is free
        already, or when no idle request has anything to give). For a worker whose
        ``allocate`` answered False: a pass offloads only above ``high``. ``running`` as for
        ``evict_if_needed``; ``need_bytes`` an int >= 0 and at most the device capacity
        (ValueError otherwise, nothing done: no offload could free more than the device)."""
        _check_running(running, "make_room")
        if not is_integral(need_bytes) or need_bytes < 0:
            raise ValueError(f"make_room: need_bytes must be an int >= 0, got {need_bytes!r}")
        if need_bytes > self._capacity:  # no offload frees it: refused, nothing offloaded
            raise ValueError(f"make_room: need_bytes {need_bytes} is more than the device "
                             f"holds ({self._capacity} bytes)")
        try:
            self._poll()
            fraction = self._sample()
            if fraction is None:
                return _NO_RIDS
            current = self._effective(fraction) * self._capacity
            target = self._capacity - int(need_bytes)
            if current <= target:
                return _NO_RIDS
            out: list[str] = []
            self._eviction.offload_until(target, current, running, self._clock(), out,
                                         inclusive=True)
        except BaseException:
            self._eviction.forget_finding()
            raise
        return tuple(out)

    def reload_refusal(self, rid: str) -> Exception | None:
        """The error ``request_reload(rid)`` would raise now (an unknown request, one with
        nothing offloaded, one that could never fit under the admission limit), or None
        when it would start or queue it. Changes nothing."""
        _check_rid(rid, "reload_refusal")
        return self._admission.refusal(rid)

    def plan_offload(self, running: Collection[str], need_bytes: int) -> tuple[Candidate, ...]:
        """The victims the policy would offload now to free ``need_bytes``; moves nothing.

        Same candidates as ``evict_if_needed`` would consider, best first, as
        few as add up to ``need_bytes`` (all of them if they fall short).
        """
        _check_running(running, "plan_offload")
        if isinstance(need_bytes, bool) or not isinstance(need_bytes, int) or need_bytes < 0:
            raise ValueError(f"need_bytes must be an int >= 0, got {need_bytes!r}")
        if need_bytes == 0:
            return ()
        return self._eviction.plan(running, need_bytes, self._clock())

    def stats(self) -> dict[str, float]:
        """Counters, byte totals and current figures as a plain dict of numbers."""
        out = self._stats.as_dict()
        queue = self._admission.queue
        out["reload_waits"] = len(queue)
        out["max_wait_s"] = max(out["max_wait_s"], queue.max_wait(self._clock()))
        out["reserved_reload_bytes"] = self._ledger.reserved_bytes
        out["releasing_bytes"] = self._ledger.releasing_bytes
        out["offloads_in_flight"] = len(self._ledger.moving)
        out["demotions_in_flight"] = len(self._ledger.demoting)
        out["live_requests"] = len(self._table)
        out["device_capacity_bytes"] = self._capacity
        return out

    def check_integrity(self) -> None:
        """The table, ledger and queue agree with each other; AssertionError names what not."""
        self._table.check_integrity()
        self._ledger.check_integrity()
        self._admission.check_integrity()
        for name, rid in (*self._ledger.moving, *self._ledger.demoting):
            if name not in self._table.names.get(rid, ()):
                raise AssertionError(f"in-flight move of {rid!r} on {name!r}: not registered")


def _check_rid(rid: object, what: str) -> None:
    if not isinstance(rid, str) or not rid:
        raise BadRequestId(f"EvictionController.{what}: a request id is a non-empty str, "
                           f"got {rid!r}")


_RUNNING_TYPES = frozenset({frozenset, set, list, tuple, dict})  # the step path's own: no ABC check


def _check_running(running: object, what: str) -> None:
    if type(running) in _RUNNING_TYPES:
        return
    if isinstance(running, (str, bytes)) or not isinstance(running, Collection):
        raise TypeError(
            f"EvictionController.{what}: running must be a collection of request ids "
            f"(a set, list or tuple), got {running!r}")


def _priority_handle(policy: Policy, handles: Mapping[str, ResourceHandle]
                     ) -> ResourceHandle | None:
    """The resource a PRIORITY policy asks, checked; None for any other policy."""
    name = policy.needs_priority_from
    if name is None:
        return None
    h = handles.get(name)
    if h is None:
        raise ValueError(
            f"policy {policy.name!r} needs priorities from resource {name!r}, "
            f"which is not one of {sorted(handles)}"
        )
    if not h.evicts:
        raise ValueError(
            f"policy {policy.name!r} needs priorities from resource {name!r}, "
            "which does not support eviction"
        )
    return h
