"""Our Resource interface carries every method of the engine's, with the same
parameters and defaults. Checked against the seed file when it is beside the
repository, and always against the list of eviction hooks."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import tiering.resources.base as base
from tiering.resources.kv_cache import PagedKVCache

SEED_DIR = Path(__file__).resolve().parents[2] / "shared" / "seeds"

# The seed's text lost its indentation; these are its module-level functions.
MODULE_FUNCTIONS = {"build_resource"}

EVICTION_HOOKS = {
    "supports_eviction", "is_offloaded", "offload", "reload", "can_reload",
    "reclaimable", "get_offload_priority",
}


def seed_methods() -> dict[tuple[str, str], tuple[list[str], list[str]]]:
    """(class, method) -> (parameter names, default sources) parsed from the seed."""
    files = sorted(SEED_DIR.glob("*.txt"))
    if not files:
        return {}
    text = "\n".join(f.read_text() for f in files)
    out = {}
    cls = None
    for m in re.finditer(r"^class (\w+)|^def (\w+)\(", text, re.M):
        if m.group(1):
            cls = m.group(1)
            continue
        name = m.group(2)
        owner = None if name in MODULE_FUNCTIONS else cls
        i = m.end()
        depth = 1
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        params = text[m.end() : i - 1]
        fn = ast.parse(f"def f({params}): pass").body[0].args
        names = [a.arg for a in fn.posonlyargs + fn.args + fn.kwonlyargs]
        defaults = [ast.unparse(d) for d in fn.defaults]
        out[(owner, name)] = (names, defaults)
    return out


SEED = seed_methods()
ENGINE_CLASSES = {"Resource": base.Resource, "AttentionResource": base.AttentionResource,
                  "CGSlotSpec": base.CGSlotSpec, "EngineResourceInfo": base.EngineResourceInfo,
                  "PublishedInfo": base.PublishedInfo}


def test_seed_was_parsed():
    if not SEED_DIR.exists():
        pytest.skip(f"no seed beside the repository at {SEED_DIR}")
    assert len(SEED) > 40, f"parsed only {len(SEED)} methods from {SEED_DIR}"


@pytest.mark.parametrize("key", sorted(SEED, key=str) or [("Resource", "offload")], ids=str)
def test_every_seed_method_has_same_signature(key):
    cls_name, meth = key
    if cls_name is None:  # module-level function
        ours = getattr(base, meth)
    else:
        ours = inspect.getattr_static(ENGINE_CLASSES[cls_name], meth)
    if isinstance(ours, property):
        ours = ours.fget
    if isinstance(ours, classmethod):
        ours = ours.__func__
    if key not in SEED:  # no seed beside the repo: the eviction hooks still must exist
        assert callable(ours)
        return
    names, defaults = SEED[key]
    sig = inspect.signature(ours)
    assert list(sig.parameters) == names, f"{key}: {list(sig.parameters)} != {names}"
    ours_defaults = [
        repr(p.default) for p in sig.parameters.values() if p.default is not inspect.Parameter.empty
    ]
    assert ours_defaults == [repr(ast.literal_eval(d)) for d in defaults], key


def test_eviction_hooks_are_on_the_interface_and_overridden_by_the_kv_cache():
    for hook in EVICTION_HOOKS:
        assert hasattr(base.Resource, hook), hook
        assert getattr(PagedKVCache, hook) is not getattr(base.Resource, hook), hook
    assert base.Resource.supports_eviction.fget(None) is False


def test_engine_types_exist():
    for name in ("NodeResourceSpec", "ResourceReqConfig", "ResourceStep", "StepContext",
                 "AdmitOutcome", "ADMIT_OK", "BucketKey", "EngineResourceInfo", "CachedPrefix",
                 "KeyedWalks", "PublishedInfo", "CGSlotSpec", "build_resource"):
        assert hasattr(base, name), name
    assert base.ADMIT_OK.ok and bool(base.ADMIT_OK)


def test_build_resource_builds_a_kv_cache(geom):
    import torch

    spec = base.NodeResourceSpec("kv", PagedKVCache, {"geometry": geom, "device_pages": 4,
                                                      "host_pages": 4})
    with base.build_resource(spec, base.EngineResourceInfo(device=torch.device("cpu"))) as kv:
        assert isinstance(kv, PagedKVCache) and kv.supports_eviction
        kv.check_integrity()


# -- the vocabulary: where a request in each state is reported --------------------------


def test_a_request_in_flight_is_reported_at_the_faster_of_its_two_tiers(kv, closing):
    import threading

    import torch
    from conftest import fill

    from tiering.types import TIER_ORDER, Move, RequestState, Tier

    S = RequestState
    moves_of = {
        S.OFFLOADING: (Move.OFFLOAD_TO_HOST, Move.OFFLOAD_TO_DISK),
        S.DEMOTING: (Move.DEMOTE,),
        S.RELOADING: (Move.RELOAD_FROM_HOST, Move.RELOAD_FROM_DISK),
    }
    assert {s for s in S if s.in_flight} == set(moves_of)
    for state, moves in moves_of.items():
        for move in moves:
            fastest = min(move.source, move.destination, key=TIER_ORDER.index)
            assert state.tier is fastest, (state, move)
    at_rest = {S.RESIDENT: Tier.DEVICE, S.ON_HOST: Tier.HOST, S.ON_DISK: Tier.DISK, S.LOST: None}
    assert {s: s.tier for s in at_rest} == at_rest

    # the real cache reports the same while its copies are provably in flight
    go, entered = threading.Event(), threading.Semaphore(0)

    def hold(kind):
        entered.release()
        assert go.wait(10)

    cache = kv(device_pages=8, host_pages=8, copy_fault_hook=hold)
    closing.call(go.set)  # before the cache is closed: its held copy goes on
    fill(cache, "a", torch.Generator().manual_seed(5), 8)
    cache.offload("a")
    assert entered.acquire(timeout=10)
    assert cache.state_of("a") is S.OFFLOADING and cache.tier_of("a") is Tier.DEVICE
    go.set()
    cache.synchronize(10)
    go.clear()
    assert cache.reload("a")
    assert entered.acquire(timeout=10)
    assert cache.state_of("a") is S.RELOADING and cache.tier_of("a") is Tier.DEVICE
    cache.check_integrity()
    go.set()
    cache.synchronize(10)
    assert cache.tier_of("a") is Tier.DEVICE
    cache.check_integrity()


# -- the fake resource answers as the real one's contract says ------------------------------

from tiering.errors import CacheClosed, UnknownRequest  # noqa: E402
from tiering.testing import ExactPressure, FakeClock, FakeTieredResource  # noqa: E402
from tiering.types import Tier  # noqa: E402

_FAKE_LOOKUPS = {
    "reclaimable": lambda f, rid: f.reclaimable(rid),
    "tier_of": lambda f, rid: f.tier_of(rid),
    "reload_bytes": lambda f, rid: f.reload_bytes(rid),
    "get_offload_priority": lambda f, rid: f.get_offload_priority(rid),
    "reclaimable_many": lambda f, rid: f.reclaimable_many(["r0", rid]),
    "get_offload_priority_many": lambda f, rid: f.get_offload_priority_many(["r0", rid]),
    "is_offloaded": lambda f, rid: f.is_offloaded(rid),
    "offload": lambda f, rid: f.offload(rid),
}
_FAKE_CLOSED_ONLY = {"poll": lambda f, rid: f.poll()}


def _fake_with_requests(seed: int) -> tuple[FakeTieredResource, dict]:
    import random

    rng = random.Random(seed)
    fake = FakeTieredResource(1 << 20, 1 << 20, 1 << 20)
    for i in range(4):
        fake.add(f"r{i}", rng.randint(1, 1 << 16))
    return fake, (dict(fake.state), dict(fake.size), list(fake.ledger.used))


@pytest.mark.parametrize("hook", sorted(_FAKE_LOOKUPS))
def test_the_fake_refuses_an_unknown_request_as_the_real_cache_does(hook):
    fake, before = _fake_with_requests(1)
    with pytest.raises(UnknownRequest, match="'nope'"):
        _FAKE_LOOKUPS[hook](fake, "nope")
    assert (fake.state, fake.size, fake.ledger.used) == before
    fake.check_integrity()


@pytest.mark.parametrize("hook", sorted({**_FAKE_LOOKUPS, **_FAKE_CLOSED_ONLY}))
def test_the_fake_answers_nothing_once_closed(hook):
    fake, before = _fake_with_requests(2)
    fake.close()
    with pytest.raises(CacheClosed, match=hook):
        {**_FAKE_LOOKUPS, **_FAKE_CLOSED_ONLY}[hook](fake, "r1")
    with pytest.raises(CacheClosed):
        fake.add("late", 7)
    assert (fake.state, fake.size, fake.ledger.used) == before


@pytest.mark.parametrize("kwargs, field", [
    ({"device_capacity": True}, "device_capacity"),
    ({"device_capacity": 8.5}, "device_capacity"),
    ({"device_capacity": float("nan")}, "device_capacity"),
    ({"device_capacity": "8"}, "device_capacity"),
    ({"device_capacity": 0}, "device_capacity"),
    ({"device_capacity": 8, "host_capacity": -1}, "host_capacity"),
    ({"device_capacity": 8, "host_capacity": 2.5}, "host_capacity"),
    ({"device_capacity": 8, "disk_capacity": -3}, "disk_capacity"),
    ({"device_capacity": 8, "async_transfers": 1}, "async_transfers"),
    ({"device_capacity": 8, "clock": 3.0}, "clock"),
])
def test_the_fake_refuses_a_bad_configuration_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FakeTieredResource(**kwargs)


@pytest.mark.parametrize("args, what", [
    ((3, 4), "rid"),
    (("", 4), "rid"),
    (("x", 1.5), "nbytes"),
    (("x", True), "nbytes"),
    (("x", float("nan")), "nbytes"),
    (("x", 0), "nbytes"),
    (("x", 4, "device"), "tier"),
    (("r0", 4), "already exists"),
    (("x", 1 << 30), "does not fit"),
])
def test_a_refused_add_names_what_was_wrong_and_changes_nothing(args, what):
    fake, before = _fake_with_requests(3)
    with pytest.raises(ValueError, match=what):
        fake.add(*args)
    assert (fake.state, fake.size, fake.ledger.used) == before
    fake.check_integrity()


def test_fail_transfer_names_an_unknown_or_idle_request_and_changes_nothing():
    fake = FakeTieredResource(1 << 20, 1 << 20, 0, async_transfers=True,
                              complete_on_poll=False)
    fake.add("a", 4099)
    fake.add("b", 517)
    assert fake.offload("a") == 4099
    before = (dict(fake.state), list(fake.ledger.used), fake.in_flight())
    with pytest.raises(UnknownRequest, match="'nope'"):
        fake.fail_transfer("nope")
    with pytest.raises(ValueError, match="'b' has no transfer in flight"):
        fake.fail_transfer("b")
    with pytest.raises(ValueError, match="not the str"):
        fake.complete_transfers("a")
    assert (dict(fake.state), list(fake.ledger.used), fake.in_flight()) == before
    fake.check_integrity()
    fake.fail_transfer("a")  # the real one still works, once
    with pytest.raises(ValueError, match="'a' has no transfer in flight"):
        fake.fail_transfer("a")
    fake.check_integrity()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, True, "1"])
def test_the_fake_clock_refuses_a_bad_step_and_stays_put(bad):
    clock = FakeClock(250.0)
    with pytest.raises(ValueError, match="seconds"):
        clock.advance(bad)
    assert clock() == 250.0
    clock.advance(1.5)
    assert clock() == 251.5


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), True, "5", None])
def test_the_fake_clock_refuses_a_bad_start(bad):
    with pytest.raises(ValueError, match="start"):
        FakeClock(bad)


def test_the_fake_clock_cannot_be_pushed_past_every_finite_time():
    clock = FakeClock(1.5e308)
    with pytest.raises(ValueError, match="finite"):
        clock.advance(1e308)
    assert clock() == 1.5e308


def test_exact_pressure_needs_a_resource():
    with pytest.raises(ValueError, match="at least one resource"):
        ExactPressure()
    fake = FakeTieredResource(1000)
    fake.add("a", 250, Tier.DEVICE)
    assert ExactPressure(fake).read() == 0.25


def test_the_contracts_import_from_tiering_testing_as_the_readme_shows():
    from tiering.policies import LRU

    import tiering.testing as testing
    import tiering.testing.blocks as block_contract
    import tiering.testing.policies as request_contract

    assert testing.check_policy is request_contract.check_policy
    assert testing.check_block_policy is block_contract.check_block_policy
    assert "check_policy" in testing.__all__
    checked = testing.check_policy(LRU, cases=3, seed=4)
    assert isinstance(checked, testing.PolicyCheck) and checked.cases == 3


def test_the_testing_kits_pressure_stand_ins_refuse_what_they_cannot_read():
    """``ExactPressure([res])`` (a list for the resources) raised AttributeError naming no
    argument; ``LaggingPressure(3)`` was built and failed at its first ``sample``."""
    from tiering.testing import ExactPressure, FakeClock, FakeTieredResource, LaggingPressure

    res = FakeTieredResource(device_capacity=100)
    for bad in ([res], 3, object()):
        with pytest.raises(TypeError, match=r"ExactPressure: each resource needs "
                                            r"device_capacity_bytes and device_used"):
            ExactPressure(bad)
    for bad in (3, res):
        with pytest.raises(TypeError, match=r"LaggingPressure: source must have read\(\)"):
            LaggingPressure(bad)
    with pytest.raises(TypeError, match=r"LaggingPressure: clock must be callable"):
        LaggingPressure(ExactPressure(res), clock=5.0)
    res.ingest_request("a")  # the control: a real pair reads the resource
    assert res.allocate("a", 40)
    lagging = LaggingPressure(ExactPressure(res), clock=FakeClock(7.0))
    assert lagging.latest() is None
    assert lagging.sample() == (0.4, 1, 7.0) and lagging.latest().fraction == 0.4
