"""crc32c over numpy buffers, as fast as this machine allows, without holding the GIL.

The disk tier checksums every byte it moves, so the checksum's speed is a large part of
the tier's. Three implementations, the first that is installed and agrees with the
reference (``google_crc32c``) on a self-test at import is used; ``IMPLEMENTATION`` names
it and ``RELEASES_GIL`` says whether it runs with the GIL released:

- ``crc32c-rs``: vectorised (carry-less multiply folding, AVX-512 where the CPU has it),
  about 2.5x the speed of the next one in the CPU cache; releases the GIL.
- ``google-crc32c (ctypes)``: the C library inside the ``google_crc32c`` wheel, called
  through ``ctypes`` (which drops the GIL for every foreign call). The wheel's own Python
  binding releases the GIL only for ``bytes`` of 1 MiB or more, never for a numpy array.
- ``google-crc32c``: that binding (same values, GIL held).

Every implementation computes the same function (CRC-32C, the one zarr's ``crc32c`` codec
stores), so data written under one is read under any other.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import google_crc32c
import numpy as np

__all__ = ["IMPLEMENTATION", "RELEASES_GIL", "ByteSpan", "crc32c_bytes", "crc32c_extend"]

_PROBE = np.frombuffer(bytes(range(256)) * 17, dtype=np.uint8)[3:]


def _agrees(fn: Callable[[int, np.ndarray], int]) -> bool:
    """Whether ``fn(crc, array)`` extends a crc32c exactly as the reference does."""
    whole = google_crc32c.value(_PROBE.tobytes())
    try:
        head = fn(0, _PROBE[:1000])
        return (
            fn(0, _PROBE) == whole
            and fn(head, _PROBE[1000:]) == whole
            and fn(0x1234ABCD, _PROBE[:0]) == 0x1234ABCD
        )
    except (OSError, ValueError, TypeError, ctypes.ArgumentError):
        return False


def _load_rs() -> Callable[..., int] | None:
    """``crc32c(buffer, crc)`` from ``crc32c_rs``, or None."""
    try:
        from crc32c_rs import crc32c as fn
    except ImportError:
        return None
    return fn if _agrees(lambda crc, a: fn(memoryview(a), crc)) else None


def _load_native() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, address, length)`` from the wheel's C library, or None."""
    try:
        from google_crc32c import _crc32c as binding  # the C extension module
    except ImportError:
        return None
    path = getattr(binding, "__file__", None)
    if not path:
        return None
    try:
        # dlsym on the extension's handle also searches the libraries it links,
        # so the crc32c library is found whatever name the wheel gave it.
        fn = ctypes.CDLL(path).crc32c_extend
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return fn if _agrees(lambda crc, a: fn(crc, a.ctypes.data, a.nbytes)) else None


_RS = _load_rs()
_NATIVE = _load_native()


def implementation() -> str:
    """The name of the implementation in use (see the module docstring)."""
    if _RS is not None:
        return "crc32c-rs"
    if _NATIVE is not None:
        return "google-crc32c (ctypes)"
    return "google-crc32c"


IMPLEMENTATION = implementation()
RELEASES_GIL = _RS is not None or _NATIVE is not None


def _as_bytes_view(buf: np.ndarray) -> np.ndarray:
    if not isinstance(buf, np.ndarray):
        raise ValueError(f"crc32c needs a numpy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous array")
    return buf.reshape(-1).view(np.uint8)


def crc32c_extend(crc: int, buf: np.ndarray) -> int:
    """The crc32c of (the bytes ``crc`` summarises) followed by ``buf``'s bytes.

    ``buf`` must be a C-contiguous numpy array; it is read in place, never
    copied. Start from ``crc=0`` for a fresh checksum. The GIL is released
    while the bytes are read when ``RELEASES_GIL``; the caller must keep
    ``buf`` unchanged until this returns.
    """
    return ByteSpan(buf).extend(crc, 0, None)


class ByteSpan:
    """One C-contiguous array seen as bytes, for checksumming many ranges of it cheaply.

    Holds a reference to the array, so its memory stays valid; looks its
    address up once, so each ``extend`` costs little more than the foreign call.
    ``view`` is a flat ``memoryview`` of the same bytes, for I/O calls.
    """

    __slots__ = ("_array", "_address", "nbytes", "view")

    def __init__(self, buf: np.ndarray) -> None:
        self._array = _as_bytes_view(buf)
        self.nbytes = int(self._array.nbytes)
        self._address = self._array.ctypes.data if _RS is None and _NATIVE is not None else 0
        self.view = memoryview(self._array)

    def extend(self, crc: int, start: int, stop: int | None) -> int:
        """``crc`` extended over bytes ``[start, stop)`` (``stop`` None: to the end)."""
        end = self.nbytes if stop is None else stop
        if not 0 <= start <= end <= self.nbytes:
            raise ValueError(f"byte range [{start}, {stop}) is outside a span of {self.nbytes}")
        if start == end:
            return crc
        if _RS is not None:
            return int(_RS(self.view[start:end], crc))
        if _NATIVE is not None:
            return int(_NATIVE(crc, self._address + start, end - start))
        return int(google_crc32c.extend(crc, self._array[start:end]))


def crc32c_bytes(crc: int) -> bytes:
    """How a crc32c is stored after a zarr chunk: four bytes, little-endian."""
    return int(crc).to_bytes(4, "little")
