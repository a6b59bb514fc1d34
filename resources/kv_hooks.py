"""The engine's admission and eviction hooks of ``PagedKVCache``.

``KVEvictionHooks`` answers what the controller asks before it moves anything
(is a request a candidate, what would it free, where would it go, may it come
back), reports the bytes each tier holds and each request's state, and admits
a step only when its KV is on the device. The answers read
the records; the one that starts a move is ``offload``/``reload`` in
``tiering.resources.kv_transfers``.
"""

from __future__ import annotations

import numpy as np
from tiering.resources.base import AdmitOutcome, ResourceReqConfig, ResourceStep, StepContext
from tiering.resources.engine_types import retention_offload_priority

from tiering.core.lifecycle import LifecycleAnswers
from tiering.errors import UnknownRequest
from tiering.types import OFFLOADED_STATES, RequestState, Tier

NO_OVERRIDES = ResourceReqConfig()

S = RequestState


class KVEvictionHooks(LifecycleAnswers):
    """What the cache answers: sizes, states, admission and the eviction
    questions (a part of ``PagedKVCache``)."""

    @property
    def device_capacity_bytes(self) -> int:
        return self.device_pool.capacity_bytes

    @property
    def host_capacity_bytes(self) -> int:
        return self.host_pool.capacity_bytes

    def device_used_bytes(self) -> int:
        """Device bytes held, not counting cached prefix blocks no request maps
        (the cache frees those itself when it needs the room)."""
        self._open("device_used_bytes")
        return self._held_bytes(Tier.DEVICE, self.device_pool)

    def host_used_bytes(self) -> int:
        """Host bytes held, not counting cached prefix blocks no request maps."""
        self._open("host_used_bytes")
        return self._held_bytes(Tier.HOST, self.host_pool)

    def _held_bytes(self, tier: Tier, pool) -> int:
        """``pool``'s used bytes less the prefix blocks on ``tier`` that no request maps."""
        used = pool.used_bytes
        if self._prefix is not None:
            used -= self._prefix.unmapped(tier) * self.geometry.page_bytes
        return used

    def disk_used_bytes(self) -> int:
        """Bytes the disk tier's ledger holds (0 without a disk tier)."""
        self._open("disk_used_bytes")
        return 0 if self.disk is None else self.disk.used_bytes()

    # -- step lifecycle (the engine's admit) -------------------------------------

    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        """OK only when the request's KV is resident and its reload has landed.

        A request whose offload is still queued (its copy not started) is
        wanted again: the offload is cancelled and the step admitted."""
        r = self._req(step.rid, "admit")
        if r.state is S.RELOADING:
            self._finish_now(r)
        if r.state is S.OFFLOADING:
            self._cancel_offload(r)
        if r.state is S.RESIDENT:
            self._streams.wait_on_compute(r.ready_event)
            r.ready_event = None
            if r.head:  # a streamed request: its layer 0 starts copying now
                self._stream.start(r.rid, r.head, 0)
        if self._admitted_early(r):
            if not r.admitted_early:
                r.admitted_early = True
                self.stats.reloads_admitted_early += 1
            return AdmitOutcome(True, "")
        return AdmitOutcome(*self._life.admission(r))

    def _admitted_early(self, r) -> bool:
        """A layer-wise reload whose layer 0 is on the device: its step may run, each
        layer read only once it has landed (``wait_layer``)."""
        p = r.layers
        return (r.state is S.RELOADING and p is not None and p.layerwise and p.ready >= 1
                and p.failed_at is None)

    # -- eviction hooks -------------------------------------------------------------

    @property
    def supports_eviction(self):
        return True

    def reclaimable(self, rid: str) -> int:
        r = self._req(rid, "reclaimable")
        if r.state is not S.RESIDENT or not r.device or r.head:
            return 0
        n = len(r.device)
        return n * self.geometry.page_bytes if self._room_below(n) else 0

    def _room_below(self, n: int) -> bool:
        """Whether an offload of ``n`` pages has somewhere to go now (cached prefix
        blocks no request maps count as room: the cache moves them down first)."""
        free = self.host_pool.free_pages
        if self._prefix is not None:
            free += self._prefix.unmapped(Tier.HOST)
        return free >= n or (
            self.disk is not None
            and self.offload_to_disk_when_host_full
            and self.disk.can_reserve(n)
        )

    def reclaimable_many(self, rids) -> np.ndarray:
        """``reclaimable`` for each of ``rids`` in one call (int64, aligned).

        The same answers, computed in one pass: page counts of the resident
        requests first, then one room check per distinct size."""
        self._open("reclaimable_many")
        reqs = self._reqs
        try:
            pages = [
                len(r.device) if r.state is S.RESIDENT and not r.head else 0
                for r in (reqs[rid] for rid in rids)
            ]
        except KeyError as exc:
            raise UnknownRequest(f"unknown request {exc.args[0]!r}") from None
        out = np.asarray(pages, dtype=np.int64)
        for n in np.unique(out[out > 0]).tolist():
            if not self._room_below(n):
                out[out == n] = 0
        out *= self.geometry.page_bytes
        return out

    def get_offload_priority_many(self, rids) -> np.ndarray:
        """``get_offload_priority`` for each of ``rids`` in one call (float64, aligned)."""
        self._open("get_offload_priority_many")
        return np.fromiter(
            (self.get_offload_priority(r) for r in rids), dtype=np.float64, count=len(rids)
        )

    def get_offload_priority(self, rid: str) -> float:
        """``retention_offload_priority`` of the request's retention: a request
        the serving layer wants kept is a poor victim; an expired retention
        falls back to the default."""
        r = self._req(rid, "get_offload_priority")
        o = r.overrides or NO_OVERRIDES
        return retention_offload_priority(
            o.retention_priority, o.retention_expiry_s, self._clock() - r.ingested_at
        )

    def reload_bytes(self, rid: str) -> int:
        r = self._req(rid, "reload_bytes")
        if r.state not in OFFLOADED_STATES:
            return 0
        if r.prefix_load is not None:
            return len(r.prefix_load.positions) * self.geometry.page_bytes
        return self._pages_for(r) * self.geometry.page_bytes
