"""The modelled cache's block-page calls: a refused call changes nothing."""

from __future__ import annotations

import random

import pytest

from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.simulator import SimClock
from tiering.types import Tier


def _snapshot(kv: ModeledKVCache) -> tuple:
    return (tuple(kv.free_pages(t) for t in Tier), tuple(kv.block_pages(t) for t in Tier),
            kv.stats.bytes_d2h, kv.stats.bytes_disk_write)


@pytest.mark.parametrize("seed", range(5))
def test_a_refused_block_move_changes_nothing(seed):
    rng = random.Random(seed)
    kv = ModeledKVCache(rng.randint(2, 64), 4, 40, 40, 40,
                        LinkRates(1e9, 1e9, 1e8, 1e8, d2h_latency_s=1e-4), SimClock())
    held = rng.randint(1, 8)
    assert kv.take_block_pages(Tier.DEVICE, held)
    before = _snapshot(kv)
    # more pages than the source's blocks hold: refused before the destination is taken
    for bad in (held + 1, held + rng.randint(2, 20), -1, True, 1.0, "2"):
        with pytest.raises(ValueError, match="move_block_pages: n must be an int"):
            kv.move_block_pages(Tier.DEVICE, Tier.HOST, bad)
        assert _snapshot(kv) == before, f"n={bad!r} changed the cache"
    with pytest.raises(ValueError, match="no move from"):
        kv.move_block_pages(Tier.HOST, Tier.DEVICE, 1)
    assert _snapshot(kv) == before
    # a short destination is an expected shortage: False, nothing changed
    kv2 = ModeledKVCache(8, 4, 40, 2, 40, LinkRates.instant(), SimClock())
    assert kv2.take_block_pages(Tier.DEVICE, 3)
    snap = _snapshot(kv2)
    assert kv2.move_block_pages(Tier.DEVICE, Tier.HOST, 3) is False
    assert _snapshot(kv2) == snap
    # a legal move takes the destination, frees the source and counts its bytes
    n = rng.randint(1, held)
    assert kv.move_block_pages(Tier.DEVICE, Tier.HOST, n)
    assert kv.block_pages(Tier.DEVICE) == held - n and kv.block_pages(Tier.HOST) == n
    assert kv.stats.bytes_d2h == before[2] + n * kv.page_bytes


def _published(kv: ModeledKVCache, clock: SimClock):
    """A block store on ``kv`` (lru, a block is 2 pages) holding blocks 1, 2 and 3 on the
    device, published by a request that has gone."""
    from tiering.apps.replay.block_tiers import PrefixBlocks

    store = PrefixBlocks(kv, "lru", 8, clock)
    peek = store.peek((1, 2, 3), 25)
    att = store.attach_request("a", peek)
    assert kv.allocate("a", 25)
    kv.remove_request("a")
    store.release(att.mapped)
    assert store.publish(peek.keys) == 3
    return store


def test_a_request_maps_blocks_the_store_holds_and_bad_mappings_change_nothing():
    """Blocks a request maps are the store's pages (counted once), the used figures leave
    out blocks no request maps, an allocation makes room through the store, and a mapping
    with bad figures, or of a request that already holds tokens, is refused naming what
    was wrong, with nothing changed."""
    rng = random.Random(3)
    clock = SimClock()
    kv = ModeledKVCache(rng.randint(2, 64), 4, 20, 8, 8, LinkRates.instant(), clock)
    store = _published(kv, clock)
    assert kv.block_pages(Tier.DEVICE) == 6 and kv.device_used_bytes() == 0
    for rid in ("b", "c"):  # two live requests map the same two blocks
        att = store.attach_request(rid, store.peek((1, 2, 9), 24))
        assert att.mapped == [1, 2] and kv.mapped_pages(rid) == 4
        assert kv.allocate(rid, 24)
    used = kv.device_used_bytes() // kv.page_bytes
    assert used == 4 + 2 * 2  # the shared blocks once, each request's own 8 tokens
    assert store.idle_pages(Tier.DEVICE) == 2  # block 3: nobody maps it
    snap = _snapshot(kv), kv.num_tokens("b")
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="map_blocks"):
            kv.map_blocks("b", bad, 2)
    with pytest.raises(ValueError, match="only a fresh request"):
        kv.map_blocks("b", 8, 2)
    assert (_snapshot(kv), kv.num_tokens("b")) == snap
    # growing "b" past the free pages sends block 3 down to the host first
    free = kv.device_free_pages()
    assert kv.allocate("b", 24 + 4 * (free + 1))
    assert store.count(Tier.HOST) == 1 and store.idle_pages(Tier.DEVICE) == 0
    kv.check_integrity()
    store.check_integrity()


def test_a_device_victim_the_host_has_no_room_for_goes_to_disk_as_in_the_cache():
    """The replay's side of the cache's rule: a device victim the host admits but cannot
    make room for (an offloaded request holds all of it) goes straight to disk when the
    disk's policy admits it; it was dropped."""
    clock = SimClock()
    kv = ModeledKVCache(16, 4, 16, 8, 32, LinkRates.instant(), clock)
    store = _published(kv, clock)
    kv.ingest_request("h")  # 8 pages: the whole host once offloaded
    assert kv.allocate("h", 32)
    assert kv.offload("h") > 0
    clock.now += 1.0
    kv.poll()
    assert kv.free_pages(Tier.HOST) == 0 and store.count(Tier.HOST) == 0
    kv.ingest_request("big")  # the whole device: the three blocks must leave it
    assert kv.allocate("big", 16 * 4)
    assert store.count(Tier.DEVICE) == 0 and store.count(Tier.DISK) == 3
    assert store.counters.dropped == 0
    kv.check_integrity()
    store.check_integrity()


def _chain(clock: SimClock, *tiers: tuple[str, Tier, int]) -> ModeledKVCache:
    """A modelled cache over instant links: the device, then ``(name, role, pages)`` tiers,
    each linked both ways with the host (a page of 4 tokens)."""
    import math

    from tiering.core.tiers import ModelledLink, PageTier, TierChain

    pb = 64
    made = [PageTier(name, role, pages, pb) for name, role, pages in tiers]
    ends = [("device", "host")] + [("host", t.name) for t in made if t.name not in (
        "device", "host")]
    links = [ModelledLink(a, b, math.inf, 0.0) for x, y in ends for a, b in ((x, y), (y, x))]
    return ModeledKVCache.from_chain(TierChain(made, links), 4, clock)


def _two_disks(clock: SimClock) -> ModeledKVCache:
    """Device 16 pages, host 8, and two disk-like tiers of 6 pages."""
    return _chain(clock, ("device", Tier.DEVICE, 16), ("host", Tier.HOST, 8),
                  ("nvme", Tier.DISK, 6), ("hdd", Tier.DISK, 6))


def _one_block_prompts(kv: ModeledKVCache, clock: SimClock, n: int):
    """An lru block store on ``kv`` (a block is a page) holding ``n`` one-block prompts on
    the device (leaves, each its own victim), published by requests that have gone."""
    from tiering.apps.replay.block_tiers import PrefixBlocks

    store = PrefixBlocks(kv, "lru", 4, clock)
    for i in range(1, n + 1):
        peek = store.peek((i,), 4)
        att = store.attach_request(f"a{i}", peek)
        assert kv.allocate(f"a{i}", 4)
        kv.remove_request(f"a{i}")
        store.release(att.mapped)
        assert store.publish(peek.keys) == 1
    return store


def test_a_live_demotion_takes_room_on_one_disk_tier_not_the_sum_of_them():
    """A request's pages land on one disk-like tier, so cached disk blocks make way until
    one tier fits it. Before, the disks' summed free pages were asked: the blocks stopped
    giving way as soon as the sum fitted, and the demotion was refused after two needless
    drops (nvme 2 free + hdd 3 free for 5 pages)."""
    from tiering.types import RequestState

    clock = SimClock()
    kv = _two_disks(clock)
    store = _one_block_prompts(kv, clock, 6)
    for rid, pages in (("r1", 3), ("h", 5)):  # the whole host
        kv.ingest_request(rid)
        assert kv.allocate(rid, pages * 4) and kv.offload(rid) > 0
    clock.now += 1.0
    kv.poll()
    kv.ingest_request("big")  # the whole device: the host is full, the blocks go to nvme
    assert kv.allocate("big", 64)
    kv.remove_request("big")
    assert store.count(Tier.DISK) == 6 and kv.chain["nvme"].free_pages == 0
    assert kv.demote("r1")  # lands on hdd, the only disk tier with room
    clock.now += 1.0
    kv.poll()
    assert (kv.chain["nvme"].free_pages, kv.chain["hdd"].free_pages) == (0, 3)
    assert kv.demote("h")
    clock.now += 1.0
    assert [r.ok for r in kv.poll()] == [True]
    assert kv.state_of("h") is RequestState.ON_DISK and kv.chain["nvme"].held("h") == 5
    assert store.counters.dropped == 5 and store.count(Tier.DISK) == 1
    kv.check_integrity()
    store.check_integrity()


def test_a_live_offload_takes_room_on_one_host_like_tier_not_the_sum_of_them():
    """With a host and a remote memory tier, cached host blocks go down to disk until a
    live request fits on one host-like tier. Before, the summed free pages (host 3 +
    remote 3) were asked: nothing moved, and a 5-page offload went to disk."""
    from tiering.types import RequestState

    clock = SimClock()
    kv = _chain(clock, ("device", Tier.DEVICE, 16), ("host", Tier.HOST, 10),
                ("remote", Tier.HOST, 10), ("disk", Tier.DISK, 40))
    store = _one_block_prompts(kv, clock, 3)
    for rid, pages in (("x", 4), ("z", 7)):  # x on the host, z on the remote tier
        kv.ingest_request(rid)
        assert kv.allocate(rid, pages * 4) and kv.offload(rid) > 0
        clock.now += 1.0
        kv.poll()
    kv.ingest_request("y")
    assert kv.allocate("y", 5 * 4)
    kv.ingest_request("big")  # the device's last 11 pages: the three blocks go to the host
    assert kv.allocate("big", 11 * 4)
    kv.remove_request("big")
    assert store.count(Tier.HOST) == 3
    assert (kv.chain["host"].free_pages, kv.chain["remote"].free_pages) == (3, 3)
    assert kv.offload("y") == 5 * kv.page_bytes
    clock.now += 1.0
    assert [r.ok for r in kv.poll()] == [True]
    assert kv.state_of("y") is RequestState.ON_HOST and kv.chain["host"].held("y") == 5
    assert store.count(Tier.DISK) == 3 and store.count(Tier.HOST) == 0  # one batched write
    kv.check_integrity()
    store.check_integrity()
