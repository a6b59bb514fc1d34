"""The demo's long request: one request whose KV is several times the device's.

It is served twice with the same model and tokens: on a cache whose device holds
only ``device_pages`` pages (the request streams: a window on the device, the
rest read from the host layer by layer, ``stream_window_pages`` /
``stream_buffer_pages``), and on a device that holds all of it (compute only:
no copy at all). The tokens and final logits must be bitwise the same; the
time of the first against the second is what streaming costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tiering.apps.demo.model import ModelConfig, TinyDecoder
from tiering.resources.kv_cache import PagedKVCache


@dataclass(frozen=True)
class LongConfig:
    """``times_device``: the request's KV over the device's. ``window_pages`` /
    ``buffer_pages``: the streaming cache's window and ring. ``prompt_chunk``:
    prompt tokens per forward (the window must hold one chunk's pages; default
    what a window less one page holds)."""

    device_pages: int = 16
    times_device: int = 4
    window_pages: int = 7
    buffer_pages: int = 4
    new_tokens: int = 8
    prompt_chunk: int | None = None
    page_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("device_pages", "times_device", "window_pages", "buffer_pages",
                     "new_tokens", "prompt_chunk", "page_tokens"):
            v = getattr(self, name)
            if name == "prompt_chunk" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LongConfig.{name} must be an int >= 1, got {v!r}")
        if self.window_pages + self.buffer_pages >= self.device_pages:
            raise ValueError("LongConfig: window_pages + buffer_pages must be below device_pages")
        if self.window_pages < 2:
            raise ValueError("LongConfig: window_pages must be >= 2 (a chunk and the page it"
                             " continues)")
        if -(-self.chunk // self.page_tokens) + 1 > self.window_pages:
            raise ValueError(f"LongConfig: a prompt chunk of {self.chunk} tokens needs a"
                             f" window of more than {self.window_pages} pages")

    @property
    def chunk(self) -> int:
        """Prompt tokens per forward."""
        if self.prompt_chunk is not None:
            return self.prompt_chunk
        return (self.window_pages - 1) * self.page_tokens

    @property
    def prompt_tokens(self) -> int:
        return self.times_device * self.device_pages * self.page_tokens - self.new_tokens


class _Served(NamedTuple):
    tokens: list[int]
    logits: torch.Tensor
    prefill_s: float
    decode_s: float
    streamed: bool


def _serve(model: TinyDecoder, kv: PagedKVCache, prompt: torch.Tensor,
           cfg: LongConfig) -> _Served:
    rid = "long"
    kv.ingest_request(rid)
    tokens: list[int] = []
    logits = None
    t0 = time.perf_counter()
    for start in range(0, len(prompt), cfg.chunk):
        chunk = prompt[start : start + cfg.chunk]
        if not kv.allocate(rid, start + len(chunk)):
            raise RuntimeError(f"long request: allocate({start + len(chunk)}) refused")
        logits = model.forward(kv, rid, chunk, start)
    prefill_s = time.perf_counter() - t0
    pos = len(prompt)
    t1 = time.perf_counter()
    for _ in range(cfg.new_tokens):
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        if not kv.allocate(rid, pos + 1):
            raise RuntimeError(f"long request: allocate({pos + 1}) refused")
        logits = model.forward(kv, rid, torch.tensor([nxt]), pos)
        pos += 1
    decode_s = time.perf_counter() - t1
    streamed = kv.is_streamed(rid)
    kv.check_integrity()
    return _Served(tokens, logits, prefill_s, decode_s, streamed)


def run_long(cfg: LongConfig, model_cfg: ModelConfig | None = None,
             device: str = "cpu") -> dict[str, Any]:
    """Serve the long request streamed and on a device that holds it; the figures."""
    model_cfg = model_cfg or ModelConfig()
    geometry = model_cfg.kv_geometry(cfg.page_tokens)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prompt = torch.randint(0, model_cfg.vocab, (cfg.prompt_tokens,), generator=gen)
    model = TinyDecoder(model_cfg, cfg.seed, device)
    total_pages = geometry.pages_for(cfg.prompt_tokens + cfg.new_tokens)
    with PagedKVCache(geometry, device, cfg.device_pages, total_pages + 1,
                      stream_window_pages=cfg.window_pages,
                      stream_buffer_pages=cfg.buffer_pages) as kv:
        got = _serve(model, kv, prompt, cfg)
        copy_s = kv._stream.copy_s
    with PagedKVCache(geometry, device, total_pages + 1, 1) as roomy:
        want = _serve(model, roomy, prompt, cfg)
    identical = got.tokens == want.tokens and torch.equal(got.logits, want.logits)
    return {
        "request_kv_bytes": total_pages * geometry.page_bytes,
        "device_kv_bytes": cfg.device_pages * geometry.page_bytes,
        "times_device": round(total_pages / cfg.device_pages, 2),
        "prompt_tokens": cfg.prompt_tokens,
        "generated_tokens": cfg.new_tokens,
        "streamed": got.streamed and not want.streamed,
        "prefill_s": round(got.prefill_s, 3),
        "decode_s": round(got.decode_s, 3),
        "decode_tokens_per_s": round(cfg.new_tokens / got.decode_s, 2) if got.decode_s > 0 else None,
        "compute_only_prefill_s": round(want.prefill_s, 3),
        "compute_only_decode_s": round(want.decode_s, 3),
        "compute_only_tokens_per_s": round(cfg.new_tokens / want.decode_s, 2) if want.decode_s > 0 else None,
        "stream_copy_s": round(copy_s, 3),
        "slowdown": round((got.prefill_s + got.decode_s) / (want.prefill_s + want.decode_s), 3) if want.prefill_s + want.decode_s > 0
        else None,
        "identical": bool(identical),
    }
