"""The front door: one object that owns cache, controller, pressure and policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiering.resources.base import ResourceReqConfig

from tiering.control.controller import ControllerConfig
from tiering.testing import FakeClock
from tiering.tiered import TieredKV, TieredKVConfig
from tiering.types import RequestState


def _config(geom, **kw) -> TieredKVConfig:
    base = dict(geometry=geom, device_pages=8, host_pages=32,
                controller=ControllerConfig(high=0.7, low=0.4, min_residency_s=0.0))
    base.update(kw)
    return TieredKVConfig(**base)


def _fill(tkv: TieredKV, rid: str, tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    g = tkv.kv.geometry
    tkv.add(rid)
    assert tkv.kv.allocate(rid, tokens)
    layers = []
    for layer in range(g.num_layers):
        k = torch.randn(tokens, g.num_kv_heads, g.head_dim, generator=gen).to(g.dtype)
        v = torch.randn(tokens, g.num_kv_heads, g.head_dim, generator=gen).to(g.dtype)
        tkv.kv.write(rid, layer, 0, k, v)
        layers.append((k, v))
    return layers


def test_worker_loop_moves_idle_requests_out_and_brings_them_back_exact(geom):
    clock = FakeClock()
    gen = torch.Generator().manual_seed(7)
    with TieredKV(_config(geom), clock=clock) as tkv:
        data = {rid: _fill(tkv, rid, 8, gen) for rid in ("a", "b", "c")}  # 2 pages each
        tkv.check_integrity()
        # a and b idle; c runs: 6 of 8 pages used > high 0.7, so idle ones leave
        assert tkv.prepare(["c"]) == ["c"]
        report = tkv.after_step(["c"])
        assert report.offloaded, "pressure above high must offload an idle request"
        assert "c" not in report.offloaded
        tkv.synchronize(timeout=10)
        tkv.check_integrity()
        gone = [rid for rid in ("a", "b") if tkv.kv.is_offloaded(rid)]
        assert gone
        # asked back: not ready this step, ready once its reload has landed
        rid = gone[0]
        assert tkv.prepare([rid]) == []
        for _ in range(5):
            clock.advance(1.0)
            tkv.after_step([])
            tkv.synchronize(timeout=10)
            if tkv.prepare([rid]) == [rid]:
                break
        else:
            pytest.fail(f"{rid} never came back: {tkv.kv.state_of(rid)}")
        tkv.check_integrity()
        for layer, (k, v) in enumerate(data[rid]):
            got_k, got_v = tkv.kv.read(rid, layer)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert tkv.stats()["kv.offloads_to_host"] >= 1
        assert tkv.stats()["kv.reloads_from_host"] >= 1


def test_add_is_idempotent_and_refuses_different_settings(geom):
    with TieredKV(_config(geom)) as tkv:
        tkv.add("a")
        tkv.add("a")
        assert tkv.requests() == ["a"]
        with pytest.raises(ValueError, match="'a'"):
            tkv.add("a", ResourceReqConfig(retention_priority=90))
        assert tkv.requests() == ["a"]
        tkv.check_integrity()


def test_unknown_requests_are_refused_without_change(geom):
    with TieredKV(_config(geom)) as tkv:
        tkv.add("a")
        with pytest.raises(KeyError, match="'nope'"):
            tkv.prepare(["a", "nope"])
        with pytest.raises(KeyError, match="'nope'"):
            tkv.after_step(["nope"])
        with pytest.raises(KeyError, match="'nope'"):
            tkv.remove("nope")
        assert tkv.requests() == ["a"]
        assert tkv.kv.state_of("a") is RequestState.RESIDENT


def test_remove_forgets_everywhere_and_close_is_final(geom):
    gen = torch.Generator().manual_seed(3)
    tkv = TieredKV(_config(geom))
    _fill(tkv, "a", 5, gen)
    tkv.remove("a")
    assert tkv.requests() == [] and tkv.kv.requests() == []
    assert tkv.stats()["device_used_bytes"] == 0
    tkv.check_integrity()
    tkv.close()
    tkv.close()
    with pytest.raises(RuntimeError, match="closed"):
        tkv.add("b")
    with pytest.raises(RuntimeError, match="closed"):
        tkv.prepare([])


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("device_pages", 0, "device_pages"),
        ("host_pages", True, "host_pages"),
        ("policy", 3, "policy"),
        ("controller", {}, "controller"),
        ("cache_options", {"device": "cpu"}, "cache_options"),
    ],
)
def test_config_names_the_bad_field(geom, field, value, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _config(geom, **{field: value})


def test_unknown_policy_name_is_refused_and_leaves_nothing_running(geom):
    with pytest.raises(ValueError, match="mru"):
        TieredKV(_config(geom, policy="mru"))


def test_front_door_exports_every_public_name():
    import tiering

    for name in tiering.__all__:
        assert getattr(tiering, name) is not None, name
    assert tiering.TieredKV is TieredKV
    with pytest.raises(AttributeError, match="no_such_name"):
        tiering.no_such_name  # noqa: B018


def test_synchronize_through_the_front_door_settles_the_controllers_ledger(geom):
    """Copies waited for through the front door reach the controller: after
    every offload has landed nothing is still counted as leaving the device."""
    gen = torch.Generator().manual_seed(11)
    with TieredKV(_config(geom)) as tkv:
        for rid in ("a", "b", "c"):
            _fill(tkv, rid, 8, gen)
        tkv.prepare(["c"])
        assert tkv.after_step(["c"]).offloaded
        tkv.synchronize(timeout=10)
        assert tkv.stats()["controller.transfers_reported"] >= 1
        tkv.controller.check_integrity()
        assert tkv.stats()["controller.offloads_in_flight"] == 0, "a landed offload still counted"


def test_around_wraps_a_cache_built_elsewhere_and_owns_it(geom):
    from tiering.resources.kv_cache import PagedKVCache

    from tiering.errors import CacheClosed

    clock = FakeClock()
    gen = torch.Generator().manual_seed(11)
    kv = PagedKVCache(geom, device_pages=8, host_pages=32, clock=clock)
    tkv = TieredKV.around(kv, policy="lru", clock=clock,
                          controller=ControllerConfig(high=0.7, low=0.4, min_residency_s=0.0))
    assert tkv.config is None and tkv.kv is kv
    _fill(tkv, "a", 8, gen)
    _fill(tkv, "b", 8, gen)
    _fill(tkv, "c", 8, gen)
    assert tkv.requests() == ["a", "b", "c"] == kv.requests()
    tkv.prepare(["c"])
    assert tkv.after_step(["c"]).offloaded
    tkv.synchronize(timeout=10)
    tkv.check_integrity()
    tkv.close()
    with pytest.raises(CacheClosed):
        kv.requests()


def test_around_refuses_what_it_cannot_drive_and_names_it(geom):
    class NotACache:
        def supports_eviction(self):
            return True

    with pytest.raises(TypeError, match="lacks .*ingest_request"):
        TieredKV.around(NotACache())
    from tiering.resources.kv_cache import PagedKVCache

    with PagedKVCache(geom, device_pages=4, host_pages=4) as kv:
        with pytest.raises(TypeError, match="controller must be a ControllerConfig"):
            TieredKV.around(kv, controller={"high": 0.9})
        assert kv.requests() == []  # refused before it registered or changed anything


def test_ready_names_each_state_a_request_can_be_in(geom, tmp_path):
    """READY, WAITING (its copy is running), ASKED_BACK (offloaded), READY again
    once back with the same bytes, LOST once dropped; each call changes only what
    it says."""
    import threading

    from tiering.disk.config import DiskConfig
    from tiering.tiered import Readiness

    started, release = threading.Event(), threading.Event()

    def hold_disk_writes(direction: str) -> None:
        if direction == "d2h":
            started.set()
            assert release.wait(10), "the test never let the copy go"

    disk = DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=16 * geom.page_bytes,
                      chunk_bytes=2 * geom.page_bytes)
    gen = torch.Generator().manual_seed(5)
    cfg = _config(geom, host_pages=1, disk=disk,
                  cache_options={"copy_fault_hook": hold_disk_writes})
    with TieredKV(cfg, clock=FakeClock()) as tkv:
        data = _fill(tkv, "a", 8, gen)
        _fill(tkv, "b", 8, gen)
        assert tkv.ready("a", 3) is Readiness.READY
        assert tkv.kv.offload("a") > 0  # host full: straight to disk, held by the hook
        assert started.wait(10)
        assert tkv.ready("a") is Readiness.WAITING
        assert tkv.kv.state_of("a") is RequestState.OFFLOADING
        release.set()
        tkv.synchronize(timeout=10)
        tkv.check_integrity()
        assert tkv.kv.state_of("a") is RequestState.ON_DISK
        assert tkv.ready("a") is Readiness.ASKED_BACK
        assert tkv.kv.state_of("a") in (RequestState.RELOADING, RequestState.ON_DISK)
        tkv.synchronize(timeout=10)
        assert tkv.ready("a") is Readiness.READY
        for layer, (k, v) in enumerate(data):
            got_k, got_v = tkv.kv.read("a", layer)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert tkv.stats()["kv.reloads_from_disk"] == 1
        assert tkv.kv.offload("b") > 0
        tkv.synchronize(timeout=10)
        tkv.kv.drop("b")
        assert tkv.ready("b") is Readiness.LOST
        assert [rid for rid, _ in tkv.take_lost()] == ["b"]
        tkv.check_integrity()
        with pytest.raises(KeyError, match="'nope'"):
            tkv.ready("nope")
    with pytest.raises(RuntimeError, match="closed"):
        tkv.ready("a")
    with pytest.raises(RuntimeError, match="closed"):
        tkv.poll()


def test_check_integrity_catches_a_request_registered_behind_the_front_door(geom):
    with TieredKV(_config(geom)) as tkv:
        tkv.add("a")
        tkv.check_integrity()
        tkv.kv.ingest_request("x")  # the cache alone: the controller never heard of it
        with pytest.raises(AssertionError, match=r"only in the cache \['x'\]"):
            tkv.check_integrity()
        tkv.add("x")  # registering it through the front door mends it
        tkv.check_integrity()
        assert tkv.knows("x") and not tkv.knows("y")


def test_stats_parts_are_the_prefixed_figures_without_the_prefix(geom):
    gen = torch.Generator().manual_seed(13)
    with TieredKV(_config(geom)) as tkv:
        for rid in ("a", "b", "c"):
            _fill(tkv, rid, 8, gen)
        tkv.after_step(["c"])
        tkv.synchronize(timeout=10)
        flat = tkv.stats()
        kv_part, ctl_part = tkv.stats("kv"), tkv.stats("controller")
        assert kv_part["offloads_to_host"] >= 1
        assert kv_part == {k[3:]: v for k, v in flat.items() if k.startswith("kv.")}
        assert ctl_part == {k[11:]: v for k, v in flat.items() if k.startswith("controller.")}
        assert ctl_part["live_requests"] == 3
        with pytest.raises(ValueError, match="part must be one of"):
            tkv.stats("disk")


def test_around_takes_a_pressure_class_a_source_or_nothing_else(geom):
    from tiering.resources.kv_cache import PagedKVCache

    from tiering.control.pressure import PoolPressure, ScriptedPressure

    with TieredKV.around(PagedKVCache(geom, device_pages=8, host_pages=8),
                         pressure=PoolPressure) as tkv:
        assert isinstance(tkv.pressure, PoolPressure), "a source class is called with the cache"
        tkv.add("a")
        assert tkv.kv.allocate("a", 8)
        assert tkv.pressure.read() == pytest.approx(2 / 8)
    source = ScriptedPressure([0.25])
    with TieredKV.around(PagedKVCache(geom, device_pages=8, host_pages=8),
                         pressure=source) as tkv:
        assert tkv.pressure is source, "a source instance is used as it is"
    kv = PagedKVCache(geom, device_pages=4, host_pages=4)
    with kv, pytest.raises(TypeError, match="pressure must be"):
        TieredKV.around(kv, pressure=3)


# -- bad input at the front door: refused by name, nothing changed ----------------------


def _front_state(tkv: TieredKV) -> tuple:
    kv = tkv.kv
    return (tkv.requests(), {rid: kv.state_of(rid) for rid in kv.requests()},
            tkv.stats(), tkv.controller.pending_reloads())


def _two_requests(tkv: TieredKV, gen: torch.Generator) -> dict:
    data = {rid: _fill(tkv, rid, 6, gen) for rid in ("ab", "c")}
    # "a" and "b" exist too, so a str taken for a batch of its characters would pass silently
    for rid in ("a", "b"):
        _fill(tkv, rid, 3, gen)
    tkv.check_integrity()
    return data


@pytest.mark.parametrize("call,match", [
    (lambda t: t.prepare("ab"), "batch must be a collection of request ids"),
    (lambda t: t.prepare(b"ab"), "batch must be a collection of request ids"),
    (lambda t: t.prepare(None), "batch must be a collection of request ids"),
    (lambda t: t.prepare(["c", 5]), r"request ids must be str, got \[5\]"),
    (lambda t: t.prepare([["c"]]), r"request ids must be str, got \[\['c'\]\]"),
    (lambda t: t.prepare(["c", "ab", "c"]), r"names request\(s\) \['c'\] more than once"),
    (lambda t: t.prepare(["c"], True), "step must be an int >= 0, got True"),
    (lambda t: t.prepare(["c"], -1), "step must be an int >= 0, got -1"),
    (lambda t: t.prepare(["c"], 2.0), "step must be an int >= 0, got 2.0"),
    (lambda t: t.ready("c", float("nan")), "step must be an int >= 0, got nan"),
    (lambda t: t.ready({}), r"request ids must be str, got \[\{\}\]"),
    (lambda t: t.ready(7), r"request ids must be str, got \[7\]"),
    (lambda t: t.after_step("ab"), "ran must be a collection of request ids"),
    (lambda t: t.after_step(["c"], keep="ab"), "keep must be a collection of request ids"),
    (lambda t: t.after_step(["c"], keep=[3]), r"keep ids must be str, got \[3\]"),
    (lambda t: t.after_step([None]), r"request ids must be str, got \[None\]"),
    (lambda t: t.remove(["c"]), r"request ids must be str"),
    (lambda t: t.knows(["c"]), r"request ids must be str"),
    (lambda t: t.synchronize(float("inf")), "timeout must be a finite number"),
    (lambda t: t.controller.evict_if_needed("ab"), "running must be a collection"),
    (lambda t: t.controller.plan_offload("ab", 1), "running must be a collection"),
    (lambda t: t.controller.touch(["c"]), "touch: a request id is a non-empty str"),
    (lambda t: t.controller.remove_request({}), "remove_request: a request id is a non-empty str"),
    (lambda t: t.controller.request_reload(["c"]), "request_reload: a request id is a non-empty str"),
    (lambda t: t.controller.add_request("c", ["kv"]), r"unknown resource \['kv'\]"),
])
def test_bad_input_is_refused_by_name_and_changes_nothing(geom, call, match):
    gen = torch.Generator().manual_seed(41)
    with TieredKV(_config(geom), clock=FakeClock()) as tkv:
        data = _two_requests(tkv, gen)
        before = _front_state(tkv)
        with pytest.raises((TypeError, ValueError)) as err:
            call(tkv)
        assert err.match(match)
        assert not isinstance(err.value, KeyError), "a malformed id is not an unknown one"
        assert _front_state(tkv) == before
        tkv.check_integrity()
        for rid, layers in data.items():
            for layer, (k, v) in enumerate(layers):
                got_k, got_v = tkv.kv.read(rid, layer)
                assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_a_str_keep_would_have_offloaded_the_request_it_names(geom):
    """The negative control of the str checks: with keep as a list the request named
    "ab" stays; the same call is what a str keep used to turn into {"a", "b"}."""
    gen = torch.Generator().manual_seed(42)
    clock = FakeClock()
    with TieredKV(_config(geom), clock=clock) as tkv:
        _two_requests(tkv, gen)  # 2 + 2 + 1 + 1 pages of 8: above high
        report = tkv.after_step(["c"], keep=["ab"])
        tkv.synchronize(timeout=10)
        assert "ab" not in report.offloaded and not tkv.kv.is_offloaded("ab")
        assert set(report.offloaded) <= {"a", "b"} and report.offloaded
        tkv.check_integrity()


def test_every_call_after_close_says_the_front_door_is_closed(geom):
    gen = torch.Generator().manual_seed(43)
    tkv = TieredKV(_config(geom))
    _fill(tkv, "a", 5, gen)
    tkv.after_step(["a"])
    tkv.check_integrity()
    final_kv, final_ctl = tkv.stats("kv"), tkv.stats("controller")
    tkv.close()
    calls = {
        "add": lambda: tkv.add("b"), "remove": lambda: tkv.remove("a"),
        "requests": tkv.requests, "knows": lambda: tkv.knows("a"),
        "prepare": lambda: tkv.prepare(["a"]), "poll": tkv.poll,
        "ready": lambda: tkv.ready("a"), "after_step": lambda: tkv.after_step(["a"]),
        "synchronize": lambda: tkv.synchronize(1.0), "take_lost": tkv.take_lost,
        "stats": tkv.stats, "check_integrity": tkv.check_integrity,
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as err:
            call()
        assert str(err.value) == "TieredKV is closed", name
    # the two counter parts stay readable: the final figures of the closed cache
    assert tkv.stats("kv") == final_kv
    assert tkv.stats("controller")["live_requests"] == final_ctl["live_requests"] == 1
    tkv.close()  # idempotent


@pytest.mark.parametrize("field,value,match", [
    ("verify", "no", "verify must be a bool"),
    ("verify", 1, "verify must be a bool"),
    ("offload_to_disk_when_host_full", "false", "offload_to_disk_when_host_full must be a bool"),
    ("device", 0, "device must be a str or torch.device"),
    ("cache_options", [("copy_workers", 1)], "cache_options must be a dict"),
    ("cache_options", {"copy_wrokers": 1}, r"\['copy_wrokers'\] are not options of PagedKVCache"),
])
def test_config_refuses_mistyped_fields_by_name(geom, field, value, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _config(geom, **{field: value})


def test_config_takes_every_real_cache_option(geom):
    cfg = _config(geom, cache_options={"copy_workers": 1, "io_workers": 1})
    with TieredKV(cfg) as tkv:
        tkv.add("a")
        tkv.check_integrity()


@pytest.mark.parametrize("name,value", [
    ("verify", "no"), ("offload_to_disk_when_host_full", "false"), ("stage_disk_io", 1),
    ("clock", 3.0), ("copy_fault_hook", "hook"), ("disk_wrap_store", 5),
])
def test_cache_refuses_mistyped_options_by_name(geom, name, value):
    from tiering.resources.kv_cache import PagedKVCache

    with pytest.raises(ValueError, match=f"PagedKVCache: {name} must be"):
        PagedKVCache(geom, device_pages=4, host_pages=4, **{name: value})


def test_a_request_too_large_to_reload_is_never_offloaded_so_never_stranded(geom):
    """Device 8 pages, high 0.7, headroom 0.02: a reload may need at most 5.44 pages. A
    6-page request offloaded by the controller could never come back (prepare raised
    every step); it is passed over, and a smaller idle one leaves instead."""
    gen = torch.Generator().manual_seed(44)
    clock = FakeClock()
    with TieredKV(_config(geom), clock=clock) as tkv:
        big = _fill(tkv, "big", 24, gen)  # 6 pages
        _fill(tkv, "small", 4, gen)  # 1 page: 7 of 8 used, above high
        tkv.check_integrity()
        assert [c.rid for c in tkv.controller.plan_offload((), 1 << 30)] == ["small"]
        report = tkv.after_step([])
        tkv.synchronize(timeout=10)
        tkv.check_integrity()
        assert report.offloaded == ("small",)
        assert not tkv.kv.is_offloaded("big")
        for step in range(3):
            clock.advance(1.0)
            assert tkv.prepare(["big"], step) == ["big"]
            tkv.after_step(["big"])
            tkv.synchronize(timeout=10)
            tkv.check_integrity()
        for layer, (k, v) in enumerate(big):
            got_k, got_v = tkv.kv.read("big", layer)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
        # the negative control: offloaded behind the controller's back, it is stranded
        tkv.remove("small")
        assert tkv.kv.offload("big") > 0
        tkv.synchronize(timeout=10)
        with pytest.raises(ValueError, match="more than the admission limit"):
            tkv.prepare(["big"])
        tkv.check_integrity()


def test_close_stops_a_pressure_poller_the_front_door_built_and_not_one_handed_in(geom):
    import threading

    from tiering.resources.kv_cache import PagedKVCache

    from tiering.control.pressure import PoolPressure, PressurePoller

    built: list[PressurePoller] = []

    def polled(kv):
        poller = PressurePoller(PoolPressure(kv), interval_s=0.005)
        poller.start()
        built.append(poller)
        return poller

    tkv = TieredKV(_config(geom, pressure=polled))
    tkv.add("a")
    assert tkv.kv.allocate("a", 8)
    tkv.check_integrity()
    assert built[0].running
    tkv.close()
    assert not built[0].running, "the poller's thread outlived the TieredKV that built it"
    assert "tiering-pressure-poller" not in {t.name for t in threading.enumerate()}
    # through around, a callable's source is built (and stopped) the same way
    with TieredKV.around(PagedKVCache(geom, device_pages=8, host_pages=8), pressure=polled):
        assert built[1].running
    assert not built[1].running
    # the control: a started poller handed in as a source is the caller's, left running
    kv = PagedKVCache(geom, device_pages=8, host_pages=8)
    mine = PressurePoller(PoolPressure(kv), interval_s=0.005)
    mine.start()
    try:
        with TieredKV.around(kv, pressure=mine) as tkv:
            assert tkv.pressure is mine
        assert mine.running
    finally:
        assert mine.stop(5)


def test_remove_mends_a_request_removed_behind_the_front_door(geom):
    gen = torch.Generator().manual_seed(45)
    with TieredKV(_config(geom)) as tkv:
        _fill(tkv, "a", 6, gen)
        kept = _fill(tkv, "b", 5, gen)
        tkv.kv.remove_request("a")  # straight from the cache: the controller still has it
        with pytest.raises(AssertionError, match=r"only in the controller \['a'\]"):
            tkv.check_integrity()
        tkv.remove("a")  # before: UnknownRequest from the cache, and "a" stuck for good
        tkv.check_integrity()
        assert tkv.requests() == ["b"] and not tkv.knows("a")
        with pytest.raises(KeyError, match="'a'"):
            tkv.remove("a")  # now unknown everywhere
        for layer, (k, v) in enumerate(kept):
            got_k, got_v = tkv.kv.read("b", layer)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_a_bad_clock_is_refused_before_anything_is_built_or_closed(geom):
    from tiering.resources.kv_cache import PagedKVCache

    with pytest.raises(TypeError, match="TieredKV: clock must be callable"):
        TieredKV(_config(geom), clock=5.0)
    kv = PagedKVCache(geom, device_pages=4, host_pages=4)
    with kv:
        kv.ingest_request("a")
        with pytest.raises(TypeError, match="around: clock must be callable"):
            TieredKV.around(kv, clock="now")
        assert kv.requests() == ["a"]  # still open: the refusal closed nothing
        kv.check_integrity()


# -- a state machine over the front door ----------------------------------------------


def _front_machine(with_disk: bool):
    """A worker loop with random arrivals, batches, removals, settles and time, over a real
    cache (with a disk tier when ``with_disk``): every READY request reads back bit for bit
    what was written into it, nothing is lost, and the front door's check holds after every
    step. (hypothesis is imported here, as in conftest.)"""
    import shutil
    import tempfile

    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
    from tiering.resources.kv_geometry import KVGeometry

    from tiering.disk import DiskConfig
    from tiering.tiered import Readiness

    geom = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=2,
                      dtype=torch.float32)

    class Front(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.clock = FakeClock()
            self.dir = tempfile.mkdtemp() if with_disk else None
            disk = DiskConfig(path=f"{self.dir}/disk", capacity_bytes=8 * geom.page_bytes,
                              chunk_bytes=2 * geom.page_bytes) if with_disk else None
            self.tkv = TieredKV(TieredKVConfig(
                geometry=geom, device_pages=10, host_pages=6, disk=disk, verify=True,
                controller=ControllerConfig(high=0.7, low=0.4, host_high=0.5, host_low=0.3,
                                            min_residency_s=0.0, aging_s=2.0)),
                clock=self.clock)
            self.data: dict[str, list] = {}
            self.gen = torch.Generator().manual_seed(46)
            self.n = self.step_no = 0

        def teardown(self):
            self.tkv.close()
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)

        def rids(self):
            return sorted(self.data)

        @rule(tokens=st.integers(1, 12))
        def arrive(self, tokens):
            rid = f"r{self.n}"
            self.n += 1
            self.tkv.add(rid)
            kv = self.tkv.kv
            before = kv.device_used_bytes()
            if not kv.allocate(rid, tokens):
                assert kv.device_used_bytes() == before  # refused: nothing taken
                self.tkv.remove(rid)
                return
            layers = []
            for layer in range(geom.num_layers):
                k = torch.randn(tokens, 1, 4, generator=self.gen)
                v = torch.randn(tokens, 1, 4, generator=self.gen)
                kv.write(rid, layer, 0, k, v)
                layers.append((k, v))
            self.data[rid] = layers

        @precondition(lambda self: self.data)
        @rule(pick=st.sets(st.integers(0, 30), min_size=1, max_size=4), keep=st.booleans())
        def step(self, pick, keep):
            rids = self.rids()
            batch = sorted({rids[i % len(rids)] for i in pick})
            ready = self.tkv.prepare(batch, self.step_no)
            self.step_no += 1
            assert set(ready) <= set(batch)
            for rid in ready:
                assert self.tkv.kv.state_of(rid) is RequestState.RESIDENT
                for layer, (k, v) in enumerate(self.data[rid]):
                    got_k, got_v = self.tkv.kv.read(rid, layer)
                    assert torch.equal(got_k, k) and torch.equal(got_v, v), rid
            others = [rid for rid in rids if rid not in ready]
            report = self.tkv.after_step(ready, keep=others[:1] if keep else ())
            assert not set(report.offloaded) & set(ready), "a request that ran was offloaded"

        @precondition(lambda self: self.data)
        @rule(i=st.integers(0, 30))
        def ask(self, i):
            rid = self.rids()[i % len(self.data)]
            self.tkv.poll()
            got = self.tkv.ready(rid, self.step_no)
            assert got is not Readiness.LOST
            if got is Readiness.READY:
                assert self.tkv.kv.state_of(rid) is RequestState.RESIDENT

        @precondition(lambda self: self.data)
        @rule(i=st.integers(0, 30))
        def finish(self, i):
            rid = self.rids()[i % len(self.data)]
            self.tkv.remove(rid)
            del self.data[rid]

        @rule()
        def settle(self):
            self.tkv.synchronize(10)

        @rule(dt=st.floats(0.1, 3.0))
        def tick(self, dt):
            self.clock.advance(dt)

        @invariant()
        def agrees(self):
            self.tkv.check_integrity()
            assert self.tkv.requests() == self.rids()
            assert self.tkv.take_lost() == []

    Front.TestCase.settings = settings(
        max_examples=25, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    return Front


TestFrontDoorMachine = _front_machine(with_disk=False).TestCase
TestFrontDoorMachineWithDisk = _front_machine(with_disk=True).TestCase


def test_around_refuses_a_cache_without_state_of_which_ready_needs(geom):
    from tiering.resources.kv_cache import PagedKVCache

    class NoStates:  # every hook but state_of, which ready() asks of a request not admitted
        def __init__(self, kv):
            self._kv = kv

        def __getattr__(self, name):
            if name == "state_of":
                raise AttributeError(name)
            return getattr(self._kv, name)

    with PagedKVCache(geom, device_pages=4, host_pages=4) as kv:
        with pytest.raises(TypeError, match=r"lacks \['state_of'\]"):
            TieredKV.around(NoStates(kv))
        kv.check_integrity()  # refused up front: the cache is still open


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_a_device_that_holds_no_bytes_is_refused(geom, device):
    from tiering.resources.kv_cache import PagedKVCache

    with pytest.raises(ValueError, match="device must be a CPU or CUDA device"):
        PagedKVCache(geom, device=device, device_pages=4, host_pages=4)
    with pytest.raises(ValueError, match="device must be a CPU or CUDA device"):
        TieredKV(_config(geom, device=device))


def test_prepare_refuses_a_batch_with_a_request_that_can_never_reload_before_asking_any(geom):
    gen = torch.Generator().manual_seed(47)
    clock = FakeClock()
    with TieredKV(_config(geom), clock=clock) as tkv:
        _fill(tkv, "x", 4, gen)  # 1 page
        _fill(tkv, "big", 24, gen)  # 6 pages: over the 5.44-page admission limit
        for rid in ("x", "big"):  # offloaded behind the controller's back
            assert tkv.kv.offload(rid) > 0
        tkv.synchronize(timeout=10)
        tkv.check_integrity()
        before = _front_state(tkv)
        with pytest.raises(ValueError, match="'big' needs .* more than the admission limit"):
            tkv.prepare(["x", "big"])
        assert _front_state(tkv) == before, "x was asked back by a refused prepare"
        assert tkv.controller.pending_reloads() == () and tkv.kv.is_offloaded("x")
        assert tkv.controller.reload_refusal("x") is None
        assert isinstance(tkv.controller.reload_refusal("big"), ValueError)
        tkv.check_integrity()
        assert tkv.prepare(["x"]) == []  # the control: x alone is asked back
        assert tkv.stats("controller")["reloads_started"] == 1
        tkv.synchronize(timeout=10)
        assert tkv.prepare(["x"]) == ["x"]
        tkv.check_integrity()


def test_config_cache_options_cannot_change_after_the_check(geom):
    options = {"copy_workers": 1}
    cfg = _config(geom, cache_options=options)
    options["copy_wrokers"] = 3  # the caller's dict changes later: the config does not
    assert dict(cfg.cache_options) == {"copy_workers": 1}
    with pytest.raises(TypeError):
        cfg.cache_options["io_workers"] = 0  # read-only
    with TieredKV(cfg) as tkv:
        tkv.add("a")
        tkv.check_integrity()


def _stall_setup(geom, tmp_path, high: float, gen: torch.Generator, **kw):
    """Device of 8 pages; 'a' (random KV) offloaded to disk; the device then filled so
    that asking 'a' back queues it; returns the front door and a's data."""
    from tiering.disk.config import DiskConfig

    disk = DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=64 * geom.page_bytes,
                      chunk_bytes=2 * geom.page_bytes)
    cfg = _config(geom, host_pages=1, disk=disk,
                  controller=ControllerConfig(high=high, low=0.4, min_residency_s=0.0), **kw)
    tkv = TieredKV(cfg, clock=FakeClock())
    data = _fill(tkv, "a", 8, gen)
    for rid in ("b", "c"):
        _fill(tkv, rid, 8, gen)
    assert tkv.kv.offload("a") > 0
    tkv.synchronize(timeout=10)
    assert tkv.kv.state_of("a") is RequestState.ON_DISK
    for rid in ("d", "e"):
        _fill(tkv, rid, 8, gen)  # the device is full: a reload of 'a' cannot start
    return tkv, data


def test_a_worker_that_skips_after_step_still_gets_an_asked_back_request(geom, tmp_path,
                                                                        closing):
    """poll() and ready() only (no after_step while nothing ran): once room appears, the
    waiting reload starts from poll and the request comes back with its bytes."""
    from tiering.tiered import Readiness

    tkv, data = _stall_setup(geom, tmp_path, 0.9, torch.Generator().manual_seed(11))
    closing(tkv)
    tkv.poll()
    assert tkv.ready("a") is Readiness.ASKED_BACK
    assert tkv.controller.pending_reloads() == ("a",)
    tkv.remove("d")
    tkv.remove("e")  # room now; nothing else will happen unless poll serves the queue
    for step in range(100):
        tkv.poll()
        if tkv.ready("a", step) is Readiness.READY:
            break
        tkv.synchronize(timeout=10)
    else:
        pytest.fail(f"'a' never came back: {tkv.kv.state_of('a')}, "
                    f"waiting {tkv.controller.pending_reloads()}")
    assert tkv.stats()["kv.reloads_from_disk"] == 1
    for layer, (k, v) in enumerate(data):
        got_k, got_v = tkv.kv.read("a", layer)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert tkv.stalled() == {}
    tkv.check_integrity()


def test_a_request_asked_back_without_progress_is_named_once_with_what_it_waits_for(
        geom, tmp_path, closing, caplog):
    from tiering.tiered import Readiness

    tkv, _ = _stall_setup(geom, tmp_path, 0.7, torch.Generator().manual_seed(12),
                          stall_warn_steps=10)
    closing(tkv)
    with caplog.at_level("WARNING", logger="tiering.tiered"):
        for step in range(30):
            tkv.poll()
            assert tkv.ready("a", step) is Readiness.ASKED_BACK
            assert tkv.ready("b", step) is Readiness.READY
            if step < 8:
                assert tkv.stalled() == {}
    warned = [r.getMessage() for r in caplog.records if "'a'" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "asked back for 10 steps" in warned[0] and "ON_DISK" in warned[0]
    assert f"{2 * geom.page_bytes} bytes of device room" in warned[0]
    assert "after_step has not run" in warned[0]
    assert not any("'b'" in r.getMessage() for r in caplog.records)
    assert tkv.stalled() == {"a": 30}
    # the loop as it should be: after_step each step makes room, and 'a' comes back
    clock = tkv.controller._clock
    for step in range(30, 80):
        clock.advance(1.0)
        if "a" in tkv.prepare(["a"], step):
            break
        tkv.after_step([])
        tkv.synchronize(timeout=10)
    else:
        pytest.fail(f"'a' never came back: {tkv.kv.state_of('a')}")
    assert tkv.stalled() == {}
    tkv.check_integrity()


def test_a_request_asked_back_only_now_and_then_is_not_called_stalled(geom, tmp_path, closing,
                                                                      caplog):
    tkv, _ = _stall_setup(geom, tmp_path, 0.7, torch.Generator().manual_seed(13),
                          stall_warn_steps=3)
    closing(tkv)
    with caplog.at_level("WARNING", logger="tiering.tiered"):
        for step in range(20):
            tkv.poll()
            if step % 2 == 0:  # a window that passes over it every other step
                tkv.ready("a", step)
    assert tkv.stalled() == {}
    assert not [r for r in caplog.records if "asked back" in r.getMessage()]


def test_a_worker_that_polls_and_then_prepares_each_step_is_warned_all_the_same(
        geom, tmp_path, closing, caplog):
    """poll() then prepare() each step is one step of them: counted as two, every request
    looked checked only every other step and the warning never came."""
    from tiering.tiered import Readiness

    tkv, _ = _stall_setup(geom, tmp_path, 0.7, torch.Generator().manual_seed(15),
                          stall_warn_steps=5)
    closing(tkv)
    with caplog.at_level("WARNING", logger="tiering.tiered"):
        for step in range(12):
            tkv.poll()
            assert "a" not in tkv.prepare(["a", "b"], step)
            assert tkv.ready("a", step) is Readiness.ASKED_BACK
    warned = [r.getMessage() for r in caplog.records if "'a'" in r.getMessage()]
    assert len(warned) == 1 and "asked back for 5 steps" in warned[0], warned
    assert tkv.stalled() == {"a": 12}


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "50"])
def test_stall_warn_steps_is_an_int_of_at_least_one_or_none(geom, value):
    with pytest.raises(ValueError, match="stall_warn_steps"):
        _config(geom, stall_warn_steps=value)
    assert _config(geom, stall_warn_steps=None).stall_warn_steps is None


@pytest.mark.parametrize("call", [
    lambda t: t.add(5),
    lambda t: t.add(None),
    lambda t: t.add(["c"]),
    lambda t: t.add("z", config=5),
    lambda t: t.remove(5),
    lambda t: t.knows(5),
    lambda t: t.ready(5),
    lambda t: t.prepare([5]),
    lambda t: t.after_step([5]),
    lambda t: t.after_step(["c"], keep=[5]),
    lambda t: t.stats(5),
])
def test_a_request_id_or_argument_of_the_wrong_type_is_a_type_error(geom, call):
    """The docs promise TypeError (not ValueError, not UnknownRequest) for a value of
    the wrong type; nothing is registered."""
    gen = torch.Generator().manual_seed(43)
    with TieredKV(_config(geom), clock=FakeClock()) as tkv:
        _two_requests(tkv, gen)
        before = _front_state(tkv)
        with pytest.raises(TypeError):
            call(tkv)
        assert _front_state(tkv) == before
        assert tkv.requests() == sorted(tkv.kv.requests())
        tkv.check_integrity()


def test_a_disk_capacity_past_what_the_ledger_can_hold_is_refused_by_name(geom, tmp_path):
    """1 PiB of small pages: a ValueError naming DiskConfig.capacity_bytes, from the
    config and from a cache built without it, never numpy's MemoryError; nothing is
    created on disk."""
    from tiering.resources.kv_cache import PagedKVCache

    from tiering.disk.config import MAX_DISK_PAGES, DiskConfig

    path = tmp_path / "disk"
    disk = DiskConfig(path=str(path), capacity_bytes=1 << 50)
    assert (1 << 50) // geom.page_bytes > MAX_DISK_PAGES
    with pytest.raises(ValueError, match="DiskConfig.capacity_bytes"):
        _config(geom, disk=disk)
    with pytest.raises(ValueError, match="DiskConfig.capacity_bytes"):
        PagedKVCache(geom, device="cpu", device_pages=4, host_pages=4, disk=disk)
    assert not path.exists()
    fits = DiskConfig(path=str(path), capacity_bytes=MAX_DISK_PAGES * geom.page_bytes)
    assert _config(geom, disk=fits).disk is fits  # the limit itself is taken


@pytest.mark.parametrize("kind", [np.int8, np.int16, np.int32, np.int64, np.uint32, np.uint64])
def test_a_numpy_integer_size_is_multiplied_exactly_never_in_its_own_width(kind):
    """``gib(np.int32(5))`` was 1 GiB and ``gib(np.int32(2**31 - 1))`` negative: the size
    was multiplied in the integer's own fixed width, which wrapped around silently."""
    from tiering import gib, kib, mib, tib

    big = int(np.iinfo(kind).max)
    for fn, unit in ((kib, 1 << 10), (mib, 1 << 20), (gib, 1 << 30), (tib, 1 << 40)):
        for n in (5, big):
            got = fn(kind(n))
            assert got == n * unit and type(got) is int, (fn.__name__, kind, n, got)


def test_a_size_too_large_for_a_float_is_refused_by_name():
    from tiering import gib, tib

    with pytest.raises(ValueError, match=r"tib: 1e\+300 is more bytes than a float holds"):
        tib(1e300)  # was OverflowError: cannot convert float infinity to integer
    assert tib(10**300) == 10**300 << 40  # an int of any size is exact
    assert gib(np.float32(0.5)) == 1 << 29


def test_sizes_are_bytes_written_with_helpers_and_pools_can_be_given_in_bytes(geom):
    import tiering
    from tiering import gib, kib, mib, tib

    assert (kib(1), mib(1), gib(2), tib(1)) == (1 << 10, 1 << 20, 2 << 30, 1 << 40)
    assert gib(1.5) == 3 << 29 and isinstance(gib(1.5), int)
    assert {"kib", "mib", "gib", "tib"} <= set(tiering.__all__)
    with pytest.raises(TypeError, match="gib"):
        gib("2")
    with pytest.raises(ValueError, match="gib"):
        gib(-1)
    pb = geom.page_bytes
    cfg = TieredKVConfig.from_bytes(geom, device_bytes=8 * pb + pb // 2, host_bytes=32 * pb,
                                    policy="lru")
    assert (cfg.device_pages, cfg.host_pages, cfg.policy) == (8, 32, "lru")
    with pytest.raises(ValueError, match="device_bytes must be an int of at least one page"):
        TieredKVConfig.from_bytes(geom, device_bytes=pb - 1, host_bytes=32 * pb)
    with pytest.raises(ValueError, match="give host_bytes, not host_pages"):
        TieredKVConfig.from_bytes(geom, device_bytes=pb, host_bytes=pb, host_pages=3)
    with TieredKV(cfg) as tkv:
        assert tkv.kv.device_capacity_bytes == 8 * pb


def test_a_stall_with_after_step_running_names_the_aging_wait(geom, tmp_path, closing, caplog):
    """after_step runs every step but the clock stands still: the reload waits for aging_s
    (nothing is offloaded below high), and the warning says so rather than blame
    after_step."""
    from tiering.tiered import Readiness

    tkv, _ = _stall_setup(geom, tmp_path, 0.7, torch.Generator().manual_seed(14),
                          stall_warn_steps=5)
    closing(tkv)
    with caplog.at_level("WARNING", logger="tiering.tiered"):
        for step in range(8):
            tkv.poll()
            assert tkv.ready("a", step) is Readiness.ASKED_BACK
            tkv.after_step(["b", "c", "d", "e"])
    warned = [r.getMessage() for r in caplog.records if "'a'" in r.getMessage()]
    assert len(warned) == 1
    assert "aging_s = 10 s" in warned[0] and "after_step has not run" not in warned[0]


def _disk_run(geom, path, gen, **disk_kw):
    from tiering.disk.config import DiskConfig

    disk = DiskConfig(path=str(path), capacity_bytes=64 * geom.page_bytes,
                      chunk_bytes=2 * geom.page_bytes, **disk_kw)
    tkv = TieredKV(_config(geom, host_pages=1, disk=disk), clock=FakeClock())
    _fill(tkv, "a", 8, gen)
    assert tkv.kv.offload("a") > 0  # host full: to disk
    tkv.synchronize(timeout=10)
    assert tkv.kv.state_of("a") is RequestState.ON_DISK
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) >= 64 * geom.page_bytes
    tkv.close()


def test_close_removes_the_disk_directory_the_cache_created_and_only_that(geom, tmp_path):
    """A snippet with a fresh disk path leaves no preallocated slot file behind; a directory
    the caller made, or a reattach store meant for a later process, is kept."""
    gen = torch.Generator().manual_seed(15)
    fresh = tmp_path / "new" / "disk"
    _disk_run(geom, fresh, gen)
    assert not (tmp_path / "new").exists()
    made = tmp_path / "mine"
    made.mkdir()
    _disk_run(geom, made, gen)
    assert any(made.iterdir())  # the caller's directory and what it holds stay
    kept = tmp_path / "reattach"
    _disk_run(geom, kept, gen, on_start="reattach")
    assert any(kept.iterdir())


def test_an_allocate_refused_below_high_gets_room_from_make_room(geom):
    """32 pages, high 0.9: three 8-page requests hold 75%, so no pass offloads and a
    12-page allocate stays refused for ever; make_room offloads idle requests (not
    the kept one) until the pages are free, and the allocate then succeeds."""
    gen = torch.Generator().manual_seed(16)
    cfg = _config(geom, device_pages=32, host_pages=64,
                  controller=ControllerConfig(high=0.9, low=0.5, min_residency_s=0.0))
    with TieredKV(cfg, clock=FakeClock()) as tkv:
        data = {rid: _fill(tkv, rid, 32, gen) for rid in ("a", "b", "c")}
        tkv.add("d")
        for step in range(5):  # the loop without make_room: nothing ever frees room
            assert tkv.prepare(["a"], step) == ["a"]
            tkv.after_step(["a"])
            tkv.synchronize(timeout=10)
            assert not tkv.kv.allocate("d", 48)
        with pytest.raises(ValueError, match="nbytes"):
            tkv.make_room(-1)
        with pytest.raises(TypeError, match="keep"):
            tkv.make_room(8, keep="a")
        assert tkv.make_room(8 * geom.page_bytes) == ()  # 8 pages are free: nothing to do
        gone = tkv.make_room(12 * geom.page_bytes)
        assert len(gone) == 1 and "a" not in gone  # 'a' ran at the last after_step
        tkv.synchronize(timeout=10)
        assert tkv.kv.allocate("d", 48)
        tkv.check_integrity()
        for rid in gone:  # and each comes back with its bytes
            for step in range(50):
                if tkv.prepare([rid], step) == [rid]:
                    break
                tkv.after_step([])
                tkv.synchronize(timeout=10)
                if tkv.knows("d"):
                    tkv.remove("d")  # room for the one coming back
            for layer, (k, v) in enumerate(data[rid]):
                got_k, got_v = tkv.kv.read(rid, layer)
                assert torch.equal(got_k, k) and torch.equal(got_v, v)
        tkv.check_integrity()


@pytest.mark.parametrize("options, error, match", [
    ({"copy_workers": 0}, ValueError, r"copy_workers must be an int >= 1, got 0"),
    ({"io_workers": True}, ValueError, r"io_workers must be an int >= 1, got True"),
    ({"staging": 3}, ValueError, r"staging must be a StagingConfig or None"),
    ({"layerwise_reload": 1}, ValueError, r"layerwise_reload must be a bool, got 1"),
    ({"layer_wait_timeout_s": float("nan")}, ValueError, r"layer_wait_timeout_s"),
    ({"stream_window_pages": 3}, ValueError, r"stream_window_pages and stream_buffer_pages"),
    ({"stream_window_pages": 5, "stream_buffer_pages": 3}, ValueError,
     r"must leave device pages for other requests \(device_pages=8\)"),
    ({"host_runtime": 3}, TypeError, r"host_runtime must be a HostRuntime"),
    ({"disk_store": 3}, TypeError, r"disk_store must be a DiskPageStore"),
])
def test_a_bad_cache_option_value_is_refused_by_the_config_naming_it(geom, options, error, match):
    """``TieredKVConfig(cache_options={"copy_workers": 0})`` was a valid config; only
    ``TieredKV(config)`` refused it, later and wherever the config was built. The values
    are now checked in ``__post_init__``, as the cache checks them."""
    with pytest.raises(error, match=r"^TieredKVConfig\.cache_options: .*" + match):
        _config(geom, cache_options=options)


def test_good_cache_option_values_still_make_a_config_and_a_cache(geom):
    cfg = _config(geom, cache_options={"copy_workers": 1, "layerwise_reload": True,
                                       "stream_window_pages": 2, "stream_buffer_pages": 2})
    with TieredKV(cfg) as tkv:
        assert tkv.kv.layerwise_reload and tkv.kv.stream_window_pages == 2
        tkv.check_integrity()
