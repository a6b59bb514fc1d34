"""Range I/O: ``write``/``read`` of pages ``[first_page, first_page + k)`` of an extent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiering.disk import DiskConfig, DiskIOError, DiskPageStore, FaultPlan, FaultyStore

PAGE_SHAPE = (2, 4, 8)
PAGE_BYTES = int(np.prod(PAGE_SHAPE)) * 4
PPC = 3
CHUNK = PPC * PAGE_BYTES


def make(tmp_path, mode: str, plan: FaultPlan | None = None) -> DiskPageStore:
    cfg = DiskConfig(path=tmp_path / "d", capacity_bytes=8 * CHUNK, chunk_bytes=CHUNK)
    wrap = None
    if mode == "zarr":
        wrap = lambda s: FaultyStore(s, plan or FaultPlan())  # noqa: E731
    store = DiskPageStore(cfg, PAGE_SHAPE, torch.float32, fingerprint="r", wrap_store=wrap)
    assert store.direct_io is (mode == "direct")
    return store


def pages(rng, n):
    return torch.from_numpy(rng.standard_normal((n, *PAGE_SHAPE)).astype(np.float32))


@pytest.mark.parametrize("mode", ["direct", "zarr"])
def test_pipelined_range_writes_and_reads_round_trip(tmp_path, mode):
    rng = np.random.default_rng(21)
    store = make(tmp_path, mode)
    n = 4 * PPC + 2  # a short tail chunk
    data = pages(rng, n)
    ext = store.reserve("r", n)
    step = PPC - 1  # ranges need not follow the I/O batch
    ring = [torch.empty((step, *PAGE_SHAPE)) for _ in range(2)]
    for i, first in enumerate(range(0, n, step)):
        k = min(step, n - first)
        buf = ring[i % 2][:k]
        buf.copy_(data[first : first + k])
        if first + k < n:
            with pytest.raises(ValueError, match="not completely written"):
                store.commit("r", ext)  # a commit needs every page
        store.write(ext, buf, first_page=first)
        store.check_integrity()
    store.commit("r", ext)
    whole = torch.empty_like(data)
    store.read(ext, whole)
    assert torch.equal(whole, data)
    part = torch.empty((2 * PPC, *PAGE_SHAPE))
    store.read(ext, part, first_page=PPC + 1)
    assert torch.equal(part, data[PPC + 1 : 3 * PPC + 1])
    tail = torch.empty((2, *PAGE_SHAPE))
    store.read(ext, tail, first_page=4 * PPC)
    assert torch.equal(tail, data[4 * PPC :])
    assert store.stats()["bytes_written"] == n * PAGE_BYTES
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("mode", ["direct", "zarr"])
def test_unwritten_ranges_cannot_be_read_and_bad_ranges_change_nothing(tmp_path, mode):
    rng = np.random.default_rng(22)
    store = make(tmp_path, mode)
    ext = store.reserve("r", 2 * PPC)
    first = pages(rng, PPC)
    store.write(ext, first, first_page=0)
    out = torch.empty((PPC, *PAGE_SHAPE))
    with pytest.raises(ValueError, match="not been written"):
        store.read(ext, out, first_page=PPC)
    with pytest.raises(ValueError, match="not been written"):
        store.read(ext, torch.empty((2 * PPC, *PAGE_SHAPE)))
    before = store.stats()
    for bad_first, k, what in [
        (PPC + 1, PPC, "not inside"),
        (2 * PPC, 1, "not inside"),
        (0, 0, "not inside"),
        (-1, 1, "first_page"),
    ]:
        with pytest.raises(ValueError, match=what):
            store.write(ext, pages(rng, k), first_page=bad_first)
    assert store.stats() == before
    store.read(ext, out, first_page=0)  # the written range is still good
    assert torch.equal(out, first)
    store.check_integrity()
    store.close()


def test_a_failed_range_write_unwrites_only_that_range(tmp_path):
    rng = np.random.default_rng(23)
    plan = FaultPlan(seed=3)
    store = make(tmp_path, "zarr", plan)
    ext = store.reserve("r", 2 * PPC)
    a, b = pages(rng, PPC), pages(rng, PPC)
    store.write(ext, a, first_page=0)
    plan.arm("enospc_write", next_n=1)
    with pytest.raises(DiskIOError):
        store.write(ext, b, first_page=PPC)
    with pytest.raises(ValueError, match="not completely written"):
        store.commit("r", ext)
    out = torch.empty((PPC, *PAGE_SHAPE))
    store.read(ext, out, first_page=0)
    assert torch.equal(out, a)
    store.write(ext, b, first_page=PPC)  # rewritten: now complete
    store.commit("r", ext)
    whole = torch.empty((2 * PPC, *PAGE_SHAPE))
    store.read(ext, whole)
    assert torch.equal(whole, torch.cat([a, b]))
    store.check_integrity()
    store.close()
