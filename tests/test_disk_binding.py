"""Chunk binding: an intact chunk in the wrong place, of another store, or of an older
reservation is detected at read (DiskCorruptionError), never served."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from zarr.storage import MemoryStore

from tiering.disk import DiskConfig, DiskCorruptionError, DiskPageStore, FaultPlan, FaultyStore
from tiering.disk.manifest import MANIFEST_KEY
from tiering.disk.slotfile import SLOT_FILE_NAME

PAGE_SHAPE = (2, 4, 8)
PAGE_BYTES = int(np.prod(PAGE_SHAPE)) * 4
PPC = 2
CHUNK = PPC * PAGE_BYTES
MODES = ["direct", "zarr-slots", "zarr-memory"]


def make(path: Path | None, mode: str, *, on_start="clear", memory=None, seed_id=None):
    if mode == "zarr-memory":
        cfg = DiskConfig(store=memory, capacity_bytes=6 * CHUNK, chunk_bytes=CHUNK)
    else:
        cfg = DiskConfig(path=path, capacity_bytes=6 * CHUNK, chunk_bytes=CHUNK, on_start=on_start)
    wrap = (lambda s: FaultyStore(s, FaultPlan())) if mode == "zarr-slots" else None
    ids = (lambda: seed_id) if seed_id is not None else None
    store = DiskPageStore(
        cfg, PAGE_SHAPE, torch.float32, fingerprint="b", wrap_store=wrap, new_store_id=ids
    )
    assert store.direct_io is (mode == "direct")
    return store


def pages(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((n, *PAGE_SHAPE)).astype(np.float32))


class Slots:
    """Raw access to one chunk's stored bytes, for the slot file or a memory store."""

    def __init__(self, store: DiskPageStore, memory: dict | None) -> None:
        self.memory = memory
        self.slots = store._backend.slots

    def get(self, chunk: int) -> tuple[bytes, ...]:
        if self.memory is not None:
            return (self.memory[f"c/{chunk}/0"], self.memory[f"tiering-bind/{chunk}"])
        start = 4096 + chunk * self.slots.stride
        with open(self.slots.slot_path, "rb") as f:
            f.seek(start)
            return (f.read(self.slots.stride),)

    def put(self, chunk: int, raw: tuple[bytes, ...]) -> None:
        if self.memory is not None:
            self.memory[f"c/{chunk}/0"], self.memory[f"tiering-bind/{chunk}"] = raw
            return
        with open(self.slots.slot_path, "r+b") as f:
            f.seek(4096 + chunk * self.slots.stride)
            f.write(raw[0])


def setup(tmp_path: Path, mode: str):
    memory: dict | None = {} if mode == "zarr-memory" else None
    store = make(
        tmp_path / "d", mode, memory=MemoryStore(store_dict=memory) if memory is not None else None
    )
    return store, Slots(store, memory)


def read_fails(store: DiskPageStore, extent, n: int) -> str:
    before = store.stats()["corruptions"]
    out = torch.full((n, *store.page_shape), 7.0)
    with pytest.raises(DiskCorruptionError) as info:
        store.read(extent, out)
    assert store.stats()["corruptions"] == before + 1
    store.check_integrity()
    return str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_intact_chunks_read_back_and_swapped_slots_are_refused(tmp_path, mode):
    rng = np.random.default_rng(11)
    store, raw = setup(tmp_path, mode)
    a, b = store.reserve("a", PPC), store.reserve("b", PPC)
    da, db = pages(rng, PPC), pages(rng, PPC)
    store.write(a, da)
    store.write(b, db)
    out = torch.empty_like(da)
    store.read(a, out)  # the control: untouched chunks are served
    assert torch.equal(out, da)
    ra, rb = raw.get(a.chunks[0]), raw.get(b.chunks[0])
    raw.put(a.chunks[0], rb)
    raw.put(b.chunks[0], ra)
    assert "bound to" in read_fails(store, a, PPC)
    read_fails(store, b, PPC)
    raw.put(a.chunks[0], ra)  # put back: served again, so the refusal was the binding
    store.read(a, out)
    assert torch.equal(out, da)
    store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_misdirected_write_is_refused_where_it_landed(tmp_path, mode):
    rng = np.random.default_rng(12)
    store, raw = setup(tmp_path, mode)
    a, b = store.reserve("a", PPC), store.reserve("b", PPC)
    store.write(a, pages(rng, PPC))
    store.write(b, pages(rng, PPC))
    raw.put(b.chunks[0], raw.get(a.chunks[0]))  # a's write landed in b's slot
    read_fails(store, b, PPC)
    store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_generation_is_refused(tmp_path, mode):
    rng = np.random.default_rng(13)
    store, raw = setup(tmp_path, mode)
    old = store.reserve("r", PPC)
    store.write(old, pages(rng, PPC))
    stale = raw.get(old.chunks[0])
    store.release(old)
    new = store.reserve("r", PPC)  # same owner, same slot, a later generation
    assert new.chunks == old.chunks and new.generation > old.generation
    data = pages(rng, PPC)
    store.write(new, data)
    raw.put(new.chunks[0], stale)  # the new write was lost; the old bytes came back
    assert f"generation {old.generation}" in read_fails(store, new, PPC)
    store.close()


@pytest.mark.parametrize("mode", ["direct", "zarr-slots"])
def test_a_slot_file_of_another_store_with_the_same_geometry_is_refused(tmp_path, mode):
    rng = np.random.default_rng(14)
    mine = make(tmp_path / "mine", mode)
    other = make(tmp_path / "other", mode)
    assert mine.store_id != other.store_id
    em, eo = mine.reserve("r", 3), other.reserve("r", 3)
    assert em.chunks == eo.chunks and em.generation == eo.generation
    mine.write(em, pages(rng, 3))
    other.write(eo, pages(rng, 3))
    other.close()
    with open(tmp_path / "other" / SLOT_FILE_NAME, "rb") as f:
        foreign = f.read()
    with open(tmp_path / "mine" / SLOT_FILE_NAME, "r+b") as f:
        f.write(foreign)
    assert "store " + other.store_id in read_fails(mine, em, 3)
    mine.close()


def test_reattach_refuses_a_manifest_and_slot_file_copied_from_another_store(tmp_path, caplog):
    rng = np.random.default_rng(15)
    for name in ("mine", "other"):
        s = make(tmp_path / name, "direct", on_start="reattach")
        e = s.reserve("r", 3)
        s.write(e, pages(rng, 3))
        s.commit("r", e)
        s.close()
    for name in (SLOT_FILE_NAME, MANIFEST_KEY):
        shutil.copyfile(tmp_path / "other" / name, tmp_path / "mine" / name)
    with caplog.at_level(logging.WARNING, logger="tiering.disk.store"):
        again = make(tmp_path / "mine", "direct", on_start="reattach")
    assert again.reattached() == {} and "written by store" in caplog.text
    again.check_integrity()
    again.close()
    # the control: an uncopied store reattaches its own entry and serves it
    own = make(tmp_path / "other", "direct", on_start="reattach")
    ext, _ = own.reattached()["r"]
    out = torch.empty((3, *PAGE_SHAPE))
    own.read(ext, out)
    own.close()


def test_reattach_keeps_the_identity_and_generations_and_clear_makes_a_new_one(tmp_path):
    rng = np.random.default_rng(16)
    first = make(tmp_path / "d", "direct", on_start="reattach", seed_id=bytes(range(16)))
    assert first.store_id == bytes(range(16)).hex()
    e = first.reserve("r", 3)
    data = pages(rng, 3)
    first.write(e, data)
    first.commit("r", e)
    later = first.reserve("s", 1)
    first.close()
    again = make(tmp_path / "d", "direct", on_start="reattach", seed_id=bytes(16))
    assert again.store_id == first.store_id  # reattach keeps the identity
    ext, _ = again.reattached()["r"]
    assert ext.generation == e.generation
    out = torch.empty_like(data)
    again.read(ext, out)
    assert torch.equal(out, data)
    assert again.reserve("t", 1).generation > later.generation  # no generation is reused
    again.close()
    cleared = make(tmp_path / "d", "direct", seed_id=bytes([9] * 16))
    assert cleared.store_id == bytes([9] * 16).hex()
    cleared.close()


def test_large_pages_keep_page_aligned_slots_and_their_binding(tmp_path):
    rng = np.random.default_rng(17)
    shape = (65536,)  # 256 KiB float32 pages: slots get a 4 KiB prefix
    cfg = DiskConfig(path=tmp_path / "big", capacity_bytes=4 * 65536 * 4)
    s = DiskPageStore(cfg, shape, torch.float32)
    slots = s._backend.slots
    assert slots.prefix == 4096 and slots.payload_offset(1) % 4096 == 0
    a, b = s.reserve("a", 2), s.reserve("b", 2)
    da = torch.from_numpy(rng.standard_normal((2, *shape)).astype(np.float32))
    db = torch.from_numpy(rng.standard_normal((2, *shape)).astype(np.float32))
    s.write(a, da)
    s.write(b, db)
    out = torch.empty_like(da)
    s.read(a, out)
    assert torch.equal(out, da)
    raw = Slots(s, None)
    ra, rb = raw.get(a.chunks[1]), raw.get(b.chunks[0])
    raw.put(a.chunks[1], rb)
    raw.put(b.chunks[0], ra)
    read_fails(s, a, 2)
    read_fails(s, b, 2)
    s.close()


def test_zarr_data_moved_under_an_intact_binding_record_is_refused(tmp_path):
    """On the zarr path a chunk's pages and its binding record are separate objects: pages
    of another chunk put under this chunk's (intact, correctly bound) record are refused by
    the page checksum the record vouches for, and served again once put back."""
    rng = np.random.default_rng(14)
    store, raw = setup(tmp_path, "zarr-memory")
    a, b = store.reserve("a", PPC), store.reserve("b", PPC)
    da, db = pages(rng, PPC), pages(rng, PPC)
    store.write(a, da)
    store.write(b, db)
    mem = raw.memory
    ka, kb = f"c/{a.chunks[0]}/0", f"c/{b.chunks[0]}/0"
    data_a, data_b = mem[ka], mem[kb]
    mem[ka], mem[kb] = data_b, data_a  # the pages swap; each binding record stays put
    assert "not the ones its binding record vouches for" in read_fails(store, a, PPC)
    read_fails(store, b, PPC)
    mem[ka], mem[kb] = data_a, data_b  # put back: served again, so the refusal was the pages
    out = torch.empty_like(da)
    store.read(a, out)
    assert torch.equal(out, da)
    store.check_integrity()
    store.close()
