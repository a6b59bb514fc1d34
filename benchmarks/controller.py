"""Eviction controller benchmark: the idle and busy steps and the victim pick, per policy.

For each built-in policy (made by name with ``tiering.policies.make_policy``):

- ``idle_step_us``: median cost of one ``evict_if_needed`` with 10,000 live
  requests, pressure below the high watermark and nothing waiting (target
  <= 20 us). The resource has a host tier, so the cascade check runs too.
- ``busy_step_us``: median cost of one ``evict_if_needed`` with 10,000 live
  requests, pressure above the high watermark and every request running, so
  that there is nothing it may offload; the same frozenset is passed each
  call, as a worker that rebuilds it only when its batch changes would.
- ``busy_step_set_us``: the same, with the running requests passed as a
  (mutable) set, which the controller must compare with the ones it saw.
- ``busy_step_rescan_us``: ``busy_step_us`` with the finding of nothing to
  offload switched off (every call over ``high`` scans again): what the scan
  reuse saves.
- ``busy_batch_step_us``: the same pressure with 256 of the 10,000 running
  (passed as a set) and the rest offloaded to host, so none is reclaimable.
- ``pick_100k_ms``: median time of ``plan_offload`` for 1 % of the device
  among 100,000 idle requests, on a fresh controller (target <= 20 ms): the
  candidate columns, the resource's answers (``reclaimable_many`` where the
  resource offers it), the policy's order of the prefix it needs, and the
  victims' ``Candidate`` records.
- ``pick_100k_warm_ms``: the same pick again on the same controller.
- ``pick_100k_one_by_one_ms``: the cold pick on a resource without the
  optional ``reclaimable_many`` / ``get_offload_priority_many`` hooks, asked
  one request at a time: for bytes lazily, only for the rows walked, by lru
  and priority; all up front by largest and cost.
- ``scan_100k_ms``: the controller's part alone: the candidate columns and
  the resource's answers, for 100,000 requests.
- ``order_100k_ms``: ``Policy.order`` of all 100,000 rows of that batch (the
  whole order, which a pick never needs), for scale.
- ``rank_100k_ms``: ``Policy.rank`` on 100,000 ``Candidate`` records (the
  object API: columns gathered from the records, then ``order``), for scale.

Usage: ``python benchmarks/controller.py --out controller.json [--quick] [--repeats N]
[--baseline BEFORE.json]``. With ``--baseline`` (the JSON of a run of another
commit made just before, on the same machine) it also prints and records each
figure as a ratio to that run's (``after / before``; below 1 is faster).

Figures are medians. On a shared machine they move with its load: compare
runs made at the same time, not across days.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiering.policies import Candidate, make_policy  # noqa: E402

from benchmarks._report import table, write_json  # noqa: E402
from tiering.control.controller import ControllerConfig, EvictionController  # noqa: E402
from tiering.testing import ExactPressure, FakeClock, FakeTieredResource  # noqa: E402
from tiering.types import RequestState, Tier  # noqa: E402

POLICIES = {"lru": {}, "priority": {"resource": "kv"}, "largest": {}, "cost": {}}


class LeanResource(FakeTieredResource):
    """The test fake without its per-call counting on the two hooks a pick calls per request."""

    def reclaimable(self, rid: str) -> int:
        return self.size[rid] if self.state[rid] is RequestState.RESIDENT else 0

    def get_offload_priority(self, rid: str) -> float:
        return self.priorities.get(rid, 0.0)


class OneByOneResource(LeanResource):
    """``LeanResource`` without the optional ``*_many`` hooks: asked one request at a time."""

    reclaimable_many = None
    get_offload_priority_many = None


def _populate(
    n: int, seed: int, fill: float, cls: type[LeanResource] = LeanResource
) -> tuple[LeanResource, list[tuple[str, int]]]:
    """A resource holding ``n`` random-sized requests that fill ``fill`` of its device."""
    rng = random.Random(seed)
    sizes = [rng.randint(4096, 65536) for _ in range(n)]
    capacity = int(sum(sizes) / fill) + 1
    res = cls(capacity, host_capacity=capacity, disk_capacity=capacity)
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


def _per_call_us(evict, running, calls: int, batch: int = 100) -> float:
    """Median cost of ``evict(running)`` in microseconds, over batches of ``batch`` calls."""
    per_call = []
    for _ in range(max(1, calls // batch)):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            evict(running)
        per_call.append((time.perf_counter_ns() - t0) / batch / 1e3)
    return statistics.median(per_call)


def idle_step_us(policy_name: str, requests: int, calls: int) -> float:
    clock = FakeClock()
    res, rids = _populate(requests, seed=1, fill=0.5)
    ctl = _controller(res, rids, policy_name, clock)
    running = frozenset(rid for rid, _ in rids[:64])
    per_call = _per_call_us(ctl.evict_if_needed, running, calls)
    report = ctl.evict_if_needed(running)
    if report.offloaded or report.demoted:
        raise AssertionError("the idle benchmark moved something; pressure was meant to be low")
    return per_call


def _check_busy(ctl: EvictionController, running) -> None:
    report = ctl.evict_if_needed(running)
    if report.pressure_before <= ctl.config.high or report.offloaded or report.demoted:
        raise AssertionError("the busy benchmark was meant to be over high with nothing to move")


def busy_step_us(policy_name: str, requests: int, calls: int) -> dict[str, float]:
    """``busy_step_us`` and ``busy_step_set_us``: every request running, over high."""
    clock = FakeClock()
    res, rids = _populate(requests, seed=3, fill=0.95)
    ctl = _controller(res, rids, policy_name, clock)
    out = {}
    for key, running in (
        ("busy_step_us", frozenset(rid for rid, _ in rids)),
        ("busy_step_set_us", {rid for rid, _ in rids}),
    ):
        _check_busy(ctl, running)  # the first call over high scans
        out[key] = _per_call_us(ctl.evict_if_needed, running, calls)
        _check_busy(ctl, running)
    eviction = getattr(ctl, "_eviction", None)
    if eviction is not None:  # the split controller: the same step without the reuse
        eviction.reuse_scans = False
        eviction.forget_finding()
        running = frozenset(rid for rid, _ in rids)
        _check_busy(ctl, running)
        out["busy_step_rescan_us"] = _per_call_us(
            ctl.evict_if_needed, running, max(100, calls // 10))
    return out


def busy_batch_step_us(policy_name: str, requests: int, calls: int, batch: int = 256) -> float:
    """Over high with a batch of ``batch`` running and every other request on host."""
    clock = FakeClock()
    rng = random.Random(4)
    sizes = [rng.randint(4096, 65536) for _ in range(requests)]
    capacity = int(sum(sizes[:batch]) / 0.95) + 1
    # host room to spare: the cascade has nothing to do
    res = LeanResource(capacity, host_capacity=2 * sum(sizes), disk_capacity=capacity)
    rids = []
    for i, size in enumerate(sizes):
        rid = f"req-{i:06d}"
        res.add(rid, size, Tier.DEVICE if i < batch else Tier.HOST)
        res.priorities[rid] = rng.random()
        rids.append((rid, size))
    ctl = _controller(res, rids, policy_name, clock)
    running = {rid for rid, _ in rids[:batch]}
    _check_busy(ctl, running)
    per_call = _per_call_us(ctl.evict_if_needed, running, calls)
    _check_busy(ctl, running)
    return per_call


def pick_100k(policy_name: str, requests: int, repeats: int) -> dict[str, float]:
    clock = FakeClock()
    res, rids = _populate(requests, seed=2, fill=0.85)
    one_by_one, _ = _populate(requests, seed=2, fill=0.85, cls=OneByOneResource)
    need = res.device_capacity_bytes // 100
    running = frozenset(rid for rid, _ in rids[:256])
    cold, warm, lazy, scan, order, rank = [], [], [], [], [], []
    for _ in range(repeats):
        ctl = _controller(res, rids, policy_name, clock)
        t0 = time.perf_counter()
        victims = ctl.plan_offload(running, need)
        cold.append(time.perf_counter() - t0)
        if not victims or sum(v.reclaimable for v in victims) < need:
            raise AssertionError("the pick did not cover the bytes asked for")
        t0 = time.perf_counter()
        again = ctl.plan_offload(running, need)
        warm.append(time.perf_counter() - t0)
        if again != victims:
            raise AssertionError("the same pick twice gave different victims")
        t0 = time.perf_counter()
        batch, _ = ctl._eviction.candidate_batch(running, clock())
        scan.append(time.perf_counter() - t0)
        policy = make_policy(policy_name, **POLICIES[policy_name])
        t0 = time.perf_counter()
        policy.order(batch, clock())
        order.append(time.perf_counter() - t0)

        other = _controller(one_by_one, rids, policy_name, clock)
        t0 = time.perf_counter()
        same = other.plan_offload(running, need)
        lazy.append(time.perf_counter() - t0)
        if [v.rid for v in same] != [v.rid for v in victims]:
            raise AssertionError("asking one by one picked other victims")

    records = _records(res, ctl, running)
    for _ in range(repeats):
        t0 = time.perf_counter()
        policy.rank(records, clock())
        rank.append(time.perf_counter() - t0)
    ms = 1e3
    return {
        "pick_100k_ms": statistics.median(cold) * ms,
        "pick_100k_warm_ms": statistics.median(warm) * ms,
        "pick_100k_one_by_one_ms": statistics.median(lazy) * ms,
        "scan_100k_ms": statistics.median(scan) * ms,
        "order_100k_ms": statistics.median(order) * ms,
        "rank_100k_ms": statistics.median(rank) * ms,
    }


def _records(res: LeanResource, ctl: EvictionController, running) -> list[Candidate]:
    """The idle requests as ``Candidate`` records, as a pick would see them."""
    return [
        Candidate(rid, res.size[rid], ctl.last_used(rid), priority=res.priorities[rid],
                  resource="kv")
        for rid in res.state
        if rid not in running
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="fresh controllers per pick figure")
    parser.add_argument("--baseline", help="JSON of a run to report ratios against")
    args = parser.parse_args(argv)
    baseline = None
    if args.baseline:
        baseline = json.loads(Path(args.baseline).read_text())
        if baseline.get("benchmark") != "controller":
            raise SystemExit(f"{args.baseline}: not a controller benchmark result")

    idle_requests, pick_requests = 10_000, 100_000
    calls = 2_000 if args.quick else 20_000
    busy_calls = 500 if args.quick else 5_000
    repeats = 1 if args.quick else max(1, args.repeats)
    results: dict[str, dict[str, float]] = {}
    for name in POLICIES:
        entry = {"idle_step_us": idle_step_us(name, idle_requests, calls)}
        entry.update(busy_step_us(name, idle_requests, busy_calls))
        entry["busy_batch_step_us"] = busy_batch_step_us(name, idle_requests, busy_calls)
        entry.update(pick_100k(name, pick_requests, repeats))
        results[name] = entry

    headers = ("policy", "idle_step_us", "busy_step_us", "busy_step_set_us",
               "busy_step_rescan_us", "busy_batch_step_us", "pick_100k_ms", "pick_100k_warm_ms",
               "pick_100k_one_by_one_ms", "scan_100k_ms", "order_100k_ms", "rank_100k_ms")
    rows = [(name, *(r.get(h, float("nan")) for h in headers[1:]))
            for name, r in results.items()]
    print(table(rows, headers))
    ratios = _ratios(results, baseline["policies"]) if baseline is not None else None
    if ratios:
        keys = sorted({k for r in ratios.values() for k in r})
        print("\nratio to the baseline run (after / before; < 1 is faster)")
        print(table([(name, *(r.get(k, float("nan")) for k in keys))
                     for name, r in ratios.items()], ("policy", *keys)))
    write_json(args.out, {
        "ratios_to_baseline": ratios,
        "baseline": args.baseline,
        "benchmark": "controller",
        "policies": results,
        "targets": {"idle_step_us": 20.0, "pick_100k_ms": 20.0},
        "setup": {
            "idle_requests": idle_requests,
            "busy_requests": idle_requests,
            "busy_calls": busy_calls,
            "busy_batch_running": 256,
            "pick_requests": pick_requests,
            "idle_calls": calls,
            "pick_repeats": repeats,
            "pick_need": "1% of device capacity",
        },
    })
    return 0


def _ratios(results: dict, before: dict) -> dict[str, dict[str, float]]:
    """Each figure over the same figure of ``before`` (policies and keys both have)."""
    return {
        name: {key: value / before[name][key] for key, value in figures.items()
               if before.get(name, {}).get(key)}
        for name, figures in results.items() if name in before
    }


if __name__ == "__main__":
    raise SystemExit(main())
