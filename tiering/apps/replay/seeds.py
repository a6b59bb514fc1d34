"""Repeated runs with jittered arrivals, and their means with 95% confidence intervals.

The simulator is deterministic, so one run of a trace has no noise to speak
of. ``jitter(trace, seed)`` gives the same requests with each arrival moved
by an independent uniform offset: earlier by up to half the gap to the
neighbour before it, or later by up to half the gap to the one after it, so
the order of the arrivals is kept (seed 0 is the trace unchanged); the spread of a figure over several seeds
says how much of a difference between two policies the arrival order alone
could explain. ``aggregate(rows_per_seed)`` averages each numeric figure and
adds ``<figure>_ci95``: the half-width of Student's t interval (n - 1 degrees
of freedom) around the mean.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from tiering.apps.replay.traces import TraceRequest

# two-sided 95% critical values of Student's t, by degrees of freedom
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(df: int) -> float:
    """The two-sided 95% critical value of Student's t with ``df`` >= 1 degrees of freedom."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"t95: df must be an int >= 1, got {df!r}")
    return _T95[df - 1] if df <= len(_T95) else 1.960 + 2.4 / df  # close to the table past 30


def jitter(trace: Sequence[TraceRequest], seed: int) -> list[TraceRequest]:
    """``trace`` with jittered arrivals (see the module docstring); seed 0: unchanged."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"jitter: seed must be an int >= 0, got {seed!r}")
    reqs = list(trace)
    if seed == 0 or len(reqs) < 2:
        return reqs
    t = np.array([r.arrival_s for r in reqs], dtype=np.float64)
    order = np.argsort(t, kind="stable")
    ts = t[order]
    gaps = np.diff(ts)
    before = np.concatenate(([gaps[0]], gaps))
    after = np.concatenate((gaps, [gaps[-1]]))
    rng = np.random.default_rng(seed)
    # earlier by up to half the gap before, later by up to half the gap after: the gap of
    # the side it moves towards, so no arrival passes a neighbour (one next to ten idle
    # minutes moves into them, not minutes past the burst on its other side)
    u = rng.uniform(-0.5, 0.5, len(ts))
    moved = ts + u * np.where(u < 0, before, after)
    moved = np.maximum(moved, 0.0)
    out = list(reqs)
    for i, new_t in zip(order.tolist(), moved.tolist(), strict=True):
        out[i] = dataclasses.replace(reqs[i], arrival_s=float(new_t))
    return out


def aggregate(rows_per_seed: Sequence[Sequence[dict]]) -> list[dict]:
    """One row per run: the mean of each numeric figure over the seeds, with
    ``<figure>_ci95`` (0 with a single seed) and ``seeds``. Text fields are the
    first seed's; every seed must hold the same runs in the same order."""
    if not rows_per_seed:
        raise ValueError("aggregate: no runs")
    n = len(rows_per_seed)
    first = rows_per_seed[0]
    for rows in rows_per_seed:
        if [r["label"] for r in rows] != [r["label"] for r in first]:
            raise ValueError("aggregate: the seeds ran different configurations")
    out = []
    for i, base in enumerate(first):
        row: dict = {}
        for key, value in base.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                row[key] = value
                continue
            vals = [float(rows[i][key]) for rows in rows_per_seed]
            finite = [v for v in vals if math.isfinite(v)]
            if not finite:
                row[key] = math.nan
                row[f"{key}_ci95"] = math.nan
                continue
            mean = sum(finite) / len(finite)
            if len(finite) > 1:
                sd = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))
                half = t95(len(finite) - 1) * sd / math.sqrt(len(finite))
            else:
                half = 0.0
            same = all(v == vals[0] for v in vals)
            row[key] = value if same else mean
            row[f"{key}_ci95"] = 0.0 if same else half
        row["seeds"] = n
        out.append(row)
    return out
