"""PagedKVCache's prefix cache on the shared cold tier.

Two workers with the same root share published blocks through the object store: worker A
publishes random KV, worker B (another process, or another cache with its own disk) attaches
and reads it bitwise. The counters prove the shared path ran (``shared_fetched``, no local
hit). Negative controls: another root finds nothing; a damaged object is refused and the
request keeps only the blocks before it; a frozen server makes the fetch a miss without any
call on the step path waiting. The first tests run against a real SeaweedFS server
(``seaweed_fixture``); the rest use obstore's in-memory store with gates and faults, and a
hypothesis state machine. ``check_integrity`` runs after every operation.

Size: over 700 lines: every shared-tier behaviour shares the gated store, ``pair`` and
``share`` helpers defined here.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import obstore
import pytest
import torch
from conftest import assert_leading, write_random
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from obstore.store import MemoryStore
from seaweed_fixture import _seaweed_shared, seaweed, seaweed_faults  # noqa: F401  (fixtures)
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry
from tiering.resources.kv_prefix import derive_key_root

from tiering.blocks import KeyRoot
from tiering.coldtier import (
    BlockQueue,
    BlockStatus,
    BreakerConfig,
    ColdTierConfig,
    SharedBlockStore,
    SharedTierConfig,
    block_path,
    frame,
)
from tiering.coldtier.frame import KIND_BLOCK
from tiering.coldtier.trust import TrustConfig
from tiering.disk import DiskConfig
from tiering.types import RequestState

S = RequestState
GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4)
T = GEOM.page_tokens
GEOM_ID = GEOM.fingerprint().encode()


TRUST = TrustConfig(secret=b"the-deployment-secret-of-these-tests")


def root(model: str = "m") -> KeyRoot:
    return KeyRoot(GEOM.fingerprint(), model, page_tokens=T)


def key_root(model: str = "m") -> bytes:
    """The root a cache of ``root(model)`` keys its blocks (and names its objects) under."""
    return derive_key_root(root(model).key, GEOM.fingerprint())


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(disk_dir=None, shared=None, model="m", device_pages=16, host_pages=8, **kw):
    disk = None
    if disk_dir is not None:
        disk = DiskConfig(path=str(disk_dir), capacity_bytes=32 * GEOM.page_bytes,
                          chunk_bytes=2 * GEOM.page_bytes)
    kv = PagedKVCache(GEOM, "cpu", device_pages, host_pages, disk=disk, **kw)
    assert kv.enable_prefix_cache(root(model), shared=shared)
    kv.check_integrity()
    return kv


def publish_random(kv, gen, rid="a", n=13):
    ids = torch.randint(0, 1000, (n,), generator=gen, dtype=torch.long)
    kv.ingest_request(rid)
    data = write_random(kv, rid, gen, n)
    assert kv.publish_prefix(rid, ids) == (n // T) * T
    kv.check_integrity()
    return ids, data


def admit(kv, rid) -> bool:
    return bool(kv.admit(ResourceStep(rid), StepContext()))


def load(kv, rid, timeout=30.0):
    """Sync until the request's fetches land, reload it, sync until it is resident."""
    kv.synchronize(timeout)
    kv.check_integrity()
    if kv.is_offloaded(rid):
        assert not admit(kv, rid)
        assert kv.reload(rid)
        kv.check_integrity()
        kv.synchronize(timeout)
        kv.check_integrity()
    assert admit(kv, rid)


def relist(kv) -> None:
    """List the shared tier now and wait for it (after any listing still out: a listing
    already queued would refuse a second one and might have run before the last writes)."""
    kv.synchronize(30)
    kv._prefix._refresh()
    kv.synchronize(30)
    kv.check_integrity()


def local_hits(st: dict) -> int:
    return st["hit_tokens_device"] + st["hit_tokens_host"] + st["hit_tokens_disk"]


# -- against the real server ------------------------------------------------------------------
def _publisher(url, opts, seed, out):
    """Worker A in its own process: publish random KV under the common root, send it back."""
    gen = torch.Generator().manual_seed(seed)
    with make(shared=SharedTierConfig(url, opts, trust=TRUST)) as kv:
        ids, data = publish_random(kv, gen, n=17)
        kv.synchronize(60)
        raw = [(k.view(torch.int16).numpy(), v.view(torch.int16).numpy()) for k, v in data]
        out.put({"ids": ids.numpy(), "data": raw,
                 "stats": kv.prefix_stats()})


def test_two_worker_processes_share_a_prefix_bitwise(seaweed, tmp_path, closing):  # noqa: F811
    url, opts = seaweed.url(), seaweed.options()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_publisher, args=(url, opts, 11, out))
    p.start()
    try:
        got, deadline = None, time.monotonic() + 180
        while got is None and time.monotonic() < deadline:
            try:
                got = out.get(timeout=1)
            except Exception:  # queue.Empty: keep waiting while the worker lives
                if not p.is_alive():
                    break
        assert got is not None, "the publishing worker sent nothing"
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert got["stats"]["shared_published"] == 4 and got["stats"]["shared_publish_failed"] == 0
    ids = torch.from_numpy(got["ids"])
    data = [(torch.from_numpy(k).view(GEOM.dtype), torch.from_numpy(v).view(GEOM.dtype))
            for k, v in got["data"]]

    kv_b = closing(make(tmp_path / "b", shared=SharedTierConfig(url, opts, trust=TRUST)))
    kv_c = closing(make(tmp_path / "c", shared=SharedTierConfig(url, opts, trust=TRUST), model="other"))  # another root
    kv_n = closing(make(tmp_path / "n"))  # no shared tier
    for kv in (kv_b, kv_c, kv_n):
        kv.synchronize(30)  # the first listing of the root's blocks lands
        kv.check_integrity()
    hit = kv_b.cached_prefix(ids)
    assert (hit.tokens, hit.shared, hit.device + hit.host + hit.disk) == (16, 16, 0)
    kv_b.ingest_request("b")
    assert kv_b.attach_prefix("b", ids) == 16
    kv_b.check_integrity()
    assert kv_b.is_offloaded("b") and not admit(kv_b, "b")
    load(kv_b, "b")
    assert kv_b.num_tokens("b") == 16
    assert_leading(kv_b, "b", data, 16)
    st = kv_b.prefix_stats()
    assert st["shared_fetched"] == 4 and st["hit_tokens_shared"] == 16
    assert local_hits(st) == 0 and st.get("blocks_published", 0) == 0  # none was B's own
    assert st["shared_lost"] == st["shared_unavailable"] == 0
    # B goes on from the hit: its own tail, then it publishes; the shared blocks are known
    write_random(kv_b, "b", torch.Generator().manual_seed(5), 1, start=16)
    kv_b.check_integrity()
    # negative controls: another root, and no shared tier, find nothing for the same tokens
    for kv in (kv_c, kv_n):
        assert kv.cached_prefix(ids).tokens == 0
        kv.ingest_request("x")
        assert kv.attach_prefix("x", ids) == 0
        kv.check_integrity()
    assert kv_c.prefix_stats()["shared_fetched"] == 0
    assert kv_c.prefix_stats()["shared_refreshes"] >= 1  # it did look


def test_two_caches_share_and_a_duplicate_is_harmless(seaweed, tmp_path, closing):  # noqa: F811
    gen = torch.Generator().manual_seed(21)
    cfg = SharedTierConfig(seaweed.url(), seaweed.options(), trust=TRUST)
    kv_a, kv_b = make(tmp_path / "a", shared=cfg), make(tmp_path / "b", shared=cfg)
    closing(kv_a)
    closing(kv_b)
    kv_b.synchronize(30)  # B lists before A publishes: it knows nothing yet
    ids, data = publish_random(kv_a, gen, n=9)
    kv_a.synchronize(30)
    assert kv_a.prefix_stats()["shared_published"] == 2
    # B computed the same prefix itself (the same bytes): its publish finds them there
    kv_b.ingest_request("same")
    assert kv_b.allocate("same", 9)
    for layer, (k, v) in enumerate(data):
        kv_b.write("same", layer, 0, k, v)
    kv_b.publish_prefix("same", ids)
    kv_b.synchronize(30)
    st = kv_b.prefix_stats()
    assert st["shared_duplicates"] == 2 and st["shared_published"] == 0
    # A's objects hold exactly A's pages, framed; B's duplicate changed none of them
    for key in kv_a._prefix.keys(ids)[:2]:
        raw = obstore.get(kv_a._prefix.shared.blocks.store, block_path(kv_a._prefix.key_root, GEOM_ID, key)).bytes()
        assert raw == frame(KIND_BLOCK, key, kv_a._prefix.key_root, GEOM_ID, _page_bytes(data, key, kv_a, ids),
                            keys=TRUST.keys())


def _page_bytes(data, key, kv, ids) -> bytes:
    """The bytes of the page ``key`` names, built from the K/V written (what a page holds)."""
    i = kv._prefix.keys(ids).index(key)
    page = torch.empty(GEOM.page_shape, dtype=GEOM.dtype)
    for layer, (k, v) in enumerate(data):
        page[layer, 0] = k[i * T:(i + 1) * T].reshape(page[layer, 0].shape)
        page[layer, 1] = v[i * T:(i + 1) * T].reshape(page[layer, 1].shape)
    return page.contiguous().view(torch.uint8).numpy().tobytes()


def test_damaged_shared_object_is_refused_and_recomputed(seaweed, tmp_path):  # noqa: F811
    gen = torch.Generator().manual_seed(31)
    cfg = SharedTierConfig(seaweed.url(), seaweed.options(), trust=TRUST)
    for damage in (False, True):  # the first pass is the control: nothing damaged, all hit
        with (make(tmp_path / f"a{damage}", shared=cfg, model=f"m{damage}") as kv_a,
              make(tmp_path / f"b{damage}", shared=cfg, model=f"m{damage}") as kv_b):
            ids, data = publish_random(kv_a, gen, n=13)
            kv_a.synchronize(30)
            keys = kv_a._prefix.keys(ids)
            store, rt = kv_a._prefix.shared.blocks.store, kv_a._prefix.key_root
            if damage:  # overwrite block 1 with the raw client: one payload byte changes
                raw = bytearray(obstore.get(store, block_path(rt, GEOM_ID, keys[1])).bytes())
                raw[len(raw) // 2] ^= 0x40
                obstore.put(store, block_path(rt, GEOM_ID, keys[1]), bytes(raw))
            relist(kv_b)
            kv_b.ingest_request("b")
            assert kv_b.attach_prefix("b", ids) == 12  # optimistic until fetched
            load(kv_b, "b")
            st = kv_b.prefix_stats()
            valid = kv_b.num_tokens("b")
            assert valid == (4 if damage else 12)
            assert_leading(kv_b, "b", data, valid)
            assert local_hits(st) == 0
            if not damage:
                assert st["shared_fetched"] == 3 and st["shared_lost"] == 0
                continue
            assert st["shared_fetched"] == 1 and st["shared_lost"] == 1
            assert st["load_shared_lost"] == 1
            # the refused object was deleted (it can be published again); block 2 was let go
            with pytest.raises(FileNotFoundError):
                obstore.head(store, block_path(rt, GEOM_ID, keys[1]))
            assert keys[1] not in kv_b._prefix.index and keys[2] not in kv_b._prefix.index
            # B recomputes the rest from the valid count: its own pages, its own bytes
            kv_b.check_integrity()
            assert kv_b.allocate("b", 13)
            for layer, (k, v) in enumerate(data):
                kv_b.write("b", layer, 4, k[4:13], v[4:13])
            assert_leading(kv_b, "b", data, 13)
            assert kv_b.publish_prefix("b", ids) == 12
            kv_b.synchronize(30)
            assert kv_b.prefix_stats()["shared_published"] == 1  # block 1 written again
            kv_b.check_integrity()


def test_frozen_server_mid_fetch_is_a_miss_and_no_step_waits(seaweed_faults, tmp_path, closing):  # noqa: F811
    srv = seaweed_faults
    gen = torch.Generator().manual_seed(41)
    url = srv.url()
    kv_a = closing(make(shared=SharedTierConfig(url, srv.options(), trust=TRUST)))
    clock = FakeClock()
    cfg_b = SharedTierConfig(url, srv.options(timeout_s=1.5, max_retries=0),
                             ColdTierConfig(io_threads=2, breaker=BreakerConfig(1, cooldown_s=5.0)), trust=TRUST)
    kv_b = closing(make(tmp_path / "b", shared=cfg_b, clock=clock))
    ids, data = publish_random(kv_a, gen, n=13)
    kv_a.synchronize(30)
    relist(kv_b)
    assert kv_b.cached_prefix(ids).shared == 12
    srv.freeze()
    try:
        # the store cannot answer before the client's 1.5 s timeout: a step-path call that
        # waited on it would return with the fetch settled. Each returns with it still out.
        rec = kv_b._reqs

        def out_after(fn, *a):
            result = fn(*a)
            assert kv_b._prefix.fetch_pending(rec["b"]), f"{fn.__name__} waited on the store"
            return result

        kv_b.ingest_request("b")
        assert out_after(kv_b.attach_prefix, "b", ids) == 12
        assert not out_after(admit, kv_b, "b")
        assert not out_after(kv_b.reload, "b")  # not yet: the fetch is out
        out_after(kv_b.poll)
        deadline = time.monotonic() + 20
        while kv_b._prefix.fetch_pending(rec["b"]) and time.monotonic() < deadline:
            assert not admit(kv_b, "b")
            kv_b.poll()
            kv_b.check_integrity()
            time.sleep(0.05)
        assert not kv_b._prefix.fetch_pending(rec["b"])
        st = kv_b.prefix_stats()
        assert st["shared_fetched"] == 0 and st["shared_unavailable"] == 3
        assert st["shared_reload_waits"] >= 1
        assert kv_b._prefix.shared.blocks.breaker.stats().opened == 1
        # the request keeps nothing of the prefix: it is a miss, recomputed from token 0
        assert kv_b.reload("b")
        kv_b.synchronize(10)
        assert admit(kv_b, "b") and kv_b.num_tokens("b") == 0
        kv_b.check_integrity()
        # while the breaker is open, a lookup and an attach ask nothing of the store
        assert kv_b.cached_prefix(ids).shared == 0
        kv_b.ingest_request("b2")
        assert kv_b.attach_prefix("b2", ids) == 0
        assert kv_b._prefix.shared.blocks.breaker.stats().opened == 1
    finally:
        srv.thaw()
    # the blocks were left where they are: after the cooldown one trial fetch goes out (the
    # request's other fetches are skipped, so it keeps one block) and closes the breaker
    clock.t += 6
    kv_b.ingest_request("b3")
    assert kv_b.attach_prefix("b3", ids) == 12
    load(kv_b, "b3")
    assert kv_b.num_tokens("b3") == 4
    assert kv_b.prefix_stats()["shared_fetched"] == 1
    kv_b.ingest_request("b4")
    assert kv_b.attach_prefix("b4", ids) == 12  # block 0 is local now, 1 and 2 fetched
    load(kv_b, "b4")
    assert kv_b.num_tokens("b4") == 12
    assert_leading(kv_b, "b4", data, 12)
    st = kv_b.prefix_stats()
    assert st["shared_fetched"] == 3 and local_hits(st) == 4  # block 0: b3's, now local
    assert kv_b._prefix.shared.blocks.breaker.stats().opened == 1


# -- in memory: gates, faults, bad input, and a state machine ---------------------------------
class GatedBlocks(SharedBlockStore):
    """A block store whose fetches wait for ``gate`` (bounded), then fail as ``mode`` says."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.gate.set()
        self.mode = "ok"  # "ok" | "unavailable"
        self.fetches = 0
        self.pub_gate = threading.Event()
        self.pub_gate.set()

    def publish(self, key: bytes, payload, crc=None):
        assert self.pub_gate.wait(10), "test publish gate never opened"
        return super().publish(key, payload, crc)

    def fetch(self, key: bytes):
        self.fetches += 1
        assert self.gate.wait(10), "test gate never opened"
        if self.mode == "unavailable":
            from tiering.coldtier import BlockResult

            return BlockResult("fetch", key, BlockStatus.UNAVAILABLE, reason="injected timeout")
        return super().fetch(key)


def pair(host_pages=8, device_pages=16, io_threads=1, max_queued=256):
    """Worker A and worker B on one in-memory store; B's fetches and publishes can be gated."""
    mem = MemoryStore()
    rt = key_root()
    cfg = ColdTierConfig(io_threads=io_threads)
    a = make(shared=SharedBlockStore(mem, rt, GEOM_ID, config=cfg, trust=TRUST))
    gated = GatedBlocks(mem, rt, GEOM_ID, config=ColdTierConfig(io_threads=io_threads, max_queued=max_queued), trust=TRUST)
    b = make(shared=gated, host_pages=host_pages, device_pages=device_pages)
    return mem, a, b, gated


def closed_pair(closing):
    """``pair()`` for one test: both workers are closed at its end by ``closing``, after B's
    gate is opened (a held fetch would otherwise keep B's close waiting)."""
    mem, a, b, gated = pair()
    closing(a)
    closing(b)
    closing.call(gated.gate.set)
    return mem, a, b, gated


def share(a, b, gen, n=13):
    ids, data = publish_random(a, gen, n=n)
    a.synchronize(10)
    relist(b)
    return ids, data


def attach_with_fetches_held(a, b, gated, gen):
    """A publishes 13 tokens; B's fetches are held at the gate while "b" attaches 12 of them."""
    ids, data = share(a, b, gen)
    gated.gate.clear()
    b.ingest_request("b")
    assert b.attach_prefix("b", ids) == 12
    return ids, data


def test_reload_refuses_while_a_fetch_is_out_then_loads_bitwise(closing):
    gen = torch.Generator().manual_seed(51)
    _, a, b, gated = closed_pair(closing)
    ids, data = attach_with_fetches_held(a, b, gated, gen)
    b.check_integrity()
    for _ in range(3):
        b.poll()
        assert not admit(b, "b") and not b.reload("b")
        b.check_integrity()
    assert b.prefix_stats()["shared_reload_waits"] == 3
    assert b.state_of("b") is S.ON_DISK and b.reload_bytes("b") == 3 * GEOM.page_bytes
    gated.gate.set()
    load(b, "b")
    assert b.num_tokens("b") == 12
    assert_leading(b, "b", data, 12)
    st = b.prefix_stats()
    assert st["shared_fetched"] == 3 and local_hits(st) == 0 and st["blocks_host_to_device"] == 3


def test_synchronize_names_a_held_fetch_and_the_timeout_it_was_given(closing):
    gen = torch.Generator().manual_seed(53)
    _, a, b, gated = closed_pair(closing)
    ids, data = attach_with_fetches_held(a, b, gated, gen)
    with pytest.raises(TimeoutError, match=r"shared tier's fetches or publishes still in "
                                           r"flight after 0\.2s"):
        b.synchronize(0.2)  # the fetch is held: the wait cannot end with it applied
    b.check_integrity()
    assert b._prefix.fetch_pending(b._reqs["b"])  # nothing was given up
    gated.gate.set()
    load(b, "b")
    assert b.num_tokens("b") == 12
    assert_leading(b, "b", data, 12)
    assert b.prefix_stats()["shared_fetched"] == 3


def test_a_removed_requests_fetch_lands_as_a_host_block_or_is_adopted(closing):
    gen = torch.Generator().manual_seed(52)
    _, a, b, gated = closed_pair(closing)
    ids, data = attach_with_fetches_held(a, b, gated, gen)
    b.remove_request("b")  # its fetches are let go, still in flight
    b.check_integrity()
    assert b.cached_prefix(ids).shared == 12  # let-go fetches can be taken up again
    b.ingest_request("c")
    assert b.attach_prefix("c", ids) == 12  # adopts the fetches in flight: no new request
    assert b.prefix_stats()["shared_fetch_adopted"] == 3
    b.remove_request("c")
    b.check_integrity()
    gated.gate.set()
    b.synchronize(10)
    b.check_integrity()
    st = b.prefix_stats()
    assert st["shared_prefetched"] == 3 and st["shared_fetched"] == 0
    assert gated.fetches == 3  # one fetch per block, whoever waited for it
    hit = b.cached_prefix(ids)
    assert (hit.host, hit.shared) == (12, 0)  # now local host blocks
    b.ingest_request("d")
    assert b.attach_prefix("d", ids) == 12
    load(b, "d")
    assert_leading(b, "d", data, 12)
    assert b.prefix_stats()["hit_tokens_host"] == 12 and gated.fetches == 3


def test_an_unavailable_fetch_keeps_the_blocks_before_it(closing):
    gen = torch.Generator().manual_seed(53)
    for fail in (False, True):  # the control first: nothing fails, everything lands
        _, a, b, gated = closed_pair(closing)
        ids, data = share(a, b, gen)
        b.ingest_request("p")  # block 0 made local on B first: B's own copy of A's page
        assert b.attach_prefix("p", ids[:5]) == 4
        load(b, "p")
        b.remove_request("p")
        gated.mode = "unavailable" if fail else "ok"
        b.ingest_request("b")
        assert b.attach_prefix("b", ids) == 12  # block 0 local, 1 and 2 fetched
        load(b, "b")
        st = b.prefix_stats()
        valid = b.num_tokens("b")
        assert valid == (4 if fail else 12)
        assert_leading(b, "b", data, valid)
        assert st["shared_unavailable"] == (2 if fail else 0)
        if fail:  # still known remotely: a miss now, a retry later
            assert all(k in b._prefix.shared.known for k in b._prefix.keys(ids)[1:3])
            assert st["load_shared_unavailable"] == 1
        a.close()
        b.close()


def test_bad_shared_input_is_refused_and_changes_nothing():
    mem = MemoryStore()
    rt = key_root()
    with PagedKVCache(GEOM, "cpu", 4, 4) as kv:
        bad = [
            ("s3://bucket/p", "SharedTierConfig, SharedBlockStore or BlockQueue"),
            (SharedBlockStore(mem, b"x" * 16, GEOM_ID, trust=TRUST), "another root"),
            (SharedBlockStore(mem, rt, b"other-geometry", trust=TRUST), "geometry"),
            (BlockQueue(SharedBlockStore(mem, b"y" * 16, GEOM_ID, trust=TRUST)), "another root"),
        ]
        for shared, what in bad:
            with pytest.raises(ValueError, match=what):
                kv.enable_prefix_cache(root(), shared=shared)
            assert not kv.prefix_enabled
        good = SharedBlockStore(mem, rt, GEOM_ID, trust=TRUST)
        with pytest.raises(ValueError, match="shared_refresh_s"):
            kv.enable_prefix_cache(root(), shared=good, shared_refresh_s=0)
        assert not kv.prefix_enabled
        assert kv.enable_prefix_cache(root())
        with pytest.raises(ValueError, match="first call"):
            kv.enable_prefix_cache(root(), shared=SharedBlockStore(mem, rt, GEOM_ID, trust=TRUST))
        assert kv._prefix.shared is None
        kv.check_integrity()
    for kwargs, what in [({"url": "s3://bucket"}, "bucket root"), ({"url": "http://x/y"}, "s3"),
                         ({"url": "s3://b/p", "storage_options": {"nope": 1}}, "nope"),
                         ({"url": "s3://b/p", "storage_options": [1]}, "mapping"),
                         ({"url": "s3://b/p", "tier": 3}, "ColdTierConfig")]:
        with pytest.raises(ValueError, match=what):
            SharedTierConfig(**kwargs, trust=TRUST)
    opts = {"region": "us-east-1"}
    cfg = SharedTierConfig("s3://b/p", opts, trust=TRUST)
    opts["region"] = "changed"
    assert cfg.storage_options["region"] == "us-east-1"  # copied read-only


def test_a_passed_queue_is_the_callers_and_the_built_one_is_closed():
    mem = MemoryStore()
    rt = key_root()
    q = BlockQueue(SharedBlockStore(mem, rt, GEOM_ID, trust=TRUST))
    kv = make(shared=q)
    kv.close()
    assert q.submit_refresh()  # still open: the caller's to close
    q.close(5)
    kv = make(shared=SharedBlockStore(mem, rt, GEOM_ID, trust=TRUST))
    built = kv._prefix.shared.queue
    kv.close()
    assert built.closed and not built.submit_refresh()  # closed: a submit is refused
    assert not q.submit_refresh() and q.closed  # the passed one, closed by its owner above


def _page_for(key: bytes) -> torch.Tensor:
    seed = int.from_bytes(key[:8], "little") >> 1
    return torch.randn(GEOM.page_shape, generator=torch.Generator().manual_seed(seed)).to(GEOM.dtype)


class SharedPrefixMachine(RuleBasedStateMachine):
    """Worker A publishes, worker B attaches through the shared tier with its fetches gated,
    failing or damaged objects; a page's bytes are a function of its key, so whatever B holds
    resident must read back exactly those bytes."""

    @initialize()
    def setup(self) -> None:
        self.mem, self.a, self.b, self.gated = pair(host_pages=4, device_pages=10, io_threads=2, max_queued=4)
        self.stems = [torch.randint(0, 50, (3 * T + 1,), generator=torch.Generator().manual_seed(s))
                      for s in range(3)]
        self.seq = 0
        self.live: dict[str, torch.Tensor] = {}
        for stem in range(3):  # every stem's pages are on the shared tier to begin with
            self.a_publishes(stem, 3)
        self.b.synchronize(10)

    def _write_pages(self, kv, rid, ids, first_page):
        keys = kv._prefix.keys(ids)
        for i in range(first_page, len(keys)):
            page = _page_for(keys[i])
            for layer in range(GEOM.num_layers):
                kv.write(rid, layer, i * T, page[layer, 0], page[layer, 1])

    @rule(stem=st.integers(0, 2), pages=st.integers(1, 3))
    def a_publishes(self, stem, pages):
        ids = self.stems[stem][: pages * T + 1]
        rid = f"a{self.seq}"
        self.seq += 1
        self.a.ingest_request(rid)
        if not self.a.allocate(rid, len(ids)):
            self.a.remove_request(rid)
            return
        self._write_pages(self.a, rid, ids, 0)
        self.a.publish_prefix(rid, ids)
        self.a.remove_request(rid)
        self.a.synchronize(10)
        self.b._prefix._refresh()

    @rule(stem=st.integers(0, 2))
    def b_attaches(self, stem):
        ids = self.stems[stem]
        rid = f"b{self.seq}"
        self.seq += 1
        self.b.ingest_request(rid)
        self.b.attach_prefix(rid, ids)
        self.live[rid] = ids

    @rule()
    def b_polls(self):
        self.b.poll()

    @rule()
    def b_syncs(self):
        self.gated.gate.set()
        self.gated.pub_gate.set()
        self.b.synchronize(10)

    # Which request a rule picks is drawn as an index, always, whatever the state: the state
    # depends on when the queue's threads finish, and hypothesis needs the same draws on replay.
    @rule(i=st.integers(0, 63))
    def b_reloads(self, i):
        offl = sorted(r for r in self.live if self.b.is_offloaded(r))
        if offl:
            self.b.reload(offl[i % len(offl)])

    @rule(i=st.integers(0, 63))
    def b_removes(self, i):
        if self.live:
            rid = sorted(self.live)[i % len(self.live)]
            self.b.remove_request(rid)
            del self.live[rid]

    @rule(i=st.integers(0, 63))
    def b_finishes(self, i):
        """A resident request recomputes and publishes its full pages (B's own blocks)."""
        res = sorted(r for r in self.live if self.b.state_of(r) is S.RESIDENT)
        if not res:
            return
        rid = res[i % len(res)]
        ids = self.live[rid]
        have = self.b.num_tokens(rid)
        if self.b.allocate(rid, len(ids)):
            self._write_pages(self.b, rid, ids, have // T)
            self.b.publish_prefix(rid, ids)

    @rule(mode=st.sampled_from(["ok", "unavailable"]), gate=st.booleans(), pub=st.booleans())
    def b_faults(self, mode, gate, pub):
        self.gated.mode = mode
        (self.gated.gate.set if gate else self.gated.gate.clear)()
        (self.gated.pub_gate.set if pub else self.gated.pub_gate.clear)()

    @rule(stem=st.integers(0, 2), page=st.integers(0, 2))
    def damage_object(self, stem, page):
        key = self.a._prefix.keys(self.stems[stem])[page]
        path = block_path(self.a._prefix.key_root, GEOM_ID, key)
        try:
            raw = bytearray(obstore.get(self.mem, path).bytes())
        except FileNotFoundError:
            return
        raw[-10] ^= 0x01
        obstore.put(self.mem, path, bytes(raw))

    @invariant()
    def consistent(self):
        if not hasattr(self, "b"):
            return
        self.a.check_integrity()
        self.b.check_integrity()
        for rid, ids in self.live.items():
            if self.b.state_of(rid) is not S.RESIDENT or self.b._reqs[rid].prefix_load is not None:
                continue
            n = self.b.num_tokens(rid)
            keys = self.b._prefix.keys(ids)
            for layer in range(GEOM.num_layers):
                k, v = self.b.read(rid, layer)
                for i in range(n // T):
                    page = _page_for(keys[i])
                    assert torch.equal(k[i * T:(i + 1) * T], page[layer, 0]), (rid, i)
                    assert torch.equal(v[i * T:(i + 1) * T], page[layer, 1]), (rid, i)

    def teardown(self):
        if not hasattr(self, "b"):
            return
        self.gated.gate.set()
        self.gated.pub_gate.set()
        self.b.synchronize(10)
        self.b.check_integrity()
        st = self.b.prefix_stats()
        for name in ("shared_fetched", "shared_prefetched", "shared_lost", "shared_unavailable",
                     "shared_reload_waits", "shared_fetch_adopted", "shared_publish_retried"):
            event(f"{name} > 0: {st.get(name, 0) > 0}")
        for rid in list(self.live):
            self.b.remove_request(rid)
        self.b.check_integrity()
        assert not self.b._prefix.fetching
        self.a.close()
        self.b.close()


TestSharedPrefixMachine = SharedPrefixMachine.TestCase
TestSharedPrefixMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


def test_enabling_again_with_the_same_shared_tier_does_nothing(closing):
    mem = MemoryStore()
    blocks = SharedBlockStore(mem, key_root(), GEOM_ID, trust=TRUST)
    kv = closing(make(shared=blocks))
    link = kv._prefix.shared
    assert kv.enable_prefix_cache(root(), shared=blocks)
    assert kv.enable_prefix_cache(root())
    assert kv._prefix.shared is link
    other = SharedBlockStore(mem, key_root(), GEOM_ID, trust=TRUST)
    with pytest.raises(ValueError, match="first call"):
        kv.enable_prefix_cache(root(), shared=other)
    assert kv._prefix.shared is link
    kv.check_integrity()


def test_publishes_refused_by_a_full_queue_are_retried_from_poll(closing):
    gen = torch.Generator().manual_seed(54)
    mem = MemoryStore()
    gated = GatedBlocks(mem, key_root(), GEOM_ID, config=ColdTierConfig(io_threads=1, max_queued=3), trust=TRUST)
    kv = closing(make(shared=gated))
    closing.call(gated.pub_gate.set)
    kv.synchronize(10)  # the first listing is done: the queue is empty
    gated.pub_gate.clear()
    ids, _ = publish_random(kv, gen, n=21)  # 5 blocks: 3 queued, 2 refused
    st = kv.prefix_stats()
    assert st["shared_publish_queued"] == 3 and st["shared_publish_refused"] == 2
    assert len(kv._prefix.unpublished) == 2
    kv.poll()  # no room yet: nothing retried, nothing lost
    assert kv.prefix_stats()["shared_publish_retried"] == 0 and len(kv._prefix.unpublished) == 2
    kv.check_integrity()
    gated.pub_gate.set()
    for _ in range(5):
        kv.synchronize(10)
        kv.check_integrity()
    st = kv.prefix_stats()
    assert st["shared_publish_retried"] == 2 and st["shared_published"] == 5
    assert not kv._prefix.unpublished
    keys = kv._prefix.keys(ids)
    for key in keys:  # every block is on the store, framed with its own bytes
        assert obstore.head(mem, block_path(key_root(), GEOM_ID, key))["size"] == gated.object_size(key, GEOM.page_bytes)
    # a refused block that left the local cache before its retry is not written
    gated.pub_gate.clear()
    ids2, _ = publish_random(kv, gen, rid="b", n=21)
    keys2 = kv._prefix.keys(ids2)
    assert len(kv._prefix.unpublished) == 2
    kv.remove_request("b")
    late = list(kv._prefix.unpublished)
    for key in late:
        kv._prefix._drop(key, "evicted")
    kv.check_integrity()
    gated.pub_gate.set()
    for _ in range(3):
        kv.synchronize(10)
    for key in keys2:
        if key in late:
            with pytest.raises(FileNotFoundError):
                obstore.head(mem, block_path(key_root(), GEOM_ID, key))
        else:
            obstore.head(mem, block_path(key_root(), GEOM_ID, key))
    kv.check_integrity()


def test_cached_prefix_does_not_reorder_the_known_blocks(closing):
    """``cached_prefix`` changes nothing, the shared tier's known-blocks LRU included: it
    used to count each block it looked at as a use, so a lookup decided which known blocks
    the bounded cache forgets first."""
    gen = torch.Generator().manual_seed(58)
    _, a, b, gated = closed_pair(closing)
    ids, _ = share(a, b, gen)
    ids2, _ = publish_random(a, gen, rid="a2", n=9)
    a.synchronize(10)
    relist(b)
    known = b._prefix.shared.known
    before = known.keys()
    assert len(before) == 5
    assert b.cached_prefix(ids).shared == 12
    assert known.keys() == before
    b.check_integrity()
    b.ingest_request("b")
    assert b.attach_prefix("b", ids) == 12  # the control: an attach is a use, and reorders
    assert known.keys() != before


def test_a_queue_closed_under_the_cache_refuses_and_breaks_nothing(closing):
    """A passed BlockQueue that its owner closed first made ``publish_prefix`` raise after the
    block entered the index but before the cache took its page, crc and policy entry: the
    cache failed check_integrity for good. Its submits are now refusals."""
    gen = torch.Generator().manual_seed(59)
    mem = MemoryStore()
    q = BlockQueue(SharedBlockStore(mem, key_root(), GEOM_ID, trust=TRUST))
    clock = FakeClock()
    kv = closing(make(shared=q, clock=clock))
    q.close(5)
    ids, data = publish_random(kv, gen, n=13)  # checks integrity
    st = kv.prefix_stats()
    assert st["blocks_published"] == 3 and st["shared_publish_refused"] == 3
    clock.t += 60.0  # past the refresh timer: poll queues a listing and retries publishes
    kv.poll()
    kv.check_integrity()
    kv.ingest_request("b")
    assert kv.attach_prefix("b", ids) == 12  # the local blocks still serve
    kv.check_integrity()
    assert_leading(kv, "b", data, 12)
    assert [m for c in obstore.list(mem) for m in c] == []  # nothing was written
    assert q.closed and not q.submit_fetch(b"k" * 16) and not q.submit_refresh()
