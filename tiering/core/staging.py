"""A small ring of staging buffers between the device and the disk tier.

Disk jobs that cannot move bytes straight between a tier and the disk (a GPU
device: the disk store reads and writes host memory) stage them through one of
a few host buffers allocated once (pinned when CUDA is present), a piece of a
request at a time, so a large request needs no request-sized allocation and
the copy of one piece overlaps the I/O of the next.

Buffers are handed out by a blocking queue: ``acquire(timeout)`` waits at most
``timeout`` seconds (no polling) and returns None when none came free.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiering.core.validate import check_fields, check_timeout, check_waitable
from tiering.errors import StagingTimeout  # noqa: F401 (re-exported from its old home)


@dataclass(frozen=True)
class StagingConfig:
    """``buffers`` buffers of ``pages`` pages each; ``timeout_s`` bounds one acquire."""

    buffers: int = 4
    pages: int = 16
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check_fields(self, ints={"buffers": 1, "pages": 1}, numbers=("timeout_s",))
        if not math.isfinite(self.timeout_s):  # every wait is bounded
            raise ValueError(f"StagingConfig.timeout_s must be finite, got {self.timeout_s!r}")
        check_waitable("StagingConfig.timeout_s", self.timeout_s)


class StagingRing:
    """``config.buffers`` page buffers of ``config.pages`` pages, allocated once."""

    def __init__(
        self,
        config: StagingConfig,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        pin: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(config, StagingConfig):
            raise ValueError(f"config must be a StagingConfig, got {type(config).__name__}")
        self.config = config
        self.pages = config.pages
        self._all: list[torch.Tensor] = []
        self._free: queue.Queue[int] = queue.Queue()  # indexes into _all of the free buffers
        self._held: set[int] = set()  # indexes into _all of the buffers handed out
        self._lock = threading.Lock()
        for _ in range(config.buffers):
            t = torch.empty((config.pages, *page_shape), dtype=dtype)
            if pin is not None:
                t = pin(t)
            self._free.put(len(self._all))
            self._all.append(t)
        self.allocations = len(self._all)  # never grows: proves the ring is reused

    def acquire(self, timeout: float | None = None) -> torch.Tensor | None:
        """A free buffer, or None after ``timeout`` (default: the config's) seconds;
        a ``timeout`` that is not a finite number >= 0 is a ValueError."""
        wait = self.config.timeout_s if timeout is None else check_timeout(
            "StagingRing.acquire", timeout)
        try:
            i = self._free.get(timeout=wait)
        except queue.Empty:
            return None
        with self._lock:
            self._held.add(i)
        return self._all[i]

    def _index(self, buf: torch.Tensor) -> int:
        for i, b in enumerate(self._all):
            if buf is b:
                return i
        raise ValueError("release: not a buffer of this ring")

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer ``acquire`` handed out. A foreign buffer, or one released
        twice (two jobs would then share it), is a ValueError and changes nothing."""
        i = self._index(buf)
        with self._lock:
            if i not in self._held:
                raise ValueError(f"release: buffer {i} of this ring is not held (released twice)")
            self._held.remove(i)
        self._free.put(i)

    def free_count(self) -> int:
        return self._free.qsize()

    def check_integrity(self) -> None:
        """Every buffer is free (call when no job runs)."""
        with self._lock:
            held = len(self._held)
        if self._free.qsize() != len(self._all) or held:
            raise AssertionError(
                f"staging ring: {len(self._all) - self._free.qsize()} of {len(self._all)} buffers"
                " still held with no job running"
            )
