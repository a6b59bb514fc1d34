"""Prefix reuse on ``PagedKVCache``: the block store's calls and the engine's prefix hooks.

``PrefixReuse`` opens and owns the cache's ``tiering.resources.kv_prefix.PrefixCache``
and answers the calls on it: publishing, looking up and attaching cached prefix
blocks, the counters, and the engine's prefix hooks. Loading an attached prefix's
blocks is a reload (``kv_transfers``).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from tiering.policies.blocks import DEFAULT_BLOCK_POLICY, default_block_registry
from tiering.resources.base import CachedPrefix
from tiering.resources.kv_options import KVContext
from tiering.resources.kv_prefix import PrefixCache, PrefixHit, as_root

from tiering.blocks import KeyRoot
from tiering.core.validate import is_int, is_number
from tiering.types import IllegalTransition, RequestState, Tier

log = logging.getLogger("tiering.kv_cache")

S = RequestState


class PrefixReuse:
    """The prefix-reuse calls (see the module doc). ``blocks`` is the block store once
    ``enable_prefix_cache`` opened it (None before); this part is its one owner."""

    def __init__(self, ctx: KVContext, owner: str) -> None:
        self._life, self._s, self._clock = ctx.life, ctx.storage, ctx.options.clock
        self._g = self._s.geometry
        self._owner = owner  # how the shared tier's queue names the cache that claims it
        self.blocks: PrefixCache | None = None

    def enable_prefix_cache(self, root, walks=None, *, policy: str = DEFAULT_BLOCK_POLICY,
                            disk_batch_pages: int = 16, shared=None,
                            shared_refresh_s: float = 10.0) -> bool:
        self._life.check_open("enable_prefix_cache")
        del walks
        key = as_root(root)
        self._check_prefix_args(root, policy, disk_batch_pages, shared_refresh_s)
        if self.blocks is not None:
            if self.blocks.root != key:
                raise ValueError("enable_prefix_cache: already enabled under another root")
            if shared is not None and (self.blocks.shared is None
                                       or not self.blocks.shared.same_source(shared)):
                raise ValueError("enable_prefix_cache: already enabled; a shared tier is given at the first call")
            return True
        self.blocks = PrefixCache(self._s, self._clock, self._owner, key, policy,
                                  disk_batch_pages, shared, shared_refresh_s)
        return True

    def _check_prefix_args(self, root, policy, disk_batch_pages, shared_refresh_s) -> None:
        """enable_prefix_cache's arguments, checked before anything is built or compared (a
        second call with bad arguments is refused too, not ignored)."""
        g = self._g
        if isinstance(root, KeyRoot):
            if root.page_tokens != g.page_tokens:
                raise ValueError(f"enable_prefix_cache: the root's page_tokens is {root.page_tokens},"
                                 f" the cache's pages hold {g.page_tokens} tokens")
            if root.geometry_fingerprint != g.fingerprint():
                raise ValueError(f"enable_prefix_cache: the root's geometry_fingerprint is"
                                 f" {root.geometry_fingerprint!r}, the cache's is {g.fingerprint()!r}")
        registry = default_block_registry()
        if not isinstance(policy, str) or policy not in registry:
            raise ValueError(f"enable_prefix_cache: unknown block policy {policy!r};"
                             f" known: {', '.join(registry.names)}")
        if not is_int(disk_batch_pages) or disk_batch_pages < 1:
            raise ValueError(f"enable_prefix_cache: disk_batch_pages must be an int >= 1,"
                             f" got {disk_batch_pages!r}")
        if not is_number(shared_refresh_s) or not 0 < shared_refresh_s < math.inf:
            raise ValueError(f"enable_prefix_cache: shared_refresh_s must be a finite number > 0,"
                             f" got {shared_refresh_s!r}")

    @property
    def prefix_enabled(self) -> bool:
        return self.blocks is not None

    def _prefix_on(self, what: str) -> PrefixCache:
        self._life.check_open(what)
        if self.blocks is None:
            raise RuntimeError(f"{what}: the prefix cache is not enabled (call enable_prefix_cache)")
        return self.blocks

    @staticmethod
    def _token_array(what: str, token_ids) -> np.ndarray:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        arr = np.asarray(token_ids)
        if arr.ndim != 1:
            raise ValueError(f"{what}: token_ids must be one-dimensional, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"{what}: token_ids must be integers, got dtype {arr.dtype}")
        if arr.size and int(arr.min()) < 0:
            raise ValueError(f"{what}: token_ids must be >= 0, got {int(arr.min())}")
        return arr

    def publish_prefix(self, rid: str, token_ids) -> int:
        p = self._prefix_on("publish_prefix")
        r = self._life.get(rid, "publish_prefix")
        arr = self._token_array(f"publish_prefix({rid!r})", token_ids)
        if r.state is not S.RESIDENT or r.prefix_load is not None:
            raise IllegalTransition(
                f"publish_prefix: request {rid!r} is {r.state.value}; it must be resident"
            )
        if r.head:
            raise IllegalTransition(f"publish_prefix: request {rid!r} streams from the host (it is"
                                    " longer than the device); its pages are not published")
        return p.publish(r, arr) * self._g.page_tokens

    def cached_prefix(self, token_ids) -> PrefixHit:
        p = self._prefix_on("cached_prefix")
        return p.lookup(self._token_array("cached_prefix", token_ids))

    def attach_prefix(self, rid: str, token_ids) -> int:
        return self._attach(rid, token_ids)

    def _attach(self, rid: str, token_ids, chain: np.ndarray | None = None) -> int:
        """``attach_prefix``; the block policies are told the request as reading the pages
        of ``chain`` (default ``token_ids``: all it is known to read)."""
        p = self._prefix_on("attach_prefix")
        r = self._life.get(rid, "attach_prefix")
        arr = self._token_array(f"attach_prefix({rid!r})", token_ids)
        if r.state is not S.RESIDENT or r.num_tokens or r.device or r.blocks:
            raise IllegalTransition(
                f"attach_prefix: request {rid!r} already holds tokens; attach only a fresh request"
            )
        r.chain_tokens = arr.tolist()
        n = p.attach(r, arr, chain)
        if r.prefix_load is not None:
            on_host = Tier.HOST in r.prefix_load.tiers
            r.state = S.ON_HOST if on_host else S.ON_DISK  # offloaded for the pages to load
        return n

    def prefix_stats(self) -> dict[str, int]:
        p = self._prefix_on("prefix_stats")
        out = dict(p.stats)
        out["blocks_cached"] = len(p.index)
        for t in Tier:
            out.setdefault(f"hit_tokens_{t.value}", 0)
            out[f"blocks_on_{t.value}"] = p.index.count(t)
        for name in p.shared_counters():
            out.setdefault(name, 0)
        return out

    # the engine's prefix hooks, on the calls above (one rank: no TP lease)

    @property
    def keys_prefix_chains(self) -> bool:
        return self.blocks is not None

    def fingerprint(self) -> bytes | None:
        return self._g.fingerprint().encode()

    def resolve_cached_prefix(self, rid, node_name, graph_walk, inputs) -> CachedPrefix | None:
        self._life.check_open("resolve_cached_prefix")  # a closed cache answers nothing, prefix cache or not
        if self.blocks is None:
            return None
        arr = self._token_array("resolve_cached_prefix", inputs)
        T = self._g.page_tokens
        tokens = min(self.cached_prefix(arr).tokens, max(0, (arr.size - 1) // T) * T)
        return CachedPrefix(graph_walk, tokens, tokens)

    def apply_cached_prefix(self, rid, node_name, graph_walk, inputs, prefix) -> None:
        self._life.check_open("apply_cached_prefix")  # a closed cache answers nothing, prefix cache or not
        if self.blocks is None:
            return
        arr = self._token_array("apply_cached_prefix", inputs)
        r = self._life.get(rid, "apply_cached_prefix")
        if prefix is None or prefix.tokens == 0:
            r.chain_tokens = arr.tolist()
            return
        got = self._attach(rid, arr[: prefix.tokens + 1], arr)
        r.chain_tokens = arr.tolist()
        if got < prefix.tokens:
            log.info("request %r: %d of %d agreed prefix tokens attached", rid, got, prefix.tokens)

    def extend_prefix_chain(self, rid, node_name, graph_walk, outputs) -> None:
        self._life.check_open("extend_prefix_chain")  # a closed cache answers nothing, prefix cache or not
        if self.blocks is None:
            return
        r = self._life.get(rid, "extend_prefix_chain")
        r.chain_tokens.extend(self._token_array("extend_prefix_chain", outputs).tolist())
        if r.state is S.RESIDENT and r.prefix_load is None:
            T = self._g.page_tokens
            n = min(len(r.chain_tokens), r.written_tokens(self._g.num_layers, len(r.blocks) * T))
            self.publish_prefix(rid, r.chain_tokens[:n])

    def complete_cached_walk(self, rid, node_name, graph_walk) -> None:
        self._life.check_open("complete_cached_walk")  # a closed cache answers nothing, prefix cache or not
        return
