"""``TieredKV``: the one object a serving worker embeds.

It owns a ``PagedKVCache``, an ``EvictionController``, the pressure source and
the policy, and drives them in the order a step needs::

    tkv = TieredKV(TieredKVConfig(geometry=geom, device_pages=64, host_pages=256))
    tkv.add("req-1")
    ready = tkv.prepare(batch)       # asks offloaded requests back, admits the rest
    model.step(ready)                # reads and writes tkv.kv
    tkv.after_step(ready)            # touches what ran, evicts at the safe point
    tkv.remove("req-1")
    tkv.close()

A worker that picks its own batch (a window, a token budget) calls ``poll()``
once per step and ``ready(rid, step)`` per candidate (a ``Readiness``);
``prepare`` is exactly that over a whole batch.

The parts stay usable alone (the engine's ``Resource`` contract) for an engine
that drives them itself.
"""

from __future__ import annotations

import enum
import inspect
import logging
import os
import shutil
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiering.control.controller import ControllerConfig, EvictionController, EvictionReport
from tiering.control.pressure import PressureSource, cache_pressure
from tiering.control.protocols import TieredCache
from tiering.core.frozen import FrozenMap
from tiering.core.validate import check_clock, check_timeout, is_int
from tiering.errors import BadRequestId, UnknownRequest
from tiering.policies import PolicyRegistry, default_registry, make_policy
from tiering.policies.base import Policy
from tiering.resources.base import ResourceReqConfig, ResourceStep, StepContext
from tiering.resources.kv_geometry import KVGeometry
from tiering.types import RequestState

if TYPE_CHECKING:  # pragma: no cover - imported where a TieredKV builds its own cache
    from tiering.disk.config import DiskConfig
    from tiering.resources.kv_cache import PagedKVCache


log = logging.getLogger("tiering.tiered")


DEFAULT_STALL_WARN_STEPS = 50


def _check_stall_steps(name: str, value: object) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


def _check_pages(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TieredKVConfig.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class TieredKVConfig:
    """What a ``TieredKV`` is built from.

    ``device_pages`` / ``host_pages``: the pools' sizes in KV pages of
    ``geometry.page_bytes`` (``from_bytes`` takes bytes); every other size is bytes
    (``tiering.units``). ``policy``: a registered policy name or a ``Policy`` instance
    (a name whose factory needs the ``resource`` it reads priorities from, such as
    ``"priority"``, is given the cache's, ``"kv"``).
    ``pressure``: builds the pressure source from the cache (default
    ``cache_pressure``: the pool's own occupancy on a CPU; on a GPU the worse of
    that and the whole device as NVML sees it). ``cache_options``: further keyword
    arguments of ``PagedKVCache`` (``copy_workers``, ``disk_wrap_store``, ...), their values
    checked here as the cache checks them.
    ``disk``: a local directory that does not exist yet, with ``on_start="clear"``, is
    created by the cache and removed with everything in it (its preallocated slot file
    too) by ``close()``; create the directory first, or use ``on_start="reattach"``, to
    keep it for a later process.
    ``stall_warn_steps``: a request ``ready`` or ``prepare`` has asked back this many
    steps in a row without its reload starting is logged once as stalled, naming what it
    waits for (``None``: never).
    """

    geometry: KVGeometry
    device: str = "cpu"
    device_pages: int = 64
    host_pages: int = 64
    disk: DiskConfig | None = None
    verify: bool = False
    offload_to_disk_when_host_full: bool = True
    policy: str | Policy = "lru"
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    pressure: Callable[[PagedKVCache], PressureSource] = cache_pressure
    cache_options: dict[str, Any] = field(default_factory=dict)
    stall_warn_steps: int | None = DEFAULT_STALL_WARN_STEPS

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, KVGeometry):
            raise TypeError(
                f"TieredKVConfig.geometry must be a KVGeometry, got {type(self.geometry).__name__}"
            )
        _check_stall_steps("TieredKVConfig.stall_warn_steps", self.stall_warn_steps)
        _check_pages("device_pages", self.device_pages)
        _check_pages("host_pages", self.host_pages)
        if not isinstance(self.device, (str, torch.device)):
            raise TypeError(
                f"TieredKVConfig.device must be a str or torch.device, got {self.device!r}")
        from tiering.resources.kv_geometry import parse_device

        parse_device("TieredKVConfig", self.device)  # ValueError naming the field, not torch's
        for name in ("verify", "offload_to_disk_when_host_full"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"TieredKVConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.disk is not None:
            from tiering.disk.config import (  # zarr: loaded only for a config with a disk
                DiskConfig,
                check_capacity_pages,
            )

        if self.disk is not None and not isinstance(self.disk, DiskConfig):
            raise TypeError(
                f"TieredKVConfig.disk must be a DiskConfig or None, got {type(self.disk).__name__}"
            )
        if self.disk is not None:
            check_capacity_pages(self.disk.capacity_bytes, self.geometry.page_bytes)
        if not isinstance(self.policy, (str, Policy)):
            raise TypeError(
                f"TieredKVConfig.policy must be a policy name or a Policy, got {self.policy!r}"
            )
        if not isinstance(self.controller, ControllerConfig):
            raise TypeError("TieredKVConfig.controller must be a ControllerConfig")
        if not callable(self.pressure):
            raise TypeError("TieredKVConfig.pressure must be callable (cache -> PressureSource)")
        if not isinstance(self.cache_options, Mapping):
            raise TypeError(
                f"TieredKVConfig.cache_options must be a dict, got {self.cache_options!r}")
        reserved = {"geometry", "device", "device_pages", "host_pages", "disk", "verify",
                    "offload_to_disk_when_host_full", "clock"}
        clash = reserved & set(self.cache_options)
        if clash:
            raise ValueError(
                f"TieredKVConfig.cache_options must not repeat fields of the config: {sorted(clash)}"
            )
        from tiering.resources.kv_cache import PagedKVCache

        known = set(inspect.signature(PagedKVCache).parameters) - reserved
        unknown = sorted(set(self.cache_options) - known, key=repr)
        if unknown:
            raise ValueError(
                f"TieredKVConfig.cache_options: {unknown} are not options of PagedKVCache; "
                f"known: {sorted(known)}"
            )
        _check_cache_options(self, PagedKVCache)
        # a read-only copy: the caller's dict may change later, this checked config may not
        object.__setattr__(self, "cache_options", FrozenMap(self.cache_options))


    @classmethod
    def from_bytes(cls, geometry: KVGeometry, *, device_bytes: int, host_bytes: int,
                   **fields: Any) -> TieredKVConfig:
        """A config whose pools hold the whole pages that fit in ``device_bytes`` and
        ``host_bytes`` (``from_bytes(geom, device_bytes=gib(2), host_bytes=gib(8))``);
        ``fields``: the config's other fields. ValueError naming the size that holds no
        page."""
        if not isinstance(geometry, KVGeometry):
            raise TypeError(
                f"TieredKVConfig.from_bytes: geometry must be a KVGeometry, got "
                f"{type(geometry).__name__}")
        for name in ("device_pages", "host_pages"):
            if name in fields:
                raise ValueError(f"TieredKVConfig.from_bytes: give {name[:-6]}_bytes, "
                                 f"not {name}")
        pages = {}
        for name, nbytes in (("device", device_bytes), ("host", host_bytes)):
            if not is_int(nbytes) or nbytes < geometry.page_bytes:
                raise ValueError(
                    f"TieredKVConfig.from_bytes: {name}_bytes must be an int of at least one "
                    f"page ({geometry.page_bytes} bytes), got {nbytes!r}")
            pages[f"{name}_pages"] = nbytes // geometry.page_bytes
        return cls(geometry=geometry, **pages, **fields)


def _check_cache_options(config: TieredKVConfig, cache_class: type) -> None:
    """The values of ``config.cache_options``, checked as the cache will check them
    (``KVOptions`` and the injected disk store and host runtime), so that a bad one is
    refused by the config, naming ``TieredKVConfig.cache_options``, not later by
    ``TieredKV``."""
    from tiering.resources.kv_options import KVOptions
    from tiering.resources.kv_storage import check_injected

    given = {name: p.default for name, p in inspect.signature(cache_class).parameters.items()
             if p.default is not inspect.Parameter.empty}
    given.update(config.cache_options)
    try:
        KVOptions(config.device_pages, config.host_pages, config.verify,
                  config.offload_to_disk_when_host_full, given["copy_workers"],
                  given["io_workers"], time.monotonic, given["copy_fault_hook"],
                  given["disk_wrap_store"], given["staging"], given["stage_disk_io"],
                  given["layerwise_reload"], given["layer_wait_timeout_s"],
                  given["stream_window_pages"], given["stream_buffer_pages"])
        check_injected(config.geometry, config.disk, given["disk_store"], given["host_runtime"])
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"TieredKVConfig.cache_options: {exc}") from None


_CACHE_METHODS = tuple(sorted({
    name for proto in TieredCache.__mro__ if proto not in (object,)
    for name, value in vars(proto).items()
    if not name.startswith("_") and callable(value)
}))


#: the name the front door's cache has in its controller (what a PRIORITY policy asks)
CACHE_RESOURCE = "kv"


def _resolve_policy(policy: str | Policy, registry: Any) -> Policy:
    """A policy name is built from ``registry`` (default: the built-ins); one whose factory
    needs the ``resource`` it reads priorities from ("priority") is given the cache's."""
    if isinstance(policy, str):
        reg = default_registry() if registry is None else registry
        needs = reg.required_options(policy) if isinstance(reg, PolicyRegistry) else ()
        options = {"resource": CACHE_RESOURCE} if "resource" in needs else {}
        return make_policy(policy, registry=registry, **options)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a policy name or a Policy, got {policy!r}")
    return policy


def _close_cache(kv: Any) -> None:
    kv.close()


def _disk_dir_to_create(disk: DiskConfig | None) -> Path | None:
    """The topmost directory a cache over ``disk`` will create (a local path that does
    not exist yet, cleared at start), which ``close`` removes; None when there is none."""
    if disk is None or disk.store is not None or disk.path is None or disk.on_start != "clear":
        return None
    text = os.fspath(disk.path)
    if "://" in text:
        return None
    path = Path(text).absolute()
    if path.exists():
        return None
    top = path
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    return top


def _remove_dir(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("TieredKV.close: could not remove the disk directory it created, %s: %s",
                    path, exc)


def _stop_source(source: Any) -> None:
    """Stop a pressure source the front door built (a poller's thread): ``stop()``, else
    ``close()``, where it has one. A failure is logged; the cache is closed regardless."""
    for name in ("stop", "close"):
        fn = getattr(source, name, None)
        if callable(fn):
            try:
                fn()
            except Exception as exc:
                log.error("TieredKV.close: the pressure source's %s() failed: %s: %s",
                          name, type(exc).__name__, exc)
            return


def _is_source(pressure: object) -> bool:
    """A pressure source instance (``read`` or ``latest``), not a class of them."""
    if isinstance(pressure, type):
        return False
    return callable(getattr(pressure, "read", None)) or callable(getattr(pressure, "latest", None))


def _pressure_factory(pressure: object) -> Callable[[Any], PressureSource]:
    """``pressure`` as ``cache -> source``: None is ``cache_pressure``, a source is
    used as it is, a class or another callable is called with the cache."""
    if pressure is None:
        return cache_pressure
    if _is_source(pressure):
        return lambda _cache: pressure  # type: ignore[return-value]
    if callable(pressure):
        return pressure  # type: ignore[return-value]
    raise TypeError(
        f"pressure must be a pressure source, a callable (cache -> source) or None, "
        f"got {pressure!r}"
    )


#: The attribute a driven cache carries: a weak reference to the TieredKV that drives it
#: (one front door, one controller, per cache). A cache that cannot take an attribute
#: (``__slots__`` without it) is driven unmarked.
_DRIVER_ATTR = "_tiered_driver"


def _driver_of(cache: Any) -> TieredKV | None:
    ref = getattr(cache, _DRIVER_ATTR, None)
    tkv = ref() if isinstance(ref, weakref.ref) else None
    if tkv is None or tkv._closed or tkv.kv is not cache:
        return None
    return tkv


class Readiness(enum.Enum):
    """What ``TieredKV.ready`` found for one request of a batch."""

    READY = "ready"  # on the device and admitted: it may run this step
    ASKED_BACK = "asked_back"  # offloaded: its reload was asked for (it runs a later step)
    WAITING = "waiting"  # a copy of it is still moving (the cache did not admit it)
    LOST = "lost"  # its KV is gone (``take_lost`` says why)


_STATS_PARTS = ("kv", "controller")


class TieredKV:
    """A tiered KV cache with its controller, driven once per step (see the module doc).

    ``clock`` is shared by the cache and the controller (residency, ageing,
    retention expiry). Registering is one call: ``add`` is idempotent for the
    same settings and refuses different ones, like the cache's
    ``ingest_request``. Not thread-safe: drive it from the worker's step thread.
    """

    def __init__(
        self,
        config: TieredKVConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        policy_registry: Any = None,
    ) -> None:
        if not isinstance(config, TieredKVConfig):
            raise TypeError(f"TieredKV needs a TieredKVConfig, got {type(config).__name__}")
        check_clock("TieredKV", clock)
        policy = _resolve_policy(config.policy, policy_registry)
        from tiering.resources.kv_cache import (
            PagedKVCache,  # paid only by a TieredKV that builds one
        )

        created = _disk_dir_to_create(config.disk)
        try:
            kv = PagedKVCache(
                config.geometry, device=config.device, device_pages=config.device_pages,
                host_pages=config.host_pages, disk=config.disk, verify=config.verify,
                offload_to_disk_when_host_full=config.offload_to_disk_when_host_full,
                clock=clock, **config.cache_options,
            )
            self.config: TieredKVConfig | None = config
            self._assemble(kv, policy, config.pressure, config.controller, clock,
                           stall_warn_steps=config.stall_warn_steps)
        except BaseException:
            if created is not None:  # the cache was closed (or never built): nothing left
                _remove_dir(created)
            raise
        self._created_disk = created

    @classmethod
    def around(
        cls,
        cache: Any,
        *,
        policy: str | Policy = "lru",
        pressure: Any = None,
        controller: ControllerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy_registry: Any = None,
        stall_warn_steps: int | None = DEFAULT_STALL_WARN_STEPS,
    ) -> TieredKV:
        """A ``TieredKV`` over a cache built elsewhere: any resource with the
        eviction hooks (``PagedKVCache``, the replay's modelled cache, the test
        fake). ``pressure``: a pressure source, a callable ``cache -> source``
        (a source class such as ``PoolPressure`` is one), or None for
        ``cache_pressure(cache)``. The ``TieredKV`` owns the cache
        from then on: ``close()`` closes it. A refused argument (a cache without
        the hooks, a controller, pressure or clock of the wrong kind) raises
        before that and leaves the cache open (so does a cache another open ``TieredKV``
        drives: ValueError, one controller per cache); a failure while assembling (the
        pressure factory or the controller raising) closes it. ``stall_warn_steps``: as
        in ``TieredKVConfig``."""
        check_clock("TieredKV.around", clock)
        missing = [m for m in _CACHE_METHODS if not callable(getattr(cache, m, None))]
        if missing:
            raise TypeError(
                f"TieredKV.around: {type(cache).__name__} lacks {missing} (see TieredCache)"
            )
        if not cache.supports_eviction:
            raise TypeError(
                f"TieredKV.around needs a cache that supports eviction, got {type(cache).__name__}"
            )
        if _driver_of(cache) is not None:
            raise ValueError(
                f"TieredKV.around: this {type(cache).__name__} is already driven by an open "
                "TieredKV (two controllers would move the same requests); close that one, "
                "which closes the cache, or use it")
        if controller is None:
            controller = ControllerConfig()
        if not isinstance(controller, ControllerConfig):
            raise TypeError(
                f"TieredKV.around: controller must be a ControllerConfig, got {controller!r}"
            )
        _check_stall_steps("TieredKV.around: stall_warn_steps", stall_warn_steps)
        factory = _pressure_factory(pressure)
        self = cls.__new__(cls)
        self.config = None
        self._created_disk = None  # the cache's disk is the caller's
        self._assemble(cache, _resolve_policy(policy, policy_registry), factory, controller,
                       clock, owns_pressure=not _is_source(pressure),
                       stall_warn_steps=stall_warn_steps)
        return self

    def _assemble(self, kv: Any, policy: Policy, pressure: Callable[[Any], PressureSource],
                  controller: ControllerConfig, clock: Callable[[], float], *,
                  owns_pressure: bool = True,
                  stall_warn_steps: int | None = DEFAULT_STALL_WARN_STEPS) -> None:
        self.policy = policy
        self.kv = kv
        # a source the front door built is its to stop; one handed in is the caller's
        self._owns_pressure = False
        try:
            self.pressure = pressure(kv)
            self._owns_pressure = owns_pressure
            self.controller = EvictionController(
                {CACHE_RESOURCE: kv}, policy, self.pressure, controller, clock=clock
            )
            for rid in kv.requests():  # reattached from disk by an earlier process
                self.controller.add_request(rid)
        except BaseException:
            if self._owns_pressure:
                _stop_source(self.pressure)
            _close_cache(kv)
            raise
        self._running: frozenset[str] = frozenset()
        self._closed = False
        self._stalls = _StallWatch(stall_warn_steps)
        try:
            setattr(kv, _DRIVER_ATTR, weakref.ref(self))
        except (AttributeError, TypeError):
            pass  # a cache with __slots__: unmarked (a second TieredKV is not refused)

    # -- registration -----------------------------------------------------------

    def add(self, rid: str, config: ResourceReqConfig | None = None) -> None:
        """Register a request with the cache and the controller (idempotent). ``rid`` is a
        str (TypeError otherwise); ``config`` a ``ResourceReqConfig`` or None."""
        self._check_open()
        _check_ids((rid,), "add", "request")
        self.kv.ingest_request(rid, config)  # validates; refuses different settings
        self.controller.add_request(rid)  # idempotent

    def remove(self, rid: str) -> None:
        """Forget a request everywhere and give back its slots. One the cache no longer
        knows (removed behind the front door, straight from ``tkv.kv``) is forgotten by
        the controller too, which mends that disagreement (logged)."""
        self._check_open()
        _check_ids((rid,), "remove", "request")
        if not self.controller.knows(rid):
            raise UnknownRequest(f"TieredKV.remove: unknown request {rid!r}")
        try:
            self.kv.remove_request(rid)
        except UnknownRequest:
            log.warning("TieredKV.remove: %r was already gone from the cache (removed behind "
                        "the front door); the controller forgets it too", rid)
        self.controller.remove_request(rid)
        self._stalls.forget(rid)

    def requests(self) -> list[str]:
        """The registered requests, sorted (the controller's table is the one list)."""
        self._check_open()
        return self.controller.requests()

    # -- the step ---------------------------------------------------------------

    def prepare(self, batch: Sequence[str], step: int = 0) -> list[str]:
        """The requests of ``batch`` whose KV is on the device and ready, in order.

        Finished copies are applied and waiting reloads that fit are started first
        (``poll``); then each request is ``ready``-checked: an offloaded one is asked
        back (admitted only when it fits) and is not ready this step; a lost one is not
        ready (``take_lost`` says why). One asked back ``stall_warn_steps`` steps in a
        row without its reload starting is logged once (see ``stalled``)."""
        self._check_open()
        batch = _as_ids(batch, "prepare", "batch")
        self._check_batch(batch, "prepare")
        _check_step(step, "prepare")
        if len(set(batch)) < len(batch):
            seen: set[str] = set()
            twice = sorted({rid for rid in batch if rid in seen or seen.add(rid)})
            raise ValueError(f"TieredKV.prepare: batch names request(s) {twice[:5]} more than once")
        self._poll(in_prepare=True)
        kv, controller = self.kv, self.controller
        for rid in batch:  # a reload refused for good is raised before any request is asked
            if kv.is_offloaded(rid):
                err = controller.reload_refusal(rid)
                if err is not None:
                    raise err
        return [rid for rid in batch if self._ready(rid, step) is Readiness.READY]

    def poll(self) -> None:
        """Apply every finished copy now (the controller settles its ledgers from what
        completed), then start the waiting reloads that fit; ``prepare`` does this first.
        Making room for a reload that does not fit is ``after_step``'s work. One call is
        one step for the stall warning."""
        self._check_open()
        self._poll()

    def _poll(self, in_prepare: bool = False) -> None:
        self.controller.poll()
        self.controller.serve_reloads()
        self._stalls.step(in_prepare)

    def ready(self, rid: str, step: int = 0) -> Readiness:
        """One request of a batch, for a worker that picks its batch itself (a
        window, a token budget): READY when its KV is on the device and the
        cache admits it for ``step``; an offloaded one is asked back
        (ASKED_BACK); WAITING while a copy of it moves; LOST when its KV is
        gone. Does not poll: call ``poll`` once per step first."""
        self._check_open()
        self._check_batch((rid,), "ready")
        _check_step(step, "ready")
        return self._ready(rid, step)

    def _ready(self, rid: str, step: int) -> Readiness:
        kv = self.kv
        if kv.is_offloaded(rid):
            self.controller.request_reload(rid)
            stalled = self._stalls.check(rid, kv.state_of(rid))
            if stalled is not None:
                log.warning("TieredKV: %s", self._stall_text(rid, stalled))
            return Readiness.ASKED_BACK
        self._stalls.forget(rid)  # on the device or moving: not stalled
        if kv.admit(ResourceStep(rid), StepContext(step)):
            return Readiness.READY
        if kv.state_of(rid) is RequestState.LOST:
            return Readiness.LOST
        return Readiness.WAITING

    def stalled(self) -> dict[str, int]:
        """Requests asked back for ``stall_warn_steps`` steps in a row whose reload has
        not started: rid -> steps so far (each was logged once when it crossed the mark)."""
        self._check_open()
        return self._stalls.stalled()

    def _stall_text(self, rid: str, steps: int) -> str:
        state = self.kv.state_of(rid)
        name = getattr(state, "name", str(state))
        head = f"request {rid!r} asked back for {steps} steps and still {name}"
        pending = self.controller.pending_reloads()
        if rid not in pending:
            return f"{head}: it waits for its reload to be asked for again"
        need = getattr(self.kv, "reload_bytes", None)
        need_text = f"{need(rid)} bytes" if callable(need) else "room"
        cfg = self.controller.config
        used = self.kv.device_used_bytes()
        cap = self.controller.device_capacity_bytes
        since = self._stalls.steps_since_after_step
        text = (f"{head}: its reload waits (place {pending.index(rid) + 1} of {len(pending)}) "
                f"for {need_text} of device room; {used} of {cap} bytes are in use and "
                f"reloads are admitted up to (high - reload_headroom) = "
                f"{cfg.high - cfg.reload_headroom:.2f} of capacity")
        if since is None or since >= steps:
            text += ("; after_step has not run since it was asked back, and only "
                     "after_step offloads idle requests to make room: call it every step, "
                     "with an empty ran when nothing ran")
        else:
            text += (f"; after_step offloads idle requests for it once it has waited "
                     f"aging_s = {cfg.aging_s:g} s (below high = {cfg.high:g} nothing is "
                     "offloaded before that); a device where (1 - high) x capacity holds "
                     "the largest reload never waits so")
        return text

    def knows(self, rid: str) -> bool:
        """Whether ``rid`` (a str) is registered."""
        self._check_open()
        _check_ids((rid,), "knows", "request")
        return self.controller.knows(rid)

    def after_step(self, ran: Iterable[str], keep: Collection[str] = ()) -> EvictionReport:
        """Mark ``ran`` as used now and let the controller move KV at this safe
        point; ``ran`` and ``keep`` (requests about to run) are not offloaded."""
        self._check_open()
        ran = _as_ids(ran, "after_step", "ran")
        self._check_batch(ran, "after_step")
        keep = _as_ids(keep, "after_step", "keep")
        _check_ids(keep, "after_step", "keep")
        self._stalls.after_step()
        for rid in ran:
            self.controller.touch(rid)
        running = frozenset(ran).union(keep)
        if running != self._running:  # the same frozenset lets the controller reuse a scan
            self._running = running
        return self.controller.evict_if_needed(self._running)

    def make_room(self, nbytes: int, keep: Collection[str] = ()) -> tuple[str, ...]:
        """Offload idle requests, in policy order, until ``nbytes`` of the device will be
        free once their copies land (a later step); the rids offloaded, none when the room
        is there already or nothing idle has bytes to give. For an ``allocate`` that
        answered False below ``high``, where ``after_step`` offloads nothing. Never
        offloads ``keep`` or what the last ``after_step`` was told ran or keeps. An
        ``nbytes`` above the device's capacity is a ValueError (nothing offloaded)."""
        self._check_open()
        keep = _as_ids(keep, "make_room", "keep")
        _check_ids(keep, "make_room", "keep")
        if not is_int(nbytes) or nbytes < 0:
            raise ValueError(f"TieredKV.make_room: nbytes must be an int >= 0, got {nbytes!r}")
        capacity = self.controller.device_capacity_bytes
        if nbytes > capacity:
            raise ValueError(f"TieredKV.make_room: nbytes {nbytes} is more than the device "
                             f"holds ({capacity} bytes); no offload can free it")
        return self.controller.make_room(nbytes, self._running.union(keep))

    def synchronize(self, timeout: float = 60.0) -> None:
        """Wait for every copy in flight (at most ``timeout`` seconds; then
        TimeoutError naming what is still moving) and apply them all. A
        ``timeout`` that is not a finite number >= 0 is a ValueError (nothing waited on)."""
        self._check_open()
        timeout = check_timeout("TieredKV.synchronize", timeout)
        self.controller.synchronize(timeout)

    def take_lost(self) -> list[tuple[str, str]]:
        """(rid, reason) of requests whose KV was lost since the last call."""
        self._check_open()
        return self.kv.take_lost()

    # -- reports and lifecycle ---------------------------------------------------

    def stats(self, part: str | None = None) -> dict[str, float]:
        """The cache's move counters (``kv.*``), the controller's
        (``controller.*``), and the bytes per tier; ``part="kv"`` or
        ``"controller"``: that part alone, its names without the prefix.

        After ``close`` the two parts stay readable (the final counters); the
        whole dict, which reads the tiers' live bytes, raises like every other call."""
        if part is not None and not isinstance(part, str):
            raise TypeError(f"TieredKV.stats: part must be a str or None, got {part!r}")
        if part is not None and part not in _STATS_PARTS:
            raise ValueError(f"TieredKV.stats: part must be one of {_STATS_PARTS} or None, "
                             f"got {part!r}")
        if part is None:
            self._check_open()
        kv_stats = getattr(self.kv, "stats", None)
        counters = kv_stats.as_dict() if kv_stats is not None else {}
        if part == "kv":
            return dict(counters)
        if part == "controller":
            return self.controller.stats()
        out: dict[str, float] = {f"kv.{k}": v for k, v in counters.items()}
        out.update({f"controller.{k}": v for k, v in self.controller.stats().items()})
        out["device_used_bytes"] = self.kv.device_used_bytes()
        out["host_used_bytes"] = self.kv.host_used_bytes()
        out["disk_used_bytes"] = self.kv.disk_used_bytes()
        out["requests"] = len(self.controller.requests())
        return out

    def check_integrity(self) -> None:
        """The cache's own check, the controller's (table, ledgers, queue), and
        that the two know the same requests; AssertionError names what is wrong."""
        self._check_open()
        self.kv.check_integrity()
        self.controller.check_integrity()
        in_cache, in_controller = set(self.kv.requests()), set(self.controller.requests())
        if in_cache != in_controller:
            raise AssertionError(
                "TieredKV: the cache and the controller know different requests: only in the "
                f"cache {sorted(in_cache - in_controller)[:5]}, only in the controller "
                f"{sorted(in_controller - in_cache)[:5]}"
            )

    def close(self) -> None:
        """Finish or abandon transfers and stop every thread (idempotent): a pressure
        source the front door built (from ``TieredKVConfig.pressure`` or a callable
        given to ``around``) is stopped (``stop()``, else ``close()``) before the cache
        closes; a source instance handed to ``around`` is the caller's and left running.
        A disk directory the cache created (see ``TieredKVConfig.disk``) is removed last."""
        if self._closed:
            return
        self._closed = True
        ref = getattr(self.kv, _DRIVER_ATTR, None)
        if isinstance(ref, weakref.ref) and ref() is self:
            try:
                setattr(self.kv, _DRIVER_ATTR, None)
            except (AttributeError, TypeError):
                pass
        try:
            if self._owns_pressure:  # first: a poller reads the cache until it stops
                _stop_source(self.pressure)
        finally:
            try:
                _close_cache(self.kv)
            finally:
                if self._created_disk is not None:
                    _remove_dir(self._created_disk)

    def __enter__(self) -> TieredKV:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TieredKV is closed")

    def _check_batch(self, batch: Sequence[str], what: str) -> None:
        _check_ids(batch, what, "request")
        knows = self.controller.knows
        unknown = [rid for rid in batch if not knows(rid)]
        if unknown:
            raise UnknownRequest(f"TieredKV.{what}: unknown request(s) {unknown[:5]}")


class _StallWatch:
    """Counts, per request, the steps in a row it was asked back in one state.

    A step is one ``poll``, or one ``prepare`` not right after a ``poll`` (a worker that
    calls both each step makes one step of them); a request not checked in a step starts
    again from zero, so only requests a worker keeps asking for can stall. ``limit``
    None: never reports."""

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._step = 0
        self._after_step: int | None = None  # the step of the last after_step
        self._polled = False  # a poll counted a step and nothing was checked since
        self._seen: dict[str, list[Any]] = {}  # rid -> [what, first step, last step, warned]

    def step(self, in_prepare: bool = False) -> None:
        """One poll; ``in_prepare``: prepare's own, which is the same step as a poll
        just before it."""
        if in_prepare and self._polled:
            self._polled = False
            return
        self._step += 1
        self._polled = not in_prepare

    def after_step(self) -> None:
        self._after_step = self._step

    @property
    def steps_since_after_step(self) -> int | None:
        return None if self._after_step is None else self._step - self._after_step

    def forget(self, rid: str) -> None:
        self._polled = False
        self._seen.pop(rid, None)

    def check(self, rid: str, what: object) -> int | None:
        """Note ``rid`` not ready as ``what``; the steps so far when it first reaches the
        limit (once), else None."""
        self._polled = False
        if self._limit is None:
            return None
        now = self._step
        entry = self._seen.get(rid)
        if entry is None or entry[0] != what or entry[2] < now - 1:
            self._seen[rid] = [what, now, now, False]
            return None
        entry[2] = now
        steps = now - entry[1] + 1
        if entry[3] or steps < self._limit:
            return None
        entry[3] = True
        return steps

    def stalled(self) -> dict[str, int]:
        now = self._step
        return {rid: e[2] - e[1] + 1 for rid, e in sorted(self._seen.items())
                if e[3] and e[2] >= now - 1}


def _as_ids(ids: object, what: str, name: str) -> list[str]:
    """``ids`` (a collection of request ids, not one str) as a list; TypeError naming
    ``name`` otherwise."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(
            f"TieredKV.{what}: {name} must be a collection of request ids, got {ids!r}")
    return list(ids)


def _check_ids(ids: Sequence[object], what: str, name: str) -> None:
    bad = [rid for rid in ids if not isinstance(rid, str) or not rid]
    if bad:
        must = "non-empty" if all(isinstance(rid, str) for rid in bad) else "str"
        raise BadRequestId(f"TieredKV.{what}: {name} ids must be {must}, got {bad[:5]!r}")


def _check_step(step: object, what: str) -> int:
    if not is_int(step) or step < 0:
        raise ValueError(f"TieredKV.{what}: step must be an int >= 0, got {step!r}")
    return step
