"""``TierChain``: the tiers, fastest first, and the links between them; a move is a
(source, destination) pair of the chain, copied over its route."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from itertools import pairwise

from tiering.core.tiers.base import Copy, Link, Role, Tier

__all__ = ["TierChain"]

_ROLE_ORDER = {Role.DEVICE: 0, Role.HOST: 1, Role.DISK: 2}

Hop = tuple[Link, Tier, Tier]


class TierChain:
    """Ordered tiers (``tiers[0]`` the device) and the links that join them.

    A valid chain: at least one tier, unique tier and link names, exactly one DEVICE tier
    and it comes first, then the HOST-role tiers, then the DISK-role ones; each link joins
    two of its tiers, at most one link a direction between two tiers, and every tier can
    be reached from the device and reach it back (a chain that is not connected is
    refused, naming a pair with no route). The route from one tier to another is the
    fewest links that join them (the direct link when there is one; ties go to the links
    given first).
    """

    def __init__(self, tiers: Sequence[Tier], links: Sequence[Link]) -> None:
        tiers = tuple(tiers)
        links = tuple(links)
        if not tiers:
            raise ValueError("TierChain: no tiers")
        for t in tiers:
            if not isinstance(t, Tier):
                raise ValueError(f"TierChain: {t!r} is not a Tier")
        for lk in links:
            if not isinstance(lk, Link):
                raise ValueError(f"TierChain: {lk!r} is not a Link")
        names = [t.name for t in tiers]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"TierChain: two tiers are named {dup!r}")
        if tiers[0].role is not Role.DEVICE:
            raise ValueError(f"TierChain: the first tier must have role DEVICE, "
                             f"{tiers[0].name!r} is {tiers[0].role.value}")
        for a, b in pairwise(tiers):
            if _ROLE_ORDER[b.role] < _ROLE_ORDER[a.role] or b.role is Role.DEVICE:
                raise ValueError(f"TierChain: tier {b.name!r} ({b.role.value}) cannot come "
                                 f"after {a.name!r} ({a.role.value}): one device first, then "
                                 f"host-like tiers, then disk-like ones")
        self._by_name = {t.name: t for t in tiers}
        link_names = [lk.name for lk in links]
        dup = next((n for n in link_names if link_names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"TierChain: two links are named {dup!r}")
        direct: dict[tuple[str, str], Link] = {}
        for lk in links:
            for end in (lk.src, lk.dst):
                if end not in self._by_name:
                    raise ValueError(f"TierChain: link {lk.name!r} names tier {end!r}, which "
                                     f"is not in the chain {names}")
            if (lk.src, lk.dst) in direct:
                raise ValueError(f"TierChain: links {direct[lk.src, lk.dst].name!r} and "
                                 f"{lk.name!r} both copy {lk.src} -> {lk.dst}")
            direct[lk.src, lk.dst] = lk
        self.tiers: tuple[Tier, ...] = tiers
        self.links: tuple[Link, ...] = links
        self._index = {t.name: i for i, t in enumerate(tiers)}
        self._direct = direct
        self._routes: dict[tuple[str, str], tuple[Hop, ...]] = {}
        for a in tiers:
            for b, hops in self._paths_from(a).items():
                self._routes[a.name, b] = hops
        for t in tiers[1:]:
            for pair in ((tiers[0].name, t.name), (t.name, tiers[0].name)):
                if pair not in self._routes:
                    raise ValueError(f"TierChain is not connected: no route "
                                     f"{pair[0]} -> {pair[1]} over the links {link_names}")

    def _paths_from(self, a: Tier) -> dict[str, tuple[Hop, ...]]:
        """The fewest-links route from ``a`` to every tier it reaches (breadth first)."""
        out: dict[str, tuple[Hop, ...]] = {a.name: ()}
        frontier = [a]
        while frontier:
            nxt = []
            for x in frontier:
                for lk in self.links:
                    if lk.src == x.name and lk.dst not in out:
                        y = self._by_name[lk.dst]
                        out[y.name] = (*out[x.name], (lk, x, y))
                        nxt.append(y)
            frontier = nxt
        del out[a.name]
        return out

    # -- lookups ----------------------------------------------------------------------------

    def tier(self, tier: str | Tier) -> Tier:
        """The chain's tier of that name (or that object); KeyError naming it otherwise."""
        name = tier.name if isinstance(tier, Tier) else tier
        t = self._by_name.get(name) if isinstance(name, str) else None
        if t is None or (isinstance(tier, Tier) and t is not tier):
            raise KeyError(f"tier {tier!r} is not in the chain {list(self._by_name)}")
        return t

    __getitem__ = tier

    def __contains__(self, tier: object) -> bool:
        try:
            self.tier(tier)  # type: ignore[arg-type]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def index(self, tier: str | Tier) -> int:
        return self._index[self.tier(tier).name]

    @property
    def device(self) -> Tier:
        return self.tiers[0]

    def below(self, tier: str | Tier) -> tuple[Tier, ...]:
        """The tiers slower than ``tier``, nearest first."""
        return self.tiers[self.index(tier) + 1:]

    def above(self, tier: str | Tier) -> tuple[Tier, ...]:
        """The tiers faster than ``tier``, nearest first."""
        return self.tiers[:self.index(tier)][::-1]

    def with_role(self, role: Role) -> tuple[Tier, ...]:
        """The tiers of ``role``, in chain order (empty: none)."""
        if not isinstance(role, Role):
            raise ValueError(f"with_role: role must be a tiering.types.Tier, got {role!r}")
        return tuple(t for t in self.tiers if t.role is role)

    def link(self, src: str | Tier, dst: str | Tier) -> Link:
        """The direct link ``src -> dst``; KeyError naming the pair when there is none."""
        a, b = self.tier(src).name, self.tier(dst).name
        try:
            return self._direct[a, b]
        except KeyError:
            raise KeyError(f"no direct link {a} -> {b} (route: "
                           f"{[h[0].name for h in self.route(a, b)]})") from None

    def route(self, src: str | Tier, dst: str | Tier) -> tuple[Hop, ...]:
        """The hops (link, from tier, to tier) a copy ``src -> dst`` crosses, in order."""
        a, b = self.tier(src).name, self.tier(dst).name
        if a == b:
            raise ValueError(f"route: {a!r} to itself is not a move")
        return self._routes[a, b]  # every pair has one: each tier reaches the device and back

    def moves(self) -> tuple[tuple[Tier, Tier], ...]:
        """Every (source, destination) pair of the chain."""
        return tuple((h[0][1], h[-1][2]) for h in self._routes.values())

    # -- copies and the ledgers ------------------------------------------------------------

    def copy(self, src: str | Tier, dst: str | Tier, owner: Hashable, nbytes: int, *,
             now: float, layers: Sequence[int] | None = None) -> Copy:
        """Copy ``nbytes`` of ``owner`` over the route ``src -> dst`` (its first link's
        ``relay`` runs a route of several)."""
        hops = self.route(src, dst)
        if len(hops) == 1:
            link, a, b = hops[0]
            return link.copy(a, b, owner, nbytes, now=now, layers=layers)
        return type(hops[0][0]).relay(hops, owner, nbytes, now=now, layers=layers)

    def used_pages(self) -> list[int]:
        return [t.used_pages for t in self.tiers]

    def capacity_pages(self) -> list[int]:
        return [t.capacity_pages for t in self.tiers]

    def check_integrity(self) -> None:
        """Every tier's ``check_integrity``; AssertionError naming each failing tier."""
        problems = []
        for t in self.tiers:
            try:
                t.check_integrity()
            except AssertionError as e:
                problems.append(str(e))
        if problems:
            raise AssertionError("; ".join(problems))

    def __repr__(self) -> str:
        return "TierChain(" + " | ".join(f"{t.name}:{t.role.value}" for t in self.tiers) + ")"
