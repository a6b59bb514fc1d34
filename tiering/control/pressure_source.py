"""The pressure source contract and what every source shares: ``PressureSource``
(``read()`` -> a fraction in [0, 1]), the retry schedule of a source that
failed (``RetryPolicy``) and a device source's health (``SourceHealth``).
``tiering.control.pressure`` is the public module; it re-exports these."""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

#: Every pressure module logs under one name (the public module's).
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
