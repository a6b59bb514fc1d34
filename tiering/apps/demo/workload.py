"""Synthetic long-context requests for the demo worker, drawn from a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DemoRequest:
    """One request: its prompt (1-D int64 token ids on the CPU), how many tokens
    to generate, and the worker step at which it arrives."""

    rid: str
    prompt: torch.Tensor
    max_new_tokens: int
    arrival_step: int

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"DemoRequest.rid must be a non-empty str, got {self.rid!r}")
        if self.prompt.dim() != 1 or self.prompt.numel() == 0 or self.prompt.dtype != torch.long:
            raise ValueError(
                f"DemoRequest {self.rid!r}: prompt must be a non-empty 1-D int64 tensor, got "
                f"shape {tuple(self.prompt.shape)} dtype {self.prompt.dtype}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(
                f"DemoRequest {self.rid!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if self.arrival_step < 0:
            raise ValueError(
                f"DemoRequest {self.rid!r}: arrival_step must be >= 0, got {self.arrival_step}"
            )

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the request holds when it finishes (its last token is never fed back)."""
        return int(self.prompt.numel()) + self.max_new_tokens - 1


def _check_range(name: str, lo_hi: tuple[int, int], minimum: int) -> None:
    lo, hi = lo_hi
    if not minimum <= lo <= hi:
        raise ValueError(f"{name} must satisfy {minimum} <= low <= high, got {lo_hi!r}")


def synthetic_requests(
    count: int,
    seed: int,
    vocab: int,
    prompt_tokens: tuple[int, int] = (200, 1500),
    new_tokens: tuple[int, int] = (16, 32),
    arrival_every: float = 1.0,
) -> list[DemoRequest]:
    """``count`` requests with random prompts of random lengths (both ranges
    inclusive) arriving about every ``arrival_every`` steps (seeded jitter).
    The same arguments always give the same requests."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    _check_range("prompt_tokens", prompt_tokens, 1)
    _check_range("new_tokens", new_tokens, 1)
    if not arrival_every >= 0:
        raise ValueError(f"arrival_every must be >= 0, got {arrival_every!r}")
    gen = torch.Generator().manual_seed(int(seed))
    width = len(str(count - 1))
    out = []
    t = 0.0
    for i in range(count):
        n = int(torch.randint(prompt_tokens[0], prompt_tokens[1] + 1, (1,), generator=gen))
        m = int(torch.randint(new_tokens[0], new_tokens[1] + 1, (1,), generator=gen))
        prompt = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.long)
        out.append(DemoRequest(f"req-{i:0{width}d}", prompt, m, int(t)))
        t += arrival_every * float(torch.rand((), generator=gen) * 2.0)
    return out
