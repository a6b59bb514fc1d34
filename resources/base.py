"""The engine's ``Resource`` interface, as this package offers it.

Every method and property keeps the engine's name, signature, default and
meaning, so a resource written here drops into that engine and the engine's
own resources can be driven by our eviction controller. Defaults are the
do-nothing answers: a resource overrides only what it takes part in.

The eviction part is the heart of this product. The worker (our
``EvictionController``), not the resource, knows which requests exist, which
are running and how recently each ran; a resource only answers for its own
state:

- ``supports_eviction``: the resource opts in.
- ``reclaimable(rid)``: what ``offload`` would free now; 0 means "not a
  candidate", however idle the request is.
- ``get_offload_priority(rid)``: higher means more wants it gone; asked only by
  a PRIORITY policy naming this resource.
- ``offload(rid) -> int``: move the request's state off the device and say
  what was reclaimed.
- ``is_offloaded``, ``can_reload``, ``reload(rid) -> bool``: False from
  ``reload`` means it does not fit yet, and nothing changed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from tiering.resources.engine_types import (
    ADMIT_OK,
    AdmitOutcome,
    BucketKey,
    NodeResourceSpec,
    ResourceReqConfig,
    ResourceStep,
    StepContext,
)

__all__ = [
    "ADMIT_OK",
    "AdmitOutcome",
    "AttentionResource",
    "BucketKey",
    "CGSlotKey",
    "CGSlotSpec",
    "CachedPrefix",
    "EngineResourceInfo",
    "KeyedWalks",
    "NodeResourceSpec",
    "PublishedInfo",
    "Resource",
    "ResourceReqConfig",
    "ResourceStep",
    "StepContext",
    "build_resource",
]


@dataclass(frozen=True)
class CGSlotSpec:
    """One graph-capture slot: the batch shape it replays and its config."""

    bucket: BucketKey
    slot: int
    config: Any
    config_idx: int | None = None

    @property
    def bs(self) -> int:
        return self.bucket.bs

    @property
    def num_tokens(self) -> int:
        return self.bucket.num_tokens

    def __str__(self) -> str:
        return f"{self.bucket} slot={self.slot}"


@dataclass(frozen=True)
class CGSlotKey:
    """Identifies a capture slot together with the label it was taken under."""

    bucket: BucketKey
    slot: int
    label: str


@dataclass(frozen=True)
class EngineResourceInfo:
    """Everything the engine can give a resource when building it.

    Passed as one object so a resource picks the fields it needs; asking for a
    field that does not exist fails loudly instead of vanishing in ``**kwargs``.
    """

    device: torch.device
    joint_comm_group: Any = None
    transfer_engine_info: Any = None
    kv_dtype: torch.dtype = torch.bfloat16
    needs_remote_transfer: bool = True
    dependencies: Mapping[str, NodeResourceSpec] = field(default_factory=dict)
    max_rows_in_combined: Mapping[str, int | None] = field(default_factory=dict)
    #: the engine's CUDA compute stream; every copy marker is recorded on it
    compute_stream: Any = None

    def dependency(self, key: str) -> NodeResourceSpec:
        spec = self.dependencies.get(key)
        if spec is None:
            raise KeyError(
                f"resource {key!r} was not resolved; list it in the spec's depends_on"
            )
        return spec


class CachedPrefix(NamedTuple):
    """How many leading inputs of a walk a resource already holds for ``label``,
    and the stream position once they are skipped."""

    label: str
    tokens: int
    position: int


class KeyedWalks(NamedTuple):
    """The walks whose writes a prefix cache keys, and the walks whose sampled
    tokens extend those keys."""

    writes: tuple[str, ...]
    growth: tuple[str, ...] = ()


class PublishedInfo(ABC):
    """Metadata a resource publishes about a request for another worker."""

    @abstractmethod
    def update(self, other: PublishedInfo) -> None: ...

    @abstractmethod
    def clone(self) -> PublishedInfo:
        """An independent copy, safe to send later."""


class Resource(ABC):
    """A per-request piece of engine state (KV cache, sampler, positions...).

    The engine drives a resource through three lifecycles: the request's
    (ingest, admit/plan/commit per step, remove), the engine's (build, graph
    buffers, validation, cleanup), and eviction (below). Each hook's default
    is the answer of a resource that does not take part.
    """

    @classmethod
    @abstractmethod
    def build(cls, spec: NodeResourceSpec, info: EngineResourceInfo) -> Resource: ...

    def depends_on(self) -> set[str]:
        return set()

    def can_capture(self) -> bool:
        return True

    # True when the resource stays correct if a prefix-cache hit skips the
    # front of a request.
    prefix_skip_safe: bool = False

    # -- prefix cache ---------------------------------------------------------

    def enable_prefix_cache(self, root: bytes, walks: dict[str, KeyedWalks] | None = None) -> bool:
        """Open any cross-request store under ``root``; True if one opened."""
        return False

    def resolve_cached_prefix(
        self, rid: str, node_name: str, graph_walk: str, inputs: Any,
    ) -> CachedPrefix | None:
        """How much of the walk's leading input is already held; None abstains."""
        return None

    def apply_cached_prefix(
        self, rid: str, node_name: str, graph_walk: str,
        inputs: Any, prefix: CachedPrefix | None,
    ) -> None:
        """Adopt the prefix all resources agreed to skip (None: there is none)."""
        return

    def extend_prefix_chain(
        self, rid: str, node_name: str, graph_walk: str, outputs: Any,
    ) -> None:
        """Record this step's sampled tokens so generated text can be keyed."""
        return

    @property
    def keys_prefix_chains(self) -> bool:
        """Whether ``extend_prefix_chain`` has work to do now."""
        return False

    def complete_cached_walk(self, rid: str, node_name: str, graph_walk: str) -> None:
        """A walk the cache served entirely, which therefore never admits."""
        return

    def lease_cached_prefix(self, rid: str, node_name: str, graph_walk: str) -> list[int] | None:
        """Rank 0 of a tensor-parallel node: lease the cached prefix's pages."""
        return None

    def adopt_cached_prefix(
        self, rid: str, node_name: str, graph_walk: str, pages: list[int], caught_up: bool,
    ) -> bool:
        """A follower rank takes the same lease; False until it can."""
        return True

    def release_cached_prefix(self, rid: str, node_name: str, graph_walk: str) -> None:
        """Undo a lease for a step that will not run."""
        return

    def page_trail(self) -> tuple[int, int] | None:
        """(allocations made, hash of their pages) for cross-rank checks; None if untracked."""
        return None

    def fingerprint(self) -> bytes | None:
        """What this resource adds to the prefix cache's root; None leaves it out."""
        return None

    # -- request lifecycle ------------------------------------------------------

    def ingest_request(self, rid: str, overrides: ResourceReqConfig | None):
        """Register a request. Must be idempotent: one request may be ingested
        once per partition the worker serves."""
        return

    def ingest_capture_row(self, rid: str):
        """Open a graph-capture padding row; treated as a request by default."""
        self.ingest_request(rid, None)

    def remove_request(self, rid: str):
        return

    def admit_retrieve(
        self, rid: str, node_name: str, graph_walk: str, published: PublishedInfo | None,
    ) -> AdmitOutcome:
        """Start fetching published state (e.g. KV from another worker); says
        whether it has arrived."""
        return ADMIT_OK

    # -- step lifecycle ---------------------------------------------------------

    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        """Reserve what the step needs, or say why it cannot run yet."""
        return ADMIT_OK

    def rollback_admit(self, step: ResourceStep, ctx: StepContext) -> None:
        """Return only what this step's admit freshly took."""
        return

    def plan(self, step: ResourceStep, ctx: StepContext) -> Any:
        """An opaque, immutable plan the runner passes back via ``ctx.plan_results``."""
        return None

    def commit(self, step: ResourceStep, ctx: StepContext) -> None:
        """Record what the step consumed."""
        return

    def publish(self, request_id: str) -> PublishedInfo | None:
        return None

    def publish_for_step(
        self, request_id: str, node_name: str | None, graph_walk: str | None,
    ) -> PublishedInfo | None:
        """Publish after one node step; falls back to ``publish``."""
        del node_name, graph_walk
        return self.publish(request_id)

    def publish_after_stop(
        self, request_id: str, node_name: str | None, graph_walk: str | None,
    ) -> PublishedInfo | None:
        """Publish what matters only once a dynamic loop has stopped."""
        del request_id, node_name, graph_walk
        return None

    def publish_snapshot_batch(
        self, request_ids: list[str], node_name: str | None, graph_walk: str | None,
    ) -> list:
        """One snapshot per request of a step, in order."""
        return [
            self.publish_snapshot_for_step(rid, node_name=node_name, graph_walk=graph_walk)
            for rid in request_ids
        ]

    def publish_snapshot_for_step(
        self, request_id: str, node_name: str | None, graph_walk: str | None,
    ) -> Any:
        """A cheap record of what ``publish_for_step`` would give now."""
        return self.publish_for_step(request_id, node_name=node_name, graph_walk=graph_walk)

    def publish_from_snapshot(
        self, request_id: str, snapshot: Any, node_name: str | None, graph_walk: str | None,
    ) -> PublishedInfo | None:
        """Turn a snapshot into the published info."""
        del request_id, node_name, graph_walk
        return snapshot

    def reset_request(self, rid: str, free: bool = False):
        """Clear a placeholder request used during graph capture."""
        return

    # -- pre-planning -----------------------------------------------------------

    @property
    def supports_preplan(self):
        return False

    @property
    def force_double_buffer(self):
        """True if a host staging buffer this resource reuses could be
        overwritten by the next step's plan before this step's copy retired."""
        return False

    def clear_preplan(self):
        return

    # -- eviction ---------------------------------------------------------------

    @property
    def supports_eviction(self):
        return False

    def is_offloaded(self, rid: str) -> bool:
        return False

    def offload(self, rid: str) -> int:
        """Move the request's state off the device; returns what was reclaimed."""
        return 0

    def reload(self, rid: str) -> bool:
        """Bring the state back; False when it does not fit on the device yet."""
        return True

    def can_reload(self, rid: str) -> bool:
        """False tells the worker not to try; True still needs ``reload``'s answer."""
        return True

    def reclaimable(self, rid: str) -> int:
        """What ``offload`` would free now; 0 means the request is no candidate."""
        return 0

    def get_offload_priority(self, rid: str) -> float:
        """How much this resource wants ``rid`` gone (higher: more)."""
        return 0.0

    # -- engine lifecycle -------------------------------------------------------

    def build_accelerator_graph_buffers(
        self, slots: list[CGSlotSpec], max_bs: int, max_seq_len: int,
    ) -> None:
        """Size buffers read by captured replays; may be called repeatedly and
        must only grow."""
        return

    def post_warmup_validate(self):
        """Raise if state that must agree across ranks does not."""
        return

    def cleanup(self):
        return


class AttentionResource(Resource):
    """A resource called once per layer under a plan label, with label and
    layer cursors so a caller running the whole stack sets them once."""

    _default_label: str = "main"
    _default_layer_idx: int | None = None

    @property
    def default_label(self) -> str:
        return self._default_label

    def set_default_label(self, label: str) -> None:
        self._default_label = label

    def set_default_layer_idx(self, layer_idx: int) -> None:
        self._default_layer_idx = layer_idx

    def reset_default_cursors(self) -> None:
        self._default_label = "main"
        self._default_layer_idx = None


def build_resource(spec: NodeResourceSpec, info: EngineResourceInfo) -> Resource:
    """Build the resource a spec names."""
    return spec.resource_class.build(spec, info)
