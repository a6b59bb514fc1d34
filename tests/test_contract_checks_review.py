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
