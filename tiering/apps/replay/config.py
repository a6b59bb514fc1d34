"""What a replay run is configured with: the simulated engine and the run's mode."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tiering.apps.replay.policy_spec import PolicySpec
from tiering.control.controller import ControllerConfig
from tiering.policies.blocks import DEFAULT_BLOCK_POLICY

MODES = ("tiering", "recompute", "no-tiering")
MAKE_ROOM = ("drop", "offload")
PREEMPT = ("latest", "policy")


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine.

    ``max_batch``: requests in the batch (prefilling or decoding) at most.
    ``max_step_tokens``: tokens one step processes at most (one per decoding
    request, the rest prefill chunks). ``page_tokens``: tokens per KV page.
    ``prefix_reuse``: retain finished prompts and reuse shared prefixes
    (needs a trace with block ids). ``block_tokens``: tokens per block id.
    ``preempted_retention``: the retention priority (0..100) a live request
    carries; the KV cache turns it into the offload priority a ``priority``
    policy reads. ``preempt``: which request of the batch a tiering run pauses
    when a decoding request cannot grow and no memory is on its way:
    ``latest``, the latest-arrived (vLLM's rule; the default), or ``policy``,
    the first in the run's policy's order over the requests of the batch it
    could offload (see ``simulator._Worker._policy_victim``; equal ranks go as
    the policy breaks ties). The baselines
    have no policy and always pause the latest-arrived.
    ``sample_every_s``: simulated seconds between two samples of the timeline
    (occupancy per tier and hits so far). ``make_room``: what the scheduler
    does with cached prefix blocks on the device when it needs room at once:
    with tiering, ``offload`` them (the default) in the block policy's order a
    tier down while one has room (the books change at once, the copy occupies
    the link), else drop them; or ``drop`` them all. The baselines have no tier
    below and always drop. ``block_policy``: the block retention policy (a name of
    ``tiering.policies.blocks``, default ``adaptive``) of every tier's cached prefix
    blocks, made per tier with ``capacity`` (its size in blocks) and
    ``block_policy_options``. ``block_decisions``: the decision log also holds every
    move down and drop of a cached block (most of a long run's records; the CLI keeps
    them only for ``--decisions``). ``batch_hooks``: the block store calls the block
    policies' batch hooks (False: their per-event hooks one by one; the same run).
    ``disk_batch_blocks``: the most cached blocks one host -> disk copy packs (the cache's
    ``enable_prefix_cache(disk_batch_pages=)``, whose blocks are one page each; its
    default, 16).
    """

    max_batch: int = 64
    max_step_tokens: int = 8192
    page_tokens: int = 16
    prefix_reuse: bool = True
    block_tokens: int = 512
    preempted_retention: float = 80.0
    sample_every_s: float = 1.0
    make_room: str = "offload"
    block_policy: str = DEFAULT_BLOCK_POLICY
    block_policy_options: tuple[tuple[str, Any], ...] = ()
    preempt: str = "latest"
    block_decisions: bool = True
    batch_hooks: bool = True
    disk_batch_blocks: int = 16

    def __post_init__(self) -> None:
        for name in ("block_decisions", "batch_hooks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SimConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.block_policy, str) or not self.block_policy:
            raise ValueError(f"SimConfig.block_policy must name a block policy, "
                             f"got {self.block_policy!r}")
        opts = self.block_policy_options
        if not isinstance(opts, tuple) or not all(
            isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str) and o[0]
            for o in opts
        ):
            raise ValueError("SimConfig.block_policy_options must be a tuple of (name, value) "
                             f"pairs, got {opts!r}")
        if not isinstance(self.prefix_reuse, bool):
            raise ValueError(f"SimConfig.prefix_reuse must be a bool, got {self.prefix_reuse!r}")
        if not isinstance(self.preempt, str) or self.preempt not in PREEMPT:
            raise ValueError(f"SimConfig.preempt must be one of {PREEMPT}, got {self.preempt!r}")
        if self.make_room not in MAKE_ROOM:
            raise ValueError(f"SimConfig.make_room must be one of {MAKE_ROOM}, "
                             f"got {self.make_room!r}")
        v = self.sample_every_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
            math.isfinite(v) and v > 0
        ):
            raise ValueError(f"SimConfig.sample_every_s must be a finite number > 0, got {v!r}")
        _check_int("SimConfig", "max_batch", self.max_batch, 1)
        _check_int("SimConfig", "max_step_tokens", self.max_step_tokens, 1)
        _check_int("SimConfig", "page_tokens", self.page_tokens, 1)
        _check_int("SimConfig", "block_tokens", self.block_tokens, 1)
        _check_int("SimConfig", "disk_batch_blocks", self.disk_batch_blocks, 1)
        if self.max_step_tokens < self.max_batch:
            raise ValueError(
                f"SimConfig.max_step_tokens ({self.max_step_tokens}) must be >= max_batch "
                f"({self.max_batch}): every decoding request needs a token per step"
            )
        v = self.preempted_retention
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 100:
            raise ValueError(f"SimConfig.preempted_retention must be a number in [0, 100], "
                             f"got {v!r}")


@dataclass(frozen=True)
class RunSpec:
    """What to run: a ``mode`` (see ``MODES``) and, for ``tiering``, the policy
    (a registry name or a ``module:Class`` path), its keyword options and the
    controller's configuration. The policy makes every retention decision of
    the run (see ``tiering.apps.replay.retention``); the controller's host
    watermarks say when the host demotes, to disk, what the policy picks."""

    mode: str = "tiering"
    policy: str = "lru"
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    policy_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"RunSpec.mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"RunSpec.policy must name a policy, got {self.policy!r}")
        if not isinstance(self.controller, ControllerConfig):
            raise TypeError("RunSpec.controller must be a ControllerConfig")
        # normalised (sorted pairs) and checked by PolicySpec
        object.__setattr__(self, "policy_options", self.policy_spec.options)

    @property
    def policy_spec(self) -> PolicySpec:
        return PolicySpec(self.policy, self.policy_options)

    @property
    def label(self) -> str:
        return self.policy_spec.label if self.mode == "tiering" else self.mode
