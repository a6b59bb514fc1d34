"""``PressurePoller``: samples a pressure source on a daemon thread, so that the
step path reads the latest figure (``PressureReading``) without waiting for a
driver call. ``tiering.control.pressure`` is the public module; it re-exports
these."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from tiering.control.pressure_source import PressureSource, _check_fraction, logger
from tiering.core.validate import check_timeout, check_waitable


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
        check_waitable("PressurePoller.interval_s", interval_s)
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
        """Stop the thread and wait up to ``timeout`` s; True when it has ended. A
        ``timeout`` that is not a finite number >= 0 is a ValueError (nothing stops)."""
        timeout = check_timeout("PressurePoller.stop", timeout)
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
