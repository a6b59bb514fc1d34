"""The vLLM manager's host tier: every rank's slab, the slot pool, and what only the
host side knows of a block (a store in flight, a promotion's hold, where its bytes
came from)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from tiering.core.pools import PagePool
from tiering.disk import DiskPageStore
from tiering.disk.ledger import DiskExtent
from tiering.integrations.vllm._config import HostSlab
from tiering.integrations.vllm._ctx import Ctx
from tiering.integrations.vllm._state import PROMOTED_HOLD_STEPS, RESET_HOLD_STEPS

__all__ = ["HostTier"]


class HostTier:
    """Host slots: ``pool`` (a ``PagePool`` of ``num_slots`` pages of ``page_bytes``, one
    page a slot of every rank's slab) and per block what the index does not hold:

    - ``storing``: key -> (slot, parent) of a store in flight (the block enters the index
      when its bytes have landed); ``orphaned``: those whose parent was dropped since;
    - ``abandoned``: slot -> step of the reset that abandoned its store (the worker may
      still write it; taken back ``RESET_HOLD_STEPS`` later);
    - ``from_disk``: host copies promoted from disk;
    - ``fresh``: key -> step of a promotion for a lookup that answered pending and has
      not been loaded yet (not a victim for ``PROMOTED_HOLD_STEPS`` steps).
    """

    def __init__(self, ctx: Ctx, slabs: Sequence[HostSlab]) -> None:
        if not slabs:
            raise ValueError("TieredBlockManager: at least one host slab is needed")
        n = slabs[0].num_slots
        if any(s.num_slots != n for s in slabs):
            raise ValueError("TieredBlockManager: every rank's slab must have the same slots")
        self._ctx = ctx
        self.slabs = list(slabs)
        self.num_slots = n
        self.page_bytes = sum(s.slot_bytes for s in slabs)
        self.pool = PagePool("host", n, self.page_bytes)
        self.storing: dict[bytes, tuple[int, bytes | None]] = {}
        self.orphaned: set[bytes] = set()
        self.abandoned: dict[int, int] = {}
        self.from_disk: set[bytes] = set()
        self.fresh: dict[bytes, int] = {}

    # -- bytes (I/O threads) -----------------------------------------------------------

    def page(self, slot: int) -> torch.Tensor:
        """The slot's bytes across every rank, as one (1, page_bytes) page."""
        if len(self.slabs) == 1:
            return self.slabs[0].tensor[slot : slot + 1]
        return torch.cat([s.tensor[slot] for s in self.slabs]).view(1, -1)

    def read_into(self, disk: DiskPageStore, extent: DiskExtent, slot: int) -> None:
        """Read a disk page (checked by the disk store) into ``slot`` of every rank."""
        if len(self.slabs) == 1:
            disk.read(extent, self.slabs[0].tensor[slot : slot + 1])
            return
        buf = torch.empty((1, self.page_bytes), dtype=torch.uint8)
        disk.read(extent, buf)  # checked before any byte reaches a slot
        off = 0
        for s in self.slabs:
            s.tensor[slot].copy_(buf[0, off : off + s.slot_bytes])
            off += s.slot_bytes

    # -- promotions' holds ---------------------------------------------------------------

    def promoted(self, key: bytes) -> None:
        """``key``'s promotion landed: its host copy came from disk and is held for the
        load its lookup waits for."""
        self.from_disk.add(key)
        self.fresh[key] = self._ctx.step

    def loaded(self, key: bytes) -> None:
        """A load took ``key``: its promotion's hold has served."""
        self.fresh.pop(key, None)

    def forget_fresh(self, key: bytes) -> None:
        """``key`` leaves the host: a hold it still had counts as an unused promotion."""
        if self.fresh.pop(key, None) is not None:
            self._ctx.counters.promotions_unused += 1

    def held_fresh(self, key: bytes) -> bool:
        """A block promoted for a pending lookup is kept for ``PROMOTED_HOLD_STEPS``
        steps or until it is loaded: evicting it first would make concurrent
        requests undo each other's promotions (and retry them forever)."""
        at = self.fresh.get(key)
        return at is not None and self._ctx.step - at < PROMOTED_HOLD_STEPS

    def held(self) -> list[bytes]:
        return [k for k in self.fresh if self.held_fresh(k)]

    def left(self, key: bytes, slot: int) -> None:
        """``key``'s host copy at ``slot`` is gone (dropped or moved down)."""
        self.pool.release(key, [slot])
        self.from_disk.discard(key)
        self.forget_fresh(key)

    # -- stores in flight ------------------------------------------------------------------

    def begin_stores(self, blocks: Sequence[tuple[bytes, bytes | None]]) -> list[int]:
        """Slots for ``blocks`` ((key, parent) each); the caller made room for them."""
        slots = self.pool.allocate(("batch",), len(blocks)) if blocks else []
        assert slots is not None
        for (k, p), s in zip(blocks, slots, strict=True):
            self.pool.transfer_ownership(("batch",), k, [s])
            self.storing[k] = (s, p)
        return slots

    def end_store(self, key: bytes) -> tuple[int, bytes | None, bool] | None:
        """The store of ``key`` ended: (slot, parent, orphaned), or None when none was in
        flight. The slot stays the key's (released by ``pool.release`` if not kept)."""
        st = self.storing.pop(key, None)
        if st is None:
            return None
        orphan = key in self.orphaned
        self.orphaned.discard(key)
        return st[0], st[1], orphan

    def orphan_under(self, gone: Collection[bytes]) -> None:
        """Stores in flight whose parent is in ``gone`` will not be stored."""
        for k, (_, parent) in self.storing.items():
            if parent in gone:
                self.orphaned.add(k)

    def abandon_stores(self) -> None:
        """A reset: stores in flight never enter the index; their slots stay reserved."""
        for k, (slot, _) in self.storing.items():
            self.pool.transfer_ownership(k, ("reset", slot), [slot])
            self.abandoned[slot] = self._ctx.step
        self.storing.clear()
        self.orphaned.clear()

    def take_back(self) -> None:
        """Free the slots abandoned by a reset ``RESET_HOLD_STEPS`` steps ago."""
        for slot, at in list(self.abandoned.items()):
            if self._ctx.step - at >= RESET_HOLD_STEPS:
                del self.abandoned[slot]
                self.pool.release(("reset", slot), [slot])

    # -- checking ----------------------------------------------------------------------------

    def holdings(self) -> dict[Any, list[int]]:
        """Slot holders other than blocks at rest: stores in flight and abandoned slots."""
        out: dict[Any, list[int]] = {k: [slot] for k, (slot, _) in self.storing.items()}
        for slot in self.abandoned:
            out[("reset", slot)] = [slot]
        return out
