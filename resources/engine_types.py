"""Small local stand-ins for the engine types the ``Resource`` contract names.

The engine this product plugs into defines richer versions of these. We keep
only the fields our resources and tests need, with the same names, so that a
resource written against this package reads the same as one written against
the engine.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from tiering.resources.base import Resource


class BucketKey(NamedTuple):
    """A captured batch shape: batch size and tokens per step."""

    bs: int
    num_tokens: int


class AdmitOutcome(NamedTuple):
    """Whether a step may run now; ``reason`` says why not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:  # so `if resource.admit(...)` reads naturally
        return self.ok


ADMIT_OK = AdmitOutcome(True)


@dataclass(frozen=True)
class ResourceReqConfig:
    """Per-request settings a worker hands a resource at ingest.

    ``retention_priority`` (0..100, higher keeps the request's state longer;
    None means the default) and ``retention_expiry_s`` (seconds after ingest
    when the priority stops applying; None means never) are how a serving
    layer tells the KV cache which idle requests it would rather keep.
    """

    retention_priority: float | None = None
    retention_expiry_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = self.retention_priority
        if p is not None:
            _check_real("retention_priority", p, "a number in [0, 100]")
            if not 0.0 <= p <= 100.0:
                raise ValueError(
                    f"ResourceReqConfig.retention_priority must be in [0, 100], got {p!r}")
        e = self.retention_expiry_s
        if e is not None:
            _check_real("retention_expiry_s", e, "a number of seconds > 0")
            if not e > 0.0:
                raise ValueError(
                    f"ResourceReqConfig.retention_expiry_s must be > 0 seconds, got {e!r}")
        if not isinstance(self.extra, Mapping):
            raise TypeError(f"ResourceReqConfig.extra must be a mapping, got {self.extra!r}")


def _check_real(name: str, value: object, what: str) -> None:
    """A real number (Python's or numpy's), never a bool or a str that looks like one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"ResourceReqConfig.{name} must be {what} or None, got {value!r}")


def step_rid(step: object, what: str) -> str:
    """The request id of ``step`` (a ``ResourceStep``); TypeError naming ``what`` for anything
    else, such as a bare request id."""
    rid = getattr(step, "rid", None)
    if not isinstance(rid, str):
        raise TypeError(f"{what}: step must be a ResourceStep (its rid a request id), "
                        f"got {step!r:.80}")
    return rid


#: Retention priority assumed when a request names none (0..100 scale).
DEFAULT_RETENTION = 35.0


def retention_offload_priority(
    retention: float | None, expiry_s: float | None, age_s: float
) -> float:
    """The offload priority a retention priority turns into: ``(100 - p) / 100``.

    A request the serving layer wants kept (high retention) is a poor victim.
    ``p`` is ``retention`` while it applies (no expiry, or ``age_s`` below
    it), else ``DEFAULT_RETENTION``.
    """
    p = DEFAULT_RETENTION
    if retention is not None and (expiry_s is None or age_s < expiry_s):
        p = float(retention)
    return (100.0 - p) / 100.0


@dataclass(frozen=True)
class ResourceStep:
    """One request's share of a step, as the runner hands it to a resource."""

    rid: str
    node_name: str = ""
    graph_walk: str = ""
    num_tokens: int = 0


@dataclass(frozen=True)
class StepContext:
    """What the runner knows about the step as a whole."""

    step_index: int = 0
    plan_results: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeResourceSpec:
    """How a node of the engine's graph asks for a resource to be built."""

    key: str
    resource_class: type[Resource]
    config: Mapping[str, Any] = field(default_factory=dict)
    depends_on: tuple[str, ...] = ()
