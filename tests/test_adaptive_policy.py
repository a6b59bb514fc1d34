"""The adaptive block policy and the LIRS-like baseline: the shared contract, a state
machine over a real ``BlockIndex`` (with the lead changing hands often), bounded ghost
state, and that the lead goes to the expert that pays."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant
from test_block_policy_state_machine import PolicyMachine
from tiering.policies.blocks import (
    AdaptiveBlocks,
    ARCBlocks,
    BlockInfo,
    ChainOdds,
    LIRSBlocks,
    LRUBlocks,
    S3FIFOBlocks,
)
from tiering.policies.blocks.adaptive import GHOST_FACTOR, _key_insert, _sample_value

from tiering.blocks import BlockIndex, synth
from tiering.blocks.replay import replay_blocks
from tiering.testing.blocks import check_block_policy
from tiering.types import Tier


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("factory", [
    AdaptiveBlocks,
    lambda capacity: AdaptiveBlocks(capacity, window=8, margin=0.0, z=0.0),  # leads swap often
    lambda capacity: AdaptiveBlocks(capacity, rate=1 if capacity < 4 else 4),
    LIRSBlocks,
    lambda capacity: LIRSBlocks(capacity, reuse_only=True),
], ids=["default", "restless", "sampled", "lirs", "lirs-reuse-only"])
def test_contract(factory, seed):
    check_block_policy(factory, seed=seed)


class AdaptiveMachine(PolicyMachine):
    """The shared machine, with an adaptive policy whose lead changes hands at the
    slightest difference; after every step every expert tracks exactly the index's
    blocks and the ghost state is within its bound."""

    @initialize(capacity=st.integers(1, 8), window=st.integers(1, 6),
                experts=st.permutations(["chain", "s3fifo", "arc", "lirs", "lru"]))
    def setup(self, capacity, window, experts):
        self.name, self.capacity = "adaptive", capacity
        self.policy = AdaptiveBlocks(capacity, experts=experts, window=window,
                                     margin=0.0, z=0.0)
        self.index = BlockIndex()
        self.now = 0.0
        self.next_key = 0
        self.slot = 0
        self.pinned = {}

    @invariant()
    def experts_agree_and_ghosts_are_bounded(self):
        if not hasattr(self, "policy"):
            return
        tracked = set(self.index.keys())
        for name, p in zip(self.policy.expert_names, self.policy._experts, strict=True):
            assert len(p) == len(tracked), (name, len(p), len(tracked))
            assert all(k in p for k in tracked), name
        assert self.policy.ghost_entries <= GHOST_FACTOR * self.capacity


AdaptiveMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestAdaptiveMachine = AdaptiveMachine.TestCase


def _replay_watching(chains, capacity, policy, watch):
    """``replay_blocks`` with ``watch(policy)`` after every request (through on_request
    of the next one, and once at the end; the per-event path, where on_request is
    called, not the batch hooks, which go round it)."""
    seen = []
    inner_request = policy.on_request

    def on_request(keys, now):
        seen.append(watch(policy))
        inner_request(keys, now)

    policy.on_request = on_request
    r = replay_blocks(chains, capacity, policy, batch=False)
    seen.append(watch(policy))
    assert len(seen) == len(chains) + 1
    return r, seen


@pytest.mark.parametrize("capacity", [50, 300])
def test_ghost_state_stays_within_its_bound_and_is_used(capacity):
    """A scan-heavy workload fills every ghost list: the ghosts reach a good part of the
    bound (so it is the bound, not a quiet workload, that holds them) and never pass it.
    ChainOdds' own history is bounded by its horizon in requests, not by capacity."""
    chains = synth.scan_mix_chains(1500, 3, synth.ScanMixConfig(hot=60, scan_blocks_mean=40.0))
    policy = AdaptiveBlocks(capacity)
    longest = max(map(len, chains))
    _, seen = _replay_watching(chains, capacity, policy,
                               lambda p: (p.ghost_entries, p.history_entries))
    ghosts = [g for g, _ in seen]
    assert max(ghosts) <= GHOST_FACTOR * capacity
    assert max(ghosts) >= capacity, "the ghost lists were never filled: the test proves nothing"
    chain_policies = 2  # the chain expert and its shadow
    horizon = policy._experts[policy.expert_names.index("chain")].horizon
    assert max(h for _, h in seen) <= chain_policies * horizon * longest


def test_lirs_ghosts_are_cut_at_their_bound():
    """The negative control of the bound: on a scan past blocks that are never read again
    (they stay LIR at the bottom of the stack, so nothing prunes the ghosts above them)
    LIRS holds exactly as many ghosts as its bound allows, and more with a larger one."""
    rng = random.Random(4)
    chains = [[rng.randbytes(16)] for _ in range(600)]
    held = {}
    for factor in (0.5, 4.0):
        p = LIRSBlocks(40, ghost_factor=factor)
        _, seen = _replay_watching(chains, 40, p, lambda q: q.ghosts)
        assert max(seen) <= p.ghost_bound
        held[factor] = max(seen)
    assert held[0.5] == LIRSBlocks(40, ghost_factor=0.5).ghost_bound
    assert held[4.0] > held[0.5]


def test_lirs_keeps_a_loop_slightly_larger_than_the_tier_where_lru_keeps_nothing():
    chains = synth.loop_chains(400, 110, chain_blocks=1)
    lirs = replay_blocks(chains, 100, LIRSBlocks(100))
    lru = replay_blocks(chains, 100, LRUBlocks(100))
    assert lru.hits == 0
    assert lirs.hits > 0.8 * (400 - 110)  # all but the first pass, nearly


def test_the_lead_goes_to_the_expert_that_pays_and_the_result_follows_it():
    """On a loop a little larger than the tier, recency (LRU) gets nothing and LIRS
    nearly everything: an adaptive policy told to start from LRU hands the lead to LIRS
    and ends far above LRU. The control: the same policy with the lead never changing
    hands (z too high to pass) stays with LRU and gets what LRU gets."""
    chains = synth.loop_chains(1500, 330, chain_blocks=3)
    cap = 300
    lru = replay_blocks(chains, cap, AdaptiveBlocks(cap, experts=("lru",)))
    moving = AdaptiveBlocks(cap, experts=("lru", "lirs"), rate=1, window=200)
    stuck = AdaptiveBlocks(cap, experts=("lru", "lirs"), rate=1, window=200, z=100.0,
                           margin=1.0)
    r_moving = replay_blocks(chains, cap, moving)
    r_stuck = replay_blocks(chains, cap, stuck)
    assert moving.leader_name == "lirs" and moving.switches >= 1
    assert stuck.leader_name == "lru" and stuck.switches == 0
    assert r_stuck.hits == lru.hits
    assert r_moving.hit_rate > lru.hit_rate + 0.5


def test_sampling_is_the_same_for_equal_keys_of_any_process():
    """The shadow sample reads a key's bytes, not Python's per-process hash of them."""
    rng = random.Random(5)
    key = rng.randbytes(16)
    assert _sample_value(key) == int.from_bytes(key[-8:], "little")
    assert _sample_value(12345) == 12345


@pytest.mark.parametrize("kw, word", [
    ({"capacity": 0}, "capacity"),
    ({"capacity": 10, "experts": ()}, "experts"),
    ({"capacity": 10, "experts": ("lru", "nope")}, "experts"),
    ({"capacity": 10, "experts": ("lru", "lru")}, "experts"),
    ({"capacity": 10, "rate": 0}, "rate"),
    ({"capacity": 10, "rate": 11}, "rate"),
    ({"capacity": 10, "window": 0}, "window"),
    ({"capacity": 10, "margin": -0.1}, "margin"),
    ({"capacity": 10, "z": -1.0}, "z"),
    ({"capacity": 10, "hold": -1}, "hold"),
    ({"capacity": 10, "hold": 2.5}, "hold"),
])
def test_adaptive_rejects_bad_parameters_by_name(kw, word):
    with pytest.raises(ValueError, match=word):
        AdaptiveBlocks(**kw)


@pytest.mark.parametrize("kw, word", [
    ({"capacity": 0}, "capacity"),
    ({"capacity": 10, "hir_fraction": 0.0}, "hir_fraction"),
    ({"capacity": 10, "ghost_factor": -1.0}, "ghost_factor"),
    ({"capacity": 10, "reuse_only": 1}, "reuse_only"),
])
def test_lirs_rejects_bad_parameters_by_name(kw, word):
    with pytest.raises(ValueError, match=word):
        LIRSBlocks(**kw)


def _info_of(key, depth=0):
    return BlockInfo(key, None, depth, 1, 0, 0.0, 0.0, 0)


@pytest.mark.parametrize("reuse_only", [False, True])
def test_lirs_reuse_only_refills_its_lir_set_by_reuse_not_by_first_reads(reuse_only):
    """A full LIRS tier loses LIR blocks to another policy's victims (as the adaptive
    policy's LIRS expert does while another expert leads). Plain LIRS makes the next
    first reads LIR (and evicts its old HIR block first); with ``reuse_only`` they wait
    as HIR and go first, and one read again inside the stack joins the LIR set without
    demoting a LIR block."""
    rng = random.Random(7)
    cap = 20
    p = LIRSBlocks(cap, hir_fraction=0.1, reuse_only=reuse_only)
    keys = rng.sample(range(10**9), cap + 4)
    for k in keys[:cap]:
        p.on_insert(_info_of(k), 0.0)
    old_hir = list(p._q)
    assert len(old_hir) == 2 and len(p) == cap
    lost = [k for k in keys[:cap] if k in p._lir][:3]
    for k in lost:  # another policy's victims
        p.on_remove(k)
    fresh = keys[cap:cap + 3]
    for k in fresh:
        p.on_insert(_info_of(k), 0.0)
    first = list(p.victims(0.0))[:5]
    if not reuse_only:
        assert first[:2] == old_hir and not set(fresh) & set(first)
        return
    assert first == old_hir + fresh
    lir_before = set(p._lir)
    p.on_hit(_info_of(fresh[1]), 0.0)  # read again inside the stack: LIR, nobody demoted
    assert set(p._lir) == lir_before | {fresh[1]}
    assert list(p.victims(0.0))[:4] == [*old_hir, fresh[0], fresh[2]]


def test_a_refused_admission_of_the_leader_inserts_nothing_anywhere():
    """The leader's answer is the policy's answer; the other experts are still asked (ARC
    reads its ghosts there) and none of them is told of a block that was not inserted."""
    idx = BlockIndex()
    p = AdaptiveBlocks(2, experts=("chain", "lru"), rate=1)
    rng = random.Random(2)
    keys = [rng.randbytes(16) for _ in range(40)]
    refused = 0
    for t, k in enumerate(keys):
        p.on_request([k], float(t))
        if not p.admit(k, 0, float(t)):
            refused += 1
            assert all(k not in e for e in p._experts)
            continue
        while len(idx) >= 2:
            v = idx.choose_victim(p, float(t))
            for d in idx.drop(v):
                p.on_remove(d.key)
        idx.insert(k, None, Tier.DEVICE, t, float(t))
        p.on_insert(idx.get(k), float(t))
        assert all(k in e for e in p._experts)
    assert refused > 0, "chain never refused a block read once: the test proves nothing"


def test_check_integrity_names_an_expert_that_fell_out_of_step():
    """The control first: a replay leaves every expert in step. Then one expert is told
    of a removal the others were not: the check names it."""
    chains = synth.session_chains(300, 1, synth.SessionConfig(live=10))
    p = AdaptiveBlocks(40)
    replay_blocks(chains, 40, p, check_every=1)
    p.check_integrity()
    name = next(n for n in p.expert_names if n != p.leader_name)
    other = p._experts[p.expert_names.index(name)]
    other.on_remove(next(iter(p.leader.victims(0.0))))
    with pytest.raises(AssertionError, match=f"expert {name} tracks"):
        p.check_integrity()


def test_check_integrity_names_a_shadow_whose_tree_fell_out_of_step():
    """The control first: after a replay every shadow's parents and children match its
    policy. Then a shadow forgets a held block's parent, or a child link: the check
    names the shadow."""
    chains = synth.session_chains(300, 1, synth.SessionConfig(live=10))
    p = AdaptiveBlocks(40)
    replay_blocks(chains, 40, p)
    p.check_integrity()
    s = p._shadows[p.expert_names.index("s3fifo")]
    up, kids = next(iter(s.kids.items()))
    kid = next(iter(kids))
    del s.parents[kid]
    with pytest.raises(AssertionError, match="s3fifo shadow's parents"):
        p.check_integrity()
    s.parents[kid] = up
    p.check_integrity()
    del kids[kid]
    with pytest.raises(AssertionError, match="s3fifo shadow's children"):
        p.check_integrity()


@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc", "lirs"])
def test_a_full_size_shadow_is_the_real_tier(name):
    """A shadow over every block (rate 1) is a tier of the same size: like the block index
    it drops an evicted block's cached descendants, so for a policy that reads only keys
    it scores exactly the hits of a real replay. Before shadows dropped descendants,
    S3-FIFO's and ARC's shadows kept orphans and scored otherwise."""
    from tiering.policies.blocks import make_block_policy
    from tiering.policies.blocks.adaptive import _Shadow

    chains = synth.session_chains(800, 7, synth.SessionConfig(live=40))
    cap = 120
    real = replay_blocks(chains, cap, make_block_policy(name, capacity=cap))
    shadow = _Shadow(make_block_policy(name, capacity=cap), cap)
    hits = sum(shadow.request(list(c), float(t)) for t, c in enumerate(chains))
    assert real.orphaned > 0, "no eviction dropped descendants: the test proves nothing"
    assert hits == real.hits
    held = set(shadow.parents)
    assert len(held) == len(shadow.policy) and all(k in shadow.policy for k in held)
    assert all(p is None or p in held for p in shadow.parents.values())


def test_a_shadow_victim_takes_its_descendants_and_a_leaf_only_itself():
    from tiering.policies.blocks.adaptive import _Shadow

    rng = random.Random(8)
    a, b, c, d, e = (rng.randbytes(16) for _ in range(5))
    shadow = _Shadow(LRUBlocks(3), 3)
    shadow.request([a, b, c], 0.0)  # LRU's first victim is the root a
    shadow.request([d], 1.0)
    assert set(shadow.parents) == {d} and len(shadow.policy) == 1
    shadow.request([d, e], 2.0)
    shadow.request([a], 3.0)
    shadow.request([b], 4.0)  # full: the victim is d, and e goes with it
    assert set(shadow.parents) == {a, b}
    shadow.request([a, c], 5.0)
    shadow.request([e], 6.0)  # the victim is the leaf b, which takes nothing else
    assert set(shadow.parents) == {a, c, e}
    assert shadow.kids == {a: {c: None}}


def test_a_shadow_reparents_a_block_read_below_another_parent_and_stops_at_a_repeat():
    """Keys that are not content addressed: a held block read after another block
    moves below it (so a victim never takes a block of the request in hand with it);
    a chain through one block twice (the index refuses it) stops there, and the
    shadow stays a forest whose victims take whole subtrees."""
    from tiering.policies.blocks.adaptive import _Shadow

    shadow = _Shadow(LRUBlocks(4), 4)
    shadow.request([1, 2], 0.0)
    shadow.request([3, 2], 1.0)  # 2 was held below 1: now below 3
    assert shadow.parents == {1: None, 2: 3, 3: None} and shadow.kids == {3: {2: None}}
    # 2 becomes a root and 3 goes below it; the second 2 is a repeat: the chain stops
    shadow.request([2, 3, 2, 9], 2.0)
    assert shadow.parents == {1: None, 2: None, 3: 2} and shadow.kids == {2: {3: None}}
    shadow.request([5, 6, 7], 3.0)  # full: the victims are 1, then 2 with 3 below it
    assert shadow.parents == {5: None, 6: 5, 7: 6} and len(shadow.policy) == 3


def _agent_tier():
    """Agents at a small tier, where S3-FIFO's filter of one-read blocks pays more than
    ChainOdds' odds (it does on the tuning generators' seeds)."""
    return synth.agent_chains(4000, 100), 300


def test_the_lead_passes_to_s3fifo_where_it_pays_and_stays_with_chain_where_chain_does():
    chains, cap = _agent_tier()
    r_chain = replay_blocks(chains, cap, AdaptiveBlocks(cap, experts=("chain",))).hit_rate
    r_s3 = replay_blocks(chains, cap, AdaptiveBlocks(cap, experts=("s3fifo",))).hit_rate
    assert r_s3 > r_chain + 0.01, "the workload does not favour S3-FIFO: the test proves nothing"
    p = AdaptiveBlocks(cap, experts=("chain", "s3fifo"))
    r = replay_blocks(chains, cap, p).hit_rate
    assert p.leader_name == "s3fifo" and p.switches == 1
    assert r > r_chain + 0.5 * (r_s3 - r_chain)
    # the control: on conversations ChainOdds pays, and the same policy ends with it,
    # nearer ChainOdds alone than S3-FIFO alone
    conv = synth.synthetic_chains(4000, 100)
    c_chain = replay_blocks(conv, cap, AdaptiveBlocks(cap, experts=("chain",))).hit_rate
    c_s3 = replay_blocks(conv, cap, AdaptiveBlocks(cap, experts=("s3fifo",))).hit_rate
    assert c_chain > c_s3 + 0.005, "conversations do not favour ChainOdds: the test proves nothing"
    q = AdaptiveBlocks(cap, experts=("chain", "s3fifo"))
    c = replay_blocks(conv, cap, q).hit_rate
    assert q.leader_name == "chain" and q.switches <= 2
    assert c > c_s3 + 0.5 * (c_chain - c_s3)


def test_the_lead_does_not_change_hands_while_held_then_does():
    """With any difference enough (z 0, margin 0), the lead still stays for ``hold``
    requests, and the shadows' hits of those requests are not counted; then it moves."""
    chains, cap = _agent_tier()
    p = AdaptiveBlocks(cap, experts=("chain", "s3fifo"), z=0.0, margin=0.0, hold=200)
    _, seen = _replay_watching(chains[:600], cap, p, lambda q: (q.switches, dict(q.scores)))
    # seen[i]: after i requests
    assert all(sw == 0 and all(v == 0.0 for v in sc.values()) for sw, sc in seen[:201])
    assert any(v > 0.0 for _, sc in seen[201:] for v in sc.values())
    assert seen[-1][0] >= 1, "the lead never moved after the hold: the test proves nothing"


class _AskEveryExpert(AdaptiveBlocks):
    """The adaptive policy asking every expert's ``admit`` on every block, as it did
    before a read-only ``admit`` of an expert that does not lead was skipped."""

    def admit(self, key, depth, now):
        answers = [p.admit(key, depth, now) for p in self._experts]
        return answers[self._experts.index(self.leader)]


def test_an_expert_not_leading_is_asked_to_admit_only_where_its_admit_records():
    """ChainOdds' admit only reads, ARC's notes a ghost: with LRU leading throughout,
    ChainOdds is never asked and ARC always is, and every decision is the one of a
    policy that asks them all (the control: the same replay through it, where ChainOdds
    is asked, ends with the same hits, evictions and expert state)."""
    chains = synth.session_chains(600, 11, synth.SessionConfig(live=20))
    cap = 60
    calls = {}

    def counted(policy):
        for name, e in zip(policy.expert_names, policy._experts, strict=True):
            inner = e.admit

            def admit(key, depth, now, _inner=inner, _name=name):
                calls[_name] = calls.get(_name, 0) + 1
                return _inner(key, depth, now)

            e.admit = admit
        return policy

    kw = {"experts": ("lru", "chain", "arc"), "z": 100.0, "margin": 1.0}
    skip = counted(AdaptiveBlocks(cap, **kw))
    r_skip = replay_blocks(chains, cap, skip)
    asked_skip, calls = calls, {}
    every = counted(_AskEveryExpert(cap, **kw))
    r_every = replay_blocks(chains, cap, every)
    assert skip.leader_name == every.leader_name == "lru"
    assert asked_skip.get("chain", 0) == 0 and asked_skip["arc"] == asked_skip["lru"] > 0
    assert calls["chain"] == calls["arc"] > 0, "the control never asked ChainOdds"
    assert r_skip == r_every._replace(seconds=r_skip.seconds)
    for a, b in zip(skip._experts, every._experts, strict=True):
        assert list(a.victims(0.0)) == list(b.victims(0.0))


def test_last_switch_is_the_request_the_lead_changed_hands_at():
    """None while the first leader leads; after a change, the number of the request whose
    shadow hits moved it (past the hold, at most the requests served)."""
    chains, cap = _agent_tier()
    p = AdaptiveBlocks(cap, experts=("chain", "s3fifo"), z=0.0, margin=0.0, hold=200)
    _, seen = _replay_watching(chains[:600], cap, p, lambda q: (q.switches, q.last_switch))
    assert all(at is None for sw, at in seen if sw == 0)
    first = next(i for i, (sw, _) in enumerate(seen) if sw == 1)
    assert seen[first][1] == first  # seen[i]: after i requests
    assert 200 < seen[-1][1] <= 600 and seen[-1][0] >= 1


@pytest.mark.parametrize("name", ["chain", "s3fifo", "arc", "lru"])
def test_a_shadow_tells_its_held_prefix_in_one_commit_with_the_same_effect(name):
    """A shadow tells the blocks a request finds held in one ``on_commit``. Against the
    same expert whose ``on_hit`` is its own (so ``on_commit`` falls back to one
    ``on_hit`` per block), every request scores the same hits and the expert ends in
    the same order; the batch path did run (it was told hits through ``on_commit``)."""
    from tiering.policies.blocks import make_block_policy
    from tiering.policies.blocks.adaptive import _Shadow

    base = type(make_block_policy(name, capacity=4))

    class PerEvent(base):
        def on_hit(self, info, now):
            super().on_hit(info, now)

    chains = synth.session_chains(700, 12, synth.SessionConfig(live=30))
    cap = 150
    batch = _Shadow(make_block_policy(name, capacity=cap), cap)
    told = []
    inner = batch.policy.on_commit

    def on_commit(keys, hits, depths, get, now):
        told.append(len(hits))
        inner(keys, hits, depths, get, now)

    batch.policy.on_commit = on_commit
    single = _Shadow(PerEvent(capacity=cap), cap)
    for t, c in enumerate(chains):
        assert batch.request(list(c), float(t)) == single.request(list(c), float(t)), t
    assert sum(told) > 0, "no request found a held block: the test proves nothing"
    assert list(batch.policy.victims(0.0)) == list(single.policy.victims(0.0))
    assert batch.parents == single.parents


def _adaptive_state(p: AdaptiveBlocks) -> tuple:
    return (p.leader_name, p.switches, p.last_switch, p.scores, p.history_entries,
            list(p.leader.victims(0.0)), [list(s.parents) for s in p._shadows])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_shadow_reads_its_experts_chain_history_and_nothing_changes(monkeypatch, seed):
    """At rate 1 the chain shadow is told the expert's requests and reads its history
    (ChainOdds.share_history) instead of keeping a copy: with the lead changing hands
    often, the replay, the scores and every expert's order are those of a run where each
    keeps its own, and the sharing really happened; a sampled shadow shares nothing."""
    from tiering.policies.blocks.chain import ChainOdds

    chains = synth.synthetic_chains(700, seed)
    cap = 150

    def make(rate=1):
        return AdaptiveBlocks(cap, window=8, margin=0.0, z=0.0, hold=0, rate=rate)

    shared = make()
    one = replay_blocks(chains, cap, shared, check_every=37)
    expert = shared._experts[shared.expert_names.index("chain")]
    shadow = shared._shadows[shared.expert_names.index("chain")].policy
    assert shadow._leader is expert and shadow._ghost is expert._ghost
    assert shared.switches >= 2, "the lead never changed hands: the test proves less"
    sampled = make(rate=4)
    replay_blocks(chains[:50], cap, sampled)
    assert sampled._shadows[sampled.expert_names.index("chain")].policy._leader is None
    with monkeypatch.context() as m:
        m.setattr(ChainOdds, "share_history", lambda self, others: False)
        own = make()
        two = replay_blocks(chains, cap, own, check_every=37)
        assert own._shadows[own.expert_names.index("chain")].policy._leader is None
    assert one[:9] == two[:9]
    assert _adaptive_state(shared) == _adaptive_state(own)


def test_tiers_adaptive_policies_share_one_chain_history(monkeypatch):
    """Three tiers' adaptive policies told the same requests in turn (as a block store
    tells its device, host and disk policies) read one ChainOdds history: every
    request scores the same hits in each tier and every policy ends in the state of
    tiers that keep their own; share_history refuses what it cannot share."""
    from tiering.policies.blocks.adaptive import _Shadow
    from tiering.policies.blocks.chain import ChainOdds

    chains = synth.session_chains(500, 5, synth.SessionConfig(live=30))
    caps = (60, 120, 240)

    def run(share):
        pols = [AdaptiveBlocks(c, window=8, margin=0.0, z=0.0, hold=0) for c in caps]
        if share:
            assert pols[0].share_history(pols[1:])
            assert not pols[0].share_history(pols[1:])  # linked already
        tiers = [_Shadow(p, c) for p, c in zip(pols, caps, strict=True)]
        hits = [[t.request(c, float(i)) for t in tiers] for i, c in enumerate(chains)]
        for p in pols:
            p.check_integrity()
        return pols, hits

    pols, hits = run(True)
    lead = pols[0]._chains[0]
    chains_of = [c for p in pols for c in p._chains]
    assert all(c._leader is lead for c in chains_of[1:]) and lead._leader is None
    with monkeypatch.context() as m:
        m.setattr(ChainOdds, "share_history", lambda self, others: False)
        own, own_hits = run(False)
    assert hits == own_hits
    assert [_adaptive_state(p) for p in pols] == [_adaptive_state(p) for p in own]
    assert sum(map(sum, hits)) > 0, "nothing was ever held: the test proves nothing"
    fresh = AdaptiveBlocks(10)
    assert not fresh.share_history([])
    assert not fresh.share_history([fresh])
    assert not fresh.share_history([AdaptiveBlocks(10, rate=2)])
    assert not fresh.share_history([AdaptiveBlocks(10, experts=("lru", "arc"))])
    used = AdaptiveBlocks(10)
    used.on_request([1, 2], 0.0)
    assert not fresh.share_history([used])
    assert fresh.share_history([AdaptiveBlocks(20)])


def test_an_insert_of_a_held_block_by_key_is_refused_and_changes_nothing():
    rng = random.Random(7)
    keys = [rng.randbytes(16) for _ in range(6)]
    p = AdaptiveBlocks(10)
    p.on_request(keys, 0.0)
    info = {}
    for d, k in enumerate(keys):
        info[k] = (k, keys[d - 1] if d else None, d, 1, 0, 0.0, 0.0, 0)
        p.on_insert_key(k, d, lambda key: BlockInfo(*info[key]), 0.0)
    before = [list(e.victims(0.0)) for e in p._experts]
    with pytest.raises(ValueError, match="already tracks"):
        p.on_insert_key(keys[3], 3, lambda key: BlockInfo(*info[key]), 0.0)
    assert [list(e.victims(0.0)) for e in p._experts] == before
    assert all(len(e) == len(keys) for e in p._experts)


@pytest.mark.parametrize("make_room", ["drop", "offload"])
def test_a_stores_adaptive_tiers_share_one_chain_history_and_the_run_is_the_same(
        monkeypatch, make_room):
    """In a full replay the block store lets its host and disk adaptive policies read
    the device one's ChainOdds history: the run equals one where every ChainOdds keeps
    its own, and the sharing really happened."""
    import dataclasses

    from conftest import conversation_trace
    from replay_helpers import COST, SIM
    from tiering.policies.blocks.chain import ChainOdds

    from tiering.apps.replay.simulator import RunSpec, simulate

    sim = dataclasses.replace(SIM, make_room=make_room, block_policy="adaptive")
    real = ChainOdds.share_history
    shared = []

    def counting(self, others):
        out = real(self, others)
        shared.append((len(others), out))
        return out

    trace = conversation_trace(31, 200, shared=0.6)
    spec = RunSpec("tiering", "lru")
    with monkeypatch.context() as m:
        m.setattr(ChainOdds, "share_history", counting)
        one = simulate(trace, COST, spec, sim, check=True)
    assert shared == [(5, True)]  # the device expert leads its shadow and the other tiers'
    with monkeypatch.context() as m:
        m.setattr(ChainOdds, "share_history", lambda self, others: False)
        own = simulate(trace, COST, spec, sim)
    for f in ("requests", "decisions", "counters", "timeline", "makespan_s", "kv_stats",
              "controller_stats"):
        assert getattr(one, f) == getattr(own, f), f
    c = one.counters
    assert c.prefix_hits > 0 and c.block_drops + c.block_moves_host > 20, c


def _state(p):
    if isinstance(p, LRUBlocks):
        return list(p._order)
    if isinstance(p, S3FIFOBlocks):
        return list(p._s.items()), list(p._m.items()), list(p._g)
    if isinstance(p, ARCBlocks):
        return list(p._t1), list(p._t2), list(p._b1), list(p._b2), p.p
    return (sorted(p._meta.items()), [list(lst.items()) for lst in p._lists], p._stay,
            p._version)


@pytest.mark.parametrize("cls", [LRUBlocks, S3FIFOBlocks, ARCBlocks, ChainOdds])
def test_the_experts_unchecked_paths_equal_their_per_event_hooks(cls):
    """What the adaptive policy tells its experts without a snapshot or a second check
    (an insert by key, ``_removes``) leaves each built-in as its per-event hooks do, over
    random inserts, hits and removals that fill the tier and its ghost lists."""
    rng = random.Random(hash(cls.__name__) & 0xFFFF)
    a, b = cls(capacity=16), cls(capacity=16)
    key_insert = _key_insert(a)
    assert (key_insert is None) is (cls is ChainOdds)
    held: list[int] = []
    for t in range(600):
        now = float(t)
        keys = rng.sample(range(60), rng.randint(1, 5))
        for p in (a, b):
            p.on_request(keys, now)
        for d, k in enumerate(keys):
            info = BlockInfo(k, None, d, 0, 0, now, now, 0)
            if k in b:
                a.on_hit(info, now)
                b.on_hit(info, now)
                continue
            if key_insert is not None:
                key_insert(k)
            else:
                a.on_insert_key(k, d, lambda key, info=info: info, now)
            b.on_insert(info, now)
            held.append(k)
        if len(held) > 16:
            gone = [held.pop(rng.randrange(len(held))) for _ in range(len(held) - 16)]
            a._removes(gone)
            for k in gone:
                b.on_remove(k)
        assert _state(a) == _state(b), t
    assert len(a) == 16 and _state(a) == _state(b)


def test_a_subclass_that_changes_on_remove_is_still_told_each_removal():
    """``_removes`` of a subclass of a built-in that replaces ``on_remove`` calls it."""
    told = []

    class Counting(LRUBlocks):
        def on_remove(self, key):
            told.append(key)
            super().on_remove(key)

    p = Counting()
    for k in (3, 1, 2):
        p.on_insert(BlockInfo(k, None, 0, 0, 0, 0.0, 0.0, 0), 0.0)
    p._removes([1, 3])
    p.on_removes([2])
    assert told == [1, 3, 2] and len(p) == 0


def test_the_default_keeps_lru_where_it_pays_from_the_start_and_hands_conversations_on():
    """The default's first leader is LRU, and the lead moves only on evidence: on
    sessions whose working set a large tier holds, where LRU pays from the first
    eviction and ChainOdds, still learning, does not, it keeps LRU and scores exactly
    LRU's hits; on conversations at a small tier it passes the lead to ChainOdds and
    scores above every established policy alone."""
    sessions, cap = synth.session_chains(3000, 100), 3000
    lru = replay_blocks(sessions, cap, LRUBlocks(cap)).hit_rate
    chain = replay_blocks(sessions, cap, AdaptiveBlocks(cap, experts=("chain",))).hit_rate
    assert lru > chain + 0.01, "the sessions do not favour LRU: the test proves nothing"
    p = AdaptiveBlocks(cap)
    assert p.expert_names[0] == "lru"
    assert replay_blocks(sessions, cap, p).hit_rate == lru
    assert p.leader_name == "lru" and p.switches == 0

    conv, cap = synth.synthetic_chains(3000, 100), 300
    from tiering.policies.blocks import make_block_policy

    established = max(replay_blocks(conv, cap, make_block_policy(n, capacity=cap)).hit_rate
                      for n in ("lru", "arc", "s3fifo", "lirs"))
    q = AdaptiveBlocks(cap)
    r = replay_blocks(conv, cap, q).hit_rate
    assert q.leader_name == "chain" and q.switches >= 1
    assert r > established
