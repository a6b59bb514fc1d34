"""Injected clocks. Components take a ``clock`` callable instead of reading
the time themselves, so tests and simulations decide what "now" is."""

from __future__ import annotations


class StepClock:
    """Time counted in steps: the owner advances it once per step, and every
    component handed it sees the step count as seconds."""

    def __init__(self) -> None:
        self._now = 0.0

    def __call__(self) -> float:
        return self._now

    def advance(self) -> None:
        self._now += 1.0
