"""Disk jobs through the staging ring, a piece at a time, and page-range disk I/O.

Most tests drive the range path through ``RangeStore``, a stand-in that adds
``first_page=`` range I/O on top of the store's whole-extent I/O (it records
every call, so a test can show the path that ran).
``test_the_real_store_moves_a_large_request_in_pieces`` uses the real store's own
range I/O (``read(extent, out, *, first_page=0)`` / ``write(extent, pages, *,
first_page=0)``) and records the ranges it was asked for. A hypothesis state
machine drives the ring alone (acquire, release, double and foreign releases)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same, fill
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tiering.resources.kv_cache import PagedKVCache

from tiering.core.staging import StagingConfig, StagingRing
from tiering.disk import DiskConfig
from tiering.disk.store import DiskPageStore
from tiering.types import Move, RequestState

S = RequestState


class RangeStore(DiskPageStore):
    """Page-range reads and writes over whole-extent I/O; records each call."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls: list[tuple[str, int, int]] = []
        self._parts: dict[tuple, tuple[torch.Tensor, set[int]]] = {}

    def read(self, extent, out, *, first_page=0):
        k = out.shape[0]
        self.calls.append(("read", first_page, k))
        full = torch.empty((extent.num_pages, *out.shape[1:]), dtype=out.dtype)
        super().read(extent, full)
        out.copy_(full[first_page : first_page + k])

    def write(self, extent, pages, *, first_page=0):
        k = pages.shape[0]
        self.calls.append(("write", first_page, k))
        buf, got = self._parts.setdefault(
            extent.chunks,
            (torch.empty((extent.num_pages, *pages.shape[1:]), dtype=pages.dtype), set()),
        )
        buf[first_page : first_page + k].copy_(pages)
        got.update(range(first_page, first_page + k))
        if len(got) == extent.num_pages:
            del self._parts[extent.chunks]
            super().write(extent, buf)


def make(geom, tmp_path, *, host_pages=1, device_pages=24, staging=None, stage=True, **kw):
    page = geom.page_bytes
    cfg = DiskConfig(path=tmp_path / "disk", capacity_bytes=32 * page, chunk_bytes=2 * page)
    store = RangeStore(cfg, geom.page_shape, geom.dtype, fingerprint=geom.fingerprint())
    kv = PagedKVCache(geom, device_pages=device_pages, host_pages=host_pages, disk_store=store,
                      staging=staging, stage_disk_io=stage, verify=True, **kw)
    return kv, store


def test_a_large_request_moves_through_the_ring_piece_by_piece(geom, tmp_path, closing):
    kv, store = make(geom, tmp_path, staging=StagingConfig(buffers=2, pages=2))
    closing(kv)
    gen = torch.Generator().manual_seed(50)
    data = fill(kv, "a", gen, 27)  # 7 pages; the host holds 1: straight to disk
    assert kv.offload("a")
    assert [(d.move, d.ok) for d in kv.synchronize(10)] == [(Move.OFFLOAD_TO_DISK, True)]
    kv.check_integrity()
    assert store.calls == [("write", 0, 2), ("write", 2, 2), ("write", 4, 2), ("write", 6, 1)]
    store.calls.clear()
    assert kv.reload("a")
    (done,) = kv.synchronize(10)
    assert done.ok and done.state is S.RESIDENT
    assert store.calls == [("read", 0, 2), ("read", 2, 2), ("read", 4, 2), ("read", 6, 1)]
    assert kv._ring.allocations == 2 and kv._ring.free_count() == 2  # reused, all back
    kv.check_integrity()
    assert_same(kv, "a", data)


def test_one_buffer_large_enough_is_one_piece(geom, tmp_path, closing):
    """The negative control: the same move with a ring buffer of 16 pages is one piece."""
    kv, store = make(geom, tmp_path, staging=StagingConfig(buffers=2, pages=16))
    closing(kv)
    data = fill(kv, "a", torch.Generator().manual_seed(51), 27)
    assert kv.offload("a")
    kv.synchronize(10)
    assert kv.reload("a")
    kv.synchronize(10)
    assert store.calls == [("write", 0, 7), ("read", 0, 7)]
    assert_same(kv, "a", data)
    kv.check_integrity()


def test_a_staging_timeout_fails_the_reload_and_keeps_the_request(geom, tmp_path, closing):
    kv, store = make(geom, tmp_path, staging=StagingConfig(buffers=1, pages=2, timeout_s=0.05))
    closing(kv)
    data = fill(kv, "a", torch.Generator().manual_seed(52), 9)
    assert kv.offload("a")
    kv.synchronize(10)
    held = kv._ring.acquire(1)  # the only buffer is taken
    assert held is not None
    assert kv.reload("a")
    (done,) = kv.synchronize(10)
    assert not done.ok and done.state is S.ON_DISK and "staging buffer" in done.reason
    assert kv.device_used_bytes() == 0
    kv._ring.release(held)
    kv.check_integrity()
    assert kv.reload("a")
    kv.synchronize(10)
    assert_same(kv, "a", data)
    kv.check_integrity()


def test_a_failed_piece_returns_every_buffer(geom, tmp_path, closing):
    calls = []
    faults = [True]  # the copy fault hook injects while this holds True

    def hook(kind):
        if not faults[0]:
            return
        calls.append(kind)
        if kind == "h2d" and calls.count("h2d") == 2:
            raise RuntimeError("injected copy fault")

    kv, store = make(geom, tmp_path, staging=StagingConfig(buffers=2, pages=2), copy_fault_hook=hook)
    closing(kv)
    data = fill(kv, "a", torch.Generator().manual_seed(53), 27)
    assert kv.offload("a")
    kv.synchronize(10)
    assert kv.reload("a")
    (done,) = kv.synchronize(10)
    assert not done.ok and done.state is S.ON_DISK and "injected" in done.reason
    assert kv._ring.free_count() == 2
    kv.check_integrity()
    faults[0] = False  # no more faults: the same reload now lands
    assert kv.reload("a")
    kv.synchronize(10)
    assert_same(kv, "a", data)


def test_cpu_disk_io_goes_straight_between_tier_and_disk(geom, tmp_path, closing):
    """Without staging, each run of pages is read into / written from where it lies."""
    kv, store = make(geom, tmp_path, host_pages=8, stage=False)
    closing(kv)
    gen = torch.Generator().manual_seed(54)
    fill(kv, "x", gen, 4)  # slot 0
    a = fill(kv, "a", gen, 8)  # slots 1, 2
    fill(kv, "y", gen, 4)  # slot 3
    assert kv.allocate("a", 12)  # slot 4: a is [1, 2, 4]
    extra = torch.randn(4, geom.num_kv_heads, geom.head_dim, generator=gen).to(geom.dtype)
    for layer in range(geom.num_layers):
        kv.write("a", layer, 8, extra, extra)
    a = [(torch.cat([k, extra]), torch.cat([v, extra])) for k, v in a]
    assert kv.page_table("a") == [1, 2, 4]
    kv.offload("a")
    kv.synchronize(10)
    assert kv.demote("a")  # host slots are [0, 1, 2]: one run
    kv.synchronize(10)
    assert store.calls == [("write", 0, 3)]
    kv.remove_request("x")
    kv.remove_request("y")
    fill(kv, "z", gen, 4)  # slot 0; the free slots are 1, 2, 3, ...
    fill(kv, "w", gen, 4)  # slot 1
    kv.remove_request("z")  # free: 0, 2, 3, ...
    assert kv.reload("a")
    kv.synchronize(10)
    assert kv.page_table("a") == [0, 2, 3]
    assert store.calls[1:] == [("read", 0, 1), ("read", 1, 2)]
    assert kv._ring is None
    assert_same(kv, "a", a)
    kv.check_integrity()


def test_ring_acquire_times_out_and_refuses_foreign_buffers(geom):
    ring = StagingRing(StagingConfig(buffers=1, pages=2), geom.page_shape, geom.dtype)
    b = ring.acquire(1)
    assert b is not None and tuple(b.shape[:1]) == (2,)
    assert ring.acquire(0.02) is None  # a shortage: None, after the timeout
    with pytest.raises(ValueError, match="not a buffer"):
        ring.release(torch.empty(2))
    ring.release(b)
    ring.check_integrity()
    for bad in ({"buffers": 0}, {"pages": True}, {"timeout_s": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            StagingConfig(**bad)


def test_the_real_store_moves_a_large_request_in_pieces(geom, tmp_path, closing):
    page = geom.page_bytes
    cfg = DiskConfig(path=tmp_path / "disk", capacity_bytes=32 * page, chunk_bytes=2 * page)
    kv = PagedKVCache(geom, device_pages=24, host_pages=1, disk=cfg, verify=True,
                      staging=StagingConfig(buffers=2, pages=2), stage_disk_io=True)
    closing(kv)
    assert kv._ring is not None
    calls = []  # (op, first_page, pages) of every range the real store was asked for
    store_read, store_write = kv.disk.read, kv.disk.write

    def read(extent, out, *, first_page=0):
        calls.append(("read", first_page, out.shape[0]))
        return store_read(extent, out, first_page=first_page)

    def write(extent, pages, *, first_page=0):
        calls.append(("write", first_page, pages.shape[0]))
        return store_write(extent, pages, first_page=first_page)

    kv.disk.read, kv.disk.write = read, write
    data = fill(kv, "a", torch.Generator().manual_seed(55), 27)
    pages = -(-27 // geom.page_tokens)
    assert kv.offload("a")
    assert [d.ok for d in kv.synchronize(10)] == [True]
    kv.check_integrity()
    # one write per ring buffer's worth (2 pages), covering every page once, in order
    want = [(p, min(2, pages - p)) for p in range(0, pages, 2)]
    assert [c[1:] for c in calls if c[0] == "write"] == want
    assert kv.reload("a")
    assert [d.ok for d in kv.synchronize(10)] == [True]
    assert [c[1:] for c in calls if c[0] == "read"] == want
    assert kv._ring.allocations == 2  # the two buffers of the ring, never a request-sized one
    assert_same(kv, "a", data)
    kv.check_integrity()


def test_ring_refuses_a_second_release_so_two_jobs_never_share_a_buffer(geom):
    ring = StagingRing(StagingConfig(buffers=2, pages=2), geom.page_shape, geom.dtype)
    a = ring.acquire(1)
    ring.release(a)
    with pytest.raises(ValueError, match="not held"):
        ring.release(a)  # before: the free queue held it twice
    x, y = ring.acquire(1), ring.acquire(1)
    assert x is not None and y is not None and x is not y, "one buffer handed out twice"
    assert ring.acquire(0.02) is None
    with pytest.raises(AssertionError, match="still held"):
        ring.check_integrity()
    ring.release(x)
    ring.release(y)
    ring.check_integrity()
    for bad in (float("nan"), float("inf"), -1):
        with pytest.raises(ValueError, match="StagingRing.acquire: timeout"):
            ring.acquire(bad)
    ring.check_integrity()


class RingMachine(RuleBasedStateMachine):
    """Random acquires (with zero timeouts: a shortage is None at once), releases, second
    releases and foreign buffers; the model is the set of buffers handed out."""

    @initialize(buffers=st.integers(1, 4), pages=st.integers(1, 3))
    def setup(self, buffers, pages):
        self.n = buffers
        self.ring = StagingRing(StagingConfig(buffers=buffers, pages=pages), (2, 3), torch.float32)
        self.held: list[torch.Tensor] = []
        self.released: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(buffers * 10 + pages)

    @rule()
    def acquire(self):
        buf = self.ring.acquire(0)
        if len(self.held) == self.n:
            assert buf is None, "a buffer was handed out while all were held"
            return
        assert buf is not None, "a free buffer was not handed out"
        assert all(buf is not h for h in self.held), "one buffer handed out twice"
        buf.copy_(torch.randn(buf.shape, generator=self.gen))  # a job writes into it
        self.held.append(buf)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        buf = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.ring.release(buf)
        self.released.append(buf)

    @precondition(lambda self: any(all(r is not h for h in self.held) for r in self.released))
    @rule(data=st.data())
    def release_twice(self, data):
        free = [r for r in self.released if all(r is not h for h in self.held)]
        buf = data.draw(st.sampled_from(free))
        before = self.ring.free_count()
        with pytest.raises(ValueError, match="not held"):
            self.ring.release(buf)
        assert self.ring.free_count() == before  # the refusal changed nothing

    @rule()
    def release_foreign(self):
        before = self.ring.free_count()
        with pytest.raises(ValueError, match="not a buffer of this ring"):
            self.ring.release(torch.randn((1, 2, 3), generator=self.gen))
        assert self.ring.free_count() == before

    @invariant()
    def counts(self):
        assert self.ring.free_count() == self.n - len(self.held)
        assert self.ring.allocations == self.n  # the ring never allocates more
        if self.held:
            with pytest.raises(AssertionError, match="still held"):
                self.ring.check_integrity()
        else:
            self.ring.check_integrity()


RingMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
TestRingMachine = RingMachine.TestCase
