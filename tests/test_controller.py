"""The eviction controller: watermarks, victims, admission, anti-starvation, cascade, stats.

Size: about 1900 lines on purpose: every controller behaviour test with the fakes and
state machines they share (split by topic, each file would re-declare the same fakes).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from operator import attrgetter

import numpy as np
import pytest
from conftest import ReclaimsNothing, rule_on_one_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from tiering.policies import make_policy
from tiering.policies.base import Candidate, Policy

from tiering.control.admission import InFlightLedger, ReloadQueue
from tiering.control.controller import (
    ControllerConfig,
    EvictionController,
    EvictionReport,
    UnknownRequestError,
)
from tiering.control.pressure import PressurePoller, ScriptedPressure
from tiering.testing import (
    ExactPressure,
    FakeClock,
    FakeTieredResource,
    LaggingPressure,
    ScriptedFraction,
)
from tiering.types import RequestState, Tier

# -- local stand-ins ---------------------------------------------------------------


class NoBulkAnswers(FakeTieredResource):
    """The fake without the ``*_many`` hooks: it must be asked one request at a time."""

    reclaimable_many = None
    get_offload_priority_many = None


class CountingBulk(FakeTieredResource):
    """The fake, recording what its ``*_many`` hooks were asked about."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked = 0  # requests reclaimable_many answered for
        self.asked_priority: list[str] = []

    def reclaimable_many(self, rids):
        self.asked += len(rids)
        return super().reclaimable_many(rids)

    def get_offload_priority_many(self, rids):
        self.asked_priority.extend(rids)
        return super().get_offload_priority_many(rids)


class OldestFirst(Policy):
    """A minimal LRU written here, so these tests do not depend on policies/."""

    name = "oldest-first"

    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        return sorted(candidates, key=attrgetter("last_used", "rid", "resource"))


class WantedGoneFirst(Policy):
    """A minimal PRIORITY policy naming the resource it needs."""

    name = "wanted-gone-first"

    def __init__(self, resource: str) -> None:
        self.needs_priority_from = resource

    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (-c.priority, c.last_used, c.rid, c.resource))


def _policies(resource: str = "kv") -> dict[str, Policy]:
    return {
        "local-lru": OldestFirst(),
        "local-priority": WantedGoneFirst(resource),
        "lru": make_policy("lru"),
        "priority": make_policy("priority", resource=resource),
        "largest": make_policy("largest"),
        "cost": make_policy("cost"),
    }


POLICY_NAMES = tuple(_policies())

MiB = 1 << 20


def _setup(
    rng: random.Random,
    *,
    n: int,
    device: int = 64 * MiB,
    fill: float,
    policy: Policy | None = None,
    config: ControllerConfig | None = None,
    host: int = 1 << 40,
    resource_cls: type = FakeTieredResource,
    **fake_kwargs,
):
    """A fake resource with ``n`` random-sized resident requests filling ~``fill`` of it."""
    clock = FakeClock()
    res = resource_cls(device, host, 1 << 40, **fake_kwargs)
    sizes = [rng.randint(1, 1000) for _ in range(n)]
    scale = fill * device / sum(sizes)
    ctl = EvictionController(
        {"kv": res},
        policy or OldestFirst(),
        ExactPressure(res),
        config or ControllerConfig(),
        clock=clock,
    )
    rids = []
    for i, s in enumerate(sizes):
        rid = f"r{i:04d}"
        res.add(rid, max(1, int(s * scale)))
        ctl.add_request(rid)
        clock.advance(rng.uniform(0.001, 0.5))
        rids.append(rid)
    for rid in rng.sample(rids, len(rids)):  # random recency, unrelated to size
        clock.advance(rng.uniform(0.001, 0.5))
        ctl.touch(rid)
    return res, ctl, clock, rids


def _fill_to(res: FakeTieredResource, ctl: EvictionController, rng, fraction: float, tag: str):
    """Add resident requests until the device is above ``fraction`` full."""
    cap = res.device_capacity_bytes
    i = 0
    while res.device_used <= fraction * cap:
        size = min(rng.randint(cap // 200, cap // 50), cap - res.device_used)
        rid = f"{tag}{i}"
        res.add(rid, size)
        ctl.add_request(rid)
        i += 1


# -- configuration -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"high": 1.5}, "high"),
        ({"high": 0.0}, "high"),
        ({"low": 0.95}, "low"),
        ({"low": 0.0}, "low"),
        ({"low": 0.9, "high": 0.9}, "low"),
        ({"host_high": 1.01}, "host_high"),
        ({"host_low": 0.95}, "host_low"),
        ({"min_residency_s": -1.0}, "min_residency_s"),
        ({"aging_s": -0.5}, "aging_s"),
        ({"aging_s": float("inf")}, "aging_s"),
        ({"reload_headroom": -0.01}, "reload_headroom"),
        ({"reload_headroom": 0.95}, "reload_headroom"),
        ({"on_disk_full": "forget"}, "on_disk_full"),
        ({"high": "0.9"}, "high"),
        ({"low": float("nan")}, "low"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        ControllerConfig(**kwargs)


def test_config_accepts_valid_edges():
    cfg = ControllerConfig(high=1.0, low=0.01, min_residency_s=0, aging_s=0, on_disk_full="drop")
    assert cfg.high == 1.0 and cfg.aging_s == 0


def test_constructor_errors_name_what_is_wrong():
    res = FakeTieredResource(1000, 1000, 1000)
    pressure, oldest, wants_nope = ExactPressure(res), OldestFirst(), WantedGoneFirst("nope")
    wants_aux = WantedGoneFirst("aux")

    class NoCapacity:
        supports_eviction = False

    cap = NoCapacity()
    with pytest.raises(ValueError, match="device_capacity_bytes"):
        EvictionController({"x": cap}, oldest, pressure)
    with pytest.raises(ValueError, match="'nope'"):
        EvictionController({"kv": res}, wants_nope, pressure)
    off = FakeTieredResource(1000, supports_eviction=False)
    with pytest.raises(ValueError, match="'aux'.*does not support eviction"):
        EvictionController({"kv": res, "aux": off}, wants_aux, pressure)
    with pytest.raises(TypeError, match="pressure"):
        EvictionController({"kv": res}, oldest, object())
    with pytest.raises(TypeError, match="policy"):
        EvictionController({"kv": res}, object(), pressure)
    with pytest.raises(ValueError, match="device_capacity_bytes"):
        EvictionController({"kv": res}, oldest, pressure, device_capacity_bytes=0)

    class NoDrop(FakeTieredResource):
        drop = None

    no_drop, drop_cfg = NoDrop(1000, 1000, 1000), ControllerConfig(on_disk_full="drop")
    with pytest.raises(ValueError, match="on_disk_full='drop'.*'kv'.*drop"):
        EvictionController({"kv": no_drop}, oldest, pressure, drop_cfg)


def test_request_bookkeeping_errors_change_nothing():
    rng = random.Random(11)
    res, ctl, clock, rids = _setup(rng, n=5, fill=0.5)
    # adding a known request again is a no-op, as the cache's ingest_request is
    used = ctl.last_used(rids[0])
    clock.advance(3.0)
    ctl.add_request(rids[0])
    ctl.add_request(rids[0], resource="kv")
    assert ctl.last_used(rids[0]) == used
    ctl.check_integrity()
    with pytest.raises(ValueError, match="unknown resource 'gpu'"):
        ctl.add_request("new", resource="gpu")
    with pytest.raises(UnknownRequestError, match="'ghost'"):
        ctl.touch("ghost")
    with pytest.raises(UnknownRequestError, match="'ghost'"):
        ctl.remove_request("ghost")
    with pytest.raises(UnknownRequestError, match="'ghost'"):
        ctl.request_reload("ghost")
    with pytest.raises(ValueError, match=f"{rids[1]!r} has nothing offloaded"):
        ctl.request_reload(rids[1])
    assert ctl.stats()["live_requests"] == 5
    assert ctl.pending_reloads() == ()
    assert res.calls["reload"] == 0


# -- watermarks and hysteresis ---------------------------------------------------------


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hysteresis_offloads_down_to_under_low_and_no_further(policy_name, seed):
    rng = random.Random(seed)
    cfg = ControllerConfig(high=0.9, low=0.7)
    res, ctl, clock, rids = _setup(
        rng, n=60, fill=rng.uniform(0.72, 0.88), policy=_policies()[policy_name], config=cfg
    )
    for rid in rids:
        res.priorities[rid] = rng.random()
    cap = res.device_capacity_bytes

    # between the watermarks: nothing happens, and no request is even looked at
    for _ in range(3):
        clock.advance(0.1)
        report = ctl.evict_if_needed(())
        assert report.offloaded == () and report.bytes_offloaded == 0
    assert res.calls["reclaimable"] == 0 and res.calls["offload"] == 0

    _fill_to(res, ctl, rng, 0.93, "hot")
    before = res.device_used / cap
    assert before > cfg.high
    report = ctl.evict_if_needed(())
    after = res.device_used / cap
    assert report.pressure_before == pytest.approx(before)
    assert report.offloaded, "above high, something must be offloaded"
    assert after < cfg.low
    assert report.projected_after == pytest.approx(after)
    assert report.bytes_offloaded == round((before - after) * cap)
    # not further: without the last victim the projection would not be under low
    last = res.size[report.offloaded[-1]]
    assert after + last / cap >= cfg.low
    res.check_integrity()

    # and once under low, the next pass leaves everything alone
    offloads = res.calls["offload"]
    assert ctl.evict_if_needed(()).offloaded == ()
    assert res.calls["offload"] == offloads


def test_policy_order_is_followed():
    rng = random.Random(5)
    res, ctl, clock, rids = _setup(rng, n=40, fill=0.95, policy=OldestFirst())
    order = sorted(rids, key=lambda r: ctl.last_used(r))
    report = ctl.evict_if_needed(())
    assert list(report.offloaded) == order[: len(report.offloaded)]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    running_share=st.floats(0.0, 1.0),
    policy_name=st.sampled_from(POLICY_NAMES),
    as_list=st.booleans(),
)
def test_running_requests_are_never_offloaded(seed, running_share, policy_name, as_list):
    rng = random.Random(seed)
    res, ctl, clock, rids = _setup(
        rng, n=40, fill=0.97, policy=_policies()[policy_name]
    )
    running = {r for r in rids if rng.random() < running_share}
    report = ctl.evict_if_needed(list(running) if as_list else running)
    assert not running & set(report.offloaded)
    assert not running & set(res.offloaded_rids)
    assert report.skipped_running == len(running)
    for rid in running:
        assert res.state[rid] is RequestState.RESIDENT
    idle = set(rids) - running
    if res.device_used / res.device_capacity_bytes >= ctl.config.low:
        # still above low: then every idle request must have been taken
        assert set(report.offloaded) == idle


@pytest.mark.parametrize("resource_cls", [CountingBulk, NoBulkAnswers])
def test_priority_policy_asks_only_the_named_resource(resource_cls):
    rng = random.Random(8)
    clock = FakeClock()
    kv = resource_cls(10_000, 1 << 30, 1 << 30)
    aux = resource_cls(10_000, 1 << 30, 1 << 30)
    both = [f"b{i}" for i in range(10)]
    aux_only = [f"a{i}" for i in range(5)]
    for rid in both:
        kv.add(rid, rng.randint(500, 900))
        aux.add(rid, rng.randint(500, 900))
        kv.priorities[rid] = rng.random()
    for rid in aux_only:
        aux.add(rid, rng.randint(100, 200))
    for policy in (WantedGoneFirst("kv"), make_policy("priority", resource="kv")):
        kv.calls.clear()
        aux.calls.clear()
        pressure = ScriptedPressure([0.95])
        ctl = EvictionController(
            {"kv": kv, "aux": aux}, policy, pressure, device_capacity_bytes=20_000, clock=clock
        )
        for rid in both:
            ctl.add_request(rid)
        for rid in aux_only:
            ctl.add_request(rid, resource="aux")
        plan = ctl.plan_offload((), 1)
        wanted = max(both, key=lambda r: kv.priorities[r])
        assert plan[0].rid == wanted
        assert plan[0].priority == kv.priorities[wanted]
        # once per request, not per part: one by one, or all in one call
        if resource_cls is NoBulkAnswers:
            assert kv.calls["get_offload_priority"] == len(both)
        else:
            assert kv.calls["get_offload_priority"] == 0
            assert sorted(kv.asked_priority) == both
            assert aux.asked_priority == []
        assert aux.calls["get_offload_priority"] == 0
        report = ctl.evict_if_needed(())
        assert report.offloaded[0] == wanted
        assert aux.calls["get_offload_priority"] == 0
        if resource_cls is CountingBulk:
            kv.asked_priority.clear()
        # aux-only requests were never asked about on kv
        assert all(r not in kv.state for r in aux_only)
        for rid in both:  # reset for the next policy
            for res in (kv, aux):
                if res.state[rid] is RequestState.ON_HOST:
                    assert res.reload(rid)
        for rid in aux_only:
            if aux.state[rid] is RequestState.ON_HOST:
                assert aux.reload(rid)




def _twin_scenario(seed: int, policy: Policy, resource_cls: type) -> tuple:
    """One random scenario; the same seed builds the same requests on any fake class.

    Two evicting resources (kv with offloads left in flight, lora without) and
    one that does not evict; requests on one, two or all three; some on host,
    some reloaded a moment ago, ties in recency and priority.
    """
    rng = random.Random(seed)
    clock = FakeClock()
    kv = resource_cls(1 << 40, 1 << 40, 1 << 40, async_transfers=True, complete_on_poll=False)
    lora = resource_cls(1 << 40, 1 << 40, 1 << 40)
    aux = FakeTieredResource(1 << 40, supports_eviction=False)
    rids = []
    for i in range(rng.randint(1, 70)):
        rid = f"r{rng.randrange(10_000):04d}-{i}"
        where = rng.choice(["kv", "lora", "aux", None])
        for name, res in (("kv", kv), ("lora", lora)):
            if where in (name, None):
                tier = rng.choice([Tier.DEVICE, Tier.DEVICE, Tier.DEVICE, Tier.HOST])
                res.add(rid, rng.choice([4096, 8192, rng.randint(1, 10**6)]), tier)
                res.priorities[rid] = rng.choice([0.0, 0.5, rng.random()])
        rids.append((rid, where))
    capacity = int(1.2 * (kv.device_used + lora.device_used + kv.host_used + lora.host_used)) + 1
    pressure = ScriptedPressure([rng.uniform(0.5, 0.7)])
    ctl = EvictionController(
        {"kv": kv, "lora": lora, "aux": aux}, policy, pressure,
        ControllerConfig(min_residency_s=1.0), device_capacity_bytes=capacity, clock=clock,
    )
    for rid, where in rids:
        ctl.add_request(rid, resource=where)
        clock.advance(rng.choice([0.0, rng.random()]))
    for rid, _ in rng.sample(rids, len(rids) // 2):
        ctl.touch(rid)
        clock.advance(rng.choice([0.0, rng.random()]))
    for rid, where in rids:
        if where != "aux" and any(
            r.state.get(rid) is RequestState.ON_HOST for r in (kv, lora)
        ) and rng.random() < 0.5:
            ctl.request_reload(rid)
            clock.advance(rng.random() * 0.6)
    running = {rid for rid, _ in rids if rng.random() < 0.2}
    needs = [1, rng.randint(1, 2 * 10**6), rng.randint(1, capacity), capacity * 2]
    return ctl, (kv, lora), pressure, running, needs, rng.uniform(0.91, 0.99)


def _twin_runs(seed: int, policy: Policy, resource_cls: type) -> tuple:
    """Plans, then an eviction round, then plans again: what a controller decided."""
    ctl, resources, pressure, running, needs, high_reading = _twin_scenario(
        seed, policy, resource_cls
    )
    plans = [ctl.plan_offload(running, need) for need in needs]
    pressure.set(high_reading)  # offload down to under low: kv's copies stay in flight
    report = ctl.evict_if_needed(running)
    pressure.set(0.5)
    later = [ctl.plan_offload(running, need) for need in needs]
    asked = sum(r.calls["reclaimable"] for r in resources)
    for r in resources:
        r.check_integrity()
    return plans, report, later, asked


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_lazy_asking_picks_the_same_victims_as_asking_everyone_first(seed):
    # lru/priority ask for bytes only while walking the order: one request at
    # a time without the *_many hooks, a chunk at a time with them. A rank-only
    # policy has everyone asked first. Every way must choose the same victims,
    # records and all.
    for lazy_policy, rank_only in (
        (make_policy("lru"), OldestFirst()),
        (make_policy("priority", resource="kv"), WantedGoneFirst("kv")),
    ):
        lazy = _twin_runs(seed, lazy_policy, NoBulkAnswers)
        for policy, resource_cls in (
            (lazy_policy, FakeTieredResource),
            (rank_only, FakeTieredResource),
        ):
            other = _twin_runs(seed, policy, resource_cls)
            assert lazy[:3] == other[:3], (policy.name, resource_cls.__name__)
        everyone = _twin_runs(seed, rank_only, NoBulkAnswers)
        assert lazy[:3] == everyone[:3]
        assert lazy[3] <= everyone[3]  # never asks more than asking everyone
        assert all(all(c.reclaimable > 0 for c in plan) for plan in lazy[0] + lazy[2])


def test_lazy_asking_asks_only_the_requests_it_walks():
    rng = random.Random(31)
    res, ctl, clock, rids = _setup(
        rng, n=3000, fill=0.5, policy=make_policy("lru"), resource_cls=NoBulkAnswers
    )
    oldest = sorted(rids, key=ctl.last_used)
    for rid in oldest[:5]:  # the five oldest have nothing to reclaim: skipped, not picked
        res.offload(rid)
    res.calls.clear()
    plan = ctl.plan_offload((), 1)
    assert [c.rid for c in plan] == [oldest[5]]
    assert res.calls["reclaimable"] == 6
    assert res.calls["get_offload_priority"] == 0
    need = sum(res.size[r] for r in oldest[5:25])
    res.calls.clear()
    plan = ctl.plan_offload((), need)
    assert [c.rid for c in plan] == oldest[5:25]
    assert res.calls["reclaimable"] == 25
    # with reclaimable_many the same plan asks once, for a chunk of the order
    bulk, bulk_ctl, _, _ = _setup(random.Random(31), n=3000, fill=0.5,
                                  policy=make_policy("lru"), resource_cls=CountingBulk)
    for rid in oldest[:5]:
        bulk.offload(rid)
    bulk.calls.clear()
    assert bulk_ctl.plan_offload((), need) == plan
    assert bulk.calls["reclaimable_many"] == 1 and bulk.calls["reclaimable"] == 0
    assert 25 <= bulk.asked <= 500  # the chunk read, far from all 3000
    # a policy that needs the bytes to order has everyone asked
    largest = EvictionController({"kv": bulk}, make_policy("largest"), ScriptedPressure([0.5]),
                                 device_capacity_bytes=bulk.device_capacity_bytes)
    for rid in bulk.state:
        largest.add_request(rid)
    bulk.asked = 0
    largest.plan_offload((), 1)
    assert bulk.asked == 3000 and bulk.calls["reclaimable"] == 0


@pytest.mark.parametrize("resource_cls", [FakeTieredResource, NoBulkAnswers])
@pytest.mark.parametrize("policy_name", ["lru", "largest"])
def test_slots_stay_right_through_adds_and_removes(resource_cls, policy_name):
    rng = random.Random(32)
    clock = FakeClock()
    res = resource_cls(1 << 40, 1 << 40, 1 << 40)
    ctl = EvictionController(
        {"kv": res}, make_policy(policy_name), ScriptedPressure([0.5]),
        device_capacity_bytes=1 << 40, clock=clock,
    )
    live: dict[str, float] = {}
    for step in range(1500):
        clock.advance(rng.choice([0.0, rng.random()]))
        action = rng.random()
        if action < 0.55 or not live:
            rid = f"q{step}"
            res.add(rid, rng.randint(1, 50) * 4096)
            ctl.add_request(rid)
            live[rid] = clock()
        elif action < 0.8:
            rid = rng.choice(sorted(live))
            ctl.remove_request(rid)
            res.remove(rid)
            del live[rid]
        else:
            rid = rng.choice(sorted(live))
            ctl.touch(rid)
            live[rid] = clock()
    assert ctl.stats()["live_requests"] == len(live)
    assert all(ctl.last_used(rid) == t for rid, t in live.items())
    running = set(rng.sample(sorted(live), len(live) // 10))
    plan = ctl.plan_offload(running, 1 << 50)
    if policy_name == "lru":
        expected = sorted(set(live) - running, key=lambda r: (live[r], r))
    else:
        expected = sorted(set(live) - running, key=lambda r: (-res.size[r], live[r], r))
    assert [c.rid for c in plan] == expected
    assert [c.reclaimable for c in plan] == [res.size[r] for r in expected]
    assert [c.last_used for c in plan] == [live[r] for r in expected]


class _Answers(NoBulkAnswers):
    """A fake, asked one request at a time, whose answers a test can spoil."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bad_bytes: dict[str, object] = {}
        self.bad_priority: dict[str, float] = {}

    def reclaimable(self, rid: str) -> int:
        return self.bad_bytes.get(rid, super().reclaimable(rid))

    def get_offload_priority(self, rid: str) -> float:
        return self.bad_priority.get(rid, super().get_offload_priority(rid))


@pytest.mark.parametrize("bad", [1.5, "4096", None, True, 2**63])
@pytest.mark.parametrize("policy_name", ["lru", "largest"])
def test_a_bad_reclaimable_answer_is_refused_by_name(bad, policy_name):
    rng = random.Random(33)
    res = _Answers(1 << 30, 1 << 30, 1 << 30)
    ctl = EvictionController(
        {"kv": res}, make_policy(policy_name), ScriptedPressure([0.5]),
        device_capacity_bytes=1 << 30, clock=FakeClock(),
    )
    for i in range(20):
        res.add(f"r{i}", rng.randint(1, 10**5))
        ctl.add_request(f"r{i}")
    res.bad_bytes = {"r0": bad}
    with pytest.raises(ValueError, match=r"'kv'.*reclaimable\('r0'\)"):
        ctl.plan_offload((), 1 << 40)


def test_bad_bulk_and_priority_answers_are_refused_by_name():
    rng = random.Random(34)
    res = _Answers(1 << 30, 1 << 30, 1 << 30)
    ctl = EvictionController(
        {"kv": res}, make_policy("priority", resource="kv"), ScriptedPressure([0.5]),
        device_capacity_bytes=1 << 30, clock=FakeClock(),
    )
    for i in range(20):
        res.add(f"r{i}", rng.randint(1, 10**5))
        ctl.add_request(f"r{i}")
    res.bad_priority = {"r7": float("nan")}
    with pytest.raises(ValueError, match=r"'kv'.*get_offload_priority\('r7'\).*finite"):
        ctl.plan_offload((), 1)
    res.bad_priority = {}
    assert ctl.plan_offload((), 1)
    for bulk, match in (
        (lambda rids: np.full(len(rids), np.inf), r"get_offload_priority\('r0'\).*finite"),
        (lambda rids: ["high"] * len(rids), r"get_offload_priority_many.*one number each"),
        (lambda rids: np.zeros(len(rids) + 1), r"shape \(21,\) for 20 requests"),
    ):
        res.get_offload_priority_many = bulk  # looked up when the controller is made
        ctl = EvictionController(
            {"kv": res}, make_policy("priority", resource="kv"), ScriptedPressure([0.5]),
            device_capacity_bytes=1 << 30, clock=FakeClock(),
        )
        for rid in res.state:
            ctl.add_request(rid)
        with pytest.raises(ValueError, match=match):
            ctl.plan_offload((), 1)

    def controller_with(bulk_answer) -> EvictionController:
        short = _Answers(1 << 30, 1 << 30, 1 << 30)
        short.reclaimable_many = bulk_answer  # looked up when the controller is made
        ctl = EvictionController(
            {"kv": short}, make_policy("largest"), ScriptedPressure([0.5]),
            device_capacity_bytes=1 << 30, clock=FakeClock(),
        )
        for i in range(3):
            short.add(f"r{i}", 4096)
            ctl.add_request(f"r{i}")
        return ctl

    ctl = controller_with(lambda rids: np.ones(len(rids) - 1, dtype=np.int64))
    with pytest.raises(ValueError, match=r"'kv'.*shape \(2,\) for 3 requests"):
        ctl.plan_offload((), 1)
    ctl = controller_with(lambda rids: [4096.5] * len(rids))
    with pytest.raises(ValueError, match=r"'kv'.*reclaimable\('r0'\) returned 4096.5"):
        ctl.plan_offload((), 1)
    ctl = controller_with(lambda rids: np.full(len(rids), 4096, dtype=np.uint64))
    assert [c.rid for c in ctl.plan_offload((), 1 << 20)] == ["r0", "r1", "r2"]


@pytest.mark.parametrize("policy", [OldestFirst(), make_policy("lru"), make_policy("largest"),
                                    make_policy("cost")])
def test_policies_without_a_named_resource_never_ask_for_priority(policy):
    rng = random.Random(9)
    res, ctl, clock, rids = _setup(rng, n=30, fill=0.96, policy=policy)
    report = ctl.evict_if_needed(())
    assert report.offloaded
    assert res.calls["get_offload_priority"] == 0


def test_a_resource_without_eviction_is_never_asked():
    rng = random.Random(10)
    clock = FakeClock()
    kv = FakeTieredResource(10_000, 2_200, 1_000_000, async_transfers=True)
    aux = FakeTieredResource(10_000, 10_000, 10_000, supports_eviction=False)
    ctl = EvictionController(
        {"kv": kv, "aux": aux},
        OldestFirst(),
        ExactPressure(kv),
        ControllerConfig(aging_s=1.0),
        device_capacity_bytes=10_000,
        clock=clock,
    )
    for i in range(31):
        rid = f"r{i}"
        kv.add(rid, 300)
        aux.add(rid, rng.randint(100, 200))
        ctl.add_request(rid)
        clock.advance(0.1)
    for _ in range(5):
        ctl.evict_if_needed(())
        clock.advance(2.0)
    offloaded = [r for r in kv.state if kv.state[r] is not RequestState.RESIDENT]
    assert offloaded
    kv.complete_transfers()
    ctl.request_reload(offloaded[0])
    ctl.evict_if_needed(())
    assert ctl.stats()["demotions"] > 0  # the cascade ran on kv
    for hook in ("reclaimable", "reclaimable_many", "offload", "get_offload_priority",
                 "is_offloaded",
                 "can_reload", "reload", "reload_bytes", "tier_of", "demote", "drop",
                 "host_used_bytes"):
        assert aux.calls[hook] == 0, hook
    assert aux.calls["poll"] > 0  # poll is the only thing it is asked


@pytest.mark.parametrize("policy_name", ["lru", "largest"])
def test_with_no_resource_that_evicts_nothing_is_picked(policy_name):
    rng = random.Random(35)
    aux = FakeTieredResource(10_000, 10_000, 10_000, supports_eviction=False)
    ctl = EvictionController({"aux": aux}, make_policy(policy_name), ScriptedPressure([0.99]),
                             clock=FakeClock())
    for i in range(rng.randint(1, 20)):
        aux.add(f"r{i}", rng.randint(1, 400))
        ctl.add_request(f"r{i}")
    assert ctl.plan_offload((), 1000) == ()
    report = ctl.evict_if_needed(())
    assert report.offloaded == () and report.pressure_before == 0.99
    assert sum(aux.calls.values()) == aux.calls["poll"]


def test_idle_path_does_no_per_request_work():
    rng = random.Random(12)
    res, ctl, clock, rids = _setup(rng, n=500, fill=0.6)
    res.calls.clear()
    for _ in range(50):
        report = ctl.evict_if_needed(rids[:10])
        assert report == EvictionReport(report.pressure_before, report.pressure_before,
                                        (), 0, (), (), (), 0)
    assert res.calls["reclaimable"] == 0
    assert res.calls["tier_of"] == 0
    assert res.calls["poll"] == 50  # once per resource per call
    assert res.calls["host_used_bytes"] == 50  # the cascade check is one call too


def test_no_sample_yet_means_no_action():
    clock = FakeClock()
    res = FakeTieredResource(1000, 1000, 1000)
    res.add("a", 860)  # under the 880-byte admission limit: a victim that may come back
    res.add("c", 60)
    res.add("b", 40, Tier.HOST)
    lagging = LaggingPressure(ExactPressure(res))
    ctl = EvictionController({"kv": res}, OldestFirst(), lagging, clock=clock)
    ctl.add_request("a")
    ctl.add_request("b")
    ctl.add_request("c")
    report = ctl.evict_if_needed(())
    assert report.offloaded == () and res.calls["reclaimable"] == 0
    assert ctl.request_reload("b") is False  # waits for a reading
    lagging.sample()
    report = ctl.evict_if_needed(())
    assert report.offloaded == ("a",)


# -- in-flight offloads are not counted twice ------------------------------------------


@pytest.mark.parametrize("lagging", [False, True])
def test_offloads_in_flight_do_not_cause_a_second_round(lagging):
    rng = random.Random(14)
    clock = FakeClock()
    res = FakeTieredResource(100_000, 1 << 30, 1 << 30, async_transfers=True,
                             complete_on_poll=False)
    exact = ExactPressure(res)
    pressure = LaggingPressure(exact) if lagging else exact
    ctl = EvictionController({"kv": res}, OldestFirst(), pressure, clock=clock)
    _fill_to(res, ctl, rng, 0.95, "r")
    if lagging:
        pressure.sample()
    first = ctl.evict_if_needed(())
    assert first.offloaded and first.projected_after < ctl.config.low
    assert res.device_used / 100_000 > 0.9  # copies still in flight: nothing freed yet
    second = ctl.evict_if_needed(())
    assert second.offloaded == ()
    assert second.pressure_before == pytest.approx(first.projected_after)
    res.complete_transfers()
    real = res.device_used / 100_000
    assert real == pytest.approx(first.projected_after)
    for _ in range(3):
        if lagging:
            pressure.sample()
        report = ctl.evict_if_needed(())
        assert report.offloaded == ()
        # a lagging source may show the release a sample late: the controller may
        # under-estimate for a moment (never evicting more), never over-estimate
        assert report.pressure_before <= real + 1e-9
    assert report.pressure_before == pytest.approx(real)
    assert ctl.stats()["offloads_in_flight"] == 0
    assert ctl.stats()["releasing_bytes"] == 0


def test_a_failed_offload_copy_is_no_longer_counted_as_leaving():
    rng = random.Random(17)
    clock = FakeClock()
    res = FakeTieredResource(100_000, 1 << 30, 1 << 30, async_transfers=True,
                             complete_on_poll=False)
    ctl = EvictionController({"kv": res}, OldestFirst(), ExactPressure(res), clock=clock)
    _fill_to(res, ctl, rng, 0.95, "r")
    first = ctl.evict_if_needed(())
    assert first.offloaded
    for rid in first.offloaded:
        res.fail_transfer(rid)  # every copy fails; the requests stay resident
    res.check_integrity()
    second = ctl.evict_if_needed(())
    assert second.pressure_before == pytest.approx(res.device_used / 100_000)
    assert second.offloaded == first.offloaded  # offloaded again, the same victims
    assert ctl.stats()["offloads_in_flight"] == len(first.offloaded)


# -- reload admission ---------------------------------------------------------------------


def test_ledger_counts_a_reload_for_admission_until_certainly_seen():
    ledger = InFlightLedger(lag=2)
    ledger.add_reload(300, before=5, after=6)
    assert ledger.reserved_bytes == 300
    assert ledger.unseen_reload_bytes(5) == 300  # sample 5 was published before it
    assert ledger.unseen_reload_bytes(6) == 0  # sample 6 may show it: eviction ignores it
    ledger.expire(7)
    assert ledger.reserved_bytes == 300  # sample 7 may have begun before it
    ledger.expire(8)
    assert ledger.reserved_bytes == 0 and not ledger


def test_ledger_releases_offloads_after_completion_and_a_fresh_sample():
    ledger = InFlightLedger(lag=1)
    ledger.add_offload(("kv", "a"), 500)
    with pytest.raises(ValueError, match="already in flight"):
        ledger.add_offload(("kv", "a"), 500)
    ledger.expire(10)
    assert ledger.releasing_bytes == 500  # still in flight: no sample can show it
    ledger.settle_offload(("kv", "a"), stamp=10)
    assert ledger.releasing_bytes == 500
    ledger.expire(11)
    assert ledger.releasing_bytes == 0
    ledger.add_offload(("kv", "b"), 70)
    ledger.forget_offload(("kv", "b"))
    assert ledger.releasing_bytes == 0 and not ledger


def test_reload_queue_drains_best_first_and_restores():
    queue = ReloadQueue(aging_s=1.0)
    queue.push("a", now=10.0)
    queue.push("b", now=11.0, base=5.0)
    queue.push("c", now=12.0)
    with pytest.raises(ValueError, match="'a' is already waiting"):
        queue.push("a", now=13.0)
    queue.remove("c")
    drained = [e.rid for e in queue.drain_in_order()]
    assert drained == ["b", "a"]
    assert len(queue) == 2
    for entry in queue.entries():
        queue.restore(entry)
    assert [e.rid for e in queue.drain_in_order()] == ["b", "a"]


def _offloaded_world(rng, *, lag: str, n_host: int = 40):
    """Device ~40% full with resident requests, many requests waiting on host."""
    clock = FakeClock()
    res = FakeTieredResource(1_000_000, 1 << 30, 1 << 30, enforce_device_capacity=False)
    exact = ExactPressure(res)
    if lag == "poller":
        pressure = PressurePoller(exact, interval_s=60.0, clock=clock)  # never started
        sample = pressure.sample_now
    elif lag == "fake":
        pressure = LaggingPressure(exact, clock)
        sample = pressure.sample
    else:
        pressure, sample = exact, (lambda: None)
    cfg = ControllerConfig(high=0.9, low=0.75, reload_headroom=0.05)
    ctl = EvictionController({"kv": res}, OldestFirst(), pressure, cfg, clock=clock)
    i = 0
    while res.device_used < 400_000:
        rid = f"d{i}"
        res.add(rid, rng.randint(5_000, 20_000))
        ctl.add_request(rid)
        i += 1
    host = []
    for j in range(n_host):
        rid = f"h{j}"
        res.add(rid, rng.randint(10_000, 40_000), Tier.HOST)
        ctl.add_request(rid)
        host.append(rid)
    sample()
    limit = (cfg.high - cfg.reload_headroom) * res.device_capacity_bytes
    return res, ctl, clock, host, sample, limit


@pytest.mark.parametrize("lag", ["poller", "fake", "exact"])
@pytest.mark.parametrize("seed", [1, 2])
def test_admission_never_oversubscribes_even_when_pressure_lags(lag, seed):
    rng = random.Random(seed)
    res, ctl, clock, host, sample, limit = _offloaded_world(rng, lag=lag)
    # the stale reading alone would admit every one of them: the test can fail
    assert res.device_used + sum(res.size[r] for r in host) > limit
    started = [r for r in host if ctl.request_reload(r)]
    assert res.max_device_used <= limit
    assert started, "some reloads fit and must start"
    waiting = ctl.pending_reloads()
    assert set(waiting) == set(host) - set(started)
    if lag != "exact":
        # the source has not seen any of them: the controller counted them itself
        assert ctl.stats()["reserved_reload_bytes"] == sum(res.size[r] for r in started)
    # more samples and passes: still never over the limit, and the device fills up to it
    for _ in range(6):
        sample()
        clock.advance(0.5)
        ctl.evict_if_needed(())
        assert res.max_device_used <= limit
        res.check_integrity()
    sample()
    sample()
    ctl.evict_if_needed(())
    assert ctl.stats()["reserved_reload_bytes"] == 0, "reservations must not be counted forever"
    left = ctl.pending_reloads()
    assert left, "the scenario is meant to leave some waiting"
    smallest = min(res.size[r] for r in left)
    assert res.device_used + smallest > limit, "admission stalled below the limit"


def test_a_refusing_resource_keeps_the_reload_waiting():
    rng = random.Random(3)
    clock = FakeClock()
    res = FakeTieredResource(100_000, 1 << 20, 1 << 20)
    waiting = rng.randint(10_000, 20_000)
    res.add("w", waiting, Tier.HOST)
    res.add("filler", 100_000 - waiting + 1)  # one byte short of room
    # the pressure source claims plenty of room; the resource knows better
    ctl = EvictionController(
        {"kv": res}, OldestFirst(), ScriptedPressure([0.3]), clock=clock
    )
    ctl.add_request("w")
    ctl.add_request("filler")
    assert ctl.request_reload("w") is False
    assert ctl.pending_reloads() == ("w",)
    assert ctl.stats()["reload_resource_refusals"] == 1
    assert ctl.stats()["reserved_reload_bytes"] == 0  # nothing reserved for a refusal
    assert res.state["w"] is RequestState.ON_HOST
    res.remove("filler")
    ctl.remove_request("filler")
    assert ctl.evict_if_needed(()).reloads_started == ("w",)
    assert ctl.pending_reloads() == ()
    assert res.state["w"] is RequestState.RESIDENT


def test_a_request_on_two_resources_is_admitted_as_a_whole():
    clock = FakeClock()
    kv = FakeTieredResource(10_000, 1 << 20, 1 << 20)
    aux = FakeTieredResource(10_000, 1 << 20, 1 << 20)
    kv.add("r", 1_500, Tier.HOST)
    aux.add("r", 700, Tier.HOST)
    aux.add("hog", 9_500)  # aux itself has no room yet
    ctl = EvictionController(
        {"kv": kv, "aux": aux}, OldestFirst(), ScriptedPressure([0.2]),
        device_capacity_bytes=20_000, clock=clock,
    )
    ctl.add_request("r")
    ctl.add_request("hog", resource="aux")
    assert ctl.request_reload("r") is False
    assert kv.state["r"] is RequestState.RESIDENT  # its kv part went first
    assert aux.state["r"] is RequestState.ON_HOST
    assert ctl.request_reload("r") is False  # already waiting: no second entry
    assert ctl.pending_reloads() == ("r",)
    clock.advance(3.0)
    assert ctl.evict_if_needed({"hog"}).reloads_started == ()
    assert kv.calls["reload"] == 1  # the kv part is not reloaded twice
    aux.remove("hog")
    ctl.remove_request("hog")
    report = ctl.evict_if_needed(())
    assert report.reloads_started == ("r",)
    stats = ctl.stats()
    assert stats["reloads_started"] == 1
    assert stats["bytes_reloaded"] == 2_200 == stats["bytes_host_to_device"]
    assert stats["max_wait_s"] == 3.0
    assert stats["reload_resource_refusals"] == 2


def test_removing_a_request_cancels_its_waiting_reload():
    clock = FakeClock()
    res = FakeTieredResource(1000, 10_000, 10_000)
    res.add("full", 850)
    res.add("w", 100, Tier.HOST)
    ctl = EvictionController({"kv": res}, OldestFirst(), ExactPressure(res), clock=clock)
    ctl.add_request("full")
    ctl.add_request("w")
    assert ctl.request_reload("w") is False
    clock.advance(2.5)
    assert ctl.stats()["max_wait_s"] == 2.5  # the current wait counts
    assert ctl.stats()["reload_waits"] == 1
    ctl.remove_request("w")
    res.remove("full")
    assert ctl.pending_reloads() == ()
    assert ctl.evict_if_needed(()).reloads_started == ()
    assert res.calls["reload"] == 0
    assert ctl.stats()["reload_waits"] == 0


def test_reload_that_can_never_fit_is_refused_up_front():
    clock = FakeClock()
    res = FakeTieredResource(1000, 10_000, 10_000)
    res.add("big", 900, Tier.HOST)
    ctl = EvictionController({"kv": res}, OldestFirst(), ExactPressure(res), clock=clock)
    ctl.add_request("big")
    with pytest.raises(ValueError, match="'big' needs 900 bytes.*880"):
        ctl.request_reload("big")
    assert ctl.pending_reloads() == () and res.calls["reload"] == 0


def test_waiting_order_ages_base_priority():
    clock = FakeClock()
    res = FakeTieredResource(1000, 10_000, 10_000)
    res.add("blocker", 850)
    base = {"old": 0.0, "vip": 3.0, "late": 0.0}
    for rid in base:
        res.add(rid, 100, Tier.HOST)
    ctl = EvictionController(
        {"kv": res}, OldestFirst(), ExactPressure(res), ControllerConfig(aging_s=2.0),
        clock=clock, reload_priority=base.__getitem__,
    )
    for rid in ("blocker", *base):
        ctl.add_request(rid)
    assert ctl.request_reload("old") is False
    clock.advance(4.0)  # "old" has gained 2 units
    assert ctl.request_reload("vip") is False  # base 3 beats 2 units of waiting
    clock.advance(0.5)
    assert ctl.request_reload("late") is False
    assert ctl.pending_reloads() == ("vip", "old", "late")
    clock.advance(1.0)
    ctl.remove_request("vip")
    assert ctl.pending_reloads() == ("old", "late")


def test_aging_zero_is_plain_arrival_order():
    clock = FakeClock()
    res = FakeTieredResource(1000, 10_000, 10_000)
    res.add("blocker", 850)
    for rid in ("a", "b"):
        res.add(rid, 100, Tier.HOST)
    ctl = EvictionController(
        {"kv": res}, OldestFirst(), ExactPressure(res), ControllerConfig(aging_s=0.0),
        clock=clock, reload_priority={"a": 0.0, "b": 100.0}.__getitem__,
    )
    for rid in ("blocker", "a", "b"):
        ctl.add_request(rid)
    ctl.request_reload("a")
    clock.advance(1.0)
    ctl.request_reload("b")
    assert ctl.pending_reloads() == ("a", "b")


def _stream(aging_s: float, steps: int, seed: int):
    """Small reloads arrive every step and run for a while; one big reload waits.

    Every device request is running, so only the queue's passing rule can make
    room for the big one.
    """
    rng = random.Random(seed)
    clock = FakeClock()
    cap = 100_000
    res = FakeTieredResource(cap, 1 << 30, 1 << 30)
    cfg = ControllerConfig(high=0.9, low=0.75, reload_headroom=0.02, aging_s=aging_s)
    ctl = EvictionController({"kv": res}, OldestFirst(), ExactPressure(res), cfg, clock=clock)
    running: dict[str, int] = {}  # rid -> step it finishes
    i = 0
    while res.device_used < 80_000:
        rid = f"w{i}"
        res.add(rid, rng.randint(2_000, 4_000))
        ctl.add_request(rid)
        running[rid] = rng.randint(1, 8)
        i += 1
    res.add("big", 25_000, Tier.HOST)
    ctl.add_request("big")
    assert ctl.request_reload("big") is False
    admitted_at = None
    passed_while_young = 0
    for step in range(steps):
        clock.advance(1.0)
        for rid in [r for r, end in running.items() if end <= step]:
            del running[rid]
            res.remove(rid)
            ctl.remove_request(rid)
        for _ in range(6):  # a steady stream of small ones, more than the device can hold
            rid = f"s{i}"
            i += 1
            res.add(rid, rng.randint(1_000, 3_000), Tier.HOST)
            ctl.add_request(rid)
            if ctl.request_reload(rid):
                running[rid] = step + rng.randint(5, 12)
                if admitted_at is None:
                    passed_while_young += 1
        report = ctl.evict_if_needed(running)
        assert not set(report.offloaded) & set(running)
        for rid in report.reloads_started:
            if rid == "big":
                admitted_at = step
                running["big"] = step + 1000
            else:
                running[rid] = step + rng.randint(5, 12)
                if admitted_at is None:
                    passed_while_young += 1
        assert res.max_device_used <= 0.88 * cap
        if admitted_at is not None:
            break
    return admitted_at, passed_while_young, ctl


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_waiting_reload_starves_under_a_stream_of_small_ones(seed):
    admitted_at, passed, ctl = _stream(aging_s=5.0, steps=200, seed=seed)
    assert admitted_at is not None, "the big reload starved"
    # small ones were allowed past it while it was young, and not for ever after
    assert passed > 0
    assert admitted_at <= 5 + 12 + 1  # blocks after aging_s; the running ones end by then
    assert ctl.stats()["max_wait_s"] >= 5.0


def test_without_the_passing_limit_the_big_one_would_starve():
    # the same stream with a passing window longer than the run: it never fits
    admitted_at, passed, _ = _stream(aging_s=1e9, steps=200, seed=1)
    assert admitted_at is None and passed > 100


def test_a_long_waiting_reload_gets_room_made_from_idle_requests():
    rng = random.Random(21)
    clock = FakeClock()
    res = FakeTieredResource(100_000, 1 << 30, 1 << 30)
    cfg = ControllerConfig(high=0.9, low=0.75, aging_s=3.0, min_residency_s=0.5)
    ctl = EvictionController({"kv": res}, OldestFirst(), ExactPressure(res), cfg, clock=clock)
    _fill_to(res, ctl, rng, 0.8, "idle")  # between the watermarks: no pressure eviction
    for rid in rng.sample(sorted(res.state), len(res.state)):
        clock.advance(0.01)
        ctl.touch(rid)
    res.add("big", 30_000, Tier.HOST)
    ctl.add_request("big")
    assert ctl.request_reload("big") is False
    for _ in range(2):
        clock.advance(1.0)
        assert ctl.evict_if_needed(()).offloaded == ()  # young: it waits
    clock.advance(1.5)
    report = ctl.evict_if_needed(())
    assert report.offloaded, "an old head must get room made for it"
    order = sorted((r for r in res.state if r.startswith("idle")), key=ctl.last_used)
    assert list(report.offloaded) == order[: len(report.offloaded)]
    assert ctl.stats()["make_room_offloads"] == len(report.offloaded)
    report = ctl.evict_if_needed(())
    assert report.reloads_started == ("big",)
    assert res.state["big"] is RequestState.RESIDENT
    assert res.max_device_used <= 0.88 * 100_000


def test_minimum_residency_protects_a_reloaded_request():
    rng = random.Random(4)
    clock = FakeClock()
    res = FakeTieredResource(100_000, 1 << 30, 1 << 30)
    cfg = ControllerConfig(min_residency_s=2.0)
    ctl = EvictionController({"kv": res}, OldestFirst(), ExactPressure(res), cfg, clock=clock)
    res.add("back", 5_000, Tier.HOST)
    ctl.add_request("back")  # the oldest request of all
    clock.advance(1.0)
    _fill_to(res, ctl, rng, 0.5, "a")
    assert ctl.request_reload("back") is True
    _fill_to(res, ctl, rng, 0.95, "b")
    clock.advance(1.0)
    report = ctl.evict_if_needed(())
    assert report.offloaded and "back" not in report.offloaded
    assert res.state["back"] is RequestState.RESIDENT
    clock.advance(1.0)  # now 2 s since the reload
    _fill_to(res, ctl, rng, 0.95, "c")
    report = ctl.evict_if_needed(())
    assert report.offloaded[0] == "back"


# -- host -> disk cascade ----------------------------------------------------------------


def _host_world(rng, *, disk: int, on_disk_full: str = "keep", async_transfers=False):
    clock = FakeClock()
    host_cap = 100_000
    res = FakeTieredResource(1_000_000, host_cap, disk, async_transfers=async_transfers,
                             complete_on_poll=False)
    cfg = ControllerConfig(host_high=0.9, host_low=0.7, on_disk_full=on_disk_full)
    ctl = EvictionController({"kv": res}, OldestFirst(), ExactPressure(res), cfg, clock=clock)
    rids = []
    while res.host_used < 0.95 * host_cap:
        rid = f"h{len(rids)}"
        size = min(rng.randint(2_000, 6_000), host_cap - res.host_used)
        res.add(rid, size, Tier.HOST)
        ctl.add_request(rid)
        rids.append(rid)
    for rid in rng.sample(rids, len(rids)):
        clock.advance(0.1)
        ctl.touch(rid)
    coldest = sorted(rids, key=ctl.last_used)
    return res, ctl, clock, coldest


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cascade_demotes_the_coldest_host_requests_to_under_host_low(seed):
    rng = random.Random(seed)
    res, ctl, clock, coldest = _host_world(rng, disk=1 << 30)
    report = ctl.evict_if_needed(())
    assert report.offloaded == ()
    assert list(report.demoted) == coldest[: len(report.demoted)]
    assert res.host_used < 0.7 * 100_000
    assert res.host_used + res.size[report.demoted[-1]] >= 0.7 * 100_000  # no further
    for rid in report.demoted:
        assert res.state[rid] is RequestState.ON_DISK
    stats = ctl.stats()
    assert stats["demotions"] == len(report.demoted)
    assert stats["bytes_demoted"] == stats["bytes_host_to_disk"] == res.disk_used
    assert ctl.evict_if_needed(()).demoted == ()
    res.check_integrity()


def test_cascade_counts_demotions_in_flight_once():
    rng = random.Random(6)
    res, ctl, clock, coldest = _host_world(rng, disk=1 << 30, async_transfers=True)
    first = ctl.evict_if_needed(())
    assert first.demoted
    assert res.host_used > 0.9 * 100_000  # still held until the writes complete
    assert ctl.evict_if_needed(()).demoted == ()
    res.complete_transfers()
    assert ctl.evict_if_needed(()).demoted == ()
    assert res.host_used < 0.7 * 100_000
    assert ctl.stats()["demotions_in_flight"] == 0


def test_a_failed_demotion_is_tried_again():
    rng = random.Random(6)
    res, ctl, clock, coldest = _host_world(rng, disk=1 << 30, async_transfers=True)
    first = ctl.evict_if_needed(())
    assert first.demoted
    for rid in first.demoted:
        res.fail_transfer(rid)  # the disk writes fail; the requests stay on host
    second = ctl.evict_if_needed(())
    assert second.demoted == first.demoted
    assert ctl.stats()["demotions_in_flight"] == len(first.demoted)


def test_disk_full_keep_leaves_it_on_host_and_counts():
    rng = random.Random(7)
    res, ctl, clock, coldest = _host_world(rng, disk=7_000)
    report = ctl.evict_if_needed(())
    assert report.dropped == ()
    assert len(report.demoted) <= 1
    stats = ctl.stats()
    assert stats["disk_full_keeps"] == 1
    assert stats["drops"] == 0
    kept = coldest[len(report.demoted)]
    assert res.state[kept] is RequestState.ON_HOST
    assert all(res.state[r] is not RequestState.LOST for r in coldest)


def test_disk_full_drop_drops_for_recompute_and_reports_it():
    rng = random.Random(7)
    res, ctl, clock, coldest = _host_world(rng, disk=7_000, on_disk_full="drop")
    report = ctl.evict_if_needed(())
    assert report.dropped, "a full disk with on_disk_full='drop' must drop"
    n = len(report.demoted) + len(report.dropped)
    assert set(report.demoted) | set(report.dropped) == set(coldest[:n])
    for rid in report.dropped:
        assert res.state[rid] is RequestState.LOST
    stats = ctl.stats()
    assert stats["drops"] == len(report.dropped) == res.calls["drop"]
    assert stats["bytes_dropped"] == sum(res.size[r] for r in report.dropped)
    assert stats["disk_full_keeps"] == 0
    assert res.host_used < 0.7 * 100_000


# -- stats and exporter -------------------------------------------------------------------


def test_stats_are_plain_numbers_with_link_totals():
    rng = random.Random(15)
    clock = FakeClock()
    res = FakeTieredResource(100_000, 30_000, 1 << 30)
    ctl = EvictionController({"kv": res}, OldestFirst(), ExactPressure(res), clock=clock)
    _fill_to(res, ctl, rng, 0.95, "r")
    r1 = ctl.evict_if_needed(())
    r2 = ctl.evict_if_needed(())
    disk = [r for r in r1.offloaded + r2.demoted if res.state[r] is RequestState.ON_DISK]
    host = [r for r in r1.offloaded if res.state[r] is RequestState.ON_HOST]
    if disk:
        ctl.request_reload(disk[0])
    if host:
        ctl.request_reload(host[0])
    stats = ctl.stats()
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in stats.values())
    assert stats["bytes_device_to_host"] + stats["bytes_device_to_disk"] == stats["bytes_offloaded"]
    assert stats["bytes_host_to_device"] + stats["bytes_disk_to_device"] == stats["bytes_reloaded"]
    assert stats["bytes_host_to_device"] == (res.size[host[0]] if host else 0)
    assert stats["bytes_disk_to_device"] == (res.size[disk[0]] if disk else 0)
    assert stats["evict_calls"] == 2
    for key in ("offloads", "bytes_offloaded", "demotions", "bytes_demoted", "drops",
                "reloads_started", "reload_refusals", "reload_waits", "max_wait_s",
                "evict_calls", "disk_full_keeps"):
        assert key in stats


def test_prometheus_exporter_exposes_stats():
    from prometheus_client import CollectorRegistry

    from tiering.control.metrics import PrometheusExporter

    rng = random.Random(16)
    res, ctl, clock, rids = _setup(rng, n=30, fill=0.96)
    registry = CollectorRegistry()
    exporter = PrometheusExporter(ctl, registry)
    report = ctl.evict_if_needed(())
    value = registry.get_sample_value
    assert value("tiering_controller_offloads_total") == len(report.offloaded)
    assert value("tiering_controller_bytes_offloaded_total") == report.bytes_offloaded
    assert value("tiering_controller_evict_calls_total") == 1
    assert value("tiering_controller_live_requests") == 30
    assert value("tiering_controller_reload_waits") == 0
    exporter.close()
    assert value("tiering_controller_offloads_total") is None


def test_prometheus_exporter_says_what_is_missing(monkeypatch):
    import sys

    from tiering.control.metrics import PrometheusExporter

    class Stats:
        def stats(self):
            return {}

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(ImportError, match="prometheus_client.*tiering\\[metrics\\]"):
        PrometheusExporter(Stats())


# -- a scan that found nothing to offload is not repeated ------------------------------------


class AlwaysRescan(EvictionController):
    """The controller without its memory of a scan that found nothing: every call over
    ``high`` scans again. The reference the shortcut is compared with."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._eviction.reuse_scans = False


class RoomAware(FakeTieredResource):
    """The fake, answering ``reclaimable`` 0 for a request that neither host nor disk has
    room for, as ``PagedKVCache`` does."""

    def _fits_below(self, rid: str) -> bool:
        n = self.size[rid]
        return (self.host_used + n <= self.host_capacity_bytes
                or self.disk_used + n <= self.disk_capacity)

    def reclaimable(self, rid: str) -> int:
        n = super().reclaimable(rid)
        return n if n and self._fits_below(rid) else 0

    def reclaimable_many(self, rids):
        told = super().reclaimable_many(rids).tolist()
        return np.array([n if n and self._fits_below(r) else 0
                         for r, n in zip(rids, told, strict=True)], dtype=np.int64)


class Unmetered(FakeTieredResource):
    """The fake without host and disk gauges, so a test sees what other cues catch."""

    host_used_bytes = None
    disk_used_bytes = None


class RoomAwareUnmetered(RoomAware):
    host_used_bytes = None
    disk_used_bytes = None


class Growing(ReclaimsNothing, Unmetered):
    """Requests in ``empty`` hold no device pages yet (``reclaimable`` 0 while resident);
    the test makes one grow with nothing the controller is told, as a worker's step does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.empty: set[str] = set()

    def holds_nothing(self, rid: str) -> bool:
        return rid in self.empty


class NoPoll(FakeTieredResource):
    poll = None


BUSY = ControllerConfig(high=0.8, low=0.6, min_residency_s=1.0)
DEVICE = 100_000


class World:
    """One resource and one controller; twins are built from the same seed."""

    def __init__(self, cls, seed, *, resource_cls=FakeTieredResource, policy_name="lru",
                 host=1 << 30, disk=1 << 30, fill=0.9, config=BUSY, scripted=False,
                 **fake_kwargs):
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.res = resource_cls(DEVICE, host, disk, **fake_kwargs)
        self.pressure = ScriptedFraction(0.9) if scripted else ExactPressure(self.res)
        self.ctl = cls({"kv": self.res}, _policies()[policy_name], self.pressure, config,
                       clock=self.clock)
        self.rids: list[str] = []
        self.grow_to(fill, "r")
        for rid in self.rng.sample(self.rids, len(self.rids)):  # recency unrelated to size
            self.clock.advance(self.rng.uniform(0.01, 0.1))
            self.ctl.touch(rid)

    def add(self, rid: str, size: int, tier: Tier = Tier.DEVICE) -> str:
        self.res.add(rid, size, tier)
        self.ctl.add_request(rid)
        self.clock.advance(self.rng.uniform(0.01, 0.1))
        return rid

    def grow_to(self, fill: float, tag: str) -> None:
        """Add resident requests (the worker's own growth) until the device is over ``fill``."""
        while self.res.device_used < fill * DEVICE:
            size = min(self.rng.randint(1_000, 6_000), DEVICE - self.res.device_used)
            self.rids.append(self.add(f"{tag}{len(self.rids):03d}", size))

    def skipped(self) -> int:
        return self.ctl.stats()["scans_skipped"]


def _twins(scenario, **world_kwargs):
    """Run ``scenario(world)`` over identical worlds, one with the shortcut, one that
    always rescans; check that every call decided and counted the same; return the
    shortcut's world and the reports."""
    fast = World(EvictionController, **world_kwargs)
    slow = World(AlwaysRescan, **world_kwargs)
    reports = scenario(fast)
    assert scenario(slow) == reports
    assert fast.res.state == slow.res.state
    mine, reference = fast.ctl.stats(), slow.ctl.stats()
    assert reference.pop("scans_skipped") == 0
    mine.pop("scans_skipped")
    assert mine == reference
    fast.res.check_integrity()
    return fast, reports


def _call(world, running, times: int) -> list[EvictionReport]:
    return [world.ctl.evict_if_needed(running) for _ in range(times)]


RUNNING_KINDS = ("frozenset", "set", "list", "tuple", "dict")


def _as(kind: str, rids):
    return {"frozenset": frozenset, "set": set, "list": list, "tuple": tuple,
            "dict": dict.fromkeys}[kind](rids)


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@pytest.mark.parametrize("resource_cls", [FakeTieredResource, NoBulkAnswers])
@pytest.mark.parametrize("kind", RUNNING_KINDS)
def test_a_busy_step_asks_no_resource_about_any_request(policy_name, resource_cls, kind):
    def scenario(w):
        for i in range(w.rng.randint(20, 40)):  # idle, offloaded: nothing to reclaim
            w.add(f"h{i:03d}", w.rng.randint(1_000, 6_000), Tier.HOST)
        running = _as(kind, w.rids)
        first = w.ctl.evict_if_needed(running)
        assert first.pressure_before > BUSY.high and first.offloaded == ()
        w.res.calls.clear()
        return [first, *_call(w, running, 5)]

    fast, reports = _twins(scenario, seed=3, policy_name=policy_name,
                           resource_cls=resource_cls)
    asked = ("reclaimable", "reclaimable_many", "get_offload_priority",
             "get_offload_priority_many", "tier_of", "offload")
    assert {name: fast.res.calls[name] for name in asked} == dict.fromkeys(asked, 0)
    assert fast.skipped() == 5
    assert all(r.skipped_running == len(fast.rids) for r in reports)


@pytest.mark.parametrize("policy_name", ["lru", "largest"])
def test_the_rescanning_twin_does_ask_every_call(policy_name):
    # the reference really scans: the counts above are not zero by construction
    w = World(AlwaysRescan, 3, policy_name=policy_name)
    for i in range(10):
        w.add(f"h{i}", 2_000, Tier.HOST)
    running = frozenset(w.rids)
    _call(w, running, 1)
    w.res.calls.clear()
    _call(w, running, 5)
    assert w.res.calls["reclaimable_many"] == 5


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@pytest.mark.parametrize("kind", RUNNING_KINDS)
def test_a_request_that_stops_running_is_offloaded_at_once(policy_name, kind):
    def scenario(w):
        running = _as(kind, w.rids)
        out = _call(w, running, 3)
        leaving = w.rng.choice(w.rids)
        if kind in ("set", "dict"):
            running.pop(leaving) if kind == "dict" else running.discard(leaving)
        else:
            running = _as(kind, [r for r in w.rids if r != leaving])
        out += _call(w, running, 3)
        assert out[3].offloaded == (leaving,)
        return out

    fast, reports = _twins(scenario, seed=5, policy_name=policy_name)
    # two before the change; after the offload one scan, then one more skipped
    assert fast.skipped() == 2 + 1


def test_more_requests_running_keeps_the_finding_and_counts_them():
    def scenario(w):
        w.res.add("untracked", 500)  # a running request the controller was never told of
        some = w.rids[: len(w.rids) // 2]
        idle_on_host = [w.add(f"h{i}", 2_000, Tier.HOST) for i in range(4)]
        out = _call(w, set(w.rids), 2)
        out += _call(w, set(w.rids) | {"untracked", "stranger"}, 2)
        out += _call(w, set(w.rids) | set(idle_on_host[:2]), 2)  # known, idle: now running
        out += _call(w, set(w.rids) | set(idle_on_host[:2]), 1)
        assert [r.skipped_running for r in out] == [len(w.rids)] * 4 + [len(w.rids) + 2] * 3
        out += _call(w, set(some), 1)  # half stopped: a scan again, and offloads
        assert out[-1].offloaded
        return out

    fast, _ = _twins(scenario, seed=6)
    assert fast.skipped() == 6


def test_a_minimum_residency_running_out_is_noticed():
    def scenario(w):
        back = w.add("back", 4_000, Tier.HOST)
        assert w.ctl.request_reload(back)  # the device is half full: it fits
        reloaded_at = w.clock()
        w.grow_to(0.9, "g")
        running = frozenset(w.rids)  # everyone but the reloaded one
        out = _call(w, running, 3)
        w.clock.now = max(w.clock.now, reloaded_at + 0.9)
        out += _call(w, running, 2)
        assert all(r.offloaded == () for r in out)
        w.clock.advance(0.2)  # 1.1 s since the reload
        out += _call(w, running, 1)
        assert out[-1].offloaded == (back,)
        return out

    fast, _ = _twins(scenario, seed=7, fill=0.5)
    assert fast.skipped() == 4


@pytest.mark.parametrize("policy_name", ["lru", "largest", "priority"])
def test_a_reload_completed_in_poll_is_noticed(policy_name):
    # no room gauges: only poll()'s records say that something changed
    def scenario(w):
        back = w.add("back", 4_000, Tier.HOST)
        assert w.ctl.request_reload(back)
        w.grow_to(0.9, "g")
        running = frozenset(w.rids)
        out = _call(w, running, 3)  # the reload is in flight: not reclaimable
        assert w.res.state[back] is RequestState.RELOADING
        w.res.complete_transfers()  # reported by the next poll()
        out += _call(w, running, 1)
        assert out[-1].offloaded == (back,)  # no minimum residency here
        return out

    fast, _ = _twins(scenario, seed=8, fill=0.5, resource_cls=Unmetered,
                     policy_name=policy_name, async_transfers=True, complete_on_poll=False,
                     config=ControllerConfig(high=0.8, low=0.6, min_residency_s=0.0))
    assert fast.skipped() == 2


def test_a_failed_offload_is_offloaded_again():
    def scenario(w):
        leaving = w.rids[0]
        running = frozenset(w.rids[1:])
        out = _call(w, running, 4)  # the first offloads; its copy stays in flight
        assert out[0].offloaded == (leaving,) and out[1].pressure_before > BUSY.high
        w.res.fail_transfer(leaving)
        out += _call(w, running, 1)
        assert out[-1].offloaded == (leaving,)
        return out

    fast, _ = _twins(scenario, seed=9, resource_cls=Unmetered, fill=0.95,
                     async_transfers=True, complete_on_poll=False)
    assert fast.skipped() == 2


def _room_below_comes_back(fill, free):
    """A scenario: ``fill(w)`` fills the tier below the device, so three busy calls
    offload nothing; ``free(w, what_fill_returned)`` makes room there; the next
    call must offload the idle request."""
    def scenario(w):
        held = fill(w)
        idle = w.rids[0]
        running = frozenset(w.rids[1:])
        out = _call(w, running, 3)
        assert all(r.offloaded == () for r in out), "nothing fits below: nothing moves"
        free(w, held)
        out += _call(w, running, 1)
        assert out[-1].offloaded == (idle,)  # (not one that was just reloaded)
        return out

    return scenario


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
def test_room_freed_below_the_device_without_a_word_is_noticed(tier):
    # the worker frees KV the controller never knew of; only the gauges show it
    def fill(w):
        w.res.add("other", 50_000, tier)  # fills the tier: nothing else fits below
        return "other"

    room = {"host": 50_000 if tier is Tier.HOST else 0,
            "disk": 50_000 if tier is Tier.DISK else 0}
    scenario = _room_below_comes_back(fill, lambda w, other: w.res.remove(other))
    fast, _ = _twins(scenario, seed=10, resource_cls=RoomAware, **room)
    assert fast.skipped() == 2


def test_a_removed_request_that_held_the_room_is_noticed():
    def free(w, holder):
        w.res.remove(holder)
        w.ctl.remove_request(holder)

    scenario = _room_below_comes_back(lambda w: w.add("holder", 50_000, Tier.HOST), free)
    fast, _ = _twins(scenario, seed=11, resource_cls=RoomAwareUnmetered, host=50_000, disk=0)
    assert fast.skipped() == 2


def test_a_new_request_is_a_candidate_at_once():
    def scenario(w):
        running = frozenset(w.rids)
        out = _call(w, running, 3)
        new = w.add("new", 3_000)
        out += _call(w, running, 1)
        assert out[-1].offloaded == (new,)
        return out

    fast, _ = _twins(scenario, seed=12, resource_cls=Unmetered)
    assert fast.skipped() == 2


@pytest.mark.parametrize("how,seed", [("touched_after_the_scan", 13), ("grew_in_the_batch", 14)])
def test_a_request_that_grew_unseen_is_looked_at_again(how, seed):
    # it held nothing at the scan, then grew with nothing the controller is told (as a
    # worker's step does): after it ran while idle, or while it was in the batch
    def scenario(w):
        quiet = w.add("quiet", 3_000)
        w.res.empty.add(quiet)
        running = frozenset(w.rids)
        if how == "touched_after_the_scan":
            out = _call(w, running, 3)
            w.ctl.touch(w.rids[0])  # a running one ran: changes nothing
            out += _call(w, running, 1)
            w.res.empty.discard(quiet)
            w.ctl.touch(quiet)
        else:
            out = _call(w, running, 2)
            out += _call(w, running | {quiet}, 2)  # it joins the batch and grows there
            w.res.empty.discard(quiet)
        out += _call(w, running, 1)  # (and leaves the batch)
        assert out[-1].offloaded == (quiet,)
        return out

    fast, _ = _twins(scenario, seed=seed, resource_cls=Growing)
    assert fast.skipped() == 3


def test_a_reload_that_frees_room_below_is_noticed():
    # no gauges, no completions to report: only the reload itself says it
    def free(w, holder):
        w.pressure.set(0.4)
        assert w.ctl.request_reload(holder)  # back on the device; the host is empty
        w.pressure.set(0.9)

    scenario = _room_below_comes_back(lambda w: w.add("holder", 30_000, Tier.HOST), free)
    fast, _ = _twins(scenario, seed=15, resource_cls=RoomAwareUnmetered, host=30_000,
                     disk=0, fill=0.5, scripted=True)
    assert fast.skipped() == 2


def test_without_poll_every_busy_call_scans():
    def scenario(w):
        for i in range(8):
            w.add(f"h{i}", 2_000, Tier.HOST)
        running = frozenset(w.rids)
        out = _call(w, running, 1)
        w.res.calls.clear()
        out += _call(w, running, 4)
        assert w.res.calls["reclaimable_many"] == 4
        return out

    fast, _ = _twins(scenario, seed=16, resource_cls=NoPoll)
    assert fast.skipped() == 0


def test_an_evicting_resource_without_poll_turns_the_shortcut_off_for_all():
    clock = FakeClock()
    kv, other = FakeTieredResource(DEVICE, 1 << 30, 0), NoPoll(DEVICE, 1 << 30, 0)
    ctl = EvictionController({"kv": kv, "other": other}, OldestFirst(),
                             ScriptedFraction(0.95), BUSY, clock=clock)
    for i, res in enumerate((kv, other)):
        res.add(f"x{i}", 1_000)
        ctl.add_request(f"x{i}", "kv" if res is kv else "other")
    for _ in range(3):
        assert ctl.evict_if_needed({"x0", "x1"}).offloaded == ()
    assert ctl.stats()["scans_skipped"] == 0


def test_a_resource_that_does_not_evict_is_polled_but_its_count_is_not_watched():
    class Busy(FakeTieredResource):
        def poll(self):
            super().poll()
            return 3  # completes something every time; it is never asked to offload

    clock = FakeClock()
    kv, other = FakeTieredResource(DEVICE, 1 << 30, 0), Busy(DEVICE, supports_eviction=False)
    ctl = EvictionController({"kv": kv, "other": other}, OldestFirst(),
                             ScriptedFraction(0.95), BUSY, clock=clock)
    kv.add("x", 1_000)
    ctl.add_request("x")
    for _ in range(4):
        assert ctl.evict_if_needed({"x"}).offloaded == ()
    assert other.calls["poll"] == 4
    assert ctl.stats()["scans_skipped"] == 3


# -- a state machine over the whole surface ---------------------------------------------


class ControllerMachine(RuleBasedStateMachine):
    """Random add / touch / evict / reload / remove / time / transfer completion.

    The fake accepts reloads past the device capacity, so the controller alone
    keeps it under the admission limit; the machine checks that, that running
    requests are never offloaded, that just-reloaded requests stay put, and
    that the counters agree with what the reports said. A twin world, driven
    by the same steps, has a controller that scans at every call
    (``AlwaysRescan``): every decision and counter must be the same in both.
    """

    @initialize(
        seed=st.integers(0, 2**16),
        lagging=st.booleans(),
        async_transfers=st.booleans(),
        on_disk_full=st.sampled_from(["keep", "drop"]),
        policy_name=st.sampled_from(POLICY_NAMES),
        # room-aware answers; no host/disk gauges (so no cascade either), leaving the
        # other cues to notice changes; or the plain fake
        resource_cls=st.sampled_from([FakeTieredResource, RoomAware, RoomAwareUnmetered]),
    )
    def setup(self, seed, lagging, async_transfers, on_disk_full, policy_name, resource_cls):
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.cfg = ControllerConfig(
            high=0.8, low=0.6, host_high=0.8, host_low=0.6, min_residency_s=1.0,
            reload_headroom=0.05, aging_s=2.0, on_disk_full=on_disk_full,
        )
        worlds = []
        for cls in (EvictionController, AlwaysRescan):
            res = resource_cls(
                40_000, 24_000, 12_000, async_transfers=async_transfers,
                enforce_device_capacity=False,
            )
            exact = ExactPressure(res)
            lag = LaggingPressure(exact, self.clock) if lagging else None
            ctl = cls({"kv": res}, _policies()[policy_name], lag or exact, self.cfg,
                      clock=self.clock)
            worlds.append((res, lag, ctl))
        (self.res, self.lagging, self.ctl), (self.twin_res, self.twin_lagging, self.twin_ctl) = (
            worlds
        )
        self.limit = (self.cfg.high - self.cfg.reload_headroom) * 40_000
        self.next_id = 0
        self.live: list[str] = []
        self.gone: list[str] = []  # removed from the resource, not yet from the controller
        self.running: set[str] | None = None  # what the last evict passed
        self.reloaded_at: dict[str, float] = {}
        self.seen = {"offloads": 0, "bytes_offloaded": 0, "reloads_started": 0,
                     "demotions": 0, "drops": 0, "evict_calls": 0}
        for _ in range(self.rng.randint(5, 20)):
            self.add(self.rng.randint(500, 8_000))
        self._sample()

    def _sample(self):
        if self.lagging is not None:
            self.lagging.sample()
            self.twin_lagging.sample()

    @rule(size=st.integers(500, 8_000))
    def add(self, size):
        # the worker grows its device use as it likes; only reloads are the controller's
        if self.res.device_used + size > self.res.device_capacity_bytes:
            return
        rid = f"q{self.next_id}"
        self.next_id += 1
        for res, ctl in ((self.res, self.ctl), (self.twin_res, self.twin_ctl)):
            res.add(rid, size)
            ctl.add_request(rid)
        self.live.append(rid)
        self._sample()  # the worker's own growth shows in the next sample

    @rule_on_one_of(lambda self: self.live)
    def touch(self, rid):
        self.ctl.touch(rid)
        self.twin_ctl.touch(rid)

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 2.5]))
    def tick(self, dt):
        self.clock.advance(dt)

    @rule()
    def sample(self):
        self._sample()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def evict(self, data):
        drawn = set(data.draw(st.lists(st.sampled_from(self.live), max_size=6)))
        # a few running, or all but a few (busy: often nothing left to offload), or the
        # same as last time, plus some
        kind = data.draw(st.sampled_from(["few", "most", "again"]))
        if kind == "few":
            running = drawn
        elif kind == "most" or self.running is None:
            running = set(self.live) - drawn
        else:
            running = self.running | drawn
        self.running = running
        for _ in range(data.draw(st.integers(1, 3))):  # a worker's steps in a row
            self._evict(running)

    def _evict(self, running: set[str]) -> None:
        report = self.ctl.evict_if_needed(running)
        assert self.twin_ctl.evict_if_needed(running) == report, "the shortcut decided otherwise"
        now = self.clock()
        assert not running & set(report.offloaded), "a running request was offloaded"
        for rid in report.offloaded:
            t = self.reloaded_at.get(rid)
            assert t is None or now - t >= self.cfg.min_residency_s, "residency broken"
        for rid in report.reloads_started:
            self.reloaded_at[rid] = now
        self.seen["offloads"] += len(report.offloaded)
        self.seen["bytes_offloaded"] += report.bytes_offloaded
        self.seen["reloads_started"] += len(report.reloads_started)
        self.seen["demotions"] += len(report.demoted)
        self.seen["drops"] += len(report.dropped)
        self.seen["evict_calls"] += 1

    def _offloaded(self) -> list[str]:
        on = (RequestState.ON_HOST, RequestState.ON_DISK)
        return [r for r in self.live if self.res.state[r] in on]

    @precondition(lambda self: self._offloaded())
    @rule(data=st.data())
    def reload(self, data):
        rid = data.draw(st.sampled_from(self._offloaded()))
        started = self.ctl.request_reload(rid)
        assert self.twin_ctl.request_reload(rid) == started
        if started:
            self.reloaded_at[rid] = self.clock()
            self.seen["reloads_started"] += 1

    @rule_on_one_of(lambda self: self.live)
    def remove(self, rid):
        self.live.remove(rid)
        for res, ctl in ((self.res, self.ctl), (self.twin_res, self.twin_ctl)):
            res.remove(rid)
            ctl.remove_request(rid)
        self.reloaded_at.pop(rid, None)

    @rule_on_one_of(lambda self: self.live)
    def vanish(self, rid):
        """The worker frees a request; the controller hears of it only later."""
        self.live.remove(rid)
        self.gone.append(rid)
        self.res.remove(rid)
        self.twin_res.remove(rid)

    @precondition(lambda self: self.gone)
    @rule()
    def late_remove(self):
        rid = self.gone.pop(0)
        self.ctl.remove_request(rid)
        self.twin_ctl.remove_request(rid)
        self.reloaded_at.pop(rid, None)

    @precondition(lambda self: any(self.res.state[r] is RequestState.ON_HOST for r in self.live))
    @rule(data=st.data())
    def worker_demotes(self, data):
        """The worker demotes an on-host request itself, behind the controller's back."""
        on_host = [r for r in self.live if self.res.state[r] is RequestState.ON_HOST]
        rid = data.draw(st.sampled_from(on_host))
        assert self.res.demote(rid) == self.twin_res.demote(rid)

    @rule()
    def complete(self):
        assert self.res.complete_transfers() == self.twin_res.complete_transfers()

    @precondition(lambda self: self.res.in_flight())
    @rule(data=st.data())
    def fail(self, data):
        rid = data.draw(st.sampled_from(self.res.in_flight()))
        self.res.fail_transfer(rid)
        self.twin_res.fail_transfer(rid)

    @invariant()
    def reloads_never_oversubscribe(self):
        assert self.res.max_device_used_by_reload <= self.limit
        assert self.res.max_device_used <= self.res.device_capacity_bytes

    @invariant()
    def ledgers_agree(self):
        self.res.check_integrity()
        self.ctl.check_integrity()
        self.twin_ctl.check_integrity()

    @invariant()
    def the_twin_is_in_the_same_state(self):
        assert self.twin_res.state == self.res.state
        mine, reference = self.ctl.stats(), self.twin_ctl.stats()
        assert reference.pop("scans_skipped") == 0
        mine.pop("scans_skipped")
        # a rescan asks about a vanished request again, and logs it again
        assert mine.pop("vanished_skips") <= reference.pop("vanished_skips")
        assert mine == reference

    @invariant()
    def counters_agree_with_reports(self):
        stats = self.ctl.stats()
        for key, value in self.seen.items():
            assert stats[key] == value, key
        assert stats["reload_waits"] == len(self.ctl.pending_reloads())
        assert stats["bytes_device_to_host"] + stats["bytes_device_to_disk"] == \
            stats["bytes_offloaded"]
        assert stats["bytes_host_to_device"] + stats["bytes_disk_to_device"] == \
            stats["bytes_reloaded"]
        assert stats["live_requests"] == len(self.live) + len(self.gone)
        assert stats["reserved_reload_bytes"] >= 0 and stats["releasing_bytes"] >= 0


ControllerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_controller_state_machine = ControllerMachine.TestCase


@pytest.mark.parametrize("policy", ["lru", "largest", "cost"])
def test_a_request_whose_reload_could_never_be_admitted_is_never_a_victim(policy):
    """Admission limit (0.9 - 0.02) x 1000 = 880 bytes: a 900-byte request offloaded would
    be refused by request_reload for good. Every policy, lazy or asking bytes up front,
    passes it over (and plans without it); the smaller idle ones leave instead."""
    clock = FakeClock()
    res = FakeTieredResource(1000, 10_000, 10_000)
    res.add("huge", 900)
    res.add("s1", 40)
    res.add("s2", 40)
    ctl = EvictionController({"kv": res}, make_policy(policy), ExactPressure(res), clock=clock)
    for rid in ("huge", "s1", "s2"):
        ctl.add_request(rid)
    clock.advance(5.0)
    assert [c.rid for c in ctl.plan_offload((), 1 << 20)] and all(
        c.rid != "huge" for c in ctl.plan_offload((), 1 << 20))
    report = ctl.evict_if_needed(())
    ctl.check_integrity()
    assert "huge" not in report.offloaded and set(report.offloaded) <= {"s1", "s2"}
    assert report.offloaded, "the small idle requests are still victims"
    assert res.tier_of("huge") is Tier.DEVICE
    # the control: an 880-byte one fits the limit exactly; with 40 more bytes the device is
    # above high, and no order reaches low (750) without offloading it
    res = FakeTieredResource(1000, 10_000, 10_000)
    res.add("fits", 880)
    res.add("s1", 40)
    ctl = EvictionController({"kv": res}, make_policy(policy), ExactPressure(res), clock=clock)
    for rid in ("fits", "s1"):
        ctl.add_request(rid)
    clock.advance(5.0)
    report = ctl.evict_if_needed(())
    ctl.check_integrity()
    assert "fits" in report.offloaded
    ctl.request_reload("fits")  # not refused: it may come back
    if res.tier_of("s1") is Tier.DEVICE:  # s1 stayed: fits waits until s1 leaves
        res.remove("s1")
        ctl.remove_request("s1")
        assert ctl.evict_if_needed(()).reloads_started == ("fits",)
    assert res.tier_of("fits") is Tier.DEVICE
    ctl.check_integrity()
