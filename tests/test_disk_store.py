"""The disk tier's page store: round trips, the hard cap, faults, corruption, start-up.

Size: over 1100 lines on purpose: the store's whole contract (round trips, cap, faults,
corruption, start-up) against the one ``make`` helper and fault plans they share.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
import zarr
from conftest import disk_lock_held
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.storage import LocalStore, MemoryStore, StorePath

from tiering.disk import crc as disk_crc
from tiering.disk import slotfile as disk_slotfile
from tiering.disk.array import page_codecs
from tiering.disk.faults import FaultPlan, FaultyStore
from tiering.disk.ledger import pick_chunks
from tiering.disk.lock import LOCK_FILE_NAME
from tiering.disk.manifest import MANIFEST_KEY
from tiering.disk.slotfile import (
    SLOT_FILE_NAME,
    ChunkChecksumError,
    SlotFileStore,
    slot_chunk_key,
)
from tiering.disk.store import (
    DiskConfig,
    DiskCorruptionError,
    DiskExtent,
    DiskIntegrityError,
    DiskIOError,
    DiskPageStore,
)

PAGE_SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, tokens, heads, head dim: 256 elements
CHUNK = 4096  # 4 float32 pages or 8 bf16 pages per chunk


def make(
    tmp_path: Path, *, dtype=torch.float32, capacity_chunks=16, sub="disk", **kw
) -> DiskPageStore:
    page_bytes = int(np.prod(PAGE_SHAPE)) * dtype.itemsize
    ppc = max(1, kw.get("chunk_bytes", CHUNK) // page_bytes)
    wrap = kw.pop("wrap_store", None)
    fingerprint = kw.pop("fingerprint", "test-geometry")
    kw.setdefault("chunk_bytes", CHUNK)
    if "store" not in kw and "path" not in kw:
        kw["path"] = tmp_path / sub
    cfg = DiskConfig(capacity_bytes=capacity_chunks * ppc * page_bytes, **kw)
    return DiskPageStore(cfg, PAGE_SHAPE, dtype, fingerprint=fingerprint, wrap_store=wrap)


def pages(gen: torch.Generator, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn((n, *PAGE_SHAPE), generator=gen).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def round_trip(store: DiskPageStore, extent: DiskExtent, data: torch.Tensor) -> torch.Tensor:
    store.write(extent, data)
    out = torch.full_like(data, 7)
    store.read(extent, out)
    return out


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def store(tmp_path):
    s = make(tmp_path)
    yield s
    s.close()


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_round_trip_many_extents_bitwise(tmp_path, gen, dtype):
    s = make(tmp_path, dtype=dtype, capacity_chunks=24)
    written = {}
    for i, n in enumerate([1, 3, 4, 5, 9, 2, 7, 13]):
        data = (
            torch.randint(-128, 127, (n, *PAGE_SHAPE), generator=gen, dtype=torch.int8)
            if dtype == torch.int8
            else pages(gen, n, dtype)
        )
        extent = s.reserve(f"r{i}", n)
        assert extent is not None and extent.num_pages == n
        s.write(extent, data)
        written[extent] = data
        s.check_integrity()
    for extent, data in written.items():  # read everything after all writes
        out = torch.empty_like(data)
        s.read(extent, out)
        assert same_bits(out, data), f"extent {extent} changed"
    s.close()


def test_page_of_zeros_and_extent_of_zeros_read_back(store, gen):
    data = pages(gen, 6)
    data[2].zero_()  # one zero page among random ones
    extent = store.reserve("mixed", 6)
    assert same_bits(round_trip(store, extent, data), data)
    zeros = torch.zeros((4, *PAGE_SHAPE))  # a whole chunk of zeros
    extent2 = store.reserve("zeros", 4)
    out = round_trip(store, extent2, zeros)
    assert same_bits(out, zeros)


def test_numpy_pages_and_out(store):
    rng = np.random.default_rng(5)
    data = rng.standard_normal((5, *PAGE_SHAPE)).astype(np.float32)
    extent = store.reserve("np", 5)
    store.write(extent, data)
    out = np.full_like(data, 3.0)
    store.read(extent, out)
    assert np.array_equal(out, data)


def test_non_contiguous_pages_are_written_correctly(store, gen):
    base = pages(gen, 10)
    strided = base[::2]  # non-contiguous view of 5 pages
    extent = store.reserve("strided", 5)
    assert same_bits(round_trip(store, extent, strided), strided.contiguous())


def test_rewrite_replaces_contents(store, gen):
    extent = store.reserve("r", 5)
    first, second = pages(gen, 5), pages(gen, 5)
    round_trip(store, extent, first)
    assert same_bits(round_trip(store, extent, second), second)


def test_stored_array_is_plain_zarr_with_crc32c(tmp_path, gen):
    s = make(tmp_path, store=LocalStore(tmp_path / "plain"))
    data = pages(gen, 6)
    extent = s.reserve("r", 6)
    s.write(extent, data)
    arr = zarr.open_array(LocalStore(tmp_path / "plain"), mode="r")
    assert any(c.to_dict()["name"] == "crc32c" for c in arr.metadata.codecs)
    ppc = s.pages_per_chunk
    rows = [arr[c * ppc : (c + 1) * ppc] for c in extent.chunks]
    stored = np.concatenate(rows)[: extent.num_pages]
    assert np.array_equal(
        stored.view(np.uint8).reshape(-1), data.view(torch.uint8).numpy().reshape(-1)
    )
    s.close()


def test_concurrent_reads_and_writes_on_distinct_extents(tmp_path, gen):
    s = make(tmp_path, capacity_chunks=32)
    work = [(s.reserve(f"r{i}", 3 + i % 5), pages(gen, 3 + i % 5)) for i in range(12)]

    def job(item):
        extent, data = item
        s.write(extent, data)
        out = torch.empty_like(data)
        s.read(extent, out)
        return same_bits(out, data)

    with ThreadPoolExecutor(4) as pool:
        results = [f.result(timeout=60) for f in [pool.submit(job, w) for w in work]]
    assert all(results)
    s.check_integrity()
    assert s.stats()["writes"] == 12 and s.stats()["reads"] == 12
    s.close()


# ---------------------------------------------------------------------------- ledger and cap


def test_sizes_are_page_exact(tmp_path):
    s = make(tmp_path, capacity_chunks=5)
    assert s.page_bytes == 1024 and s.pages_per_chunk == 4  # the I/O batch
    assert s.capacity_pages == 20 and s.capacity_bytes == 5 * 4096
    assert s.bytes_for(1) == 1024 and s.bytes_for(4) == 4096 and s.bytes_for(5) == 5120
    s.close()


def test_reserve_refuses_beyond_cap_and_counts(store):
    big = store.reserve("big", store.capacity_pages)
    assert big is not None and store.used_bytes() == store.capacity_bytes
    assert not store.can_reserve(1)
    assert store.reserve("more", 1) is None
    assert store.reserve("huge", store.capacity_pages + 1) is None
    assert store.stats()["refusals"] == 2
    store.release(big)
    assert store.used_bytes() == 0 and store.can_reserve(store.capacity_pages)


def test_reserve_prefers_one_adjacent_run(store):
    a = store.reserve("a", 4)
    b = store.reserve("b", 8)
    store.reserve("c", 4)
    store.release(b)  # a hole of eight pages between a and c
    d = store.reserve("d", 5)
    assert d.chunks == tuple(range(a.chunks[-1] + 1, a.chunks[-1] + 6))
    store.check_integrity()


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 30), st.integers(0, 1000)), max_size=60)
)
def test_cap_never_exceeded_under_random_reserve_release(tmp_path_factory, ops):
    with make(tmp_path_factory.mktemp("cap"), capacity_chunks=12, store=MemoryStore()) as s:
        live: list[DiskExtent] = []
        refusals = 0
        for do_reserve, n, pick in ops:
            if do_reserve or not live:
                could = s.can_reserve(n)
                extent = s.reserve(f"o{len(live)}", n)
                assert (extent is not None) == could
                if extent is None:
                    refusals += 1
                else:
                    assert len(extent.chunks) == n  # one slot per page
                    live.append(extent)
            else:
                s.release(live.pop(pick % len(live)))
            s.check_integrity()
            expected = sum(len(e.chunks) for e in live) * s.chunk_alloc_bytes
            assert s.used_bytes() == expected <= s.capacity_bytes
            held = [c for e in live for c in e.chunks]
            assert len(held) == len(set(held))
        assert s.stats()["refusals"] == refusals


def test_check_integrity_reports_a_broken_ledger(store):
    extent = store.reserve("a", 3)
    ledger = store._ledger  # deliberately broken below, to prove the check can fail
    ledger._used += 1
    with pytest.raises(DiskIntegrityError, match="ledger counts"):
        store.check_integrity()
    ledger._used -= 1
    ledger._free[extent.chunks[0]] = True
    with pytest.raises(DiskIntegrityError, match="held yet marked free"):
        store.check_integrity()
    ledger._free[extent.chunks[0]] = False
    store.check_integrity()


def test_pick_chunks_prefers_the_tightest_run_then_the_longest_runs():
    free = np.array([1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1], dtype=bool)
    assert pick_chunks(free, 2) == (4, 5)  # the run of exactly two
    assert pick_chunks(free, 3) == (0, 1, 2)
    assert pick_chunks(free, 4) == (7, 8, 9, 10)
    assert pick_chunks(free, 6) == (0, 1, 7, 8, 9, 10)  # no run fits: longest runs first


# ---------------------------------------------------------------------------- bad input


def test_bad_input_raises_and_changes_nothing(store, gen):
    extent = store.reserve("a", 5)
    before = store.stats()
    with pytest.raises(ValueError, match="shape"):
        store.write(extent, torch.randn((5, 3, 2), generator=gen))
    with pytest.raises(ValueError, match="not inside the extent"):
        store.write(extent, pages(gen, 6))
    with pytest.raises(ValueError, match="not inside the extent"):
        store.write(extent, pages(gen, 4), first_page=4)
    with pytest.raises(ValueError, match="first_page"):
        store.write(extent, pages(gen, 1), first_page=-1)
    with pytest.raises(ValueError, match="stale"):
        store.write(extent._replace(generation=extent.generation + 1), pages(gen, 5))
    with pytest.raises(ValueError, match="dtype"):
        store.write(extent, pages(gen, 5, torch.bfloat16))
    with pytest.raises(ValueError, match="not been written"):
        store.read(extent, torch.empty((5, *PAGE_SHAPE)))
    with pytest.raises(ValueError, match="not completely written"):
        store.commit("a", extent, {})
    with pytest.raises(ValueError, match="num_pages"):
        store.reserve("b", 0)
    with pytest.raises(ValueError, match="owner"):
        store.reserve("", 1)
    with pytest.raises(ValueError, match="not reserved"):
        store.write(DiskExtent((9,), 1), pages(gen, 1))
    with pytest.raises(ValueError, match="reserved for 5 pages"):
        store.write(DiskExtent(extent.chunks, 4), pages(gen, 4))
    store.write(extent, pages(gen, 5))
    with pytest.raises(ValueError, match="contiguous"):
        store.read(extent, torch.empty((10, *PAGE_SHAPE))[::2])
    with pytest.raises(ValueError, match="reserved by 'a'"):
        store.commit("b", extent, {})
    with pytest.raises(ValueError, match="JSON"):
        store.commit("a", extent, {"x": object()})
    after = store.stats()
    assert after["writes"] == before["writes"] + 1 and after["used_bytes"] == before["used_bytes"]
    store.release(extent)
    with pytest.raises(ValueError, match="not reserved"):
        store.release(extent)
    store.check_integrity()


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("capacity_bytes", {"path": "x", "capacity_bytes": 0}),
        ("capacity_bytes", {"path": "x", "capacity_bytes": -5}),
        ("capacity_bytes", {"path": "x", "capacity_bytes": True}),
        ("codec", {"path": "x", "capacity_bytes": 10, "codec": "lz4"}),
        ("chunk_bytes", {"path": "x", "capacity_bytes": 10, "chunk_bytes": 0}),
        ("on_start", {"path": "x", "capacity_bytes": 10, "on_start": "keep"}),
        ("io_threads", {"path": "x", "capacity_bytes": 10, "io_threads": 0}),
        ("io_timeout_s", {"path": "x", "capacity_bytes": 10, "io_timeout_s": 0}),
        ("io_timeout_s", {"path": "x", "capacity_bytes": 10, "io_timeout_s": float("inf")}),
        ("io_timeout_s", {"path": "x", "capacity_bytes": 10, "io_timeout_s": float("nan")}),
        ("io_timeout_s", {"path": "x", "capacity_bytes": 10, "io_timeout_s": True}),
        ("lease_ttl_s", {"path": "x", "capacity_bytes": 10, "lease_ttl_s": float("nan")}),
        ("lease_ttl_s must be a finite", {"path": "x", "capacity_bytes": 10,
                                          "lease_ttl_s": float("inf")}),
        ("DiskConfig.path 's3:///p' is not a usable", {"path": "s3:///p", "capacity_bytes": 10}),
        ("DiskConfig.path 's3://b/x/../y' is not a usable", {"path": "s3://b/x/../y",
                                                            "capacity_bytes": 10}),
        ("io_threads", {"path": "x", "capacity_bytes": 10, "io_threads": 2.0}),
        ("chunk_bytes", {"path": "x", "capacity_bytes": 10, "chunk_bytes": True}),
        ("path", {"capacity_bytes": 10}),
        ("path", {"path": 42, "capacity_bytes": 10}),
        ("store", {"store": object(), "capacity_bytes": 10}),
    ],
)
def test_invalid_config_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        DiskConfig(**kwargs)


def test_capacity_below_one_chunk_is_refused(tmp_path):
    small = DiskConfig(path=tmp_path, capacity_bytes=1000, chunk_bytes=CHUNK)  # valid alone
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskPageStore(small, PAGE_SHAPE, torch.float32)
    big = DiskConfig(path=tmp_path, capacity_bytes=1 << 20)
    with pytest.raises(ValueError, match="page_shape"):
        DiskPageStore(big, (2, 0), torch.float32)


# ---------------------------------------------------------------------------- faults


def faulty(tmp_path, plan: FaultPlan, **kw) -> DiskPageStore:
    return make(tmp_path, wrap_store=lambda s: FaultyStore(s, plan), **kw)


@pytest.mark.parametrize("kind, code", [("enospc_write", errno.ENOSPC), ("eio_write", errno.EIO)])
def test_write_fault_raises_with_errno_and_leaves_ledger(tmp_path, gen, kind, code):
    plan = FaultPlan(seed=1)
    s = faulty(tmp_path, plan)
    extent = s.reserve("a", 6)  # two chunks: the second one fails
    used = s.used_bytes()
    plan.arm(kind, next_n=1)
    with pytest.raises(DiskIOError) as info:
        s.write(extent, pages(gen, 6))
    assert info.value.errno == code
    assert plan.injected[kind] == 1
    assert s.used_bytes() == used
    s.check_integrity()
    with pytest.raises(ValueError, match="not been written"):  # never served after a failed write
        s.read(extent, torch.empty((6, *PAGE_SHAPE)))
    data = pages(gen, 6)
    assert same_bits(round_trip(s, extent, data), data)  # the fault was one-shot
    stats = s.stats()
    assert stats["write_faults"] == 1 and stats["faults"] == 1
    s.release(extent)
    assert s.used_bytes() == 0
    s.close()


def test_read_fault_and_corruption_are_reported(tmp_path, gen):
    plan = FaultPlan(seed=2)
    s = faulty(tmp_path, plan)
    data = pages(gen, 7)
    extent = s.reserve("a", 7)
    s.write(extent, data)
    plan.arm("eio_read", next_n=1)
    with pytest.raises(DiskIOError) as info:
        s.read(extent, torch.empty_like(data))
    assert info.value.errno == errno.EIO and not isinstance(info.value, DiskCorruptionError)
    plan.arm("corrupt", next_n=1)
    with pytest.raises(DiskCorruptionError):
        s.read(extent, torch.empty_like(data))
    assert plan.injected["eio_read"] == 1 and plan.injected["corrupt"] == 1
    out = torch.empty_like(data)
    s.read(extent, out)  # the stored bytes were never harmed
    assert same_bits(out, data)
    stats = s.stats()
    assert stats["read_faults"] == 2 and stats["corruptions"] == 1
    s.close()


def test_slow_fault_uses_the_injected_sleep(tmp_path, gen):
    slept: list[float] = []
    plan = FaultPlan(seed=3, sleep=slept.append, slow_seconds=0.25)
    s = faulty(tmp_path, plan)
    data = pages(gen, 5)
    extent = s.reserve("a", 5)
    plan.arm("slow", next_n=3)
    assert same_bits(round_trip(s, extent, data), data)
    assert slept == [0.25, 0.25, 0.25] and plan.injected["slow"] == 3
    s.close()


def test_every_injected_fault_surfaces(tmp_path, gen):
    """Under random faults, an operation fails exactly when a failing fault struck it."""
    plan = FaultPlan(seed=11)
    for kind in ("enospc_write", "eio_write", "eio_read", "corrupt"):
        plan.arm(kind, probability=0.08)
    s = faulty(tmp_path, plan, capacity_chunks=20)
    rng = random.Random(7)
    live: dict[DiskExtent, torch.Tensor] = {}
    failing = ("enospc_write", "eio_write", "eio_read", "corrupt")
    surfaced = corrupt_reads = 0
    for step in range(120):
        before = sum(plan.injected[k] for k in failing)
        corrupt_before = plan.injected["corrupt"]
        if live and rng.random() < 0.5:
            extent = rng.choice(list(live))
            out = torch.empty_like(live[extent])
            try:
                s.read(extent, out)
                ok = True
            except DiskIOError as exc:
                ok = False
                if isinstance(exc, DiskCorruptionError):
                    corrupt_reads += 1
                    assert plan.injected["corrupt"] > corrupt_before, (
                        f"step {step}: a corruption reported with none injected")
            if ok:
                assert same_bits(out, live[extent]), f"step {step}: wrong bytes served"
        else:
            n = rng.randint(1, 9)
            extent = s.reserve(f"o{step}", n)
            if extent is None:
                s.release(live.popitem()[0])
                continue
            data = pages(gen, n)
            try:
                s.write(extent, data)
                ok = True
                live[extent] = data
            except DiskIOError:
                ok = False
                s.release(extent)
        struck = sum(plan.injected[k] for k in failing) - before
        assert ok == (struck == 0), f"step {step}: ok={ok} but {struck} faults struck"
        surfaced += 0 if ok else 1
        s.check_integrity()
    stats = s.stats()
    assert surfaced > 5 and stats["faults"] == surfaced
    # one corruption per read that failed as corrupt (a read may draw several corrupt chunks)
    assert 0 < corrupt_reads == stats["corruptions"] <= plan.injected["corrupt"]
    s.close()


def test_fault_plan_is_reproducible_and_validated():
    def sequence(seed):
        plan = FaultPlan(seed=seed)
        plan.arm("eio_write", probability=0.3)
        return [plan.draw("set")[0] for _ in range(50)]

    assert sequence(5) == sequence(5)
    assert sequence(5) != sequence(6)
    plan = FaultPlan()
    with pytest.raises(ValueError, match="unknown fault kind"):
        plan.arm("melt")
    with pytest.raises(ValueError, match="probability"):
        plan.arm("corrupt", probability=1.5)
    plan.arm("eio_read", next_n=2)
    assert [plan.draw("get")[0] for _ in range(3)] == ["eio_read", "eio_read", None]
    assert plan.draw("set") == (None, False)


@pytest.mark.parametrize("kwargs, field", [
    ({"next_n": True}, "next_n"), ({"next_n": 1.5}, "next_n"), ({"next_n": "2"}, "next_n"),
    ({"probability": True}, "probability"), ({"probability": float("nan")}, "probability"),
    ({"probability": "0.5"}, "probability"),
])
def test_fault_arm_refuses_bools_floats_and_strings_and_changes_nothing(kwargs, field):
    plan = FaultPlan(seed=1)
    plan.arm("eio_read", next_n=1)
    with pytest.raises(ValueError, match=field):
        plan.arm("eio_read", **kwargs)
    assert [plan.draw("get")[0] for _ in range(2)] == ["eio_read", None]  # the old rule held


@pytest.mark.parametrize("kwargs, field", [
    ({"slow_seconds": float("nan")}, "slow_seconds"), ({"slow_seconds": float("inf")}, "slow_seconds"),
    ({"slow_seconds": True}, "slow_seconds"), ({"slow_seconds": -1}, "slow_seconds"),
    ({"sleep": 5}, "sleep"),
])
def test_fault_plan_refuses_bad_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FaultPlan(seed=1, **kwargs)


def _timed_out_write(tmp_path, gen, seed):
    """A store whose write of 4 pages to extent "a" timed out while its I/O is held at
    ``gate``: (store, extent, gate)."""
    gate = threading.Event()
    plan = FaultPlan(seed=seed, sleep=lambda _s: gate.wait(30), slow_seconds=1.0)
    s = faulty(tmp_path, plan, io_timeout_s=0.2)
    extent = s.reserve("a", 4)
    plan.arm("slow", next_n=1)
    data = pages(gen, 4)
    with pytest.raises(DiskIOError) as info:
        s.write(extent, data)
    assert info.value.errno == errno.ETIMEDOUT
    return s, extent, gate


def test_timed_out_write_keeps_chunks_until_stray_io_ends(tmp_path, gen):
    s, extent, gate = _timed_out_write(tmp_path, gen, 4)
    s.release(extent)  # allowed, but its slots stay out of circulation
    assert s.used_bytes() == 4 * s.page_bytes and s.stats()["quarantined_chunks"] == 4
    s.check_integrity()
    gate.set()
    assert s.wait_idle(30)
    assert s.used_bytes() == 0 and s.stats()["quarantined_chunks"] == 0
    s.check_integrity()
    s.close()


def test_a_write_that_timed_out_is_never_served_once_it_lands(tmp_path, gen):
    """The caller was told the write failed (timed out); when its I/O ends later, every
    chunk did land, but the extent stays unwritten: a read is refused, never served."""
    s, extent, gate = _timed_out_write(tmp_path, gen, 5)
    gate.set()
    assert s.wait_idle(30)
    s.check_integrity()
    with pytest.raises(ValueError, match="not been written"):
        s.read(extent, torch.empty((4, *PAGE_SHAPE)))
    data = pages(gen, 4)
    assert same_bits(round_trip(s, extent, data), data)  # the control: a write that returns
    s.close()


def test_a_failed_rewrite_leaves_nothing_readable(tmp_path, gen):
    """A rewrite whose second chunk fails: the first chunk holds new bytes, the second old
    ones; the extent must read as unwritten, not as that mix."""
    plan = FaultPlan(seed=6)
    s = faulty(tmp_path, plan)
    extent = s.reserve("a", 6)  # two chunks
    old = pages(gen, 6)
    s.write(extent, old)
    plan.arm("eio_write", next_n=1)
    with pytest.raises(DiskIOError):
        s.write(extent, pages(gen, 6))
    assert plan.injected["eio_write"] == 1
    s.check_integrity()
    with pytest.raises(ValueError, match="not been written"):
        s.read(extent, torch.empty_like(old))
    s.close()


def test_rewriting_a_committed_extent_is_refused_until_uncommitted(tmp_path, gen):
    s = make(tmp_path, on_start="reattach")
    extent = s.reserve("a", 5)
    data = pages(gen, 5)
    s.write(extent, data)
    s.commit("a", extent, {"tokens": 17})
    with pytest.raises(ValueError, match="committed by 'a'; uncommit it before rewriting"):
        s.write(extent, pages(gen, 5))
    out = torch.full_like(data, 3.0)
    s.read(extent, out)
    assert same_bits(out, data)  # the refusal changed nothing
    s.uncommit(extent)
    new = pages(gen, 5)
    assert same_bits(round_trip(s, extent, new), new)
    s.check_integrity()
    s.close()


# ---------------------------------------------------------------------------- on-disk corruption


def _flip_first_occurrence(path: Path, needle: bytes) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.find(needle)
    assert at >= 0, f"data not found in {path}"
    raw[at + len(needle) // 2] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_byte_flipped_in_slot_file_is_detected(tmp_path, gen):
    s = make(tmp_path)
    data, other = pages(gen, 5), pages(gen, 3)
    extent, extent2 = s.reserve("a", 5), s.reserve("b", 3)
    s.write(extent, data)
    s.write(extent2, other)
    _flip_first_occurrence(tmp_path / "disk" / SLOT_FILE_NAME, data[4].numpy().tobytes()[:64])
    with pytest.raises(DiskCorruptionError):
        s.read(extent, torch.empty_like(data))
    out = torch.empty_like(other)
    s.read(extent2, out)  # other extents are untouched
    assert same_bits(out, other)
    assert s.stats()["corruptions"] == 1
    s.close()


@pytest.mark.parametrize("damage", ["byte_flipped", "chunk_missing"])
def test_a_damaged_local_store_chunk_file_is_an_error_not_data(tmp_path, gen, damage):
    """A flipped byte is a checksum error; a missing chunk is ENODATA, never fill values."""
    s = make(tmp_path, store=LocalStore(tmp_path / "local"))
    data = pages(gen, 4)
    extent = s.reserve("a", 4)
    s.write(extent, data)
    page = 1 if damage == "byte_flipped" else 0
    chunk_file = tmp_path / "local" / "c" / str(extent.chunks[page]) / "0"
    if damage == "byte_flipped":
        _flip_first_occurrence(chunk_file, data[page].numpy().tobytes()[:64])
    else:
        chunk_file.unlink()
    error = DiskCorruptionError if damage == "byte_flipped" else DiskIOError
    with pytest.raises(error) as info:
        s.read(extent, torch.empty_like(data))
    if damage == "chunk_missing":
        assert info.value.errno == errno.ENODATA
    s.close()


# ---------------------------------------------------------------------------- start-up


def _file_contains(path: Path, needle: bytes) -> bool:
    return needle in path.read_bytes()


def _left_committed(tmp_path: Path, gen, owner="old", meta=None, **kw) -> torch.Tensor:
    """A store that committed five random pages as ``owner`` (``meta``, by default
    ``{"tokens": 20}``) and closed; returns the pages."""
    first = make(tmp_path, on_start="reattach", **kw)
    data = pages(gen, 5)
    extent = first.reserve(owner, 5)
    first.write(extent, data)
    first.commit(owner, extent, {"tokens": 20} if meta is None else meta)
    first.close()
    return data


def test_clear_removes_leftovers(tmp_path, gen):
    data = _left_committed(tmp_path, gen)
    slot_file = tmp_path / "disk" / SLOT_FILE_NAME
    assert (tmp_path / "disk" / MANIFEST_KEY).exists()
    assert _file_contains(slot_file, data[0].numpy().tobytes()[:64])
    second = make(tmp_path)  # on_start="clear"
    assert second.reattached() == {} and second.used_bytes() == 0
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == sorted(
        [SLOT_FILE_NAME, "zarr.json", LOCK_FILE_NAME]
    )
    assert not _file_contains(slot_file, data[0].numpy().tobytes()[:64])
    second.check_integrity()
    second.close()


@pytest.mark.parametrize("foreign", ["junk.bin", "c"])
def test_clear_refuses_a_directory_holding_foreign_files(tmp_path, gen, foreign):
    _left_committed(tmp_path, gen)
    target = tmp_path / "disk" / foreign
    if foreign == "c":
        target.mkdir()
    else:
        target.write_bytes(b"not the tier's")
    slot_file = tmp_path / "disk" / SLOT_FILE_NAME
    before = slot_file.read_bytes()
    with pytest.raises(DiskIOError, match=rf"did not write: \['{foreign}'\]"):
        make(tmp_path)  # on_start="clear"
    assert target.exists() and slot_file.read_bytes() == before
    assert (tmp_path / "disk" / MANIFEST_KEY).exists()
    assert not disk_lock_held(tmp_path / "disk")


def test_clear_refuses_a_foreign_file_named_like_the_slot_file(tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    (root / SLOT_FILE_NAME).write_bytes(b"someone else's file" * 100)
    with pytest.raises(DiskIOError, match="did not write"):
        make(tmp_path)
    assert (root / SLOT_FILE_NAME).read_bytes() == b"someone else's file" * 100
    assert sorted(p.name for p in root.iterdir()) == [SLOT_FILE_NAME]


def test_reattach_adopts_committed_and_clears_the_rest(tmp_path, gen):
    plan = FaultPlan(seed=9)
    first = faulty(tmp_path, plan, on_start="reattach")
    kept, dropped, torn = pages(gen, 6), pages(gen, 3), pages(gen, 9)
    e_kept = first.reserve("kept", 6)
    first.write(e_kept, kept)
    first.commit("kept", e_kept, {"tokens": 24, "layers": [0, 1]})
    e_dropped = first.reserve("dropped", 3)
    first.write(e_dropped, dropped)  # written, never committed
    e_torn = first.reserve("torn", 9)
    plan.arm("eio_write", next_n=1)
    with pytest.raises(DiskIOError):  # a write that dies half way: some chunks landed
        first.write(e_torn, torn)
    first.close()

    second = make(tmp_path, on_start="reattach")
    adopted = second.reattached()
    assert list(adopted) == ["kept"]
    extent, meta = adopted["kept"]
    assert extent == e_kept and meta == {"tokens": 24, "layers": [0, 1]}
    out = torch.empty_like(kept)
    second.read(extent, out)
    assert same_bits(out, kept)
    assert second.used_bytes() == len(e_kept.chunks) * second.chunk_alloc_bytes
    second.check_integrity()
    slots = SlotFileStore(
        tmp_path / "disk",
        num_slots=second.capacity_chunks,
        slot_capacity=second.chunk_alloc_bytes + 4,
    )
    slots.open_sync()
    assert slots.occupied_slots() == list(e_kept.chunks)  # uncommitted chunks were cleared
    slots.close()
    # A reattached extent behaves like any other: released, it is forgotten for good.
    second.release(extent)
    second.close()
    third = make(tmp_path, on_start="reattach")
    assert third.reattached() == {} and third.used_bytes() == 0
    third.close()


def test_forget_keeps_the_extent_but_drops_it_from_the_manifest(tmp_path, gen):
    first = make(tmp_path, on_start="reattach")
    e = first.reserve("a", 4)
    first.write(e, pages(gen, 4))
    first.commit("a", e, {})
    manifest = json.loads((tmp_path / "disk" / MANIFEST_KEY).read_text())
    assert list(manifest["body"]["entries"]) == ["a"]
    assert first.forget("a") and not first.forget("a")
    manifest = json.loads((tmp_path / "disk" / MANIFEST_KEY).read_text())
    assert manifest["body"]["entries"] == {}
    assert first.used_bytes() == 4 * first.page_bytes
    first.close()


def _committed_store(tmp_path, gen, **kw):
    """A store that committed five random pages as "a" with meta ``{"n": 1}`` and closed."""
    return _left_committed(tmp_path, gen, "a", {"n": 1}, **kw)


def test_mismatched_fingerprint_clears(tmp_path, gen, caplog):
    _committed_store(tmp_path, gen)
    with caplog.at_level(logging.WARNING, logger="tiering.disk.store"):
        s = make(tmp_path, on_start="reattach", fingerprint="another-model")
    assert s.reattached() == {} and s.used_bytes() == 0
    assert "fingerprint" in caplog.text
    s.close()


def test_other_geometry_clears(tmp_path, gen, caplog):
    _committed_store(tmp_path, gen)
    with caplog.at_level(logging.WARNING, logger="tiering.disk.store"):
        s = make(tmp_path, on_start="reattach", capacity_chunks=9)
    assert s.reattached() == {} and "geometry" in caplog.text
    s.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "edit"])
def test_damaged_manifest_clears(tmp_path, gen, caplog, damage):
    _committed_store(tmp_path, gen)
    path = tmp_path / "disk" / MANIFEST_KEY
    text = path.read_text()
    if damage == "flip":
        path.write_text(text.replace('"n": 1', '"n": 2'))  # still JSON, checksum no longer matches
    elif damage == "truncate":
        path.write_text(text[: len(text) // 2])
    else:
        doc = json.loads(text)
        doc["body"]["entries"]["a"]["num_pages"] = 99
        path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="tiering.disk.store"):
        s = make(tmp_path, on_start="reattach")
    assert s.reattached() == {} and s.used_bytes() == 0
    assert "not reattaching" in caplog.text
    s.close()


def test_reattach_through_a_shared_memory_store(gen):
    shared = MemoryStore()
    first = DiskPageStore(
        DiskConfig(store=shared, capacity_bytes=8 * CHUNK, chunk_bytes=CHUNK, on_start="reattach"),
        PAGE_SHAPE,
        torch.float32,
        fingerprint="f",
    )
    data = pages(gen, 7)
    e = first.reserve("a", 7)
    first.write(e, data)
    first.commit("a", e, {"k": "v"})
    stray = first.reserve("b", 2)
    first.write(stray, pages(gen, 2))
    first.close()
    second = DiskPageStore(
        DiskConfig(store=shared, capacity_bytes=8 * CHUNK, chunk_bytes=CHUNK, on_start="reattach"),
        PAGE_SHAPE,
        torch.float32,
        fingerprint="f",
    )
    extent, meta = second.reattached()["a"]
    out = torch.empty_like(data)
    second.read(extent, out)
    assert same_bits(out, data) and meta == {"k": "v"}
    assert f"c/{stray.chunks[0]}/0" not in shared._store_dict
    second.close()


# ---------------------------------------------------------------------------- other stores


def test_file_url_path(tmp_path, gen):
    s = make(tmp_path, path=f"file://{tmp_path / 'viaurl'}")
    data = pages(gen, 6)
    extent = s.reserve("a", 6)
    assert same_bits(round_trip(s, extent, data), data)
    assert (tmp_path / "viaurl" / SLOT_FILE_NAME).is_file()
    s.close()


def test_memory_store_and_store_path_and_fsspec_url(tmp_path, gen):
    for cfg in (
        {"store": MemoryStore()},
        {"store": StorePath(MemoryStore(), "worker-3/kv")},
        {"path": "memory://tiering-test/kv"},
    ):
        s = make(tmp_path, **cfg)
        data = pages(gen, 5)
        extent = s.reserve("a", 5)
        assert same_bits(round_trip(s, extent, data), data), cfg
        s.close()


@pytest.mark.parametrize("codec", ["zstd", "blosc"])
def test_compressed_codecs_round_trip_and_detect_corruption(tmp_path, gen, codec):
    plan = FaultPlan(seed=1)
    s = faulty(tmp_path, plan, codec=codec, dtype=torch.bfloat16)
    data = pages(gen, 6, torch.bfloat16)
    data[1].zero_()
    extent = s.reserve("a", 6)
    assert same_bits(round_trip(s, extent, data), data)
    plan.arm("corrupt", next_n=1)
    with pytest.raises(DiskCorruptionError):
        s.read(extent, torch.empty_like(data))
    s.close()


# ---------------------------------------------------------------------------- slot store itself


def test_slot_store_keys_ranges_and_listing(tmp_path):
    import asyncio

    from zarr.abc.store import RangeByteRequest, SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype

    proto = default_buffer_prototype()
    store = SlotFileStore(tmp_path / "s", num_slots=4, slot_capacity=100, read_buffers=2)
    store.open_sync()
    payload = bytes(range(60))

    async def scenario():
        await store.set("c/2/0", proto.buffer.from_bytes(payload))
        await store.set("zarr.json", proto.buffer.from_bytes(b"{}"))
        got = await store.get("c/2/0", proto)
        part = await store.get("c/2/0", proto, RangeByteRequest(10, 20))
        tail = await store.get("c/2/0", proto, SuffixByteRequest(5))
        missing = await store.get("c/1/0", proto)
        keys = sorted([k async for k in store.list()])
        await store.delete("c/2/0")
        after = await store.exists("c/2/0")
        return got.to_bytes(), part.to_bytes(), tail.to_bytes(), missing, keys, after

    got, part, tail, missing, keys, after = asyncio.run(scenario())
    assert got == payload and part == payload[10:20] and tail == payload[-5:]
    assert missing is None and keys == ["c/2/0", "zarr.json"] and after is False
    with pytest.raises(OSError) as info:
        store.set_sync("c/0/0", proto.buffer.from_bytes(bytes(101)))
    assert info.value.errno == errno.EFBIG
    with pytest.raises(ValueError, match="slot"):
        store.set_sync("c/9/0", proto.buffer.from_bytes(b"x"))
    store.close()
    reopened = SlotFileStore(tmp_path / "s", num_slots=5, slot_capacity=100)
    reopened.open_sync()  # another geometry: recreated empty
    assert reopened.found_existing and not reopened.matched_existing
    assert reopened.occupied_slots() == []
    reopened.close()


# ---------------------------------------------------------------------------- manifest faults, busy extents


class ManifestFaults(FaultyStore):
    """Fails manifest writes while ``failing`` is set (FaultyStore leaves metadata alone)."""

    failing = False

    async def set(self, key, value):
        if key.endswith(MANIFEST_KEY) and self.failing:
            raise OSError(errno.EIO, "manifest write refused", key)
        await super().set(key, value)


def test_manifest_write_failures_never_leave_a_stale_manifest(tmp_path, gen, caplog):
    wrapper: dict[str, ManifestFaults] = {}

    def wrap(inner):
        wrapper["w"] = ManifestFaults(inner, FaultPlan())
        return wrapper["w"]

    s = make(tmp_path, on_start="reattach", wrap_store=wrap)
    a, b = s.reserve("a", 4), s.reserve("b", 4)
    s.write(a, pages(gen, 4))
    s.write(b, pages(gen, 4))
    s.commit("a", a, {})
    wrapper["w"].failing = True
    with pytest.raises(DiskIOError, match="manifest"):
        s.commit("b", b, {})
    assert s.stats()["committed"] == 1  # the failed commit left nothing behind
    with caplog.at_level(logging.WARNING, logger="tiering.disk.store"):
        s.release(a)  # a manifest failure on release is logged, never raised
    assert "will retry" in caplog.text and s.stats()["manifest_dirty"]
    # The manifest on disk still lists a's chunk, so it must not be handed out again yet.
    assert s.used_bytes() == 8 * s.page_bytes and s.stats()["quarantined_chunks"] == 4
    s.check_integrity()
    wrapper["w"].failing = False
    s.commit("b", b, {})  # the next good manifest write frees it
    assert s.used_bytes() == 4 * s.page_bytes and s.stats()["quarantined_chunks"] == 0
    s.check_integrity()
    s.close()
    again = make(tmp_path, on_start="reattach")
    assert list(again.reattached()) == ["b"]
    again.close()


def test_clear_mode_keeps_commits_in_memory_only(store, tmp_path, gen):
    e = store.reserve("a", 4)
    store.write(e, pages(gen, 4))
    store.commit("a", e, {"x": 1})
    assert store.stats()["committed"] == 1
    assert not (tmp_path / "disk" / MANIFEST_KEY).exists()


def test_operations_on_a_busy_extent_are_refused(tmp_path, gen):
    entered = threading.Semaphore(0)
    gate = threading.Event()

    def held_sleep(_seconds):
        entered.release()
        assert gate.wait(30), "gate never opened"

    plan = FaultPlan(seed=8, sleep=held_sleep)
    s = faulty(tmp_path, plan)
    extent = s.reserve("a", 4)
    data = pages(gen, 4)
    plan.arm("slow", next_n=1)
    with ThreadPoolExecutor(1) as pool:
        writing = pool.submit(s.write, extent, data)
        assert entered.acquire(timeout=30), "write never reached the store"
        with pytest.raises(ValueError, match="in flight"):
            s.write(extent, data)
        with pytest.raises(ValueError, match="in flight"):
            s.release(extent)
        assert s.stats()["in_flight"] == 1
        gate.set()
        writing.result(timeout=30)
    out = torch.empty_like(data)
    s.read(extent, out)
    assert same_bits(out, data)
    s.close()


def test_closed_store_refuses_work(tmp_path, gen):
    s = make(tmp_path)
    e = s.reserve("a", 2)
    s.write(e, pages(gen, 2))
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.reserve("b", 1)
    with pytest.raises(ValueError, match="closed"):
        s.read(e, torch.empty((2, *PAGE_SHAPE)))
    with pytest.raises(ValueError, match="closed"):
        s.release(e)
    assert not s.can_reserve(1)
    s.close()  # idempotent


# ---------------------------------------------------------------------------- direct chunk I/O


def slot_store_of(tmp_path: Path, s: DiskPageStore, *, read_only: bool = False) -> SlotFileStore:
    """A second view of the slot file behind ``s`` (default local layout, codec none)."""
    slots = SlotFileStore(
        tmp_path / "disk",
        num_slots=s.capacity_chunks,
        slot_capacity=s.chunk_alloc_bytes + 4,
        read_only=read_only,
    )
    slots.open_sync()
    return slots


def storage_rows(s: DiskPageStore, data: torch.Tensor) -> np.ndarray:
    """``data`` as the array's rows: one page per row, of the storage dtype."""
    raw = data.contiguous().view(torch.uint8).numpy().reshape(data.shape[0], -1)
    return raw.view(s.format.storage_dtype)


def padded_chunk(s: DiskPageStore, rows: np.ndarray, i: int) -> np.ndarray:
    """Chunk ``i`` of an extent as zarr holds it: one page per chunk."""
    return np.ascontiguousarray(rows[i : i + 1])


def test_direct_io_only_for_the_unwrapped_uncompressed_slot_file(tmp_path):
    cases = [
        ({}, True),
        ({"path": f"file://{tmp_path / 'url'}"}, True),
        ({"codec": "zstd"}, False),
        ({"codec": "blosc"}, False),
        ({"store": LocalStore(tmp_path / "local")}, False),
        ({"store": MemoryStore()}, False),
        ({"wrap_store": lambda inner: FaultyStore(inner, FaultPlan())}, False),
    ]
    for i, (kw, direct) in enumerate(cases):
        s = make(tmp_path, sub=f"d{i}", **kw)
        assert s.direct_io is direct, kw
        s.close()


@pytest.mark.parametrize("piece", [1000, 4096, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_direct_round_trip_across_piece_boundaries(tmp_path, gen, monkeypatch, piece, dtype):
    """Chunks move in pieces; any piece size, with a padded tail, gives the same bits."""
    if piece is not None:
        monkeypatch.setattr(disk_slotfile, "PIECE_BYTES", piece)
    s = make(tmp_path, dtype=dtype, capacity_chunks=12, chunk_bytes=3 * CHUNK + 512, io_threads=3)
    assert s.direct_io
    written = {}
    for i, n in enumerate([1, s.pages_per_chunk, 2 * s.pages_per_chunk + 5, 3 * s.pages_per_chunk]):
        data = (
            torch.randint(-128, 127, (n, *PAGE_SHAPE), generator=gen, dtype=torch.int8)
            if dtype == torch.int8
            else pages(gen, n, dtype)
        )
        extent = s.reserve(f"r{i}", n)
        s.write(extent, data)
        written[extent] = data
    for extent, data in written.items():
        out = torch.full_like(data, 5)
        s.read(extent, out)
        assert same_bits(out, data), f"extent {extent} changed"
    s.check_integrity()
    s.close()


def test_large_chunks_written_by_several_threads_at_once(tmp_path, gen):
    """Many-chunk extents: each chunk spans several pieces and the I/O threads overlap."""
    s = make(tmp_path, capacity_chunks=10, chunk_bytes=(1 << 20) + 3 * 1024, io_threads=4)
    assert s.direct_io and s.pages_per_chunk * s.page_bytes > disk_slotfile.PIECE_BYTES
    n = 4 * s.pages_per_chunk - 7
    first, second = pages(gen, n), pages(gen, 2 * s.pages_per_chunk + 1)
    e1, e2 = s.reserve("a", n), s.reserve("b", second.shape[0])
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(s.write, e1, first), pool.submit(s.write, e2, second)]:
            f.result(timeout=60)
    out1, out2 = torch.empty_like(first), torch.empty_like(second)
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(s.read, e1, out1), pool.submit(s.read, e2, out2)]:
            f.result(timeout=60)
    assert same_bits(out1, first) and same_bits(out2, second)
    s.close()


def test_direct_chunks_are_byte_for_byte_what_zarr_encodes(tmp_path, gen):
    s = make(tmp_path, dtype=torch.bfloat16)
    assert s.direct_io
    n = s.pages_per_chunk + 3  # more than one I/O batch
    data = pages(gen, n, torch.bfloat16)
    extent = s.reserve("a", n)
    s.write(extent, data)
    rows = storage_rows(s, data)
    serializer, compressors = page_codecs("none", s.format.storage_dtype.itemsize)
    encoded: dict = {}
    reference = zarr.create_array(
        MemoryStore(store_dict=encoded),
        shape=(1, s.format.row_elems),
        chunks=(1, s.format.row_elems),
        dtype=s.format.storage_dtype,
        serializer=serializer,
        compressors=compressors,
        filters=[],
        fill_value=0,
        chunk_key_encoding={"name": "default", "separator": "/"},
        config={"write_empty_chunks": True},
    )
    slots = slot_store_of(tmp_path, s, read_only=True)
    for i, chunk in enumerate(extent.chunks):
        block = padded_chunk(s, rows, i)
        reference[:] = block
        stored = slots.get_sync(slot_chunk_key(chunk)).to_bytes()
        assert stored == encoded["c/0/0"].to_bytes(), f"chunk {chunk} differs from zarr's encoding"
        assert stored[-4:] == google_crc32c.value(block.tobytes()).to_bytes(4, "little")
    slots.close()
    s.close()


def test_plain_zarr_reads_what_the_direct_path_wrote(tmp_path, gen):
    s = make(tmp_path)
    assert s.direct_io
    data = pages(gen, 7)  # one page per chunk (row) of the array
    extent = s.reserve("a", 7)
    s.write(extent, data)
    rows = storage_rows(s, data)
    slots = slot_store_of(tmp_path, s, read_only=True)
    arr = zarr.open_array(slots, mode="r")
    assert arr.chunks == (1, s.format.row_elems)
    for i, chunk in enumerate(extent.chunks):
        got = arr[chunk : chunk + 1]
        assert np.array_equal(got, padded_chunk(s, rows, i)), f"chunk {chunk}"
    slots.close()
    s.close()


def _passthrough(inner):
    return FaultyStore(inner, FaultPlan())  # nothing armed: only forces zarr's pipeline


@pytest.mark.parametrize("writer_wrapped", [True, False])
def test_zarr_pipeline_and_direct_path_read_each_others_chunks(tmp_path, gen, writer_wrapped):
    """Written through one path and committed, reattached and read through the other."""
    first = make(tmp_path, on_start="reattach", wrap_store=_passthrough if writer_wrapped else None)
    assert first.direct_io is not writer_wrapped
    data = pages(gen, 10)
    extent = first.reserve("a", 10)
    first.write(extent, data)
    first.commit("a", extent, {})
    first.close()
    second = make(
        tmp_path, on_start="reattach", wrap_store=None if writer_wrapped else _passthrough
    )
    assert second.direct_io is writer_wrapped
    adopted, _ = second.reattached()["a"]
    out = torch.full_like(data, 9)
    second.read(adopted, out)
    assert same_bits(out, data)
    second.close()


def _damage(path: Path, offset: int, value: bytes | None = None) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1) if value is None else None
        f.seek(offset)
        f.write(bytes([old[0] ^ 0x5A]) if value is None else value)


@pytest.mark.parametrize("where", ["payload", "crc", "length", "binding"])
def test_direct_read_refuses_a_damaged_slot(tmp_path, gen, where):
    s = make(tmp_path)
    data, other = pages(gen, 6), pages(gen, 4)
    a, b = s.reserve("a", 6), s.reserve("b", 4)
    s.write(a, data)
    s.write(b, other)
    slots = slot_store_of(tmp_path, s, read_only=True)
    fifth = slots.payload_offset(a.chunks[4])
    offset = {
        "payload": fifth + 17,  # inside page 5
        "crc": fifth + s.page_bytes + 2,
        "length": fifth - 8,  # the header's encoded length
        "binding": fifth - 16 - 20,  # inside the binding block before the header
    }[where]
    slots.close()
    _damage(tmp_path / "disk" / SLOT_FILE_NAME, offset)
    with pytest.raises(DiskCorruptionError):
        s.read(a, torch.empty_like(data))
    out = torch.empty_like(other)
    s.read(b, out)  # other extents are untouched
    assert same_bits(out, other)
    assert s.stats()["corruptions"] == 1 and s.stats()["read_faults"] == 1
    s.close()


def test_direct_read_of_an_emptied_or_truncated_slot_is_an_io_error(tmp_path, gen):
    s = make(tmp_path, capacity_chunks=4)
    data = pages(gen, 8)
    extent = s.reserve("a", 8)
    s.write(extent, data)
    slots = slot_store_of(tmp_path, s)
    magic_at = slots.payload_offset(extent.chunks[0]) - 16
    last_payload = slots.payload_offset(extent.chunks[1])
    slots.close()
    path = tmp_path / "disk" / SLOT_FILE_NAME
    _damage(path, magic_at, bytes(8))  # the header no longer says "chunk here"
    with pytest.raises(DiskIOError) as info:
        s.read(extent, torch.empty_like(data))
    assert info.value.errno == errno.ENODATA and not isinstance(info.value, DiskCorruptionError)
    s.write(extent, data)
    with open(path, "r+b") as f:
        f.truncate(last_payload + 100)  # the second chunk runs past the end of the file
    with pytest.raises(DiskIOError) as info:
        s.read(extent, torch.empty_like(data))
    assert info.value.errno == errno.EIO and not isinstance(info.value, DiskCorruptionError)
    s.close()


def test_slot_store_direct_calls_validate_and_round_trip(tmp_path):
    store = SlotFileStore(tmp_path / "s", num_slots=3, slot_capacity=1000, read_buffers=1)
    store.open_sync()
    rng = np.random.default_rng(3)
    data = rng.integers(0, 255, 700, dtype=np.uint8)
    store.write_chunk(1, data, pad=200)
    out = np.zeros(700, dtype=np.uint8)
    store.read_chunk(1, out, pad=200)
    assert np.array_equal(out, data)
    expected = data.tobytes() + bytes(200)
    stored = store.get_sync(slot_chunk_key(1)).to_bytes()
    assert stored == expected + google_crc32c.value(expected).to_bytes(4, "little")
    with pytest.raises(ChunkChecksumError, match="expected"):
        store.read_chunk(1, out)  # the caller expects 700 payload bytes, the slot holds 900
    with pytest.raises(OSError) as info:
        store.write_chunk(0, data, pad=297)
    assert info.value.errno == errno.EFBIG
    with pytest.raises(ValueError, match="slot index"):
        store.write_chunk(3, data)
    with pytest.raises(ValueError, match="read-only"):
        store.read_chunk(1, np.frombuffer(bytes(700), dtype=np.uint8), pad=200)
    with pytest.raises(ValueError, match="contiguous"):
        store.write_chunk(0, np.zeros(20, dtype=np.uint8)[::2])
    with pytest.raises(OSError) as info:
        store.read_chunk(2, out)
    assert info.value.errno == errno.ENODATA
    store.close()


def _crc_implementations() -> list[str]:
    """The crc32c implementations this machine can run (the reference binding always)."""
    found = ["binding"]
    if disk_crc._NATIVE is not None:
        found.append("ctypes")
    if disk_crc._RS is not None:
        found.append("rs")
    return found


@pytest.mark.parametrize("impl", ["rs", "ctypes", "binding"])
def test_crc32c_matches_the_reference_in_place(monkeypatch, impl):
    if impl not in _crc_implementations():
        pytest.skip(f"the {impl} crc32c is not installed here")
    if impl != "rs":
        monkeypatch.setattr(disk_crc, "_RS", None)
    if impl == "binding":
        monkeypatch.setattr(disk_crc, "_NATIVE", None)  # the fallback through the binding
    rng = np.random.default_rng(4)
    buf = rng.integers(0, 255, 3 << 20, dtype=np.uint8)
    for start, stop in [(0, 0), (0, 1), (3, 1001), (7, buf.nbytes), (0, 1 << 20)]:
        want = google_crc32c.value(buf[start:stop].tobytes())
        assert disk_crc.crc32c_extend(0, buf[start:stop]) == want
        span = disk_crc.ByteSpan(buf)
        mid = (start + stop) // 2
        assert span.extend(span.extend(0, start, mid), mid, stop) == want
    wide = rng.integers(0, 1 << 16, 999, dtype=np.uint16)
    assert disk_crc.crc32c_extend(0, wide) == google_crc32c.value(wide.tobytes())
    with pytest.raises(ValueError, match="outside"):
        disk_crc.ByteSpan(buf).extend(0, 10, buf.nbytes + 1)
    with pytest.raises(ValueError, match="contiguous"):
        disk_crc.crc32c_extend(0, buf[::2])


def test_the_fastest_crc32c_installed_is_the_one_in_use():
    assert disk_crc.RELEASES_GIL, "crc32c would hold the GIL: the I/O threads cannot overlap"
    best = {"rs": "crc32c-rs", "ctypes": "google-crc32c (ctypes)"}.get(
        _crc_implementations()[-1], "google-crc32c")
    assert disk_crc.IMPLEMENTATION == best


def test_a_crc32c_that_disagrees_with_the_reference_is_not_used():
    data = np.random.default_rng(5).integers(0, 255, 4000, dtype=np.uint8)
    reference = google_crc32c.value
    assert disk_crc._agrees(lambda crc, a: google_crc32c.extend(crc, a.tobytes()))  # control
    assert not disk_crc._agrees(lambda crc, a: reference(a.tobytes()))  # ignores the seed
    assert not disk_crc._agrees(lambda crc, a: google_crc32c.extend(crc, a.tobytes()) ^ 1)
    assert not disk_crc._agrees(lambda crc, a: zlib.crc32(a.tobytes(), crc))  # CRC-32, not -32C

    def broken(crc: int, a: np.ndarray) -> int:
        raise OSError("no such instruction")

    assert not disk_crc._agrees(broken)
    assert disk_crc.crc32c_extend(0, data) == reference(data.tobytes())


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), True, "1"])
def test_waits_refuse_a_timeout_that_is_not_a_finite_number(tmp_path, gen, bad):
    s = make(tmp_path, on_start="reattach")
    extent = s.reserve("a", 2)
    s.write(extent, pages(gen, 2))
    for wait in (s.wait_idle, s.wait_manifest):
        with pytest.raises(ValueError, match=f"{wait.__name__} timeout must be a finite"):
            wait(bad)
        assert wait(-1.0) is True and wait(0) is True  # an expired budget answers at once
    with pytest.raises(ValueError, match="slot index"):
        s.chunk_offset(True)  # a bool is not slot 1
    assert s.chunk_offset(1) is not None
    s.check_integrity()
    s.close()


@pytest.mark.parametrize("kwargs", [{"wrap_store": 5}, {"new_store_id": "id"}])
def test_hooks_that_are_not_callable_are_refused_before_anything_is_made(tmp_path, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DiskPageStore(DiskConfig(path=tmp_path / "d", capacity_bytes=4096), PAGE_SHAPE,
                      torch.float32, **kwargs)
    assert not (tmp_path / "d").exists()
    DiskPageStore(DiskConfig(path=tmp_path / "d", capacity_bytes=4096), PAGE_SHAPE,
                  torch.float32).close()  # the control: the path was free and usable
