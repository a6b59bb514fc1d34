"""The eviction controller: decides what leaves the device, what comes back, and when.

A serving worker owns one ``EvictionController``. It tells the controller
which requests exist (``add_request`` / ``remove_request``), when each ran
(``touch``), and at a safe point between steps calls
``evict_if_needed(running)``. The controller never looks inside a resource: it
drives each one through the eviction hooks of ``tiering.protocols`` and ranks
victims with a ``policies.base.Policy``.

One call to ``evict_if_needed`` does, in order:

1. ``poll()`` every resource that offers it (completes finished transfers);
2. reads the pressure source once and works out the *effective* device
   occupancy: the reading, plus reloads this controller started after that
   reading was taken, minus offloads (in flight, or completed so recently
   that the reading may not show it) whose bytes it still counts (see
   ``tiering.admission``);
3. if that is above ``high``: ranks the idle requests (not running, not
   reloaded within ``min_residency_s``, ``reclaimable > 0``) with the policy
   and offloads them in order until the projection falls under ``low``;
4. retries waiting reloads, best first (see ``ReloadQueue`` for the order and
   the rule that keeps any of them from starving); if the head of the queue
   has waited ``aging_s`` and still does not fit, offloads idle requests until
   it does;
5. for each resource with a host tier whose host occupancy is above
   ``host_high``: demotes its coldest host-resident requests to disk until the
   projection falls under ``host_low``; a refused demotion (disk full) is kept
   on host or dropped for recompute as ``on_disk_full`` says, and counted.

With no pressure and nothing waiting, a call does a fixed amount of work per
resource and none per request. Over ``high`` with nothing it may offload (every
request running, just reloaded, in flight or not reclaimable), the first call
scans every request and the calls after it reuse that finding until something
that could change it has happened (``evict_if_needed`` lists what): such a
call compares ``running`` with the running requests of the scan (no work per
request when the very same frozenset or tuple is passed again) and asks no
resource about any request.

Finding victims among many requests: the controller keeps each request's slot,
last use and resource membership in numpy columns, so the idle candidates are
found by array operations and handed to the policy as a
``policies.CandidateBatch``. The policy's order is read front to back in
chunks (``policies.OrderCursor``) sized to free about the bytes needed, so
only a prefix a little longer than the victims is sorted. A policy that
orders by the bytes (``Policy.needs_reclaimable``: largest, cost) gets every
idle request's ``reclaimable`` up front, from one ``reclaimable_many`` call
where the resource offers it; for one that does not (lru, priority) they are
asked only for the requests the walk of its order reaches (a chunk at a time
from ``reclaimable_many``, else one request at a time). A PRIORITY policy's
resource is asked ``get_offload_priority`` (or ``get_offload_priority_many``)
once for each idle request registered with it (each with bytes to reclaim,
when those were asked up front). ``Candidate`` records are built only for the
victims ``plan_offload`` returns.

Reload admission: a reload needing ``need`` bytes (``reload_bytes``; 0 when
the resource does not say) starts only if
``current + reserved + need <= (high - reload_headroom) * capacity``, where
``current`` is the latest pressure reading in bytes and ``reserved`` the bytes
of reloads this controller started that the reading may not include yet: a
reload stays reserved until the source has produced a sample that certainly
began after the resource reserved its slots (two newer sequence numbers for a
poller, the next ``read()`` for a synchronous source; ``tiering.admission``
explains why). In-flight offloads are *not* subtracted there: until their
copies complete their source slots are really in use. Eviction uses the
opposite, equally safe estimate, so a reservation is never counted twice.

A reload that cannot start waits. Waiting reloads are tried best first
(arrival order with aging, plus the optional ``reload_priority``); a later one
may start past the best waiting one that does not fit only while that one
has waited less than ``aging_s``. After that nothing passes it, and idle
requests are offloaded to make room for it, so no reload starves. A request
whose reload started is not offloaded again for ``min_residency_s``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import numpy as np

from policies.base import Candidate, CandidateBatch, OrderCursor, Policy
from tiering.admission import InFlightLedger, ReloadQueue, WaitingReload
from tiering.controller_config import (
    ControllerConfig,
    EvictionReport,
    UnknownRequestError,
)
from tiering.request_table import RequestTable, ResourceHandle, bytes_answer, bytes_answers
from tiering.stats import ControllerStats
from tiering.types import Tier

_NO_RIDS: tuple[str, ...] = ()


# outcomes of one reload attempt
_ADMITTED, _GONE, _INELIGIBLE, _NO_ROOM = range(4)

# collections whose contents cannot change: passing the same one again is the same set
_IMMUTABLE = (frozenset, tuple)


def _uncounted(poll: Callable[[], Any]) -> Callable[[], int]:
    """``poll`` with its answer dropped (0): for a resource that is never asked to offload."""

    def run() -> int:
        poll()
        return 0

    return run


class _NothingToOffload:
    """What the last scan over ``high`` that found nothing it may offload saw.

    ``running``: the requests it was told are running (a frozen copy), plus
    known ones that joined them since; ``skipped``: how many of those are
    known; ``seen``: the collection last passed, kept only when immutable;
    ``exempt_since``: when the earliest minimum-residency exemption then in
    force began (None if none); ``room``: what the evicting resources' host
    and disk gauges read then. Owned by one controller; see
    ``EvictionController.evict_if_needed`` for when it is dropped.
    """

    __slots__ = ("running", "skipped", "seen", "exempt_since", "room")

    def __init__(
        self,
        running: frozenset[str],
        seen: Collection[str] | None,
        skipped: int,
        exempt_since: float | None,
        room: tuple[int, ...],
    ) -> None:
        self.running = running
        self.seen = seen
        self.skipped = skipped
        self.exempt_since = exempt_since
        self.room = room


class EvictionController:
    """Offloads idle requests under device pressure, admits reloads, cascades host to disk.

    ``resources``: name -> resource with the hooks of ``tiering.protocols``;
    optional hooks are looked up once here (as is ``supports_eviction``). A
    resource that does not support eviction is never asked anything but
    ``poll``. ``pressure``: an object with ``latest()`` returning a reading
    with ``fraction`` and ``seq`` (a poller; ``None`` or ``seq == 0`` means no
    sample yet, and then nothing is offloaded or admitted), or with ``read()``
    returning a fraction (a synchronous source, read once per call). ``device_capacity_bytes`` converts bytes
    to fractions; by default the sum of the resources' own
    ``device_capacity_bytes``. ``reload_priority(rid)``: optional base priority
    of a waiting reload (higher is served sooner). Not thread-safe: call it
    from the worker's step loop only.
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
            raise TypeError(f"policy must be a policies.base.Policy, got {type(policy).__name__}")
        if not resources:
            raise ValueError("resources must name at least one resource")
        for name in resources:
            if not isinstance(name, str) or not name:
                raise ValueError(f"resource names must be non-empty strings, got {name!r}")
        handles = {name: ResourceHandle(name, res) for name, res in resources.items()}

        latest = getattr(pressure, "latest", None)
        read = getattr(pressure, "read", None)
        if not callable(latest) and not callable(read):
            raise TypeError("pressure must offer latest() or read()")
        self._latest = latest if callable(latest) else None
        self._read = read if self._latest is None else None

        if device_capacity_bytes is None:
            offered = [h.device_capacity for h in handles.values() if h.device_capacity]
            if not offered:
                raise ValueError(
                    "device_capacity_bytes not given and no resource offers "
                    "device_capacity_bytes"
                )
            device_capacity_bytes = sum(offered)
        if isinstance(device_capacity_bytes, bool) or int(device_capacity_bytes) <= 0:
            raise ValueError(
                f"device_capacity_bytes must be a positive integer, got {device_capacity_bytes!r}"
            )

        prio_name = policy.needs_priority_from
        prio_handle = None
        if prio_name is not None:
            prio_handle = handles.get(prio_name)
            if prio_handle is None:
                raise ValueError(
                    f"policy {policy.name!r} needs priorities from resource {prio_name!r}, "
                    f"which is not one of {sorted(handles)}"
                )
            if not prio_handle.evicts:
                raise ValueError(
                    f"policy {policy.name!r} needs priorities from resource {prio_name!r}, "
                    "which does not support eviction"
                )
        cascade = tuple(h for h in handles.values() if h.cascades)
        if config.on_disk_full == "drop":
            for h in cascade:
                if h.drop is None:
                    raise ValueError(
                        f"on_disk_full='drop' but resource {h.name!r} offers no drop()"
                    )

        self._config = config
        self._policy = policy
        self._clock = clock
        self._reload_priority = reload_priority
        self._handles = handles
        self._evicting = tuple(h for h in handles.values() if h.evicts)
        # what an evicting resource's poll completes may change its ``reclaimable``
        # answers, so its count is watched (see ``_NothingToOffload``); another's is not
        self._polls = tuple(
            h.poll if h.evicts else _uncounted(h.poll)
            for h in handles.values() if h.poll is not None
        )
        # the host and disk gauges of the evicting resources; None when a finding of
        # nothing to offload may not be kept: an evicting resource has no poll() to say
        # when its transfers complete
        self._gauges: tuple[Callable[[], int], ...] | None = None
        if all(h.poll is not None for h in self._evicting):
            self._gauges = tuple(g for h in self._evicting for g in h.room_gauges)
        self._cascade = cascade
        self._prio_handle = prio_handle
        self._capacity = int(device_capacity_bytes)
        self._high = config.high
        self._low = config.low
        self._limit_bytes = (config.high - config.reload_headroom) * self._capacity

        # A policy that orders without the bytes (lru, priority) gets them
        # asked for only as the walk of its order reaches each request; any
        # other is handed the bytes of every idle request, asked up front.
        self._ask_lazily = not policy.needs_reclaimable
        self._names: dict[str, frozenset[str]] = {}  # rid -> every resource it was added to
        self._members: dict[str, tuple[ResourceHandle, ...]] = {}  # rid -> its evicting resources
        self._table = RequestTable(h.name for h in self._evicting)
        self._reloaded_at: dict[str, float] = {}
        self._ledger = InFlightLedger(lag=2 if self._latest is not None else 1)
        self._queue = ReloadQueue(config.aging_s)
        self._head: WaitingReload | None = None  # the head found by the last queue pass
        self._reads = 0
        self._stamp = 0
        self._stats = ControllerStats()
        # the last scan over ``high`` that found nothing to offload, while it still holds
        self._nothing: _NothingToOffload | None = None
        # (keep the attributes few: past about 29, CPython 3.11 stops specializing
        # attribute reads on this object and the idle step gets measurably slower)

    # -- what the worker tells us -------------------------------------------------

    @property
    def config(self) -> ControllerConfig:
        return self._config

    @property
    def device_capacity_bytes(self) -> int:
        return self._capacity

    def add_request(self, rid: str, resource: str | None = None) -> None:
        """Register a live request, with all resources or (repeatable) one named one."""
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request id must be a non-empty string, got {rid!r}")
        known = self._names.get(rid, frozenset())
        if resource is None:
            if known:
                raise ValueError(f"request {rid!r} is already registered")
            added = frozenset(self._handles)
        else:
            if resource not in self._handles:
                raise ValueError(
                    f"request {rid!r}: unknown resource {resource!r}; "
                    f"known: {sorted(self._handles)}"
                )
            if resource in known:
                raise ValueError(
                    f"request {rid!r} is already registered with resource {resource!r}"
                )
            added = known | {resource}
        self._names[rid] = added
        self._nothing = None
        if len(added) == len(self._handles):
            members = self._evicting  # shared tuple, the common case
        else:
            members = tuple(h for h in self._evicting if h.name in added)
        self._members[rid] = members
        table = self._table
        slot = table.slot.get(rid)
        if slot is None:
            slot = table.add(rid, self._clock())
        for h in members:
            table.member[h.name][slot] = True

    def remove_request(self, rid: str) -> None:
        """Forget a request that finished; its waiting reload, if any, is cancelled."""
        members = self._members.pop(rid, None)
        if members is None:
            raise UnknownRequestError(f"unknown request {rid!r}")
        del self._names[rid]
        self._nothing = None
        self._table.remove(rid)
        self._reloaded_at.pop(rid, None)
        self._queue.remove(rid)
        for h in members:
            h.demoting.pop(rid, None)
            self._ledger.forget_offload((h.name, rid))

    def touch(self, rid: str) -> None:
        """The request ran now."""
        table = self._table
        slot = table.slot.get(rid)
        if slot is None:
            raise UnknownRequestError(f"unknown request {rid!r}")
        table.last_used[slot] = self._clock()
        nothing = self._nothing
        if nothing is not None and rid not in nothing.running:
            # it ran though the last scan found it idle: what it holds may have changed
            self._nothing = None

    def last_used(self, rid: str) -> float:
        """When the request last ran (``touch``), or was registered if it never has."""
        table = self._table
        slot = table.slot.get(rid)
        if slot is None:
            raise UnknownRequestError(f"unknown request {rid!r}")
        return float(table.last_used[slot])

    # -- pressure -----------------------------------------------------------------

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
        if not 0.0 <= fraction < math.inf:
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

    def _settle_offloads(self) -> None:
        """Offloads whose copy completed start counting down to a fresh sample.

        Called before the pressure read, so the completion is in that reading
        for a synchronous source; a copy that completes between this check and
        the read is subtracted twice for one call (under-evicting, never
        over-admitting: admission does not use offload releases). A request
        still on the device that is ``reclaimable`` again had its copy fail
        (a request in flight is never reclaimable): it is no longer counted as
        leaving.
        """
        handles = self._handles
        ledger = self._ledger
        done = []
        for key in tuple(ledger.moving):
            h, rid = handles[key[0]], key[1]
            if h.tier_of(rid) is not Tier.DEVICE:
                done.append(key)
            elif h.reclaimable(rid) > 0:
                ledger.forget_offload(key)  # the copy failed; it stayed resident
                self._nothing = None
        if done:
            self._nothing = None
            stamp = self._fresh_stamp()
            for key in done:
                ledger.settle_offload(key, stamp)

    def _effective(self, fraction: float) -> float:
        """Device occupancy for eviction: never above the truth for long (see admission)."""
        ledger = self._ledger
        if not ledger:
            return fraction
        unseen = ledger.unseen_reload_bytes(self._stamp)
        return fraction + (unseen - ledger.releasing_bytes) / self._capacity

    # -- eviction -----------------------------------------------------------------

    def evict_if_needed(self, running: Collection[str]) -> EvictionReport:
        """Run one safe-point pass: offload under pressure, serve reloads, cascade.

        ``running``: the requests of this step, which are never offloaded
        (any collection of rids; unknown ones are ignored).

        A scan for victims that found nothing it may offload (no idle request
        past its minimum residency, not in flight, with ``reclaimable > 0``)
        is not repeated while that finding must still hold: the calls in
        between report and count exactly what a scan would have, and each scan
        not made adds one to ``scans_skipped``. The finding is dropped, and the
        next call over ``high`` scans again, as soon as any of these happens:

        - a request is added or removed;
        - a request that was not running at the scan is touched (it ran, so
          what it holds on the device may have changed), or a request that
          was running is missing from ``running`` (it may be idle now; more
          requests running changes nothing, but those that joined must keep
          running from then on);
        - the earliest minimum-residency exemption then in force runs out;
        - this controller starts a move (offload, reload, demotion, drop), or
          sees an offload or demotion it started complete or fail;
        - an evicting resource's ``poll()`` returns anything but 0 (it
          completed or failed transfers; a completed reload is exempt for a
          while, but a failed offload is a candidate at once, and either may
          free room below the device);
        - the bytes in use on an evicting resource's host or disk
          (``host_used_bytes``, ``disk_used_bytes``, where offered) differ from
          what they were at the scan: ``reclaimable`` may say 0 for lack of
          room there, and room can come back through a path the controller
          does not see, such as the worker freeing a request's KV.

        Pressure and targets are not on the list: a finding of no candidate
        holds for any occupancy and any target. A finding is never kept when
        an evicting resource has no ``poll()``, since then nothing says when
        its transfers complete. The rule assumes what the hooks already
        promise: a resource's ``reclaimable`` answers change only through its
        own hooks, the requests it holds, completions that its ``poll()``
        reports, and the room below its device.
        """
        stats = self._stats
        stats.evict_calls += 1
        for poll in self._polls:
            if poll() != 0:  # something completed (or the resource does not say)
                self._nothing = None
        if self._ledger.moving:
            # before the read: a copy seen complete now is complete in the reading too
            self._settle_offloads()
        fraction = self._sample()
        if fraction is None:
            return EvictionReport(math.nan, math.nan, _NO_RIDS, 0, _NO_RIDS, _NO_RIDS, _NO_RIDS, 0)
        before = self._effective(fraction)

        offloaded: list[str] | tuple[str, ...] = _NO_RIDS
        started: list[str] | tuple[str, ...] = _NO_RIDS
        demoted: list[str] | tuple[str, ...] = _NO_RIDS
        dropped: list[str] | tuple[str, ...] = _NO_RIDS
        freed = 0
        skipped = 0
        now = None
        if before > self._high:
            now = self._clock()
            offloaded = []
            freed, skipped = self._offload_until(
                self._low, before, running, now, offloaded, inclusive=False
            )
        if self._queue:
            if now is None:
                now = self._clock()
            started = []
            head = self._serve(fraction, now, started)
            if head is not None:
                need = self._need_bytes(head)
                target = (self._limit_bytes - need) / self._capacity
                current = self._effective(fraction)
                if current > target:
                    if offloaded is _NO_RIDS:
                        offloaded = []
                    n_before = len(offloaded)
                    more, more_skipped = self._offload_until(
                        target, current, running, now, offloaded, inclusive=True
                    )
                    freed += more
                    skipped = max(skipped, more_skipped)
                    stats.make_room_offloads += len(offloaded) - n_before
        if self._cascade:
            for h in self._cascade:
                if h.demoting:
                    self._settle_demotions(h)
                used = h.host_used() - sum(h.demoting.values())
                if used > self._config.host_high * h.host_capacity:
                    if demoted is _NO_RIDS:
                        demoted, dropped = [], []
                    self._demote_coldest(h, used, demoted, dropped)
        stats.skipped_running += skipped
        return EvictionReport(
            before,
            self._effective(fraction),
            tuple(offloaded),
            freed,
            tuple(demoted),
            tuple(dropped),
            tuple(started),
            skipped,
        )

    def _candidate_batch(
        self, running: Collection[str], now: float
    ) -> tuple[CandidateBatch, int]:
        """Every idle (request, resource) pair that may be offloaded, as columns; how many ran.

        Idle: not in ``running``, past its minimum residency, and not already
        being offloaded from that resource. When bytes are asked for up front
        (see ``_ask_lazily``), each resource is asked once for all its idle
        requests (``reclaimable_many``, or one ``reclaimable`` call each) and
        rows with nothing to reclaim are left out; otherwise the batch carries
        no bytes and ``_victim_rows`` asks for them as it walks the order. A
        PRIORITY policy's resource is asked ``get_offload_priority`` once per
        request that has a row.
        """
        if not isinstance(running, (set, frozenset, dict)):
            running = set(running)
        table = self._table
        end = table.end
        slot_of = table.slot
        idle = table.live[:end].copy()
        skipped = 0
        for rid in running:
            slot = slot_of.get(rid)
            if slot is not None:
                idle[slot] = False
                skipped += 1
        recent = self._reloaded_at
        if recent:
            min_res = self._config.min_residency_s
            expired = []
            for rid, started_at in recent.items():
                if now - started_at < min_res:
                    idle[slot_of[rid]] = False
                else:
                    expired.append(rid)
            for rid in expired:
                del recent[rid]
        moving = self._ledger.moving
        ask_now = not self._ask_lazily
        slot_parts: list[np.ndarray] = []
        rid_parts: list[np.ndarray] = []
        byte_parts: list[np.ndarray] = []
        for h in self._evicting:
            rows = idle & table.member[h.name][:end]
            for name, rid in moving:
                if name == h.name and rid in slot_of:
                    rows[slot_of[rid]] = False
            slots = np.flatnonzero(rows)
            rids = table.rid_at[slots]
            if ask_now:
                sizes = self._ask_reclaimable(h, rids.tolist())
                keep = sizes > 0
                if not keep.all():
                    slots, rids, sizes = slots[keep], rids[keep], sizes[keep]
                byte_parts.append(sizes)
            slot_parts.append(slots)
            rid_parts.append(rids)
        if not slot_parts:  # no resource supports eviction
            slot_parts, rid_parts = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=object)]
            byte_parts = [np.empty(0, dtype=np.int64)]
        single = len(slot_parts) == 1
        if single:
            slots, rids = slot_parts[0], rid_parts[0]
            resources = np.empty(len(slots), dtype=object)
            if self._evicting:
                resources.fill(self._evicting[0].name)
        else:
            slots, rids = np.concatenate(slot_parts), np.concatenate(rid_parts)
            resources = np.repeat(
                np.array([h.name for h in self._evicting], dtype=object),
                [len(part) for part in slot_parts],
            )
        reclaimable = None
        if ask_now:
            reclaimable = byte_parts[0] if single else np.concatenate(byte_parts)
        priority = None
        if self._prio_handle is not None and len(slots):
            priority = self._ask_priorities(slots, rids, single=single)
        batch = CandidateBatch.of_registered(
            rids, resources, table.last_used[slots], reclaimable=reclaimable, priority=priority
        )
        return batch, skipped

    @staticmethod
    def _ask_reclaimable(h: ResourceHandle, rids: list[str]) -> np.ndarray:
        """``h``'s reclaimable bytes for each of ``rids`` (int64), in one call when it can."""
        if not rids:
            return np.empty(0, dtype=np.int64)
        if h.reclaimable_many is not None:
            return bytes_answers(h.name, rids, h.reclaimable_many(rids))
        answers = list(map(h.reclaimable, rids))
        if not set(map(type, answers)) <= {int}:  # check each, naming the first bad one
            answers = [
                bytes_answer(h.name, rid, value)
                for rid, value in zip(rids, answers, strict=True)
            ]
        return bytes_answers(h.name, rids, answers)

    def _ask_priorities(self, slots: np.ndarray, rids: np.ndarray, *, single: bool) -> np.ndarray:
        """The PRIORITY resource's opinion of the request of each row (0.0 elsewhere).

        ``slots`` and ``rids`` are the rows' request slots and ids; ``single``
        says they all belong to the one evicting resource, which is then the
        PRIORITY one. Asked once per request registered with that resource,
        in one ``get_offload_priority_many`` call when it offers one.
        """
        h = self._prio_handle
        table = self._table
        if single:  # one row per request, each registered with h
            asked, rids = slots, rids.tolist()
        else:
            asked = np.unique(slots)
            asked = asked[table.member[h.name][asked]]
            rids = table.rid_at[asked].tolist()
        if h.priority_many is not None:
            values = np.asarray(h.priority_many(rids))
            if values.shape != (len(rids),) or (len(rids) and values.dtype.kind not in "iuf"):
                raise ValueError(
                    f"resource {h.name!r}: get_offload_priority_many gave {values.dtype} "
                    f"answers of shape {values.shape} for {len(rids)} requests; expected "
                    "one number each"
                )
            values = values.astype(np.float64, copy=False)
        else:
            values = np.fromiter(map(h.priority, rids), dtype=np.float64, count=len(rids))
        finite = np.isfinite(values)
        if not finite.all():
            bad = int(np.flatnonzero(~finite)[0])
            raise ValueError(
                f"resource {h.name!r}: get_offload_priority({rids[bad]!r}) returned "
                f"{values[bad]!r}; expected a finite number"
            )
        if single:
            return values
        by_slot = np.zeros(table.end, dtype=np.float64)
        by_slot[asked] = values
        return by_slot[slots]

    def _victim_rows(
        self, batch: CandidateBatch, now: float, need_bytes: float
    ) -> Iterator[tuple[int, int]]:
        """(row, reclaimable bytes) of ``batch`` in the policy's order, skipping empty rows.

        The order is computed in chunks sized to free about ``need_bytes``
        (``OrderCursor``), so a pick sorts little more than its victims. For
        a batch without bytes, the walk asks for them chunk by chunk: a
        resource with ``reclaimable_many`` answers for the chunk's rows in one
        call when the chunk is read; any other is asked ``reclaimable`` for
        one row at a time, when the walk reaches that row (after the offloads
        of the rows before it).
        """
        cursor = OrderCursor(self._policy, batch, now)
        sizes = batch.reclaimable
        handles = self._handles
        mean = float(sizes.mean()) if sizes is not None and len(sizes) else None
        seen = 0
        while True:
            chunk = cursor.take_for(need_bytes - seen, mean)
            if not len(chunk):
                return
            if sizes is not None:
                for row, nbytes in zip(chunk.tolist(), sizes[chunk].tolist(), strict=True):
                    seen += nbytes
                    yield row, nbytes
            else:
                rids = batch.rids[chunk].tolist()
                names = batch.resources[chunk]
                told = self._bulk_answers(rids, names)
                for row, rid, name, nbytes in zip(
                    chunk.tolist(), rids, names.tolist(), told, strict=True
                ):
                    if nbytes is None:
                        nbytes = bytes_answer(name, rid, handles[name].reclaimable(rid))
                    if nbytes > 0:
                        seen += nbytes
                        yield row, nbytes
            mean = seen / cursor.read if seen else None

    def _bulk_answers(self, rids: list[str], names: np.ndarray) -> list[int | None]:
        """Bytes of each row from resources with ``reclaimable_many``; None for the others."""
        evicting = self._evicting
        if len(evicting) == 1:
            h = evicting[0]
            if h.reclaimable_many is None:
                return [None] * len(rids)
            return bytes_answers(h.name, rids, h.reclaimable_many(rids)).tolist()
        told: list[int | None] = [None] * len(rids)
        for h in evicting:
            if h.reclaimable_many is None:
                continue
            positions = np.flatnonzero(names == h.name).tolist()
            if positions:
                asked = [rids[p] for p in positions]
                answers = bytes_answers(h.name, asked, h.reclaimable_many(asked)).tolist()
                for p, nbytes in zip(positions, answers, strict=True):
                    told[p] = nbytes
        return told

    def plan_offload(self, running: Collection[str], need_bytes: int) -> tuple[Candidate, ...]:
        """The victims the policy would offload now to free ``need_bytes``; moves nothing.

        Same candidates as ``evict_if_needed`` would consider (idle, past their
        minimum residency, ``reclaimable > 0``), best first, as few as add up to
        ``need_bytes`` (all of them if they fall short).
        """
        if isinstance(need_bytes, bool) or not isinstance(need_bytes, int) or need_bytes < 0:
            raise ValueError(f"need_bytes must be an int >= 0, got {need_bytes!r}")
        if need_bytes == 0:
            return ()
        now = self._clock()
        batch, _ = self._candidate_batch(running, now)
        rows: list[int] = []
        sizes: list[int] = []
        total = 0
        for row, nbytes in self._victim_rows(batch, now, need_bytes):
            rows.append(row)
            sizes.append(nbytes)
            total += nbytes
            if total >= need_bytes:
                break
        return tuple(batch.records(rows, reclaimable=sizes))

    def _offload_until(
        self,
        target: float,
        projected: float,
        running: Collection[str],
        now: float,
        out: list[str],
        *,
        inclusive: bool,
    ) -> tuple[int, int]:
        """Offload victims in policy order until the projection is under ``target`` (or at it).

        Returns (bytes freed, requests skipped because running). A scan that
        finds nothing it may offload is remembered, and the next calls reuse
        that finding while it holds (``_NothingToOffload``).
        """
        skipped = self._recall_nothing(running, now)
        if skipped is not None:
            self._stats.scans_skipped += 1
            return 0, skipped
        self._nothing = None
        given = running
        if not isinstance(running, (set, frozenset, dict)):
            running = set(running)
        batch, skipped = self._candidate_batch(running, now)
        if not len(batch):
            self._remember_nothing(given, running, skipped)
            return 0, skipped
        stats = self._stats
        handles = self._handles
        rids = batch.rids
        resources = batch.resources
        # in bytes, so that many small subtractions do not drift
        projected_bytes = projected * self._capacity
        target_bytes = target * self._capacity
        victims = self._victim_rows(batch, now, projected_bytes - target_bytes + 1)
        freed = 0
        first = True
        while projected_bytes > target_bytes or (
            not inclusive and projected_bytes == target_bytes
        ):
            victim = next(victims, None)
            if victim is None:
                if first:  # the whole order walked: not one row with bytes to reclaim
                    self._remember_nothing(given, running, skipped)
                break
            first = False
            rid = rids[victim[0]]
            h = handles[resources[victim[0]]]
            nbytes = h.offload(rid)
            if nbytes <= 0:
                stats.offload_refusals += 1
                continue
            out.append(rid)
            freed += nbytes
            projected_bytes -= nbytes
            stats.offloads += 1
            stats.bytes_offloaded += nbytes
            key = (h.name, rid)
            tier = h.tier_of(rid) if h.tier_of is not None else Tier.HOST
            # while the copy is in flight the resource reports the source tier;
            # where the bytes go is a separate (optional) question
            dest = h.destination_of(rid) if h.destination_of is not None else tier
            if dest is Tier.DISK:
                stats.bytes_device_to_disk += nbytes
            else:
                stats.bytes_device_to_host += nbytes
            if tier is Tier.DEVICE:
                self._ledger.add_offload(key, nbytes)
            else:
                self._ledger.add_released(nbytes, self._fresh_stamp())
        victims.close()
        return freed, skipped

    def _remember_nothing(
        self, given: Collection[str], running: set[str] | frozenset[str] | dict, skipped: int
    ) -> None:
        """Keep the finding of a scan that found nothing it may offload (see the class)."""
        gauges = self._gauges
        if gauges is None:
            return
        recent = self._reloaded_at  # the scan has just dropped the exemptions that ran out
        self._nothing = _NothingToOffload(
            running=running if type(running) is frozenset else frozenset(running),
            seen=given if type(given) in _IMMUTABLE else None,
            skipped=skipped,
            exempt_since=min(recent.values()) if recent else None,
            room=tuple(gauge() for gauge in gauges),
        )

    def _recall_nothing(self, running: Collection[str], now: float) -> int | None:
        """If the last scan's finding of nothing to offload still holds: the
        known requests in ``running`` (what a scan would count as skipped); else None.

        Reads no request's bytes: only the clock against the earliest minimum
        residency then in force, the room gauges, and ``running`` against the
        running requests of that scan (a set comparison; none at all when the
        very same frozenset or tuple is passed again).
        """
        found = self._nothing
        if found is None:
            return None
        if found.exempt_since is not None and (
            not now - found.exempt_since < self._config.min_residency_s
        ):
            self._nothing = None  # an exemption ran out: that request may be a candidate now
            return None
        if found.room and tuple(gauge() for gauge in self._gauges) != found.room:
            self._nothing = None  # room below the device came or went
            return None
        if running is found.seen:
            return found.skipped
        given = running
        if not isinstance(running, (set, frozenset)):
            running = set(running)
        if not found.running <= running:
            self._nothing = None  # a request stopped running: it may be a candidate now
            return None
        if len(running) != len(found.running):
            # more are running: a known one joining can never leave unnoticed, so it
            # joins the requests that must keep running
            slot_of = self._table.slot
            joined = [rid for rid in running - found.running if rid in slot_of]
            if joined:
                found.running = found.running.union(joined)
                found.skipped += len(joined)
        found.seen = given if type(given) in _IMMUTABLE else None
        return found.skipped

    # -- reloads ------------------------------------------------------------------

    def pending_reloads(self) -> tuple[str, ...]:
        """Waiting reloads, in the order they will be tried."""
        return tuple(e.rid for e in self._queue.entries())

    def request_reload(self, rid: str) -> bool:
        """Start reloading ``rid`` now if it fits, else queue it; True if it started.

        A new request is tried at once unless the head of the queue (as the
        last ``evict_if_needed`` found it) has waited ``aging_s`` or more; then
        it queues behind. Parts of ``rid`` on resources that cannot reload it
        yet (``can_reload`` False, or an offload still in flight) make it wait
        without holding others back. Raises for an unknown request, one with
        nothing offloaded, or one that could never fit under the admission
        limit; nothing changes then. A request already waiting stays where it
        is (False).
        """
        members = self._members.get(rid)
        if members is None:
            raise UnknownRequestError(f"unknown request {rid!r}")
        if rid in self._queue:
            return False
        parts = [h for h in members if h.is_offloaded(rid)]
        if not parts:
            raise ValueError(f"request {rid!r} has nothing offloaded to reload")
        need = sum(h.reload_bytes(rid) for h in parts if h.reload_bytes is not None)
        if need > self._limit_bytes:
            raise ValueError(
                f"request {rid!r} needs {need} bytes to reload, more than the admission "
                f"limit of {int(self._limit_bytes)} bytes ((high - reload_headroom) x capacity)"
            )
        base = 0.0
        if self._reload_priority is not None:
            base = float(self._reload_priority(rid))
            if not math.isfinite(base):
                raise ValueError(f"reload_priority({rid!r}) returned {base!r}; expected finite")
        now = self._clock()
        head = self._head
        may_pass = (
            head is None
            or head.rid not in self._queue
            or now - head.enqueued_at < self._config.aging_s
        )
        entry = self._queue.push(rid, now, base)
        if may_pass:
            fraction = self._sample()
            if fraction is not None:
                outcome = self._try_reload(entry, fraction * self._capacity, now)
                if outcome in (_ADMITTED, _GONE):
                    self._queue.remove(rid)
                    return outcome == _ADMITTED
        self._stats.reload_refusals += 1
        return False

    def _need_bytes(self, entry: WaitingReload) -> int:
        rid = entry.rid
        return sum(
            h.reload_bytes(rid)
            for h in self._members[rid]
            if h.name not in entry.started and h.reload_bytes is not None and h.is_offloaded(rid)
        )

    def _try_reload(self, entry: WaitingReload, current_bytes: float, now: float) -> int:
        """Admit and start one waiting reload if it fits; say what happened."""
        rid = entry.rid
        ledger = self._ledger
        parts = [
            h for h in self._members[rid]
            if h.name not in entry.started and h.is_offloaded(rid)
        ]
        if not parts:
            if not entry.started:
                return _GONE  # back already, or dropped: nothing to reload
            return self._admitted(entry, now)
        for h in parts:
            if (h.name, rid) in ledger.moving or not h.can_reload(rid):
                return _INELIGIBLE
        needs = [h.reload_bytes(rid) if h.reload_bytes is not None else 0 for h in parts]
        if current_bytes + ledger.reserved_bytes + sum(needs) > self._limit_bytes:
            return _NO_ROOM
        stats = self._stats
        for h, need in zip(parts, needs, strict=True):
            source = h.tier_of(rid) if h.tier_of is not None else Tier.HOST
            before = self._fresh_stamp()
            if not h.reload(rid):
                stats.reload_resource_refusals += 1
                return _NO_ROOM
            self._nothing = None
            entry.started.add(h.name)
            ledger.add_reload(need, before, self._fresh_stamp())
            stats.bytes_reloaded += need
            if source is Tier.DISK:
                stats.bytes_disk_to_device += need
            else:
                stats.bytes_host_to_device += need
        return self._admitted(entry, now)

    def _admitted(self, entry: WaitingReload, now: float) -> int:
        stats = self._stats
        stats.reloads_started += 1
        stats.max_wait_s = max(stats.max_wait_s, now - entry.enqueued_at)
        self._reloaded_at[entry.rid] = now
        self._nothing = None
        return _ADMITTED

    def _serve(self, fraction: float, now: float, started: list[str]) -> WaitingReload | None:
        """Retry waiting reloads best first; return the head if it may no longer be passed."""
        queue = self._queue
        current = fraction * self._capacity
        aging = self._config.aging_s
        head: WaitingReload | None = None
        keep: list[WaitingReload] = []
        blocked = False
        for entry in queue.drain_in_order():
            outcome = self._try_reload(entry, current, now)
            if outcome == _ADMITTED:
                queue.remove(entry.rid)
                started.append(entry.rid)
                continue
            if outcome == _GONE:
                queue.remove(entry.rid)
                continue
            keep.append(entry)
            if outcome == _NO_ROOM and head is None:
                head = entry
                if now - entry.enqueued_at >= aging:
                    blocked = True
                    break
        for entry in keep:
            queue.restore(entry)
        self._head = head
        return head if blocked else None

    # -- host -> disk cascade -------------------------------------------------------

    def _settle_demotions(self, h: ResourceHandle) -> None:
        """Forget demotions that completed (off the host) or failed (reloadable again).

        A request whose demotion is in flight is not reloadable, so one on the
        host that ``can_reload`` again had its write fail and stayed there.
        """
        done = [
            rid for rid in h.demoting
            if h.tier_of(rid) is not Tier.HOST or h.can_reload(rid)
        ]
        for rid in done:
            del h.demoting[rid]
        if done:
            self._nothing = None

    def _demote_coldest(
        self, h: ResourceHandle, used: int, demoted: list[str], dropped: list[str]
    ) -> None:
        """Demote h's least recently used host requests until under host_low.

        ``used``: host bytes in use, less demotions already in flight. Requests
        waiting for a reload are left on host (they are about to come back).
        """
        config = self._config
        stats = self._stats
        target = config.host_low * h.host_capacity
        table = self._table
        last_used, slot_of = table.last_used, table.slot
        queue = self._queue
        tier_of = h.tier_of
        cold = sorted(
            (float(last_used[slot_of[rid]]), rid)
            for rid in table.members_of(h.name)
            if rid not in h.demoting and rid not in queue and tier_of(rid) is Tier.HOST
        )
        for _, rid in cold:
            if used < target:
                break
            nbytes = h.reload_bytes(rid)
            if h.demote(rid):
                self._nothing = None
                demoted.append(rid)
                used -= nbytes
                stats.demotions += 1
                stats.bytes_demoted += nbytes
                stats.bytes_host_to_disk += nbytes
                if tier_of(rid) is Tier.HOST:
                    h.demoting[rid] = nbytes
                continue
            if config.on_disk_full == "drop":
                h.drop(rid)
                self._nothing = None
                dropped.append(rid)
                used -= nbytes
                stats.drops += 1
                stats.bytes_dropped += nbytes
                continue
            stats.disk_full_keeps += 1
            break  # the disk is full; try again next call

    # -- reporting ----------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters, byte totals and current figures as a plain dict of numbers."""
        out = self._stats.as_dict()
        now = self._clock()
        out["reload_waits"] = len(self._queue)
        out["max_wait_s"] = max(out["max_wait_s"], self._queue.max_wait(now))
        out["reserved_reload_bytes"] = self._ledger.reserved_bytes
        out["releasing_bytes"] = self._ledger.releasing_bytes
        out["offloads_in_flight"] = len(self._ledger.moving)
        out["demotions_in_flight"] = sum(len(h.demoting) for h in self._cascade)
        out["live_requests"] = len(self._table)
        out["device_capacity_bytes"] = self._capacity
        return out
