"""``PageMover``: the mover of the backends that count pages (the replay's modelled cache and
the test fake), written once over a ``TierChain``.

It owns the request ``Lifecycle`` (whose release table gives pages back to the chain's
tiers), picks where a move goes (an offload to the first host-like tier with room, else to
a disk-like one when allowed; a demotion to the first disk-like tier with room), reserves
the destination, runs the copy over the chain's route and begins the lifecycle's move.
What stays with each backend is when a move lands (at a modelled time, or when a test
says) and its answers (``reclaimable`` and the like).

The lifecycle speaks of roles (DEVICE, HOST, DISK); a chain may hold several tiers of one
role (a remote memory tier beside the host): a ``ChainRecord`` names which one holds its
host and its disk pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tiering.core.lifecycle import Counters, Job, Lifecycle, PageRecord
from tiering.core.tiers.base import Copy, Role, Tier
from tiering.core.tiers.chain import TierChain
from tiering.types import Move, RequestState

__all__ = ["BLOCKS", "ChainRecord", "PageMover"]

#: The owner of pages that cached prefix blocks hold (a tuple: no request id is one).
BLOCKS = ("cached blocks",)

_MOVES = {
    (Role.DEVICE, Role.HOST): Move.OFFLOAD_TO_HOST,
    (Role.DEVICE, Role.DISK): Move.OFFLOAD_TO_DISK,
    (Role.HOST, Role.DISK): Move.DEMOTE,
    (Role.HOST, Role.DEVICE): Move.RELOAD_FROM_HOST,
    (Role.DISK, Role.DEVICE): Move.RELOAD_FROM_DISK,
}
_S = RequestState
#: A ``ChainRecord``'s page count and tier for each role below the device.
_HOLDINGS = {Role.HOST: ("host", "host_at"), Role.DISK: ("disk", "disk_at")}


@dataclass(eq=False, slots=True)
class ChainRecord(PageRecord):
    """A ``PageRecord`` that names the tier of the chain holding its host pages
    (``host_at``) and its disk pages (``disk_at``); None where it holds none."""

    host_at: Tier | None = None
    disk_at: Tier | None = None


class PageMover:
    """Moves of ``ChainRecord`` requests over ``chain`` (see the module docstring).

    ``lifecycle``: the backend's records and transitions (``name``, ``counters`` and
    ``clock`` are the ``Lifecycle``'s). The chain needs one device, at least one tier of
    each other role, and one ``page_bytes`` for all of its tiers.
    """

    def __init__(self, name: str, chain: TierChain, counters: Counters,
                 clock: Callable[[], float]) -> None:
        if not isinstance(chain, TierChain):
            raise ValueError(f"{name}: chain must be a TierChain, got {chain!r}")
        self.chain = chain
        self.device = chain.device
        self.hosts = chain.with_role(Role.HOST)
        self.disks = chain.with_role(Role.DISK)
        for role, tiers in ((Role.HOST, self.hosts), (Role.DISK, self.disks)):
            if not tiers:
                raise ValueError(f"{name}: the chain {chain!r} has no {role.value} tier")
        sizes = {t.page_bytes for t in chain.tiers}
        if len(sizes) != 1:
            raise ValueError(f"{name}: the chain's tiers differ in page_bytes "
                             f"({ {t.name: t.page_bytes for t in chain.tiers} })")
        self.page_bytes = sizes.pop()
        self._clock = clock
        self.life = Lifecycle(name, counters, clock, self._releasers(),
                              release_all=self._release_all)

    # -- the lifecycle's release table ------------------------------------------------------

    def _releasers(self) -> dict[Role, Callable[[ChainRecord], None]]:
        device = self.device

        def dev(r: ChainRecord) -> None:
            if r.device:
                device.release(r.rid, r.device)
                r.device = 0

        def host(r: ChainRecord) -> None:
            if r.host:
                r.host_at.release(r.rid, r.host)
                r.host = 0
            r.host_at = None

        def disk(r: ChainRecord) -> None:
            if r.disk:
                r.disk_at.release(r.rid, r.disk)
                r.disk = 0
            r.disk_at = None

        self._release = {Role.DEVICE: dev, Role.HOST: host, Role.DISK: disk}
        return self._release

    def _release_all(self, r: ChainRecord) -> None:
        for release in self._release.values():
            release(r)

    # -- placing and moving ---------------------------------------------------------------

    def place(self, r: ChainRecord, tier: Tier, pages: int) -> bool:
        """``pages`` more of ``tier`` for ``r`` (and ``r`` counts them); False (nothing
        changed) when the tier is short. The record may hold one tier of each role."""
        role = tier.role
        if role is Role.DEVICE:
            if not tier.reserve(r.rid, pages):
                return False
            r.device += pages
            return True
        count, at = _HOLDINGS[role]
        where = getattr(r, at)
        if where is not None and where is not tier:
            raise ValueError(f"request {r.rid!r} holds {role.value} pages in "
                             f"{where.name!r}, not {tier.name!r}")
        if not tier.reserve(r.rid, pages):
            return False
        setattr(r, count, getattr(r, count) + pages)
        setattr(r, at, tier)
        return True

    def at(self, r: ChainRecord) -> Tier:
        """The tier ``r`` rests in (its source, for a move that starts now)."""
        st = r.state
        if st is _S.RESIDENT:
            return self.device
        if st is _S.ON_HOST:
            return r.host_at or self.hosts[0]
        if st is _S.ON_DISK:
            return r.disk_at or self.disks[0]
        raise ValueError(f"request {r.rid!r} is {st.value}: it rests in no tier")

    def offload_to(self, pages: int, to_disk_when_host_full: bool) -> Tier | None:
        """Where an offload of ``pages`` goes: the first host-like tier with room, else (when
        allowed) the first disk-like one; None when none has room."""
        for t in self.hosts:
            if t.free_pages >= pages:
                return t
        if to_disk_when_host_full:
            for t in self.disks:
                if t.free_pages >= pages:
                    return t
        return None

    def demote_to(self, pages: int) -> Tier | None:
        """The first disk-like tier with room for ``pages``; None when none has."""
        for t in self.disks:
            if t.free_pages >= pages:
                return t
        return None

    def start(self, r: ChainRecord, dst: Tier, pages: int, nbytes: int, *,
              handle: object = None) -> Copy | None:
        """Begin moving ``r`` to ``dst``: reserve ``pages`` there, copy ``nbytes`` over the
        chain's route, begin the lifecycle's move (``handle``: the backend's job handle).
        None (nothing changed) when ``dst`` is short; ValueError for a pair that is no move
        of the lifecycle (two host-like tiers, say)."""
        src = self.at(r)
        move = _MOVES.get((src.role, dst.role))
        if move is None:
            raise ValueError(f"request {r.rid!r}: no lifecycle move from {src.name!r} "
                             f"({src.role.value}) to {dst.name!r} ({dst.role.value})")
        if not self.place(r, dst, pages):
            return None
        now = self._clock()
        copy = self.chain.copy(src, dst, r.rid, nbytes, now=now)
        self.life.begin(r, Job(move, now, handle))
        return copy

    # -- integrity --------------------------------------------------------------------------

    def problems(self, need: Callable[[ChainRecord], int]) -> list[str]:
        """What is wrong, as messages (empty: nothing): each tier's own check, the
        lifecycle's check of the records against the ledgers (summed per role, pages of
        ``BLOCKS`` as others' holdings; no role over its capacity unless one of its tiers
        may overcommit), and each tier's owners against the records' holdings."""
        problems = []
        try:
            self.chain.check_integrity()
        except AssertionError as e:
            problems.append(str(e))
        used = dict.fromkeys((Role.DEVICE, Role.HOST, Role.DISK), 0)
        cap = dict(used)
        extra = dict(used)
        for t in self.chain.tiers:
            used[t.role] += t.used_pages
            cap[t.role] += t.capacity_pages
            extra[t.role] += t.held(BLOCKS)
        for t in self.chain.tiers:
            if getattr(t, "overcommit", False):
                cap.pop(t.role, None)
        problems += self.life.check(need, used=used, capacity=cap, extra=extra)
        records = self.life.records
        for t in self.chain.tiers:
            for owner, n in t.owners().items():
                if owner == BLOCKS:
                    continue
                r = records.get(owner) if isinstance(owner, str) else None
                if r is None:
                    problems.append(f"{t.name}: {n} pages held by {owner!r}, no such request")
                    continue
                has = {Role.DEVICE: (r.device, t), Role.HOST: (r.host, r.host_at),
                       Role.DISK: (r.disk, r.disk_at)}[t.role]
                if has != (n, t):
                    problems.append(f"{t.name}: {owner!r} holds {n} pages here, its record "
                                    f"{has[0]} in {getattr(has[1], 'name', None)!r}")
        for r in records.values():
            for n, t in ((r.host, r.host_at), (r.disk, r.disk_at)):
                if n and (t is None or t.held(r.rid) != n):
                    problems.append(f"{r.rid}: record holds {n} pages in "
                                    f"{getattr(t, 'name', None)!r}, the tier disagrees")
            if r.device != self.device.held(r.rid):
                problems.append(f"{r.rid}: record holds {r.device} device pages, the tier "
                                f"{self.device.held(r.rid)}")
        return problems

