"""The contract checks of ``tiering.testing`` run on a user's own code: they judge a policy
that keeps the contract as passing, and one that breaks it with an AssertionError naming the
rule, never by crashing inside the check."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from tiering.policies.blocks.base import BlockPolicy

from tiering.testing import check_block_policy


class _ListLRU(BlockPolicy):
    """Least recently used first; ``victims`` hands back a plain iterator over a list, which
    the protocol allows (an ``Iterator``), not a generator."""

    name = "list-lru"

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.order: OrderedDict = OrderedDict()

    def on_insert(self, info, now):
        self.order[info.key] = None

    def on_hit(self, info, now):
        self.order.move_to_end(info.key)

    def on_remove(self, key):
        self.order.pop(key, None)

    def victims(self, now):
        return iter(list(self.order))

    def __len__(self):
        return len(self.order)


class _NoVictims(_ListLRU):
    def victims(self, now):
        return iter(())


def test_a_policy_whose_victims_is_a_plain_iterator_passes_the_block_contract():
    check_block_policy(_ListLRU, requests=200)


def test_a_policy_that_offers_no_victims_fails_the_block_contract_by_name():
    with pytest.raises(AssertionError, match="victims did not offer every tracked block"):
        check_block_policy(_NoVictims, requests=200)


class _NotAPolicy:
    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")


def test_a_factory_that_makes_no_block_policy_fails_the_contract_by_name():
    """Before: AttributeError ('_NotAPolicy' object has no attribute 'on_request')."""
    with pytest.raises(AssertionError, match="returned _NotAPolicy, not a BlockPolicy"):
        check_block_policy(_NotAPolicy, requests=50)


@pytest.mark.parametrize("args, error, match", [
    (("lru",), TypeError, "factory must be callable"),
    ((_ListLRU,), ValueError, "requests must be an int >= 1"),
])
def test_the_block_contract_refuses_its_own_bad_arguments_by_name(args, error, match):
    """Before: check_block_policy("lru") failed as if the policy broke the capacity rule,
    and requests=0 as if it got no hits."""
    kwargs = {"requests": 0} if args[0] is _ListLRU else {}
    with pytest.raises(error, match=match):
        check_block_policy(*args, **kwargs)
    with pytest.raises(ValueError, match="seed must be an int"):
        check_block_policy(_ListLRU, seed="x", requests=50)
