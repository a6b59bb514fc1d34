"""The rules of a block store, written once: what each tier's block policy is told, and when.

``BlockRules`` is the policy side of a store of content-addressed KV blocks on the
device, host and disk tiers. The cache's ``PrefixCache`` (``tiering.resources.kv_prefix``)
and the replay's ``PrefixBlocks`` (``tiering.apps.replay.block_tiers``) each own one
over their ``BlockIndex`` and move the bytes (or count the pages) themselves; every
decision a policy makes for them is taken here, so a replay runs the rules a cache runs:

- **Attach** (``attachable``): the longest run of leading blocks of a prompt that the
  index holds, not moving, and, off the device, mapped by no other request (a block off
  the device is mapped by at most one request: its loader). At most ``(n - 1) // T``
  blocks of an ``n``-token prompt: its last token is always computed.
- **Tell** (``tell``): once per attach, every tier's policy hears the chain of the
  request's full blocks and its hits in that tier (``on_commit``), device first.
- **Publish** (``publish``, ``offer``): a request's blocks, root first: one the device
  holds is passed, one held elsewhere stops it; each run the index lacks is offered to
  the device policy (``on_publish``: ``admit`` each in turn; a refusal stops the publish).
- **Make room** (``reachable``, ``victim``, ``admits``): when the device or the host
  needs pages, the room is refused at once, nothing moved, unless enough of its blocks
  may leave; then its policy names each victim (unmapped, not moving, nothing below it
  busy). The victim moves one tier down when that tier's policy admits it and room can
  be made there by the same rule (device -> host -> disk); a device victim the host's
  policy refuses goes on to the disk when the disk's policy admits it; otherwise it is
  dropped with its cached descendants. A disk victim is dropped.
- **Arrivals** (``moved``, ``landed``, ``arrived``, ``dropped``): blocks that move, land
  on the device from a load, come from outside, or leave are taken off their old tier's
  policy and put on the new one's, in bulk where several go at once.

``watch(kind, key, tier)``, when set, is told every event in the order it happens:
``hit`` (the tier it was found on), ``publish``, ``refuse`` (a block the device policy
did not admit for a publish, or the tier below for a victim), ``load`` (the tier it
came from), ``move`` (the tier it went to) and ``drop`` (the tier it left), after an
``orphan`` for each cached descendant that left with it (deepest first).

``admission=False`` never asks ``admit``: every offered block is taken while there is
room, and a victim moves down whenever the tier below can take it (benchmarks compare
the two). ``batch=False`` calls each policy's per-event hooks one by one instead of its
batch hooks (the base class's defaults), for the same answers.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Sequence
from typing import Any

from tiering.policies.blocks.base import BlockPolicy

from tiering.blocks.index import BlockIndex, Dropped
from tiering.types import Tier

__all__ = ["BELOW", "TIERS", "BlockRules", "Watch"]

TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
#: Where a victim of each tier goes, if anywhere.
BELOW: dict[Tier, Tier | None] = {Tier.DEVICE: Tier.HOST, Tier.HOST: Tier.DISK, Tier.DISK: None}

Watch = Callable[[str, Hashable, Tier], None]


class BlockRules:
    """The policy calls of one block store (see the module docstring).

    ``policies``: one per tier (device, host, disk); ``plain``: they are the library's
    own, unwrapped (a victim is then taken with ``pop_victim``, without a generator).
    """

    def __init__(self, index: BlockIndex, policies: dict[Tier, Any], *, plain: bool = True,
                 admission: bool = True, batch: bool = True, watch: Watch | None = None) -> None:
        if set(policies) != set(TIERS):
            raise ValueError(f"BlockRules: one policy per tier of {[t.value for t in TIERS]},"
                             f" got {[getattr(t, 'value', t) for t in policies]}")
        self.index = index
        self.policies = {t: policies[t] for t in TIERS}  # device, host, disk: the order told
        self.admission = bool(admission)
        self.batch = bool(batch)
        self._pop = self.batch and bool(plain)
        self.watch = watch
        # every tier's policy is told the same requests in the same order (device first):
        # policies that learn only from them may keep one history between them
        share = getattr(self.policies[Tier.DEVICE], "share_history", None)
        self.shared_history = bool(share and share([self.policies[Tier.HOST],
                                                    self.policies[Tier.DISK]]))

    def _hook(self, policy: Any, name: str) -> Callable:
        """``policy``'s batch hook ``name``, or with ``batch=False`` the base class's default
        (which calls the per-event hooks)."""
        if self.batch:
            return getattr(policy, name)
        return getattr(BlockPolicy, name).__get__(policy)

    # -- attach, tell -------------------------------------------------------------------

    def attachable(self, keys: Sequence[Hashable], n_tokens: int, block_tokens: int) -> list[Tier]:
        """The tiers of the leading blocks of ``keys`` an attach of an ``n_tokens`` prompt
        maps (see the module docstring); changes nothing."""
        return self.index.attachable_tiers(keys[:max(0, (n_tokens - 1) // block_tokens)])

    def tell(self, keys: Sequence[Hashable], tiers: Sequence[Tier], now: float) -> None:
        """A request reading ``keys`` (its full blocks, root first) was admitted, with the
        leading ``len(tiers)`` of them mapped from the cache (``tiers``: where each was):
        they are touched, and each tier's policy is told the request and its hits there."""
        index = self.index
        hit = keys[:len(tiers)]
        index.touch_many(hit, now)
        dev = Tier.DEVICE
        if all(t is dev for t in tiers):  # the common case: every hit on the device
            by_tier: dict[Tier, Sequence[Hashable]] = {dev: hit}
        else:
            by_tier = {t: [] for t in TIERS}
            for k, t in zip(keys, tiers, strict=False):
                by_tier[t].append(k)
        get, depths = index.get, index.depths
        for t, p in self.policies.items():
            h = by_tier.get(t, ())
            self._hook(p, "on_commit")(keys, h, depths(h), get, now)
        if self.watch is not None:
            for k, t in zip(keys, tiers, strict=False):
                self.watch("hit", k, t)

    # -- publish --------------------------------------------------------------------------

    def offer(self, keys: Sequence[Hashable], depth: int, room: Callable[[], int],
              insert: Callable[[Sequence[Hashable]], int], now: float) -> tuple[int, bool]:
        """Offer ``keys`` (blocks the index lacks, one after another from ``depth``, root
        first) to the device policy; ``insert(run)`` puts the first of ``run`` in the
        index and answers how many, ``room()`` how many it can take now. Returns (blocks
        inserted, whether the policy refused one)."""
        dev = self.policies[Tier.DEVICE]
        get = self.index.get
        if self.admission:
            got, refused = self._hook(dev, "on_publish")(keys, depth, room, insert, get, now)
        else:
            got, refused = insert(keys), False
            if got:
                self._hook(dev, "on_inserts")(keys[:got], range(depth, depth + got), get, now)
        if self.watch is not None:
            for k in keys[:got]:
                self.watch("publish", k, Tier.DEVICE)
            if refused:
                self.watch("refuse", keys[got], Tier.DEVICE)
        return got, refused

    def publish(self, keys: Sequence[Hashable], start: int, now: float, *,
                room: Callable[[int], int],
                insert: Callable[[Sequence[Hashable], Hashable | None], int],
                passed: Callable[[Hashable, Any], None] | None = None,
                busy: Container[Hashable] = ()) -> tuple[int, int]:
        """Publish ``keys`` (a request's full blocks, root first) from position ``start``:
        a block the device holds, not moving, is the same bytes and is ``passed`` (key,
        location); one held elsewhere, moving, or in ``busy`` stops the publish; each run
        of blocks the index lacks is offered to the device policy (``offer``, ``depth``
        their position), ``insert(part, parent)`` putting the first of ``part`` in the index
        under ``parent`` and answering how many, ``room(left)`` how many it can take now
        (``left``: of the run still to go); a refusal or a run cut short stops it.
        Returns (blocks inserted, runs the policy refused)."""
        index = self.index
        location, dev = index.location, Tier.DEVICE
        added = refused_runs = 0
        i, n = start, len(keys)
        while i < n:
            key = keys[i]
            if key in busy:
                break
            loc = location(key)
            if loc is not None:
                if loc.tier is not dev or loc.moving_to is not None:
                    break  # held elsewhere: the rest is not kept
                if passed is not None:
                    passed(key, loc)
                i += 1
                continue
            j = i + 1  # the run of blocks the index lacks, keys[i:j]
            while j < n and keys[j] not in index and keys[j] not in busy:
                j += 1
            run = keys[i:j]
            state = [keys[i - 1] if i else None, 0]  # the next part's parent, inserted so far

            def put(part: Sequence[Hashable], state=state) -> int:
                got = insert(part, state[0])
                if got:
                    state[0] = part[got - 1]
                    state[1] += got
                return got

            got, refused = self.offer(run, i, lambda run=run, state=state: room(len(run) - state[1]),
                                      put, now)
            added += got
            refused_runs += refused
            if refused or got < len(run):
                break
            i = j
        return added, refused_runs

    # -- making room ------------------------------------------------------------------------

    def reachable(self, tier: Tier, short: int, now: float) -> bool:
        """Whether ``short`` more blocks can leave ``tier`` now: its unmapped, unmoving
        blocks are enough, and so are those its policy offers that may leave (asked
        before anything moves, so a shortage is refused with nothing changed)."""
        if short <= 0:
            return True
        index = self.index
        return short <= index.idle_count(tier) and index.count_evictable(
            self.policies[tier], now, tier, short) >= short

    def victim(self, tier: Tier, now: float, skip: Container[Hashable] = ()) -> Hashable | None:
        """The block ``tier``'s policy sends away first among those that may leave; None
        when none may. The policy still tracks it (``moved`` or ``dropped`` tells it).
        ``skip``: more keys to pass over (ones the caller cannot let go of now)."""
        index = self.index
        p = self.policies[tier]
        if self._pop:
            if skip:
                return p.pop_victim(now, index._refs, index._dest, index._below, skip)
            return p.pop_victim(now, index._refs, index._dest, index._below)
        return index.choose_victim(p, now, tier=tier, skip=skip)

    def admits(self, tier: Tier, key: Hashable, now: float, depth: int | None = None) -> bool:
        """Whether ``tier``'s policy takes ``key``, a victim of the tier above (or, with
        ``depth``, a block arriving from outside that the index does not hold yet)."""
        if depth is None:
            depth = self.index.depth(key)
        if not self.admission or self.policies[tier].admit(key, depth, now):
            return True
        if self.watch is not None:
            self.watch("refuse", key, tier)
        return False

    def disk_batch(self, size: int, clock: Callable[[], float],
                   drop: Callable[[Hashable], None],
                   mark: Callable[[Hashable, int], None]) -> tuple[list[Hashable], int]:
        """Up to ``size`` host victims for one write to disk, in the host policy's order:
        each the disk's policy admits is ``mark``ed (its move begun, so the next victim is
        another block) with its place in the batch, each it refuses is ``drop``ped. Returns
        (the marked keys, how many were refused)."""
        chosen: list[Hashable] = []
        refused = 0
        for _ in range(size):
            now = clock()
            key = self.victim(Tier.HOST, now)
            if key is None:
                break
            if not self.admits(Tier.DISK, key, now):
                drop(key)  # the disk does not take it: it leaves the store
                refused += 1
                continue
            mark(key, len(chosen))
            chosen.append(key)
        return chosen, refused

    # -- arrivals and departures --------------------------------------------------------

    def moved(self, key: Hashable, src: Tier, dst: Tier, now: float) -> None:
        """``key`` moved from ``src`` to ``dst`` (the index says so already)."""
        self.policies[src].on_remove(key)
        self.policies[dst].on_insert_key(key, self.index.depth(key), self.index.get, now)
        if self.watch is not None:
            self.watch("move", key, dst)

    def arrived(self, key: Hashable, tier: Tier, now: float) -> None:
        """``key`` arrived in ``tier`` from outside the store's tiers (a shared cold tier)."""
        self.policies[tier].on_insert_key(key, self.index.depth(key), self.index.get, now)

    def landed(self, keys: Sequence[Hashable], sources: Sequence[Tier], now: float) -> None:
        """Loads of ``keys`` (from ``sources``) landed on the device, in this order."""
        if not keys:
            return
        by_tier: dict[Tier, list[Hashable]] = {}
        for k, t in zip(keys, sources, strict=True):
            by_tier.setdefault(t, []).append(k)
        for t in TIERS:
            if t in by_tier:
                self._hook(self.policies[t], "on_removes")(by_tier[t])
        index = self.index
        self._hook(self.policies[Tier.DEVICE], "on_inserts")(keys, index.depths(keys), index.get,
                                                              now)
        if self.watch is not None:
            for k, t in zip(keys, sources, strict=True):
                self.watch("load", k, t)

    def dropped(self, gone: Sequence[Dropped]) -> None:
        """These blocks left the index (``BlockIndex.drop``'s answer, deepest first)."""
        if len(gone) == 1 or not self.batch:
            for d in gone:
                self.policies[d.tier].on_remove(d.key)
        else:
            by_tier: dict[Tier, list[Hashable]] = {}
            for d in gone:
                by_tier.setdefault(d.tier, []).append(d.key)
            for t, ks in by_tier.items():
                self.policies[t].on_removes(ks)
        if self.watch is not None:
            for d in gone:
                self.watch("orphan" if d.reason == "orphaned" else "drop", d.key, d.tier)

    def check(self) -> list[str]:
        """Problems found (empty: none): each tier's policy tracks exactly its blocks."""
        index = self.index
        out = []
        for t, p in self.policies.items():
            if len(p) != index.count(t):
                out.append(f"{t.value} policy tracks {len(p)} blocks, index holds {index.count(t)}")
        for k in index.keys():
            t = index.location(k).tier
            if k not in self.policies[t]:
                name = k.hex() if isinstance(k, bytes) else repr(k)
                out.append(f"block {name} is not tracked by the {t.value} policy")
        return out
