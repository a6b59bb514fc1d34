"""PagedKVCache: a paged KV cache whose requests move between device, host and disk.

Ownership:
- ``PagePool`` objects own the device and host slots, their free lists and
  byte ledgers; ``DiskPageStore`` owns the disk chunks and its ledger.
- This class owns the per-request records (state, slot lists, checksums),
  kept in its ``Lifecycle`` (``tiering.core.lifecycle``: the one request state
  machine it shares with the replay's model and the test fake), and is the
  only thing that changes them, always on the caller's thread.
- It is split by job: ``kv_hooks`` (the answers, admission), ``kv_transfers``
  (starting moves, applying their outcomes), ``kv_moves`` (the byte copies on
  worker threads), ``kv_data`` (page tables, reads, writes) and
  ``kv_prefix_api`` (prefix reuse); this module builds, registers, removes,
  checks and tears down.
- Worker threads only copy bytes and compute checksums; they return results
  that ``poll`` applies. So no lock guards the records.

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

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from tiering.resources.base import (
    EngineResourceInfo,
    NodeResourceSpec,
    Resource,
    ResourceReqConfig,
)
from tiering.resources.kv_data import KVDataPlane, check_int
from tiering.resources.kv_geometry import KVGeometry, parse_device
from tiering.resources.kv_hooks import KVEvictionHooks
from tiering.resources.kv_moves import CopyJobs
from tiering.resources.kv_prefix import BLOCKS, PrefixCache
from tiering.resources.kv_prefix_api import KVPrefixReuse
from tiering.resources.kv_records import (  # noqa: F401 (the errors are re-exported from their old home)
    CacheClosed,
    KVStats,
    RequestLost,
    RequestRecord,
    Tombstone,
    TransferJob,
    UnknownRequest,
)
from tiering.resources.kv_stream import STREAM_BUFFER, StreamBuffer
from tiering.resources.kv_transfers import KVTransfers, _why

from tiering.control.protocols import CompletionFeed
from tiering.core.executor import PriorityExecutor
from tiering.core.lifecycle import Lifecycle, Op, guard
from tiering.core.pinning import HostRuntime, PinnedSlab, PinOutcome, pin_host_slab
from tiering.core.pools import PagePool, PoolIntegrityError
from tiering.core.staging import StagingConfig, StagingRing
from tiering.core.transfer import StreamSet, no_fault
from tiering.core.validate import check_timeout
from tiering.types import (
    CANCELLED,
    Move,
    RequestState,
    Tier,
    TransferResult,
)

log = logging.getLogger("tiering.kv_cache")

NO_OVERRIDES = ResourceReqConfig()

S = RequestState


class PagedKVCache(KVPrefixReuse, KVEvictionHooks, KVTransfers, KVDataPlane, Resource):
    """A paged KV cache implementing the engine's eviction hooks.

    ``device_pages`` pages are allocated once on ``device`` page-first; the
    host tier is one page-aligned slab of ``host_pages`` pages (pinned to
    exactly that size when CUDA is present, see ``tiering.core.pinning``); the
    disk tier is a ``DiskPageStore`` when ``disk`` is given
    (``disk_wrap_store`` wraps its zarr store: the fault-injection seam;
    ``disk_store`` injects a ready-made store, which the cache then owns and
    closes). ``offload``, ``demote`` and ``reload`` queue their copies and
    return at once; ``poll`` applies finished ones and ``synchronize`` waits
    for all of them. ``compute_stream`` names the CUDA stream the engine's
    kernels run on (default: the stream current when the cache is built).

    Copies run on three executors: device-to-host (offloads), host-to-device
    (reloads from host) and disk I/O (writes, and disk reloads ahead of
    writes), so a reload never waits behind a running offload.
    """

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
        if staging is not None and not isinstance(staging, StagingConfig):
            raise ValueError(f"staging must be a StagingConfig or None, got {type(staging).__name__}")
        for name, v in (("device_pages", device_pages), ("host_pages", host_pages),
                        ("copy_workers", copy_workers), ("io_workers", io_workers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PagedKVCache: {name} must be an int >= 1, got {v!r}")
        for name, v in (("verify", verify),
                        ("offload_to_disk_when_host_full", offload_to_disk_when_host_full),
                        ("layerwise_reload", layerwise_reload)):
            if not isinstance(v, bool):
                raise ValueError(f"PagedKVCache: {name} must be a bool, got {v!r}")
        for name, v in (("stream_window_pages", stream_window_pages),
                        ("stream_buffer_pages", stream_buffer_pages)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"PagedKVCache: {name} must be an int >= 0, got {v!r}")
        if (stream_window_pages == 0) != (stream_buffer_pages == 0):
            raise ValueError(
                "PagedKVCache: stream_window_pages and stream_buffer_pages are both 0 (no"
                f" streaming) or both >= 1, got {stream_window_pages} and {stream_buffer_pages}")
        if stream_window_pages and stream_window_pages + stream_buffer_pages >= device_pages:
            raise ValueError(
                f"PagedKVCache: stream_window_pages ({stream_window_pages}) plus"
                f" stream_buffer_pages ({stream_buffer_pages}) must leave device pages for other"
                f" requests (device_pages={device_pages})")
        if stage_disk_io is not None and not isinstance(stage_disk_io, bool):
            raise ValueError(f"PagedKVCache: stage_disk_io must be a bool or None, got {stage_disk_io!r}")
        for name, fn in (("clock", clock), ("copy_fault_hook", copy_fault_hook)):
            if not callable(fn):
                raise ValueError(f"PagedKVCache: {name} must be callable, got {fn!r}")
        if disk_wrap_store is not None and not callable(disk_wrap_store):
            raise ValueError(f"PagedKVCache: disk_wrap_store must be callable or None, got {disk_wrap_store!r}")
        self.stats = KVStats()
        self._life = Lifecycle(
            "PagedKVCache", self.stats, clock,
            {Tier.DEVICE: self._release_device, Tier.HOST: self._release_host,
             Tier.DISK: self._release_disk},
            release_all=self._release_all, on_lost=self._on_lost,
        )
        self._prefix: PrefixCache | None = None
        self._stream: StreamBuffer | None = None
        self.stream_window_pages = stream_window_pages
        self._stream_pages = stream_buffer_pages
        self._executors: list[PriorityExecutor] = []
        self._slab: PinnedSlab | None = None
        self.disk = None
        self.geometry = geometry
        self.device = parse_device("PagedKVCache", device)
        if self.device.type not in ("cpu", "cuda"):  # "meta" holds no bytes; others are untested
            raise ValueError(f"PagedKVCache: device must be a CPU or CUDA device, got {device!r}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for but CUDA is not available")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.verify = bool(verify)
        self.layerwise_reload = layerwise_reload
        self.layer_wait_timeout_s = check_timeout("PagedKVCache: layer_wait_timeout_s",
                                                  layer_wait_timeout_s)
        self.offload_to_disk_when_host_full = bool(offload_to_disk_when_host_full)
        self._clock = clock
        self._fault = copy_fault_hook
        pb = geometry.page_bytes
        self.device_pool = PagePool("device", device_pages, pb)
        self.host_pool = PagePool("host", host_pages, pb)
        shape = geometry.page_shape
        self._reqs: dict[str, RequestRecord] = self._life.records
        self._inflight: dict[str, RequestRecord] = self._life.inflight  # rid -> record
        self._tombstones: dict[tuple, Tombstone] = {}
        self._tomb_seq = itertools.count(1)
        self._unreported: list[TransferResult] = []  # applied outside poll, reported by it
        self._feeds: list[CompletionFeed] = []
        self._moves = CopyJobs(self)
        self._completions: dict[Move, Callable[[RequestRecord, TransferJob, BaseException | None], TransferResult]] = {
            Move.OFFLOAD_TO_HOST: self._done_offload_host,
            Move.OFFLOAD_TO_DISK: self._done_offload_disk,
            Move.DEMOTE: self._done_demote,
            Move.RELOAD_FROM_HOST: self._done_reload_host,
            Move.RELOAD_FROM_DISK: self._done_reload_disk,
        }
        try:
            self._streams = StreamSet(self.device, compute_stream)
            self._dev = torch.empty((device_pages, *shape), dtype=geometry.dtype, device=self.device)
            self._slab = pin_host_slab(
                (host_pages, *shape), geometry.dtype, self.device, runtime=host_runtime
            )
            self._host = self._slab.tensor
            if stream_buffer_pages:  # the ring's pages are set aside once (admission counts them)
                ring = self.device_pool.allocate(STREAM_BUFFER, stream_buffer_pages)
                assert ring == list(range(stream_buffer_pages)), ring
                self._stream = StreamBuffer(self._dev[:stream_buffer_pages], geometry.num_layers,
                                            self._host, self._streams, lambda kind: self._fault(kind))
            self._d2h = self._executor(copy_workers, "tiering-d2h")
            self._h2d = self._executor(copy_workers, "tiering-h2d")
            self._io = self._executor(io_workers, "tiering-io")
            self.disk = disk_store
            if self.disk is None and disk is not None:
                from tiering.disk.store import DiskPageStore

                self.disk = DiskPageStore(
                    disk, shape, geometry.dtype, fingerprint=geometry.fingerprint(),
                    wrap_store=disk_wrap_store,
                )
            # a GPU's pages reach the disk through the ring; a CPU's go straight
            self._stage = (self.device.type == "cuda") if stage_disk_io is None else bool(stage_disk_io)
            self._ring = None
            if self.disk is not None and self._stage:
                pin = (lambda t: t.pin_memory()) if self.device.type == "cuda" else None
                self._ring = StagingRing(staging or StagingConfig(), shape, geometry.dtype, pin=pin)
            if self.disk is not None:
                self._adopt_reattached()
        except BaseException:
            self._teardown(timeout=10.0)
            raise

    def _executor(self, workers: int, name: str) -> PriorityExecutor:
        ex = PriorityExecutor(workers, name)
        self._executors.append(ex)
        return ex

    @property
    def host_pinning(self) -> PinOutcome:
        """How the host slab is pinned (exact / torch-rounded / not pinned)."""
        return self._slab.outcome

    # -- construction helpers ------------------------------------------------------

    def _adopt_reattached(self) -> None:
        """Requests an earlier process left intact on disk come back as ON_DISK."""
        for rid, (extent, meta) in self.disk.reattached().items():
            self._reqs[rid] = RequestRecord(  # placed at rest on disk, not moved there
                rid, None, self._clock(), int(meta["num_tokens"]), S.ON_DISK,
                disk=extent, checksum=meta.get("checksum"))

    @classmethod
    def build(cls, spec: NodeResourceSpec, info: EngineResourceInfo) -> PagedKVCache:
        cfg = dict(spec.config)
        geometry = cfg.pop("geometry")
        stream = info.compute_stream
        if stream is not None:
            cfg.setdefault("compute_stream", stream)
        return cls(geometry, device=info.device, **cfg)

    # -- small lookups ----------------------------------------------------------------

    @property
    def _closed(self) -> bool:
        return self._life.closed

    @_closed.setter
    def _closed(self, value: bool) -> None:
        self._life.closed = value

    def _open(self, what: str) -> None:
        self._life.check_open(what)

    def _pages_for(self, r: RequestRecord) -> int:
        """The request's own pages (mapped prefix blocks are the index's)."""
        return self.geometry.pages_for(r.num_tokens) - len(r.shared)

    # -- request lifecycle ----------------------------------------------------------

    def ingest_request(self, rid: str, overrides: ResourceReqConfig | None = None):
        """Register ``rid`` (idempotent). Ingesting it again with different
        overrides is an error: the first settings are the ones in force."""
        self._open("ingest_request")
        now = self._clock()
        self._life.register(rid, overrides, lambda: RequestRecord(rid, overrides, now),
                            ResourceReqConfig)

    def allocate(self, rid: str, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in total (growing, never
        shrinking). False, with nothing changed, when the device pool is short."""
        r = self._req(rid, "allocate")
        check_int(f"allocate({rid!r})", "num_tokens", num_tokens)
        if not self._admitted_early(r):
            guard(r, Op.ALLOCATE)
        if num_tokens <= r.num_tokens:
            return True
        extra = self.geometry.pages_for(num_tokens) - len(r.device) - len(r.shared) - len(r.head)
        if extra > 0 and self._stream is not None and (
                r.head or self.geometry.pages_for(num_tokens) - len(r.shared) > self._longest()):
            return self._allocate_streamed(r, num_tokens, extra)
        if extra > 0:
            if self._prefix is not None and not self._prefix.ensure_device(extra):
                return False
            slots = self.device_pool.allocate(rid, extra)
            if slots is None:
                return False
            r.device.extend(slots)
            r.index = None
        r.num_tokens = num_tokens
        return True

    def _longest(self) -> int:
        """The most pages a request can ever hold on the device (past it, it streams)."""
        return self.device_pool.num_pages - self._stream_pages

    def _allocate_streamed(self, r: RequestRecord, num_tokens: int, extra: int) -> bool:
        """Grow a request longer than the device: its window keeps its last
        ``stream_window_pages`` pages (where the new tokens go); older window pages move
        to the host head. False (nothing changed) when the host or device is short."""
        what, W, T = f"allocate({r.rid!r})", self.stream_window_pages, self.geometry.page_tokens
        if r.shared or r.blocks or r.prefix_load is not None:
            raise ValueError(f"{what}: a request mapping prefix blocks cannot stream past the device")
        total = self.geometry.pages_for(num_tokens)
        touched = total - r.num_tokens // T  # the pages the coming writes fill
        if touched > W:
            raise ValueError(
                f"{what}: growing from {r.num_tokens} to {num_tokens} tokens writes {touched} pages"
                f" at once; a streamed request's window (stream_window_pages) holds {W}")
        spill = max(0, len(r.device) + extra - W)
        host = self.host_pool.allocate(r.rid, spill) if spill else []
        if host is None or self.device_pool.free_pages + spill < extra:
            if host:
                self.host_pool.release(r.rid, host)
            return False
        old = r.device[:spill]
        for d, h in zip(old, host, strict=True):  # in stream order before the slots are reused
            self._host[h].copy_(self._dev[d], non_blocking=self.device.type == "cuda")
        if old and self.device.type == "cuda":
            self._streams.compute_marker().synchronize()  # the head is read by the copy thread
        self.device_pool.release(r.rid, old)
        new = self.device_pool.allocate(r.rid, extra)
        r.head.extend(host)
        r.device = r.device[spill:] + new
        r.index = None
        r.num_tokens = num_tokens
        if spill:
            self._stream.forget(r.rid)
        return True

    def remove_request(self, rid: str):
        """Forget ``rid`` and give back every slot. A copy in flight is
        cancelled if it has not started, else its slots come back when it
        ends (under a fresh key: the id may be ingested again at once, and
        then behaves exactly like a new one)."""
        r = self._req(rid, "remove_request")
        if r.job is not None and r.job.future.done():
            self._finish_now(r)  # a finished copy's outcome (a fault too) is still reported
        if r.load_work is not None:  # a prefix load in flight
            job, work = r.job, r.load_work
            if job.future.cancel():
                self._prefix.finish_load(None, work, ["cancelled"] * len(work))
                self._unreported.append(TransferResult(rid, job.move, False, 0, None, CANCELLED))
            else:  # it ends in poll; its blocks stay mapped by it until then
                keys = {w[0] for w in work}
                for key in r.blocks:
                    if key not in keys:
                        self._prefix.index.release(key)
                self._prefix.orphans.append((job.future, work))
                r.blocks, r.shared = [], []
            r.job, r.load_work, r.prefix_load = None, None, None
            self._release_all(r)
            self._life.forget(rid)
            return
        if self._prefix is not None and r.blocks:
            self._prefix.release_request(r)
        job = r.job
        fut = job.future if job else None
        if fut is not None and fut.cancel():  # never started: reported as not done
            self._unreported.append(TransferResult(
                rid, job.move, False, 0, None, CANCELLED))
            self._release_all(r)
        elif fut is not None and not fut.done():
            key = ("removed", next(self._tomb_seq))
            for pool, slots in ((self.device_pool, r.device), (self.host_pool, r.host)):
                pool.transfer_ownership(rid, key, slots)
            if r.disk is not None and job.move is Move.RELOAD_FROM_DISK:
                # the extent stays reserved until the read ends, but its
                # committed entry must not outlive the request
                self._disk_call(self.disk.uncommit, r.disk)
            self._tombstones[key] = Tombstone(key, rid, job.move, fut, r.device, r.host, r.disk)
        else:
            self._release_all(r)
        self._life.forget(rid)

    # the lifecycle's release table (one function per tier) and what a loss adds

    def _release_device(self, r: RequestRecord) -> None:
        self.device_pool.release(r.rid, r.device)
        r.device, r.index = [], None

    def _release_host(self, r: RequestRecord) -> None:
        self.host_pool.release(r.rid, r.host)
        r.host = []
        if r.head:
            self._stream.forget(r.rid)
            self.host_pool.release(r.rid, r.head)
            r.head = []

    def _release_disk(self, r: RequestRecord) -> None:
        extent, r.disk = r.disk, None
        if extent is not None:
            self._disk_call(self.disk.release, extent)  # also forgets its committed entry

    def _release_all(self, r: RequestRecord) -> None:
        if self._prefix is not None and (r.blocks or r.prefix_load is not None):
            self._prefix.release_request(r)
        self._release_device(r)
        self._release_host(r)
        self._release_disk(r)

    def _on_lost(self, r: RequestRecord, reason: str) -> None:
        log.error("request %r lost: %s", r.rid, reason)
        r.checksum = None

    def _disk_call(self, call: Callable[[Any], Any], extent) -> bool:
        """``disk.release`` / ``disk.uncommit`` on the step path: a fault is logged, never raised.

        The ledger changes before the manifest is rewritten, so a failed
        rewrite leaves the chunks quarantined until the next good one. ``call``
        is the bound method (``self.disk.release`` or ``self.disk.uncommit``)."""
        try:
            call(extent)
            return True
        except Exception as exc:
            self.stats.disk_release_faults += 1
            log.error("disk %s of extent %s failed: %s: %s", call.__name__,
                      getattr(extent, "chunks", extent), type(exc).__name__, exc)
            return False

    # -- integrity --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Every slot of every tier is free, held by exactly one request, or
        held by a removed request's copy still in flight; each request holds
        exactly what its state allows (the lifecycle's one table); ledgers
        equal the slots they count."""
        self._open("check_integrity")
        pages = self.geometry.pages_for

        def checked_here(r: RequestRecord) -> bool:
            # a pending prefix load, or a layer-wise reload whose early-admitted step grew
            # the request: its source holds the pages it had when the reload started
            return r.prefix_load is not None or bool(r.head) or (
                r.layers is not None and r.num_tokens != r.layers.base_tokens)

        problems = self._life.check(lambda r: pages(r.num_tokens) - len(r.shared),
                                    skip=checked_here)
        dev: dict = {}
        host: dict = {}
        for rid, r in self._reqs.items():
            dev[rid], host[rid] = r.device, r.host + r.head
            st = r.state
            problems += self._check_layers(r)
            if r.head:
                problems += self._check_streamed(r)
            if r.prefix_load is not None:  # a pending prefix load holds only mapped blocks
                if r.held() != (0, 0, 0):
                    problems.append(f"{rid}: a pending prefix load holds {r.held()}")
                if st not in (S.ON_HOST, S.ON_DISK, S.RELOADING):
                    problems.append(f"{rid}: a pending prefix load in state {st.value}")
                if (r.load_work is not None) != (st is S.RELOADING):
                    problems.append(f"{rid}: load in flight {r.load_work is not None}, state {st.value}")
                if st.in_flight != (r.job is not None) or st.in_flight != (rid in self._inflight):
                    problems.append(f"{rid}: state {st.value} but job={r.job is not None}")
            if st is S.RESIDENT and len(r.device) != pages(r.num_tokens) - len(r.shared) - len(r.head):
                problems.append(f"{rid}: {len(r.device)} device pages for {r.num_tokens} tokens")
            if r.index is not None and r.index.tolist() != r.shared + r.device:
                problems.append(f"{rid}: device page table {r.index.tolist()} != slots {r.shared + r.device}")
            if self._prefix is None and (r.blocks or r.shared):
                problems.append(f"{rid}: maps prefix blocks with no prefix cache")
            for layer, spans in r.written.items():  # sorted, apart, within the request
                ends = [0] + [x for span in spans for x in span]
                if any(b <= a for a, b in zip(ends[1:], ends[2:], strict=False)) or ends[-1] > r.num_tokens:
                    problems.append(f"{rid}: layer {layer} written spans {spans[:4]} (of"
                                    f" {len(spans)}) for {r.num_tokens} tokens")
        for key, t in self._tombstones.items():
            dev[key], host[key] = t.device, t.host
        if self._stream is not None:
            dev[STREAM_BUFFER] = list(range(self._stream_pages))
        if self._prefix is not None:
            dev[BLOCKS], host[BLOCKS] = self._prefix.pages_on(Tier.DEVICE), self._prefix.pages_on(Tier.HOST)
            problems += self._prefix.check_integrity(self._reqs.values())
        if self._ring is not None and not self._inflight and not self._tombstones:
            try:
                self._ring.check_integrity()
            except AssertionError as exc:
                problems.append(str(exc))
        try:
            self.device_pool.check_integrity(dev)
            self.host_pool.check_integrity(host)
            if self.disk is not None:
                self.disk.check_integrity()
                held = sum(1 for r in self._reqs.values() if r.disk is not None)
                held += sum(1 for t in self._tombstones.values() if t.disk is not None)
                if self._prefix is not None:
                    held += len(self._prefix.extents)
                extents = self.disk.stats()["extents"]
                if held != extents:
                    problems.append(f"disk holds {extents} extents, records {held}")
        except (PoolIntegrityError, AssertionError) as exc:
            problems.append(str(exc))
        if problems:
            raise PoolIntegrityError("PagedKVCache integrity: " + "; ".join(problems[:20]))

    def _check_streamed(self, r: RequestRecord) -> list[str]:
        """A streamed request: resident, nothing in flight, no prefix blocks, its head
        and window covering its tokens with the window within its size."""
        rid, out = r.rid, []
        if self._stream is None:
            return [f"{rid}: streams with no stream buffer"]
        if r.state is not S.RESIDENT or r.job is not None or r.host or r.disk is not None:
            out.append(f"{rid}: streamed in state {r.state.value} (job={r.job is not None},"
                       f" host={len(r.host)}, disk={r.disk is not None})")
        if r.shared or r.blocks:
            out.append(f"{rid}: streamed while mapping prefix blocks")
        if len(r.head) + len(r.device) != self.geometry.pages_for(r.num_tokens):
            out.append(f"{rid}: {len(r.head)} head and {len(r.device)} window pages for"
                       f" {r.num_tokens} tokens")
        if not 0 < len(r.device) <= self.stream_window_pages:
            out.append(f"{rid}: a window of {len(r.device)} pages (at most"
                       f" {self.stream_window_pages})")
        return out

    def _check_layers(self, r: RequestRecord) -> list[str]:
        """A reload's layer progress: only while it is in flight, consistent, and (once a
        step was admitted early and grew the request) device pages for every token with
        the source still holding the pages it had."""
        p, rid = r.layers, r.rid
        if p is None:
            return [f"{rid}: admitted early with no reload in flight"] if r.admitted_early else []
        if r.state is not S.RELOADING or r.job is None:
            return [f"{rid}: layer progress in state {r.state.value}"]
        out = [f"{rid}: {m}" for m in p.check()]
        if p.num_layers != self.geometry.num_layers:
            out.append(f"{rid}: progress over {p.num_layers} layers, the cache has"
                       f" {self.geometry.num_layers}")
        if r.admitted_early and not p.layerwise:
            out.append(f"{rid}: admitted early from a whole-request reload")
        if r.num_tokens < p.base_tokens:
            out.append(f"{rid}: {r.num_tokens} tokens, fewer than the {p.base_tokens} reloaded")
        if r.num_tokens != p.base_tokens:
            if not r.admitted_early:
                out.append(f"{rid}: grew while reloading without a step admitted")
            need = self.geometry.pages_for(r.num_tokens) - len(r.shared)
            src = len(r.host) if r.job.move is Move.RELOAD_FROM_HOST else (
                r.disk.num_pages if r.disk is not None else 0)
            if len(r.device) != need or src != p.base_pages:
                out.append(f"{rid}: grown reload holds {len(r.device)} device pages (needs"
                           f" {need}) and {src} source pages (reloaded {p.base_pages})")
        return out

    # -- engine lifecycle -----------------------------------------------------------

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

    def _teardown(self, timeout: float) -> None:
        """Stop every worker, close the disk tier, then unregister the host slab
        (only once every worker has joined: a copy may still read it)."""
        self._closed = True
        if self._stream is not None:
            self._stream.stop()
        if self._prefix is not None:
            self._prefix.close(timeout)  # the shared tier's queue, if the cache built it
        joined = all([ex.shutdown(timeout=timeout) for ex in self._executors])
        if self.disk is not None:
            try:
                self.disk.close()
            except Exception as exc:
                log.error("close: the disk tier did not close cleanly: %s", _why(exc))
        if self._slab is not None:
            if joined:
                self._slab.release()
            else:
                log.error("close: a copy worker is still running; the host slab stays registered")

    close = cleanup

    def __enter__(self) -> PagedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

