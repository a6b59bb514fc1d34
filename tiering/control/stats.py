"""Counters the eviction controller keeps, and their plain-dict form.

One ``ControllerStats`` belongs to one controller, which is the only writer.
Byte totals per link say which way the bytes went: an offload is counted
device->host unless the resource reports the request on disk right after
``offload`` returns; a reload is counted by the tier ``tier_of`` reported just
before it (host->device when the resource does not say).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(slots=True)
class ControllerStats:
    evict_calls: int = 0
    offloads: int = 0
    bytes_offloaded: int = 0
    offload_refusals: int = 0  # offload() returned 0 for a candidate
    make_room_offloads: int = 0  # offloads made so a long-waiting reload fits
    demotions: int = 0
    bytes_demoted: int = 0
    drops: int = 0
    bytes_dropped: int = 0
    disk_full_keeps: int = 0
    reloads_started: int = 0
    bytes_reloaded: int = 0
    reload_refusals: int = 0  # request_reload calls that had to wait
    reload_resource_refusals: int = 0  # admitted, but the resource's reload() said no
    max_wait_s: float = 0.0  # longest wait of a reload that has started
    skipped_running: int = 0
    scans_skipped: int = 0  # victim scans not repeated: a finding of no candidate still held
    vanished_skips: int = 0  # hook calls that failed for a request gone or changed; logged
    transfers_reported: int = 0  # completion records taken from poll()
    bytes_device_to_host: int = 0
    bytes_device_to_disk: int = 0
    bytes_host_to_disk: int = 0
    bytes_host_to_device: int = 0
    bytes_disk_to_device: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


#: stats() keys that only ever grow (exported as counters); every other key is a
#: figure of the moment (exported as a gauge).
COUNTER_KEYS: frozenset[str] = frozenset(
    f.name for f in fields(ControllerStats) if f.name != "max_wait_s"
)
