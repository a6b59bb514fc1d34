"""Trace replay benchmark: each figure as a ratio to the trace's load time, in one run.

The base is ``load``: ``tiering.blocks.replay.load_chains`` of the trace (reading
its JSON lines and every block id), CPU seconds, best of ``--repeat``. Then, each
in CPU seconds (best of ``--repeat``) and as ``x load``:

- ``blocks <policy>``: ``tiering replay --blocks`` (``replay_blocks``) at
  ``--capacity-blocks`` for every built-in block policy, and ``blocks user``: a
  policy written with the per-event hooks only (its batch hooks are the base
  class's defaults), the way a user writes one; each also through the per-event
  loop (``batch=False``, the loop before the batch hooks), with the speed-up. A
  built-in generic policy (lru, arc, s3fifo, lirs) runs through the slim loop
  (``tiering.blocks.slim``); its row ``blocks <policy> (index path)`` is the same
  replay over the ``BlockIndex`` (``slim=False``), with the slim loop's speed-up;
- ``full <policy>``: the whole trace, default full replay (``simulate``, the CLI's
  defaults: block decisions not logged) with one policy, and the same run through
  the per-event hooks with every block decision logged (as before), with the
  speed-up;
- ``jobs``: a sweep of ``--sweep-runs`` runs (``--sweep-limit`` requests each), one
  process against ``--jobs`` worker processes, wall seconds (the pool's work is in
  other processes), with the speed-up. Its figure means something only on idle
  cores: the load average is printed beside it.

Targets (README): blocks of a generic built-in at most 3x load, of ``chain`` and of
the default block policy at most 8x, of the user's per-event policy at most 5x; full at most 40x; jobs 2 at
least 1.8x the one-process sweep.

Usage: ``python benchmarks/replay.py --out replay.json [--cases blocks,full,jobs]
[--repeat K] [--limit N]``
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiering.policies.blocks import (  # noqa: E402
    DEFAULT_BLOCK_POLICY,
    BlockPolicy,
    default_block_registry,
)

from benchmarks._report import table, write_json  # noqa: E402
from tiering.apps.replay import jobs as jobs_mod  # noqa: E402
from tiering.apps.replay.presets import GiB, StepCost, get_hardware, get_model  # noqa: E402
from tiering.apps.replay.simulator import RunSpec, SimConfig, simulate  # noqa: E402
from tiering.apps.replay.sweep import Grid  # noqa: E402
from tiering.apps.replay.traces import load_trace  # noqa: E402
from tiering.blocks.replay import load_chains, replay_blocks  # noqa: E402
from tiering.blocks.slim import takes_slim  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake" / "conversation_trace.jsonl"
TARGETS = {"generic": 3.0, "chain": 8.0, "user": 5.0, "full": 40.0, "jobs": 1.8}


class UserLRU(BlockPolicy):
    """Least recently used, written as a user would: per-event hooks only."""

    name = "user-lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def on_insert(self, info, now) -> None:
        self._order[info.key] = None

    def on_hit(self, info, now) -> None:
        self._order.move_to_end(info.key)

    def on_remove(self, key) -> None:
        del self._order[key]

    def victims(self, now):
        yield from self._order


def _cpu(fn, repeat: int) -> tuple[float, object]:
    best, out = None, None
    for _ in range(max(1, repeat)):
        gc.collect()
        t = time.process_time()
        out = fn()
        dt = time.process_time() - t
        best = dt if best is None else min(best, dt)
    return best, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--cases", default="blocks,full,jobs")
    p.add_argument("--policy", default="lru", help="request policy of the full replay")
    p.add_argument("--block-policies", default=None,
                   help="block policies of the full replay, comma-separated (default: chain"
                        " and the default block policy)")
    p.add_argument("--capacity-blocks", type=int, default=4000)
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--repeat", type=int, default=1, help="best of K runs (default 1)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--sweep-runs", type=int, default=4)
    p.add_argument("--sweep-limit", type=int, default=1500)
    args = p.parse_args(argv)
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    unknown = cases - {"blocks", "full", "jobs"}
    if unknown:
        p.error(f"--cases: unknown {sorted(unknown)}; known: blocks, full, jobs")

    load_s, chains = _cpu(lambda: load_chains(args.trace, args.limit), args.repeat)
    rows = [("load (load_chains)", load_s, 1.0, "", "", "")]
    results: dict = {"load": {"cpu_s": load_s, "requests": len(chains)}}

    def add(name, target, batch_s, before_s=None):
        ratio = batch_s / load_s
        results[name] = {"cpu_s": batch_s, "x_load": ratio, "target_x_load": target,
                         "per_event_cpu_s": before_s,
                         "speedup": before_s / batch_s if before_s else None}
        rows.append((name, batch_s, ratio, f"{target:g}" if target else "",
                     f"{before_s / load_s:.1f}" if before_s else "",
                     f"{before_s / batch_s:.2f}" if before_s else ""))

    gc.freeze()  # as the CLI does once the trace is loaded
    if "blocks" in cases:
        cap = args.capacity_blocks
        registry = default_block_registry()
        makers = [(n, lambda n=n: registry.make(n, capacity=cap)) for n in registry.names]
        makers.append(("user", lambda: UserLRU(cap)))
        for name, make in makers:
            batch_s, res = _cpu(lambda make=make: replay_blocks(chains, cap, make()),
                                args.repeat)
            per_s, per = _cpu(lambda make=make: replay_blocks(chains, cap, make(), batch=False),
                              args.repeat)
            if per[:9] != res[:9]:
                raise SystemExit(f"blocks {name}: the batch hooks changed the result")
            target = TARGETS["user"] if name == "user" else (  # chain and the default: 8x
                TARGETS["chain"] if name in ("chain", DEFAULT_BLOCK_POLICY) else TARGETS["generic"])
            add(f"blocks {name}", target, batch_s, per_s)
            if takes_slim(make()):  # the same replay over the BlockIndex
                index_s, idx = _cpu(lambda make=make: replay_blocks(chains, cap, make(), slim=False),
                                    args.repeat)
                if idx[:9] != res[:9]:
                    raise SystemExit(f"blocks {name}: the slim loop changed the result")
                add(f"blocks {name} (index path)", None, index_s, None)
                results[f"blocks {name}"]["index_path_cpu_s"] = index_s
                results[f"blocks {name}"]["slim_speedup"] = index_s / batch_s
                rows[-1] = (*rows[-1][:5], f"slim {index_s / batch_s:.2f}")

    if "full" in cases:
        trace = load_trace(args.trace, limit=args.limit)
        cost = StepCost(get_model("llama-3.1-8b"), get_hardware("h100-80g"))
        spec = RunSpec("tiering", args.policy)
        default = SimConfig().block_policy
        names = (args.block_policies.split(",") if args.block_policies
                 else list(dict.fromkeys(("chain", default))))
        for bp in (n.strip() for n in names if n.strip()):
            sim = SimConfig(block_decisions=False, block_policy=bp)
            batch_s, res = _cpu(lambda sim=sim: simulate(trace, cost, spec, sim), args.repeat)
            before = SimConfig(batch_hooks=False, block_decisions=True, block_policy=bp)
            per_s, per = _cpu(lambda before=before: simulate(trace, cost, spec, before),
                              args.repeat)
            if (per.requests, per.counters) != (res.requests, res.counters):
                raise SystemExit(f"full {bp}: the batch hooks changed the run")
            tag = " (the default)" if bp == default else ""
            add(f"full {args.policy} (block policy {bp}{tag})", TARGETS["full"], batch_s, per_s)

    if "jobs" in cases:
        trace = load_trace(args.trace, limit=args.sweep_limit)
        model, hw = get_model("llama-3.1-8b"), get_hardware("h100-80g")
        hosts = tuple(int(hw.host_bytes * f) for f in (0.25, 0.5, 0.75, 1.0))
        n = max(1, args.sweep_runs)
        policies = ("lru", "cost")[: min(2, n)]
        grid = Grid(policies, ((0.9, 0.75),), hosts[: max(1, (n + 1) // len(policies))],
                    baselines=False)
        sim = SimConfig(block_decisions=False)
        keys = [f"{i}" for i in range(grid.runs())]
        ctx = jobs_mod.JobContext(trace, model, hw, grid, sim, 1.0, None, keys, 1, True, False)
        walls = {}
        rows_by = {}
        for j in (1, args.jobs):
            got = []
            t = time.perf_counter()
            jobs_mod.run_all(ctx, j, got.append)
            walls[j] = time.perf_counter() - t
            rows_by[j] = [d.row for d in got]
        if rows_by[1] != rows_by[args.jobs]:
            raise SystemExit("jobs: the pool's rows differ from one process's")
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        speed = walls[1] / walls[args.jobs]
        results["jobs"] = {"runs": grid.runs(), "wall_s_1": walls[1],
                           f"wall_s_{args.jobs}": walls[args.jobs], "speedup": speed,
                           "target_speedup": TARGETS["jobs"], "cores": os.cpu_count(),
                           "load_average_1min": load}
        rows.append((f"jobs: {grid.runs()} runs, 1 -> {args.jobs} processes (wall s)",
                     walls[args.jobs], "", f"{TARGETS['jobs']:g}x", f"{walls[1]:.2f} s",
                     f"{speed:.2f}"))
        print(f"jobs measured with load average {load:.2f} on {os.cpu_count()} cores "
              "(the figure holds only on idle cores)")

    print(table(rows, ("case", "cpu s", "x load", "target", "per-event x load", "speed-up")))
    write_json(args.out, {"benchmark": "replay", "trace": str(args.trace),
                          "capacity_blocks": args.capacity_blocks, "policy": args.policy,
                          "limit": args.limit, "results": results,
                          "sim": dataclasses.asdict(SimConfig(block_decisions=False)),
                          "gib": GiB})
    return 0


if __name__ == "__main__":
    sys.exit(main())
