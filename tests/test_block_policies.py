"""Every registered block policy passes the shared contract; the contract catches bad policies."""

from __future__ import annotations

import copy
import heapq
import math
import random
from collections import OrderedDict
from pathlib import Path

import pytest
from tiering.policies.blocks import (
    BlockPolicy,
    default_block_registry,
    make_block_policy,
    register_block_policy,
)
from tiering.policies.blocks.base import BlockInfo
from tiering.policies.blocks.chain import ChainOdds
from tiering.policies.blocks.generic import LRUBlocks

from tiering.blocks import BlockIndex
from tiering.blocks.replay import load_chains, replay_blocks
from tiering.blocks.synth import synthetic_chains
from tiering.testing.blocks import check_block_policy
from tiering.types import Tier

NAMES = default_block_registry().names


def test_registry_holds_the_six_policies():
    assert set(NAMES) == {"lru", "arc", "s3fifo", "lirs", "chain", "adaptive"}


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


class _OffersGhosts(LRUBlocks):
    """Broken: forgets a removed block but still offers it first."""

    name = "ghosts"

    def __init__(self, capacity):
        super().__init__(capacity)
        self._gone = []

    def on_remove(self, key):
        super().on_remove(key)
        self._gone.append(key)

    def victims(self, now):
        yield from self._gone
        yield from super().victims(now)


class _CapacityTypeError(LRUBlocks):
    """Broken: refuses capacity 0 with a TypeError that does not name it."""

    def __init__(self, capacity):
        if capacity < 1:
            raise TypeError("bad")
        super().__init__(capacity)


@pytest.mark.parametrize("bad, rule", [
    (_ForgetsRemovals, "policy and index disagree after an eviction"),
    (_EvictsNewest, "victims did not offer every tracked block within len\\(policy\\) offers"),
    (_NoCapacityCheck, "capacity=0 was accepted"),
    (_OffersGhosts, "the policy broke the protocol: policy 'ghosts' offered block .*, which is not in the index"),
    (_CapacityTypeError, "capacity=0 raised TypeError \\(bad\\), not a ValueError naming capacity"),
])
def test_contract_fails_broken_policies(bad, rule):
    """Each broken policy fails the contract with an AssertionError naming the rule it
    breaks (the test used to accept any of three exception types, whatever the reason)."""
    with pytest.raises(AssertionError, match=rule):
        check_block_policy(bad)


# -- ChainOdds ---------------------------------------------------------------------------

TRACE = (
    Path(__file__).resolve().parent.parent / "benchmarks/traces/mooncake/conversation_trace.jsonl"
)


def _conversations(n, seed, extend_share=0.0, cont=0.7):
    """Seeded conversations on a shared root block 0: one-offs, and conversations whose
    turns either extend the whole previous request or branch from its context (a new
    question after the same context: the earlier question is never read again)."""
    rng = random.Random(seed)
    nid = [1]

    def fresh(k):
        out = list(range(nid[0], nid[0] + k))
        nid[0] += k
        return out

    due, seq, chains = [], 0, []
    for i in range(n):
        if due and due[0][0] <= i:
            _, _, extend, ctx, prev = heapq.heappop(due)
            chain = (prev if extend else ctx) + fresh(rng.randint(2, 6))
        elif rng.random() < 0.4:
            chains.append([0, *fresh(rng.randint(2, 12))])
            continue
        else:
            ctx = [0, *fresh(rng.randint(4, 12))]
            chain = ctx + fresh(rng.randint(2, 6))
            extend = rng.random() < extend_share
        chains.append(chain)
        if rng.random() < cont:
            seq += 1
            heapq.heappush(due, (i + rng.randint(20, 200), seq, extend, ctx, chain))
    return chains


class _CheckedChain(ChainOdds):
    """ChainOdds that checks its own records after every event it is told about."""

    def on_request(self, keys, now):
        super().on_request(keys, now)
        self.check_integrity()

    def on_insert(self, info, now):
        super().on_insert(info, now)
        self.check_integrity()

    def on_hit(self, info, now):
        super().on_hit(info, now)
        self.check_integrity()

    def on_remove(self, key):
        super().on_remove(key)
        self.check_integrity()

    def admit(self, key, depth, now):
        ok = super().admit(key, depth, now)
        self.check_integrity()
        return ok


@pytest.mark.parametrize(
    "source,capacity",
    [("synth", 40), ("synth", 300), ("mooncake", 100), ("mooncake", 500)],
)
def test_chain_records_stay_consistent_and_checking_changes_no_decision(source, capacity):
    chains = synthetic_chains(600, seed=5) if source == "synth" else load_chains(TRACE, limit=400)
    checked = replay_blocks(chains, capacity, _CheckedChain(capacity=capacity), check_every=1)
    plain = replay_blocks(chains, capacity, ChainOdds(capacity=capacity))
    # the cached lowest end was compared with a recomputation after every event; the
    # decisions (hits, admissions, refusals, evictions) are those of the unchecked run
    assert checked[:-1] == plain[:-1]
    assert plain.evicted > 0 and plain.refused > 0 and plain.hits > 0  # every path ran


def test_chain_check_integrity_catches_what_it_checks():
    chains = synthetic_chains(300, seed=2)

    def fresh():
        p = ChainOdds(capacity=60)
        replay_blocks(chains, 60, p)
        p.check_integrity()
        return p

    p = fresh()  # a stale cached lowest end
    p._ends()
    p._ends_memo = (-1.0, "stale")
    with pytest.raises(AssertionError, match="cached lowest end"):
        p.check_integrity()
    p = fresh()  # a block listed under the wrong class
    k = next(iter(p._meta))
    p._meta[k] = (p._meta[k] + 1) % len(p._lists)
    with pytest.raises(AssertionError, match="listed in class"):
        p.check_integrity()
    p = fresh()  # a list entry without a record
    p._meta.pop(next(iter(p._meta)))
    with pytest.raises(AssertionError):
        p.check_integrity()


@pytest.mark.parametrize(
    "kw,word",
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 10, "horizon": 1}, "horizon"),
        ({"capacity": 10, "max_turn": 0}, "max_turn"),
        ({"capacity": 10, "max_reads": 0}, "max_reads"),
        ({"capacity": 10, "max_reads": True}, "max_reads"),
        ({"capacity": 10, "length_classes": -1}, "length_classes"),
        ({"capacity": 10, "length_classes": 2.0}, "length_classes"),
        ({"capacity": 10, "shared_children": 1}, "shared_children"),
    ],
)
def test_chain_rejects_bad_parameters_by_name(kw, word):
    with pytest.raises(ValueError, match=word):
        ChainOdds(**kw)


@pytest.mark.parametrize("seed", [0, 1])
def test_chain_tells_a_context_read_again_from_a_question_read_once(seed):
    # Every turn reads the conversation's context again and asks a new question that is
    # never read again. Only the read count separates the two within a turn.
    chains = _conversations(3000, seed)
    cap = 400
    by_reads = replay_blocks(chains, cap, ChainOdds(capacity=cap, horizon=1024))
    blind = replay_blocks(chains, cap, ChainOdds(capacity=cap, horizon=1024, max_reads=1))
    lru = replay_blocks(chains, cap, LRUBlocks(capacity=cap))
    assert by_reads.hits > 1.1 * blind.hits, (by_reads.hits, blind.hits)
    assert blind.hits > lru.hits  # the turn classes alone still help (negative control is lru)
    p = ChainOdds(capacity=cap, horizon=1024)
    replay_blocks(chains, cap, p)
    # what it learned: a turn-2 block read for the second time comes back more often
    # than one read for the first time (class 1 + (turn - 1) * max_reads + (reads - 1))
    first, again = p._hist[1 + p.max_reads], p._hist[2 + p.max_reads]
    assert again.reused / (again.reused + again.never) > 2 * first.reused / (
        first.reused + first.never
    )


def test_chain_classes_a_branch_apart_from_an_extension():
    p = ChainOdds(capacity=100, length_classes=0)
    p.on_request([0, 1, 2, 3, 4, 5], 0.0)  # turn 1
    p.on_request([0, 1, 2, 3, 4, 5, 6, 7], 1.0)  # extends it: turn 2, not a branch
    assert p._ghost[6][0] == 1 + p.max_reads  # turn 2, first read (7 is the unextended tail)
    assert p._ghost[7][0] == p._tail_cls
    p.on_request([0, 1, 2, 3, 8, 9, 10], 2.0)  # continues from inside request 1: a branch
    assert p._ghost[9][0] == p._branch_cls + 1  # turn 2, branch class
    q = ChainOdds(capacity=100, length_classes=0, branch_classes=False)
    for t, keys in enumerate(
        ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 8, 9, 10])
    ):
        q.on_request(keys, float(t))
    assert q._ghost[9][0] == 1 + q.max_reads  # turn 2, first read, no branch class
    p.check_integrity()
    q.check_integrity()


# -- the kept lowest end and the heap of the oldest read change no choice ---------------------


class _Recording(ChainOdds):
    """ChainOdds that records every block it is told left its tier, in order."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.removed: list = []
        self.victims_seen = 0

    def on_remove(self, key):
        self.removed.append(key)
        super().on_remove(key)

    def victims_except(self, now, *busy):
        self.victims_seen += 1
        return super().victims_except(now, *busy)


class _Resorting(_Recording):
    """The reference: the lowest end found by a minimum over every class on every call,
    and the oldest read's blocks sorted again on every call (no heap). Same records."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._key = None

    def _ends(self):
        if self._ends_at == self._version:
            return self._ends_memo
        dens, now, top = self._dens, self._t, 17
        cend, lists = self._cend, self._lists
        if self._key != (now, self._dens_at):
            self._key = (now, self._dens_at)
            dirty = range(len(lists))
        else:
            dirty = self._dirty
        lows = self._lows
        for cls in dirty:
            lst = lists[cls]
            if not lst:
                cend[cls] = ()
                lows[cls] = (math.inf, cls, None)
                continue
            row = dens[cls]
            first = next(iter(lst))
            t0 = lst[first][0]
            group = []
            for pos, (k2, (t2, d2, _)) in enumerate(lst.items()):
                if t2 != t0:
                    break
                group.append((d2, -pos, k2))
            k = max(group)[2]  # the deepest of the oldest read, the earliest of equals
            k2 = next(reversed(lst))
            b_old, b_young = (now - t0).bit_length(), (now - lst[k2][0]).bit_length()
            old = (row[min(b_old, top)], k)
            young = (row[min(b_young, top)], k2)
            low = old if old[0] <= young[0] else young
            cend[cls] = (low, old, young)
            lows[cls] = (low[0], cls, low[1])
        self._dirty = set()
        m = min(lows)
        best = None if m[2] is None else (m[0], m[2])
        self._ends_memo, self._ends_at = best, self._version
        return best


class _ForgetsLateBlocks(_Recording):
    """A broken heap: blocks tracked after the oldest read's heap was built never join it
    (the negative control: the comparison below must see the difference)."""

    def _track(self, key, depth):
        super()._track(key, depth)
        for front in self._front.values():
            front[3].clear()


@pytest.mark.parametrize(
    "source,capacity,seed",
    [("synth", 40, 5), ("synth", 300, 11), ("synth", 120, 23), ("mooncake", 100, 0),
     ("mooncake", 500, 0)],
)
def test_chain_fast_ends_choose_exactly_what_a_full_recomputation_chooses(source, capacity, seed):
    """Every block that leaves, in order, and every figure of the replay are those of the
    reference that recomputes every class's ends and re-sorts the oldest read; a heap that
    drops late blocks differs (so the comparison can fail)."""
    chains = (synthetic_chains(800, seed=seed) if source == "synth"
              else load_chains(TRACE, limit=600))
    fast, ref = _Recording(capacity=capacity), _Resorting(capacity=capacity)
    a = replay_blocks(chains, capacity, fast, check_every=50)
    b = replay_blocks(chains, capacity, ref)
    assert fast.removed == ref.removed and len(fast.removed) > 100
    assert a[:-1] == b[:-1] and a.evicted > 0 and a.refused > 0
    assert fast.victims_seen == ref.victims_seen > 100
    fast.check_integrity()


def test_chain_sees_blocks_tracked_late_in_a_read_once_the_read_is_over():
    """Blocks tracked at a read after the last victim search during that read were not
    seen by the cached end once the read was over: check_integrity failed at the next
    request, and the victim was the read's first block instead of its deepest."""
    rng = random.Random(3)
    for _ in range(20):
        p = ChainOdds(capacity=rng.randint(20, 200))
        keys = [rng.randbytes(8) for _ in range(rng.randint(4, 12))]
        p.on_request(keys, 1.0)
        p.on_insert(BlockInfo(keys[0], None, 1, 0, 0, 1.0, 1.0, 0), 1.0)
        assert list(p.victims(1.0))[:1] == [keys[0]]  # the class's end is now cached
        late = rng.randint(2, len(keys) - 2)
        for i in range(1, late + 1):
            p.on_insert(BlockInfo(keys[i], keys[i - 1], i + 1, 0, 0, 1.0, 1.0, 0), 1.0)
        p.on_request([rng.randbytes(8)], 2.0)  # the read is over
        p.check_integrity()
        assert next(iter(p.victims(2.0))) == keys[late]  # the deepest of that read


def test_chain_fast_ends_comparison_catches_a_heap_that_drops_late_blocks():
    differs = 0
    for seed in (5, 11, 23):
        chains = synthetic_chains(800, seed=seed)
        broken, ref = _ForgetsLateBlocks(capacity=40), _Resorting(capacity=40)
        replay_blocks(chains, 40, broken)
        replay_blocks(chains, 40, ref)
        differs += broken.removed != ref.removed
    assert differs > 0


@pytest.mark.parametrize("name", sorted(NAMES))
def test_victims_except_is_victims_without_the_busy_keys(name):
    """Every policy's victims_except yields what a caller refusing the keys in the
    containers given would take from victims(), in the same order (ChainOdds skips them
    inside its own walk). A policy may reorder itself as keys are refused (S3-FIFO), so
    each side runs on its own copy."""
    rng = random.Random(17)
    chains = synthetic_chains(400, seed=3)
    p = make_block_policy(name, capacity=80)
    replay_blocks(chains, 80, p)
    keys = list(copy.deepcopy(p).victims(0.0))
    assert len(keys) == len(p) > 40
    for _ in range(20):
        busy = [set(rng.sample(keys, rng.randint(0, len(keys) // 2))) for _ in range(3)]
        want = [k for k in copy.deepcopy(p).victims(0.0) if not any(k in c for c in busy)]
        assert list(copy.deepcopy(p).victims_except(0.0, *busy)) == want
    assert list(copy.deepcopy(p).victims_except(0.0, set(keys), set(), set())) == []
    assert list(copy.deepcopy(p).victims_except(0.0, set(), set(), set())) == keys


@pytest.mark.parametrize("name", sorted(NAMES))
def test_pop_victim_is_the_first_of_victims_except_and_leaves_the_same_state(name):
    """pop_victim answers what victims_except offers first, and leaves the policy as
    taking that one and closing the walk does (S3-FIFO moves the keys it passes), with
    busy keys anywhere, everywhere, or nowhere."""
    rng = random.Random(29)
    chains = synthetic_chains(400, seed=5)
    p = make_block_policy(name, capacity=80)
    replay_blocks(chains, 80, p)
    keys = list(copy.deepcopy(p).victims(0.0))
    hits = 0
    for trial in range(40):
        share = 1.0 if trial == 0 else 0.0 if trial == 1 else rng.random()
        busy = [set(rng.sample(keys, int(len(keys) * share * rng.random()))) for _ in range(3)]
        if trial == 0:
            busy[0] = set(keys)
        q = copy.deepcopy(p)
        for k in rng.sample(keys, rng.randint(0, len(keys))):  # a state with reads of its own
            q.on_hit(BlockInfo(k, None, 0, 0, 1, 0.0, 1.0, 0), 1.0)
        a, b = copy.deepcopy(q), copy.deepcopy(q)
        gen = b.victims_except(0.0, *busy)
        want = next(gen, None)
        gen.close()
        assert a.pop_victim(0.0, *busy) == want
        assert vars(a).keys() == vars(b).keys()
        for attr, value in vars(a).items():
            if isinstance(value, dict):  # the queues, in order
                assert list(value.items()) == list(getattr(b, attr).items()), (name, attr)
        hits += want is not None
    assert hits > 20


@pytest.mark.parametrize("name", ["arc", "s3fifo", "lru"])
def test_batch_inserts_and_removes_leave_what_the_per_event_hooks_leave(name):
    """on_inserts and on_removes of a batch leave every queue, ghost list and target as
    on_insert and on_remove of each would, with ghosts coming back and lists trimmed."""
    rng = random.Random(31)
    cap = 12
    one, batch = make_block_policy(name, capacity=cap), make_block_policy(name, capacity=cap)
    tracked: list[int] = []
    seen: set[str] = set()  # the policy's queues that held something at some point
    for _ in range(300):
        if tracked and (rng.random() < 0.5 or len(tracked) > 30):
            keys = rng.sample(tracked, rng.randint(1, min(len(tracked), 6)))
            for k in keys:
                one.on_remove(k)
                tracked.remove(k)
            batch.on_removes(keys)
        else:
            new = [k for k in range(40) if k not in tracked]
            keys = rng.sample(new, rng.randint(1, min(len(new), 6)))
            for k in keys:
                one.on_insert(BlockInfo(k, None, 0, 0, 0, 0.0, 0.0, 0), 0.0)
            batch.on_inserts(keys, range(len(keys)), None, 0.0)
            tracked += keys
        if tracked and rng.random() < 0.3:
            k = rng.choice(tracked)
            for p in (one, batch):
                p.on_hit(BlockInfo(k, None, 0, 0, 1, 0.0, 1.0, 0), 1.0)
        for attr, value in vars(one).items():
            other = getattr(batch, attr)
            assert (list(value.items()) == list(other.items()) if isinstance(value, dict)
                    else value == other), (name, attr)
        seen |= {attr for attr, value in vars(one).items()
                 if attr.startswith("_") and isinstance(value, dict) and value}
    assert len(one) == len(tracked)
    if name == "arc":  # every list was used, ghosts came back and moved the target
        assert seen >= {"_t1", "_t2", "_b1", "_b2"} and one.p > 0
    if name == "s3fifo":
        assert seen >= {"_s", "_m", "_g"}


# -- tiers sharing one ghost history ------------------------------------------------------


def _tiers_run(share: bool, chains, caps=(60, 150, 400)):
    """Three ChainOdds told the same requests, device first; each tier keeps its own
    blocks (a miss is inserted on the device, the device's victim goes to the host, the
    host's to disk). Returns what left each tier, in order, and the policies."""
    pols = [_Recording(capacity=c) for c in caps]
    if share:
        assert ChainOdds.share_history(pols[0], pols[1:])
    idx = [BlockIndex() for _ in caps]
    handle = 0
    for t, chain in enumerate(chains):
        now = float(t)
        for p in pols:
            p.on_request(chain, now)
        for depth, key in enumerate(chain):
            for i, p in enumerate(pols):
                if key in idx[i]:
                    p.on_hit(idx[i].touch(key, now), now)
            if key in idx[0] or not pols[0].admit(key, depth, now):
                continue
            carry = [key]
            for i, p in enumerate(pols):
                nxt = []
                for k in carry:
                    if k in idx[i]:
                        continue
                    if len(idx[i]) >= caps[i]:
                        v = idx[i].choose_victim(p, now)
                        if v is None:
                            continue
                        for gone in idx[i].drop(v):
                            p.on_remove(gone.key)
                        nxt.append(v)
                    handle += 1
                    idx[i].insert(k, None, Tier.DEVICE, handle, now)
                    p.on_insert(idx[i].get(k), now)
                carry = nxt
    return [p.removed for p in pols], pols


@pytest.mark.parametrize("seed", [3, 8])
def test_tiers_sharing_one_history_decide_exactly_as_with_their_own(seed):
    """The host and disk policies reading the device policy's ghost history make every
    choice they made with their own copies (the history depends only on the requests),
    with density tables from their own learned stay; and they really share it."""
    chains = synthetic_chains(700, seed=seed)
    own, own_pols = _tiers_run(False, chains)
    shared, pols = _tiers_run(True, chains)
    assert [len(r) for r in own] == [len(r) for r in shared] and min(map(len, own)) > 50
    assert own == shared
    assert pols[1]._ghost is pols[0]._ghost and own_pols[1]._ghost is not own_pols[0]._ghost
    assert [p._stay for p in pols] == [p._stay for p in own_pols]
    assert [p._dens for p in pols] == [p._dens for p in own_pols]
    assert pols[1]._dens != pols[0]._dens  # each its own table
    for p in pols:
        p.check_integrity()


def test_a_policy_sharing_history_must_be_told_each_request_after_its_leader():
    lead, f = ChainOdds(capacity=10), ChainOdds(capacity=20)
    assert lead.share_history([f])
    with pytest.raises(RuntimeError, match="right after the policy that keeps it"):
        f.on_request(["a", "b"], 0.0)  # before the leader
    lead.on_request(["a", "b"], 0.0)
    with pytest.raises(RuntimeError, match="same keys"):
        f.on_request(["a", "c"], 0.0)
    f.on_request(["a", "b"], 0.0)
    assert f._t == lead._t == 1
    lead.on_request(["a"], 1.0)
    with pytest.raises(RuntimeError, match="was not told the last request"):
        lead.on_request(["a"], 2.0)  # the follower missed request 2


def test_share_history_refuses_what_it_cannot_share_exactly():
    assert not ChainOdds(capacity=10).share_history([])
    assert not ChainOdds(capacity=10).share_history([ChainOdds(capacity=10, horizon=64)])
    assert not ChainOdds(capacity=10).share_history([LRUBlocks()])
    used = ChainOdds(capacity=10)
    used.on_request(["a"], 0.0)
    assert not ChainOdds(capacity=10).share_history([used])
    a, b = ChainOdds(capacity=10), ChainOdds(capacity=10)
    assert not a.share_history([b, b]) and not a.share_history([a])
    assert a._followers == () and b._leader is None  # nothing changed
    assert a.share_history([b]) and not ChainOdds(capacity=10).share_history([b])


@pytest.mark.parametrize("name", sorted(NAMES))
def test_on_insert_key_is_on_insert(name):
    """Told of inserts by key and depth (the snapshot built only if the policy asks),
    every policy ends in the same state as when told with snapshots: the same victims in
    the same order, the same admissions."""
    chains = synthetic_chains(300, seed=9)
    index = BlockIndex()
    a, b = make_block_policy(name, capacity=50), make_block_policy(name, capacity=50)
    h = 0
    for t, chain in enumerate(chains):
        now = float(t)
        a.on_request(chain, now)
        b.on_request(chain, now)
        parent = None
        for depth, key in enumerate(chain):
            if key not in index:
                assert a.admit(key, depth, now) == b.admit(key, depth, now)
                if len(index) >= 50:
                    v = index.choose_victim(a, now)
                    assert v == index.choose_victim(b, now)
                    for gone in index.drop(v):
                        a.on_remove(gone.key)
                        b.on_remove(gone.key)
                h += 1
                if not index.insert(key, parent, Tier.DEVICE, h, now):
                    break
                a.on_insert(index.get(key), now)
                b.on_insert_key(key, index.depth(key), index.get, now)
            else:
                info = index.touch(key, now)
                a.on_hit(info, now)
                b.on_hit(info, now)
            parent = key
    assert list(copy.deepcopy(a).victims(1e9)) == list(copy.deepcopy(b).victims(1e9))
    assert len(a) == len(b) > 30


def test_on_insert_key_honours_a_subclass_own_on_insert():
    seen = []

    class Counting(ChainOdds):
        def on_insert(self, info, now):
            seen.append(info.key)
            super().on_insert(info, now)

    index = BlockIndex()
    index.insert("a", None, Tier.DEVICE, 1, 0.0)
    p = Counting(capacity=4)
    p.on_request(["a"], 0.0)
    p.on_insert_key("a", 0, index.get, 0.0)
    assert seen == ["a"] and "a" in p


def _one_block_policy(name):
    from tiering.policies.blocks.base import BlockInfo

    def info(k):
        return BlockInfo(k, None, 0, 0, 0, 0.0, 0.0, 0)

    p = make_block_policy(name, capacity=8)
    p.on_request([b"a"], 0.0)
    assert p.admit(b"a", 0, 0.0)
    p.on_insert(info(b"a"), 0.0)
    return p, info


def _policy_state(p):
    return len(p), list(p.victims(9.0))


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "lirs", "chain", "adaptive"])
def test_an_event_for_a_block_the_policy_does_not_hold_is_refused_by_name(name):
    """A second on_insert of a tracked block was taken silently (ARC then held a block read
    once in T2 and again in T1, counted twice by len); on_hit and on_remove of an untracked
    block raised a bare KeyError."""
    p, info = _one_block_policy(name)
    p.on_hit(info(b"a"), 1.0)  # in ARC it is now in T2
    before = _policy_state(p)
    with pytest.raises(ValueError, match=f"{name}: on_insert of block b'a', which the policy already tracks"):
        p.on_insert(info(b"a"), 2.0)
    with pytest.raises(ValueError, match=f"{name}: on_hit of block b'zz', which the policy does not track"):
        p.on_hit(info(b"zz"), 2.0)
    with pytest.raises(ValueError, match=f"{name}: on_remove of block b'zz', which the policy does not track"):
        p.on_remove(b"zz")
    assert _policy_state(p) == before == (1, [b"a"])
    p.on_remove(b"a")  # the control: the real removal works, and a second one is refused
    with pytest.raises(ValueError, match="on_remove of block b'a'"):
        p.on_remove(b"a")
    assert len(p) == 0


def test_chain_refuses_a_hit_on_a_block_it_does_not_track():
    p, info = _one_block_policy("chain")
    with pytest.raises(ValueError, match="b'zz'"):
        p.on_hit(info(b"zz"), 1.0)
    assert len(p) == 1


def test_chain_refuses_a_second_insert_of_a_tracked_block():
    p, info = _one_block_policy("chain")
    with pytest.raises(ValueError, match="b'a'"):
        p.on_insert(info(b"a"), 1.0)


def test_the_block_registry_refuses_a_wrong_registry_by_name():
    """make_block_policy took any registry: a PolicyRegistry built a request policy (LRU of
    policies) where a block policy was asked for, a dict failed with a bare AttributeError."""
    from tiering.policies import default_registry

    for wrong in (default_registry(), {"lru": LRUBlocks}, 3):
        with pytest.raises(TypeError,
                           match="make_block_policy: registry must be a BlockPolicyRegistry"):
            make_block_policy("lru", registry=wrong, capacity=4)
        with pytest.raises(TypeError,
                           match="register_block_policy: registry must be a BlockPolicyRegistry"):
            register_block_policy("mine", LRUBlocks, registry=wrong)
    # the control: a block registry, given or not, still builds block policies
    mine = register_block_policy("mine", LRUBlocks)
    assert isinstance(make_block_policy("mine", registry=mine, capacity=4), LRUBlocks)
    assert isinstance(make_block_policy("lru", capacity=4), LRUBlocks)


class _Recorder(BlockPolicy):
    """A user's LRU with the default ``admit`` and batch hooks that logs every call it gets,
    with each snapshot whole (``children`` included)."""

    name = "recorder"

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict = OrderedDict()
        self.log: list[tuple] = []

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def on_request(self, keys, now) -> None:
        self.log.append(("request", tuple(keys), now))

    def on_insert(self, info, now) -> None:
        self.log.append(("insert", tuple(info), now))
        self._order[info.key] = None

    def on_hit(self, info, now) -> None:
        self.log.append(("hit", tuple(info), now))
        self._order.move_to_end(info.key)

    def on_remove(self, key) -> None:
        self.log.append(("remove", key))
        del self._order[key]

    def victims(self, now):
        # the most recent first now and then, so victims have cached descendants
        if int(now) % 3 == 0:
            yield from reversed(self._order)
        else:
            yield from self._order


class _AdmitsEach(_Recorder):
    """The same policy with an ``admit`` of its own (True, logging nothing): the default
    publish then offers each block in turn."""

    def admit(self, key, depth, now) -> bool:
        return True


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_default_publish_tells_a_user_policy_what_offering_each_block_does(seed):
    """With the default ``admit``, the default ``on_publish`` inserts the blocks there is
    room for at once; the policy is told the same events in the same order with the same
    snapshots as when each block is offered in turn, while blocks arrive in runs and
    victims are made, and the replay is the per-event loop's."""
    chains = synthetic_chains(150, seed)
    cap = random.Random(seed).randint(10, 40)
    each, runs = _AdmitsEach(cap), _Recorder(cap)
    a = replay_blocks(chains, cap, each, check_every=5)
    b = replay_blocks(chains, cap, runs, check_every=5)
    assert a[:9] == b[:9] == replay_blocks(chains, cap, _Recorder(cap), batch=False)[:9]
    assert a.evicted > 0 and a.orphaned > 0
    assert each.log == runs.log
    pairs = zip(runs.log, runs.log[1:], strict=False)
    after = sum(1 for x, y in pairs if x[0] == y[0] == "insert"
                and y[1][1] == x[1][0])  # a block told right after its parent
    assert after > 100


@pytest.mark.parametrize("hook", ["_insert", "_track", "_density", "on_remove", "on_insert"])
@pytest.mark.parametrize("batch", [True, False])
def test_a_chain_subclass_changing_an_inner_hook_has_it_called_and_the_same_answers(
        hook, batch):
    """The batch hooks do some hooks' work inline; a subclass that replaces one of them
    (here with one that calls ChainOdds' own) has its hook called, and the replay is
    that of ChainOdds."""
    chains = synthetic_chains(500, 3)
    cap = 90
    calls = []

    def wrapped(self, *args):
        calls.append(hook)
        return getattr(ChainOdds, hook)(self, *args)

    sub = type("Sub", (ChainOdds,), {hook: wrapped})
    plain = replay_blocks(chains, cap, ChainOdds(cap), batch=batch)
    other = replay_blocks(chains, cap, sub(cap), check_every=41, batch=batch)
    assert plain[2:9] == other[2:9]
    assert plain.refused > 0 and plain.evicted > 0, "nothing was refused or evicted"
    # each event through the subclass's hook: every insert, removal, track, refusal
    at_least = {"_insert": other.inserted, "on_insert": other.inserted,
                "on_remove": other.evicted + other.orphaned,
                "_track": other.inserted + other.hits, "_density": other.refused}[hook]
    assert len(calls) >= at_least > 0, f"{hook} of the subclass was called {len(calls)} times"


def _random_chain_events(p, rng, steps):
    """Drive ``p`` with random requests, inserts, hits, removes and victim pops (classes
    emptied and refilled, densities tied across classes at the start), calling
    ``check_integrity`` (the cached lowest end against a recomputation, and the floor
    kept under the other classes) after every event; return how many events ran."""
    pool = [rng.randbytes(4) for _ in range(rng.randint(30, 120))]
    now, events = 0.0, 0
    for _ in range(steps):
        now += 1.0
        keys = rng.sample(pool, rng.randint(1, 12))
        p.on_request(keys, now)
        events += 1
        p.check_integrity()
        for i, k in enumerate(keys):
            op = rng.random()
            if k in p:
                if op < 0.6:
                    p.on_hit(BlockInfo(k, None, i + 1, 0, 1, now, now, 0), now)
                else:
                    p.on_remove(k)
            elif len(p) < p.capacity or op < 0.3:
                p.on_insert(BlockInfo(k, None, i + 1, 0, 0, now, now, 0), now)
            else:
                v = p.pop_victim(now, _NOTHING_BUSY, _NOTHING_BUSY, set(keys[:i]))
                if v is not None:
                    p.on_remove(v)
                    p.on_insert(BlockInfo(k, None, i + 1, 0, 0, now, now, 0), now)
            events += 1
            p.check_integrity()
        if rng.random() < 0.1:  # empty some classes outright
            for k in [k for k in p._meta if rng.random() < 0.5]:
                p.on_remove(k)
                events += 1
                p.check_integrity()
    return events


_NOTHING_BUSY: frozenset = frozenset()


@pytest.mark.parametrize("seed", range(8))
def test_chain_lowest_end_equals_a_recomputation_after_every_event(seed):
    rng = random.Random(seed)
    p = ChainOdds(capacity=rng.randint(5, 60), horizon=rng.randint(2, 64),
                  max_turn=rng.randint(1, 4), max_reads=rng.randint(1, 3),
                  length_classes=rng.randint(0, 3), branch_classes=rng.random() < 0.5)
    assert _random_chain_events(p, rng, 150) > 1000
    assert p._lowest_from_scratch() is not None or not len(p)


def test_chain_check_integrity_catches_a_floor_above_another_class():
    rng = random.Random(1)
    p = ChainOdds(capacity=40)
    _random_chain_events(p, rng, 40)
    p.check_integrity()
    others = [e for e in p._lows if e[1] != p._best[1] and e[0] < float("inf")]
    assert others
    p._floor = (max(e[0] for e in others) + 1.0, 0, None)  # a floor above some other class
    with pytest.raises(AssertionError, match="below the floor"):
        p.check_integrity()


def test_a_lirs_subclass_changing_its_per_event_hooks_has_them_called_through_batches():
    """LIRS's batch hooks (inserts, hits, publish, victims) skip its per-event hooks; a
    subclass that changes one has it called for every event, and with the hooks
    unchanged the replay is the plain policy's (hits, evictions). A control with no
    override takes the batch path: its per-event hooks are never called."""
    from tiering.policies.blocks.adaptive import LIRSBlocks

    chains = synthetic_chains(300, seed=9)

    def counting(override: bool):
        calls = {"on_insert": 0, "on_hit": 0, "victims": 0}

        class Counting(LIRSBlocks):
            def on_insert(self, info, now):
                calls["on_insert"] += 1
                super().on_insert(info, now)

            def on_hit(self, info, now):
                calls["on_hit"] += 1
                super().on_hit(info, now)

            def victims(self, now):
                calls["victims"] += 1
                return super().victims(now)

        if not override:
            for name in calls:
                delattr(Counting, name)
        return Counting(capacity=60), calls

    plain = replay_blocks(chains, 60, LIRSBlocks(capacity=60), slim=False)
    p, calls = counting(True)
    res = replay_blocks(chains, 60, p, slim=False)
    assert res[2:9] == plain[2:9] and plain.evicted > 0
    assert calls["on_insert"] == plain.inserted and calls["on_hit"] == plain.hits
    assert calls["victims"] > 0
    q, none = counting(False)
    assert replay_blocks(chains, 60, q, slim=False)[2:9] == plain[2:9]
    assert none == {"on_insert": 0, "on_hit": 0, "victims": 0}
