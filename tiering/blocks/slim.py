"""The block replay's slim loop: ``replay_blocks`` for the built-in generic policies.

``replay_blocks`` keeps its tier in a ``BlockIndex``, which holds everything a
store needs: tiers, handles, moves in flight, reference counts per block and the
held-children counts that make a block's evictability O(1) for any caller. The
replay needs far less: one tier, one request live at a time, and no handles (a
result never names one). This loop keeps only that, for a policy whose class is
exactly one of ``SLIM_POLICIES`` (not a subclass: a subclass may read what the
index would tell it, and takes the index's path):

- ``node``: every cached block's ``(parent, depth, first use, line)``;
- lines: a block's ``line`` is a list of cached blocks, each the parent of the
  next, that it belongs to: a run of new blocks inserted together starts one, or
  goes on with its parent's when the parent is the last of its line and has no
  other child. A block's children are the next block of its line unless
  ``branch`` says otherwise: there a block whose one child starts another line
  has that child, and a block with two or more children their set, built and
  emptied by the same steps as the index's, so a dropped subtree leaves in the
  same order. Inserting a run and dropping a line below a block cost a slice of
  the line, not a step per block;
- ``hits`` and ``last``: the hit count and last use of the blocks read again;
- ``held``: the blocks the live request maps and every block above one of them,
  the blocks no victim may be (the index's mapped blocks and those with a mapped
  block below). A request maps a chain root first, so ``held`` is the part of
  its chain served so far, and a block is added as the request reaches it.

The policy makes every decision through the same batch hooks, called in the same
order with the same arguments as ``replay_blocks``' index path (``on_commit``,
``on_publish`` with ``room`` and ``insert``, ``pop_victim``, ``on_removes``,
``on_hit``), and each snapshot ``get`` builds is the one the index would build,
so the results and the eviction sequence are the same (the tests replay both).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from itertools import chain as _then
from itertools import islice, repeat

from tiering.policies.blocks import (
    ARCBlocks,
    BlockInfo,
    BlockPolicy,
    LIRSBlocks,
    LRUBlocks,
    S3FIFOBlocks,
)

__all__ = ["SLIM_POLICIES", "replay_slim", "takes_slim"]

#: The policy classes the slim loop serves: the built-in generic policies, whose hooks
#: read a block's key and nothing the index alone knows.
SLIM_POLICIES = (LRUBlocks, ARCBlocks, S3FIFOBlocks, LIRSBlocks)

_new = tuple.__new__
_NOTHING: frozenset = frozenset()  # the containers of busy blocks the index has and this loop has not


def takes_slim(policy: object) -> bool:
    """Whether ``replay_blocks`` runs ``policy`` through the slim loop: its class is
    exactly one of ``SLIM_POLICIES``."""
    return type(policy) in SLIM_POLICIES


def replay_slim(chains: Sequence[Sequence[Hashable]], capacity: int, policy: BlockPolicy,
                check_every: int = 0) -> tuple[int, int, int, int, int, int]:
    """``replay_blocks``' index path over the slim tables (module docstring): the
    counts ``(accesses, hits, inserted, refused, evicted, orphaned)``.

    ``check_every=n`` checks the tables and the policy's count after every n-th
    request (AssertionError naming what is wrong)."""
    node: dict[Hashable, tuple[Hashable | None, int, float, list]] = {}
    branch: dict[Hashable, Hashable | set] = {}
    hits_of: dict[Hashable, int] = {}
    last: dict[Hashable, float] = {}
    held: set[Hashable] = set()
    # the blocks of ``held`` the live request does not map exactly once: 0 (held only
    # for a mapped block below) or the times it maps one its chain reads twice
    odd: dict[Hashable, int] = {}
    hits = accesses = inserted = refused = evicted = orphaned = 0
    now = 0.0
    parent: Hashable | None = None
    stop = False
    pop_victim, on_removes = policy.pop_victim, policy.on_removes
    on_commit, on_publish, on_hit = policy.on_commit, policy.on_publish, policy.on_hit
    name = policy.name
    cached_keys = node.keys()

    def get(key: Hashable) -> BlockInfo | None:
        """The block's snapshot, as ``BlockIndex.get`` builds it."""
        rec = node.get(key)
        if rec is None:
            return None
        up, depth, first, line = rec
        c = branch.get(key)
        return _new(BlockInfo, (
            key, up, depth, odd.get(key, 1) if key in held else 0, hits_of.get(key, 0),
            first, last.get(key, first),
            (0 if line[-1] == key else 1) if c is None else (len(c) if c.__class__ is set else 1),
        ))

    def next_in_line(key: Hashable) -> Hashable | None:
        """The block after ``key`` in its line (None: it is the last)."""
        _, depth, _, line = node[key]
        i = depth - node[line[0]][1] + 1
        return line[i] if i < len(line) else None

    def room() -> int:
        return capacity - len(node)

    def hold_above(key: Hashable) -> None:
        """The blocks above ``key`` (held now) are held too; ``odd`` counts them as unmapped."""
        p = node[key][0]
        while p is not None and p not in held:
            held.add(p)
            odd[p] = 0
            p = node[p][0]

    def map_one(key: Hashable) -> None:
        """The live request maps ``key``, a cached block (a hit after a miss)."""
        if key in held:
            n = odd.get(key, 1) + 1
            if n == 1:
                del odd[key]
            else:
                odd[key] = n
        else:
            held.add(key)
            hold_above(key)

    def unlink(key: Hashable, up: Hashable | None) -> None:
        """``key`` is no longer among ``up``'s cached children (its line cut first)."""
        if up is None:
            return
        pk = branch.get(up)
        if pk is None:
            return  # it was the next in ``up``'s line: the cut took it
        if pk.__class__ is set:
            pk.discard(key)
            if len(pk) == 1:
                c = next(iter(pk))
                if next_in_line(up) == c:
                    del branch[up]
                else:
                    branch[up] = c
        else:
            del branch[up]

    def link(up: Hashable, key: Hashable) -> None:
        """``key``, the first block of a new line, is a cached child of ``up``, which has
        one at least."""
        pk = branch.get(up)
        if pk is None:
            branch[up] = {next_in_line(up), key}
        elif pk.__class__ is set:
            pk.add(key)
        else:
            branch[up] = {pk, key}

    def line_for(up: Hashable | None, first: Hashable) -> list:
        """The line new blocks after ``up`` join: ``up``'s, when it has no child;
        else a new one, ``first`` linked below ``up``."""
        if up is not None:
            line = node[up][3]
            if line[-1] == up and up not in branch:
                return line
            link(up, first)
        return []

    def make_room() -> bool:
        """The policy's victim leaves with its cached descendants, deepest first; False
        (``stop`` set) when it offers none."""
        nonlocal stop, evicted, orphaned
        victim = pop_victim(now, held, _NOTHING, _NOTHING)
        if victim is None:
            stop = True
            return False
        rec = node.get(victim)
        if rec is None:
            raise RuntimeError(f"policy {name!r} offered block {victim!r}, which is not in the index")
        if victim in held:
            raise ValueError(f"drop of block {victim!r}: it is mapped by the live request, "
                             "or a block below it is")
        up, depth, _, line = rec
        i = depth - node[line[0]][1]  # its place in its line
        if i == len(line) - 1 and victim not in branch:  # nearly always: nothing below it
            line.pop()
            unlink(victim, up)
            del node[victim]
            if victim in hits_of:
                del hits_of[victim], last[victim]
            on_removes([victim])
            evicted += 1
            return True
        # its subtree, in the order the index walks it (down a line of only children,
        # then each set of children in its order), deepest first; nothing in it is held
        # (its root is not)
        subtree: list[Hashable] = []
        more = subtree.extend
        stack = [victim]
        take, extend = stack.pop, stack.extend
        forks, fork_of = branch.keys(), branch.pop
        while stack:
            x = take()
            while True:
                _, d, _, ln = node[x]
                tail = ln[d - node[ln[0]][1]:]
                if forks.isdisjoint(tail):  # a line to its end, which has no child
                    more(tail)
                    break
                for j, y in enumerate(tail):  # the first with a branch (one there is)
                    if y in forks:
                        more(tail[:j + 1])
                        break
                c = fork_of(y)
                if c.__class__ is set:
                    extend(c)
                    break
                x = c  # its one child starts another line: down it
        del line[i:]
        unlink(victim, up)
        subtree.reverse()
        for _ in map(node.pop, subtree):
            pass
        if hits_of and not hits_of.keys().isdisjoint(subtree):
            for x in subtree:
                if x in hits_of:
                    del hits_of[x], last[x]
        on_removes(subtree)
        evicted += 1
        orphaned += len(subtree) - 1
        return True

    def insert(run: Sequence[Hashable]) -> int:
        """The blocks of ``run`` into the tier after ``parent``, mapped, as many as room
        is found for; how many went in. All the room first, then the blocks, as the
        index path does."""
        nonlocal parent
        want = len(run)
        if want == 1:
            if len(node) >= capacity and not make_room():
                return 0
            k = 1
        else:
            while capacity - len(node) < want and make_room():
                pass
            k = min(want, capacity - len(node))
            if not k:
                return 0
        up = parent
        if up is None:
            d0 = 0
        else:
            pn = node.get(up)
            if pn is None:
                return 0  # its parent is gone: the rest of the chain is unreachable
            d0 = pn[1] + 1
        if k == 1:
            key = run[0]
            if key in node or key is None:
                raise ValueError(f"insert: block {key!r} is already in the index"
                                 if key is not None else "insert: a block key must not be None")
            line = line_for(up, key)
            line.append(key)
            node[key] = (up, d0, now, line)
            held.add(key)
            parent = key
            return 1
        part = run if k == want else run[:k]
        before = len(node)
        line = line_for(up, part[0])
        line.extend(part)
        node.update(zip(part, zip(_then((up,), part), range(d0, d0 + k), repeat(now),
                                  repeat(line), strict=False), strict=False))
        if len(node) - before != k or None in node:
            _refuse_run(part, held)
        held.update(part)
        parent = part[-1]
        return k

    for t, keys in enumerate(chains):
        now = float(t)
        n = len(keys)
        accesses += n
        m = 0
        for k in keys:
            if k not in node:
                break
            m += 1
        hits += m
        if m:
            prefix = keys[:m] if m < n else keys
            depths = []
            rooted = True  # each block's parent the one before it, the first a root
            up = None
            for k in prefix:  # touched, as the index's touch_many
                hits_of[k] = hits_of.get(k, 0) + 1
                last[k] = now
                rec = node[k]
                depths.append(rec[1])
                if rec[0] != up:
                    rooted = False
                up = k
            on_commit(keys, prefix, depths, get, now)
            held.update(prefix)
            if len(held) != m:  # the chain reads a block twice
                for k, c in Counter(prefix).items():
                    if c > 1:
                        odd[k] = c
            if not rooted:
                for k in prefix:
                    hold_above(k)
            parent = prefix[-1]
        else:
            on_commit(keys, keys[:0], [], get, now)
            parent = None
        i = m
        while i < n:  # the rest: runs of blocks the tier lacks, and any block it holds
            key = keys[i]
            if key in node:
                hits_of[key] = hits_of.get(key, 0) + 1
                last[key] = now
                on_hit(get(key), now)
                map_one(key)
                parent = key
                i += 1
                continue
            if cached_keys.isdisjoint(islice(keys, i + 1, None)):  # one C pass, nearly always
                j = n
            else:  # the next block the tier holds
                j = i + 1
                while keys[j] not in node:
                    j += 1
            stop = False
            depth = 0 if parent is None else node[parent][1] + 1
            got, no = on_publish(keys[i:j], depth, room, insert, get, now)
            inserted += got
            if no or stop:
                refused += 1
            if got < j - i:
                break
            i = j
        held.clear()
        if odd:
            odd.clear()
        if check_every and t % check_every == 0:
            _check(node, branch, hits_of, last, policy, capacity)
    return accesses, hits, inserted, refused, evicted, orphaned


def _refuse_run(part: Sequence[Hashable], held: set) -> None:
    """The ValueError the index raises for a run it refuses: the first block of ``part``
    that is None or already cached (this request's blocks are the only ones a run can
    meet again: ``held`` before the run's own), else a block the run repeats."""
    for key in part:
        if key is None:
            raise ValueError("insert: a block key must not be None")
        if key in held:
            raise ValueError(f"insert: block {key!r} is already in the index")
    raise ValueError(f"insert_run: the run {list(part)[:4]!r}... repeats a block")


def _check(node: dict, branch: dict, hits_of: dict, last: dict, policy: BlockPolicy,
           capacity: int) -> None:
    """The slim tables' rules (a parent is cached, its depth one less, each block in its
    line after its parent or first in it, the children the lines and ``branch`` give
    exactly the parents', at most ``capacity`` blocks) and the policy's count."""
    if len(node) > capacity:
        raise AssertionError(f"{len(node)} blocks cached in a tier of {capacity}")
    below: dict[Hashable, set] = {}
    given: dict[Hashable, set] = {}  # the children the lines and branch give
    for k, (up, depth, _, line) in node.items():
        i = depth - node[line[0]][1] if line and line[0] in node else -1
        if not (0 <= i < len(line) and line[i] == k and (i == 0 or line[i - 1] == up)):
            raise AssertionError(f"block {k!r}: not in its line after its parent")
        if any(node[x][3] is not line for x in (line[0], line[-1])):
            raise AssertionError(f"block {k!r}: its line's ends are in another line")
        b = branch.get(k)
        nxt = {line[i + 1]} if i + 1 < len(line) else set()
        if b is None:
            given[k] = nxt
        elif b.__class__ is set:
            if len(b) < 2 or not nxt <= b:
                raise AssertionError(f"block {k!r}: a set of {len(b)} children without its next")
            given[k] = set(b)
        else:
            if nxt:
                raise AssertionError(f"block {k!r}: one child in branch, and a next in its line")
            given[k] = {b}
        if up is None:
            if depth != 0:
                raise AssertionError(f"block {k!r}: a root block has depth {depth}")
            continue
        pn = node.get(up)
        if pn is None:
            raise AssertionError(f"block {k!r}: its parent {up!r} is not cached")
        if depth != pn[1] + 1:
            raise AssertionError(f"block {k!r}: depth {depth}, parent's {pn[1]}")
        below.setdefault(up, set()).add(k)
    if not branch.keys() <= node.keys():
        raise AssertionError("branch names blocks that are not cached")
    if {p: c for p, c in given.items() if c} != below:
        raise AssertionError("the children table does not match the blocks' parents")
    if set(hits_of) != set(last) or not set(hits_of) <= node.keys():
        raise AssertionError("the hit counts and last uses do not name the same cached blocks")
    if len(policy) != len(node):
        raise AssertionError(
            f"policy {policy.name!r} tracks {len(policy)} blocks, the tier holds {len(node)}")
