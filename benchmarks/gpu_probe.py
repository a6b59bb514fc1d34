"""GPU probes: was the host slab pinned to exactly its size, and do NVML and torch agree?

    python benchmarks/gpu_probe.py --out probe.json

- ``pinning``: builds a cache whose host tier is 37 pages (not a power of two)
  and reports how the slab was pinned as the cache says (``kv.host_pinning``,
  a ``PinOutcome``: mode ``exact`` / ``torch-rounded`` / ``not-pinned``, bytes,
  error), next to what torch's pinned caching allocator saw meanwhile
  (``torch.cuda.memory.host_memory_stats``): an exact ``cudaHostRegister`` of
  the slab leaves torch's allocator untouched, ``pin_memory()`` grows it by the
  size rounded up to a power of two. ``exact`` is true only if both agree.
- ``pressure``: for every visible CUDA device, ``NvmlPressure(i)`` (found by
  UUID; ``mode`` says whether MIG made it read ``mem_get_info``) against
  ``TorchCudaPressure(i)``, before and after allocating a fifth of the free
  memory on that device, and ``cache_pressure(kv)`` for a cache on it. With
  two or more devices, a child process under a reversed
  ``CUDA_VISIBLE_DEVICES`` checks that ``NvmlPressure(0)`` finds the UUID of
  the parent's last device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tiering.control.pressure import NvmlPressure
s = NvmlPressure(0)
print(json.dumps({"uuid": s.uuid, "nvml_index": s.nvml_index, "available": s.available}))
"""


def _numeric(d) -> dict:
    return {k: v for k, v in (d or {}).items() if isinstance(v, (int, float))}


def pinning(torch, device) -> dict:
    from tiering.resources.kv_cache import PagedKVCache
    from tiering.resources.kv_geometry import KVGeometry

    geom = KVGeometry(num_layers=8, num_kv_heads=8, head_dim=128, page_tokens=16)
    host_pages = 37
    expected = host_pages * geom.page_bytes
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    before = _numeric(stats()) if stats else {}
    kv = PagedKVCache(geom, device=device, device_pages=8, host_pages=host_pages)
    try:
        after = _numeric(stats()) if stats else {}
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        outcome = getattr(kv, "host_pinning", None)
        reported = None if outcome is None else {
            "mode": getattr(getattr(outcome, "mode", None), "value", str(getattr(outcome, "mode", None))),
            "nbytes": getattr(outcome, "nbytes", None),
            "error": getattr(outcome, "error", None),
        }
        grew = max((v for k, v in delta.items() if "allocated_bytes" in k or "reserved" in k),
                   default=0)
        return {
            "expected_bytes": expected,
            "reported": reported,
            "reported_missing": outcome is None,  # the cache has no host_pinning yet
            "torch_host_allocator_delta": delta,
            "torch_host_allocator_grew_bytes": grew,
            "host_memory_stats_available": stats is not None,
            "exact": bool(reported and reported["mode"] == "exact"
                          and reported["nbytes"] == expected and grew < expected),
        }
    finally:
        kv.close()


def pressure(torch) -> dict:
    from tiering.resources.kv_cache import PagedKVCache
    from tiering.resources.kv_geometry import KVGeometry

    from tiering.control.pressure import NvmlPressure, TorchCudaPressure, cache_pressure

    out = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "devices": []}
    uuids = []
    for i in range(torch.cuda.device_count()):
        nv, tc = NvmlPressure(i), TorchCudaPressure(i)
        entry = {"index": i, "nvml_uuid": nv.uuid, "nvml_index": nv.nvml_index, "mode": nv.mode,
                 "torch_uuid": str(torch.cuda.get_device_properties(i).uuid),
                 "nvml_health": nv.health()._asdict(), "torch_health": tc.health()._asdict()}
        uuids.append(nv.uuid)
        b_nv, b_tc = nv.read_bytes(), tc.read_bytes()
        free, _ = torch.cuda.mem_get_info(i)
        block = torch.empty(int(free * 0.2), dtype=torch.uint8, device=f"cuda:{i}")
        torch.cuda.synchronize(i)
        a_nv, a_tc = nv.read_bytes(), tc.read_bytes()
        entry.update(
            allocated_bytes=block.numel(),
            nvml_before=b_nv, nvml_after=a_nv, torch_before=b_tc, torch_after=a_tc,
            nvml_delta=None if not (a_nv and b_nv) else a_nv[0] - b_nv[0],
            torch_delta=None if not (a_tc and b_tc) else a_tc[0] - b_tc[0],
            nvml_minus_torch_used=None if not (a_nv and a_tc) else a_nv[0] - a_tc[0],
        )
        del block
        torch.cuda.empty_cache()
        geom = KVGeometry(num_layers=4, num_kv_heads=8, head_dim=128, page_tokens=16)
        kv = PagedKVCache(geom, device=f"cuda:{i}", device_pages=256, host_pages=8)
        try:
            comp = cache_pressure(kv)
            entry["cache_pressure"] = {"name": comp.name, "reading": comp.read(),
                                       "sources": {s.name: s.read() for s in comp.sources}}
        finally:
            kv.close()
        nv.close()
        out["devices"].append(entry)
    if len(uuids) >= 2:
        order = ",".join(str(i) for i in reversed(range(len(uuids))))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": order}
        got = subprocess.run([sys.executable, "-c", _CHILD, str(Path(__file__).resolve().parent.parent)],
                             capture_output=True, text=True, timeout=60, env=env)
        child = json.loads(got.stdout) if got.returncode == 0 else {"error": got.stderr[-2000:]}
        out["permuted_child"] = {"cuda_visible_devices": order, **child,
                                 "matches_parent_last": child.get("uuid") == uuids[-1]}
    else:
        out["permuted_child"] = {"skipped": "one visible device"}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        res = {"status": "skipped", "reason": "needs a CUDA device"}
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
        print("gpu_probe: skipped (no CUDA device)")
        return res
    res: dict = {"status": "ok"}
    for name, fn in (("pinning", lambda: pinning(torch, a.device)), ("pressure", lambda: pressure(torch))):
        try:
            res[name] = fn()
        except Exception as err:  # report, keep going
            res[name] = {"error": f"{type(err).__name__}: {err}"}
            res["status"] = "failed"
    Path(a.out).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps(res, indent=1, default=str)[:4000])
    return res


if __name__ == "__main__":
    sys.exit(0 if main()["status"] in ("ok", "skipped") else 1)
