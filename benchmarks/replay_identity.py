"""Replay outputs, digested: proves a speed change left every run's results bit for bit.

Runs a fixed matrix of ``simulate`` configurations (the bundled conversation trace
with several policies, block policies and modes, and small seeded synthetic traces
with tight tiers) and writes, per configuration, a sha256 of everything the run
produced: every request record, every decision, every timeline sample, the counters,
the KV and controller statistics, the makespan and the capacities, floats by their
exact ``repr``. Two counters say only how the loop got there (``fast_steps``,
``quiet_safe_points``); they are left out of the digest and reported beside it.

``--before DIR`` first runs the same matrix with the code of checkout ``DIR`` (a
subprocess importing all of it from ``DIR``: ``tiering`` and the ``policies/`` and
``resources/`` folders, ``use_root``) and compares: the exit status is 1 and the
differing configurations are named when any digest differs.

``--against FILE`` compares with the runs of an earlier ``--out`` file instead. Either way
the differing configurations' hit rates (all tiers and each), makespans and decision counts
are printed before -> after, and written under ``changes``.

``--admission`` measures what block admission changes, in the same run: every
configuration with prefix reuse runs again with block policies whose ``admit`` is never
asked (each built-in's subclass answering True without looking: what ``PagedKVCache``
did before its store took the replay's rules, ``tiering.resources.kv_prefix_rules``),
and the report says, per configuration, whether any figure changed and the prefix hit
rates (reused / looked-up prompt tokens, and per tier) without and with admission, as a
table and under ``admission`` in the JSON.

Usage: ``python benchmarks/replay_identity.py --out ids.json [--before DIR | --against FILE]
[--quick] [--only SUBSTRING] [--admission]``
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
TIERS = ("device", "host", "disk")


def _always(self, key, depth, now) -> bool:
    return True


def _without_admission():
    """A block policy registry with every built-in's name, each policy's ``admit``
    answering True without asking the policy (a subclass, so the store checks and meters
    it as a user's policy; its answers are otherwise the built-in's)."""
    from tiering.policies.blocks import BlockPolicyRegistry, default_block_registry

    base = default_block_registry()
    made = {}
    for name in base.names:
        cls = type(base.make(name, capacity=1))
        made[name] = type(f"{cls.__name__}WithoutAdmission", (cls,), {"admit": _always})
    return BlockPolicyRegistry(made)


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


def _run_one(c: dict, admission: bool = True) -> dict:
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
    extra = {}
    if not admission:  # metered as a user's policy would be, without the budget warning
        from tiering.apps.replay.block_guard import PolicyMeter

        extra = {"block_registry": _without_admission(),
                 "block_meter": PolicyMeter("without-admission", warn=None)}
    res = simulate(trace, cost, spec, sim, time_scale=c.get("time_scale", 1.0),
                   kv_factory=factory, **extra)
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
    sc = res.counters
    looked = max(1, getattr(sc, "lookup_tokens", 0))
    rates = {"hit_rate": sc.reused_tokens / looked}
    for t in TIERS:
        rates[f"hit_rate_{t}"] = getattr(sc, f"reused_tokens_{t}", 0) / looked
    return {
        **rates,
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


def _reuses(c: dict) -> bool:
    """Whether a configuration keeps cached prefix blocks (admission can matter)."""
    return c.get("prefix_reuse", True)


def _admission(quick: bool, only: str | None, after: dict) -> dict:
    """Each configuration with prefix reuse run again without admission (``after``: its
    runs with it): per configuration, whether any figure changed and the hit rates."""
    out = {}
    print("\nwhat block admission changes (hit rate: reused / looked-up prompt tokens):")
    head = (f"{'configuration':36s} {'changed':>7s} {'hit before':>10s} {'hit after':>10s}"
            f" {'delta':>7s}  " + "  ".join(f"{t + ' b->a':>15s}" for t in TIERS))
    print(head)
    for c in _configs(quick):
        if (only and only not in c["name"]) or not _reuses(c) or c["name"] not in after:
            continue
        b, a = _run_one(c, admission=False), after[c["name"]]
        keys = ["hit_rate", *(f"hit_rate_{t}" for t in TIERS)]
        row = {
            "changed": b["digest"] != a["digest"],
            "before": {k: b[k] for k in keys}, "after": {k: a[k] for k in keys},
            "delta_hit_rate": a["hit_rate"] - b["hit_rate"],
            "reused_tokens": [b["reused_tokens"], a["reused_tokens"]],
        }
        out[c["name"]] = row
        tiers = "  ".join(f"{100 * b[f'hit_rate_{t}']:6.2f}->{100 * a[f'hit_rate_{t}']:6.2f}"
                          for t in TIERS)
        print(f"{c['name']:36s} {'yes' if row['changed'] else 'no':>7s}"
              f" {100 * b['hit_rate']:9.2f}% {100 * a['hit_rate']:9.2f}%"
              f" {100 * row['delta_hit_rate']:+6.2f}  {tiers}", flush=True)
    changed = [n for n, r in out.items() if r["changed"]]
    print(f"admission changed the figures of {len(changed)} of {len(out)} configurations"
          + (f": {', '.join(changed)}" if changed else ""))
    return out


def _changes(before: dict, after: dict, names: list[str]) -> dict:
    """How the figures of the configurations ``names`` moved, as a table and a dict: the
    hit rate (all tiers and each), the makespan and the decisions, before -> after."""
    out = {}
    print("\nhow the differing configurations changed (hit rate: reused / looked-up tokens):")
    print(f"{'configuration':36s} {'hit before':>10s} {'hit after':>10s} {'delta':>7s}  "
          + "  ".join(f"{t + ' b->a':>15s}" for t in TIERS)
          + f"  {'makespan b->a (s)':>19s}  {'decisions b->a':>15s}")
    for n in names:
        b, a = before[n], after[n]
        if "hit_rate" not in b:  # an --out file from before the hit rates were kept
            continue
        row = {k: [b[k], a[k]] for k in ("hit_rate", *(f"hit_rate_{t}" for t in TIERS),
                                         "makespan_s", "decisions")}
        out[n] = row
        tiers = "  ".join(f"{100 * b[f'hit_rate_{t}']:6.2f}->{100 * a[f'hit_rate_{t}']:6.2f}"
                          for t in TIERS)
        print(f"{n:36s} {100 * b['hit_rate']:9.2f}% {100 * a['hit_rate']:9.2f}%"
              f" {100 * (a['hit_rate'] - b['hit_rate']):+6.2f}  {tiers}"
              f"  {b['makespan_s']:8.1f}->{a['makespan_s']:8.1f}"
              f"  {b['decisions']:6d}->{a['decisions']:6d}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--before", type=Path, default=None)
    p.add_argument("--against", type=Path, default=None,
                   help="compare with the runs of an earlier --out file instead of --before")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default=None, help="only configurations whose name has this")
    p.add_argument("--admission", action="store_true",
                   help="also run each configuration without block admission and report"
                        " what admission changes")
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
    if args.admission:
        doc["admission"] = _admission(args.quick, args.only, runs)
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
            doc["changes"] = _changes(before, runs, differ)
        else:
            print(f"identical: all {len(runs)} configurations")
            for n in runs:
                b, a = before[n]["wall_s"], runs[n]["wall_s"]
                print(f"  {n:36s} wall {b:7.2f} -> {a:7.2f} s")
    Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True))
    return status


def use_root(root: str | Path) -> None:
    """Import the library from checkout ``root``: ``tiering`` from its folder, and the
    packages an install maps from other folders (``tiering.policies`` from
    ``policies/``, ``tiering.resources`` from ``resources/``) from that checkout's,
    not from the installed one's. Call before anything imports ``tiering``."""
    import importlib.util

    root = Path(root).resolve()
    sys.path.insert(0, str(root))
    for name, folder in (("tiering.policies", "policies"), ("tiering.resources", "resources")):
        init = root / folder / "__init__.py"
        if not init.is_file():
            raise SystemExit(f"--root {root}: no {folder}/__init__.py there")
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(root / folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)


if __name__ == "__main__":
    if "--root" in sys.argv:
        use_root(sys.argv[sys.argv.index("--root") + 1])
    else:
        sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
