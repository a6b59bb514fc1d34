"""Page copies between page-first tensors, off the caller's thread.

Pages are laid out page-first (``[pages, layers, 2, tokens, heads, dim]``), so
one page is one contiguous region across all layers and a run of adjacent
pages is one contiguous region too. ``coalesce`` turns a request's slot lists
into as few runs as possible, and each run is a single ``copy_``.

On CUDA, copies go on dedicated device-to-host and host-to-device streams.
A device-to-host copy first waits on an event recorded on the compute stream
when the offload was asked for, because the KV it reads may still be being
written by kernels queued there. The host-to-device copy records an event that
the compute stream waits on before the request's next step. The job that
issued the copies waits for that event on a worker thread, never on the step
thread, so completion is observed by polling futures.

Without CUDA the same jobs run on worker threads (torch copies release the
GIL), so every test runs on a CPU-only machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from tiering.errors import CopyFault  # noqa: F401 (re-exported from its old home)


class PageRun(NamedTuple):
    """``length`` adjacent pages copied from ``src`` onwards to ``dst`` onwards."""

    src: int
    dst: int
    length: int


def coalesce(src_slots: Sequence[int], dst_slots: Sequence[int]) -> list[PageRun]:
    """Pair up slots in order, merging neighbours that are adjacent on both sides."""
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"coalesce: {len(src_slots)} source vs {len(dst_slots)} destination slots")
    runs: list[PageRun] = []
    for s, d in zip(src_slots, dst_slots, strict=True):
        if runs:
            last = runs[-1]
            if s == last.src + last.length and d == last.dst + last.length:
                runs[-1] = PageRun(last.src, last.dst, last.length + 1)
                continue
        runs.append(PageRun(s, d, 1))
    return runs


def no_fault(kind: str) -> None:
    """The default fault hook: never injects anything."""


class StreamSet:
    """Where copies are issued: CUDA streams on a GPU, nothing on a CPU.

    ``compute_stream`` is the stream the engine's kernels run on (None: the
    stream current on the calling thread when the cache was built). Every
    marker a copy waits on is recorded on it, and the compute stream is what
    waits for a reload's copy. ``compute_marker()`` is called on the step
    thread when a copy is asked for; the returned marker (a CUDA event, or
    None on a CPU) is what the copy waits on before it touches a slot.

    Events are created with ``blocking=True`` so a worker waiting for a copy
    sleeps in the driver instead of spinning a core.
    """

    def __init__(self, device: torch.device, compute_stream=None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.compute = None
        if self.cuda:
            with torch.cuda.device(device):
                self.d2h = torch.cuda.Stream(device=device)
                self.h2d = torch.cuda.Stream(device=device)
                self.compute = (
                    compute_stream
                    if compute_stream is not None
                    else torch.cuda.current_stream(device)
                )
        elif compute_stream is not None:
            raise ValueError(f"compute_stream given for a {device.type} device; it needs CUDA")

    def new_event(self):
        """A CUDA event whose ``synchronize()`` blocks (no spinning)."""
        return torch.cuda.Event(blocking=True)

    def compute_marker(self):
        if not self.cuda:
            return None
        ev = self.new_event()
        ev.record(self.compute)
        return ev

    def wait_on_compute(self, ready_event) -> None:
        """Make the compute stream wait for a reload's copy (no-op on CPU)."""
        if self.cuda and ready_event is not None:
            self.compute.wait_event(ready_event)


def issue_runs(
    streams: StreamSet,
    src: torch.Tensor,
    dst: torch.Tensor,
    runs: Sequence[PageRun],
    direction: str,
    after=None,
    fault_hook: Callable[[str], None] = no_fault,
    layer: int | None = None,
):
    """Queue the copies of ``runs`` from ``src`` to ``dst``; returns the event
    recorded after them on CUDA (not waited for), None on a CPU (already done).

    Runs on a worker thread. ``direction`` is "d2h" or "h2d" and picks the
    CUDA stream; ``after`` is a compute-stream marker to wait on first (for
    an offload, kernels may still be writing the KV; for a reload, kernels
    queued for the slots' previous owner may still use them). ``layer``: copy
    only that layer of each page (a page holds its layers one after the other,
    so the layer of a run of pages is strided: on a CPU each run is one strided
    copy, on CUDA each page's slice is one asynchronous copy).

    If anything raises after copies were queued, the copies already queued
    are fenced (waited for) before the exception leaves, so no caller frees
    a slot a queued copy still reads or writes.
    """
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"copy_runs: direction must be 'd2h' or 'h2d', got {direction!r}")
    if streams.cuda and (src.is_cuda or dst.is_cuda):
        stream = streams.d2h if direction == "d2h" else streams.h2d
        with torch.cuda.device(streams.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            done = streams.new_event()
            try:
                for r in runs:
                    fault_hook(direction)
                    if layer is None:
                        dst[r.dst : r.dst + r.length].copy_(
                            src[r.src : r.src + r.length], non_blocking=True
                        )
                        continue
                    for i in range(r.length):
                        dst[r.dst + i, layer].copy_(src[r.src + i, layer], non_blocking=True)
            except BaseException:
                done.record(stream)
                done.synchronize()  # fence what was queued before the fault
                raise
            done.record(stream)
        return done
    for r in runs:
        fault_hook(direction)
        if layer is None:
            dst[r.dst : r.dst + r.length].copy_(src[r.src : r.src + r.length])
        else:
            dst[r.dst : r.dst + r.length, layer].copy_(src[r.src : r.src + r.length, layer])
    return None


def copy_runs(*args, **kwargs):
    """``issue_runs`` (the same arguments) and wait until the copies are done (a
    blocking-sync event: the worker sleeps). Returns the event (None on a CPU)."""
    done = issue_runs(*args, **kwargs)
    if done is not None:
        done.synchronize()
    return done
