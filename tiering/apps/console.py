"""What every ``tiering`` command shares on the console: ``-v``/``-q``, log levels, and
one progress style.

Progress goes to stderr. On a terminal it is a tqdm bar; anywhere else (a pipe, a log
file, CI) it is plain lines, one each time another tenth of the work is done, so a log
holds a few readable lines rather than hundreds of carriage-return updates. ``-q`` turns
progress off and lets only errors through the ``tiering`` loggers; ``-v`` lets INFO
through, ``-vv`` DEBUG; by default warnings are shown.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

_LEVELS = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}


def version() -> str:
    """The installed distribution's version (the package's own when not installed)."""
    from importlib import metadata

    try:
        return metadata.version("tiering")
    except metadata.PackageNotFoundError:
        from tiering import __version__

        return __version__


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """``--version``, ``-v``/``--verbose`` (repeatable) and ``-q``/``--quiet`` on ``parser``."""
    parser.add_argument("-V", "--version", action="version", version=f"tiering {version()}")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="count", default=0,
                       help="more log output (-v info, -vv debug)")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="no progress and only errors in the log output")


def verbosity(args: argparse.Namespace) -> int:
    """-1 quiet, 0 default, 1 and up more (from ``add_common_options``)."""
    return -1 if getattr(args, "quiet", False) else int(getattr(args, "verbose", 0))


@contextlib.contextmanager
def log_level(level: int, stream: TextIO | None = None) -> Iterator[None]:
    """While it is open, the ``tiering`` loggers show what ``level`` names (see
    ``verbosity``: -1 errors, 0 warnings, 1 info, 2 debug) on ``stream`` (stderr); the
    logger's level and handlers are as they were afterwards."""
    logger = logging.getLogger("tiering")
    before = logger.level
    handler = None
    if level > 0:  # warnings reach stderr without a handler of ours (logging's last resort)
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(_LEVELS.get(level, logging.DEBUG))
    try:
        yield
    finally:
        logger.setLevel(before)
        if handler is not None:
            logger.removeHandler(handler)


def is_terminal(stream: TextIO) -> bool:
    """A terminal a bar can be drawn on: a tty that says how wide it is (a pseudo-terminal
    of width 0, as some CI runners give, shows nothing: plain lines there)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """Progress of one piece of work of ``total`` ``unit``\\ s, named ``desc``.

    ``update(n)`` adds done work, ``set(done)`` says how much is done, ``note(text)`` sets
    a short status shown beside it; ``close()`` ends it (a last plain line off a
    terminal). ``tty``: None detects ``stream``; ``quiet``: show nothing. ``clock``:
    wall seconds for the elapsed figure."""

    def __init__(self, total: float, *, desc: str, unit: str, stream: TextIO | None = None,
                 tty: bool | None = None, quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not total > 0:
            raise ValueError(f"Progress: total must be > 0, got {total!r}")
        self._stream = stream if stream is not None else sys.stderr
        self._total = total
        self._desc = desc
        self._unit = unit
        self._clock = clock
        self._started = clock()
        self._done = 0.0
        self._note = ""
        self._quiet = quiet
        self._closed = False
        self._next_tenth = 1
        self._bar = None
        if not quiet and (is_terminal(self._stream) if tty is None else tty):
            from tiering._optional import require

            tqdm = require("tqdm", "apps", f"the {desc} progress bar").tqdm
            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self._stream,
                             dynamic_ncols=True)

    def update(self, n: float = 1) -> None:
        self.set(self._done + n)

    def set(self, done: float) -> None:
        done = min(float(done), float(self._total))
        if done <= self._done:
            return
        step = done - self._done
        self._done = done
        if self._bar is not None:
            self._bar.update(step)
            return
        if self._quiet:
            return
        tenth = int(10 * done / self._total)
        if tenth >= self._next_tenth and done < self._total:
            self._next_tenth = tenth + 1
            self._line()

    def note(self, text: str) -> None:
        self._note = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        """End the bar, or print the last line (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif not self._quiet:
            self._line(final=True)

    def _line(self, final: bool = False) -> None:
        pct = 100.0 * self._done / self._total
        elapsed = self._clock() - self._started
        done = f"{self._done:,.0f}" if float(self._done).is_integer() else f"{self._done:,.1f}"
        total = f"{self._total:,.0f}" if float(self._total).is_integer() else f"{self._total:,.1f}"
        text = f"{self._desc}: {pct:3.0f}% ({done}/{total} {self._unit}, {elapsed:.1f} s)"
        if final:
            text += " done"
        if self._note:
            text += f" {self._note}"
        print(text, file=self._stream, flush=True)
