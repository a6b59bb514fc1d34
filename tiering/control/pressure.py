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

This is the public module. It holds the pool-based and composed sources and
``cache_pressure``; the contract (``pressure_source``), the CUDA sources
(``pressure_cuda``) and the poller (``pressure_poller``) live beside it and are
re-exported here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from tiering.control.pressure_cuda import NvmlPressure, TorchCudaPressure, cuda_index
from tiering.control.pressure_poller import PressurePoller, PressureReading
from tiering.control.pressure_source import (
    PressureSource,
    RetryPolicy,
    SourceHealth,
    _check_fraction,
    _used_fraction,
    logger,
)

__all__ = [
    "CompositePressure",
    "NvmlPressure",
    "PoolAdjustedPressure",
    "PoolPressure",
    "PressurePoller",
    "PressureReading",
    "PressureSource",
    "RetryPolicy",
    "ScriptedPressure",
    "SourceHealth",
    "TorchCudaPressure",
    "cache_pressure",
    "cuda_index",
    "logger",
]


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
        got = self.read_bytes()
        return 0.0 if got is None else got[0] / got[1]  # already clamped to [0, total]


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
