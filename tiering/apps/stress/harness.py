"""The stress harness: the real cache, controller and disk tier under a random workload.

Size: the module is about 700 lines and ``StressHarness`` most of it, on
purpose: every path of a run (steps, losses and recomputes, id reuse,
restarts, the second open, the drain) reads and changes the same table of
live requests, the same tombstones of removed requests' copies and the same
counters, and the run's verdicts (every reload read back, every loss tied to
a fault, nothing left after the drain) are drawn across all of them. The
parts that stand alone are beside it: the records and counters (``records``),
the workload's KV (``kvdata``), the faults (``faults``), the second open
(``second_open``) and the report (``report``).

``StressHarness`` owns one ``tiering.TieredKV`` (``tkv``): a ``PagedKVCache``
(device, host and a disk tier in a directory) with its ``EvictionController``
reading the device pool's exact occupancy; and the faults of the run. The
workload registers, asks back, settles and removes requests through ``tkv``;
it reads and writes KV, injects faults and inspects states on the cache
itself (``tkv.kv``). Each ``step``:

1. collects requests the cache lost (``take_lost``); each is forgotten and, if
   it was still wanted, recomputed: added again with fresh KV;
2. lets a request arrive (seeded), and places waiting arrivals on the device
   in order: ``allocate``, then ``write`` of every layer from the request's
   regenerable KV (``tiering.apps.stress.kvdata``);
3. reads back every request whose reload has landed (and keeps those still
   reloading or unread from eviction), so every reload is verified;
4. picks a random batch of requests: a resident one that ``tkv.ready`` finds
   READY is read back layer by layer and compared bit for bit with its
   regenerated KV and grows by a few tokens (``allocate`` + ``write``); an
   offloaded one is asked back (``tkv.ready`` again);
5. lets finished and cancelled requests leave. While a failing fault kind is
   armed, a request leaves only once its transfer has settled (a copy cut
   loose from its request could absorb a fault no request would show);
   otherwise it leaves at once, even mid-copy, and half the cancellations
   aim at requests with a transfer in flight;
6. calls ``tkv.after_step(ran, coming back)`` (touches what ran, then the
   controller's safe-point pass): the device is small for the
   working set and ``high`` is low, so the device sits at the watermark, most
   offloads make room for waiting reloads, the host tier keeps demoting to
   disk, and copies are in flight on the cache's worker threads all the time;
7. if nothing could run, waits (bounded) for the transfers in flight
   (``tkv.synchronize``).

``tkv.check_integrity`` (the cache's pools, the controller's ledgers, the two
agree on which requests exist) runs after every step, or after every single
cache or front-door call when ``check_every_op`` is set. ``drain`` lets every
request leave and checks that every tier is then entirely free.

The optional paths (``StressConfig.paths``):

- ``remove_in_flight``: step 5 removes requests whatever their transfers are
  doing, faults or not; every ``TransferResult`` the cache's ``poll`` returns
  is kept, and a failed copy of a removed request (``state=None``) is tied to
  the fault that struck it (``tiering.apps.stress.accounting``).
- ``reuse_ids``: a request that left may come back under its id with the next
  generation of its KV (``request_kv(seed, rid, generation)``): at once when it
  was removed with a copy in flight, else at a later arrival. Every read of it
  is compared with that generation, so an old generation's byte served for
  the new one is a data error.
- ``reattach``: ``restart`` closes ``tkv`` and opens a new one over the same
  directory (``on_start="reattach"``). Exactly the requests that were on disk
  must come back, with their token counts; each is verified bit for bit when
  it is next read (``drain`` reloads those not read yet). Requests that were
  on the device or the host died with the old cache and are recomputed.
- ``second_open``: ``second_open_check`` lets a child process try to open a
  cache on the live disk directory (``tiering.apps.stress.second_open``).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tiering.apps.stress.config import RELOAD_HEADROOM, StressConfig
from tiering.apps.stress.faults import FaultInjector
from tiering.apps.stress.kvdata import derived_seed, mismatched_layers, request_kv, write_tokens
from tiering.apps.stress.memory import RssTracker
from tiering.apps.stress.records import HarnessCounts, RecordingKVCache, Wanted, sum_disk_stats
from tiering.apps.stress.second_open import (
    SecondOpenOutcome,
    attempt_second_open,
    directory_digest,
    verdict,
)
from tiering.control.controller import ControllerConfig
from tiering.control.pressure import PoolPressure
from tiering.core.clocks import StepClock
from tiering.disk.config import DiskConfig
from tiering.tiered import Readiness, TieredKV
from tiering.types import CANCELLED, Move, RequestState

S = RequestState
_T = TypeVar("_T")
#: How many examples of each kind of failure a report keeps.
EXAMPLES = 20


class StressHarness:
    """One stress run whose disk tier lives in ``directory``/disk (cleared at start).

    ``sleep`` is what a slow disk fault waits with (a recorder in tests).
    Not thread-safe: drive it from one thread.
    """

    def __init__(
        self,
        config: StressConfig,
        directory: str | Path,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        c = config
        g = c.geometry
        self._rng = random.Random(derived_seed("workload", c.seed))
        self.clock = StepClock()
        self.faults = FaultInjector(
            c.faults, seed=derived_seed("faults", c.seed), rate=c.fault_rate,
            slow_seconds=c.slow_seconds, sleep=sleep,
        )
        page = g.page_bytes
        self.directory = Path(directory)
        self.disk_config = DiskConfig(
            path=self.directory / "disk",
            capacity_bytes=c.disk_chunks * c.max_request_pages * page,
            chunk_bytes=c.max_request_pages * page,
            io_threads=1,
            on_start="reattach" if c.has("reattach") else "clear",
        )
        self._retired_kv: Counter[str] = Counter()
        self._retired_disk: dict[str, Any] = {}
        self._open_cache()
        self.counts = HarnessCounts()
        self.occupancy_total = 0.0  # device occupancy summed over the steps' eviction passes
        self.rss = RssTracker()
        self.lost: list[tuple[str, str]] = []
        self.data_error_examples: list[str] = []
        self.integrity_examples: list[str] = []
        self._live: dict[str, Wanted] = {}
        self._waiting: deque[str] = deque()  # arrivals not yet placed, in order
        self._serial = 0
        self._draining = False
        self._per_op = c.check_every_op
        self._generations: dict[str, int] = {}  # rid -> the last generation used
        self._reuse: deque[str] = deque()  # ids that left and may come back
        self._tombs: Counter[str] = Counter()  # rid -> copies of removed requests still running
        self.removed_failures: list[tuple[Move, str]] = []  # failed copies of removed requests
        self.restart_problems: list[str] = []
        self._unverified_reattached: set[str] = set()
        self.second_open: SecondOpenOutcome | None = None
        self._milestones_done: set[float] = set()

    def _open_cache(self) -> None:
        """Build the cache over ``disk_config`` and the ``TieredKV`` around it (which
        registers the requests a reattach brought back)."""
        c = self.config
        kv = RecordingKVCache(
            c.geometry, c.device, device_pages=c.device_pages, host_pages=c.host_pages,
            disk=self.disk_config, verify=True, copy_workers=c.copy_workers,
            io_workers=c.io_workers, clock=self.clock, copy_fault_hook=self.faults.copy_hook,
            disk_wrap_store=self.faults.wrap_store,
        )
        try:
            if kv.disk.pages_per_chunk != c.max_request_pages:
                raise AssertionError("a request's disk copy must be exactly one chunk")
        except BaseException:
            kv.close()
            raise
        self.tkv = TieredKV.around(  # closes the cache itself if it cannot be built
            kv,
            policy=c.policy,
            pressure=PoolPressure,
            controller=ControllerConfig(
                high=c.high, low=c.low, host_high=c.host_high, host_low=c.host_low,
                min_residency_s=c.min_residency_steps, aging_s=c.aging_steps,
                reload_headroom=RELOAD_HEADROOM, on_disk_full="keep",
            ),
            clock=self.clock,
        )
        self.kv = kv

    # -- what every cache of the run did, together --------------------------------------

    def kv_stats(self) -> dict[str, float]:
        """``PagedKVCache.stats`` summed over every cache of the run (restarts included)."""
        out = dict(self._retired_kv)
        for k, v in self.tkv.stats("kv").items():
            out[k] = out.get(k, 0) + v
        return out

    def disk_stats(self) -> dict[str, Any]:
        """``DiskPageStore.stats()`` with the counters summed over every cache of the run;
        occupancy (``extents``, ``used_bytes``, ...) is the current cache's."""
        return sum_disk_stats(self._retired_disk, self.kv.disk.stats())

    # -- the step -------------------------------------------------------------------

    def step(self) -> None:
        """One worker step (see the module docstring)."""
        self.clock.advance()
        self.counts.steps += 1
        self._absorb_results()
        self._collect_lost()
        self._arrive()
        self._check_landed()
        ran = self._run_batch()
        self._collect_lost()
        self._depart()
        occupancy = self.kv.device_used_bytes() / self.kv.device_capacity_bytes
        self.occupancy_total += occupancy
        if occupancy >= self.config.high - RELOAD_HEADROOM:
            self.counts.steps_at_high += 1
        still = [rid for rid in ran if self.tkv.knows(rid)]  # finished ones have left
        self._op(self.tkv.after_step, still, self._coming_back())
        self._collect_lost()
        if not ran and self.kv.in_flight():
            self.counts.waits += 1
            self._op(self.tkv.synchronize, self.config.sync_timeout_s)
            self._collect_lost()
        self._absorb_results()
        if not self._per_op:
            self.check_integrity()
        self.rss.sample()

    def at_progress(self, done: float) -> None:
        """Run what is due once the run is ``done`` (0..1) through: the restarts of a
        ``reattach`` run and the second-open check, each once."""
        c = self.config
        points = [(p, self.restart) for p in c.restart_points]
        if c.has("second_open"):
            points.append((c.second_open_at, self.second_open_check))
        for point, action in sorted(points, key=lambda pa: pa[0]):
            if done >= point and point not in self._milestones_done:
                self._milestones_done.add(point)
                action()

    def live_requests(self) -> int:
        return len(self._live)

    # -- operations and checks ---------------------------------------------------------

    def _op(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Call one cache or front-door operation, counted, checked after when asked."""
        self.counts.operations += 1
        try:
            return fn(*args)
        finally:
            if self._per_op:
                self.check_integrity()

    def _absorb_results(self) -> None:
        """Take the cache's transfer results: a removed request's finished copy
        (``state=None``) is one fewer still running under that id; a failed one is
        kept for the fault accounting."""
        for res in self.kv.take_results():
            if res.state is not None or res.reason == CANCELLED:  # no tombstone: never copied
                continue
            self._tombs[res.rid] -= 1
            if self._tombs[res.rid] <= 0:
                del self._tombs[res.rid]
            if not res.ok:
                self.counts.removed_copies_failed += 1
                self.removed_failures.append((res.move, res.reason or ""))

    def _write(self, *args: Any) -> None:
        self._op(self.kv.write, *args)

    def _read(self, *args: Any):
        return self._op(self.kv.read, *args)

    def check_integrity(self) -> None:
        """Run the front door's check (pools, ledgers, membership); a failure is
        counted, not raised."""
        self.counts.integrity_checks += 1
        try:
            self.tkv.check_integrity()
        except AssertionError as exc:  # PoolIntegrityError is one
            self._violation(f"step {self.counts.steps}: {exc}")

    def _violation(self, text: str) -> None:
        self.counts.integrity_violations += 1
        if len(self.integrity_examples) < EXAMPLES:
            self.integrity_examples.append(text)

    def _data_error(self, text: str) -> None:
        self.counts.data_errors += 1
        if len(self.data_error_examples) < EXAMPLES:
            self.data_error_examples.append(text)

    # -- arrivals ------------------------------------------------------------------------

    def _arrive(self) -> None:
        c = self.config
        if not self._draining and len(self._live) < c.max_live:
            if self._rng.random() < c.arrival_rate:
                self._serial += 1
                pages = self._rng.randint(1, c.max_request_pages)
                T = c.geometry.page_tokens
                prompt = self._rng.randint((pages - 1) * T + 1, pages * T)
                final = min(c.max_tokens, prompt + self._rng.randint(0, 3 * c.decode_tokens))
                runs = self._rng.randint(1, c.max_runs)
                rid = self._reused_id()
                if rid is None:
                    rid = f"r{self._serial}"
                gen = self._next_generation(rid)
                self._start(Wanted(rid, gen, prompt, final, runs, self.counts.steps,
                                    reused=gen > 0))
                self.counts.arrivals += 1
        self._place_waiting()

    def _next_generation(self, rid: str) -> int:
        """The generation of ``rid``'s next KV: 0 for a new id, one more each time it
        comes back (recomputed, reused or restarted)."""
        gen = self._generations.get(rid, -1) + 1
        self._generations[rid] = gen
        return gen

    def _reused_id(self) -> str | None:
        """An id that left and is not alive now, if one waits to come back."""
        while self._reuse:
            rid = self._reuse.popleft()
            if rid not in self._live:
                self._note_reuse(rid)
                return rid
        return None

    def _note_reuse(self, rid: str) -> None:
        self.counts.reused += 1
        if self._tombs.get(rid, 0) > 0:
            self.counts.reused_while_in_flight += 1

    def _reuse_now(self, rid: str) -> None:
        """Ingest ``rid`` again at once, as a fresh request with new KV."""
        c = self.config
        self._note_reuse(rid)
        pages = self._rng.randint(1, c.max_request_pages)
        T = c.geometry.page_tokens
        prompt = self._rng.randint((pages - 1) * T + 1, pages * T)
        final = min(c.max_tokens, prompt + self._rng.randint(0, 3 * c.decode_tokens))
        self._start(Wanted(rid, self._next_generation(rid), prompt, final,
                            self._rng.randint(1, c.max_runs), self.counts.steps, reused=True))
        self.counts.arrivals += 1

    def _start(self, w: Wanted) -> None:
        self._op(self.tkv.add, w.rid)
        self._live[w.rid] = w
        self._waiting.append(w.rid)

    def _place_waiting(self) -> None:
        """Place waiting arrivals on the device, oldest first, until one does not fit.

        Arrivals and reloads share the device fairly: the head arrival is
        placed if it came before every offloaded request still waiting to come
        back, or if it fits under the ``high`` watermark; otherwise it (and
        every arrival behind it) waits. New work would else keep taking the
        room that offloaded requests wait for, and once the tiers below are
        full nothing could be moved out to make room for them."""
        kv, g = self.kv, self.config.geometry
        offloaded = (S.ON_HOST, S.DEMOTING, S.ON_DISK)
        oldest_reload = min(
            (w.asked_at for w in self._live.values()
             if w.asked_at is not None and kv.state_of(w.rid) in offloaded),
            default=None,
        )
        room = self.config.high * kv.device_capacity_bytes
        while self._waiting:
            w = self._live.get(self._waiting[0])
            if w is None or w.leaving or w.placed:
                self._waiting.popleft()
                continue
            if (
                oldest_reload is not None
                and w.arrived_at > oldest_reload
                and kv.device_used_bytes() + g.pages_for(w.prompt_tokens) * g.page_bytes > room
            ):
                return
            if not self._op(kv.allocate, w.rid, w.prompt_tokens):
                return
            data = self._kv_of(w)
            write_tokens(self._write, w.rid, data, 0, w.prompt_tokens)
            w.tokens = w.prompt_tokens
            w.placed = True
            self._waiting.popleft()

    def _kv_of(self, w: Wanted):
        c = self.config
        return request_kv(c.geometry, c.seed, w.rid, w.generation, c.max_tokens)

    # -- running -------------------------------------------------------------------------

    def _run_batch(self) -> list[str]:
        ready = [w for w in self._live.values() if w.placed and not w.leaving]
        batch = self._rng.sample(ready, min(self.config.batch, len(ready)))
        return [w.rid for w in batch if self._run_one(w)]

    def _run_one(self, w: Wanted) -> bool:
        """Run ``w`` if it is on the device (read back, check, grow); else ask it back."""
        state = self.kv.state_of(w.rid)
        if state in (S.ON_HOST, S.DEMOTING, S.ON_DISK):
            w.away = True
            if w.asked_at is None:
                w.asked_at = self.counts.steps
            self.counts.reload_requests += 1
            self._op(self.tkv.ready, w.rid, self.counts.steps)  # asks it back
            return False
        if state is S.RELOADING:
            w.away = True
        elif state is not S.RESIDENT:
            return False  # offloading: ask later; lost: collected by _collect_lost
        if self._op(self.tkv.ready, w.rid, self.counts.steps) is not Readiness.READY:
            return False
        self._verify(w)
        self._grow(w)
        return True  # touched by after_step

    def _check_landed(self) -> None:
        """Read back every request whose reload has landed, before anything else may
        move it again: so every reload is verified (``reloads_verified``)."""
        for w in [w for w in self._live.values() if w.away]:
            self._verify_if_back(w)

    def _verify_if_back(self, w: Wanted) -> None:
        if self.kv.state_of(w.rid) in (S.RESIDENT, S.RELOADING):
            if self._op(self.tkv.ready, w.rid, self.counts.steps) is Readiness.READY:
                self._verify(w)

    def _coming_back(self) -> list[str]:
        """Requests reloading or reloaded but not yet read back: kept from eviction
        like running ones (a worker is about to run them)."""
        back = (S.RESIDENT, S.RELOADING)
        return [w.rid for w in self._live.values() if w.away and self.kv.state_of(w.rid) in back]

    def _verify(self, w: Wanted) -> None:
        held = self.kv.num_tokens(w.rid)
        if held != w.tokens:
            self._data_error(f"{w.rid}: holds {held} tokens, {w.tokens} were written")
            return
        bad = mismatched_layers(self._read, w.rid, self._kv_of(w), w.tokens)
        if bad:
            self._data_error(
                f"{w.rid} (generation {w.generation}, {w.tokens} tokens): layers {bad} read back "
                "different bits from those written"
            )
        self.counts.reads_verified += 1
        if w.reused:
            self.counts.reused_reads_verified += 1
        if w.rid in self._unverified_reattached:
            self._unverified_reattached.discard(w.rid)
            self.counts.reattach_verified += 1
        if w.away:
            self.counts.reloads_verified += 1
            w.away = False
        w.asked_at = None

    def _grow(self, w: Wanted) -> None:
        w.runs_left -= 1
        if w.runs_left <= 0:
            w.leaving = "finished"
            return
        if w.tokens >= w.final_tokens:
            return
        n = min(self._rng.randint(1, self.config.decode_tokens), w.final_tokens - w.tokens)
        if self._op(self.kv.allocate, w.rid, w.tokens + n):
            write_tokens(self._write, w.rid, self._kv_of(w), w.tokens, w.tokens + n)
            w.tokens += n

    # -- leaving and losses ------------------------------------------------------------------

    def _depart(self) -> None:
        c = self.config
        anytime = c.has("remove_in_flight") or not self.faults.any_failing
        if not self._draining and self._live and self._rng.random() < c.cancel_rate:
            # a reattached request not yet read back stays until it is (see drain)
            pool = [w for w in self._live.values() if w.rid not in self._unverified_reattached]
            if anytime and self._rng.random() < 0.5:
                # half the cancellations aim at a request with a transfer in flight, each
                # kind of transfer (offload, demotion, reload) as often as the others
                moving: dict[RequestState, list[Wanted]] = {}
                for w in pool:
                    state = self.kv.state_of(w.rid)
                    if state.in_flight:
                        moving.setdefault(state, []).append(w)
                if moving:
                    pool = moving[self._rng.choice(sorted(moving, key=lambda st: st.value))]
            if pool:
                w = self._rng.choice(pool)
                w.leaving = w.leaving or "cancelled"
        for w in [w for w in self._live.values() if w.leaving]:
            if w.away:
                self._verify_if_back(w)  # a landed reload is checked even if it leaves now
            if w.rid in self._unverified_reattached:
                self._bring_back_to_verify(w)
                continue
            state = self.kv.state_of(w.rid)
            if state.in_flight:
                if not anytime:
                    continue  # leaves once its transfer has settled
                self.counts.removed_in_flight += 1
                name = f"removed_{state.value}"
                setattr(self.counts, name, getattr(self.counts, name) + 1)
            self._forget(w)
            reason = w.leaving
            setattr(self.counts, reason, getattr(self.counts, reason) + 1)
            if self._draining or not c.has("reuse_ids") or self._rng.random() >= c.reuse_rate:
                continue
            if state.in_flight and self.kv.in_flight():
                self._reuse_now(w.rid)  # while the removed request's copy may still run
            else:
                self._reuse.append(w.rid)

    def _bring_back_to_verify(self, w: Wanted) -> None:
        """Drain: a reattached request never read back is reloaded and read first
        (straight on the cache: no eviction pass runs while draining, so a reload
        the controller queued would never be admitted)."""
        state = self.kv.state_of(w.rid)
        w.away = True
        if state in (S.ON_HOST, S.ON_DISK):
            self._op(self.kv.reload, w.rid)

    def _forget(self, w: Wanted) -> None:
        before = self.kv.in_flight()
        moving = self.kv.state_of(w.rid).in_flight
        self._op(self.tkv.remove, w.rid)
        if moving and self.kv.in_flight() == before:
            # its copy had started: it runs on without a request and reports when it ends
            self._tombs[w.rid] += 1
        del self._live[w.rid]

    def _collect_lost(self) -> None:
        """Record every loss; recompute a lost request that is still wanted."""
        for rid, reason in self.kv.take_lost():
            self.lost.append((rid, reason))
            w = self._live.get(rid)
            if w is None:
                continue
            if rid in self._unverified_reattached:
                self._unverified_reattached.discard(rid)
                self.counts.reattach_lost_to_faults += 1
            self._forget(w)
            if w.leaving:
                setattr(self.counts, w.leaving, getattr(self.counts, w.leaving) + 1)
                continue
            # recompute: the same request, fresh KV, as far as it had got
            self.counts.recomputed += 1
            self._recompute(w)

    def _recompute(self, w: Wanted) -> None:
        """Ingest ``w`` again with the next generation of its KV, as far as it had got."""
        self._start(Wanted(w.rid, self._next_generation(w.rid), max(1, w.tokens),
                            max(w.final_tokens, w.tokens, 1), w.runs_left, self.counts.steps,
                            reused=w.reused))

    # -- restart over the same directory (reattach) --------------------------------------

    def _settle(self) -> None:
        """Wait for every transfer (bounded), take what they did, and read back every
        reload that landed (so every reload is verified before anything moves it)."""
        self._op(self.tkv.synchronize, self.config.sync_timeout_s)
        self._absorb_results()
        self._collect_lost()
        self._check_landed()

    def restart(self) -> None:
        """Close ``tkv`` and open a new one over the same directory (``on_start=
        "reattach"``); check that exactly the requests on disk came back."""
        self._settle()
        kv = self.kv
        on_disk = {rid: kv.num_tokens(rid) for rid in kv.requests()
                   if kv.state_of(rid) is S.ON_DISK}
        self._retire()
        self._open_cache()
        self.counts.restarts += 1
        kv = self.kv
        found = {rid: (kv.state_of(rid), kv.num_tokens(rid)) for rid in kv.requests()}
        at = f"restart {self.counts.restarts} (step {self.counts.steps})"
        stale = sorted(set(found) - set(on_disk))
        if stale:
            self.restart_problems.append(
                f"{at}: {len(stale)} request(s) came back that were not on disk: {stale[:10]}")
        missing = sorted(set(on_disk) - set(found))
        if missing:
            self.restart_problems.append(
                f"{at}: {len(missing)} request(s) on disk did not come back: {missing[:10]}")
        for rid, (state, tokens) in sorted(found.items()):
            if rid in on_disk and (state is not S.ON_DISK or tokens != on_disk[rid]):
                self.restart_problems.append(
                    f"{at}: {rid} came back {state.value} with {tokens} tokens; it was on disk "
                    f"with {on_disk[rid]}")
                stale.append(rid)
        for rid in stale:  # what should not have come back goes, so the rest stays clean
            self._op(self.tkv.remove, rid)
        self.check_integrity()
        # the live requests: those that came back are on disk (the new TieredKV
        # registered them), the rest died with the cache
        self._waiting.clear()
        for w in list(self._live.values()):
            if w.rid in found and w.rid not in stale:
                w.away = True
                w.asked_at = None
                if w.rid not in self._unverified_reattached:  # still unread since an earlier
                    self.counts.reattached += 1               # restart: counted once
                self._unverified_reattached.add(w.rid)
            else:
                del self._live[w.rid]
                self.counts.restart_recomputed += 1
                if w.placed:
                    self._recompute(w)
                else:  # it had not been placed yet: it arrives again as it was
                    self._start(Wanted(w.rid, self._next_generation(w.rid), w.prompt_tokens,
                                        w.final_tokens, w.runs_left, self.counts.steps,
                                        reused=w.reused))
        self._tombs.clear()  # the old cache finished every copy before it closed

    def _retire(self) -> None:
        """Close the current ``tkv``, keeping its cache's counters for the report."""
        kv = self.kv
        try:
            self.tkv.close()
        finally:
            self._absorb_results()
            self._retired_kv.update(self.tkv.stats("kv"))
            self._retired_disk = sum_disk_stats(self._retired_disk, kv.disk.stats())

    # -- a second process on the same path ---------------------------------------------------

    def second_open_check(self) -> SecondOpenOutcome:
        """With no transfer in flight, a child tries to open a cache on the live disk
        directory; its outcome is judged by ``tiering.apps.stress.second_open.verdict``. If
        the open was tolerated and the directory changed, the requests on disk can no
        longer be trusted: they are dropped and recomputed (never read)."""
        self._settle()
        root = Path(self.disk_config.path)
        before = directory_digest(root)
        report = attempt_second_open(self.config.geometry, self.disk_config,
                                     timeout_s=self.config.child_timeout_s)
        after = directory_digest(root)
        outcome = verdict(report, path=os.fspath(root), holder_pid=os.getpid(),
                          before=before, after=after)
        self.second_open = outcome
        if not outcome.data_unchanged:
            for w in list(self._live.values()):
                if self.kv.state_of(w.rid) is S.ON_DISK:
                    self._forget(w)
                    self._unverified_reattached.discard(w.rid)
                    self.counts.second_open_discarded += 1
                    self._recompute(w)
        self.check_integrity()
        return outcome

    # -- the end ---------------------------------------------------------------------------

    def drain(self, max_rounds: int = 1000) -> None:
        """Let every request leave (waiting for transfers as needed), then check that
        the cache, the controller and every tier are empty; what is not counts as an
        integrity violation."""
        self._draining = True
        for w in self._live.values():
            w.leaving = w.leaving or "drained"
        for _ in range(max_rounds):
            self._absorb_results()
            self._collect_lost()
            self._depart()
            if not self._live:
                break
            self._op(self.tkv.synchronize, self.config.sync_timeout_s)
        self._settle()
        self.check_integrity()
        for problem in self.leftovers():
            self._violation(f"after drain: {problem}")
        if self._unverified_reattached:
            self.restart_problems.append(
                f"{len(self._unverified_reattached)} reattached request(s) were never read "
                f"back: {sorted(self._unverified_reattached)[:10]}")

    def leftovers(self) -> list[str]:
        """What is still held anywhere (empty after a clean drain)."""
        kv, out = self.kv, []
        if self._live:
            out.append(f"{len(self._live)} requests did not leave: {sorted(self._live)[:10]}")
        if kv.requests():
            out.append(f"the cache still knows {len(kv.requests())} requests")
        if kv.in_flight():
            out.append(f"{kv.in_flight()} transfers still in flight")
        for name, used in (
            ("device", kv.device_used_bytes()),
            ("host", kv.host_used_bytes()),
            ("disk", kv.disk.used_bytes()),
        ):
            if used:
                out.append(f"{name} tier still holds {used} bytes")
        if self._tombs:
            out.append(f"copies of removed requests never reported: {dict(self._tombs)}")
        if kv.disk.stats()["extents"]:
            out.append(f"disk tier still holds {kv.disk.stats()['extents']} extents")
        live = self.tkv.stats("controller")["live_requests"]
        if live:
            out.append(f"the controller still tracks {live} requests")
        return out

    def close(self) -> None:
        self.tkv.close()
        self._absorb_results()
