"""The vLLM manager's tiers on the block store's rules (``tiering.resources.kv_prefix_rules``).

``TieredBlockManager`` makes every block-policy decision through one ``BlockRules``, the
object the cache's ``PrefixCache`` and the replay's ``PrefixBlocks`` own: each tier's
policy is told a request once (``tell``), a block arriving on the host is admitted by
the host's policy (``admits``; a block vLLM stores, which the index does not hold
yet, with its ``depth`` given), a host victim is the host policy's (``victim``) and moves
to disk when the disk's policy admits it, else it is dropped with its descendants, a
disk victim is dropped, and every arrival, move and drop is told through ``moved``,
``arrived`` and ``dropped``.

What vLLM's offloading API changes, and so what differs from the cache:

- vLLM owns the device tier (its GPU prefix cache). The rules' device policy is
  ``VllmDevice``: it tracks no block and ignores what it hears. A request's blocks
  that vLLM holds on the GPU (the chain above a load or a store batch) are told as
  device hits; no publish is offered to a device policy (vLLM computes and keeps
  those blocks itself).
- A request is told at its first ``prepare_load`` or ``prepare_store`` (vLLM hands
  the manager no prompt): its chain is the blocks the index links above that batch,
  then the batch.
- A load copies a host block to the GPU and leaves it on the host (vLLM keeps the
  GPU copy itself): no ``landed``.
- Copies are vLLM's jobs or the manager's I/O threads, never on the step path. A host
  block is written to disk ahead of its eviction (``demote_headroom``), oldest arrival
  first, without asking any policy; when the block leaves the host, the disk's
  policy decides whether it moves down (its copy kept) or is dropped. A host victim
  whose copy is not written yet is passed over (it cannot leave now) and the next
  victim is asked (``victim(..., skip=...)``). Disk room for a copy is made when the copy is
  written, so under disk pressure disk victims leave earlier than in the cache.
- A block vLLM stores under a parent that leaves while it is being stored is not
  stored (in the cache a block leaves with its ancestors); a parent the index never
  held (vLLM keeps it on the GPU) makes the block a chain's first.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence

from tiering.blocks import BlockIndex
from tiering.policies.blocks import BlockPolicy
from tiering.policies.blocks.base import BlockInfo
from tiering.resources.kv_prefix_rules import BlockRules
from tiering.types import Tier

__all__ = ["VllmDevice", "manager_rules"]


class VllmDevice(BlockPolicy):
    """The device tier's policy in the manager's rules: vLLM keeps those blocks, so this
    one tracks none, admits everything and offers no victim."""

    name = "vllm-device"

    def on_commit(self, keys: Sequence[Hashable], hits: Sequence[Hashable],
                  depths: Sequence[int], get: Callable[[Hashable], BlockInfo],
                  now: float) -> None:
        return

    def on_insert(self, info: BlockInfo, now: float) -> None:
        raise ValueError(f"vllm-device: block {info.key!r} inserted, but vLLM keeps the "
                         "device tier")

    def on_hit(self, info: BlockInfo, now: float) -> None:
        return

    def on_remove(self, key: Hashable) -> None:
        raise ValueError(f"vllm-device: block {key!r} removed, but vLLM keeps the device tier")

    def victims(self, now: float) -> Iterator[Hashable]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __contains__(self, key: object) -> bool:
        return False


def manager_rules(index: BlockIndex, host: BlockPolicy, disk: BlockPolicy | None) -> BlockRules:
    """The rules of a manager over ``index`` with these host and disk policies (no disk
    tier: ``None``, a ``VllmDevice`` stands in and is never asked)."""
    return BlockRules(index, {Tier.DEVICE: VllmDevice(), Tier.HOST: host,
                              Tier.DISK: disk if disk is not None else VllmDevice()})
