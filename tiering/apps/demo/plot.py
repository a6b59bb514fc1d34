"""The occupancy plot: bytes used in each tier, and where the live requests are, per step."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tiering._optional import require
from tiering.apps.demo.worker import StepSample

_MIB = 1024 * 1024


def plot_occupancy(
    samples: Sequence[StepSample],
    capacities: dict[str, int],
    path: str | Path,
    title: str = "KV cache occupancy per tier",
) -> Path:
    """Write a PNG of ``samples`` to ``path`` and return the path.

    Top panel: device, host and disk bytes used per step (MiB); each capacity
    from ``capacities`` (keys "device", "host", "disk"; 0 or missing: none)
    is named in the legend and drawn dashed when it is within the plotted
    range. Bottom panel: how many live requests have their KV on the device,
    on host, on disk, moving, or none yet. Uses matplotlib's Agg backend.
    """
    if not samples:
        raise ValueError("plot_occupancy: no samples to plot")
    matplotlib = require("matplotlib", "plots", "the demo's occupancy figure")
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [s.step for s in samples]
    series = {
        "device": ([s.device_bytes / _MIB for s in samples], "tab:red"),
        "host": ([s.host_bytes / _MIB for s in samples], "tab:blue"),
        "disk": ([s.disk_bytes / _MIB for s in samples], "tab:green"),
    }
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    peak = max(max(values) for values, _ in series.values())
    for name, (values, color) in series.items():
        cap = capacities.get(name, 0)
        label = f"{name} used" + (f" (capacity {cap / _MIB:.0f} MiB)" if cap else "")
        top.plot(steps, values, color=color, linewidth=1.4, label=label)
        if cap and cap / _MIB <= 1.5 * peak:
            top.axhline(cap / _MIB, color=color, linestyle="--", linewidth=0.9)
    top.set_ylim(0, 1.3 * peak if peak > 0 else 1.0)
    top.set_ylabel("MiB used (dashed: capacity)")
    top.set_title(title)
    top.grid(True, alpha=0.3)
    top.legend(loc="upper right", fontsize=8, ncol=3)

    bottom.stackplot(
        steps,
        [s.resident for s in samples],
        [s.on_host for s in samples],
        [s.on_disk for s in samples],
        [s.in_flight for s in samples],
        [s.not_started for s in samples],
        labels=["on device", "on host", "on disk", "moving", "not started"],
        colors=["tab:red", "tab:blue", "tab:green", "tab:gray", "lightgray"],
        alpha=0.75,
    )
    bottom.set_ylabel("live requests")
    bottom.set_xlabel("worker step")
    bottom.grid(True, alpha=0.3)
    bottom.legend(loc="upper right", fontsize=8, ncol=5)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
