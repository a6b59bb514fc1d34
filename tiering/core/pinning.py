"""The host tier's slab: page-aligned, pinned to exactly its size where CUDA is present.

torch's pinned caching allocator rounds a request up to a power of two, so a
48 GiB host tier would pin 64 GiB. Registering an ordinary page-aligned
allocation with ``cudaHostRegister`` pins just the bytes asked for. That call
can fail (locked-memory limits, an odd driver); a failed runtime call leaves a
pending CUDA error that a later, unrelated call would raise, so:

- through cupy's runtime (when cupy is installed) the failure is a named
  ``CUDARuntimeError`` and cupy clears the pending error;
- through torch's cudart binding the pending error is cleared here with
  ``cudaGetLastError``;

and either way the error is logged by name, and the slab falls back to
``pin_memory()`` (torch-rounded) or, failing that, stays unpinned. The result
says which (``PinMode``) so a GPU check can report it.

``PinnedSlab.release()`` unregisters; the owner calls it only after every copy
has finished and every worker thread has joined.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tiering.errors import PinError

log = logging.getLogger("tiering.core.pinning")

#: Alignment of the slab's first byte (a host page).
PAGE_ALIGN = 4096


class PinMode(enum.Enum):
    EXACT = "exact"  # cudaHostRegister of exactly the slab's bytes
    TORCH_ROUNDED = "torch-rounded"  # pin_memory(): torch's allocator, rounded up
    NOT_PINNED = "not-pinned"  # ordinary pageable memory (no CUDA, or pinning failed)


class PinOutcome(NamedTuple):
    """How the slab was pinned, and why not exactly when it was not."""

    mode: PinMode
    nbytes: int
    error: str | None = None


class HostRuntime(NamedTuple):
    """The three runtime calls pinning needs (injectable, so CPU tests can drive failures).

    ``register(ptr, nbytes)`` and ``unregister(ptr)`` raise ``PinError`` naming
    the CUDA error; ``name`` says which binding is in use.
    """

    name: str
    register: Callable[[int, int], None]
    unregister: Callable[[int], None]


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, align: int = PAGE_ALIGN) -> torch.Tensor:
    """An uninitialised CPU tensor whose first byte is ``align``-aligned."""
    if align < 1 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    elem = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * elem
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off : off + nbytes].view(dtype).view(shape)


def _torch_runtime() -> HostRuntime:
    cudart = torch.cuda.cudart()

    def clear_and_name(rc: Any) -> str:
        code = int(rc)
        last = getattr(cudart, "cudaGetLastError", None)
        if last is not None:
            last()  # clears the pending error so an unrelated call does not raise it
        else:  # older bindings: peek-and-clear through torch's own check
            try:
                torch.cuda.synchronize()
            except RuntimeError:
                pass
        name = getattr(rc, "name", None) or f"cudaError {code}"
        return f"{name} ({code})"

    def register(ptr: int, nbytes: int) -> None:
        rc = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(rc) != 0:
            raise PinError(f"cudaHostRegister: {clear_and_name(rc)}")

    def unregister(ptr: int) -> None:
        rc = cudart.cudaHostUnregister(ptr)
        if int(rc) != 0:
            raise PinError(f"cudaHostUnregister: {clear_and_name(rc)}")

    return HostRuntime("torch.cudart", register, unregister)


def _cupy_runtime() -> HostRuntime | None:
    try:
        from cupy.cuda import runtime  # type: ignore[import-not-found]
    except Exception:  # cupy absent or without a usable CUDA
        return None

    def register(ptr: int, nbytes: int) -> None:
        try:
            runtime.hostRegister(ptr, nbytes, 0)
        except runtime.CUDARuntimeError as exc:  # cupy has cleared the error
            raise PinError(f"cudaHostRegister: {exc}") from exc

    def unregister(ptr: int) -> None:
        try:
            runtime.hostUnregister(ptr)
        except runtime.CUDARuntimeError as exc:
            raise PinError(f"cudaHostUnregister: {exc}") from exc

    return HostRuntime("cupy", register, unregister)


def default_runtime() -> HostRuntime:
    """cupy's runtime when installed, else torch's cudart binding."""
    return _cupy_runtime() or _torch_runtime()


class PinnedSlab:
    """A host slab and how it is pinned. ``release()`` is idempotent."""

    def __init__(self, tensor: torch.Tensor, outcome: PinOutcome, runtime: HostRuntime | None):
        self.tensor = tensor
        self.outcome = outcome
        self._runtime = runtime if outcome.mode is PinMode.EXACT else None

    @property
    def registered(self) -> bool:
        return self._runtime is not None

    def release(self) -> None:
        """Unregister an exactly pinned slab (call after all copies and workers are done)."""
        rt, self._runtime = self._runtime, None
        if rt is None:
            return
        try:
            rt.unregister(self.tensor.data_ptr())
        except PinError as exc:
            log.error("host slab unregister failed: %s", exc)


def pin_host_slab(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    runtime: HostRuntime | None = None,
    pin_memory: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> PinnedSlab:
    """Allocate the host slab (page-aligned) and pin it as well as this machine allows.

    On a CPU ``device`` (and with no runtime injected) the slab is left
    unpinned. Registration happens with ``device`` current, so a cache on
    ``cuda:N`` registers under its own device.
    """
    t = aligned_empty(shape, dtype)
    nbytes = t.numel() * t.element_size()
    if device.type != "cuda" and runtime is None:
        return PinnedSlab(t, PinOutcome(PinMode.NOT_PINNED, nbytes), None)
    rt = runtime if runtime is not None else default_runtime()
    pin = pin_memory if pin_memory is not None else (lambda x: x.pin_memory())
    error = None
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                rt.register(t.data_ptr(), nbytes)
        else:
            rt.register(t.data_ptr(), nbytes)
        return PinnedSlab(t, PinOutcome(PinMode.EXACT, nbytes), rt)
    except PinError as exc:
        error = str(exc)
        log.warning("exact-size host pinning via %s failed: %s; using pin_memory()", rt.name, error)
    try:
        return PinnedSlab(pin(t), PinOutcome(PinMode.TORCH_ROUNDED, nbytes, error), None)
    except RuntimeError as exc:
        error = f"{error}; pin_memory: {exc}"
        log.warning("pin_memory() failed too (%s); the host tier is not pinned", exc)
    return PinnedSlab(t, PinOutcome(PinMode.NOT_PINNED, nbytes, error), None)
