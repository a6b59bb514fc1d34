"""Per-request records of the KV cache and its counters.

Only ``PagedKVCache`` creates and changes these, always on the caller's
thread; worker threads never see them.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Any

from resources.base import ResourceReqConfig
from tiering.errors import CacheClosed, RequestLost, UnknownRequest  # noqa: F401 (re-exported from its old home)
from tiering.types import Move, RequestState

S = RequestState


@dataclass
class TransferJob:
    """A transfer in flight for one request."""

    move: Move
    future: cf.Future
    started: float


@dataclass
class RequestRecord:
    rid: str
    overrides: ResourceReqConfig | None
    ingested_at: float
    num_tokens: int = 0
    state: RequestState = S.RESIDENT
    device: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    disk: Any = None  # DiskExtent while the request holds disk chunks
    job: TransferJob | None = None
    checksum: int | None = None
    ready_event: Any = None
    lost_reason: str | None = None
    index: Any = None  # device page table (a long tensor on the device), built on demand
    # prefix reuse (resources.kv_prefix): leading blocks the request maps, their
    # device pages (-1 while a load is pending), a pending load and one in flight
    blocks: list = field(default_factory=list)
    shared: list = field(default_factory=list)
    prefix_load: Any = None
    load_work: Any = None
    chain_tokens: list = field(default_factory=list)


@dataclass
class Tombstone:
    """What a request removed mid-copy still holds until its copy finishes.

    ``key`` is fresh for every tombstone (never the request id, which may be
    ingested again at once); the pools hold the slots under it."""

    key: tuple
    rid: str
    move: Move
    future: cf.Future
    device: list[int]
    host: list[int]
    disk: Any


class KVStats:
    """Counters of moves and faults. Plain integers; ``as_dict`` for reports."""

    FIELDS = (
        "offloads_to_host", "offloads_to_disk", "demotions", "reloads_from_host",
        "reloads_from_disk", "bytes_device_to_host", "bytes_device_to_disk",
        "bytes_host_to_disk", "bytes_host_to_device", "bytes_disk_to_device",
        "offload_refusals", "reload_refusals", "demote_refusals_disk_full",
        "offload_failures", "demote_failures", "reload_failures", "lost", "dropped",
        "offloads_cancelled", "commit_failures", "completion_errors",
        "disk_release_faults", "page_tables_built",
        "reload_stall_s_total",
    )

    def __init__(self) -> None:
        for f in self.FIELDS:
            setattr(self, f, 0)

    def as_dict(self) -> dict[str, float]:
        return {f: getattr(self, f) for f in self.FIELDS}
