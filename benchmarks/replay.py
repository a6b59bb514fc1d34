"""Trace replay benchmark: how fast one configuration replays a whole trace.

Measures, in one run:

- ``raw``: loading the trace file and iterating its requests once (summing
  their tokens): the floor any replay pays;
- ``replay``: ``simulate`` of one policy over the whole trace (default: the
  Mooncake conversation trace, lru, llama-3.1-8b on h100-80g), with the
  recompute and no-tiering baselines for scale, and the same policy once more
  at request level (``prefix_reuse=False``: no block cached, moved or looked
  up), which shows what the block layer costs.

For each it reports the wall time, requests simulated per wall second, the
ratio to ``raw``, the simulated time covered and the steps (with how many ran
in the decode-only tight loop). Wall time is the best of ``--repeat`` runs.
The target for the tiering run is at most 10 times ``raw``. ``--policy``
takes a built-in name or a ``module:Class`` path.

``--before DIR`` first runs this same benchmark in another checkout ``DIR``
(a subprocess with ``DIR`` as its working directory, the same interpreter
and arguments) and reports both, back to back in one run, each with its own
``raw`` and ratios (``before`` in the JSON).

Usage: ``python benchmarks/replay.py --out replay.json [--limit N] [--repeat K] [--before DIR]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import table, write_json  # noqa: E402
from tiering.apps.replay.presets import StepCost, get_hardware, get_model  # noqa: E402
from tiering.apps.replay.simulator import RunSpec, SimConfig, simulate  # noqa: E402
from tiering.apps.replay.traces import load_trace  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake" / "conversation_trace.jsonl"


def _raw(path: Path, limit: int | None) -> tuple[float, int]:
    start = time.perf_counter()
    trace = load_trace(path, limit=limit)
    tokens = 0
    for req in trace:
        tokens += req.input_tokens + req.output_tokens + len(req.hash_ids)
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--hardware", default="h100-80g")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests")
    parser.add_argument("--repeat", type=int, default=1, help="best of K runs (default 1)")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout to run first, for a before/after comparison")
    args = parser.parse_args(argv)
    before = None
    if args.before is not None:
        before = _run_before(args, argv if argv is not None else sys.argv[1:])

    raw_s = min(_raw(args.trace, args.limit)[0] for _ in range(max(1, args.repeat)))
    trace = load_trace(args.trace, limit=args.limit)
    cost = StepCost(get_model(args.model), get_hardware(args.hardware))
    sim = SimConfig()
    rows = [("raw load+iterate", len(trace), raw_s, len(trace) / raw_s, 1.0, 0.0, 0, 0)]
    results = {"raw": {"wall_s": raw_s, "requests": len(trace)}}
    # the block-level runs (the default), then the policy's run at request level: the same
    # worker without prefix reuse, so no block is cached, moved or looked up
    plain = dataclasses.replace(sim, prefix_reuse=False)
    runs = [(RunSpec("tiering", args.policy), sim, None),
            (RunSpec("recompute"), sim, None), (RunSpec("no-tiering"), sim, None),
            (RunSpec("tiering", args.policy), plain, "no prefix reuse")]
    for spec, run_sim, note in runs:
        best = None
        for _ in range(max(1, args.repeat)):
            start = time.perf_counter()
            res = simulate(trace, cost, spec, run_sim, time_scale=args.time_scale)
            wall = time.perf_counter() - start
            best = wall if best is None else min(best, wall)
        key = spec.label if note is None else f"{spec.label}, {note}"
        label = f"replay {key}"
        rows.append((label, len(trace), best, len(trace) / best, best / raw_s, res.makespan_s,
                     res.counters.steps, res.counters.fast_steps))
        results[key] = {
            "wall_s": best,
            "requests_per_s": len(trace) / best,
            "ratio_to_raw": best / raw_s,
            "simulated_s": res.makespan_s,
            "steps": res.counters.steps,
            "fast_steps": res.counters.fast_steps,
            "steps_per_s": res.counters.steps / best,
        }
    headers = ("case", "requests", "wall s", "req/s", "x raw", "simulated s", "steps",
               "fast steps")
    speedup = None
    if before is not None:
        print(f"before ({args.before}):")
        old = before["results"]
        order = [c for c in results if c in old] + [c for c in old if c not in results]
        brows = [(_label(case), r.get("requests", len(trace)), r["wall_s"],
                  r.get("requests_per_s", r.get("requests", 0) / r["wall_s"]),
                  r.get("ratio_to_raw", 1.0), r.get("simulated_s", 0.0), r.get("steps", 0),
                  r.get("fast_steps", 0)) for case, r in ((c, old[c]) for c in order)]
        print(table(brows, headers))
        print("after (this checkout):")
    print(table(rows, headers))
    if before is not None:
        old = before["results"]
        speedup = {c: old[c]["wall_s"] / results[c]["wall_s"]
                   for c in results if c in old and c != "raw"}
        print("before -> after (each against its own raw load):")
        print(table([(_label(c), old[c]["wall_s"], results[c]["wall_s"],
                      old[c].get("ratio_to_raw", 0.0), results[c]["ratio_to_raw"], speedup[c])
                     for c in speedup],
                    ("case", "before s", "after s", "before x raw", "after x raw", "speed-up")))
    write_json(args.out, {
        "before": before,
        "speedup": speedup,
        "benchmark": "replay",
        "trace": str(args.trace),
        "model": args.model,
        "hardware": args.hardware,
        "policy": args.policy,
        "time_scale": args.time_scale,
        "target_ratio_to_raw": 10.0,
        "results": results,
    })
    return 0


def _label(case: str) -> str:
    return "raw load+iterate" if case == "raw" else f"replay {case}"


def _run_before(args: argparse.Namespace, argv: list[str]) -> dict:
    """This benchmark, run in the checkout ``args.before`` with the same arguments."""
    rest, skip = [], False
    for a in argv:  # drop --out and --before (and their values); the rest is passed on
        if skip:
            skip = False
            continue
        if a in ("--out", "--before"):
            skip = True
            continue
        if a.startswith(("--out=", "--before=")):
            continue
        rest.append(a)
    script = args.before / "benchmarks" / "replay.py"
    if not script.is_file():
        raise SystemExit(f"--before: {script} does not exist")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "before.json"
        trace = ["--trace", str(args.trace.resolve())] if "--trace" not in rest else []
        subprocess.run([sys.executable, str(script), "--out", str(out), *trace, *rest],
                       cwd=args.before, check=True, timeout=3600)
        return json.loads(out.read_text())


if __name__ == "__main__":
    sys.exit(main())
