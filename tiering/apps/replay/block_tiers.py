"""Cached prefix blocks in every tier: the replay's prefix reuse on ``tiering.blocks.BlockIndex``.

A Mooncake trace names a prompt's 512-token blocks by ``hash_ids`` (equal ids,
equal prefix). ``PrefixBlocks`` keeps those blocks the way ``PagedKVCache``'s block
store does: one ``BlockIndex`` (the keys are the ids, the tiers device, host and
disk), per tier a block retention policy made by
``tiering.policies.blocks.make_block_policy`` with the tier's capacity in blocks,
and every policy call made by the cache's own rules (``tiering.resources.kv_prefix_rules
.BlockRules``: what is attached, who is told what, what is admitted, which block
leaves first and where it goes). The same index, policies and rules run in
production; ``tests/test_replay_fidelity.py`` drives both with one request sequence,
one request at a time and several live at once.

The store registers with its ``ModeledKVCache`` (``use_blocks``), which then holds the
blocks as the cache holds its block store's: their pages are the store's, a request
maps them and holds only its own pages after them (a block two live requests map is
counted once), the used figures leave out blocks no request maps, and the cache's
``allocate``, ``reload`` and ``offload`` make room through the store.

The life of a block, in the order a worker on the cache meets it:

- **Attach** (``attach_request``: ``peek``, ``attach``, ``start_loads``, when a request
  is admitted): the longest attachable prefix of its full prompt blocks is mapped
  (``BlockRules.attachable``: never its last token, never a block moving or loaded by
  another request) and every tier's policy is told the request and its hits once
  (``BlockRules.tell``), before any room is made. Matched host and disk blocks then
  move up to the device as the cache's ``reload`` loads them: room for them is made
  (``ensure_device``), their device pages taken and the moves begun; ``loaded``
  finishes them when the copy lands, and only then does the request take its own
  pages (``allocate``: the cache allocates a request only once its load landed).
- **Publish** (``publish``, when the request finishes): its prompt blocks past
  those the device already holds are offered to the device policy root first
  (``BlockRules.publish``, the cache's walk) and kept while it admits them and the
  device has room; a block held on another tier stops the publish, as in the cache.
- **Release** (the request finished, or its KV was freed to be recomputed):
  its blocks are unmapped; their pages stay the store's.
- **Down the tiers**, only when room is needed, by the cache's own steps
  (``tiering.resources.kv_prefix_room.RoomMaker`` over the modelled pages): ``ensure_device``
  (an allocation, a reload, a load) sends the device policy's victims one tier down
  when the host policy admits them and room can be made there (``ensure_host``), a
  victim the host refuses or has no room for straight to disk when the disk policy
  admits it, else drops them with their cached descendants; ``ensure_host`` (a device victim,
  an offload of a live request) writes a batch of up to ``disk_batch`` host victims
  the disk policy admits to disk in one copy (a refused one is dropped), dropping
  disk victims for room; with no disk, or no room there, the first host victim is
  dropped; ``ensure_disk`` (a live request's offload or demotion) drops disk victims
  until it fits. Moves down change the books at once; their copies occupy the links
  (``move_block_pages``).

``check_integrity`` checks the index, that every policy tracks exactly its
tier's blocks, and that the pages held match the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from tiering.apps.replay.block_guard import Guarded, PolicyMeter, is_builtin
from tiering.blocks.index import BlockIndex, Dropped
from tiering.policies.blocks import BlockPolicyRegistry, make_block_policy
from tiering.resources.kv_prefix_room import RoomMaker
from tiering.resources.kv_prefix_rules import TIERS, BlockRules
from tiering.types import Tier

__all__ = ["Attached", "BlockCounters", "PrefixBlocks", "PrefixPeek"]


class PrefixPeek(NamedTuple):
    """What a lookup found (nothing changed yet): the request's full prompt block keys,
    how many lead the cache (attachable), each one's tier, the prompt tokens they save,
    and the device pages of matched blocks no request maps yet (an attach pins them)."""

    keys: tuple[Hashable, ...]
    blocks: int
    tiers: tuple[Tier, ...]
    reused: int
    lent_pages: int


class Attached(NamedTuple):
    """A request's attach (``PrefixBlocks.attach_request``): what the lookup found, the
    keys it maps, and of those the ones loading onto the device (``loaded`` lands them)."""

    peek: PrefixPeek
    mapped: list
    moves: list


class _ModelledPages:
    """The replay's ``BlockSpace`` (``tiering.resources.kv_prefix_room``): block pages on the
    KV backend's modelled tiers. It owns the blocks counted per tier (device: loads
    landing too), the moves down and drops it was told, and their decision log."""

    instant = True  # a modelled move changes the books at once; its copy occupies the links

    def __init__(self, kv: Any, block_pages: int, capacity_pages: dict, has_disk: bool,
                 events: bool) -> None:
        self._kv = kv
        self.free_pages = kv.free_pages  # free pages of a tier: the KV backend's
        self.block_pages = block_pages
        self.capacity = capacity_pages
        self.has_disk = has_disk
        self.held = dict.fromkeys(TIERS, 0)
        self.handles = 0
        self.moved_host = self.moved_disk = self.dropped_blocks = 0
        self.changes = 0
        self.record_events = events
        self.events: list[tuple[str, Hashable]] = []

    def new_handle(self) -> int:
        self.handles += 1
        return self.handles

    def take(self, tier: Tier, blocks: int) -> bool:
        """``blocks`` blocks of ``tier`` hold pages now; False (nothing changed) if short."""
        if not self._kv.take_block_pages(tier, blocks * self.block_pages):
            return False
        self.held[tier] += blocks
        return True

    def give(self, tier: Tier, blocks: int) -> None:
        self._kv.give_block_pages(tier, blocks * self.block_pages)
        self.held[tier] -= blocks

    # -- BlockSpace ---------------------------------------------------------------------

    def capacity_pages(self, tier: Tier) -> int:
        return self.capacity[tier]

    def request_fits(self, tier: Tier, n: int) -> bool:
        """A request's ``n`` pages fit on ``tier`` now: on one tier of that role where the
        backend says so (``request_fits``), else in the role's free pages."""
        fits = getattr(self._kv, "request_fits", None)
        return fits(tier, n) if fits is not None else self._kv.free_pages(tier) >= n

    def reserve(self, tier: Tier, n: int) -> Any:
        """Room is taken by ``settle``, as the move lands at once: on the host a block's
        new handle (``RoomMaker`` asks only once the room is free: ``settle`` checks it
        again); on disk the extent's pages when they are free, else None."""
        if tier is Tier.HOST:
            return self.new_handle()
        pages = n * self.block_pages
        return pages if self._kv.free_pages(tier) >= pages else None

    def settle(self, keys: Sequence[Hashable], handles: Sequence[Any], src: Tier,
               dst: Tier) -> None:
        n = len(keys)
        if not self._kv.move_block_pages(src, dst, n * self.block_pages):
            raise RuntimeError(f"moving blocks {list(keys)[:3]!r} to {dst.value}: room was checked")
        self.held[src] -= n
        self.held[dst] += n
        if dst is Tier.HOST:
            self.moved_host += n
        else:
            self.moved_disk += n
        if self.record_events:
            kind = "block-host" if dst is Tier.HOST else "block-disk"
            self.events.extend((kind, key) for key in keys)
        self.changes += 1

    def release(self, tier: Tier, handles: Sequence[Any]) -> None:
        self.give(tier, len(handles))

    def release_extent(self, room: Any) -> None:
        """The extent's pages come free with its last block (the cache's disk extent)."""
        self._kv.give_block_pages(Tier.DISK, room)

    def dropped(self, key: Hashable, reason: str, gone: Sequence[Dropped]) -> None:
        if not gone:  # a victim its ancestor's drop took: counted with that drop
            return
        # a disk block's pages are its extent's: counted out of the tier here
        self.held[Tier.DISK] -= sum(1 for d in gone if d.tier is Tier.DISK)
        self.dropped_blocks += len(gone)
        if self.record_events:
            self.events.extend(("block-drop", d.key) for d in gone)  # its descendants too
        self.changes += 1


class BlockCounters(NamedTuple):
    moved_host: int  # device -> host
    moved_disk: int  # host (or a device victim the host did not take) -> disk
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
    what admission changes). ``move``: device victims go down a tier (the cache's rule;
    False: they are dropped, the replay's ``make_room="drop"``). ``disk_batch``: the most
    host blocks one host -> disk copy packs (the cache's ``disk_batch_pages``: a block is
    a page there). The store registers with ``kv`` (``use_blocks``) when ``kv`` has it.
    """

    def __init__(self, kv: Any, policy: str, block_tokens: int, clock: Callable[[], float],
                 registry: BlockPolicyRegistry | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, batch: bool = True,
                 events: bool = True, meter: PolicyMeter | None = None,
                 admission: bool = True, move: bool = True, disk_batch: int = 16) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or (
            block_tokens < 1
        ):
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        if isinstance(disk_batch, bool) or not isinstance(disk_batch, int) or disk_batch < 1:
            raise ValueError(f"disk_batch must be an int >= 1, got {disk_batch!r}")
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
        # the blocks' pages on the modelled tiers, and the cache's steps making room there
        self.pages = _ModelledPages(kv, self.block_pages,
                                    {t: caps[t] // int(kv.page_bytes) for t in TIERS},
                                    bool(self.capacity_blocks[Tier.DISK]), bool(events))
        self.room = RoomMaker(self.index, self.rules, self.pages, clock, disk_batch=disk_batch,
                              move=move)
        self._changes = 0  # bumped whenever a block comes, is (un)mapped or loaded
        self._loaded = self._refused = 0
        if hasattr(kv, "use_blocks"):
            kv.use_blocks(self)

    # -- reading ---------------------------------------------------------------------

    @property
    def shared_history(self) -> bool:
        """Whether the tiers' policies keep one request history between them."""
        return self.rules.shared_history

    @property
    def counters(self) -> BlockCounters:
        p = self.pages
        return BlockCounters(p.moved_host, p.moved_disk, self._loaded, p.dropped_blocks,
                             self._refused)

    @property
    def changes(self) -> int:
        """Bumped whenever a block comes, goes, moves or is (un)mapped."""
        return self._changes + self.pages.changes

    @property
    def events(self) -> list[tuple[str, Hashable]]:
        """(kind, key) of moves down and drops, in order, when ``events`` is on."""
        return self.pages.events

    @property
    def capacity_pages(self) -> dict[Tier, int]:
        return self.pages.capacity

    @property
    def device_pages(self) -> int:
        """Device pages held by cached blocks no request maps (what dropping all of them
        frees at most)."""
        return self.index.idle_count(Tier.DEVICE) * self.block_pages

    def idle_pages(self, tier: Tier) -> int:
        """Pages of ``tier`` held by cached blocks no request maps and none moves (room the
        store can free; the KV backend leaves them out of its used figures)."""
        return self.index.idle_count(tier) * self.block_pages

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
        refs, dev = self.index.refs, Tier.DEVICE
        lent = sum(1 for k, t in zip(keys, tiers, strict=False) if t is dev and not refs(k))
        return PrefixPeek(keys, d, tiers, d * self.block_tokens, lent * self.block_pages)

    def need_pages(self, peek: PrefixPeek | None, tokens: int) -> int:
        """Device pages a request of ``tokens`` tokens takes after the attach ``peek``
        found: pages for its loads (hits off the device) and its own pages after its
        blocks."""
        if peek is None:
            return int(self._kv.pages_for(tokens))
        loads = sum(1 for t in peek.tiers if t is not Tier.DEVICE)
        return loads * self.block_pages + int(self._kv.pages_for(tokens - peek.reused))

    # -- a request's blocks ----------------------------------------------------------

    def attach_request(self, rid: str, peek: PrefixPeek, overrides: Any = None) -> Attached | None:
        """What a worker on the cache does to admit ``rid`` (``ingest_request``,
        ``attach_prefix``, the ``reload`` of its host and disk hits): ingest it, map its
        hits (``map_blocks``) and tell the policies (``attach``), then make room for the
        loads and begin them (``start_loads``). None when the loads find no room: the
        request is removed again and its blocks unmapped (the policies were told, as the
        cache's were). The caller allocates the request's own pages once the loads landed
        (``loaded``), or at once when there are none; ``abandon`` undoes it all."""
        kv = self._kv
        kv.ingest_request(rid, overrides)
        mapped = self.attach(peek)
        if mapped:
            kv.map_blocks(rid, peek.reused, peek.blocks * self.block_pages)
        moves = self.start_loads(peek)
        if moves is None:
            kv.remove_request(rid)
            self.release(mapped)
            return None
        return Attached(peek, mapped, moves)

    def abandon(self, rid: str, att: Attached) -> None:
        """Undo ``attach_request`` (its own allocation was refused): the request is removed,
        loads not landed are given up (their device pages freed) and its blocks unmapped."""
        self._kv.remove_request(rid)
        self.undo_loads(att.moves)
        self.release(att.mapped)

    def attach(self, peek: PrefixPeek) -> list[Hashable]:
        """Map the matched blocks (they can no longer be evicted; their pages stay the
        store's) and tell every tier's policy the request and its hits
        (``BlockRules.tell``), as the cache's attach does. Returns the keys mapped."""
        index = self.index
        mapped = list(peek.keys[:peek.blocks])
        for k in mapped:
            index.acquire(k)
        self.rules.tell(peek.keys, peek.tiers, self._clock())
        self._changes += 1
        return mapped

    def start_loads(self, peek: PrefixPeek) -> list[Hashable] | None:
        """The attached host and disk hits start moving up to the device, in chain order,
        as the cache's reload starts them: room for their pages is made first
        (``ensure_device``) and the pages taken. Returns the keys whose move ``loaded``
        finishes ([] when all hits are on the device); None, with no load begun, when the
        device has no room for them."""
        dev = Tier.DEVICE
        todo = [k for k, t in zip(peek.keys, peek.tiers, strict=False) if t is not dev]
        if not todo:
            return []
        n = len(todo) * self.block_pages
        if not self.ensure_device(n) or not self.pages.take(dev, len(todo)):
            return None
        index = self.index
        for k in todo:
            index.begin_move(k, dev, self.pages.new_handle())
        self._changes += 1
        return todo

    def undo_loads(self, moves: Sequence[Hashable]) -> None:
        """Give up the loads of ``moves`` not landed yet: their device pages are freed and
        the blocks stay where they were (the cache's cancelled load)."""
        index = self.index
        gone = 0
        for k in moves:
            loc = index.location(k)
            if loc is not None and loc.moving_to is Tier.DEVICE:
                index.fail_move(k)
                gone += 1
        if gone:
            self.pages.give(Tier.DEVICE, gone)
            self._changes += 1

    def loaded(self, moves: Sequence[Hashable]) -> None:
        """The copy of these blocks to the device landed: they are device blocks now (on
        the pages ``start_loads`` took), and their old tier's pages are free."""
        index = self.index
        done, sources = [], []
        for k in moves:
            loc = index.location(k)
            if loc is None or loc.moving_to is not Tier.DEVICE:
                continue
            index.finish_move(k)
            self.room.free_location(loc.tier, loc.handle)  # its old place is free
            if loc.tier is Tier.DISK:
                self.pages.held[Tier.DISK] -= 1
            done.append(k)
            sources.append(loc.tier)
        if done:
            self.rules.landed(done, sources, self._clock())
            self._loaded += len(done)
        self._changes += 1

    def release(self, mapped: Sequence[Hashable]) -> None:
        """The request that mapped these blocks no longer holds its KV: unmap them."""
        index = self.index
        for k in mapped:
            index.release(k)
        self._changes += 1

    def publish(self, keys: Sequence[Hashable]) -> int:
        """A request finished (its KV freed, its blocks released): its full prompt blocks
        are published as the cache publishes them. A block the device holds (not moving)
        is the same bytes and is passed; a block held elsewhere stops the publish; each
        run of blocks the index lacks is offered to the device policy and kept while it
        admits them and the device has room (``BlockRules.publish``, as the cache's).
        Returns the blocks added."""
        now = self._clock()
        index, pages = self.index, self.pages
        free, bp = self._kv.free_pages, self.block_pages

        def room(left: int) -> int:
            return free(Tier.DEVICE) // bp

        def insert(run: Sequence[Hashable], parent: Hashable | None) -> int:
            """As many of ``run`` as the device has room for, into the index."""
            k = min(len(run), free(Tier.DEVICE) // bp)
            if k <= 0:
                return 0
            handles = [pages.new_handle() for _ in range(k)]
            if not index.insert_run(run[:k], parent, Tier.DEVICE, handles, now):
                return 0
            if not pages.take(Tier.DEVICE, k):
                raise RuntimeError(f"blocks {list(run[:3])!r}...: no device pages for them "
                                   "(block pages were miscounted)")
            return k

        added, refused = self.rules.publish(keys, 0, now, room=room, insert=insert)
        self._refused += refused
        if added:
            self._changes += 1
        return added

    # -- making room -------------------------------------------------------------------

    def ensure_device(self, n: int) -> bool:
        """Free device pages held by cached blocks no request maps, in the device policy's
        order, until ``n`` pages are free, by the cache's steps (``RoomMaker``: each victim
        goes down a tier when ``move`` and the tier below admits it, else it is dropped).
        True if the pages are free; False at once, with nothing changed, when the blocks
        that may leave would not free enough."""
        return self.room.ensure(Tier.DEVICE, n)

    def ensure_host(self, n: int) -> bool:
        """Free host pages held by cached blocks no request maps until a live request of
        ``n`` pages fits on a host-like tier: the host policy's victims go to disk in
        batches (``RoomMaker.ensure_request``). False, with nothing changed, when the
        blocks that may leave would not free enough."""
        return self.room.ensure_request(Tier.HOST, n)

    def ensure_disk(self, n: int) -> bool:
        """Drop disk blocks no request maps until the disk can take ``n`` pages of a live
        request (``RoomMaker.ensure_request``, as the cache's offload and demotion do)."""
        return self.room.ensure_request(Tier.DISK, n)

    def drop_all_device(self) -> bool:
        """Drop every cached device block that may leave; False if none could."""
        any_ = False
        dev = Tier.DEVICE
        while self.index.idle_count(dev):
            key = self.rules.victim(dev, self._clock())
            if key is None:
                break
            self.room.drop(key, "evicted")
            any_ = True
        return any_

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
            if loc.tier is not Tier.DEVICE and info.refs > 1:
                raise AssertionError(f"block {k!r} off the device is mapped {info.refs} times")
            held[loc.tier] += 1
            if loc.moving_to is Tier.DEVICE:
                held[Tier.DEVICE] += 1  # the pages its load lands in
        counted = dict(self.pages.held)
        if held != counted:
            raise AssertionError(f"blocks holding pages {held} != counted {counted}")
        problems = self.room.problems()
        if problems:
            raise AssertionError("; ".join(problems[:3]))
        pages = {t: held[t] * self.block_pages for t in TIERS}
        pages[Tier.DISK] = sum(p for p, _ in self.room.extents.values())
        kv = self._kv
        if hasattr(kv, "block_pages"):
            for t in TIERS:
                if kv.block_pages(t) != pages[t]:
                    raise AssertionError(
                        f"{t.value}: the KV backend holds {kv.block_pages(t)} block pages, "
                        f"the blocks {pages[t]}")
