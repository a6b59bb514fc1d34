"""The shape of a KV cache page, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    """Model and paging geometry of a KV cache.

    A page holds ``page_tokens`` tokens of K and V for every layer, laid out
    ``[layers, 2, page_tokens, num_kv_heads, head_dim]`` so that one page is one
    contiguous region across layers and a request's pages move in few copies.
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
