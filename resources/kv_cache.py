"""PagedKVCache: a paged KV cache whose requests move between device, host and disk.

Ownership:
- ``PagePool`` objects own the device and host slots, their free lists and
  byte ledgers; ``DiskPageStore`` owns the disk chunks and its ledger.
- This class owns the per-request records (state, slot lists, checksums) and
  is the only thing that changes them, always on the caller's thread.
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

import concurrent.futures as cf
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from resources.base import (
    ADMIT_OK,
    AdmitOutcome,
    CachedPrefix,
    EngineResourceInfo,
    NodeResourceSpec,
    Resource,
    ResourceReqConfig,
    ResourceStep,
    StepContext,
)
from resources.engine_types import retention_offload_priority
from resources.kv_geometry import KVGeometry
from resources.kv_prefix import BLOCKS, PrefixCache, PrefixHit, as_root
from resources.kv_records import (
    CacheClosed,
    KVStats,
    RequestLost,
    RequestRecord,
    Tombstone,
    TransferJob,
    UnknownRequest,
)
from tiering.control.protocols import CompletionFeed
from tiering.core.checksum import ChecksumMismatch, crc_of, crc_of_pages
from tiering.core.executor import OFFLOAD, RELOAD, WRITE, PriorityExecutor
from tiering.core.pinning import HostRuntime, PinnedSlab, PinOutcome, pin_host_slab
from tiering.core.pools import PagePool, PoolIntegrityError
from tiering.core.staging import StagingConfig, StagingRing, StagingTimeout
from tiering.core.transfer import StreamSet, coalesce, copy_runs, issue_runs, no_fault
from tiering.errors import TRANSIENT_IO_ERRNOS
from tiering.types import (
    CANCELLED,
    OFFLOADED_STATES,
    RELOADABLE_STATES,
    IllegalTransition,
    Move,
    RequestState,
    Tier,
    TransferResult,
    check_transition,
)

log = logging.getLogger("tiering.kv_cache")

NO_OVERRIDES = ResourceReqConfig()

S = RequestState


def check_int(what: str, name: str, value: Any, lo: int | None = 0) -> int:
    """``value`` as an int (bool is not an int here), at least ``lo``; else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}: {name} must be an int, got {type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{what}: {name} must be >= {lo}, got {value}")
    return value


class PagedKVCache(Resource):
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
    ) -> None:
        if not isinstance(geometry, KVGeometry):
            raise TypeError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        if staging is not None and not isinstance(staging, StagingConfig):
            raise ValueError(f"staging must be a StagingConfig or None, got {type(staging).__name__}")
        for name, v in (("device_pages", device_pages), ("host_pages", host_pages),
                        ("copy_workers", copy_workers), ("io_workers", io_workers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PagedKVCache: {name} must be an int >= 1, got {v!r}")
        self._closed = False
        self._prefix: PrefixCache | None = None
        self._executors: list[PriorityExecutor] = []
        self._slab: PinnedSlab | None = None
        self.disk = None
        self.geometry = geometry
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for but CUDA is not available")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.verify = bool(verify)
        self.offload_to_disk_when_host_full = bool(offload_to_disk_when_host_full)
        self._clock = clock
        self._fault = copy_fault_hook
        pb = geometry.page_bytes
        self.device_pool = PagePool("device", device_pages, pb)
        self.host_pool = PagePool("host", host_pages, pb)
        shape = geometry.page_shape
        self._reqs: dict[str, RequestRecord] = {}
        self._inflight: set[str] = set()
        self._tombstones: dict[tuple, Tombstone] = {}
        self._tomb_seq = itertools.count(1)
        self._newly_lost: list[tuple[str, str]] = []
        self._unreported: list[TransferResult] = []  # applied outside poll, reported by it
        self._feeds: list[CompletionFeed] = []
        self.stats = KVStats()
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
            r = RequestRecord(rid, None, self._clock(), num_tokens=int(meta["num_tokens"]))
            r.state = S.ON_DISK
            r.disk = extent
            r.checksum = meta.get("checksum")
            self._reqs[rid] = r

    @classmethod
    def build(cls, spec: NodeResourceSpec, info: EngineResourceInfo) -> PagedKVCache:
        cfg = dict(spec.config)
        geometry = cfg.pop("geometry")
        stream = info.compute_stream
        if stream is not None:
            cfg.setdefault("compute_stream", stream)
        return cls(geometry, device=info.device, **cfg)

    # -- small lookups ----------------------------------------------------------------

    def _open(self, what: str) -> None:
        if self._closed:
            raise CacheClosed(f"{what}: the KV cache is closed")

    def _req(self, rid: str, what: str = "call") -> RequestRecord:
        self._open(what)
        try:
            return self._reqs[rid]
        except (KeyError, TypeError):
            raise UnknownRequest(f"unknown request {rid!r}") from None

    def _pages_for(self, r: RequestRecord) -> int:
        """The request's own pages (mapped prefix blocks are the index's)."""
        return self.geometry.pages_for(r.num_tokens) - len(r.shared)

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
        used = self.device_pool.used_bytes
        if self._prefix is not None:
            used -= self._prefix.unmapped(Tier.DEVICE) * self.geometry.page_bytes
        return used

    def host_used_bytes(self) -> int:
        """Host bytes held, not counting cached prefix blocks no request maps."""
        self._open("host_used_bytes")
        used = self.host_pool.used_bytes
        if self._prefix is not None:
            used -= self._prefix.unmapped(Tier.HOST) * self.geometry.page_bytes
        return used

    def disk_used_bytes(self) -> int:
        """Bytes the disk tier's ledger holds (0 without a disk tier)."""
        self._open("disk_used_bytes")
        return 0 if self.disk is None else self.disk.used_bytes()

    def requests(self) -> list[str]:
        self._open("requests")
        return list(self._reqs)

    def state_of(self, rid: str) -> RequestState:
        return self._req(rid, "state_of").state

    def tier_of(self, rid: str) -> Tier | None:
        return self._req(rid, "tier_of").state.tier

    def num_tokens(self, rid: str) -> int:
        return self._req(rid, "num_tokens").num_tokens

    def page_table(self, rid: str) -> list[int]:
        """Device slots of the request, in token order. Only while it is resident."""
        r = self._req(rid, "page_table")
        if r.state is not S.RESIDENT:
            raise IllegalTransition(f"request {rid!r} is {r.state.value}; it has no page table")
        return list(r.shared) + list(r.device)

    def device_page_table(self, rid: str) -> torch.Tensor:
        """The request's device slots as a long tensor on the device (kept per
        request, rebuilt only when its slots change; no host sync to use it)."""
        return self._index(self._readable(rid, "device_page_table"))

    def _index(self, r: RequestRecord) -> torch.Tensor:
        if r.index is None or r.index.numel() != len(r.shared) + len(r.device):
            r.index = torch.tensor(r.shared + r.device, dtype=torch.long).to(self.device)
            self.stats.page_tables_built += 1
        return r.index

    def lost_reason(self, rid: str) -> str | None:
        return self._req(rid, "lost_reason").lost_reason

    def take_lost(self) -> list[tuple[str, str]]:
        """(rid, reason) of requests lost since the last call."""
        self._open("take_lost")
        out, self._newly_lost = self._newly_lost, []
        return out

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer over all device pages, ``[pages, tokens, heads, dim]``
        views (no copy) for attention kernels that take a page table."""
        self._open("layer_view")
        self._check_layer("layer_view", layer)
        return self._dev[:, layer, 0], self._dev[:, layer, 1]

    def _check_layer(self, what: str, layer: int) -> None:
        check_int(what, "layer", layer, lo=None)
        if not 0 <= layer < self.geometry.num_layers:
            raise ValueError(f"{what}: layer {layer} out of range [0, {self.geometry.num_layers})")

    # -- request lifecycle ----------------------------------------------------------

    def ingest_request(self, rid: str, overrides: ResourceReqConfig | None = None):
        """Register ``rid`` (idempotent). Ingesting it again with different
        overrides is an error: the first settings are the ones in force."""
        self._open("ingest_request")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request id must be a non-empty str, got {rid!r}")
        if overrides is not None and not isinstance(overrides, ResourceReqConfig):
            raise TypeError(f"overrides for {rid!r} must be a ResourceReqConfig or None")
        r = self._reqs.get(rid)
        if r is not None:
            if r.overrides != overrides:
                raise ValueError(
                    f"request {rid!r} was already ingested with overrides {r.overrides!r};"
                    f" got different overrides {overrides!r}"
                )
            return
        self._reqs[rid] = RequestRecord(rid, overrides, self._clock())

    def allocate(self, rid: str, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in total (growing, never
        shrinking). False, with nothing changed, when the device pool is short."""
        r = self._req(rid, "allocate")
        check_int(f"allocate({rid!r})", "num_tokens", num_tokens)
        if r.state is not S.RESIDENT:
            raise IllegalTransition(f"request {rid!r} is {r.state.value}; allocate needs it resident")
        if num_tokens <= r.num_tokens:
            return True
        extra = self.geometry.pages_for(num_tokens) - len(r.device) - len(r.shared)
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

    def _token_pages(self, r: RequestRecord, start: int, n: int):
        """(slot, offset in page, token index in the input, count) pieces of a token range."""
        T = self.geometry.page_tokens
        table = r.shared + r.device
        pos, end = start, start + n
        while pos < end:
            page, off = divmod(pos, T)
            take = min(T - off, end - pos)
            yield table[page], off, pos - start, take
            pos += take

    def _check_kv(self, what: str, k: Any, v: Any) -> None:
        g = self.geometry
        want = (g.num_kv_heads, g.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != want:
            raise ValueError(
                f"{what}: k and v must both be [tokens, {want[0]}, {want[1]}],"
                f" got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        for name, t in (("k", k), ("v", v)):
            if t.dtype != g.dtype:
                raise ValueError(f"{what}: {name}.dtype is {t.dtype}; the cache holds {g.dtype}")
            if t.device.type != self.device.type or (
                self.device.type == "cuda" and t.device.index != self.device.index
            ):
                raise ValueError(f"{what}: {name}.device is {t.device}; the cache is on {self.device}")

    def write(self, rid: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V ``[tokens, heads, dim]`` of one layer at token ``start``.

        ``k`` and ``v`` must already have the cache's dtype and device (nothing
        is converted)."""
        what = f"write({rid!r})"
        r = self._req(rid, "write")
        self._check_layer(what, layer)
        check_int(what, "start", start)
        self._check_kv(what, k, v)
        n = k.shape[0]
        if start + n > r.num_tokens:
            raise ValueError(
                f"{what}: tokens [{start}, {start + n}) are past the {r.num_tokens}"
                " allocated tokens"
            )
        if start < len(r.shared) * self.geometry.page_tokens:
            raise ValueError(
                f"{what}: tokens from {start} fall in published page {start // self.geometry.page_tokens}"
                f" (the first {len(r.shared) * self.geometry.page_tokens} tokens are published and immutable)"
            )
        r = self._readable(rid, "write")
        for slot, off, i, take in self._token_pages(r, start, n):
            self._dev[slot, layer, 0, off : off + take].copy_(k[i : i + take])
            self._dev[slot, layer, 1, off : off + take].copy_(v[i : i + take])

    def read(self, rid: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_tokens, heads, dim]`` of one layer (copies), gathered
        through the request's device page table (no host sync)."""
        self._req(rid, "read")
        self._check_layer(f"read({rid!r})", layer)
        r = self._readable(rid, "read")
        g = self.geometry
        pages = self._dev[:, layer].index_select(0, self._index(r))  # [p, 2, T, H, D]
        k = pages[:, 0].reshape(-1, g.num_kv_heads, g.head_dim)[: r.num_tokens]
        v = pages[:, 1].reshape(-1, g.num_kv_heads, g.head_dim)[: r.num_tokens]
        return k, v

    def _readable(self, rid: str, what: str) -> RequestRecord:
        r = self._req(rid, what)
        if r.state is S.LOST:
            raise RequestLost(rid, r.lost_reason or "unknown")
        if r.state is S.RELOADING:
            self._finish_now(r)  # maybe the copy is done already
        if r.state is not S.RESIDENT:
            raise IllegalTransition(
                f"{what}: request {rid!r} is {r.state.value}; it must be resident on the device"
            )
        self._streams.wait_on_compute(r.ready_event)
        r.ready_event = None
        return r

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
            self._inflight.discard(rid)
            del self._reqs[rid]
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
                self._disk_call("uncommit", r.disk)
            self._tombstones[key] = Tombstone(key, rid, job.move, fut, r.device, r.host, r.disk)
        else:
            self._release_all(r)
        self._inflight.discard(rid)
        del self._reqs[rid]

    def _release_all(self, r: RequestRecord) -> None:
        if self._prefix is not None and (r.blocks or r.prefix_load is not None):
            self._prefix.release_request(r)
        self.device_pool.release(r.rid, r.device)
        self.host_pool.release(r.rid, r.host)
        if r.disk is not None:
            self._disk_call("release", r.disk)  # also forgets its committed entry
        r.device, r.host, r.disk, r.index = [], [], None, None

    def _disk_call(self, name: str, extent) -> bool:
        """``disk.release`` / ``disk.uncommit`` on the step path: a fault is logged, never raised.

        The ledger changes before the manifest is rewritten, so a failed
        rewrite leaves the chunks quarantined until the next good one."""
        try:
            getattr(self.disk, name)(extent)
            return True
        except Exception as exc:
            self.stats.disk_release_faults += 1
            log.error("disk %s of extent %s failed: %s: %s", name,
                      getattr(extent, "chunks", extent), type(exc).__name__, exc)
            return False

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
            return ADMIT_OK
        if r.state is S.LOST:
            return AdmitOutcome(False, f"lost: {r.lost_reason}")
        return AdmitOutcome(False, r.state.value)

    def _cancel_offload(self, r: RequestRecord) -> None:
        """The request is wanted again before its offload copy started: take
        the copy back (a copy already running is left to finish)."""
        if not r.job.future.cancel():
            return
        self.host_pool.release(r.rid, r.host)
        if r.disk is not None:
            self._disk_call("release", r.disk)
        move = r.job.move
        r.host, r.disk, r.job = [], None, None
        self._inflight.discard(r.rid)
        self._set_state(r, S.RESIDENT)
        self.stats.offloads_cancelled += 1
        self._unreported.append(TransferResult(
            r.rid, move, False, 0, S.RESIDENT, CANCELLED))

    # -- eviction hooks -------------------------------------------------------------

    @property
    def supports_eviction(self):
        return True

    def reclaimable(self, rid: str) -> int:
        r = self._req(rid, "reclaimable")
        if r.state is not S.RESIDENT or not r.device:
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
                len(r.device) if r.state is S.RESIDENT else 0
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

    def offload_destination(self, rid: str) -> Tier | None:
        """Where an offload in flight is copying to: HOST, or DISK when the host was full."""
        r = self._req(rid, "offload_destination")
        if r.state is S.OFFLOADING:
            return Tier.DISK if r.disk is not None else Tier.HOST
        return r.state.tier

    def get_offload_priority(self, rid: str) -> float:
        """``retention_offload_priority`` of the request's retention: a request
        the serving layer wants kept is a poor victim; an expired retention
        falls back to the default."""
        r = self._req(rid, "get_offload_priority")
        o = r.overrides or NO_OVERRIDES
        return retention_offload_priority(
            o.retention_priority, o.retention_expiry_s, self._clock() - r.ingested_at
        )

    def is_offloaded(self, rid: str) -> bool:
        return self._req(rid, "is_offloaded").state in OFFLOADED_STATES

    def can_reload(self, rid: str) -> bool:
        return self._req(rid, "can_reload").state in RELOADABLE_STATES

    def reload_bytes(self, rid: str) -> int:
        r = self._req(rid, "reload_bytes")
        if r.state not in OFFLOADED_STATES:
            return 0
        if r.prefix_load is not None:
            return len(r.prefix_load.positions) * self.geometry.page_bytes
        return self._pages_for(r) * self.geometry.page_bytes

    def _submit(self, ex: PriorityExecutor, prio: int, fn, *args) -> cf.Future | None:
        """Queue a job; None (logged) when the executor refuses it, so the caller undoes its reservation."""
        try:
            return ex.submit(prio, fn, *args)
        except RuntimeError as exc:
            log.error("could not queue a copy: %s", exc)
            return None

    def offload(self, rid: str) -> int:
        """Start moving a resident request to host (or straight to disk when the
        host is full and that is allowed). Returns the device bytes it will
        free; 0 (nothing changed) when no tier below has room, or when the
        request holds no pages (nothing to move)."""
        r = self._req(rid, "offload")
        if r.state is not S.RESIDENT:
            raise IllegalTransition(
                f"offload: request {rid!r} is {r.state.value}; only a resident request offloads"
            )
        n = len(r.device)
        if n == 0:
            return 0
        freed = n * self.geometry.page_bytes
        marker = self._streams.compute_marker()
        if self._prefix is not None:
            self._prefix.ensure_host(n)  # cached blocks make way for a live request
        host = self.host_pool.allocate(rid, n)
        if host is not None:
            fut = self._submit(
                self._d2h, OFFLOAD, self._job_offload_host, list(r.device), list(host), marker
            )
            if fut is None:
                self.host_pool.release(rid, host)
                return 0
            r.host = host
            self._start(r, Move.OFFLOAD_TO_HOST, fut, S.OFFLOADING)
            return freed
        if self.disk is not None and self.offload_to_disk_when_host_full:
            extent = self.disk.reserve(rid, n)
            if extent is not None:
                fut = self._submit(
                    self._io, WRITE, self._job_offload_disk, list(r.device), extent, marker
                )
                if fut is None:
                    self._disk_call("release", extent)
                    return 0
                r.disk = extent
                self._start(r, Move.OFFLOAD_TO_DISK, fut, S.OFFLOADING)
                return freed
        self.stats.offload_refusals += 1
        return 0

    def demote(self, rid: str) -> bool:
        """Start moving an on-host request to disk. False (nothing changed)
        when there is no disk tier or it cannot take the request."""
        r = self._req(rid, "demote")
        if r.state is not S.ON_HOST:
            raise IllegalTransition(
                f"demote: request {rid!r} is {r.state.value}; only an on-host request demotes"
            )
        if self.disk is None or not r.host:
            return False
        extent = self.disk.reserve(rid, len(r.host))
        if extent is None:
            self.stats.demote_refusals_disk_full += 1
            return False
        fut = self._submit(self._io, WRITE, self._job_demote, list(r.host), extent)
        if fut is None:
            self._disk_call("release", extent)
            return False
        r.disk = extent
        self._start(r, Move.DEMOTE, fut, S.DEMOTING)
        return True

    def reload(self, rid: str) -> bool:
        """Start bringing an offloaded request back. False (nothing changed)
        when the device pool cannot hold it yet.

        The copy waits on a compute-stream marker recorded now: the slots it
        writes may just have been freed by ``remove_request`` while kernels
        queued for their previous owner still use them."""
        r = self._req(rid, "reload")
        if r.state not in (S.ON_HOST, S.ON_DISK):
            raise IllegalTransition(
                f"reload: request {rid!r} is {r.state.value}; only an offloaded request reloads"
            )
        if r.prefix_load is not None:
            return self._reload_prefix(r)
        n = self._pages_for(r)
        if self._prefix is not None:
            self._prefix.ensure_device(n)
        slots = self.device_pool.allocate(rid, n)
        if slots is None:
            self.stats.reload_refusals += 1
            return False
        marker = self._streams.compute_marker()
        if r.state is S.ON_HOST:
            move = Move.RELOAD_FROM_HOST
            fut = self._submit(self._h2d, RELOAD, self._job_reload_host, list(r.host), list(slots),
                               r.checksum, marker)
        else:
            move = Move.RELOAD_FROM_DISK
            fut = self._submit(self._io, RELOAD, self._job_reload_disk, r.disk, list(slots),
                               r.checksum, marker)
        if fut is None:
            self.device_pool.release(rid, slots)
            return False
        r.device = slots
        r.index = None
        self._start(r, move, fut, S.RELOADING)
        return True

    def drop(self, rid: str) -> None:
        """Give up an offloaded request's KV (the worker will recompute it)."""
        r = self._req(rid, "drop")
        if r.state not in (S.ON_HOST, S.ON_DISK):
            raise IllegalTransition(
                f"drop: request {rid!r} is {r.state.value}; only an offloaded request is dropped"
            )
        self.stats.dropped += 1
        self._mark_lost(r, "dropped")

    # -- jobs (worker threads: bytes only, no records) ------------------------------

    def _job_offload_host(self, dev_slots, host_slots, marker):
        copy_runs(self._streams, self._dev, self._host, coalesce(dev_slots, host_slots), "d2h",
                  after=marker, fault_hook=self._fault)
        return crc_of_pages(self._host, host_slots) if self.verify else None

    def _job_offload_disk(self, dev_slots, extent, marker):
        if self._stage:
            return self._staged_write(dev_slots, extent, marker)
        crc = 0  # a CPU device: each run of pages goes to disk from where it lies
        for r in coalesce(dev_slots, range(len(dev_slots))):
            self._fault("d2h")
            pages = self._dev[r.src : r.src + r.length]
            crc = crc_of(pages, crc) if self.verify else 0
            self.disk.write(extent, pages, first_page=r.dst)
        return crc if self.verify else None

    def _job_demote(self, host_slots, extent):
        # the request's host slots stay its own until the write completes; each
        # run of host pages is written from where it lies
        for r in coalesce(host_slots, range(len(host_slots))):
            self.disk.write(extent, self._host[r.src : r.src + r.length], first_page=r.dst)

    def _job_reload_host(self, host_slots, dev_slots, checksum, marker):
        if checksum is not None and crc_of_pages(self._host, host_slots) != checksum:
            raise ChecksumMismatch("host copy does not match the checksum taken at offload")
        return copy_runs(self._streams, self._host, self._dev, coalesce(host_slots, dev_slots),
                         "h2d", after=marker, fault_hook=self._fault)

    def _job_reload_disk(self, extent, dev_slots, checksum, marker):
        if self._stage:
            crc = self._staged_read(extent, dev_slots, marker)
        else:
            # a CPU device: straight into the destination; the slots are this
            # reload's own and are not readable until the completion lands
            crc = 0
            for r in coalesce(range(len(dev_slots)), dev_slots):
                self._fault("h2d")
                dst = self._dev[r.dst : r.dst + r.length]
                self.disk.read(extent, dst, first_page=r.src)
                crc = crc_of(dst, crc) if checksum is not None else 0
        if checksum is not None and crc != checksum:
            raise ChecksumMismatch("disk copy does not match the checksum taken at offload")
        return None

    def _acquire_staging(self) -> torch.Tensor:
        buf = self._ring.acquire()
        if buf is None:
            raise StagingTimeout(
                f"no staging buffer came free within {self._ring.config.timeout_s}s"
            )
        return buf

    def _staged_write(self, dev_slots, extent, marker):
        """Device pages to disk through the ring, a piece at a time: the copy
        of piece i+1 is queued before piece i is written."""
        P, n = self._ring.pages, len(dev_slots)
        crc = 0
        pending: list[tuple[torch.Tensor, int, int, Any]] = []  # (buf, first page, count, event)
        held: list[torch.Tensor] = []

        def drain_one() -> None:
            nonlocal crc
            buf, p, k, ev = pending.pop(0)
            if ev is not None:
                ev.synchronize()
            if self.verify:
                crc = crc_of(buf[:k], crc)
            self.disk.write(extent, buf[:k], first_page=p)
            held.remove(buf)
            self._ring.release(buf)

        try:
            for p in range(0, n, P):
                k = min(P, n - p)
                if pending and self._ring.free_count() == 0:
                    drain_one()  # never wait for a buffer this job itself holds
                buf = self._acquire_staging()
                held.append(buf)
                ev = issue_runs(self._streams, self._dev, buf,
                                coalesce(dev_slots[p : p + k], range(k)), "d2h",
                                after=marker if p == 0 else None, fault_hook=self._fault)
                pending.append((buf, p, k, ev))
                if len(pending) > 1:
                    drain_one()
            while pending:
                drain_one()
        finally:
            for _, _, _, ev in pending:  # fence copies still queued before the buffers go back
                if ev is not None:
                    ev.synchronize()
            for buf in held:
                self._ring.release(buf)
        return crc if self.verify else None

    def _staged_read(self, extent, dev_slots, marker) -> int:
        """Disk pages to the device through the ring, a piece at a time: piece
        i+1 is read while piece i is being copied. Returns the crc of all pages."""
        P, n = self._ring.pages, len(dev_slots)
        crc = 0
        pending: list[tuple[torch.Tensor, Any]] = []
        try:
            for p in range(0, n, P):
                k = min(P, n - p)
                if len(pending) > 1 or (pending and self._ring.free_count() == 0):
                    # at most two pieces in flight per job, and never wait for
                    # a buffer this job itself holds
                    buf, ev = pending.pop(0)
                    if ev is not None:
                        ev.synchronize()
                    self._ring.release(buf)
                buf = self._acquire_staging()
                pending.append((buf, None))
                self.disk.read(extent, buf[:k], first_page=p)
                crc = crc_of(buf[:k], crc)
                ev = issue_runs(self._streams, buf, self._dev,
                                coalesce(range(k), dev_slots[p : p + k]), "h2d",
                                after=marker if p == 0 else None, fault_hook=self._fault)
                pending[-1] = (buf, ev)
        finally:
            for buf, ev in pending:  # every copy has finished before a slot or buffer is freed
                if ev is not None:
                    ev.synchronize()
                self._ring.release(buf)
        return crc

    # -- completion (caller's thread) -------------------------------------------------

    def _start(self, r: RequestRecord, move: Move, fut: cf.Future, state: RequestState) -> None:
        check_transition(r.rid, r.state, state)
        r.state = state
        r.job = TransferJob(move, fut, self._clock())
        self._inflight.add(r.rid)

    def _set_state(self, r: RequestRecord, state: RequestState) -> None:
        check_transition(r.rid, r.state, state)
        r.state = state

    def poll(self) -> list[TransferResult]:
        """Apply every finished transfer; returns what each did, in the order
        applied (a removed request's finished copy has ``state=None``).
        Never raises for a fault in a transfer or its completion."""
        self._open("poll")
        if self._prefix is not None:
            self._prefix.poll_shared()  # the shared cold tier: finished fetches and publishes
        if self._prefix is not None and self._prefix.orphans:
            self._prefix.poll_orphans()
        done, self._unreported = self._unreported, []
        for rid in [rid for rid in self._inflight if self._reqs[rid].job.future.done()]:
            res = self._finish(self._reqs[rid])
            if res is not None:
                done.append(res)
        for key in [k for k, t in self._tombstones.items() if t.future.done()]:
            done.append(self._bury(self._tombstones.pop(key)))
        if done and self._feeds:
            self._feeds = [f for f in self._feeds if not f.closed]
            for f in self._feeds:
                f.put(done)
        return done

    def completion_feed(self) -> CompletionFeed:
        """A feed that receives every record ``poll`` (or ``synchronize``) reports
        from now on, whoever calls them; the controller settles from one."""
        self._open("completion_feed")
        feed = CompletionFeed()
        self._feeds.append(feed)
        return feed

    def _bury(self, t: Tombstone) -> TransferResult:
        exc = t.future.exception() if not t.future.cancelled() else None
        self.device_pool.release(t.key, t.device)
        self.host_pool.release(t.key, t.host)
        if t.disk is not None:
            self._disk_call("release", t.disk)
        nbytes = self._extent_bytes(t) if exc is None else 0
        return TransferResult(t.rid, t.move, exc is None, nbytes, None,
                              None if exc is None else _why(exc))

    def _extent_bytes(self, t: Tombstone) -> int:
        n = len(t.device) or len(t.host) or (t.disk.num_pages if t.disk is not None else 0)
        return n * self.geometry.page_bytes

    def _finish_now(self, r: RequestRecord) -> None:
        """Apply ``r``'s finished job outside ``poll``; the next ``poll`` reports it."""
        res = self._finish(r)
        if res is not None:
            self._unreported.append(res)

    def _finish(self, r: RequestRecord) -> TransferResult | None:
        """Apply the outcome of ``r``'s finished job (None if still running).

        Exception-safe: whatever a completion handler raises, the request ends
        in a consistent state (at its source, or LOST with the reason) and the
        error is logged and counted, never raised."""
        job = r.job
        if job is None or not job.future.done():
            return None
        r.job = None
        self._inflight.discard(r.rid)
        exc = job.future.exception()
        try:
            if r.load_work is not None:
                return self._done_prefix_load(r, job, exc)
            return self._completions[job.move](r, job, exc)
        except Exception as err:  # a bug or an unexpected fault: keep the records consistent
            self.stats.completion_errors += 1
            log.exception("request %r: completing %s failed", r.rid, job.move.value)
            reason = f"completing {job.move.value} failed: {_why(err)}"
            if r.state is not S.LOST:
                try:
                    self._mark_lost(r, reason)
                except Exception:  # records already broken: leave it to check_integrity
                    log.exception("request %r: could not mark it lost", r.rid)
            return TransferResult(r.rid, job.move, False, 0, r.state, reason)

    def _nbytes(self, r: RequestRecord) -> int:
        return self._pages_for(r) * self.geometry.page_bytes

    def _done_offload_host(self, r, job, exc):
        if exc is not None:
            return self._survived(r, job, S.RESIDENT, "offload_failures", exc)
        r.checksum = job.future.result()
        nbytes = self._free_source(r, Tier.DEVICE)
        return self._land(r, job, S.ON_HOST, "offloads_to_host", "bytes_device_to_host", nbytes)

    def _done_offload_disk(self, r, job, exc):
        if exc is not None:
            return self._survived(r, job, S.RESIDENT, "offload_failures", exc)
        checksum = job.future.result()
        err = self._commit_disk(r, checksum)
        if err is not None:
            return self._survived(r, job, S.RESIDENT, "offload_failures", err)
        r.checksum = checksum
        nbytes = self._free_source(r, Tier.DEVICE)
        return self._land(r, job, S.ON_DISK, "offloads_to_disk", "bytes_device_to_disk", nbytes)

    def _done_demote(self, r, job, exc):
        if exc is not None:
            return self._survived(r, job, S.ON_HOST, "demote_failures", exc)
        err = self._commit_disk(r, r.checksum)
        if err is not None:
            return self._survived(r, job, S.ON_HOST, "demote_failures", err)
        nbytes = self._free_source(r, Tier.HOST)
        return self._land(r, job, S.ON_DISK, "demotions", "bytes_host_to_disk", nbytes)

    def _done_reload_host(self, r, job, exc):
        if isinstance(exc, ChecksumMismatch):
            return self._lost(r, job, f"checksum mismatch on reload from host: {exc}")
        if exc is not None:
            return self._survived(r, job, S.ON_HOST, "reload_failures", exc)
        r.ready_event = job.future.result()
        nbytes = self._free_source(r, Tier.HOST)
        self.stats.reload_stall_s_total += max(0.0, self._clock() - job.started)
        return self._land(r, job, S.RESIDENT, "reloads_from_host", "bytes_host_to_device", nbytes)

    def _done_reload_disk(self, r, job, exc):
        if isinstance(exc, StagingTimeout) or (
            exc is not None and not isinstance(exc, (OSError, ChecksumMismatch))
        ) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_IO_ERRNOS):
            # nothing was read wrong: the bytes are still on disk (a miss now, a retry later)
            return self._survived(r, job, S.ON_DISK, "reload_failures", exc)
        if exc is not None:
            return self._lost(r, job, f"reload from disk failed: {_why(exc)}")
        r.ready_event = job.future.result()
        nbytes = self._free_source(r, Tier.DISK)
        self.stats.reload_stall_s_total += max(0.0, self._clock() - job.started)
        return self._land(r, job, S.RESIDENT, "reloads_from_disk", "bytes_disk_to_device", nbytes)

    def _free_source(self, r: RequestRecord, tier: Tier) -> int:
        """Give back the tier a completed copy read from; returns the bytes moved."""
        nbytes = self._nbytes(r)
        if tier is Tier.DEVICE:
            self.device_pool.release(r.rid, r.device)
            r.device, r.index = [], None
        elif tier is Tier.HOST:
            self.host_pool.release(r.rid, r.host)
            r.host = []
        elif tier is Tier.DISK:
            extent, r.disk = r.disk, None
            self._disk_call("release", extent)
        else:  # pragma: no cover - Tier has three members
            raise ValueError(f"unknown tier {tier!r}")
        return nbytes

    def _land(self, r, job, state: RequestState, count: str, link: str, nbytes: int):
        """A completed move: the new state and its counters."""
        self._set_state(r, state)
        setattr(self.stats, count, getattr(self.stats, count) + 1)
        setattr(self.stats, link, getattr(self.stats, link) + nbytes)
        return TransferResult(r.rid, job.move, True, nbytes, state)

    def _commit_disk(self, r: RequestRecord, checksum) -> BaseException | None:
        """Commit the written extent; the exception (logged, counted) when that fails."""
        try:
            self.disk.commit(r.rid, r.disk, {"num_tokens": r.num_tokens, "checksum": checksum})
            return None
        except Exception as exc:
            self.stats.commit_failures += 1
            return exc

    def _survived(self, r, job, back_to, counter, exc):
        """A failed copy or write: give back the destination, stay at the source."""
        log.warning("request %r: %s failed, kept where it was: %s", r.rid, job.move.value, _why(exc))
        dest = job.move.destination
        if dest is Tier.HOST:
            self.host_pool.release(r.rid, r.host)
            r.host = []
        elif dest is Tier.DISK:
            extent, r.disk = r.disk, None
            if extent is not None:
                self._disk_call("release", extent)
        else:
            self.device_pool.release(r.rid, r.device)
            r.device, r.index = [], None
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self._set_state(r, back_to)
        return TransferResult(r.rid, job.move, False, 0, back_to, _why(exc))

    def _lost(self, r, job, reason: str) -> TransferResult:
        self._mark_lost(r, reason)
        return TransferResult(r.rid, job.move, False, 0, S.LOST, reason)

    def _mark_lost(self, r: RequestRecord, reason: str) -> None:
        log.error("request %r lost: %s", r.rid, reason)
        self._release_all(r)
        r.lost_reason = reason
        r.checksum = None
        self._set_state(r, S.LOST)
        if reason != "dropped":
            self.stats.lost += 1
        self._newly_lost.append((r.rid, reason))

    def synchronize(self, timeout: float = 60.0) -> list[TransferResult]:
        """Wait for every transfer in flight, then apply them all; returns what
        was applied (as ``poll``). Raises TimeoutError naming what is still in
        flight after ``timeout`` seconds (after applying what did finish)."""
        self._open("synchronize")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"synchronize: timeout must be a number of seconds >= 0, got {timeout!r}")
        futs = [self._reqs[rid].job.future for rid in self._inflight]
        futs += [t.future for t in self._tombstones.values()]
        if self._prefix is not None:
            futs += [f for f, _ in self._prefix.orphans]
            timeout = self._prefix.wait_shared(timeout)  # the shared tier's fetches and publishes
        _, pending = cf.wait(futs, timeout=timeout)
        done = self.poll()
        if pending:
            raise TimeoutError(
                f"synchronize: {len(pending)} transfer(s) still in flight after {timeout}s:"
                f" {sorted(self._inflight)[:10]}"
            )
        return done

    def in_flight(self) -> int:
        self._open("in_flight")
        orphans = len(self._prefix.orphans) if self._prefix is not None else 0
        return len(self._inflight) + len(self._tombstones) + orphans

    # -- prefix reuse (resources.kv_prefix) -------------------------------------------

    prefix_skip_safe = True  # a hit only skips tokens whose K/V the cache already holds

    def enable_prefix_cache(self, root, walks=None, *, policy: str = "lru",
                            disk_batch_pages: int = 16, shared=None,
                            shared_refresh_s: float = 10.0) -> bool:
        """Open the block store under ``root`` (16 bytes, or a ``tiering.blocks.KeyRoot``).

        ``policy`` names the block retention policy of every tier
        (``policies.blocks.make_block_policy``); ``disk_batch_pages`` is how many
        blocks one host -> disk write packs. ``shared`` (a
        ``tiering.coldtier.SharedTierConfig``, ``SharedBlockStore`` or ``BlockQueue``)
        adds the shared cold tier: published blocks are written there, and an
        attach that misses locally fetches blocks other workers published
        (``docs/coldtier.md``); its index of what exists is refreshed every
        ``shared_refresh_s`` seconds of the cache's clock, from ``poll``. Enabling
        twice with another root, or with a shared tier the first call did not
        have, is an error; with the same root it does nothing. ``walks`` is
        accepted for the engine contract and not used (every walk's writes are keyed)."""
        self._open("enable_prefix_cache")
        del walks
        key = as_root(root)
        if self._prefix is not None:
            if self._prefix.root != key:
                raise ValueError("enable_prefix_cache: already enabled under another root")
            if shared is not None and (self._prefix.shared is None
                                       or not self._prefix.shared.same_source(shared)):
                raise ValueError("enable_prefix_cache: already enabled; a shared tier is given at the first call")
            return True
        self._prefix = PrefixCache(self, key, policy, disk_batch_pages, shared, shared_refresh_s)
        return True

    @property
    def prefix_enabled(self) -> bool:
        return self._prefix is not None

    def _prefix_on(self, what: str) -> PrefixCache:
        self._open(what)
        if self._prefix is None:
            raise RuntimeError(f"{what}: the prefix cache is not enabled (call enable_prefix_cache)")
        return self._prefix

    @staticmethod
    def _token_array(what: str, token_ids) -> np.ndarray:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        arr = np.asarray(token_ids)
        if arr.ndim != 1:
            raise ValueError(f"{what}: token_ids must be one-dimensional, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"{what}: token_ids must be integers, got dtype {arr.dtype}")
        if arr.size and int(arr.min()) < 0:
            raise ValueError(f"{what}: token_ids must be >= 0, got {int(arr.min())}")
        return arr

    def publish_prefix(self, rid: str, token_ids) -> int:
        """Key the request's full pages of ``token_ids`` (its first tokens); idempotent.

        Published pages become cached blocks the request maps; they are
        immutable (``write`` into them raises). A page whose key is already
        cached on the device is replaced by that block (the request's copy is
        freed); publishing stops at a key cached on another tier. Returns the
        tokens the request now maps as blocks."""
        p = self._prefix_on("publish_prefix")
        r = self._req(rid, "publish_prefix")
        arr = self._token_array(f"publish_prefix({rid!r})", token_ids)
        if r.state is not S.RESIDENT or r.prefix_load is not None:
            raise IllegalTransition(
                f"publish_prefix: request {rid!r} is {r.state.value}; it must be resident"
            )
        return p.publish(r, arr) * self.geometry.page_tokens

    def cached_prefix(self, token_ids) -> PrefixHit:
        """How many leading tokens of ``token_ids`` are cached, and per tier. Changes nothing."""
        p = self._prefix_on("cached_prefix")
        return p.lookup(self._token_array("cached_prefix", token_ids))

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
        p = self._prefix_on("attach_prefix")
        r = self._req(rid, "attach_prefix")
        arr = self._token_array(f"attach_prefix({rid!r})", token_ids)
        if r.state is not S.RESIDENT or r.num_tokens or r.device or r.blocks:
            raise IllegalTransition(
                f"attach_prefix: request {rid!r} already holds tokens; attach only a fresh request"
            )
        r.chain_tokens = arr.tolist()
        n = p.attach(r, arr)
        if r.prefix_load is not None:
            on_host = Tier.HOST in r.prefix_load.tiers
            r.state = S.ON_HOST if on_host else S.ON_DISK  # offloaded for the pages to load
        return n

    def prefix_stats(self) -> dict[str, int]:
        """Counters of the block store: hit tokens per tier, blocks moved, dropped, ..."""
        p = self._prefix_on("prefix_stats")
        out = dict(p.stats)
        out["blocks_cached"] = len(p.index)
        for t in Tier:
            out.setdefault(f"hit_tokens_{t.value}", 0)
            out[f"blocks_on_{t.value}"] = p.index.count(t)
        for name in p.shared_counters():
            out.setdefault(name, 0)
        return out

    def _reload_prefix(self, r: RequestRecord) -> bool:
        p = self._prefix
        if p.fetch_pending(r):  # a block is still on its way from the shared tier: not yet
            p.stats["shared_reload_waits"] += 1
            return False
        k = len(r.prefix_load.positions)
        p.ensure_device(k)
        pages = self.device_pool.allocate(BLOCKS, k)
        if pages is None:
            self.stats.reload_refusals += 1
            return False
        work = p.start_load(r, pages)
        move = Move.RELOAD_FROM_HOST if r.state is S.ON_HOST else Move.RELOAD_FROM_DISK
        marker = self._streams.compute_marker()
        fut = self._submit(self._io, RELOAD, p.load_job, work, self._fault, marker)
        if fut is None:
            p.finish_load(None, work, ["not queued"] * len(work))
            return False
        r.load_work = work
        self._start(r, move, fut, S.RELOADING)
        return True

    def _done_prefix_load(self, r, job, exc):
        p = self._prefix
        work, r.load_work = r.load_work, None
        results = job.future.result() if exc is None else [f"read_failed: {_why(exc)}"] * len(work)
        kept, reason = p.finish_load(r, work, results)
        positions, cut = r.prefix_load.positions, r.prefix_load.failed
        r.prefix_load = None
        reason = reason or cut  # blocks cut before the load (a failed shared fetch)
        if kept < len(work):
            p.truncate(r, positions[kept], reason)
        self._set_state(r, S.RESIDENT)
        nbytes = kept * self.geometry.page_bytes
        self.stats.reload_stall_s_total += max(0.0, self._clock() - job.started)
        return TransferResult(r.rid, job.move, reason is None, nbytes, S.RESIDENT, reason)

    # the engine's prefix hooks, on the calls above (one rank: no TP lease)

    @property
    def keys_prefix_chains(self) -> bool:
        return self._prefix is not None

    def fingerprint(self) -> bytes | None:
        """The geometry (layout and dtype of a page): what a stored page depends on here."""
        return self.geometry.fingerprint().encode()

    def resolve_cached_prefix(self, rid, node_name, graph_walk, inputs) -> CachedPrefix | None:
        if self._prefix is None:
            return None
        arr = self._token_array("resolve_cached_prefix", inputs)
        T = self.geometry.page_tokens
        tokens = min(self.cached_prefix(arr).tokens, max(0, (arr.size - 1) // T) * T)
        return CachedPrefix(graph_walk, tokens, tokens)

    def apply_cached_prefix(self, rid, node_name, graph_walk, inputs, prefix) -> None:
        if self._prefix is None:
            return
        arr = self._token_array("apply_cached_prefix", inputs)
        r = self._req(rid, "apply_cached_prefix")
        if prefix is None or prefix.tokens == 0:
            r.chain_tokens = arr.tolist()
            return
        got = self.attach_prefix(rid, arr[: prefix.tokens + 1])
        r.chain_tokens = arr.tolist()
        if got < prefix.tokens:
            log.info("request %r: %d of %d agreed prefix tokens attached", rid, got, prefix.tokens)

    def extend_prefix_chain(self, rid, node_name, graph_walk, outputs) -> None:
        if self._prefix is None:
            return
        r = self._req(rid, "extend_prefix_chain")
        r.chain_tokens.extend(self._token_array("extend_prefix_chain", outputs).tolist())
        if r.state is S.RESIDENT and r.prefix_load is None:
            n = min(len(r.chain_tokens), r.num_tokens)
            self.publish_prefix(rid, r.chain_tokens[:n])

    def complete_cached_walk(self, rid, node_name, graph_walk) -> None:
        return

    # -- integrity --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Every slot of every tier is free, held by exactly one request, or
        held by a removed request's copy still in flight; each request holds
        exactly what its state allows; ledgers equal the slots they count."""
        self._open("check_integrity")
        problems = []
        dev: dict = {}
        host: dict = {}
        pages = self.geometry.pages_for
        for rid, r in self._reqs.items():
            dev[rid], host[rid] = r.device, r.host
            need = pages(r.num_tokens) - len(r.shared)
            st = r.state
            has = (bool(r.device), bool(r.host), r.disk is not None)
            allowed = {
                S.RESIDENT: {(True, False, False)},
                S.OFFLOADING: {(True, True, False), (True, False, True)},
                S.ON_HOST: {(False, True, False)},
                S.DEMOTING: {(False, True, True)},
                S.ON_DISK: {(False, False, True)},
                S.RELOADING: {(True, True, False), (True, False, True)},
                S.LOST: {(False, False, False)},
            }[st]
            if need == 0 and st is not S.LOST:
                allowed = allowed | {(False, False, False)}
            if r.prefix_load is not None:  # a pending prefix load holds only mapped blocks
                allowed = {(False, False, False)}
                if st not in (S.ON_HOST, S.ON_DISK, S.RELOADING):
                    problems.append(f"{rid}: a pending prefix load in state {st.value}")
                if (r.load_work is not None) != (st is S.RELOADING):
                    problems.append(f"{rid}: load in flight {r.load_work is not None}, state {st.value}")
            if has not in allowed:
                problems.append(f"{rid}: state {st.value} holds device/host/disk {has}")
            if st is S.RESIDENT and len(r.device) != need:
                problems.append(f"{rid}: {len(r.device)} device pages for {r.num_tokens} tokens")
            for name, slots in (("device", r.device), ("host", r.host)):
                if slots and len(slots) != need:
                    problems.append(f"{rid}: {len(slots)} {name} pages, needs {need}")
            if st.in_flight != (r.job is not None) or st.in_flight != (rid in self._inflight):
                problems.append(f"{rid}: state {st.value} but job={r.job is not None}")
            if r.index is not None and r.index.tolist() != r.shared + r.device:
                problems.append(f"{rid}: device page table {r.index.tolist()} != slots {r.shared + r.device}")
            if self._prefix is None and (r.blocks or r.shared):
                problems.append(f"{rid}: maps prefix blocks with no prefix cache")
            if r.disk is not None and r.disk.num_pages != need:
                problems.append(f"{rid}: disk extent of {r.disk.num_pages} pages, needs {need}")
        for key, t in self._tombstones.items():
            dev[key], host[key] = t.device, t.host
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

    # -- engine lifecycle -----------------------------------------------------------

    def cleanup(self, timeout: float = 30.0) -> None:
        """Finish (or, after ``timeout``, abandon) transfers and stop the worker
        threads; then close the disk tier and unpin the host slab. Calling it
        again does nothing; every other call afterwards raises CacheClosed."""
        if self._closed:
            return
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


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
