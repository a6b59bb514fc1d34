"""Victim ranking for the offload controller: pure functions of candidates.

A policy orders ``Candidate`` records (``rank``) or the same fields as columns,
a ``CandidateBatch`` (``order``); the controller uses the columns, so that
picking victims among 100,000 requests stays a few array operations.

Built-in policies are reached by name through a ``PolicyRegistry``::

    policy = make_policy("priority", resource="kv")

A custom policy is plugged in by registering a factory on a registry and
making it from that registry::

    registry = register_policy("mine", MyPolicy)  # a new registry: built-ins + "mine"
    policy = make_policy("mine", registry=registry, some_option=3)

Registries are immutable values: registering returns a new registry and never
changes the one it started from, so nothing leaks between callers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from policies.base import Candidate, CandidateBatch, OrderCursor, Policy, rank_by
from policies.cost_aware import CostAware
from policies.largest import LargestFirst
from policies.lru import LRU
from policies.priority import Priority

PolicyFactory = Callable[..., Policy]

__all__ = [
    "LRU",
    "Candidate",
    "CandidateBatch",
    "CostAware",
    "LargestFirst",
    "OrderCursor",
    "Policy",
    "PolicyFactory",
    "PolicyRegistry",
    "Priority",
    "default_registry",
    "make_policy",
    "rank_by",
    "register_policy",
]


class PolicyRegistry:
    """An immutable map from policy name to a factory that builds the policy.

    ``make(name, **kwargs)`` calls the factory with ``kwargs``;
    ``with_policy(name, factory)`` returns a new registry that also knows
    ``name``.
    """

    __slots__ = ("_factories",)

    def __init__(self, factories: Mapping[str, PolicyFactory] | None = None) -> None:
        checked: dict[str, PolicyFactory] = {}
        for name, factory in (factories or {}).items():
            _check_entry(name, factory)
            checked[name] = factory
        self._factories = MappingProxyType(checked)

    @property
    def names(self) -> tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._factories))

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def with_policy(self, name: str, factory: PolicyFactory) -> PolicyRegistry:
        """A new registry holding this one's entries plus ``name``; ``name`` must be new."""
        _check_entry(name, factory)
        if name in self._factories:
            raise ValueError(f"policy {name!r} is already registered")
        return PolicyRegistry({**self._factories, name: factory})

    def make(self, name: str, **kwargs: object) -> Policy:
        """Build the policy registered as ``name`` with ``kwargs``."""
        factory = self._factories.get(name)
        if factory is None:
            raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(self.names)}")
        try:
            policy = factory(**kwargs)
        except TypeError as err:
            raise TypeError(f"policy {name!r}: {err}") from err
        if not isinstance(policy, Policy):
            raise TypeError(
                f"policy {name!r}: factory returned {type(policy).__name__}, not a Policy"
            )
        return policy

    def __repr__(self) -> str:
        return f"PolicyRegistry({', '.join(self.names)})"


def _check_entry(name: object, factory: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a policy name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"policy {name!r}: factory {factory!r} is not callable")


def default_registry() -> PolicyRegistry:
    """A fresh registry with the built-ins: "lru", "priority", "largest", "cost"."""
    return PolicyRegistry(
        {"lru": LRU, "priority": Priority, "largest": LargestFirst, "cost": CostAware}
    )


def register_policy(
    name: str, factory: PolicyFactory, registry: PolicyRegistry | None = None
) -> PolicyRegistry:
    """Plug in a custom policy: a new registry = ``registry`` (default: built-ins) + ``name``.

    ``factory(**kwargs)`` must return a ``Policy``. Pass the returned registry
    to ``make_policy`` (or call its ``make``).
    """
    return (registry if registry is not None else default_registry()).with_policy(name, factory)


def make_policy(name: str, registry: PolicyRegistry | None = None, **kwargs: object) -> Policy:
    """Build policy ``name`` from ``registry`` (default: the built-ins) with ``kwargs``.

    Unknown names raise ValueError naming the name and listing the known ones.
    """
    return (registry if registry is not None else default_registry()).make(name, **kwargs)
