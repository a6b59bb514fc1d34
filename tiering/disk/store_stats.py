"""Counters and checks of ``DiskPageStore``.

``_Counters`` is what the store counts; ``StatsPart`` holds the store's ``stats`` and
``check_integrity``. It is a part of that one class, not an object of its own: it reads
and writes the state ``DiskPageStore.__init__`` sets up, and the contract is in
``tiering.disk.store``'s module docstring. Split out so each file stays readable; the
state stays in one owner.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from tiering.core.counters import counter_record
from tiering.disk.ledger import DiskIntegrityError

_Counters = counter_record(
    "_Counters",
    "writes reads bytes_written bytes_read write_faults read_faults corruptions timeouts"
    " manifest_faults",
    doc="What the store did and what failed; ``errnos`` counts faults by errno name.",
    module=__name__,
    extra=[("errnos", dict[str, int], field(default_factory=dict))],
)


class StatsPart:
    """``DiskPageStore``'s ``stats`` and ``check_integrity`` (see the module docstring)."""

    def check_integrity(self) -> None:
        """Raise DiskIntegrityError unless every chunk is free, held by exactly one live
        extent, or quarantined; the ledger equals the reserved chunks times the chunk
        size and stays under the cap; every committed entry names a live, written
        extent of the same owner."""
        self._ledger.check()
        ledger = self.used_bytes()
        if ledger > self.capacity_bytes:
            raise DiskIntegrityError(f"ledger {ledger} bytes exceeds the cap {self.capacity_bytes}")

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy, as a fresh dict."""
        counts = self._ledger.counts()
        with self._stats_lock:
            c = self._counters
            return {
                "writes": c.writes,
                "reads": c.reads,
                "bytes_written": c.bytes_written,
                "bytes_read": c.bytes_read,
                "refusals": counts["refusals"],
                "write_faults": c.write_faults,
                "read_faults": c.read_faults,
                "corruptions": c.corruptions,
                "timeouts": c.timeouts,
                "manifest_faults": c.manifest_faults,
                "manifest_dirty": self._manifest_dirty,
                "manifest_pending": self._flush_wanted is not None or self._flush_busy,
                "manifest_async": self._flusher is not None,
                "faults": c.write_faults + c.read_faults + c.manifest_faults,
                "fault_errnos": dict(c.errnos),
                "extents": counts["extents"],
                "committed": counts["committed"],
                "quarantined_chunks": counts["quarantined_chunks"],
                "in_flight": counts["in_flight"],
                "used_bytes": counts["used_chunks"] * self.chunk_alloc_bytes,
                "capacity_bytes": self.capacity_bytes,
            }
