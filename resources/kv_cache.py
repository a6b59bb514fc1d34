"""PagedKVCache: a paged KV cache whose requests move between device, host and disk.

Composition (each part owns its state and is handed its collaborators):
- ``KVStorage`` (``kv_storage``): the pools, the device tensor, the host slab, the
  disk tier, the staging ring, the copy streams and the fault hook;
- the ``Lifecycle`` (``tiering.core.lifecycle``): the per-request records and every
  change of their state (the one machine shared with the replay's model and the
  test fake); ``RequestPages`` (``kv_pages``) grows a record's slots and is the
  lifecycle's release table;
- ``Transfers`` (``kv_transfers``): the executors, queuing moves, applying their
  outcomes, removed requests' copies in flight; ``CopyJobs`` (``kv_moves``) the
  byte copies on worker threads;
- ``DataPlane`` (``kv_data``): page tables, reads, writes, layer waits, streamed reads
  (``StreamBuffer``, ``kv_stream``, owns the stream ring);
- ``PrefixReuse`` (``kv_prefix_api``): the block store (``PrefixCache``, ``kv_prefix``)
  and its calls;
- ``EvictionHooks`` (``kv_hooks``): sizes, admission and the eviction answers;
- ``IntegrityCheck`` (``kv_integrity``): the conservation check.
This class checks its settings (``KVOptions``, ``kv_options``), builds the parts,
delegates its public API to them, and tears them down.
Worker threads only copy bytes and compute checksums; they return results that
``poll`` applies on the caller's thread. So no lock guards the records.

Contract of every move (see ``tiering.types`` for the states):
- destination slots are reserved before a copy starts, and source slots are
  freed only after it has completed;
- a refused move (no room) returns 0/False and changes nothing;
- a move asked of a request in the wrong state raises ``IllegalTransition``
  naming the request and its state, and changes nothing;
- a copy or write that fails leaves the request where it was; a read that
  fails, or bytes whose checksum does not match, mark it LOST with the reason.
  No wrong byte is ever handed back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tiering.policies.blocks import DEFAULT_BLOCK_POLICY
from tiering.resources.base import (
    AdmitOutcome,
    CachedPrefix,
    EngineResourceInfo,
    NodeResourceSpec,
    Resource,
    ResourceReqConfig,
    ResourceStep,
    StepContext,
)
from tiering.resources.kv_data import DataPlane, check_int
from tiering.resources.kv_geometry import KVGeometry
from tiering.resources.kv_hooks import EvictionHooks
from tiering.resources.kv_integrity import IntegrityCheck
from tiering.resources.kv_options import KVContext, KVOptions
from tiering.resources.kv_pages import RequestPages, adopt_reattached
from tiering.resources.kv_prefix import PrefixHit
from tiering.resources.kv_prefix_api import PrefixReuse
from tiering.resources.kv_records import (  # noqa: F401 (the errors are re-exported from their old home)
    CacheClosed,
    KVStats,
    RequestLost,
    RequestRecord,
    Tombstone,
    TransferJob,
    UnknownRequest,
)
from tiering.resources.kv_storage import KVStorage
from tiering.resources.kv_stream import STREAM_BUFFER, StreamBuffer
from tiering.resources.kv_transfers import Transfers

from tiering.control.protocols import CompletionFeed
from tiering.core.lifecycle import Lifecycle, LifecycleAnswers
from tiering.core.pinning import HostRuntime, PinOutcome
from tiering.core.staging import StagingConfig
from tiering.core.transfer import no_fault
from tiering.core.validate import check_timeout
from tiering.types import Tier, TransferResult

log = logging.getLogger("tiering.kv_cache")


class PagedKVCache(LifecycleAnswers, Resource):
    """A paged KV cache implementing the engine's eviction hooks.

    ``device_pages`` pages are allocated once on ``device`` page-first; the
    host tier is one page-aligned slab of ``host_pages`` pages (pinned to
    exactly that size when CUDA is present, see ``tiering.core.pinning``); the
    disk tier is a ``DiskPageStore`` when ``disk`` is given
    (``disk_wrap_store`` wraps its zarr store: the fault-injection seam;
    ``disk_store`` injects a ready-made store, in place of ``disk``, laid out for this
    geometry's pages, which the cache then owns and closes; a refused one stays open). ``offload``, ``demote`` and ``reload`` queue their copies and
    return at once; ``poll`` applies finished ones and ``synchronize`` waits
    for all of them. ``compute_stream`` names the CUDA stream the engine's
    kernels run on (default: the stream current when the cache is built).

    Copies run on three executors: device-to-host (offloads), host-to-device
    (reloads from host) and disk I/O (writes, and disk reloads ahead of
    writes), so a reload never waits behind a running offload.
    """

    prefix_skip_safe = True  # a hit only skips tokens whose K/V the cache already holds

    def __init__(
        self,
        geometry: KVGeometry,
        device: str | torch.device = "cpu",
        device_pages: int = 64,
        host_pages: int = 64,
        *,
        disk=None,
        verify: bool = False,
        offload_to_disk_when_host_full: bool = True,
        copy_workers: int = 2,
        io_workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
        copy_fault_hook: Callable[[str], None] = no_fault,
        disk_store=None,
        disk_wrap_store: Callable[[Any], Any] | None = None,
        compute_stream=None,
        host_runtime: HostRuntime | None = None,
        staging: StagingConfig | None = None,
        stage_disk_io: bool | None = None,
        layerwise_reload: bool = False,
        layer_wait_timeout_s: float = 60.0,
        stream_window_pages: int = 0,
        stream_buffer_pages: int = 0,
    ) -> None:
        if not isinstance(geometry, KVGeometry):
            raise TypeError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        o = KVOptions(device_pages, host_pages, verify, offload_to_disk_when_host_full,
                      copy_workers, io_workers, clock, copy_fault_hook, disk_wrap_store, staging,
                      stage_disk_io, layerwise_reload, layer_wait_timeout_s,
                      stream_window_pages, stream_buffer_pages)
        self.geometry = geometry
        self.verify = verify  # the settings, read-only once built
        self.layerwise_reload = layerwise_reload
        self.layer_wait_timeout_s = o.layer_wait_timeout_s
        self.offload_to_disk_when_host_full = offload_to_disk_when_host_full
        self.stream_window_pages = stream_window_pages
        self.stats = KVStats()
        self._clock = clock
        # the lifecycle calls its release table through the parts built below
        self._life = Lifecycle(
            "PagedKVCache", self.stats, clock,
            {Tier.DEVICE: lambda r: self._pages.release_device(r),
             Tier.HOST: lambda r: self._pages.release_host(r),
             Tier.DISK: lambda r: self._pages.release_disk(r)},
            release_all=lambda r: self._pages.release_all(r), on_lost=RequestPages.on_lost,
        )
        self._storage: KVStorage | None = None
        self._stream: StreamBuffer | None = None
        self._reuse: PrefixReuse | None = None
        self._transfers: Transfers | None = None
        try:
            self._storage = st = KVStorage(
                geometry, device, device_pages, host_pages, stats=self.stats, verify=verify,
                fault=copy_fault_hook, disk=disk, disk_store=disk_store,
                disk_wrap_store=disk_wrap_store, compute_stream=compute_stream,
                host_runtime=host_runtime, staging=staging, stage_disk_io=stage_disk_io)
            if stream_buffer_pages:  # the ring's pages are set aside once (admission counts them)
                ring = st.device_pool.allocate(STREAM_BUFFER, stream_buffer_pages)
                assert ring == list(range(stream_buffer_pages)), ring
                self._stream = StreamBuffer(st.dev[:stream_buffer_pages], geometry.num_layers,
                                            st.host, st.streams, lambda kind: st.fault(kind),
                                            join_timeout_s=o.layer_wait_timeout_s)
            ctx = KVContext(self._life, self.stats, st, self._stream, o)
            self._reuse = PrefixReuse(ctx, f"PagedKVCache at 0x{id(self):x}")
            self._pages = RequestPages(ctx, self._reuse)
            self._transfers = Transfers(ctx, self._reuse, self._pages)
            self._data = DataPlane(ctx, self._transfers)
            self._hooks = EvictionHooks(ctx, self._reuse, self._transfers)
            self._check = IntegrityCheck(ctx, self._reuse, self._transfers)
            if st.disk is not None:  # what an earlier process left intact on disk
                adopt_reattached(st.disk, self._life.records, clock)
        except BaseException:
            self._teardown(timeout=10.0, failed_start=True)
            raise

    # -- the parts' state, by the names it had on the cache ----------------------------

    device = property(lambda self: self._storage.device)
    device_pool = property(lambda self: self._storage.device_pool)
    host_pool = property(lambda self: self._storage.host_pool)
    disk = property(lambda self: self._storage.disk)
    _prefix = property(lambda self: self._reuse.blocks)
    _reqs = property(lambda self: self._life.records)
    _host = property(lambda self: self._storage.host)
    _ring = property(lambda self: self._storage.ring)

    # the copy fault hook, read when each copy runs; the lifecycle's closed flag
    _fault = property(lambda self: self._storage.fault,
                      lambda self, hook: setattr(self._storage, "fault", hook))
    _closed = property(lambda self: self._life.closed,
                       lambda self, value: setattr(self._life, "closed", value))

    @property
    def host_pinning(self) -> PinOutcome:
        """How the host slab is pinned (exact / torch-rounded / not pinned)."""
        return self._storage.slab.outcome

    @classmethod
    def build(cls, spec: NodeResourceSpec, info: EngineResourceInfo) -> PagedKVCache:
        cfg = dict(spec.config)
        if "geometry" not in cfg:
            raise ValueError(f"PagedKVCache.build: the node's config needs 'geometry' (a "
                             f"KVGeometry); it has {sorted(map(str, cfg))}")
        geometry = cfg.pop("geometry")
        if not isinstance(geometry, KVGeometry):
            raise TypeError(f"PagedKVCache.build: config 'geometry' must be a KVGeometry, "
                            f"got {type(geometry).__name__}")
        stream = info.compute_stream
        if stream is not None:
            cfg.setdefault("compute_stream", stream)
        return cls(geometry, device=info.device, **cfg)

    # -- request lifecycle ----------------------------------------------------------

    def ingest_request(self, rid: str, overrides: ResourceReqConfig | None = None):
        """Register ``rid`` (idempotent). Ingesting it again with different
        overrides is an error: the first settings are the ones in force."""
        self._life.check_open("ingest_request")
        now = self._clock()
        self._life.register(rid, overrides, lambda: RequestRecord(rid, overrides, now),
                            ResourceReqConfig)

    def allocate(self, rid: str, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in total (growing, never
        shrinking). False, with nothing changed, when the device pool is short."""
        r = self._req(rid, "allocate")
        check_int(f"allocate({rid!r})", "num_tokens", num_tokens)
        return self._pages.allocate(r, num_tokens)

    def remove_request(self, rid: str):
        """Forget ``rid`` and give back every slot. A copy in flight is
        cancelled if it has not started, else its slots come back when it
        ends (under a fresh key: the id may be ingested again at once, and
        then behaves exactly like a new one)."""
        self._transfers.remove(self._req(rid, "remove_request"))

    # -- moves (kv_transfers) ----------------------------------------------------------

    def offload(self, rid: str) -> int:
        """Start moving a resident request to host (or straight to disk when the
        host is full and that is allowed). Returns the device bytes it will
        free; 0 (nothing changed) when no tier below has room, or when the
        request holds no pages (nothing to move)."""
        return self._transfers.offload(rid)

    def demote(self, rid: str) -> bool:
        """Start moving an on-host request to disk. False (nothing changed)
        when there is no disk tier or it cannot take the request."""
        return self._transfers.demote(rid)

    def reload(self, rid: str) -> bool:
        """Start bringing an offloaded request back. False (nothing changed)
        when the device pool cannot hold it yet.

        The copy waits on a compute-stream marker recorded now: the slots it
        writes may just have been freed by ``remove_request`` while kernels
        queued for their previous owner still use them."""
        return self._transfers.reload(rid)

    def poll(self) -> list[TransferResult]:
        """Apply every finished transfer; returns what each did, in the order
        applied (a removed request's finished copy has ``state=None``).
        Never raises for a fault in a transfer or its completion."""
        return self._transfers.poll()

    def completion_feed(self) -> CompletionFeed:
        """A feed that receives every record ``poll`` (or ``synchronize``) reports
        from now on, whoever calls them; the controller settles from one."""
        return self._transfers.completion_feed()

    def synchronize(self, timeout: float = 60.0) -> list[TransferResult]:
        """Wait for every transfer in flight, then apply them all; returns what
        was applied (as ``poll``). Raises TimeoutError naming what is still in
        flight after ``timeout`` seconds (after applying what did finish): copies, and
        the shared tier's fetches and publishes."""
        pending, shared_idle, timeout = self._transfers.wait_all(timeout)
        done = self.poll()  # through the cache: a subclass's poll sees these too
        if pending or not shared_idle:
            what = [f"{len(pending)} transfer(s) {sorted(self._life.inflight)[:10]}"] \
                if pending else []
            if not shared_idle:
                what.append("the shared tier's fetches or publishes")
            raise TimeoutError(
                f"synchronize: {' and '.join(what)} still in flight after {timeout}s")
        return done

    def in_flight(self) -> int:
        return self._transfers.in_flight()

    # -- sizes, admission, eviction answers (kv_hooks) --------------------------------

    @property
    def device_capacity_bytes(self) -> int:
        return self._storage.device_pool.capacity_bytes

    @property
    def host_capacity_bytes(self) -> int:
        return self._storage.host_pool.capacity_bytes

    @property
    def supports_eviction(self):
        return True

    def device_used_bytes(self) -> int:
        """Device bytes held, not counting cached prefix blocks no request maps
        (the cache frees those itself when it needs the room)."""
        return self._hooks.device_used_bytes()

    def host_used_bytes(self) -> int:
        """Host bytes held, not counting cached prefix blocks no request maps."""
        return self._hooks.host_used_bytes()

    def disk_used_bytes(self) -> int:
        """Bytes the disk tier's ledger holds (0 without a disk tier)."""
        return self._hooks.disk_used_bytes()

    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        """OK only when the request's KV is resident and its reload has landed.

        A request whose offload is still queued (its copy not started) is
        wanted again: the offload is cancelled and the step admitted."""
        return self._hooks.admit(step, ctx)

    def reclaimable(self, rid: str) -> int:
        return self._hooks.reclaimable(rid)

    def reclaimable_many(self, rids) -> np.ndarray:
        """``reclaimable`` for each of ``rids`` in one call (int64, aligned).

        The same answers, computed in one pass: page counts of the resident
        requests first, then one room check per distinct size."""
        return self._hooks.reclaimable_many(rids)

    def get_offload_priority_many(self, rids) -> np.ndarray:
        """``get_offload_priority`` for each of ``rids`` in one call (float64, aligned)."""
        return self._hooks.get_offload_priority_many(rids)

    def get_offload_priority(self, rid: str) -> float:
        """``retention_offload_priority`` of the request's retention: a request
        the serving layer wants kept is a poor victim; an expired retention
        falls back to the default."""
        return self._hooks.get_offload_priority(rid)

    def reload_bytes(self, rid: str) -> int:
        return self._hooks.reload_bytes(rid)

    # -- page tables, reads, writes (kv_data) ------------------------------------------

    def page_table(self, rid: str) -> list[int]:
        """Device slots of the request, in token order. Only while it is resident (or
        admitted from layer 0 of a layer-wise reload: ``wait_layer`` before each layer)."""
        return self._data.page_table(rid)

    def device_page_table(self, rid: str) -> torch.Tensor:
        """The request's device slots as a long tensor on the device (kept per
        request, rebuilt only when its slots change; no host sync to use it). It is the
        cache's own tensor: read it, never write into it (``clone()`` one to change;
        ``check_integrity`` names a table written into). During a layer-wise reload
        admitted from layer 0, read layer L only after ``wait_layer``."""
        return self._data.device_page_table(rid)

    def is_streamed(self, rid: str) -> bool:
        """Whether ``rid`` is longer than the device: its last ``stream_window_pages`` pages
        on the device, the rest read from the host layer by layer (``read``)."""
        return self._data.is_streamed(rid)

    def wait_layer(self, rid: str, layer: int, timeout: float | None = None) -> bool:
        """Whether layer ``layer`` of ``rid`` may be read and written now. A resident
        request: True at once. During a layer-wise reload: True once that layer has
        landed (a CPU waits for its copy, at most ``timeout`` seconds, default the
        cache's ``layer_wait_timeout_s``; a GPU makes the compute stream wait on its
        copy's event and returns at once); during a whole-request reload, once every
        layer has. False when it will not land (its copy failed: the request goes back
        to where it was, ``poll`` reports why), when the time ran out, or when the
        request is not on the device or on its way there."""
        return self._data.wait_layer(rid, layer, timeout)

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer over all device pages, ``[pages, tokens, heads, dim]``
        views (no copy) for attention kernels that take a page table."""
        return self._data.layer_view(layer)

    def write(self, rid: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V ``[tokens, heads, dim]`` of one layer at token ``start``.

        ``k`` and ``v`` must already have the cache's dtype and device (nothing
        is converted)."""
        return self._data.write(rid, layer, start, k, v)

    def mark_written(self, rid: str, num_tokens: int) -> None:
        """Say that the first ``num_tokens`` tokens of ``rid`` hold K and V in every layer,
        written in place (through ``layer_view`` and ``device_page_table``) rather than by
        ``write``: ``publish_prefix`` keys only tokens written one way or the other."""
        return self._data.mark_written(rid, num_tokens)

    def read(self, rid: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_tokens, heads, dim]`` of one layer (copies), gathered
        through the request's device page table (no host sync)."""
        return self._data.read(rid, layer)

    # -- prefix reuse (kv_prefix_api) ---------------------------------------------------

    def enable_prefix_cache(self, root, walks=None, *, policy: str = DEFAULT_BLOCK_POLICY,
                            disk_batch_pages: int = 16, shared=None,
                            shared_refresh_s: float = 10.0) -> bool:
        """Open the block store under ``root`` (any non-empty bytes, such as a digest or a model
        tag, or a ``tiering.blocks.KeyRoot``); the keys chain from a digest of it and the geometry.

        ``policy`` names the block retention policy of every tier
        (``tiering.policies.blocks.make_block_policy``); ``disk_batch_pages`` is how many
        blocks one host -> disk write packs. ``shared`` (a
        ``tiering.coldtier.SharedTierConfig``, ``SharedBlockStore`` or ``BlockQueue``)
        adds the shared cold tier: published blocks are written there, and an
        attach that misses locally fetches blocks other workers published
        (``docs/coldtier.md``); its index of what exists is refreshed every
        ``shared_refresh_s`` seconds of the cache's clock, from ``poll``. Enabling
        twice with another root, or with a shared tier the first call did not
        have, is an error; with the same root it does nothing. ``walks`` is
        accepted for the engine contract and not used (every walk's writes are keyed)."""
        return self._reuse.enable_prefix_cache(root, walks, policy=policy, disk_batch_pages=disk_batch_pages, shared=shared, shared_refresh_s=shared_refresh_s)

    @property
    def prefix_enabled(self) -> bool:
        return self._reuse.prefix_enabled

    def publish_prefix(self, rid: str, token_ids) -> int:
        """Key the request's full pages of ``token_ids`` (its first tokens); idempotent.

        Published pages become cached blocks the request maps; they are
        immutable (``write`` into them raises). A page whose key is already
        cached on the device is replaced by that block (the request's copy is
        freed); publishing stops at a key cached on another tier. Returns the
        tokens the request now maps as blocks."""
        return self._reuse.publish_prefix(rid, token_ids)

    def cached_prefix(self, token_ids) -> PrefixHit:
        """How many leading tokens of ``token_ids`` are cached, and per tier. Changes nothing."""
        return self._reuse.cached_prefix(token_ids)

    def attach_prefix(self, rid: str, token_ids) -> int:
        """Give a freshly ingested request the longest cached prefix of ``token_ids``.

        Device blocks are mapped by reference. Host and disk blocks, and
        blocks fetched from the shared cold tier (``reload`` refuses until
        they have arrived), are loaded into fresh device pages: the request
        is then offloaded for those pages
        (``is_offloaded`` True, ``admit`` not ready) until ``reload`` (the
        controller's admission) brings them in. The last token is never
        attached (its logits are needed). Returns the tokens attached; when a
        load finds a block corrupt or unreadable, the request keeps only the
        blocks before it, and ``num_tokens(rid)`` (read after ``admit`` says
        ready) is the number of valid tokens the caller continues from."""
        return self._reuse.attach_prefix(rid, token_ids)

    def prefix_stats(self) -> dict[str, int]:
        """Counters of the block store: hit tokens per tier, blocks moved, dropped, ..."""
        return self._reuse.prefix_stats()

    @property
    def keys_prefix_chains(self) -> bool:
        return self._reuse.keys_prefix_chains

    def fingerprint(self) -> bytes | None:
        """The geometry (layout and dtype of a page): what a stored page depends on here."""
        return self._reuse.fingerprint()

    def resolve_cached_prefix(self, rid, node_name, graph_walk, inputs) -> CachedPrefix | None:
        return self._reuse.resolve_cached_prefix(rid, node_name, graph_walk, inputs)

    def apply_cached_prefix(self, rid, node_name, graph_walk, inputs, prefix) -> None:
        return self._reuse.apply_cached_prefix(rid, node_name, graph_walk, inputs, prefix)

    def extend_prefix_chain(self, rid, node_name, graph_walk, outputs) -> None:
        return self._reuse.extend_prefix_chain(rid, node_name, graph_walk, outputs)

    def complete_cached_walk(self, rid, node_name, graph_walk) -> None:
        return self._reuse.complete_cached_walk(rid, node_name, graph_walk)

    # -- integrity, engine lifecycle -----------------------------------------------------

    def check_integrity(self) -> None:
        """Every slot of every tier is free, held by exactly one request, or
        held by a removed request's copy still in flight; each request holds
        exactly what its state allows (the lifecycle's one table); ledgers
        equal the slots they count."""
        return self._check.check()

    def cleanup(self, timeout: float = 30.0) -> None:
        """Finish (or, after ``timeout``, abandon) transfers and stop the worker
        threads; then close the disk tier and unpin the host slab. Calling it
        again does nothing; every other call afterwards raises CacheClosed.
        A ``timeout`` that is not a finite number >= 0 is refused (ValueError)
        before anything closes."""
        if self._closed:
            return
        timeout = check_timeout("cleanup", timeout)
        try:
            self.synchronize(timeout=timeout)
        except TimeoutError as exc:
            log.error("close: abandoning transfers still in flight: %s", exc)
        finally:
            self._closed = True
            self._teardown(timeout=10.0)

    def _teardown(self, timeout: float, failed_start: bool = False) -> None:
        """Stop every worker, close the disk tier, then unregister the host slab
        (only once every worker has joined: a copy may still read it). ``failed_start``:
        the constructor failed; a disk tier it opened is discarded, not kept."""
        self._closed = True
        if self._stream is not None:
            self._stream.stop()
        if self._reuse is not None and self._reuse.blocks is not None:
            self._reuse.blocks.close(timeout)  # the shared tier's queue, if the cache built it
        joined = self._transfers.shutdown(timeout) if self._transfers is not None else True
        if self._storage is not None:
            self._storage.close(joined, failed_start)

    close = cleanup

    def __enter__(self) -> PagedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
