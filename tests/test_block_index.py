"""The block index: a hypothesis state machine against a plain model, and direct checks."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiering.policies.blocks import LRUBlocks

from tiering.blocks import BlockIndex
from tiering.types import Tier

TIERS = [Tier.DEVICE, Tier.HOST, Tier.DISK]


class IndexMachine(RuleBasedStateMachine):
    """Model: key -> [parent, tier, refs, moving_to]; handles the caller has allocated."""

    def __init__(self):
        super().__init__()
        self.index = BlockIndex()
        self.model: dict[int, list] = {}
        self.next_key = 0
        self.next_handle = 0
        self.allocated: set[tuple[Tier, int]] = set()  # handles the caller must still free
        self.handle_of: dict[int, tuple[Tier, int]] = {}
        self.dest_of: dict[int, tuple[Tier, int]] = {}
        self.now = 0.0
        self.gone: list[int] = []

    def _handle(self, tier):
        self.next_handle += 1
        h = (tier, self.next_handle)
        return h

    def _subtree(self, key):
        out, stack = [], [key]
        while stack:
            k = stack.pop()
            out.append(k)
            stack.extend(c for c, v in self.model.items() if v[0] == k)
        return out

    def _keys(self):
        return sorted(self.model)

    @rule(tier=st.sampled_from(TIERS), data=st.data())
    def insert(self, tier, data):
        self.now += 1.0
        choices = [None] + self._keys() + self.gone[-3:]
        parent = data.draw(st.sampled_from(choices))
        key = self.next_key
        self.next_key += 1
        h = self._handle(tier)
        ok = self.index.insert(key, parent, tier, h[1], self.now)
        if parent is not None and parent not in self.model:
            assert not ok, "a block behind a missing parent was inserted"
            return
        assert ok
        self.model[key] = [parent, tier, 0, None]
        self.allocated.add(h)
        self.handle_of[key] = h

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def duplicate_insert_is_refused(self, data):
        key = data.draw(st.sampled_from(self._keys()))
        with pytest.raises(ValueError, match="already in the index"):
            self.index.insert(key, None, Tier.HOST, -1, self.now)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def lookup(self, data):
        key = data.draw(st.sampled_from(self._keys()))
        chain = self.index.chain_keys(key)
        tail = data.draw(st.lists(st.sampled_from(self._keys() + [10**9]), max_size=3))
        model_chain = [key]
        while self.model[model_chain[-1]][0] is not None:
            model_chain.append(self.model[model_chain[-1]][0])
        assert list(chain) == model_chain[::-1]
        before = {k: self.index.location(k) for k in self.model}
        m = self.index.match(chain + tail)
        assert {k: self.index.location(k) for k in self.model} == before, "match changed something"
        # the model's match: walk while present (the index does not check parentage in match)
        walk = 0
        for k in chain + tail:
            if k not in self.model:
                break
            walk += 1
        assert m.blocks == walk >= len(chain)
        assert list(m.tiers[: len(chain)]) == [self.model[k][1] for k in chain]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def touch(self, data):
        key = data.draw(st.sampled_from(self._keys()))
        self.now += 1.0
        before = self.index.get(key).hits
        info = self.index.touch(key, self.now)
        assert info.hits == before + 1 and info.last_use == self.now

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def acquire(self, data):
        key = data.draw(st.sampled_from(self._keys()))
        if self.model[key][1] is Tier.DEVICE and self.model[key][3] is not None:
            with pytest.raises(ValueError, match="moving from device"):
                self.index.acquire(key)
            return
        assert self.index.acquire(key) == self.model[key][2] + 1
        self.model[key][2] += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        key = data.draw(st.sampled_from(self._keys()))
        if self.model[key][2] == 0:
            with pytest.raises(ValueError, match="not mapped"):
                self.index.release(key)
        else:
            assert self.index.release(key) == self.model[key][2] - 1
            self.model[key][2] -= 1

    def _busy_below(self, key):
        return any(self.model[k][2] or self.model[k][3] for k in self._subtree(key))

    def _move_refused(self, key, dst):
        """What the model says of a move of ``key`` to ``dst``: refused while it moves, to its
        own tier, or off the device with a busy block at or below it."""
        _, tier, _, moving = self.model[key]
        return moving is not None or dst is tier or (tier is Tier.DEVICE and self._busy_below(key))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), dst=st.sampled_from(TIERS))
    def begin_move(self, data, dst):
        key = data.draw(st.sampled_from(self._keys()))
        parent, tier, refs, moving = self.model[key]
        h = self._handle(dst)
        bad = self._move_refused(key, dst)
        if bad:
            with pytest.raises(ValueError):
                self.index.begin_move(key, dst, h[1])
            return
        self.index.begin_move(key, dst, h[1])
        self.model[key][3] = dst
        self.allocated.add(h)
        self.dest_of[key] = h

    @precondition(lambda self: self.model)
    @rule(data=st.data(), dst=st.sampled_from(TIERS))
    def move_at_once(self, data, dst):
        """``move``: begin_move and finish_move in one call, with the same refusals."""
        key = data.draw(st.sampled_from(self._keys()))
        parent, tier, refs, moving = self.model[key]
        h = self._handle(dst)
        bad = self._move_refused(key, dst)
        if bad:
            before = {k: self.index.location(k) for k in self.model}
            with pytest.raises(ValueError):
                self.index.move(key, dst, h[1])
            assert {k: self.index.location(k) for k in self.model} == before
            return
        freed = self.index.move(key, dst, h[1])
        assert (freed.tier, freed.handle) == self.handle_of[key]
        self.allocated.discard(self.handle_of[key])
        self.allocated.add(h)
        self.handle_of[key] = h
        self.model[key][1] = dst

    @precondition(lambda self: any(v[3] for v in self.model.values()))
    @rule(data=st.data(), ok=st.booleans())
    def end_move(self, data, ok):
        key = data.draw(st.sampled_from([k for k in self._keys() if self.model[k][3]]))
        if ok:
            freed = self.index.finish_move(key)
            assert (freed.tier, freed.handle) == self.handle_of[key]
            self.allocated.discard(self.handle_of[key])
            self.handle_of[key] = self.dest_of.pop(key)
            self.model[key][1] = self.model[key][3]
        else:
            freed = self.index.fail_move(key)
            assert (freed.tier, freed.handle) == self.dest_of[key]
            self.allocated.discard(self.dest_of.pop(key))
        self.model[key][3] = None

    @precondition(lambda self: self.model)
    @rule(data=st.data(), reason=st.sampled_from(["evicted", "corrupt"]))
    def drop(self, data, reason):
        """Eviction, or a damaged block found at read (corruption-as-drop)."""
        key = data.draw(st.sampled_from(self._keys()))
        if self._busy_below(key):
            before = {k: self.index.location(k) for k in self.model}
            with pytest.raises(ValueError):
                self.index.drop(key, reason)
            assert {k: self.index.location(k) for k in self.model} == before
            return
        sub = self._subtree(key)
        out = self.index.drop(key, reason)
        assert sorted(d.key for d in out) == sorted(sub)
        assert out[-1].key == key and out[-1].reason == reason
        for d in out:
            assert (d.tier, d.handle) == self.handle_of.pop(d.key)
            self.allocated.discard((d.tier, d.handle))
            del self.model[d.key]
            self.gone.append(d.key)

    @precondition(lambda self: self.model)
    @rule()
    def choose_victim_never_takes_a_mapped_block(self):
        policy = LRUBlocks()
        for k in self._keys():
            policy.on_insert(self.index.get(k), self.now)
        v = self.index.choose_victim(policy, self.now)
        if v is None:
            assert all(self._busy_below(k) for k in self.model)
        else:
            assert not self._busy_below(v)

    @invariant()
    def consistent(self):
        self.index.check_integrity()
        assert set(self.index.keys()) == set(self.model)
        held = set()
        for k, (parent, tier, refs, moving) in self.model.items():
            info = self.index.get(k)
            loc = self.index.location(k)
            assert info.refs == refs >= 0
            assert info.parent == parent and loc.tier is tier and loc.moving_to is moving
            held.add((loc.tier, loc.handle))
            if moving is not None:
                held.add((loc.moving_to, loc.dest_handle))
        assert held == self.allocated, "a handle leaked or was freed twice"
        for t in TIERS:
            assert self.index.count(t) == sum(1 for v in self.model.values() if v[1] is t)
            # idle_count is kept as counts change; the model counts the idle blocks
            assert self.index.idle_count(t) == sum(
                1 for v in self.model.values() if v[1] is t and not v[2] and v[3] is None)
        # evictable is O(1) from the held-children counts; the model walks the subtree
        for k in self.model:
            assert self.index.evictable(k) == (not self._busy_below(k)), k


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def _chain(index, keys, tier=Tier.DEVICE, start=0):
    parent = None
    for i, k in enumerate(keys):
        assert index.insert(k, parent, tier, start + i, 0.0)
        parent = k
    index.check_integrity()


def test_corrupt_block_turns_a_hit_into_a_miss_and_drops_what_follows():
    index = BlockIndex()
    _chain(index, ["a", "b", "c", "d"], Tier.DISK)
    assert index.match(["a", "b", "c", "d"]).blocks == 4
    out = index.drop("b", "corrupt")
    index.check_integrity()
    assert [d.key for d in out] == ["d", "c", "b"]
    assert [d.reason for d in out] == ["orphaned", "orphaned", "corrupt"]
    assert index.match(["a", "b", "c", "d"]).blocks == 1
    assert index.dropped["corrupt"] == 1 and index.dropped["orphaned"] == 2


def test_a_mapped_block_cannot_leave_the_device_or_be_dropped():
    index = BlockIndex()
    _chain(index, ["a", "b"])
    index.acquire("b")
    for call in (lambda: index.drop("a"), lambda: index.begin_move("a", Tier.HOST, 9)):
        with pytest.raises(ValueError, match="mapped"):
            call()
    index.check_integrity()
    assert index.match(["a", "b"]).blocks == 2
    index.release("b")
    index.begin_move("b", Tier.HOST, 9)
    assert index.finish_move("b") == (Tier.DEVICE, 1, None, None)
    index.check_integrity()
    assert index.match(["a", "b"]).tiers == (Tier.DEVICE, Tier.HOST)


def test_a_host_block_being_attached_may_be_mapped_while_it_moves_up():
    index = BlockIndex()
    _chain(index, ["a"], Tier.HOST)
    index.acquire("a")
    index.begin_move("a", Tier.DEVICE, 5)
    index.check_integrity()
    assert index.location("a").moving_to is Tier.DEVICE
    index.finish_move("a")
    assert index.location("a").tier is Tier.DEVICE
    index.check_integrity()


def test_handle_reuse_is_refused_and_changes_nothing():
    index = BlockIndex()
    _chain(index, ["a"])
    with pytest.raises(ValueError, match="handle 0 already holds block 'a'"):
        index.insert("b", "a", Tier.DEVICE, 0, 0.0)
    assert "b" not in index
    index.check_integrity()


def test_check_integrity_catches_a_corrupted_record():
    index = BlockIndex()
    _chain(index, ["a", "b"])
    index._refs["b"] = -1  # negative controls: the check must see each of these
    with pytest.raises(AssertionError, match="refs"):
        index.check_integrity()
    del index._refs["b"]
    index.check_integrity()
    index._slots[Tier.HOST][99] = "a"  # a leaked slot
    with pytest.raises(AssertionError, match="handle map"):
        index.check_integrity()
    del index._slots[Tier.HOST][99]
    index._kids["b"] = {"zz"}  # a child that is not cached
    with pytest.raises(AssertionError, match="child"):
        index.check_integrity()
    del index._kids["b"]
    index.check_integrity()
    index._busy_n[Tier.DEVICE] += 1  # a busy count that no mapped or moving block backs
    with pytest.raises(AssertionError, match="busy counts"):
        index.check_integrity()



def test_check_integrity_catches_a_wrong_chain_record():
    """Each block's one record (parent, depth, handle, first use): a wrong depth, parent or
    handle, a record of the wrong shape, or a block without one is seen."""
    rng = random.Random(5)
    keys = rng.sample(range(10**6), 6)
    index = BlockIndex()
    assert index.insert_run(keys, None, Tier.DEVICE, [10 + i for i in range(6)], 1.5)
    index.check_integrity()
    good = index._node[keys[3]]
    for bad, match in (((good[0], good[1] + 1, good[2], good[3]), "depth"),
                       ((keys[0], good[1], good[2], good[3]), "children"),
                       ((good[0], good[1], 99, good[3]), "handle map"),
                       ([*good], "is not"), (good[:3], "is not")):
        index._node[keys[3]] = bad
        with pytest.raises(AssertionError, match=match):
            index.check_integrity()
        index._node[keys[3]] = good
        index.check_integrity()
    del index._node[keys[5]]
    with pytest.raises(AssertionError, match="_node does not cover"):
        index.check_integrity()

def test_evictable_follows_a_deep_chain_mapped_and_released_in_any_order():
    """The held-children counts walk up only while a block's held state changes: map a
    chain root first, release it leaf first or root first, and every block's
    evictability is the subtree's; a corrupted count is caught."""
    index = BlockIndex()
    keys = [f"k{i}" for i in range(30)]
    _chain(index, keys)
    assert index.insert("side", "k10", Tier.DEVICE, 99, 0.0)  # a branch off the chain
    for k in keys[:20]:
        index.acquire(k)
    index.check_integrity()
    assert [index.evictable(k) for k in keys] == [False] * 20 + [True] * 10
    assert index.evictable("side")
    index.release("k0")  # k0 is still held by k1..k19 below it
    assert not index.evictable("k0")
    for k in reversed(keys[1:20]):
        index.release(k)
        index.check_integrity()
    assert all(index.evictable(k) for k in keys)
    index.begin_move("side", Tier.HOST, 7)  # a move in flight holds the chain above it
    assert not index.evictable("k0") and not index.evictable("k10")
    assert index.evictable("k11")
    index.finish_move("side")
    index.check_integrity()
    assert index.evictable("k0")
    index.acquire("k29")
    index._below.pop("k28")  # negative control: a lost count must be seen
    with pytest.raises(AssertionError, match="held-children"):
        index.check_integrity()


def test_move_at_once_is_refused_like_begin_move_and_changes_nothing():
    index = BlockIndex()
    _chain(index, ["a", "b"])
    index.acquire("b")
    with pytest.raises(ValueError, match="mapped"):
        index.move("a", Tier.HOST, 5)
    with pytest.raises(ValueError, match="already on device"):
        index.move("b", Tier.DEVICE, 5)
    with pytest.raises(ValueError, match="not in the index"):
        index.move("zz", Tier.HOST, 5)
    index.check_integrity()
    assert index.location("a") == (Tier.DEVICE, 0, None, None)
    index.release("b")
    assert index.move("b", Tier.HOST, 5) == (Tier.DEVICE, 1, None, None)
    assert index.location("b") == (Tier.HOST, 5, None, None)
    with pytest.raises(ValueError, match="handle 5 already holds block 'b'"):
        index.move("a", Tier.HOST, 5)
    index.check_integrity()


def _snapshot(index):
    return (
        {k: (index.location(k), index.get(k)) for k in index.keys()},
        {t: index.count(t) for t in Tier},
        dict(index.dropped),
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None, "3", True])
def test_a_bad_clock_value_is_refused_by_name_and_changes_nothing(bad):
    """A NaN, infinite, missing, text or bool ``now`` used to be stored as a use time, and
    the next check_integrity failed ("bad use record") on a call that had been accepted."""
    index = BlockIndex()
    index.insert("a", None, Tier.DEVICE, 0, 5.0)
    before = _snapshot(index)
    with pytest.raises(ValueError, match=r"insert of block 'b': now must be a finite number"):
        index.insert("b", "a", Tier.DEVICE, 1, bad)
    with pytest.raises(ValueError, match=r"touch of block 'a': now must be a finite number"):
        index.touch("a", bad)
    assert _snapshot(index) == before
    index.check_integrity()


def test_a_touch_before_the_blocks_first_use_is_refused():
    index = BlockIndex()
    index.insert("a", None, Tier.DEVICE, 0, 5.0)
    before = _snapshot(index)
    with pytest.raises(ValueError, match=r"touch of block 'a': now 1.0 is before its first use 5.0"):
        index.touch("a", 1.0)
    assert _snapshot(index) == before
    index.check_integrity()
    import numpy as np

    assert index.touch("a", 7).last_use == 7  # an int clock and a numpy float are numbers too
    assert index.touch("a", np.float64(8.5)).hits == 2
    index.check_integrity()


def test_a_bad_tier_or_reason_is_refused_by_name_and_changes_nothing():
    """A tier given as text used to make choose_victim answer None (nothing to evict) and
    count raise a bare KeyError; a drop reason that is not text was counted as given."""
    index = BlockIndex()
    _chain(index, ["a", "b"])
    policy = LRUBlocks()
    for k in ("a", "b"):
        policy.on_insert(index.get(k), 0.0)
    before = _snapshot(index)
    with pytest.raises(ValueError, match="choose_victim: tier must be a Tier, got 'device'"):
        index.choose_victim(policy, 1.0, tier="device")
    with pytest.raises(ValueError, match="count: tier must be a Tier"):
        index.count("device")
    with pytest.raises(ValueError, match="idle_count: tier must be a Tier"):
        index.idle_count("host")
    with pytest.raises(ValueError, match="keys: tier must be a Tier"):
        index.keys("disk")
    for bad in (5, "", None):
        with pytest.raises(ValueError, match="drop of block 'a': reason must be a non-empty str"):
            index.drop("a", bad)
    assert _snapshot(index) == before
    index.check_integrity()
    assert index.choose_victim(policy, 1.0, tier=Tier.DEVICE) == "a"  # the control


def test_count_evictable_counts_what_may_leave_up_to_want_and_changes_nothing():
    from tiering.policies.blocks import LRUBlocks

    rng = random.Random(9)
    idx, pol = BlockIndex(), LRUBlocks()
    keys = [rng.randbytes(6) for _ in range(6)]
    for i, k in enumerate(keys):  # one chain on the device
        assert idx.insert(k, keys[i - 1] if i else None, Tier.DEVICE, i, float(i))
        pol.on_insert(idx.get(k), float(i))
    idx.acquire(keys[3])  # mapped: it and its ancestors (held below) may not leave
    assert idx.count_evictable(pol, 9.0, Tier.DEVICE, 10) == 2  # keys 4 and 5
    assert idx.count_evictable(pol, 9.0, Tier.DEVICE, 1) == 1
    assert idx.count_evictable(pol, 9.0, Tier.HOST, 10) == 0
    before = [idx.location(k) for k in keys]
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="want must be an int >= 0"):
            idx.count_evictable(pol, 9.0, Tier.DEVICE, bad)
    assert [idx.location(k) for k in keys] == before and len(pol) == 6
    idx.check_integrity()


@pytest.mark.parametrize("busy_first", ["move", "map"])
def test_a_moving_block_keeps_its_chain_held_when_a_block_below_it_is_released(busy_first):
    """a -> b -> c: b moves (host -> disk) while c is mapped; releasing c leaves b moving,
    so a (above a busy block) must still not be evictable, and dropping it is refused
    without changing anything. Once b's move ends, a is evictable again (the control)."""
    index = BlockIndex()
    _chain(index, ["a", "b", "c"], Tier.HOST)
    steps = {"move": lambda: index.begin_move("b", Tier.DISK, 99), "map": lambda: index.acquire("c")}
    order = ["move", "map"] if busy_first == "move" else ["map", "move"]
    for step in order:
        steps[step]()
        index.check_integrity()
    assert not index.evictable("a") and not index.evictable("b")
    assert index.release("c") == 0
    index.check_integrity()
    assert not index.evictable("a"), "a is above a moving block but was called evictable"
    before = {k: index.location(k) for k in "abc"}
    with pytest.raises(ValueError, match="'a'"):
        index.drop("a")
    assert {k: index.location(k) for k in "abc"} == before
    assert index.evictable("c")  # c itself is idle: it may go
    index.finish_move("b")
    index.check_integrity()
    assert index.evictable("a") and index.evictable("b")


def test_drop_run_removes_what_drop_does_with_the_same_records_and_counts():
    rng = random.Random(41)
    twins = (BlockIndex(), BlockIndex())
    keys = [rng.randrange(10**9) for _ in range(40)]
    for index in twins:  # two branches below a shared root, some of it on the host
        _chain(index, keys[:20])
        _chain(index, keys[20:], start=100)
        index.insert(keys[20] + 1, keys[5], Tier.HOST, 999, 1.0)
    kids = twins[0]._kids[keys[5]]
    assert isinstance(kids, set) and len(kids) == 2
    out = twins[0].drop(keys[3], "corrupt")
    run = twins[1].drop_run(keys[3], "corrupt")
    assert [d.key for d in out] == run.keys and run.keys[-1] == keys[3]
    assert [d.tier for d in out] == run.tiers and Tier.HOST in run.tiers
    assert [d.handle for d in out] == run.handles
    assert [d.reason for d in out] == ["orphaned"] * (len(out) - 1) + ["corrupt"]
    for index in twins:
        index.check_integrity()
        assert set(index.keys()) == set(keys[:3]) | set(keys[20:])
        assert index.dropped == {"corrupt": 1, "orphaned": 17}
        assert index.count(Tier.HOST) == 0 and index.idle_count(Tier.DEVICE) == 23
    twins[1].acquire(keys[1])
    with pytest.raises(ValueError, match="mapped by 1"):
        twins[1].drop_run(keys[0])
    twins[1].check_integrity()
    assert len(twins[1]) == 23


def test_attachable_tiers_stop_at_a_block_in_flight_or_mapped_off_the_device():
    """The cached prefix a request may map: cut before the first block moving, or off the
    device and mapped already; the same answer as match, refs and moving_to put together."""
    rng = random.Random(17)
    for _ in range(30):
        index = BlockIndex()
        keys = [rng.randrange(10**9) for _ in range(rng.randint(1, 12))]
        h = 0
        for i, k in enumerate(keys[:rng.randint(0, len(keys))]):
            h += 1
            index.insert(k, keys[i - 1] if i else None, rng.choice(TIERS), h, 0.0)
        for k in list(index.keys()):
            r = rng.random()
            if r < 0.15:
                index.acquire(k)  # mapped (a host or disk block may be mapped while it loads)
            elif r < 0.25 and index.location(k).tier is not Tier.DEVICE:
                h += 1
                index.begin_move(k, Tier.DEVICE, 10**6 + h)
        want = []
        for k, t in zip(keys, index.match(keys).tiers, strict=False):
            if index.moving_to(k) is not None or (t is not Tier.DEVICE and index.get(k).refs):
                break
            want.append(t)
        assert index.attachable_tiers(keys) == want
        assert [index.refs(k) for k in keys] == [
            index.get(k).refs if k in index else 0 for k in keys]


def _tables(index):
    return {name: getattr(index, name) for name in (
        "_node", "_tier", "_dest", "_refs", "_hits", "_last",
        "_kids", "_slots", "_counts", "_busy_n", "_below")}


def test_release_many_equals_release_of_each_for_lines_and_any_other_keys():
    """release_many of a request's line of blocks (the common case) or of any mapped keys
    leaves every table as releasing each in turn does, with blocks mapped twice, moving,
    and held below by a branch mapped by someone else."""
    rng = random.Random(23)
    lines = 0
    for trial in range(200):
        twins = (BlockIndex(), BlockIndex())
        keys = rng.sample(range(10**6), rng.randint(2, 14))
        branch = rng.randrange(10**6, 2 * 10**6)
        at = rng.randrange(len(keys))
        twice = keys[rng.randrange(len(keys))] if rng.random() < 0.2 else None
        held, moving = rng.random() < 0.2, rng.random() < 0.15
        # the line on one tier, or on the host with its end loading up, or on any tiers
        tiers = ([Tier.HOST] * len(keys) if moving else
                 [rng.choice(TIERS) for _ in keys] if rng.random() < 0.3 else
                 [Tier.DEVICE] * len(keys))
        for index in twins:
            for i, (k, t) in enumerate(zip(keys, tiers, strict=True)):
                assert index.insert(k, keys[i - 1] if i else None, t, i, 0.0)
            index.insert(branch, keys[at], Tier.DEVICE, 10**3, 0.0)
            index.acquire_many(keys)
            if twice is not None:
                index.acquire(twice)  # one mapped twice
            if held:
                index.acquire(branch)  # held below, by another request
            if moving:
                index.begin_move(keys[-1], Tier.DEVICE, 7)  # the line's end loading up
        lo = rng.randrange(len(keys))
        part = keys[lo:] if rng.random() < 0.6 else rng.sample(keys, rng.randint(1, len(keys)))
        twins[0].release_many(part)
        for k in part:
            twins[1].release(k)
        assert _tables(twins[0]) == _tables(twins[1]), (trial, part)
        assert [twins[0].evictable(k) for k in keys] == [twins[1].evictable(k) for k in keys]
        twins[0].check_integrity()
        lines += part == keys[lo:] and len(part) > 1
    assert lines > 50  # the line's shortcut was taken often enough to be tested


def test_release_many_of_a_line_released_too_often_is_refused_and_changes_nothing():
    index = BlockIndex()
    keys = [5, 9, 2, 7]
    _chain(index, keys)
    index.acquire_many(keys[1:])
    before = _tables(index)
    before = {k: (dict(v) if isinstance(v, dict) else v) for k, v in before.items()}
    with pytest.raises(ValueError, match="block 5 is not mapped"):
        index.release_many(keys)
    assert _tables(index) == before
    index.release_many(keys[1:])
    assert index.refs(9) == 0 and all(index.evictable(k) for k in keys)
    index.check_integrity()


def test_an_untouched_block_reads_no_hits_and_its_first_use_and_the_check_sees_bad_records():
    index = BlockIndex()
    _chain(index, ["a", "b", "c"])
    index.touch("b", 3.0)
    index.touch_many(["b", "c", "c"], 4.0)
    got = {k: (index.get(k).hits, index.get(k).first_seen, index.get(k).last_use) for k in "abc"}
    assert got == {"a": (0, 0.0, 0.0), "b": (2, 0.0, 4.0), "c": (2, 0.0, 4.0)}
    index.check_integrity()
    index.drop("a")
    assert len(index) == 0 and not index._hits and not index._last
    _chain(index, ["a", "b"])
    index._hits["a"], index._last["a"] = 0, 1.0  # negative controls: a stored count of 0,
    with pytest.raises(AssertionError, match="bad use record"):  # a last use with no hits
        index.check_integrity()
    del index._hits["a"], index._last["a"]
    index.check_integrity()
    index._last["b"] = 5.0
    with pytest.raises(AssertionError, match="touched"):
        index.check_integrity()


def _forest(index, rng, keys):
    """``keys`` as a random forest on random tiers, some blocks touched, mapped or moving."""
    for i, k in enumerate(keys):
        parent = keys[rng.randrange(i)] if i and rng.random() < 0.8 else None
        assert index.insert(k, parent, rng.choice(TIERS), i, float(i))
    for k in keys:
        r = rng.random()
        if r < 0.2:
            index.touch(k, float(len(keys)))
        elif r < 0.35:
            index.acquire(k)
        elif r < 0.4 and index.location(k).tier is not Tier.DISK:
            index.begin_move(k, Tier.DISK, 10**6 + k)


def test_insert_mapped_equals_insert_then_acquire():
    """The replay's one-call insert of a mapped block leaves every table as ``insert`` and
    ``acquire`` do, below any parent (mapped, idle, moving, with or without children);
    False behind a parent not cached and a cached or None key refused as ``insert``
    refuses them, each changing nothing."""
    import copy

    rng = random.Random(7)
    walks = 0
    for trial in range(150):
        twins = (BlockIndex(), BlockIndex())
        keys = rng.sample(range(10**5), rng.randint(1, 12))
        seed = rng.random()
        for index in twins:
            _forest(index, random.Random(seed), keys)
        key, tier = rng.randrange(10**5, 2 * 10**5), rng.choice(TIERS)
        parent = rng.choice([None, 3 * 10**5, *keys])
        now = float(rng.randrange(100))
        ok = twins[0]._insert_mapped(key, parent, tier, 500, now)
        assert ok == twins[1].insert(key, parent, tier, 500, now) == (parent != 3 * 10**5)
        if ok:
            twins[1].acquire(key)
            walks += parent is not None and not twins[0].refs(parent)
        assert _tables(twins[0]) == _tables(twins[1]), trial
        twins[0].check_integrity()
        before = copy.deepcopy(_tables(twins[0]))
        for bad, match in ((rng.choice(keys), "already in the index"), (None, "not be None")):
            with pytest.raises(ValueError, match=match):
                twins[0]._insert_mapped(bad, None, Tier.DEVICE, 501, now)
        assert _tables(twins[0]) == before
    assert walks > 30  # parents not mapped: the held counts walked up


def test_evict_leaf_equals_drop_run_of_an_idle_leaf_and_refuses_anything_else():
    """``_evict_leaf`` of a cached, evictable block with no children leaves every table and
    ``dropped`` as ``drop_run`` does and hands its handle over; of any other key (unknown,
    mapped, moving, holding a busy block below or any child) it answers False and changes
    nothing."""
    import copy

    rng = random.Random(11)
    taken = refused = 0
    for trial in range(150):
        twins = (BlockIndex(), BlockIndex())
        keys = rng.sample(range(10**5), rng.randint(1, 12))
        seed = rng.random()
        for index in twins:
            _forest(index, random.Random(seed), keys)
        key = rng.choice([*keys, 3 * 10**5])
        leaf = key in twins[0] and twins[0].evictable(key) and not twins[0].get(key).children
        before = copy.deepcopy((_tables(twins[0]), twins[0].dropped))
        freed = [-1]
        assert twins[0]._evict_leaf(key, freed) == leaf, trial
        if leaf:
            run = twins[1].drop_run(key)
            assert run.keys == [key] and freed == [-1, *run.handles]
            assert (_tables(twins[0]), twins[0].dropped) == (_tables(twins[1]), twins[1].dropped)
            twins[0].check_integrity()
            taken += 1
        else:
            assert freed == [-1] and (_tables(twins[0]), twins[0].dropped) == before
            refused += 1
    assert taken > 30 and refused > 30
