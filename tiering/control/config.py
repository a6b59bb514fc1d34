"""What a controller is configured with and what one of its passes reports."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from tiering.errors import UnknownRequestError  # noqa: F401 (re-exported from its old home)

ON_DISK_FULL_CHOICES = ("keep", "drop")


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"ControllerConfig.{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"ControllerConfig.{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ControllerConfig:
    """Watermarks and timings of the eviction controller.

    ``high`` / ``low``: device occupancy fractions; above ``high`` the
    controller offloads until the projection is under ``low``.
    ``host_high`` / ``host_low``: the same for the host tier, which demotes to
    disk. ``min_residency_s``: a request just reloaded is not offloaded again
    within this. ``reload_headroom``: admission keeps this fraction free below
    ``high``. ``aging_s``: a waiting reload gains one unit of priority per
    ``aging_s`` seconds of waiting, and may be overtaken only while it has
    waited less than that. ``on_disk_full``: what a refused demotion does,
    ``"keep"`` (stay on host) or ``"drop"`` (give the KV up for recompute).
    """

    high: float = 0.90
    low: float = 0.75
    host_high: float = 0.90
    host_low: float = 0.75
    min_residency_s: float = 1.0
    reload_headroom: float = 0.02
    aging_s: float = 10.0
    on_disk_full: str = "keep"

    def __post_init__(self) -> None:
        for name in ("high", "low", "host_high", "host_low", "min_residency_s",
                     "reload_headroom", "aging_s"):
            _check_number(name, getattr(self, name))
        if not 0 < self.high <= 1:
            raise ValueError(f"ControllerConfig.high must be in (0, 1], got {self.high!r}")
        if not 0 < self.low < self.high:
            raise ValueError(
                f"ControllerConfig.low must satisfy 0 < low < high, got low={self.low!r}, "
                f"high={self.high!r}"
            )
        if not 0 < self.host_high <= 1:
            raise ValueError(
                f"ControllerConfig.host_high must be in (0, 1], got {self.host_high!r}"
            )
        if not 0 < self.host_low < self.host_high:
            raise ValueError(
                f"ControllerConfig.host_low must satisfy 0 < host_low < host_high, got "
                f"host_low={self.host_low!r}, host_high={self.host_high!r}"
            )
        for name in ("min_residency_s", "aging_s"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"ControllerConfig.{name} must be >= 0, got {getattr(self, name)!r}"
                )
        if not 0 <= self.reload_headroom < self.high:
            raise ValueError(
                f"ControllerConfig.reload_headroom must satisfy 0 <= reload_headroom < high, "
                f"got {self.reload_headroom!r}"
            )
        if self.on_disk_full not in ON_DISK_FULL_CHOICES:
            raise ValueError(
                f"ControllerConfig.on_disk_full must be one of {ON_DISK_FULL_CHOICES}, "
                f"got {self.on_disk_full!r}"
            )


class EvictionReport(NamedTuple):
    """What one ``evict_if_needed`` call did.

    ``pressure_before``: effective device occupancy at the start of the call
    (reading adjusted for moves it may not show yet). ``projected_after``: the
    same after this call's offloads and reloads. ``offloaded``: one rid per
    offload made (a request spread over several resources may appear more than
    once). ``skipped_running``: known requests passed over because they were
    running (counted only when victims were looked for). Both fractions are
    NaN when the pressure source has no sample yet (nothing was done then).
    """

    pressure_before: float
    projected_after: float
    offloaded: tuple[str, ...]
    bytes_offloaded: int
    demoted: tuple[str, ...]
    dropped: tuple[str, ...]
    reloads_started: tuple[str, ...]
    skipped_running: int
