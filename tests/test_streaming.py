"""Requests longer than the device: the window stays on the device, the head streams
from the host layer by layer, and every read gives bitwise the bytes written."""

from __future__ import annotations

import pytest
import torch
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.errors import IllegalTransition, LayerNotReady

GEOM = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.float32)
DEVICE_PAGES, WINDOW, BUFFER = 12, 3, 2


def streaming(**kw) -> PagedKVCache:
    return PagedKVCache(GEOM, device_pages=DEVICE_PAGES, host_pages=64,
                        stream_window_pages=WINDOW, stream_buffer_pages=BUFFER, **kw)


def grow(kv: PagedKVCache, rid: str, tokens: int, seed: int, step: int = 6):
    """Allocate and write ``tokens`` tokens ``step`` at a time (as decode and chunked
    prefill do); returns every layer's K and V as written."""
    gen = torch.Generator().manual_seed(seed)
    ks = [[] for _ in range(GEOM.num_layers)]
    vs = [[] for _ in range(GEOM.num_layers)]
    kv.ingest_request(rid)
    for start in range(0, tokens, step):
        n = min(step, tokens - start)
        assert kv.allocate(rid, start + n)
        for layer in range(GEOM.num_layers):
            k, v = torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen)
            kv.write(rid, layer, start, k, v)
            ks[layer].append(k)
            vs[layer].append(v)
        kv.check_integrity()
    return [(torch.cat(k), torch.cat(v)) for k, v in zip(ks, vs, strict=True)]


def test_a_request_several_times_the_device_reads_back_bitwise():
    tokens = 3 * DEVICE_PAGES * GEOM.page_tokens + 5  # three devices' worth and a bit
    with streaming() as kv:
        want = grow(kv, "long", tokens, seed=1)
        assert kv.is_streamed("long")
        assert kv.device_pool.used_pages == BUFFER + WINDOW  # admission: window and buffer
        assert kv.host_pool.used_pages == GEOM.pages_for(tokens) - WINDOW
        assert kv.admit(ResourceStep("long"), StepContext(0)).ok
        for _ in range(2):  # a second pass restarts the stream at layer 0
            for layer in range(GEOM.num_layers):
                k, v = kv.read("long", layer)
                assert torch.equal(k, want[layer][0]) and torch.equal(v, want[layer][1])
        assert kv._stream.copy_s > 0  # the head came through the buffer
        kv.check_integrity()


def test_the_same_bytes_as_a_device_that_holds_it_and_the_head_is_read_from_the_host():
    tokens = 2 * DEVICE_PAGES * GEOM.page_tokens
    with streaming() as kv, PagedKVCache(GEOM, device_pages=64, host_pages=4) as big:
        a = grow(kv, "r", tokens, seed=2)
        b = grow(big, "r", tokens, seed=2)
        assert not big.is_streamed("r")
        for layer in range(GEOM.num_layers):
            assert torch.equal(kv.read("r", layer)[0], big.read("r", layer)[0])
            assert torch.equal(kv.read("r", layer)[1], b[layer][1])
        # negative control: the head's bytes are the host's; change one and the read differs
        head0 = kv._reqs["r"].head[0]
        kv._host[head0, 2, 0, 0, 0, 0] += 1.0
        k, _ = kv.read("r", 2)
        assert not torch.equal(k, a[2][0])
        assert torch.equal(kv.read("r", 1)[0], a[1][0])  # other layers untouched


def test_a_streamed_request_is_not_offloaded_and_its_removal_frees_everything():
    with streaming() as kv:
        grow(kv, "long", 2 * DEVICE_PAGES * GEOM.page_tokens, seed=3)
        grow(kv, "short", 9, seed=4)  # the rest of the device still serves others
        assert kv.reclaimable("long") == 0 and kv.offload("long") == 0
        assert list(kv.reclaimable_many(["long", "short"]))[0] == 0
        with pytest.raises(IllegalTransition, match="streams"):
            kv.device_page_table("long")
        with pytest.raises(ValueError, match="stream from the host"):
            kv.write("long", 0, 0, torch.randn(1, 2, 8), torch.randn(1, 2, 8))
        kv.read("long", 0)
        kv.remove_request("long")
        kv.check_integrity()
        assert kv.host_pool.used_pages == 0
        assert kv.device_pool.used_pages == BUFFER + GEOM.pages_for(9)


def test_a_copy_fault_while_streaming_fails_the_read_and_loses_nothing():
    faults = {"on": False}

    def hook(kind):
        if faults["on"] and kind == "h2d":
            raise OSError(5, "injected stream fault")

    with streaming(copy_fault_hook=hook, layer_wait_timeout_s=10.0) as kv:
        want = grow(kv, "long", 2 * DEVICE_PAGES * GEOM.page_tokens, seed=5)
        faults["on"] = True
        with pytest.raises(LayerNotReady, match="could not be brought"):
            kv.read("long", 1)
        kv.check_integrity()
        faults["on"] = False
        for layer in range(GEOM.num_layers):
            assert torch.equal(kv.read("long", layer)[0], want[layer][0])


def test_refusals_change_nothing():
    with streaming() as kv:
        grow(kv, "long", 2 * DEVICE_PAGES * GEOM.page_tokens, seed=6)
        n = kv.num_tokens("long")
        with pytest.raises(ValueError, match="stream_window_pages"):
            kv.allocate("long", n + WINDOW * GEOM.page_tokens + 1)  # more than the window at once
        assert kv.num_tokens("long") == n
        kv.check_integrity()
    with PagedKVCache(GEOM, device_pages=DEVICE_PAGES, host_pages=4, stream_window_pages=WINDOW,
                      stream_buffer_pages=BUFFER) as kv:  # the host cannot take the head
        kv.ingest_request("x")
        for start in range(0, 200, 6):
            if not kv.allocate("x", start + 6):
                break
        else:
            raise AssertionError("a host of 4 pages took a head of 40")
        before = (kv.num_tokens("x"), kv.host_pool.used_pages, kv.device_pool.used_pages)
        assert not kv.allocate("x", kv.num_tokens("x") + 6)
        assert before == (kv.num_tokens("x"), kv.host_pool.used_pages, kv.device_pool.used_pages)
        kv.check_integrity()


@pytest.mark.parametrize("window,buffer,match", [
    (3, 0, "both 0"), (0, 2, "both 0"), (-1, 2, "stream_window_pages"),
    (8, 4, "leave device pages"), (True, 2, "stream_window_pages"),
])
def test_bad_stream_config(window, buffer, match):
    with pytest.raises(ValueError, match=match):
        PagedKVCache(GEOM, device_pages=DEVICE_PAGES, stream_window_pages=window,
                     stream_buffer_pages=buffer)


def test_a_copy_thread_that_does_not_stop_in_time_loses_the_ring_not_the_bytes():
    """The stream's copy thread hangs in a copy: the read gives up within the wait limit,
    the ring that thread may still write is never used again, and later reads copy every
    chunk themselves, still bitwise."""
    import threading

    stuck = threading.Event()

    def hook(kind):
        if kind == "h2d" and threading.current_thread().name == "tiering-stream":
            stuck.wait(10)

    with streaming(copy_fault_hook=hook, layer_wait_timeout_s=0.2) as kv:
        want = grow(kv, "long", 2 * DEVICE_PAGES * GEOM.page_tokens, seed=7)
        with pytest.raises(LayerNotReady):  # the thread takes a chunk and hangs in its copy
            kv.read("long", 0)
        assert kv._stream.ring_lost
        stuck.set()
        for layer in range(GEOM.num_layers):
            k, v = kv.read("long", layer)
            assert torch.equal(k, want[layer][0]) and torch.equal(v, want[layer][1])
        kv.check_integrity()
