"""Many worker processes on one real SeaweedFS server, a worker killed mid-write, the server
killed and frozen (SIGSTOP) mid-demote and mid-reload, and a full store."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import time
import uuid

import obstore
import pytest
from seaweed_fixture import _seaweed_shared, seaweed, seaweed_faults, seaweed_tiny  # noqa: F401  (fixtures)

from tiering.coldtier import (
    BlockQueue,
    BlockStatus,
    BreakerConfig,
    ColdTierConfig,
    LeaseConfig,
    LeaseHeld,
    PrivatePrefix,
    SharedBlockStore,
    open_s3_store,
)
from tiering.coldtier.trust import TrustConfig

ROOT = hashlib.sha256(b"test-root").digest()[:16]
GEOM = b"L2H2D8P4bf16"
TRUST = TrustConfig(secret=hashlib.sha256(b"test-secret").digest())


def key_of(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()


def payload_of(key: bytes, lo: int = 1, hi: int = 60_000) -> bytes:
    """Random bytes fixed by the key, so every process can regenerate what was written."""
    rng = random.Random(key)
    return rng.randbytes(rng.randrange(lo, hi))


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- two and four workers sharing a prefix ----------------------------------------------------
def _share_worker(url, opts, index, n, barrier, out):
    store = open_s3_store(url, opts, timeout_s=10.0)
    blocks = SharedBlockStore(store, ROOT, GEOM, config=ColdTierConfig(io_threads=2), trust=TRUST)
    q = BlockQueue(blocks)
    common = [key_of(f"common-{j}") for j in range(12)]
    own = [key_of(f"own-{index}-{j}") for j in range(6)]
    order = common[:] if index % 2 == 0 else common[::-1]  # collide from both ends
    for k in order + own:
        assert q.submit_publish(k, payload_of(k))  # 18 requests: under max_queued
    written = {r.key.hex(): r.status.value for r in q.drain(60)}
    barrier.wait(60)
    blocks.known = type(blocks.known)(10_000)  # forget own writes: learn everything by listing
    listed = blocks.refresh_index()
    everyone = common + [key_of(f"own-{i}-{j}") for i in range(n) for j in range(6)]
    for k in everyone:
        assert q.submit_fetch(k)
    hits = mismatches = 0
    for r in q.drain(60):
        if r.status is BlockStatus.HIT:
            hits += 1
            mismatches += r.payload != payload_of(r.key)
    # negative control: a block of another root is not found
    other = SharedBlockStore(store, b"another-root", GEOM, trust=TRUST)
    foreign = other.fetch(common[0]).status.value
    q.close(10)
    out.put({"index": index, "written": written, "listed": listed, "hits": hits,
             "mismatches": mismatches, "foreign": foreign, "wanted": len(everyone)})


@pytest.mark.parametrize("n", [2, 4])
def test_workers_share_blocks_bitwise(seaweed, n):  # noqa: F811
    url = seaweed.url()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_share_worker, args=(url, seaweed.options(), i, n, barrier, out))
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    for r in results:
        assert r["mismatches"] == 0 and r["hits"] == r["wanted"], r
        assert r["listed"] == 12 + 6 * n
        assert r["foreign"] == "lost"
    # every common block was created by exactly one worker; the others' writes were duplicates
    for j in range(12):
        h = key_of(f"common-{j}").hex()
        statuses = sorted(r["written"][h] for r in results)
        assert statuses == ["duplicate"] * (n - 1) + ["written"], (j, statuses)
    # hits across workers: each worker read the n-1 other workers' own blocks, which it never wrote
    for r in results:
        mine = {key_of(f"own-{r['index']}-{j}").hex() for j in range(6)}
        assert mine <= set(r["written"]) and not any(
            key_of(f"own-{i}-{j}").hex() in r["written"] for i in range(n) if i != r["index"]
            for j in range(6))


# -- a worker killed mid-write ----------------------------------------------------------------
def _victim(url, opts, out):
    store = open_s3_store(url, opts, timeout_s=10.0)
    priv = PrivatePrefix.open(store, "victim", "victim-proc",
                              lease_config=LeaseConfig(ttl_s=60, renew_every_s=5, safety_s=2), trust=TRUST)
    blocks = SharedBlockStore(store, ROOT, GEOM, trust=TRUST)
    i = 0
    while True:  # until killed
        k = key_of(f"victim-{i}")
        blocks.publish(k, payload_of(k, 1 << 20, 3 << 20))
        priv.put(f"req-{i}", payload_of(k + b"p", 1 << 20, 3 << 20))
        out.put(i)
        i += 1


def test_worker_killed_mid_write(seaweed):  # noqa: F811
    url = seaweed.url()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_victim, args=(url, seaweed.options(), out))
    p.start()
    try:
        done = [out.get(timeout=120) for _ in range(3)]
    finally:
        os.kill(p.pid, signal.SIGKILL)  # in the middle of its next pair of writes
        p.join(30)
    assert done == [0, 1, 2]
    store = open_s3_store(url, seaweed.options(), timeout_s=10.0)
    blocks = SharedBlockStore(store, ROOT, GEOM, trust=TRUST)
    listed = blocks.refresh_index()
    assert listed >= 3
    for k in blocks.known.keys():  # whatever is there is whole and right, or it is refused
        r = blocks.fetch(k)
        assert r.status is BlockStatus.HIT, r.reason
        assert r.payload == payload_of(k, 1 << 20, 3 << 20)
    assert {key_of(f"victim-{i}") for i in range(3)} <= set(blocks.known.keys())
    # its lease is still live: a second worker is refused with a clear error ...
    cfg = LeaseConfig(ttl_s=60, renew_every_s=5, safety_s=2)
    with pytest.raises(LeaseHeld, match="victim-proc"):
        PrivatePrefix.open(store, "victim", "heir", lease_config=cfg, renew=False, trust=TRUST)
    # ... and takes it over once it has expired (clock injected: 61 s later)
    later = FakeClock(time.time() + 61)
    heir = PrivatePrefix.open(store, "victim", "heir", lease_config=cfg, clock=later, renew=False, trust=TRUST)
    names = heir.names()
    assert {f"req-{i}" for i in range(3)} <= set(names)
    for n in names:
        i = int(n.split("-")[1])
        r = heir.get(n)
        assert r.status is BlockStatus.HIT and r.payload == payload_of(key_of(f"victim-{i}") + b"p", 1 << 20, 3 << 20)
    assert heir.clear() == len(names)
    heir.close()


# -- the server frozen, then killed, mid-demote and mid-reload --------------------------------
def _fault_tier(srv, clock):
    store = open_s3_store(srv.url(), srv.options(), timeout_s=1.5, max_retries=0)
    cfg = ColdTierConfig(io_threads=2, breaker=BreakerConfig(failure_threshold=1, cooldown_s=5.0))
    blocks = SharedBlockStore(store, ROOT, GEOM, config=cfg, clock=clock, trust=TRUST)
    return blocks, BlockQueue(blocks)


def test_server_frozen_mid_demote_and_mid_reload(seaweed_faults):  # noqa: F811
    clock = FakeClock(100.0)
    blocks, q = _fault_tier(seaweed_faults, clock)
    a = [key_of(f"frozen-a-{i}") for i in range(6)]
    b = [key_of(f"frozen-b-{i}") for i in range(8)]
    for k in a:
        assert blocks.publish(k, payload_of(k)).status is BlockStatus.WRITTEN
    seaweed_faults.freeze()
    try:
        # mid-demote: everything is queued at once; at most one request per I/O thread waits out
        # its timeout, the breaker opens on the first, and the rest are skipped without I/O
        assert all(q.submit_publish(k, payload_of(k)) for k in b)
        res = q.drain(30)
        st = [r.status for r in res]
        assert len(res) == 8 and BlockStatus.WRITTEN not in st
        assert 1 <= st.count(BlockStatus.UNAVAILABLE) <= 2 and st.count(BlockStatus.SKIPPED) >= 6
        assert blocks.breaker.stats().opened == 1
        # while open, the step path's submits are refused at once
        assert not any(q.submit_fetch(k) for k in a)
        # mid-reload, after the cooldown: one trial times out, the others skip; nothing is lost
        clock.t += 5
        assert all(q.submit_fetch(k) for k in a)
        st = [r.status for r in q.drain(30)]
        assert BlockStatus.LOST not in st and BlockStatus.HIT not in st
        assert st.count(BlockStatus.UNAVAILABLE) == 1
        assert all(k in blocks.known for k in a)  # left where they are: a miss now
        blocks.check_integrity()
    finally:
        seaweed_faults.thaw()
    clock.t += 5
    assert q.submit_fetch(a[0])
    assert q.drain(30)[0].status is BlockStatus.HIT  # the trial closes the breaker
    for k in a[1:]:
        assert q.submit_fetch(k)
    got = {r.key: r.payload for r in q.drain(30)}
    assert got == {k: payload_of(k) for k in a[1:]}
    for k in b:  # a timed-out write may have landed after the thaw: then it is a duplicate
        r = blocks.publish(k, payload_of(k))
        assert r.status in (BlockStatus.WRITTEN, BlockStatus.DUPLICATE)
        assert blocks.fetch(k).payload == payload_of(k)
    q.close(10)


def test_server_killed_mid_demote_and_mid_reload(seaweed_faults):  # noqa: F811
    clock = FakeClock(100.0)
    blocks, q = _fault_tier(seaweed_faults, clock)
    a = [key_of(f"killed-a-{i}") for i in range(6)]
    for k in a:
        assert blocks.publish(k, payload_of(k)).status is BlockStatus.WRITTEN
    big = [key_of(f"killed-b-{i}") for i in range(4)]
    for k in big:
        assert q.submit_publish(k, payload_of(k, 4 << 20, 8 << 20))
    seaweed_faults.kill()  # mid-demote
    res = {r.key: r for r in q.drain(30)}
    assert set(res) == set(big)
    assert all(r.status in (BlockStatus.WRITTEN, BlockStatus.UNAVAILABLE, BlockStatus.SKIPPED)
               for r in res.values())
    # mid-reload on a dead server: a miss now, never lost
    clock.t += 5
    for k in a:
        q.submit_fetch(k)
    st = [r.status for r in q.drain(30)]
    assert st and BlockStatus.LOST not in st and BlockStatus.HIT not in st
    assert all(k in blocks.known for k in a)
    seaweed_faults.start()  # same data directory and ports
    clock.t += 5
    for k in a:
        r = blocks.fetch(k)
        assert r.status is BlockStatus.HIT and r.payload == payload_of(k)
    for k in big:
        r = blocks.fetch(k)
        if res[k].status is BlockStatus.WRITTEN:
            assert r.status is BlockStatus.HIT
        # written or not, nothing but the exact bytes is ever handed back
        assert r.status in (BlockStatus.HIT, BlockStatus.LOST)
        if r.status is BlockStatus.HIT:
            assert r.payload == payload_of(k, 4 << 20, 8 << 20)
    blocks.check_integrity()
    q.close(10)


# -- a full store -----------------------------------------------------------------------------
def test_full_store_is_a_refused_write_not_a_loss(seaweed_tiny):  # noqa: F811
    clock = FakeClock(0.0)
    store = open_s3_store(seaweed_tiny.url(), seaweed_tiny.options(), timeout_s=5.0, max_retries=0)
    blocks = SharedBlockStore(store, ROOT, GEOM, clock=clock,
                              config=ColdTierConfig(breaker=BreakerConfig(1, 5.0)), trust=TRUST)
    written: list[bytes] = []
    refused = None
    for i in range(40):
        k = key_of(f"full-{i}")
        r = blocks.publish(k, payload_of(k, 200_000, 300_000))
        if r.status is BlockStatus.WRITTEN:
            written.append(k)
            continue
        refused = (k, r)
        break
    assert refused is not None, "the 1 MB store never filled"
    k, r = refused
    assert r.status is BlockStatus.UNAVAILABLE and "HTTP 500" in r.reason
    assert k not in blocks.known and written
    clock.t += 5
    for k in written:  # what was stored is still served, bitwise
        got = blocks.fetch(k)
        assert got.status is BlockStatus.HIT and got.payload == payload_of(k, 200_000, 300_000)
    # the refused block left nothing behind
    with pytest.raises(FileNotFoundError):
        obstore.head(store, f"blocks/{ROOT.hex()}/{refused[0].hex()}")


def test_no_stray_prefix_is_used(seaweed):  # noqa: F811
    """Everything a shared store writes is under blocks/<root>/ of its own prefix."""
    prefix = "t-" + uuid.uuid4().hex[:10]
    s = SharedBlockStore(seaweed.store(prefix), ROOT, GEOM, trust=TRUST)
    for i in range(3):
        k = key_of(f"stray-{i}")
        assert s.publish(k, payload_of(k)).status is BlockStatus.WRITTEN
    whole = open_s3_store(seaweed.url(""), seaweed.options(), timeout_s=5.0, check=False)
    paths = [m["path"] for c in obstore.list(whole, prefix=prefix + "/", chunk_size=100) for m in c]
    assert len(paths) == 3 and all(p.startswith(f"{prefix}/blocks/{ROOT.hex()}/") for p in paths)
