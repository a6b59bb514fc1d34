"""The block retention policy contract, as a function a user can run on their own policy.

    from tiering.testing.blocks import check_block_policy
    check_block_policy(lambda capacity: MyPolicy(capacity=capacity))

It raises AssertionError (naming the rule broken; also when the index refuses a block the
policy offered, or a bad capacity raises something other than ValueError) unless the policy:

- rejects a capacity below 1 with a ValueError that names ``capacity``;
- keeps ``len(policy)`` equal to the blocks the index holds after every request
  of a seeded random conversation workload, with ``BlockIndex.check_integrity``
  passing after each one (so it never offered a block that is not cached);
- offers, from ``victims``, only blocks it tracks, every one of them within
  ``len(policy)`` offers, and never a block mapped by a live request once the
  index filters it (``choose_victim`` returns only evictable blocks);
- is deterministic: the same workload gives the same hits, inserts and evictions;
- never beats Belady's optimum for the same workload and capacity, and gets
  some hits on a workload that has reuse (a policy that evicts everything fails).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tiering.blocks.belady import belady_hit_rate
from tiering.blocks.index import BlockIndex
from tiering.blocks.replay import replay_blocks
from tiering.blocks.synth import SynthConfig, synthetic_chains
from tiering.policies.blocks.base import BlockPolicy
from tiering.types import Tier

__all__ = ["check_block_policy"]

PolicyFactory = Callable[..., BlockPolicy]


def _check_rejects_bad_capacity(factory: PolicyFactory) -> None:
    for bad in (0, -3):
        try:
            factory(capacity=bad)
        except ValueError as err:
            if "capacity" not in str(err):
                raise AssertionError(f"capacity={bad}: the error does not name capacity: {err}") from err
        except Exception as err:
            raise AssertionError(
                f"capacity={bad} raised {type(err).__name__} ({err}), not a ValueError naming capacity"
            ) from err
        else:
            raise AssertionError(f"capacity={bad} was accepted")


def _check_victims(factory: PolicyFactory, seed: int) -> None:
    """Fill a tier, pin a random third of it, and ask for victims."""
    rng = random.Random(seed)
    capacity = 60
    policy = factory(capacity=capacity)
    index = BlockIndex()
    chains = synthetic_chains(40, seed, SynthConfig(gap_median=5.0))
    slot = 0
    for t, chain in enumerate(chains):
        policy.on_request(chain, float(t))
        parent = None
        for depth, key in enumerate(chain):
            if key in index:
                policy.on_hit(index.touch(key, float(t)), float(t))
            elif len(index) < capacity and policy.admit(key, depth, float(t)):
                if not index.insert(key, parent, Tier.DEVICE, slot, float(t)):
                    break
                slot += 1
                policy.on_insert(index.get(key), float(t))
            else:
                break
            parent = key
    tracked = set(index.keys())
    if len(policy) != len(tracked):
        raise AssertionError(f"policy tracks {len(policy)} blocks, the index holds {len(tracked)}")
    offered = []
    gen = policy.victims(float(len(chains)))
    try:
        for k in gen:
            offered.append(k)
            if len(offered) >= len(tracked):
                break
    finally:
        close = getattr(gen, "close", None)  # an Iterator need not be a generator
        if callable(close):
            close()
    if not all(k in tracked for k in offered):
        raise AssertionError(f"victims offered untracked blocks {set(offered) - tracked}")
    if set(offered) != tracked:
        raise AssertionError(
            f"victims did not offer every tracked block within len(policy) offers: missing {len(tracked - set(offered))}"
        )
    if len(policy) != len(tracked):
        raise AssertionError("asking for victims changed what the policy tracks")
    pinned = rng.sample(sorted(tracked), len(tracked) // 3)
    for k in pinned:
        # pinning a block pins its prefix too, as a request mapping it would
        for a in index.chain_keys(k):
            index.acquire(a)
    for _ in range(10):
        v = index.choose_victim(policy, float(len(chains)))
        if v is None:
            break
        if not index.evictable(v):
            raise AssertionError(f"choose_victim returned {v!r}, which may not leave")
        for d in index.drop(v):
            policy.on_remove(d.key)
        index.check_integrity()
        if len(policy) != len(index):
            raise AssertionError("policy and index disagree after an eviction")
    for k in pinned:
        if k not in index:
            raise AssertionError(f"pinned block {k!r} was evicted")


def check_block_policy(factory: PolicyFactory, seed: int = 0, requests: int = 600) -> None:
    """Run the whole contract on ``factory(capacity=...)``; raises AssertionError on a breach
    (a factory that makes something other than a ``BlockPolicy`` is one). The check's own
    arguments are refused by name: a ``factory`` that is not callable (TypeError), a
    ``seed`` that is not an int or ``requests`` that is not an int >= 1 (ValueError)."""
    if not callable(factory):
        raise TypeError(f"check_block_policy: factory must be callable (capacity=... -> a "
                        f"BlockPolicy), got {factory!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"check_block_policy: seed must be an int, got {seed!r}")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ValueError(f"check_block_policy: requests must be an int >= 1, got {requests!r}")
    _check_rejects_bad_capacity(factory)
    made = _policies_of(factory)
    try:
        _check_replays(made, seed, requests)
    except RuntimeError as err:  # the index refused what the policy offered (e.g. a block gone)
        raise AssertionError(f"the policy broke the protocol: {err}") from err


def _policies_of(factory: PolicyFactory) -> PolicyFactory:
    """``factory``, each policy it makes checked to be a ``BlockPolicy``."""
    def make(**kwargs):
        policy = factory(**kwargs)
        if not isinstance(policy, BlockPolicy):
            raise AssertionError(
                f"factory({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) returned "
                f"{type(policy).__name__}, not a BlockPolicy")
        return policy
    return make


def _check_replays(factory: PolicyFactory, seed: int, requests: int) -> None:
    _check_victims(factory, seed)
    chains = synthetic_chains(requests, seed, SynthConfig(gap_median=40.0))
    for capacity in (1, 7, 120):
        a = replay_blocks(chains, capacity, factory(capacity=capacity), check_every=1)
        b = replay_blocks(chains, capacity, factory(capacity=capacity))
        if a[:-1] != b[:-1]:
            raise AssertionError(
                f"capacity {capacity}: two runs of the same workload differ: {a} vs {b}"
            )
        opt = belady_hit_rate(chains, capacity)
        if not (a.hits <= opt.hits):
            raise AssertionError(f"capacity {capacity}: {a.hits} hits beat Belady's {opt.hits}")
        if not (a.hits > 0):
            raise AssertionError(f"capacity {capacity}: no hits at all on a workload with reuse")
