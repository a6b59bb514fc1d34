"""The conservation check of ``PagedKVCache`` (``check_integrity``).

``IntegrityCheck`` reads every part's state and changes none: every slot of every
tier is free, held by exactly one request, by a removed request's copy still in
flight, by the block store or by the stream buffer; each record holds what its
state allows; ledgers equal the slots they count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiering.resources.kv_options import KVContext
from tiering.resources.kv_prefix_types import BLOCKS
from tiering.resources.kv_records import RequestRecord
from tiering.resources.kv_stream import STREAM_BUFFER

from tiering.core.pools import PoolIntegrityError
from tiering.types import Move, RequestState, Tier

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.kv_prefix_api import PrefixReuse
    from tiering.resources.kv_transfers import Transfers

S = RequestState


#: states a record whose step a failed reload cut short is never in (a reload that
#: starts, or a new step, clears it)
_NEVER_UNDONE = frozenset({S.RESIDENT, S.OFFLOADING, S.RELOADING})


class IntegrityCheck:
    """``check_integrity`` over the parts it is given (see the module doc)."""

    def __init__(self, ctx: KVContext, reuse: PrefixReuse, transfers: Transfers) -> None:
        self._life, _, self._s, self._stream, o = ctx
        self._g, self._reuse, self._transfers = self._s.geometry, reuse, transfers
        self._window, self._stream_pages = o.stream_window_pages, o.stream_buffer_pages

    def check(self) -> None:
        """Every slot of every tier is free, held by exactly one request, or
        held by a removed request's copy still in flight; each request holds
        exactly what its state allows (the lifecycle's one table); ledgers
        equal the slots they count."""
        self._life.check_open("check_integrity")
        pages = self._g.pages_for

        def checked_here(r: RequestRecord) -> bool:
            # a pending prefix load, or a layer-wise reload whose early-admitted step grew
            # the request: its source holds the pages it had when the reload started
            return r.prefix_load is not None or bool(r.head) or (
                r.layers is not None and r.num_tokens != r.layers.base_tokens)

        problems = self._life.check(lambda r: pages(r.num_tokens) - len(r.shared),
                                    skip=checked_here)
        dev: dict = {}
        host: dict = {}
        for rid, r in self._life.records.items():
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
                if st.in_flight != (r.job is not None) or st.in_flight != (rid in self._life.inflight):
                    problems.append(f"{rid}: state {st.value} but job={r.job is not None}")
            if st is S.RESIDENT and len(r.device) != pages(r.num_tokens) - len(r.shared) - len(r.head):
                problems.append(f"{rid}: {len(r.device)} device pages for {r.num_tokens} tokens")
            if r.index is not None and r.index.tolist() != r.shared + r.device:
                problems.append(f"{rid}: device page table {r.index.tolist()} != slots {r.shared + r.device}")
            if self._reuse.blocks is None and (r.blocks or r.shared):
                problems.append(f"{rid}: maps prefix blocks with no prefix cache")
            for layer, spans in r.written.items():  # sorted, apart, within the request
                ends = [0] + [x for span in spans for x in span]
                if any(b <= a for a, b in zip(ends[1:], ends[2:], strict=False)) or ends[-1] > r.num_tokens:
                    problems.append(f"{rid}: layer {layer} written spans {spans[:4]} (of"
                                    f" {len(spans)}) for {r.num_tokens} tokens")
        for key, t in self._transfers.tombstones.items():
            dev[key], host[key] = t.device, t.host
        if self._stream is not None:
            dev[STREAM_BUFFER] = list(range(self._stream_pages))
        if self._reuse.blocks is not None:
            dev[BLOCKS], host[BLOCKS] = self._reuse.blocks.pages_on(Tier.DEVICE), self._reuse.blocks.pages_on(Tier.HOST)
            problems += self._reuse.blocks.check_integrity(self._life.records.values())
        if self._s.ring is not None and not self._life.inflight and not self._transfers.tombstones:
            try:
                self._s.ring.check_integrity()
            except AssertionError as exc:
                problems.append(str(exc))
        try:
            self._s.device_pool.check_integrity(dev)
            self._s.host_pool.check_integrity(host)
            if self._s.disk is not None:
                self._s.disk.check_integrity()
                held = sum(1 for r in self._life.records.values() if r.disk is not None)
                held += sum(1 for t in self._transfers.tombstones.values() if t.disk is not None)
                if self._reuse.blocks is not None:
                    held += len(self._reuse.blocks.extents)
                extents = self._s.disk.stats()["extents"]
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
        if len(r.head) + len(r.device) != self._g.pages_for(r.num_tokens):
            out.append(f"{rid}: {len(r.head)} head and {len(r.device)} window pages for"
                       f" {r.num_tokens} tokens")
        if not 0 < len(r.device) <= self._window:
            out.append(f"{rid}: a window of {len(r.device)} pages (at most"
                       f" {self._window})")
        return out

    def _check_layers(self, r: RequestRecord) -> list[str]:
        """A reload's layer progress: only while it is in flight, consistent, and (once a
        step was admitted early and grew the request) device pages for every token with
        the source still holding the pages it had."""
        p, rid = r.layers, r.rid
        if r.undone is not None and r.state in _NEVER_UNDONE:  # set by a failed reload only
            return [f"{rid}: a step cut short by a failed reload while {r.state.value}"]
        if p is None:
            return [f"{rid}: admitted early with no reload in flight"] if r.admitted_early else []
        if r.state is not S.RELOADING or r.job is None:
            return [f"{rid}: layer progress in state {r.state.value}"]
        out = [f"{rid}: {m}" for m in p.check()]
        if p.num_layers != self._g.num_layers:
            out.append(f"{rid}: progress over {p.num_layers} layers, the cache has"
                       f" {self._g.num_layers}")
        if r.admitted_early and not p.layerwise:
            out.append(f"{rid}: admitted early from a whole-request reload")
        if r.num_tokens < p.base_tokens:
            out.append(f"{rid}: {r.num_tokens} tokens, fewer than the {p.base_tokens} reloaded")
        if r.num_tokens != p.base_tokens:
            if not r.admitted_early:
                out.append(f"{rid}: grew while reloading without a step admitted")
            need = self._g.pages_for(r.num_tokens) - len(r.shared)
            src = len(r.host) if r.job.move is Move.RELOAD_FROM_HOST else (
                r.disk.num_pages if r.disk is not None else 0)
            if len(r.device) != need or src != p.base_pages:
                out.append(f"{rid}: grown reload holds {len(r.device)} device pages (needs"
                           f" {need}) and {src} source pages (reloaded {p.base_pages})")
        return out
