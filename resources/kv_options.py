"""The scalar settings of ``PagedKVCache``, checked once when it is built, and the
context its parts share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tiering.core.staging import StagingConfig
from tiering.core.validate import check_clock, check_threads, check_timeout

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.kv_records import KVStats
    from tiering.resources.kv_storage import KVStorage
    from tiering.resources.kv_stream import StreamBuffer

    from tiering.core.lifecycle import Lifecycle


@dataclass(frozen=True)
class KVOptions:
    """``PagedKVCache``'s keyword settings; a bad one raises ValueError naming it."""

    device_pages: int
    host_pages: int
    verify: bool
    offload_to_disk_when_host_full: bool
    copy_workers: int
    io_workers: int
    clock: Callable[[], float]
    copy_fault_hook: Callable[[str], None]
    disk_wrap_store: Callable[[Any], Any] | None
    staging: StagingConfig | None
    stage_disk_io: bool | None
    layerwise_reload: bool
    layer_wait_timeout_s: float
    stream_window_pages: int
    stream_buffer_pages: int

    def __post_init__(self) -> None:
        if self.staging is not None and not isinstance(self.staging, StagingConfig):
            raise ValueError(f"staging must be a StagingConfig or None, got {type(self.staging).__name__}")
        for name in ("device_pages", "host_pages", "copy_workers", "io_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PagedKVCache: {name} must be an int >= 1, got {v!r}")
            if name.endswith("_workers"):
                check_threads(f"PagedKVCache: {name}", v)
        for name in ("verify", "offload_to_disk_when_host_full", "layerwise_reload"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"PagedKVCache: {name} must be a bool, got {v!r}")
        window, ring = self.stream_window_pages, self.stream_buffer_pages
        for name, v in (("stream_window_pages", window), ("stream_buffer_pages", ring)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"PagedKVCache: {name} must be an int >= 0, got {v!r}")
        if (window == 0) != (ring == 0):
            raise ValueError(
                "PagedKVCache: stream_window_pages and stream_buffer_pages are both 0 (no"
                f" streaming) or both >= 1, got {window} and {ring}")
        if window and window + ring >= self.device_pages:
            raise ValueError(
                f"PagedKVCache: stream_window_pages ({window}) plus"
                f" stream_buffer_pages ({ring}) must leave device pages for other"
                f" requests (device_pages={self.device_pages})")
        if self.stage_disk_io is not None and not isinstance(self.stage_disk_io, bool):
            raise ValueError(f"PagedKVCache: stage_disk_io must be a bool or None, got {self.stage_disk_io!r}")
        if not callable(self.copy_fault_hook):
            raise ValueError(
                f"PagedKVCache: copy_fault_hook must be callable, got {self.copy_fault_hook!r}")
        check_clock("PagedKVCache", self.clock, ValueError)
        if self.disk_wrap_store is not None and not callable(self.disk_wrap_store):
            raise ValueError(f"PagedKVCache: disk_wrap_store must be callable or None, got {self.disk_wrap_store!r}")
        object.__setattr__(self, "layer_wait_timeout_s", check_timeout(
            "PagedKVCache: layer_wait_timeout_s", self.layer_wait_timeout_s))


class KVContext(NamedTuple):
    """What every part of ``PagedKVCache`` is built on: the request records, the
    counters, the tiers' storage, the streaming ring (or None) and the settings.
    Each part takes from it what it reads and owns none of it."""

    life: Lifecycle
    stats: KVStats
    storage: KVStorage
    stream: StreamBuffer | None
    options: KVOptions
