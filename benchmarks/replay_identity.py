"""Replay outputs, digested: proves a speed change left every run's results bit for bit.

Runs a fixed matrix of ``simulate`` configurations (the bundled conversation trace
with several policies, block policies and modes, and small seeded synthetic traces
with tight tiers) and writes, per configuration, a sha256 of everything the run
produced: every request record, every decision, every timeline sample, the counters,
the KV and controller statistics, the makespan and the capacities, floats by their
exact ``repr``. Two counters say only how the loop got there (``fast_steps``,
``quiet_safe_points``); they are left out of the digest and reported beside it.

``--before DIR`` first runs the same matrix with the code of checkout ``DIR`` (a
subprocess importing from ``DIR``) and compares: the exit status is 1 and the
differing configurations are named when any digest differs.

``--against FILE`` compares with the runs of an earlier ``--out`` file instead.

Usage: ``python benchmarks/replay_identity.py --out ids.json [--before DIR | --against FILE]
[--quick] [--only SUBSTRING]``
(``--quick``: the synthetic part and one short trace run only).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRACE = HERE / "traces" / "mooncake" / "conversation_trace.jsonl"

# counters that say how the loop ran, not what happened
LOOP_COUNTERS = ("fast_steps", "quiet_safe_points")


def _configs(quick: bool) -> list[dict]:
    """The matrix: name -> keyword description (plain data, so both checkouts agree)."""
    full = None if not quick else 600
    out = [
        dict(name="trace-lru", trace="mooncake", limit=full, mode="tiering", policy="lru"),
        dict(name="trace-cost-4000", trace="mooncake", limit=4000 if not quick else 600,
             mode="tiering", policy="cost"),
    ]
    if not quick:
        out += [
            dict(name="trace-priority-3000", trace="mooncake", limit=3000, mode="tiering",
                 policy="priority"),
            dict(name="trace-largest-3000", trace="mooncake", limit=3000, mode="tiering",
                 policy="largest"),
            dict(name="trace-lru-blocklru-3000", trace="mooncake", limit=3000,
                 mode="tiering", policy="lru", block_policy="lru"),
            dict(name="trace-lru-arc-3000", trace="mooncake", limit=3000, mode="tiering",
                 policy="lru", block_policy="arc"),
            dict(name="trace-lru-s3fifo-3000", trace="mooncake", limit=3000, mode="tiering",
                 policy="lru", block_policy="s3fifo"),
            dict(name="trace-lru-offload-3000", trace="mooncake", limit=3000,
                 mode="tiering", policy="lru", make_room="offload"),
            dict(name="trace-lru-host8-3000", trace="mooncake", limit=3000, mode="tiering",
                 policy="lru", host_gib=8, disk_gib=64),
            dict(name="trace-cost-host4-scale0.5-2000", trace="mooncake", limit=2000,
                 mode="tiering", policy="cost", host_gib=4, disk_gib=16, time_scale=0.5),
            dict(name="trace-lru-noreuse-3000", trace="mooncake", limit=3000,
                 mode="tiering", policy="lru", prefix_reuse=False),
            dict(name="trace-largest-preempt-3000", trace="mooncake", limit=3000,
                 mode="tiering", policy="largest", preempt="policy"),
            dict(name="trace-recompute", trace="mooncake", limit=None, mode="recompute"),
            dict(name="trace-no-tiering", trace="mooncake", limit=None, mode="no-tiering"),
        ]
    for seed in (7, 25, 31):
        for policy in ("lru", "priority", "largest", "cost"):
            for make_room in ("drop", "offload"):
                out.append(dict(name=f"synth-{seed}-{policy}-{make_room}", trace="synth",
                                seed=seed, n=200, mode="tiering", policy=policy,
                                make_room=make_room, high=0.85, low=0.7))
        for mode in ("recompute", "no-tiering"):
            out.append(dict(name=f"synth-{seed}-{mode}", trace="synth", seed=seed, n=200,
                            mode=mode))
        out.append(dict(name=f"synth-{seed}-lru-slow-links", trace="synth", seed=seed, n=150,
                        mode="tiering", policy="lru", high=0.85, low=0.7, slow=True))
        out.append(dict(name=f"synth-{seed}-cost-preempt", trace="synth", seed=seed, n=200,
                        mode="tiering", policy="cost", high=0.85, low=0.7, preempt="policy"))
    return out


def _preempt(c: dict) -> dict:
    """``preempt`` for SimConfig, only where a configuration sets it (a checkout from
    before the option runs every other configuration)."""
    return {"preempt": c["preempt"]} if "preempt" in c else {}


def _run_one(c: dict) -> dict:
    from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
    from tiering.apps.replay.presets import StepCost, get_hardware, get_model
    from tiering.apps.replay.simulator import RunSpec, SimConfig, simulate
    from tiering.apps.replay.traces import load_trace
    from tiering.control.controller import ControllerConfig

    model = get_model("llama-3.1-8b")
    ctl = ControllerConfig(high=c.get("high", 0.9), low=c.get("low", 0.75))
    spec = RunSpec(c["mode"], c.get("policy", "lru"), ctl)
    factory = None
    if c["trace"] == "mooncake":
        hw = get_hardware("h100-80g")
        gib = 1 << 30
        if "host_gib" in c:
            hw = dataclasses.replace(hw, host_bytes=c["host_gib"] * gib,
                                     disk_bytes=c["disk_gib"] * gib)
        trace = load_trace(TRACE, limit=c["limit"])
        sim = SimConfig(make_room=c.get("make_room", "drop"),
                        block_policy=c.get("block_policy", "chain"),
                        prefix_reuse=c.get("prefix_reuse", True),
                        **_preempt(c))
    else:
        sys.path.insert(0, str(Path.cwd() / "tests"))
        from conftest import conversation_trace

        hw = get_hardware("small")
        trace = conversation_trace(c["seed"], c["n"], shared=0.6)
        sim = SimConfig(max_batch=16, max_step_tokens=1024, page_tokens=16, block_tokens=64,
                        make_room=c.get("make_room", "drop"), **_preempt(c))
        rates = (LinkRates(2e8, 2e8, 5e7, 1e8) if c.get("slow")
                 else LinkRates(2e9, 2e9, 5e8, 1e9, 1e-5, 1e-5, 1e-4, 1e-4))
        host, disk = (100, 800) if c["mode"] == "tiering" else (0, 0)

        def factory(clock):
            return ModeledKVCache(model.kv_bytes_per_token, sim.page_tokens, 300, host, disk,
                                  rates, clock)

    cost = StepCost(model, hw)
    start = time.perf_counter()
    res = simulate(trace, cost, spec, sim, time_scale=c.get("time_scale", 1.0),
                   kv_factory=factory)
    wall = time.perf_counter() - start
    counters = dataclasses.asdict(res.counters)
    loop = {k: counters.pop(k) for k in LOOP_COUNTERS}
    parts = (
        [repr(tuple(r)) for r in res.requests],
        repr(sorted(counters.items())),
        repr(sorted(res.kv_stats.items())),
        repr(sorted(res.controller_stats.items())),
        [repr(tuple(d)) for d in res.decisions],
        repr(res.makespan_s),
        repr(sorted(res.capacities.items())),
        [repr(tuple(s)) for s in res.timeline],
    )
    h = hashlib.sha256()
    for p in parts:
        for line in (p if isinstance(p, list) else [p]):
            h.update(line.encode())
            h.update(b"\n")
        h.update(b"--\n")
    return {
        "digest": h.hexdigest(),
        "requests": len(res.requests),
        "decisions": len(res.decisions),
        "steps": res.counters.steps,
        "makespan_s": res.makespan_s,
        "reused_tokens": res.counters.reused_tokens,
        "loop": loop,
        "wall_s": wall,
    }


def _matrix(quick: bool, only: str | None) -> dict:
    out = {}
    for c in _configs(quick):
        if only and only not in c["name"]:
            continue
        out[c["name"]] = _run_one(c)
        r = out[c["name"]]
        print(f"{c['name']:36s} {r['digest'][:16]} steps {r['steps']:>7} "
              f"decisions {r['decisions']:>6} wall {r['wall_s']:.2f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--before", type=Path, default=None)
    p.add_argument("--against", type=Path, default=None,
                   help="compare with the runs of an earlier --out file instead of --before")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default=None, help="only configurations whose name has this")
    p.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    before = None
    if args.before is not None:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "before.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out),
                   "--root", str(args.before.resolve())]
            if args.quick:
                cmd.append("--quick")
            if args.only:
                cmd += ["--only", args.only]
            print(f"before ({args.before}):", flush=True)
            subprocess.run(cmd, cwd=args.before, check=True, timeout=7200)
            before = json.loads(out.read_text())["runs"]
        print("after (this checkout):", flush=True)
    elif args.against is not None:
        before = json.loads(args.against.read_text())["runs"]
    runs = _matrix(args.quick, args.only)
    doc = {"runs": runs}
    status = 0
    if before is not None:
        if args.only:
            before = {n: v for n, v in before.items() if n in runs}
        differ = [n for n in runs if n in before and before[n]["digest"] != runs[n]["digest"]]
        missing = sorted(set(before) ^ set(runs))
        doc["before"] = before
        doc["differ"] = differ
        if differ or missing:
            status = 1
            print(f"DIFFERENT: {differ} missing: {missing}")
        else:
            print(f"identical: all {len(runs)} configurations")
            for n in runs:
                b, a = before[n]["wall_s"], runs[n]["wall_s"]
                print(f"  {n:36s} wall {b:7.2f} -> {a:7.2f} s")
    Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True))
    return status


if __name__ == "__main__":
    _root = None
    if "--root" in sys.argv:
        _root = sys.argv[sys.argv.index("--root") + 1]
    sys.path.insert(0, _root or str(HERE.parent))
    sys.exit(main())
