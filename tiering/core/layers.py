"""Per-layer readiness of one reload: which layers are on the device.

A reload copies a request's pages layer by layer (``LayerProgress`` with
``layerwise=True``) or all at once. The copy thread says when each layer has
landed (on a CPU: copied; on a GPU: its copy queued, with the CUDA event that
completes it); the step thread asks whether a layer may be read, and on a CPU
waits for it. A copy that fails on layer L marks every layer from L on as
failed: they are never reported readable.

The object is the one thing both threads touch; a condition variable guards
it. Times are wall-clock measurements (``time.perf_counter``) kept for the
cache's counters, never used for a decision.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple


class LayerWait(NamedTuple):
    """What waiting for one layer found: ``ok`` (readable now; on a GPU after the
    compute stream waits on ``event``), or why not (``reason``)."""

    ok: bool
    event: Any = None
    reason: str | None = None


class LayerProgress:
    """How far one reload of ``num_layers`` layers has come (see the module doc).

    ``base_tokens`` / ``base_pages``: the request's token and device page counts when
    the reload started (what a failed reload goes back to)."""

    __slots__ = ("num_layers", "layerwise", "base_tokens", "base_pages", "started",
                 "_cond", "_landed", "_events", "_failed_at", "_reason", "_times", "waited_s")

    def __init__(self, num_layers: int, *, layerwise: bool, base_tokens: int = 0,
                 base_pages: int = 0) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"LayerProgress: num_layers must be an int >= 1, got {num_layers!r}")
        self.num_layers = num_layers
        self.layerwise = bool(layerwise)
        self.base_tokens = base_tokens
        self.base_pages = base_pages
        self.started = time.perf_counter()
        self._cond = threading.Condition()
        self._landed = 0
        self._events: list[Any] = [None] * num_layers
        self._failed_at: int | None = None
        self._reason: str | None = None
        self._times: list[float] = []
        self.waited_s = 0.0  # time the step thread spent blocked in ``wait``

    # -- the copy thread -------------------------------------------------------------

    def landed(self, layer: int, event: Any = None) -> None:
        """Layer ``layer`` (the next in order) is on the device, or its copy is queued
        behind ``event``. Ignored once the reload has failed."""
        with self._cond:
            if self._failed_at is not None:
                return
            if layer != self._landed:
                raise ValueError(f"LayerProgress: layer {layer} landed, expected {self._landed}")
            self._events[layer] = event
            self._landed += 1
            self._times.append(time.perf_counter())
            self._cond.notify_all()

    def landed_all(self, event: Any = None) -> None:
        """Every layer still to come landed at once (a whole-request copy)."""
        with self._cond:
            if self._failed_at is not None:
                return
            now = time.perf_counter()
            for layer in range(self._landed, self.num_layers):
                self._events[layer] = event
                self._times.append(now)
            self._landed = self.num_layers
            self._cond.notify_all()

    def fail(self, layer: int, reason: str) -> None:
        """The copy of ``layer`` failed: it and every later layer never land."""
        with self._cond:
            if self._failed_at is None:
                self._failed_at = min(layer, self._landed)
                self._reason = reason
            self._cond.notify_all()

    # -- the step thread -------------------------------------------------------------

    @property
    def ready(self) -> int:
        """Layers 0..ready-1 are readable (landed and not failed)."""
        return self._landed

    @property
    def failed_at(self) -> int | None:
        return self._failed_at

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def complete(self) -> bool:
        return self._landed == self.num_layers

    def first_layer_s(self) -> float | None:
        """Seconds from the start of the reload until layer 0 landed (None: not yet)."""
        return self._times[0] - self.started if self._times else None

    def wait(self, layer: int, timeout: float | None) -> LayerWait:
        """Wait until ``layer`` has landed (at most ``timeout`` seconds; None: forever);
        not ok when its copy failed or the time ran out."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"LayerProgress.wait: layer {layer} out of range "
                             f"[0, {self.num_layers})")
        with self._cond:
            if layer >= self._landed and self._failed_at is None:
                t0 = time.perf_counter()
                self._cond.wait_for(
                    lambda: layer < self._landed or self._failed_at is not None, timeout)
                self.waited_s += time.perf_counter() - t0
            if layer < self._landed:
                return LayerWait(True, self._events[layer])
            if self._failed_at is not None:
                return LayerWait(False, None, f"layer {layer} will not land: the reload failed"
                                               f" at layer {self._failed_at}: {self._reason}")
            return LayerWait(False, None, f"layer {layer} did not land within {timeout}s")

    def check(self) -> list[str]:
        """What is inconsistent (empty: nothing)."""
        problems = []
        if not 0 <= self._landed <= self.num_layers:
            problems.append(f"{self._landed} layers landed of {self.num_layers}")
        if self._failed_at is not None and self._failed_at > self._landed:
            problems.append(f"failed at layer {self._failed_at} past the {self._landed} landed")
        if len(self._times) != self._landed:
            problems.append(f"{len(self._times)} landing times for {self._landed} layers")
        return problems
