"""vLLM's offloading classes on our core (this is the only module that imports vLLM).

``TieredOffloadingSpec`` is what vLLM's ``OffloadingConnector`` loads through
``spec_name``/``spec_module_path``. Its manager (scheduler process) and worker
(each worker process) share one host slab file per rank, named from vLLM's
engine id; the manager's store and load specs carry the host slots.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering.integrations.vllm._core import (
    Counters,
    GroupLayout,
    HostSlab,
    LayerCopy,
    LoadWindow,
    Lookup,
    TieredBlockManager,
    TieredConfig,
    TieredMover,
    default_host_dir,
    open_disk,
    remove_leftover_slabs,
    slab_path,
)

log = logging.getLogger(__name__)

METRIC_PREFIX = "tiering_kv_"


class TieredLoadStoreSpec(LoadStoreSpec):
    """Host slots (one per offloaded key, in the order of the keys) of our host tier;
    slots past the host tier are rows of the ``staging`` file: a store's blocks going
    straight to disk (see ``StoreDecision``), a load's blocks read (checked) from disk
    (see ``TieredBlockManager.prepare_load``)."""

    def __init__(self, slots: Iterable[int], staging: str | None = None):
        self.slots = np.asarray(list(slots), dtype=np.int64)
        self.staging = staging

    def __repr__(self) -> str:
        return f"TieredLoadStoreSpec({self.slots.tolist()}, staging={self.staging!r})"


class _Geometry:
    """What both sides derive from vLLM's offloading config."""

    def __init__(self, config: OffloadingConfig, cfg: TieredConfig, bpc: int):
        if config.worker_kv_bytes_per_block <= 0:
            raise ValueError("vLLM reported 0 KV bytes per block; nothing to offload")
        self.world = max(1, config.parallel.world_size)
        self.slot_bytes = config.worker_kv_bytes_per_block * bpc
        self.num_slots = cfg.host_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"kv_connector_extra_config.host_bytes {cfg.host_bytes} holds no block "
                f"({self.slot_bytes} bytes per offloaded block and rank)"
            )
        self.host_dir = cfg.host_dir or default_host_dir()
        self.engine_id = config.engine_id

    def slab(self, rank: int) -> HostSlab:
        """The host slab of ``rank``; a caller sweeps ``host_dir`` once first
        (``remove_leftover_slabs``), not once per rank."""
        return HostSlab(slab_path(self.host_dir, self.engine_id, rank), self.num_slots,
                        self.slot_bytes)


class _RequestChain:
    """Per request (kept on its ``ReqContext``): the last key seen of each KV group,
    in the order vLLM looks up and stores them, i.e. the parent of the next one. It is
    also the request's object for the manager (``request=``: told once)."""

    __slots__ = ("__weakref__", "last")

    def __init__(self) -> None:
        self.last: dict[bytes, bytes] = {}

    @staticmethod
    def of(ctx: ReqContext) -> _RequestChain:
        chain = ctx.get_state(_RequestChain)
        if chain is None:
            chain = _RequestChain()
            ctx.set_state(chain)
        return chain

    def parents(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's parent: the key before it of its group (changes nothing)."""
        last = dict(self.last)
        out: list[bytes | None] = []
        for k in keys:
            group = k[-4:]  # an offload key is block hash + 4-byte group index
            out.append(last.get(group))
            last[group] = k
        return out

    def advance(self, keys: list[bytes]) -> None:
        for k in keys:
            self.last[k[-4:]] = k


class TieredOffloadingManager(OffloadingManager):
    def __init__(self, core: TieredBlockManager, enable_events: bool):
        self.core = core
        self.enable_events = enable_events

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        k = bytes(key)
        window = req_context.get_state(LoadWindow)
        if window is None:
            window = LoadWindow()
            req_context.set_state(window)
        r = self.core.lookup(k, window)
        if r is Lookup.MISS:
            return LookupResult.MISS
        # lookups run root first and stop at a miss: a hit is the next one's parent
        _RequestChain.of(req_context).last[k[-4:]] = k
        return LookupResult.HIT if r is Lookup.HIT else LookupResult.HIT_PENDING

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        if self.core.loaded_from_disk(bytes(key)):
            return CacheHitSource.DISK
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        slots = self.core.prepare_load([bytes(k) for k in keys],
                                       request=_RequestChain.of(req_context))
        direct = any(s >= self.core.num_slots for s in slots)
        return TieredLoadStoreSpec(slots, self.core.load_staging if direct else None)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext):
        self.core.touch(bytes(k) for k in keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext):
        self.core.complete_load(bytes(k) for k in keys)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        ks = [bytes(k) for k in keys]
        chain = _RequestChain.of(req_context)
        d = self.core.prepare_store(ks, chain.parents(ks), request=chain)
        if d is None:
            return None
        chain.advance(ks)
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in d.keys_to_store],
            store_spec=TieredLoadStoreSpec(d.slots, d.staging),
            evicted_keys=[OffloadKey(k) for k in d.evicted],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ):
        self.core.complete_store((bytes(k) for k in keys), success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context) -> None:
        self.core.maintain()

    def has_pending_work(self) -> bool:
        return self.core.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self.core.take_events()
        if not self.enable_events:
            return ()
        return [
            OffloadingEvent(
                keys=[OffloadKey(k) for k in ev.keys],
                medium=Medium.CPU if ev.tier == "host" else Medium.STORAGE,
                removed=ev.removed,
                locality=Locality.LOCAL,
            )
            for ev in events
        ]

    def get_stats(self) -> OffloadingConnectorStats | None:
        delta = self.core.stats_delta()
        stats = OffloadingConnectorStats()
        for name, value in delta.items():
            stats.increase_counter(METRIC_PREFIX + name, value)
        stats.set_gauge(METRIC_PREFIX + "host_used_slots", self.core.pool.used_pages)
        return stats

    def reset_cache(self) -> None:
        self.core.reset()

    def shutdown(self) -> None:
        self.core.shutdown()
        for s in self.core.slabs:
            s.close()


class TieredOffloadingWorker(OffloadingWorker):
    def __init__(self, mover: TieredMover):
        self.mover = mover

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, TieredLoadStoreSpec), type(dst_spec)
        return self.mover.submit(job_id, True, src_spec.block_ids, src_spec.group_sizes,
                                 src_spec.block_indices, dst_spec.slots, dst_spec.staging)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, TieredLoadStoreSpec), type(src_spec)
        return self.mover.submit(job_id, False, dst_spec.block_ids, dst_spec.group_sizes,
                                 dst_spec.block_indices, src_spec.slots, src_spec.staging)

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(r.job_id, r.success, r.nbytes, r.seconds)
                for r in self.mover.get_finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.mover.wait(job_ids)

    def shutdown(self) -> None:
        self.mover.shutdown()
        self.mover.slab.close()


class TieredOffloadingSpec(OffloadingSpec):
    """Host (shared slab), optional disk (zarr, crc32c) and optional shared cold tier
    (object store, authenticated) on the project's block index."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {
            METRIC_PREFIX + name: OffloadingCounterMetadata(
                documentation=f"tiering vLLM backend: {name.replace('_', ' ')}"
            )
            for name in Counters.__dataclass_fields__
        }
        defs[METRIC_PREFIX + "host_used_slots"] = OffloadingGaugeMetadata(
            documentation="tiering vLLM backend: host slots in use"
        )
        return defs

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.cfg = TieredConfig.from_extra(self.extra_config)
        self.geometry = _Geometry(config, self.cfg, self.blocks_per_chunk)
        self._manager: TieredOffloadingManager | None = None
        self._worker: TieredOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            g = self.geometry
            slabs: list[HostSlab] = []
            disk = None
            shared = None
            remove_leftover_slabs(g.host_dir)  # of processes that died (nobody holds them)
            try:  # a failure here (a disk tier that cannot open, say) leaves no slab file
                for r in range(g.world):
                    slabs.append(g.slab(r))
                for s in slabs:
                    s.unlink_if_second()
                disk = open_disk(
                    self.cfg,
                    g.slot_bytes * g.world,
                    fingerprint=f"vllm:{self.config.model.name}:{g.slot_bytes}x{g.world}",
                )
                shared = self._open_shared()
                core = TieredBlockManager(self.cfg, slabs, disk, disk_root=self.cfg.disk_path,
                                          shared=shared)
            except BaseException:
                if disk is not None:
                    disk.close()
                for s in slabs:
                    s.close()
                raise
            self._manager = TieredOffloadingManager(
                core, self.kv_events_config.enable_kv_cache_events
            )
            log.info("tiering: %d host slots of %d B per rank (x%d ranks), disk %s, shared %s",
                     g.num_slots, g.slot_bytes, g.world,
                     "off" if disk is None else f"{disk.capacity_pages} blocks",
                     "off" if shared is None else self.cfg.shared_config().url)
        return self._manager

    def _open_shared(self):
        """The shared cold tier (``shared``), opened and probed; None without one. Its
        blocks are named by the model (root) and the page geometry, so only engines of
        the same model and layout see each other's blocks."""
        sc = self.cfg.shared_config()
        if sc is None:
            return None
        from tiering.coldtier import SharedBlockStore, open_s3_store

        g = self.geometry
        root = f"vllm:{self.config.model.name}".encode()
        if len(root) > 512:  # a very long model path: its digest names it
            root = b"vllm:" + hashlib.sha256(root).hexdigest().encode()
        geometry = f"{g.slot_bytes}x{g.world}:{self.config.model.dtype}".encode()
        store = open_s3_store(sc.url, sc.storage_options)  # unreachable: ColdTierUnavailable
        return SharedBlockStore(store, root, geometry, trust=sc.trust,
                                block_bytes=g.slot_bytes * g.world, config=sc.tier)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            g = self.geometry
            groups = []
            device = None
            for refs in kv_caches.group_data_refs:
                copies = []
                seen: set[int] = set()
                off = 0
                for ref in refs:
                    if ref.tensor_idx in seen:
                        continue
                    seen.add(ref.tensor_idx)
                    t = kv_caches.tensors[ref.tensor_idx].tensor
                    device = t.device
                    flat = t.view(torch.uint8) if t.dtype == torch.int8 else t
                    flat = flat.reshape(flat.shape[0], -1)
                    if flat.dtype != torch.uint8:
                        flat = flat.view(torch.uint8)
                    copies.append(LayerCopy(flat, off, int(ref.page_size_bytes)))
                    off += int(ref.page_size_bytes)
                groups.append(GroupLayout(tuple(copies), off))
            rank = self.config.parallel.rank
            remove_leftover_slabs(g.host_dir)  # of processes that died (nobody holds them)
            slab = g.slab(rank)
            try:
                slab.unlink_if_second()
                if device is not None and device.type == "cuda":
                    _pin(slab)
                mover = TieredMover(groups, slab, self.blocks_per_chunk,
                                    threads=self.cfg.copy_threads, device=device,
                                    corrupt_loads=self.cfg.test_corrupt_loads, rank=rank)
            except BaseException:
                slab.close()
                raise
            if self.cfg.test_corrupt_loads:
                log.warning("tiering: test_corrupt_loads is ON: every load is deliberately wrong")
            self._worker = TieredOffloadingWorker(mover)
        return self._worker


def _pin(slab: HostSlab) -> None:
    """Register the shared slab with CUDA so copies to and from it are DMA (best effort)."""
    try:
        t = slab.tensor
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(rc) != 0:
            log.warning("tiering: cudaHostRegister of %s returned %s; copies stay pageable",
                        slab.path, rc)
    except Exception as exc:  # pinning is an optimisation only
        log.warning("tiering: cannot pin %s: %r (pid %d)", slab.path, exc, os.getpid())
