"""The demo's two readiness modes and its long request (several times the device)."""

from __future__ import annotations

import pytest
import torch
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
