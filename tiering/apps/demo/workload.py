"""Synthetic long-context requests for the demo worker, drawn from a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DemoRequest:
    """One request: its prompt (1-D int64 token ids on the CPU), how many tokens
    to generate, and the worker step at which it arrives.

    A continuation (``parent`` set) continues an earlier request's
    conversation: its full prompt is the parent's full prompt, the parent's
    generated tokens and then ``prompt`` (the new user turn), built by the
    worker once the parent has finished; ``context_tokens`` is the length of
    that context (the parent's full prompt plus its generated tokens)."""

    rid: str
    prompt: torch.Tensor
    max_new_tokens: int
    arrival_step: int
    parent: str | None = None
    context_tokens: int = 0

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
        return self.context_tokens + int(self.prompt.numel()) + self.max_new_tokens - 1


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


def conversation_requests(
    count: int,
    seed: int,
    vocab: int,
    *,
    system_prompts: int = 3,
    system_tokens: tuple[int, int] = (96, 320),
    user_tokens: tuple[int, int] = (48, 320),
    new_tokens: tuple[int, int] = (8, 24),
    continue_p: float = 0.45,
    arrival_every: float = 1.0,
    continue_after: int = 6,
) -> list[DemoRequest]:
    """``count`` requests that share system prompts and continue earlier conversations.

    A new conversation is one of ``system_prompts`` shared system prompts
    followed by a user turn; with probability ``continue_p`` a request instead
    continues an earlier request that nobody has continued yet (its prompt is
    just the new user turn; the worker prepends the conversation so far) and
    arrives at least ``continue_after`` requests later. Seeded: the same
    arguments give the same requests."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    if system_prompts < 1:
        raise ValueError(f"system_prompts must be >= 1, got {system_prompts}")
    if not 0.0 <= continue_p <= 1.0:
        raise ValueError(f"continue_p must be in [0, 1], got {continue_p!r}")
    for name, r in (("system_tokens", system_tokens), ("user_tokens", user_tokens),
                    ("new_tokens", new_tokens)):
        _check_range(name, r, 1)
    gen = torch.Generator().manual_seed(int(seed))

    def draw(lo_hi: tuple[int, int]) -> int:
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=gen))

    systems = [torch.randint(0, vocab, (draw(system_tokens),), generator=gen, dtype=torch.long)
               for _ in range(system_prompts)]
    width = len(str(count - 1))
    out: list[DemoRequest] = []
    full: dict[str, int] = {}  # rid -> its full prompt length
    open_ends: list[int] = []  # indices of requests nobody continues yet
    t = 0.0
    for i in range(count):
        rid = f"req-{i:0{width}d}"
        m = draw(new_tokens)
        user = torch.randint(0, vocab, (draw(user_tokens),), generator=gen, dtype=torch.long)
        ready = [j for j in open_ends if i - j >= continue_after]
        if ready and float(torch.rand((), generator=gen)) < continue_p:
            j = ready[int(torch.randint(0, len(ready), (1,), generator=gen))]
            open_ends.remove(j)
            parent = out[j]
            ctx = full[parent.rid] + parent.max_new_tokens
            req = DemoRequest(rid, user, m, int(t), parent=parent.rid, context_tokens=ctx)
        else:
            sp = systems[int(torch.randint(0, system_prompts, (1,), generator=gen))]
            req = DemoRequest(rid, torch.cat([sp, user]), m, int(t))
        full[rid] = req.context_tokens + int(req.prompt.numel())
        out.append(req)
        open_ends.append(i)
        t += arrival_every * float(torch.rand((), generator=gen) * 2.0)
    return out
