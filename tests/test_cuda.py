"""CUDA-only checks: dedicated streams, compute-stream ordering, exact pinning.

Skipped on a machine without a CUDA device (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same, random_kv
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

pytestmark = pytest.mark.cuda

GEOM = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_tokens=16)


def fill(kv, rid, gen, tokens):
    """Ingest, allocate and write random KV on the cache's device; returns it (on the device)."""
    kv.ingest_request(rid, None)
    assert kv.allocate(rid, tokens)
    data = [(k.to(kv.device), v.to(kv.device)) for k, v in random_kv(gen, kv.geometry, tokens)]
    for layer, (k, v) in enumerate(data):
        kv.write(rid, layer, 0, k, v)
    return data


def test_round_trip_on_gpu(closing):
    kv = closing(PagedKVCache(GEOM, device="cuda:0", device_pages=64, host_pages=64, verify=True))
    gen = torch.Generator().manual_seed(1)
    data = {f"r{i}": fill(kv, f"r{i}", gen, 40 + 17 * i) for i in range(4)}
    for rid in data:
        assert kv.offload(rid)
    assert all(r.ok for r in kv.synchronize(30))
    for rid in data:
        assert kv.reload(rid)
    kv.synchronize(30)
    kv.check_integrity()
    for rid, d in data.items():
        assert_same(kv, rid, d)


def test_offload_waits_for_kernels_still_writing_the_kv(closing):
    """A write queued on the compute stream behind a long kernel must be in
    the host copy: the device-to-host stream waits on the compute stream."""
    kv = closing(PagedKVCache(GEOM, device="cuda:0", device_pages=64, host_pages=64))
    kv.ingest_request("a")
    assert kv.allocate("a", 256)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the compute stream busy
        big = big @ big / 4096
    k = torch.randn(256, 2, 64, device="cuda").to(GEOM.dtype)
    for layer in range(GEOM.num_layers):
        kv.write("a", layer, 0, k, k)  # queued behind the matmuls
    kv.offload("a")
    kv.synchronize(60)
    assert kv.reload("a")
    kv.synchronize(60)
    for layer in range(GEOM.num_layers):
        k2, _ = kv.read("a", layer)
        assert torch.equal(k2, k)


def test_host_slab_is_pinned_to_exactly_its_size(closing):
    kv = closing(PagedKVCache(GEOM, device="cuda:0", device_pages=8, host_pages=37))
    assert kv._host.numel() * kv._host.element_size() == 37 * GEOM.page_bytes
    assert kv._host.is_pinned()


def _busy(stream, n=30):
    """Queue a long run of matmuls on ``stream``."""
    with torch.cuda.stream(stream):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(n):
            big = big @ big / 4096
    return big


def test_reload_waits_for_kernels_still_using_freed_slots(closing):
    """Item 10: a kernel queued for a removed request's slots still reads them
    when a reload into those slots is asked for; the reload must wait."""
    kv = closing(PagedKVCache(GEOM, device="cuda:0", device_pages=4, host_pages=8))
    gen = torch.Generator().manual_seed(2)
    b = fill(kv, "b", gen, 64)  # 4 pages, all of them
    kv.offload("b")
    kv.synchronize(60)
    old = fill(kv, "a", gen, 64)
    _busy(torch.cuda.current_stream())
    snap = kv.layer_view(0)[0].clone()  # queued behind the matmuls: reads a's slots
    kv.remove_request("a")
    assert kv.reload("b")  # into the very slots a held
    kv.synchronize(60)
    torch.cuda.synchronize()
    assert kv.page_table("b") == [0, 1, 2, 3]  # the slots a held
    assert torch.equal(snap.reshape(-1, 2, 64)[:64], old[0][0])
    assert_same(kv, "b", b)


def test_markers_are_recorded_on_the_named_compute_stream(closing):
    """Item 11: with a named compute stream, offloads wait for it even when
    the calling thread's current stream is another one."""
    compute = torch.cuda.Stream()
    kv = PagedKVCache(GEOM, device="cuda:0", device_pages=64, host_pages=64,
                      compute_stream=compute)
    closing(kv)
    kv.ingest_request("a")
    assert kv.allocate("a", 256)
    _busy(compute)
    k = torch.randn(256, 2, 64, device="cuda").to(GEOM.dtype)
    with torch.cuda.stream(compute):
        for layer in range(GEOM.num_layers):
            kv.write("a", layer, 0, k, k)  # queued on compute behind the matmuls
    kv.offload("a")  # called on the default stream, which is idle
    kv.synchronize(60)
    assert kv.reload("a")
    kv.synchronize(60)
    with torch.cuda.stream(compute):
        k2, _ = kv.read("a", 0)
    compute.synchronize()
    assert torch.equal(k2, k)


def test_copy_events_block_instead_of_spinning():
    """Item 12: every event a worker waits on is a blocking-sync event."""
    from tiering.core.transfer import StreamSet

    ev = StreamSet(torch.device("cuda:0")).new_event()
    assert ev.blocking


def test_a_fault_mid_copy_fences_the_queued_copies():
    """Item 14: a fault between runs raises only after the runs already queued finished."""
    from tiering.core.transfer import PageRun, StreamSet, copy_runs

    streams = StreamSet(torch.device("cuda:0"))
    src = torch.randn(8, 1 << 20, device="cuda")
    dst = torch.empty(8, 1 << 20).pin_memory()
    calls = []

    def hook(kind):
        calls.append(kind)
        if len(calls) == 3:
            raise RuntimeError("injected")

    runs = [PageRun(i, i, 1) for i in range(8)]
    with pytest.raises(RuntimeError, match="injected"):
        copy_runs(streams, src, dst, runs, "d2h", fault_hook=hook)
    assert streams.d2h.query()  # nothing still queued on the copy stream
    assert torch.equal(dst[:2], src[:2].cpu())


def test_cache_on_a_second_device(closing):
    """Item 15: everything of a cache on cuda:1 happens on cuda:1."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    kv = closing(PagedKVCache(GEOM, device="cuda:1", device_pages=16, host_pages=16, verify=True))
    gen = torch.Generator().manual_seed(5)
    data = fill(kv, "a", gen, 40)
    kv.offload("a")
    kv.synchronize(60)
    assert kv.reload("a")
    kv.synchronize(60)
    assert_same(kv, "a", data)


def test_pinning_reports_exact_and_leaves_no_pending_error(closing):
    """Item 17: the slab is pinned exactly (or says why not) and no CUDA error is left pending."""
    from tiering.core.pinning import PinMode

    kv = closing(PagedKVCache(GEOM, device="cuda:0", device_pages=8, host_pages=37))
    print("host pinning:", kv.host_pinning)
    assert kv.host_pinning.mode in (PinMode.EXACT, PinMode.TORCH_ROUNDED)
    assert kv._host.data_ptr() % 4096 == 0 or kv.host_pinning.mode is not PinMode.EXACT
    torch.cuda.synchronize()  # would raise a pending error left by a failed register
    kv.close()
    torch.cuda.synchronize()


def test_read_gathers_without_a_host_sync(closing):
    """Item 18: the page table is kept on the device and reused by every read."""
    kv = closing(PagedKVCache(GEOM, device="cuda:0", device_pages=16, host_pages=16))
    gen = torch.Generator().manual_seed(6)
    data = fill(kv, "a", gen, 40)
    assert_same(kv, "a", data)
    built = kv.stats.page_tables_built
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(GEOM.num_layers):
            kv.read("a", layer)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kv.stats.page_tables_built == built
    assert kv._reqs["a"].index.is_cuda
