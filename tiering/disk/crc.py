"""crc32c over numpy buffers without holding the GIL.

zarr's crc32c codec uses ``google_crc32c``. Its Python binding releases the
GIL only for ``bytes`` objects of 1 MiB or more, so over a numpy array (what
the disk tier checksums) it holds the GIL for the whole pass and two I/O
threads cannot checksum at the same time. The binding is a thin layer over
the C library ``crc32c`` that ships in the same wheel; calling that library's
``crc32c_extend`` through ``ctypes`` (which drops the GIL for the duration of
every foreign call) gives the same checksum with the GIL released.

``crc32c_extend`` uses that route when the library can be found and agrees
with the binding on a self-test at import; otherwise it falls back to the
binding (same values, GIL held). ``RELEASES_GIL`` says which one is in use.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import google_crc32c
import numpy as np

__all__ = ["RELEASES_GIL", "ByteSpan", "crc32c_bytes", "crc32c_extend"]


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
    probe = np.frombuffer(bytes(range(256)) * 17, dtype=np.uint8)[3:]
    try:
        if fn(0, probe.ctypes.data, probe.nbytes) != google_crc32c.value(probe.tobytes()):
            return None
        if fn(0x1234ABCD, probe.ctypes.data, 0) != 0x1234ABCD:
            return None
    except (OSError, ValueError, ctypes.ArgumentError):
        return None
    return fn


_NATIVE = _load_native()
RELEASES_GIL = _NATIVE is not None


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
        self._address = self._array.ctypes.data if _NATIVE is not None else 0
        self.view = memoryview(self._array)

    def extend(self, crc: int, start: int, stop: int | None) -> int:
        """``crc`` extended over bytes ``[start, stop)`` (``stop`` None: to the end)."""
        end = self.nbytes if stop is None else stop
        if not 0 <= start <= end <= self.nbytes:
            raise ValueError(f"byte range [{start}, {stop}) is outside a span of {self.nbytes}")
        if start == end:
            return crc
        if _NATIVE is not None:
            return int(_NATIVE(crc, self._address + start, end - start))
        return int(google_crc32c.extend(crc, self._array[start:end]))


def crc32c_bytes(crc: int) -> bytes:
    """How a crc32c is stored after a zarr chunk: four bytes, little-endian."""
    return int(crc).to_bytes(4, "little")
