"""The demo's two readiness modes and its long request (several times the device)."""

from __future__ import annotations

import pytest
import torch
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_stream import StreamBuffer

from tiering.apps.demo.long import LongConfig, run_long
from tiering.apps.demo.model import ModelConfig

SMALL_MODEL = ModelConfig(vocab=64, width=32, layers=3, q_heads=2, kv_heads=1, head_dim=8,
                          mlp_hidden=64)
SMALL = LongConfig(device_pages=8, times_device=3, window_pages=4, buffer_pages=2,
                   new_tokens=4, page_tokens=8)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_the_long_request_streams_and_gives_the_compute_only_outputs():
    out = run_long(SMALL, SMALL_MODEL)
    assert out["streamed"] is True
    assert out["times_device"] >= 3
    assert out["stream_copy_s"] > 0  # its head came through the stream buffer
    assert out["identical"] is True


def test_a_wrong_byte_in_the_stream_shows_in_the_outputs(monkeypatch):
    """The negative control: the comparison sees a changed value in a streamed layer."""
    real = StreamBuffer.read_layer

    def bent(self, rid, head, layer, out_k, out_v, page_tokens, timeout):
        ok = real(self, rid, head, layer, out_k, out_v, page_tokens, timeout)
        out_k[0] += 0.5
        return ok

    monkeypatch.setattr(StreamBuffer, "read_layer", bent)
    assert run_long(SMALL, SMALL_MODEL)["identical"] is False


@pytest.mark.parametrize("kw,field", [
    ({"window_pages": 5, "buffer_pages": 3}, "below device_pages"),
    ({"window_pages": 1}, "window_pages"),
    ({"prompt_chunk": 64}, "prompt chunk"),
    ({"times_device": 0}, "times_device"),
])
def test_bad_long_settings_name_the_field(kw, field):
    base = dict(device_pages=8, times_device=3, window_pages=4, buffer_pages=2, page_tokens=8)
    base.update(kw)
    with pytest.raises(ValueError, match=field):
        LongConfig(**base)


def test_a_layer_fault_mid_step_is_undone_and_the_outputs_stay_bitwise(tmp_path):
    """Host reloads copy slowly layer by layer and a few layer copies fail: steps admitted
    from layer 0 are cut short, the requests go back to the host with the tokens
    they had, run again, and every output still matches the unpressured run."""
    import sys
    import threading
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_demo import small_config

    from tiering.apps.demo.scenario import compare_outputs, plan_tiers, serve

    lock = threading.Lock()
    seen = {"layer_calls": 0, "failed": 0}

    def slow_and_failing(kind):
        if kind != "h2d" or threading.current_thread().name.startswith("tiering-io"):
            return
        time.sleep(0.004)  # a slow link: later layers still copy while the step runs
        with lock:
            seen["layer_calls"] += 1
            fail = seen["layer_calls"] % 7 == 3 and seen["failed"] < 4  # a few, then none
            if fail:
                seen["failed"] += 1
        if fail:
            raise OSError(5, "injected fault on a layer copy")

    cfg = small_config(settle_each_step=False, compare_readiness=False, long_request=False)
    requests = cfg.draw_requests()
    tight = plan_tiers(cfg, requests, pressured=True)
    run = serve(cfg, requests, tight, tmp_path / "d",
                cache_options={"copy_fault_hook": slow_and_failing})
    ref = serve(cfg, requests, plan_tiers(cfg, requests, pressured=False), None, prefix=False)
    assert compare_outputs(ref.result.outputs, run.result.outputs) == []
    assert seen["failed"] > 0 and run.kv_stats["reload_failures"] > 0
    assert run.kv_stats["lost"] == 0


def test_the_model_step_cut_short_by_a_layer_fault_runs_again_bitwise():
    """A decode step admitted from layer 0 meets a failed copy of layer 2: forward raises
    LayerNotReady (what the demo worker catches), the request is back on the host with
    the tokens it had, and the step run again gives the unfaulted logits bitwise."""
    import threading

    from tiering.resources.kv_cache import PagedKVCache

    from tiering.apps.demo.model import TinyDecoder
    from tiering.errors import LayerNotReady
    from tiering.types import RequestState

    g = SMALL_MODEL.kv_geometry(8)
    gate = {"hold": False, "fail": False, "calls": 0}
    release = threading.Event()

    def hook(kind):
        if kind != "h2d" or not gate["hold"]:
            return
        gate["calls"] += 1
        if gate["calls"] == 3:  # layer 2 of a one-run reload
            assert release.wait(10)
            if gate["fail"]:
                raise OSError(5, "injected fault on layer 2")

    model = TinyDecoder(SMALL_MODEL, 3)
    prompt = torch.randint(0, SMALL_MODEL.vocab, (29,), generator=torch.Generator().manual_seed(4))
    with PagedKVCache(g, device_pages=16, host_pages=16, layerwise_reload=True,
                      copy_fault_hook=hook) as kv, PagedKVCache(g, device_pages=16) as ref:
        for cache in (kv, ref):
            cache.ingest_request("a")
            assert cache.allocate("a", 29)
            first = model.forward(cache, "a", prompt, 0)
        nxt = torch.tensor([int(torch.argmax(first))])
        assert ref.allocate("a", 30)
        want = model.forward(ref, "a", nxt, 29)
        assert kv.offload("a")
        kv.synchronize()
        gate.update(hold=True, fail=True, calls=0)
        assert kv.reload("a")
        assert kv.wait_layer("a", 0, timeout=10)
        assert kv.admit(ResourceStep("a"), StepContext(0)).ok  # from layer 0, 2 still held
        assert kv.allocate("a", 30)
        threading.Timer(0.2, release.set).start()
        with pytest.raises(LayerNotReady):
            model.forward(kv, "a", nxt, 29)  # layers 0 and 1 ran; layer 2 never lands
        kv.synchronize()
        assert kv.state_of("a") is RequestState.ON_HOST and kv.num_tokens("a") == 29
        assert kv.stats.reloads_undone == 1
        gate.update(hold=False, fail=False)
        assert kv.reload("a")
        kv.synchronize()
        assert kv.allocate("a", 30)
        got = model.forward(kv, "a", nxt, 29)
        assert torch.equal(got, want)
        kv.check_integrity()
