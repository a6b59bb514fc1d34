"""The figures of one run, computed from what the simulator recorded.

``summarize(result)`` returns a flat dict of numbers (plus ``label`` and
``mode``), the shape written to ``summary.json`` and ``sweep.csv``:

- requests: ``requests``, ``finished``, ``rejected``;
- time: ``duration_s`` (first arrival to last finish), ``throughput_tok_s``
  (prompt and output tokens of finished requests per second of
  ``duration_s``), ``output_tok_s``;
- latency: ``ttft_p50_s``, ``ttft_p99_s`` (arrival to first token),
  ``tpot_p50_s``, ``tpot_p99_s`` (per request: (finish - first token) /
  (output tokens - 1), for requests with at least two output tokens);
- scheduling: ``preemptions``, ``stalls``, ``recomputed_tokens``,
  ``forced_recomputes``;
- cached prefix blocks: ``block_moves_host``, ``block_moves_disk`` (moved a
  tier down), ``block_loads`` (moved up for a request reusing them),
  ``block_drops``, ``block_refused`` (not admitted by the device block policy);
- moves: ``offloads_to_host``, ``offloads_to_disk``, ``demotions``,
  ``reloads_from_host``, ``reloads_from_disk``, ``bytes_<link>`` for each link;
  ``reload_stall_s`` (preempted requests: asking for a reload to rejoining the
  batch, summed), ``prefix_load_stall_s`` (admitted requests waiting for a
  reused prefix to be copied in, summed), ``max_reload_queue_wait_s`` (the
  longest a reload waited in the controller's queue for room);
- prefix reuse: ``prefix_lookups``, ``hit_rate_device``, ``hit_rate_host``,
  ``hit_rate_disk`` (lookups served at least one block by that tier; a prefix
  may come from several), ``miss_rate`` (fractions of lookups), ``reused_tokens``,
  ``token_hit_rate`` (reused over prompt tokens of the requests looked up),
  ``block_hit_rate`` (reused over full prompt blocks looked up), and per tier
  ``token_hit_rate_<tier>`` and ``block_hit_rate_<tier>`` (they add up to the
  totals);
- peaks and sizes: ``max_device_bytes``, ``max_host_bytes``, ``max_disk_bytes``
  (modeled backend only) and ``device_bytes``, ``host_bytes``, ``disk_bytes``.

Percentiles interpolate linearly between the two nearest ranks (numpy's
default), so they can be checked by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tiering.apps.replay.model_kv import LINKS
from tiering.apps.replay.simulator import RunResult


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation; NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q!r}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _rate(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def summarize(result: RunResult) -> dict[str, float | int | str]:
    """The figures of ``result`` (see the module docstring)."""
    recs = result.requests
    done = [r for r in recs if r.status == "finished"]
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    tpot = [
        (r.finish_s - r.first_token_s) / (r.output_tokens - 1)
        for r in done
        if r.output_tokens >= 2 and r.first_token_s is not None
    ]
    start = min(r.arrival_s for r in recs)
    end = max((r.finish_s for r in done), default=start)
    duration = end - start
    tokens_in = sum(r.input_tokens for r in done)
    tokens_out = sum(r.output_tokens for r in done)
    c = result.counters
    kv = result.kv_stats
    page_bytes = result.capacities["page_bytes"]
    lookups = c.prefix_lookups
    out: dict[str, float | int | str] = {
        "label": result.spec.label,
        "mode": result.spec.mode,
        "requests": len(recs),
        "finished": len(done),
        "rejected": sum(1 for r in recs if r.status == "rejected"),
        "duration_s": duration,
        "throughput_tok_s": _rate(tokens_in + tokens_out, duration),
        "output_tok_s": _rate(tokens_out, duration),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "preemptions": c.preemptions,
        "stalls": c.stalls,
        "recomputed_tokens": c.recomputed_tokens,
        "forced_recomputes": c.forced_recomputes,
        "offloads_to_host": kv.get("offloads_to_host", 0),
        "offloads_to_disk": kv.get("offloads_to_disk", 0),
        "demotions": kv.get("demotions", 0),
        "reloads_from_host": kv.get("reloads_from_host", 0),
        "reloads_from_disk": kv.get("reloads_from_disk", 0),
        "reload_stall_s": c.reload_wait_s,
        "prefix_load_stall_s": c.prefix_load_wait_s,
        "max_reload_queue_wait_s": result.controller_stats.get("max_wait_s", 0.0),
        "prefix_lookups": lookups,
        "hit_rate_device": _rate(c.hits_device, lookups),
        "hit_rate_host": _rate(c.hits_host, lookups),
        "hit_rate_disk": _rate(c.hits_disk, lookups),
        "miss_rate": _rate(lookups - c.prefix_hits, lookups),
        "reused_tokens": c.reused_tokens,
        "token_hit_rate": _rate(c.reused_tokens, c.lookup_tokens),
        "lookup_blocks": c.lookup_blocks,
        "block_hit_rate": _rate(c.reused_blocks_device + c.reused_blocks_host
                                + c.reused_blocks_disk, c.lookup_blocks),
        "block_moves_host": c.block_moves_host,
        "block_moves_disk": c.block_moves_disk,
        "block_loads": c.block_loads,
        "block_drops": c.block_drops,
        "block_refused": c.block_refused,
        "max_device_bytes": kv.get("max_device_pages", 0) * page_bytes,
        "max_host_bytes": kv.get("max_host_pages", 0) * page_bytes,
        "max_disk_bytes": kv.get("max_disk_pages", 0) * page_bytes,
    }
    for tier in ("device", "host", "disk"):
        out[f"token_hit_rate_{tier}"] = _rate(getattr(c, f"reused_tokens_{tier}"),
                                              c.lookup_tokens)
        out[f"block_hit_rate_{tier}"] = _rate(getattr(c, f"reused_blocks_{tier}"),
                                              c.lookup_blocks)
    for tier in ("device", "host", "disk"):
        out[f"{tier}_bytes"] = result.capacities[f"{tier}_bytes"]
    for link in LINKS:
        out[f"bytes_{link}"] = kv.get(f"bytes_{link}", 0)
    return out
