"""Fault injection for the disk tier: a seeded plan and a zarr store wrapper that obeys it.

``FaultPlan`` decides, operation by operation, which faults strike; ``FaultyStore``
wraps any zarr store and applies the plan to chunk reads and writes and to
manifest writes. Other metadata keys (``zarr.json``) pass through untouched.

Kinds and the operation they strike:

- ``enospc_write`` / ``eio_write``: a chunk ``set`` raises ``OSError`` with
  ``ENOSPC`` / ``EIO`` before anything is stored.
- ``eio_read``: a chunk ``get`` raises ``OSError(EIO)``.
- ``corrupt``: a chunk ``get`` returns the stored bytes with one byte flipped,
  as a medium that rotted would; the crc32c codec must catch it.
- ``enospc_manifest`` / ``erofs_manifest`` / ``eio_manifest``: a ``set`` of the
  manifest (``tiering-manifest.json``) raises ``OSError`` with ``ENOSPC`` /
  ``EROFS`` / ``EIO`` before anything is stored (the old manifest stays).
- ``slow``: a chunk ``set`` or ``get`` first waits ``slow_seconds`` through the injected
  ``sleep`` function, then proceeds normally.

Each kind is armed either with a probability (drawn from the plan's own seeded
``random.Random``) or for the next N operations it applies to. At most one
failing kind strikes an operation (write: ``enospc_write`` before ``eio_write``;
read: ``eio_read`` before ``corrupt``); ``slow`` may accompany either.
``plan.injected`` counts every fault actually applied, per kind, so a test or a
stress run can check that each one surfaced as an error.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from tiering.core.validate import check_waitable
from tiering.disk.manifest import MANIFEST_KEY

WRITE_KINDS = ("enospc_write", "eio_write")
READ_KINDS = ("eio_read", "corrupt")
#: a read that times out, or that the store answers with a server error (5xx): transient,
#: the data stays
TRANSIENT_KINDS = ("etimedout_read", "eremoteio_read")
MANIFEST_KINDS = ("enospc_manifest", "erofs_manifest", "eio_manifest")
FAULT_KINDS = (*WRITE_KINDS, *READ_KINDS, "slow")  # the data path's kinds
ALL_KINDS = (*FAULT_KINDS, *MANIFEST_KINDS, *TRANSIENT_KINDS)  # what ``arm`` accepts and ``injected`` counts
_ERRNO = {
    "enospc_write": errno.ENOSPC,
    "eio_write": errno.EIO,
    "enospc_manifest": errno.ENOSPC,
    "erofs_manifest": errno.EROFS,
    "eio_manifest": errno.EIO,
}


@dataclass(frozen=True)
class FaultRule:
    """How one kind is armed: a per-operation probability, or the next ``next_n`` operations."""

    probability: float = 0.0
    next_n: int = 0

    def __post_init__(self) -> None:
        p = self.probability
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"FaultRule.probability must be a number in [0, 1], got {p!r}")
        n = self.next_n
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"FaultRule.next_n must be an int >= 0, got {n!r}")
        if self.probability and self.next_n:
            raise ValueError("FaultRule takes either probability or next_n, not both")


class FaultPlan:
    """Which faults strike which chunk operations; thread-safe, reproducible from its seed.

    ``rng`` (or ``seed``) drives the probabilistic rules; ``sleep`` is what a
    ``slow`` fault calls, so tests can pass a recorder instead of really waiting.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        slow_seconds: float = 0.05,
    ) -> None:
        if (
            isinstance(slow_seconds, bool)
            or not isinstance(slow_seconds, (int, float))
            or not 0 <= slow_seconds < float("inf")
        ):
            raise ValueError(f"slow_seconds must be a finite number >= 0, got {slow_seconds!r}")
        check_waitable("FaultPlan.slow_seconds", slow_seconds)  # a slow fault sleeps it
        if not callable(sleep):
            raise ValueError(f"sleep must be callable, got {type(sleep).__name__}")
        self._rng = rng if rng is not None else random.Random(seed)
        self.sleep = sleep
        self.slow_seconds = slow_seconds
        self._rules: dict[str, FaultRule] = {}
        self._remaining: dict[str, int] = {}
        self._injected = dict.fromkeys(ALL_KINDS, 0)
        self._lock = threading.Lock()

    def arm(self, kind: str, *, probability: float = 0.0, next_n: int = 0) -> None:
        """Arm ``kind`` with a probability or for the next ``next_n`` operations it applies to."""
        if kind not in ALL_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {ALL_KINDS}")
        rule = FaultRule(probability=probability, next_n=next_n)
        with self._lock:
            self._rules[kind] = rule
            self._remaining[kind] = rule.next_n

    def disarm(self, kind: str | None = None) -> None:
        """Stop injecting ``kind`` (every kind when None); counts are kept."""
        with self._lock:
            for k in [kind] if kind is not None else list(self._rules):
                self._rules.pop(k, None)
                self._remaining.pop(k, None)

    @property
    def injected(self) -> dict[str, int]:
        """Faults applied so far, per kind (a copy)."""
        with self._lock:
            return dict(self._injected)

    def draw(self, op: str) -> tuple[str | None, bool]:
        """Decide one operation's fate: (failing kind or None, whether it is slow).

        ``op`` is ``"set"``, ``"get"`` or ``"manifest"`` (a manifest write; never slow). The caller reports what it actually
        applied through ``record``; only that is counted.
        """
        if op == "set":
            kinds: Iterable[str] = WRITE_KINDS
        elif op == "get":
            kinds = (*READ_KINDS, *TRANSIENT_KINDS)
        elif op == "manifest":
            with self._lock:
                return next((k for k in MANIFEST_KINDS if self._fires(k)), None), False
        else:
            raise ValueError(f"op must be 'set', 'get' or 'manifest', got {op!r}")
        with self._lock:
            failing = next((k for k in kinds if self._fires(k)), None)
            slow = self._fires("slow")
        return failing, slow

    def record(self, kind: str) -> None:
        """Count one applied fault of ``kind``."""
        with self._lock:
            self._injected[kind] += 1

    def flip_position(self, size: int) -> int:
        """Where a ``corrupt`` fault flips a byte in a payload of ``size`` bytes."""
        with self._lock:
            return self._rng.randrange(size)

    def _fires(self, kind: str) -> bool:
        rule = self._rules.get(kind)
        if rule is None:
            return False
        if rule.next_n:
            if self._remaining[kind] <= 0:
                return False
            self._remaining[kind] -= 1
            return True
        return self._rng.random() < rule.probability


def _is_chunk_key(key: str) -> bool:
    return key.startswith("c/") or "/c/" in key


class FaultyStore(WrapperStore[Store]):
    """Wraps a zarr store and applies a ``FaultPlan`` to chunk ``get``/``set``."""

    def __init__(self, store: Store, plan: FaultPlan) -> None:
        super().__init__(store)
        self.plan = plan

    def _with_store(self, store: Store) -> FaultyStore:
        return FaultyStore(store, self.plan)

    def __repr__(self) -> str:
        return f"FaultyStore({self._store!r})"

    async def _maybe_slow(self, slow: bool) -> None:
        if slow:
            self.plan.record("slow")
            await asyncio.to_thread(self.plan.sleep, self.plan.slow_seconds)

    async def set(self, key: str, value: Buffer) -> None:
        if key.split("/")[-1] == MANIFEST_KEY:
            failing, _ = self.plan.draw("manifest")
        elif not _is_chunk_key(key):
            await self._store.set(key, value)
            return
        else:
            failing, slow = self.plan.draw("set")
            await self._maybe_slow(slow)
        if failing is not None:
            self.plan.record(failing)
            code = _ERRNO[failing]
            raise OSError(code, f"injected fault {failing}: {os.strerror(code)}", key)
        await self._store.set(key, value)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if not _is_chunk_key(key):
            return await self._store.get(key, prototype, byte_range)
        failing, slow = self.plan.draw("get")
        await self._maybe_slow(slow)
        if failing in ("eio_read", *TRANSIENT_KINDS):
            self.plan.record(failing)
            code = {"eio_read": errno.EIO, "etimedout_read": errno.ETIMEDOUT,
                    "eremoteio_read": errno.EREMOTEIO}[failing]
            raise OSError(code, f"injected fault {failing}: {os.strerror(code)}", key)
        value = await self._store.get(key, prototype, byte_range)
        if failing == "corrupt" and value is not None and len(value) > 0:
            data = np.array(value.as_numpy_array(), dtype=np.uint8, copy=True)
            data[self.plan.flip_position(len(data))] ^= 0xFF
            value = prototype.buffer.from_array_like(data)
            self.plan.record(failing)
        return value
