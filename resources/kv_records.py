"""Per-request records of the KV cache and its counters.

The record is the shared ``tiering.core.lifecycle.Record`` with what the real
cache holds: device and host slot lists and a disk extent, a checksum, a
device page table and the prefix-reuse fields. Only the parts of ``PagedKVCache``
(through its ``Lifecycle``) create and change these, always on the caller's thread;
worker threads never see them.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Any

from tiering.core.lifecycle import Counters, Record
from tiering.errors import CacheClosed, RequestLost, UnknownRequest  # noqa: F401 (re-exported from its old home)
from tiering.types import Move, RequestState


@dataclass
class TransferJob:
    """A transfer in flight for one request (``Lifecycle`` reads ``move`` and ``started``)."""

    move: Move
    future: cf.Future
    started: float


@dataclass(eq=False)
class RequestRecord(Record):
    device: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    disk: Any = None  # DiskExtent while the request holds disk chunks
    checksum: int | None = None
    ready_event: Any = None
    layers: Any = None  # LayerProgress of the reload in flight (tiering.core.layers)
    admitted_early: bool = False  # a step was admitted before that reload landed in full
    undone: str | None = None  # why that step cannot go on (its reload failed); cleared by admit
    head: list = field(default_factory=list)  # a streamed request's host pages before its window
    index: Any = None  # device page table (a long tensor on the device), built on demand
    # prefix reuse (resources.kv_prefix): leading blocks the request maps, their
    # device pages (-1 while a load is pending), a pending load and one in flight
    blocks: list = field(default_factory=list)
    shared: list = field(default_factory=list)
    prefix_load: Any = None
    load_work: Any = None
    chain_tokens: list = field(default_factory=list)
    # per layer, the merged token ranges [start, end) written into the request's own pages
    # (``write``, or ``mark_written`` for in-place writers): only what every layer wrote is
    # published as blocks
    written: dict = field(default_factory=dict)

    def note_written(self, layer: int, start: int, end: int) -> None:
        """Layer ``layer`` now holds tokens [start, end)."""
        spans = self.written.get(layer)
        if not spans:
            self.written[layer] = [(start, end)]
            return
        last_start, last_end = spans[-1]
        if start >= last_start:  # the usual case, a write after the last one: no re-sort
            if start > last_end:
                spans.append((start, end))
            elif end > last_end:
                spans[-1] = (last_start, end)
            return
        spans.append((start, end))
        spans.sort()
        merged = [spans[0]]
        for s, e in spans[1:]:
            if s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        self.written[layer] = merged

    def written_tokens(self, num_layers: int, mapped: int) -> int:
        """Leading tokens every layer holds: the ``mapped`` tokens of its blocks, then what all
        ``num_layers`` layers wrote contiguously from there (never past ``num_tokens``)."""
        upto = mapped
        for layer in range(num_layers):
            reach = mapped
            for s, e in self.written.get(layer, ()):
                if s <= reach:
                    reach = max(reach, e)
            upto = reach if layer == 0 else min(upto, reach)
        return min(max(upto, mapped), self.num_tokens)

    def forget_written_from(self, tokens: int) -> None:
        """The request keeps only its first ``tokens`` tokens: writes past them are gone."""
        for layer, spans in list(self.written.items()):
            self.written[layer] = [(s, min(e, tokens)) for s, e in spans if s < tokens]

    def held(self) -> tuple[int, int, int]:
        """Pages held per tier (mapped prefix blocks are the block store's)."""
        return (len(self.device), len(self.host),
                self.disk.num_pages if self.disk is not None else 0)


def admitted_early(r: RequestRecord) -> bool:
    """A layer-wise reload whose layer 0 is on the device: its step may run, each
    layer read only once it has landed (``wait_layer``)."""
    p = r.layers
    return (r.state is RequestState.RELOADING and p is not None and p.layerwise
            and p.ready >= 1 and p.failed_at is None)


def own_pages(geometry, r: RequestRecord) -> int:
    """The request's own pages (mapped prefix blocks are the index's)."""
    return geometry.pages_for(r.num_tokens) - len(r.shared)


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


class KVStats(Counters):
    """The shared counters, plus the real cache's own faults and page tables."""

    FIELDS = Counters.FIELDS + (
        "commit_failures", "completion_errors", "disk_release_faults", "page_tables_built",
        # reloads: seconds from the start of each until its first layer could be read
        # (every layer at once without layer-wise reload), and the steps' time blocked
        # waiting for a later layer; admitted before the whole copy landed; undone
        "reload_first_layer_s_total", "layer_wait_s_total", "reloads_admitted_early",
        "reloads_undone",
    )
