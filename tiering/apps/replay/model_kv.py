"""A modeled paged KV cache: byte accounting over three tiers, transfers in simulated time.

``ModeledKVCache`` offers the same request lifecycle (``ingest_request``,
``allocate``, ``remove_request``) and the same eviction hooks as
``tiering.resources.kv_cache.PagedKVCache``, with the same answers, but holds no
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
from dataclasses import dataclass

import numpy as np

from tiering.core import lifecycle as lc
from tiering.core.lifecycle import Counters, LifecycleAnswers, Op, PageRecord, guard
from tiering.errors import UnknownRequest
from tiering.resources.base import AdmitOutcome
from tiering.resources.engine_types import ResourceReqConfig, retention_offload_priority
from tiering.types import (
    OFFLOADED_STATES,
    Move,
    RequestState,
    Tier,
    TransferResult,
)

S = RequestState

LINKS = ("d2h", "h2d", "disk_write", "disk_read")

# tier indices of the page counters (plain ints: this is the simulator's hot path)
_DEV, _HOST, _DISK = 0, 1, 2
_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)  # ``_TIERS.index(tier)``: faster than a dict here
# a copy of cached blocks a tier down: (source index, destination index, links it crosses)
_BLOCK_MOVES = {(Tier.DEVICE, Tier.HOST): (_DEV, _HOST, ("d2h",)),
                (Tier.DEVICE, Tier.DISK): (_DEV, _DISK, ("d2h", "disk_write")),
                (Tier.HOST, Tier.DISK): (_HOST, _DISK, ("disk_write",))}


def _removed(rid: str, move: Move, nbytes: int) -> TransferResult:  # reported by ``poll``
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


class ModelStats(Counters):
    """The shared counters (``tiering.core.lifecycle.Counters``), plus bytes per
    link, prefix loads and the most pages each tier held."""

    FIELDS = Counters.FIELDS + (
        "prefix_loads_from_host", "prefix_loads_from_disk",
        *(f"bytes_{link}" for link in LINKS),
        "max_device_pages", "max_host_pages", "max_disk_pages")


NO_OVERRIDES = ResourceReqConfig()
_PEAKS = ("max_device_pages", "max_host_pages", "max_disk_pages")

# the links each move crosses
_MOVE_LINKS = {
    Move.OFFLOAD_TO_HOST: ("d2h",), Move.OFFLOAD_TO_DISK: ("d2h", "disk_write"),
    Move.DEMOTE: ("disk_write",), Move.RELOAD_FROM_HOST: ("h2d",),
    Move.RELOAD_FROM_DISK: ("disk_read", "h2d"),
}


class ModeledKVCache(LifecycleAnswers):
    """Byte-accounting stand-in for ``PagedKVCache`` (see the module docstring).

    ``page_bytes`` = ``bytes_per_token * page_tokens``; each tier holds a whole
    number of pages (``host_pages`` and ``disk_pages`` may be 0: no such tier).
    ``offload`` goes to the host, or straight to disk when the host is full and
    ``offload_to_disk_when_host_full`` (as the real cache decides,
    ``tiering.core.lifecycle.offload_move``). The records, transitions and
    counters are the shared ``Lifecycle``'s. Not thread-safe; driven from the
    simulator's loop only.
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
        *,
        offload_to_disk_when_host_full: bool = True,
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
        if not isinstance(offload_to_disk_when_host_full, bool):
            raise TypeError("ModeledKVCache.offload_to_disk_when_host_full must be a bool, "
                            f"got {offload_to_disk_when_host_full!r}")
        self.page_tokens = page_tokens
        self.page_bytes = bytes_per_token * page_tokens
        self.device_pages = device_pages
        self.host_pages = host_pages
        self.disk_pages = disk_pages
        self.rates = rates
        self.offload_to_disk_when_host_full = offload_to_disk_when_host_full
        self._clock = clock
        self.ledger = lc.PageLedger(device_pages, host_pages, disk_pages)
        self._used = self.ledger.used  # the same list: read directly on the hot path
        self._cap = self.ledger.cap
        self._peak = [0, 0, 0]  # the most pages each tier held (``stats.max_*_pages``)
        self._blocks = [0, 0, 0]  # pages held by cached prefix blocks (``take_block_pages``)
        self._free_at = dict.fromkeys(LINKS, 0.0)
        # links -> (rates, bandwidth, latency, byte counters): ``_occupy``'s constants
        self._link_costs: dict[tuple[str, ...], tuple] = {}
        self.stats = ModelStats()
        self._life = lc.Lifecycle("ModeledKVCache", self.stats, clock,
                                  lc.page_releasers(self.ledger),
                                  release_all=lc.page_release_all(self.ledger))
        self._reqs: dict[str, PageRecord] = self._life.records
        # (done_at, seq, rid, move, nbytes), a heap; a job whose request was removed is
        # reported by the next poll as not ok, with state None
        self._jobs: list[tuple[float, int, str, Move, int]] = []
        self._abandoned: list[TransferResult] = []
        self._seq = 0

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

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def ingest_request(self, rid: str, overrides: ResourceReqConfig | None = None) -> None:
        """Register ``rid`` with no KV yet (idempotent for identical overrides)."""
        now = self._clock()
        self._life.register(rid, overrides, lambda: PageRecord(rid, overrides, now),
                            ResourceReqConfig)

    def allocate(self, rid: str, num_tokens: int) -> bool:
        """Grow ``rid`` to ``num_tokens`` tokens; False (nothing changed) if the device is short."""
        r = self._life.get(rid, "allocate")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"allocate({rid!r}): num_tokens must be an int >= 0, "
                             f"got {num_tokens!r}")
        if r.state is not S.RESIDENT:  # the hot path asks once, the guard says why
            guard(r, Op.ALLOCATE)
        if num_tokens <= r.num_tokens:
            return True
        extra = self.pages_for(num_tokens) - r.device
        if extra > 0:
            if not self._take(_DEV, extra):
                return False
            r.device += extra
        r.num_tokens = num_tokens
        return True

    def remove_request(self, rid: str) -> None:
        """Forget ``rid`` and free every page it holds (a transfer in flight is abandoned)."""
        self._life.remove(rid)

    def admit(self, step, ctx) -> AdmitOutcome:
        """OK only when the request's KV is resident (a reload lands at a ``poll``)."""
        return AdmitOutcome(*self._life.admission(self._req(step.rid, "admit")))

    def close(self) -> None:
        """Every later call raises CacheClosed (idempotent); nothing runs in the background."""
        self._life.closed = True

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
        self._used[i] -= n
        self._blocks[i] -= n

    def move_block_pages(self, src: Tier, dst: Tier, n: int) -> bool:
        """Cached blocks of ``n`` pages go from ``src`` down to ``dst`` (HOST or DISK): the
        destination is taken and the source freed at once, and the copy occupies its links
        (so transfers started after it queue behind it). False (nothing changed) if ``dst``
        is short."""
        move = _BLOCK_MOVES.get((src, dst))
        if move is None:
            raise ValueError(f"move_block_pages: no move from {src!r} to {dst!r}")
        si, di, links = move
        blocks = self._blocks
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= blocks[si]:
            raise ValueError(f"move_block_pages: n must be an int in [0, {blocks[si]}] "
                             f"for {src.value}, got {n!r}")
        if not self._take(di, n):
            return False
        blocks[di] += n
        self._used[si] -= n
        blocks[si] -= n
        self._occupy(links, n * self.page_bytes)
        return True

    def _take(self, tier: int, n: int) -> bool:
        used = self._used[tier] + n
        if used > self._cap[tier]:
            return False
        self._used[tier] = used
        peak = self._peak
        if used > peak[tier]:
            peak[tier] = used
            setattr(self.stats, _PEAKS[tier], used)
        return True

    # -- transfers --------------------------------------------------------------------

    def _occupy(self, links: tuple[str, ...], nbytes: int) -> float:
        """Reserve ``links`` for a copy of ``nbytes``; return its completion time."""
        now = self._clock()
        rates = self.rates
        cost = self._link_costs.get(links)
        if cost is None or cost[0] is not rates:  # per link set, while ``rates`` stays
            cost = self._link_costs[links] = (
                rates,
                min(getattr(rates, name) for name in links),
                sum(getattr(rates, f"{name}_latency_s") for name in links),
                tuple(f"bytes_{name}" for name in links),
            )
        _, rate, latency, counted = cost
        free_at = self._free_at
        start = now
        for name in links:
            if free_at[name] > start:
                start = free_at[name]
        done = start + latency + nbytes / rate
        stats = self.stats
        for name, attr in zip(links, counted, strict=True):
            free_at[name] = done
            setattr(stats, attr, getattr(stats, attr) + nbytes)
        return done

    def _start(self, r: PageRecord, move: Move, nbytes: int) -> None:
        done = self._occupy(_MOVE_LINKS[move], nbytes)
        self._seq += 1
        self._life.begin(r, lc.Job(move, self._clock(), self._seq))
        heapq.heappush(self._jobs, (done, self._seq, r.rid, move, nbytes))

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

    def _current(self, rid: str, seq: int) -> PageRecord | None:
        r = self._reqs.get(rid)
        return r if r is not None and r.job is not None and r.job.handle == seq else None

    def next_completion(self) -> float | None:
        """Clock time at which the earliest transfer in flight completes (None: none)."""
        jobs = self._jobs
        while jobs:
            _, seq, rid, move, nbytes = jobs[0]
            if self._current(rid, seq) is not None:
                return jobs[0][0]
            heapq.heappop(jobs)  # its request was removed: the next poll reports it
            self._abandoned.append(_removed(rid, move, nbytes))
        return None

    def in_flight(self) -> int:
        return len(self._life.inflight)

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
        life = self._life
        while jobs and jobs[0][0] <= now:
            finished_at, seq, rid, move, nbytes = heapq.heappop(jobs)
            r = self._current(rid, seq)
            if r is None:
                out.append(_removed(rid, move, nbytes))
                continue
            job = life.end(r)
            out.append(life.land(r, move, nbytes, job.started, finished_at))
        return out

    # -- eviction hooks ----------------------------------------------------------------

    @property
    def supports_eviction(self) -> bool:
        return True

    def _room_below(self) -> int:
        """The most pages an offload could take now (host, or disk where allowed)."""
        used, cap = self._used, self._cap
        room = cap[_HOST] - used[_HOST]
        if self.offload_to_disk_when_host_full:
            room = max(room, cap[_DISK] - used[_DISK])
        return room

    def reclaimable(self, rid: str) -> int:
        r = self._reqs.get(rid)
        if r is None:
            raise UnknownRequest(f"unknown request {rid!r}")
        n = r.device
        if r.state is not S.RESIDENT or not n:
            return 0
        used, cap = self._used, self._cap
        if used[_HOST] + n <= cap[_HOST] or (
                self.offload_to_disk_when_host_full and used[_DISK] + n <= cap[_DISK]):
            return n * self.page_bytes
        return 0

    def reclaimable_many(self, rids: Sequence[str]) -> np.ndarray:
        """``reclaimable`` of each of ``rids`` (int64), in one call; changes nothing."""
        reqs = self._reqs
        room = self._room_below()
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
        o = r.overrides or NO_OVERRIDES
        return retention_offload_priority(o.retention_priority, o.retention_expiry_s,
                                          self._clock() - r.ingested_at)

    def reload_bytes(self, rid: str) -> int:
        r = self._req(rid)
        if r.state not in OFFLOADED_STATES:
            return 0
        return self.pages_for(r.num_tokens) * self.page_bytes

    def offload(self, rid: str) -> int:
        """Start moving a resident request to host, or to disk when the host is full (and
        that is allowed). Returns the device bytes it will free; 0 (nothing changed) when
        no tier below has room or the request holds no pages."""
        r = self._req(rid, "offload")
        guard(r, Op.OFFLOAD)
        n = r.device
        used, cap = self._used, self._cap
        move = lc.offload_move(used[_HOST] + n <= cap[_HOST], used[_DISK] + n <= cap[_DISK],
                            self.offload_to_disk_when_host_full) if n else None
        if move is None:
            if n:
                self.stats.offload_refusals += 1
            return 0
        if move is Move.OFFLOAD_TO_HOST:
            self._take(_HOST, n)
            r.host = n
        else:
            self._take(_DISK, n)
            r.disk = n
        nbytes = n * self.page_bytes
        self._start(r, move, nbytes)
        return nbytes

    def demote(self, rid: str) -> bool:
        """Start moving an on-host request to disk; False (nothing changed) if it does not fit."""
        r = self._req(rid, "demote")
        guard(r, Op.DEMOTE)
        if not r.host:
            return False
        if not self._take(_DISK, r.host):
            self.stats.demote_refusals_disk_full += 1
            return False
        r.disk = r.host
        self._start(r, Move.DEMOTE, r.host * self.page_bytes)
        return True

    def reload(self, rid: str) -> bool:
        """Start bringing an offloaded request back; False (nothing changed) if it does not fit."""
        r = self._req(rid, "reload")
        guard(r, Op.RELOAD)
        n = self.pages_for(r.num_tokens)
        if not self._take(_DEV, n):
            self.stats.reload_refusals += 1
            return False
        r.device = n
        self._start(r, lc.RELOAD_FROM[r.state.tier], n * self.page_bytes)
        return True

    # -- integrity ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Page counters equal what the records (and cached blocks) hold; no tier over
        capacity; each record holds exactly what its state allows (``Lifecycle.check``)."""
        used, cap = lc.ledger_maps(self.ledger)
        extra = dict(zip(lc.TIERS, self._blocks, strict=True))
        problems = self._life.check(lambda r: self.pages_for(r.num_tokens), used=used,
                                    capacity=cap, extra=extra)
        if problems:
            raise AssertionError("ModeledKVCache integrity: " + "; ".join(problems[:20]))
