"""Where ``PagedKVCache`` keeps bytes: device pages, the host slab, the disk tier.

``KVStorage`` builds and owns the two ``PagePool`` ledgers, the page-first
device tensor, the host slab (pinned once, exactly its size), the disk tier
(a ``DiskPageStore``), the staging ring between a GPU and the disk, the copy
streams and the copy fault hook. It holds no request records; the cache's
other parts read its public attributes.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from tiering.resources.kv_geometry import KVGeometry, parse_device

from tiering.core.lifecycle import Counters
from tiering.core.pinning import HostRuntime, PinnedSlab, pin_host_slab
from tiering.core.pools import PagePool
from tiering.core.staging import StagingConfig, StagingRing
from tiering.core.transfer import StreamSet

log = logging.getLogger("tiering.kv_cache")


def why(exc: BaseException) -> str:
    """An exception as ``Type: message`` (the reason records and logs give)."""
    return f"{type(exc).__name__}: {exc}"


class KVStorage:
    """The cache's tiers and copy streams (see the module doc).

    ``fault`` is read each time a copy runs, so a hook swapped in applies to the
    next copy. A failure while building releases what was built, then raises."""

    def __init__(self, geometry: KVGeometry, device, device_pages: int, host_pages: int, *,
                 stats: Counters, verify: bool, fault: Callable[[str], None], disk=None,
                 disk_store=None, disk_wrap_store: Callable[[Any], Any] | None = None,
                 compute_stream=None, host_runtime: HostRuntime | None = None,
                 staging: StagingConfig | None = None, stage_disk_io: bool | None = None) -> None:
        check_injected(geometry, disk, disk_store, host_runtime)
        self.geometry = geometry
        self.stats = stats
        self.verify = verify
        self.fault = fault
        self.slab: PinnedSlab | None = None
        self.disk = None
        self._opened_disk = disk_store is None  # a given store stays the caller's files
        self.ring: StagingRing | None = None
        self._read_fn: Any = None  # the disk's read last looked at, and whether it takes
        self._read_scratch = False  # out_is_scratch (see read_disk)
        self.device = parse_device("PagedKVCache", device)
        if self.device.type not in ("cpu", "cuda"):  # "meta" holds no bytes; others are untested
            raise ValueError(f"PagedKVCache: device must be a CPU or CUDA device, got {device!r}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for but CUDA is not available")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        pb, shape = geometry.page_bytes, geometry.page_shape
        with _naming_shortage("device_pages", device_pages, pb, self.device):
            self.device_pool = PagePool("device", device_pages, pb)
        with _naming_shortage("host_pages", host_pages, pb, "host"):
            self.host_pool = PagePool("host", host_pages, pb)
        try:
            self.streams = StreamSet(self.device, compute_stream)
            with _naming_shortage("device_pages", device_pages, pb, self.device):
                self.dev = torch.empty((device_pages, *shape), dtype=geometry.dtype,
                                       device=self.device)
            with _naming_shortage("host_pages", host_pages, pb, "host"):
                self.slab = pin_host_slab(
                    (host_pages, *shape), geometry.dtype, self.device, runtime=host_runtime
                )
            self.host = self.slab.tensor
            self.disk = disk_store
            if self.disk is None and disk is not None:
                from tiering.disk.store import DiskPageStore

                self.disk = DiskPageStore(
                    disk, shape, geometry.dtype, fingerprint=geometry.fingerprint(),
                    wrap_store=disk_wrap_store,
                )
            # a GPU's pages reach the disk through the ring; a CPU's go straight
            self.stage = (self.device.type == "cuda") if stage_disk_io is None else bool(stage_disk_io)
            if self.disk is not None and self.stage:
                pin = (lambda t: t.pin_memory()) if self.device.type == "cuda" else None
                ring = staging or StagingConfig()
                with _naming_shortage("staging buffers x pages", ring.buffers * ring.pages, pb,
                                      "host"):
                    self.ring = StagingRing(ring, shape, geometry.dtype, pin=pin)
        except BaseException:
            self.close(joined=True, failed_start=True)
            raise

    def read_disk(self, extent, out: torch.Tensor, first_page: int) -> None:
        """``disk.read`` into ``out``, which the caller throws away if the read fails (a
        staging buffer, a reload's own slots, a temporary): a store whose ``read`` takes
        ``out_is_scratch`` is told so and skips its staging copy. The store's ``read`` is
        looked at on each call, so a wrapped or replaced one is honoured."""
        read = self.disk.read
        fn = getattr(read, "__func__", read)
        if fn is not self._read_fn:
            try:
                params = inspect.signature(read).parameters
            except (TypeError, ValueError):  # a callable without a signature: ask plainly
                params = {}
            self._read_fn, self._read_scratch = fn, "out_is_scratch" in params
        if self._read_scratch:
            read(extent, out, first_page=first_page, out_is_scratch=True)
        else:
            read(extent, out, first_page=first_page)

    def disk_call(self, call: Callable[[Any], Any], extent) -> bool:
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

    def close(self, joined: bool, failed_start: bool = False) -> None:
        """Close the disk tier, then unregister the host slab, but only if every copy
        worker has ``joined`` (a copy may still read it). ``failed_start``: the cache is
        not being built after all; a disk tier it opened itself is discarded (what its
        start created, a preallocated slot file among them, is removed)."""
        if self.disk is not None:
            discard = getattr(self.disk, "discard", None) if failed_start and self._opened_disk \
                else None
            try:
                (discard if callable(discard) else self.disk.close)()
            except Exception as exc:
                log.error("close: the disk tier did not close cleanly: %s", why(exc))
        if self.slab is not None:
            if joined:
                self.slab.release()
            else:
                log.error("close: a copy worker is still running; the host slab stays registered")


#: what the cache calls on a disk store it is given (``DiskPageStore`` has them all)
_STORE_METHODS = ("reattached", "read", "write", "close")


def check_injected(geometry: KVGeometry, disk: Any, disk_store: Any,
                    host_runtime: Any) -> None:
    """A ready-made disk store and a host runtime are refused at the door, before the
    cache takes the store (a refused one stays the caller's, open): a store next to a
    ``disk`` config, one without the store's methods or laid out for other pages, a
    runtime without ``register`` and ``unregister``."""
    if host_runtime is not None and not all(
            callable(getattr(host_runtime, m, None)) for m in ("register", "unregister")):
        raise TypeError(f"PagedKVCache: host_runtime must be a HostRuntime (register, "
                        f"unregister) or None, got {host_runtime!r:.80}")
    if disk_store is None:
        return
    if disk is not None:
        raise ValueError("PagedKVCache: disk (a DiskConfig the cache opens) and disk_store "
                         "(a store already open) both name the disk tier; give one")
    missing = [m for m in _STORE_METHODS if not callable(getattr(disk_store, m, None))]
    if missing:
        raise TypeError(f"PagedKVCache: disk_store must be a DiskPageStore (or offer its "
                        f"methods); {type(disk_store).__name__} lacks {missing}")
    fmt = getattr(disk_store, "format", None)
    shape, dtype = getattr(fmt, "page_shape", None), getattr(fmt, "torch_dtype", None)
    if shape is not None and (tuple(shape) != geometry.page_shape or dtype != geometry.dtype):
        raise ValueError(
            f"PagedKVCache: disk_store holds pages of shape {shape} and dtype {dtype}; this "
            f"cache's pages are {geometry.page_shape} of {geometry.dtype} (give the store "
            "geometry.page_shape and geometry.dtype)")


#: what torch's allocator says when a tensor cannot be had (beside MemoryError itself)
_SHORTAGE_WORDS = ("memory", "bad_alloc", "overflow")


@contextlib.contextmanager
def _naming_shortage(name: str, pages: int, page_bytes: int, where: object):
    """A tier that cannot be allocated raises MemoryError naming the argument and its size
    (torch's own message may be empty)."""
    try:
        yield
    except (MemoryError, RuntimeError, OverflowError) as exc:  # overflow: past the address space
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and not any(w in text for w in _SHORTAGE_WORDS):
            raise
        raise MemoryError(
            f"PagedKVCache: {name}={pages:,} ({pages * page_bytes / 2**30:,.1f} GiB of {where}"
            f" memory) could not be allocated: {type(exc).__name__}: {exc}") from exc
