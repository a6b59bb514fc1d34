"""The block retention policy interface: what a policy is told and what it answers.

A block policy decides, for one tier of content-addressed KV blocks, which
block leaves first (``victims``) and whether a missed block is worth keeping
at all (``admit``). It keeps its own metadata (queues, ghosts, learned odds)
and never changes the block index: it is told about every event through the
``on_*`` hooks, with ``BlockInfo`` snapshots, and answers with keys.

Protocol (checked for every registered policy by
``tiering.testing.blocks.check_block_policy``):

- ``on_request(keys, now)`` first, once per request, with the whole chain of
  block keys it reads (root first), before any per-block event of that request;
- then per block: ``on_hit`` for a block the tier holds, or ``admit`` for one it
  does not, followed by ``on_insert`` if the caller inserted it;
- ``on_remove(key)`` when a block leaves the tier (evicted, dropped, moved away);
- ``victims(now)`` yields tracked keys, best victim first. Resuming the
  generator after a yield means the caller could not take that key (it is
  mapped by a live request or in flight); the caller evicts the key it stops
  at and then calls ``on_remove``. Every tracked key is yielded within
  ``len(policy)`` resumptions, so a caller can bound its search.
- ``len(policy)`` is the number of blocks it tracks (those inserted and not removed).

Batch hooks: the block store calls a policy at four points, each with one call
that covers many blocks: ``on_commit`` (a request admitted: ``on_request`` and its
hits in this tier), ``on_publish`` (a finished request's new blocks offered, with
their admission), ``pop_victim`` (one victim of an eviction burst, without a
generator) with ``on_removes`` (the blocks that left), and ``on_inserts`` (blocks
that arrived: loads and moves down). The defaults here call the per-event hooks
above in the order the per-event path does, so a policy that implements only
those behaves exactly as before; a policy may override a batch hook to do the
same work for less, and must then give exactly the same answers and state. A batch
hook given a block it cannot take (a hit or removal of one it does not track, an
insert of one it does, or one block twice) raises ValueError naming it before
anything changes (``check_batch``), where the policy answers ``in``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Hashable, Iterator, Sequence
from typing import NamedTuple

__all__ = ["BlockInfo", "BlockPolicy"]


class BlockInfo(NamedTuple):
    """What a policy may read about one block (a snapshot; changing it changes nothing)."""

    key: Hashable
    parent: Hashable | None  # None for a chain's first block
    depth: int  # 0 for a chain's first block
    refs: int  # live requests mapping it
    hits: int  # accesses after the first
    first_seen: float
    last_use: float
    children: int  # cached children


class BlockPolicy(ABC):
    """Retention order for the blocks of one tier. Subclasses implement the abstract hooks."""

    name: str = "block-policy"

    def on_request(self, keys: Sequence[Hashable], now: float) -> None:
        """The chain of keys a request reads, root first, before its per-block events."""
        return

    def admit(self, key: Hashable, depth: int, now: float) -> bool:
        """Whether a block the tier does not hold should be inserted. Default: always."""
        return True

    @abstractmethod
    def on_insert(self, info: BlockInfo, now: float) -> None:
        """``info.key`` now lives in this tier."""

    @abstractmethod
    def on_hit(self, info: BlockInfo, now: float) -> None:
        """A block this tier holds was accessed."""

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """``key`` left this tier."""

    @abstractmethod
    def victims(self, now: float) -> Iterator[Hashable]:
        """Tracked keys, best victim first (see the module's protocol)."""

    def on_insert_key(self, key: Hashable, depth: int, get: Callable[[Hashable], BlockInfo],
                      now: float) -> None:
        """``on_insert`` for a caller that has not built the block's snapshot: ``get(key)``
        builds it. The default builds it and calls ``on_insert``; a policy that reads only
        the key and depth may skip it (it must then behave exactly as ``on_insert``)."""
        self.on_insert(get(key), now)

    def victims_except(self, now: float, *busy: Container) -> Iterator[Hashable]:
        """``victims(now)`` without the keys in any of ``busy`` (containers of keys the
        caller would refuse, e.g. mapped or moving blocks), in the same order. At most
        ``len(self) + 1`` keys of ``victims`` are looked at, as a caller bounds its
        search. Subclasses may skip those keys more cheaply; the order must not change."""
        left = len(self) + 1
        for k in self.victims(now):
            if left <= 0:
                return
            left -= 1
            for c in busy:
                if k in c:
                    break
            else:
                yield k

    # -- batch hooks (see the module docstring); each default calls the per-event hooks --

    def on_commit(self, keys: Sequence[Hashable], hits: Sequence[Hashable],
                  depths: Sequence[int], get: Callable[[Hashable], BlockInfo],
                  now: float) -> None:
        """A request reading ``keys`` was admitted: ``on_request(keys, now)``, then
        ``on_hit(get(k), now)`` for each of ``hits`` (the blocks of ``keys`` this tier
        holds, in chain order, already touched; ``depths``: theirs)."""
        if _answers_in(self):
            check_batch(self, "on_hit", hits, True, repeats=True)
        self.on_request(keys, now)
        on_hit = self.on_hit
        for k in hits:
            on_hit(get(k), now)

    def on_publish(self, keys: Sequence[Hashable], depth: int, room: Callable[[], int],
                   insert: Callable[[Sequence[Hashable]], int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> tuple[int, bool]:
        """Offer ``keys``, blocks the tier lacks that follow one another in a chain
        (``keys[0]`` at ``depth``), root first. Each in turn: ``admit``, stopping if it
        refuses; ``insert([key])`` (the caller puts it in its index, making room if it
        must and may; 0: it could not, stop); ``on_insert_key``. Returns (blocks
        inserted, whether one was refused).

        ``insert(run)`` takes several blocks at once and answers how many of them, from
        the first, it inserted; ``room()``: how many blocks it can take now without
        making room. A policy whose ``admit`` of those is certain (True, changing
        nothing) may insert them in one call and then track them (``publish_room``)."""
        cls = type(self)
        if cls.admit is BlockPolicy.admit and cls.on_insert_key is BlockPolicy.on_insert_key:
            return _publish_admitted(self, keys, room, insert, get, now)
        return BlockPolicy.publish_room(self, keys, depth, _nothing_certain, insert, get, now)

    def publish_room(self, keys: Sequence[Hashable], depth: int, certain: Callable[[], int],
                     insert: Callable[[Sequence[Hashable]], int],
                     get: Callable[[Hashable], BlockInfo], now: float) -> tuple[int, bool]:
        """``on_publish`` for a policy that knows how many blocks ``admit`` would take
        with True, changing nothing (``certain()``, asked again as blocks arrive): those
        in one ``insert`` and one ``on_inserts``, each other one as
        ``BlockPolicy.on_publish`` does."""
        admit, on_insert = self.admit, self.on_insert_key
        n, total = 0, len(keys)
        while n < total:
            c = certain()
            if c > 0:
                part = keys[n:n + c]
                got = insert(part)
                if got:
                    self.on_inserts(part[:got], range(depth + n, depth + n + got), get, now)
                n += got
                if got < len(part):
                    return n, False
                continue
            k = keys[n]
            d = depth + n
            if not admit(k, d, now):
                return n, True
            if insert((k,)) != 1:
                return n, False
            on_insert(k, d, get, now)
            n += 1
        return n, False

    def pop_victim(self, now: float, *busy: Container) -> Hashable | None:
        """The first key ``victims_except(now, *busy)`` offers, or None when it offers
        none (one victim of an eviction burst). The policy still tracks it: the caller
        evicts it and then calls ``on_remove`` (or ``on_removes``)."""
        gen = self.victims_except(now, *busy)
        try:
            return next(gen, None)
        finally:
            gen.close()

    def on_removes(self, keys: Sequence[Hashable]) -> None:
        """``on_remove`` of each of ``keys``, in order."""
        if _answers_in(self):
            check_batch(self, "on_remove", keys, True)
        BlockPolicy._removes(self, keys)

    def _removes(self, keys: Sequence[Hashable]) -> None:
        """``on_removes`` of keys already checked (each tracked, none twice): what a
        policy that tracks the same blocks as one that checked them is told (the experts
        of ``AdaptiveBlocks``). A built-in's own loop; this default calls ``on_remove``."""
        on_remove = self.on_remove
        for k in keys:
            on_remove(k)

    def on_inserts(self, keys: Sequence[Hashable], depths: Sequence[int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> None:
        """``on_insert_key`` of each of ``keys`` (at ``depths``), in order: blocks that
        arrived in this tier (loaded up, or moved down)."""
        if _answers_in(self):
            check_batch(self, "on_insert", keys, False)
        insert = self.on_insert_key
        for k, d in zip(keys, depths, strict=True):
            insert(k, d, get, now)

    def overrides(self, base: type, *hooks: str) -> bool:
        """Whether this object's class replaces any of ``base``'s ``hooks`` (a built-in's
        batch hook falls back to these defaults for a subclass that changed a per-event
        hook, so the subclass's hook is still called)."""
        cls = type(self)
        return cls is not base and any(getattr(cls, h) is not getattr(base, h) for h in hooks)

    @abstractmethod
    def __len__(self) -> int:
        """How many blocks the policy tracks."""

    def __contains__(self, key: object) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def _tracked_count(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys`` the policy tracks (``check_batch``); a policy may count
        them more cheaply from its own tables."""
        return sum(map(self.__contains__, keys))


def _publish_admitted(policy: BlockPolicy, keys: Sequence[Hashable], room: Callable[[], int],
                      insert: Callable[[Sequence[Hashable]], int],
                      get: Callable[[Hashable], BlockInfo], now: float) -> tuple[int, bool]:
    """``BlockPolicy.on_publish`` for a policy whose ``admit`` and ``on_insert_key`` are the
    defaults (True, changing nothing; ``on_insert(get(key))``): the blocks there is room
    for in one ``insert``, then ``on_insert`` of each with the snapshot it had when it
    arrived (the next of them not yet its child); each other one on its own."""
    on_insert = policy.on_insert
    n, total = 0, len(keys)
    while n < total:
        c = room()
        part = keys[n:n + max(c, 1)]
        got = insert(part)
        last = got - 1
        for i in range(got):
            info = get(part[i])
            if i < last:  # its only child is the next one, inserted after its on_insert
                info = _new(BlockInfo, (*info[:7], info[7] - 1))
            on_insert(info, now)
        n += got
        if got < len(part):
            return n, False
    return n, False


_new = tuple.__new__


def _nothing_certain() -> int:
    """``publish_room``'s ``certain`` for a policy that knows nothing of its ``admit``."""
    return 0


def _answers_in(policy: BlockPolicy) -> bool:
    """Whether the policy's class answers ``key in policy`` (every built-in does)."""
    return type(policy).__contains__ is not BlockPolicy.__contains__


def check_batch(policy: BlockPolicy, event: str, keys: Sequence[Hashable], tracked: bool,
                repeats: bool = False) -> None:
    """ValueError naming the first of ``keys`` the batch hook cannot take: with
    ``tracked``, one the policy does not track (``on_hit``, ``on_remove``); else one it
    tracks (``on_insert``); and, unless ``repeats``, one that comes twice. A batch hook
    calls it before it changes anything (``_tracked_count`` counts in one pass)."""
    n = len(keys)
    if not n:
        return
    if policy._tracked_count(keys) == (n if tracked else 0) and (
            repeats or n == 1 or len(set(keys)) == n):
        return
    contains = policy.__contains__
    for k in keys:
        if contains(k) is not tracked:
            raise not_tracked(policy, event, k) if tracked else already_tracked(policy, k)
    seen: set = set()
    for k in keys:
        if k in seen:
            raise ValueError(f"{policy.name}: {event} of block {k!r} twice in one call")
        seen.add(k)


def not_tracked(policy: BlockPolicy, event: str, key: Hashable) -> ValueError:
    """The error for ``event`` (``on_hit``, ``on_remove``) of a block ``policy`` does not hold."""
    return ValueError(f"{policy.name}: {event} of block {key!r}, which the policy does not track")


def already_tracked(policy: BlockPolicy, key: Hashable) -> ValueError:
    """The error for an ``on_insert`` of a block ``policy`` already holds."""
    return ValueError(f"{policy.name}: on_insert of block {key!r}, which the policy already tracks")
