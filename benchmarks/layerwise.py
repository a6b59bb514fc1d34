"""Layer-wise reload and streaming, on the demo model, as ratios measured in one run.

1. First layer: a request on the host is asked back; the time until its layer 0
   has been computed (read from the cache and attended over) with layer-wise
   reload, against the whole-request reload time over the layer count (the
   target: at most 1.2). The total time of both reloads (every layer landed) is
   the whole-request path's cost check (ratio near 1).
2. Streaming: one decode step of a request longer than the device (its head
   read from the host layer by layer) against max(copy time, compute time) of
   its layers, where compute is the same step on a device that holds the whole
   request (the target: at most 1.3; the sum would be the no-overlap figure).

    python benchmarks/layerwise.py --out bench-out/layerwise.json [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiering.resources.base import ResourceStep, StepContext  # noqa: E402
from tiering.resources.kv_cache import PagedKVCache  # noqa: E402

from benchmarks._report import table, write_json  # noqa: E402
from tiering.apps.demo.model import ModelConfig, TinyDecoder  # noqa: E402

PAGE_TOKENS = 16


def _fill(kv: PagedKVCache, rid: str, tokens: int, gen: torch.Generator, step: int) -> None:
    g = kv.geometry
    kv.ingest_request(rid)
    for start in range(0, tokens, step):
        n = min(step, tokens - start)
        assert kv.allocate(rid, start + n)
        for layer in range(g.num_layers):
            k = torch.randn(n, g.num_kv_heads, g.head_dim, generator=gen, dtype=g.dtype)
            k = k.to(kv.device)
            kv.write(rid, layer, start, k, k * 0.5)


def _layer0(model: TinyDecoder, kv: PagedKVCache, rid: str, q: torch.Tensor) -> None:
    k, v = kv.read(rid, 0)
    model._attend(q, k, v, k.shape[0] - 1)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def first_layer(cfg: ModelConfig, tokens: int, repeats: int, device: str = "cpu") -> dict:
    g = cfg.kv_geometry(PAGE_TOKENS)
    pages = g.pages_for(tokens)
    model = TinyDecoder(cfg, 0, device)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, cfg.q_heads, cfg.head_dim, generator=gen).to(device)
    med: dict[str, dict[str, float]] = {}
    for mode, layerwise in (("whole", False), ("layer", True)):
        got: dict[str, list[float]] = {"ready": [], "first": [], "total": [], "compute": []}
        with PagedKVCache(g, device, device_pages=pages + 1, host_pages=pages + 1,
                          layerwise_reload=layerwise) as kv:
            _fill(kv, "r", tokens, gen, 64 * PAGE_TOKENS)
            for _ in range(repeats):
                assert kv.offload("r") > 0
                kv.synchronize()
                t0 = time.perf_counter()
                assert kv.reload("r")
                assert kv.wait_layer("r", 0)  # blocks (no spinning) until layer 0 may be read
                assert kv.admit(ResourceStep("r"), StepContext(0)).ok
                _sync(device)  # on a GPU the compute stream now waits for layer 0's copy
                t_ready = time.perf_counter()
                _layer0(model, kv, "r", q)
                _sync(device)
                t_first = time.perf_counter()
                kv.synchronize()
                got["ready"].append(t_ready - t0)
                got["first"].append(t_first - t0)
                assert kv.offload("r") > 0  # the same reload, timed to its last layer
                kv.synchronize()
                t0 = time.perf_counter()
                assert kv.reload("r")
                kv.synchronize()
                got["total"].append(time.perf_counter() - t0)
                c0 = time.perf_counter()
                _layer0(model, kv, "r", q)
                _sync(device)
                got["compute"].append(time.perf_counter() - c0)
        med[mode] = {k: statistics.median(v) for k, v in got.items()}
    L = cfg.layers
    w, lw = med["whole"], med["layer"]
    return {
        "tokens": tokens,
        "request_bytes": pages * g.page_bytes,
        "layers": L,
        "whole_reload_s": w["total"],
        "layerwise_reload_s": lw["total"],
        "whole_ready_s": w["ready"],
        "layerwise_ready_s": lw["ready"],
        "whole_first_layer_computed_s": w["first"],
        "layerwise_first_layer_computed_s": lw["first"],
        "layer0_compute_s": lw["compute"],
        # layer 0 readable, against the whole-request reload over the layer count
        "ready_ratio": lw["ready"] / (w["total"] / L),
        # layer 0 computed, against the same bound plus that compute
        "computed_ratio": lw["first"] / (w["total"] / L + lw["compute"]),
        "target": 1.2,
        "layerwise_total_over_whole": lw["total"] / w["total"],
    }


def streaming(cfg: ModelConfig, tokens: int, device_pages: int, window: int, buffer: int,
              repeats: int, device: str = "cpu") -> dict:
    g = cfg.kv_geometry(PAGE_TOKENS)
    pages = g.pages_for(tokens + repeats + 1)
    model = TinyDecoder(cfg, 0, device)
    res = {}
    for name, kw in (("streamed", dict(device_pages=device_pages, host_pages=pages + 1,
                                       stream_window_pages=window, stream_buffer_pages=buffer)),
                     ("resident", dict(device_pages=pages + 1, host_pages=1))):
        gen = torch.Generator().manual_seed(2)
        with PagedKVCache(g, device, **kw) as kv:
            _fill(kv, "long", tokens, gen, (window - 1) * PAGE_TOKENS)
            assert kv.is_streamed("long") == (name == "streamed")
            steps, copies = [], []
            pos = tokens
            for _ in range(repeats):
                assert kv.allocate("long", pos + 1)
                before = kv._stream.copy_s if kv._stream is not None else 0.0
                kv.admit(ResourceStep("long"), StepContext(0))
                _sync(device)
                t0 = time.perf_counter()
                model.forward(kv, "long", torch.tensor([pos % cfg.vocab]), pos)
                _sync(device)
                steps.append(time.perf_counter() - t0)
                copies.append((kv._stream.copy_s if kv._stream is not None else 0.0) - before)
                pos += 1
            res[name] = (statistics.median(steps), statistics.median(copies))
    step, copy = res["streamed"]
    compute = res["resident"][0]
    return {
        "tokens": tokens,
        "request_bytes": g.pages_for(tokens) * g.page_bytes,
        "device_bytes": device_pages * g.page_bytes,
        "times_device": round(g.pages_for(tokens) / device_pages, 2),
        "step_s": step,
        "copy_s": copy,
        "compute_s": compute,
        "ratio_to_max": step / max(copy, compute),
        "ratio_to_sum": step / (copy + compute),
        "target": 1.3,
    }


def copy_floor(cfg: ModelConfig, tokens: int, repeats: int) -> dict:
    """The floor under "layer 0 readable": the raw copy of one layer's slices of every
    page (strided: a page holds its layers one after the other) against a quarter
    of the raw copy of the whole pages, no threads, no cache."""
    g = cfg.kv_geometry(PAGE_TOKENS)
    pages = g.pages_for(tokens)
    src = torch.randn(pages, *g.page_shape, generator=torch.Generator().manual_seed(3))
    dst = torch.empty_like(src)
    whole, layer0 = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        whole.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst[:, 0].copy_(src[:, 0])
        layer0.append(time.perf_counter() - t0)
    w, one = statistics.median(whole), statistics.median(layer0)
    return {"whole_copy_s": w, "layer0_copy_s": one, "ratio": one / (w / cfg.layers)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out/layerwise.json")
    ap.add_argument("--quick", action="store_true", help="smaller requests, fewer repeats")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: CUDA is not available")
    cfg = ModelConfig()
    if a.device == "cpu":
        torch.set_num_threads(1)  # the copy thread gets the other core
    n, reps = (4096, 3) if a.quick else (16384, 7)
    fl = first_layer(cfg, n, reps, a.device)
    floor = copy_floor(cfg, n, reps)
    # the demo model (4 layers): a ring of 16 of the 64 device pages holds 1/16 of a layer
    # of a 16x head, so most of each layer copies while the step waits
    st = streaming(cfg, n, device_pages=64, window=8, buffer=16, repeats=reps, device=a.device)
    # the same model 32 layers deep (a real model's depth): the same share of the device
    # holds two layers of a 4x head, so the next layer copies while this one computes
    deep = ModelConfig(layers=32)
    dn = n // 4
    st_deep = streaming(deep, dn, device_pages=dn // PAGE_TOKENS // 4, window=8,
                        buffer=dn // PAGE_TOKENS // 16, repeats=reps, device=a.device)
    per_layer = fl["whole_reload_s"] / fl["layers"]
    print(table([
        ("layer 0 readable", fl["layerwise_ready_s"] * 1e3, per_layer * 1e3, fl["ready_ratio"],
         fl["target"]),
        ("layer 0 computed", fl["layerwise_first_layer_computed_s"] * 1e3,
         (per_layer + fl["layer0_compute_s"]) * 1e3, fl["computed_ratio"], fl["target"]),
        ("whole reload (layer-wise)", fl["layerwise_reload_s"] * 1e3, fl["whole_reload_s"] * 1e3,
         fl["layerwise_total_over_whole"], "~1"),
        ("layer 0 copy alone (floor)", floor["layer0_copy_s"] * 1e3,
         floor["whole_copy_s"] / cfg.layers * 1e3, floor["ratio"], "-"),
        (f"streamed step, 4 layers, {st['times_device']}x", st["step_s"] * 1e3,
         max(st["copy_s"], st["compute_s"]) * 1e3, st["ratio_to_max"], st["target"]),
        (f"streamed step, 32 layers, {st_deep['times_device']}x", st_deep["step_s"] * 1e3,
         max(st_deep["copy_s"], st_deep["compute_s"]) * 1e3, st_deep["ratio_to_max"],
         st_deep["target"]),
    ], ("figure", "measured ms", "baseline ms", "ratio", "target")))
    print(f"a reload of {fl['request_bytes'] >> 20} MiB over {fl['layers']} layers; whole-request"
          f" readiness computes layer 0 after {fl['whole_first_layer_computed_s'] * 1e3:.2f} ms;"
          f" streamed step / (copy + compute) {st['ratio_to_sum']:.2f}"
          f" (copy {st['copy_s'] * 1e3:.2f} ms, compute {st['compute_s'] * 1e3:.2f} ms,"
          f" {st['times_device']}x the device)")
    res = {"device": a.device, "first_layer": fl, "copy_floor": floor, "streaming": st, "streaming_32_layers": st_deep}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
