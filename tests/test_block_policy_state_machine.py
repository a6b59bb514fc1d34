"""Every registered block policy, driven by a hypothesis state machine over a real
``BlockIndex``: requests that walk (and map) chains, hits, admissions, evictions through
``choose_victim``, blocks dropped as corrupt, and blocks pinned by a live request.

After every step: the index's and (where it has one) the policy's ``check_integrity``;
the policy tracks exactly the blocks the index holds; ``victims`` offers only tracked
blocks and every one of them within ``len(policy)`` offers, and asking changes nothing;
a pinned block is never evicted. The known-blocks cache of the shared tier (a bounded
LRU) has its own machine against a plain model.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from tiering.policies.blocks import default_block_registry, make_block_policy

from tiering.blocks import BlockIndex
from tiering.coldtier import KnownBlocks
from tiering.types import Tier

NAMES = default_block_registry().names


class PolicyMachine(RuleBasedStateMachine):
    @initialize(name=st.sampled_from(NAMES), capacity=st.integers(1, 8))
    def setup(self, name, capacity):
        self.name, self.capacity = name, capacity
        self.policy = make_block_policy(name, capacity=capacity)
        self.index = BlockIndex()
        self.now = 0.0
        self.next_key = 0
        self.slot = 0
        self.pinned: dict[int, int] = {}  # key -> maps held by "live requests"

    def _fresh(self, n):
        out = list(range(self.next_key, self.next_key + n))
        self.next_key += n
        return out

    def _evict_one(self) -> bool:
        v = self.index.choose_victim(self.policy, self.now)
        if v is None:
            return False
        assert self.index.evictable(v), f"{self.name}: choose_victim gave {v!r}, not evictable"
        for d in self.index.drop(v):
            assert d.key not in self.pinned, f"{self.name}: pinned block {d.key!r} evicted"
            self.policy.on_remove(d.key)
        return True

    @rule(data=st.data(), new=st.integers(1, 4))
    def request(self, data, new):
        """A request reads a chain: a cached chain's prefix (if any) and new blocks; it maps
        each block it walks (as an engine would) and lets them go at the end."""
        self.now += 1.0
        keys = sorted(self.index.keys())
        chain: list = []
        if keys and data.draw(st.booleans()):
            chain = list(self.index.chain_keys(data.draw(st.sampled_from(keys))))
        chain += self._fresh(new)
        self.policy.on_request(chain, self.now)
        mapped, parent = [], None
        for depth, key in enumerate(chain):
            if key in self.index:
                self.policy.on_hit(self.index.touch(key, self.now), self.now)
            else:
                if not self.policy.admit(key, depth, self.now):
                    break
                while len(self.index) >= self.capacity:
                    if not self._evict_one():
                        break
                if len(self.index) >= self.capacity:
                    break  # everything cached is mapped: no room now
                assert self.index.insert(key, parent, Tier.DEVICE, self.slot, self.now)
                self.slot += 1
                self.policy.on_insert(self.index.get(key), self.now)
            self.index.acquire(key)
            mapped.append(key)
            parent = key
        for key in mapped:
            self.index.release(key)

    @precondition(lambda self: len(self.index) > 0)
    @rule(data=st.data())
    def pin(self, data):
        key = data.draw(st.sampled_from(sorted(self.index.keys())))
        for k in self.index.chain_keys(key):  # a live request maps the whole prefix
            self.index.acquire(k)
            self.pinned[k] = self.pinned.get(k, 0) + 1

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(self.pinned)))
        chain = list(self.index.chain_keys(key))
        if not all(self.pinned.get(k, 0) for k in chain):
            return  # only whole prefixes were pinned: release one the same way
        for k in chain:
            self.index.release(k)
            self.pinned[k] -= 1
            if not self.pinned[k]:
                del self.pinned[k]

    @precondition(lambda self: len(self.index) > 0)
    @rule(data=st.data())
    def drop_as_corrupt(self, data):
        evictable = [k for k in sorted(self.index.keys()) if self.index.evictable(k)]
        if not evictable:
            return
        key = data.draw(st.sampled_from(evictable))
        for d in self.index.drop(key, "corrupt"):
            self.policy.on_remove(d.key)

    @rule()
    def evict(self):
        had = len(self.index)
        if self._evict_one():
            assert len(self.index) < had

    @invariant()
    def policy_tracks_exactly_the_index(self):
        if not hasattr(self, "policy"):
            return
        self.index.check_integrity()
        if hasattr(self.policy, "check_integrity"):
            self.policy.check_integrity()
        tracked = set(self.index.keys())
        assert len(self.policy) == len(tracked), (self.name, len(self.policy), len(tracked))
        assert all(k in self.policy for k in tracked), self.name
        assert len(tracked) <= self.capacity
        offered = []
        gen = self.policy.victims(self.now)
        for k in gen:
            offered.append(k)
            if len(offered) >= len(tracked):
                break
        gen.close()
        assert set(offered) == tracked, (self.name, sorted(offered), sorted(tracked))
        assert len(self.policy) == len(tracked), f"{self.name}: asking for victims changed it"
        for k in self.pinned:
            assert k in self.index, f"{self.name}: pinned block {k!r} is gone"


PolicyMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPolicyMachine = PolicyMachine.TestCase


class KnownBlocksMachine(RuleBasedStateMachine):
    """KnownBlocks against an OrderedDict model: add, touch (``in``), peek, discard."""

    @initialize(capacity=st.integers(1, 6), seed=st.integers(0, 2**16))
    def setup(self, capacity, seed):
        self.rng = random.Random(seed)
        self.kb = KnownBlocks(capacity)
        self.model: OrderedDict[bytes, int] = OrderedDict()
        self.capacity = capacity
        self.seen: list[bytes] = []

    def _key(self, data):
        if self.seen and data.draw(st.booleans()):
            return data.draw(st.sampled_from(self.seen))
        key = self.rng.randbytes(16)
        self.seen.append(key)
        return key

    @rule(data=st.data(), size=st.integers(1, 1 << 20))
    def add(self, data, size):
        key = self._key(data)
        self.kb.add(key, size)
        self.model[key] = size
        self.model.move_to_end(key)
        while len(self.model) > self.capacity:
            self.model.popitem(last=False)

    @rule(data=st.data())
    def touch(self, data):
        key = self._key(data)
        assert (key in self.kb) == (key in self.model)
        if key in self.model:
            self.model.move_to_end(key)

    @rule(data=st.data())
    def peek(self, data):
        key = self._key(data)
        assert self.kb.peek(key) == (key in self.model)  # and the order is unchanged

    @rule(data=st.data())
    def discard(self, data):
        key = self._key(data)
        self.kb.discard(key)
        self.model.pop(key, None)

    @invariant()
    def same_as_the_model(self):
        if not hasattr(self, "kb"):
            return
        self.kb.check_integrity()
        assert self.kb.keys() == list(self.model)
        assert len(self.kb) == len(self.model) <= self.capacity


KnownBlocksMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                deadline=None)
TestKnownBlocksMachine = KnownBlocksMachine.TestCase
