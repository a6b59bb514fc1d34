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

import threading
import time
from collections import deque
from typing import Any

import torch

from tiering.core.transfer import coalesce

#: The pool owner of the ring's device pages.
STREAM_BUFFER = "<stream buffer>"


class _Feed:
    """One run of the copy thread: the head of ``rid`` from ``first_layer`` on."""

    def __init__(self, rid: str, head: list[int], first_layer: int, num_layers: int) -> None:
        self.rid = rid
        self.head = head
        self.first_layer = first_layer
        self.num_layers = num_layers
        self.cancelled = False
        self.error: BaseException | None = None
        self.done = False
        self.next = (first_layer, 0)  # the (layer, chunk) the thread copies next


class StreamBuffer:
    """The rotating device buffer of streamed requests (see the module doc).

    ``ring`` is ``chunks`` tensors of ``chunk_pages`` layer slices each
    (``[chunk_pages, 2, page_tokens, heads, dim]``), views of device pages the pool
    set aside. One request streams at a time; a read of another request, or of a
    layer the thread is not on, restarts the thread there."""

    def __init__(self, ring_pages: torch.Tensor, num_layers: int, host: torch.Tensor,
                 streams: Any, fault_hook: Any, chunks: int = 4) -> None:
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
        self.copy_s = 0.0  # seconds the thread spent copying (a measurement)
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
        ``[0, len(head) * page_tokens)``), chunk by chunk as they land. False when the
        copy failed or did not come within ``timeout`` seconds."""
        if not head:
            return True
        self.start(rid, head, layer)
        feed = self._feed
        T = page_tokens
        for chunk, first in enumerate(range(0, len(head), self.chunk_pages)):
            t0 = time.perf_counter()
            with self._cond:
                ok = self._cond.wait_for(
                    lambda: bool(self._filled) or feed.error is not None or feed.done, timeout)
                self.wait_s += time.perf_counter() - t0
                if not ok or not self._filled:
                    self.stop()
                    return False
                got_layer, got_chunk, buf, k, event = self._filled.popleft()
            if (got_layer, got_chunk) != (layer, chunk):  # the thread must run in order
                self.stop()
                return False
            if event is not None:
                self._streams.wait_on_compute(event)
            rows = slice(first * T, (first + k) * T)
            src = self.ring[buf][:k]
            out_k[rows].view(k, T, *out_k.shape[1:]).copy_(src[:, 0])  # no staging copy
            out_v[rows].view(k, T, *out_v.shape[1:]).copy_(src[:, 1])
            gathered = self._streams.compute_marker()  # the refill waits for this gather
            with self._cond:
                self._free.append((buf, gathered))
                self._cond.notify_all()
        return True

    def stop(self) -> None:
        """Stop the copy thread (it finishes the chunk it is copying)."""
        f, t = self._feed, self._thread
        if f is not None:
            with self._cond:
                f.cancelled = True
                self._cond.notify_all()
        if t is not None:
            t.join()
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
        try:
            starts = range(0, len(feed.head), self.chunk_pages)
            for layer in range(feed.first_layer, feed.num_layers):
                for chunk, first in enumerate(starts):
                    with self._cond:
                        self._cond.wait_for(lambda: bool(self._free) or feed.cancelled)
                        if feed.cancelled:
                            return
                        buf, gathered = self._free.popleft()
                    slots = feed.head[first : first + self.chunk_pages]
                    t0 = time.perf_counter()
                    event = self._copy(slots, buf, layer, gathered)
                    self.copy_s += time.perf_counter() - t0
                    with self._cond:
                        if feed.cancelled:
                            return
                        self._filled.append((layer, chunk, buf, len(slots), event))
                        feed.next = (layer, chunk + 1) if chunk + 1 < len(starts) else (layer + 1, 0)
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
