"""Small shared vocabulary: tiers, request states and the legal moves between them.

Every layer speaks of where a request's KV lives in these words, so they live
in one module with no dependencies of its own.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from tiering.errors import IllegalTransition


class IdentityEnum(enum.Enum):
    """An enum whose members hash by identity, in C: they are singletons compared by
    identity, and Enum's own ``__hash__`` is a Python call on every dict lookup."""

    __hash__ = object.__hash__


class Tier(IdentityEnum):
    """Where a request's KV cache lives."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class RequestState(IdentityEnum):
    """The lifecycle of one request's KV cache.

    A request is in exactly one tier, except while a transfer is in flight
    (OFFLOADING, DEMOTING, RELOADING), when it holds slots in both the source
    and the destination tier.
    """

    RESIDENT = "resident"  # on the device, readable
    OFFLOADING = "offloading"  # device -> host (or device -> disk) copy in flight
    ON_HOST = "on_host"
    DEMOTING = "demoting"  # host -> disk write in flight
    ON_DISK = "on_disk"
    RELOADING = "reloading"  # host/disk -> device copy in flight
    LOST = "lost"  # its bytes could not be kept; the reason is recorded

    @property
    def in_flight(self) -> bool:
        return self in (RequestState.OFFLOADING, RequestState.DEMOTING, RequestState.RELOADING)

    @property
    def tier(self) -> Tier | None:
        """The tier a request in this state is reported at (None for LOST).

        At rest, the tier that holds it. In flight, the request holds slots in
        two tiers, and is reported at the faster of them (DEVICE before HOST
        before DISK): an offload (OFFLOADING) at DEVICE, its source, whose
        pages it still holds and whose bytes stay good until the copy
        completes; a demotion (DEMOTING) at HOST, its source, for the same
        reason; a reload (RELOADING) at DEVICE, its destination, whose pages
        were reserved when it started (its source, host or disk, is not known
        from the state alone; the move says it).
        """
        return _STATE_TIER[self]


_STATE_TIER = {
    RequestState.RESIDENT: Tier.DEVICE,
    RequestState.OFFLOADING: Tier.DEVICE,  # source
    RequestState.ON_HOST: Tier.HOST,
    RequestState.DEMOTING: Tier.HOST,  # source
    RequestState.ON_DISK: Tier.DISK,
    RequestState.RELOADING: Tier.DEVICE,  # destination
    RequestState.LOST: None,
}

#: The tiers from fastest to slowest (what ``RequestState.tier`` reports a move at).
TIER_ORDER = (Tier.DEVICE, Tier.HOST, Tier.DISK)

#: States in which a request's KV is off the device (on host or disk, or on
#: its way from host to disk).
OFFLOADED_STATES = frozenset({RequestState.ON_HOST, RequestState.DEMOTING, RequestState.ON_DISK})
#: States from which a reload may start now.
RELOADABLE_STATES = frozenset({RequestState.ON_HOST, RequestState.ON_DISK})

# The only moves a request's state may make. Anything else is a bug in the
# caller and is refused with an error naming the request and its state.
LEGAL_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.RESIDENT: frozenset({RequestState.OFFLOADING, RequestState.LOST}),
    RequestState.OFFLOADING: frozenset(
        {RequestState.ON_HOST, RequestState.ON_DISK, RequestState.RESIDENT, RequestState.LOST}
    ),
    RequestState.ON_HOST: frozenset(
        {RequestState.RELOADING, RequestState.DEMOTING, RequestState.LOST}
    ),
    RequestState.DEMOTING: frozenset(
        {RequestState.ON_DISK, RequestState.ON_HOST, RequestState.LOST}
    ),
    RequestState.ON_DISK: frozenset({RequestState.RELOADING, RequestState.LOST}),
    RequestState.RELOADING: frozenset(
        {RequestState.RESIDENT, RequestState.ON_HOST, RequestState.ON_DISK, RequestState.LOST}
    ),
    RequestState.LOST: frozenset(),
}


def check_transition(rid: str, current: RequestState, new: RequestState) -> None:
    """Raise IllegalTransition naming the request unless current -> new is legal."""
    if new not in LEGAL_TRANSITIONS[current]:
        raise IllegalTransition(
            f"request {rid!r} is {current.value}; it cannot become {new.value}"
        )


class Move(IdentityEnum):
    """One kind of transfer between tiers (the typed key moves are dispatched by)."""

    OFFLOAD_TO_HOST = "offload_host"
    OFFLOAD_TO_DISK = "offload_disk"
    DEMOTE = "demote"
    RELOAD_FROM_HOST = "reload_host"
    RELOAD_FROM_DISK = "reload_disk"

    @property
    def source(self) -> Tier:
        return _MOVE_TIERS[self][0]

    @property
    def destination(self) -> Tier:
        return _MOVE_TIERS[self][1]


_MOVE_TIERS = {
    Move.OFFLOAD_TO_HOST: (Tier.DEVICE, Tier.HOST),
    Move.OFFLOAD_TO_DISK: (Tier.DEVICE, Tier.DISK),
    Move.DEMOTE: (Tier.HOST, Tier.DISK),
    Move.RELOAD_FROM_HOST: (Tier.HOST, Tier.DEVICE),
    Move.RELOAD_FROM_DISK: (Tier.DISK, Tier.DEVICE),
}


#: ``TransferResult.reason`` of a transfer taken back before its copy started
#: (wanted again, or removed): nothing was copied and nothing failed.
CANCELLED = "cancelled before its copy started"


class TransferResult(NamedTuple):
    """What one finished transfer did, as ``poll()`` reports it.

    ``ok``: the bytes reached the destination. ``state``: the request's state
    after the completion was applied (None when the request was removed while
    its copy ran; its slots came back). ``reason``: why it failed, else None.
    """

    rid: str
    move: Move
    ok: bool
    nbytes: int
    state: RequestState | None
    reason: str | None = None
