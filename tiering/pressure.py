"""Memory pressure: the fraction of device memory in use, from several sources.

Every source's ``read()`` returns a fraction in [0, 1]. A source that cannot
measure on this machine (no NVML library, no CUDA) says so once in the log,
reports ``available`` False and reads 0.0, so that it never wins in a
``CompositePressure``, which takes the worst of the available sources.

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
from types import ModuleType
from typing import Any, NamedTuple

logger = logging.getLogger("tiering.pressure")


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


class _OptionalSource(PressureSource):
    """A source that may find itself unable to measure; it then warns once and reads 0.0."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._usable = False
        self._warned = False

    @property
    def available(self) -> bool:
        return self._usable

    def read(self) -> float:
        got = self.read_bytes()
        return 0.0 if got is None else _used_fraction(got[0], got[1], self.name)

    def read_bytes(self) -> tuple[int, int] | None:
        """(used, total) bytes; None when unavailable."""
        raise NotImplementedError

    def _give_up(self, what: str, err: BaseException) -> None:
        self._usable = False
        if not self._warned:
            self._warned = True
            logger.warning(
                "pressure source %s is unavailable: %s failed (%s: %s); it will read 0.0",
                self.name,
                what,
                type(err).__name__,
                err,
            )


class NvmlPressure(_OptionalSource):
    """Whole-device memory use as NVML sees it (other processes included).

    ``nvml`` is a module with the ``pynvml`` API (nvidia-ml-py); by default
    ``pynvml`` is imported. NVML is initialised here and released by ``close``.
    Any failure (library missing, no such device, a read that errors) makes the
    source unavailable, with one warning.
    """

    def __init__(self, device_index: int = 0, nvml: ModuleType | Any | None = None) -> None:
        if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
            raise ValueError(f"NvmlPressure.device_index must be an int >= 0, got {device_index!r}")
        super().__init__(f"nvml:{device_index}")
        self.device_index = device_index
        self._nvml: Any = None
        self._handle: Any = None
        step = "import pynvml"
        try:
            module = nvml if nvml is not None else importlib.import_module("pynvml")
            step = "nvmlInit"
            module.nvmlInit()
            self._nvml = module
            step = f"nvmlDeviceGetHandleByIndex({device_index})"
            self._handle = module.nvmlDeviceGetHandleByIndex(device_index)
        except Exception as err:
            self._give_up(step, err)
            self._release()
            return
        self._usable = True

    def read_bytes(self) -> tuple[int, int] | None:
        """(used, total) bytes of the whole device; None when unavailable."""
        if not self._usable:
            return None
        try:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            used, total = int(info.used), int(info.total)
            _used_fraction(used, total, self.name)  # validates
            return used, total
        except Exception as err:
            self._give_up("nvmlDeviceGetMemoryInfo", err)
            self._release()
            return None

    def close(self) -> None:
        """Release NVML; the source is unavailable afterwards."""
        self._usable = False
        self._release()

    def _release(self) -> None:
        module, self._nvml, self._handle = self._nvml, None, None
        if module is not None:
            try:
                module.nvmlShutdown()
            except Exception as err:  # releasing must never raise
                logger.debug("nvmlShutdown failed: %s", err)


class TorchCudaPressure(_OptionalSource):
    """Device memory use from ``torch.cuda.mem_get_info``: ``1 - free / total``.

    ``device`` is anything ``mem_get_info`` accepts (None: the current device).
    ``torch_module`` replaces ``torch`` (for tests). Without CUDA the source is
    unavailable, with one warning; torch raises several exception types when
    CUDA is missing, so every exception counts as "unavailable".
    """

    def __init__(self, device: Any = None, torch_module: ModuleType | Any | None = None) -> None:
        super().__init__(f"torch-cuda:{'current' if device is None else device}")
        self.device = device
        self._torch: Any = None
        step = "import torch"
        try:
            torch = torch_module if torch_module is not None else importlib.import_module("torch")
            step = "torch.cuda.is_available"
            if not torch.cuda.is_available():
                raise RuntimeError("torch reports no CUDA device")
            self._torch = torch
            step = "torch.cuda.mem_get_info"
            self._measure()
        except Exception as err:
            self._give_up(step, err)
            self._torch = None
            return
        self._usable = True

    def _measure(self) -> float:
        free, total = self._torch.cuda.mem_get_info(self.device)
        return _used_fraction(int(total) - int(free), int(total), self.name)

    def read_bytes(self) -> tuple[int, int] | None:
        """(used, total) bytes of the device; None when unavailable."""
        if not self._usable:
            return None
        try:
            free, total = self._torch.cuda.mem_get_info(self.device)
            used = int(total) - int(free)
            _used_fraction(used, int(total), self.name)  # validates
            return used, int(total)
        except Exception as err:
            self._give_up("torch.cuda.mem_get_info", err)
            return None


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
        self._device = device
        self._pool = PoolPressure(kv)  # validates kv
        self._kv = kv
        self.name = f"pool-adjusted:{getattr(device, 'name', 'device')}"

    @property
    def available(self) -> bool:
        return bool(getattr(self._device, "available", True))

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
        return max((s.read() for s in self.sources if s.available), default=0.0)


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
