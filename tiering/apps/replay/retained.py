"""Retained prefixes: the finished prompts a worker keeps for reuse, and where they are.

``RetainedPrefixes`` is the one owner of this state. A finished request leaves
its full prompt blocks behind as an idle entry in the KV backend (same rid),
registered with the eviction controller like any idle request, so that the
controller may offload it to host and demote it to disk. This class keeps:

- the ``PrefixIndex`` (which entry holds which block chain, LRU order);
- the entries known resident on the device, with their pages, coldest first:
  the scheduler may drop these at once when it needs room (they are a cache);
- the entries on their way down a tier (from the controller's reports), and
  those that left the device, which are taken off the controller's books: it
  has nothing left to do with them (the worker demotes and expires them
  through the run's policy) and scans every request it knows under pressure.

It never decides when to make room; the simulator asks it to.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tiering.apps.replay.prefix import PrefixIndex
from tiering.types import RequestState, Tier

_TIER_RANK = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}


class RetainedPrefixes:
    """Retained prefix entries over a KV backend (see the module docstring).

    ``kv``: the backend; ``ctl``: the eviction controller, or None when there
    is none (the baselines); ``overrides``: the per-request settings an entry
    is ingested with; ``block_tokens``: prompt tokens per block id;
    ``pages``: tokens -> device pages. ``clock``: the run's time (when each
    entry was last retained or used). ``rank(rids, tier)``: the entries of one
    tier most evictable first, the order in which drops and expiries take
    them (default: least recently used first).
    """

    def __init__(
        self,
        kv: Any,
        ctl: Any,
        overrides: Any,
        block_tokens: int,
        pages: Callable[[int], int],
        clock: Callable[[], float],
        rank: Callable[[list[str], Tier], list[str]] | None = None,
    ) -> None:
        self._clock = clock
        self._rank = rank
        self._last_used: dict[str, float] = {}
        self._kv = kv
        self._ctl = ctl
        self._overrides = overrides
        self._block_tokens = block_tokens
        self._pages = pages
        self._index = PrefixIndex()
        self._resident: OrderedDict[str, int] = OrderedDict()  # rid -> device pages
        self._resident_pages = 0
        self._sinking: set[str] = set()
        self._untracked: set[str] = set()
        self.discarded = 0  # entries given up (redundant, expired or dropped for room)
        self.changes = 0  # bumped whenever an entry comes, goes, is used or leaves the books

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, rid: object) -> bool:
        return rid in self._index

    def resident(self) -> list[str]:
        """The entries resident on the device that the scheduler may drop, coldest first."""
        return list(self._resident)

    def entries(self) -> list[str]:
        """Every entry's rid, least recently used first."""
        return list(self._index.coldest_first())

    @property
    def resident_pages(self) -> int:
        """Device pages held by entries the scheduler may drop at once."""
        return self._resident_pages

    # -- reuse ------------------------------------------------------------------------

    def lookup(self, hash_ids: tuple[int, ...], n_in: int) -> tuple[int, str | None, Tier | None]:
        """(prompt tokens reusable, the entry holding them, its tier) for a new request;
        ``(0, None, None)`` on a miss. At least one prompt token is always left to compute.
        Among the newest entries holding the longest match, the best tier wins."""
        depth, holders = self._index.longest_match(hash_ids)
        if not depth:
            return 0, None, None
        tier_of = self._kv.tier_of
        best, best_tier = None, None
        for rid in holders:
            tier = tier_of(rid)
            if tier is None:
                continue
            if best_tier is None or _TIER_RANK[tier] < _TIER_RANK[best_tier]:
                best, best_tier = rid, tier
                if tier is Tier.DEVICE:
                    break
        reused = min(depth * self._block_tokens, n_in - 1)
        if best is None or reused <= 0:
            return 0, None, None
        return reused, best, best_tier

    def adoptable(self, rid: str, reused: int) -> bool:
        """Whether a request reusing ``reused`` tokens of entry ``rid`` may take over its
        pages: the entry is resident and holds no more than that."""
        kv = self._kv
        return rid in self._resident and kv.state_of(rid) is RequestState.RESIDENT and (
            kv.num_tokens(rid) <= reused
        )

    def pages_of(self, rid: str) -> int:
        return self._resident.get(rid, 0)

    def used(self, rid: str) -> None:
        """Entry ``rid`` was reused now: it becomes the warmest."""
        self.changes += 1
        self._index.touch(rid)
        self._last_used[rid] = self._clock()
        if rid in self._resident:
            self._resident.move_to_end(rid)
        if self._ctl is not None and rid not in self._untracked:
            self._ctl.touch(rid)

    # -- entries coming and going --------------------------------------------------------

    def retain(self, rid: str, hash_ids: tuple[int, ...], n_in: int) -> None:
        """Keep the full prompt blocks of finished request ``rid``, whose own KV the caller
        has just freed. Entries the new one makes redundant are discarded."""
        blocks = min(len(hash_ids), n_in // self._block_tokens)
        if not blocks:
            return
        self.changes += 1
        tokens = blocks * self._block_tokens
        kv = self._kv
        kv.ingest_request(rid, self._overrides)
        if not kv.allocate(rid, tokens):  # cannot happen: its request just freed more
            raise RuntimeError(f"retaining {rid!r}: allocate({tokens}) refused")
        if self._ctl is not None:
            self._ctl.add_request(rid)
        pages = self._pages(tokens)
        self._last_used[rid] = self._clock()
        self._resident[rid] = pages
        self._resident_pages += pages
        for old in self._index.add(rid, hash_ids[:blocks]):
            self.discard(old)

    def discard(self, rid: str, *, counted: bool = True) -> None:
        """Forget entry ``rid`` and free its KV wherever it is."""
        self.changes += 1
        self._index.remove(rid)
        self._last_used.pop(rid, None)
        self._kv.remove_request(rid)
        self._resident_pages -= self._resident.pop(rid, 0)
        self._sinking.discard(rid)
        if rid in self._untracked:
            self._untracked.discard(rid)
        elif self._ctl is not None:
            self._ctl.remove_request(rid)
        if counted:
            self.discarded += 1

    def drop_resident(self, need_pages: int, free_pages: Callable[[], int],
                      keep: str | None = None) -> bool:
        """Make ``need_pages`` device pages free by discarding resident entries (never
        ``keep``), coldest first. True if they are free; False, with nothing discarded,
        if even discarding all of them would not do."""
        free = free_pages()
        if free >= need_pages:
            return True
        if free + self._resident_pages - self._resident.get(keep, 0) < need_pages:
            return False
        for rid in self._ranked([r for r in self._resident if r != keep], Tier.DEVICE):
            self.discard(rid)
            if free_pages() >= need_pages:
                return True
        raise RuntimeError("retained prefix pages were miscounted")  # pragma: no cover

    def drop_all_resident(self) -> bool:
        """Discard every resident entry; False if there was none."""
        rids = list(self._resident)
        for rid in rids:
            self.discard(rid)
        return bool(rids)

    # -- following the controller --------------------------------------------------------

    def moved(self, offloaded: tuple[str, ...], demoted: tuple[str, ...]) -> None:
        """The controller started these moves (rids of other requests are ignored)."""
        index = self._index
        for rid in offloaded:
            if rid in index:
                self._resident_pages -= self._resident.pop(rid, 0)
                self._sinking.add(rid)
        self._sinking.update(rid for rid in demoted if rid in index)

    def settle(self) -> None:
        """Entries that left the device leave the controller's books: it has nothing more
        to do with them (the worker demotes and expires them), and each request it knows
        costs it work in every scan under pressure."""
        if not self._sinking:
            return
        state_of = self._kv.state_of
        untracked = self._untracked
        for rid in list(self._sinking):
            state = state_of(rid)
            if state is not RequestState.ON_DISK and state is not RequestState.ON_HOST:
                continue  # still in flight
            if rid not in untracked:
                self._ctl.remove_request(rid)
                untracked.add(rid)
                self.changes += 1
            self._sinking.discard(rid)

    def expire(self, host_high: float, host_low: float) -> None:
        """Discard the coldest entries of a lower tier that is over ``host_high`` of its
        capacity and cannot pass them further down, until it is under ``host_low``: the
        disk, or the host when there is no disk or the disk is over ``host_high`` too."""
        if not self._index:
            return
        kv = self._kv
        disk_cap = getattr(kv, "disk_capacity_bytes", 0)
        disk_full = disk_cap > 0 and kv.disk_used_bytes() > host_high * disk_cap
        if disk_full:
            self._expire_from(RequestState.ON_DISK, kv.disk_used_bytes, host_low * disk_cap)
            disk_full = kv.disk_used_bytes() > host_high * disk_cap
        host_cap = kv.host_capacity_bytes
        if host_cap and (disk_cap == 0 or disk_full) and (
            kv.host_used_bytes() > host_high * host_cap
        ):
            self._expire_from(RequestState.ON_HOST, kv.host_used_bytes, host_low * host_cap)

    def _expire_from(self, settled: RequestState, used: Callable[[], int],
                     target: float) -> None:
        state_of = self._kv.state_of
        rids = [rid for rid in self._index.coldest_first() if state_of(rid) is settled]
        for rid in self._ranked(rids, settled.tier):
            if used() <= target:
                return
            self.discard(rid)

    def last_used(self, rid: str) -> float:
        """When entry ``rid`` was retained or last reused (the run's clock)."""
        return self._last_used[rid]

    def _ranked(self, rids: list[str], tier: Tier) -> list[str]:
        """``rids`` (coldest first) in the order the run's policy evicts them."""
        if self._rank is None or len(rids) < 2:
            return rids
        return self._rank(rids, tier)
