"""tiering: a GPU memory-tiering offload manager for long-context LLM serving workers.

The mechanism lives here (pools, transfers, the disk store, pressure sources,
the eviction controller); the KV cache that uses it is ``resources.kv_cache``.
Heavier pieces are imported from their own modules, e.g.
``from tiering.controller import EvictionController``.
"""

from tiering.types import RequestState, Tier

__all__ = ["RequestState", "Tier"]
__version__ = "0.1.0"
