"""The moves of ``PagedKVCache``: starting them, and applying what finished.

``KVTransfers`` is the part of the cache that queues copies (``offload``,
``demote``, ``reload``) and applies their outcomes (``poll``,
``synchronize``). Every change of a record goes through the cache's
``Lifecycle`` (``tiering.core.lifecycle``): the move chosen by
``offload_move``, begun, then landed, survived (a failed copy leaves the
request at its source) or lost (its bytes are gone, with the reason). The
byte copies themselves are ``tiering.resources.kv_moves.CopyJobs``. Completion
handlers are dispatched through ``_completions``, a ``Move -> handler`` table.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging

from tiering.resources.kv_records import RequestRecord, Tombstone, TransferJob

from tiering.control.protocols import CompletionFeed
from tiering.core.checksum import ChecksumMismatch
from tiering.core.executor import OFFLOAD, RELOAD, WRITE, PriorityExecutor
from tiering.core.layers import LayerProgress
from tiering.core.lifecycle import IN_FLIGHT, RELOAD_FROM, Op, guard, offload_move
from tiering.core.staging import StagingTimeout
from tiering.core.validate import check_timeout
from tiering.errors import TRANSIENT_IO_ERRNOS
from tiering.types import Move, RequestState, TransferResult

log = logging.getLogger("tiering.kv_cache")

S = RequestState


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class KVTransfers:
    """Starting and completing moves (a part of ``PagedKVCache``; see the module doc)."""

    # -- starting a move ------------------------------------------------------------

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
        guard(r, Op.OFFLOAD)
        n = len(r.device)
        if n == 0 or r.head:  # a streamed request stays: its head is on the host already
            return 0
        freed = n * self.geometry.page_bytes
        marker = self._streams.compute_marker()
        if self._prefix is not None:
            self._prefix.ensure_host(n)  # cached blocks make way for a live request
        host_room = self.host_pool.free_pages >= n
        move = offload_move(
            host_room,
            not host_room and self.disk is not None and self.offload_to_disk_when_host_full
            and self.disk.can_reserve(n),
            self.offload_to_disk_when_host_full,
        )
        if move is Move.OFFLOAD_TO_HOST:
            host = self.host_pool.allocate(rid, n)
            fut = self._submit(self._d2h, OFFLOAD, self._moves.offload_host, list(r.device),
                               list(host), marker)
            if fut is None:
                self.host_pool.release(rid, host)
                return 0
            r.host = host
        else:
            extent = self.disk.reserve(rid, n) if move is Move.OFFLOAD_TO_DISK else None
            if extent is None:
                self.stats.offload_refusals += 1
                return 0
            fut = self._submit(self._io, WRITE, self._moves.offload_disk, list(r.device),
                               extent, marker)
            if fut is None:
                self._disk_call(self.disk.release, extent)
                return 0
            r.disk = extent
        self._start(r, move, fut, S.OFFLOADING)
        return freed

    def demote(self, rid: str) -> bool:
        """Start moving an on-host request to disk. False (nothing changed)
        when there is no disk tier or it cannot take the request."""
        r = self._req(rid, "demote")
        guard(r, Op.DEMOTE)
        if self.disk is None or not r.host:
            return False
        extent = self.disk.reserve(rid, len(r.host))
        if extent is None:
            self.stats.demote_refusals_disk_full += 1
            return False
        fut = self._submit(self._io, WRITE, self._moves.demote, list(r.host), extent)
        if fut is None:
            self._disk_call(self.disk.release, extent)
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
        guard(r, Op.RELOAD)
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
        move = RELOAD_FROM[r.state.tier]
        progress = LayerProgress(self.geometry.num_layers,
                                 layerwise=self.layerwise_reload and move is Move.RELOAD_FROM_HOST,
                                 base_tokens=r.num_tokens, base_pages=n)
        if move is Move.RELOAD_FROM_HOST:
            fut = self._submit(self._h2d, RELOAD, self._moves.reload_host, list(r.host),
                               list(slots), r.checksum, marker, progress)
        else:
            fut = self._submit(self._io, RELOAD, self._moves.reload_disk, r.disk, list(slots),
                               r.checksum, marker, progress)
        if fut is None:
            self.device_pool.release(rid, slots)
            return False
        r.device = slots
        r.index = None
        r.layers = progress
        self._start(r, move, fut, S.RELOADING)
        return True

    def _reload_ended(self, r: RequestRecord, ok: bool) -> None:
        """Count what the reload's layers did and take its progress off the record;
        a failed one admitted early gives back what the step added since it started
        (tokens, written spans, device pages: the source holds only the rest)."""
        p, r.layers = r.layers, None
        r.admitted_early = False
        if p is None:
            return
        first = p.first_layer_s()
        if first is not None:
            self.stats.reload_first_layer_s_total += first
        self.stats.layer_wait_s_total += p.waited_s
        if not ok and r.num_tokens != p.base_tokens:
            self.stats.reloads_undone += 1
            r.num_tokens = p.base_tokens
            r.forget_written_from(p.base_tokens)

    def _start(self, r: RequestRecord, move: Move, fut: cf.Future, state: RequestState) -> None:
        if IN_FLIGHT[move] is not state:
            raise ValueError(f"_start: {move.value} runs in state {IN_FLIGHT[move].value}, "
                             f"not {state.value}")
        self._life.begin(r, TransferJob(move, fut, self._clock()))

    def _set_state(self, r: RequestRecord, state: RequestState) -> None:
        self._life.set_state(r, state)

    def _cancel_offload(self, r: RequestRecord) -> None:
        """The request is wanted again before its offload copy started: take
        the copy back (a copy already running is left to finish)."""
        if not r.job.future.cancel():
            return
        self._unreported.append(self._life.cancel(r))

    # -- completion (caller's thread) -------------------------------------------------

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
        for r in [r for r in self._inflight.values() if r.job.future.done()]:
            res = self._finish(r)
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
            self._disk_call(self.disk.release, t.disk)
        n = len(t.device) or len(t.host) or (t.disk.num_pages if t.disk is not None else 0)
        nbytes = n * self.geometry.page_bytes if exc is None else 0
        return TransferResult(t.rid, t.move, exc is None, nbytes, None,
                              None if exc is None else _why(exc))

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
        self._life.end(r)
        exc = job.future.exception()
        try:
            if r.load_work is not None:
                return self._done_prefix_load(r, job, exc)
            return self._completions[job.move](r, job, exc)
        except Exception as err:  # a bug or an unexpected fault: keep the records consistent
            self.stats.completion_errors += 1
            log.exception("request %r: completing %s failed", r.rid, job.move.value)
            reason = f"completing {job.move.value} failed: {_why(err)}"
            r.layers = None
            if r.state is not S.LOST:
                try:
                    self._life.mark_lost(r, reason)
                except Exception:  # records already broken: leave it to check_integrity
                    log.exception("request %r: could not mark it lost", r.rid)
            return TransferResult(r.rid, job.move, False, 0, r.state, reason)

    def _nbytes(self, r: RequestRecord) -> int:
        return self._pages_for(r) * self.geometry.page_bytes

    def _land(self, r: RequestRecord, job: TransferJob) -> TransferResult:
        return self._life.land(r, job.move, self._nbytes(r), job.started)

    def _survived(self, r: RequestRecord, job: TransferJob, exc: BaseException) -> TransferResult:
        """A failed copy or write: the destination goes back, the request stays at its source."""
        log.warning("request %r: %s failed, kept where it was: %s", r.rid, job.move.value, _why(exc))
        return self._life.survive(r, job.move, _why(exc))

    def _done_offload_host(self, r, job, exc):
        if exc is not None:
            return self._survived(r, job, exc)
        r.checksum = job.future.result()
        return self._land(r, job)

    def _done_offload_disk(self, r, job, exc):
        if exc is not None:
            return self._survived(r, job, exc)
        checksum = job.future.result()
        err = self._commit_disk(r, checksum)
        if err is not None:
            return self._survived(r, job, err)
        r.checksum = checksum
        return self._land(r, job)

    def _done_demote(self, r, job, exc):
        if exc is None:
            exc = self._commit_disk(r, r.checksum)
        return self._survived(r, job, exc) if exc is not None else self._land(r, job)

    def _done_reload_host(self, r, job, exc):
        self._reload_ended(r, exc is None)
        if isinstance(exc, ChecksumMismatch):
            return self._life.lose(r, job.move, f"checksum mismatch on reload from host: {exc}")
        if exc is not None:
            return self._survived(r, job, exc)
        r.ready_event = job.future.result()
        return self._land(r, job)

    def _done_reload_disk(self, r, job, exc):
        self._reload_ended(r, exc is None)
        if isinstance(exc, StagingTimeout) or (
            exc is not None and not isinstance(exc, (OSError, ChecksumMismatch))
        ) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_IO_ERRNOS):
            # nothing was read wrong: the bytes are still on disk (a miss now, a retry later)
            return self._survived(r, job, exc)
        if exc is not None:
            return self._life.lose(r, job.move, f"reload from disk failed: {_why(exc)}")
        r.ready_event = job.future.result()
        return self._land(r, job)

    def _commit_disk(self, r: RequestRecord, checksum) -> BaseException | None:
        """Commit the written extent; the exception (logged, counted) when that fails."""
        try:
            self.disk.commit(r.rid, r.disk, {"num_tokens": r.num_tokens, "checksum": checksum})
            return None
        except Exception as exc:
            self.stats.commit_failures += 1
            return exc

    def synchronize(self, timeout: float = 60.0) -> list[TransferResult]:
        """Wait for every transfer in flight, then apply them all; returns what
        was applied (as ``poll``). Raises TimeoutError naming what is still in
        flight after ``timeout`` seconds (after applying what did finish)."""
        self._open("synchronize")
        timeout = check_timeout("synchronize", timeout)
        futs = [r.job.future for r in self._inflight.values()]
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
