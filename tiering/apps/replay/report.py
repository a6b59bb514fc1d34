"""What a replay prints: a compact table, and the warnings that say when a comparison means
little.

- ``format_table``: one line per run, at most ``TABLE_WIDTH`` columns wide (a long run name
  is shortened in the middle); the 95% intervals, the hit rate of each tier, the move
  counts and every other figure are in ``summary.json`` (and ``sweep.csv``).
- ``policy_decisions``: the moves a run's request policy chose (offloads to host and disk,
  demotions host -> disk). A tiering run with none never consulted its policy: its
  figures are those of any other policy, and ``warnings`` says so.
- ``saturation``: whether the simulated worker kept up with the arrivals. When it does
  not, queueing grows for as long as requests keep coming and the latency figures measure
  the length of the trace, not the policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

TABLE_WIDTH = 100
# saturated: the TTFT of the last quarter of the arrivals is this many times the first's
GROWTH = 4.0
# ... and at least this long (a worker that answers in 0.1 s then 0.5 s is not drowning)
MIN_LATE_TTFT_S = 10.0
MIN_REQUESTS = 20  # fewer finished requests say nothing about a trend


class Saturation(NamedTuple):
    """``saturated``: queueing grew through the run. ``early_s`` / ``late_s``: median TTFT
    of the first and last quarter of the finished requests, by arrival."""

    saturated: bool
    early_s: float
    late_s: float


def saturation(requests: Sequence[Any]) -> Saturation:
    """From a run's request records (``arrival_s``, ``first_token_s``, ``status``)."""
    ttft = sorted((r.arrival_s, r.first_token_s - r.arrival_s) for r in requests
                  if r.status == "finished" and r.first_token_s is not None)
    if len(ttft) < MIN_REQUESTS:
        return Saturation(False, math.nan, math.nan)
    quarter = len(ttft) // 4
    early = _median([w for _, w in ttft[:quarter]])
    late = _median([w for _, w in ttft[-quarter:]])
    grew = late >= MIN_LATE_TTFT_S and late > GROWTH * max(early, 1e-9)
    return Saturation(grew, early, late)


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def policy_decisions(row: Mapping[str, Any]) -> int:
    """Moves the run's request policy chose: offloads to host and disk, demotions."""
    return int(sum(float(row.get(k) or 0) for k in
                   ("offloads_to_host", "offloads_to_disk", "demotions")))


def warnings(keys: Sequence[str], rows: Sequence[Mapping[str, Any]],
             saturated: Mapping[str, Saturation]) -> list[str]:
    """One line per caveat, naming the runs it applies to: rejected requests, a policy
    never consulted, a worker that could not keep up."""
    rejected, idle, drowned = [], [], []
    for key, r in zip(keys, rows, strict=True):
        if r.get("rejected"):
            rejected.append(f"{key} {r['rejected']:.0f} of {r['requests']:.0f}")
        if r.get("mode") == "tiering" and policy_decisions(r) == 0:
            idle.append(key)
        sat = saturated.get(key)
        if sat is not None and sat.saturated:
            drowned.append(f"{key} ({sat.early_s:.3g} s -> {sat.late_s:.3g} s)")
    out = []
    if rejected:
        out.append("requests rejected (their KV could never fit on the device; latency and "
                   "hit figures cover the others only): " + ", ".join(rejected))
    if idle:
        out.append("the policy made no decision (nothing was offloaded or demoted), so these "
                   "runs say nothing about it: " + ", ".join(idle) + "; give the worker less "
                   "room (--device-gib) or more load (--time-scale below 1)")
    if drowned:
        out.append("the simulated worker is saturated: its queue grows for as long as "
                   "requests arrive (median time to first token, first quarter of the "
                   "arrivals -> last), so latency figures measure the trace's length, not "
                   "the policy: " + ", ".join(drowned) + "; slow the arrivals (--time-scale "
                   "above 1) or give it a faster --hardware")
    return out


COLUMNS = ("run", "done", "rej", "tok/s", "ttft p50", "ttft p99", "tpot p50", "decisions",
           "tok hit %", "block hit %")


def _num(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return fmt.format(v)


def _seconds(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:,.0f}"


def _pct(v: Any) -> str:
    return _num(None if v is None else 100 * float(v), "{:.1f}")


def _shorten(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    keep = width - 1
    return text[: (keep + 1) // 2] + "…" + text[len(text) - keep // 2:]


def format_table(keys: Sequence[str], rows: Sequence[Mapping[str, Any]],
                 bounds: Sequence[Any] = (), width: int = TABLE_WIDTH) -> str:
    """The main figures, one line per run, then the bounds; no line wider than ``width``.
    With several seeds the figures are means (intervals: summary.json)."""
    lines = []
    for key, r in zip(keys, rows, strict=True):
        mode = r.get("mode")
        lines.append([
            key, _num(r.get("finished"), "{:.0f}"), _num(r.get("rejected"), "{:.0f}"),
            _num(r.get("throughput_tok_s"), "{:,.0f}"), _seconds(r.get("ttft_p50_s")),
            _seconds(r.get("ttft_p99_s")), _seconds(r.get("tpot_p50_s")),
            f"{policy_decisions(r):,}" if mode == "tiering" else "-",
            _pct(r.get("token_hit_rate")), _pct(r.get("block_hit_rate")),
        ])
    for b in bounds:
        cap = "inf" if math.isinf(b.capacity_blocks) else f"{b.capacity_blocks:,.0f}"
        # a trace without block ids has no bound to show (not a bound of 0)
        tok, blk = (_pct(b.token_hit_rate), _pct(b.block_hit_rate)) if b.blocks else ("-", "-")
        lines.append([f"bound: {b.name} ({cap} blk)", "", "", "", "", "", "", "", tok, blk])
    widths = [max(len(x) for x in col) for col in zip(COLUMNS, *lines, strict=True)]
    rest = sum(widths[1:]) + len(widths) - 2 + 2
    widths[0] = max(len(COLUMNS[0]), min(widths[0], width - rest))

    def fmt(cells: Sequence[str]) -> str:
        name = cells[0]
        if name.startswith("bound: ") and len(name) > widths[0]:  # keep the bound's name
            name = name[: widths[0] - 1] + "…"
        first = _shorten(name, widths[0]).ljust(widths[0])
        return first + "  " + " ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:],
                                                                   strict=True))

    out = [fmt(COLUMNS), fmt(["-" * w for w in widths])]
    out += [fmt(line) for line in lines]
    seeds = max((int(r.get("seeds") or 1) for r in rows), default=1)
    if seeds > 1:
        out.append(f"means of {seeds} seeds; their 95% intervals (±) are in summary.json")
    return "\n".join(out)
