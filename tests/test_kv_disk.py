"""PagedKVCache with its disk tier: round trips, the cap, faults, start-up."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_same, fill, reload_all_and_check

from resources.kv_cache import PagedKVCache, RequestLost
from tiering.disk import DiskConfig, FaultPlan, FaultyStore
from tiering.types import Move, RequestState, Tier, TransferResult

S = RequestState


def make(geom, tmp_path, *, host_pages=8, device_pages=16, cap_pages=16, plan=None, **kw):
    page = geom.page_bytes
    cfg = DiskConfig(path=tmp_path / "disk", capacity_bytes=cap_pages * page, chunk_bytes=2 * page,
                     **{k: kw.pop(k) for k in ("on_start",) if k in kw})
    wrap = (lambda s: FaultyStore(s, plan)) if plan is not None else None
    return PagedKVCache(geom, device_pages=device_pages, host_pages=host_pages, disk=cfg,
                        disk_wrap_store=wrap, **kw)


def to_disk(kv, rid):
    kv.offload(rid)
    kv.synchronize(10)
    if kv.state_of(rid) is S.ON_HOST:
        assert kv.demote(rid)
        kv.synchronize(10)
    assert kv.state_of(rid) is S.ON_DISK, kv.state_of(rid)


def test_round_trip_device_host_disk_device(geom, tmp_path):
    kv = make(geom, tmp_path, verify=True)
    try:
        gen = torch.Generator().manual_seed(11)
        data = {f"r{i}": fill(kv, f"r{i}", gen, 3 + 4 * i) for i in range(4)}
        for rid in data:
            to_disk(kv, rid)
            kv.check_integrity()
        assert kv.host_used_bytes() == 0 and kv.device_used_bytes() == 0
        assert all(kv.tier_of(r) is Tier.DISK for r in data)
        reload_all_and_check(kv, data)
        assert kv.stats.reloads_from_disk == 4 and kv.stats.demotions == 4
        assert kv.disk.used_bytes() == 0
    finally:
        kv.close()


def test_offload_goes_straight_to_disk_when_host_full(geom, tmp_path):
    kv = make(geom, tmp_path, host_pages=1)
    try:
        gen = torch.Generator().manual_seed(12)
        a = fill(kv, "a", gen, 12)  # 3 pages: the host cannot take it
        assert kv.reclaimable("a") == 3 * geom.page_bytes
        assert kv.offload("a") == 3 * geom.page_bytes
        kv.synchronize(10)
        assert kv.state_of("a") is S.ON_DISK
        assert kv.stats.offloads_to_disk == 1
        assert kv.reload("a")
        kv.synchronize(10)
        assert_same(kv, "a", a)
    finally:
        kv.close()


def test_disk_cap_never_exceeded_under_random_load(geom, tmp_path):
    kv = make(geom, tmp_path, host_pages=6, device_pages=24, cap_pages=8)
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(13)
    data = {}
    try:
        ops = ["add"] * 3 + ["offload"] * 3 + ["demote"] * 3 + ["reload", "remove", "poll"]
        for step in range(300):
            op = rng.choice(ops)
            rids = sorted(data)
            rid = rng.choice(rids) if rids else None
            st = kv.state_of(rid) if rid else None
            if op == "add":
                r = f"n{step}"
                kv.ingest_request(r)
                if kv.allocate(r, rng.randint(1, 9)):
                    data[r] = None
                else:
                    kv.remove_request(r)
            elif op == "offload" and st is S.RESIDENT:
                kv.offload(rid)
            elif op == "demote" and st is S.ON_HOST:
                before = kv.disk.used_bytes()
                ok = kv.demote(rid)
                assert ok or kv.disk.used_bytes() == before
            elif op == "reload" and st in (S.ON_HOST, S.ON_DISK):
                kv.reload(rid)
            elif op == "remove" and rid:
                kv.remove_request(rid)
                del data[rid]
            else:
                kv.poll()
            assert kv.disk.used_bytes() <= kv.disk.capacity_bytes
            kv.check_integrity()
            if step % 3 == 0:
                kv.poll()
        kv.synchronize(10)
        kv.check_integrity()
        assert kv.disk.stats()["refusals"] > 0, "the cap was never reached"
        assert kv.stats.demotions + kv.stats.offloads_to_disk > 0, kv.stats.as_dict()
        del gen
    finally:
        kv.close()


def test_write_fault_leaves_request_on_host(geom, tmp_path):
    plan = FaultPlan(seed=1)
    kv = make(geom, tmp_path, plan=plan)
    try:
        gen = torch.Generator().manual_seed(14)
        a = fill(kv, "a", gen, 8)
        kv.offload("a")
        kv.synchronize(10)
        plan.arm("enospc_write", next_n=1)
        assert kv.demote("a")
        kv.synchronize(10)
        assert plan.injected["enospc_write"] == 1
        assert kv.state_of("a") is S.ON_HOST
        assert kv.stats.demote_failures == 1
        assert kv.disk.used_bytes() == 0
        kv.check_integrity()
        assert kv.reload("a")
        kv.synchronize(10)
        assert_same(kv, "a", a)
    finally:
        kv.close()


@pytest.mark.parametrize("kind", ["eio_read", "corrupt"])
def test_read_fault_loses_only_that_request(geom, tmp_path, kind):
    plan = FaultPlan(seed=2)
    kv = make(geom, tmp_path, plan=plan)
    try:
        gen = torch.Generator().manual_seed(15)
        a = fill(kv, "a", gen, 8)
        b = fill(kv, "b", gen, 8)
        to_disk(kv, "a")
        to_disk(kv, "b")
        plan.arm(kind, next_n=1)
        assert kv.reload("a")
        kv.synchronize(10)
        plan.disarm()
        assert plan.injected[kind] == 1
        assert kv.state_of("a") is S.LOST
        assert "disk" in kv.lost_reason("a")
        with pytest.raises(RequestLost):
            kv.read("a", 0)
        assert kv.reload("b")
        kv.synchronize(10)
        assert_same(kv, "b", b)
        kv.check_integrity()
        assert kv.take_lost() == [("a", kv.lost_reason("a"))]
        del a
    finally:
        kv.close()


def test_flipped_byte_in_the_file_is_detected_never_served(geom, tmp_path):
    kv = make(geom, tmp_path)
    try:
        gen = torch.Generator().manual_seed(16)
        a = fill(kv, "a", gen, 8)
        to_disk(kv, "a")
        needle = a[0][0][:4].contiguous().view(torch.uint8).numpy().tobytes()  # layer 0 K, page 0
        hits = 0
        for path in (tmp_path / "disk").rglob("*"):
            raw = bytearray(path.read_bytes()) if path.is_file() else bytearray()
            at = raw.find(needle)
            if at >= 0:
                raw[at + 7] ^= 0xFF
                path.write_bytes(bytes(raw))
                hits += 1
        assert hits == 1, "the request's bytes were not found on disk exactly once"
        assert kv.reload("a")
        kv.synchronize(10)
        assert kv.state_of("a") is S.LOST
        kv.check_integrity()
    finally:
        kv.close()


def test_start_up_reattach_and_clear(geom, tmp_path):
    kv = make(geom, tmp_path, on_start="reattach")
    gen = torch.Generator().manual_seed(17)
    a = fill(kv, "a", gen, 10)
    to_disk(kv, "a")
    fill(kv, "b", gen, 4)  # resident only: nothing of it on disk
    kv.close()
    kv2 = make(geom, tmp_path, on_start="reattach")
    try:
        assert kv2.requests() == ["a"]
        assert kv2.state_of("a") is S.ON_DISK
        kv2.check_integrity()
        assert kv2.reload("a")
        kv2.synchronize(10)
        assert_same(kv2, "a", a)
    finally:
        kv2.close()
    kv3 = make(geom, tmp_path, on_start="clear")
    try:
        assert kv3.requests() == [] and kv3.disk.used_bytes() == 0
    finally:
        kv3.close()


def test_controller_splits_offload_bytes_by_destination(geom, tmp_path):
    from policies import make_policy
    from tiering.control.controller import ControllerConfig, EvictionController
    from tiering.control.pressure import PoolPressure

    kv = make(geom, tmp_path, host_pages=2, device_pages=8)
    try:
        gen = torch.Generator().manual_seed(18)
        for rid in ("a", "b", "c"):
            fill(kv, rid, gen, 8)  # 2 pages each: 6 of 8 device pages
        clock = [0.0]
        ctl = EvictionController({"kv": kv}, make_policy("lru"), PoolPressure(kv),
                                 ControllerConfig(high=0.5, low=0.3), clock=lambda: clock[0])
        for i, rid in enumerate(("a", "b", "c")):
            ctl.add_request(rid)
            clock[0] = float(i)
            ctl.touch(rid)
        report = ctl.evict_if_needed(running=())
        kv.synchronize(10)
        kv.check_integrity()
        assert report.offloaded == ("a", "b")  # oldest first, until under low
        assert kv.state_of("a") is S.ON_HOST and kv.state_of("b") is S.ON_DISK
        st = ctl.stats()
        assert st["bytes_device_to_host"] == 2 * geom.page_bytes
        assert st["bytes_device_to_disk"] == 2 * geom.page_bytes
    finally:
        kv.close()


def test_reclaimable_many_matches_one_by_one(geom, tmp_path):
    kv = make(geom, tmp_path, host_pages=3, device_pages=24, cap_pages=4)
    try:
        gen = torch.Generator().manual_seed(19)
        rng = random.Random(19)
        rids = []
        for i in range(10):
            rid = f"m{i}"
            fill(kv, rid, gen, rng.randint(1, 9))
            rids.append(rid)
        for rid in rids[:4]:
            kv.offload(rid)
        kv.synchronize(10)
        kv.ingest_request("empty")  # resident with no pages
        rids.append("empty")
        many = kv.reclaimable_many(rids)
        one = [kv.reclaimable(r) for r in rids]
        assert many.tolist() == one
        assert any(one) and not all(one)  # some fit below, some do not
        with pytest.raises(KeyError, match="ghost"):
            kv.reclaimable_many(["m5", "ghost"])
    finally:
        kv.close()


def test_poll_counts_buried_copies_and_disk_gauge(geom, tmp_path):
    import threading

    release = threading.Event()
    entered = threading.Event()

    def hold(kind):
        entered.set()
        assert release.wait(10)

    kv = make(geom, tmp_path, copy_fault_hook=hold)
    try:
        gen = torch.Generator().manual_seed(20)
        fill(kv, "a", gen, 8)
        assert kv.offload("a") and entered.wait(10)
        kv.remove_request("a")  # its copy is running: the slots wait for it
        (tomb,) = kv._tombstones.values()
        release.set()
        tomb.future.result(10)
        assert kv.host_used_bytes() > 0
        (done,) = kv.poll()  # the burial is reported, with no state: the request is gone
        assert done == TransferResult("a", Move.OFFLOAD_TO_HOST, True, 2 * kv.geometry.page_bytes, None)
        assert kv.host_used_bytes() == 0 and kv.device_used_bytes() == 0
        fill(kv, "b", gen, 8)
        kv.offload("b")
        kv.synchronize(10)
        assert kv.demote("b")
        kv.synchronize(10)
        assert kv.disk_used_bytes() == kv.disk.used_bytes() > 0
        kv.check_integrity()
    finally:
        release.set()
        kv.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_drop_gives_up_an_offloaded_request(geom, tmp_path, tier):
    kv = make(geom, tmp_path)
    try:
        gen = torch.Generator().manual_seed(23)
        fill(kv, "a", gen, 8)
        b = fill(kv, "b", gen, 8)
        if tier == "host":
            kv.offload("a")
            kv.synchronize(10)
        else:
            to_disk(kv, "a")
        kv.drop("a")
        kv.check_integrity()
        assert kv.state_of("a") is S.LOST and kv.lost_reason("a") == "dropped"
        assert kv.stats.dropped == 1 and kv.stats.lost == 0
        assert kv.host_used_bytes() == 0 and kv.disk_used_bytes() == 0
        assert kv.take_lost() == [("a", "dropped")]
        with pytest.raises(RequestLost, match="dropped"):
            kv.read("a", 0)
        assert_same(kv, "b", b)
        kv.remove_request("a")
        kv.check_integrity()
    finally:
        kv.close()


@pytest.mark.parametrize("on_start", ["clear", "reattach"])
def test_a_second_cache_on_a_live_cache_disk_path_is_refused(geom, tmp_path, on_start):
    from tiering.disk import DiskPathInUseError

    first = make(geom, tmp_path, on_start="reattach")
    try:
        gen = torch.Generator().manual_seed(41)
        data = {"a": fill(first, "a", gen, 9)}
        to_disk(first, "a")
        with pytest.raises(DiskPathInUseError, match=str(tmp_path / "disk")):
            make(geom, tmp_path, on_start=on_start)
        first.check_integrity()
        reload_all_and_check(first, data)  # the first cache's KV is still its own
    finally:
        first.close()
    second = make(geom, tmp_path, on_start=on_start)  # released when the first closed
    second.check_integrity()
    second.close()
