"""Tiers, links and chains (``tiering.core.tiers``): the contracts on every built-in
implementation, a state machine over a tier's ledger, the chain's rules, the shared mover in
the modelled cache and the fake, and a fourth, remote tier run in the modelled cache."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.simulator import SimClock
from tiering.core.tiers import (
    BLOCKS,
    Copy,
    InstantLink,
    ModelledLink,
    PageTier,
    Role,
    TierChain,
)
from tiering.testing import FakeClock, FakeTieredResource
from tiering.testing.tiers import LinkContract, TierContract, tier_ledger_machine
from tiering.types import RequestState, Tier

S = RequestState


# -- the contracts on the built-ins -------------------------------------------------------------


class TestPageTier(TierContract):
    def make_tier(self, capacity_pages):
        return PageTier("host", Role.HOST, capacity_pages, page_bytes=4096)

    def corrupt_tier(self, tier):
        tier._used += 1  # the count no longer the owners' sum


class TestModelledLink(LinkContract):
    def make_link(self):
        a = PageTier("host", Role.HOST, 64, 512)
        b = PageTier("disk", Role.DISK, 64, 512)
        return ModelledLink("host", "disk", 3e9, 2e-5, name="disk_write"), a, b


class TestInfiniteModelledLink(LinkContract):
    def make_link(self):
        a = PageTier("device", Role.DEVICE, 16, 256)
        b = PageTier("host", Role.HOST, 16, 256)
        return ModelledLink("device", "host", math.inf), a, b


class TestInstantLink(LinkContract):
    def make_link(self):
        a = PageTier("disk", Role.DISK, 8, 64)
        b = PageTier("host", Role.HOST, 8, 64)
        return InstantLink("disk", "host"), a, b


TestPageTierLedger = tier_ledger_machine(lambda cap: PageTier("t", Role.HOST, cap, 8)).TestCase
TestPageTierLedger.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# -- the contracts can fail -------------------------------------------------------------------------


class _CountsRefusals(PageTier):
    """Broken on purpose: a refused reserve still moves the count."""

    def reserve(self, owner, pages):
        ok = super().reserve(owner, pages)
        if not ok:
            self._used += pages
        return ok


class _LandsEarly(ModelledLink):
    """Broken on purpose: reports a landing before the copy was issued."""

    def copy(self, src, dst, owner, nbytes, *, now, layers=None):
        c = super().copy(src, dst, owner, nbytes, now=now, layers=layers)
        return c._replace(done=now - 1.0)


def test_the_tier_contract_fails_a_broken_tier():
    class Broken(TierContract):
        def make_tier(self, capacity_pages):
            return _CountsRefusals("x", Role.HOST, capacity_pages)

    with pytest.raises(AssertionError):
        Broken().test_a_refused_reserve_changes_nothing()
    with pytest.raises(AssertionError, match="tier 'x'"):  # its own check sees it too
        t = _CountsRefusals("x", Role.HOST, 4)
        t.reserve("a", 9)
        t.check_integrity()


def test_the_link_contract_fails_a_broken_link():
    class Broken(LinkContract):
        def make_link(self):
            a, b = PageTier("a", Role.HOST, 4), PageTier("b", Role.DISK, 4)
            return _LandsEarly("a", "b", 1e9), a, b

    with pytest.raises(AssertionError, match="lands before"):
        Broken().test_a_copy_reports_what_it_copied_and_lands_after_it_is_issued()


def test_bad_tier_and_link_settings_are_refused_naming_them():
    for args, what in ((("", Role.HOST, 4), "name"), (("t", "host", 4), "role"),
                       (("t", Role.HOST, -1), "capacity_pages"),
                       (("t", Role.HOST, 4, 0), "page_bytes")):
        with pytest.raises(ValueError, match=what):
            PageTier(*args)
    for kwargs, what in (({"bandwidth": 0}, "bandwidth"), ({"bandwidth": True}, "bandwidth"),
                         ({"bandwidth": 1e9, "latency_s": -1}, "latency_s"),
                         ({"bandwidth": 1e9, "latency_s": math.inf}, "latency_s")):
        with pytest.raises(ValueError, match=what):
            ModelledLink("a", "b", **kwargs)
    with pytest.raises(ValueError, match="same tier"):
        InstantLink("a", "a")


# -- modelled time ------------------------------------------------------------------------------


def _three(rng, pages=100, pb=1000):
    tiers = (PageTier("device", Role.DEVICE, pages, pb), PageTier("host", Role.HOST, pages, pb),
             PageTier("disk", Role.DISK, pages, pb))
    rates = LinkRates(rng.uniform(1e6, 1e9), rng.uniform(1e6, 1e9), rng.uniform(1e5, 1e8),
                      rng.uniform(1e5, 1e8), rng.uniform(0, 1e-3), rng.uniform(0, 1e-3),
                      rng.uniform(0, 1e-2), rng.uniform(0, 1e-2))
    return TierChain(tiers, rates.links()), rates


@pytest.mark.parametrize("seed", range(4))
def test_a_modelled_link_is_fifo_at_its_bandwidth_plus_latency(seed):
    rng = random.Random(seed)
    chain, rates = _three(rng)
    link = chain.link("device", "host")
    now = rng.uniform(0, 10)
    n1, n2 = rng.randint(1, 10**7), rng.randint(1, 10**7)
    first = chain.copy("device", "host", "a", n1, now=now)
    assert first.started == now
    assert first.done == pytest.approx(now + rates.d2h_latency_s + n1 / rates.d2h)
    second = chain.copy("device", "host", "b", n2, now=now)  # queues behind the first
    assert second.started == first.done
    assert second.done == pytest.approx(first.done + rates.d2h_latency_s + n2 / rates.d2h)
    later = first.done + second.done  # idle again by then: starts when issued
    assert chain.copy("device", "host", "c", 5, now=later).started == later
    assert link.bytes_copied == n1 + n2 + 5 and link.copies == 3
    assert chain.link("host", "device").copies == 0  # the other direction is its own link


@pytest.mark.parametrize("seed", range(4))
def test_a_route_of_modelled_links_is_cut_through(seed):
    rng = random.Random(seed)
    chain, rates = _three(rng)
    n = rng.randint(1, 10**8)
    c = chain.copy("device", "disk", "a", n, now=1.0)
    assert c.links == ("d2h", "disk_write") and (c.src, c.dst) == ("device", "disk")
    want = 1.0 + rates.d2h_latency_s + rates.disk_write_latency_s + n / min(
        rates.d2h, rates.disk_write)
    assert c.done == pytest.approx(want)
    # both links are held until it lands: a host -> disk copy issued meanwhile waits for it
    assert chain.copy("host", "disk", "b", 1, now=1.0).started == c.done
    up = chain.copy("disk", "device", "a", n, now=c.done)
    assert up.links == ("disk_read", "h2d")


def test_a_route_with_a_link_of_another_kind_is_store_and_forward():
    a, b, c = (PageTier("d", Role.DEVICE, 4), PageTier("h", Role.HOST, 4),
               PageTier("k", Role.DISK, 4))
    slow = ModelledLink("d", "h", 100.0, 0.5)
    chain = TierChain((a, b, c), (slow, ModelledLink("h", "d", 100.0), InstantLink("h", "k"),
                                  InstantLink("k", "h")))
    out = chain.copy("d", "k", "x", 200, now=2.0)
    assert out == Copy(("d->h", "h->k"), "d", "k", "x", 200, None, 2.0, 2.0 + 0.5 + 2.0)
    assert chain.link("h", "k").bytes_copied == 200


# -- the chain's rules ------------------------------------------------------------------------------


def _tiers():
    return (PageTier("device", Role.DEVICE, 8), PageTier("host", Role.HOST, 8),
            PageTier("disk", Role.DISK, 8))


def _both(a, b):
    return [InstantLink(a, b), InstantLink(b, a)]


def test_a_chain_that_is_not_connected_is_refused_naming_the_pair():
    with pytest.raises(ValueError, match="not connected: no route device -> disk"):
        TierChain(_tiers(), _both("device", "host") + [InstantLink("disk", "host")])
    with pytest.raises(ValueError, match="not connected: no route host -> device"):
        TierChain(_tiers(), [InstantLink("device", "host")] + _both("host", "disk"))


@pytest.mark.parametrize(("tiers", "links", "what"), [
    ((), (), "no tiers"),
    (lambda: (PageTier("host", Role.HOST, 1), PageTier("device", Role.DEVICE, 1)), (),
     "first tier must have role DEVICE"),
    (lambda: (PageTier("device", Role.DEVICE, 1), PageTier("disk", Role.DISK, 1),
              PageTier("host", Role.HOST, 1)), (), "cannot come after 'disk'"),
    (lambda: (PageTier("device", Role.DEVICE, 1), PageTier("device", Role.HOST, 1)), (),
     "two tiers are named 'device'"),
    (_tiers, lambda: _both("device", "host") + _both("host", "tape"), "names tier 'tape'"),
    (_tiers, lambda: _both("device", "host") + _both("host", "disk")
     + [InstantLink("host", "disk", name="again")], "both copy host -> disk"),
    (_tiers, lambda: [InstantLink("device", "host", name="x"), InstantLink("host", "device",
                                                                           name="x")],
     "two links are named 'x'"),
    (lambda: ("device",), (), "is not a Tier"),
    (_tiers, lambda: ["d2h"], "is not a Link"),
])
def test_a_malformed_chain_is_refused_naming_what_is_wrong(tiers, links, what):
    with pytest.raises(ValueError, match=what):
        TierChain(tiers() if callable(tiers) else tiers, links() if callable(links) else links)


def test_chain_lookups_by_name_and_object():
    tiers = _tiers()
    chain = TierChain(tiers, _both("device", "host") + _both("host", "disk"))
    device, host, disk = tiers
    assert chain["host"] is chain.tier(host) is host and "disk" in chain and disk in chain
    stranger = PageTier("host", Role.HOST, 8)  # same name, another object
    assert stranger not in chain and "tape" not in chain
    with pytest.raises(KeyError, match="'tape' is not in the chain"):
        chain.tier("tape")
    with pytest.raises(KeyError, match="not in the chain"):
        chain.tier(stranger)
    assert chain.device is device and list(chain) == list(tiers) and len(chain) == 3
    assert chain.below(device) == (host, disk) and chain.below("disk") == ()
    assert chain.above("disk") == (host, device)
    assert chain.index("disk") == 2
    assert chain.with_role(Role.HOST) == (host,)
    assert len(chain.moves()) == 6 and (device, disk) in chain.moves()
    assert [h[0].name for h in chain.route("device", "disk")] == ["device->host", "host->disk"]
    with pytest.raises(KeyError, match="no direct link device -> disk"):
        chain.link("device", "disk")
    with pytest.raises(ValueError, match="to itself"):
        chain.route("host", host)


def test_a_direct_link_is_the_route_when_there_is_one():
    chain = TierChain(_tiers(), _both("device", "host") + _both("host", "disk")
                      + [InstantLink("device", "disk", name="gds")])
    assert [h[0].name for h in chain.route("device", "disk")] == ["gds"]
    assert [h[0].name for h in chain.route("disk", "device")] == ["disk->host", "host->device"]


def test_chain_check_integrity_names_the_broken_tier():
    tiers = _tiers()
    chain = TierChain(tiers, _both("device", "host") + _both("host", "disk"))
    assert tiers[2].reserve("a", 3)
    chain.check_integrity()
    tiers[2]._used = 1
    with pytest.raises(AssertionError, match="tier 'disk'"):
        chain.check_integrity()


# -- the shared mover in the modelled cache and the fake -------------------------------------------


def test_the_modelled_cache_keeps_its_ledgers_in_the_chain():
    rng = random.Random(3)
    kv = ModeledKVCache(64, 4, 20, 6, 30, LinkRates.instant(), SimClock())
    device, host, disk = kv.chain.tiers
    kv.ingest_request("a")
    n = rng.randint(5, 20)
    assert kv.allocate("a", n)
    assert device.held("a") == kv.pages_for(n) and device.used_pages == kv.pages_for(n)
    assert kv.take_block_pages(Tier.DEVICE, 2) and device.held(BLOCKS) == 2
    kv.offload("a")
    assert kv.offload_destination("a") is (Tier.HOST if kv.pages_for(n) <= 6 else Tier.DISK)
    kv.poll()
    where = host if kv.pages_for(n) <= 6 else disk
    assert where.held("a") == kv.pages_for(n) and device.held("a") == 0
    kv.check_integrity()
    where._held["a"] += 1  # a tier's ledger behind the records' back
    where._used += 1
    with pytest.raises(AssertionError, match=f"{where.name}: 'a' holds"):
        kv.check_integrity()


def test_the_modelled_cache_reports_the_counters_it_always_did():
    """The replay's summaries read these names, in this order."""
    from tiering.apps.replay.model_kv import LINKS
    from tiering.core.lifecycle import Counters

    kv = ModeledKVCache(8, 2, 10, 4, 4, LinkRates(1e9, 2e9, 3e8, 4e8), SimClock())
    assert list(kv.stats.as_dict()) == [
        *Counters.FIELDS, "prefix_loads_from_host", "prefix_loads_from_disk",
        *(f"bytes_{link}" for link in LINKS), "max_device_pages", "max_host_pages",
        "max_disk_pages"]
    kv.ingest_request("a")
    assert kv.allocate("a", 7)
    kv.offload("a")
    assert kv.stats.bytes_d2h == kv.chain.link("device", "host").bytes_copied == 4 * 16
    assert kv.stats.max_host_pages == 4 and kv.stats.as_dict()["max_device_pages"] == 4
    with pytest.raises(AttributeError, match="no counter 'bytes_tape'"):
        kv.stats.bytes_tape  # noqa: B018 - the lookup is the test


def test_the_fake_moves_through_its_chain():
    fake = FakeTieredResource(100, 50, 200, async_transfers=True, complete_on_poll=False,
                              clock=FakeClock())
    fake.add("a", 30)
    assert fake.offload("a") == 30
    device, host, _ = fake.chain.tiers
    assert device.held("a") == host.held("a") == 30  # both tiers held while in flight
    assert fake.chain.link("device", "host").bytes_copied == 30
    fake.complete_transfers()
    assert device.held("a") == 0 and fake.state["a"] is S.ON_HOST
    fake.check_integrity()
    assert fake.ledger.used == [0, 30, 0] and fake.ledger.cap == [100, 50, 200]


# -- the worked example of docs/tiers.md: a remote memory tier, a fourth in the chain --------------


def _doc_namespace() -> dict:
    """The names docs/tiers.md defines, from its python blocks (the replay run left out: the
    tests below run their own)."""
    import builtins
    from pathlib import Path

    from test_docs_snippets import blocks

    ns = {"__name__": "docs_tiers", "__builtins__": builtins}
    page = Path(__file__).resolve().parents[1] / "docs" / "tiers.md"
    for b in blocks(page):
        if b.lang == "python" and not b.directives and "simulate(" not in b.code:
            exec(compile(b.code, b.where, "exec"), ns)
    return ns


DOC = _doc_namespace()
RemoteMemory, four_tiers = DOC["RemoteMemory"], DOC["four_tiers"]
GIB = 1 << 30


class TestRemoteMemory(TierContract):
    def make_tier(self, capacity_pages):
        return RemoteMemory("remote", capacity_pages, 4096)

    def corrupt_tier(self, tier):
        tier._slots["a"].append(tier._slots["a"][0])  # one slot held twice


TestRemoteMemoryLedger = tier_ledger_machine(lambda cap: RemoteMemory("r", cap, 8)).TestCase
TestRemoteMemoryLedger.settings = settings(max_examples=40, stateful_step_count=30,
                                           deadline=None)


def _four(remote_pages, host_pages=10, disk_pages=100, device_pages=60, seed=0):
    from tiering.apps.replay.presets import get_hardware

    pb = 16 * 64
    hw = get_hardware("small").with_sizes(device_kv_bytes=device_pages * pb,
                                          host_bytes=host_pages * pb, disk_bytes=disk_pages * pb)
    clock = SimClock()
    return ModeledKVCache.from_chain(four_tiers(hw, pb, remote_pages * pb), 16, clock), clock


@pytest.mark.parametrize("seed", range(3))
def test_the_remote_tier_takes_what_the_host_cannot(seed):
    rng = random.Random(seed)
    kv, clock = _four(remote_pages=rng.randint(12, 20), seed=seed)
    assert [t.name for t in kv.chain] == ["device", "host", "remote", "disk"]
    host, remote, disk = kv.chain["host"], kv.chain["remote"], kv.chain["disk"]
    sizes = {}
    for i in range(5):
        rid = f"r{i}"
        sizes[rid] = rng.randint(4, 9)
        kv.ingest_request(rid)
        assert kv.allocate(rid, sizes[rid] * 16 - rng.randrange(16))
    placed = {}
    for rid in sizes:
        free = (host.free_pages, remote.free_pages)
        assert kv.offload(rid) == sizes[rid] * kv.page_bytes
        # the first host-like tier with room, else the disk
        placed[rid] = "host" if free[0] >= sizes[rid] else (
            "remote" if free[1] >= sizes[rid] else "disk")
        kv.check_integrity()
    clock.now += 10.0
    kv.poll()
    assert "remote" in placed.values(), placed
    for rid, where in placed.items():
        assert kv.chain[where].held(rid) == sizes[rid], (rid, where)
        assert kv.tier_of(rid) is (Tier.DISK if where == "disk" else Tier.HOST)
    assert kv.host_used_bytes() == (host.used_pages + remote.used_pages) * kv.page_bytes
    on_remote = [rid for rid, w in placed.items() if w == "remote"]
    # a request on the remote tier demotes to the disk over r2h and disk_write ...
    before = kv.stats.bytes_r2h
    assert kv.demote(on_remote[0])
    clock.now += 10.0
    kv.poll()
    assert disk.held(on_remote[0]) == sizes[on_remote[0]] and remote.held(on_remote[0]) == 0
    assert kv.stats.bytes_r2h == before + sizes[on_remote[0]] * kv.page_bytes
    # ... and reloads from wherever it is
    for rid in placed:
        assert kv.reload(rid)
    clock.now += 10.0
    kv.poll()
    assert all(kv.state_of(rid) is S.RESIDENT for rid in placed)
    assert host.used_pages == remote.used_pages == disk.used_pages == 0
    assert kv.stats.max_remote_pages >= sizes[on_remote[0]]
    kv.check_integrity()


def test_without_its_chain_entry_nothing_lands_in_remote_memory():
    """The negative control: the same requests with a remote tier of no pages go to disk."""
    kv, clock = _four(remote_pages=0)
    for i in range(4):
        kv.ingest_request(f"r{i}")
        assert kv.allocate(f"r{i}", 8 * 16)
        kv.offload(f"r{i}")
    clock.now += 10.0
    kv.poll()
    assert kv.stats.bytes_h2r == 0 and kv.chain["disk"].used_pages == 3 * 8


@pytest.mark.parametrize("seed", range(3))
def test_block_pages_spread_over_the_host_like_tiers(seed):
    rng = random.Random(seed)
    kv, clock = _four(remote_pages=rng.randint(5, 15), host_pages=rng.randint(3, 8))
    host, remote, disk = kv.chain["host"], kv.chain["remote"], kv.chain["disk"]
    room = host.free_pages + remote.free_pages
    assert kv.free_pages(Tier.HOST) == room
    assert not kv.take_block_pages(Tier.HOST, room + 1)  # short: nothing changed
    assert host.used_pages == remote.used_pages == 0
    n = rng.randint(host.free_pages + 1, room)
    assert kv.take_block_pages(Tier.HOST, n)  # fills the host first
    assert host.held(BLOCKS) == host.capacity_pages and remote.held(BLOCKS) == n - host.capacity_pages
    assert kv.block_pages(Tier.HOST) == n
    k = rng.randint(1, n)
    assert kv.move_block_pages(Tier.HOST, Tier.DISK, k)  # leaves the slowest first
    assert kv.block_pages(Tier.HOST) == n - k and disk.held(BLOCKS) == k
    assert remote.held(BLOCKS) == max(0, n - host.capacity_pages - k)
    moved = kv.stats.bytes_disk_write
    assert moved == k * kv.page_bytes
    kv.give_block_pages(Tier.HOST, n - k)
    assert kv.block_pages(Tier.HOST) == 0
    kv.check_integrity()


def test_the_replay_runs_the_four_tier_chain_and_the_remote_tier_takes_disk_traffic():
    from tiering.apps.replay.config import RunSpec, SimConfig
    from tiering.apps.replay.presets import StepCost, get_hardware, get_model
    from tiering.apps.replay.simulator import simulate
    from tiering.apps.replay.traces import TraceRequest

    hardware = get_hardware("h100-80g").with_sizes(device_kv_bytes=3 * GIB, host_bytes=GIB,
                                                   disk_bytes=64 * GIB)
    cost = StepCost(get_model("llama-3.1-8b"), hardware)
    sim = SimConfig(preempt="policy")
    pb = cost.model.kv_bytes_per_token * sim.page_tokens
    rng = random.Random(11)
    trace, t = [], 0.0
    for _ in range(80):
        t += rng.expovariate(4.0)
        conv, blocks = rng.randrange(10), rng.randint(2, 24)
        trace.append(TraceRequest(t, 512 * blocks + 100, rng.randint(10, 300),
                                  tuple(1000 * conv + i for i in range(blocks))))
    stats = {}
    for remote in (0, 8):
        run = simulate(trace, cost, RunSpec("tiering", "lru"), sim, check=True,
                       kv_factory=lambda clock, r=remote: ModeledKVCache.from_chain(
                           four_tiers(hardware, pb, r * GIB), sim.page_tokens, clock))
        assert all(r.status == "finished" for r in run.requests)
        stats[remote] = run.kv_stats
    assert stats[0]["bytes_h2r"] == 0 and stats[8]["bytes_h2r"] > 0
    assert stats[8]["max_remote_pages"] > 0
    assert stats[8]["bytes_disk_write"] < stats[0]["bytes_disk_write"]


def test_a_pair_that_is_no_lifecycle_move_is_refused_and_changes_nothing():
    kv, clock = _four(remote_pages=20)
    kv.ingest_request("a")
    assert kv.allocate("a", 5 * 16)
    kv.offload("a")
    clock.now += 1.0
    kv.poll()
    host, remote = kv.chain["host"], kv.chain["remote"]
    r = kv._reqs["a"]
    before = (host.held("a"), remote.held("a"), r.state, kv.chain.link("host", "remote").copies)
    with pytest.raises(ValueError, match="no lifecycle move from 'host' .* to 'remote'"):
        kv._mover.start(r, remote, 5, 5 * kv.page_bytes)
    with pytest.raises(ValueError, match="holds host pages in 'host', not 'remote'"):
        kv._mover.place(r, remote, 1)
    assert (host.held("a"), remote.held("a"), r.state,
            kv.chain.link("host", "remote").copies) == before
    kv.check_integrity()


# -- a state machine over the four-tier modelled cache --------------------------------------------

class FourTierCache(RuleBasedStateMachine):
    """Random requests through device, host, remote and disk, with cached block pages
    beside them: every step leaves the chain's ledgers, the records and the lifecycle
    consistent (``check_integrity``), and no tier past its capacity."""

    def __init__(self) -> None:
        super().__init__()
        self.kv, self.clock = _four(remote_pages=12, host_pages=6, disk_pages=30,
                                    device_pages=40)
        self.n = 0

    def _rids(self, *states):
        return [rid for rid in self.kv.requests() if self.kv.state_of(rid) in states]

    @rule(tokens=st.integers(1, 9 * 16))
    def arrive(self, tokens):
        rid = f"r{self.n}"
        self.n += 1
        self.kv.ingest_request(rid)
        if not self.kv.allocate(rid, tokens):
            self.kv.remove_request(rid)

    @rule(data=st.data())
    def offload(self, data):
        rids = self._rids(S.RESIDENT)
        if rids:
            self.kv.offload(data.draw(st.sampled_from(rids)))

    @rule(data=st.data())
    def demote(self, data):
        rids = self._rids(S.ON_HOST)
        if rids:
            self.kv.demote(data.draw(st.sampled_from(rids)))

    @rule(data=st.data())
    def reload(self, data):
        rids = self._rids(S.ON_HOST, S.ON_DISK)
        if rids:
            self.kv.reload(data.draw(st.sampled_from(rids)))

    @precondition(lambda self: self.kv.requests())
    @rule(data=st.data())
    def remove(self, data):
        self.kv.remove_request(data.draw(st.sampled_from(self.kv.requests())))

    @rule(role=st.sampled_from([Tier.DEVICE, Tier.HOST, Tier.DISK]), n=st.integers(0, 8))
    def take_blocks(self, role, n):
        self.kv.take_block_pages(role, n)

    @rule(src=st.sampled_from([Tier.DEVICE, Tier.HOST]), n=st.integers(0, 8))
    def move_blocks(self, src, n):
        dst = Tier.HOST if src is Tier.DEVICE else Tier.DISK
        self.kv.move_block_pages(src, dst, min(n, self.kv.block_pages(src)))

    @rule(role=st.sampled_from([Tier.DEVICE, Tier.HOST, Tier.DISK]), n=st.integers(0, 8))
    def give_blocks(self, role, n):
        self.kv.give_block_pages(role, min(n, self.kv.block_pages(role)))

    @rule(dt=st.floats(0, 1e-3))
    def poll(self, dt):
        self.clock.now += dt
        for res in self.kv.poll():
            assert res.ok or res.state is None, res

    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        for t in self.kv.chain:
            assert 0 <= t.used_pages <= t.capacity_pages, t


TestFourTierCache = FourTierCache.TestCase
TestFourTierCache.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
