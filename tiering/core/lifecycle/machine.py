"""The machine of the request lifecycle: every change of a record, and the shared answers.

See the package docstring; the tables it follows are in ``tables``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tiering.core.lifecycle.tables import (
    AT_REST,
    FAILURE_COUNTERS,
    IN_FLIGHT,
    MOVE_COUNTERS,
    TIER_INDEX,
    TIERS,
    Counters,
    Op,
    guard,
    holds,
)
from tiering.errors import BadRequestId, CacheClosed, UnknownRequest
from tiering.types import (
    CANCELLED,
    OFFLOADED_STATES,
    RELOADABLE_STATES,
    Move,
    RequestState,
    Tier,
    TransferResult,
    check_transition,
)

S = RequestState
_RELOADS = frozenset({Move.RELOAD_FROM_HOST, Move.RELOAD_FROM_DISK})
_OFFLOADS = frozenset({Move.OFFLOAD_TO_HOST, Move.OFFLOAD_TO_DISK})


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

    def register(self, rid: str, overrides: Any, make: Callable[[], Any],
                 overrides_type: type | None = None) -> bool:
        """Add ``make()`` as the record of ``rid``; True when new. Idempotent for the
        same overrides; different ones are refused with ValueError (nothing changes).
        ``overrides_type``: what ``overrides`` must be when not None (else TypeError)."""
        self.check_open("ingest_request")
        if not isinstance(rid, str) or not rid:
            raise BadRequestId(f"request id must be a non-empty str, got {rid!r}")
        if overrides_type is not None and overrides is not None \
                and not isinstance(overrides, overrides_type):
            raise TypeError(
                f"overrides for {rid!r} must be a {overrides_type.__name__} or None")
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

    def remove(self, rid: str) -> Any:
        """Give back everything ``rid`` holds (a move in flight is abandoned) and drop it."""
        r = self.get(rid, "remove_request")
        self._release_all(r)
        self.forget(rid)
        return r

    @staticmethod
    def admission(r: Any) -> tuple[bool, str]:
        """(ok, reason) of the engine's ``admit``: only a resident request's step runs."""
        if r.state is S.RESIDENT:
            return True, ""
        if r.state is S.LOST:
            return False, f"lost: {r.lost_reason}"
        return False, r.state.value

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


class LifecycleAnswers:
    """What every backend answers the same way, read off its ``Lifecycle`` (``_life``).

    A backend mixes this in (before any base class with default hooks) and
    sets ``_life``; an unknown request raises ``UnknownRequest``, a closed
    backend ``CacheClosed``."""

    _life: Lifecycle

    def _req(self, rid: str, what: str = "call") -> Any:
        return self._life.get(rid, what)

    def requests(self) -> list[str]:
        self._life.check_open("requests")
        return list(self._life.records)

    def state_of(self, rid: str) -> RequestState:
        return self._life.get(rid, "state_of").state

    def tier_of(self, rid: str) -> Tier | None:
        return self._life.get(rid, "tier_of").state.tier

    def num_tokens(self, rid: str) -> int:
        return self._life.get(rid, "num_tokens").num_tokens

    def lost_reason(self, rid: str) -> str | None:
        return self._life.get(rid, "lost_reason").lost_reason

    def is_offloaded(self, rid: str) -> bool:
        return self._life.get(rid, "is_offloaded").state in OFFLOADED_STATES

    def can_reload(self, rid: str) -> bool:
        return self._life.get(rid, "can_reload").state in RELOADABLE_STATES

    def offload_destination(self, rid: str) -> Tier | None:
        """Where an offload in flight is copying to: HOST, or DISK when the host was full."""
        r = self._life.get(rid, "offload_destination")
        return r.job.move.destination if r.state is S.OFFLOADING else r.state.tier

    def take_lost(self) -> list[tuple[str, str]]:
        """(rid, reason) of requests lost since the last call."""
        self._life.check_open("take_lost")
        return self._life.take_lost()

    def drop(self, rid: str) -> None:
        """Give up an offloaded request's KV (it will be recomputed): LOST, "dropped"."""
        self._life.drop(self._life.get(rid, "drop"))
