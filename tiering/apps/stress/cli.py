"""``tiering stress``: run the stress test, print its report, write it as JSON.

Exit status: 0 when the run passed; 1 when any byte read back was wrong, an
integrity check failed, an injected fault is not accounted for, something
unexpected was raised, a restart of a ``reattach`` run brought back anything but
exactly the requests on disk, a second open of the live disk path was not refused
or changed its files, or (with ``--crash``) the crash check failed; 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tiering.apps.console import Progress, add_common_options, log_level, verbosity
from tiering.apps.stress.config import PATHS, parse_paths
from tiering.apps.stress.faults import FAULT_KINDS, parse_faults


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiering stress",
        description="Stress the real tiered KV cache under memory pressure with injected "
        "faults; check every byte read back, integrity throughout and that nothing leaks.",
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                        help="how long to run (default 60)")
    length.add_argument("--steps", type=int, default=None,
                        help="run this many steps instead of a duration")
    p.add_argument("--faults", default="all",
                   help=f"all, none or a comma-separated list of: {', '.join(FAULT_KINDS)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the faults")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the report here")
    p.add_argument("--fault-rate", type=float, default=0.03,
                   help="probability that an armed fault strikes an operation (default 0.03)")
    p.add_argument("--slow-ms", type=float, default=5.0,
                   help="latency a slow-disk fault adds, in milliseconds (default 5)")
    p.add_argument("--dir", default=None,
                   help="directory for the disk tier (default: a fresh temporary directory)")
    p.add_argument("--device", default="auto",
                   help="device tier: auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--paths", default="all",
                   help="workload paths added to the basic one: all (default), none or a "
                   f"comma-separated list of: {', '.join(PATHS)}")
    p.add_argument("--restarts", type=int, default=2,
                   help="with the reattach path: how many times the cache restarts (default 2)")
    p.add_argument("--crash", action="store_true",
                   help="also kill a process mid-write and check the restart over its directory")
    add_common_options(p)
    return p


@contextlib.contextmanager
def _quiet_library_logs():
    """Injected faults make the cache log every failure; the report counts them instead
    (unless ``-v`` asks for the log)."""
    logger = logging.getLogger("tiering")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _progress(total: float, unit: str, by_time: bool, *, quiet: bool = False,
              stream=None, tty: bool | None = None,
              clock=time.monotonic) -> tuple[Progress, Any]:
    """The run's progress (a bar on a terminal, plain lines elsewhere) and the
    ``on_step`` callback that feeds it."""
    bar = Progress(total, desc="stress", unit=unit, quiet=quiet, stream=stream, tty=tty,
                   clock=clock)
    started = clock()

    def on_step(h) -> None:
        if h.counts.steps % 50 == 0:  # before the line the update may print
            bar.note(f"ops={h.counts.operations} live={h.live_requests()} "
                     f"lost={len(h.lost)} errors={h.counts.data_errors}")
        bar.set(min(total, clock() - started) if by_time else h.counts.steps)

    return bar, on_step


def _crash_section(seed: int) -> dict[str, Any]:
    from tiering.apps.stress.crash import run_crash_check

    with tempfile.TemporaryDirectory(prefix="tiering-crash-") as tmp:
        out = run_crash_check(tmp, seed=seed)
    problems = list(out.problems)
    if not out.writes_in_flight:
        problems.append("the child was not killed inside a chunk write")
    return {
        "committed_before_kill": len(out.committed),
        "uncertain_at_kill": len(out.uncertain),
        "reattached": len(out.reattached),
        "verified": out.verified,
        "problems": problems,
    }


def _cuda_available() -> bool:
    import torch

    try:
        return torch.cuda.is_available()
    except Exception:  # torch raises mixed types when no driver is present
        return False


def _resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if _cuda_available() else "cpu"
    if name.startswith("cuda") and not _cuda_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return name


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with log_level(verbosity(args)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from tiering.apps.stress.config import StressConfig
    from tiering.apps.stress.report import failures, format_report
    from tiering.apps.stress.runner import run_stress

    try:
        faults = parse_faults(args.faults)
        duration = (
            args.duration if args.duration is not None or args.steps is not None else 60.0
        )
        config = StressConfig(
            seed=args.seed, steps=args.steps, duration_s=duration, faults=faults,
            fault_rate=args.fault_rate, slow_seconds=args.slow_ms / 1000.0,
            device=_resolve_device(args.device), paths=parse_paths(args.paths),
            restarts=args.restarts,
        )
        if args.out is not None:
            _check_out(Path(args.out))
        if args.dir is not None:
            _check_dir(Path(args.dir))
    except ValueError as err:
        print(f"tiering stress: {err}", file=sys.stderr)
        return 2

    by_time = config.steps is None
    total = config.duration_s if by_time else config.steps
    bar, on_step = _progress(total, "s" if by_time else "steps", by_time,
                             quiet=verbosity(args) < 0)
    # -v asks for the library's log lines: the injected faults' are what it wants to see
    with _quiet_library_logs() if verbosity(args) <= 0 else contextlib.nullcontext():
        try:
            report = run_stress(config, args.dir, on_step=on_step)
        finally:
            bar.close()
        if args.crash:
            report["crash"] = _crash_section(config.seed)
            report["ok"] = not failures(report)
    print(format_report(report))
    if args.out:
        out = Path(args.out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as err:
            print(f"tiering stress: --out {args.out}: cannot write the report: {err}",
                  file=sys.stderr)
            return 2
        print(f"report written to {out}")
    return 0 if report["ok"] else 1


def _check_dir(path: Path) -> None:
    """``--dir`` must be an empty directory, or absent and creatable (it is created here,
    so a path the run could not use is refused before it starts)."""
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"--dir {path}: not a directory")
        if any(path.iterdir()):
            raise ValueError(f"--dir {path}: must be empty or absent")
        return
    try:
        path.mkdir(parents=True)
    except OSError as err:
        raise ValueError(f"--dir {path}: cannot create it: {err}") from err


def _check_out(path: Path) -> None:
    """``--out`` must be a file that can be written: checked before the run, by opening
    it for appending (a file that did not exist is removed again), not after it."""
    if path.is_dir():
        raise ValueError(f"--out {path}: is a directory")
    existed = path.exists()
    made: list[Path] = []
    try:
        for parent in reversed(path.parents):
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        with open(path, "a"):
            pass
    except OSError as err:
        raise ValueError(f"--out {path}: cannot be written: {err}") from err
    finally:
        if not existed:
            with contextlib.suppress(OSError):
                path.unlink()
            for parent in reversed(made):
                with contextlib.suppress(OSError):
                    parent.rmdir()
