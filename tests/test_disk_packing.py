"""Page-granular allocation: small requests pack the tier; the cap stays byte-exact; no
owner's write touches another owner's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.storage import MemoryStore

from tiering.disk import DiskConfig, DiskIOError, DiskPageStore, FaultPlan, FaultyStore

PAGE_SHAPE = (2, 4, 8)
PAGE_BYTES = int(np.prod(PAGE_SHAPE)) * 4


def test_a_64_mib_tier_of_4_kib_pages_holds_1024_requests_of_64_kib():
    page_shape = (1024,)  # 4 KiB float32 pages: 16 per 64 KiB request
    cfg = DiskConfig(store=MemoryStore(), capacity_bytes=64 << 20)  # default 32 MiB chunk_bytes
    s = DiskPageStore(cfg, page_shape, torch.float32)
    held = 0
    while s.reserve(f"r{held}", 16) is not None:
        held += 1
    assert held == 1024  # was 2 when every request took a whole 32 MiB chunk
    assert s.used_bytes() == s.capacity_bytes == 64 << 20
    assert s.stats()["refusals"] == 1 and not s.can_reserve(1)
    s.check_integrity()
    s.close()


@settings(max_examples=40, deadline=None)
@given(
    capacity_pages=st.integers(10, 400),
    seed=st.integers(0, 2**32 - 1),
    churn=st.booleans(),
)
def test_any_request_sizes_fill_at_least_90_percent(capacity_pages, seed, churn):
    rng = np.random.default_rng(seed)
    cfg = DiskConfig(
        store=MemoryStore(), capacity_bytes=capacity_pages * PAGE_BYTES + 7, chunk_bytes=4096
    )
    s = DiskPageStore(cfg, PAGE_SHAPE, torch.float32)
    biggest = max(1, capacity_pages // 10)
    live = []
    if churn:  # fragment the free space first
        while (e := s.reserve("x", int(rng.integers(1, biggest + 1)))) is not None:
            live.append(e)
        for e in live[::2]:
            s.release(e)
        live = live[1::2]
        s.check_integrity()
    while True:
        n = int(rng.integers(1, biggest + 1))
        e = s.reserve("y", n)
        s.check_integrity()
        if e is None:
            break
        assert len(e.chunks) == n
        live.append(e)
    used = s.used_bytes()
    assert used == sum(e.num_pages for e in live) * PAGE_BYTES  # byte-exact ledger
    assert used <= s.capacity_bytes
    assert used >= 0.9 * s.capacity_bytes - PAGE_BYTES  # cap not a whole page count: +7
    s.close()


@pytest.mark.parametrize("mode", ["direct", "zarr"])
def test_interleaved_owners_never_corrupt_each_other(tmp_path, mode):
    rng = np.random.default_rng(31)
    plan = FaultPlan(seed=5)
    wrap = (lambda st_: FaultyStore(st_, plan)) if mode == "zarr" else None
    cfg = DiskConfig(
        path=tmp_path / "d", capacity_bytes=40 * PAGE_BYTES, chunk_bytes=4 * PAGE_BYTES
    )
    s = DiskPageStore(cfg, PAGE_SHAPE, torch.float32, wrap_store=wrap)
    # one-page holes between others: the next extents are scattered across them
    singles = [s.reserve(f"s{i}", 1) for i in range(20)]
    for e in singles[::2]:
        s.release(e)
    neighbours = singles[1::2]
    kept = {}
    for e in neighbours:
        kept[e] = torch.from_numpy(rng.standard_normal((1, *PAGE_SHAPE)).astype(np.float32))
        s.write(e, kept[e])
    victim = s.reserve("v", 25)  # 10 holes + 15 pages after: not one run
    assert victim is not None and len(set(victim.chunks) & {e.chunks[0] for e in neighbours}) == 0
    data = torch.from_numpy(rng.standard_normal((25, *PAGE_SHAPE)).astype(np.float32))
    if mode == "zarr":
        plan.arm("eio_write", probability=0.5)
        with pytest.raises(DiskIOError):
            s.write(victim, data)  # a failed write of one owner...
        plan.disarm("eio_write")
    s.write(victim, data)
    for e, want in kept.items():  # ...and a good one leave every neighbour intact
        out = torch.empty_like(want)
        s.read(e, out)
        assert torch.equal(out, want)
    out = torch.empty_like(data)
    s.read(victim, out)
    assert torch.equal(out, data)
    s.check_integrity()
    s.close()


@pytest.mark.parametrize("damage", ["written_map", "generation", "busy", "double_holder"])
def test_check_integrity_catches_a_broken_allocation_state(damage):
    from tiering.disk import DiskIntegrityError

    cfg = DiskConfig(store=MemoryStore(), capacity_bytes=20 * PAGE_BYTES, chunk_bytes=4096)
    s = DiskPageStore(cfg, PAGE_SHAPE, torch.float32)
    a, b = s.reserve("a", 3), s.reserve("b", 4)
    s.check_integrity()  # the control: a sound state passes
    ledger = s._ledger
    state = ledger._extents[a.chunks]
    if damage == "written_map":
        state.done.add(7)  # a page position the extent does not have
    elif damage == "generation":
        state.generation = ledger.next_generation + 5
    elif damage == "busy":
        state.busy = True  # busy with no range in flight
    else:
        ledger._extents[b.chunks + (a.chunks[0],)] = ledger._extents.pop(b.chunks)
    with pytest.raises(DiskIntegrityError):
        s.check_integrity()
