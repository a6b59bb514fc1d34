"""Tie every injected fault to what it did: a survived failure or a lost request.

Each stress request's disk copy is one chunk, so one request-level disk read or
write is one chunk operation and at most one failing fault strikes it. Copy
faults strike one copy each. The expected outcomes are therefore exact:

- a write fault (``enospc_write``, ``eio_write``) fails a demotion or a
  straight-to-disk offload, and the request stays where it was
  (``demote_failures`` / ``offload_failures``);
- a read fault (``eio_read``, ``corrupt``) loses the request being reloaded,
  with a reason naming the I/O error or the corruption;
- a copy fault fails an offload (device to host) or a reload (host to
  device) and the request stays where it was (``offload_failures`` /
  ``reload_failures``);
- a slow fault delays one operation, observed as one wait.

A fault can also strike the copy of a request that was removed while the copy
ran (``remove_in_flight``). Nothing is lost then: the cache gives the slots
back when the copy ends and reports it as a ``TransferResult`` with
``state=None``; ``removed_fault_kind`` names the fault from its move and
reason, and such faults count as survived.

``account_faults`` compares those request-level outcomes with the injectors'
counts, kind by kind, and with the disk tier's own fault counters.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from tiering.apps.stress.faults import COPY, FAULT_KINDS
from tiering.types import Move

_EIO = f"DiskIOError: [Errno {errno.EIO}]"
_ENOSPC = f"DiskIOError: [Errno {errno.ENOSPC}]"
#: Moves that copy away from the device or host (their faults are d2h copies or disk writes).
WRITE_MOVES = frozenset({Move.OFFLOAD_TO_HOST, Move.OFFLOAD_TO_DISK, Move.DEMOTE})


def removed_fault_kind(move: Move, reason: str) -> str:
    """Which fault kind failed a removed request's copy (``other`` if none explains it)."""
    if "CopyFault:" in reason:
        return COPY
    if move in WRITE_MOVES:
        if move is Move.OFFLOAD_TO_HOST:
            return "other"
        if _ENOSPC in reason:
            return "enospc_write"
        if _EIO in reason:
            return "eio_write"
        return "other"
    if move is Move.RELOAD_FROM_DISK:
        return loss_kind(reason)
    return "other"


def loss_kind(reason: str) -> str:
    """Which fault kind a lost request's reason points at (``other`` if none)."""
    if "DiskCorruptionError:" in reason:
        return "corrupt"
    if _EIO in reason:
        return "eio_read"
    return "other"


class FaultAccount(NamedTuple):
    """Per kind: injected, survived (the request stayed where it was), lost (the request
    was lost with a reason naming that fault) and unaccounted (injected minus the
    other two; zero when everything is explained). ``problems``: cross-checks that
    failed, in words. ``lost_unexplained``: losses (and failed copies of removed
    requests) no injected fault explains. ``on_removed``: per kind, the survived
    faults that struck the copy of a request removed while it ran."""

    injected: dict[str, int]
    survived: dict[str, int]
    lost: dict[str, int]
    unaccounted: dict[str, int]
    problems: tuple[str, ...]
    lost_unexplained: int
    on_removed: dict[str, int] | None = None  # of ``survived``: faults on removed requests' copies

    @property
    def balanced(self) -> bool:
        return not self.problems and not any(self.unaccounted.values())


def account_faults(
    *,
    injected: Mapping[str, int],
    copy_injected: Mapping[str, int],
    slow_waits: int,
    kv_stats: Mapping[str, float],
    disk_stats: Mapping[str, object],
    lost_reasons: Iterable[str],
    removed_failures: Iterable[tuple[Move, str]] = (),
) -> FaultAccount:
    """Match injected faults with outcomes once every transfer has settled.

    ``injected``: per kind (``copy`` both directions together);
    ``copy_injected``: per direction (``d2h``, ``h2d``); ``slow_waits``: waits the
    slow faults performed; ``kv_stats``: ``PagedKVCache.stats.as_dict()``;
    ``disk_stats``: ``DiskPageStore.stats()``; ``lost_reasons``: every reason
    ``take_lost`` returned; ``removed_failures``: (move, reason) of every failed
    copy of a request removed while it ran (``TransferResult`` with ``state=None``).
    """
    lost = dict.fromkeys(FAULT_KINDS, 0)
    unexplained = 0
    for reason in lost_reasons:
        kind = loss_kind(reason)
        if kind == "other":
            unexplained += 1
        else:
            lost[kind] += 1

    errnos = disk_stats.get("fault_errnos", {})
    assert isinstance(errnos, Mapping)
    disk_write_faults = int(disk_stats.get("write_faults", 0))  # type: ignore[arg-type]
    disk_read_faults = int(disk_stats.get("read_faults", 0))  # type: ignore[arg-type]
    disk_corruptions = int(disk_stats.get("corruptions", 0))  # type: ignore[arg-type]
    enospc = int(errnos.get("ENOSPC", 0))
    # failed copies of removed requests: no counter of the cache names them
    removed = dict.fromkeys(FAULT_KINDS, 0)
    removed_writes = removed_reload_copies = 0
    for move, reason in removed_failures:
        kind = removed_fault_kind(move, reason)
        if kind == "other":
            unexplained += 1
            continue
        removed[kind] += 1
        if move in WRITE_MOVES:
            removed_writes += 1
        elif kind == COPY:
            removed_reload_copies += 1
    offload_f = int(kv_stats["offload_failures"]) + removed_writes
    demote_f = int(kv_stats["demote_failures"])
    reload_f = int(kv_stats["reload_failures"]) + removed_reload_copies

    survived = dict.fromkeys(FAULT_KINDS, 0)
    # the split between the two write kinds is the disk tier's errno of each failed write
    survived["enospc_write"] = enospc
    survived["eio_write"] = disk_write_faults - enospc
    # request-level failures that no disk write explains are copy failures
    survived[COPY] = offload_f + demote_f - disk_write_faults + reload_f
    survived["slow"] = slow_waits
    # a read fault that struck a removed request's reload lost nothing
    survived["eio_read"] = removed["eio_read"]
    survived["corrupt"] = removed["corrupt"]

    inj = {k: int(injected.get(k, 0)) for k in FAULT_KINDS}
    unaccounted = {k: inj[k] - survived[k] - lost[k] for k in FAULT_KINDS}

    problems = []
    d2h, h2d = int(copy_injected.get("d2h", 0)), int(copy_injected.get("h2d", 0))
    if offload_f + demote_f != d2h + inj["enospc_write"] + inj["eio_write"]:
        problems.append(
            f"offload_failures {offload_f} + demote_failures {demote_f} (removed requests' failed "
            f"writes included) != device-to-host copy "
            f"faults {d2h} + write faults {inj['enospc_write'] + inj['eio_write']}"
        )
    if reload_f != h2d:
        problems.append(f"reload_failures {reload_f} (removed requests' failed copies included) "
                        f"!= host-to-device copy faults {h2d}")
    if disk_read_faults != inj["eio_read"] + inj["corrupt"]:
        problems.append(
            f"disk read faults {disk_read_faults} != injected read faults "
            f"{inj['eio_read'] + inj['corrupt']}"
        )
    if disk_corruptions != inj["corrupt"]:
        problems.append(f"disk corruptions {disk_corruptions} != injected corruptions")
    if unexplained:
        problems.append(
            f"{unexplained} request(s) lost, or removed copies failed, for a reason no "
            "injected fault explains"
        )
    for counter in ("timeouts", "manifest_faults"):
        n = int(disk_stats.get(counter, 0))  # type: ignore[arg-type]
        if n:
            problems.append(f"disk {counter}: {n} (none were injected)")
    return FaultAccount(inj, survived, lost, unaccounted, tuple(problems), unexplained, removed)
