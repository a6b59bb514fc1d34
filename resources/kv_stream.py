"""Requests longer than the device: a device window, the rest streamed layer by layer.

A streamed request keeps its last ``window`` pages on the device (where its new
tokens are written) and its head, every page before them, on the host. Reading
one layer brings that layer of the head through ``StreamBuffer``: a ring of
chunks carved out of the device pool once (the pages admission counts), filled
by a copy thread that runs ahead of the reader, across layers, as far as the
ring allows. So while the engine computes layer L, layer L+1 is copying.

``StreamBuffer`` owns the ring and its copy thread; the cache owns the records
(``RequestRecord.head``: the host slots, in token order) and calls ``read_layer``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from tiering.core.transfer import coalesce

log = logging.getLogger("tiering.kv_cache")

#: The pool owner of the ring's device pages.
STREAM_BUFFER = "<stream buffer>"


@dataclass(eq=False)
class _Feed:
    """One run of the copy thread: the head of ``rid`` from ``first_layer`` on."""

    rid: str
    head: list[int]
    first_layer: int
    num_layers: int
    cancelled: bool = False
    error: BaseException | None = None
    done: bool = False
    next: tuple[int, int] = field(init=False)  # the first (layer, chunk) nobody has claimed yet

    def __post_init__(self) -> None:
        self.next = (self.first_layer, 0)


class StreamBuffer:
    """The rotating device buffer of streamed requests (see the module doc).

    ``ring`` is ``chunks`` tensors of ``chunk_pages`` layer slices each
    (``[chunk_pages, 2, page_tokens, heads, dim]``), views of device pages the pool
    set aside. One request streams at a time; a read of another request, or of a
    layer the thread is not on, restarts the thread there."""

    def __init__(self, ring_pages: torch.Tensor, num_layers: int, host: torch.Tensor,
                 streams: Any, fault_hook: Any, chunks: int = 4,
                 join_timeout_s: float = 60.0) -> None:
        pages = ring_pages.shape[0]
        slices = ring_pages.reshape(pages * num_layers, *ring_pages.shape[2:])
        self.chunk_pages = max(1, slices.shape[0] // chunks)
        n = slices.shape[0] // self.chunk_pages
        self.ring = [slices[i * self.chunk_pages : (i + 1) * self.chunk_pages] for i in range(n)]
        self.num_layers = num_layers
        self._host = host
        self._streams = streams
        self._fault = fault_hook
        self._cond = threading.Condition()
        self._free: deque[tuple[int, Any]] = deque((i, None) for i in range(n))
        self._filled: deque[tuple[int, int, int, int, Any]] = deque()  # layer, chunk, buf, count, event
        self._feed: _Feed | None = None
        self._thread: threading.Thread | None = None
        self._join_timeout_s = join_timeout_s
        # a copy thread that did not stop in time may still write the ring: it is never
        # used again, and readers copy every chunk themselves
        self.ring_lost = False
        self.copy_s = 0.0  # seconds spent copying, by the thread or a reader (a measurement)
        self.wait_s = 0.0  # seconds readers waited for a chunk

    # -- the reader (the step thread) ---------------------------------------------

    def start(self, rid: str, head: list[int], layer: int = 0) -> None:
        """Begin (or keep) streaming ``rid``'s head from ``layer`` on."""
        f = self._feed
        if f is not None and f.rid == rid and f.head == head and not f.cancelled and (
            self._next_layer() == layer):
            return
        self.stop()
        feed = _Feed(rid, list(head), layer, self.num_layers)
        with self._cond:
            self._feed = feed
            self._free = deque((i, None) for i in range(len(self.ring)))
            self._filled.clear()
        if self.ring_lost:
            return  # no thread: every chunk is the reader's to copy
        self._thread = threading.Thread(target=self._run, args=(feed,), daemon=True,
                                        name="tiering-stream")
        self._thread.start()

    def _next_layer(self) -> int | None:
        """The layer the reader would get next, if at its first chunk (else None)."""
        with self._cond:
            f = self._feed
            if f is None:
                return None
            layer, chunk = (self._filled[0][0], self._filled[0][1]) if self._filled else f.next
            return layer if chunk == 0 and layer < self.num_layers else None

    def read_layer(self, rid: str, head: list[int], layer: int, out_k: torch.Tensor,
                   out_v: torch.Tensor, page_tokens: int, timeout: float) -> bool:
        """Copy layer ``layer`` of the head into ``out_k``/``out_v`` (token rows
        ``[0, len(head) * page_tokens)``), chunk by chunk: from the ring where the copy
        thread has brought it, straight from the host where the thread has not started
        it (the reader claims it; no handing over). False when a copy failed or did not
        come within ``timeout`` seconds."""
        if not head:
            return True
        self.start(rid, head, layer)
        feed = self._feed
        T = page_tokens
        for chunk, first in enumerate(range(0, len(head), self.chunk_pages)):
            want = (layer, chunk)
            t0 = time.perf_counter()
            with self._cond:
                got = self._take(feed, want, len(head))
                while got is None and feed.error is None and not feed.cancelled:
                    left = timeout - (time.perf_counter() - t0)
                    if left <= 0:
                        break
                    self._cond.wait(left)
                    got = self._take(feed, want, len(head))
                self.wait_s += time.perf_counter() - t0
            if got is None:
                self.stop()
                return False
            rows = slice(first * T, (first + min(self.chunk_pages, len(head) - first)) * T)
            if got == "direct":
                try:
                    self._copy_out(head[first : first + self.chunk_pages], layer, out_k[rows],
                                   out_v[rows], T)
                except Exception:  # a copy fault: nothing wrong was handed back
                    self.stop()
                    return False
                continue
            _, _, buf, k, event = got
            if event is not None:
                self._streams.wait_on_compute(event)
            src = self.ring[buf][:k]
            out_k[rows].view(k, T, *out_k.shape[1:]).copy_(src[:, 0])  # no staging copy
            out_v[rows].view(k, T, *out_v.shape[1:]).copy_(src[:, 1])
            gathered = self._streams.compute_marker()  # the refill waits for this gather
            with self._cond:
                self._free.append((buf, gathered))
                self._cond.notify_all()
        return True

    def _take(self, feed: _Feed, want: tuple[int, int], head_pages: int):
        """(Under the lock.) The ring entry of chunk ``want`` if it has landed; "direct"
        if nobody has claimed it (now the reader's to copy); None while the thread
        copies it."""
        if self._filled and self._filled[0][:2] == want:
            return self._filled.popleft()
        if feed.next == want:
            feed.next = self._after(want, head_pages)
            return "direct"
        return None

    def _after(self, pos: tuple[int, int], head_pages: int) -> tuple[int, int]:
        chunks = -(-head_pages // self.chunk_pages)
        layer, chunk = pos
        return (layer, chunk + 1) if chunk + 1 < chunks else (layer + 1, 0)

    def _copy_out(self, slots: list[int], layer: int, out_k: torch.Tensor,
                  out_v: torch.Tensor, T: int) -> None:
        """One chunk of the head straight from the host into the reader's rows (on the
        compute stream on a GPU)."""
        t0 = time.perf_counter()
        k_rows = out_k.view(len(slots), T, *out_k.shape[1:])
        v_rows = out_v.view(len(slots), T, *out_v.shape[1:])
        cuda = self._streams.cuda
        for r in coalesce(slots, range(len(slots))):
            self._fault("h2d")
            src = self._host[r.src : r.src + r.length, layer]
            k_rows[r.dst : r.dst + r.length].copy_(src[:, 0], non_blocking=cuda)
            v_rows[r.dst : r.dst + r.length].copy_(src[:, 1], non_blocking=cuda)
        with self._cond:
            self.copy_s += time.perf_counter() - t0

    def stop(self) -> None:
        """Stop the copy thread (it finishes the chunk it is copying)."""
        f, t = self._feed, self._thread
        if f is not None:
            with self._cond:
                f.cancelled = True
                self._cond.notify_all()
        if t is not None:
            t.join(self._join_timeout_s)
            if t.is_alive():
                log.error("the stream copy thread did not stop within %ss; its ring is not"
                          " used again", self._join_timeout_s)
                self.ring_lost = True
        self._feed, self._thread = None, None
        with self._cond:
            self._filled.clear()
            self._free = deque((i, None) for i in range(len(self.ring)))

    def forget(self, rid: str) -> None:
        """``rid`` is gone or its head changed: stop streaming it."""
        if self._feed is not None and self._feed.rid == rid:
            self.stop()

    # -- the copy thread -----------------------------------------------------------------

    def _run(self, feed: _Feed) -> None:
        n = len(feed.head)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: bool(self._free) or feed.cancelled)
                    pos = feed.next
                    if feed.cancelled or pos[0] >= feed.num_layers:
                        return
                    feed.next = self._after(pos, n)  # claimed: the reader will wait for it
                    buf, gathered = self._free.popleft()
                first = pos[1] * self.chunk_pages
                slots = feed.head[first : first + self.chunk_pages]
                t0 = time.perf_counter()
                event = self._copy(slots, buf, pos[0], gathered)
                with self._cond:
                    self.copy_s += time.perf_counter() - t0
                    if feed.cancelled:
                        return
                    self._filled.append((pos[0], pos[1], buf, len(slots), event))
                    self._cond.notify_all()
        except BaseException as exc:  # reported to the reader, who answers False
            feed.error = exc
        finally:
            with self._cond:
                feed.done = True
                self._cond.notify_all()

    def _copy(self, slots: list[int], buf: int, layer: int, gathered: Any):
        dst = self.ring[buf]
        runs = coalesce(slots, range(len(slots)))
        s = self._streams
        if s.cuda:
            with torch.cuda.device(s.device), torch.cuda.stream(s.h2d):
                if gathered is not None:  # the reader's gather from this chunk has ended
                    s.h2d.wait_event(gathered)
                for r in runs:
                    self._fault("h2d")
                    dst[r.dst : r.dst + r.length].copy_(
                        self._host[r.src : r.src + r.length, layer], non_blocking=True)
                ev = s.new_event()
                ev.record(s.h2d)
            return ev
        for r in runs:
            self._fault("h2d")
            dst[r.dst : r.dst + r.length].copy_(self._host[r.src : r.src + r.length, layer])
        return None
