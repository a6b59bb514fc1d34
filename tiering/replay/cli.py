"""``tiering replay``: replay a trace against simulated tiers and report.

    tiering replay TRACE --out DIR [--policy P[,P...]|all] [--model M] [--hardware H]
                   [--limit N] [--time-scale X] [--host-gib G[,G...]]
                   [--watermarks HIGH:LOW[,...]] [--sweep] [--format F] [--no-prefix-reuse]

Without ``--sweep``: each policy runs at the first watermark pair and host
size, next to the ``recompute`` and ``no-tiering`` baselines; ``DIR/summary.json``
gets one entry per policy and per baseline, and a table is printed. With
``--sweep``: every policy at every watermark pair and host size (defaults: all
policies, three watermark pairs, five host sizes up to the preset's), written
to ``DIR/sweep.csv``, ``DIR/summary.json`` and two PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from policies import default_registry
from tiering.replay.presets import HARDWARE, MODELS, GiB, StepCost, get_hardware, get_model
from tiering.replay.simulator import SimConfig
from tiering.replay.sweep import Grid, plot, run_grid, write_csv
from tiering.replay.traces import FORMATS, load_trace

DEFAULT_WATERMARKS = ((0.9, 0.75),)
SWEEP_WATERMARKS = ((0.9, 0.75), (0.95, 0.85), (0.8, 0.6))
SWEEP_HOST_FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiering replay",
        description="Replay a production trace through a simulated serving worker.",
    )
    p.add_argument("trace", help="trace file (.jsonl Mooncake, .csv Azure or BurstGPT)")
    p.add_argument("--out", required=True, help="directory for summary.json (and sweep files)")
    p.add_argument("--policy", default=None,
                   help="policy, comma list, or 'all' (default: lru; with --sweep: all)")
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    p.add_argument("--hardware", default="h100-80g", choices=sorted(HARDWARE))
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times by X (2 halves the request rate)")
    p.add_argument("--host-gib", default=None,
                   help="host tier size(s) in GiB, comma list (default: the preset's)")
    p.add_argument("--watermarks", default=None,
                   help="device watermark pair(s) HIGH:LOW, comma list (default 0.9:0.75)")
    p.add_argument("--sweep", action="store_true",
                   help="run every policy x watermark pair x host size")
    p.add_argument("--format", choices=FORMATS, default=None, help="trace format (default: detect)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="do not retain finished prompts for reuse")
    return p


def _policies(text: str | None, sweep: bool) -> tuple[str, ...]:
    known = default_registry().names
    if text is None:
        return known if sweep else ("lru",)
    if text == "all":
        return known
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    for name in names:
        if name not in known:
            raise ValueError(f"--policy: unknown policy {name!r}; known: {', '.join(known)}")
    if not names:
        raise ValueError("--policy: no policy named")
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
            pairs.append((float(high), float(low)))
        except ValueError:
            raise ValueError(f"--watermarks: {item!r} is not HIGH:LOW (e.g. 0.9:0.75)") from None
    return tuple(pairs)


def _host_sizes(text: str | None, preset_bytes: int, sweep: bool) -> tuple[int, ...]:
    if text is None:
        if sweep:
            return tuple(int(preset_bytes * f) for f in SWEEP_HOST_FRACTIONS)
        return (preset_bytes,)
    sizes = []
    for item in text.split(","):
        try:
            gib = float(item)
        except ValueError:
            raise ValueError(f"--host-gib: {item!r} is not a number of GiB") from None
        if not math.isfinite(gib) or gib < 0:
            raise ValueError(f"--host-gib: {item!r} must be a number >= 0")
        sizes.append(int(gib * GiB))
    return tuple(sizes)


def _run_key(row: dict, sweep: bool) -> str:
    if row["mode"] != "tiering" or not sweep:
        return row["label"]
    return f"{row['policy']}@{row['high']:g}:{row['low']:g}@{row['host_gib']:g}GiB"


TABLE = (
    ("run", "{}"), ("done", "{}"), ("tok/s", "{:.0f}"), ("ttft p50", "{:.2f}"),
    ("ttft p99", "{:.2f}"), ("tpot p50", "{:.4f}"), ("tpot p99", "{:.4f}"), ("preempt", "{}"),
    ("offl h/d", "{}"), ("reload h/d", "{}"), ("recomp tok", "{}"), ("hit d/h/d", "{}"),
)


def format_table(keys: list[str], rows: list[dict]) -> str:
    """A plain-text table of the main figures, one line per run."""
    lines = []
    for key, r in zip(keys, rows, strict=True):
        cells = (
            key, r["finished"], r["throughput_tok_s"], r["ttft_p50_s"], r["ttft_p99_s"],
            r["tpot_p50_s"], r["tpot_p99_s"], r["preemptions"],
            f"{r['offloads_to_host']}/{r['offloads_to_disk']}",
            f"{r['reloads_from_host']}/{r['reloads_from_disk']}", r["recomputed_tokens"],
            f"{r['hit_rate_device']:.2f}/{r['hit_rate_host']:.2f}/{r['hit_rate_disk']:.2f}",
        )
        lines.append([fmt.format(c) for (_, fmt), c in zip(TABLE, cells, strict=True)])
    head = [h for h, _ in TABLE]
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        policies = _policies(args.policy, args.sweep)
        watermarks = _watermarks(args.watermarks, args.sweep)
        model = get_model(args.model)
        hardware = get_hardware(args.hardware)
        hosts = _host_sizes(args.host_gib, hardware.host_bytes, args.sweep)
        if not args.sweep and (len(watermarks) > 1 or len(hosts) > 1):
            raise ValueError("several --watermarks or --host-gib values need --sweep")
        grid = Grid(policies, watermarks, hosts)
        sim = SimConfig(prefix_reuse=not args.no_prefix_reuse)
        trace = load_trace(args.trace, args.format, args.limit)
    except (ValueError, FileNotFoundError) as err:
        print(f"tiering replay: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    with tqdm(total=len(trace) * grid.runs(), unit="req", desc="replay", file=sys.stderr,
              disable=None) as bar:
        def on_run(row: dict) -> None:
            bar.set_postfix_str(row["label"])

        rows = run_grid(trace, model, hardware, grid, sim, time_scale=args.time_scale,
                        on_finish=bar.update, on_run=on_run)
    keys = [_run_key(r, args.sweep) for r in rows]
    cost = StepCost(model, hardware)
    summary = {
        "trace": str(args.trace),
        "requests": len(trace),
        "time_scale": args.time_scale,
        "model": {**dataclasses.asdict(model), "kv_bytes_per_token": model.kv_bytes_per_token},
        "hardware": dataclasses.asdict(hardware),
        "step_cost": {"prefill_s_per_token": cost.prefill_s_per_token,
                      "decode_s_per_step": cost.decode_s_per_step},
        "sim": dataclasses.asdict(sim),
        "runs": {k: _finite(r) for k, r in zip(keys, rows, strict=True)},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_table(keys, rows))
    if args.sweep:
        write_csv(rows, out / "sweep.csv")
        title = (f"{Path(args.trace).name}: {model.name} on {hardware.name}, "
                 f"time scale {args.time_scale:g}")
        for path in plot(rows, out, title):
            print(f"wrote {path}")
        print(f"wrote {out / 'sweep.csv'}")
    print(f"wrote {out / 'summary.json'}")
    return 0


def _finite(row: dict) -> dict:
    """JSON has no NaN: a figure with no samples (e.g. no TPOT) is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}
