"""Cached prefix blocks in every tier: the replay's prefix reuse on ``tiering.blocks.BlockIndex``.

A Mooncake trace names a prompt's 512-token blocks by ``hash_ids`` (equal ids,
equal prefix). ``PrefixBlocks`` keeps those blocks the way a worker built on
this library does: one ``BlockIndex`` (the keys are the ids, the tiers device,
host and disk) and, per tier, a block retention policy made by
``tiering.policies.blocks.make_block_policy`` with the tier's capacity in blocks. It
is the same index and the same policies that run in production, not a copy.

The life of a block:

- **Lookup** (``peek``, ``lend``, ``commit``, when a request is admitted):
  the longest cached prefix of its full prompt blocks is reused; every
  tier's policy is told the request (``on_request``), each matched block is
  touched (``on_hit`` of its tier's policy) and mapped; matched host and
  disk blocks move up to the device (``begin_move``; ``loaded`` finishes the
  moves when the copy lands).
- **Publish** (``publish``, when the request finishes): the blocks of its
  prompt the index lacks are offered to the device policy root first
  (``admit``, then ``insert`` and ``on_insert``) while it admits them and the
  device has room. A prompt's blocks are thus kept once its request is done
  (as a worker keeps a finished request's prefix), never half-computed.
- **Device pages.** A block mapped by a live request is part of that
  request's KV (its pages are in the request's allocation); an unmapped
  device block holds its own pages (``take_block_pages`` of the KV backend),
  so the device's pressure sees it. Blocks on host and disk always hold
  their pages there.
- **Release** (the request finished, or its KV was freed to be recomputed):
  its blocks are unmapped.
- **Down the tiers** (``shed_device``, ``relieve_lower``, ``make_room``): the
  tier's policy picks the victim (``BlockIndex.choose_victim``, so a mapped
  block, or one with a mapped or moving descendant, never leaves); it moves
  one tier down if the tier below admits it and has room, else it is
  dropped with its cached descendants. Moves down change the books at once;
  their copies occupy the links (``move_block_pages``).

Each of these points calls a tier's policy once, through its batch hooks
(``on_commit``, ``on_publish``, ``pop_victim`` with ``on_removes``, ``on_inserts``;
see ``tiering.policies.blocks.base``), and updates the index in bulk; with
``batch=False`` the per-event hooks are called one by one instead, for the same run.

``check_integrity`` checks the index, that every policy tracks exactly its
tier's blocks, and that the pages held match the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from tiering.apps.replay.block_guard import Guarded, PolicyMeter, is_builtin
from tiering.blocks.index import BlockIndex, Dropped
from tiering.policies.blocks import BlockPolicyRegistry, make_block_policy
from tiering.types import Tier

__all__ = ["BlockCounters", "PrefixBlocks", "PrefixPeek"]

_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
_BELOW = {Tier.DEVICE: (Tier.HOST, Tier.DISK), Tier.HOST: (Tier.DISK,), Tier.DISK: ()}


class PrefixPeek(NamedTuple):
    """What a lookup found (nothing changed yet): the request's full prompt block keys,
    how many lead the cache, each one's tier, the prompt tokens they save, and the
    device pages the store would hand over to the request (matched unmapped device
    blocks)."""

    keys: tuple[Hashable, ...]
    blocks: int
    tiers: tuple[Tier, ...]
    reused: int
    lent_pages: int


class _TierState:
    """One tier of the store, as the eviction path reads it."""

    __slots__ = ("down", "held", "policy", "tier")

    def __init__(self, tier: Tier, policy: Any) -> None:
        self.tier = tier
        self.policy = policy
        self.held = 0  # blocks holding their own pages in this tier
        self.down: tuple[_TierState, ...] = ()  # the tiers below with any room, nearest first


class BlockCounters(NamedTuple):
    moved_host: int  # device -> host
    moved_disk: int  # device or host -> disk
    loaded: int  # host or disk -> device (reused)
    dropped: int  # blocks dropped, descendants included
    refused: int  # blocks a device policy did not admit


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
    """

    def __init__(self, kv: Any, policy: str, block_tokens: int, clock: Callable[[], float],
                 registry: BlockPolicyRegistry | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, batch: bool = True,
                 events: bool = True, meter: PolicyMeter | None = None) -> None:
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
        self.capacity_blocks = {t: caps[t] // self.block_bytes for t in _TIERS}
        made = {
            t: make_block_policy(policy, registry, capacity=max(1, self.capacity_blocks[t]),
                                 **dict(options))
            for t in _TIERS
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
        # the batch hooks (one call per commit, publish, load and burst), or the per-event
        # hooks as they were called before the batch hooks (tests compare the two)
        self.batch = bool(batch)
        self._plain = all(is_builtin(p) for p in self.policies.values())
        self.policy_name = policy
        # every tier's policy is told the same requests in the same order (commit, device
        # first): policies that learn only from them may keep one history between them
        share = getattr(self.policies[Tier.DEVICE], "share_history", None)
        self.shared_history = bool(share and share([self.policies[Tier.HOST],
                                                    self.policies[Tier.DISK]]))
        # per tier: its policy, the blocks holding their own pages there, the tiers below
        # it that have any room at all (what the eviction path reads, without a dict by Tier)
        self._st = {t: _TierState(t, self.policies[t]) for t in _TIERS}
        for t in _TIERS:
            self._st[t].down = tuple(self._st[d] for d in _BELOW[t] if self.capacity_blocks[d])
        self.index = BlockIndex()
        self._handle = 0
        self.changes = 0  # bumped whenever a block comes, goes, moves or is (un)mapped
        self._moved_host = self._moved_disk = self._loaded = self._dropped = self._refused = 0
        # (kind, key) of moves down and drops, when ``events`` (the decision log's) is on
        self.record_events = bool(events)
        self.events: list[tuple[str, Hashable]] = []

    # -- reading ---------------------------------------------------------------------

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
        """The longest reusable cached prefix of a prompt; changes nothing. At least one
        prompt token is always left to compute."""
        keys = self.keys_of(hash_ids, n_in)
        tiers = self.index.match(keys).tiers
        d = len(tiers)
        reused = min(d * self.block_tokens, n_in - 1) if d else 0
        if reused <= 0:
            return PrefixPeek(keys, 0, (), 0, 0)
        get = self.index.get
        lent = sum(1 for k, t in zip(keys, tiers, strict=False) if t is Tier.DEVICE and not get(k).refs)
        return PrefixPeek(keys, d, tiers, reused, lent * self.block_pages)

    def lends(self, hash_ids: Sequence[Hashable], n_in: int) -> bool:
        """Whether ``peek(hash_ids, n_in)`` finds blocks to reuse (``lend`` would map
        some); changes nothing."""
        if n_in <= 1:
            return False
        n = n_in // self.block_tokens
        return n > 0 and hash_ids[0] in self.index

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
        """Admission went through (after ``lend``): tell every tier's policy of the
        request, touch the hits (``on_hit`` of their tier's policy) and start moving host
        and disk hits up to the device. Returns the keys whose move ``loaded`` must
        finish."""
        if not self.batch:
            return self._commit_events(peek)
        now = self._clock()
        index = self.index
        keys = peek.keys
        tiers = peek.tiers
        index.touch_many(keys[:len(tiers)], now)
        dev = Tier.DEVICE
        if all(t is dev for t in tiers):  # the common case: every hit on the device
            hits = {dev: keys[:len(tiers)]}
        else:
            hits = {t: [] for t in _TIERS}
            for k, t in zip(keys, tiers, strict=False):
                hits[t].append(k)
        get = index.get
        depths = index.depths
        empty = ()
        for t, p in self.policies.items():
            h = hits.get(t, empty)
            p.on_commit(keys, h, depths(h), get, now)
        moves = []
        if len(hits) > 1:  # host and disk hits start up to the device, in chain order
            moving = index.moving_to
            for k, t in zip(keys, tiers, strict=False):
                if t is not dev and moving(k) is None:
                    index.begin_move(k, dev, self._new_handle())
                    moves.append(k)
        self.changes += 1
        return moves

    def _commit_events(self, peek: PrefixPeek) -> list[Hashable]:
        """``commit`` through the per-event hooks."""
        now = self._clock()
        index = self.index
        pol = self.policies
        keys = peek.keys
        for p in pol.values():
            p.on_request(keys, now)
        moves = []
        for k, t in zip(keys, peek.tiers, strict=False):
            pol[t].on_hit(index.touch(k, now), now)
            if t is not Tier.DEVICE and index.location(k).moving_to is None:
                index.begin_move(k, Tier.DEVICE, self._new_handle())
                moves.append(k)
        self.changes += 1
        return moves

    def loaded(self, moves: Sequence[Hashable]) -> None:
        """The copy of these blocks to the device landed: they are device blocks now."""
        if not self.batch:
            return self._loaded_events(moves)
        index = self.index
        now = self._clock()
        landed = {t: [] for t in _TIERS}
        for k in moves:
            loc = index.location(k)
            if loc is None or loc.moving_to is not Tier.DEVICE:
                continue
            index.finish_move(k)
            self._unreserve(loc.tier)
            landed[loc.tier].append(k)
        done = landed[Tier.HOST] + landed[Tier.DISK]
        if done:
            for t in (Tier.HOST, Tier.DISK):
                if landed[t]:
                    self.policies[t].on_removes(landed[t])
            # the device policy is told in the order the blocks landed
            if landed[Tier.HOST] and landed[Tier.DISK]:
                both = set(done)
                done = [k for k in moves if k in both]
            self.policies[Tier.DEVICE].on_inserts(done, index.depths(done), index.get, now)
            self._loaded += len(done)
        self.changes += 1

    def _loaded_events(self, moves: Sequence[Hashable]) -> None:
        """``loaded`` through the per-event hooks."""
        index = self.index
        now = self._clock()
        for k in moves:
            loc = index.location(k)
            if loc is None or loc.moving_to is not Tier.DEVICE:
                continue
            index.finish_move(k)
            self._unreserve(loc.tier)
            self.policies[loc.tier].on_remove(k)
            self.policies[Tier.DEVICE].on_insert_key(k, index.depth(k), index.get, now)
            self._loaded += 1
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
        the index lacks are offered to the device policy, root first, and kept on the
        device while it admits them and the device has room. Returns the blocks added."""
        if not self.batch:
            return self._publish_events(keys)
        now = self._clock()
        index = self.index
        dev = self.policies[Tier.DEVICE]
        kv = self._kv
        bp = self.block_pages
        added = 0
        i, n = 0, len(keys)
        parent = None
        while i < n:
            k = keys[i]
            if k in index:
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
            got, refused = dev.on_publish(keys[i:j], depth, room, insert, index.get, now)
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

    def _publish_events(self, keys: Sequence[Hashable]) -> int:
        """``publish`` through the per-event hooks."""
        now = self._clock()
        index = self.index
        dev = self.policies[Tier.DEVICE]
        kv = self._kv
        parent = None
        added = 0
        for depth, k in enumerate(keys):
            if k in index:
                parent = k
                continue
            if not dev.admit(k, depth, now):
                self._refused += 1
                break
            if kv.free_pages(Tier.DEVICE) < self.block_pages:
                break
            if not index.insert(k, parent, Tier.DEVICE, self._new_handle(), now):
                break
            self._reserve(k, Tier.DEVICE)
            dev.on_insert_key(k, index.depth(k), index.get, now)
            added += 1
            parent = k
        if added:
            self.changes += 1
        return added

    # -- making room -------------------------------------------------------------------

    def make_room(self, need_pages: int, free_pages: Callable[[], int], move: bool) -> bool:
        """Free device pages held by cached blocks, in the device policy's order, until
        ``need_pages`` are free: each victim moves down a tier where one admits it and
        has room (``move``), else it is dropped. True if the pages are free; False at
        once, with nothing changed, if all such pages would not do (some may have gone
        before a False when blocks still mapped by requests keep the rest)."""
        free = free_pages()
        if free >= need_pages:
            return True
        if free + self.device_pages < need_pages:
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

    def _evict_one(self, st: _TierState, move: bool) -> bool:
        """One victim of ``st``'s policy leaves: down a tier (``move``, where one admits
        it and has room) or dropped. False if the policy offers nothing that may leave."""
        now = self._clock()
        index = self.index
        tier = st.tier
        if self.batch and self._plain:  # a built-in: its victim, without a generator
            key = st.policy.pop_victim(now, index._refs, index._dest, index._below)
        else:
            key = index.choose_victim(st.policy, now, tier=tier)
        if key is None:
            return False
        if move:
            free = self._kv.free_pages
            bp = self.block_pages
            for dst in st.down:
                if free(dst.tier) >= bp and dst.policy.admit(key, index.depth(key), now):
                    self._move_down(key, st, dst, now)
                    return True
        self._drop(key, "evicted")
        return True

    def _move_down(self, key: Hashable, src: _TierState, dst: _TierState, now: float) -> None:
        to = dst.tier
        if not self._kv.move_block_pages(src.tier, to, self.block_pages):
            raise RuntimeError(f"moving block {key!r} to {to.value}: room was checked")
        index = self.index
        self._handle = handle = self._handle + 1  # _new_handle
        index.move(key, to, handle)
        src.held -= 1
        dst.held += 1
        src.policy.on_remove(key)
        dst.policy.on_insert_key(key, index.depth(key), index.get, now)
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
        if self.batch and len(out) > 1:
            by_tier: dict[Tier, list] = {}
            for d in out:
                by_tier.setdefault(d.tier, []).append(d.key)
            for t, ks in by_tier.items():
                self.policies[t].on_removes(ks)
                self._unreserve(t, len(ks))
        else:
            for d in out:
                self.policies[d.tier].on_remove(d.key)
                self._unreserve(d.tier)
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
        for t in _TIERS:
            n = index.count(t)
            if len(self.policies[t]) != n:
                raise AssertionError(
                    f"{t.value} policy tracks {len(self.policies[t])} blocks, the index holds {n}"
                )
        held = dict.fromkeys(_TIERS, 0)
        for k in index.keys():
            info = index.get(k)
            loc = index.location(k)
            if loc.moving_to not in (None, Tier.DEVICE):
                raise AssertionError(f"block {k!r} moves down in flight")
            if loc.tier is not Tier.DEVICE or not info.refs:
                held[loc.tier] += 1
            if k not in self.policies[loc.tier]:
                raise AssertionError(f"block {k!r} missing from its tier's policy")
        counted = {t: self._st[t].held for t in _TIERS}
        if held != counted:
            raise AssertionError(f"blocks holding pages {held} != counted {counted}")
        kv = self._kv
        if hasattr(kv, "block_pages"):
            for t in _TIERS:
                if kv.block_pages(t) != held[t] * self.block_pages:
                    raise AssertionError(
                        f"{t.value}: the KV backend holds {kv.block_pages(t)} block pages, "
                        f"the blocks {held[t] * self.block_pages}")
