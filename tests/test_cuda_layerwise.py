"""CUDA-only checks of layer-wise reload and streaming: each layer's copy runs on the
host-to-device stream and the compute stream waits on that layer's event, never on
the whole request; a streamed request's reads are bitwise the bytes written.

Skipped on a machine without a CUDA device (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_kv
from test_cuda import GEOM, fill  # the same geometry and filling as the other CUDA checks
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_cache import PagedKVCache

pytestmark = pytest.mark.cuda

def test_layerwise_reload_on_gpu_reads_each_layer_after_its_event(closing):
    kv = closing(PagedKVCache(GEOM, device="cuda:0", device_pages=128, host_pages=128,
                              layerwise_reload=True))
    gen = torch.Generator().manual_seed(1)
    data = fill(kv, "a", gen, 1500)
    assert kv.offload("a")
    kv.synchronize(30)
    assert kv.reload("a")
    assert kv.wait_layer("a", 0, timeout=30)  # the compute stream now waits on layer 0
    assert kv.admit(ResourceStep("a"), StepContext(0)).ok
    for layer in range(GEOM.num_layers):
        k, v = kv.read("a", layer)  # each read waits on its own layer's event
        assert torch.equal(k, data[layer][0]) and torch.equal(v, data[layer][1])
    kv.synchronize(30)
    kv.check_integrity()


def test_a_streamed_request_on_gpu_is_bitwise(closing):
    kv = closing(PagedKVCache(GEOM, device="cuda:0", device_pages=16, host_pages=256,
                              stream_window_pages=4, stream_buffer_pages=4))
    gen = torch.Generator().manual_seed(2)
    kv.ingest_request("long", None)
    want = [([], []) for _ in range(GEOM.num_layers)]
    for start in range(0, 64 * 16, 48):
        assert kv.allocate("long", start + 48)
        for layer, (k, v) in enumerate(random_kv(gen, GEOM, 48)):
            k, v = k.to(kv.device), v.to(kv.device)
            kv.write("long", layer, start, k, v)
            want[layer][0].append(k)
            want[layer][1].append(v)
    assert kv.is_streamed("long")
    for _ in range(2):
        for layer in range(GEOM.num_layers):
            k, v = kv.read("long", layer)
            assert torch.equal(k, torch.cat(want[layer][0]))
            assert torch.equal(v, torch.cat(want[layer][1]))
    kv.check_integrity()
