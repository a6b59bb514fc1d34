"""``PageTier``: a tier that is its ledger only (page counts per owner, no bytes), the store
of the replay's modelled cache and of the test fake."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from types import MappingProxyType

from tiering.core.tiers.base import Role, Tier, check_int, check_name, check_pages

__all__ = ["PageTier"]


class PageTier(Tier):
    """``capacity_pages`` pages of ``page_bytes`` each, counted per owner.

    ``overcommit=True``: ``reserve`` never refuses (a test fake that lets a caller go past
    capacity, to prove that someone else kept it under); ``used_pages`` may then exceed
    ``capacity_pages`` and ``free_pages`` go negative. ``peak_pages``: the most ever used.
    """

    __slots__ = ("name", "role", "page_bytes", "capacity_pages", "overcommit", "peak_pages",
                 "_held", "_used")

    def __init__(self, name: str, role: Role, capacity_pages: int, page_bytes: int = 1, *,
                 overcommit: bool = False) -> None:
        self.name = check_name("PageTier name", name)
        if not isinstance(role, Role):
            raise ValueError(f"PageTier {name!r}: role must be a tiering.types.Tier, got {role!r}")
        check_int(f"PageTier {name!r}: capacity_pages", capacity_pages, 0)
        check_int(f"PageTier {name!r}: page_bytes", page_bytes, 1)
        if not isinstance(overcommit, bool):
            raise ValueError(f"PageTier {name!r}: overcommit must be a bool, got {overcommit!r}")
        self.role = role
        self.capacity_pages = capacity_pages
        self.page_bytes = page_bytes
        self.overcommit = overcommit
        self.peak_pages = 0
        self._held: dict[Hashable, int] = {}
        self._used = 0

    @property
    def used_pages(self) -> int:
        return self._used

    @property
    def free_pages(self) -> int:  # the base's, without a second property call
        return self.capacity_pages - self._used

    def held(self, owner: Hashable) -> int:
        return self._held.get(owner, 0)

    def owners(self) -> Mapping[Hashable, int]:
        return MappingProxyType(dict(self._held))

    def reserve(self, owner: Hashable, pages: int) -> bool:
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
            check_pages(f"{self.name}.reserve({owner!r})", pages)
        if owner is None:
            raise ValueError(f"{self.name}.reserve: owner must not be None")
        used = self._used + pages
        if used > self.capacity_pages and not self.overcommit:
            return False
        if pages:
            held = self._held
            held[owner] = held.get(owner, 0) + pages
            self._used = used
            if used > self.peak_pages:
                self.peak_pages = used
        return True

    def release(self, owner: Hashable, pages: int | None = None) -> int:
        held = self._held
        has = held.get(owner, 0)
        if pages is None:
            pages = has
        elif isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
            check_pages(f"{self.name}.release({owner!r})", pages)
        if pages > has:
            raise ValueError(f"{self.name}.release: {owner!r} holds {has} pages, "
                             f"cannot give back {pages}")
        if pages:
            if pages == has:
                del held[owner]
            else:
                held[owner] = has - pages
            self._used -= pages
        return pages

    def check_integrity(self) -> None:
        problems = []
        total = 0
        for owner, n in self._held.items():
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                problems.append(f"owner {owner!r} holds {n!r} pages")
            else:
                total += n
        if total != self._used:
            problems.append(f"owners hold {total} pages, the ledger counts {self._used}")
        if self._used < 0 or (self._used > self.capacity_pages and not self.overcommit):
            problems.append(f"{self._used} pages used of {self.capacity_pages}")
        if self.peak_pages < self._used:
            problems.append(f"peak {self.peak_pages} below the {self._used} pages in use")
        if problems:
            raise AssertionError(f"tier {self.name!r}: " + "; ".join(problems))
