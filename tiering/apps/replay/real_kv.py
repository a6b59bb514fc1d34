"""Drive a real ``PagedKVCache`` from the simulator.

The simulator needs, besides the eviction hooks, ``page_tokens``,
``page_bytes`` and ``next_completion()`` from its KV backend.
``SynchronizedKV`` adds those to a real cache and makes ``poll()`` wait for
every copy in flight first, so that at each of the controller's safe points
the real cache is in the state a ``ModeledKVCache`` with instantaneous links
would be in. Everything else is passed through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class SynchronizedKV:
    """A ``PagedKVCache`` whose transfers have all completed by each ``poll()``."""

    def __init__(self, cache: Any, clock: Callable[[], float], timeout_s: float = 30.0) -> None:
        self._cache = cache
        self._clock = clock  # the simulator's clock (give the cache the same one)
        self._timeout_s = timeout_s
        self.page_tokens = cache.geometry.page_tokens
        self.page_bytes = cache.geometry.page_bytes

    @property
    def cache(self) -> Any:
        return self._cache

    def poll(self) -> list:
        """Wait (up to the timeout) for every copy in flight, then apply them;
        returns the cache's ``TransferResult`` records."""
        return self._cache.synchronize(self._timeout_s)

    def next_completion(self) -> float | None:
        """Copies in flight complete at the next poll: now, on the shared clock."""
        return self._clock() if self._cache.in_flight() else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)
