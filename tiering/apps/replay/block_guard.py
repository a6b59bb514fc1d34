"""A user's block policy, checked at every call the replay makes into it.

A ``--block-policy module:Class`` is user code, called from deep inside the block
index and the tiers' eviction path. ``Guarded`` wraps it (the built-ins of
``tiering.policies.blocks`` are not wrapped): an exception raised by any of its hooks,
``admit`` answering something that is not a bool, or ``victims`` offering a key
the policy does not hold, stops the run with ``tiering.PolicyFailed`` (a
``ValueError``) naming the block policy, its class, the tier, the hook and the
simulated time (``__cause__``: what the policy raised), instead of a traceback
from the index or a wrong victim. The order and every answer of a policy that behaves are passed through
unchanged, so its runs are those of the unwrapped policy.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterator, Sequence

from tiering.errors import PolicyFailed
from tiering.policies.blocks import BlockPolicy
from tiering.policies.blocks.base import BlockInfo


def is_builtin(policy: BlockPolicy) -> bool:
    """Whether ``policy`` is one of the library's own (not wrapped)."""
    return type(policy).__module__.startswith("tiering.policies.")


class Guarded(BlockPolicy):
    """``inner`` with each hook checked (see the module docstring); ``tier`` names its tier
    and ``clock`` gives the simulated time in messages."""

    def __init__(self, inner: BlockPolicy, tier: str, clock: Callable[[], float]) -> None:
        self.inner = inner
        self.name = inner.name
        self._tier = tier
        self._clock = clock

    def _fail(self, hook: str, what: str) -> PolicyFailed:
        cls = type(self.inner)
        return PolicyFailed(
            f"block policy {self.inner.name!r} ({cls.__module__}.{cls.__qualname__}) of the "
            f"{self._tier} tier, in {hook} at t={self._clock():g} s: {what}")

    def _call(self, hook: str, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as err:
            raise self._fail(hook, f"raised {type(err).__name__}: {err}") from err

    def on_request(self, keys: Sequence[Hashable], now: float) -> None:
        self._call("on_request", self.inner.on_request, keys, now)

    def admit(self, key: Hashable, depth: int, now: float) -> bool:
        answer = self._call("admit", self.inner.admit, key, depth, now)
        if not isinstance(answer, bool):
            raise self._fail("admit", f"returned {answer!r}, not a bool")
        return answer

    def on_insert(self, info: BlockInfo, now: float) -> None:
        self._call("on_insert", self.inner.on_insert, info, now)

    def on_insert_key(self, key: Hashable, depth: int, get: Callable[[Hashable], BlockInfo],
                      now: float) -> None:
        self._call("on_insert", self.inner.on_insert_key, key, depth, get, now)

    def on_hit(self, info: BlockInfo, now: float) -> None:
        self._call("on_hit", self.inner.on_hit, info, now)

    def on_remove(self, key: Hashable) -> None:
        self._call("on_remove", self.inner.on_remove, key)

    def victims(self, now: float) -> Iterator[Hashable]:
        return self._checked("victims", lambda: self.inner.victims(now))

    def victims_except(self, now: float, *busy: Container) -> Iterator[Hashable]:
        return self._checked("victims", lambda: self.inner.victims_except(now, *busy))

    def _checked(self, hook: str, make: Callable[[], Iterator[Hashable]]) -> Iterator[Hashable]:
        keys = self._call(hook, lambda: iter(make()))
        inner = self.inner
        while True:
            try:
                key = next(keys)
            except StopIteration:
                return
            except Exception as err:
                raise self._fail(hook, f"raised {type(err).__name__}: {err}") from err
            held = self._call("__contains__", inner.__contains__, key)
            if not held:
                raise self._fail(hook, f"offered {key!r}, a block it does not hold")
            yield key

    def __len__(self) -> int:
        n = self._call("__len__", self.inner.__len__)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise self._fail("__len__", f"returned {n!r}, not an int >= 0")
        return n

    def __contains__(self, key: object) -> bool:
        return bool(self._call("__contains__", self.inner.__contains__, key))

    def check_integrity(self) -> None:
        check = getattr(self.inner, "check_integrity", None)
        if check is not None:
            check()
