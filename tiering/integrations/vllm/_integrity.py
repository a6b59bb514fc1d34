"""The vLLM manager's integrity check: every part's tables against the block index,
each other, the host slot pool and the disk store's ledger."""

from __future__ import annotations

from typing import Any

from tiering.errors import TableIntegrityError
from tiering.integrations.vllm._cold import ColdFetches
from tiering.integrations.vllm._ctx import Ctx
from tiering.integrations.vllm._disk import DiskTier
from tiering.integrations.vllm._host import HostTier
from tiering.integrations.vllm._protocol import Loads
from tiering.integrations.vllm._reads import DiskReads
from tiering.integrations.vllm._staging import StoreStaging
from tiering.types import Tier

__all__ = ["check_manager"]


def check_manager(ctx: Ctx, host: HostTier, disk: DiskTier, reads: DiskReads,
                  staging: StoreStaging, cold: ColdFetches, loads: Loads) -> None:
    """Raise ``TableIntegrityError`` naming (up to 20 of) the inconsistencies found."""
    problems = []
    index = ctx.index
    try:
        index.check_integrity()
    except AssertionError as exc:
        problems.append(f"block index: {exc}")
    holdings = host.holdings()
    host_ready: set[bytes] = set()
    extents: dict[Any, Any] = {}
    for k in host.storing:
        if k in index:
            problems.append(f"{k.hex()}: storing and already in the index")
    problems += loads.problems()
    for k in index.keys():
        loc = index.location(k)
        info = index.get(k)
        if not (loc is not None and info is not None):
            raise AssertionError(f"block {k.hex()}: listed by the index without a location")
        pins = (loads.pins.get(k, 0) + (1 if k in disk.demoting else 0)
                + (1 if k in reads.row_jobs else 0))
        if info.refs != pins:
            problems.append(f"{k.hex()}: {info.refs} refs, {pins} load/demotion pins")
        if loc.tier is Tier.HOST:
            host_ready.add(k)
            holdings[k] = [loc.handle]
            if loc.moving_to is not None:
                problems.append(f"{k.hex()}: a host block moving to {loc.moving_to.value}")
            ext = disk.copies.get(k)
            if ext is not None:
                if ext in extents:
                    problems.append(f"{k.hex()}: extent {ext} held twice")
                extents[ext] = k
        elif loc.tier is Tier.DISK:
            if loc.handle in extents:
                problems.append(f"{k.hex()}: extent {loc.handle} held twice")
            extents[loc.handle] = k
            if (loc.moving_to is Tier.HOST) != (k in reads.promoting):
                problems.append(f"{k.hex()}: promoting state and job disagree")
            if loc.moving_to is Tier.HOST:
                holdings[k] = [loc.dest_handle]
            if (loads.pins.get(k) and k not in reads.row_of) or k in disk.copies or (
                k in host.from_disk
            ):
                problems.append(f"{k.hex()}: a disk-only block with host-side state")
        else:
            problems.append(f"{k.hex()}: on {loc.tier.value}, which this manager has not")
    problems += staging.problems({*index.keys(), *host.storing}, extents)
    extents.update(cold.extents())
    stray = [k for k in host.fresh if k not in host_ready]
    if stray:
        problems.append(f"{stray[0].hex()}: held as freshly promoted but not on host")
    for name, keys in (("disk copies", disk.copies), ("demotions", disk.demoting),
                       ("promotions", reads.promoting), ("from-disk marks", host.from_disk),
                       ("load pins", loads.pins), ("lost blocks", ctx.lost)):
        stray = [k for k in keys if k not in index]
        if stray:
            problems.append(f"{name} of blocks not in the index: {stray[0].hex()}")
    if not set(disk.demoting) <= set(disk.copies):
        problems.append("a demotion without its disk copy")
    problems += ctx.rules.check()  # each tier's policy tracks exactly its blocks
    if not host.orphaned <= set(host.storing):
        problems.append("an orphaned store that is not in flight")
    unwritten = ({k for k in host_ready if k not in disk.copies}
                 if disk.disk is not None else set())
    if set(disk.unwritten) != unwritten:
        problems.append(f"{len(disk.unwritten)} blocks listed to write down, "
                        f"{len(unwritten)} host blocks without a disk copy")
    try:
        host.pool.check_integrity(holdings)
    except AssertionError as exc:
        problems.append(f"host pool: {exc}")
    problems += reads.problems()
    if disk.disk is not None:
        try:
            disk.disk.check_integrity()
        except AssertionError as exc:
            problems.append(str(exc))
        if disk.disk.used_bytes() < len(extents) * disk.disk.chunk_alloc_bytes:
            problems.append("disk ledger holds fewer chunks than the blocks' extents")
    elif extents:
        problems.append("disk extents without a disk tier")
    if problems:
        raise TableIntegrityError("tiering vLLM manager: " + "; ".join(problems[:20]))
