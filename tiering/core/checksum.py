"""Checksums of page data, for ``verify=True`` round trips.

zlib's crc32 reads any buffer without copying and runs at several GB/s here;
it is a guard against corruption, not a cryptographic hash.
"""

from __future__ import annotations

import zlib

import torch

from tiering.core.transfer import coalesce
from tiering.errors import ChecksumMismatch  # noqa: F401 (re-exported from its old home)


def crc_of(t: torch.Tensor, crc: int = 0) -> int:
    """crc32 of a CPU tensor's bytes, continuing from ``crc``."""
    if t.device.type != "cpu":
        raise ValueError(f"crc_of needs a CPU tensor, got one on {t.device}")
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy(), crc)


def crc_of_pages(pool: torch.Tensor, slots, crc: int = 0) -> int:
    """crc32 of pages ``slots`` of a CPU page pool, in slot-list order."""
    for r in coalesce(slots, range(len(slots))):
        crc = crc_of(pool[r.src : r.src + r.length], crc)
    return crc
