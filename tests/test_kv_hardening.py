"""Hardening of the KV cache: failed commits, reused ids, empty moves, closed
caches, strict input, completion records, and reloads that do not queue behind
offloads. Every test checks integrity after each operation.

Size: over 500 lines: each hardening case with the integrity checks after every operation.
"""

from __future__ import annotations

import dataclasses
import errno
import threading

import numpy as np
import pytest
import torch
from conftest import assert_same, fill, random_kv
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_records import CacheClosed

from tiering.core.pinning import HostRuntime, PinError, PinMode, aligned_empty, pin_host_slab
from tiering.disk import DiskConfig
from tiering.types import Move, RequestState, TransferResult

S = RequestState


def make(geom, tmp_path, *, host_pages=8, device_pages=16, cap_pages=16, on_start="reattach", **kw):
    page = geom.page_bytes
    cfg = DiskConfig(path=tmp_path / "disk", capacity_bytes=cap_pages * page,
                     chunk_bytes=2 * page, on_start=on_start)
    return PagedKVCache(geom, device_pages=device_pages, host_pages=host_pages, disk=cfg, **kw)


def snapshot(kv):
    return (
        {rid: (r.state, list(r.device), list(r.host), r.disk, r.num_tokens)
         for rid, r in kv._reqs.items()},
        kv.device_pool.used_pages, kv.host_pool.used_pages,
        kv.disk.used_bytes() if kv.disk is not None else 0,
        dict(kv.stats.as_dict()), len(kv._transfers.tombstones), sorted(kv._life.inflight),
    )


def failing_commit(monkeypatch, kv, fail: threading.Event):
    real = kv.disk.commit

    def commit(owner, extent, meta=None):
        if fail.is_set():
            raise OSError(errno.ENOSPC, "No space left on device (manifest)")
        return real(owner, extent, meta)

    monkeypatch.setattr(kv.disk, "commit", commit)


# -- A: a commit that fails is a failed write -------------------------------------------


@pytest.mark.parametrize("route", ["demote", "offload_disk"])
def test_failed_commit_is_a_failed_write_and_never_escapes(geom, tmp_path, monkeypatch, route, closing):
    kv = closing(make(geom, tmp_path, host_pages=8 if route == "demote" else 1))
    fail = threading.Event()
    failing_commit(monkeypatch, kv, fail)
    gen = torch.Generator().manual_seed(31)
    data = fill(kv, "a", gen, 11)  # 3 pages: never fits a 1-page host tier
    if route == "demote":
        assert kv.offload("a")
        assert [d.move for d in kv.synchronize(10)] == [Move.OFFLOAD_TO_HOST]
        kv.check_integrity()
        fail.set()
        assert kv.demote("a")
        (done,) = kv.synchronize(10)  # must not raise
        assert done.move is Move.DEMOTE and not done.ok and done.state is S.ON_HOST
        back = S.ON_HOST
    else:
        fail.set()
        assert kv.offload("a")
        (done,) = kv.synchronize(10)
        assert done.move is Move.OFFLOAD_TO_DISK and not done.ok
        assert done.state is S.RESIDENT
        back = S.RESIDENT
    assert "ENOSPC" in done.reason or "No space" in done.reason
    kv.check_integrity()
    assert kv.state_of("a") is back and kv.in_flight() == 0
    assert kv.disk_used_bytes() == 0  # the destination was given back
    assert kv.stats.commit_failures == 1
    fail.clear()
    if back is S.ON_HOST:
        assert kv.reload("a")
        kv.synchronize(10)
    kv.check_integrity()
    assert_same(kv, "a", data)  # the source was never freed


def test_commit_failure_through_poll_does_not_raise(geom, tmp_path, monkeypatch, closing):
    kv = closing(make(geom, tmp_path, host_pages=1))
    fail = threading.Event()
    fail.set()
    failing_commit(monkeypatch, kv, fail)
    fill(kv, "a", torch.Generator().manual_seed(32), 9)
    assert kv.offload("a")
    kv._reqs["a"].job.future.result(10)
    out = kv.poll()
    assert [(d.rid, d.ok, d.state) for d in out] == [("a", False, S.RESIDENT)]
    kv.check_integrity()


def test_an_unexpected_completion_error_is_contained(geom, tmp_path, monkeypatch, closing):
    """Whatever a completion handler raises, poll returns and the records agree."""
    kv = closing(make(geom, tmp_path, host_pages=1))
    fill(kv, "a", torch.Generator().manual_seed(33), 9)

    def broken(*a, **k):
        raise KeyError("a bug in a completion")

    monkeypatch.setitem(kv._transfers.completions, Move.OFFLOAD_TO_DISK, broken)
    assert kv.offload("a")
    (done,) = kv.synchronize(10)
    assert not done.ok and done.state is S.LOST and "a bug" in done.reason
    assert kv.stats.completion_errors == 1
    kv.check_integrity()
    assert kv.device_used_bytes() == 0 and kv.disk_used_bytes() == 0


# -- B: a reused id behaves exactly like a fresh one ---------------------------------------


def test_reused_id_after_removal_mid_disk_reload(geom, tmp_path, closing):
    release, entered = threading.Event(), threading.Event()

    def hold(kind):
        if kind == "h2d":
            entered.set()
            assert release.wait(10)

    kv = closing(make(geom, tmp_path, host_pages=1, copy_fault_hook=hold))
    closing.call(release.set)
    gen = torch.Generator().manual_seed(34)
    fill(kv, "a", gen, 7)
    assert kv.offload("a")  # 2 pages, host holds 1: straight to disk
    kv.synchronize(10)
    assert kv.state_of("a") is S.ON_DISK
    assert kv.reload("a") and entered.wait(10)
    kv.remove_request("a")  # its disk read is running
    kv.check_integrity()
    (tomb,) = kv._transfers.tombstones.values()
    assert "a" not in tomb.key  # a fresh key, never the id
    data = fill(kv, "a", gen, 7)
    kv.check_integrity()
    assert kv.offload("a")  # straight to disk again
    release.set()
    out = kv.synchronize(10)  # used to raise "already committed"
    kv.check_integrity()
    assert sorted((d.move, d.ok, d.state) for d in out if d.state is not None) == [
        (Move.OFFLOAD_TO_DISK, True, S.ON_DISK)
    ]
    assert [d.state for d in out if d.move is Move.RELOAD_FROM_DISK] == [None]
    assert kv.reload("a")
    kv.synchronize(10)
    kv.check_integrity()
    assert_same(kv, "a", data)


def test_reused_id_after_removal_mid_offload_to_host(geom, closing):
    release, entered = threading.Event(), threading.Event()

    def hold(kind):
        entered.set()
        assert release.wait(10)

    kv = closing(PagedKVCache(geom, device_pages=8, host_pages=8, copy_fault_hook=hold))
    closing.call(release.set)
    gen = torch.Generator().manual_seed(35)
    fill(kv, "a", gen, 5)
    assert kv.offload("a") and entered.wait(10)
    kv.remove_request("a")
    data = fill(kv, "a", gen, 6)
    kv.check_integrity()
    release.set()
    out = kv.synchronize(10)
    assert [(d.rid, d.state) for d in out] == [("a", None)]
    assert kv.state_of("a") is S.RESIDENT  # the old copy's landing did not touch it
    kv.check_integrity()
    assert_same(kv, "a", data)


# -- C: an empty move changes nothing ------------------------------------------------------


def test_empty_request_offload_changes_nothing(geom, tmp_path, closing):
    kv = closing(make(geom, tmp_path))
    kv.ingest_request("e")
    assert kv.allocate("e", 0)
    before = snapshot(kv)
    assert kv.offload("e") == 0
    assert snapshot(kv) == before
    assert kv.state_of("e") is S.RESIDENT
    assert kv.reclaimable("e") == 0
    kv.check_integrity()
    assert kv.synchronize(5) == []
    assert kv.admit(ResourceStep("e"), StepContext())


# -- D: after close every call raises and changes nothing; a failed constructor leaves nothing


def _calls(kv):
    k, v = random_kv(torch.Generator().manual_seed(1), kv.geometry, 2)[0]
    return [
        lambda: kv.offload("r"), lambda: kv.reload("d"), lambda: kv.remove_request("d"),
        lambda: kv.remove_request("r"), lambda: kv.demote("h"), lambda: kv.drop("d"),
        lambda: kv.allocate("r", 40), lambda: kv.write("r", 0, 0, k, v),
        lambda: kv.read("r", 0), lambda: kv.ingest_request("new"), lambda: kv.poll(),
        lambda: kv.synchronize(1), lambda: kv.admit(ResourceStep("r"), StepContext()),
        lambda: kv.state_of("r"), lambda: kv.reclaimable("r"), lambda: kv.in_flight(),
    ]


def test_after_close_every_call_raises_and_changes_nothing(geom, tmp_path):
    kv = make(geom, tmp_path, host_pages=4)
    gen = torch.Generator().manual_seed(36)
    fill(kv, "r", gen, 6)
    fill(kv, "h", gen, 4)
    fill(kv, "d", gen, 9)
    assert kv.offload("h")
    kv.synchronize(10)
    assert kv.offload("d")  # host has 3 pages left, d needs 3
    kv.synchronize(10)
    assert kv.demote("d")
    kv.synchronize(10)
    assert kv.state_of("d") is S.ON_DISK and kv.state_of("h") is S.ON_HOST
    kv.check_integrity()
    kv.close()
    before = snapshot(kv)
    for call in _calls(kv):
        with pytest.raises(CacheClosed, match="closed"):
            call()
        assert snapshot(kv) == before
    kv.close()  # twice is fine
    assert snapshot(kv) == before


# close and cleanup are idempotent; fingerprint is a pure function of the geometry
AFTER_CLOSE_ANSWERS = {"close", "cleanup", "fingerprint"}


def _own_methods():
    """Every public method PagedKVCache defines itself (its tiering.resources.kv_* classes), not the
    engine contract's no-op defaults."""
    import inspect

    for cls in PagedKVCache.__mro__:
        if not cls.__module__.startswith("tiering.resources.kv"):
            continue
        for name, fn in vars(cls).items():
            if not name.startswith("_") and inspect.isfunction(fn):
                yield name, fn


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_after_close_every_own_method_raises_cache_closed(geom, tmp_path, prefix):
    """Not a hand-picked list: every method the cache defines, the engine's prefix hooks
    included (resolve/apply/extend/complete answered None after close when the prefix cache
    was off), raises CacheClosed after close, before it looks at its arguments."""
    import inspect

    from tiering.blocks import KeyRoot

    kv = make(geom, tmp_path)
    if prefix:
        kv.enable_prefix_cache(KeyRoot(geom.fingerprint(), "m", page_tokens=geom.page_tokens))
    fill(kv, "r", torch.Generator().manual_seed(5), 3)
    kv.close()
    before = snapshot(kv)
    methods = dict(_own_methods())
    assert {"resolve_cached_prefix", "apply_cached_prefix", "extend_prefix_chain",
            "complete_cached_walk", "admit", "offload"} <= set(methods)  # the walk finds them
    special = {"admit": (ResourceStep("r"), StepContext())}
    checked = []
    for name, fn in sorted(methods.items()):
        if name in AFTER_CLOSE_ANSWERS:
            continue
        params = list(inspect.signature(fn).parameters.values())[1:]
        args = special.get(name) or tuple(
            "r" for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        with pytest.raises(CacheClosed, match="closed"):
            getattr(kv, name)(*args)
        assert snapshot(kv) == before, name
        checked.append(name)
    assert len(checked) >= 30, checked


def test_a_constructor_that_fails_leaves_no_threads(geom, tmp_path):
    def names():
        return {t.name for t in threading.enumerate() if t.name.startswith("tiering-")}

    before = names()

    class Refused(RuntimeError):
        pass

    class BadStore:
        def reattached(self):
            raise Refused("the disk tier cannot start")

        def read(self, *args, **kwargs):  # the store's methods, never reached
            raise AssertionError("read")

        write = read

        closed = False

        def close(self):
            BadStore.closed = True

    with pytest.raises(Refused):
        PagedKVCache(geom, device_pages=4, host_pages=4, disk_store=BadStore())
    assert BadStore.closed
    assert names() == before
    with pytest.raises(ValueError, match="copy_workers"):
        PagedKVCache(geom, device_pages=4, host_pages=4, copy_workers=True)
    assert names() == before


# -- E: strict input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda kv, k, v: kv.write("r", True, 0, k, v), "layer must be an int"),
        (lambda kv, k, v: kv.write("r", 0, False, k, v), "start must be an int"),
        (lambda kv, k, v: kv.write("r", 0, 1.0, k, v), "start must be an int"),
        (lambda kv, k, v: kv.write("r", 0, -1, k, v), "start must be >= 0"),
        (lambda kv, k, v: kv.write("r", 0, 0, k.float(), v.float()), "k.dtype"),
        (lambda kv, k, v: kv.write("r", 0, 0, k, v.half()), "v.dtype"),
        (lambda kv, k, v: kv.write("r", 0, 0, k.to("meta"), v), "k.device"),
        (lambda kv, k, v: kv.write("r", 0, 0, k.tolist(), v), "k must be a torch.Tensor"),
        (lambda kv, k, v: kv.write("r", 0, 0, k[:, :1], v[:, :1]), "must both be"),
        (lambda kv, k, v: kv.read("r", True), "layer must be an int"),
        (lambda kv, k, v: kv.layer_view(True), "layer must be an int"),
        (lambda kv, k, v: kv.allocate("r", True), "num_tokens must be an int"),
        (lambda kv, k, v: kv.allocate("r", 9.0), "num_tokens must be an int"),
        (lambda kv, k, v: kv.synchronize(True), "timeout"),
    ],
)
def test_bad_arguments_name_the_field_and_change_nothing(geom, call, match, closing):
    kv = closing(PagedKVCache(geom, device_pages=8, host_pages=8))
    gen = torch.Generator().manual_seed(37)
    data = fill(kv, "r", gen, 8)
    k, v = random_kv(gen, geom, 3)[1]
    before = snapshot(kv)
    with pytest.raises(ValueError, match=match):
        call(kv, k, v)
    assert snapshot(kv) == before
    kv.check_integrity()
    assert_same(kv, "r", data)  # nothing written


# -- G: completion as data -----------------------------------------------------------------


def test_poll_and_synchronize_return_transfer_records(geom, tmp_path, closing):
    kv = closing(make(geom, tmp_path, host_pages=4))
    pb = geom.page_bytes
    gen = torch.Generator().manual_seed(38)
    fill(kv, "a", gen, 5)  # 2 pages
    fill(kv, "b", gen, 13)  # 4 pages: the host has 2 left after a
    assert kv.offload("a") and kv.offload("b")
    out = sorted(kv.synchronize(10))
    assert out == [
        TransferResult("a", Move.OFFLOAD_TO_HOST, True, 2 * pb, S.ON_HOST),
        TransferResult("b", Move.OFFLOAD_TO_DISK, True, 4 * pb, S.ON_DISK),
    ]
    kv.check_integrity()
    assert kv.demote("a")
    assert kv.synchronize(10) == [TransferResult("a", Move.DEMOTE, True, 2 * pb, S.ON_DISK)]
    assert kv.reload("a") and kv.reload("b")
    out = sorted(kv.synchronize(10))
    assert out == [
        TransferResult("a", Move.RELOAD_FROM_DISK, True, 2 * pb, S.RESIDENT),
        TransferResult("b", Move.RELOAD_FROM_DISK, True, 4 * pb, S.RESIDENT),
    ]
    assert kv.poll() == []  # each completion is reported once
    kv.check_integrity()


def test_a_completion_applied_by_admit_is_still_reported_by_poll(geom, closing):
    kv = closing(PagedKVCache(geom, device_pages=8, host_pages=8))
    fill(kv, "a", torch.Generator().manual_seed(39), 5)
    kv.offload("a")
    kv.synchronize(10)
    assert kv.reload("a")
    kv._reqs["a"].job.future.result(10)
    assert kv.admit(ResourceStep("a"), StepContext())  # applies the reload
    assert [(d.move, d.state) for d in kv.poll()] == [(Move.RELOAD_FROM_HOST, S.RESIDENT)]
    assert kv.poll() == []
    kv.check_integrity()


# -- F12 (CPU): a reload does not queue behind a running offload ---------------------------


def test_reload_is_not_queued_behind_running_offloads(geom, closing):
    release = threading.Event()
    offloads_running = threading.Semaphore(0)

    def hook(kind):
        if kind == "d2h":  # every offload copy blocks until released
            offloads_running.release()
            assert release.wait(10)

    kv = closing(PagedKVCache(geom, device_pages=16, host_pages=16, copy_workers=1, copy_fault_hook=hook))
    closing.call(release.set)
    gen = torch.Generator().manual_seed(40)
    a = fill(kv, "a", gen, 6)
    kv.offload("a")
    release.set()
    kv.synchronize(10)
    assert offloads_running.acquire(timeout=1)  # a's own copy went through the hook
    release.clear()
    fill(kv, "b", gen, 6)
    fill(kv, "c", gen, 6)
    kv.offload("b")
    kv.offload("c")
    assert offloads_running.acquire(timeout=10)  # b's copy holds the only d2h worker
    assert kv.reload("a")
    (done,) = [kv._reqs["a"].job.future]
    done.result(10)  # completes while the offloads are still blocked
    assert kv.state_of("b") is S.OFFLOADING and kv.state_of("c") is S.OFFLOADING
    out = kv.poll()
    assert [(d.rid, d.move) for d in out] == [("a", Move.RELOAD_FROM_HOST)]
    kv.check_integrity()
    assert_same(kv, "a", a)
    release.set()
    kv.synchronize(10)
    kv.check_integrity()


# -- F18: the device page table is kept per request ---------------------------------------


def test_read_reuses_the_device_page_table_until_slots_change(geom, closing):
    kv = closing(PagedKVCache(geom, device_pages=16, host_pages=16))
    gen = torch.Generator().manual_seed(41)
    data = fill(kv, "a", gen, 6)
    assert_same(kv, "a", data)
    built = kv.stats.page_tables_built
    table = kv._reqs["a"].index
    assert built == 1 and table.tolist() == kv.page_table("a")
    assert_same(kv, "a", data)  # every layer again: no rebuild
    assert kv.stats.page_tables_built == built and kv._reqs["a"].index is table
    assert kv.allocate("a", 20)  # grows: the table must be rebuilt (negative control)
    k, v = random_kv(gen, geom, 20)[0]
    kv.write("a", 0, 0, k, v)
    k2, v2 = kv.read("a", 0)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert kv.stats.page_tables_built == built + 1
    kv.check_integrity()


# -- F17: pinning reports how the slab was pinned; a failed register falls back ---------


def test_pinning_with_a_failing_runtime_falls_back_and_says_why(geom):
    calls = []

    def register(ptr, nbytes):
        calls.append(("register", ptr % 4096, nbytes))
        raise PinError("cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered (712)")

    rt = HostRuntime("fake", register, lambda ptr: calls.append(("unregister", ptr)))
    slab = pin_host_slab((3, *geom.page_shape), geom.dtype, torch.device("cpu"), runtime=rt,
                         pin_memory=lambda t: t)
    assert slab.outcome.mode is PinMode.TORCH_ROUNDED
    assert "712" in slab.outcome.error
    assert calls == [("register", 0, 3 * geom.page_bytes)]  # page-aligned, exact size
    slab.release()
    assert calls == [("register", 0, 3 * geom.page_bytes)]  # nothing to unregister

    def no_pin(t):
        raise RuntimeError("no pinned memory here")

    slab = pin_host_slab((3, *geom.page_shape), geom.dtype, torch.device("cpu"), runtime=rt,
                         pin_memory=no_pin)
    assert slab.outcome.mode is PinMode.NOT_PINNED and "no pinned memory" in slab.outcome.error


def test_exact_pinning_unregisters_once_after_the_workers_joined(geom):
    calls = []
    rt = HostRuntime("fake", lambda p, n: calls.append(("register", n)),
                     lambda p: calls.append(("unregister", p)))
    kv = PagedKVCache(geom, device_pages=4, host_pages=5, host_runtime=rt)
    assert kv.host_pinning.mode is PinMode.EXACT
    assert kv.host_pinning.nbytes == 5 * geom.page_bytes
    assert kv._host.data_ptr() % 4096 == 0
    threads = {t.name for t in threading.enumerate()}
    assert any(n.startswith("tiering-h2d") for n in threads)
    kv.close()
    kv.close()
    assert calls[0] == ("register", 5 * geom.page_bytes)
    assert [c[0] for c in calls] == ["register", "unregister"]
    assert calls[1][1] == kv._host.data_ptr()
    assert all(not ex._threads[0].is_alive() for ex in kv._transfers.executors)


def test_aligned_empty_is_aligned_and_exact():
    for shape in [(1,), (3, 5), (7, 11, 13)]:
        t = aligned_empty(shape, torch.bfloat16)
        assert t.data_ptr() % 4096 == 0 and tuple(t.shape) == shape
    with pytest.raises(ValueError, match="power of two"):
        aligned_empty((2,), torch.float32, align=3000)


def test_compute_stream_needs_cuda(geom):
    with pytest.raises(ValueError, match="compute_stream"):
        PagedKVCache(geom, device_pages=4, host_pages=4, compute_stream=object())



def test_build_takes_the_compute_stream_from_the_engine_info(geom):
    from tiering.resources.base import EngineResourceInfo, NodeResourceSpec

    spec = NodeResourceSpec("kv", PagedKVCache, {"geometry": geom, "device_pages": 4, "host_pages": 4})
    kv = PagedKVCache.build(spec, EngineResourceInfo(device=torch.device("cpu")))
    kv.close()
    info = EngineResourceInfo(device=torch.device("cpu"), compute_stream=object())
    with pytest.raises(ValueError, match="compute_stream given for a cpu device"):
        PagedKVCache.build(spec, info)  # forwarded: a CPU cache refuses a stream


def _second_offload_queued(geom, seed):
    """A cache whose one d2h worker is held inside a's offload copy, with b's
    offload queued behind it (not started). Returns (cache, gate to open)."""
    gate = threading.Event()
    started = threading.Event()

    def hold(direction):  # the first copy blocks the single d2h worker
        if direction == "d2h" and not started.is_set():
            started.set()
            assert gate.wait(10)

    kv = PagedKVCache(geom, device_pages=8, host_pages=8, copy_fault_hook=hold, copy_workers=1)
    gen = torch.Generator().manual_seed(seed)
    fill(kv, "a", gen, 5)
    fill(kv, "b", gen, 5)
    assert kv.offload("a") and started.wait(10)
    assert kv.offload("b")  # queued behind a's copy
    return kv, gate


def test_a_cancelled_offload_is_reported_as_a_record(geom, closing):
    """An offload taken back by admit before its copy started is reported
    (ok=False, resident again): a controller that counted it as leaving the
    device would otherwise count it for good (the demo stalled on exactly that)."""
    kv, gate = _second_offload_queued(geom, 5)
    closing(kv)
    closing.call(gate.set)
    assert kv.admit(ResourceStep("b"), StepContext())  # wanted again: cancelled
    recs = kv.poll()
    assert [(d.rid, d.ok, d.state) for d in recs] == [("b", False, S.RESIDENT)]
    assert "cancelled" in recs[0].reason
    gate.set()
    kv.synchronize(10)
    kv.check_integrity()


def test_remove_reports_a_copy_it_cancelled(geom, closing):
    kv, gate = _second_offload_queued(geom, 6)
    closing(kv)
    closing.call(gate.set)
    kv.remove_request("b")  # its copy never started
    assert [(d.rid, d.ok, d.state) for d in kv.poll()] == [("b", False, None)]
    gate.set()
    assert [(d.rid, d.ok) for d in kv.synchronize(10)] == [("a", True)]
    kv.check_integrity()


# -- bad timeouts: refused before anything waits or closes ------------------------------


BAD_TIMEOUTS = [float("nan"), float("inf"), -1.0, True, "5"]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_close_with_a_bad_timeout_is_refused_and_the_cache_stays_open(geom, timeout, closing):
    kv = closing(PagedKVCache(geom, device_pages=8, host_pages=8))
    gen = torch.Generator().manual_seed(31)
    data = fill(kv, "a", gen, 7)
    kv.check_integrity()
    before = snapshot(kv)
    with pytest.raises(ValueError, match="cleanup: timeout must be a finite number"):
        kv.close(timeout)
    assert snapshot(kv) == before
    kv.check_integrity()  # would raise CacheClosed had the refused call closed it
    assert_same(kv, "a", data)
    assert kv.offload("a") > 0  # the copy threads still run
    kv.synchronize(10)
    kv.check_integrity()
    assert kv.state_of("a") is S.ON_HOST


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_synchronize_with_a_bad_timeout_is_refused_while_a_copy_is_in_flight(
        geom, timeout, closing):
    go, entered = threading.Event(), threading.Semaphore(0)

    def hold(kind):
        entered.release()
        assert go.wait(10)

    kv = closing(PagedKVCache(geom, device_pages=8, host_pages=8, copy_fault_hook=hold))
    closing.call(go.set)  # before the cache is closed: its held copy goes on
    gen = torch.Generator().manual_seed(32)
    data = fill(kv, "a", gen, 9)
    assert kv.offload("a") > 0
    assert entered.acquire(timeout=10)
    kv.check_integrity()
    before = snapshot(kv)
    with pytest.raises(ValueError, match="synchronize: timeout must be a finite number"):
        kv.synchronize(timeout)
    assert snapshot(kv) == before
    kv.check_integrity()
    go.set()
    kv.synchronize(10)
    kv.check_integrity()
    assert kv.state_of("a") is S.ON_HOST
    assert kv.reload("a")
    kv.synchronize(10)
    kv.check_integrity()
    assert_same(kv, "a", data)


def test_build_without_a_geometry_names_what_the_config_lacks(geom):
    """Before, a node config without 'geometry' raised KeyError('geometry'), and one whose
    geometry was not a KVGeometry failed deep in the cache's set-up."""
    from tiering.resources.base import EngineResourceInfo, NodeResourceSpec

    info = EngineResourceInfo(device=torch.device("cpu"))
    spec = NodeResourceSpec("kv", PagedKVCache, {"device_pages": 4, "host_pages": 4})
    with pytest.raises(ValueError, match=r"needs 'geometry'.*\['device_pages', 'host_pages'\]"):
        PagedKVCache.build(spec, info)
    bad = NodeResourceSpec("kv", PagedKVCache, {"geometry": {"num_layers": 2}, "device_pages": 4})
    with pytest.raises(TypeError, match="'geometry' must be a KVGeometry, got dict"):
        PagedKVCache.build(bad, info)


def _many_resources(kv):
    """A PagedKVCache, a FakeTieredResource and the replay's ModeledKVCache, each holding
    requests "a", "b" and "ab" with different sizes, "a" and "b" resident."""
    from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
    from tiering.testing import FakeTieredResource

    cache = kv(device_pages=8, host_pages=8)
    fake = FakeTieredResource(device_capacity=100, host_capacity=100, disk_capacity=100)
    model = ModeledKVCache(16, 4, 8, 8, 8, LinkRates.instant(), lambda: 0.0)
    for res in (cache, fake, model):
        for rid, n in (("a", 3), ("b", 9), ("ab", 0)):
            res.ingest_request(rid)
            assert res.allocate(rid, n)
    return cache, fake, model


@pytest.mark.parametrize("bad", ["ab", b"ab", 7, (r for r in ("a", "b"))],
                         ids=["str", "bytes", "int", "generator"])
def test_the_many_hooks_refuse_one_str_instead_of_a_collection_of_ids(kv, bad):
    """``reclaimable_many("ab")`` answered for requests "a" and "b" (a str is a sequence of
    its characters), the wrong requests and as many answers as characters; a generator
    failed on ``len``. Now anything but a collection of ids is a TypeError naming the
    hook, and nothing changes."""
    for res in _many_resources(kv):
        before = [res.reclaimable(r) for r in ("a", "b", "ab")], res.device_used_bytes()
        for hook in (res.reclaimable_many, res.get_offload_priority_many):
            with pytest.raises(TypeError, match=rf"{hook.__name__}: rids must be a collection "
                                                r"of request ids"):
                hook(bad)
        assert ([res.reclaimable(r) for r in ("a", "b", "ab")],
                res.device_used_bytes()) == before
        res.check_integrity()
        # the control: the same requests named in a list, a tuple or an array
        for ids in (["a", "b"], ("ab",), np.array(["b", "a"])):
            assert res.reclaimable_many(ids).tolist() == [res.reclaimable(r) for r in ids]
            assert res.get_offload_priority_many(ids).tolist() == [
                res.get_offload_priority(r) for r in ids]


def test_an_injected_disk_store_or_host_runtime_of_the_wrong_kind_is_refused_at_the_door(
        geom, tmp_path):
    """``disk_store=3`` and ``host_runtime=3`` raised AttributeError from deep in the set-up
    (and logged that the disk tier "did not close cleanly"); a store laid out for other
    pages was taken, and then every offload to it failed; ``disk`` next to ``disk_store``
    was silently ignored. Each is now refused by name before the cache takes the store,
    which stays the caller's, open and usable."""
    from tiering.disk.store import DiskPageStore

    cfg = DiskConfig(path=tmp_path / "d", capacity_bytes=16 * geom.page_bytes)
    other = dataclasses.replace(geom, head_dim=geom.head_dim * 2, dtype=torch.float16)
    wrong = DiskPageStore(cfg, other.page_shape, other.dtype)
    cases = [
        (dict(disk_store=3), TypeError, r"disk_store must be a DiskPageStore .*int lacks"),
        (dict(host_runtime=3), TypeError, r"host_runtime must be a HostRuntime"),
        (dict(host_runtime=object()), TypeError, r"host_runtime must be a HostRuntime"),
        (dict(disk_store=wrong), ValueError, r"disk_store holds pages of shape"),
        (dict(disk_store=wrong, disk=DiskConfig(path=tmp_path / "e", capacity_bytes=1 << 20)),
         ValueError, r"disk \(a DiskConfig the cache opens\) and disk_store"),
    ]
    try:
        for kwargs, error, match in cases:
            with pytest.raises(error, match=match):
                PagedKVCache(geom, device_pages=4, host_pages=4, **kwargs)
        assert not (tmp_path / "e").exists()  # the config next to the store was never opened
        assert wrong.reattached() == {}  # the refused store is still open, the caller's
    finally:
        wrong.close()
    # the control: a store laid out for this geometry is taken and holds a request exactly
    right = DiskPageStore(DiskConfig(path=tmp_path / "r", capacity_bytes=16 * geom.page_bytes),
                          geom.page_shape, geom.dtype, fingerprint=geom.fingerprint())
    kv = PagedKVCache(geom, device_pages=4, host_pages=1, disk_store=right)
    try:
        data = fill(kv, "a", torch.Generator().manual_seed(11), 2 * geom.page_tokens)
        assert kv.offload("a") > 0
        kv.synchronize()
        assert kv.state_of("a") is S.ON_DISK
        assert kv.reload("a")
        kv.synchronize()
        assert_same(kv, "a", data)
        kv.check_integrity()
    finally:
        kv.close()


@pytest.mark.parametrize("bad", ["a", None, 3], ids=["rid", "none", "int"])
def test_admit_refuses_what_is_not_a_step_by_name_and_changes_nothing(kv, bad):
    """``admit("a", ctx)`` (the request id where a ResourceStep goes) raised AttributeError
    ("'str' object has no attribute 'rid'"), from the cache and the fake alike."""
    from tiering.testing import FakeTieredResource

    cache, fake = kv(device_pages=8, host_pages=8), FakeTieredResource(device_capacity=100)
    for res in (cache, fake):
        res.ingest_request("a")
        assert res.allocate("a", 3)
        before = res.state_of("a"), res.device_used_bytes()
        for step in (bad, object()) if isinstance(bad, str) else (bad, ResourceStep(bad)):
            with pytest.raises(TypeError, match=r"admit: step must be a ResourceStep"):
                res.admit(step, StepContext(0))
        assert (res.state_of("a"), res.device_used_bytes()) == before
        assert res.admit(ResourceStep("a"), StepContext(0)).ok  # the control
        res.check_integrity()
