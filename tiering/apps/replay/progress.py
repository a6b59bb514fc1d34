"""Progress of a replay on stderr, naming the run in progress.

On a terminal (a tty with a width), a tqdm bar over every request of every run, whose label is
the run being simulated. Anywhere else (a pipe, a log file, CI), plain lines:
one when a run starts, one each time another tenth of its requests is done,
and one when it ends, each naming the run (``[3/6 lru] 4,812/12,031
requests``). ``quiet``: nothing at all (``-q``). ``clock`` is injected (wall seconds, for
the elapsed figure). The terminal test is the one every command uses
(``tiering.apps.console.is_terminal``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tiering._optional import require
from tiering.apps.console import is_terminal


class Progress:
    """Callbacks for ``run_grid``: ``start(i, label)``, ``advance(n)``, ``end()``."""

    def __init__(self, runs: int, requests: int, *, stream: TextIO | None = None,
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic,
                 prefix: str = "", quiet: bool = False) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._quiet = quiet
        self._tty = not quiet and (is_terminal(self._stream) if tty is None else tty)
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
            tqdm = require("tqdm", "apps", "tiering replay's progress bar").tqdm

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
        if self._quiet:
            return
        print(f"replay {text}", file=self._stream, flush=True)
