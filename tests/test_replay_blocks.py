"""The replay's cached prefix blocks: ``PrefixBlocks`` on the block index, in every tier,
under the block policies; the Belady bound from ``tiering.blocks.belady``."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiering.policies.blocks import LRUBlocks, register_block_policy

from tiering.apps.replay.block_tiers import PrefixBlocks
from tiering.apps.replay.bounds import belady
from tiering.apps.replay.metrics import summarize
from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.presets import StepCost, get_hardware, get_model
from tiering.apps.replay.simulator import RunSpec, SimClock, SimConfig, simulate
from tiering.apps.replay.traces import TraceRequest
from tiering.blocks.belady import belady_hit_rate
from tiering.types import Tier

BT = 32  # tokens a block
PT = 16  # tokens a page: a block is 2 pages
COST = StepCost(get_model("llama-3.1-8b"), get_hardware("h100-80g"))


def _kv(clock, device=40, host=12, disk=16) -> ModeledKVCache:
    return ModeledKVCache(64, PT, device, host, disk, LinkRates(2e9, 2e9, 5e8, 1e9), clock)


def _store(clock, policy="lru", **sizes):
    kv = _kv(clock, **sizes)
    return kv, PrefixBlocks(kv, policy, BT, clock)


def _admit(kv, store, rid, chain, n_in):
    """What the worker does at admission: peek, attach (ingest, map, tell, start the
    loads), and allocate the prompt at once when nothing loads (else ``_land``)."""
    peek = store.peek(chain, n_in)
    att = store.attach_request(rid, peek)
    assert att is not None
    if not att.moves:
        assert kv.allocate(rid, n_in)
    return peek, att.mapped, att.moves


def _land(kv, store, rid, moves, n_in):
    """The loads landed: the request allocates its prompt (as on the cache)."""
    store.loaded(moves)
    assert kv.allocate(rid, n_in)


def _finish(kv, store, rid, mapped, keys=()):
    kv.remove_request(rid)
    store.release(mapped)
    return store.publish(keys)


def test_hand_checked_reuse_moves_down_and_back_up():
    clock = SimClock()
    kv, store = _store(clock)
    a = (11, 12, 13)
    peek, mapped, moves = _admit(kv, store, "a", a, 3 * BT + 5)
    assert peek.blocks == 0 and moves == [] and mapped == [] and peek.keys == a
    # kept only once its request is done
    assert store.peek(a + (14,), 4 * BT + 1).blocks == 0
    assert _finish(kv, store, "a", mapped, a) == 3
    store.check_integrity()
    assert store.count(Tier.DEVICE) == 3 and kv.block_pages(Tier.DEVICE) == 6
    # the request itself is gone, and blocks no request maps are not counted as used
    assert kv.device_used_bytes() == 0 and store.idle_pages(Tier.DEVICE) == 6
    # on the device: the last token is always computed, so (as the cache attaches) the
    # block that holds it is not mapped; one more token and all three are
    p = store.peek(a, 3 * BT)
    assert (p.blocks, p.reused, p.tiers) == (2, 2 * BT, (Tier.DEVICE,) * 2)
    assert p.lent_pages == 4
    p = store.peek(a, 3 * BT + 1)
    assert (p.blocks, p.reused, p.tiers) == (3, 3 * BT, (Tier.DEVICE,) * 3)
    assert p.lent_pages == 6
    # pushed down when the device needs their room (the host has 12 pages = 6 blocks)
    assert store.ensure_device(40)
    assert store.count(Tier.DEVICE) == 0
    store.check_integrity()
    assert store.count(Tier.HOST) == 3 and kv.block_pages(Tier.HOST) == 6
    assert kv.stats.bytes_d2h == 6 * kv.page_bytes
    # reused from the host: they move up when the copy lands
    peek, mapped, moves = _admit(kv, store, "b", a + (21,), 4 * BT + 3)
    assert peek.tiers == (Tier.HOST,) * 3 and moves == list(a)
    # the loads' device pages are taken (the store's), the host copies stay until they land
    assert kv.block_pages(Tier.DEVICE) == 6 and kv.block_pages(Tier.HOST) == 6
    store.check_integrity()
    _land(kv, store, "b", moves, 4 * BT + 3)
    store.check_integrity()
    assert store.count(Tier.DEVICE) == 3 and store.count(Tier.HOST) == 0
    # the mapped blocks' pages are the store's; the request holds only its own 3 (35 tokens)
    assert kv.block_pages(Tier.HOST) == 0 and kv.block_pages(Tier.DEVICE) == 6
    assert kv.device_used_bytes() == (6 + 3) * kv.page_bytes
    assert store.idle_pages(Tier.DEVICE) == 0
    assert _finish(kv, store, "b", mapped, a + (21,)) == 1
    store.check_integrity()
    assert kv.block_pages(Tier.DEVICE) == 8 and store.counters.loaded == 3


def test_mapped_blocks_never_leave():
    clock = SimClock()
    kv, store = _store(clock)
    chain = (1, 2, 3, 4)
    _, mapped, _ = _admit(kv, store, "a", chain, 4 * BT + 1)
    _finish(kv, store, "a", mapped, chain)
    _, mapped, _ = _admit(kv, store, "b", chain, 4 * BT + 1)
    assert mapped == list(chain)
    free = kv.device_free_pages
    # everything is mapped: no block may go, and nothing changes
    assert not store.ensure_device(free() + 1)
    assert not store.drop_all_device() and store.count(Tier.DEVICE) == 4
    store.check_integrity()
    _finish(kv, store, "b", mapped, chain)
    assert store.ensure_device(40) and store.count(Tier.DEVICE) == 0
    store.check_integrity()


def test_make_room_drops_in_the_block_policy_order_and_refuses_when_it_cannot():
    clock = SimClock()
    kv = _kv(clock, device=20, host=0, disk=0)
    store = PrefixBlocks(kv, "lru", BT, clock, move=False)
    for i, chain in enumerate([(1, 2), (3, 4), (5, 6)]):
        clock.now = float(i)
        _, mapped, _ = _admit(kv, store, f"r{i}", chain, 2 * BT + 1)
        _finish(kv, store, f"r{i}", mapped, chain)
    clock.now = 5.0
    _admit(kv, store, "x", (3, 4), 2 * BT + 1)  # maps (3, 4): the most recent, and pinned
    free = kv.device_free_pages
    # 8 pages of unmapped blocks, 4 of the blocks x maps, 1 of request x's own
    assert free() == 20 - 8 - 4 - 1
    # 16 free pages are out of reach: nothing is dropped
    assert not store.ensure_device(16)
    assert len(store) == 6
    assert store.ensure_device(11)
    store_keys = set(store.index.keys())
    assert store_keys == {3, 4, 5, 6}  # the least recently used chain went first
    with pytest.raises(ValueError, match="unknown block policy 'nope'"):
        PrefixBlocks(kv, "nope", BT, clock)


class BlockStoreMachine(RuleBasedStateMachine):
    """Random admissions, prefills, finishes, recomputes, loads and pressure on one store;
    the store's, the index's and the KV's checks after every step, and a model of what each
    live request maps."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = SimClock()
        self.kv, self.store = _store(self.clock, policy="chain", device=48, host=10, disk=14)
        self.live: dict[str, tuple] = {}  # rid -> (its attach, prompt tokens, loads landed)
        self.n = 0

    @rule(base=st.integers(0, 3), extra=st.integers(0, 4), first=st.integers(0, 2),
          tail=st.integers(1, BT))
    def admit(self, base, extra, first, tail):
        chain = tuple(range(first * 100, first * 100 + base)) + tuple(
            range(1000 + 10 * self.n, 1000 + 10 * self.n + extra))
        n_in = len(chain) * BT + tail
        self.clock.now += 1.0
        rid = f"r{self.n}"
        self.n += 1
        store, kv = self.store, self.kv
        peek = store.peek(chain, n_in)
        att = store.attach_request(rid, peek)
        if att is None:  # no room for the loads: nothing of it is left behind
            assert rid not in kv
            return
        assert att.mapped == list(peek.keys[: peek.blocks])
        if not att.moves and not kv.allocate(rid, n_in):
            store.abandon(rid, att)
            assert rid not in kv
            return
        self.live[rid] = (att, n_in, not att.moves)

    @precondition(lambda self: any(not landed for _, _, landed in self.live.values()))
    @rule(data=st.data())
    def land(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r, v in self.live.items() if not v[2])))
        att, n_in, _ = self.live[rid]
        self.store.loaded(att.moves)
        if self.kv.allocate(rid, n_in):
            self.live[rid] = (att, n_in, True)
        else:  # no room for its prompt once landed: it is given up
            self.store.abandon(rid, self.live.pop(rid)[0])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        att, _, landed = self.live.pop(rid)
        if not landed:  # removed while its loads were in flight: they are given up
            self.store.abandon(rid, att)
            return
        self.kv.remove_request(rid)
        self.store.release(att.mapped)
        if not data.draw(st.booleans()):  # finished, not freed to be recomputed
            keys = att.peek.keys
            before = self.store.index.match_length(keys)
            added = self.store.publish(keys)
            assert self.store.index.match_length(keys) >= before + added

    @precondition(lambda self: any(landed for _, _, landed in self.live.values()))
    @rule(data=st.data(), tokens=st.integers(1, 4 * BT))
    def grow(self, data, tokens):
        """A decode under pressure: cached blocks make room as the cache's allocate does."""
        rid = data.draw(st.sampled_from(sorted(r for r, v in self.live.items() if v[2])))
        kv = self.kv
        want = kv.num_tokens(rid) + tokens
        need = kv.pages_for(want - kv.mapped_pages(rid) * PT) - kv._reqs[rid].device
        free, before = kv.device_free_pages(), kv.num_tokens(rid)
        ok = kv.allocate(rid, want)
        assert kv.num_tokens(rid) == (want if ok else before)
        assert ok or need > kv.device_free_pages()
        if need <= free:
            assert ok

    @rule(need=st.integers(1, 48))
    def ensure_device(self, need):
        before = len(self.store)
        ok = self.store.ensure_device(need)
        assert ok == (self.kv.device_free_pages() >= need) or (not ok and len(self.store) <= before)

    @rule(need=st.integers(1, 10))
    def ensure_host(self, need):
        ok = self.store.ensure_host(need)
        assert ok == (self.kv.free_pages(Tier.HOST) >= need) or not ok

    @invariant()
    def sound(self):
        self.store.check_integrity()
        self.kv.check_integrity()
        refs: dict = {}
        for att, _, _ in self.live.values():
            for k in att.mapped:
                refs[k] = refs.get(k, 0) + 1
        for k, n in refs.items():
            assert self.store.index.get(k).refs == n


TestBlockStore = BlockStoreMachine.TestCase
TestBlockStore.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_check_integrity_catches_miscounted_pages():
    """Negative control: a page taken behind the store's back fails its check."""
    clock = SimClock()
    kv, store = _store(clock)
    _, mapped, _ = _admit(kv, store, "a", (1, 2), 2 * BT + 1)
    _finish(kv, store, "a", mapped, (1, 2))
    store.check_integrity()
    kv.take_block_pages(Tier.DEVICE, 1)
    with pytest.raises(AssertionError, match="block pages"):
        store.check_integrity()


def _conversations(seed: int, n: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    chains: list[list[int]] = []
    out, t, nxt = [], 0.0, 1
    for _ in range(n):
        t += rng.expovariate(3.0)
        if chains and rng.random() < 0.6:
            chain = rng.choice(chains) + [nxt + i for i in range(rng.randint(1, 4))]
        else:
            chain = [0] + [nxt + i for i in range(rng.randint(2, 12))]
        nxt = max(nxt, max(chain) + 1)
        chains.append(chain)
        out.append(TraceRequest(t, len(chain) * 64 - rng.randint(1, 63), rng.randint(1, 80),
                                tuple(chain)))
    return out


def _factory(device, host, disk):
    def factory(clock):
        return ModeledKVCache(COST.model.kv_bytes_per_token, 16, device, host, disk,
                              LinkRates(2e9, 2e9, 5e8, 1e9), clock)
    return factory


SIM = SimConfig(max_batch=16, max_step_tokens=1024, page_tokens=16, block_tokens=64)


def test_the_block_policy_decides_retention_in_the_full_replay():
    """The replay keeps blocks with the policy it is given (a registered one too): the
    runs under different block policies differ, a policy that never admits reuses
    nothing, and every run passes every check after every round."""
    trace = _conversations(5, 150)
    runs = {}
    for name in ("lru", "chain", "s3fifo"):
        sim = SimConfig(**{**SIM.__dict__, "block_policy": name})
        runs[name] = simulate(trace, COST, RunSpec("tiering", "lru"), sim,
                              kv_factory=_factory(160, 40, 120), check=True)
        assert summarize(runs[name])["token_hit_rate"] > 0.05
    blocks = {n: [d for d in r.decisions if d.kind.startswith("block-")] for n, r in runs.items()}
    assert blocks["lru"] != blocks["chain"] and blocks["lru"] != blocks["s3fifo"]

    class NeverAdmit(LRUBlocks):
        name = "never"

        def admit(self, key, depth, now):
            return False

    registry = register_block_policy("never", NeverAdmit)
    sim = SimConfig(**{**SIM.__dict__, "block_policy": "never"})
    none = simulate(trace, COST, RunSpec("tiering", "lru"), sim,
                    kv_factory=_factory(160, 40, 120), block_registry=registry, check=True)
    m = summarize(none)
    assert m["token_hit_rate"] == 0 and m["block_refused"] > 0 and m["finished"] == len(trace)


def test_belady_bound_is_the_block_index_belady():
    trace = _conversations(8, 200)
    chains = [t.hash_ids[: t.input_tokens // 64] for t in trace]
    for cap in (5, 40, 400):
        b = belady(trace, 64, cap)
        ref = belady_hit_rate(chains, cap)
        assert b.blocks == ref.accesses and b.block_hit_rate == pytest.approx(ref.hit_rate)
        assert b.block_hit_rate > 0
    assert belady(trace, 64, 0).block_hit_rate == 0.0

