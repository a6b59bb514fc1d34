"""The vLLM manager's small types: what a block's state reads as, a request's lookup
window, the counters, the KV events, what the state file holds, and the staging-file
helpers (``_core`` re-exports the types)."""

from __future__ import annotations

import logging
import os
from enum import Enum
from typing import Any, NamedTuple

from tiering.core.counters import counter_record
from tiering.disk import DiskPageStore
from tiering.disk.ledger import DiskExtent
from tiering.types import Tier

__all__ = [
    "MAX_ABSENT",
    "MAX_FETCHES",
    "MAX_LOAD_ROWS",
    "PROMOTED_HOLD_STEPS",
    "RESET_HOLD_STEPS",
    "SHARED_ABSENT_HOLD_S",
    "BlockView",
    "Counters",
    "DiskState",
    "Event",
    "HostState",
    "LoadWindow",
    "Lookup",
    "StoreDecision",
    "clear_staging",
    "manager_state",
    "payload_offset",
    "unlink_staging",
]

log = logging.getLogger("tiering.integrations.vllm._core")  # the manager's one logger


# ----------------------------------------------------------------------------- block state


class HostState(Enum):
    NONE = "none"
    STORING = "storing"  # slot reserved, a worker job is writing it
    PROMOTING = "promoting"  # slot reserved, the manager is reading it from disk
    READY = "ready"


class DiskState(Enum):
    NONE = "none"
    WRITING = "writing"  # demotion in flight (host copy pinned)
    READY = "ready"


class BlockView(NamedTuple):
    """One block as the manager sees it (a snapshot, read from the index and the
    manager's per-tier state; changing it changes nothing)."""

    key: bytes
    host: HostState
    slot: int | None
    disk: DiskState
    extent: DiskExtent | None
    load_pins: int
    from_disk: bool  # its host copy was promoted from disk
    parent: bytes | None
    depth: int


class Lookup(Enum):
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"


class StoreDecision(NamedTuple):
    """Where each accepted key goes: ``slots[i]`` < ``num_slots`` is a host slot; a
    larger value ``num_slots + j`` sends the block straight to disk through row
    ``j`` of the staging file ``staging`` (one per rank: ``f"{staging}.r{rank}"``)."""

    keys_to_store: list[bytes]
    slots: list[int]
    evicted: list[bytes]  # keys that are gone from every tier
    staging: str | None = None


class LoadWindow:
    """One request's lookups, kept by the caller per request (``lookup(key, window)``).

    vLLM looks a request's keys up from its first, every step, until one misses,
    and defers the request while any answers pending; it loads all hits at once.
    So a request may hold at most ``load_budget`` blocks (hits and pending
    answers) in one pass (a key seen again starts a new pass), and once it has
    waited ``load_wait_s`` since its first pending answer, a key not on host
    answers miss. Either way vLLM loads the leading hits and recomputes the rest."""

    __slots__ = ("held", "last", "pending", "seen", "since")

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.last: bytes | None = None  # the key before, in this pass (a fetched block's parent)
        self.held = 0
        self.pending = False  # this pass answered pending at least once
        self.since: float | None = None  # first pending answer of the current wait

    def restart(self) -> None:
        """A key seen again: a new pass begins (the wait goes on only if the last
        pass answered pending)."""
        if not self.pending:
            self.since = None  # the last pass was served without a wait
        self.seen.clear()
        self.held = 0
        self.pending = False
        self.last = None


Counters = counter_record(
    "Counters",
    """lookups host_hits pending_answers stores_started stores_completed stores_failed
    stores_refused stores_not_admitted stores_staged stores_staged_failed
    lookups_over_budget lookups_timed_out shared_published shared_publish_failed
    shared_fetches shared_hits shared_misses shared_unavailable direct_reads_started
    direct_reads_failed loads_from_host loads_from_disk promotions_started
    promotions_ok promotions_failed promotions_deferred promotions_unused demotions_started
    demotions_ok demotions_failed demotions_not_admitted host_evictions disk_evictions dropped
    drops_deferred""",
    doc="""What the manager did, as plain integers. Where a name does not say it all:

    ``stores_refused``: no block of a batch could be placed (every tier full of
    pinned blocks): prepare_store answered None.
    ``stores_staged``: blocks that went straight to disk (no host slot was free, or the
    host's policy refused them and the disk's admitted them).
    ``stores_staged_failed``: of those, blocks whose staging or disk write failed.
    ``lookups_over_budget``: a miss because the request held ``load_budget`` blocks.
    ``lookups_timed_out``: a miss because the request waited ``load_wait_s``.
    ``direct_reads_started`` / ``direct_reads_failed``: disk blocks read (and checked)
    into the load staging file because no host slot was free for them.
    ``shared_published``: blocks written to the shared tier (or found there already).
    ``shared_fetches`` / ``shared_hits``: local misses asked of the shared tier / found
    there, checked and written to disk; ``shared_misses``: not there (or refused by
    its check); ``shared_unavailable``: the shared tier did not answer.
    ``stores_not_admitted``: the host's policy refused the block, and so did the disk's
    (or there is no disk tier): not stored.
    ``loads_from_host``: blocks handed to vLLM whose bytes were stored into host.
    ``loads_from_disk``: blocks handed to vLLM whose bytes were promoted from disk.
    ``promotions_failed``: failed their check or I/O: dropped, recomputed.
    ``promotions_deferred``: no host slot could be freed yet: lookup said pending.
    ``promotions_unused``: promoted, then left host before any load.
    ``demotions_not_admitted``: the disk's policy refused a host victim: dropped, not
    moved down.
    ``dropped``: blocks gone from every tier (orphaned descendants included, and blocks
    not stored because their parent was dropped while they were).
    ``drops_deferred``: a damaged block (or one forgotten by a reset) waited, answering
    miss, for its own or a descendant's job to end.
    """,
    module=__name__,
)


class Event(NamedTuple):
    keys: tuple[bytes, ...]
    tier: str  # "host" or "disk"
    removed: bool


def unlink_staging(staging: str, ranks: int) -> None:
    for r in range(ranks):
        try:
            os.unlink(f"{staging}.r{r}")
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("tiering: removing staging file %s.r%d: %s", staging, r, exc)


def clear_staging(path: str) -> None:
    """Remove this backend's staging files (``store-*.r*``, ``load-*.r*``) from ``path``."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for n in names:
        if n.startswith(("store-", "load-")) and ".r" in n:
            try:
                os.unlink(os.path.join(path, n))
            except OSError:
                pass


def manager_state(m: Any) -> dict[str, Any]:
    """A manager's state as the state file holds it: time, counters, host use, the
    disk blocks (key, chunk, where its payload starts, whether it is on host too),
    the policy and the index's counts. ``m``: a ``TieredBlockManager``."""
    index = m.index
    disk_blocks = []
    for k in index.keys():
        b = m.block(k)
        assert b is not None
        if b.disk is DiskState.READY and b.extent is not None:
            chunk = b.extent.chunks[0]
            disk_blocks.append(
                {"key": k.hex(), "chunk": chunk,
                 "payload_offset": payload_offset(m.disk, chunk),
                 "on_host": b.host is HostState.READY}
            )
    return {
        "time": m.clock(),
        "counters": dict(m.counters.__dict__),
        "host_slots": m.num_slots,
        "host_used": m.pool.used_pages,
        "page_bytes": m.page_bytes,
        "disk_root": m.disk_root,
        "disk_blocks": disk_blocks,
        "policy": m.cfg.policy,
        "index": {
            "blocks": len(index),
            "on_host": index.count(Tier.HOST),
            "on_disk": index.count(Tier.DISK),
            "chained": sum(1 for k in index.keys() if index.get(k).parent is not None),
            "dropped": dict(index.dropped),
        },
    }


def payload_offset(disk: DiskPageStore | None, chunk: int) -> int | None:
    """Where a chunk's payload starts in the disk tier's slot file (None when unknown)."""
    return disk.chunk_offset(chunk) if disk is not None else None


SHARED_ABSENT_HOLD_S = 30.0  # a block the shared tier did not have is not asked again sooner
MAX_ABSENT = 65536  # such blocks remembered
MAX_FETCHES = 64  # fetches from the shared tier in flight
MAX_LOAD_ROWS = 1 << 16  # rows of the load staging file (blocks loaded straight from disk)
PROMOTED_HOLD_STEPS = 16  # steps a promoted, not yet loaded block is not a host victim
# Steps after a reset before the slots of stores and loads that were in flight are
# taken back: vLLM flushes those jobs at the reset and never completes them.
RESET_HOLD_STEPS = 16
