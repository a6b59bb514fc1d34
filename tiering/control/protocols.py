"""What the tiering core expects of the things it drives, as structural protocols.

The controller lives below the ``resources`` package and must not import it,
so it sees a resource only through these duck-typed hooks: the eviction part of
the engine's ``Resource`` contract, plus a few optional extensions that a
tiered resource (our ``PagedKVCache``, or the replay simulator's model of it)
offers. A resource that lacks an optional hook simply does not take part in
what that hook is for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tiering.types import Tier, TransferResult


@runtime_checkable
class EvictableResource(Protocol):
    """The eviction hooks of the engine's Resource contract.

    - ``supports_eviction``: the resource opts in; a resource that says False is
      never asked anything else.
    - ``reclaimable(rid)``: what ``offload`` would free on the device now, in
      bytes; 0 means the request is not a candidate.
    - ``get_offload_priority(rid)``: higher means more wants it gone; asked only
      by a PRIORITY policy that names this resource.
    - ``offload(rid) -> int``: start moving the request off the device; returns
      the bytes it will free (the copy may still be in flight).
    - ``is_offloaded``, ``can_reload``, ``reload(rid) -> bool`` (False when it
      does not fit on the device yet; nothing changed).
    """

    @property
    def supports_eviction(self) -> bool: ...

    def reclaimable(self, rid: str) -> int: ...

    def get_offload_priority(self, rid: str) -> float: ...

    def offload(self, rid: str) -> int: ...

    def is_offloaded(self, rid: str) -> bool: ...

    def can_reload(self, rid: str) -> bool: ...

    def reload(self, rid: str) -> bool: ...


@runtime_checkable
class TieredResource(EvictableResource, Protocol):
    """Optional extensions a tiered resource offers the controller.

    - ``reload_bytes(rid)``: device bytes a reload of ``rid`` would take, so
      admission can reserve them up front.
    - ``tier_of(rid)``: the tier the request lives in now.
    - ``device_capacity_bytes`` / ``host_capacity_bytes``: sizes of the pools.
    - ``host_used_bytes()``: bytes of the host tier held or reserved.
    - ``demote(rid) -> bool``: start moving a request host -> disk; False when
      the disk cannot take it (full, or no disk tier); nothing changed then.
    - ``drop(rid)``: give up a request's offloaded KV (it will be recomputed);
      its state becomes LOST with reason "dropped".
    - ``poll()``: complete finished transfers; returns one ``TransferResult``
      for each transfer it completed or failed since the previous ``poll``
      (``state`` None for a request removed while its copy ran). The
      controller settles its in-flight ledger from these records alone; any
      other answer (a count, None) from an evicting resource is refused with a
      TypeError naming it. An evicting resource without ``poll`` is taken to
      offload synchronously (done when ``offload`` returns) and takes no part
      in the host -> disk cascade.
    - ``reclaimable_many(rids: Sequence[str]) -> numpy.ndarray``: optional, and
      not part of the structural check below. The answers ``reclaimable``
      would give for each of ``rids`` right now, in one call: a 1-D integer
      array (int64) aligned with ``rids``, values in [0, 2**63), 0 meaning
      "not a candidate". It must not change any state, and may raise like
      ``reclaimable`` for an unknown rid. ``rids`` is a list of requests the
      controller registered with this resource (up to all of them at once,
      each at most once). A policy whose order needs the bytes (largest,
      cost) has every idle request asked up front: one call of this hook
      instead of one ``reclaimable`` call each. A policy that orders without
      them (lru, priority) has them asked as the walk of its order goes: with
      this hook, one call per chunk of the order read (about the victims
      needed, plus a margin); without it, one ``reclaimable`` call per request
      walked, just before it would be offloaded.
    - ``get_offload_priority_many(rids: Sequence[str]) -> numpy.ndarray``:
      optional in the same way. The answers ``get_offload_priority`` would
      give for each of ``rids``, in one call: a 1-D float array aligned with
      ``rids``, every value finite. Asked, instead of one call per request,
      only of the resource a PRIORITY policy names, for every idle request
      registered with it (the policy orders by it).
    - ``offload_destination(rid) -> Tier | None``: optional. Where the bytes
      of the request's offload are going (HOST, or DISK when the host was
      full), asked right after ``offload``; while the copy is in flight
      ``tier_of`` still reports the source tier. Used only to split the
      controller's byte totals by link.
    """

    def reload_bytes(self, rid: str) -> int: ...

    def tier_of(self, rid: str) -> Tier | None: ...

    @property
    def device_capacity_bytes(self) -> int: ...

    @property
    def host_capacity_bytes(self) -> int: ...

    def host_used_bytes(self) -> int: ...

    def demote(self, rid: str) -> bool: ...

    def drop(self, rid: str) -> None: ...

    def poll(self) -> Sequence[TransferResult]: ...


class CompletionFeed:
    """A consumer's own copy of every ``TransferResult`` a resource reports.

    A resource that offers ``completion_feed()`` appends each record its
    ``poll()`` returns (``synchronize`` polls too) to every feed it handed
    out, so a controller settles from its feed whoever else polled or waited.
    ``take()`` returns what arrived since the last call. Single-threaded: the
    resource and the consumer both run on the worker's step thread.
    """

    __slots__ = ("_items", "closed")

    def __init__(self) -> None:
        self._items: list[TransferResult] = []
        self.closed = False

    def put(self, records: Sequence[TransferResult]) -> None:
        if not self.closed:
            self._items.extend(records)

    def take(self) -> list[TransferResult]:
        out, self._items = self._items, []
        return out

    def close(self) -> None:
        """Stop receiving (the resource drops a closed feed at its next report)."""
        self.closed = True
        self._items = []


@runtime_checkable
class TieredCache(EvictableResource, Protocol):
    """What ``TieredKV`` drives besides the eviction hooks; the real cache, the
    replay's modelled cache and the test fake all offer it (``step``/``ctx``:
    the engine's ``ResourceStep`` and ``StepContext``)."""

    def ingest_request(self, rid: str, overrides: object = None) -> object: ...
    def remove_request(self, rid: str) -> object: ...
    def requests(self) -> list[str]: ...
    def admit(self, step: object, ctx: object) -> object: ...
    def take_lost(self) -> list[tuple[str, str]]: ...
    def state_of(self, rid: str) -> object: ...  # a RequestState (``ready`` tells LOST apart)
    def device_used_bytes(self) -> int: ...
    def host_used_bytes(self) -> int: ...
    def disk_used_bytes(self) -> int: ...
    def check_integrity(self) -> None: ...
    def close(self) -> None: ...
