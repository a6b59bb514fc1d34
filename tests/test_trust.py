"""Trust and bounds on what a worker loads, without a server (obstore's in-memory store).

Each test reproduces one way a worker was handed bytes it should have refused, or wedged, and
checks the refusal: a forged block (keyed MAC), rotation, geometries that must never meet,
bounded reads, a lease whose renewal reply was lost, one reader per queue, the sweeper's
table, pages published before they were written, a retried publish of a damaged page, a
planted symlink, bad device arguments, and roots of any length.
"""

from __future__ import annotations

import hashlib
import json
import os
import random

import obstore
import pytest
import torch
from conftest import random_kv, write_layers
from obstore.store import MemoryStore
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry
from tiering.resources.kv_prefix import derive_key_root

from tiering.coldtier import (
    BlockQueue,
    BlockStatus,
    BreakerConfig,
    ColdTierConfig,
    HitLog,
    Lease,
    LeaseConfig,
    MacKeys,
    PrivatePrefix,
    SharedBlockStore,
    SharedTierConfig,
    Sweeper,
    SweeperConfig,
    TrustConfig,
)
from tiering.coldtier.frame import KIND_BLOCK, FrameRefused, frame, unframe
from tiering.types import Tier

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.float32)
T = GEOM.page_tokens
SECRET = hashlib.sha256(b"deployment secret of test_trust").digest()
TRUST = TrustConfig(secret=SECRET)
ROOT = b"model-7b-rev3"  # an engine's root: any non-empty bytes


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def shared_blocks(mem, geom: KVGeometry = GEOM, root: bytes = ROOT, **kw) -> SharedBlockStore:
    """The shared store a cache of ``geom`` enabled under ``root`` reads and writes."""
    kw.setdefault("trust", TRUST)
    return SharedBlockStore(mem, derive_key_root(root, geom.fingerprint()),
                            geom.fingerprint().encode(), **kw)


def cache(shared=None, geom: KVGeometry = GEOM, device_pages=16, host_pages=8, **kw) -> PagedKVCache:
    kv = PagedKVCache(geom, "cpu", device_pages, host_pages, **kw)
    assert kv.enable_prefix_cache(ROOT, shared=shared)
    return kv


def publish(kv, gen, rid="a", n=13, written=None):
    """A request of ``n`` tokens, its first ``written`` (all) written with random KV, all ``n``
    token ids offered to publish_prefix; returns (ids, data, tokens published)."""
    ids = torch.randint(0, 1000, (n,), generator=gen, dtype=torch.long)
    kv.ingest_request(rid)
    assert kv.allocate(rid, n)
    w = n if written is None else written
    data = random_kv(gen, kv.geometry, w)
    write_layers(kv, rid, data)
    got = kv.publish_prefix(rid, ids)
    kv.check_integrity()
    return ids, data, got


def publish_random(s: SharedBlockStore, rng: random.Random, n: int) -> list[bytes]:
    """``n`` random 16-byte keys, each published to ``s`` with 1,000 random bytes; the keys."""
    keys = [rng.randbytes(16) for _ in range(n)]
    for k in keys:
        assert s.publish(k, rng.randbytes(1000)).status is BlockStatus.WRITTEN
    return keys


def attach_and_land(kv, rid, ids, timeout=10.0) -> int:
    kv.ingest_request(rid)
    kv.attach_prefix(rid, ids)
    kv.synchronize(timeout)
    if kv.is_offloaded(rid):
        assert kv.reload(rid)
        kv.synchronize(timeout)
    kv.check_integrity()
    return kv.num_tokens(rid)


# -- the MAC ----------------------------------------------------------------------------------
def test_mac_binds_every_field_and_rotation_accepts_current_and_previous():
    rng = random.Random(1)
    key, root, geom, payload = rng.randbytes(16), rng.randbytes(16), rng.randbytes(8), rng.randbytes(999)
    old, new = MacKeys(SECRET), MacKeys(rng.randbytes(32), previous=SECRET)
    data = frame(KIND_BLOCK, key, root, geom, payload, keys=old)
    assert bytes(unframe(KIND_BLOCK, data, key, root, geom, keys=new)) == payload  # previous key
    newer = MacKeys(rng.randbytes(32))  # rotated twice: the first key is gone
    with pytest.raises(FrameRefused, match="neither the current nor the previous"):
        unframe(KIND_BLOCK, data, key, root, geom, keys=newer)
    with pytest.raises(FrameRefused, match="no MAC"):
        unframe(KIND_BLOCK, frame(KIND_BLOCK, key, root, geom, payload, keys=None), key, root, geom, keys=old)
    # another payload, framed with a fresh crc, under the same ids: the MAC refuses it
    forged = frame(KIND_BLOCK, key, root, geom, rng.randbytes(999), keys=MacKeys(rng.randbytes(32)))
    forged = forged[:28] + data[28:36] + forged[36:]  # even with our key id copied in
    with pytest.raises(FrameRefused):
        unframe(KIND_BLOCK, forged, key, root, geom, keys=old)


def test_without_a_secret_the_shared_tier_refuses_to_open_unless_told_unauthenticated(monkeypatch):
    mem = MemoryStore()
    monkeypatch.delenv("TIERING_COLDTIER_SECRET", raising=False)
    with pytest.raises(ValueError, match="TIERING_COLDTIER_SECRET.*trust='unauthenticated'"):
        SharedBlockStore(mem, b"r" * 16, b"g")
    with pytest.raises(ValueError, match="TIERING_COLDTIER_SECRET"):
        PrivatePrefix(mem, "p", "o")
    cfg = SharedTierConfig("s3://b/p")  # checked without I/O; the secret is read at open
    with pytest.raises(ValueError, match="deployment secret"):
        cfg.trust.keys()
    assert SharedBlockStore(mem, b"r" * 16, b"g", trust="unauthenticated").keys is None
    monkeypatch.setenv("TIERING_COLDTIER_SECRET", SECRET.hex())
    assert SharedBlockStore(mem, b"r" * 16, b"g").authenticated
    for bad, msg in [({"secret": b"short"}, "at least 16"), ({"trust": "maybe"}, "trust must be"),
                     ({"secret": SECRET, "trust": "unauthenticated"}, "takes no secret"),
                     ({"previous_secret": SECRET}, "needs a current"), ({"secret": 5}, "bytes or str")]:
        with pytest.raises(ValueError, match=msg):
            TrustConfig(**bad)
    assert SECRET.hex() not in repr(TRUST) and repr(SECRET) not in repr(TRUST)


# -- 1. a forged block ------------------------------------------------------------------------
def test_a_forged_block_is_a_miss_counted_never_mapped():
    gen = torch.Generator().manual_seed(11)
    mem = MemoryStore()
    a, b = cache(shared_blocks(mem)), cache(shared_blocks(mem))
    ids, data, got = publish(a, gen)
    assert got == 12
    a.synchronize(10)
    # the adversary can write the bucket: block 1 is replaced by other KV, framed correctly
    # (fresh crc, even the writer's key id), but without the secret
    blocks = a._prefix.shared.blocks
    key = a._prefix.keys(ids)[1]
    other = torch.randn(GEOM.page_shape, generator=gen).contiguous().view(torch.uint8).numpy()
    attacker = MacKeys(os.urandom(32))
    for keys in (None, attacker):
        obstore.delete(mem, blocks.path(key))
        forged = frame(KIND_BLOCK, key, blocks.root, blocks.geometry, other, keys=keys)
        obstore.put(mem, blocks.path(key), forged)
        rid = f"b-{keys is None}"
        b._prefix.shared.known.discard(key)
        b._prefix._refresh()
        b.synchronize(10)
        n = attach_and_land(b, rid, ids)
        assert n == T  # only block 0 (authentic); block 1 refused, recomputed from here
        k, _ = b.read(rid, 0)
        assert torch.equal(k[:T], data[0][0][:T])
        b.remove_request(rid)
    st = b.prefix_stats()
    assert st["shared_lost"] >= 2 and st["shared_fetched"] >= 1
    assert b._prefix.shared.blocks.refusals()["mac"] == 2
    a.close()
    b.close()


# -- 4. geometries never meet -----------------------------------------------------------------
def test_workers_of_two_dtypes_with_one_root_never_share_or_delete_each_others_blocks():
    gen = torch.Generator().manual_seed(4)
    bf = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.bfloat16)
    fp = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.float16)
    assert bf.page_bytes == fp.page_bytes
    mem = MemoryStore()
    a = cache(shared_blocks(mem, bf), geom=bf)
    ids, _, _ = publish(a, gen)
    a.synchronize(10)
    names = sorted(m["path"] for c in obstore.list(mem, prefix="blocks/") for m in c)
    assert len(names) == 3
    b = cache(shared_blocks(mem, fp), geom=fp)
    assert a._prefix.keys(ids) != b._prefix.keys(ids)  # the key root covers the geometry
    b._prefix._refresh()
    b.synchronize(10)
    assert b.cached_prefix(ids).shared == 0  # b sees none of a's blocks
    ids_b, _, _ = publish(b, gen, rid="b")
    b.synchronize(10)
    after = sorted(m["path"] for c in obstore.list(mem, prefix="blocks/") for m in c)
    assert set(names) <= set(after) and len(after) == 6  # nothing of a's was deleted
    c = cache(shared_blocks(mem, bf), geom=bf)  # another bf16 worker still finds a's blocks
    c._prefix._refresh()
    c.synchronize(10)
    assert attach_and_land(c, "c", ids) == 12 and c.prefix_stats()["shared_fetched"] == 3
    for kv in (a, b, c):
        kv.close()


# -- 5. bounded reads -------------------------------------------------------------------------
def test_an_oversized_object_is_refused_unread_for_blocks_private_objects_and_leases():
    rng = random.Random(5)
    mem = MemoryStore()
    s = SharedBlockStore(mem, b"r" * 16, b"g", trust=TRUST, block_bytes=512)
    key = rng.randbytes(16)
    assert s.publish(key, rng.randbytes(512)).status is BlockStatus.WRITTEN
    huge = rng.randbytes(8 << 20)
    obstore.put(mem, s.path(key), huge)  # replaced after the listing recorded its size
    r = s.fetch(key)
    assert r.status is BlockStatus.LOST and "over the frame's maximum" in r.reason and r.nbytes == 0
    assert s.refusals()["oversized"] == 1
    assert s.refresh_index() == 0  # the listing shows its size: it is not taken as a block
    assert s.fetch(key).status is BlockStatus.LOST  # a local miss now (not known)
    p = PrivatePrefix(mem, "w", "me", trust=TRUST, max_object_bytes=1024)
    p.lease.acquire()
    assert p.put("obj", rng.randbytes(1000)).status is BlockStatus.WRITTEN
    obstore.put(mem, "private/w/obj/obj", huge)
    got = p.get("obj")
    assert got.status is BlockStatus.LOST and "over the frame's maximum" in got.reason
    lease = Lease(mem, "L", "me")
    lease.acquire()
    obstore.put(mem, "L", b"{" + b" " * (1 << 20) + b"}")  # a 1 MiB lease: unreadable, not read
    assert lease._read().owner == "<unreadable>"


def test_a_block_of_another_payload_size_is_a_counted_miss_and_left_in_place():
    rng = random.Random(15)
    mem = MemoryStore()
    loose = SharedBlockStore(mem, b"r" * 16, b"g", trust=TRUST)  # no fixed block size
    key = rng.randbytes(16)
    assert loose.publish(key, rng.randbytes(300)).status is BlockStatus.WRITTEN
    s = SharedBlockStore(mem, b"r" * 16, b"g", trust=TRUST, block_bytes=512)
    r = s.fetch(key)
    assert r.status is BlockStatus.LOST and "payload is 300 bytes, a block is 512" in r.reason
    assert s.refusals() == {"size": 1}
    assert loose.fetch(key).status is BlockStatus.HIT  # a valid frame: not deleted


# -- 6. a renewal whose reply was lost --------------------------------------------------------
def test_a_renewal_that_landed_without_its_reply_keeps_the_lease():
    mem = MemoryStore()
    clock = FakeClock(1000.0)
    cfg = LeaseConfig(ttl_s=30, renew_every_s=10, safety_s=2)
    lease = Lease(mem, "p/LEASE", "worker-a", config=cfg, clock=clock)
    info = lease.acquire()
    clock.t += 10
    # the renewal reached the store (our token, a new ETag) but its reply never came back
    body = json.dumps({"owner": "worker-a", "token": info.token, "expires_at": clock.t + 30}).encode()
    obstore.put(mem, "p/LEASE", body, mode={"e_tag": info.e_tag})
    clock.t += 10
    assert lease.renew()  # 412, re-read: still our token, renewed on the new ETag
    assert lease.held and lease.info.e_tag != info.e_tag
    clock.t += 10
    assert lease.renew()  # and it goes on renewing
    # negative control: another worker's token in the lease is a takeover
    theirs = json.dumps({"owner": "worker-b", "token": "feedbeef", "expires_at": clock.t + 30}).encode()
    obstore.put(mem, "p/LEASE", theirs)
    assert not lease.renew() and not lease.held
    assert "taken over" in lease.lost_reason and "worker-b" in lease.lost_reason


# -- 7. one reader per queue ------------------------------------------------------------------
def test_a_block_queue_given_to_a_second_cache_is_refused_by_name():
    mem = MemoryStore()
    q = BlockQueue(shared_blocks(mem))
    a = cache(q)
    b = PagedKVCache(GEOM, "cpu", 16, 8)
    with pytest.raises(ValueError, match=r"BlockQueue is already used by PagedKVCache at 0x"):
        b.enable_prefix_cache(ROOT, shared=q)
    assert not b.prefix_enabled  # refused before anything was built
    a.close()  # a releases its claim: the queue may now serve b
    assert b.enable_prefix_cache(ROOT, shared=q)
    b.check_integrity()
    b.close()
    q.close(5)


# -- 8. the sweeper's table -------------------------------------------------------------------
def test_the_sweeper_forgets_unknown_blocks_and_clamps_reported_times():
    import time

    rng = random.Random(8)
    mem = MemoryStore()
    s = SharedBlockStore(mem, b"r" * 16, b"g", trust=TRUST)
    old = publish_random(s, rng, 4)
    log = HitLog("fast-clock")
    log.record(s.root, s.geometry, old[0], 1e15)  # a worker whose clock counts microseconds
    for _ in range(5000):  # and reports for blocks that do not exist
        log.record(s.root, s.geometry, rng.randbytes(16), time.time())
    assert log.flush(mem)
    time.sleep(1.1)  # store times have whole seconds: the new blocks are strictly newer
    new = publish_random(s, rng, 2)
    size = s.object_size(old[0], 1000)
    sw = Sweeper(mem, "sweeper", SweeperConfig(cap_bytes=3 * size, low_fraction=0.67))
    res = sw.sweep_once()
    assert res.deleted == 4 and res.hit_reports == 1
    assert len(sw._recency) <= 2  # only blocks the listing found are remembered
    s.known = type(s.known)(100)
    assert s.refresh_index() == 2
    for k in new:  # the newest survive; the block reported with a far-future time does not
        assert s.fetch(k).status is BlockStatus.HIT
    assert s.fetch(old[0]).status is BlockStatus.LOST
    sw.close()


# -- 3. pages allocated but never written -----------------------------------------------------
def test_only_written_pages_are_published_by_publish_prefix_and_extend_prefix_chain():
    gen = torch.Generator().manual_seed(3)
    kv = cache()
    ids, data, got = publish(kv, gen, rid="a", n=13, written=T)  # one page written of four
    assert got == T
    assert kv.cached_prefix(ids).tokens == T
    assert kv.prefix_stats()["publish_unwritten_pages"] == 2
    # the chain hook: 13 tokens allocated, the first 4 written, the whole chain offered
    kv.ingest_request("b")
    assert kv.allocate("b", 13)
    ids_b = torch.randint(0, 1000, (13,), generator=gen, dtype=torch.long)
    write_layers(kv, "b", random_kv(gen, GEOM, T))
    kv.extend_prefix_chain("b", None, None, ids_b)
    assert kv.cached_prefix(ids_b).tokens == T
    # an in-place writer says what it wrote: then its pages are published
    kv.mark_written("b", 13)
    kv.extend_prefix_chain("b", None, None, [])
    assert kv.cached_prefix(ids_b).tokens == 12
    # one layer short is not written: layer 1 of request c misses its second page
    kv.ingest_request("c")
    assert kv.allocate("c", 9)
    full = random_kv(gen, GEOM, 8)
    kv.write("c", 0, 0, *full[0])
    kv.write("c", 1, 0, full[1][0][:T], full[1][1][:T])
    ids_c = torch.randint(0, 1000, (9,), generator=gen, dtype=torch.long)
    assert kv.publish_prefix("c", ids_c) == T
    kv.check_integrity()
    kv.close()


# -- 2. a retried publish of a page damaged since ---------------------------------------------
def test_a_retried_publish_of_a_page_damaged_on_the_host_is_not_uploaded():
    gen = torch.Generator().manual_seed(2)
    mem = MemoryStore()
    clock = FakeClock()
    blocks = shared_blocks(mem, clock=clock, config=ColdTierConfig(breaker=BreakerConfig(cooldown_s=5.0)))
    kv = cache(blocks, device_pages=4, host_pages=8, clock=clock)
    kv.synchronize(10)  # the first listing is done (its success would close the breaker)
    blocks.breaker.record_failure()  # the store stopped answering: the breaker is open
    ids, _, got = publish(kv, gen, rid="a", n=13)
    assert got == 12 and kv.prefix_stats()["shared_publish_refused"] == 3
    kv.remove_request("a")
    kv.ingest_request("b")
    assert kv.allocate("b", 16)  # needs every device page: the blocks move to the host
    keys = kv._prefix.keys(ids)
    loc = kv._prefix.index.location(keys[1])
    assert loc.tier is Tier.HOST
    kv._host[loc.handle].view(torch.uint8).view(-1)[17] ^= 0x10  # a bit flips there
    clock.t += 10  # past the cooldown: polls retry the refused publishes (the first is the
    # breaker's trial, so the others may wait for a later poll)
    for _ in range(50):
        kv.poll()
        kv.synchronize(10)
        if not kv._prefix.unpublished and kv._prefix.shared.queue.in_flight == 0:
            break
    kv.poll()
    assert not kv._prefix.unpublished
    stored = {m["path"] for c in obstore.list(mem, prefix="blocks/") for m in c}
    assert blocks.path(keys[1]) not in stored  # the damaged page never left
    assert blocks.path(keys[0]) in stored and blocks.path(keys[2]) in stored  # the control
    st = kv.prefix_stats()
    assert st["shared_publish_corrupt"] == 1 and st["shared_publish_retried"] >= 2
    kv.close()


# -- 9. local files ---------------------------------------------------------------------------
def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(tmp_path):
    from tiering.disk.lock import LocalDirLock

    victim = tmp_path / "precious.txt"
    victim.write_text("do not truncate me")
    d = tmp_path / "tier"
    d.mkdir()
    (d / ".tiering.lock").symlink_to(victim)
    with pytest.raises(OSError, match="symlink"):
        LocalDirLock(d).acquire()
    assert victim.read_text() == "do not truncate me"
    os.mkfifo(d / "fifo")
    lock = LocalDirLock(d)
    lock.path = d / "fifo"
    with pytest.raises(OSError, match="not a regular file"):
        lock.acquire()
    clean = LocalDirLock(tmp_path / "clean")  # the control: a fresh directory locks
    clean.acquire()
    assert clean.held
    clean.release()


def test_the_vllm_state_file_is_never_written_through_a_planted_name(tmp_path):
    from tiering.integrations.vllm._config import _write_json

    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = tmp_path / "state.json"
    (tmp_path / f"state.json.{os.getpid()}.tmp").symlink_to(victim)
    _write_json(str(path), {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert victim.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["victim", "state.json", f"state.json.{os.getpid()}.tmp"])  # no temporary file left


# -- 10. the device argument ------------------------------------------------------------------
@pytest.mark.parametrize("device", [8, "bogus", "cuda:x", None, 1.5])
def test_a_bad_device_is_a_value_error_naming_the_field(device):
    from tiering import TieredKVConfig

    with pytest.raises(ValueError, match="PagedKVCache: device"):
        PagedKVCache(GEOM, device, 4, 4)
    with pytest.raises((ValueError, TypeError), match="TieredKVConfig.*device"):
        TieredKVConfig(geometry=GEOM, device=device)


# -- 11. any root -----------------------------------------------------------------------------
@pytest.mark.parametrize("root", [hashlib.sha256(b"m").digest(), b"llama", b"\x00", bytes(random.Random(7).randrange(256) for _ in range(100))],
                         ids=["sha256", "tag", "one-byte", "random-100"])
def test_any_non_empty_root_is_taken_and_the_key_root_covers_the_geometry(root):
    gen = torch.Generator().manual_seed(len(root))
    kv = PagedKVCache(GEOM, "cpu", 16, 8)
    assert kv.enable_prefix_cache(root)
    ids, data, got = publish(kv, gen)
    assert got == 12
    assert attach_and_land(kv, "b", ids) == 12 and kv.prefix_stats()["hit_tokens_device"] == 12
    half = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.float16)
    other = PagedKVCache(half, "cpu", 4, 4)
    assert other.enable_prefix_cache(root)
    assert set(other._prefix.keys(ids)).isdisjoint(kv._prefix.keys(ids))
    with pytest.raises(ValueError, match="root must be non-empty bytes"):
        PagedKVCache(GEOM, "cpu", 4, 4).enable_prefix_cache(b"")
    kv.close()
    other.close()


def test_a_shared_store_of_another_page_size_is_refused():
    mem = MemoryStore()
    s = shared_blocks(mem, block_bytes=GEOM.page_bytes * 2)
    with pytest.raises(ValueError, match="blocks are .* bytes, the cache's pages"):
        cache(s)


def test_the_sweeper_does_not_read_an_oversized_hit_report():
    """A report past MAX_REPORT_BYTES is dropped unread: the hit it carries (made after every
    block was written, so it would be believed) does not keep its block."""
    import time

    from tiering.coldtier.sweeper import MAX_REPORT_BYTES

    rng = random.Random(9)
    mem = MemoryStore()
    s = SharedBlockStore(mem, b"r" * 16, b"g", trust=TRUST)
    keys = publish_random(s, rng, 3)
    rel = s.path(keys[0])[len("blocks/"):]
    pad = {f"pad-{i:08d}": 1.0 for i in range(MAX_REPORT_BYTES // 16)}
    report = json.dumps({rel: time.time(), **pad}).encode()
    assert len(report) > MAX_REPORT_BYTES
    obstore.put(mem, "hits/big/000000000001-x", report)
    size = s.object_size(keys[0], 1000)
    sw = Sweeper(mem, "sweeper", SweeperConfig(cap_bytes=2 * size, low_fraction=0.5))
    res = sw.sweep_once()
    assert res.hit_reports == 1 and res.deleted == 2
    assert not list(obstore.list(mem, prefix="hits/"))  # dropped: it is not read again
    s.known = type(s.known)(100)
    s.refresh_index()
    assert s.fetch(keys[0]).status is BlockStatus.LOST  # the oldest went, its report unread
    assert s.fetch(keys[2]).status is BlockStatus.HIT
    sw.close()
