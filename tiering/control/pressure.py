"""Memory pressure: the fraction of device memory in use, from several sources.

Every source's ``read()`` returns a fraction in [0, 1]. Every source that
reads a CUDA device takes the device it reads (an index, ``"cuda:N"`` or a
``torch.device``) and never follows the current device. A source that can
never measure on this machine (no NVML library, no CUDA) says so once in the
log, reports ``available`` False and reads 0.0, so that it never wins in a
``CompositePressure``, which takes the worst of the available sources. A read
that fails starts an outage: one warning, 0.0 readings, and a retry after a
backoff delay measured by the injected clock (``RetryPolicy``); one failed
read never disables a source for good.

``NvmlPressure`` finds its NVML device by the UUID of the CUDA device (NVML
indices ignore ``CUDA_VISIBLE_DEVICES``) and, under MIG, reads
``torch.cuda.mem_get_info`` instead. ``cache_pressure(kv)`` builds the
composite a controller should use for one cache.

``PressurePoller`` samples a source on a daemon thread, so that the step path
reads the latest figure without waiting for a driver call.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

logger = logging.getLogger("tiering.control.pressure")


def _check_fraction(value: object, what: str) -> float:
    """Return ``value`` as a float if it is a fraction in [0, 1]; ValueError naming it if not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}: pressure must be a number in [0, 1], got {value!r}")
    fraction = float(value)
    if not 0.0 <= fraction <= 1.0:  # also refuses NaN
        raise ValueError(f"{what}: pressure must be in [0, 1], got {value!r}")
    return fraction


def _used_fraction(used: int, total: int, what: str) -> float:
    if total <= 0:
        raise ValueError(f"{what}: total memory must be > 0, got {total}")
    if not 0 <= used <= total:
        raise ValueError(f"{what}: used memory {used} is outside [0, {total}]")
    return used / total


class PressureSource(ABC):
    """Something that reports the fraction of device memory in use."""

    #: A short label for logs and for ``CompositePressure.name``.
    name: str = "pressure"

    @property
    def available(self) -> bool:
        """False when this source cannot measure here; it then reads 0.0."""
        return True

    @abstractmethod
    def read(self) -> float:
        """The fraction of device memory in use now, in [0, 1]."""


@dataclass(frozen=True)
class RetryPolicy:
    """How a source that failed to read tries again: after ``first_s``, then
    each delay ``factor`` times the last, at most ``max_s``; timed by the
    source's injected clock (no thread, no sleep: the next ``read`` after the
    delay is the retry)."""

    first_s: float = 1.0
    max_s: float = 60.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        for name in ("first_s", "max_s", "factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"RetryPolicy.{name} must be a finite number, got {v!r}")
        if self.first_s <= 0:
            raise ValueError(f"RetryPolicy.first_s must be > 0, got {self.first_s!r}")
        if self.max_s < self.first_s:
            raise ValueError(
                f"RetryPolicy.max_s must be >= first_s ({self.first_s!r}), got {self.max_s!r}"
            )
        if self.factor < 1:
            raise ValueError(f"RetryPolicy.factor must be >= 1, got {self.factor!r}")


class SourceHealth(NamedTuple):
    """Where a device source stands: up or not, failed reads so far, outages so far,
    the clock time of the next retry (None while up or when it can never measure)."""

    up: bool
    failures: int
    outages: int
    next_retry_at: float | None
    absent_reason: str | None


class _Absent(Exception):
    """This machine can never measure with this source (no library, no CUDA)."""


def cuda_index(device: Any, torch_module: Any | None, what: str) -> int:
    """The CUDA ordinal ``device`` names: an int, ``"cuda:N"``, ``"cuda"`` or a
    ``torch.device``. A device without an index is the current CUDA device, asked
    of ``torch_module`` once, here, so later reads never follow the current device."""
    if isinstance(device, bool):
        raise ValueError(f"{what}: device must be a CUDA device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{what}: CUDA device index must be >= 0, got {device!r}")
        return device
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        index: int | None
        if kind != "cuda" or (idx and not idx.isdigit()):
            raise ValueError(f"{what}: device must be 'cuda' or 'cuda:N', got {device!r}")
        index = int(idx) if idx else None
    elif hasattr(device, "type") and hasattr(device, "index"):
        if device.type != "cuda":
            raise ValueError(f"{what}: device must be a CUDA device, got {device!r}")
        index = device.index
    else:
        raise ValueError(f"{what}: device must be an int, 'cuda[:N]' or a torch.device, got {device!r}")
    if index is not None:
        return int(index)
    if torch_module is None:
        raise _Absent("no torch to resolve the current CUDA device")
    return int(torch_module.cuda.current_device())


class _OptionalSource(PressureSource):
    """A device source that may be unable to measure.

    Absent (no library, no CUDA): one warning, reads 0.0 for good. A failed
    read or connection is an outage: one warning when it starts, reads 0.0,
    and the next read after the retry delay (``RetryPolicy``, by the injected
    clock) tries again; success ends the outage (logged at INFO) and resets the
    delay. Subclasses implement ``_connect()`` (raise on failure, ``_Absent`` if
    it can never work) and ``_measure() -> (used, total)``.
    """

    def __init__(
        self, name: str, clock: Callable[[], float], retry: RetryPolicy | None
    ) -> None:
        if not callable(clock):
            raise TypeError(f"{name}: clock must be callable, got {clock!r}")
        if retry is None:
            retry = RetryPolicy()
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"{name}: retry must be a RetryPolicy, got {retry!r}")
        self.name = name
        self._clock = clock
        self._retry = retry
        self._up = False
        self._absent: str | None = None
        self._failures = 0
        self._outages = 0
        self._delay = retry.first_s
        self._next_try: float | None = None

    @property
    def available(self) -> bool:
        return self._up

    def health(self) -> SourceHealth:
        return SourceHealth(
            self._up, self._failures, self._outages,
            None if self._up or self._absent else self._next_try, self._absent,
        )

    def read(self) -> float:
        got = self.read_bytes()
        return 0.0 if got is None else got[0] / got[1]

    def _start(self, absent: str | None = None) -> None:
        """Connect now (from the subclass's constructor), unless ``absent`` says why
        this source can never work here."""
        if absent is not None:
            self._go_absent(absent)
            return
        self._attempt(connect=True)

    def _go_absent(self, why: str) -> None:
        self._absent = why
        self._up = False
        logger.warning(
            "pressure source %s is unavailable on this machine: %s; it will read 0.0",
            self.name, why,
        )

    def read_bytes(self) -> tuple[int, int] | None:
        """(used, total) bytes; None while absent or in an outage (never raises)."""
        if self._absent is not None:
            return None
        if not self._up:
            if self._next_try is not None and self._clock() < self._next_try:
                return None
            return self._attempt(connect=True)
        return self._attempt(connect=False)

    def _attempt(self, connect: bool) -> tuple[int, int] | None:
        step = "connect"
        try:
            if connect:
                self._connect()
            step = "read"
            used, total = self._measure()
            used, total = int(used), int(total)
            _used_fraction(used, total, self.name)  # validates
        except _Absent as why:
            self._disconnect()
            self._go_absent(str(why))
            return None
        except Exception as err:
            self._failed(step, err)
            return None
        if not self._up and self._outages:
            logger.info(
                "pressure source %s recovered after %d failed reads", self.name, self._failures
            )
        self._up = True
        self._delay = self._retry.first_s
        self._next_try = None
        return used, total

    def _failed(self, step: str, err: BaseException) -> None:
        self._failures += 1
        starting = self._up or self._next_try is None  # a new outage, not a failed retry
        if starting:
            self._outages += 1
            self._delay = self._retry.first_s
        else:
            self._delay = min(self._retry.max_s, self._delay * self._retry.factor)
        self._up = False
        self._next_try = self._clock() + self._delay
        self._disconnect()
        if starting:
            logger.warning(
                "pressure source %s: %s failed (%s: %s); reading 0.0, retrying in %.3g s",
                self.name, step, type(err).__name__, err, self._delay,
            )
        else:
            logger.debug("pressure source %s: retry failed (%s)", self.name, err)

    def _connect(self) -> None:
        raise NotImplementedError

    def _measure(self) -> tuple[int, int]:
        raise NotImplementedError

    def _disconnect(self) -> None:
        """Drop whatever ``_connect`` acquired (never raises)."""


def _import(module: Any | None, name: str) -> Any:
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    except Exception as err:
        raise _Absent(f"import {name} failed ({type(err).__name__}: {err})") from err


def _torch_cuda(torch_module: Any | None) -> Any:
    """``torch`` with CUDA, or ``_Absent``; torch raises mixed types without a driver."""
    torch = _import(torch_module, "torch")
    try:
        ok = bool(torch.cuda.is_available())
    except Exception as err:
        raise _Absent(f"torch.cuda.is_available failed ({type(err).__name__}: {err})") from err
    if not ok:
        raise _Absent("torch reports no CUDA device")
    return torch


_NVML_NOT_FOUND = 6  # NVML_ERROR_NOT_FOUND
_NVML_MIG_ENABLE = 1  # NVML_DEVICE_MIG_ENABLE


def _cuda_target(device: Any, torch_module: Any, who: str) -> tuple[Any, int | None, str | None]:
    """(torch, CUDA index, why absent or None) for a CUDA-backed source; bad input
    (a device that cannot name a CUDA device) raises even without CUDA."""
    torch = None
    absent: str | None = None
    try:
        torch = _torch_cuda(torch_module)
    except _Absent as why:
        absent = str(why)
    try:
        return torch, cuda_index(device, torch, who), absent
    except _Absent as why:
        return torch, None, str(why)


class NvmlPressure(_OptionalSource):
    """Whole-device memory use as NVML sees it (other processes included), for
    the CUDA device ``device`` of this process.

    NVML numbers devices its own way and ignores ``CUDA_VISIBLE_DEVICES``, so
    the device is found by the UUID that CUDA (through torch) reports for
    ``device``, never by index. Under MIG, NVML's figures are the whole GPU's,
    not the instance's, so the source reads ``torch.cuda.mem_get_info(device)``
    instead (``mode == "mig-torch"``). ``nvml`` replaces the ``pynvml`` module
    (nvidia-ml-py) and ``torch_module`` replaces ``torch``: the test seams.
    A failed read is an outage retried with backoff (``RetryPolicy``).
    """

    def __init__(
        self,
        device: Any,
        *,
        nvml: ModuleType | Any | None = None,
        torch_module: ModuleType | Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry: RetryPolicy | None = None,
    ) -> None:
        torch, index, absent = _cuda_target(device, torch_module, "NvmlPressure")
        super().__init__(f"nvml:cuda:{'?' if index is None else index}", clock, retry)
        self.cuda_index: int | None = index
        self.uuid: str | None = None
        self.nvml_index: int | None = None
        self.mode: str | None = None  # "nvml" or "mig-torch" once connected
        self._torch = torch
        self._nvml_module = nvml
        self._nvml: Any = None
        self._handle: Any = None
        self._start(absent)

    def _connect(self) -> None:
        module = _import(self._nvml_module, "pynvml")
        module.nvmlInit()
        self._nvml = module
        uuid = str(self._torch.cuda.get_device_properties(self.cuda_index).uuid)
        if uuid.startswith(("GPU-", "MIG-")):
            candidates = [uuid]
        else:
            candidates = ["GPU-" + uuid, "MIG-" + uuid]
        for candidate in candidates:
            try:
                handle = module.nvmlDeviceGetHandleByUUID(candidate)
            except Exception as err:
                if getattr(err, "value", None) == _NVML_NOT_FOUND:
                    continue
                raise
            self.uuid, self._handle = candidate, handle
            break
        else:
            raise LookupError(f"NVML has no device with UUID {uuid} (cuda:{self.cuda_index})")
        mig = self.uuid.startswith("MIG-")
        if not mig and hasattr(module, "nvmlDeviceGetMigMode"):
            try:
                current = module.nvmlDeviceGetMigMode(self._handle)[0]
                mig = int(current) == _NVML_MIG_ENABLE
            except Exception as err:  # NOT_SUPPORTED on GPUs without MIG
                logger.debug("nvmlDeviceGetMigMode: %s", err)
        self.mode = "mig-torch" if mig else "nvml"
        if not mig and hasattr(module, "nvmlDeviceGetIndex"):
            try:
                self.nvml_index = int(module.nvmlDeviceGetIndex(self._handle))
            except Exception as err:
                logger.debug("nvmlDeviceGetIndex: %s", err)

    def _measure(self) -> tuple[int, int]:
        if self.mode == "mig-torch":
            free, total = self._torch.cuda.mem_get_info(self.cuda_index)
            return int(total) - int(free), int(total)
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return int(info.used), int(info.total)

    def _disconnect(self) -> None:
        module, self._nvml, self._handle = self._nvml, None, None
        if module is not None:
            try:
                module.nvmlShutdown()
            except Exception as err:  # releasing must never raise
                logger.debug("nvmlShutdown failed: %s", err)

    def close(self) -> None:
        """Release NVML; the source reads 0.0 for good afterwards."""
        self._up = False
        self._absent = "closed"
        self._disconnect()


class TorchCudaPressure(_OptionalSource):
    """Memory use of CUDA device ``device`` from ``torch.cuda.mem_get_info``:
    ``1 - free / total``.

    ``device`` is an int, ``"cuda:N"`` or a ``torch.device`` (one without an
    index is the current device at construction, fixed from then on: the
    reading never follows a later change of the current device).
    ``torch_module`` replaces ``torch`` (the test seam). Without CUDA the
    source is absent; a failed read is an outage retried with backoff.
    """

    def __init__(
        self,
        device: Any,
        torch_module: ModuleType | Any | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        retry: RetryPolicy | None = None,
    ) -> None:
        torch, index, absent = _cuda_target(device, torch_module, "TorchCudaPressure")
        super().__init__(f"torch-cuda:{'?' if index is None else index}", clock, retry)
        self.cuda_index: int | None = index
        self._torch = torch
        self._start(absent)

    def _connect(self) -> None:
        pass

    def _measure(self) -> tuple[int, int]:
        free, total = self._torch.cuda.mem_get_info(self.cuda_index)
        return int(total) - int(free), int(total)


class PoolPressure(PressureSource):
    """Exact occupancy of our own device pool: ``device_used_bytes() / device_capacity_bytes``.

    ``kv`` is any object with a ``device_used_bytes()`` method (bytes held or
    reserved) and a ``device_capacity_bytes`` attribute. A figure outside
    [0, capacity] is a ledger bug and raises ValueError.
    """

    name = "pool"

    def __init__(self, kv: Any) -> None:
        if not callable(getattr(kv, "device_used_bytes", None)):
            raise TypeError(
                f"PoolPressure needs an object with a device_used_bytes() method, got {kv!r}"
            )
        if not hasattr(kv, "device_capacity_bytes"):
            raise TypeError(
                f"PoolPressure needs an object with a device_capacity_bytes attribute, got {kv!r}"
            )
        self._kv = kv

    def read(self) -> float:
        return _used_fraction(
            int(self._kv.device_used_bytes()), int(self._kv.device_capacity_bytes), self.name
        )


class PoolAdjustedPressure(PressureSource):
    """A whole-device reading with the pool's free pages counted as free.

    The KV pool is allocated once at start-up, so NVML and ``mem_get_info`` see
    all of it as used whether its pages hold KV or not; used alone they would
    read near-full forever. This source takes ``(used, total)`` bytes from
    ``device`` (an ``NvmlPressure`` or ``TorchCudaPressure``) and returns
    ``(used - pool_free) / total``: it rises with the pool's own occupancy and
    with everything else on the device (activations, the caching allocator,
    other processes). Combine it with ``PoolPressure`` in a
    ``CompositePressure`` to act on the worse of the two. Unavailable (and
    0.0) when ``device`` is.
    """

    def __init__(self, device: Any, kv: Any) -> None:
        if not callable(getattr(device, "read_bytes", None)):
            raise TypeError(f"PoolAdjustedPressure needs a source with read_bytes(), got {device!r}")
        self._pool = PoolPressure(kv)  # validates kv
        source_index = getattr(device, "cuda_index", None)
        kv_device = getattr(kv, "device", None)
        kv_index = getattr(kv_device, "index", None) if getattr(kv_device, "type", None) == "cuda" else None
        if source_index is not None and kv_index is not None and int(kv_index) != source_index:
            raise ValueError(
                f"PoolAdjustedPressure: the device source reads cuda:{source_index} but the "
                f"cache lives on {kv_device}; build the source for the cache's device"
            )
        self._device = device
        self._kv = kv
        self.name = f"pool-adjusted:{getattr(device, 'name', 'device')}"

    @property
    def available(self) -> bool:
        return bool(getattr(self._device, "available", True))

    def read_bytes(self) -> tuple[int, int] | None:
        """(used - pool free, total) bytes; None when the device source has no reading."""
        got = self._device.read_bytes()
        if got is None:
            return None
        used, total = got
        pool_free = int(self._kv.device_capacity_bytes) - int(self._kv.device_used_bytes())
        return min(total, max(0, used - pool_free)), total

    def read(self) -> float:
        got = self._device.read_bytes()
        if got is None:
            return 0.0
        used, total = got
        pool_free = int(self._kv.device_capacity_bytes) - int(self._kv.device_used_bytes())
        return min(1.0, max(0.0, (used - pool_free) / total))


class ScriptedPressure(PressureSource):
    """Returns the given fractions in order, then keeps returning the last one.

    ``set(value)`` replaces the script with that single value. Every value must
    lie in [0, 1]. Safe to drive from one thread while another reads.
    """

    name = "scripted"

    def __init__(self, values: Iterable[float]) -> None:
        script = [_check_fraction(v, "ScriptedPressure value") for v in values]
        if not script:
            raise ValueError("ScriptedPressure needs at least one value")
        self._lock = threading.Lock()
        self._script = script
        self._next = 0

    def read(self) -> float:
        with self._lock:
            value = self._script[self._next]
            if self._next < len(self._script) - 1:
                self._next += 1
            return value

    def set(self, value: float) -> None:
        """From now on, read ``value``."""
        fraction = _check_fraction(value, "ScriptedPressure.set")
        with self._lock:
            self._script = [fraction]
            self._next = 0


class CompositePressure(PressureSource):
    """The worst (largest) reading of the sources that are available.

    Reads 0.0 and reports unavailable when none is. An exception from a source's
    ``read`` propagates to the caller (a poller logs it and keeps its last
    reading).
    """

    def __init__(self, *sources: PressureSource) -> None:
        if not sources:
            raise ValueError("CompositePressure needs at least one source")
        for source in sources:
            if not isinstance(source, PressureSource):
                raise TypeError(f"CompositePressure: {source!r} is not a PressureSource")
        self.sources: tuple[PressureSource, ...] = sources
        self.name = "max(" + ",".join(s.name for s in sources) + ")"

    @property
    def available(self) -> bool:
        return any(s.available for s in self.sources)

    def read(self) -> float:
        # Every source is read, available or not: a device source in an outage
        # retries inside its read (when its backoff delay has passed), so
        # skipping unavailable sources would disable them for good. A source
        # still unavailable after its read is left out of the maximum.
        readings = [(s.read(), s) for s in self.sources]
        return max((value for value, s in readings if s.available), default=0.0)


def cache_pressure(
    kv: Any,
    *,
    nvml: ModuleType | Any | None = None,
    torch_module: ModuleType | Any | None = None,
    clock: Callable[[], float] = time.monotonic,
    retry: RetryPolicy | None = None,
) -> CompositePressure:
    """The pressure a controller should act on for cache ``kv``, read for the
    cache's own device (never the current one): the worse of the pool's exact
    occupancy and, on a CUDA device, NVML's whole-device figure with the
    pool's free pages counted as free (``PoolAdjustedPressure``)."""
    pool = PoolPressure(kv)
    device = getattr(kv, "device", None)
    if getattr(device, "type", None) != "cuda":
        return CompositePressure(pool)
    nv = NvmlPressure(device, nvml=nvml, torch_module=torch_module, clock=clock, retry=retry)
    return CompositePressure(pool, PoolAdjustedPressure(nv, kv))


class PressureReading(NamedTuple):
    """One sample: the fraction in use, its sequence number (0: none yet) and clock time."""

    fraction: float
    seq: int
    at: float


class PressurePoller:
    """Samples a source every ``interval_s`` on a daemon thread; ``latest()`` never blocks.

    ``start()`` takes one sample at once, then starts the thread; ``stop()``
    wakes it and joins it with a timeout. A failing ``read`` (an exception or a
    value outside [0, 1]) is logged once, counted in ``failures``, and the
    previous reading is kept. Before the first sample ``latest()`` is
    ``PressureReading(0.0, 0, <clock at construction>)``. Also a context
    manager (start on enter, stop on exit).
    """

    def __init__(
        self,
        source: PressureSource,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not callable(getattr(source, "read", None)):
            raise TypeError(f"PressurePoller needs a source with read(), got {source!r}")
        if (
            isinstance(interval_s, bool)
            or not isinstance(interval_s, (int, float))
            or not math.isfinite(interval_s)
            or interval_s <= 0
        ):
            raise ValueError(f"PressurePoller.interval_s must be a number > 0, got {interval_s!r}")
        if not callable(clock):
            raise TypeError(f"PressurePoller.clock must be callable, got {clock!r}")
        self.source = source
        self.interval_s = float(interval_s)
        self._clock = clock
        self._latest = PressureReading(0.0, 0, clock())
        self._sample_lock = threading.Lock()
        self._failures = 0
        self._warned = False
        self._stop_event: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def latest(self) -> PressureReading:
        """The most recent good sample (a plain attribute read: never blocks)."""
        return self._latest

    @property
    def failures(self) -> int:
        """How many samples failed and were skipped."""
        return self._failures

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def sample_now(self) -> PressureReading:
        """Take one sample synchronously and return the (possibly unchanged) latest reading."""
        with self._sample_lock:
            try:
                fraction = _check_fraction(self.source.read(), f"source {self._source_name()}")
                reading = PressureReading(fraction, self._latest.seq + 1, self._clock())
            except Exception as err:
                self._failures += 1
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "pressure poller: reading %s failed (%s: %s); keeping the last reading",
                        self._source_name(),
                        type(err).__name__,
                        err,
                    )
                return self._latest
            self._latest = reading
            return reading

    def start(self) -> None:
        """Sample once now, then every ``interval_s`` on a daemon thread."""
        if self.running:
            raise RuntimeError("PressurePoller is already running")
        self.sample_now()
        stop_event = threading.Event()
        thread = threading.Thread(
            target=self._run, args=(stop_event,), name="tiering-pressure-poller", daemon=True
        )
        self._stop_event, self._thread = stop_event, thread
        thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread and wait up to ``timeout`` s; True when it has ended."""
        if self._stop_event is not None:
            self._stop_event.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._thread = self._stop_event = None
        return True

    def _run(self, stop_event: threading.Event) -> None:
        while not stop_event.wait(self.interval_s):
            self.sample_now()

    def _source_name(self) -> str:
        return str(getattr(self.source, "name", type(self.source).__name__))

    def __enter__(self) -> PressurePoller:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
