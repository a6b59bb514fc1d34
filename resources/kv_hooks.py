"""The engine's admission and eviction hooks of ``PagedKVCache``.

``EvictionHooks`` answers what the controller asks before it moves anything
(is a request a candidate, what would it free, where would it go, may it come
back), reports the bytes each tier holds, and admits a step only when its KV is
on the device. It reads the records and starts no move (``offload``/``reload``
are ``tiering.resources.kv_transfers``); a step admitted applies a finished
reload and takes back an offload not yet started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from tiering.resources.base import AdmitOutcome, ResourceReqConfig, ResourceStep, StepContext
from tiering.resources.engine_types import retention_offload_priority, step_rid
from tiering.resources.kv_options import KVContext
from tiering.resources.kv_records import admitted_early, own_pages

from tiering.core.validate import check_rids
from tiering.errors import UnknownRequest
from tiering.types import OFFLOADED_STATES, RequestState, Tier

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.kv_prefix_api import PrefixReuse
    from tiering.resources.kv_transfers import Transfers

NO_OVERRIDES = ResourceReqConfig()

S = RequestState


class EvictionHooks:
    """What the cache answers: sizes, admission and the eviction questions."""

    def __init__(self, ctx: KVContext, reuse: PrefixReuse, transfers: Transfers) -> None:
        self._life, self._stats, self._s, self._stream, o = ctx
        self._g, self._streams, self._clock = self._s.geometry, self._s.streams, o.clock
        self._to_disk = o.offload_to_disk_when_host_full
        self._reuse, self._transfers = reuse, transfers

    def device_used_bytes(self) -> int:
        self._life.check_open("device_used_bytes")
        return self._held_bytes(Tier.DEVICE, self._s.device_pool)

    def host_used_bytes(self) -> int:
        self._life.check_open("host_used_bytes")
        return self._held_bytes(Tier.HOST, self._s.host_pool)

    def _held_bytes(self, tier: Tier, pool) -> int:
        """``pool``'s used bytes less the prefix blocks on ``tier`` that no request maps."""
        used = pool.used_bytes
        if self._reuse.blocks is not None:
            used -= self._reuse.blocks.unmapped(tier) * self._g.page_bytes
        return used

    def disk_used_bytes(self) -> int:
        self._life.check_open("disk_used_bytes")
        return 0 if self._s.disk is None else self._s.disk.used_bytes()

    # -- step lifecycle (the engine's admit) -------------------------------------

    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        r = self._life.get(step_rid(step, "admit"), "admit")
        r.undone = None  # a new step
        if r.state is S.RELOADING:
            self._transfers.finish_now(r)
        if r.state is S.OFFLOADING:
            self._transfers.cancel_offload(r)
        if r.state is S.RESIDENT:
            self._streams.wait_on_compute(r.ready_event)
            r.ready_event = None
            if r.head:  # a streamed request: its layer 0 starts copying now
                self._stream.start(r.rid, r.head, 0)
        if admitted_early(r):
            if not r.admitted_early:
                r.admitted_early = True
                self._stats.reloads_admitted_early += 1
            return AdmitOutcome(True, "")
        return AdmitOutcome(*self._life.admission(r))

    # -- eviction hooks -------------------------------------------------------------

    def reclaimable(self, rid: str) -> int:
        r = self._life.get(rid, "reclaimable")
        if r.state is not S.RESIDENT or not r.device or r.head:
            return 0
        n = len(r.device)
        return n * self._g.page_bytes if self._room_below(n) else 0

    def _room_below(self, n: int) -> bool:
        """Whether an offload of ``n`` pages has somewhere to go now (cached prefix
        blocks no request maps count as room: the cache moves them down first)."""
        free = self._s.host_pool.free_pages
        if self._reuse.blocks is not None:
            free += self._reuse.blocks.unmapped(Tier.HOST)
        return free >= n or (
            self._s.disk is not None
            and self._to_disk
            and self._s.disk.can_reserve(n)
        )

    def reclaimable_many(self, rids) -> np.ndarray:
        self._life.check_open("reclaimable_many")
        check_rids("reclaimable_many", rids)
        reqs = self._life.records
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
        out *= self._g.page_bytes
        return out

    def get_offload_priority_many(self, rids) -> np.ndarray:
        self._life.check_open("get_offload_priority_many")
        check_rids("get_offload_priority_many", rids)
        return np.fromiter(
            (self.get_offload_priority(r) for r in rids), dtype=np.float64, count=len(rids)
        )

    def get_offload_priority(self, rid: str) -> float:
        r = self._life.get(rid, "get_offload_priority")
        o = r.overrides or NO_OVERRIDES
        return retention_offload_priority(
            o.retention_priority, o.retention_expiry_s, self._clock() - r.ingested_at
        )

    def reload_bytes(self, rid: str) -> int:
        r = self._life.get(rid, "reload_bytes")
        if r.state not in OFFLOADED_STATES:
            return 0
        if r.prefix_load is not None:
            return len(r.prefix_load.positions) * self._g.page_bytes
        return own_pages(self._g, r) * self._g.page_bytes
