"""A disk reload through ``PagedKVCache``: the cache's scratch read (the store skips its
staging copy) against the same reloads through a store read that is asked plainly, in
the same run.

Method:
- Geometry of 32 layers, K and V, 16 tokens a page, 8 KV heads, head dim 128, bf16
  (2 MiB a page); requests of 64 pages (128 MiB) of random normal data; a CPU device
  (the reload reads straight into the request's device slots) with a one-page host,
  so every offload goes to the disk tier (codec ``none``, the direct path).
- A pass reloads every request from disk, one at a time (``reload`` then
  ``synchronize``: the time a waiting request sees), then offloads it back
  (untimed). The pages stay in the page cache: these are warm reads.
- ``plain`` wraps the store's ``read`` in a function without the ``out_is_scratch``
  keyword, so the cache asks it plainly and the store stages each read; ``scratch``
  is the cache as it ships. Passes alternate between the two; each figure is the
  best pass.
- Every reload is checked bit for bit against what was written, once per side.

Usage: python benchmarks/cache_disk.py --out FILE.json [--requests N] [--passes N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import table, write_json  # noqa: E402
from tiering import DiskConfig, KVGeometry, PagedKVCache, RequestState  # noqa: E402

GEOMETRY = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16,
                      dtype=torch.bfloat16)
REQUEST_PAGES = 64


def _build(root: str, requests: int) -> tuple[PagedKVCache, dict[str, torch.Tensor]]:
    page = GEOMETRY.page_bytes
    cache = PagedKVCache(GEOMETRY, "cpu", device_pages=REQUEST_PAGES + 1, host_pages=1,
                         disk=DiskConfig(path=root, capacity_bytes=(requests + 1) * REQUEST_PAGES * page))
    gen = torch.Generator().manual_seed(5)
    tokens = REQUEST_PAGES * GEOMETRY.page_tokens
    data = {}
    for i in range(requests):
        rid = f"r{i}"
        cache.ingest_request(rid, None)
        assert cache.allocate(rid, tokens)
        kv = torch.randn((GEOMETRY.num_layers, 2, tokens, GEOMETRY.num_kv_heads,
                          GEOMETRY.head_dim), generator=gen).to(GEOMETRY.dtype)
        for layer in range(GEOMETRY.num_layers):
            cache.write(rid, layer, 0, kv[layer, 0], kv[layer, 1])
        data[rid] = kv
        _offload(cache, rid)
    return cache, data


def _offload(cache: PagedKVCache, rid: str) -> None:
    assert cache.offload(rid)
    cache.synchronize(60)
    assert cache.state_of(rid) is RequestState.ON_DISK, cache.state_of(rid)


def _check(cache: PagedKVCache, rid: str, kv: torch.Tensor) -> None:
    for layer in range(GEOMETRY.num_layers):
        k, v = cache.read(rid, layer)
        assert torch.equal(k, kv[layer, 0]) and torch.equal(v, kv[layer, 1]), (rid, layer)


def _pass(cache: PagedKVCache, data: dict[str, torch.Tensor], check: bool) -> float:
    spent = 0.0
    for rid, kv in data.items():
        t0 = time.perf_counter()
        assert cache.reload(rid)
        results = cache.synchronize(60)
        spent += time.perf_counter() - t0
        assert all(r.ok for r in results), results
        if check:
            _check(cache, rid, kv)
        _offload(cache, rid)
    return spent


def run(requests: int, passes: int, base_dir: str | None) -> dict:
    with tempfile.TemporaryDirectory(dir=base_dir) as root:
        cache, data = _build(os.path.join(root, "disk"), requests)
        try:
            scratch_read = cache.disk.read

            def plain_read(extent, out, *, first_page=0):
                return scratch_read(extent, out, first_page=first_page)

            best = {"scratch": float("inf"), "plain": float("inf")}
            load = [os.getloadavg()[0]]
            for i in range(passes):
                for side in (("scratch", "plain") if i % 2 == 0 else ("plain", "scratch")):
                    cache.disk.read = scratch_read if side == "scratch" else plain_read
                    best[side] = min(best[side], _pass(cache, data, check=i == 0))
            load.append(os.getloadavg()[0])
            cache.check_integrity()
        finally:
            cache.close()
    nbytes = requests * REQUEST_PAGES * GEOMETRY.page_bytes
    figures = {side: {"seconds": s, "gb_per_s": nbytes / s / 1e9} for side, s in best.items()}
    return {"benchmark": "cache_disk", "requests": requests, "request_bytes":
            REQUEST_PAGES * GEOMETRY.page_bytes, "passes": passes, "load_1min": load,
            "reload": figures, "scratch_over_plain": best["plain"] / best["scratch"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument("--requests", type=int, default=4, help="requests of 128 MiB (default 4)")
    ap.add_argument("--passes", type=int, default=5, help="passes per side (default 5)")
    ap.add_argument("--dir", default=None, help="directory for the disk tier (default: temp)")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.passes < 1:
        ap.error("--requests and --passes must be >= 1")
    r = run(args.requests, args.passes, args.dir)
    rows = [(side, f["gb_per_s"], f["seconds"]) for side, f in r["reload"].items()]
    print(table(rows, ("disk reload", "GB/s", "best pass s")))
    print(f"scratch / plain: {r['scratch_over_plain']:.2f}x (load {r['load_1min'][0]:.1f} ->"
          f" {r['load_1min'][1]:.1f})")
    write_json(args.out, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
