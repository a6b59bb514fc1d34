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

__all__ = [
    "AgentConfig",
    "ScanMixConfig",
    "SessionConfig",
    "SynthConfig",
    "agent_chains",
    "loop_chains",
    "scan_chains",
    "scan_mix_chains",
    "session_chains",
    "shift_chains",
    "synthetic_chains",
]


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


# -- more shapes: multi-turn sessions, agents with tools, a scan-heavy mix -----------------
#
# Each generator is seeded and deterministic, returns chains of int block ids (a Mooncake
# trace's ``hash_ids``), and takes a frozen config checked on construction.


def _check_fields(obj: object, ints: tuple[str, ...], fractions: tuple[str, ...],
                  positives: tuple[str, ...]) -> None:
    name = type(obj).__name__
    for f in ints:
        v = getattr(obj, f)
        if not is_int(v) or v < 1:
            raise ValueError(f"{name}.{f} must be an int >= 1, got {v!r}")
    for f in fractions:
        v = getattr(obj, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}.{f} must be a number in [0, 1], got {v!r}")
    for f in positives:
        v = getattr(obj, f)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or v < 1.0):
            raise ValueError(f"{name}.{f} must be a finite number >= 1, got {v!r}")


def _check_exponent(record: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 4.0:
        raise ValueError(f"{record}.zipf must be a number in (0, 4], got {v!r}")


class _Ids:
    """Fresh block ids and the draws every generator shares."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next = 0

    def fresh(self, k: int) -> list[int]:
        out = list(range(self.next, self.next + k))
        self.next += k
        return out

    def geometric(self, mean: float) -> int:
        p = 1.0 / mean
        if p >= 1.0:
            return 1
        return 1 + int(math.log(1.0 - self.rng.random()) / math.log(1.0 - p))

    def zipf(self, n: int, s: float) -> int:
        """An index in [0, n) drawn with weight 1 / (i + 1) ** s."""
        return self.rng.choices(range(n), [1.0 / (i + 1) ** s for i in range(n)])[0]


def _check_n(fn: str, n: object) -> None:
    if not is_int(n) or n < 0:
        raise ValueError(f"{fn}: n must be an int >= 0, got {n!r}")


@dataclass(frozen=True)
class SessionConfig:
    """Multi-turn chat sessions: ``live`` sessions interleave; each turn re-reads the
    whole conversation so far and appends ``turn_blocks_mean`` blocks; a session ends
    after each turn with probability ``end_prob`` and a new one takes its place. A
    turn regenerates the previous answer (branches off one block earlier) with
    probability ``regen_prob``."""

    live: int = 300
    system_blocks: int = 2
    turn_blocks_mean: float = 3.0
    end_prob: float = 0.15
    regen_prob: float = 0.1
    hot_fraction: float = 0.2  # share of the live sessions that take most turns
    hot_weight: float = 4.0  # how much likelier a hot session's turn is

    def __post_init__(self) -> None:
        _check_fields(self, ("live", "system_blocks"), ("end_prob", "regen_prob", "hot_fraction"),
                      ("turn_blocks_mean", "hot_weight"))


def session_chains(n: int, seed: int, config: SessionConfig | None = None) -> list[list[int]]:
    """``n`` requests of interleaved multi-turn sessions (see ``SessionConfig``)."""
    _check_n("session_chains", n)
    cfg = config or SessionConfig()
    ids = _Ids(seed)
    rng = ids.rng
    system = ids.fresh(cfg.system_blocks)
    live = [list(system) for _ in range(cfg.live)]
    hot = max(1, int(cfg.live * cfg.hot_fraction))
    weights = [cfg.hot_weight if i < hot else 1.0 for i in range(cfg.live)]
    chains: list[list[int]] = []
    for _ in range(n):
        i = rng.choices(range(cfg.live), weights)[0]
        conv = live[i]
        if len(conv) > cfg.system_blocks + 1 and rng.random() < cfg.regen_prob:
            conv = conv[:-1]
        chain = conv + ids.fresh(ids.geometric(cfg.turn_blocks_mean))
        chains.append(chain)
        live[i] = list(system) if rng.random() < cfg.end_prob else chain
    return chains


@dataclass(frozen=True)
class AgentConfig:
    """Agents with tools: ``agents`` long shared system prompts (``system_blocks``
    each), each with ``toolsets`` tool descriptions (``tool_blocks``) shared by its
    tasks. A task (agent and tool set by Zipf popularity, exponent ``zipf``) runs
    ``steps_mean`` steps back to back with other tasks interleaved; each step re-reads
    the task so far and appends a tool result of ``result_blocks_mean`` blocks.
    ``live`` tasks run at once."""

    agents: int = 24
    system_blocks: int = 16
    toolsets: int = 6
    tool_blocks: int = 8
    live: int = 150
    steps_mean: float = 8.0
    result_blocks_mean: float = 3.0
    zipf: float = 1.0

    def __post_init__(self) -> None:
        _check_fields(self, ("agents", "system_blocks", "toolsets", "tool_blocks", "live"), (),
                      ("steps_mean", "result_blocks_mean"))
        _check_exponent(type(self).__name__, self.zipf)


def agent_chains(n: int, seed: int, config: AgentConfig | None = None) -> list[list[int]]:
    """``n`` requests of agents stepping through tool calls (see ``AgentConfig``)."""
    _check_n("agent_chains", n)
    cfg = config or AgentConfig()
    ids = _Ids(seed)
    rng = ids.rng
    prefixes = []
    for _ in range(cfg.agents):
        sysp = ids.fresh(cfg.system_blocks)
        prefixes.append([sysp + ids.fresh(cfg.tool_blocks) for _ in range(cfg.toolsets)])

    def new_task() -> list:
        a = ids.zipf(cfg.agents, cfg.zipf)
        t = ids.zipf(cfg.toolsets, cfg.zipf)
        return [prefixes[a][t] + ids.fresh(ids.geometric(4.0)), ids.geometric(cfg.steps_mean)]

    tasks = [new_task() for _ in range(cfg.live)]
    chains: list[list[int]] = []
    for _ in range(n):
        i = rng.randrange(cfg.live)
        chain, left = tasks[i]
        chains.append(chain)
        if left <= 1:
            tasks[i] = new_task()
        else:
            tasks[i] = [chain + ids.fresh(ids.geometric(cfg.result_blocks_mean)), left - 1]
    return chains


@dataclass(frozen=True)
class ScanMixConfig:
    """A reused working set cut by scans. ``hot`` documents of ``hot_blocks`` blocks
    are re-read by Zipf popularity (exponent ``zipf``); with probability
    ``scan_prob`` a request is instead a one-off scan of ``scan_blocks_mean`` new
    blocks (a long upload read once), which a recency order lets flush the hot set."""

    hot: int = 400
    hot_blocks: int = 8
    zipf: float = 0.8
    scan_prob: float = 0.3
    scan_blocks_mean: float = 60.0

    def __post_init__(self) -> None:
        _check_fields(self, ("hot", "hot_blocks"), ("scan_prob",), ("scan_blocks_mean",))
        _check_exponent(type(self).__name__, self.zipf)


def scan_mix_chains(n: int, seed: int, config: ScanMixConfig | None = None) -> list[list[int]]:
    """``n`` requests of a Zipf working set interleaved with one-off scans."""
    _check_n("scan_mix_chains", n)
    cfg = config or ScanMixConfig()
    ids = _Ids(seed)
    rng = ids.rng
    docs = [ids.fresh(cfg.hot_blocks) for _ in range(cfg.hot)]
    weights = [1.0 / (i + 1) ** cfg.zipf for i in range(cfg.hot)]
    order = list(range(cfg.hot))
    rng.shuffle(order)  # popularity is not the order of the ids
    chains: list[list[int]] = []
    for _ in range(n):
        if rng.random() < cfg.scan_prob:
            chains.append(ids.fresh(ids.geometric(cfg.scan_blocks_mean)))
        else:
            d = order[rng.choices(range(cfg.hot), weights)[0]]
            chains.append(docs[d] + ids.fresh(1))
    return chains


# -- adversarial cases ---------------------------------------------------------------------


def loop_chains(n: int, loop_blocks: int, chain_blocks: int = 8) -> list[list[int]]:
    """A cyclic read of ``loop_blocks`` distinct blocks in chains of ``chain_blocks``
    (independent chains, no shared prefix): with a loop slightly larger than the tier,
    recency keeps exactly the blocks read longest ago and never hits."""
    _check_n("loop_chains", n)
    for name, v in (("loop_blocks", loop_blocks), ("chain_blocks", chain_blocks)):
        if not is_int(v) or v < 1:
            raise ValueError(f"loop_chains: {name} must be an int >= 1, got {v!r}")
    starts = range(0, loop_blocks, chain_blocks)  # the last chain may be shorter
    chains = [list(range(s, min(s + chain_blocks, loop_blocks))) for s in starts]
    return [list(chains[i % len(chains)]) for i in range(n)]


def shift_chains(n: int, seed: int, working_blocks: int, at: int,
                 chain_blocks: int = 4) -> list[list[int]]:
    """Zipf reads over a working set of ``working_blocks`` blocks (chains of
    ``chain_blocks``) that is replaced by a disjoint one of the same shape at request
    ``at``: how fast a policy forgets the old set and learns the new one."""
    _check_n("shift_chains", n)
    for name, v in (("working_blocks", working_blocks), ("chain_blocks", chain_blocks)):
        if not is_int(v) or v < 1:
            raise ValueError(f"shift_chains: {name} must be an int >= 1, got {v!r}")
    if not is_int(at) or at < 0:
        raise ValueError(f"shift_chains: at must be an int >= 0, got {at!r}")
    ids = _Ids(seed)
    per = max(1, working_blocks // chain_blocks)
    sets = [[ids.fresh(chain_blocks) for _ in range(per)] for _ in range(2)]
    weights = [1.0 / (i + 1) ** 0.6 for i in range(per)]
    return [list(sets[i >= at][ids.rng.choices(range(per), weights)[0]]) for i in range(n)]


def scan_chains(n: int, seed: int, working_blocks: int, scan_blocks: int, at: int,
                chain_blocks: int = 4) -> list[list[int]]:
    """Zipf reads over a working set, cut at request ``at`` by one scan of
    ``scan_blocks`` new blocks (in chains of 64), then the same working set again:
    whether the scan flushes what will be read again."""
    _check_n("scan_chains", n)
    for name, v in (("working_blocks", working_blocks), ("scan_blocks", scan_blocks),
                    ("chain_blocks", chain_blocks)):
        if not is_int(v) or v < 1:
            raise ValueError(f"scan_chains: {name} must be an int >= 1, got {v!r}")
    if not is_int(at) or at < 0:
        raise ValueError(f"scan_chains: at must be an int >= 0, got {at!r}")
    ids = _Ids(seed)
    per = max(1, working_blocks // chain_blocks)
    work = [ids.fresh(chain_blocks) for _ in range(per)]
    weights = [1.0 / (i + 1) ** 0.6 for i in range(per)]
    out: list[list[int]] = []
    for i in range(n):
        if i == at:
            left = scan_blocks
            while left > 0:
                out.append(ids.fresh(min(64, left)))
                left -= 64
        out.append(list(work[ids.rng.choices(range(per), weights)[0]]))
    return out[:n] if len(out) > n else out
