"""Device eviction: which idle requests leave the device, in the policy's order.

``DeviceEviction`` finds the candidates (columns of the request table, handed
to the policy as a ``CandidateBatch``), walks the policy's order in chunks and
offloads until a projection is under a target. It also keeps the finding of a
scan that found nothing it may offload, while that finding must still hold
(``docs/controller.md`` gives the rule). A request that vanished from its
resource or changed state under the controller is skipped and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import NamedTuple

import numpy as np

from tiering.control.admission import InFlightLedger
from tiering.control.config import ControllerConfig
from tiering.control.request_table import RequestTable, ResourceHandle, bytes_answer, bytes_answers
from tiering.control.stats import ControllerStats
from tiering.policies.base import Candidate, CandidateBatch, OrderCursor, Policy
from tiering.types import Tier

log = logging.getLogger("tiering.control.controller")

# collections whose contents cannot change: passing the same one again is the same set
_IMMUTABLE = (frozenset, tuple)


def skip(stats: ControllerStats, what: str, name: str, rid: str, err: BaseException) -> None:
    """Log and count a hook that failed for one request (it vanished or changed state)."""
    stats.vanished_skips += 1
    log.warning("resource %r: %s(%r) failed (%s: %s); skipped", name, what, rid,
                type(err).__name__, err)


class _Finding:
    """What the last scan over ``high`` that found nothing it may offload saw.

    ``running``: the requests it was told are running, plus known ones that
    joined them since; ``skipped``: how many of those are known; ``seen``: the
    collection last passed, kept only when immutable; ``exempt_since``: when
    the earliest minimum-residency exemption then in force began;
    ``fingerprint``: everything else that may change the finding (see
    ``DeviceEviction.fingerprint``).
    """

    __slots__ = ("running", "seen", "skipped", "exempt_since", "fingerprint")

    def __init__(self, running, seen, skipped, exempt_since, fingerprint) -> None:
        self.running: frozenset[str] = running
        self.seen: Collection[str] | None = seen
        self.skipped: int = skipped
        self.exempt_since: float | None = exempt_since
        self.fingerprint: tuple = fingerprint


class Offloaded(NamedTuple):
    """What one ``offload_until`` did: bytes freed, known requests passed over as running."""

    freed: int
    skipped: int


_new_tuple = tuple.__new__  # builds an ``Offloaded`` without the Python-level __new__ (hot path)


class DeviceEviction:
    """Offloads idle requests of the evicting resources in policy order.

    Shares the controller's request table, in-flight ledger and stats (the
    controller owns them). ``stamp()``: the newest pressure stamp there is now.
    ``reuse_scans``: keep a finding of nothing to offload (off: every call
    over ``high`` scans; tests compare the two). ``reload_limit_bytes``: the
    admission limit; a request whose device bytes exceed it is never a victim
    (once offloaded, its reload could never be admitted: it would be stranded).
    """

    def __init__(
        self,
        handles: Mapping[str, ResourceHandle],
        policy: Policy,
        config: ControllerConfig,
        table: RequestTable,
        ledger: InFlightLedger,
        stats: ControllerStats,
        stamp: Callable[[], int],
        prio_handle: ResourceHandle | None,
        reload_limit_bytes: float = float("inf"),
    ) -> None:
        self._handles = handles
        self._limit = reload_limit_bytes
        self._evicting = tuple(h for h in handles.values() if h.evicts)
        self._policy = policy
        self._config = config
        self._table = table
        self._ledger = ledger
        self._stats = stats
        self._stamp = stamp
        self._prio_handle = prio_handle
        # A policy that orders without the bytes (lru, priority) gets them asked
        # for only as the walk of its order reaches each request.
        self._ask_lazily = not policy.needs_reclaimable
        # the host and disk gauges of the evicting resources; None when no finding may
        # be kept: an evicting resource has no poll() to say when transfers complete
        self._gauges: tuple[Callable[[], int], ...] | None = None
        if all(h.poll is not None for h in self._evicting):
            self._gauges = tuple(g for h in self._evicting for g in h.room_gauges)
        self.reuse_scans = True
        self._finding: _Finding | None = None

    # -- the finding of nothing to offload -------------------------------------------

    def fingerprint(self) -> tuple:
        """What a finding depends on besides ``running``, touches and the clock: the
        membership, every move started or reported, and the room below the device."""
        s = self._stats
        key = (self._table.version, s.offloads, s.offload_refusals, s.reloads_started,
               s.bytes_reloaded, s.demotions, s.drops, s.transfers_reported, s.vanished_skips)
        gauges = self._gauges
        if gauges:
            return key + tuple([g() for g in gauges])
        return key

    def forget_finding(self) -> None:
        """Drop the finding (a failed pass, or a touch of a request it found idle)."""
        self._finding = None

    def touched(self, rid: str) -> None:
        found = self._finding
        if found is not None and rid not in found.running:
            self._finding = None  # it ran though the scan found it idle

    def _remember(self, given: Collection[str], running: Collection[str], skipped: int) -> None:
        if self._gauges is None or not self.reuse_scans:
            return
        self._finding = _Finding(
            running if type(running) is frozenset else frozenset(running),
            given if type(given) in _IMMUTABLE else None,
            skipped,
            self._table.earliest_exemption(),
            self.fingerprint(),
        )

    def _recall(self, running: Collection[str], now: float) -> int | None:
        """The skipped count of the last finding if it still holds for ``running``, else None."""
        found = self._finding
        if found is None:
            return None
        self._finding = None
        if found.exempt_since is not None and not (
            now - found.exempt_since < self._config.min_residency_s
        ):
            return None  # an exemption ran out
        if self.fingerprint() != found.fingerprint:
            return None
        if running is not found.seen:
            given = running
            if not isinstance(running, (set, frozenset)):
                running = set(running)
            if not found.running <= running:
                return None  # a request stopped running: it may be a candidate now
            if len(running) != len(found.running):
                # more are running: those known join the requests that must keep running
                joined = [rid for rid in running - found.running if rid in self._table]
                if joined:
                    found.running = found.running.union(joined)
                    found.skipped += len(joined)
            found.seen = given if type(given) in _IMMUTABLE else None
        self._finding = found
        return found.skipped

    # -- offloading ------------------------------------------------------------------

    def offload_until(
        self, target_bytes: float, projected_bytes: float, running: Collection[str],
        now: float, out: list[str], *, inclusive: bool,
    ) -> Offloaded:
        """Offload victims in policy order until the projection is under ``target_bytes``
        (or at it, when ``inclusive``); rids offloaded are appended to ``out``."""
        skipped = self._recall(running, now)
        if skipped is not None:
            self._stats.scans_skipped += 1
            return _new_tuple(Offloaded, (0, skipped))
        given = running
        if not isinstance(running, (set, frozenset, dict)):
            running = set(running)
        batch, skipped = self.candidate_batch(running, now)
        if not len(batch):
            self._remember(given, running, skipped)
            return Offloaded(0, skipped)
        victims = self._victim_rows(batch, now, projected_bytes - target_bytes + 1)
        freed = 0
        first = True
        try:
            while projected_bytes > target_bytes or (
                not inclusive and projected_bytes == target_bytes
            ):
                victim = next(victims, None)
                if victim is None:
                    if first:  # the whole order walked: not one row with bytes to reclaim
                        self._remember(given, running, skipped)
                    break
                first = False
                h = self._handles[batch.resources[victim[0]]]
                nbytes = self._offload(h, batch.rids[victim[0]])
                if nbytes > 0:
                    out.append(batch.rids[victim[0]])
                    freed += nbytes
                    projected_bytes -= nbytes
        finally:
            victims.close()
        return Offloaded(freed, skipped)

    def _offload(self, h: ResourceHandle, rid: str) -> int:
        """Offload one victim and count it; 0 if refused, or if it vanished (logged)."""
        stats = self._stats
        try:
            nbytes = h.offload(rid)
        except Exception as err:  # removed or changed state under the controller
            skip(stats, "offload", h.name, rid, err)
            return 0
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
            raise ValueError(f"resource {h.name!r}: offload({rid!r}) returned {nbytes!r}; "
                             "expected an int")
        nbytes = int(nbytes)
        if nbytes <= 0:
            stats.offload_refusals += 1
            return 0
        stats.offloads += 1
        stats.bytes_offloaded += nbytes
        try:
            tier = h.tier_of(rid) if h.tier_of is not None else Tier.HOST
            # while the copy is in flight the resource reports the source tier
            dest = h.destination_of(rid) if h.destination_of is not None else tier
        except Exception as err:
            skip(stats, "tier_of", h.name, rid, err)
            tier = dest = Tier.DEVICE
        if dest is Tier.DISK:
            stats.bytes_device_to_disk += nbytes
        else:
            stats.bytes_device_to_host += nbytes
        if tier is Tier.DEVICE and h.poll is not None:  # in flight: its record settles it
            self._ledger.add_offload((h.name, rid), nbytes)
        else:  # done already (a resource without poll() offloads synchronously)
            self._ledger.add_released(nbytes, self._stamp())
        return nbytes

    def plan(self, running: Collection[str], need_bytes: int, now: float
             ) -> tuple[Candidate, ...]:
        """The victims the policy would offload now to free ``need_bytes``; moves nothing."""
        batch, _ = self.candidate_batch(running, now)
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

    # -- candidates ------------------------------------------------------------------

    def candidate_batch(self, running: Collection[str], now: float
                        ) -> tuple[CandidateBatch, int]:
        """Every idle (request, resource) pair that may be offloaded, as columns; how many ran.

        Idle: not in ``running``, past its minimum residency, not being
        offloaded from that resource. Bytes are asked up front only for a
        policy that orders by them (then rows with none are left out).
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
        exempt = table.exempt_mask(now, self._config.min_residency_s)
        if exempt is not None:
            idle &= ~exempt
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
            priority, keep = self._ask_priorities(slots, rids, single=single)
            if keep is not None:  # rows whose request vanished from the PRIORITY resource
                slots, rids, resources, priority = (
                    slots[keep], rids[keep], resources[keep], priority[keep])
                if reclaimable is not None:
                    reclaimable = reclaimable[keep]
        batch = CandidateBatch.of_registered(
            rids, resources, table.last_used[slots], reclaimable=reclaimable, priority=priority
        )
        return batch, skipped

    def _ask_reclaimable(self, h: ResourceHandle, rids: list[str]) -> np.ndarray:
        """``h``'s reclaimable bytes for each of ``rids`` (int64), in one call when it can."""
        if not rids:
            return np.empty(0, dtype=np.int64)
        if h.reclaimable_many is not None:
            return ask_many(self._stats, h, rids)
        try:
            answers = list(map(h.reclaimable, rids))
        except Exception:  # one vanished: ask again one by one, skipping it
            return np.array([ask_one(self._stats, h, rid) for rid in rids], dtype=np.int64)
        if not set(map(type, answers)) <= {int}:  # check each, naming the first bad one
            answers = [bytes_answer(h.name, rid, value)
                       for rid, value in zip(rids, answers, strict=True)]
        return bytes_answers(h.name, rids, answers)

    def _ask_priorities(self, slots: np.ndarray, rids: np.ndarray, *, single: bool
                        ) -> tuple[np.ndarray, np.ndarray | None]:
        """The PRIORITY resource's opinion of each row (0.0 for rows not registered with
        it), and a mask of the rows to keep (None: all) when some request vanished."""
        h = self._prio_handle
        table = self._table
        if single:  # one row per request, each registered with h
            asked, names = slots, rids.tolist()
        else:
            asked = np.unique(slots)
            asked = asked[table.member[h.name][asked]]
            names = table.rid_at[asked].tolist()
        values, gone = priorities_of(self._stats, h, names)
        finite = np.isfinite(values)
        if not finite.all():
            bad = int(np.flatnonzero(~finite)[0])
            raise ValueError(
                f"resource {h.name!r}: get_offload_priority({names[bad]!r}) returned "
                f"{values[bad]!r}; expected a finite number"
            )
        if single:
            return values, (~gone if gone.any() else None)
        by_slot = np.zeros(table.end, dtype=np.float64)
        by_slot[asked] = values
        keep = None
        if gone.any():
            lost = np.zeros(table.end, dtype=bool)
            lost[asked[gone]] = True
            keep = ~lost[slots]
        return by_slot[slots], keep

    def _victim_rows(self, batch: CandidateBatch, now: float, need_bytes: float
                     ) -> Iterator[tuple[int, int]]:
        """(row, reclaimable bytes) of ``batch`` in the policy's order, skipping empty rows.

        The order is read in chunks sized to free about ``need_bytes``
        (``OrderCursor``). For a batch without bytes, a resource with
        ``reclaimable_many`` answers for a chunk in one call; any other is
        asked one row at a time, when the walk reaches it.
        """
        cursor = OrderCursor(self._policy, batch, now)
        sizes = batch.reclaimable
        handles = self._handles
        limit = self._limit  # a row above it could never be reloaded: never a victim
        mean = float(sizes.mean()) if sizes is not None and len(sizes) else None
        seen = 0
        while True:
            chunk = cursor.take_for(need_bytes - seen, mean)
            if not len(chunk):
                return
            if sizes is not None:
                for row, nbytes in zip(chunk.tolist(), sizes[chunk].tolist(), strict=True):
                    if nbytes <= limit:
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
                        nbytes = ask_one(self._stats, handles[name], rid)
                    if 0 < nbytes <= limit:
                        seen += nbytes
                        yield row, nbytes
            mean = seen / cursor.read if seen else None

    def _bulk_answers(self, rids: list[str], names: np.ndarray) -> list[int | None]:
        """Bytes of each row from tiering.resources with ``reclaimable_many``; None for the others."""
        evicting = self._evicting
        if len(evicting) == 1:
            h = evicting[0]
            if h.reclaimable_many is None:
                return [None] * len(rids)
            return ask_many(self._stats, h, rids).tolist()
        told: list[int | None] = [None] * len(rids)
        for h in evicting:
            if h.reclaimable_many is None:
                continue
            positions = np.flatnonzero(names == h.name).tolist()
            if positions:
                answers = ask_many(self._stats, h, [rids[p] for p in positions]).tolist()
                for p, nbytes in zip(positions, answers, strict=True):
                    told[p] = nbytes
        return told


def ask_one(stats: ControllerStats, h: ResourceHandle, rid: str) -> int:
    """``h.reclaimable(rid)`` checked; 0 (logged) if the request vanished."""
    try:
        value = h.reclaimable(rid)
    except Exception as err:
        skip(stats, "reclaimable", h.name, rid, err)
        return 0
    return bytes_answer(h.name, rid, value)


def ask_many(stats: ControllerStats, h: ResourceHandle, rids: list[str]) -> np.ndarray:
    """``h.reclaimable_many(rids)`` checked; one by one if it raised (a request vanished)."""
    try:
        answers = h.reclaimable_many(rids)
    except Exception as err:
        log.warning("resource %r: reclaimable_many failed (%s: %s); asking one by one",
                    h.name, type(err).__name__, err)
        return np.array([ask_one(stats, h, rid) for rid in rids], dtype=np.int64)
    return bytes_answers(h.name, rids, answers)


def priorities_of(stats: ControllerStats, h: ResourceHandle, rids: list[str]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Priorities of ``rids`` (float64) and which of them vanished (their value 0.0)."""
    gone = np.zeros(len(rids), dtype=bool)
    if h.priority_many is not None:
        try:
            values = np.asarray(h.priority_many(rids))
        except Exception as err:
            log.warning("resource %r: get_offload_priority_many failed (%s: %s); asking "
                        "one by one", h.name, type(err).__name__, err)
        else:
            if values.shape != (len(rids),) or (
                    len(rids) and values.dtype.kind not in "iuf"):
                raise ValueError(
                    f"resource {h.name!r}: get_offload_priority_many gave {values.dtype} "
                    f"answers of shape {values.shape} for {len(rids)} requests; expected "
                    "one number each"
                )
            return values.astype(np.float64, copy=False), gone
    values = np.zeros(len(rids), dtype=np.float64)
    for i, rid in enumerate(rids):
        try:
            value = h.priority(rid)
        except Exception as err:  # vanished
            skip(stats, "get_offload_priority", h.name, rid, err)
            gone[i] = True
            continue
        values[i] = value  # a non-number still raises (a broken contract)
    return values, gone
