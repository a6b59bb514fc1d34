"""Every registered block policy passes the shared contract; the contract catches bad policies."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from policies.blocks import (
    BlockPolicy,
    default_block_registry,
    make_block_policy,
    register_block_policy,
)
from policies.blocks.generic import LRUBlocks
from tiering.testing.blocks import check_block_policy

NAMES = default_block_registry().names


def test_registry_holds_the_four_policies():
    assert set(NAMES) == {"lru", "arc", "s3fifo", "chain"}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_contract(name, seed):
    check_block_policy(lambda **kw: make_block_policy(name, **kw), seed=seed)


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="'nope'"):
        make_block_policy("nope", capacity=3)


def test_register_returns_a_new_registry():
    base = default_block_registry()
    reg = register_block_policy("mine", LRUBlocks, base)
    assert "mine" in reg and "mine" not in base
    with pytest.raises(ValueError, match="already registered"):
        reg.with_policy("mine", LRUBlocks)


class _ForgetsRemovals(LRUBlocks):
    """Broken: never forgets a removed block, so it offers blocks that are gone."""

    def on_remove(self, key):
        pass


class _EvictsNewest(BlockPolicy):
    """Broken: offers only the block inserted last, never the others."""

    name = "newest-only"

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._keys: OrderedDict = OrderedDict()

    def __len__(self):
        return len(self._keys)

    def __contains__(self, k):
        return k in self._keys

    def on_insert(self, info, now):
        self._keys[info.key] = None

    def on_hit(self, info, now):
        pass

    def on_remove(self, key):
        del self._keys[key]

    def victims(self, now):
        if self._keys:
            yield next(reversed(self._keys))


class _NoCapacityCheck(LRUBlocks):
    def __init__(self, capacity):
        super().__init__(None)


@pytest.mark.parametrize("bad", [_ForgetsRemovals, _EvictsNewest, _NoCapacityCheck])
def test_contract_fails_broken_policies(bad):
    with pytest.raises((AssertionError, RuntimeError, KeyError)):
        check_block_policy(bad)
