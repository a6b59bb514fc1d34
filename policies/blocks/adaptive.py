"""Two policies: a LIRS-like baseline, and the adaptive default that follows whichever
of several experts pays on the workload in front of it.

``AdaptiveBlocks`` ("adaptive") keeps a full instance of each expert (by default
LRU, ChainOdds, S3-FIFO and LIRS), tells every one of them every event of the tier,
and takes its victims and admission answers from one of them, the leader. The first
expert (LRU) leads first: every policy serves the same until the tier is full, and
while ChainOdds has not yet seen enough reuse to learn its odds, LRU is the generic
policy that loses least on a large tier. Which one leads is decided by simulations:
each expert also runs in a shadow tier of ``capacity / rate`` blocks over the blocks
whose key falls in a fixed 1-in-``rate`` hash sample, told the same requests in the
same order (the sampled part of each chain), and dropping a block's held descendants
with it as the block index does. ``rate`` is 1 by default: a shadow is then a tier of
the real size serving every block, which scores a generic policy exactly as a replay
would; a sampled miniature costs less but misjudges ChainOdds, whose odds depend on
the tier's size, against the others. Each request's shadow prefix hits are summed
with an exponential decay of ``window`` requests, and their products with the squared
decay, which gives the variance of the decayed difference between two experts. The
lead passes to an expert whose decayed hits exceed the leader's by ``z`` standard
errors of that difference and by ``margin`` of the leader's hits. The short window
(700 requests) and the modest ``z`` (1.5) move the lead within a few hundred requests
of an expert starting to pay, which is what a switch gains most from: each change of
leader costs hits while the tier still holds what the old leader kept, and each
request served by the wrong leader costs more. Nothing is counted in the first
``hold`` requests (0 by default).

Bounds: each shadow holds at most ``capacity / rate`` blocks; the ghost keys of the
experts and shadows (ARC's B1 and B2, S3-FIFO's ghost FIFO, LIRS's non-resident HIR
keys) are at most ``GHOST_FACTOR`` x capacity in all (``ghost_entries`` counts
them); ChainOdds' reuse history is bounded by its horizon (the blocks read in its
last ``horizon`` requests), counted apart (``history_entries``). It depends only on the
requests: at rate 1 the ChainOdds shadow reads its expert's, and the adaptive policies
of a store's tiers may share one (``share_history``). Per event: each
expert's hook once, and each shadow's for the sampled blocks (all of them at rate
1); an expert that does not lead is asked to admit only where its ``admit`` records
something (ARC's); per request, a few products per pair of experts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterator, Sequence

from tiering.policies.blocks.base import (
    BlockInfo,
    BlockPolicy,
    _nothing_certain,
    already_tracked,
    check_batch,
    not_tracked,
)
from tiering.policies.blocks.chain import ChainOdds
from tiering.policies.blocks.generic import ARCBlocks, LRUBlocks, S3FIFOBlocks, _first_free

__all__ = ["GHOST_FACTOR", "AdaptiveBlocks", "LIRSBlocks"]

#: Ghost keys of the experts and the shadows, at most this many times the capacity: per
#: expert at most 2x (ARC, LIRS; S3-FIFO 1x, LRU and ChainOdds none), so at most 5x for
#: the five experts, and the shadows as much again at 1 / rate of the capacity.
GHOST_FACTOR = 10


def _check_capacity(name: str, capacity: object) -> int:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"{name}: capacity must be an int >= 1 (blocks), got {capacity!r}")
    return capacity


class LIRSBlocks(BlockPolicy):
    """LIRS: blocks read twice within a short reuse distance (LIR) hold most of the
    tier; the rest (resident HIR, ``hir_fraction`` of it) wait in a FIFO and go
    first. The recency stack also keeps non-resident HIR keys (ghosts), at most
    ``ghost_factor`` x capacity of them, so a block read again soon after leaving
    becomes LIR.

    ``reuse_only``: once the tier has been full, a block joins the LIR set only by a
    reuse (a hit within the stack or a ghost read again), and a reuse while the set is
    below its target takes nobody's place. That is the adaptive policy's LIRS expert:
    while another expert leads, its victims take LIR blocks, and a LIR set refilled by
    first reads would fill with whatever arrives next (a scan), so that when LIRS takes
    the lead it holds no working set to protect."""

    name = "lirs"

    def __init__(self, capacity: int, hir_fraction: float = 0.01,
                 ghost_factor: float = 2.0, reuse_only: bool = False) -> None:
        self.capacity = _check_capacity(self.name, capacity)
        if isinstance(hir_fraction, bool) or not isinstance(hir_fraction, (int, float)) or not (
                0.0 < hir_fraction < 1.0):
            raise ValueError(f"lirs: hir_fraction must be in (0, 1), got {hir_fraction!r}")
        if isinstance(ghost_factor, bool) or not isinstance(ghost_factor, (int, float)) or not (
                0.0 <= ghost_factor <= 16.0):
            raise ValueError(f"lirs: ghost_factor must be in [0, 16], got {ghost_factor!r}")
        self._lir_target = max(1, capacity - max(1, int(capacity * hir_fraction)))
        self.ghost_bound = int(capacity * ghost_factor)
        self._s: OrderedDict[Hashable, None] = OrderedDict()  # recency stack, bottom first
        self._q: OrderedDict[Hashable, None] = OrderedDict()  # resident HIR, oldest first
        self._lir: set[Hashable] = set()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()  # non-resident HIR in S
        if not isinstance(reuse_only, bool):
            raise ValueError(f"lirs: reuse_only must be a bool, got {reuse_only!r}")
        self.reuse_only = reuse_only
        self._filled = False  # the tier has been full (with reuse_only)

    def __len__(self) -> int:
        return len(self._lir) + len(self._q)

    def __contains__(self, key: object) -> bool:
        return key in self._lir or key in self._q

    def _tracked_count(self, keys: Sequence[Hashable]) -> int:
        return sum(map(self._lir.__contains__, keys)) + sum(map(self._q.__contains__, keys))

    @property
    def ghosts(self) -> int:
        return len(self._ghost)

    def _prune(self) -> None:
        """Drop HIR entries from the bottom of the stack until an LIR block is there."""
        s, lir, ghost = self._s, self._lir, self._ghost
        while s:
            k = next(iter(s))
            if k in lir:
                return
            del s[k]
            ghost.pop(k, None)

    def _demote_bottom(self) -> None:
        """The bottom LIR block becomes resident HIR (end of the FIFO)."""
        self._prune()  # (with reuse_only, a LIR set emptied by removals left HIR below)
        s = self._s
        if not s:
            return
        k, _ = s.popitem(last=False)
        self._lir.discard(k)
        self._q[k] = None
        self._prune()

    def on_insert(self, info: BlockInfo, now: float) -> None:
        self._insert_key(info.key)

    def on_insert_key(self, key: Hashable, depth: int, get: Callable[[Hashable], BlockInfo],
                      now: float) -> None:
        """``on_insert``, which reads only the key: no snapshot built."""
        if self.overrides(LIRSBlocks, "on_insert"):
            super().on_insert_key(key, depth, get, now)
            return
        self._insert_key(key)

    def on_publish(self, keys: Sequence[Hashable], depth: int, room: Callable[[], int],
                   insert: Callable[[Sequence[Hashable]], int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> tuple[int, bool]:
        """As ``BlockPolicy.on_publish``: ``admit`` is the base class's (True, changing
        nothing), so the blocks there is room for go in one ``insert`` and one
        ``on_inserts``."""
        if self.overrides(LIRSBlocks, "admit", "on_insert", "on_insert_key", "on_inserts"):
            return super().on_publish(keys, depth, room, insert, get, now)
        return self.publish_room(keys, depth, room, insert, get, now)

    def on_inserts(self, keys: Sequence[Hashable], depths: Sequence[int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> None:
        if self.overrides(LIRSBlocks, "on_insert", "on_insert_key", "__len__",
                          "__contains__", "_tracked_count"):
            super().on_inserts(keys, depths, get, now)
            return
        check_batch(self, "on_insert", keys, False)
        insert = self._insert_key
        for k in keys:
            insert(k)

    def _insert_key(self, k: Hashable) -> None:
        if k in self._lir or k in self._q:
            raise already_tracked(self, k)
        s = self._s
        room = len(self._lir) < self._lir_target
        filled = self._filled
        if self.reuse_only and not filled and len(self) + 1 >= self.capacity:
            self._filled = True
        if room and not filled:
            self._ghost.pop(k, None)
            s.pop(k, None)
            s[k] = None
            self._lir.add(k)
        elif k in self._ghost:  # read again within its reuse distance: LIR
            del self._ghost[k]
            s.move_to_end(k)
            self._lir.add(k)
            if not room:
                self._demote_bottom()
        else:
            s[k] = None
            self._q[k] = None

    def on_hit(self, info: BlockInfo, now: float) -> None:
        self._hit(info.key)

    def on_commit(self, keys: Sequence[Hashable], hits: Sequence[Hashable],
                  depths: Sequence[int], get: Callable[[Hashable], BlockInfo],
                  now: float) -> None:
        """``on_hit`` of each of ``hits``, which reads only the key: no snapshot built."""
        if self.overrides(LIRSBlocks, "on_request", "on_hit"):
            super().on_commit(keys, hits, depths, get, now)
            return
        check_batch(self, "on_hit", hits, True, repeats=True)
        hit = self._hit
        for k in hits:
            hit(k)

    def _hit(self, k: Hashable) -> None:
        s = self._s
        if k in self._lir:
            bottom = next(iter(s)) == k
            s.move_to_end(k)
            if bottom:
                self._prune()
        elif k in self._q:
            if k in s:  # a resident HIR block inside the stack: LIR
                s.move_to_end(k)
                del self._q[k]
                room = self._filled and len(self._lir) < self._lir_target
                self._lir.add(k)
                if not room:
                    self._demote_bottom()
            else:
                s[k] = None
                self._q.move_to_end(k)
        else:
            raise not_tracked(self, "on_hit", k)

    def on_remove(self, key: Hashable) -> None:
        if key in self._q:
            del self._q[key]
            if key in self._s:
                ghost = self._ghost
                ghost[key] = None
                if len(ghost) > self.ghost_bound:
                    old, _ = ghost.popitem(last=False)
                    del self._s[old]
        elif key in self._lir:
            self._lir.discard(key)
            del self._s[key]
            self._prune()
        else:
            raise not_tracked(self, "on_remove", key)

    def victims(self, now: float) -> Iterator[Hashable]:
        yield from self._q
        lir = self._lir
        for k in self._s:
            if k in lir:
                yield k

    def pop_victim(self, now: float, *busy: Container) -> Hashable | None:
        """The first of ``victims_except``, the resident HIR FIFO searched without a
        generator."""
        if self.overrides(LIRSBlocks, "victims", "victims_except"):
            return super().pop_victim(now, *busy)
        k = _first_free(self._q, busy)
        if k is None:
            lir = self._lir
            k = _first_free((k for k in self._s if k in lir), busy)
        return k


_EXPERTS: dict[str, Callable[..., BlockPolicy]] = {
    "chain": ChainOdds,
    "s3fifo": S3FIFOBlocks,
    "arc": ARCBlocks,
    "lirs": lambda capacity: LIRSBlocks(capacity, reuse_only=True),
    "lru": LRUBlocks,
}
#: ``admit`` methods that change nothing (an expert with one of these is asked only
#: when it leads)
_READ_ONLY_ADMIT = (BlockPolicy.admit, ChainOdds.admit)
_NONE: frozenset = frozenset()
_ABSENT = object()  # a dict.get default no key maps to
_info = tuple.__new__  # _info(BlockInfo, fields): a snapshot without NamedTuple's __new__
_MASK = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15


def _sample_value(key: Hashable) -> int:
    """A value of ``key`` that is the same in every process (a block key is a digest)."""
    if type(key) is int:
        return key
    if isinstance(key, bytes):
        return int.from_bytes(key[-8:], "little")
    return hash(key)


def _key_insert(p: BlockPolicy) -> Callable[[Hashable], None] | None:
    """``on_insert`` of a generic built-in of its exact class, which reads only the key
    of the snapshot, as a call with the key alone (no snapshot built); None for others."""
    cls = type(p)
    if cls is LRUBlocks or cls is S3FIFOBlocks:
        return p._insert_key
    if cls is ARCBlocks:
        return p._insert
    if cls is LIRSBlocks:
        return p._insert_key
    return None


def _ghosts(p: BlockPolicy) -> int:
    if isinstance(p, ARCBlocks):
        return len(p._b1) + len(p._b2)
    if isinstance(p, S3FIFOBlocks):
        return len(p._g)
    if isinstance(p, LIRSBlocks):
        return len(p._ghost)
    return 0


class _Shadow:
    """One expert in a shadow tier over the sampled blocks (every block at rate 1),
    counting its prefix hits.

    Like the block index, it drops a block's held descendants with it (a sampled
    block's parent is the sampled block before it in its chain): a policy whose victims
    orphan descendants gets that room back, as in the real tier, rather than a tier
    cluttered with blocks no prefix reaches. A block read below another parent than
    the one it was held under moves there, so no victim takes a block of the request
    being served with it (a chain that reads one block twice, which the index refuses,
    is served up to the repeat)."""

    __slots__ = ("capacity", "kids", "parents", "policy")

    def __init__(self, policy: BlockPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.parents: dict[Hashable, Hashable | None] = {}  # every block it holds
        self.kids: dict[Hashable, dict[Hashable, None]] = {}  # held children, where any

    def request(self, keys: list, now: float) -> int:
        """Serve one request's sampled chain; its prefix hits. The leading blocks it
        holds are told in one ``on_commit`` (up to a repeat, where serving stops), the
        rest block by block."""
        parents = self.parents  # exactly the blocks the policy holds (``check``)
        mine: set = set()  # the blocks of this request served so far: never a victim
        parent = None
        hits = n = 0
        whole = True
        absent = _ABSENT
        for k in keys:
            up = parents.get(k, absent)
            if up is absent:
                break
            hits += 1
            if whole:
                if up != parent:
                    if k in mine:  # a chain through one block twice: served so far
                        whole = False
                        continue
                    self._move(k, parent)
                mine.add(k)
                parent = k
                n += 1

        def get(key: Hashable) -> BlockInfo:
            d = keys.index(key)
            return BlockInfo(key, keys[d - 1] if d else None, d, 1, 0, now, now, 0)

        self.policy.on_commit(keys, keys[:n], range(n), get, now)
        if whole and n < len(keys):
            self._serve(keys, n, parent, mine, get, now)
        return hits

    def _serve(self, keys: list, start: int, parent: Hashable | None, mine: set,
               get: Callable[[Hashable], BlockInfo], now: float) -> None:
        """The blocks of ``keys`` from ``start`` on, after ``parent`` (``get``: a block's
        snapshot, for a policy's ``on_insert_key``)."""
        p, parents, kids, cap = self.policy, self.parents, self.kids, self.capacity
        cls = type(p)
        admit = p.admit if cls.admit is not BlockPolicy.admit else None
        pop, on_hit, remove = p.pop_victim, p.on_hit, p.on_remove
        # a policy that reads only the key and depth of an insert is not built a snapshot
        by_key = cls.on_insert_key is not BlockPolicy.on_insert_key
        on_insert = p.on_insert_key if by_key else p.on_insert
        key_insert = _key_insert(p)  # one that reads only the key: told the key alone
        add, absent = mine.add, _ABSENT
        for depth in range(start, len(keys)):
            k = keys[depth]
            up = parents.get(k, absent)
            if up is not absent:
                if up != parent:
                    if k in mine:  # a chain through one block twice: served so far
                        return
                    self._move(k, parent)
                on_hit(_info(BlockInfo, (k, parent, depth, 1, 0, now, now, 0)), now)
            else:
                if admit is not None and not admit(k, depth, now):
                    return
                if len(parents) >= cap:
                    victim = pop(now, mine, _NONE, _NONE)
                    if victim is None:
                        return
                    if victim in kids:
                        self._drop(victim)
                    else:  # a leaf (nearly always): it alone leaves
                        up = parents.pop(victim)
                        if up is not None:
                            sib = kids[up]
                            del sib[victim]
                            if not sib:
                                del kids[up]
                        remove(victim)
                if key_insert is not None:
                    key_insert(k)
                elif by_key:
                    on_insert(k, depth, get, now)
                else:
                    on_insert(_info(BlockInfo, (k, parent, depth, 1, 0, now, now, 0)), now)
                parents[k] = parent
                if parent is not None:
                    sib = kids.get(parent)
                    if sib is None:
                        kids[parent] = {k: None}
                    else:
                        sib[k] = None
            add(k)
            parent = k

    def check(self, name: str) -> None:
        """Its parents name exactly the blocks its policy holds, each parent a held block
        listing it among its children, and the children name nothing else; raises
        AssertionError naming the shadow otherwise."""
        p, parents = self.policy, self.parents
        if len(parents) != len(p) or not all(k in p for k in parents):
            raise AssertionError(f"adaptive: the {name} shadow's parents name "
                                 f"{len(parents)} blocks, its policy holds {len(p)}")
        below = {}
        for k, up in parents.items():
            if up is not None:
                below.setdefault(up, {})[k] = None
        if below != self.kids or not all(up in parents for up in below):
            raise AssertionError(f"adaptive: the {name} shadow's children do not match "
                                 f"its parents")

    def _move(self, k: Hashable, parent: Hashable | None) -> None:
        self._detach(k)
        self.parents[k] = parent
        if parent is not None:
            self.kids.setdefault(parent, {})[k] = None

    def _detach(self, k: Hashable) -> None:
        up = self.parents[k]
        if up is not None:
            sib = self.kids[up]
            del sib[k]
            if not sib:
                del self.kids[up]

    def _drop(self, victim: Hashable) -> None:
        """``victim`` and its held descendants leave, deepest first."""
        kids = self.kids
        gone, stack = [], [victim]
        keep, take, more = gone.append, stack.pop, stack.extend
        pop = kids.pop
        while stack:
            k = take()
            keep(k)
            below = pop(k, None)
            if below is not None:
                more(below)
        self._detach(victim)
        gone.reverse()
        parents = self.parents
        for k in gone:
            del parents[k]
        self.policy.on_removes(gone)


class AdaptiveBlocks(BlockPolicy):
    """Follow the expert whose shadow tier scores best lately (module docstring)."""

    name = "adaptive"

    def __init__(self, capacity: int,
                 experts: Sequence[str] = ("lru", "chain", "s3fifo", "lirs"),
                 rate: int | None = None, window: int = 700, margin: float = 0.0,
                 z: float = 1.5, hold: int = 0) -> None:
        self.capacity = _check_capacity(self.name, capacity)
        experts = tuple(experts)
        if not experts or any(e not in _EXPERTS for e in experts) or len(set(experts)) != len(
                experts):
            raise ValueError(f"adaptive: experts must be distinct names among "
                             f"{', '.join(_EXPERTS)}, got {experts!r}")
        if rate is None:
            rate = 1
        if not isinstance(rate, int) or isinstance(rate, bool) or not 1 <= rate <= capacity:
            raise ValueError(f"adaptive: rate must be an int in [1, capacity], got {rate!r}")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"adaptive: window must be an int >= 1 (requests), got {window!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not (
                0.0 <= margin <= 1.0):
            raise ValueError(f"adaptive: margin must be in [0, 1], got {margin!r}")
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not 0.0 <= z <= 100.0:
            raise ValueError(f"adaptive: z must be in [0, 100] (standard errors), got {z!r}")
        if not isinstance(hold, int) or isinstance(hold, bool) or hold < 0:
            raise ValueError(f"adaptive: hold must be an int >= 0 (requests), got {hold!r}")
        self.z = float(z)
        self.hold = hold
        self._seen = 0  # requests the shadows have served
        self.expert_names = experts
        self.rate = rate
        self.window = window
        self.margin = float(margin)
        self._decay = 1.0 - 1.0 / window
        self._decay2 = self._decay * self._decay  # the weights' squares: the sums' variance
        self._experts = [_EXPERTS[e](capacity=capacity) for e in experts]
        small = max(1, capacity // rate)
        self._shadows = [_Shadow(_EXPERTS[e](capacity=small), small) for e in experts]
        k = len(experts)
        self._sums = [0.0] * k  # decayed shadow hits per expert
        self._cross = [[0.0] * k for _ in range(k)]  # products, squared decay, upper half
        self._recorders = [p for p in self._experts if type(p).admit not in _READ_ONLY_ADMIT]
        # experts told an insert by key and depth alone (no snapshot built for them)
        self._by_key = tuple(type(p).on_insert_key is not BlockPolicy.on_insert_key
                             for p in self._experts)
        # experts whose insert reads only the key, told it alone (None: the others)
        self._key_inserts = tuple(_key_insert(p) for p in self._experts)
        # ChainOdds' history depends only on the requests: at rate 1 its shadow is told
        # the same ones right after the expert, and reads the expert's (share_history),
        # linked at the first request unless share_history linked it with other tiers'
        self._chains = ()
        if rate == 1 and "chain" in experts:
            i = experts.index("chain")
            self._chains = (self._experts[i], self._shadows[i].policy)
        self._linked = not self._chains
        self._lead = 0
        self.leader = self._experts[0]
        self.switches = 0
        self.last_switch = None  # the request count at the latest change of leader

    # -- reading -------------------------------------------------------------------

    @property
    def leader_name(self) -> str:
        return self.expert_names[self._lead]

    @property
    def scores(self) -> dict[str, float]:
        """Each expert's decayed shadow hits (what the leader is chosen by)."""
        return dict(zip(self.expert_names, self._sums, strict=True))

    @property
    def ghost_entries(self) -> int:
        """Ghost keys held by the experts and the shadows (bounded by GHOST_FACTOR x capacity)."""
        return sum(_ghosts(p) for p in self._experts) + sum(
            _ghosts(s.policy) for s in self._shadows)

    @property
    def history_entries(self) -> int:
        """Records in ChainOdds' reuse histories (bounded by its horizon, in requests); a
        shared history counts once per policy that reads it."""
        return sum(len(p._ghost) for p in (*self._experts, *(s.policy for s in self._shadows))
                   if isinstance(p, ChainOdds))

    def __len__(self) -> int:
        return len(self.leader)

    def __contains__(self, key: object) -> bool:
        return key in self.leader

    def _tracked_count(self, keys: Sequence[Hashable]) -> int:
        return self.leader._tracked_count(keys)

    def check_integrity(self) -> None:
        """Every expert tracks as many blocks as the leader, and each passes its own
        check (ChainOdds'); raises AssertionError naming the expert otherwise."""
        n = len(self.leader)
        for name, p in zip(self.expert_names, self._experts, strict=True):
            if len(p) != n:
                raise AssertionError(f"adaptive: expert {name} tracks {len(p)} blocks, "
                                     f"the leader {self.leader_name} {n}")
            check = getattr(p, "check_integrity", None)
            if check is not None:
                check()
        for name, s in zip(self.expert_names, self._shadows, strict=True):
            if len(s.policy) > s.capacity:
                raise AssertionError(f"adaptive: the {name} shadow holds {len(s.policy)} "
                                     f"blocks, more than its {s.capacity}")
            s.check(name)

    # -- events ----------------------------------------------------------------------

    def share_history(self, others: Sequence[BlockPolicy]) -> bool:
        """Let the ChainOdds experts and shadows of ``others`` (the other tiers' policies
        of one store, told the same requests in the same order, each right after this
        one) read this policy's ChainOdds history (``ChainOdds.share_history``). False
        (nothing shared) unless all are fresh, distinct adaptive policies of this class
        with a ChainOdds expert at rate 1."""
        group = (self, *others)
        if not others or len({id(p) for p in group}) != len(group) or any(
            type(p) is not type(self) or p._linked or not p._chains for p in group
        ):
            return False
        lead, *rest = [c for p in group for c in p._chains]
        if not lead.share_history(rest):
            return False
        for p in group:
            p._linked = True
        return True

    def _link(self) -> None:
        """The shadow's ChainOdds reads the expert's history, where it can (once)."""
        self._linked = True
        self._chains[0].share_history(self._chains[1:])

    def on_request(self, keys: Sequence[Hashable], now: float) -> None:
        if not self._linked:
            self._link()
        for p in self._experts:
            p.on_request(keys, now)
        self._shadow_step(keys, now)

    def _shadow_step(self, keys: Sequence[Hashable], now: float) -> None:
        """The request in every shadow, then the choice of leader."""
        rate = self.rate
        if rate == 1:  # the shadows only read it
            sampled = keys if type(keys) is list else list(keys)
        else:
            sv, g, m = _sample_value, _GOLD, _MASK
            sampled = [k for k in keys
                       if ((((k if type(k) is int else sv(k)) * g) & m) >> 32) % rate == 0]
        self._choose([s.request(sampled, now) for s in self._shadows])

    def on_commit(self, keys: Sequence[Hashable], hits: Sequence[Hashable],
                  depths: Sequence[int], get: Callable[[Hashable], BlockInfo],
                  now: float) -> None:
        """Each expert's own ``on_commit``; then the shadows and the choice of leader, as
        ``on_request`` (the hits change nothing the choice reads)."""
        if self.overrides(AdaptiveBlocks, "on_request", "on_hit"):
            super().on_commit(keys, hits, depths, get, now)
            return
        check_batch(self, "on_hit", hits, True, repeats=True)  # before any expert hears it
        if not self._linked:
            self._link()
        for p in self._experts:
            p.on_commit(keys, hits, depths, get, now)
        self._shadow_step(keys, now)

    def on_removes(self, keys: Sequence[Hashable]) -> None:
        if self.overrides(AdaptiveBlocks, "on_remove"):
            super().on_removes(keys)
            return
        check_batch(self, "on_remove", keys, True)
        # every expert tracks the blocks the leader does (each is told every insert and
        # removal), so the leader's check holds for all: each expert's loop, unchecked
        for p in self._experts:
            p._removes(keys)

    def pop_victim(self, now: float, *busy: Container) -> Hashable | None:
        if self.overrides(AdaptiveBlocks, "victims", "victims_except"):
            return super().pop_victim(now, *busy)
        return self.leader.pop_victim(now, *busy)

    def _choose(self, hits: list[int]) -> None:
        """Decay the sums, add this request's shadow hits, and hand the lead to the expert
        that beats the leader by ``z`` standard errors and by ``margin``."""
        self._seen += 1
        if self._seen <= self.hold:
            return
        g, g2, n = self._decay, self._decay2, len(hits)
        sums, cross = self._sums, self._cross
        for i in range(n):
            hi = hits[i]
            sums[i] = sums[i] * g + hi
            row = cross[i]
            for j in range(i, n):
                row[j] = row[j] * g2 + hi * hits[j]
        lead = self._lead
        sl = sums[lead]
        best, best_gap = lead, 0.0
        for i in range(n):
            if i == lead:
                continue
            d = sums[i] - sl
            if d <= best_gap or d <= self.margin * sl + 1.0:
                continue
            a, b = (i, lead) if i < lead else (lead, i)
            var = cross[i][i] - 2.0 * cross[a][b] + cross[lead][lead]
            if d * d > self.z * self.z * var:
                best, best_gap = i, d
        if best != lead:
            self._lead = best
            self.leader = self._experts[best]
            self.switches += 1
            self.last_switch = self._seen

    def admit(self, key: Hashable, depth: int, now: float) -> bool:
        """The leader's answer. Another expert is asked only when its ``admit`` may
        record something (ARC notes a B2 ghost there); one whose ``admit`` only reads
        (the default's, ChainOdds') is not."""
        leader = self.leader
        for p in self._recorders:
            if p is not leader:
                p.admit(key, depth, now)
        return leader.admit(key, depth, now)

    def on_insert(self, info: BlockInfo, now: float) -> None:
        if info.key in self.leader:
            raise already_tracked(self, info.key)
        for p in self._experts:
            p.on_insert(info, now)

    def on_publish(self, keys: Sequence[Hashable], depth: int, room: Callable[[], int],
                   insert: Callable[[Sequence[Hashable]], int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> tuple[int, bool]:
        """As ``BlockPolicy.on_publish``: each block in turn ``admit``, ``insert([key])``,
        ``on_insert_key`` (nothing is certain of the leader's ``admit``)."""
        return self.publish_room(keys, depth, _nothing_certain, insert, get, now)

    def on_insert_key(self, key: Hashable, depth: int, get: Callable[[Hashable], BlockInfo],
                      now: float) -> None:
        """``on_insert``, the snapshot built once and only for experts that read it."""
        if self.overrides(AdaptiveBlocks, "on_insert"):
            super().on_insert_key(key, depth, get, now)
            return
        if key in self.leader:
            raise already_tracked(self, key)
        info = None
        for p, by_key, ins in zip(self._experts, self._by_key, self._key_inserts):  # noqa: B905
            if ins is not None:
                ins(key)
            elif by_key:
                p.on_insert_key(key, depth, get, now)
            else:
                if info is None:
                    info = get(key)
                p.on_insert(info, now)

    def on_hit(self, info: BlockInfo, now: float) -> None:
        if info.key not in self.leader:
            raise not_tracked(self, "on_hit", info.key)
        for p in self._experts:
            p.on_hit(info, now)

    def on_remove(self, key: Hashable) -> None:
        if key not in self.leader:
            raise not_tracked(self, "on_remove", key)
        for p in self._experts:
            p.on_remove(key)

    def victims(self, now: float) -> Iterator[Hashable]:
        return self.leader.victims(now)

    def victims_except(self, now: float, *busy: Container) -> Iterator[Hashable]:
        return self.leader.victims_except(now, *busy)
