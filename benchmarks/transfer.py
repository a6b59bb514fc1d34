"""Offload and reload throughput of one large request whose pages are scattered.

Measures a request of ``--gib`` GiB of KV (default 1) whose device pages are
interleaved with another request's, moved device -> host and back through
``PagedKVCache``, against a raw contiguous ``copy_`` of the same number of
bytes between the same kinds of memory, measured in the same run. On a GPU the
raw baseline is a device <-> pinned-host copy; on a CPU it is a plain memory
copy.

    python benchmarks/transfer.py --out t.json
    python benchmarks/transfer.py --out t.json --page-kib 2048,128,8 --both-ways --under-matmul

``--page-kib`` repeats the measurement for each page size (2048 KiB is the
default geometry: 32 layers, 8 KV heads, head dim 128, 16 tokens a page;
smaller pages use fewer tokens a page, then fewer layers). ``--both-ways``
also offloads one request while reloading another, against a raw copy each way
at once (two CUDA streams on a GPU, two threads on a CPU). ``--under-matmul``
(GPU only; the JSON says skipped elsewhere) repeats offload and reload while a
bf16 matmul loop runs on another stream, and reports both the transfer rate
and the matmul rate against each alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiering.resources.kv_cache import PagedKVCache  # noqa: E402
from tiering.resources.kv_geometry import KVGeometry  # noqa: E402

from benchmarks._report import table, write_json  # noqa: E402
from tiering.core.transfer import coalesce  # noqa: E402

DEFAULT_PAGE_KIB = 2048


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def geometry_for(page_kib: int) -> KVGeometry:
    """A geometry whose page is ``page_kib`` KiB: 32 layers x 8 heads x 128 dim bf16
    (128 KiB a token) with fewer tokens a page, then fewer layers (4 KiB a layer-token)."""
    if page_kib <= 0 or page_kib % 4:
        raise ValueError(f"--page-kib: a page must be a positive multiple of 4 KiB, got {page_kib}")
    if page_kib % 128 == 0:
        return KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=page_kib // 128)
    return KVGeometry(num_layers=page_kib // 4, num_kv_heads=8, head_dim=128, page_tokens=1)


def _timed(device, fn) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def raw_copy_gbps(nbytes: int, device: torch.device, reps: int) -> tuple[float, float]:
    """(device->host, host->device) GB/s of one contiguous copy of nbytes."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev.random_(0, 255)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        times = [_timed(device, lambda d=dst, s=src: d.copy_(s, non_blocking=True))
                 for _ in range(reps)]
        out.append(nbytes / statistics.median(times) / 1e9)
    del dev, host
    return out[0], out[1]


def raw_both_ways_gbps(nbytes: int, device: torch.device, reps: int) -> float:
    """GB/s (both directions counted) of a device->host and a host->device copy
    of nbytes each, at once: one CUDA stream each on a GPU, one thread each on a CPU."""
    cuda = device.type == "cuda"
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).random_(0, 255)
    times = []
    if cuda:
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
        for _ in range(reps):
            def both():
                with torch.cuda.stream(s1):
                    host_a.copy_(dev_a, non_blocking=True)
                with torch.cuda.stream(s2):
                    dev_b.copy_(host_b, non_blocking=True)
            times.append(_timed(device, both))
    else:
        for _ in range(reps):
            t = threading.Thread(target=host_a.copy_, args=(dev_a,))
            t0 = time.perf_counter()
            t.start()
            dev_b.copy_(host_b)
            t.join(timeout=600)
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


class _Matmuls:
    """A bf16 matmul loop on its own stream, fed from a thread that waits on
    blocking-sync events (no spinning); counts the matmuls it ran."""

    def __init__(self, device: torch.device, n: int = 8192) -> None:
        self.device, self.n = device, n
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.stream = torch.cuda.Stream(device)
        torch.cuda.synchronize(device)
        self.done = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                for _ in range(4):
                    torch.matmul(self.a, self.b)
                ev = torch.cuda.Event(blocking=True)
                ev.record(self.stream)
                ev.synchronize()
                self.done += 4

    def __enter__(self):
        self.done = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="bench-matmul", daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        self.seconds = time.perf_counter() - self._t0

    @property
    def tflops(self) -> float:
        return 2 * self.n**3 * self.done / self.seconds / 1e12


def measure(device: torch.device, page_kib: int, gib: float, reps: int, both_ways: bool,
            under_matmul: bool) -> dict:
    g = geometry_for(page_kib)
    pages = int(gib * (1 << 30)) // g.page_bytes
    if pages < 1:
        raise ValueError(f"--gib {gib} holds no page of {page_kib} KiB")
    nbytes = pages * g.page_bytes
    kv = PagedKVCache(g, device=device, device_pages=(3 if both_ways else 2) * pages,
                      host_pages=(2 if both_ways else 1) * pages)
    # interleave two requests page by page so the measured one is scattered
    kv.ingest_request("big")
    kv.ingest_request("filler")
    for i in range(1, pages + 1):
        assert kv.allocate("big", i * g.page_tokens)
        assert kv.allocate("filler", i * g.page_tokens)
    for rid in ("big", "filler"):  # random KV, never zeros
        for layer in range(g.num_layers):
            k = torch.randn(pages * g.page_tokens, g.num_kv_heads, g.head_dim, device=device)
            kv.write(rid, layer, 0, k.to(g.dtype), (-k).to(g.dtype))
    runs = len(coalesce(kv.page_table("big"), range(pages)))

    def round_trip(off: list, rel: list) -> None:
        off.append(_timed(device, lambda: (kv.offload("big"), kv.synchronize(timeout=600))))
        rel.append(_timed(device, lambda: (kv.reload("big") or _refused(),
                                           kv.synchronize(timeout=600))))
        kv.check_integrity()

    off, rel = [], []
    for _ in range(reps):
        round_trip(off, rel)
    res = {
        "page_kib": page_kib, "bytes": nbytes, "pages": pages, "page_bytes": g.page_bytes,
        "geometry": {"num_layers": g.num_layers, "page_tokens": g.page_tokens},
        "scattered_runs": runs,
        "offload_gbps": nbytes / statistics.median(off) / 1e9,
        "reload_gbps": nbytes / statistics.median(rel) / 1e9,
    }
    if both_ways:
        kv.ingest_request("other")
        assert kv.allocate("other", pages * g.page_tokens)
        for layer in range(g.num_layers):
            k = torch.randn(pages * g.page_tokens, g.num_kv_heads, g.head_dim, device=device)
            kv.write("other", layer, 0, k.to(g.dtype), k.to(g.dtype))
        kv.offload("other")
        kv.synchronize(timeout=600)
        out_rid, in_rid = "big", "other"
        times = []
        for _ in range(reps):
            def swap(o=out_rid, i=in_rid):
                kv.offload(o)
                assert kv.reload(i), f"reload({i}) refused"
                kv.synchronize(timeout=600)
            times.append(_timed(device, swap))
            kv.check_integrity()
            out_rid, in_rid = in_rid, out_rid
        if kv.is_offloaded("big"):  # leave "big" on the device for what follows
            kv.offload("other")
            assert kv.reload("big")
            kv.synchronize(timeout=600)
        res["both_ways_gbps"] = 2 * nbytes / statistics.median(times) / 1e9
    if under_matmul:
        if device.type != "cuda":
            res["under_matmul"] = {"skipped": "needs a CUDA device"}
        else:
            mm = _Matmuls(device)
            with mm:  # the matmul alone
                time.sleep(1.0)
            alone = mm.tflops
            off_mm, rel_mm = [], []
            with mm:
                for _ in range(reps):
                    round_trip(off_mm, rel_mm)
            res["under_matmul"] = {
                "matmul_tflops_alone": alone,
                "matmul_tflops_during_transfers": mm.tflops,
                "matmul_ratio": mm.tflops / alone,
                "offload_gbps": nbytes / statistics.median(off_mm) / 1e9,
                "reload_gbps": nbytes / statistics.median(rel_mm) / 1e9,
            }
            res["under_matmul"]["offload_ratio_to_idle"] = (
                res["under_matmul"]["offload_gbps"] / res["offload_gbps"])
            res["under_matmul"]["reload_ratio_to_idle"] = (
                res["under_matmul"]["reload_gbps"] / res["reload_gbps"])
    kv.close()  # its device pool is freed before the raw baseline allocates
    raw_d2h, raw_h2d = raw_copy_gbps(nbytes, device, reps)
    res.update(raw_gbps=(raw_d2h + raw_h2d) / 2, raw_d2h_gbps=raw_d2h, raw_h2d_gbps=raw_h2d,
               offload_ratio=res["offload_gbps"] / raw_d2h, reload_ratio=res["reload_gbps"] / raw_h2d)
    if both_ways:
        res["raw_both_ways_gbps"] = raw_both_ways_gbps(nbytes, device, reps)
        res["both_ways_ratio"] = res["both_ways_gbps"] / res["raw_both_ways_gbps"]
    return res


def _refused():
    raise AssertionError("reload refused although the pages are free")


def _page_list(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--page-kib wants integers like 2048,128,8, got {text!r}") from None
    if not sizes:
        raise argparse.ArgumentTypeError("--page-kib needs at least one size")
    for s in sizes:
        try:
            geometry_for(s)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return sizes


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--page-kib", type=_page_list, default=[DEFAULT_PAGE_KIB],
                    help="comma-separated page sizes in KiB (default 2048)")
    ap.add_argument("--both-ways", action="store_true",
                    help="also offload one request while reloading another")
    ap.add_argument("--under-matmul", action="store_true",
                    help="also measure while a matmul runs on another stream (GPU only)")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.gib <= 0:
        ap.error("--reps must be >= 1 and --gib > 0")
    device = torch.device(a.device)
    results = [measure(device, kib, a.gib, a.reps, a.both_ways, a.under_matmul)
               for kib in a.page_kib]
    first = results[0]
    res = {k: first[k] for k in ("bytes", "pages", "page_bytes", "scattered_runs", "offload_gbps",
                                 "reload_gbps", "raw_gbps", "raw_d2h_gbps", "raw_h2d_gbps",
                                 "offload_ratio", "reload_ratio")}
    res["device"] = str(device)
    if len(results) > 1 or a.both_ways or a.under_matmul:
        res["by_page_kib"] = results
    rows = []
    for r in results:
        tag = "" if len(results) == 1 else f" {r['page_kib']} KiB"
        rows.append((f"offload (device->host){tag}", r["offload_gbps"], r["raw_d2h_gbps"],
                     r["offload_ratio"]))
        rows.append((f"reload (host->device){tag}", r["reload_gbps"], r["raw_h2d_gbps"],
                     r["reload_ratio"]))
        if "both_ways_gbps" in r:
            rows.append((f"both ways at once{tag}", r["both_ways_gbps"], r["raw_both_ways_gbps"],
                         r["both_ways_ratio"]))
    print(table(rows, ("move", "GB/s", "raw GB/s", "ratio")))
    for r in results:
        page = (f"{r['page_bytes'] >> 20} MiB" if r["page_bytes"] >= 1 << 20
                else f"{r['page_bytes'] >> 10} KiB")
        print(f"{r['bytes'] / 2**30:.2f} GiB in {r['pages']} pages of {page}, "
              f"scattered across {r['scattered_runs']} non-adjacent runs, on {device}")
        um = r.get("under_matmul")
        if um is not None:
            if "skipped" in um:
                print(f"  under matmul: skipped ({um['skipped']})")
            else:
                print(f"  under matmul: offload {um['offload_gbps']:.2f} GB/s "
                      f"({um['offload_ratio_to_idle']:.2f} of idle), reload {um['reload_gbps']:.2f} "
                      f"GB/s ({um['reload_ratio_to_idle']:.2f}); matmul {um['matmul_ratio']:.2f} "
                      "of its rate alone")
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
