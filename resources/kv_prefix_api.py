"""Prefix reuse on ``PagedKVCache``: the block store's calls and the engine's prefix hooks.

``KVPrefixReuse`` is the cache's face of ``tiering.resources.kv_prefix.PrefixCache``
(publishing, looking up and attaching cached prefix blocks, and loading the
blocks of an attached prefix from host or disk). These methods are the ones
the cache always had, moved here verbatim.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from tiering.policies.blocks import DEFAULT_BLOCK_POLICY, default_block_registry
from tiering.resources.base import CachedPrefix
from tiering.resources.kv_prefix import BLOCKS, PrefixCache, PrefixHit, as_root
from tiering.resources.kv_records import RequestRecord
from tiering.resources.kv_transfers import _why

from tiering.blocks import KeyRoot
from tiering.core.executor import RELOAD
from tiering.core.validate import is_int, is_number
from tiering.types import IllegalTransition, Move, RequestState, Tier, TransferResult

log = logging.getLogger("tiering.kv_cache")

S = RequestState


class KVPrefixReuse:
    """The prefix-reuse calls (a part of ``PagedKVCache``)."""

    # -- prefix reuse (resources.kv_prefix) -------------------------------------------

    prefix_skip_safe = True  # a hit only skips tokens whose K/V the cache already holds

    def enable_prefix_cache(self, root, walks=None, *, policy: str = DEFAULT_BLOCK_POLICY,
                            disk_batch_pages: int = 16, shared=None,
                            shared_refresh_s: float = 10.0) -> bool:
        """Open the block store under ``root`` (any non-empty bytes, such as a digest or a model
        tag, or a ``tiering.blocks.KeyRoot``); the keys chain from a digest of it and the geometry.

        ``policy`` names the block retention policy of every tier
        (``tiering.policies.blocks.make_block_policy``); ``disk_batch_pages`` is how many
        blocks one host -> disk write packs. ``shared`` (a
        ``tiering.coldtier.SharedTierConfig``, ``SharedBlockStore`` or ``BlockQueue``)
        adds the shared cold tier: published blocks are written there, and an
        attach that misses locally fetches blocks other workers published
        (``docs/coldtier.md``); its index of what exists is refreshed every
        ``shared_refresh_s`` seconds of the cache's clock, from ``poll``. Enabling
        twice with another root, or with a shared tier the first call did not
        have, is an error; with the same root it does nothing. ``walks`` is
        accepted for the engine contract and not used (every walk's writes are keyed)."""
        self._open("enable_prefix_cache")
        del walks
        key = as_root(root)
        self._check_prefix_args(root, policy, disk_batch_pages, shared_refresh_s)
        if self._prefix is not None:
            if self._prefix.root != key:
                raise ValueError("enable_prefix_cache: already enabled under another root")
            if shared is not None and (self._prefix.shared is None
                                       or not self._prefix.shared.same_source(shared)):
                raise ValueError("enable_prefix_cache: already enabled; a shared tier is given at the first call")
            return True
        self._prefix = PrefixCache(self, key, policy, disk_batch_pages, shared, shared_refresh_s)
        return True

    def _check_prefix_args(self, root, policy, disk_batch_pages, shared_refresh_s) -> None:
        """enable_prefix_cache's arguments, checked before anything is built or compared (a
        second call with bad arguments is refused too, not ignored)."""
        g = self.geometry
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
        return self._prefix is not None

    def _prefix_on(self, what: str) -> PrefixCache:
        self._open(what)
        if self._prefix is None:
            raise RuntimeError(f"{what}: the prefix cache is not enabled (call enable_prefix_cache)")
        return self._prefix

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
        """Key the request's full pages of ``token_ids`` (its first tokens); idempotent.

        Published pages become cached blocks the request maps; they are
        immutable (``write`` into them raises). A page whose key is already
        cached on the device is replaced by that block (the request's copy is
        freed); publishing stops at a key cached on another tier. Returns the
        tokens the request now maps as blocks."""
        p = self._prefix_on("publish_prefix")
        r = self._req(rid, "publish_prefix")
        arr = self._token_array(f"publish_prefix({rid!r})", token_ids)
        if r.state is not S.RESIDENT or r.prefix_load is not None:
            raise IllegalTransition(
                f"publish_prefix: request {rid!r} is {r.state.value}; it must be resident"
            )
        if r.head:
            raise IllegalTransition(f"publish_prefix: request {rid!r} streams from the host (it is"
                                    " longer than the device); its pages are not published")
        return p.publish(r, arr) * self.geometry.page_tokens

    def cached_prefix(self, token_ids) -> PrefixHit:
        """How many leading tokens of ``token_ids`` are cached, and per tier. Changes nothing."""
        p = self._prefix_on("cached_prefix")
        return p.lookup(self._token_array("cached_prefix", token_ids))

    def attach_prefix(self, rid: str, token_ids) -> int:
        """Give a freshly ingested request the longest cached prefix of ``token_ids``.

        Device blocks are mapped by reference. Host and disk blocks, and
        blocks fetched from the shared cold tier (``reload`` refuses until
        they have arrived), are loaded into fresh device pages: the request
        is then offloaded for those pages
        (``is_offloaded`` True, ``admit`` not ready) until ``reload`` (the
        controller's admission) brings them in. The last token is never
        attached (its logits are needed). Returns the tokens attached; when a
        load finds a block corrupt or unreadable, the request keeps only the
        blocks before it, and ``num_tokens(rid)`` (read after ``admit`` says
        ready) is the number of valid tokens the caller continues from."""
        return self._attach(rid, token_ids)

    def _attach(self, rid: str, token_ids, chain: np.ndarray | None = None) -> int:
        """``attach_prefix``; the block policies are told the request as reading the pages
        of ``chain`` (default ``token_ids``: all it is known to read)."""
        p = self._prefix_on("attach_prefix")
        r = self._req(rid, "attach_prefix")
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
        """Counters of the block store: hit tokens per tier, blocks moved, dropped, ..."""
        p = self._prefix_on("prefix_stats")
        out = dict(p.stats)
        out["blocks_cached"] = len(p.index)
        for t in Tier:
            out.setdefault(f"hit_tokens_{t.value}", 0)
            out[f"blocks_on_{t.value}"] = p.index.count(t)
        for name in p.shared_counters():
            out.setdefault(name, 0)
        return out

    def _reload_prefix(self, r: RequestRecord) -> bool:
        p = self._prefix
        if p.fetch_pending(r):  # a block is still on its way from the shared tier: not yet
            p.stats["shared_reload_waits"] += 1
            return False
        k = len(r.prefix_load.positions)
        p.ensure_device(k)
        pages = self.device_pool.allocate(BLOCKS, k)
        if pages is None:
            self.stats.reload_refusals += 1
            return False
        work = p.start_load(r, pages)
        move = Move.RELOAD_FROM_HOST if r.state is S.ON_HOST else Move.RELOAD_FROM_DISK
        marker = self._streams.compute_marker()
        fut = self._submit(self._io, RELOAD, p.load_job, work, self._fault, marker)
        if fut is None:
            p.finish_load(None, work, ["not queued"] * len(work))
            return False
        r.load_work = work
        self._start(r, move, fut, S.RELOADING)
        return True

    def _done_prefix_load(self, r, job, exc):
        p = self._prefix
        work, r.load_work = r.load_work, None
        results = job.future.result() if exc is None else [f"read_failed: {_why(exc)}"] * len(work)
        kept, reason = p.finish_load(r, work, results)
        positions, cut = r.prefix_load.positions, r.prefix_load.failed
        r.prefix_load = None
        reason = reason or cut  # blocks cut before the load (a failed shared fetch)
        if kept < len(work):
            p.truncate(r, positions[kept], reason)
        self._set_state(r, S.RESIDENT)
        nbytes = kept * self.geometry.page_bytes
        self.stats.reload_stall_s_total += max(0.0, self._clock() - job.started)
        return TransferResult(r.rid, job.move, reason is None, nbytes, S.RESIDENT, reason)

    # the engine's prefix hooks, on the calls above (one rank: no TP lease)

    @property
    def keys_prefix_chains(self) -> bool:
        return self._prefix is not None

    def fingerprint(self) -> bytes | None:
        """The geometry (layout and dtype of a page): what a stored page depends on here."""
        return self.geometry.fingerprint().encode()

    def resolve_cached_prefix(self, rid, node_name, graph_walk, inputs) -> CachedPrefix | None:
        self._open("resolve_cached_prefix")  # a closed cache answers nothing, prefix cache or not
        if self._prefix is None:
            return None
        arr = self._token_array("resolve_cached_prefix", inputs)
        T = self.geometry.page_tokens
        tokens = min(self.cached_prefix(arr).tokens, max(0, (arr.size - 1) // T) * T)
        return CachedPrefix(graph_walk, tokens, tokens)

    def apply_cached_prefix(self, rid, node_name, graph_walk, inputs, prefix) -> None:
        self._open("apply_cached_prefix")  # a closed cache answers nothing, prefix cache or not
        if self._prefix is None:
            return
        arr = self._token_array("apply_cached_prefix", inputs)
        r = self._req(rid, "apply_cached_prefix")
        if prefix is None or prefix.tokens == 0:
            r.chain_tokens = arr.tolist()
            return
        got = self._attach(rid, arr[: prefix.tokens + 1], arr)
        r.chain_tokens = arr.tolist()
        if got < prefix.tokens:
            log.info("request %r: %d of %d agreed prefix tokens attached", rid, got, prefix.tokens)

    def extend_prefix_chain(self, rid, node_name, graph_walk, outputs) -> None:
        self._open("extend_prefix_chain")  # a closed cache answers nothing, prefix cache or not
        if self._prefix is None:
            return
        r = self._req(rid, "extend_prefix_chain")
        r.chain_tokens.extend(self._token_array("extend_prefix_chain", outputs).tolist())
        if r.state is S.RESIDENT and r.prefix_load is None:
            T = self.geometry.page_tokens
            n = min(len(r.chain_tokens), r.written_tokens(self.geometry.num_layers, len(r.blocks) * T))
            self.publish_prefix(rid, r.chain_tokens[:n])

    def complete_cached_walk(self, rid, node_name, graph_walk) -> None:
        self._open("complete_cached_walk")  # a closed cache answers nothing, prefix cache or not
        return
