"""The controller's view of resources and requests: hooks looked up once, and
the live requests kept in numpy columns so that scans are array slicing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


class ResourceHandle:
    """One resource as the controller drives it, with its optional hooks looked up once."""

    __slots__ = (
        "name", "resource", "evicts", "reclaimable", "offload", "priority", "is_offloaded",
        "can_reload", "reload", "reload_bytes", "tier_of", "poll", "device_capacity",
        "host_capacity", "host_used", "disk_used", "demote", "drop", "demoting",
        "reclaimable_many", "priority_many", "destination_of",
    )

    def __init__(self, name: str, resource: Any) -> None:
        self.name = name
        self.resource = resource
        self.evicts = bool(getattr(resource, "supports_eviction", False))
        self.reclaimable_many = self.priority_many = None
        if self.evicts:
            self.reclaimable_many = getattr(resource, "reclaimable_many", None)
            self.priority_many = getattr(resource, "get_offload_priority_many", None)
            self.reclaimable = resource.reclaimable
            self.offload = resource.offload
            self.priority = resource.get_offload_priority
            self.is_offloaded = resource.is_offloaded
            self.can_reload = resource.can_reload
            self.reload = resource.reload
        self.reload_bytes = getattr(resource, "reload_bytes", None)
        self.tier_of = getattr(resource, "tier_of", None)
        self.destination_of = getattr(resource, "offload_destination", None)
        self.poll = getattr(resource, "poll", None)
        cap = getattr(resource, "device_capacity_bytes", None)
        self.device_capacity = int(cap) if cap is not None else None
        host_cap = getattr(resource, "host_capacity_bytes", None)
        self.host_capacity = int(host_cap) if host_cap is not None else None
        self.host_used = getattr(resource, "host_used_bytes", None)
        self.disk_used = getattr(resource, "disk_used_bytes", None)
        self.demote = getattr(resource, "demote", None)
        self.drop = getattr(resource, "drop", None)
        self.demoting: dict[str, int] = {}  # demotions in flight: rid -> host bytes

    @property
    def room_gauges(self) -> tuple:
        """The hooks that report the bytes in use below the device (host, disk), if offered.

        What ``reclaimable`` answers may depend on room in those tiers (an
        offload needs somewhere to go), so a change in them can change the answers.
        """
        return tuple(g for g in (self.host_used, self.disk_used) if g is not None)

    @property
    def cascades(self) -> bool:
        """Whether this resource takes part in the host -> disk cascade."""
        return (
            self.evicts
            and self.host_capacity is not None
            and self.host_capacity > 0
            and self.host_used is not None
            and self.demote is not None
            and self.tier_of is not None
            and self.reload_bytes is not None
        )


class RequestTable:
    """The live requests, one slot each, with their per-request columns.

    ``slot`` maps a rid to its slot; ``rid_at``, ``last_used`` and ``live``
    are numpy columns indexed by slot, and ``member[name]`` says which slots
    are registered with the evicting resource ``name``. A scan of every
    request for victims is then array slicing, not a walk over dicts. Slots of
    removed requests are reused; ``end`` is one past the highest slot used.
    Owned by one controller, which is the only writer.
    """

    __slots__ = ("slot", "rid_at", "last_used", "live", "member", "end", "_free")

    def __init__(self, names: Iterable[str], capacity: int = 64) -> None:
        self.slot: dict[str, int] = {}
        self.rid_at = np.empty(capacity, dtype=object)
        self.last_used = np.zeros(capacity, dtype=np.float64)
        self.live = np.zeros(capacity, dtype=bool)
        self.member = {name: np.zeros(capacity, dtype=bool) for name in names}
        self.end = 0
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.slot)

    def add(self, rid: str, now: float) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = self.end
            if slot == len(self.live):
                self._grow(2 * slot)
            self.end = slot + 1
        self.slot[rid] = slot
        self.rid_at[slot] = rid
        self.last_used[slot] = now
        self.live[slot] = True
        return slot

    def remove(self, rid: str) -> None:
        slot = self.slot.pop(rid)
        self.rid_at[slot] = None
        self.live[slot] = False
        for column in self.member.values():
            column[slot] = False
        self._free.append(slot)

    def members_of(self, name: str) -> list[str]:
        """The rids registered with the evicting resource ``name``, by slot."""
        return self.rid_at[np.flatnonzero(self.member[name][: self.end])].tolist()

    def _grow(self, capacity: int) -> None:
        def grown(column: np.ndarray) -> np.ndarray:
            bigger = np.full(capacity, None if column.dtype == object else 0, column.dtype)
            bigger[: len(column)] = column
            return bigger

        self.rid_at = grown(self.rid_at)
        self.last_used = grown(self.last_used)
        self.live = grown(self.live)
        self.member = {name: grown(column) for name, column in self.member.items()}


def bytes_answer(name: str, rid: str, value: object) -> int:
    """One ``reclaimable`` answer as an int (<= 0: nothing to reclaim); raise if not an int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"resource {name!r}: reclaimable({rid!r}) returned {value!r}; expected an int"
        )
    if value >= 2**63:
        raise ValueError(
            f"resource {name!r}: reclaimable({rid!r}) returned {value!r}; expected < 2**63"
        )
    return int(value)


def bytes_answers(name: str, rids: list[str], values: object) -> np.ndarray:
    """Many ``reclaimable`` answers as int64 (<= 0: nothing to reclaim); raise if not ints."""
    answers = np.asarray(values)
    if answers.shape != (len(rids),):
        raise ValueError(
            f"resource {name!r}: got reclaimable answers of shape {answers.shape} "
            f"for {len(rids)} requests"
        )
    if answers.dtype.kind not in "iu" or (answers.dtype.kind == "u" and len(answers) and
                                          int(answers.max()) >= 2**63):
        checked = [
            bytes_answer(name, rid, value)
            for rid, value in zip(rids, answers.tolist(), strict=True)
        ]
        return np.array(checked, dtype=np.int64)
    return answers.astype(np.int64, copy=False)
