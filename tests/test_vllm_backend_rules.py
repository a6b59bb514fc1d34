"""The two questions the vLLM manager asks of ``BlockRules`` beyond the cache's: a victim
passing over keys it cannot let go of now (``victim(..., skip=...)``), and whether a
block the index does not hold yet is admitted at a given depth (``admits(..., depth=...)``)."""

from __future__ import annotations

import random

from tiering.policies.blocks import LRUBlocks
from tiering.resources.kv_prefix_rules import BlockRules

from tiering.blocks import BlockIndex
from tiering.integrations.vllm._rules import VllmDevice
from tiering.types import Tier


class _Asked(LRUBlocks):
    """lru, recording every ``admit`` question (key, depth) and admitting all."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.asked: list[tuple[bytes, int]] = []

    def admit(self, key, depth, now):
        self.asked.append((key, depth))
        return True


def _rules(n: int, seed: int) -> tuple[BlockRules, list[bytes]]:
    """Rules over an index holding ``n`` random host blocks (chain roots), oldest first."""
    rng = random.Random(seed)
    keys = [rng.randbytes(12) for _ in range(n)]
    index = BlockIndex()
    rules = BlockRules(index, {Tier.DEVICE: VllmDevice(), Tier.HOST: _Asked(n),
                               Tier.DISK: _Asked(n)})
    for i, k in enumerate(keys):
        assert index.insert(k, None, Tier.HOST, i, float(i))  # roots: each may leave
        rules.arrived(k, Tier.HOST, float(i))
    return rules, keys


def test_victim_passes_over_skipped_keys_and_changes_nothing():
    rules, keys = _rules(5, seed=71)
    now = 10.0
    assert rules.victim(Tier.HOST, now) == keys[0]  # the control: lru's first
    assert rules.victim(Tier.HOST, now, skip={keys[0]}) == keys[1]
    assert rules.victim(Tier.HOST, now, skip=set(keys[:3])) == keys[3]
    assert rules.victim(Tier.HOST, now, skip=set(keys)) is None
    # asking moved nothing: the policy still offers its first again, and tracks all five
    assert rules.victim(Tier.HOST, now) == keys[0]
    assert len(rules.policies[Tier.HOST]) == 5 and rules.check() == []


def test_victim_with_skip_still_refuses_a_pinned_block():
    rules, keys = _rules(4, seed=72)
    rules.index.acquire(keys[1])  # a load pins it: the index refuses it, skip or not
    assert rules.victim(Tier.HOST, 10.0, skip={keys[0]}) == keys[2]


def test_admits_asks_the_policy_at_the_depth_given_for_a_block_not_indexed():
    rules, keys = _rules(3, seed=73)
    disk = rules.policies[Tier.DISK]
    new = random.Random(74).randbytes(12)
    assert new not in rules.index
    assert rules.admits(Tier.DISK, new, 10.0, depth=6)
    assert rules.admits(Tier.DISK, keys[2], 10.0)  # held: its depth read from the index
    assert disk.asked == [(new, 6), (keys[2], rules.index.depth(keys[2]))]


class _Offers(LRUBlocks):
    """lru that offers a block the index does not hold first: a policy's defect."""

    def victims_except(self, now, *busy):
        yield b"not-indexed"
        yield from super().victims_except(now, *busy)


def test_a_skip_keeps_the_index_checking_a_policy_of_ones_own():
    """Rules built for a user's policy (``plain=False``) check every key it offers, a skip
    or not: an offer the index does not hold is named, never handed back as a victim."""
    import pytest

    for plain, policy in ((False, _Asked), (False, _Offers)):
        rng = random.Random(73)
        keys = [rng.randbytes(12) for _ in range(4)]
        index = BlockIndex()
        rules = BlockRules(index, {Tier.DEVICE: VllmDevice(), Tier.HOST: policy(4),
                                   Tier.DISK: _Asked(4)}, plain=plain)
        for i, k in enumerate(keys):
            assert index.insert(k, None, Tier.HOST, i, float(i))
            rules.arrived(k, Tier.HOST, float(i))
        if policy is _Asked:  # the control: a sound policy's skip works on this path too
            assert rules.victim(Tier.HOST, 10.0, skip={keys[0]}) == keys[1]
        else:
            with pytest.raises(RuntimeError, match="not in the index"):
                rules.victim(Tier.HOST, 10.0, skip={keys[0]})
