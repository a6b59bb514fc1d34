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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import NamedTuple

from policies.blocks.base import BlockInfo, BlockPolicy
from tiering.types import Tier

__all__ = ["BlockIndex", "BlockLocation", "Dropped", "PrefixMatch"]


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


class Dropped(NamedTuple):
    """A block that left the index and the slot the caller must free."""

    key: Hashable
    tier: Tier
    handle: Hashable
    reason: str


class _Entry:
    __slots__ = (
        "children",
        "depth",
        "dst_handle",
        "dst_tier",
        "first_seen",
        "handle",
        "hits",
        "key",
        "last_use",
        "parent",
        "refs",
        "tier",
    )

    def __init__(self, key, parent, depth, tier, handle, now) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth
        self.tier = tier
        self.handle = handle
        self.dst_tier = None
        self.dst_handle = None
        self.refs = 0
        self.hits = 0
        self.first_seen = now
        self.last_use = now
        self.children: set | None = None

    def info(self) -> BlockInfo:
        return BlockInfo(
            self.key,
            self.parent,
            self.depth,
            self.refs,
            self.hits,
            self.first_seen,
            self.last_use,
            len(self.children) if self.children else 0,
        )


def _check_tier(tier: object, what: str) -> Tier:
    if not isinstance(tier, Tier):
        raise ValueError(f"{what}: tier must be a Tier, got {tier!r}")
    return tier


class BlockIndex:
    """Key -> location, reference counts and chain structure of cached KV blocks."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, _Entry] = {}
        self._handles: dict[tuple[Tier, Hashable], Hashable] = {}
        self._counts: Counter[Tier] = Counter()
        self._moving = 0
        self.dropped: Counter[str] = Counter()  # blocks dropped, by reason

    # -- reading ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def count(self, tier: Tier) -> int:
        """Blocks whose current (source) location is ``tier``."""
        return self._counts[tier]

    @property
    def moving(self) -> int:
        return self._moving

    def get(self, key: Hashable) -> BlockInfo | None:
        e = self._entries.get(key)
        return None if e is None else e.info()

    def location(self, key: Hashable) -> BlockLocation | None:
        e = self._entries.get(key)
        if e is None:
            return None
        return BlockLocation(e.tier, e.handle, e.dst_tier, e.dst_handle)

    def keys(self, tier: Tier | None = None) -> Iterator[Hashable]:
        for k, e in self._entries.items():
            if tier is None or e.tier is tier:
                yield k

    def match(self, keys: Iterable[Hashable]) -> PrefixMatch:
        """The longest cached prefix of ``keys`` (root first); changes nothing.

        A block in flight is reported at its source tier, where its bytes still are.
        """
        entries = self._entries
        tiers: list[Tier] = []
        for k in keys:
            e = entries.get(k)
            if e is None:
                break
            tiers.append(e.tier)
        return PrefixMatch(len(tiers), tuple(tiers))

    def match_length(self, keys: Iterable[Hashable]) -> int:
        """``match(keys).blocks`` without building the tier list."""
        entries = self._entries
        n = 0
        for k in keys:
            if k not in entries:
                break
            n += 1
        return n

    def evictable(self, key: Hashable) -> bool:
        """Whether ``drop(key)`` would succeed: cached, unmapped, not moving, nor any descendant."""
        e = self._entries.get(key)
        if e is None or e.refs or e.dst_tier is not None:
            return False
        if not e.children:
            return True
        return all(not d.refs and d.dst_tier is None for d in self._subtree(e))

    # -- changing --------------------------------------------------------------

    def _entry(self, key: Hashable, what: str) -> _Entry:
        e = self._entries.get(key)
        if e is None:
            raise ValueError(f"{what}: block {key!r} is not in the index")
        return e

    def insert(
        self, key: Hashable, parent: Hashable | None, tier: Tier, handle: Hashable, now: float
    ) -> bool:
        """Add a block at ``(tier, handle)`` after ``parent`` (None: a chain's first block).

        False if the parent is no longer cached (the block would be unreachable).
        """
        entries = self._entries
        if key in entries:
            raise ValueError(f"insert: block {key!r} is already in the index")
        if key is None:
            raise ValueError("insert: a block key must not be None")
        _check_tier(tier, f"insert of block {key!r}")
        slot = (tier, handle)
        if slot in self._handles:
            raise ValueError(
                f"insert of block {key!r}: {tier.value} handle {handle!r} already holds block {self._handles[slot]!r}"
            )
        if parent is None:
            depth = 0
        else:
            p = entries.get(parent)
            if p is None:
                return False
            depth = p.depth + 1
            if p.children is None:
                p.children = {key}
            else:
                p.children.add(key)
        entries[key] = _Entry(key, parent, depth, tier, handle, now)
        self._handles[slot] = key
        self._counts[tier] += 1
        return True

    def touch(self, key: Hashable, now: float) -> BlockInfo:
        """Record an access of a cached block (a hit); returns its new snapshot."""
        e = self._entries.get(key)
        if e is None:
            raise ValueError(f"touch: block {key!r} is not in the index")
        e.hits += 1
        e.last_use = now
        return e.info()

    def acquire(self, key: Hashable) -> int:
        """A live request maps the block; returns its reference count.

        Refused (ValueError) for a block in flight off the device: its device
        page is freed when that copy lands. Fail or finish the move first.
        """
        e = self._entry(key, "acquire")
        if e.dst_tier is not None and e.tier is Tier.DEVICE:
            raise ValueError(
                f"acquire: block {key!r} is moving from device to {e.dst_tier.value}; it cannot be mapped now"
            )
        e.refs += 1
        return e.refs

    def release(self, key: Hashable) -> int:
        """A live request stops mapping the block; never below zero."""
        e = self._entry(key, "release")
        if e.refs <= 0:
            raise ValueError(f"release: block {key!r} is not mapped by any request")
        e.refs -= 1
        return e.refs

    def begin_move(self, key: Hashable, dst: Tier, dst_handle: Hashable) -> None:
        """Reserve ``(dst, dst_handle)`` for a copy of the block; it stays readable at its source."""
        e = self._entry(key, "begin_move")
        _check_tier(dst, f"begin_move of block {key!r}")
        if e.dst_tier is not None:
            raise ValueError(f"begin_move: block {key!r} is already moving to {e.dst_tier.value}")
        if dst is e.tier:
            raise ValueError(f"begin_move: block {key!r} is already on {dst.value}")
        if e.tier is Tier.DEVICE and not self.evictable(key):
            raise ValueError(
                f"begin_move: block {key!r} (or a block after it) is mapped by a live request or moving; it cannot leave the device"
            )
        slot = (dst, dst_handle)
        if slot in self._handles:
            raise ValueError(
                f"begin_move of block {key!r}: {dst.value} handle {dst_handle!r} already holds block {self._handles[slot]!r}"
            )
        e.dst_tier = dst
        e.dst_handle = dst_handle
        self._handles[slot] = key
        self._moving += 1

    def finish_move(self, key: Hashable) -> BlockLocation:
        """The copy landed: the block is at its destination. Returns the source to free."""
        e = self._entry(key, "finish_move")
        if e.dst_tier is None:
            raise ValueError(f"finish_move: block {key!r} is not moving")
        old = BlockLocation(e.tier, e.handle)
        del self._handles[(e.tier, e.handle)]
        self._counts[e.tier] -= 1
        e.tier, e.handle = e.dst_tier, e.dst_handle
        e.dst_tier = e.dst_handle = None
        self._counts[e.tier] += 1
        self._moving -= 1
        return old

    def fail_move(self, key: Hashable) -> BlockLocation:
        """The copy failed: the block stays where it was. Returns the destination to free."""
        e = self._entry(key, "fail_move")
        if e.dst_tier is None:
            raise ValueError(f"fail_move: block {key!r} is not moving")
        dest = BlockLocation(e.dst_tier, e.dst_handle)
        del self._handles[(e.dst_tier, e.dst_handle)]
        e.dst_tier = e.dst_handle = None
        self._moving -= 1
        return dest

    def _subtree(self, e: _Entry) -> Iterator[_Entry]:
        entries = self._entries
        stack = [e]
        while stack:
            x = stack.pop()
            yield x
            if x.children:
                stack.extend(entries[c] for c in x.children)

    def drop(self, key: Hashable, reason: str = "evicted") -> list[Dropped]:
        """Remove a block and its cached descendants; returns what each one held, deepest first.

        ``reason`` is counted in ``dropped`` (e.g. ``evicted``, ``corrupt``,
        ``read_failed``); descendants are counted as ``orphaned``.
        """
        e = self._entry(key, "drop")
        subtree = list(self._subtree(e))
        for d in subtree:
            if d.refs:
                raise ValueError(
                    f"drop of block {key!r}: block {d.key!r} is mapped by {d.refs} request(s)"
                )
            if d.dst_tier is not None:
                raise ValueError(
                    f"drop of block {key!r}: block {d.key!r} is moving to {d.dst_tier.value}"
                )
        if e.parent is not None:
            p = self._entries[e.parent]
            p.children.discard(key)
        out: list[Dropped] = []
        for d in reversed(subtree):
            del self._entries[d.key]
            del self._handles[(d.tier, d.handle)]
            self._counts[d.tier] -= 1
            out.append(Dropped(d.key, d.tier, d.handle, reason if d is e else "orphaned"))
        self.dropped[reason] += 1
        if len(subtree) > 1:
            self.dropped["orphaned"] += len(subtree) - 1
        return out

    def choose_victim(
        self, policy: BlockPolicy, now: float, tier: Tier | None = None
    ) -> Hashable | None:
        """The first key ``policy.victims`` offers that may leave (``evictable``, in ``tier``).

        None when the policy offers nothing that may leave. The policy is
        resumed once per key refused, at most ``len(policy)`` times.
        """
        gen = policy.victims(now)
        try:
            for _ in range(len(policy) + 1):
                k = next(gen, None)
                if k is None:
                    return None
                e = self._entries.get(k)
                if e is None:
                    raise RuntimeError(
                        f"policy {policy.name!r} offered block {k!r}, which is not in the index"
                    )
                if (tier is None or e.tier is tier) and self.evictable(k):
                    return k
            return None
        finally:
            gen.close()

    # -- checking --------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless every rule in the module docstring holds."""
        entries = self._entries
        handles: dict[tuple[Tier, Hashable], Hashable] = {}
        counts: Counter[Tier] = Counter()
        moving = 0
        for k, e in entries.items():
            assert e.key == k, f"block {k!r} is filed under another key {e.key!r}"
            assert e.refs >= 0, f"block {k!r} has refs {e.refs}"
            assert e.hits >= 0 and e.last_use >= e.first_seen, f"block {k!r}: bad use record"
            if e.parent is None:
                assert e.depth == 0, f"block {k!r}: a root block has depth {e.depth}"
            else:
                p = entries.get(e.parent)
                assert p is not None, f"block {k!r}: its parent {e.parent!r} is not cached"
                assert p.children and k in p.children, (
                    f"block {k!r}: missing from its parent's children"
                )
                assert e.depth == p.depth + 1, f"block {k!r}: depth {e.depth}, parent's {p.depth}"
            for c in e.children or ():
                assert c in entries and entries[c].parent == k, (
                    f"block {k!r}: child {c!r} is not its child"
                )
            slot = (e.tier, e.handle)
            assert slot not in handles, f"{slot} holds blocks {handles.get(slot)!r} and {k!r}"
            handles[slot] = k
            counts[e.tier] += 1
            if e.dst_tier is not None:
                moving += 1
                assert e.dst_tier is not e.tier, f"block {k!r} moves to its own tier"
                dslot = (e.dst_tier, e.dst_handle)
                assert dslot not in handles, (
                    f"{dslot} holds blocks {handles.get(dslot)!r} and {k!r}"
                )
                handles[dslot] = k
            else:
                assert e.dst_handle is None, f"block {k!r}: a destination handle without a move"
            if e.refs and e.dst_tier is not None:
                assert e.dst_tier is Tier.DEVICE or e.tier is not Tier.DEVICE, (
                    f"block {k!r} is mapped and leaving the device"
                )
        assert handles == self._handles, "the handle map does not equal the blocks' locations"
        assert +counts == +self._counts, f"tier counts {dict(self._counts)} != {dict(counts)}"
        assert moving == self._moving, f"moving count {self._moving} != {moving}"

    def chain_keys(self, key: Hashable) -> Sequence[Hashable]:
        """The chain from the root to ``key``, root first."""
        e = self._entry(key, "chain_keys")
        out = [key]
        while e.parent is not None:
            out.append(e.parent)
            e = self._entries[e.parent]
        out.reverse()
        return out
