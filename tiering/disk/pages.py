"""How a KV page's bytes are seen by the disk tier: rows of unsigned integers.

A page of any dtype (bf16 included, which numpy lacks) is stored as its raw
bytes reinterpreted as unsigned integers of the dtype's width (``uint16`` for
2-byte types, ``uint8`` for widths without a twin), so every bit round-trips.
``PageFormat.rows`` views a batch of pages that way without copying.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_STORAGE_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class PageFormat:
    """One page's shape and element type, and the row layout it is stored in."""

    page_shape: tuple[int, ...]
    torch_dtype: torch.dtype | None  # None where torch has no such dtype
    np_dtype: np.dtype | None  # None where numpy has none (bf16, fp8)
    dtype_name: str
    page_bytes: int
    storage_dtype: np.dtype
    row_elems: int

    @classmethod
    def of(cls, page_shape: tuple[int, ...], dtype: torch.dtype | np.dtype | str) -> PageFormat:
        """Validate ``page_shape`` and ``dtype`` (ValueError naming them) and derive the layout."""
        shape = tuple(page_shape)
        if not shape or not all(_is_int(d) and d > 0 for d in shape):
            raise ValueError(
                f"page_shape must be a non-empty tuple of positive ints, got {page_shape!r}"
            )
        shape = tuple(int(d) for d in shape)
        if isinstance(dtype, torch.dtype):
            torch_dtype: torch.dtype | None = dtype
            try:
                np_dtype: np.dtype | None = torch.empty(0, dtype=dtype).numpy().dtype
            except (TypeError, RuntimeError):
                np_dtype = None
            itemsize, name = dtype.itemsize, str(dtype)
        else:
            try:
                np_dtype = np.dtype(dtype)
            except TypeError as exc:
                raise ValueError(f"dtype {dtype!r} is neither a torch nor a numpy dtype") from exc
            if np_dtype.hasobject or np_dtype.itemsize == 0:
                raise ValueError(f"dtype {np_dtype} cannot be stored as raw page bytes")
            try:
                torch_dtype = torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
            except TypeError:
                torch_dtype = None
            itemsize, name = np_dtype.itemsize, str(np_dtype)
        page_bytes = math.prod(shape) * itemsize
        storage = np.dtype(_STORAGE_DTYPES.get(itemsize, np.uint8))
        return cls(
            shape, torch_dtype, np_dtype, name, page_bytes, storage, page_bytes // storage.itemsize
        )

    def rows(
        self, pages: torch.Tensor | np.ndarray, n: int, name: str, *, writable: bool
    ) -> np.ndarray:
        """View ``pages`` ([n, *page_shape], CPU) as [n, row_elems] of the storage dtype.

        No copy, except that a non-contiguous input that is only read
        (``writable=False``) is made contiguous once. Raises ValueError naming
        ``name`` for a wrong type, dtype, device or shape, or for an output that
        cannot be filled in place.
        """
        expected = (n, *self.page_shape)
        if isinstance(pages, torch.Tensor):
            if self.torch_dtype is None or pages.dtype != self.torch_dtype:
                raise ValueError(
                    f"{name} has dtype {pages.dtype}; this store holds {self.dtype_name}"
                )
            if pages.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor, got device {pages.device}")
            if tuple(pages.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(pages.shape)}; expected {expected}")
            if not pages.is_contiguous():
                if writable:
                    raise ValueError(f"{name} must be contiguous to be filled in place")
                pages = pages.contiguous()
            raw = pages.detach().view(torch.uint8).numpy()
        elif isinstance(pages, np.ndarray):
            if self.np_dtype is None or pages.dtype != self.np_dtype:
                raise ValueError(
                    f"{name} has dtype {pages.dtype}; this store holds {self.dtype_name}"
                )
            if pages.shape != expected:
                raise ValueError(f"{name} has shape {pages.shape}; expected {expected}")
            if not pages.flags.c_contiguous:
                if writable:
                    raise ValueError(f"{name} must be C-contiguous to be filled in place")
                pages = np.ascontiguousarray(pages)
            if writable and not pages.flags.writeable:
                raise ValueError(f"{name} is read-only")
            raw = pages.reshape(-1).view(np.uint8)
        else:
            raise ValueError(
                f"{name} must be a torch.Tensor or numpy.ndarray, got {type(pages).__name__}"
            )
        return raw.reshape(n, self.page_bytes).view(self.storage_dtype)
