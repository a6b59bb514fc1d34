"""The cold tier against a real SeaweedFS server: shared blocks, leases, private prefixes, the
sweeper, the step-path queue, and zarr over the same store."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid

import numpy as np
import obstore
import pytest
import torch
from conftest import assert_same, fill
from seaweed_fixture import _seaweed_shared, seaweed  # noqa: F401  (fixtures)
from tiering.resources.kv_cache import PagedKVCache
from zarr.storage import WrapperStore

from tiering.coldtier import (
    BlockQueue,
    BlockStatus,
    ColdTierConfig,
    ColdTierUnavailable,
    HitLog,
    LeaseConfig,
    LeaseHeld,
    PrivatePrefix,
    SharedBlockStore,
    Sweeper,
    SweeperConfig,
    block_path,
    open_zarr_store,
)
from tiering.coldtier.lease import Lease
from tiering.coldtier.trust import TrustConfig
from tiering.disk import DiskConfig
from tiering.disk.manifest import MANIFEST_KEY
from tiering.types import Tier

TRUST = TrustConfig(secret=random.Random(22).randbytes(32))  # the deployment secret of these tests


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def rkey(rng: random.Random) -> bytes:
    return rng.randbytes(32)


def test_publish_fetch_across_stores_bitwise(seaweed):  # noqa: F811
    rng = random.Random(10)
    prefix = "t-" + uuid.uuid4().hex[:10]
    root, geom = rng.randbytes(16), rng.randbytes(8)
    a = SharedBlockStore(seaweed.store(prefix), root, geom, trust=TRUST)
    b = SharedBlockStore(seaweed.store(prefix), root, geom, trust=TRUST)  # another worker's view
    blocks = {rkey(rng): rng.randbytes(rng.randrange(1, 70_000)) for _ in range(12)}
    for k, v in blocks.items():
        r = a.publish(k, v)
        assert r.status is BlockStatus.WRITTEN and r.nbytes == a.object_size(k, len(v))
        a.check_integrity()
    # b knows nothing yet: a local miss is a miss, no network asked
    q = BlockQueue(b)
    assert not any(q.submit_fetch(k) for k in blocks)
    assert q.in_flight == 0
    assert b.refresh_index() == len(blocks)
    b.check_integrity()
    for k, v in blocks.items():
        r = b.fetch(k)
        assert r.status is BlockStatus.HIT and r.payload == v
    # a duplicate write is refused by the store and harmless
    k0 = next(iter(blocks))
    dup = b.publish(k0, rng.randbytes(10))
    assert dup.status is BlockStatus.DUPLICATE
    assert a.fetch(k0).payload == blocks[k0]
    # objects are their own length: no padding of small blocks
    for k, v in blocks.items():
        meta = obstore.head(a.store, block_path(root, geom, k))
        assert meta["size"] == a.object_size(k, len(v))
    # negative control: another root sees none of them and its fetch of the same key misses
    other = SharedBlockStore(seaweed.store(prefix), rng.randbytes(16), geom, trust=TRUST)
    assert other.refresh_index() == 0
    assert other.fetch(k0).status is BlockStatus.LOST
    q.close(5)


def test_damaged_or_foreign_object_is_never_served(seaweed):  # noqa: F811
    rng = random.Random(11)
    prefix = "t-" + uuid.uuid4().hex[:10]
    root, geom = rng.randbytes(16), rng.randbytes(8)
    s = SharedBlockStore(seaweed.store(prefix), root, geom, trust=TRUST)
    k1, k2, k3 = rkey(rng), rkey(rng), rkey(rng)
    v1 = rng.randbytes(30_000)
    assert s.publish(k1, v1).status is BlockStatus.WRITTEN
    good = bytes(obstore.get(s.store, block_path(root, geom, k1)).bytes())
    # a truncated object (what a non-atomic writer dying mid-write would leave)
    obstore.put(s.store, block_path(root, geom, k2), good[: len(good) // 2])
    # k1's exact object planted under k3's name: a foreign key
    obstore.put(s.store, block_path(root, geom, k3), good)
    s.refresh_index()
    for k, why in ((k2, "truncated"), (k3, "expected")):
        r = s.fetch(k)
        assert r.status is BlockStatus.LOST and r.payload is None and why in r.reason
        assert k not in s.known
        s.check_integrity()
    # the refused objects were removed, so the block can be published correctly again
    v2 = rng.randbytes(15_000)
    assert s.publish(k2, v2).status is BlockStatus.WRITTEN
    assert s.fetch(k2).payload == v2
    assert s.fetch(k1).payload == v1  # untouched


class GatedBlocks(SharedBlockStore):
    """Its I/O threads wait at a gate before each request, so a test can know that what it
    queued is still queued (a free thread may otherwise finish a request at once)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()

    def publish(self, key, payload, crc=None):
        assert self.gate.wait(30), "the test never opened the gate"
        return super().publish(key, payload, crc)


def test_queue_publishes_and_fetches_off_the_step_path(seaweed):  # noqa: F811
    rng = random.Random(12)
    s = GatedBlocks(seaweed.store(), rng.randbytes(16), b"g",
                    config=ColdTierConfig(io_threads=3, max_queued=5), trust=TRUST)
    q = BlockQueue(s)
    blocks = {rkey(rng): rng.randbytes(rng.randrange(100, 50_000)) for _ in range(5)}
    s.gate.clear()  # hold the I/O threads: all five stay queued
    assert all(q.submit_publish(k, v) for k, v in blocks.items())
    assert q.in_flight == 5
    assert not q.submit_publish(rkey(rng), b"x")  # queue full: refused, nothing queued
    assert q.in_flight == 5
    s.gate.set()
    res = q.drain(30)
    q.check_integrity()
    assert sorted(r.status for r in res) == [BlockStatus.WRITTEN] * 5, [r.reason for r in res]
    assert {r.key for r in res} == set(blocks)  # the refused sixth never ran
    assert not q.submit_publish(next(iter(blocks)), b"y")  # known to exist already
    s.known = type(s.known)(100)  # forget: learn them back from a queued listing
    assert not q.submit_fetch(next(iter(blocks)))
    assert q.submit_refresh()
    (listed,) = q.drain(30)
    assert listed.status is BlockStatus.LISTED and listed.nbytes == 5 and len(s.known) == 5, listed
    assert all(q.submit_fetch(k) for k in blocks)
    got = {r.key: r.payload for r in q.drain(30)}
    assert got == blocks
    q.close(5)
    assert q.closed and not q.submit_delete(next(iter(blocks)))  # closed: refused, not queued
    assert q.in_flight == 0 and q.poll() == []


def test_lease_excludes_second_worker_and_is_taken_over_after_expiry(seaweed):  # noqa: F811
    store = seaweed.store()
    clock = FakeClock(5_000.0)
    cfg = LeaseConfig(ttl_s=30, renew_every_s=10, safety_s=2)
    a = Lease(store, "private/w/LEASE", "worker-a", config=cfg, clock=clock)
    b = Lease(store, "private/w/LEASE", "worker-b", config=cfg, clock=clock)
    a.acquire()
    assert a.held
    with pytest.raises(LeaseHeld, match="held by 'worker-a'"):
        b.acquire()
    clock.t += 20
    assert a.renew() and a.held  # renewed: expires 30 s from now
    clock.t += 25
    with pytest.raises(LeaseHeld):
        b.acquire()  # renewal counted: still held
    clock.t += 6  # past expiry with no renewal
    assert not a.held
    b.acquire()
    assert b.held
    assert not a.renew() and a.info is None and "taken over" in a.lost_reason
    a.check_integrity()
    b.check_integrity()
    assert b.release()
    a.acquire()  # a released lease is free at once
    assert a.held


def test_lease_race_for_an_expired_lease_has_one_winner(seaweed):  # noqa: F811
    store = seaweed.store()
    clock = FakeClock(9_000.0)
    cfg = LeaseConfig(ttl_s=30, renew_every_s=10, safety_s=2)
    Lease(store, "L", "dead", config=cfg, clock=clock).acquire()
    clock.t += 31
    racers = [Lease(store, "L", f"r{i}", config=cfg, clock=clock) for i in range(2)]
    # both read the expired lease; the first conditional put wins, the second gets 412
    stale = racers[0]._read()
    racers[0].acquire()
    with pytest.raises(Exception) as err:
        obstore.put(store, "L", b"{}", mode={"e_tag": stale.e_tag})
    assert "Precondition" in type(err.value).__name__
    with pytest.raises(LeaseHeld):
        racers[1].acquire()


def test_private_prefix_is_exclusive_and_deletes_released_objects(seaweed):  # noqa: F811
    rng = random.Random(13)
    store = seaweed.store()
    clock = FakeClock(1_000.0)
    cfg = LeaseConfig(ttl_s=30, renew_every_s=10, safety_s=2)
    p = PrivatePrefix.open(store, "worker-0", "a", lease_config=cfg, clock=clock, renew=False, trust=TRUST)
    with pytest.raises(LeaseHeld, match="worker-0"):
        PrivatePrefix.open(store, "worker-0", "b", lease_config=cfg, clock=clock, renew=False, trust=TRUST)
    data = {f"req-{i}": rng.randbytes(rng.randrange(1, 40_000)) for i in range(4)}
    for n, v in data.items():
        assert p.put(n, v).status is BlockStatus.WRITTEN
    assert p.names() == sorted(data)
    for n, v in data.items():
        assert p.get(n).payload == v
    assert p.delete("req-0").status is BlockStatus.DELETED
    assert p.get("req-0").status is BlockStatus.LOST and p.names() == sorted(data)[1:]
    with pytest.raises(ValueError, match="object name"):
        p.put("../escape", b"x")
    # lease expires without renewal and is taken over: the old holder can no longer write
    clock.t += 31
    q = PrivatePrefix.open(store, "worker-0", "b", lease_config=cfg, clock=clock, renew=False, trust=TRUST)
    r = p.put("req-1", rng.randbytes(10))
    assert r.status is BlockStatus.SKIPPED and "lease" in r.reason
    assert q.get("req-1").payload == data["req-1"]  # the taker reads what the first one wrote
    assert q.clear() == 3 and q.names() == []
    q.close()


def test_sweeper_caps_shared_bytes_lru_and_only_the_leader_sweeps(seaweed):  # noqa: F811
    rng = random.Random(14)
    prefix = "t-" + uuid.uuid4().hex[:10]
    clock = FakeClock(2_000_000_000.0)  # in the future of every object's last-modified time
    root = rng.randbytes(16)
    s = SharedBlockStore(seaweed.store(prefix), root, b"g", trust=TRUST)
    keys = [rkey(rng) for _ in range(10)]
    vals = [rng.randbytes(10_000) for _ in keys]
    for k, v in zip(keys, vals, strict=True):
        assert s.publish(k, v).status is BlockStatus.WRITTEN
    size = s.object_size(keys[0], 10_000)
    cap = size * 6
    cfg = LeaseConfig(ttl_s=30, renew_every_s=10, safety_s=2)
    leader = Sweeper(s.store, "w0", SweeperConfig(cap_bytes=cap, low_fraction=0.5),
                     lease_config=cfg, clock=clock)
    other = Sweeper(s.store, "w1", SweeperConfig(cap_bytes=cap, low_fraction=0.5),
                    lease_config=cfg, clock=clock)
    # hits on the first three written (read by another worker) make them the most recently used;
    # a reported time is clamped to its report's last-modified time (whole seconds on this
    # store), so the hits come a second after the writes, on the real clock
    time.sleep(1.1)
    log = HitLog("w2")
    reader = SharedBlockStore(s.store, root, b"g", on_hit=log.hook(root, b"g", time.time), trust=TRUST)
    reader.refresh_index()
    for k, v in zip(keys[:3], vals[:3], strict=True):
        assert reader.fetch(k).payload == v
    assert log.flush(s.store)
    assert leader.leader() and not other.leader()
    assert other.sweep_once() is None
    res = leader.sweep_once()
    assert res.total_before == 10 * size and res.total_after <= cap * 0.5
    assert res.deleted == 7 and res.hit_reports == 1
    s.known = type(s.known)(100)
    assert s.refresh_index() == 3
    for k, v in zip(keys[:3], vals[:3], strict=True):
        assert s.fetch(k).payload == v  # the hit blocks survived
    for k in keys[3:]:
        assert s.fetch(k).status is BlockStatus.LOST  # a miss, never wrong bytes
    # under the cap, a pass deletes nothing
    again = leader.sweep_once()
    assert again.deleted == 0 and again.total_after == 3 * size
    leader.close()


def test_zarr_over_the_same_store(seaweed):  # noqa: F811
    import zarr

    zs = open_zarr_store(seaweed.url(), seaweed.options(), timeout_s=5.0)
    rng = np.random.default_rng(15)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    arr = zarr.create_array(zs, name="x", shape=a.shape, chunks=(16, 32), dtype=a.dtype)
    arr[:] = a
    back = zarr.open_array(zs, path="x")[:]
    assert np.array_equal(back, a)


def test_wrong_credentials_raise_unavailable_at_start(seaweed):  # noqa: F811
    from tiering.coldtier import open_s3_store

    with pytest.raises(ColdTierUnavailable, match="PermissionDenied|Unauthenticated|403"):
        open_s3_store(seaweed.url(), seaweed.options(secret="wrong"), timeout_s=5.0)


def test_held_zarr_prefix_is_exclusive(seaweed, closing):  # noqa: F811
    import zarr

    from tiering.coldtier import hold_zarr_prefix

    url = seaweed.url()
    cfg = LeaseConfig(ttl_s=30, renew_every_s=10, safety_s=2)
    a = closing(hold_zarr_prefix(url, seaweed.options(), owner="disk-a", lease_config=cfg, timeout_s=5.0))
    with pytest.raises(LeaseHeld, match="disk-a"):
        hold_zarr_prefix(url, seaweed.options(), owner="disk-b", lease_config=cfg, timeout_s=5.0)
    data = np.random.default_rng(16).standard_normal((8, 8)).astype(np.float32)
    arr = zarr.create_array(a.zarr_store, name="kv", shape=data.shape, chunks=(4, 8), dtype=data.dtype)
    arr[:] = data
    a.close()
    b = hold_zarr_prefix(url, seaweed.options(), owner="disk-b", lease_config=cfg, timeout_s=5.0,
                         renew=False)
    assert np.array_equal(zarr.open_array(b.zarr_store, path="kv")[:], data)
    b.close()


# -- the disk tier's manifest on s3:// in reattach mode: off the step path ---------------------
class _ManifestGate(WrapperStore):
    """Holds every manifest write until ``gate`` opens (bounded), counting the ones it held."""

    def __init__(self, store, gate: threading.Event) -> None:
        super().__init__(store)
        self.gate = gate
        self.held = 0

    def _with_store(self, store):
        return _ManifestGate(store, self.gate)

    async def set(self, key, value) -> None:
        if key.split("/")[-1] == MANIFEST_KEY and not self.gate.is_set():
            self.held += 1
            await asyncio.to_thread(self.gate.wait, 20)
        await self._store.set(key, value)


def test_reattach_manifest_write_on_s3_never_holds_the_step_path(seaweed, geom, closing):  # noqa: F811
    url = seaweed.url() + "/w0"
    cfg = DiskConfig(path=url, capacity_bytes=1 << 20, on_start="reattach", io_timeout_s=5.0,
                     storage_options=seaweed.options(timeout_s=5.0), trust=TRUST)  # a restart
    # reattaches only chunks a deployment secret vouches for
    gen = torch.Generator().manual_seed(61)
    gate = threading.Event()
    gate.set()  # the start-up write goes through
    wrappers = []
    kv = PagedKVCache(geom, device_pages=16, host_pages=16, disk=cfg,
                      disk_wrap_store=lambda s: wrappers.append(_ManifestGate(s, gate)) or wrappers[-1])
    closing(kv)
    closing.call(gate.set)
    data = {rid: fill(kv, rid, gen, n) for rid, n in (("keep", 9), ("gone", 5), ("late", 7))}
    for rid in data:
        assert kv.offload(rid) > 0
    kv.synchronize(30)
    for rid in ("keep", "gone"):  # committed, and listed by a manifest on the store
        assert kv.demote(rid)
    kv.synchronize(30)
    assert getattr(kv.disk, "wait_manifest", lambda t: True)(30)  # (synchronous writes: done)
    gate.clear()  # from now on the store holds every manifest write
    assert kv.demote("late")
    kv._reqs["late"].job.future.result(30)  # the chunks are written; the commit is next
    # the gate holds a manifest write for up to 20 s, past the 5 s I/O timeout: a step-path
    # call that waited on it would time out, failing the demote's commit or the release
    deadline = time.monotonic() + 20
    while kv.tier_of("late") is not Tier.DISK and time.monotonic() < deadline:
        for res in kv.poll():  # applies the demote: its commit asks for a manifest write
            assert res.ok, res.reason
        time.sleep(0.02)
    assert kv.tier_of("late") is Tier.DISK
    kv.remove_request("gone")  # a release of a listed extent: another manifest write
    assert kv.stats.disk_release_faults == 0 and kv.stats.commit_failures == 0
    kv.check_integrity()
    assert wrappers[0].held >= 1 and kv.disk.stats()["manifest_pending"]
    assert kv.disk.stats()["manifest_async"]
    # "gone" is still listed by the manifest on the store: its chunks are not reusable yet
    assert kv.disk.stats()["quarantined_chunks"] == geom.pages_for(5)
    gate.set()
    assert kv.disk.wait_manifest(30)
    st = kv.disk.stats()
    assert not st["manifest_pending"] and not st["manifest_dirty"]
    assert st["quarantined_chunks"] == 0  # the new manifest no longer lists them
    kv.check_integrity()
    gate.set()
    kv.close()
    # what the background writes recorded survives a restart: "late" too, "gone" not
    kv2 = closing(PagedKVCache(geom, device_pages=16, host_pages=16, disk=cfg))
    assert sorted(kv2.requests()) == ["keep", "late"]
    for rid in ("keep", "late"):
        assert kv2.tier_of(rid) is Tier.DISK and kv2.reload(rid)
    kv2.synchronize(30)
    kv2.check_integrity()
    for rid in ("keep", "late"):
        assert_same(kv2, rid, data[rid])
