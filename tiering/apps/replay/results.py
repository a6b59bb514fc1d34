"""What a replay run records: per-request outcomes, counters and the controller's moves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tiering.apps.replay.config import RunSpec


class Decision(NamedTuple):
    """One move the controller made: ``kind`` is offload, reload, demote or drop."""

    step: int
    at: float
    kind: str
    rid: str


class RequestRecord(NamedTuple):
    """How one request went. Times in simulated seconds; None where it never got there.

    ``status``: "finished" or "rejected" (its KV could never fit).
    ``prefix_tier``: where its reused prefix came from ("device", "host",
    "disk"), None on a miss or without lookup.
    """

    rid: str
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    input_tokens: int
    output_tokens: int
    status: str
    prefix_tier: str | None
    reused_tokens: int


@dataclass
class SimCounters:
    """What the worker counted (the simulator is the only writer).

    ``stalls``: decode steps a request sat out waiting for memory on its way;
    ``forced_recomputes``: KV freed to get out of a state where nothing could
    move; ``reload_wait_s`` / ``prefix_load_wait_s``: summed waits for reloads
    of preempted requests and for reused prefixes to be copied in.
    """

    steps: int = 0
    preemptions: int = 0
    stalls: int = 0
    recomputed_tokens: int = 0
    forced_recomputes: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0  # lookups that reused at least one block
    lookup_tokens: int = 0  # prompt tokens of the requests looked up
    hits_device: int = 0
    hits_host: int = 0
    hits_disk: int = 0
    reused_tokens: int = 0
    lookup_blocks: int = 0  # full prompt blocks of the requests looked up
    reused_tokens_device: int = 0
    reused_tokens_host: int = 0
    reused_tokens_disk: int = 0
    reused_blocks_device: int = 0
    reused_blocks_host: int = 0
    reused_blocks_disk: int = 0
    block_moves_host: int = 0  # cached prefix blocks moved device -> host
    block_moves_disk: int = 0  # ... device or host -> disk
    block_loads: int = 0  # ... host or disk -> device, for a request reusing them
    block_drops: int = 0  # ... dropped (descendants included; not blocks never computed)
    block_refused: int = 0  # blocks the device block policy did not admit
    reload_wait_s: float = 0.0
    prefix_load_wait_s: float = 0.0
    fast_steps: int = 0  # decode-only steps run in the tight loop (``_fast_forward``)
    quiet_safe_points: int = 0  # safe points skipped: nothing had changed since a fruitless one


class Sample(NamedTuple):
    """The state of a run at simulated time ``t``: bytes in use per tier, and the prompt
    tokens looked up and reused (per tier) so far."""

    t: float
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    lookup_tokens: int
    reused_device: int
    reused_host: int
    reused_disk: int


class RunResult(NamedTuple):
    """Everything one run produced; ``metrics.summarize`` turns it into figures."""

    spec: RunSpec
    requests: list[RequestRecord]
    counters: SimCounters
    kv_stats: dict[str, float]
    controller_stats: dict[str, float]
    decisions: list[Decision]
    makespan_s: float
    capacities: dict[str, int]  # page_bytes and device/host/disk bytes of the KV backend
    timeline: list[Sample] = []  # noqa: RUF012 - a NamedTuple default, never mutated
    # per tier and hook of the block policies, when metered (block_guard.HookCost)
    policy_cost: tuple = ()
