"""What a stress run does: the cache's sizes, the workload's shape, the faults and how long."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from tiering.apps.stress.faults import FAILING_KINDS, FAULT_KINDS, parse_choices
from tiering.policies import default_registry
from tiering.resources.kv_geometry import KVGeometry

#: Fraction of the device the controller keeps free below ``high`` when admitting reloads.
RELOAD_HEADROOM = 0.02

#: The workload paths a run may add to the basic one (see ``StressConfig.paths``).
PATHS: tuple[str, ...] = ("remove_in_flight", "reuse_ids", "reattach", "second_open")


def parse_paths(text: str) -> tuple[str, ...]:
    """``all``, ``none`` or a comma-separated list of paths -> the paths, in canonical order."""
    return parse_choices(text, PATHS, "paths", "path")


def _default_geometry() -> KVGeometry:
    return KVGeometry(num_layers=4, num_kv_heads=4, head_dim=32, page_tokens=16,
                      dtype=torch.bfloat16)


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"StressConfig.{name} must be an int >= {minimum}, got {value!r}")


def _number(name: str, value: object, *, positive: bool) -> None:
    """A finite number, > 0 when ``positive`` else >= 0; ValueError naming ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (0 < value if positive else 0 <= value)
        or not value < math.inf
    ):
        bound = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"StressConfig.{name} must be {bound}, got {value!r}")


def _known(name: str, value: object, choices: tuple[str, ...], noun: str) -> None:
    """A tuple of some of ``choices``; ValueError naming ``name`` and the unknown ones."""
    if not isinstance(value, tuple):
        raise ValueError(f"StressConfig.{name} must be a tuple, got {value!r}")
    unknown = [k for k in value if k not in choices]
    if unknown:
        raise ValueError(
            f"StressConfig.{name}: unknown {noun}(s) {unknown}; known: {', '.join(choices)}"
        )
    repeated = sorted({k for k in value if value.count(k) > 1})
    if repeated:
        raise ValueError(f"StressConfig.{name}: {noun}(s) given more than once: {repeated}")


def _fraction(name: str, value: object, *, upper_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"StressConfig.{name} must be a finite number, got {value!r}")
    if not 0.0 <= value <= 1.0 or (upper_open and value >= 1.0):
        raise ValueError(f"StressConfig.{name} must lie in [0, 1], got {value!r}")


@dataclass(frozen=True)
class StressConfig:
    """One stress run, validated on construction.

    Length: exactly one of ``steps`` (tests: reproducible amount of work) and
    ``duration_s`` (operators: wall-clock seconds).

    Cache: ``device_pages`` / ``host_pages`` size the two memory tiers;
    ``disk_chunks`` the disk tier, in chunks of ``max_request_pages`` pages, so a
    request's disk copy is exactly one chunk and one chunk operation (which is
    what lets every injected disk fault be tied to one request's outcome).

    Workload: a request arrives with probability ``arrival_rate`` per step
    (while fewer than ``max_live`` are alive), holding a random number of tokens
    up to ``max_request_pages`` pages; it runs 1..``max_runs`` times, growing by
    1..``decode_tokens`` tokens a run up to a random final length, then leaves;
    each step one live request is cancelled with probability ``cancel_rate``. ``batch``
    requests are picked at random each step; resident ones run (and are read
    back and checked), offloaded ones are asked back through the controller.

    Controller: ``high`` / ``low`` and ``host_high`` / ``host_low`` watermarks;
    times are counted in steps (``min_residency_steps``, ``aging_steps``).

    Faults: ``faults`` names the kinds injected (see ``tiering.apps.stress.faults``);
    each strikes an operation it applies to with probability ``fault_rate``;
    a ``slow`` fault waits ``slow_seconds``.

    ``device``: where the device tier lives (``cpu``, ``cuda``, ``cuda:N``).

    Checks: ``check_every_op`` runs the cache's integrity check after every
    operation (tests); otherwise once per step.

    Paths (``paths``, any of ``PATHS``; none by default, all from the CLI):

    - ``remove_in_flight``: requests leave (finish or are cancelled) while their
      offload, demotion or reload is in flight, faults or not, and half the
      cancellations aim at such requests; a fault that strikes a removed
      request's copy is accounted from the cache's ``TransferResult``.
    - ``reuse_ids``: a request that left comes back under the same id with a
      new generation of KV, with probability ``reuse_rate``; one removed with a
      copy in flight is ingested again at once, while that copy still runs.
    - ``reattach``: the disk tier runs with ``on_start="reattach"`` and the
      cache is closed and opened again over the same directory ``restarts``
      times, evenly spread over the run.
    - ``second_open``: at ``second_open_at`` (a fraction of the run) a child
      process tries to open a cache on the live disk directory; it must be
      refused and leave every byte of the directory as it was.
    """

    seed: int = 0
    steps: int | None = None
    duration_s: float | None = None
    faults: tuple[str, ...] = ()
    fault_rate: float = 0.03
    slow_seconds: float = 0.005
    geometry: KVGeometry = field(default_factory=_default_geometry)
    device_pages: int = 40
    host_pages: int = 32
    disk_chunks: int = 40
    max_request_pages: int = 6
    max_live: int = 48
    arrival_rate: float = 0.6
    cancel_rate: float = 0.05
    decode_tokens: int = 4
    max_runs: int = 24
    batch: int = 4
    high: float = 0.6
    low: float = 0.45
    host_high: float = 0.7
    host_low: float = 0.5
    min_residency_steps: float = 2.0
    aging_steps: float = 8.0
    policy: str = "lru"
    device: str = "cpu"
    copy_workers: int = 2
    io_workers: int = 2
    check_every_op: bool = False
    sync_timeout_s: float = 60.0
    paths: tuple[str, ...] = ()
    reuse_rate: float = 0.5
    restarts: int = 2
    second_open_at: float = 0.5
    child_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"StressConfig.seed must be an int >= 0, got {self.seed!r}")
        if (self.steps is None) == (self.duration_s is None):
            raise ValueError("StressConfig needs exactly one of steps and duration_s")
        if self.steps is not None:
            _positive_int("steps", self.steps)
        if self.duration_s is not None:
            _number("duration_s", self.duration_s, positive=True)
        _known("faults", self.faults, FAULT_KINDS, "kind")
        _fraction("fault_rate", self.fault_rate, upper_open=True)
        if self.faults and self.fault_rate == 0:
            raise ValueError("StressConfig.fault_rate must be > 0 when faults are armed")
        if (
            isinstance(self.slow_seconds, bool)
            or not isinstance(self.slow_seconds, (int, float))
            or not 0 <= self.slow_seconds <= 10
        ):
            raise ValueError(
                f"StressConfig.slow_seconds must be in [0, 10], got {self.slow_seconds!r}"
            )
        if not isinstance(self.geometry, KVGeometry):
            raise ValueError(f"StressConfig.geometry must be a KVGeometry, got {self.geometry!r}")
        for name in ("device_pages", "host_pages", "disk_chunks", "max_request_pages",
                     "max_live", "decode_tokens", "max_runs", "batch", "copy_workers", "io_workers"):
            _positive_int(name, getattr(self, name))
        for name in ("arrival_rate", "cancel_rate", "high", "low", "host_high", "host_low"):
            _fraction(name, getattr(self, name))
        if not 0 < self.low < self.high or not 0 < self.host_low < self.host_high:
            raise ValueError(
                "StressConfig watermarks must satisfy 0 < low < high and 0 < host_low < host_high,"
                f" got low={self.low}, high={self.high}, host_low={self.host_low},"
                f" host_high={self.host_high}"
            )
        limit = (self.high - RELOAD_HEADROOM) * self.device_pages
        if self.max_request_pages > limit:
            raise ValueError(
                f"StressConfig.max_request_pages {self.max_request_pages} exceeds what the"
                f" controller admits on reload ({limit:.1f} pages = (high - {RELOAD_HEADROOM}) x device_pages)"
            )
        for name in ("min_residency_steps", "aging_steps"):
            _number(name, getattr(self, name), positive=False)
        _number("sync_timeout_s", self.sync_timeout_s, positive=True)
        if not isinstance(self.device, str) or (
            self.device != "cpu" and re.fullmatch(r"cuda(:\d+)?", self.device) is None
        ):
            raise ValueError(f"StressConfig.device must be cpu, cuda or cuda:N, got {self.device!r}")
        _known("paths", self.paths, PATHS, "path")
        if not isinstance(self.check_every_op, bool):
            raise ValueError(
                f"StressConfig.check_every_op must be a bool, got {self.check_every_op!r}")
        if not isinstance(self.policy, str) or self.policy not in default_registry():
            raise ValueError(
                f"StressConfig.policy must be a built-in policy name "
                f"({', '.join(default_registry().names)}), got {self.policy!r}"
            )
        _fraction("reuse_rate", self.reuse_rate)
        _fraction("second_open_at", self.second_open_at)
        _positive_int("restarts", self.restarts)
        _number("child_timeout_s", self.child_timeout_s, positive=True)

    @property
    def max_tokens(self) -> int:
        """The most tokens one request ever holds."""
        return self.max_request_pages * self.geometry.page_tokens

    def has(self, path: str) -> bool:
        """Whether ``path`` (one of ``PATHS``) is part of this run."""
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; known: {', '.join(PATHS)}")
        return path in self.paths

    @property
    def restart_points(self) -> tuple[float, ...]:
        """Fractions of the run at which a ``reattach`` run restarts its cache."""
        if not self.has("reattach"):
            return ()
        return tuple(k / (self.restarts + 1) for k in range(1, self.restarts + 1))

    @property
    def failing_faults(self) -> tuple[str, ...]:
        """The armed kinds that make an operation fail (all but ``slow``)."""
        return tuple(k for k in self.faults if k in FAILING_KINDS)
