"""ChainOdds: a retention policy that knows blocks form conversations.

A generic cache sees independent items. A KV block is one link of a chain,
and chains are conversations: a request reads the longest cached prefix of its
chain, most blocks are never read again, a conversation that has continued a
few times is likely to continue again, and a continuation comes back after a
typical delay. ChainOdds turns that into one number per block, the chance that
the block is read again given what it has seen so far, and evicts the block
with the lowest chance (the deepest of a chain first); a missed block whose
chance is lower than that of the block it would displace is not admitted.

What it tracks:

- **Turn.** A request whose known prefix ends inside an earlier request's own
  blocks (not at a shared branch point) continues that conversation: its turn
  is one more than that request's. A block's class is the turn of the last
  request that read it, capped at ``max_turn``; blocks where chains branch
  (``shared_children`` distinct successors or more: a shared system prompt)
  form class 0.
- **Ghost history.** Every block read in the last ``horizon`` requests keeps a
  small record (class, last read) whether or not it is still cached, so
  learning outlives eviction. When a block is read again, the gap since its
  last read is counted for its class; when its record ages past the horizon
  unread, a miss is counted.
- **Odds.** For a block of class c, unread for a requests, the chance of a
  future read is ``(R_c - R_c(<= a)) / (R_c - R_c(<= a) + X_c)``: reuses still
  to come over reuses still to come plus never-reused, from the counts above
  (with a weak prior). The age is measured in requests (the policy counts
  ``on_request`` calls), so the odds do not depend on the caller's clock.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence

from policies.blocks.base import BlockInfo, BlockPolicy

__all__ = ["ChainOdds"]

# gap buckets (in requests): bucket i holds gaps <= _EDGES[i]
_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class _Hist:
    """Per-class reuse counts: gaps of reuses by bucket, and never-reused count."""

    __slots__ = ("cum", "gaps", "never", "reused")

    def __init__(self, prior_reused: float, prior_never: float) -> None:
        self.gaps = [0.0] * (len(_EDGES) + 1)
        self.reused = prior_reused
        self.never = prior_never
        self.cum: list[float] | None = None
        # the prior's reuses sit in the bucket of gap ~512 requests
        self.gaps[9] += prior_reused

    def add_reuse(self, gap: int) -> None:
        self.gaps[bisect_right(_EDGES, gap - 1) if gap > 0 else 0] += 1.0
        self.reused += 1.0
        self.cum = None

    def add_never(self) -> None:
        self.never += 1.0
        self.cum = None

    def odds(self, age: int) -> float:
        cum = self.cum
        if cum is None:
            cum, s = [], 0.0
            for g in self.gaps:
                s += g
                cum.append(s)
            self.cum = cum
        # reuses already behind a block of this age: those with gap <= age
        i = bisect_right(_EDGES, age) - 1
        done = cum[i] if i >= 0 else 0.0
        left = self.reused - done
        if left <= 0.0:
            return 0.0
        return left / (left + self.never)


class ChainOdds(BlockPolicy):
    """Evict the block least likely to be read again; refuse blocks less likely than that."""

    name = "chain"

    def __init__(
        self,
        capacity: int,
        horizon: int | None = None,
        max_turn: int = 6,
        shared_children: int = 3,
        admission: bool = True,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"chain: capacity must be an int >= 1 (blocks), got {capacity!r}")
        if horizon is None:
            horizon = 8192
        if not isinstance(horizon, int) or horizon < 2:
            raise ValueError(f"chain: horizon must be an int >= 2 (requests), got {horizon!r}")
        if not isinstance(max_turn, int) or max_turn < 1:
            raise ValueError(f"chain: max_turn must be an int >= 1, got {max_turn!r}")
        if not isinstance(shared_children, int) or shared_children < 2:
            raise ValueError(f"chain: shared_children must be an int >= 2, got {shared_children!r}")
        self.capacity = capacity
        self.horizon = horizon
        self.max_turn = max_turn
        self.shared_children = shared_children
        self.admission = bool(admission)
        self._t = 0  # requests seen
        # class 0: shared branch points; 1..max_turn: a conversation's turn
        self._hist = [_Hist(2.0, 1.0)] + [_Hist(1.0, 2.0) for _ in range(max_turn)]
        # ghost history, oldest read first: key -> [class, last read, created turn, children seen]
        self._ghost: OrderedDict[Hashable, list] = OrderedDict()
        self._children: dict[Hashable, set | int] = {}  # key -> successors seen (capped)
        # tracked (cached) blocks: key -> (class, last read, depth); heaps per class
        self._meta: dict[Hashable, tuple[int, int, int]] = {}
        self._heaps: list[list] = [[] for _ in range(max_turn + 1)]
        self._turn = 1  # the current request's turn
        self._cls = 1

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    # -- learning --------------------------------------------------------------

    def _expire(self) -> None:
        ghost, cut = self._ghost, self._t - self.horizon
        hist, children = self._hist, self._children
        while ghost:
            k, rec = next(iter(ghost.items()))
            if rec[1] > cut:
                break
            del ghost[k]
            hist[rec[0]].add_never()
            children.pop(k, None)

    def on_request(self, keys: Sequence[Hashable], now: float) -> None:
        self._t += 1
        t = self._t
        self._expire()
        ghost, children, shared = self._ghost, self._children, self.shared_children
        # the deepest known block decides the turn
        turn = 1
        deepest = None
        for k in keys:
            rec = ghost.get(k)
            if rec is None:
                break
            deepest = rec
        if deepest is not None and deepest[3] < shared:
            turn = min(deepest[2] + 1, self.max_turn)
        self._turn = turn
        hist = self._hist
        prev = None
        for k in keys:
            rec = ghost.get(k)
            if prev is not None:
                seen = children.get(prev)
                if seen is None:
                    children[prev] = seen = {k}
                elif isinstance(seen, set) and k not in seen:
                    seen.add(k)
                    if len(seen) >= shared:
                        children[prev] = seen = shared
                pr = ghost[prev]
                pr[3] = seen if isinstance(seen, int) else len(seen)
                pr[0] = 0 if pr[3] >= shared else turn
            if rec is None:
                rec = [turn, t, turn, 0]
                ghost[k] = rec
            else:
                if rec[1] < t:
                    hist[rec[0]].add_reuse(t - rec[1])
                ghost.move_to_end(k)
                rec[1] = t
                rec[0] = 0 if rec[3] >= shared else turn
            prev = k
        self._cls = turn

    # -- ordering --------------------------------------------------------------

    def _score(self, cls: int, last: int) -> float:
        return self._hist[cls].odds(self._t - last)

    def _track(self, key: Hashable, depth: int) -> None:
        rec = self._ghost.get(key)
        cls = rec[0] if rec is not None else self._cls
        t = self._t
        self._meta[key] = (cls, t, depth)
        heapq.heappush(self._heaps[cls], (t, -depth, id(key), key))

    def on_insert(self, info: BlockInfo, now: float) -> None:
        self._track(info.key, info.depth)

    def on_hit(self, info: BlockInfo, now: float) -> None:
        self._track(info.key, info.depth)

    def on_remove(self, key: Hashable) -> None:
        del self._meta[key]

    def _top(self, cls: int):
        heap, meta = self._heaps[cls], self._meta
        while heap:
            t, nd, _, k = heap[0]
            m = meta.get(k)
            if m is not None and m[0] == cls and m[1] == t:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _best(self):
        best = None
        for cls in range(len(self._heaps)):
            top = self._top(cls)
            if top is None:
                continue
            s = self._score(cls, top[0])
            cand = (s, top[0], top[1], cls)
            if best is None or cand < best:
                best = cand
        return best

    def admit(self, key: Hashable, depth: int, now: float) -> bool:
        if not self.admission or len(self._meta) < self.capacity:
            return True
        best = self._best()
        if best is None:
            return True
        rec = self._ghost.get(key)
        cls = rec[0] if rec is not None else self._cls
        return self._hist[cls].odds(0) > best[0]

    def victims(self, now: float) -> Iterator[Hashable]:
        skipped: list[tuple[int, tuple]] = []
        try:
            while True:
                best = self._best()
                if best is None:
                    return
                cls = best[3]
                entry = heapq.heappop(self._heaps[cls])
                skipped.append((cls, entry))
                yield entry[3]
        finally:
            for cls, entry in skipped:
                heapq.heappush(self._heaps[cls], entry)
