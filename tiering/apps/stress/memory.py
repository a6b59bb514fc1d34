"""Resident set size of this process: sampled during a run, and the kernel's peak."""

from __future__ import annotations

import resource
import sys

from tiering._optional import require


def kernel_peak_rss_bytes() -> int:
    """The process's peak RSS as the kernel counts it (KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class RssTracker:
    """Samples the current RSS on demand; remembers the first, last and largest sample."""

    def __init__(self) -> None:
        self._proc = require("psutil", "apps", "tiering stress's memory tracking").Process()
        self.first = self.last = self.peak = self._proc.memory_info().rss
        self.warm: int | None = None

    def mark_warm(self) -> None:
        """Remember the current RSS as the end of warm-up (caches filled, threads started);
        growth after it is what a long run would keep adding."""
        self.warm = self.sample()

    def sample(self) -> int:
        rss = self._proc.memory_info().rss
        self.last = rss
        if rss > self.peak:
            self.peak = rss
        return rss

    def as_dict(self) -> dict[str, int]:
        return {
            "start_bytes": self.first,
            "end_bytes": self.last,
            "peak_sampled_bytes": self.peak,
            "after_warmup_bytes": self.warm if self.warm is not None else self.first,
            "growth_after_warmup_bytes": self.last - (self.warm if self.warm is not None
                                                      else self.first),
            "peak_process_bytes": kernel_peak_rss_bytes(),
        }
