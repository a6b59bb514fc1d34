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

A seeded schedule with several requests live at once (admissions, growth under device
pressure, finishes; prompts sharing prefixes) is driven through the cache as a worker
drives it and through the replay's worker path (``PrefixBlocks.attach_request``, the
simulator's admission check, ``ModeledKVCache``), for every built-in block policy: the
same hits per tier per admission, the same block events and admissions per step, the same
blocks on every tier. The same schedule with live requests offloaded, demoted and brought
back among the steps must agree too (cached blocks make way for a live request on the host
and on the disk). Negative controls: telling the policies after room is made, counting
unmapped blocks as used, counting a mapped block in its request's allocation, one-block
disk writes, and cached blocks that do not make way for a live move each differ.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Hashable
from typing import NamedTuple

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
from tiering.types import RequestState as S
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


def make_cache(policy: str, clock: Clock) -> PagedKVCache:
    """``PagedKVCache`` on CPU with an in-memory disk and its prefix cache (default
    ``disk_batch_pages``: 16 blocks a host -> disk write)."""
    page_bytes = GEOMETRY.page_bytes
    kv = PagedKVCache(GEOMETRY, "cpu", device_pages=DEVICE, host_pages=HOST, clock=clock,
                      disk=DiskConfig(store=zarr.storage.MemoryStore(),
                                      capacity_bytes=DISK * page_bytes, chunk_bytes=page_bytes))
    kv.enable_prefix_cache(b"replay-fidelity", policy=policy)
    return kv


def watched_cache(policy: str):
    """A cache of ``make_cache`` on a fresh clock, its block rules watched into a ``Log``:
    (clock, cache, its block store, the names blocks are logged by, the log)."""
    clock = Clock()
    kv = make_cache(policy, clock)
    p = kv._prefix
    names: dict[Hashable, int] = {}
    log = Log()
    p.rules.watch = log.watch(names.__getitem__)
    return clock, kv, p, names, log


def run_cache(policy: str, reqs: list[Request], seed: int,
              change: Callable[[PagedKVCache], None] | None = None) -> Log:
    """The slice through ``PagedKVCache`` on CPU (random KV bytes, an in-memory disk)."""
    clock, kv, p, names, log = watched_cache(policy)
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


def make_replay(policy: str, clock: Clock, move: bool = True,
                disk_batch: int = 16) -> tuple[ModeledKVCache, PrefixBlocks]:
    """The replay's modelled cache and block store (it registers with the cache)."""
    kv = ModeledKVCache(GEOMETRY.page_bytes // T, T, DEVICE, HOST, DISK, LinkRates.instant(),
                        clock)
    return kv, PrefixBlocks(kv, policy, T, clock, events=False, move=move,
                            disk_batch=disk_batch)


def run_replay(policy: str, reqs: list[Request], move: bool = True,
               change: Callable[[PrefixBlocks], None] | None = None) -> Log:
    """The slice through the replay's worker path (``PrefixBlocks.attach_request``: the
    attach, the loads; the prompt allocated once they landed) and modelled cache."""
    clock = Clock()
    kv, store = make_replay(policy, clock, move)
    log = Log()
    store.rules.watch = log.watch(lambda k: k)
    if change is not None:
        change(store)
    for i, r in enumerate(reqs):
        clock.now = float(i + 1)
        log.start()
        peek = store.peek(r.hash_ids, r.n_in)
        att = store.attach_request(r.rid, peek)
        assert att is not None
        n = Counter(peek.tiers)
        log.hits.append((n[Tier.DEVICE] * T, n[Tier.HOST] * T, n[Tier.DISK] * T))
        if att.moves:
            store.loaded(att.moves)
        assert kv.allocate(r.rid, r.n_in)
        kv.remove_request(r.rid)
        store.release(att.mapped)
        store.publish(peek.keys)
        store.check_integrity()
        kv.check_integrity()
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


# -- several requests live at once ---------------------------------------------------------

LIVE = 4  # requests live at most at once
SMALL = 14  # the most pages a prompt of the concurrent slice takes


class Op(NamedTuple):
    """One step of a concurrent schedule: ``admit`` the next request, ``grow`` the
    ``which``-th live request by ``tokens`` (a decode under pressure), or ``finish`` it."""

    kind: str
    which: int = 0
    tokens: int = 0


def schedule(reqs: list[Request], seed: int, moves: bool = False) -> list[Op]:
    """A seeded interleaving of admissions, growth and finishes with up to ``LIVE``
    requests live (the same for both sides: which live request an op names is an index
    into the live requests in admission order). ``moves``: live requests are also
    offloaded, demoted and brought ``back`` (each op a no-op where the request's state
    does not allow it, on either side alike)."""
    rng = random.Random(seed)
    out, live, nxt = [], 0, 0
    while nxt < len(reqs) or live:
        x = rng.random()
        if nxt < len(reqs) and live < LIVE and (x < 0.5 or not live):
            out.append(Op("admit"))
            nxt += 1
            live += 1  # an admission refused for room counts as live until its finish op
        elif moves and live and x < 0.65:
            out.append(Op(rng.choice(("offload", "offload", "demote", "back")),
                          rng.randrange(live)))
        elif live and x < 0.75:
            out.append(Op("grow", rng.randrange(live), rng.randint(1, 3 * T)))
        elif live:
            out.append(Op("finish", rng.randrange(live)))
            live -= 1
    return out


def concurrent_requests(seed: int) -> list[Request]:
    """The conversation slice with small prompts (several fit the device at once)."""
    out = []
    for r in conversations(seed):
        if -(-r.n_in // T) <= SMALL:
            out.append(Request(len(out), r.hash_ids, r.n_in))
    return out


def attachable(p, tokens: list[int]) -> tuple[Tier, ...]:
    """The tiers of the blocks an attach of ``tokens`` maps in the cache (its own rule)."""
    return tuple(p.rules.attachable(p.keys(tokens), len(tokens), T))


def move_live(kv, rid: str, kind: str, settle: Callable[[], list]) -> tuple[str, str, str]:
    """Offload, demote or bring ``back`` a live request where its state allows it, and
    land the copy (``settle``): the event naming what happened and the state after."""
    state = kv.state_of(rid)
    if kind == "offload":
        done = state is S.RESIDENT and kv.offload(rid) > 0
    elif kind == "demote":
        done = state is S.ON_HOST and kv.demote(rid)
    else:
        done = state in (S.ON_HOST, S.ON_DISK) and kv.reload(rid)
    if done:
        results = settle()
        assert [res.ok for res in results] == [True], results
    return (kind if done else f"no {kind}", rid, kv.state_of(rid).value)


def run_cache_live(policy: str, reqs: list[Request], ops: list[Op], seed: int) -> Log:
    """The schedule through ``PagedKVCache`` as a worker drives it: a request the device
    could not hold even with every unmapped block gone is left waiting (refused); else
    ``ingest_request``, ``attach_prefix``, the ``reload`` of host and disk hits (landed by
    ``synchronize``), ``allocate`` of the prompt and its KV written (a refusal removes
    it); growth is ``allocate``; a finish publishes the prompt and removes it."""
    clock, kv, p, names, log = watched_cache(policy)
    gen = torch.Generator().manual_seed(seed)
    live: list[tuple[Request, bool]] = []  # (request, admitted)
    nxt = 0
    try:
        for i, op in enumerate(ops):
            clock.now = float(i + 1)
            log.start()
            if op.kind == "admit":
                r = reqs[nxt]
                nxt += 1
                names.update(zip(p.keys(r.tokens), r.hash_ids, strict=False))
                tiers = attachable(p, r.tokens)
                loads = sum(1 for t in tiers if t is not Tier.DEVICE)
                need = loads + kv.geometry.pages_for(r.n_in - len(tiers) * T)
                room = (kv.device_capacity_bytes - kv.device_used_bytes()) // GEOMETRY.page_bytes
                ok = need <= room
                if ok:
                    before = kv.prefix_stats()
                    kv.ingest_request(r.rid)
                    kv.attach_prefix(r.rid, r.tokens)
                    after = kv.prefix_stats()
                    log.hits.append(tuple(after[f"hit_tokens_{t}"] - before[f"hit_tokens_{t}"]
                                          for t in ("device", "host", "disk")))
                    if kv.is_offloaded(r.rid):
                        ok = kv.reload(r.rid)
                        if ok:
                            assert all(res.ok for res in kv.synchronize())
                    start = kv.num_tokens(r.rid)
                    ok = ok and kv.allocate(r.rid, r.n_in)
                    if ok:
                        for layer in range(GEOMETRY.num_layers):
                            shape = (r.n_in - start, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
                            k = (torch.rand(shape, generator=gen) + 0.5).to(GEOMETRY.dtype)
                            kv.write(r.rid, layer, start, k, -k)
                    else:
                        kv.remove_request(r.rid)
                log.events[-1].append(("admitted" if ok else "refused", r.rid, "device"))
                live.append((r, ok))
            elif op.kind == "grow":
                r, ok = live[op.which]
                if ok and kv.state_of(r.rid) is S.RESIDENT:
                    got = kv.allocate(r.rid, kv.num_tokens(r.rid) + op.tokens)
                    log.events[-1].append(("grew" if got else "short", r.rid, "device"))
            elif op.kind != "finish":
                r, ok = live[op.which]
                if ok:
                    log.events[-1].append(move_live(kv, r.rid, op.kind, kv.synchronize))
            else:
                r, ok = live.pop(op.which)
                if ok:
                    if kv.state_of(r.rid) is S.RESIDENT:
                        kv.publish_prefix(r.rid, r.tokens)
                    kv.remove_request(r.rid)
            kv.check_integrity()
            log.tiers.append({names[k]: p.index.location(k).tier.value for k in p.index.keys()})
    finally:
        kv.close()
    return log


def run_replay_live(policy: str, reqs: list[Request], ops: list[Op], disk_batch: int = 16,
                    change: Callable[[ModeledKVCache, PrefixBlocks], None] | None = None
                    ) -> Log:
    """The schedule through the replay's worker path over the modelled cache: the
    simulator's admission check (``_Worker._hopeless``: ``need_pages`` against what the
    used figure leaves), ``attach_request``, ``loaded``, ``allocate`` (``abandon`` on a
    refusal); growth is ``allocate``; a finish removes the request, releases its blocks
    and publishes them."""
    clock = Clock()
    kv, store = make_replay(policy, clock, disk_batch=disk_batch)
    if change is not None:
        change(kv, store)
    log = Log()
    store.rules.watch = log.watch(lambda k: k)
    live: list[tuple[Request, object]] = []  # (request, its attach or None: refused)
    nxt = 0
    for i, op in enumerate(ops):
        clock.now = float(i + 1)
        log.start()
        if op.kind == "admit":
            r = reqs[nxt]
            nxt += 1
            peek = store.peek(r.hash_ids, r.n_in)
            room = (kv.device_capacity_bytes - kv.device_used_bytes()) // kv.page_bytes
            att = None
            if store.need_pages(peek, r.n_in) <= room:
                att = store.attach_request(r.rid, peek)
                n = Counter(peek.tiers)
                log.hits.append((n[Tier.DEVICE] * T, n[Tier.HOST] * T, n[Tier.DISK] * T))
                if att is not None:
                    if att.moves:
                        store.loaded(att.moves)
                    if not kv.allocate(r.rid, r.n_in):
                        store.abandon(r.rid, att)
                        att = None
            log.events[-1].append(("admitted" if att else "refused", r.rid, "device"))
            live.append((r, att))
        elif op.kind == "grow":
            r, att = live[op.which]
            if att is not None and kv.state_of(r.rid) is S.RESIDENT:
                got = kv.allocate(r.rid, kv.num_tokens(r.rid) + op.tokens)
                log.events[-1].append(("grew" if got else "short", r.rid, "device"))
        elif op.kind != "finish":
            r, att = live[op.which]
            if att is not None:
                log.events[-1].append(move_live(kv, r.rid, op.kind, kv.poll))
        else:
            r, att = live.pop(op.which)
            if att is not None:
                resident = kv.state_of(r.rid) is S.RESIDENT
                kv.remove_request(r.rid)
                store.release(att.mapped)
                if resident:
                    store.publish(att.peek.keys)
        store.check_integrity()
        kv.check_integrity()
        log.tiers.append({k: store.index.location(k).tier.value for k in store.index.keys()})
    return log


def first_op_difference(a: Log, b: Log, ops: list[Op]) -> str | None:
    """Where two logs of a schedule first disagree, in words; None when they agree."""
    if a.hits != b.hits:
        i = next((i for i, (x, y) in enumerate(zip(a.hits, b.hits, strict=False)) if x != y),
                 min(len(a.hits), len(b.hits)))
        return f"admission {i}: hit tokens differ ({len(a.hits)} and {len(b.hits)} attaches)"
    for i, op in enumerate(ops):
        x, y = grouped(a.events[i]), grouped(b.events[i])
        if x != y:
            return f"op {i} ({op.kind}): events {x[:6]} != {y[:6]}"
        if a.tiers[i] != b.tiers[i]:
            return f"op {i} ({op.kind}): the blocks on each tier differ after it"
    return None


@pytest.fixture(scope="module")
def concurrent() -> tuple[list[Request], list[Op]]:
    reqs = concurrent_requests(seed=11)
    return reqs, schedule(reqs, seed=12)


@pytest.mark.parametrize("policy", POLICIES)
def test_concurrent_requests_run_alike_in_the_replay_worker_and_the_cache(policy, concurrent):
    """Several requests live at once, sharing prefixes, under device pressure (growth and
    admissions that need cached blocks to make room): per admission the same hit tokens
    per tier, per step the same block events, admissions and refusals, and the same blocks
    on every tier."""
    reqs, ops = concurrent
    cache = run_cache_live(policy, reqs, ops, seed=13)
    replay = run_replay_live(policy, reqs, ops)
    assert first_op_difference(cache, replay, ops) is None
    events = Counter((kind, tier) for per in cache.events for kind, _k, tier in per)
    # it ran concurrently and under pressure: shared device hits (a block mapped by two
    # live requests), refusals and short growth, and blocks moved down both links
    assert events["refused", "device"] and events["short", "device"] and events["grew", "device"]
    for want in (("hit", "device"), ("hit", "host"), ("load", "host"), ("move", "host"),
                 ("move", "disk"), ("publish", "device")):
        assert events[want] > 0, f"{policy}: no {want} event in the schedule"


def test_the_concurrent_schedule_shares_device_blocks_between_live_requests(concurrent):
    """The schedule has a block mapped by two live requests at once (what counting it
    in both requests' allocations would get wrong)."""
    reqs, ops = concurrent
    clock = Clock()
    kv, store = make_replay(DEFAULT_BLOCK_POLICY, clock)
    shared = 0
    live, nxt = [], 0
    for op in ops:
        if op.kind == "admit":
            r = reqs[nxt]
            nxt += 1
            peek = store.peek(r.hash_ids, r.n_in)
            room = (kv.device_capacity_bytes - kv.device_used_bytes()) // kv.page_bytes
            att = (store.attach_request(r.rid, peek)
                   if store.need_pages(peek, r.n_in) <= room else None)
            if att is not None:
                store.loaded(att.moves)
                if not kv.allocate(r.rid, r.n_in):
                    store.abandon(r.rid, att)
                    att = None
            live.append((r, att))
            shared = max([shared] + [store.index.get(k).refs for k in store.index.keys()])
        elif op.kind == "finish":
            r, att = live.pop(op.which)
            if att is not None:
                kv.remove_request(r.rid)
                store.release(att.mapped)
                store.publish(att.peek.keys)
    assert shared >= 2


def test_a_worker_that_drives_blocks_otherwise_is_caught(concurrent):
    """Negative controls, each differing from the cache: the policies told after the
    loads made room (not at attach), cached blocks no request maps counted as used, a
    block mapped by a live request counted in that request's allocation too, and
    host -> disk writes of one block each (the cache writes 16)."""
    reqs, ops = concurrent
    cache = run_cache_live(DEFAULT_BLOCK_POLICY, reqs, ops, seed=13)

    def late_tell(kv, store) -> None:
        told, tell, loads = [], store.rules.tell, store.start_loads
        store.rules.tell = lambda *args: told.append(args)

        def loads_then_tell(peek):
            out = loads(peek)
            while told:
                tell(*told.pop(0))
            return out

        store.start_loads = loads_then_tell

    def idle_used(kv, store) -> None:
        kv.device_used_bytes = lambda: (kv.device_capacity_bytes
                                        - kv.free_pages(Tier.DEVICE) * kv.page_bytes)

    def twice(kv, store) -> None:
        kv.map_blocks = lambda rid, tokens, pages: None  # its prompt's pages are all its own

    for change in (late_tell, idle_used, twice):
        assert first_op_difference(cache, run_replay_live(DEFAULT_BLOCK_POLICY, reqs, ops,
                                                          change=change), ops) is not None
    assert first_op_difference(cache, run_replay_live(DEFAULT_BLOCK_POLICY, reqs, ops,
                                                      disk_batch=1), ops) is not None


@pytest.fixture(scope="module")
def moving() -> tuple[list[Request], list[Op]]:
    reqs = concurrent_requests(seed=21)
    return reqs, schedule(reqs, seed=22, moves=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_live_offloads_demotions_and_reloads_run_alike_in_the_replay_and_the_cache(
        policy, moving):
    """The concurrent schedule with live requests offloaded, demoted and brought back
    among the admissions (cached blocks make way for them on the host and the disk): the
    same answers and states, the same block events and the same blocks on every tier."""
    reqs, ops = moving
    cache = run_cache_live(policy, reqs, ops, seed=23)
    assert first_op_difference(cache, run_replay_live(policy, reqs, ops), ops) is None
    done = Counter((kind, state) for per in cache.events for kind, _k, state in per)
    for want in (("offload", "on_host"), ("offload", "on_disk"), ("demote", "on_disk"),
                 ("back", "resident")):
        assert done[want] > 0, f"{policy}: no {want} in the schedule ({done})"


@pytest.mark.parametrize("skip", ["ensure_host", "ensure_disk"])
def test_a_model_whose_cached_blocks_do_not_make_way_for_live_moves_is_caught(skip, moving):
    """Negative controls: cached blocks that do not give way on the host (or on the disk)
    to a live request's offload or demotion, as the cache's do, differ."""
    reqs, ops = moving
    cache = run_cache_live(DEFAULT_BLOCK_POLICY, reqs, ops, seed=23)

    def refuse(kv, store) -> None:
        setattr(store, skip, lambda n: False)

    assert first_op_difference(cache, run_replay_live(DEFAULT_BLOCK_POLICY, reqs, ops,
                                                      change=refuse), ops) is not None
