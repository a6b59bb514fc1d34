"""KV contents a stress run writes, regenerable from (seed, request id, generation).

Nothing keeps a copy of what was written: the expected bytes of any request
are produced again from its seed whenever they are needed, so the run's
memory does not grow with the data it has moved.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from tiering.resources.kv_geometry import KVGeometry

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def derived_seed(*parts: object) -> int:
    """A 63-bit seed that depends on every part (stable across processes and runs)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def request_kv(
    geometry: KVGeometry, seed: int, rid: str, generation: int, max_tokens: int
) -> torch.Tensor:
    """The KV of one request: ``[max_tokens, layers, 2, heads, dim]``, K at ``[:, l, 0]``.

    A request holding ``n`` tokens holds the first ``n`` rows. The same
    arguments always give the same bits; another ``generation`` (the request
    recomputed after a loss) gives different ones.
    """
    g = geometry
    gen = torch.Generator().manual_seed(derived_seed("kv", seed, rid, generation))
    shape = (max_tokens, g.num_layers, 2, g.num_kv_heads, g.head_dim)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(g.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when both tensors have the same shape, dtype and bit pattern."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        as_int = _INT_OF_WIDTH[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def write_tokens(
    write: Callable[..., None], rid: str, data: torch.Tensor, start: int, end: int
) -> None:
    """Write tokens ``[start, end)`` of ``data`` (from ``request_kv``) for every layer.

    ``write`` has the signature of ``PagedKVCache.write``.
    """
    for layer in range(data.shape[1]):
        write(rid, layer, start, data[start:end, layer, 0], data[start:end, layer, 1])


def mismatched_layers(
    read: Callable[[str, int], tuple[torch.Tensor, torch.Tensor]],
    rid: str,
    data: torch.Tensor,
    num_tokens: int,
) -> list[int]:
    """Read every layer of ``rid`` back (``read`` as ``PagedKVCache.read``) and return
    the layers whose bits differ from the first ``num_tokens`` tokens of ``data``."""
    bad = []
    for layer in range(data.shape[1]):
        k, v = read(rid, layer)
        k, v = k.cpu(), v.cpu()
        if not (
            same_bits(k, data[:num_tokens, layer, 0]) and same_bits(v, data[:num_tokens, layer, 1])
        ):
            bad.append(layer)
    return bad
