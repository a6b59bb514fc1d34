"""Progress of a replay on stderr, naming the run in progress.

On a terminal (a tty with a width), a tqdm bar over every request of every run, whose label is
the run being simulated. Anywhere else (a pipe, a log file, CI), plain lines:
one when a run starts, one each time another tenth of its requests is done,
and one when it ends, each naming the run (``[3/6 lru] 4,812/12,031
requests``). ``clock`` is injected (wall seconds, for the elapsed figure).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO


def _drawable(stream: TextIO) -> bool:
    """A terminal a bar can be drawn on: a tty that says how wide it is (a pseudo-terminal
    of width 0, as some CI runners give, would show nothing: plain lines there)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """Callbacks for ``run_grid``: ``start(i, label)``, ``advance(n)``, ``end()``."""

    def __init__(self, runs: int, requests: int, *, stream: TextIO | None = None,
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic,
                 prefix: str = "") -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._tty = _drawable(self._stream) if tty is None else tty
        self._runs = runs
        self._requests = requests
        self._clock = clock
        self._prefix = prefix
        self._label = ""
        self._i = 0
        self._done = 0
        self._next_line = 0
        self._started = clock()
        self._bar = None
        if self._tty:
            from tqdm import tqdm

            self._bar = tqdm(total=runs * requests, unit="req", file=self._stream,
                             desc="replay", dynamic_ncols=True)

    @property
    def running(self) -> str:
        """The label of the run in progress (or that ran last); "" before the first."""
        return self._label

    def _name(self) -> str:
        return f"{self._prefix}[{self._i + 1}/{self._runs} {self._label}]"

    def start(self, i: int, label: str) -> None:
        self._i = i
        self._label = label
        self._done = 0
        self._next_line = max(1, self._requests // 10)
        self._started = self._clock()
        if self._bar is not None:
            self._bar.set_description_str(f"replay {self._name()}")
        else:
            self._line(f"{self._name()} started, {self._requests:,} requests")

    def advance(self, n: int) -> None:
        self._done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        if self._done >= self._next_line and self._done < self._requests:
            self._line(f"{self._name()} {self._done:,}/{self._requests:,} requests")
            self._next_line += max(1, self._requests // 10)

    def finished(self, row: dict) -> None:
        if self._bar is None:
            self._line(f"{self._name()} done in {self._clock() - self._started:.1f} s: "
                       f"{row['finished']:,} finished, {row['rejected']:,} rejected")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _line(self, text: str) -> None:
        print(f"replay {text}", file=self._stream, flush=True)
