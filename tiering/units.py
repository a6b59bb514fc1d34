"""Sizes: one convention for the whole library.

- The API takes and reports **bytes** (``DiskConfig.capacity_bytes``, ``stats()``'s
  ``*_bytes``, the vLLM config). These helpers write them readably: ``gib(2)`` is
  ``2 * 2**30`` bytes. Binary units throughout (a GiB is 2**30 bytes).
- The two device and host pool sizes of ``TieredKVConfig`` are counts of KV pages
  (``device_pages``, ``host_pages``), because a pool holds whole pages;
  ``TieredKVConfig.from_bytes`` takes them in bytes instead (the whole pages that fit).
- The command line takes **GiB** (``--device-gib 2.5``) and prints GiB.
"""

from __future__ import annotations

import math
import numbers

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def _size(n: object, unit: int, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"{name}: a size must be a number, got {n!r}")
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"{name}: a size must be a finite number >= 0, got {n!r}")
    if isinstance(n, numbers.Integral):  # numpy's too: multiplied as a Python int, never
        return int(n) * unit  # in its own fixed width, where it would wrap around
    nbytes = float(n) * unit
    if not math.isfinite(nbytes):
        raise ValueError(f"{name}: {n!r} is more bytes than a float holds; give an int")
    return round(nbytes)


def kib(n: float) -> int:
    """``n`` KiB in bytes (an int; a fraction is rounded to the nearest byte)."""
    return _size(n, KiB, "kib")


def mib(n: float) -> int:
    """``n`` MiB in bytes."""
    return _size(n, MiB, "mib")


def gib(n: float) -> int:
    """``n`` GiB in bytes: ``gib(2) == 2 * 2**30``."""
    return _size(n, GiB, "gib")


def tib(n: float) -> int:
    """``n`` TiB in bytes."""
    return _size(n, TiB, "tib")

