"""The data plane of ``PagedKVCache``: reading and writing K/V through page tables.

``DataPlane`` is the part of the cache an attention kernel talks to: the
device page tables, one layer's K/V over all device pages, and token-range
writes and reads of a resident request. It moves no request between tiers;
a read or write of a request that is not resident raises (a reload that has
finished is applied first).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import TYPE_CHECKING, Any

import torch
from tiering.resources.kv_options import KVContext
from tiering.resources.kv_records import RequestLost, RequestRecord, admitted_early

from tiering.errors import LayerNotReady
from tiering.types import IllegalTransition, RequestState

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.kv_transfers import Transfers

S = RequestState


def check_int(what: str, name: str, value: Any, lo: int | None = 0) -> int:
    """``value`` as an int (bool is not an int here), at least ``lo``; else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}: {name} must be an int, got {type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{what}: {name} must be >= {lo}, got {value}")
    return value


class DataPlane:
    """Page tables, layer views, writes and reads (see the module doc)."""

    def __init__(self, ctx: KVContext, transfers: Transfers) -> None:
        self._life, self._stats, storage, self._stream, o = ctx
        # the storage's tensors and streams, read here
        self._g, self._dev, self._device = storage.geometry, storage.dev, storage.device
        self._streams, self._transfers = storage.streams, transfers
        self._layer_timeout = o.layer_wait_timeout_s

    def page_table(self, rid: str) -> list[int]:
        r = self._life.get(rid, "page_table")
        self._not_streamed(r, "page_table")
        if r.state is not S.RESIDENT and not admitted_early(r):
            raise IllegalTransition(f"request {rid!r} is {r.state.value}; it has no page table")
        return list(r.shared) + list(r.device)

    def device_page_table(self, rid: str) -> torch.Tensor:
        r = self.readable(rid, "device_page_table", partial_ok=True)
        self._not_streamed(r, "device_page_table")
        return self._index(r)

    def _not_streamed(self, r: RequestRecord, what: str) -> None:
        if r.head:
            raise IllegalTransition(
                f"{what}: request {r.rid!r} is longer than the device and streams its first"
                f" {len(r.head)} pages from the host; it has no device page table (use read)")

    def is_streamed(self, rid: str) -> bool:
        return bool(self._life.get(rid, "is_streamed").head)

    def wait_layer(self, rid: str, layer: int, timeout: float | None = None) -> bool:
        r = self._life.get(rid, "wait_layer")
        self._check_layer(f"wait_layer({rid!r})", layer)
        if timeout is not None:
            from tiering.core.validate import check_timeout

            timeout = check_timeout(f"wait_layer({rid!r})", timeout)
        return self._wait_layer(r, layer, timeout)

    def _wait_layer(self, r: RequestRecord, layer: int, timeout: float | None = None) -> bool:
        if r.undone is not None:
            return False  # the step admitted on a failed reload cannot go on
        limit = self._layer_timeout if timeout is None else timeout
        if r.state is S.RELOADING and r.layers is not None:
            progress = r.layers
            w = progress.wait(layer, limit)
            if w.ok and progress.layerwise:
                self._streams.wait_on_compute(w.event)
                return True
            if w.ok:  # a whole-request copy has landed: its job is ending
                cf.wait([r.job.future], timeout=limit)
            if r.job is not None and r.job.future.done():
                self._transfers.finish_now(r)  # applied now (a failed copy too); the next poll reports it
        if r.state is S.RELOADING:
            self._transfers.finish_now(r)
        if r.state is S.RESIDENT:
            self._streams.wait_on_compute(r.ready_event)
            r.ready_event = None
            return True
        return False

    def _index(self, r: RequestRecord) -> torch.Tensor:
        if r.index is None or r.index.numel() != len(r.shared) + len(r.device):
            r.index = torch.tensor(r.shared + r.device, dtype=torch.long).to(self._device)
            self._stats.page_tables_built += 1
        return r.index

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._life.check_open("layer_view")
        self._check_layer("layer_view", layer)
        return self._dev[:, layer, 0], self._dev[:, layer, 1]

    def _check_layer(self, what: str, layer: int) -> None:
        check_int(what, "layer", layer, lo=None)
        if not 0 <= layer < self._g.num_layers:
            raise ValueError(f"{what}: layer {layer} out of range [0, {self._g.num_layers})")

    def _token_pages(self, r: RequestRecord, start: int, n: int):
        """(slot, offset in page, token index in the input, count) pieces of a token range."""
        T = self._g.page_tokens
        table = r.shared + r.device
        skip = len(r.head)  # a streamed request's window starts after its head
        pos, end = start, start + n
        while pos < end:
            page, off = divmod(pos, T)
            take = min(T - off, end - pos)
            yield table[page - skip], off, pos - start, take
            pos += take

    def _check_kv(self, what: str, k: Any, v: Any) -> None:
        g = self._g
        want = (g.num_kv_heads, g.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.layout is not torch.strided:
                raise ValueError(f"{what}: {name} must be a dense tensor, got layout {t.layout}")
        if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != want:
            raise ValueError(
                f"{what}: k and v must both be [tokens, {want[0]}, {want[1]}],"
                f" got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        for name, t in (("k", k), ("v", v)):
            if t.dtype != g.dtype:
                raise ValueError(f"{what}: {name}.dtype is {t.dtype}; the cache holds {g.dtype}")
            if t.device.type != self._device.type or (
                self._device.type == "cuda" and t.device.index != self._device.index
            ):
                raise ValueError(f"{what}: {name}.device is {t.device}; the cache is on {self._device}")

    def write(self, rid: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        what = f"write({rid!r})"
        r = self._life.get(rid, "write")
        self._check_layer(what, layer)
        check_int(what, "start", start)
        self._check_kv(what, k, v)
        n = k.shape[0]
        if start + n > r.num_tokens:
            raise ValueError(
                f"{what}: tokens [{start}, {start + n}) are past the {r.num_tokens}"
                " allocated tokens"
            )
        if start < len(r.head) * self._g.page_tokens:
            raise ValueError(
                f"{what}: tokens from {start} fall in the first {len(r.head)} pages of a request"
                " longer than the device, which stream from the host and are not written again")
        if start < len(r.shared) * self._g.page_tokens:
            raise ValueError(
                f"{what}: tokens from {start} fall in published page {start // self._g.page_tokens}"
                f" (the first {len(r.shared) * self._g.page_tokens} tokens are published and immutable)"
            )
        r = self.readable(rid, "write", layer)
        for slot, off, i, take in self._token_pages(r, start, n):
            self._dev[slot, layer, 0, off : off + take].copy_(k[i : i + take])
            self._dev[slot, layer, 1, off : off + take].copy_(v[i : i + take])
        if n:
            r.note_written(layer, start, start + n)  # what publish_prefix may key

    def mark_written(self, rid: str, num_tokens: int) -> None:
        r = self._life.get(rid, "mark_written")
        check_int(f"mark_written({rid!r})", "num_tokens", num_tokens)
        if num_tokens > r.num_tokens:
            raise ValueError(f"mark_written({rid!r}): {num_tokens} tokens but {r.num_tokens} are allocated")
        if num_tokens:
            for layer in range(self._g.num_layers):
                r.note_written(layer, 0, num_tokens)

    def read(self, rid: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._life.get(rid, "read")
        self._check_layer(f"read({rid!r})", layer)
        r = self.readable(rid, "read", layer)
        g = self._g
        if r.head:
            return self._read_streamed(r, layer)
        pages = self._dev[:, layer].index_select(0, self._index(r))  # [p, 2, T, H, D]
        k = pages[:, 0].reshape(-1, g.num_kv_heads, g.head_dim)[: r.num_tokens]
        v = pages[:, 1].reshape(-1, g.num_kv_heads, g.head_dim)[: r.num_tokens]
        return k, v

    def _read_streamed(self, r: RequestRecord, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``read`` of a streamed request: its head through the stream buffer, its
        window from the device; the same bytes a resident request's read gives."""
        g = self._g
        shape = (r.num_tokens, g.num_kv_heads, g.head_dim)
        k = torch.empty(shape, dtype=g.dtype, device=self._device)
        v = torch.empty(shape, dtype=g.dtype, device=self._device)
        if not self._stream.read_layer(r.rid, r.head, layer, k, v, g.page_tokens,
                                       self._layer_timeout):
            raise LayerNotReady(f"read({r.rid!r}): layer {layer} of its head could not be"
                                " brought from the host (the copy failed or timed out)")
        h = len(r.head) * g.page_tokens
        pages = self._dev[:, layer].index_select(0, self._index(r))
        k[h:] = pages[:, 0].reshape(-1, g.num_kv_heads, g.head_dim)[: r.num_tokens - h]
        v[h:] = pages[:, 1].reshape(-1, g.num_kv_heads, g.head_dim)[: r.num_tokens - h]
        return k, v

    def readable(self, rid: str, what: str, layer: int | None = None,
                  partial_ok: bool = False) -> RequestRecord:
        """``rid``'s record when its KV (or, given ``layer``, that layer) may be used
        now; else IllegalTransition (LayerNotReady for a layer that did not land),
        RequestLost for a lost request."""
        r = self._life.get(rid, what)
        if r.state is S.LOST:
            raise RequestLost(rid, r.lost_reason or "unknown")
        if r.state is S.RELOADING:
            self._transfers.finish_now(r)  # maybe the copy is done already
        if r.undone is not None:
            raise LayerNotReady(
                f"{what}: the layer-wise reload request {rid!r}'s step was admitted on failed"
                f" ({r.undone}); the request is now {r.state.value} and this step cannot go on")
        if admitted_early(r):
            if partial_ok:
                return r
            if layer is None:
                raise IllegalTransition(
                    f"{what}: request {rid!r} is reloading layer by layer; name the layer")
            progress = r.layers
            if self._wait_layer(r, layer):
                return r
            raise LayerNotReady(
                f"{what}: layer {layer} of request {rid!r} is not on the device"
                f" ({progress.wait(layer, 0).reason}); the request is now {r.state.value}")
        if r.state is not S.RESIDENT:
            raise IllegalTransition(
                f"{what}: request {rid!r} is {r.state.value}; it must be resident on the device"
            )
        self._streams.wait_on_compute(r.ready_event)
        r.ready_event = None
        return r
