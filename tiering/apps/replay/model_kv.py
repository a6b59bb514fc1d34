"""A modeled paged KV cache: byte accounting over three tiers, transfers in simulated time.

``ModeledKVCache`` offers the same request lifecycle (``ingest_request``,
``allocate``, ``remove_request``) and the same eviction hooks as
``resources.kv_cache.PagedKVCache``, with the same answers, but holds no
tensors: each tier is a page counter and each request a record. A transfer
reserves its destination pages at once, occupies the links it crosses for
``bytes / bandwidth`` seconds of the injected clock (links are FIFO: a copy
starts when the previous one on the same link ends), and is applied by the
first ``poll()`` at or after its completion time, which frees the source
pages. With infinite bandwidth a transfer still completes only at the next
``poll()``, exactly like a real cache that is synchronized at each poll.

Links: ``d2h`` and ``h2d`` (device <-> host), ``disk_write`` and
``disk_read``. An offload straight to disk crosses ``d2h`` and
``disk_write``; a reload from disk crosses ``disk_read`` and ``h2d``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from resources.engine_types import ResourceReqConfig, retention_offload_priority
from tiering.errors import UnknownRequest
from tiering.types import (
    OFFLOADED_STATES,
    RELOADABLE_STATES,
    IllegalTransition,
    Move,
    RequestState,
    Tier,
    TransferResult,
    check_transition,
)

S = RequestState

LINKS = ("d2h", "h2d", "disk_write", "disk_read")

# tier indices of the page counters (plain ints: this is the simulator's hot path)
_DEV, _HOST, _DISK = 0, 1, 2
_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
# the links a copy of cached blocks a tier down crosses
_BLOCK_LINKS = {(Tier.DEVICE, Tier.HOST): ("d2h",), (Tier.DEVICE, Tier.DISK): ("d2h", "disk_write"),
                (Tier.HOST, Tier.DISK): ("disk_write",)}


def _removed(rid: str, move: Move, nbytes: int) -> TransferResult:
    return TransferResult(rid, move, False, nbytes, None, "request removed during the copy")


@dataclass(frozen=True)
class LinkRates:
    """Bandwidth of each link in bytes per second (``math.inf``: instantaneous), and the
    fixed latency of one copy on it in seconds (``<link>_latency_s``, default 0)."""

    d2h: float
    h2d: float
    disk_write: float
    disk_read: float
    d2h_latency_s: float = 0.0
    h2d_latency_s: float = 0.0
    disk_write_latency_s: float = 0.0
    disk_read_latency_s: float = 0.0

    def __post_init__(self) -> None:
        for f in LINKS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"LinkRates.{f} must be a number > 0 (or inf), got {v!r}")
            lat = getattr(self, f"{f}_latency_s")
            if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not (
                math.isfinite(lat) and lat >= 0
            ):
                raise ValueError(
                    f"LinkRates.{f}_latency_s must be a finite number >= 0, got {lat!r}")

    @classmethod
    def instant(cls) -> LinkRates:
        return cls(math.inf, math.inf, math.inf, math.inf)


@dataclass(slots=True)
class ModelStats:
    """Counters of moves, by tier and by link (the real cache's names where they exist)."""

    offloads_to_host: int = 0
    offloads_to_disk: int = 0
    demotions: int = 0
    reloads_from_host: int = 0
    reloads_from_disk: int = 0
    prefix_loads_from_host: int = 0
    prefix_loads_from_disk: int = 0
    offload_refusals: int = 0
    reload_refusals: int = 0
    demote_refusals_disk_full: int = 0
    dropped: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    bytes_disk_write: int = 0
    bytes_disk_read: int = 0
    reload_stall_s_total: float = 0.0
    max_device_pages: int = 0
    max_host_pages: int = 0
    max_disk_pages: int = 0

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _Rec:
    rid: str
    retention: float | None
    expiry_s: float | None
    ingested_at: float
    tokens: int = 0
    state: RequestState = S.RESIDENT
    tier: Tier | None = Tier.DEVICE  # state.tier, kept alongside it
    device: int = 0  # pages held in each tier (both ends while in flight)
    host: int = 0
    disk: int = 0
    job: int = 0  # sequence number of the transfer in flight, 0 when none
    job_kind: str = ""
    job_started: float = 0.0


class ModeledKVCache:
    """Byte-accounting stand-in for ``PagedKVCache`` (see the module docstring).

    ``page_bytes`` = ``bytes_per_token * page_tokens``; each tier holds a whole
    number of pages (``host_pages`` and ``disk_pages`` may be 0: no such tier).
    ``offload`` goes to the host, or straight to disk when the host is full.
    Not thread-safe; driven from the simulator's loop only.
    """

    def __init__(
        self,
        bytes_per_token: int,
        page_tokens: int,
        device_pages: int,
        host_pages: int,
        disk_pages: int,
        rates: LinkRates,
        clock: Callable[[], float],
    ) -> None:
        for name, v, low in (
            ("bytes_per_token", bytes_per_token, 1), ("page_tokens", page_tokens, 1),
            ("device_pages", device_pages, 1), ("host_pages", host_pages, 0),
            ("disk_pages", disk_pages, 0),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"ModeledKVCache.{name} must be an int >= {low}, got {v!r}")
        if not isinstance(rates, LinkRates):
            raise TypeError(f"rates must be LinkRates, got {type(rates).__name__}")
        self.page_tokens = page_tokens
        self.page_bytes = bytes_per_token * page_tokens
        self.device_pages = device_pages
        self.host_pages = host_pages
        self.disk_pages = disk_pages
        self.rates = rates
        self._clock = clock
        self._used = [0, 0, 0]
        self._blocks = [0, 0, 0]  # pages held by cached prefix blocks (``take_block_pages``)
        self._cap = [device_pages, host_pages, disk_pages]
        self._free_at = dict.fromkeys(LINKS, 0.0)
        self._reqs: dict[str, _Rec] = {}
        # (done_at, seq, rid, move, nbytes), a heap; a job whose request was removed is
        # reported by the next poll as not ok, with state None
        self._jobs: list[tuple[float, int, str, Move, int]] = []
        self._abandoned: list[TransferResult] = []
        self._seq = 0
        self.stats = ModelStats()

    # -- sizes ------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    @property
    def device_capacity_bytes(self) -> int:
        return self.device_pages * self.page_bytes

    @property
    def host_capacity_bytes(self) -> int:
        return self.host_pages * self.page_bytes

    @property
    def disk_capacity_bytes(self) -> int:
        return self.disk_pages * self.page_bytes

    def device_used_bytes(self) -> int:
        return self._used[_DEV] * self.page_bytes

    def host_used_bytes(self) -> int:
        return self._used[_HOST] * self.page_bytes

    def disk_used_bytes(self) -> int:
        return self._used[_DISK] * self.page_bytes

    def device_free_pages(self) -> int:
        return self.device_pages - self._used[_DEV]

    # -- records ----------------------------------------------------------------

    def _req(self, rid: str) -> _Rec:
        try:
            return self._reqs[rid]
        except KeyError:
            raise UnknownRequest(f"unknown request {rid!r}") from None

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def state_of(self, rid: str) -> RequestState:
        return self._req(rid).state

    def tier_of(self, rid: str) -> Tier | None:
        return self._req(rid).tier

    def num_tokens(self, rid: str) -> int:
        return self._req(rid).tokens

    def ingest_request(self, rid: str, overrides: ResourceReqConfig | None = None) -> None:
        """Register ``rid`` with no KV yet (idempotent for identical overrides)."""
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request id must be a non-empty str, got {rid!r}")
        if overrides is not None and not isinstance(overrides, ResourceReqConfig):
            raise TypeError(f"overrides for {rid!r} must be a ResourceReqConfig or None")
        retention = overrides.retention_priority if overrides is not None else None
        expiry = overrides.retention_expiry_s if overrides is not None else None
        r = self._reqs.get(rid)
        if r is not None:
            if (r.retention, r.expiry_s) != (retention, expiry):
                raise ValueError(f"request {rid!r} was already ingested with other overrides")
            return
        self._reqs[rid] = _Rec(rid, retention, expiry, self._clock())

    def allocate(self, rid: str, num_tokens: int) -> bool:
        """Grow ``rid`` to ``num_tokens`` tokens; False (nothing changed) if the device is short."""
        r = self._req(rid)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"allocate({rid!r}): num_tokens must be an int >= 0, "
                             f"got {num_tokens!r}")
        if r.state is not S.RESIDENT:
            raise IllegalTransition(f"request {rid!r} is {r.state.value}; allocate needs it resident")
        if num_tokens <= r.tokens:
            return True
        extra = self.pages_for(num_tokens) - r.device
        if extra > 0:
            if not self._take(_DEV, extra):
                return False
            r.device += extra
        r.tokens = num_tokens
        return True

    def remove_request(self, rid: str) -> None:
        """Forget ``rid`` and free every page it holds (a transfer in flight is abandoned)."""
        r = self._req(rid)
        self._give(_DEV, r.device)
        self._give(_HOST, r.host)
        self._give(_DISK, r.disk)
        del self._reqs[rid]

    # -- cached prefix blocks --------------------------------------------------------

    def block_pages(self, tier: Tier) -> int:
        """Pages held in ``tier`` by cached prefix blocks (not by any request)."""
        return self._blocks[_TIERS.index(tier)]

    def free_pages(self, tier: Tier) -> int:
        i = _TIERS.index(tier)
        return self._cap[i] - self._used[i]

    def take_block_pages(self, tier: Tier, n: int) -> bool:
        """``n`` pages of ``tier`` now hold cached blocks; False (nothing changed) if short."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"take_block_pages: n must be an int >= 0, got {n!r}")
        i = _TIERS.index(tier)
        if not self._take(i, n):
            return False
        self._blocks[i] += n
        return True

    def give_block_pages(self, tier: Tier, n: int) -> None:
        """``n`` pages of ``tier`` held by cached blocks are free again."""
        i = _TIERS.index(tier)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self._blocks[i]:
            raise ValueError(f"give_block_pages: n must be an int in [0, {self._blocks[i]}] "
                             f"for {tier.value}, got {n!r}")
        self._give(i, n)
        self._blocks[i] -= n

    def move_block_pages(self, src: Tier, dst: Tier, n: int) -> bool:
        """Cached blocks of ``n`` pages go from ``src`` down to ``dst`` (HOST or DISK): the
        destination is taken and the source freed at once, and the copy occupies its links
        (so transfers started after it queue behind it). False (nothing changed) if ``dst``
        is short."""
        links = _BLOCK_LINKS.get((src, dst))
        if links is None:
            raise ValueError(f"move_block_pages: no move from {src!r} to {dst!r}")
        if not self.take_block_pages(dst, n):
            return False
        self.give_block_pages(src, n)
        self._occupy(links, n * self.page_bytes)
        return True

    # -- page counters --------------------------------------------------------------

    def _can_take(self, tier: int, n: int) -> bool:
        return self._used[tier] + n <= self._cap[tier]

    def _take(self, tier: int, n: int) -> bool:
        used = self._used[tier] + n
        if used > self._cap[tier]:
            return False
        self._used[tier] = used
        st = self.stats
        if tier == _DEV:
            st.max_device_pages = max(st.max_device_pages, used)
        elif tier == _HOST:
            st.max_host_pages = max(st.max_host_pages, used)
        else:
            st.max_disk_pages = max(st.max_disk_pages, used)
        return True

    def _give(self, tier: int, n: int) -> None:
        self._used[tier] -= n

    # -- transfers --------------------------------------------------------------------

    def _occupy(self, links: tuple[str, ...], nbytes: int) -> float:
        """Reserve ``links`` for a copy of ``nbytes``; return its completion time."""
        now = self._clock()
        rates = self.rates
        rate = min(getattr(rates, name) for name in links)
        latency = sum(getattr(rates, f"{name}_latency_s") for name in links)
        start = max([now] + [self._free_at[name] for name in links])
        done = start + latency + nbytes / rate
        for name in links:
            self._free_at[name] = done
            setattr(self.stats, f"bytes_{name}", getattr(self.stats, f"bytes_{name}") + nbytes)
        return done

    def _start(self, r: _Rec, kind: str, links: tuple[str, ...], nbytes: int,
               state: RequestState) -> None:
        check_transition(r.rid, r.state, state)
        done = self._occupy(links, nbytes)
        self._seq += 1
        self._set(r, state)
        r.job = self._seq
        r.job_kind = kind
        r.job_started = self._clock()
        heapq.heappush(self._jobs, (done, self._seq, r.rid, Move(kind), nbytes))

    @staticmethod
    def _set(r: _Rec, state: RequestState) -> None:
        r.state = state
        r.tier = state.tier

    def copy_in(self, nbytes: int, source: Tier) -> float:
        """A copy of ``nbytes`` from ``source`` (HOST or DISK) into pages the caller
        already allocated on the device, e.g. a reused prefix; returns when it lands."""
        if source is Tier.HOST:
            self.stats.prefix_loads_from_host += 1
            return self._occupy(("h2d",), nbytes)
        if source is Tier.DISK:
            self.stats.prefix_loads_from_disk += 1
            return self._occupy(("disk_read", "h2d"), nbytes)
        raise ValueError(f"copy_in: source must be HOST or DISK, got {source!r}")

    def next_completion(self) -> float | None:
        """Clock time at which the earliest transfer in flight completes (None: none)."""
        jobs = self._jobs
        while jobs:
            _, seq, rid, move, nbytes = jobs[0]
            r = self._reqs.get(rid)
            if r is not None and r.job == seq:
                return jobs[0][0]
            heapq.heappop(jobs)  # its request was removed: the next poll reports it
            self._abandoned.append(_removed(rid, move, nbytes))
        return None

    def in_flight(self) -> int:
        return sum(1 for r in self._reqs.values() if r.job)

    def poll(self) -> list[TransferResult]:
        """Apply every transfer whose completion time has come; one ``TransferResult`` per
        transfer, in completion order. A transfer whose request was removed while it ran
        is reported once, not ok, with ``state`` None (its pages came back at the removal).
        Modeled links never fail, so every other result is ok."""
        jobs = self._jobs
        out = self._abandoned
        if not jobs and not out:
            return []
        self._abandoned = []
        now = self._clock()
        while jobs and jobs[0][0] <= now:
            finished_at, seq, rid, move, nbytes = heapq.heappop(jobs)
            r = self._reqs.get(rid)
            if r is None or r.job != seq:
                out.append(_removed(rid, move, nbytes))
                continue
            r.job = 0
            getattr(self, f"_done_{r.job_kind}")(r, finished_at)
            out.append(TransferResult(rid, move, True, nbytes, r.state))
        return out

    def _done_offload_host(self, r: _Rec, at: float) -> None:
        self._give(_DEV, r.device)
        r.device = 0
        self._set(r, S.ON_HOST)
        self.stats.offloads_to_host += 1

    def _done_offload_disk(self, r: _Rec, at: float) -> None:
        self._give(_DEV, r.device)
        r.device = 0
        self._set(r, S.ON_DISK)
        self.stats.offloads_to_disk += 1

    def _done_demote(self, r: _Rec, at: float) -> None:
        self._give(_HOST, r.host)
        r.host = 0
        self._set(r, S.ON_DISK)
        self.stats.demotions += 1

    def _done_reload_host(self, r: _Rec, at: float) -> None:
        self._give(_HOST, r.host)
        r.host = 0
        self._set(r, S.RESIDENT)
        self.stats.reloads_from_host += 1
        self.stats.reload_stall_s_total += at - r.job_started

    def _done_reload_disk(self, r: _Rec, at: float) -> None:
        self._give(_DISK, r.disk)
        r.disk = 0
        self._set(r, S.RESIDENT)
        self.stats.reloads_from_disk += 1
        self.stats.reload_stall_s_total += at - r.job_started

    # -- eviction hooks ----------------------------------------------------------------

    @property
    def supports_eviction(self) -> bool:
        return True

    def reclaimable(self, rid: str) -> int:
        r = self._reqs.get(rid)
        if r is None:
            raise UnknownRequest(f"unknown request {rid!r}")
        n = r.device
        if r.state is not S.RESIDENT or not n:
            return 0
        used, cap = self._used, self._cap
        if used[_HOST] + n <= cap[_HOST] or used[_DISK] + n <= cap[_DISK]:
            return n * self.page_bytes
        return 0

    def reclaimable_many(self, rids: Sequence[str]) -> np.ndarray:
        """``reclaimable`` of each of ``rids`` (int64), in one call; changes nothing."""
        reqs = self._reqs
        used, cap = self._used, self._cap
        host_free = cap[_HOST] - used[_HOST]
        disk_free = cap[_DISK] - used[_DISK]
        room = max(host_free, disk_free)
        page_bytes = self.page_bytes
        resident = S.RESIDENT
        out = np.zeros(len(rids), dtype=np.int64)
        for i, rid in enumerate(rids):
            r = reqs.get(rid)
            if r is None:
                raise UnknownRequest(f"unknown request {rid!r}")
            n = r.device
            if n and n <= room and r.state is resident:
                out[i] = n * page_bytes
        return out

    def get_offload_priority_many(self, rids: Sequence[str]) -> np.ndarray:
        """``get_offload_priority`` of each of ``rids`` (float64), in one call."""
        return np.fromiter(map(self.get_offload_priority, rids), dtype=np.float64,
                           count=len(rids))

    def get_offload_priority(self, rid: str) -> float:
        """The real cache's rule (``retention_offload_priority``)."""
        r = self._req(rid)
        return retention_offload_priority(r.retention, r.expiry_s, self._clock() - r.ingested_at)

    def is_offloaded(self, rid: str) -> bool:
        return self._req(rid).state in OFFLOADED_STATES

    def can_reload(self, rid: str) -> bool:
        return self._req(rid).state in RELOADABLE_STATES

    def reload_bytes(self, rid: str) -> int:
        r = self._req(rid)
        if r.state not in OFFLOADED_STATES:
            return 0
        return self.pages_for(r.tokens) * self.page_bytes

    def offload(self, rid: str) -> int:
        """Start moving a resident request to host, or to disk when the host is full.
        Returns the device bytes it will free; 0 (nothing changed) when neither has room."""
        r = self._req(rid)
        if r.state is not S.RESIDENT:
            raise IllegalTransition(
                f"offload: request {rid!r} is {r.state.value}; only a resident request offloads"
            )
        n = r.device
        nbytes = n * self.page_bytes
        if self._take(_HOST, n):
            r.host = n
            self._start(r, "offload_host", ("d2h",), nbytes, S.OFFLOADING)
            return nbytes
        if self._take(_DISK, n):
            r.disk = n
            self._start(r, "offload_disk", ("d2h", "disk_write"), nbytes, S.OFFLOADING)
            return nbytes
        self.stats.offload_refusals += 1
        return 0

    def demote(self, rid: str) -> bool:
        """Start moving an on-host request to disk; False (nothing changed) if it does not fit."""
        r = self._req(rid)
        if r.state is not S.ON_HOST:
            raise IllegalTransition(
                f"demote: request {rid!r} is {r.state.value}; only an on-host request demotes"
            )
        if not self._take(_DISK, r.host):
            self.stats.demote_refusals_disk_full += 1
            return False
        r.disk = r.host
        self._start(r, "demote", ("disk_write",), r.host * self.page_bytes, S.DEMOTING)
        return True

    def reload(self, rid: str) -> bool:
        """Start bringing an offloaded request back; False (nothing changed) if it does not fit."""
        r = self._req(rid)
        if r.state not in (S.ON_HOST, S.ON_DISK):
            raise IllegalTransition(
                f"reload: request {rid!r} is {r.state.value}; only an offloaded request reloads"
            )
        n = self.pages_for(r.tokens)
        if not self._take(_DEV, n):
            self.stats.reload_refusals += 1
            return False
        r.device = n
        if r.state is S.ON_HOST:
            self._start(r, "reload_host", ("h2d",), n * self.page_bytes, S.RELOADING)
        else:
            self._start(r, "reload_disk", ("disk_read", "h2d"), n * self.page_bytes, S.RELOADING)
        return True

    def drop(self, rid: str) -> None:
        """Give up an offloaded request's KV (it will be recomputed); it becomes LOST."""
        r = self._req(rid)
        if r.state not in (S.ON_HOST, S.ON_DISK):
            raise IllegalTransition(
                f"drop: request {rid!r} is {r.state.value}; only an offloaded request is dropped"
            )
        self._give(_HOST, r.host)
        self._give(_DISK, r.disk)
        r.host = r.disk = 0
        self._set(r, S.LOST)
        self.stats.dropped += 1

    # -- integrity ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Page counters equal what the records hold; no tier over capacity; each
        record holds exactly what its state allows."""
        held = list(self._blocks)
        problems = []
        for rid, r in self._reqs.items():
            held[_DEV] += r.device
            held[_HOST] += r.host
            held[_DISK] += r.disk
            if r.tier is not r.state.tier:
                problems.append(f"{rid}: tier {r.tier} does not match state {r.state.value}")
            need = self.pages_for(r.tokens)
            has = tuple(n > 0 for n in (r.device, r.host, r.disk))
            allowed = {
                S.RESIDENT: {(True, False, False)},
                S.OFFLOADING: {(True, True, False), (True, False, True)},
                S.ON_HOST: {(False, True, False)},
                S.DEMOTING: {(False, True, True)},
                S.ON_DISK: {(False, False, True)},
                S.RELOADING: {(True, True, False), (True, False, True)},
                S.LOST: {(False, False, False)},
            }[r.state]
            if need == 0 or r.state is S.LOST:
                allowed = allowed | {(False, False, False)}
            if has not in allowed:
                problems.append(f"{rid}: state {r.state.value} holds device/host/disk {has}")
            for name, n in (("device", r.device), ("host", r.host), ("disk", r.disk)):
                if n and n != need:
                    problems.append(f"{rid}: {n} {name} pages for {r.tokens} tokens")
            if r.state.in_flight != bool(r.job):
                problems.append(f"{rid}: state {r.state.value} but job={r.job}")
        for i, tier in enumerate(_TIERS):
            if held[i] != self._used[i]:
                problems.append(f"{tier.value}: records hold {held[i]} pages, counter says "
                                f"{self._used[i]}")
            if not 0 <= self._used[i] <= self._cap[i]:
                problems.append(f"{tier.value}: {self._used[i]} pages used of {self._cap[i]}")
        if problems:
            raise AssertionError("ModeledKVCache integrity: " + "; ".join(problems[:20]))
