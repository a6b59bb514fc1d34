"""Cached prefix blocks in every tier: the replay's prefix reuse on ``tiering.blocks.BlockIndex``.

A Mooncake trace names a prompt's 512-token blocks by ``hash_ids`` (equal ids,
equal prefix). ``PrefixBlocks`` keeps those blocks the way ``PagedKVCache``'s block
store does: one ``BlockIndex`` (the keys are the ids, the tiers device, host and
disk), per tier a block retention policy made by
``tiering.policies.blocks.make_block_policy`` with the tier's capacity in blocks,
and every policy call made by the cache's own rules (``tiering.resources.kv_prefix_rules
.BlockRules``: what is attached, who is told what, what is admitted, which block
leaves first and where it goes). The same index, policies and rules run in
production; ``tests/test_replay_fidelity.py`` drives both with one request sequence.

The life of a block:

- **Lookup** (``peek``, ``lend``, ``commit``, when a request is admitted): the
  longest attachable prefix of its full prompt blocks is reused (``BlockRules
  .attachable``: never its last token, never a block moving or loaded by another
  request); every tier's policy is told the request and its hits once
  (``BlockRules.tell``) and matched host and disk blocks move up to the device
  (``begin_move``; ``loaded`` finishes the moves when the copy lands).
- **Publish** (``publish``, when the request finishes): its prompt blocks past
  those the device already holds are offered to the device policy root first
  (``BlockRules.offer``) and kept while it admits them and the device has room;
  a block held on another tier stops the publish, as in the cache.
- **Device pages.** A block mapped by a live request is part of that
  request's KV (its pages are in the request's allocation); an unmapped
  device block holds its own pages (``take_block_pages`` of the KV backend),
  so the device's pressure sees it. Blocks on host and disk always hold
  their pages there.
- **Release** (the request finished, or its KV was freed to be recomputed):
  its blocks are unmapped.
- **Down the tiers** (``make_room`` when an allocation needs pages, and at the
  simulator's safe points ``shed_device``, ``relieve_lower``): the tier's policy
  picks the victim; it moves one tier down (device -> host -> disk) if that tier's
  policy admits it and room can be made there the same way, else it is dropped with
  its cached descendants. Moves down change the books at once; their copies occupy
  the links (``move_block_pages``).

``check_integrity`` checks the index, that every policy tracks exactly its
tier's blocks, and that the pages held match the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from tiering.apps.replay.block_guard import Guarded, PolicyMeter, is_builtin
from tiering.blocks.index import BlockIndex, Dropped
from tiering.policies.blocks import BlockPolicyRegistry, make_block_policy
from tiering.resources.kv_prefix_rules import BELOW, TIERS, BlockRules
from tiering.types import Tier

__all__ = ["BlockCounters", "PrefixBlocks", "PrefixPeek"]


class PrefixPeek(NamedTuple):
    """What a lookup found (nothing changed yet): the request's full prompt block keys,
    how many lead the cache (attachable), each one's tier, the prompt tokens they save,
    and the device pages the store would hand over to the request (matched unmapped
    device blocks)."""

    keys: tuple[Hashable, ...]
    blocks: int
    tiers: tuple[Tier, ...]
    reused: int
    lent_pages: int


class _TierState:
    """One tier of the store, as the eviction path reads it."""

    __slots__ = ("below", "held", "tier")

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.held = 0  # blocks holding their own pages in this tier
        self.below: _TierState | None = None  # where its victims go (a tier with room at all)


class BlockCounters(NamedTuple):
    moved_host: int  # device -> host
    moved_disk: int  # host -> disk
    loaded: int  # host or disk -> device (reused)
    dropped: int  # blocks dropped, descendants included
    refused: int  # publishes a device policy stopped by not admitting a block


class PrefixBlocks:
    """The block store of one run (see the module docstring).

    ``kv``: the KV backend (``pages_for``, ``page_bytes``, tier capacities and
    ``take_block_pages`` / ``give_block_pages`` / ``move_block_pages`` /
    ``free_pages``); ``policy``: a block policy name of ``registry`` (default:
    the built-ins), with ``options`` passed to each tier's factory;
    ``block_tokens``: prompt tokens per block id; ``clock``: the run's time.
    ``batch``: call the policies' batch hooks (False: the per-event hooks one by one,
    as a check that both give the same run); ``events``: keep ``events`` for the
    decision log; ``meter``: count and time every policy call (a user's policy is
    always metered, with a meter of its own when none is given; ``meter`` holds it).
    ``admission``: ask the policies' ``admit`` (``BlockRules``; False only to measure
    what admission changes).
    """

    def __init__(self, kv: Any, policy: str, block_tokens: int, clock: Callable[[], float],
                 registry: BlockPolicyRegistry | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, batch: bool = True,
                 events: bool = True, meter: PolicyMeter | None = None,
                 admission: bool = True) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or (
            block_tokens < 1
        ):
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        self._kv = kv
        self._clock = clock
        self.block_tokens = block_tokens
        self.block_pages = int(kv.pages_for(block_tokens))
        self.block_bytes = self.block_pages * int(kv.page_bytes)
        caps = {Tier.DEVICE: int(kv.device_capacity_bytes), Tier.HOST: int(kv.host_capacity_bytes),
                Tier.DISK: int(getattr(kv, "disk_capacity_bytes", 0))}
        self.capacity_blocks = {t: caps[t] // self.block_bytes for t in TIERS}
        made = {
            t: make_block_policy(policy, registry, capacity=max(1, self.capacity_blocks[t]),
                                 **dict(options))
            for t in TIERS
        }
        # a user's policy is checked at every call (block_guard) and its calls metered; the
        # built-ins are neither, unless a meter is given
        if meter is None and not all(is_builtin(p) for p in made.values()):
            meter = PolicyMeter(policy)
        self.meter = meter
        self.policies = {
            t: p if is_builtin(p) and meter is None
            else Guarded(p, t.value, clock, meter, not is_builtin(p))
            for t, p in made.items()}
        self.batch = bool(batch)
        self.policy_name = policy
        self.index = BlockIndex()
        # the cache's rules: every policy call of the store goes through them
        self.rules = BlockRules(self.index, self.policies,
                                plain=all(is_builtin(p) for p in self.policies.values()),
                                admission=admission, batch=self.batch)
        # per tier: the blocks holding their own pages there and where its victims go
        # (what the eviction path reads, without a dict by Tier)
        self._st = {t: _TierState(t) for t in TIERS}
        for t in TIERS:
            b = BELOW[t]
            if b is not None and self.capacity_blocks[b]:
                self._st[t].below = self._st[b]
        self._handle = 0
        self.changes = 0  # bumped whenever a block comes, goes, moves or is (un)mapped
        self._moved_host = self._moved_disk = self._loaded = self._dropped = self._refused = 0
        # (kind, key) of moves down and drops, when ``events`` (the decision log's) is on
        self.record_events = bool(events)
        self.events: list[tuple[str, Hashable]] = []

    # -- reading ---------------------------------------------------------------------

    @property
    def shared_history(self) -> bool:
        """Whether the tiers' policies keep one request history between them."""
        return self.rules.shared_history

    @property
    def counters(self) -> BlockCounters:
        return BlockCounters(self._moved_host, self._moved_disk, self._loaded, self._dropped,
                             self._refused)

    @property
    def device_pages(self) -> int:
        """Device pages held by unmapped cached blocks (what dropping all of them frees
        at most)."""
        return self._st[Tier.DEVICE].held * self.block_pages

    def __len__(self) -> int:
        return len(self.index)

    def count(self, tier: Tier) -> int:
        return self.index.count(tier)

    def keys_of(self, hash_ids: Sequence[Hashable], n_in: int) -> tuple[Hashable, ...]:
        """The keys of a prompt's full blocks."""
        return tuple(hash_ids[: n_in // self.block_tokens])

    def peek(self, hash_ids: Sequence[Hashable], n_in: int) -> PrefixPeek:
        """The blocks an attach of this prompt would map (``BlockRules.attachable``: at
        least one prompt token is always left to compute); changes nothing."""
        keys = self.keys_of(hash_ids, n_in)
        tiers = tuple(self.rules.attachable(keys, n_in, self.block_tokens))
        d = len(tiers)
        if not d:
            return PrefixPeek(keys, 0, (), 0, 0)
        get = self.index.get
        lent = sum(1 for k, t in zip(keys, tiers, strict=False) if t is Tier.DEVICE and not get(k).refs)
        return PrefixPeek(keys, d, tiers, d * self.block_tokens, lent * self.block_pages)

    def lends(self, hash_ids: Sequence[Hashable], n_in: int) -> bool:
        """Whether ``peek(hash_ids, n_in)`` finds blocks to reuse (``lend`` would map
        some); changes nothing."""
        if (n_in - 1) // self.block_tokens < 1:
            return False
        index = self.index
        k = hash_ids[0]
        loc = index.location(k)
        if loc is None or loc.moving_to is not None:
            return False
        return loc.tier is Tier.DEVICE or not index.get(k).refs

    # -- a request's blocks ----------------------------------------------------------

    def lend(self, peek: PrefixPeek) -> list[Hashable]:
        """Map the matched blocks (they can no longer be evicted); the pages of matched
        unmapped device blocks pass to the caller's allocation. Returns the keys mapped;
        ``unlend`` undoes it exactly."""
        index = self.index
        mapped = []
        for k, t in zip(peek.keys, peek.tiers, strict=False):
            if index.acquire(k) == 1 and t is Tier.DEVICE:
                self._unreserve(Tier.DEVICE)
            mapped.append(k)
        self.changes += 1
        return mapped

    def unlend(self, mapped: Sequence[Hashable]) -> None:
        """Undo ``lend`` (the request was not admitted after all)."""
        index = self.index
        for k in mapped:
            if not index.release(k) and index.location(k).tier is Tier.DEVICE:
                self._reserve(k, Tier.DEVICE)
        self.changes += 1

    def commit(self, peek: PrefixPeek) -> list[Hashable]:
        """Admission went through (after ``lend``): the request and its hits are told to
        every tier's policy (``BlockRules.tell``) and host and disk hits start moving up
        to the device, in chain order. Returns the keys whose move ``loaded`` must
        finish."""
        self.rules.tell(peek.keys, peek.tiers, self._clock())
        moves = []
        dev = Tier.DEVICE
        if any(t is not dev for t in peek.tiers):
            index = self.index
            for k, t in zip(peek.keys, peek.tiers, strict=False):
                if t is not dev:  # attachable: not moving
                    index.begin_move(k, dev, self._new_handle())
                    moves.append(k)
        self.changes += 1
        return moves

    def loaded(self, moves: Sequence[Hashable]) -> None:
        """The copy of these blocks to the device landed: they are device blocks now."""
        index = self.index
        done, sources = [], []
        for k in moves:
            loc = index.location(k)
            if loc is None or loc.moving_to is not Tier.DEVICE:
                continue
            index.finish_move(k)
            self._unreserve(loc.tier)
            done.append(k)
            sources.append(loc.tier)
        if done:
            self.rules.landed(done, sources, self._clock())
            self._loaded += len(done)
        self.changes += 1

    def release(self, mapped: Sequence[Hashable]) -> None:
        """The request that mapped these blocks no longer holds its KV (the caller freed
        it first): unmap them; a device block nobody maps takes its own pages again."""
        index = self.index
        for k in mapped:
            if not index.release(k) and index.location(k).tier is Tier.DEVICE:
                self._reserve(k, Tier.DEVICE)
        self.changes += 1

    def publish(self, keys: Sequence[Hashable]) -> int:
        """A request finished (its KV freed, its blocks released): its full prompt blocks
        are published as the cache publishes them. A block the device holds (not moving)
        is the same bytes and is passed; a block held elsewhere stops the publish; each
        run of blocks the index lacks is offered to the device policy
        (``BlockRules.offer``) and kept while it admits them and the device has room.
        Returns the blocks added."""
        now = self._clock()
        index = self.index
        kv = self._kv
        bp = self.block_pages
        moving = index.moving_to
        added = 0
        i, n = 0, len(keys)
        parent = None
        while i < n:
            k = keys[i]
            loc = index.location(k)
            if loc is not None:
                if loc.tier is not Tier.DEVICE or moving(k) is not None:
                    break  # held elsewhere: as the cache, the rest is not kept
                parent = k
                i += 1
                continue
            j = i + 1  # the run of blocks the index lacks, keys[i:j]
            while j < n and keys[j] not in index:
                j += 1
            last = [parent]

            def room() -> int:
                return kv.free_pages(Tier.DEVICE) // bp

            def insert(run: Sequence[Hashable], last=last) -> int:
                """As many of ``run`` as the device has room for, into the index."""
                k = min(len(run), room())
                if k <= 0:
                    return 0
                handles = [self._new_handle() for _ in range(k)]
                if not index.insert_run(run[:k], last[0], Tier.DEVICE, handles, now):
                    return 0
                self._reserve_many(run[:k], Tier.DEVICE)
                last[0] = run[k - 1]
                return k

            depth = 0 if parent is None else index.depth(parent) + 1
            got, refused = self.rules.offer(keys[i:j], depth, room, insert, now)
            added += got
            if refused:
                self._refused += 1
            if refused or got < j - i:
                break
            parent = keys[j - 1]
            i = j
        if added:
            self.changes += 1
        return added

    # -- making room -------------------------------------------------------------------

    def make_room(self, need_pages: int, free_pages: Callable[[], int], move: bool) -> bool:
        """Free device pages held by cached blocks, in the device policy's order, until
        ``need_pages`` are free: each victim moves down (``move``, see the module
        docstring), else it is dropped. True if the pages are free; False at once, with
        nothing changed, if all such pages would not do (some may have gone before a
        False when blocks still mapped by requests keep the rest)."""
        free = free_pages()
        if free >= need_pages:
            return True
        if free + self.device_pages < need_pages or not self.rules.reachable(
                Tier.DEVICE, -(-(need_pages - free) // self.block_pages), self._clock()):
            return False
        dev = self._st[Tier.DEVICE]
        while free_pages() < need_pages:
            if not self._evict_one(dev, move):
                return False
        return True

    def drop_all_device(self) -> bool:
        """Drop every cached device block that may leave; False if none could."""
        any_ = False
        dev = self._st[Tier.DEVICE]
        while dev.held and self._evict_one(dev, False):
            any_ = True
        return any_

    def shed_device(self, over: Callable[[], bool]) -> int:
        """While ``over()``: move the device policy's victim down (or drop it). Returns
        the blocks that left the device."""
        n = 0
        dev = self._st[Tier.DEVICE]
        while dev.held and over():
            if not self._evict_one(dev, True):
                break
            n += 1
        return n

    def relieve_lower(self, high: float, low: float) -> int:
        """The host over ``high`` of its capacity: its policy's victims move to disk (or
        are dropped) until under ``low``; then the disk over ``high``: its victims are
        dropped until under ``low``. One call leaves nothing for the next to do.
        Returns the blocks that left."""
        kv = self._kv
        n = 0
        for tier in (Tier.HOST, Tier.DISK):
            total = {Tier.HOST: kv.host_capacity_bytes,
                     Tier.DISK: getattr(kv, "disk_capacity_bytes", 0)}[tier] // kv.page_bytes
            st = self._st[tier]
            if not total or not st.held:
                continue

            def used(tier=tier, total=total) -> int:
                return total - kv.free_pages(tier)

            if used() <= high * total:
                continue
            while st.held and used() > low * total:
                if not self._evict_one(st, True):
                    break
                n += 1
        return n

    # -- internals ---------------------------------------------------------------------

    def _new_handle(self) -> int:
        self._handle += 1
        return self._handle

    def _reserve(self, key: Hashable, tier: Tier) -> None:
        if not self._kv.take_block_pages(tier, self.block_pages):
            # the request that mapped it has just freed at least as much
            raise RuntimeError(f"block {key!r}: no {tier.value} page for it once unmapped "
                               "(block pages were miscounted)")
        self._st[tier].held += 1

    def _reserve_many(self, keys: Sequence[Hashable], tier: Tier) -> None:
        if not self._kv.take_block_pages(tier, len(keys) * self.block_pages):
            raise RuntimeError(f"blocks {list(keys)[:3]!r}...: no {tier.value} pages for them "
                               "(block pages were miscounted)")
        self._st[tier].held += len(keys)

    def _unreserve(self, tier: Tier, blocks: int = 1) -> None:
        self._kv.give_block_pages(tier, blocks * self.block_pages)
        self._st[tier].held -= blocks

    def _room(self, st: _TierState) -> bool:
        """Make room for one block in ``st`` by its own rule (its victims move down or are
        dropped); False if its blocks that may leave would not do (on the host, known
        before any leaves, as ``BlockRules.reachable``)."""
        free = self._kv.free_pages
        bp = self.block_pages
        tier = st.tier
        short = -(-(bp - free(tier)) // bp)
        if tier is Tier.HOST and not self.rules.reachable(tier, short, self._clock()):
            return False
        while free(tier) < bp:
            if not self._evict_one(st, True):
                return False
        return True

    def _evict_one(self, st: _TierState, move: bool) -> bool:
        """One victim of ``st``'s policy leaves (``BlockRules``): down a tier (``move``,
        where that tier's policy admits it and room can be made there) or dropped. False
        if the policy offers nothing that may leave."""
        rules = self.rules
        now = self._clock()
        key = rules.victim(st.tier, now)
        if key is None:
            return False
        dst = st.below if move else None
        if dst is not None and rules.admits(dst.tier, key, now):
            if dst.tier is Tier.HOST:
                room = self._room(dst)
                if key not in self.index:
                    return True  # making room dropped an ancestor, and this block with it
            else:  # the cache marks a block for disk before it makes room there
                handle = self._new_handle()
                self.index.begin_move(key, dst.tier, handle)
                room = self._room(dst)
                self.index.fail_move(key)
            if room:
                self._move_down(key, st, dst, now)
                return True
        self._drop(key, "evicted")
        return True

    def _move_down(self, key: Hashable, src: _TierState, dst: _TierState, now: float) -> None:
        to = dst.tier
        if not self._kv.move_block_pages(src.tier, to, self.block_pages):
            raise RuntimeError(f"moving block {key!r} to {to.value}: room was checked")
        self.index.move(key, to, self._new_handle())
        src.held -= 1
        dst.held += 1
        self.rules.moved(key, src.tier, to, now)
        if to is Tier.HOST:
            self._moved_host += 1
            if self.record_events:
                self.events.append(("block-host", key))
        else:
            self._moved_disk += 1
            if self.record_events:
                self.events.append(("block-disk", key))
        self.changes += 1

    def _drop(self, key: Hashable, reason: str, counted: bool = True) -> list[Dropped]:
        """Drop ``key`` and its cached descendants; every page they held is given back."""
        out = self.index.drop(key, reason)
        self.rules.dropped(out)
        if len(out) == 1:
            self._unreserve(out[0].tier)
        else:
            by_tier: dict[Tier, int] = {}
            for d in out:
                by_tier[d.tier] = by_tier.get(d.tier, 0) + 1
            for t, n in by_tier.items():
                self._unreserve(t, n)
        if counted:
            self._dropped += len(out)
            if self.record_events:
                self.events.extend(("block-drop", d.key) for d in out)  # its descendants too
        self.changes += 1
        return out

    # -- checking ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless the index is sound, each tier's policy tracks
        exactly that tier's blocks, and the pages held equal the blocks that hold them."""
        index = self.index
        index.check_integrity()
        problems = self.rules.check()
        if problems:
            raise AssertionError("; ".join(problems[:3]))
        held = dict.fromkeys(TIERS, 0)
        for k in index.keys():
            info = index.get(k)
            loc = index.location(k)
            if loc.moving_to not in (None, Tier.DEVICE):
                raise AssertionError(f"block {k!r} moves down in flight")
            if loc.tier is not Tier.DEVICE or not info.refs:
                held[loc.tier] += 1
        counted = {t: self._st[t].held for t in TIERS}
        if held != counted:
            raise AssertionError(f"blocks holding pages {held} != counted {counted}")
        kv = self._kv
        if hasattr(kv, "block_pages"):
            for t in TIERS:
                if kv.block_pages(t) != held[t] * self.block_pages:
                    raise AssertionError(
                        f"{t.value}: the KV backend holds {kv.block_pages(t)} block pages, "
                        f"the blocks {held[t] * self.block_pages}")
