"""A seeded synthetic conversation trace: chains of block ids, as a Mooncake trace's ``hash_ids``.

Three kinds of request, all opening with one of a few shared system prompts
(picked by a Zipf-like popularity):

- a new conversation: the system prompt and a geometric number of new blocks;
- a continuation: the whole previous prompt of that conversation except its
  last (partial) block, then new blocks. After turn k a conversation continues
  with probability ``min(cont_max, cont_first + cont_step * (k - 1))``, after a
  log-normal gap (in requests);
- a one-off: the system prompt and new blocks, never continued.

``synthetic_chains(n, seed)`` is deterministic for a given seed and parameters.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from tiering.core.validate import is_int

__all__ = ["SynthConfig", "synthetic_chains"]


@dataclass(frozen=True)
class SynthConfig:
    system_prompts: int = 4
    system_blocks: tuple[int, int] = (1, 3)  # min, max blocks of a system prompt
    one_off_fraction: float = 0.35
    new_blocks_mean: float = 8.0  # mean new blocks per turn (geometric)
    cont_first: float = 0.35
    cont_step: float = 0.12
    cont_max: float = 0.75
    gap_median: float = 400.0  # requests between turns
    gap_sigma: float = 0.9

    def __post_init__(self) -> None:
        if not is_int(self.system_prompts):
            raise ValueError(f"SynthConfig.system_prompts must be an int, got {self.system_prompts!r}")
        if not (isinstance(self.system_blocks, tuple) and len(self.system_blocks) == 2
                and all(is_int(v) for v in self.system_blocks)):
            raise ValueError(
                f"SynthConfig.system_blocks must be a (min, max) pair of ints, got {self.system_blocks!r}"
            )
        for name in ("one_off_fraction", "new_blocks_mean", "cont_first", "cont_step",
                     "cont_max", "gap_median", "gap_sigma"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"SynthConfig.{name} must be a finite number, got {v!r}")
        if self.system_prompts < 1:
            raise ValueError(f"SynthConfig.system_prompts must be >= 1, got {self.system_prompts}")
        lo, hi = self.system_blocks
        if not 1 <= lo <= hi:
            raise ValueError(
                f"SynthConfig.system_blocks must be 1 <= min <= max, got {self.system_blocks}"
            )
        for name in ("one_off_fraction", "cont_first", "cont_max"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"SynthConfig.{name} must be in [0, 1), got {v}")
        if self.cont_step < 0:
            raise ValueError(f"SynthConfig.cont_step must be >= 0, got {self.cont_step}")
        if self.new_blocks_mean < 1:
            raise ValueError(
                f"SynthConfig.new_blocks_mean must be >= 1, got {self.new_blocks_mean}"
            )
        if self.gap_median < 1 or self.gap_sigma < 0:
            raise ValueError(
                f"SynthConfig.gap_median must be >= 1 and gap_sigma >= 0, got {self.gap_median}, {self.gap_sigma}"
            )


def synthetic_chains(n: int, seed: int, config: SynthConfig | None = None) -> list[list[int]]:
    """``n`` requests' chains of block ids."""
    if not is_int(n) or n < 0:
        raise ValueError(f"synthetic_chains: n must be an int >= 0, got {n!r}")
    cfg = config or SynthConfig()
    rng = random.Random(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + k))
        next_id += k
        return out

    def geometric(mean: float) -> int:
        p = 1.0 / mean
        return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p)) if p < 1 else 1

    prompts = [fresh(rng.randint(*cfg.system_blocks)) for _ in range(cfg.system_prompts)]
    weights = [1.0 / (i + 1) for i in range(cfg.system_prompts)]
    due: list[tuple[int, int, list[int], int]] = []  # (request index, seq, chain, turn)
    seq = 0
    chains: list[list[int]] = []
    for i in range(n):
        if due and due[0][0] <= i:
            _, _, prev, turn = heapq.heappop(due)
            chain = prev[:-1] + fresh(geometric(cfg.new_blocks_mean) + 1)
        else:
            sysp = rng.choices(prompts, weights)[0]
            chain = sysp + fresh(geometric(cfg.new_blocks_mean))
            turn = 0
            if rng.random() < cfg.one_off_fraction:
                chains.append(chain)
                continue
        turn += 1
        chains.append(chain)
        p = min(cfg.cont_max, cfg.cont_first + cfg.cont_step * (turn - 1))
        if rng.random() < p:
            gap = max(1, int(cfg.gap_median * math.exp(cfg.gap_sigma * rng.gauss(0.0, 1.0))))
            seq += 1
            heapq.heappush(due, (i + gap, seq, chain, turn))
    return chains
