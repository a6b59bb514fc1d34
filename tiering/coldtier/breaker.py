"""A circuit breaker: a store that stops answering is detected once and skipped until it answers.

States: CLOSED (requests go through), OPEN (requests are refused at once, without I/O, until
``cooldown_s`` has passed on the injected clock), HALF_OPEN (exactly one trial request is let
through; its success closes the breaker, its failure opens it again for another cooldown).
``failure_threshold`` consecutive failures open it. Thread-safe; never waits.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from tiering.core.validate import check_fields

__all__ = ["BreakerConfig", "BreakerState", "BreakerStats", "CircuitBreaker"]


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 1
    cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        check_fields(self, ints={"failure_threshold": 1}, numbers=("cooldown_s",))
        if not math.isfinite(self.cooldown_s):  # an endless cooldown never tries the store again
            raise ValueError(f"BreakerConfig.cooldown_s must be finite, got {self.cooldown_s!r}")


class BreakerStats(NamedTuple):
    state: BreakerState
    opened: int  # times it went CLOSED/HALF_OPEN -> OPEN
    refused: int  # requests refused without I/O
    consecutive_failures: int


class CircuitBreaker:
    def __init__(self, config: BreakerConfig | None = None, *, clock: Callable[[], float]) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial_out = False
        self._opened = 0
        self._refused = 0

    def allow(self) -> bool:
        """May a request go to the store now? (OPEN past its cooldown lets one trial through.)"""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.config.cooldown_s:
                self._state = BreakerState.HALF_OPEN
                self._trial_out = False
            if self._state is BreakerState.HALF_OPEN and not self._trial_out:
                self._trial_out = True
                return True
            self._refused += 1
            return False

    def would_allow(self) -> bool:
        """What allow() would answer now, without using up a half-open trial or counting."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN:
                return self._clock() - self._opened_at >= self.config.cooldown_s
            return not self._trial_out

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._trial_out = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._failures >= self.config.failure_threshold
            ):
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self._trial_out = False
                self._opened += 1
            # OPEN: a late failure of a request let through before opening changes nothing

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def stats(self) -> BreakerStats:
        with self._lock:
            return BreakerStats(self._state, self._opened, self._refused, self._failures)

    def check_integrity(self) -> None:
        with self._lock:
            if not (self._failures >= 0 and self._opened >= 0 and self._refused >= 0):
                raise AssertionError(
                    f"negative counts: failures {self._failures}, opened {self._opened}, "
                    f"refused {self._refused}"
                )
            if self._state is BreakerState.CLOSED:
                if not (self._failures < self.config.failure_threshold):
                    raise AssertionError("closed with failures at threshold")
                if self._trial_out:
                    raise AssertionError("closed breaker has a trial out")
            if self._state is BreakerState.OPEN:
                if not (self._opened >= 1):
                    raise AssertionError("open without ever opening")
                if self._trial_out:
                    raise AssertionError("open breaker has a trial out")
