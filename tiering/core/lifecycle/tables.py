"""The tables of the request lifecycle: tiers each state holds, guards, counters, records.

Everything here is data or a pure function of it; ``machine`` changes records
by these tables. See the package docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from tiering.errors import IllegalTransition
from tiering.types import RELOADABLE_STATES, IdentityEnum, Move, RequestState, Tier

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


class Op(IdentityEnum):
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
    Op.RELOAD: (RELOADABLE_STATES, "reload: request {rid!r} is {state}; a reload starts only "
                "from on_host or on_disk (can_reload says when)"),
    Op.DROP: (RELOADABLE_STATES, "drop: request {rid!r} is {state}; only a request on_host or "
              "on_disk is dropped (can_reload says when)"),
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


def page_release_all(ledger: PageLedger) -> Callable[[PageRecord], None]:
    """Give every tier's pages of a ``PageRecord`` back to ``ledger`` at once."""
    used = ledger.used

    def release_all(r: PageRecord) -> None:
        used[0] -= r.device
        used[1] -= r.host
        used[2] -= r.disk
        r.device = r.host = r.disk = 0

    return release_all


def ledger_maps(ledger: PageLedger, tiers: Iterable[Tier] = TIERS) -> tuple[dict, dict]:
    """(used, capacity) of ``ledger`` as tier maps, for ``Lifecycle.check``."""
    used = {t: ledger.used[TIER_INDEX[t]] for t in tiers}
    cap = {t: ledger.cap[TIER_INDEX[t]] for t in tiers}
    return used, cap
