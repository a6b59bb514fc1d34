"""The disk tier's fast path keeps every check.

A direct write now sends a chunk's binding block, header, payload and crc32c in one
``pwritev`` (it used to write the block after the chunk), the checksum runs on the fastest
crc32c installed, and a read copies its scratch buffer into ``out`` with one ``memmove``.
Pages here are larger than ``PIECE_BYTES``, so a chunk is read in more than one piece and
every piece's bytes are under test: a flipped byte in any piece or in the stored crc32c,
a torn write (a block of one write over the payload of another), a chunk moved to another
slot and a damaged header are each refused with ``out`` left as it was; the same bytes put
back read fine (the control: the refusal came from the damage)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tiering.disk import DiskConfig, DiskCorruptionError, DiskIOError, DiskPageStore
from tiering.disk.slotfile import PIECE_BYTES, SlotFileStore
from tiering.disk.slotio import _IOV_MAX, _pread_all, _pwrite_all
from tiering.disk.store_io import _copy_bytes

PAGE_BYTES = PIECE_BYTES + PIECE_BYTES // 2  # two pieces a page: a whole one and a half
PAGE_SHAPE = (PAGE_BYTES // 4,)  # float32
N = 3
BLOCK_AND_HEADER = 40 + 16  # the binding block, then the slot header, before the payload


def make(tmp_path: Path) -> DiskPageStore:
    cfg = DiskConfig(path=tmp_path / "d", capacity_bytes=2 * N * PAGE_BYTES,
                     chunk_bytes=2 * PAGE_BYTES)
    store = DiskPageStore(cfg, PAGE_SHAPE, torch.float32, fingerprint="fast")
    assert store.direct_io
    return store


def random_pages(rng: np.random.Generator, n: int = N) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((n, *PAGE_SHAPE)).astype(np.float32))


def slot_bytes(store: DiskPageStore, slot: int) -> tuple[int, int]:
    """(offset, length) of a slot's block, header, payload and crc32c in the slot file."""
    payload = store.chunk_offset(slot)
    assert payload is not None
    return payload - BLOCK_AND_HEADER, BLOCK_AND_HEADER + PAGE_BYTES + 4


def peek(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def refused_and_untouched(store: DiskPageStore, extent, rng, exc_type=DiskCorruptionError):
    out = torch.from_numpy(rng.standard_normal((N, *PAGE_SHAPE)).astype(np.float32))
    before = out.clone()
    with pytest.raises(exc_type) as info:
        store.read(extent, out)
    assert torch.equal(out, before), "a failed read changed the caller's out"
    store.check_integrity()
    return info.value


def reads_back(store: DiskPageStore, extent, data: torch.Tensor) -> None:
    out = torch.zeros_like(data)
    store.read(extent, out)
    assert torch.equal(out, data)


# where in a page a flipped byte lands: first piece, second piece, its last byte, the crc32c
@pytest.mark.parametrize("where", [17, PIECE_BYTES + 3, PAGE_BYTES - 1, PAGE_BYTES + 2])
def test_a_flipped_byte_in_any_piece_or_the_crc_is_refused(tmp_path, where):
    rng = np.random.default_rng(where % 1000)
    store = make(tmp_path)
    extent = store.reserve("a", N)
    data = random_pages(rng)
    store.write(extent, data)
    reads_back(store, extent, data)
    path = store._backend.slots.slot_path
    at = store.chunk_offset(extent.chunks[1]) + where
    good = peek(path, at, 1)
    poke(path, at, bytes([good[0] ^ 0x21]))
    err = refused_and_untouched(store, extent, rng)
    assert "crc32c" in str(err)
    poke(path, at, good)
    reads_back(store, extent, data)  # the control
    store.close()


def test_a_torn_write_is_refused(tmp_path):
    """The block of a second write over the payload of the first (a write torn between
    them) vouches for bytes the slot does not hold."""
    rng = np.random.default_rng(11)
    store = make(tmp_path)
    extent = store.reserve("a", N)
    first, second = random_pages(rng), random_pages(rng)
    path = store._backend.slots.slot_path
    offset, length = slot_bytes(store, extent.chunks[0])
    store.write(extent, first)
    old = peek(path, offset, length)
    store.write(extent, second)
    reads_back(store, extent, second)
    poke(path, offset + BLOCK_AND_HEADER, old[BLOCK_AND_HEADER:])  # old payload and crc only
    err = refused_and_untouched(store, extent, rng)
    assert "bound to" in str(err)
    poke(path, offset, old[:BLOCK_AND_HEADER])  # the control: the first write, whole
    expected = second.clone()
    expected[0] = first[0]
    reads_back(store, extent, expected)
    store.close()


def test_a_chunk_moved_to_another_slot_is_refused(tmp_path):
    rng = np.random.default_rng(12)
    store = make(tmp_path)
    a, b = store.reserve("a", N), store.reserve("b", N)
    data_a, data_b = random_pages(rng), random_pages(rng)
    store.write(a, data_a)
    store.write(b, data_b)
    path = store._backend.slots.slot_path
    src, length = slot_bytes(store, b.chunks[2])
    dst, _ = slot_bytes(store, a.chunks[2])
    kept = peek(path, dst, length)
    poke(path, dst, peek(path, src, length))  # b's chunk, intact, in a's slot
    err = refused_and_untouched(store, a, rng)
    assert "bound to" in str(err)
    reads_back(store, b, data_b)  # the original is still good where it belongs
    poke(path, dst, kept)
    reads_back(store, a, data_a)  # the control
    store.close()


def test_a_damaged_header_is_refused(tmp_path):
    rng = np.random.default_rng(13)
    store = make(tmp_path)
    extent = store.reserve("a", N)
    data = random_pages(rng)
    store.write(extent, data)
    path = store._backend.slots.slot_path
    header = store.chunk_offset(extent.chunks[2]) - 16
    good = peek(path, header, 16)
    poke(path, header + 8, (PAGE_BYTES + 8).to_bytes(8, "little"))  # a wrong length
    assert "encoded bytes" in str(refused_and_untouched(store, extent, rng))
    poke(path, header, bytes(8))  # no magic: the chunk is missing
    assert refused_and_untouched(store, extent, rng, DiskIOError).errno == errno.ENODATA
    poke(path, header, good)
    reads_back(store, extent, data)  # the control
    store.close()


def test_one_write_call_sends_block_and_chunk_together(tmp_path, monkeypatch):
    """What ``write_chunk`` hands the kernel: one pwritev starting at the binding block."""
    store = SlotFileStore(tmp_path / "s", num_slots=2, slot_capacity=PAGE_BYTES + 4)
    store.open_sync()
    calls: list[tuple[int, int]] = []
    real = os.pwritev

    def spy(fd, buffers, offset):
        calls.append((offset, sum(memoryview(b).nbytes for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", spy)
    data = np.random.default_rng(14).integers(0, 256, PAGE_BYTES, dtype=np.uint8)
    binding = bytes(range(36))
    store.write_chunk(1, data, 0, binding)
    assert calls == [(store.payload_offset(1) - BLOCK_AND_HEADER, BLOCK_AND_HEADER + PAGE_BYTES + 4)]
    out = np.zeros_like(data)
    store.read_chunk(1, out, 0, binding)
    assert np.array_equal(out, data)
    store.close()


def test_positional_io_moves_more_buffers_than_one_call_takes(tmp_path):
    rng = np.random.default_rng(15)
    parts = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1, 64, 1500)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError):  # the negative control: the kernel refuses so many
            os.pwritev(fd, parts, 0)
        assert len(parts) > _IOV_MAX
        end = _pwrite_all(fd, parts, 0)
        assert end == sum(p.nbytes for p in parts)
        back = [np.zeros_like(p) for p in parts]
        assert _pread_all(fd, back, 0) == end
        assert all(np.array_equal(a, b) for a, b in zip(parts, back, strict=True))
    finally:
        os.close(fd)


def test_the_scratch_copy_refuses_buffers_that_do_not_match():
    src = np.arange(64, dtype=np.uint8)
    dest = np.zeros(64, dtype=np.uint8)
    _copy_bytes(dest, src)
    assert np.array_equal(dest, src)
    with pytest.raises(ValueError, match="same size"):
        _copy_bytes(np.zeros(63, dtype=np.uint8), src)
    with pytest.raises(ValueError, match="contiguous"):
        _copy_bytes(np.zeros(128, dtype=np.uint8)[::2], src)


def test_a_read_takes_every_slot_once_and_stops_at_the_first_failure(tmp_path, monkeypatch):
    """The direct read's jobs share one cursor over the range: each slot is read exactly
    once; after a bad chunk no job starts more than one slot past it per thread."""
    rng = np.random.default_rng(16)
    cfg = DiskConfig(path=tmp_path / "d", capacity_bytes=64 * 4096, chunk_bytes=4 * 4096,
                     io_threads=2)
    store = DiskPageStore(cfg, (1024,), torch.float32, fingerprint="cursor")
    extent = store.reserve("a", 40)
    data = torch.from_numpy(rng.standard_normal((40, 1024)).astype(np.float32))
    store.write(extent, data)
    direct = store._backend.direct
    started: list[int] = []
    real = direct.read_chunk

    def spy(slot, out, pad=0, binding=None, **kw):
        started.append(slot)
        return real(slot, out, pad, binding, **kw)

    monkeypatch.setattr(direct, "read_chunk", spy)
    out = torch.zeros_like(data)
    store.read(extent, out)
    assert torch.equal(out, data)
    assert sorted(started) == sorted(extent.chunks)  # every slot, once
    bad = 5
    at = store.chunk_offset(extent.chunks[bad]) + 9
    good = peek(direct.slot_path, at, 1)
    poke(direct.slot_path, at, bytes([good[0] ^ 0x40]))
    started.clear()
    before = out.clone()
    with pytest.raises(DiskCorruptionError):
        store.read(extent, out)
    assert torch.equal(out, before)
    assert extent.chunks[bad] in started
    assert set(started) <= set(extent.chunks[: bad + 1 + cfg.io_threads])
    assert len(started) == len(set(started))
    store.close()
