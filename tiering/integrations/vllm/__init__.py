"""A drop-in KV offload backend for vLLM (0.32 or newer): host and disk tiers, and
optionally the cold tier every engine of a deployment shares (``shared``).

Enable it with::

    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {
                            "spec_name": "TieredOffloadingSpec",
                            "spec_module_path": "tiering.integrations.vllm",
                            "host_bytes": 4 << 30, "disk_path": "/nvme/kv", "disk_bytes": 64 << 30}}

Only ``TieredOffloadingSpec`` (and the classes next to it in ``_spec``) needs vLLM;
it is imported on first access, so the engine-independent core (``_core``) can
be used and tested without vLLM installed. The ``policy`` extra-config field
names one of the registered block policies (``tiering.policies.blocks``: adaptive,
arc, chain, lirs, lru, s3fifo; default ``DEFAULT_BLOCK_POLICY``, adaptive).
docs/vllm.md lists every option.
"""

from __future__ import annotations

from typing import Any

from tiering._optional import MissingExtra
from tiering.integrations.vllm._core import (
    BlockView,
    TieredBlockManager,
    TieredConfig,
    TieredMover,
)

_VLLM_NAMES = (
    "TieredOffloadingSpec",
    "TieredOffloadingManager",
    "TieredOffloadingWorker",
    "TieredLoadStoreSpec",
)

__all__ = [
    "BlockView",
    "TieredBlockManager",
    "TieredConfig",
    "TieredMover",
    *_VLLM_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _VLLM_NAMES:
        try:
            from tiering.integrations.vllm import _spec
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "vllm":
                raise
            raise MissingExtra(
                "vllm", "vllm", f"tiering.integrations.vllm.{name} (the vLLM offload backend)"
            ) from exc
        return getattr(_spec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
