"""A batch hook given a block it cannot take raises ValueError and changes nothing.

Every registered block policy is brought to a real state by a replay of random chains,
then offered bad batches: a hit or a removal of a block it does not track after ones
it does, a removal or an insert of one block twice, an insert of a block it tracks
after new ones. Each must raise ValueError naming the block, with every part of the
policy's state (queues, ghosts, learned odds, the adaptive policy's experts and
shadows) as it was, and the policy must go on exactly as an untouched copy does.
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict, deque

import pytest
from tiering.policies.blocks import BlockInfo, default_block_registry

from tiering.blocks.replay import replay_blocks

NAMES = default_block_registry().names
CAP = 40


def _state(obj, seen=None):
    """Everything an object holds, as comparable plain values (shared parts once)."""
    seen = {} if seen is None else seen
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if callable(obj) and not hasattr(obj, "__dict__") and not hasattr(obj, "__slots__"):
        return ("callable", type(obj).__name__)
    if id(obj) in seen:
        return ("seen", seen[id(obj)])
    seen[id(obj)] = len(seen)
    if isinstance(obj, (dict, OrderedDict)):
        return (type(obj).__name__, [(_state(k, seen), _state(v, seen)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple, deque)):
        return (type(obj).__name__, [_state(v, seen) for v in obj])
    if isinstance(obj, (set, frozenset)):
        return (type(obj).__name__, sorted(repr(_state(v, seen)) for v in obj))
    if type(obj).__name__ in ("method", "function", "builtin_function_or_method"):
        return ("callable", getattr(obj, "__name__", "?"))
    fields = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                fields[name] = getattr(obj, name)
    return (type(obj).__name__, sorted((k, _state(v, seen)) for k, v in fields.items()))


def _trained(name: str, seed: int):
    rng = random.Random(seed)
    chains = [list(dict.fromkeys(rng.randrange(150) for _ in range(rng.randint(1, 12))))
              for _ in range(300)]
    policy = default_block_registry().make(name, capacity=CAP)
    replay_blocks(chains, CAP, policy)
    return policy, float(len(chains))


def _info(key, depth, now):
    return BlockInfo(key, None, depth, 0, 0, now, now, 0)


def _bad_calls(policy, now):
    tracked = [k for k in range(150) if k in policy]
    fresh = [k for k in range(1000, 1010)]
    a, b = tracked[:2]
    get = lambda k: _info(k, 0, now)  # noqa: E731
    return [
        ("on_commit untracked hit", lambda: policy.on_commit(
            [a, b, fresh[0]], [a, b, fresh[0]], [0, 1, 2], get, now), fresh[0]),
        ("on_removes untracked", lambda: policy.on_removes([a, b, fresh[0]]), fresh[0]),
        ("on_removes twice", lambda: policy.on_removes([a, b, a]), a),
        ("on_inserts tracked", lambda: policy.on_inserts(
            [fresh[1], fresh[2], a], [0, 1, 2], get, now), a),
        ("on_inserts twice", lambda: policy.on_inserts(
            [fresh[3], fresh[4], fresh[3]], [0, 1, 2], get, now), fresh[3]),
    ]


@pytest.mark.parametrize("name", NAMES)
def test_a_bad_batch_raises_naming_the_block_and_changes_nothing(name):
    policy, now = _trained(name, seed=hash(name) % 1000)
    assert len(policy) >= CAP // 2  # a tier in use: the state is not trivial
    for what, call, bad in _bad_calls(policy, now):
        before = _state(policy)
        twin = copy.deepcopy(policy)
        with pytest.raises(ValueError, match=repr(bad)):
            call()
        assert _state(policy) == before, f"{name}: {what} changed the policy"
        # and it goes on as the untouched copy does
        keys = [k for k in range(150) if k in policy][:3]
        for p in (policy, twin):
            p.on_commit(keys + [2000], keys, range(len(keys)), lambda k: _info(k, 0, now + 1),
                        now + 1)
        assert list(policy.victims_except(now + 1))[:10] == list(twin.victims_except(now + 1))[:10]
        assert _state(policy) == _state(twin), f"{name}: {what} left a trace"
        check = getattr(policy, "check_integrity", None)
        if check is not None:
            check()
