"""PagedKVCache with its disk tier: round trips, the cap, faults, start-up."""

from __future__ import annotations

import errno
import random

import pytest
import torch
from conftest import assert_same, fill, reload_all_and_check
from tiering.resources.kv_cache import RequestLost

from tiering.disk import DiskConfig, FaultPlan, FaultyStore
from tiering.types import Move, RequestState, Tier, TransferResult

S = RequestState


def make(kv, tmp_path, *, host_pages=8, device_pages=16, cap_pages=16, plan=None, **kw):
    """A cache with a disk tier under ``tmp_path``, made by the ``kv`` factory (closed for us)."""
    page = kv.geometry.page_bytes
    cfg = DiskConfig(path=tmp_path / "disk", capacity_bytes=cap_pages * page, chunk_bytes=2 * page,
                     **{k: kw.pop(k) for k in ("on_start",) if k in kw})
    wrap = (lambda s: FaultyStore(s, plan)) if plan is not None else None
    return kv(device_pages=device_pages, host_pages=host_pages, disk=cfg, disk_wrap_store=wrap,
              **kw)


def to_disk(kv, rid):
    kv.offload(rid)
    kv.synchronize(10)
    if kv.state_of(rid) is S.ON_HOST:
        assert kv.demote(rid)
        kv.synchronize(10)
    assert kv.state_of(rid) is S.ON_DISK, kv.state_of(rid)


def test_round_trip_device_host_disk_device(kv, tmp_path):
    cache = make(kv, tmp_path, verify=True)
    gen = torch.Generator().manual_seed(11)
    data = {f"r{i}": fill(cache, f"r{i}", gen, 3 + 4 * i) for i in range(4)}
    for rid in data:
        to_disk(cache, rid)
        cache.check_integrity()
    assert cache.host_used_bytes() == 0 and cache.device_used_bytes() == 0
    assert all(cache.tier_of(r) is Tier.DISK for r in data)
    reload_all_and_check(cache, data)
    assert cache.stats.reloads_from_disk == 4 and cache.stats.demotions == 4
    assert cache.disk.used_bytes() == 0


def test_offload_goes_straight_to_disk_when_host_full(kv, geom, tmp_path):
    cache = make(kv, tmp_path, host_pages=1)
    gen = torch.Generator().manual_seed(12)
    a = fill(cache, "a", gen, 12)  # 3 pages: the host cannot take it
    assert cache.reclaimable("a") == 3 * geom.page_bytes
    assert cache.offload("a") == 3 * geom.page_bytes
    cache.synchronize(10)
    assert cache.state_of("a") is S.ON_DISK
    assert cache.stats.offloads_to_disk == 1
    assert cache.reload("a")
    cache.synchronize(10)
    assert_same(cache, "a", a)


def test_disk_cap_never_exceeded_under_random_load(kv, tmp_path):
    cache = make(kv, tmp_path, host_pages=6, device_pages=24, cap_pages=8)
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(13)
    data = {}
    ops = ["add"] * 3 + ["offload"] * 3 + ["demote"] * 3 + ["reload", "remove", "poll"]
    for step in range(300):
        op = rng.choice(ops)
        rids = sorted(data)
        rid = rng.choice(rids) if rids else None
        st = cache.state_of(rid) if rid else None
        if op == "add":
            r = f"n{step}"
            cache.ingest_request(r)
            if cache.allocate(r, rng.randint(1, 9)):
                data[r] = None
            else:
                cache.remove_request(r)
        elif op == "offload" and st is S.RESIDENT:
            cache.offload(rid)
        elif op == "demote" and st is S.ON_HOST:
            before = cache.disk.used_bytes()
            ok = cache.demote(rid)
            assert ok or cache.disk.used_bytes() == before
        elif op == "reload" and st in (S.ON_HOST, S.ON_DISK):
            cache.reload(rid)
        elif op == "remove" and rid:
            cache.remove_request(rid)
            del data[rid]
        else:
            cache.poll()
        assert cache.disk.used_bytes() <= cache.disk.capacity_bytes
        cache.check_integrity()
        if step % 3 == 0:
            cache.poll()
    cache.synchronize(10)
    cache.check_integrity()
    assert cache.stats.demotions + cache.stats.offloads_to_disk > 0, cache.stats.as_dict()
    # whether the random load reached the cap depends on how fast the copies ran; then
    # push to it deterministically: requests demoted one by one until a demote is refused
    for i in range(40):
        if cache.disk.stats()["refusals"] > 0:
            break
        r = f"fill{i}"
        cache.ingest_request(r)
        while not cache.allocate(r, 8) and data:  # make device room from the random load
            cache.remove_request(data.popitem()[0])
        assert cache.offload(r) > 0 or cache.disk.stats()["refusals"] > 0
        cache.synchronize(10)
        if cache.state_of(r) is S.ON_HOST:
            cache.demote(r)
            cache.synchronize(10)
        assert cache.disk.used_bytes() <= cache.disk.capacity_bytes
        cache.check_integrity()
    assert cache.disk.stats()["refusals"] > 0, "the cap was never reached"
    assert cache.disk.used_bytes() <= cache.disk.capacity_bytes
    del gen


def test_write_fault_leaves_request_on_host(kv, tmp_path):
    plan = FaultPlan(seed=1)
    cache = make(kv, tmp_path, plan=plan)
    gen = torch.Generator().manual_seed(14)
    a = fill(cache, "a", gen, 8)
    cache.offload("a")
    cache.synchronize(10)
    plan.arm("enospc_write", next_n=1)
    assert cache.demote("a")
    cache.synchronize(10)
    assert plan.injected["enospc_write"] == 1
    assert cache.state_of("a") is S.ON_HOST
    assert cache.stats.demote_failures == 1
    assert cache.disk.used_bytes() == 0
    cache.check_integrity()
    assert cache.reload("a")
    cache.synchronize(10)
    assert_same(cache, "a", a)


@pytest.mark.parametrize("kind", ["eio_read", "corrupt"])
def test_read_fault_loses_only_that_request(kv, tmp_path, kind):
    plan = FaultPlan(seed=2)
    cache = make(kv, tmp_path, plan=plan)
    gen = torch.Generator().manual_seed(15)
    a = fill(cache, "a", gen, 8)
    b = fill(cache, "b", gen, 8)
    to_disk(cache, "a")
    to_disk(cache, "b")
    plan.arm(kind, next_n=1)
    assert cache.reload("a")
    cache.synchronize(10)
    plan.disarm()
    assert plan.injected[kind] == 1
    assert cache.state_of("a") is S.LOST
    assert "disk" in cache.lost_reason("a")
    with pytest.raises(RequestLost):
        cache.read("a", 0)
    assert cache.reload("b")
    cache.synchronize(10)
    assert_same(cache, "b", b)
    cache.check_integrity()
    assert cache.take_lost() == [("a", cache.lost_reason("a"))]
    del a


@pytest.mark.parametrize("kind, code", [("etimedout_read", errno.ETIMEDOUT),
                                        ("eremoteio_read", errno.EREMOTEIO)])
def test_a_read_that_times_out_leaves_the_request_on_disk_for_a_retry(kv, tmp_path, kind, code):
    """A store that did not answer (ETIMEDOUT), or answered with a server
    error (EREMOTEIO: a 5xx), has lost nothing: the reload fails, the request
    stays on disk, and the next reload brings back the same bytes. Only a
    failed check or a missing chunk means lost."""
    plan = FaultPlan(seed=3)
    cache = make(kv, tmp_path, plan=plan)
    gen = torch.Generator().manual_seed(17)
    a = fill(cache, "a", gen, 8)
    to_disk(cache, "a")
    plan.arm(kind, next_n=1)
    assert cache.reload("a")
    (done,) = cache.synchronize(10)
    assert not done.ok and f"Errno {code}" in done.reason and done.state is S.ON_DISK
    assert plan.injected[kind] == 1
    assert cache.state_of("a") is S.ON_DISK and cache.take_lost() == []
    cache.check_integrity()
    assert cache.reload("a")
    (done,) = cache.synchronize(10)
    assert done.ok
    assert_same(cache, "a", a)
    cache.check_integrity()


def flip_on_disk(tmp_path, data, at: int, bits: int) -> None:
    """Flip ``bits`` of byte ``at`` of the request's first page (layer 0 K), found on disk
    exactly once."""
    needle = data[0][0][:4].contiguous().view(torch.uint8).numpy().tobytes()
    hits = 0
    for path in (tmp_path / "disk").rglob("*"):
        raw = bytearray(path.read_bytes()) if path.is_file() else bytearray()
        found = raw.find(needle)
        if found >= 0:
            raw[found + at] ^= bits
            path.write_bytes(bytes(raw))
            hits += 1
    assert hits == 1, "the request's bytes were not found on disk exactly once"


def test_flipped_byte_in_the_file_is_detected_never_served(kv, tmp_path):
    cache = make(kv, tmp_path)
    gen = torch.Generator().manual_seed(16)
    a = fill(cache, "a", gen, 8)
    to_disk(cache, "a")
    flip_on_disk(tmp_path, a, at=7, bits=0xFF)
    assert cache.reload("a")
    cache.synchronize(10)
    assert cache.state_of("a") is S.LOST
    cache.check_integrity()


def test_start_up_reattach_and_clear(kv, tmp_path):
    cache = make(kv, tmp_path, on_start="reattach")
    gen = torch.Generator().manual_seed(17)
    a = fill(cache, "a", gen, 10)
    to_disk(cache, "a")
    fill(cache, "b", gen, 4)  # resident only: nothing of it on disk
    cache.close()
    kv2 = make(kv, tmp_path, on_start="reattach")
    assert kv2.requests() == ["a"]
    assert kv2.state_of("a") is S.ON_DISK
    kv2.check_integrity()
    assert kv2.reload("a")
    kv2.synchronize(10)
    assert_same(kv2, "a", a)
    kv2.close()  # releases the path for the next cache
    kv3 = make(kv, tmp_path, on_start="clear")
    assert kv3.requests() == [] and kv3.disk.used_bytes() == 0


def test_controller_splits_offload_bytes_by_destination(kv, geom, tmp_path):
    from tiering.policies import make_policy

    from tiering.control.controller import ControllerConfig, EvictionController
    from tiering.control.pressure import PoolPressure

    cache = make(kv, tmp_path, host_pages=2, device_pages=8)
    gen = torch.Generator().manual_seed(18)
    for rid in ("a", "b", "c"):
        fill(cache, rid, gen, 8)  # 2 pages each: 6 of 8 device pages
    clock = [0.0]
    ctl = EvictionController({"kv": cache}, make_policy("lru"), PoolPressure(cache),
                             ControllerConfig(high=0.5, low=0.3), clock=lambda: clock[0])
    for i, rid in enumerate(("a", "b", "c")):
        ctl.add_request(rid)
        clock[0] = float(i)
        ctl.touch(rid)
    report = ctl.evict_if_needed(running=())
    cache.synchronize(10)
    cache.check_integrity()
    assert report.offloaded == ("a", "b")  # oldest first, until under low
    assert cache.state_of("a") is S.ON_HOST and cache.state_of("b") is S.ON_DISK
    st = ctl.stats()
    assert st["bytes_device_to_host"] == 2 * geom.page_bytes
    assert st["bytes_device_to_disk"] == 2 * geom.page_bytes


def test_reclaimable_many_matches_one_by_one(kv, tmp_path):
    cache = make(kv, tmp_path, host_pages=3, device_pages=24, cap_pages=4)
    gen = torch.Generator().manual_seed(19)
    rng = random.Random(19)
    rids = []
    for i in range(10):
        rid = f"m{i}"
        fill(cache, rid, gen, rng.randint(1, 9))
        rids.append(rid)
    for rid in rids[:4]:
        cache.offload(rid)
    cache.synchronize(10)
    cache.ingest_request("empty")  # resident with no pages
    rids.append("empty")
    many = cache.reclaimable_many(rids)
    one = [cache.reclaimable(r) for r in rids]
    assert many.tolist() == one
    assert any(one) and not all(one)  # some fit below, some do not
    with pytest.raises(KeyError, match="ghost"):
        cache.reclaimable_many(["m5", "ghost"])


def test_poll_counts_buried_copies_and_disk_gauge(kv, tmp_path, closing):
    import threading

    release = threading.Event()
    entered = threading.Event()

    def hold(kind):
        entered.set()
        assert release.wait(10)

    cache = make(kv, tmp_path, copy_fault_hook=hold)
    closing.call(release.set)  # before the cache is closed: its held copy goes on
    gen = torch.Generator().manual_seed(20)
    fill(cache, "a", gen, 8)
    assert cache.offload("a") and entered.wait(10)
    cache.remove_request("a")  # its copy is running: the slots wait for it
    assert cache.host_used_bytes() > 0 and cache.device_used_bytes() > 0
    assert cache.in_flight() == 1
    cache.check_integrity()
    release.set()
    (done,) = cache.synchronize(10)  # the burial is reported, with no state: it is gone
    assert done == TransferResult("a", Move.OFFLOAD_TO_HOST, True, 2 * cache.geometry.page_bytes, None)
    assert cache.host_used_bytes() == 0 and cache.device_used_bytes() == 0
    fill(cache, "b", gen, 8)
    cache.offload("b")
    cache.synchronize(10)
    assert cache.demote("b")
    cache.synchronize(10)
    assert cache.disk_used_bytes() == cache.disk.used_bytes() > 0
    cache.check_integrity()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_drop_gives_up_an_offloaded_request(kv, tmp_path, tier):
    cache = make(kv, tmp_path)
    gen = torch.Generator().manual_seed(23)
    fill(cache, "a", gen, 8)
    b = fill(cache, "b", gen, 8)
    if tier == "host":
        cache.offload("a")
        cache.synchronize(10)
    else:
        to_disk(cache, "a")
    cache.drop("a")
    cache.check_integrity()
    assert cache.state_of("a") is S.LOST and cache.lost_reason("a") == "dropped"
    assert cache.stats.dropped == 1 and cache.stats.lost == 0
    assert cache.host_used_bytes() == 0 and cache.disk_used_bytes() == 0
    assert cache.take_lost() == [("a", "dropped")]
    with pytest.raises(RequestLost, match="dropped"):
        cache.read("a", 0)
    assert_same(cache, "b", b)
    cache.remove_request("a")
    cache.check_integrity()


@pytest.mark.parametrize("on_start", ["clear", "reattach"])
def test_a_second_cache_on_a_live_cache_disk_path_is_refused(kv, tmp_path, on_start):
    from tiering.disk import DiskPathInUseError

    first = make(kv, tmp_path, on_start="reattach")
    gen = torch.Generator().manual_seed(41)
    data = {"a": fill(first, "a", gen, 9)}
    to_disk(first, "a")
    with pytest.raises(DiskPathInUseError, match=str(tmp_path / "disk")):
        make(kv, tmp_path, on_start=on_start)
    first.check_integrity()
    reload_all_and_check(first, data)  # the first cache's KV is still its own
    first.close()
    second = make(kv, tmp_path, on_start=on_start)  # released when the first closed
    second.check_integrity()


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
def test_verify_catches_wrong_bytes_the_store_did_not_notice(kv, tmp_path, stage):
    """A store that hands back one wrong bit for one request (no error of its own): the
    cache's checksum taken at offload catches it on the direct path (CPU) and on the
    staged path (a GPU's, through the ring); that request is lost with the reason, its
    wrong bytes are never handed back, and the other request comes back bitwise."""
    from tiering.core.staging import StagingConfig

    extra = {"stage_disk_io": True, "staging": StagingConfig(buffers=2, pages=2)} if stage else {}
    cache = make(kv, tmp_path, verify=True, **extra)
    assert (cache._ring is not None) == stage
    gen = torch.Generator().manual_seed(61)
    a, b = fill(cache, "a", gen, 13), fill(cache, "b", gen, 13)
    for rid in ("a", "b"):
        to_disk(cache, rid)
    cache.check_integrity()
    bad = cache._reqs["a"].disk.chunks
    served = cache.disk.read
    flipped = []

    def read(extent, out, *, first_page=0):
        served(extent, out, first_page=first_page)
        if extent.chunks == bad and not flipped:
            out.view(torch.uint8).view(-1)[5] ^= 0x10  # one wrong bit, no error
            flipped.append(first_page)

    cache.disk.read = read
    assert cache.reload("a") and cache.reload("b")
    results = {r.rid: r for r in cache.synchronize(10)}
    assert flipped, "the store never served a's extent"
    assert not results["a"].ok and results["b"].ok
    assert cache.state_of("a") is S.LOST
    assert "disk copy does not match the checksum" in cache.lost_reason("a")
    with pytest.raises(RequestLost, match="'a' is lost"):
        cache.read("a", 0)
    assert_same(cache, "b", b)
    cache.check_integrity()
    del a


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
def test_reloads_read_the_disk_as_scratch_and_a_failed_one_hands_back_nothing(
        kv, tmp_path, stage):
    """The cache's disk reads land in buffers it throws away on a failure (its staging
    ring, a reload's own slots), so it asks the store to skip its staging copy
    (``out_is_scratch``); a chunk damaged on disk then fails only its own request, whose
    bytes are never handed back, and the other request comes back bitwise. A store whose
    ``read`` has no such keyword is asked plainly (the control)."""
    from tiering.core.staging import StagingConfig

    extra = {"stage_disk_io": True, "staging": StagingConfig(buffers=2, pages=2)} if stage else {}
    cache = make(kv, tmp_path, **extra)
    assert cache.disk.direct_io
    gen = torch.Generator().manual_seed(62)
    data = {rid: fill(cache, rid, gen, 13) for rid in ("a", "b")}
    for rid in data:
        to_disk(cache, rid)
    flip_on_disk(tmp_path, data["a"], at=3, bits=0x40)
    served, flags = cache.disk.read, []

    def read(extent, out, *, first_page=0, out_is_scratch=False):
        flags.append(out_is_scratch)
        return served(extent, out, first_page=first_page, out_is_scratch=out_is_scratch)

    cache.disk.read = read
    assert cache.reload("a") and cache.reload("b")
    results = {r.rid: r for r in cache.synchronize(10)}
    assert flags and all(flags), flags
    assert not results["a"].ok and results["b"].ok
    assert cache.state_of("a") is S.LOST
    assert_same(cache, "b", data["b"])
    cache.check_integrity()

    plain = []  # the control: a read without the keyword is called without it

    def plain_read(extent, out, *, first_page=0):
        plain.append(first_page)
        return served(extent, out, first_page=first_page)

    cache.offload("b")
    cache.synchronize(10)
    if cache.state_of("b") is S.ON_HOST:
        assert cache.demote("b")
        cache.synchronize(10)
    cache.disk.read = plain_read
    assert cache.reload("b")
    assert all(r.ok for r in cache.synchronize(10))
    assert plain
    assert_same(cache, "b", data["b"])
    cache.check_integrity()
