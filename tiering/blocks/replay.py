"""Block replay: a trace's block accesses alone, through the block index and a retention policy.

Each request reads the longest cached prefix of its chain of block ids (those
blocks are hits), then inserts or touches every block of its chain, root
first, mapping them for the duration (so nothing it is publishing is evicted
under it). A block the policy refuses stops the chain there: its descendants
could never be matched. The metric is ``hits / accesses`` over all blocks of
all requests (``block_hit_rate``). The same run computes Belady's optimum for
the same trace and capacity (``tiering.blocks.belady``).

    python -m tiering.blocks.replay TRACE --capacity-blocks C --policy P --out DIR

``--policy all`` runs every registered block policy. ``DIR/summary.json``
holds one entry per policy with ``block_hit_rate``, ``belady_hit_rate``,
``of_belady`` and ``of_best_established`` (its rate over the best of the
established policies in ``ESTABLISHED`` that ran, named by ``best_established``);
the printed lines show both ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import NamedTuple

from tiering.blocks.belady import belady_hit_rate
from tiering.blocks.index import BlockIndex
from tiering.blocks.slim import replay_slim, takes_slim
from tiering.policies.blocks import BlockPolicy, BlockPolicyRegistry, default_block_registry
from tiering.types import Tier

__all__ = ["ESTABLISHED", "BlockReplayResult", "load_chains", "main", "replay_blocks"]

#: The established policies a block policy is compared with (``--policy all`` prints each
#: policy's ratio to the best of those it ran).
ESTABLISHED = ("lru", "arc", "s3fifo", "lirs")


class BlockReplayResult(NamedTuple):
    policy: str
    capacity_blocks: int
    requests: int
    accesses: int
    hits: int
    inserted: int
    refused: int  # misses the policy did not admit
    evicted: int
    orphaned: int  # cached descendants dropped with an evicted block
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def load_chains(path: str | Path, limit: int | None = None) -> list[list[int]]:
    """The ``hash_ids`` of every request of a Mooncake-style JSON-lines trace, in order
    (the first ``limit`` requests when given)."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(f"load_chains: limit must be None or an int >= 0, got {limit!r}")
    chains: list[list[int]] = []
    if limit == 0:
        return chains
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["hash_ids"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{path}:{lineno}: not a trace record with hash_ids ({err})"
                ) from err
            if not isinstance(ids, list):
                raise ValueError(
                    f"{path}:{lineno}: hash_ids must be a list, got {type(ids).__name__}"
                )
            for b in ids:
                if type(b) is not int:  # a block id is an int (a list or text would not key)
                    raise ValueError(f"{path}:{lineno}: hash_ids holds {b!r}, not an int")
            chains.append(ids)
            if limit is not None and len(chains) >= limit:
                break
    return chains


def replay_blocks(
    chains: Sequence[Sequence[Hashable]],
    capacity_blocks: int,
    policy: BlockPolicy,
    check_every: int = 0,
    batch: bool = True,
    slim: bool = True,
) -> BlockReplayResult:
    """Replay ``chains`` through one tier of ``capacity_blocks`` blocks under ``policy``.

    ``check_every=n`` checks the tier's tables (``BlockIndex.check_integrity``) and the
    policy's count after every n-th request (tests).
    ``batch``: call the policy's batch hooks (``on_commit`` for each request's cached
    prefix, ``on_publish`` for each run of blocks it lacks, ``pop_victim`` and
    ``on_removes`` per eviction); False calls the per-event hooks one by one. Both
    give the same result.
    ``slim``: with ``batch``, a policy whose class is exactly a built-in generic one
    (``tiering.blocks.slim.SLIM_POLICIES``) runs over the slim loop's tables instead of a
    ``BlockIndex``, with the same hook calls and the same result; False: always the index.
    """
    if not isinstance(capacity_blocks, int) or isinstance(capacity_blocks, bool) or capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be an int >= 1, got {capacity_blocks!r}")
    if batch and slim and takes_slim(policy):
        t0 = time.perf_counter()
        counts = replay_slim(chains, capacity_blocks, policy, check_every)
        return BlockReplayResult(policy.name, capacity_blocks, len(chains), *counts,
                                 time.perf_counter() - t0)
    if batch:
        return _replay_batch(chains, capacity_blocks, policy, check_every)
    t0 = time.perf_counter()
    index = BlockIndex()
    free = list(range(capacity_blocks - 1, -1, -1))
    dev = Tier.DEVICE
    entries = index  # local names for the hot loop
    match_length, touch, insert, acquire, release = (
        index.match_length,
        index.touch,
        index.insert,
        index.acquire,
        index.release,
    )
    on_request, on_hit, admit, on_insert, on_remove = (
        policy.on_request,
        policy.on_hit,
        policy.admit,
        policy.on_insert,
        policy.on_remove,
    )
    hits = accesses = inserted = refused = evicted = orphaned = 0
    for t, chain in enumerate(chains):
        now = float(t)
        accesses += len(chain)
        hits += match_length(chain)
        on_request(chain, now)
        parent = None
        mapped = []
        for depth, key in enumerate(chain):
            if key in entries:
                on_hit(touch(key, now), now)
            else:
                if not admit(key, depth, now):
                    refused += 1
                    break
                if not free:
                    victim = index.choose_victim(policy, now)
                    if victim is None:
                        refused += 1
                        break
                    for d in index.drop(victim):
                        free.append(d.handle)
                        on_remove(d.key)
                        if d.reason == "orphaned":
                            orphaned += 1
                        else:
                            evicted += 1
                if not insert(key, parent, dev, free[-1], now):
                    break  # its parent is gone: the rest of the chain is unreachable
                free.pop()
                acquire(key)  # mapped by the request publishing it, as the batch path does
                on_insert(index.get(key), now)
                inserted += 1
                mapped.append(key)
                parent = key
                continue
            acquire(key)
            mapped.append(key)
            parent = key
        for key in mapped:
            release(key)
        if check_every and t % check_every == 0:
            _check(index, policy)
    return BlockReplayResult(
        policy.name,
        capacity_blocks,
        len(chains),
        accesses,
        hits,
        inserted,
        refused,
        evicted,
        orphaned,
        time.perf_counter() - t0,
    )


def _check(index: BlockIndex, policy: BlockPolicy) -> None:
    index.check_integrity()
    if len(policy) != len(index):
        raise AssertionError(
            f"policy {policy.name!r} tracks {len(policy)} blocks, the index holds {len(index)}"
        )


def _replay_batch(chains, capacity_blocks: int, policy: BlockPolicy,
                  check_every: int) -> BlockReplayResult:
    """``replay_blocks`` through the batch hooks: the same calls, in the same order, as
    the per-event loop, grouped (see ``BlockPolicy``'s batch hooks)."""
    t0 = time.perf_counter()
    index = BlockIndex()
    free = list(range(capacity_blocks - 1, -1, -1))
    dev = Tier.DEVICE
    get = index.get
    refs, dest, below, where = index._refs, index._dest, index._below, index._tier
    entries = where  # key in index, without the method call
    insert_run, drop_run = index.insert_run, index.drop_run
    insert_mapped, evict_leaf = index._insert_mapped, index._evict_leaf
    plain = type(policy).__module__.startswith("tiering.policies.")
    pop_victim, on_removes = policy.pop_victim, policy.on_removes
    hits = accesses = inserted = refused = evicted = orphaned = 0
    now = 0.0
    parent: Hashable | None = None
    stop = False

    def make_room() -> bool:
        """The policy's victim leaves (with its cached descendants); False (``stop`` set)
        when it offers none."""
        nonlocal stop, evicted, orphaned
        victim = pop_victim(now, refs, dest, below) if plain else index.choose_victim(policy, now)
        if victim is None:
            stop = True
            return False
        if evict_leaf(victim, free):  # nearly always: a block with nothing cached below it
            on_removes([victim])
            evicted += 1
            return True
        if plain and where.get(victim) is None:
            raise RuntimeError(f"policy {policy.name!r} offered block {victim!r}, "
                               "which is not in the index")
        out = drop_run(victim)
        free.extend(out.handles)
        on_removes(out.keys)
        evicted += 1
        orphaned += len(out.keys) - 1
        return True

    def insert(run: Sequence[Hashable]) -> int:
        """The blocks of ``run`` into the index after ``parent``, mapped, as many as room
        is found for; how many went in. All the room first, then one insert: the same
        victims as making room each time the tier fills, since the policy tracks none of
        the new blocks yet and they hold no block that was free (``parent`` is mapped)."""
        nonlocal parent
        want = len(run)
        if want == 1:  # the common case: room for one block, made once at most
            if not free and not make_room():
                return 0
            k = 1
        else:
            while len(free) < want and make_room():
                pass
            k = min(want, len(free))
        if k == 1:
            key = run[0]
            if not insert_mapped(key, parent, dev, free[-1], now):
                return 0
            free.pop()
            parent = key
            return 1
        if not k:
            return 0
        part = run if k == want else run[:k]
        handles = free[len(free) - k:][::-1]  # what free.pop() would hand out, in turn
        if not insert_run(part, parent, dev, handles, now, True):
            return 0  # its parent is gone: the rest of the chain is unreachable
        del free[len(free) - k:]
        parent = part[-1]
        return k

    match_length, touch_many, depths = index.match_length, index.touch_many, index.depths
    acquire_many, release_many, node = index.acquire_many, index.release_many, index._node
    on_commit, on_publish, room = policy.on_commit, policy.on_publish, free.__len__
    for t, chain in enumerate(chains):
        now = float(t)
        n = len(chain)
        accesses += n
        m = match_length(chain)
        hits += m
        if m:
            prefix = chain[:m] if m < n else chain
            touch_many(prefix, now)
            on_commit(chain, prefix, depths(prefix), get, now)
            acquire_many(prefix)
            parent = chain[m - 1]
        else:
            on_commit(chain, chain[:0], [], get, now)
            parent = None
        i = m
        while i < n:  # the rest: runs of blocks the index lacks, and any block it holds
            key = chain[i]
            if key in entries:
                policy.on_hit(index.touch(key, now), now)
                index.acquire(key)
                parent = key
                i += 1
                continue
            j = i + 1
            while j < n and chain[j] not in entries:
                j += 1
            stop = False
            depth = 0 if parent is None else node[parent][1] + 1
            got, no = on_publish(chain[i:j], depth, room, insert, get, now)
            inserted += got
            if no or stop:
                refused += 1
            if got < j - i:
                i += got
                break
            i = j
        release_many(chain if i == n else chain[:i])
        if check_every and t % check_every == 0:
            _check(index, policy)
    return BlockReplayResult(policy.name, capacity_blocks, len(chains), accesses, hits,
                             inserted, refused, evicted, orphaned, time.perf_counter() - t0)


def run_policies(
    chains: Sequence[Sequence[Hashable]],
    capacity_blocks: int,
    names: Sequence[str],
    registry: BlockPolicyRegistry | None = None,
) -> dict[str, BlockReplayResult]:
    registry = registry or default_block_registry()
    return {
        n: replay_blocks(chains, capacity_blocks, registry.make(n, capacity=capacity_blocks))
        for n in names
    }


def main(argv: Sequence[str] | None = None) -> int:
    registry = default_block_registry()
    ap = argparse.ArgumentParser(
        prog="python -m tiering.blocks.replay",
        description="Replay a trace's block accesses through the block index and a retention policy.",
    )
    ap.add_argument("trace", help="Mooncake-style JSON lines with hash_ids")
    ap.add_argument("--capacity-blocks", type=int, required=True, help="blocks the tier holds")
    ap.add_argument("--policy", default="all", help=f"one of {', '.join(registry.names)}, or all")
    ap.add_argument("--out", required=True, help="directory for summary.json")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    args = ap.parse_args(argv)
    if args.capacity_blocks < 1:
        ap.error(f"--capacity-blocks must be >= 1, got {args.capacity_blocks}")
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be >= 1, got {args.limit}")
    names = registry.names if args.policy == "all" else (args.policy,)
    for n in names:
        if n not in registry:
            ap.error(
                f"--policy: unknown block policy {n!r}; known: {', '.join(registry.names)}, all"
            )
    chains = load_chains(args.trace, args.limit)
    gc.freeze()  # the chains live all run: the collector need not walk them
    results = run_policies(chains, args.capacity_blocks, names, registry)
    belady = belady_hit_rate(chains, args.capacity_blocks)
    # the best of the established policies run here: what a policy must at least match
    est = [n for n in ESTABLISHED if n in results]
    best = max(est, key=lambda n: results[n].hit_rate) if est else None
    best_rate = results[best].hit_rate if best else 0.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "trace": str(args.trace),
        "requests": len(chains),
        "capacity_blocks": args.capacity_blocks,
        "belady_hit_rate": belady.hit_rate,
        "belady_plain_hit_rate": belady_hit_rate(
            chains, args.capacity_blocks, prefix_ties=False
        ).hit_rate,
        "policies": {
            n: {
                "block_hit_rate": r.hit_rate,
                "belady_hit_rate": belady.hit_rate,
                "of_belady": r.hit_rate / belady.hit_rate if belady.hit_rate else None,
                "of_best_established": r.hit_rate / best_rate if best_rate else None,
                "hits": r.hits,
                "accesses": r.accesses,
                "inserted": r.inserted,
                "refused": r.refused,
                "evicted": r.evicted,
                "orphaned": r.orphaned,
                "seconds": r.seconds,
            }
            for n, r in results.items()
        },
    }
    summary["best_established"] = best
    if len(names) == 1:
        summary["block_hit_rate"] = results[names[0]].hit_rate
        summary["policy"] = names[0]
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print(
        f"{len(chains)} requests, {results[names[0]].accesses} block accesses, capacity {args.capacity_blocks} blocks"
    )
    print(f"  {'belady':>8}  {belady.hit_rate:.4f}")
    vs_best = f" of best established ({best})" if best else ""
    for n, r in results.items():
        of_best = f", {r.hit_rate / best_rate:.3f}{vs_best}" if best_rate else ""
        print(
            f"  {n:>8}  {r.hit_rate:.4f}  ({r.hit_rate / belady.hit_rate if belady.hit_rate else 0:.3f} of belady{of_best}, {r.seconds:.2f} s)"
        )
    print(f"wrote {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
