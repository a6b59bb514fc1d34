"""The replay checks a user's block policy at every call and trusts the library's own: the
test of which is which must follow the installed package names."""

from __future__ import annotations

from tiering.policies.blocks import LRUBlocks, default_block_registry, make_block_policy

from tiering.apps.replay.block_guard import is_builtin


def test_every_built_in_block_policy_is_recognised():
    for name in default_block_registry().names:
        assert is_builtin(make_block_policy(name, capacity=8)), name


def test_a_user_policy_is_not_a_built_in():
    mine = type("Mine", (LRUBlocks,), {"__module__": "my_policies.blocks"})
    assert not is_builtin(mine(capacity=8))
    # a module named like the old top-level package is a user's, not ours
    other = type("Other", (LRUBlocks,), {"__module__": "policies.blocks.generic"})
    assert not is_builtin(other(capacity=8))
