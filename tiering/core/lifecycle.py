"""One tensor-free request state machine, shared by every KV backend.

``PagedKVCache`` (threads, CUDA and zarr copies), the replay's
``ModeledKVCache`` (simulated link time) and ``tiering.testing``'s
``FakeTieredResource`` (instant, or completed when a test says) keep their
requests in a ``Lifecycle``. It owns what they must agree on:

- the request records (state, pages held per tier, the move in flight);
- the legal transitions (``tiering.types.check_transition``) and the one table
  of which tiers each state holds (``HOLDS``);
- the guard messages (``UnknownRequest``, ``CacheClosed``, ``IllegalTransition``);
- the counters (``Counters``: one set of names);
- the move choice (``offload_move``: host, or disk when the host is full and
  that is allowed);
- begin / land / survive / cancel / lose of a move, each returning a
  ``TransferResult``;
- ``check`` of the records against the per-tier page ledger.

What differs between the backends is the mover behind the machine: what a
tier's pages *are* (slot lists and disk extents, or plain counts) and how a
copy runs. A backend gives the machine one release function per tier (a typed
``Tier -> handler`` table) and its records say what they hold (``held``).
Nothing here imports torch or touches bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from tiering.errors import CacheClosed, IllegalTransition, UnknownRequest
from tiering.types import (
    CANCELLED,
    RELOADABLE_STATES,
    Move,
    RequestState,
    Tier,
    TransferResult,
    check_transition,
)

S = RequestState

#: Index of each tier in a ``held()`` triple and a ``PageLedger``.
TIER_INDEX = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}
TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)

#: The state a request rests in on each tier.
AT_REST = {Tier.DEVICE: S.RESIDENT, Tier.HOST: S.ON_HOST, Tier.DISK: S.ON_DISK}
#: The state a request is in while each move runs.
IN_FLIGHT = {
    Move.OFFLOAD_TO_HOST: S.OFFLOADING,
    Move.OFFLOAD_TO_DISK: S.OFFLOADING,
    Move.DEMOTE: S.DEMOTING,
    Move.RELOAD_FROM_HOST: S.RELOADING,
    Move.RELOAD_FROM_DISK: S.RELOADING,
}
#: The reload that brings a request back from each lower tier.
RELOAD_FROM = {Tier.HOST: Move.RELOAD_FROM_HOST, Tier.DISK: Move.RELOAD_FROM_DISK}

_D, _H, _K = Tier.DEVICE, Tier.HOST, Tier.DISK

#: THE table of which tiers a request in each state holds pages in (the one
#: copy; every backend's integrity check reads it). In flight, a request holds
#: its source and its destination; which pair is the move's to say.
HOLDS: dict[RequestState, frozenset[frozenset[Tier]]] = {
    S.RESIDENT: frozenset({frozenset({_D})}),
    S.OFFLOADING: frozenset({frozenset({_D, _H}), frozenset({_D, _K})}),
    S.ON_HOST: frozenset({frozenset({_H})}),
    S.DEMOTING: frozenset({frozenset({_H, _K})}),
    S.ON_DISK: frozenset({frozenset({_K})}),
    S.RELOADING: frozenset({frozenset({_D, _H}), frozenset({_D, _K})}),
    S.LOST: frozenset({frozenset()}),
}


def holds(state: RequestState, move: Move | None) -> frozenset[frozenset[Tier]]:
    """The sets of tiers a request in ``state`` may hold pages in; with ``move``
    in flight (and ``state`` its in-flight state), exactly its source and destination."""
    if move is not None and IN_FLIGHT[move] is state:
        return frozenset({frozenset({move.source, move.destination})})
    return HOLDS[state]


class Op(enum.Enum):
    """A request operation whose state is guarded."""

    OFFLOAD = "offload"
    DEMOTE = "demote"
    RELOAD = "reload"
    DROP = "drop"
    ALLOCATE = "allocate"


#: The states each operation accepts, and the message naming the rule.
GUARDS: dict[Op, tuple[frozenset[RequestState], str]] = {
    Op.OFFLOAD: (frozenset({S.RESIDENT}), "offload: request {rid!r} is {state}; only a resident request offloads"),
    Op.DEMOTE: (frozenset({S.ON_HOST}), "demote: request {rid!r} is {state}; only an on-host request demotes"),
    Op.RELOAD: (RELOADABLE_STATES, "reload: request {rid!r} is {state}; only an offloaded request reloads"),
    Op.DROP: (RELOADABLE_STATES, "drop: request {rid!r} is {state}; only an offloaded request is dropped"),
    Op.ALLOCATE: (frozenset({S.RESIDENT}), "request {rid!r} is {state}; allocate needs it resident"),
}


def guard(r: Record, op: Op) -> None:
    """Raise IllegalTransition (naming the request and its state) unless ``op`` is legal now."""
    allowed, message = GUARDS[op]
    if r.state not in allowed:
        raise IllegalTransition(message.format(rid=r.rid, state=r.state.value))


def offload_move(host_room: bool, disk_room: bool, to_disk_when_host_full: bool) -> Move | None:
    """Where an offload goes: the host when it has room, else the disk when that
    is allowed and has room; None when neither (the offload is refused)."""
    if host_room:
        return Move.OFFLOAD_TO_HOST
    if disk_room and to_disk_when_host_full:
        return Move.OFFLOAD_TO_DISK
    return None


# -- counters ---------------------------------------------------------------------------

#: What a landed move counts: (moves field, bytes field).
MOVE_COUNTERS: dict[Move, tuple[str, str]] = {
    Move.OFFLOAD_TO_HOST: ("offloads_to_host", "bytes_device_to_host"),
    Move.OFFLOAD_TO_DISK: ("offloads_to_disk", "bytes_device_to_disk"),
    Move.DEMOTE: ("demotions", "bytes_host_to_disk"),
    Move.RELOAD_FROM_HOST: ("reloads_from_host", "bytes_host_to_device"),
    Move.RELOAD_FROM_DISK: ("reloads_from_disk", "bytes_disk_to_device"),
}
#: What a failed move counts.
FAILURE_COUNTERS: dict[Move, str] = {
    Move.OFFLOAD_TO_HOST: "offload_failures",
    Move.OFFLOAD_TO_DISK: "offload_failures",
    Move.DEMOTE: "demote_failures",
    Move.RELOAD_FROM_HOST: "reload_failures",
    Move.RELOAD_FROM_DISK: "reload_failures",
}
_RELOADS = frozenset({Move.RELOAD_FROM_HOST, Move.RELOAD_FROM_DISK})
_OFFLOADS = frozenset({Move.OFFLOAD_TO_HOST, Move.OFFLOAD_TO_DISK})


class Counters:
    """Counters of moves and faults, one set of names for every backend.

    Plain numbers; ``as_dict`` for reports. A backend with more to count
    extends ``FIELDS`` in a subclass (``KVStats``, ``ModelStats``)."""

    FIELDS: tuple[str, ...] = (
        "offloads_to_host", "offloads_to_disk", "demotions", "reloads_from_host",
        "reloads_from_disk", "bytes_device_to_host", "bytes_device_to_disk",
        "bytes_host_to_disk", "bytes_host_to_device", "bytes_disk_to_device",
        "offload_refusals", "reload_refusals", "demote_refusals_disk_full",
        "offload_failures", "demote_failures", "reload_failures", "lost", "dropped",
        "offloads_cancelled", "reload_stall_s_total",
    )

    def __init__(self) -> None:
        for f in self.FIELDS:
            setattr(self, f, 0)

    def as_dict(self) -> dict[str, float]:
        return {f: getattr(self, f) for f in self.FIELDS}


# -- records and the ledger ----------------------------------------------------------------


class Job(NamedTuple):
    """A move in flight: what it is, when it started, and the mover's handle
    (a future, a sequence number, or None)."""

    move: Move
    started: float
    handle: Any = None


@dataclass(eq=False, slots=True)
class Record:
    """One request. ``job`` is the move in flight (``.move``, ``.started``), or None.
    Subclasses say what they hold per tier (``held``) and how many pages a full
    copy needs (``need``)."""

    rid: str
    overrides: Any
    ingested_at: float
    num_tokens: int = 0
    state: RequestState = S.RESIDENT
    job: Any = None
    lost_reason: str | None = None

    def held(self) -> tuple[int, int, int]:  # pragma: no cover - every backend overrides
        raise NotImplementedError


@dataclass(eq=False, slots=True)
class PageRecord(Record):
    """A record whose holdings are page counts (the model's and the fake's)."""

    device: int = 0
    host: int = 0
    disk: int = 0

    def held(self) -> tuple[int, int, int]:
        return (self.device, self.host, self.disk)


class PageLedger:
    """Pages used per tier against a capacity (``used`` and ``cap`` are lists
    indexed by ``TIER_INDEX``, read directly on hot paths)."""

    __slots__ = ("cap", "used")

    def __init__(self, device: int, host: int, disk: int) -> None:
        for name, v in (("device", device), ("host", host), ("disk", disk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"PageLedger: {name} capacity must be an int >= 0, got {v!r}")
        self.cap = [device, host, disk]
        self.used = [0, 0, 0]

    def free(self, tier: Tier) -> int:
        i = TIER_INDEX[tier]
        return self.cap[i] - self.used[i]

    def take(self, i: int, n: int, force: bool = False) -> bool:
        """Take ``n`` pages of tier ``i``; False (nothing changed) if short, unless ``force``."""
        used = self.used[i] + n
        if used > self.cap[i] and not force:
            return False
        self.used[i] = used
        return True

    def give(self, i: int, n: int) -> None:
        self.used[i] -= n


def page_releasers(ledger: PageLedger) -> dict[Tier, Callable[[PageRecord], None]]:
    """The release table of a ``PageRecord`` backend: give a tier's pages back to ``ledger``."""
    used = ledger.used

    def device(r: PageRecord) -> None:
        used[0] -= r.device
        r.device = 0

    def host(r: PageRecord) -> None:
        used[1] -= r.host
        r.host = 0

    def disk(r: PageRecord) -> None:
        used[2] -= r.disk
        r.disk = 0

    return {Tier.DEVICE: device, Tier.HOST: host, Tier.DISK: disk}


# -- the machine ------------------------------------------------------------------------------


class Lifecycle:
    """The records of one backend and every change of their state.

    ``release``: one function per tier that gives back what a record holds
    there (and empties it). ``release_all`` (default: each tier in turn) is
    called when a request is lost. ``on_lost(r, reason)`` logs, if given.
    Single-threaded: only the backend's caller thread uses it.
    """

    def __init__(
        self,
        name: str,
        counters: Counters,
        clock: Callable[[], float],
        release: Mapping[Tier, Callable[[Any], None]],
        *,
        release_all: Callable[[Any], None] | None = None,
        on_lost: Callable[[Any, str], None] | None = None,
    ) -> None:
        missing = [t.value for t in TIERS if t not in release]
        if missing:
            raise ValueError(f"Lifecycle({name}): no release function for tier(s) {missing}")
        self.name = name
        self.counters = counters
        self.records: dict[str, Any] = {}
        self.inflight: dict[str, Any] = {}  # rid -> record with a move in flight
        self.closed = False
        self._clock = clock
        self._release = dict(release)
        self._release_all = release_all or self._each_tier
        self._on_lost = on_lost
        self._lost: list[tuple[str, str]] = []

    # -- guards ------------------------------------------------------------------

    def check_open(self, what: str) -> None:
        if self.closed:
            raise CacheClosed(f"{what}: the KV cache is closed")

    def get(self, rid: str, what: str = "call") -> Any:
        """The record of ``rid``; CacheClosed when closed, UnknownRequest when unknown."""
        if self.closed:
            raise CacheClosed(f"{what}: the KV cache is closed")
        try:
            return self.records[rid]
        except (KeyError, TypeError):
            raise UnknownRequest(f"unknown request {rid!r}") from None

    def register(self, rid: str, overrides: Any, make: Callable[[], Any]) -> bool:
        """Add ``make()`` as the record of ``rid``; True when new. Idempotent for the
        same overrides; different ones are refused with ValueError (nothing changes)."""
        self.check_open("ingest_request")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request id must be a non-empty str, got {rid!r}")
        r = self.records.get(rid)
        if r is not None:
            if r.overrides != overrides:
                raise ValueError(
                    f"request {rid!r} was already ingested with overrides {r.overrides!r};"
                    f" got different overrides {overrides!r}"
                )
            return False
        self.records[rid] = make()
        return True

    def forget(self, rid: str) -> None:
        """Drop the record of ``rid`` (its holdings are the backend's to give back first)."""
        del self.records[rid]
        self.inflight.pop(rid, None)

    # -- transitions -------------------------------------------------------------

    def set_state(self, r: Any, state: RequestState) -> None:
        check_transition(r.rid, r.state, state)
        r.state = state

    def begin(self, r: Any, job: Any) -> None:
        """Start ``job.move`` (its destination already reserved by the mover)."""
        check_transition(r.rid, r.state, IN_FLIGHT[job.move])
        r.state = IN_FLIGHT[job.move]
        r.job = job
        self.inflight[r.rid] = r

    def end(self, r: Any) -> Any:
        """Take the finished job off ``r`` (before its outcome is applied); returns it."""
        job, r.job = r.job, None
        self.inflight.pop(r.rid, None)
        return job

    def land(self, r: Any, move: Move, nbytes: int, started: float | None = None,
             at: float | None = None) -> TransferResult:
        """A completed move: the source is given back, the request rests at the
        destination, the move is counted (a reload's stall from ``started`` to ``at``)."""
        self._release[move.source](r)
        state = AT_REST[move.destination]
        check_transition(r.rid, r.state, state)
        r.state = state
        c = self.counters
        moves, link = MOVE_COUNTERS[move]
        setattr(c, moves, getattr(c, moves) + 1)
        setattr(c, link, getattr(c, link) + nbytes)
        if started is not None and move in _RELOADS:
            c.reload_stall_s_total += max(0.0, (self._clock() if at is None else at) - started)
        return TransferResult(r.rid, move, True, nbytes, state)

    def survive(self, r: Any, move: Move, reason: str) -> TransferResult:
        """A failed copy or write: the destination is given back, the request stays at its source."""
        self._release[move.destination](r)
        back = AT_REST[move.source]
        self.set_state(r, back)
        c = self.counters
        field = FAILURE_COUNTERS[move]
        setattr(c, field, getattr(c, field) + 1)
        return TransferResult(r.rid, move, False, 0, back, reason)

    def cancel(self, r: Any) -> TransferResult:
        """Take back a move whose copy never started (the mover cancelled it)."""
        move = self.end(r).move
        self._release[move.destination](r)
        back = AT_REST[move.source]
        self.set_state(r, back)
        if move in _OFFLOADS:
            self.counters.offloads_cancelled += 1
        return TransferResult(r.rid, move, False, 0, back, CANCELLED)

    def lose(self, r: Any, move: Move, reason: str) -> TransferResult:
        """A move whose bytes are gone: the request is LOST with ``reason``."""
        self.mark_lost(r, reason)
        return TransferResult(r.rid, move, False, 0, S.LOST, reason)

    def mark_lost(self, r: Any, reason: str) -> None:
        if self._on_lost is not None:
            self._on_lost(r, reason)
        self._release_all(r)
        r.lost_reason = reason
        self.set_state(r, S.LOST)
        if reason != "dropped":
            self.counters.lost += 1
        self._lost.append((r.rid, reason))

    def drop(self, r: Any) -> None:
        """Give up an offloaded request's KV (it will be recomputed): LOST, "dropped"."""
        guard(r, Op.DROP)
        self.counters.dropped += 1
        self.mark_lost(r, "dropped")

    def take_lost(self) -> list[tuple[str, str]]:
        """(rid, reason) of requests lost since the last call."""
        out, self._lost = self._lost, []
        return out

    def _each_tier(self, r: Any) -> None:
        for tier in TIERS:
            self._release[tier](r)

    # -- integrity -------------------------------------------------------------------

    def reserved(self, tier: Tier) -> int:
        """Pages of ``tier`` reserved as the destination of a move in flight."""
        i = TIER_INDEX[tier]
        return sum(r.held()[i] for r in self.inflight.values() if r.job.move.destination is tier)

    def check(
        self,
        need: Callable[[Any], int],
        *,
        used: Mapping[Tier, int] | None = None,
        capacity: Mapping[Tier, int] | None = None,
        extra: Mapping[Tier, int] | None = None,
        skip: Callable[[Any], bool] | None = None,
    ) -> list[str]:
        """What is wrong with the records, as messages (empty: nothing).

        Each record holds exactly the tiers ``HOLDS`` (or its move) allows, each
        non-empty holding is ``need(r)`` pages, a move is in flight exactly in an
        in-flight state and the in-flight table lists exactly those. With
        ``used``, each tier's ledger equals what the records hold plus ``extra``
        (held by others: cached blocks, copies of removed requests); with
        ``capacity``, no tier is over it. ``skip(r)``: records the backend checks itself.
        """
        problems: list[str] = []
        held = [0, 0, 0]
        for rid, r in self.records.items():
            h = r.held()
            held[0] += h[0]
            held[1] += h[1]
            held[2] += h[2]
            if skip is not None and skip(r):
                continue
            st = r.state
            job = r.job
            n = need(r)
            has = frozenset(t for t, k in zip(TIERS, h, strict=True) if k)
            move = job.move if job is not None else None
            allowed = set(holds(st, move))
            if n == 0 and st is not S.LOST:
                allowed.add(frozenset())
            if has not in allowed:
                problems.append(f"{rid}: state {st.value} holds {sorted(t.value for t in has)}")
            for t, k in zip(TIERS, h, strict=True):
                if k and k != n:
                    problems.append(f"{rid}: {k} {t.value} pages, needs {n}")
            if st.in_flight != (job is not None) or st.in_flight != (rid in self.inflight):
                problems.append(f"{rid}: state {st.value} but job={job is not None}")
            if move is not None and IN_FLIGHT[move] is not st:
                problems.append(f"{rid}: state {st.value} with {move.value} in flight")
            if (st is S.LOST) != (r.lost_reason is not None):
                problems.append(f"{rid}: state {st.value}, lost reason {r.lost_reason!r}")
        for rid, r in self.inflight.items():
            if self.records.get(rid) is not r:
                problems.append(f"{rid}: in flight but not a current record")
        for tier in TIERS:
            i = TIER_INDEX[tier]
            total = held[i] + (extra or {}).get(tier, 0)
            if used is not None and tier in used and used[tier] != total:
                problems.append(
                    f"{tier.value}: records hold {total} pages, the ledger says {used[tier]}")
            if capacity is not None and tier in capacity and used is not None and tier in used:
                if not 0 <= used[tier] <= capacity[tier]:
                    problems.append(f"{tier.value}: {used[tier]} pages used of {capacity[tier]}")
        return problems

    def states(self) -> dict[str, RequestState]:
        return {rid: r.state for rid, r in self.records.items()}


def ledger_maps(ledger: PageLedger, tiers: Iterable[Tier] = TIERS) -> tuple[dict, dict]:
    """(used, capacity) of ``ledger`` as tier maps, for ``Lifecycle.check``."""
    used = {t: ledger.used[TIER_INDEX[t]] for t in tiers}
    cap = {t: ledger.cap[TIER_INDEX[t]] for t in tiers}
    return used, cap
