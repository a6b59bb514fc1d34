"""``DiskPageStore.read(..., out_is_scratch=True)``: no staging copy on the direct path.

Each piece lands in a small bounce buffer of the store's, is checked there and copied
into ``out`` through a gate. What is promised: a good read returns exactly the written
bytes; a failed one raises (never a wrong byte handed back), changes nothing on bad
input, and, once it has returned, nothing writes into ``out`` any more, even I/O that is
still running after a timeout (it ends in the bounce buffer, which no other read is
given until that I/O has returned). Off the direct path the flag changes nothing: the
read is staged and a failure leaves ``out`` as it was."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tiering.disk import DiskConfig, DiskCorruptionError, DiskIOError, DiskPageStore
from tiering.disk.faults import FaultPlan, FaultyStore
from tiering.disk.slotfile import BOUNCE_BYTES, PIECE_BYTES, ChunkChecksumError, SlotFileStore
from tiering.disk.slotio import CopyGate, CopyLane

SMALL = (2, 4, 8)  # 256 bytes a page
BIG = (PIECE_BYTES // 4 + 12_345,)  # float32: a page of several pieces, the last partial


def make(tmp_path: Path, shape, pages: int, **kw) -> DiskPageStore:
    page_bytes = int(np.prod(shape)) * 4
    cfg = DiskConfig(path=tmp_path / "d", capacity_bytes=pages * page_bytes,
                     chunk_bytes=2 * page_bytes, **kw)
    store = DiskPageStore(cfg, shape, torch.float32, fingerprint="scratch")
    assert store.direct_io
    return store


def random_pages(rng: np.random.Generator, n: int, shape) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((n, *shape)).astype(np.float32))


def noise_like(rng: np.random.Generator, t: torch.Tensor) -> torch.Tensor:
    raw = rng.integers(0, 256, t.numel() * 4, dtype=np.uint8)
    return torch.from_numpy(raw).view(torch.float32).reshape(t.shape)


@pytest.mark.parametrize("shape", [SMALL, BIG], ids=["small-pages", "multi-piece-pages"])
def test_a_scratch_read_returns_the_written_bytes_without_the_staging_copy(tmp_path, shape):
    rng = np.random.default_rng(1)
    n = 5
    store = make(tmp_path, shape, 8)
    extent = store.reserve("a", n)
    data = random_pages(rng, n, shape)
    store.write(extent, data)
    for first in range(n):
        out = noise_like(rng, data[first:])
        store.read(extent, out, first_page=first, out_is_scratch=True)
        assert torch.equal(out, data[first:])
    # the reads above went through the bounce buffers, never through the range scratch
    assert store._read_scratch.kept() == []
    assert store._bounces.kept() and all(b == BOUNCE_BYTES for b in store._bounces.kept())
    out = noise_like(rng, data)
    store.read(extent, out)  # the control: a default read is staged
    assert torch.equal(out, data)
    assert store._read_scratch.kept() != []
    store.close()
    assert store._bounces.kept() == []


def test_a_flipped_byte_fails_a_scratch_read(tmp_path):
    """The last piece of the page is damaged, so earlier pieces were already copied:
    the read still raises and is counted; the control read after the repair succeeds."""
    rng = np.random.default_rng(2)
    store = make(tmp_path, BIG, 4)
    extent = store.reserve("a", 3)
    data = random_pages(rng, 3, BIG)
    store.write(extent, data)
    path = store._backend.slots.slot_path
    at = store.chunk_offset(extent.chunks[1]) + PIECE_BYTES + 99
    with open(path, "r+b") as f:
        f.seek(at)
        good = f.read(1)
        f.seek(at)
        f.write(bytes([good[0] ^ 0x21]))
    faults = store.stats()["read_faults"]
    with pytest.raises(DiskCorruptionError):
        store.read(extent, noise_like(rng, data), out_is_scratch=True)
    assert store.stats()["read_faults"] == faults + 1
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(good)
    out = noise_like(rng, data)
    store.read(extent, out, out_is_scratch=True)
    assert torch.equal(out, data)
    store.close()


def test_bad_input_to_a_scratch_read_changes_nothing(tmp_path):
    rng = np.random.default_rng(3)
    store = make(tmp_path, SMALL, 8)
    extent = store.reserve("a", 3)
    store.write(extent, random_pages(rng, 3, SMALL))
    unwritten = store.reserve("b", 2)
    for flag in (1, "yes", None):
        out = noise_like(rng, torch.empty((3, *SMALL)))
        before = out.clone()
        with pytest.raises(ValueError, match="out_is_scratch must be a bool"):
            store.read(extent, out, out_is_scratch=flag)
        assert torch.equal(out.view(torch.int32), before.view(torch.int32))
    out = noise_like(rng, torch.empty((2, *SMALL)))
    before = out.clone()
    with pytest.raises(ValueError, match="not been written"):
        store.read(unwritten, out, out_is_scratch=True)
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))
    store.check_integrity()
    store.close()


class _StallOnePread:
    """``os.preadv`` as on a cold device that hangs: a call that may not wait
    (``RWF_NOWAIT``) finds nothing cached, and blocking data read number ``which``
    hangs until released, then does its read. Only reads into a buffer of more than
    1 KiB count, so which call stalls does not hang on how the reader threads'
    header reads (56 bytes) interleave with their data reads."""

    def __init__(self, which: int) -> None:
        self.real = os.preadv
        self.which = which
        self.calls = 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.stalled_at: int | None = None  # the address of the buffer it will fill
        self.done = threading.Event()

    def __call__(self, fd, buffers, offset, flags=0):
        if flags & os.RWF_NOWAIT:
            raise BlockingIOError(errno.EAGAIN, "not cached")
        biggest = max(buffers, key=lambda b: memoryview(b).nbytes)
        data = memoryview(biggest).nbytes > 1024
        with self.lock:
            self.calls += data
            stall = data and self.calls == self.which
        if stall:
            self.stalled_at = np.frombuffer(biggest, dtype=np.uint8).ctypes.data
            self.release.wait(30)
            try:
                return self.real(fd, buffers, offset)
            finally:
                self.done.set()
        return self.real(fd, buffers, offset)


@pytest.mark.parametrize("gate_works", [True, False], ids=["store", "negative-control"])
def test_stray_io_after_a_timeout_never_writes_into_out(tmp_path, monkeypatch, gate_works):
    """A ``preadv`` stuck past ``io_timeout_s`` completes after the read has returned.
    Its bytes end in the bounce buffer; ``out`` keeps what it held when the read
    returned, and the stuck bounce is not handed to the next read until that I/O
    returned. The negative control disables the gate's shut: the stray copy then lands
    in ``out``, so the check can see it."""
    rng = np.random.default_rng(4)
    store = make(tmp_path, BIG, 8, io_timeout_s=1.0, io_threads=2)
    extent = store.reserve("a", 3)
    data = random_pages(rng, 3, BIG)
    store.write(extent, data)
    other = store.reserve("b", 2)
    other_data = random_pages(rng, 2, BIG)
    store.write(other, other_data)
    if not gate_works:
        monkeypatch.setattr(CopyGate, "shut", lambda self, timeout: True)
    taken: list[int] = []
    real_take = store._bounces.take

    def take(nbytes):
        buf = real_take(nbytes)
        taken.append(buf.ctypes.data)
        return buf

    monkeypatch.setattr(store._bounces, "take", take)
    stall = _StallOnePread(which=2)  # a data piece, past the first one copied
    monkeypatch.setattr(os, "preadv", stall)
    out = noise_like(rng, data)
    with pytest.raises(DiskIOError) as info:
        store.read(extent, out, out_is_scratch=True)
    assert info.value.errno == errno.ETIMEDOUT
    returned = out.clone()
    assert stall.stalled_at in taken  # the stuck preadv fills a bounce buffer, not out
    # while the stray I/O is stuck, another read runs; it never gets the stuck bounce
    taken.clear()
    got = noise_like(rng, other_data)
    store.read(other, got, out_is_scratch=True)
    assert torch.equal(got, other_data)
    assert stall.stalled_at not in taken
    stall.release.set()
    assert stall.done.wait(30) and store.wait_idle(30)
    if gate_works:
        assert torch.equal(out.view(torch.int32), returned.view(torch.int32)), (
            "a timed-out read's stray I/O wrote into out after the read returned")
    else:
        assert not torch.equal(out.view(torch.int32), returned.view(torch.int32))
    monkeypatch.setattr(os, "preadv", stall.real)
    store.check_integrity()
    fresh = noise_like(rng, data)
    store.read(extent, fresh, out_is_scratch=True)  # the extent reads back afterwards
    assert torch.equal(fresh, data)
    store.close()


def test_off_the_direct_path_a_scratch_read_is_staged(tmp_path):
    """With a wrapped store (fault injection), the flag changes nothing: a corrupt chunk
    is refused and ``out`` keeps every byte it held."""
    rng = np.random.default_rng(5)
    plan = FaultPlan(seed=5)
    cfg = DiskConfig(path=tmp_path / "d", capacity_bytes=8 * 256, chunk_bytes=512)
    store = DiskPageStore(cfg, SMALL, torch.float32, wrap_store=lambda s: FaultyStore(s, plan))
    assert not store.direct_io
    extent = store.reserve("a", 4)
    data = random_pages(rng, 4, SMALL)
    store.write(extent, data)
    plan.arm("corrupt", next_n=1)
    out = noise_like(rng, data)
    before = out.clone()
    with pytest.raises(DiskCorruptionError):
        store.read(extent, out, out_is_scratch=True)
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))
    store.read(extent, out, out_is_scratch=True)
    assert torch.equal(out, data)
    store.close()


def test_a_shut_gate_refuses_to_copy(tmp_path):
    rng = np.random.default_rng(6)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    dest = rng.integers(0, 256, 4096, dtype=np.uint8)
    gate = CopyGate()
    lane = gate.lane()
    lane.copy(dest.ctypes.data, src.ctypes.data, 1000)
    assert np.array_equal(dest[:1000], src[:1000])
    assert gate.shut(1.0)
    before = dest.copy()
    path = tmp_path / "f"
    path.write_bytes(src.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        for late in (lane, gate.lane()):  # a lane made after the shut refuses too
            with pytest.raises(OSError) as info:
                late.copy(dest.ctypes.data, src.ctypes.data, 4096)
            assert info.value.errno == errno.ECANCELED
            with pytest.raises(OSError) as info:
                late.read_cached(fd, [dest], 0)
            assert info.value.errno == errno.ECANCELED
        assert np.array_equal(dest, before)
        fresh = CopyGate().lane()  # the control: an open lane reads the cached file
        assert fresh.read_cached(fd, [dest], 0) == 4096
        assert np.array_equal(dest, src)
    finally:
        os.close(fd)


def test_shutting_waits_for_a_copy_under_way_and_no_longer_than_its_budget():
    gate = CopyGate()
    lane = gate.lane()
    lane._lock.acquire()  # stands for a copy under way
    assert gate.shut(0.05) is False
    done = threading.Event()
    waiter = threading.Thread(target=lambda: done.set() if gate.shut(10) else None)
    waiter.start()
    assert not done.wait(0.1)  # still waiting for the copy
    lane._lock.release()
    waiter.join(10)
    assert done.is_set()


def test_read_chunk_checks_its_bounce_buffer(tmp_path):
    slots = SlotFileStore(tmp_path / "s", num_slots=2, slot_capacity=64 + 4)
    slots.open_sync()
    slots.write_chunk(0, np.arange(16, dtype=np.float32))
    out = np.empty(16, dtype=np.float32)
    with pytest.raises(ValueError, match="together"):
        slots.read_chunk(0, out, bounce=np.empty(BOUNCE_BYTES, np.uint8))
    with pytest.raises(ValueError, match="bounce must be"):
        slots.read_chunk(0, out, bounce=np.empty(4095, np.uint8), lane=CopyGate().lane())
    slots.read_chunk(0, out, bounce=np.empty(BOUNCE_BYTES, np.uint8), lane=CopyGate().lane())
    assert np.array_equal(out, np.arange(16, dtype=np.float32))
    gate = CopyGate()
    lane = gate.lane()
    gate.shut(0.0)
    shut_out = np.random.default_rng(10).standard_normal(16).astype(np.float32)
    before = shut_out.copy()
    with pytest.raises(OSError) as info:  # a shut gate: the chunk's bytes are dropped
        slots.read_chunk(0, shut_out, bounce=np.empty(BOUNCE_BYTES, np.uint8), lane=lane)
    assert info.value.errno == errno.ECANCELED
    assert np.array_equal(shut_out.view(np.uint32), before.view(np.uint32))
    with pytest.raises(ValueError, match="no pad"):
        slots.read_chunk(0, np.empty(15, np.float32), pad=4,
                         bounce=np.empty(BOUNCE_BYTES, np.uint8), lane=CopyGate().lane())
    with pytest.raises(ChunkChecksumError):
        slots.read_chunk(0, np.empty(15, np.float32), pad=0,
                         bounce=np.empty(BOUNCE_BYTES, np.uint8), lane=CopyGate().lane())
    slots.close()


@pytest.mark.parametrize("bounced", [False, True], ids=["in-place", "bounced"])
def test_a_short_preadv_is_finished_not_trusted(tmp_path, monkeypatch, bounced):
    """Every read's first ``preadv`` of a piece is a bare call; when the kernel moves
    fewer bytes than asked, the piece is read again in full (the data still checks)."""
    rng = np.random.default_rng(7)
    slots = SlotFileStore(tmp_path / "s", num_slots=2, slot_capacity=PIECE_BYTES * 2 + 4)
    slots.open_sync()
    data = rng.integers(0, 256, PIECE_BYTES + 5000, dtype=np.uint8)
    slots.write_chunk(1, data)
    real = os.preadv
    shorted = []

    def short_once(fd, buffers, offset, *flags):
        if not shorted:
            shorted.append(offset)
            first = memoryview(buffers[0]).cast("B")
            return real(fd, [first[: len(first) // 2]], offset, *flags)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", short_once)
    out = rng.integers(0, 256, data.nbytes, dtype=np.uint8)
    if bounced:
        slots.read_chunk(1, out, bounce=np.empty(BOUNCE_BYTES, np.uint8),
                         lane=CopyGate().lane())
    else:
        slots.read_chunk(1, out)
    assert shorted and np.array_equal(out, data)
    slots.close()


def test_scratch_reads_from_several_threads_each_get_their_own_bytes(tmp_path):
    """Bounce buffers and lanes are per job: concurrent reads of distinct extents never
    see each other's pieces."""
    rng = np.random.default_rng(8)
    store = make(tmp_path, BIG, 8, io_threads=2)
    extents = [store.reserve(f"r{i}", 2) for i in range(4)]
    datas = [random_pages(rng, 2, BIG) for _ in extents]
    for extent, data in zip(extents, datas, strict=True):
        store.write(extent, data)
    wrong: list[int] = []

    def reader(i: int) -> None:
        local = np.random.default_rng(100 + i)
        for _ in range(6):
            out = noise_like(local, datas[i])
            store.read(extents[i], out, out_is_scratch=True)
            if not torch.equal(out, datas[i]):
                wrong.append(i)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert store.stats()["reads"] == 4 * 6
    store.close()


class _PreadSpy:
    """Counts ``os.preadv`` calls by kind; ``cached`` decides what an ``RWF_NOWAIT``
    call finds: "all" (real call), "none" (EAGAIN), "half" (the first half of the
    first buffer) or "refused" (EOPNOTSUPP, a file that does not take the flag)."""

    def __init__(self, cached: str) -> None:
        self.real = os.preadv
        self.cached = cached
        self.nowait_bytes = 0
        self.nowait_calls = 0
        self.blocking_calls = 0

    def __call__(self, fd, buffers, offset, flags=0):
        if not flags & os.RWF_NOWAIT:
            self.blocking_calls += 1
            return self.real(fd, buffers, offset)
        self.nowait_calls += 1
        if self.cached == "none":
            raise BlockingIOError(errno.EAGAIN, "not cached")
        if self.cached == "refused":
            raise OSError(errno.EOPNOTSUPP, "RWF_NOWAIT not supported")
        if self.cached == "half":
            first = memoryview(buffers[0]).cast("B")
            buffers = [first[: len(first) // 2]]
        got = self.real(fd, buffers, offset, flags)
        self.nowait_bytes += got
        return got


@pytest.mark.parametrize("cached", ["all", "none", "half", "refused"])
def test_a_scratch_read_takes_what_the_page_cache_holds_straight_into_out(
    tmp_path, monkeypatch, cached
):
    """Warm pages come straight from the page cache into ``out`` (no bounce copy); what
    is not cached, or a file that refuses the flag, goes through the bounce buffer.
    The bytes are right either way."""
    rng = np.random.default_rng(9)
    store = make(tmp_path, BIG, 4)
    extent = store.reserve("a", 3)
    data = random_pages(rng, 3, BIG)
    store.write(extent, data)
    copies: list[int] = []
    real_copy = CopyLane.copy

    def counting_copy(self, dest, src, nbytes):
        copies.append(nbytes)
        return real_copy(self, dest, src, nbytes)

    monkeypatch.setattr(CopyLane, "copy", counting_copy)
    spy = _PreadSpy(cached)
    monkeypatch.setattr(os, "preadv", spy)
    out = noise_like(rng, data)
    store.read(extent, out, out_is_scratch=True)
    assert torch.equal(out, data)
    payload = data.numel() * 4
    if cached == "all":
        assert spy.nowait_bytes >= payload and copies == [] and spy.blocking_calls == 0
    elif cached == "none":
        assert spy.nowait_bytes == 0 and sum(copies) == payload
    elif cached == "half":
        assert 0 < sum(copies) < payload and spy.nowait_bytes > 0
    else:  # refused: asked at most once per thread, then never again on this file
        assert 1 <= spy.nowait_calls <= store.config.io_threads and sum(copies) == payload
        assert store._backend.direct._nowait is False
    store.close()
