"""Links that model time instead of moving bytes: ``ModelledLink`` (bandwidth and latency,
the replay's) and ``InstantLink`` (lands at once, for tests)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from tiering.core.tiers.base import Copy, Link, Tier

__all__ = ["InstantLink", "ModelledLink"]


def _rate(what: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"{what} must be a number > 0 (or inf), got {v!r}")
    return v


def _latency(what: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
            math.isfinite(v) and v >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {v!r}")
    return v


class ModelledLink(Link):
    """A FIFO link of ``bandwidth`` bytes a second (``math.inf``: no transfer time) and a
    fixed ``latency_s`` a copy: a copy starts when the one before it landed (``free_at``)
    and lands ``latency_s + nbytes / bandwidth`` later.

    A route of modelled links (``relay``) is cut through: the copy starts when every link
    is free, runs at the slowest one's bandwidth plus every link's latency, and holds every
    link until it lands."""

    def __init__(self, src: str, dst: str, bandwidth: float, latency_s: float = 0.0, *,
                 name: str | None = None) -> None:
        super().__init__(src, dst, name)
        self.bandwidth = _rate(f"link {self.name!r} bandwidth", bandwidth)
        self.latency_s = _latency(f"link {self.name!r} latency_s", latency_s)
        self.free_at = -math.inf

    def copy(self, src: Tier, dst: Tier, owner: Hashable, nbytes: int, *, now: float,
             layers: Sequence[int] | None = None) -> Copy:
        layers = self._checked(src, dst, nbytes, layers)
        start = now if self.free_at <= now else self.free_at
        done = start + self.latency_s + nbytes / self.bandwidth
        self.free_at = done
        self._count(nbytes)
        return Copy((self.name,), src.name, dst.name, owner, nbytes, layers, start, done)

    @classmethod
    def relay(cls, hops: Sequence[tuple[Link, Tier, Tier]], owner: Hashable, nbytes: int, *,
              now: float, layers: Sequence[int] | None = None) -> Copy:
        if not all(isinstance(link, ModelledLink) for link, _, _ in hops):
            return super().relay(hops, owner, nbytes, now=now, layers=layers)
        checked = [link._checked(a, b, nbytes, layers) for link, a, b in hops]
        start = now
        for link, _, _ in hops:
            if link.free_at > start:
                start = link.free_at
        latency = sum(link.latency_s for link, _, _ in hops)
        rate = min(link.bandwidth for link, _, _ in hops)
        done = start + latency + nbytes / rate
        for link, _, _ in hops:
            link.free_at = done
            link._count(nbytes)
        return Copy(tuple(link.name for link, _, _ in hops), hops[0][1].name, hops[-1][2].name,
                    owner, nbytes, checked[0], start, done)

    def __repr__(self) -> str:
        return (f"ModelledLink({self.name!r}: {self.src} -> {self.dst}, "
                f"{self.bandwidth:g} B/s, {self.latency_s:g} s)")


class InstantLink(Link):
    """A link whose every copy lands the moment it is issued (``done == now``)."""

    def copy(self, src: Tier, dst: Tier, owner: Hashable, nbytes: int, *, now: float,
             layers: Sequence[int] | None = None) -> Copy:
        layers = self._checked(src, dst, nbytes, layers)
        self._count(nbytes)
        return Copy((self.name,), src.name, dst.name, owner, nbytes, layers, now, now)
