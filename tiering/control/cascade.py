"""The host -> disk cascade: demotes host-resident requests when a host tier is full.

``HostCascade`` ranks the requests settled on a resource's host tier through
the configured policy (a ``CandidateBatch`` of tier HOST whose ``reclaimable``
column is the host bytes each would free) and demotes them in that order
until the host is under ``host_low``. A request the worker itself moved (for
example demoted, or began reloading) is not settled on the host and is not a
candidate; one that vanished or changed state under the cascade is skipped
and logged, never an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from tiering.control.admission import InFlightLedger
from tiering.control.config import ControllerConfig
from tiering.control.eviction import skip
from tiering.control.request_table import RequestTable, ResourceHandle
from tiering.control.stats import ControllerStats
from tiering.policies.base import CandidateBatch, Policy
from tiering.types import Tier


class HostCascade:
    """Demotes, per resource with a host tier, the policy's first host requests to disk."""

    def __init__(
        self,
        handles: tuple[ResourceHandle, ...],
        policy: Policy,
        config: ControllerConfig,
        table: RequestTable,
        ledger: InFlightLedger,
        stats: ControllerStats,
        prio_handle: ResourceHandle | None,
    ) -> None:
        self.handles = handles
        self._policy = policy
        self._config = config
        self._table = table
        self._ledger = ledger
        self._stats = stats
        self._prio_handle = prio_handle

    def run(self, waiting: Collection[str], clock: Callable[[], float], demoted: list[str],
            dropped: list[str]) -> None:
        """For each resource over ``host_high``: demote (or drop) until under ``host_low``.

        ``waiting``: requests waiting for a reload, left on host (they are about
        to come back). ``clock`` is read only when something must be demoted.
        """
        high = self._config.host_high
        demoting = self._ledger.demoting
        for h in self.handles:
            used = h.host_used()
            if demoting:
                used -= self._ledger.demoting_bytes(h.name)
            if used > high * h.host_capacity:
                self._demote(h, used, waiting, clock(), demoted, dropped)

    def candidates(self, h: ResourceHandle, waiting: Collection[str], now: float
                   ) -> tuple[CandidateBatch, list[int]]:
        """``h``'s requests settled on its host tier, as a batch, and their host bytes.

        Settled: the resource reports the tier HOST and ``can_reload`` (no
        transfer of it in flight), no demotion of this controller in flight,
        no reload waiting.
        """
        table = self._table
        demoting = self._ledger.demoting
        rids, sizes, slots = [], [], []
        for rid in table.members_of(h.name):
            if rid in waiting or (h.name, rid) in demoting:
                continue
            try:
                if h.tier_of(rid) is not Tier.HOST or not h.can_reload(rid):
                    continue
                nbytes = int(h.reload_bytes(rid))
            except Exception as err:
                skip(self._stats, "tier_of", h.name, rid, err)
                continue
            rids.append(rid)
            sizes.append(nbytes)
            slots.append(table.slot[rid])
        names = np.empty(len(rids), dtype=object)
        names.fill(h.name)
        priority = None
        if h is self._prio_handle and rids:
            priority = np.zeros(len(rids), dtype=np.float64)
            for i, rid in enumerate(rids):
                try:
                    value = h.priority(rid)
                except Exception as err:  # vanished
                    skip(self._stats, "get_offload_priority", h.name, rid, err)
                    continue
                priority[i] = value
            if not np.isfinite(priority).all():
                raise ValueError(f"resource {h.name!r}: get_offload_priority returned a "
                                 "non-finite number for a host request")
        batch = CandidateBatch.of_registered(
            np.array(rids, dtype=object), names,
            table.last_used[np.array(slots, dtype=np.int64)],
            reclaimable=np.array(sizes, dtype=np.int64), priority=priority, tier=Tier.HOST,
        )
        return batch, sizes

    def _demote(self, h: ResourceHandle, used: int, waiting: Collection[str], now: float,
                demoted: list[str], dropped: list[str]) -> None:
        config = self._config
        stats = self._stats
        target = config.host_low * h.host_capacity
        batch, sizes = self.candidates(h, waiting, now)
        if not len(batch):
            return
        for row in self._policy.order(batch, now).tolist():
            if used < target:
                break
            rid, nbytes = batch.rids[row], sizes[row]
            try:
                ok = h.demote(rid)
                tier = h.tier_of(rid) if ok else None
            except Exception as err:  # changed state under the cascade
                skip(stats, "demote", h.name, rid, err)
                continue
            if ok:
                demoted.append(rid)
                used -= nbytes
                stats.demotions += 1
                stats.bytes_demoted += nbytes
                stats.bytes_host_to_disk += nbytes
                if tier is Tier.HOST:  # the write is in flight
                    self._ledger.add_demotion((h.name, rid), nbytes)
                continue
            if config.on_disk_full == "drop":
                try:
                    h.drop(rid)
                except Exception as err:
                    skip(stats, "drop", h.name, rid, err)
                    continue
                dropped.append(rid)
                used -= nbytes
                stats.drops += 1
                stats.bytes_dropped += nbytes
                continue
            stats.disk_full_keeps += 1
            break  # the disk is full; try again next call
