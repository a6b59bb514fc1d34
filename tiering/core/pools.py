"""Page pools: the single owner of one tier's slots, free list and byte ledger.

A pool knows nothing about tensors or requests beyond an owner key per slot.
The KV cache asks it for slots and hands them back; the pool guarantees that
a slot is either free or held by exactly one owner, and that its byte ledger
always equals the slots it counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable

from tiering.core.validate import is_integral
from tiering.errors import PoolIntegrityError


class PagePool:
    """Fixed number of equally sized page slots of one tier.

    ``allocate`` hands out the lowest free slots, which keeps a request's
    pages in long adjacent runs so copies coalesce. ``allocate`` and
    ``release`` are all-or-nothing: a refused or invalid call changes nothing.
    Not thread-safe: it is driven from the owning cache's caller thread only.
    """

    def __init__(self, name: str, num_pages: int, page_bytes: int) -> None:
        if not is_integral(num_pages) or num_pages < 1:
            raise ValueError(f"{name} pool: num_pages must be an int >= 1, got {num_pages!r}")
        if not is_integral(page_bytes) or page_bytes < 1:
            raise ValueError(f"{name} pool: page_bytes must be an int >= 1, got {page_bytes!r}")
        self.name = name
        self.num_pages = int(num_pages)
        self.page_bytes = int(page_bytes)
        self._free: list[int] = list(range(self.num_pages))  # a heap
        self._owner: list[Hashable | None] = [None] * self.num_pages
        self._used_bytes = 0

    # -- reading ----------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    # -- changing ---------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        self._check_count(n, "can_allocate")
        return n <= len(self._free)

    def _check_count(self, n: object, what: str) -> None:
        if not is_integral(n) or n < 0:
            raise ValueError(f"{self.name} pool: {what} needs a page count (an int >= 0), "
                             f"got {n!r}")

    def _check_slots(self, owner: Hashable, slots: list, what: str) -> None:
        """Every slot an int in range, none repeated (ValueError naming the first bad one)."""
        for s in slots:
            if not is_integral(s) or not 0 <= s < self.num_pages:
                raise ValueError(f"{self.name} pool: {what} of {owner!r}: slot {s!r} is not "
                                 f"a slot index in [0, {self.num_pages})")
        if len(set(slots)) != len(slots):
            raise ValueError(f"{self.name} pool: {what} of {owner!r} repeats a slot")

    def allocate(self, owner: Hashable, n: int) -> list[int] | None:
        """Take ``n`` free slots for ``owner``; None (nothing changed) if short."""
        if owner is None:
            raise ValueError(f"{self.name} pool: owner must not be None")
        self._check_count(n, "allocate")
        n = int(n)
        if n > len(self._free):
            return None
        slots = [heapq.heappop(self._free) for _ in range(n)]
        for s in slots:
            self._owner[s] = owner
        self._used_bytes += n * self.page_bytes
        return slots

    def release(self, owner: Hashable, slots: Iterable[int]) -> None:
        """Give back slots held by ``owner``. Raises (changing nothing) if any
        slot is out of range, repeated, or not held by ``owner``."""
        slots = list(slots)
        self._check_slots(owner, slots, "release")
        slots = [int(s) for s in slots]
        for s in slots:
            if self._owner[s] != owner:
                raise ValueError(
                    f"{self.name} pool: slot {s} is held by {self._owner[s]!r}, not {owner!r}"
                )
        for s in slots:
            self._owner[s] = None
            heapq.heappush(self._free, s)
        self._used_bytes -= len(slots) * self.page_bytes

    def transfer_ownership(self, old: Hashable, new: Hashable, slots: Iterable[int]) -> None:
        """Re-label slots from one owner to another (e.g. to a tombstone). Raises
        (changing nothing) if ``new`` is None, or any slot is out of range, repeated
        or not held by ``old``."""
        if new is None:
            raise ValueError(f"{self.name} pool: slots of {old!r} cannot pass to owner None")
        slots = list(slots)
        self._check_slots(old, slots, "transfer_ownership")
        for s in slots:
            if self._owner[s] != old:
                raise ValueError(f"{self.name} pool: slot {s} is not held by {old!r}")
        for s in slots:
            self._owner[s] = new

    # -- checking ---------------------------------------------------------------

    def holdings(self) -> dict[Hashable, list[int]]:
        """owner -> sorted slots, rebuilt from the per-slot owner table."""
        out: dict[Hashable, list[int]] = {}
        for s, o in enumerate(self._owner):
            if o is not None:
                out.setdefault(o, []).append(s)
        return out

    def check_integrity(self, expected: dict[Hashable, Iterable[int]] | None = None) -> None:
        """Check free list, owner table and ledger agree; with ``expected``
        (owner -> slots as the caller records them), also that every held slot
        is accounted for by exactly that owner and nothing else is held."""
        problems = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("free list holds a slot twice")
        for s in range(self.num_pages):
            is_free = s in free
            if is_free == (self._owner[s] is not None):
                problems.append(f"slot {s}: free={is_free} but owner={self._owner[s]!r}")
        if self._used_bytes != (self.num_pages - len(free)) * self.page_bytes:
            problems.append(
                f"ledger {self._used_bytes} B != {self.num_pages - len(free)} used pages"
                f" * {self.page_bytes} B"
            )
        if expected is not None:
            actual = self.holdings()
            want = {o: sorted(v) for o, v in expected.items() if list(v)}
            for o in set(actual) | set(want):
                if actual.get(o, []) != want.get(o, []):
                    problems.append(
                        f"owner {o!r}: pool says {actual.get(o, [])}, records say {want.get(o, [])}"
                    )
        if problems:
            raise PoolIntegrityError(f"{self.name} pool: " + "; ".join(problems[:20]))
