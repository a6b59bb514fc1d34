"""The disk tier on ``s3://bucket/prefix`` against a real SeaweedFS server: a round trip through
the KV cache, the prefix held by a lease (a second cache refused, a lost lease refusing writes),
a clear that stays inside the prefix, the server down at start-up, and the server frozen
mid-demote. Config checks need no server."""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import uuid

import numpy as np
import obstore
import pytest
import torch
from conftest import assert_same, fill
from seaweed_fixture import _seaweed_shared, seaweed, seaweed_faults  # noqa: F401  (fixtures)
from tiering.resources.kv_cache import PagedKVCache

from tiering.coldtier import ColdTierUnavailable, StoreNotAnswering
from tiering.disk import DiskConfig, DiskIOError, DiskPageStore, DiskPathInUseError, PathLease
from tiering.types import RequestState, Tier

CAP = 1 << 20


def s3_config(srv, url: str, **kw) -> DiskConfig:
    opts = srv.options(timeout_s=kw.pop("timeout_s", 5.0), max_retries=kw.pop("max_retries", 1))
    return DiskConfig(path=url, capacity_bytes=CAP, storage_options=opts, **kw)


def cache(geom, config: DiskConfig, **kw) -> PagedKVCache:
    return PagedKVCache(geom, device_pages=kw.pop("device_pages", 32), host_pages=32, disk=config, **kw)


def keys_under(srv, url: str) -> list[str]:
    """Every object under the URL's prefix, read with a client of its own."""
    bucket_root = srv.store("", check=False)
    prefix = url.split(f"s3://{srv.bucket}/", 1)[1]
    return sorted(m["path"] for c in obstore.list(bucket_root, prefix=prefix + "/") for m in c)


def lease_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "coldtier-lease" and t.is_alive()]


# -- config (no server) -----------------------------------------------------------------------
def test_storage_options_are_validated_and_copied():
    good = {"endpoint": "http://127.0.0.1:1", "key": "k", "secret": "s", "region": "r"}
    cfg = DiskConfig(path="s3://bucket/w0", capacity_bytes=CAP, storage_options=good)
    good["endpoint"] = "http://changed"
    assert cfg.storage_options["endpoint"] == "http://127.0.0.1:1"  # a copy, read-only
    with pytest.raises(TypeError):
        cfg.storage_options["key"] = "x"
    cases = [
        (dict(path="s3://bucket/w0", storage_options={"endpiont": "x"}), "'endpiont'"),
        (dict(path="s3://bucket/w0", storage_options={"timeout_s": 0}), "timeout_s"),
        (dict(path="s3://bucket/w0", storage_options=["endpoint"]), "mapping"),
        (dict(path="s3://bucket/w0", storage_options={1: "x"}), "mapping"),
        (dict(path="s3://bucket", storage_options=good), "bucket root"),
        (dict(path="s3://bucket/", storage_options=good), "bucket root"),
        (dict(path="s3://bucket/a//b"), "empty or relative"),
        (dict(path="/tmp/local", storage_options=good), "only to a URL path"),
        (dict(path="file:///tmp/local", storage_options=good), "only to a URL path"),
        (dict(path="s3://bucket/w0", lease_ttl_s=0), "lease_ttl_s"),
        (dict(path="s3://bucket/w0", lease_ttl_s=True), "lease_ttl_s"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            DiskConfig(capacity_bytes=CAP, **kwargs)

    class Lease:
        def acquire(self):
            pass

        def release(self):
            pass

    assert isinstance(Lease(), PathLease)
    with pytest.raises(ValueError, match="its own lease"):
        DiskConfig(path="s3://bucket/w0", capacity_bytes=CAP, lease=Lease())


def test_other_fsspec_urls_take_storage_options(geom, closing):
    url = f"memory://tiering-{uuid.uuid4().hex[:8]}/w0"
    cfg = DiskConfig(path=url, capacity_bytes=CAP, storage_options={"skip_instance_cache": True})
    store = closing(DiskPageStore(cfg, geom.page_shape, geom.dtype))
    rng = np.random.default_rng(7)
    pages = torch.from_numpy(rng.standard_normal((3, *geom.page_shape)).astype(np.float32)).to(geom.dtype)
    ext = store.reserve("r", 3)
    store.write(ext, pages)
    store.check_integrity()
    back = torch.empty_like(pages)
    store.read(ext, back)
    assert torch.equal(back, pages)
    assert type(store._backend.store._store).__name__ == "FsspecStore"


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_down_at_start_is_the_tiers_own_error(geom):
    port = _dead_port()
    opts = {"endpoint": f"http://127.0.0.1:{port}", "region": "us-east-1", "key": "k",
            "secret": "s", "timeout_s": 2.0, "max_retries": 0}
    url = "s3://bucket/w0"
    before = len(lease_threads())
    cfg = DiskConfig(path=url, capacity_bytes=CAP, storage_options=opts)
    with pytest.raises(DiskIOError) as err:
        cache(geom, cfg)
    text = str(err.value)
    assert url in text and f"127.0.0.1:{port}" in text and "cannot start" in text, text
    chain, e = [], err.value
    while e is not None:
        chain.append(type(e))
        e = e.__cause__
    assert ColdTierUnavailable in chain, chain  # the cold tier's reason, kept as the cause
    assert "obstore" not in type(err.value).__module__
    assert len(lease_threads()) == before  # nothing was left running


# -- against the real server ------------------------------------------------------------------
def _move_all(kv: PagedKVCache, rids, move) -> None:
    """Start ``move`` (``kv.demote`` or ``kv.reload``) for every request, checking the
    cache after each; wait for them all and require that every one landed."""
    for rid in rids:
        assert move(rid)
        kv.check_integrity()
    res = kv.synchronize(60)
    kv.check_integrity()
    assert all(r.ok for r in res), [r.reason for r in res]


def test_round_trip_device_host_s3_device_bitwise(seaweed, geom, closing):  # noqa: F811
    url = seaweed.url() + "/w0"
    gen = torch.Generator().manual_seed(21)
    kv = closing(cache(geom, s3_config(seaweed, url)))
    data = {f"r{i}": fill(kv, f"r{i}", gen, tokens) for i, tokens in enumerate((3, 9, 17, 4))}
    for rid in data:
        assert kv.offload(rid) > 0
        kv.check_integrity()
    kv.synchronize(30)
    kv.check_integrity()
    assert all(kv.tier_of(rid) is Tier.HOST for rid in data)
    _move_all(kv, data, kv.demote)
    assert all(kv.tier_of(rid) is Tier.DISK for rid in data)
    # the pages are on the server, under the prefix: one chunk object per page
    pages = sum(geom.pages_for(t) for t in (3, 9, 17, 4))
    keys = keys_under(seaweed, url)
    prefix = url.split(f"s3://{seaweed.bucket}/", 1)[1]
    assert sum(k.startswith(f"{prefix}/c/") for k in keys) == pages
    assert f"{prefix}/LEASE" in keys
    assert kv.disk.stats()["bytes_written"] == pages * geom.page_bytes
    _move_all(kv, data, kv.reload)
    for rid, d in data.items():
        assert kv.tier_of(rid) is Tier.DEVICE
        assert_same(kv, rid, d)
    assert kv.disk.stats()["bytes_read"] == pages * geom.page_bytes  # read back from S3
    # negative control: a damaged object on the server is refused, never handed back
    assert kv.offload("r2") and not kv.synchronize(30)[0].reason
    assert kv.demote("r2") and kv.synchronize(60)[0].ok
    store = seaweed.store(prefix, check=False)
    chunks = [k[len(prefix) + 1:] for k in keys_under(seaweed, url) if k.startswith(f"{prefix}/c/")]
    for rel in chunks:  # flip one bit in every chunk object on the server (r2's among them)
        raw = bytearray(obstore.get(store, rel).bytes())
        raw[len(raw) // 2] ^= 0x40
        obstore.put(store, rel, bytes(raw))
    assert kv.reload("r2")
    (r,) = kv.synchronize(60)
    kv.check_integrity()
    assert not r.ok, "a damaged object was handed back"
    assert kv.state_of("r2") is RequestState.LOST and "reload from disk failed" in r.reason
    kv.close()
    assert not any(k.endswith("/LEASE") and _lease_live(seaweed, k) for k in keys_under(seaweed, url))


def _lease_live(srv, key: str) -> bool:
    body = json.loads(bytes(obstore.get(srv.store("", check=False), key).bytes()))
    return body["expires_at"] > time.time()


def test_second_cache_on_the_same_prefix_is_refused(seaweed, geom, closing):  # noqa: F811
    url = seaweed.url() + "/w0"
    gen = torch.Generator().manual_seed(22)
    a = closing(cache(geom, s3_config(seaweed, url)))
    data = fill(a, "x", gen, 8)
    threads = len(lease_threads())
    cfg = s3_config(seaweed, url)
    with pytest.raises(DiskPathInUseError) as err:
        cache(geom, cfg)
    assert len(lease_threads()) == threads  # the refused cache left nothing running
    text = str(err.value)
    assert err.value.errno == errno.EBUSY
    assert url in text and f"pid {os.getpid()} host" in text, text
    # the refused cache touched nothing: the first one still demotes and reloads its bytes
    assert a.offload("x") and a.synchronize(30)[0].ok
    assert a.demote("x") and a.synchronize(60)[0].ok
    assert a.reload("x") and a.synchronize(60)[0].ok
    a.check_integrity()
    assert_same(a, "x", data)
    # another prefix of the same bucket is free
    other = cache(geom, s3_config(seaweed, seaweed.url() + "/w1"))
    other.close()
    a.close()
    b = cache(geom, s3_config(seaweed, url))  # released at close: free at once
    b.close()


def test_clear_touches_only_the_held_prefix(seaweed, geom, closing):  # noqa: F811
    base = seaweed.url()
    parent = base.split(f"s3://{seaweed.bucket}/", 1)[1]
    root = seaweed.store("", check=False)
    outside = {f"{parent}/w0-sibling/obj": b"s", f"{parent}/w0.txt": b"t", f"{parent}/other/x": b"o"}
    for k, v in outside.items():
        obstore.put(root, k, v)
    url = base + "/w0"
    gen = torch.Generator().manual_seed(23)
    kv = cache(geom, s3_config(seaweed, url))
    fill(kv, "a", gen, 12)
    assert kv.offload("a") and kv.synchronize(30)[0].ok
    assert kv.demote("a") and kv.synchronize(60)[0].ok
    kv.close()
    left = keys_under(seaweed, url)
    assert any("/c/" in k for k in left)  # what the last run wrote
    kv = closing(cache(geom, s3_config(seaweed, url)))  # on_start="clear"
    kv.check_integrity()
    now = keys_under(seaweed, url)
    assert not any("/c/" in k for k in now) and f"{parent}/w0/LEASE" in now
    for k, v in outside.items():  # nothing outside the prefix was touched
        assert bytes(obstore.get(root, k).bytes()) == v
    kv.close()
    # a foreign object inside the prefix: the clear is refused and deletes nothing
    obstore.put(root, f"{parent}/w0/not-ours", b"f")
    before, threads = keys_under(seaweed, url), len(lease_threads())
    cfg = s3_config(seaweed, url)
    with pytest.raises(DiskIOError, match="did not write") as err:
        cache(geom, cfg)
    assert err.value.errno == errno.EEXIST
    assert keys_under(seaweed, url) == before
    assert len(lease_threads()) == threads  # the failed start stopped renewing ...
    assert not _lease_live(seaweed, f"{parent}/w0/LEASE")  # ... and released the lease


def test_lost_lease_fails_the_write_and_the_request_stays_on_host(seaweed, geom, closing):  # noqa: F811
    url = seaweed.url() + "/w0"
    prefix = url.split(f"s3://{seaweed.bucket}/", 1)[1]
    gen = torch.Generator().manual_seed(24)
    kv = closing(cache(geom, s3_config(seaweed, url, lease_ttl_s=3.0)))  # renewed every second
    data = {rid: fill(kv, rid, gen, 10) for rid in ("ok", "late")}
    for rid in data:
        assert kv.offload(rid)
    kv.synchronize(30)
    assert kv.demote("ok") and kv.synchronize(60)[0].ok  # control: held, the write lands
    # another worker takes the prefix over behind this one's back (its lease object changes)
    store = seaweed.store(prefix, check=False)
    obstore.put(store, "LEASE", json.dumps({"owner": "usurper", "token": "t",
                                            "expires_at": time.time() + 600}).encode())
    lease = kv.disk._backend.hold.lease
    deadline = time.monotonic() + 15
    while lease.info is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # the next renewal (within a second) finds the ETag changed
    assert lease.info is None and "taken over" in lease.lost_reason
    before = keys_under(seaweed, url)
    assert kv.demote("late")
    (r,) = kv.synchronize(60)
    kv.check_integrity()
    assert not r.ok and r.state is RequestState.ON_HOST
    assert "no longer holds" in r.reason and "taken over" in r.reason, r.reason
    assert kv.disk.stats()["fault_errnos"].get("ENOLCK", 0) >= 1
    assert keys_under(seaweed, url) == before  # nothing was written after the loss
    assert kv.reload("late") and kv.synchronize(30)[0].ok  # the host copy is intact
    assert_same(kv, "late", data["late"])
    kv.close()
    # the usurper's lease was not released by the old holder's close
    assert _lease_live(seaweed, f"{prefix}/LEASE")


def test_frozen_server_mid_demote_keeps_requests_on_host(seaweed_faults, geom, closing):  # noqa: F811
    srv = seaweed_faults
    url = srv.url() + "/w0"
    gen = torch.Generator().manual_seed(25)
    cfg = s3_config(srv, url, timeout_s=1.5, max_retries=0, io_timeout_s=20.0)
    kv = closing(cache(geom, cfg, io_workers=2))
    rids = [f"r{i}" for i in range(6)]
    data = {rid: fill(kv, rid, gen, 8) for rid in rids}
    for rid in rids:
        assert kv.offload(rid)
    kv.synchronize(30)
    breaker = kv.disk._backend.hold.breaker
    srv.freeze()
    try:
        for rid in rids:
            assert kv.demote(rid)
        # the store cannot answer before the client's 1.5 s timeout: had a demote (or the
        # poll) waited on it, the copies queued before would have settled by now
        first = kv.poll()
        assert first == [] and kv.in_flight() == len(rids), "a step-path call waited on the store"
        results = []
        deadline = time.monotonic() + 30
        while len(results) < len(rids) and time.monotonic() < deadline:
            results += kv.poll()
            kv.check_integrity()
            time.sleep(0.02)
    finally:
        srv.thaw()
    assert len(results) == len(rids), "demotes did not settle while the server was frozen"
    assert all(not r.ok and r.state is RequestState.ON_HOST for r in results)
    assert all(kv.tier_of(rid) is Tier.HOST for rid in rids)
    timed_out = [r for r in results if r.reason.startswith(f"DiskIOError: [Errno {errno.ETIMEDOUT}]")]
    skipped = [r for r in results if r.reason.startswith(f"DiskIOError: [Errno {errno.EAGAIN}]")
               and "no request made" in r.reason]
    # at most one request per I/O thread waited on the network; the others made no request
    assert 1 <= len(timed_out) <= 2 and len(timed_out) + len(skipped) == len(rids), \
        [r.reason for r in results]
    assert breaker.stats().opened == 1
    # after the cooldown a trial closes the breaker and the same requests demote and reload
    time.sleep(breaker.config.cooldown_s + 0.1)
    assert kv.demote(rids[0])  # the one trial request a half-open breaker lets through
    assert kv.synchronize(60)[0].ok
    assert breaker.stats().state.value == "closed"
    for rid in rids[1:]:
        assert kv.demote(rid)
    res = kv.synchronize(60)
    assert all(r.ok for r in res), [r.reason for r in res]
    for rid in rids:
        assert kv.reload(rid)
    assert all(r.ok for r in kv.synchronize(60))
    kv.check_integrity()
    for rid, d in data.items():
        assert_same(kv, rid, d)


def test_guarded_store_raises_its_own_errors_and_hides_the_lease(seaweed, closing):  # noqa: F811
    """The store under the disk tier: no write once the lease is gone, the lease key unlisted."""
    import zarr
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    from tiering.coldtier import LeaseConfig, PrefixLeaseLost, hold_zarr_prefix

    url = seaweed.url() + "/w0"
    held = hold_zarr_prefix(url, seaweed.options(), owner="me", timeout_s=5.0, renew=False,
                            lease_config=LeaseConfig(ttl_s=30, renew_every_s=10, safety_s=2))
    closing(held)
    zs = held.zarr_store
    rng = np.random.default_rng(26)
    a = rng.standard_normal((4, 8)).astype(np.float32)
    zarr.create_array(zs, name="x", shape=a.shape, chunks=(2, 8), dtype=a.dtype)[:] = a
    listed = sync(_collect(zs.list()))
    assert "LEASE" not in listed and any(k.startswith("x/") for k in listed)
    with pytest.raises(PermissionError):
        sync(zs.set("LEASE", default_buffer_prototype().buffer.from_bytes(b"{}")))
    assert sync(zs.get("LEASE", default_buffer_prototype())) is None
    held.lease.release()  # gone: the next write is refused before any request
    with pytest.raises(PrefixLeaseLost) as err:
        zarr.open_array(zs, path="x")[:] = a + 1
    assert err.value.errno == errno.ENOLCK and url in str(err.value)
    assert np.array_equal(zarr.open_array(zs, path="x")[:], a)  # unchanged
    assert issubclass(StoreNotAnswering, OSError)


async def _collect(it):
    return [k async for k in it]


def test_refused_credentials_at_start_are_the_tiers_own_error(seaweed, geom):  # noqa: F811
    url = seaweed.url() + "/w0"
    cfg = DiskConfig(path=url, capacity_bytes=CAP, storage_options=seaweed.options(secret="wrong"))
    with pytest.raises(DiskIOError) as err:
        cache(geom, cfg)
    assert err.value.errno == errno.EACCES and url in str(err.value), str(err.value)
    assert keys_under(seaweed, url) == []  # nothing was written, not even a lease
