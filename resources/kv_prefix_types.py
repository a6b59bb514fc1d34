"""The small types of the prefix cache (``tiering.resources.kv_prefix``), shared by its parts.

``BLOCKS`` is the pool owner of the pages the block index holds; ``PrefixHit`` and
``PrefixLoad`` are what ``cached_prefix`` and a pending load report; ``crc_page`` is
the checksum every block is published and loaded under.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tiering.disk.crc import crc32c_extend
from tiering.types import Tier

#: Pool owner of every device or host page the block index holds.
BLOCKS = ("prefix-blocks",)
DISK_OWNER = "prefix-blocks"


class PrefixHit(NamedTuple):
    """What ``cached_prefix`` found: leading tokens cached, and how many on each tier
    (``shared``: known to exist on the shared cold tier, fetched by an attach)."""

    tokens: int
    device: int
    host: int
    disk: int
    shared: int = 0


class PrefixLoad(NamedTuple):
    """A pending load of an attached request: block positions and their source tiers
    (a block fetched from the shared tier is marked DISK until it lands on the host);
    ``failed``: why blocks were cut from it before the load ran (a failed fetch)."""

    positions: tuple[int, ...]
    tiers: tuple[Tier, ...]
    failed: str | None = None


def crc_page(t: torch.Tensor) -> int:
    """crc32c of one page's bytes (a CPU tensor)."""
    arr = t.contiguous().view(torch.uint8).numpy()
    return crc32c_extend(0, arr)


class BlockParts(NamedTuple):
    """What the block store's parts (``BlockMoves``, ``SharedBlocks``) share: the cache's
    storage, the block index, the rules, the blocks' checksums, the counters and the clock
    (each owned by the ``PrefixCache``; the parts read and update them)."""

    storage: Any
    index: Any
    rules: Any
    crc: dict
    stats: Any
    clock: Any
