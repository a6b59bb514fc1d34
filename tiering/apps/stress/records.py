"""What the stress harness keeps about its run: the requests it serves
(``Wanted``), its counters (``HarnessCounts``), the cache subclass that keeps
every transfer result (``RecordingKVCache``), and the disk counters summed over
the caches of a run (``sum_disk_stats``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from tiering.core.counters import counter_record
from tiering.resources.kv_cache import PagedKVCache
from tiering.types import TransferResult


@dataclass
class Wanted:
    """A request the harness is serving; its KV is ``request_kv(seed, rid, generation)``."""

    rid: str
    generation: int
    prompt_tokens: int
    final_tokens: int
    runs_left: int
    arrived_at: int
    tokens: int = 0  # tokens written so far (0 until placed)
    placed: bool = False
    leaving: str | None = None  # why it will leave: finished, cancelled, drained
    away: bool = False  # seen off the device since it was last read back
    asked_at: int | None = None  # step of the first reload request since it was last read
    reused: bool = False  # the id was used before, by a request that left


class RecordingKVCache(PagedKVCache):
    """The real ``PagedKVCache``, keeping every ``TransferResult`` its ``poll`` returns
    (``synchronize`` and the controller's passes poll too) until ``take_results``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._results: list[TransferResult] = []
        super().__init__(*args, **kwargs)

    def poll(self) -> list[TransferResult]:
        done = super().poll()
        self._results.extend(done)
        return done

    def take_results(self) -> list[TransferResult]:
        out, self._results = self._results, []
        return out


HarnessCounts = counter_record(
    "HarnessCounts",
    """steps operations integrity_checks integrity_violations data_errors arrivals finished
    cancelled drained recomputed reads_verified reloads_verified reload_requests
    removed_in_flight removed_offloading removed_demoting removed_reloading
    removed_copies_failed reused reused_while_in_flight reused_reads_verified restarts
    reattached reattach_verified reattach_lost_to_faults restart_recomputed
    second_open_discarded waits steps_at_high""",
    doc="""What the harness did and saw (plain integers). Where a name does not say it all:

    ``removed_copies_failed``: removed requests' copies that ended in a fault.
    ``reused``: arrivals under an id used before.
    ``reused_while_in_flight``: ... while the old request's copy still ran.
    ``reattached``: requests that came back at a restart.
    ``reattach_verified``: ... and were read back bit for bit.
    ``reattach_lost_to_faults``: ... or lost by an injected read fault first.
    ``restart_recomputed``: requests the restart took (device, host) and recomputed.
    ``second_open_discarded``: on-disk requests dropped after a tolerated second open.
    ``steps_at_high``: steps that began their eviction pass at the reload ceiling or above.
    """,
    module=__name__,
)


#: Disk-tier counters that add up over the caches of a run.
_DISK_COUNTERS = ("writes", "reads", "bytes_written", "bytes_read", "refusals", "write_faults",
                  "read_faults", "corruptions", "timeouts", "manifest_faults", "faults")


def sum_disk_stats(retired: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    out = dict(current)
    for k in _DISK_COUNTERS:
        out[k] = int(retired.get(k, 0)) + int(current.get(k, 0))
    errnos = Counter(retired.get("fault_errnos", {}))
    errnos.update(current.get("fault_errnos", {}))
    out["fault_errnos"] = dict(errnos)
    return out
