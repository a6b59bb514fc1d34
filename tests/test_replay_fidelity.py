"""Replay fidelity: the replay's block store runs the cache's rules.

One seeded conversation trace (``tiering.blocks.synth``: shared system prompts,
conversations continued a few requests later, one-offs), and a seeded slice of the
bundled Mooncake conversation trace, are each driven through the cache users run (``PagedKVCache`` on CPU with its prefix cache, random KV bytes, a
disk tier) and through the replay's modelled cache (``PrefixBlocks`` over
``ModeledKVCache``), one request after another: its arrival, the prefix attach, the
loads of host and disk hits, the allocation of its prompt (the pressure: cached
blocks make room, moving down device -> host -> disk or leaving), its publish and its
removal. For every built-in block policy both must report the same hit tokens per
tier for every request, the same block events in the same order (hits, loads,
publishes, refusals, moves, drops) and the same blocks on every tier after every
request. A store that makes room by another rule (dropping instead of moving down,
or never asking ``admit``) must be caught.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Hashable

import pytest
import torch
import zarr
from replay_helpers import MOONCAKE
from tiering.policies.blocks import DEFAULT_BLOCK_POLICY, default_block_registry

from tiering import DiskConfig, KVGeometry, PagedKVCache
from tiering.apps.replay.block_tiers import PrefixBlocks
from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.traces import load_trace
from tiering.blocks.synth import SynthConfig, synthetic_chains
from tiering.types import Tier

T = 4  # tokens a page, and a block: one trace block (512 tokens) is one page here
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, page_tokens=T)
DEVICE, HOST, DISK = 40, 16, 24  # pages of each tier: every tier fills in the slice
N = 150  # requests in the trace
POLICIES = default_block_registry().names


class Request:
    """One request of the slice: its block ids, its prompt length, its token ids (each
    block id's page of tokens, so equal ids are equal prefixes)."""

    def __init__(self, i: int, hash_ids: tuple[int, ...], n_in: int) -> None:
        self.rid = f"r{i}"
        self.hash_ids = hash_ids
        self.n_in = n_in
        self.tokens = [h * T + j for h in hash_ids for j in range(T)][:n_in]


def conversations(seed: int) -> list[Request]:
    """``N`` seeded requests: conversations continued about 12 requests later (so hits
    come from every tier), each prompt ending in a partial page; prompts longer than the
    device could hold are left out."""
    rng = random.Random(seed)
    out = []
    for chain in synthetic_chains(N, seed, SynthConfig(gap_median=12.0, new_blocks_mean=6.0)):
        n_in = len(chain) * T - rng.randrange(T)
        if -(-n_in // T) <= DEVICE - 4:
            out.append(Request(len(out), tuple(chain), n_in))
    return out


class Log:
    """What one side did: per request, hit tokens per tier, block events, the tiers."""

    def __init__(self) -> None:
        self.hits: list[tuple[int, int, int]] = []
        self.events: list[list[tuple[str, Hashable, str]]] = []
        self.tiers: list[dict[Hashable, str]] = []

    def start(self) -> None:
        self.events.append([])

    def watch(self, name: Callable[[Hashable], Hashable]):
        def record(kind: str, key: Hashable, tier: Tier) -> None:
            self.events[-1].append((kind, name(key), tier.value))
        return record


def grouped(events: list[tuple]) -> list[tuple]:
    """``events`` with each drop and the orphans before it as one event (the order a
    dropped subtree is listed in depends on set order, which differs between keys)."""
    out, orphans = [], []
    for kind, key, tier in events:
        if kind == "orphan":
            orphans.append((key, tier))
            continue
        if kind == "drop":
            out.append((kind, key, tier, frozenset(orphans)))
            orphans = []
        else:
            out.append((kind, key, tier))
    assert not orphans, "an orphan without its drop"
    return out


def first_difference(a: Log, b: Log, reqs: list[Request]) -> str | None:
    """Where two logs first disagree, in words; None when they agree throughout."""
    for i, r in enumerate(reqs):
        if a.hits[i] != b.hits[i]:
            return f"{r.rid}: hit tokens (device, host, disk) {a.hits[i]} != {b.hits[i]}"
        x_events, y_events = grouped(a.events[i]), grouped(b.events[i])
        if x_events != y_events:
            for j, (x, y) in enumerate(zip(x_events, y_events, strict=False)):
                if x != y:
                    return f"{r.rid}: block event {j} is {x} on one side, {y} on the other"
            return (f"{r.rid}: {len(x_events)} block events on one side,"
                    f" {len(y_events)} on the other")
        if a.tiers[i] != b.tiers[i]:
            return f"{r.rid}: the blocks on each tier differ after it"
    return None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_cache(policy: str, reqs: list[Request], seed: int,
              change: Callable[[PagedKVCache], None] | None = None) -> Log:
    """The slice through ``PagedKVCache`` on CPU (random KV bytes, an in-memory disk)."""
    clock = Clock()
    page_bytes = GEOMETRY.page_bytes
    kv = PagedKVCache(GEOMETRY, "cpu", device_pages=DEVICE, host_pages=HOST, clock=clock,
                      disk=DiskConfig(store=zarr.storage.MemoryStore(),
                                      capacity_bytes=DISK * page_bytes, chunk_bytes=page_bytes))
    kv.enable_prefix_cache(b"replay-fidelity", policy=policy, disk_batch_pages=1)
    p = kv._prefix
    names: dict[Hashable, int] = {}
    log = Log()
    p.rules.watch = log.watch(names.__getitem__)
    if change is not None:
        change(kv)
    gen = torch.Generator().manual_seed(seed)
    try:
        for i, r in enumerate(reqs):
            clock.now = float(i + 1)
            log.start()
            names.update(zip(p.keys(r.tokens), r.hash_ids, strict=False))
            before = kv.prefix_stats()
            kv.ingest_request(r.rid)
            kv.attach_prefix(r.rid, r.tokens)
            after = kv.prefix_stats()
            log.hits.append(tuple(after[f"hit_tokens_{t}"] - before[f"hit_tokens_{t}"]
                                  for t in ("device", "host", "disk")))
            if kv.is_offloaded(r.rid):  # host or disk hits: loaded before the prompt runs
                assert kv.reload(r.rid)
                assert all(res.ok for res in kv.synchronize())
            start = kv.num_tokens(r.rid)
            assert kv.allocate(r.rid, r.n_in)
            for layer in range(GEOMETRY.num_layers):
                shape = (r.n_in - start, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
                k = (torch.rand(shape, generator=gen) + 0.5).to(GEOMETRY.dtype)
                kv.write(r.rid, layer, start, k, -k)
            kv.publish_prefix(r.rid, r.tokens)
            kv.remove_request(r.rid)
            kv.check_integrity()
            log.tiers.append({names[k]: p.index.location(k).tier.value for k in p.index.keys()})
        stats = kv.prefix_stats()
        assert stats.get("load_corrupt", 0) == stats.get("load_read_failed", 0) == 0
    finally:
        kv.close()
    return log


def run_replay(policy: str, reqs: list[Request], move: bool = True,
               change: Callable[[PrefixBlocks], None] | None = None) -> Log:
    """The slice through the replay's store and modelled cache, in the cache's order:
    attach (lend, commit), room for the loads, the loads, room for the prompt."""
    clock = Clock()
    kv = ModeledKVCache(GEOMETRY.page_bytes // T, T, DEVICE, HOST, DISK, LinkRates.instant(),
                        clock)
    store = PrefixBlocks(kv, policy, T, clock, events=False)
    log = Log()
    store.rules.watch = log.watch(lambda k: k)
    if change is not None:
        change(store)

    def free() -> int:
        return kv.free_pages(Tier.DEVICE)

    for i, r in enumerate(reqs):
        clock.now = float(i + 1)
        log.start()
        peek = store.peek(r.hash_ids, r.n_in)
        mapped = store.lend(peek) if peek.blocks else []
        moves = store.commit(peek)
        n = Counter(peek.tiers)
        log.hits.append((n[Tier.DEVICE] * T, n[Tier.HOST] * T, n[Tier.DISK] * T))
        kv.ingest_request(r.rid)
        held = 0  # pages the request holds (its lent device hits are free pages until then)
        if moves:
            assert store.make_room(peek.blocks, free, move)
            assert kv.allocate(r.rid, peek.blocks * T)
            held = peek.blocks
            store.loaded(moves)
        assert store.make_room(kv.pages_for(r.n_in) - held, free, move)
        assert kv.allocate(r.rid, r.n_in)
        kv.remove_request(r.rid)
        store.release(mapped)
        store.publish(peek.keys)
        store.check_integrity()
        log.tiers.append({k: store.index.location(k).tier.value for k in store.index.keys()})
    return log


def mooncake_slice(seed: int) -> list[Request]:
    """``N`` consecutive requests of the bundled Mooncake trace from a seeded start, each
    512-token block one page; prompts longer than the device could hold are left out."""
    trace = load_trace(MOONCAKE)
    start = random.Random(seed).randrange(len(trace) - 4 * N)
    out = []
    for t in trace[start:start + 4 * N]:
        n_in = min(len(t.hash_ids) * T, max(1, round(t.input_tokens * T / 512)))
        if -(-n_in // T) <= DEVICE - 4 and len(out) < N:
            out.append(Request(len(out), tuple(t.hash_ids), n_in))
    return out


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    return conversations(seed=5)


def test_a_slice_of_the_mooncake_trace_runs_alike_in_the_replay_and_the_cache():
    """Real hash-id chains (mostly shared system prompts, far-apart continuations):
    device hits, and every tier filled and emptied, for the default policy."""
    reqs = mooncake_slice(seed=2024)
    assert len(reqs) == N
    cache = run_cache(DEFAULT_BLOCK_POLICY, reqs, seed=3)
    assert first_difference(cache, run_replay(DEFAULT_BLOCK_POLICY, reqs), reqs) is None
    events = Counter((kind, tier) for per in cache.events for kind, _k, tier in per)
    assert events["hit", "device"] and events["move", "disk"] and events["drop", "disk"]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_replay_and_the_cache_agree_request_by_request(policy, requests):
    cache = run_cache(policy, requests, seed=7)
    replay = run_replay(policy, requests)
    assert first_difference(cache, replay, requests) is None
    # the trace exercised every rule: hits on every tier, loads, moves down both links,
    # drops off the bottom
    events = Counter((kind, tier) for per in cache.events for kind, _k, tier in per)
    for want in (("hit", "device"), ("hit", "host"), ("hit", "disk"), ("load", "host"),
                 ("load", "disk"), ("publish", "device"), ("move", "host"), ("move", "disk"),
                 ("drop", "disk")):
        assert events[want] > 0, f"{policy}: no {want} event in the trace"


def test_a_store_that_makes_room_by_another_rule_is_caught(requests):
    """Negative controls: dropping victims instead of moving them down, and a cache that
    never asks ``admit`` (a policy whose admission refuses in this trace), each differ."""
    cache = run_cache("lru", requests, seed=7)
    dropping = run_replay("lru", requests, move=False)
    assert first_difference(cache, dropping, requests) is not None

    def no_admission(kv) -> None:
        kv._prefix.rules.admission = False

    chain = run_replay("chain", requests)  # chain's host policy refuses victims here
    assert any(kind == "refuse" for per in chain.events for kind, *_ in per)
    blind = run_cache("chain", requests, seed=7, change=no_admission)
    assert first_difference(blind, chain, requests) is not None
