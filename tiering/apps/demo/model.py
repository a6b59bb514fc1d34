"""A small decoder-only transformer whose attention reads its K and V from a PagedKVCache.

The model exists to give the demo worker real work and real KV bytes: it is
randomly initialised from a seed (no weights are downloaded), uses grouped
query attention (fewer KV heads than query heads), rotary positions, RMSNorm
and a GELU MLP, and decodes greedily.

Each call to ``forward`` handles one request and a run of its tokens (a prefill
chunk or one decode token): it writes the new tokens' K and V of every layer
into the cache with ``write`` and attends over everything the request has
written so far, read back with ``read``. The cache is therefore the only place
the model keeps context between calls; wherever the cache moved the pages in
between (host, disk, back), the model sees the same bytes.

Numerics depend only on the request's own tokens and on the sizes of the runs
it is fed, never on other requests, so the same request fed the same runs gives
bitwise the same logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiering.resources.kv_geometry import KVGeometry


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model. ``q_heads`` must be a multiple of ``kv_heads``."""

    vocab: int = 512
    width: int = 256
    layers: int = 4
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    mlp_hidden: int = 1024
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "layers", "q_heads", "kv_heads", "head_dim", "mlp_hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"ModelConfig.q_heads ({self.q_heads}) must be a multiple of "
                f"kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary positions, "
                             f"got {self.head_dim}")
        if not self.rope_base > 1.0:
            raise ValueError(f"ModelConfig.rope_base must be > 1, got {self.rope_base!r}")
        if not self.norm_eps > 0.0:
            raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"ModelConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")

    def kv_geometry(self, page_tokens: int) -> KVGeometry:
        """The KV cache geometry this model writes, with pages of ``page_tokens`` tokens."""
        return KVGeometry(self.layers, self.kv_heads, self.head_dim, page_tokens, self.dtype)


class _Layer:
    """Weights of one transformer block (plain tensors; the model is never trained)."""

    def __init__(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        def init(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen) / math.sqrt(rows)

        self.attn_norm = 1.0 + 0.1 * torch.randn(cfg.width, generator=gen)
        self.wq = init(cfg.width, cfg.q_heads * cfg.head_dim)
        self.wk = init(cfg.width, cfg.kv_heads * cfg.head_dim)
        self.wv = init(cfg.width, cfg.kv_heads * cfg.head_dim)
        self.wo = init(cfg.q_heads * cfg.head_dim, cfg.width)
        self.mlp_norm = 1.0 + 0.1 * torch.randn(cfg.width, generator=gen)
        self.w_up = init(cfg.width, cfg.mlp_hidden)
        self.w_down = init(cfg.mlp_hidden, cfg.width)

    def to(self, device: torch.device, dtype: torch.dtype) -> _Layer:
        for name, value in vars(self).items():
            setattr(self, name, value.to(device=device, dtype=dtype))
        return self


class TinyDecoder:
    """Decoder-only transformer over a ``PagedKVCache`` (see the module docstring).

    ``seed`` fixes every weight. ``device`` is where weights and activations
    live; it must be the cache's device. Not thread-safe (one worker thread).
    """

    def __init__(self, cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(int(seed))
        dt = cfg.dtype
        self.embed = torch.randn(cfg.vocab, cfg.width, generator=gen).to(self.device, dt)
        self.layers = [_Layer(cfg, gen).to(self.device, dt) for _ in range(cfg.layers)]
        self.final_norm = (1.0 + 0.1 * torch.randn(cfg.width, generator=gen)).to(self.device, dt)
        half = cfg.head_dim // 2
        inv = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
        self._inv_freq = inv.to(self.device, torch.float32)

    def _check_cache(self, kv) -> None:
        g = kv.geometry
        c = self.cfg
        if (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) != (
            c.layers, c.kv_heads, c.head_dim, c.dtype
        ):
            raise ValueError(
                f"cache geometry {g.fingerprint()} does not match the model "
                f"(layers={c.layers}, kv_heads={c.kv_heads}, head_dim={c.head_dim}, "
                f"dtype={c.dtype})"
            )
        if kv.device != self.device:
            raise ValueError(f"cache is on {kv.device}, model on {self.device}")

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
        return x * scale * weight

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary positions on ``x`` ``[tokens, heads, dim]`` (first/second halves paired)."""
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Causal grouped-query attention of ``q`` (tokens from ``start`` on) over ``k``/``v``."""
        n, hq, d = q.shape
        total, hkv, _ = k.shape
        group = hq // hkv
        qg = q.reshape(n, hkv, group, d).permute(1, 2, 0, 3)  # [hkv, group, n, d]
        kt = k.permute(1, 2, 0).unsqueeze(1)  # [hkv, 1, d, total]
        scores = torch.matmul(qg, kt) * (1.0 / math.sqrt(d))  # [hkv, group, n, total]
        if n > 1:
            rows = torch.arange(start, start + n, device=q.device).unsqueeze(1)
            cols = torch.arange(total, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(cols > rows, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))  # [hkv, group, n, d]
        return out.permute(2, 0, 1, 3).reshape(n, hq * d)

    @torch.inference_mode()
    def forward(self, kv, rid: str, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Run ``tokens`` (1-D, positions ``start`` onwards) of request ``rid``.

        The cache must hold exactly ``start + len(tokens)`` allocated tokens for
        ``rid`` (the caller allocates first) with K/V written for the first
        ``start``; this call writes the rest. Returns the logits ``[vocab]`` that
        follow the last token, as float32.

        Batch-invariant by construction: the tokens are run in tiles of one
        cache page aligned to absolute positions (a tile's other rows are
        padding), and each tile attends over exactly the keys up to its end,
        so every operation on a token has the same shape and the same inputs
        however the request was chunked, and whether its prefix was computed
        here or reused from the cache. A token's K/V and logits are therefore
        bitwise the same in every run.
        """
        self._check_cache(kv)
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"forward({rid!r}): tokens must be a non-empty 1-D tensor, "
                             f"got shape {tuple(tokens.shape)}")
        n = int(tokens.numel())
        if kv.num_tokens(rid) != start + n:
            raise ValueError(
                f"forward({rid!r}): cache holds {kv.num_tokens(rid)} tokens, "
                f"expected start + len(tokens) = {start + n}"
            )
        R = kv.geometry.page_tokens
        tokens = tokens.to(self.device)
        logits = None
        pos = start
        end = start + n
        while pos < end:
            tile0 = (pos // R) * R
            take = min(tile0 + R, end) - pos
            logits = self._tile(kv, rid, tokens[pos - start : pos - start + take], pos, tile0, R)
            pos += take
        return logits

    def _tile(self, kv, rid: str, toks: torch.Tensor, pos: int, tile0: int, R: int) -> torch.Tensor:
        """Tokens ``toks`` at positions ``pos..`` inside the tile ``[tile0, tile0 + R)``."""
        c = self.cfg
        lo = pos - tile0
        m = int(toks.numel())
        ids = torch.zeros(R, dtype=torch.long, device=self.device)
        ids[lo : lo + m] = toks
        positions = torch.arange(tile0, tile0 + R, device=self.device, dtype=torch.float32)
        angles = positions.unsqueeze(1) * self._inv_freq.unsqueeze(0)  # [R, half]
        cos = angles.cos().to(c.dtype).unsqueeze(1)
        sin = angles.sin().to(c.dtype).unsqueeze(1)
        x = self.embed.index_select(0, ids)
        keys = tile0 + R  # every tile attends over exactly the keys up to its end
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.attn_norm)
            q = (h @ layer.wq).view(R, c.q_heads, c.head_dim)
            k = (h @ layer.wk).view(R, c.kv_heads, c.head_dim)
            v = (h @ layer.wv).view(R, c.kv_heads, c.head_dim)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            kv.write(rid, i, pos, k[lo : lo + m].contiguous(), v[lo : lo + m].contiguous())
            k_all, v_all = kv.read(rid, i)
            have = pos + m  # written so far (later tiles of this call are not yet)
            k_all, v_all = k_all[: min(have, keys)], v_all[: min(have, keys)]
            if have < keys:  # keys past the last written token are zeros (their weight is exactly 0)
                pad = keys - have
                k_all = torch.cat([k_all, k_all.new_zeros((pad, *k_all.shape[1:]))])
                v_all = torch.cat([v_all, v_all.new_zeros((pad, *v_all.shape[1:]))])
            x = x + self._attend(q, k_all, v_all, tile0) @ layer.wo
            h = self._norm(x, layer.mlp_norm)
            x = x + torch.nn.functional.gelu(h @ layer.w_up) @ layer.w_down
        last = self._norm(x, self.final_norm)
        return (last @ self.embed.t())[lo + m - 1].float()
