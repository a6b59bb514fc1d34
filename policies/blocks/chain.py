"""ChainOdds: a retention policy that knows blocks form conversations.

A generic cache sees independent items. A KV block is one link of a chain,
and chains are conversations: a request reads the longest cached prefix of its
chain, most blocks are never read again, a conversation that has continued a
few times is likely to continue again, and a continuation comes back after a
typical delay. ChainOdds turns that into one number per block, its expected
reads per request of cache space it occupies from now on (its hit density),
and evicts the block with the lowest density (the deepest of its request's
chain first, so a head outlives its tail); a missed block whose density at
age 0 is not above that of the block it would displace is not admitted.

What it tracks:

- **Class.** A request whose known prefix ends inside an earlier request's
  own blocks (not at a branch point) continues that conversation: its turn is
  one more than that request's, capped at ``max_turn``. A block's class is the
  turn of the last request that read it times how often it has been read
  (capped at ``max_reads``): a re-read block is shared context, a block read
  once may be a question never asked again. A first read in a new
  conversation is classed by its request's length (``length_classes``
  buckets by powers of two from 4 blocks), and one in a continuation that
  branches from inside an earlier request rather than extending its end
  (``branch_classes``) has a class per turn. Blocks where chains branch
  (``shared_children`` distinct successors or more: a shared system prompt)
  form class 0, and a chain's last block that nothing has extended yet (in a
  trace, the partial page of the prompt) forms its own class.
- **Ghost history.** Every block read in the last ``horizon`` requests keeps a
  small record (class, last read, turn, successors seen, reads, whether it
  ended a request) whether or not it is
  still cached, so learning outlives eviction. When a block is read again,
  the gap since its last read is counted for its class; when its record ages
  past the horizon unread, a never-reused block is counted.
- **Density.** For a block of class c, unread for a requests: reuses still to
  come (counted gaps longer than a) over the expected requests it will still
  occupy (the remaining gap for those reused, the learned stay of an evicted
  block for those never reused). Ages are bucketed by powers of two and the
  table is refreshed every 16 requests. Within a class density is taken at
  the oldest and the youngest block (the function of age rises then falls);
  each class's lowest end is cached until an event changes that class, so a
  miss costs one or two classes' work, and ``check_integrity`` compares the
  cached choice with a recomputation.
  Ages are counted in requests (``on_request`` calls), so nothing depends on
  the caller's clock.

Size: ``ChainOdds`` is over 400 lines because its ghost history, class lists
and the incremental caches of its class ends are one state that every hook
updates together (``check_integrity`` recomputes the caches from the lists);
the learned densities (``_Stay``) are their own class.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterator, Sequence
from heapq import heapify, heappop, heappush
from operator import itemgetter

from tiering.policies.blocks.base import (
    BlockInfo,
    BlockPolicy,
    already_tracked,
    check_batch,
    not_tracked,
)

__all__ = ["ChainOdds"]

_first = itemgetter(0)
_NOTHING: frozenset = frozenset()
_INF = float("inf")
_AGE = tuple([0.0] + [float(1 << (b - 1)) for b in range(1, 18)])  # youngest age of bucket b
_MID = tuple([0.0] + [0.75 * (1 << b) for b in range(1, 18)])  # a typical gap in bucket b
_BUCKETS = 18  # gap and age buckets: bucket b holds values v with v.bit_length() == b
_SPAN = tuple(max(m - a, 1.0) for m, a in zip(_MID, _AGE, strict=True))  # a gap's wait
_DOWN = tuple(range(_BUCKETS - 1, -1, -1))


class _Hist:
    """Per-class reuse counts: reuses by gap bucket, and blocks never reused."""

    __slots__ = ("gaps", "never", "reused")

    def __init__(self, prior_reused: float, prior_never: float) -> None:
        self.gaps = [0.0] * _BUCKETS
        self.reused = prior_reused
        self.never = prior_never
        self.gaps[10] += prior_reused  # the prior's reuses come after ~512-1023 requests

    def add_reuse(self, gap: int) -> None:
        self.gaps[min(gap.bit_length(), _BUCKETS - 1)] += 1.0
        self.reused += 1.0

    def add_never(self) -> None:
        self.never += 1.0

    def densities(self, stay: float) -> list[float]:
        """Expected reads per request held, for a block of each age bucket not read yet.

        Reuses still ahead of a block of age a, over the time it is expected
        to stay: until its read for those reused, ``stay`` more (its expected
        time to eviction) for those never reused.
        """
        gaps, never = self.gaps, self.never
        tail = never * stay
        out = [0.0] * _BUCKETS
        later = later_mid = 0.0  # sums over the buckets above b: counts, counts x midpoints
        age, mid, span = _AGE, _MID, _SPAN
        for b in _DOWN:
            g = gaps[b]
            left = 0.5 * g + later
            if left > 0.0:
                a = age[b]
                wait = 0.5 * g * span[b] + later_mid - a * later + tail
                out[b] = left / (1e-9 if 1e-9 > wait else wait)  # max(wait, 1e-9)
            later += g
            later_mid += g * mid[b]
        return out


class ChainOdds(BlockPolicy):
    """Evict the block least likely to be read again; refuse blocks less likely than that."""

    name = "chain"

    def __init__(
        self,
        capacity: int,
        horizon: int | None = None,
        max_turn: int = 4,
        max_reads: int = 3,
        length_classes: int = 3,
        branch_classes: bool = True,
        shared_children: int = 4,
        admission: bool = True,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"chain: capacity must be an int >= 1 (blocks), got {capacity!r}")
        if horizon is None:
            horizon = 2048
        if not isinstance(horizon, int) or horizon < 2:
            raise ValueError(f"chain: horizon must be an int >= 2 (requests), got {horizon!r}")
        if not isinstance(max_turn, int) or max_turn < 1:
            raise ValueError(f"chain: max_turn must be an int >= 1, got {max_turn!r}")
        if not isinstance(max_reads, int) or isinstance(max_reads, bool) or max_reads < 1:
            raise ValueError(f"chain: max_reads must be an int >= 1, got {max_reads!r}")
        if (
            not isinstance(length_classes, int)
            or isinstance(length_classes, bool)
            or length_classes < 0
        ):
            raise ValueError(f"chain: length_classes must be an int >= 0, got {length_classes!r}")
        if not isinstance(shared_children, int) or shared_children < 2:
            raise ValueError(f"chain: shared_children must be an int >= 2, got {shared_children!r}")
        self.capacity = capacity
        self.horizon = horizon
        self.max_turn = max_turn
        self.max_reads = max_reads
        self.length_classes = length_classes
        self.branch_classes = bool(branch_classes)
        R = max_reads
        self.shared_children = shared_children
        self.admission = bool(admission)
        self._t = 0  # requests seen
        # class 0: shared branch points; then turn x reads; the tail; length; branch per turn
        self._hist = (
            [_Hist(2.0, 1.0)]
            + [_Hist(1.0, 2.0) for _ in range(max_turn * R)]
            + [_Hist(0.5, 4.0)]
            + [_Hist(1.0, 2.0) for _ in range(length_classes)]
            + [_Hist(0.5, 4.0) for _ in range(max_turn)]
        )
        self._branch_cls = max_turn * R + 2 + length_classes  # + turn - 1
        self._tail_cls = max_turn * R + 1  # a chain's last block, which nothing has extended yet
        # ghost history, oldest read first:
        # key -> [class, last read, created turn, children seen, reads, ended a request]
        self._ghost: OrderedDict[Hashable, list] = OrderedDict()
        self._children: dict[Hashable, set | int] = {}  # key -> successors seen (capped)
        # tracked (cached) blocks: key -> class; per class, keys oldest read first
        self._meta: dict[Hashable, int] = {}
        self._lists: list[OrderedDict[Hashable, int]] = [
            OrderedDict() for _ in range(len(self._hist))
        ]
        self._stay = max(1.0, capacity / 24.0)  # requests a block stays before eviction (learned)
        self._dens: list[list[float]] = []
        self._dens_at = 0
        self._refresh()
        self._cend: list[tuple] = [()] * len(self._lists)  # class -> its two ends, cached
        self._cend_t = self._cend_d = -1  # the request count and table age of _cend
        self._dirty: set[int] = set()  # classes changed since _cend was computed
        self._lows = [(_INF, c, None) for c in range(len(self._lists))]  # (density, class, key)
        self._best = self._lows[0]  # the lowest of _lows, as of the last _ends
        # a lower bound, in (density, class) order, on every entry of _lows but _best's
        self._floor = self._lows[0]
        self._above = (_INF, len(self._lows), None)  # above every entry of _lows
        # class -> its oldest read's blocks as _ends last saw them: (that read, a heap of
        # (-depth, seq, key), key -> seq, blocks tracked at that read since, as (-depth,
        # seq, key)); see _ends
        self._front: dict[int, tuple[int, list, dict, list]] = {}
        self._seq = 0  # numbers every _track, so a list's order is its entries' seq order
        self._version = 0  # bumped by every change to what is tracked
        self._ends_at = -1
        self._ends_memo: tuple | None = None
        self._turn = 1  # the current request's turn
        self._cls = 1
        # history shared with other tiers' policies (share_history): the ones this one
        # advances, or the one that advances this one and the keys it was last told
        self._followers: tuple[ChainOdds, ...] = ()
        self._leader: ChainOdds | None = None
        self._told: Sequence[Hashable] | None = None
        # pop_victim's own path, unless a subclass changed how victims are found
        self._own_pop = not self.overrides(ChainOdds, "victims", "victims_except", "_victims",
                                           "_ends")
        self._own_density = not self.overrides(ChainOdds, "_density")
        self._own_insert = not self.overrides(ChainOdds, "on_insert")

    def share_history(self, others: Sequence[BlockPolicy]) -> bool:
        """Let ``others`` (the other tiers' policies of one store, told the same requests
        in the same order, each right after this one) read this policy's ghost history
        instead of keeping identical copies: it depends only on the requests, so this one
        keeps it for all and sets each one's request count, turn and class, and its
        density table (from its own learned stay) at the moment it would. Each of them
        must then be told every request right after this one, with the same keys
        (``on_request`` raises otherwise). False (nothing shared) unless all are fresh,
        distinct policies of one class that learns as ChainOdds does, with the same
        parameters."""
        params = ("horizon", "max_turn", "max_reads", "length_classes", "branch_classes",
                  "shared_children")
        group = (self, *others)
        if not others or len({id(p) for p in group}) != len(group) or any(
            type(p) is not type(self) for p in group
        ) or any(  # a subclass that learns differently keeps its own history
            getattr(type(self), m) is not getattr(ChainOdds, m)
            for m in ("on_request", "_expire", "_refresh", "_refresh_at")
        ) or any(
            p._t or p._ghost or p._meta or p._followers or p._leader is not None
            for p in group
        ) or any(getattr(p, a) != getattr(self, a) for p in others for a in params):
            return False
        for p in others:
            p._leader = self
            p._ghost, p._children, p._hist = self._ghost, self._children, self._hist
        self._followers = tuple(others)
        return True

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def _tracked_count(self, keys: Sequence[Hashable]) -> int:
        return sum(map(self._meta.__contains__, keys))

    # -- learning --------------------------------------------------------------

    def _expire(self) -> None:
        ghost, cut = self._ghost, self._t - self.horizon
        hist, children = self._hist, self._children
        gone = []
        for k, rec in ghost.items():  # oldest read first
            if rec[1] > cut:
                break
            gone.append((k, rec))
        pop = children.pop
        for k, rec in gone:
            del ghost[k]
            hist[rec[0]].never += 1.0  # _Hist.add_never, inline
            pop(k, None)

    def on_request(self, keys: Sequence[Hashable], now: float) -> None:
        if self._leader is not None:
            told = self._told
            if told is None or (told is not keys and list(told) != list(keys)):
                raise RuntimeError(
                    "chain: this policy shares its history (share_history) and must be told "
                    "each request right after the policy that keeps it, with the same keys")
            self._told = None  # the leader did this request's work
            return
        self._t += 1
        self._version += 1
        t = self._t
        self._expire()
        if t - self._dens_at >= 16:  # the density table, refreshed every 16 requests
            self._refresh()
            for f in self._followers:
                f._refresh_at(t)
        ghost, children, shared = self._ghost, self._children, self.shared_children
        # the deepest known block decides the turn
        turn = 1
        deepest = None
        for k in keys:
            rec = ghost.get(k)
            if rec is None:
                break
            deepest = rec
        branch = False
        if deepest is not None and deepest[3] < shared:
            turn = min(deepest[2] + 1, self.max_turn)
            branch = not deepest[5]  # it continues from inside an earlier request, not its end
        self._turn = turn
        R = self.max_reads
        base = (turn - 1) * R
        # a first read in a new conversation: its class also says how long the request is
        first = base + 1
        if turn == 1 and self.length_classes:
            first = (
                self._tail_cls
                + min(max(len(keys).bit_length() - 2, 0), self.length_classes - 1)
                + 1
            )
        elif branch and self.branch_classes:
            first = self._branch_cls + turn - 1
        hist = self._hist
        top = _BUCKETS - 1
        to_end = ghost.move_to_end
        prev = pr = None  # the previous key and its ghost record
        for k in keys:
            rec = ghost.get(k)
            if pr is not None:
                seen = children.get(prev)
                if seen is None:
                    children[prev] = {k}
                    n = 1
                elif seen.__class__ is int:
                    n = seen
                else:
                    if k not in seen:
                        seen.add(k)
                        if len(seen) >= shared:
                            children[prev] = shared
                            seen = shared
                    n = seen if seen.__class__ is int else len(seen)
                pr[3] = n
                pr[0] = 0 if n >= shared else (first if pr[4] == 1 else base + pr[4])
            if rec is None:
                rec = [first, t, turn, 0, 1, False]
                ghost[k] = rec
            else:
                if rec[1] < t:  # _Hist.add_reuse, inline
                    h = hist[rec[0]]
                    b = (t - rec[1]).bit_length()
                    h.gaps[b if b < top else top] += 1.0
                    h.reused += 1.0
                to_end(k)
                rec[1] = t
                r = rec[4] + 1
                rec[4] = r = r if r < R else R
                rec[0] = 0 if rec[3] >= shared else base + r
            prev, pr = k, rec
        if len(keys) >= 2:
            ghost[keys[-2]][5] = True
        if prev is not None:
            last = ghost[prev]
            last[5] = True
            if last[3] == 0:
                last[0] = self._tail_cls
        self._cls = first
        for f in self._followers:
            if f._told is not None:
                raise RuntimeError(
                    "chain: a policy sharing this one's history was not told the last request")
            f._t, f._turn, f._cls, f._told = t, turn, first, keys
            f._version += 1

    # -- ordering --------------------------------------------------------------

    def _refresh(self) -> None:
        self._dens = [h.densities(self._stay) for h in self._hist]
        self._dens_at = self._t

    def _refresh_at(self, t: int) -> None:
        """The density table, as this policy's own on_request would refresh it at ``t``."""
        self._dens = [h.densities(self._stay) for h in self._hist]
        self._dens_at = t

    def _density(self, cls: int, last: int) -> float:
        return self._dens[cls][min((self._t - last).bit_length(), _BUCKETS - 1)]

    def _track(self, key: Hashable, depth: int) -> None:
        rec = self._ghost.get(key)
        cls = rec[0] if rec is not None else self._cls
        meta, dirty = self._meta, self._dirty
        old = meta.get(key)
        if old is not None:
            del self._lists[old][key]
            dirty.add(old)
        dirty.add(cls)
        meta[key] = cls
        self._seq = seq = self._seq + 1
        t = self._t
        self._lists[cls][key] = (t, depth, seq)
        front = self._front.get(cls)
        if front is not None and front[0] == t:  # it joins the class's oldest read
            front[3].append((-depth, seq, key))
        self._version += 1

    def _insert(self, key: Hashable, depth: int) -> None:
        if key in self._meta:
            raise already_tracked(self, key)
        self._track(key, depth)

    def on_insert(self, info: BlockInfo, now: float) -> None:
        self._insert(info[0], info[2])  # key, depth

    def on_hit(self, info: BlockInfo, now: float) -> None:
        """A hit re-tracks the block exactly as an insert does."""
        key = info[0]
        if key not in self._meta:
            raise not_tracked(self, "on_hit", key)
        self._track(key, info[2])

    def on_insert_key(self, key, depth, get, now) -> None:
        if not self._own_insert:  # a subclass's own on_insert
            self.on_insert(get(key), now)
        else:
            self._insert(key, depth)

    # batch hooks: the per-event hooks' work in one loop; a subclass that changes a
    # per-event hook gets the base class's defaults, which call it

    def on_commit(self, keys: Sequence[Hashable], hits: Sequence[Hashable],
                  depths: Sequence[int], get: Callable[[Hashable], BlockInfo],
                  now: float) -> None:
        if self.overrides(ChainOdds, "on_request", "on_hit"):
            return super().on_commit(keys, hits, depths, get, now)
        check_batch(self, "on_hit", hits, True, repeats=True)
        self.on_request(keys, now)
        meta, track = self._meta, self._track
        for k, d in zip(hits, depths, strict=True):
            if k not in meta:
                raise not_tracked(self, "on_hit", k)
            track(k, d)

    def on_publish(self, keys: Sequence[Hashable], depth: int, room: Callable[[], int],
                   insert: Callable[[Sequence[Hashable]], int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> tuple[int, bool]:
        if self.overrides(ChainOdds, "admit", "on_insert", "on_insert_key", "on_inserts"):
            return super().on_publish(keys, depth, room, insert, get, now)
        if not self.admission:
            return self.publish_room(keys, depth, room, insert, get, now)
        meta, cap = self._meta, self.capacity

        def certain() -> int:  # admit answers True, changing nothing, below capacity
            return min(room(), cap - len(meta))

        if self.overrides(ChainOdds, "publish_room", "_insert", "_track", "_density"):
            return self.publish_room(keys, depth, certain, insert, get, now)
        # publish_room with certain(), admit and on_insert_key inline
        n, total = 0, len(keys)
        while n < total:
            c = min(room(), cap - len(meta))
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
            if len(meta) >= cap:  # admit: the block at age 0 against the lowest end
                low = self._ends()
                if low is not None:
                    rec = self._ghost.get(k)
                    if not self._dens[rec[0] if rec is not None else self._cls][0] > low[0]:
                        return n, True
            if insert((k,)) != 1:
                return n, False
            if k in meta:
                raise already_tracked(self, k)
            self._track(k, depth + n)
            n += 1
        return n, False

    def pop_victim(self, now: float, *busy: Container) -> Hashable | None:
        """The first of ``victims_except``, without a generator: nearly always the lowest
        end; else the first free one in ``_victims``' order."""
        if not self._own_pop or len(busy) != 3:
            return super().pop_victim(now, *busy)
        # _ends, its cached answer inline (admit has nearly always just asked it)
        low = self._ends_memo if self._ends_at == self._version else self._ends()
        if low is None:
            return None
        r, d, b = busy
        k0 = low[1]
        if not (k0 in r or k0 in d or k0 in b):
            return k0
        # _victims' order: the class ends by density, then each class from its young end
        # (a key refused once is refused again, so the first free key is the answer)
        for _, k in sorted([e for c in self._cend if c for e in c[1:3]], key=_first):
            if not (k in r or k in d or k in b):
                return k
        lists = self._lists
        order = sorted((self._density(cls, lst[next(reversed(lst))][0]), cls)
                       for cls, lst in enumerate(lists) if lst)
        for _, cls in order:
            for k in reversed(lists[cls]):
                if not (k in r or k in d or k in b):
                    return k
        return None

    def on_remove(self, key: Hashable) -> None:
        cls = self._meta.pop(key, None)
        if cls is None:
            raise not_tracked(self, "on_remove", key)
        last = self._lists[cls].pop(key)[0]
        self._dirty.add(cls)
        self._version += 1
        age = self._t - last
        self._stay += 0.01 * (age - self._stay)

    def on_removes(self, keys: Sequence[Hashable]) -> None:
        if self.overrides(ChainOdds, "on_remove"):
            return super().on_removes(keys)
        check_batch(self, "on_remove", keys, True)
        self._removes(keys)

    def _removes(self, keys: Sequence[Hashable]) -> None:
        """``on_removes`` of keys already checked (each tracked, none twice)."""
        if self.overrides(ChainOdds, "on_remove"):
            return super()._removes(keys)
        meta, lists, dirty, t = self._meta, self._lists, self._dirty, self._t
        stay = self._stay
        try:
            for key in keys:
                cls = meta.pop(key, None)
                if cls is None:
                    raise not_tracked(self, "on_remove", key)
                last = lists[cls].pop(key)[0]
                dirty.add(cls)
                self._version += 1
                stay += 0.01 * ((t - last) - stay)
        finally:
            self._stay = stay

    def _ends(self):
        """The lowest (density, key) of the oldest (deepest of its request) and the youngest block of every class.

        Per class, cached until that class changes, the request count moves or
        the density table is refreshed; so a miss recomputes one or two classes.
        The lowest class is kept with a floor under all the others (``_floor``): it
        stays the lowest while its new end is below the floor, and all classes are
        looked at again only when it goes past it.
        """
        if self._ends_at == self._version:
            return self._ends_memo
        dens, now, top = self._dens, self._t, _BUCKETS - 1
        cend, lists = self._cend, self._lists
        if self._cend_t != now or self._cend_d != self._dens_at:
            if self._cend_d == self._dens_at:
                # a new request, the same table: the ends of a class nothing changed are
                # the same blocks, only their ages moved; their densities are read again
                self._age_ends(now)
                dirty = self._dirty
            else:
                dirty = range(len(lists))
            self._cend_t, self._cend_d = now, self._dens_at
            full = True
        else:
            dirty = self._dirty
            full = False
        front, lows = self._front, self._lows
        best = self._best  # (density, class, key) of the lowest class, kept across calls
        floor = self._floor  # at or below, in (density, class) order, every other class
        for cls in dirty:
            lst = lists[cls]
            if not lst:
                cend[cls] = ()
                e = lows[cls] = (_INF, cls, None)
                if not full:
                    d = e[0]
                    if best[1] == cls:
                        if d <= best[0] or d < floor[0] or (d == floor[0] and cls < floor[1]):
                            best = e  # still the lowest
                        else:
                            full = True  # the lowest class went up past the floor
                    elif d < best[0] or (d == best[0] and cls < best[1]):
                        floor, best = best, e
                    elif d < floor[0] or (d == floor[0] and cls < floor[1]):
                        floor = e
                continue
            first = next(iter(lst))
            t0 = lst[first][0]
            stack = front.get(cls)
            if stack is None or stack[0] != t0:
                # the oldest read's blocks, deepest (then earliest) first
                heap = []
                for k2, (t2, d2, q2) in lst.items():
                    if t2 != t0:
                        break
                    heap.append((-d2, q2, k2))
                heapify(heap)
                stack = front[cls] = (t0, heap, {e[2]: e[1] for e in heap}, [])
            _, heap, seen, added = stack
            if added:
                # what the read added since counts, as if the list were read again
                # (a block tracked again moves to its new place), whether or not the
                # read is still going on
                for e in added:
                    seen[e[2]] = e[1]
                    heappush(heap, e)
                added.clear()
            while heap:
                _, q, k = heap[0]
                e = lst.get(k)
                if e is not None and e[0] == t0 and seen.get(k) == q:
                    break
                heappop(heap)
            else:
                k = first
            k2 = next(reversed(lst))
            ty = lst[k2][0]
            row = dens[cls]
            b = (now - t0).bit_length()
            d_old = row[b if b < top else top]
            b = (now - ty).bit_length()
            d_young = row[b if b < top else top]
            old = (d_old, k)
            young = (d_young, k2)
            if d_old <= d_young:
                cend[cls] = (old, old, young, t0, ty)
                e = lows[cls] = (d_old, cls, k)
            else:
                cend[cls] = (young, old, young, t0, ty)
                e = lows[cls] = (d_young, cls, k2)
            if not full:
                d = e[0]
                if best[1] == cls:
                    # the lowest class changed: it stays the lowest unless it went up past
                    # the floor of the others
                    if d <= best[0] or d < floor[0] or (d == floor[0] and cls < floor[1]):
                        best = e
                    else:
                        full = True  # look at them all
                elif d < best[0] or (d == best[0] and cls < best[1]):
                    floor, best = best, e
                elif d < floor[0] or (d == floor[0] and cls < floor[1]):
                    floor = e
        if dirty:
            self._dirty = set()
        if full:
            # (density, class, key): ties go to the first class, so keys are never compared;
            # the floor is the lowest of the others, found with the lowest set aside
            best = min(lows)
            c = best[1]
            lows[c] = self._above
            floor = min(lows)
            lows[c] = best
        self._best = m = best
        self._floor = floor
        best = None if m[2] is None else (m[0], m[2])
        self._ends_memo, self._ends_at = best, self._version
        return best

    def _age_ends(self, now: int) -> None:
        """The cached ends of every class ``_dirty`` does not hold, at request count
        ``now``: the same two blocks, each one's density read at its age now."""
        dens, top, lows, dirty = self._dens, _BUCKETS - 1, self._lows, self._dirty
        cend = self._cend
        for cls, c in enumerate(cend):
            if not c or cls in dirty:
                continue
            _, (_, k), (_, k2), t0, ty = c
            row = dens[cls]
            b_old, b_young = (now - t0).bit_length(), (now - ty).bit_length()
            old = (row[b_old if b_old < top else top], k)
            young = (row[b_young if b_young < top else top], k2)
            low = old if old[0] <= young[0] else young
            cend[cls] = (low, old, young, t0, ty)
            lows[cls] = (low[0], cls, low[1])

    def admit(self, key: Hashable, depth: int, now: float) -> bool:
        if not self.admission or len(self._meta) < self.capacity:
            return True
        low = self._ends()
        if low is None:
            return True
        rec = self._ghost.get(key)
        cls = rec[0] if rec is not None else self._cls
        if self._own_density:  # _density at age 0, inline
            return self._dens[cls][0] > low[0]
        return self._density(cls, self._t) > low[0]

    def victims(self, now: float) -> Iterator[Hashable]:
        return self._victims(now, _NOTHING, _NOTHING, _NOTHING)

    def victims_except(self, now: float, *busy) -> Iterator[Hashable]:
        if len(busy) != 3:
            return super().victims_except(now, *busy)
        return self._victims(now, *busy)

    def _victims(self, now: float, r, d, b) -> Iterator[Hashable]:
        """The victims in order, without the keys in ``r``, ``d`` or ``b``."""
        low = self._ends()
        if low is None:
            return
        k0 = low[1]
        if not (k0 in r or k0 in d or k0 in b):
            yield k0  # nearly always taken: sort the rest only when it is not
        seen = {k0}
        ends = [e for c in self._cend if c for e in c[1:3]]
        for _, k in sorted(ends, key=_first):
            if k not in seen:
                seen.add(k)
                if not (k in r or k in d or k in b):
                    yield k
        # every end was refused (mapped by the request being served, which is the
        # youngest): walk each class from its young end, lowest density first
        ends = sorted(
            (self._density(cls, lst[next(reversed(lst))][0]), cls)
            for cls, lst in enumerate(self._lists)
            if lst
        )
        for _, cls in ends:
            for k in reversed(self._lists[cls]):
                if k not in seen:
                    seen.add(k)
                    if not (k in r or k in d or k in b):
                        yield k

    # -- checking --------------------------------------------------------------

    def _lowest_from_scratch(self) -> tuple | None:
        """What ``_ends`` must answer, recomputed without any of its caches."""
        dens, now, top = self._dens, self._t, _BUCKETS - 1
        best = None
        for cls, lst in enumerate(self._lists):
            if not lst:
                continue
            it = iter(lst.items())
            k, (t0, d0, _) = next(it)
            for k2, (t2, d2, _) in it:
                if t2 != t0:
                    break
                if d2 > d0:
                    k, d0 = k2, d2
            k2 = next(reversed(lst))
            old = (dens[cls][min((now - t0).bit_length(), top)], k)
            young = (dens[cls][min((now - lst[k2][0]).bit_length(), top)], k2)
            low = old if old[0] <= young[0] else young
            if best is None or low[0] < best[0]:
                best = low
        return best

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first inconsistency in the policy's own records."""
        total = 0
        for cls, lst in enumerate(self._lists):
            last = -1
            for k, (t, _, _) in lst.items():
                if self._meta.get(k) != cls:
                    raise AssertionError(
                        f"chain: block {k!r} is listed in class {cls}, recorded as {self._meta.get(k)}"
                    )
                if t < last or t > self._t:
                    raise AssertionError(f"chain: class {cls} is out of read order at {k!r}")
                last = t
            total += len(lst)
        if total != len(self._meta):
            raise AssertionError(
                f"chain: {len(self._meta)} blocks tracked, {total} in the class lists"
            )
        last = -1
        for k, rec in self._ghost.items():
            if rec[1] < last or rec[1] <= self._t - self.horizon:
                raise AssertionError(f"chain: ghost record of {k!r} is out of order or expired")
            if not 0 <= rec[0] < len(self._hist) or not 1 <= rec[4] <= self.max_reads:
                raise AssertionError(f"chain: ghost record of {k!r} has a bad class or read count")
            last = rec[1]
        cached, fresh = self._ends(), self._lowest_from_scratch()
        if cached != fresh:
            raise AssertionError(f"chain: cached lowest end {cached!r}, recomputed {fresh!r}")
        best, floor = self._best, self._floor
        for e in self._lows:
            if e[1] != best[1] and (e[0], e[1]) < (floor[0], floor[1]):
                raise AssertionError(
                    f"chain: class {e[1]}'s lowest end {e[0]!r} is below the floor "
                    f"{floor[0]!r} of class {floor[1]} kept for the classes but the lowest")
