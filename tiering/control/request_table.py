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
        "host_capacity", "host_used", "disk_used", "demote", "drop",
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
            and self.poll is not None  # a demotion in flight is settled by its record
        )


class RequestTable:
    """The live requests, one slot each, with their per-request columns: the one
    membership table of a controller.

    ``slot`` maps a rid to its slot; ``names[rid]`` is every resource it was
    registered with; ``rid_at``, ``last_used``, ``reloaded_at`` (when its last
    reload was admitted, NaN if none is still exempting it) and ``live`` are
    numpy columns indexed by slot, and ``member[name]`` says which slots are
    registered with the evicting resource ``name``. A scan of every request
    for victims is then array slicing, not a walk over dicts. Slots of removed
    requests are reused; ``end`` is one past the highest slot used. ``version``
    grows by one whenever a request is added, removed or registered with one
    more resource. Owned by one controller, which is the only writer.
    """

    __slots__ = ("slot", "names", "rid_at", "last_used", "reloaded_at", "live", "member",
                 "end", "version", "exempt", "_free")

    def __init__(self, names: Iterable[str], capacity: int = 64) -> None:
        self.slot: dict[str, int] = {}
        self.names: dict[str, frozenset[str]] = {}
        self.rid_at = np.empty(capacity, dtype=object)
        self.last_used = np.zeros(capacity, dtype=np.float64)
        self.reloaded_at = np.full(capacity, np.nan, dtype=np.float64)
        self.live = np.zeros(capacity, dtype=bool)
        self.member = {name: np.zeros(capacity, dtype=bool) for name in names}
        self.end = 0
        self.version = 0
        self.exempt = 0  # how many slots have a reloaded_at (not NaN)
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.slot)

    def __contains__(self, rid: object) -> bool:
        return rid in self.slot

    def add(self, rid: str, now: float) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = self.end
            if slot == len(self.live):
                self._grow(2 * slot)
            self.end = slot + 1
        self.slot[rid] = slot
        self.names[rid] = frozenset()
        self.rid_at[slot] = rid
        self.last_used[slot] = now
        self.live[slot] = True
        self.version += 1
        return slot

    def register(self, rid: str, names: frozenset[str]) -> None:
        """``rid`` (already added) is now registered with ``names`` (all of them so far)."""
        slot = self.slot[rid]
        self.names[rid] = names
        for name, column in self.member.items():
            column[slot] = name in names
        self.version += 1

    def remove(self, rid: str) -> None:
        slot = self.slot.pop(rid)
        del self.names[rid]
        self.rid_at[slot] = None
        self.live[slot] = False
        self.clear_reload(slot)
        for column in self.member.values():
            column[slot] = False
        self._free.append(slot)
        self.version += 1

    def mark_reload(self, rid: str, now: float) -> None:
        """A reload of ``rid`` was admitted at ``now`` (it is exempt from offload a while)."""
        slot = self.slot[rid]
        if self.reloaded_at[slot] != self.reloaded_at[slot]:  # NaN: not exempt yet
            self.exempt += 1
        self.reloaded_at[slot] = now

    def clear_reload(self, slot: int) -> None:
        if self.reloaded_at[slot] == self.reloaded_at[slot]:
            self.exempt -= 1
            self.reloaded_at[slot] = np.nan

    def exempt_mask(self, now: float, min_residency_s: float) -> np.ndarray | None:
        """Slots still within their minimum residency (bool, up to ``end``), or None if
        none is; exemptions that ran out are cleared."""
        if not self.exempt:
            return None
        at = self.reloaded_at[: self.end]
        with np.errstate(invalid="ignore"):
            ran_out = now - at >= min_residency_s
        if ran_out.any():
            for slot in np.flatnonzero(ran_out).tolist():
                self.clear_reload(slot)
        if not self.exempt:
            return None
        return ~np.isnan(at)

    def earliest_exemption(self) -> float | None:
        """When the earliest exemption in force began, or None."""
        if not self.exempt:
            return None
        return float(np.nanmin(self.reloaded_at[: self.end]))

    def members_of(self, name: str) -> list[str]:
        """The rids registered with the evicting resource ``name``, by slot."""
        return self.rid_at[np.flatnonzero(self.member[name][: self.end])].tolist()

    def _grow(self, capacity: int) -> None:
        def grown(column: np.ndarray) -> np.ndarray:
            fill = None if column.dtype == object else (
                np.nan if column is self.reloaded_at else 0)
            bigger = np.full(capacity, fill, column.dtype)
            bigger[: len(column)] = column
            return bigger

        self.rid_at = grown(self.rid_at)
        self.last_used = grown(self.last_used)
        self.reloaded_at = grown(self.reloaded_at)
        self.live = grown(self.live)
        self.member = {name: grown(column) for name, column in self.member.items()}

    def check_integrity(self) -> None:
        """The dict and the columns agree; raise AssertionError naming what does not."""
        end = self.end
        live = np.flatnonzero(self.live[:end]).tolist()
        if sorted(self.slot.values()) != live:
            raise AssertionError(f"live slots {live} differ from the rids' slots")
        if set(self.names) != set(self.slot):
            raise AssertionError("registered names and slots cover different requests")
        for rid, slot in self.slot.items():
            if self.rid_at[slot] != rid:
                raise AssertionError(f"slot {slot} holds {self.rid_at[slot]!r}, not {rid!r}")
            for name, column in self.member.items():
                if bool(column[slot]) != (name in self.names[rid]):
                    raise AssertionError(f"request {rid!r}: membership of {name!r} disagrees")
        dead = ~self.live[:end]
        if any(column[:end][dead].any() for column in self.member.values()):
            raise AssertionError("a free slot is still a member of a resource")
        exempt = int((~np.isnan(self.reloaded_at[:end])).sum())
        if exempt != self.exempt or (~np.isnan(self.reloaded_at[:end][dead])).any():
            raise AssertionError(f"{exempt} exemptions in the column, {self.exempt} counted")
        if set(self._free) & set(live) or len(self._free) + len(live) != end:
            raise AssertionError("free list and live slots do not partition the table")


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
