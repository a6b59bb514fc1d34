"""Publishing to the shared cold tier: every block that reaches the vLLM manager's disk
tier is offered to it (``Publisher``)."""

from __future__ import annotations

from typing import Any

import torch

from tiering.integrations.vllm._ctx import Ctx
from tiering.integrations.vllm._state import log

__all__ = ["Publisher"]


class Publisher:
    """Offers blocks that reached the disk tier to ``shared`` (None: no shared tier)."""

    def __init__(self, ctx: Ctx, shared: Any) -> None:
        self._ctx = ctx
        self.shared = shared

    def publish(self, key: bytes, page: torch.Tensor) -> bool | None:
        """I/O thread: offer a block that just reached the disk tier to the shared tier;
        whether it is there now (None: no shared tier). Counted by ``count``."""
        if self.shared is None:
            return None
        try:
            res = self.shared.publish(key, page.numpy().tobytes())
        except Exception as exc:  # a store fault is a status; anything else is logged
            log.warning("tiering: publishing %s to the shared tier: %r", key.hex(), exc)
            return False
        return res.status.value in ("written", "duplicate")

    def count(self, ok: bool | None) -> None:
        if ok is True:
            self._ctx.counters.shared_published += 1
        elif ok is False:
            self._ctx.counters.shared_publish_failed += 1
