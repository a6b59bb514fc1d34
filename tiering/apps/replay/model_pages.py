"""The pages cached prefix blocks hold on a modelled tier chain, named by role.

A modelled cache (``model_kv.ModeledKVCache``) may have several tiers of one role
(a host and a remote memory beside it, two disks). Its block store asks for pages
by role (``tiering.types.Tier``): ``RolePages`` turns that into the tiers' own
ledgers (the ``BLOCKS`` owner's pages of each tier). Block pages fill a role's
tiers fastest first and leave them slowest first; a move down pairs the pieces,
each copied over its own route; a request's pages land in one tier, so whether a
request fits is asked of each tier alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tiering.core.tiers import BLOCKS, PageMover, Role, TierChain
from tiering.core.tiers import Tier as ChainTier
from tiering.types import Tier

__all__ = ["RolePages"]


def _spread(tiers: Sequence[ChainTier], n: int) -> list[tuple[ChainTier, int]]:
    """Reserve ``n`` block pages over ``tiers``, fastest first (they have room)."""
    out = []
    for t in tiers:
        k = min(n, t.free_pages)
        if k > 0:
            t.reserve(BLOCKS, k)
            out.append((t, k))
            n -= k
    return out


def _gather(tiers: Sequence[ChainTier], n: int) -> list[tuple[ChainTier, int]]:
    """Release ``n`` block pages from ``tiers``, slowest first (they hold them)."""
    out = []
    for t in reversed(tiers):
        k = min(n, t.held(BLOCKS))
        if k > 0:
            t.release(BLOCKS, k)
            out.append((t, k))
            n -= k
    return out


class RolePages:
    """Block pages on the tiers of ``chain``, by role (see the module docstring).

    It keeps no ledger of its own: each tier's is the tier's. Errors name the
    modelled cache's calls (``take_block_pages``, ...), which are these. A refused
    call changes nothing: bad input raises ValueError, a short tier answers False."""

    def __init__(self, chain: TierChain, mover: PageMover, clock: Callable[[], float]) -> None:
        self.chain = chain
        self._mover = mover
        self._clock = clock
        self.page_bytes = mover.page_bytes
        self.by_role = {Role.DEVICE: (mover.device,), Role.HOST: mover.hosts,
                        Role.DISK: mover.disks}
        # (src, dst) -> their tiers, for each move of cached blocks down the chain
        self._downs = {(r, q): (a, b) for r, a in self.by_role.items()
                       for q, b in self.by_role.items()
                       if a and b and chain.index(a[0]) < chain.index(b[0])}

    def tiers(self, role: Tier, what: str) -> tuple[ChainTier, ...]:
        """The tiers of ``role``, fastest first (``what`` names the call in an error)."""
        tiers = self.by_role.get(role) if isinstance(role, Tier) else None
        if tiers is None:
            raise ValueError(f"{what}: tier must be a tiering.types.Tier, got {role!r}")
        return tiers

    def held(self, tier: Tier) -> int:
        tiers = self.tiers(tier, "block_pages")
        if len(tiers) == 1:
            return tiers[0].held(BLOCKS)
        return sum(t.held(BLOCKS) for t in tiers)

    def free(self, tier: Tier) -> int:
        tiers = self.tiers(tier, "free_pages")
        if len(tiers) == 1:
            return tiers[0].free_pages
        return sum(t.free_pages for t in tiers)

    def request_fits(self, tier: Tier, n: int) -> bool:
        if tier is Tier.HOST:
            return self._mover.offload_to(n, False) is not None
        if tier is Tier.DISK:
            return self._mover.demote_to(n) is not None
        raise ValueError(f"request_fits: tier must be HOST or DISK, got {tier!r}")

    def take(self, tier: Tier, n: int) -> bool:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"take_block_pages: n must be an int >= 0, got {n!r}")
        tiers = self.tiers(tier, "take_block_pages")
        if len(tiers) == 1:
            return tiers[0].reserve(BLOCKS, n)
        if self.free(tier) < n:
            return False
        _spread(tiers, n)
        return True

    def give(self, tier: Tier, n: int) -> None:
        tiers = self.tiers(tier, "give_block_pages")
        held = self.held(tier)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= held:
            raise ValueError(f"give_block_pages: n must be an int in [0, {held}] "
                             f"for {tier.value}, got {n!r}")
        _gather(tiers, n)

    def move_down(self, src: Tier, dst: Tier, n: int) -> bool:
        pair = self._downs.get((src, dst)) if isinstance(src, Tier) and isinstance(dst, Tier) \
            else None
        if pair is None:
            raise ValueError(f"move_block_pages: no move from {src!r} to {dst!r}")
        a, b = pair
        chain = self.chain
        if len(a) == 1 and len(b) == 1:  # the common case, checked as below
            ta, tb = a[0], b[0]
            held = ta.held(BLOCKS)
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= held:
                raise ValueError(f"move_block_pages: n must be an int in [0, {held}] "
                                 f"for {src.value}, got {n!r}")
            if tb.free_pages < n:
                return False
            tb.reserve(BLOCKS, n)
            ta.release(BLOCKS, n)
            chain.copy(ta, tb, BLOCKS, n * self.page_bytes, now=self._clock())
            return True
        held = self.held(src)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= held:
            raise ValueError(f"move_block_pages: n must be an int in [0, {held}] "
                             f"for {src.value}, got {n!r}")
        if self.free(dst) < n:
            return False
        now = self._clock()
        froms = [list(p) for p in _gather(a, n)]
        tos = [list(p) for p in _spread(b, n)]
        while froms:  # pair the pieces (both add up to n): each copies over its own route
            k = min(froms[0][1], tos[0][1])
            chain.copy(froms[0][0], tos[0][0], BLOCKS, k * self.page_bytes, now=now)
            froms[0][1] -= k
            tos[0][1] -= k
            if not froms[0][1]:
                froms.pop(0)
            if not tos[0][1]:
                tos.pop(0)
        return True

    def source(self, role: Tier) -> ChainTier:
        """The tier of ``role`` a prefix is copied from: the one holding the most block
        pages."""
        tiers = self.by_role[role]
        return tiers[0] if len(tiers) == 1 else max(tiers, key=lambda t: t.held(BLOCKS))
