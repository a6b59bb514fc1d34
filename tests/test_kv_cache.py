"""PagedKVCache on the CPU: round trips, in-flight interleavings, bad input, integrity."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import assert_same, fill, random_kv, reload_all_and_check

from resources.base import ResourceReqConfig, ResourceStep, StepContext
from resources.kv_cache import PagedKVCache, RequestLost, UnknownRequest
from resources.kv_geometry import KVGeometry
from tiering.core.transfer import CopyFault
from tiering.types import IllegalTransition, RequestState, Tier


@pytest.fixture
def kv(geom):
    cache = PagedKVCache(geom, device_pages=32, host_pages=32, verify=True)
    yield cache
    cache.close()


class Gate:
    """A copy fault hook that holds copies until released, so tests can act
    while a transfer is provably in flight (no sleeps)."""

    def __init__(self):
        self.open = threading.Event()
        self.entered = threading.Semaphore(0)

    def __call__(self, kind):
        self.entered.release()
        assert self.open.wait(10), "gate never opened"


def test_round_trip_many_requests(kv):
    gen = torch.Generator().manual_seed(1)
    data = {f"r{i}": fill(kv, f"r{i}", gen, 3 + 5 * i) for i in range(5)}
    kv.check_integrity()
    for rid in data:
        assert kv.offload(rid) == kv.geometry.page_bytes * kv.geometry.pages_for(kv.num_tokens(rid))
        kv.check_integrity()
    kv.synchronize(10)
    kv.check_integrity()
    assert all(kv.tier_of(r) is Tier.HOST for r in data)
    assert kv.device_used_bytes() == 0
    reload_all_and_check(kv, data)


def test_interleaved_while_copies_in_flight(geom):
    gate = Gate()
    kv = PagedKVCache(geom, device_pages=24, host_pages=24, copy_fault_hook=gate)
    try:
        gen = torch.Generator().manual_seed(2)
        a = fill(kv, "a", gen, 9)
        b = fill(kv, "b", gen, 7)
        c = fill(kv, "c", gen, 5)
        kv.offload("a")
        kv.offload("b")
        assert gate.entered.acquire(timeout=10)
        kv.check_integrity()
        assert kv.state_of("a") is RequestState.OFFLOADING
        # device slots of an offloading request are still held
        assert kv.device_pool.used_pages == 3 + 2 + 2
        with pytest.raises(IllegalTransition, match="'a' is offloading"):
            kv.offload("a")
        with pytest.raises(IllegalTransition):
            kv.read("a", 0)
        assert not kv.admit(ResourceStep("a"), StepContext())
        kv.remove_request("c")  # a resident request, nothing in flight
        kv.remove_request("b")  # in flight or queued: its slots come back later
        kv.check_integrity()
        gate.open.set()
        kv.synchronize(10)
        kv.check_integrity()
        assert kv.host_pool.used_pages == 3 and kv.device_pool.used_pages == 0
        assert kv.reload("a")
        kv.synchronize(10)
        assert_same(kv, "a", a)
        del b, c
        kv.remove_request("a")
        kv.check_integrity()
        assert kv.device_pool.used_pages == 0 and kv.host_pool.used_pages == 0
    finally:
        gate.open.set()
        kv.close()


def test_reload_refused_when_device_full(geom):
    kv = PagedKVCache(geom, device_pages=4, host_pages=8)
    try:
        gen = torch.Generator().manual_seed(3)
        a = fill(kv, "a", gen, 16)  # all 4 pages
        kv.offload("a")
        kv.synchronize(5)
        b = fill(kv, "b", gen, 4)
        assert kv.reload("a") is False  # needs 4, 3 free
        assert kv.state_of("a") is RequestState.ON_HOST
        assert kv.stats.reload_refusals == 1
        kv.check_integrity()
        kv.remove_request("b")
        assert kv.reload("a")
        kv.synchronize(5)
        assert_same(kv, "a", a)
        del b
    finally:
        kv.close()


def test_allocate_refused_changes_nothing(geom):
    kv = PagedKVCache(geom, device_pages=3, host_pages=3)
    try:
        kv.ingest_request("a")
        assert kv.allocate("a", 8)
        assert kv.allocate("a", 20) is False
        assert kv.num_tokens("a") == 8 and len(kv.page_table("a")) == 2
        kv.check_integrity()
    finally:
        kv.close()


def test_offload_refused_when_host_full_and_no_disk(geom):
    kv = PagedKVCache(geom, device_pages=8, host_pages=1)
    try:
        gen = torch.Generator().manual_seed(4)
        fill(kv, "a", gen, 8)
        assert kv.reclaimable("a") == 0
        assert kv.offload("a") == 0
        assert kv.state_of("a") is RequestState.RESIDENT
        assert kv.stats.offload_refusals == 1
        kv.check_integrity()
    finally:
        kv.close()


def test_growth_then_write_read(kv):
    gen = torch.Generator().manual_seed(5)
    kv.ingest_request("g")
    written = []
    for t in range(11):
        assert kv.allocate("g", t + 1)
        step = random_kv(gen, kv.geometry, 1)
        for layer, (k, v) in enumerate(step):
            kv.write("g", layer, t, k, v)
        written.append(step)
        kv.check_integrity()
    for layer in range(kv.geometry.num_layers):
        k, v = kv.read("g", layer)
        assert torch.equal(k, torch.cat([w[layer][0] for w in written]))
        assert torch.equal(v, torch.cat([w[layer][1] for w in written]))


def test_copy_fault_on_offload_is_survived(geom):
    faults = {"d2h": 1}

    def hook(kind):
        if faults.get(kind, 0) > 0:
            faults[kind] -= 1
            raise CopyFault(f"injected {kind} failure")

    kv = PagedKVCache(geom, device_pages=8, host_pages=8, copy_fault_hook=hook)
    try:
        gen = torch.Generator().manual_seed(6)
        a = fill(kv, "a", gen, 7)
        kv.offload("a")
        kv.synchronize(5)
        assert kv.state_of("a") is RequestState.RESIDENT
        assert kv.stats.offload_failures == 1
        assert kv.host_pool.used_pages == 0
        kv.check_integrity()
        assert_same(kv, "a", a)
        kv.offload("a")
        kv.synchronize(5)
        assert kv.state_of("a") is RequestState.ON_HOST
    finally:
        kv.close()


def test_verify_detects_host_corruption_and_only_that_request_is_lost(geom):
    kv = PagedKVCache(geom, device_pages=8, host_pages=8, verify=True)
    try:
        gen = torch.Generator().manual_seed(7)
        a = fill(kv, "a", gen, 5)
        b = fill(kv, "b", gen, 5)
        kv.offload("a")
        kv.offload("b")
        kv.synchronize(5)
        slot = kv._reqs["a"].host[1]
        kv._host[slot].view(torch.uint8).view(-1)[3] ^= 0x40  # flip one bit
        kv.reload("a")
        kv.reload("b")
        kv.synchronize(5)
        assert kv.state_of("a") is RequestState.LOST
        assert "checksum" in kv.lost_reason("a")
        assert kv.take_lost() == [("a", kv.lost_reason("a"))]
        with pytest.raises(RequestLost, match="'a' is lost"):
            kv.read("a", 0)
        assert_same(kv, "b", b)
        kv.check_integrity()
        assert kv.device_pool.used_pages == 2  # only b's pages
        del a
    finally:
        kv.close()


def test_retention_priority_becomes_offload_priority(geom):
    t = [0.0]
    kv = PagedKVCache(geom, device_pages=4, host_pages=4, clock=lambda: t[0])
    try:
        kv.ingest_request("keep", ResourceReqConfig(retention_priority=90, retention_expiry_s=5))
        kv.ingest_request("drop", ResourceReqConfig(retention_priority=10))
        kv.ingest_request("plain", None)
        assert kv.get_offload_priority("drop") > kv.get_offload_priority("plain")
        assert kv.get_offload_priority("plain") > kv.get_offload_priority("keep")
        t[0] = 5.0  # retention expired: back to the default
        assert kv.get_offload_priority("keep") == kv.get_offload_priority("plain")
    finally:
        kv.close()


def test_admit_reports_not_ready_until_reload_lands(geom):
    gate = Gate()
    kv = PagedKVCache(geom, device_pages=8, host_pages=8, copy_fault_hook=gate)
    try:
        gen = torch.Generator().manual_seed(8)
        a = fill(kv, "a", gen, 6)
        gate.open.set()
        kv.offload("a")
        kv.synchronize(5)
        gate.open.clear()
        assert kv.reload("a")
        assert gate.entered.acquire(timeout=10)
        out = kv.admit(ResourceStep("a"), StepContext())
        assert not out and out.reason == "reloading"
        assert kv.is_offloaded("a") is False and kv.can_reload("a") is False
        gate.open.set()
        kv.synchronize(5)
        assert kv.admit(ResourceStep("a"), StepContext())
        assert_same(kv, "a", a)
    finally:
        gate.open.set()
        kv.close()


# -- bad input: a clear error, nothing changes ---------------------------------------


def snapshot(kv):
    return (
        {rid: (r.state, list(r.device), list(r.host), r.num_tokens) for rid, r in kv._reqs.items()},
        kv.device_pool.used_bytes,
        kv.host_pool.used_bytes,
    )


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda kv: kv.offload("nope"), "unknown request 'nope'"),
        (lambda kv: kv.reload("nope"), "unknown request 'nope'"),
        (lambda kv: kv.read("nope", 0), "unknown request 'nope'"),
        (lambda kv: kv.reclaimable("nope"), "unknown request 'nope'"),
        (lambda kv: kv.remove_request("nope"), "unknown request 'nope'"),
        (lambda kv: kv.ingest_request("r", ResourceReqConfig(retention_priority=1)), "different overrides"),
        (lambda kv: kv.reload("r"), "'r' is resident"),
        (lambda kv: kv.offload("h"), "'h' is on_host"),
        (lambda kv: kv.read("h", 0), "must be resident"),
        (lambda kv: kv.demote("r"), "'r' is resident"),
        (lambda kv: kv.drop("r"), "'r' is resident"),
        (lambda kv: kv.write("r", 0, 6, *random_kv(torch.Generator(), kv.geometry, 3)[0]), "past the 8"),
        (lambda kv: kv.write("r", 0, 0, torch.ones(2, 3, 8), torch.ones(2, 3, 8)), "must both be"),
        (lambda kv: kv.read("r", 2), "layer 2 out of range"),
        (lambda kv: kv.allocate("r", -1), "num_tokens"),
        (lambda kv: kv.allocate("h", 40), "allocate needs it resident"),
    ],
)
def test_bad_input_raises_and_changes_nothing(geom, call, match):
    kv = PagedKVCache(geom, device_pages=8, host_pages=8)
    try:
        gen = torch.Generator().manual_seed(9)
        fill(kv, "r", gen, 8)
        fill(kv, "h", gen, 4)
        kv.offload("h")
        kv.synchronize(5)
        before = snapshot(kv)
        with pytest.raises((ValueError, KeyError, IllegalTransition, TypeError), match=match):
            call(kv)
        assert snapshot(kv) == before
        kv.check_integrity()
    finally:
        kv.close()


def test_unknown_request_is_a_key_error_with_a_readable_message(kv):
    with pytest.raises(UnknownRequest) as info:
        kv.offload("ghost")
    assert str(info.value) == "unknown request 'ghost'"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=0, num_kv_heads=1, head_dim=1, page_tokens=1), "num_layers"),
        (dict(num_layers=1, num_kv_heads=-2, head_dim=1, page_tokens=1), "num_kv_heads"),
        (dict(num_layers=1, num_kv_heads=1, head_dim=0, page_tokens=1), "head_dim"),
        (dict(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=0), "page_tokens"),
        (dict(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=1, dtype="bf16"), "dtype"),
    ],
)
def test_bad_geometry(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVGeometry(**kwargs)


def test_host_tier_smaller_than_one_page(geom):
    with pytest.raises(ValueError, match="host_pages"):
        PagedKVCache(geom, device_pages=4, host_pages=0)
    with pytest.raises(ValueError, match="device_pages"):
        PagedKVCache(geom, device_pages=0, host_pages=4)


def test_ingest_is_idempotent(kv):
    cfg = ResourceReqConfig(retention_priority=50)
    kv.ingest_request("x", cfg)
    kv.ingest_request("x", ResourceReqConfig(retention_priority=50))
    assert kv.requests() == ["x"]


def test_cuda_device_refused_without_cuda(geom):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        PagedKVCache(geom, device="cuda:0")


def test_synchronize_times_out_naming_what_is_in_flight(geom):
    gate = Gate()
    kv = PagedKVCache(geom, device_pages=8, host_pages=8, copy_fault_hook=gate)
    try:
        gen = torch.Generator().manual_seed(10)
        fill(kv, "slow", gen, 6)
        kv.offload("slow")
        assert gate.entered.acquire(timeout=10)
        with pytest.raises(TimeoutError, match="slow"):
            kv.synchronize(timeout=0.05)
        assert kv.state_of("slow") is RequestState.OFFLOADING
        kv.check_integrity()
        gate.open.set()
        kv.synchronize(10)
        assert kv.state_of("slow") is RequestState.ON_HOST
    finally:
        gate.open.set()
        kv.close()


def test_layer_view_through_the_page_table_matches_read(kv):
    gen = torch.Generator().manual_seed(21)
    data = fill(kv, "p", gen, 11)
    fill(kv, "q", gen, 5)  # another request's pages in between
    table = torch.tensor(kv.page_table("p"))
    for layer, (k, v) in enumerate(data):
        k_pages, v_pages = kv.layer_view(layer)
        assert k_pages.shape[0] == kv.device_pool.num_pages  # a view over the whole pool
        shape = (-1, kv.geometry.num_kv_heads, kv.geometry.head_dim)
        assert torch.equal(k_pages[table].reshape(shape)[:11], k)
        assert torch.equal(v_pages[table].reshape(shape)[:11], v)
    with pytest.raises(ValueError, match="layer 5 out of range"):
        kv.layer_view(5)


def test_admit_cancels_an_offload_that_has_not_started(geom):
    gate = Gate()
    kv = PagedKVCache(geom, device_pages=8, host_pages=8, copy_workers=1, copy_fault_hook=gate)
    try:
        gen = torch.Generator().manual_seed(22)
        fill(kv, "a", gen, 4)
        b = fill(kv, "b", gen, 6)
        kv.offload("a")
        assert gate.entered.acquire(timeout=10)  # a's copy holds the only worker
        kv.offload("b")  # queued behind it
        assert kv.host_pool.used_pages == 1 + 2
        assert kv.admit(ResourceStep("b"), StepContext())
        assert kv.state_of("b") is RequestState.RESIDENT
        assert kv.stats.offloads_cancelled == 1
        assert kv.host_pool.used_pages == 1
        kv.check_integrity()
        out = kv.admit(ResourceStep("a"), StepContext())  # running copy: not cancelled
        assert not out and out.reason == "offloading"
        gate.open.set()
        kv.synchronize(10)
        assert kv.state_of("a") is RequestState.ON_HOST
        assert_same(kv, "b", b)
        kv.check_integrity()
    finally:
        gate.open.set()
        kv.close()
