"""A small priority thread pool: reloads go ahead of offload and disk writes.

``concurrent.futures.ThreadPoolExecutor`` runs jobs in arrival order; a
reload waiting behind a queue of 1 GiB demotions stalls a request the
scheduler wants to run now. Here every job carries a priority (lower runs
first, arrival order within a priority). Workers block on the queue (no
polling); ``shutdown`` waits with a timeout.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tiering.core.validate import check_timeout, is_int

RELOAD = 0  # priorities, lower first
OFFLOAD = 1
WRITE = 2

_STOP = object()


class PriorityExecutor:
    """Runs submitted callables on ``workers`` daemon threads, lowest priority first."""

    def __init__(self, workers: int, name: str) -> None:
        if not is_int(workers) or workers < 1:
            raise ValueError(f"{name}: workers must be an int >= 1, got {workers!r}")
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for i, t in enumerate(self._threads):
            try:
                t.start()
            except RuntimeError as exc:  # the platform's thread limit: stop the ones started
                self._threads = self._threads[:i]
                self.shutdown(timeout=10.0)
                raise RuntimeError(f"{name}: could start only {i} of the {workers} worker "
                                   f"threads asked for: {exc}") from exc

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` at ``priority`` (an int, lower runs first); its Future.
        A non-int priority (it would poison the queue's ordering) or a ``fn`` that is
        not callable is a ValueError, and nothing is queued."""
        if not is_int(priority):
            raise ValueError(f"submit: priority must be an int, got {priority!r}")
        if not callable(fn):
            raise ValueError(f"submit: fn must be callable, got {fn!r}")
        with self._lock:
            if self._closed:
                raise RuntimeError("executor is shut down")
            fut: Future = Future()
            self._q.put((priority, next(self._seq), fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item[2] is _STOP:
                return
            _, _, fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to whoever waits on the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Finish queued jobs, then stop the workers (waiting at most ``timeout`` each).

        Returns True when every worker has joined (also on a second call). A
        ``timeout`` that is not a finite number >= 0 is a ValueError (nothing stops)."""
        timeout = check_timeout("PriorityExecutor.shutdown", timeout)
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    # sorts after every real job (priority is larger than any used)
                    self._q.put((1 << 30, next(self._seq), _STOP, None, ()))
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)
