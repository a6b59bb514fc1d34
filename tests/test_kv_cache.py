"""PagedKVCache on the CPU: round trips, in-flight interleavings, bad input, integrity."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import assert_same, fill, random_kv, reload_all_and_check
from tiering.resources.base import ResourceReqConfig, ResourceStep, StepContext
from tiering.resources.kv_cache import RequestLost, UnknownRequest
from tiering.resources.kv_geometry import KVGeometry

from tiering.core.transfer import CopyFault
from tiering.types import IllegalTransition, RequestState, Tier


@pytest.fixture
def cache(kv):
    """A verifying cache with room to spare (closed by the ``kv`` factory)."""
    return kv(device_pages=32, host_pages=32, verify=True)


class Gate:
    """A copy fault hook that holds copies until released, so tests can act
    while a transfer is provably in flight (no sleeps)."""

    def __init__(self):
        self.open = threading.Event()
        self.entered = threading.Semaphore(0)

    def __call__(self, kind):
        self.entered.release()
        assert self.open.wait(10), "gate never opened"


@pytest.fixture
def gated(kv):
    """``gated(**kw)``: a cache (from ``kv``) whose copies wait at a fresh ``Gate``, and
    the gate; every gate is opened at teardown, before the caches are closed."""
    gates = []

    def make(**kw):
        gate = Gate()
        gates.append(gate)
        return kv(copy_fault_hook=gate, **kw), gate

    yield make
    for gate in gates:
        gate.open.set()


def test_round_trip_many_requests(cache):
    gen = torch.Generator().manual_seed(1)
    data = {f"r{i}": fill(cache, f"r{i}", gen, 3 + 5 * i) for i in range(5)}
    cache.check_integrity()
    for rid in data:
        assert cache.offload(rid) == cache.geometry.page_bytes * cache.geometry.pages_for(cache.num_tokens(rid))
        cache.check_integrity()
    cache.synchronize(10)
    cache.check_integrity()
    assert all(cache.tier_of(r) is Tier.HOST for r in data)
    assert cache.device_used_bytes() == 0
    reload_all_and_check(cache, data)


def test_interleaved_while_copies_in_flight(gated):
    cache, gate = gated(device_pages=24, host_pages=24)
    gen = torch.Generator().manual_seed(2)
    a = fill(cache, "a", gen, 9)
    b = fill(cache, "b", gen, 7)
    c = fill(cache, "c", gen, 5)
    cache.offload("a")
    cache.offload("b")
    assert gate.entered.acquire(timeout=10)
    cache.check_integrity()
    assert cache.state_of("a") is RequestState.OFFLOADING
    # device slots of an offloading request are still held
    assert cache.device_pool.used_pages == 3 + 2 + 2
    with pytest.raises(IllegalTransition, match="'a' is offloading"):
        cache.offload("a")
    with pytest.raises(IllegalTransition):
        cache.read("a", 0)
    assert not cache.admit(ResourceStep("a"), StepContext())
    cache.remove_request("c")  # a resident request, nothing in flight
    cache.remove_request("b")  # in flight or queued: its slots come back later
    cache.check_integrity()
    gate.open.set()
    cache.synchronize(10)
    cache.check_integrity()
    assert cache.host_pool.used_pages == 3 and cache.device_pool.used_pages == 0
    assert cache.reload("a")
    cache.synchronize(10)
    assert_same(cache, "a", a)
    del b, c
    cache.remove_request("a")
    cache.check_integrity()
    assert cache.device_pool.used_pages == 0 and cache.host_pool.used_pages == 0


def test_reload_refused_when_device_full(kv):
    cache = kv(device_pages=4, host_pages=8)
    gen = torch.Generator().manual_seed(3)
    a = fill(cache, "a", gen, 16)  # all 4 pages
    cache.offload("a")
    cache.synchronize(5)
    b = fill(cache, "b", gen, 4)
    assert cache.reload("a") is False  # needs 4, 3 free
    assert cache.state_of("a") is RequestState.ON_HOST
    assert cache.stats.reload_refusals == 1
    cache.check_integrity()
    cache.remove_request("b")
    assert cache.reload("a")
    cache.synchronize(5)
    assert_same(cache, "a", a)
    del b


def test_allocate_refused_changes_nothing(kv):
    cache = kv(device_pages=3, host_pages=3)
    cache.ingest_request("a")
    assert cache.allocate("a", 8)
    assert cache.allocate("a", 20) is False
    assert cache.num_tokens("a") == 8 and len(cache.page_table("a")) == 2
    cache.check_integrity()


def test_offload_refused_when_host_full_and_no_disk(kv):
    cache = kv(device_pages=8, host_pages=1)
    gen = torch.Generator().manual_seed(4)
    fill(cache, "a", gen, 8)
    assert cache.reclaimable("a") == 0
    assert cache.offload("a") == 0
    assert cache.state_of("a") is RequestState.RESIDENT
    assert cache.stats.offload_refusals == 1
    cache.check_integrity()


def test_growth_then_write_read(cache):
    gen = torch.Generator().manual_seed(5)
    cache.ingest_request("g")
    written = []
    for t in range(11):
        assert cache.allocate("g", t + 1)
        step = random_kv(gen, cache.geometry, 1)
        for layer, (k, v) in enumerate(step):
            cache.write("g", layer, t, k, v)
        written.append(step)
        cache.check_integrity()
    for layer in range(cache.geometry.num_layers):
        k, v = cache.read("g", layer)
        assert torch.equal(k, torch.cat([w[layer][0] for w in written]))
        assert torch.equal(v, torch.cat([w[layer][1] for w in written]))


def test_copy_fault_on_offload_is_survived(kv):
    faults = {"d2h": 1}

    def hook(kind):
        if faults.get(kind, 0) > 0:
            faults[kind] -= 1
            raise CopyFault(f"injected {kind} failure")

    cache = kv(device_pages=8, host_pages=8, copy_fault_hook=hook)
    gen = torch.Generator().manual_seed(6)
    a = fill(cache, "a", gen, 7)
    cache.offload("a")
    cache.synchronize(5)
    assert cache.state_of("a") is RequestState.RESIDENT
    assert cache.stats.offload_failures == 1
    assert cache.host_pool.used_pages == 0
    cache.check_integrity()
    assert_same(cache, "a", a)
    cache.offload("a")
    cache.synchronize(5)
    assert cache.state_of("a") is RequestState.ON_HOST


def test_verify_detects_host_corruption_and_only_that_request_is_lost(kv):
    cache = kv(device_pages=8, host_pages=8, verify=True)
    gen = torch.Generator().manual_seed(7)
    a = fill(cache, "a", gen, 5)
    b = fill(cache, "b", gen, 5)
    cache.offload("a")
    cache.offload("b")
    cache.synchronize(5)
    slot = cache._reqs["a"].host[1]
    cache._host[slot].view(torch.uint8).view(-1)[3] ^= 0x40  # flip one bit
    cache.reload("a")
    cache.reload("b")
    cache.synchronize(5)
    assert cache.state_of("a") is RequestState.LOST
    assert "checksum" in cache.lost_reason("a")
    assert cache.take_lost() == [("a", cache.lost_reason("a"))]
    with pytest.raises(RequestLost, match="'a' is lost"):
        cache.read("a", 0)
    assert_same(cache, "b", b)
    cache.check_integrity()
    assert cache.device_pool.used_pages == 2  # only b's pages
    del a


def test_retention_priority_becomes_offload_priority(kv):
    t = [0.0]
    cache = kv(device_pages=4, host_pages=4, clock=lambda: t[0])
    cache.ingest_request("keep", ResourceReqConfig(retention_priority=90, retention_expiry_s=5))
    cache.ingest_request("drop", ResourceReqConfig(retention_priority=10))
    cache.ingest_request("plain", None)
    assert cache.get_offload_priority("drop") > cache.get_offload_priority("plain")
    assert cache.get_offload_priority("plain") > cache.get_offload_priority("keep")
    t[0] = 5.0  # retention expired: back to the default
    assert cache.get_offload_priority("keep") == cache.get_offload_priority("plain")


def test_admit_reports_not_ready_until_reload_lands(gated):
    cache, gate = gated(device_pages=8, host_pages=8)
    gen = torch.Generator().manual_seed(8)
    a = fill(cache, "a", gen, 6)
    gate.open.set()
    cache.offload("a")
    cache.synchronize(5)
    gate.open.clear()
    assert cache.reload("a")
    assert gate.entered.acquire(timeout=10)
    out = cache.admit(ResourceStep("a"), StepContext())
    assert not out and out.reason == "reloading"
    assert cache.is_offloaded("a") is False and cache.can_reload("a") is False
    gate.open.set()
    cache.synchronize(5)
    assert cache.admit(ResourceStep("a"), StepContext())
    assert_same(cache, "a", a)


# -- bad input: a clear error, nothing changes ---------------------------------------


def snapshot(kv):
    """Everything a caller can see of the cache: each request's state, tokens and loss
    reason, and which slots of each pool every owner holds (the pools' own ledgers)."""
    return (
        {rid: (kv.state_of(rid), kv.num_tokens(rid), kv.lost_reason(rid))
         for rid in kv.requests()},
        kv.device_pool.holdings(),
        kv.host_pool.holdings(),
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
def test_bad_input_raises_and_changes_nothing(kv, call, match):
    cache = kv(device_pages=8, host_pages=8)
    gen = torch.Generator().manual_seed(9)
    fill(cache, "r", gen, 8)
    fill(cache, "h", gen, 4)
    cache.offload("h")
    cache.synchronize(5)
    before = snapshot(cache)
    with pytest.raises((ValueError, KeyError, IllegalTransition, TypeError), match=match):
        call(cache)
    assert snapshot(cache) == before
    cache.check_integrity()


def test_unknown_request_is_a_key_error_with_a_readable_message(cache):
    with pytest.raises(UnknownRequest) as info:
        cache.offload("ghost")
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


def test_host_tier_smaller_than_one_page(kv):
    with pytest.raises(ValueError, match="host_pages"):
        kv(device_pages=4, host_pages=0)
    with pytest.raises(ValueError, match="device_pages"):
        kv(device_pages=0, host_pages=4)


@pytest.mark.parametrize("arg", ["device_pages", "host_pages"])
def test_a_tier_too_large_to_allocate_names_its_argument_and_size(kv, arg):
    """Before, a tier larger than memory raised a bare MemoryError (an empty message)."""
    threads = threading.active_count()
    with pytest.raises(MemoryError, match=rf"{arg}=10,000,000,000,000 \(.* GiB .*\) could not"):
        kv(**{"device_pages": 4, "host_pages": 4, arg: 10**13})
    assert threading.active_count() == threads  # the refused cache left nothing running


@pytest.mark.parametrize("arg", ["device_pages", "host_pages"])
@pytest.mark.parametrize("pages", [2**63, 2**70])
def test_a_tier_past_the_address_space_names_its_argument_and_size(kv, arg, pages):
    """A page count past the address space raised a bare OverflowError ("Python int too
    large to convert to C ssize_t"), naming nothing."""
    threads = threading.active_count()
    with pytest.raises(MemoryError, match=rf"{arg}={pages:,} \(.* GiB .*\) could not be "
                                          r"allocated: OverflowError"):
        kv(**{"device_pages": 4, "host_pages": 4, arg: pages})
    assert threading.active_count() == threads


def test_a_staging_ring_too_large_to_allocate_names_itself(kv, tmp_path):
    """A ring of 2**62 pages raised torch's RuntimeError ("Storage size calculation
    overflowed"), naming nothing."""
    from tiering.core.staging import StagingConfig
    from tiering.disk import DiskConfig

    with pytest.raises(MemoryError, match=r"staging buffers x pages=18,446,744,073,709,551,616 "
                                          r"\(.* GiB of host memory\) could not be allocated"):
        kv(device_pages=4, host_pages=4, stage_disk_io=True, staging=StagingConfig(pages=2**62),
           disk=DiskConfig(path=tmp_path / "d", capacity_bytes=1 << 20))
    assert not tmp_path.joinpath("d").exists()  # the directory the refused cache made is gone


def test_a_cache_that_fails_to_start_leaves_no_disk_files_and_keeps_reattachable_data(
        kv, tmp_path):
    """A cache whose constructor failed after its disk tier had opened left the tier's
    directory behind, with a slot file preallocated to capacity_bytes. Now what that start
    created is removed; what an earlier process left to reattach is kept, byte for byte."""
    from tiering.core.staging import StagingConfig
    from tiering.disk import DiskConfig

    too_big = dict(stage_disk_io=True, staging=StagingConfig(pages=2**62))
    for made in (tmp_path / "new", tmp_path / "new" / "deeper"):
        with pytest.raises(MemoryError):
            kv(device_pages=4, host_pages=1, **too_big,
               disk=DiskConfig(path=made, capacity_bytes=64 * kv.geometry.page_bytes))
        assert not made.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MemoryError):
        kv(device_pages=4, host_pages=1, **too_big,
           disk=DiskConfig(path=empty, capacity_bytes=64 * kv.geometry.page_bytes))
    assert list(empty.iterdir()) == []  # a directory that was there stays, emptied of ours

    kept = DiskConfig(path=tmp_path / "kept", capacity_bytes=64 * kv.geometry.page_bytes,
                      on_start="reattach")
    first = kv(device_pages=4, host_pages=1, disk=kept)
    data = fill(first, "a", torch.Generator().manual_seed(5), 7)
    assert first.offload("a") > 0
    first.synchronize()
    assert first.state_of("a") is RequestState.ON_DISK
    first.close()
    with pytest.raises(MemoryError):
        kv(device_pages=4, host_pages=1, disk=kept, **too_big)
    again = kv(device_pages=4, host_pages=1, disk=kept)
    assert again.requests() == ["a"] and again.reload("a")
    again.synchronize()
    assert_same(again, "a", data)
    again.check_integrity()


def test_ingest_is_idempotent(cache):
    cfg = ResourceReqConfig(retention_priority=50)
    cache.ingest_request("x", cfg)
    cache.ingest_request("x", ResourceReqConfig(retention_priority=50))
    assert cache.requests() == ["x"]


def test_cuda_device_refused_without_cuda(kv):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        kv(device="cuda:0")


def test_synchronize_times_out_naming_what_is_in_flight(gated):
    cache, gate = gated(device_pages=8, host_pages=8)
    gen = torch.Generator().manual_seed(10)
    fill(cache, "slow", gen, 6)
    cache.offload("slow")
    assert gate.entered.acquire(timeout=10)
    with pytest.raises(TimeoutError, match="slow"):
        cache.synchronize(timeout=0.05)
    assert cache.state_of("slow") is RequestState.OFFLOADING
    cache.check_integrity()
    gate.open.set()
    cache.synchronize(10)
    assert cache.state_of("slow") is RequestState.ON_HOST


def test_layer_view_through_the_page_table_matches_read(cache):
    gen = torch.Generator().manual_seed(21)
    data = fill(cache, "p", gen, 11)
    fill(cache, "q", gen, 5)  # another request's pages in between
    table = torch.tensor(cache.page_table("p"))
    for layer, (k, v) in enumerate(data):
        k_pages, v_pages = cache.layer_view(layer)
        assert k_pages.shape[0] == cache.device_pool.num_pages  # a view over the whole pool
        shape = (-1, cache.geometry.num_kv_heads, cache.geometry.head_dim)
        assert torch.equal(k_pages[table].reshape(shape)[:11], k)
        assert torch.equal(v_pages[table].reshape(shape)[:11], v)
    with pytest.raises(ValueError, match="layer 5 out of range"):
        cache.layer_view(5)


def test_admit_cancels_an_offload_that_has_not_started(gated):
    cache, gate = gated(device_pages=8, host_pages=8, copy_workers=1)
    gen = torch.Generator().manual_seed(22)
    fill(cache, "a", gen, 4)
    b = fill(cache, "b", gen, 6)
    cache.offload("a")
    assert gate.entered.acquire(timeout=10)  # a's copy holds the only worker
    cache.offload("b")  # queued behind it
    assert cache.host_pool.used_pages == 1 + 2
    assert cache.admit(ResourceStep("b"), StepContext())
    assert cache.state_of("b") is RequestState.RESIDENT
    assert cache.stats.offloads_cancelled == 1
    assert cache.host_pool.used_pages == 1
    cache.check_integrity()
    out = cache.admit(ResourceStep("a"), StepContext())  # running copy: not cancelled
    assert not out and out.reason == "offloading"
    gate.open.set()
    cache.synchronize(10)
    assert cache.state_of("a") is RequestState.ON_HOST
    assert_same(cache, "b", b)
    cache.check_integrity()


_ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


@pytest.mark.parametrize("dtype", _ALL_DTYPES, ids=str)
def test_every_dtype_a_geometry_takes_round_trips_bit_exact_and_the_rest_are_refused(dtype, tmp_path):
    """A geometry took any torch dtype, so a quantized or sub-byte one (torch.qint8,
    torch.int4) built a cache whose first write raised inside torch (an internal assert).
    Now a dtype is refused by name at the geometry, or its random bytes come back exactly
    from the host and the disk."""
    from tiering.resources.kv_cache import PagedKVCache

    from tiering.disk import DiskConfig

    try:
        geom = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=4, dtype=dtype)
    except ValueError as err:
        assert f"KVGeometry.dtype {dtype} cannot hold KV pages" in str(err)
        name = str(dtype).removeprefix("torch.")  # only quantized and sub-byte ints refused
        assert name.startswith(("qint", "quint")) or name in {
            *(f"int{b}" for b in range(1, 8)), *(f"uint{b}" for b in range(1, 8))}, dtype
        return
    gen = torch.Generator().manual_seed(7)
    width = 4 * geom.element_bytes
    kv = PagedKVCache(geom, device_pages=8, host_pages=2,
                      disk=DiskConfig(path=tmp_path / "d", capacity_bytes=16 * geom.page_bytes))
    try:
        wrote = {}
        for rid, n in (("a", 7), ("b", 5)):
            kv.ingest_request(rid)
            assert kv.allocate(rid, n)
            top = 2 if dtype is torch.bool else 256  # a bool byte other than 0 or 1 is not a bool
            raw = torch.randint(0, top, (2, 2, n, 2, width), generator=gen, dtype=torch.uint8)
            for layer in range(2):
                kv.write(rid, layer, 0, raw[layer, 0].view(dtype), raw[layer, 1].view(dtype))
            wrote[rid] = raw
        for rid, tier in (("a", RequestState.ON_HOST), ("b", RequestState.ON_DISK)):
            assert kv.offload(rid) > 0
            kv.synchronize()
            assert kv.state_of(rid) is tier
        for rid in wrote:
            assert kv.reload(rid)
            kv.synchronize()
            assert kv.state_of(rid) is RequestState.RESIDENT
            for layer in range(2):
                k, v = kv.read(rid, layer)
                assert torch.equal(k.view(torch.uint8), wrote[rid][layer, 0]), (rid, layer)
                assert torch.equal(v.view(torch.uint8), wrote[rid][layer, 1]), (rid, layer)
        kv.check_integrity()
    finally:
        kv.close()
