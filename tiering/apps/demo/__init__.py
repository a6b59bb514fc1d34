"""``tiering demo``: a small long-context serving worker on the tiered KV cache.

Serves synthetic long-prompt requests with a small randomly initialised
transformer whose attention reads its KV from ``PagedKVCache``, twice: once
with a device pool of about a quarter of the working set (the rest on host
and on disk, moved by the ``EvictionController``), once with everything on
the device and no prefix reuse (the pressured run reuses cached prefixes of
shared system prompts and earlier conversations). Prints a summary, says
whether every request's tokens and final logits were bitwise identical in
both runs, and writes ``summary.json`` and ``occupancy.png``. Exit status 0 when identical, 1 when not.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tiering.apps.console import Progress, add_common_options, log_level, verbosity

DEFAULT_OUT = "demo-out"


def _parser(default_requests: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiering demo",
        description="Serve long-context requests on a tiered KV cache and check that "
        "memory pressure changes no output.",
    )
    p.add_argument("--requests", type=int, default=default_requests,
                   help=f"number of requests (default {default_requests})")
    p.add_argument("--seed", type=int, default=0, help="seed for the model and the requests")
    p.add_argument("--device", default="auto",
                   help="torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--out", default=None,
                   help=f"directory for summary.json and occupancy.png (default ./{DEFAULT_OUT})")
    add_common_options(p)
    return p


def _resolve_device(name: str) -> str:
    import torch

    from tiering.apps.demo.scenario import is_device_name

    if name == "auto":
        try:
            return "cuda" if torch.cuda.is_available() else "cpu"
        except Exception:  # torch raises mixed types when no driver is present
            return "cpu"
    if not is_device_name(name):
        raise ValueError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N")
    if name.startswith("cuda"):
        try:
            ok = torch.cuda.is_available()
        except Exception:
            ok = False
        if not ok:
            raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return name


def _prepare_torch(device: str) -> None:
    """Threads and determinism settings for the process running the demo."""
    import torch

    if device.startswith("cuda"):
        # cuBLAS needs a fixed workspace to be deterministic across streams.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    else:
        # Leave a core to the copy and disk threads; on a small machine one
        # compute thread is also far steadier than two competing for it.
        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, min(torch.get_num_threads(), cores // 2)))


class _Progress:
    """One progress line or bar per run (``tiering.apps.console.Progress``), each opened
    when its run produces its first token."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total = total
        self._quiet = quiet
        self._runs: dict[str, Progress] = {}

    def _tick(self, name: str) -> None:
        run = self._runs.get(name)
        if run is None:
            self.close()  # the previous run has ended
            run = Progress(self.total, desc=f"demo {name}", unit="tok", quiet=self._quiet)
            self._runs[name] = run
        run.update(1)

    def pressured(self) -> None:
        self._tick("under pressure")

    def reference(self) -> None:
        self._tick("reference")

    def close(self) -> None:
        for run in self._runs.values():
            run.close()  # closing twice is harmless


def main(argv: list[str] | None = None) -> int:
    from tiering.apps.demo.scenario import DemoConfig

    parser = _parser(DemoConfig().requests)
    args = parser.parse_args(argv)
    with log_level(verbosity(args)):
        return _run(args, parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tiering.apps.demo.scenario import DemoConfig

    if args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")
    try:
        device = _resolve_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    try:
        cfg = DemoConfig(requests=args.requests, seed=args.seed, device=device)
    except ValueError as err:
        parser.error(str(err))
    out_dir = Path(args.out if args.out is not None else DEFAULT_OUT)
    try:  # before the run, so a place the files cannot go is named before minutes of work
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out {out_dir}: cannot create the output directory: {err}")
    _prepare_torch(device)

    from tiering.apps.demo.plot import plot_occupancy
    from tiering.apps.demo.report import format_summary
    from tiering.apps.demo.scenario import run_demo

    total = sum(r.max_new_tokens for r in cfg.draw_requests())

    progress = _Progress(total, quiet=verbosity(args) < 0)
    try:
        with tempfile.TemporaryDirectory(prefix="tiering-demo-disk-") as disk_dir:
            report = run_demo(
                cfg,
                Path(disk_dir),
                on_token=progress.pressured,
                on_reference_token=progress.reference,
            )
    finally:
        progress.close()

    summary = report.summary
    plan = report.pressured.plan
    pb = report.pressured.page_bytes
    png = plot_occupancy(
        report.pressured.result.samples,
        {"device": plan.device_pages * pb, "host": plan.host_pages * pb, "disk": plan.disk_bytes},
        out_dir / "occupancy.png",
        title=f"KV occupancy per tier: {cfg.requests} requests, device holds "
        f"{100.0 * plan.device_pages / plan.working_set_pages:.0f}% of the working set",
    )
    json_path = out_dir / "summary.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary))
    print(f"wrote {json_path} and {png}")
    return 0 if summary["identical"] else 1
