"""The front door and the parts, from a user's side: every policy the docs name can be
asked for by name, bad input is refused by name without a change, and reported figures
are what happened."""

from __future__ import annotations

import pytest
import torch
from tiering.policies import default_registry, register_policy
from tiering.resources.base import ResourceReqConfig

from tiering import ControllerConfig, TieredKV, TieredKVConfig, make_policy
from tiering.testing import FakeClock


def _fill(tkv: TieredKV, rid: str, tokens: int, gen: torch.Generator,
          config: ResourceReqConfig | None = None) -> None:
    g = tkv.kv.geometry
    tkv.add(rid, config)
    assert tkv.kv.allocate(rid, tokens)
    for layer in range(g.num_layers):
        k = torch.randn(tokens, g.num_kv_heads, g.head_dim, generator=gen).to(g.dtype)
        tkv.kv.write(rid, layer, 0, k, -k)


@pytest.mark.parametrize("name", default_registry().names)
def test_every_built_in_policy_name_builds_a_front_door(geom, name):
    """docs/embedding.md lists lru, priority, largest and cost as `policy` values."""
    with TieredKV(TieredKVConfig(geometry=geom, device_pages=8, host_pages=8,
                                 policy=name)) as tkv:
        assert tkv.policy.name == name


def test_priority_by_name_offloads_the_request_the_serving_layer_keeps_least(geom):
    clock = FakeClock()
    gen = torch.Generator().manual_seed(11)
    cfg = TieredKVConfig(geometry=geom, device_pages=8, host_pages=8, policy="priority",
                         controller=ControllerConfig(high=0.7, low=0.6, min_residency_s=0.0))
    with TieredKV(cfg, clock=clock) as tkv:
        _fill(tkv, "kept", 2 * geom.page_tokens, gen, ResourceReqConfig(retention_priority=90))
        clock.advance(1.0)
        _fill(tkv, "spare", 2 * geom.page_tokens, gen, ResourceReqConfig(retention_priority=10))
        clock.advance(1.0)
        _fill(tkv, "runs", 2 * geom.page_tokens, gen)
        report = tkv.after_step(["runs"])
        # LRU would pick "kept" (the oldest); the retention priority says "spare"
        assert report.offloaded == ("spare",)
        tkv.synchronize(timeout=10)
        tkv.check_integrity()


def test_a_custom_policy_that_needs_a_resource_is_given_the_caches(geom):
    seen = []

    def factory(resource, weight=1.0):
        seen.append((resource, weight))
        return make_policy("priority", resource=resource)

    registry = register_policy("mine", factory)
    assert registry.required_options("mine") == ("resource",)
    assert registry.required_options("lru") == ()
    assert registry.required_options("nope") == ()
    with TieredKV(TieredKVConfig(geometry=geom, device_pages=8, host_pages=8, policy="mine"),
                  policy_registry=registry):
        pass
    assert seen == [("kv", 1.0)]


@pytest.mark.parametrize("fields, error, name", [
    ({"retention_priority": "50"}, TypeError, "retention_priority"),
    ({"retention_priority": True}, TypeError, "retention_priority"),
    ({"retention_priority": "high"}, TypeError, "retention_priority"),
    ({"retention_priority": [5]}, TypeError, "retention_priority"),
    ({"retention_priority": float("nan")}, ValueError, "retention_priority"),
    ({"retention_priority": 100.5}, ValueError, "retention_priority"),
    ({"retention_expiry_s": "5"}, TypeError, "retention_expiry_s"),
    ({"retention_expiry_s": True}, TypeError, "retention_expiry_s"),
    ({"retention_expiry_s": 0}, ValueError, "retention_expiry_s"),
    ({"retention_expiry_s": float("nan")}, ValueError, "retention_expiry_s"),
    ({"extra": None}, TypeError, "extra"),
    ({"extra": [("a", 1)]}, TypeError, "extra"),
])
def test_request_settings_refuse_what_is_not_a_number_by_field(fields, error, name):
    """A str that looks like a number, or a bool, used to be kept as given: the cache then
    compared it with the number (so `add` refused the same request's real settings) and a
    non-number one failed later, inside the step, with float()'s message."""
    with pytest.raises(error, match=rf"ResourceReqConfig\.{name}"):
        ResourceReqConfig(**fields)


def test_request_settings_take_numpy_numbers_and_an_infinite_expiry():
    import numpy as np

    cfg = ResourceReqConfig(retention_priority=np.float64(40.0), retention_expiry_s=float("inf"))
    assert cfg.retention_priority == 40.0


def _datetime_now():
    import datetime

    return datetime.datetime.now()


@pytest.mark.parametrize("clock", [_datetime_now, lambda: "now", lambda: None,
                                   lambda: float("nan"), lambda: True],
                         ids=["datetime.now", "str", "None", "nan", "bool"])
def test_a_clock_that_reads_no_number_is_refused_when_built(geom, clock):
    """Before, such a clock was taken; the first `add` then raised float()'s error after the
    cache had ingested the request and the controller's table had half-registered it, so
    check_integrity failed ("live slots [] differ from the rids' slots")."""
    from tiering import EvictionController, PagedKVCache, cache_pressure

    cfg = TieredKVConfig(geometry=geom, device_pages=8, host_pages=8)
    with pytest.raises(TypeError, match="TieredKV: clock must return a finite number"):
        TieredKV(cfg, clock=clock)
    with pytest.raises(ValueError, match="PagedKVCache: clock must return a finite number"):
        PagedKVCache(geom, device_pages=8, host_pages=8, clock=clock)
    with PagedKVCache(geom, device_pages=8, host_pages=8) as kv:
        kv.ingest_request("a")
        with pytest.raises(TypeError, match="TieredKV.around: clock must return"):
            TieredKV.around(kv, clock=clock)
        with pytest.raises(TypeError, match="EvictionController: clock must return"):
            EvictionController({"kv": kv}, make_policy("lru"), cache_pressure(kv), clock=clock)
        assert kv.requests() == ["a"]  # the refusals left the cache open and as it was
        kv.check_integrity()


def test_a_clock_in_integer_nanoseconds_or_numpy_is_a_clock(geom):
    import time

    import numpy as np

    with TieredKV(TieredKVConfig(geometry=geom, device_pages=8, host_pages=8),
                  clock=lambda: np.float64(time.monotonic())) as tkv:
        tkv.add("a")
        tkv.after_step(["a"])
        tkv.check_integrity()
    with TieredKV(TieredKVConfig(geometry=geom, device_pages=8, host_pages=8),
                  clock=time.monotonic_ns) as tkv:
        tkv.add("a")
        tkv.check_integrity()


def test_the_prometheus_exporter_closes_twice_refuses_a_duplicate_and_takes_a_front_door(geom):
    """Before: a second close() raised KeyError; a second exporter on one registry doubled
    every metric family (a scrape Prometheus rejects); a TieredKV was exported under
    names like tiering_controller_controller_offloads, every counter typed as a gauge; and
    a registry that is not one failed with AttributeError."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from tiering.control.metrics import PrometheusExporter

    gen = torch.Generator().manual_seed(5)
    cfg = TieredKVConfig(geometry=geom, device_pages=8, host_pages=8,
                         controller=ControllerConfig(high=0.5, low=0.25, min_residency_s=0.0))
    with TieredKV(cfg) as tkv:
        registry = CollectorRegistry()
        exporter = PrometheusExporter(tkv, registry)
        _fill(tkv, "a", 3 * geom.page_tokens, gen)
        _fill(tkv, "b", 3 * geom.page_tokens, gen)
        offloaded = tkv.after_step(["b"]).offloaded
        assert offloaded == ("a",)
        value = registry.get_sample_value
        assert value("tiering_controller_offloads_total") == 1
        assert value("tiering_controller_live_requests") == 2
        with pytest.raises(ValueError, match="already exports tiering_controller_"):
            PrometheusExporter(tkv.controller, registry)
        text = generate_latest(registry).decode()
        assert text.count("# TYPE tiering_controller_offloads_total counter") == 1
        assert "controller_controller" not in text
        exporter.close()
        exporter.close()  # idempotent
        assert value("tiering_controller_offloads_total") is None
        again = PrometheusExporter(tkv.controller, registry)  # the names are free again
        assert value("tiering_controller_offloads_total") == 1
        again.close()
        with pytest.raises(TypeError, match="registry must be a prometheus_client"):
            PrometheusExporter(tkv.controller, 3)
        tkv.synchronize(timeout=10)


def test_make_room_for_more_than_the_device_holds_is_refused_and_offloads_nothing(geom):
    """Before, make_room(100 pages) on an 8-page device offloaded every idle request for
    room that could never be there."""
    from tiering import EvictionController, PagedKVCache, cache_pressure

    gen = torch.Generator().manual_seed(3)
    cfg = TieredKVConfig(geometry=geom, device_pages=8, host_pages=16,
                         controller=ControllerConfig(min_residency_s=0.0))
    with TieredKV(cfg) as tkv:
        for rid in ("a", "b", "c"):
            _fill(tkv, rid, 2 * geom.page_tokens, gen)
        before = (tkv.stats(), [tkv.kv.state_of(r) for r in ("a", "b", "c")])
        with pytest.raises(ValueError, match=rf"nbytes {8 * geom.page_bytes + 1} is more than the device holds"):
            tkv.make_room(8 * geom.page_bytes + 1)
        assert (tkv.stats(), [tkv.kv.state_of(r) for r in ("a", "b", "c")]) == before
        assert tkv.make_room(8 * geom.page_bytes) == ("a", "b", "c")  # all of it: allowed
        tkv.synchronize(timeout=10)
        tkv.check_integrity()
    with PagedKVCache(geom, device_pages=4, host_pages=4) as kv:
        ctl = EvictionController({"kv": kv}, make_policy("lru"), cache_pressure(kv))
        with pytest.raises(ValueError, match=rf"need_bytes {4 * geom.page_bytes + 1} is more than the device"):
            ctl.make_room(4 * geom.page_bytes + 1, ())


def test_a_cache_another_open_front_door_drives_is_refused_and_left_as_it_was(geom):
    """Before, a second TieredKV.around over the same cache was built: two controllers then
    moved the same requests, and the second's check_integrity failed at once for a request
    the first added."""
    from tiering import PagedKVCache

    kv = PagedKVCache(geom, device_pages=8, host_pages=8)
    first = TieredKV.around(kv)
    first.add("a")
    with pytest.raises(ValueError, match="already driven by an open TieredKV"):
        TieredKV.around(kv)
    first.check_integrity()
    assert first.requests() == ["a"] and kv.requests() == ["a"]  # still open, unchanged
    with TieredKV(TieredKVConfig(geometry=geom, device_pages=8, host_pages=8)) as built:
        with pytest.raises(ValueError, match="already driven"):
            TieredKV.around(built.kv)
        built.add("b")
        built.check_integrity()
    first.close()  # the cache closes with it; a closed cache cannot be driven again
    with pytest.raises(Exception, match="closed"):
        TieredKV.around(kv)
    other = PagedKVCache(geom, device_pages=8, host_pages=8)
    dropped = TieredKV.around(other)
    del dropped  # never closed, but gone: the cache may be driven again
    import gc

    gc.collect()
    with TieredKV.around(other) as again:
        again.add("c")
        again.check_integrity()


def test_a_sparse_write_is_refused_by_name_and_writes_nothing(geom):
    """Before, a sparse k failed inside the copy with torch's NotImplementedError."""
    from tiering import PagedKVCache

    gen = torch.Generator().manual_seed(9)
    with PagedKVCache(geom, device_pages=4, host_pages=4) as kv:
        kv.ingest_request("a")
        assert kv.allocate("a", 4)
        k = torch.randn(4, geom.num_kv_heads, geom.head_dim, generator=gen).to(geom.dtype)
        kv.write("a", 0, 0, k, -k)
        other = torch.randn(4, geom.num_kv_heads, geom.head_dim, generator=gen)
        with pytest.raises(ValueError, match="k must be a dense tensor"):
            kv.write("a", 0, 0, other.to_sparse().to(geom.dtype), other.to(geom.dtype))
        assert torch.equal(kv.read("a", 0)[0], k)
        kv.check_integrity()


def test_a_reload_while_demoting_is_refused_naming_the_states_it_starts_from(geom, tmp_path):
    """is_offloaded is True while a request demotes, but a reload starts only from on_host
    or on_disk (can_reload False): the refusal said "only an offloaded request reloads" of
    a request is_offloaded called offloaded."""
    import threading

    from tiering import DiskConfig, IllegalTransition, PagedKVCache
    from tiering.disk.faults import FaultPlan, FaultyStore
    from tiering.types import RequestState

    gate = threading.Event()
    plan = FaultPlan(0, sleep=lambda _s: gate.wait(10))
    kv = PagedKVCache(geom, device_pages=8, host_pages=8,
                      disk=DiskConfig(path=tmp_path / "disk", capacity_bytes=16 * geom.page_bytes),
                      disk_wrap_store=lambda store: FaultyStore(store, plan))
    try:
        kv.ingest_request("a")
        assert kv.allocate("a", 2 * geom.page_tokens)
        kv.offload("a")
        kv.synchronize(timeout=10)
        plan.arm("slow", next_n=1)
        assert kv.demote("a")
        assert kv.state_of("a") is RequestState.DEMOTING
        assert kv.is_offloaded("a") and not kv.can_reload("a")
        with pytest.raises(IllegalTransition, match="demoting.*on_host or on_disk.*can_reload"):
            kv.reload("a")
        with pytest.raises(IllegalTransition, match="demoting.*on_host or on_disk.*can_reload"):
            kv.drop("a")
        kv.check_integrity()
    finally:
        gate.set()
        kv.close()


def test_an_early_admitted_reload_that_would_outgrow_the_device_waits_to_stream():
    """Found by tests/test_layerwise_state_machine.py: a layer-wise reload admitted from
    layer 0 grew, during its early step, past what the device holds; the cache then turned
    it into a streamed request while its later layers were still copying (spilling device
    pages those copies write to a host head), and check_integrity failed ("grown reload
    holds 3 device pages (needs 13)"; "streamed in state reloading"). Now that allocate
    answers False, changing nothing, until the reload has landed; then it streams."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_layerwise_state_machine import LayerwiseMachine

    m = LayerwiseMachine()
    try:
        m.add(tokens=5)
        m.grow(grow=4, i=0)
        m.offload(i=0)
        m.reload_held(fail=None, hold=1, i=0)  # layer 0 landed, layer 1 held
        kv = m.kv
        grown = []
        for grow in (2, 2, 3, 3, 3, 3):
            before = kv.num_tokens("r0")
            m.grow_early(grow=grow)
            grown.append(kv.num_tokens("r0") - before)
            m.integrity()
            assert not kv.is_streamed("r0")
        assert grown[-1] == 0  # the growth that would stream was refused while reloading
        m.finish()  # the reload lands; every byte written is read back
        m.integrity()
        n = kv.num_tokens("r0")
        assert kv.allocate("r0", n + 3)  # now it may stream
        assert kv.is_streamed("r0")
        m._write("r0", n, 3)
        m._check("r0")
        m.integrity()
    finally:
        m.teardown()
