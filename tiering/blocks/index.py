"""The block index: where every content-addressed KV block is, and who maps it.

``BlockIndex`` owns key -> location (a tier and an opaque per-tier handle: a
device page, a host slot, a disk location), the count of live requests mapping
each block, the chain structure (parent, depth, cached children) and what
retention policies read (last use, hit count, first seen). It holds no tensors
and performs no I/O: the caller copies bytes and tells the index.

Rules it enforces (``check_integrity`` proves them):

- A block is in exactly one place, or in flight between two (``begin_move`` ..
  ``finish_move`` / ``fail_move``); one handle of a tier names at most one block,
  counting the destinations of moves in flight.
- A block's parent is cached: a block is only inserted after its parent, and
  dropping a block drops its cached descendants with it (a prefix match stops at
  the first miss, so they could never be read again). ``drop`` returns every
  location freed so the caller can free them.
- Reference counts never go negative; a mapped block (refs > 0) or one with a
  mapped or moving descendant is never dropped and never moves off the device.
- Bad input (a duplicate key, an unknown key, a handle already used, a release
  below zero) raises ``ValueError`` naming the block and changes nothing. A
  parent that has gone is an expected shortage: ``insert`` returns False.

Size: ``BlockIndex`` is over 400 lines because it is the one table of where
each block is, who maps it and what is held below it; the held-children counts
that make ``evictable`` O(1) must change in the same calls as the locations
(``check_integrity`` rebuilds them from scratch).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container, Hashable, Iterable, Iterator, Sequence
from itertools import repeat
from numbers import Real
from operator import itemgetter
from typing import NamedTuple

from tiering.policies.blocks.base import BlockInfo, BlockPolicy
from tiering.types import Tier

__all__ = ["BlockIndex", "BlockLocation", "Dropped", "DroppedRun", "PrefixMatch"]


class BlockLocation(NamedTuple):
    """Where a block is: its tier and handle, and the destination of a move in flight."""

    tier: Tier
    handle: Hashable
    moving_to: Tier | None = None
    dest_handle: Hashable | None = None


class PrefixMatch(NamedTuple):
    """The longest cached prefix of a chain: how many blocks, and each one's tier."""

    blocks: int
    tiers: tuple[Tier, ...]

    def count(self, tier: Tier) -> int:
        return sum(1 for t in self.tiers if t is tier)


class DroppedRun(NamedTuple):
    """The blocks one ``drop_run`` removed, deepest first, and the slots to free."""

    keys: list[Hashable]
    tiers: list[Tier]
    handles: list[Hashable]


class Dropped(NamedTuple):
    """A block that left the index and the slot the caller must free."""

    key: Hashable
    tier: Tier
    handle: Hashable
    reason: str


_NONE = object()  # "no entry", where None may be a value
_PARENT, _DEPTH, _HANDLE, _FIRST = range(4)  # the fields of a block's record in ``_node``
_parent_of, _handle_of = itemgetter(_PARENT), itemgetter(_HANDLE)
_new = tuple.__new__


def _check_tier(tier: object, what: str) -> Tier:
    if not isinstance(tier, Tier):
        raise ValueError(f"{what}: tier must be a Tier, got {tier!r}")
    return tier


def _check_now(now: object, op: str, key: Hashable) -> None:
    """``now`` must be a finite real number (not a bool): it is stored as a use time."""
    t = type(now)
    if (t is float or t is int) and now - now == 0:  # the common case; NaN and inf fail it
        return
    if isinstance(now, bool) or not isinstance(now, Real) or not math.isfinite(now):
        raise ValueError(f"{op} of block {key!r}: now must be a finite number, got {now!r}")


class BlockIndex:
    """Key -> location, reference counts and chain structure of cached KV blocks.

    Stored as a few dicts of plain values and tuples of them (no mutable object
    per block), so a million cached blocks cost the garbage collector nothing to
    walk: every cached block has its tier in ``_tier`` and one record in
    ``_node``, ``(parent, depth, handle, first use)``, replaced when it moves;
    the other tables hold only the blocks they say something about.
    """

    def __init__(self) -> None:
        self._tier: dict[Hashable, Tier] = {}
        # key -> (parent, depth, handle, first use): _PARENT, _DEPTH, _HANDLE, _FIRST
        self._node: dict[Hashable, tuple[Hashable | None, int, Hashable, float]] = {}
        self._dest: dict[Hashable, tuple[Tier, Hashable]] = {}  # moves in flight
        self._refs: dict[Hashable, int] = {}  # only blocks mapped by someone
        # only blocks touched since their insert (a block absent has 0 hits, last use = first)
        self._hits: dict[Hashable, int] = {}
        self._last: dict[Hashable, float] = {}
        # only blocks with cached children: the child itself, or a set when there are several
        self._kids: dict[Hashable, Hashable | set] = {}
        self._slots: dict[Tier, dict[Hashable, Hashable]] = {t: {} for t in Tier}  # handle -> key
        self._counts: dict[Tier, int] = {t: 0 for t in Tier}
        # busy blocks (mapped or moving) by their current (source) tier: idle_count in O(1)
        self._busy_n: dict[Tier, int] = {t: 0 for t in Tier}
        # only blocks with a busy subtree below them: how many of their children are busy
        # or have a busy block below (so ``evictable`` needs no subtree walk)
        self._below: dict[Hashable, int] = {}
        self.dropped: Counter[str] = Counter()  # blocks dropped, by reason

    # -- reading ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._tier)

    def __contains__(self, key: object) -> bool:
        return key in self._tier

    def count(self, tier: Tier) -> int:
        """Blocks whose current (source) location is ``tier``."""
        return self._counts[_check_tier(tier, "count")]

    @property
    def moving(self) -> int:
        return len(self._dest)

    def idle_count(self, tier: Tier) -> int:
        """Blocks whose location is ``tier`` that no request maps and that are not moving (O(1))."""
        _check_tier(tier, "idle_count")
        return self._counts[tier] - self._busy_n[tier]

    def get(self, key: Hashable) -> BlockInfo | None:
        node = self._node.get(key)
        if node is None:
            return None
        parent, depth, _, first = node
        kids = self._kids.get(key)
        return _new(BlockInfo, (  # BlockInfo(...) without its Python-level __new__
            key,
            parent,
            depth,
            self._refs.get(key, 0),
            self._hits.get(key, 0),
            first,
            self._last.get(key, first),
            0 if kids is None else (len(kids) if kids.__class__ is set else 1),
        ))

    def depth(self, key: Hashable) -> int:
        """The block's depth in its chain (0 for a chain's first block)."""
        node = self._node.get(key)
        if node is None:
            raise ValueError(f"depth: block {key!r} is not in the index")
        return node[1]

    def depths(self, keys: Iterable[Hashable]) -> list[int]:
        """``depth`` of each of ``keys``, in one call (ValueError naming the first unknown)."""
        node = self._node
        try:
            return [node[k][1] for k in keys]
        except KeyError as err:
            raise ValueError(f"depths: block {err.args[0]!r} is not in the index") from None

    def moving_to(self, key: Hashable) -> Tier | None:
        """The destination of the block's move in flight (None: not moving)."""
        dest = self._dest.get(key)
        return None if dest is None else dest[0]

    def location(self, key: Hashable) -> BlockLocation | None:
        tier = self._tier.get(key)
        if tier is None:
            return None
        dest = self._dest.get(key)
        if dest is None:
            return _new(BlockLocation, (tier, self._node[key][2], None, None))
        return _new(BlockLocation, (tier, self._node[key][2], dest[0], dest[1]))

    def keys(self, tier: Tier | None = None) -> Iterator[Hashable]:
        if tier is not None:
            _check_tier(tier, "keys")
        return self._keys(tier)

    def _keys(self, tier: Tier | None) -> Iterator[Hashable]:
        for k, t in self._tier.items():
            if tier is None or t is tier:
                yield k

    def match(self, keys: Iterable[Hashable]) -> PrefixMatch:
        """The longest cached prefix of ``keys`` (root first); changes nothing.

        A block in flight is reported at its source tier, where its bytes still are.
        """
        where = self._tier
        tiers: list[Tier] = []
        for k in keys:
            t = where.get(k)
            if t is None:
                break
            tiers.append(t)
        return PrefixMatch(len(tiers), tuple(tiers))

    def refs(self, key: Hashable) -> int:
        """Live requests mapping the block (0: none, or not cached)."""
        return self._refs.get(key, 0)

    def attachable_tiers(self, keys: Iterable[Hashable]) -> list[Tier]:
        """The tiers of the longest cached prefix of ``keys`` that a request may map now:
        it ends before the first block in flight and the first block off the device that
        a request maps already (its single load is that request's). Changes nothing."""
        where, dest, refs, dev = self._tier, self._dest, self._refs, Tier.DEVICE
        tiers: list[Tier] = []
        for k in keys:
            t = where.get(k)
            if t is None or k in dest or (t is not dev and k in refs):
                break
            tiers.append(t)
        return tiers

    def match_length(self, keys: Iterable[Hashable]) -> int:
        """``match(keys).blocks`` without building the tier list."""
        where = self._tier
        n = 0
        for k in keys:
            if k not in where:
                break
            n += 1
        return n

    def _busy(self, key: Hashable) -> bool:
        return key in self._refs or key in self._dest

    def evictable(self, key: Hashable) -> bool:
        """Whether ``drop(key)`` would succeed: cached, unmapped, not moving, nor any descendant.

        O(1): ``_below`` says which blocks have a busy block below them.
        """
        return key in self._tier and not (
            key in self._refs or key in self._dest or key in self._below
        )

    # A block is "held" when it or a block below it is busy (mapped or moving); ``_below``
    # counts, per block, its held children. A change of a block's busy flag walks up only
    # while it changes whether the block above is held, so mapping or releasing a chain
    # root first costs O(1) per block.

    def _now_busy(self, key: Hashable) -> None:
        """``key`` has just become busy (it was not)."""
        below, node, refs, dest = self._below, self._node, self._refs, self._dest
        if key in below:
            return  # it was held already
        p = node[key][0]
        while p is not None:
            n = below.get(p, 0)
            below[p] = n + 1
            if n or p in refs or p in dest:
                return  # p was held already
            p = node[p][0]

    def _now_idle(self, key: Hashable) -> None:
        """``key`` has just stopped being busy."""
        below, node, refs, dest = self._below, self._node, self._refs, self._dest
        if key in below:
            return  # still held by a block below it
        p = node[key][0]
        while p is not None:
            n = below[p] - 1
            if n:
                below[p] = n
                return
            del below[p]
            if p in refs or p in dest:
                return  # p is busy itself: still held
            p = node[p][0]

    # -- changing --------------------------------------------------------------

    def _check_known(self, key: Hashable, what: str) -> None:
        if key not in self._tier:
            raise ValueError(f"{what}: block {key!r} is not in the index")

    def insert(
        self, key: Hashable, parent: Hashable | None, tier: Tier, handle: Hashable, now: float
    ) -> bool:
        """Add a block at ``(tier, handle)`` after ``parent`` (None: a chain's first block).

        False if the parent is no longer cached (the block would be unreachable).
        """
        if key in self._tier:
            raise ValueError(f"insert: block {key!r} is already in the index")
        if key is None:
            raise ValueError("insert: a block key must not be None")
        if tier.__class__ is not Tier:  # the message is built only for a bad tier
            _check_tier(tier, f"insert of block {key!r}")
        _check_now(now, "insert", key)
        slots = self._slots[tier]
        if handle in slots:
            raise ValueError(
                f"insert of block {key!r}: {tier.value} handle {handle!r} already holds block {slots[handle]!r}"
            )
        if parent is None:
            depth = 0
        else:
            pn = self._node.get(parent)
            if pn is None:
                return False
            depth = pn[1] + 1
            kids = self._kids.get(parent, _NONE)
            if kids is _NONE:
                self._kids[parent] = key
            elif isinstance(kids, set):
                kids.add(key)
            else:
                self._kids[parent] = {kids, key}
        self._node[key] = (parent, depth, handle, now)
        self._tier[key] = tier
        slots[handle] = key
        self._counts[tier] += 1
        return True

    def _insert_mapped(self, key: Hashable, parent: Hashable | None, tier: Tier,
                       handle: Hashable, now: float) -> bool:
        """``insert`` and ``acquire`` of one block, for a caller that passes a Tier, a
        finite ``now`` and a handle unused on ``tier``; ``key`` is checked as ``insert``
        checks it."""
        where = self._tier
        if key in where or key is None:
            return self.insert(key, parent, tier, handle, now)  # raises, naming it
        node = self._node
        if parent is None:
            depth = 0
        else:
            pn = node.get(parent)
            if pn is None:
                return False
            depth = pn[1] + 1
            kids = self._kids
            pk = kids.get(parent)
            if pk is None:
                kids[parent] = key
            elif pk.__class__ is set:
                pk.add(key)
            else:
                kids[parent] = {pk, key}
        node[key] = (parent, depth, handle, now)
        where[key] = tier
        self._slots[tier][handle] = key
        self._counts[tier] += 1
        refs = self._refs
        refs[key] = 1
        self._busy_n[tier] += 1
        # _now_busy(key): a new block holds nothing below it
        p = parent
        if p is not None:
            below, dest = self._below, self._dest
            while True:
                n = below.get(p, 0)
                below[p] = n + 1
                if n or p in refs or p in dest:
                    break  # p was held already
                p = node[p][0]
                if p is None:
                    break
        return True

    def insert_run(self, keys: Sequence[Hashable], parent: Hashable | None, tier: Tier,
                   handles: Sequence[Hashable], now: float, acquire: bool = False) -> bool:
        """``insert`` of a run of new blocks that follow one another (``keys[0]`` after
        ``parent``, each next after the one before), at ``handles``; with ``acquire``, each
        mapped once as well. Checked as a whole first (a key cached or repeated, None, a
        handle used or repeated, a bad tier or ``now``: ValueError, nothing changed);
        False if the parent is not cached."""
        n = len(keys)
        if not n:
            return True
        where = self._tier
        if tier.__class__ is not Tier:
            _check_tier(tier, f"insert of block {keys[0]!r}")
        _check_now(now, "insert", keys[0])
        slots = self._slots[tier]
        keyset = set(keys)
        if len(keyset) != n or None in keyset or not where.keys().isdisjoint(keyset):
            for k in keys:  # the per-block error
                if k in where or k is None:
                    self.insert(k, None, tier, object(), now)
            raise ValueError(f"insert_run: the run {list(keys)[:4]!r}... repeats a block")
        if len(handles) != n or len(set(handles)) != n or not slots.keys().isdisjoint(handles):
            raise ValueError(f"insert_run of block {keys[0]!r}: {n} blocks need {n} unused, "
                             f"distinct {tier.value} handles, got {list(handles)[:4]!r}...")
        k0 = keys[0]
        node = self._node
        if parent is None:
            d0 = 0
        else:
            pn = node.get(parent)
            if pn is None:
                return False
            d0 = pn[1] + 1
            kids = self._kids
            pk = kids.get(parent)
            if pk is None:
                kids[parent] = k0
            elif pk.__class__ is set:
                pk.add(k0)
            else:
                kids[parent] = {pk, k0}
        prev = parent
        if acquire:
            refs = self._refs
            for k, h in zip(keys, handles, strict=False):  # one pass writes every table
                node[k] = (prev, d0, h, now)
                where[k] = tier
                slots[h] = k
                refs[k] = 1
                d0 += 1
                prev = k
        else:
            for k, h in zip(keys, handles, strict=False):
                node[k] = (prev, d0, h, now)
                where[k] = tier
                slots[h] = k
                d0 += 1
                prev = k
        head = keys[:-1]
        if n > 1:  # each one's only child: the next
            self._kids.update(zip(head, keys[1:], strict=False))
        self._counts[tier] += n
        if acquire:
            self._busy_n[tier] += n
            self._now_busy(k0)  # held now: the blocks above it, as acquire walks them
            if n > 1:  # each one's only child is busy
                self._below.update(zip(head, repeat(1, n - 1), strict=False))
        return True

    def touch(self, key: Hashable, now: float) -> BlockInfo:
        """Record an access of a cached block (a hit); returns its new snapshot."""
        self._check_known(key, "touch")
        _check_now(now, "touch", key)
        first = self._node[key][3]
        if now < first:
            raise ValueError(
                f"touch of block {key!r}: now {now!r} is before its first use {first!r}"
            )
        hits = self._hits
        hits[key] = hits.get(key, 0) + 1
        self._last[key] = now
        return self.get(key)

    def touch_many(self, keys: Sequence[Hashable], now: float) -> None:
        """``touch`` of each of ``keys`` (one request's hits), checked first as a whole:
        a bad ``now`` or key raises ValueError, as ``touch`` would, and changes nothing."""
        node, hits, last = self._node, self._hits, self._last
        if keys:
            _check_now(now, "touch", keys[0])
        for key in keys:
            f = node.get(key)
            if f is None:
                raise ValueError(f"touch: block {key!r} is not in the index")
            f = f[3]
            if now < f:
                raise ValueError(
                    f"touch of block {key!r}: now {now!r} is before its first use {f!r}")
        get = hits.get
        for key in keys:
            hits[key] = get(key, 0) + 1
            last[key] = now

    def acquire(self, key: Hashable) -> int:
        """A live request maps the block; returns its reference count.

        Refused (ValueError) for a block in flight off the device: its device
        page is freed when that copy lands. Fail or finish the move first.
        """
        self._check_known(key, "acquire")
        dest = self._dest.get(key)
        if dest is not None and self._tier[key] is Tier.DEVICE:
            raise ValueError(
                f"acquire: block {key!r} is moving from device to {dest[0].value}; it cannot be mapped now"
            )
        n = self._refs.get(key, 0) + 1
        self._refs[key] = n
        if n == 1 and dest is None:
            self._busy_n[self._tier[key]] += 1
            self._now_busy(key)
        return n

    def acquire_many(self, keys: Sequence[Hashable]) -> None:
        """``acquire`` of each of ``keys`` in order (one request mapping its chain). Every
        key is checked first: one ``acquire`` would refuse raises the same ValueError
        and nothing changes."""
        refs, dest, tier = self._refs, self._dest, self._tier
        dev = Tier.DEVICE
        for key in keys:
            if key not in tier:
                self._check_known(key, "acquire")
            if key in dest and tier[key] is dev:
                self.acquire(key)  # raises, naming the move
        now_busy, busy_n = self._now_busy, self._busy_n
        for key in keys:
            n = refs.get(key, 0) + 1
            refs[key] = n
            if n == 1 and key not in dest:
                busy_n[tier[key]] += 1
                now_busy(key)

    def release_many(self, keys: Sequence[Hashable]) -> None:
        """``release`` of each of ``keys`` in order. Checked first: a key released more
        often than it is mapped raises the ValueError ``release`` would, and nothing
        changes."""
        refs, dest = self._refs, self._dest
        n = len(keys)
        if n > 1 and self._release_line(keys):
            return
        need = Counter(keys) if len(set(keys)) != n else None
        for key in keys:
            if refs.get(key, 0) < (1 if need is None else need[key]):
                self._check_known(key, "release")
                raise ValueError(f"release: block {key!r} is not mapped by any request")
        now_idle, below, busy_n, where = self._now_idle, self._below, self._busy_n, self._tier
        for key in keys:
            n = refs[key]
            if n == 1:
                del refs[key]
                if key not in dest:
                    busy_n[where[key]] -= 1
                    if key not in below:  # held by a block below: no walk
                        now_idle(key)
            else:
                refs[key] = n - 1

    def _release_line(self, keys: Sequence[Hashable]) -> bool:
        """``release_many(keys)`` at once when ``keys`` are a line of blocks (each the
        parent of the next), each mapped once, none moving, and nothing else held below
        them; False (nothing changed) otherwise."""
        refs, below = self._refs, self._below
        if keys[-1] in below or (self._dest and not self._dest.keys().isdisjoint(keys)):
            return False
        n = len(keys)
        # each mapped once (so each is cached), each but the last held by its one busy
        # child only (a count of 1 above it), and each the parent of the next: checked in C
        if list(map(refs.get, keys)).count(1) != n:
            return False
        head = keys[:-1]
        if list(map(below.get, head)).count(1) != n - 1:
            return False
        if list(map(_parent_of, map(self._node.__getitem__, keys[1:]))) != list(head):
            return False
        # every block of the line is idle now and nothing below it is held
        where, busy_n = self._tier, self._busy_n
        tiers = list(map(where.__getitem__, keys))
        t0 = tiers[-1]
        same = tiers.count(t0)
        if same != n:  # blocks of the line on another tier than its last
            for t in tiers:
                if t is not t0:
                    busy_n[t] -= 1
        busy_n[t0] -= same
        list(map(refs.pop, keys))
        list(map(below.pop, head))
        self._now_idle(keys[0])  # the blocks above the line
        return True

    def release(self, key: Hashable) -> int:
        """A live request stops mapping the block; never below zero."""
        self._check_known(key, "release")
        n = self._refs.get(key, 0)
        if n <= 0:
            raise ValueError(f"release: block {key!r} is not mapped by any request")
        if n == 1:
            del self._refs[key]
            if key not in self._dest:
                self._busy_n[self._tier[key]] -= 1
                self._now_idle(key)
        else:
            self._refs[key] = n - 1
        return n - 1

    def _check_move(self, key: Hashable, dst: Tier, dst_handle: Hashable, what: str):
        """The checks of a move of ``key`` to ``(dst, dst_handle)``; its tier and the
        destination's slots when it may go."""
        self._check_known(key, what)
        if dst.__class__ is not Tier:
            _check_tier(dst, f"{what} of block {key!r}")
        if key in self._dest:
            raise ValueError(
                f"{what}: block {key!r} is already moving to {self._dest[key][0].value}"
            )
        tier = self._tier[key]
        if dst is tier:
            raise ValueError(f"{what}: block {key!r} is already on {dst.value}")
        if tier is Tier.DEVICE and not self.evictable(key):
            raise ValueError(
                f"{what}: block {key!r} (or a block after it) is mapped by a live request or moving; it cannot leave the device"
            )
        slots = self._slots[dst]
        if dst_handle in slots:
            raise ValueError(
                f"{what} of block {key!r}: {dst.value} handle {dst_handle!r} already holds block {slots[dst_handle]!r}"
            )
        return tier, slots

    def begin_move(self, key: Hashable, dst: Tier, dst_handle: Hashable) -> None:
        """Reserve ``(dst, dst_handle)`` for a copy of the block; it stays readable at its source."""
        _, slots = self._check_move(key, dst, dst_handle, "begin_move")
        self._dest[key] = (dst, dst_handle)
        slots[dst_handle] = key
        if key not in self._refs:
            self._busy_n[self._tier[key]] += 1
            self._now_busy(key)

    def finish_move(self, key: Hashable) -> BlockLocation:
        """The copy landed: the block is at its destination. Returns the source to free."""
        self._check_known(key, "finish_move")
        dest = self._dest.pop(key, None)
        if dest is None:
            raise ValueError(f"finish_move: block {key!r} is not moving")
        node = self._node[key]
        old = BlockLocation(self._tier[key], node[2])
        self._busy_n[old.tier] -= 1
        if key not in self._refs:
            self._now_idle(key)
        else:  # still mapped: busy at its new tier
            self._busy_n[dest[0]] += 1
        del self._slots[old.tier][old.handle]
        self._counts[old.tier] -= 1
        self._tier[key] = dest[0]
        self._node[key] = (node[0], node[1], dest[1], node[3])
        self._counts[dest[0]] += 1
        return old

    def move(self, key: Hashable, dst: Tier, dst_handle: Hashable) -> BlockLocation:
        """``begin_move`` and ``finish_move`` at once (the copy is already done, or is the
        caller's to make before it reads the destination): the same checks, the same
        result; returns the source to free."""
        tier, slots = self._check_move(key, dst, dst_handle, "move")
        node = self._node[key]
        old = BlockLocation(tier, node[2])
        del self._slots[tier][old.handle]
        slots[dst_handle] = key
        self._counts[tier] -= 1
        self._tier[key] = dst
        self._node[key] = (node[0], node[1], dst_handle, node[3])
        self._counts[dst] += 1
        if key in self._refs:  # a mapped block off the device: busy where it is now
            self._busy_n[tier] -= 1
            self._busy_n[dst] += 1
        return old

    def fail_move(self, key: Hashable) -> BlockLocation:
        """The copy failed: the block stays where it was. Returns the destination to free."""
        self._check_known(key, "fail_move")
        dest = self._dest.pop(key, None)
        if dest is None:
            raise ValueError(f"fail_move: block {key!r} is not moving")
        del self._slots[dest[0]][dest[1]]
        if key not in self._refs:
            self._busy_n[self._tier[key]] -= 1
            self._now_idle(key)
        return BlockLocation(dest[0], dest[1])

    def _subtree(self, key: Hashable) -> Iterator[Hashable]:
        kids = self._kids
        stack = [key]
        while stack:
            x = stack.pop()
            yield x
            c = kids.get(x, _NONE)
            if c is not _NONE:
                if isinstance(c, set):
                    stack.extend(c)
                else:
                    stack.append(c)

    def _subtree_list(self, key: Hashable) -> list[Hashable]:
        """``list(_subtree(key))``, in the same order, without a generator."""
        get = self._kids.get
        out: list[Hashable] = []
        stack = [key]
        pop, extend, append = stack.pop, stack.extend, out.append
        while stack:
            x = pop()
            while True:  # down a line of only children, as pushing and popping each would
                append(x)
                c = get(x)
                if c is None:
                    break
                if c.__class__ is set:
                    extend(c)
                    break
                x = c
        return out

    def drop(self, key: Hashable, reason: str = "evicted") -> list[Dropped]:
        """Remove a block and its cached descendants; returns what each one held, deepest first.

        ``reason`` is counted in ``dropped`` (e.g. ``evicted``, ``corrupt``,
        ``read_failed``); descendants are counted as ``orphaned``.
        """
        run = self.drop_run(key, reason)
        n = len(run.keys)
        reasons = repeat("orphaned", n - 1)
        rows = zip(run.keys, run.tiers, run.handles, reasons, strict=False)  # all but the last
        out = list(map(_new, repeat(Dropped), rows))
        out.append(_new(Dropped, (key, run.tiers[-1], run.handles[-1], reason)))
        return out

    def _unlink(self, key: Hashable) -> None:
        """``key`` is no longer among its parent's cached children."""
        kids = self._kids
        parent = self._node[key][0]
        if parent is not None:
            pk = kids[parent]
            if isinstance(pk, set):
                pk.discard(key)
                if len(pk) == 1:
                    kids[parent] = next(iter(pk))
            else:
                del kids[parent]

    def _drop_leaf(self, key: Hashable, reason: str) -> DroppedRun:
        """``drop_run`` of an evictable block with no cached children."""
        self._unlink(key)
        tier = self._tier.pop(key)
        handle = self._node.pop(key)[2]
        if key in self._hits:
            del self._hits[key], self._last[key]
        del self._slots[tier][handle]
        self._counts[tier] -= 1
        self.dropped[reason] += 1
        return _new(DroppedRun, ([key], [tier], [handle]))

    def _evict_leaf(self, key: Hashable, freed: list) -> bool:
        """``drop_run(key)`` when ``key`` is cached, evictable and has no cached children,
        its handle appended to ``freed``; False, nothing changed, otherwise."""
        if key in self._kids or key in self._refs or key in self._dest or key in self._below:
            return False
        tier = self._tier.pop(key, None)
        if tier is None:
            return False
        parent, _, handle, _ = self._node.pop(key)
        if parent is not None:  # _unlink
            kids = self._kids
            pk = kids[parent]
            if pk.__class__ is set:
                pk.discard(key)
                if len(pk) == 1:
                    kids[parent] = next(iter(pk))
            else:
                del kids[parent]
        hits = self._hits
        if key in hits:
            del hits[key], self._last[key]
        del self._slots[tier][handle]
        self._counts[tier] -= 1
        self.dropped["evicted"] += 1
        freed.append(handle)
        return True

    def drop_run(self, key: Hashable, reason: str = "evicted") -> DroppedRun:
        """``drop`` without a record per block: the keys that left, deepest first (``key``
        last), with their tiers and handles, as three lists. The same checks and counts."""
        self._check_known(key, "drop")
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"drop of block {key!r}: reason must be a non-empty str, got {reason!r}")
        kids = self._kids
        if key not in kids and self.evictable(key):  # a leaf: no subtree to walk
            return self._drop_leaf(key, reason)
        if not self.evictable(key):
            for d in self._subtree_list(key):
                if d in self._refs:
                    raise ValueError(
                        f"drop of block {key!r}: block {d!r} is mapped by {self._refs[d]} request(s)"
                    )
                if d in self._dest:
                    raise ValueError(
                        f"drop of block {key!r}: block {d!r} is moving to {self._dest[d][0].value}"
                    )
            raise RuntimeError(f"drop of block {key!r}: held, but nothing below it is busy")
        self._unlink(key)
        # nothing in the subtree is busy (evictable), so refs, moves and held counts hold
        # none of it. The walk of _subtree_list, taking each block's children on the way;
        # then every other table of the subtree emptied in C
        subtree: list[Hashable] = []
        kid_of, add = kids.pop, subtree.append
        stack = [key]
        pop, extend = stack.pop, stack.extend
        while stack:
            x = pop()
            while True:  # down a line of only children, as pushing and popping each would
                add(x)
                c = kid_of(x, None)
                if c is None:
                    break
                if c.__class__ is set:
                    extend(c)
                    break
                x = c
        subtree.reverse()
        tiers = list(map(self._tier.pop, subtree))
        handles = list(map(_handle_of, map(self._node.pop, subtree)))
        hits = self._hits
        if hits and not hits.keys().isdisjoint(subtree):
            last = self._last
            for x in subtree:
                if x in hits:
                    del hits[x], last[x]
        slots, counts = self._slots, self._counts
        t0 = tiers[-1]  # key's
        n = len(subtree)
        same = tiers.count(t0)
        counts[t0] -= same
        if same == n:
            list(map(slots[t0].pop, handles))
        else:
            for t, h in zip(tiers, handles, strict=True):
                del slots[t][h]
                if t is not t0:
                    counts[t] -= 1
        self.dropped[reason] += 1
        if n > 1:
            self.dropped["orphaned"] += n - 1
        return _new(DroppedRun, (subtree, tiers, handles))

    def choose_victim(
        self, policy: BlockPolicy, now: float, tier: Tier | None = None,
        skip: Container[Hashable] = (),
    ) -> Hashable | None:
        """The first key ``policy.victims`` offers that may leave (``evictable``, in ``tier``,
        not in ``skip``).

        None when the policy offers nothing that may leave. The policy is
        resumed once per key refused, at most ``len(policy)`` times.
        """
        if tier is not None:
            _check_tier(tier, "choose_victim")
        where, refs, dest, below = self._tier, self._refs, self._dest, self._below
        # the policy skips the keys that may not leave; they are checked again below
        gen = (policy.victims_except(now, refs, dest, below, skip) if skip else
               policy.victims_except(now, refs, dest, below))
        try:
            k = next(gen, None)  # nearly always the one taken
            n = -1  # keys still to try after the first: len(policy), counted at a refusal
            while k is not None:
                t = where.get(k)
                if t is None:
                    raise RuntimeError(
                        f"policy {policy.name!r} offered block {k!r}, which is not in the index"
                    )
                # evictable(k), inline
                if (tier is None or t is tier) and not (k in refs or k in dest or k in below
                                                        or k in skip):
                    return k
                if n < 0:
                    n = len(policy)
                if n == 0:
                    return None
                n -= 1
                k = next(gen, None)
            return None
        finally:
            gen.close()

    def count_evictable(self, policy: BlockPolicy, now: float, tier: Tier, want: int) -> int:
        """How many of the keys ``policy.victims`` offers may leave ``tier``, counted up
        to ``want`` (a caller that needs ``want`` victims asks this first, so a shortage
        is refused before anything moves). Changes nothing."""
        if isinstance(want, bool) or not isinstance(want, int) or want < 0:
            raise ValueError(f"count_evictable: want must be an int >= 0, got {want!r}")
        _check_tier(tier, "count_evictable")
        where, refs, dest, below = self._tier, self._refs, self._dest, self._below
        n = 0
        left = len(policy) + 1  # the policy offers each tracked key within len() resumptions
        gen = policy.victims_except(now, refs, dest, below)
        try:
            for k in gen:
                if n >= want or left <= 0:
                    break
                left -= 1
                if where.get(k) is tier and not (k in refs or k in dest or k in below):
                    n += 1
        finally:
            gen.close()
        return n

    # -- checking --------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless every rule in the module docstring holds."""
        keys = set(self._tier)
        node = self._node
        if set(node) != keys:
            raise AssertionError("_node does not cover exactly the cached blocks")
        for k, rec in node.items():
            if rec.__class__ is not tuple or len(rec) != 4:
                raise AssertionError(f"block {k!r}: record {rec!r} is not (parent, depth, "
                                     "handle, first use)")
        if set(self._last) != set(self._hits):
            raise AssertionError("_hits and _last do not hold the same (touched) blocks")
        for name in ("_dest", "_refs", "_kids", "_hits"):
            extra = set(getattr(self, name)) - keys
            if extra:
                raise AssertionError(
                    f"{name} holds blocks that are not cached: {sorted(map(repr, extra))[:3]}"
                )
        handles: dict[tuple[Tier, Hashable], Hashable] = {}
        counts = {t: 0 for t in Tier}
        for k in keys:
            tier = self._tier[k]
            if not isinstance(tier, Tier):
                raise AssertionError(f"block {k!r}: tier {tier!r}")
            if not (self._refs.get(k, 1) > 0):
                raise AssertionError(f"block {k!r} has refs {self._refs.get(k)}")
            parent, depth, handle, first = node[k]
            if not (self._hits.get(k, 1) > 0 and self._last.get(k, first) >= first):
                raise AssertionError(f"block {k!r}: bad use record")
            if parent is None:
                if depth != 0:
                    raise AssertionError(f"block {k!r}: a root block has depth {depth}")
            else:
                if parent not in keys:
                    raise AssertionError(f"block {k!r}: its parent {parent!r} is not cached")
                pk = self._kids.get(parent, _NONE)
                if not (pk == k or (isinstance(pk, set) and k in pk)):
                    raise AssertionError(f"block {k!r}: missing from its parent's children")
                if depth != node[parent][1] + 1:
                    raise AssertionError(
                        f"block {k!r}: depth {depth}, parent's {node[parent][1]}"
                    )
            slot = (tier, handle)
            if slot in handles:
                raise AssertionError(f"{slot} holds blocks {handles.get(slot)!r} and {k!r}")
            handles[slot] = k
            counts[tier] += 1
            dest = self._dest.get(k)
            if dest is not None:
                if dest[0] is tier:
                    raise AssertionError(f"block {k!r} moves to its own tier")
                if dest in handles:
                    raise AssertionError(f"{dest} holds blocks {handles.get(dest)!r} and {k!r}")
                handles[dest] = k
                if k in self._refs:
                    if tier is Tier.DEVICE:
                        raise AssertionError(f"block {k!r} is mapped and leaving the device")
        for p, kids in self._kids.items():
            group = kids if isinstance(kids, set) else {kids}
            if not (len(group) != 1 or not isinstance(kids, set)):
                raise AssertionError(f"block {p!r}: a one-child set")
            for c in group:
                if not (c in keys and node[c][0] == p):
                    raise AssertionError(f"block {p!r}: child {c!r} is not its child")
        held: set[Hashable] = set()  # busy blocks and every block above one
        for k in (*self._refs, *self._dest):
            x = k
            while x is not None and x not in held:
                held.add(x)
                x = node[x][0]
        below: dict[Hashable, int] = {}
        for k in held:
            p = node[k][0]
            if p is not None:
                below[p] = below.get(p, 0) + 1
        if below != self._below:
            raise AssertionError(
                "held-children counts are wrong for blocks "
            f"{sorted(map(repr, set(below.items()) ^ set(self._below.items())))[:3]}"
            )
        flat = {(t, h): k for t, slots in self._slots.items() for h, k in slots.items()}
        if handles != flat:
            raise AssertionError("the handle map does not equal the blocks' locations")
        if counts != self._counts:
            raise AssertionError(f"tier counts {self._counts} != {counts}")
        busy = {t: 0 for t in Tier}
        for k in {*self._refs, *self._dest}:
            busy[self._tier[k]] += 1
        if busy != self._busy_n:
            raise AssertionError(f"busy counts {self._busy_n} != {busy}")

    def chain_keys(self, key: Hashable) -> Sequence[Hashable]:
        """The chain from the root to ``key``, root first."""
        self._check_known(key, "chain_keys")
        node = self._node
        out = [key]
        p = node[key][0]
        while p is not None:
            out.append(p)
            p = node[p][0]
        out.reverse()
        return out
