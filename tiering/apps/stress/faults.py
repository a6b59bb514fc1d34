"""The faults a stress run injects, and the counters that say how many struck.

Kinds (``FAULT_KINDS``):

- ``enospc_write``, ``eio_write``: a disk chunk write fails (ENOSPC / EIO);
- ``eio_read``: a disk chunk read fails (EIO);
- ``corrupt``: a disk chunk read returns the stored bytes with one byte flipped;
- ``slow``: a disk chunk operation first waits (a real sleep in the CLI, an
  injected recorder in tests), then proceeds;
- ``copy``: a page copy between device and host (either direction) fails with
  ``CopyFault``.

The disk kinds go through the disk tier's store seam (``FaultyStore`` around
the zarr store, driven by a seeded ``FaultPlan``); ``copy`` through the
transfer layer's fault hook, driven by ``CopyFaultPlan``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from tiering.core.transfer import CopyFault, no_fault
from tiering.disk.faults import FAULT_KINDS as DISK_KINDS
from tiering.disk.faults import FaultPlan, FaultyStore

COPY = "copy"
FAULT_KINDS: tuple[str, ...] = (*DISK_KINDS, COPY)
#: Kinds that make an operation fail; ``slow`` only delays it.
FAILING_KINDS: tuple[str, ...] = tuple(k for k in FAULT_KINDS if k != "slow")
COPY_DIRECTIONS = ("d2h", "h2d")


def parse_choices(text: str, choices: tuple[str, ...], what: str, noun: str) -> tuple[str, ...]:
    """``all``, ``none`` or a comma-separated list of ``choices`` -> those chosen, in the
    order of ``choices``; ValueError naming ``what`` and the unknown words otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string, got {text!r}")
    words = [w.strip() for w in text.split(",") if w.strip()]
    if words == ["all"]:
        return choices
    if words == ["none"]:
        return ()
    if not words:
        raise ValueError(f"{what}: empty; give all, none or a comma-separated list of {noun}s")
    unknown = [w for w in words if w not in choices]
    if unknown:
        raise ValueError(
            f"{what}: unknown {noun}(s) {', '.join(unknown)}; expected all, none or some of "
            f"{', '.join(choices)}"
        )
    return tuple(k for k in choices if k in words)


def parse_faults(text: str) -> tuple[str, ...]:
    """``all``, ``none`` or a comma-separated list of kinds -> the kinds, in canonical order."""
    return parse_choices(text, FAULT_KINDS, "faults", "kind")


class CopyFaultPlan:
    """A copy fault hook: each copy fails with probability ``probability`` (seeded).

    Thread-safe; ``injected`` counts the faults raised, per direction.
    """

    def __init__(self, seed: int, probability: float) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"CopyFaultPlan.probability must be in [0, 1], got {probability}")
        self._rng = random.Random(seed)
        self._probability = probability
        self._lock = threading.Lock()
        self._injected = dict.fromkeys(COPY_DIRECTIONS, 0)

    def __call__(self, direction: str) -> None:
        if direction not in self._injected:
            raise ValueError(f"copy direction must be one of {COPY_DIRECTIONS}, got {direction!r}")
        with self._lock:
            fires = self._rng.random() < self._probability
            if fires:
                self._injected[direction] += 1
        if fires:
            raise CopyFault(f"injected copy fault ({direction})")

    @property
    def injected(self) -> dict[str, int]:
        with self._lock:
            return dict(self._injected)


class CountingSleep:
    """Wraps a sleep function and counts the calls (each is one slow disk operation)."""

    def __init__(self, sleep: Callable[[float], None]) -> None:
        self._sleep = sleep
        self._lock = threading.Lock()
        self._calls = 0

    def __call__(self, seconds: float) -> None:
        with self._lock:
            self._calls += 1
        self._sleep(seconds)

    @property
    def calls(self) -> int:
        with self._lock:
            return self._calls


class FaultInjector:
    """The faults of one run: a disk ``FaultPlan`` and a ``CopyFaultPlan``, both seeded.

    ``wrap_store`` is what the cache's ``disk_wrap_store`` gets (None when no
    disk kind is armed); ``copy_hook`` its ``copy_fault_hook``. ``sleep`` is
    what a slow fault waits with.
    """

    def __init__(
        self,
        kinds: tuple[str, ...],
        *,
        seed: int,
        rate: float,
        slow_seconds: float,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        unknown = [k for k in kinds if k not in FAULT_KINDS]
        if unknown:
            raise ValueError(f"unknown fault kind(s) {unknown}; known: {FAULT_KINDS}")
        rng = random.Random(seed)
        self.kinds = tuple(kinds)
        self.sleeps = CountingSleep(sleep)
        self.disk_plan = FaultPlan(
            rng=random.Random(rng.getrandbits(64)), sleep=self.sleeps, slow_seconds=slow_seconds
        )
        for kind in self.kinds:
            if kind in DISK_KINDS:
                self.disk_plan.arm(kind, probability=rate)
        self.copy_plan = CopyFaultPlan(rng.getrandbits(64), rate if COPY in self.kinds else 0.0)
        self._disk_armed = any(k in DISK_KINDS for k in self.kinds)

    @property
    def wrap_store(self) -> Callable[[Any], Any] | None:
        if not self._disk_armed:
            return None
        plan = self.disk_plan
        return lambda store: FaultyStore(store, plan)

    @property
    def copy_hook(self) -> Callable[[str], None]:
        return self.copy_plan if COPY in self.kinds else no_fault

    @property
    def any_failing(self) -> bool:
        """Whether some armed kind makes operations fail (not just slow)."""
        return any(k in FAILING_KINDS for k in self.kinds)

    def injected(self) -> dict[str, int]:
        """Faults that struck so far, per kind (``copy``: both directions together)."""
        out = {k: v for k, v in self.disk_plan.injected.items() if k in DISK_KINDS}
        out[COPY] = sum(self.copy_plan.injected.values())
        return out
