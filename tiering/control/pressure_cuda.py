"""Pressure read from a CUDA device: NVML's whole-device figure
(``NvmlPressure``) and ``torch.cuda.mem_get_info`` (``TorchCudaPressure``).

Both may be unable to measure (``_OptionalSource``): absent for good on a
machine without the library or CUDA, or in an outage retried with backoff.
``tiering.control.pressure`` is the public module; it re-exports these."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from tiering.control.pressure_source import (
    PressureSource,
    RetryPolicy,
    SourceHealth,
    _used_fraction,
    logger,
)


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
