"""``tiering.core.validate``: the one set of config-field checks, and the configs using it."""

from __future__ import annotations

import math
import re

import pytest

from tiering.coldtier.breaker import BreakerConfig
from tiering.coldtier.lease import LeaseConfig
from tiering.coldtier.sweeper import SweeperConfig
from tiering.core.staging import StagingConfig
from tiering.core.validate import check_fields, check_int, check_number, check_timeout


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_check_int_accepts_ints_at_or_above_the_minimum(value):
    check_int("C", "f", value, 1)


@pytest.mark.parametrize("value", [0, -3, True, 1.0, "2", None])
def test_check_int_refuses_by_name(value):
    with pytest.raises(ValueError, match=rf"^C\.f must be an int >= 1, got {value!r}$"):
        check_int("C", "f", value, 1)


@pytest.mark.parametrize(
    "value,kw",
    [(0.5, {}), (3, {}), (0, {"zero_ok": True}), (0.0, {"zero_ok": True}), (1, {"maximum": 1})],
)
def test_check_number_accepts(value, kw):
    check_number("C", "f", value, **kw)


@pytest.mark.parametrize(
    "value,kw,want",
    [
        (0, {}, "must be a number > 0"),
        (-1.0, {"zero_ok": True}, "must be a number >= 0"),
        (math.nan, {}, "must be a number > 0"),
        (math.nan, {"zero_ok": True}, "must be a number >= 0"),
        (True, {}, "must be a number > 0"),
        ("1", {}, "must be a number > 0"),
        (1.5, {"maximum": 1}, "must be a number > 0 and <= 1"),
    ],
)
def test_check_number_refuses_by_name(value, kw, want):
    with pytest.raises(ValueError, match="^C\\.f " + want) as err:
        check_number("C", "f", value, **kw)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: StagingConfig(pages=True), "StagingConfig.pages"),
        (lambda: StagingConfig(timeout_s=0), "StagingConfig.timeout_s"),
        (lambda: LeaseConfig(ttl_s=True), "LeaseConfig.ttl_s"),
        (lambda: LeaseConfig(safety_s=math.nan), "LeaseConfig.safety_s"),
        (lambda: BreakerConfig(failure_threshold=True), "BreakerConfig.failure_threshold"),  # took True before
        (lambda: BreakerConfig(cooldown_s=-1), "BreakerConfig.cooldown_s"),
        (lambda: SweeperConfig(cap_bytes=False), "SweeperConfig.cap_bytes"),
        (lambda: SweeperConfig(cap_bytes=10, low_fraction=1.5), "SweeperConfig.low_fraction"),
    ],
)
def test_configs_refuse_bad_fields_by_name(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_configs_keep_their_defaults_valid():
    staging = StagingConfig()
    assert (staging.buffers, staging.pages, staging.timeout_s) == (4, 16, 10.0)
    for cfg in (LeaseConfig(), BreakerConfig(), SweeperConfig(cap_bytes=1 << 20)):
        # each default passes the record's own check again (a changed default that breaks
        # its own bound raises here)
        assert type(cfg)(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}) == cfg


def test_check_fields_names_the_record_and_the_first_bad_field():
    class Rec:
        a = 2
        b = 0
        c = -1.0

    check_fields(Rec(), ints={"a": 1})
    with pytest.raises(ValueError, match=r"^Rec\.b must be an int >= 1, got 0$"):
        check_fields(Rec(), ints={"a": 1, "b": 1}, zero_ok=("c",))
    with pytest.raises(ValueError, match=r"^Rec\.c must be a number >= 0, got -1\.0$"):
        check_fields(Rec(), ints={"a": 1}, numbers=("a",), zero_ok=("c",))
    with pytest.raises(ValueError, match=r"^Rec\.b must be a number > 0, got 0$"):
        check_fields(Rec(), numbers=("b",))


@pytest.mark.parametrize("value", [0, 0.0, 1, 2.5, 3600])
def test_check_timeout_accepts_finite_seconds(value):
    assert check_timeout("thing.wait", value) == float(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, -0.5, True, False, "1",
                                   None, [1]])
def test_check_timeout_refuses_unbounded_or_odd_waits_by_name(value):
    with pytest.raises(ValueError, match=r"thing\.wait: timeout must be a finite number") as err:
        check_timeout("thing.wait", value)
    assert repr(value) in str(err.value)


# -- durations that are waited: never longer than the platform's longest wait ----------------

LONG = 1e10  # finite, but past threading.TIMEOUT_MAX (about 9.2e9 s): a wait raised OverflowError


def _cache(tmp_path, **kw):
    import torch
    from tiering.resources.kv_cache import PagedKVCache
    from tiering.resources.kv_geometry import KVGeometry

    geom = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=4)
    kv = PagedKVCache(geom, device_pages=8, host_pages=8, layerwise_reload=True, **kw)
    kv.ingest_request("a")
    assert kv.allocate("a", 6)
    k = torch.randn(6, 1, 4).to(geom.dtype)
    for layer in range(2):
        kv.write("a", layer, 0, k, k)
    return kv, k


def test_a_wait_longer_than_the_platform_takes_is_refused_by_name_and_changes_nothing(tmp_path):
    """``synchronize(1e10)``, ``wait_layer(..., 1e10)``, ``cleanup(1e10)`` passed the
    timeout check (finite, >= 0) and then raised OverflowError ("timestamp out of range
    for platform time_t") from inside the wait, naming nothing."""
    import torch

    from tiering.core.validate import MAX_WAIT_S

    kv, k = _cache(tmp_path)
    try:
        assert kv.offload("a") > 0
        for call, what in ((lambda: kv.synchronize(LONG), "synchronize"),
                           (lambda: kv.cleanup(LONG), "cleanup")):
            with pytest.raises(ValueError, match=rf"^{what}: timeout 10000000000.0 s is longer "
                                                 r"than the longest wait the platform takes"):
                call()
        kv.synchronize(MAX_WAIT_S)  # the longest one is taken, and the copy lands
        assert kv.state_of("a").value == "on_host"
        assert kv.reload("a")
        with pytest.raises(ValueError, match=r"wait_layer\('a'\): timeout 10000000000.0 s is"):
            kv.wait_layer("a", 1, LONG)
        assert kv.wait_layer("a", 1, MAX_WAIT_S)
        kv.synchronize()
        assert torch.equal(kv.read("a", 1)[0], k)
        kv.check_integrity()
    finally:
        kv.close()


@pytest.mark.parametrize("build, name", [
    (lambda tmp: StagingConfig(timeout_s=LONG), "StagingConfig.timeout_s"),
    (lambda tmp: LeaseConfig(ttl_s=3 * LONG, renew_every_s=LONG), "LeaseConfig.renew_every_s"),
    (lambda tmp: _disk_config(tmp, io_timeout_s=LONG), "DiskConfig.io_timeout_s"),
    (lambda tmp: _poller(LONG), "PressurePoller.interval_s"),
    (lambda tmp: _cache(tmp, layer_wait_timeout_s=LONG), "layer_wait_timeout_s: timeout"),
    (lambda tmp: _queue().wait_idle(LONG), "BlockQueue.wait_idle: timeout_s"),
    (lambda tmp: _fault_plan(LONG), "FaultPlan.slow_seconds"),
])
def test_a_waited_duration_past_the_platforms_longest_wait_is_refused_where_it_is_given(
        tmp_path, build, name):
    """Each of these was taken, and the first wait on it (a staging buffer, a lease renewal,
    a disk operation, the poller's sleep, a layer) raised OverflowError, in a worker thread
    for the poller (which then died: its pressure never moved again)."""
    with pytest.raises(ValueError, match=rf"{re.escape(name)} 10000000000.0 s is longer than "
                                         r"the longest wait the platform takes"):
        build(tmp_path)


def test_a_staging_timeout_must_be_finite():
    with pytest.raises(ValueError, match=r"StagingConfig.timeout_s must be finite, got inf"):
        StagingConfig(timeout_s=math.inf)  # a wait for ever: every wait is bounded
    assert StagingConfig(timeout_s=5.0).timeout_s == 5.0


def _disk_config(tmp_path, **kw):
    from tiering.disk import DiskConfig

    return DiskConfig(path=tmp_path / "d", capacity_bytes=1 << 20, **kw)


def _poller(interval_s):
    from tiering.control.pressure import PressurePoller
    from tiering.testing import ScriptedFraction

    return PressurePoller(ScriptedFraction(0.5), interval_s=interval_s)


def _queue():
    from obstore.store import MemoryStore

    from tiering.coldtier import BlockQueue, SharedBlockStore
    from tiering.coldtier.trust import TrustConfig

    return BlockQueue(SharedBlockStore(MemoryStore(), b"r" * 16, b"g",
                                       trust=TrustConfig(secret=bytes(range(32)))))


def _fault_plan(slow_seconds):
    from tiering.disk.faults import FaultPlan

    return FaultPlan(slow_seconds=slow_seconds)


# -- checked configs travel: pickled (to a worker process) and deep-copied ---------------------


def _configs():
    from tiering.resources.kv_geometry import KVGeometry

    from tiering.coldtier import SharedTierConfig, TrustConfig
    from tiering.disk import DiskConfig
    from tiering.tiered import TieredKVConfig

    trust = TrustConfig(secret=bytes(range(32)))
    options = {"endpoint": "http://127.0.0.1:9", "client_kwargs": {"region_name": "r1"}}
    geom = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=4)
    return {
        "TieredKVConfig": TieredKVConfig(geometry=geom, cache_options={"copy_workers": 1}),
        "DiskConfig": DiskConfig(path="s3://bucket/prefix", capacity_bytes=1 << 20,
                                 storage_options=options, trust=trust),
        "SharedTierConfig": SharedTierConfig(url="s3://bucket/prefix", storage_options=options,
                                             trust=trust),
    }


@pytest.mark.parametrize("name", ["TieredKVConfig", "DiskConfig", "SharedTierConfig"])
def test_a_checked_config_pickles_and_deep_copies_and_stays_read_only(name):
    """These configs kept their mapping (cache_options, storage_options) as a
    MappingProxyType, which cannot be pickled: a config could not be sent to a worker
    process, nor deep-copied ("cannot pickle 'mappingproxy' object")."""
    import copy
    import pickle

    config = _configs()[name]
    field = "cache_options" if name == "TieredKVConfig" else "storage_options"
    for back in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert back == config and dict(getattr(back, field)) == dict(getattr(config, field))
    held = getattr(config, field)
    with pytest.raises(TypeError):
        held["copy_workers"] = 2  # what was checked is what is used
    with pytest.raises(AttributeError):
        held._data = {}
    if name != "TieredKVConfig":  # a nested mapping is read-only too
        with pytest.raises(TypeError):
            held["client_kwargs"]["region_name"] = "elsewhere"


@pytest.mark.parametrize("build, name", [
    (lambda tmp, n: _cache(tmp, copy_workers=n), "PagedKVCache: copy_workers"),
    (lambda tmp, n: _cache(tmp, io_workers=n), "PagedKVCache: io_workers"),
    (lambda tmp, n: _disk_config(tmp, io_threads=n), "DiskConfig.io_threads"),
    (lambda tmp, n: _cold_config(n), "ColdTierConfig.io_threads"),
])
def test_a_thread_count_past_what_one_pool_may_start_is_refused_by_name(tmp_path, build, name):
    """copy_workers=10**7 started building ten million threads (and DiskConfig.io_threads
    as many read buffers) before the platform refused one, exhausting the process first."""
    from tiering.core.validate import MAX_WORKER_THREADS

    with pytest.raises(ValueError, match=rf"{re.escape(name)} {MAX_WORKER_THREADS + 1} is more "
                                         r"worker threads than one pool may start \(at most 64\)"):
        build(tmp_path, MAX_WORKER_THREADS + 1)
    made = build(tmp_path, 3)  # the control
    close = getattr(made[0] if isinstance(made, tuple) else made, "close", None)
    if callable(close):
        close()


def _cold_config(io_threads):
    from tiering.coldtier import ColdTierConfig

    return ColdTierConfig(io_threads=io_threads)
