"""The two interfaces of the tier seam: ``Tier`` (a store with its own page ledger) and
``Link`` (a one-way copy path between two tiers), and ``Copy``, what a link reports."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

from tiering.types import Tier as Role

__all__ = ["Copy", "Link", "Role", "Tier", "check_int", "check_name", "check_pages"]


def check_name(what: str, name: object) -> str:
    """``name`` if it is a non-empty str without spaces; ValueError naming ``what`` otherwise."""
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"{what} must be a non-empty str without spaces, got {name!r}")
    return name


def check_int(what: str, value: object, low: int) -> int:
    """``value`` if it is an int >= ``low``; ValueError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
    return value


def check_pages(what: str, pages: object) -> int:
    """``pages`` if it is an int >= 0; ValueError naming ``what`` and pages otherwise."""
    return check_int(f"{what}: pages", pages, 0)


class Tier(ABC):
    """A store of fixed-size pages that owns its ledger: how many pages each owner holds.

    Contract (``tiering.testing.tiers.TierContract`` checks it):

    - ``reserve(owner, n)`` takes ``n`` more pages for ``owner``: True, or False with
      nothing changed when fewer than ``n`` are free;
    - ``release(owner, n)`` gives ``n`` of them back (``None``: all it holds) and returns
      how many; asking for more than the owner holds raises and changes nothing;
    - ``used_pages`` is the sum over ``owners()``; an owner holding 0 is not listed;
    - bad input (a negative or non-int count, a ``None`` owner) raises ValueError naming
      it, with nothing changed;
    - ``check_integrity()`` raises AssertionError naming what is inconsistent.

    ``role`` is what the request lifecycle calls a request at rest here (DEVICE, HOST or
    DISK): a remote or CXL memory tier is host-like, its role is HOST.
    """

    name: str
    role: Role
    page_bytes: int
    capacity_pages: int

    @abstractmethod
    def reserve(self, owner: Hashable, pages: int) -> bool: ...

    @abstractmethod
    def release(self, owner: Hashable, pages: int | None = None) -> int: ...

    @abstractmethod
    def held(self, owner: Hashable) -> int:
        """Pages ``owner`` holds here (0 when none)."""

    @abstractmethod
    def owners(self) -> Mapping[Hashable, int]:
        """A read-only copy of owner -> pages held (every value > 0)."""

    @property
    @abstractmethod
    def used_pages(self) -> int: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    # -- derived, the same for every tier ---------------------------------------------------

    @property
    def free_pages(self) -> int:
        return self.capacity_pages - self.used_pages

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    @property
    def free_bytes(self) -> int:
        return self.free_pages * self.page_bytes

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, {self.role.value}, "
                f"{self.used_pages}/{self.capacity_pages} pages of {self.page_bytes} B)")


class Copy(NamedTuple):
    """One copy a link (or a route of links) ran or modelled: ``nbytes`` of ``owner``'s from
    tier ``src`` to tier ``dst`` (names), over ``links`` (names), ``layers`` (None: all of
    them); its bytes started moving at ``started`` (after any copy queued before it on the
    same links) and landed at ``done`` (clock seconds, ``done >= started``)."""

    links: tuple[str, ...]
    src: str
    dst: str
    owner: Hashable
    nbytes: int
    layers: tuple[int, ...] | None
    started: float
    done: float


class Link(ABC):
    """A one-way copy path from tier ``src`` to tier ``dst`` (their names).

    Contract (``tiering.testing.tiers.LinkContract`` checks it): ``copy`` moves bytes, not
    pages (the tiers' ledgers are the caller's to change, before and after); it returns a
    ``Copy`` with ``done >= now``, adds ``nbytes`` to ``bytes_copied`` and one to
    ``copies``; tiers other than its own, or a negative ``nbytes``, raise ValueError naming
    them, with nothing counted. ``layers``: the layer indices copied (None: all).
    """

    name: str
    src: str
    dst: str
    bytes_copied: int
    copies: int

    def __init__(self, src: str, dst: str, name: str | None = None) -> None:
        self.src = check_name("Link src", src)
        self.dst = check_name("Link dst", dst)
        if src == dst:
            raise ValueError(f"Link: src and dst are the same tier {src!r}")
        self.name = check_name("Link name", f"{src}->{dst}" if name is None else name)
        self.bytes_copied = 0
        self.copies = 0

    @abstractmethod
    def copy(self, src: Tier, dst: Tier, owner: Hashable, nbytes: int, *, now: float,
             layers: Sequence[int] | None = None) -> Copy: ...

    @classmethod
    def relay(cls, hops: Sequence[tuple[Link, Tier, Tier]], owner: Hashable, nbytes: int, *,
              now: float, layers: Sequence[int] | None = None) -> Copy:
        """One copy across several links in a row (``hops``: link, its source, its
        destination), as ``TierChain.copy`` runs a route: store and forward by default, each
        link starting when the one before it landed. ``cls`` is the first hop's class."""
        if not hops:
            raise ValueError("relay: no hops")
        copies = []
        t = now
        for link, a, b in hops:
            copies.append(link.copy(a, b, owner, nbytes, now=t, layers=layers))
            t = copies[-1].done
        return Copy(tuple(link.name for link, _, _ in hops), hops[0][1].name, hops[-1][2].name,
                    owner, nbytes, copies[0].layers, copies[0].started, t)

    def _checked(self, src: Tier, dst: Tier, nbytes: int,
                 layers: Sequence[int] | None) -> tuple[int, ...] | None:
        """The shared argument checks of ``copy`` (a subclass calls it first)."""
        if getattr(src, "name", None) != self.src or getattr(dst, "name", None) != self.dst:
            raise ValueError(
                f"link {self.name!r} copies {self.src!r} -> {self.dst!r}, not "
                f"{getattr(src, 'name', src)!r} -> {getattr(dst, 'name', dst)!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"link {self.name!r}: nbytes must be an int >= 0, got {nbytes!r}")
        if layers is None:
            return None
        out = tuple(layers)
        if not out or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in out):
            raise ValueError(f"link {self.name!r}: layers must be a non-empty sequence of "
                             f"ints >= 0 (or None: all), got {layers!r}")
        return out

    def _count(self, nbytes: int) -> None:
        self.bytes_copied += nbytes
        self.copies += 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}: {self.src} -> {self.dst})"
