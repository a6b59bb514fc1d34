"""CUDA-only checks: dedicated streams, compute-stream ordering, exact pinning.

Skipped on a machine without a CUDA device (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same, fill

from resources.kv_cache import PagedKVCache
from resources.kv_geometry import KVGeometry

pytestmark = pytest.mark.cuda

GEOM = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_tokens=16)


def test_round_trip_on_gpu():
    kv = PagedKVCache(GEOM, device="cuda:0", device_pages=64, host_pages=64, verify=True)
    try:
        gen = torch.Generator().manual_seed(1)
        data = {f"r{i}": fill(kv, f"r{i}", gen, 40 + 17 * i) for i in range(4)}
        for rid in data:
            kv.offload(rid)
        kv.synchronize(30)
        for rid in data:
            assert kv.reload(rid)
        kv.synchronize(30)
        kv.check_integrity()
        for rid, d in data.items():
            assert_same(kv, rid, [(k.cuda(), v.cuda()) for k, v in d])
    finally:
        kv.close()


def test_offload_waits_for_kernels_still_writing_the_kv():
    """A write queued on the compute stream behind a long kernel must be in
    the host copy: the device-to-host stream waits on the compute stream."""
    kv = PagedKVCache(GEOM, device="cuda:0", device_pages=64, host_pages=64)
    try:
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
    finally:
        kv.close()


def test_host_slab_is_pinned_to_exactly_its_size():
    kv = PagedKVCache(GEOM, device="cuda:0", device_pages=8, host_pages=37)
    try:
        assert kv._host.numel() * kv._host.element_size() == 37 * GEOM.page_bytes
        assert kv._host.is_pinned()
    finally:
        kv.close()
