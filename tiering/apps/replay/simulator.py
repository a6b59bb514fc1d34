"""A simulated serving worker: continuous batching over a pluggable KV backend.

Time is the simulator's own (``SimClock``), advanced by the step-time model of
``presets.StepCost``; wall time never enters. The KV backend is anything with
the request lifecycle and eviction hooks of ``tiering.resources.kv_cache.PagedKVCache``
plus ``page_tokens``, ``page_bytes`` and ``next_completion()``: the modeled
``ModeledKVCache`` normally, a real cache wrapped in ``SynchronizedKV`` to
check that both lead the controller to the same decisions.

One loop iteration is one engine step:

1. arrivals up to now join the waiting queue (a request whose final KV could
   never fit under the controller's admission limit is rejected);
2. safe point (``tiering`` only): ``EvictionController.evict_if_needed`` with
   the active requests as running (cached prefix blocks no request maps are not
   in the used figures it reads, as in the cache: they leave only when room is
   needed, below).
   The call is skipped while nothing it looks at has changed since a call that
   found nothing to do (see ``_Worker._still_quiet``; a test checks that runs
   are identical either way);
3. preempted requests resume first-preempted first: a resident one rejoins
   the batch, an offloaded one asks the controller for a reload. No new
   request is admitted while any is preempted (vLLM's rule);
4. the step is built: decoding requests that need a new page get it,
   prefilling requests get a chunk of the token budget, and waiting requests
   are admitted while the batch, the budget and the device allow;
5. the step runs for ``StepCost.step_s`` seconds; first tokens and finishes
   are recorded at its end.

Cached prefix blocks make room as in the cache (``block_tiers``): an allocation, a
reload or a load that needs device pages first moves the device block policy's
victims down (or drops them, ``make_room="drop"``), and an offload that needs host
pages first moves host blocks to disk. Under memory shortage (a page cannot be
allocated even so) the modes differ:

``tiering``    the request stalls for a step while memory is on its way (an
               offload in flight, or an idle request the controller can
               offload); otherwise the latest-arrived active request (or,
               with ``SimConfig.preempt="policy"``, the first of the batch
               in the run's policy's order) is preempted and left idle on
               the device, where it is an offload candidate for the
               controller.
``recompute``  the latest-arrived active request is preempted and its KV
               freed at once; it is prefilled again later (vLLM's default).
``no-tiering`` a request is admitted only with room for its whole final KV,
               so it never needs to grow; requests wait for room.

Finished requests leave their full prompt blocks behind as cached blocks
(``block_tiers.PrefixBlocks``: the ``BlockIndex`` and the block policies, when
the trace has block ids and ``prefix_reuse`` is on); a later request reuses the
longest cached prefix block by block from whichever tier holds each block: from
the device at no cost, from host or disk at the cost of the copy
(``copy_in``), which the request waits for instead of prefilling those tokens.
Admission drives the blocks as a worker on ``PagedKVCache`` does: a request whose
prompt the device could not hold even with every unmapped block gone waits,
untouched; otherwise it is attached (the block policies told) before any room is
made, its loads get their pages, and it takes its own pages at once or, with
loads, when they land (a request refused then is freed and waits again, first).

Size: ``_Worker`` is over 800 lines because it is the one owner of a modelled
step's state (the queues, the batch, the running set, the page budget, the
fast-forward and quiet-point bookkeeping) and its steps read that state in the
hot loop; the parts that need no such state live beside it (``block_tiers``,
``model_kv``, ``retention``, ``results``, ``config``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import Any

from tiering.apps.replay.block_guard import PolicyMeter
from tiering.apps.replay.block_tiers import PrefixBlocks
from tiering.apps.replay.config import MODES, RunSpec, SimConfig
from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.presets import HardwarePreset, ModelPreset, StepCost
from tiering.apps.replay.results import Decision, RequestRecord, RunResult, Sample, SimCounters
from tiering.apps.replay.retention import CostFilled, ReloadCosts, Retention
from tiering.apps.replay.traces import TraceRequest
from tiering.control.controller import EvictionController
from tiering.control.pressure import PoolPressure
from tiering.policies import PolicyRegistry
from tiering.policies.blocks import BlockPolicyRegistry
from tiering.resources.engine_types import ResourceReqConfig
from tiering.tiered import TieredKV
from tiering.types import RequestState, Tier

# phases of a simulated request
WAITING, LOADING, PREFILL, DECODE, STALLED, PREEMPTED, DONE, REJECTED = range(8)

_RESIDENT = RequestState.RESIDENT
_DEPTH = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}

__all__ = ["MODES", "Decision", "RequestRecord", "RunResult", "RunSpec", "SimClock",
           "SimConfig", "SimCounters", "modeled_kv_factory", "simulate"]


class SimClock:
    """The simulator's time; every part of a run reads it, only the loop moves it."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


KVFactory = Callable[[SimClock], Any]


def modeled_kv_factory(model: ModelPreset, hardware: HardwarePreset, sim: SimConfig) -> KVFactory:
    """Build ``ModeledKVCache`` instances sized by the presets."""
    page_bytes = model.kv_bytes_per_token * sim.page_tokens
    rates = LinkRates.of(hardware)

    def factory(clock: SimClock) -> ModeledKVCache:
        device_pages = hardware.device_kv_bytes // page_bytes
        if device_pages < 1:
            raise ValueError(f"hardware {hardware.name!r} has no room for one KV page")
        return ModeledKVCache(model.kv_bytes_per_token, sim.page_tokens, device_pages,
                              hardware.host_bytes // page_bytes,
                              hardware.disk_bytes // page_bytes, rates, clock)

    return factory


class _Req:
    __slots__ = (
        "rid", "order", "arrival", "n_in", "n_out", "hash_ids", "phase", "target", "done",
        "produced", "kv", "k0", "k_last", "epoch", "first_at", "finish_at", "waited_at",
        "prefix_tier", "reused", "looked_up", "blocks", "moves", "keys", "stalled_at",
    )

    def __init__(self, order: int, t: TraceRequest, time_scale: float) -> None:
        self.rid = f"r{order:06d}"
        self.order = order
        self.arrival = t.arrival_s * time_scale
        self.n_in = t.input_tokens
        self.n_out = t.output_tokens
        self.hash_ids = t.hash_ids
        self.phase = WAITING
        self.target = t.input_tokens  # tokens to prefill before decoding (more after a recompute)
        self.done = 0  # tokens of ``target`` in the KV so far
        self.produced = 0  # output tokens produced
        self.kv = 0  # KV tokens while not decoding; decoding: kv + (k - k0)
        self.k0 = 0
        self.k_last = 0
        self.epoch = 0
        self.first_at: float | None = None
        self.finish_at: float | None = None
        self.waited_at = 0.0  # when it started waiting for a reload or a prefix copy
        self.stalled_at = 0.0  # when it last stalled (sat a step out, in the batch)
        self.prefix_tier: str | None = None
        self.reused = 0
        self.looked_up = False
        self.blocks: list = []  # cached prefix blocks it maps (PrefixBlocks)
        self.moves: list = []  # of those, the ones moving up to the device for it
        self.keys: tuple = ()  # its full prompt blocks' keys


def simulate(
    trace: Sequence[TraceRequest],
    cost: StepCost,
    spec: RunSpec,
    sim: SimConfig = SimConfig(),  # noqa: B008 - frozen
    *,
    time_scale: float = 1.0,
    kv_factory: KVFactory | None = None,
    on_finish: Callable[[int], None] | None = None,
    registry: PolicyRegistry | None = None,
    block_registry: BlockPolicyRegistry | None = None,
    check: bool = False,
    block_meter: PolicyMeter | None = None,
) -> RunResult:
    """Replay ``trace`` through one simulated worker and return what happened.

    ``registry``: where ``spec.policy`` is looked up (default: the built-ins;
    a ``module:Class`` path is imported); ``block_registry``: where
    ``sim.block_policy`` is (default: the built-in block policies). ``time_scale`` multiplies arrival
    times (2.0 halves the request rate).
    ``kv_factory(clock)`` builds the KV backend (default: a ``ModeledKVCache``
    sized by the presets of ``cost``). ``on_finish(n)`` is told each time ``n``
    more requests have finished or been rejected. ``check``: run every
    ``check_integrity`` (the KV backend's, the block store's) after every round of
    the loop (tests; slow). ``block_meter``: counts and times every call into the block
    policies (a user's block policy is always metered); its figures are the result's
    ``policy_cost``.
    """
    if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not (
        math.isfinite(time_scale) and time_scale > 0
    ):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    if not trace:
        raise ValueError("the trace holds no requests")
    if not math.isfinite(max(t.arrival_s for t in trace) * time_scale):
        raise ValueError(f"time_scale {time_scale!r} puts the last arrival at infinity")
    policy = spec.policy_spec.build(registry) if spec.mode == "tiering" else None
    clock = SimClock()
    factory = kv_factory or modeled_kv_factory(cost.model, cost.hardware, sim)
    worker = _Worker(trace, cost, spec, sim, time_scale, factory(clock), clock, on_finish,
                     policy, block_registry, block_meter)
    worker.check = check
    return worker.run()


class _Worker:
    """One run. Owns every piece of simulated state; see the module docstring."""

    def __init__(self, trace, cost, spec, sim, time_scale, kv, clock, on_finish,
                 policy=None, block_registry=None, meter=None) -> None:
        self.cost = cost
        self.spec = spec
        self.sim = sim
        self.kv = kv
        self.clock = clock
        self.on_finish = on_finish
        self.mode = spec.mode
        self.tiering = spec.mode == "tiering"
        self.P = int(kv.page_tokens)
        self.page_bytes = int(kv.page_bytes)
        self.device_pages = int(kv.device_capacity_bytes) // self.page_bytes
        cfg = spec.controller
        # the controller refuses a reload above (high - headroom) x capacity, so a
        # request whose final KV is larger could never come back: reject it up front
        self.limit_pages = int((cfg.high - cfg.reload_headroom) * self.device_pages)
        self.ctl: EvictionController | None = None
        self.retention: Retention | None = None
        self.offload_room = self.tiering and sim.make_room == "offload"
        if self.tiering:
            costs = ReloadCosts(cost.hardware, cost, self.page_bytes // self.P)
            def host_free() -> int:
                return kv.host_capacity_bytes - kv.host_used_bytes()

            self.retention = Retention(policy, costs, kv.get_offload_priority, host_free)
            # the controller's policy, its offloads' and its host cascade's reload costs filled in
            self.ctl_policy = CostFilled(policy, costs, host_free)
            # assembled by the front door over the modelled cache; the worker then drives the
            # controller it owns directly, at the points of the modelled step
            self.tkv = TieredKV.around(kv, policy=self.ctl_policy, pressure=PoolPressure(kv),
                                       controller=cfg, clock=clock)
            self.ctl = self.tkv.controller
        self.reuse = sim.prefix_reuse
        if self.reuse and not (hasattr(kv, "copy_in") and hasattr(kv, "take_block_pages")):
            raise ValueError("prefix_reuse needs a KV backend with copy_in() and block pages "
                             "(take_block_pages); turn it off")
        self.live = ResourceReqConfig(retention_priority=sim.preempted_retention)
        self.prefixes: PrefixBlocks | None = (
            PrefixBlocks(kv, sim.block_policy, sim.block_tokens, clock, block_registry,
                         sim.block_policy_options, batch=sim.batch_hooks,
                         events=sim.block_decisions, meter=meter, move=self.offload_room,
                         disk_batch=sim.disk_batch_blocks)
            if self.reuse else None
        )
        # (rid, free pages, resident prefix pages) of the last admission refused for room:
        # it is not retried until one of the two figures changes
        self._refused: tuple[str, int, int] | None = None
        self.reqs = [_Req(i, t, time_scale) for i, t in enumerate(trace)]
        self.reqs.sort(key=lambda r: (r.arrival, r.order))
        self.by_rid = {r.rid: r for r in self.reqs}
        self.counters = SimCounters()
        self.decisions: list[Decision] = []
        self.timeline: list[Sample] = []
        self.k = 0  # steps run so far
        self.waiting: deque[_Req] = deque()
        self.active: set[str] = set()  # in the batch: loading, prefilling, decoding or stalled
        self.prefilling: list[_Req] = []
        self.stalled: list[_Req] = []
        self.preempted: deque[_Req] = deque()
        self.reload_asked: set[str] = set()
        self.loading: list[tuple[float, int, str]] = []  # (ready at, order, rid), a heap
        self.n_dec = 0
        self.ctx_base = 0  # sum over decoding requests of (kv - k0)
        self._plan: list[tuple[_Req, int]] = []  # this step's prefill chunks
        self.allocs: list[tuple[int, int, str]] = []  # (step, epoch, rid): needs a page
        self.finishes: list[tuple[int, int, str]] = []  # (step, epoch, rid): last token
        self.unfinished = len(self.reqs)
        self._waited = False  # the current stuck spell already let min_residency_s pass
        # the safe point is skipped while nothing the controller looks at has changed since
        # a call that found nothing to do (see _still_quiet); _gen counts such changes
        self._gen = 0
        self._quiet: tuple[int, int] | None = None
        self._fast = True  # decode-only stretches in a tight loop (see _fast_forward)
        # the running set handed to the controller, rebuilt only when _gen moved (every
        # change of ``active`` bumps it)
        self._running: tuple[int, frozenset[str]] = (-1, frozenset())
        self._evictable_at = 0.0

    # -- the loop -------------------------------------------------------------------

    def run(self) -> RunResult:
        reqs = self.reqs
        n = len(reqs)
        nxt = 0
        clock = self.clock
        idle_rounds = 0
        every = self.sim.sample_every_s
        next_sample = 0.0
        check = getattr(self, "check", False)
        while self.unfinished:
            if check:
                self.check_integrity()
            now = clock.now
            if now >= next_sample:
                self._sample(now)
                next_sample = (math.floor(now / every) + 1) * every
            while nxt < n and reqs[nxt].arrival <= now:
                self._arrive(reqs[nxt])
                nxt += 1
            if self.ctl is not None:
                self._safe_point()
            if self.loading:
                self._finish_loads(now)
            if self.preempted:
                self._serve_preempted()
            prefill_tokens = self._build_step()
            if self.prefixes is not None:
                self._log_blocks()
            if prefill_tokens or self.n_dec:
                idle_rounds = 0
                self._waited = False
                self._run_step(prefill_tokens)
                if not prefill_tokens and self._fast:
                    self._fast_forward(reqs[nxt].arrival if nxt < n else math.inf,
                                       next_sample)
                continue
            upcoming = [reqs[nxt].arrival] if nxt < n else []
            done_at = self.kv.next_completion()
            if done_at is not None:
                upcoming.append(done_at)
            if self.loading:
                upcoming.append(self.loading[0][0])
            if upcoming:
                clock.now = max(now, min(upcoming))
                # an event due now is applied by the next round; many rounds in a row that
                # neither run a step nor move the clock would be a bug, not a workload
                idle_rounds = idle_rounds + 1 if clock.now == now else 0
                if idle_rounds > 1000:
                    raise RuntimeError(self._stuck_message("1000 rounds without progress"))
                continue
            if not self.unfinished:  # the last arrivals were all rejected: nothing is left
                break
            if not self._unstick():
                raise RuntimeError(self._stuck_message("nothing can move"))
        self._sample(clock.now)
        return self._result()

    def check_integrity(self) -> None:
        """The KV backend's and the block store's own checks, and that every block a
        request maps is cached and mapped."""
        if hasattr(self.kv, "check_integrity"):
            self.kv.check_integrity()
        prefixes = self.prefixes
        if prefixes is None:
            return
        prefixes.check_integrity()
        maps: dict = {}
        for r in self.reqs:
            for k in r.blocks:
                maps[k] = maps.get(k, 0) + 1
        for k, n in maps.items():
            info = prefixes.index.get(k)
            if not (info is not None and info.refs == n):
                raise AssertionError(
                    f"block {k!r}: mapped by {n} requests, the index says "
                    f"{None if info is None else info.refs}"
                )

    def _fast_forward(self, next_arrival: float, next_sample: float) -> None:
        """Run decode-only steps in a tight loop while every round of the full loop would
        do nothing but run one: no arrival, sample, transfer completion, page allocation or
        finish is due; nothing prefills, loads, stalls or is preempted; no waiting request
        can be admitted; and the safe point has nothing to do (it would be skipped as
        quiet, or the device is under ``high`` with no reload waiting). Stops at the first
        round where any of that may change; that round runs in full. A test checks that
        runs are identical with and without it."""
        if not self.n_dec or self.prefilling or self.stalled or self.preempted or (
            self.loading or self.reload_asked
        ):
            return
        kv = self.kv
        ctl = self.ctl
        if ctl is not None:
            over = kv.device_used_bytes() > self.spec.controller.high * kv.device_capacity_bytes
            if over:
                if self._quiet is None or not self._still_quiet():
                    return
            elif ctl.pending_reloads() or ctl.demotions_in_flight:
                return
        if self.waiting and len(self.active) < self.sim.max_batch and (
            self.sim.max_step_tokens - self.n_dec > 0
        ):
            seen = (self.waiting[0].rid, self._free_pages(), self._block_pages())
            if seen != self._refused:
                return
        due = kv.next_completion()
        until_t = min(next_arrival, next_sample, math.inf if due is None else due)
        until_k = min(self.allocs[0][0] if self.allocs else math.inf,
                      self.finishes[0][0] if self.finishes else math.inf)
        clock = self.clock
        k = self.k
        now = clock.now
        if k >= until_k or now >= until_t:
            return
        n_dec = self.n_dec
        base = self.ctx_base
        step_s = self.cost.step_s
        start_k = k
        while k < until_k and now < until_t:
            now += step_s(0, n_dec, base + n_dec * k)
            k += 1
        clock.now = now
        self.k = k
        ran = k - start_k
        self.counters.steps += ran
        self.counters.fast_steps += ran

    def _sample(self, now: float) -> None:
        kv = self.kv
        c = self.counters
        self.timeline.append(Sample(
            now, kv.device_used_bytes(), kv.host_used_bytes(), kv.disk_used_bytes(),
            c.lookup_tokens, c.reused_tokens_device, c.reused_tokens_host, c.reused_tokens_disk,
        ))

    def _stuck_message(self, why: str) -> str:
        return (
            f"simulation stuck at t={self.clock.now:.3f}s ({why}): {self.unfinished} unfinished,"
            f" {len(self.waiting)} waiting, {len(self.active)} active, "
            f"{len(self.preempted)} preempted, device {self.kv.device_used_bytes()} of "
            f"{self.kv.device_capacity_bytes} bytes"
        )

    def _arrive(self, r: _Req) -> None:
        if self._pages(r.n_in + r.n_out) > self.limit_pages:
            r.phase = REJECTED
            self._count_done()
            return
        self.waiting.append(r)

    def _count_done(self) -> None:
        self.unfinished -= 1
        if self.on_finish is not None:
            self.on_finish(1)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.P)

    def _free_pages(self) -> int:
        return (self.kv.device_capacity_bytes - self.kv.device_used_bytes()) // self.page_bytes

    # -- safe point -------------------------------------------------------------------

    def _safe_point(self) -> None:
        if self._quiet is not None and self._still_quiet():
            self.counters.quiet_safe_points += 1
            return
        if self._running[0] != self._gen:  # the same frozenset while the batch is unchanged
            self._running = (self._gen, frozenset(self.active))
        cfg = self.spec.controller
        rep = self.ctl.evict_if_needed(self._running[1])  # its host cascade included
        if self.prefixes is not None:
            self._log_blocks()  # cached blocks an offload or a reload made room with
        if rep.demoted or rep.dropped:
            self._gen += 1
        fruitful = bool(rep.offloaded or rep.reloads_started or rep.demoted or rep.dropped)
        if fruitful:
            log = self.decisions
            k, now = self.k, self.clock.now
            log.extend(Decision(k, now, "offload", rid) for rid in rep.offloaded)
            log.extend(Decision(k, now, "demote", rid) for rid in rep.demoted)
            log.extend(Decision(k, now, "drop", rid) for rid in rep.dropped)
            log.extend(Decision(k, now, "reload", rid) for rid in rep.reloads_started)
            if rep.reloads_started:
                self._reloaded(now)
            for rid in rep.dropped:
                self._lost(rid)
        self._quiet = None
        if not fruitful and rep.pressure_before > cfg.high:
            self._quiet = (self._gen, self._block_changes())

    def _block_pages(self) -> int:
        """Device pages held by unmapped cached blocks (0 without prefix reuse)."""
        return self.prefixes.device_pages if self.prefixes is not None else 0

    def _block_changes(self) -> int:
        return self.prefixes.changes if self.prefixes is not None else 0

    def _log_blocks(self) -> None:
        """Moves down and drops of cached blocks go to the decisions log."""
        events = self.prefixes.events
        if events:
            k, now = self.k, self.clock.now
            # Decision(k, now, kind, str(key)) for each, built in C (no per-event bytecode)
            kinds, keys = zip(*events, strict=True)
            self.decisions.extend(map(tuple.__new__, repeat(Decision), zip(
                repeat(k), repeat(now), kinds, map(str, keys))))
            events.clear()

    def _still_quiet(self) -> bool:
        """Whether the controller would find nothing to do again, so the safe point may be
        skipped. The last call looked for victims (the device was over ``high``) and moved
        nothing; since then no request joined or left the batch or the controller's books,
        none was touched, no reload was asked for, no offload the worker started to make
        room is still in flight, no transfer has come due (the one poll
        would apply), no reloaded request has become evictable again, and the device is
        still over ``high``. Victims, the cascade and admission then have exactly what they
        had: nothing."""
        kv = self.kv
        now = self.clock.now
        if self._quiet != (self._gen, self._block_changes()) or self.reload_asked:
            return False
        due = kv.next_completion()
        return (
            now >= self._evictable_at
            and (due is None or due > now)
            and kv.device_used_bytes() > self.spec.controller.high * kv.device_capacity_bytes
        )

    def _reloaded(self, now: float) -> None:
        """A reload started: the request becomes evictable ``min_residency_s`` later."""
        self._evictable_at = now + self.spec.controller.min_residency_s

    def _lost(self, rid: str) -> None:
        """The controller gave up ``rid``'s offloaded KV (disk full, on_disk_full=drop)."""
        self._recompute_later(self.by_rid[rid])

    # -- preempted requests -------------------------------------------------------------

    def _serve_preempted(self) -> None:
        slots = self.sim.max_batch - len(self.active)
        if slots <= 0:
            return
        kv = self.kv
        ctl = self.ctl
        for r in list(self.preempted):
            if slots <= 0:
                break
            state = kv.state_of(r.rid)
            if state is _RESIDENT:
                if not self._resume(r):
                    break  # no room to prefill it again yet; keep the order
            elif state is RequestState.ON_HOST or state is RequestState.ON_DISK:
                if r.rid not in self.reload_asked:
                    self.reload_asked.add(r.rid)
                    r.waited_at = self.clock.now
                    if ctl.request_reload(r.rid):
                        self.decisions.append(Decision(self.k, self.clock.now, "reload", r.rid))
                        self._reloaded(self.clock.now)
            elif state is RequestState.LOST:
                self._recompute_later(r)
                continue
            slots -= 1

    def _resume(self, r: _Req) -> bool:
        """Put a resident preempted request back in the batch; False if it lost its KV and
        there is no room yet to prefill it again."""
        if r.done < r.target and self.kv.num_tokens(r.rid) < r.target:
            if not self.kv.allocate(r.rid, r.target):
                return False
        self._gen += 1
        self.preempted.remove(r)
        if r.rid in self.reload_asked:
            self.reload_asked.discard(r.rid)
            self.counters.reload_wait_s += self.clock.now - r.waited_at
        self.active.add(r.rid)
        if r.done < r.target:
            r.phase = PREFILL
            self.prefilling.append(r)
        else:
            self._join_decode(r, self.k)
        return True

    def _preempt(self, r: _Req) -> None:
        """Take ``r`` out of the batch (its KV stays where it is)."""
        self._gen += 1
        self._leave_batch(r)
        self.counters.preemptions += 1
        if self.tiering:
            self.ctl.touch(r.rid)
            r.phase = PREEMPTED
            self.preempted.append(r)
        else:
            self._recompute_later(r)

    def _recompute_later(self, r: _Req) -> None:
        """Free ``r``'s KV; it is prefilled again from scratch (prompt and output so far)."""
        self._gen += 1
        kv = self.kv
        self.counters.recomputed_tokens += r.done if r.done < r.target else r.kv
        kv.remove_request(r.rid)
        self._release_blocks(r)
        kv.ingest_request(r.rid, self.live)
        r.target = r.n_in + r.produced
        r.done = 0
        r.kv = 0
        if self.tiering:
            self.ctl.remove_request(r.rid)
            self.ctl.add_request(r.rid)
            self.reload_asked.discard(r.rid)
            if r.phase != PREEMPTED:
                r.phase = PREEMPTED
                self.preempted.appendleft(r)
        else:
            r.phase = WAITING
            self.waiting.appendleft(r)

    def _leave_batch(self, r: _Req) -> None:
        self.active.discard(r.rid)
        if r.phase == DECODE:
            self._leave_decode(r, self.k)
        elif r.phase == PREFILL:
            self.prefilling.remove(r)
        elif r.phase == STALLED:
            self.stalled.remove(r)

    # -- decoding bookkeeping -------------------------------------------------------------

    def _join_decode(self, r: _Req, k: int) -> None:
        """``r`` decodes from step ``k`` on (its KV holds ``r.kv`` tokens)."""
        r.phase = DECODE
        r.epoch += 1
        r.k0 = k
        remaining = r.n_out - r.produced
        r.k_last = k + remaining - 1
        self.n_dec += 1
        self.ctx_base += r.kv - k
        heapq.heappush(self.finishes, (r.k_last, r.epoch, r.rid))
        if self.mode != "no-tiering":
            first = k + (-r.kv) % self.P
            if first <= r.k_last:
                heapq.heappush(self.allocs, (first, r.epoch, r.rid))

    def _leave_decode(self, r: _Req, k: int) -> None:
        """``r`` stops decoding before step ``k``; its counts are brought up to date."""
        ran = k - r.k0
        self.n_dec -= 1
        self.ctx_base -= r.kv - r.k0
        r.kv += ran
        r.produced += ran
        r.epoch += 1

    # -- building a step ---------------------------------------------------------------

    def _build_step(self) -> int:
        """Allocate this step's KV and admit requests; returns the prefill tokens planned."""
        k = self.k
        if self.stalled:
            for r in list(self.stalled):
                if self.kv.allocate(r.rid, min(r.kv + self.P, r.n_in + r.n_out)):
                    self.stalled.remove(r)
                    self._join_decode(r, k)
        allocs = self.allocs
        for r in self._due(allocs, k):
            tokens = min(r.kv + (k - r.k0) + self.P, r.n_in + r.n_out)
            if self.kv.allocate(r.rid, tokens) or self._grow_failed(r, tokens):
                if k + self.P <= r.k_last:
                    heapq.heappush(allocs, (k + self.P, r.epoch, r.rid))
        budget = self.sim.max_step_tokens - self.n_dec
        planned = 0
        self._plan = []
        for r in self.prefilling:  # their whole prompt was allocated at admission
            if budget <= 0:
                break
            chunk = min(r.target - r.done, budget)
            self._plan.append((r, chunk))
            budget -= chunk
            planned += chunk
        if self.waiting and not self.preempted:
            planned += self._admit(budget)
        return planned

    def _due(self, heap: list, k: int) -> Iterator[_Req]:
        """Pop the entries of ``heap`` (decode step, epoch, rid) due by step ``k``; yield
        the requests still decoding in that epoch (a stale entry is passed over)."""
        by_rid = self.by_rid
        while heap and heap[0][0] <= k:
            _, epoch, rid = heapq.heappop(heap)
            r = by_rid[rid]
            if r.epoch == epoch and r.phase == DECODE:
                yield r

    def _grow_failed(self, r: _Req, tokens: int) -> bool:
        """Decoding ``r`` could not grow to ``tokens`` (the KV backend made what room cached
        blocks could give). True if it could after preempting others; otherwise ``r``
        stalls or is preempted (see the module docstring): False."""
        kv = self.kv
        if not self.tiering:
            while True:
                victim = self._latest_active()  # r itself at the latest
                self._preempt(victim)
                if victim is r:
                    return False
                if kv.allocate(r.rid, tokens):
                    return True
        if self._memory_coming():
            self._stall(r)
            return False
        victim = self._policy_victim() if self.sim.preempt == "policy" else self._latest_active()
        self._preempt(victim)
        if victim is not r:
            self._stall(r)
        return False

    def _kv_tokens(self, r: _Req) -> int:
        return self.kv.num_tokens(r.rid)

    def _stall(self, r: _Req) -> None:
        """A decoding ``r`` sits this step out, in the batch, holding its KV."""
        self.counters.stalls += 1
        self._leave_decode(r, self.k)
        r.stalled_at = self.clock.now
        r.phase = STALLED
        self.stalled.append(r)

    def _latest_active(self) -> _Req | None:
        """The latest-arrived request in the batch that may be preempted (not one whose
        prefix copy is still landing); None if there is none."""
        by_rid = self.by_rid
        batch = [by_rid[rid] for rid in self.active]
        return max((q for q in batch if q.phase != LOADING), key=lambda q: q.order, default=None)

    def _policy_victim(self) -> _Req:
        """The request of the batch the run's policy would pause first (``preempt="policy"``).

        The candidates are the requests of the batch the controller could offload once
        paused (not one whose prefix copy is still landing, nor one no tier below has room
        for: pausing it would free nothing), latest-arrived first, each with what it holds
        on the device, the reload cost from where it would go (the host where it has room,
        else disk: the controller's rule) and its last use: now, as it is running (a
        stalled one: when it stalled). Equal ranks go as the policy breaks ties (the
        built-ins: by rid, the earliest-arrived first). Without any such candidate the
        latest-arrived is paused, as by default."""
        by_rid = self.by_rid
        kv = self.kv
        now = self.clock.now
        batch = sorted((by_rid[rid] for rid in self.active if by_rid[rid].phase != LOADING),
                       key=lambda q: q.order, reverse=True)
        rids: list[str] = []
        nbytes: list[int] = []
        last: list[float] = []
        for q in batch:
            n = kv.reclaimable(q.rid)
            if n > 0:
                rids.append(q.rid)
                nbytes.append(n)
                last.append(q.stalled_at if q.phase == STALLED else now)
        if not rids:
            return self._latest_active()
        order = self.retention.order(rids, nbytes, last, Tier.DEVICE, "offload", now,
                                     decision="which request of the batch to pause")
        return by_rid[order[0]]

    def _memory_coming(self) -> bool:
        """Device memory will come free without preempting anyone: an offload is in
        flight, or the device is over the high watermark and an idle request on it can be
        offloaded."""
        if self.ctl.stats()["releasing_bytes"] > 0:
            return True
        kv = self.kv
        if kv.device_used_bytes() <= self.spec.controller.high * kv.device_capacity_bytes:
            return False
        reclaimable = kv.reclaimable
        return any(reclaimable(r.rid) > 0 for r in self.preempted)

    # -- admission and prefix reuse ------------------------------------------------------------

    def _admit(self, budget: int) -> int:
        """Admit waiting requests in order while there is room; returns tokens planned."""
        planned = 0
        waiting = self.waiting
        max_batch = self.sim.max_batch
        while waiting and budget > 0 and len(self.active) < max_batch:
            r = waiting[0]
            seen = (r.rid, self._free_pages(), self._block_pages())
            if seen == self._refused:
                break  # refused for room before, and no room has come since
            got = self._try_admit(r, budget)
            if got is None:
                self._refused = seen
                break
            waiting.popleft()
            self._gen += 1
            self.active.add(r.rid)
            if got:
                budget -= got
                planned += got
        return planned

    def _try_admit(self, r: _Req, budget: int) -> int | None:
        """Give ``r`` its first KV; None if the device has no room (nothing changed when
        it could not hold ``r`` at all; otherwise as a worker on the cache leaves a
        refused attach: the block policies were told, blocks may have made room).
        Returns the prefill tokens planned for it."""
        kv = self.kv
        rid = r.rid
        prefixes = self.prefixes
        # the whole prompt (or, without tiering, the whole final KV) is allocated now, so
        # a prefilling request never has to grow
        tokens = self._tokens(r)
        peek = None
        if prefixes is not None:
            peek = prefixes.peek(r.hash_ids, r.n_in) if r.hash_ids else None
            if self._hopeless(peek, tokens):
                return None
        if peek is None:  # nothing cached to attach (or no prefix reuse at all)
            kv.ingest_request(rid, self.live)
            if not kv.allocate(rid, tokens):
                kv.remove_request(rid)
                return None
            return self._admitted(r, 0, budget)
        att = prefixes.attach_request(rid, peek, self.live)
        if att is None:
            return None
        if not att.moves and not kv.allocate(rid, tokens):
            prefixes.abandon(rid, att)
            return None
        r.blocks = att.mapped
        r.moves = att.moves
        r.keys = peek.keys
        if not r.looked_up:  # counted once, at the first admission
            r.looked_up = True
            self._count_lookup(r, peek)
        if not att.moves:
            return self._admitted(r, peek.reused, budget)
        host = sum(1 for t in peek.tiers if t is Tier.HOST)
        disk = sum(1 for t in peek.tiers if t is Tier.DISK)
        block_bytes = prefixes.block_bytes
        ready = max(kv.copy_in(host * block_bytes, Tier.HOST) if host else 0.0,
                    kv.copy_in(disk * block_bytes, Tier.DISK) if disk else 0.0)
        if self.ctl is not None:
            self.ctl.add_request(rid)
        r.done = peek.reused
        r.phase = LOADING
        r.waited_at = self.clock.now
        heapq.heappush(self.loading, (ready, r.order, rid))
        return 0

    def _tokens(self, r: _Req) -> int:
        """The tokens ``r`` is allocated at admission: its prompt (without tiering, its
        whole final KV)."""
        return r.n_in + r.n_out if self.mode == "no-tiering" else r.target

    def _admitted(self, r: _Req, reused: int, budget: int) -> int:
        """``r`` holds its KV: it prefills from ``reused``; the tokens planned for it."""
        if self.ctl is not None:
            self.ctl.add_request(r.rid)
        r.done = reused
        r.phase = PREFILL
        self.prefilling.append(r)
        chunk = min(r.target - reused, budget)
        self._plan.append((r, chunk))
        return chunk

    def _hopeless(self, peek, tokens: int) -> bool:
        """Whether the device could not hold the request even with every cached block no
        request maps gone (what ``device_capacity_bytes - device_used_bytes`` says): it
        is then not attached, and nothing changes. A worker on the cache can ask the same
        (``cached_prefix`` says what the attach would find)."""
        return self.prefixes.need_pages(peek, tokens) > self._free_pages()

    def _count_lookup(self, r: _Req, peek) -> None:
        """Count one lookup: its tokens and blocks, and what each tier served (the block
        that holds the last reused token is clipped to it)."""
        c = self.counters
        bt = self.sim.block_tokens
        c.prefix_lookups += 1
        c.lookup_tokens += r.n_in
        c.lookup_blocks += len(peek.keys)
        if not peek.blocks:
            return
        reused = peek.reused
        c.prefix_hits += 1
        c.reused_tokens += reused
        r.reused = reused
        per = {Tier.DEVICE: [0, 0], Tier.HOST: [0, 0], Tier.DISK: [0, 0]}
        for i, t in enumerate(peek.tiers):
            row = per[t]
            row[0] += 1
            row[1] += min(bt, reused - i * bt)
        r.prefix_tier = max(peek.tiers, key=_DEPTH.__getitem__).value  # the deepest it read
        for tier, (blocks, tokens) in per.items():
            if not blocks:
                continue
            if tier is Tier.DEVICE:
                c.hits_device += 1
                c.reused_tokens_device += tokens
                c.reused_blocks_device += blocks
            elif tier is Tier.HOST:
                c.hits_host += 1
                c.reused_tokens_host += tokens
                c.reused_blocks_host += blocks
            else:
                c.hits_disk += 1
                c.reused_tokens_disk += tokens
                c.reused_blocks_disk += blocks

    def _finish_loads(self, now: float) -> None:
        loading = self.loading
        while loading and loading[0][0] <= now:
            _, _, rid = heapq.heappop(loading)
            r = self.by_rid[rid]
            if r.phase != LOADING:
                continue
            self.counters.prefix_load_wait_s += now - r.waited_at
            if r.moves:
                self.prefixes.loaded(r.moves)
                r.moves = []
            # as on the cache: a request allocates its prompt once its load has landed
            if not self.kv.allocate(rid, self._tokens(r)):
                self._requeue(r)
                continue
            r.phase = PREFILL
            self.prefilling.append(r)

    def _requeue(self, r: _Req) -> None:
        """``r``'s loads landed but its own pages were refused: its KV is freed and it
        waits again, first in line (its blocks, now on the device, are found again)."""
        self._gen += 1
        self.active.discard(r.rid)
        self.kv.remove_request(r.rid)
        if self.ctl is not None:
            self.ctl.remove_request(r.rid)
        self._release_blocks(r)
        r.done = 0
        r.phase = WAITING
        self.waiting.appendleft(r)

    # -- running a step ---------------------------------------------------------------------

    def _run_step(self, prefill_tokens: int) -> None:
        k = self.k
        n_dec = self.n_dec
        ctx = self.ctx_base + n_dec * k
        self.clock.now += self.cost.step_s(prefill_tokens, n_dec, ctx)
        self.counters.steps += 1
        self.k = k + 1
        end = self.clock.now
        for r, chunk in self._plan:
            if r.phase != PREFILL:
                continue
            r.done += chunk
            if r.done >= r.target:
                self._prefilled(r, end)
        self._plan = []
        for r in self._due(self.finishes, k):
            self._leave_decode(r, k + 1)
            self._finished(r, end)

    def _prefilled(self, r: _Req, end: float) -> None:
        """``r``'s prefill completed in the step ending at ``end``: it produced a token."""
        self.prefilling.remove(r)
        r.kv = r.target
        r.produced += 1
        if r.first_at is None:
            r.first_at = end
        if r.produced >= r.n_out:
            self._finished(r, end)
        else:
            self._join_decode(r, self.k)

    def _finished(self, r: _Req, end: float) -> None:
        self._gen += 1
        r.phase = DONE
        r.finish_at = end
        self.active.discard(r.rid)
        self._count_done()
        kv = self.kv
        kv.remove_request(r.rid)
        if self.ctl is not None:
            self.ctl.remove_request(r.rid)
        self._release_blocks(r)
        if r.keys:
            self.prefixes.publish(r.keys)

    def _release_blocks(self, r: _Req) -> None:
        """``r``'s KV was just freed: it no longer maps its cached blocks."""
        if r.moves:  # cannot happen (a loading request is never preempted); keep books sound
            self.prefixes.undo_loads(r.moves)
            r.moves = []
        if r.blocks:
            self.prefixes.release(r.blocks)
            r.blocks = []

    # -- getting unstuck ------------------------------------------------------------------------

    def _unstick(self) -> bool:
        """Nothing can run and nothing is on its way. In this order: drop the retained
        prefixes resident on the device; once per stuck spell, let ``min_residency_s`` pass
        (a request reloaded just now may not be offloaded before); free the KV of the last
        preempted request holding any, else of the batch's latest-arrived request (it will
        be recomputed). False if there was nothing to do."""
        if self.prefixes is not None and self.prefixes.drop_all_device():
            self._log_blocks()
            return True
        wait = self.spec.controller.min_residency_s
        if self.tiering and wait > 0 and not self._waited and self.preempted:
            self._waited = True
            self.clock.now += wait
            return True
        victim = next((r for r in reversed(self.preempted) if self.kv.num_tokens(r.rid)), None)
        if victim is None:
            victim = self._latest_active()
            if victim is None:
                return False
            self._preempt(victim)
        if victim.phase == PREEMPTED:
            self._recompute_later(victim)
        self.counters.forced_recomputes += 1
        return True

    # -- the result ---------------------------------------------------------------------------

    def _result(self) -> RunResult:
        records = [
            RequestRecord(
                r.rid, r.arrival, r.first_at, r.finish_at, r.n_in, r.n_out,
                "rejected" if r.phase == REJECTED else "finished", r.prefix_tier, r.reused,
            )
            for r in sorted(self.reqs, key=lambda q: q.order)
        ]
        if self.prefixes is not None:
            b = self.prefixes.counters
            c = self.counters
            c.block_moves_host, c.block_moves_disk = b.moved_host, b.moved_disk
            c.block_loads, c.block_drops, c.block_refused = b.loaded, b.dropped, b.refused
        kv_stats = self.kv.stats.as_dict() if hasattr(self.kv.stats, "as_dict") else {}
        ctl_stats = self.ctl.stats() if self.ctl is not None else {}
        kv = self.kv
        capacities = {
            "page_bytes": self.page_bytes,
            "device_bytes": int(kv.device_capacity_bytes),
            "host_bytes": int(kv.host_capacity_bytes),
            "disk_bytes": int(getattr(kv, "disk_capacity_bytes", 0)),
        }
        meter = self.prefixes.meter if self.prefixes is not None else None
        return RunResult(self.spec, records, self.counters, kv_stats, ctl_stats,
                         self.decisions, self.clock.now, capacities, self.timeline,
                         meter.costs() if meter is not None else ())
