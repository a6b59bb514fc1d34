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
``tiering.testing.blocks.check_block_policy`` (a block retention policy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from tiering.types import Move, RequestState, Tier, TransferResult


class FakeClock:
    """A clock that moves only when told."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"FakeClock.advance: seconds must be >= 0, got {seconds!r}")
        self.now += seconds


_ON_HOST = RequestState.ON_HOST
_ON_DISK = RequestState.ON_DISK
_RESIDENT = RequestState.RESIDENT

_MOVES = {
    (_RESIDENT, _ON_HOST): Move.OFFLOAD_TO_HOST,
    (_RESIDENT, _ON_DISK): Move.OFFLOAD_TO_DISK,
    (_ON_HOST, _ON_DISK): Move.DEMOTE,
    (_ON_HOST, _RESIDENT): Move.RELOAD_FROM_HOST,
    (_ON_DISK, _RESIDENT): Move.RELOAD_FROM_DISK,
}


def _move(source: RequestState, dest: RequestState) -> Move:
    return _MOVES[(source, dest)]


class FakeTieredResource:
    """A resource that keeps only byte counts per request and tier.

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
    applied only in its ``poll`` would.
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
    ) -> None:
        if device_capacity <= 0:
            raise ValueError(f"device_capacity must be > 0, got {device_capacity!r}")
        self._device_capacity = int(device_capacity)
        self._host_capacity = int(host_capacity)
        self.disk_capacity = int(disk_capacity)
        self._supports_eviction = supports_eviction
        self.async_transfers = async_transfers
        self.complete_on_poll = complete_on_poll
        self.enforce_device_capacity = enforce_device_capacity
        self.state: dict[str, RequestState] = {}
        self.size: dict[str, int] = {}
        # rid -> what get_offload_priority answers: 0.0 from add() until a test sets it
        self.priorities: dict[str, float] = {}
        # in-flight rid -> (state it left, state it will reach); both tiers are held
        self._dest: dict[str, tuple[RequestState, RequestState]] = {}
        self.device_used = 0
        self.host_used = 0
        self.disk_used = 0
        self.max_device_used = 0
        self.max_device_used_by_reload = 0  # device bytes in use right after any reload
        self.calls: Counter[str] = Counter()
        # transfers the test completed or failed (or whose request went) since the last poll
        self._unreported: list[TransferResult] = []
        self.offloaded_rids: list[str] = []
        # what reclaimable() answers, per request, kept with every state change
        # so that reclaimable_many is one dict lookup a request
        self._reclaimable_now: dict[str, int] = {}

    # -- set-up -------------------------------------------------------------------

    def add(self, rid: str, nbytes: int, tier: Tier = Tier.DEVICE) -> None:
        """Place a request's bytes directly in ``tier`` (raises if it does not fit)."""
        if rid in self.state:
            raise ValueError(f"request {rid!r} already exists")
        if nbytes <= 0:
            raise ValueError(f"request {rid!r}: nbytes must be > 0, got {nbytes!r}")
        if tier is Tier.DEVICE:
            if self.device_used + nbytes > self._device_capacity:
                raise ValueError(f"request {rid!r} does not fit on the device")
            self.device_used += nbytes
            self.max_device_used = max(self.max_device_used, self.device_used)
            state = _RESIDENT
        elif tier is Tier.HOST:
            if self.host_used + nbytes > self._host_capacity:
                raise ValueError(f"request {rid!r} does not fit on the host")
            self.host_used += nbytes
            state = _ON_HOST
        else:
            if self.disk_used + nbytes > self.disk_capacity:
                raise ValueError(f"request {rid!r} does not fit on disk")
            self.disk_used += nbytes
            state = _ON_DISK
        self.size[rid] = nbytes
        self.priorities[rid] = 0.0
        self._set_state(rid, state)

    def remove(self, rid: str) -> None:
        """The request finished: free whatever it holds."""
        if rid in self._dest:
            source, dest = self._dest.pop(rid)
            self._free(rid, source)
            self._free(rid, dest)
            self._unreported.append(
                TransferResult(rid, _move(source, dest), False, self.size[rid], None, "removed"))
        else:
            self._free(rid, self.state[rid])
        del self.state[rid]
        del self.size[rid]
        del self._reclaimable_now[rid]
        del self.priorities[rid]

    def _set_state(self, rid: str, state: RequestState) -> None:
        self.state[rid] = state
        self._reclaimable_now[rid] = self.size[rid] if state is _RESIDENT else 0

    def _free(self, rid: str, state: RequestState) -> None:
        tier = state.tier
        n = self.size[rid]
        if tier is Tier.DEVICE:
            self.device_used -= n
        elif tier is Tier.HOST:
            self.host_used -= n
        elif tier is Tier.DISK:
            self.disk_used -= n

    def _take(self, rid: str, state: RequestState) -> None:
        tier = state.tier
        n = self.size[rid]
        if tier is Tier.DEVICE:
            self.device_used += n
            self.max_device_used = max(self.max_device_used, self.device_used)
        elif tier is Tier.HOST:
            self.host_used += n
        elif tier is Tier.DISK:
            self.disk_used += n

    def _move(self, rid: str, in_flight: RequestState, dest: RequestState) -> None:
        """Reserve the destination; free the source now or when the transfer completes."""
        self._take(rid, dest)
        if self.async_transfers:
            self._dest[rid] = (self.state[rid], dest)
            self._set_state(rid, in_flight)
        else:
            self._free(rid, self.state[rid])
            self._set_state(rid, dest)

    def complete_transfers(self, rids: Iterable[str] | None = None) -> int:
        """Complete in-flight transfers (all, or those named); returns how many."""
        done = self._complete(rids)
        self._unreported += done
        return len(done)

    def _complete(self, rids: Iterable[str] | None) -> list[TransferResult]:
        chosen = list(self._dest) if rids is None else [r for r in rids if r in self._dest]
        out = []
        for rid in chosen:
            source, dest = self._dest.pop(rid)
            self._free(rid, source)
            self._set_state(rid, dest)
            out.append(TransferResult(rid, _move(source, dest), True, self.size[rid], dest))
        return out

    def fail_transfer(self, rid: str, reason: str = "injected failure") -> None:
        """An in-flight transfer fails: the request goes back to where it came from."""
        source, dest = self._dest.pop(rid)
        self._free(rid, dest)
        self._set_state(rid, source)
        self._unreported.append(
            TransferResult(rid, _move(source, dest), False, self.size[rid], source, reason))

    def in_flight(self) -> tuple[str, ...]:
        return tuple(self._dest)

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

    def host_used_bytes(self) -> int:
        self.calls["host_used_bytes"] += 1
        return self.host_used

    def disk_used_bytes(self) -> int:
        self.calls["disk_used_bytes"] += 1
        return self.disk_used

    def reclaimable(self, rid: str) -> int:
        self.calls["reclaimable"] += 1
        return self.size[rid] if self.state[rid] is _RESIDENT else 0

    def reclaimable_many(self, rids: Sequence[str]) -> np.ndarray:
        """``reclaimable`` of every rid, in one call (int64); KeyError for an unknown one."""
        self.calls["reclaimable_many"] += 1
        return _look_up_all(self._reclaimable_now, rids, np.int64)

    def get_offload_priority_many(self, rids: Sequence[str]) -> np.ndarray:
        """``get_offload_priority`` of every rid, in one call; KeyError for an unknown one."""
        self.calls["get_offload_priority_many"] += 1
        return _look_up_all(self.priorities, rids, np.float64)

    def get_offload_priority(self, rid: str) -> float:
        self.calls["get_offload_priority"] += 1
        if rid not in self.state:
            raise KeyError(f"unknown request {rid!r}")
        return self.priorities.get(rid, 0.0)

    def offload(self, rid: str) -> int:
        self.calls["offload"] += 1
        state = self.state[rid]
        if state is not _RESIDENT:
            raise ValueError(f"request {rid!r} is {state.value}; cannot offload")
        n = self.size[rid]
        if self.host_used + n <= self._host_capacity:
            self._move(rid, RequestState.OFFLOADING, _ON_HOST)
        elif self.disk_used + n <= self.disk_capacity:
            self._move(rid, RequestState.OFFLOADING, _ON_DISK)
        else:
            return 0
        self.offloaded_rids.append(rid)
        return n

    def is_offloaded(self, rid: str) -> bool:
        self.calls["is_offloaded"] += 1
        return self.state[rid] in (_ON_HOST, _ON_DISK)

    def can_reload(self, rid: str) -> bool:
        self.calls["can_reload"] += 1
        return self.state[rid] in (_ON_HOST, _ON_DISK)

    def reload_bytes(self, rid: str) -> int:
        self.calls["reload_bytes"] += 1
        return self.size[rid]

    def reload(self, rid: str) -> bool:
        self.calls["reload"] += 1
        state = self.state[rid]
        if state not in (_ON_HOST, _ON_DISK):
            raise ValueError(f"request {rid!r} is {state.value}; cannot reload")
        n = self.size[rid]
        if self.enforce_device_capacity and self.device_used + n > self._device_capacity:
            return False
        self._move(rid, RequestState.RELOADING, _RESIDENT)
        self.max_device_used_by_reload = max(self.max_device_used_by_reload, self.device_used)
        return True

    def tier_of(self, rid: str) -> Tier | None:
        self.calls["tier_of"] += 1
        return self.state[rid].tier

    def demote(self, rid: str) -> bool:
        self.calls["demote"] += 1
        state = self.state[rid]
        if state is not _ON_HOST:
            raise ValueError(f"request {rid!r} is {state.value}; cannot demote")
        if self.disk_used + self.size[rid] > self.disk_capacity:
            return False
        self._move(rid, RequestState.DEMOTING, _ON_DISK)
        return True

    def drop(self, rid: str) -> None:
        self.calls["drop"] += 1
        state = self.state[rid]
        if state not in (_ON_HOST, _ON_DISK):
            raise ValueError(f"request {rid!r} is {state.value}; cannot drop")
        self._free(rid, state)
        self._set_state(rid, RequestState.LOST)

    def poll(self) -> list[TransferResult]:
        """Complete every transfer in flight (when ``complete_on_poll``); returns a record
        of each that completed or failed since the previous ``poll``."""
        self.calls["poll"] += 1
        done = self._unreported
        if done:
            self._unreported = []
        if self._dest and self.async_transfers and self.complete_on_poll:
            done += self._complete(None)
        return done

    # -- checking -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Byte counters equal what the request states say is held."""
        used = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
        for rid, state in self.state.items():
            held = self._dest.get(rid, (state,))
            for s in held:
                if s.tier is not None:
                    used[s.tier] += self.size[rid]
        got = {Tier.DEVICE: self.device_used, Tier.HOST: self.host_used, Tier.DISK: self.disk_used}
        if used != got:
            raise AssertionError(f"byte ledger mismatch: states say {used}, counters say {got}")
        answers = {r: self.size[r] if s is _RESIDENT else 0 for r, s in self.state.items()}
        if answers != self._reclaimable_now:
            raise AssertionError("reclaimable_many would disagree with the request states")
        if self.host_used > self._host_capacity or self.disk_used > self.disk_capacity:
            raise AssertionError("host or disk over capacity")


def _look_up_all(mapping: dict, keys: Sequence[str], dtype: type) -> np.ndarray:
    """``[mapping[k] for k in keys]`` as an array, in one C-level pass; KeyError if one is missing."""
    if len(keys) < 2:
        return np.array([mapping[k] for k in keys], dtype=dtype)
    return np.fromiter(itemgetter(*keys)(mapping), dtype=dtype, count=len(keys))


class ExactPressure:
    """Synchronous pressure: the resources' device bytes in use over their capacity."""

    def __init__(self, *resources: FakeTieredResource) -> None:
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
    """A synchronous source returning whatever fraction the test set last."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def set(self, value: float) -> None:
        self.value = value

    def read(self) -> float:
        return self.value
