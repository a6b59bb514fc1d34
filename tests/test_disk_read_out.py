"""A failed ``DiskPageStore.read`` leaves the caller's ``out`` exactly as it was.

Every way a read can fail (a flipped byte on the slot file's direct path, a binding of
another slot, a corrupt chunk or an I/O error through zarr's pipeline, a damaged binding
record on another store, a read that times out and whose stray I/O ends later) is
attacked with ``out`` filled with random bytes first; after the refusal those bytes are
still there, bit for bit. A good read of the same extent afterwards fills ``out`` (the
control: the range was readable, so the bytes really were withheld)."""

from __future__ import annotations

import errno
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import disk_lock_held
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from seaweed_fixture import _seaweed_shared, seaweed  # noqa: F401  (fixtures)
from zarr.storage import MemoryStore

from tiering.disk import DiskConfig, DiskCorruptionError, DiskIOError, DiskPageStore
from tiering.disk.faults import FaultPlan, FaultyStore

PAGE_SHAPE = (2, 4, 8)  # 64 float32 elements: 256 bytes a page
PAGE_BYTES = int(np.prod(PAGE_SHAPE)) * 4
N = 5  # pages of the extent under attack


def make(tmp_path: Path, mode: str, plan: FaultPlan | None = None, **kw) -> DiskPageStore:
    codec = "zstd" if mode == "zstd" else "none"
    if mode == "memory":
        cfg = DiskConfig(store=MemoryStore(), capacity_bytes=16 * PAGE_BYTES,
                         chunk_bytes=2 * PAGE_BYTES, **kw)
    else:
        cfg = DiskConfig(path=tmp_path / "d", capacity_bytes=16 * PAGE_BYTES,
                         chunk_bytes=2 * PAGE_BYTES, codec=codec, **kw)
    wrap = (lambda s: FaultyStore(s, plan)) if plan is not None else None
    store = DiskPageStore(cfg, PAGE_SHAPE, torch.float32, fingerprint="out", wrap_store=wrap)
    assert store.direct_io is (mode == "direct" and plan is None)
    return store


def random_pages(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((n, *PAGE_SHAPE)).astype(np.float32))


def filled_out(rng: np.random.Generator, n: int) -> tuple[torch.Tensor, bytes]:
    out = torch.from_numpy(rng.integers(0, 256, n * PAGE_BYTES, dtype=np.uint8)).view(
        torch.float32).reshape(n, *PAGE_SHAPE)
    return out, out.numpy().tobytes()


def refused_and_untouched(store: DiskPageStore, extent, rng, exc_type, first_page=0, n=N):
    out, before = filled_out(rng, n)
    stats = store.stats()
    with pytest.raises(exc_type) as info:
        store.read(extent, out, first_page=first_page)
    assert out.numpy().tobytes() == before, "a failed read changed the caller's out"
    assert store.stats()["read_faults"] == stats["read_faults"] + 1
    store.check_integrity()
    return info.value


def _payload_at(store: DiskPageStore, chunk: int) -> int:
    offset = store.chunk_offset(chunk)
    assert offset is not None
    return offset


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("bad", [0, 2, N - 1])  # the first, a middle and the last page
def test_a_flipped_byte_on_the_direct_path_leaves_out_untouched(tmp_path, bad):
    rng = np.random.default_rng(100 + bad)
    store = make(tmp_path, "direct")
    extent = store.reserve("a", N)
    data = random_pages(rng, N)
    store.write(extent, data)
    slot_file = store._backend.slots.slot_path
    _flip(slot_file, _payload_at(store, extent.chunks[bad]) + 17)
    refused_and_untouched(store, extent, rng, DiskCorruptionError)
    # a range that holds the bad page is refused too; one that does not is served
    refused_and_untouched(store, extent, rng, DiskCorruptionError, first_page=bad, n=1)
    good = [p for p in range(N) if p != bad][0]
    out = torch.empty((1, *PAGE_SHAPE))
    store.read(extent, out, first_page=good)
    assert torch.equal(out[0], data[good])
    _flip(slot_file, _payload_at(store, extent.chunks[bad]) + 17)  # put the byte back
    out = torch.empty_like(data)
    store.read(extent, out)  # the control: the extent reads back, so the refusal was the flip
    assert torch.equal(out, data)
    store.close()


def test_a_chunk_bound_to_another_slot_leaves_out_untouched(tmp_path):
    rng = np.random.default_rng(7)
    store = make(tmp_path, "direct")
    a, b = store.reserve("a", N), store.reserve("b", N)
    store.write(a, random_pages(rng, N))
    store.write(b, random_pages(rng, N))
    slots = store._backend.slots
    with open(slots.slot_path, "r+b") as f:  # b's last slot, whole, lands on a's last slot
        f.seek(4096 + b.chunks[-1] * slots.stride)
        raw = f.read(slots.stride)
        f.seek(4096 + a.chunks[-1] * slots.stride)
        f.write(raw)
    err = refused_and_untouched(store, a, rng, DiskCorruptionError)
    assert "bound to" in str(err)
    store.close()


@pytest.mark.parametrize("mode", ["direct", "zstd", "memory"])
@pytest.mark.parametrize("kind, exc_type", [("corrupt", DiskCorruptionError),
                                            ("eio_read", DiskIOError)])
def test_an_injected_read_fault_leaves_out_untouched(tmp_path, mode, kind, exc_type):
    rng = np.random.default_rng(3)
    plan = FaultPlan(seed=5)
    store = make(tmp_path, mode, plan)
    extent = store.reserve("a", N)
    data = random_pages(rng, N)
    store.write(extent, data)
    plan.arm(kind, next_n=1)
    refused_and_untouched(store, extent, rng, exc_type)
    assert plan.injected[kind] == 1
    out = torch.empty_like(data)
    store.read(extent, out)  # the control: the fault was one-shot and the data stayed
    assert torch.equal(out, data)
    store.close()


def test_a_damaged_binding_record_leaves_out_untouched(tmp_path):
    rng = np.random.default_rng(9)
    memory: dict = {}
    cfg = DiskConfig(store=MemoryStore(store_dict=memory), capacity_bytes=16 * PAGE_BYTES,
                     chunk_bytes=2 * PAGE_BYTES)
    store = DiskPageStore(cfg, PAGE_SHAPE, torch.float32, fingerprint="out")
    extent = store.reserve("a", N)
    data = random_pages(rng, N)
    store.write(extent, data)
    key = f"tiering-bind/{extent.chunks[-1]}"
    record = memory[key]
    raw = bytearray(record.to_bytes())
    raw[3] ^= 0xFF
    memory[key] = type(record).from_bytes(bytes(raw))
    refused_and_untouched(store, extent, rng, DiskCorruptionError)
    memory[key] = record
    out = torch.empty_like(data)
    store.read(extent, out)
    assert torch.equal(out, data)
    store.close()


def test_a_timed_out_read_never_writes_into_out_later(tmp_path):
    rng = np.random.default_rng(21)
    gate = threading.Event()
    plan = FaultPlan(seed=6, sleep=lambda _s: gate.wait(30), slow_seconds=1.0)
    store = make(tmp_path, "direct", plan, io_timeout_s=0.2)
    extent = store.reserve("a", N)
    data = random_pages(rng, N)
    store.write(extent, data)
    plan.arm("slow", next_n=1)
    out, before = filled_out(rng, N)
    with pytest.raises(DiskIOError) as info:
        store.read(extent, out)
    assert info.value.errno == errno.ETIMEDOUT
    gate.set()  # the stray read now completes, after the caller was told it failed
    assert store.wait_idle(30)
    assert out.numpy().tobytes() == before, "a timed-out read's stray I/O wrote into out"
    store.check_integrity()
    store.read(extent, out)
    assert torch.equal(out, data)
    store.close()


def test_a_good_read_reuses_its_scratch_buffer(tmp_path):
    """The good path copies through one reused scratch buffer (no allocation per read);
    a read larger than the kept buffer gets a new one."""
    rng = np.random.default_rng(31)
    store = make(tmp_path, "direct")
    extent = store.reserve("a", N)
    data = random_pages(rng, N)
    store.write(extent, data)
    out = torch.empty_like(data)
    store.read(extent, out)
    kept = store._read_scratch.kept()
    assert len(kept) == 1 and kept[0] >= N * PAGE_BYTES
    for first in range(N):
        part = torch.empty((N - first, *PAGE_SHAPE))
        store.read(extent, part, first_page=first)
        assert torch.equal(part, data[first:])
    assert store._read_scratch.kept() == kept  # the same buffer served every read
    store.release(store.reserve("b", 1))
    with pytest.raises(ValueError, match="not been written"):  # refused before any I/O
        store.read(store.reserve("c", 2), torch.empty((2, *PAGE_SHAPE)))
    assert store._read_scratch.kept() == kept  # a refused read does not lose the buffer
    store.close()
    assert store._read_scratch.kept() == []  # close lets it go


def test_a_damaged_object_on_s3_leaves_out_untouched(seaweed):  # noqa: F811
    """The same promise on an ``s3://`` prefix (a real SeaweedFS server): a chunk object
    flipped on the server is refused and ``out`` keeps its bytes; put back, it is served."""
    import obstore

    rng = np.random.default_rng(41)
    url = seaweed.url() + "/read-out"
    prefix = url.split(f"s3://{seaweed.bucket}/", 1)[1]
    cfg = DiskConfig(path=url, capacity_bytes=16 * PAGE_BYTES, chunk_bytes=2 * PAGE_BYTES,
                     storage_options=seaweed.options(timeout_s=5.0, max_retries=1))
    store = DiskPageStore(cfg, PAGE_SHAPE, torch.float32, fingerprint="out")
    try:
        extent = store.reserve("a", N)
        data = random_pages(rng, N)
        store.write(extent, data)
        objects = seaweed.store(prefix, check=False)
        key = f"c/{extent.chunks[-1]}/0"  # the last page: the others are read first
        good = bytes(obstore.get(objects, key).bytes())
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x40
        obstore.put(objects, key, bytes(bad))
        refused_and_untouched(store, extent, rng, DiskCorruptionError)
        obstore.put(objects, key, good)
        out = torch.empty_like(data)
        store.read(extent, out)
        assert torch.equal(out, data)
    finally:
        store.close()


class ReadOutMachine(RuleBasedStateMachine):
    """Random reserves, writes, reads and releases with write and read faults injected;
    a model of each extent's bytes. A good read returns exactly the model's bytes; a
    failed one leaves ``out`` as it was; the cap is never exceeded nor drifts."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="disk-read-out-sm-"))
        self.plan = FaultPlan(seed=11)
        self.store = make(self.dir, "direct", self.plan)
        self.rng = np.random.default_rng(17)
        self.live: dict[str, tuple[object, torch.Tensor | None]] = {}  # owner -> extent, bytes
        self.failed_reads = 0

    @rule(owner=st.sampled_from("abcdef"), n=st.integers(1, 5))
    def reserve(self, owner, n):
        if owner in self.live:
            return
        ext = self.store.reserve(owner, n)
        if ext is not None:
            self.live[owner] = (ext, None)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), fault=st.sampled_from([None, "enospc_write", "eio_write"]))
    def write(self, pick, fault):
        owner = sorted(self.live)[pick % len(self.live)]
        ext, _ = self.live[owner]
        data = random_pages(self.rng, ext.num_pages)
        if fault is None:
            self.store.write(ext, data)
            self.live[owner] = (ext, data)
            return
        self.plan.arm(fault, next_n=1)
        with pytest.raises(DiskIOError):
            self.store.write(ext, data)
        self.plan.disarm(fault)
        self.live[owner] = (ext, None)  # a failed write leaves its range unwritten

    @precondition(lambda self: any(d is not None for _, d in self.live.values()))
    @rule(pick=st.integers(0, 99), fault=st.sampled_from([None, "eio_read", "corrupt"]),
          first=st.integers(0, 4))
    def read(self, pick, fault, first):
        written = sorted(o for o, (_, d) in self.live.items() if d is not None)
        ext, data = self.live[written[pick % len(written)]]
        first = first % ext.num_pages
        out, before = filled_out(self.rng, ext.num_pages - first)
        if fault is None:
            self.store.read(ext, out, first_page=first)
            assert torch.equal(out, data[first:])
            return
        self.plan.arm(fault, next_n=1)
        with pytest.raises(DiskIOError):
            self.store.read(ext, out, first_page=first)
        self.plan.disarm(fault)
        assert out.numpy().tobytes() == before
        self.failed_reads += 1

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def release(self, pick):
        owner = sorted(self.live)[pick % len(self.live)]
        self.store.release(self.live.pop(owner)[0])

    @invariant()
    def consistent(self):
        self.store.check_integrity()
        pages = sum(ext.num_pages for ext, _ in self.live.values())
        assert self.store.used_bytes() == pages * PAGE_BYTES <= self.store.capacity_bytes
        assert self.store.stats()["read_faults"] == self.failed_reads

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestReadOutMachine = ReadOutMachine.TestCase
TestReadOutMachine.settings = settings(
    max_examples=20, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_a_close_that_gave_up_on_stray_io_can_be_finished_later(tmp_path, caplog):
    """``close`` with a timed-out operation still running keeps the file and the lock (as
    documented); once that I/O has ended, a second ``close`` lets them go (it returned at
    once and the path stayed locked for the life of the process)."""
    rng = np.random.default_rng(51)
    gate = threading.Event()
    plan = FaultPlan(seed=8, sleep=lambda _s: gate.wait(30), slow_seconds=1.0)
    store = make(tmp_path, "direct", plan, io_timeout_s=0.2)
    extent = store.reserve("a", 2)
    store.write(extent, random_pages(rng, 2))
    plan.arm("slow", next_n=1)
    with pytest.raises(DiskIOError):
        store.read(extent, torch.empty((2, *PAGE_SHAPE)))
    with caplog.at_level("WARNING", logger="tiering.disk.store"):
        store.close()  # gives up after io_timeout_s: the stray read still runs
    assert "still in flight" in caplog.text
    assert disk_lock_held(tmp_path / "d")
    gate.set()
    assert store.wait_idle(30)
    store.close()  # now the file and the lock go
    assert not disk_lock_held(tmp_path / "d")
    store.close()  # and a third close is a no-op
    again = make(tmp_path, "direct")  # the path is free for a new store
    again.close()
