"""A small continuous-batching worker that serves requests on a tiered KV cache.

Requests wait in one queue. Each ``step``:

Everything goes through one ``tiering.TieredKV`` (``tkv``); the model reads
and writes ``tkv.kv``. Each ``step``:

1. requests whose arrival step has come join the back of the queue
   (``tkv.add``); finished copies are applied (``tkv.poll``);
2. the worker looks at the first ``window`` places of the queue. An
   offloaded request there is asked back by ``tkv.ready`` (so the ones
   about to run are brought back ahead of time); a resident one that
   ``tkv.ready`` finds READY and whose next tokens fit on the device joins
   the batch, up to ``batch`` requests. Others wait, keeping their place;
3. each request of the batch runs alone (a prefill chunk or one decode
   token), so its numerics never depend on what else runs. A request keeps
   its place for ``quantum`` runs, then yields it and goes to the back of
   the queue (round robin); a finished one leaves (``tkv.remove``);
4. at the safe point, ``tkv.after_step(ran, keep)`` touches what ran and lets
   the controller move KV; ``keep`` holds the resident requests in the
   window: they are about to run and would only come straight back if moved
   out. The idle requests further back are the controller's to move to host
   and disk.

A step that could run nothing (every candidate waiting for a copy or for
room) waits for the copies in flight with ``tkv.synchronize(timeout)`` and
protects only the head of the queue, so the controller may move anything
else out to make room for it. The worker gives up with ``WorkerStalled``
(it never hangs) after ``max_stalled_steps`` such steps in a row.

The controller runs on a ``StepClock``: its notion of time is the step
count, so its residency and ageing times are counted in steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tiering.apps.demo.model import TinyDecoder
from tiering.apps.demo.workload import DemoRequest
from tiering.core.clocks import StepClock
from tiering.errors import LayerNotReady, WorkerStalled
from tiering.tiered import Readiness, TieredKV
from tiering.types import RequestState


@dataclass(frozen=True)
class WorkerConfig:
    """``batch``: requests run per step. ``prefill_chunk``: prompt tokens per
    prefill step. ``quantum``: runs a request gets before it yields its place.
    ``reload_window``: how many places at the head of the queue are candidates
    (and are asked back when offloaded); default ``batch + batch // 2``.
    ``max_stalled_steps``: steps in a row with nothing run before giving up.
    ``sync_timeout_s``: the longest a stalled step waits for copies in flight.
    ``settle_each_step``: wait for every copy at the end of each step and for the
    reloads each step starts before it picks its batch, so a run does not depend on
    how fast the copy threads are (the same moves and hits every time; copies then
    never overlap compute)."""

    batch: int = 4
    prefill_chunk: int = 256
    quantum: int = 8
    reload_window: int | None = None
    max_stalled_steps: int = 200
    sync_timeout_s: float = 60.0
    settle_each_step: bool = False

    def __post_init__(self) -> None:
        for name in ("batch", "prefill_chunk", "quantum", "max_stalled_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"WorkerConfig.{name} must be an int >= 1, got {v!r}")
        w = self.reload_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < self.batch):
            raise ValueError(
                f"WorkerConfig.reload_window must be an int >= batch ({self.batch}), got {w!r}"
            )
        if not self.sync_timeout_s > 0:
            raise ValueError(
                f"WorkerConfig.sync_timeout_s must be > 0, got {self.sync_timeout_s!r}"
            )

    @property
    def window(self) -> int:
        if self.reload_window is not None:
            return self.reload_window
        return self.batch + self.batch // 2


class RequestOutput(NamedTuple):
    """What a finished request produced: its tokens and the logits of its last step."""

    rid: str
    tokens: tuple[int, ...]
    final_logits: torch.Tensor


class StepSample(NamedTuple):
    """Occupancy after one step: bytes used per tier and where the live requests are."""

    step: int
    wall_s: float
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    ran: int
    not_started: int  # live requests with no KV yet
    resident: int
    on_host: int
    on_disk: int
    in_flight: int


@dataclass
class WorkerCounters:
    """Plain counters of what the worker did (the worker is their only writer)."""

    steps: int = 0
    stalled_steps: int = 0
    allocation_refusals: int = 0
    reload_asks: int = 0  # reloads asked for; a waiting request is asked each step
    admit_waits: int = 0
    prefix_attached_tokens: int = 0  # tokens attach_prefix gave (before loads were checked)
    prefix_valid_tokens: int = 0  # of those, the tokens whose KV was valid (prefill skipped)
    prefix_recomputed_tokens: int = 0  # attached, then found corrupt: run again
    prompt_tokens: int = 0
    generated_tokens: int = 0
    stall_wait_s: float = 0.0
    steps_undone: int = 0  # runs cut short by a failed layer-wise reload (run again later)

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


class WorkerResult(NamedTuple):
    """A finished run: outputs by request id, one sample per step, counters, wall time."""

    outputs: dict[str, RequestOutput]
    samples: list[StepSample]
    counters: dict[str, float]
    wall_s: float


@dataclass
class _Live:
    """A request in progress (owned by the worker)."""

    req: DemoRequest
    written: int = 0  # tokens whose K/V are in the cache
    generated: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    runs_in_turn: int = 0  # runs since it last reached its place in the queue
    attached: bool = False  # attach_prefix was asked (prefix reuse only)
    loading: int = 0  # tokens attached whose load has not been checked yet

    def next_input(self, chunk: int) -> tuple[torch.Tensor, int]:
        """The tokens to feed next and the position of the first one."""
        n = int(self.req.prompt.numel())
        if self.written < n:
            return self.req.prompt[self.written : min(n, self.written + chunk)], self.written
        return torch.tensor([self.generated[-1]], dtype=torch.long), self.written

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.req.max_new_tokens


def _disk_used_bytes(kv) -> int:
    """Bytes the cache's disk tier holds (0 without one)."""
    disk = getattr(kv, "disk", None)
    return 0 if disk is None else int(disk.used_bytes())


class DemoWorker:
    """Serves ``requests`` with ``model`` on the tiered cache ``tkv`` (see module doc).

    ``clock`` must be the clock ``tkv`` was built with; the worker advances it
    once per step. ``on_token`` is called once per generated token (for a
    progress bar).
    """

    def __init__(
        self,
        model: TinyDecoder,
        tkv: TieredKV,
        requests: Sequence[DemoRequest],
        config: WorkerConfig,
        clock: StepClock,
        *,
        on_token: Callable[[], None] | None = None,
        on_step: Callable[[int], None] | None = None,
        on_attach: Callable[[str], None] | None = None,
    ) -> None:
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            raise ValueError("request ids must be unique")
        self.model = model
        self.tkv = tkv
        self.kv = kv = tkv.kv
        self.config = config
        self._clock = clock
        self._on_token = on_token
        self._on_step = on_step
        self._on_attach = on_attach
        self._prefix = bool(getattr(kv, "prefix_enabled", False))
        self._full: dict[str, torch.Tensor] = {}  # rid -> full prompt, once it has arrived
        self._pending = deque(sorted(requests, key=lambda r: (r.arrival_step, r.rid)))
        self._queue: deque[str] = deque()
        self._live: dict[str, _Live] = {}
        self._outputs: dict[str, RequestOutput] = {}
        self._samples: list[StepSample] = []
        self._stalled_in_a_row = 0
        self.counters = WorkerCounters()
        self._t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        return not self._pending and not self._live

    def full_prompts(self) -> dict[str, torch.Tensor]:
        """Each arrived request's full prompt (a continuation's includes its conversation)."""
        return dict(self._full)

    @property
    def samples(self) -> list[StepSample]:
        return list(self._samples)

    def run(self) -> WorkerResult:
        """Step until every request has finished."""
        self._t0 = time.perf_counter()
        while not self.done:
            self.step()
        self.tkv.synchronize(self.config.sync_timeout_s)
        return WorkerResult(
            dict(self._outputs),
            list(self._samples),
            self.counters.as_dict(),
            time.perf_counter() - self._t0,
        )

    # -- one step -----------------------------------------------------------------

    def step(self) -> None:
        """Admit arrivals, run a batch, then let the controller move KV."""
        step = self.counters.steps
        if self._on_step is not None:
            self._on_step(step)
        self._admit_arrivals(step)
        tkv = self.tkv
        tkv.poll()
        if self.config.settle_each_step:  # the reloads poll just started land before the
            tkv.synchronize(self.config.sync_timeout_s)  # picks: none is a race with a copy
        batch = self._pick(step)
        for rid in list(batch):
            try:
                self._run(rid)
            except LayerNotReady:  # its layer-wise reload failed mid-step: the request is
                # back where it was with the tokens it had, and runs this step again later
                self.counters.steps_undone += 1
                batch.remove(rid)
        self._requeue(batch)
        ran = [rid for rid in batch if rid in self._live]  # the finished ones have left
        if batch or not self._live:
            self._stalled_in_a_row = 0
            head = list(self._queue)[: self.config.window]
            keep = {rid for rid in head if self._resident(rid)}
        else:
            keep = self._stalled(step)
        tkv.after_step(ran, keep)
        if self.config.settle_each_step:
            tkv.synchronize(self.config.sync_timeout_s)
        self.counters.steps += 1
        self._clock.advance()
        self._sample(step, len(batch))

    def _admit_arrivals(self, step: int) -> None:
        """Requests whose step has come join the queue; a continuation waits for its parent
        to finish, then arrives with the conversation so far as its prompt."""
        waiting = deque()
        while self._pending and self._pending[0].arrival_step <= step:
            req = self._pending.popleft()
            if req.parent is not None:
                done = self._outputs.get(req.parent)
                if done is None:
                    waiting.append(req)
                    continue
                context = torch.cat([self._full[req.parent],
                                     torch.tensor(done.tokens, dtype=torch.long)])
                req = dataclasses.replace(req, prompt=torch.cat([context, req.prompt]),
                                          parent=None, context_tokens=0)
            self._full[req.rid] = req.prompt
            self.tkv.add(req.rid)
            self._live[req.rid] = _Live(req)
            self._queue.append(req.rid)
        self._pending.extendleft(reversed(waiting))

    def _resident(self, rid: str) -> bool:
        return self.kv.state_of(rid) is RequestState.RESIDENT

    def _pick(self, step: int) -> list[str]:
        """Up to ``batch`` runnable requests from the front of the queue; asks
        back offloaded ones within the reload window."""
        cfg = self.config
        kv = self.kv
        tkv = self.tkv
        batch: list[str] = []
        for pos, rid in enumerate(self._queue):
            if pos >= cfg.window:
                break
            full = len(batch) >= cfg.batch
            if kv.state_of(rid) is RequestState.LOST:
                raise RuntimeError(f"request {rid!r} lost its KV: {kv.lost_reason(rid)}")
            live = self._live[rid]
            if self._prefix and not live.attached:
                live.attached = True
                got = kv.attach_prefix(rid, live.req.prompt)
                self.counters.prefix_attached_tokens += got
                live.written = live.loading = got
                if self._on_attach is not None:
                    self._on_attach(rid)
            if full and not kv.is_offloaded(rid):
                continue  # an offloaded one is still asked back below
            got = tkv.ready(rid, step)
            if got is Readiness.ASKED_BACK:
                self.counters.reload_asks += 1
                continue
            if got is not Readiness.READY:
                self.counters.admit_waits += 1
                continue
            if live.loading:  # the load landed: continue from the tokens that proved valid
                valid = kv.num_tokens(rid)
                self.counters.prefix_valid_tokens += valid
                self.counters.prefix_recomputed_tokens += live.loading - valid
                live.written, live.loading = valid, 0
            tokens, start = live.next_input(cfg.prefill_chunk)
            if not kv.allocate(rid, start + int(tokens.numel())):
                self.counters.allocation_refusals += 1
                continue
            batch.append(rid)
        return batch

    def _run(self, rid: str) -> None:
        live = self._live[rid]
        tokens, start = live.next_input(self.config.prefill_chunk)
        logits = self.model.forward(self.kv, rid, tokens, start)
        n = int(tokens.numel())
        live.written = start + n
        if live.written < live.req.prompt.numel():
            self.counters.prompt_tokens += n
            return
        if not live.generated:
            self.counters.prompt_tokens += n
        live.generated.append(int(torch.argmax(logits)))
        live.logits = logits
        self.counters.generated_tokens += 1
        if self._on_token is not None:
            self._on_token()

    def _requeue(self, batch: list[str]) -> None:
        """Finished requests leave; those that used up their quantum go to the back."""
        if not batch:
            return
        leaving = set()
        for rid in batch:
            live = self._live[rid]
            live.runs_in_turn += 1
            if live.finished or live.runs_in_turn >= self.config.quantum:
                leaving.add(rid)
        if not leaving:
            return
        self._queue = deque(rid for rid in self._queue if rid not in leaving)
        for rid in batch:
            if rid not in leaving:
                continue
            live = self._live[rid]
            if live.finished:
                self._finish(live)
            else:
                live.runs_in_turn = 0
                self._queue.append(rid)

    def _finish(self, live: _Live) -> None:
        rid = live.req.rid
        if self._prefix:  # its KV stays as cached blocks for later requests
            ids = torch.cat([live.req.prompt, torch.tensor(live.generated, dtype=torch.long)])
            self.kv.publish_prefix(rid, ids[: live.written])
        self.tkv.remove(rid)
        del self._live[rid]
        assert live.logits is not None
        self._outputs[rid] = RequestOutput(rid, tuple(live.generated), live.logits.cpu())

    def _stalled(self, step: int) -> set[str]:
        """Nothing could run: wait for copies in flight and protect only the head."""
        self.counters.stalled_steps += 1
        self._stalled_in_a_row += 1
        if self._stalled_in_a_row > self.config.max_stalled_steps:
            states = {rid: self.kv.state_of(rid).value for rid in list(self._queue)[:8]}
            raise WorkerStalled(
                f"step {step}: nothing could run for {self._stalled_in_a_row - 1} steps in a row;"
                f" head of the queue: {states}; device {self.kv.device_used_bytes()} of"
                f" {self.kv.device_capacity_bytes} bytes used"
            )
        t = time.perf_counter()
        self.tkv.synchronize(self.config.sync_timeout_s)
        self.counters.stall_wait_s += time.perf_counter() - t
        head = self._queue[0]
        return {head} if self._resident(head) else set()

    def _sample(self, step: int, ran: int) -> None:
        kv = self.kv
        counts = {RequestState.RESIDENT: 0, RequestState.ON_HOST: 0, RequestState.ON_DISK: 0}
        moving = 0
        not_started = 0
        for rid, live in self._live.items():
            st = kv.state_of(rid)
            if live.written == 0 and st is RequestState.RESIDENT:
                not_started += 1
            elif st in counts:
                counts[st] += 1
            elif st.in_flight:
                moving += 1
        self._samples.append(
            StepSample(
                step,
                time.perf_counter() - self._t0,
                kv.device_used_bytes(),
                kv.host_used_bytes(),
                _disk_used_bytes(kv),
                ran,
                not_started,
                counts[RequestState.RESIDENT],
                counts[RequestState.ON_HOST],
                counts[RequestState.ON_DISK],
                moving,
            )
        )
