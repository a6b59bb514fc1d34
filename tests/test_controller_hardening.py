"""The controller under requests that vanish or change state beneath it, and failed passes.

A request removed from its resource but not yet from the controller, or one the
worker moved itself, is skipped and logged, never an exception; a pass that does
raise (a broken pressure source) strands no waiting reload and keeps no finding.
Each scenario runs on ``FakeTieredResource`` and, where the cache offers the same
situation, on a real ``PagedKVCache`` through its public API.
"""

from __future__ import annotations

import logging
import random
import threading

import pytest
import torch
from conftest import assert_same, fill
from tiering.policies import make_policy

from tiering.control.controller import ControllerConfig, EvictionController
from tiering.control.pressure import PoolPressure
from tiering.disk import DiskConfig, FaultPlan, FaultyStore
from tiering.testing import ExactPressure, FakeClock, FakeTieredResource, ScriptedFraction
from tiering.types import RequestState, Tier

S = RequestState
POLICY_NAMES = ("lru", "priority", "largest", "cost")


def _policy(name: str):
    return make_policy(name, resource="kv") if name == "priority" else make_policy(name)


class OneByOne(FakeTieredResource):
    """The fake without the optional bulk hooks: asked one request at a time."""

    reclaimable_many = None
    get_offload_priority_many = None


def _fake_world(seed: int, policy_name: str = "lru", *, n: int = 15, host: int = 1 << 30,
                config: ControllerConfig | None = None, cls=FakeTieredResource, **kwargs):
    rng = random.Random(seed)
    clock = FakeClock()
    res = cls(100_000, host, 1 << 30, **kwargs)
    ctl = EvictionController({"kv": res}, _policy(policy_name), ExactPressure(res),
                             config or ControllerConfig(high=0.8, low=0.5), clock=clock)
    rids = []
    for i in range(n):
        rid = f"r{i:02d}"
        res.add(rid, rng.randint(6_000, 6_600))
        res.priorities[rid] = rng.random()
        ctl.add_request(rid)
        clock.advance(rng.uniform(0.01, 0.2))
        rids.append(rid)
    clock.advance(5.0)
    return res, ctl, clock, rids


def _check(ctl, *resources) -> None:
    ctl.check_integrity()
    for res in resources:
        res.check_integrity()


# -- a request removed from the resource but not from the controller --------------------


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@pytest.mark.parametrize("bulk", [True, False])
def test_a_request_gone_from_the_resource_is_skipped_and_logged(policy_name, bulk, caplog):
    res, ctl, clock, rids = _fake_world(3, policy_name,
                                        cls=FakeTieredResource if bulk else OneByOne)
    gone = rids[0]
    res.remove(gone)  # the worker freed it; remove_request has not reached the controller
    assert res.device_used / 100_000 > 0.8
    with caplog.at_level(logging.WARNING, logger="tiering.control.controller"):
        report = ctl.evict_if_needed(())
    assert gone not in report.offloaded
    assert report.offloaded, "the other requests must still be offloaded"
    assert res.device_used / 100_000 < 0.5
    assert ctl.stats()["vanished_skips"] >= 1
    assert any(repr(gone) in rec.getMessage() for rec in caplog.records)
    _check(ctl, res)
    ctl.remove_request(gone)  # the late removal is still accepted
    _check(ctl, res)


def test_a_request_gone_while_its_reload_waits_strands_no_other_reload():
    res, ctl, clock, rids = _fake_world(4, n=10, config=ControllerConfig(high=0.9, low=0.5))
    waiting = rids[:3]
    for rid in waiting:
        assert res.offload(rid) > 0
    ctl.evict_if_needed(())
    # fill the device so that the reloads must wait
    extra = 100_000 - res.device_used
    res.add("filler", extra)
    ctl.add_request("filler")
    for rid in waiting:
        assert ctl.request_reload(rid) is False
    assert ctl.pending_reloads() == tuple(waiting)
    res.remove(waiting[0])  # gone from the resource, still known to the controller
    report = ctl.evict_if_needed(("filler",))  # must not raise
    _check(ctl, res)
    assert ctl.pending_reloads() == tuple(waiting[1:])
    # room comes back: the others are served, none was stranded by the failure
    res.remove("filler")
    ctl.remove_request("filler")
    report = ctl.evict_if_needed(())
    assert set(report.reloads_started) == set(waiting[1:])
    assert ctl.pending_reloads() == ()
    for rid in waiting[1:]:
        assert res.state[rid] is S.RESIDENT
    _check(ctl, res)


def test_a_request_resident_again_behind_the_controllers_back_is_dropped_from_the_queue():
    res, ctl, clock, rids = _fake_world(5, n=10, config=ControllerConfig(high=0.9, low=0.5))
    rid = rids[0]
    assert res.offload(rid) > 0
    res.add("filler", 100_000 - res.device_used)
    ctl.add_request("filler")
    assert ctl.request_reload(rid) is False
    res.remove("filler")
    ctl.remove_request("filler")
    assert res.reload(rid)  # the worker reloaded it itself
    report = ctl.evict_if_needed(())
    assert report.reloads_started == ()
    assert ctl.pending_reloads() == ()
    _check(ctl, res)


# -- the cascade and a request the worker demoted itself -------------------------------


def _host_world(seed: int, policy_name: str = "lru", **kwargs):
    rng = random.Random(seed)
    clock = FakeClock()
    res = FakeTieredResource(1_000_000, 100_000, 1 << 30, async_transfers=True,
                             complete_on_poll=False, **kwargs)
    cfg = ControllerConfig(host_high=0.9, host_low=0.7)
    ctl = EvictionController({"kv": res}, _policy(policy_name), ExactPressure(res), cfg,
                             clock=clock)
    rids = []
    while res.host_used < 0.95 * 100_000:
        rid = f"h{len(rids):02d}"
        res.add(rid, min(rng.randint(2_000, 6_000), 100_000 - res.host_used), Tier.HOST)
        res.priorities[rid] = rng.random()
        ctl.add_request(rid)
        clock.advance(0.1)
        rids.append(rid)
    return res, ctl, clock, rids


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_the_cascade_skips_a_request_the_worker_is_demoting(policy_name):
    twin = _host_world(6, policy_name)
    chosen = twin[1].evict_if_needed(()).demoted[0]  # what the cascade picks first
    res, ctl, clock, rids = _host_world(6, policy_name)
    assert res.demote(chosen)  # the worker demotes it itself
    assert res.state[chosen] is S.DEMOTING
    report = ctl.evict_if_needed(())  # must not raise
    assert chosen not in report.demoted
    assert report.demoted
    assert all(res.state[r] is S.DEMOTING for r in report.demoted)
    _check(ctl, res)
    res.complete_transfers()
    ctl.evict_if_needed(())
    assert ctl.stats()["demotions_in_flight"] == 0
    assert res.state[chosen] is S.ON_DISK
    _check(ctl, res)


def test_the_cascade_ranks_through_the_configured_policy():
    res, ctl, clock, rids = _host_world(7, "largest")
    report = ctl.evict_if_needed(())
    sizes = [res.size[r] for r in report.demoted]
    assert sizes == sorted(sizes, reverse=True)
    rest = [res.size[r] for r in rids if r not in report.demoted]
    assert min(sizes) >= max(rest)
    _check(ctl, res)
    # negative control: recency order would have demoted the oldest first instead
    assert list(report.demoted) != rids[: len(report.demoted)]


def test_a_demotion_of_a_request_gone_from_the_resource_is_skipped():
    res, ctl, clock, rids = _host_world(8)
    res.remove(rids[0])  # the oldest, the first the cascade would pick
    report = ctl.evict_if_needed(())
    assert rids[0] not in report.demoted and report.demoted
    assert ctl.stats()["vanished_skips"] >= 1
    _check(ctl, res)


# -- a pass that raises keeps nothing stale --------------------------------------------


class FlakyLatest:
    """A poller stand-in whose ``latest()`` raises once it is armed."""

    def __init__(self, res: FakeTieredResource) -> None:
        self._res = res
        self.seq = 0
        self.fail_after: int | None = None

    def sample(self) -> None:
        self.seq += 1

    def latest(self):
        if self.fail_after is not None:
            if self.fail_after == 0:
                self.fail_after = None
                raise RuntimeError("pressure source broke")
            self.fail_after -= 1
        from tiering.testing import Reading

        return Reading(self._res.device_used / self._res.device_capacity_bytes, self.seq, 0.0)


def test_a_pass_that_raises_while_serving_reloads_strands_none():
    clock = FakeClock()
    res = FakeTieredResource(100_000, 1 << 30, 1 << 30)
    pressure = FlakyLatest(res)
    pressure.sample()
    ctl = EvictionController({"kv": res}, make_policy("lru"), pressure,
                             ControllerConfig(high=0.9, low=0.5, aging_s=100.0), clock=clock)
    rng = random.Random(9)
    rids = [f"w{i}" for i in range(4)]
    for rid in rids:
        res.add(rid, rng.randint(5_000, 9_000), Tier.HOST)
        ctl.add_request(rid)
    res.add("filler", 86_000)
    ctl.add_request("filler")
    for rid in rids:
        assert ctl.request_reload(rid) is False
    res.remove("filler")
    ctl.remove_request("filler")
    pressure.sample()
    pressure.fail_after = 2  # the pass's own read works; a stamp taken for a reload raises
    with pytest.raises(RuntimeError, match="pressure source broke"):
        ctl.evict_if_needed(())
    left = ctl.pending_reloads()
    assert left, "the failure was meant to interrupt the queue"
    pressure.sample()
    report = ctl.evict_if_needed(())
    assert set(report.reloads_started) == set(left)  # none was stranded
    assert ctl.pending_reloads() == ()
    assert all(res.state[r] is S.RESIDENT for r in rids)
    _check(ctl, res)


def test_a_pass_that_raises_keeps_no_finding_of_nothing_to_offload():
    clock = FakeClock()
    res = FakeTieredResource(100_000, 1 << 30, 1 << 30)
    pressure = ScriptedFraction(0.95)
    ctl = EvictionController({"kv": res}, make_policy("lru"), pressure,
                             ControllerConfig(high=0.8, low=0.6), clock=clock)
    for i in range(6):
        res.add(f"b{i}", 10_000)
        ctl.add_request(f"b{i}")
    running = frozenset(f"b{i}" for i in range(6))
    ctl.evict_if_needed(running)
    ctl.evict_if_needed(running)
    assert ctl.stats()["scans_skipped"] == 1  # control: the finding is reused
    pressure.set(float("nan"))
    with pytest.raises(ValueError, match="pressure source returned nan"):
        ctl.evict_if_needed(running)
    pressure.set(0.95)
    ctl.evict_if_needed(running)
    assert ctl.stats()["scans_skipped"] == 1  # it scanned again after the failed pass
    _check(ctl, res)


# -- the same on a real PagedKVCache ---------------------------------------------------


def _gate_plan(gate: threading.Event) -> FaultPlan:
    """A fault plan whose ``slow`` faults hold a disk write until ``gate`` is set."""
    plan = FaultPlan(seed=0, sleep=lambda _s: gate.wait(10.0), slow_seconds=0.0)
    return plan


def _real(kv, tmp_path, *, plan: FaultPlan | None = None, device_pages=16, host_pages=16):
    """A real cache with a disk tier, made by the ``kv`` factory (closed for us)."""
    page = kv.geometry.page_bytes
    cfg = DiskConfig(path=tmp_path / "disk", capacity_bytes=64 * page, chunk_bytes=2 * page)
    wrap = (lambda s: FaultyStore(s, plan)) if plan is not None else None
    return kv(device="cpu", device_pages=device_pages, host_pages=host_pages, disk=cfg,
              disk_wrap_store=wrap)


def _lru_controller(cache, config: ControllerConfig):
    """An LRU controller over ``cache`` alone, on a fake clock; returns both."""
    clock = FakeClock()
    return EvictionController({"kv": cache}, make_policy("lru"), PoolPressure(cache), config,
                              clock=clock), clock


def test_real_cache_a_removed_request_is_skipped(kv, geom, tmp_path):
    cache = _real(kv, tmp_path)
    gen = torch.Generator().manual_seed(11)
    ctl, clock = _lru_controller(cache, ControllerConfig(high=0.8, low=0.4))
    data = {}
    for i in range(4):
        rid = f"q{i}"
        data[rid] = fill(cache, rid, gen, 4 * geom.page_tokens - 1)  # 4 pages each
        ctl.add_request(rid)
        clock.advance(0.5)
    clock.advance(5.0)
    cache.remove_request("q0")  # the worker freed it; the controller has not heard yet
    cache.check_integrity()
    cache.ingest_request("q9", None)
    assert cache.allocate("q9", 4 * geom.page_tokens)  # the device fills up again
    ctl.add_request("q9")
    report = ctl.evict_if_needed({"q9"})  # must not raise
    assert "q0" not in report.offloaded and report.offloaded
    assert ctl.stats()["vanished_skips"] >= 1
    cache.synchronize(10)
    cache.check_integrity()
    ctl.remove_request("q0")
    ctl.check_integrity()
    for rid in report.offloaded:
        assert cache.is_offloaded(rid)
        assert ctl.request_reload(rid) or rid in ctl.pending_reloads()
    cache.remove_request("q9")
    ctl.remove_request("q9")
    for _ in range(3):
        ctl.evict_if_needed(())
        cache.synchronize(10)
    for rid in report.offloaded:
        assert cache.state_of(rid) is S.RESIDENT
        assert_same(cache, rid, data[rid])
    cache.check_integrity()
    ctl.check_integrity()


def test_real_cache_the_cascade_skips_what_the_worker_demotes(kv, geom, tmp_path, closing):
    gate = threading.Event()
    plan = _gate_plan(gate)
    cache = _real(kv, tmp_path, plan=plan, host_pages=12)
    closing.call(gate.set)  # before the cache is closed: its held writes go on
    gen = torch.Generator().manual_seed(12)
    ctl, clock = _lru_controller(cache, ControllerConfig(host_high=0.6, host_low=0.3))
    data = {}
    for i in range(3):
        rid = f"c{i}"
        data[rid] = fill(cache, rid, gen, 4 * geom.page_tokens)
        ctl.add_request(rid)
        clock.advance(0.5)
        assert cache.offload(rid) > 0
    cache.synchronize(10)
    assert all(cache.state_of(r) is S.ON_HOST for r in data)
    plan.arm("slow", next_n=1_000)  # every disk write waits at the gate
    assert cache.demote("c0")  # the worker demotes the coldest itself
    assert cache.state_of("c0") is S.DEMOTING
    report = ctl.evict_if_needed(())  # must not raise
    assert "c0" not in report.demoted
    assert report.demoted  # host over host_high without c0: the next coldest goes
    gate.set()
    cache.synchronize(10)
    ctl.evict_if_needed(())
    assert cache.state_of("c0") is S.ON_DISK
    assert ctl.stats()["demotions_in_flight"] == 0
    cache.check_integrity()
    ctl.check_integrity()
    for rid in data:
        if cache.is_offloaded(rid):
            assert cache.reload(rid)
    cache.synchronize(10)
    for rid in data:
        assert_same(cache, rid, data[rid])


def test_real_cache_a_waiting_reload_of_a_removed_request_strands_no_other(kv, geom, tmp_path):
    cache = _real(kv, tmp_path)
    gen = torch.Generator().manual_seed(13)
    ctl, clock = _lru_controller(cache, ControllerConfig())
    pages = 4 * geom.page_tokens
    data = {}
    for rid in ("q0", "q1", "q2", "q3"):
        data[rid] = fill(cache, rid, gen, pages)
        ctl.add_request(rid)
        clock.advance(0.5)
    for rid in ("q0", "q1"):
        assert cache.offload(rid) > 0
    cache.synchronize(10)
    for rid in ("q4", "q5"):  # the worker fills the device again
        data[rid] = fill(cache, rid, gen, pages)
        ctl.add_request(rid)
    assert ctl.request_reload("q0") is False
    assert ctl.request_reload("q1") is False
    cache.remove_request("q0")  # freed by the worker; the controller has not heard yet
    for rid in ("q4", "q5"):
        cache.remove_request(rid)
        ctl.remove_request(rid)
    report = ctl.evict_if_needed(())  # must not raise
    assert report.reloads_started == ("q1",)
    assert ctl.pending_reloads() == ()
    cache.synchronize(10)
    assert cache.state_of("q1") is S.RESIDENT
    assert_same(cache, "q1", data["q1"])
    ctl.remove_request("q0")
    cache.check_integrity()
    ctl.check_integrity()


@pytest.mark.parametrize("kw,err,match", [
    ({"device_capacity_bytes": "100"}, ValueError, "device_capacity_bytes must be a positive integer"),
    ({"device_capacity_bytes": 1.7}, ValueError, "device_capacity_bytes must be a positive integer"),
    ({"device_capacity_bytes": float("nan")}, ValueError, "device_capacity_bytes must be"),
    ({"device_capacity_bytes": True}, ValueError, "device_capacity_bytes must be"),
    ({"clock": 3.0}, TypeError, "clock must be callable"),
    ({"reload_priority": 5}, TypeError, "reload_priority must be callable"),
])
def test_controller_construction_refuses_mistyped_arguments_by_name(kw, err, match):
    res = FakeTieredResource(1000, 1000, 1000)
    with pytest.raises(err, match=match):
        EvictionController({"kv": res}, make_policy("lru"), ExactPressure(res), **kw)


def test_controller_resources_must_be_a_mapping():
    res = FakeTieredResource(1000, 1000, 1000)
    with pytest.raises(TypeError, match="resources must be a mapping"):
        EvictionController([res], make_policy("lru"), ExactPressure(res))
    ctl = EvictionController({"kv": res}, make_policy("lru"), ExactPressure(res),
                             device_capacity_bytes=1000)  # the control: a plain int is taken
    assert ctl.device_capacity_bytes == 1000


@pytest.mark.parametrize("bad", ["0.5", None, True, float("nan"), -0.1, float("inf")])
def test_a_pressure_reading_that_is_not_a_fraction_is_refused_naming_it(bad):
    res = FakeTieredResource(1000, 1000, 1000)
    res.add("a", 950)
    source = ScriptedFraction(0.5)
    ctl = EvictionController({"kv": res}, make_policy("lru"), source, clock=FakeClock())
    ctl.add_request("a")
    source.set(bad)
    with pytest.raises(ValueError, match=r"pressure source returned .*expected a fraction"):
        ctl.evict_if_needed(())
    assert res.tier_of("a") is Tier.DEVICE  # nothing moved on a reading it refused
    ctl.check_integrity()
    source.set(0.5)  # the control: a fraction is taken
    assert ctl.evict_if_needed(()).pressure_before == 0.5
