"""Fetches from the vLLM manager's shared cold tier (a ``tiering.coldtier.SharedBlockStore``):
a block no local tier holds is fetched from it into the disk tier (``ColdFetches``;
publishing to it is ``_publish``)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from tiering.core.executor import RELOAD
from tiering.disk.ledger import DiskExtent
from tiering.integrations.vllm._ctx import Ctx, finished
from tiering.integrations.vllm._disk import DiskTier
from tiering.integrations.vllm._state import (
    MAX_ABSENT,
    MAX_FETCHES,
    SHARED_ABSENT_HOLD_S,
    log,
)
from tiering.types import Tier

__all__ = ["ColdFetches"]


class ColdFetches:
    """Fetches from the shared tier: ``fetching`` (key -> (job, its disk extent once the
    block was found, parent)), ``abandoned`` (jobs a reset let go: (job, extent)) and
    ``absent`` (blocks the shared tier did not have: key -> when asked)."""

    def __init__(self, ctx: Ctx, shared: Any, disk: DiskTier, page_bytes: int) -> None:
        if shared is not None and disk.disk is None:
            raise ValueError("TieredBlockManager: a shared tier needs the disk tier")
        self._ctx = ctx
        self.shared = shared
        self._disk = disk
        self._page_bytes = page_bytes
        self.fetching: dict[bytes, tuple[Future, DiskExtent | None, bytes | None]] = {}
        self.abandoned: list[tuple[Future, DiskExtent | None]] = []
        self.absent: dict[bytes, float] = {}

    def start(self, key: bytes, parent: bytes | None) -> bool:
        """Ask the shared tier for a block no local tier has. Two jobs: the fetch (its
        frame and MAC checked), then, once a disk extent is reserved for the block
        found, its write to disk; the block enters the index at DISK after both."""
        if self.shared is None:
            return False
        ctx = self._ctx
        at = self.absent.get(key)
        if at is not None and ctx.clock() - at < SHARED_ABSENT_HOLD_S:
            return False
        if len(self.fetching) >= MAX_FETCHES:
            return False
        ctx.counters.shared_fetches += 1
        self.fetching[key] = (ctx.io.submit(RELOAD, self._fetch, key), None, parent)
        ctx.dirty = True
        return True

    def _fetch(self, key: bytes) -> tuple[str, torch.Tensor | None]:
        """I/O thread: the shared tier's answer for ``key``: (status, page or None)."""
        assert self.shared is not None
        res = self.shared.fetch(key)
        if res.status.value != "hit":
            return res.status.value, None
        if len(res.payload) != self._page_bytes:
            return "lost", None
        return "hit", torch.frombuffer(bytearray(res.payload), dtype=torch.uint8).view(1, -1)

    def _write_fetched(self, ext: DiskExtent, page: torch.Tensor) -> tuple[str, None]:
        assert self._disk.disk is not None
        self._disk.disk.write(ext, page)
        return "written", None

    def busy(self) -> bool:
        return bool(self.fetching or self.abandoned)

    def futures(self) -> list[Future]:
        return [*(f[0] for f in self.fetching.values()), *(f[0] for f in self.abandoned)]

    def reap(self, now: float) -> None:
        ctx, disk = self._ctx, self._disk
        for fut, ext in [f for f in self.abandoned if f[0].done()]:
            self.abandoned.remove((fut, ext))
            if ext is not None:
                disk.release(ext)
        for key, (fut, ext, parent) in finished(self.fetching, lambda f: f[0]):
            ctx.dirty = True
            exc = fut.exception()
            status, page = ("error", None) if exc is not None else fut.result()
            if status == "hit":  # found: now a disk extent for it (evicting, as a store)
                evicted: list[bytes] = []
                ext = None if key in ctx.index else disk.reserve(key, evicted)
                if ext is not None:
                    self.fetching[key] = (ctx.io.submit(RELOAD, self._write_fetched, ext,
                                                        page), ext, parent)
                continue
            if status != "written":
                if ext is not None:
                    disk.release(ext)
                if status in ("unavailable", "skipped", "error"):
                    ctx.counters.shared_unavailable += 1
                    if exc is not None:
                        log.warning("tiering: block %s from the shared tier: %r", key.hex(), exc)
                else:
                    ctx.counters.shared_misses += 1
                self.absent[key] = now
                if len(self.absent) > MAX_ABSENT:
                    del self.absent[next(iter(self.absent))]
                continue
            assert ext is not None
            if key in ctx.index:  # stored meanwhile by this engine: keep that copy
                disk.release(ext)
                continue
            self.absent.pop(key, None)
            ctx.insert(key, parent, Tier.DISK, ext, now)
            ctx.counters.shared_hits += 1
            ctx.event((key,), "disk", False)

    def reset(self) -> None:
        """Let every fetch go: its extent is released when its job ends."""
        for fut, ext, _ in self.fetching.values():
            self.abandoned.append((fut, ext))
        self.fetching.clear()
        self.absent.clear()

    def extents(self) -> dict[DiskExtent, tuple[str, Any]]:
        """The disk extents fetches hold (for the integrity check)."""
        out: dict[DiskExtent, tuple[str, Any]] = {}
        for k, (_, ext, _) in self.fetching.items():
            if ext is not None:
                out[ext] = ("fetch", k)
        for _, ext in self.abandoned:
            if ext is not None:
                out[ext] = ("fetch abandoned", ext)
        return out
