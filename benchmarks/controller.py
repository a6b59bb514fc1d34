"""Eviction controller benchmark: the idle step and the victim pick, per policy.

For each built-in policy (made by name with ``policies.make_policy``):

- ``idle_step_us``: median cost of one ``evict_if_needed`` with 10,000 live
  requests, pressure below the high watermark and nothing waiting (target
  <= 20 us). The resource has a host tier, so the cascade check runs too.
- ``pick_100k_ms``: median time to build the candidates of 100,000 idle
  requests, rank them and pick the victims for 1 % of the device, on a fresh
  controller (every Candidate record is built; target <= 20 ms).
- ``pick_100k_warm_ms``: the same pick repeated with nothing changed, when the
  controller reuses the records it built last time.
- ``rank_100k_ms``: the policy's ``rank`` alone on the same 100,000 records,
  for scale: the part of the pick that belongs to the policy.
- ``scan_100k_ms``: the ``reclaimable`` calls and bookkeeping alone for
  100,000 requests (warm, no ranking), the part that belongs to the controller.

Usage: ``python benchmarks/controller.py --out controller.json [--quick] [--repeats N]``

Figures are medians. On a shared machine they move with its load: compare
runs made at the same time, not across days.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import table, write_json  # noqa: E402
from policies import make_policy  # noqa: E402
from tiering.controller import ControllerConfig, EvictionController  # noqa: E402
from tiering.testing import ExactPressure, FakeClock, FakeTieredResource  # noqa: E402
from tiering.types import RequestState  # noqa: E402

POLICIES = {"lru": {}, "priority": {"resource": "kv"}, "largest": {}, "cost": {}}


class LeanResource(FakeTieredResource):
    """The test fake without its per-call counting on the two hooks a pick calls per request."""

    def reclaimable(self, rid: str) -> int:
        return self.size[rid] if self.state[rid] is RequestState.RESIDENT else 0

    def get_offload_priority(self, rid: str) -> float:
        return self.priorities.get(rid, 0.0)


def _populate(n: int, seed: int, fill: float) -> tuple[LeanResource, list[tuple[str, int]]]:
    """A resource holding ``n`` random-sized requests that fill ``fill`` of its device."""
    rng = random.Random(seed)
    sizes = [rng.randint(4096, 65536) for _ in range(n)]
    capacity = int(sum(sizes) / fill) + 1
    res = LeanResource(capacity, host_capacity=capacity, disk_capacity=capacity)
    out = []
    for i, size in enumerate(sizes):
        rid = f"req-{i:06d}"
        res.add(rid, size)
        res.priorities[rid] = rng.random()
        out.append((rid, size))
    return res, out


def _controller(res: LeanResource, rids, policy_name: str, clock: FakeClock):
    policy = make_policy(policy_name, **POLICIES[policy_name])
    ctl = EvictionController(
        {"kv": res}, policy, ExactPressure(res), ControllerConfig(), clock=clock
    )
    rng = random.Random(7)
    for rid, _ in rids:
        ctl.add_request(rid)
        clock.advance(rng.random() * 1e-3)
        ctl.touch(rid)
    clock.advance(5.0)
    return ctl


def idle_step_us(policy_name: str, requests: int, calls: int) -> float:
    clock = FakeClock()
    res, rids = _populate(requests, seed=1, fill=0.5)
    ctl = _controller(res, rids, policy_name, clock)
    running = frozenset(rid for rid, _ in rids[:64])
    evict = ctl.evict_if_needed
    batch = 100
    per_call = []
    for _ in range(max(1, calls // batch)):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            evict(running)
        per_call.append((time.perf_counter_ns() - t0) / batch / 1e3)
    report = evict(running)
    if report.offloaded or report.demoted:
        raise AssertionError("the idle benchmark moved something; pressure was meant to be low")
    return statistics.median(per_call)


def pick_100k(policy_name: str, requests: int, repeats: int) -> dict[str, float]:
    clock = FakeClock()
    res, rids = _populate(requests, seed=2, fill=0.85)
    need = res.device_capacity_bytes // 100
    running = frozenset(rid for rid, _ in rids[:256])
    cold, warm, rank, scan = [], [], [], []
    for _ in range(repeats):
        ctl = _controller(res, rids, policy_name, clock)
        t0 = time.perf_counter()
        victims = ctl.plan_offload(running, need)
        cold.append(time.perf_counter() - t0)
        if not victims or sum(v.reclaimable for v in victims) < need:
            raise AssertionError("the pick did not cover the bytes asked for")
        t0 = time.perf_counter()
        ctl.plan_offload(running, need)
        warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        candidates, _ = ctl._candidates(running, clock())
        scan.append(time.perf_counter() - t0)
        policy = make_policy(policy_name, **POLICIES[policy_name])
        t0 = time.perf_counter()
        policy.rank(candidates, clock())
        rank.append(time.perf_counter() - t0)
    ms = 1e3
    return {
        "pick_100k_ms": statistics.median(cold) * ms,
        "pick_100k_warm_ms": statistics.median(warm) * ms,
        "rank_100k_ms": statistics.median(rank) * ms,
        "scan_100k_ms": statistics.median(scan) * ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh controllers per pick figure")
    args = parser.parse_args(argv)

    idle_requests, pick_requests = 10_000, 100_000
    calls = 2_000 if args.quick else 20_000
    repeats = 1 if args.quick else max(1, args.repeats)
    results: dict[str, dict[str, float]] = {}
    for name in POLICIES:
        entry = {"idle_step_us": idle_step_us(name, idle_requests, calls)}
        entry.update(pick_100k(name, pick_requests, repeats))
        results[name] = entry

    headers = ("policy", "idle_step_us", "pick_100k_ms", "pick_100k_warm_ms",
               "rank_100k_ms", "scan_100k_ms")
    rows = [(name, *(r[h] for h in headers[1:])) for name, r in results.items()]
    print(table(rows, headers))
    write_json(args.out, {
        "benchmark": "controller",
        "policies": results,
        "targets": {"idle_step_us": 20.0, "pick_100k_ms": 20.0},
        "setup": {
            "idle_requests": idle_requests,
            "pick_requests": pick_requests,
            "idle_calls": calls,
            "pick_repeats": repeats,
            "pick_need": "1% of device capacity",
        },
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
