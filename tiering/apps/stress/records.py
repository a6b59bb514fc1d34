"""What the stress harness keeps about its run: the requests it serves
(``Wanted``), its counters (``HarnessCounts``), the cache subclass that keeps
every transfer result (``RecordingKVCache``), and the disk counters summed over
the caches of a run (``sum_disk_stats``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Any

from resources.kv_cache import PagedKVCache
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


@dataclass
class HarnessCounts:
    """What the harness did and saw (plain integers)."""

    steps: int = 0
    operations: int = 0
    integrity_checks: int = 0
    integrity_violations: int = 0
    data_errors: int = 0
    arrivals: int = 0
    finished: int = 0
    cancelled: int = 0
    drained: int = 0
    recomputed: int = 0
    reads_verified: int = 0
    reloads_verified: int = 0
    reload_requests: int = 0
    removed_in_flight: int = 0
    removed_offloading: int = 0
    removed_demoting: int = 0
    removed_reloading: int = 0
    removed_copies_failed: int = 0  # removed requests' copies that ended in a fault
    reused: int = 0  # arrivals under an id used before
    reused_while_in_flight: int = 0  # ... while the old request's copy still ran
    reused_reads_verified: int = 0
    restarts: int = 0
    reattached: int = 0  # requests that came back at a restart
    reattach_verified: int = 0  # ... and were read back bit for bit
    reattach_lost_to_faults: int = 0  # ... or lost by an injected read fault first
    restart_recomputed: int = 0  # requests the restart took (device, host) and recomputed
    second_open_discarded: int = 0  # on-disk requests dropped after a tolerated second open
    waits: int = 0
    steps_at_high: int = 0  # steps that began their eviction pass at the reload ceiling or above

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
