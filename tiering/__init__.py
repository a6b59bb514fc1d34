"""tiering: a GPU memory-tiering offload manager for long-context LLM serving workers.

The front door: ``from tiering import ...`` gives the whole public API.

- ``TieredKV`` / ``TieredKVConfig``: the one object a worker embeds (cache,
  controller, pressure source and policy together).
- The parts, for an engine that drives them itself: ``PagedKVCache``,
  ``KVGeometry``, ``DiskConfig``, ``EvictionController``, ``ControllerConfig``,
  the pressure sources, ``make_policy`` / ``register_policy``.
- The vocabulary: ``Tier``, ``RequestState``, ``Move``, ``TransferResult``.
- Sizes are bytes; ``kib`` / ``mib`` / ``gib`` / ``tib`` write them (``tiering.units``).
- The errors a caller may catch (all defined in ``tiering.errors``).

Names are loaded on first use, so ``import tiering`` stays cheap and the
packages below (``policies``, ``resources``) may import ``tiering.types``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from tiering.errors import __all__ as _ERRORS  # no dependencies: cheap to load

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # the front door
    "TieredKV": "tiering.tiered",
    "TieredKVConfig": "tiering.tiered",
    "Readiness": "tiering.tiered",
    "TieredCache": "tiering.control.protocols",
    # the parts
    "PagedKVCache": "tiering.resources.kv_cache",
    "KVGeometry": "tiering.resources.kv_geometry",
    "ResourceReqConfig": "tiering.resources.base",
    "DiskConfig": "tiering.disk.config",
    "EvictionController": "tiering.control.controller",
    "ControllerConfig": "tiering.control.config",
    "EvictionReport": "tiering.control.config",
    "PoolPressure": "tiering.control.pressure",
    "NvmlPressure": "tiering.control.pressure",
    "TorchCudaPressure": "tiering.control.pressure",
    "PoolAdjustedPressure": "tiering.control.pressure",
    "CompositePressure": "tiering.control.pressure",
    "PressurePoller": "tiering.control.pressure",
    "cache_pressure": "tiering.control.pressure",
    "Policy": "tiering.policies.base",
    "make_policy": "tiering.policies",
    "register_policy": "tiering.policies",
    # sizes in bytes (tiering.units states the convention)
    "kib": "tiering.units",
    "mib": "tiering.units",
    "gib": "tiering.units",
    "tib": "tiering.units",
    # vocabulary
    "Tier": "tiering.types",
    "RequestState": "tiering.types",
    "Move": "tiering.types",
    "TransferResult": "tiering.types",
    # the errors a caller may catch: every one tiering.errors defines
    **dict.fromkeys(_ERRORS, "tiering.errors"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tiering' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
