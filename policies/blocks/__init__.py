"""Block retention policies: which cached KV block leaves a tier first, and which are kept at all.

Pure (no torch, no I/O). Reached by name through a ``BlockPolicyRegistry``::

    policy = make_block_policy("chain", capacity=4000)

Every factory takes ``capacity`` (the tier's size in blocks) as a keyword.
A custom policy subclasses ``BlockPolicy`` and is plugged in with
``register_block_policy(name, factory)``, which returns a new registry; run
``tiering.testing.blocks.check_block_policy`` on it (the contract test every
built-in passes).
"""

from __future__ import annotations

from collections.abc import Callable

from tiering.policies.blocks.adaptive import AdaptiveBlocks, LIRSBlocks
from tiering.policies.blocks.base import BlockInfo, BlockPolicy
from tiering.policies.blocks.chain import ChainOdds
from tiering.policies.blocks.generic import ARCBlocks, LRUBlocks, S3FIFOBlocks
from tiering.policies.registry import Registry, registry_or_default

BlockPolicyFactory = Callable[..., BlockPolicy]

#: The block policy the cache, the replay and the vLLM backend use when none is named.
DEFAULT_BLOCK_POLICY = "adaptive"

__all__ = [
    "ARCBlocks",
    "AdaptiveBlocks",
    "BlockInfo",
    "BlockPolicy",
    "BlockPolicyRegistry",
    "ChainOdds",
    "DEFAULT_BLOCK_POLICY",
    "LIRSBlocks",
    "LRUBlocks",
    "S3FIFOBlocks",
    "default_block_registry",
    "make_block_policy",
    "register_block_policy",
]


class BlockPolicyRegistry(Registry):
    """An immutable map from block policy name to factory (see ``tiering.policies.registry``)."""

    kind = "block policy"
    product = BlockPolicy
    __slots__ = ()


def default_block_registry() -> BlockPolicyRegistry:
    """A fresh registry with the built-ins: "lru", "arc", "s3fifo", "lirs", "chain",
    "adaptive"."""
    return BlockPolicyRegistry(
        {"lru": LRUBlocks, "arc": ARCBlocks, "s3fifo": S3FIFOBlocks, "lirs": LIRSBlocks,
         "chain": ChainOdds, "adaptive": AdaptiveBlocks}
    )


def register_block_policy(
    name: str, factory: BlockPolicyFactory, registry: BlockPolicyRegistry | None = None
) -> BlockPolicyRegistry:
    return _registry(registry, "register_block_policy").with_policy(name, factory)


def make_block_policy(
    name: str, registry: BlockPolicyRegistry | None = None, **kwargs: object
) -> BlockPolicy:
    return _registry(registry, "make_block_policy").make(name, **kwargs)


def _registry(registry: object, caller: str) -> BlockPolicyRegistry:
    """``registry``, or the built-ins when None; anything but a BlockPolicyRegistry is
    refused (a PolicyRegistry would build request policies)."""
    return registry_or_default(registry, BlockPolicyRegistry, default_block_registry, caller,
                               "default_block_registry or register_block_policy")
