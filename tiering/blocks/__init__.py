"""Content-addressed KV blocks: keys, the block index, block replay and Belady's optimum.

Tensor-free: the index records where each block is (opaque per-tier handles),
who maps it and what retention policies read; the caller copies the bytes.
"""

from tiering.blocks.index import BlockIndex, BlockLocation, Dropped, PrefixMatch
from tiering.blocks.keys import KEY_BYTES, KeyRoot, block_key, block_keys, root_key

__all__ = [
    "KEY_BYTES",
    "BlockIndex",
    "BlockLocation",
    "Dropped",
    "KeyRoot",
    "PrefixMatch",
    "block_key",
    "block_keys",
    "root_key",
]
