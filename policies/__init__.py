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

from collections.abc import Callable

from tiering.policies.base import Candidate, CandidateBatch, OrderCursor, Policy, rank_by
from tiering.policies.cost_aware import CostAware
from tiering.policies.largest import LargestFirst
from tiering.policies.lru import LRU
from tiering.policies.priority import Priority
from tiering.policies.registry import Registry, registry_or_default

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
    "Registry",
    "register_policy",
]


class PolicyRegistry(Registry):
    """An immutable map from policy name to a factory that builds the policy.

    ``make(name, **kwargs)`` calls the factory with ``kwargs``;
    ``with_policy(name, factory)`` returns a new registry that also knows
    ``name``.
    """

    kind = "policy"
    product = Policy
    __slots__ = ()


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
    return _registry(registry, "register_policy").with_policy(name, factory)


def make_policy(name: str, registry: PolicyRegistry | None = None, **kwargs: object) -> Policy:
    """Build policy ``name`` from ``registry`` (default: the built-ins) with ``kwargs``.

    Unknown names raise ValueError naming the name and listing the known ones.
    """
    return _registry(registry, "make_policy").make(name, **kwargs)


def _registry(registry: object, caller: str) -> PolicyRegistry:
    """``registry``, or the built-ins when None; anything but a PolicyRegistry is refused."""
    return registry_or_default(registry, PolicyRegistry, default_registry, caller,
                               "default_registry or register_policy")
