"""Run one stress test from start to drained end and produce its report."""

from __future__ import annotations

import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiering.apps.stress.accounting import account_faults
from tiering.apps.stress.config import StressConfig
from tiering.apps.stress.harness import StressHarness
from tiering.apps.stress.report import build_report

#: The share of a run after which its memory is taken as warmed up.
WARMUP_FRACTION = 0.2


def _describe(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"


def run_stress(
    config: StressConfig,
    directory: str | Path | None = None,
    *,
    sleep: Callable[[float], None] = time.sleep,
    wall: Callable[[], float] = time.monotonic,
    on_step: Callable[[StressHarness], None] | None = None,
) -> dict[str, Any]:
    """Run ``config`` (its ``steps``, or for its ``duration_s`` on ``wall``), drain,
    account for the faults and return the report (``tiering.apps.stress.report``).

    The disk tier lives in ``directory`` (a fresh temporary one when None).
    ``sleep`` is what slow disk faults wait with. An unexpected exception
    stops the stepping; it is reported under ``errors`` and the run is
    still drained and accounted for.
    """
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="tiering-stress-") as tmp:
            return run_stress(config, tmp, sleep=sleep, wall=wall, on_step=on_step)
    started = wall()
    harness = StressHarness(config, directory, sleep=sleep)
    errors: list[str] = []
    try:
        try:
            while True:
                if config.steps is not None:
                    done = harness.counts.steps / config.steps
                else:
                    done = (wall() - started) / config.duration_s
                if done >= 1.0:
                    break
                if harness.rss.warm is None and done >= WARMUP_FRACTION:
                    harness.rss.mark_warm()
                harness.at_progress(done)
                harness.step()
                if on_step is not None:
                    on_step(harness)
            harness.at_progress(1.0)  # what is due at the very end, before the drain
        except Exception as exc:  # noqa: BLE001 - reported, then the run is drained
            errors.append(f"step {harness.counts.steps}: {_describe(exc)}")
        try:
            harness.drain()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"drain: {_describe(exc)}")
    finally:
        harness.close()
    faults = harness.faults
    account = account_faults(
        injected=faults.injected(),
        copy_injected=faults.copy_plan.injected,
        slow_waits=faults.sleeps.calls,
        kv_stats=harness.kv_stats(),
        disk_stats=harness.disk_stats(),
        lost_reasons=[reason for _, reason in harness.lost],
        removed_failures=harness.removed_failures,
    )
    return build_report(config, harness, account, errors, wall() - started)
