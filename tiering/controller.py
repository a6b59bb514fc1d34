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
resource and none per request.

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
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from policies.base import Candidate, Policy
from tiering.admission import InFlightLedger, ReloadQueue, WaitingReload
from tiering.stats import ControllerStats
from tiering.types import Tier

ON_DISK_FULL_CHOICES = ("keep", "drop")


class UnknownRequestError(KeyError):
    """A request id the controller was never told about (or was told is gone)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"ControllerConfig.{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"ControllerConfig.{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ControllerConfig:
    """Watermarks and timings of the eviction controller.

    ``high`` / ``low``: device occupancy fractions; above ``high`` the
    controller offloads until the projection is under ``low``.
    ``host_high`` / ``host_low``: the same for the host tier, which demotes to
    disk. ``min_residency_s``: a request just reloaded is not offloaded again
    within this. ``reload_headroom``: admission keeps this fraction free below
    ``high``. ``aging_s``: a waiting reload gains one unit of priority per
    ``aging_s`` seconds of waiting, and may be overtaken only while it has
    waited less than that. ``on_disk_full``: what a refused demotion does,
    ``"keep"`` (stay on host) or ``"drop"`` (give the KV up for recompute).
    """

    high: float = 0.90
    low: float = 0.75
    host_high: float = 0.90
    host_low: float = 0.75
    min_residency_s: float = 1.0
    reload_headroom: float = 0.02
    aging_s: float = 10.0
    on_disk_full: str = "keep"

    def __post_init__(self) -> None:
        for name in ("high", "low", "host_high", "host_low", "min_residency_s",
                     "reload_headroom", "aging_s"):
            _check_number(name, getattr(self, name))
        if not 0 < self.high <= 1:
            raise ValueError(f"ControllerConfig.high must be in (0, 1], got {self.high!r}")
        if not 0 < self.low < self.high:
            raise ValueError(
                f"ControllerConfig.low must satisfy 0 < low < high, got low={self.low!r}, "
                f"high={self.high!r}"
            )
        if not 0 < self.host_high <= 1:
            raise ValueError(
                f"ControllerConfig.host_high must be in (0, 1], got {self.host_high!r}"
            )
        if not 0 < self.host_low < self.host_high:
            raise ValueError(
                f"ControllerConfig.host_low must satisfy 0 < host_low < host_high, got "
                f"host_low={self.host_low!r}, host_high={self.host_high!r}"
            )
        for name in ("min_residency_s", "aging_s"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"ControllerConfig.{name} must be >= 0, got {getattr(self, name)!r}"
                )
        if not 0 <= self.reload_headroom < self.high:
            raise ValueError(
                f"ControllerConfig.reload_headroom must satisfy 0 <= reload_headroom < high, "
                f"got {self.reload_headroom!r}"
            )
        if self.on_disk_full not in ON_DISK_FULL_CHOICES:
            raise ValueError(
                f"ControllerConfig.on_disk_full must be one of {ON_DISK_FULL_CHOICES}, "
                f"got {self.on_disk_full!r}"
            )


class EvictionReport(NamedTuple):
    """What one ``evict_if_needed`` call did.

    ``pressure_before``: effective device occupancy at the start of the call
    (reading adjusted for moves it may not show yet). ``projected_after``: the
    same after this call's offloads and reloads. ``offloaded``: one rid per
    offload made (a request spread over several resources may appear more than
    once). ``skipped_running``: known requests passed over because they were
    running (counted only when victims were looked for). Both fractions are
    NaN when the pressure source has no sample yet (nothing was done then).
    """

    pressure_before: float
    projected_after: float
    offloaded: tuple[str, ...]
    bytes_offloaded: int
    demoted: tuple[str, ...]
    dropped: tuple[str, ...]
    reloads_started: tuple[str, ...]
    skipped_running: int


_NO_RIDS: tuple[str, ...] = ()


class _Handle:
    """One resource as the controller drives it, with its optional hooks looked up once."""

    __slots__ = (
        "name", "resource", "evicts", "reclaimable", "offload", "priority", "is_offloaded",
        "can_reload", "reload", "reload_bytes", "tier_of", "poll", "device_capacity",
        "host_capacity", "host_used", "demote", "drop", "rids", "demoting", "candidates",
    )

    def __init__(self, name: str, resource: Any) -> None:
        self.name = name
        self.resource = resource
        self.evicts = bool(getattr(resource, "supports_eviction", False))
        if self.evicts:
            self.reclaimable = resource.reclaimable
            self.offload = resource.offload
            self.priority = resource.get_offload_priority
            self.is_offloaded = resource.is_offloaded
            self.can_reload = resource.can_reload
            self.reload = resource.reload
        self.reload_bytes = getattr(resource, "reload_bytes", None)
        self.tier_of = getattr(resource, "tier_of", None)
        self.poll = getattr(resource, "poll", None)
        cap = getattr(resource, "device_capacity_bytes", None)
        self.device_capacity = int(cap) if cap is not None else None
        host_cap = getattr(resource, "host_capacity_bytes", None)
        self.host_capacity = int(host_cap) if host_cap is not None else None
        self.host_used = getattr(resource, "host_used_bytes", None)
        self.demote = getattr(resource, "demote", None)
        self.drop = getattr(resource, "drop", None)
        self.rids: set[str] = set()  # requests registered with this resource
        self.demoting: dict[str, int] = {}  # demotions in flight: rid -> host bytes
        # the last Candidate built per rid, reused while its fields are unchanged
        self.candidates: dict[str, Candidate] = {}

    @property
    def cascades(self) -> bool:
        """Whether this resource takes part in the host -> disk cascade."""
        return (
            self.evicts
            and self.host_capacity is not None
            and self.host_capacity > 0
            and self.host_used is not None
            and self.demote is not None
            and self.tier_of is not None
            and self.reload_bytes is not None
        )


# outcomes of one reload attempt
_ADMITTED, _GONE, _INELIGIBLE, _NO_ROOM = range(4)


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
        handles = {name: _Handle(name, res) for name, res in resources.items()}

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
        self._polls = tuple(h.poll for h in handles.values() if h.poll is not None)
        self._cascade = cascade
        self._prio_handle = prio_handle
        self._capacity = int(device_capacity_bytes)
        self._high = config.high
        self._low = config.low
        self._limit_bytes = (config.high - config.reload_headroom) * self._capacity

        self._names: dict[str, frozenset[str]] = {}  # rid -> every resource it was added to
        self._members: dict[str, tuple[_Handle, ...]] = {}  # rid -> its evicting resources
        self._last_used: dict[str, float] = {}
        self._reloaded_at: dict[str, float] = {}
        self._ledger = InFlightLedger(lag=2 if self._latest is not None else 1)
        self._queue = ReloadQueue(config.aging_s)
        self._head: WaitingReload | None = None  # the head found by the last queue pass
        self._reads = 0
        self._stamp = 0
        self._stats = ControllerStats()

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
        if len(added) == len(self._handles):
            members = self._evicting  # shared tuple, the common case
        else:
            members = tuple(h for h in self._evicting if h.name in added)
        self._members[rid] = members
        for h in members:
            h.rids.add(rid)
        if rid not in self._last_used:
            self._last_used[rid] = self._clock()

    def remove_request(self, rid: str) -> None:
        """Forget a request that finished; its waiting reload, if any, is cancelled."""
        members = self._members.pop(rid, None)
        if members is None:
            raise UnknownRequestError(f"unknown request {rid!r}")
        del self._names[rid]
        del self._last_used[rid]
        self._reloaded_at.pop(rid, None)
        self._queue.remove(rid)
        for h in members:
            h.rids.discard(rid)
            h.demoting.pop(rid, None)
            h.candidates.pop(rid, None)
            self._ledger.forget_offload((h.name, rid))

    def touch(self, rid: str) -> None:
        """The request ran now."""
        if rid not in self._last_used:
            raise UnknownRequestError(f"unknown request {rid!r}")
        self._last_used[rid] = self._clock()

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
        if done:
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
        """Run one safe-point pass: offload under pressure, serve reloads, cascade."""
        stats = self._stats
        stats.evict_calls += 1
        for poll in self._polls:
            poll()
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

    def _candidates(
        self, running: Collection[str], now: float
    ) -> tuple[list[Candidate], int]:
        """Every idle (rid, resource) with something to reclaim, and how many ran.

        Candidates are immutable and most idle requests do not change between
        two pressure events, so the record built last time is reused while its
        reclaimable bytes, last use and priority are the same.
        """
        if not isinstance(running, (set, frozenset, dict)):
            running = set(running)
        moving = self._ledger.moving
        prio_handle = self._prio_handle
        if len(self._evicting) == 1 and prio_handle is None and not moving:
            return self._candidates_of_one(self._evicting[0], running, now)
        return self._candidates_general(running, now)

    def _candidates_general(
        self, running: Collection[str], now: float
    ) -> tuple[list[Candidate], int]:
        """``_candidates`` for any number of resources, priorities and offloads in flight."""
        moving = self._ledger.moving
        prio_handle = self._prio_handle
        min_res = self._config.min_residency_s
        recent = self._reloaded_at
        members = self._members
        device = Tier.DEVICE
        out: list[Candidate] = []
        append = out.append
        skipped = 0
        expired: list[str] = []
        for rid, last in self._last_used.items():
            if rid in running:
                skipped += 1
                continue
            if recent:
                t = recent.get(rid)
                if t is not None:
                    if now - t < min_res:
                        continue
                    expired.append(rid)
            handles = members[rid]
            prio = None
            for h in handles:
                if moving and (h.name, rid) in moving:
                    continue
                nbytes = h.reclaimable(rid)
                if nbytes <= 0:
                    continue
                if prio is None:
                    if prio_handle is not None and prio_handle in handles:
                        prio = float(prio_handle.priority(rid))
                    else:
                        prio = 0.0
                c = h.candidates.get(rid)
                if (
                    c is None
                    or c.reclaimable != nbytes
                    or c.last_used != last
                    or c.priority != prio
                ):
                    c = Candidate(rid, nbytes, last, device, prio, 0.0, h.name)
                    h.candidates[rid] = c
                append(c)
        for rid in expired:
            del recent[rid]
        return out, skipped

    def _candidates_of_one(
        self, h: _Handle, running: Collection[str], now: float
    ) -> tuple[list[Candidate], int]:
        """``_candidates`` for the common case, in a tighter loop (same result).

        One resource can evict, the policy needs no priority and no offload is
        in flight; this is the loop a 100,000-request pick spends its time in.
        """
        min_res = self._config.min_residency_s
        recent = self._reloaded_at
        reclaimable = h.reclaimable
        cache = h.candidates
        cached = cache.get
        members = h.rids
        check_members = len(members) != len(self._last_used)
        name = h.name
        device = Tier.DEVICE
        out: list[Candidate] = []
        append = out.append
        skipped = 0
        expired: list[str] = []
        for rid, last in self._last_used.items():
            if rid in running:
                skipped += 1
                continue
            if recent:
                t = recent.get(rid)
                if t is not None:
                    if now - t < min_res:
                        continue
                    expired.append(rid)
            if check_members and rid not in members:
                continue
            nbytes = reclaimable(rid)
            if nbytes <= 0:
                continue
            c = cached(rid)
            if c is None or c.last_used != last or c.reclaimable != nbytes:
                c = Candidate(rid, nbytes, last, device, 0.0, 0.0, name)
                cache[rid] = c
            append(c)
        for rid in expired:
            del recent[rid]
        return out, skipped

    def plan_offload(self, running: Collection[str], need_bytes: int) -> tuple[Candidate, ...]:
        """The victims the policy would offload now to free ``need_bytes``; moves nothing.

        Same candidates as ``evict_if_needed`` would consider (idle, past their
        minimum residency, ``reclaimable > 0``), best first, as few as add up to
        ``need_bytes`` (all of them if they fall short).
        """
        if isinstance(need_bytes, bool) or not isinstance(need_bytes, int) or need_bytes < 0:
            raise ValueError(f"need_bytes must be an int >= 0, got {need_bytes!r}")
        now = self._clock()
        candidates, _ = self._candidates(running, now)
        return tuple(self._policy.pick(candidates, now, need_bytes))

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
        """Offload ranked victims until the projection is under ``target`` (or at it).

        Returns (bytes freed, requests skipped because running).
        """
        candidates, skipped = self._candidates(running, now)
        if not candidates:
            return 0, skipped
        ranked = self._policy.rank(candidates, now)
        stats = self._stats
        handles = self._handles
        # in bytes, so that many small subtractions do not drift
        projected_bytes = projected * self._capacity
        target_bytes = target * self._capacity
        freed = 0
        for c in ranked:
            if projected_bytes < target_bytes or (inclusive and projected_bytes <= target_bytes):
                break
            h = handles[c.resource]
            nbytes = h.offload(c.rid)
            if nbytes <= 0:
                stats.offload_refusals += 1
                continue
            out.append(c.rid)
            freed += nbytes
            projected_bytes -= nbytes
            stats.offloads += 1
            stats.bytes_offloaded += nbytes
            key = (h.name, c.rid)
            tier = h.tier_of(c.rid) if h.tier_of is not None else Tier.HOST
            if tier is Tier.DISK:
                stats.bytes_device_to_disk += nbytes
            else:
                stats.bytes_device_to_host += nbytes
            if tier is Tier.DEVICE:
                self._ledger.add_offload(key, nbytes)
            else:
                self._ledger.add_released(nbytes, self._fresh_stamp())
        return freed, skipped

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

    def _settle_demotions(self, h: _Handle) -> None:
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

    def _demote_coldest(
        self, h: _Handle, used: int, demoted: list[str], dropped: list[str]
    ) -> None:
        """Demote h's least recently used host requests until under host_low.

        ``used``: host bytes in use, less demotions already in flight. Requests
        waiting for a reload are left on host (they are about to come back).
        """
        config = self._config
        stats = self._stats
        target = config.host_low * h.host_capacity
        last_used = self._last_used
        queue = self._queue
        tier_of = h.tier_of
        cold = sorted(
            (last_used[rid], rid)
            for rid in h.rids
            if rid not in h.demoting and rid not in queue and tier_of(rid) is Tier.HOST
        )
        for _, rid in cold:
            if used < target:
                break
            nbytes = h.reload_bytes(rid)
            if h.demote(rid):
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
        out["live_requests"] = len(self._last_used)
        out["device_capacity_bytes"] = self._capacity
        return out
