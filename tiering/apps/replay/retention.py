"""Every retention decision of a replay, made by the one policy the run was given.

The eviction controller asks its policy which idle requests leave the device
and, in its host cascade (the one the front door runs over the cache), which
on-host requests are demoted to disk when the host is over its high watermark
(``tier=HOST`` rows). The worker's own decision, whom of the batch to pause
(``--preempt policy``), is made here (``Retention``), by the same policy, over
the same kind of ``CandidateBatch``.

Cached prefix blocks are not requests: the block policies keep them
(``block_tiers``).

``reload_cost_s`` of every row is what bringing that candidate back would
cost after the move being decided, from the hardware preset's link
bandwidths and latencies (``presets.reload_seconds``): from host or disk for
an offload (wherever it would land), from disk for a demotion, and the
prefill time of its tokens (``StepCost.prefill_s_per_token``) for a drop or
an expiry, which leave only recomputation. ``CostFilled`` wraps the policy
handed to the controller so that its batches carry the same figures.

A policy is user code: every order it gives goes through ``checked_order``,
so a policy that raises, or returns anything but distinct row indices of the
batch (at least the ``limit`` asked for, every row without one), stops the run
with ``tiering.PolicyFailed`` (a ``ValueError``) naming the policy, the tier of
the candidates and what was wrong (``__cause__``: what the policy raised),
instead of an error from deep inside the controller (or a wrong victim).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tiering.apps.replay.presets import HardwarePreset, StepCost
from tiering.errors import PolicyFailed
from tiering.policies import CandidateBatch, Policy
from tiering.types import Tier


def checked_order(policy: Policy, batch: CandidateBatch, now: float,
                  limit: int | None = None, decision: str = "") -> np.ndarray:
    """``policy.order(batch, now, limit)``, checked (see the module docstring).
    ``decision``: what the order decides, named in the message of a failure."""
    n = len(batch)
    where = (f"policy {policy.name!r} ({type(policy).__module__}.{type(policy).__qualname__}), "
             f"ordering {n} {batch.tier.name.lower() if batch.tier is not None else ''} "
             f"candidate(s){f' ({decision})' if decision else ''} at t={now:g} s")
    try:
        rows = policy.order(batch, now, limit)
    except Exception as err:
        raise PolicyFailed(f"{where}: raised {type(err).__name__}: {err}") from err
    if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype.kind not in "iu":
        shape = f"{type(rows).__name__}" + (
            f" of dtype {rows.dtype} and shape {rows.shape}" if isinstance(rows, np.ndarray)
            else "")
        raise PolicyFailed(f"{where}: order returned {shape}, not a 1-D integer numpy array "
                           "of row indices")
    want = n if limit is None else min(limit, n)
    if len(rows) < want or (limit is None and len(rows) != n):
        raise PolicyFailed(f"{where}: order returned {len(rows)} row(s), expected "
                           f"{'all ' + str(n) if limit is None else f'at least {want}'}")
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise PolicyFailed(f"{where}: order returned row indices outside [0, {n}): "
                           f"{rows.tolist()[:10]}")
    if len(rows) > 1 and len(np.unique(rows)) != len(rows):
        raise PolicyFailed(f"{where}: order returned a row twice: {rows.tolist()[:10]}")
    return rows


class ReloadCosts:
    """Seconds to bring ``nbytes`` back from a tier, per the preset (vectorised)."""

    def __init__(self, hardware: HardwarePreset, cost: StepCost, bytes_per_token: int) -> None:
        hw = hardware
        self._host = (hw.h2d_latency_s, 1.0 / hw.h2d_bps)
        rate = min(hw.disk_read_bps, hw.h2d_bps)
        self._disk = (hw.disk_read_latency_s + hw.h2d_latency_s, 1.0 / rate)
        self._recompute_per_byte = cost.prefill_s_per_token / bytes_per_token

    def from_host(self, nbytes: np.ndarray) -> np.ndarray:
        lat, per_byte = self._host
        return lat + nbytes * per_byte

    def from_disk(self, nbytes: np.ndarray) -> np.ndarray:
        lat, per_byte = self._disk
        return lat + nbytes * per_byte

    def recompute(self, nbytes: np.ndarray) -> np.ndarray:
        return nbytes * self._recompute_per_byte

    def after_offload(self, nbytes: np.ndarray, host_free_bytes: int) -> np.ndarray:
        """The reload of an offload: from the host where it fits in ``host_free_bytes``,
        else from disk (the controller's rule)."""
        as_float = nbytes.astype(np.float64)
        return np.where(nbytes <= host_free_bytes, self.from_host(as_float),
                        self.from_disk(as_float))


_OFFLOAD = "which idle requests leave the device"
_DEMOTE = "which on-host requests go to disk"
_AFTER = ("host", "disk", "offload", "recompute")  # where Retention.order's bytes come back from


class CostFilled(Policy):
    """``inner`` ordering the controller's candidates with ``reload_cost_s`` filled in:
    for device candidates the reload from host when the host has room for the candidate,
    else from disk; for host candidates (the cascade's) the reload from disk.

    Filled only for batches that carry reclaimable bytes (a policy that orders
    without bytes, ``needs_reclaimable`` False, does not read costs either);
    the rows, and so the indices returned, are the batch's own.
    """

    def __init__(self, inner: Policy, costs: ReloadCosts, host_free_bytes: Callable[[], int]):
        self.inner = inner
        self._costs = costs
        self._host_free = host_free_bytes
        self.name = inner.name
        self.calls = 0  # batches whose costs were filled (a test reads it)

    @property
    def needs_priority_from(self) -> str | None:  # type: ignore[override]
        return self.inner.needs_priority_from

    @property
    def needs_reclaimable(self) -> bool:
        return self.inner.needs_reclaimable

    @property
    def reads_reclaimable(self) -> bool:  # type: ignore[override]
        return self.inner.reads_reclaimable

    def order(self, batch: CandidateBatch, now: float, limit: int | None = None) -> np.ndarray:
        sizes = batch.reclaimable
        what = _DEMOTE if batch.tier is Tier.HOST else _OFFLOAD
        if sizes is None or not len(batch):
            return checked_order(self.inner, batch, now, limit, what)
        self.calls += 1
        if batch.tier is Tier.HOST:  # the cascade's: a demoted request comes back from disk
            cost = self._costs.from_disk(sizes.astype(np.float64))
        else:
            cost = self._costs.after_offload(sizes, self._host_free())
        filled = CandidateBatch.of_registered(
            np.array(batch.rids, dtype=object), np.array(batch.resources, dtype=object),
            batch.last_used, reclaimable=sizes, priority=batch.priority, reload_cost_s=cost,
            tier=batch.tier,
        )
        return checked_order(self.inner, filled, now, limit, what)


class Retention:
    """Orders candidates of any tier with the run's policy (see the module docstring).

    ``priority_of(rid)``: the KV cache's offload priority, asked only when the
    policy reads priorities. ``host_free_bytes()``: the host's free bytes, for
    candidates whose bytes would go to the host where they fit, else to disk
    (``after="offload"``). ``order(...)`` returns the rids most evictable first.
    """

    def __init__(self, policy: Policy, costs: ReloadCosts,
                 priority_of: Callable[[str], float],
                 host_free_bytes: Callable[[], int] | None = None) -> None:
        self.policy = policy
        self.costs = costs
        self._priority_of = priority_of
        self._host_free = host_free_bytes
        self.decisions = 0  # orderings made here (a test reads it)

    def order(self, rids: Sequence[str], nbytes: Sequence[int], last_used: Sequence[float],
              tier: Tier, after: str, now: float, decision: str = "") -> list[str]:
        """``rids`` (with their bytes and last use) most evictable first. ``after``: where
        a candidate's bytes would come back from after the move, "host", "disk",
        "offload" (the host where they fit in its free bytes now, else disk) or
        "recompute". ``decision`` names what is decided in the message of a failure."""
        if after not in _AFTER:
            raise ValueError(f"Retention.order: after must be one of {_AFTER}, got {after!r}")
        if after == "offload" and self._host_free is None:
            raise ValueError("Retention.order: after='offload' needs host_free_bytes")
        if not rids:
            return []
        self.decisions += 1
        sizes = np.asarray(nbytes, dtype=np.int64)
        costs = self.costs
        if after == "offload":
            cost = costs.after_offload(sizes, self._host_free())
        else:
            cost = {"host": costs.from_host, "disk": costs.from_disk,
                    "recompute": costs.recompute}[after](sizes.astype(np.float64))
        prio = None
        if self.policy.needs_priority_from is not None:
            prio = np.fromiter(map(self._priority_of, rids), dtype=np.float64, count=len(rids))
        batch = CandidateBatch(list(rids), np.asarray(last_used, dtype=np.float64),
                               reclaimable=sizes, priority=prio, reload_cost_s=cost,
                               resources="kv", tier=tier)
        rows = checked_order(self.policy, batch, now, decision=decision)
        return [rids[i] for i in rows.tolist()]

