"""Measure the figures that README.md and docs/ quote, and write them into the text.

    python scripts/figures.py [--runs N]   run `tiering demo` N times (default 3), record each
                                           run and the machine in docs/figures/demo.json, copy
                                           the last run's occupancy plot to
                                           docs/demo-occupancy.png, and rewrite the marked
                                           regions of README.md and docs/demo.md
    python scripts/figures.py --render     rewrite the marked regions from the recorded JSON only
    python scripts/figures.py --check      only re-render the regions from the recorded JSON;
                                           exit 1 naming each file whose text differs

A marked region is the text between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``;
everything in it is generated, so the quoted numbers are the recorded ones and say which
machine they came from. tests/test_readme.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "figures" / "demo.json"
PLOT = ROOT / "docs" / "demo-occupancy.png"
TARGETS = (ROOT / "README.md", ROOT / "docs" / "demo.md")
_REGION = re.compile(r"(<!-- figures:(?P<name>[a-z-]+) -->\n)(.*?)(<!-- /figures:(?P=name) -->)",
                     re.S)


def machine() -> dict:
    """What the numbers depend on: CPU model and count, load, Python, torch, the device."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": gpu,
        "os": f"{platform.system()} {platform.release()}",
    }


#: one demo run takes a minute or two; one past this is stuck, not slow
DEMO_TIMEOUT_S = 1800


def run_demo(out: Path) -> dict:
    """One `tiering demo` run in a child process: its summary, wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    exe = Path(sys.executable).with_name("tiering")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tiering"]
    try:
        proc = subprocess.run([*cmd, "demo", "--out", str(out)], capture_output=True, text=True,
                              check=False, timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"tiering demo ran past {DEMO_TIMEOUT_S} s; no figures written") from None
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"tiering demo failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_1min": machine()["load_1min"],
            "summary": summary}


def _span(values: list[float], fmt: str = "{:.0f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def _readiness_rows(s: list[dict]) -> str:
    """The rows of the layer-wise comparison and the long request (runs that have them)."""
    if not all("layerwise" in x and "long_request" in x for x in s):
        return ""
    lw = [x["layerwise"] for x in s]
    lr = [x["long_request"] for x in s]
    return (
        f"| reload stall, layer by layer vs whole-request (same requests) | "
        f"{_span([x['layer']['stall_s'] for x in lw], '{:.2f}')} s vs "
        f"{_span([x['whole']['stall_s'] for x in lw], '{:.2f}')} s |\n"
        f"| long request ({lr[0]['times_device']}x the device's KV), decode streamed vs compute"
        f" only | {_span([x['decode_tokens_per_s'] for x in lr])} vs "
        f"{_span([x['compute_only_tokens_per_s'] for x in lr])} tok/s |\n"
    )


def render(record: dict, name: str) -> str:
    """The text of region ``name`` from a record (the same for every file that has it)."""
    m, runs = record["machine"], record["runs"]
    s = [r["summary"] for r in runs]
    gpu = f", GPU {m['gpu']}" if m["gpu"] else ", no GPU"
    where = (f"{m['cores']}-core {m['cpu']}{gpu}; Python {m['python']}, torch {m['torch']}; "
             f"1-minute load {_span([r['load_1min'] for r in runs], '{:.1f}')} from other work")
    if name == "demo-summary":
        return (
            f"Measured by `make figures` ({len(runs)} runs of `make demo`, set-up done) on a "
            f"{where}:\n\n"
            f"| figure | range over the runs |\n|---|---|\n"
            f"| whole command, wall | {_span([r['wall_s'] for r in runs])} s |\n"
            f"| whole command, CPU (user + system) | {_span([r['cpu_s'] for r in runs])} s |\n"
            f"| pressured run (a quarter of the working set on the device) | "
            f"{_span([x['wall_s'] for x in s], '{:.1f}')} s |\n"
            f"| reference run (all KV on the device, no reuse) | "
            f"{_span([x['reference_wall_s'] for x in s], '{:.1f}')} s |\n"
            f"| prompt tokens run, pressured vs reference | "
            f"{_span([x['prefix']['prompt_tokens_run'] for x in s], '{:,.0f}')} vs "
            f"{_span([x['prefix']['reference_prompt_tokens_run'] for x in s], '{:,.0f}')} |\n"
            f"| offloads (device to host or disk) | "
            f"{_span([x['offloads']['device_to_host'] + x['offloads']['device_to_disk'] for x in s])} |\n"
            f"| reloads (host or disk to device) | "
            f"{_span([x['reloads']['from_host'] + x['reloads']['from_disk'] for x in s])} |\n"
            + _readiness_rows(s) +
            f"| outputs identical to the reference | "
            f"{'all runs' if all(x['identical'] for x in s) else 'NOT all runs'} |\n\n"
            "The two runs share the machine's cores with the copy threads, so which of them "
            "finishes first depends on the machine and its load; on another machine class "
            "expect other times. Token counts and move counts vary a little from run to run "
            "(copies run on threads); `identical` does not.\n"
        )
    raise KeyError(f"figures: no region named {name!r}")


def rewrite(text: str, record: dict) -> str:
    return _REGION.sub(lambda m: m.group(1) + render(record, m.group("name")) + m.group(4), text)


def check(record: dict) -> list[str]:
    """The files whose marked regions differ from what the record renders."""
    return [str(p.relative_to(ROOT)) for p in TARGETS
            if p.exists() and rewrite(p.read_text(), record) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="demo runs to measure (default 3)")
    ap.add_argument("--check", action="store_true",
                    help="only check that the text matches docs/figures/demo.json")
    ap.add_argument("--render", action="store_true",
                    help="rewrite the marked regions from docs/figures/demo.json, run nothing")
    args = ap.parse_args(argv)
    if args.render:
        record = json.loads(RECORD.read_text())
        for path in TARGETS:
            if path.exists():
                path.write_text(rewrite(path.read_text(), record))
        return 0
    if args.check:
        stale = check(json.loads(RECORD.read_text()))
        for path in stale:
            print(f"figures: {path} differs from {RECORD.relative_to(ROOT)}; run make figures")
        return 1 if stale else 0
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    record = {"command": "tiering demo", "machine": machine(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}"
            run = run_demo(out)
            record["runs"].append(run)
            print(f"run {i + 1}/{args.runs}: {run['wall_s']} s wall, {run['cpu_s']} s CPU",
                  file=sys.stderr)
        shutil.copyfile(out / "occupancy.png", PLOT)
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    for path in TARGETS:
        if path.exists():
            path.write_text(rewrite(path.read_text(), record))
    print(render(record, "demo-summary"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
