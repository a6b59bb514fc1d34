"""Offload and reload throughput of one large request whose pages are scattered.

Measures a request of ``--gib`` GiB of KV (default 1) whose device pages are
interleaved with another request's, moved device -> host and back through
``PagedKVCache``, against a raw contiguous ``copy_`` of the same number of
bytes between the same kinds of memory, measured in the same run. On a GPU the
raw baseline is a device <-> pinned-host copy; on a CPU it is a plain memory
copy.

    python benchmarks/transfer.py --out t.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import table, write_json  # noqa: E402
from resources.kv_cache import PagedKVCache  # noqa: E402
from resources.kv_geometry import KVGeometry  # noqa: E402
from tiering.transfer import coalesce  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_copy_gbps(nbytes: int, device: torch.device, reps: int) -> tuple[float, float]:
    """(device->host, host->device) GB/s of one contiguous copy of nbytes."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev.random_(0, 255)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for _ in range(reps):
            _sync(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            times.append(time.perf_counter() - t)
        out.append(nbytes / statistics.median(times) / 1e9)
    del dev, host
    return out[0], out[1]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    g = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16)
    pages = int(a.gib * (1 << 30)) // g.page_bytes
    nbytes = pages * g.page_bytes
    kv = PagedKVCache(g, device=device, device_pages=2 * pages, host_pages=pages)
    # interleave two requests page by page so the measured one is scattered
    kv.ingest_request("big")
    kv.ingest_request("filler")
    for i in range(1, pages + 1):
        assert kv.allocate("big", i * g.page_tokens)
        assert kv.allocate("filler", i * g.page_tokens)
    kv._dev.normal_()  # random KV, never zeros
    runs = len(coalesce(kv.page_table("big"), range(pages)))
    off, rel = [], []
    for _ in range(a.reps):
        _sync(device)
        t = time.perf_counter()
        kv.offload("big")
        kv.synchronize(timeout=600)
        off.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert kv.reload("big")
        kv.synchronize(timeout=600)
        _sync(device)
        rel.append(time.perf_counter() - t)
        kv.check_integrity()
    kv.close()
    del kv
    raw_d2h, raw_h2d = raw_copy_gbps(nbytes, device, a.reps)
    off_gbps = nbytes / statistics.median(off) / 1e9
    rel_gbps = nbytes / statistics.median(rel) / 1e9
    res = {
        "bytes": nbytes,
        "pages": pages,
        "page_bytes": g.page_bytes,
        "scattered_runs": runs,
        "device": str(device),
        "offload_gbps": off_gbps,
        "reload_gbps": rel_gbps,
        "raw_gbps": (raw_d2h + raw_h2d) / 2,
        "raw_d2h_gbps": raw_d2h,
        "raw_h2d_gbps": raw_h2d,
        "offload_ratio": off_gbps / raw_d2h,
        "reload_ratio": rel_gbps / raw_h2d,
    }
    print(table(
        [("offload (device->host)", off_gbps, raw_d2h, res["offload_ratio"]),
         ("reload (host->device)", rel_gbps, raw_h2d, res["reload_ratio"])],
        ("move", "GB/s", "raw GB/s", "ratio"),
    ))
    print(f"{nbytes / 2**30:.2f} GiB in {pages} pages of {g.page_bytes >> 20} MiB, "
          f"scattered across {runs} non-adjacent runs, on {device}")
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
