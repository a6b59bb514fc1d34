"""The moves of ``PagedKVCache``: starting them, and applying what finished.

``Transfers`` queues copies (``offload``, ``demote``, ``reload``, a prefix load)
on its executors and applies their outcomes (``poll``, ``synchronize``). Every
change of a record goes through the ``Lifecycle`` (``tiering.core.lifecycle``):
the move chosen by ``offload_move``, begun, then landed, survived (a failed copy
leaves the request at its source) or lost (its bytes are gone, with the reason).
The byte copies are ``tiering.resources.kv_moves.CopyJobs``; completion handlers
are dispatched through ``completions``, a ``Move -> handler`` table.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiering.resources.kv_moves import CopyJobs
from tiering.resources.kv_options import KVContext
from tiering.resources.kv_prefix_types import BLOCKS
from tiering.resources.kv_records import RequestRecord, Tombstone, TransferJob, own_pages
from tiering.resources.kv_storage import why as _why

from tiering.control.protocols import CompletionFeed
from tiering.core.checksum import ChecksumMismatch
from tiering.core.executor import OFFLOAD, RELOAD, WRITE, PriorityExecutor
from tiering.core.layers import LayerProgress
from tiering.core.lifecycle import IN_FLIGHT, RELOAD_FROM, Op, guard, offload_move
from tiering.core.staging import StagingTimeout
from tiering.core.validate import check_timeout
from tiering.errors import TRANSIENT_IO_ERRNOS
from tiering.types import CANCELLED, Move, RequestState, TransferResult

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.kv_pages import RequestPages
    from tiering.resources.kv_prefix import PrefixCache
    from tiering.resources.kv_prefix_api import PrefixReuse

log = logging.getLogger("tiering.kv_cache")

S = RequestState


class Transfers:
    """Starting and completing moves (see the module doc).

    It owns the executors, the copies in flight of removed requests (``tombstones``),
    what was applied outside ``poll`` and the completion feeds; the records are the
    ``Lifecycle``'s, changed only through it."""

    def __init__(self, ctx: KVContext, reuse: PrefixReuse, pages: RequestPages) -> None:
        self._life, self._stats, storage, _, o = ctx
        self._s, self._g, self._reuse, self._pages = storage, storage.geometry, reuse, pages
        self._clock, self._layerwise = o.clock, o.layerwise_reload
        self._to_disk = o.offload_to_disk_when_host_full
        copy_workers, io_workers = o.copy_workers, o.io_workers
        self.moves = CopyJobs(storage)
        self.tombstones: dict[tuple, Tombstone] = {}
        self._tomb_seq = itertools.count(1)
        self._unreported: list[TransferResult] = []  # applied outside poll, reported by it
        self._feeds: list[CompletionFeed] = []
        self.completions: dict[Move, Callable[[RequestRecord, TransferJob, BaseException | None],
                                              TransferResult]] = {
            Move.OFFLOAD_TO_HOST: self._done_offload_host,
            Move.OFFLOAD_TO_DISK: self._done_offload_disk,
            Move.DEMOTE: self._done_demote,
            Move.RELOAD_FROM_HOST: self._done_reload_host,
            Move.RELOAD_FROM_DISK: self._done_reload_disk,
        }
        self.executors: list[PriorityExecutor] = []
        try:
            self._d2h = self._executor(copy_workers, "tiering-d2h")
            self._h2d = self._executor(copy_workers, "tiering-h2d")
            self._io = self._executor(io_workers, "tiering-io")
        except BaseException:  # the cache never gets this part: stop what started here
            for ex in self.executors:
                ex.shutdown(timeout=10.0)
            raise

    def _executor(self, workers: int, name: str) -> PriorityExecutor:
        ex = PriorityExecutor(workers, name)
        self.executors.append(ex)
        return ex

    def shutdown(self, timeout: float) -> bool:
        """Stop every executor; whether every worker joined within ``timeout``."""
        return all([ex.shutdown(timeout=timeout) for ex in self.executors])

    # -- starting a move ------------------------------------------------------------

    def _submit(self, ex: PriorityExecutor, prio: int, fn, *args) -> cf.Future | None:
        """Queue a job; None (logged) when the executor refuses it, so the caller undoes its reservation."""
        try:
            return ex.submit(prio, fn, *args)
        except RuntimeError as exc:
            log.error("could not queue a copy: %s", exc)
            return None

    def offload(self, rid: str) -> int:
        r = self._life.get(rid, "offload")
        guard(r, Op.OFFLOAD)
        n = len(r.device)
        if n == 0 or r.head:  # a streamed request stays: its head is on the host already
            return 0
        freed = n * self._g.page_bytes
        marker = self._s.streams.compute_marker()
        blocks = self._reuse.blocks
        if blocks is not None:
            blocks.ensure_host(n)  # cached blocks make way for a live request
        host_room = self._s.host_pool.free_pages >= n
        if blocks is not None and not host_room and self._to_disk and self._s.disk is not None:
            blocks.ensure_disk(n)  # on disk too
        move = offload_move(
            host_room,
            not host_room and self._s.disk is not None and self._to_disk
            and self._s.disk.can_reserve(n),
            self._to_disk,
        )
        if move is Move.OFFLOAD_TO_HOST:
            host = self._s.host_pool.allocate(rid, n)
            fut = self._submit(self._d2h, OFFLOAD, self.moves.offload_host, list(r.device),
                               list(host), marker)
            if fut is None:
                self._s.host_pool.release(rid, host)
                return 0
            r.host = host
        else:
            extent = self._s.disk.reserve(rid, n) if move is Move.OFFLOAD_TO_DISK else None
            if extent is None:
                self._stats.offload_refusals += 1
                return 0
            fut = self._submit(self._io, WRITE, self.moves.offload_disk, list(r.device),
                               extent, marker)
            if fut is None:
                self._s.disk_call(self._s.disk.release, extent)
                return 0
            r.disk = extent
        self._start(r, move, fut, S.OFFLOADING)
        return freed

    def demote(self, rid: str) -> bool:
        r = self._life.get(rid, "demote")
        guard(r, Op.DEMOTE)
        if self._s.disk is None or not r.host:
            return False
        if self._reuse.blocks is not None:
            self._reuse.blocks.ensure_disk(len(r.host))  # cached blocks make way for it
        extent = self._s.disk.reserve(rid, len(r.host))
        if extent is None:
            self._stats.demote_refusals_disk_full += 1
            return False
        fut = self._submit(self._io, WRITE, self.moves.demote, list(r.host), extent)
        if fut is None:
            self._s.disk_call(self._s.disk.release, extent)
            return False
        r.disk = extent
        self._start(r, Move.DEMOTE, fut, S.DEMOTING)
        return True

    def reload(self, rid: str) -> bool:
        r = self._life.get(rid, "reload")
        guard(r, Op.RELOAD)
        if r.prefix_load is not None:
            return self._reload_prefix(r, self._reuse.blocks)
        n = own_pages(self._g, r)
        if self._reuse.blocks is not None:
            self._reuse.blocks.ensure_device(n)
        slots = self._s.device_pool.allocate(rid, n)
        if slots is None:
            self._stats.reload_refusals += 1
            return False
        marker = self._s.streams.compute_marker()
        move = RELOAD_FROM[r.state.tier]
        progress = LayerProgress(self._g.num_layers,
                                 layerwise=self._layerwise and move is Move.RELOAD_FROM_HOST,
                                 base_tokens=r.num_tokens, base_pages=n)
        r.layers = progress  # on the record before its copy can report a layer
        if move is Move.RELOAD_FROM_HOST:
            fut = self._submit(self._h2d, RELOAD, self.moves.reload_host, list(r.host),
                               list(slots), r.checksum, marker, progress)
        else:
            fut = self._submit(self._io, RELOAD, self.moves.reload_disk, r.disk, list(slots),
                               r.checksum, marker, progress)
        if fut is None:
            r.layers = None
            self._s.device_pool.release(rid, slots)
            return False
        r.device = slots
        r.index = None
        r.undone = None  # the step a failed reload cut short is over (a refusal keeps it)
        self._start(r, move, fut, S.RELOADING)
        return True

    def _reload_prefix(self, r: RequestRecord, p: PrefixCache) -> bool:
        if p.fetch_pending(r):  # a block is still on its way from the shared tier: not yet
            p.stats["shared_reload_waits"] += 1
            return False
        k = len(r.prefix_load.positions)
        p.ensure_device(k)
        pages = self._s.device_pool.allocate(BLOCKS, k)
        if pages is None:
            self._stats.reload_refusals += 1
            return False
        work = p.start_load(r, pages)
        move = Move.RELOAD_FROM_HOST if r.state is S.ON_HOST else Move.RELOAD_FROM_DISK
        marker = self._s.streams.compute_marker()
        fut = self._submit(self._io, RELOAD, p.load_job, work, self._s.fault, marker)
        if fut is None:
            p.finish_load(None, work, ["not queued"] * len(work))
            return False
        r.load_work = work
        r.undone = None  # as in reload
        self._start(r, move, fut, S.RELOADING)
        return True

    def _reload_ended(self, r: RequestRecord, ok: bool) -> None:
        """Count what the reload's layers did and take its progress off the record;
        a failed one admitted early gives back what the step added since it started
        (tokens, written spans, device pages: the source holds only the rest)."""
        p, r.layers = r.layers, None
        if not ok and r.admitted_early:  # the step running on it cannot go on
            r.undone = (p.reason if p is not None and p.reason else "its copy failed")
        r.admitted_early = False
        if p is None:
            return
        first = p.first_layer_s()
        if first is not None:
            self._stats.reload_first_layer_s_total += first
        self._stats.layer_wait_s_total += p.waited_s
        if not ok and r.num_tokens != p.base_tokens:
            self._stats.reloads_undone += 1
            r.num_tokens = p.base_tokens
            r.forget_written_from(p.base_tokens)

    def _start(self, r: RequestRecord, move: Move, fut: cf.Future, state: RequestState) -> None:
        if IN_FLIGHT[move] is not state:
            raise ValueError(f"_start: {move.value} runs in state {IN_FLIGHT[move].value}, "
                             f"not {state.value}")
        self._life.begin(r, TransferJob(move, fut, self._clock()))

    def cancel_offload(self, r: RequestRecord) -> None:
        """The request is wanted again before its offload copy started: take
        the copy back (a copy already running is left to finish)."""
        if not r.job.future.cancel():
            return
        self._unreported.append(self._life.cancel(r))

    def remove(self, r: RequestRecord) -> None:
        """``remove_request``: a copy not started is cancelled; a running one keeps its
        slots under a fresh key (a tombstone) until it ends."""
        rid = r.rid
        if r.job is not None and r.job.future.done():
            self.finish_now(r)  # a finished copy's outcome (a fault too) is still reported
        prefix = self._reuse.blocks
        if r.load_work is not None:  # a prefix load in flight
            job, work = r.job, r.load_work
            if job.future.cancel():
                prefix.finish_load(None, work, ["cancelled"] * len(work))
                self._unreported.append(TransferResult(rid, job.move, False, 0, None, CANCELLED))
            else:  # it ends in poll; its blocks stay mapped by it until then
                keys = {w[0] for w in work}
                for key in r.blocks:
                    if key not in keys:
                        prefix.index.release(key)
                prefix.orphans.append((job.future, work))
                r.blocks, r.shared = [], []
            r.job, r.load_work, r.prefix_load = None, None, None
            self._pages.release_all(r)
            self._life.forget(rid)
            return
        if prefix is not None and r.blocks:
            prefix.release_request(r)
        job = r.job
        fut = job.future if job else None
        if fut is not None and fut.cancel():  # never started: reported as not done
            self._unreported.append(TransferResult(
                rid, job.move, False, 0, None, CANCELLED))
            self._pages.release_all(r)
        elif fut is not None and not fut.done():
            key = ("removed", next(self._tomb_seq))
            for pool, slots in ((self._s.device_pool, r.device), (self._s.host_pool, r.host)):
                pool.transfer_ownership(rid, key, slots)
            if r.disk is not None and job.move is Move.RELOAD_FROM_DISK:
                # the extent stays reserved until the read ends, but its
                # committed entry must not outlive the request
                self._s.disk_call(self._s.disk.uncommit, r.disk)
            self.tombstones[key] = Tombstone(key, rid, job.move, fut, r.device, r.host, r.disk)
        else:
            self._pages.release_all(r)
        self._life.forget(rid)

    # -- completion (caller's thread) -------------------------------------------------

    def poll(self) -> list[TransferResult]:
        self._life.check_open("poll")
        prefix = self._reuse.blocks
        if prefix is not None:
            prefix.poll_shared()  # the shared cold tier: finished fetches and publishes
        if prefix is not None and prefix.orphans:
            prefix.poll_orphans()
        done, self._unreported = self._unreported, []
        for r in [r for r in self._life.inflight.values() if r.job.future.done()]:
            res = self._finish(r)
            if res is not None:
                done.append(res)
        for key in [k for k, t in self.tombstones.items() if t.future.done()]:
            done.append(self._bury(self.tombstones.pop(key)))
        if done and self._feeds:
            self._feeds = [f for f in self._feeds if not f.closed]
            for f in self._feeds:
                f.put(done)
        return done

    def completion_feed(self) -> CompletionFeed:
        self._life.check_open("completion_feed")
        feed = CompletionFeed()
        self._feeds.append(feed)
        return feed

    def _bury(self, t: Tombstone) -> TransferResult:
        exc = t.future.exception() if not t.future.cancelled() else None
        self._s.device_pool.release(t.key, t.device)
        self._s.host_pool.release(t.key, t.host)
        if t.disk is not None:
            self._s.disk_call(self._s.disk.release, t.disk)
        n = len(t.device) or len(t.host) or (t.disk.num_pages if t.disk is not None else 0)
        nbytes = n * self._g.page_bytes if exc is None else 0
        return TransferResult(t.rid, t.move, exc is None, nbytes, None,
                              None if exc is None else _why(exc))

    def finish_now(self, r: RequestRecord) -> None:
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
            return self.completions[job.move](r, job, exc)
        except Exception as err:  # a bug or an unexpected fault: keep the records consistent
            self._stats.completion_errors += 1
            log.exception("request %r: completing %s failed", r.rid, job.move.value)
            reason = f"completing {job.move.value} failed: {_why(err)}"
            r.layers = None
            if r.state is not S.LOST:
                try:
                    self._life.mark_lost(r, reason)
                except Exception:  # records already broken: leave it to check_integrity
                    log.exception("request %r: could not mark it lost", r.rid)
            return TransferResult(r.rid, job.move, False, 0, r.state, reason)

    def _done_prefix_load(self, r, job, exc):
        p = self._reuse.blocks
        work, r.load_work = r.load_work, None
        results = job.future.result() if exc is None else [f"read_failed: {_why(exc)}"] * len(work)
        kept, reason = p.finish_load(r, work, results)
        positions, cut = r.prefix_load.positions, r.prefix_load.failed
        r.prefix_load = None
        reason = reason or cut  # blocks cut before the load (a failed shared fetch)
        if kept < len(work):
            p.truncate(r, positions[kept], reason)
        self._life.set_state(r, S.RESIDENT)
        nbytes = kept * self._g.page_bytes
        self._stats.reload_stall_s_total += max(0.0, self._clock() - job.started)
        return TransferResult(r.rid, job.move, reason is None, nbytes, S.RESIDENT, reason)

    def _nbytes(self, r: RequestRecord) -> int:
        return own_pages(self._g, r) * self._g.page_bytes

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
            self._s.disk.commit(r.rid, r.disk, {"num_tokens": r.num_tokens, "checksum": checksum})
            return None
        except Exception as exc:
            self._stats.commit_failures += 1
            return exc

    def wait_all(self, timeout: float) -> tuple[set, bool, float]:
        """``synchronize``'s wait: the copies still running after ``timeout``, whether the
        shared tier's queue went idle (its fetches and publishes), and the timeout checked
        (the caller polls, then raises for what is left)."""
        self._life.check_open("synchronize")
        timeout = check_timeout("synchronize", timeout)
        futs = [r.job.future for r in self._life.inflight.values()]
        futs += [t.future for t in self.tombstones.values()]
        prefix = self._reuse.blocks
        left, idle = timeout, True
        if prefix is not None:
            futs += [f for f, _ in prefix.orphans]
            idle, left = prefix.wait_shared(timeout)
        _, pending = cf.wait(futs, timeout=left)
        return pending, idle, timeout

    def in_flight(self) -> int:
        self._life.check_open("in_flight")
        orphans = len(self._reuse.blocks.orphans) if self._reuse.blocks is not None else 0
        return len(self._life.inflight) + len(self.tombstones) + orphans
