"""The shape of a KV cache page, validated once."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    """Model and paging geometry of a KV cache.

    A page holds ``page_tokens`` tokens of K and V for every layer, laid out
    ``[layers, 2, page_tokens, num_kv_heads, head_dim]`` so that one page is one
    contiguous region across layers and a request's pages move in few copies.
    ``dtype``: any dtype whose tensors torch copies and views as bytes (a quantized or
    sub-byte one, such as ``torch.qint8`` or ``torch.int4``, is refused by name).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"KVGeometry.{name} must be a positive int, got {v!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVGeometry.dtype must be a torch.dtype, got {self.dtype!r}")
        why = _cannot_hold_pages(self.dtype)
        if why is not None:
            raise ValueError(
                f"KVGeometry.dtype {self.dtype} cannot hold KV pages: torch cannot copy, "
                f"gather or byte-view tensors of it ({why}); use a plain dtype such as "
                "torch.bfloat16, torch.float16, a float8 or an int")

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_tokens, self.num_kv_heads, self.head_dim)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_tokens

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def fingerprint(self) -> str:
        """A string that changes whenever stored pages would be laid out differently."""
        return (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}"
            f"-T{self.page_tokens}-{str(self.dtype).removeprefix('torch.')}"
        )


#: the dtypes KV is usually kept in, known to hold pages (no probe needed)
_PLAIN_DTYPES = frozenset((torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8))


def _cannot_hold_pages(dtype: torch.dtype) -> str | None:
    """Why tensors of ``dtype`` cannot hold KV pages (a quantized or sub-byte dtype: the
    copies the cache makes raise inside torch), or None when they can: the same
    operations as a write (a slice ``copy_``), a read (``index_select`` over pages) and a
    move (a byte view), run on a tiny pool."""
    if dtype in _PLAIN_DTYPES:
        return None
    try:
        with warnings.catch_warnings():  # a quantized dtype's deprecation notice
            warnings.simplefilter("ignore")
            pool = torch.empty((2, 1, 2, 2, 1, 1), dtype=dtype)
            pool[1, 0, 0, 0:2].copy_(torch.empty((2, 1, 1), dtype=dtype))
            pool[:, 0].index_select(0, torch.tensor([1, 0]))
            pool.view(torch.uint8)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    return None


def parse_device(owner: str, device: object) -> torch.device:
    """``device`` (a str such as ``"cpu"`` / ``"cuda:1"``, or a ``torch.device``) as a
    ``torch.device``; ValueError naming ``owner``'s ``device`` for anything else (a page count
    given in the device position, a name torch does not know)."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise ValueError(f"{owner}: device must be a str or torch.device (such as 'cpu' or"
                         f" 'cuda:0'), got {device!r:.60}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"{owner}: device {device!r:.60} is not a device name torch knows"
                         f" ({str(exc).splitlines()[0][:120]})") from None
