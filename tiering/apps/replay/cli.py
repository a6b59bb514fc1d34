"""``tiering replay``: replay a trace against simulated tiers and report.

    tiering replay TRACE [--out DIR] [--policy P[,P...]|all] [--policy-option KEY=VALUE ...]
                   [--model M | --model-config FILE] [--kv-bytes-per-token N]
                   [--hardware H] [--device-gib G] [--host-gib G[,G...]]
                   [--disk-gib G] [--limit N] [--time-scale X] [--seeds N] [--jobs N]
                   [--watermarks HIGH:LOW[,...]] [--sweep] [--format F] [--no-prefix-reuse]
                   [--make-room drop|offload] [--preempt latest|policy]
                   [--block-policy B] [--requests-csv] [--decisions] [--no-plots] [-v|-q]

``P`` is a built-in name (``lru``, ``priority``, ``largest``, ``cost``) or a
``module:Class`` path to a ``tiering.policies.Policy`` subclass (or a factory
returning one); ``--policy-option`` keyword options go to every policy named.
``P`` orders the live requests (device offloads, host demotions and, with
``--preempt policy``, which request of the batch is paused when memory runs
out; by default the latest-arrived is, vLLM's rule); ``B`` (a
block policy of ``tiering.policies.blocks``: ``lru``, ``arc``, ``s3fifo``, ``lirs``, ``chain``,
``adaptive``, default ``adaptive``) keeps the cached prefix blocks of every tier.
Without ``--sweep``: each policy runs at the first watermark pair and host
size, next to the ``recompute`` and ``no-tiering`` baselines. With
``--sweep``: every policy at every watermark pair and host size (defaults:
the built-ins, three watermark pairs, five host sizes up to the preset's).

Written to ``DIR`` (default ``./replay-out``): ``summary.json`` (every run's figures, the bounds, the
tier sizes of every run, rejected requests), ``compare.png`` (hit rate by
tier with the bounds, p99 TTFT), ``timeline.png`` (per-tier occupancy and hit
rate over time), with ``--sweep`` also ``sweep.csv`` and two plots against host
size; ``requests.csv`` and ``decisions.csv`` on request. A compact table is printed
(``tiering.apps.replay.report``), then a warning for each run whose figures need one:
rejected requests, a policy that made no decision, a saturated worker.
``--jobs N`` runs the independent runs in N worker processes (the same outputs);
each finished run's row is kept in ``DIR/runs.jsonl`` until ``summary.json`` is
written, so Ctrl-C (exit status 130) keeps them. A user's block policy is metered:
its cost per hook is printed after the table and kept in ``summary.json``.
Bad arguments: a message naming the argument on stderr, exit status 2, and
nothing created.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import itertools
import json
import math
import os
import sys
from pathlib import Path

from tiering.apps.console import add_common_options, log_level, verbosity
from tiering.apps.replay import jobs, report
from tiering.apps.replay.block_guard import cost_summary, format_costs
from tiering.apps.replay.bounds import belady, infinite
from tiering.apps.replay.policy_spec import PolicySpec, load_factory, parse_option
from tiering.apps.replay.presets import (
    HARDWARE,
    MODELS,
    GiB,
    StepCost,
    check_fits,
    get_hardware,
    get_model,
    model_from_file,
)
from tiering.apps.replay.progress import Progress
from tiering.apps.replay.seeds import aggregate, jitter
from tiering.apps.replay.simulator import SimConfig
from tiering.apps.replay.sweep import Grid, plot, run_grid, write_csv
from tiering.apps.replay.traces import FORMATS, load_trace
from tiering.control.controller import ControllerConfig
from tiering.errors import PolicyFailed
from tiering.policies import default_registry
from tiering.policies.blocks import (
    DEFAULT_BLOCK_POLICY,
    BlockPolicy,
    default_block_registry,
    make_block_policy,
)

DEFAULT_WATERMARKS = ((0.9, 0.75),)
SWEEP_WATERMARKS = ((0.9, 0.75), (0.95, 0.85), (0.8, 0.6))
SWEEP_HOST_FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)
DEFAULT_OUT = "replay-out"
DEFAULT_MODEL = "llama-3.1-8b"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit 2 with our prefix; nothing has been created yet
        self.print_usage(sys.stderr)
        print(f"tiering replay: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tiering replay",
        description="Replay a production trace through a simulated serving worker.",
    )
    p.add_argument("trace", help="trace file (.jsonl Mooncake, .csv Azure or BurstGPT)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"directory for summary.json and plots (default ./{DEFAULT_OUT})")
    p.add_argument("--policy", default=None,
                   help="policy name or module:Class, comma list, or 'all' (the built-ins; "
                        "default: lru, with --sweep: all)")
    p.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword option for the policies (repeat for several)")
    p.add_argument("--model", default=None, choices=sorted(MODELS),
                   help="model preset (default llama-3.1-8b): " + "; ".join(
                       f"{m.name}: {m.describe()}" for m in MODELS.values()))
    p.add_argument("--model-config", default=None, metavar="FILE",
                   help="another model, from a JSON file instead of --model: a Hugging Face "
                        "config.json, or num_layers, num_kv_heads, head_dim, dtype_bytes, "
                        "params_b")
    p.add_argument("--kv-bytes-per-token", default=None, metavar="N",
                   help="KV bytes of one token (all layers, K and V), replacing the model's")
    p.add_argument("--hardware", default="h100-80g", choices=sorted(HARDWARE),
                   help="worker preset (default h100-80g): " + "; ".join(
                       f"{h.name}: {h.describe()}" for h in HARDWARE.values()))
    p.add_argument("--device-gib", default=None,
                   help="device memory for KV in GiB (default: the preset's)")
    p.add_argument("--host-gib", default=None,
                   help="host tier size(s) in GiB, comma list with --sweep (default: the preset's)")
    p.add_argument("--disk-gib", default=None, help="disk tier size in GiB (default: the preset's)")
    p.add_argument("--limit", default=None, help="replay only the first N requests")
    p.add_argument("--time-scale", default="1.0",
                   help="multiply arrival times by X > 0 (2 halves the request rate)")
    p.add_argument("--seeds", default="1",
                   help="run N times, arrivals jittered from the second on; means and 95%% "
                        "intervals (default 1)")
    p.add_argument("--jobs", default="1",
                   help="run the independent runs (every seed x configuration) in N worker "
                        "processes; the same results as one (default 1)")
    p.add_argument("--watermarks", default=None,
                   help="device watermark pair(s) HIGH:LOW, comma list (default 0.9:0.75)")
    p.add_argument("--sweep", action="store_true",
                   help="run every policy x watermark pair x host size")
    p.add_argument("--format", choices=FORMATS, default=None, help="trace format (default: detect)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="do not retain finished prompts for reuse")
    p.add_argument("--requests-csv", action="store_true",
                   help="also write DIR/requests.csv: one line per request and run")
    p.add_argument("--decisions", action="store_true",
                   help="also write DIR/decisions.csv: every offload, demotion, drop and reload")
    p.add_argument("--make-room", choices=("drop", "offload"), default="offload",
                   help="cached prefix blocks in the way of a request on the device: move "
                        "them a tier down while one has room (default) or drop them")
    p.add_argument("--preempt", choices=("latest", "policy"), default="latest",
                   help="which request of the batch a tiering run pauses when memory runs "
                        "out: the latest-arrived (default, vLLM's rule) or the first in the "
                        "policy's order over those a tier below has room for (ties: the "
                        "policy's tie-break; the built-ins': earliest-arrived)")
    p.add_argument("--block-policy", default=DEFAULT_BLOCK_POLICY,
                   help="block retention policy of every tier's cached prefix blocks: "
                        f"{', '.join(default_block_registry().names)} or module:Class, comma "
                        f"list to compare several (default {DEFAULT_BLOCK_POLICY})")
    p.add_argument("--no-plots", action="store_true", help="write no PNG")
    add_common_options(p)
    return p


def _number(flag: str, text: str, *, minimum: float, strict: bool = False) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a number") from None
    bad = v <= minimum if strict else v < minimum
    if not math.isfinite(v) or bad:
        raise ValueError(f"{flag}: {text!r} must be a finite number {'>' if strict else '>='} "
                         f"{minimum:g}")
    return v


def _count(flag: str, text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a whole number") from None
    if v < 1:
        raise ValueError(f"{flag}: {text!r} must be >= 1")
    return v


def _policies(text: str | None, sweep: bool) -> tuple[str, ...]:
    known = default_registry().names
    if text is None:
        return known if sweep else ("lru",)
    if text.strip() == "all":
        return known
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise ValueError("--policy: no policy named")
    if "all" in names:
        raise ValueError("--policy: 'all' stands alone (it names every built-in)")
    return names


def _watermarks(text: str | None, sweep: bool) -> tuple[tuple[float, float], ...]:
    if text is None:
        return SWEEP_WATERMARKS if sweep else DEFAULT_WATERMARKS
    pairs = []
    for item in text.split(","):
        high, sep, low = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            pair = (float(high), float(low))
        except ValueError:
            raise ValueError(f"--watermarks: {item!r} is not HIGH:LOW (e.g. 0.9:0.75)") from None
        try:
            ControllerConfig(high=pair[0], low=pair[1])
        except (ValueError, TypeError) as err:
            raise ValueError(f"--watermarks: {item.strip()!r}: {err}") from None
        pairs.append(pair)
    return tuple(pairs)


def _gib(flag: str, text: str) -> int:
    return int(_number(flag, text, minimum=0) * GiB)


def _host_sizes(text: str | None, preset_bytes: int, sweep: bool) -> tuple[int, ...]:
    if text is None:
        if sweep:
            return tuple(int(preset_bytes * f) for f in SWEEP_HOST_FRACTIONS)
        return (preset_bytes,)
    return tuple(_gib("--host-gib", item.strip()) for item in text.split(","))


def _run_key(row: dict, sweep: bool) -> str:
    if row["mode"] != "tiering" or not sweep:
        return row["label"]
    return _point_key(row["policy"], row["high"], row["low"], row["host_gib"])


def _run_keys(grid: Grid, sweep: bool) -> list[str]:
    """The key of every run (as ``_run_key`` names its row), in the order ``run_grid``
    runs them: the baselines, then each block policy's pass over the grid's points."""
    keys = list(grid.labels())
    base = len(keys) - len(grid.points()) * len(grid.blocks())
    if sweep:
        points = [p for _ in grid.blocks() for p in grid.points()]
        keys[base:] = [_point_key(label, high, low, host / GiB)
                       for label, (_, high, low, host) in zip(keys[base:], points, strict=True)]
    return keys


def _point_key(label: str, high: float, low: float, host_gib: float) -> str:
    return f"{label}@{high:g}:{low:g}@{host_gib:g}GiB"


def _check_unique_runs(policies, options, watermarks, hosts, sweep: bool) -> None:
    """summary.json, the table and the CSVs name each run by its key: two runs with one
    key would overwrite each other, so a configuration that repeats one is refused."""
    keys: dict[str, tuple] = {}
    for (high, low), host, policy in itertools.product(watermarks, hosts, policies):
        label = PolicySpec(policy, options).label
        key = _point_key(label, high, low, host / GiB) if sweep else label
        if key in keys:
            raise ValueError(
                f"--policy/--watermarks/--host-gib: run {key!r} is named twice "
                f"({keys[key]} and {(policy, high, low, host)}: policy, high, low, host bytes)")
        keys[key] = (policy, high, low, host)


def _check(args: argparse.Namespace):
    """Everything the run needs, validated; ValueError naming the argument otherwise."""
    policies = _policies(args.policy, args.sweep)
    options = tuple(parse_option(o) for o in args.policy_option)
    for name in policies:  # build each once now, so a bad name or option stops here
        PolicySpec(name, options).build()
    watermarks = _watermarks(args.watermarks, args.sweep)
    model = _model(args)
    hardware = get_hardware(args.hardware)
    if args.device_gib is not None:
        device = int(_number("--device-gib", args.device_gib, minimum=0, strict=True) * GiB)
        hardware = hardware.with_sizes(device_kv_bytes=device)
    if args.disk_gib is not None:
        hardware = hardware.with_sizes(disk_bytes=_gib("--disk-gib", args.disk_gib))
    hosts = _host_sizes(args.host_gib, hardware.host_bytes, args.sweep)
    if not args.sweep and (len(watermarks) > 1 or len(hosts) > 1):
        raise ValueError("several --watermarks or --host-gib values need --sweep")
    try:
        check_fits(model, hardware)
    except ValueError as err:
        raise ValueError(f"--model/--hardware/--device-gib: {err}") from None
    time_scale = _number("--time-scale", args.time_scale, minimum=0, strict=True)
    seeds = _count("--seeds", args.seeds)
    limit = _count("--limit", args.limit) if args.limit is not None else None
    _check_unique_runs(policies, options, watermarks, hosts, args.sweep)
    grid = Grid(policies, watermarks, hosts, policy_options=options,
                device_bytes=hardware.device_kv_bytes, disk_bytes=hardware.disk_bytes)
    blocks, block_registry = _block_policies(args.block_policy)
    grid = dataclasses.replace(grid, block_policies=blocks if len(blocks) > 1 else ())
    sim = SimConfig(prefix_reuse=not args.no_prefix_reuse, make_room=args.make_room,
                    block_policy=blocks[0], preempt=args.preempt,
                    block_decisions=bool(args.decisions))
    args.jobs = _count("--jobs", args.jobs)
    page_bytes = model.kv_bytes_per_token * sim.page_tokens
    if hardware.device_kv_bytes < page_bytes:
        raise ValueError(f"--device-gib: {hardware.device_kv_bytes} bytes hold no KV page "
                         f"({page_bytes} bytes)")
    trace = load_trace(args.trace, args.format, limit)
    last = max(t.arrival_s for t in trace) * time_scale
    if not math.isfinite(last):
        raise ValueError(f"--time-scale: {args.time_scale!r} puts the last arrival "
                         f"({max(t.arrival_s for t in trace):g} s) at infinity")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    _check_creatable(out)
    return policies, model, hardware, grid, sim, block_registry, trace, time_scale, seeds, out


def _model(args: argparse.Namespace):
    """The model of ``--model`` or ``--model-config``, with ``--kv-bytes-per-token``."""
    if args.model_config is not None:
        if args.model is not None:
            raise ValueError("--model and --model-config: give one of them")
        model = model_from_file(args.model_config)
    else:
        model = get_model(args.model or DEFAULT_MODEL)
    if args.kv_bytes_per_token is not None:
        n = _count("--kv-bytes-per-token", args.kv_bytes_per_token)
        model = dataclasses.replace(model, name=f"{model.name} ({n} B/token KV)", kv_bytes=n)
    return model


def _block_policies(text: str):
    """The ``--block-policy`` list, and the block registry that holds each: a built-in
    name, or a ``module:Class`` path registered under that path. Each is built once here,
    so a bad name or a class that cannot be built stops before any run."""
    registry = default_block_registry()
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise ValueError(f"--block-policy: {text!r} has an empty name")
    if len(set(names)) != len(names):
        raise ValueError(f"--block-policy: {text!r} names a block policy twice")
    for name in names:
        if ":" in name:
            factory = load_factory(name, BlockPolicy, "--block-policy", "tiering.policies.blocks.BlockPolicy")
            registry = registry.with_policy(name, factory)
        elif name not in registry:
            raise ValueError(f"--block-policy: unknown block policy {name!r}; known: "
                             f"{', '.join(registry.names)} (or give a module:Class path)")
        try:
            make_block_policy(name, registry, capacity=16)
        except Exception as err:  # the user's class, whatever it raised
            raise ValueError(f"--block-policy: {name!r} cannot be built "
                             f"({type(err).__name__}: {err})") from None
    return tuple(names), registry


def _check_creatable(out: Path) -> None:
    """ValueError unless ``out`` is, or can be made as, a directory: its nearest existing
    ancestor must be a directory this process may write into (checked before any run, so
    a typo does not cost the whole replay)."""
    parent = out
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out: cannot create {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out: cannot create {out}: {parent} is not writable")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--blocks" in argv:  # block accesses alone, through the block index and policies
        from tiering.blocks.replay import main as blocks_main

        try:
            return blocks_main([a for a in argv if a != "--blocks"])
        except (ValueError, OSError) as err:  # a missing or unreadable trace: named, exit 2
            print(f"tiering replay --blocks: {err}", file=sys.stderr)
            return 2
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    with log_level(verbosity(args)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        policies, model, hardware, grid, sim, block_registry, trace, time_scale, seeds, out = (
            _check(args))
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"tiering replay: {err}", file=sys.stderr)
        return 2
    gc.freeze()  # the trace and the presets live all run: the collector need not walk them

    bt = sim.block_tokens
    total_bytes = hardware.device_kv_bytes + max(grid.host_bytes) + hardware.disk_bytes
    block_bytes = bt * model.kv_bytes_per_token
    per_seed: list[list[dict]] = []
    first_results: dict[str, object] = {}
    saturated: dict[str, report.Saturation] = {}
    requests_rows: list[list] = []
    decision_rows: list[list] = []
    labels = grid.labels()
    run_keys = _run_keys(grid, args.sweep)
    # every finished run's row, on disk as it finishes: what a Ctrl-C leaves
    keeper = jobs.Keeper(out / "runs.jsonl", run_keys)
    if args.jobs > 1:
        per_seed = [[None] * len(run_keys) for _ in range(seeds)]

        def deliver(done: jobs.RunDone) -> None:  # in the sequential order
            per_seed[done.seed][done.index] = done.row
            if not done.seed:
                _first_result(done.row, done.result)

    def _first_result(row, result) -> None:
        key = _run_key(row, args.sweep)
        # kept for the bounds and the timeline plot: not the decision log, the bulk of a
        # run (about 600,000 records on the whole trace), copied below when asked for
        first_results[key] = result._replace(decisions=[])
        saturated[key] = report.saturation(result.requests)
        if args.requests_csv:
            requests_rows.extend([key, *rec] for rec in result.requests)
        if args.decisions:
            decision_rows.extend([key, *d] for d in result.decisions)

    try:
        if args.jobs > 1:
            ctx = jobs.JobContext(trace, model, hardware, grid, sim, time_scale, block_registry,
                                  run_keys, seeds, verbosity(args) < 0, bool(args.decisions))
            jobs.run_all(ctx, args.jobs, deliver, keeper)
    except PolicyFailed as err:
        keeper.forget()  # nothing is written
        print(f"tiering replay: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(keeper)
    except Exception:
        keeper.forget()  # the replay's own defect: its traceback, and nothing written
        raise
    for seed in range(seeds if args.jobs == 1 else 0):
        run_trace = jitter(trace, seed)
        progress = Progress(grid.runs(), len(trace), quiet=verbosity(args) < 0,
                            prefix=f"seed {seed + 1}/{seeds} " if seeds > 1 else "")

        def on_start(i, label, progress=progress):
            # named as in summary.json and the table (with --sweep: label@high:low@host)
            progress.start(i, run_keys[i])

        def on_result(row, result, seed=seed, progress=progress):
            progress.finished(row)
            keeper(jobs.RunDone(seed, run_keys.index(_run_key(row, args.sweep)), row, None,
                                None))
            if not seed:
                _first_result(row, result)

        try:
            rows = run_grid(run_trace, model, hardware, grid, sim, time_scale=time_scale,
                            on_finish=progress.advance, on_start=on_start,
                            on_result=on_result, block_registry=block_registry)
        except PolicyFailed as err:
            # the user's policy, mid-run (checked_order and the block guard name it and what
            # it did); any other error is the replay's own defect and keeps its traceback
            # rather than pass for a bad argument
            progress.close()  # nothing is written
            keeper.forget()
            where = f" (seed {seed + 1} of {seeds})" if seeds > 1 else ""
            print(f"tiering replay: run {progress.running!r}{where} stopped: {err}",
                  file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            progress.close()
            return _interrupted(keeper)
        except Exception:
            keeper.forget()  # the replay's own defect: its traceback, and nothing written
            raise
        finally:
            progress.close()
        per_seed.append(rows)
    # the bounds cover the requests every run served: a rejected request never ran, so
    # neither reused nor left anything (the runs of the first seed say which)
    accepted = _accepted(trace, first_results)
    capacity_blocks = total_bytes // block_bytes
    bounds = [infinite(accepted, bt), belady(accepted, bt, capacity_blocks)]
    rows = aggregate(per_seed) if seeds > 1 else per_seed[0]
    keys = [_run_key(r, args.sweep) for r in rows]
    assert len(labels) == len(rows) and keys == run_keys
    for key, r in zip(keys, rows, strict=True):  # in summary.json, the table and the CSV
        r["policy_decisions"] = report.policy_decisions(r)
        r["saturated"] = bool(saturated[key].saturated)
    cautions = report.warnings(keys, rows, saturated)

    host_bytes = list(grid.host_bytes) if args.sweep else grid.host_bytes[0]  # as run
    try:  # a write that fails (disk full, permissions) is named, not a traceback
        out.mkdir(parents=True, exist_ok=True)
        cost = StepCost(model, hardware)
        summary = {
            "trace": str(args.trace),
            "requests": len(trace),
            "time_scale": time_scale,
            "seeds": seeds,
            "model": {**dataclasses.asdict(model), "kv_bytes_per_token": model.kv_bytes_per_token},
            # the preset as run: its host size is the one asked for (a list with --sweep)
            "hardware": {**dataclasses.asdict(hardware), "host_bytes": host_bytes},
            "tier_bytes": {
                "device": hardware.device_kv_bytes,
                "host": host_bytes,
                "disk": hardware.disk_bytes,
                "note": "each run's own sizes are in its device_bytes, host_bytes and disk_bytes; "
                        "the baselines have no host or disk tier",
            },
            "step_cost": {"prefill_s_per_token": cost.prefill_s_per_token,
                          "decode_s_per_step": cost.decode_s_per_step},
            "sim": dataclasses.asdict(sim),
            "bounds": {
                b.name: {**b._asdict(), "capacity_blocks": None if math.isinf(b.capacity_blocks)
                         else b.capacity_blocks}
                for b in bounds
            },
            "bounds_note": (
                f"block level, {bt} tokens a block; belady is the offline optimum (MIN) at the "
                f"total capacity of device + host + disk ({capacity_blocks} blocks"
                + (", at the largest host size of the sweep" if len(grid.host_bytes) > 1
                   else "")
                + f"), not per tier; over the {len(accepted)} requests not rejected"),
            "runs": {k: _finite(r) for k, r in zip(keys, rows, strict=True)},
            "warnings": cautions,
            # per run of the first seed, where its block policy was metered (a user's is)
            "block_policy_cost": {k: cost_summary(r.policy_cost)
                                  for k, r in first_results.items() if r.policy_cost},
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(report.format_table(keys, rows, bounds))
        for key in keys:
            if key in first_results and first_results[key].policy_cost:
                print(format_costs(key, first_results[key].policy_cost))
        for line in cautions:
            print(f"warning: {line}", file=sys.stderr)
        if args.requests_csv:
            _write_rows(out / "requests.csv", ["run", "rid", "arrival_s", "first_token_s",
                        "finish_s", "input_tokens", "output_tokens", "status", "prefix_tier",
                        "reused_tokens"], requests_rows)
            print(f"wrote {out / 'requests.csv'}")
        if args.decisions:
            _write_rows(out / "decisions.csv", ["run", "step", "at_s", "kind", "rid"],
                        decision_rows)
            print(f"wrote {out / 'decisions.csv'}")
        title = (f"{Path(args.trace).name}: {model.name} on {hardware.name}, "
                 f"time scale {time_scale:g}" + (f", {seeds} seeds" if seeds > 1 else ""))
        if args.sweep:
            write_csv(rows, out / "sweep.csv")
            print(f"wrote {out / 'sweep.csv'}")
        if not args.no_plots:
            from tiering.apps.replay.plots import plot_compare, plot_timeline

            written = plot_compare(keys, rows, bounds, out / "compare.png", title)
            timelines = {k: first_results[k].timeline for k in keys}
            caps = {k: first_results[k].capacities for k in keys}
            written += plot_timeline(timelines, caps, out / "timeline.png", title=title)
            if args.sweep:
                written += plot(rows, out, title)
            for path in written:
                print(f"wrote {path}")
        print(f"wrote {out / 'summary.json'}")
        keeper.discard()  # the partial record of finished runs: summary.json has them all
        return 0
    except OSError as err:
        print(f"tiering replay: --out: writing the results under {out} failed: {err}",
              file=sys.stderr)
        return 1


def _interrupted(keeper: jobs.Keeper) -> int:
    """Ctrl-C: the runs that finished are in ``keeper``'s file; exit status 130."""
    where = f": {keeper.kept} finished run(s) kept in {keeper.path}" if keeper.kept else (
        ": no run had finished")
    print(f"tiering replay: interrupted{where}", file=sys.stderr)
    return 130


def _accepted(trace, results: dict) -> list:
    """The requests of ``trace`` that no run rejected (runs with other watermarks reject
    others: the controller's admission limit is a fraction of the device)."""
    rejected = {int(rec.rid[1:]) for r in results.values() for rec in r.requests
                if rec.status == "rejected"}
    return [t for i, t in enumerate(trace) if i not in rejected]


def _write_rows(path: Path, header: list[str], rows: list[list]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            w.writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)
                        for v in row])


def _finite(row: dict) -> dict:
    """JSON has no NaN: a figure with no samples (e.g. no TPOT) is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}
