"""Race probes on a GPU: moves that overlap kernels still queued on the engine's compute stream.

    python benchmarks/gpu_race.py --out race.json [--trials 5] [--sleep-ms 150]

Each probe keeps the engine's named (non-default) compute stream busy with
``torch.cuda._sleep`` and queues a KV write behind it, then asks the cache for
a move while that write has not run yet, and checks the bytes bit for bit.

- ``reload_into_freed_slots``: request ``old`` holds every device
  page and has a write queued for it; ``remove_request("old")`` frees the
  pages at once and ``reload("new")`` lands in exactly those pages. The
  reload's host-to-device copy must wait for the compute stream, or the old
  owner's queued write lands on top of the new owner's KV. A cache whose reload
  recorded no marker would let its copy run while the write is still queued, and
  this probe FAILS there (``new`` reads the old owner's bytes).
- ``offload_while_writing``: request ``a`` has a write queued on the
  compute stream when ``offload("a")`` is asked for on the step thread (whose
  current stream is the default one). The device-to-host copy must wait for
  the *named* compute stream. A cache that recorded its marker on the current
  stream, which has nothing queued, would let the copy take the stale KV, and
  this probe FAILS there (after the reload, ``a`` reads the bytes from before
  the write).

Every trial records whether the queued kernel was still pending when the move
was asked for (else the trial proves nothing: ``conclusive``). A control run of
each probe uses a cache that is not told the compute stream; it must show
corruption, proving the probe can see the race (``control_detected_race``).
The probes use ``PagedKVCache(..., compute_stream=...)``; where the cache does
not accept it, the probe runs without it and reports
``compute_stream_supported: false``.

``status`` is ``pass`` (every trial exact and conclusive, and the control saw
the race), ``fail`` (a trial's bytes differ), or ``inconclusive``. On a machine
without CUDA the JSON says the probes were skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Trial(NamedTuple):
    """One attempt: were the bytes exact, and did it test anything."""

    exact: bool
    mismatched_bytes: int
    pending_at_call: bool  # the queued kernel had not finished when the move was asked for
    overlap_pages: int | None  # reload_into_freed_slots: pages of the reload that the old owner held


def verdict(trials: list[Trial], controls: list[Trial]) -> dict:
    """Summarise a probe: ``pass`` only when every trial is exact and
    conclusive and the control run caught the race."""
    conclusive = [t.pending_at_call and (t.overlap_pages is None or t.overlap_pages > 0)
                  for t in trials]
    control_caught = any(not c.exact for c in controls)
    if any(not t.exact for t in trials):
        status = "fail"
    elif trials and all(conclusive) and control_caught:
        status = "pass"
    else:
        status = "inconclusive"
    return {
        "status": status,
        "trials": len(trials),
        "exact": sum(t.exact for t in trials),
        "conclusive": sum(conclusive),
        "mismatched_bytes": [t.mismatched_bytes for t in trials],
        "pending_at_call": [t.pending_at_call for t in trials],
        "overlap_pages": [t.overlap_pages for t in trials],
        "control_trials": len(controls),
        "control_detected_race": control_caught,
        "control_mismatched_bytes": [c.mismatched_bytes for c in controls],
    }


def _mismatch(torch, got, want) -> int:
    a = got.contiguous().view(torch.uint8).cpu()
    b = want.contiguous().view(torch.uint8).cpu()
    return int((a != b).sum())


def _make_cache(torch, geom, device, pages, compute, tell_stream: bool):
    from tiering.resources.kv_cache import PagedKVCache

    if tell_stream:
        try:
            return PagedKVCache(geom, device=device, device_pages=pages, host_pages=pages,
                                compute_stream=compute), True
        except TypeError as err:
            if "compute_stream" not in str(err):
                raise
    return PagedKVCache(geom, device=device, device_pages=pages, host_pages=pages), False


def _random_kv(torch, geom, tokens, gen, device):
    shape = (tokens, geom.num_kv_heads, geom.head_dim)
    return [(torch.randn(shape, generator=gen).to(geom.dtype).to(device),
             torch.randn(shape, generator=gen).to(geom.dtype).to(device))
            for _ in range(geom.num_layers)]


def _read_all(torch, kv, rid, compute):
    from tiering.resources.engine_types import ResourceStep, StepContext

    with torch.cuda.stream(compute):
        ok = kv.admit(ResourceStep(rid), StepContext())
        assert ok, f"admit({rid}) refused: {ok}"
        out = [kv.read(rid, layer) for layer in range(kv.geometry.num_layers)]
    torch.cuda.synchronize(kv.device)
    return out


def _filled(torch, kv, rid, tokens, gen):
    """Register ``rid`` with ``tokens`` tokens of random K/V written on every layer;
    returns what was written."""
    kv.ingest_request(rid)
    assert kv.allocate(rid, tokens)
    data = _random_kv(torch, kv.geometry, tokens, gen, kv.device)
    for layer, (k, v) in enumerate(data):
        kv.write(rid, layer, 0, k, v)
    return data


def _read_back(torch, kv, rid, compute, want) -> int:
    """Admit and read ``rid`` on ``compute``, check the cache, and count the
    elements that differ from ``want``."""
    got = _read_all(torch, kv, rid, compute)
    bad = sum(_mismatch(torch, gk, wk) + _mismatch(torch, gv, wv)
              for (gk, gv), (wk, wv) in zip(got, want, strict=True))
    kv.check_integrity()
    return bad


def probe_reload_into_freed_slots(torch, geom, device, compute, cycles, gen, tell_stream):
    pages = 32
    tokens = pages * geom.page_tokens
    kv, told = _make_cache(torch, geom, device, pages, compute, tell_stream)
    try:
        want = _filled(torch, kv, "new", tokens, gen)
        torch.cuda.synchronize(device)
        kv.offload("new")
        kv.synchronize(60)
        kv.ingest_request("old")
        assert kv.allocate("old", tokens)  # every device page: the ones "new" will get
        old_pages = set(kv.page_table("old"))
        garbage = _random_kv(torch, geom, tokens, gen, device)
        torch.cuda.synchronize(device)
        with torch.cuda.stream(compute):  # the old owner's kernels, still queued
            torch.cuda._sleep(cycles)
            for layer, (k, v) in enumerate(garbage):
                kv.write("old", layer, 0, k, v)
        kv.remove_request("old")
        assert kv.reload("new"), "reload refused although every page is free"
        pending = not compute.query()
        kv.synchronize(60)
        torch.cuda.synchronize(device)  # let every queued write land before looking
        bad = _read_back(torch, kv, "new", compute, want)  # admitted: has a page table
        overlap = len(old_pages & set(kv.page_table("new")))
        return Trial(bad == 0, bad, pending, overlap), told
    finally:
        torch.cuda.synchronize(device)
        kv.close()


def probe_offload_while_writing(torch, geom, device, compute, cycles, gen, tell_stream):
    pages = 32
    tokens = pages * geom.page_tokens
    kv, told = _make_cache(torch, geom, device, pages, compute, tell_stream)
    try:
        _filled(torch, kv, "a", tokens, gen)
        want = _random_kv(torch, geom, tokens, gen, device)
        torch.cuda.synchronize(device)
        with torch.cuda.stream(compute):  # the engine's step, still writing the KV
            torch.cuda._sleep(cycles)
            for layer, (k, v) in enumerate(want):
                kv.write("a", layer, 0, k, v)
        kv.offload("a")  # asked on the step thread: current stream is the default one
        pending = not compute.query()
        kv.synchronize(60)
        # The queued write now lands on the freed device pages; wait for it so
        # that what comes back can only be what the offload copied.
        compute.synchronize()
        assert kv.reload("a")
        kv.synchronize(60)
        bad = _read_back(torch, kv, "a", compute, want)
        return Trial(bad == 0, bad, pending, None), told
    finally:
        torch.cuda.synchronize(device)
        kv.close()


def sleep_cycles(torch, stream, ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that take about ``ms`` on ``stream``."""
    probe = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        torch.cuda._sleep(probe)
        end.record()
    end.synchronize()
    per_ms = probe / max(start.elapsed_time(end), 1e-3)
    return int(per_ms * ms)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--controls", type=int, default=2)
    ap.add_argument("--sleep-ms", type=float, default=150.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args(argv)
    if a.trials < 1 or a.controls < 1 or a.sleep_ms <= 0:
        ap.error("--trials and --controls must be >= 1 and --sleep-ms > 0")
    import torch

    result: dict = {"probes": {}, "device": a.device}
    if not torch.cuda.is_available():
        result.update(status="skipped", reason="needs a CUDA device")
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        print("gpu_race: skipped (no CUDA device)")
        return result
    from tiering.resources.kv_geometry import KVGeometry

    device = torch.device(a.device)
    torch.cuda.set_device(device)
    geom = KVGeometry(num_layers=4, num_kv_heads=8, head_dim=128, page_tokens=16)
    compute = torch.cuda.Stream(device=device)  # the engine's named compute stream
    cycles = sleep_cycles(torch, compute, a.sleep_ms)
    result.update(sleep_ms=a.sleep_ms, sleep_cycles=cycles, page_bytes=geom.page_bytes)
    gen = torch.Generator().manual_seed(a.seed)
    supported = True
    for name, probe in (("reload_into_freed_slots", probe_reload_into_freed_slots),
                        ("offload_while_writing", probe_offload_while_writing)):
        t0 = time.perf_counter()
        trials, controls = [], []
        try:
            for _ in range(a.trials):
                trial, told = probe(torch, geom, device, compute, cycles, gen, True)
                trials.append(trial)
                supported = supported and told
            for _ in range(a.controls):
                controls.append(probe(torch, geom, device, compute, cycles, gen, False)[0])
            entry = verdict(trials, controls)
        except Exception as err:  # a crash is a failed probe, reported, not a lost run
            entry = {"status": "fail", "error": f"{type(err).__name__}: {err}",
                     **({} if not trials else verdict(trials, controls))}
            entry["status"] = "fail"
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        result["probes"][name] = entry
        print(f"gpu_race: {name:26s} {entry['status']:12s} "
              f"exact {entry.get('exact', 0)}/{entry.get('trials', 0)}, "
              f"control saw race: {entry.get('control_detected_race')}")
    result["compute_stream_supported"] = supported
    statuses = [p["status"] for p in result["probes"].values()]
    result["status"] = ("fail" if "fail" in statuses else
                        "pass" if all(s == "pass" for s in statuses) else "inconclusive")
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["status"] in ("pass", "skipped") else 1)
