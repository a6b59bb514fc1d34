"""Shared cold tier benchmark against a real SeaweedFS server on loopback.

Part 1, throughput (same obstore client object, same object sizes, same number of requests in
flight, measured in the same run):

- ``demote / raw PUT``: publishing blocks through ``BlockQueue`` (frame + crc32c + keyed
  BLAKE2b MAC + create-if-absent PUT on the I/O threads) against raw ``obstore.put`` of the same
  bytes from a thread pool of the same size;
- ``reload / raw GET``: fetching them back through ``BlockQueue`` (bounded GET + frame check +
  MAC check) against raw ``obstore.get(...).bytes()``;
- the MAC's cost per block: framing and unframing one block with the deployment key against
  without one (``trust="unauthenticated"``: crc32c only), on one thread, beside the time one raw
  PUT and one raw GET of that block took (per request, from the same passes).

Part 2, cross-worker hit rate on the bundled conversation trace
(``benchmarks/traces/mooncake/conversation_trace.jsonl``; each request's ``hash_ids`` are its
prefix blocks, keyed here by chaining them). Requests are split round-robin over four workers.
A request's hits are its leading blocks found in the tier (a prefix match stops at the first
miss); then all its blocks are published.

- ``real``: the first ``--trace-requests`` requests on the real server: four workers, each with
  its own ``SharedBlockStore`` and local cache (it learns the others' blocks by listing every
  ``--refresh-every`` of its requests), every hit read back and compared bitwise; against four
  workers that each keep a private tier (their own root: they never see each other's blocks).
- ``model``: the whole trace, with the tier's total capacity as a fraction of the distinct
  blocks; one shared LRU against four private LRUs of a quarter of that capacity each.

Part 3, the disk tier on ``s3://bucket/prefix`` (``DiskConfig(path="s3://...",
storage_options=...)``: a leased prefix through obstore): ``DiskPageStore.write`` / ``read`` of
whole requests against raw ``obstore.put`` / ``get`` of the same page-sized objects with as
many requests in flight (``io_threads``). The tier stores each page as a zarr chunk (bytes codec
+ crc32c) plus a 76-byte binding record (its MAC), so it makes two PUTs per page where the raw baseline
makes one; every read checks both, and the pages read back are compared bitwise.

Part 4, two ``PagedKVCache`` workers sharing prefixes through the store
(``enable_prefix_cache(root, shared=SharedTierConfig(...))``): the first ``--kv-requests``
requests of the trace (each block is ``page_tokens`` tokens derived from its hash id, at most
``--kv-max-blocks`` blocks a request), round-robin over two caches with the same root. A
request attaches what it can (local blocks, and blocks the other worker published, fetched
from the server), loads them, writes its other pages, publishes and is removed. Its hit tokens
come from ``prefix_stats``: ``hit_tokens_shared`` (cross-worker, through the store) and the
local tiers. Every attached page is compared bitwise with the bytes its key names. The
baseline is the same two caches with no shared tier (each sees only its own blocks), in the
same run. Each worker lists the store every ``--refresh-every`` of its requests (the cache's
clock advances one second a request). After each request the worker waits for its publishes
to land (a stand-in for the model's compute between requests), so the figure measures sharing,
not how fast the store absorbs writes.

Usage: ``python benchmarks/coldtier.py --out coldtier.json [--quick]``
       (``--endpoint URL --key K --secret S`` uses a running store instead of starting one).

Size: a little over 500 lines: the four parts share one server, one client and one report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import obstore  # noqa: E402

from tiering.coldtier import (  # noqa: E402
    BlockQueue,
    BlockStatus,
    ColdTierConfig,
    MacKeys,
    SharedBlockStore,
    TrustConfig,
    open_s3_store,
)
from tiering.coldtier.frame import KIND_BLOCK, frame, unframe  # noqa: E402

TRACE = REPO / "benchmarks" / "traces" / "mooncake" / "conversation_trace.jsonl"


# -- the server -------------------------------------------------------------------------------
class Server:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tiering-weed-bench-"))
        env = dict(os.environ, PYTHON=sys.executable)
        weed = Path(sys.executable).parent / "weed"
        if weed.exists():
            env["WEED"] = str(weed)
        self.env = env
        out = subprocess.run(["bash", str(REPO / "scripts" / "seaweedfs.sh"), "start", str(self.dir), "60"],
                             capture_output=True, text=True, env=env, timeout=120, check=True)
        fields = dict(kv.split("=", 1) for kv in out.stdout.strip().splitlines()[-1].split())
        self.endpoint, self.key, self.secret = fields["endpoint"], fields["access_key"], fields["secret_key"]

    def stop(self) -> None:
        subprocess.run(["bash", str(REPO / "scripts" / "seaweedfs.sh"), "stop", str(self.dir)],
                       capture_output=True, env=self.env, timeout=60, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def options(endpoint: str, key: str, secret: str) -> dict:
    return {"endpoint": endpoint, "key": key, "secret": secret, "region": "us-east-1"}


# -- part 1: throughput -----------------------------------------------------------------------
def mac_cost(block_bytes: int, keys: MacKeys, repeats: int) -> dict:
    """Seconds per block to frame and to unframe one block, with the MAC and without it."""
    key, root, geom = os.urandom(16), os.urandom(16), b"bench-geometry"
    payload = os.urandom(block_bytes)
    n = max(3, min(200, (256 << 20) // block_bytes))  # about 256 MiB a measurement
    out = {}
    for name, k in (("mac", keys), ("crc_only", None)):
        frame_s, unframe_s = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(n):
                data = frame(KIND_BLOCK, key, root, geom, payload, keys=k)
            frame_s.append((time.perf_counter() - t) / n)
            t = time.perf_counter()
            for _ in range(n):
                unframe(KIND_BLOCK, data, key, root, geom, keys=k)
            unframe_s.append((time.perf_counter() - t) / n)
        out[name] = {"frame_s": statistics.median(frame_s), "unframe_s": statistics.median(unframe_s)}
    return out


def throughput(url: str, opts: dict, *, blocks: int, block_bytes: int, threads: int, repeats: int,
               trust: TrustConfig):
    store = open_s3_store(url, opts, timeout_s=60.0)
    rng_data = [os.urandom(block_bytes) for _ in range(blocks)]  # random, never zeros
    # warm-up (unmeasured): a fresh server grows its volumes on the first writes
    with ThreadPoolExecutor(threads) as pool:
        warm = [f"warm/{i}" for i in range(threads * 2)]
        list(pool.map(lambda p: obstore.put(store, p, rng_data[0]), warm))
        list(pool.map(lambda p: obstore.get(store, p).bytes(), warm))
        obstore.delete(store, warm)
    passes = []
    for rep in range(repeats):
        root = hashlib.sha256(f"bench-{rep}-{time.time_ns()}".encode()).digest()[:16]
        keys = [hashlib.sha256(root + i.to_bytes(4, "little")).digest() for i in range(blocks)]
        raw_paths = [f"raw/{root.hex()}/{i}" for i in range(blocks)]
        total = blocks * block_bytes
        with ThreadPoolExecutor(threads) as pool:
            t = time.perf_counter()
            list(pool.map(lambda a: obstore.put(store, a[0], a[1], mode="create"),
                          zip(raw_paths, rng_data, strict=True)))
            raw_put = total / (time.perf_counter() - t)
            t = time.perf_counter()
            got = list(pool.map(lambda p: obstore.get(store, p).bytes(), raw_paths))
            raw_get = total / (time.perf_counter() - t)
            assert all(len(g) == block_bytes for g in got)
            del got
        tier = SharedBlockStore(store, root, b"bench-geometry", trust=trust, block_bytes=block_bytes,
                                config=ColdTierConfig(io_threads=threads, max_queued=blocks,
                                                      max_block_bytes=max(block_bytes, 256 << 20)))
        q = BlockQueue(tier)
        t = time.perf_counter()
        for k, d in zip(keys, rng_data, strict=True):
            assert q.submit_publish(k, d)
        res = q.drain(600)
        demote = total / (time.perf_counter() - t)
        assert all(r.status is BlockStatus.WRITTEN for r in res), {r.status for r in res}
        t = time.perf_counter()
        for k in keys:
            assert q.submit_fetch(k)
        res = q.drain(600)
        reload = total / (time.perf_counter() - t)
        back = {r.key: r.payload for r in res if r.status is BlockStatus.HIT}
        assert len(back) == blocks and all(back[k] == d for k, d in zip(keys, rng_data, strict=True))
        q.close(60)
        obstore.delete(store, raw_paths)
        obstore.delete(store, [tier.path(k) for k in keys])
        passes.append({"raw_put_MBps": raw_put / 1e6, "demote_MBps": demote / 1e6,
                       "raw_put_s_per_block": block_bytes * threads / raw_put,
                       "raw_get_s_per_block": block_bytes * threads / raw_get,
                       "raw_get_MBps": raw_get / 1e6, "reload_MBps": reload / 1e6,
                       "demote_over_put": demote / raw_put, "reload_over_get": reload / raw_get})
    med = {k: statistics.median(p[k] for p in passes) for k in passes[0]}
    return {"blocks": blocks, "block_bytes": block_bytes, "threads": threads, "passes": passes,
            "median": med, "min_demote_over_put": min(p["demote_over_put"] for p in passes),
            "max_demote_over_put": max(p["demote_over_put"] for p in passes),
            "min_reload_over_get": min(p["reload_over_get"] for p in passes),
            "max_reload_over_get": max(p["reload_over_get"] for p in passes)}


# -- part 3: the disk tier on s3:// ----------------------------------------------------------
def disk_tier(url: str, opts: dict, *, requests: int, pages: int, page_bytes: int, threads: int,
              repeats: int, trust: TrustConfig) -> dict:
    import numpy as np
    import torch

    from tiering.disk import DiskConfig, DiskPageStore

    elems = page_bytes // 2
    rng = np.random.default_rng(5)
    data = [torch.from_numpy(rng.integers(0, 1 << 16, (pages, elems), dtype=np.uint16).astype(np.int16))
            .view(torch.bfloat16) for _ in range(requests)]  # random bits, never zeros
    total = requests * pages * page_bytes
    passes = []
    for rep in range(repeats):
        cfg = DiskConfig(path=f"{url}/{rep}", capacity_bytes=total, io_threads=threads,
                         chunk_bytes=page_bytes, storage_options={**opts, "timeout_s": 60.0},
                         trust=trust)
        store = DiskPageStore(cfg, (elems,), torch.bfloat16)
        raw = open_s3_store(f"{url}/raw-{rep}", opts, timeout_s=60.0)
        raw_pages = [bytes(d[i].view(torch.int16).numpy().tobytes()) for d in data for i in range(pages)]
        try:
            with ThreadPoolExecutor(threads) as pool:
                t = time.perf_counter()
                list(pool.map(lambda a, s=raw: obstore.put(s, f"p/{a[0]}", a[1]), enumerate(raw_pages)))
                raw_put = total / (time.perf_counter() - t)
                t = time.perf_counter()
                got = list(pool.map(lambda i, s=raw: obstore.get(s, f"p/{i}").bytes(), range(len(raw_pages))))
                raw_get = total / (time.perf_counter() - t)
                assert all(len(g) == page_bytes for g in got)
            extents = [store.reserve(f"r{i}", pages) for i in range(requests)]
            t = time.perf_counter()
            for ext, d in zip(extents, data, strict=True):
                store.write(ext, d)
            write = total / (time.perf_counter() - t)
            outs = [torch.empty_like(d) for d in data]
            t = time.perf_counter()
            for ext, out in zip(extents, outs, strict=True):
                store.read(ext, out)
            read = total / (time.perf_counter() - t)
            mismatches = sum(not torch.equal(o.view(torch.int16), d.view(torch.int16))  # bitwise (NaNs too)
                             for o, d in zip(outs, data, strict=True))
            assert mismatches == 0, f"{mismatches} requests read back different bytes"
        finally:
            store.close()
            obstore.delete(raw, [f"p/{i}" for i in range(len(raw_pages))])
        passes.append({"raw_put_MBps": raw_put / 1e6, "write_MBps": write / 1e6,
                       "raw_get_MBps": raw_get / 1e6, "read_MBps": read / 1e6,
                       "write_over_put": write / raw_put, "read_over_get": read / raw_get})
    med = {k: statistics.median(p[k] for p in passes) for k in passes[0]}
    return {"requests": requests, "pages": pages, "page_bytes": page_bytes, "threads": threads,
            "passes": passes, "median": med,
            "range_write_over_put": [min(p["write_over_put"] for p in passes),
                                     max(p["write_over_put"] for p in passes)],
            "range_read_over_get": [min(p["read_over_get"] for p in passes),
                                    max(p["read_over_get"] for p in passes)]}


# -- part 2: hit rate -------------------------------------------------------------------------
def load_trace(limit: int | None = None) -> list[list[bytes]]:
    """Each request's chained block keys (a key depends on every block before it)."""
    out = []
    with open(TRACE) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"]
            key, keys = b"trace-root", []
            for h in ids:
                key = hashlib.sha256(key + int(h).to_bytes(8, "little")).digest()
                keys.append(key)
            out.append(keys)
            if limit is not None and len(out) >= limit:
                break
    return out


def load_hash_ids(limit: int) -> list[list[int]]:
    out = []
    with open(TRACE) as f:
        for line in f:
            out.append([int(h) for h in json.loads(line)["hash_ids"]])
            if len(out) >= limit:
                break
    return out


def payload_of(key: bytes, size: int) -> bytes:
    return hashlib.shake_256(key).digest(size)  # random-looking, fixed by the key


def real_hit_rate(url: str, opts: dict, reqs: list[list[bytes]], *, shared: bool, workers: int,
                  refresh_every: int, block_bytes: int, trust: TrustConfig) -> dict:
    store = open_s3_store(url, opts, timeout_s=30.0)
    tiers = []
    for w in range(workers):
        root = b"shared-root" if shared else f"private-root-{w}".encode()
        tiers.append(SharedBlockStore(store, root, b"g", trust=trust))
    hits = total = mismatches = 0
    done = [0] * workers
    for i, keys in enumerate(reqs):
        w = i % workers
        t = tiers[w]
        if done[w] % refresh_every == 0:
            t.refresh_index()
        done[w] += 1
        n = 0
        for k in keys:
            if k not in t.known:
                break
            r = t.fetch(k)
            if r.status is not BlockStatus.HIT:
                break
            mismatches += r.payload != payload_of(k, block_bytes)
            n += 1
        hits += n
        total += len(keys)
        for k in keys[n:]:
            t.publish(k, payload_of(k, block_bytes))
    return {"requests": len(reqs), "blocks": total, "hits": hits, "hit_rate": hits / total,
            "mismatches": mismatches}


def model_hit_rate(reqs: list[list[bytes]], capacity: int, workers: int, shared: bool) -> float:
    tiers = [OrderedDict() for _ in range(1 if shared else workers)]
    cap = capacity if shared else max(1, capacity // workers)
    hits = total = 0
    for i, keys in enumerate(reqs):
        lru = tiers[0 if shared else i % workers]
        n = 0
        for k in keys:
            if k not in lru:
                break
            lru.move_to_end(k)
            n += 1
        hits += n
        total += len(keys)
        for k in keys[n:]:
            lru[k] = True
            if len(lru) > cap:
                lru.popitem(last=False)
    return hits / total


# -- part 4: two PagedKVCache workers sharing prefixes --------------------------------------
def kv_share(url: str | None, opts: dict, reqs: list[list[int]], *, max_blocks: int,
             refresh_every: int, trust: TrustConfig) -> dict:
    """Two caches with one root, requests round-robin; ``url`` None: no shared tier."""
    import torch
    from tiering.resources.base import ResourceStep, StepContext
    from tiering.resources.kv_cache import PagedKVCache
    from tiering.resources.kv_geometry import KVGeometry

    from tiering.blocks import KeyRoot
    from tiering.coldtier import SharedTierConfig

    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=4)
    T = g.page_tokens

    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    def page_of(key: bytes) -> torch.Tensor:  # random-looking bytes fixed by the key
        raw = bytearray(hashlib.shake_256(key).digest(g.page_bytes))
        return torch.frombuffer(raw, dtype=torch.int16).view(g.dtype).reshape(g.page_shape)

    root = KeyRoot(g.fingerprint(), "bench", page_tokens=T)
    clocks = [Clock(), Clock()]
    pages = max_blocks + 2
    caches = [PagedKVCache(g, "cpu", device_pages=pages, host_pages=4 * pages, clock=c) for c in clocks]
    try:
        for kv in caches:
            shared = SharedTierConfig(url, opts, trust=trust) if url is not None else None
            kv.enable_prefix_cache(root, shared=shared, shared_refresh_s=float(refresh_every))
            kv.synchronize(60)
        tokens = hits_shared = hits_local = mismatches = 0
        t0 = time.perf_counter()
        for i, hids in enumerate(reqs):
            w = i % 2
            kv, clocks[w].t = caches[w], clocks[w].t + 1.0
            ids = [int(h) * T + j for h in hids[:max_blocks] for j in range(T)] + [0]
            rid = f"r{i}"
            kv.poll()
            before = kv.prefix_stats()
            kv.ingest_request(rid)
            kv.attach_prefix(rid, ids)
            if kv.is_offloaded(rid):
                kv.synchronize(60)
                if not kv.reload(rid):
                    raise RuntimeError(f"{rid}: the device could not take its prefix")
                kv.synchronize(60)
            if not kv.admit(ResourceStep(rid), StepContext()):
                raise RuntimeError(f"{rid}: not admitted after its load")
            after = kv.prefix_stats()
            got = kv.num_tokens(rid)
            local = sum(after[f"hit_tokens_{t}"] - before[f"hit_tokens_{t}"] for t in ("device", "host", "disk"))
            hits_local += min(local, got)  # local blocks come first; the rest came from the store
            hits_shared += got - min(local, got)
            keys = kv._prefix.keys(ids)
            for layer in range(g.num_layers):
                k, v = kv.read(rid, layer)
                for p in range(got // T):
                    want = page_of(keys[p])[layer]
                    mismatches += not (torch.equal(k[p * T:(p + 1) * T].view(torch.int16), want[0].view(torch.int16))
                                       and torch.equal(v[p * T:(p + 1) * T].view(torch.int16), want[1].view(torch.int16)))
            if not kv.allocate(rid, len(ids)):
                raise RuntimeError(f"{rid}: no device room for its own pages")
            for p in range(got // T, len(keys)):
                page = page_of(keys[p])
                for layer in range(g.num_layers):
                    kv.write(rid, layer, p * T, page[layer, 0], page[layer, 1])
            kv.publish_prefix(rid, ids)
            kv.remove_request(rid)
            kv.synchronize(60)  # its publishes land: a stand-in for the model's time between requests
            tokens += len(keys) * T
        elapsed = time.perf_counter() - t0
        for kv in caches:
            kv.synchronize(60)
        stats = [kv.prefix_stats() for kv in caches]
    finally:
        for kv in caches:
            kv.close()
    return {"requests": len(reqs), "tokens": tokens, "hit_tokens_local": hits_local,
            "hit_tokens_cross_worker": hits_shared, "hit_rate": (hits_local + hits_shared) / tokens,
            "mismatches": mismatches, "seconds": elapsed,
            "shared_published": sum(st.get("shared_published", 0) for st in stats),
            "shared_fetched": sum(st.get("shared_fetched", 0) for st in stats),
            # publishes not written (queue full, store not answering): they lower the cross-worker hits
            "shared_publish_refused": sum(st.get("shared_publish_refused", 0) for st in stats),
            "shared_publish_failed": sum(st.get("shared_publish_failed", 0) for st in stats),
            "shared_unavailable": sum(st.get("shared_unavailable", 0) for st in stats)}


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def vs_raw(rows: list[tuple[str, float, float, float, tuple[float, float]]]) -> str:
    """A table of (operation, tier MB/s, raw MB/s, median ratio, (lowest, highest) ratio)."""
    return table([[op, f"{tier:.0f}", f"{raw:.0f}", f"{ratio:.2f} ({lo:.2f}-{hi:.2f})"]
                  for op, tier, raw, ratio, (lo, hi) in rows],
                 ["operation", "tier MB/s", "raw MB/s", "ratio"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--block-mib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace-requests", type=int, default=600)
    ap.add_argument("--refresh-every", type=int, default=8)
    ap.add_argument("--trace-block-bytes", type=int, default=2048)
    ap.add_argument("--disk-requests", type=int, default=8)
    ap.add_argument("--disk-pages", type=int, default=16)
    ap.add_argument("--disk-page-kib", type=int, default=256)
    ap.add_argument("--kv-requests", type=int, default=300)
    ap.add_argument("--kv-max-blocks", type=int, default=48)
    ap.add_argument("--endpoint")
    ap.add_argument("--key")
    ap.add_argument("--secret")
    ap.add_argument("--bucket", default="tiering")
    a = ap.parse_args(argv)
    if a.quick:
        a.blocks, a.block_mib, a.repeats, a.trace_requests = 6, 1.0, 1, 120
        a.disk_requests, a.disk_pages, a.kv_requests = 2, 4, 60
    server = None
    if a.endpoint:
        opts = options(a.endpoint, a.key or "", a.secret or "")
    else:
        server = Server()
        opts = options(server.endpoint, server.key, server.secret)
    trust = TrustConfig(secret=os.urandom(32))  # this run's deployment secret
    block_bytes = int(a.block_mib * (1 << 20))
    try:
        run = f"bench-{time.time_ns()}"
        tp = throughput(f"s3://{a.bucket}/{run}/tp", opts, blocks=a.blocks, trust=trust,
                        block_bytes=block_bytes, threads=a.threads, repeats=a.repeats)
        mac = mac_cost(block_bytes, trust.keys(), a.repeats)
        disk = disk_tier(f"s3://{a.bucket}/{run}/disk", opts, requests=a.disk_requests,
                         pages=a.disk_pages, page_bytes=a.disk_page_kib << 10, threads=a.threads,
                         repeats=a.repeats, trust=trust)
        reqs = load_trace()
        head = reqs[: a.trace_requests]
        real = {
            "shared": real_hit_rate(f"s3://{a.bucket}/{run}/shared", opts, head, shared=True, workers=4,
                                    refresh_every=a.refresh_every, block_bytes=a.trace_block_bytes,
                                    trust=trust),
            "private": real_hit_rate(f"s3://{a.bucket}/{run}/private", opts, head, shared=False,
                                     workers=4, refresh_every=a.refresh_every,
                                     block_bytes=a.trace_block_bytes, trust=trust),
        }
        # the same requests through the LRU model with no cap and no listing lag: the ceiling
        head_distinct = len({k for r in head for k in r})
        for name, shared in (("shared", True), ("private", False)):
            real[name]["model_no_lag"] = model_hit_rate(head, head_distinct * 4, 4, shared)
        hids = load_hash_ids(a.kv_requests)
        kv = {"two, shared tier": kv_share(f"s3://{a.bucket}/{run}/kv", opts, hids, trust=trust,
                                           max_blocks=a.kv_max_blocks, refresh_every=a.refresh_every),
              "two, no shared tier": kv_share(None, opts, hids, max_blocks=a.kv_max_blocks,
                                              refresh_every=a.refresh_every, trust=trust)}
        distinct = len({k for r in reqs for k in r})
        model = []
        for frac in (0.02, 0.05, 0.1, 0.25, 1.0):
            cap = max(4, int(distinct * frac))
            model.append({"capacity_fraction": frac, "capacity_blocks": cap,
                          "shared": model_hit_rate(reqs, cap, 4, True),
                          "private": model_hit_rate(reqs, cap, 4, False)})
    finally:
        if server is not None:
            server.stop()
    m = tp["median"]
    print(f"throughput: {tp['blocks']} blocks of {tp['block_bytes'] / (1 << 20):.1f} MiB, "
          f"{tp['threads']} in flight, {a.repeats} passes (medians; ratio range in brackets)")
    print(vs_raw([
        ("demote / raw PUT", m["demote_MBps"], m["raw_put_MBps"], m["demote_over_put"],
         (tp["min_demote_over_put"], tp["max_demote_over_put"])),
        ("reload / raw GET", m["reload_MBps"], m["raw_get_MBps"], m["reload_over_get"],
         (tp["min_reload_over_get"], tp["max_reload_over_get"])),
    ]))
    put_s, get_s = m["raw_put_s_per_block"], m["raw_get_s_per_block"]
    print(f"\nMAC cost per block of {block_bytes / (1 << 20):.1f} MiB (one thread, medians), beside one raw"
          " request of that block (its latency in the passes above, with the same requests in flight):")
    mc, co = mac["mac"], mac["crc_only"]
    print(table([
        ["frame (publish)", f"{co['frame_s'] * 1e3:.2f}", f"{mc['frame_s'] * 1e3:.2f}",
         f"{(mc['frame_s'] - co['frame_s']) * 1e3:.2f}", f"{put_s * 1e3:.2f}",
         f"{(mc['frame_s'] - co['frame_s']) / put_s:.3f}"],
        ["unframe (fetch)", f"{co['unframe_s'] * 1e3:.2f}", f"{mc['unframe_s'] * 1e3:.2f}",
         f"{(mc['unframe_s'] - co['unframe_s']) * 1e3:.2f}", f"{get_s * 1e3:.2f}",
         f"{(mc['unframe_s'] - co['unframe_s']) / get_s:.3f}"],
    ], ["step", "crc only ms", "crc + MAC ms", "MAC ms", "raw request ms", "MAC / raw request"]))
    d = disk["median"]
    print(f"\ndisk tier on s3://: {disk['requests']} requests of {disk['pages']} pages of "
          f"{disk['page_bytes'] >> 10} KiB, {disk['threads']} in flight, {a.repeats} passes")
    print(vs_raw([
        ("write / raw PUT", d["write_MBps"], d["raw_put_MBps"], d["write_over_put"],
         disk["range_write_over_put"]),
        ("read / raw GET", d["read_MBps"], d["raw_get_MBps"], d["read_over_get"],
         disk["range_read_over_get"]),
    ]))
    print(f"\ncross-worker hit rate, real server, first {len(head)} requests, 4 workers round-robin:")
    print(table([[k, str(v["blocks"]), str(v["hits"]), f"{v['hit_rate']:.3f}",
                  f"{v['model_no_lag']:.3f}", str(v["mismatches"])] for k, v in real.items()],
                ["tier", "blocks", "hits", "hit rate", "model, no listing lag", "mismatches"]))
    print(f"\nhit rate, whole trace ({len(reqs)} requests, {distinct} distinct blocks), LRU model:")
    print(table([[f"{r['capacity_fraction']:.2f}", str(r["capacity_blocks"]), f"{r['shared']:.3f}",
                  f"{r['private']:.3f}", f"{r['shared'] / r['private']:.2f}" if r["private"] else "inf"]
                 for r in model], ["capacity/distinct", "blocks", "shared", "4 private", "shared/private"]))
    base = kv["two, no shared tier"]
    print(f"\ntwo PagedKVCache workers, first {base['requests']} requests round-robin, "
          f"at most {a.kv_max_blocks} blocks each (hit tokens; baseline: no shared tier, same run):")
    print(table([[k, str(v["tokens"]), str(v["hit_tokens_local"]), str(v["hit_tokens_cross_worker"]),
                  f"{v['hit_rate']:.3f}", f"{v['hit_rate'] / base['hit_rate']:.2f}"
                  if base["hit_rate"] else "inf", str(v["mismatches"]),
                  str(v["shared_publish_refused"] + v["shared_publish_failed"])]
                 for k, v in kv.items()],
                ["workers", "tokens", "local hit tokens", "cross-worker hit tokens", "hit rate",
                 "vs no shared tier", "mismatches", "publishes not written"]))
    result = {"throughput": tp, "mac_cost_per_block": mac, "disk_tier_s3": disk, "hit_rate_real": real, "hit_rate_model": model,
              "kv_workers": kv,
              "trace": str(TRACE.relative_to(REPO)), "args": vars(a)}
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
