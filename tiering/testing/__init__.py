"""Small stand-ins for tests and benchmarks: a clock, a byte-counting resource, pressure sources.

``FakeTieredResource`` implements every hook of ``tiering.control.protocols`` with
exact byte accounting over three tiers and no real memory. It can complete
transfers at once or leave them in flight until ``poll`` (or the test) says
so, and it can accept reloads beyond device capacity so that a test can prove
the controller, not the resource, kept the device from being oversubscribed.
``ExactPressure`` reports its occupancy synchronously; ``LaggingPressure``
publishes numbered samples only when told, as a background poller would.

The contracts, as functions a user runs on their own code:
``tiering.testing.policies.check_policy`` (a request-eviction policy) and
``tiering.testing.blocks.check_block_policy`` (a block retention policy); both
are also importable from ``tiering.testing`` itself.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from tiering.core.lifecycle import AT_REST, Counters, LifecycleAnswers, Op, guard
from tiering.core.tiers import ChainRecord, InstantLink, PageMover, PageTier, TierChain
from tiering.core.validate import check_rids
from tiering.errors import BadRequestId, UnknownRequest
from tiering.resources.base import AdmitOutcome
from tiering.resources.engine_types import step_rid
from tiering.testing.blocks import check_block_policy  # the contracts, importable from here
from tiering.testing.policies import PolicyCheck, check_policy
from tiering.types import (
    RequestState,
    Tier,
    TransferResult,
)


def _finite(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class FakeClock:
    """A clock that moves only when told (a finite time; it never goes back)."""

    def __init__(self, start: float = 1000.0) -> None:
        if not _finite(start):
            raise ValueError(f"FakeClock: start must be a finite number, got {start!r}")
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if not _finite(seconds) or seconds < 0:
            raise ValueError(
                f"FakeClock.advance: seconds must be a finite number >= 0, got {seconds!r}")
        moved = self.now + seconds
        if not math.isfinite(moved):
            raise ValueError(f"FakeClock.advance: {seconds!r} s would take the clock past "
                             f"every finite time")
        self.now = moved


_RESIDENT = RequestState.RESIDENT



class _UsedPages(list):
    """Pages in use per tier, fastest first; a write sets that tier's count behind its
    ledger's back (how a test corrupts a ledger to see ``check_integrity`` catch it)."""

    def __init__(self, tiers: Sequence[PageTier]) -> None:
        super().__init__(t.used_pages for t in tiers)
        self._tiers = tiers

    def __setitem__(self, i, value) -> None:  # noqa: ANN001 - list's signature
        super().__setitem__(i, value)
        self._tiers[i]._used = value


class LedgerView(NamedTuple):
    """Pages used and capacity per tier of the chain, fastest first (fresh lists;
    see ``_UsedPages`` for what a write to ``used`` does)."""

    used: list[int]
    cap: list[int]


def fake_chain(device: int, host: int, disk: int, *, overcommit_device: bool = False
               ) -> TierChain:
    """The fake's chain: device, host and disk ``PageTier`` objects of one-byte pages,
    joined both ways by ``InstantLink`` objects."""
    tiers = (PageTier("device", Tier.DEVICE, device, overcommit=overcommit_device),
             PageTier("host", Tier.HOST, host), PageTier("disk", Tier.DISK, disk))
    links = [InstantLink(a.name, b.name) for x, y in pairwise(tiers)
             for a, b in ((x, y), (y, x))]
    return TierChain(tiers, links)


class FakeTieredResource(LifecycleAnswers):
    """A resource that keeps only byte counts per request and tier.

    Its records, transitions, guards and counters (``stats``) are the shared
    ``tiering.core.lifecycle.Lifecycle``'s, with a page of one byte, and its mover
    the shared ``tiering.core.tiers.PageMover`` over ``chain`` (``fake_chain``:
    ``PageTier`` ledgers, ``InstantLink`` copies): no bytes move; a transfer lands
    at once, or waits for ``poll`` or the test.

    ``async_transfers``: offloads, demotions and reloads stay in flight (both
    tiers held) until completed; ``complete_on_poll`` makes ``poll`` complete
    them, otherwise the test calls ``complete_transfers``.
    ``enforce_device_capacity=False`` lets ``reload`` go past the device
    capacity (recorded in ``max_device_used`` and ``max_device_used_by_reload``)
    instead of refusing.
    ``calls`` counts every hook call by name (a ``*_many`` hook once per
    call, however many requests it answers for). ``poll`` returns a
    ``TransferResult`` for each transfer that completed or failed since the
    previous ``poll``, whether it completed them itself or the test did
    (``complete_transfers``, ``fail_transfer``), or the request was removed
    while it ran (``state`` None), as a resource whose completions are
    applied only in its ``poll`` would. ``state`` and ``size`` are read-only
    mirrors of the records (plain dicts, for fast lookups; ``check_integrity``
    compares them).
    """

    def __init__(
        self,
        device_capacity: int,
        host_capacity: int = 0,
        disk_capacity: int = 0,
        *,
        supports_eviction: bool = True,
        async_transfers: bool = False,
        complete_on_poll: bool = True,
        enforce_device_capacity: bool = True,
        offload_to_disk_when_host_full: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not _count(device_capacity) or device_capacity <= 0:
            raise ValueError(f"FakeTieredResource: device_capacity must be an int > 0, "
                             f"got {device_capacity!r}")
        for field, value in (("host_capacity", host_capacity), ("disk_capacity", disk_capacity)):
            if not _count(value) or value < 0:
                raise ValueError(f"FakeTieredResource: {field} must be an int >= 0, "
                                 f"got {value!r}")
        for field, value in (("supports_eviction", supports_eviction),
                             ("async_transfers", async_transfers),
                             ("complete_on_poll", complete_on_poll),
                             ("enforce_device_capacity", enforce_device_capacity),
                             ("offload_to_disk_when_host_full", offload_to_disk_when_host_full)):
            if not isinstance(value, bool):
                raise ValueError(f"FakeTieredResource: {field} must be a bool, got {value!r}")
        if clock is not None and not callable(clock):
            raise ValueError(f"FakeTieredResource: clock must be callable, got {clock!r}")
        self._device_capacity = int(device_capacity)
        self._host_capacity = int(host_capacity)
        self.disk_capacity = int(disk_capacity)
        self._supports_eviction = supports_eviction
        self.async_transfers = async_transfers
        self.complete_on_poll = complete_on_poll
        self.enforce_device_capacity = enforce_device_capacity
        self.offload_to_disk_when_host_full = bool(offload_to_disk_when_host_full)
        self._clock = clock if clock is not None else FakeClock()
        self.chain = fake_chain(self._device_capacity, self._host_capacity,
                                self.disk_capacity, overcommit_device=not enforce_device_capacity)
        self.stats = Counters()
        self._mover = PageMover("FakeTieredResource", self.chain, self.stats, self._clock)
        self._life = self._mover.life
        self._dev, self._host, self._disk = self.chain.tiers
        self._by_role = {t.role: t for t in self.chain.tiers}
        self.state: dict[str, RequestState] = {}  # mirror of the records' states
        self.size: dict[str, int] = {}  # mirror of the records' sizes (bytes)
        # rid -> what get_offload_priority answers: 0.0 from add() until a test sets it
        self.priorities: dict[str, float] = {}
        self.max_device_used = 0
        self.max_device_used_by_reload = 0  # device bytes in use right after any reload
        self.calls: Counter[str] = Counter()
        # transfers the test completed or failed (or whose request went) since the last poll
        self._unreported: list[TransferResult] = []
        self.offloaded_rids: list[str] = []
        # what reclaimable() answers, per request, kept with every state change
        # so that reclaimable_many is one dict lookup a request
        self._reclaimable_now: dict[str, int] = {}

    # -- byte gauges (the chain's tiers') ----------------------------------------------

    @property
    def ledger(self) -> LedgerView:
        return LedgerView(_UsedPages(self.chain.tiers), self.chain.capacity_pages())

    @property
    def device_used(self) -> int:
        return self._dev.used_pages

    @property
    def host_used(self) -> int:
        return self._host.used_pages

    @property
    def disk_used(self) -> int:
        return self._disk.used_pages

    # -- set-up -------------------------------------------------------------------

    def add(self, rid: str, nbytes: int, tier: Tier = Tier.DEVICE) -> None:
        """Place a request's bytes directly in ``tier`` (raises if it does not fit).

        A refused call (bad rid, size or tier, a rid already known, no room, a
        closed resource) raises and changes nothing."""
        self._life.check_open("add")
        if not isinstance(rid, str) or not rid:
            raise BadRequestId(f"add: rid must be a non-empty str, got {rid!r}")
        if not isinstance(tier, Tier):
            raise ValueError(f"add({rid!r}): tier must be a Tier, got {tier!r}")
        if not _count(nbytes):
            raise ValueError(f"add({rid!r}): nbytes must be an int > 0, got {nbytes!r}")
        if rid in self.state:
            raise ValueError(f"request {rid!r} already exists")
        if nbytes <= 0:
            raise ValueError(f"request {rid!r}: nbytes must be > 0, got {nbytes!r}")
        t = self.chain.with_role(tier)[0]
        if t.free_pages < nbytes:
            raise ValueError(f"request {rid!r} does not fit on "
                             f"{'the ' if tier is not Tier.DISK else ''}{tier.value}")
        r = ChainRecord(rid, None, self._clock(), nbytes, AT_REST[tier])
        self._mover.place(r, t, nbytes)
        self._life.records[rid] = r
        self.priorities[rid] = 0.0
        self._sync(r)

    def ingest_request(self, rid: str, overrides: object = None) -> None:
        """Register ``rid`` resident with no bytes yet (idempotent; ``allocate`` grows it)."""
        now = self._clock()
        if self._life.register(rid, overrides, lambda: ChainRecord(rid, overrides, now)):
            self.priorities[rid] = 0.0
            self._sync(self._life.records[rid])

    def allocate(self, rid: str, nbytes: int) -> bool:
        """Grow a resident request to ``nbytes``; False (nothing changed) if the device is short."""
        r = self._life.get(rid, "allocate")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"allocate({rid!r}): nbytes must be an int >= 0, got {nbytes!r}")
        guard(r, Op.ALLOCATE)
        extra = nbytes - r.num_tokens
        if extra > 0:
            if self._dev.free_pages < extra:  # also when reloads overcommitted it
                return False
            self._mover.place(r, self._dev, extra)
            r.num_tokens = nbytes
            self._note_device()
            self._sync(r)
        return True

    def remove(self, rid: str) -> None:
        """The request finished: free whatever it holds."""
        r = self._life.remove(rid)
        if r.job is not None:
            self._unreported.append(
                TransferResult(rid, r.job.move, False, r.num_tokens, None, "removed"))
        del self.state[rid]
        del self.size[rid]
        del self._reclaimable_now[rid]
        del self.priorities[rid]

    remove_request = remove

    def admit(self, step, ctx) -> AdmitOutcome:
        """OK only when the request is resident and not moving."""
        return AdmitOutcome(*self._life.admission(self._life.get(step_rid(step, "admit"), "admit")))

    def close(self) -> None:
        """Every later call that looks a request up raises CacheClosed (idempotent)."""
        self._life.closed = True

    def _sync(self, r: ChainRecord) -> None:
        rid = r.rid
        self.state[rid] = r.state
        self.size[rid] = r.num_tokens
        self._reclaimable_now[rid] = r.num_tokens if r.state is _RESIDENT else 0

    def _note_device(self) -> None:
        self.max_device_used = max(self.max_device_used, self._dev.used_pages)

    def _move(self, rid: str, in_flight: RequestState, dest: RequestState) -> None:
        """Start moving ``rid`` to the tier it rests in as ``dest`` (its room was checked;
        ``in_flight``: the state it moves in); it lands now unless ``async_transfers``."""
        r = self._life.records[rid]
        dst = self._by_role[dest.tier]
        n = r.num_tokens
        if self._mover.start(r, dst, n, n) is None:  # pragma: no cover - room was checked
            raise AssertionError(f"{dst.name} refused {n} pages it had room for")
        if dst is self._dev:
            self._note_device()
        if not self.async_transfers:
            move = self._life.end(r).move
            self._life.land(r, move, n)
        self._sync(r)

    def complete_transfers(self, rids: Iterable[str] | None = None) -> int:
        """Complete in-flight transfers (all, or those named); returns how many."""
        if isinstance(rids, str):
            raise ValueError(f"complete_transfers: rids must be a collection of ids, "
                             f"not the str {rids!r}")
        done = self._complete(rids)
        self._unreported += done
        return len(done)

    def _complete(self, rids: Iterable[str] | None) -> list[TransferResult]:
        inflight = self._life.inflight
        chosen = list(inflight) if rids is None else [r for r in rids if r in inflight]
        out = []
        for rid in chosen:
            r = inflight[rid]
            job = self._life.end(r)
            out.append(self._life.land(r, job.move, r.num_tokens))
            self._sync(r)
        return out

    def fail_transfer(self, rid: str, reason: str = "injected failure") -> None:
        """An in-flight transfer fails: the request goes back to where it came from.

        UnknownRequest for an unknown rid, ValueError for one not in flight."""
        self._life.get(rid, "fail_transfer")
        r = self._life.inflight.get(rid)
        if r is None:
            raise ValueError(f"fail_transfer: request {rid!r} has no transfer in flight")
        job = self._life.end(r)
        res = self._life.survive(r, job.move, reason)
        self._sync(r)
        self._unreported.append(res._replace(nbytes=r.num_tokens))

    def in_flight(self) -> tuple[str, ...]:
        return tuple(self._life.inflight)

    # -- the eviction hooks -------------------------------------------------------

    @property
    def supports_eviction(self) -> bool:
        return self._supports_eviction

    @property
    def device_capacity_bytes(self) -> int:
        return self._device_capacity

    @property
    def host_capacity_bytes(self) -> int:
        return self._host_capacity

    def device_used_bytes(self) -> int:
        return self._dev.used_pages

    def host_used_bytes(self) -> int:
        self.calls["host_used_bytes"] += 1
        return self._host.used_pages

    def disk_used_bytes(self) -> int:
        self.calls["disk_used_bytes"] += 1
        return self._disk.used_pages

    def reclaimable(self, rid: str) -> int:
        self.calls["reclaimable"] += 1
        r = self._life.get(rid, "reclaimable")
        return r.num_tokens if r.state is _RESIDENT else 0

    def reclaimable_many(self, rids: Sequence[str]) -> np.ndarray:
        """``reclaimable`` of every rid, in one call (int64); UnknownRequest (a KeyError)
        for an unknown one, CacheClosed once closed."""
        self.calls["reclaimable_many"] += 1
        self._life.check_open("reclaimable_many")
        check_rids("reclaimable_many", rids)
        return _look_up_all(self._reclaimable_now, rids, np.int64)

    def get_offload_priority_many(self, rids: Sequence[str]) -> np.ndarray:
        """``get_offload_priority`` of every rid, in one call; UnknownRequest (a KeyError)
        for an unknown one, CacheClosed once closed."""
        self.calls["get_offload_priority_many"] += 1
        self._life.check_open("get_offload_priority_many")
        check_rids("get_offload_priority_many", rids)
        return _look_up_all(self.priorities, rids, np.float64)

    def get_offload_priority(self, rid: str) -> float:
        self.calls["get_offload_priority"] += 1
        self._life.get(rid, "get_offload_priority")
        return self.priorities.get(rid, 0.0)

    def offload(self, rid: str) -> int:
        self.calls["offload"] += 1
        r = self._life.get(rid, "offload")
        guard(r, Op.OFFLOAD)
        n = r.num_tokens
        if n == 0:
            return 0
        dst = self._mover.offload_to(n, self.offload_to_disk_when_host_full)
        if dst is None:
            self.stats.offload_refusals += 1
            return 0
        self._move(rid, RequestState.OFFLOADING, AT_REST[dst.role])
        self.offloaded_rids.append(rid)
        return n

    def is_offloaded(self, rid: str) -> bool:
        self.calls["is_offloaded"] += 1
        return super().is_offloaded(rid)

    def can_reload(self, rid: str) -> bool:
        self.calls["can_reload"] += 1
        return super().can_reload(rid)

    def reload_bytes(self, rid: str) -> int:
        self.calls["reload_bytes"] += 1
        return self._life.get(rid, "reload_bytes").num_tokens

    def reload(self, rid: str) -> bool:
        self.calls["reload"] += 1
        r = self._life.get(rid, "reload")
        guard(r, Op.RELOAD)
        n = r.num_tokens
        if self.enforce_device_capacity and self._dev.free_pages < n:
            self.stats.reload_refusals += 1
            return False
        self._move(rid, RequestState.RELOADING, _RESIDENT)
        self.max_device_used_by_reload = max(self.max_device_used_by_reload, self.device_used)
        return True

    def tier_of(self, rid: str) -> Tier | None:
        self.calls["tier_of"] += 1
        return super().tier_of(rid)

    def demote(self, rid: str) -> bool:
        self.calls["demote"] += 1
        r = self._life.get(rid, "demote")
        guard(r, Op.DEMOTE)
        if self._mover.demote_to(r.num_tokens) is None:
            self.stats.demote_refusals_disk_full += 1
            return False
        self._move(rid, RequestState.DEMOTING, RequestState.ON_DISK)
        return True

    def drop(self, rid: str) -> None:
        self.calls["drop"] += 1
        r = self._life.get(rid, "drop")
        self._life.drop(r)
        self._sync(r)

    def poll(self) -> list[TransferResult]:
        """Complete every transfer in flight (when ``complete_on_poll``); returns a record
        of each that completed or failed since the previous ``poll``. CacheClosed once
        closed, as the real cache's ``poll``."""
        self.calls["poll"] += 1
        self._life.check_open("poll")
        done = self._unreported
        if done:
            self._unreported = []
        if self._life.inflight and self.async_transfers and self.complete_on_poll:
            done += self._complete(None)
        return done

    # -- checking -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """The shared mover's check (holdings per state, each tier's ledger owner by
        owner, the in-flight table; host and disk, and the device unless it may
        overcommit, within capacity) and the mirrors against the records."""
        problems = self._mover.problems(lambda r: r.num_tokens)
        records = self._life.records
        if self.state != {rid: r.state for rid, r in records.items()}:
            problems.append("the state mirror disagrees with the records")
        if self.size != {rid: r.num_tokens for rid, r in records.items()}:
            problems.append("the size mirror disagrees with the records")
        answers = {rid: r.num_tokens if r.state is _RESIDENT else 0 for rid, r in records.items()}
        if answers != self._reclaimable_now:
            problems.append("reclaimable_many would disagree with the request states")
        if problems:
            raise AssertionError("FakeTieredResource integrity: " + "; ".join(problems[:20]))


def _look_up_all(mapping: dict, keys: Sequence[str], dtype: type) -> np.ndarray:
    """``[mapping[k] for k in keys]`` as an array, in one C-level pass; KeyError if one is missing."""
    try:
        if len(keys) < 2:
            return np.array([mapping[k] for k in keys], dtype=dtype)
        return np.fromiter(itemgetter(*keys)(mapping), dtype=dtype, count=len(keys))
    except (KeyError, TypeError):
        missing = next((k for k in keys if not isinstance(k, str) or k not in mapping), None)
        raise UnknownRequest(f"unknown request {missing!r}") from None


class ExactPressure:
    """Synchronous pressure: the resources' device bytes in use over their capacity."""

    def __init__(self, *resources: FakeTieredResource) -> None:
        if not resources:
            raise ValueError("ExactPressure needs at least one resource")
        for r in resources:  # one list given for the resources is the usual slip
            if not _count(getattr(r, "device_capacity_bytes", None)) or not hasattr(r, "device_used"):
                raise TypeError(
                    f"ExactPressure: each resource needs device_capacity_bytes and device_used "
                    f"(a FakeTieredResource; pass them as ExactPressure(a, b)), got {r!r:.80}")
        self._resources = resources
        self._capacity = sum(r.device_capacity_bytes for r in resources)
        self.reads = 0

    def read(self) -> float:
        self.reads += 1
        return sum(r.device_used for r in self._resources) / self._capacity


class Reading(NamedTuple):
    """A numbered pressure sample (same fields as the poller's reading)."""

    fraction: float
    seq: int
    at: float


class LaggingPressure:
    """A poller stand-in: ``latest()`` returns the last sample published by ``sample()``."""

    def __init__(self, source: ExactPressure, clock: FakeClock | None = None) -> None:
        if not callable(getattr(source, "read", None)):
            raise TypeError(f"LaggingPressure: source must have read() (an ExactPressure), "
                            f"got {source!r:.80}")
        if clock is not None and not callable(clock):
            raise TypeError(f"LaggingPressure: clock must be callable or None, got {clock!r:.80}")
        self._source = source
        self._clock = clock
        self._latest: Reading | None = None
        self._seq = 0

    def sample(self) -> Reading:
        self._seq += 1
        at = self._clock() if self._clock is not None else float(self._seq)
        self._latest = Reading(self._source.read(), self._seq, at)
        return self._latest

    def latest(self) -> Reading | None:
        return self._latest


class ScriptedFraction:
    """A synchronous source returning whatever fraction the test set last.

    Nothing is checked, on purpose: a test sets NaN, a negative or a str to
    see what the controller does with a broken source."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def set(self, value: float) -> None:
        self.value = value

    def read(self) -> float:
        return self.value


__all__ = [
    "ExactPressure",
    "FakeClock",
    "FakeTieredResource",
    "LaggingPressure",
    "LedgerView",
    "PolicyCheck",
    "Reading",
    "ScriptedFraction",
    "check_block_policy",
    "check_policy",
    "fake_chain",
]
