"""A user's block policy, checked and metered at every call the replay makes into it.

A ``--block-policy module:Class`` is user code, called from deep inside the block
index and the tiers' eviction path. ``Guarded`` wraps it (the built-ins of
``tiering.policies.blocks`` are not wrapped unless the run is metered): an exception
raised by any of its hooks, ``admit`` answering something that is not a bool, or
``victims`` offering a key the policy does not hold, stops the run with
``tiering.PolicyFailed`` (a ``ValueError``) naming the block policy, its class, the
tier, the hook and the simulated time (``__cause__``: what the policy raised),
instead of a traceback from the index or a wrong victim. The order and every answer
of a policy that behaves are passed through unchanged, so its runs are those of the
unwrapped policy.

A batch hook (``on_commit``, ``on_publish``, ``pop_victim``, ``on_removes``,
``on_inserts``) the policy's class defines itself is called as one hook; one it
inherits runs the base class's default here, which calls the per-event hooks, each
checked and metered.

``PolicyMeter`` counts each hook's calls and the events they cover (a block, or a
request for ``on_request``) and the time spent inside the policy. Once the policy's
mean time per event is over ``budget_s`` (after ``MIN_EVENTS`` events) it says so
once, while the run goes on (``warn``), naming the hook that took most.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Container, Hashable, Iterator, Sequence
from typing import NamedTuple

from tiering.errors import PolicyFailed
from tiering.policies.blocks import BlockPolicy
from tiering.policies.blocks.base import BlockInfo

#: The default budget of a block policy: mean seconds inside it per event.
DEFAULT_BUDGET_S = 50e-6
MIN_EVENTS = 2000  # events seen before a mean is trusted for the warning

_BATCH = ("on_commit", "on_publish", "pop_victim", "on_removes", "on_inserts")


def is_builtin(policy: BlockPolicy) -> bool:
    """Whether ``policy`` is one of the library's own (not wrapped)."""
    return type(policy).__module__.startswith("tiering.policies.")


class HookCost(NamedTuple):
    """One hook of one tier's policy: calls, events (blocks or requests) and seconds."""

    tier: str
    hook: str
    calls: int
    events: int
    seconds: float


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class PolicyMeter:
    """Calls, events and seconds per (tier, hook) of one run's block policies, with the
    budget warning (see the module docstring). ``timer``: seconds (injected)."""

    def __init__(self, name: str, budget_s: float = DEFAULT_BUDGET_S,
                 warn: Callable[[str], None] | None = _stderr,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not (
                budget_s > 0 and budget_s < float("inf")):
            raise ValueError(f"PolicyMeter: budget_s must be a finite number > 0, got {budget_s!r}")
        self.name = name
        self.budget_s = float(budget_s)
        self.timer = timer
        self._warn = warn
        self.warned = False
        self._rows: dict[tuple[str, str], list] = {}  # (tier, hook) -> [calls, events, s]
        self.events = 0
        self.seconds = 0.0

    def add(self, tier: str, hook: str, events: int, seconds: float) -> None:
        row = self._rows.get((tier, hook))
        if row is None:
            row = self._rows[(tier, hook)] = [0, 0, 0.0]
        row[0] += 1
        row[1] += events
        row[2] += seconds
        self.events += events
        self.seconds += seconds
        if (not self.warned and self.events >= MIN_EVENTS
                and self.seconds > self.budget_s * self.events):
            self.warned = True
            if self._warn is not None:
                (tier_, hook_), worst = max(self._rows.items(), key=lambda kv: kv[1][2])
                self._warn(
                    f"warning: block policy {self.name!r} is slow: "
                    f"{1e6 * self.seconds / self.events:.1f} µs per event over "
                    f"{self.events:,} events (budget {1e6 * self.budget_s:g} µs); most in "
                    f"{hook_} of the {tier_} tier ({worst[0]:,} calls, {worst[2]:.2f} s). "
                    "The replay goes on; see docs/blocks.md on how often each hook is called")

    def costs(self) -> tuple[HookCost, ...]:
        """Every (tier, hook) seen, in the order first called."""
        return tuple(HookCost(t, h, c, e, s) for (t, h), (c, e, s) in self._rows.items())


def _defined_by_user(cls: type, hook: str, check: bool) -> bool:
    """Whether ``cls`` has its own ``hook`` (not the base class's): with ``check``, only
    one written outside the library counts (a library class's batch hook would call the
    user's per-event hooks unchecked)."""
    for c in cls.__mro__:
        if hook in c.__dict__:
            if c is BlockPolicy:
                return False
            return not check or not c.__module__.startswith("tiering.policies.")
    return False


class Guarded(BlockPolicy):
    """``inner`` with each hook checked (``check``) and metered (``meter``); see the
    module docstring. ``tier`` names its tier and ``clock`` gives the simulated time in
    messages."""

    def __init__(self, inner: BlockPolicy, tier: str, clock: Callable[[], float],
                 meter: PolicyMeter | None = None, check: bool = True) -> None:
        self.inner = inner
        self.name = inner.name
        self._tier = tier
        self._clock = clock
        self._meter = meter
        self._check = check
        # the batch hooks the policy's own code defines (a built-in's, when only metered);
        # the others, a library class's among them, run the base class's defaults over
        # the checked per-event hooks below
        self._own = frozenset(h for h in _BATCH if _defined_by_user(type(inner), h, check))

    def _fail(self, hook: str, what: str) -> PolicyFailed:
        cls = type(self.inner)
        return PolicyFailed(
            f"block policy {self.inner.name!r} ({cls.__module__}.{cls.__qualname__}) of the "
            f"{self._tier} tier, in {hook} at t={self._clock():g} s: {what}")

    def _call(self, hook: str, fn: Callable, *args, events: int = 1):
        meter = self._meter
        t0 = meter.timer() if meter is not None else 0.0
        try:
            out = fn(*args)
        except Exception as err:
            raise self._fail(hook, f"raised {type(err).__name__}: {err}") from err
        if meter is not None:
            meter.add(self._tier, hook, events, meter.timer() - t0)
        return out

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
        keys = self._call(hook, lambda: iter(make()), events=0)
        inner = self.inner
        meter = self._meter
        while True:
            t0 = meter.timer() if meter is not None else 0.0
            try:
                key = next(keys)
            except StopIteration:
                return
            except Exception as err:
                raise self._fail(hook, f"raised {type(err).__name__}: {err}") from err
            if meter is not None:
                meter.add(self._tier, f"{hook} (next)", 1, meter.timer() - t0)
            if self._check:
                held = self._call("__contains__", inner.__contains__, key, events=0)
                if not held:
                    raise self._fail(hook, f"offered {key!r}, a block it does not hold")
            yield key

    # -- batch hooks: the policy's own, called as one hook, or the base defaults --------

    def on_commit(self, keys, hits, depths, get, now) -> None:
        if "on_commit" not in self._own:
            return super().on_commit(keys, hits, depths, get, now)
        self._call("on_commit", self.inner.on_commit, keys, hits, depths, get, now,
                   events=1 + len(hits))

    def on_publish(self, keys, depth, room, insert, get, now) -> tuple[int, bool]:
        if "on_publish" not in self._own:
            return super().on_publish(keys, depth, room, insert, get, now)
        out = self._call("on_publish", self.inner.on_publish, keys, depth, room, insert, get,
                         now, events=len(keys))
        if self._check and not (
                isinstance(out, tuple) and len(out) == 2 and type(out[0]) is int
                and 0 <= out[0] <= len(keys) and isinstance(out[1], bool)):
            raise self._fail("on_publish", f"returned {out!r}, not (blocks inserted, refused)")
        return out

    def pop_victim(self, now: float, *busy: Container) -> Hashable | None:
        if "pop_victim" not in self._own:
            return super().pop_victim(now, *busy)
        key = self._call("pop_victim", self.inner.pop_victim, now, *busy)
        if self._check and key is not None and not self._call(
                "__contains__", self.inner.__contains__, key, events=0):
            raise self._fail("pop_victim", f"offered {key!r}, a block it does not hold")
        return key

    def on_removes(self, keys) -> None:
        if "on_removes" not in self._own:
            return super().on_removes(keys)
        self._call("on_removes", self.inner.on_removes, keys, events=len(keys))

    def on_inserts(self, keys, depths, get, now) -> None:
        if "on_inserts" not in self._own:
            return super().on_inserts(keys, depths, get, now)
        self._call("on_inserts", self.inner.on_inserts, keys, depths, get, now,
                   events=len(keys))

    def __len__(self) -> int:
        n = self._call("__len__", self.inner.__len__, events=0)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise self._fail("__len__", f"returned {n!r}, not an int >= 0")
        return n

    def __contains__(self, key: object) -> bool:
        return bool(self._call("__contains__", self.inner.__contains__, key, events=0))

    def check_integrity(self) -> None:
        check = getattr(self.inner, "check_integrity", None)
        if check is not None:
            check()


def cost_summary(costs: Sequence[HookCost]) -> dict:
    """``costs`` as summary.json keeps them: per tier and hook, calls, events and seconds,
    with the totals and the mean microseconds per event."""
    events = sum(c.events for c in costs)
    seconds = sum(c.seconds for c in costs)
    return {
        "hooks": [c._asdict() for c in costs],
        "events": events,
        "seconds": seconds,
        "us_per_event": 1e6 * seconds / events if events else None,
    }


def format_costs(run: str, costs: Sequence[HookCost]) -> str:
    """A short table of one run's block policy cost: per hook (the tiers added up), calls,
    events and seconds, the busiest first."""
    by_hook: dict[str, list] = {}
    for c in costs:
        row = by_hook.setdefault(c.hook, [0, 0, 0.0])
        row[0] += c.calls
        row[1] += c.events
        row[2] += c.seconds
    total = cost_summary(costs)
    per = total["us_per_event"]
    lines = [f"block policy cost, {run}: {total['seconds']:.2f} s in the policy, "
             f"{total['events']:,} events" + (f", {per:.1f} µs each" if per is not None else "")]
    for hook, (calls, events, seconds) in sorted(by_hook.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"  {hook:<16} {calls:>12,} calls {events:>12,} events {seconds:>9.3f} s")
    return "\n".join(lines)
