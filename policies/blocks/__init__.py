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

from collections.abc import Callable, Mapping
from types import MappingProxyType

from policies.blocks.base import BlockInfo, BlockPolicy
from policies.blocks.chain import ChainOdds
from policies.blocks.generic import ARCBlocks, LRUBlocks, S3FIFOBlocks

BlockPolicyFactory = Callable[..., BlockPolicy]

__all__ = [
    "ARCBlocks",
    "BlockInfo",
    "BlockPolicy",
    "BlockPolicyRegistry",
    "ChainOdds",
    "LRUBlocks",
    "S3FIFOBlocks",
    "default_block_registry",
    "make_block_policy",
    "register_block_policy",
]


class BlockPolicyRegistry:
    """An immutable map from block policy name to factory."""

    __slots__ = ("_factories",)

    def __init__(self, factories: Mapping[str, BlockPolicyFactory] | None = None) -> None:
        checked: dict[str, BlockPolicyFactory] = {}
        for name, factory in (factories or {}).items():
            _check_entry(name, factory)
            checked[name] = factory
        self._factories = MappingProxyType(checked)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._factories))

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def with_policy(self, name: str, factory: BlockPolicyFactory) -> BlockPolicyRegistry:
        _check_entry(name, factory)
        if name in self._factories:
            raise ValueError(f"block policy {name!r} is already registered")
        return BlockPolicyRegistry({**self._factories, name: factory})

    def make(self, name: str, **kwargs: object) -> BlockPolicy:
        factory = self._factories.get(name)
        if factory is None:
            raise ValueError(f"unknown block policy {name!r}; known: {', '.join(self.names)}")
        try:
            policy = factory(**kwargs)
        except TypeError as err:
            raise TypeError(f"block policy {name!r}: {err}") from err
        if not isinstance(policy, BlockPolicy):
            raise TypeError(
                f"block policy {name!r}: factory returned {type(policy).__name__}, not a BlockPolicy"
            )
        return policy

    def __repr__(self) -> str:
        return f"BlockPolicyRegistry({', '.join(self.names)})"


def _check_entry(name: object, factory: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a block policy name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"block policy {name!r}: factory {factory!r} is not callable")


def default_block_registry() -> BlockPolicyRegistry:
    """A fresh registry with the built-ins: "lru", "arc", "s3fifo", "chain"."""
    return BlockPolicyRegistry(
        {"lru": LRUBlocks, "arc": ARCBlocks, "s3fifo": S3FIFOBlocks, "chain": ChainOdds}
    )


def register_block_policy(
    name: str, factory: BlockPolicyFactory, registry: BlockPolicyRegistry | None = None
) -> BlockPolicyRegistry:
    return (registry if registry is not None else default_block_registry()).with_policy(
        name, factory
    )


def make_block_policy(
    name: str, registry: BlockPolicyRegistry | None = None, **kwargs: object
) -> BlockPolicy:
    return (registry if registry is not None else default_block_registry()).make(name, **kwargs)
