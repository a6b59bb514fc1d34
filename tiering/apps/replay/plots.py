"""Figures a person reads at a glance.

- ``plot_compare`` (``compare_figure``): one bar per run, each with its value written on
  it; a run's rejected requests, and a saturated worker, are named under its label. Left,
  the token hit rate split by the tier it came from, with the infinite-cache bound (black,
  dotted) and Belady's (red, dashed, drawn over it: both show when they coincide) as lines
  (the axis reaches well above the highest bar or bound: room for the legend); left out
  when the trace has no block hashes (no run could hit, no bound exists). Right, p99 time
  to first token, on a log axis when the runs, with the ends of their intervals, span
  more than a factor of 20 (a slow baseline would otherwise squash the rest). Error bars
  are the 95% intervals when several seeds ran, cut at what the figure can be (a rate in
  [0, 1], a time >= 0; on a log axis an interval reaching 0 is drawn to the bottom of the
  axis).
- ``plot_timeline``: per-tier occupancy (mean fraction of each tier's
  capacity) and the token hit rate over time, per window of simulated time,
  one line per run, told apart by colour, dash pattern and marker (the same in every
  panel).
- ``plot_sweep``: token hit rate (not for a trace without block hashes) and p99 TTFT
  against host size, one line per policy and one panel per watermark pair, baselines as grey lines (log
  axis for TTFT when the range needs it); with several seeds, each point
  has its 95% interval, cut as above.

Every function returns the paths it wrote (PNG, Agg backend).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tiering._optional import require
from tiering.apps.replay.bounds import BoundResult
from tiering.apps.replay.results import Sample

TIERS = ("device", "host", "disk")
COLORS = {"device": "#2b6cb0", "host": "#dd6b20", "disk": "#718096"}
_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*")
_DASHES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (8, 3)))



def _save(plt, fig, path: str | Path, title: str, dpi: int) -> Path:
    """Title (if any), lay out, write ``path`` and close the figure."""
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out

def _plt():
    matplotlib = require("matplotlib", "plots", "the replay's figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def needs_log(values: Sequence[float], span: float = 20.0) -> bool:
    """Whether positive ``values`` span more than ``span`` times (a log axis reads better)."""
    pos = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    return len(pos) >= 2 and max(pos) / min(pos) > span


def rate_top(values: Sequence[float], above: float = 1.2) -> float:
    """The top of a hit-rate axis: ``above`` times the highest value shown, so that rates of
    a few percent are not squashed against a 0..1 axis; never above 1, never below 0.05."""
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return min(1.0, max(0.05, above * max(finite, default=1.0)))


def interval(values: Sequence[float], halves: Sequence[float], low: float = 0.0,
             high: float = math.inf) -> np.ndarray:
    """The ``yerr`` of matplotlib (2 x n: below, above) for ``values`` +- ``halves``, each
    end cut to ``[low, high]``, what the figure can be (a rate cannot pass 1, a time
    cannot fall below 0); a value or half-width that is not finite draws no bar."""
    v = np.asarray(values, dtype=np.float64)
    h = np.asarray(halves, dtype=np.float64)
    ok = np.isfinite(v) & np.isfinite(h)
    v0 = np.where(ok, v, 0.0)
    h0 = np.where(ok, np.maximum(h, 0.0), 0.0)
    below = v0 - np.maximum(v0 - h0, low)
    above = np.minimum(v0 + h0, high) - v0
    return np.maximum(np.vstack([below, above]), 0.0)


def _log_floor(err: np.ndarray, values: Sequence[float]) -> np.ndarray:
    """``err`` for a log axis: an interval that reaches 0 or below ends at half the
    smallest positive lower end shown (the bottom of the axis) instead."""
    v = np.asarray(values, dtype=np.float64)
    lows = v - err[0]
    pos = lows[np.isfinite(lows) & (lows > 0)]
    floor = 0.5 * float(pos.min()) if len(pos) else 0.0
    out = err.copy()
    hit = np.isfinite(v) & (lows <= 0) & (v > 0)
    out[0] = np.where(hit, v - np.minimum(floor, v), out[0])
    return out


def _ci_of(rows: Sequence[Mapping], key: str) -> list[float]:
    return [float(r.get(f"{key}_ci95") or 0.0) for r in rows]


# how each bound is drawn: the infinite cache under, Belady over it and apart in colour
BOUND_STYLE = {
    "infinite": {"color": "black", "linestyle": ":", "linewidth": 1.4, "zorder": 3},
    "belady": {"color": "#c53030", "linestyle": (0, (6, 4)), "linewidth": 2.0, "zorder": 4},
}


def _run_label(label: str, row: Mapping) -> str:
    """A bar's label, with what a reader must know about its run."""
    notes = []
    rejected = row.get("rejected") or 0
    if rejected:
        notes.append(f"{rejected:.0f} rejected")
    if row.get("saturated"):
        notes.append("saturated")
    return "\n".join([label, *notes])


def _has_hits(rows: Sequence[Mapping], bounds: Sequence[BoundResult]) -> bool:
    """Whether a hit-rate panel has anything to show (a trace with block hashes)."""
    return any(b.blocks for b in bounds) or any(
        float(r.get("token_hit_rate") or 0.0) > 0 or r.get("lookup_blocks") for r in rows)


def compare_figure(labels: Sequence[str], rows: Sequence[Mapping],
                   bounds: Sequence[BoundResult], title: str = ""):
    """The figure ``plot_compare`` writes (matplotlib's Figure, not yet saved)."""
    plt = _plt()
    n = len(rows)
    hits = _has_hits(rows, bounds)
    width = max(9.0, 1.3 * n + 5) if hits else max(5.5, 0.9 * n + 3)
    fig, axes = plt.subplots(1, 2 if hits else 1, figsize=(width, 4.8), squeeze=False)
    x = np.arange(n)
    shown = [_run_label(label, r) for label, r in zip(labels, rows, strict=True)]
    if hits:
        left, right = axes[0]
        _hit_panel(left, x, rows, bounds)
    else:
        right = axes[0][0]
    ttft = [float(r["ttft_p99_s"]) if r.get("ttft_p99_s") is not None else math.nan
            for r in rows]
    bars = right.bar(x, ttft, color="#4a5568")
    right.bar_label(bars, labels=[_seconds(v) for v in ttft], fontsize=7, padding=2)
    terr = interval(ttft, _ci_of(rows, "ttft_p99_s"), 0.0)
    ends = [*ttft, *(np.asarray(ttft) + terr[1]).tolist(), *(np.asarray(ttft) - terr[0]).tolist()]
    log = needs_log(ends)
    if log:
        terr = _log_floor(terr, ttft)
    if terr.any():
        right.errorbar(x, ttft, yerr=terr, fmt="none", ecolor="black", capsize=3)
    if log:
        right.set_yscale("log")
    right.set_ylabel("p99 time to first token (s)")
    note = "" if hits else "; the trace has no block hashes: no hit rate to show"
    right.set_title("p99 TTFT" + (" (log axis)" if log else "") + note, fontsize=10)
    right.margins(y=0.12)  # room for the value labels
    for ax in axes[0]:
        ax.set_xticks(x, shown, rotation=30, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _hit_panel(ax, x: np.ndarray, rows: Sequence[Mapping],
               bounds: Sequence[BoundResult]) -> None:
    n = len(rows)
    bottom = np.zeros(n)
    for tier in TIERS:
        vals = np.array([float(r.get(f"token_hit_rate_{tier}", 0.0)) for r in rows])
        ax.bar(x, vals, bottom=bottom, color=COLORS[tier], label=f"from {tier}")
        bottom += vals
    err = interval(bottom, _ci_of(rows, "token_hit_rate"), 0.0, 1.0)
    if err.any():
        ax.errorbar(x, bottom, yerr=err, fmt="none", ecolor="black", capsize=3)
    for xi, total, above in zip(x, bottom, err[1], strict=True):
        ax.text(xi, total + above, f"{total:.3f}", ha="center", va="bottom", fontsize=7)
    for b in sorted(bounds, key=lambda b: b.name != "infinite"):  # Belady drawn last
        if not b.blocks:  # a trace without block ids: nothing to bound
            continue
        style = BOUND_STYLE.get(b.name, {"color": "grey", "linestyle": "-."})
        ax.axhline(b.token_hit_rate, label=f"{b.name} bound {b.token_hit_rate:.3f}", **style)
    # room above the bars for the legend band (two rows), which then hides none of them
    ax.set_ylim(0, rate_top([*(bottom + err[1]).tolist(),
                             *(b.token_hit_rate for b in bounds if b.blocks)], 1.45))
    ax.set_ylabel("prompt tokens reused (fraction)")
    ax.set_title("token hit rate by tier", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", ncol=3)


def _seconds(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"


def plot_compare(labels: Sequence[str], rows: Sequence[Mapping], bounds: Sequence[BoundResult],
                 path: str | Path, title: str = "") -> list[Path]:
    plt = _plt()
    fig = compare_figure(labels, rows, bounds, title)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


def plot_timeline(timelines: Mapping[str, Sequence[Sample]], capacities: Mapping[str, Mapping],
                  path: str | Path, window_s: float | None = None,
                  title: str = "") -> list[Path]:
    """``timelines``: label -> samples; ``capacities``: label -> {"<tier>_bytes": int}.
    ``window_s``: the window of the hit-rate curve (default: a fiftieth of the span)."""
    plt = _plt()
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    span = max((s[-1].t for s in timelines.values() if s), default=1.0) or 1.0
    window = window_s or span / 50
    for i, (label, samples) in enumerate(timelines.items()):
        if not samples:
            continue
        t = np.array([s.t for s in samples])
        # one colour, dash pattern and marker per run in every panel, whichever tiers it has
        style = {"label": label, "color": f"C{i % 10}", "linewidth": max(0.9, 1.8 - 0.15 * i),
                 "linestyle": _DASHES[i % len(_DASHES)],
                 "marker": _MARKERS[i % len(_MARKERS)], "markersize": 4}
        edges = np.arange(0.0, t[-1] + window, window)
        slot = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, max(len(edges) - 2, 0))
        counts = np.bincount(slot, minlength=max(len(edges) - 1, 1)).astype(np.float64)
        mids = (edges[:-1] + edges[1:]) / 2 if len(edges) > 1 else edges
        for ax, tier in zip(axes[:3], TIERS, strict=True):
            cap = capacities[label].get(f"{tier}_bytes", 0)
            if not cap:
                continue
            used = np.array([getattr(s, f"{tier}_bytes") for s in samples]) / cap
            sums = np.bincount(slot, weights=used, minlength=len(counts))
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = np.where(counts > 0, sums / counts, np.nan)
            ax.plot(mids[: len(mean)], mean, markevery=_every(len(mean), i), **style)
        looked = np.array([s.lookup_tokens for s in samples], dtype=np.float64)
        reused = np.array([s.reused_device + s.reused_host + s.reused_disk for s in samples],
                          dtype=np.float64)
        idx = np.searchsorted(t, edges, side="right") - 1
        idx = np.clip(idx, 0, len(t) - 1)
        d_look = np.diff(looked[idx])
        d_reuse = np.diff(reused[idx])
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(d_look > 0, d_reuse / d_look, np.nan)
        axes[3].plot(edges[1:], rate, markevery=_every(len(rate), i), **style)
    for ax, tier in zip(axes[:3], TIERS, strict=True):
        ax.set_ylabel(f"{tier} used\n(of capacity,\nmean per {window:.0f} s)")
        ax.set_ylim(0, 1.05)
        ax.grid(True, alpha=0.3)
    axes[3].set_ylabel(f"token hit rate\n(per {window:.0f} s)")
    axes[3].set_ylim(0, 1.0)
    axes[3].grid(True, alpha=0.3)
    axes[3].set_xlabel("simulated time (s)")
    # below the panels, where it hides no line (the device panel is full near 1.0)
    axes[3].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3)
    return [_save(plt, fig, path, title, dpi=100)]


def _every(n: int, i: int) -> tuple[int, int]:
    """About eight markers on a line of ``n`` points, run ``i``'s shifted from the others'."""
    step = max(1, n // 8)
    return (i % step, step)


SWEEP_PLOTS = (
    ("token_hit_rate", "prompt tokens reused (fraction)", "hit_rate_vs_host.png"),
    ("ttft_p99_s", "p99 time to first token (s)", "ttft_p99_vs_host.png"),
)


def plot_sweep(rows: Sequence[Mapping], out_dir: str | Path, title: str = "") -> list[Path]:
    plt = _plt()
    tiered = [r for r in rows if r["mode"] == "tiering"]
    if not tiered:
        raise ValueError("plot: no tiering runs to plot")
    base = [r for r in rows if r["mode"] != "tiering"]
    pairs = sorted({(r["high"], r["low"]) for r in tiered}, reverse=True)
    policies = sorted({r["policy"] for r in tiered})
    written = []
    hits = _has_hits(rows, ())
    for metric, ylabel, filename in SWEEP_PLOTS:
        if metric == "token_hit_rate" and not hits:  # no block hashes: nothing to draw
            continue
        fig, axes = plt.subplots(1, len(pairs), figsize=(5.2 * len(pairs), 4.2), sharey=True,
                                 squeeze=False)
        rate = metric == "token_hit_rate"
        values = [float(r[metric]) for r in rows if r.get(metric) is not None]
        with_ci = [r for r in tiered if r.get(metric) is not None]
        shown = np.asarray([float(r[metric]) for r in with_ci], dtype=np.float64)
        errs = interval(shown, _ci_of(with_ci, metric), 0.0, 1.0 if rate else math.inf)
        ends = [*values, *(shown + errs[1]).tolist()]
        log = not rate and needs_log(ends)
        for ax, (high, low) in zip(axes[0], pairs, strict=True):
            for i, policy in enumerate(policies):
                pts = sorted(
                    (r["host_gib"], r[metric], float(r.get(f"{metric}_ci95") or 0.0))
                    for r in tiered
                    if r["policy"] == policy and (r["high"], r["low"]) == (high, low)
                    and r.get(metric) is not None
                )
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                line, = ax.plot(xs, ys, label=policy,
                                marker=_MARKERS[i % len(_MARKERS)],
                                markersize=max(3.0, 9.0 - 1.2 * i),
                                linewidth=max(0.8, 2.4 - 0.3 * i))
                err = interval(ys, [p[2] for p in pts], 0.0, 1.0 if rate else math.inf)
                if log:
                    err = _log_floor(err, ys)
                if err.any():  # several seeds: each point's 95% interval
                    ax.errorbar(xs, ys, yerr=err, fmt="none", ecolor=line.get_color(),
                                capsize=3, alpha=0.8)
            for r, style in zip(base, ("--", ":"), strict=False):
                if r.get(metric) is not None:
                    ax.axhline(r[metric], linestyle=style, color="grey", label=r["label"])
            ax.set_title(f"watermarks high={high:g} low={low:g}", fontsize=10)
            ax.set_xlabel("host tier size (GiB)")
            if log:
                ax.set_yscale("log")
            elif metric == "token_hit_rate":
                ax.set_ylim(0, rate_top(ends))
            ax.grid(True, alpha=0.3, which="both")
        axes[0][0].set_ylabel(ylabel + (" (log)" if log else ""))
        axes[0][-1].legend(fontsize=8, loc="best")
        written.append(_save(plt, fig, Path(out_dir) / filename, title, dpi=110))
    return written
