"""Content keys for KV blocks.

A block is one full page of tokens. Its key is a 16-byte BLAKE2b digest chained
from its parent's key (the root for the first page) and its own token ids, so
one key names a whole prefix: two blocks with equal keys were computed from the
same tokens after the same prefix under the same root. The root covers
everything else the stored bytes depend on: the KV geometry's fingerprint, the
model's identity and the ``fingerprint()`` of every resource that contributes
one (a resource whose fingerprint is None is left out, as the engine contract
says). Changing any of them changes every key, so a stale block is never hit.

A partial page is never keyed: ``block_keys`` returns one key per full page and
ignores the tail. Keys are plain ``bytes`` (stable across processes and
machines); ``key.hex()`` names the block's object in a shared cold tier.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["KEY_BYTES", "KeyRoot", "block_key", "block_keys", "root_key"]

KEY_BYTES = 16
_ROOT_TAG = b"tiering.blocks/root/v1\0"
_TOKEN_DTYPE = np.dtype("<i8")


def _field(h, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def root_key(
    geometry_fingerprint: str,
    model_id: str,
    resource_fingerprints: Mapping[str, bytes | None] | None = None,
) -> bytes:
    """The root every chain of one cache starts from.

    ``resource_fingerprints`` maps a resource's name to its ``fingerprint()``;
    None values are left out. Fields are length-prefixed and resources sorted
    by name, so no two different inputs share a root by concatenation.
    """
    if not isinstance(geometry_fingerprint, str) or not geometry_fingerprint:
        raise ValueError(
            f"root_key: geometry_fingerprint must be a non-empty str, got {geometry_fingerprint!r}"
        )
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"root_key: model_id must be a non-empty str, got {model_id!r}")
    h = hashlib.blake2b(_ROOT_TAG, digest_size=KEY_BYTES)
    _field(h, geometry_fingerprint.encode())
    _field(h, model_id.encode())
    if resource_fingerprints is not None and not isinstance(
        resource_fingerprints, (Mapping, list, tuple)
    ):
        raise TypeError(
            "root_key: resource_fingerprints must be a mapping of name to fingerprint, got "
            f"{type(resource_fingerprints).__name__}"
        )
    try:
        fps = dict(resource_fingerprints or {})
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"root_key: resource_fingerprints must be (name, fingerprint) pairs ({err})"
        ) from err
    for name in fps:  # before sorting: names of mixed types must be named, not fail to sort
        if not isinstance(name, str) or not name:
            raise ValueError(f"root_key: a resource name must be a non-empty str, got {name!r}")
    for name in sorted(fps):
        fp = fps[name]
        if fp is None:
            continue
        if not isinstance(fp, (bytes, bytearray)):
            raise TypeError(
                f"root_key: fingerprint of resource {name!r} must be bytes or None, got {type(fp).__name__}"
            )
        _field(h, name.encode())
        _field(h, bytes(fp))
    return h.digest()


@dataclass(frozen=True)
class KeyRoot:
    """What a cache's block keys depend on beyond the tokens; ``key`` is the root bytes."""

    geometry_fingerprint: str
    model_id: str
    resource_fingerprints: tuple[tuple[str, bytes], ...] = ()
    page_tokens: int = 16
    key: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (
            not isinstance(self.page_tokens, int)
            or isinstance(self.page_tokens, bool)
            or self.page_tokens < 1
        ):
            raise ValueError(f"KeyRoot.page_tokens must be an int >= 1, got {self.page_tokens!r}")
        pairs = self.resource_fingerprints
        if isinstance(pairs, Mapping):
            pairs = tuple(pairs.items())
        if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
            raise TypeError(
                "KeyRoot.resource_fingerprints must be (name, fingerprint) pairs, got "
                f"{type(pairs).__name__}"
            )
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(
                    f"KeyRoot.resource_fingerprints: each entry must be a (name, fingerprint) pair, got {pair!r}"
                )
        # stored as a tuple of tuples, fingerprints as bytes, so the root is hashable and frozen
        pairs = tuple((n, bytes(fp) if isinstance(fp, bytearray) else fp) for n, fp in pairs)
        object.__setattr__(self, "resource_fingerprints", pairs)
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"KeyRoot.resource_fingerprints names a resource twice: {names}")
        fps = dict(self.resource_fingerprints)
        # the page size changes which tokens a page holds, so it is part of the root too
        fps["\0page_tokens"] = str(self.page_tokens).encode()
        object.__setattr__(self, "key", root_key(self.geometry_fingerprint, self.model_id, fps))

    def keys(self, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """One key per full page of ``token_ids``; a partial last page gets none."""
        return block_keys(self.key, token_ids, self.page_tokens)


def _tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"token ids must be >= 0, got {int(arr.min())}")
    return np.ascontiguousarray(arr, dtype=_TOKEN_DTYPE)


def block_key(parent: bytes, page_token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The key of one full page after ``parent`` (the root for the first page)."""
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise ValueError(f"block_key: parent must be {KEY_BYTES} bytes, got {parent!r}")
    arr = _tokens(page_token_ids)
    if arr.size == 0:
        raise ValueError("block_key: a page must hold at least one token")
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(arr.tobytes())
    return h.digest()


def block_keys(root: bytes, token_ids: Sequence[int] | np.ndarray, page_tokens: int) -> list[bytes]:
    """Chained keys of every full page of ``token_ids`` under ``root``."""
    if not isinstance(root, bytes) or len(root) != KEY_BYTES:
        raise ValueError(f"block_keys: root must be {KEY_BYTES} bytes, got {root!r}")
    if not isinstance(page_tokens, int) or isinstance(page_tokens, bool) or page_tokens < 1:
        raise ValueError(f"block_keys: page_tokens must be an int >= 1, got {page_tokens!r}")
    arr = _tokens(token_ids)
    full = arr.size // page_tokens
    raw = memoryview(arr.tobytes())
    step = page_tokens * _TOKEN_DTYPE.itemsize
    blake = hashlib.blake2b
    keys: list[bytes] = []
    parent = root
    for i in range(full):
        h = blake(parent, digest_size=KEY_BYTES)
        h.update(raw[i * step : (i + 1) * step])
        parent = h.digest()
        keys.append(parent)
    return keys
