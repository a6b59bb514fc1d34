"""A modeled paged KV cache: page accounting over a chain of tiers, transfers in simulated time.

``ModeledKVCache`` offers the same request lifecycle (``ingest_request``,
``allocate``, ``remove_request``) and the same eviction hooks as
``tiering.resources.kv_cache.PagedKVCache``, with the same answers, but holds no
tensors: each tier is a ``PageTier`` (a page ledger) of a ``TierChain`` and each
request a record. A transfer reserves its destination pages at once, occupies the
links of its route (``ModelledLink``: FIFO, ``latency + bytes / bandwidth`` of the
injected clock, a route of several cut through), and is applied by the first
``poll()`` at or after its completion time, which frees the source pages. With
infinite bandwidth a transfer still completes only at the next ``poll()``, exactly
like a real cache that is synchronized at each poll. The mover itself is the shared
``tiering.core.tiers.PageMover``.

The default chain (``LinkRates.chain``): device, host, disk, with links ``d2h`` and
``h2d`` (device <-> host), ``disk_write`` and ``disk_read`` (host <-> disk). An
offload straight to disk crosses ``d2h`` and ``disk_write``; a reload from disk
crosses ``disk_read`` and ``h2d``. ``ModeledKVCache.from_chain`` runs any other
chain (a remote memory tier beside the host, say: docs/tiers.md).

Cached prefix blocks (``block_tiers.PrefixBlocks``, registered with ``use_blocks``) are
held as ``PagedKVCache`` holds its ``PrefixCache``'s: their pages belong to the store, a
request maps them (``map_blocks``) and holds only its own pages after them, the used
figures leave out blocks no request maps, and ``allocate``, ``reload`` and ``offload``
ask the store for room first (``ensure_device``, ``ensure_host``), as the cache does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tiering.apps.replay.model_pages import RolePages
from tiering.core.lifecycle import Counters, LifecycleAnswers, Op, guard
from tiering.core.tiers import (
    ChainRecord,
    ModelledLink,
    PageMover,
    PageTier,
    Role,
    TierChain,
)
from tiering.core.tiers import Tier as ChainTier
from tiering.core.validate import check_rids
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

#: The owner of the pages a prefix copied into the device lands in (``copy_in``: the
#: caller allocated them; the copy only occupies the links).
PREFIX = ("prefix copy",)


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

    @classmethod
    def of(cls, hardware: object) -> LinkRates:
        """The rates of a ``HardwarePreset`` (``<link>_bps`` and ``<link>_latency_s``)."""
        return cls(*(getattr(hardware, f"{f}_bps") for f in LINKS),
                   *(getattr(hardware, f"{f}_latency_s") for f in LINKS))

    def links(self) -> tuple[ModelledLink, ...]:
        """Fresh ``ModelledLink`` objects at these rates, joining tiers named device, host
        and disk: ``d2h``, ``h2d``, ``disk_write``, ``disk_read``."""
        ends = {"d2h": ("device", "host"), "h2d": ("host", "device"),
                "disk_write": ("host", "disk"), "disk_read": ("disk", "host")}
        return tuple(ModelledLink(*ends[f], getattr(self, f), getattr(self, f"{f}_latency_s"),
                                  name=f) for f in LINKS)

    def chain(self, page_bytes: int, device_pages: int, host_pages: int,
              disk_pages: int) -> TierChain:
        """The three-tier chain of ``PageTier`` objects (device, host, disk) with ``links()``."""
        return TierChain((PageTier("device", Role.DEVICE, device_pages, page_bytes),
                          PageTier("host", Role.HOST, host_pages, page_bytes),
                          PageTier("disk", Role.DISK, disk_pages, page_bytes)), self.links())


class ModelStats(Counters):
    """The shared counters (``tiering.core.lifecycle.Counters``), plus prefix loads, the
    bytes each link copied (``bytes_<link>``, read off the chain's links) and the most
    pages each tier held (``max_<tier>_pages``, read off the tiers that count a
    ``peak_pages``, as ``PageTier`` does)."""

    FIELDS = Counters.FIELDS + ("prefix_loads_from_host", "prefix_loads_from_disk")

    def __init__(self, chain: TierChain) -> None:
        super().__init__()
        derived: dict[str, Callable[[], int]] = {}
        for link in chain.links:
            derived[f"bytes_{link.name}"] = lambda link=link: link.bytes_copied
        for t in chain.tiers:
            if hasattr(t, "peak_pages"):
                derived[f"max_{t.name}_pages"] = lambda t=t: t.peak_pages
        self._derived = derived
        self.FIELDS = type(self).FIELDS + tuple(derived)

    def __getattr__(self, name: str) -> int:  # only names not set as plain counters
        derived = self.__dict__.get("_derived")
        if derived is not None and name in derived:
            return derived[name]()
        raise AttributeError(f"{type(self).__name__} has no counter {name!r}")


NO_OVERRIDES = ResourceReqConfig()


class ModeledKVCache(LifecycleAnswers):
    """Page-accounting stand-in for ``PagedKVCache`` (see the module docstring).

    ``page_bytes`` = ``bytes_per_token * page_tokens``; each tier holds a whole
    number of pages (``host_pages`` and ``disk_pages`` may be 0: no room there).
    ``offload`` goes to the host, or straight to disk when the host is full and
    ``offload_to_disk_when_host_full`` (as the real cache decides,
    ``tiering.core.lifecycle.offload_move``). The records, transitions and
    counters are the shared ``Lifecycle``'s. Not thread-safe; driven from the
    simulator's loop only.

    Calls that name a tier (``free_pages``, ``take_block_pages``, ``copy_in``, ...) take
    its role (``tiering.types.Tier``) and mean every tier of that role together: cached
    block pages fill them fastest first and leave them slowest first, a prefix copy comes
    from the one holding the most of them, and the byte gauges sum them.
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
        self.rates = rates
        self._build(rates.chain(bytes_per_token * page_tokens, device_pages, host_pages,
                                disk_pages), page_tokens, clock, offload_to_disk_when_host_full)

    @classmethod
    def from_chain(cls, chain: TierChain, page_tokens: int, clock: Callable[[], float], *,
                   offload_to_disk_when_host_full: bool = True) -> ModeledKVCache:
        """A modelled cache over ``chain``: tiers of one ``page_bytes`` (a multiple of
        ``page_tokens``), at least one device page and one tier of each role, and links
        that model time (``ModelledLink``; any ``Link`` runs, timed as it says)."""
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
            raise ValueError(f"ModeledKVCache.page_tokens must be an int >= 1, "
                             f"got {page_tokens!r}")
        if not isinstance(chain, TierChain):
            raise TypeError(f"chain must be a TierChain, got {type(chain).__name__}")
        for t in chain.tiers:
            if t.page_bytes % page_tokens:
                raise ValueError(f"ModeledKVCache: tier {t.name!r} has pages of "
                                 f"{t.page_bytes} B, not a multiple of {page_tokens} tokens")
        if chain.device.capacity_pages < 1:
            raise ValueError("ModeledKVCache: the device tier needs at least one page")
        self = cls.__new__(cls)
        self.rates = None
        self._build(chain, page_tokens, clock, offload_to_disk_when_host_full)
        return self

    def _build(self, chain: TierChain, page_tokens: int, clock: Callable[[], float],
               offload_to_disk_when_host_full: bool) -> None:
        if not isinstance(offload_to_disk_when_host_full, bool):
            raise TypeError("ModeledKVCache.offload_to_disk_when_host_full must be a bool, "
                            f"got {offload_to_disk_when_host_full!r}")
        self.chain = chain
        self.stats = ModelStats(chain)
        self._mover = PageMover("ModeledKVCache", chain, self.stats, clock)
        self._life = self._mover.life
        self._reqs: dict[str, ChainRecord] = self._life.records
        self._dev = self._mover.device
        self._hosts = self._mover.hosts
        self._disks = self._mover.disks
        self._pages = RolePages(chain, self._mover, clock)  # block pages, by role
        self.page_tokens = page_tokens
        self.page_bytes = self._mover.page_bytes
        self.device_pages = self._dev.capacity_pages
        self.host_pages = sum(t.capacity_pages for t in self._hosts)
        self.disk_pages = sum(t.capacity_pages for t in self._disks)
        self.offload_to_disk_when_host_full = offload_to_disk_when_host_full
        self._clock = clock
        # (done_at, seq, rid, move, nbytes), a heap; a job whose request was removed is
        # reported by the next poll as not ok, with state None
        self._jobs: list[tuple[float, int, str, Move, int]] = []
        self._abandoned: list[TransferResult] = []
        self._seq = 0
        self._blocks = None  # the block store (use_blocks), or None
        self._mapped: dict[str, tuple[int, int]] = {}  # rid -> (tokens, pages) of blocks mapped

    def use_blocks(self, store) -> None:
        """Hold ``store``'s cached blocks as the cache holds its block store's: ``store``
        answers ``idle_pages(tier)`` (pages of blocks no request maps and none moves: left
        out of the used figures) and makes room (``ensure_device(n)``, ``ensure_host(n)``,
        ``ensure_disk(n)``: True when ``n`` pages of that tier are free). One store per
        cache."""
        if self._blocks is not None and self._blocks is not store:
            raise ValueError("ModeledKVCache.use_blocks: this cache holds another block store")
        for name in ("idle_pages", "ensure_device", "ensure_host", "ensure_disk"):
            if not callable(getattr(store, name, None)):
                raise TypeError(f"use_blocks: the block store has no {name}()")
        self._blocks = store

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
        """Device bytes held, not counting cached blocks no request maps (as the cache)."""
        used = self._dev.used_pages
        if self._blocks is not None:
            used -= self._blocks.idle_pages(Tier.DEVICE)
        return used * self.page_bytes

    def host_used_bytes(self) -> int:
        """Host bytes held, not counting cached blocks no request maps (as the cache)."""
        used = sum(t.used_pages for t in self._hosts)
        if self._blocks is not None:
            used -= self._blocks.idle_pages(Tier.HOST)
        return used * self.page_bytes

    def disk_used_bytes(self) -> int:
        return sum(t.used_pages for t in self._disks) * self.page_bytes

    def device_free_pages(self) -> int:
        return self._dev.free_pages

    @property
    def _used(self) -> list[int]:
        """Pages in use per role (device, host-like, disk-like): a fresh list."""
        return [self._dev.used_pages, sum(t.used_pages for t in self._hosts),
                sum(t.used_pages for t in self._disks)]

    # -- records ----------------------------------------------------------------

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def ingest_request(self, rid: str, overrides: ResourceReqConfig | None = None) -> None:
        """Register ``rid`` with no KV yet (idempotent for identical overrides)."""
        now = self._clock()
        self._life.register(rid, overrides, lambda: ChainRecord(rid, overrides, now),
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
        extra = self._own_pages(rid, num_tokens) - r.device
        if extra > 0:
            blocks = self._blocks
            if blocks is not None and not blocks.ensure_device(extra):
                return False
            if not self._dev.reserve(rid, extra):
                return False
            r.device += extra
        r.num_tokens = num_tokens
        return True

    def _own_pages(self, rid: str, num_tokens: int) -> int:
        """The pages a request of ``num_tokens`` tokens holds itself (past the blocks it maps)."""
        mapped = self._mapped.get(rid)
        if mapped is None:
            return -(-num_tokens // self.page_tokens)
        return -(-(num_tokens - mapped[0]) // self.page_tokens)

    def map_blocks(self, rid: str, tokens: int, pages: int) -> None:
        """Fresh request ``rid`` maps cached blocks holding its first ``tokens`` tokens in
        ``pages`` device pages of the block store (pages it does not hold: as the cache's
        ``attach_prefix``); it holds only the pages of its tokens after them."""
        r = self._life.get(rid, "map_blocks")
        for name, v in (("tokens", tokens), ("pages", pages)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"map_blocks({rid!r}): {name} must be an int >= 0, got {v!r}")
        if r.state is not S.RESIDENT or r.num_tokens or r.device or rid in self._mapped:
            raise ValueError(f"map_blocks({rid!r}): only a fresh request maps blocks")
        if tokens:
            self._mapped[rid] = (tokens, pages)
            r.num_tokens = tokens

    def mapped_pages(self, rid: str) -> int:
        """Device pages of cached blocks ``rid`` maps (``map_blocks``; 0: none)."""
        self._life.get(rid, "mapped_pages")
        mapped = self._mapped.get(rid)
        return 0 if mapped is None else mapped[1]

    def remove_request(self, rid: str) -> None:
        """Forget ``rid`` and free every page it holds (a transfer in flight is abandoned);
        the blocks it mapped are the block store's to release."""
        self._life.remove(rid)
        self._mapped.pop(rid, None)

    def admit(self, step, ctx) -> AdmitOutcome:
        """OK only when the request's KV is resident (a reload lands at a ``poll``)."""
        return AdmitOutcome(*self._life.admission(self._req(step.rid, "admit")))

    def close(self) -> None:
        """Every later call raises CacheClosed (idempotent); nothing runs in the background."""
        self._life.closed = True

    # -- cached prefix blocks (their pages by role: ``RolePages``) -------------------

    def block_pages(self, tier: Tier) -> int:
        """Pages held in ``tier`` by cached prefix blocks (not by any request)."""
        return self._pages.held(tier)

    def free_pages(self, tier: Tier) -> int:
        return self._pages.free(tier)

    def request_fits(self, tier: Tier, n: int) -> bool:
        """Whether a request of ``n`` pages fits on a host-like (``tier`` HOST) or
        disk-like (DISK) tier now: all on one, as a request's move lands in one tier, while
        cached blocks spread over them."""
        return self._pages.request_fits(tier, n)

    def take_block_pages(self, tier: Tier, n: int) -> bool:
        """``n`` pages of ``tier`` now hold cached blocks; False (nothing changed) if short."""
        return self._pages.take(tier, n)

    def give_block_pages(self, tier: Tier, n: int) -> None:
        """``n`` pages of ``tier`` held by cached blocks are free again."""
        self._pages.give(tier, n)

    def move_block_pages(self, src: Tier, dst: Tier, n: int) -> bool:
        """Cached blocks of ``n`` pages go from ``src`` down to ``dst`` (a slower tier): the
        destination is taken and the source freed at once, and the copy occupies its links
        (so transfers started after it queue behind it). False (nothing changed) if ``dst``
        is short."""
        return self._pages.move_down(src, dst, n)

    # -- transfers --------------------------------------------------------------------

    def _start(self, r: ChainRecord, dst: ChainTier, pages: int) -> bool:
        """Start moving ``r`` to ``dst`` (``pages`` reserved there); False if it is short."""
        nbytes = pages * self.page_bytes
        seq = self._seq + 1
        copy = self._mover.start(r, dst, pages, nbytes, handle=seq)
        if copy is None:
            return False
        self._seq = seq
        heapq.heappush(self._jobs, (copy.done, seq, r.rid, r.job.move, nbytes))
        return True

    def copy_in(self, nbytes: int, source: Tier) -> float:
        """A copy of ``nbytes`` from ``source`` (HOST or DISK) into pages the caller
        already allocated on the device, e.g. a reused prefix; returns when it lands."""
        if source is Tier.HOST:
            self.stats.prefix_loads_from_host += 1
        elif source is Tier.DISK:
            self.stats.prefix_loads_from_disk += 1
        else:
            raise ValueError(f"copy_in: source must be HOST or DISK, got {source!r}")
        src = self._pages.source(source)
        return self.chain.copy(src, self._dev, PREFIX, nbytes, now=self._clock()).done

    def _current(self, rid: str, seq: int) -> ChainRecord | None:
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
        """The most pages an offload could take now (host-like, or disk where allowed)."""
        room = max(t.free_pages for t in self._hosts)
        if self.offload_to_disk_when_host_full:
            room = max(room, max(t.free_pages for t in self._disks))
        return room

    def reclaimable(self, rid: str) -> int:
        r = self._reqs.get(rid)
        if r is None:
            raise UnknownRequest(f"unknown request {rid!r}")
        n = r.device
        if r.state is not S.RESIDENT or not n:
            return 0
        if self._mover.offload_to(n, self.offload_to_disk_when_host_full) is not None or (
                self._host_room_with_blocks(n)):
            return n * self.page_bytes
        return 0

    def _host_room_with_blocks(self, n: int) -> bool:
        """Whether ``n`` host pages come free once cached host blocks no request maps
        leave (they count as room, as in the cache: ``offload`` moves them down first)."""
        blocks = self._blocks
        return blocks is not None and (
            self.free_pages(Tier.HOST) + blocks.idle_pages(Tier.HOST) >= n)

    def reclaimable_many(self, rids: Sequence[str]) -> np.ndarray:
        """``reclaimable`` of each of ``rids`` (int64), in one call; changes nothing."""
        check_rids("reclaimable_many", rids)
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
            if n and r.state is resident and (n <= room or self._host_room_with_blocks(n)):
                out[i] = n * page_bytes
        return out

    def get_offload_priority_many(self, rids: Sequence[str]) -> np.ndarray:
        """``get_offload_priority`` of each of ``rids`` (float64), in one call."""
        check_rids("get_offload_priority_many", rids)
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
        return self._own_pages(rid, r.num_tokens) * self.page_bytes

    def offload(self, rid: str) -> int:
        """Start moving a resident request to the host (the first host-like tier with room),
        or to disk when those are full (and that is allowed). Returns the device bytes it
        will free; 0 (nothing changed) when no tier below has room or it holds no pages."""
        r = self._req(rid, "offload")
        guard(r, Op.OFFLOAD)
        n = r.device
        if not n:
            return 0
        blocks = self._blocks
        if blocks is not None:
            blocks.ensure_host(n)  # cached blocks make way for a live request
            if self.offload_to_disk_when_host_full and self._mover.offload_to(n, False) is None:
                blocks.ensure_disk(n)  # on disk too, as the cache's offload
        dst = self._mover.offload_to(n, self.offload_to_disk_when_host_full)
        if dst is None or not self._start(r, dst, n):
            self.stats.offload_refusals += 1
            return 0
        return n * self.page_bytes

    def demote(self, rid: str) -> bool:
        """Start moving an on-host request to disk; False (nothing changed) if it does not fit."""
        r = self._req(rid, "demote")
        guard(r, Op.DEMOTE)
        if not r.host:
            return False
        if self._blocks is not None:
            self._blocks.ensure_disk(r.host)  # cached blocks make way for it, as in the cache
        dst = self._mover.demote_to(r.host)
        if dst is None:
            self.stats.demote_refusals_disk_full += 1
            return False
        return self._start(r, dst, r.host)

    def reload(self, rid: str) -> bool:
        """Start bringing an offloaded request back; False (nothing changed) if it does not fit."""
        r = self._req(rid, "reload")
        guard(r, Op.RELOAD)
        n = self._own_pages(rid, r.num_tokens)
        if self._blocks is not None:
            self._blocks.ensure_device(n)
        if not self._start(r, self._dev, n):
            self.stats.reload_refusals += 1
            return False
        return True

    # -- integrity ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Each tier's ledger is sound and equals what the records (and cached blocks) hold,
        owner by owner; no tier over capacity; each record holds exactly what its state
        allows (``Lifecycle.check``)."""
        problems = self._mover.problems(lambda r: self._own_pages(r.rid, r.num_tokens))
        if problems:
            raise AssertionError("ModeledKVCache integrity: " + "; ".join(problems[:20]))
