"""Three established cache policies over blocks: LRU, ARC and S3-FIFO.

They see blocks as independent items: no chain structure, no notion of a
conversation. They are the baselines the KV-aware policy is measured against.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterator, Sequence

from tiering.policies.blocks.base import (
    BlockInfo,
    BlockPolicy,
    already_tracked,
    check_batch,
    not_tracked,
)

__all__ = ["ARCBlocks", "LRUBlocks", "S3FIFOBlocks"]


def _check_capacity(name: str, capacity: object) -> int:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"{name}: capacity must be an int >= 1 (blocks), got {capacity!r}")
    return capacity


def _first_free(keys, busy: tuple) -> Hashable | None:
    """The first of ``keys`` in none of the ``busy`` containers (None: there is none)."""
    if len(busy) == 3:
        r, d, b = busy
        for k in keys:
            if not (k in r or k in d or k in b):
                return k
        return None
    for k in keys:
        if not any(k in c for c in busy):
            return k
    return None


def _free_test(busy: tuple) -> Callable[[Hashable], bool]:
    """Whether a key is in none of the ``busy`` containers."""
    if len(busy) == 3:
        r, d, b = busy
        return lambda k: not (k in r or k in d or k in b)
    return lambda k: not any(k in c for c in busy)


class LRUBlocks(BlockPolicy):
    """Least recently used block first."""

    name = "lru"

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None:
            _check_capacity(self.name, capacity)
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self._own_pop = not self.overrides(LRUBlocks, "victims", "victims_except")

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def _tracked_count(self, keys: Sequence[Hashable]) -> int:
        return sum(map(self._order.__contains__, keys))

    def on_insert(self, info: BlockInfo, now: float) -> None:
        if info.key in self._order:
            raise already_tracked(self, info.key)
        self._order[info.key] = None

    def _insert_key(self, key: Hashable) -> None:
        """``on_insert`` of an exact LRUBlocks, which reads only the key."""
        if key in self._order:
            raise already_tracked(self, key)
        self._order[key] = None

    def on_hit(self, info: BlockInfo, now: float) -> None:
        try:
            self._order.move_to_end(info.key)
        except KeyError:
            raise not_tracked(self, "on_hit", info.key) from None

    def on_remove(self, key: Hashable) -> None:
        try:
            del self._order[key]
        except KeyError:
            raise not_tracked(self, "on_remove", key) from None

    def victims(self, now: float) -> Iterator[Hashable]:
        yield from self._order

    # batch hooks: the same work as the per-event hooks, in one loop (a subclass that
    # changes a per-event hook gets the base class's defaults, which call it)

    def on_commit(self, keys: Sequence[Hashable], hits: Sequence[Hashable],
                  depths: Sequence[int], get: Callable[[Hashable], BlockInfo],
                  now: float) -> None:
        if self.overrides(LRUBlocks, "on_request", "on_hit"):
            return super().on_commit(keys, hits, depths, get, now)
        check_batch(self, "on_hit", hits, True, repeats=True)
        to_end = self._order.move_to_end
        for k in hits:
            try:
                to_end(k)
            except KeyError:
                raise not_tracked(self, "on_hit", k) from None

    def on_publish(self, keys: Sequence[Hashable], depth: int, room: Callable[[], int],
                   insert: Callable[[Sequence[Hashable]], int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> tuple[int, bool]:
        if self.overrides(LRUBlocks, "admit", "on_insert", "on_insert_key"):
            return super().on_publish(keys, depth, room, insert, get, now)
        # admit is always True and the order of the others does not depend on the new
        # blocks (mapped while they arrive): all in one call, room made as needed
        n = insert(keys)
        if n:
            self.on_inserts(keys[:n], range(depth, depth + n), get, now)
        return n, False

    def pop_victim(self, now: float, *busy: Container) -> Hashable | None:
        if not self._own_pop:
            return super().pop_victim(now, *busy)
        return _first_free(self._order, busy)

    def on_removes(self, keys: Sequence[Hashable]) -> None:
        if self.overrides(LRUBlocks, "on_remove"):
            return super().on_removes(keys)
        check_batch(self, "on_remove", keys, True)
        self._removes(keys)

    def _removes(self, keys: Sequence[Hashable]) -> None:
        if self.overrides(LRUBlocks, "on_remove"):
            return super()._removes(keys)
        order = self._order
        for k in keys:
            try:
                del order[k]
            except KeyError:
                raise not_tracked(self, "on_remove", k) from None

    def on_inserts(self, keys: Sequence[Hashable], depths: Sequence[int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> None:
        if self.overrides(LRUBlocks, "on_insert", "on_insert_key", "__contains__",
                          "_tracked_count"):
            return super().on_inserts(keys, depths, get, now)
        check_batch(self, "on_insert", keys, False)  # none tracked, none twice
        order = self._order
        for k in keys:
            order[k] = None


class ARCBlocks(BlockPolicy):
    """Adaptive Replacement Cache: recency list T1, frequency list T2, ghosts B1/B2, target p."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = _check_capacity(self.name, capacity)
        self.p = 0.0
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._incoming_in_b2 = False
        self._own_pop = not self.overrides(ARCBlocks, "victims", "victims_except")
        self._own_len = not self.overrides(ARCBlocks, "__len__")

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def _tracked_count(self, keys: Sequence[Hashable]) -> int:
        return sum(map(self._t1.__contains__, keys)) + sum(map(self._t2.__contains__, keys))

    def admit(self, key: Hashable, depth: int, now: float) -> bool:
        self._incoming_in_b2 = key in self._b2
        return True

    def on_insert(self, info: BlockInfo, now: float) -> None:
        self._insert(info.key)

    def on_publish(self, keys: Sequence[Hashable], depth: int, room: Callable[[], int],
                   insert: Callable[[Sequence[Hashable]], int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> tuple[int, bool]:
        if self.overrides(ARCBlocks, "admit", "on_insert", "on_insert_key", "on_inserts"):
            return super().on_publish(keys, depth, room, insert, get, now)
        # admit answers True; what it records (the block is a B2 ghost) only steers a
        # victim chosen before the block is inserted, and none is while there is room
        return self.publish_room(keys, depth, room, insert, get, now)

    def on_inserts(self, keys: Sequence[Hashable], depths: Sequence[int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> None:
        if self.overrides(ARCBlocks, "on_insert", "on_insert_key", "_insert", "_trim", "__len__",
                          "__contains__", "_tracked_count"):
            return super().on_inserts(keys, depths, get, now)
        check_batch(self, "on_insert", keys, False)
        # _insert of each, inline: the same lists, target and trimming after each (the
        # lists' lengths followed in locals)
        c, c2 = self.capacity, 2 * self.capacity
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        pop1, pop2 = b1.popitem, b2.popitem
        n1, n2, g1, g2 = len(t1), len(t2), len(b1), len(b2)
        for k in keys:  # check_batch: none tracked, none twice
            if k in b1:
                self.p = min(float(c), self.p + max(g2 / g1, 1.0))
                del b1[k]
                t2[k] = None
                g1 -= 1
                n2 += 1
            elif k in b2:
                self.p = max(0.0, self.p - max(g1 / g2, 1.0))
                del b2[k]
                t2[k] = None
                g2 -= 1
                n2 += 1
            else:
                t1[k] = None
                n1 += 1
            self._incoming_in_b2 = False
            while g1 and n1 + g1 > c:
                pop1(last=False)
                g1 -= 1
            while g2 and n1 + n2 + g1 + g2 > c2:
                pop2(last=False)
                g2 -= 1

    def on_removes(self, keys: Sequence[Hashable]) -> None:
        if self.overrides(ARCBlocks, "on_remove", "_trim", "__len__"):
            return super().on_removes(keys)
        check_batch(self, "on_remove", keys, True)
        self._removes(keys)

    def _removes(self, keys: Sequence[Hashable]) -> None:
        if self.overrides(ARCBlocks, "on_remove", "_trim", "__len__"):
            return super()._removes(keys)
        # on_remove of each, inline: to its ghost list, trimming after each
        c, c2 = self.capacity, 2 * self.capacity
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        pop1, pop2 = b1.popitem, b2.popitem
        n1, n2, g1, g2 = len(t1), len(t2), len(b1), len(b2)
        for key in keys:
            if key in t1:
                del t1[key]
                b1[key] = None
                n1 -= 1
                g1 += 1
            elif key in t2:
                del t2[key]
                b2[key] = None
                n2 -= 1
                g2 += 1
            else:
                raise not_tracked(self, "on_remove", key)
            while g1 and n1 + g1 > c:
                pop1(last=False)
                g1 -= 1
            while g2 and n1 + n2 + g1 + g2 > c2:
                pop2(last=False)
                g2 -= 1

    def _insert(self, k: Hashable) -> None:
        c = self.capacity
        if k in self._t1 or k in self._t2:
            raise already_tracked(self, k)
        if k in self._b1:
            self.p = min(float(c), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[k]
            self._t2[k] = None
        elif k in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[k]
            self._t2[k] = None
        else:
            self._t1[k] = None
        self._incoming_in_b2 = False
        self._trim()

    def on_hit(self, info: BlockInfo, now: float) -> None:
        k = info.key
        if k in self._t1:
            del self._t1[k]
        elif k in self._t2:
            del self._t2[k]
        else:
            raise not_tracked(self, "on_hit", k)
        self._t2[k] = None

    def on_remove(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            raise not_tracked(self, "on_remove", key)
        self._trim()

    def _trim(self) -> None:
        c = self.capacity
        b1, b2 = self._b1, self._b2
        if b1:
            n1 = len(self._t1)
            while b1 and n1 + len(b1) > c:
                b1.popitem(last=False)
        if not self._own_len:  # a subclass's len(), asked each time
            while b2 and len(self) + len(b1) + len(b2) > 2 * c:
                b2.popitem(last=False)
        elif b2:
            n = len(self._t1) + len(self._t2) + len(b1)  # the loop changes only b2
            while b2 and n + len(b2) > 2 * c:
                b2.popitem(last=False)

    def victims(self, now: float) -> Iterator[Hashable]:
        t1 = len(self._t1)
        if t1 and (t1 > self.p or (self._incoming_in_b2 and t1 == int(self.p))):
            yield from self._t1
            yield from self._t2
        else:
            yield from self._t2
            yield from self._t1

    def pop_victim(self, now: float, *busy: Container) -> Hashable | None:
        """The first of ``victims_except``, without a generator."""
        if not self._own_pop:
            return super().pop_victim(now, *busy)
        t1 = len(self._t1)
        if t1 and (t1 > self.p or (self._incoming_in_b2 and t1 == int(self.p))):
            lists = (self._t1, self._t2)
        else:
            lists = (self._t2, self._t1)
        for lst in lists:
            k = _first_free(lst, busy)
            if k is not None:
                return k
        return None

    def on_commit(self, keys: Sequence[Hashable], hits: Sequence[Hashable],
                  depths: Sequence[int], get: Callable[[Hashable], BlockInfo],
                  now: float) -> None:
        if self.overrides(ARCBlocks, "on_request", "on_hit"):
            return super().on_commit(keys, hits, depths, get, now)
        check_batch(self, "on_hit", hits, True, repeats=True)
        t1, t2 = self._t1, self._t2
        for k in hits:
            if k in t1:
                del t1[k]
            elif k in t2:
                del t2[k]
            else:
                raise not_tracked(self, "on_hit", k)
            t2[k] = None


class S3FIFOBlocks(BlockPolicy):
    """S3-FIFO: a small FIFO (10%) that filters one-hit blocks, a main FIFO with
    reinsertion, and a ghost FIFO of blocks evicted from the small queue."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        self.capacity = _check_capacity(self.name, capacity)
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"s3fifo: small_fraction must be in (0, 1), got {small_fraction!r}")
        self._small_target = max(1, int(capacity * small_fraction))
        self._ghost_cap = max(1, capacity - self._small_target)
        self._s: OrderedDict[Hashable, int] = OrderedDict()
        self._m: OrderedDict[Hashable, int] = OrderedDict()
        self._g: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._s) + len(self._m)

    def __contains__(self, key: object) -> bool:
        return key in self._s or key in self._m

    def _tracked_count(self, keys: Sequence[Hashable]) -> int:
        return sum(map(self._s.__contains__, keys)) + sum(map(self._m.__contains__, keys))

    def on_insert(self, info: BlockInfo, now: float) -> None:
        self._insert_key(info.key)

    def _insert_key(self, k: Hashable) -> None:
        """``on_insert``, which reads only the key."""
        if k in self._s or k in self._m:
            raise already_tracked(self, k)
        if k in self._g:
            del self._g[k]
            self._m[k] = 0
        else:
            self._s[k] = 0

    def on_hit(self, info: BlockInfo, now: float) -> None:
        k = info.key
        q = self._s if k in self._s else self._m
        try:
            q[k] = min(q[k] + 1, 3)
        except KeyError:
            raise not_tracked(self, "on_hit", k) from None

    def on_commit(self, keys: Sequence[Hashable], hits: Sequence[Hashable],
                  depths: Sequence[int], get: Callable[[Hashable], BlockInfo],
                  now: float) -> None:
        if self.overrides(S3FIFOBlocks, "on_request", "on_hit"):
            return super().on_commit(keys, hits, depths, get, now)
        check_batch(self, "on_hit", hits, True, repeats=True)
        s, m = self._s, self._m
        for k in hits:
            q = s if k in s else m
            try:
                q[k] = min(q[k] + 1, 3)
            except KeyError:
                raise not_tracked(self, "on_hit", k) from None

    def on_publish(self, keys: Sequence[Hashable], depth: int, room: Callable[[], int],
                   insert: Callable[[Sequence[Hashable]], int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> tuple[int, bool]:
        if self.overrides(S3FIFOBlocks, "admit", "on_insert", "on_insert_key", "on_inserts"):
            return super().on_publish(keys, depth, room, insert, get, now)
        return self.publish_room(keys, depth, room, insert, get, now)  # admit: always True

    def on_inserts(self, keys: Sequence[Hashable], depths: Sequence[int],
                   get: Callable[[Hashable], BlockInfo], now: float) -> None:
        if self.overrides(S3FIFOBlocks, "on_insert", "on_insert_key", "__contains__",
                          "_tracked_count"):
            return super().on_inserts(keys, depths, get, now)
        check_batch(self, "on_insert", keys, False)
        s, m, g = self._s, self._m, self._g
        for k in keys:  # check_batch: none tracked, none twice
            if k in g:
                del g[k]
                m[k] = 0
            else:
                s[k] = 0

    def on_remove(self, key: Hashable) -> None:
        if key in self._s:
            del self._s[key]
            self._g[key] = None
            while len(self._g) > self._ghost_cap:
                self._g.popitem(last=False)
        else:
            try:
                del self._m[key]
            except KeyError:
                raise not_tracked(self, "on_remove", key) from None

    def on_removes(self, keys: Sequence[Hashable]) -> None:
        if self.overrides(S3FIFOBlocks, "on_remove"):
            return super().on_removes(keys)
        check_batch(self, "on_remove", keys, True)
        self._removes(keys)

    def _removes(self, keys: Sequence[Hashable]) -> None:
        if self.overrides(S3FIFOBlocks, "on_remove"):
            return super()._removes(keys)
        # on_remove of each, inline: one from the small queue becomes a ghost
        s, m, g = self._s, self._m, self._g
        cap, pop = self._ghost_cap, g.popitem
        for key in keys:
            if key in s:
                del s[key]
                g[key] = None
                while len(g) > cap:
                    pop(last=False)
            else:
                try:
                    del m[key]
                except KeyError:
                    raise not_tracked(self, "on_remove", key) from None

    def pop_victim(self, now: float, *busy: Container) -> Hashable | None:
        """The first of ``victims_except``, without a generator: the same queue moves
        before it, and none after (the caller takes it)."""
        if self.overrides(S3FIFOBlocks, "victims", "victims_except", "__len__"):
            return super().pop_victim(now, *busy)
        s, m = self._s, self._m
        # victims offers each key once (``offered``), so victims_except's bound of
        # len(self) + 1 keys is never reached
        offered: set[Hashable] = set()
        free = _free_test(busy)
        while s or m:
            if s and (len(s) >= self._small_target or not m):
                k, f = next(iter(s.items()))
                if f > 0:  # read again while in the small queue: promote
                    del s[k]
                    m[k] = 0
                    continue
                offered.add(k)
                if free(k):
                    return k
                del s[k]  # refused (mapped or moving): it goes on to the main queue
                m[k] = f
            else:
                k, f = next(iter(m.items()))
                if k in offered:
                    break  # went round once: offer the rest without reordering
                if f > 0:
                    m.move_to_end(k)
                    m[k] = f - 1
                    continue
                offered.add(k)
                if free(k):
                    return k
                m.move_to_end(k)
        for k in [*s, *m]:
            if k not in offered:
                offered.add(k)
                if free(k):
                    return k
        return None

    def victims(self, now: float) -> Iterator[Hashable]:
        s, m = self._s, self._m
        offered: set[Hashable] = set()
        while s or m:
            if s and (len(s) >= self._small_target or not m):
                k, f = next(iter(s.items()))
                if f > 0:  # read again while in the small queue: promote
                    del s[k]
                    m[k] = 0
                    continue
                offered.add(k)
                yield k
                del s[k]  # refused (mapped or moving): it goes on to the main queue
                m[k] = f
            else:
                k, f = next(iter(m.items()))
                if k in offered:
                    break  # went round once: offer the rest without reordering
                if f > 0:
                    m.move_to_end(k)
                    m[k] = f - 1
                    continue
                offered.add(k)
                yield k
                m.move_to_end(k)
        for k in [*s, *m]:
            if k not in offered:
                offered.add(k)
                yield k
